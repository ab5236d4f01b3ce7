"""Many fleet runs: sweeps over configurations, the simulated size at the peak, and :func:`plan`, how many
engines of each type carry an offered load and at what cost (the answer of ``metronome-sim fleet`` and of the
report's "How many GPUs"), with :func:`hour_series`, one calibration's per-hour series of plan's bins table.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from metronome.admission import AIMDParams
from metronome.erlang import (DEFAULT_MAX_REFUSAL, batch_means_interval, check_refusal, engines_by_routing,
                              engines_needed)
from metronome.workload import Arrivals, Durations

from metronome.sim.executors import LocalExecutor
from metronome.sim.fleet import simulate
from metronome.sim.fleet_config import (AutoscalePolicy, EngineType, FleetConfig, FleetResult, check_engine_count,
                                        check_offered, check_prices, check_router)

# Which closed form a router's simulated sizing search starts from (the others lie between the two).
CLOSED_FORM_START = {"least-loaded": "pooled", "round-robin": "pooled", "power-of-two": "pooled", "random": "random"}


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


# Runs of the simulated sizing at each fleet size tried, each run one batch of the interval (independent seeds; the
# quarters of one hour are not: refusals come in bursts while the fleet is full, so four quarters with none refused
# gave "95% CI 0.00%-0.00%"). An hour's refused share at a 1% target scatters with a coefficient of variation near 1
# (Moshi/H200, 6 GPUs, 300 Erlangs: hours from 0% to 3.2% around 1.0%), so 8 runs give a half-width near 0.8x the
# share and 64 near 0.25x: from SIZING_MIN_RUNS, doubling while the interval holds the target, to SIZING_MAX_RUNS.
SIZING_MIN_RUNS = 8
SIZING_MAX_RUNS = 64


def _sizing_seeds(seeds: Sequence[int], runs: int) -> list[int]:
    """``seeds`` first, then the following integers, ``runs`` in all (at least the seeds given)."""
    out = [int(s) for s in seeds]
    nxt = (max(out) + 1) if out else 0
    while len(out) < runs:
        out.append(nxt)
        nxt += 1
    return out


def size_by_simulation(cfg: FleetConfig, max_refusal: float, seeds: Sequence[int], start: int,
                       min_runs: int = SIZING_MIN_RUNS, max_runs: int = SIZING_MAX_RUNS) -> dict:
    """The fewest engines whose simulated refused fraction (after the warm-up) is at most ``max_refusal``, searched
    from ``start`` (a closed-form answer): down one engine at a time while it holds, else up by doubling steps and
    then bisection. ``cfg`` is a stationary run (:func:`peak_config`); its ``engines`` is ignored.

    Each size is run with ``seeds`` and the seeds after them, at least ``min_runs`` runs, doubled while the 95%
    batch-means interval of the refused fraction (:func:`metronome.erlang.batch_means_interval`, one batch per run,
    after its warm-up) holds the target, up to ``max_runs`` (see ``SIZING_MIN_RUNS``). Returns the answer, its
    refused fraction, its interval (None when no session was refused: a zero spread is no interval), the runs and
    counts behind it, whether the interval lies on one side of the target, and every (G, fraction, runs) tried."""
    check_refusal(max_refusal)
    seen: dict[int, dict] = {}

    def measure(res: list[FleetResult]) -> dict:
        refused_, offered_ = [r.totals["refused"] for r in res], [r.totals["offered"] for r in res]
        off, ref = sum(offered_), sum(refused_)
        ci = None
        if ref > 0 and len(res) >= 2:  # one batch per run (seeds are independent)
            ci = [float(x) for x in batch_means_interval(refused_, offered_)[1:]]
        return {"refused_fraction": float(ref / off) if off else 0.0, "refused_fraction_ci": ci, "runs": len(res),
                "seeds": [r.config.seed for r in res], "refused": int(ref), "offered": int(off),
                "hours_per_run": (cfg.horizon_s - cfg.warmup_s) / 3600.0,
                "decided": bool(ci is None or ci[1] <= max_refusal or ci[0] > max_refusal)}

    def refused(g: int) -> float:
        if g not in seen:
            n = max(min_runs, len(seeds))
            res = [simulate(replace(cfg, engines=g, seed=s)) for s in _sizing_seeds(seeds, n)]
            m = measure(res)
            while not m["decided"] and n < max_runs:  # more runs, keeping those drawn
                n = min(2 * n, max_runs)
                res += [simulate(replace(cfg, engines=g, seed=s)) for s in _sizing_seeds(seeds, n)[len(res):]]
                m = measure(res)
            seen[g] = m
        return seen[g]["refused_fraction"]

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
    return {"engines": g, **seen[g], "tried": sorted((k, v["refused_fraction"], v["runs"]) for k, v in seen.items())}


def _size_task(item: tuple) -> dict:
    cfg, max_refusal, seeds, start = item
    return size_by_simulation(cfg, max_refusal, seeds, start)


def _day_task(cfg: FleetConfig) -> FleetResult:
    return simulate(cfg)


@dataclass(frozen=True)
class PlanOptions:
    """What :func:`plan` sizes for and how: the most refused (``max_refusal``), the routers and seeds simulated, a
    fleet size to run instead of the sized one (``engines``), each engine's admission (``controller``,
    ``aimd_params``), an autoscaler to run beside the static fleet, prices in USD per GPU-hour by calibration name,
    and the peak's window."""

    max_refusal: float = DEFAULT_MAX_REFUSAL
    routers: Sequence[str] = ("least-loaded",)
    seeds: Sequence[int] = (0,)
    engines: int | None = None
    controller: str = "static"
    aimd_params: AIMDParams | None = None
    autoscale: AutoscalePolicy | None = None
    prices: dict[str, float] | None = None
    peak_window_s: float = 3600.0


