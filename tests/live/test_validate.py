"""``metronome-probe validate`` on ``tiny``: the cliff unbounded, no cliff under vLLM's window or the sinks plugin;
and ``calibrate --kv sinks`` through the plugin.

Only pool facts and silence are asserted. Latencies and their errors against the simulator are written to
summary.json and reported in docs/live.md; they depend on what else runs on the cores, so no test
asserts them.
"""

import json

import pandas as pd
import pytest

from metronome.kv_policy import KVPolicy

SESSIONS, BLOCKS, WINDOW, SINKS = 6, 96, 128, 32


@pytest.fixture(scope="module")
def validated(tmp_path_factory, probe):
    out = tmp_path_factory.mktemp("validate") / "v"
    res = probe("validate", "--model", "tiny", "--out", str(out), "--num-blocks", str(BLOCKS), "--sessions",
                str(SESSIONS), "--horizon", "6", "--window", str(WINDOW), "--sinks", str(SINKS), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res, json.loads((out / "summary.json").read_text())


def test_unbounded_hits_the_cliff(validated):
    out, _, summary = validated
    u = summary["policies"]["unbounded"]
    assert u["preemptions"]["live"] > 0 and u["silent_frame_fraction"]["live"] > 0
    assert u["t_sat_observed_s"] is not None and u["t_sat_predicted_s"] is not None
    assert u["cliff_live"] and summary["cliff"]["unbounded"]
    steps = pd.read_parquet(out / "unbounded" / "steps.parquet")
    assert steps.used_blocks.max() >= BLOCKS - 1 - SESSIONS  # the pool ran (nearly) dry before the preemption
    frames = pd.read_parquet(out / "unbounded" / "frames.parquet")
    assert frames[frames.state != "running"].silent.all()  # every frame of a waiting session is silent


@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_bounded_policies_do_not(validated, policy):
    out, _, summary = validated
    p = summary["policies"][policy]
    assert p["preemptions"]["live"] == 0 and p["silent_frame_fraction"]["live"] == 0
    assert p["t_sat_observed_s"] is None and not p["cliff_live"]
    kv = KVPolicy.window(32, WINDOW) if policy == "window" else KVPolicy.sinks(32, SINKS, WINDOW)
    # bounded blocks: each session within its policy's bound (+1: vLLM frees a block one step late)
    assert p["peak_used_blocks"]["live"] <= SESSIONS * (kv.max_resident_blocks + 1)
    steps = pd.read_parquet(out / policy / "steps.parquet")
    late = steps[steps.t_s > 3.0]  # long past where the unbounded pool ran dry, still bounded
    assert len(late) and late.used_blocks.max() <= SESSIONS * (kv.max_resident_blocks + 1)


def test_outputs_and_table(validated):
    out, res, summary = validated
    for policy in ("unbounded", "window", "sinks"):
        for table in ("frames", "steps", "sessions", "events"):
            if table != "events" or policy == "unbounded":
                assert (out / policy / f"{table}.parquet").is_file(), (policy, table)
        assert (out / policy / "sim" / "summary.json").is_file()
        p = summary["policies"][policy]
        for k in ("p50_frame_latency_s", "p99_frame_latency_s"):
            assert set(p[k]) == {"live", "simulated", "relative_error"} and p[k]["live"] > 0
        assert set(p["silent_frame_fraction"]) == {"live", "simulated"}
    assert (out / "calibration" / "calibration.json").is_file()
    assert summary["policies"]["unbounded"]["cliff_simulated"]  # the simulator sees the same cliff
    assert "t_sat live" in res.stdout and "unbounded" in res.stdout
    # the report's reader accepts it
    from metronome.report.live import read_live

    assert set(read_live(out)["policies"]) == {"unbounded", "window", "sinks"}


@pytest.mark.parametrize("args, message", [
    (["--num-blocks", "0"], "--num-blocks"),
    (["--window", "16"], "under one block"),
    (["--sinks", "200"], "fewer than the window"),
    (["--sessions", "0"], "--sessions"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_one_line_and_exit_2(probe, tmp_path, args, message):
    base = {"--model": "tiny", "--out": str(tmp_path / "v")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    res = probe("validate", *[x for kv in base.items() for x in kv], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and message in res.stderr


def test_calibrate_sinks_through_the_plugin(probe, tmp_path):
    out = tmp_path / "sinks"
    res = probe("calibrate", "--model", "tiny", "--out", str(out), "--kv", "sinks", "--sinks", str(SINKS),
                "--window", str(WINDOW), "--num-blocks", "96", "--max-model-len", "2048",
                "--grid-sessions", "1,4", "--grid-context", "128,512", "--decode-steps", "4",
                "--fill-seconds", "1", "--fill-sessions", "2", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((out / "measurements.json").read_text())
    g = m["kv_growth"]
    policy = KVPolicy.sinks(32, SINKS, WINDOW)
    assert g["policy"] == policy.describe()
    # the engine's blocks equal KVPolicy.sinks at every step, up to vLLM's one-step freeing lag
    assert g["consistent"] and g["excess_min"] == 0 and g["excess_max"] <= 1
    assert g["final_tokens"] > 4 * WINDOW  # it grew far past the window ...
    assert g["peak_blocks"] <= policy.max_resident_blocks + 1  # ... within the bound
    assert m["pool"]["kv_spec"] == "SinkWindowSpec"
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["name"].endswith(f"-sinks{SINKS}-window{WINDOW}")
    assert any("sink+window" in n for n in cal["provenance"]["notes"])
    assert f"--sinks {SINKS}" in cal["provenance"]["source"]
