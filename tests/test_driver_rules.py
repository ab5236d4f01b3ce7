"""The live driver's serving rules, on a fake engine and virtual time (no vLLM, no wall clock).

``tests/fake_engine.py`` runs :class:`metronome.serving.EngineModel`, the project's one model of vLLM 0.32's
scheduler (proven step by step equal to vLLM's own by ``tests/live/test_scheduler_differential.py``): a paged
pool, running requests first (a dry pool preempts ``running[-1]``), then, in a step that preempted nothing, the
kv-holding queue (paused sessions, resumed in place) and the waiting queue, head first, past vLLM's
full-sequence gate; streaming sessions pause holding their blocks and the engine never preempts them. The
driver runs on the fake's virtual clock (``Driver(..., clock=eng.clock, sleep=eng.sleep)``), so every run here
is deterministic and takes milliseconds. The tests go through the driver's public API only
(``Driver(...).run(plans)`` and the :class:`RunResult` it returns) and read what the driver told the engine from
the fake's call log, so they hold whatever the driver's insides look like.

Throughout: a frame appends 14 input tokens and waits for 2 output tokens (16 KV tokens a frame) over
16-token blocks, so a session with ``prompt_tokens=1`` holds exactly ``k + 1`` blocks while its frame ``k``
runs (its frame ``k`` request is ``16k + 15`` tokens, ``16k + 16`` computed after the frame's decode), and the
fake's pool has ``num_blocks - 1`` usable blocks (one is vLLM's null block). The expected numbers below are
worked by hand from vLLM's rules as ``metronome/serving.py`` states them.
"""

from __future__ import annotations

import math

import pytest

from fake_engine import FakeEngine, FakeRemoteEngine

from metronome.calibration import TokenStream
from metronome.kv_policy import KVPolicy
from metronome.probe.driver import Driver, DriverConfig, SessionPlan

STREAM = TokenStream(0.1, 14, 2)
P, N_IN, N_OUT = STREAM.frame_period_s, STREAM.input_tokens_per_frame, STREAM.output_tokens_per_frame
BS = 16
EPS = 1e-9


def drive(eng: FakeEngine, plans: list[SessionPlan], horizon_s: float, **config):
    cfg = DriverConfig(stream=STREAM, horizon_s=horizon_s, **config)
    return Driver(eng, cfg, clock=eng.clock, sleep=eng.sleep).run(plans)


def events(res, kind: str, session: str | None = None) -> list[dict]:
    return [e for e in res.events if e["event"] == kind and (session is None or e["session"] == session)]


def frames_of(res, session: str) -> list[dict]:
    return sorted((f for f in res.frames if f["session"] == session), key=lambda f: f["frame"])


def first_append(eng: FakeEngine, prefix: str) -> dict | None:
    """The first request the driver started for a session (its rids are ``sid``, ``sid.p1``, ``sid.r2``...)."""
    return next((e for e in eng.appends() if e["new"] and e["rid"].split(".")[0] == prefix), None)


def session_row(res, sid: str) -> dict:
    return next(s for s in res.sessions if s["session"] == sid)


def assert_silent_on_time(frames: list[dict]) -> None:
    for f in frames:
        assert f["silent"] and f["tokens_delivered"] == 0, f
        assert f["done_s"] is not None and f["latency_s"] <= STREAM.frame_period_s + EPS, f  # answered, on time


# -- the fake's own model: what the driver has to work around ------------------------------------------------
def test_fake_engine_deadlocks_when_paused_sessions_fill_the_pool():
    """As vLLM 0.32 (tests/live/test_driver_preemption.py): sessions that paused between frames hold their
    blocks and are never preempted, so once the pool is full the engine schedules nothing, for good."""
    eng = FakeEngine(num_blocks=9)  # 8 usable blocks
    for sid in "abcd":
        eng.append(sid, list(range(10, 41)), 1)  # 31 tokens: 2 blocks each once computed
    while eng.has_work():
        eng.step()
    assert eng.pool().free_blocks == 0 and eng.pool().paused == 4
    last = {sid: eng.held_tokens(sid)[-1] for sid in "abcd"}
    for sid in "abcd":
        eng.append(sid, [last[sid]] + [20] * N_IN, 2)  # each needs a third block
    for _ in range(5):
        info = eng.step()
        assert info.batch == 0 and not info.preempted  # stalled: nothing runs, nobody is preempted
    pool = eng.pool()
    assert pool.running == 0 and pool.waiting == 4 and pool.free_blocks == 0 and eng.has_work()


