"""The real-time driver: paces sessions on the frame clock against the live engine and records every frame.

Each session is one long-lived resumable engine request, so its KV persists across frames (no re-encoding).
vLLM has no clock; ``step()`` simply blocks, so the driver keeps the clock itself. Every rule of a session's
life on the serving side (the frame clock and phases, the admission gate and the FCFS queue for blocks, the
first frame, silence, preemption by recompute and the deadlock rule of vLLM 0.32's paused sessions, readmission
with the whole history, the rebase or finish at ``max_model_len``, what a session that dies with the engine comes
back as) is :class:`metronome.front_end.FrontEnd`'s, the simulator's own: the driver is that front end on the
wall clock, over the engine in slots (:class:`metronome.probe.slot_engine.SlotEngine`, which turns its counts into
the token ids vLLM holds). ``tests/test_front_end_differential.py`` runs it on a fake engine's virtual time beside
the simulator, step by step.

What the driver adds is what only a live run has: the wall clock and its naps, the engine's health (silence,
death, restart: :mod:`metronome.probe.supervise`), a clean stop on request, and one row per frame (with what the
engine did for it: submitted, first token, tokens by the deadline), step, session and event, kept by
:class:`metronome.probe.live_sink.LiveSink`: journaled when the engine is idle between frames and at least once a
second, so a crash or Ctrl-C keeps what was measured and no file I/O sits between two steps of a frame. The driver
calls its engine through :class:`metronome.probe.engine.DrivenEngine` and its admission controller through
:class:`AdmissionController`, the interface :mod:`metronome.admission`'s controllers share with the simulator. The
run's figures are :mod:`metronome.probe.summary`'s, the Prometheus export :mod:`metronome.probe.metrics`'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from metronome import front_end, results, serving
from metronome.calibration import TokenStream
from metronome.front_end import ENDED, PREFILL, REFUSED, RUNNING, WAITING, FrontEnd, FrontEndOptions, Roster
from metronome.kv_policy import KVPolicy
from metronome.probe.engine import DrivenEngine
from metronome.probe.live_sink import LiveSink
from metronome.probe.metrics import LiveMetrics
from metronome.probe.remote import EngineDied
from metronome.probe.slot_engine import SlotEngine
from metronome.probe.summary import summarize
from metronome.probe.supervise import Supervisor
from metronome.serving import EndReason, EngineLimits

PHASES = "aligned"  # serving.PHASES: the regime a live run uses unless told otherwise (DriverConfig.phases);
# whatever simulates a live run (validate, the report's --live, the AIMD bench) simulates the run's regime

_EPS = 1e-9
# Journals are written off the timing path (live_sink): when the engine is idle with at least FLUSH_MIN_GAP_S
# before the next due work, and, for an engine that is never idle, every live_sink.FLUSH_EVERY_S.
FLUSH_MIN_GAP_S = 0.005
NAP_S = 0.05  # an idle driver wakes this often to stop or to notice a dead engine (Driver._nap)
# a frame row's state: the session's when the frame came due
RUNNING_S, PREFILL_S, WAITING_S = "running", "prefill", "waiting"


class AdmissionController(Protocol):
    """What the driver calls on its admission controller: :mod:`metronome.admission`'s controllers (the
    simulator's) and :class:`AdmitAll`. :class:`metronome.serving.AdmissionGate` reads its queueing settings."""

    interval_s: float  # its control interval; the engine-silence threshold unless DriverConfig.silence_s

    @property
    def limit(self) -> int | None: ...  # the session limit, for the metrics (None: none to report)

    @property
    def dead(self) -> bool: ...  # refusing everything because the latency signal is dead

    def advance(self, now_s: float, in_flight: int) -> None: ...  # close the control intervals up to now_s

    def observe(self, now_s: float, latency_s: float, frames: int = 1, silent: int = 0) -> None: ...

    def may_admit(self, now_s: float, in_flight: int) -> bool: ...

    def compile_now(self) -> None: ...  # compile what the calls above run, before the driver's clock starts


class AdmitAll:
    """The default controller: admit every session."""

    interval_s = 1.0
    limit = None
    dead = False

    def advance(self, now_s: float, in_flight: int) -> None:
        pass

    def observe(self, now_s: float, latency_s: float, frames: int = 1, silent: int = 0) -> None:
        pass

    def may_admit(self, now_s: float, in_flight: int) -> bool:
        return True

    def compile_now(self) -> None:
        pass  # (nothing compiled)


