"""The report's numbers: every figure and table, computed from the sim layer.

:func:`~metronome.report.plan.plan_report` plans the whole report from its options first (the builder's one call
into the planning); then phases, each a typed list of points from that plan, fanned out over the executor with its
own progress:

1. **capacity** per calibration: memory ceiling, deadline-bound N*, which binds, under both phase regimes and with
   each serving stack the calibration ships; then N* over the step terms' ranges (the interval, the tornado and
   the dominant term, :func:`metronome.sim.capacity.sensitivity`) for every stack, each variant searched from near
   its central N*;
2. **AIMD tuning** per calibration on an overload mix at 1.5× N* (a small grid);
3. **simulation**: :meth:`~metronome.report.plan.ReportPlan.simulation_points` lists everything else once N* and
   the tuned controller are known — the unbounded verdict at N*, pool fill for several N, the latency signal
   against N, the first Monte Carlo pass of the metastability grid, the admission traces and, for a ``--live`` run
   folder without a ``sim/`` folder, the run's workload re-simulated with the calibration (and the simulator's N*
   for the run's policy, pool and deadline) — and it runs as one batch; then the cells on the collapse band's edge
   are topped up (:meth:`~metronome.report.plan.ReportPlan.refinement`), a batch per round; then the fill model's
   P(collapse) and P(saturate) for every cell (:meth:`~metronome.report.plan.ReportPlan.prediction_points`);
4. with an offered load (``--offered-load``), **the fleet**: how many GPUs of each calibration carry it with at
   most ``--max-refusal`` refused (Erlang B on N*, and :mod:`metronome.sim.fleet` with a least-loaded router),
   and the day's GPU-hours static and autoscaled, with the cost when ``--gpu-price`` is given.

Every simulated run is seeded by its own point, so the report is the same whichever executor and how
many workers run it. Every simulation of phases 1-3 goes through :class:`metronome.sim.cache.ResultCache`: a
point simulated before (same calibration contents, point, seed and code) is read back, not run. Each phase's answers
are read into typed records here, the sections are assembled from them as :mod:`metronome.report.sections`, and
:meth:`~metronome.report.sections.Report.to_dict` makes the JSON-ready dict that :mod:`metronome.report.answer`
turns into the words and numbers both renderers print.
"""

from __future__ import annotations

import contextlib
import copy
import math
import platform
import shlex
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from metronome import __version__
from metronome import calibration as calmod
from metronome.errors import MetronomeError
from metronome.kv_policy import policy_option_values
from metronome.workload import Durations

from metronome.report.live import attach_simulation, sim_side
from metronome.report.plan import (ANSWER_LOADS, FLEET_DAY_S, MC_FRACTIONS, MC_HORIZON_FACTOR,
                                   MISS_BUDGET, OVERLOAD, PERCENTILE, TARGET_FRACTION, TUNING_GRID, WINDOW_CONTEXT_S,
                                   Plan, Point, ReportOptions, plan_report)
from metronome.report.sections import (Admission, AdmissionPolicy, Answer, CalibrationSection, Fill, FillCurve,
                                       Metastability, MetastabilityPolicy, Planned, Report, Shown, SignalSeries,
                                       TuningSection)
from metronome.results import wilson_interval
from metronome.sim import scenario as scn
from metronome.sim.cache import ResultCache
from metronome.sim.capacity import capacity, sensitivity, variant_n_star
from metronome.sim.executors import LocalExecutor
from metronome.sim.montecarlo import run_decided as mc_run_decided
from metronome.sim.tuning import tune_aimd

# progress(label, total) -> advance(n): one phase of work with a known number of tasks
Progress = Callable[[str, int], Callable[[int], None]]

FILL_POINTS = 48  # simulated points per pool-fill curve
FILL_LINE_POINTS = 240
TRACE_POINTS = 300  # buckets per admission trace


# ------------------------------------------------------------------------------------------- tasks
# Module-level so that a process pool or Ray can pickle them. Each returns plain numbers.
def _capacity_task(task: dict) -> dict:
    """``task``: :meth:`Plan.capacity_task` (calibration spec and stack, policy, deadline, mean duration, phases)."""
    return capacity(calmod.load(task["calibration"], stack=task["stack"] or None), task["policy"], task["deadline_s"],
                    TARGET_FRACTION, PERCENTILE, task["duration_s"], phases=task["phases"])


def _range_task(task: dict) -> dict:
    """One variant of N* over the step terms' ranges: the calibration (with its stack) with the task's terms moved,
    searched from near the central N* (:func:`metronome.sim.capacity.variant_n_star`)."""
    cal = calmod.load(task["calibration"], stack=task["stack"] or None)
    return variant_n_star(cal, task["policy"], task["central"], tuple((n, v) for n, v in task["overrides"]))