def test_fake_engine_preempts_the_newest_running_request():
    """Running requests that cannot get a block preempt the newest running one (vLLM's running.pop())."""
    eng = FakeEngine(num_blocks=4)  # 3 usable blocks
    eng.append("old", list(range(10, 26)), 5)  # 16 tokens: 1 block, its first decode needs a 2nd
    eng.append("new", list(range(10, 42)), 5)  # 32 tokens: 2 blocks
    eng.step()  # both prefilled: 3 blocks held, 0 free
    info = eng.step()  # "old" decodes into a new block: "new" is preempted for it
    assert info.preempted == ["new"] and "old" in info.scheduled
    assert eng.status_of("new") == "preempted" and eng.blocks_of("new") == 0 and eng.is_scheduled_waiting("new")


def test_fake_engine_serves_resumed_sessions_before_new_requests():
    """vLLM admits the kv-holding queue (paused sessions, resumed in place) before the waiting queue, whatever
    order the calls came in: a session resumed after a new request was added is still served first."""
    eng = FakeEngine(num_blocks=4)  # 3 usable blocks
    eng.append("p", list(range(10, 25)), 1)  # 15 tokens: 1 block; it samples its 16th token and pauses
    eng.step()
    eng.append("n", list(range(10, 42)), 1)  # a new request of 32 tokens: 2 blocks, and 2 are free
    eng.append("p", [eng.held_tokens("p")[-1]] + [20] * 16, 1)  # 15 computed + 17 = 32 tokens: a 2nd block
    info = eng.step()
    # p (kv-holding queue): gate cdiv(32, 16) - 1 slot = 1 <= 2 free, 17 tokens scheduled, 1 block left;
    # n (waiting queue, after it): gate cdiv(32, 16) = 2 > 1, so it waits
    assert info.scheduled == {"p": 17} and eng.status_of("n") == "waiting" and eng.pool().free_blocks == 1


def test_fake_engine_frees_out_of_window_blocks_before_the_next_allocation():
    """vLLM frees the blocks that left a window at the request's *computed* count, just before it allocates
    the request's next tokens (``remove_skipped_blocks``): a chunk that slides the window past a block keeps
    that block until the request's next allocation."""
    policy = KVPolicy.sinks(BS, 16, 64)  # 1 sink block, a 64-token window
    eng = FakeEngine(num_blocks=16, policy=policy)
    eng.append("a", list(range(10, 90)), 1)  # 80 tokens: cdiv(80, 16) = 5 blocks
    eng.step()
    assert eng.blocks_of("a") == 5
    eng.append("a", [eng.held_tokens("a")[-1]] + [20] * 14, 1)  # 80 computed + 15 = 95 tokens
    eng.step()
    # before allocating: at 80 computed the window starts in block (80 - 63) // 16 = 1, below it only the sink
    # block 0: nothing to free (5 held); then cdiv(95, 16) = 6 slots, 1 more block: 6 held, though at 95
    # computed the window starts in block (95 - 63) // 16 = 2 and 1 sink + 4 window blocks would do
    assert eng.blocks_of("a") == 6 and int(policy.resident_blocks(95)) == 5
    eng.append("a", [eng.held_tokens("a")[-1]] + [20] * 14, 1)  # 95 computed + 15 = 110 tokens
    eng.step()
    # before allocating: block 1 goes (5 held); cdiv(110, 16) = 7 slots, 6 taken so far: 1 more, 6 held
    assert eng.blocks_of("a") == 6


# -- admission ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, admitted", [(146, True), (147, False)])
def test_admission_needs_the_whole_first_request_to_fit(prompt, admitted):
    """10 free blocks = 160 tokens. A new session's request is its prompt + its first frame's input, and vLLM's
    full-sequence gate wants all of it free (serving.admission_need_blocks, full attention: no cap):
    146 + 14 = 160 tokens fits in 10 blocks; 147 + 14 = 161 needs 11 and waits."""
    eng = FakeEngine(num_blocks=11)
    res = drive(eng, [SessionPlan("s", prompt_tokens=prompt)], horizon_s=0.35)
    first = first_append(eng, "s")
    if admitted:
        assert first is not None and first["t"] == 0.0 and len(first["tokens"]) == prompt + N_IN
        assert frames_of(res, "s")[0]["state"] == "running"
    else:
        assert first is None  # never handed to the engine
        frames = frames_of(res, "s")
        assert len(frames) == 4 and all(f["state"] == "waiting" for f in frames)
        assert_silent_on_time(frames)


