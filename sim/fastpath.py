"""The simulator's hot loop, compiled: turns and steps of a steady span, one machine-code loop.

An hour of Moshi is hundreds of thousands of steps, and under independent phases nothing repeats from one step
to the next that numpy could take a whole span at a time. This module runs the front end's rules one step at a
time in numba, under either phase regime: the turn (frames that came due are handed to the engine,
:meth:`FrontEnd._ticks`; a session without a place hears silence, at once or, in lockstep, with its tick's
running frames, :meth:`FrontEnd._answer_silent`), the engine step, the step's latency with its jitter draw and
:meth:`FrontEnd._after_step`'s bookkeeping and records. The engine step is not restated here: it is
:func:`metronome.serving.engine_step`, the one statement of vLLM's step, called on the engine model's own arrays
(what :meth:`EngineModel.step` runs too). A turn visits only the phase slots whose tick came due and a step reads
only the requests with work, so a step's cost follows its batch, not the sessions in flight.

A step may preempt, stop an admission at the token budget, ``max_num_seqs``, the gate or the watermark: the engine
step decides it. With a front end that steps vLLM itself (``--loop driver``) the front end then reacts here as
FrontEnd._after_step does: the requests vLLM preempted and the deadlock rule's victims (serving.deadlock_pick,
the need serving.resume_need) lose their place, their frames owed, and go back to the head of the front end's
queue; a later turn readmits one as a request whose prompt is its history (FrontEnd._readmit), which re-prefills
while its frames are answered silent. A step that scheduled nothing, or a reaction the span has no room for, is
handed back *after* the step is taken (``STEP_TAKEN``) and the step-by-step path does the rest. A session's first
frame becomes a new request here (FrontEnd._submit: serving.add_slot); the caller names the requests the loop
adds and forgets those it aborts (``new_k``).

Before a turn it would take differently (the length limit, a rebase, the next arrival) it stops and hands back,
and the step-by-step path takes it from exactly there. A departure is taken here (FrontEnd._end: its request
aborted or its place in the queue given up, the frames it is owed answered; each frame row carries the sessions in
flight, which an admission controller is told). ``tests/test_sim_scenarios.py`` compares the two, bit for bit, and
``tests/test_front_end_differential.py`` both with the live driver.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from metronome import (admission, compiled, control_kernel, front_end, jitter_kernel, kv_policy, percentile_kernel,
                       results, serving)
from metronome import control_kernel as ck
from metronome.compiled import borrowed, hold
from metronome.calibration import step_inputs
from metronome.front_end import ENDED, PREFILL, REFUSED, RUNNING, WAITING  # (the session states, declared there)
from metronome.jitter_kernel import correlated_ratio
from metronome.sim.recorder import FRAME_BLOCK, STEP_BLOCK
from metronome.serving import (E_KW, E_NEXT, E_RUN, E_STEPS, E_USED, E_WQ, L_BS, L_CAP, L_MAXLEN, L_NB, L_SINKB,
                               L_WINDOW, O_CTX, O_NEW, O_PRE, O_SAM, O_SCHED, O_USED, PHASE_SLOTS, EngineModel,
                               abort_slot, add_slot, deadlock_pick, engine_step, gate_blocks_jit, key_order_in,
                               key_order_work, resume_need, resume_slot)

P_CODE = EngineModel.PAUSED_CODE
W_CODE, X_CODE = EngineModel.WAITING_CODE, EngineModel.PREEMPTED_CODE  # waiting: new or resumed; preempted

# iconf: the front end's and the stream's constants (the engine's limits are the engine model's own, ``lim``);
# I_SEES: the front end sees starved and preempted requests after each step (serving.sees_starvation); I_NA_END:
# the arrivals the loop takes are those before this one (the next arrival's index: it takes none); I_CTL: how the
# admission controller hears the answered frames (CTL_*)
# I_TPF: a frame's KV tokens (a readmission must leave room for one)
I_NIN, I_NOUT, I_MAXSTEPS, I_PROMPT, I_ANSCAP, I_FLO, I_LOCKSTEP, I_SEES, I_NA_END, I_CTL, I_TPF = range(11)
N_ICONF = 11
# I_CTL: no controller; one deciding in Python (the caller hands it the frame rows after the call, with each row's
# in-flight count, R_INFLIGHT); a compiled one (control_kernel), which this loop runs at each arrival and each frame
# row, as SimEngine does
CTL_NONE, CTL_AFTER, CTL_COMPILED = 0, 1, 2
# frame rows' integer columns (fr_i); R_INFLIGHT: sessions in flight at the front end when the row was answered (what
# an admission controller is told with it)
R_FRAMES, R_LATE, R_TOKENS, R_SILENT, R_SILENT_PRE, R_SILENT_WAIT, R_SILENT_DEP, R_INFLIGHT = (
    FRAME_BLOCK.index(c) for c in ("frames", "late", "tokens", "silent", "silent_preempted", "silent_waiting",
                                   "silent_departed", "in_flight"))
# a step row's integer columns (st_i), likewise the steps table's block
(Q_BATCH, Q_NEW, Q_CTX, Q_USED, Q_OUT, Q_DONE, Q_RUNNING, Q_WAITING, Q_SILENT, Q_FREE, Q_PRE) = (
    STEP_BLOCK.index(c) for c in ("batch", "new_tokens", "context_tokens", "resident_blocks", "tokens_out",
                                  "frames_done", "running", "waiting", "silent_frames", "free_blocks", "preemptions"))
# fconf: times and the step-latency model's real-time terms (its coefficients come as their own array, ``coef``)
# (F_TPAUSE: the loop hands back after the first turn from then on, so a caller can look at the run, e.g. whether
# its outcome is decided; unlike F_TNEXT it is no event, and nothing waits for it)
# (F_ROUTE: the step model's moe_route, the MoE input of step_inputs)
F_P, F_PQ, F_DEADLINE, F_TNEXT, F_FIRST, F_EPS, F_JITTER, F_HORIZON, F_WZ, F_WSHARED, F_WOWN, F_TPAUSE, F_ROUTE = range(13)
# fconf[F_JITTER]: no jitter; independent (each step's ratio given, ``jit``); correlated (a step's ratio from its own
# score ``jz`` and the parts ``ja``/``jb`` of the frame it is taken on, frames iconf[I_FLO] on)
NO_JITTER, INDEPENDENT, CORRELATED = 0, 1, 2
# the step model's form and a session's first frame, compiled from their one statement
_step_inputs = nb.njit(cache=True)(step_inputs)
_join_frame = nb.njit(cache=True)(serving.join_frame)
_silent_cause = nb.njit(cache=True)(results.silent_cause)
# istate[S_TURNED]: 0 the caller takes the turn at fstate[0]; 1 the turn there is taken, the step is the caller's;
# 2 a step (or a wait) starts at fstate[0] and ends at fstate[1], at or past the horizon, where SimPy stops the
# run (the step-by-step path never gets to its records either); 3 the turn at fstate[0] is taken and the loop
# paused there (F_TPAUSE): called again, it goes on from that very point; 4 a step started at fstate[0] and
# took fstate[1] seconds (EngineModel.last_step says what it did), and what follows it is the caller's: the front
# end reacts to a preemption, a request left waiting or a step that scheduled nothing, as the loop does not
TURN_CALLER, TURN_TAKEN, PAST_HORIZON, PAUSED, STEP_TAKEN = range(5)
# fstate[FS_TSAT] (in/out): when a step first preempted (SimEngine.t_sat), NaN until one does
FS_TSAT = 2
# the front end's counters (``fc``, in/out): sessions running at the front end (re-prefilling ones included),
# departures taken (of ``dep_t``) and booked (its length), sessions waiting at the front end (its FCFS queue:
# ``fq[C_QHEAD:C_QHEAD + C_NWAIT]``; a preempted session goes back to its head), the next arrival, the next
# admission's sequence number, sessions re-prefilling; in lockstep the frames owed (``pend``) are its rows
# ``fc[C_PHEAD]:n_pend``, and rows ``C_PHEAD:C_PSORTED`` are known to be in frame order (see _answer_silent)
C_NRUN, C_DEP, C_NDEPS, C_NWAIT, C_QHEAD, C_NARR, C_SEQ, C_NPF, C_PHEAD, C_PSORTED = range(10)
N_FC = 10
# what the loop did to a session's request, in order (``new_k``, beside ``new_i``/``new_s``): a first frame or a
# readmission became request ``new_s`` (the caller names it), or its request was aborted (preempted)
NEW_FIRST, NEW_READMIT, NEW_DROPPED = 0, 1, 2
# istate (in/out): what the call did (S_NNEW: the requests added); S_NSTEPS and S_NROWS come in as the rows of the
# record arrays (st_*, fr_*: the tables' storage) to write from, S_NSTEPS goes out as the steps taken and S_NROWS as
# the row after the last written
# S_IDLE (in/out): the engine waited since its last step (a frame's step then pays first_s); S_PRELAST (in/out): the
# last step preempted (SimEngine.preempted_last: the next turn admits nobody)
S_SFRAME, S_PEAK, S_NSTEPS, S_NROWS, S_TURNED, S_IDLE, S_NPEND, S_NNEW, S_PRELAST = range(9)


@nb.njit(cache=True)
def _tick(f, P, ph):
    return f * P + ph


@compiled.inlined
def flush(now, n, keys, who, toks, state, s_admitted, P, Pq, deadline, eps, s_late, fr_f, fr_tick, fr_done, fr_lat,
          fr_i, nrows, in_flight, work):
    """``n`` answers (tick key, session, tokens got) become one row per tick, in tick order, all answered at
    ``now`` with ``in_flight`` sessions in flight (-1: nobody reads it, not written); a late frame counts against its
    session (``s_late``), a silent one is counted by what it is (results.silent_cause: a session that ended now was
    answered at its departure). Both paths record their rows with it (SimEngine._flush_answers). ``work``: room to
    sort in (serving.key_order_in). Returns the rows written so far."""
    if n == 0:
        return nrows
    # rows are sums over a tick: the order within one does not matter
    key_order_in(keys, n, work)
    order = work[:n]
    j = 0
    while j < n:
        key = keys[order[j]]
        e = j
        while e < n and keys[order[e]] == key:
            e += 1
        f, sl = key // PHASE_SLOTS, key % PHASE_SLOTS
        tick = f * P + sl * Pq
        latency = now - tick
        late = latency > deadline + eps
        tk = 0
        pre = 0
        wait = 0
        dep = 0
        for q in range(j, e):
            i = who[order[q]]
            tok = toks[order[q]]
            tk += tok
            if tok == 0:  # serving.frame_is_silent
                cause = _silent_cause(tok, state[i] == ENDED, tick, s_admitted[i])
                if cause == results.SILENT_PREEMPTED:
                    pre += 1
                elif cause == results.SILENT_WAITING:
                    wait += 1
                else:
                    dep += 1
            if late:
                s_late[i] += 1
        fr_f[nrows] = f
        fr_tick[nrows] = tick
        fr_done[nrows] = now
        fr_lat[nrows] = latency
        fr_i[R_FRAMES, nrows] = e - j
        fr_i[R_LATE, nrows] = (e - j) if late else 0
        fr_i[R_TOKENS, nrows] = tk
        fr_i[R_SILENT, nrows] = pre + wait + dep
        fr_i[R_SILENT_PRE, nrows] = pre
        fr_i[R_SILENT_WAIT, nrows] = wait
        fr_i[R_SILENT_DEP, nrows] = dep
        if in_flight >= 0:
            fr_i[R_INFLIGHT, nrows] = in_flight
        nrows += 1
        j = e
    return nrows


@compiled.counted  # (it allocates)
def _wheel(live, state, pslot, next_frame, phase, P):
    """The sessions by phase slot (slot k's: ``who[start[k]:start[k + 1]]``) and each slot's next tick: the live
    ones, and those yet to arrive in the span (they tick once they arrive, :func:`_arrive`).

    A turn takes every frame that came due, so every live session of a slot is before the same next frame; the
    turn then visits only the slots that came due, not every live session. ``ok`` is False when a slot's sessions
    are not on one frame (the caller then steps one at a time)."""
    start = np.zeros(PHASE_SLOTS + 1, np.int64)
    for j in range(live.size):
        start[pslot[live[j]] + 1] += 1
    for k in range(PHASE_SLOTS):
        start[k + 1] += start[k]
    fill = start[:PHASE_SLOTS].copy()
    who = np.empty(live.size, np.int64)
    frame = np.full(PHASE_SLOTS, -1, np.int64)
    tick = np.full(PHASE_SLOTS, np.inf)
    ok = True
    for j in range(live.size):
        i = live[j]
        k = pslot[i]
        who[fill[k]] = i
        fill[k] += 1
        if not _live(state[i]):
            continue
        if frame[k] < 0:
            frame[k] = next_frame[i]
            tick[k] = _tick(next_frame[i], P, phase[i])
        elif frame[k] != next_frame[i]:
            ok = False
    return start, who, tick, ok


@nb.njit(cache=True)
def _due_sessions(now, eps, tick, start, who, ready, n_ready, state, out):
    """The sessions a turn at ``now`` visits: those of the slots that came due, then those whose frame was
    answered in the last step with frames still queued (``ready``); not those that departed. Returns how many
    (a session may appear twice)."""
    n = 0
    for k in range(PHASE_SLOTS):
        if tick[k] <= now + eps:
            for q in range(start[k], start[k + 1]):
                if _live(state[who[q]]):
                    out[n] = who[q]
                    n += 1
    for q in range(n_ready):
        if _live(state[ready[q]]):
            out[n] = ready[q]
            n += 1
    return n


@nb.njit(cache=True)
def _live(st):
    return WAITING <= st <= RUNNING


@nb.njit(cache=True)
def _placeless(st):
    """Waiting at the front end or re-prefilling: its frames are answered silent (FrontEnd._queues)."""
    return st == WAITING or st == PREFILL


@nb.njit(cache=True)
def _slot_tick(k, start, who, state, next_frame, phase, P):
    """Slot ``k``'s next tick: its live sessions' (all on one frame), or never when all of them departed."""
    for q in range(start[k], start[k + 1]):
        i = who[q]
        if _live(state[i]):
            return _tick(next_frame[i], P, phase[i])
    return np.inf


@nb.njit(cache=True)
def _turn_fits(now, visit, n_visit, iconf, fconf, maxlen, state, phase, next_frame, backlog, inflight, hist,
               pending_in, running_since, started, sslot, status, room):
    """The turn's checks: every due frame of the visited sessions is one the compiled turn takes as the
    step-by-step one would (a running session's, on a paused request or, its first, on a new one for which the
    engine's arrays have ``room``, fitting the length limit). Returns (whether all pass, the silent answers the
    turn will write, the room left)."""
    P, eps = fconf[F_P], fconf[F_EPS]
    chunk, n_out = 1 + iconf[I_NIN], iconf[I_NOUT]
    n_ans = 0
    for j in range(n_visit):
        i = visit[j]
        t = _tick(next_frame[i], P, phase[i])
        due = t <= now + eps
        if _placeless(state[i]):  # each due frame will be answered silent
            k = 0
            while _tick(next_frame[i] + k, P, phase[i]) <= now + eps:
                k += 1
            n_ans += k
            continue
        if due and t < running_since[i] - eps:
            return False, n_ans, room
        if inflight[i] < 0 and (due or backlog[i] > 0):
            s = sslot[i]
            if s < 0:  # its first frame (a session that started and has no request was rebased: not here)
                room -= 1
                if started[i] or room < 0 or not _first_fits(i, iconf, maxlen, hist, pending_in):
                    return False, n_ans, room
            elif status[s] != P_CODE or hist[i] + chunk + pending_in[i] + n_out >= maxlen:
                return False, n_ans, room
    return True, n_ans, room


@nb.njit(cache=True)
def _queue_due(now, visit, n_visit, P, eps, n_in, lockstep, state, phase, pslot, next_frame, backlog, pending_in,
               s_frames, s_silent, a_key, a_who, a_tok, n0, pend, n_pend):
    """The turn, first half: frames that came due are queued (a running session's) or owed silent (a session
    waiting at the front end: FrontEnd._tick_one's quiet branch and _owe), after the ``n0`` answers already
    written. Returns (the answers, frames owed in lockstep)."""
    n_ans = n0
    for j in range(n_visit):
        i = visit[j]
        nf, ph = next_frame[i], phase[i]
        if state[i] == ENDED:  # departed in this turn
            continue
        if _placeless(state[i]):
            while _tick(next_frame[i], P, ph) <= now + eps:
                n_ans, n_pend = _owe(i, next_frame[i], np.int64(0), lockstep, pslot, s_frames, s_silent, a_key, a_who,
                                     a_tok, n_ans, pend, n_pend)
                next_frame[i] += 1
                pending_in[i] += n_in
            continue
        if _tick(nf, P, ph) <= now + eps:
            if _tick(nf + 1, P, ph) > now + eps:
                n_due = 1
            else:  # an engine slower than the frame clock: FrontEnd._ticks's count, exactly
                n_due = np.int64(np.floor((now + eps - ph) / P)) - nf + 1
                if _tick(nf + n_due - 1, P, ph) > now + eps:
                    n_due -= 1
                if _tick(nf + n_due, P, ph) <= now + eps:
                    n_due += 1
            backlog[i] += n_due
            next_frame[i] += n_due
    return n_ans, n_pend


@nb.njit(cache=True)
def _hand_over(i, s, chunk, next_frame, backlog, inflight, inflight_tok, hist, last_tok, work_step, fresh, steps):
    """Session ``i``'s oldest queued frame is in its request ``s`` now (FrontEnd._submit's books). Returns it."""
    fresh[s] = True
    f = next_frame[i] - backlog[i]
    hist[i] += chunk
    last_tok[i] = False
    backlog[i] -= 1
    inflight[i] = f
    inflight_tok[i] = 0
    work_step[i] = steps
    return f


@nb.njit(cache=True)
def _sort_in_place(a):
    """Sort the few ints of ``a`` (a turn's first frames) by insertion: numba's sort allocates, and the turn is
    compiled without numba's reference counting (``_turn``), so nothing it calls may allocate."""
    for j in range(1, a.size):
        x = a[j]
        k = j - 1
        while k >= 0 and a[k] > x:
            a[k + 1] = a[k]
            k -= 1
        a[k + 1] = x


@nb.njit(cache=True)
def _submit_due(visit, n_visit, chunk, n_out, prompt, sslot, next_frame, backlog, inflight, inflight_tok, hist,
                last_tok, pending_in, work_step, started, fresh, sess_of_slot, cnt, status, computed, ntok, out,
                maxtok, kseq, kw, wq, new_i, new_s, new_k, n_new):
    """The turn, second half: a paused session's oldest queued frame is handed to its request
    (EngineModel.append_many: serving.resume_slot), which waits in its place in the kv-holding queue; then a
    session's first frame, with its prompt, becomes a new request at the tail of ``waiting`` (FrontEnd._submit:
    serving.add_slot), in session order as the step-by-step turn hands them over, and ``new_i``/``new_s`` get its
    session and slot. Returns (how many were handed over, the latest frame handed, the new requests so far)."""
    n_sub = 0
    latest = -1
    n_first = 0
    for j in range(n_visit):
        i = visit[j]
        if inflight[i] < 0 and backlog[i] > 0:
            s = sslot[i]
            if s < 0:  # its first frame: after the others (a session may be visited twice: kept once, below)
                new_i[n_new + n_first] = i
                n_first += 1
                continue
            c = chunk + pending_in[i]  # (the input of frames it missed re-prefilling goes with it)
            pending_in[i] = 0
            resume_slot(s, c, n_out, cnt, status, computed, ntok, out, maxtok, kw)
            latest = max(latest, _hand_over(i, s, c, next_frame, backlog, inflight, inflight_tok, hist, last_tok,
                                            work_step, fresh, cnt[E_STEPS]))
            n_sub += 1
    firsts = new_i[n_new:n_new + n_first]
    _sort_in_place(firsts)
    last = -1  # (the kept ones are written back over those already read)
    for a in range(n_first):
        i = firsts[a]
        if i == last:
            continue
        last = i
        first = _first_chunk(prompt, pending_in[i], chunk - 1)
        s = add_slot(hist[i] + first, n_out, cnt, status, ntok, maxtok, kseq, wq)
        sslot[i], sess_of_slot[s], started[i], pending_in[i] = s, i, True, 0
        new_i[n_new], new_s[n_new], new_k[n_new] = i, s, NEW_FIRST
        n_new += 1
        latest = max(latest, _hand_over(i, s, first, next_frame, backlog, inflight, inflight_tok, hist, last_tok,
                                        work_step, fresh, cnt[E_STEPS]))
        n_sub += 1
    return n_sub, latest, n_new


@compiled.uncounted
def _step_latency(coef, fconf, nS, ctx, new_tokens, first, jitter, step_no, sframe, f_lo, jit, jz, ja, jb, jp, jr):
    """StepLatencyModel.step_s (the same sums in the same order, bit for bit), the first-step term, the jitter."""
    xs = _step_inputs(float(nS), float(ctx), float(new_tokens), fconf[F_ROUTE])
    lat = 0.0
    for i in range(coef.size):
        lat += coef[i] * xs[i]
    if first:
        lat += fconf[F_FIRST]
    if jitter == INDEPENDENT:
        lat *= jit[step_no]
    elif jitter == CORRELATED:  # JitterDraws.ratio(step, serving frame): the same compiled function
        f = sframe - f_lo
        lat *= correlated_ratio(jz[step_no], ja[f], jb[f], fconf[F_WZ], fconf[F_WSHARED], fconf[F_WOWN], jp, jr)
    return lat


@compiled.uncounted
def _tokens_to_frames(now, sampled, n_sam, n_out, sess_of_slot, pslot, inflight, inflight_tok, s_tokens, s_frames,
                      hist, last_tok, backlog, a_key, a_who, a_tok, ready, state, running_since, fc):
    """FrontEnd._after_step: a re-prefill that sampled is done (the token starts its next chunk: the session
    runs from now); sampled tokens go to their frames; a frame with all its tokens is answered (its tick key,
    session, tokens). Returns (tokens out, frames done, sessions with frames still queued)."""
    tokens_out = 0
    n_done = 0
    for j in range(n_sam):
        i = sess_of_slot[sampled[j]]
        if state[i] == PREFILL:
            state[i] = RUNNING
            last_tok[i] = True
            running_since[i] = now
            fc[C_NPF] -= 1
        elif inflight[i] >= 0:
            inflight_tok[i] += 1
            s_tokens[i] += 1
            tokens_out += 1
            if inflight_tok[i] >= n_out:
                a_key[n_done] = inflight[i] * PHASE_SLOTS + pslot[i]  # serving.tick_key
                a_who[n_done] = i
                a_tok[n_done] = inflight_tok[i]
                n_done += 1
    n_ready = 0
    for j in range(n_done):
        i = a_who[j]
        hist[i] += n_out - 1
        last_tok[i] = True
        s_frames[i] += 1
        inflight[i] = -1
        if backlog[i] > 0:
            ready[n_ready] = i
            n_ready += 1
    return tokens_out, n_done, n_ready


@compiled.uncounted
def _victims(lim, cnt, status, computed, ntok, held, kw, wq, o_s, o_pre, o_n, sslot, sess_of_slot, state, inflight,
             work_step, admit_seq, backlog, scr, vic):
    """FrontEnd._preempt_after_step's choice, after a step that scheduled something (a stall is the caller's):
    the sessions whose requests the engine preempted, then the deadlock rule's victims (serving.deadlock_pick)
    among the sessions still in the engine, the starved ones' need asked of serving.resume_need. Written to
    ``vic`` in the order they are preempted; ``scr`` is scratch, a row per slot, its marks all 0 between calls.
    Returns (how many, an upper bound of the frames they will be owed: their frame in flight and those queued).

    A starved request waits in the engine (EngineModel.waiting_of), so it is in the kv-holding or the waiting
    queue: the starved ones' need is summed over those two queues, and only when it exceeds the free blocks (the
    rule takes victims) are the slots scanned for every session in the engine. Past N* a step leaves requests
    waiting every time, and a scan of every slot the run ever used, each step, was the loop's cost."""
    mark, who, need, seq, hl, order = scr[0], scr[1], scr[2], scr[3], scr[4], scr[5]
    n_vic = 0
    owed = 0
    free = lim[L_NB] - cnt[E_USED]
    for j in range(o_n[O_PRE]):  # (aborted first: its blocks, if any, are free for the rule below)
        sl = o_pre[j]
        i = sess_of_slot[sl]
        mark[sl] = 2
        vic[n_vic] = i
        n_vic += 1
        owed += 1 + backlog[i]
        free += held[sl]
    for j in range(o_n[O_SCHED]):
        if mark[o_s[j]] == 0:
            mark[o_s[j]] = 1
    step_no = cnt[E_STEPS] - 1
    total = 0
    n_kw = cnt[E_KW]
    for q in range(n_kw + cnt[E_WQ]):
        sl = kw[q] if q < n_kw else wq[q - n_kw]
        if mark[sl] == 0:
            total += _starved_need(sl, lim, status, computed, ntok, held, sslot, sess_of_slot, state, inflight,
                                   work_step, step_no)
    if total > free:
        k = 0
        for sl in range(cnt[E_NEXT]):  # every session with a request in the engine
            if mark[sl] == 2 or status[sl] == 0:
                continue
            i = sess_of_slot[sl]
            if sslot[i] != sl:
                continue
            n = 0 if mark[sl] else _starved_need(sl, lim, status, computed, ntok, held, sslot, sess_of_slot, state,
                                                 inflight, work_step, step_no)
            who[k], need[k], seq[k], hl[k] = i, n, admit_seq[i], held[sl]
            k += 1
        m = deadlock_pick(need[:k], seq[:k], hl[:k], free, False, order)
        for q in range(m):
            i = who[order[q]]
            vic[n_vic] = i
            n_vic += 1
            owed += 1 + backlog[i]
    for j in range(o_n[O_PRE]):  # (the marks back to 0, without touching every slot)
        mark[o_pre[j]] = 0
    for j in range(o_n[O_SCHED]):
        mark[o_s[j]] = 0
    return n_vic, owed


@compiled.uncounted
def _starved_need(sl, lim, status, computed, ntok, held, sslot, sess_of_slot, state, inflight, work_step, step_no):
    """Blocks request ``sl`` is starved for (serving.resume_need), 0 if it is not starved: its session's work (a
    frame, or a re-prefill) was handed over before the step, and it waits in the engine (EngineModel.waiting_of).
    The caller has ruled out a request scheduled or preempted in the step."""
    i = sess_of_slot[sl]
    st = status[sl]
    if (sslot[i] == sl and (inflight[i] >= 0 or state[i] == PREFILL) and work_step[i] <= step_no
            and (st == W_CODE or st == X_CODE)):
        return resume_need(ntok[sl], computed[sl], held[sl], lim[L_BS], lim[L_CAP], lim[L_SINKB], lim[L_WINDOW])
    return 0


@compiled.uncounted
def _preempt_session(i, iconf, fc, fq, state, sslot, pslot, next_frame, backlog, inflight, inflight_tok, hist,
                     last_tok, pending_in, s_preempt, s_frames, s_silent, fresh, cnt, status, slots, held, run, kw, wq,
                     a_key, a_who, a_tok, n_ans, pend, n_pend, new_i, new_s, new_k, n_new):
    """FrontEnd._preempt: the session's request goes (the caller forgets its id); its frame in flight is owed
    with what it got, its queued frames silent (their input joins its history); it waits at the head of the front
    end's queue. An owed frame is answered now, or in lockstep with its tick's running frames. Returns (answers,
    frames owed in lockstep, the requests the caller names or forgets)."""
    s = sslot[i]
    abort_slot(s, cnt, status, slots, held, run, kw, wq)
    fresh[s] = False
    sslot[i] = -1
    new_i[n_new], new_s[n_new], new_k[n_new] = i, s, NEW_DROPPED
    n_new += 1
    lockstep = iconf[I_LOCKSTEP] != 0
    if inflight[i] >= 0:
        hist[i] += inflight_tok[i]
    elif last_tok[i]:
        hist[i] += 1
    last_tok[i] = False
    f0 = next_frame[i] - backlog[i]
    for q in range(-1, backlog[i]):  # its frame in flight (if any, with its tokens), then the queued ones
        if q < 0 and inflight[i] < 0:
            continue
        f, tok = (inflight[i], inflight_tok[i]) if q < 0 else (f0 + q, np.int64(0))
        n_ans, n_pend = _owe(i, f, tok, lockstep, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans, pend, n_pend)
    pending_in[i] += iconf[I_NIN] * backlog[i]
    inflight[i] = -1
    backlog[i] = 0
    if state[i] == PREFILL:
        fc[C_NPF] -= 1
    state[i] = WAITING
    s_preempt[i] += 1
    fc[C_NRUN] -= 1
    fc[C_QHEAD] -= 1
    fq[fc[C_QHEAD]] = i
    fc[C_NWAIT] += 1
    return n_ans, n_pend, n_new


@nb.njit(cache=True)
def _departures_due(now, dep_t, dep_i, k, n_deps, state, sslot, held, backlog, pend, head, n_pend):
    """The departures due at a turn at ``now``, in FrontEnd._turn's order (its heap's): where they end in
    ``dep_t``, the blocks they free and (at most) the frames they leave owed."""
    freed = 0
    owed = 0
    while k < n_deps and dep_t[k] <= now:
        i = dep_i[k]
        if _live(state[i]):  # (a session that already ended is passed over, as FrontEnd._turn does)
            if sslot[i] >= 0:  # (admitted, its first frame not yet due: no request yet)
                freed += held[sslot[i]]
            owed += backlog[i] + 1
            for q in range(head, n_pend):
                if pend[q, 0] == i:
                    owed += 1
        k += 1
    return k, freed, owed


@nb.njit(cache=True)
def _book_departure(t, i, dep_t, dep_i, fc):
    """FrontEnd._enter's departure: ``(t, i)`` into the departures still to come, in the heap's order."""
    j = fc[C_NDEPS]
    while j > fc[C_DEP] and (dep_t[j - 1] > t or (dep_t[j - 1] == t and dep_i[j - 1] > i)):
        dep_t[j], dep_i[j] = dep_t[j - 1], dep_i[j - 1]
        j -= 1
    dep_t[j], dep_i[j] = t, i
    fc[C_NDEPS] += 1


@nb.njit(cache=True)
def _arrive(now, iconf, fconf, fc, arr_t, dur, state, phase, pslot, next_frame, s_ended, fq, dep_t, dep_i, tick,
            ctl):
    """FrontEnd._turn's arrivals (those up to ``now``): each passes the gate (the controller's may_admit,
    compiled) with the sessions in flight, or is refused (the caller names the reason). One let in waits at the
    tail of the front end's queue, streams from its join frame and has its departure booked (FrontEnd._enter)."""
    P, horizon = fconf[F_P], fconf[F_HORIZON]
    while fc[C_NARR] < iconf[I_NA_END] and arr_t[fc[C_NARR]] <= now:
        i = fc[C_NARR]
        fc[C_NARR] += 1
        if arr_t[i] >= horizon:
            continue
        in_flight = fc[C_NRUN] + fc[C_NWAIT]
        # (the count as a float, as every other caller gives it: one compiled form of the controller's kernel)
        if iconf[I_CTL] == CTL_COMPILED and not ck.may_admit(ctl, now, float(in_flight)):
            state[i] = REFUSED
            s_ended[i] = now
            continue
        state[i] = WAITING
        nf = _join_frame(arr_t[i], P, phase[i])
        next_frame[i] = nf
        fq[fc[C_QHEAD] + fc[C_NWAIT]] = i
        fc[C_NWAIT] += 1
        _book_departure(arr_t[i] + dur[i], i, dep_t, dep_i, fc)
        k = pslot[i]
        tick[k] = min(tick[k], _tick(nf, P, phase[i]))  # (its slot's others, if any, tick no later)


@nb.njit(cache=True)
def _first_chunk(prompt, pending, n_in):
    """A session's first frame's tokens (FrontEnd._request_tokens): the prompt, the input of its silent frames
    and its own."""
    return prompt + pending + n_in


@nb.njit(cache=True)
def _first_fits(i, iconf, maxlen, hist, pending_in):
    """Whether session ``i``'s first frame fits the length limit (FrontEnd._submit: serving.frame_fits)."""
    return hist[i] + _first_chunk(iconf[I_PROMPT], pending_in[i], iconf[I_NIN]) + iconf[I_NOUT] < maxlen


@nb.njit(cache=True)
def _admissions(now, iconf, fconf, lim, free, fc, fq, hist, pending_in, started, next_frame, phase, room, leaving,
                pre_last):
    """FrontEnd._admit's FCFS pass (serving.admit_fcfs), planned: how many heads of the front end's queue (less
    those ``leaving`` before it) get the blocks vLLM's gate wants (serving.admission_need_blocks), none right after a
    step that preempted (``pre_last``), or -1 when one that does is one this loop does not take (a readmission past
    the length limit; a first frame due now past it; either without room for its request)."""
    if pre_last:
        return 0
    n = 0
    for q in range(fc[C_QHEAD], fc[C_QHEAD] + fc[C_NWAIT]):
        i = fq[q]
        gone = False
        for d in leaving:
            gone = gone or d == i
        if gone:
            continue
        tok = hist[i] + pending_in[i] if started[i] else _first_chunk(iconf[I_PROMPT], pending_in[i], iconf[I_NIN])
        need = gate_blocks_jit(tok, lim[L_BS], lim[L_CAP], 0)
        if need > free:
            break
        if started[i]:  # readmitted at once, its history its prompt (FrontEnd._readmit), unless it must rebase
            room -= 1
            if room < 0 or hist[i] + pending_in[i] + iconf[I_TPF] >= lim[L_MAXLEN]:  # (serving.frame_fits)
                return -1
        elif _tick(next_frame[i], fconf[F_P], phase[i]) <= now + fconf[F_EPS]:  # its first frame is due now
            room -= 1
            if room < 0 or not _first_fits(i, iconf, lim[L_MAXLEN], hist, pending_in):
                return -1
        free -= need
        n += 1
    return n


@nb.njit(cache=True)
def _admit(now, n, P, fc, fq, state, next_frame, phase, running_since, admit_seq, s_admitted, admitted, hist,
           pending_in, started, sslot, sess_of_slot, work_step, cnt, status, ntok, maxtok, kseq, wq, new_i, new_s,
           new_k, n_new):
    """The ``n`` heads of the front end's queue are admitted (FrontEnd._admit): a new session runs from its
    first frame's tick, which hands its prompt to the engine; one that lost its place comes back as a new request
    whose prompt is its whole history, and one token to sample (FrontEnd._readmit). Returns the requests the
    caller names so far."""
    for _ in range(n):
        i = fq[fc[C_QHEAD]]
        fc[C_QHEAD] += 1
        fc[C_NWAIT] -= 1
        admit_seq[i] = fc[C_SEQ]
        fc[C_SEQ] += 1
        fc[C_NRUN] += 1
        if np.isnan(s_admitted[i]):
            s_admitted[i] = now
            admitted[i] = True
        if not started[i]:
            state[i] = RUNNING
            running_since[i] = _tick(next_frame[i], P, phase[i])
            continue
        hist[i] += pending_in[i]
        pending_in[i] = 0
        s = add_slot(hist[i], 1, cnt, status, ntok, maxtok, kseq, wq)
        sslot[i], sess_of_slot[s] = s, i
        new_i[n_new], new_s[n_new], new_k[n_new] = i, s, NEW_READMIT
        n_new += 1
        state[i] = PREFILL
        fc[C_NPF] += 1
        work_step[i] = cnt[E_STEPS]
    return n_new


@nb.njit(cache=True)
def _leave_queue(i, fc, fq):
    """Session ``i`` leaves the front end's queue (it departed while waiting)."""
    h, n = fc[C_QHEAD], fc[C_NWAIT]
    j = h
    while fq[j] != i:
        j += 1
    for q in range(j, h + n - 1):
        fq[q] = fq[q + 1]
    fc[C_NWAIT] -= 1


@nb.njit(cache=True)
def _answer(i, f, tok, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans):
    """FrontEnd._answer_many of one frame: session ``i``'s frame ``f`` answered now with ``tok`` tokens (its tick
    key, session and tokens appended to the answers, its counts kept). Returns the answers."""
    a_key[n_ans] = f * PHASE_SLOTS + pslot[i]  # serving.tick_key
    a_who[n_ans] = i
    a_tok[n_ans] = tok
    s_frames[i] += 1
    if tok == 0:  # serving.frame_is_silent
        s_silent[i] += 1
    return n_ans + 1


@nb.njit(cache=True)
def _owe(i, f, tok, lockstep, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans, pend, n_pend):
    """FrontEnd._owe of one frame: session ``i``'s frame ``f``, owed with the ``tok`` tokens it got while it has no
    place, is answered now or, in lockstep, waits for its tick's running frames (:func:`_answer_silent`). Returns
    (answers, frames owed in lockstep)."""
    if lockstep:  # (a tick in lockstep is its frame index: every phase is 0)
        pend[n_pend, 0], pend[n_pend, 1], pend[n_pend, 2] = i, f, tok
        return n_ans, n_pend + 1
    return _answer(i, f, tok, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans), n_pend


@nb.njit(cache=True)
def _owed(i, f, tok, now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who, a_tok, n_ans):
    """A departed session's frame ``f``, with the ``tok`` tokens it got: answered if its deadline has passed (else
    censored), as FrontEnd._end does. Returns the answers."""
    if _tick(f, fconf[F_P], phase[i]) + fconf[F_DEADLINE] <= now + fconf[F_EPS]:
        n_ans = _answer(i, f, tok, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
    return n_ans


@nb.njit(cache=True)
def _depart(i, now, fconf, fc, fq, state, sslot, pslot, phase, next_frame, backlog, inflight, inflight_tok, s_frames,
            s_silent, s_ended, fresh, cnt, status, slots, held, run, kw, wq, pend, n_pend, a_key, a_who, a_tok, n_ans):
    """FrontEnd._end of a session that departs: its request aborted (EngineModel.abort: serving.abort_slot), or
    its place in the front end's queue given up, then the frames it is owed (the lockstep's held ones, the one in
    the engine, the queued ones) answered once their deadline has passed. Returns (answers, frames still owed to
    others)."""
    s = sslot[i]
    if s >= 0:  # (admitted, its first frame not yet due: no request yet)
        abort_slot(s, cnt, status, slots, held, run, kw, wq)
        fresh[s] = False
        sslot[i] = -1
    if state[i] == WAITING:
        _leave_queue(i, fc, fq)
    else:
        fc[C_NRUN] -= 1
        if state[i] == PREFILL:
            fc[C_NPF] -= 1
    m = fc[C_PHEAD]
    for q in range(m, n_pend):
        if pend[q, 0] == i:
            n_ans = _owed(i, pend[q, 1], pend[q, 2], now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who,
                          a_tok, n_ans)
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = pend[q, 0], pend[q, 1], pend[q, 2]
            m += 1
    fc[C_PSORTED] = fc[C_PHEAD]  # (the rows moved: their order is checked again when next needed)
    if inflight[i] >= 0:
        n_ans = _owed(i, inflight[i], inflight_tok[i], now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who,
                      a_tok, n_ans)
    for f in range(next_frame[i] - backlog[i], next_frame[i]):
        n_ans = _owed(i, f, np.int64(0), now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
    inflight[i] = -1
    backlog[i] = 0
    state[i] = ENDED
    s_ended[i] = now
    return n_ans, m


@compiled.inlined
def _turn_plan(now, iconf, fconf, tick, start, who, ready, n_ready, visit, state, phase, next_frame, backlog,
               inflight, hist, pending_in, running_since, started, sslot, lim, cnt, status, held, pend, n_pend, fc, fq,
               dep_t, dep_i, n_room, pre_last):
    """The checks of the turn at ``now``, after its arrivals: the sessions it visits, whether this loop takes the
    rest as FrontEnd._turn would (_turn_fits, the departures, the admissions, room for the answers) and what it
    takes: (visited, taken, departures' end in ``dep_t``, sessions admitted)."""
    n_visit = _due_sessions(now, fconf[F_EPS], tick, start, who, ready, n_ready, state, visit)
    fits, n_ans, room = _turn_fits(now, visit, n_visit, iconf, fconf, lim[L_MAXLEN], state, phase, next_frame, backlog,
                                   inflight, hist, pending_in, running_since, started, sslot, status, n_room)
    k0 = fc[C_DEP]
    k1, freed, owed = _departures_due(now, dep_t, dep_i, k0, fc[C_NDEPS], state, sslot, held, backlog, pend,
                                      fc[C_PHEAD], n_pend)
    n_adm = _admissions(now, iconf, fconf, lim, lim[L_NB] - (cnt[E_USED] - freed), fc, fq, hist, pending_in, started,
                        next_frame, phase, room, dep_i[k0:k1], pre_last)
    taken = (fits and n_adm >= 0 and owed + n_ans <= iconf[I_ANSCAP]
             and (iconf[I_LOCKSTEP] == 0 or n_pend + n_ans <= pend.shape[0]))
    return n_visit, taken, k1, n_adm


# Without numba's reference counting (compiled.inlined: also compiled into run_span): the turn handed on the loop's
# arrays (borrowed, without an owner) at some 330 increments and decrements, no-ops but calls all the same, ~10 % of
# a run. So nothing it calls may allocate or return a view (its sorts work in buffers the span owns:
# _sort_in_place, serving.key_order_in); what allocates, and everything it reaches in other modules, is made with
# compiled.counted, which keeps the counting, or, if it allocates nothing, with compiled.uncounted or
# compiled.inlined: either way its flags are its own, not the turn's. This module's own helpers take the turn's.
@compiled.inlined
def _turn(now, iconf, fconf, tick, start, who, ready, n_ready, visit, state, phase, pslot, sslot, next_frame, backlog,
          inflight, inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_frames,
          s_silent, s_late, fresh, sess_of_slot, lim, cnt, status, computed, ntok, slots, held, out, maxtok, kseq, run,
          kw, wq, a_key, a_who, a_tok, work, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, run_sess, pend, n_pend, fc,
          fq, arr_t, dur, s_admitted, admit_seq, dep_t, dep_i, s_ended, new_i, new_s, new_k, n_new, pre_last, ctl,
          nsteps, live):
    """The front end's turn at ``now`` (FrontEnd._turn): the arrivals, then, if the checks pass (:func:`_turn_plan`;
    else the caller takes the rest of the turn), the departures due, the admissions and the sessions whose frames
    came due (_ticks, _answer_silent). ``fc`` holds the front end's counters. None of it when the span ends here:
    at its next event, after ``nsteps`` of its steps, or without room for another turn and step. Returns (taken,
    frames handed over, the latest, rows, frames owed in lockstep, new requests so far)."""
    P, eps = fconf[F_P], fconf[F_EPS]
    ans_cap = iconf[I_ANSCAP]
    if (now >= fconf[F_TNEXT] or nsteps >= iconf[I_MAXSTEPS] or nrows + 2 * ans_cap > fr_f.size
            or ck.open_samples(ctl) + 2 * ans_cap > ctl.lat.size or n_new + live.size + 1 > new_i.size):
        return False, 0, -1, nrows, n_pend, n_new
    n_in, n_out = iconf[I_NIN], iconf[I_NOUT]
    _arrive(now, iconf, fconf, fc, arr_t, dur, state, phase, pslot, next_frame, s_ended, fq, dep_t, dep_i, tick, ctl)
    n_visit, taken, k1, n_adm = _turn_plan(
        now, iconf, fconf, tick, start, who, ready, n_ready, visit, state, phase, next_frame, backlog, inflight, hist,
        pending_in, running_since, started, sslot, lim, cnt, status, held, pend, n_pend, fc, fq, dep_t, dep_i,
        min(status.size - cnt[E_NEXT], new_i.size - n_new), pre_last)
    if not taken:
        return False, 0, -1, nrows, n_pend, n_new
    n0 = np.int64(0)  # (not a literal: see _engine_step)
    for k in range(fc[C_DEP], k1):
        i = dep_i[k]
        if _live(state[i]):
            n0, n_pend = _depart(i, now, fconf, fc, fq, state, sslot, pslot, phase, next_frame, backlog, inflight,
                                 inflight_tok, s_frames, s_silent, s_ended, fresh, cnt, status, slots, held, run, kw,
                                 wq, pend, n_pend, a_key, a_who, a_tok, n0)
            sl = pslot[i]
            if tick[sl] > now + eps:  # its slot may have no one left to tick
                tick[sl] = _slot_tick(sl, start, who, state, next_frame, phase, P)
    fc[C_DEP] = k1
    if n_adm:  # (rare: a call with all it needs costs every turn)
        n_new = _admit(now, n_adm, P, fc, fq, state, next_frame, phase, running_since, admit_seq, s_admitted,
                       admitted, hist, pending_in, started, sslot, sess_of_slot, work_step, cnt, status, ntok, maxtok,
                       kseq, wq, new_i, new_s, new_k, n_new)
    lockstep = iconf[I_LOCKSTEP] != 0
    n_ans, n_pend = _queue_due(now, visit, n_visit, P, eps, n_in, lockstep, state, phase, pslot, next_frame, backlog,
                               pending_in, s_frames, s_silent, a_key, a_who, a_tok, n0, pend, n_pend)
    for k in range(PHASE_SLOTS):
        if tick[k] <= now + eps:  # the slot's sessions moved on together
            tick[k] = _slot_tick(k, start, who, state, next_frame, phase, P)
    n_sub, latest, n_new = _submit_due(visit, n_visit, 1 + n_in, n_out, iconf[I_PROMPT], sslot, next_frame, backlog,
                                       inflight, inflight_tok, hist, last_tok, pending_in, work_step, started, fresh,
                                       sess_of_slot, cnt, status, computed, ntok, out, maxtok, kseq, kw, wq, new_i,
                                       new_s, new_k, n_new)
    if lockstep:
        n_ans, n_pend = _answer_silent(run_sess, state, inflight, backlog, next_frame, pslot, fc, pend, n_pend,
                                       s_frames, s_silent, a_key, a_who, a_tok, n0)
    nrows = _answered(now, n_ans, iconf, fconf, fc, a_key, a_who, a_tok, work, state, s_admitted, s_late, fr_f,
                      fr_tick, fr_done, fr_lat, fr_i, nrows, ctl)
    return True, n_sub, latest, nrows, n_pend, n_new


@compiled.inlined
def _answered(now, n_ans, iconf, fconf, fc, a_key, a_who, a_tok, work, state, s_admitted, s_late, fr_f, fr_tick,
              fr_done, fr_lat, fr_i, nrows, ctl):
    """The moment's answers recorded (:func:`flush`) and told to a compiled controller as SimEngine._flush_answers
    tells it (row by row; all at one moment: control_kernel.observe_moment). Returns the rows."""
    if n_ans == 0:
        return nrows
    r0 = nrows
    in_flight = fc[C_NRUN] + fc[C_NWAIT]
    nrows = flush(now, n_ans, a_key, a_who, a_tok, state, s_admitted, fconf[F_P], fconf[F_PQ], fconf[F_DEADLINE],
                  fconf[F_EPS], s_late, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows,
                  in_flight if iconf[I_CTL] == CTL_AFTER else -1, work)
    if iconf[I_CTL] == CTL_COMPILED:  # (the rows were all answered at `now` with `in_flight` in flight)
        ck.observe_moment(ctl, now, in_flight, fr_lat[r0:nrows], fr_i[R_FRAMES][r0:nrows], fr_i[R_SILENT][r0:nrows])
    return nrows


@nb.njit(cache=True)
def _answer_silent(run_sess, state, inflight, backlog, next_frame, pslot, fc, pend, n_pend, s_frames, s_silent, a_key,
                   a_who, a_tok, n_ans):
    """FrontEnd._answer_silent (lockstep): frames owed to sessions without a place (``pend``'s rows
    ``fc[C_PHEAD]:n_pend``: session, frame, tokens got) are answered once every running session's frame of their
    tick is done (``run_sess``: the sessions the span may see). Appends them to the answers, in the rows' order;
    returns (the answers, the end of the frames still owed).

    Rows are owed tick after tick, so they are nearly always in frame order, and then the frames answered are the
    rows from the head up to the first one not yet due: the head moves past them and nothing else is read. An
    engine slower than the frame clock holds hundreds of frames owed a tick (every waiting session's), a backlog
    that grows for as long as it stays behind; read whole at every step, it made the loop's time quadratic in the
    run's length. Rows out of frame order (a preempted session's frames, owed late) are read whole and kept in
    their order, as FrontEnd does."""
    unfinished = np.iinfo(np.int64).max
    for j in range(run_sess.size):
        i = run_sess[j]
        if state[i] != RUNNING:
            continue
        if inflight[i] >= 0:
            unfinished = min(unfinished, inflight[i])
        elif backlog[i] > 0:
            unfinished = min(unfinished, next_frame[i] - backlog[i])
    h = fc[C_PHEAD]
    k = max(fc[C_PSORTED], h + 1)
    while k < n_pend and pend[k - 1, 1] <= pend[k, 1]:  # (rows appended since: still in frame order?)
        k += 1
    if k >= n_pend:
        while h < n_pend and pend[h, 1] < unfinished:
            n_ans = _answer(pend[h, 0], pend[h, 1], pend[h, 2], pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
            h += 1
        if h == n_pend:  # none owed: the rows start again at 0
            fc[C_PHEAD] = fc[C_PSORTED] = 0
            return n_ans, 0
        fc[C_PHEAD], fc[C_PSORTED] = h, n_pend
        return n_ans, n_pend
    m = h
    for q in range(h, n_pend):
        i, f = pend[q, 0], pend[q, 1]
        if f < unfinished:
            n_ans = _answer(i, f, pend[q, 2], pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = i, f, pend[q, 2]
            m += 1
    fc[C_PSORTED] = h  # (the rows moved)
    return n_ans, m


@compiled.uncounted
def _preempt_all(step_start, vic, n_vic, iconf, fstate, fc, fq, state, sslot, pslot, next_frame, backlog, inflight,
                 inflight_tok, hist, last_tok, pending_in, s_preempt, s_frames, s_silent, fresh, cnt, status, slots,
                 held, run, kw, wq, a_key, a_who, a_tok, n_ans, pend, n_pend, new_i, new_s, new_k, n_new):
    """After the tokens of a step that started at ``step_start``, the ``n_vic`` sessions of ``vic`` preempted
    (:func:`_preempt_session`; the first ever dates t_sat, ``fstate[FS_TSAT]``). Returns (answers, frames owed in
    lockstep, the requests the caller names or forgets)."""
    for v in range(n_vic):
        n_ans, n_pend, n_new = _preempt_session(vic[v], iconf, fc, fq, state, sslot, pslot, next_frame, backlog,
                                                inflight, inflight_tok, hist, last_tok, pending_in, s_preempt, s_frames,
                                                s_silent, fresh, cnt, status, slots, held, run, kw, wq, a_key, a_who,
                                                a_tok, n_ans, pend, n_pend, new_i, new_s, new_k, n_new)
    if np.isnan(fstate[FS_TSAT]):
        fstate[FS_TSAT] = step_start
    return n_ans, n_pend, n_new


@compiled.inlined
def _answer_step(now, step_start, lat, iconf, fconf, fc, n_done, n_ans, tokens_out, n_vic, pslot, state, inflight,
                 backlog, next_frame, s_frames, s_silent, s_late, s_admitted, a_key, a_who, a_tok, work, run_sess, pend,
                 n_pend, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, st_t, st_lat, st_i, k, o_n, ctl):
    """A step that started at ``step_start``, took ``lat`` and ended at ``now``, its tokens gone to their frames
    (answers up to ``n_done``) and its ``n_vic`` victims preempted (their owed frames answered up to ``n_ans``):
    in lockstep the silent frames they held back, then all answered, one row per tick, and the step's row ``k``
    (FrontEnd._after_step). Returns (frames still owed, frame rows)."""
    if n_pend:
        n_ans, n_pend = _answer_silent(run_sess, state, inflight, backlog, next_frame, pslot, fc, pend, n_pend,
                                       s_frames, s_silent, a_key, a_who, a_tok, n_ans)
    nrows = _answered(now, n_ans, iconf, fconf, fc, a_key, a_who, a_tok, work, state, s_admitted, s_late, fr_f,
                      fr_tick, fr_done, fr_lat, fr_i, nrows, ctl)
    _record_step(st_i, k, fc, o_n[O_SCHED], o_n[O_NEW], o_n[O_CTX], o_n[O_USED], tokens_out, n_ans,
                 a_tok[n_done:n_ans], n_vic)
    st_t[k], st_lat[k] = step_start, lat
    return n_pend, nrows


@compiled.uncounted
def _record_step(st_i, k, fc, nS, new_tokens, ctx, used, tokens_out, n_ans, silent_tok, n_vic):
    """Step row ``k`` (FrontEnd._after_step's): batch, tokens, context, blocks, frames answered, silent ones,
    sessions preempted, running (not re-prefilling) and waiting at the front end (the caller fills the free
    blocks)."""
    silent = 0
    for t in silent_tok:
        if t == 0:  # serving.frame_is_silent
            silent += 1
    st_i[Q_BATCH, k], st_i[Q_NEW, k], st_i[Q_CTX, k], st_i[Q_USED, k] = nS, new_tokens, ctx, used
    st_i[Q_OUT, k], st_i[Q_DONE, k], st_i[Q_SILENT, k] = tokens_out, n_ans, silent
    st_i[Q_RUNNING, k], st_i[Q_WAITING, k], st_i[Q_PRE, k] = fc[C_NRUN] - fc[C_NPF], fc[C_NWAIT], n_vic


@compiled.counted  # (it allocates)
def _queued_behind(live, state, inflight, backlog):
    """Running sessions with frames queued and none in the engine (a step-by-step turn leaves none)."""
    ready = np.empty(live.size, np.int64)
    n = 0
    for j in range(live.size):
        i = live[j]
        if inflight[i] < 0 and backlog[i] > 0 and state[i] == RUNNING:
            ready[n] = i
            n += 1
    return ready, n


@nb.njit(cache=True)
def _next_wake(tick, t_next, fc, dep_t, iconf, arr_t):
    """When an idle engine looks again (SimEngine._run's wait): the next tick, event, departure or arrival."""
    until = min(tick.min(), t_next)
    if fc[C_DEP] < fc[C_NDEPS]:
        until = min(until, dep_t[fc[C_DEP]])
    if fc[C_NARR] < iconf[I_NA_END]:
        until = min(until, arr_t[fc[C_NARR]])
    return until


@nb.njit(cache=True)
def _idle(now, tick, t_next, fc, dep_t, iconf, arr_t, horizon, idle, turned, fstate):
    """An engine without work waits for its next tick, event, departure or arrival (:func:`_next_wake`); one that
    would wake no later than ``now`` hands the span back, one that would wake at the horizon or after waits and
    the run ends there (PAST_HORIZON, ``fstate[1]``). Returns (now, idle, turned, whether the span ends)."""
    until = _next_wake(tick, t_next, fc, dep_t, iconf, arr_t)
    if until <= now:
        return now, idle, turned, True
    if until >= horizon:  # SimPy stops the run during this wait
        fstate[1] = until
        return now, True, PAST_HORIZON, True
    return until, True, turned, False


@compiled.inlined
def _engine_step(now, iconf, fconf, coef, lim, cnt, status, computed, ntok, slots, held, out, maxtok, kseq, run, kw,
                 wq, o_s, o_k, o_pre, o_sam, o_pau, o_n, reached, idle, fresh, step_no, sframe, jit, jz, ja, jb, jp,
                 jr):
    """EngineModel.step (serving.engine_step on the engine model's own arrays) at ``now``, the first-step term and
    the step's latency. Returns (the latency, TURN_CALLER when this loop goes on after it, or where it stops:
    TURN_TAKEN before it, the step the caller's to take (under correlated jitter its frame's draws are not in this
    call); PAST_HORIZON, it outlives the run; STEP_TAKEN, the front end reacts to something in it that the loop does
    not restate)."""
    jitter, f_lo = int(fconf[F_JITTER]), iconf[I_FLO]
    if jitter == CORRELATED and sframe - f_lo >= ja.size:
        return -1.0, TURN_TAKEN
    engine_step(lim, cnt, status, computed, ntok, slots, held, out, maxtok, kseq, run, kw, wq, o_s, o_k, o_pre, o_sam,
                o_pau, o_n, reached)
    # SimEngine._step: a frame starts in a step after the engine idled. (Not a literal False: numba would compile
    # what it is handed to for the literal too; so the zeros below)
    first = np.bool_(False)
    for j in range(o_n[O_SCHED]):
        if fresh[o_s[j]]:
            first = idle
            fresh[o_s[j]] = False
    lat = _step_latency(coef, fconf, o_n[O_SCHED], o_n[O_CTX], o_n[O_NEW], first, jitter, step_no, sframe, f_lo, jit,
                        jz, ja, jb, jp, jr)
    # FrontEnd._after_step's own rules: a step that scheduled nothing stalls; a front end that steps vLLM itself
    # takes back what it preempted, and looks at every request left waiting (serving.deadlock_pick)
    plain = o_n[O_SCHED] > 0 and (iconf[I_SEES] == 0 or (o_n[O_PRE] == 0 and cnt[E_KW] + cnt[E_WQ] == 0))
    if now + lat >= fconf[F_HORIZON]:
        return lat, PAST_HORIZON
    return lat, TURN_CALLER if plain else STEP_TAKEN


@compiled.counted  # (it allocates)
def _span_state(live, state, pslot, next_frame, phase, inflight, backlog, P, lockstep, n_answers, n_slots):
    """What a span keeps besides the caller's arrays: the wheel over the phase slots, the sessions a turn visits,
    those with frames queued, the running ones (lockstep), room for a step's ``n_answers`` answers and, for the
    front end's reaction to a step (:func:`_victims`), room for its victims and scratch over the ``n_slots``
    slots."""
    start, who, tick, ok = _wheel(live, state, pslot, next_frame, phase, P)
    visit = np.empty(2 * live.size, np.int64)
    ready, n_ready = _queued_behind(live, state, inflight, backlog)
    run_sess = live if lockstep else live[:0]
    a_key, a_who, a_tok = np.empty(n_answers, np.int64), np.empty(n_answers, np.int64), np.empty(n_answers, np.int64)
    work = key_order_work(n_answers)  # (flush sorts the answers in it)
    scr, vic = np.zeros((6, n_slots), np.int64), np.empty(live.size, np.int64)
    return (start, who, tick, visit, ready, a_key, a_who, a_tok, work, scr, vic), ok, n_ready, run_sess


@compiled.uncounted
def _reaction(turned, iconf, lim, cnt, status, computed, ntok, held, kw, wq, o_s, o_pre, o_n, sslot, sess_of_slot,
              state, inflight, work_step, admit_seq, backlog, scr, vic, n_pend, pend, n_new, new_i):
    """After _engine_step said ``turned``: a step the front end reacts to (STEP_TAKEN) that scheduled something,
    with a front end that steps vLLM itself, is taken on here (its victims chosen: :func:`_victims`) when the span
    has room for the frames they will be owed and the requests they give up; the rest is the caller's (a stall, or
    vLLM's own loop seeing nothing). Returns (the victims, TURN_CALLER, or ``turned`` as it was)."""
    if turned != STEP_TAKEN or iconf[I_SEES] == 0 or o_n[O_SCHED] == 0:
        return 0, turned
    n_vic, owed = _victims(lim, cnt, status, computed, ntok, held, kw, wq, o_s, o_pre, o_n, sslot, sess_of_slot,
                           state, inflight, work_step, admit_seq, backlog, scr, vic)
    if (o_n[O_SAM] + n_pend + owed > iconf[I_ANSCAP] or n_pend + owed > pend.shape[0]
            or n_new + n_vic > new_i.size):
        return 0, STEP_TAKEN
    return n_vic, TURN_CALLER


# run_span: the state arrays (the engine model's ``eng``, the controller's ``ctl``) are updated in place, records
# written to ``st_*``/``fr_*``, and ``istate``/``fstate``/``fc`` say where it stopped (S_TURNED). ``dep_t``/``dep_i``:
# departures booked, in time order; ``arr_t``/``dur``: arrivals and durations; ``new_i``/``new_s``/``new_k``: each
# request added (first frame, readmission) or aborted (preemption), in order.
@nb.njit(cache=True)
def run_span(iconf, fconf, coef, istate, fstate, live, state, phase, pslot, sslot, next_frame, backlog, inflight,
             inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_tokens,
             s_frames, s_silent, s_late, fresh, sess_of_slot, eng, jit, jz, ja, jb, jp, jr, st_t, st_lat, st_i, fr_f,
             fr_tick, fr_done, fr_lat, fr_i, pend, dep_t, dep_i, s_ended, new_i, new_s, new_k, fc, fq, arr_t, dur,
             s_admitted, admit_seq, s_preempt, ctl):
    """Turns and steps from just after the caller's turn at ``fstate[0]`` until the next event, ``max_steps`` or what
    this loop does not restate (its arrays: the comment above)."""
    P, t_next, horizon, t_pause = fconf[F_P], fconf[F_TNEXT], fconf[F_HORIZON], fconf[F_TPAUSE]
    ans_cap, lockstep = iconf[I_ANSCAP], iconf[I_LOCKSTEP] != 0
    # the arguments live as long as this call: inside it they need no reference counts (compiled.borrowed), and
    # the engine's arrays are unpacked once (a tuple of arrays handed to a callee costs every call)
    (iconf, fconf, coef, istate, fstate, live, state, phase, pslot, sslot, next_frame, backlog, inflight,
     inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_tokens, s_frames,
     s_silent, s_late, fresh, sess_of_slot, jit, jz, ja, jb, jp, jr, st_t, st_lat, st_i, fr_f, fr_tick, fr_done,
     fr_lat, fr_i, pend, dep_t, dep_i, s_ended, new_i, new_s, new_k, fc, fq, arr_t, dur, s_admitted, admit_seq,
     s_preempt) = borrowed((
        iconf, fconf, coef, istate, fstate, live, state, phase, pslot, sslot, next_frame, backlog, inflight,
        inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_tokens, s_frames,
        s_silent, s_late, fresh, sess_of_slot, jit, jz, ja, jb, jp, jr, st_t, st_lat, st_i, fr_f, fr_tick, fr_done,
        fr_lat, fr_i, pend, dep_t, dep_i, s_ended, new_i, new_s, new_k, fc, fq, arr_t, dur, s_admitted, admit_seq,
        s_preempt))
    lim, cnt, status, computed, ntok, slots, held, out, maxtok, kseq, run, kw, wq, o_s, o_k, o_pre, o_sam, o_pau, \
        o_n, reached = borrowed(eng)
    ctl = borrowed(ctl)
    sframe, peak, n_pend, s0 = istate[S_SFRAME], istate[S_PEAK], istate[S_NPEND], istate[S_NSTEPS]
    nrows, now, idle, pre_last = istate[S_NROWS], fstate[0], istate[S_IDLE] != 0, istate[S_PRELAST] != 0
    nsteps, n_new, turned = 0, 0, TURN_TAKEN  # (the caller's turn at `now` is done)
    owned, ok, n_ready, run_sess = _span_state(live, state, pslot, next_frame, phase, inflight, backlog, P, lockstep,
                                               ans_cap + pend.shape[0], status.size)
    start, who, tick, visit, ready, a_key, a_who, a_tok, work, scr, vic = borrowed(owned)  # (held to the end: hold)
    while ok:
        if turned == TURN_CALLER:
            taken, n_sub, latest, nrows, n_pend, n_new = _turn(
                now, iconf, fconf, tick, start, who, ready, n_ready, visit, state, phase, pslot, sslot, next_frame,
                backlog, inflight, inflight_tok, hist, last_tok, pending_in, work_step, running_since, started,
                admitted, s_frames, s_silent, s_late, fresh, sess_of_slot, lim, cnt, status, computed, ntok, slots,
                held, out, maxtok, kseq, run, kw, wq, a_key, a_who, a_tok, work, fr_f, fr_tick, fr_done, fr_lat, fr_i,
                nrows, run_sess, pend, n_pend, fc, fq, arr_t, dur, s_admitted, admit_seq, dep_t, dep_i, s_ended, new_i,
                new_s, new_k, n_new, pre_last, ctl, nsteps, live)
            if not taken:
                break
            sframe, n_ready = max(sframe, latest), 0
            if now >= t_pause:  # the turn is taken: the caller looks, then calls again from here
                turned = PAUSED
                break
        turned = TURN_CALLER
        if cnt[E_RUN] + cnt[E_KW] + cnt[E_WQ] == 0:  # no work: wait (no step ran: no admission is "right after" one)
            now, idle, turned, ends = _idle(now, tick, t_next, fc, dep_t, iconf, arr_t, horizon, idle, turned, fstate)
            pre_last = False
            if ends:
                break
            continue
        lat, turned = _engine_step(now, iconf, fconf, coef, lim, cnt, status, computed, ntok, slots, held, out, maxtok,
                                   kseq, run, kw, wq, o_s, o_k, o_pre, o_sam, o_pau, o_n, reached, idle, fresh, nsteps,
                                   sframe, jit, jz, ja, jb, jp, jr)
        n_vic = 0
        if turned == STEP_TAKEN:  # the front end reacts to the step: here, if it can
            n_vic, turned = _reaction(turned, iconf, lim, cnt, status, computed, ntok, held, kw, wq, o_s, o_pre, o_n,
                                      sslot, sess_of_slot, state, inflight, work_step, admit_seq, backlog, scr, vic,
                                      n_pend, pend, n_new, new_i)
        idle = idle and turned == TURN_TAKEN  # (TURN_TAKEN: the step is the step-by-step path's to take)
        if turned != TURN_CALLER:  # (SimPy stops a run during a step that outlives it; STEP_TAKEN: it took `lat`)
            fstate[1] = now + lat if turned == PAST_HORIZON else lat
            break
        step_start, now, pre_last = now, now + lat, n_vic > 0
        tokens_out, n_done, n_ready = _tokens_to_frames(
            now, o_sam, o_n[O_SAM], iconf[I_NOUT], sess_of_slot, pslot, inflight, inflight_tok, s_tokens, s_frames,
            hist, last_tok, backlog, a_key, a_who, a_tok, ready, state, running_since, fc)
        n_ans = n_done
        if n_vic:
            n_ans, n_pend, n_new = _preempt_all(
                step_start, vic, n_vic, iconf, fstate, fc, fq, state, sslot, pslot, next_frame, backlog, inflight,
                inflight_tok, hist, last_tok, pending_in, s_preempt, s_frames, s_silent, fresh, cnt, status, slots,
                held, run, kw, wq, a_key, a_who, a_tok, n_ans, pend, n_pend, new_i, new_s, new_k, n_new)
        n_pend, nrows = _answer_step(now, step_start, lat, iconf, fconf, fc, n_done, n_ans, tokens_out, n_vic, pslot,
                                     state, inflight, backlog, next_frame, s_frames, s_silent, s_late, s_admitted,
                                     a_key, a_who, a_tok, work, run_sess, pend, n_pend, fr_f, fr_tick, fr_done, fr_lat,
                                     fr_i, nrows, st_t, st_lat, st_i, s0 + nsteps, o_n, ctl)
        peak, nsteps = max(peak, o_n[O_USED]), nsteps + 1
    istate[S_SFRAME], istate[S_PEAK], istate[S_NSTEPS], istate[S_NROWS], istate[S_TURNED], istate[S_IDLE], \
        istate[S_NPEND], istate[S_NNEW], istate[S_PRELAST], fstate[0] = sframe, peak, nsteps, nrows, turned, idle, \
        n_pend, n_new, pre_last, now
    hold(owned)


# what run_span compiles into itself from other modules: the engine step (with the residency it calls), the step
# model's form, the jitter ratio, the admission controllers, the hold on borrowed arrays, what a silent frame is and
# the session states (the front end's module: its constants are compiled in as they were)
FORM_PARTS = (serving, kv_policy, step_inputs, jitter_kernel, control_kernel, admission, percentile_kernel, compiled,
              results.silent_cause, front_end)
STEP_FORM = compiled.guard(run_span, FORM_PARTS)  # before any loop is called, so none has loaded its cache yet
