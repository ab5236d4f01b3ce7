"""The simulator's hot loop, compiled: turns and steps of a steady span, one machine-code loop.

Under independent phases the engine steps back to back, each step batching the frames that arrived during the
last one, so an hour of Moshi is hundreds of thousands of steps and nothing repeats from one step to the next
that numpy could take a whole span at a time (the aligned lockstep's :meth:`SimEngine._fast_span`). This module
runs the same rules one step at a time in numba: the front end's turn (frames that came due are handed to the
engine, :meth:`SimEngine._ticks`), ``EngineModel.step`` (running requests first, then the kv-holding queue
head first, out-of-window frees before each allocation, the full-sequence gate and watermark on admission),
the step's latency and :meth:`SimEngine._after_step`'s bookkeeping and records.

It covers what a steady span holds and nothing else: every live session runs or waits at the front end (its
frames answered silent at once, as independent phases have it), nothing prefills, the engine's waiting queue is
empty, and each step gives every request with work its blocks and its tokens within the budget. Before doing
anything a step or a turn would do differently (a failed allocation that would preempt, the token budget,
``max_num_seqs``, the length limit, the front end's head fitting, a session's first frame, the next arrival,
departure or controller poll) it stops and hands back to the step-by-step path, which takes it from exactly
there. ``tests/test_sim_scenarios.py`` compares the two, bit for bit.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import numba as nb
import numpy as np

from metronome.calibration import step_inputs
from metronome.serving import PHASE_SLOTS, EngineModel

P_CODE, W_CODE, R_CODE = EngineModel.PAUSED_CODE, EngineModel.WAITING_CODE, EngineModel.RUNNING_CODE

# iconf: the engine and stream constants
I_BS, I_BOUNDED, I_SINKB, I_WINDOW, I_NB, I_MAXSEQS, I_BUDGET, I_MAXLEN, I_WM, I_THR, I_CAP, I_NIN, I_NOUT, \
    I_MAXSTEPS, I_SLOTS, I_NRUNNING, I_NWAITING, I_HEAD, I_PROMPT, I_ANSCAP = range(20)
# frame rows' integer columns (fr_i)
R_FRAMES, R_LATE, R_TOKENS, R_SILENT, R_SILENT_PRE = range(5)
WAITING_STATE = 1  # SimEngine's front-end state of a session waiting for blocks
# fconf: times and the step-latency model's real-time terms (its coefficients come as their own array, ``coef``)
F_P, F_PQ, F_DEADLINE, F_TNEXT, F_FIRST, F_EPS, F_JITTER, F_HORIZON = range(8)
# the step model's form, compiled from its one statement (so a new term needs no change here)
_step_inputs = nb.njit(cache=True)(step_inputs)
# istate[S_TURNED]: 0 the caller takes the turn at fstate[0]; 1 the turn there is taken, the step is the caller's;
# 2 a step (or a wait) starts at fstate[0] and ends at fstate[1], at or past the horizon, where SimPy stops the
# run (the step-by-step path never gets to its records either)
TURN_CALLER, TURN_TAKEN, PAST_HORIZON = 0, 1, 2
# istate (in/out): the engine's counters; then what the call did
S_USED, S_PAUSED, S_MSTEPS, S_SFRAME, S_PEAK, S_RUNLEN, S_KVHLEN, S_NSTEPS, S_NROWS, S_TURNED, S_IDLE = range(11)


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
def _flush(now, n, keys, who, toks, admitted, P, Pq, deadline, eps, s_late, fr_f, fr_tick, fr_done, fr_lat, fr_i,
           nrows):
    """SimEngine._flush_answers: ``n`` answers (tick key, session, tokens got) become one row per tick, in tick
    order, all answered at ``now``. Returns the rows written so far."""
    order = np.argsort(keys[:n], kind="mergesort")
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
def run_span(iconf, fconf, coef, istate, fstate, live, state, phase, pslot, sslot, next_frame, backlog, inflight,
             inflight_tok, hist, last_tok, pending_in, work_step, running_since, started, admitted, s_tokens,
             s_frames, s_silent, s_late, status, computed, ntok, slots, held, out, maxtok, fresh, sess_of_slot,
             run_arr, kvh_arr, jit, st_t, st_lat, st_i, fr_f, fr_tick, fr_done, fr_lat, fr_i):
    bs, bounded, sinkb, window = iconf[I_BS], iconf[I_BOUNDED] != 0, iconf[I_SINKB], iconf[I_WINDOW]
    NB, maxseqs, B, maxlen = iconf[I_NB], iconf[I_MAXSEQS], iconf[I_BUDGET], iconf[I_MAXLEN]
    wm_blocks, long_thr, cap, n_in, n_out = iconf[I_WM], iconf[I_THR], iconf[I_CAP], iconf[I_NIN], iconf[I_NOUT]
    max_steps, nslots, n_running_state = iconf[I_MAXSTEPS], iconf[I_SLOTS], iconf[I_NRUNNING]
    n_waiting, head, prompt, ans_cap = iconf[I_NWAITING], iconf[I_HEAD], iconf[I_PROMPT], iconf[I_ANSCAP]
    P, Pq, deadline, t_next, eps = fconf[F_P], fconf[F_PQ], fconf[F_DEADLINE], fconf[F_TNEXT], fconf[F_EPS]
    first_s = fconf[F_FIRST]
    jitter = fconf[F_JITTER] != 0.0
    horizon = fconf[F_HORIZON]
    used, n_paused, m_steps, sframe, peak = istate[S_USED], istate[S_PAUSED], istate[S_MSTEPS], istate[S_SFRAME], istate[S_PEAK]
    run_len, kvh_len = istate[S_RUNLEN], istate[S_KVHLEN]
    idle = istate[S_IDLE] != 0  # the engine waited since its last step: a frame's step then pays first_s
    now = fstate[0]
    chunk = 1 + n_in
    n_live = live.size
    fr_cap = fr_f.size
    sched = np.empty(nslots, np.int64)
    schk = np.empty(nslots, np.int64)
    who = np.empty(nslots, np.int64)
    tmp = np.empty(nslots, np.int64)
    a_key = np.empty(ans_cap, np.int64)  # answers of one turn or one step: tick key, session, tokens
    a_who = np.empty(ans_cap, np.int64)
    a_tok = np.empty(ans_cap, np.int64)
    nsteps = 0
    nrows = 0
    turned = 1  # the caller's turn at `now` is done
    while True:
        if turned == 0:
            if now >= t_next or nsteps >= max_steps or nrows + 2 * ans_cap > fr_cap:
                break
            # -- the turn's checks (nothing changes unless all pass) --------------------------------------
            if head >= 0:  # SimEngine._admit: the front end's head must still not fit
                tok = hist[head] + pending_in[head] if started[head] else prompt + pending_in[head] + n_in
                want = (tok + bs - 1) // bs  # serving.admission_need_blocks
                if cap >= 0 and want > cap:
                    want = cap
                if want <= NB - used:
                    break
            ok = True
            n_ans = 0
            for j in range(n_live):
                i = live[j]
                t = _tick(next_frame[i], P, phase[i])
                due = t <= now + eps
                if state[i] == WAITING_STATE:  # each due frame will be answered silent
                    k = 0
                    while _tick(next_frame[i] + k, P, phase[i]) <= now + eps:
                        k += 1
                    n_ans += k
                    continue
                if due and (not started[i] or t < running_since[i] - eps):
                    ok = False
                    break
                if inflight[i] < 0 and (due or backlog[i] > 0):
                    s = sslot[i]
                    if s < 0 or status[s] != P_CODE or hist[i] + chunk + n_out >= maxlen:  # serving.frame_fits
                        ok = False
                        break
            if not ok or n_ans > ans_cap:
                break
            # -- the turn: frames that came due are queued, and a paused session's oldest is handed over ---
            n_ans = 0
            for j in range(n_live):
                i = live[j]
                nf, ph = next_frame[i], phase[i]
                if state[i] == WAITING_STATE:  # SimEngine._tick_one's quiet branch, answered at once (_owe)
                    while _tick(next_frame[i], P, ph) <= now + eps:
                        a_key[n_ans] = next_frame[i] * PHASE_SLOTS + pslot[i]
                        a_who[n_ans] = i
                        a_tok[n_ans] = 0
                        n_ans += 1
                        next_frame[i] += 1
                        pending_in[i] += n_in
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
            for j in range(n_live):
                i = live[j]
                if inflight[i] < 0 and backlog[i] > 0:
                    s = sslot[i]
                    ntok[s] = computed[s] + chunk  # EngineModel.append_many
                    maxtok[s] = n_out
                    out[s] = 0
                    status[s] = W_CODE
                    n_paused -= 1
                    fresh[s] = True
                    f = next_frame[i] - backlog[i]
                    hist[i] += chunk
                    last_tok[i] = False
                    backlog[i] -= 1
                    inflight[i] = f
                    inflight_tok[i] = 0
                    if f > sframe:
                        sframe = f
                    work_step[i] = m_steps
            if n_ans:
                nrows = _flush(now, n_ans, a_key, a_who, a_tok, admitted, P, Pq, deadline, eps, s_late,
                               fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows)
        turned = 0
        has_work = run_len > 0 or kvh_len > n_paused
        if not has_work:
            nt = np.inf
            for j in range(n_live):
                i = live[j]
                t = _tick(next_frame[i], P, phase[i])
                if t < nt:
                    nt = t
            until = min(nt, t_next)
            if until <= now:
                break
            if until >= horizon:  # SimPy stops the run during this wait
                fstate[1] = until
                turned = PAST_HORIZON
                idle = True
                break
            now = until
            idle = True
            continue
        # -- the step's checks: EngineModel.step would give every request its blocks and tokens ------------
        thr = long_thr if run_len + kvh_len > 1 else 0
        free = NB - used
        tot = 0
        ok = True
        for j in range(run_len):
            s = run_arr[j]
            k = _tokens(s, ntok, computed, thr, maxlen, True)
            if k <= 0:
                continue
            tot += k
            if tot > B:
                ok = False
                break
            freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
            free += freed
            if need > free:
                ok = False
                break
            free -= need
        run_tot = tot
        n_adm = 0
        if ok and kvh_len > n_paused:
            if run_tot >= B:
                ok = False
            else:
                for j in range(kvh_len):
                    s = kvh_arr[j]
                    if status[s] == P_CODE:
                        continue
                    if maxseqs - run_len - n_paused - n_adm <= 0:
                        ok = False
                        break
                    k = _tokens(s, ntok, computed, thr, maxlen, False)
                    tot += k
                    if k <= 0 or tot > B:
                        ok = False
                        break
                    wm = wm_blocks if run_len + n_adm > 0 else 0
                    gate = (min(ntok[s], maxlen) + bs - 1) // bs
                    if cap >= 0 and gate > cap:
                        gate = cap
                    gate = max(gate - slots[s], 0)
                    if gate + wm > free:
                        ok = False
                        break
                    freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
                    if need + wm > free + freed:
                        ok = False
                        break
                    free += freed - need
                    n_adm += 1
        if not ok or tot == 0:
            turned = 1  # the turn at `now` is done; the step-by-step path takes the step
            break
        # -- the step: allocations, admissions, the model run ------------------------------------------
        start = now
        nS = 0
        for j in range(run_len):
            s = run_arr[j]
            k = _tokens(s, ntok, computed, thr, maxlen, True)
            if k <= 0:
                continue
            freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
            used += _take(s, freed, need, slots, held)
            sched[nS] = s
            schk[nS] = k
            nS += 1
        if n_adm:
            m = 0
            for j in range(kvh_len):
                s = kvh_arr[j]
                if status[s] == P_CODE:
                    tmp[m] = s
                    m += 1
                    continue
                k = _tokens(s, ntok, computed, thr, maxlen, False)
                freed, need = _frees_need(s, k, computed, slots, held, bs, bounded, sinkb, window)
                used += _take(s, freed, need, slots, held)
                status[s] = R_CODE
                run_arr[run_len] = s
                run_len += 1
                sched[nS] = s
                schk[nS] = k
                nS += 1
            for j in range(m):
                kvh_arr[j] = tmp[j]
            kvh_len = m
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
                who[n_sam] = s  # sampled, in schedule order
                n_sam += 1
                if out[s] >= maxtok[s]:
                    status[s] = P_CODE
                    n_paused += 1
                    n_pause += 1
        if n_pause:
            m = 0
            for j in range(run_len):
                s = run_arr[j]
                if status[s] == R_CODE:
                    run_arr[m] = s
                    m += 1
            run_len = m
            for j in range(nS):  # paused in this step: to the kv-holding queue, in schedule order
                s = sched[j]
                if status[s] == P_CODE:
                    kvh_arr[kvh_len] = s
                    kvh_len += 1
        idle = False
        m_steps += 1
        xs = _step_inputs(float(nS), float(ctx), float(new_tokens))
        lat = 0.0
        for i in range(coef.size):  # StepLatencyModel.step_s, in the same order (same sums, bit for bit)
            lat += coef[i] * xs[i]
        if first:
            lat += first_s
        if jitter:
            lat *= jit[nsteps]
        now = start + lat
        if now >= horizon:
            fstate[1] = now
            now = start
            turned = PAST_HORIZON
            break
        # -- after the step: tokens to their frames, finished frames answered (one row per tick) ----------
        tokens_out = 0
        n_done = 0
        for j in range(n_sam):
            i = sess_of_slot[who[j]]
            if inflight[i] >= 0:
                inflight_tok[i] += 1
                s_tokens[i] += 1
                tokens_out += 1
                if inflight_tok[i] >= n_out:
                    a_key[n_done] = inflight[i] * PHASE_SLOTS + pslot[i]  # serving.tick_key
                    a_who[n_done] = i
                    a_tok[n_done] = inflight_tok[i]
                    n_done += 1
        for j in range(n_done):
            i = a_who[j]
            hist[i] += n_out - 1
            last_tok[i] = True
            s_frames[i] += 1
            inflight[i] = -1
        if used > peak:
            peak = used
        nrows = _flush(now, n_done, a_key, a_who, a_tok, admitted, P, Pq, deadline, eps, s_late,
                       fr_f, fr_tick, fr_done, fr_lat, fr_i, nrows)
        st_t[nsteps] = start
        st_lat[nsteps] = lat
        st_i[nsteps, 0] = nS
        st_i[nsteps, 1] = new_tokens
        st_i[nsteps, 2] = ctx
        st_i[nsteps, 3] = used
        st_i[nsteps, 4] = tokens_out
        st_i[nsteps, 5] = n_done
        st_i[nsteps, 6] = n_running_state
        st_i[nsteps, 7] = n_waiting
        nsteps += 1
    istate[S_USED], istate[S_PAUSED], istate[S_MSTEPS], istate[S_SFRAME], istate[S_PEAK] = used, n_paused, m_steps, sframe, peak
    istate[S_RUNLEN], istate[S_KVHLEN] = run_len, kvh_len
    istate[S_NSTEPS], istate[S_NROWS], istate[S_TURNED] = nsteps, nrows, turned
    istate[S_IDLE] = 1 if idle else 0
    fstate[0] = now


def forget_other_forms(where: Path, form: str) -> bool:
    """Drop this module's cached machine code in ``where`` unless it was compiled from step model form ``form``.

    numba keys its cache of these loops on this file alone, but :func:`run_span` compiles
    :func:`metronome.calibration.step_inputs` into itself: after that function changes (a new term), the cached
    loop would go on running the old form. A marker beside the cache names the form it was compiled from.
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


STEP_FORM = hashlib.sha256(inspect.getsource(step_inputs).encode()).hexdigest()
try:
    _CACHE = Path(run_span._cache._cache_path)  # numba's cache folder for this module (not public API)
except AttributeError:  # another numba: no guard, as numba itself has none
    _CACHE = None
if _CACHE is not None:
    forget_other_forms(_CACHE, STEP_FORM)  # before any loop is called, so none has loaded its cache yet
