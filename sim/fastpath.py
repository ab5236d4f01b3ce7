"""The simulator's hot loop, compiled: turns and steps of a steady span, one machine-code loop.

An hour of Moshi is hundreds of thousands of steps, and under independent phases nothing repeats from one step
to the next that numpy could take a whole span at a time. This module runs the front end's turns and steps in
numba, under either phase regime: the turn (frames that came due are handed to the engine; a session without a
place hears silence, at once or, in lockstep, with its tick's running frames), the engine step, the step's latency
with its jitter draw, the reaction to the step and the records. The engine step is not restated here: it is
:func:`metronome.serving.engine_step`, the one statement of vLLM's step, called on the engine model's own arrays
(what :meth:`EngineModel.step` runs too). A turn visits only the phase slots whose tick came due and a step reads
only the requests with work, so a step's cost follows its batch, not the sessions in flight.

A step may preempt, stop an admission at the token budget, ``max_num_seqs``, the gate or the watermark: the engine
step decides it. With a front end that steps vLLM itself (``--loop driver``) the requests vLLM preempted and the
deadlock rule's victims (serving.deadlock_pick, the need serving.resume_need) lose their place, their frames owed,
and go back to the head of the front end's queue; a later turn readmits one as a request whose prompt is its
history, which re-prefills while its frames are answered silent. A step that scheduled nothing, or a reaction the
span has no room for, is handed back *after* the step is taken (``STEP_TAKEN``) and the step-by-step path does the
rest. A session's first frame becomes a new request here (serving.add_slot); the caller names the requests the
loop adds and forgets those it aborts (``new_k``).

Before a turn it would take differently (the length limit, a rebase, the next arrival) it stops and hands back,
and the step-by-step path takes it from exactly there. Departures are taken here (each frame row carries the
sessions in flight, which an admission controller is told). ``tests/test_sim_scenarios.py`` compares the two, bit
for bit, and ``tests/test_front_end_differential.py`` both with the live driver.

The loop's state is named records, not lists of arguments: the front end's per-session arrays
(:class:`metronome.front_end.Sessions`), the engine model's (:class:`metronome.serving.EngineArrays`), the front
end's queues and the span's buffers (:class:`Front`, :class:`Span`), the tables' storage (:class:`Rows`), the jitter
draws (:class:`Draws`), and two numpy records, the span's constants (:data:`CONF`) and its counters
(:data:`STATE`). A field is named where it is read and written; one added in the wrong place of a positional list
would break silently.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from metronome import (admission, compiled, control_kernel, front_end, front_rules, jitter_kernel, kv_policy,
                       percentile_kernel, results, serving)
from metronome import control_kernel as ck
from metronome.calibration import step_inputs
from metronome.compiled import borrowed, hold
from metronome.front_rules import (ENDED, PREFILL, REFUSED, WAITING, Queues, Tally,  # (the states: declared there)
                                   admit_head, answer_silent, awaits_engine, chunk_of, end_owed, enter, hand_over,
                                   leave_queue, lose_place, readmitted, tick_due, tokens_in)
from metronome.front_rules import live as _live
from metronome.front_rules import placeless as _placeless
from metronome.front_rules import tick as _tick
from metronome.jitter_kernel import correlated_ratio
from metronome.serving import (E_KW, E_NEXT, E_RUN, E_STEPS, E_USED, E_WQ, L_BS, L_CAP, L_MAXLEN, L_NB, L_SINKB,
                               L_WINDOW, O_CTX, O_NEW, O_PRE, O_SAM, O_SCHED, O_USED, abort_slot, add_slot,
                               deadlock_pick, engine_step, gate_blocks_jit, resume_need, resume_slot)
from metronome.sim import recorder, span
from metronome.sim.span import (CORRELATED, CTL_AFTER, CTL_COMPILED, INDEPENDENT, NEW_DROPPED, NEW_FIRST, NEW_READMIT,
                                P_CODE, PAST_HORIZON, PAUSED, STEP_TAKEN, TURN_CALLER, TURN_TAKEN, W_CODE, X_CODE)
from metronome.sim.span import inlined as _inlined
from metronome.sim.span import njit as _njit
from metronome.sim.span import spliced as _spliced
from metronome.sim.recorder import (Q_BATCH, Q_CTX, Q_DONE, Q_NEW, Q_OUT, Q_PRE, Q_RUNNING, Q_SILENT, Q_USED,
                                    Q_WAITING, R_FRAMES, R_SILENT, flush)

# the step model's form, a session's first frame and what a silent frame is, compiled from their one statement
_step_inputs = nb.njit(cache=True)(step_inputs)


@_spliced
def _first_fits(i, ss, maxlen):
    """Whether session ``i``'s first frame fits the length limit (serving.frame_fits)."""
    return ss.hist[i] + chunk_of(i, ss) + ss.n_out_of[i] < maxlen