def _fcfs_run():
    """41 blocks = 40 usable. A (prompt 400): its frame k request is 400 + 14 + 16k tokens, so it holds
    cdiv(414 + 16k, 16) = 26 + k blocks during its frame k (the decode's token, 415 + 16k, stays in the last
    one), and it leaves at 1.0 s.
    B (prompt 305) arrives at 0.2 s, before A's frame 2 is appended (A holds 27: 13 free): vLLM's full-sequence
    gate wants cdiv(305 + 14, 16) = 20 blocks for it. C (prompt 1) arrives at 0.3 s (A holds 28: 12 free) and
    needs cdiv(1 + 14, 16) = 1: it fits, but it is behind B.
    When A leaves (40 free) B's request is 305 + 8·14 (its silent frames 0.2 .. 0.9) + 14 = 431 tokens,
    cdiv(431, 16) = 27 blocks, and C's 1 + 7·14 + 14 = 113, 8 blocks: 35 <= 40, both go in; both are new
    requests, admitted from vLLM's waiting queue in the order they were appended."""
    eng = FakeEngine(num_blocks=41)
    plans = [SessionPlan("A", prompt_tokens=400, duration_s=1.0),
             SessionPlan("B", arrival_s=0.2, prompt_tokens=305), SessionPlan("C", arrival_s=0.3, prompt_tokens=1)]
    return eng, drive(eng, plans, horizon_s=1.25)


def test_admission_is_fcfs_a_later_small_session_never_jumps_the_queue():
    eng, res = _fcfs_run()
    b, c = first_append(eng, "B"), first_append(eng, "C")
    assert b is not None and c is not None
    assert b["t"] >= 1.0 - EPS  # B waited for A's blocks...
    assert c["t"] >= b["t"] and eng.log.index(c) > eng.log.index(b)  # ...and C waited behind B, though it fit
    assert c["t"] == b["t"]  # both went in as soon as A's blocks came back
    assert not events(res, "preempt")


def test_frames_of_waiting_sessions_are_silent_on_time_and_their_input_joins_the_history():
    eng, res = _fcfs_run()
    for sid, prompt, arrival in (("B", 305, 0.2), ("C", 1, 0.3)):
        waited = [f for f in frames_of(res, sid) if f["tick_s"] < 1.0 - EPS]
        assert len(waited) == round((1.0 - arrival) / P)  # one per tick from its arrival
        assert all(f["state"] == "waiting" for f in waited)
        assert_silent_on_time(waited)
        # the first chunk the engine gets is the prompt, the input of every silent frame and its own input
        assert len(first_append(eng, sid)["tokens"]) == prompt + N_IN * len(waited) + N_IN
        later = [f for f in frames_of(res, sid) if f["tick_s"] >= 1.0 - EPS and not f["censored"]]
        assert later and not any(f["silent"] for f in later)


def _admissions_right_after_a_preempting_step(eng: FakeEngine, res) -> list[dict]:
    """New engine requests (admissions, readmissions) started after a step that preempted and before the
    next step, with no time passing in between (the driver's very next turn)."""
    steps = [e for e in eng.log if e["op"] == "step"]
    assert len(steps) == len(res.steps)
    bad = []
    for i, row in enumerate(res.steps):
        if row["preemptions"] or row["engine_preempted"]:
            bad += [e for e in eng.appends() if e["new"] and e["step"] == i + 1 and e["t"] == steps[i]["t"]]
    return bad


