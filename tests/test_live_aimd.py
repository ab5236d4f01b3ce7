"""metronome.probe.live_aimd: the live AIMD benchmark's reusable parts, without an engine.

The live half needs vLLM (benchmarks/bench_live_aimd.py runs it); everything the benchmark decides before and after
the live runs (the deadline, the AIMD interval, settled concurrency, the comparison, the verdicts) runs here on a
small-pool Moshi calibration and synthetic live traces.
"""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from metronome.kv_policy import KVPolicy
from metronome.probe import live_aimd as la
from metronome.results import settled_mean

WINDOW = 368
SCENARIO = dict(window=WINDOW, num_blocks=2_000, rate=6.0, duration="exp:20", horizon=40.0, deadline=0.04)


def test_settled_mean_and_rel():
    t = np.arange(10.0)
    n = np.array([0, 0, 0, 0, 0, 4, 6, 4, 6, 5])
    assert settled_mean(t, n, 10.0) == 5.0  # samples at t >= 5 only
    assert settled_mean(t[:3], n[:3], 10.0) is None  # nothing in the second half
    assert la.rel(11.0, 10) == pytest.approx(0.1)
    assert la.rel(None, 10) is None and la.rel(3.0, None) is None and la.rel(3.0, 0) is None


def test_aimd_for_starts_at_half_n_star():
    assert la.aimd_for(la.AIMD, 30)["initial_limit"] == 15
    assert la.aimd_for(la.AIMD, 3)["initial_limit"] == 2
    got = la.aimd_for(la.AIMD, 30, 8.0)
    assert got["interval_s"] == 8.0 and la.AIMD["interval_s"] == 2.5  # a copy: the defaults stay
    assert la.aimd_for(la.AIMD, 30)["interval_s"] == la.AIMD["interval_s"]


def test_verdicts():
    tol = la.TOLERANCE
    assert la.single_run_verdict(0.05, drift=0.02) == "met"
    assert la.single_run_verdict(-0.15, drift=0.02) == "missed"
    assert la.single_run_verdict(0.05, drift=tol + 0.01) == "inconclusive"  # N* moved more than the tolerance
    assert la.single_run_verdict(0.05, drift=None) == "inconclusive"
    assert la.single_run_verdict(None, drift=0.0) == "missed"  # nothing settled
    assert la.repeat_verdict(-0.08) == "met" and la.repeat_verdict(0.2) == "missed" and la.repeat_verdict(None) == "missed"


def test_tune_interval_picks_the_smallest_mean_error(monkeypatch):
    """Closest to N* on average over the seeds, whichever side; each seed's error kept."""
    settled = {1.0: [14.0, 14.0], 2.0: [11.5, 7.5], 4.0: [9.0, 9.0]}  # vs N* = 10: +40%, -5%, -10%
    monkeypatch.setattr(la, "simulated_settled", lambda cal, aimd, *, seeds, **kw: settled[aimd["interval_s"]])
    best, errs = la.tune_interval(None, la.AIMD, 10, intervals=(1.0, 2.0, 4.0), seeds=(1, 2))
    assert best == 2.0
    assert errs[2.0] == pytest.approx([0.15, -0.25]) and errs[1.0] == pytest.approx([0.4, 0.4])


def test_tune_interval_in_the_simulator(small_cal):
    best, errs = la.tune_interval(small_cal, la.AIMD, 40, intervals=(1.0, 5.0), seeds=(1, 2), **SCENARIO)
    assert set(errs) == {1.0, 5.0} and all(len(e) == 2 and all(np.isfinite(e)) for e in errs.values())
    assert best == min(errs, key=lambda i: abs(np.mean(errs[i])))
    # the seeds draw different sessions, the same seed the same ones
    again = la.simulated_settled(small_cal, la.aimd_for(la.AIMD, 40, 1.0), seeds=(1, 2), **SCENARIO)
    assert again == pytest.approx([40 * (1 + e) for e in errs[1.0]])