@_inlined
def _turn_fits(now, n_visit, c, ss, w, eng, room):
    """The turn's checks: every due frame of the visited sessions is one the compiled turn takes as the
    step-by-step one would (a running session's, on a paused request or, its first, on a new one for which the
    engine's arrays have ``room``, fitting the length limit). Returns (whether all pass, the silent answers the
    turn will write, the room left)."""
    P, eps, maxlen = c.P, c.eps, eng.lim[L_MAXLEN]
    n_ans = 0
    for j in range(n_visit):
        i = w.visit[j]
        t = _tick(ss.next_frame[i], P, ss.phase[i])
        due = t <= now + eps
        if _placeless(ss.state[i]):  # each due frame will be answered silent
            k = 0
            while _tick(ss.next_frame[i] + k, P, ss.phase[i]) <= now + eps:
                k += 1
            n_ans += k
            continue
        if due and t < ss.running_since[i] - eps:
            return False, n_ans, room
        if ss.inflight[i] < 0 and (due or ss.backlog[i] > 0):
            s = ss.slot[i]
            if s < 0:  # its first frame (a session that started and has no request was rebased: not here)
                room -= 1
                if ss.started[i] or room < 0 or not _first_fits(i, ss, maxlen):
                    return False, n_ans, room
            elif (eng.status[s] != P_CODE
                  or ss.hist[i] + 1 + ss.n_in_of[i] + ss.pending_in[i] + ss.n_out_of[i] >= maxlen):
                return False, n_ans, room
    return True, n_ans, room


@_inlined
def _queue_due(now, n_visit, c, s, ss, fe, w, a, n_ans):
    """The turn, first half: frames that came due are queued (a running session's) or owed silent
    (front_rules.tick_due), after the ``n_ans`` answers already written. Returns the answers."""
    none = (fe.new_i[:0], fe.new_i[:0], fe.fresh[:0])  # (the loop keeps no record of each frame heard)
    for j in range(n_visit):
        i = w.visit[j]
        if ss.state[i] != ENDED:  # (departed in this turn)
            n_ans, _ = tick_due(i, now, c.eps, c.lockstep, ss, s, fe.pend, a, n_ans, none, 0)
    return n_ans


@_njit
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


@_inlined
def _submit_due(n_visit, s, ss, fe, w, eng):
    """The turn, second half: a paused session's oldest queued frame is handed to its request
    (EngineModel.append_many: serving.resume_slot), which waits in its place in the kv-holding queue; then a
    session's first frame, with its prompt, becomes a new request at the tail of ``waiting`` (FrontEnd._submit:
    serving.add_slot), in session order as the step-by-step turn hands them over. Returns (how many were handed
    over, the latest frame handed)."""
    n_sub = 0
    latest = -1
    n_first = 0
    n_new = s.nnew
    steps = eng.cnt[E_STEPS]
    for j in range(n_visit):
        i = w.visit[j]
        if ss.inflight[i] < 0 and ss.backlog[i] > 0:
            sl = ss.slot[i]
            if sl < 0:  # its first frame: after the others (a session may be visited twice: kept once, below)
                fe.new_i[n_new + n_first] = i
                n_first += 1
                continue
            chunk = chunk_of(i, ss)
            resume_slot(sl, chunk, ss.n_out_of[i], eng.cnt, eng.status, eng.computed, eng.ntok, eng.out, eng.maxtok,
                        eng.kw)
            latest = max(latest, hand_over(i, sl, chunk, steps, ss, fe.fresh))
            n_sub += 1
    firsts = fe.new_i[n_new:n_new + n_first]
    _sort_in_place(firsts)
    last = -1  # (the kept ones are written back over those already read)
    for a in range(n_first):
        i = firsts[a]
        if i == last:
            continue
        last = i
        first = chunk_of(i, ss)
        sl = add_slot(ss.hist[i] + first, ss.n_out_of[i], eng.cnt, eng.status, eng.ntok, eng.maxtok, eng.kseq, eng.wq)
        ss.slot[i], fe.sess_of_slot[sl] = sl, i
        fe.new_i[n_new], fe.new_s[n_new], fe.new_k[n_new] = i, sl, NEW_FIRST
        n_new += 1
        latest = max(latest, hand_over(i, sl, first, steps, ss, fe.fresh))
        n_sub += 1
    s.nnew = n_new
    return n_sub, latest