def test_nothing_is_admitted_in_the_turn_right_after_a_step_that_preempted():
    """12 usable blocks; s0..s3 (prompt 1) arrive 50 ms apart and stream from frames 0, 1, 1, 2. At 0.4 s
    they hold 4 + 3 + 3 + 2 = 12 blocks, all paused, and each frame's 15 tokens need one more block. No request
    runs; the head of vLLM's kv-holding queue (s0, resumed in place) fails the gate (1 > 0 free), which ends the
    pass: the step schedules nothing. Each starved session needs 1 block: the driver preempts s3 (2 blocks
    back: 2 free, 3 needed), then s2 (5 free, 2 needed). s2, whose history is 3·16 + 15 = 63 tokens, heads
    the driver's queue and needs cdiv(63, 16) = 4 <= 5 blocks: it would fit at once. But as a new request it
    would sit in vLLM's waiting queue, behind s0 and s1 in the kv-holding queue: the next step gives them 1
    block each (3 free), s2's gate wants 4 > 3, and the driver would preempt it again (the most recently
    admitted). The rule keeps it waiting."""
    eng = FakeEngine(num_blocks=13)
    plans = [SessionPlan(f"s{i}", arrival_s=0.05 * i) for i in range(4)]
    res = drive(eng, plans, horizon_s=1.0)
    stall = next(i for i, st in enumerate(res.steps) if st["stalled"])
    assert res.steps[stall]["preempted"] == ["s3", "s2"]
    pre = events(res, "preempt", "s2")[0]
    assert pre["history_tokens"] == 63
    assert not _admissions_right_after_a_preempting_step(eng, res)
    # in particular s2 is not readmitted in that turn (to be bounced by s0 and s1 in the next step)
    stall_end = [e for e in eng.log if e["op"] == "step"][stall]["t"]
    assert not [e for e in events(res, "readmit", "s2") if abs(e["t_s"] - stall_end) < EPS]


# -- preemption by recompute -------------------------------------------------------------------------------
def test_dry_pool_preempts_the_most_recent_session_which_heads_the_queue_and_comes_back_with_its_history():
    """37 blocks = 36 usable. a, b, c, d (prompt 100) are requests of 114 tokens, cdiv(114, 16) = 8 blocks each
    (the decode's 115th token stays in the 8th), admitted in that order (32 blocks); e (prompt 100, arrival
    50 ms) needs 8 of the 4 left and waits. At 0.1 s each frame makes 115 + 15 = 130 tokens, a 9th block:
    the kv-holding queue takes the last 4 (a, b, c, d in turn). At 0.2 s each makes 131 + 15 = 146 tokens,
    a 10th block, and none is free: the head (a) fails the gate, nothing runs, and the driver preempts d,
    the most recently admitted (9 blocks back; the other three need 3), which goes back to the driver's queue
    *ahead of e*. d's history is 146 tokens, plus 14 per missed frame. b and c leave at 0.75 s; d comes back
    first, as a new request whose prompt is everything it held plus the input of the 5 frames it missed
    (0.3 .. 0.7): 146 + 70 = 216 tokens, cdiv(216, 16) = 14 blocks."""
    eng = FakeEngine(num_blocks=37)
    plans = [SessionPlan("a", prompt_tokens=100), SessionPlan("b", prompt_tokens=100, duration_s=0.75),
             SessionPlan("c", prompt_tokens=100, duration_s=0.75), SessionPlan("d", prompt_tokens=100),
             SessionPlan("e", arrival_s=0.05, prompt_tokens=100)]
    res = drive(eng, plans, horizon_s=1.0)
    pre = events(res, "preempt")
    assert pre[0]["session"] == "d" and pre[0]["reason"] == "pool_dry"
    # the engine did not preempt anyone itself: d's request was waiting for a block with others holding the pool
    assert not any(st["engine_preempted"] for st in res.steps)
    abort = eng.aborts("d")[0]
    assert abort["status"] != "running" and abort["free"] == 0 and abort["blocks"] > 0
    # d heads the queue: it is readmitted before e, which was waiting before d was preempted
    readmit = events(res, "readmit", "d")
    assert readmit and readmit[0]["rid"] != "d"
    (back,) = [e for e in eng.appends(readmit[0]["rid"]) if e["new"]]
    e_first = first_append(eng, "e")
    assert e_first is None or eng.log.index(e_first) > eng.log.index(back)
    # ...only once its whole history fits again (b and c left), not before
    assert back["t"] >= 0.75 - EPS
    # a new request (one token to sample: it re-prefills), whose prompt is d's whole history:
    # what the engine held for d, then 14 input tokens per frame it missed while waiting
    missed = [f for f in frames_of(res, "d") if f["state"] == "waiting" and f["tick_s"] < back["t"]]
    assert len(missed) == 5  # ticks 0.3 .. 0.7
    assert back["max_tokens"] == 1
    assert back["tokens"][:len(abort["held_tokens"])] == abort["held_tokens"]
    assert len(back["tokens"]) == len(abort["held_tokens"]) + N_IN * len(missed) == readmit[0]["prompt_tokens"]
    # and it talks again
    assert any(not f["silent"] for f in frames_of(res, "d") if f["tick_s"] > back["t"])
    assert_silent_on_time(missed)
    assert session_row(res, "d")["preemptions"] == 1 and session_row(res, "d")["readmissions"] == 1


