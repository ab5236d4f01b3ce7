"""What one call of the simulator's compiled loop (:mod:`metronome.sim.fastpath`) takes and keeps: its constants and
counters (numpy records), the front end's queues as it runs on them, the buffers a span allocates, the jitter draws,
what it reports, and the wheel over the phase slots that tells a turn which sessions it visits.

:class:`metronome.sim.engine.SimEngine` fills them from the front end's own arrays (they are those arrays) and reads
them back after the call.
"""

from __future__ import annotations

from collections import namedtuple

import numba as nb
import numpy as np

from metronome import compiled, front_end, front_rules, serving
from metronome.front_rules import RUNNING
from metronome.front_rules import live as _live
from metronome.serving import frame_tick as _tick
from metronome.serving import PHASE_SLOTS, EngineModel, key_order_work

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

P_CODE = EngineModel.PAUSED_CODE
W_CODE, X_CODE = EngineModel.WAITING_CODE, EngineModel.PREEMPTED_CODE  # waiting: new or resumed; preempted

# Constants and counters are numpy records of one element: numba reads and writes a field as a load or a store at
# its offset and hands a record to a callee as one pointer, where a named tuple of scalars would be copied whole
# into every call and could not be written.
# The span's constants. max_steps: steps this call may take; ans_cap: answers one turn or step may write; f_lo: the
# first frame whose correlated-jitter parts the call is given; sees: the front end sees starved and preempted
# requests after each step (serving.sees_starvation); na_end: the arrivals the loop takes are those before this one;
# ctl: how the admission controller hears answered frames (CTL_*); tpf: a frame's KV tokens (a readmission leaves
# room for one); P: the run's frame period; Pq: one phase slot; shaped: some session ticks on a clock of its own
# (front_end.on_run_clock: each row's tick is then its sessions', recorder.flush); t_next: the next event the loop
# leaves to the caller; first_s: the first-step term; jitter: NO_JITTER, INDEPENDENT or CORRELATED; wz, wshared,
# wown: the correlated jitter's weights; t_pause: the loop hands back after the first turn from then on, so a
# caller can look at the run (unlike t_next it is no event, and nothing waits for it); route: the step model's
# moe_route (step_inputs)
CONF = np.dtype([("max_steps", np.int64), ("ans_cap", np.int64), ("f_lo", np.int64), ("lockstep", np.bool_),
                 ("sees", np.bool_), ("na_end", np.int64), ("ctl", np.int64), ("tpf", np.int64), ("P", np.float64),
                 ("Pq", np.float64), ("shaped", np.bool_), ("t_next", np.float64), ("first_s", np.float64),
                 ("eps", np.float64), ("jitter", np.int64), ("horizon", np.float64), ("wz", np.float64),
                 ("wshared", np.float64), ("wown", np.float64), ("t_pause", np.float64), ("route", np.float64)],
                align=True)
# The span's counters, in and out. now: where the loop is; out_s: where a step past the horizon ends, or how long a
# STEP_TAKEN step took; sessions running (re-prefilling ones included: nrun) and re-prefilling (npf), counted for
# the span; the sessions' first frames it handed over, those it readmitted and preempted (nfirst, nreadmit,
# ndrop: counts for the caller's books), the first step row to write (step0) and the steps written (nsteps),
# the row after the last frame row written (nrows) and where it stopped (turned, TURN_*). Within a turn, what its
# plan found for the phases after it (front_rules.turn): the sessions it visits and the wheel's slots due (nvisit,
# ndue), where the departures due end (depend), the sessions it admits (nadm), and the answers written at the
# moment (nans); after a step (front_rules.after_step), what the step found and what each phase leaves the next
# (the fields from step_start up to nready: fastpath's phases say which); the turns the loop took (took: whether
# it took the one at the start of the span, when the caller left it, STATE.turned on the way in). The front end's
# own counters (the next arrival, the admissions' sequence, the latest frame handed to the engine, the peak of
# blocks used, t_sat, whether the last step preempted, whether the engine waited since its last step) are in its
# books (front_rules.BOOK_FIELDS, Front.books), which the loop writes in place.
STATE = np.dtype([("now", np.float64), ("out_s", np.float64), ("nrun", np.int64), ("npf", np.int64),
                  ("nfirst", np.int64), ("nreadmit", np.int64), ("ndrop", np.int64), ("step0", np.int64),
                  ("nsteps", np.int64), ("nrows", np.int64), ("turned", np.int64), ("nvisit", np.int64),
                  ("ndue", np.int64), ("depend", np.int64), ("nadm", np.int64), ("nans", np.int64),
                  ("step_start", np.float64), ("step_s", np.float64), ("nvic", np.int64), ("ndone", np.int64),
                  ("tokens_out", np.int64), ("nready", np.int64), ("took", np.int64)], align=True)