@dataclass(frozen=True)
class SessionPlan:
    """A session of the scenario: it arrives at ``arrival_s`` (from the run's start) and lasts ``duration_s``."""

    sid: str
    arrival_s: float = 0.0
    duration_s: float = math.inf
    prompt_tokens: int = 1  # the first frame carries these extra tokens (at least 1: vLLM rejects an empty chunk)
    phase_slot: int = 0  # its phase, in serving.PHASE_SLOTS per period (workload.draw_phases); 0 in lockstep
    # its own input and output tokens per frame, at most the stream's (None: the stream's)
    input_tokens: int | None = None
    output_tokens: int | None = None
    # its own frame period and deadline, in seconds (None: the stream's period, the run's deadline; independent
    # phases only)
    period_s: float | None = None
    deadline_s: float | None = None
    # live runs only: it also leaves once this many of its frames were answered (whichever comes first), so that a
    # scenario unfolds frame by frame however slow the host (None: by duration_s alone)
    frames: int | None = None


@dataclass(frozen=True)
class DriverConfig:
    stream: TokenStream
    horizon_s: float  # wall-clock length of the run
    run: str = "run"  # label stored on every record (e.g. the KV policy)
    deadline_s: float | None = None  # a frame is on time if done within this of its tick (default: one period)
    cap: str | None = None  # near max_model_len: "rebase" or "finish" (default: serving.default_cap(policy))
    rebase_tokens: int | None = None  # tokens an unbounded rebase keeps (default: serving.rebase_keep_tokens)
    seed: int = 0
    vocab_size: int = 1000  # input token ids are drawn from [10, vocab_size)
    prometheus_port: int | None = None
    policy: KVPolicy | None = None  # the KV policy the engine runs (default: the engine's own)
    # the engine is *silent* when frames are in flight and it produced no token for this long (default: the
    # controller's interval, or 1 s): flagged in events ("engine_silent"), the summary and the metrics
    silence_s: float | None = None
    # the engine's process died (probe.remote.EngineDied): with restart, start a new engine and readmit every
    # session as a rebase (its KV is gone); frames are answered silent meanwhile. Without, the run stops.
    restart: bool = False
    max_restarts: int = 3
    phases: str = PHASES  # serving.PHASES: "aligned" (lockstep) or "independent" (each session's own phase)
    # the run ends at the first turn where until(driver) holds (e.g. frames_answered, events_seen), its sessions
    # ended as at the horizon, which is then only a cap: a run that needs K frames or an event gets them on a host
    # of any speed (RunResult.until_met says whether it held)
    until: Callable[["Driver"], bool] | None = None

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else self.stream.frame_period_s


@dataclass
class RunResult:
    frames: list[dict]
    steps: list[dict]
    sessions: list[dict]
    summary: dict
    events: list[dict] = field(default_factory=list)  # preemptions and readmissions, in order
    until_met: bool | None = None  # the run ended because DriverConfig.until held (None: no until)