def test_frames_of_a_prefilling_session_are_silent_on_time_and_their_input_joins_the_history():
    """10 usable blocks, a 32-token step budget and 1 ms a token, so a re-prefill takes several steps. a and v
    (prompt 1) prefill their frames together (15 + 15 <= 32) and hold k + 1 blocks in frame k: 5 each at 0.5 s,
    and each frame needs a 6th. The kv-holding queue's head (a) fails the gate, nothing runs: the driver
    preempts v, the more recent (80 computed + 15 tokens = 95 of history). a leaves at 0.75 s (10 free); v
    comes back as a new request of 95 + 2·14 = 123 tokens (its frames at 0.6 and 0.7 s were silent;
    cdiv(123, 16) = 8 <= 10), prefilled in chunks of 32, 32, 32, 27 tokens: steps of 36, 36, 36, 31 ms, from
    0.75 to 0.889 s. The tick at 0.8 s finds it prefilling."""
    eng = FakeEngine(num_blocks=11, max_num_batched_tokens=32, step_token_s=1e-3)
    res = drive(eng, [SessionPlan("a", duration_s=0.75), SessionPlan("v")], horizon_s=0.95)
    readmit = events(res, "readmit", "v")[0]
    assert readmit["prompt_tokens"] == 95 + 2 * N_IN
    prefill = [f for f in frames_of(res, "v") if f["state"] == "prefill"]
    assert [round(f["tick_s"], 6) for f in prefill] == [0.8]
    assert_silent_on_time(prefill)
    # the next chunk carries the sampled token, the prefilling frame's input and its own
    chunk = eng.appends(readmit["rid"])[1]
    assert len(chunk["tokens"]) == 1 + N_IN * len(prefill) + N_IN
    f9 = frames_of(res, "v")[9]
    assert f9["state"] == "running" and f9["tokens_delivered"] == N_OUT


# -- max_model_len -----------------------------------------------------------------------------------------
S, W, MAX_LEN = 16, 64, 320


def _capped(cap: str):
    """One session (prompt 1) has a history of 16k tokens before its frame k (plus the token it sampled last,
    which starts the next chunk); frame k would reach 16k + 15 + 2 tokens, which is >= max_model_len first
    at k = 19 (16·19 + 17 = 321; 305 at k = 18)."""
    eng = FakeEngine(num_blocks=64, max_model_len=MAX_LEN, policy=KVPolicy.sinks(BS, S, W))
    return eng, drive(eng, [SessionPlan("a")], horizon_s=2.05, cap=cap)


def test_at_max_model_len_a_bounded_session_is_rebased_to_its_sinks_and_last_window():
    eng, res = _capped("rebase")
    (rebase,) = events(res, "rebase")
    assert rebase["kept_tokens"] == S + W and rebase["prompt_tokens"] == S + W + 1 + N_IN
    frames = frames_of(res, "a")
    assert [f["frame"] for f in frames if f["rebased"]] == [19]
    assert not any(f["silent"] for f in frames) and frames[19]["tokens_delivered"] == N_OUT
    # what the engine got: the old request aborted, a new one with its S sinks, its last W tokens, then the
    # frame's chunk (the token sampled last, which vLLM dropped, and the input)
    (abort,) = eng.aborts("a")
    held = abort["held_tokens"]
    assert len(held) == 16 * 19 + 1  # 16 a frame, plus the token sampled last
    (new,) = [e for e in eng.appends() if e["new"] and e["rid"] != "a"]
    assert new["t"] == abort["t"] and len(new["tokens"]) == S + W + 1 + N_IN
    assert new["tokens"][:S] == held[:S]
    assert new["tokens"][S:S + W] == held[:-1][-W:]
    assert new["tokens"][S + W] == held[-1]
    assert max(len(e["tokens"]) for e in eng.appends() if e["new"]) < MAX_LEN
    assert res.summary["rebases"] == 1 and session_row(res, "a")["rebases"] == 1


def test_a_steps_context_is_what_it_attended_over_as_in_the_simulator():
    """One key, one meaning across the live and simulated steps tables: ``context_tokens`` is the KV a step
    attended over under the policy (sinks S=16 and a window of 64 keep at most S + W tokens plus a partial block at
    each end), ``raw_context_tokens`` the whole history the scheduled requests computed (16 tokens a frame here,
    past 300 by frame 19)."""
    _, res = _capped("rebase")
    ctx = [st["context_tokens"] for st in res.steps]
    raw = [st["raw_context_tokens"] for st in res.steps]
    assert max(raw) >= 16 * 19 and max(ctx) <= S + W + 2 * BS
    assert all(c == r for c, r in zip(ctx, raw) if r <= S + W)  # nothing evicted yet: the same


