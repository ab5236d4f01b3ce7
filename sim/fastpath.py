"""The simulator's hot loop, compiled: turns and steps of a steady span, one machine-code loop.

An hour of Moshi is hundreds of thousands of steps, and under independent phases nothing repeats from one step to
the next that numpy could take a whole span at a time. This module runs the front end's turns and the engine's
steps in numba, under either phase regime. It states no rule of its own: the front end's are
:mod:`metronome.front_rules`' (what :class:`metronome.front_end.FrontEnd` calls too), the order of a turn
:func:`metronome.front_rules.turn`, the engine step :func:`metronome.serving.engine_step` on the engine model's own
arrays, the deadlock rule :func:`metronome.serving.deadlock_pick` and a frame row
:func:`metronome.sim.recorder.flush`. What is here is the loop: a turn's phases on its arrays, the step's latency
with its jitter draw, and what it may take without the caller.

A turn visits only the phase slots whose tick came due (:mod:`metronome.sim.span`'s wheel) and a step reads only
the requests with work, so a step's cost follows its batch, not the sessions in flight. Before a turn it would take
differently (the length limit, a rebase, an arrival the gate queues) it stops and hands back, and the step-by-step
path takes it from exactly there; a step after which the front end must act in Python (a stall, a reaction the span
has no room for) is handed back once taken (``STEP_TAKEN``). ``tests/test_sim_scenarios.py`` compares the two, bit
for bit, and ``tests/test_front_end_differential.py`` both with the live driver.
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
                                   admit_head, answer_silent, chunk_of, end_owed, enter, hand_over, leave_queue,
                                   readmitted, request_tokens, tick_due, tokens_in, turn, after_step)
from metronome.front_rules import live as _live
from metronome.front_rules import placeless as _placeless
from metronome.serving import frame_tick as _tick
from metronome.jitter_kernel import correlated_ratio
from metronome.serving import add_slot, engine_step, gate_blocks_jit, resume_slot
from metronome.sim import reaction, recorder, span
from metronome.sim.recorder import Answers, Clock, Owners, flush
from metronome.sim.span import (CORRELATED, CTL_AFTER, CTL_COMPILED, INDEPENDENT, P_CODE, PAST_HORIZON, PAUSED,
                                STEP_TAKEN, TURN_CALLER, TURN_TAKEN)
from metronome.sim.span import inlined as _inlined
from metronome.sim.span import njit as _njit
from metronome.sim.span import spliced as _spliced

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

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
    eps, maxlen = c.eps, eng.lim[0].max_len
    n_ans = 0
    for j in range(n_visit):
        i = w.visit[j]
        P = ss.P_of[i]
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
    b = fe.books[0]
    for j in range(n_visit):
        i = w.visit[j]
        if ss.state[i] != ENDED:  # (departed in this turn)
            n_ans, _ = tick_due(i, now, c.eps, c.lockstep, ss, b, fe.pend, a, n_ans, None, 0)  # (no record kept)
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
    session's first frame, with its prompt, becomes a new request at the tail of ``waiting`` (serving.add_slot),
    in session order as the step-by-step turn hands them over (front_rules.hand_over). Returns the latest frame
    handed over."""
    latest = -1
    n_first = 0
    steps = eng.cnt[0].steps
    for j in range(n_visit):
        i = w.visit[j]
        if ss.inflight[i] < 0 and ss.backlog[i] > 0:
            sl = ss.slot[i]
            if sl < 0:  # its first frame: after the others (a session may be visited twice: kept once, below)
                w.firsts[n_first] = i
                n_first += 1
                continue
            chunk = chunk_of(i, ss)
            resume_slot(sl, chunk, ss.n_out_of[i], eng.cnt[0], eng.status, eng.computed, eng.ntok, eng.out, eng.maxtok,
                        eng.kw)
            latest = max(latest, hand_over(i, sl, chunk, steps, ss, fe.fresh))
    firsts = w.firsts[:n_first]
    _sort_in_place(firsts)
    last = -1  # (the kept ones are written back over those already read)
    for a in range(n_first):
        i = firsts[a]
        if i == last:
            continue
        last = i
        first = chunk_of(i, ss)
        sl = add_slot(ss.hist[i] + first, ss.n_out_of[i], eng.cnt[0], eng.status, eng.ntok, eng.maxtok, eng.kseq,
                      eng.wq)
        ss.slot[i], fe.sess_of_slot[sl] = sl, i
        s.nfirst += 1
        latest = max(latest, hand_over(i, sl, first, steps, ss, fe.fresh))
    return latest


