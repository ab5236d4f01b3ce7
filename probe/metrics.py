"""The live driver's Prometheus export (prometheus-client): admission limit, frame latency, silent frames, the
KV pool and the engine's health, updated as the run goes (:class:`metronome.probe.driver.Driver` owns one when
``DriverConfig.prometheus_port`` is set)."""

from __future__ import annotations

import math
from collections import deque

from metronome.results import percentile

RECENT_FRAMES = 500  # the window the latency percentiles and the silent-frame rate are taken over


def _limit_value(limit: int) -> float:
    return math.inf if limit >= 2**62 else limit  # NoAdmission's sys.maxsize: no limit


class LiveMetrics:
    """Prometheus gauges and counters for one live run, served on a port."""

    def __init__(self, port: int | None):
        """Serves the metrics on ``port``; ``None``: no server (the gauges are only kept, e.g. in a test)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

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
        self.refused = Counter("metronome_sessions_refused", "Sessions the admission controller refused",
                                registry=r)
        self.dead = Gauge("metronome_admission_dead", "1 while the controller sees a dead signal", registry=r)
        self.engine_up = Gauge("metronome_engine_up", "1 while the engine answers, 0 while it is dead or restarting",
                               registry=r)
        self.engine_up.set(1)
        self.restarts = Counter("metronome_engine_restarts", "Times the engine came back after dying", registry=r)
        self.engine_silent = Gauge("metronome_engine_silent", "1 while frames wait and the engine produces no token",
                                   registry=r)
        self._recent = deque(maxlen=RECENT_FRAMES)
        self._recent_silent = deque(maxlen=RECENT_FRAMES)
        self.server, self.thread = (start_http_server(port, registry=r) if port is not None else None) or (None, None)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def admission(self, controller, admitted: bool) -> None:
        """The controller decided on an arrival (``controller``: the driver's ``AdmissionController``)."""
        (self.admitted if admitted else self.refused).inc()
        limit = controller.limit
        if limit is not None:
            self.limit.set(_limit_value(limit))
        self.dead.set(1 if controller.dead else 0)

    def frame(self, latency: float, silent: bool) -> None:
        self.frames.inc()
        if silent:
            self.silent.inc()
        self._recent_silent.append(bool(silent))
        self.silent_rate.set(sum(self._recent_silent) / len(self._recent_silent))
        if not silent:
            self._recent.append(latency)
        if self._recent:  # the one percentile (metronome.results): the summary's and the controller's p99
            self.p99.set(percentile(self._recent, 99))
            self.p50.set(percentile(self._recent, 50))

    def step(self, row: dict, limit: int | None) -> None:
        """An engine step (the driver's ``steps`` row) and the controller's limit after it."""
        self.usage.set(row["kv_usage"])
        self.running.set(row["running"])
        self.waiting.set(row["waiting"])
        if row["preemptions"]:
            self.preempt.inc(row["preemptions"])
        if limit is not None:
            self.limit.set(_limit_value(limit))