@_inlined
def _step_latency(coef, c, o_n, first, step_no, sframe, dr):
    """StepLatencyModel.step_s of the step ``o_n`` counts (the same sums in the same order, bit for bit), the
    first-step term, the jitter."""
    xs = _step_inputs(float(o_n[O_SCHED]), float(o_n[O_CTX]), float(o_n[O_NEW]), c.route)
    lat = 0.0
    for i in range(coef.size):
        lat += coef[i] * xs[i]
    if first:
        lat += c.first_s
    if c.jitter == INDEPENDENT:
        lat *= dr.jit[step_no]
    elif c.jitter == CORRELATED:  # JitterDraws.ratio(step, serving frame): the same compiled function
        f = sframe - c.f_lo
        lat *= correlated_ratio(dr.jz[step_no], dr.ja[f], dr.jb[f], c.wz, c.wshared, c.wown, dr.jp, dr.jr)
    return lat


@_inlined
def _tokens_to_frames(now, s, ss, fe, w, eng):
    """The step's sampled tokens to their frames (front_rules.tokens_in), the frames done answered from the
    moment's first answer on. Returns (tokens out, frames done, sessions with frames still queued)."""
    scr = w.scr  # (rows 1-3: _victims's scratch, free again; row 0 is its marks, kept at 0)
    n_done, n_pre, tokens_out, n_ready = tokens_in(
        eng.o_sam[:eng.o_n[O_SAM]], now, ss, fe.sess_of_slot, Tally(ss.pslot, ss.s_frames, ss.s_silent, w.key, w.who,
                                                                    w.tok), np.int64(0),
        (scr[1], scr[2], scr[3], w.ready))
    s.npf -= n_pre
    return tokens_out, n_done, n_ready


@_inlined
def _victims(ss, fe, w, eng):
    """FrontEnd._preempt_after_step's choice, after a step that scheduled something (a stall is the caller's):
    the sessions whose requests the engine preempted, then the deadlock rule's victims (serving.deadlock_pick)
    among the sessions still in the engine, the starved ones' need asked of serving.resume_need. Written to
    ``w.vic`` in the order they are preempted; ``w.scr`` is scratch, a row per slot, its marks all 0 between calls.
    Returns (how many, an upper bound of the frames they will be owed: their frame in flight and those queued).

    A starved request waits in the engine (EngineModel.waiting_of), so it is in the kv-holding or the waiting
    queue: the starved ones' need is summed over those two queues, and only when it exceeds the free blocks (the
    rule takes victims) are the slots scanned for every session in the engine. Past N* a step leaves requests
    waiting every time, and a scan of every slot the run ever used, each step, was the loop's cost."""
    mark, who, need, seq, hl, order = w.scr[0], w.scr[1], w.scr[2], w.scr[3], w.scr[4], w.scr[5]
    cnt, o_n, held, status, vic = eng.cnt, eng.o_n, eng.held, eng.status, w.vic
    n_vic = 0
    owed = 0
    free = eng.lim[L_NB] - cnt[E_USED]
    for j in range(o_n[O_PRE]):  # (aborted first: its blocks, if any, are free for the rule below)
        sl = eng.o_pre[j]
        i = fe.sess_of_slot[sl]
        mark[sl] = 2
        vic[n_vic] = i
        n_vic += 1
        owed += 1 + ss.backlog[i]
        free += held[sl]
    for j in range(o_n[O_SCHED]):
        if mark[eng.o_s[j]] == 0:
            mark[eng.o_s[j]] = 1
    step_no = cnt[E_STEPS] - 1
    total = 0
    n_kw = cnt[E_KW]
    for q in range(n_kw + cnt[E_WQ]):
        sl = eng.kw[q] if q < n_kw else eng.wq[q - n_kw]
        if mark[sl] == 0:
            total += _starved_need(sl, ss, fe, eng, step_no)
    if total > free:
        k = 0
        for sl in range(cnt[E_NEXT]):  # every session with a request in the engine
            if mark[sl] == 2 or status[sl] == 0:
                continue
            i = fe.sess_of_slot[sl]
            if ss.slot[i] != sl:
                continue
            who[k], seq[k], hl[k] = i, ss.admit_seq[i], held[sl]
            need[k] = 0 if mark[sl] else _starved_need(sl, ss, fe, eng, step_no)
            k += 1
        m = deadlock_pick(need[:k], seq[:k], hl[:k], free, False, order)
        for q in range(m):
            i = who[order[q]]
            vic[n_vic] = i
            n_vic += 1
            owed += 1 + ss.backlog[i]
    for j in range(o_n[O_PRE]):  # (the marks back to 0, without touching every slot)
        mark[eng.o_pre[j]] = 0
    for j in range(o_n[O_SCHED]):
        mark[eng.o_s[j]] = 0
    return n_vic, owed


