"""``metronome-probe calibrate`` times the frame pipeline's other stages and writes them into the calibration as
measured terms of the stack the user names (issue 47, item 7). No GPU: the pricing from hand-made timings, the
real stage timers in their small CPU shapes, and the CLI's refusals."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from metronome.calibration import Provenance, StepLatencyModel, load_file, load_preset
from metronome.errors import MetronomeError
from metronome.probe import calibrate
from metronome.probe.stage_timers import stage_terms

WHERE = {"device": "Fake GPU 9000", "driver": "580.1", "torch": "9.9.9+cu130", "cuda": "13.0",
         "measured_at": "2026-12-05T00:00:00+00:00", "dtype": "bfloat16", "shapes": "full"}


def _rec(units_per_s, key, fit, lo, hi):
    """A stage record with one timed mode: fit (per_launch_s, per_session_s) and its range's lows and highs."""
    return {"unit": "one unit", "units_per_s": units_per_s, "modes": {key: {
        "fit": {"per_launch_s": fit[0], "per_session_s": fit[1], "fit_max_abs_rel_error": 0.01},
        "range": {"per_launch_s": [lo[0], hi[0]], "per_session_s": [lo[1], hi[1]]}}}}


def _terms(terms):
    return {t.name: t for t in terms}


def test_moshi_batched_stages_fold_into_the_step_as_by_hand():
    """Moshi's stages (duty 1) batched with graphs, for a stream of 4 steps every 0.16 s: 12.5 units/s x 0.16 s / 4
    = 0.5 units a step. The Mimi stage is two timers summed; a negative fit part is priced 0; a range that misses
    the value is widened to it."""
    timings = {**WHERE, "models": {"moshi-7b": {
        "pipeline": {"depformer": ["depformer"], "Mimi encoder + decoder": ["mimi_encoder", "mimi_decoder"]},
        "stages": {
            "depformer": _rec(12.5, "batched/graphs", (2e-3, 8e-6), (1.9e-3, 7e-6), (2.2e-3, 9e-6)),
            "mimi_encoder": _rec(12.5, "batched/graphs", (1e-3, -2e-6), (1.1e-3, -3e-6), (1.2e-3, 1e-6)),
            "mimi_decoder": _rec(12.5, "batched/graphs", (3e-3, 4e-6), (3.0e-3, 3e-6), (3.3e-3, 5e-6)),
        }}}}
    t = _terms(stage_terms("moshi-7b", "batched-graphs", timings, 0.16, 4))
    label = "batched across the step's sessions, CUDA graphs"
    dep_l, dep_s = t[f"depformer: per launch ({label})"], t[f"depformer: per session ({label})"]
    mimi_l = t[f"Mimi encoder + decoder: per launch ({label})"]
    mimi_s = t[f"Mimi encoder + decoder: per session ({label})"]
    assert len(t) == 4 and {x.basis for x in t.values()} == {"measured"}
    assert (dep_l.coefficient, dep_s.coefficient) == ("base_s", "per_seq_s")
    # depformer: 0.5 x 2 ms; 0.5 x 8 us; ranges 0.5 x (1.9..2.2 ms), 0.5 x (7..9 us)
    assert (dep_l.value, dep_l.low, dep_l.high) == pytest.approx((1e-3, 0.95e-3, 1.1e-3), rel=1e-12)
    assert (dep_s.value, dep_s.low, dep_s.high) == pytest.approx((4e-6, 3.5e-6, 4.5e-6), rel=1e-12)
    # Mimi launch: 0.5 x (1 + 3 ms) = 2 ms; low 0.5 x (1.1 + 3.0) = 2.05 ms, above it: widened to 2 ms;
    # high 0.5 x (1.2 + 3.3) = 2.25 ms
    assert (mimi_l.value, mimi_l.low, mimi_l.high) == pytest.approx((2e-3, 2e-3, 2.25e-3), rel=1e-12)
    # Mimi per session: 0.5 x (0 + 4 us) = 2 us; low 0.5 x (0 + 3 us) = 1.5 us; high 0.5 x (1 + 5 us) = 3 us
    assert (mimi_s.value, mimi_s.low, mimi_s.high) == pytest.approx((2e-6, 1.5e-6, 3e-6), rel=1e-12)
    for x in t.values():  # the source names the device, PyTorch, the date and the mode
        assert all(w in x.source for w in ("Fake GPU 9000", "torch 9.9.9+cu130", "2026-12-05", "batched/graphs"))


