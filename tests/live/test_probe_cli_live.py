"""The CLI as a user runs it: a killed calibration resumes and completes; bad input is one line and exit 2."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

GRID = ["--grid-sessions", "1,2,4", "--grid-context", "128,256,512,1024", "--decode-steps", "6",
        "--fill-seconds", "2", "--fill-sessions", "2", "--no-progress"]


def _done(out):
    path = out / "done.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in rows if r.get("event") == "done"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, probe):
    """Start a calibration, SIGKILL it after three grid points, then --resume it."""
    out = tmp_path_factory.mktemp("resume") / "tiny"
    args = [sys.executable, "-m", "metronome.cli.probe_cli", "--model", "tiny", "--out", str(out), *GRID]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.time() + 900
    try:
        while sum(r["phase"].startswith("grid") for r in _done(out)) < 3:
            assert proc.poll() is None, "the probe ended before it could be killed"
            assert time.time() < deadline, "the probe measured nothing in 15 minutes"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before_done = _done(out)
    before_grid = (out / "grid.jsonl").read_text().splitlines()
    assert not (out / "calibration.json").exists()
    res = probe("--model", "tiny", "--out", str(out), *GRID, "--resume")
    return out, before_done, before_grid, res


def test_resume_completes_and_keeps_earlier_samples(resumed):
    out, before_done, before_grid, res = resumed
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "calibration.json").is_file()
    after_grid = (out / "grid.jsonl").read_text().splitlines()
    assert after_grid[: len(before_grid) - 1] == before_grid[:-1]  # earlier samples kept (the last may be torn)
    grid = pd.read_parquet(out / "grid.parquet")
    assert set(grid.attempt) == {0, 1}
    done_before = {r["phase"] for r in before_done}
    redone = set(grid[grid.attempt == 1].phase)
    assert not (done_before & redone)  # phases finished before the kill were not measured again
    assert sum(p.startswith("grid") for p in done_before) >= 3
    m = json.loads((out / "measurements.json").read_text())
    assert len(m["grid_points"]) == 12 and "decode N=1 C=128" in m["step_fit"]["per_point_rel_error"]


def test_engine_that_fails_to_start_loses_nothing(resumed, probe):
    out, *_ = resumed
    snapshot = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".jsonl", ".json", ".parquet")
                and p.name not in ("done.jsonl", "probe_config.json")}
    # same options, but vLLM gets no KV memory: the engine cannot start
    res = probe("--model", "tiny", "--out", str(out), *GRID, "--resume", env={"VLLM_CPU_KVCACHE_SPACE": "0"})
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "engine failed to start" in res.stderr
    for name, data in snapshot.items():
        assert (out / name).read_bytes() == data, name


def test_out_dir_with_a_run_needs_resume(resumed, probe):
    out, *_ = resumed
    res = probe("--model", "tiny", "--out", str(out), *GRID)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--resume" in res.stderr


@pytest.mark.parametrize("args, words", [
    (["--model", "no-such-model"], "unknown --model"),
    (["--model", "tiny", "--num-blocks", "0"], "--num-blocks"),
    (["--model", "tiny", "--kv", "window", "--window", "16"], "under one block"),
    (["--model", "tiny", "--kv", "window"], "--window"),
    (["--model", "qwen3-omni"], "needs a GPU host"),
    (["--model", "tiny", "--block-size", "48"], "multiple of 32"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, probe, args, words):
    res = probe(*args, "--out", str(tmp_path / "out"), timeout=600)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and words in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_a_preset_on_a_cpu_host_says_it_needs_a_gpu_and_offers_tiny(tmp_path, probe):
    # (not "--weights dummy --device cpu": the full model's shape then fails on this host's memory)
    res = probe("--model", "qwen3-omni", "--out", str(tmp_path / "o"), timeout=600)
    assert res.returncode == 2 and "needs a GPU host" in res.stderr and "--model tiny" in res.stderr
    assert "--device cpu" not in res.stderr and not (tmp_path / "o").exists()


def test_engine_that_fails_to_start_is_one_line(tmp_path, probe):
    res = probe("--model", "tiny", "--num-blocks", "2", "--out", str(tmp_path / "o"), timeout=900)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "engine failed to start" in res.stderr


def test_run_on_vllms_own_loop_from_the_cli(tmp_path, probe):
    """``metronome-probe run --loop vllm`` as a user types it: vLLM spawns its EngineCore and workers, which import
    the CLI's main module again and numba with it; numba's llvmlite wrapper then broke vLLM's module scan in the
    worker unless ``metronome.compiled`` mends it at import (an engine started from ``python -m metronome.cli.*``
    died in its worker). The run completes and writes its summary."""
    out = tmp_path / "run"
    r = probe("run", "--model", "tiny", "--kv", "sinks", "--sinks", "32", "--window", "128", "--num-blocks", "128",
              "--loop", "vllm", "--arrival-rate", "2", "--session-duration", "3", "--horizon", "5", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["loop"] == "vllm" and s["frames"] > 0 and s["sessions_admitted"] >= 1
