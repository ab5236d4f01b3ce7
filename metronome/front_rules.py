"""The front end's rules over its queues, compiled once: what :class:`metronome.front_end.FrontEnd` calls from
Python (the live driver, the server, the simulator's step-by-step path) and the simulator's compiled loop
(``sim/fastpath.py``) calls from machine code. One statement of each, on the same arrays.

The queues are arrays the front end owns (:class:`Queues`), their heads and lengths a numpy record of one element
(:data:`BOOKS`):

- **its FCFS queue** ``queue[qhead:qhead + nwait]``: sessions let in by the gate and waiting for blocks. An arrival
  joins the tail (:func:`enqueue`), a preempted session the head (:func:`requeue`), so the array keeps room on
  both sides (the caller's, before it calls);
- **the departures booked** ``(dep_t, dep_i)[dep:ndeps]``, in time order, ties by session: the order of a heap of
  ``(t, i)`` pairs, which is what the front end once kept;
- **the frames owed in lockstep** ``pend[phead:npend]``, one row (session, frame, tokens got) each, in the order
  they were owed; rows ``phead:psorted`` are known to be in frame order (:func:`answer_silent`).

A frame answered goes to the caller's answers (:class:`Tally`: tick key, session and tokens got, and the
session's counts), which the caller records one row per tick. What only a live front end records (the frames it
never answers, for its rows) comes back in buffers the caller reads.

Why records and named tuples: numba compiles a record's field to a load or store at its offset, and a record is
handed to a callee as one pointer; a named tuple of arrays unpacks at no cost. Compiled with
``metronome.compiled``'s flags, so each is the same code whichever caller compiles it first (the loop's turn runs
without reference counting: nothing here allocates).
"""

from __future__ import annotations

from collections import namedtuple

import numba as nb
import numpy as np

from metronome import compiled, serving

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

# front-end states of a session (a session's life: metronome.front_end)
NOT_ARRIVED, WAITING, PREFILL, RUNNING, ENDED, REFUSED, QUEUED = 0, 1, 2, 3, 4, 5, 6

# The queues' heads and lengths (see the module's docstring), then the front end's counters: the next arrival, the
# sessions admitted so far (their order), the latest frame handed to the engine, the most blocks held after a step,
# the start of the first step that preempted (NaN: none yet), whether the last step preempted and, for the
# simulator, whether the engine waited since its last step. The simulator's loop writes the front end's own record
# in place (sim/span.py, Front.books).
BOOK_FIELDS = [("qhead", np.int64), ("nwait", np.int64), ("dep", np.int64), ("ndeps", np.int64),
               ("phead", np.int64), ("psorted", np.int64), ("npend", np.int64), ("narr", np.int64),
               ("seq", np.int64), ("sframe", np.int64), ("peak", np.int64), ("t_sat", np.float64),
               ("prelast", np.bool_), ("idle", np.bool_)]
BOOKS = np.dtype(BOOK_FIELDS, align=True)
Queues = namedtuple("Queues", "queue dep_t dep_i pend")
# where a frame answered goes (the caller's answers: tick key, session, tokens got) and the counts it updates
Tally = namedtuple("Tally", "pslot s_frames s_silent key who tok")

# A rule called at every frame is spliced into its compiled caller (inline="always": its body joins the caller's
# before either is compiled, so it takes the caller's flags); LLVM does not inline a small function into a caller
# as large as the simulator's loop, and each frame would pay a call.
_spliced = nb.njit(cache=True, inline="always")


@_spliced
def live(st):
    """Let in by the gate and not yet ended: waiting for blocks, re-prefilling or running."""
    return WAITING <= st <= RUNNING


@_spliced
def placeless(st):
    """Waiting at the front end or re-prefilling: its frames are answered silent."""
    return st == WAITING or st == PREFILL


_join_frame = nb.njit(cache=True)(serving.join_frame)


@_spliced
def chunk_of(i, ss):
    """The tokens session ``i``'s next frame hands to the engine: its prompt (its first frame) or the token sampled
    last (it is re-fed), the input of the frames it missed (silent) and its own."""
    return (1 if ss.started[i] else ss.prompt_of[i]) + ss.pending_in[i] + ss.n_in_of[i]


