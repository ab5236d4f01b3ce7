"""Fleets: G engines behind a router, simulated at the level of sessions — who is admitted where, for how long,
and which admitted sessions the engine's memory leaves silent.

An engine is a loss system with an admission controller of its own, the project's real controller classes
(:func:`metronome.admission.make_controller`): ``static`` (a cap at the engine's ``N*``) or ``aimd`` (the AIMD
controller, fed every control interval the engine's p99 frame latency at its current number of running
sessions, interpolated from :func:`metronome.sim.capacity.capacity`'s ``evaluations`` curve, and its silent
frames). A router sends each arriving session to one serving engine:

* ``round-robin`` — the next serving engine in turn;
* ``least-loaded`` — the serving engine with the fewest sessions in flight (the lowest-numbered on a tie). With
  equal static caps it finds an engine with room whenever one exists, so the fleet refuses as one loss system
  of ``G·N*`` places (Erlang B pooled, :mod:`metronome.erlang`); under AIMD the limits differ and it need not;
* ``power-of-two`` — two distinct serving engines drawn at random, the one with fewer in flight;
* ``random`` — a serving engine drawn at random (each engine a loss system fed ``A/G``).

A session the chosen engine refuses is refused at the door: it does not try another engine. The router sees
in-flight counts only.

**Memory.** Under a bounded KV policy and a static cap the cap is ``N*``, already inside the memory ceiling, so
memory never silences anyone. Otherwise (unbounded KV, or an AIMD limit that may pass the ceiling) an engine
holds, at every instant, the blocks each of its sessions holds at its age
(:meth:`metronome.fill_model.FillModel.blocks_at_age`); it runs its sessions in admission order while their
blocks fit in its usable blocks (and ``max_num_seqs``), and the rest are silent: vLLM preempts the most recently
admitted, and its waiting queue is first come, first served. A silent session still counts in flight, so the
router keeps sending sessions to an engine whose long-lived sessions have run its pool dry. The silent share is
evaluated on a grid of ``memory_grid_s`` over the whole run (vectorised, after the run, when only the statistics
need it: the grid misses changes shorter than a grid step, an error of about ``memory_grid_s`` over the mean
session length) and, for AIMD, also at each event on the engine (the controller acts on it). It is the fill
model's approximation: a preempted session comes back holding all the blocks of its age (the simulator's engine
lets it back with fewer, so this runs a few percent above it, as :meth:`FillModel.silenced_fraction` notes), and
an unbounded session that reaches ``max_model_len`` keeps its blocks until it ends (vLLM would end it).

**Autoscaling** (:class:`AutoscalePolicy`): every ``check_s`` the autoscaler looks at the fleet's utilisation,
sessions in flight on serving engines over the places of the serving and starting engines (a starting engine
counts ``N*``). Pressure = utilisation above ``scale_out_utilization`` (engines at or near their limit), or
more than ``max_refusal`` of the arrivals since the last check refused while no engine is starting (a
refusal an engine already starting will answer is not counted twice); after ``scale_out_after_s`` of it, it
brings enough engines (draining ones back first, then new ones that serve after ``start_delay_s``) to bring
utilisation to the middle of the two thresholds, at least one. Slack = utilisation below
``scale_in_utilization`` and no refusal over the target; after ``scale_in_after_s`` of it, it drains engines
(the least loaded) down to that middle: a draining engine takes no new session and is released when its last
one ends. GPU-hours integrate every engine from its start to its release (starting, serving, draining).

Everything is event-driven on arrivals, departures, engine starts and autoscaler checks; the same
configuration and seed give the same result (the sessions come from :func:`metronome.workload.draw`, the
router's draws from a generator of their own seeded with the same seed).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from metronome.admission import AIMDParams, make_controller
from metronome.calibration import Calibration
from metronome.erlang import DEFAULT_MAX_REFUSAL, batch_means_interval, check_refusal, engines_needed
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.workload import Arrivals, Durations, draw

from metronome.sim.executors import LocalExecutor

ROUTERS = ("round-robin", "least-loaded", "power-of-two", "random")
CONTROLLERS = ("static", "aimd")
# Which closed form a router's simulated sizing search starts from (the others lie between the two).
CLOSED_FORM_START = {"least-loaded": "pooled", "round-robin": "pooled", "power-of-two": "pooled", "random": "random"}
_ROUTER_STREAM = 0xF1EE7  # the router's draws: a generator of their own, so sessions do not depend on the router
_STARTING, _SERVING, _DRAINING, _RELEASED = 0, 1, 2, 3
_FREE = 1 << 40  # the load least-loaded sees for an engine that is not serving


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
    """When the fleet grows and shrinks (see the module docstring). Times in seconds."""

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


# ------------------------------------------------------------------------------------------- memory
def _silent_mask(blocks: np.ndarray, starts: np.ndarray, usable: int, max_seqs: int) -> np.ndarray:
    """Which sessions are silent, for groups of sessions (one engine at one instant each) laid one after another,
    each in admission order: a group runs the longest prefix whose blocks fit in ``usable`` blocks and that has
    at most ``max_seqs`` sessions; the rest wait (vLLM preempts the most recently admitted, and its waiting
    queue is first come, first served)."""
    if blocks.size == 0:
        return np.zeros(0, dtype=bool)
    lens = np.diff(np.append(starts, blocks.size))
    first = np.repeat(starts, lens)
    cs = np.cumsum(blocks)
    within = cs - (cs - blocks)[first]
    return (within > usable) | (np.arange(blocks.size) - first >= max_seqs)


def _silent_on_grid(start, stop, eng, n_eng, fill: FillModel, max_seqs: int, grid_s: float, horizon_s: float,
                    bin_s: float, n_bins: int):
    """Silent and in-flight session counts summed over the ticks ``(k + ½)·grid_s`` of each (engine, bin), for
    admitted sessions in admission order (``start`` sorted)."""
    silent = np.zeros(n_eng * n_bins)
    flying = np.zeros(n_eng * n_bins)
    n_ticks = int(math.ceil(horizon_s / grid_s - 0.5))
    if start.size == 0 or n_ticks <= 0:
        return silent.reshape(n_eng, n_bins), flying.reshape(n_eng, n_bins)
    first_tick = np.maximum(np.ceil(start / grid_s - 0.5), 0).astype(np.int64)  # first k with (k+½)g >= start
    end_tick = np.minimum(np.ceil(stop / grid_s - 0.5), n_ticks).astype(np.int64)  # first k with (k+½)g >= stop
    chunk = max(1, int(300 // grid_s))  # five minutes of ticks at a time: a 100-engine fleet's pairs stay ~50 MB
    for k0 in range(0, n_ticks, chunk):
        k1 = min(n_ticks, k0 + chunk)
        hi = int(np.searchsorted(first_tick, k1, side="left"))
        cand = np.flatnonzero(end_tick[:hi] > k0)
        if cand.size == 0:
            continue
        a = np.maximum(first_tick[cand], k0)
        b = np.minimum(end_tick[cand], k1)
        lens = np.maximum(b - a, 0)
        total = int(lens.sum())
        if total == 0:
            continue
        sess = np.repeat(cand, lens)
        k = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(a, lens)
        t = (k + 0.5) * grid_s
        key = (k - k0) * n_eng + eng[sess]
        order = np.argsort(key, kind="stable")  # stable: within an (instant, engine), admission order stays
        key, sess, t = key[order], sess[order], t[order]
        blocks = fill.blocks_at_age(t - start[sess])
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        mute = _silent_mask(blocks, starts, fill.usable_blocks, max_seqs)
        cell = eng[sess] * n_bins + np.minimum((t // bin_s).astype(np.int64), n_bins - 1)
        silent += np.bincount(cell, weights=mute, minlength=n_eng * n_bins)
        flying += np.bincount(cell, minlength=n_eng * n_bins)
    return silent.reshape(n_eng, n_bins), flying.reshape(n_eng, n_bins)


def _overlap_by_bin(start, stop, group, n_groups: int, edges: np.ndarray) -> np.ndarray:
    """Seconds each group's intervals ``[start, stop)`` spend in each bin ``[edges[k], edges[k+1])``."""
    cum = np.empty((n_groups, edges.size))
    for k, e in enumerate(edges):
        cum[:, k] = np.bincount(group, weights=np.clip(np.minimum(stop, e) - start, 0, None), minlength=n_groups)
    return np.diff(cum, axis=1)


