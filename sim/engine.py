"""The simulated engine: one SimPy process that runs step by step, like vLLM v1's continuous batching.

The model, in the order a frame lives through it:

1. **The frame clock.** Frame ``f`` ticks at ``f·P`` for every session (``P`` = the calibration's frame
   period); a session that arrives at ``t`` streams from frame ``ceil(t/P)``. Each frame appends
   ``in`` input tokens and asks for ``out`` output tokens. Serving it takes ``out`` engine steps: the
   first computes ``in + 1`` positions and emits a token, each later one computes 1 and emits 1.
2. **Who runs.** Running sessions are served in lockstep: step ``j`` of frame ``f`` batches every
   running session. Admitted sessions with history to (re)compute are *prefilling*: they share each
   step's leftover token budget (``max_num_batched_tokens``) in admission order and produce nothing
   until caught up.
3. **Blocks.** A session holds ``policy.resident_blocks(computed_tokens)`` blocks (the core KV policy).
   When a step needs more blocks than are free, the most recently admitted running session is
   preempted by recompute, as vLLM v1 does: all its blocks are freed, it goes back to the head of the
   waiting queue and must re-prefill its whole history when readmitted. Waiting sessions are admitted
   in order (stopping at the first that does not fit, counting its whole history) before a step, unless
   the previous step preempted.
4. **Silence.** A frame is answered when its lockstep finishes (or at once if nobody runs). Sessions
   that got no token in it (waiting, prefilling) get an **empty frame, delivered on time** with the
   same latency as everyone else: the failure a latency metric cannot see. Their input is still
   appended to their history.
5. **Length.** A session whose next frame would pass ``max_model_len`` is rebased under a bounded
   policy (it restarts as a request of S sink + W window tokens, prefilled in that step), and finished
   under unbounded KV (``end_reason = "length"``).

Arrivals and departures are SimPy events that wake the engine; the engine applies them at its next
step boundary (as vLLM's scheduler picks up added and aborted requests). Between such events, and
while nothing is being prefilled, admitted or preempted, the lockstep is periodic; the engine then
computes a whole span of steps with numpy (``fast_forward``) instead of one step per SimPy event. The
span reproduces exactly the steps the one-step path would take; tests compare the two.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np
import simpy

from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy, admit_fcfs

from metronome.sim.recorder import frame_table, step_table

NOT_ARRIVED, WAITING, PREFILL, RUNNING, ENDED, REFUSED, QUEUED = 0, 1, 2, 3, 4, 5, 6
END_REASONS = {0: "", 1: "departed", 2: "length", 3: "horizon", 4: "refused", 5: "queue_timeout"}
_EPS = 1e-12


class SimEngine:
    def __init__(self, env: simpy.Environment, calibration: Calibration, policy: KVPolicy,
                 arrival_s: np.ndarray, duration_s: np.ndarray, horizon_s: float, deadline_s: float,
                 controller=None, fast_forward: bool = True, max_span_steps: int = 256,
                 check_invariants: bool = False, seed: int = 0):
        self.env, self.cal, self.policy = env, calibration, policy
        self.horizon = float(horizon_s)
        self.deadline = float(deadline_s)
        self.controller = controller
        self.fast_forward = fast_forward
        self.max_span_steps = max_span_steps
        self.check_invariants = check_invariants

        st = calibration.stream
        self.P = st.frame_period_s
        self.n_in, self.n_out = st.input_tokens_per_frame, st.output_tokens_per_frame
        self.tpf = st.kv_tokens_per_frame
        self.maxlen = calibration.model.max_model_len_tokens
        self.num_blocks = calibration.engine.usable_blocks  # the pool requests can hold
        self.watermark = calibration.engine.watermark_blocks
        self.budget = calibration.engine.max_num_batched_tokens
        self.lat = calibration.step_latency
        self.first_s = float(self.lat.frame_first_s)  # extra time of a frame's first step (after the idle gap)
        self.jitter = bool(self.lat.jitter)  # step i, on frame f, takes the model's time x draws.ratio(i, f)
        self.seed = int(seed)
        self.draws = self.lat.draws(self.seed, self.P)
        self.n_steps = 0  # steps taken: the index of the next step's jitter draw
        self.rebase_tokens = policy.rebase_tokens()

        order = np.argsort(arrival_s, kind="stable")
        self.arrival = np.asarray(arrival_s, dtype=np.float64)[order]
        self.duration = np.asarray(duration_s, dtype=np.float64)[order]
        M = len(self.arrival)
        self.join_frame = np.ceil(self.arrival / self.P - 1e-9).astype(np.int64)
        self.state = np.zeros(M, dtype=np.int8)
        self.hist = np.full(M, st.prompt_tokens, dtype=np.int64)  # tokens the request holds
        self.computed = np.zeros(M, dtype=np.int64)  # tokens whose KV is computed
        self.admit_seq = np.full(M, -1, dtype=np.int64)
        self.next_frame = np.zeros(M, dtype=np.int64)
        self.frame_tokens = np.zeros(M, dtype=np.int64)  # tokens delivered in the current frame
        self.ever_admitted = np.zeros(M, dtype=bool)
        # per-session results
        self.s_frames = np.zeros(M, dtype=np.int64)
        self.s_silent = np.zeros(M, dtype=np.int64)
        self.s_late = np.zeros(M, dtype=np.int64)
        self.s_tokens = np.zeros(M, dtype=np.int64)
        self.s_preempt = np.zeros(M, dtype=np.int64)
        self.s_rebase = np.zeros(M, dtype=np.int64)
        self.s_admitted = np.full(M, np.nan)
        self.s_ended = np.full(M, np.nan)
        self.s_end_reason = np.zeros(M, dtype=np.int8)

        self.waiting: deque[int] = deque()
        self.queued: deque[int] = deque()  # refused by the admission controller, waiting outside the engine
        self.next_arrival = 0
        self.departures: list[tuple[float, int]] = []
        self.seq = 0
        self.f, self.j = 0, 0
        self.used = 0
        self.last_preempted = False
        self.t_sat: float | None = None
        self.peak_used = 0
        self.steps = step_table()
        self.frames = frame_table()
        self._active_cache: np.ndarray | None = None
        self._wake = env.event()
        self.fast_steps = 0  # steps computed in numpy spans (the summary does not depend on it)
        self.slow_steps = 0  # steps taken one SimPy event each

    # ---------------------------------------------------------------------------------------- events
    def start(self):
        self.env.process(self._arrivals())
        return self.env.process(self._run())

    def _arrivals(self):
        """Arrivals are SimPy events; each wakes the engine, which admits at its next step boundary."""
        for t in np.unique(self.arrival):
            if t >= self.horizon:
                break
            yield self.env.timeout(max(0.0, t - self.env.now))
            self._poke()

    def _schedule_departure(self, i: int, t: float):
        heapq.heappush(self.departures, (t, i))
        if t < self.horizon:
            ev = self.env.timeout(max(0.0, t - self.env.now))
            ev.callbacks.append(lambda _ev: self._poke())

    def _poke(self):
        if not self._wake.triggered:
            self._wake.succeed()

    def _next_event_time(self) -> float:
        t = self.horizon
        if self.next_arrival < len(self.arrival):
            t = min(t, self.arrival[self.next_arrival])
        if self.departures:
            t = min(t, self.departures[0][0])
        if self.queued and self.controller is not None:
            t = min(t, self.env.now + max(self.controller_poll_s(), 1e-6))
        return t

    def controller_poll_s(self) -> float:
        return float(getattr(self.controller, "interval_s", 1.0))

    # --------------------------------------------------------------------------------- bookkeeping
    @property
    def active(self) -> np.ndarray:
        """Sessions inside the engine (waiting, prefilling or running)."""
        if self._active_cache is None:
            self._active_cache = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        return self._active_cache

    def _set_state(self, idx, s):
        self.state[idx] = s
        self._active_cache = None

    def _in_flight(self) -> int:
        return int(self.active.size)

    def _drain(self, now: float):
        """Apply arrivals, departures and the admission controller's queue up to ``now``."""
        while self.departures and self.departures[0][0] <= now:
            t, i = heapq.heappop(self.departures)
            if self.state[i] in (WAITING, PREFILL, RUNNING):
                self._end(i, t, 1)
        while self.next_arrival < len(self.arrival) and self.arrival[self.next_arrival] <= now:
            i = self.next_arrival
            self.next_arrival += 1
            if self.arrival[i] >= self.horizon:
                continue
            self._offer(i, now)
        if self.queued:
            self._retry_queue(now)

    def _offer(self, i: int, now: float):
        ctl = self.controller
        if ctl is None or ctl.may_admit(now, self._in_flight()):
            self._enter(i, now)
        elif getattr(ctl, "on_refuse", "reject") == "queue":
            self._set_state(i, QUEUED)
            self.queued.append(i)
        else:
            self._set_state(i, REFUSED)
            self.s_end_reason[i] = 4
            self.s_ended[i] = now

    def _retry_queue(self, now: float):
        timeout = float(getattr(self.controller, "queue_timeout_s", math.inf))
        while self.queued:
            i = self.queued[0]
            if now - self.arrival[i] > timeout:
                self.queued.popleft()
                self._set_state(i, REFUSED)
                self.s_end_reason[i], self.s_ended[i] = 5, now
                continue
            if not self.controller.may_admit(now, self._in_flight()):
                break
            self.queued.popleft()
            self._enter(i, now)

    def _enter(self, i: int, now: float):
        """The session's request reaches the engine's waiting queue; it streams from the next frame."""
        self._set_state(i, WAITING)
        self.join_frame[i] = max(self.join_frame[i], int(math.ceil(now / self.P - 1e-9)))
        self.waiting.append(i)
        self._schedule_departure(i, now + self.duration[i])

    def _end(self, i: int, t: float, reason: int):
        if self.state[i] == WAITING:
            self.waiting.remove(i)
        self.used -= int(self.policy.resident_blocks(self.computed[i]))
        self.computed[i] = 0
        self._set_state(i, ENDED)
        self.s_ended[i], self.s_end_reason[i] = t, reason

    def _admission_need(self, i: int) -> int:
        """Blocks the waiting session needs to be admitted: its whole history plus its next frame."""
        return int(self.policy.resident_blocks(self.hist[i] + self.n_in + 1))

    def _admit(self, now: float):
        """FCFS: admit waiting sessions while the head fits (vLLM checks the full sequence)."""
        free = self.num_blocks - self.used - self.watermark
        for i in admit_fcfs(self.waiting, self._admission_need, free):
            self.admit_seq[i] = self.seq
            self.seq += 1
            if not self.ever_admitted[i]:
                self.ever_admitted[i] = True
                self.s_admitted[i] = now
            if self.hist[i] > self.computed[i]:
                self._set_state(i, PREFILL)
            else:
                self._join_lockstep(i)

    def _join_lockstep(self, i: int):
        self._set_state(i, RUNNING)
        self.next_frame[i] = max(self.join_frame[i], self.f if self.j == 0 else self.f + 1)
        self.frame_tokens[i] = 0

    # ----------------------------------------------------------------------------------- the loop
    def _run(self):
        env = self.env
        while env.now < self.horizon:
            now = env.now
            self._drain(now)
            if not self.last_preempted:
                self._admit(now)
            act = self.active
            st = self.state[act]
            running = act[st == RUNNING]
            part = running[self.next_frame[running] == self.f]
            prefill = act[st == PREFILL]
            tick = self.f * self.P
            frame_due = self.j > 0 or tick <= now + _EPS
            if frame_due and part.size == 0:
                # nobody is left in this frame's lockstep: answer it now (silent for all who got nothing)
                self._complete_frame(now, part)
                self.f, self.j = self.f + 1, 0
                continue
            if not frame_due and prefill.size == 0:
                wake = self._wake = env.event() if self._wake.triggered else self._wake
                until = min(tick, self._next_event_time())
                yield env.timeout(max(0.0, until - now)) | wake
                continue
            if (self.fast_forward and frame_due and prefill.size == 0 and part.size == running.size
                    and not self.last_preempted):
                span = self._fast_span(now, part)
                if span is not None:
                    yield env.timeout(span)
                    continue
            lat = self._step(now, part if frame_due else np.zeros(0, dtype=np.int64), prefill)
            yield env.timeout(lat)
            self._finish_step(env.now, part if frame_due else None, prefill)

    # ------------------------------------------------------------------------------ one slow step
    def _step(self, now: float, part: np.ndarray, prefill: np.ndarray) -> float:
        """Schedule one step at ``now``: allocate blocks (preempting if the pool is dry); return its latency."""
        pol = self.policy
        first = self.j == 0
        # a frame that would pass max_model_len: rebase (bounded) or finish the session (unbounded)
        extra = np.zeros(part.size, dtype=np.int64)
        if part.size and first:
            over = self.computed[part] + self.tpf > self.maxlen
            if over.any():
                if self.rebase_tokens is None:
                    for i in part[over]:
                        self._end(int(i), now, 2)
                    part, extra = part[~over], extra[~over]
                else:
                    ids = part[over]
                    self.used -= int(pol.resident_blocks(self.computed[ids]).sum())
                    self.computed[ids] = self.hist[ids] = 0
                    self.s_rebase[ids] += 1
                    extra[over] = self.rebase_tokens
        tok_part = (self.n_in + 1 if first else 1) + extra
        left = max(0, self.budget - int(tok_part.sum()))
        prefill = prefill[np.argsort(self.admit_seq[prefill], kind="stable")]
        gap = self.hist[prefill] - self.computed[prefill]
        chunk = np.minimum(gap, np.maximum(left - np.concatenate([[0], np.cumsum(gap)[:-1]]), 0))
        sched = np.concatenate([part, prefill[chunk > 0]])
        tokens = np.concatenate([tok_part, chunk[chunk > 0]])
        old = self.computed[sched]
        new = old + tokens
        need = pol.resident_blocks(new) - pol.resident_blocks(old)
        free = self.num_blocks - self.used
        preempted = 0
        keep = np.ones(sched.size, dtype=bool)
        if int(need.sum()) > free:
            if self.t_sat is None:
                self.t_sat = now
            victims_pool = self.active[(self.state[self.active] == RUNNING) | (self.state[self.active] == PREFILL)]
            victims_pool = victims_pool[np.argsort(-self.admit_seq[victims_pool], kind="stable")]
            total = int(need.sum())
            for v in victims_pool:
                if total <= free:
                    break
                v = int(v)
                free += int(pol.resident_blocks(self.computed[v]))
                self.used -= int(pol.resident_blocks(self.computed[v]))
                pos = np.flatnonzero(sched == v)
                if pos.size:
                    keep[pos[0]] = False
                    total -= int(need[pos[0]])
                self._preempt(v)
                preempted += 1
        self.last_preempted = preempted > 0
        sched, tokens, new, need = sched[keep], tokens[keep], new[keep], need[keep]
        self.computed[sched] = new
        self.used += int(need.sum())
        self.peak_used = max(self.peak_used, self.used)
        ctx = int(pol.resident_tokens(new).sum())
        lat = float(self.lat.step_s(sched.size, ctx, int(tokens.sum())))
        if first and part.size:
            lat += self.first_s
        if self.jitter:
            lat *= float(self.draws.ratio(self.n_steps, self.f)[0])
        self.n_steps += 1
        self._pending = dict(t=now, lat=lat, batch=sched.size, new=int(tokens.sum()), ctx=ctx, pre=preempted)
        self.slow_steps += 1
        return lat

    def _preempt(self, v: int):
        self.computed[v] = 0
        self.s_preempt[v] += 1
        self._set_state(v, WAITING)
        self.waiting.appendleft(v)  # vLLM prepends the victim to the waiting queue

    def _finish_step(self, t_end: float, part: np.ndarray | None, prefill: np.ndarray):
        p = self._pending
        frames_done = silent = 0
        tokens_out = 0
        if part is not None and part.size:
            part = part[self.state[part] == RUNNING]  # some may have been preempted or ended
            tokens_out = part.size
            self.frame_tokens[part] += 1
            self.s_tokens[part] += 1
            self.hist[part] = np.maximum(self.hist[part], self.computed[part])
        if part is not None:
            self.j += 1
            if self.j == self.n_out:
                frames_done, silent = self._complete_frame(t_end, part)
                self.j = 0
                self.f += 1
        caught = prefill[(self.state[prefill] == PREFILL) & (self.computed[prefill] >= self.hist[prefill])]
        for i in caught:
            self._join_lockstep(int(i))
        self.steps.add(t_s=p["t"], step_s=p["lat"], batch=p["batch"], new_tokens=p["new"], context_tokens=p["ctx"],
                       resident_blocks=self.used, free_blocks=self.num_blocks - self.used, tokens_out=tokens_out,
                       frames_done=frames_done, silent_frames=silent, preemptions=p["pre"],
                       running=int((self.state == RUNNING).sum()), waiting=len(self.waiting))
        if self.check_invariants:
            self.assert_invariants()

    def assert_invariants(self):
        """Pool accounting: used = Σ blocks held, 0 ≤ used ≤ pool, every session within its policy's bound."""
        held = self.policy.resident_blocks(self.computed)
        assert (held >= 0).all(), "negative block count"
        assert int(held.sum()) == self.used, f"pool accounting drifted: {int(held.sum())} held vs {self.used} used"
        assert 0 <= self.used <= self.num_blocks, f"used {self.used} outside [0, {self.num_blocks}]"
        outside = (self.state != PREFILL) & (self.state != RUNNING)
        assert not held[outside].any(), "a session outside the engine holds blocks"
        bound = self.policy.max_resident_blocks
        if bound is not None:
            assert int(held.max(initial=0)) <= bound, f"a session holds {int(held.max())} > {bound} blocks"

    def _complete_frame(self, done: float, part: np.ndarray) -> tuple[int, int]:
        """Answer frame ``f`` for every session streaming it; the ones that got no token hear silence."""
        f = self.f
        act = self.active
        arrived = act[self.join_frame[act] <= f]
        tok = self.frame_tokens[arrived]
        silent_mask = tok == 0
        latency = done - f * self.P
        late = latency > self.deadline + _EPS
        n, n_silent = arrived.size, int(silent_mask.sum())
        self.s_frames[arrived] += 1
        self.s_silent[arrived[silent_mask]] += 1
        if late:
            self.s_late[arrived] += 1
        # waiting and prefilling sessions still send their input: it joins their history
        behind = arrived[self.state[arrived] != RUNNING]
        self.hist[behind] += self.n_in
        self.frame_tokens[arrived] = 0
        self.next_frame[part] = f + 1
        n_pre = int((silent_mask & self.ever_admitted[arrived]).sum())
        self.frames.add(frame=f, tick_s=f * self.P, done_s=done, latency_s=latency, frames=n, silent=n_silent,
                        silent_preempted=n_pre, late=n if late else 0, tokens=int(tok.sum()))
        if self.controller is not None and n:
            self.controller.advance(done, self._in_flight())
            self.controller.observe(done, latency, frames=n, silent=n_silent)
        return n, n_silent

    # ------------------------------------------------------------------------- the fast-forward span
    def _fast_span(self, now: float, part: np.ndarray) -> float | None:
        """Run the lockstep for as many steps as nothing changes; return the simulated time it took.

        Preconditions (checked by the caller): no prefill, every running session is in the lockstep,
        the previous step did not preempt. The span stops before the first step that would preempt,
        admit a waiting session, rebase or finish a session, or start at/after the next event."""
        pol = self.policy
        waiting = np.fromiter(self.waiting, dtype=np.int64, count=len(self.waiting))
        if waiting.size and int(self.join_frame[waiting].max()) > self.f:
            return None  # a waiting session starts streaming inside the span: take it step by step
        S = self.max_span_steps
        s_idx = np.arange(S)
        jj = (self.j + s_idx) % self.n_out
        k = (self.j + s_idx) // self.n_out  # frame offset of each step
        tok = np.where(jj == 0, self.n_in + 1, 1)
        delta = np.cumsum(tok)  # tokens each lockstep session has added after step s
        n0 = self.computed[part]
        # length: the first step of a frame that would pass max_model_len must go the slow way
        frame_start_ok = (n0.max() + (delta - tok) + self.tpf <= self.maxlen) | (jj != 0)
        # count sessions per residue class: residency is periodic in n (KVPolicy.canonical)
        n_c, b_off, t_off = pol.canonical(n0)
        reps, inv = np.unique(n_c, return_inverse=True)
        weight = np.bincount(inv, minlength=reps.size)
        n_after = reps[:, None] + delta[None, :]
        used = weight @ pol.resident_blocks(n_after) + int(b_off.sum())
        ok = frame_start_ok & (used <= self.num_blocks)
        if waiting.size:
            head = int(waiting[0])
            free_before = self.num_blocks - np.concatenate([[self.used], used[:-1]]) - self.watermark
            head_need = pol.resident_blocks(self.hist[head] + self.n_in * k + self.n_in + 1)
            ok &= head_need > free_before
        bad = np.flatnonzero(~ok)
        S = int(bad[0]) if bad.size else S
        if S == 0:
            return None
        ctx = weight @ pol.resident_tokens(n_after[:, :S]) + int(t_off.sum())
        lat = self.lat.step_s(part.size, ctx, part.size * tok[:S]) + self.first_s * (jj[:S] == 0)
        if self.jitter:
            lat = lat * self.draws.ratio(self.n_steps + np.arange(S), self.f + k[:S])
        # timing: a frame's first step starts at its tick or when the engine frees up
        t_next = self._next_event_time()
        starts = np.empty(S)
        t = now
        ticks = (self.f + k[:S]) * self.P
        n_ok = S
        for s in range(S):
            if jj[s] == 0 and t < ticks[s]:
                t = float(ticks[s])
            if t >= t_next:
                n_ok = s
                break
            starts[s] = t
            t = t + float(lat[s])
        S = n_ok
        self.n_steps += S
        if S == 0:
            return None
        starts, lat, ctx = starts[:S], lat[:S], ctx[:S]
        ends = starts + lat
        used, jj, k, tok = used[:S], jj[:S], k[:S], tok[:S]
        done = jj == self.n_out - 1
        n_done = int(done.sum())
        # frames answered inside the span
        n_frames = part.size + waiting.size
        n_silent = waiting.size
        n_pre = int(self.ever_admitted[waiting].sum()) if waiting.size else 0
        if n_done:
            fr = self.f + k[done]
            done_t = ends[done]
            latency = done_t - fr * self.P
            late = latency > self.deadline + _EPS
            self.frames.add(frame=fr, tick_s=fr * self.P, done_s=done_t, latency_s=latency, frames=n_frames,
                            silent=n_silent, silent_preempted=n_pre, late=np.where(late, n_frames, 0),
                            tokens=part.size * self.n_out)
            n_late = int(late.sum())
            self.s_frames[part] += n_done
            self.s_late[part] += n_late
            if waiting.size:
                self.s_frames[waiting] += n_done
                self.s_silent[waiting] += n_done
                self.s_late[waiting] += n_late
                self.hist[waiting] += self.n_in * n_done
            if self.controller is not None and n_frames:
                in_flight = self._in_flight()
                for dt_, lt_ in zip(done_t.tolist(), latency.tolist()):
                    self.controller.advance(dt_, in_flight)
                    self.controller.observe(dt_, lt_, frames=n_frames, silent=n_silent)
        self.steps.add(t_s=starts, step_s=lat, batch=part.size, new_tokens=part.size * tok, context_tokens=ctx,
                       resident_blocks=used, free_blocks=self.num_blocks - used, tokens_out=part.size,
                       frames_done=np.where(done, n_frames, 0), silent_frames=np.where(done, n_silent, 0),
                       preemptions=0, running=part.size, waiting=waiting.size)
        added = int(delta[S - 1])
        self.computed[part] += added
        self.hist[part] = self.computed[part]
        self.s_tokens[part] += S
        self.used = int(used[-1])
        self.peak_used = max(self.peak_used, int(used.max()))
        total = self.j + S
        self.f += total // self.n_out
        self.j = total % self.n_out
        self.next_frame[part] = self.f
        self.frame_tokens[part] = self.j
        self.fast_steps += S
        if self.check_invariants:
            self.assert_invariants()
        return float(ends[-1] - now)

    # ------------------------------------------------------------------------------------ results
    def finalize(self):
        """Close the books at the horizon: sessions still in the engine end with reason 'horizon'."""
        now = self.env.now
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING) | (self.state == QUEUED))
        self.s_ended[live] = min(now, self.horizon) if np.isfinite(self.horizon) else now
        self.s_end_reason[live] = 3