@_inlined
def _step_latency(coef, c, o_n, first, step_no, sframe, dr):
    """StepLatencyModel.step_s of the step ``o_n`` counts (the same sums in the same order, bit for bit), the
    first-step term, the jitter."""
    xs = _step_inputs(float(o_n.sched), float(o_n.ctx_tokens), float(o_n.new_tokens), c.route)
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
    a = Tally(ss.pslot, ss.s_frames, ss.s_silent, w.key, w.who, w.tok)
    n_done, n_pre, tokens_out, n_ready = tokens_in(eng.o_sam[:eng.o_n[0].sampled], now, ss, fe.sess_of_slot, a,
                                                   np.int64(0), None, w.ready)
    s.npf -= n_pre
    return tokens_out, n_done, n_ready


@_inlined
def _departures_due(now, s, ss, fe, held):
    """The departures due at a turn at ``now``, in the order booked: where they end in ``fe.dep_t``, the blocks
    they free and (at most) the frames they leave owed."""
    b = fe.books[0]
    freed = 0
    owed = 0
    k = b.dep
    while k < b.ndeps and fe.dep_t[k] <= now:
        i = fe.dep_i[k]
        if _live(ss.state[i]):  # (a session that already ended is passed over)
            if ss.slot[i] >= 0:  # (admitted, its first frame not yet due: no request yet)
                freed += held[ss.slot[i]]
            owed += ss.backlog[i] + 1
            for q in range(b.phead, b.npend):
                if fe.pend[q, 0] == i:
                    owed += 1
        k += 1
    return k, freed, owed


# The turn's phases (front_rules.turn calls each as phase(x, now), x the turn's records: the conf, the span's
# counters, the sessions, the front end's queues, the span's own arrays, the answers' tally, the engine, the rows, the
# controller, and the sessions with frames queued after the last step). The few lines of a phase that only calls
# or loops are spliced into the turn: compiled apart, each would be optimized once more on its own (about half a
# second of every cold compile of the loop).
@_inlined
def _arrive(x, now):
    """The arrivals up to ``now``: each passes the gate (the controller's may_admit, compiled) with the sessions in
    flight and enters (front_rules.enter), or is refused (the caller names the reason)."""
    c, s, ss, fe, w, _, _, _, ctl, _ = x
    b = fe.books[0]
    while b.narr < c.na_end and ss.arrival[b.narr] <= now:
        i = b.narr
        b.narr += 1
        if ss.arrival[i] >= c.horizon:
            continue
        in_flight = s.nrun + b.nwait
        # (the count as a float, as every other caller gives it: one compiled form of the controller's kernel)
        if c.ctl == CTL_COMPILED and not ck.may_admit(ctl, now, float(in_flight)):
            ss.state[i] = REFUSED
            ss.s_ended[i] = now
            continue
        nf = enter(i, ss.arrival[i], ss, b, Queues(fe.queue, fe.dep_t, fe.dep_i, fe.pend))
        k = span.wheel_slot(i, ss, c)
        w.tick[k] = min(w.tick[k], _tick(nf, ss.P_of[i], ss.phase[i]))  # (its slot's others, if any, no later)


@_inlined
def _admissions(now, c, s, ss, fe, lim, free, room, leaving):
    """The FCFS admission (serving.admit_fcfs), planned: how many heads of the front end's queue (less those
    ``leaving`` before it) get the blocks vLLM's gate wants (serving.admission_need_blocks), none right after a step
    that preempted (the books' ``prelast``), or -1 when one that does is one this loop does not take (a readmission
    past the length limit; a first frame due now past it; either without room for its request)."""
    b = fe.books[0]
    if b.prelast:
        return 0
    n = 0
    for q in range(b.qhead, b.qhead + b.nwait):
        i = fe.queue[q]
        gone = False
        for d in leaving:
            gone = gone or d == i
        if gone:
            continue
        need = gate_blocks_jit(request_tokens(i, ss), lim.block_size, lim.cap, 0)
        if need > free:
            break
        if ss.started[i]:  # readmitted at once, its history its prompt, unless it must rebase (the caller's)
            room -= 1
            if room < 0 or ss.hist[i] + ss.pending_in[i] + c.tpf >= lim.max_len:  # (serving.frame_fits)
                return -1
        elif _tick(ss.next_frame[i], ss.P_of[i], ss.phase[i]) <= now + c.eps:  # its first frame is due now
            room -= 1
            if room < 0 or not _first_fits(i, ss, lim.max_len):
                return -1
        free -= need
        n += 1
    return n


