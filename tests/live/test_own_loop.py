"""Sessions on vLLM's own loop (``--loop vllm``, :mod:`metronome.probe.own_loop`): ``AsyncLLM`` with its
EngineCore stepping on its own in a process of its own, each session a streaming-input client on its own
clock, the driver seeing only what the loop reports.

One engine (``tiny``, unbounded, 96 blocks) and one run: 6 sessions from t = 0 on independent phases. vLLM
0.32 alone would deadlock once paused sessions fill the pool (test_driver_preemption.py shows it); the client
breaks it at the first step that schedules nothing, as serving.LOOPS says. Pool facts are asserted exactly;
time only where the host was quiet (latency depends on what else runs on the 2 cores). The run lasts until every
session had 60 frames answered (``DriverConfig.until``: 6 s of ticks), however long a busy host takes for them.
"""

import os

import pytest

from metronome.calibration import TokenStream

SESSIONS, BLOCKS = 6, 96
STREAM = TokenStream(0.1, 14, 2)
# As test_validate.py works it out by hand: 95 usable blocks, 6 sessions of ceil(tokens / 32) blocks; frame 30
# (ticking at 3.0 s + the session's phase, under 0.1 s) takes each session from 480 to 495 tokens, the 16th
# block, and 6 x 16 > 95: the pool runs dry in frame 30.
T_FRAME_30, P = 3.0, 0.1
QUIET_LOAD = 1.0
FRAMES, CAP_S = 60, 600.0  # the run waits for 60 frames each; CAP_S is only a cap


@pytest.fixture(scope="module")
def run(tiny_model):
    from metronome.probe.driver import SessionPlan, frames_answered, run_live
    from metronome.probe.engine import EngineConfig
    from metronome.probe.own_loop import OwnLoopEngine
    from metronome.workload import draw_phases

    eng = OwnLoopEngine(EngineConfig(tiny_model, num_blocks=BLOCKS, max_model_len=2048))
    try:
        slots = draw_phases(SESSIONS, "independent", 0)
        plans = [SessionPlan(f"s{i}", phase_slot=int(slots[i])) for i in range(SESSIONS)]
        load = os.getloadavg()[0]
        res = run_live(eng, STREAM, plans, CAP_S, phases="independent", cap="finish",
                       until=lambda d: frames_answered(d, FRAMES))
        assert res.until_met, f"not {FRAMES} frames each within {CAP_S:g} s: {res.summary['frames']} in all"
        return res, max(load, os.getloadavg()[0]), eng.describe()
    finally:
        eng.close()


def test_the_client_breaks_the_deadlock_at_the_first_stall(run):
    res, load, describe = run
    assert "own process" in describe
    pre = [e for e in res.events if e["event"] == "preempt"]
    assert pre, "the pool ran dry: some session had to go"
    # a client cannot see a starved session, only a step that ran nothing: every abort is a stall's
    assert {e["reason"] for e in pre} == {"stall"}, pre
    first = pre[0]
    # the most recently admitted session goes first, holding frame 30's chunk: 480 + 15 tokens, as by hand
    assert (first["session"], first["history_tokens"]) == ("s5", 495), first
    t_sat = res.summary["t_sat_observed_s"]
    assert t_sat >= T_FRAME_30 - 0.05, res.summary  # not before the frame that ran the pool dry
    if load < QUIET_LOAD:  # in time only on a quiet host: the stall follows frame 30's tick within a period
        assert t_sat <= T_FRAME_30 + P + 0.05, (t_sat, load)


def test_sessions_keep_streaming_after_it(run):
    """No deadlock: ten frames after the one that ran the pool dry (frame 30), the sessions still in the engine get
    their tokens. (Counted in frames: a busy host runs frame 30 well after its tick.)"""
    res, _, _ = run
    late = [f for f in res.frames if f["frame"] >= 40 and f["tokens_delivered"] == STREAM.output_tokens_per_frame]
    assert len({f["session"] for f in late}) >= 3, len(late)
    assert sum(1 for f in res.frames if f["silent"]) > 0  # the victims' frames, answered empty on time


def test_steps_are_vllms_own(run):
    """Each step row is a step of vLLM's loop as it reported it: its own duration and batch, in order."""
    res, _, _ = run
    ran = [s for s in res.steps if s["batch"] > 0]
    assert len(ran) > 100
    assert all(s["step_s"] > 0 and s["new_tokens"] >= s["batch"] for s in ran)
    starts = [s["t_s"] for s in res.steps]
    assert all(b >= a - 1e-3 for a, b in zip(starts, starts[1:]))  # reported in the order vLLM ran them
    assert res.summary["frames"] >= SESSIONS * FRAMES  # every session's frames came due and were answered
