"""What a report simulates for one calibration, and why those defaults are meaningful for it.

Everything here is derived from the calibration and the fill model, never picked per preset by hand:

* **the bound to recommend** — ``sinks`` with ``S = 16`` and ``W`` ≈ the last ``WINDOW_CONTEXT_S``
  (30 s) of conversation, rounded so that ``S + W`` fills whole blocks (Moshi at 12.5 tokens/s:
  S=16, W=368 = 29.4 s, S+W = 24 blocks), shortened if the pool would hold fewer than 8 such sessions;
* **the session mix** — exponential durations with a 5-minute mean (``DEFAULT_SESSION_DURATION``);
  the window is then a tenth of a mean conversation;
* **concurrency** — fractions of the **binding N**: N* = min(deadline-bound N*, memory ceiling), known once the
  capacity phase has run, up to ``1.5·N*``, so every sweep shows both sides of whatever binds first (a grid in
  units of the memory ceiling would spend its time far past a deadline that binds first — Moshi/H200: N* = 122
  against a ceiling of 512 — where frames take minutes and the simulator is slowest). Both memory ceilings
  stay marked in the figures and tables;
* **mean session duration** (metastability) — multiples of the unbounded ``t_sat`` at the
  recommended N*, so the grid straddles the race between fill and session length;
* **offered load** (AIMD tuning and goodput) — Poisson arrivals at ``OVERLOAD × N* / mean duration``,
  i.e. 1.5× what N* sessions can carry, so admission has something to refuse;
* **the admission trace** — a rising-then-falling rate pattern, one mean duration per step;
* **Monte Carlo runs** — ``--mc-runs`` runs per metastability cell in a first pass; then every cell on the band's
  edge (some but not all of its runs collapsed, or next to a cell of another outcome) is topped up to
  ``MC_EDGE_RUNS`` runs, so the edge is measured to a useful interval without paying for it everywhere.

:func:`plan_report` is the builder's one way in: it checks every input and returns the whole report's
:class:`ReportPlan`, whose methods list each phase's simulations as one typed list of :class:`Point` (every
calibration's at once): the capacity phase from the options alone, the other sections once N* and the tuned
controller are known (their grids are fractions of N*), and the top-ups of the collapse band's edge after each
Monte Carlo pass. :func:`simulation_points`, :func:`mc_refinement` and :func:`prediction_points` are those lists
for one calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from metronome.calibration import Calibration
from metronome import serving
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy, bounded_kinds, cdiv, check_policy_options, policy_class
from metronome.erlang import DEFAULT_MAX_REFUSAL, check_refusal
from metronome.workload import Arrivals, Durations

DEFAULT_KV = "sinks"
WINDOW_CONTEXT_S = 30.0
MIN_BOUNDED_SESSIONS = 8
DEFAULT_SESSION_DURATION = "exp:300"
DEFAULT_MC_RUNS = 5
TARGET_FRACTION = 0.8  # N*: p99 frame latency at most this fraction of the deadline (as `capacity`)
PERCENTILE = 99.0
OVERLOAD = 1.5
REGIME_GAP = 0.10  # N* under the two phase regimes: shown side by side when they differ by more than this
MISS_BUDGET = 0.01
FLEET_DAY_S = 86400.0  # a constant offered rate is sized and costed over one day
# the answer's "GPUs for an offered load" table: concurrent sessions offered (Erlangs), sized by Erlang B on N*
ANSWER_LOADS = (100, 1_000, 10_000)

SIGNAL_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)
FILL_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
MC_FRACTIONS = (0.1, 0.25, 0.5, 1.0, 1.5)
MC_DURATION_FACTORS = (0.5, 1.0, 2.0, 4.0, 8.0)
MC_HORIZON_FACTOR = 3.0  # each cell runs 3 mean durations: ~95% of the sessions have ended by then
MC_EDGE_RUNS = 20  # runs of every cell on the edge of the collapse band (its Wilson interval is then ~±20 points)
MC_REFINE_ROUNDS = 3  # top-up passes at most: a cell topped up may turn out mixed and bring its neighbours in
# Small on purpose: the default report must stay fast. `metronome-sim tune-aimd` searches wider.
TUNING_GRID = {"additive_increase": [1.0, 4.0], "decrease_factor": [0.75, 0.9], "target_fraction": [0.8, 0.9],
               "interval_s": [1.0]}
ADMISSION_PATTERN = (0.5, 1.5, 3.0, 1.0, 0.25)  # offered rate, in units of N*/mean duration


@dataclass(frozen=True)
class ReportOptions:
    """The report's inputs, as the user gave them (``None``: derive the default per calibration)."""

    calibrations: tuple[str, ...]
    kv: str = DEFAULT_KV
    kv_params: tuple[tuple[str, int], ...] = ()  # the policy's parameters as given (None: sized by the report)
    session_duration: str = DEFAULT_SESSION_DURATION
    deadline_s: float | None = None
    arrival_rate: float | None = None
    seed: int = 0
    mc_runs: int = DEFAULT_MC_RUNS
    mc_edge_runs: int = MC_EDGE_RUNS  # runs of a cell on the collapse band's edge (at least mc_runs)
    live: tuple[str, ...] = ()
    phases: str = "independent"  # serving.PHASES: the regime the answer assumes
    offered_load: str | None = None  # a rate, a rate pattern or a load CSV: the "How many GPUs" section
    max_refusal: float = DEFAULT_MAX_REFUSAL
    gpu_prices: tuple[tuple[str, float], ...] = ()  # (calibration name, USD per GPU-hour)
    calibrations_from_live: bool = False  # the calibrations are those the --live folders recorded (none given)

    def offered(self) -> Arrivals | None:
        """The offered load the fleet section sizes for (None: no such section)."""
        return None if self.offered_load is None else Arrivals.parse_offered(self.offered_load)

    def validate(self) -> None:
        serving.check_phases(self.phases)
        if self.offered_load is None and (self.gpu_prices or self.max_refusal != DEFAULT_MAX_REFUSAL):
            raise MetronomeError("--gpu-price and --max-refusal size a fleet: give the load with --offered-load")
        check_refusal(self.max_refusal, "--max-refusal")
        if self.offered_load is not None:
            from metronome.sim.fleet_config import check_offered

            check_offered(self.offered())
        if not self.calibrations:
            raise MetronomeError("give at least one --calibration NAME|PATH")
        if len(self.calibrations) > 4:
            raise MetronomeError(f"a report compares at most 4 calibrations, got {len(self.calibrations)}")
        if self.kv not in bounded_kinds():
            raise MetronomeError(f"--kv {self.kv!r}: the report recommends a bounded policy "
                                 f"({' or '.join(bounded_kinds())}); the unbounded one is always shown beside it")
        check_policy_options(self.kv, dict(self.kv_params))
        if self.deadline_s is not None and not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise MetronomeError(f"--deadline must be positive seconds, got {self.deadline_s}")
        if self.arrival_rate is not None and not (self.arrival_rate > 0 and math.isfinite(self.arrival_rate)):
            raise MetronomeError(f"--arrival-rate must be a positive number of sessions/s, got {self.arrival_rate}")
        if self.mc_runs < 1:
            raise MetronomeError(f"--mc-runs must be >= 1, got {self.mc_runs}")
        if self.mc_edge_runs < 1:
            raise MetronomeError(f"--mc-edge-runs must be >= 1, got {self.mc_edge_runs}")
        if self.live and len(self.live) > len(self.calibrations):
            raise MetronomeError(f"--live given {len(self.live)} times for {len(self.calibrations)} calibration(s) "
                                 "(one per --calibration, in the same order)")


