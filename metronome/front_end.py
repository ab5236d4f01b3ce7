"""The serving front end: a session's life on the serving side, on counts, over an engine in slots.

The rules of a session's life between its client and the engine are written here once, on arrays over sessions
(one entry per session, in arrival order): the frame clock, the admission gate and its queue, the front end's
FCFS queue for blocks, the first frame and its prompt, silence, the rebase at ``max_model_len``, the deadlock
rule after each step and the frames owed. Who runs in a step, what a session needs to be admitted, who is
preempted and where it goes are asked of :mod:`metronome.serving`, which
``tests/live/test_scheduler_differential.py`` checks step by step against vLLM's own scheduler.

Core: no clock and no engine of its own. The caller keeps the time (it calls :meth:`FrontEnd._turn` at each event
and :meth:`FrontEnd._after_step` after each step) and passes the engine, anything with
:class:`metronome.serving.EngineModel`'s interface in slots (the engine model itself, or vLLM's own scheduler in
the differential test). The records are the caller's (:meth:`FrontEnd._flush_answers`,
:meth:`FrontEnd._record_step`): the simulator (:class:`metronome.sim.engine.SimEngine`) keeps one row per tick.

A frame's life:

1. **The frame clock.** Frame ``f`` of session ``i`` ticks at ``f·P + φ_i`` (``serving.frame_tick``; ``P`` =
   the stream's frame period). Under ``aligned`` phases every ``φ_i`` is 0 and the engine serves the sessions
   in lockstep; under ``independent`` phases each has its own (``workload.draw_phases``) and the engine steps
   back to back while any request has work, each step batching the frames that arrived before it. A session
   that arrives at ``t`` streams from frame ``serving.join_frame(t, P, φ_i)``.
2. **The front end.** An arrival passes the admission gate (controller, queue, timeout), then waits in the
   front end's FCFS queue until the engine has the blocks vLLM's admission gate wants
   (``serving.admission_need_blocks``), never in the turn right after a step that preempted. At its tick a
   running session appends its frame (the token sampled last, the input of any silent frames, the frame's
   input) to its request, or is rebased/finished when the frame would reach ``max_model_len``.
3. **After a step.** Sampled tokens go to their frames; a frame with all its tokens is answered. Requests the
   engine preempted, and the victims of the deadlock rule (``serving.deadlock_pick``), lose their place: their
   request is aborted and they go back to the head of the front end's queue, to be readmitted as a new request
   whose prompt is their whole history.
4. **Silence.** A waiting or re-prefilling session's frame is answered empty, on time; its input joins the
   history. In lockstep it is answered when every running session's frame of its tick is done; with
   independent phases the front end answers it at once (``front_rules.owe``).
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from metronome import front_rules as rules
from metronome import serving
from metronome.front_rules import (ENDED, NOT_ARRIVED, PREFILL, QUEUED, REFUSED, RUNNING,  # noqa: F401 (the
                                   WAITING, Queues, Tally)  # session states: declared there, with the rules)
from metronome.kv_policy import KVPolicy
from metronome.serving import EndReason, EngineLimits

_EPS = 1e-12


# The per-session arrays a compiled loop runs the front end on (metronome.sim.fastpath), by the names of
# FrontEnd's attributes: one record, so a loop reads a field by its name (FrontEnd.session_arrays).
Sessions = namedtuple("Sessions", "state phase pslot slot next_frame backlog inflight inflight_tok hist last_tok "
                                  "pending_in work_step running_since started admitted admit_seq s_tokens s_frames "
                                  "s_silent s_late s_preempt s_ended s_admitted arrival duration prompt_of n_in_of "
                                  "n_out_of P_of deadline_of")


class BookCounter:
    """One of a front end's counters, kept in its books (:data:`metronome.front_rules.BOOKS`) rather than as an
    attribute, so that the simulator's compiled loop, handed the books, writes it in place: read as ``kind`` of the
    field, set as is (None: NaN, a float field's "none yet")."""

    def __init__(self, field: str, kind, doc: str):
        self.field, self.kind, self.__doc__ = field, kind, doc

    def __get__(self, fe, owner=None):
        return self if fe is None else self.kind(fe._b[self.field])

    def __set__(self, fe, value) -> None:
        fe._b[self.field] = math.nan if value is None else value


def on_run_clock(period_s, phase_s, slot, run_period_s):
    """Whether a session (or each, given arrays) ticks on the run's clock: the run's period, and the phase of its
    phase slot (``serving.phase_offset_s``), so that its ticks are the run's tick keys (``serving.tick_key``) and
    it ticks with the other sessions of its slot. A session with a period of its own (a roster's, or
    :meth:`FrontEnd.reshape`'s) ticks on a clock of its own. The compiled loop's wheel asks it too
    (``sim.span.wheel_slot``)."""
    return (period_s == run_period_s) & (phase_s == serving.phase_offset_s(slot, run_period_s))


def tokens_within(tokens, most: int) -> bool:
    """Whether a session may stream ``tokens`` (input or output, a number or an array) a frame of a stream of
    ``most``: 1 to the stream's own, the most the rebase's room is checked for (``serving.check_rebase_room``)."""
    t = np.asarray(tokens)
    return bool(((t >= 1) & (t <= most)).all())


@dataclass(frozen=True)
class Roster:
    """The sessions a front end is given up front (in any order; more may be offered later, :meth:`FrontEnd.offer`):
    when each arrives and how long it stays, its phase slot (None: all 0), its first frame's prompt, its input
    and output tokens per frame (None: the stream's; a session streams no more tokens a frame than the stream, the
    most the rebase's room is checked for) and its frame period and deadline in seconds (None: the stream's period
    and the run's deadline; independent phases only: its phase slot is then a slot of its own period)."""

    arrival_s: np.ndarray
    duration_s: np.ndarray
    phase_slot: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    input_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    period_s: np.ndarray | None = None
    deadline_s: np.ndarray | None = None


@dataclass(frozen=True)
class FrontEndOptions:
    """How a front end serves: ``phases`` (``serving.PHASES``); ``loop`` (``serving.LOOPS``: whose loop steps the
    engine, does the front end see starved and preempted sessions after each step?); ``cap`` and ``rebase_tokens``,
    what it does at the length limit (``serving.length_outcome``, ``serving.rebase_keep_tokens``)."""

    phases: str = "aligned"
    loop: str = "driver"
    cap: str | None = None
    rebase_tokens: int | None = None


@dataclass
class StepDone:
    """What follows a step, between the phases of :func:`metronome.front_rules.after_step`: when it started
    (``start``, seconds), how long it took (``lat``), the engine's record and the step's number; what the phases
    leave the next: blocks used after it, tokens out, sessions it preempted."""

    start: float
    lat: float
    rec: object
    step_no: int
    used: int = 0
    tokens_out: int = 0
    victims: int = 0


def compile_rules() -> None:
    """Compile the rules :class:`FrontEnd` calls from Python (:mod:`metronome.front_rules`) now, for the types it
    calls them with, as a front end with hooks (a live one) does: a live driver calls it before its clock starts, so
    that its first turns do not stop the frame clock while numba compiles (seconds each on an empty cache). Each is
    called on scratch arrays, with nothing to do."""
    shape = SimpleNamespace(prompt=1, P=1.0, deadline=1.0, n_in=1, n_out=1)
    arrays = FrontEnd._session_arrays(shape, 2)
    arrays.update(arrival=np.zeros(2), duration=np.zeros(2), pslot=np.zeros(2, np.int64), phase=np.zeros(2))
    ss = Sessions(*(arrays[name] for name in Sessions._fields))
    b = np.zeros(1, rules.BOOKS)[0]
    b["qhead"] = 4
    q = Queues(np.zeros(8, np.int64), np.zeros(8), np.zeros(8, np.int64), np.zeros((8, 3), np.int64))
    none = np.zeros(0, np.int64)
    a = Tally(ss.pslot, ss.s_frames, ss.s_silent, *(np.zeros(8, np.int64) for _ in range(3)))
    rules.enter(0, 0.0, ss, b, q)
    rules.request_tokens(0, ss)
    rules.admit_head(0.0, 0, ss, b, q.queue)
    rules.readmitted(0, 1, 0, ss)
    rules.ticks_due(none, 0.0, _EPS, False, ss, b, q.pend, a, 0, (none, none, np.zeros(0, bool)))
    rules.chunks_of(none, ss)
    rules.hand_over_each(none, none, none, 0, ss, np.zeros(1, bool))
    rules.hand_over(0, 0, 1, 0, ss, np.zeros(1, bool))
    rules.answer_silent(b, q.pend, none, (ss.state, ss.inflight, ss.backlog, ss.next_frame), a, 0)
    rules.tokens_in(none, 0.0, ss, none, a, 0, (none, none, none), None)
    rules.awaiting_engine(0, ss, np.zeros(2, np.int64))
    rules.lose_place(0, False, ss, b, q, a, 0)
    rules.leave_queue(0, b, q.queue)
    rules.end_owed(0, 0.0, (1.0, 0.0, 1.0, _EPS, False), (ss.state, ss.inflight, ss.inflight_tok, ss.next_frame,
                                                          ss.backlog), b, q.pend, a, 0, (none, none))
    rules.book_departure(0.0, 0, b, q.dep_t, q.dep_i)


class FrontEnd:
    # one entry per session, in arrival order (set by _init_sessions): the front end's state of each
    state: np.ndarray  # NOT_ARRIVED .. QUEUED
    slot: np.ndarray  # its engine request, by the slot the engine gave it (-1: none)
    hist: np.ndarray  # tokens of its history (what a readmission re-prefills)
    last_tok: np.ndarray  # a sampled token not yet in the engine (re-fed next frame)
    pending_in: np.ndarray  # input of silent frames, not yet in the engine
    started: np.ndarray  # its first frame (with the prompt) went to the engine
    prompt_of: np.ndarray  # the prompt its first frame carries
    rebase_next: np.ndarray  # its KV was lost with the engine: its readmission is a rebase
    next_frame: np.ndarray  # the next tick it has not yet seen
    P_of: np.ndarray  # its frame period (its frame f ticks at f·P_of + phase)
    n_in_of: np.ndarray  # input tokens per frame
    n_out_of: np.ndarray  # output tokens per frame
    deadline_of: np.ndarray  # its frames' deadline after their tick
    backlog: np.ndarray  # due frames not yet submitted (one frame in flight at a time)
    inflight: np.ndarray  # the frame in the engine (-1: none)
    inflight_tok: np.ndarray  # tokens that frame has got
    admit_seq: np.ndarray
    work_step: np.ndarray  # step count when its work was handed to the engine
    running_since: np.ndarray
    # ... and its results
    s_frames: np.ndarray
    s_silent: np.ndarray
    s_late: np.ndarray
    s_tokens: np.ndarray
    s_preempt: np.ndarray
    s_rebase: np.ndarray
    s_admitted: np.ndarray
    admitted: np.ndarray  # s_admitted is set (what the compiled loop reads, kept rather than derived per call)
    s_ended: np.ndarray
    s_end_reason: np.ndarray
    own_clocks: bool  # some session ticks on a clock of its own (on_run_clock)
    _ss: Sessions | None  # the per-session arrays as one record (session_arrays; None: made at its next call)
    # one entry per engine slot
    sess_of_slot: np.ndarray
    fresh_slot: np.ndarray  # a frame submitted and not yet scheduled (first-step term)

    def __init__(self, model, policy: KVPolicy, limits: EngineLimits, stream, roster: Roster, horizon_s: float,
                 deadline_s: float, controller=None, options: FrontEndOptions = FrontEndOptions(),
                 check_invariants: bool = False):
        """``model``: the engine in slots; ``stream``: the frame shape (:class:`metronome.calibration.TokenStream`);
        ``roster``: the sessions given up front; ``options``: how it serves them."""
        arrival_s, duration_s, phase_slot, prompt_tokens = (roster.arrival_s, roster.duration_s, roster.phase_slot,
                                                           roster.prompt_tokens)
        phases, loop, cap, rebase_tokens = options.phases, options.loop, options.cap, options.rebase_tokens
        self.model, self.policy, self.limits = model, policy, limits
        self.horizon = float(horizon_s)
        self.deadline = float(deadline_s)
        self.controller = controller
        self.gate = serving.AdmissionGate(controller)
        self.check_invariants = check_invariants
        self.P = stream.frame_period_s
        self.n_in, self.n_out = stream.input_tokens_per_frame, stream.output_tokens_per_frame
        self.tpf = stream.kv_tokens_per_frame
        self.prompt = max(stream.prompt_tokens, 1)  # vLLM rejects an empty chunk
        self.maxlen = limits.max_model_len
        self.num_blocks = limits.num_blocks
        self.cap_blocks = policy.admission_cap_blocks(limits.in_flight_tokens, self.maxlen)
        self.outcome = serving.length_outcome(policy, cap)
        self.keep_tokens = serving.rebase_keep_tokens(policy, self.maxlen, unbounded=rebase_tokens)
        if self.outcome == "rebase":  # (a reshaped session streams no more tokens a frame than this: serve's limits)
            serving.check_rebase_room(policy, self.keep_tokens, self.n_in, self.n_out, self.maxlen)

        order = np.argsort(arrival_s, kind="stable")
        self.arrival = np.asarray(arrival_s, dtype=np.float64)[order]
        self.duration = np.asarray(duration_s, dtype=np.float64)[order]
        M = len(self.arrival)
        # each session's phase (serving.PHASE_SLOTS per period): its frame f ticks at f·P + phase
        self.pslot = (np.zeros(M, dtype=np.int64) if phase_slot is None
                      else np.asarray(phase_slot, dtype=np.int64)[order])
        self.phase = serving.phase_offset_s(self.pslot, self.P)
        serving.check_phases(phases)
        self.sees_starvation = serving.sees_starvation(loop)
        self.lockstep = phases == "aligned"
        if self.lockstep and self.pslot.any():
            raise ValueError("aligned phases: every session's phase is 0")
        self._init_sessions(M)
        if prompt_tokens is not None:  # (vLLM rejects an empty chunk)
            self.prompt_of[:] = np.maximum(np.asarray(prompt_tokens, dtype=np.int64)[order], 1)
        for given, most, own in ((roster.input_tokens, self.n_in, self.n_in_of),
                                 (roster.output_tokens, self.n_out, self.n_out_of)):
            if given is not None:
                given = np.asarray(given, dtype=np.int64)
                if given.shape != (M,) or not tokens_within(given, most):
                    raise ValueError(f"a session's tokens per frame are 1 to the stream's {most}, one per session")
                own[:] = given[order]
        self.own_clocks = False  # whether a session ticks on a clock other than the run's (on_run_clock)
        if roster.period_s is not None or roster.deadline_s is not None:
            self._own_shapes(roster, order)
        self.offered = M  # sessions known: those given, and those offered since (offer)

        # its queues (the FCFS queue, the departures booked, the frames owed in lockstep) as arrays, their heads and
        # lengths and its counters in one record: what the rules over them (metronome.front_rules) take, here and in
        # the simulator's compiled loop, which writes it in place (next_arrival, seq, ... below read it)
        self.books = np.zeros(1, rules.BOOKS)
        self._b = self.books[0]  # (a view: the rules write through it; b["name"] reads it 7x faster than a recarray's)
        self._b["t_sat"] = math.nan
        self.queues = Queues(np.zeros(16, np.int64), np.zeros(16), np.zeros(16, np.int64), np.zeros((16, 3), np.int64))
        self.now = 0.0
        self.stalled = False  # the last step scheduled nothing and freed nothing: wait for an event
        # the frames answered at the current moment (tick key, session, tokens got): the first n_answers
        self.answers = tuple(np.zeros(64, np.int64) for _ in range(3))
        self.n_answers = 0
        self.done: StepDone | None = None  # the step being followed up (_after_step)

    # its counters, in its books (front_rules.BOOK_FIELDS): the simulator's loop writes them in place
    next_arrival = BookCounter("narr", int, "The next session to arrive (in order of arrival).")
    seq = BookCounter("seq", int, "Sessions admitted so far (the next admission's place in their order).")
    serving_frame = BookCounter("sframe", int, "The latest frame handed to the engine: the frame a step is taken "
                                               "on (the step's jitter draw).")
    peak_used = BookCounter("peak", int, "The most blocks held after a step.")
    t_sat = BookCounter("t_sat", lambda t: None if math.isnan(t) else float(t),
                        "The start of the first step after which a session had to be preempted, or None.")
    preempted_last = BookCounter("prelast", bool, "The last step preempted: nobody is admitted in the next turn.")

    # ----------------------------------------------------------------------------------- the caller's records
    def _flush_answers(self, now: float) -> tuple[int, int]:
        """Record the frames answered at ``now`` (the first :attr:`n_answers` of :attr:`answers`, then none) and feed
        the controller; returns (frames, silent)."""
        raise NotImplementedError

    def _record_step(self, start: float, lat: float, rec, used: int, tokens_out: int, preemptions: int) -> None:
        """Record the step that started at ``start`` and took ``lat`` (``rec``: the engine's record; ``used``:
        blocks held after it), after its answers (:meth:`_after_step`)."""
        raise NotImplementedError

    # What only a live front end records (no-ops here): metronome.probe.driver's rows of each frame and event.
    def _event(self, kind: str, i: int, t: float, **extra) -> None:
        """Session ``i``'s ``kind`` (preempt, lost, readmit, rebase, prefilled) at ``t``."""

    def _offered(self, i: int, decision: str) -> None:
        """Session ``i`` was offered to the admission gate, which said ``decision``."""

    def _submitted(self, idx, f, rebased: bool) -> None:
        """Frames ``f`` of sessions ``idx`` went to the engine now (``rebased``: the frame restarted its session)."""

    def _silenced(self, idx: np.ndarray, f: np.ndarray, state) -> None:
        """Frames ``f`` of sessions ``idx`` will be answered silent: ``state`` at their tick (None: the sessions'
        state now, a running one's tick before its place being a re-prefill's)."""

    def _tokens_in(self, pre: np.ndarray, inf: np.ndarray, frames: np.ndarray) -> None:
        """A step ended now: sessions ``pre`` finished their re-prefill, ``inf``'s frames ``frames`` got a token
        each (rules.tokens_in)."""

    def _censored(self, i: int, f: np.ndarray, tokens: np.ndarray) -> None:
        """Session ``i`` ended with frames ``f`` owed and not yet due (or the run ended): never answered."""

    HEARS_TICKS = False  # whether _ticked is called (a server takes each frame's input at its tick)

    def _ticked(self, idx: np.ndarray, f: np.ndarray) -> None:
        """Frames ``f`` of sessions ``idx`` came due, in each session's order of frames."""

    # ---------------------------------------------------------------------------- sessions and their requests
    def _session_arrays(self, M: int) -> dict[str, np.ndarray]:
        """Fresh per-session arrays (declared on the class) for ``M`` sessions, by name: what
        :meth:`_init_sessions` sets and :meth:`offer` grows (a subclass adds its own)."""
        d = {"state": np.zeros(M, dtype=np.int8), "prompt_of": np.full(M, self.prompt, dtype=np.int64),
             "running_since": np.zeros(M), "s_admitted": np.full(M, np.nan), "s_ended": np.full(M, np.nan),
             "s_end_reason": np.full(M, "", dtype=object)}
        d.update({k: np.full(M, -1, dtype=np.int64) for k in ("slot", "inflight", "admit_seq")})
        d.update({k: np.zeros(M, dtype=np.int64) for k in (
            "hist", "pending_in", "next_frame", "backlog", "inflight_tok", "work_step",
            "s_frames", "s_silent", "s_late", "s_tokens", "s_preempt", "s_rebase")})
        d.update({k: np.zeros(M, dtype=bool) for k in ("last_tok", "started", "rebase_next", "admitted")})
        # each session's stream shape: the run's, until :meth:`reshape` gives a session its own
        d.update(P_of=np.full(M, float(self.P)), deadline_of=np.full(M, self.deadline),
                 n_in_of=np.full(M, self.n_in, dtype=np.int64), n_out_of=np.full(M, self.n_out, dtype=np.int64))
        return d

    def session_arrays(self) -> Sessions:
        """The per-session arrays as one record (the arrays themselves, not copies; made again when they grow)."""
        if self._ss is None:
            self._ss = Sessions(*(getattr(self, name) for name in Sessions._fields))
        return self._ss

    def _init_sessions(self, M: int) -> None:
        """The per-session arrays for ``M`` sessions, and the per-slot ones."""
        for name, a in self._session_arrays(M).items():
            setattr(self, name, a)
        self._ss = None  # (session_arrays)
        self.sess_of_slot = np.full(64, -1, dtype=np.int64)
        self.fresh_slot = np.zeros(64, dtype=bool)

    def offer(self, t: float, duration_s: float = math.inf, phase_slot: int = 0) -> int:
        """A session that arrives unannounced at ``t`` (not before the last one offered), as a server's clients do:
        the gate decides on it at the next turn. Returns its index."""
        i = self.offered
        if i and t < self.arrival[i - 1]:
            raise ValueError(f"a session offered at {t} s, before the last one ({self.arrival[i - 1]} s)")
        if self.lockstep and phase_slot:
            raise ValueError("aligned phases: every session's phase is 0")
        if i == self.arrival.size:
            self._grow(max(16, 2 * i))
        self.arrival[i], self.duration[i], self.pslot[i] = t, duration_s, phase_slot
        self.phase[i] = serving.phase_offset_s(phase_slot, self.P)
        self.offered += 1
        return i

    def reshape(self, i: int, period_s: float, input_tokens: int, output_tokens: int, deadline_s: float) -> bool:
        """Session ``i`` streams its own shape (a server's client asked for it) from its next frame on. It changes
        only at a frame boundary where nothing of the session is owed (no frame in the engine's hands or queued for
        it, no silent frame's input pending), so every frame is served under one shape from tick to answer; the
        clock goes on from the tick already due next (its frame numbers run on, each later tick one new period
        after the last). Returns whether it changed now; if not, ask again at a later turn. A session at the
        gate's queue has no clock yet: it takes the shape at once."""
        if self.lockstep:
            raise ValueError("aligned phases: every session streams the run's shape")
        if not (period_s > 0 and deadline_s > 0 and input_tokens >= 1 and output_tokens >= 1):
            raise ValueError(f"a stream shape is positive: period {period_s} s, deadline {deadline_s} s, "
                             f"{input_tokens} in, {output_tokens} out")
        st = self.state[i]
        if st in (ENDED, REFUSED):
            return False
        clocked = WAITING <= st <= RUNNING
        if clocked and (self.inflight[i] >= 0 or self.backlog[i] or self.pending_in[i]):
            return False
        if clocked:  # the tick due next stays where it is
            t_next = serving.frame_tick(self.next_frame[i], self.P_of[i], self.phase[i])
            self.phase[i] = t_next - self.next_frame[i] * period_s
        else:
            self.phase[i] = serving.phase_offset_s(self.pslot[i], period_s)
        self.P_of[i], self.deadline_of[i] = period_s, deadline_s
        self.n_in_of[i], self.n_out_of[i] = input_tokens, output_tokens
        self.own_clocks = self.own_clocks or not on_run_clock(period_s, self.phase[i], self.pslot[i], self.P)
        return True

    def _own_shapes(self, roster: Roster, order: np.ndarray) -> None:
        """Each session's own frame period and deadline, as the roster gives them (in arrival ``order``)."""
        M = order.size
        for given, own in ((roster.period_s, self.P_of), (roster.deadline_s, self.deadline_of)):
            if given is not None:
                given = np.asarray(given, dtype=np.float64)
                if given.shape != (M,) or not (np.isfinite(given) & (given > 0)).all():
                    raise ValueError("a session's period and deadline are positive seconds, one per session")
                own[:] = given[order]
        if self.lockstep and (self.P_of != self.P).any():
            raise ValueError("aligned phases: every session streams the run's period")
        self.phase = serving.phase_offset_s(self.pslot, self.P_of)
        self.own_clocks = not on_run_clock(self.P_of, self.phase, self.pslot, self.P).all()

    def _grow(self, M: int) -> None:
        """Room for ``M`` sessions; the room not yet offered arrives never (at infinity)."""
        extra = M - self.arrival.size
        for name, a in self._session_arrays(extra).items():
            setattr(self, name, np.concatenate([getattr(self, name), a]))
        self.arrival = np.concatenate([self.arrival, np.full(extra, np.inf)])
        self.duration = np.concatenate([self.duration, np.full(extra, np.inf)])
        self.pslot = np.concatenate([self.pslot, np.zeros(extra, dtype=np.int64)])
        self.phase = np.concatenate([self.phase, np.zeros(extra)])
        self._ss = None  # (session_arrays)

    # --------------------------------------------------------------------------------------------- its queues
    @property
    def waiting(self) -> np.ndarray:
        """The front end's FCFS queue, head first (a view)."""
        b = self._b
        return self.queues.queue[b["qhead"]:b["qhead"] + b["nwait"]]

    @property
    def silent_pending(self) -> np.ndarray:
        """The frames owed in lockstep, one row (session, frame, tokens got) each, in the order owed (a view)."""
        b = self._b
        return self.queues.pend[b["phead"]:b["npend"]]

    def room(self, ahead: int = 0, behind: int = 0, departures: int = 0, owed: int = 0) -> None:
        """Room in the queues, before a caller adds to them: ``ahead`` sessions before the FCFS queue's head (a
        preemption puts one there), ``behind`` after its tail, ``departures`` more booked and ``owed`` more frames
        owed in lockstep. Each grows to twice what it needs when short (the caller then writes at no cost), and the
        departures taken and frames answered are dropped from the front."""
        b, q = self._b, self.queues
        queue, dep_t, dep_i, pend = q
        h, n = int(b["qhead"]), int(b["nwait"])
        if h < ahead or h + n + behind > queue.size:
            size = max(queue.size, 2 * (ahead + n + behind) + 16)
            head = ahead + (size - ahead - n - behind) // 2  # (room on both sides for what comes next)
            queue = np.zeros(size, np.int64)
            queue[head:head + n] = q.queue[h:h + n]
            b["qhead"] = head
        if b["ndeps"] + departures > dep_t.size:
            d, nd = int(b["dep"]), int(b["ndeps"])
            size = max(dep_t.size, 2 * (nd - d + departures) + 16)
            dep_t, dep_i = np.zeros(size), np.zeros(size, np.int64)
            dep_t[:nd - d], dep_i[:nd - d] = q.dep_t[d:nd], q.dep_i[d:nd]
            b["dep"], b["ndeps"] = 0, nd - d
        if b["npend"] + owed > pend.shape[0]:
            p0, n_pend = int(b["phead"]), int(b["npend"])
            size = max(pend.shape[0], 2 * (n_pend - p0 + owed) + 16)
            pend = np.zeros((size, 3), np.int64)
            pend[:n_pend - p0] = q.pend[p0:n_pend]
            b["phead"], b["psorted"], b["npend"] = 0, b["psorted"] - p0, n_pend - p0
        self.queues = Queues(queue, dep_t, dep_i, pend)

    def _answer_room(self, n: int) -> Tally:
        """Room for ``n`` more answers at the current moment; returns where they go (:class:`Tally`)."""
        key, who, tok = self.answers
        if self.n_answers + n > key.size:
            size = 2 * (self.n_answers + n) + 64
            self.answers = tuple(np.concatenate([x[:self.n_answers], np.zeros(size - self.n_answers, np.int64)])
                                 for x in self.answers)
            key, who, tok = self.answers
        return Tally(self.pslot, self.s_frames, self.s_silent, key, who, tok)

    def _owing_room(self, n: int) -> Tally:
        """Room for ``n`` more frames owed (rules.owe: rows waiting for their tick in lockstep, else answers now);
        returns where answers go."""
        if self.lockstep:
            self.room(owed=n)
        return self._answer_room(0 if self.lockstep else n)

    def _book_departure(self, t: float, i: int) -> None:
        """Session ``i`` departs at ``t`` (rules.book_departure)."""
        self.room(departures=1)
        q = self.queues
        rules.book_departure(float(t), int(i), self._b, q.dep_t, q.dep_i)

    def _in_flight(self) -> int:
        """Sessions the front end has let in (waiting for blocks, prefilling or running)."""
        return int(((self.state >= WAITING) & (self.state <= RUNNING)).sum())

    def _next_event_time(self, departures: bool = True, arrivals: bool = True) -> float:
        t = self.horizon
        if self.next_arrival < len(self.arrival) and arrivals:
            t = min(t, self.arrival[self.next_arrival])
        b = self._b
        if b["dep"] < b["ndeps"] and departures:
            t = min(t, float(self.queues.dep_t[b["dep"]]))
        if self.gate.queue:
            t = min(t, self.now + self.gate.poll_s)
        return t

    def _add(self, i: int, prompt_tokens: int, max_tokens: int, origin: serving.Origin) -> int:
        """A new engine request for session ``i``: its whole prompt, ``max_tokens`` to sample; ``origin`` says what
        it is (an engine of token ids builds them from it)."""
        slot = self.model.add(prompt_tokens, max_tokens, origin=origin)
        self._fit_slots(slot + 1)
        self.slot[i] = slot
        self.sess_of_slot[slot] = i
        return slot

    def _fit_slots(self, n: int) -> None:
        """The per-slot arrays at least ``n`` long (the engine model's grow as requests are added)."""
        if self.sess_of_slot.size < n:
            grow = max(n, 2 * self.sess_of_slot.size) - self.sess_of_slot.size  # (doubling: adds one at a time)
            self.sess_of_slot = np.concatenate([self.sess_of_slot, np.full(grow, -1)])
            self.fresh_slot = np.concatenate([self.fresh_slot, np.zeros(grow, dtype=bool)])

    def _drop_request(self, i: int) -> None:
        """Session ``i``'s request aborted, if it has one the engine still holds (a dead engine holds none)."""
        s = int(self.slot[i])
        if s >= 0:
            if self.model.status(s) is not None:
                self.model.abort(s)
            self.fresh_slot[s] = False
            self.slot[i] = -1

    # ----------------------------------------------------------------------------------------------- the turn
    def _steps_now(self) -> bool:
        """Whether the engine is stepped now: it has work, and its last step did not stall on it (scheduled nothing
        and freed nothing: stepping again would spin until an event changes something)."""
        return self.model.has_work() and not self.stalled

    def _idle_until(self) -> float:
        """No step now: the front end waits for its next event (a tick, an arrival, a departure, the gate's poll,
        the horizon), and the turn at it is not "right after" a step, so it may admit. Returns when that is."""
        self.preempted_last = False
        return self._next_due()

    def _next_due(self) -> float:
        """When the front end next has something to do: a tick, an arrival, a departure, the gate's poll, the
        horizon."""
        return min(self._next_tick(), self._next_event_time())

    def _next_tick(self) -> float:
        live = (self.state >= WAITING) & (self.state <= RUNNING)
        if not live.any():
            return math.inf
        return float(serving.frame_tick(self.next_frame[live], self.P_of[live], self.phase[live]).min())

    def _turn(self, now: float) -> None:
        """The front end's turn at ``now`` (the driver's, the server's, the simulator's step by step): these
        methods, in the order of :func:`metronome.front_rules.turn`, which the simulator's compiled loop runs on its
        own phases."""
        t = type(self)
        rules.turn.py_func(self, now, t._arrivals, t._takes_turn, t._departures, t._admit, t._ticks, t._answer_silent,
                           t._flush_answers)

    def _takes_turn(self, now: float) -> bool:
        """Whether this front end takes the rest of the turn at ``now`` after its arrivals: always (the compiled
        loop hands back a turn it would take differently)."""
        return True

    def _arrivals(self, now: float) -> None:
        """The arrivals up to ``now`` offered to the gate, then the gate's queue retried."""
        while self.next_arrival < len(self.arrival) and self.arrival[self.next_arrival] <= now:
            i = self.next_arrival
            self.next_arrival += 1
            if self.arrival[i] >= self.horizon:
                continue
            decision = self.gate.offer(i, self.arrival[i], now, self._in_flight())
            self._offered(i, decision)
            if decision == "admit":
                self._enter(i, float(self.arrival[i]))
            elif decision == "queue":
                self.state[i] = QUEUED
            else:
                self._refuse(i, now, EndReason.REFUSED)
        if self.gate.queue:
            admitted, timed_out = self.gate.retry(now, self._in_flight)
            for i in timed_out:
                self._refuse(i, now, EndReason.QUEUE_TIMEOUT)
            for i in admitted:
                self._enter(i, now)

    def _departures(self, now: float) -> None:
        """The departures due by ``now``, in the order booked."""
        b = self._b
        while b["dep"] < b["ndeps"] and self.queues.dep_t[b["dep"]] <= now:
            i = int(self.queues.dep_i[b["dep"]])
            if WAITING <= self.state[i] <= RUNNING:  # (taken off only once ended: a dying engine may interrupt)
                self._end(i, now, EndReason.DEPARTED)
            b["dep"] += 1

    def _refuse(self, i: int, now: float, reason: str) -> None:
        self.state[i] = REFUSED
        self.s_end_reason[i], self.s_ended[i] = reason, now

    def _enter(self, i: int, t_enter: float) -> None:
        """Past the gate (at its arrival, or when the gate's queue let it in): the session waits in the front
        end's queue, streams from the first tick at or after ``t_enter`` and leaves ``duration`` after it."""
        self.room(behind=1, departures=1)
        rules.enter(i, float(t_enter), self.session_arrays(), self._b, self.queues)

    def _request_tokens(self, i: int) -> int:
        """Tokens the session's request will carry when (re)admitted (rules.request_tokens), or what a rebase keeps
        of its history when its KV was lost with the engine."""
        n = int(rules.request_tokens(i, self.session_arrays()))
        return min(n, self.keep_tokens) if self.started[i] and self.rebase_next[i] else n

    def _admission_need(self, i: int) -> int:
        return serving.admission_need_blocks(self.policy, self._request_tokens(i), self.cap_blocks)

    def _admit(self, now: float) -> None:
        if self.preempted_last:
            return
        n = serving.admit_fcfs(self.waiting, self._admission_need, self.model.free_blocks())
        for _ in range(n):
            i, new = rules.admit_head(now, self.seq, self.session_arrays(), self._b, self.queues.queue)
            self.seq += 1
            if new:  # its first frame (prompt + input) is its prefill, submitted at its tick
                self.rebase_next[i] = False  # (nothing was lost: it never reached an engine)
                continue
            self._readmit(i, now)

    def _readmit(self, i: int, now: float) -> None:
        """A session that lost its place comes back as a new request whose prompt is its whole history, or what a
        rebase keeps of it (its KV lost with the engine, or the history past the length limit). Nothing changes
        before the engine took the request (an engine that dies meanwhile finds the session as it was)."""
        history = int(self.hist[i])
        prompt = history + int(self.pending_in[i])
        origin = serving.Origin(i, "readmit", history, prompt)
        rebases = 0
        if self.rebase_next[i]:
            prompt = min(prompt, self.keep_tokens)
            rebases += 1
            self._event("rebase", i, now, prompt_tokens=prompt, kept_tokens=prompt, reason="engine_restart")
        if not serving.frame_fits(prompt + self.tpf, self.maxlen):
            if self.outcome == "finish":
                self.hist[i], self.pending_in[i], self.rebase_next[i] = prompt, 0, False
                self.s_rebase[i] += rebases
                self._end(i, now, EndReason.LENGTH)
                return
            prompt = min(prompt, self.keep_tokens)
            rebases += 1
            self._event("rebase", i, now, prompt_tokens=prompt, kept_tokens=prompt, reason="max_model_len")
        self._add(i, prompt, 1, origin)  # its one sampled token starts the next chunk
        rules.readmitted(i, prompt, self.model.steps, self.session_arrays())
        self.rebase_next[i] = False
        self.s_rebase[i] += rebases
        self._event("readmit", i, now, prompt_tokens=prompt)

    def _ticks(self, now: float) -> None:
        """Frames that came due: running sessions queue them (and submit one); the others hear silence."""
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        self._tick_due(now, live)
        submit = live[(self.state[live] == RUNNING) & (self.inflight[live] < 0) & (self.backlog[live] > 0)]
        if submit.size:
            self._submit_many(submit, now)

    def _tick_due(self, now: float, live: np.ndarray) -> None:
        """The frames of sessions ``live`` that came due by ``now`` (rules.tick_due), told to the hooks."""
        due = live[serving.frame_tick(self.next_frame[live], self.P_of[live], self.phase[live]) <= now + _EPS]
        if not due.size:
            return
        # at most this many came due (the division's rounding aside: +1)
        most = int((np.floor((now + _EPS - self.phase[due]) / self.P_of[due]) - self.next_frame[due] + 2).sum())
        a = self._owing_room(most)
        # (the frames heard, for a front end whose hooks read them; the simulator's do not)
        hears = self.HEARS_TICKS or type(self)._silenced is not FrontEnd._silenced
        heard = tuple(np.empty(most, t) for t in (np.int64, np.int64, np.bool_)) if hears else None
        self.n_answers, n = rules.ticks_due(due, now, _EPS, self.lockstep, self.session_arrays(), self._b,
                                            self.queues.pend, a, self.n_answers, heard)
        if heard is None:
            return
        who, f, quiet = (x[:n] for x in heard)
        if self.HEARS_TICKS:
            self._ticked(who, f)
        if quiet.any():
            self._silenced(who[quiet], f[quiet], None)

    def _submit_many(self, idx: np.ndarray, now: float) -> None:
        """Hand each session's oldest due frame to the engine. Sessions paused in the engine whose frame fits
        go at once (one append each, as arrays); the others (a first frame, a rebase, the length limit) one by
        one, in session order, as the driver does."""
        ss = self.session_arrays()
        chunk = rules.chunks_of(idx, ss)
        simple = (self.started[idx] & (self.slot[idx] >= 0)
                  & serving.frame_fits(self.hist[idx] + chunk + self.n_out_of[idx], self.maxlen))
        fast, slow = idx[simple], idx[~simple]
        if fast.size:
            sl = self.slot[fast]
            self.model.append_many(sl, chunk[simple], self.n_out_of[fast])
            f = rules.hand_over_each(fast, sl, chunk[simple], self.model.steps, ss, self.fresh_slot)
            self.serving_frame = max(self.serving_frame, int(f))
            self.stalled = False
            self._submitted(fast, self.inflight[fast], False)
        for i, c in zip(slow.tolist(), chunk[~simple].tolist()):
            self._submit(i, now, c)

    def _submit(self, i: int, now: float, chunk: int) -> None:
        """Hand the oldest due frame, of ``chunk`` tokens (rules.chunk_of), to the engine (rebased or finished at the
        length limit)."""
        ss = self.session_arrays()
        f = int(self.next_frame[i] - self.backlog[i])
        n_out = int(self.n_out_of[i])
        rebased = not serving.frame_fits(int(self.hist[i]) + chunk + n_out, self.maxlen)
        # (the engine takes the request before anything changes here: an engine that dies meanwhile finds the
        # session as it was)
        if rebased:
            if self.outcome == "finish":
                self._end(i, now, EndReason.LENGTH)
                return
            origin = serving.Origin(i, "rebase", int(self.hist[i]), chunk)
            kept, chunk = serving.rebase_counts(int(self.hist[i]), chunk, n_out, self.keep_tokens, self.maxlen)
            self._drop_request(i)
            sl = self._add(i, kept + chunk, n_out, origin)
            self.hist[i] = kept
            self.s_rebase[i] += 1
            self._event("rebase", i, now, prompt_tokens=kept + chunk, kept_tokens=kept)
        elif self.slot[i] < 0:
            sl = self._add(i, int(self.hist[i]) + chunk, n_out, serving.Origin(i, "first", 0, chunk))
        else:
            sl = int(self.slot[i])
            self.model.append(sl, chunk, n_out)
        rules.hand_over(i, sl, chunk, self.model.steps, ss, self.fresh_slot)
        self.serving_frame = max(self.serving_frame, f)
        self.stalled = False
        self._submitted((i,), (f,), rebased)

    def _end(self, i: int, now: float, reason: str) -> None:
        self._drop_request(i)
        self.model.session_ended(i)
        self.stalled = False
        if self.state[i] == WAITING:  # (not there if it ended while being admitted)
            rules.leave_queue(i, self._b, self.queues.queue)
        # frames still owed: answered (silent or short) once their deadline has passed, else never (censored); an
        # overloaded session ends with hundreds of frames queued, answered in one call
        most = int(self._b["npend"] - self._b["phead"] + self.backlog[i] + 1)
        a = self._answer_room(most)
        censored = np.empty(most, np.int64), np.empty(most, np.int64)
        clock = (float(self.P_of[i]), float(self.phase[i]), float(self.deadline_of[i]), _EPS,
                 reason in serving.RUN_OVER)  # (the run's last frames are left out, as finalize leaves them)
        self.n_answers, n_cens = rules.end_owed(
            i, now, clock, (self.state, self.inflight, self.inflight_tok, self.next_frame, self.backlog), self._b,
            self.queues.pend, a, self.n_answers, censored)
        if n_cens:
            self._censored(i, censored[0][:n_cens], censored[1][:n_cens])
        self.s_ended[i], self.s_end_reason[i] = now, reason

    # ------------------------------------------------------------------------------------------------ answers
    def buffered_answers(self) -> int:
        """Frames answered at the current moment and not yet recorded."""
        return self.n_answers

    def _answer_silent(self, now: float) -> None:
        """Lockstep: silent frames are answered once every running session's frame of their tick is done
        (rules.answer_silent)."""
        b = self._b
        if b["npend"] == b["phead"]:
            return
        a = self._answer_room(int(b["npend"] - b["phead"]))
        self.n_answers = rules.answer_silent(b, self.queues.pend, np.flatnonzero(self.state == RUNNING),
                                             (self.state, self.inflight, self.backlog, self.next_frame), a,
                                             self.n_answers)

    # ------------------------------------------------------------------------------------------- after a step
    def _after_step(self, start: float, lat: float, rec) -> None:
        """The step that started at ``start`` and took ``lat`` ended now (``rec``: the engine's record of it): these
        methods, in the order of :func:`metronome.front_rules.after_step`, which the simulator's compiled loop runs
        on its own phases; what one leaves the next is in :attr:`done`."""
        self.done = StepDone(start, lat, rec, self.model.steps - 1)
        t = type(self)
        rules.after_step.py_func(self, self.now, t._step_tokens, t._step_preemptions, t._answer_silent,
                                 t._step_records)
        if self.check_invariants:
            self.assert_invariants()

    def _step_tokens(self, now: float) -> None:
        """The step's sampled tokens to their frames (rules.tokens_in), the frames done answered; the blocks used
        after the step."""
        d = self.done
        sampled = np.asarray(d.rec.sampled_slots, np.int64)
        a = self._answer_room(sampled.size)
        if type(self)._tokens_in is not FrontEnd._tokens_in:  # (its hook reads what the tokens went to)
            told, ready = tuple(np.empty(sampled.size, np.int64) for _ in range(3)), None
        else:  # (nobody reads it: as the simulator's loop calls the rule, so that numba compiles it once for both)
            told, ready = None, np.empty(sampled.size, np.int64)
        self.n_answers, n_pre, d.tokens_out, _ = rules.tokens_in(sampled, now, self.session_arrays(),
                                                                 self.sess_of_slot, a, self.n_answers, told, ready)
        if told is not None:
            self._tokens_in(told[0][:n_pre], told[1][:d.tokens_out], told[2][:d.tokens_out])
        d.used = self.model.used

    def _step_preemptions(self, now: float) -> None:
        """The engine's preemptions and the deadlock rule's victims (:meth:`_preempt_after_step`); a step that
        preempted dates the pool's saturation (its start) and holds admission back for a turn, one that scheduled
        nothing and preempted no one stalled."""
        d = self.done
        victims = self._preempt_after_step(d.rec, d.step_no, d.start)
        if victims and self.t_sat is None:
            self.t_sat = d.start
        self.preempted_last = bool(victims)
        if not d.rec.batch and not victims:
            self.stalled = True
        self.peak_used = max(self.peak_used, d.used)
        d.victims = len(victims)

    def _step_records(self, now: float) -> None:
        """The moment's answers and the step recorded (:meth:`_record_step`)."""
        d = self.done
        self._record_step(d.start, d.lat, d.rec, d.used, d.tokens_out, d.victims)

    def _preempt_after_step(self, rec, step_no: int, start: float) -> list[int]:
        """The engine's own preemptions, then the deadlock rule's victims: each loses its place (dated at the
        step's start, as t_sat is)."""
        out = []
        for s in (rec.preempted if self.sees_starvation else ()):  # else vLLM re-prefills it in its own queue
            i = int(self.sess_of_slot[s])
            if self.slot[i] == s:  # (not a request the front end aborted since)
                self._preempt(i, "engine", start)
                out.append(i)
        m = self.model
        # starved: work handed over before this step, not scheduled in it, waiting in the engine
        cand = np.empty(self.state.size, np.int64)
        cand = cand[:rules.awaiting_engine(step_no, self.session_arrays(), cand)] if self.sees_starvation else cand[:0]
        if cand.size:
            scheduled = np.zeros(self.sess_of_slot.size, dtype=bool)
            scheduled[rec.slots] = True
            sl = self.slot[cand]
            cand = cand[~scheduled[sl] & m.waiting_of(sl)]
        stalled = not rec.batch and m.has_work()
        if not cand.size and not stalled:
            return out
        # the rule on arrays (serving.deadlock_pick, as the compiled loop asks it): every session in the engine, the
        # starved ones with the blocks they need
        inside = np.flatnonzero(self.slot >= 0)
        need = np.zeros(inside.size, dtype=np.int64)
        for i in cand.tolist():
            s = int(self.slot[i])
            need[np.searchsorted(inside, i)] = serving.blocks_to_resume(self.policy, m.tokens_of(s), m.computed(s),
                                                                         m.blocks_of(s), self.cap_blocks)
        pick = np.empty(inside.size, dtype=np.int64)
        free = m.free_blocks()
        n = serving.deadlock_pick(need, self.admit_seq[inside], m.held_of(self.slot[inside]).astype(np.int64),
                                  np.int64(free), np.bool_(stalled), pick)
        # why: the starved sessions need more than is free, or the step scheduled nothing at all
        reason = "pool_dry" if cand.size and int(need.sum()) > free else "stall"
        for i in inside[pick[:n]].tolist():
            self._preempt(i, reason, start)
            out.append(i)
        return out

    def _lose_all(self, now: float) -> int:
        """The engine died, and every session's KV with it: each session it held (or was handing a request when
        it died) loses its place without an abort and goes back to the head of the queue, the oldest admitted
        first, to come back as a rebase. Returns how many."""
        self.model.lost()
        live = (self.state >= WAITING) & (self.state <= RUNNING)
        live[self.waiting] = False
        lost = np.flatnonzero(live)
        for i in lost[np.argsort(self.admit_seq[lost], kind="stable")][::-1].tolist():
            self._preempt(i, "engine_died", now, lost=True)
        self.preempted_last = False
        return int(lost.size)

    def _preempt(self, i: int, reason: str, t: float, lost: bool = False) -> None:
        """Recompute preemption at the session level: the request goes, the session waits at the queue's head
        (``reason``: ``engine``, ``pool_dry``, ``stall``; ``t``: when). ``lost``: the engine died with its KV."""
        self._drop_request(i)
        first_q = int(self.next_frame[i] - self.backlog[i])
        if self.backlog[i]:  # due frames never submitted: silent
            self._silenced(np.full(int(self.backlog[i]), i), np.arange(first_q, int(self.next_frame[i])), WAITING)
        self.room(ahead=1)
        a = self._owing_room(int(self.backlog[i]) + 1)
        self.n_answers = rules.lose_place(i, self.lockstep, self.session_arrays(), self._b, self.queues, a,
                                          self.n_answers)
        if lost:
            self.rebase_next[i] = True
        else:
            self.s_preempt[i] += 1
        self.stalled = False
        self._event("lost" if lost else "preempt", i, t, reason=reason, history_tokens=int(self.hist[i]))

    # -------------------------------------------------------------------------------------------------- books
    def assert_invariants(self):
        """Pool accounting: used = Σ held, 0 <= used <= pool, every session within its policy's bound."""
        self.model.check()
        if self.cap_blocks is not None:
            held = int(self.model.held_of(self.slot[self.slot >= 0]).max(initial=0))
            assert held <= self.cap_blocks, f"a session holds {held} > {self.cap_blocks} blocks (the admission cap)"
        assert (self.s_late <= self.s_frames).all() and (self.s_silent <= self.s_frames).all(), \
            "a session has more late or silent frames than frames answered"
        outside = (self.state != PREFILL) & (self.state != RUNNING)
        assert not (self.slot[outside] >= 0).any(), "a session outside the engine holds a request"

    def finalize(self):
        """Close the books at the horizon: sessions still in the engine end with reason 'horizon'."""
        live = np.flatnonzero(((self.state >= WAITING) & (self.state <= RUNNING)) | (self.state == QUEUED))
        self.s_ended[live] = min(self.now, self.horizon)
        self.s_end_reason[live] = EndReason.HORIZON