def _level_max_by_bin(start, stop, group, n_groups: int, edges: np.ndarray) -> np.ndarray:
    """The most intervals of each group open at once within each bin (a departure before an arrival at the same
    instant, as the simulation processes them)."""
    n_bins = edges.size - 1
    out = np.zeros((n_groups, n_bins), dtype=np.int64)
    for k in range(n_bins):  # the level carried into each bin
        at = (start <= edges[k]) & (stop > edges[k])
        out[:, k] = np.bincount(group[at], minlength=n_groups)
    inside = stop < edges[-1]
    t = np.concatenate([start, stop[inside]])
    d = np.concatenate([np.ones(start.size, dtype=np.int64), -np.ones(int(inside.sum()), dtype=np.int64)])
    g = np.concatenate([group, group[inside]])
    order = np.lexsort((d, t, g))
    t, d, g = t[order], d[order], g[order]
    level = np.cumsum(d)
    firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    level -= np.repeat(level[firsts] - d[firsts], np.diff(np.append(firsts, g.size)))
    b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n_bins - 1)
    np.maximum.at(out, (g, b), level)
    return out


def _expected_by_bin(arrivals: Arrivals, edges: np.ndarray) -> np.ndarray:
    """Sessions the arrival rate offers in each bin (the integral of the rate; ``all``/``ramp``: none)."""
    if arrivals.kind == "poisson":
        return arrivals.rate_per_s * np.diff(edges)
    if arrivals.kind != "pattern":
        return np.zeros(edges.size - 1)
    lengths = np.array([d for d, _ in arrivals.segments], dtype=float)
    rates = np.array([r for _, r in arrivals.segments], dtype=float)
    starts = np.cumsum(lengths) - lengths
    # sessions offered from 0 to each edge: every segment's rate times the part of it before the edge
    cum = np.clip(edges[:, None] - starts[None, :], 0.0, lengths[None, :]) @ rates
    return np.diff(cum)