def plan(engine_types: Sequence[EngineType], arrivals: Arrivals, durations: Durations, horizon_s: float,
         options: PlanOptions = PlanOptions(), executor=None,
         progress: Callable[[str, int], Callable[[int], None]] | None = None) -> tuple[dict, dict[str, pd.DataFrame]]:
    """How many engines of each type carry ``arrivals`` with at most ``max_refusal`` refused, and at what cost
    (``options``: :class:`PlanOptions`).

    Per engine type: the closed form at the peak (Erlang B, pooled and random routing; the offered load is the
    peak rate × the mean session length); per router, the simulated size at the peak (:func:`size_by_simulation`
    from the closed form); then the whole run (``horizon_s``) with a static fleet of that size (or ``engines``)
    and, with ``autoscale``, an autoscaled one starting from the closed form at the rate at t=0. ``prices``:
    USD per GPU-hour by calibration name, for the cost per 1,000 session-hours.

    Returns ``(summary, tables)``: tables ``bins`` (per bin of each day run) and ``engines`` (per engine per bin)."""
    o = options
    max_refusal, routers, seeds, engines, controller, aimd_params, autoscale, prices, peak_window_s = (
        o.max_refusal, o.routers, o.seeds, o.engines, o.controller, o.aimd_params, o.autoscale, o.prices,
        o.peak_window_s)
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

    closed = {et.name: engines_by_routing(offered, et.n_star, max_refusal) for et in engine_types}
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
                    # an hour's refusals scatter around the mean the fleet is sized for: how many hours passed the target
                    "bins_over_target": int((b.refused_fraction > max_refusal).sum()), "bins": int(len(b)),
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



def hour_series(bins: pd.DataFrame, calibration: str, router: str) -> dict[str, list]:
    """One calibration's rows of :func:`plan`'s ``bins`` table under one router, as plain lists (the report keeps
    them in its JSON): each bin's start and offered rate, then the static and the autoscaled fleet's GPUs (mean;
    the autoscaled max), refused and silent fractions. The autoscaled lists are empty when it was not run."""
    b = bins[(bins.calibration == calibration) & (bins.router == router)]
    st, au = b[b["mode"] == "static"], b[b["mode"] == "autoscaled"]
    return {"start_s": st.start_s.tolist(), "offered_rate_per_s": st.offered_rate_per_s.tolist(),
            "static_engines": st.engines_mean.tolist(), "autoscaled_engines_mean": au.engines_mean.tolist(),
            "autoscaled_engines_max": au.engines_max.tolist(),
            "static_refused_fraction": st.refused_fraction.tolist(),
            "autoscaled_refused_fraction": au.refused_fraction.tolist(),
            "static_silent_frame_fraction": st.silent_frame_fraction.tolist(),
            "autoscaled_silent_frame_fraction": au.silent_frame_fraction.tolist()}
