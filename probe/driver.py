"""The real-time driver: paces sessions on the frame clock against the live engine and records every frame.

Each session is one long-lived resumable engine request, so its KV persists across frames (no
re-encoding). vLLM has no clock; ``step()`` simply blocks, so the driver keeps the clock itself. The serving
rules are :mod:`metronome.serving`'s, the same the simulator runs (README, "The engine model"):

1. **Frame clock** (``serving.join_frame``, ``frame_tick``). Frame ``k`` of a session ticks at ``k·P + φ``:
   ``φ = 0`` for every session in lockstep (``phases="aligned"``, the default), each session's own seeded
   phase with ``phases="independent"`` (the engine then steps whenever any request has work, batching the
   frames that arrived, as vLLM's engine loop does); a session that arrives at ``t`` streams from its first
   tick at or after ``t``. At its tick a running session's frame appends ``in``
   tokens (after the token the engine sampled last, which vLLM drops from the history and the driver
   re-feeds) and waits for ``out`` tokens. A session has at most one frame in the engine; a frame that comes
   due early waits in the driver and its latency still counts from its tick.
2. **Admission** (``serving.AdmissionGate``, ``admit_fcfs``, ``admission_need_blocks``). Arrivals pass the
   gate (the controller; refused, or queued with a timeout), then join the FCFS waiting queue. The head is
   admitted when the blocks vLLM's full-sequence gate wants for its request are free, never right after a
   step that preempted.
3. **Preemption by recompute, done by the driver** (``serving.deadlock_victims``). vLLM 0.32 does not
   preempt paused streaming sessions, so a pool full of them deadlocks; after a step that left a session's
   work unscheduled for want of blocks (or scheduled nothing), the driver aborts the **most recently
   admitted** session and puts it at the head of the waiting queue. A session vLLM preempts on its own is
   handled the same way. A readmitted session is a **new request whose prompt is its whole token
   history**: the re-prefill is the latency wall.
4. **Silence** (``serving.frame_is_silent``). Frames of waiting and re-prefilling sessions are answered
   empty, on time: in lockstep when every running session's frame of the same tick is done (at once if none
   runs); with independent phases at once.
   Their input tokens still join the history. A late frame of a running session is late, not silent
   (``silent_by_deadline`` records whether a token came in time).
5. **Length** (``serving.frame_fits``, ``length_outcome``). A frame that would reach max_model_len rebases
   the session (S sinks + last W tokens under the bound) or finishes it (unbounded, by default).

Every frame, step and event (preemption, readmission) is appended to a journal (see ``records``), written
when the engine is idle between frames and at least once a second, so a crash or Ctrl-C keeps what was
measured and no file I/O sits between two steps of a frame. The driver calls its engine through
:class:`metronome.probe.engine.DrivenEngine` and its admission controller through
:class:`AdmissionController`, the interface :mod:`metronome.admission`'s controllers share with the simulator.

The engine's health (silence, death, restart) is :mod:`metronome.probe.supervise`'s, the run's figures
:mod:`metronome.probe.summary`'s, the Prometheus export :mod:`metronome.probe.metrics`'s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from metronome.calibration import TokenStream
from metronome.kv_policy import KVPolicy
from metronome import serving
from metronome.serving import EndReason, admit_fcfs
from metronome.probe.engine import DrivenEngine
from metronome.probe.live_sink import LiveSink
from metronome.probe.metrics import LiveMetrics
from metronome.probe.remote import EngineDied
from metronome.probe.summary import summarize
from metronome.probe.supervise import Supervisor
from metronome.probe.token_book import TokenBook

PHASES = "aligned"  # serving.PHASES: the regime a live run uses unless told otherwise (DriverConfig.phases);
# whatever simulates a live run (validate, the report's --live, the AIMD bench) simulates the run's regime

_EPS = 1e-9
# Journals are written off the timing path (live_sink): when the engine is idle with at least FLUSH_MIN_GAP_S
# before the next due work, and, for an engine that is never idle, every live_sink.FLUSH_EVERY_S.
FLUSH_MIN_GAP_S = 0.005
NAP_S = 0.05  # an idle driver wakes this often to stop or to notice a dead engine (Driver._nap)
RUNNING, PREFILL, WAITING = "running", "prefill", "waiting"


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


@dataclass(frozen=True)
class SessionPlan:
    """A session of the scenario: it arrives at ``arrival_s`` (from the run's start) and lasts ``duration_s``."""

    sid: str
    arrival_s: float = 0.0
    duration_s: float = math.inf
    prompt_tokens: int = 1  # the first frame carries these extra tokens (at least 1: vLLM rejects an empty chunk)
    phase_slot: int = 0  # its phase, in serving.PHASE_SLOTS per period (workload.draw_phases); 0 in lockstep


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

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else self.stream.frame_period_s


@dataclass
class _Frame:
    index: int  # the session's own frame count
    tick_s: float
    submitted_s: float | None = None
    first_s: float | None = None
    done_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    by_deadline: int = 0
    state: str = RUNNING  # the session's state when the frame came due
    rebased: bool = False  # this frame restarted the session near max_model_len (its latency carries the prefill)


@dataclass
class _Session:
    plan: SessionPlan
    start_s: float
    end_s: float
    rid: str  # current engine request id (changes on readmission and rebase)
    next_frame: int  # global frame index of the next tick
    state: str = WAITING
    tokens: TokenBook = field(default_factory=TokenBook)  # its ids: history, waiting input, the last sampled
    queue: deque = field(default_factory=deque)  # due frames not yet submitted
    inflight: _Frame | None = None
    work_step: int = -1  # engine step count when its current chunk or prefill was handed to the engine
    admit_seq: int = -1
    running_since: float = 0.0  # when it last became RUNNING: frames that ticked before were not its to serve
    in_engine: bool = False  # an engine request exists (rid)
    frames: int = 0  # frames that ticked (the next one's index)
    answered: int = 0  # frames answered, not censored (the sessions table's ``frames``, as the simulator's)
    silent: int = 0
    rebases: int = 0
    preemptions: int = 0
    readmissions: int = 0
    incarnation: int = 0
    rebase_next: bool = False  # its KV was lost with the engine: the readmission restarts it as a rebase
    phase_s: float = 0.0  # its frame k ticks at k·P + phase_s


@dataclass
class RunResult:
    frames: list[dict]
    steps: list[dict]
    sessions: list[dict]
    summary: dict
    events: list[dict] = field(default_factory=list)  # preemptions and readmissions, in order


class Driver:
    """Runs one scenario (a list of :class:`SessionPlan`) against the engine; use one Driver per run."""

    def __init__(self, engine: DrivenEngine, config: DriverConfig, admission: AdmissionController | None = None,
                 out_dir: str | Path | None = None, notify=None, retain: bool = True,
                 clock=time.perf_counter, sleep=time.sleep):
        self.engine, self.cfg = engine, config
        self.clock, self.sleep = clock, sleep  # injectable: tests run the driver on a fake engine's virtual time
        serving.compile_front_end_rules()  # (before the clock starts)
        self.admission = admission if admission is not None else AdmitAll()
        self.policy = config.policy or engine.policy
        self.rng = np.random.default_rng(config.seed)
        self.max_len = engine.max_model_len
        self.outcome = serving.length_outcome(self.policy, config.cap)
        self.rebase_keep = serving.rebase_keep_tokens(self.policy, self.max_len, unbounded=config.rebase_tokens)
        # vLLM's admission cap for this policy: one batch of tokens in flight (the probe schedules synchronously)
        self.cap_blocks = self.policy.admission_cap_blocks(engine.max_num_batched_tokens, self.max_len)
        self.gate = serving.AdmissionGate(self.admission)
        metrics = LiveMetrics(config.prometheus_port) if config.prometheus_port else None
        self.sink = LiveSink(config.run, out_dir, retain=retain, metrics=metrics)
        # True after a step that scheduled nothing and left nothing the driver could preempt: stepping again
        # would spin, so the driver waits for its next event instead.
        self._stalled = False
        self._preempted = False  # the last step (or the check after it) preempted: admit nobody before the next
        self._seq = 0
        self._nsteps = 0
        self._stop_reason: str | None = None  # set by stop() (e.g. from a SIGTERM handler): a clean stop
        silence_s = config.silence_s if config.silence_s is not None else float(self.admission.interval_s)
        self.supervisor = Supervisor(engine, self.sink.record, silence_s=silence_s, restart=config.restart,
                                     max_restarts=config.max_restarts, metrics=metrics, notify=notify)
        self.t_stopped_s: float | None = None
        self._active: dict[str, _Session] = {}  # by session id
        self.waiting: deque[_Session] = deque()  # admitted by the controller, waiting for blocks (FCFS)
        self.silent_pending: list[tuple[_Session, _Frame]] = []  # answered with their tick's lockstep
        self._lockstep = serving.check_phases(config.phases) == "aligned"
        self.frames, self.steps, self.sessions, self.events = (self.sink.tables[t] for t in
                                                               ("frames", "steps", "sessions", "events"))

    def stop(self, reason: str = EndReason.STOPPED) -> None:
        """Ask the run to stop cleanly at its next loop turn (safe from a signal handler): every session is
        ended (``reason`` in the sessions table), journals are closed, and the summary covers what ran."""
        if self._stop_reason is None:
            self._stop_reason = reason

    # -- records (the rows' content; the sink keeps them) -------------------------------------------
    def _flush(self) -> None:
        self.sink.flush(self.clock())

    def _record_frame(self, s: _Session, f: _Frame, now: float, censored: bool = False,
                      left_s: float | None = None) -> None:
        """``left_s``: the frame was never done, its session left then (its latency runs until then)."""
        done = f.done_s if f.done_s is not None or censored else left_s
        latency = (done - f.tick_s) if done is not None else None
        silent = serving.frame_is_silent(len(f.tokens)) and not censored
        met = f.done_s is not None and latency <= self.cfg.deadline + _EPS
        s.silent += int(silent)
        s.answered += int(not censored)
        observed = None if censored else (latency if latency is not None else now - f.tick_s)  # what it counts for
        self.sink.frame({
            "session": s.plan.sid, "frame": f.index, "tick_s": f.tick_s, "submitted_s": f.submitted_s,
            "first_token_s": f.first_s, "done_s": f.done_s, "latency_s": latency,
            "tokens_expected": self.cfg.stream.output_tokens_per_frame, "tokens_delivered": len(f.tokens),
            "tokens_by_deadline": f.by_deadline, "silent": silent, "silent_by_deadline": f.by_deadline == 0,
            "met_deadline": met, "censored": censored, "state": f.state, "period_s": self.cfg.stream.frame_period_s,
            "rebased": f.rebased,
        }, observed)
        if not censored:
            self.admission.advance(now, len(self._active))  # the controller closes its intervals here
            self.admission.observe(now, observed, frames=1, silent=int(silent))

    def _event(self, kind: str, s: _Session, t: float, **extra) -> None:
        self.sink.record("events", {"t_s": t, "event": kind, "session": s.plan.sid, "rid": s.rid, **extra})

    # -- sessions --------------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(10, self.cfg.vocab_size, size=n).tolist()

    def _free(self) -> int:
        return self.engine.pool().free_blocks

    def _request_tokens(self, s: _Session) -> int:
        """Tokens the session's request will carry when (re)admitted: its first frame, or its whole history."""
        tokens = len(s.tokens)
        if s.tokens.new:  # a new session: its first frame carries the prompt
            tokens += max(s.plan.prompt_tokens, 1) + self.cfg.stream.input_tokens_per_frame
        elif s.rebase_next:  # its KV died with the engine: it comes back as a rebase
            tokens = min(tokens, self.rebase_keep)
        return tokens

    def _admission_need(self, s: _Session) -> int:
        """Blocks vLLM's admission gate wants free for the session's request (serving.admission_need_blocks)."""
        return serving.admission_need_blocks(self.policy, self._request_tokens(s), self.cap_blocks)

    def _admit(self, now: float, by_rid: dict) -> None:
        """FCFS: admit waiting sessions while the head fits (whole history counted, as vLLM checks)."""
        if self._preempted:
            return
        for s in admit_fcfs(self.waiting, self._admission_need, self._free()):
            s.admit_seq, self._seq = self._seq, self._seq + 1
            if s.tokens.new:
                s.rebase_next = False  # nothing was lost: it never reached the engine
                s.state = RUNNING  # a new session: its first frame (prompt + input) is its prefill
                s.running_since = serving.frame_tick(s.next_frame, self.cfg.stream.frame_period_s,
                                                     s.phase_s)  # it serves every frame from now
                continue
            self._readmit(s, now, by_rid)

    def _rebase_prompt(self, tokens: list[int]) -> list[int]:
        """What a session keeps of its token ids when it restarts near max_model_len (``serving.rebase_ids``)."""
        return serving.rebase_ids(self.policy, tokens, self.rebase_keep)

    def _readmit(self, s: _Session, now: float, by_rid: dict) -> None:
        """A preempted session comes back as a new request whose prompt is its whole token history."""
        st = self.cfg.stream
        prompt = s.tokens.take_prompt()
        if s.rebase_next:  # the engine died with its KV: it comes back the way a rebase does (S+W / last tokens)
            s.rebase_next = False
            prompt = self._rebase_prompt(prompt)
            s.rebases += 1
            self._event("rebase", s, now, prompt_tokens=len(prompt), kept_tokens=len(prompt), reason="engine_restart")
        if not serving.frame_fits(len(prompt) + st.kv_tokens_per_frame, self.max_len):
            if self.outcome == "finish":
                s.tokens.restarted(prompt)
                self._end(s, now, EndReason.LENGTH, by_rid)
                return
            prompt = self._rebase_prompt(prompt)
            s.rebases += 1
            self._event("rebase", s, now, prompt_tokens=len(prompt), kept_tokens=len(prompt), reason="max_model_len")
        s.tokens.restarted(prompt)
        s.incarnation += 1
        by_rid.pop(s.rid, None)
        s.rid = f"{s.plan.sid}.p{s.incarnation}"
        by_rid[s.rid] = s
        self.engine.append(s.rid, prompt, 1)  # the one sampled token becomes the next chunk's first token
        s.in_engine = True
        s.state = PREFILL
        s.work_step = self._nsteps
        s.readmissions += 1
        self._event("readmit", s, now, prompt_tokens=len(prompt))

    def _preempt(self, s: _Session, now: float, reason: str, held: int, event: str = "preempt",
                 t_event: float | None = None) -> None:
        """Recompute preemption at the session level: abort the request, free every block, wait again; the
        frames it is owed are answered from ``now``. ``t_event``: the event's time, if not ``now`` (a preemption
        after a step is dated at the step's start, as the simulator's t_sat is). ``event="lost"``: the engine
        died with the session's KV (nothing to abort; readmitted as a rebase)."""
        if s.in_engine and event == "preempt":
            self.engine.abort(s.rid)
        s.in_engine = False
        s.tokens.preempted(s.inflight.tokens if s.inflight is not None else None)
        if s.inflight is not None:  # its frame is answered with its tick's lockstep, with what it got
            self._owe(s, s.inflight, now)
            s.inflight = None
        while s.queue:  # due frames never submitted: silent, their input joins the history
            f = s.queue.popleft()
            f.state = WAITING
            s.tokens.silent(self._tokens(self.cfg.stream.input_tokens_per_frame))
            self._owe(s, f, now)
        s.state = WAITING
        if event == "preempt":
            s.preemptions += 1
        else:
            s.rebase_next = True
        self.waiting.appendleft(s)  # as vLLM (and the simulator) prepend the victim
        self._preempted = True
        self._stalled = False
        self._event(event, s, now if t_event is None else t_event, reason=reason, blocks_freed=held,
                    history_tokens=len(s.tokens.history))

    def _let_in(self, plan: SessionPlan, t_enter: float, by_rid: dict) -> None:
        """Past the gate at ``t_enter`` (its arrival, or when the gate's queue let it in): it waits for blocks
        in the FCFS queue, streams from frame ``serving.join_frame(t_enter)`` (due at once if the driver noticed
        it late) and leaves ``duration`` after ``t_enter``."""
        phase = float(serving.phase_offset_s(plan.phase_slot, self.cfg.stream.frame_period_s))
        first = serving.join_frame(t_enter, self.cfg.stream.frame_period_s, phase)
        s = _Session(plan=plan, start_s=t_enter, end_s=t_enter + plan.duration_s, rid=plan.sid, next_frame=first,
                     phase_s=phase)
        self._active[plan.sid] = s
        by_rid[s.rid] = s
        self.waiting.append(s)

    def _refused(self, plan: SessionPlan, now: float, reason: str) -> None:
        self.sink.record("sessions", {"session": plan.sid, "arrival_s": plan.arrival_s, "admitted": False,
                                      "end_s": now, "reason": reason})

    def _submit(self, s: _Session, f: _Frame, now: float, by_rid: dict) -> bool:
        """Append frame ``f`` to the session's request; False if the session had to finish at max_model_len."""
        st = self.cfg.stream
        chunk = s.tokens.chunk(s.plan.prompt_tokens, st.input_tokens_per_frame, self._tokens)
        # vLLM does not enforce max_model_len across chunks and dies if a session passes it,
        # so the driver caps the history itself.
        if not serving.frame_fits(len(s.tokens.history) + len(chunk) + st.output_tokens_per_frame, self.max_len):
            if self.outcome == "finish":
                return False
            # rebase: a new request whose prompt is the last tokens of the history plus this frame
            self.engine.abort(s.rid)
            # (what it keeps, and the frame's chunk; a first frame carrying a long prompt and the input of the
            # frames it waited through keeps what a rebase keeps of all of it: the simulator's rebase_counts)
            kept, chunk = serving.rebase_request_ids(self.policy, s.tokens.history, chunk,
                                                     st.output_tokens_per_frame, self.rebase_keep, self.max_len)
            rid = f"{s.plan.sid}.r{s.incarnation + 1}"
            self.engine.append(rid, kept + chunk, st.output_tokens_per_frame)
            s.rebases += 1
            s.incarnation += 1
            by_rid.pop(s.rid, None)
            s.rid = rid
            by_rid[s.rid] = s
            s.tokens.restarted(kept + chunk)
            f.rebased = True
            self._event("rebase", s, now, prompt_tokens=len(kept) + len(chunk), kept_tokens=len(kept))
        else:
            self.engine.append(s.rid, chunk, st.output_tokens_per_frame)
            s.tokens.sent(chunk)
        s.in_engine = True
        s.work_step = self._nsteps
        f.submitted_s = now
        s.inflight = f
        return True

    def _end(self, s: _Session, now: float, reason: str, by_rid: dict) -> None:
        if s.in_engine:
            self.engine.abort(s.rid)
            self._stalled = False  # the freed blocks may unblock the others
        s.in_engine = False
        if s in self.waiting:
            self.waiting.remove(s)
        pending = ([s.inflight] if s.inflight else []) + list(s.queue)
        pending += [f for (o, f) in self.silent_pending if o is s]
        self.silent_pending = [(o, f) for (o, f) in self.silent_pending if o is not s]
        # frames still owed: a departed session's count once their deadline passed (the client waited in vain):
        # never done (done_s null: summary's frames_unfinished), their latency is until the session left, as the
        # simulator's _end answers them; when the run itself ends they are censored, as the simulator leaves a
        # run's last frames out
        run_over = reason in (EndReason.HORIZON, EndReason.STOPPED, EndReason.ENGINE_DIED)
        for f in sorted(pending, key=lambda f: f.tick_s):
            self._record_frame(s, f, now, censored=run_over or f.tick_s + self.cfg.deadline > now, left_s=now)
        s.inflight, s.queue = None, deque()
        self.sink.record("sessions", {
            "session": s.plan.sid, "arrival_s": s.plan.arrival_s, "admitted": s.admit_seq >= 0, "start_s": s.start_s,
            "end_s": now, "reason": reason, "frames": s.answered, "silent_frames": s.silent, "rebases": s.rebases,
            "preemptions": s.preemptions, "readmissions": s.readmissions})
        by_rid.pop(s.rid, None)
        self._active.pop(s.plan.sid, None)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, plans: list[SessionPlan]) -> RunResult:
        cfg, eng = self.cfg, self.engine
        arrivals = deque(sorted(plans, key=lambda p: p.arrival_s))
        by_rid: dict[str, _Session] = {}  # by current engine request id
        clock = self.clock
        t0 = clock()
        self.supervisor.started()
        self.sink.flush(t0)  # (the clock of every flush: the journals' next write is due a second from here)
        try:
            while True:
                now = clock() - t0
                if now >= cfg.horizon_s or self._stop_reason is not None:
                    break
                if self.sink.flush_due(now + t0):  # an engine that is never idle still gets its rows on disk
                    self._flush()
                try:
                    self._turn(now, t0, arrivals, by_rid)
                except EngineDied as exc:
                    self._flush()
                    self._engine_died(exc, clock() - t0, by_rid)
            now = clock() - t0
            self.supervisor.close(now)
            if self._stop_reason is not None:
                self.t_stopped_s = now
            for s in list(self._active.values()):
                self._end(s, now, self._stop_reason or EndReason.HORIZON, by_rid)
            for plan, _ in self.gate.queue:  # still waiting at the gate: offered, never admitted (the simulator's
                self._refused(plan, now, self._stop_reason or EndReason.HORIZON)  # finalize ends them so too)
            self.gate.queue.clear()
        finally:
            self.sink.close()  # (without retain, the rows went only to the journals: read back here)
        summary = summarize(self.frames, self.steps, self.sessions, eng.num_blocks, self.events)
        summary.update({
            "stopped": self._stop_reason is not None, "stop_reason": self._stop_reason, "t_stopped_s": self.t_stopped_s,
            **self.supervisor.summary(),
        })
        return RunResult(self.frames, self.steps, self.sessions, summary, self.events)

    def _turn(self, now: float, t0: float, arrivals: deque, by_rid: dict) -> None:
        """One turn of the loop: arrivals, ends, admission, due frames, then one engine step (or a nap)."""
        cfg, eng, clock = self.cfg, self.engine, self.clock
        period = cfg.stream.frame_period_s
        if self.supervisor.down_since is not None and self.supervisor.back(now):
            self._stalled = False
        while arrivals and arrivals[0].arrival_s <= now:
            plan = arrivals.popleft()
            decision = self.gate.offer(plan, plan.arrival_s, now, len(self._active))
            self.sink.admission(self.admission, decision == "admit")
            if decision == "admit":
                self._let_in(plan, plan.arrival_s, by_rid)
            elif decision == "refuse":
                self._refused(plan, now, EndReason.REFUSED)
        if self.gate.queue:
            admitted, timed_out = self.gate.retry(now, lambda: len(self._active))
            for plan in timed_out:
                self._refused(plan, now, EndReason.QUEUE_TIMEOUT)
            for plan in admitted:
                self._let_in(plan, now, by_rid)
        for s in [s for s in self._active.values() if now >= s.end_s]:
            self._end(s, now, EndReason.DEPARTED, by_rid)
        self._admit(now, by_rid)
        self._ticks(now, by_rid)
        self._answer_silent(now)
        self.supervisor.watch(now, any(s.inflight is not None or s.state == PREFILL for s in self._active.values()))
        if eng.has_work() and not self._stalled:
            self._step(t0, by_rid)
        else:
            nxt = min([serving.frame_tick(s.next_frame, period, s.phase_s) for s in self._active.values()]
                      + [s.end_s for s in self._active.values()]
                      + ([arrivals[0].arrival_s] if arrivals else []) + [cfg.horizon_s]
                      + ([now + self.gate.poll_s] if self.gate.queue else []))  # the gate's queue is polled
            self._preempted = False  # no step ran: the next admission check is not "right after"
            eng.check_alive()  # an engine in its own process, idle: a step would have noticed its death
            if nxt - (clock() - t0) >= FLUSH_MIN_GAP_S:
                self._flush()  # idle: the rows go to disk off the timing path (records.Journal, deferred)
            self._nap(t0, nxt)

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
            if self.supervisor.down_since is not None:
                return
            eng.check_alive()

    # -- engine death ---------------------------------------------------------------------------------------
    def _engine_died(self, exc: EngineDied, now: float, by_rid: dict) -> None:
        """The engine's process is gone, and every session's KV with it: each session in the engine goes back
        to the head of the waiting queue (in admission order) to be readmitted as a rebase; its frames are
        answered silent meanwhile. Then restart (``restart``) or stop the run (``stop_reason="engine_died"``)."""
        self.supervisor.died(exc, now)
        lost = sorted((s for s in self._active.values() if s not in self.waiting), key=lambda s: s.admit_seq)
        for s in reversed(lost):  # appendleft in reverse: the oldest admitted ends up first
            self._preempt(s, now, "engine_died", 0, event="lost")
        self._preempted = False
        if not self.supervisor.recover(exc, now, len(lost)):
            self.stop(EndReason.ENGINE_DIED)

    def _ticks(self, now: float, by_rid: dict) -> None:
        """Frames that came due: queue (and submit) those of running sessions; waiting and re-prefilling
        sessions get a silent frame, and their input joins their history."""
        period, n_in = self.cfg.stream.frame_period_s, self.cfg.stream.input_tokens_per_frame
        for s in list(self._active.values()):
            while serving.frame_tick(s.next_frame, period, s.phase_s) <= now + _EPS:
                tick = serving.frame_tick(s.next_frame, period, s.phase_s)
                # a tick the driver notices late (it was inside a step) belongs to the state at the tick
                state = s.state if s.state != RUNNING or tick >= s.running_since - _EPS else PREFILL
                f = _Frame(index=s.frames, tick_s=tick, state=state)
                s.frames += 1
                s.next_frame += 1
                if state == RUNNING:
                    s.queue.append(f)
                else:
                    s.tokens.silent(self._tokens(n_in))
                    self._owe(s, f, now)
            if s.state == RUNNING and s.inflight is None and s.queue:
                self._stalled = False  # new input may unblock the engine
                # the frame leaves the queue only once the engine took it (an engine that dies keeps it due)
                if not self._submit(s, s.queue[0], now, by_rid):
                    self._end(s, now, EndReason.LENGTH, by_rid)
                else:
                    s.queue.popleft()

    def _owe(self, s: _Session, f: _Frame, now: float) -> None:
        """A frame of a session without a place, answered short or empty: with its tick's running frames in
        lockstep (:meth:`_answer_silent`), at once with independent phases (as the simulator's ``_owe``)."""
        if self._lockstep:
            self.silent_pending.append((s, f))
        else:
            f.done_s = now
            self._record_frame(s, f, now)

    def _answer_silent(self, now: float) -> None:
        """Answer silent frames once every running session's frame of the same tick is done."""
        if not self.silent_pending:
            return
        unfinished = math.inf
        for s in self._active.values():
            if s.state == RUNNING:
                f = s.inflight or (s.queue[0] if s.queue else None)
                if f is not None:
                    unfinished = min(unfinished, f.tick_s)
        keep = []
        for s, f in self.silent_pending:
            if f.tick_s < unfinished - _EPS:
                f.done_s = now
                self._record_frame(s, f, now)
            else:
                keep.append((s, f))
        self.silent_pending = keep

    def _step(self, t0: float, by_rid: dict) -> None:
        eng, clock = self.engine, self.clock
        t_start = clock() - t0
        step_no = self._nsteps
        info = eng.step()
        if info is None:  # an engine on its own loop reported no step yet (probe.own_loop): back to the clock
            return
        self._nsteps += 1
        self._preempted = False
        now = clock() - t0
        if info.t_end is not None:  # stepped on its own: the step ran and its outputs came in before we looked
            t_start, now = info.t_start - t0, info.t_end - t0
        out_n = self.cfg.stream.output_tokens_per_frame
        for rid, toks in info.outputs.items():
            s = by_rid.get(rid)
            if s is None:
                continue
            if toks:
                self.supervisor.token(now)
            if s.state == PREFILL:  # the re-prefill is done: the sampled token starts the next chunk
                s.tokens.prefilled(toks[-1])
                s.state = RUNNING
                s.running_since = now
                self._event("prefilled", s, now, computed_tokens=info.computed.get(rid, 0),
                            scheduled_tokens=info.scheduled.get(rid, 0))
                continue
            if s.inflight is None:
                continue
            f = s.inflight
            if f.first_s is None:
                f.first_s = now
            f.tokens.extend(toks)
            if now - f.tick_s <= self.cfg.deadline:
                f.by_deadline += len(toks)
            if len(f.tokens) >= out_n:
                # vLLM keeps every sampled token in the history but the last; that one is re-fed next frame
                s.tokens.sampled(f.tokens)
                f.done_s = now
                s.inflight = None
                self._record_frame(s, f, now)
        for rid in info.finished:  # the engine ended a request on its own (e.g. length cap)
            if rid in by_rid:
                self._end(by_rid[rid], now, EndReason.ENGINE_FINISHED, by_rid)
        preempted = self._preempt_after_step(info, step_no, t_start, now, by_rid)
        stalled = info.batch == 0
        if stalled and not preempted:
            self._stalled = True
        self._answer_silent(now)
        p = eng.pool()
        # t_s: the step's start, as in the simulator's steps (metronome.results); t_end_s: when its outputs were in
        row = {"t_s": t_start, "t_end_s": now, "stalled": stalled, "step_s": info.duration_s,
               # context_tokens: the KV the step attended over under the policy, as the simulator's steps and the
               # calibration's fit mean it; raw_context_tokens: the scheduled requests' whole computed histories
               "batch": info.batch, "new_tokens": info.new_tokens,
               "context_tokens": int(sum(self.policy.resident_tokens(k) for k in info.computed.values())),
               "raw_context_tokens": info.context_tokens,
               "prefill_tokens": info.prefill_tokens, "preemptions": len(preempted),
               "preempted": [v for v, _ in preempted], "engine_preempted": info.preempted,
               "free_blocks": p.free_blocks, "used_blocks": p.used_blocks, "kv_usage": p.kv_usage,
               "running": p.running, "waiting": p.waiting, "paused": p.paused,
               "sessions": len(self._active), "sessions_waiting": len(self.waiting),
               "sessions_prefill": sum(1 for s in self._active.values() if s.state == PREFILL),
               "held_tokens": sum(eng.computed_tokens(s.rid) for s in self._active.values() if s.in_engine)}
        self.sink.step(row, self.admission.limit)

    def _preempt_after_step(self, info, step_no: int, t_start: float, now: float,
                            by_rid: dict) -> list[tuple[str, str]]:
        """Break vLLM's paused-session deadlock: preempt (most recently admitted first) while a session with
        work in the engine got nothing in this step for want of blocks. The step ended at ``now``: the victims'
        frames are answered from then (the simulator's _after_step). Returns [(session, reason)]."""
        eng = self.engine
        done: list[tuple[str, str]] = []
        # 1. sessions vLLM itself preempted (a running request, vLLM's own recompute): the driver takes them
        for rid in info.preempted:
            s = by_rid.get(rid)
            if s is not None and s.in_engine:
                self._preempt(s, now, "engine", 0, t_event=t_start)
                done.append((s.plan.sid, "engine"))
        # 2. starved: work handed over before this step, not scheduled in it, and the pool cannot fit it
        starved = []
        for s in self._active.values():
            if (s.in_engine and s.work_step <= step_no and (s.inflight is not None or s.state == PREFILL)
                    and s.rid not in info.scheduled and eng.is_scheduled_waiting(s.rid)):
                starved.append((s, serving.blocks_to_resume(self.policy, eng.tokens_of(s.rid),
                                                            eng.computed_tokens(s.rid), eng.blocks_of(s.rid),
                                                            self.cap_blocks)))
        free = self._free()
        stalled = info.batch == 0 and eng.has_work()
        in_engine = [(s, s.admit_seq, eng.blocks_of(s.rid)) for s in self._active.values() if s.in_engine]
        victims = serving.deadlock_victims(starved, in_engine, free, stalled)
        reason = "pool_dry" if starved and sum(n for _, n in starved) > free else "stall"
        for v in victims:
            held = eng.blocks_of(v.rid)
            self._preempt(v, now, reason, held, t_event=t_start)
            done.append((v.plan.sid, reason))
        return done


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

