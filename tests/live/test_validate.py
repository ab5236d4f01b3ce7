"""``metronome-probe validate`` on ``tiny``: the cliff unbounded, no cliff under vLLM's window or the sinks plugin;
the simulator's agreement with the live runs (what the README quotes); and ``calibrate --kv sinks`` through the
plugin.

What agrees how well, and what is asserted (README "What works today": "t_sat exact; bounded frame latency
within 10 %", docs/live.md "Measured results"):

* **t_sat** (unbounded) is pool arithmetic: the step the pool ran dry in is asserted exactly against the hand
  value, live and simulated, on any host. Its time (t_sat_observed_s, t_sat_predicted_s) is asserted at the
  hand value and live against simulated within the README's 5 % target when the host was quiet (load under 1);
  a busy host only delays that step, live and as calibrated, so there only "not before the tick" is asserted.
* **Frame latency** (bounded runs) is timing on a shared 2-core host (CI runs it beside the suite's own
  engines): the README's figures are measured by the validate command on a quiet host, not asserted here. The
  test asserts the model is not grossly wrong (the p50 within LATENCY_BAND) in any run whose engine kept up with
  the frame clock (KEPT_UP), and skips, saying why, otherwise.
"""

import json

import pandas as pd
import pytest

from metronome.kv_policy import KVPolicy

SESSIONS, BLOCKS, WINDOW, SINKS = 6, 96, 128, 32

# t_sat by hand: 96 blocks less vLLM's null block = 95 usable, shared by 6 sessions that start together and
# each hold ceil(tokens / 32) blocks. The pool runs dry when each needs its 16th block (6 x 16 = 96 > 95), i.e.
# once a session passes 15 x 32 = 480 tokens in the KV. After frames 0 .. 29 (0.1 s each, 14 tokens in, 2 out) a
# session's KV holds 1 prompt token + 30 x 14 inputs + 59 of its 60 outputs (the last one sampled is written
# with the next frame) = 480 tokens, exactly 15 blocks; the first step of frame 30 adds 15 more and needs the
# 16th block: at that frame's tick, 30 x 0.1 = 3.0 s.
T_SAT_BY_HAND = 3.0
T_SAT_TARGET = 0.05      # README: "t_sat exact" (3.001 s live vs 3.000 s simulated); the target it states is 5 %
QUIET_LOAD = 1.0         # load average under 1 on 2 cores: nothing else held a core for long
# The p50 of the simulator against the live run, within -50 %..+50 %. What it tolerates: the live steps slowed or
# sped by other processes on the 2 cores between the calibration and the run (measured +31 % for sinks at load
# 1.5 while the suite ran; +3..+6 % at load 1.2 alone). What it catches: a step model off by a factor, a lost
# first-step term, the old grid-fitted model (p50 -30..-50 %, docs/live.md) at its worst.
LATENCY_BAND = 0.50
# A burst of another process inside the 6 s run stalls the live engine (measured: load 1.6, live p50 2.9 s, every
# frame late): the band is asserted only if the live run kept up with the frame clock, at most 1 % of its frames
# past the 100 ms deadline (the simulator's p99 is ~15 ms; on a quiet host none is late).
KEPT_UP = 0.01


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
    # every answered frame of a waiting session is silent. Frames still owed when the horizon ends are censored
    # (neither silent nor spoken, as the simulator leaves a run's last frames out): on a busy host the running
    # sessions' last frames finish after the horizon, so the waiting sessions' frames of those ticks are censored
    waiting = frames[(frames.state != "running") & ~frames.censored]
    assert len(waiting) > 0 and waiting.silent.all(), waiting[~waiting.silent].to_string()


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


def _load(policy_row) -> float:
    """The highest load average seen at the start and end of a policy's live run."""
    return max(policy_row["live"]["load_avg_start"], policy_row["live"]["load_avg_end"])