# ------------------------------------------------------------------------------------------- the run
class _Run:
    """The state of one fleet run; :func:`simulate` is its interface."""

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        et = cfg.engine
        self.n_star = et.n_star
        self.aimd = cfg.controller == "aimd"
        self.memory = et.needs_memory(cfg.limit_max)
        self.fill = et.fill
        self.max_seqs = et.calibration.engine.max_num_seqs
        self.period = et.calibration.stream.frame_period_s
        self.peak_blocks = self.fill.peak_resident_blocks
        self.lat_cache: dict[int, float] = {}
        self.n_bins = int(math.ceil(cfg.horizon_s / cfg.bin_s - 1e-9))
        # engines, indexed by id (never reused)
        self.state: list[int] = []
        self.inflight: list[int] = []
        self.ctl: list = []
        self.t_prov: list[float] = []
        self.t_serve: list[float] = []
        self.t_rel: list[float] = []
        self.fed: list[float] = []  # AIMD: the time up to which the controller has been fed
        self.active: list[list[int]] = []  # AIMD with memory: each engine's sessions, in admission order
        self.load = np.full(max(16, cfg.engines), _FREE, dtype=np.int64)
        self.serving: list[int] = []
        self.ready: list[tuple[float, int]] = []  # (time an engine starts serving, id)
        self.refused_count = 0
        self.limit_sum: dict[tuple[int, int], float] = {}
        self.limit_n: dict[tuple[int, int], int] = {}
        self.decreases: dict[tuple[int, int], int] = {}

    # -- engines ---------------------------------------------------------------------------------------
    def provision(self, t: float, serve_at: float) -> int:
        e = len(self.state)
        if e >= self.load.size:
            self.load = np.concatenate([self.load, np.full(self.load.size, _FREE, dtype=np.int64)])
        self.state.append(_STARTING)
        self.inflight.append(0)
        self.ctl.append(self.cfg.make_controller())
        self.t_prov.append(t)
        self.t_serve.append(math.inf)
        self.t_rel.append(math.inf)
        self.fed.append(serve_at)
        self.active.append([])
        if serve_at <= t:
            self.serve(e, t)
        else:
            heapq.heappush(self.ready, (serve_at, e))
        return e

    def serve(self, e: int, t: float) -> None:
        if self.state[e] == _STARTING:
            self.t_serve[e] = t
            self.fed[e] = t
            self.ctl[e].advance(t, 0)  # the controller's control intervals start when the engine does
        self.state[e] = _SERVING
        self.load[e] = self.inflight[e]
        self.serving = sorted(self.serving + [e])

    def drain(self, e: int, t: float) -> None:
        self.state[e] = _DRAINING
        self.load[e] = _FREE
        self.serving.remove(e)
        if self.inflight[e] == 0:
            self.release(e, t)

    def release(self, e: int, t: float) -> None:
        if self.aimd:
            self.feed(e, t)
        self.state[e] = _RELEASED
        self.t_rel[e] = t

    # -- AIMD's signal ---------------------------------------------------------------------------------
    def may_mute(self, e: int, t: float) -> bool:
        """Whether memory can silence any of engine ``e``'s sessions by ``t`` (a cheap bound: every session
        holding as many blocks as the most any can hold by then)."""
        sess = self.active[e]
        n = len(sess)
        if not self.memory or n == 0:
            return False
        if n > self.max_seqs:
            return True
        if self.peak_blocks is not None:
            most = self.peak_blocks
        else:  # unbounded: the oldest session holds the most
            most = float(self.fill.blocks_at_age(t - self.arr[sess[0]]))
        return n * most > self.fill.usable_blocks

    def silent_counts(self, e: int, times: np.ndarray) -> np.ndarray:
        """Silent sessions on engine ``e`` at each of ``times`` (its sessions as they are now)."""
        sess = self.active[e]
        n = len(sess)
        ages = times[:, None] - self.arr[np.asarray(sess)][None, :]
        blocks = self.fill.blocks_at_age(ages).ravel()
        mute = _silent_mask(blocks, np.arange(times.size) * n, self.fill.usable_blocks, self.max_seqs)
        return mute.reshape(times.size, n).sum(axis=1)

    def latency(self, running: int) -> float:
        v = self.lat_cache.get(running)
        if v is None:
            v = self.lat_cache[running] = float(self.cfg.engine.latency_at(running))
        return v

    def feed(self, e: int, t: float) -> None:
        """Hand engine ``e``'s controller what it answered from the last feed up to ``t`` (its in-flight count
        unchanged meanwhile): a row per control interval, the silent count evaluated at the span's start and on
        the memory grid, the frames counted on the sessions' frame clocks (``floor(n·t/period)`` answered by
        ``t``)."""
        t0 = self.fed[e]
        if t <= t0:
            return
        self.fed[e] = t
        ctl = self.ctl[e]
        n = self.inflight[e]
        if n == 0:
            ctl.advance(t, 0)
        else:
            I, anchor = ctl.interval_s, self.t_serve[e]
            k = math.floor((t0 - anchor) / I) + 1
            tau = [t0]
            while anchor + k * I < t:
                if anchor + k * I > t0:
                    tau.append(anchor + k * I)
                k += 1
            tau.append(t)
            rows = len(tau) - 1
            if self.may_mute(e, t):
                g = self.cfg.memory_grid_s
                grid = [g * j for j in range(math.floor(t0 / g) + 1, math.ceil(t / g)) if t0 < g * j < t]
                evals = np.array([t0] + grid)
                counts = self.silent_counts(e, evals)
                s_rows = counts[np.searchsorted(evals, np.array(tau[:-1]), side="right") - 1].tolist()
            else:
                s_rows = [0] * rows
            P = self.period
            for j in range(rows):
                a, b, s = tau[j], tau[j + 1], int(s_rows[j])
                f = math.floor(n * b / P) - math.floor(n * a / P)
                ctl.advance(a, n)
                ctl.observe(a, self.latency(n - s), f, min(f, math.floor(s * b / P) - math.floor(s * a / P)))
        self._take_trace(e)

    def _take_trace(self, e: int) -> None:
        bin_s = self.cfg.bin_s
        for row in self.ctl[e].take_trace():
            key = (e, min(int((row["t_s"] - 1e-9) // bin_s), self.n_bins - 1))
            self.limit_sum[key] = self.limit_sum.get(key, 0.0) + row["limit"]
            self.limit_n[key] = self.limit_n.get(key, 0) + 1
            if row["decision"] == "decrease":
                self.decreases[key] = self.decreases.get(key, 0) + 1

    # -- the autoscaler --------------------------------------------------------------------------------
    def autoscale(self, t: float) -> None:
        pol = self.cfg.autoscale
        starting = [e for e, s in enumerate(self.state) if s == _STARTING]
        draining = [e for e, s in enumerate(self.state) if s == _DRAINING]
        in_s = sum(self.inflight[e] for e in self.serving)
        places = sum(self.ctl[e].limit for e in self.serving) + self.n_star * len(starting)
        u = in_s / places if places else (math.inf if in_s else 0.0)
        refused, arrived = self.refused_count - self.refused_seen, self.arrived - self.arrived_seen
        self.refused_seen, self.arrived_seen = self.refused_count, self.arrived
        refusing = arrived > 0 and refused > pol.max_refusal * arrived
        pressure = u > pol.scale_out_utilization or (refusing and not starting)
        slack = not pressure and not refusing and u < pol.scale_in_utilization
        self.pressure_since = (self.pressure_since if self.pressure_since is not None else t) if pressure else None
        self.slack_since = (self.slack_since if self.slack_since is not None else t) if slack else None
        active = len(self.serving) + len(starting)
        want = math.ceil(in_s / (pol.target_utilization * self.n_star))
        if pressure and t - self.pressure_since >= pol.scale_out_after_s:
            self.pressure_since = None
            k = max(1, want - active)
            for e in sorted(draining, key=lambda x: -self.inflight[x])[:k]:
                self.serve(e, t)
                k -= 1
            room = (pol.max_engines - (active + len(draining))) if pol.max_engines is not None else k
            for _ in range(max(0, min(k, room))):
                self.provision(t, t + pol.start_delay_s)
        elif slack and t - self.slack_since >= pol.scale_in_after_s:
            self.slack_since = None
            k = min(active - max(pol.min_engines, want), len(self.serving))
            for e in sorted(self.serving, key=lambda x: (self.inflight[x], -x))[:max(0, k)]:
                self.drain(e, t)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        arr, dur = draw(cfg.arrivals, cfg.durations, cfg.horizon_s, cfg.seed)
        n = arr.size
        self.arr = arr
        stop = arr + dur
        dep_order = np.argsort(stop, kind="stable")
        dep_t, dep_i = stop[dep_order].tolist(), dep_order.tolist()
        arr_l = arr.tolist()
        u1 = u2 = []
        if cfg.router in ("random", "power-of-two"):  # the draws are the router's own: none for the others
            u = np.random.default_rng([cfg.seed, _ROUTER_STREAM]).random((2, n))
            u1, u2 = u[0].tolist(), u[1].tolist()
        self.eng_of = eng_of = [-1] * n
        self.chosen = chosen = [-1] * n
        for _ in range(cfg.engines):
            self.provision(0.0, 0.0)
        pol = cfg.autoscale
        self.refused_seen = self.arrived = self.arrived_seen = 0
        self.pressure_since = self.slack_since = None
        check_s = pol.check_s if pol else math.inf
        next_check = check_s
        inflight, state, ctl, load, active = self.inflight, self.state, self.ctl, self.load, self.active
        aimd, track = self.aimd, self.aimd and self.memory
        router = ROUTERS.index(cfg.router)
        rr = 0
        dp = 0
        INF = math.inf
        for i in range(n + 1):
            t = arr_l[i] if i < n else cfg.horizon_s
            while True:  # everything due by t, in time order: departures, then engine starts and checks
                td = dep_t[dp] if dp < n else INF
                tt = min(next_check, self.ready[0][0]) if self.ready else next_check
                if td <= tt:
                    if td > t:
                        break
                    j = dep_i[dp]
                    dp += 1
                    e = eng_of[j]
                    if e < 0:
                        continue
                    if aimd:
                        self.feed(e, td)
                    inflight[e] -= 1
                    if track:
                        active[e].remove(j)
                    s = state[e]
                    if s == _SERVING:
                        load[e] -= 1
                    elif s == _DRAINING and inflight[e] == 0:
                        self.release(e, td)
                else:
                    if tt > t:
                        break
                    if self.ready and self.ready[0][0] <= tt:
                        _, e = heapq.heappop(self.ready)
                        self.serve(e, tt)
                    else:
                        self.autoscale(tt)
                        next_check += check_s
            if i == n:
                break
            if pol is not None:
                load = self.load  # provisioning may have grown it
                self.arrived = i + 1
            serving = self.serving
            m = len(serving)
            if m == 0:
                self.refused_count += 1
                continue
            if router == 1:  # least-loaded
                e = int(load.argmin())
            elif router == 0:  # round-robin
                e = serving[rr % m]
                rr += 1
            elif router == 3:  # random
                e = serving[int(u1[i] * m)]
            else:  # power-of-two
                a = int(u1[i] * m)
                e = serving[a]
                if m > 1:
                    b = int(u2[i] * (m - 1))
                    b = serving[b + 1 if b >= a else b]
                    if inflight[b] < inflight[e]:
                        e = b
            chosen[i] = e
            if aimd:
                self.feed(e, t)
            if ctl[e].may_admit(t, inflight[e]):
                inflight[e] += 1
                load[e] += 1
                eng_of[i] = e
                if track:
                    active[e].append(i)
            else:
                self.refused_count += 1
        if aimd:
            for e, s in enumerate(state):
                if s != _RELEASED:
                    self.feed(e, cfg.horizon_s)
        self.stop = np.minimum(stop, cfg.horizon_s)

    # -- the tables ------------------------------------------------------------------------------------
    def tables(self) -> FleetResult:
        cfg = self.cfg
        H, n_bins = cfg.horizon_s, self.n_bins
        edges = np.minimum(np.arange(n_bins + 1) * cfg.bin_s, H)
        width = np.diff(edges)
        n_eng = len(self.state)
        eng_of = np.asarray(self.eng_of, dtype=np.int64)
        chosen = np.asarray(self.chosen, dtype=np.int64)
        arr = self.arr
        adm = eng_of >= 0
        bin_of = np.minimum((arr // cfg.bin_s).astype(np.int64), n_bins - 1)
        offered = np.bincount(bin_of, minlength=n_bins)
        admitted = np.bincount(bin_of[adm], minlength=n_bins)
        refused = offered - admitted
        # per engine: sessions, silent frames, provisioned time
        start, stop, eng = arr[adm], self.stop[adm], eng_of[adm]
        in_flight_s = _overlap_by_bin(start, stop, eng, n_eng, edges)
        in_flight_max = _level_max_by_bin(start, stop, eng, n_eng, edges)
        if self.memory:
            silent_ticks, flying_ticks = _silent_on_grid(start, stop, eng, n_eng, self.fill, self.max_seqs,
                                                         cfg.memory_grid_s, H, cfg.bin_s, n_bins)
        else:
            silent_ticks = flying_ticks = np.zeros((n_eng, n_bins))
        t_prov = np.asarray(self.t_prov)
        t_rel = np.minimum(np.asarray(self.t_rel), H)
        ids = np.arange(n_eng)
        prov_s = _overlap_by_bin(t_prov, t_rel, ids, n_eng, edges)
        eng_level = _level_max_by_bin(t_prov, t_rel, np.zeros(n_eng, dtype=np.int64), 1, edges)[0]
        e_adm = np.bincount(eng * n_bins + bin_of[adm], minlength=n_eng * n_bins).reshape(n_eng, n_bins)
        ref = (~adm) & (chosen >= 0)
        e_ref = np.bincount(chosen[ref] * n_bins + bin_of[ref], minlength=n_eng * n_bins).reshape(n_eng, n_bins)
        limit = np.full((n_eng, n_bins), float(self.n_star) if not self.aimd else np.nan)
        dec = np.zeros((n_eng, n_bins), dtype=np.int64)
        for (e, b), v in self.limit_sum.items():
            limit[e, b] = v / self.limit_n[(e, b)]
        for (e, b), v in self.decreases.items():
            dec[e, b] = v

        def frac(num, den):
            return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)

        bins = pd.DataFrame({
            "bin": np.arange(n_bins), "start_s": edges[:-1], "end_s": edges[1:],
            "offered_rate_per_s": _expected_by_bin(cfg.arrivals, edges) / width,
            "offered": offered, "admitted": admitted, "refused": refused,
            "refused_fraction": frac(refused, offered),
            "silent_frame_fraction": frac(silent_ticks.sum(axis=0), flying_ticks.sum(axis=0)),
            "in_flight_mean": in_flight_s.sum(axis=0) / width,
            "engines_mean": prov_s.sum(axis=0) / width, "engines_max": eng_level,
            "gpu_hours": prov_s.sum(axis=0) / 3600.0, "session_hours": in_flight_s.sum(axis=0) / 3600.0,
        })
        ee, bb = np.meshgrid(np.arange(n_eng), np.arange(n_bins), indexing="ij")
        engines = pd.DataFrame({
            "engine": ee.ravel(), "bin": bb.ravel(), "provisioned_s": prov_s.ravel(),
            "in_flight_mean": (in_flight_s / width).ravel(), "in_flight_max": in_flight_max.ravel(),
            "admitted": e_adm.ravel(), "refused": e_ref.ravel(),
            "silent_frame_fraction": frac(silent_ticks, flying_ticks).ravel(),
            "limit_mean": limit.ravel(), "limit_decreases": dec.ravel(),
        })
        engines = engines[engines.provisioned_s > 0].reset_index(drop=True)
        # totals over arrivals (and, for silence, instants) after the warm-up
        late = arr >= cfg.warmup_s
        n_off, n_adm = int(late.sum()), int((late & adm).sum())
        first_bin = int(cfg.warmup_s // cfg.bin_s)
        w_edges = np.array([cfg.warmup_s, H])
        silent_s = silent_ticks[:, first_bin:].sum() if self.memory else 0.0
        flying_s = flying_ticks[:, first_bin:].sum() if self.memory else 0.0
        engine_s = float(prov_s.sum())
        ci = None
        whole = bins[(bins.start_s >= cfg.warmup_s) & (bins.offered > 0)]
        if len(whole) >= 2:
            ci = batch_means_interval(whole.refused, whole.offered)[1:]
        totals = {
            "calibration": cfg.engine.name, "policy": cfg.engine.policy.describe(), "n_star": self.n_star,
            "router": cfg.router, "controller": cfg.controller, "autoscaled": cfg.autoscale is not None,
            "engines_initial": cfg.engines, "seed": cfg.seed, "horizon_s": H, "warmup_s": cfg.warmup_s,
            "offered": n_off, "admitted": n_adm, "refused": n_off - n_adm,
            "refused_fraction": (n_off - n_adm) / n_off if n_off else 0.0,
            "refused_fraction_ci": None if ci is None else [round(float(x), 6) for x in ci],
            "silent_frame_fraction": float(silent_s / flying_s) if flying_s else 0.0,
            "session_hours": float(_overlap_by_bin(start, stop, np.zeros(start.size, dtype=np.int64), 1,
                                                   w_edges).sum() / 3600.0),
            "gpu_hours": engine_s / 3600.0, "engines_mean": engine_s / H, "engines_max": int(eng_level.max()),
            "engines_provisioned": n_eng,
        }
        lifecycle = pd.DataFrame({"engine": ids, "provisioned_s": t_prov, "serving_s": np.asarray(self.t_serve),
                                  "released_s": np.asarray(self.t_rel)})
        return FleetResult(cfg, bins, engines, lifecycle, totals)


def simulate(cfg: FleetConfig) -> FleetResult:
    """Run one fleet configuration (see the module docstring)."""
    t0 = time.perf_counter()
    r = _Run(cfg)
    r.run()
    res = r.tables()
    wall = time.perf_counter() - t0
    res.totals["wall_s"] = round(wall, 4)
    res.totals["engine_seconds_per_wall_s"] = res.totals["gpu_hours"] * 3600.0 / wall
    return res


# ------------------------------------------------------------------------------------------- sweeps
def _totals(cfg: FleetConfig) -> dict:
    return simulate(cfg).totals


def grid(engine_types: Sequence[EngineType], engines: Sequence[int], routers: Sequence[str], seeds: Sequence[int],
         **common) -> list[FleetConfig]:
    """Every (engine type × engine count × router × seed), the last varying fastest; ``common`` holds the other
    :class:`FleetConfig` fields (arrivals, durations, horizon_s, ...)."""
    return [FleetConfig(engine=et, engines=int(g), router=r, seed=int(s), **common)
            for et in engine_types for g in engines for r in routers for s in seeds]


def sweep(configs: Sequence[FleetConfig], executor=None, progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """Run every configuration on ``executor`` (:func:`metronome.sim.executors.make_executor`: a local process pool
    or Ray; default local): one row of totals per configuration, in input order."""
    rows = (executor or LocalExecutor()).map(_totals, list(configs), progress=progress)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- sizing
def peak_config(cfg: FleetConfig, window_s: float = 3600.0, warmup_s: float | None = None) -> FleetConfig:
    """The stationary run at ``cfg``'s peak arrival rate: a warm-up of five mean session lengths (an empty fleet
    fills to within 1% of its steady occupancy for exponential sessions, closer for fixed ones), then
    ``window_s`` measured in four batches (each several sessions long) for the confidence interval."""
    peak = check_offered(cfg.arrivals)
    batch = window_s / 4
    w = 5 * cfg.durations.mean_s if warmup_s is None else warmup_s
    w = math.ceil(w / batch - 1e-9) * batch  # whole batches, so that each batch is all warm or all measured
    return replace(cfg, arrivals=Arrivals("poisson", rate_per_s=peak), horizon_s=w + window_s, warmup_s=w,
                   bin_s=batch, autoscale=None)


def size_by_simulation(cfg: FleetConfig, max_refusal: float, seeds: Sequence[int], start: int) -> dict:
    """The fewest engines whose simulated refused fraction (over ``seeds``, after the warm-up) is at most
    ``max_refusal``, searched from ``start`` (a closed-form answer): down one engine at a time while it holds,
    else up by doubling steps and then bisection. ``cfg`` is a stationary run (:func:`peak_config`); its
    ``engines`` is ignored. Returns the answer, its refused fraction and interval, and every (G, fraction) tried."""
    check_refusal(max_refusal)
    seen: dict[int, tuple[float, Any]] = {}

    def refused(g: int) -> float:
        if g not in seen:
            res = [simulate(replace(cfg, engines=g, seed=s)) for s in seeds]
            off = sum(r.totals["offered"] for r in res)
            ref = sum(r.totals["refused"] for r in res)
            batches = pd.concat([r.bins[r.bins.start_s >= cfg.warmup_s] for r in res])
            ci = None
            if (batches.offered > 0).sum() >= 2:
                ci = batch_means_interval(batches.refused, batches.offered)[1:]
            seen[g] = (ref / off if off else 0.0, ci)
        return seen[g][0]

    g = max(1, int(start))
    if refused(g) <= max_refusal:
        while g > 1 and refused(g - 1) <= max_refusal:
            g -= 1
    else:
        lo, step = g, 1
        while refused(lo + step) > max_refusal:
            lo, step = lo + step, step * 2
        hi = lo + step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if refused(mid) <= max_refusal else (mid, hi)
        g = hi
    p, ci = seen[g]
    return {"engines": g, "refused_fraction": p, "refused_fraction_ci": None if ci is None else list(ci),
            "tried": sorted((k, v[0]) for k, v in seen.items())}


def _size_task(item: tuple) -> dict:
    cfg, max_refusal, seeds, start = item
    return size_by_simulation(cfg, max_refusal, seeds, start)


def _day_task(cfg: FleetConfig) -> FleetResult:
    return simulate(cfg)


def plan(engine_types: Sequence[EngineType], arrivals: Arrivals, durations: Durations, horizon_s: float,
         max_refusal: float = DEFAULT_MAX_REFUSAL, routers: Sequence[str] = ("least-loaded",), seeds: Sequence[int] = (0,),
         engines: int | None = None, controller: str = "static", aimd_params: AIMDParams | None = None,
         autoscale: AutoscalePolicy | None = None, prices: dict[str, float] | None = None,
         peak_window_s: float = 3600.0, executor=None, progress: Callable[[str, int], Callable[[int], None]] | None = None
         ) -> tuple[dict, dict[str, pd.DataFrame]]:
    """How many engines of each type carry ``arrivals`` with at most ``max_refusal`` refused, and at what cost.

    Per engine type: the closed form at the peak (Erlang B, pooled and random routing; the offered load is the
    peak rate × the mean session length); per router, the simulated size at the peak (:func:`size_by_simulation`
    from the closed form); then the whole run (``horizon_s``) with a static fleet of that size (or ``engines``)
    and, with ``autoscale``, an autoscaled one starting from the closed form at the rate at t=0. ``prices``:
    USD per GPU-hour by calibration name, for the cost per 1,000 session-hours.

    Returns ``(summary, tables)``: tables ``bins`` (per bin of each day run) and ``engines`` (per engine per bin)."""
    check_refusal(max_refusal)
    prices = check_prices(prices or {}, [et.name for et in engine_types])
    for r in routers:
        check_router(r)
    if engines is not None:
        check_engine_count(engines)
    peak = check_offered(arrivals)
    offered = peak * durations.mean_s
    seeds = [int(s) for s in seeds]
    executor = executor or LocalExecutor()
    t0 = time.perf_counter()

    def base(et: EngineType) -> FleetConfig:
        return FleetConfig(engine=et, engines=1, arrivals=arrivals, durations=durations, horizon_s=horizon_s,
                           controller=controller, aimd_params=aimd_params)

    closed = {et.name: {rt: engines_needed(offered, et.n_star, max_refusal, rt) for rt in ("pooled", "random")}
              for et in engine_types}
    # simulated sizing at the peak: one task per (engine type, router)
    items = [(replace(peak_config(base(et), peak_window_s), router=r), max_refusal, seeds,
              closed[et.name][CLOSED_FORM_START[r]]) for et in engine_types for r in routers]
    tick = progress("sizing at the peak", len(items)) if progress else None
    sized = executor.map(_size_task, items, progress=tick)
    sizing = {(et.name, r): sized[k * len(routers) + j] for k, et in enumerate(engine_types)
              for j, r in enumerate(routers)}
    # the whole run: static (sized for the peak) and autoscaled, per router and seed
    days: list[tuple[str, str, str, FleetConfig]] = []
    for et in engine_types:
        for r in routers:
            g_static = int(engines) if engines is not None else sizing[(et.name, r)]["engines"]
            for s in seeds:
                days.append((et.name, r, "static", replace(base(et), engines=g_static, router=r, seed=s)))
                if autoscale is not None:
                    g0 = engines_needed(arrivals.rate_at(0.0) * durations.mean_s, et.n_star, max_refusal,
                                        CLOSED_FORM_START[r])
                    pol = autoscale if autoscale.max_engines is not None else replace(
                        autoscale, max_engines=max(2 * g_static, autoscale.min_engines))
                    g0 = min(max(g0, pol.min_engines), pol.max_engines)
                    days.append((et.name, r, "autoscaled",
                                 replace(base(et), engines=g0, router=r, seed=s, autoscale=pol)))
    tick = progress("the whole run", len(days)) if progress else None
    results = executor.map(_day_task, [d[3] for d in days], progress=tick)
    wall = time.perf_counter() - t0

    bins, engs = [], []
    summary: dict[str, Any] = {"max_refusal": max_refusal, "peak_rate_per_s": peak,
                               "mean_session_s": durations.mean_s, "peak_offered_erlangs": offered,
                               "horizon_s": horizon_s, "seeds": seeds, "routers": list(routers),
                               "controller": controller, "calibrations": []}
    sim_engine_s = sim_wall = 0.0
    for et in engine_types:
        entry = {"calibration": et.name, "provenance": et.calibration.provenance.kind,
                 "policy": et.policy.describe(), "n_star": et.n_star, "deadline_s": et.deadline_s,
                 "memory_ceiling": et.fill.memory_ceiling(None if et.policy.bounded else durations.mean_s),
                 "closed_form_engines": closed[et.name], "gpu_price_per_hour": prices.get(et.name),
                 "routers": {}}
        for r in routers:
            row: dict[str, Any] = {"simulated": sizing[(et.name, r)]}
            for mode in ("static", "autoscaled"):
                runs = [res for (name, rt, md, _), res in zip(days, results) if name == et.name and rt == r
                        and md == mode]
                if not runs:
                    continue
                b = pd.concat([x.bins for x in runs]).groupby("bin", as_index=False).agg(
                    start_s=("start_s", "first"), end_s=("end_s", "first"),
                    offered_rate_per_s=("offered_rate_per_s", "first"), offered=("offered", "sum"),
                    admitted=("admitted", "sum"), refused=("refused", "sum"),
                    silent_frame_fraction=("silent_frame_fraction", "mean"), in_flight_mean=("in_flight_mean", "mean"),
                    engines_mean=("engines_mean", "mean"), engines_max=("engines_max", "max"),
                    gpu_hours=("gpu_hours", "mean"), session_hours=("session_hours", "mean"))
                b["refused_fraction"] = np.where(b.offered > 0, b.refused / b.offered.clip(lower=1), 0.0)
                b.insert(0, "mode", mode)
                b.insert(0, "router", r)
                b.insert(0, "calibration", et.name)
                bins.append(b)
                for x in runs:
                    e = x.engines.copy()
                    e.insert(0, "seed", x.config.seed)
                    e.insert(0, "mode", mode)
                    e.insert(0, "router", r)
                    e.insert(0, "calibration", et.name)
                    engs.append(e)
                    sim_engine_s += x.totals["gpu_hours"] * 3600.0
                    sim_wall += x.totals["wall_s"]
                tot = [x.totals for x in runs]
                off = sum(t["offered"] for t in tot)
                gpu_h = float(np.mean([t["gpu_hours"] for t in tot]))
                sess_h = float(np.mean([t["session_hours"] for t in tot]))
                price = prices.get(et.name)
                row[mode] = {
                    "engines": runs[0].config.engines if mode == "static" else None,
                    "engines_max": int(max(t["engines_max"] for t in tot)),
                    "engines_mean": float(np.mean([t["engines_mean"] for t in tot])),
                    "gpu_hours": gpu_h, "session_hours": sess_h,
                    "refused_fraction": sum(t["refused"] for t in tot) / off if off else 0.0,
                    "worst_bin_refused_fraction": float(b.refused_fraction.max()),
                    "silent_frame_fraction": float(np.mean([t["silent_frame_fraction"] for t in tot])),
                    "worst_bin_silent_frame_fraction": float(b.silent_frame_fraction.max()),
                    "cost_usd": None if price is None else gpu_h * price,
                    "cost_per_1000_session_hours": (None if price is None or sess_h <= 0
                                                    else 1000.0 * gpu_h * price / sess_h),
                }
            entry["routers"][r] = row
        summary["calibrations"].append(entry)
    summary["simulated_engine_seconds"] = sim_engine_s
    summary["simulated_engine_seconds_per_wall_s"] = sim_engine_s / sim_wall if sim_wall > 0 else None
    summary["wall_s"] = round(wall, 3)
    tables = {"bins": pd.concat(bins, ignore_index=True) if bins else pd.DataFrame(),
              "engines": pd.concat(engs, ignore_index=True) if engs else pd.DataFrame()}
    return summary, tables