def _prediction_task(task: dict) -> list[float]:
    """The fill model's [P(collapse), P(saturate)] for one metastability cell: N sessions of exponential mean
    length ``mean_s`` over ``horizon_s`` (cached and fanned out like a simulation: for an overloaded cell it
    costs as much as one)."""
    from metronome.fill_model import FillModel

    fm = FillModel(calmod.load(task["calibration"]), task["policy"], task["phases"])
    durations = Durations("exponential", task["mean_s"])
    return [fm.p_collapse_fixed(task["sessions"], durations, task["horizon_s"]),
            fm.p_saturate_fixed(task["sessions"], durations, task["horizon_s"])]


def _sim_task(task: tuple[str, dict]) -> dict:
    kind, point = task
    if kind == "mc":  # only collapsed and t_sat are read: the run stops once they are decided
        return mc_run_decided(point)
    res = scn.run(scn.make_scenario(**point))
    out = {"summary": res.summary}
    if kind == "fill":
        st = res.steps
        t = st["t_s"].to_numpy()
        want = np.linspace(0.0, point["horizon"], FILL_POINTS + 1)[1:]
        idx = np.clip(np.searchsorted(t, want, side="right") - 1, 0, max(len(t) - 1, 0))
        pool = res.scenario.calibration.engine.num_blocks
        out["t_s"] = [round(float(x), 3) for x in t[idx]] if len(t) else []
        out["occupancy"] = [round(float(x) / pool, 5) for x in st["resident_blocks"].to_numpy()[idx]] if len(t) else []
    elif kind == "admission":
        out["trace"] = _bucket_trace(res.controller_trace or [], point["horizon"])
    elif kind == "live":
        out.update(_live_sim(res))
    return out


def _live_sim(res) -> dict:
    """A live run re-simulated: the simulated side (as read from a sim/ folder) and the simulator's N* for the
    run's policy, pool and deadline (p99 at most ``TARGET_FRACTION`` of it; unbounded: at the mean duration)."""
    ctl = pd.DataFrame(res.controller_trace) if res.controller_trace else None
    sc = res.scenario
    mean = sc.durations.mean_s if sc.durations is not None else None
    cap = capacity(sc.calibration, sc.policy, sc.deadline, TARGET_FRACTION, PERCENTILE,
                   mean if mean is not None and math.isfinite(mean) else None)
    return {"side": sim_side(res.summary, res.steps, ctl), "n_star": cap["n_star"],
            "n_star_policy": f"{sc.policy.describe()}, {1e3 * sc.deadline:g} ms deadline, {cap['binding']} binds"}


def _bucket_trace(trace: list[dict], horizon_s: float) -> dict:
    """Downsample a controller trace to about ``TRACE_POINTS`` buckets: the limit at the bucket's end,
    the peak sessions in flight, the worst interval percentile latency, silent frames / frames."""
    if not trace:
        return {"t_s": [], "limit": [], "in_flight": [], "p_latency_s": [], "silent_fraction": [], "bucket_s": 0}
    t = np.array([r["t_s"] for r in trace], dtype=float)
    width = max(horizon_s / TRACE_POINTS, float(np.median(np.diff(t))) if t.size > 1 else 1.0)
    b = np.floor((t - 1e-9) / width).astype(int)
    out = {"t_s": [], "limit": [], "in_flight": [], "p_latency_s": [], "silent_fraction": [], "bucket_s": width}
    for k in np.unique(b):
        rows = [trace[i] for i in np.nonzero(b == k)[0]]
        lat = [r["p_latency_s"] for r in rows if r["p_latency_s"] is not None]
        frames = sum(r["frames"] for r in rows)
        out["t_s"].append(round(float((k + 1) * width), 3))
        out["limit"].append(int(rows[-1]["limit"]))
        out["in_flight"].append(int(max(r["in_flight"] for r in rows)))
        out["p_latency_s"].append(round(max(lat), 6) if lat else None)
        out["silent_fraction"].append(round(sum(r["silent"] for r in rows) / frames, 5) if frames else 0.0)
    return out


# ------------------------------------------------------------------------------------------- typed results
# The tasks above return plain dicts (the cache stores them as they are); each phase's answers are read into these
# once, and the sections are assembled from their fields.
@dataclass
class Capacity:
    """One calibration's capacity phase: N* under the answer's regime and stack (``answer``, which gains
    ``other_regime`` and ``ranges`` here) and with each serving stack it ships
    (``by_stack``, the answer's own first). Each is :func:`metronome.sim.capacity.capacity`'s dict."""

    answer: dict = field(default_factory=dict)
    by_stack: dict[str, dict] = field(default_factory=dict)
    ranges: dict[tuple, dict] = field(default_factory=dict)  # (stack, overrides) -> that variant's N*

    def attach_ranges(self, plan: Plan) -> None:
        """Each stack's capacity gains its ``ranges`` (:func:`metronome.sim.capacity.sensitivity`) from the
        variants searched (:meth:`ReportPlan.range_points`)."""
        for stack, cap in self.by_stack.items():
            cap["ranges"] = sensitivity(plan.calibration.with_stack(stack or None), plan.policy, cap,
                                        solve=lambda wanted, s=stack: [self.ranges[(s, ov)] for ov in wanted])

    def add(self, pt: Point, cap: dict) -> None:
        """One capacity point's answer (:meth:`ReportPlan.capacity_points`, which lists a calibration's
        ``capacity`` point before its ``other_regime`` one)."""
        if pt.section == "capacity":
            self.answer = copy.deepcopy(cap)  # gains other_regime and ranges: the cached answer stays as it was
            self.by_stack = {pt.key: self.answer, **self.by_stack}
        elif pt.section == "other_regime":
            self.answer["other_regime"] = {k: cap[k] for k in ("phases", "n_star", "deadline_n_star", "binding")}
        else:
            self.by_stack[pt.key] = cap


