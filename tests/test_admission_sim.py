"""Admission in the loop: AIMD finds N* when state is bounded, and over-admits into the wall when not."""

import json

import numpy as np
import pandas as pd
import pytest

from sim_cli_helpers import run_cli
from metronome.kv_policy import KVPolicy
from metronome.sim.capacity import capacity
from metronome.sim.scenario import make_scenario, run
from fixed_engine import fast_moshi, write_fast_moshi

# Moshi on an H200 (the fixed engine of fixed_engine.py) with a 40 ms frame budget, served in lockstep (aligned phases, Moshi's own batched server):
# the deadline binds (N* ≈ 283) before memory (512 sessions). Under independent phases a step batches only
# the frames that arrived, latency stays far below 40 ms and memory binds (test_sim_scenarios covers them).
BOUND = dict(calibration=fast_moshi(), kv="sinks", sinks=16, window=368, deadline=0.04, phases="aligned")
AIMD = {"additive_increase": 5, "decrease_factor": 0.9, "target_fraction": 0.8}
OVERLOAD = dict(arrival_rate=10.0, session_duration="exp:300", horizon=700.0)


@pytest.fixture(scope="module")
def n_star():
    cap = capacity(fast_moshi(), KVPolicy.sinks(16, 16, 368), deadline_s=0.04, phases="aligned")
    assert cap["binding"] == "deadline"
    return cap["n_star"]


@pytest.fixture(scope="module")
def bounded_aimd():
    return run(make_scenario(**BOUND, **OVERLOAD, admission="aimd", aimd_params=AIMD))


def _in_flight(res):
    st = res.steps
    return st.t_s.to_numpy(), (st.running + st.waiting).to_numpy()


def test_capacity_reports_ceiling_n_star_and_which_binds(n_star):
    assert 250 < n_star < 320
    mem = capacity(fast_moshi(), KVPolicy.sinks(16, 16, 368), phases="aligned")  # 80 ms: memory
    assert mem["binding"] == "memory" and mem["n_star"] == mem["memory_ceiling"] == 512
    assert mem["deadline_n_star"] > 512


def test_aimd_converges_to_n_star_with_the_bound(bounded_aimd, n_star):
    t, n = _in_flight(bounded_aimd)
    late = n[t > 300]
    assert abs(late.mean() - n_star) / n_star < 0.10
    assert late.max() < 1.15 * n_star and late.min() > 0.8 * n_star  # stays there
    s = bounded_aimd.summary
    assert not s["collapsed"] and s["deadline_miss_fraction"] < 0.01 and s["silent_frame_fraction"] == 0


def test_the_limit_is_a_sawtooth_whose_trough_over_peak_is_the_decrease_factor(bounded_aimd):
    tr = pd.DataFrame(bounded_aimd.controller_trace)
    tr = tr[tr.t_s > 300]
    cuts = tr[tr.decision == "decrease"]
    assert len(cuts) >= 5
    limits = tr.limit.to_numpy()
    prev = np.concatenate([[limits[0]], limits[:-1]])
    before, after = prev[tr.decision.to_numpy() == "decrease"], limits[tr.decision.to_numpy() == "decrease"]
    ratios = after / before
    assert np.allclose(ratios, 0.9, atol=0.02)
    assert 0.85 <= limits.min() / limits.max() <= 0.95


def test_the_limit_follows_a_rising_then_falling_load(n_star):
    res = run(make_scenario(**BOUND, rate_pattern="200:0.3,200:10,200:0.3", session_duration="exp:100",
                            horizon=600.0, admission="aimd", aimd_params=AIMD))
    t, n = _in_flight(res)
    low, peak, after = n[(t > 100) & (t < 200)], n[(t > 330) & (t < 400)], n[t > 560]
    assert low.mean() < 0.25 * n_star  # demand-limited: 0.3/s x 100 s = 30 sessions
    assert abs(peak.mean() - n_star) / n_star < 0.10  # the limit holds the overload at N*
    assert after.mean() < 0.5 * peak.mean()  # and it follows the load back down
    tr = pd.DataFrame(res.controller_trace)
    assert tr[(tr.t_s > 100) & (tr.t_s < 200)].limit.max() < 2 * n_star  # no runaway growth while app-limited
    assert res.summary["deadline_miss_fraction"] < 0.01