@_inlined
def _admit(now, n, c, s, ss, fe, eng):
    """The ``n`` heads of the front end's queue are admitted (front_rules.admit_head); one that lost its place comes
    back as a new request whose prompt is its whole history, and one token to sample (front_rules.readmitted)."""
    b = fe.books[0]
    for _ in range(n):
        i, new = admit_head(now, b.seq, ss, b, fe.queue)
        b.seq += 1
        s.nrun += 1
        if new:
            continue
        prompt = ss.hist[i] + ss.pending_in[i]
        sl = add_slot(prompt, np.int64(1), eng.cnt[0], eng.status, eng.ntok, eng.maxtok, eng.kseq, eng.wq)
        ss.slot[i], fe.sess_of_slot[sl] = sl, i
        s.nreadmit += 1
        readmitted(i, prompt, eng.cnt[0].steps, ss)
        s.npf += 1


@_inlined
def _depart(i, now, c, s, ss, fe, a, eng, n_ans):
    """A session departs: its request aborted, or its place in the front end's queue given up, then the frames it
    is owed answered once their deadline has passed (front_rules.end_owed; the loop keeps no rows of those it never
    answers). Returns the answers."""
    reaction.abort(i, ss, fe, eng)
    if ss.state[i] == WAITING:
        leave_queue(i, fe.books[0], fe.queue)
    else:
        s.nrun -= 1
        if ss.state[i] == PREFILL:
            s.npf -= 1
    n_ans, _ = end_owed(i, now, (ss.P_of[i], ss.phase[i], ss.deadline_of[i], c.eps, False),
                        (ss.state, ss.inflight, ss.inflight_tok, ss.next_frame, ss.backlog), fe.books[0], fe.pend, a,
                        n_ans, None)
    ss.s_ended[i] = now
    return n_ans


@_inlined
def _turn_plan(x, now):
    """The checks of the turn at ``now``, after its arrivals: the sessions it visits, whether this loop takes the
    rest as the step-by-step turn would (_turn_fits, the departures, the admissions, room for the answers) and what
    the phases after it take (the span's counters: visited, slots due, the departures' end in ``fe.dep_t``, sessions
    admitted; no answers yet). Returns whether it is taken."""
    c, s, ss, fe, w, _, eng, _, _, n_ready = x
    n_visit, n_due = span.due_sessions(now, c.eps, w, n_ready, ss.state)
    fits, n_ans, room = _turn_fits(now, n_visit, c, ss, w, eng, eng.status.size - eng.cnt[0].next_slot)
    k0 = fe.books[0].dep
    k1, freed, owed = _departures_due(now, s, ss, fe, eng.held)
    n_adm = _admissions(now, c, s, ss, fe, eng.lim[0], eng.lim[0].num_blocks - (eng.cnt[0].used - freed), room,
                        fe.dep_i[k0:k1])
    s.nvisit, s.ndue, s.depend, s.nadm, s.nans = n_visit, n_due, k1, n_adm, 0
    return (fits and n_adm >= 0 and owed + n_ans <= c.ans_cap
            and (not c.lockstep or fe.books[0].npend + n_ans <= fe.pend.shape[0]))


@_spliced
def _departures(x, now):
    """The departures due (:func:`_depart`), each leaving its phase slot's tick to the sessions left in it."""
    c, s, ss, fe, w, a, eng, _, _, _ = x
    # (the constants a loop below reads, in locals: a record's field is read from memory again after every store
    # the compiler cannot tell apart from it, and the slot loop runs at every turn)
    eps = c.eps
    n_ans = s.nans
    b = fe.books[0]
    for k in range(b.dep, s.depend):
        i = fe.dep_i[k]
        if _live(ss.state[i]):
            n_ans = _depart(i, now, c, s, ss, fe, a, eng, n_ans)
            sl = span.wheel_slot(i, ss, c)
            if w.tick[sl] > now + eps:  # its slot may have no one left to tick (or, OWN, a later tick)
                w.tick[sl] = span.slot_tick(sl, w, ss)
    b.dep = s.depend
    s.nans = n_ans


