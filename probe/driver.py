"""The real-time driver: paces sessions on the frame clock against the live engine and records every frame.

Each session is one long-lived resumable engine request, so its KV persists across frames (no
re-encoding). Every ``frame_period_s`` a session's frame is due: the driver appends the frame's input
tokens and waits for the frame's output tokens. vLLM has no clock; ``step()`` simply blocks, so the
driver keeps the clock itself and measures lateness against it.

A session has at most one frame in the engine. The next frame's chunk must start with the last token the
engine sampled (vLLM drops it from the history), which is only known once the previous frame is done, so
a frame that comes due early waits in the driver and is submitted the moment its predecessor completes.
Its latency still counts from its own tick, so overload shows up as growing frame latency and silent
frames, as a listener would hear it.

Every frame and every engine step is appended to a journal as it happens (see ``records``), so a crash or
Ctrl-C keeps what was measured. Sessions are admitted through an admission controller with the
``observe(now_s, latency_s, frames=1, silent=0)`` / ``may_admit(now_s, in_flight)`` interface shared with
the simulator.
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
from metronome.probe.engine import Engine
from metronome.probe.records import Journal


class AdmissionController(Protocol):
    def observe(self, now_s: float, latency_s: float, frames: int = 1, silent: int = 0) -> None: ...

    def may_admit(self, now_s: float, in_flight: int) -> bool: ...


class AdmitAll:
    """The default controller: admit every session."""

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


@dataclass(frozen=True)
class DriverConfig:
    stream: TokenStream
    horizon_s: float  # wall-clock length of the run
    run: str = "run"  # label stored on every record (e.g. the KV policy)
    deadline_s: float | None = None  # a frame is on time if done within this of its tick (default: one period)
    cap: str = "rebase"  # near max_model_len: "rebase" (new request with the last tokens) or "finish"
    rebase_tokens: int | None = None  # tokens kept by a rebase (default: half of max_model_len)
    seed: int = 0
    vocab_size: int = 1000  # input token ids are drawn from [10, vocab_size)
    prometheus_port: int | None = None

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else self.stream.frame_period_s


@dataclass
class _Frame:
    index: int
    tick_s: float
    submitted_s: float | None = None
    first_s: float | None = None
    done_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    by_deadline: int = 0


@dataclass
class _Session:
    plan: SessionPlan
    start_s: float
    end_s: float
    rid: str  # current engine request id (changes on rebase)
    next_tick_s: float
    history: list[int] = field(default_factory=list)  # token ids the engine holds, for rebasing
    last_token: int | None = None
    queue: deque = field(default_factory=deque)  # due frames not yet submitted
    inflight: _Frame | None = None
    frames: int = 0
    rebases: int = 0
    preemptions: int = 0


@dataclass
class RunResult:
    frames: list[dict]
    steps: list[dict]
    sessions: list[dict]
    summary: dict


class Driver:
    """Runs one scenario (a list of :class:`SessionPlan`) against the engine; use one Driver per run."""

    def __init__(self, engine: Engine, config: DriverConfig, admission: AdmissionController | None = None,
                 out_dir: str | Path | None = None):
        self.engine, self.cfg = engine, config
        self.admission = admission if admission is not None else AdmitAll()
        self.rng = np.random.default_rng(config.seed)
        self.max_len = engine.max_model_len
        self.rebase_keep = config.rebase_tokens or self.max_len // 2
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._journals = {}
        self._metrics = _Metrics(config.prometheus_port) if config.prometheus_port else None
        # True after a step that scheduled nothing: every request waits for blocks that only the driver can
        # free (paused sessions hold them and are not preemptible: the deadlock of notes Q4). Stepping again
        # would spin; the driver waits for its next event instead.
        self._stalled = False
        self.frames: list[dict] = []
        self.steps: list[dict] = []
        self.sessions: list[dict] = []

    # -- records ---------------------------------------------------------------------------------------
    def _record(self, table: str, row: dict) -> None:
        row = {"run": self.cfg.run, **row}
        getattr(self, table).append(row)
        if self.out_dir is not None:
            if table not in self._journals:
                self._journals[table] = Journal(self.out_dir, table)
            self._journals[table].append(row)

    def _record_frame(self, s: _Session, f: _Frame, now: float, censored: bool = False) -> None:
        period = self.cfg.stream.frame_period_s
        latency = (f.done_s - f.tick_s) if f.done_s is not None else None
        silent = f.by_deadline == 0
        met = f.done_s is not None and latency <= self.cfg.deadline + 1e-9
        self._record("frames", {
            "session": s.plan.sid, "frame": f.index, "tick_s": f.tick_s, "submitted_s": f.submitted_s,
            "first_token_s": f.first_s, "done_s": f.done_s, "latency_s": latency,
            "tokens_expected": self.cfg.stream.output_tokens_per_frame, "tokens_delivered": len(f.tokens),
            "tokens_by_deadline": f.by_deadline, "silent": silent, "met_deadline": met, "censored": censored,
            "period_s": period,
        })
        if not censored:
            observed = latency if latency is not None else now - f.tick_s
            self.admission.observe(now, observed, frames=1, silent=int(silent))
            if self._metrics:
                self._metrics.frame(observed, silent)

    # -- sessions --------------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(10, self.cfg.vocab_size, size=n).tolist()

    def _start(self, plan: SessionPlan, now: float) -> _Session:
        return _Session(plan=plan, start_s=now, end_s=plan.arrival_s + plan.duration_s, rid=plan.sid,
                        next_tick_s=max(plan.arrival_s, now))

    def _submit(self, s: _Session, f: _Frame, now: float) -> bool:
        """Append frame ``f`` to the session's request; False if the session had to finish at max_model_len."""
        st = self.cfg.stream
        first = s.last_token is None
        chunk = (self._tokens(max(s.plan.prompt_tokens, 1)) if first else [s.last_token])
        chunk += self._tokens(st.input_tokens_per_frame)
        # vLLM does not enforce max_model_len across chunks and dies if a session passes it (notes Q4),
        # so the driver caps the history itself.
        if len(s.history) + len(chunk) + st.output_tokens_per_frame >= self.max_len:
            if self.cfg.cap == "finish":
                return False
            # rebase: a new request whose prompt is the last tokens of the history plus this frame
            self.engine.abort(s.rid)
            s.rebases += 1
            s.rid = f"{s.plan.sid}.r{s.rebases}"
            s.history = s.history[-self.rebase_keep:] if self.rebase_keep else []
            chunk = s.history + chunk
            s.history = []
        s.history.extend(chunk)
        self.engine.append(s.rid, chunk, st.output_tokens_per_frame)
        f.submitted_s = now
        s.inflight = f
        return True

    def _end(self, s: _Session, now: float, reason: str, active: dict) -> None:
        self.engine.abort(s.rid)
        self._stalled = False  # the freed blocks may unblock the others
        pending = ([s.inflight] if s.inflight else []) + list(s.queue)
        for f in pending:
            self._record_frame(s, f, now, censored=f.tick_s + self.cfg.deadline > now)
        self._record("sessions", {"session": s.plan.sid, "arrival_s": s.plan.arrival_s, "admitted": True,
                                  "start_s": s.start_s, "end_s": now, "reason": reason, "frames": s.frames,
                                  "rebases": s.rebases, "preemptions": s.preemptions})
        del active[s.rid]

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, plans: list[SessionPlan]) -> RunResult:
        cfg, eng = self.cfg, self.engine
        period = cfg.stream.frame_period_s
        arrivals = deque(sorted(plans, key=lambda p: p.arrival_s))
        active: dict[str, _Session] = {}  # by current engine request id
        clock = time.perf_counter
        t0 = clock()
        try:
            while True:
                now = clock() - t0
                if now >= cfg.horizon_s:
                    break
                while arrivals and arrivals[0].arrival_s <= now:
                    plan = arrivals.popleft()
                    if self.admission.may_admit(now, len(active)):
                        s = self._start(plan, now)
                        active[s.rid] = s
                    else:
                        self._record("sessions", {"session": plan.sid, "arrival_s": plan.arrival_s,
                                                  "admitted": False, "reason": "rejected"})
                for s in [s for s in active.values() if now >= s.end_s]:
                    self._end(s, now, "ended", active)
                for s in list(active.values()):
                    while s.next_tick_s <= now:
                        s.queue.append(_Frame(index=s.frames, tick_s=s.next_tick_s))
                        s.frames += 1
                        s.next_tick_s += period
                    if s.inflight is None and s.queue:
                        self._stalled = False  # new input may unblock the engine
                        old = s.rid
                        if not self._submit(s, s.queue.popleft(), now):
                            self._end(s, now, "max_model_len", active)
                        elif s.rid != old:
                            active[s.rid] = active.pop(old)
                if eng.has_work() and not self._stalled:
                    self._step(t0, active)
                else:
                    nxt = min([s.next_tick_s for s in active.values()] + [s.end_s for s in active.values()]
                              + ([arrivals[0].arrival_s] if arrivals else []) + [cfg.horizon_s])
                    time.sleep(max(0.0, min(nxt - (clock() - t0), period)))
            now = clock() - t0
            for s in list(active.values()):
                self._end(s, now, "horizon", active)
        finally:
            for j in self._journals.values():
                j.close()
        return RunResult(self.frames, self.steps, self.sessions,
                         summarize(self.frames, self.steps, self.sessions, eng.num_blocks))

    def _step(self, t0: float, active: dict) -> None:
        eng, clock = self.engine, time.perf_counter
        info = eng.step()
        now = clock() - t0
        for rid, toks in info.outputs.items():
            s = active.get(rid)
            if s is None or s.inflight is None:
                continue
            f = s.inflight
            if f.first_s is None:
                f.first_s = now
            f.tokens.extend(toks)
            if now - f.tick_s <= self.cfg.deadline:
                f.by_deadline += len(toks)
            if len(f.tokens) >= self.cfg.stream.output_tokens_per_frame:
                # vLLM keeps every sampled token in the history but the last; that one is re-fed next frame
                s.history.extend(f.tokens[:-1])
                s.last_token = f.tokens[-1]
                f.done_s = now
                s.inflight = None
                self._record_frame(s, f, now)
        for rid in info.preempted:
            if rid in active:
                active[rid].preemptions += 1
        for rid in info.finished:  # the engine ended a request on its own (e.g. length cap)
            if rid in active:
                self._end(active[rid], now, "engine_finished", active)
        if info.batch == 0:
            self._stalled = True
        p = eng.pool()
        row = {"t_s": now, "stalled": info.batch == 0, "step_s": info.duration_s, "batch": info.batch, "new_tokens": info.new_tokens,
               "context_tokens": info.context_tokens, "prefill_tokens": info.prefill_tokens,
               "preemptions": len(info.preempted), "preempted": info.preempted, "free_blocks": p.free_blocks,
               "used_blocks": p.used_blocks, "kv_usage": p.kv_usage, "running": p.running,
               "waiting": p.waiting, "paused": p.paused, "sessions": len(active),
               "held_tokens": sum(eng.computed_tokens(s.rid) for s in active.values())}
        self._record("steps", row)
        if self._metrics:
            self._metrics.step(row, getattr(self.admission, "limit", None))


