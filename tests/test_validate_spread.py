"""validate's simulator spread: the p50 and p99 the simulator gives the validate workload over draws of its step
jitter, the sessions and their phases fixed (``probe/validate.py``'s ``seed_spread``), and the live figure placed in
it (``compare``). No engine: the calibration is the fixed Moshi engine with the step jitter of
``tests/test_step_jitter.py``."""

from __future__ import annotations

import copy
from dataclasses import replace

from fixed_engine import fast_moshi
from test_step_jitter import JITTER

from metronome.probe.validate import ValidateOptions, compare, seed_spread, simulate

SEEDS = 8


def _setup(tmp_path, jitter=JITTER):
    c = fast_moshi()
    cal = replace(c, step_latency=replace(c.step_latency, jitter=jitter))
    # independent phases: a spread that redrew the sessions' phases along with the jitter would move without it
    opts = ValidateOptions(model="tiny", out=str(tmp_path / "v"), block_size=16, window=128, sinks=16,
                           phases="independent", horizon_s=4.0)
    name, policy = opts.policies()[2]
    assert name == "sinks"
    return cal, opts, policy


def test_the_spread_is_the_jitters_alone(tmp_path):
    cal, opts, policy = _setup(tmp_path)
    one = simulate(cal, policy, opts, tmp_path / "sim").summary
    s = seed_spread(cal, policy, opts, SEEDS)
    assert s["seeds"] == SEEDS
    for q in ("p50", "p99"):
        r = s[q]
        assert r["min"] <= one[f"{q}_frame_latency_s"] <= r["max"], (q, r, one[f"{q}_frame_latency_s"])
        assert r["min"] <= r["median"] <= r["max"]
    assert s["p99"]["min"] < s["p99"]["max"], s  # the draws differ: each is the jitter drawn anew
    # without jitter every draw is the same run: the workload and the phases do not move with the draws
    cal0, opts0, policy0 = _setup(tmp_path, jitter=())
    s0 = seed_spread(cal0, policy0, opts0, SEEDS)
    one0 = simulate(cal0, policy0, opts0, tmp_path / "sim0").summary
    for q in ("p50", "p99"):
        assert s0[q]["min"] == s0[q]["max"] == one0[f"{q}_frame_latency_s"], (q, s0[q])


def test_the_live_p99_is_placed_in_the_spread_and_the_verdict_stays_the_errors(tmp_path):
    cal, opts, policy = _setup(tmp_path)
    sim = simulate(cal, policy, opts, tmp_path / "sim")
    s = seed_spread(cal, policy, opts, SEEDS)
    hi = s["p99"]["max"]
    for live_p99, inside in ((hi * 1.5, False), (s["p99"]["median"], True), (s["p99"]["min"] * 0.5, False)):
        live = copy.copy(sim)
        live.summary = {**sim.summary, "p99_frame_latency_s": live_p99}
        row = compare(live, sim, policy, s)["p99_frame_latency_s"]
        assert row["live_within_seed_range"] is inside, (live_p99, s["p99"])
        assert row["simulated_over_seeds"] == {**s["p99"], "seeds": SEEDS}
    # outside the range but within 10 %: the verdict is the relative error's, as before
    live = copy.copy(sim)
    live.summary = {**sim.summary, "p99_frame_latency_s": sim.summary["p99_frame_latency_s"] * 1.05}
    row = compare(live, sim, policy, {"p50": s["p50"], "p99": {"min": 0.0, "median": 0.0, "max": 0.0},
                                      "seeds": SEEDS})
    assert row["p99_frame_latency_s"]["live_within_seed_range"] is False
    assert row["within_target"]["p99"] is True
