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

**Fast-forward.** Under aligned phases, when every session streams in lockstep with nothing waiting, queued, prefilling or behind,
the next frames are computed a whole span at a time with numpy (:meth:`SimEngine._fast_span`): the same
allocations ``EngineModel`` would make (out-of-window frees at the computed count, the full-sequence gate at
each frame's resume, decode blocks), the same timings, jitter draws and records, one SimPy event per span.
The span stops before anything the step-by-step path would do differently (a failed allocation, the length
limit, the token budget, the next arrival, departure or controller poll); tests compare the two.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np
import simpy

from metronome import serving
from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy, cdiv
from metronome.serving import EndReason, EngineLimits, EngineModel

from metronome.sim.recorder import frame_table, step_table

# front-end states of a session
NOT_ARRIVED, WAITING, PREFILL, RUNNING, ENDED, REFUSED, QUEUED = 0, 1, 2, 3, 4, 5, 6
_EPS = 1e-12


class SimEngine:
    def __init__(self, env: simpy.Environment, calibration: Calibration, policy: KVPolicy,
                 arrival_s: np.ndarray, duration_s: np.ndarray, horizon_s: float, deadline_s: float,
                 controller=None, fast_forward: bool = True, max_span_steps: int = 256,
                 check_invariants: bool = False, seed: int = 0, engine_model=EngineModel,
                 phase_slot: np.ndarray | None = None, phases: str = "aligned", loop: str = "driver"):
        self.env, self.cal, self.policy = env, calibration, policy
        self.horizon = float(horizon_s)
        self.deadline = float(deadline_s)
        self.controller = controller
        self.gate = serving.AdmissionGate(controller)
        self.max_span_steps = max_span_steps
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
        self.state = np.zeros(M, dtype=np.int8)
        self.rid = np.full(M, -1, dtype=np.int64)  # the session's engine request (-1: none)
        self.slot = np.full(M, -1, dtype=np.int64)  # its request's slot in the engine model
        self.sess_of_slot = np.full(64, -1, dtype=np.int64)
        self.fresh_slot = np.zeros(64, dtype=bool)  # a frame submitted and not yet scheduled (first-step term)
        self.hist = np.zeros(M, dtype=np.int64)  # tokens of its history (what a readmission re-prefills)
        self.last_tok = np.zeros(M, dtype=bool)  # a sampled token not yet in the engine (re-fed next frame)
        self.pending_in = np.zeros(M, dtype=np.int64)  # input of silent frames, not yet in the engine
        self.started = np.zeros(M, dtype=bool)  # its first frame (with the prompt) went to the engine
        self.next_frame = np.zeros(M, dtype=np.int64)  # the next tick it has not yet seen
        self.backlog = np.zeros(M, dtype=np.int64)  # due frames not yet submitted (one frame in flight at a time)
        self.inflight = np.full(M, -1, dtype=np.int64)  # the frame in the engine (-1: none)
        self.inflight_tok = np.zeros(M, dtype=np.int64)
        self.admit_seq = np.full(M, -1, dtype=np.int64)
        self.work_step = np.zeros(M, dtype=np.int64)  # step count when its work was handed to the engine
        self.running_since = np.zeros(M)
        # per-session results
        self.s_frames = np.zeros(M, dtype=np.int64)
        self.s_silent = np.zeros(M, dtype=np.int64)
        self.s_late = np.zeros(M, dtype=np.int64)
        self.s_tokens = np.zeros(M, dtype=np.int64)
        self.s_preempt = np.zeros(M, dtype=np.int64)
        self.s_rebase = np.zeros(M, dtype=np.int64)
        self.s_admitted = np.full(M, np.nan)
        self.s_ended = np.full(M, np.nan)
        self.s_end_reason = np.full(M, "", dtype=object)

        self.waiting: deque[int] = deque()  # the front end's FCFS queue (admitted by the gate, not in the engine)
        self.by_rid: dict[int, int] = {}
        self.next_rid = 0
        self.next_arrival = 0
        self.departures: list[tuple[float, int]] = []
        self.seq = 0
        self.now = 0.0
        self.preempted_last = False  # the last step preempted: admit nobody in the next turn
        self.stalled = False  # the last step scheduled nothing and freed nothing: wait for an event
        self._ctx = 0  # the last step's context tokens (its row is written after it ends)
        self.serving_frame = 0  # the latest frame handed to the engine: the frame a step is taken on (jitter)
        self.silent_pending: list[tuple[int, int, int]] = []  # (session, frame, tokens got) answered with the lockstep
        self._answers: dict[int, list[int]] = {}  # frame -> [frames, silent, silent_preempted, tokens] at one moment
        self.t_sat: float | None = None
        self.peak_used = 0
        self.steps = step_table()
        self.frames = frame_table()
        self.fast_steps = 0  # steps computed in numpy spans (the summary does not depend on it)
        self.slow_steps = 0  # steps taken one SimPy event each
        self._buffers = None  # the compiled loop's record buffers, reused from call to call

    # ------------------------------------------------------------------------------------------ helpers
    def _in_flight(self) -> int:
        """Sessions the front end has let in (waiting for blocks, prefilling or running)."""
        return int(((self.state >= WAITING) & (self.state <= RUNNING)).sum())

    def _next_event_time(self) -> float:
        t = self.horizon
        if self.next_arrival < len(self.arrival):
            t = min(t, self.arrival[self.next_arrival])
        if self.departures:
            t = min(t, self.departures[0][0])
        if self.gate.queue:
            t = min(t, self.now + self.gate.poll_s)
        return t

    def _add(self, i: int, prompt_tokens: int, max_tokens: int) -> int:
        """A new engine request for session ``i``: its whole prompt, ``max_tokens`` to sample."""
        r = self.next_rid
        self.next_rid += 1
        slot = self.model.add(r, prompt_tokens, max_tokens)
        while slot >= self.sess_of_slot.size:
            self.sess_of_slot = np.concatenate([self.sess_of_slot, np.full(self.sess_of_slot.size, -1)])
            self.fresh_slot = np.concatenate([self.fresh_slot, np.zeros(self.fresh_slot.size, dtype=bool)])
        self.rid[i], self.slot[i] = r, slot
        self.by_rid[r] = i
        self.sess_of_slot[slot] = i
        return slot

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
        while self.now < self.horizon:
            if not turned:
                self._turn(self.now)
                if self.fast_forward:
                    span = self._fast_span(self.now)
                    if span is None:
                        span = self._compiled_span(self.now)
                    if span is not None:
                        end, turned = span
                        yield env.timeout(max(0.0, end - env.now))
                        self.now = end
                        continue
            turned = False
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
                queued = (self.state[many] == RUNNING) & (tick(nf, P, ph) >= self.running_since[many] - _EPS)
                q = many[queued]
                self.backlog[q] += n_due[queued]
                self.next_frame[q] += n_due[queued]
                for i in many[~queued].tolist():
                    while tick(self.next_frame[i], P, self.phase[i]) <= now + _EPS:
                        self._tick_one(np.array([i]))
            self._tick_one(due[one])
        submit = live[(self.state[live] == RUNNING) & (self.inflight[live] < 0) & (self.backlog[live] > 0)]
        if submit.size:
            self._submit_many(submit, now)

    def _tick_one(self, idx: np.ndarray) -> None:
        """Frame ``next_frame`` of sessions ``idx`` is due: a running session's is queued, the others' is silent."""
        f = self.next_frame[idx].copy()
        self.next_frame[idx] += 1
        run = (self.state[idx] == RUNNING) & (serving.frame_tick(f, self.P, self.phase[idx]) >= self.running_since[idx] - _EPS)
        self.backlog[idx[run]] += 1
        quiet = idx[~run]
        if quiet.size:
            self.pending_in[quiet] += self.n_in
            self._owe(quiet, f[~run], np.zeros(quiet.size, dtype=np.int64))

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
            kept = min(int(self.hist[i]), self.keep_tokens)
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
        owed = [(f, tok) for (j, f, tok) in self.silent_pending if j == i]
        self.silent_pending = [x for x in self.silent_pending if x[0] != i]
        if self.inflight[i] >= 0:
            owed.append((int(self.inflight[i]), int(self.inflight_tok[i])))
        first_q = int(self.next_frame[i] - self.backlog[i])
        owed += [(f, 0) for f in range(first_q, int(self.next_frame[i]))]
        for f, tok in owed:
            if serving.frame_tick(f, self.P, self.phase[i]) + self.deadline <= now + _EPS:
                self._answer(i, f, tok)
        self.inflight[i], self.backlog[i] = -1, 0
        self.state[i] = ENDED
        self.s_ended[i], self.s_end_reason[i] = now, reason

    # -------------------------------------------------------------------------------------------- answers
    def _answer(self, i: int, f: int, tokens: int) -> None:
        self._answer_many(np.array([i]), np.array([f]), np.array([tokens]))

    def _answer_many(self, idx: np.ndarray, f: np.ndarray, tokens: np.ndarray) -> None:
        """Count sessions ``idx``'s frames ``f`` as answered now with ``tokens`` tokens each (0: silent)."""
        silent = serving.frame_is_silent(tokens)
        self.s_frames[idx] += 1
        self.s_silent[idx[silent]] += 1
        pre = silent & ~np.isnan(self.s_admitted[idx])
        key = serving.tick_key(f, self.pslot[idx])  # one row per tick: a frame index and a phase
        for k in np.unique(key).tolist():
            m = key == k
            a = self._answers.setdefault(k, [0, 0, 0, 0, []])
            a[0] += int(m.sum())
            a[1] += int(silent[m].sum())
            a[2] += int(pre[m].sum())
            a[3] += int(tokens[m].sum())
            a[4].append(idx[m])

    def _owe(self, idx: np.ndarray, f: np.ndarray, tokens: np.ndarray) -> None:
        """Frames of sessions without a place (waiting, re-prefilling, just preempted), answered short or empty.
        In lockstep they are answered with their tick's running frames (:meth:`_answer_silent`); a front end
        serving clients on their own clocks answers them at once."""
        if self.lockstep:
            self.silent_pending.extend(zip(idx.tolist(), f.tolist(), tokens.tolist()))
        elif idx.size:
            self._answer_many(idx, f, tokens)

    def _answer_silent(self, now: float) -> None:
        """Lockstep: silent frames are answered once every running session's frame of their tick is done."""
        if not self.silent_pending:
            return
        # lockstep only (every phase 0): a tick is its frame index
        run = np.flatnonzero(self.state == RUNNING)
        owed = np.where(self.inflight[run] >= 0, self.inflight[run],
                        np.where(self.backlog[run] > 0, self.next_frame[run] - self.backlog[run], np.iinfo(np.int64).max))
        unfinished = int(owed.min()) if owed.size else np.iinfo(np.int64).max
        pend = np.array(self.silent_pending, dtype=np.int64).reshape(-1, 3)
        now_ = pend[:, 1] < unfinished
        if now_.any():
            self._answer_many(pend[now_, 0], pend[now_, 1], pend[now_, 2])
            self.silent_pending = [tuple(x) for x in pend[~now_].tolist()]

    def _flush_answers(self, now: float) -> tuple[int, int]:
        """Record the frames answered at ``now`` (one row per tick) and feed the controller; returns (frames, silent)."""
        if not self._answers:
            return 0, 0
        keys = sorted(self._answers)
        rows = np.array([self._answers[k][:4] for k in keys], dtype=np.int64).reshape(-1, 4)
        f, slot = np.divmod(np.array(keys, dtype=np.int64), serving.PHASE_SLOTS)
        tick = serving.frame_tick(f, self.P, serving.phase_offset_s(slot, self.P))
        latency = now - tick
        late = latency > self.deadline + _EPS
        for j in np.flatnonzero(late).tolist():
            self.s_late[np.concatenate(self._answers[keys[j]][4])] += 1
        n, silent = rows[:, 0], rows[:, 1]
        self.frames.add(frame=f, tick_s=tick, done_s=now, latency_s=latency, frames=n, silent=silent,
                        silent_preempted=rows[:, 2], late=np.where(late, n, 0), tokens=rows[:, 3])
        if self.controller is not None:
            for lt, nn, sl in zip(latency.tolist(), n.tolist(), silent.tolist()):
                self.controller.advance(now, self._in_flight())
                self.controller.observe(now, lt, frames=nn, silent=sl)
        self._answers = {}
        return int(n.sum()), int(silent.sum())

    # ----------------------------------------------------------------------------------------- one step
    def _step(self, now: float):
        rec = self.model.step()
        S = rec.slots
        first = self.idle and bool(self.fresh_slot[S].any())
        self.idle = False
        self.fresh_slot[S] = False
        ctx = int(self.policy.resident_tokens(self.model.computed_of(S)).sum())
        lat = float(self.lat.step_s(int(S.size), ctx, rec.new_tokens))
        if first:
            lat += self.first_s
        if self.jitter:
            lat *= float(self.draws.ratio(self.n_steps, self.serving_frame)[0])
        self.n_steps += 1
        self.slow_steps += 1
        self._ctx = ctx
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
                       context_tokens=self._ctx, resident_blocks=used, free_blocks=self.num_blocks - used,
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
        starved = [(i, serving.blocks_to_resume(self.policy, m.tokens_of(int(self.rid[i])), m.computed(int(self.rid[i])),
                                                m.blocks_of(int(self.rid[i])), self.cap_blocks)) for i in cand.tolist()]
        inside = np.flatnonzero(self.slot >= 0)
        in_engine = list(zip(inside.tolist(), self.admit_seq[inside].tolist(), m.held_of(self.slot[inside]).tolist()))
        for i in serving.deadlock_victims(starved, in_engine, m.free_blocks(), stalled):
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
        outside = (self.state != PREFILL) & (self.state != RUNNING)
        assert not (self.rid[outside] >= 0).any(), "a session outside the engine holds a request"

    # ----------------------------------------------------------------------------------- the compiled loop
    COMPILED_STEPS = 8192  # steps per call of the compiled loop (its record buffers are sized by it)

    def _compiled_span(self, now: float) -> tuple[float, bool] | None:
        """Turns and steps of a steady span in :func:`metronome.sim.fastpath.run_span` (compiled), from just
        after the turn at ``now``; returns (where it stopped, whether the turn there is taken), or None when
        it could not take a single step (the step-by-step path goes on)."""
        m = self.model
        if (self.lockstep or self.gate.queue or self.preempted_last or self._answers or self.stalled
                or m.waiting or not isinstance(m, EngineModel)):
            return None
        if self.jitter and (self.draws.rho or self.draws.rho_f):
            return None  # correlated jitter needs each step's frame as it happens: step by step
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        run = live[self.state[live] == RUNNING]
        if live.size == 0 or run.size + len(self.waiting) != live.size:  # nobody prefilling
            return None
        st = self.started[run]
        if (self.slot[run[st]] < 0).any() or (self.pending_in[run] > 0).any():
            return None
        t_next = self._next_event_time()
        fresh = run[~st]  # admitted, first frame not yet due: its tick is where the span stops
        if fresh.size:
            t_next = min(t_next, float(serving.frame_tick(self.next_frame[fresh], self.P, self.phase[fresh]).min()))
        if t_next <= now:
            return None
        from metronome.sim import fastpath as fp

        assert fp.WAITING_STATE == WAITING

        lim, pol, lat = self.limits, self.policy, self.lat
        nslots = m.status_a.size
        n_max = self.COMPILED_STEPS
        ans_cap = 2 * max(nslots, live.size) + 64
        iconf = np.zeros(20, dtype=np.int64)
        iconf[[fp.I_BS, fp.I_BOUNDED, fp.I_SINKB, fp.I_WINDOW, fp.I_NB, fp.I_MAXSEQS, fp.I_BUDGET, fp.I_MAXLEN,
               fp.I_WM, fp.I_THR, fp.I_CAP, fp.I_NIN, fp.I_NOUT, fp.I_MAXSTEPS, fp.I_SLOTS, fp.I_NRUNNING,
               fp.I_NWAITING, fp.I_HEAD, fp.I_PROMPT, fp.I_ANSCAP]] = [
            pol.block_size, int(pol.bounded), pol.sink_blocks if pol.bounded else 0,
            pol.window_tokens if pol.bounded else 0, lim.num_blocks, lim.max_num_seqs,
            lim.max_num_batched_tokens, self.maxlen, lim.watermark_blocks, lim.long_prefill_token_threshold,
            -1 if self.cap_blocks is None else self.cap_blocks, self.n_in, self.n_out, n_max, nslots,
            int((self.state == RUNNING).sum()), len(self.waiting), self.waiting[0] if self.waiting else -1,
            self.prompt, ans_cap]
        fconf = np.array([self.P, float(serving.phase_offset_s(1, self.P)), self.deadline, t_next, self.first_s, _EPS,
                          1.0 if self.jitter else 0.0, self.horizon])
        coef = np.array(lat.coefficients, dtype=np.float64)
        jit = (np.asarray(self.draws.ratio(self.n_steps + np.arange(n_max), 0), dtype=np.float64)
               if self.jitter else np.zeros(0))
        istate = np.array([m.used, m.n_paused, m.steps, self.serving_frame, self.peak_used, len(m.running),
                           len(m.kv_holding), 0, 0, 0, int(self.idle)], dtype=np.int64)
        fstate = np.array([now, 0.0])
        n_rows = 4 * n_max + 4 * ans_cap
        buf = self._buffers
        if buf is None or buf["run"].size < nslots or buf["fr_f"].size < n_rows:  # kept between calls
            nsl, nr = max(nslots, 2 * (buf["run"].size if buf else 0)), max(n_rows, 2 * (buf["fr_f"].size if buf else 0))
            buf = self._buffers = {
                "run": np.zeros(nsl, dtype=np.int64), "kvh": np.zeros(nsl, dtype=np.int64),
                "st_t": np.zeros(n_max), "st_lat": np.zeros(n_max), "st_i": np.zeros((n_max, 8), dtype=np.int64),
                "fr_f": np.zeros(nr, dtype=np.int64), "fr_tick": np.zeros(nr), "fr_done": np.zeros(nr),
                "fr_lat": np.zeros(nr), "fr_i": np.zeros((nr, 5), dtype=np.int64)}
        run_arr, kvh_arr = buf["run"], buf["kvh"]
        run_arr[:len(m.running)] = m.running
        kvh_arr[:len(m.kv_holding)] = list(m.kv_holding)
        st_t, st_lat, st_i = buf["st_t"], buf["st_lat"], buf["st_i"]
        fr_f, fr_tick, fr_done, fr_lat, fr_i = buf["fr_f"], buf["fr_tick"], buf["fr_done"], buf["fr_lat"], buf["fr_i"]
        fp.run_span(iconf, fconf, coef, istate, fstate, live, self.state, self.phase, self.pslot, self.slot,
                    self.next_frame, self.backlog, self.inflight, self.inflight_tok, self.hist, self.last_tok,
                    self.pending_in, self.work_step, self.running_since, self.started, ~np.isnan(self.s_admitted),
                    self.s_tokens, self.s_frames, self.s_silent, self.s_late,
                    m.status_a, m.computed_a, m.ntok_a, m.slots_a, m.held_a, m.out_a, m.maxtok_a, self.fresh_slot,
                    self.sess_of_slot, run_arr, kvh_arr, jit, st_t, st_lat, st_i, fr_f, fr_tick, fr_done, fr_lat, fr_i)
        used, n_paused, msteps, sframe, peak, run_len, kvh_len, n, rows, turned, idle = istate.tolist()
        self.idle = bool(idle)
        end = float(fstate[0])
        if n == 0 and end == now and turned != fp.PAST_HORIZON:
            return None
        m.used, m.n_paused, m.steps = used, n_paused, msteps
        m.running = run_arr[:run_len].tolist()
        m.kv_holding = deque(kvh_arr[:kvh_len].tolist())
        self.serving_frame, self.peak_used = sframe, peak
        self.n_steps += n
        self.fast_steps += n
        if n:
            self.stalled = False
            self.preempted_last = False
            si = st_i[:n].copy()
            self.steps.add(t_s=st_t[:n].copy(), step_s=st_lat[:n].copy(), batch=si[:, 0], new_tokens=si[:, 1],
                           context_tokens=si[:, 2], resident_blocks=si[:, 3], free_blocks=self.num_blocks - si[:, 3],
                           tokens_out=si[:, 4], frames_done=si[:, 5], silent_frames=0, preemptions=0,
                           running=si[:, 6], waiting=si[:, 7])
        if rows:
            fi = fr_i[:rows].copy()
            self.frames.add(frame=fr_f[:rows].copy(), tick_s=fr_tick[:rows].copy(), done_s=fr_done[:rows].copy(),
                            latency_s=fr_lat[:rows].copy(), frames=fi[:, fp.R_FRAMES], silent=fi[:, fp.R_SILENT],
                            silent_preempted=fi[:, fp.R_SILENT_PRE], late=fi[:, fp.R_LATE], tokens=fi[:, fp.R_TOKENS])
            if self.controller is not None:
                self.controller.observe_many(fr_done[:rows], fr_lat[:rows], fi[:, fp.R_FRAMES], fi[:, fp.R_SILENT],
                                             in_flight=int(live.size))
        if self.check_invariants:
            self.assert_invariants()
        if turned == fp.PAST_HORIZON:  # its last step outlives the run: SimPy stops while it runs
            self.now = end
            return float(fstate[1]), False
        return end, turned == fp.TURN_TAKEN

    # ---------------------------------------------------------------------------------- the fast-forward
    def _fast_span(self, now: float) -> float | None:
        """Whole frames of a steady lockstep computed at once; returns (the time the span ends, False), or None.

        Preconditions: every running session is past its first frame; the others wait at the front end for
        blocks (their frames are silent); nothing is prefilling, in the gate's queue or owed from earlier
        ticks, and the last step did not preempt; and either every session is before the same next tick
        (running ones paused between frames), or every session has just had the same frame come due (running
        ones submitted it, none scheduled yet). The span stops before the first frame whose resume or decode
        would not fit, that would reach the length limit, in which the waiting head would be admitted, or
        whose steps would start at or after the next event."""
        m = self.model
        if not self.lockstep:
            return None
        if self.gate.queue or self.preempted_last or self._answers or self.stalled or m.running or m.waiting:
            return None
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        run = live[self.state[live] == RUNNING]
        wait = live[self.state[live] == WAITING]
        if run.size == 0 or run.size + wait.size != live.size or len(self.waiting) != wait.size:
            return None
        if not self.started[run].all() or (self.backlog[live] > 0).any() or (self.pending_in[run] > 0).any():
            return None
        if len(m.kv_holding) != run.size or (self.slot[run] < 0).any():
            return None
        status = m.status_a[self.slot[run]]
        chunk = 1 + self.n_in
        submitted = bool(self.inflight[run[0]] >= 0)
        if submitted:  # frame f0 came due: running sessions submitted it, waiting ones heard silence
            f0 = int(self.inflight[run[0]])
            if ((self.inflight[run] != f0).any() or (self.inflight_tok[run] > 0).any()
                    or (status != serving.EngineModel.WAITING_CODE).any() or not self.fresh_slot[self.slot[run]].all()
                    or (self.next_frame[wait] != f0 + 1).any() or len(self.silent_pending) != wait.size
                    or any(f != f0 or tok for _, f, tok in self.silent_pending)):
                return None
        else:  # every session before tick f0; running ones paused
            f0 = int(self.next_frame[run[0]])
            if ((self.inflight[run] >= 0).any() or (self.next_frame[live] != f0).any() or self.silent_pending
                    or (status != serving.EngineModel.PAUSED_CODE).any()):
                return None
        # engine order: the kv-holding queue (sessions resume in it; the running order follows)
        rslots = np.fromiter(m.kv_holding, dtype=np.int64, count=len(m.kv_holding))  # request slots, in order
        order = self.sess_of_slot[rslots]
        N, n_wait = order.size, int(wait.size)
        lim = self.limits
        if N * chunk > lim.max_num_batched_tokens or N > lim.max_num_seqs:
            return None
        pol, bs = self.policy, self.policy.block_size
        comp, held0 = m.computed_a[rslots], m.held_a[rslots]
        hist0 = self.hist[order] - (chunk if submitted else 0)  # history before frame f0's chunk
        K_max = max(1, self.max_span_steps // self.n_out)
        # no frame can start at or after the next event: at most the ticks before it (+1: one already due)
        t_next = self._next_event_time()
        K_max = min(K_max, max(1, int((t_next - f0 * self.P) / self.P) + 2))
        # frames that fit under max_model_len (serving.frame_fits for every session)
        fits = serving.frame_fits(int(hist0.max()) + np.arange(K_max) * self.tpf + chunk + self.n_out, self.maxlen)
        K_max = int(np.argmin(fits)) if not fits.all() else K_max
        if K_max == 0:
            return None
        S_max = K_max * self.n_out
        jj = np.arange(S_max) % self.n_out
        kk = np.arange(S_max) // self.n_out
        tok = np.where(jj == 0, chunk, 1)
        d_before = np.cumsum(tok) - tok  # tokens each session has added before step s
        # sessions in lockstep grow alike: count them per residue class (KVPolicy.canonical)
        n_c, b_off, t_off = pol.canonical(comp)
        reps, inv = np.unique(n_c, return_inverse=True)
        w = np.bincount(inv, minlength=reps.size)
        cb = reps[:, None] + d_before[None, :]  # computed before step s, per class
        res_b = w @ pol.resident_blocks(cb) + int(b_off.sum())  # Σ blocks left after the out-of-window frees
        need = w @ (cdiv(cb + tok, bs) - cdiv(cb, bs))  # Σ new blocks (EngineModel._allocate)
        held_b = np.concatenate([[int(held0.sum())], (res_b + need)[:-1]])  # Σ held before each step
        used_after = m.used + np.cumsum(need - (held_b - res_b))
        used_before = np.concatenate([[m.used], used_after[:-1]])
        # every request of the step gets its blocks whatever the order when Σ need (+ the watermark a resume
        # may ask) fits in what is free before the step's frees; otherwise the slow path decides
        ok = need + np.where(jj == 0, lim.watermark_blocks, 0) <= self.num_blocks - used_before
        if n_wait:
            # the turn before each step tries the front end's head (never right after a preemption, and none
            # happens in a span): it must not fit. Its input grows by one frame per tick the turn has seen.
            head = self.waiting[0]
            seen = np.where(jj == 0, kk - 1, kk) + (0 if submitted else 1)  # ticks past f0 - 1 (A) or f0 (B)
            tokens = self._request_tokens(head) + self.n_in * seen
            want = serving.admission_need_blocks(pol, tokens, self.cap_blocks)
            turn = np.ones(S_max, dtype=bool)
            if submitted:
                turn[0] = False  # this turn already tried it
            ok &= ~turn | (want > self.num_blocks - used_before)
        bad = np.flatnonzero(~ok)
        K_max = min(K_max, int(bad[0]) // self.n_out) if bad.size else K_max
        if K_max == 0:
            return None
        S_max = K_max * self.n_out
        ctx = w @ pol.resident_tokens(cb[:, :S_max] + tok[None, :S_max]) + int(t_off.sum())
        base_l = self.lat.step_s(N, ctx, N * tok[:S_max]).tolist()
        ratio_l = (self.draws.ratio(self.n_steps + np.arange(S_max), f0 + kk[:S_max]).tolist() if self.jitter
                   else None)
        # timing: a frame's first step starts at its tick (after the engine idled: it pays the first-step
        # term) or when the engine frees up (a frame already submitted starts now); a step must start before
        # the next event. The arithmetic is _step's, in its order.
        starts, lat_l = [], []
        t = now
        n_out, first_s = self.n_out, self.first_s
        K = 0
        for k in range(K_max):
            tick = (f0 + k) * self.P
            if submitted and k == 0:
                t0, idle = now, self.idle
            else:
                t0, idle = (tick, True) if t < tick else (t, False)
            tt, row, lrow = t0, [], []
            for j in range(n_out):
                if tt >= t_next:
                    break
                i = k * n_out + j
                lt = base_l[i]
                if j == 0 and idle:
                    lt += first_s
                if ratio_l is not None:
                    lt *= ratio_l[i]
                row.append(tt)
                lrow.append(lt)
                tt = tt + lt
            if len(row) < n_out:
                break
            starts.extend(row)
            lat_l.extend(lrow)
            t = tt
            K += 1
        if K == 0:
            return None
        S = K * n_out
        starts = np.array(starts)
        lats = np.array(lat_l)
        used = used_after[:S]
        ctx = ctx[:S]
        done_idx = np.arange(n_out - 1, S, n_out)
        ends_done = starts[done_idx] + lats[done_idx]
        fr_ = f0 + np.arange(K)
        # the sessions' state after K frames (per session: the class arithmetic again, exact)
        comp_k = comp + K * self.tpf
        tok_last = chunk if n_out == 1 else 1  # the span's last step: the frame's chunk, or one decode token
        held_k = pol.step_blocks(comp_k - tok_last, tok_last)
        free_k = self.num_blocks - int(used[-1])
        n_frames = N + n_wait
        is_done = np.isin(np.arange(S), done_idx)
        self.steps.add(t_s=starts, step_s=lats, batch=N, new_tokens=N * tok[:S],
                       context_tokens=ctx, resident_blocks=used, free_blocks=self.num_blocks - used, tokens_out=N,
                       frames_done=np.where(is_done, n_frames, 0), silent_frames=np.where(is_done, n_wait, 0),
                       preemptions=0, running=N, waiting=n_wait)
        latency = ends_done - fr_ * self.P
        late = latency > self.deadline + _EPS
        n_pre = int((~np.isnan(self.s_admitted[wait])).sum())
        self.frames.add(frame=fr_, tick_s=fr_ * self.P, done_s=ends_done, latency_s=latency, frames=n_frames,
                        silent=n_wait, silent_preempted=n_pre, late=np.where(late, n_frames, 0), tokens=N * self.n_out)
        self.s_late[live] += int(late.sum())
        if self.controller is not None:
            in_flight = self._in_flight()
            for done, lt in zip(ends_done.tolist(), latency.tolist()):
                self.controller.advance(done, in_flight)
                self.controller.observe(done, lt, frames=n_frames, silent=n_wait)
        if n_wait:  # their K frames were silent; the input of the ticks seen here joins their history
            self.pending_in[wait] += self.n_in * (K - (1 if submitted else 0))
            self.next_frame[wait] = f0 + K
            self.s_frames[wait] += K
            self.s_silent[wait] += K
            self.silent_pending = []
        self.peak_used = max(self.peak_used, int(used.max()))
        self.serving_frame = int(f0 + K - 1)
        self.idle = False
        # the engine's state after the span: every request paused after K frames
        m.computed_a[rslots] = comp_k
        m.ntok_a[rslots] = comp_k + 1
        m.slots_a[rslots] = cdiv(comp_k, bs)
        m.held_a[rslots] = held_k
        m.out_a[rslots] = self.n_out
        m.status_a[rslots] = serving.EngineModel.PAUSED_CODE
        if submitted:
            m.n_paused += N
        m.used = self.num_blocks - free_k
        m.steps += S
        self.n_steps += S
        self.fast_steps += S
        self.hist[order] = hist0 + K * self.tpf
        self.last_tok[order] = True
        self.inflight[order] = -1
        self.next_frame[order] = f0 + K
        self.fresh_slot[rslots] = False
        self.s_tokens[order] += K * self.n_out
        self.s_frames[order] += K
        if self.check_invariants:
            self.assert_invariants()
        return float(ends_done[-1]), False

    # ------------------------------------------------------------------------------------------ results
    def finalize(self):
        """Close the books at the horizon: sessions still in the engine end with reason 'horizon'."""
        live = np.flatnonzero(((self.state >= WAITING) & (self.state <= RUNNING)) | (self.state == QUEUED))
        self.s_ended[live] = min(self.now, self.horizon)
        self.s_end_reason[live] = EndReason.HORIZON