@_spliced
def _starved_need(sl, ss, fe, eng, step_no):
    """Blocks request ``sl`` is starved for (serving.resume_need), 0 if it is not starved: its session's work (a
    frame, or a re-prefill) was handed over before the step, and it waits in the engine (EngineModel.waiting_of).
    The caller has ruled out a request scheduled or preempted in the step."""
    i = fe.sess_of_slot[sl]
    st = eng.status[sl]
    if ss.slot[i] == sl and awaits_engine(i, step_no, ss) and (st == W_CODE or st == X_CODE):
        lim = eng.lim
        return resume_need(eng.ntok[sl], eng.computed[sl], eng.held[sl], lim[L_BS], lim[L_CAP], lim[L_SINKB],
                           lim[L_WINDOW])
    return 0


@_spliced
def _abort(i, ss, fe, eng):
    """Session ``i``'s request aborted (EngineModel.abort: serving.abort_slot), if it has one (none before its first
    frame); the caller forgets its id."""
    sl = ss.slot[i]
    if sl >= 0:
        abort_slot(sl, eng.cnt, eng.status, eng.slots, eng.held, eng.run, eng.kw, eng.wq)
        fe.fresh[sl] = False
        ss.slot[i] = -1
    return sl


@_inlined
def _preempt_session(i, c, s, ss, fe, a, eng, n_ans):
    """Session ``i`` loses its place (front_rules.lose_place), its request aborted (the caller forgets its id).
    Returns the answers."""
    sl = _abort(i, ss, fe, eng)
    fe.new_i[s.nnew], fe.new_s[s.nnew], fe.new_k[s.nnew] = i, sl, NEW_DROPPED
    s.nnew += 1
    if ss.state[i] == PREFILL:
        s.npf -= 1
    s.nrun -= 1
    n_ans = lose_place(i, c.lockstep, ss, s, Queues(fe.queue, fe.dep_t, fe.dep_i, fe.pend), a, n_ans)
    ss.s_preempt[i] += 1
    return n_ans


@_inlined
def _departures_due(now, s, ss, fe, held):
    """The departures due at a turn at ``now``, in FrontEnd._turn's order (its heap's): where they end in
    ``fe.dep_t``, the blocks they free and (at most) the frames they leave owed."""
    freed = 0
    owed = 0
    k = s.dep
    while k < s.ndeps and fe.dep_t[k] <= now:
        i = fe.dep_i[k]
        if _live(ss.state[i]):  # (a session that already ended is passed over, as FrontEnd._turn does)
            if ss.slot[i] >= 0:  # (admitted, its first frame not yet due: no request yet)
                freed += held[ss.slot[i]]
            owed += ss.backlog[i] + 1
            for q in range(s.phead, s.npend):
                if fe.pend[q, 0] == i:
                    owed += 1
        k += 1
    return k, freed, owed


@_inlined
def _arrive(now, c, s, ss, fe, w, ctl):
    """FrontEnd._turn's arrivals (those up to ``now``): each passes the gate (the controller's may_admit,
    compiled) with the sessions in flight, or is refused (the caller names the reason). One let in waits at the
    tail of the front end's queue, streams from its join frame and has its departure booked (FrontEnd._enter)."""
    while s.narr < c.na_end and ss.arrival[s.narr] <= now:
        i = s.narr
        s.narr += 1
        if ss.arrival[i] >= c.horizon:
            continue
        in_flight = s.nrun + s.nwait
        # (the count as a float, as every other caller gives it: one compiled form of the controller's kernel)
        if c.ctl == CTL_COMPILED and not ck.may_admit(ctl, now, float(in_flight)):
            ss.state[i] = REFUSED
            ss.s_ended[i] = now
            continue
        nf = enter(i, ss.arrival[i], ss, s, Queues(fe.queue, fe.dep_t, fe.dep_i, fe.pend))
        k = ss.pslot[i]
        w.tick[k] = min(w.tick[k], _tick(nf, c.P, ss.phase[i]))  # (its slot's others, if any, tick no later)