# the front end's queues as the loop keeps them: its FCFS queue, the departures booked (in time order), the frames
# owed in lockstep (session, frame, tokens got), its books of them (front_rules.BOOKS, the front end's own record:
# one element, written in place), the session of each request slot and whether a frame was handed to
# it and not yet scheduled (the first-step term). A request the loop adds takes the engine's next slot, as
# EngineModel.add would give it: the front end's own `slot` and `sess_of_slot` name it, and nothing is left to
# translate after the span.
Front = namedtuple("Front", "queue dep_t dep_i pend books sess_of_slot fresh")
# what a span allocates: the wheel over the phase slots (slot k's sessions: wheel_who[wheel_start[k]:wheel_start[k +
# 1]], its next tick; the slots due at a turn), the sessions a turn visits, those with frames queued, the running
# ones (lockstep), the sessions whose first frame a turn hands over; the moment's answers (tick key, session,
# tokens got), room for their ticks and to sort them in (recorder.flush); scratch and victims for the reaction to a
# step (sim/reaction.py)
Span = namedtuple("Span", "wheel_start wheel_who tick due visit ready run_sess firsts key who tok at work scr vic")
# the step jitter: each step's ratio (independent), or each step's own score and the shared and frame-only parts of
# the frames from CONF.f_lo on, with the table of the ratio's distribution (correlated)
Draws = namedtuple("Draws", "jit jz ja jb jp jr")

# CONF.ctl: no controller; one deciding in Python (the caller hands it the frame rows after the call, with each
# row's in-flight count, Rows.in_flight); a compiled one (control_kernel), which this loop runs at each arrival and each
# frame row, as SimEngine does
CTL_NONE, CTL_AFTER, CTL_COMPILED = 0, 1, 2
NO_JITTER, INDEPENDENT, CORRELATED = 0, 1, 2
# STATE.turned: 0 the caller takes the turn at `now`; 1 the turn there is taken, the step is the caller's; 2 a step
# (or a wait) starts at `now` and ends at out_s, at or past the horizon, where SimPy stops the run (the step-by-step
# path never gets to its records either); 3 the turn at `now` is taken and the loop paused there (t_pause): called
# again, it goes on from that very point; 4 a step started at `now` and took out_s seconds (EngineModel.last_step
# says what it did), and what follows it is the caller's: the front end reacts to a preemption, a request left
# waiting or a step that scheduled nothing, as the loop does not
TURN_CALLER, TURN_TAKEN, PAST_HORIZON, PAUSED, STEP_TAKEN = range(5)

# A small rule called from several places in the loop, or at every frame, is spliced into each caller by numba
# (inline="always": its body joins the caller's before either is compiled). A call hands the callee every array of
# the records it takes, and LLVM does not inline a small function into a caller as large as the loop: each
# frame then paid a call for its tick.
spliced = nb.njit(cache=True, inline="always", no_cpython_wrapper=True, no_cfunc_wrapper=True)


# The loop's parts are called from compiled code only: numba's wrapper for a call from Python (which unboxes every
# array of every record a part takes) is left out, as is its C callback.
_bare = dict(no_cpython_wrapper=True, no_cfunc_wrapper=True)
njit = nb.njit(cache=True, **_bare)
inlined = nb.njit(cache=True, _nrt=False, forceinline=True, **_bare)
uncounted = nb.njit(cache=True, _nrt=False, forceinline=False, **_bare)
counted = nb.njit(cache=True, _nrt=True, forceinline=False, **_bare)


_on_run_clock = nb.njit(cache=True, inline="always")(front_end.on_run_clock)  # (the front end's rule, compiled in)

# The wheel's last slot: the sessions on a clock of their own (a period or a phase of their own:
# front_end.on_run_clock), whose ticks are no phase slot's. It ticks at the earliest of its sessions' next ticks.
OWN = PHASE_SLOTS
SLOTS = PHASE_SLOTS + 1


@spliced
def wheel_slot(i, ss, c):
    """Session ``i``'s slot of the wheel: its phase slot on the run's clock (front_end.on_run_clock), else OWN."""
    k = ss.pslot[i]
    return k if _on_run_clock(ss.P_of[i], ss.phase[i], k, c.P) else OWN