@dataclass(frozen=True)
class Tuning:
    """AIMD tuned for one calibration (:func:`metronome.sim.tuning.tune_aimd`): the best setting's record (None:
    none kept misses within budget, ``error`` says why, and the static limit is recommended), the grid's table, the
    overload mix it ran on and how many simulated runs that took."""

    best: dict | None
    table: list[dict]
    point: dict
    error: str | None
    runs: int

    @property
    def params(self) -> dict | None:
        return self.best["params"] if self.best else None


@dataclass(frozen=True)
class FillRun:
    """A pool-fill point: the run's summary and its occupancy sampled at ``FILL_POINTS`` times."""

    summary: dict
    t_s: list[float]
    occupancy: list[float]


@dataclass(frozen=True)
class McRun:
    """One Monte Carlo run of a metastability cell: only these two are read (the run stops once they are decided)."""

    collapsed: bool
    t_sat_observed_s: float | None

    @property
    def saturated(self) -> bool:
        t = self.t_sat_observed_s
        return t is not None and not (isinstance(t, float) and math.isnan(t))


@dataclass(frozen=True)
class AdmissionRun:
    """An admission trace's run: its summary and the controller trace bucketed (:func:`_bucket_trace`)."""

    summary: dict
    trace: dict


@dataclass(frozen=True)
class LiveRun:
    """A live run re-simulated (:func:`_live_sim`)."""

    side: dict
    n_star: int
    n_star_policy: str


@dataclass
class Simulated:
    """One calibration's simulations, by the section that reads them (keys as :func:`simulation_points` gives)."""

    verdict: dict | None = None  # the unbounded run at N*: its summary
    fill: dict[tuple[str, int], FillRun] = field(default_factory=dict)
    signal: dict[tuple[str, int], dict] = field(default_factory=dict)  # summaries
    mc: dict[tuple[str, int, float], list[McRun]] = field(default_factory=dict)
    admission: dict[str, AdmissionRun] = field(default_factory=dict)
    live: dict[str, LiveRun] = field(default_factory=dict)
    predicted: dict[tuple[str, int, float], list[float]] = field(default_factory=dict)  # [P(collapse), P(saturate)]

    def add(self, pt: Point, res: dict) -> None:
        """One simulated point's answer (:func:`_sim_task`), filed under its section."""
        if pt.section == "verdict":
            self.verdict = res["summary"]
        elif pt.section == "fill":
            self.fill[pt.key] = FillRun(res["summary"], res["t_s"], res["occupancy"])
        elif pt.section == "signal":
            self.signal[pt.key] = res["summary"]
        elif pt.section == "mc":
            self.mc.setdefault(pt.key, []).append(McRun(bool(res["collapsed"]), res["t_sat_observed_s"]))
        elif pt.section == "admission":
            self.admission[pt.key] = AdmissionRun(res["summary"], res["trace"])
        elif pt.section == "live":
            self.live[pt.key] = LiveRun(res["side"], res["n_star"], res["n_star_policy"])
        elif pt.section == "predicted":
            self.predicted[pt.key] = res
        else:
            raise ValueError(f"no section {pt.section!r} reads simulated points")

    def mc_counts(self) -> dict[tuple, tuple[int, int]]:
        """(policy, N, d) -> (collapsed runs, runs) of the Monte Carlo runs so far."""
        return {key: (sum(r.collapsed for r in runs), len(runs)) for key, runs in self.mc.items()}

    def runs(self) -> int:
        """Simulated runs: the verdict's, each section's and every Monte Carlo run."""
        return (1 + len(self.fill) + len(self.signal) + len(self.admission) + len(self.live)
                + sum(len(v) for v in self.mc.values()))


# ------------------------------------------------------------------------------------------- helpers
def _short_hardware(cal) -> str:
    return cal.provenance.hardware.split(" (")[0]


def _short_model(cal) -> str:
    return cal.model.name.split(" (")[0]


def _noop_progress(label: str, total: int) -> Callable[[int], None]:
    return lambda n: None