@dataclass(frozen=True)
class Plan:
    """One calibration's report scenario: the bound, the mix, the deadline and the sweep grids."""

    spec: str  # the preset name or path, as given (tasks reload it in the worker)
    calibration: Calibration
    policy: KVPolicy  # the bounded policy to recommend
    durations: Durations
    session_duration: str
    deadline_s: float
    seed: int
    mc_runs: int
    arrival_rate: float | None
    window_defaulted: bool = False
    mc_edge_runs: int = MC_EDGE_RUNS
    phases: str = "independent"

    @property
    def unbounded(self) -> KVPolicy:
        return KVPolicy.unbounded(self.calibration.engine.block_size_tokens)

    @property
    def fill_bounded(self) -> FillModel:
        return FillModel(self.calibration, self.policy, self.phases)

    @property
    def fill_unbounded(self) -> FillModel:
        return FillModel(self.calibration, self.unbounded, self.phases)

    @property
    def memory_ceiling(self) -> int:
        return int(self.fill_bounded.memory_ceiling())

    @property
    def pool_ceiling(self) -> int:
        """The sessions the pool alone holds under the bound: the memory ceiling with vLLM's request limit
        (``max_num_seqs``) lifted, so the two can be told apart when the limit binds first."""
        cal = self.calibration
        free = replace(cal, engine=replace(cal.engine, max_num_seqs=2**40))
        return int(FillModel(free, self.policy, self.phases).memory_ceiling())

    @property
    def edge_runs(self) -> int:
        """Runs of a metastability cell on the collapse band's edge (never fewer than the first pass's)."""
        return max(self.mc_edge_runs, self.mc_runs)

    @property
    def mean_duration_s(self) -> float:
        return float(self.durations.mean_s)

    def bound_options(self) -> dict:
        """The bounded policy as make_scenario options."""
        return self.policy.options()

    def base(self, **kw) -> dict:
        return {"calibration": self.spec, "deadline": self.deadline_s, "phases": self.phases, **kw}

    # -- the grids ------------------------------------------------------------------------------------
    def sessions_grid(self, fractions, n_bind: int) -> list[int]:
        """Session counts at ``fractions`` of the binding N (N* from the capacity phase)."""
        return sorted({max(1, int(round(f * n_bind))) for f in fractions})

    def fill_horizon_s(self, n_bind: int) -> float:
        """Long enough for the smallest N's unbounded cliff and for the bounded windows to fill."""
        n_min = self.sessions_grid(FILL_FRACTIONS, n_bind)[0]
        t_small = self.fill_unbounded.t_sat(n_min)
        p = self.policy
        window_fill_s = (p.kept_tokens + p.block_size) / self.calibration.stream.kv_tokens_per_s
        return float(max(1.25 * (t_small or 0.0), 2.0 * window_fill_s, 10 * self.calibration.stream.frame_period_s))

    def mc_durations_s(self, n_star: int) -> list[float]:
        t = self.fill_unbounded.t_sat(max(n_star, 1)) or self.mean_duration_s
        return [_round_s(f * t) for f in MC_DURATION_FACTORS]

    def offered_rate(self, n_star: int) -> float:
        """Sessions/s for tuning and goodput: the user's --arrival-rate, or 1.5× what N* carries."""
        if self.arrival_rate is not None:
            return float(self.arrival_rate)
        return OVERLOAD * n_star / self.mean_duration_s

    def tuning_point(self, n_star: int) -> dict:
        return self.base(**self.bound_options(), arrival_rate=self.offered_rate(n_star),
                         session_duration=self.session_duration, horizon=2.0 * self.mean_duration_s)

    def admission_pattern(self, n_star: int) -> list[tuple[float, float]]:
        base_rate = n_star / self.mean_duration_s
        return [(self.mean_duration_s, f * base_rate) for f in ADMISSION_PATTERN]

    def admission_point(self, n_star: int, policy_options: dict) -> dict:
        """The admission trace's scenario under a policy (make_scenario options: ``{"kv": "unbounded"}`` or
        :meth:`bound_options`)."""
        pattern = ",".join(f"{d:g}:{r:.6g}" for d, r in self.admission_pattern(n_star))
        return self.base(**policy_options, rate_pattern=pattern, session_duration=self.session_duration,
                         horizon=len(ADMISSION_PATTERN) * self.mean_duration_s, admission="aimd")


    def capacity_task(self, phases: str, stack: str | None = None) -> dict:
        """The capacity phase's task for one phase regime (``build._capacity_task``), with the calibration's stack in
        use or ``stack``."""
        return {"calibration": self.spec, "stack": self.calibration.stack if stack is None else stack,
                "policy": self.policy, "deadline_s": self.deadline_s, "duration_s": self.mean_duration_s,
                "phases": phases}


