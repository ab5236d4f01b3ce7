"""What a fleet run is given and gives back: the engine type (a calibration under a KV policy, with its
capacity), the autoscale policy, the run's configuration and its result, and the checks of their inputs (the CLI
and the report run them before any work). The run itself is :mod:`metronome.sim.fleet`; sizing and sweeps over
many runs, :mod:`metronome.sim.fleet_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

import numpy as np
import pandas as pd

from metronome.admission import AIMDParams, make_controller
from metronome.calibration import Calibration
from metronome.erlang import DEFAULT_MAX_REFUSAL, check_refusal
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.workload import Arrivals, Durations

ROUTERS = ("round-robin", "least-loaded", "power-of-two", "random")
CONTROLLERS = ("static", "aimd")


def check_engine_count(n) -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise MetronomeError(f"--engines must be an integer >= 1, got {n}")
    return int(n)


def check_router(name: str) -> str:
    if name not in ROUTERS:
        raise MetronomeError(f"unknown router {name!r} (one of {', '.join(ROUTERS)})")
    return name


def check_offered(arrivals: Arrivals) -> float:
    """The peak offered rate (sessions/s) of a workload a fleet can be sized for."""
    peak = arrivals.peak_rate_per_s
    if not peak:
        raise MetronomeError("the offered load is zero at every time: nothing to size a fleet for")
    return peak


def check_prices(prices: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    """GPU prices (USD per GPU-hour) by calibration name: every name in the run, every price > 0."""
    for name, usd in prices.items():
        if name not in names:
            raise MetronomeError(f"--gpu-price {name}=...: {name!r} is not a calibration in this run "
                                 f"({', '.join(names)})")
        if not (usd > 0 and math.isfinite(usd)):
            raise MetronomeError(f"--gpu-price {name}: the price must be a positive number of USD per hour, got {usd}")
    return dict(prices)


def check_horizon(seconds: float) -> float:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise MetronomeError(f"--horizon must be a positive number of seconds, got {seconds:g}")
    return float(seconds)



# ------------------------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EngineType:
    """One kind of engine: a calibration under a KV policy, with its capacity.

    ``n_star`` is the static admission cap (``capacity()['n_star']``); ``latency_curve`` the p99 frame latency
    at each number of sessions ``capacity()`` evaluated (what an AIMD controller is fed); ``deadline_s`` the
    frame deadline both were found for."""

    calibration: Calibration
    policy: KVPolicy
    n_star: int
    deadline_s: float
    latency_curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if isinstance(self.n_star, bool) or int(self.n_star) != self.n_star or self.n_star < 1:
            raise MetronomeError(f"{self.calibration.name}: N* is {self.n_star} under {self.policy.describe()} "
                                 f"at a {self.deadline_s:g} s deadline: not one session fits, no fleet can serve it")
        if not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise MetronomeError(f"--deadline must be positive seconds, got {self.deadline_s}")
        if self.policy.block_size != self.calibration.engine.block_size_tokens:
            raise MetronomeError("the KV policy's block size differs from the calibration's")

    @classmethod
    def from_capacity(cls, calibration: Calibration, policy: KVPolicy, cap: dict) -> "EngineType":
        """From the dict :func:`metronome.sim.capacity.capacity` returns for this calibration and policy."""
        curve = tuple((int(e["sessions"]), float(e["p_latency_s"])) for e in cap["evaluations"])
        return cls(calibration, policy, int(cap["n_star"]), float(cap["deadline_s"]), curve)

    @property
    def name(self) -> str:
        return self.calibration.name

    @cached_property
    def fill(self) -> FillModel:
        return FillModel(self.calibration, self.policy)

    def needs_memory(self, limit_max: int) -> bool:
        """Whether memory can silence sessions on an engine that admits up to ``limit_max`` sessions."""
        ceiling = self.fill.memory_ceiling()
        return ceiling is None or limit_max > ceiling

    def latency_at(self, running) -> np.ndarray:
        """p99 frame latency with ``running`` sessions running, interpolated along ``latency_curve`` (past its
        last point, that point's value: it is already over the target there, so the verdict is the same)."""
        n, v = zip(*self.latency_curve)
        return np.interp(np.asarray(running, dtype=float), np.asarray(n, dtype=float), np.asarray(v, dtype=float))


def capacity_cached(calibration: Calibration, policy: KVPolicy, deadline_s: float | None, duration_s: float | None,
                    cache: dict, phases: str = "independent") -> dict:
    """:func:`metronome.sim.capacity.capacity` once per (calibration, policy, deadline, session length, phases)
    in ``cache`` (a dict the caller keeps for a run: capacity takes tens of seconds on some calibrations)."""
    from metronome.sim.capacity import capacity

    key = (calibration.to_json(), policy, deadline_s, duration_s, phases)
    if key not in cache:
        cache[key] = capacity(calibration, policy, deadline_s, duration_s=duration_s, phases=phases)
    return cache[key]


# ------------------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class AutoscalePolicy:
    """When the fleet grows and shrinks (see :mod:`metronome.sim.fleet`). Times in seconds."""

    min_engines: int = 1
    max_engines: int | None = None
    scale_out_after_s: float = 30.0
    scale_in_after_s: float = 600.0
    start_delay_s: float = 180.0
    scale_out_utilization: float = 0.9
    scale_in_utilization: float = 0.7
    max_refusal: float = DEFAULT_MAX_REFUSAL
    check_s: float = 10.0

    def __post_init__(self):
        if isinstance(self.min_engines, bool) or int(self.min_engines) != self.min_engines or self.min_engines < 1:
            raise MetronomeError(f"--min-engines must be an integer >= 1, got {self.min_engines}")
        if self.max_engines is not None and (int(self.max_engines) != self.max_engines
                                             or self.max_engines < self.min_engines):
            raise MetronomeError(f"--max-engines must be an integer >= --min-engines ({self.min_engines}), "
                                 f"got {self.max_engines}")
        for name, flag_ in (("scale_out_after_s", "--scale-out-after"), ("scale_in_after_s", "--scale-in-after"),
                            ("start_delay_s", "--engine-start-s")):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise MetronomeError(f"{flag_} must be a finite number of seconds >= 0, got {v}")
        if not (self.check_s > 0 and math.isfinite(self.check_s)):
            raise MetronomeError(f"the autoscaler's check interval must be > 0 s, got {self.check_s}")
        check_refusal(self.max_refusal)
        lo, hi = self.scale_in_utilization, self.scale_out_utilization
        if not (0 < lo < hi <= 1):
            raise MetronomeError(f"autoscaling needs 0 < --scale-in-utilization < --scale-out-utilization <= 1, "
                                 f"got {lo:g} and {hi:g}")

    @property
    def target_utilization(self) -> float:
        """The utilisation a scaling decision aims at: the middle of the two thresholds."""
        return (self.scale_in_utilization + self.scale_out_utilization) / 2


# ------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class FleetConfig:
    """One fleet run. ``engines`` is the fleet's size (static) or its size at t=0 (autoscaled).

    ``warmup_s``: the totals (refused and silent fractions) count only sessions arriving from then on (the
    fleet starts empty); the per-bin tables cover the whole run. ``bin_s``: the length of a table row (an hour)."""

    engine: EngineType
    engines: int
    arrivals: Arrivals
    durations: Durations
    horizon_s: float
    router: str = "least-loaded"
    seed: int = 0
    controller: str = "static"
    aimd_params: AIMDParams | None = None
    autoscale: AutoscalePolicy | None = None
    warmup_s: float = 0.0
    bin_s: float = 3600.0
    memory_grid_s: float = 5.0

    def __post_init__(self):
        check_engine_count(self.engines)
        check_router(self.router)
        if self.controller not in CONTROLLERS:
            raise MetronomeError(f"unknown fleet admission controller {self.controller!r} "
                                 f"(one of {', '.join(CONTROLLERS)})")
        if self.controller == "aimd" and not self.engine.latency_curve:
            raise MetronomeError("the AIMD controller is fed the engine's latency curve; this engine type has none")
        if not isinstance(self.durations, Durations):
            raise MetronomeError("a fleet needs session durations (--session-duration): sessions must also leave")
        check_horizon(self.horizon_s)
        if not 0 <= self.warmup_s < self.horizon_s:
            raise MetronomeError(f"the warm-up ({self.warmup_s:g} s) must be in [0, horizon {self.horizon_s:g} s)")
        if not (self.bin_s > 0 and math.isfinite(self.bin_s)):
            raise MetronomeError(f"the table's bin must be positive seconds, got {self.bin_s}")
        if not (self.memory_grid_s > 0 and math.isfinite(self.memory_grid_s)):
            raise MetronomeError(f"the memory grid must be positive seconds, got {self.memory_grid_s}")
        a = self.autoscale
        if a is not None and not (a.min_engines <= self.engines <= (a.max_engines or self.engines)):
            raise MetronomeError(f"the fleet starts with {self.engines} engines, outside the autoscaler's "
                                 f"[{a.min_engines}, {a.max_engines}]")

    @property
    def params(self) -> AIMDParams:
        return self.aimd_params or AIMDParams()

    def make_controller(self):
        """A fresh controller for one engine. A static cap decides nothing per interval, so its control
        interval is only the granularity of its trace: one row per table bin keeps a day's trace small."""
        if self.controller == "static":
            return make_controller(f"static:{self.engine.n_star}", self.engine.deadline_s,
                                   replace(self.params, interval_s=self.bin_s))
        return make_controller("aimd", self.engine.deadline_s, self.params)

    @property
    def limit_max(self) -> int:
        return self.engine.n_star if self.controller == "static" else self.params.max_limit

    def describe(self) -> str:
        mode = "autoscaled" if self.autoscale else "static"
        return (f"{self.engine.name} · {self.engine.policy.describe()} · {self.engines} engines ({mode}) · "
                f"{self.router} router · {self.controller} admission · {self.arrivals.describe()} · "
                f"{self.durations.describe()} · {self.horizon_s:g} s · seed {self.seed}")


@dataclass
class FleetResult:
    """``bins``: one row per bin of the run (offered, admitted, refused, silent frames, engines, GPU-hours);
    ``engines``: one row per engine per bin (in flight, silent frames, admitted, refused, limit); ``lifecycle``:
    one row per engine (provisioned, serving from, released; ``inf``: still there at the horizon); ``totals``."""

    config: FleetConfig
    bins: pd.DataFrame
    engines: pd.DataFrame
    lifecycle: pd.DataFrame
    totals: dict