@_spliced
def request_tokens(i, ss):
    """Tokens session ``i``'s request carries when it is admitted: its first frame or, once it lost its place, its
    history and the input of the frames it missed (what a rebase keeps of them is the caller's)."""
    return ss.hist[i] + ss.pending_in[i] if ss.started[i] else chunk_of(i, ss)


# ------------------------------------------------------------------------------------------------ the queue
@_spliced
def enqueue(i, b, queue):
    """Session ``i`` joins the tail of the front end's FCFS queue."""
    queue[b.qhead + b.nwait] = i
    b.nwait += 1


@_spliced
def requeue(i, b, queue):
    """Session ``i`` goes back to the head of the front end's FCFS queue (it lost its place)."""
    b.qhead -= 1
    queue[b.qhead] = i
    b.nwait += 1


@_spliced
def dequeue(b, queue):
    """The head of the front end's FCFS queue leaves it (admitted). Returns it."""
    i = queue[b.qhead]
    b.qhead += 1
    b.nwait -= 1
    return i


@compiled.uncounted
def leave_queue(i, b, queue):
    """Session ``i`` leaves the front end's queue, the others keeping their order (it departed while waiting).
    Returns whether it was there."""
    end = b.qhead + b.nwait
    j = b.qhead
    while j < end and queue[j] != i:
        j += 1
    if j == end:
        return False
    for k in range(j, end - 1):
        queue[k] = queue[k + 1]
    b.nwait -= 1
    return True


@compiled.uncounted
def book_departure(t, i, b, dep_t, dep_i):
    """Session ``i`` departs at ``t``: into the departures still to come, in order (time, then session)."""
    j = b.ndeps
    while j > b.dep and (dep_t[j - 1] > t or (dep_t[j - 1] == t and dep_i[j - 1] > i)):
        dep_t[j], dep_i[j] = dep_t[j - 1], dep_i[j - 1]
        j -= 1
    dep_t[j], dep_i[j] = t, i
    b.ndeps += 1


@_spliced
def enter(i, t_enter, ss, b, q):
    """Session ``i`` is past the gate at ``t_enter`` (its arrival, or when the gate's queue let it in): it waits at
    the tail of the front end's FCFS queue, streams from the first tick at or after ``t_enter`` and departs its
    ``duration`` after it (``q``: :class:`Queues`, with room for both). Returns its first frame."""
    ss.state[i] = WAITING
    nf = _join_frame(t_enter, ss.P_of[i], ss.phase[i])
    ss.next_frame[i] = nf
    enqueue(i, b, q.queue)
    book_departure(t_enter + ss.duration[i], i, b, q.dep_t, q.dep_i)
    return nf


@_spliced
def admit_head(now, seq, ss, b, queue):
    """The head of the front end's FCFS queue got the blocks vLLM's gate wants: it is admitted at ``now``, the
    ``seq``-th admission (the deadlock rule's order). A new session runs from its first frame's tick, which hands its
    prompt to the engine; one that lost its place is the caller's to readmit (:func:`readmitted`). Returns (the
    session, whether it is new)."""
    i = dequeue(b, queue)
    ss.admit_seq[i] = seq
    if np.isnan(ss.s_admitted[i]):
        ss.s_admitted[i] = now
        ss.admitted[i] = True
    if ss.started[i]:
        return i, False
    ss.state[i] = RUNNING
    ss.running_since[i] = serving.frame_tick(ss.next_frame[i], ss.P_of[i], ss.phase[i])
    return i, True


@_spliced
def readmitted(i, prompt, steps, ss):
    """Session ``i``, which lost its place, is a new request now, whose ``prompt`` is its history (and the input of
    the frames it missed), or what a rebase keeps of it; it re-prefills from the engine's step ``steps`` on, its
    frames answered silent meanwhile."""
    ss.hist[i] = prompt
    ss.pending_in[i] = 0
    ss.state[i] = PREFILL
    ss.work_step[i] = steps