def test_a_first_frame_past_max_model_len_is_rebased_into_it():
    """A 310-token prompt + the frame's 14 inputs + 2 outputs = 326 >= 320: the first request itself would pass
    max_model_len (vLLM refuses it: "your prompt contains ... input tokens"; seen in paced calibration runs,
    where a long-history session's first frame also carries the input of frames it waited through). It starts
    as a rebase does: its first S tokens and its last W."""
    eng = FakeEngine(num_blocks=64, max_model_len=MAX_LEN, policy=KVPolicy.sinks(BS, S, W))
    res = drive(eng, [SessionPlan("a", prompt_tokens=310)], horizon_s=0.35, cap="rebase")
    first = first_append(eng, "a")
    assert first is not None and len(first["tokens"]) == S + W
    assert frames_of(res, "a")[0]["tokens_delivered"] == N_OUT and frames_of(res, "a")[0]["rebased"]


def test_at_max_model_len_cap_finish_ends_the_session():
    eng, res = _capped("finish")
    row = session_row(res, "a")
    assert row["reason"] == "length" and abs(row["end_s"] - 1.9) < P
    assert not events(res, "rebase") and res.summary["rebases"] == 0
    done = [f for f in frames_of(res, "a") if not f["censored"]]
    assert [f["frame"] for f in done] == list(range(19)) and not any(f["silent"] for f in done)
    assert len(eng.appends("a")) == 19 and len(eng.aborts("a")) == 1  # frame 19 never reached the engine


# -- engine death ------------------------------------------------------------------------------------------
DIE_AT, LOAD_S = 0.55, 0.3


def _killed(restart: bool):
    """a and b (prompt 1) under sinks(S=16, W=64); the engine's process dies at 0.55 s, between frames."""
    eng = FakeRemoteEngine(num_blocks=64, policy=KVPolicy.sinks(BS, S, W), die_at_s=DIE_AT, load_s=LOAD_S)
    res = drive(eng, [SessionPlan("a"), SessionPlan("b")], horizon_s=1.5, restart=restart)
    return eng, res


def test_engine_death_with_restart_readmits_every_session_as_a_rebase():
    eng, res = _killed(restart=True)
    s = res.summary
    assert s["engine_deaths"] == 1 and s["engine_restarts"] == 1 and not s["stopped"] and s["engine_error"] is None
    (died,) = [e for e in eng.log if e["op"] == "died"]
    ((down, up),) = s["engine_outages"]
    assert DIE_AT <= down < DIE_AT + P and up >= down + LOAD_S
    assert {e["session"] for e in events(res, "lost")} == {"a", "b"}
    for sid in "ab":
        held = died["held_tokens"][sid]
        assert len(held) == 16 * 6 + 1  # frames 0..5 ran: 16 tokens each, plus the token sampled last
        (rebase,) = events(res, "rebase", sid)
        (readmit,) = events(res, "readmit", sid)
        assert rebase["reason"] == "engine_restart" and readmit["t_s"] >= up
        # the new engine gets S sinks + the last W tokens of the history (what it held, then the input of
        # the frames answered silent while the engine was down)
        missed = [f for f in frames_of(res, sid) if f["state"] == "waiting"]
        assert len(missed) == 3  # ticks 0.6, 0.7, 0.8
        assert_silent_on_time(missed)
        (first,) = [e for e in eng.appends() if e["new"] and e["rid"] == readmit["rid"]]
        assert len(first["tokens"]) == S + W == readmit["prompt_tokens"]
        kept = W - N_IN * len(missed)
        assert first["tokens"][:S] == held[:S] and first["tokens"][S:S + kept] == held[-kept:]
        # and it talks again
        after = [f for f in frames_of(res, sid) if f["tick_s"] > up + P and not f["censored"]]
        assert after and not any(f["silent"] for f in after)


def test_engine_death_without_restart_stops_the_run_with_engine_error():
    eng, res = _killed(restart=False)
    s = res.summary
    assert s["stopped"] and s["stop_reason"] == "engine_died" and s["engine_deaths"] == 1
    assert s["engine_restarts"] == 0 and s["engine_error"] and "SIGKILL" in s["engine_error"]
    assert DIE_AT <= s["t_stopped_s"] < DIE_AT + P
    assert {r["reason"] for r in res.sessions} == {"engine_died"}
    assert not [e for e in eng.log if e["op"] in ("step", "append") and e["t"] > DIE_AT]
    assert not [f for f in res.frames if f["tick_s"] > DIE_AT and not f["censored"]]