class Driver(FrontEnd):
    """Runs one scenario (a list of :class:`SessionPlan`) against the engine; use one Driver per run.

    The front end is the simulator's own (:class:`metronome.front_end.FrontEnd`: every rule of a session's life),
    here on the wall clock (or a fake engine's virtual one) and over the live engine in slots
    (:class:`metronome.probe.slot_engine.SlotEngine`, which keeps the token ids). What the driver adds is what only
    a live run has: the clock and its naps, the supervisor (silence, death, restart), a stop on request, and the
    rows it records through :class:`metronome.probe.live_sink.LiveSink`: one per frame, with what the engine did
    for it (submitted, first token, tokens by the deadline), one per step, session and event."""

    plans: list[SessionPlan]  # set for each run (run(plans)), in arrival order
    # per session (FrontEnd._session_arrays)
    join: np.ndarray  # its first frame (the frame rows count from it)
    start_s: np.ndarray  # when it passed the gate
    readmits: np.ndarray

    def __init__(self, engine: DrivenEngine, config: DriverConfig, admission: AdmissionController | None = None,
                 out_dir: str | Path | None = None, notify=None, retain: bool = True,
                 clock=time.perf_counter, sleep=time.sleep, metrics: LiveMetrics | None = None):
        """``metrics``: the Prometheus export to update (default: one on ``config.prometheus_port``, if set)."""
        self.engine, self.cfg = engine, config
        self.clock, self.sleep = clock, sleep  # injectable: tests run the driver on a fake engine's virtual time
        serving.compile_front_end_rules()  # (before the clock starts)
        front_end.compile_rules()
        self.admission = admission if admission is not None else AdmitAll()
        self.admission.compile_now()  # (before the clock starts, as the front end's rules)
        self.policy = config.policy or engine.policy
        self.rng = np.random.default_rng(config.seed)
        # what the front end reads of the engine's limits (max_num_seqs is the engine's own business: unread)
        self.limits = EngineLimits(num_blocks=engine.num_blocks - 1, max_num_seqs=0,
                                   max_num_batched_tokens=engine.max_num_batched_tokens,
                                   max_model_len=engine.max_model_len)
        keep = serving.rebase_keep_tokens(self.policy, engine.max_model_len, unbounded=config.rebase_tokens)
        self.plans = []
        self.slots = SlotEngine(engine, self.policy, self.limits, keep, self._fresh, label=self._label)
        if metrics is None and config.prometheus_port:
            metrics = LiveMetrics(config.prometheus_port)
        self.sink = LiveSink(config.run, out_dir, retain=retain, metrics=metrics)
        if metrics is not None:
            metrics.compile_now()  # (before the clock starts, as the front end's rules and the controller)
        self._stop_reason: str | None = None  # set by stop() (e.g. from a SIGTERM handler): a clean stop
        silence_s = config.silence_s if config.silence_s is not None else float(self.admission.interval_s)
        self.supervisor = Supervisor(engine, self.sink.record, silence_s=silence_s, restart=config.restart,
                                     max_restarts=config.max_restarts, metrics=metrics, notify=notify)
        self.t_stopped_s: float | None = None
        # per frame in the engine, by (session, frame): [submitted, first token, tokens by the deadline, rebased,
        # the ids it got]
        self._book: dict[tuple[int, int], list] = {}
        self._silent_state: dict[tuple[int, int], str] = {}  # a frame to be answered silent: the state at its tick
        self._leaving = False  # the answers being recorded are a departing session's frames never done
        self._leave_after = np.zeros(0, dtype=np.int64)  # each session's frames before it leaves (0: by its duration)
        self._until_met = False  # the run ended because cfg.until held
        self._step_victims: list[str] = []  # sessions the current step preempted
        self.frames, self.steps, self.sessions, self.events = (self.sink.tables[t] for t in
                                                               ("frames", "steps", "sessions", "events"))

    def stop(self, reason: str = EndReason.STOPPED) -> None:
        """Ask the run to stop cleanly at its next loop turn (safe from a signal handler): every session is
        ended (``reason`` in the sessions table), journals are closed, and the summary covers what ran."""
        if self._stop_reason is None:
            self._stop_reason = reason

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(10, self.cfg.vocab_size, size=n).tolist()

    def _fresh(self, i: int, n: int) -> list[int]:
        """Session ``i``'s next ``n`` input ids (the load generator's: drawn at random)."""
        return self._tokens(n)

    def _label(self, i: int) -> str:
        return self.plans[i].sid

    def _session_arrays(self, M: int) -> dict[str, np.ndarray]:
        return {**super()._session_arrays(M), "join": np.zeros(M, dtype=np.int64), "start_s": np.full(M, np.nan),
                "readmits": np.zeros(M, dtype=np.int64)}

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, plans: list[SessionPlan]) -> RunResult:
        self._serve(plans)
        summary = summarize(self.frames, self.steps, self.sessions, self.engine.num_blocks, self.events)
        summary.update({
            "stopped": self._stop_reason is not None, "stop_reason": self._stop_reason, "t_stopped_s": self.t_stopped_s,
            **self.supervisor.summary(),
        })
        until_met = self._until_met if self.cfg.until is not None else None
        return RunResult(self.frames, self.steps, self.sessions, summary, self.events, until_met)

    def _serve(self, plans: list[SessionPlan]) -> None:
        """The run: until the horizon or a stop, then every session still in is ended, and the records closed."""
        cfg, clock = self.cfg, self.clock
        self.plans = sorted(plans, key=lambda p: p.arrival_s)
        roster = Roster(np.array([p.arrival_s for p in self.plans], dtype=np.float64),
                        np.array([p.duration_s for p in self.plans], dtype=np.float64),
                        np.array([p.phase_slot for p in self.plans], dtype=np.int64),
                        np.array([p.prompt_tokens for p in self.plans]),
                        np.array([cfg.stream.input_tokens_per_frame if p.input_tokens is None else p.input_tokens
                                  for p in self.plans], dtype=np.int64),
                        np.array([cfg.stream.output_tokens_per_frame if p.output_tokens is None else p.output_tokens
                                  for p in self.plans], dtype=np.int64),
                        np.array([cfg.stream.frame_period_s if p.period_s is None else p.period_s
                                  for p in self.plans], dtype=np.float64),
                        np.array([cfg.deadline if p.deadline_s is None else p.deadline_s
                                  for p in self.plans], dtype=np.float64))
        FrontEnd.__init__(self, self.slots, self.policy, self.limits, cfg.stream, roster, cfg.horizon_s, cfg.deadline,
                          controller=self.admission,
                          options=FrontEndOptions(phases=cfg.phases, cap=cfg.cap, rebase_tokens=cfg.rebase_tokens))
        self._leave_after = np.array([p.frames or 0 for p in self.plans], dtype=np.int64)
        self._until_met = False
        t0 = clock()
        self.supervisor.started()
        self.sink.flush(t0)  # (the clock of every flush: the journals' next write is due a second from here)
        try:
            while True:
                now = clock() - t0
                if now >= cfg.horizon_s or self._stop_reason is not None:
                    break
                if cfg.until is not None and cfg.until(self):
                    self._until_met = True
                    break
                if self.sink.flush_due(now + t0):  # an engine that is never idle still gets its rows on disk
                    self._flush()
                try:
                    self._live_turn(now, t0)
                except EngineDied as exc:
                    self._flush()
                    self._engine_died(exc, clock() - t0)
            now = self.now = clock() - t0
            self.supervisor.close(now)
            if self._stop_reason is not None:
                self.t_stopped_s = now
            reason = self._stop_reason or EndReason.HORIZON
            for i in np.flatnonzero((self.state >= WAITING) & (self.state <= RUNNING)).tolist():
                self._end(i, now, reason)
            for i, _ in self.gate.queue:  # still waiting at the gate: offered, never admitted
                self._refuse(i, now, reason)
            self.gate.queue.clear()
        finally:
            self.sink.close()  # (without retain, the rows went only to the journals: read back here)

    def _live_turn(self, now: float, t0: float) -> None:
        """One turn: the front end's (arrivals, ends, admission, due frames), then one engine step or a nap."""
        self.now = now
        if self.supervisor.down_since is not None and self.supervisor.back(now):
            self.stalled = False
        if self._leave_after.any():
            self._leave_by_frames(now)
        self._turn(now)
        self.supervisor.watch(now, bool(((self.inflight >= 0) | (self.state == PREFILL)).any()))
        if self._steps_now():
            # (an engine on its own loop is waited on no longer than the next tick or event is away)
            self._step(t0, self._next_due() - now)
        else:
            nxt = self._idle_until()
            self.engine.check_alive()  # an engine in its own process, idle: a step would have noticed its death
            if nxt - (self.clock() - t0) >= FLUSH_MIN_GAP_S:
                self._flush()  # idle: the rows go to disk off the timing path (records.Journal, deferred)
            self._nap(t0, nxt)

    def _leave_by_frames(self, now: float) -> None:
        """Sessions planned to leave after their ``SessionPlan.frames`` answered frames leave at this turn."""
        n = self._leave_after.size
        for i in np.flatnonzero((self._leave_after > 0) & (self.s_frames[:n] >= self._leave_after)).tolist():
            self._book_departure(now, i)
            self._leave_after[i] = 0

    def _nap(self, t0: float, until: float) -> None:
        """Idle until ``until`` (the next tick, departure, arrival or the horizon), waking every ``NAP_S`` only to
        stop, to notice an engine that died or, while one restarts, to look at it again. The next turn is at the
        next event, as in the simulator: a turn in between could admit a session the simulator admits only then
        (after a step that preempted, the admission it skipped)."""
        eng, clock = self.engine, self.clock
        while self._stop_reason is None:
            gap = until - (clock() - t0)
            if gap <= 0:
                return
            self.sleep(min(gap, NAP_S))
            if self.supervisor.down_since is not None or self._interrupted():
                return
            eng.check_alive()

    def _interrupted(self) -> bool:
        """Something the next turn must see came in while napping (a server's clients: its inbox)."""
        return False

    def _step(self, t0: float, wait_s: float | None = None) -> None:
        t_start = self.clock() - t0
        rec = self.slots.step(wait_s)
        if rec is None:  # an engine on its own loop reported no step yet (probe.own_loop): back to the clock
            return
        now = self.clock() - t0
        info = self.slots.last_info
        if info.t_end is not None:  # stepped on its own: the step ran and its outputs came in before we looked
            # A report that came in while this turn ran is the front end's at the turn, not earlier: the turn
            # handed over the frames that ticked by then, and a frame answered at the report's time (silent, its
            # session a victim of the stall the report tells) would be answered before its tick. The step's own
            # start and duration stay the engine's.
            t_start, now = info.t_start - t0, max(info.t_end - t0, self.now)
        if any(info.outputs.values()):
            self.supervisor.token(now)
        self.now = now
        self._after_step(t_start, info.duration_s, rec)
        for i in self.slots.finished:  # the engine ended a request on its own (e.g. its length cap)
            if WAITING <= self.state[i] <= RUNNING:
                self._end(i, now, EndReason.ENGINE_FINISHED)

    def _engine_died(self, exc: EngineDied, now: float) -> None:
        """The engine's process is gone, and every session's KV with it (``FrontEnd._lose_all``: each comes back as
        a rebase; its frames are answered silent meanwhile). Then restart (``restart``) or stop the run
        (``stop_reason="engine_died"``)."""
        self.supervisor.died(exc, now)
        self.now = now
        lost = self._lose_all(now)
        self._flush_answers(now)
        if not self.supervisor.recover(exc, now, lost):
            self.stop(EndReason.ENGINE_DIED)

    def _flush(self) -> None:
        self.sink.flush(self.clock())

    # -- records: what the front end tells, as rows ---------------------------------------------------------
    def _flush_answers(self, now: float) -> tuple[int, int]:
        """One row per frame answered (``self._answers``), each fed to the controller."""
        k = self.n_answers
        answers = [tuple(x[:k].copy() for x in self.answers)] if k else []
        self.n_answers = 0
        n = silent = 0
        in_flight = self._in_flight()
        for keys, idx, toks in answers:
            idx = np.asarray(idx)
            frames = serving.tick_frame(np.asarray(keys), self.pslot[idx])
            for i, f, tok in zip(idx.tolist(), frames.tolist(), np.asarray(toks).tolist()):
                latency, quiet = self._frame_row(i, f, tok, now)
                self.admission.advance(now, in_flight)  # the controller closes its intervals here
                self.admission.observe(now, latency, frames=1, silent=int(quiet))
                n, silent = n + 1, silent + int(quiet)
        return n, silent

    def _censored(self, i: int, f: np.ndarray, tokens: np.ndarray) -> None:
        for fr, tok in zip(f.tolist(), tokens.tolist()):
            self._frame_row(i, fr, tok, self.now, censored=True)

    def _frame_row(self, i: int, f: int, tokens: int, now: float, censored: bool = False) -> tuple:
        """Session ``i``'s frame ``f`` answered now with ``tokens`` (or, ``censored``, never: the run or its session
        ended before its deadline). A departing session's frames (``_leaving``) were never done: their latency
        runs until it left. Returns (latency, silent)."""
        tick = float(serving.frame_tick(f, self.P_of[i], self.phase[i]))
        book = self._book.pop((i, f), None)
        state = self._silent_state.pop((i, f), RUNNING_S)
        submitted, first, by_deadline, rebased, ids = book if book is not None else (None, None, 0, False, [])
        done = None if censored or self._leaving else now
        latency = None if censored else now - tick
        silent = serving.frame_is_silent(tokens) and not censored
        # what a silent frame is (results.silent_cause; the simulator's frames table has the same three columns)
        cause = results.silent_cause(tokens, self._leaving, tick, float(self.s_admitted[i])) if silent else 0
        row = {
            "session": self._label(i), "frame": f - int(self.join[i]), "tick_s": tick, "submitted_s": submitted,
            "first_token_s": first, "done_s": done, "latency_s": latency,
            "tokens_expected": int(self.n_out_of[i]), "tokens_delivered": tokens, "tokens_by_deadline": by_deadline,
            "silent": silent, "silent_preempted": cause == results.SILENT_PREEMPTED,
            "silent_waiting": cause == results.SILENT_WAITING, "silent_departed": cause == results.SILENT_DEPARTED,
            "silent_by_deadline": by_deadline == 0,
            "met_deadline": done is not None and latency <= self.deadline_of[i] + _EPS, "censored": censored,
            "state": RUNNING_S if book is not None else state, "period_s": float(self.P_of[i]), "rebased": rebased,
        }
        self.sink.frame(row, latency)
        self._deliver(i, f, row, ids)
        return latency, silent

    def _deliver(self, i: int, f: int, row: dict, ids: list[int]) -> None:
        """Session ``i``'s frame ``f`` is recorded (``row``), with the ids it got: a server sends it to its client."""

    def _submitted(self, idx, f, rebased: bool) -> None:
        for i, fr in zip(np.asarray(idx).tolist(), np.asarray(f).tolist()):
            self._book[(i, fr)] = [self.now, None, 0, rebased, []]

    def _silenced(self, idx: np.ndarray, f: np.ndarray, state) -> None:
        for i, fr in zip(idx.tolist(), f.tolist()):
            st = self.state[i] if state is None else state
            self._silent_state[(i, fr)] = WAITING_S if st == WAITING else PREFILL_S

    def _tokens_in(self, pre: np.ndarray, inf: np.ndarray, frames: np.ndarray) -> None:
        now, info = self.now, self.slots.last_info
        for i in pre.tolist():
            name = self.slots.name(i)
            self._event("prefilled", i, now, computed_tokens=info.computed.get(name, 0),
                        scheduled_tokens=info.scheduled.get(name, 0))
        for i, f in zip(inf.tolist(), frames.tolist()):
            b = self._book[(i, f)]
            b[4].append(self.slots.held[int(self.slot[i])][-1])
            if b[1] is None:
                b[1] = now
            if now - float(serving.frame_tick(f, self.P_of[i], self.phase[i])) <= self.deadline_of[i]:
                b[2] += 1

    def _event(self, kind: str, i: int, t: float, **extra) -> None:
        if kind == "readmit":
            self.readmits[i] += 1
        elif kind == "preempt":
            self._step_victims.append(self._label(i))
            extra["blocks_freed"] = self.slots.last_freed
        elif kind == "lost":
            extra["blocks_freed"] = 0
        self.sink.record("events", {"t_s": t, "event": kind, "session": self._label(i),
                                    "rid": self.slots.name(i), **extra})

    def _offered(self, i: int, decision: str) -> None:
        self.sink.admission(self.admission)

    def _enter(self, i: int, t_enter: float) -> None:
        super()._enter(i, t_enter)
        self.join[i], self.start_s[i] = self.next_frame[i], t_enter
        self.sink.entered()

    def _refuse(self, i: int, now: float, reason: str) -> None:
        super()._refuse(i, now, reason)
        self.sink.refused(reason)
        self.sink.record("sessions", {"session": self._label(i), "arrival_s": float(self.arrival[i]),
                                      "admitted": False, "end_s": now, "reason": reason})

    def _end(self, i: int, now: float, reason: str) -> None:
        self._flush_answers(now)
        super()._end(i, now, reason)
        self._leaving = True  # (what _end answered: frames owed past their deadline, never done)
        self._flush_answers(now)
        self._leaving = False
        self.sink.record("sessions", {
            "session": self._label(i), "arrival_s": float(self.arrival[i]), "admitted": bool(self.admitted[i]),
            "start_s": float(self.start_s[i]), "end_s": now, "reason": reason, "frames": int(self.s_frames[i]),
            "silent_frames": int(self.s_silent[i]), "rebases": int(self.s_rebase[i]),
            "preemptions": int(self.s_preempt[i]), "readmissions": int(self.readmits[i])})

    def _record_step(self, start: float, lat: float, rec, used: int, tokens_out: int, preemptions: int) -> None:
        now = self.now
        self._flush_answers(now)
        info, p = self.slots.last_info, self.engine.pool()
        # t_s: the step's start, as in the simulator's steps (metronome.results); t_end_s: when its outputs were in
        row = {"t_s": start, "t_end_s": now, "stalled": info.batch == 0, "step_s": lat,
               # context_tokens: the KV the step attended over under the policy, as the simulator's steps and the
               # calibration's fit mean it; raw_context_tokens: the scheduled requests' whole computed histories
               "batch": info.batch, "new_tokens": info.new_tokens, "context_tokens": rec.context_tokens,
               "raw_context_tokens": info.context_tokens,
               "prefill_tokens": info.prefill_tokens, "preemptions": preemptions,
               "preempted": self._step_victims, "engine_preempted": info.preempted,
               "free_blocks": p.free_blocks, "used_blocks": p.used_blocks, "kv_usage": p.kv_usage,
               "running": p.running, "waiting": p.waiting, "paused": p.paused,
               "sessions": self._in_flight(), "sessions_waiting": len(self.waiting),
               "sessions_prefill": int((self.state == PREFILL).sum()), "held_tokens": self.slots.held_tokens()}
        self._step_victims = []
        self.sink.step(row, self.admission.limit)


