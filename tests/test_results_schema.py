"""One results schema (issue 14): a simulated and a live run's summaries share their keys, meanings and units,
every reported percentile is the nearest-rank one, one function draws every workload, and every decision a
controller records is a named one. No vLLM: the live side is ``probe.summary.summarize`` on hand-made rows."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from metronome import results
from metronome.admission import DECISIONS, AIMDController, AIMDParams, make_controller
from metronome.probe import driver as live
from metronome.probe import metrics as live_metrics
from metronome.probe import summary as probe_summary
from metronome.sim import scenario as sim
from metronome.workload import Arrivals, Durations

PERIOD = 0.1  # the hand-made run's frame period and deadline


# ------------------------------------------------------------------------------ the hand-made run, both ways
# Four sessions arrive at t=0: A and B are admitted, C is refused, D waits for blocks. Frames tick every 0.1 s,
# 4 ticks each for A and B. B's frame of tick 0.1 is late (0.15 s); B is preempted by the step that starts at
# 0.18 s (the pool ran dry), so its frames of ticks 0.2 and 0.3 are silent after a preemption, answered with their
# tick's lockstep. D's frame of tick 0.1 is silent while it waits (answered 0.01 s after its tick); D is admitted
# at 0.15 s, and its frame of tick 0.2 is still queued when it departs at 0.4 s: flushed silent then (0.2 s after
# its tick, so late). Four steps, 6 of 9 usable
# blocks at the peak (vLLM's pool: 10 blocks with its null block).
FRAMES = [  # session, frame, tick, latency, tokens, what a silent one is (results.silent_cause)
    ("A", 0, 0.0, 0.02, 2, None), ("B", 0, 0.0, 0.03, 2, None),
    ("A", 1, 0.1, 0.04, 2, None), ("B", 1, 0.1, 0.15, 2, None), ("D", 0, 0.1, 0.01, 0, "waiting"),
    ("A", 2, 0.2, 0.05, 2, None), ("B", 2, 0.2, 0.05, 0, "preempted"), ("D", 1, 0.2, 0.20, 0, "departed"),
    ("A", 3, 0.3, 0.06, 2, None), ("B", 3, 0.3, 0.06, 0, "preempted"),
]
CAUSES = ("preempted", "waiting", "departed")
STEPS = [(0.0, 0.01, 4), (0.05, 0.02, 5), (0.18, 0.03, 6), (0.25, 0.10, 3)]  # start, duration, used blocks
T_PREEMPT = 0.18

# what both summaries must say, computed by hand
EXPECTED = {
    "frames": 10, "silent_frames": 4, "silent_frame_fraction": 0.4, "silent_preempted_fraction": 0.2,
    "silent_waiting_fraction": 0.1, "silent_departed_fraction": 0.1,
    "deadline_miss_fraction": 0.2,  # B's of tick 0.1 and D's flushed one
    # latencies sorted: .01 .02 .03 .04 .05 .05 .06 .06 .15 .20; nearest rank: p50 the 5th, p99 the 10th
    "p50_frame_latency_s": 0.05, "p99_frame_latency_s": 0.20,
    "t_sat_observed_s": T_PREEMPT,
    # ticked from 0.18 on: 5 frames answered, 2 of them silent after a preemption (40% >= 1%); D's flushed one is
    # silent too but does not count
    "collapsed": True,
    "preemptions": 1, "rebases": 0,
    # steps .01 .02 .03 .10: nearest rank p50 = the 2nd (linear interpolation would say .025), p99 = the 4th
    "steps": 4, "p50_step_latency_s": 0.02, "p99_step_latency_s": 0.10,
    "peak_used_blocks": 6, "usable_blocks": 9, "peak_pool_occupancy": round(6 / 9, 6),
    "sessions_offered": 4, "sessions_admitted": 3, "sessions_refused": 1, "tokens_total": 12,
}


def live_rows():
    """The run as the live driver records it (``Driver._record_frame``, ``_step``, ``_end``, ``_event``)."""
    frames = []
    for sid, k, tick, lat, tok, cause in FRAMES:
        silent = tok == 0
        gone = cause == "departed"  # (answered as its session left: never done)
        frames.append({
            "run": "r", "session": sid, "frame": k, "tick_s": tick, "submitted_s": tick, "first_token_s": None,
            "done_s": None if gone else tick + lat, "latency_s": lat, "tokens_expected": 2, "tokens_delivered": tok,
            "tokens_by_deadline": 0 if lat > PERIOD else tok, "silent": silent,
            **{f"silent_{c}": cause == c for c in CAUSES}, "silent_by_deadline": silent,
            "met_deadline": lat <= PERIOD and not gone, "censored": False,
            "state": "waiting" if cause in ("preempted", "waiting") else "running", "period_s": PERIOD,
            "rebased": False})
    frames.append({**frames[-1], "frame": 4, "tick_s": 0.4, "done_s": None, "latency_s": None,  # still due:
                   "censored": True, "tokens_delivered": 0})                                    # not counted
    steps = [{"run": "r", "t_s": t, "t_end_s": t + d, "stalled": False, "step_s": d, "batch": 2, "new_tokens": 2,
              "context_tokens": 100, "raw_context_tokens": 100, "prefill_tokens": 0,
              "preemptions": int(t == T_PREEMPT), "preempted": ["B"] if t == T_PREEMPT else [],
              "engine_preempted": [], "free_blocks": 9 - used, "used_blocks": used, "kv_usage": used / 9,
              "running": 2, "waiting": 0, "paused": 0, "sessions": 2, "sessions_waiting": 0, "sessions_prefill": 0,
              "held_tokens": 100} for t, d, used in STEPS]
    sessions = [
        {"run": "r", "session": "A", "arrival_s": 0.0, "admitted": True, "start_s": 0.0, "end_s": 0.4,
         "reason": "horizon", "frames": 4, "silent_frames": 0, "rebases": 0, "preemptions": 0, "readmissions": 0},
        {"run": "r", "session": "B", "arrival_s": 0.0, "admitted": True, "start_s": 0.0, "end_s": 0.4,
         "reason": "horizon", "frames": 4, "silent_frames": 2, "rebases": 0, "preemptions": 1, "readmissions": 0},
        {"run": "r", "session": "C", "arrival_s": 0.0, "admitted": False, "reason": "refused"},
        {"run": "r", "session": "D", "arrival_s": 0.0, "admitted": True, "start_s": 0.0, "end_s": 0.4,
         "reason": "departed", "frames": 2, "silent_frames": 2, "rebases": 0, "preemptions": 0, "readmissions": 0},
    ]
    events = [{"run": "r", "t_s": T_PREEMPT, "event": "preempt", "session": "B", "rid": "B", "reason": "pool_dry",
               "blocks_freed": 3, "history_tokens": 40}]
    return frames, steps, sessions, events


def sim_tables():
    """The same run as the simulator records it (``sim.recorder`` tables, ``scenario.run``'s sessions table)."""
    frames = pd.DataFrame([{"frame": k, "tick_s": tick, "done_s": tick + lat, "latency_s": lat, "frames": 1,
                            "silent": int(tok == 0), **{f"silent_{c}": int(cause == c) for c in CAUSES},
                            "late": int(lat > PERIOD), "tokens": tok} for sid, k, tick, lat, tok, cause in FRAMES])
    steps = pd.DataFrame([{"t_s": t, "step_s": d, "batch": 2, "new_tokens": 2, "context_tokens": 100,
                           "resident_blocks": used, "free_blocks": 9 - used} for t, d, used in STEPS])
    sessions = pd.DataFrame({
        "session": [0, 1, 2, 3], "arrival_s": [0.0, 0.0, 0.0, 0.0], "admitted_s": [0.0, 0.0, math.nan, 0.15],
        "ended_s": [0.4, 0.4, 0.0, 0.4], "end_reason": ["horizon", "horizon", "refused", "departed"],
        "frames": [4, 4, 0, 2], "silent_frames": [0, 2, 0, 2], "deadline_misses": [0, 1, 0, 1],
        "tokens": [8, 4, 0, 0], "preemptions": [0, 1, 0, 0], "rebases": [0, 0, 0, 0]})
    eng = SimpleNamespace(t_sat=T_PREEMPT, peak_used=6, num_blocks=9)
    sc = sim.make_scenario(sessions=4, horizon=0.4, deadline=PERIOD, num_blocks=2000)
    return sc, eng, steps, frames, sessions


def live_summary():
    frames, steps, sessions, events = live_rows()
    return probe_summary.summarize(frames, steps, sessions, num_blocks=10, events=events)


def sim_summary():
    return sim.summarize(*sim_tables())


# ------------------------------------------------------------------------------------------- 1. the schema
def test_the_hand_made_run_gives_the_same_shared_figures_live_and_simulated():
    ls, ss = live_summary(), sim_summary()
    for key in results.shared_keys():
        assert ls[key] == pytest.approx(EXPECTED[key]) and type(ls[key]) is type(EXPECTED[key]), ("live", key)
        assert ss[key] == pytest.approx(EXPECTED[key]) and type(ss[key]) is type(EXPECTED[key]), ("sim", key)
        assert ls[key] == ss[key], key


def test_each_silent_frame_is_one_thing_and_only_a_preemption_counts_towards_collapse():
    # the rule, case by case: a frame with a token is not silent; one answered as its session departs is flushed
    # (whatever the session was doing); else it waited when it ticked before its session's first admission (NaN:
    # never admitted), and was silent after a preemption when the session had been admitted by its tick
    cause = results.silent_cause
    assert cause(1, True, 0.5, 0.0) == 0 and cause(3, False, 0.5, math.nan) == 0
    assert cause(0, True, 0.5, 0.0) == results.SILENT_DEPARTED
    assert cause(0, True, 0.5, math.nan) == results.SILENT_DEPARTED
    assert cause(0, False, 0.5, math.nan) == results.SILENT_WAITING
    assert cause(0, False, 0.5, 0.6) == results.SILENT_WAITING
    assert cause(0, False, 0.5, 0.5) == results.SILENT_PREEMPTED
    assert cause(0, False, 0.5, 0.1) == results.SILENT_PREEMPTED
    # the hand-made run with B never preempted: its two silent frames flushed at its departure instead. The pool
    # still ran dry at 0.18 and 60% of the frames ticked since are silent, none after a preemption: not collapsed
    frames, steps, sessions, events = live_rows()
    for f in frames:
        if f["session"] == "B" and f["silent"]:
            f.update(silent_preempted=False, silent_departed=True, done_s=None, met_deadline=False)
    ls = probe_summary.summarize(frames, steps, sessions, num_blocks=10, events=events)
    assert ls["silent_frame_fraction"] == 0.4 and ls["silent_preempted_fraction"] == 0.0
    assert ls["silent_departed_fraction"] == 0.3 and ls["t_sat_observed_s"] == T_PREEMPT
    assert ls["collapsed"] is False
    sc, eng, st, fr, se = sim_tables()
    b = fr.silent_preempted.to_numpy() == 1
    fr.loc[b, "silent_preempted"], fr.loc[b, "silent_departed"] = 0, 1
    ss = sim.summarize(sc, eng, st, fr, se)
    assert (ss["silent_preempted_fraction"], ss["silent_departed_fraction"], ss["collapsed"]) == (0.0, 0.3, False)


def test_summaries_of_both_runs_share_the_keys_with_their_units_and_document_the_rest():
    """metronome-sim run's summary (a tiny simulated scenario) and metronome-probe run's (the driver's
    summarize) hold every shared key, of its unit's type; every other key is documented as sim- or live-only."""
    res = sim.run(sim.make_scenario(sessions=20, horizon=5.0, num_blocks=400, seed=3))
    ss, ls = res.summary, live_summary()
    shared = set(results.shared_keys())
    assert results.check_types(ss) == [] and results.check_types(ls) == []
    assert set(ss) - shared <= set(results.SIM_ONLY_KEYS), set(ss) - shared - set(results.SIM_ONLY_KEYS)
    assert set(ls) - shared <= set(results.LIVE_ONLY_KEYS), set(ls) - shared - set(results.LIVE_ONLY_KEYS)
    assert not shared & (set(results.SIM_ONLY_KEYS) | set(results.LIVE_ONLY_KEYS))
    # the shared part keeps its order in both summary.json files
    assert [k for k in ss if k in shared] == [k for k in ls if k in shared] == list(results.shared_keys())
    # the simulated run's figures are what its own tables say
    assert ss["frames"] == int(res.frames.frames.sum()) and ss["steps"] == len(res.steps)
    assert ss["p99_step_latency_s"] == round(results.percentile(res.steps.step_s, 99), 6)
    assert ss["peak_used_blocks"] == int(res.steps.resident_blocks.max())


def test_a_live_run_on_a_fake_engine_has_the_shared_keys_and_steps_stamped_at_their_start():
    """The real driver (virtual time, tests/fake_engine.py): its summary has every shared key of its unit, any
    other key is documented, and a step row's ``t_s`` is when the engine's step began (``t_end_s``: ended)."""
    fake_engine = pytest.importorskip("fake_engine")
    from metronome.calibration import TokenStream

    eng = fake_engine.FakeEngine(num_blocks=12)  # 11 usable blocks: 4 sessions fill it, the driver preempts
    cfg = live.DriverConfig(stream=TokenStream(0.1, 14, 2), horizon_s=3.0)
    plans = [live.SessionPlan(f"s{i}", arrival_s=0.05 * i) for i in range(4)]
    res = live.Driver(eng, cfg, clock=eng.clock, sleep=eng.sleep).run(plans)
    ls = res.summary
    assert results.check_types(ls) == []
    shared = set(results.shared_keys())
    assert set(ls) - shared <= set(results.LIVE_ONLY_KEYS), set(ls) - shared - set(results.LIVE_ONLY_KEYS)
    assert ls["preemptions"] > 0 and ls["t_sat_observed_s"] is not None and ls["usable_blocks"] == 11
    assert ls["peak_used_blocks"] == 11 and ls["peak_pool_occupancy"] == 1.0
    logged = [e for e in eng.log if e["op"] == "step"]
    assert len(logged) == len(res.steps) == ls["steps"] > 10
    t0 = logged[0]["t_start"] - res.steps[0]["t_s"]  # the driver's clock starts at the run's start
    for row, e in zip(res.steps, logged):
        assert row["t_s"] == pytest.approx(e["t_start"] - t0, abs=1e-12)
        assert row["t_end_s"] == pytest.approx(e["t"] - t0, abs=1e-12)
        assert row["t_end_s"] == pytest.approx(row["t_s"] + row["step_s"], abs=1e-12)
    # the live t_sat is the start of a step, as the simulator's is
    assert ls["t_sat_observed_s"] in {round(r["t_s"], 6) for r in res.steps}


def test_the_old_bridged_names_are_gone():
    ls, ss = live_summary(), sim_summary()
    for old in ("frames_total", "sessions_rejected", "p50_step_s"):
        assert old not in ls and old not in ss, old


def test_step_rows_are_stamped_at_their_start_in_both():
    frames, steps, sessions, events = live_rows()
    # the live t_sat is the start of the step that preempted, as the simulator's is: from the preemption
    # events, and from the step rows alone (a run recorded without events)
    assert probe_summary.summarize(frames, steps, sessions, 10, events)["t_sat_observed_s"] == T_PREEMPT
    assert probe_summary.summarize(frames, steps, sessions, 10, [])["t_sat_observed_s"] == T_PREEMPT
    res = sim.run(sim.make_scenario(sessions=5, horizon=1.0, num_blocks=400))
    t, d = res.steps.t_s.to_numpy(), res.steps.step_s.to_numpy()
    # the first step starts at the first frame's tick; a step starts once the one before ends
    assert t[0] == res.frames.tick_s.min() and np.all(t[1:] >= t[:-1] + d[:-1] - 1e-9)


# --------------------------------------------------------------------------------------- 2. one percentile
SAMPLES = [0.01 * k for k in range(1, 11)]  # nearest rank: p99 = 0.10, p50 = 0.05 (linear: 0.0991, 0.055)


def test_prometheus_gauge_run_summary_and_controller_report_one_p99():
    pytest.importorskip("prometheus_client")
    m = live_metrics.LiveMetrics(None)  # no server
    for x in SAMPLES:
        m.frame(x, silent=False)
    gauge_p99 = m.registry.get_sample_value("metronome_frame_latency_p99_seconds")
    gauge_p50 = m.registry.get_sample_value("metronome_frame_latency_p50_seconds")

    frames = [{"session": "s", "frame": i, "tick_s": float(i), "done_s": i + x, "latency_s": x, "silent": False,
               "silent_by_deadline": False, "met_deadline": True, "censored": False, "state": "running",
               "tokens_delivered": 1} for i, x in enumerate(SAMPLES)]
    live_s = probe_summary.summarize(frames, [], [], num_blocks=10, events=[])

    sim_frames = pd.DataFrame({"tick_s": np.arange(10.0), "latency_s": SAMPLES, "frames": 1, "silent": 0,
                               "silent_preempted": 0, "silent_waiting": 0, "silent_departed": 0, "late": 0,
                               "tokens": 1})
    sim_s = results.shared_summary(sim_frames, SAMPLES, None, results.RunCounts(
        peak_used_blocks=1, usable_blocks=9, preemptions=0, rebases=0, sessions_offered=1, sessions_admitted=1,
        sessions_refused=0))

    ctl = AIMDController(AIMDParams(interval_s=100.0), deadline_s=1.0)
    for x in SAMPLES:
        ctl.observe(1.0, x)
    ctl.advance(200.0, 1)
    ctl_p99 = ctl.trace()[0]["p_latency_s"]

    assert gauge_p99 == live_s["p99_frame_latency_s"] == sim_s["p99_frame_latency_s"] == ctl_p99 == 0.10
    assert sim_s["p99_step_latency_s"] == 0.10  # step latency: the same statistic
    assert gauge_p50 == live_s["p50_frame_latency_s"] == sim_s["p50_frame_latency_s"] == 0.05


def test_the_percentile_has_one_home():
    from metronome import admission
    from metronome.probe import calibrate
    from metronome.sim import recorder

    assert admission.weighted_percentile is results.weighted_percentile  # old imports keep working
    assert calibrate.percentile is results.percentile and probe_summary.percentile is results.percentile
    assert live_metrics.percentile is results.percentile
    assert recorder.weighted_quantile(np.array(SAMPLES), np.ones(10), 0.99) == 0.10
    assert results.percentile([], 99) is None and results.percentile([math.nan, 0.3], 50) == 0.3


def test_a_read_only_column_gets_the_same_percentile_and_stays_read_only():
    # pandas hands out its columns read-only; the percentile reads them through a writable view (one compiled
    # form for both kinds), and must leave the caller's array as it was
    lat = pd.Series(SAMPLES).to_numpy()
    weights = pd.Series(np.arange(1, 11)).to_numpy()
    assert not lat.flags.writeable and not weights.flags.writeable
    want = results.weighted_percentiles(np.array(SAMPLES), np.arange(1.0, 11.0), (50, 99))
    assert results.weighted_percentiles(lat, weights, (50, 99)) == want
    assert not lat.flags.writeable and not weights.flags.writeable
    assert lat.tolist() == SAMPLES
    frozen = np.frombuffer(np.array(SAMPLES).tobytes())  # (memory that is read-only itself)
    assert results.weighted_percentiles(frozen, np.ones(10), (99,)) == [0.10]


# ----------------------------------------------------------------------------------- 4. one workload draw
@pytest.mark.parametrize("arrivals, durations", [
    (Arrivals("poisson", rate_per_s=4.0), Durations.parse("exp:3")),
    (Arrivals.parse_pattern("2:1,2:6,2:1"), Durations.parse("lognormal:2:0.7")),
    (Arrivals("ramp", sessions=7, ramp_s=3.0), Durations.parse("list:1,2,5")),
    (Arrivals("all", sessions=5), None),
])
def test_one_seed_gives_the_same_sessions_simulated_and_live(arrivals, durations):
    from metronome.probe.live_run import make_plans

    horizon, seed = 6.0, 11
    sc = sim.Scenario(sim.make_scenario(sessions=1, horizon=horizon).calibration,
                      sim.make_scenario(sessions=1, horizon=horizon).policy, arrivals, horizon,
                      durations=durations, seed=seed)
    t_sim, d_sim = sim.workload(sc)
    plans = make_plans(arrivals, durations, horizon, seed)
    assert len(plans) == t_sim.size > 0
    assert [p.arrival_s for p in plans] == t_sim.tolist()
    assert [p.duration_s for p in plans] == d_sim.tolist()
    # and the simulated run's sessions are those very sessions
    assert sim.run(sc).sessions.arrival_s.tolist() == t_sim.tolist()
    # another seed, other sessions (the seed is used)
    if arrivals.kind != "all" and arrivals.kind != "ramp":
        assert [p.arrival_s for p in make_plans(arrivals, durations, horizon, seed + 1)] != t_sim.tolist()


# ------------------------------------------------------------------------------ 5. draining is a decision
def test_draining_is_a_named_decision_and_recorded_when_it_applies():
    assert "draining" in DECISIONS
    c = AIMDController(AIMDParams(interval_s=1.0, initial_limit=100, min_limit=1), deadline_s=0.1)
    c.advance(0.0, 100)
    for k in range(4):  # congested every interval while 100 sessions are still in flight
        c.observe(k + 0.5, 0.5)
        c.advance(k + 0.9, 100)
    c.advance(4.0, 100)
    assert [r["decision"] for r in c.trace()] == ["decrease", "draining", "draining", "draining"]
    assert c.limit == 90  # one cut, not four


def test_every_decision_recorded_is_named():
    rng = np.random.default_rng(0)
    for spec in ("none", "static:5", "aimd", "gradient"):
        c = make_controller(spec, 0.1, AIMDParams(interval_s=0.5))
        for t in np.sort(rng.uniform(0, 30, 600)):
            c.observe(float(t), float(rng.choice([0.01, 0.3])), frames=2, silent=int(rng.integers(0, 2)))
            c.may_admit(float(t), int(rng.integers(0, 40)))
        assert {r["decision"] for r in c.trace()} <= set(DECISIONS), spec


def test_a_live_runs_controller_summary_counts_draining_intervals(tmp_path):
    from metronome.probe.live_run import write_outputs

    c = AIMDController(AIMDParams(interval_s=1.0, initial_limit=100), deadline_s=0.1)
    c.advance(0.0, 100)
    for k in range(3):
        c.observe(k + 0.5, 0.5)
        c.advance(k + 0.9, 100)
    c.advance(3.0, 100)
    out = write_outputs(tmp_path, None, c, {}, {})
    assert out["controller"]["cuts"] == 1 and out["controller"]["draining_intervals"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["controller"]["draining_intervals"] == 2
    assert set(pd.read_parquet(tmp_path / "controller.parquet").decision) == {"decrease", "draining"}


def test_the_counts_of_int32_frame_rows_are_summed_past_int32():
    """The simulator's frame rows hold their counts as int32; the summary adds them as int64 (compiled,
    results.count_total), so totals past 2**31 come out whole. Four rows of 2**30 frames, one of them late, each
    with 2**29 silent ones and 3·2**29 tokens: the totals by hand."""
    big = np.full(4, 2 ** 30, np.int32)
    zero = np.zeros(4, np.int32)
    rows = {"tick_s": np.arange(4.0), "latency_s": np.full(4, 0.01), "frames": big, "silent": big // 2,
            "silent_preempted": big // 2, "silent_waiting": zero, "silent_departed": zero,
            "late": np.array([0, 0, 0, 2 ** 30], np.int32), "tokens": 3 * (big // 2)}
    out = results.shared_summary(rows, np.full(3, 0.02), None, results.RunCounts(
        peak_used_blocks=0, usable_blocks=1, preemptions=0, rebases=0, sessions_offered=0, sessions_admitted=0,
        sessions_refused=0))
    assert out["frames"] == 2 ** 32 and out["silent_frames"] == 2 ** 31
    assert out["tokens_total"] == 6 * 2 ** 30
    assert out["silent_preempted_fraction"] == 0.5 and out["deadline_miss_fraction"] == 0.25


def test_goodput_counts_the_non_silent_frames_of_the_rows_on_time():
    """goodput_frames_per_s: frames answered non-silent on time, per simulated second. A run tight against its
    deadline (some of its rows late, most not) on a pool too small for all its sessions (some of its frames silent
    while they wait), counted from its frames table row by row."""
    sc = sim.make_scenario("moshi-7b-h200", sessions=300, horizon=20.0, deadline=0.06, num_blocks=3000, kv="sinks",
                           window=368, sinks=16)
    r = sim.run(sc)
    good = 0
    for frames, silent, late in zip(r.frames["frames"], r.frames["silent"], r.frames["late"]):
        if late == 0:
            good += int(frames) - int(silent)
    assert 0 < r.summary["deadline_miss_fraction"] < 0.5 and r.summary["silent_frame_fraction"] > 0
    assert r.summary["goodput_frames_per_s"] == round(good / 20.0, 4)