def test_unbounded_the_same_controller_over_admits_into_the_wall():
    res = run(make_scenario(**{**BOUND, "kv": "unbounded"}, **OVERLOAD, admission="aimd", aimd_params=AIMD))
    s = res.summary
    assert s["collapsed"] and s["preemptions"] > 0 and s["silent_frame_fraction"] > 0.05
    # the latency signal stayed under target while the pool filled: the controller admitted past what it holds
    tr = pd.DataFrame(res.controller_trace)
    before = tr[tr.t_s < s["t_sat_observed_s"]]
    assert (before.decision != "decrease").sum() > 0.9 * len(before)
    t, n = _in_flight(res)
    held_at_sat = n[t <= s["t_sat_observed_s"]][-1]
    # what the pool can hold of sessions that old (the oldest ones fill it first): it admitted beyond that
    fm_ceiling_at_sat = 12814 // int(np.ceil(12.5 * s["t_sat_observed_s"] / 16))
    assert held_at_sat > fm_ceiling_at_sat


def test_static_cap_is_never_exceeded():
    res = run(make_scenario(**BOUND, arrival_rate=5.0, session_duration="exp:60", horizon=120.0, admission="static:50"))
    _, n = _in_flight(res)
    assert n.max() == 50 and res.summary["sessions_refused"] > 0


def test_queued_sessions_wait_and_time_out():
    params = {**AIMD, "on_refuse": "queue", "queue_timeout_s": 5.0}
    res = run(make_scenario(**BOUND, arrival_rate=10.0, session_duration="exp:60", horizon=200.0, admission="aimd",
                            aimd_params=params))
    ses = res.sessions
    waited = ses[ses.admitted_s - ses.arrival_s > 0.5]
    assert len(waited) > 0 and (waited.admitted_s - waited.arrival_s <= 5.0 + 1.0).all()
    assert (ses.end_reason == "queue_timeout").sum() > 0


def _cli_args(folder) -> list[str]:
    """BOUND as command-line options, the fixed engine written to a file."""
    cli = {**BOUND, "calibration": write_fast_moshi(folder)}
    return sum(([f"--{k}", str(v)] for k, v in cli.items()), [])


def test_tune_aimd_output_feeds_run(tmp_path):
    out = tmp_path / "tune"
    r = run_cli("tune-aimd", *_cli_args(tmp_path), "--arrival-rate", "10",
                "--session-duration", "exp:300", "--horizon", "200", "--seeds", "1", "--additive-increase", "2,5",
                "--decrease-factor", "0.9", "--target-fraction", "0.8", "--interval", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    best = json.loads((out / "best_aimd.json").read_text())
    assert best["params"]["additive_increase"] in (2.0, 5.0) and best["figures"]["feasible"]
    table = pd.read_csv(out / "tradeoff.csv")
    assert len(table) == 2 and table.goodput_frames_per_s.iloc[0] >= table.goodput_frames_per_s.iloc[1]
    r2 = run_cli("run", *_cli_args(tmp_path), "--arrival-rate", "10",
                 "--session-duration", "exp:300", "--horizon", "60", "--admission", "aimd", "--aimd-params",
                 str(out / "best_aimd.json"), "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["admission"] == "aimd"


@pytest.mark.parametrize("params,needle", [
    ({"decrease_factor": 1.5}, "decrease factor"),
    ({"decrease_factor": 0.0}, "decrease factor"),
    ({"target_fraction": 0.0}, "target"),
    ({"target_fraction": 1.2}, "target"),
    ({"min_limit": 10, "max_limit": 5}, "min"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_aimd_params_are_one_line_errors(tmp_path, params, needle):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(params))
    r = run_cli("run", "--sessions", "5", "--horizon", "5", "--admission", "aimd", "--aimd-params", str(f),
                "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and needle in r.stderr.lower() and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_bad_capacity_target_fraction():
    r = run_cli("capacity", "--kv", "sinks", "--sinks", "16", "--window", "368", "--target-fraction", "1.5")
    assert r.returncode == 2 and "target-fraction" in r.stderr
