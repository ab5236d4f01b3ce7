"""The simulator's hot loop, compiled: turns and steps of a steady span, one machine-code loop.

An hour of Moshi is hundreds of thousands of steps, and under independent phases nothing repeats from one step
to the next that numpy could take a whole span at a time. This module runs the front end's rules one step at a
time in numba, under either phase regime: the turn (frames that came due are handed to the engine,
:meth:`SimEngine._ticks`; a session without a place hears silence, at once or, in lockstep, with its tick's
running frames, :meth:`SimEngine._answer_silent`), ``EngineModel.step`` (running requests first, then the
kv-holding queue head first, out-of-window frees before each allocation, the full-sequence gate and watermark
on admission), the step's latency with its jitter draw and :meth:`SimEngine._after_step`'s bookkeeping and
records. A turn visits only the phase slots whose tick came due and a step reads only the requests with work,
so a step's cost follows its batch, not the sessions in flight.

It covers what a steady span holds and nothing else: every live session runs or waits at the front end, nothing
prefills, the engine's waiting queue is empty, and each step gives every request with work its blocks and its
tokens within the budget. Before doing anything a step or a turn would do differently (a failed allocation that
would preempt, the token budget, ``max_num_seqs``, the length limit, the front end's head fitting, a session's
first frame, the next arrival or controller poll) it stops and hands back to the step-by-step path, which takes
it from exactly there. A running session's departure is taken here (SimEngine._end: its request aborted, the
frames it is owed answered) when no controller counts the sessions in flight; otherwise, and for a session
waiting at the front end, it is an event the loop stops at. ``tests/test_sim_scenarios.py`` compares the two,
bit for bit.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import numba as nb
import numpy as np

from metronome import jitter_kernel
from metronome.calibration import step_inputs
from metronome.jitter_kernel import correlated_ratio
from metronome.serving import PHASE_SLOTS, EngineModel

P_CODE, W_CODE, R_CODE = EngineModel.PAUSED_CODE, EngineModel.WAITING_CODE, EngineModel.RUNNING_CODE

# iconf: the engine and stream constants
I_BS, I_BOUNDED, I_SINKB, I_WINDOW, I_NB, I_MAXSEQS, I_BUDGET, I_MAXLEN, I_WM, I_THR, I_CAP, I_NIN, I_NOUT, \
    I_MAXSTEPS, I_SLOTS, I_NRUNNING, I_NWAITING, I_HEAD, I_PROMPT, I_ANSCAP, I_FLO, I_LOCKSTEP = range(22)
# frame rows' integer columns (fr_i)
R_FRAMES, R_LATE, R_TOKENS, R_SILENT, R_SILENT_PRE = range(5)
WAITING_STATE, R_STATE, ENDED_STATE = 1, 3, 4  # SimEngine's states: waiting for blocks, running, ended
# fconf: times and the step-latency model's real-time terms (its coefficients come as their own array, ``coef``)
# (F_TPAUSE: the loop hands back after the first turn from then on, so a caller can look at the run, e.g. whether
# its outcome is decided; unlike F_TNEXT it is no event, and nothing waits for it)
F_P, F_PQ, F_DEADLINE, F_TNEXT, F_FIRST, F_EPS, F_JITTER, F_HORIZON, F_WZ, F_WSHARED, F_WOWN, F_TPAUSE = range(12)
# fconf[F_JITTER]: no jitter; independent (each step's ratio given, ``jit``); correlated (a step's ratio from its own
# score ``jz`` and the parts ``ja``/``jb`` of the frame it is taken on, frames iconf[I_FLO] on)
NO_JITTER, INDEPENDENT, CORRELATED = 0, 1, 2
# the step model's form, compiled from its one statement (so a new term needs no change here)
_step_inputs = nb.njit(cache=True)(step_inputs)
# istate[S_TURNED]: 0 the caller takes the turn at fstate[0]; 1 the turn there is taken, the step is the caller's;
# 2 a step (or a wait) starts at fstate[0] and ends at fstate[1], at or past the horizon, where SimPy stops the
# run (the step-by-step path never gets to its records either); 3 the turn at fstate[0] is taken and the loop
# paused there (F_TPAUSE): called again, it goes on from that very point
TURN_CALLER, TURN_TAKEN, PAST_HORIZON, PAUSED = 0, 1, 2, 3
# istate (in/out): the engine's counters; then what the call did
# the engine's counters a turn's departures change (``cnt``): blocks used, paused requests, the running list's and
# the kv-holding queue's lengths, sessions running at the front end, departures taken
C_USED, C_PAUSED, C_RUNLEN, C_KVHLEN, C_NRUN, C_DEP = range(6)
# (S_NDEP: the departures taken, the first of ``dep_t``)
S_USED, S_PAUSED, S_MSTEPS, S_SFRAME, S_PEAK, S_RUNLEN, S_KVHLEN, S_NSTEPS, S_NROWS, S_TURNED, S_IDLE, S_NPEND, \
    S_NDEP = range(13)


@nb.njit(cache=True)
def _res_blocks(n, bs, bounded, sinkb, window):
    total = (n + bs - 1) // bs
    if not bounded:
        return total
    lo = max(n - window + 1, 0) // bs
    return min(lo, sinkb) + total - lo


@nb.njit(cache=True)
def _res_tokens(n, bs, bounded, sinkb, window):
    if not bounded:
        return n
    lo = max(n - window + 1, 0) // bs
    return min(lo, sinkb) * bs + (n - lo * bs)


@nb.njit(cache=True)
def _tick(f, P, ph):
    return f * P + ph


@nb.njit(cache=True)
def _tokens(s, ntok, computed, thr, maxlen, cap_len):
    """Tokens request ``s`` is scheduled (EngineModel._tokens_for; the running pass also caps at the length)."""
    k = ntok[s] - computed[s]
    if 0 < thr < k:
        k = thr
    if cap_len:
        k = min(k, maxlen - computed[s] - 1)
    return k


@nb.njit(cache=True)
def _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window):
    """EngineModel._allocate's arithmetic: blocks freed out of the window at the computed count, then the new
    blocks the chunk of ``k`` tokens needs."""
    freed = 0
    if slots[s] > 0 and bounded:
        keep = _res_blocks(computed[s], bs, bounded, sinkb, window)
        if keep < held[s]:
            freed = held[s] - keep
    return freed, max((computed[s] + k + bs - 1) // bs - slots[s], 0)


@nb.njit(cache=True)
def _take(s, freed, need, slots, held):
    """Commit an allocation; returns the change in blocks used."""
    held[s] += need - freed
    slots[s] += need
    return need - freed


@nb.njit(cache=True)
def flush(now, n, keys, who, toks, admitted, P, Pq, deadline, eps, s_late, fr_f, fr_tick, fr_done, fr_lat, fr_i,
           nrows):
    """``n`` answers (tick key, session, tokens got) become one row per tick, in tick order, all answered at
    ``now``; a late frame counts against its session (``s_late``). Both paths record their rows with it
    (SimEngine._flush_answers). Returns the rows written so far."""
    if n == 0:
        return nrows
    # rows are sums over a tick: the order within one does not matter (and one answer needs no sort)
    order = np.zeros(1, np.int64) if n == 1 else np.argsort(keys[:n])
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
        sil = 0
        pre = 0
        for q in range(j, e):
            i = who[order[q]]
            tk += toks[order[q]]
            if toks[order[q]] == 0:  # serving.frame_is_silent
                sil += 1
                if admitted[i]:
                    pre += 1
            if late:
                s_late[i] += 1
        fr_f[nrows] = f
        fr_tick[nrows] = tick
        fr_done[nrows] = now
        fr_lat[nrows] = latency
        fr_i[nrows, R_FRAMES] = e - j
        fr_i[nrows, R_LATE] = (e - j) if late else 0
        fr_i[nrows, R_TOKENS] = tk
        fr_i[nrows, R_SILENT] = sil
        fr_i[nrows, R_SILENT_PRE] = pre
        nrows += 1
        j = e
    return nrows


@nb.njit(cache=True)
def _wheel(live, pslot, next_frame, phase, P):
    """The live sessions by phase slot (slot k's: ``who[start[k]:start[k + 1]]``) and each slot's next tick.

    A turn takes every frame that came due, so every session of a slot is before the same next frame; the turn
    then visits only the slots that came due, not every live session. ``ok`` is False when a slot's sessions are
    not on one frame (the caller then steps one at a time)."""
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
    return st == R_STATE or st == WAITING_STATE


@nb.njit(cache=True)
def _slot_tick(k, start, who, state, next_frame, phase, P):
    """Slot ``k``'s next tick: its live sessions' (all on one frame), or never when all of them departed."""
    for q in range(start[k], start[k + 1]):
        i = who[q]
        if _live(state[i]):
            return _tick(next_frame[i], P, phase[i])
    return np.inf


@nb.njit(cache=True)
def _turn_fits(now, visit, n_visit, iconf, fconf, state, phase, next_frame, backlog, inflight, hist, running_since,
               started, sslot, status):
    """The turn's checks: every due frame of the visited sessions is one the compiled turn takes as the
    step-by-step one would (a running session's, on a paused request, fitting the length limit). Returns
    (whether all pass, the silent answers the turn will write)."""
    P, eps, maxlen = fconf[F_P], fconf[F_EPS], iconf[I_MAXLEN]
    chunk, n_out = 1 + iconf[I_NIN], iconf[I_NOUT]
    n_ans = 0
    for j in range(n_visit):
        i = visit[j]
        t = _tick(next_frame[i], P, phase[i])
        due = t <= now + eps
        if state[i] == WAITING_STATE:  # each due frame will be answered silent
            k = 0
            while _tick(next_frame[i] + k, P, phase[i]) <= now + eps:
                k += 1
            n_ans += k
            continue
        if due and (not started[i] or t < running_since[i] - eps):
            return False, n_ans
        if inflight[i] < 0 and (due or backlog[i] > 0):
            s = sslot[i]
            if s < 0 or status[s] != P_CODE or hist[i] + chunk + n_out >= maxlen:  # serving.frame_fits
                return False, n_ans
    return True, n_ans


@nb.njit(cache=True)
def _queue_due(now, visit, n_visit, P, eps, n_in, held, state, phase, pslot, next_frame, backlog, pending_in,
               s_frames, s_silent, a_key, a_who, a_tok, n0):
    """The turn, first half: frames that came due are queued (a running session's) or answered silent at once
    (a session waiting at the front end: SimEngine._tick_one's quiet branch and _owe), after the ``n0`` answers
    already written. Returns the answers."""
    n_ans = n0
    for j in range(n_visit):
        i = visit[j]
        nf, ph = next_frame[i], phase[i]
        if state[i] == ENDED_STATE:  # departed in this turn
            continue
        if state[i] == WAITING_STATE:
            while _tick(next_frame[i], P, ph) <= now + eps:
                a_key[n_ans] = next_frame[i] * PHASE_SLOTS + pslot[i]
                a_who[n_ans] = i
                a_tok[n_ans] = 0
                n_ans += 1
                next_frame[i] += 1
                pending_in[i] += n_in
                if not held:  # answered now (in lockstep: when :func:`_answer_silent` answers it)
                    s_frames[i] += 1
                    s_silent[i] += 1
            continue
        if _tick(nf, P, ph) <= now + eps:
            if _tick(nf + 1, P, ph) > now + eps:
                n_due = 1
            else:  # an engine slower than the frame clock: SimEngine._ticks's count, exactly
                n_due = np.int64(np.floor((now + eps - ph) / P)) - nf + 1
                if _tick(nf + n_due - 1, P, ph) > now + eps:
                    n_due -= 1
                if _tick(nf + n_due, P, ph) <= now + eps:
                    n_due += 1
            backlog[i] += n_due
            next_frame[i] += n_due
    return n_ans


@nb.njit(cache=True)
def _submit_due(visit, n_visit, chunk, n_out, m_steps, sslot, next_frame, backlog, inflight, inflight_tok, hist,
                last_tok, work_step, status, computed, ntok, out, maxtok, fresh, kw, kw_len):
    """The turn, second half: a paused session's oldest queued frame is handed to its request
    (EngineModel.append_many), which waits in the kv-holding queue (``kw``). Returns (the queue's waiting
    entries, how many were handed over, the latest frame handed)."""
    n_sub = 0
    latest = -1
    for j in range(n_visit):
        i = visit[j]
        if inflight[i] < 0 and backlog[i] > 0:
            s = sslot[i]
            ntok[s] = computed[s] + chunk
            maxtok[s] = n_out
            out[s] = 0
            status[s] = W_CODE
            fresh[s] = True
            f = next_frame[i] - backlog[i]
            hist[i] += chunk
            last_tok[i] = False
            backlog[i] -= 1
            inflight[i] = f
            inflight_tok[i] = 0
            latest = max(latest, f)
            work_step[i] = m_steps
            kw[kw_len] = s
            kw_len += 1
            n_sub += 1
    return kw_len, n_sub, latest


@nb.njit(cache=True)
def _by_seq(kw, kw_len, kseq):
    """The kv-holding queue's waiting entries in queue order: insertion sort when they are few or in order, a
    sort of their places when many come out of order (past N* every session's frame waits in every turn)."""
    if kw_len > 32:
        inv = 0
        for a in range(1, kw_len):
            if kseq[kw[a - 1]] > kseq[kw[a]]:
                inv += 1
        if inv > 8:
            places = np.empty(kw_len, np.int64)
            for a in range(kw_len):
                places[a] = kseq[kw[a]]
            order = np.argsort(places)  # places are distinct: any sort gives the one order
            keep = kw[:kw_len].copy()
            for a in range(kw_len):
                kw[a] = keep[order[a]]
            return
    for a in range(1, kw_len):
        s = kw[a]
        b = a - 1
        while b >= 0 and kseq[kw[b]] > kseq[s]:
            kw[b + 1] = kw[b]
            b -= 1
        kw[b + 1] = s


@nb.njit(cache=True)
def _step_fits(iconf, used, n_paused, run_len, kvh_len, run_arr, kw, kw_len, status, computed, ntok, slots, held):
    """EngineModel.step's checks: would it give every running request and every waiting kv-holding one (in
    queue order) its blocks and its tokens, within the budget, max_num_seqs, the full-sequence gate and the
    watermark? Returns (whether it would, the tokens it schedules)."""
    bs, bounded, sinkb, window = iconf[I_BS], iconf[I_BOUNDED] != 0, iconf[I_SINKB], iconf[I_WINDOW]
    NB, maxseqs, B, maxlen = iconf[I_NB], iconf[I_MAXSEQS], iconf[I_BUDGET], iconf[I_MAXLEN]
    wm_blocks, cap = iconf[I_WM], iconf[I_CAP]
    thr = iconf[I_THR] if run_len + kvh_len > 1 else 0
    free = NB - used
    tot = 0
    for j in range(run_len):
        s = run_arr[j]
        k = _tokens(s, ntok, computed, thr, maxlen, True)
        if k <= 0:
            continue
        tot += k
        if tot > B:
            return False, tot
        freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
        free += freed
        if need > free:
            return False, tot
        free -= need
    if kw_len and tot >= B:
        return False, tot
    for j in range(kw_len):
        s = kw[j]
        if maxseqs - run_len - n_paused - j <= 0:
            return False, tot
        k = _tokens(s, ntok, computed, thr, maxlen, False)
        tot += k
        if k <= 0 or tot > B:
            return False, tot
        wm = wm_blocks if run_len + j > 0 else 0
        gate = (min(ntok[s], maxlen) + bs - 1) // bs
        if cap >= 0 and gate > cap:
            gate = cap
        gate = max(gate - slots[s], 0)
        if gate + wm > free:
            return False, tot
        freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
        if need + wm > free + freed:
            return False, tot
        free += freed - need
    return True, tot


@nb.njit(cache=True)
def _schedule(iconf, used, run_len, kvh_len, run_arr, kw, kw_len, status, computed, ntok, slots, held, sched, schk):
    """The step's allocations, once :func:`_step_fits` said every request gets its own: the running ones in
    order, then the waiting kv-holding ones join the running list. Returns (blocks used, the running list's
    length, how many are scheduled)."""
    bs, bounded, sinkb, window = iconf[I_BS], iconf[I_BOUNDED] != 0, iconf[I_SINKB], iconf[I_WINDOW]
    thr = iconf[I_THR] if run_len + kvh_len > 1 else 0
    maxlen = iconf[I_MAXLEN]
    nS = 0
    for j in range(run_len + kw_len):
        s = run_arr[j] if j < run_len else kw[j - run_len]
        k = _tokens(s, ntok, computed, thr, maxlen, j < run_len)
        if k <= 0:
            continue
        freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
        used += _take(s, freed, need, slots, held)
        sched[nS] = s
        schk[nS] = k
        nS += 1
    for j in range(kw_len):
        status[kw[j]] = R_CODE
        run_arr[run_len + j] = kw[j]
    return used, run_len + kw_len, nS


@nb.njit(cache=True)
def _run_model(iconf, idle, sched, schk, nS, run_arr, run_len, status, computed, ntok, out, maxtok, fresh, sampled):
    """The model run: each scheduled request computes its tokens, samples when it has computed them all, and
    pauses at its frame's last token. Returns (new tokens, context tokens, whether a frame's first step follows
    the idle gap, how many sampled, how many paused, the running list's length)."""
    bs, bounded, sinkb, window = iconf[I_BS], iconf[I_BOUNDED] != 0, iconf[I_SINKB], iconf[I_WINDOW]
    new_tokens = 0
    ctx = 0
    first = False
    n_sam = 0
    n_pause = 0
    for j in range(nS):
        s = sched[j]
        new_tokens += schk[j]
        computed[s] += schk[j]
        if fresh[s]:
            first = idle
            fresh[s] = False
        ctx += _res_tokens(computed[s], bs, bounded, sinkb, window)
        if computed[s] >= ntok[s]:
            ntok[s] += 1
            out[s] += 1
            sampled[n_sam] = s  # in schedule order
            n_sam += 1
            if out[s] >= maxtok[s]:
                status[s] = P_CODE
                n_pause += 1
    if n_pause:
        m = 0
        for j in range(run_len):
            s = run_arr[j]
            if status[s] == R_CODE:
                run_arr[m] = s
                m += 1
        run_len = m
    return new_tokens, ctx, first, n_sam, n_pause, run_len


@nb.njit(cache=True)
def _hold(sched, nS, status, kvh_all, n_all, kseq):
    """Requests paused in the step join the kv-holding queue, in schedule order (``kseq``: a request's place in
    ``kvh_all``; an earlier place of the same request is stale). Returns (the queue, its entries so far)."""
    for j in range(nS):
        s = sched[j]
        if status[s] == P_CODE:
            if n_all == kvh_all.size:
                grown = np.empty(2 * kvh_all.size + 16, np.int64)
                grown[:n_all] = kvh_all[:n_all]
                kvh_all = grown
            kvh_all[n_all] = s
            kseq[s] = n_all
            n_all += 1
    return kvh_all, n_all


@nb.njit(cache=True)
def _step_latency(coef, fconf, nS, ctx, new_tokens, first, jitter, step_no, sframe, f_lo, jit, jz, ja, jb, jp, jr):
    """StepLatencyModel.step_s (the same sums in the same order, bit for bit), the first-step term, the jitter."""
    xs = _step_inputs(float(nS), float(ctx), float(new_tokens))
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


@nb.njit(cache=True)
def _tokens_to_frames(sampled, n_sam, n_out, sess_of_slot, pslot, inflight, inflight_tok, s_tokens, s_frames, hist,
                      last_tok, backlog, a_key, a_who, a_tok, ready):
    """SimEngine._after_step: sampled tokens go to their frames; a frame with all its tokens is answered (its
    tick key, session, tokens). Returns (tokens out, frames done, sessions with frames still queued)."""
    tokens_out = 0
    n_done = 0
    for j in range(n_sam):
        i = sess_of_slot[sampled[j]]
        if inflight[i] >= 0:
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


@nb.njit(cache=True)
def _departures_due(now, dep_t, dep_i, k, state, sslot, held, backlog, pend, n_pend):
    """The departures due at a turn at ``now``, in SimEngine._turn's order (its heap's): whether this loop can
    take them all (none is of a session waiting at the front end, whose queue it does not keep), where they end
    in ``dep_t``, the blocks they free and (at most) the frames they leave owed."""
    freed = 0
    owed = 0
    while k < dep_t.size and dep_t[k] <= now:
        i = dep_i[k]
        if state[i] == WAITING_STATE:
            return False, k, 0, 0
        if state[i] == R_STATE:  # (a session that already ended is passed over, as SimEngine._turn does)
            if sslot[i] >= 0:  # (admitted, its first frame not yet due: no request yet)
                freed += held[sslot[i]]
            owed += backlog[i] + 1
            for q in range(n_pend):
                if pend[q, 0] == i:
                    owed += 1
        k += 1
    return True, k, freed, owed


@nb.njit(cache=True)
def _remove(arr, n, x):
    """Drop ``x`` from ``arr[:n]``, keeping the order; returns the new length."""
    m = 0
    for j in range(n):
        if arr[j] != x:
            arr[m] = arr[j]
            m += 1
    return m


@nb.njit(cache=True)
def _answer(i, f, tok, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans):
    """SimEngine._answer_many of one frame: session ``i``'s frame ``f`` answered now with ``tok`` tokens (its tick
    key, session and tokens appended to the answers, its counts kept). Returns the answers."""
    a_key[n_ans] = f * PHASE_SLOTS + pslot[i]  # serving.tick_key
    a_who[n_ans] = i
    a_tok[n_ans] = tok
    s_frames[i] += 1
    if tok == 0:  # serving.frame_is_silent
        s_silent[i] += 1
    return n_ans + 1


@nb.njit(cache=True)
def _owed(i, f, tok, now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who, a_tok, n_ans):
    """A departed session's frame ``f``, with the ``tok`` tokens it got: answered if its deadline has passed (else
    censored), as SimEngine._end does. Returns the answers."""
    if _tick(f, fconf[F_P], phase[i]) + fconf[F_DEADLINE] <= now + fconf[F_EPS]:
        n_ans = _answer(i, f, tok, pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
    return n_ans


@nb.njit(cache=True)
def _depart(i, now, fconf, cnt, state, sslot, pslot, phase, next_frame, backlog, inflight, inflight_tok, s_frames,
            s_silent, s_ended, status, held, slots, fresh, run_arr, kw, kw_len, pend, n_pend, a_key, a_who, a_tok,
            n_ans):
    """SimEngine._end of a running session that departs: its request aborted (EngineModel.abort: blocks freed,
    out of the running list or the kv-holding queue), then the frames it is owed (the lockstep's held ones, the
    one in the engine, the queued ones) answered once their deadline has passed. Returns (answers, frames still
    owed to others, the kv-holding queue's waiting entries)."""
    s = sslot[i]
    if s >= 0:  # (admitted, its first frame not yet due: no request yet)
        st = status[s]
        cnt[C_USED] -= held[s]
        held[s] = 0
        slots[s] = 0
        status[s] = 0
        fresh[s] = False
        if st == R_CODE:
            cnt[C_RUNLEN] = _remove(run_arr, cnt[C_RUNLEN], s)
        else:  # paused or waiting: in the kv-holding queue (its entry is dropped when the queue is written back)
            cnt[C_KVHLEN] -= 1
            if st == P_CODE:
                cnt[C_PAUSED] -= 1
            else:
                kw_len = _remove(kw, kw_len, s)
        sslot[i] = -1
    cnt[C_NRUN] -= 1
    m = 0
    for q in range(n_pend):
        if pend[q, 0] == i:
            n_ans = _owed(i, pend[q, 1], pend[q, 2], now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who,
                          a_tok, n_ans)
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = pend[q, 0], pend[q, 1], pend[q, 2]
            m += 1
    if inflight[i] >= 0:
        n_ans = _owed(i, inflight[i], inflight_tok[i], now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who,
                      a_tok, n_ans)
    for f in range(next_frame[i] - backlog[i], next_frame[i]):
        n_ans = _owed(i, f, 0, now, fconf, pslot, phase, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
    inflight[i] = -1
    backlog[i] = 0
    state[i] = ENDED_STATE
    s_ended[i] = now
    return n_ans, m, kw_len


@nb.njit(cache=True)
def _turn(now, iconf, fconf, tick, start, who, ready, n_ready, visit, kw, kw_len, m_steps, state, phase, pslot,
          sslot, next_frame, backlog, inflight, inflight_tok, hist, last_tok, pending_in, work_step, running_since,
          started, admitted, s_frames, s_silent, s_late, status, computed, ntok, out, maxtok, fresh, a_key, a_who,
          a_tok, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, run_sess, pend, n_pend, cnt, dep_t, dep_i, s_ended,
          run_arr, held, slots):
    """The front end's turn at ``now`` (SimEngine._turn): the departures due, then the sessions whose frames came
    due (_ticks, _answer_silent), if its checks pass; ``cnt`` holds the engine's counters the departures change.
    Returns (taken, the kv-holding queue's waiting entries, frames handed over, the latest, rows, frames owed in
    lockstep)."""
    P, Pq, deadline, eps = fconf[F_P], fconf[F_PQ], fconf[F_DEADLINE], fconf[F_EPS]
    n_in, n_out = iconf[I_NIN], iconf[I_NOUT]
    n_visit = _due_sessions(now, eps, tick, start, who, ready, n_ready, state, visit)
    fits, n_ans = _turn_fits(now, visit, n_visit, iconf, fconf, state, phase, next_frame, backlog, inflight,
                             hist, running_since, started, sslot, status)
    k0 = cnt[C_DEP]
    deps, k1, freed, owed = _departures_due(now, dep_t, dep_i, k0, state, sslot, held, backlog, pend, n_pend)
    lockstep = iconf[I_LOCKSTEP] != 0
    if (not fits or not deps or owed + n_ans > iconf[I_ANSCAP] or (lockstep and n_pend + n_ans > pend.shape[0])
            or _front_head_fits(iconf, cnt[C_USED] - freed, hist, pending_in, started)):  # SimEngine._admit's turn
        return False, kw_len, 0, -1, nrows, n_pend
    n0 = 0
    for k in range(k0, k1):
        i = dep_i[k]
        if state[i] == R_STATE:
            n0, n_pend, kw_len = _depart(i, now, fconf, cnt, state, sslot, pslot, phase, next_frame, backlog,
                                         inflight, inflight_tok, s_frames, s_silent, s_ended, status, held, slots,
                                         fresh, run_arr, kw, kw_len, pend, n_pend, a_key, a_who, a_tok, n0)
            sl = pslot[i]
            if tick[sl] > now + eps:  # its slot may have no one left to tick
                tick[sl] = _slot_tick(sl, start, who, state, next_frame, phase, P)
    cnt[C_DEP] = k1
    n_ans = _queue_due(now, visit, n_visit, P, eps, n_in, lockstep, state, phase, pslot, next_frame, backlog,
                       pending_in, s_frames, s_silent, a_key, a_who, a_tok, n0)
    for k in range(PHASE_SLOTS):
        if tick[k] <= now + eps:  # the slot's sessions moved on together
            tick[k] = _slot_tick(k, start, who, state, next_frame, phase, P)
    kw_len, n_sub, latest = _submit_due(visit, n_visit, 1 + n_in, n_out, m_steps, sslot, next_frame, backlog,
                                        inflight, inflight_tok, hist, last_tok, work_step, status, computed,
                                        ntok, out, maxtok, fresh, kw, kw_len)
    if lockstep:
        n_pend = _owe_silent(n0, n_ans, a_key, a_who, pend, n_pend)
        n_ans, n_pend = _answer_silent(run_sess, inflight, backlog, next_frame, pslot, pend, n_pend, s_frames,
                                       s_silent, a_key, a_who, a_tok, n0)
    if n_ans:
        nrows = flush(now, n_ans, a_key, a_who, a_tok, admitted, P, Pq, deadline, eps, s_late,
                      fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows)
    return True, kw_len, n_sub, latest, nrows, n_pend


@nb.njit(cache=True)
def _answer_silent(run_sess, inflight, backlog, next_frame, pslot, pend, n_pend, s_frames, s_silent, a_key, a_who,
                   a_tok, n_ans):
    """SimEngine._answer_silent (lockstep): frames owed to sessions without a place (``pend``: session, frame,
    tokens got) are answered once every running session's frame of their tick is done. Appends them to the
    answers; returns (the answers, the frames still owed)."""
    unfinished = np.iinfo(np.int64).max
    for j in range(run_sess.size):
        i = run_sess[j]
        if inflight[i] >= 0:
            unfinished = min(unfinished, inflight[i])
        elif backlog[i] > 0:
            unfinished = min(unfinished, next_frame[i] - backlog[i])
    m = 0
    for q in range(n_pend):
        i, f = pend[q, 0], pend[q, 1]
        if f < unfinished:
            n_ans = _answer(i, f, pend[q, 2], pslot, s_frames, s_silent, a_key, a_who, a_tok, n_ans)
        else:
            pend[m, 0], pend[m, 1], pend[m, 2] = i, f, pend[q, 2]
            m += 1
    return n_ans, m


@nb.njit(cache=True)
def _owe_silent(n0, n_ans, a_key, a_who, pend, n_pend):
    """SimEngine._owe in lockstep: the turn's silent frames (answers ``n0`` on) wait for their tick's running frames."""
    for q in range(n0, n_ans):
        pend[n_pend, 0], pend[n_pend, 1], pend[n_pend, 2] = a_who[q], a_key[q] // PHASE_SLOTS, 0
        n_pend += 1
    return n_pend


@nb.njit(cache=True)
def _answer_step(now, iconf, fconf, sampled, n_sam, sess_of_slot, pslot, inflight, inflight_tok, s_tokens, s_frames,
                 s_silent, s_late, hist, last_tok, backlog, next_frame, admitted, a_key, a_who, a_tok, ready, run_sess,
                 pend, n_pend, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, row, nS, new_tokens, ctx, used, n_running):
    """After a step that ended at ``now``: tokens to their frames, finished frames (and in lockstep the silent
    ones they held back) answered, one row per tick, and the step's row. Returns (sessions with frames still
    queued, frames still owed, frame rows)."""
    tokens_out, n_done, n_ready = _tokens_to_frames(sampled, n_sam, iconf[I_NOUT], sess_of_slot, pslot, inflight,
                                                    inflight_tok, s_tokens, s_frames, hist, last_tok, backlog,
                                                    a_key, a_who, a_tok, ready)
    n_ans = n_done
    if n_pend:
        n_ans, n_pend = _answer_silent(run_sess, inflight, backlog, next_frame, pslot, pend, n_pend, s_frames,
                                       s_silent, a_key, a_who, a_tok, n_done)
    nrows = flush(now, n_ans, a_key, a_who, a_tok, admitted, fconf[F_P], fconf[F_PQ], fconf[F_DEADLINE],
                   fconf[F_EPS], s_late, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows)
    _record_step(row, iconf, nS, new_tokens, ctx, used, tokens_out, n_ans, a_tok[n_done:n_ans], n_running)
    return n_ready, n_pend, nrows


@nb.njit(cache=True)
def _record_step(row, iconf, nS, new_tokens, ctx, used, tokens_out, n_ans, silent_tok, n_running):
    """A step's row (SimEngine._after_step's): batch, tokens, context, blocks, frames answered, silent ones."""
    row[0], row[1], row[2], row[3], row[4], row[5] = nS, new_tokens, ctx, used, tokens_out, n_ans
    silent = 0
    for t in silent_tok:
        if t == 0:  # serving.frame_is_silent
            silent += 1
    row[6], row[7], row[8] = n_running, iconf[I_NWAITING], silent


@nb.njit(cache=True)
def _front_head_fits(iconf, used, hist, pending_in, started):
    """SimEngine._admit: would the front end's head be admitted now (serving.admission_need_blocks)?"""
    head = iconf[I_HEAD]
    if head < 0:
        return False
    tok = hist[head] + pending_in[head] if started[head] else iconf[I_PROMPT] + pending_in[head] + iconf[I_NIN]
    want = (tok + iconf[I_BS] - 1) // iconf[I_BS]
    if iconf[I_CAP] >= 0 and want > iconf[I_CAP]:
        want = iconf[I_CAP]
    return want <= iconf[I_NB] - used


@nb.njit(cache=True)
def _queued_behind(live, state, inflight, backlog):
    """Running sessions with frames queued and none in the engine (a step-by-step turn leaves none)."""
    ready = np.empty(live.size, np.int64)
    n = 0
    for j in range(live.size):
        i = live[j]
        if inflight[i] < 0 and backlog[i] > 0 and state[i] != WAITING_STATE:
            ready[n] = i
            n += 1
    return ready, n


@nb.njit(cache=True)
def _kv_queue(kvh_arr, kvh_len, status, nslots):
    """The kv-holding queue as the loop keeps it: every entry in order (``kvh_all``), each request's place in it
    (``kseq``), and its waiting entries (``kw``) apart from the paused ones, so a step reads only those."""
    kvh_all = np.empty(kvh_len + nslots, np.int64)
    kseq = np.empty(nslots, np.int64)
    kw = np.empty(nslots, np.int64)
    kw_len = 0
    for j in range(kvh_len):
        s = kvh_arr[j]
        kvh_all[j] = s
        kseq[s] = j
        if status[s] != P_CODE:
            kw[kw_len] = s
            kw_len += 1
    return kvh_all, kseq, kw, kw_len


@nb.njit(cache=True)
def _kv_holding(kvh_all, n_all, kseq, status, kvh_arr):
    """The kv-holding queue in order, written back for EngineModel (stale places dropped). Returns its length."""
    m = 0
    for j in range(n_all):
        s = kvh_all[j]
        if kseq[s] == j and (status[s] == P_CODE or status[s] == W_CODE):
            kvh_arr[m] = s
            m += 1
    return m


@nb.njit(cache=True)
def _next_wake(tick, t_next, dep_t, k):
    """When an idle engine looks again (SimEngine._run's wait): the next tick, event or departure."""
    until = min(tick.min(), t_next)
    return min(until, dep_t[k]) if k < dep_t.size else until


@nb.njit(cache=True)
def _engine_step(iconf, fconf, coef, cnt, idle, step_no, sframe, kw, kw_len, kseq, kvh_all, n_all, run_arr, status,
                 computed, ntok, slots, held, out, maxtok, fresh, sched, schk, sampled, jit, jz, ja, jb, jp, jr):
    """EngineModel.step and its latency, if this loop restates what the step would do: every request with work
    gets its blocks and its tokens (and, under correlated jitter, the step's frame has its draws here). ``cnt``'s
    blocks used, paused requests and queue lengths are updated. Returns (the latency, or -1 when the step-by-step
    path must take the step; batch, new tokens, context tokens, how many sampled, the kv-holding queue)."""
    _by_seq(kw, kw_len, kseq)
    jitter, f_lo = int(fconf[F_JITTER]), iconf[I_FLO]
    fits = jitter != CORRELATED or sframe - f_lo < ja.size
    if fits:
        fits, tot = _step_fits(iconf, cnt[C_USED], cnt[C_PAUSED], cnt[C_RUNLEN], cnt[C_KVHLEN], run_arr, kw, kw_len,
                               status, computed, ntok, slots, held)
        fits = fits and tot > 0
    if not fits:
        return -1.0, 0, 0, 0, 0, kvh_all, n_all
    used, run_len, nS = _schedule(iconf, cnt[C_USED], cnt[C_RUNLEN], cnt[C_KVHLEN], run_arr, kw, kw_len, status,
                                  computed, ntok, slots, held, sched, schk)
    new_tokens, ctx, first, n_sam, n_pause, run_len = _run_model(iconf, idle, sched, schk, nS, run_arr, run_len,
                                                                status, computed, ntok, out, maxtok, fresh, sampled)
    kvh_all, n_all = _hold(sched, nS, status, kvh_all, n_all, kseq)
    cnt[C_USED], cnt[C_RUNLEN] = used, run_len
    cnt[C_KVHLEN] += n_pause - kw_len  # the waiting ones joined the running list, the paused ones the queue
    cnt[C_PAUSED] += n_pause
    lat = _step_latency(coef, fconf, nS, ctx, new_tokens, first, jitter, step_no, sframe, f_lo, jit, jz, ja, jb,
                        jp, jr)
    return lat, nS, new_tokens, ctx, n_sam, kvh_all, n_all


@nb.njit(cache=True)
def run_span(iconf, fconf, coef, istate, fstate, live, state, phase, pslot, sslot, next_frame, backlog, inflight,
             inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_tokens,
             s_frames, s_silent, s_late, status, computed, ntok, slots, held, out, maxtok, fresh, sess_of_slot,
             run_arr, kvh_arr, jit, jz, ja, jb, jp, jr, st_t, st_lat, st_i, fr_f, fr_tick, fr_done, fr_lat, fr_i, pend,
             dep_t, dep_i, s_ended):
    """Turns and steps from just after the caller's turn at ``fstate[0]`` until the next event, ``max_steps`` or
    anything this loop does not restate; the state arrays are updated in place, the steps' and frames' records
    written to ``st_*`` and ``fr_*``, and ``istate``/``fstate`` say where it stopped (S_TURNED). ``dep_t``/``dep_i``:
    the departures to come, in time order (empty when the caller takes them); ``s_ended`` gets the times of those
    taken here."""
    P, t_next, horizon, t_pause = fconf[F_P], fconf[F_TNEXT], fconf[F_HORIZON], fconf[F_TPAUSE]
    max_steps, nslots, ans_cap, lockstep = iconf[I_MAXSTEPS], iconf[I_SLOTS], iconf[I_ANSCAP], iconf[I_LOCKSTEP] != 0
    m_steps, sframe, peak, n_pend = istate[S_MSTEPS], istate[S_SFRAME], istate[S_PEAK], istate[S_NPEND]
    cnt = np.zeros(6, np.int64)  # the engine's counters, which turns (departures) and steps change
    cnt[C_USED], cnt[C_PAUSED], cnt[C_RUNLEN], cnt[C_KVHLEN], cnt[C_NRUN] = \
        istate[S_USED], istate[S_PAUSED], istate[S_RUNLEN], istate[S_KVHLEN], iconf[I_NRUNNING]
    idle = istate[S_IDLE] != 0  # the engine waited since its last step: a frame's step then pays first_s
    now = fstate[0]
    nsteps = nrows = 0
    turned = TURN_TAKEN  # the caller's turn at `now` is done
    start, who, tick, ok = _wheel(live, pslot, next_frame, phase, P)
    kvh_all, kseq, kw, kw_len = _kv_queue(kvh_arr, cnt[C_KVHLEN], status, nslots)
    n_all, visit = cnt[C_KVHLEN], np.empty(2 * live.size, np.int64)
    ready, n_ready = _queued_behind(live, state, inflight, backlog)
    run_sess = live[state[live] == R_STATE] if lockstep else live[:0]
    sched, schk, sampled = np.empty(nslots, np.int64), np.empty(nslots, np.int64), np.empty(nslots, np.int64)
    n_a = ans_cap + pend.shape[0]  # a step's answers and the silent ones answered with them
    a_key, a_who, a_tok = np.empty(n_a, np.int64), np.empty(n_a, np.int64), np.empty(n_a, np.int64)
    while ok:
        if turned == TURN_CALLER:
            if now >= t_next or nsteps >= max_steps or nrows + 2 * ans_cap > fr_f.size:
                break
            taken, kw_len, n_sub, latest, nrows, n_pend = _turn(
                now, iconf, fconf, tick, start, who, ready, n_ready, visit, kw, kw_len, m_steps, state, phase, pslot,
                sslot, next_frame, backlog, inflight, inflight_tok, hist, last_tok, pending_in, work_step,
                running_since, started, admitted, s_frames, s_silent, s_late, status, computed, ntok, out, maxtok,
                fresh, a_key, a_who, a_tok, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, run_sess, pend, n_pend, cnt,
                dep_t, dep_i, s_ended, run_arr, held, slots)
            if not taken:
                break
            cnt[C_PAUSED] -= n_sub
            sframe = max(sframe, latest)
            n_ready = 0
            if now >= t_pause:  # the turn is taken: the caller looks, then calls again from here
                turned = PAUSED
                break
        turned = TURN_CALLER
        if cnt[C_RUNLEN] == 0 and kw_len == 0:  # no work: wait for the next tick (or the next event, or departure)
            until = _next_wake(tick, t_next, dep_t, cnt[C_DEP])
            if until <= now:
                break
            idle = True
            if until >= horizon:  # SimPy stops the run during this wait
                fstate[1], turned = until, PAST_HORIZON
                break
            now = until
            continue
        lat, nS, new_tokens, ctx, n_sam, kvh_all, n_all = _engine_step(
            iconf, fconf, coef, cnt, idle, nsteps, sframe, kw, kw_len, kseq, kvh_all, n_all, run_arr, status,
            computed, ntok, slots, held, out, maxtok, fresh, sched, schk, sampled, jit, jz, ja, jb, jp, jr)
        if lat < 0:
            turned = TURN_TAKEN  # the turn at `now` is done; the step-by-step path takes the step
            break
        kw_len = 0
        idle = False
        m_steps += 1
        step_start, now = now, now + lat
        if now >= horizon:  # the step outlives the run: SimPy stops while it runs
            fstate[1], now, turned = now, step_start, PAST_HORIZON
            break
        n_ready, n_pend, nrows = _answer_step(
            now, iconf, fconf, sampled, n_sam, sess_of_slot, pslot, inflight, inflight_tok, s_tokens, s_frames,
            s_silent, s_late, hist, last_tok, backlog, next_frame, admitted, a_key, a_who, a_tok, ready, run_sess,
            pend, n_pend, fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows, st_i[nsteps], nS, new_tokens, ctx,
            cnt[C_USED], cnt[C_NRUN])
        peak = max(peak, cnt[C_USED])
        st_t[nsteps], st_lat[nsteps] = step_start, lat
        nsteps += 1
    istate[S_USED], istate[S_PAUSED], istate[S_MSTEPS], istate[S_SFRAME], istate[S_PEAK] = \
        cnt[C_USED], cnt[C_PAUSED], m_steps, sframe, peak
    istate[S_RUNLEN], istate[S_KVHLEN], istate[S_NSTEPS], istate[S_NROWS], istate[S_TURNED] = \
        cnt[C_RUNLEN], _kv_holding(kvh_all, n_all, kseq, status, kvh_arr), nsteps, nrows, turned
    istate[S_IDLE], istate[S_NPEND], istate[S_NDEP] = 1 if idle else 0, n_pend, cnt[C_DEP]
    fstate[0] = now


def forget_other_forms(where: Path, form: str) -> bool:
    """Drop this module's cached machine code in ``where`` unless it was compiled from step model form ``form``.

    numba keys its cache of these loops on this file alone, but :func:`run_span` compiles
    :func:`metronome.calibration.step_inputs` and :mod:`metronome.jitter_kernel` into itself: after either
    changes (a new term), the cached loop would go on running the old form. A marker beside the cache names the form it was compiled from.
    Returns whether anything was dropped."""
    mark = where / "fastpath.step_inputs.sha256"
    try:
        if mark.read_text() == form:
            return False
    except OSError:
        pass
    stale = list(where.glob("fastpath.*.nb[ic]"))
    for f in stale:
        f.unlink(missing_ok=True)
    try:
        mark.write_text(form)
    except OSError:  # a read-only install: numba then caches elsewhere or not at all
        pass
    return bool(stale)


# what run_span compiles into itself from other modules: the step model's form and the jitter ratio's
STEP_FORM = hashlib.sha256((inspect.getsource(step_inputs) + inspect.getsource(jitter_kernel)).encode()).hexdigest()
try:
    _CACHE = Path(run_span._cache._cache_path)  # numba's cache folder for this module (not public API)
except AttributeError:  # another numba: no guard, as numba itself has none
    _CACHE = None
if _CACHE is not None:
    forget_other_forms(_CACHE, STEP_FORM)  # before any loop is called, so none has loaded its cache yet