@_spliced
def hand_over(i, sl, chunk, steps, ss, fresh):
    """Session ``i``'s oldest queued frame (``chunk`` tokens, :func:`chunk_of`) is in its request ``sl`` now, from the
    engine's step ``steps`` on; ``fresh``: the requests with a frame not yet scheduled (the first-step term). Returns
    the frame."""
    fresh[sl] = True
    f = ss.next_frame[i] - ss.backlog[i]
    ss.hist[i] += chunk
    ss.started[i] = True
    ss.pending_in[i] = 0
    ss.last_tok[i] = False
    ss.backlog[i] -= 1
    ss.inflight[i] = f
    ss.inflight_tok[i] = 0
    ss.work_step[i] = steps
    return f


@compiled.uncounted
def hand_over_each(idx, slots, chunks, steps, ss, fresh):
    """:func:`hand_over` of each session of ``idx``, in order. Returns the latest frame handed over (-1: none)."""
    latest = -1
    for k in range(idx.size):
        latest = max(latest, hand_over(idx[k], slots[k], chunks[k], steps, ss, fresh))
    return latest


@compiled.counted
def chunks_of(idx, ss):
    """:func:`chunk_of` of each session of ``idx``."""
    out = np.empty(idx.size, np.int64)
    for k in range(idx.size):
        out[k] = chunk_of(idx[k], ss)
    return out


# ---------------------------------------------------------------------------------------------- the answers
@_spliced
def answer(i, f, tok, a, n_ans):
    """Session ``i``'s frame ``f`` answered now with ``tok`` tokens (0: silent): its tick key, session and tokens
    appended to the answers, its counts kept (``a``, a :class:`Tally`). Returns the answers."""
    a.key[n_ans] = serving.tick_key(f, a.pslot[i])
    a.who[n_ans] = i
    a.tok[n_ans] = tok
    a.s_frames[i] += 1
    if serving.frame_is_silent(tok):
        a.s_silent[i] += 1
    return n_ans + 1


@_spliced
def owe(i, f, tok, lockstep, b, pend, a, n_ans):
    """Session ``i``'s frame ``f``, owed with the ``tok`` tokens it got while it has no place (waiting,
    re-prefilling, just preempted), is answered now or, in lockstep, waits for its tick's running frames
    (:func:`answer_silent`). Returns the answers."""
    if lockstep:  # (a tick in lockstep is its frame index: every phase is 0)
        pend[b.npend, 0], pend[b.npend, 1], pend[b.npend, 2] = i, f, tok
        b.npend += 1
        return n_ans
    return answer(i, f, tok, a, n_ans)


@compiled.inlined
def answer_silent(b, pend, run_sess, ss, a, n_ans):
    """Lockstep: frames owed to sessions without a place (``pend``'s rows ``b.phead:b.npend``: session, frame,
    tokens got) are answered once every running session's frame of their tick is done (``run_sess``: the
    sessions that may run; ``ss``: their state, frame in flight, frames queued and next frame). Appends them to
    the answers, in the rows' order; returns the answers.

    Rows are owed tick after tick, so they are nearly always in frame order, and then the frames answered are the
    rows from the head up to the first one not yet due: the head moves past them and nothing else is read. An
    engine slower than the frame clock holds hundreds of frames owed a tick (every waiting session's), a backlog
    that grows for as long as it stays behind; read whole at every step, it made a run's time quadratic in its
    length. Rows out of frame order (a preempted session's frames, owed late) are read whole and kept in their
    order."""
    state, inflight, backlog, next_frame = ss
    unfinished = np.iinfo(np.int64).max
    for j in range(run_sess.size):
        i = run_sess[j]
        if state[i] != RUNNING:
            continue
        if inflight[i] >= 0:
            unfinished = min(unfinished, inflight[i])
        elif backlog[i] > 0:
            unfinished = min(unfinished, next_frame[i] - backlog[i])
    n_pend = b.npend
    h = b.phead
    k = max(b.psorted, h + 1)
    while k < n_pend and pend[k - 1, 1] <= pend[k, 1]:  # (rows appended since: still in frame order?)
        k += 1
    if k >= n_pend:
        while h < n_pend and pend[h, 1] < unfinished:
            n_ans = answer(pend[h, 0], pend[h, 1], pend[h, 2], a, n_ans)
            h += 1
        if h == n_pend:  # none owed: the rows start again at 0
            b.phead = b.psorted = b.npend = 0
        else:
            b.phead, b.psorted = h, n_pend
        return n_ans
    m = h
    for q in range(h, n_pend):
        i, f = pend[q, 0], pend[q, 1]
        if f < unfinished:
            n_ans = answer(i, f, pend[q, 2], a, n_ans)
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = i, f, pend[q, 2]
            m += 1
    b.psorted, b.npend = h, m  # (the rows moved)
    return n_ans


