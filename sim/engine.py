"""The simulated engine: vLLM v1's scheduler (:class:`metronome.serving.EngineModel`) behind the serving front end
the live driver runs, on a simulated clock.

The serving rules are not written here: who runs in a step, what a session needs to be admitted, who is
preempted and where it goes, the length limit and the deadlock rule all come from :mod:`metronome.serving`,
which ``tests/live/test_scheduler_differential.py`` checks step by step against vLLM's own scheduler. This
module keeps the time: the frame clock, step latencies from the calibration, the front end's turns
(as :class:`metronome.probe.driver.Driver` takes them live) and the records.

A frame's life:

1. **The frame clock.** Frame ``f`` of session ``i`` ticks at ``f·P + φ_i`` (``serving.frame_tick``; ``P`` =
   the calibration's frame period). Under ``aligned`` phases every ``φ_i`` is 0 and the engine serves the
   sessions in lockstep; under ``independent`` phases each has its own (``workload.draw_phases``) and the
   engine steps back to back while any request has work, each step batching the frames that arrived before
   it. A session that arrives at ``t`` streams from frame ``serving.join_frame(t, P, φ_i)``.
2. **The front end.** An arrival passes the admission gate (controller, queue, timeout), then waits in the
   front end's FCFS queue until the engine has the blocks vLLM's admission gate wants
   (``serving.admission_need_blocks``), never in the turn right after a step that preempted. At its tick a
   running session appends its frame (the token sampled last, the input of any silent frames, the frame's
   input) to its request, or is rebased/finished when the frame would reach ``max_model_len``.
3. **The engine.** One step is ``EngineModel.step()``: running requests first (a dry pool preempts the
   newest), then the waiting ones, none after a preemption. A step's latency is the calibration's step model
   (plus the first-step term when a frame starts in it, times the step's jitter draw).
4. **After a step.** Sampled tokens go to their frames; a frame with all its tokens is answered. Requests the
   engine preempted, and the victims of the deadlock rule (``serving.deadlock_victims``), lose their place:
   their request is aborted and they go back to the head of the front end's queue, to be readmitted as a new
   request whose prompt is their whole history.
5. **Silence.** A waiting or re-prefilling session's frame is answered empty, on time; its input joins the
   history. In lockstep it is answered when every running session's frame of its tick is done; with
   independent phases the front end answers it at once (:meth:`SimEngine._owe`).

**Fast-forward.** When every session streams with nothing prefilling, queued at the gate or owed from a
preemption, turns and steps run in a compiled loop (:meth:`SimEngine._compiled_span`, :mod:`metronome.sim.fastpath`),
under either phase regime: the same rules, timings, jitter draws and records, one SimPy event per span. The engine
step there is the engine model's own (``serving.engine_step`` on its arrays). A step after which the front end must
act (a stall; with the driver's loop, a preemption or a request left waiting) is handed back once taken
(:meth:`_after_step` does the rest); the span stops before a turn the loop does not restate (the length limit, an
admission, the next arrival) and the step-by-step path takes it from there; tests compare the two bit for bit.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np
import simpy

from metronome import control_kernel as ck
from metronome import serving
from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy
from metronome.serving import EndReason, EngineLimits, EngineModel

from metronome.sim.recorder import frame_table, step_table

# front-end states of a session
NOT_ARRIVED, WAITING, PREFILL, RUNNING, ENDED, REFUSED, QUEUED = 0, 1, 2, 3, 4, 5, 6
_EPS = 1e-12


class SimEngine:
    # one entry per session, in arrival order (set by _init_sessions): the front end's state of each
    state: np.ndarray  # NOT_ARRIVED .. QUEUED
    rid: np.ndarray  # the session's engine request (-1: none)
    slot: np.ndarray  # its request's slot in the engine model
    hist: np.ndarray  # tokens of its history (what a readmission re-prefills)
    last_tok: np.ndarray  # a sampled token not yet in the engine (re-fed next frame)
    pending_in: np.ndarray  # input of silent frames, not yet in the engine
    started: np.ndarray  # its first frame (with the prompt) went to the engine
    next_frame: np.ndarray  # the next tick it has not yet seen
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
    # one entry per engine slot
    sess_of_slot: np.ndarray
    fresh_slot: np.ndarray  # a frame submitted and not yet scheduled (first-step term)
    # the compiled loop's own (set by _init_loop)
    fast_steps: int
    loop_departures: int
    loop_first_frames: int
    loop_preemptions: int
    loop_readmissions: int
    loop_arrivals: int
    loop_refused: int
    loop_admissions: int
    _last_span: int
    pause_every_s: float | None
    arrivals_in_loop: bool
    _no_controller: tuple | None

    def __init__(self, env: simpy.Environment, calibration: Calibration, policy: KVPolicy,
                 arrival_s: np.ndarray, duration_s: np.ndarray, horizon_s: float, deadline_s: float,
                 controller=None, fast_forward: bool = True,
                 check_invariants: bool = False, seed: int = 0, engine_model=EngineModel,
                 phase_slot: np.ndarray | None = None, phases: str = "aligned", loop: str = "driver"):
        self.env, self.cal, self.policy = env, calibration, policy
        self.horizon = float(horizon_s)
        self.deadline = float(deadline_s)
        self.controller = controller
        self.gate = serving.AdmissionGate(controller)
        self.check_invariants = check_invariants

        st = calibration.stream
        self.P = st.frame_period_s
        self.n_in, self.n_out = st.input_tokens_per_frame, st.output_tokens_per_frame
        self.tpf = st.kv_tokens_per_frame
        self.prompt = max(st.prompt_tokens, 1)  # vLLM rejects an empty chunk
        eng = calibration.engine
        self.maxlen = calibration.model.max_model_len_tokens
        self.num_blocks = eng.usable_blocks
        self.limits = EngineLimits(num_blocks=eng.usable_blocks, max_num_seqs=eng.max_num_seqs,
                                   max_num_batched_tokens=eng.max_num_batched_tokens, max_model_len=self.maxlen,
                                   watermark_blocks=eng.watermark_blocks)
        # the scheduler: EngineModel, or anything with its interface (the differential test passes vLLM's own)
        self.model = engine_model(policy, self.limits)
        self.cap_blocks = policy.admission_cap_blocks(self.limits.in_flight_tokens, self.maxlen)
        # the fast path writes EngineModel's state directly
        self.fast_forward = fast_forward and isinstance(self.model, EngineModel)
        self.outcome = serving.length_outcome(policy)
        self.keep_tokens = serving.rebase_keep_tokens(policy, self.maxlen)
        self.lat = calibration.step_latency_for(policy)  # the plugin's own costs when the policy runs through it
        # extra time of a step that starts a frame after the engine idled (the calibration's "first step after
        # the idle gap"): in lockstep a frame's first step; with independent phases only when nothing ran before
        self.first_s = float(self.lat.frame_first_s)
        self.idle = True  # the engine waited (no step ran) since its last step
        self.jitter = bool(self.lat.jitter)
        self.seed = int(seed)
        self.draws = self.lat.draws(self.seed, self.P)
        self.n_steps = 0

        order = np.argsort(arrival_s, kind="stable")
        self.arrival = np.asarray(arrival_s, dtype=np.float64)[order]
        self.duration = np.asarray(duration_s, dtype=np.float64)[order]
        M = len(self.arrival)
        # each session's phase (serving.PHASE_SLOTS per period): its frame f ticks at f·P + phase
        self.pslot = (np.zeros(M, dtype=np.int64) if phase_slot is None
                      else np.asarray(phase_slot, dtype=np.int64)[order])
        self.phase = serving.phase_offset_s(self.pslot, self.P)
        serving.check_phases(phases)
        # serving.LOOPS: does the front end see starved and preempted sessions after each step?
        self.sees_starvation = serving.sees_starvation(loop)
        self.lockstep = phases == "aligned"
        if self.lockstep and self.pslot.any():
            raise ValueError("aligned phases: every session's phase is 0")
        self._init_sessions(M)

        self.waiting: deque[int] = deque()  # the front end's FCFS queue (admitted by the gate, not in the engine)
        self.by_rid: dict[int, int] = {}
        self.next_rid = 0
        self.next_arrival = 0
        self.departures: list[tuple[float, int]] = []
        self.seq = 0
        self.now = 0.0
        self.preempted_last = False  # the last step preempted: admit nobody in the next turn
        self.stalled = False  # the last step scheduled nothing and freed nothing: wait for an event
        self.serving_frame = 0  # the latest frame handed to the engine: the frame a step is taken on (jitter)
        # rows (session, frame, tokens got) answered with the lockstep, kept as arrays: past the cliff hundreds of
        # thousands are owed at once, and a list of tuples turned into an array every step was most of a run
        self._pend_chunks: list[np.ndarray] = []
        self._answers: list[tuple] = []  # (tick keys, sessions, tokens got) answered at the current moment
        self.t_sat: float | None = None
        self.peak_used = 0
        self.steps = step_table()
        self.frames = frame_table()
        self.slow_steps = 0  # steps taken one SimPy event each
        self._init_loop()

    def _init_loop(self) -> None:
        """What the compiled loop keeps between calls, and what it counts (the summary depends on none of it)."""
        self.fast_steps = 0  # steps taken in the compiled loop
        self.loop_departures = 0  # departures taken in the compiled loop
        self.loop_first_frames = 0  # sessions' first frames (new requests) handed over in the compiled loop
        self.loop_preemptions = self.loop_readmissions = 0  # sessions it preempted and readmitted
        # arrivals the compiled loop took (those of them the gate refused) and sessions it admitted
        self.loop_arrivals = self.loop_refused = self.loop_admissions = 0
        self._last_span = SimEngine.COMPILED_STEPS  # steps the last call of the compiled loop took
        self.pause_every_s = None  # the compiled loop hands back at each multiple of it (a caller looks)
        # the compiled loop takes arrivals too when it can run the gate: no controller or a compiled one, and nobody
        # parked in the gate's queue (it does not keep it)
        c = self.controller
        self.arrivals_in_loop = (c is None or c.compiled) and self.gate.on_refuse != "queue"
        self._no_controller = None  # the arrays the loop gets without a compiled controller (kept from call to call)

    def _init_sessions(self, M: int) -> None:
        """The per-session arrays (declared on the class) for ``M`` sessions, and the per-slot ones."""
        self.state = np.zeros(M, dtype=np.int8)
        self.rid, self.slot, self.inflight, self.admit_seq = (np.full(M, -1, dtype=np.int64) for _ in range(4))
        self.hist, self.pending_in, self.next_frame, self.backlog, self.inflight_tok, self.work_step = (
            np.zeros(M, dtype=np.int64) for _ in range(6))
        self.last_tok, self.started = np.zeros(M, dtype=bool), np.zeros(M, dtype=bool)
        self.running_since = np.zeros(M)
        self.s_frames, self.s_silent, self.s_late, self.s_tokens, self.s_preempt, self.s_rebase = (
            np.zeros(M, dtype=np.int64) for _ in range(6))
        self.s_admitted, self.s_ended = np.full(M, np.nan), np.full(M, np.nan)
        self.admitted = np.zeros(M, dtype=bool)
        self.s_end_reason = np.full(M, "", dtype=object)
        self.sess_of_slot = np.full(64, -1, dtype=np.int64)
        self.fresh_slot = np.zeros(64, dtype=bool)

    # ------------------------------------------------------------------------------------------ helpers
    def _in_flight(self) -> int:
        """Sessions the front end has let in (waiting for blocks, prefilling or running)."""
        return int(((self.state >= WAITING) & (self.state <= RUNNING)).sum())

    def _next_event_time(self, departures: bool = True, arrivals: bool = True) -> float:
        t = self.horizon
        if self.next_arrival < len(self.arrival) and arrivals:
            t = min(t, self.arrival[self.next_arrival])
        if self.departures and departures:
            t = min(t, self.departures[0][0])
        if self.gate.queue:
            t = min(t, self.now + self.gate.poll_s)
        return t

    def _add(self, i: int, prompt_tokens: int, max_tokens: int) -> int:
        """A new engine request for session ``i``: its whole prompt, ``max_tokens`` to sample."""
        r = self.next_rid
        self.next_rid += 1
        slot = self.model.add(r, prompt_tokens, max_tokens)
        self._fit_slots(slot + 1)
        self.rid[i], self.slot[i] = r, slot
        self.by_rid[r] = i
        self.sess_of_slot[slot] = i
        return slot

    def _fit_slots(self, n: int) -> None:
        """The per-slot arrays at least ``n`` long (the engine model's grow as requests are added)."""
        if self.sess_of_slot.size < n:
            grow = max(n, 2 * self.sess_of_slot.size) - self.sess_of_slot.size  # (doubling: adds one at a time)
            self.sess_of_slot = np.concatenate([self.sess_of_slot, np.full(grow, -1)])
            self.fresh_slot = np.concatenate([self.fresh_slot, np.zeros(grow, dtype=bool)])

    def _name_request(self, i: int, slot: int) -> None:
        """Session ``i``'s first frame or readmission became request ``slot`` in the compiled loop: its id, as
        :meth:`_add`."""
        r = self.next_rid
        self.next_rid += 1
        self.model.adopt(r, slot)
        self.rid[i] = r
        self.by_rid[r] = i

    def _forget_request(self, i: int) -> None:
        """The compiled loop aborted session ``i``'s request (it was preempted or departed), if it had one (none
        before its first frame): its id goes, as :meth:`_drop_rid`."""
        r = int(self.rid[i])
        if r >= 0:
            self.model.forget(r)
            self.by_rid.pop(r, None)
            self.rid[i] = -1

    def _drop_rid(self, i: int) -> None:
        r = int(self.rid[i])
        if r >= 0:
            if self.model.status(r) is not None:
                self.model.abort(r)
            self.by_rid.pop(r, None)
            self.fresh_slot[self.slot[i]] = False
            self.rid[i] = self.slot[i] = -1

    # ------------------------------------------------------------------------------------------- the loop
    def start(self):
        return self.env.process(self._run())

    def _run(self):
        env = self.env
        turned = False  # the compiled loop already took the turn at self.now
        paused = False  # ... and paused after it: it goes on from there
        while self.now < self.horizon:
            if not turned or paused:
                if not turned:
                    self._turn(self.now)
                if self.fast_forward:
                    span = self._compiled_span(self.now)
                    if span is not None:
                        end, turned, paused, taken = span
                        yield env.timeout(max(0.0, end - env.now))
                        self.now = end
                        if taken is not None:  # the loop took a step whose aftermath is this path's
                            self._after_step(*taken)
                            turned = paused = False
                        continue
            turned = paused = False
            if self.model.has_work() and not self.stalled:
                start = self.now
                lat, rec = self._step(start)
                end = start + lat
                yield env.timeout(max(0.0, end - env.now))
                self.now = end
                self._after_step(start, lat, rec)
            else:
                self.preempted_last = False  # no step ran: the next admission is not "right after" one
                self.idle = True
                until = min(self._next_tick(), self._next_event_time())
                if until <= self.now:  # nothing left to wait for (a stalled engine with no event): give up time
                    until = self.horizon
                yield env.timeout(max(0.0, until - env.now))
                self.now = until

    def _next_tick(self) -> float:
        live = (self.state >= WAITING) & (self.state <= RUNNING)
        if not live.any():
            return math.inf
        return float(serving.frame_tick(self.next_frame[live], self.P, self.phase[live]).min())

    # ------------------------------------------------------------------------------------- front end turn
    def _turn(self, now: float) -> None:
        """Arrivals, the gate's queue, departures, admission, due frames, silent answers (the driver's turn)."""
        while self.next_arrival < len(self.arrival) and self.arrival[self.next_arrival] <= now:
            i = self.next_arrival
            self.next_arrival += 1
            if self.arrival[i] >= self.horizon:
                continue
            decision = self.gate.offer(i, self.arrival[i], now, self._in_flight())
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
        while self.departures and self.departures[0][0] <= now:
            t, i = heapq.heappop(self.departures)
            if WAITING <= self.state[i] <= RUNNING:
                self._end(i, now, EndReason.DEPARTED)
        self._admit(now)
        self._ticks(now)
        self._answer_silent(now)
        self._flush_answers(now)

    def _refuse(self, i: int, now: float, reason: str) -> None:
        self.state[i] = REFUSED
        self.s_end_reason[i], self.s_ended[i] = reason, now

    def _enter(self, i: int, t_enter: float) -> None:
        """Past the gate (at its arrival, or when the gate's queue let it in): the session waits in the front
        end's queue, streams from the first tick at or after ``t_enter`` and leaves ``duration`` after it."""
        self.state[i] = WAITING
        self.next_frame[i] = serving.join_frame(t_enter, self.P, float(self.phase[i]))
        self.waiting.append(i)
        heapq.heappush(self.departures, (t_enter + self.duration[i], i))

    def _request_tokens(self, i: int) -> int:
        """Tokens the session's request will carry when (re)admitted: its first frame, or its history."""
        if not self.started[i]:
            return self.prompt + int(self.pending_in[i]) + self.n_in
        return int(self.hist[i] + self.pending_in[i])

    def _admission_need(self, i: int) -> int:
        return serving.admission_need_blocks(self.policy, self._request_tokens(i), self.cap_blocks)

    def _admit(self, now: float) -> None:
        if self.preempted_last:
            return
        for i in serving.admit_fcfs(self.waiting, self._admission_need, self.model.free_blocks()):
            self.admit_seq[i] = self.seq
            self.seq += 1
            if np.isnan(self.s_admitted[i]):
                self.s_admitted[i] = now
                self.admitted[i] = True
            if not self.started[i]:
                # a new session: its first frame (prompt + input) is its prefill, submitted at its tick
                self.state[i] = RUNNING
                self.running_since[i] = serving.frame_tick(self.next_frame[i], self.P, self.phase[i])
                continue
            self._readmit(i, now)

    def _readmit(self, i: int, now: float) -> None:
        """A session that lost its place comes back as a new request whose prompt is its whole history."""
        prompt = int(self.hist[i] + self.pending_in[i])
        self.pending_in[i] = 0
        if not serving.frame_fits(prompt + self.tpf, self.maxlen):
            if self.outcome == "finish":
                self.hist[i] = prompt
                self._end(i, now, EndReason.LENGTH)
                return
            prompt = min(prompt, self.keep_tokens)
            self.s_rebase[i] += 1
        self.hist[i] = prompt
        self._add(i, prompt, 1)  # its one sampled token starts the next chunk
        self.state[i] = PREFILL
        self.work_step[i] = self.model.steps

    def _ticks(self, now: float) -> None:
        """Frames that came due: running sessions queue them (and submit one); the others hear silence."""
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        tick = serving.frame_tick
        P = self.P
        due = live[tick(self.next_frame[live], P, self.phase[live]) <= now + _EPS]
        if due.size:
            ph = self.phase[due]
            one = tick(self.next_frame[due] + 1, P, ph) > now + _EPS  # exactly one frame came due (the usual)
            many = due[~one]
            if many.size:  # an engine slower than the frame clock: a running session queues them all
                nf, ph = self.next_frame[many], self.phase[many]
                n_due = np.floor((now + _EPS - ph) / P).astype(np.int64) - nf + 1
                # the division may round across a tick: settle on the tick test itself (f·P + φ <= now)
                n_due -= tick(nf + n_due - 1, P, ph) > now + _EPS
                n_due += tick(nf + n_due, P, ph) <= now + _EPS
                queued = self._queues(many, nf)
                q = many[queued]
                self.backlog[q] += n_due[queued]
                self.next_frame[q] += n_due[queued]
                self._tick_each(many[~queued], n_due[~queued])
            self._tick_one(due[one])
        submit = live[(self.state[live] == RUNNING) & (self.inflight[live] < 0) & (self.backlog[live] > 0)]
        if submit.size:
            self._submit_many(submit, now)

    def _tick_one(self, idx: np.ndarray) -> None:
        """Frame ``next_frame`` of sessions ``idx`` is due: a running session's is queued, the others' is silent."""
        f = self.next_frame[idx].copy()
        self.next_frame[idx] += 1
        run = self._queues(idx, f)
        self.backlog[idx[run]] += 1
        quiet = idx[~run]
        if quiet.size:
            self.pending_in[quiet] += self.n_in
            self._owe(quiet, f[~run], np.zeros(quiet.size, dtype=np.int64))

    def _queues(self, idx: np.ndarray, f: np.ndarray) -> np.ndarray:
        """Whether frame ``f`` of session ``idx`` is queued for the engine (the session runs, and the frame is not
        before its place in it) rather than heard as silence."""
        return (self.state[idx] == RUNNING) & (serving.frame_tick(f, self.P, self.phase[idx])
                                               >= self.running_since[idx] - _EPS)

    def _tick_each(self, idx: np.ndarray, n_due: np.ndarray) -> None:
        """Sessions ``idx`` have ``n_due`` frames each come due at once (a session waiting or re-prefilling while
        the engine is slower than the frame clock): :meth:`_tick_one` for each frame, session by session in
        order, in one call (past the cliff hundreds of sessions wait, and one call per frame was most of a run)."""
        if not idx.size:
            return
        start = np.cumsum(n_due) - n_due
        who = np.repeat(idx, n_due)
        f = np.repeat(self.next_frame[idx], n_due) + np.arange(who.size) - np.repeat(start, n_due)
        self.next_frame[idx] += n_due
        run = self._queues(who, f)
        np.add.at(self.backlog, who[run], 1)
        quiet = ~run
        np.add.at(self.pending_in, who[quiet], self.n_in)
        self._owe(who[quiet], f[quiet], np.zeros(int(quiet.sum()), dtype=np.int64))

    def _submit_many(self, idx: np.ndarray, now: float) -> None:
        """Hand each session's oldest due frame to the engine. Sessions paused in the engine whose frame fits
        go at once (one append each, as arrays); the others (a first frame, a rebase, the length limit) one by
        one, in session order, as the driver does."""
        chunk = 1 + self.pending_in[idx] + self.n_in
        simple = (self.started[idx] & (self.slot[idx] >= 0)
                  & serving.frame_fits(self.hist[idx] + chunk + self.n_out, self.maxlen))
        fast, slow = idx[simple], idx[~simple]
        if fast.size:
            sl = self.slot[fast]
            self.model.append_many(sl, chunk[simple], self.n_out)
            self.fresh_slot[sl] = True
            f = self.next_frame[fast] - self.backlog[fast]
            self.hist[fast] += chunk[simple]
            self.pending_in[fast] = 0
            self.last_tok[fast] = False
            self.backlog[fast] -= 1
            self.inflight[fast], self.inflight_tok[fast] = f, 0
            self.serving_frame = max(self.serving_frame, int(f.max()))
            self.work_step[fast] = self.model.steps
            self.stalled = False
        for i in slow.tolist():
            self._submit(i, now)

    def _submit(self, i: int, now: float) -> None:
        """Hand the oldest due frame to the engine (rebased or finished at the length limit)."""
        f = int(self.next_frame[i] - self.backlog[i])
        chunk = (1 if self.started[i] else self.prompt) + int(self.pending_in[i]) + self.n_in
        if not serving.frame_fits(int(self.hist[i]) + chunk + self.n_out, self.maxlen):
            if self.outcome == "finish":
                self._end(i, now, EndReason.LENGTH)
                return
            kept, chunk = serving.rebase_counts(int(self.hist[i]), chunk, self.n_out, self.keep_tokens, self.maxlen)
            self._drop_rid(i)
            self.hist[i] = kept
            self.s_rebase[i] += 1
        if self.slot[i] < 0:
            sl = self._add(i, int(self.hist[i]) + chunk, self.n_out)
        else:
            sl = int(self.slot[i])
            self.model.append(int(self.rid[i]), chunk, self.n_out)
        self.fresh_slot[sl] = True
        self.hist[i] += chunk
        self.started[i] = True
        self.pending_in[i] = 0
        self.last_tok[i] = False
        self.backlog[i] -= 1
        self.inflight[i], self.inflight_tok[i] = f, 0
        self.serving_frame = max(self.serving_frame, f)
        self.work_step[i] = self.model.steps
        self.stalled = False

    def _end(self, i: int, now: float, reason: str) -> None:
        self._drop_rid(i)
        self.stalled = False
        if self.state[i] == WAITING and i in self.waiting:
            self.waiting.remove(i)
        # frames still owed: answered (silent or short) once their deadline has passed, else censored
        pend = self.silent_pending
        mine = pend[:, 0] == i
        owed = [(f, tok) for f, tok in pend[mine, 1:].tolist()]
        if mine.any():
            left = pend[~mine]
            self._pend_chunks = [left] if left.size else []
        if self.inflight[i] >= 0:
            owed.append((int(self.inflight[i]), int(self.inflight_tok[i])))
        # an overloaded session ends with hundreds of frames queued: answered in one call, not one by one
        first_q = int(self.next_frame[i] - self.backlog[i])
        f = np.concatenate([np.array([x[0] for x in owed], dtype=np.int64),
                            np.arange(first_q, int(self.next_frame[i]), dtype=np.int64)])
        tok = np.concatenate([np.array([x[1] for x in owed], dtype=np.int64), np.zeros(f.size - len(owed), np.int64)])
        due = serving.frame_tick(f, self.P, self.phase[i]) + self.deadline <= now + _EPS
        if due.any():
            self._answer_many(np.full(int(due.sum()), i), f[due], tok[due])
        self.inflight[i], self.backlog[i] = -1, 0
        self.state[i] = ENDED
        self.s_ended[i], self.s_end_reason[i] = now, reason

    # -------------------------------------------------------------------------------------------- answers
    def _answer_many(self, idx: np.ndarray, f: np.ndarray, tokens: np.ndarray) -> None:
        """Count sessions ``idx``'s frames ``f`` as answered now with ``tokens`` tokens each (0: silent); they are
        recorded, one row per tick, when the moment's answers are flushed."""
        np.add.at(self.s_frames, idx, 1)  # (a departing session is answered several frames at once)
        np.add.at(self.s_silent, idx[serving.frame_is_silent(tokens)], 1)
        self._answers.append((serving.tick_key(np.asarray(f, np.int64), self.pslot[idx]), idx, tokens))

    def buffered_answers(self) -> int:
        """Frames answered at the current moment and not yet recorded."""
        return sum(a[0].size for a in self._answers)

    def _owe(self, idx: np.ndarray, f: np.ndarray, tokens: np.ndarray) -> None:
        """Frames of sessions without a place (waiting, re-prefilling, just preempted), answered short or empty.
        In lockstep they are answered with their tick's running frames (:meth:`_answer_silent`); a front end
        serving clients on their own clocks answers them at once."""
        if self.lockstep:
            if idx.size:
                self._pend_chunks.append(np.stack([idx, f, tokens], axis=1).astype(np.int64, copy=False))
        elif idx.size:
            self._answer_many(idx, f, tokens)

    @property
    def silent_pending(self) -> np.ndarray:
        """The frames owed in lockstep, one row (session, frame, tokens got) each, oldest first."""
        ch = self._pend_chunks
        if not ch:
            return np.zeros((0, 3), dtype=np.int64)
        if len(ch) > 1:
            self._pend_chunks = ch = [np.concatenate(ch)]
        return ch[0]

    def _answer_silent(self, now: float) -> None:
        """Lockstep: silent frames are answered once every running session's frame of their tick is done."""
        if not self._pend_chunks:
            return
        # lockstep only (every phase 0): a tick is its frame index
        run = np.flatnonzero(self.state == RUNNING)
        owed = np.where(self.inflight[run] >= 0, self.inflight[run],
                        np.where(self.backlog[run] > 0, self.next_frame[run] - self.backlog[run], np.iinfo(np.int64).max))
        unfinished = int(owed.min()) if owed.size else np.iinfo(np.int64).max
        pend = self.silent_pending
        now_ = pend[:, 1] < unfinished
        if now_.any():
            self._answer_many(pend[now_, 0], pend[now_, 1], pend[now_, 2])
            left = pend[~now_]
            self._pend_chunks = [left] if left.size else []

    def _flush_answers(self, now: float) -> tuple[int, int]:
        """Record the frames answered at ``now`` (one row per tick) and feed the controller; returns (frames, silent).
        The rows are the compiled loop's own (:func:`metronome.sim.fastpath.flush`): one statement of a row."""
        from metronome.sim import fastpath as fp

        if not self._answers:
            return 0, 0
        key, who, tok = (np.concatenate([np.asarray(a[c], np.int64) for a in self._answers]) for c in range(3))
        self._answers = []
        n = key.size
        fr = self.frames
        fr.reserve(n)
        r0 = fr.rows
        fr.commit(fp.flush(now, n, key, who, tok, self.admitted, self.P, float(serving.phase_offset_s(1, self.P)),
                           self.deadline, _EPS, self.s_late, *self._frame_stores(), r0, self._in_flight(),
                           serving.key_order_work(n)))
        lat, nn, silent = (fr.column(c)[r0:] for c in ("latency_s", "frames", "silent"))
        if self.controller is not None:
            for lt, k, sl in zip(lat.tolist(), nn.tolist(), silent.tolist()):
                self.controller.advance(now, self._in_flight())
                self.controller.observe(now, lt, frames=k, silent=sl)
        return int(nn.sum()), int(silent.sum())

    def _frame_stores(self) -> tuple:
        """The frames table's storage as :func:`metronome.sim.fastpath.flush` writes it: frame, tick, answered,
        latency, and the integer block."""
        fr = self.frames
        return fr.store("frame"), fr.store("tick_s"), fr.store("done_s"), fr.store("latency_s"), fr.block

    # ----------------------------------------------------------------------------------------- one step
    def _step(self, now: float):
        rec = self.model.step()
        S = rec.slots
        first = self.idle and bool(self.fresh_slot[S].any())
        self.idle = False
        self.fresh_slot[S] = False
        ctx = rec.context_tokens
        lat = float(self.lat.step_s(int(S.size), ctx, rec.new_tokens))
        if first:
            lat += self.first_s
        if self.jitter:
            lat *= float(self.draws.ratio(self.n_steps, self.serving_frame)[0])
        self.n_steps += 1
        self.slow_steps += 1
        return lat, rec

    def _after_step(self, start: float, lat: float, rec) -> None:
        now = self.now
        step_no = self.model.steps - 1
        sam = self.sess_of_slot[rec.sampled_slots]
        st = self.state[sam]
        pre = sam[st == PREFILL]  # the re-prefill is done: the sampled token starts the next chunk
        inf = sam[(st == RUNNING) & (self.inflight[sam] >= 0)]
        self.state[pre] = RUNNING
        self.last_tok[pre] = True
        self.running_since[pre] = now
        tokens_out = int(inf.size)
        self.inflight_tok[inf] += 1
        self.s_tokens[inf] += 1
        done = inf[self.inflight_tok[inf] >= self.n_out]
        if done.size:
            self.hist[done] += self.n_out - 1  # vLLM keeps every sampled token but the last
            self.last_tok[done] = True
            self._answer_many(done, self.inflight[done], self.inflight_tok[done])
            self.inflight[done] = -1
        used = self.model.used
        victims = self._preempt_after_step(rec, step_no)
        if victims and self.t_sat is None:
            self.t_sat = start
        self.preempted_last = bool(victims)
        if not rec.slots.size and not victims:
            self.stalled = True
        self.peak_used = max(self.peak_used, used)
        self._answer_silent(now)
        done_n, silent = self._flush_answers(now)
        self.steps.add(t_s=start, step_s=lat, batch=int(rec.slots.size), new_tokens=rec.new_tokens,
                       context_tokens=rec.context_tokens, resident_blocks=used, free_blocks=self.num_blocks - used,
                       tokens_out=tokens_out, frames_done=done_n, silent_frames=silent, preemptions=len(victims),
                       running=int((self.state == RUNNING).sum()), waiting=len(self.waiting))
        if self.check_invariants:
            self.assert_invariants()

    def _preempt_after_step(self, rec, step_no: int) -> list[int]:
        """The engine's own preemptions, then the deadlock rule's victims: each loses its place."""
        out = []
        for r in (rec.preempted if self.sees_starvation else ()):  # else vLLM re-prefills it in its own queue
            i = self.by_rid.get(r)
            if i is not None:
                self._preempt(i)
                out.append(i)
        m = self.model
        # starved: work handed over before this step, not scheduled in it, waiting in the engine
        cand = np.flatnonzero((self.slot >= 0) & ((self.inflight >= 0) | (self.state == PREFILL))
                              & (self.work_step <= step_no)) if self.sees_starvation else np.zeros(0, np.int64)
        if cand.size:
            scheduled = np.zeros(self.sess_of_slot.size, dtype=bool)
            scheduled[rec.slots] = True
            sl = self.slot[cand]
            cand = cand[~scheduled[sl] & m.waiting_of(sl)]
        stalled = not rec.slots.size and m.has_work()
        if not cand.size and not stalled:
            return out
        # the rule on arrays (serving.deadlock_pick, as the compiled loop asks it): every session in the engine, the
        # starved ones with the blocks they need
        inside = np.flatnonzero(self.slot >= 0)
        need = np.zeros(inside.size, dtype=np.int64)
        for i in cand.tolist():
            r = int(self.rid[i])
            need[np.searchsorted(inside, i)] = serving.blocks_to_resume(self.policy, m.tokens_of(r), m.computed(r),
                                                                         m.blocks_of(r), self.cap_blocks)
        pick = np.empty(inside.size, dtype=np.int64)
        n = serving.deadlock_pick(need, self.admit_seq[inside], m.held_of(self.slot[inside]).astype(np.int64),
                                  np.int64(m.free_blocks()), np.bool_(stalled), pick)
        for i in inside[pick[:n]].tolist():
            self._preempt(i)
            out.append(i)
        return out

    def _preempt(self, i: int) -> None:
        """Recompute preemption at the session level: the request goes, the session waits at the queue's head."""
        self._drop_rid(i)
        if self.inflight[i] >= 0:  # its frame is answered with its tick's lockstep, with what it got
            tok = int(self.inflight_tok[i])
            self.hist[i] += tok
            self._owe(np.array([i]), self.inflight[i:i + 1].copy(), np.array([tok]))
            self.inflight[i] = -1
        elif self.last_tok[i]:
            self.hist[i] += 1
        self.last_tok[i] = False
        first_q = int(self.next_frame[i] - self.backlog[i])
        owed = np.arange(first_q, int(self.next_frame[i]), dtype=np.int64)  # due frames never submitted: silent
        self.pending_in[i] += self.n_in * owed.size
        self._owe(np.full(owed.size, i), owed, np.zeros(owed.size, dtype=np.int64))
        self.backlog[i] = 0
        self.state[i] = WAITING
        self.s_preempt[i] += 1
        self.waiting.appendleft(i)
        self.stalled = False

    def assert_invariants(self):
        """Pool accounting: used = Σ held, 0 <= used <= pool, every session within its policy's bound."""
        self.model.check()
        if self.cap_blocks is not None:
            held = int(self.model.held_of(self.slot[self.slot >= 0]).max(initial=0))
            assert held <= self.cap_blocks, f"a session holds {held} > {self.cap_blocks} blocks (the admission cap)"
        assert (self.s_late <= self.s_frames).all() and (self.s_silent <= self.s_frames).all(), \
            "a session has more late or silent frames than frames answered"
        outside = (self.state != PREFILL) & (self.state != RUNNING)
        assert not (self.rid[outside] >= 0).any(), "a session outside the engine holds a request"

    # ----------------------------------------------------------------------------------- the compiled loop
    COMPILED_STEPS = 8192  # steps per call of the compiled loop (its record buffers are sized by it)
    SPAN_ARRIVALS = 512  # arrivals one call of the compiled loop may take (room for their sessions is made per call)
    SPAN_FRAMES = 4096  # frames whose correlated-jitter parts one call of the compiled loop is given, at most

    def _span_steps(self) -> int:
        """Steps the next call of the compiled loop may take: twice the last call's (its jitter draws are drawn
        ahead for that many), so a run whose spans end at frequent events draws no more than it uses."""
        return int(min(self.COMPILED_STEPS, max(64, 2 * self._last_span)))

    def _span_draws(self, n_max: int, live: np.ndarray, t_next: float):
        """The compiled loop's jitter: its kind, each step's ratio (independent jitter), or each step's own score
        and the shared and frame-only parts of the frames the span can be serving (from the serving frame to the
        last tick before ``t_next``; a step past them is handed back), the parts' weights and the table."""
        from metronome.sim import fastpath as fp

        none = np.zeros(0)
        d = self.draws
        if not self.jitter:
            return fp.NO_JITTER, none, none, none, none, none, none, (0.0, 0.0, 0.0)
        steps = self.n_steps + np.arange(n_max)
        if not d.correlated:
            return fp.INDEPENDENT, d.ratio(steps, 0), none, none, none, none, none, (0.0, 0.0, 0.0)
        f_lo = self.serving_frame
        last = int(np.floor((min(t_next, self.horizon) + _EPS - self.phase[live].min()) / self.P)) + 1
        shared, own = d.frame_parts(np.arange(f_lo, max(f_lo, min(last, f_lo + self.SPAN_FRAMES)) + 1))
        p, r = d.table()
        return fp.CORRELATED, none, d.step_scores(steps), shared, own, p, r, d.weights()

    def _compiled_span(self, now: float):
        """Turns and steps of a steady span in :func:`metronome.sim.fastpath.run_span` (compiled), from just
        after the turn at ``now``; returns (where it stopped, whether the turn there is taken, whether it paused
        after it, and the (start, latency, record) of a step the loop took whose aftermath is this path's, or None),
        or None when it could not take a single step (the step-by-step path goes on)."""
        from metronome.sim import fastpath as fp

        start = self._compiled_start(now)
        if start is None:
            return None
        live, t_next, na_end = start
        sess = np.concatenate([live, np.arange(self.next_arrival, na_end)])  # (and those that may arrive)
        m = self.model
        m.reserve(sess.size)  # room for each session's first frame, should it come in this span
        self._fit_slots(m.status_a.size)
        n_max = self._span_steps()
        iconf, fconf, coef, istate, draws = self._compiled_config(now, sess, t_next, n_max, na_end)
        fc, fq, dep_t, dep_i = self._front_arrays(sess.size - live.size, sess.size)
        ctl = self._controller_arrays(int(iconf[fp.I_ANSCAP]))
        fstate = np.array([now, 0.0, math.nan if self.t_sat is None else self.t_sat])
        ahead = self.horizon / now if now > 0 else 1.0  # twice the rows of the run so far, to its horizon
        self.steps.reserve(n_max, int(2 * ahead * self.steps.rows))
        self.frames.reserve(4 * n_max + 4 * int(iconf[fp.I_ANSCAP]), int(2 * ahead * self.frames.rows))
        istate[fp.S_NSTEPS], istate[fp.S_NROWS] = self.steps.rows, self.frames.rows
        # requests the loop adds (first frames, readmissions) and aborts (preemptions), in order
        new_i, new_s, new_k = (np.zeros(4 * sess.size + 64, dtype=np.int64) for _ in range(3))
        # lockstep: silent frames owed until their tick's running frames are done (session, frame, tokens got)
        owed = self.silent_pending
        pend = np.zeros((len(owed) + 8 * sess.size + 64, 3), dtype=np.int64)
        pend[:len(owed)] = owed
        na0 = self.next_arrival
        fp.run_span(iconf, fconf, coef, istate, fstate, sess, self.state, self.phase, self.pslot, self.slot,
                    self.next_frame, self.backlog, self.inflight, self.inflight_tok, self.hist, self.last_tok,
                    self.pending_in, self.work_step, self.running_since, self.started, self.admitted,
                    self.s_tokens, self.s_frames, self.s_silent, self.s_late, self.fresh_slot, self.sess_of_slot,
                    m.arrays(), *draws, self.steps.store("t_s"), self.steps.store("step_s"), self.steps.block,
                    *self._frame_stores(), pend, dep_t, dep_i, self.s_ended, new_i, new_s, new_k, fc, fq,
                    self.arrival, self.duration, self.s_admitted, self.admit_seq, self.s_preempt, ctl)
        sframe, peak, n, rows_end, turned, idle, n_pend, n_new, pre_last = istate.tolist()
        self._front_books(fc, fq, dep_t, dep_i, na0, new_i[:n_new], new_s[:n_new], new_k[:n_new])
        self.preempted_last = bool(pre_last)
        if not math.isnan(fstate[fp.FS_TSAT]):
            self.t_sat = float(fstate[fp.FS_TSAT])
        self._last_span = n
        self.idle = bool(idle)
        end = float(fstate[0])
        if n == 0 and end == now and turned not in (fp.PAST_HORIZON, fp.PAUSED, fp.STEP_TAKEN):
            return None
        self._pend_chunks = [pend[:n_pend].copy()] if n_pend else []
        self.serving_frame, self.peak_used = sframe, peak
        self.n_steps += n
        self.fast_steps += n
        self._compiled_records(n, rows_end)
        if turned == fp.PAST_HORIZON:  # its last step outlives the run: SimPy stops while it runs
            self.now = end
            return float(fstate[1]), False, False, None
        taken = None
        if turned == fp.STEP_TAKEN:
            self.n_steps += 1
            self.fast_steps += 1
            lat = float(fstate[1])
            taken = (end, lat, m.last_step())
            end += lat
        elif self.check_invariants:
            self.assert_invariants()
        return end, turned in (fp.TURN_TAKEN, fp.PAUSED), turned == fp.PAUSED, taken

    def _front_arrays(self, n_coming: int, n_sess: int):
        """The front end's counters, its queue and the departures booked, as the compiled loop keeps them (room for
        ``n_coming`` arrivals, and before the queue's head for the ``n_sess`` sessions it may see: a preempted
        session goes back to the head, and no more can than run)."""
        from metronome.sim import fastpath as fp

        deps = sorted(self.departures)  # the heap's order
        nd = len(deps)
        dep_t, dep_i = np.zeros(nd + n_coming), np.zeros(nd + n_coming, dtype=np.int64)
        if nd:
            dep_t[:nd], dep_i[:nd] = zip(*deps)
        head = n_sess + 1
        fq = np.zeros(head + len(self.waiting) + n_coming, dtype=np.int64)
        fq[head:head + len(self.waiting)] = list(self.waiting)
        fc = np.zeros(fp.N_FC, dtype=np.int64)
        fc[[fp.C_NRUN, fp.C_NDEPS, fp.C_NWAIT, fp.C_QHEAD, fp.C_NARR, fp.C_SEQ]] = (
            int((self.state == RUNNING).sum()), nd, len(self.waiting), head, self.next_arrival, self.seq)
        return fc, fq, dep_t, dep_i

    def _front_books(self, fc, fq, dep_t, dep_i, na0: int, new_i, new_s, new_k) -> None:
        """The front end's books after the compiled loop: its requests named and forgotten, in order (before
        departures: one may have left), the arrivals it refused, its queue, the departures it took and those still
        booked."""
        from metronome.sim import fastpath as fp

        for i, s, k in zip(new_i.tolist(), new_s.tolist(), new_k.tolist()):
            if k == fp.NEW_DROPPED:
                self._forget_request(i)
                self.loop_preemptions += 1
                continue
            self._name_request(i, s)
            if k == fp.NEW_FIRST:
                self.loop_first_frames += 1
            else:
                self.loop_readmissions += 1
        came = np.arange(na0, int(fc[fp.C_NARR]))
        refused = came[self.state[came] == REFUSED]
        self.s_end_reason[refused] = EndReason.REFUSED
        self.loop_arrivals += came.size
        self.loop_refused += refused.size
        self.loop_admissions += int(fc[fp.C_SEQ]) - self.seq
        self.next_arrival, self.seq = int(fc[fp.C_NARR]), int(fc[fp.C_SEQ])
        h = int(fc[fp.C_QHEAD])
        self.waiting = deque(fq[h:h + int(fc[fp.C_NWAIT])].tolist())
        k, nd = int(fc[fp.C_DEP]), int(fc[fp.C_NDEPS])
        self._departed_in_loop(dep_i[:k].tolist())
        self.departures = list(zip(dep_t[k:nd].tolist(), dep_i[k:nd].tolist()))  # (in order: a heap)

    def _controller_arrays(self, ans_cap: int) -> tuple:
        """The controller's arrays the compiled loop runs it on (a compiled controller's own, with room until the
        horizon; else arrays it does not read)."""
        c = self.controller
        if c is not None and c.compiled:
            c.room(self.now, self.horizon + 2 * c.interval_s, 4 * ans_cap)
            return c.cs, c.cp, c.lat, c.w, c.tr
        if self._no_controller is None or self._no_controller[2].size < 2 * ans_cap + 1:
            self._no_controller = (np.zeros(ck.N_CS), np.zeros(ck.N_CP), np.zeros(2 * ans_cap + 1),
                                   np.zeros(2 * ans_cap + 1), np.zeros((0, ck.N_TR)))
        return self._no_controller

    def _departed_in_loop(self, who: list[int]) -> None:
        """The books of the departures the compiled loop took (sessions ``who``): what it does not keep itself."""
        for i in who:
            if self.state[i] != ENDED or self.s_end_reason[i]:  # it had ended already: passed over
                continue
            self.s_end_reason[i] = EndReason.DEPARTED
            self.loop_departures += 1
            self._forget_request(i)

    def _compiled_start(self, now: float) -> tuple[np.ndarray, float, int] | None:
        """Whether the compiled loop may start after the turn at ``now``: (the live sessions, where it must stop
        at the latest, the arrivals it may take are those before this one), or None."""
        m = self.model
        if (self.gate.queue or self._answers or self.stalled or not isinstance(m, EngineModel)
                or (self.sees_starvation and m.cnt[serving.E_WQ])):  # (vLLM's own loop re-prefills what it preempts)
            return None
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        run = live[self.state[live] == RUNNING]
        if live.size == 0 or run.size + len(self.waiting) != live.size:  # nobody prefilling
            return None
        if len(self.silent_pending) > 4 * live.size:  # frames owed behind a late one: copied in and out each call
            return None
        st = self.started[run]
        if (self.slot[run[st]] < 0).any():
            return None
        t_next = self._next_event_time(departures=False, arrivals=not self.arrivals_in_loop)
        na_end = self.next_arrival
        if self.arrivals_in_loop:  # it takes the next arrivals, up to a bound: room for them is made per call
            na_end = min(len(self.arrival), na_end + self.SPAN_ARRIVALS)
            if na_end < len(self.arrival):
                t_next = min(t_next, float(self.arrival[na_end]))
        if t_next <= now:
            return None
        return live, t_next, na_end

    def _compiled_config(self, now: float, sess: np.ndarray, t_next: float, n_max: int, na_end: int):
        """The compiled loop's constants (``iconf``, ``fconf``, the step model's coefficients), its counters
        (``istate``) and the jitter draws, as :mod:`metronome.sim.fastpath` indexes them (the engine's state is the
        engine model's own arrays; ``sess``: the sessions the loop may see)."""
        from metronome.sim import fastpath as fp

        assert (fp.WAITING_STATE, fp.PREFILL_STATE, fp.R_STATE, fp.ENDED_STATE, fp.REFUSED_STATE) == (
            WAITING, PREFILL, RUNNING, ENDED, REFUSED)
        iconf = np.zeros(fp.N_ICONF, dtype=np.int64)
        iconf[[fp.I_NIN, fp.I_NOUT, fp.I_MAXSTEPS, fp.I_PROMPT, fp.I_ANSCAP, fp.I_FLO, fp.I_LOCKSTEP, fp.I_SEES,
               fp.I_NA_END, fp.I_CTL, fp.I_TPF]] = [
            self.n_in, self.n_out, n_max, self.prompt, 2 * max(self.model.status_a.size, sess.size) + 64,
            self.serving_frame, int(self.lockstep), int(self.sees_starvation), na_end,
            fp.CTL_COMPILED if self.controller is not None and self.controller.compiled else fp.CTL_AFTER, self.tpf]
        kind, *draws, weights = self._span_draws(n_max, sess, t_next)
        pause = math.inf if not self.pause_every_s else (math.floor(now / self.pause_every_s) + 1) * self.pause_every_s
        fconf = np.array([self.P, float(serving.phase_offset_s(1, self.P)), self.deadline, t_next, self.first_s, _EPS,
                          float(kind), self.horizon, *weights, pause])
        coef = np.array(self.lat.coefficients, dtype=np.float64)
        istate = np.array([self.serving_frame, self.peak_used, 0, 0, 0, int(self.idle), len(self.silent_pending), 0,
                           int(self.preempted_last)], dtype=np.int64)
        return iconf, fconf, coef, istate, draws

    def _compiled_records(self, n: int, rows_end: int) -> None:
        """The compiled loop wrote ``n`` steps and frame rows up to ``rows_end`` into the tables' storage: they are
        the tables' now (and a controller deciding in Python is told the rows)."""
        from metronome.sim import fastpath as fp

        st, fr = self.steps, self.frames
        if n:
            self.stalled = False
            s0 = st.rows
            st.store("free_blocks")[s0:s0 + n] = self.num_blocks - st.store("resident_blocks")[s0:s0 + n]
            st.commit(s0 + n)
        r0 = fr.rows
        fr.commit(rows_end)
        if rows_end > r0 and self.controller is not None and not self.controller.compiled:  # (else the loop told it)
            self.controller.observe_many(fr.column("done_s")[r0:], fr.column("latency_s")[r0:],
                                         fr.column("frames")[r0:], fr.column("silent")[r0:],
                                         in_flight=fr.block[fp.R_INFLIGHT, r0:rows_end])

    # ------------------------------------------------------------------------------------------ results
    def release(self) -> None:
        """The run is over and its tables taken (:meth:`Table.frame`: views of their storage): the engine lets go
        of them. SimPy's process keeps the engine in a reference cycle until the collector runs, and a run's
        storage held that long slowed the next run in the same process by up to half (measured: the realistic
        hour's loop, 0.62 s after a collection and 0.97 s without one)."""
        self.steps = self.frames = None

    def finalize(self):
        """Close the books at the horizon: sessions still in the engine end with reason 'horizon'."""
        live = np.flatnonzero(((self.state >= WAITING) & (self.state <= RUNNING)) | (self.state == QUEUED))
        self.s_ended[live] = min(self.now, self.horizon)
        self.s_end_reason[live] = EndReason.HORIZON
