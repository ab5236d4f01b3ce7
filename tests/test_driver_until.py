"""Runs driven by what happened, not by the clock: ``DriverConfig.until`` and ``SessionPlan.frames``.

A live test that needs K frames, a rebase or a preemption must get them on a host of any speed. Here the driver
runs on :mod:`fake_engine`'s virtual time (no vLLM), with steps made slower than the frame period (a busy host),
so a wall-clock horizon would end the run long before the event. Expected counts are worked by hand.
"""

from __future__ import annotations

from fake_engine import FakeEngine

from metronome.calibration import TokenStream
from metronome.kv_policy import KVPolicy
from metronome.probe.driver import Driver, DriverConfig, SessionPlan, events_seen, frames_answered, frames_before

STREAM = TokenStream(0.1, 14, 2)  # 16 KV tokens a frame
CAP_S = 1000.0  # the horizon, a cap far past every event waited for here (virtual seconds)


def slow_engine(**kw) -> FakeEngine:
    # every step takes 0.25 s of virtual time: 2.5 periods, so one frame (a chunk step and a decode step) takes
    # five periods and the frame clock runs far ahead of the engine, as on a loaded 2-core host
    return FakeEngine(num_blocks=1024, step_base_s=0.25, step_token_s=0.0, **kw)


def drive(eng, plans, horizon_s, **config):
    cfg = DriverConfig(stream=STREAM, horizon_s=horizon_s, **config)
    return Driver(eng, cfg, clock=eng.clock, sleep=eng.sleep).run(plans)


def test_until_frames_answered_ends_the_run_at_the_kth_frame_not_the_horizon():
    plans = [SessionPlan("a"), SessionPlan("b")]
    # by the clock: 5 s of a 0.5 s-a-frame engine answers about 10 frames each, not the 50 ticks of the horizon
    short = drive(slow_engine(), plans, 5.0)
    assert short.until_met is None
    assert max(s["frames"] for s in short.sessions) < 20
    # by frames: the same scenario until 30 frames each, under a cap it never reaches
    res = drive(slow_engine(), plans, CAP_S, until=lambda d: frames_answered(d, 30))
    assert res.until_met is True
    # lockstep: both sessions' frames are answered by the same step, so the run ends with exactly 30 each
    assert [s["frames"] for s in res.sessions] == [30, 30]
    assert all(s["reason"] == "horizon" for s in res.sessions)  # ended as at the horizon
    assert max(s["end_s"] for s in res.sessions) < 100  # ... long before the cap
    # frames ticking after the 30th are owed when the run ends: censored, as at the horizon, never answered
    assert sum(not f["censored"] for f in res.frames) == 60


def test_until_an_event_a_rebase_each():
    # S + W = 32 + 64: a session of 320 tokens max rebases every ~14 frames of 16 tokens
    policy = KVPolicy.sinks(16, 32, 64)
    plans = [SessionPlan("a"), SessionPlan("b")]
    res = drive(slow_engine(policy=policy, max_model_len=320), plans, CAP_S, policy=policy, cap="rebase",
                until=lambda d: events_seen(d, "rebase", 2, sessions=["a", "b"]))
    assert res.until_met is True
    rebases = [e for e in res.events if e["event"] == "rebase"]
    assert {s: sum(e["session"] == s for e in rebases) for s in "ab"} == {"a": 2, "b": 2}
    # the same run by a 5 s horizon sees none: 320 tokens take 20 frames, 10 s of this engine
    short = drive(slow_engine(policy=policy, max_model_len=320), plans, 5.0, policy=policy, cap="rebase")
    assert not [e for e in short.events if e["event"] == "rebase"]


def test_until_that_never_holds_stops_at_the_cap():
    res = drive(slow_engine(), [SessionPlan("a")], 3.0, until=lambda d: events_seen(d, "preempt"))
    assert res.until_met is False and res.sessions[0]["reason"] == "horizon"


def test_a_session_planned_for_k_frames_leaves_after_its_kth_answer():
    # b leaves after 7 answered frames however slow the engine (by its duration it would stay to the end)
    plans = [SessionPlan("a"), SessionPlan("b", frames=7)]
    res = drive(slow_engine(), plans, CAP_S, until=lambda d: frames_answered(d, 20, sessions=["a"]))
    rows = {s["session"]: s for s in res.sessions}
    assert rows["b"]["reason"] == "departed" and rows["a"]["reason"] == "horizon" and rows["a"]["frames"] == 20
    # b got exactly 7 frames' tokens and left at the turn right after the 7th (virtual time stands still between
    # a step and the next turn); the frames its slow engine still owed it then were answered as it hung up
    spoken = sorted((f for f in res.frames if f["session"] == "b" and f["tokens_delivered"] == 2),
                    key=lambda f: f["done_s"])
    assert len(spoken) == 7 and rows["b"]["end_s"] == spoken[-1]["done_s"]
    # a duration still ends a session first when it comes first (1 s: ticks 0.0 .. 0.9, at most 10 frames)
    res = drive(slow_engine(), [SessionPlan("a"), SessionPlan("b", duration_s=1.0, frames=50)], CAP_S,
                until=lambda d: frames_answered(d, 20, sessions=["a"]))
    b = next(s for s in res.sessions if s["session"] == "b")
    assert b["reason"] == "departed" and b["frames"] <= 10


def test_a_session_that_ended_does_not_hold_the_run():
    # b leaves after 1 s (at most 10 frames): waiting for 20 frames of every session ends when a has its 20
    plans = [SessionPlan("a"), SessionPlan("b", duration_s=1.0)]
    res = drive(slow_engine(), plans, CAP_S, until=lambda d: frames_answered(d, 20))
    rows = {s["session"]: s for s in res.sessions}
    assert res.until_met and rows["b"]["frames"] <= 10 and rows["a"]["frames"] == 20


def test_until_frames_before_completes_a_horizon_on_a_slow_host():
    # frames ticking before 3.0 s: 0.0, 0.1, ..., 2.9 = 30 a session (aligned phases). By a 3 s horizon this engine
    # answers about 6; run until every frame before 3 s is answered, it answers all 30 and the next are owed
    plans = [SessionPlan("a"), SessionPlan("b")]
    res = drive(slow_engine(), plans, CAP_S, until=lambda d: frames_before(d, 3.0))
    assert res.until_met
    done = [f for f in res.frames if not f["censored"]]
    assert sorted(round(f["tick_s"], 6) for f in done if f["session"] == "a") == [round(0.1 * k, 6) for k in range(30)]
    assert [s["frames"] for s in res.sessions] == [30, 30]
