"""The simulated engine: vLLM v1's scheduler (:class:`metronome.serving.EngineModel`) behind the serving front end
the live driver runs, on a simulated clock.

The serving rules are not written here: who runs in a step, what a session needs to be admitted, who is
preempted and where it goes, the length limit and the deadlock rule all come from :mod:`metronome.serving`,
which ``tests/live/test_scheduler_differential.py`` checks step by step against vLLM's own scheduler. This
module keeps the time: the frame clock, step latencies from the calibration, the front end's turns
(as :class:`metronome.probe.driver.Driver` takes them live) and the records.

A frame's life:

1. **The frame clock.** Frame ``f`` ticks at ``f·P`` (``P`` = the calibration's frame period) for every
   session (aligned phases, today's only regime); a session that arrives at ``t`` streams from frame
   ``serving.join_frame(t, P)``.
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
5. **Silence.** A waiting or re-prefilling session's frame is answered empty, on time, when every running
   session's frame of the same tick is done; its input joins the history.

**Fast-forward.** When every session streams in lockstep with nothing waiting, queued, prefilling or behind,
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
                 check_invariants: bool = False, seed: int = 0, engine_model=EngineModel):
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
        self.lat = calibration.step_latency
        self.first_s = float(self.lat.frame_first_s)  # extra time of a step in which a frame starts
        self.jitter = bool(self.lat.jitter)
        self.seed = int(seed)
        self.draws = self.lat.draws(self.seed, self.P)
        self.n_steps = 0

        order = np.argsort(arrival_s, kind="stable")
        self.arrival = np.asarray(arrival_s, dtype=np.float64)[order]
        self.duration = np.asarray(duration_s, dtype=np.float64)[order]
        M = len(self.arrival)
        self.state = np.zeros(M, dtype=np.int8)
        self.rid = np.full(M, -1, dtype=np.int64)  # the session's engine request (-1: none)
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
        self.fresh: set[int] = set()  # requests with a frame submitted and not yet scheduled (first-step term)
        self.silent_pending: list[tuple[int, int, int]] = []  # (session, frame, tokens got) answered with the lockstep
        self._answers: dict[int, list[int]] = {}  # frame -> [frames, silent, silent_preempted, tokens] at one moment
        self.t_sat: float | None = None
        self.peak_used = 0
        self.steps = step_table()
        self.frames = frame_table()
        self.fast_steps = 0  # steps computed in numpy spans (the summary does not depend on it)
        self.slow_steps = 0  # steps taken one SimPy event each

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

    def _new_rid(self, i: int) -> int:
        r = self.next_rid
        self.next_rid += 1
        self.rid[i] = r
        self.by_rid[r] = i
        return r

    def _drop_rid(self, i: int) -> None:
        r = int(self.rid[i])
        if r >= 0:
            if self.model.status(r) is not None:
                self.model.abort(r)
            self.by_rid.pop(r, None)
            self.fresh.discard(r)
            self.rid[i] = -1

    # ------------------------------------------------------------------------------------------- the loop
    def start(self):
        return self.env.process(self._run())

    def _run(self):
        env = self.env
        while self.now < self.horizon:
            self._turn(self.now)
            if self.fast_forward:
                span = self._fast_span(self.now)
                if span is not None:
                    yield env.timeout(max(0.0, span - env.now))
                    self.now = span
                    continue
            if self.model.has_work() and not self.stalled:
                start = self.now
                lat, rec = self._step(start)
                end = start + lat
                yield env.timeout(max(0.0, end - env.now))
                self.now = end
                self._after_step(start, lat, rec)
            else:
                self.preempted_last = False  # no step ran: the next admission is not "right after" one
                until = min(self._next_tick(), self._next_event_time())
                if until <= self.now:  # nothing left to wait for (a stalled engine with no event): give up time
                    until = self.horizon
                yield env.timeout(max(0.0, until - env.now))
                self.now = until

    def _next_tick(self) -> float:
        live = (self.state >= WAITING) & (self.state <= RUNNING)
        if not live.any():
            return math.inf
        return float(self.next_frame[live].min()) * self.P

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
        self.next_frame[i] = serving.join_frame(t_enter, self.P)
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
                self.running_since[i] = self.next_frame[i] * self.P
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
        self.model.add(self._new_rid(i), prompt, 1)  # its one sampled token starts the next chunk
        self.state[i] = PREFILL
        self.work_step[i] = self.model.steps

    def _ticks(self, now: float) -> None:
        """Frames that came due: running sessions queue them (and submit one); the others hear silence."""
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        due = live[self.next_frame[live] * self.P <= now + _EPS]
        for i in due.tolist():
            while self.next_frame[i] * self.P <= now + _EPS:
                f = int(self.next_frame[i])
                self.next_frame[i] += 1
                tick = f * self.P
                if self.state[i] == RUNNING and tick >= self.running_since[i] - _EPS:
                    self.backlog[i] += 1
                else:
                    self.pending_in[i] += self.n_in
                    self.silent_pending.append((i, f, 0))
        submit = live[(self.state[live] == RUNNING) & (self.inflight[live] < 0) & (self.backlog[live] > 0)]
        for i in submit.tolist():
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
        r = int(self.rid[i])
        if r < 0:
            r = self._new_rid(i)
            self.model.add(r, int(self.hist[i]) + chunk, self.n_out)
        else:
            self.model.append(r, chunk, self.n_out)
        self.fresh.add(r)
        self.hist[i] += chunk
        self.started[i] = True
        self.pending_in[i] = 0
        self.last_tok[i] = False
        self.backlog[i] -= 1
        self.inflight[i], self.inflight_tok[i] = f, 0
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
            if f * self.P + self.deadline <= now + _EPS:
                self._answer(i, f, tok)
        self.inflight[i], self.backlog[i] = -1, 0
        self.state[i] = ENDED
        self.s_ended[i], self.s_end_reason[i] = now, reason

    # -------------------------------------------------------------------------------------------- answers
    def _answer(self, i: int, f: int, tokens: int) -> None:
        """Count session ``i``'s frame ``f`` as answered now with ``tokens`` tokens (0: silent)."""
        a = self._answers.setdefault(f, [0, 0, 0, 0, []])
        silent = serving.frame_is_silent(tokens)
        a[0] += 1
        a[1] += silent
        a[2] += silent and not np.isnan(self.s_admitted[i])
        a[3] += tokens
        a[4].append(i)
        self.s_frames[i] += 1
        self.s_silent[i] += silent

    def _answer_silent(self, now: float) -> None:
        """Silent frames are answered once every running session's frame of the same tick is done."""
        if not self.silent_pending:
            return
        run = np.flatnonzero(self.state == RUNNING)
        owed = np.where(self.inflight[run] >= 0, self.inflight[run],
                        np.where(self.backlog[run] > 0, self.next_frame[run] - self.backlog[run], np.iinfo(np.int64).max))
        unfinished = int(owed.min()) if owed.size else np.iinfo(np.int64).max
        keep = []
        for i, f, tok in self.silent_pending:
            if f < unfinished:
                self._answer(i, f, tok)
            else:
                keep.append((i, f, tok))
        self.silent_pending = keep

    def _flush_answers(self, now: float) -> tuple[int, int]:
        """Record the frames answered at ``now`` (one row per tick) and feed the controller; returns (frames, silent)."""
        if not self._answers:
            return 0, 0
        tot = sil = 0
        for f in sorted(self._answers):
            n, silent, silent_pre, tokens, who = self._answers[f]
            latency = now - f * self.P
            late = latency > self.deadline + _EPS
            if late:
                self.s_late[who] += 1
            self.frames.add(frame=f, tick_s=f * self.P, done_s=now, latency_s=latency, frames=n, silent=silent,
                            silent_preempted=silent_pre, late=n if late else 0, tokens=tokens)
            if self.controller is not None:
                self.controller.advance(now, self._in_flight())
                self.controller.observe(now, latency, frames=n, silent=silent)
            tot += n
            sil += silent
        self._answers = {}
        return tot, sil

    # ----------------------------------------------------------------------------------------- one step
    def _step(self, now: float):
        rec = self.model.step()
        sched = list(rec.scheduled)
        first = any(r in self.fresh for r in sched)
        self.fresh.difference_update(sched)
        ctx = int(sum(int(self.policy.resident_tokens(self.model.computed(r))) for r in sched))
        lat = float(self.lat.step_s(len(sched), ctx, rec.new_tokens))
        if first:
            lat += self.first_s
        if self.jitter:
            lat *= float(self.draws.ratio(self.n_steps, self._frame_at(now))[0])
        self.n_steps += 1
        self.slow_steps += 1
        self._ctx = ctx
        return lat, rec

    def _frame_at(self, t):
        """The frame a step starting at ``t`` is taken on (for the jitter's per-frame parts)."""
        return np.floor(np.asarray(t) / self.P + 1e-9).astype(np.int64)

    def _after_step(self, start: float, lat: float, rec) -> None:
        now = self.now
        step_no = self.model.steps - 1
        tokens_out = 0
        for r in rec.sampled:
            i = self.by_rid.get(r)
            if i is None:
                continue
            if self.state[i] == PREFILL:  # the re-prefill is done: the sampled token starts the next chunk
                self.state[i] = RUNNING
                self.last_tok[i] = True
                self.running_since[i] = now
                continue
            if self.inflight[i] < 0:
                continue
            tokens_out += 1
            self.inflight_tok[i] += 1
            self.s_tokens[i] += 1
            if self.inflight_tok[i] >= self.n_out:
                self.hist[i] += self.n_out - 1  # vLLM keeps every sampled token but the last
                self.last_tok[i] = True
                self._answer(i, int(self.inflight[i]), int(self.inflight_tok[i]))
                self.inflight[i] = -1
        used = self.model.used
        victims = self._preempt_after_step(rec, step_no)
        if victims and self.t_sat is None:
            self.t_sat = start
        self.preempted_last = bool(victims)
        if not rec.scheduled and not victims:
            self.stalled = True
        self.peak_used = max(self.peak_used, used)
        self._answer_silent(now)
        done, silent = self._flush_answers(now)
        self.steps.add(t_s=start, step_s=lat, batch=len(rec.scheduled), new_tokens=rec.new_tokens,
                       context_tokens=self._ctx, resident_blocks=used, free_blocks=self.num_blocks - used,
                       tokens_out=tokens_out, frames_done=done, silent_frames=silent, preemptions=len(victims),
                       running=int((self.state == RUNNING).sum()), waiting=len(self.waiting))
        if self.check_invariants:
            self.assert_invariants()

    def _preempt_after_step(self, rec, step_no: int) -> list[int]:
        """The engine's own preemptions, then the deadlock rule's victims: each loses its place."""
        out = []
        for r in rec.preempted:
            i = self.by_rid.get(r)
            if i is not None:
                self._preempt(i)
                out.append(i)
        starved = []
        scheduled = rec.scheduled
        m = self.model
        for i in np.flatnonzero((self.state == RUNNING) | (self.state == PREFILL)).tolist():
            r = int(self.rid[i])
            if (r >= 0 and self.work_step[i] <= step_no and (self.inflight[i] >= 0 or self.state[i] == PREFILL)
                    and r not in scheduled and m.status(r) in (serving.WAITING, serving.PREEMPTED)):
                starved.append((i, serving.blocks_to_resume(self.policy, m.tokens_of(r), m.computed(r),
                                                            m.blocks_of(r), self.cap_blocks)))
        in_engine = [(i, int(self.admit_seq[i]), m.blocks_of(int(self.rid[i])))
                     for i in np.flatnonzero(self.rid >= 0).tolist()]
        stalled = not scheduled and m.has_work()
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
            self.silent_pending.append((i, int(self.inflight[i]), tok))
            self.inflight[i] = -1
        elif self.last_tok[i]:
            self.hist[i] += 1
        self.last_tok[i] = False
        first_q = int(self.next_frame[i] - self.backlog[i])
        for f in range(first_q, int(self.next_frame[i])):  # due frames never submitted: silent
            self.pending_in[i] += self.n_in
            self.silent_pending.append((i, f, 0))
        self.backlog[i] = 0
        self.state[i] = WAITING
        self.s_preempt[i] += 1
        self.waiting.appendleft(i)
        self.stalled = False

    def assert_invariants(self):
        """Pool accounting: used = Σ held, 0 <= used <= pool, every session within its policy's bound."""
        self.model.check()
        if self.cap_blocks is not None:
            held = max((self.model.blocks_of(int(r)) for r in self.rid if r >= 0), default=0)
            assert held <= self.cap_blocks, f"a session holds {held} > {self.cap_blocks} blocks (the admission cap)"
        outside = (self.state != PREFILL) & (self.state != RUNNING)
        assert not (self.rid[outside] >= 0).any(), "a session outside the engine holds a request"

    # ---------------------------------------------------------------------------------- the fast-forward
    def _fast_span(self, now: float) -> float | None:
        """Whole frames of a steady lockstep computed at once; returns the time the span ends, or None.

        Preconditions: every session is running and past its first frame, with nothing waiting at the front
        end, in the gate's queue or silently, and the last step did not preempt; and either every session is
        paused between frames before the same next tick, or every session has just submitted the same frame
        (due now) and none has been scheduled yet. The span stops before the first frame whose resume or
        decode would not fit, that would reach the length limit, or whose steps would start at or after the
        next event."""
        if self.waiting or self.gate.queue or self.silent_pending or self.preempted_last or self._answers:
            return None
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        if live.size == 0 or (self.state[live] != RUNNING).any() or not self.started[live].all():
            return None
        if (self.backlog[live] > 0).any() or (self.pending_in[live] > 0).any():
            return None
        m = self.model
        if len(m.kv_holding) != live.size or m.waiting or m.running:
            return None
        reqs = [m.requests.get(int(r)) for r in self.rid[live]]
        if any(q is None for q in reqs):
            return None
        chunk = 1 + self.n_in
        submitted = bool(self.inflight[live[0]] >= 0)
        if submitted:  # every session's frame f0 is in the engine, not yet scheduled
            f0 = int(self.inflight[live[0]])
            if ((self.inflight[live] != f0).any() or (self.inflight_tok[live] > 0).any()
                    or any(q.status != serving.WAITING or q.rid not in self.fresh for q in reqs)):
                return None
        else:  # every session paused, its next frame not yet due
            f0 = int(self.next_frame[live[0]])
            if ((self.inflight[live] >= 0).any() or (self.next_frame[live] != f0).any()
                    or any(q.status != serving.PAUSED for q in reqs)):
                return None
        # engine order: the kv-holding queue (sessions resume in it; the running order follows)
        order = np.array([self.by_rid[q.rid] for q in m.kv_holding], dtype=np.int64)
        N = order.size
        lim = self.limits
        if N * chunk > lim.max_num_batched_tokens or N > lim.max_num_seqs:
            return None
        pol, bs = self.policy, self.policy.block_size
        comp = np.array([m.requests[int(self.rid[i])].computed for i in order], dtype=np.int64)
        held = np.array([m.requests[int(self.rid[i])].held for i in order], dtype=np.int64)
        hist0 = self.hist[order] - (chunk if submitted else 0)  # history before frame f0's chunk
        free = m.free_blocks()
        K_max = max(1, self.max_span_steps // self.n_out)
        t_next = self._next_event_time()
        wm = np.full(N, lim.watermark_blocks, dtype=np.int64)
        wm[0] = 0  # the first resumed request finds nothing running
        rows = []  # per step: start, latency, tokens, ctx, used
        t = now
        K = 0
        comp_k, held_k, free_k = comp, held, free
        for k in range(K_max):
            if not np.all(hist0 + k * self.tpf + chunk + self.n_out < self.maxlen):
                break
            c, h, fr = comp_k.copy(), held_k.copy(), free_k
            steps_k = []
            ok = True
            for j in range(self.n_out):
                tok = chunk if j == 0 else 1
                slots = cdiv(c, bs)
                res = pol.resident_blocks(c)
                freed = h - res
                need = cdiv(c + tok, bs) - slots
                before = fr + np.concatenate([[0], np.cumsum(freed - need)[:-1]])  # free before each request
                if j == 0:
                    full = np.minimum(cdiv(c + tok, bs), self.cap_blocks) if self.cap_blocks is not None \
                        else cdiv(c + tok, bs)
                    gate = np.maximum(full - slots, 0)
                    if np.any(gate + wm > before) or np.any(need + wm > before + freed):
                        ok = False
                        break
                elif np.any(need > before + freed):
                    ok = False
                    break
                h = res + need
                fr = fr + int(freed.sum()) - int(need.sum())
                c = c + tok
                steps_k.append((tok, c.copy(), int(self.num_blocks - fr)))
            if not ok:
                break
            # timing: the frame's first step starts at its tick or when the engine frees up (a frame already
            # submitted starts now)
            tick = (f0 + k) * self.P
            start = now if (submitted and k == 0) else (tick if t < tick else t)
            if start >= t_next:
                break
            times = []
            tt = start
            for j, (tok, c_after, used) in enumerate(steps_k):
                if tt >= t_next:
                    break
                ctx = int(pol.resident_tokens(c_after).sum())
                lat = float(self.lat.step_s(N, ctx, N * tok))
                if j == 0:
                    lat += self.first_s
                if self.jitter:
                    lat *= float(self.draws.ratio(self.n_steps + len(rows) + j, self._frame_at(tt))[0])
                times.append((tt, lat, N * tok, ctx, used))
                tt = tt + lat
            if len(times) < self.n_out:
                break
            rows.extend(times)
            t = tt
            comp_k, held_k, free_k = c, h, fr
            K += 1
        if K == 0:
            return None
        S = len(rows)
        starts = np.array([r[0] for r in rows])
        lats = np.array([r[1] for r in rows])
        done_idx = np.arange(self.n_out - 1, S, self.n_out)
        ends_done = starts[done_idx] + lats[done_idx]
        fr_ = f0 + np.arange(K)
        n_frames = N
        self.steps.add(t_s=starts, step_s=lats, batch=N, new_tokens=np.array([r[2] for r in rows]),
                       context_tokens=np.array([r[3] for r in rows]), resident_blocks=np.array([r[4] for r in rows]),
                       free_blocks=self.num_blocks - np.array([r[4] for r in rows]), tokens_out=N,
                       frames_done=np.where(np.isin(np.arange(S), done_idx), n_frames, 0), silent_frames=0,
                       preemptions=0, running=N, waiting=0)
        for k in range(K):
            done = float(ends_done[k])
            latency = done - fr_[k] * self.P
            late = latency > self.deadline + _EPS
            self.frames.add(frame=int(fr_[k]), tick_s=fr_[k] * self.P, done_s=done, latency_s=latency,
                            frames=N, silent=0, silent_preempted=0, late=N if late else 0, tokens=N * self.n_out)
            if late:
                self.s_late[order] += 1
            if self.controller is not None:
                self.controller.advance(done, self._in_flight())
                self.controller.observe(done, latency, frames=N, silent=0)
        self.peak_used = max(self.peak_used, int(max(r[4] for r in rows)))
        # the engine's state after the span: every request paused after K frames
        for idx, i in enumerate(order.tolist()):
            q = m.requests[int(self.rid[i])]
            q.computed = int(comp_k[idx])
            q.num_tokens = q.computed + 1
            q.slots = int(cdiv(q.computed, bs))
            q.held = int(held_k[idx])
            q.out = self.n_out
            q.status = serving.PAUSED
        m.used = self.num_blocks - free_k
        m.steps += S
        self.n_steps += S
        self.fast_steps += S
        self.hist[order] = hist0 + K * self.tpf
        self.last_tok[order] = True
        self.inflight[order] = -1
        self.next_frame[order] = f0 + K
        if submitted:
            self.fresh.difference_update(int(r) for r in self.rid[order])
        self.s_tokens[order] += K * self.n_out
        self.s_frames[order] += K
        if self.check_invariants:
            self.assert_invariants()
        return float(ends_done[-1])

    # ------------------------------------------------------------------------------------------ results
    def finalize(self):
        """Close the books at the horizon: sessions still in the engine end with reason 'horizon'."""
        live = np.flatnonzero(((self.state >= WAITING) & (self.state <= RUNNING)) | (self.state == QUEUED))
        self.s_ended[live] = min(self.now, self.horizon)
        self.s_end_reason[live] = EndReason.HORIZON