def test_binding_deadline(small_cal):
    """The first deadline at which the deadline binds before memory: at 80 ms and 40 ms memory binds (N* = the
    ceiling), at 20 ms the deadline does."""
    policy = KVPolicy.window(small_cal.engine.block_size_tokens, WINDOW)
    seen = []
    cap = la.binding_deadline(small_cal, policy, (0.08, 0.04, 0.02), log=seen.append)
    assert cap["deadline_s"] == 0.02 and cap["binding"] == "deadline"
    assert cap["n_star"] <= la.HEADROOM * cap["memory_ceiling"]
    assert len(seen) == 3 and seen[0].startswith("capacity at deadline 80 ms")
    assert la.binding_deadline(small_cal, policy, (0.08,)) is None
    assert la.binding_deadline(small_cal, policy, (0.08,), auto=False) is None  # memory binds: asked for or not
    # at 25 ms the deadline binds, but N* (75) sits too close to the memory ceiling (83) for AIMD's overshoot,
    # unless the deadline was asked for (auto=False)
    assert la.binding_deadline(small_cal, policy, (0.025, 0.02))["deadline_s"] == 0.02
    assert la.binding_deadline(small_cal, policy, (0.025,), auto=False)["deadline_s"] == 0.025


def test_compare_run(small_cal, tmp_path):
    """Live traces as a run folder holds them, beside a simulated run of the same scenario."""
    from metronome.sim import scenario as sc_mod

    horizon = SCENARIO["horizon"]
    t = np.arange(0.0, horizon, 0.5)
    pd.DataFrame({"t_s": t, "sessions": np.where(t < horizon / 2, 3, 12)}).to_parquet(tmp_path / "steps.parquet")
    ct = np.arange(0.0, horizon, 2.5)
    pd.DataFrame({"t_s": ct, "limit": np.where(ct < horizon / 2, 5.0, 14.0), "in_flight": np.where(ct < 20, 3, 12),
                  "decision": ["increase", "decrease"] * (len(ct) // 2)}).to_parquet(tmp_path / "controller.parquet")
    live_summary = {"preemptions": 0, "silent_frame_fraction": 0.0, "p99_frame_latency_s": 0.03,
                    "sessions_planned": 240}
    res = sc_mod.run(la.scenario(small_cal, la.aimd_for(la.AIMD, 40), seed=0, **SCENARIO))

    row = la.compare_run(la.live_trace(tmp_path), live_summary, la.sim_trace(res), res, horizon)
    live, sim = row["live"], row["sim"]
    assert row["horizon_s"] == horizon
    assert live["settled_sessions"] == 12.0 and live["settled_limit"] == 14.0
    assert live["settled_peak_in_flight"] == 12.0 and live["cuts"] == len(ct) // 2
    assert live["p99_frame_latency_s"] == 0.03 and live["sessions_planned"] == 240 and live["p50_frame_latency_s"] is None
    assert sim["settled_sessions"] == settled_mean(*la.sim_admitted(res.steps), horizon)
    assert sim["settled_sessions"] > 0 and sim["preemptions"] == res.summary["preemptions"]
    assert sim["cuts"] == sum(1 for r in res.controller_trace if r["decision"] == "decrease")


def test_run_live_aimd_draws_the_simulated_sessions(monkeypatch, tmp_path):
    """The live run gets the sessions the simulator draws for the seed, and the controller the AIMD asked for."""
    from metronome.probe import live_run

    got = {}

    def fake_run(engine, stream, plans, horizon_s, controller, out_dir, **kw):
        got.update(plans=plans, horizon=horizon_s, controller=controller, out_dir=out_dir, **kw)
        return None, {"preemptions": 0}

    monkeypatch.setattr(live_run, "run", fake_run)
    engine = SimpleNamespace(policy=KVPolicy.window(16, WINDOW))
    aimd = la.aimd_for(la.AIMD, 20, 4.0)
    summary = la.run_live_aimd(engine, None, tmp_path / "window", aimd=aimd, deadline=0.04, rate=2.0,
                               duration="exp:20", horizon=30.0, seed=3, phases="aligned")
    assert got["cap"] == "rebase" and got["deadline_s"] == 0.04 and got["seed"] == 3 and got["horizon"] == 30.0
    assert got["controller"].params.interval_s == 4.0 and got["controller"].params.initial_limit == 10
    assert got["plans"] == live_run.make_plans(*_workload(2.0, "exp:20"), 30.0, 3, phases="aligned")
    assert "load_avg_start" in got["extra"] and "load_avg_end" in summary


def _workload(rate, duration):
    from metronome.workload import Arrivals, Durations

    return Arrivals("poisson", rate_per_s=rate), Durations.parse(duration)