@_inlined
def _admissions(now, c, s, ss, fe, lim, free, room, leaving):
    """FrontEnd._admit's FCFS pass (serving.admit_fcfs), planned: how many heads of the front end's queue (less
    those ``leaving`` before it) get the blocks vLLM's gate wants (serving.admission_need_blocks), none right after a
    step that preempted (``s.prelast``), or -1 when one that does is one this loop does not take (a readmission
    past the length limit; a first frame due now past it; either without room for its request)."""
    if s.prelast:
        return 0
    n = 0
    for q in range(s.qhead, s.qhead + s.nwait):
        i = fe.queue[q]
        gone = False
        for d in leaving:
            gone = gone or d == i
        if gone:
            continue
        tok = ss.hist[i] + ss.pending_in[i] if ss.started[i] else chunk_of(i, ss)
        need = gate_blocks_jit(tok, lim[L_BS], lim[L_CAP], 0)
        if need > free:
            break
        if ss.started[i]:  # readmitted at once, its history its prompt (FrontEnd._readmit), unless it must rebase
            room -= 1
            if room < 0 or ss.hist[i] + ss.pending_in[i] + c.tpf >= lim[L_MAXLEN]:  # (serving.frame_fits)
                return -1
        elif _tick(ss.next_frame[i], c.P, ss.phase[i]) <= now + c.eps:  # its first frame is due now
            room -= 1
            if room < 0 or not _first_fits(i, ss, lim[L_MAXLEN]):
                return -1
        free -= need
        n += 1
    return n


@_inlined
def _admit(now, n, c, s, ss, fe, eng):
    """The ``n`` heads of the front end's queue are admitted (front_rules.admit_head); one that lost its place comes
    back as a new request whose prompt is its whole history, and one token to sample (front_rules.readmitted)."""
    for _ in range(n):
        i, new = admit_head(now, s.seq, ss, s, fe.queue)
        s.seq += 1
        s.nrun += 1
        if new:
            continue
        prompt = ss.hist[i] + ss.pending_in[i]
        sl = add_slot(prompt, 1, eng.cnt, eng.status, eng.ntok, eng.maxtok, eng.kseq, eng.wq)
        ss.slot[i], fe.sess_of_slot[sl] = sl, i
        fe.new_i[s.nnew], fe.new_s[s.nnew], fe.new_k[s.nnew] = i, sl, NEW_READMIT
        s.nnew += 1
        readmitted(i, prompt, eng.cnt[E_STEPS], ss)
        s.npf += 1


@_inlined
def _depart(i, now, c, s, ss, fe, a, eng, n_ans):
    """A session departs: its request aborted, or its place in the front end's queue given up, then the frames it
    is owed answered once their deadline has passed (front_rules.end_owed; the loop keeps no rows of those it never
    answers). Returns the answers."""
    _abort(i, ss, fe, eng)
    if ss.state[i] == WAITING:
        leave_queue(i, s, fe.queue)
    else:
        s.nrun -= 1
        if ss.state[i] == PREFILL:
            s.npf -= 1
    none = fe.new_i[:0]
    n_ans, _ = end_owed(i, now, (c.P, ss.phase[i], c.deadline, c.eps, False),
                        (ss.state, ss.inflight, ss.inflight_tok, ss.next_frame, ss.backlog), s, fe.pend, a, n_ans,
                        (none, none))
    ss.s_ended[i] = now
    return n_ans


@_inlined
def _turn_plan(now, c, s, ss, fe, w, eng, n_ready, n_room):
    """The checks of the turn at ``now``, after its arrivals: the sessions it visits, whether this loop takes the
    rest as FrontEnd._turn would (_turn_fits, the departures, the admissions, room for the answers) and what it
    takes: (visited, slots due, taken, departures' end in ``fe.dep_t``, sessions admitted)."""
    n_visit, n_due = span.due_sessions(now, c.eps, w, n_ready, ss.state)
    fits, n_ans, room = _turn_fits(now, n_visit, c, ss, w, eng, n_room)
    k0 = s.dep
    k1, freed, owed = _departures_due(now, s, ss, fe, eng.held)
    n_adm = _admissions(now, c, s, ss, fe, eng.lim, eng.lim[L_NB] - (eng.cnt[E_USED] - freed), room,
                        fe.dep_i[k0:k1])
    taken = (fits and n_adm >= 0 and owed + n_ans <= c.ans_cap
             and (not c.lockstep or s.npend + n_ans <= fe.pend.shape[0]))
    return n_visit, n_due, taken, k1, n_adm