# -- the summary -------------------------------------------------------------------------------------------
def test_summary_counts_match_a_scenario_worked_by_hand():
    """5 usable blocks, max_model_len 64, cap="rebase" keeping the last 16 tokens. a (leaves at 0.25 s) and b,
    prompt 1: a session holds k + 1 blocks during its frame k.

    * frame 0 (t = 0): two new requests of 1 + 14 = 15 tokens, gate cdiv(15, 16) = 1 each; step 1 prefills
      both (1 block each), step 2 decodes both (16 computed: still 1 block); each pauses. 3 free.
    * frame 1 (0.1): each appends 15 (the re-fed token + 14): 16 + 15 = 31 tokens, cdiv(31, 16) = 2, one more
      block each from the kv-holding queue (a, b); steps 3 (prefill) and 4 (decode: 32 computed, 2 blocks).
      2 + 2 held, 1 free.
    * frame 2 (0.2): each makes 32 + 15 = 47 tokens and needs a 3rd block; 1 is free. Step 5: nothing runs;
      the kv-holding queue, head first: a passes the gate (1 <= 1) and takes it, b fails it (1 > 0), ending the
      pass. b is starved (needs 1, 0 free): the driver preempts b (most recent; 1 preemption; its 2 blocks
      back). b's frame 2 was in flight with no token: silent (1 silent frame). Step 6: a's decode (48
      computed, 3 blocks). Steps: 2.
    * 0.25: a leaves (3 blocks back, 5 free). b's whole history, 32 + 15 = 47 tokens, needs cdiv(47, 16) = 3
      <= 5 (vLLM's full-sequence gate): b is readmitted (1 readmission) with a 47-token prompt and one token to
      sample; its prefill is 1 step (7).
    * frame 3 (0.3): b holds 47 tokens, the frame would reach 47 + 15 + 2 = 64 >= max_model_len: rebase
      (1 rebase) to its last 16 tokens + the chunk = 31 tokens (2 blocks); steps 8 (prefill) and 9 (decode).
    * frame 4 (0.4): 32 + 15 + 2 = 49 < 64, a plain frame (47 tokens: a 3rd block, 3 free); steps 10 and 11.
      The horizon (0.45) comes before 0.5.

    frames: a 3 (0, 1, 2) + b 5 (0 .. 4) = 8; silent 1; preemptions 1; readmissions 1; rebases 1;
    steps 2 + 2 + 2 + 1 + 2 + 2 = 11."""
    eng = FakeEngine(num_blocks=6, max_model_len=64)
    res = drive(eng, [SessionPlan("a", duration_s=0.25), SessionPlan("b")], horizon_s=0.45, cap="rebase",
                rebase_tokens=16)
    s = res.summary
    got = {k: s[k] for k in ("frames", "silent_frames", "preemptions", "readmissions", "rebases", "steps")}
    assert got == {"frames": 8, "silent_frames": 1, "preemptions": 1, "readmissions": 1, "rebases": 1,
                   "steps": 11}
    assert s["preemptions_by_reason"] == {"pool_dry": 1} and s["frames_unfinished"] == 0
    assert s["silent_frame_fraction"] == pytest.approx(1 / 8)
    a, b = session_row(res, "a"), session_row(res, "b")
    assert (a["frames"], a["silent_frames"], a["reason"]) == (3, 0, "departed")
    assert (b["frames"], b["silent_frames"], b["preemptions"], b["readmissions"], b["rebases"]) == (5, 1, 1, 1, 1)
    assert [len(e["tokens"]) for e in eng.appends() if e["new"]] == [15, 15, 47, 31]  # a, b, b.p1, b.r2
    assert [f["frame"] for f in frames_of(res, "b") if f["rebased"]] == [3]
    assert [f["frame"] for f in frames_of(res, "b") if f["silent"]] == [2]
    assert math.isclose(events(res, "preempt", "b")[0]["t_s"], 0.2, abs_tol=P / 2)