def test_t_sat_live_and_simulated_agree(validated):
    out, _, summary = validated
    u = summary["policies"]["unbounded"]
    t_live, t_sim = u["t_sat_observed_s"], u["t_sat_predicted_s"]
    assert t_live is not None and t_sim is not None, u  # both ran dry (test_unbounded_hits_the_cliff: the cliff)
    # As pool arithmetic (no clock in it, so it holds on a busy host too): live and simulated, the pool ran dry
    # in frame 30's first step, the one taking each session from 480 tokens to 480 + 1 re-fed output + 14
    # inputs = 495, as by hand. Its victim held 495 tokens; the step ran the 5 others, 5 x 495 = 2475 tokens.
    events = pd.read_parquet(out / "unbounded" / "events.parquet")
    first = events[events.event == "preempt"].iloc[0]
    assert first.reason == "pool_dry" and first.history_tokens == 495, events.head().to_string()
    for steps in (pd.read_parquet(out / "unbounded" / "steps.parquet"),
                  pd.read_parquet(out / "unbounded" / "sim" / "steps.parquet")):
        dry = steps[steps.preemptions > 0].iloc[0]
        assert (dry.batch, dry.context_tokens) == (5, 2475), dry.to_string()
    # In time: t_sat is when that step started, live (the wall clock) and simulated (the simulator's clock,
    # its steps priced by the calibration). Neither starts before the frame's tick, 3.0 s (0.05 s: half a
    # frame period, telling tick 3.0 from 2.9). On a busy host both start as late as the engine, live or as
    # calibrated, fell behind the frame clock (measured here at load 4-6: 4.68 s live; 3.38 s simulated), so
    # the README's figures are asserted where they were measured, on a quiet host: the simulator at the tick
    # (a frame's first step starts at its tick when the engine is idle) and live within the README's 5 %.
    assert min(t_live, t_sim) >= T_SAT_BY_HAND - 0.05, u
    if _load(u) < QUIET_LOAD:
        assert t_sim == pytest.approx(T_SAT_BY_HAND, abs=0.05), u
        assert abs(t_sim - t_live) / t_live <= T_SAT_TARGET, u
        assert u["within_target"]["t_sat"] is True  # and validate's own verdict says so
    for policy in ("window", "sinks"):  # no t_sat to compare where the pool never runs dry
        assert summary["policies"][policy]["within_target"]["t_sat"] is None


@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_bounded_frame_latency_agrees(validated, policy):
    _, _, summary = validated
    p = summary["policies"][policy]
    load = _load(p)
    err = {q: (p[f"{q}_frame_latency_s"]["simulated"] - p[f"{q}_frame_latency_s"]["live"])
           / p[f"{q}_frame_latency_s"]["live"] for q in ("p50", "p99")}
    print(f"{policy}: load {load:.2f}, p50 {err['p50']:+.1%}, p99 {err['p99']:+.1%}")  # shown on failure
    missed = p["live"]["deadline_miss_fraction"]
    if not summary["drift"]["valid"]:  # validate's own measure of the host: these latencies are the host's
        pytest.skip(summary["verdict"])
    if missed <= KEPT_UP:
        # A timed comparison on a shared 2-core host (CI runs this beside the suite's own engines), so the
        # README's 10 % is measured by the validate command, not asserted here. What is asserted: the model is
        # not grossly wrong (half or twice the live p50: a step model off by a factor, a lost first-step term,
        # the old grid-fitted model's -50 %), in any run whose engine kept up with the frame clock.
        assert abs(err["p50"]) <= LATENCY_BAND, (err, load, p["p50_frame_latency_s"])
    else:  # said, not passed: nothing about the model can be read off these latencies
        pytest.skip(f"load {load:.1f} on 2 cores during the live run, {missed:.0%} of its frames past the deadline: "
                    f"its frame latencies measure the other processes (p50 {err['p50']:+.0%}, p99 "
                    f"{err['p99']:+.0%} against the simulator)")