@_spliced
def _admission(x, now):
    """The sessions the plan admits (:func:`_admit`; rare: a call with all it needs costs every turn)."""
    c, s, ss, fe, _, _, eng, _, _, _ = x
    if s.nadm:
        _admit(now, s.nadm, c, s, ss, fe, eng)


@_spliced
def _due(x, now):
    """The frames that came due (:func:`_queue_due`), the wheel's slots that came due moved on, then each paused
    session's oldest frame and the first frames handed to the engine (:func:`_submit_due`)."""
    c, s, ss, fe, w, a, eng, _, _, _ = x
    s.nans = _queue_due(now, s.nvisit, c, s, ss, fe, w, a, s.nans)
    for j in range(s.ndue):  # the slots that came due: their sessions moved on together (a departure leaves a slot
        k = w.due[j]  # that was not due as it was, and nothing else here moves a slot's tick)
        w.tick[k] = span.slot_tick(k, w, ss)
    b = fe.books[0]
    b.sframe = max(b.sframe, _submit_due(s.nvisit, s, ss, fe, w, eng))


@_spliced
def _silence(x, now):
    """In lockstep, the silent frames the turn's work releases (front_rules.answer_silent; none owed: nothing to
    answer, and no need to scan the running sessions)."""
    c, s, ss, fe, w, a, _, _, _, _ = x
    b = fe.books[0]
    if c.lockstep and b.npend:
        s.nans = answer_silent(b, fe.pend, w.run_sess, (ss.state, ss.inflight, ss.backlog, ss.next_frame), a, s.nans)


@_spliced
def _turn_answers(x, now):
    """The turn's answers recorded (:func:`_answered`)."""
    c, s, ss, fe, w, _, _, rec, ctl, _ = x
    _answered(now, s.nans, c, s, ss, fe, w, rec, ctl)


# Without numba's reference counting (compiled.inlined: also compiled into run_span): the turn handed on the loop's
# arrays (borrowed, without an owner) at some 330 increments and decrements, no-ops but calls all the same, ~10 % of
# a run. So nothing it calls may allocate or return a view (its sorts work in buffers the span owns:
# _sort_in_place, serving.key_order_in); what allocates, and everything it reaches in other modules, is made with
# compiled.counted, which keeps the counting, or, if it allocates nothing, with compiled.uncounted or
# compiled.inlined: either way its flags are its own, not the turn's. This module's own helpers take the turn's.
@_inlined
def _turn(now, c, s, ss, fe, w, a, eng, rec, ctl, n_ready):
    """The front end's turn at ``now`` in the order it is stated once (front_rules.turn), on this loop's phases: the
    arrivals, then, if the checks pass (:func:`_turn_plan`; else the caller takes the rest of the turn), the
    departures due, the admissions, the frames that came due and, in lockstep, the silent frames they release, and
    the answers recorded. None of it when the span ends here: at its next event, after its steps, or without room
    for another turn and step. Returns whether it was taken."""
    ans_cap = c.ans_cap
    if (now >= c.t_next or s.nsteps >= c.max_steps or s.nrows + 2 * ans_cap > rec.fr.fr_f.size
            or ck.open_samples(ctl) + 2 * ans_cap > ctl.lat.size):
        return False
    return turn((c, s, ss, fe, w, a, eng, rec, ctl, n_ready), now, _arrive, _turn_plan, _departures, _admission, _due,
                _silence, _turn_answers)