# -- each session's own deadline ----------------------------------------------------------------------------
class _OwnDeadlines(Driver):
    """A driver whose sessions each ask for their own deadline as they arrive (as a server's clients do with
    ``session.update``): the front end's ``reshape``, the stream otherwise the run's."""

    def __init__(self, *args, deadlines: dict, **kw):
        self.deadlines = deadlines
        super().__init__(*args, **kw)

    def _offered(self, i: int, decision: str) -> None:
        super()._offered(i, decision)
        assert self.reshape(i, P, N_IN, N_OUT, self.deadlines[self._label(i)])


@pytest.mark.parametrize("run_deadline", [0.03, 0.06])
def test_a_frame_is_late_against_its_own_sessions_deadline_not_the_runs(run_deadline):
    """Every step takes 0.02 s, so each frame takes two (its chunk and first token, then its second token): 0.04 s
    after its tick. a (phase 0) and b (phase 0.05 s) never share a step. a asks for a 0.05 s deadline: every frame
    on time, both tokens by it; b asks for 0.035 s: every frame late, its first token (0.02 s) by the deadline and
    its second (0.04 s) not. Whatever the run's deadline: at 0.03 s a's frames would be late by it, at 0.06 s b's
    on time."""
    eng = FakeEngine(num_blocks=64, step_base_s=0.02, step_token_s=0.0)
    cfg = DriverConfig(stream=STREAM, horizon_s=0.5, deadline_s=run_deadline, phases="independent")
    plans = [SessionPlan("a", phase_slot=0), SessionPlan("b", phase_slot=32)]
    res = _OwnDeadlines(eng, cfg, clock=eng.clock, sleep=eng.sleep, deadlines={"a": 0.05, "b": 0.035}).run(plans)
    for sid, on_time, by_deadline in (("a", True, 2), ("b", False, 1)):
        done = [f for f in frames_of(res, sid) if not f["censored"]]
        assert len(done) >= 4, done
        for f in done:
            # the latency is 0.04 s and a few sleeps' 1e-6 s (the fake's shortest nap)
            assert f["latency_s"] == pytest.approx(0.04, abs=1e-4) and f["tokens_delivered"] == 2, f
            assert bool(f["met_deadline"]) is on_time and f["tokens_by_deadline"] == by_deadline, (sid, f)
    counted = [f for f in res.frames if not f["censored"]]
    late = sum(1 for f in counted if f["session"] == "b")
    assert res.summary["deadline_miss_fraction"] == pytest.approx(late / len(counted))  # b's frames, and only its


class LateReports(FakeEngine):
    """vLLM's own loop as the driver reads it when the driver is slower than the engine: each step's report has
    come in (``t_end``) by the time the driver looks, and is read only at its next look, after a turn (vLLM steps
    on its own; the driver, busy with a turn, reads a report that waited). A request aborted meanwhile is not in
    the report it reads (as ``probe.own_loop`` drops it)."""

    def __post_init__(self):
        super().__post_init__()
        self.held = None
        self.aborted: set[str] = set()

    def abort(self, rid):
        self.aborted.add(rid)
        return super().abort(rid)

    def step(self, wait_s=None):
        info = super().step(wait_s)
        info.t_end = info.t_start + info.duration_s  # (in the driver's clock: its start is 0)
        prev, self.held = self.held, info
        if prev is not None:
            for d in (prev.scheduled, prev.computed, prev.outputs):
                for rid in [r for r in d if r in self.aborted]:
                    del d[rid]
        self.aborted = set()
        return prev


def test_a_step_report_read_after_a_turn_answers_no_frame_before_its_tick():
    """The driver reads a report of vLLM's own loop only after a turn that came later (the report waited while
    the turn ran): the turn handed over the frames that ticked meanwhile, so the step is the front end's at that
    turn, not when its report came in. Every frame is answered at or after its tick (a latency below zero
    stopped a server's gateway: the admission controller refuses it), on a pool small enough that sessions wait
    and are preempted (their frames answered silent at the step's end)."""
    eng = LateReports(num_blocks=24, sleep_min_s=0.0, own_loop=True, step_base_s=0.02)
    plans = [SessionPlan(f"s{k}", arrival_s=0.013 * k, prompt_tokens=1, phase_slot=(17 * k) % 64) for k in range(8)]
    res = drive(eng, plans, 3.0, phases="independent")
    answered = [f for f in res.frames if not f["censored"]]
    assert len(answered) > 100 and any(f["silent"] for f in answered), len(answered)
    early = [f for f in answered if f["done_s"] is not None and f["done_s"] < f["tick_s"] - EPS]
    assert not early and min(f["latency_s"] for f in answered) >= 0.0, early[:3]