def _versions() -> dict:
    import pandas
    import plotly
    import scipy
    import simpy

    return {"metronome": __version__, "python": platform.python_version(), "numpy": np.__version__,
            "scipy": scipy.__version__, "pandas": pandas.__version__, "simpy": simpy.__version__,
            "plotly": plotly.__version__}


# ------------------------------------------------------------------------------------------- build
def build_report(options: ReportOptions, executor=None, progress: Progress | None = None,
                 command: str | None = None, cache: ResultCache | None = None) -> dict:
    """Compute the report's data (see the module docstring). Raises MetronomeError on bad input. ``cache``:
    where simulated points are read and stored (default :class:`ResultCache` at its default folder;
    ``ResultCache(enabled=False)`` runs everything and writes nothing)."""
    executor = executor or LocalExecutor()
    with executor.kept() if hasattr(executor, "kept") else contextlib.nullcontext():  # one pool for every phase
        return _build(options, executor, progress or _noop_progress, command,
                      cache if cache is not None else ResultCache())


def _build(options: ReportOptions, executor, progress: Progress, command: str | None, cache: ResultCache) -> dict:
    t0 = time.perf_counter()
    rp = plan_report(options)  # the builder's one call into the planning: every later list comes from rp
    plans = rp.calibrations

    # 1. capacity, under the regime the answer assumes and under the other one (the report shows both when
    # they differ by more than REGIME_GAP) and, under the answer's regime, with each other serving stack the
    # calibration ships
    points = rp.capacity_points()
    found = cache.map(executor, _capacity_task, [pt.point for pt in points],
                      progress=progress("capacity: N* per calibration, regime and stack", len(points)))
    capacities = [Capacity() for _ in plans]
    for pt, cap in zip(points, found):
        capacities[pt.calibration].add(pt, cap)
    caps = [c.answer for c in capacities]
    for plan, cap in zip(plans, caps):
        if cap["n_star"] < 1:
            raise MetronomeError(no_session_fits(plan, cap, options))
    # 1b. N* over the step terms' ranges: the interval, the tornado and the dominant term, for every stack
    stack_caps = [c.by_stack for c in capacities]
    points = rp.range_points(stack_caps)
    found = cache.map(executor, _range_task, [pt.point for pt in points],
                      progress=progress("capacity: N* over the step terms' ranges", len(points)))
    for pt, res in zip(points, found):
        capacities[pt.calibration].ranges[pt.key] = res
    for plan, c in zip(plans, capacities):
        c.attach_ranges(plan)

    # 2. AIMD tuning on the overload mix
    tunings = [_tune(plan, cap, executor, progress, cache) for plan, cap in zip(plans, caps)]

    # 3. every other simulation, planned at once, run as one batch; then the collapse band's edge topped up
    sims = [Simulated() for _ in plans]
    points = rp.simulation_points(caps, [t.params for t in tunings])
    label = f"simulating: {len(points)} runs"
    for round_ in range(rp.refine_rounds + 1):
        results = cache.map(executor, _sim_task, [(pt.kind, pt.point) for pt in points],
                            progress=progress(label, len(points)))
        for pt, res in zip(points, results):
            sims[pt.calibration].add(pt, res)
        if round_ == rp.refine_rounds:
            break
        points = rp.refinement(caps, [s.mc_counts() for s in sims])
        if not points:
            break
        label = f"refining the collapse band's edge: {len(points)} runs"

    points = rp.prediction_points(caps)
    found = cache.map(executor, _prediction_task, [pt.point for pt in points],
                      progress=progress(f"predicting: {len(points)} metastability cells", len(points)))
    for pt, res in zip(points, found):
        sims[pt.calibration].add(pt, res)
    cals = [_calibration_section(plan, Phases(cap, by_stack, tun, sim), lv, options.max_refusal)
            for plan, cap, by_stack, tun, sim, lv in zip(plans, caps, stack_caps, tunings, sims, rp.live)]
    fleet = _fleet_data(options, plans, caps, executor, progress) if options.offered_load is not None else None
    report = Report(
        title="Capacity plan: " + " vs ".join(c.planned.name for c in cals),
        options={"calibrations": list(options.calibrations), "kv": options.kv,
                 **policy_option_values(dict(options.kv_params)), "session_duration": options.session_duration,
                 "deadline_s": options.deadline_s, "arrival_rate": options.arrival_rate, "seed": options.seed,
                 "mc_runs": options.mc_runs, "mc_edge_runs": plans[0].edge_runs,
                 "live": list(options.live), "phases": options.phases,
                 "offered_load": options.offered_load, "max_refusal": options.max_refusal,
                 "calibrations_from_live": options.calibrations_from_live,
                 "gpu_prices": dict(options.gpu_prices)},
        command=command or reproduce_command(options),
        reproduce=reproduce_command(options),
        versions=_versions(),
        executor=getattr(executor, "name", type(executor).__name__),
        simulated_runs=sum(s.runs() for s in sims) + sum(t.runs for t in tunings),
        cache=cache.stats(),
        wall_s=round(time.perf_counter() - t0, 2),
        calibrations=cals,
        fleet=fleet)
    return report.to_dict()