@_inlined
def _answered(now, n_ans, c, s, ss, fe, w, rec, ctl):
    """The moment's answers recorded (:func:`flush`) and told to a compiled controller as SimEngine._flush_answers
    tells it (row by row; all at one moment: control_kernel.observe_moment)."""
    if n_ans == 0:
        return
    r0 = s.nrows
    in_flight = s.nrun + fe.books[0].nwait
    ans = Answers(w.key, w.who, w.tok, w.at, w.work)
    owners = Owners(ss.state, ss.s_admitted, ss.s_late, ss.P_of, ss.phase, ss.deadline_of)
    fr = rec.fr
    s.nrows = flush(now, n_ans, ans, owners, Clock(c.P, c.Pq, c.eps, c.shaped), fr, r0,
                    in_flight if c.ctl == CTL_AFTER else -1)
    if c.ctl == CTL_COMPILED:  # (the rows were all answered at `now` with `in_flight` in flight)
        ck.observe_moment(ctl, now, in_flight, fr.fr_lat[r0:s.nrows], fr.frames[r0:s.nrows], fr.silent[r0:s.nrows])


# What follows a step, in the order front_rules.after_step states once (each phase called as phase(x, now), x the
# turn's records; in lockstep the turn's own _silence answers the frames the step released). What the step found
# and what one phase leaves the next live in the span's counters: the step's start, latency and victims
# (STATE.step_start, step_s, nvic), the frames its tokens finished and the moment's answers (ndone, nans), its tokens
# out and the sessions with frames still queued (tokens_out, nready).
@_spliced
def _step_tokens(x, now):
    """The step's sampled tokens to their frames, the frames done answered (:func:`_tokens_to_frames`)."""
    _, s, ss, fe, w, _, eng, _, _, _ = x
    s.tokens_out, s.ndone, s.nready = _tokens_to_frames(now, s, ss, fe, w, eng)
    s.nans = s.ndone


@_spliced
def _step_preemptions(x, now):
    """The engine's preemptions and the deadlock rule's victims (found by reaction.react as the step ended), each
    losing its place (reaction.preempt_all), dated at the step's start; a step that preempted holds admission back
    for a turn; the peak of blocks used, as the step left them (FrontEnd._step_preemptions)."""
    c, s, ss, fe, w, a, eng, _, _, _ = x
    b = fe.books[0]
    if s.nvic:
        s.nans = reaction.preempt_all(s.step_start, s.nvic, c, s, ss, fe, w, a, eng, s.nans)
    b.prelast, b.peak = s.nvic > 0, max(b.peak, eng.o_n[0].used)


@_spliced
def _step_records(x, now):
    """The moment's answers recorded, one row per tick (:func:`_answered`), then the step's row: its batch, new and
    context tokens, blocks used, tokens out, frames answered and silent, the sessions running (not re-prefilling)
    and waiting at the front end (the caller fills the free blocks), its victims."""
    c, s, ss, fe, w, _, eng, rec, ctl, _ = x
    _answered(now, s.nans, c, s, ss, fe, w, rec, ctl)
    o_n = eng.o_n[0]
    k = s.step0 + s.nsteps
    silent = 0
    for j in range(s.ndone, s.nans):
        if serving.frame_is_silent(w.tok[j]):
            silent += 1
    rec.batch[k], rec.new_tokens[k], rec.context_tokens[k], rec.resident_blocks[k] = (o_n.sched, o_n.new_tokens,
                                                                                       o_n.ctx_tokens, o_n.used)
    rec.tokens_out[k], rec.frames_done[k], rec.silent_frames[k] = s.tokens_out, s.nans, silent
    rec.running[k], rec.waiting[k], rec.preemptions[k] = s.nrun - s.npf, fe.books[0].nwait, s.nvic
    rec.st_t[k], rec.st_lat[k] = s.step_start, s.step_s


@_njit
def _idle(now, c, s, ss, fe, w, idle, turned):
    """An engine without work waits for its next tick, event, departure or arrival; one that would wake no later
    than ``now`` hands the span back, one that would wake at the horizon or after waits and the run ends there
    (PAST_HORIZON, ``s.out_s``). Returns (now, idle, turned, whether the span ends)."""
    until = min(w.tick.min(), c.t_next)
    b = fe.books[0]
    if b.dep < b.ndeps:
        until = min(until, fe.dep_t[b.dep])
    if b.narr < c.na_end:
        until = min(until, ss.arrival[b.narr])
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
    o_n = eng.o_n[0]
    # SimEngine._step: a frame starts in a step after the engine idled. (Not a literal False: numba would compile
    # what it is handed to for the literal too; so the zeros below)
    first = np.bool_(False)
    for j in range(o_n.sched):
        if fe.fresh[eng.o_s[j]]:
            first = idle
            fe.fresh[eng.o_s[j]] = False
    lat = _step_latency(coef, c, o_n, first, step_no, sframe, dr)
    # what the front end does after a step in Python: a step that scheduled nothing stalls; a front end that steps
    # vLLM itself takes back what it preempted, and looks at every request left waiting (serving.deadlock_pick)
    cnt = eng.cnt[0]
    plain = o_n.sched > 0 and (not c.sees or (o_n.preempted == 0 and cnt.n_kw + cnt.n_wq == 0))
    if now + lat >= c.horizon:
        return lat, PAST_HORIZON
    return lat, TURN_CALLER if plain else STEP_TAKEN