def run_live(engine: Engine, stream: TokenStream, plans: list[SessionPlan], horizon_s: float, *,
             policy: KVPolicy | None = None, admission: AdmissionController | None = None,
             out_dir: str | Path | None = None, run: str | None = None, **config) -> RunResult:
    """Run one scenario live on an idle engine and return every frame, step and session plus a summary.

    The engine must already run the policy (``EngineConfig.sliding_window`` for a window); ``policy`` only
    sets what a session keeps when it is rebased near max_model_len (its sinks and window).
    Extra keyword arguments go to :class:`DriverConfig` (deadline_s, cap, seed, prometheus_port, ...).
    """
    if policy is not None and policy.bounded:
        config.setdefault("rebase_tokens", policy.rebase_tokens())
    cfg = DriverConfig(stream=stream, horizon_s=horizon_s, run=run or (policy.describe() if policy else "run"),
                       **config)
    engine.reset()
    try:
        return Driver(engine, cfg, admission=admission, out_dir=out_dir).run(plans)
    finally:
        engine.reset()


def summarize(frames: list[dict], steps: list[dict], sessions: list[dict], num_blocks: int) -> dict:
    """Per-run figures: frame latency, silent/late fractions, and when the pool saturated."""
    done = [f for f in frames if not f["censored"]]
    lat = np.array([f["latency_s"] for f in done if f["latency_s"] is not None], dtype=float)
    n = len(done)
    first_preempt = next((s["t_s"] for s in steps if s["preemptions"]), None)
    # a stall: requests want tokens but the step scheduled nothing (the paused-sessions deadlock of notes Q4)
    first_full = next((s["t_s"] for s in steps if (s["free_blocks"] == 0 and s["waiting"] > 0) or s["stalled"]),
                      None)
    sat = [t for t in (first_preempt, first_full) if t is not None]
    return {
        "frames": n,
        "frames_unfinished": sum(1 for f in done if f["done_s"] is None),
        "silent_frame_fraction": (sum(f["silent"] for f in done) / n) if n else 0.0,
        "deadline_miss_fraction": (sum(not f["met_deadline"] for f in done) / n) if n else 0.0,
        "p50_frame_latency_s": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_frame_latency_s": float(np.percentile(lat, 99)) if lat.size else None,
        "preemptions": int(sum(s["preemptions"] for s in steps)),
        "t_first_preemption_s": first_preempt,
        "t_pool_full_s": first_full,
        "t_sat_observed_s": min(sat) if sat else None,
        "stalls": sum(1 for s in steps if s["stalled"]),
        "peak_used_blocks": max((s["used_blocks"] for s in steps), default=0),
        "num_blocks": num_blocks,
        "steps": len(steps),
        "sessions_admitted": sum(1 for s in sessions if s.get("admitted")),
        "sessions_rejected": sum(1 for s in sessions if not s.get("admitted")),
    }