def test_the_speech_stages_pay_their_duty_per_session_and_the_launch_whole():
    """Qwen2.5-Omni in vLLM-Omni's stack (batched, eager), on its own stream (4 steps a 2 s frame): the talker runs
    50 units/s, so 25 a step; its launch is charged whole (25 x 0.1 ms), its per-session part for half the talk
    (25 x 0.5 x 20 us). The audio encoder (duty 1): 0.5 units/s, 0.25 a step."""
    key = "batched/eager"
    timings = {**WHERE, "models": {"qwen2.5-omni-7b": {"pipeline": {}, "stages": {
        "audio_encoder": _rec(0.5, key, (4e-3, 1e-3), (4e-3, 1e-3), (4e-3, 1e-3)),
        "talker": _rec(50.0, key, (1e-4, 2e-5), (1e-4, 2e-5), (1e-4, 2e-5)),
        "token2wav": _rec(1.0, key, (5e-3, 1e-3), (5e-3, 1e-3), (5e-3, 1e-3)),
    }}}}
    t = _terms(stage_terms("qwen2.5-omni-7b", "vllm-omni", timings, 2.0, 4))
    label = "batched across the step's sessions, eager"
    assert t[f"talker: per launch ({label})"].value == pytest.approx(2.5e-3, rel=1e-12)
    assert t[f"talker: per session ({label})"].value == pytest.approx(2.5e-4, rel=1e-12)
    assert t[f"audio encoder: per launch ({label})"].value == pytest.approx(1e-3, rel=1e-12)
    assert t[f"audio encoder: per session ({label})"].value == pytest.approx(2.5e-4, rel=1e-12)
    # token2wav: 1 unit/s -> 0.5 a step; 0.5 x 5 ms; 0.5 x 0.5 x 1 ms
    assert t[f"token2wav: per launch ({label})"].value == pytest.approx(2.5e-3, rel=1e-12)
    assert t[f"token2wav: per session ({label})"].value == pytest.approx(2.5e-4, rel=1e-12)


def test_a_mode_the_timings_lack_is_refused_by_name():
    timings = {**WHERE, "models": {"moshi-7b": {"pipeline": {}, "stages": {
        name: _rec(12.5, "batched/eager", (1e-3, 1e-6), (1e-3, 1e-6), (1e-3, 1e-6))
        for name in ("depformer", "mimi_encoder", "mimi_decoder")}}}}
    with pytest.raises(ValueError, match="depformer: mode per_session/eager was not timed"):
        stage_terms("moshi-7b", "vllm-omni-duplex", timings, 0.08, 1)


def _measured_moshi():
    """A measured calibration as calibrate builds one before its stages: a fitted step model, no terms."""
    fit = StepLatencyModel(base_s=5e-3, per_seq_s=2e-5, per_context_token_s=1e-8, per_new_token_s=3e-6,
                           fitted_range={"batch": (1, 32)})
    return replace(load_preset("moshi-7b-h200"), name="measured-moshi-cuda", step_latency=fit,
                   provenance=Provenance("measured", "metronome-probe calibrate --model moshi", "a GPU", "2026-12-05"))


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """Calibrate's stages phase on a CPU: Moshi's real stage timers in small shapes, stack vllm-omni-duplex."""
    out = tmp_path_factory.mktemp("cal")
    opts = calibrate.CalibrateOptions(model="moshi", out=str(out), stack="vllm-omni-duplex", time_stages=True)
    measurements = {}
    cal = calibrate._measure_stages(opts, _measured_moshi(), calibrate._Run(opts, out), "cpu", measurements)
    path = out / "calibration.json"
    path.write_text(cal.to_json())
    return opts, out, cal, path, measurements


def test_time_stages_writes_measured_stage_terms_that_load(timed):
    opts, out, cal, path, measurements = timed
    loaded = load_file(path)
    assert loaded.stack == "vllm-omni-duplex" and loaded.stacks == ("vllm-omni-duplex",)  # graphs: not on a CPU
    stage = loaded.stack_pricing("vllm-omni-duplex").terms
    assert [t.name.split(":")[0] for t in stage] == ["depformer"] * 2 + ["Mimi encoder + decoder"] * 2
    doc = json.loads((out / "stages.json").read_text())
    for t in stage:
        assert t.basis == "measured" and t.low <= t.value <= t.high
        assert doc["torch"] in t.source and "per_session/eager" in t.source and doc["measured_at"] in t.source
    # the backbone's fit stays as it was; the stage terms are added to its coefficients
    sl, fit = loaded.step_latency, _measured_moshi().step_latency
    assert sl.base_s == pytest.approx(fit.base_s + sum(t.value for t in stage if t.coefficient == "base_s"))
    assert sl.per_seq_s == pytest.approx(fit.per_seq_s + sum(t.value for t in stage if t.coefficient == "per_seq_s"))
    assert sl.per_seq_s > fit.per_seq_s
    assert (sl.per_context_token_s, sl.per_new_token_s, sl.fitted_range) == (1e-8, 3e-6, {"batch": (1.0, 32.0)})
    assert loaded.backbone_terms[0].name.startswith("backbone step, fitted") and loaded.provenance.kind == "measured"
    assert measurements["stages"]["stack"] == "vllm-omni-duplex" and doc["shapes"] == "small"
    assert any(n.startswith("stages: ") and "small shapes" in n for n in loaded.provenance.notes)