@nb.njit(cache=True)
def run_span(conf, state, coef, live, ss, fe, eng, dr, rec, ctl):
    """Turns and steps from ``state.now`` until the next event, ``max_steps`` or what this loop does not restate:
    from just after the caller's turn there (``state.turned`` TURN_TAKEN), or from that turn itself (TURN_CALLER;
    ``state.took`` says whether this loop took it). The records' arrays are updated in place, the steps and frames
    written to ``rec`` and ``state`` says where it stopped (``turned``)."""
    # the arguments live as long as this call: inside it they need no reference counts (compiled.borrowed)
    coef, live = borrowed((coef, live))
    ss, fe, eng, dr, rec, ctl = borrowed(ss), borrowed(fe), borrowed(eng), borrowed(dr), borrowed(rec), borrowed(ctl)
    c, s, b = conf[0], state[0], fe.books[0]
    now, idle, turned = s.now, b.idle, s.turned
    s.nsteps = s.nfirst = s.nreadmit = s.ndrop = s.took = 0
    owned, ok, n_ready = span.allocate(live, ss, c, c.ans_cap + fe.pend.shape[0], eng.status.size)
    w = borrowed(owned)  # (held to the end: hold)
    a = Tally(ss.pslot, ss.s_frames, ss.s_silent, w.key, w.who, w.tok)
    while ok:
        if turned == TURN_CALLER:
            if not _turn(now, c, s, ss, fe, w, a, eng, rec, ctl, n_ready):
                break
            n_ready, s.took = 0, s.took + 1
            if now >= c.t_pause:  # the turn is taken: the caller looks, then calls again from here
                turned = PAUSED
                break
        turned = TURN_CALLER
        cnt = eng.cnt[0]
        if cnt.n_run + cnt.n_kw + cnt.n_wq == 0:  # no work: wait (no step ran: none is "right after")
            now, idle, turned, ends = _idle(now, c, s, ss, fe, w, idle, turned)
            b.prelast = False
            if ends:
                break
            continue
        lat, turned = _engine_step(now, c, coef, eng, dr, fe, idle, s.nsteps, b.sframe)
        n_vic = 0
        if turned == STEP_TAKEN:  # the front end reacts to the step: here, if it can
            n_vic, turned = reaction.react(turned, c, s, ss, fe, w, eng)
        idle = idle and turned == TURN_TAKEN  # (TURN_TAKEN: the step is the step-by-step path's to take)
        if turned != TURN_CALLER:  # (SimPy stops a run during a step that outlives it; STEP_TAKEN: it took `lat`)
            s.out_s = now + lat if turned == PAST_HORIZON else lat
            break
        s.step_start, s.step_s, s.nvic, now = now, lat, n_vic, now + lat
        after_step((c, s, ss, fe, w, a, eng, rec, ctl, n_ready), now, _step_tokens, _step_preemptions, _silence,
                   _step_records)
        n_ready, s.nsteps = s.nready, s.nsteps + 1
    s.turned, b.idle, s.now = turned, idle, now
    hold(owned)


# what run_span compiles into itself from other modules: the engine step (with the residency it calls), the step
# model's form, the jitter ratio, the admission controllers, the hold on borrowed arrays, what a silent frame is and
# the session states (the front end's module: its constants are compiled in as they were)
FORM_PARTS = (serving, kv_policy, step_inputs, jitter_kernel, control_kernel, admission, percentile_kernel, compiled,
              results.silent_cause, front_end, front_rules, reaction, recorder, span)
STEP_FORM = compiled.guard(run_span, FORM_PARTS)  # before any loop is called, so none has loaded its cache yet