# -- DriverConfig.until: what a run waits for, read from the front end's counts and the run's events ---------------
def _indices(driver: Driver, sessions) -> list[int]:
    if sessions is None:
        return list(range(len(driver.plans)))
    want = set(sessions)
    return [i for i, p in enumerate(driver.plans) if p.sid in want]


def frames_answered(driver: Driver, frames: int, sessions=None) -> bool:
    """Every session named (default: every session planned) has had ``frames`` frames answered, silent ones
    included, or has ended (or was refused) and will get no more."""
    idx = _indices(driver, sessions)
    over = (driver.state[idx] == ENDED) | (driver.state[idx] == REFUSED)
    return bool(idx) and bool(((driver.s_frames[idx] >= frames) | over).all())


def frames_before(driver: Driver, t_s: float, sessions=None) -> bool:
    """Every session named (default: every session planned) has had each of its frames that tick before ``t_s``
    answered, or has ended (or was refused): a run of horizon ``t_s`` as a host of any speed completes it."""
    idx = np.asarray(_indices(driver, sessions), dtype=np.int64)
    nxt = serving.frame_tick(driver.join[idx] + driver.s_frames[idx], driver.P_of[idx], driver.phase[idx])
    over = (driver.state[idx] == ENDED) | (driver.state[idx] == REFUSED)
    return bool(idx.size) and bool(((nxt >= t_s - _EPS) | over).all())