@dataclass(frozen=True)
class Point:
    """One simulation of the report: the section that reads it, its key there, the task kind, the task (for a
    simulation the make_scenario options, ``None`` values dropped) and the calibration it belongs to (its
    :attr:`Plan.index`)."""

    section: str
    key: Any
    kind: str
    point: dict
    calibration: int = 0  # its place in ReportPlan.calibrations (set there: a Plan does not know it)


def _point(section: str, key: Any, kind: str, point: dict) -> Point:
    return Point(section, key, kind, {k: v for k, v in point.items() if v is not None})


def policies(plan: Plan) -> dict[str, dict]:
    return {"unbounded": {"kv": "unbounded"}, "bounded": plan.bound_options()}


def mc_point(plan: Plan, policy_key: str, n: int, d: float, run: int) -> Point:
    """Run ``run`` of the metastability cell (policy, N, mean duration ``d``): seed ``seed + run``."""
    return _point("mc", (policy_key, n, d), "mc",
                  plan.base(**policies(plan)[policy_key], sessions=n, session_duration=f"exp:{d:g}",
                            horizon=MC_HORIZON_FACTOR * d, seed=plan.seed + run))


def simulation_points(plan: Plan, cap: dict, aimd_params: dict | None, live: dict | None = None) -> list[Point]:
    """Every simulation of one calibration's report, once capacity (``cap``) and tuning (``aimd_params``,
    None: the static limit) are known: the unbounded verdict at N*, pool fill, the latency signal, the first
    Monte Carlo pass, the admission traces, and the --live runs to re-simulate."""
    n_star = cap["n_star"]
    out = [_point("verdict", None, "summary",
                  plan.base(kv="unbounded", sessions=n_star, seed=plan.seed, session_duration=plan.session_duration,
                            horizon=2.0 * plan.mean_duration_s))]
    h_fill = plan.fill_horizon_s(n_star)
    for pol, kw in policies(plan).items():
        out += [_point("fill", (pol, n), "fill", plan.base(**kw, sessions=n, horizon=h_fill, seed=plan.seed))
                for n in plan.sessions_grid(FILL_FRACTIONS, n_star)]
        out += [_point("signal", (pol, n), "summary",
                       plan.base(**kw, sessions=n, horizon=plan.mean_duration_s, seed=plan.seed))
                for n in plan.sessions_grid(SIGNAL_FRACTIONS, n_star)]
        out += [mc_point(plan, pol, n, d, r) for n in plan.sessions_grid(MC_FRACTIONS, n_star)
                for d in plan.mc_durations_s(n_star) for r in range(plan.mc_runs)]
        out.append(_point("admission", pol, "admission",
                          {**plan.admission_point(n_star, kw), "aimd_params": aimd_params, "seed": plan.seed}))
    for name, run in (live["runs"].items() if live and live["kind"] == "runs" else ()):
        if run["scenario"] is not None:  # a live run without a sim/ folder: simulated here
            out.append(_point("live", name, "live", {"calibration": plan.spec, **run["scenario"]["options"]}))
    return out