# Without numba's reference counting (compiled.inlined: also compiled into run_span): the turn handed on the loop's
# arrays (borrowed, without an owner) at some 330 increments and decrements, no-ops but calls all the same, ~10 % of
# a run. So nothing it calls may allocate or return a view (its sorts work in buffers the span owns:
# _sort_in_place, serving.key_order_in); what allocates, and everything it reaches in other modules, is made with
# compiled.counted, which keeps the counting, or, if it allocates nothing, with compiled.uncounted or
# compiled.inlined: either way its flags are its own, not the turn's. This module's own helpers take the turn's.
@_inlined
def _turn(now, c, s, ss, fe, w, a, eng, rec, ctl, n_ready, live):
    """The front end's turn at ``now`` (FrontEnd._turn): the arrivals, then, if the checks pass (:func:`_turn_plan`;
    else the caller takes the rest of the turn), the departures due, the admissions and the sessions whose frames
    came due (_ticks, _answer_silent). None of it when the span ends here: at its next event, after its steps, or
    without room for another turn and step. Returns (taken, frames handed over, the latest)."""
    ans_cap = c.ans_cap
    if (now >= c.t_next or s.nsteps >= c.max_steps or s.nrows + 2 * ans_cap > rec.fr_f.size
            or ck.open_samples(ctl) + 2 * ans_cap > ctl.lat.size or s.nnew + live.size + 1 > fe.new_i.size):
        return False, 0, -1
    _arrive(now, c, s, ss, fe, w, ctl)
    n_visit, n_due, taken, k1, n_adm = _turn_plan(now, c, s, ss, fe, w, eng, n_ready,
                                           min(eng.status.size - eng.cnt[E_NEXT], fe.new_i.size - s.nnew))
    if not taken:
        return False, 0, -1
    # (the constants a loop below reads, in locals: a record's field is read from memory again after every store
    # the compiler cannot tell apart from it, and the slot loop runs at every turn)
    P, eps = c.P, c.eps
    n_ans = np.int64(0)  # (not a literal: see _engine_step)
    for k in range(s.dep, k1):
        i = fe.dep_i[k]
        if _live(ss.state[i]):
            n_ans = _depart(i, now, c, s, ss, fe, a, eng, n_ans)
            sl = ss.pslot[i]
            if w.tick[sl] > now + eps:  # its slot may have no one left to tick
                w.tick[sl] = span.slot_tick(sl, w.wheel_start, w.wheel_who, ss.state, ss.next_frame, ss.phase, P)
    s.dep = k1
    if n_adm:  # (rare: a call with all it needs costs every turn)
        _admit(now, n_adm, c, s, ss, fe, eng)
    n_ans = _queue_due(now, n_visit, c, s, ss, fe, w, a, n_ans)
    for j in range(n_due):  # the slots that came due: their sessions moved on together (a departure leaves a slot
        k = w.due[j]  # that was not due as it was, and nothing else here moves a slot's tick)
        w.tick[k] = span.slot_tick(k, w.wheel_start, w.wheel_who, ss.state, ss.next_frame, ss.phase, P)
    n_sub, latest = _submit_due(n_visit, s, ss, fe, w, eng)
    if c.lockstep and s.npend:  # (none owed: nothing to answer, and no need to scan the running sessions)
        n_ans = answer_silent(s, fe.pend, w.run_sess, (ss.state, ss.inflight, ss.backlog, ss.next_frame), a, n_ans)
    _answered(now, n_ans, c, s, ss, w, rec, ctl)
    return True, n_sub, latest


@_inlined
def _answered(now, n_ans, c, s, ss, w, rec, ctl):
    """The moment's answers recorded (:func:`flush`) and told to a compiled controller as SimEngine._flush_answers
    tells it (row by row; all at one moment: control_kernel.observe_moment)."""
    if n_ans == 0:
        return
    r0 = s.nrows
    in_flight = s.nrun + s.nwait
    s.nrows = flush(now, n_ans, w, ss, c, rec, r0, in_flight if c.ctl == CTL_AFTER else -1)
    if c.ctl == CTL_COMPILED:  # (the rows were all answered at `now` with `in_flight` in flight)
        ck.observe_moment(ctl, now, in_flight, rec.fr_lat[r0:s.nrows], rec.fr_i[R_FRAMES][r0:s.nrows],
                          rec.fr_i[R_SILENT][r0:s.nrows])


@_inlined
def _preempt_all(step_start, n_vic, c, s, ss, fe, w, a, eng, n_ans):
    """After the tokens of a step that started at ``step_start``, the ``n_vic`` sessions of ``w.vic`` preempted
    (:func:`_preempt_session`; the first ever dates t_sat). Returns the answers."""
    for v in range(n_vic):
        n_ans = _preempt_session(w.vic[v], c, s, ss, fe, a, eng, n_ans)
    if np.isnan(s.t_sat):
        s.t_sat = step_start
    return n_ans