def test_the_host_is_measured_before_and_after(validated):
    """validate measures the calibration's smallest and largest grid points on an engine as calibrated, right after
    calibrating and after the live runs (probe/drift.py), prices every run again with the calibration scaled by the
    mean speed over the runs, and past 10 % drift says the comparison is not valid instead of giving a verdict."""
    out, res, summary = validated
    d = summary["drift"]
    ref = {}
    for when in ("before", "after"):
        ref[when] = pd.read_parquet(out / f"drift_{when}.parquet")
        assert set(ref[when].kind) == {"prefill", "decode"} and (ref[when].step_s > 0).all()
        # the calibration's smallest and largest grid points: N 1..8 by C 64..512, where 8 x 512 tokens would take
        # 128 blocks of 32 and the pool has 95 (8 x 256: 64 blocks)
        assert set(ref[when].phase) == {"grid N=1 C=64", "grid N=8 C=256"}
    # The drift by hand, from the raw steps on disk (docs/live.md, "What validate compares", 5): per point and kind,
    # the median step after the runs over the median before; the engine's slow-down is the median of those 4
    # ratios, the drift that less 1. 1e-9: the same float operations in another order.
    ratios = [a.step_s.median() / ref["before"][(ref["before"].phase == phase) & (ref["before"].kind == kind)]
              .step_s.median() for (phase, kind), a in ref["after"].groupby(["phase", "kind"])]
    assert len(ratios) == 4
    slowdown = sorted(ratios)[1:3]  # (the median of 4: the mean of the middle two)
    slowdown = (slowdown[0] + slowdown[1]) / 2
    assert d["drift"] == pytest.approx(slowdown - 1, rel=1e-9, abs=1e-12)
    # the runs are priced at the engine's mean speed over them, the drift taken as steady: halfway between as
    # calibrated (x1) and as measured after (x slowdown)
    assert d["factor"] == pytest.approx((1 + slowdown) / 2, rel=1e-9)
    # README: past +-10 % drift either way the comparison is not valid
    assert d["valid"] == (abs(slowdown - 1) <= 0.10)
    for name, p in summary["policies"].items():
        assert (out / name / "sim-scaled" / "summary.json").exists()
        assert p["p50_frame_latency_s"]["relative_error_scaled"] is not None
        if not d["valid"]:
            assert all(v is None for v in p["within_target"].values())
    assert summary["verdict"] == "valid" if d["valid"] else summary["verdict"].startswith("not valid: the engine ran")
    assert "engine speed after the runs" in res.stdout and f"comparison: {summary['verdict']}" in res.stdout


def test_outputs_and_table(validated):
    out, res, summary = validated
    for policy in ("unbounded", "window", "sinks"):
        for table in ("frames", "steps", "sessions", "events"):
            if table != "events" or policy == "unbounded":
                assert (out / policy / f"{table}.parquet").is_file(), (policy, table)
        assert (out / policy / "sim" / "summary.json").is_file()
        p = summary["policies"][policy]
        for k in ("p50_frame_latency_s", "p99_frame_latency_s"):
            assert set(p[k]) == {"live", "simulated", "relative_error", "simulated_scaled", "relative_error_scaled",
                                 "simulated_over_seeds", "live_within_seed_range"} and p[k]["live"] > 0
            # the simulator's range over draws of its jitter holds its own first draw, the one compared
            rng = p[k]["simulated_over_seeds"]
            assert rng["min"] <= p[k]["simulated"] <= rng["max"] and rng["seeds"] == 20, rng
            assert p[k]["live_within_seed_range"] == (rng["min"] <= p[k]["live"] <= rng["max"])
        assert set(p["silent_frame_fraction"]) == {"live", "simulated"}
    assert (out / "calibration" / "calibration.json").is_file()
    assert summary["policies"]["unbounded"]["cliff_simulated"]  # the simulator sees the same cliff
    assert "t_sat live" in res.stdout and "unbounded" in res.stdout and "p99 sim range ms" in res.stdout
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
    res = probe("validate", *[x for kv in base.items() for x in kv], timeout=600)
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