def _tune(plan: Plan, cap: dict, executor, progress: Progress, cache: ResultCache) -> Tuning:
    """AIMD tuned on the plan's overload mix (:meth:`Plan.tuning_point`), or the static limit when no setting of
    the grid keeps misses within ``MISS_BUDGET``."""
    point = plan.tuning_point(cap["n_star"])
    n_cand = math.prod(len(v) for v in TUNING_GRID.values())
    adv = progress(f"tuning AIMD: {plan.calibration.name} ({n_cand} settings)", n_cand)
    try:
        # the limit never needs to pass N*: past the memory ceiling only silence would tell the controller;
        # it starts at N*/2 so that goodput measures the controller, not a climb from one session
        base = {"max_limit": cap["n_star"], "initial_limit": max(1, cap["n_star"] // 2)}
        best, table = tune_aimd({k: v for k, v in point.items() if v is not None}, TUNING_GRID, seeds=1,
                                seed=plan.seed, miss_budget=MISS_BUDGET, base_params=base,
                                executor=cache.wrap(executor), progress=adv)
        return Tuning(best, table.to_dict(orient="records"), point, None, len(table))
    except MetronomeError as exc:  # no feasible setting: recommend the static limit instead
        return Tuning(None, [], point, str(exc), n_cand)


def no_session_fits(plan: Plan, cap: dict, options: ReportOptions) -> str:
    """The one-line error when N* is 0, naming the lever that works: the window when a shorter one lets a session
    meet the p99 target (the report's own choice of about ``WINDOW_CONTEXT_S`` of conversation can be too long for
    a slow engine), else the deadline. Runs only on this error path: one session, pool unlimited, per window tried."""
    from metronome.kv_policy import cdiv, policy_class
    from metronome.sim.capacity import p99_at

    cal, pol = plan.calibration, plan.policy
    target = TARGET_FRACTION * plan.deadline_s
    target_words = f"the p99 target of {1e3 * target:.1f} ms ({TARGET_FRACTION:g} x the {1e3 * plan.deadline_s:g} ms deadline)"

    def p99(policy) -> float:
        return p99_at(cal, policy, 1, plan.deadline_s, PERCENTILE, plan.mean_duration_s, plan.phases)

    cls = policy_class(pol.kind)
    param = next((p for p in cls.params if p.sizes), None)  # the parameter that sets how much a session keeps
    kept = {k: v for k, v in options.kv_params if param is None or k != param.name}
    bs = cal.engine.block_size_tokens

    def with_blocks(blocks: int):  # the policy keeping S + W = ``blocks`` whole blocks (W spans one block at least)
        return cls.sized(bs, kept, lambda s: max(blocks, cdiv(s, bs) + 1) * bs)

    def valid(blocks: int) -> bool:  # e.g. sinks needs W > S
        try:
            with_blocks(blocks)
            return True
        except MetronomeError:
            return False

    p_now = cap["evaluations"][0]["p_latency_s"]  # capacity's p99 at one session
    first = cdiv(pol.sink_tokens, bs) + 1
    while first * bs < pol.kept_tokens and not valid(first):
        first += 1
    if param is None or pol.kept_tokens <= first * bs or p99(with_blocks(first)) > target:
        return (f"{cal.name}: even one session misses {target_words} (p99 {1e3 * p_now:.1f} ms with "
                f"{pol.short_words()}): raise --deadline")
    lo, hi = first, cdiv(pol.kept_tokens, bs)  # one session meets the target at lo blocks and misses it at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if p99(with_blocks(mid)) <= target else (lo, mid)
    best = getattr(with_blocks(lo), param.attr)
    chosen = (f"the window the report chose ({pol.short_words()}: about the last {WINDOW_CONTEXT_S:g} s of "
              f"conversation)" if plan.window_defaulted else f"--{param.name} {getattr(pol, param.attr)}")
    return (f"{cal.name}: N* is 0 because of {chosen}: even one session misses {target_words}, at p99 "
            f"{1e3 * p_now:.1f} ms; a shorter window is the lever: give --{param.name} {best} or less "
            f"(one session then meets the target)")


def _stack_data(plan: Plan, by_stack: dict[str, dict]) -> list[dict]:
    """N* with each serving stack the calibration ships (the default first; the answer's marked), with its interval
    over the step terms' ranges; empty for a calibration that names no stacks."""
    cal = plan.calibration
    return [{"stack": s, "default": k == 0, "answer": s == cal.stack, "description": cal.stack_pricing(s).description,
             "about": cal.stack_description(s),
             **{key: by_stack[s][key] for key in ("n_star", "deadline_n_star", "memory_ceiling", "binding", "ranges")}}
            for k, s in enumerate(cal.stacks)]


def _gpus_for_loads(plan: Plan, cap: dict, max_refusal: float) -> dict:
    """The answer's small table: GPUs for ``ANSWER_LOADS`` concurrent sessions offered, by Erlang B on the N* just
    found (each GPU a loss system of N* places; no simulation: the closed form of the fleet section)."""
    from metronome.erlang import engines_by_routing

    return {"max_refusal": max_refusal, "n_star": cap["n_star"], "mean_session_s": plan.mean_duration_s,
            "loads": [{"sessions": a, "arrival_rate_per_s": a / plan.mean_duration_s,
                       "engines": engines_by_routing(a, cap["n_star"], max_refusal)} for a in ANSWER_LOADS]}


def _fleet_data(options: ReportOptions, plans: list[Plan], caps: list[dict], executor, progress: Progress) -> dict:
    """The "How many GPUs" section: each calibration as an engine of N* places (the capacity the answer found,
    with the recommended bound), sized for the offered load's peak and run over its day."""
    from metronome.sim.fleet_config import AutoscalePolicy, EngineType
    from metronome.sim.fleet_plan import PlanOptions, hour_series, plan as fleet_plan

    arrivals = options.offered()
    types = [EngineType.from_capacity(p.calibration, p.policy, cap) for p, cap in zip(plans, caps)]
    horizon = arrivals.pattern_s or FLEET_DAY_S
    fleet = PlanOptions(max_refusal=options.max_refusal, routers=("least-loaded",), seeds=(options.seed,),
                        autoscale=AutoscalePolicy(), prices=dict(options.gpu_prices))
    summary, tables = fleet_plan(types, arrivals, plans[0].durations, horizon, fleet, executor=executor,
                                 progress=progress)
    series = {c["calibration"]: hour_series(tables["bins"], c["calibration"], "least-loaded")
              for c in summary["calibrations"]}
    return {"offered_load": arrivals.describe(), "spec": options.offered_load, "summary": summary, "series": series}


def reproduce_command(options: ReportOptions, out: str = "OUT") -> str:
    """The command that rebuilds this report, every option explicit that changes a number."""
    parts = ["metronome-sim", "report"]
    for c in options.calibrations:
        parts += ["--calibration", c]
    parts += ["--kv", options.kv]
    for name, value in options.kv_params:
        parts += [f"--{name}", str(value)]
    parts += ["--session-duration", options.session_duration]
    if options.deadline_s is not None:
        parts += ["--deadline", f"{options.deadline_s:g}"]
    if options.arrival_rate is not None:
        parts += ["--arrival-rate", f"{options.arrival_rate:g}"]
    parts += ["--phases", options.phases, "--seed", str(options.seed), "--mc-runs", str(options.mc_runs),
              "--mc-edge-runs", str(options.mc_edge_runs)]
    for d in options.live:
        parts += ["--live", d]
    if options.offered_load is not None:
        parts += ["--offered-load", options.offered_load, "--max-refusal", f"{options.max_refusal:g}"]
        for name, usd in options.gpu_prices:
            parts += ["--gpu-price", f"{name}={usd:g}"]
    parts += ["--out", out]
    return " ".join(shlex.quote(p) for p in parts)


def _live_data(live: dict | None, simulated: dict[str, LiveRun], plan: Plan) -> dict | None:
    """The --live folder's data, with the report's own simulation beside each run that had no sim/ folder."""
    if live is None or live["kind"] != "runs":
        return live
    live = copy.deepcopy(live)
    for name, run in live["runs"].items():
        sc = run.pop("scenario")
        if sc is None:
            continue
        res = simulated[name]
        attach_simulation(run, res.side, plan.calibration.name, res.n_star, res.n_star_policy)
        run["simulated_options"] = sc["options"]
    return live


def live_differences(plan: Plan, live: dict | None) -> list[dict]:
    """Every setting a ``--live`` folder ran that differs from this plan's: the deadline, the frame period, the bound
    (the plan shows unbounded beside its own bound, so only the live bounds it does not plan are named) and the pool.
    Each ``{"parameter", "run", "plan", "flag"}`` in words; ``flag`` is what plans at the run's setting."""
    if not live or not live.get("parameters"):
        return []
    p, cal, out = live["parameters"], plan.calibration, []

    def ms(x: float) -> str:
        return f"{1e3 * x:g} ms"

    if p["deadline_s"] is not None and not math.isclose(p["deadline_s"], plan.deadline_s, rel_tol=1e-6):
        out.append({"parameter": "frame deadline", "run": ms(p["deadline_s"]), "plan": ms(plan.deadline_s),
                    "flag": f"--deadline {p['deadline_s']:g}"})
    if p["frame_period_s"] is not None and not math.isclose(p["frame_period_s"], cal.stream.frame_period_s,
                                                            rel_tol=1e-6):
        out.append({"parameter": "frame period", "run": ms(p["frame_period_s"]),
                    "plan": ms(cal.stream.frame_period_s), "flag": "--calibration of the run's model"})
    other = [b for b in p["bounds"] if b != plan.policy.describe()]
    if other:
        out.append({"parameter": "KV bound", "run": ", ".join(other), "plan": plan.policy.describe(),
                    "flag": "--kv and its parameters"})
    if p["num_blocks"] is not None and p["num_blocks"] != cal.engine.num_blocks:
        out.append({"parameter": "KV pool", "run": f"{p['num_blocks']:,} blocks",
                    "plan": f"{cal.engine.num_blocks:,} blocks", "flag": "a calibration of the run's pool"})
    return out


@dataclass(frozen=True)
class Phases:
    """One calibration's results from every phase: its capacity under the answer's regime and per stack, the
    tuned controller and the simulations."""

    cap: dict
    by_stack: dict[str, dict]
    tuning: Tuning
    sim: Simulated


def _calibration_section(plan: Plan, ph: Phases, live: dict | None, max_refusal: float) -> CalibrationSection:
    labels = {"unbounded": "unbounded", "bounded": plan.policy.describe()}
    shown = Shown(fill=_fill(plan, ph.cap["n_star"], ph.sim.fill, labels),
                  signal=_signal(ph.sim.signal, labels),
                  metastability=_metastability(plan, ph.cap, ph.sim, labels),
                  admission=_admission(plan, ph.cap["n_star"], ph.sim.admission, labels),
                  live=_live_data(live, ph.sim.live, plan), live_differences=live_differences(plan, live),
                  gpus_for_loads=_gpus_for_loads(plan, ph.cap, max_refusal), stacks=_stack_data(plan, ph.by_stack))
    return CalibrationSection(_planned(plan), _answer(plan, ph.cap, ph.tuning, ph.sim.verdict), shown)


def _planned(plan: Plan) -> Planned:
    cal, pol = plan.calibration, plan.policy
    peak_blocks = plan.fill_bounded.peak_resident_blocks
    return Planned(
        name=cal.name, spec=plan.spec, model=_short_model(cal), hardware=_short_hardware(cal),
        provenance={"kind": cal.provenance.kind, "source": cal.provenance.source,
                    "hardware": cal.provenance.hardware, "date": cal.provenance.date,
                    "engine": cal.provenance.engine, "weights": cal.provenance.weights,
                    "notes": list(cal.provenance.notes), "path": cal.path, "description": cal.description,
                    "terms": [{"coefficient": t.coefficient, "name": t.name, "value": t.value, "basis": t.basis,
                               "source": t.source, "plugin": plugin}
                              for terms, plugin in ((cal.step_latency.terms, False),
                                                    (cal.step_latency.plugin_terms, True)) for t in terms],
                    "plugin_priced": pol.runs_plugin and bool(cal.step_latency.plugin_terms)},
        stream={"frame_period_s": cal.stream.frame_period_s, "kv_tokens_per_s": cal.stream.kv_tokens_per_s},
        pool={"num_blocks": cal.engine.num_blocks, "block_size_tokens": cal.engine.block_size_tokens,
              "bytes_per_block": cal.engine.bytes_per_block, "pool_bytes": cal.engine.pool_bytes},
        deadline_s=plan.deadline_s, session_duration=plan.durations.describe(),
        session_duration_mean_s=plan.mean_duration_s, seed=plan.seed,
        policy={"kind": pol.kind, "sinks": pol.sink_tokens, "window": pol.window_tokens,
                "describe": pol.describe(), "words": pol.short_words(), "peak_blocks_per_session": peak_blocks,
                "bytes_per_session": peak_blocks * cal.engine.bytes_per_block,
                "window_defaulted": plan.window_defaulted, "window_context_s": WINDOW_CONTEXT_S})


def _answer(plan: Plan, cap: dict, tun: Tuning, verdict: dict) -> Answer:
    tuned = tun.best
    tuning = TuningSection(
        params=tun.params, figures=tuned["figures"] if tuned else None, grid=TUNING_GRID, miss_budget=MISS_BUDGET,
        seeds=tuned["seeds"] if tuned else [plan.seed], offered_rate_per_s=tun.point["arrival_rate"],
        overload=OVERLOAD, horizon_s=tun.point["horizon"], error=tun.error, table=tun.table,
        offered_is_overload=plan.arrival_rate is None)
    at_n_star = {k: verdict[k] for k in ("t_sat_predicted_s", "t_sat_observed_s", "p_saturate_predicted", "collapsed",
                                         "silent_frame_fraction", "deadline_miss_fraction", "p50_frame_latency_s",
                                         "p99_frame_latency_s", "horizon_s", "workload")}
    fm_b = plan.fill_bounded
    return Answer(capacity=cap, memory_ceiling_unbounded=plan.fill_unbounded.memory_ceiling(plan.mean_duration_s),
                  pool_ceiling=plan.pool_ceiling, seqs_bind=bool(fm_b.seqs_bind),
                  max_num_seqs=plan.calibration.engine.max_num_seqs, tuning=tuning,
                  unbounded_at_n_star=at_n_star | {"sessions": cap["n_star"]})


def _fill(plan: Plan, n_star: int, runs: dict[tuple[str, int], FillRun], labels: dict[str, str]) -> Fill:
    """Pool fill: the fill model's line beside the simulated points, t_sat both ways (unbounded first, then by N)."""
    fm_b, fm_u = plan.fill_bounded, plan.fill_unbounded
    h_fill = plan.fill_horizon_s(n_star)
    t_line = np.linspace(0.0, h_fill, FILL_LINE_POINTS)
    curves = []
    for (policy_key, n), res in sorted(runs.items(), key=lambda kv: (kv[0][0] != "unbounded", kv[0][1])):
        fm = fm_u if policy_key == "unbounded" else fm_b
        rho = np.minimum(fm.occupancy_blocks(t_line, n) / fm_b.usable_blocks, 1.0)
        s = res.summary
        curves.append(FillCurve(
            policy=policy_key, label=labels[policy_key], sessions=n, t_line_s=[round(float(x), 3) for x in t_line],
            occupancy_predicted=[round(float(x), 5) for x in rho], t_sim_s=res.t_s, occupancy_simulated=res.occupancy,
            t_sat_predicted_s=s["t_sat_predicted_s"], t_sat_observed_s=s["t_sat_observed_s"],
            collapsed=s["collapsed"]))
    return Fill(h_fill, curves)


def _signal(runs: dict[tuple[str, int], dict], labels: dict[str, str]) -> dict[str, SignalSeries]:
    """The signal: latency and silence against N, per policy."""
    out: dict[str, SignalSeries] = {}
    for (policy_key, n), summary in sorted(runs.items(), key=lambda kv: kv[0][1]):
        out.setdefault(policy_key, SignalSeries(labels[policy_key])).add(n, summary)
    return out


def _metastability(plan: Plan, cap: dict, sim: Simulated, labels: dict[str, str]) -> Metastability:
    """Predicted P(collapse) (and P(saturate)) beside the Monte Carlo fractions, per cell."""
    n_star = cap["n_star"]
    ns, ds = plan.sessions_grid(MC_FRACTIONS, n_star), plan.mc_durations_s(n_star)
    policies = {}
    for policy_key in ("unbounded", "bounded"):
        grid = [[sim.predicted[(policy_key, n, d)] for n in ns] for d in ds]
        runs = [[sim.mc[(policy_key, n, d)] for n in ns] for d in ds]
        collapsed = [[sum(r.collapsed for r in cell) for cell in row] for row in runs]
        policies[policy_key] = MetastabilityPolicy(
            label=labels[policy_key],
            predicted=[[round(c[0], 4) for c in row] for row in grid],
            predicted_saturation=[[round(c[1], 4) for c in row] for row in grid],
            simulated_collapse=[[k / len(cell) for k, cell in zip(ks, row)] for ks, row in zip(collapsed, runs)],
            simulated_saturation=[[sum(r.saturated for r in cell) / len(cell) for cell in row] for row in runs],
            runs=[[len(cell) for cell in row] for row in runs],
            collapse_interval=[[[round(x, 4) for x in wilson_interval(k, len(cell))] for k, cell in zip(ks, row)]
                               for ks, row in zip(collapsed, runs)])
    # a cell past the deadline-bound N* is compute-overloaded: frames miss their deadline whatever the pool does
    return Metastability(sessions=ns, mean_duration_s=ds, runs_per_cell=plan.mc_runs, edge_runs=plan.edge_runs,
                         n_star=n_star, past_n_star=[n > cap["deadline_n_star"] for n in ns],
                         horizon_factor=MC_HORIZON_FACTOR, policies=policies)


ADMISSION_FIGURES = ("collapsed", "silent_frame_fraction", "deadline_miss_fraction", "p99_frame_latency_s",
                     "goodput_sessions", "goodput_frames_per_s", "sessions_offered", "sessions_admitted",
                     "sessions_refused", "t_sat_observed_s")


def _admission(plan: Plan, n_star: int, runs: dict[str, AdmissionRun], labels: dict[str, str]) -> Admission:
    """The admission traces on the rising-then-falling pattern."""
    return Admission(
        pattern=[[d, round(r, 6)] for d, r in plan.admission_pattern(n_star)], mean_duration_s=plan.mean_duration_s,
        policies={k: AdmissionPolicy(labels[k], runs[k].trace, {f: runs[k].summary[f] for f in ADMISSION_FIGURES})
                  for k in ("unbounded", "bounded")})