# ---------------------------------------------------------------------------------------------- the frame clock
@compiled.inlined
def tick_due(i, now, eps, lockstep, ss, b, pend, a, n_ans, heard, n_heard):
    """Session ``i``'s frames that came due by ``now`` (``eps``: the tolerance of a tick test): a running session
    queues those from its place on (``running_since``); each other one is answered silent (owed: :func:`owe`) and
    its input joins what the session owes the engine (``pending_in``). ``ss``: the front end's per-session arrays
    (:class:`metronome.front_end.Sessions`). ``heard``: (sessions, frames, silent) where each frame that came due
    is written, in the session's order of frames, from ``n_heard`` on, when the caller keeps them (a server takes
    each frame's input at its tick; None: not kept, and numba compiles the writes out). Returns (the answers, the
    frames heard)."""
    P, ph = ss.P_of[i], ss.phase[i]
    nf = ss.next_frame[i]
    if serving.frame_tick(nf, P, ph) > now + eps:
        return n_ans, n_heard
    runs = ss.state[i] == RUNNING
    if runs and serving.frame_tick(nf, P, ph) >= ss.running_since[i] - eps:  # all of them queued (the usual)
        if serving.frame_tick(nf + 1, P, ph) > now + eps:  # exactly one came due
            n_due = np.int64(1)
        else:  # an engine slower than the frame clock: every tick up to now
            n_due = np.int64(np.floor((now + eps - ph) / P)) - nf + 1
            # the division may round across a tick: settle on the tick test itself (f·P + φ <= now)
            if serving.frame_tick(nf + n_due - 1, P, ph) > now + eps:
                n_due -= 1
            if serving.frame_tick(nf + n_due, P, ph) <= now + eps:
                n_due += 1
        if heard is not None:
            for k in range(n_due):
                heard[0][n_heard], heard[1][n_heard], heard[2][n_heard] = i, nf + k, False
                n_heard += 1
        ss.backlog[i] += n_due
        ss.next_frame[i] = nf + n_due
        return n_ans, n_heard
    # frame by frame: a running session's before its place are silent too
    while serving.frame_tick(nf, P, ph) <= now + eps:
        queued = runs and serving.frame_tick(nf, P, ph) >= ss.running_since[i] - eps
        if queued:
            ss.backlog[i] += 1
        else:
            ss.pending_in[i] += ss.n_in_of[i]
            n_ans = owe(i, nf, np.int64(0), lockstep, b, pend, a, n_ans)
        if heard is not None:
            heard[0][n_heard], heard[1][n_heard], heard[2][n_heard] = i, nf, not queued
            n_heard += 1
        nf += 1
    ss.next_frame[i] = nf
    return n_ans, n_heard


@compiled.uncounted
def ticks_due(idx, now, eps, lockstep, ss, b, pend, a, n_ans, heard):
    """:func:`tick_due` of each session of ``idx``, in order. Returns (the answers, the frames heard)."""
    n_heard = 0
    for k in range(idx.size):
        n_ans, n_heard = tick_due(idx[k], now, eps, lockstep, ss, b, pend, a, n_ans, heard, n_heard)
    return n_ans, n_heard