def prediction_points(plan: Plan, n_star: int) -> list[Point]:
    """The fill model's [P(collapse), P(saturate)] for every metastability cell, policy by policy, duration by
    duration, N by N (key (policy, N, d), as the Monte Carlo runs of the cell)."""
    return [Point("predicted", (key, n, d), "prediction",
                  {"calibration": plan.spec, "policy": pol, "sessions": n, "mean_s": d,
                   "horizon_s": MC_HORIZON_FACTOR * d, "phases": plan.phases})
            for key, pol in (("unbounded", plan.unbounded), ("bounded", plan.policy))
            for d in plan.mc_durations_s(n_star) for n in plan.sessions_grid(MC_FRACTIONS, n_star)]


def _outcome(collapsed: int, runs: int) -> str:
    return "none" if collapsed == 0 else "all" if collapsed == runs else "mixed"


def mc_refinement(plan: Plan, n_star: int, counts: dict[tuple, tuple[int, int]]) -> list[Point]:
    """The runs that bring every cell on the edge of the collapse band to ``MC_EDGE_RUNS``: a cell whose runs
    neither all collapsed nor all survived, or that borders (in N or in duration) a cell of another outcome.
    ``counts``: (policy, N, d) -> (collapsed runs, runs) so far. Empty when the edge is measured."""
    ns, ds = plan.sessions_grid(MC_FRACTIONS, n_star), plan.mc_durations_s(n_star)
    want = plan.edge_runs
    out = []
    for pol in policies(plan):
        grid = {(i, j): counts[(pol, n, d)] for i, d in enumerate(ds) for j, n in enumerate(ns)}
        kind = {ij: _outcome(*c) for ij, c in grid.items()}
        for (i, j), (_, runs) in grid.items():
            near = [kind.get(nb) for nb in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1)) if nb in kind]
            edge = kind[(i, j)] == "mixed" or any(k != kind[(i, j)] for k in near)
            if edge and runs < want:
                out += [mc_point(plan, pol, ns[j], ds[i], r) for r in range(runs, want)]
    return out