@_inlined
def _answer_step(now, step_start, lat, c, s, ss, fe, w, a, rec, ctl, counts):
    """A step that started at ``step_start``, took ``lat`` and ended at ``now``, its tokens gone to their frames
    and its victims preempted (``counts``: answers up to the frames done, all answers, tokens out, victims, and
    the step's batch, new and context tokens and blocks used): in
    lockstep the silent frames they held back, then all answered, one row per tick, and the step's row
    (FrontEnd._after_step)."""
    n_done, n_ans, tokens_out, n_vic, batch, new_tokens, ctx, used = counts
    if s.npend:
        n_ans = answer_silent(s, fe.pend, w.run_sess, (ss.state, ss.inflight, ss.backlog, ss.next_frame), a, n_ans)
    _answered(now, n_ans, c, s, ss, w, rec, ctl)
    k = s.step0 + s.nsteps
    silent = 0
    for j in range(n_done, n_ans):
        if w.tok[j] == 0:  # serving.frame_is_silent
            silent += 1
    st_i = rec.st_i
    st_i[Q_BATCH, k], st_i[Q_NEW, k], st_i[Q_CTX, k], st_i[Q_USED, k] = batch, new_tokens, ctx, used
    st_i[Q_OUT, k], st_i[Q_DONE, k], st_i[Q_SILENT, k] = tokens_out, n_ans, silent
    # running (not re-prefilling) and waiting at the front end (the caller fills the free blocks)
    st_i[Q_RUNNING, k], st_i[Q_WAITING, k], st_i[Q_PRE, k] = s.nrun - s.npf, s.nwait, n_vic
    rec.st_t[k], rec.st_lat[k] = step_start, lat


@_njit
def _idle(now, c, s, ss, fe, w, idle, turned):
    """An engine without work waits for its next tick, event, departure or arrival; one that would wake no later
    than ``now`` hands the span back, one that would wake at the horizon or after waits and the run ends there
    (PAST_HORIZON, ``s.out_s``). Returns (now, idle, turned, whether the span ends)."""
    until = min(w.tick.min(), c.t_next)
    if s.dep < s.ndeps:
        until = min(until, fe.dep_t[s.dep])
    if s.narr < c.na_end:
        until = min(until, ss.arrival[s.narr])
    if until <= now:
        return now, idle, turned, True
    if until >= c.horizon:  # SimPy stops the run during this wait
        s.out_s = until
        return now, True, PAST_HORIZON, True
    return until, True, turned, False


@_inlined
def _engine_step(now, c, coef, eng, dr, fe, idle, step_no, sframe):
    """EngineModel.step (serving.engine_step on the engine model's own arrays) at ``now``, the first-step term and
    the step's latency. Returns (the latency, TURN_CALLER when this loop goes on after it, or where it stops:
    TURN_TAKEN before it, the step the caller's to take (under correlated jitter its frame's draws are not in this
    call); PAST_HORIZON, it outlives the run; STEP_TAKEN, the front end reacts to something in it that the loop does
    not restate)."""
    if c.jitter == CORRELATED and sframe - c.f_lo >= dr.ja.size:
        return -1.0, TURN_TAKEN
    engine_step(eng)
    o_n = eng.o_n
    # SimEngine._step: a frame starts in a step after the engine idled. (Not a literal False: numba would compile
    # what it is handed to for the literal too; so the zeros below)
    first = np.bool_(False)
    for j in range(o_n[O_SCHED]):
        if fe.fresh[eng.o_s[j]]:
            first = idle
            fe.fresh[eng.o_s[j]] = False
    lat = _step_latency(coef, c, o_n, first, step_no, sframe, dr)
    # FrontEnd._after_step's own rules: a step that scheduled nothing stalls; a front end that steps vLLM itself
    # takes back what it preempted, and looks at every request left waiting (serving.deadlock_pick)
    cnt = eng.cnt
    plain = o_n[O_SCHED] > 0 and (not c.sees or (o_n[O_PRE] == 0 and cnt[E_KW] + cnt[E_WQ] == 0))
    if now + lat >= c.horizon:
        return lat, PAST_HORIZON
    return lat, TURN_CALLER if plain else STEP_TAKEN