# ---------------------------------------------------------------------------------------------- after a step
@compiled.inlined
def tokens_in(sampled, now, ss, sess_of_slot, a, n_ans, told, ready):
    """A step ended at ``now`` and sampled a token for each request of ``sampled`` (engine slots; ``sess_of_slot``:
    whose each is): a re-prefill's token starts its session's next chunk (the session runs from now); any other goes
    to its session's frame in flight, and a frame with all its tokens is answered (vLLM keeps every sampled token
    but the last, which the next chunk re-feeds). ``told``: (pre, inf, frame), where the sessions whose re-prefill
    is done and those whose frame got a token (and that frame) are written for a live front end's hooks; ``ready``:
    where those answered with frames still queued are written (the compiled loop visits them next). Either None:
    not kept, and numba compiles the writes out. Returns (the answers, how many pre, inf and ready)."""
    n_pre = n_inf = n_ready = 0
    for j in range(sampled.size):
        i = sess_of_slot[sampled[j]]
        if ss.state[i] == PREFILL:
            ss.state[i] = RUNNING
            ss.last_tok[i] = True
            ss.running_since[i] = now
            if told is not None:
                told[0][n_pre] = i
            n_pre += 1
        elif ss.inflight[i] >= 0:
            if told is not None:
                told[1][n_inf], told[2][n_inf] = i, ss.inflight[i]
            n_inf += 1
            ss.inflight_tok[i] += 1
            ss.s_tokens[i] += 1
            if ss.inflight_tok[i] >= ss.n_out_of[i]:
                n_ans = answer(i, ss.inflight[i], ss.inflight_tok[i], a, n_ans)
                ss.hist[i] += ss.n_out_of[i] - 1
                ss.last_tok[i] = True
                ss.inflight[i] = -1
                if ready is not None and ss.backlog[i] > 0:
                    ready[n_ready] = i
                    n_ready += 1
    return n_ans, n_pre, n_inf, n_ready


@_spliced
def awaits_engine(i, step_no, ss):
    """Whether session ``i``'s work (a frame, or a re-prefill) was in its request before the engine's step
    ``step_no``: if the step did not schedule it and the request waits in the engine, the session is starved for
    blocks (a candidate of the deadlock rule, serving.deadlock_pick)."""
    return ss.slot[i] >= 0 and (ss.inflight[i] >= 0 or ss.state[i] == PREFILL) and ss.work_step[i] <= step_no


@compiled.uncounted
def awaiting_engine(step_no, ss, out):
    """The sessions of which :func:`awaits_engine` holds, in order, into ``out``. Returns how many."""
    n = 0
    for i in range(ss.state.size):
        if awaits_engine(i, step_no, ss):
            out[n] = i
            n += 1
    return n


# ------------------------------------------------------------------------------------------- a session's end
@compiled.inlined
def end_owed(i, now, clock, ss, b, pend, a, n_ans, censored):
    """Session ``i`` ends at ``now``: the frames it is owed (its rows owed in lockstep, taken out of ``pend``, the
    others keeping their order; the one in the engine, with what it got; the queued ones, silent) are answered
    once their deadline has passed and the rest are never answered. ``clock``: its period, phase, deadline, the
    tolerance of a tick test and whether the run itself ended (its last frames are all left unanswered, as the
    run's end leaves them). ``censored``: (frames, tokens) where those never answered are written, when the caller
    keeps them (a live front end's rows; None: not kept, and numba compiles the writes out). Its frame clock is
    then clear of them. Returns (the answers, the frames never answered)."""
    P, ph, deadline, eps, run_over = clock
    n_cens = 0
    m = b.phead
    for q in range(b.phead, b.npend):
        if pend[q, 0] == i:
            f, tok = pend[q, 1], pend[q, 2]
            if not run_over and serving.frame_tick(f, P, ph) + deadline <= now + eps:
                n_ans = answer(i, f, tok, a, n_ans)
            elif censored is not None:
                censored[0][n_cens], censored[1][n_cens] = f, tok
                n_cens += 1
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = pend[q, 0], pend[q, 1], pend[q, 2]
            m += 1
    if m < b.npend:  # (rows moved: their order is checked again when next needed)
        b.npend = m
        b.psorted = b.phead
    state, inflight, inflight_tok, next_frame, backlog = ss
    first_q = next_frame[i] - backlog[i]
    for q in range(-1, backlog[i]):  # its frame in flight (if any, with its tokens), then the queued ones
        if q < 0 and inflight[i] < 0:
            continue
        f, tok = (inflight[i], inflight_tok[i]) if q < 0 else (first_q + q, np.int64(0))
        if not run_over and serving.frame_tick(f, P, ph) + deadline <= now + eps:
            n_ans = answer(i, f, tok, a, n_ans)
        elif censored is not None:
            censored[0][n_cens], censored[1][n_cens] = f, tok
            n_cens += 1
    inflight[i] = -1
    backlog[i] = 0
    state[i] = ENDED
    return n_ans, n_cens


