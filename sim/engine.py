"""The simulated engine: the serving front end (:class:`metronome.front_end.FrontEnd`, the rules the live driver
serves by) over vLLM v1's scheduler (:class:`metronome.serving.EngineModel`), on a simulated clock.

The serving rules are not written here: the front end's are :mod:`metronome.front_end`'s, the engine's
:mod:`metronome.serving`'s, which ``tests/live/test_scheduler_differential.py`` checks step by step against vLLM's
own scheduler. This module keeps the time (SimPy's clock: the front end's turns at its events, one engine step
after another), each step's latency and the records.

**A step.** One step is ``EngineModel.step()``: running requests first (a dry pool preempts the newest), then the
waiting ones, none after a preemption. A step's latency is the calibration's step model (plus the first-step term
when a frame starts in it after the engine idled, times the step's jitter draw).

**Fast-forward.** When every session streams with nothing prefilling, queued at the gate or owed from a
preemption, turns and steps run in a compiled loop (:meth:`SimEngine._compiled_span`, :mod:`metronome.sim.fastpath`),
under either phase regime: the same rules, timings, jitter draws and records, one SimPy event per span. The engine
step there is the engine model's own (``serving.engine_step`` on its arrays). A step after which the front end must
act (a stall; with the driver's loop, a preemption or a request left waiting) is handed back once taken
(:meth:`FrontEnd._after_step` does the rest); the span stops before a turn the loop does not restate (the length
limit, an admission, the next arrival) and the step-by-step path takes it from there; tests compare the two bit for
bit. A span that ended at its own bounds (its steps, its rows) leaves the turn there to the next call, which takes
it first.
"""

from __future__ import annotations

import math
import numpy as np
import simpy

from metronome import control_kernel as ck
from metronome import serving
from metronome.calibration import Calibration
from metronome.front_end import (_EPS, ENDED, NOT_ARRIVED, PREFILL, QUEUED, REFUSED, RUNNING,  # noqa: F401
                                 WAITING, BookCounter, FrontEnd, FrontEndOptions, Roster)
from metronome.kv_policy import KVPolicy
from metronome.serving import EndReason, EngineLimits, EngineModel

from metronome.sim import recorder, span
from metronome.sim.recorder import frame_table, step_table


