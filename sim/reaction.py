"""The front end's reaction to an engine step, in the simulator's compiled loop (:mod:`metronome.sim.fastpath`), on
the engine model's arrays: the sessions whose requests the engine preempted and the deadlock rule's victims
(:func:`metronome.serving.deadlock_pick`, among the sessions starved for blocks: :func:`metronome.front_rules.
awaits_engine`) lose their place (:func:`metronome.front_rules.lose_place`), their requests aborted.

:class:`metronome.front_end.FrontEnd` takes the same decision through its engine's interface (it serves vLLM's own
scheduler too); both ask the same rules.
"""

from __future__ import annotations

import numpy as np

from metronome import compiled, front_rules, serving
from metronome.front_rules import PREFILL, Queues, awaits_engine, lose_place
from metronome.serving import abort_slot, deadlock_pick, resume_need
from metronome.sim import span
from metronome.sim.span import STEP_TAKEN, TURN_CALLER, W_CODE, X_CODE, inlined, spliced

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)


@inlined
def victims(ss, fe, w, eng):
    """The front end's reaction to a step that scheduled something (a stall is the caller's), on the engine model's
    arrays: the sessions whose requests the engine preempted, then the deadlock rule's victims
    (serving.deadlock_pick) among the sessions still in the engine, the starved ones' need asked of
    serving.resume_need. Written to ``w.vic`` in the order they are preempted; ``w.scr`` is scratch, a row per slot,
    its marks all 0 between calls. Returns (how many, an upper bound of the frames they will be owed: their frame in
    flight and those queued).

    A starved request waits in the engine (EngineModel.waiting_of), so it is in the kv-holding or the waiting queue:
    the starved ones' need is summed over those two queues, and only when it exceeds the free blocks (the rule takes
    victims) are the slots scanned for every session in the engine. Past N* a step leaves requests waiting every
    time, and a scan of every slot the run ever used, each step, was the loop's cost."""
    mark, who, need, seq, hl, order = w.scr[0], w.scr[1], w.scr[2], w.scr[3], w.scr[4], w.scr[5]
    cnt, o_n, held, status, vic = eng.cnt[0], eng.o_n[0], eng.held, eng.status, w.vic
    n_vic = 0
    owed = 0
    free = eng.lim[0].num_blocks - cnt.used
    for j in range(o_n.preempted):  # (aborted first: its blocks, if any, are free for the rule below)
        sl = eng.o_pre[j]
        i = fe.sess_of_slot[sl]
        mark[sl] = 2
        vic[n_vic] = i
        n_vic += 1
        owed += 1 + ss.backlog[i]
        free += held[sl]
    for j in range(o_n.sched):
        if mark[eng.o_s[j]] == 0:
            mark[eng.o_s[j]] = 1
    step_no = cnt.steps - 1
    total = 0
    n_kw = cnt.n_kw
    for q in range(n_kw + cnt.n_wq):
        sl = eng.kw[q] if q < n_kw else eng.wq[q - n_kw]
        if mark[sl] == 0:
            total += starved_need(sl, ss, fe, eng, step_no)
    if total > free:
        k = 0
        for sl in range(cnt.next_slot):  # every session with a request in the engine
            if mark[sl] == 2 or status[sl] == 0:
                continue
            i = fe.sess_of_slot[sl]
            if ss.slot[i] != sl:
                continue
            who[k], seq[k], hl[k] = i, ss.admit_seq[i], held[sl]
            need[k] = 0 if mark[sl] else starved_need(sl, ss, fe, eng, step_no)
            k += 1
        m = deadlock_pick(need[:k], seq[:k], hl[:k], free, False, order)
        for q in range(m):
            i = who[order[q]]
            vic[n_vic] = i
            n_vic += 1
            owed += 1 + ss.backlog[i]
    for j in range(o_n.preempted):  # (the marks back to 0, without touching every slot)
        mark[eng.o_pre[j]] = 0
    for j in range(o_n.sched):
        mark[eng.o_s[j]] = 0
    return n_vic, owed


@spliced
def starved_need(sl, ss, fe, eng, step_no):
    """Blocks request ``sl`` is starved for (serving.resume_need), 0 if it is not starved: its session's work (a
    frame, or a re-prefill) was handed over before the step, and it waits in the engine (EngineModel.waiting_of).
    The caller has ruled out a request scheduled or preempted in the step."""
    i = fe.sess_of_slot[sl]
    st = eng.status[sl]
    if ss.slot[i] == sl and awaits_engine(i, step_no, ss) and (st == W_CODE or st == X_CODE):
        lim = eng.lim[0]
        return resume_need(eng.ntok[sl], eng.computed[sl], eng.held[sl], lim.block_size, lim.cap, lim.sink_blocks,
                           lim.window)
    return 0


@spliced
def abort(i, ss, fe, eng):
    """Session ``i``'s request aborted (EngineModel.abort: serving.abort_slot), if it has one (none before its first
    frame)."""
    sl = ss.slot[i]
    if sl >= 0:
        abort_slot(sl, eng.cnt[0], eng.status, eng.slots, eng.held, eng.run, eng.kw, eng.wq)
        fe.fresh[sl] = False
        ss.slot[i] = -1


@inlined
def preempt_session(i, c, s, ss, fe, a, eng, n_ans):
    """Session ``i`` loses its place (front_rules.lose_place), its request aborted. Returns the answers."""
    abort(i, ss, fe, eng)
    s.ndrop += 1
    if ss.state[i] == PREFILL:
        s.npf -= 1
    s.nrun -= 1
    n_ans = lose_place(i, c.lockstep, ss, fe.books[0], Queues(fe.queue, fe.dep_t, fe.dep_i, fe.pend), a, n_ans)
    ss.s_preempt[i] += 1
    return n_ans


@inlined
def preempt_all(step_start, n_vic, c, s, ss, fe, w, a, eng, n_ans):
    """After the tokens of a step that started at ``step_start``, the ``n_vic`` sessions of ``w.vic`` preempted
    (:func:`preempt_session`; the first ever dates t_sat). Returns the answers."""
    for v in range(n_vic):
        n_ans = preempt_session(w.vic[v], c, s, ss, fe, a, eng, n_ans)
    b = fe.books[0]
    if np.isnan(b.t_sat):
        b.t_sat = step_start
    return n_ans


@inlined
def react(turned, c, s, ss, fe, w, eng):
    """After _engine_step said ``turned``: a step the front end reacts to (STEP_TAKEN) that scheduled something,
    with a front end that steps vLLM itself, is taken on here (its victims chosen: :func:`victims`) when the span
    has room for the frames they will be owed; the rest is the caller's (a stall, or vLLM's own loop seeing
    nothing). Returns (the victims, TURN_CALLER, or ``turned`` as it was)."""
    o_n = eng.o_n[0]
    if turned != STEP_TAKEN or not c.sees or o_n.sched == 0:
        return 0, turned
    n_vic, owed = victims(ss, fe, w, eng)
    npend = fe.books[0].npend
    if o_n.sampled + npend + owed > c.ans_cap or npend + owed > fe.pend.shape[0]:
        return 0, STEP_TAKEN
    return n_vic, TURN_CALLER


# what the reaction compiles in from other modules: its cache is dropped when they change
REACTION_PARTS = (front_rules, serving, span)
REACTION_FORM = compiled.guard(victims, REACTION_PARTS)