def _round_s(x: float) -> float:
    """Round a duration to 2 significant figures (grid labels people can read)."""
    if x <= 0:
        return x
    digits = 1 - int(math.floor(math.log10(x)))
    return float(round(x, digits))


def default_window_tokens(cal: Calibration, sink_tokens: int) -> int:
    """W ≈ the last ``WINDOW_CONTEXT_S`` of conversation, rounded so that S + W fills whole blocks (and
    spans at least one block more than the sinks), and small enough that the pool holds at least
    ``MIN_BOUNDED_SESSIONS`` bounded sessions (a small measured pool, e.g. the probe's, gets a shorter
    window rather than a report that cannot run)."""
    bs = cal.engine.block_size_tokens
    want = sink_tokens + WINDOW_CONTEXT_S * cal.stream.kv_tokens_per_s
    floor_blocks = cdiv(sink_tokens, bs) + 1
    blocks = max(int(math.floor(want / bs + 0.5)), floor_blocks)
    # a session holds up to S+W blocks plus one in flight
    fit = (cal.engine.usable_blocks - cal.engine.watermark_blocks) // MIN_BOUNDED_SESSIONS - 1
    blocks = max(min(blocks, fit), floor_blocks)
    return int(blocks * bs - sink_tokens)


def recommended_policy(cal: Calibration, kind: str = DEFAULT_KV, given: dict | None = None) -> tuple[KVPolicy, bool]:
    """The bound a report recommends for ``cal`` (and ``metronome-sim fleet`` plans with by default): ``kind``
    with the parameters ``given`` as they are and the others sized to about the last ``WINDOW_CONTEXT_S`` of
    conversation (:func:`default_window_tokens`). Returns the policy and whether its window was chosen here."""
    cls, given = policy_class(kind), dict(given or {})
    check_policy_options(kind, given)
    policy = cls.sized(cal.engine.block_size_tokens, given, lambda s: s + default_window_tokens(cal, s))
    return policy, not any(p.sizes and p.name in given for p in cls.params)


def make_plan(spec: str, cal: Calibration, options: ReportOptions) -> Plan:
    """Resolve the defaults for one calibration (one-line errors for a bad combination)."""
    policy, window_defaulted = recommended_policy(cal, options.kv, dict(options.kv_params))
    durations = Durations.parse(options.session_duration)
    if not math.isfinite(durations.mean_s):
        raise MetronomeError(f"--session-duration {options.session_duration!r}: needs a finite mean")
    fm = FillModel(cal, policy)
    if fm.usable_blocks < (fm.peak_resident_blocks or 0):
        raise MetronomeError(f"{cal.name}: the pool ({cal.engine.num_blocks} blocks) is too small for one session "
                             f"under {policy.describe()} ({fm.peak_resident_blocks} blocks)")
    return Plan(spec=spec, calibration=cal, policy=policy, durations=durations,
                session_duration=options.session_duration,
                deadline_s=float(options.deadline_s or cal.stream.frame_period_s), seed=options.seed,
                mc_runs=options.mc_runs, mc_edge_runs=options.mc_edge_runs, arrival_rate=options.arrival_rate,
                window_defaulted=window_defaulted, phases=options.phases)