class SimEngine(FrontEnd):
    """The front end on SimPy's clock over the engine model, each step as long as the calibration says."""
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
    _no_controller: ck.ControllerArrays | None

    idle = BookCounter("idle", bool, "The engine waited (no step ran) since its last step.")

    def __init__(self, env: simpy.Environment, calibration: Calibration, policy: KVPolicy, roster: Roster,
                 horizon_s: float, deadline_s: float, controller=None, fast_forward: bool = True,
                 check_invariants: bool = False, seed: int = 0, engine_model=EngineModel,
                 options: FrontEndOptions = FrontEndOptions()):
        self.env, self.cal = env, calibration
        eng = calibration.engine
        limits = EngineLimits(num_blocks=eng.usable_blocks, max_num_seqs=eng.max_num_seqs,
                              max_num_batched_tokens=eng.max_num_batched_tokens,
                              max_model_len=calibration.model.max_model_len_tokens,
                              watermark_blocks=eng.watermark_blocks)
        # the scheduler: EngineModel, or anything with its interface (the differential test passes vLLM's own)
        super().__init__(engine_model(policy, limits), policy, limits, calibration.stream, roster, horizon_s,
                         deadline_s, controller=controller, options=options, check_invariants=check_invariants)
        # the fast path writes EngineModel's state directly
        self.fast_forward = fast_forward and isinstance(self.model, EngineModel)
        self.lat = calibration.step_latency_for(policy)  # the plugin's own costs when the policy runs through it
        # extra time of a step that starts a frame after the engine idled (the calibration's "first step after
        # the idle gap"): in lockstep a frame's first step; with independent phases only when nothing ran before
        self.first_s = float(self.lat.frame_first_s)
        self.Pq = float(serving.phase_offset_s(1, self.P))  # one phase slot of the run's clock
        self.idle = True
        self.jitter = bool(self.lat.jitter)
        self.seed = int(seed)
        self.draws = self.lat.draws(self.seed, self.P)
        self.n_steps = 0
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

    # ----------------------------------------------------------------------------------------------- the loop
    def start(self):
        return self.env.process(self._run())

    def _run(self):
        env = self.env
        turned = False  # the compiled loop already took the turn at self.now
        paused = False  # ... and paused after it: it goes on from there
        while self.now < self.horizon:
            if not turned or paused:
                span = None
                # the compiled loop takes the turn at self.now itself when it was running at its last call (a span
                # ends at its bounds as often as at an event); where it cannot, this path takes it and calls again
                if self.fast_forward and (turned or self._last_span):
                    span = self._compiled_span(self.now, turned)
                if span is None and not turned:
                    self._turn(self.now)
                    turned = True
                    if self.fast_forward:
                        span = self._compiled_span(self.now, True)
                if span is not None:
                    end, turned, paused, taken = span
                    yield env.timeout(max(0.0, end - env.now))
                    self.now = end
                    if taken is not None:  # the loop took a step whose aftermath is this path's
                        self._after_step(*taken)
                        turned = paused = False
                    continue
            turned = paused = False
            if self._steps_now():
                start = self.now
                lat, rec = self._step(start)
                end = start + lat
                yield env.timeout(max(0.0, end - env.now))
                self.now = end
                self._after_step(start, lat, rec)
            else:
                self.idle = True
                until = self._idle_until()
                if until <= self.now:  # nothing left to wait for (a stalled engine with no event): give up time
                    until = self.horizon
                yield env.timeout(max(0.0, until - env.now))
                self.now = until

    # ------------------------------------------------------------------------------------------------ records
    def _flush_answers(self, now: float) -> tuple[int, int]:
        """Record the frames answered at ``now`` (one row per tick) and feed the controller; returns (frames, silent).
        The rows are the compiled loop's own (:func:`metronome.sim.recorder.flush`): one statement of a row."""
        n = self.n_answers
        if not n:
            return 0, 0
        key, who, tok = (x[:n] for x in self.answers)
        self.n_answers = 0
        fr = self.frames
        fr.reserve(n)
        r0 = fr.rows
        # (the frame clock a row's tick is read back with: the run's, or each session's own)
        clock = recorder.Clock(self.P, self.Pq, _EPS, self.own_clocks)
        owners = recorder.Owners(self.state, self.s_admitted, self.s_late, self.P_of, self.phase, self.deadline_of)
        fr.commit(recorder.flush(now, n, recorder.Answers(key, who, tok, np.empty(n), serving.key_order_work(n)),
                                 owners, clock, recorder.FrameRows(*self._frame_stores()), r0, -1))  # (-1: told below)
        lat, nn, silent = (fr.column(c)[r0:] for c in ("latency_s", "frames", "silent"))
        if self.controller is not None:
            for lt, k, sl in zip(lat.tolist(), nn.tolist(), silent.tolist()):
                self.controller.advance(now, self._in_flight())
                self.controller.observe(now, lt, frames=k, silent=sl)
        return int(nn.sum()), int(silent.sum())

    def _frame_stores(self) -> tuple:
        """The frames table's storage as :func:`metronome.sim.recorder.flush` writes it (``FrameRows``' columns)."""
        fr = self.frames
        return tuple(fr.store(c) for c in recorder.FRAME_ROWS)

    # ----------------------------------------------------------------------------------------------- one step
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

    def _record_step(self, start: float, lat: float, rec, used: int, tokens_out: int, preemptions: int) -> None:
        """The step's answers (one row per tick), then its row."""
        done_n, silent = self._flush_answers(self.now)
        self.steps.add(t_s=start, step_s=lat, batch=int(rec.slots.size), new_tokens=rec.new_tokens,
                       context_tokens=rec.context_tokens, resident_blocks=used, free_blocks=self.num_blocks - used,
                       tokens_out=tokens_out, frames_done=done_n, silent_frames=silent, preemptions=preemptions,
                       running=int((self.state == RUNNING).sum()), waiting=len(self.waiting))


    # -------------------------------------------------------------------------------------- the compiled loop
    COMPILED_STEPS = 8192  # steps per call of the compiled loop (its record buffers are sized by it)
    SPAN_ARRIVALS = 512  # arrivals one call of the compiled loop may take (room for their sessions is made per call)
    SPAN_FRAMES = 4096  # frames whose correlated-jitter parts one call of the compiled loop is given, at most

    def _span_steps(self) -> int:
        """Steps the next call of the compiled loop may take: twice the last call's (its jitter draws are drawn
        ahead for that many), so a run whose spans end at frequent events draws no more than it uses."""
        return int(min(self.COMPILED_STEPS, max(64, 2 * self._last_span)))

    def _span_draws(self, n_max: int, live: np.ndarray, t_next: float):
        """The compiled loop's jitter: its kind, the draws (:class:`metronome.sim.span.Draws`: each step's ratio
        under independent jitter; under correlated jitter each step's own score and the shared and frame-only parts
        of the frames the span can be serving, from the serving frame to the last tick before ``t_next``, a step
        past them handed back, and the table) and the parts' weights."""
        none = np.zeros(0)
        d = self.draws
        if not self.jitter:
            return span.NO_JITTER, span.Draws(none, none, none, none, none, none), (0.0, 0.0, 0.0)
        steps = self.n_steps + np.arange(n_max)
        if not d.correlated:
            return span.INDEPENDENT, span.Draws(d.ratio(steps, 0), none, none, none, none, none), (0.0, 0.0, 0.0)
        f_lo = self.serving_frame
        last = int(np.floor((min(t_next, self.horizon) + _EPS - self.phase[live]) / self.P_of[live]).max()) + 1
        shared, own = d.frame_parts(np.arange(f_lo, max(f_lo, min(last, f_lo + self.SPAN_FRAMES)) + 1))
        p, r = d.table()
        return span.CORRELATED, span.Draws(none, d.step_scores(steps), shared, own, p, r), d.weights()

    def _compiled_span(self, now: float, turn_taken: bool = True):
        """Turns and steps of a steady span in :func:`metronome.sim.fastpath.run_span` (compiled), from just
        after the turn at ``now`` (``turn_taken``) or from that turn; returns (where it stopped, whether the turn there
        is taken, whether it paused after it, and the (start, latency, record) of a step the loop took whose
        aftermath is this path's, or None), or None when it could not take a single step, nor the turn it was
        asked to take (the step-by-step path goes on, and takes that turn)."""
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
        conf, draws = self._compiled_config(now, sess, t_next, n_max, na_end)
        ans_cap = int(conf[0]["ans_cap"])
        state, fe = self._front_arrays(now, sess.size - live.size, sess.size)
        dep0, seq0 = int(self._b["dep"]), self.seq
        ctl = self._controller_arrays(ans_cap)
        ahead = self.horizon / now if now > 0 else 1.0  # twice the rows of the run so far, to its horizon
        self.steps.reserve(n_max, int(2 * ahead * self.steps.rows))
        self.frames.reserve(4 * n_max + 4 * ans_cap, int(2 * ahead * self.frames.rows))
        st, fr = self.steps, self.frames
        if self.n_steps:  # the rows it will likely write, as many steps as the last call took (their pages faulted in)
            st.map_ahead(self._last_span)
            fr.map_ahead(self._last_span * fr.rows // self.n_steps, skip=("in_flight",))
        rec = recorder.Rows(st.store("t_s"), st.store("step_s"), *(st.store(c) for c in recorder.STEP_BLOCK),
                            recorder.FrameRows(*self._frame_stores()))
        state["step0"], state["nrows"] = st.rows, fr.rows
        state["turned"] = span.TURN_TAKEN if turn_taken else span.TURN_CALLER
        na0 = self.next_arrival
        fp.run_span(conf, state, np.array(self.lat.coefficients, dtype=np.float64), sess, self.session_arrays(), fe,
                    m.arrays(), draws, rec, ctl)
        s = state[0]
        n, turned, end = int(s["nsteps"]), int(s["turned"]), float(s["now"])
        self._front_books(fe, s, na0, dep0, seq0)
        self._compiled_records(n, int(s["nrows"]))  # (a turn alone may have answered frames)
        if n == 0 and end == now and turned not in (span.PAST_HORIZON, span.PAUSED, span.STEP_TAKEN):
            if s["took"]:  # it took the turn asked of it, and could go no further
                if self.check_invariants:
                    self.assert_invariants()
                return end, True, False, None
            if turn_taken:  # (a turn it could not take is no sign of a span without steps: the next call goes on)
                self._last_span = 0
            return None
        self._last_span = n
        self.n_steps += n
        self.fast_steps += n
        if turned == span.PAST_HORIZON:  # its last step outlives the run: SimPy stops while it runs
            self.now = end
            return float(s["out_s"]), False, False, None
        taken = None
        if turned == span.STEP_TAKEN:
            self.n_steps += 1
            self.fast_steps += 1
            lat = float(s["out_s"])
            taken = (end, lat, m.last_step())
            end += lat
        elif self.check_invariants:
            self.assert_invariants()
        return end, turned in (span.TURN_TAKEN, span.PAUSED), turned == span.PAUSED, taken

    def _front_arrays(self, now: float, n_coming: int, n_sess: int):
        """The compiled loop's counters (:data:`metronome.sim.span.STATE`) and the arrays it runs the front end on
        (:class:`metronome.sim.span.Front`: the front end's own queues and their books, which it writes in place,
        with room for ``n_coming`` arrivals and, before the queue's head, for the ``n_sess`` sessions it may
        see (a preempted session goes back to the head, and no more can than run), for the silent frames owed in
        lockstep (an engine behind the frame clock owes more every tick))."""
        self.room(ahead=n_sess + 1, behind=n_coming, departures=n_coming, owed=8 * n_sess + 64)
        q = self.queues
        fe = span.Front(q.queue, q.dep_t, q.dep_i, q.pend, self.books, self.sess_of_slot, self.fresh_slot)
        state = np.zeros(1, span.STATE)
        state["now"], state["nrun"] = now, int((self.state == RUNNING).sum())
        return state, fe

    def _front_books(self, fe, s, na0: int, dep0: int, seq0: int) -> None:
        """The front end's books after the compiled loop (it wrote them in place, counters and requests included;
        ``s``: its counters, ``na0``, ``dep0`` and ``seq0``: the next arrival, departure and admission before it):
        what it counted, the arrivals it refused and the departures it took."""
        self.loop_first_frames += int(s["nfirst"])
        self.loop_readmissions += int(s["nreadmit"])
        self.loop_preemptions += int(s["ndrop"])
        came = np.arange(na0, self.next_arrival)
        refused = came[self.state[came] == REFUSED]
        self.s_end_reason[refused] = EndReason.REFUSED
        self.loop_arrivals += came.size
        self.loop_refused += refused.size
        self.loop_admissions += self.seq - seq0
        self._departed_in_loop(fe.dep_i[dep0:int(self._b["dep"])].tolist())

    def _controller_arrays(self, ans_cap: int) -> ck.ControllerArrays:
        """The controller's arrays the compiled loop runs it on (a compiled controller's own, with room until the
        horizon; else arrays it does not read)."""
        c = self.controller
        if c is not None and c.compiled:
            c.room(self.now, self.horizon + 2 * c.interval_s, 4 * ans_cap)
            return c.arrays
        if self._no_controller is None or self._no_controller.lat.size < 2 * ans_cap + 1:
            self._no_controller = ck.no_controller(2 * ans_cap + 1)
        return self._no_controller

    def _departed_in_loop(self, who: list[int]) -> None:
        """The books of the departures the compiled loop took (sessions ``who``): what it does not keep itself."""
        for i in who:
            if self.state[i] != ENDED or self.s_end_reason[i]:  # it had ended already: passed over
                continue
            self.s_end_reason[i] = EndReason.DEPARTED
            self.loop_departures += 1

    def _compiled_start(self, now: float) -> tuple[np.ndarray, float, int] | None:
        """Whether the compiled loop may start after the turn at ``now``: (the live sessions, where it must stop
        at the latest, the arrivals it may take are those before this one), or None."""
        m = self.model
        if (self.gate.queue or self.n_answers or self.stalled or not isinstance(m, EngineModel)
                or (self.sees_starvation and m.cnt[0].n_wq)):  # (vLLM's own loop re-prefills what it preempts)
            return None
        live = np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING))
        run = live[self.state[live] == RUNNING]
        if live.size == 0 or run.size + len(self.waiting) != live.size:  # nobody prefilling
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
        """The compiled loop's constants (:data:`metronome.sim.span.CONF`) and the jitter draws (``sess``: the
        sessions the loop may see)."""
        kind, draws, (wz, wshared, wown) = self._span_draws(n_max, sess, t_next)
        c = self.controller
        conf = np.zeros(1, span.CONF)
        for name, value in (
                ("max_steps", n_max), ("ans_cap", 2 * max(self.model.status_a.size, sess.size) + 64),
                ("f_lo", self.serving_frame), ("lockstep", self.lockstep), ("sees", self.sees_starvation),
                ("na_end", na_end), ("ctl", span.CTL_NONE if c is None else span.CTL_COMPILED if c.compiled
                                     else span.CTL_AFTER), ("tpf", self.tpf), ("P", self.P),
                ("Pq", self.Pq), ("shaped", self.own_clocks), ("t_next", t_next), ("first_s", self.first_s),
                ("eps", _EPS), ("jitter", kind), ("horizon", self.horizon), ("wz", wz),
                ("wshared", wshared), ("wown", wown), ("route", self.lat.moe_route),
                ("t_pause", math.inf if not self.pause_every_s
                 else (math.floor(now / self.pause_every_s) + 1) * self.pause_every_s)):
            conf[name] = value
        return conf, draws

    def _compiled_records(self, n: int, rows_end: int) -> None:
        """The compiled loop wrote ``n`` steps and frame rows up to ``rows_end`` into the tables' storage: they are
        the tables' now (and a controller deciding in Python is told the rows)."""
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
                                         in_flight=fr.store("in_flight")[r0:rows_end])

    # ------------------------------------------------------------------------------------------------ results
    def release(self) -> None:
        """The run is over and its tables taken (:meth:`Table.frame`: views of their storage): the engine lets go
        of them. SimPy's process keeps the engine in a reference cycle until the collector runs, and a run's
        storage held that long slowed the next run in the same process by up to half (measured: the realistic
        hour's loop, 0.62 s after a collection and 0.97 s without one)."""
        self.steps = self.frames = None