def test_the_simulator_runs_on_the_calibration_with_stages(timed):
    cal, path = timed[2], timed[3]
    res = subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", "capacity", "--calibration", str(path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"})
    assert res.returncode == 0, res.stderr
    assert "stack vllm-omni-duplex (the default)" in res.stdout
    # N sessions in a step cost at least N x per_seq_s, which now holds the stages' (milliseconds a session even in
    # small shapes; the fit's own is 20 us, which would let the memory ceiling, 1,024 sessions, bind)
    n = int(re.search(r"N\* = (\d+) sessions", res.stdout).group(1))
    target = float(re.search(r"target p99 <= ([\d.]+) ms", res.stdout).group(1)) / 1e3
    # (not N <= target / per_seq_s exactly: with each session on its own phase a step holds only the sessions due,
    # so N* can pass that by a little; twice it is still far below the memory ceiling the fit alone would leave)
    assert 0 < n <= 2 * target / cal.step_latency.per_seq_s < 1024
    # only the stage terms carry a range here (the fit's terms are exact): a term that moves N* is one of them
    moved = re.search(r'moved most by "([^"]+)"', res.stdout)
    assert moved is None or moved.group(1) in {t.name for t in cal.stack_pricing("vllm-omni-duplex").terms}


def test_a_resumed_run_prices_the_stages_it_already_timed(timed, monkeypatch):
    opts, out, cal, _, _ = timed

    def never(*a, **kw):
        raise AssertionError("timed again")

    monkeypatch.setattr(calibrate, "time_stages", never)
    again = replace(opts, resume=True)
    cal2 = calibrate._measure_stages(again, _measured_moshi(), calibrate._Run(again, out), "cpu", {})
    assert cal2.step_latency == cal.step_latency


def test_the_default_stack_with_cuda_graphs_is_refused_on_a_cpu():
    with pytest.raises(MetronomeError, match="choose --stack vllm-omni-duplex"):
        calibrate.stage_choice("moshi", "cpu", None, True)
    with pytest.raises(MetronomeError, match="no stack of --model minicpm-o runs all eager"):
        calibrate.stage_choice("minicpm-o", "cpu", None, True)
    assert calibrate.stage_choice("moshi", "cuda", None, False) == (True, "batched-graphs")  # CUDA: always
    assert calibrate.stage_choice("moshi", "cpu", None, False) == (False, None)  # a CPU: only when asked
    assert calibrate.stage_choice("qwen3-omni", "cpu", "vllm-omni", True) == (True, "vllm-omni")


@pytest.mark.parametrize("model, device, stack, flag, needle", [
    ("tiny", "cuda", None, True, "--time-stages: --model tiny has no pipeline stage besides the backbone"),
    ("smollm2", "cpu", "batched-graphs", False, "--stack: --model smollm2 has no pipeline stage"),
    ("moshi", "cuda", "nope", False, "--stack nope: --model moshi has no such stack (stacks: batched-graphs, "
                                     "vllm-omni-duplex)"),
    ("moshi", "cpu", "vllm-omni-duplex", False, "on a CPU add --time-stages"),
])
def test_choices_that_cannot_be_kept_are_one_line(model, device, stack, flag, needle):
    with pytest.raises(MetronomeError, match=None) as exc:
        calibrate.stage_choice(model, device, stack, flag)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_the_cli_refuses_time_stages_on_tiny_in_one_line_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "metronome.cli.probe_cli", "calibrate", "--model", "tiny",
                          "--device", "cpu", "--time-stages", "--out", str(tmp_path / "cal")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == ("metronome-probe: error: --time-stages: --model tiny has no pipeline stage "
                                  "besides the backbone vLLM serves, so there is nothing to time")
    assert not (tmp_path / "cal").exists()