@dataclass(frozen=True)
class ReportPlan:
    """The whole report's work, planned from its options by :func:`plan_report`: one :class:`Plan` per
    calibration (in the order given) and the ``--live`` folder read for each. Each phase's simulations come from
    here as one typed list of :class:`Point`, every calibration's together, so the builder runs a phase as one
    batch and never decides itself what to simulate."""

    options: ReportOptions
    calibrations: tuple[Plan, ...]
    live: tuple[dict | None, ...]  # read_live's answer per calibration (None: no --live folder for it)

    @property
    def other_phases(self) -> str:
        """The regime the answer does not assume: N* is computed under it too and shown when it differs."""
        return {"independent": "aligned", "aligned": "independent"}[self.options.phases]

    @property
    def refine_rounds(self) -> int:
        """Top-up passes of the collapse band's edge at most (:meth:`refinement` after each)."""
        return MC_REFINE_ROUNDS

    def capacity_points(self) -> list[Point]:
        """The capacity phase: N* per calibration under the answer's regime (section ``capacity``) and the other
        one (``other_regime``), then under the answer's regime with each other serving stack the calibration ships
        (``stack``, keyed by the stack). A point's ``point`` is :meth:`Plan.capacity_task`."""
        out = [Point(section, p.calibration.stack, "capacity", p.capacity_task(phases), i)
               for section, phases in (("capacity", self.options.phases), ("other_regime", self.other_phases))
               for i, p in enumerate(self.calibrations)]
        return out + [Point("stack", s, "capacity", p.capacity_task(self.options.phases, stack=s), i)
                      for i, p in enumerate(self.calibrations) for s in p.calibration.stacks
                      if s != p.calibration.stack]

    def range_points(self, by_stack: list[dict[str, dict]]) -> list[Point]:
        """N* over the step terms' ranges: every variant (:func:`metronome.sim.capacity.range_variants`) of every
        calibration with each stack it ships, to be searched from near that stack's central N* (``by_stack``: per
        calibration, stack -> its capacity). A point's key is (stack, the variant's term overrides)."""
        from metronome.sim.capacity import CENTRAL_KEYS, range_variants

        return [Point("ranges", (stack, ov), "range",
                      {"calibration": plan.spec, "stack": stack, "policy": plan.policy,
                       "overrides": [list(o) for o in ov], "central": {k: cap[k] for k in CENTRAL_KEYS}}, i)
                for i, (plan, caps) in enumerate(zip(self.calibrations, by_stack)) for stack, cap in caps.items()
                for ov in range_variants(plan.calibration.with_stack(stack or None), plan.policy)]

    def simulation_points(self, caps: list[dict], aimd_params: list[dict | None]) -> list[Point]:
        """Every calibration's :func:`simulation_points`, given its capacity and its tuned controller (None: the
        static limit), in the order of the calibrations."""
        return self._tagged(simulation_points(plan, cap, aimd, live)
                            for plan, cap, aimd, live in zip(self.calibrations, caps, aimd_params, self.live))

    def refinement(self, caps: list[dict], counts: list[dict[tuple, tuple[int, int]]]) -> list[Point]:
        """Every calibration's :func:`mc_refinement` after a Monte Carlo pass (``counts``: per calibration, (policy,
        N, d) -> (collapsed runs, runs) so far). Empty once every edge is measured."""
        return self._tagged(mc_refinement(plan, cap["n_star"], c)
                            for plan, cap, c in zip(self.calibrations, caps, counts))

    def prediction_points(self, caps: list[dict]) -> list[Point]:
        """Every calibration's :func:`prediction_points`."""
        return self._tagged(prediction_points(plan, cap["n_star"]) for plan, cap in zip(self.calibrations, caps))

    @staticmethod
    def _tagged(per_calibration) -> list[Point]:
        """One list of every calibration's points, each naming its calibration."""
        return [replace(pt, calibration=i) for i, pts in enumerate(per_calibration) for pt in pts]


def plan_report(options: ReportOptions) -> ReportPlan:
    """Check every input before any work (the options, calibrations, the bound, the mix, the live folders, the
    prices) and plan the report: one line and no work for anything wrong."""
    # imported here, not at the top: the CLIs import this module for its defaults before any report is asked for
    from metronome import calibration as calmod
    from metronome.report.live import check_resimulation, read_live
    from metronome.sim import scenario as scn

    options.validate()
    plans = tuple(make_plan(spec, calmod.load(spec), options) for spec in options.calibrations)
    names = [p.calibration.name for p in plans]
    if len(set(names)) != len(names):
        raise MetronomeError(f"--calibration given twice for {names[0]!r}: compare two different calibrations")
    live = tuple([read_live(d) for d in options.live] + [None] * (len(plans) - len(options.live)))
    for plan, lv in zip(plans, live):  # a live run without sim/ is re-simulated with this plan's calibration
        check_resimulation(lv, plan.calibration)
    if options.offered_load is not None:
        from metronome.sim.fleet_config import check_prices

        check_prices(dict(options.gpu_prices), names)
    for plan in plans:  # build one scenario of each kind now: a bad combination fails before the work
        scn.make_scenario(**plan.base(**plan.bound_options(), sessions=plan.memory_ceiling, horizon=1.0,
                                      session_duration=plan.session_duration))
    return ReportPlan(options, plans, live)