@_inlined
def _reaction(turned, c, s, ss, fe, w, eng):
    """After _engine_step said ``turned``: a step the front end reacts to (STEP_TAKEN) that scheduled something,
    with a front end that steps vLLM itself, is taken on here (its victims chosen: :func:`_victims`) when the span
    has room for the frames they will be owed and the requests they give up; the rest is the caller's (a stall, or
    vLLM's own loop seeing nothing). Returns (the victims, TURN_CALLER, or ``turned`` as it was)."""
    o_n = eng.o_n
    if turned != STEP_TAKEN or not c.sees or o_n[O_SCHED] == 0:
        return 0, turned
    n_vic, owed = _victims(ss, fe, w, eng)
    if (o_n[O_SAM] + s.npend + owed > c.ans_cap or s.npend + owed > fe.pend.shape[0]
            or s.nnew + n_vic > fe.new_i.size):
        return 0, STEP_TAKEN
    return n_vic, TURN_CALLER


@nb.njit(cache=True)
def run_span(conf, state, coef, live, ss, fe, eng, dr, rec, ctl):
    """Turns and steps from just after the caller's turn at ``state.now`` until the next event, ``max_steps`` or
    what this loop does not restate. The records' arrays are updated in place, the steps and frames written to
    ``rec`` and ``state`` says where it stopped (``turned``)."""
    # the arguments live as long as this call: inside it they need no reference counts (compiled.borrowed)
    coef, live = borrowed((coef, live))
    ss, fe, eng, dr, rec, ctl = borrowed(ss), borrowed(fe), borrowed(eng), borrowed(dr), borrowed(rec), borrowed(ctl)
    c, s = conf[0], state[0]
    now, idle, turned = s.now, s.idle, TURN_TAKEN  # (the caller's turn at `now` is done)
    s.nsteps = s.nnew = 0
    owned, ok, n_ready = span.allocate(live, ss, c, c.ans_cap + fe.pend.shape[0], eng.status.size)
    w = borrowed(owned)  # (held to the end: hold)
    a = Tally(ss.pslot, ss.s_frames, ss.s_silent, w.key, w.who, w.tok)
    o_n = eng.o_n
    while ok:
        if turned == TURN_CALLER:
            taken, n_sub, latest = _turn(now, c, s, ss, fe, w, a, eng, rec, ctl, n_ready, live)
            if not taken:
                break
            s.sframe, n_ready = max(s.sframe, latest), 0
            if now >= c.t_pause:  # the turn is taken: the caller looks, then calls again from here
                turned = PAUSED
                break
        turned = TURN_CALLER
        if eng.cnt[E_RUN] + eng.cnt[E_KW] + eng.cnt[E_WQ] == 0:  # no work: wait (no step ran: none is "right after")
            now, idle, turned, ends = _idle(now, c, s, ss, fe, w, idle, turned)
            s.prelast = False
            if ends:
                break
            continue
        lat, turned = _engine_step(now, c, coef, eng, dr, fe, idle, s.nsteps, s.sframe)
        n_vic = 0
        if turned == STEP_TAKEN:  # the front end reacts to the step: here, if it can
            n_vic, turned = _reaction(turned, c, s, ss, fe, w, eng)
        idle = idle and turned == TURN_TAKEN  # (TURN_TAKEN: the step is the step-by-step path's to take)
        if turned != TURN_CALLER:  # (SimPy stops a run during a step that outlives it; STEP_TAKEN: it took `lat`)
            s.out_s = now + lat if turned == PAST_HORIZON else lat
            break
        step_start, now, s.prelast = now, now + lat, n_vic > 0
        tokens_out, n_done, n_ready = _tokens_to_frames(now, s, ss, fe, w, eng)
        n_ans = n_done
        if n_vic:
            n_ans = _preempt_all(step_start, n_vic, c, s, ss, fe, w, a, eng, n_ans)
        counts = (n_done, n_ans, tokens_out, n_vic, o_n[O_SCHED], o_n[O_NEW], o_n[O_CTX], o_n[O_USED])
        _answer_step(now, step_start, lat, c, s, ss, fe, w, a, rec, ctl, counts)
        s.peak, s.nsteps = max(s.peak, o_n[O_USED]), s.nsteps + 1
    s.turned, s.idle, s.now = turned, idle, now
    hold(owned)


# what run_span compiles into itself from other modules: the engine step (with the residency it calls), the step
# model's form, the jitter ratio, the admission controllers, the hold on borrowed arrays, what a silent frame is and
# the session states (the front end's module: its constants are compiled in as they were)
FORM_PARTS = (serving, kv_policy, step_inputs, jitter_kernel, control_kernel, admission, percentile_kernel, compiled,
              results.silent_cause, front_end, front_rules, recorder, span)
STEP_FORM = compiled.guard(run_span, FORM_PARTS)  # before any loop is called, so none has loaded its cache yet