@counted  # (it allocates)
def wheel(live, ss, c):
    """The sessions by slot of the wheel (slot k's: ``who[start[k]:start[k + 1]]``, :func:`wheel_slot`) and each
    slot's next tick: the live ones, and those yet to arrive in the span (they tick once they arrive,
    :func:`metronome.sim.fastpath._arrive`).

    A turn takes every frame that came due, so every live session of a phase slot is before the same next frame;
    the turn then visits only the slots that came due, not every live session. ``ok`` is False when a phase slot's
    sessions are not on one frame (the caller then steps one at a time)."""
    state, next_frame, phase, P_of = ss.state, ss.next_frame, ss.phase, ss.P_of
    slot = np.empty(live.size, np.int64)
    start = np.zeros(SLOTS + 1, np.int64)
    for j in range(live.size):
        slot[j] = wheel_slot(live[j], ss, c)
        start[slot[j] + 1] += 1
    for k in range(SLOTS):
        start[k + 1] += start[k]
    fill = start[:SLOTS].copy()
    who = np.empty(live.size, np.int64)
    frame = np.full(SLOTS, -1, np.int64)
    tick = np.full(SLOTS, np.inf)
    ok = True
    for j in range(live.size):
        i = live[j]
        k = slot[j]
        who[fill[k]] = i
        fill[k] += 1
        if not _live(state[i]):
            continue
        if k == OWN:
            tick[k] = min(tick[k], _tick(next_frame[i], P_of[i], phase[i]))
        elif frame[k] < 0:
            frame[k] = next_frame[i]
            tick[k] = _tick(next_frame[i], P_of[i], phase[i])
        elif frame[k] != next_frame[i]:
            ok = False
    return start, who, tick, ok


@inlined
def due_sessions(now, eps, w, n_ready, state):
    """The sessions a turn at ``now`` visits (into ``w.visit``): those of the slots that came due (into ``w.due``),
    then those whose frame was answered in the last step with frames still queued (``w.ready``); not those that
    departed. Returns how many (a session may appear twice) and how many slots came due."""
    n = 0
    n_due = 0
    for k in range(SLOTS):
        if w.tick[k] <= now + eps:
            w.due[n_due] = k
            n_due += 1
            for q in range(w.wheel_start[k], w.wheel_start[k + 1]):
                if _live(state[w.wheel_who[q]]):
                    w.visit[n] = w.wheel_who[q]
                    n += 1
    for q in range(n_ready):
        if _live(state[w.ready[q]]):
            w.visit[n] = w.ready[q]
            n += 1
    return n, n_due


@spliced
def slot_tick(k, w, ss):
    """Slot ``k``'s next tick: its live sessions' (a phase slot's are all on one frame; OWN's, the earliest), or
    never when all of them departed."""
    t = np.inf
    for q in range(w.wheel_start[k], w.wheel_start[k + 1]):
        i = w.wheel_who[q]
        if _live(ss.state[i]):
            t = min(t, _tick(ss.next_frame[i], ss.P_of[i], ss.phase[i]))
            if k != OWN:
                break
    return t


@counted  # (it allocates)
def queued_behind(live, ss):
    """Running sessions with frames queued and none in the engine (a step-by-step turn leaves none)."""
    ready = np.empty(live.size, np.int64)
    n = 0
    for j in range(live.size):
        i = live[j]
        if ss.inflight[i] < 0 and ss.backlog[i] > 0 and ss.state[i] == RUNNING:
            ready[n] = i
            n += 1
    return ready, n


@counted  # (it allocates)
def allocate(live, ss, c, n_answers, n_slots):
    """What a span keeps besides the caller's arrays (:class:`Span`): the wheel over the phase slots, the sessions
    a turn visits, those with frames queued, the running ones (lockstep), room for a step's ``n_answers`` answers
    and, for the front end's reaction to a step (the loop's victims), room for its victims and scratch over the
    ``n_slots`` slots. Returns (it, whether the wheel holds, the sessions with frames queued)."""
    start, who, tick, ok = wheel(live, ss, c)
    ready, n_ready = queued_behind(live, ss)
    run_sess = live if c.lockstep else live[:0]
    span = Span(start, who, tick, np.empty(SLOTS, np.int64), np.empty(2 * live.size, np.int64), ready,
                run_sess, np.empty(2 * live.size, np.int64), np.empty(n_answers, np.int64),
                np.empty(n_answers, np.int64), np.empty(n_answers, np.int64), np.empty(n_answers),
                key_order_work(n_answers),
                np.zeros((6, n_slots), np.int64), np.empty(live.size, np.int64))
    return span, ok, n_ready


# what the span's parts compile in from other modules (the front end's clock rule and rules, serving's sort buffer)
SPAN_PARTS = (front_end, front_rules, serving)
SPAN_FORM = compiled.guard(allocate, SPAN_PARTS)
