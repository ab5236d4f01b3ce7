"""The live driver's Prometheus export (prometheus-client): admission limit, frame latency, silent frames, the
KV pool and the engine's health, updated as the run goes (:class:`metronome.probe.driver.Driver` owns one when
``DriverConfig.prometheus_port`` is set)."""

from __future__ import annotations

import math
from collections import deque

from metronome.results import percentile

RECENT_FRAMES = 500  # the window the latency percentiles and the silent-frame rate are taken over
# real-time frames: periods of 80 ms to 2 s, deadlines about one period
LATENCY_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.12, 0.16, 0.25, 0.5, 1.0, 2.0, 5.0)


def _limit_value(limit: int) -> float:
    return math.inf if limit >= 2**62 else limit  # NoAdmission's sys.maxsize: no limit


class LiveMetrics:
    """Prometheus gauges and counters for one live run, served on a port."""

    def __init__(self, port: int | None):
        """Serves the metrics on ``port``; ``None``: no server (the gauges are only kept, e.g. in a test)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = r = CollectorRegistry()
        self.limit = Gauge("metronome_admission_limit", "Admission controller's session limit", registry=r)
        self.p99 = Gauge("metronome_frame_latency_p99_seconds",
                         "p99 frame latency (nearest rank), last 500 non-silent frames", registry=r)
        self.frames = Counter("metronome_frames", "Frames completed or abandoned", registry=r)
        self.silent = Counter("metronome_silent_frames", "Frames with no token by their deadline", registry=r)
        self.usage = Gauge("metronome_kv_pool_usage", "KV pool occupancy (0-1)", registry=r)
        self.running = Gauge("metronome_sessions_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("metronome_sessions_waiting", "Requests queued or preempted", registry=r)
        self.preempt = Counter("metronome_preemptions", "Engine preemptions", registry=r)
        self.p50 = Gauge("metronome_frame_latency_p50_seconds",
                         "p50 frame latency (nearest rank), last 500 non-silent frames", registry=r)
        self.silent_rate = Gauge("metronome_silent_frame_rate", "Fraction of the last 500 frames that were silent",
                                 registry=r)
        self.admitted = Counter("metronome_sessions_admitted", "Sessions the admission controller admitted",
                                registry=r)
        self.refused = Counter("metronome_sessions_refused", "Sessions refused, by why (refused: the admission "
                               "controller; queue_timeout; a server's unauthorized, starting, draining)",
                               ["reason"], registry=r)
        self.active = Gauge("metronome_sessions_active", "Sessions admitted and not ended", registry=r)
        self.latency = Histogram("metronome_frame_latency_seconds", "Frame latency from its tick (answered frames)",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.late = Counter("metronome_late_frames", "Frames answered without all their tokens by the deadline "
                            "(deadline misses; the silent ones included)", registry=r)
        self.client_sent = Counter("metronome_client_frames", "Input frames clients sent (a server's)", registry=r)
        self.client_answered = Counter("metronome_client_frames_answered", "Input frames answered to their client",
                                       registry=r)
        self.client_counted = Counter("metronome_client_frames_counted", "Input frames not answered, by why",
                                      ["reason"], registry=r)
        self.dead = Gauge("metronome_admission_dead", "1 while the controller sees a dead signal", registry=r)
        self.engine_up = Gauge("metronome_engine_up", "1 while the engine answers, 0 while it is dead or restarting",
                               registry=r)
        self.engine_up.set(1)
        self.restarts = Counter("metronome_engine_restarts", "Times the engine came back after dying", registry=r)
        self.engine_silent = Gauge("metronome_engine_silent", "1 while frames wait and the engine produces no token",
                                   registry=r)
        self.nstar = None  # metronome_n_star, once a server knows its N* (n_star): no series until then
        self._recent = deque(maxlen=RECENT_FRAMES)
        self._recent_silent = deque(maxlen=RECENT_FRAMES)
        self.server, self.thread = (start_http_server(port, registry=r) if port is not None else None) or (None, None)

    def status(self) -> dict:
        """The figures a server's status page shows (metronome.serve.status), read back from the series, so they
        are what ``/metrics`` says and, like it, carry no session content. ``admission_limit``: None when there is
        no limit; ``p50_ms``/``p99_ms``: None before the first non-silent frame; ``n_star``: None without a
        calibration (:meth:`n_star`)."""

        def value(metric, suffix: str = "") -> float:
            return sum(s.value for fam in metric.collect() for s in fam.samples if s.name == fam.name + suffix)

        refused = {}
        for fam in self.refused.collect():
            for s in fam.samples:
                if s.name == fam.name + "_total":
                    refused[s.labels["reason"]] = int(s.value)
        limit = value(self.limit)
        nstar = value(self.nstar) if self.nstar is not None else None
        seen = bool(self._recent)  # (the gauges read 0 before any frame: that is no latency, not a fast one)
        return {"sessions_active": int(value(self.active)),
                "admission_limit": None if math.isinf(limit) else int(limit),
                "p99_ms": round(value(self.p99) * 1e3, 3) if seen else None,
                "p50_ms": round(value(self.p50) * 1e3, 3) if seen else None,
                "refused": sum(refused.values()), "refused_by_reason": refused,
                "admitted": int(value(self.admitted, "_total")), "frames": int(value(self.frames, "_total")),
                "silent_rate": value(self.silent_rate), "kv_pool_usage": value(self.usage),
                "engine_up": bool(value(self.engine_up)), "n_star": None if nstar is None else int(nstar)}

    def compile_now(self) -> None:
        """Compile what :meth:`frame` runs (the percentile, :func:`metronome.results.percentile`, compiled by numba)
        now: a live server calls it before it says ready, else its first frame would wait inside the gateway's
        turn for numba (seconds on an empty cache)."""
        percentile([0.001, 0.002], 99)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def admission(self, controller) -> None:
        """The controller decided on an arrival (``controller``: the driver's ``AdmissionController``)."""
        limit = controller.limit
        if limit is not None:
            self.limit.set(_limit_value(limit))
        self.dead.set(1 if controller.dead else 0)

    def n_star(self, n: int) -> None:
        """The N* of the server's own engine, from its calibration (``metronome-serve --calibrate-first`` or
        ``--calibration``): the sessions ``metronome-sim capacity`` says it holds at the controller's latency target,
        beside the limit the controller finds live."""
        from prometheus_client import Gauge

        if self.nstar is None:
            self.nstar = Gauge("metronome_n_star", "Sessions the calibration of this engine says it holds at the "
                               "admission controller's latency target (metronome-sim capacity's N*)",
                               registry=self.registry)
        self.nstar.set(n)

    def entered(self) -> None:
        """A session was admitted (at once, or from the gate's queue)."""
        self.admitted.inc()

    def refused_for(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def sessions(self, n: int) -> None:
        self.active.set(n)

    def client_frames(self, accounts: dict) -> None:
        """A server's client ended: what it sent, what was answered, what was counted and why."""
        self.client_sent.inc(accounts["sent"])
        self.client_answered.inc(accounts["answered"])
        for k, v in accounts.items():
            if k.startswith("counted_") and v:
                self.client_counted.labels(reason=k[len("counted_"):]).inc(v)

    def frame(self, latency: float, silent: bool, met_deadline: bool = True) -> None:
        self.frames.inc()
        self.latency.observe(latency)
        if not met_deadline:
            self.late.inc()
        if silent:
            self.silent.inc()
        self._recent_silent.append(bool(silent))
        self.silent_rate.set(sum(self._recent_silent) / len(self._recent_silent))
        if not silent:
            self._recent.append(latency)
        if self._recent:  # the one percentile (metronome.results): the summary's and the controller's p99
            self.p99.set(percentile(self._recent, 99))
            self.p50.set(percentile(self._recent, 50))

    def pool(self, p) -> None:
        """The engine's pool now (``probe.engine.PoolState``), read while no step runs: a step sets these gauges
        from its row (:meth:`step`), and an idle engine steps no more, so without this they would keep the last
        step's values (the pool of sessions long gone)."""
        self.usage.set(p.kv_usage)
        self.running.set(p.running)
        self.waiting.set(p.waiting)

    def step(self, row: dict, limit: int | None) -> None:
        """An engine step (the driver's ``steps`` row) and the controller's limit after it."""
        self.usage.set(row["kv_usage"])
        self.running.set(row["running"])
        self.active.set(row["sessions"])
        self.waiting.set(row["waiting"])
        if row["preemptions"]:
            self.preempt.inc(row["preemptions"])
        if limit is not None:
            self.limit.set(_limit_value(limit))