# ------------------------------------------------------------------------------------------- losing a place
@compiled.inlined
def lose_place(i, lockstep, ss, b, q, a, n_ans):
    """Recompute preemption at the session level, once its request is gone: its frame in flight is owed with
    what it got (its tokens join its history), its queued frames silent (their input joins what it owes the
    engine); it waits at the head of the front end's queue (``q``, :class:`Queues`), to be readmitted as a new
    request whose prompt is its history. ``ss``: the front end's per-session arrays
    (:class:`metronome.front_end.Sessions`). Returns the answers."""
    if ss.inflight[i] >= 0:
        ss.hist[i] += ss.inflight_tok[i]
    elif ss.last_tok[i]:
        ss.hist[i] += 1
    ss.last_tok[i] = False
    f0 = ss.next_frame[i] - ss.backlog[i]
    for k in range(-1, ss.backlog[i]):  # its frame in flight (if any, with its tokens), then the queued ones
        if k < 0 and ss.inflight[i] < 0:
            continue
        f, tok = (ss.inflight[i], ss.inflight_tok[i]) if k < 0 else (f0 + k, np.int64(0))
        n_ans = owe(i, f, tok, lockstep, b, q.pend, a, n_ans)
    ss.pending_in[i] += ss.n_in_of[i] * ss.backlog[i]
    ss.inflight[i] = -1
    ss.backlog[i] = 0
    ss.state[i] = WAITING
    requeue(i, b, q.queue)
    return n_ans


# (spliced into its caller: compiled on its own, and inlined, it would be one more level at which LLVM optimizes the
# whole turn, about a second more of every cold compile of the loop)
@_spliced
def turn(fe, now, arrivals, takes, departures, admission, due, silence, answers):
    """The order of a front end's turn at ``now``, stated once for both forms of the front end: each phase is called
    as ``phase(fe, now)``, the front end's methods from Python (:meth:`metronome.front_end.FrontEnd._turn` calls
    this function's Python form, ``fe`` the front end) and the simulator's compiled loop's from machine code (``fe``
    its records). The arrivals up to ``now`` pass the gate (or join its queue, or are refused); ``takes`` says
    whether the rest of the turn is taken here (the compiled loop hands back one it would take differently); then
    the departures due, the admissions (FCFS, none right after a step that preempted), the frames that came due
    (queued, or owed silent, and a paused session's oldest handed to the engine), in lockstep the silent frames
    they release, and the moment's answers recorded. Returns whether the turn was taken."""
    arrivals(fe, now)
    if not takes(fe, now):
        return False
    departures(fe, now)
    admission(fe, now)
    due(fe, now)
    silence(fe, now)
    answers(fe, now)
    return True


@_spliced
def after_step(fe, now, tokens, preemptions, silence, records):
    """The order of what follows a step that ended at ``now``, stated once for both forms of the front end, as
    :func:`turn` states the turn's (each phase called as ``phase(fe, now)``; the Python form from
    :meth:`metronome.front_end.FrontEnd._after_step`): the step's sampled tokens go to their frames and the frames
    they finish are answered; the engine's preemptions and the deadlock rule's victims lose their places; in
    lockstep the silent frames that releases are answered (the turn's own phase); then the moment's answers and the
    step are recorded."""
    tokens(fe, now)
    preemptions(fe, now)
    silence(fe, now)
    records(fe, now)


# what the rules compile in from other modules (the join frame, the tick key's slots): their cache is dropped when
# those change (metronome.compiled.guard), before any rule has loaded it
RULES_PARTS = (serving,)
RULES_FORM = compiled.guard(tick_due, RULES_PARTS)