def events_seen(driver: Driver, kind: str, n: int = 1, sessions=None) -> bool:
    """The run recorded ``n`` events of ``kind`` (preempt, readmit, rebase, prefilled, ...), of the sessions named
    (default: any); with ``sessions``, each of them had ``n``. Reads the events table (the driver's default
    ``retain``)."""
    got: dict = {}
    for e in driver.events:
        if e["event"] == kind:
            got[e.get("session")] = got.get(e.get("session"), 0) + 1
    if sessions is None:
        return sum(got.values()) >= n
    return all(got.get(s, 0) >= n for s in sessions)


def run_live(engine: DrivenEngine, stream: TokenStream, plans: list[SessionPlan], horizon_s: float, *,
             policy: KVPolicy | None = None, admission: AdmissionController | None = None,
             out_dir: str | Path | None = None, run: str | None = None, **config) -> RunResult:
    """Run one scenario live on an idle engine and return every frame, step, session and event plus a summary.

    The engine must already run the policy (``EngineConfig.sliding_window``, ``EngineConfig.sinks``);
    ``policy`` (default: the engine's) is what the driver counts blocks with and what a session keeps when
    it is rebased near max_model_len. Extra keyword arguments go to :class:`DriverConfig` (deadline_s, cap,
    seed, prometheus_port, ...).
    """
    policy = policy or engine.policy
    cfg = DriverConfig(stream=stream, horizon_s=horizon_s, run=run or policy.describe(), policy=policy, **config)
    engine.reset()
    try:
        return Driver(engine, cfg, admission=admission, out_dir=out_dir).run(plans)
    finally:
        engine.reset()