class _Metrics:
    """Prometheus export (prometheus-client) on a port: limit, p99 frame latency, silent frames, pool."""

    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = r = CollectorRegistry()
        self.limit = Gauge("metronome_admission_limit", "Admission controller's session limit", registry=r)
        self.p99 = Gauge("metronome_frame_latency_p99_seconds", "p99 frame latency, last 500 frames", registry=r)
        self.frames = Counter("metronome_frames", "Frames completed or abandoned", registry=r)
        self.silent = Counter("metronome_silent_frames", "Frames with no token by their deadline", registry=r)
        self.usage = Gauge("metronome_kv_pool_usage", "KV pool occupancy (0-1)", registry=r)
        self.running = Gauge("metronome_sessions_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("metronome_sessions_waiting", "Requests queued or preempted", registry=r)
        self.preempt = Counter("metronome_preemptions", "Engine preemptions", registry=r)
        self._recent = deque(maxlen=500)
        start_http_server(port, registry=r)

    def frame(self, latency: float, silent: bool) -> None:
        self.frames.inc()
        if silent:
            self.silent.inc()
        self._recent.append(latency)
        self.p99.set(float(np.percentile(self._recent, 99)))

    def step(self, row: dict, limit) -> None:
        self.usage.set(row["kv_usage"])
        self.running.set(row["running"])
        self.waiting.set(row["waiting"])
        if row["preemptions"]:
            self.preempt.inc(row["preemptions"])
        if limit is not None:
            self.limit.set(limit)
