"""``metronome-sim``: run, what-if, capacity, fleet, calibrations and more.

Every error a user can cause prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from metronome import serving, units
from metronome.admission import PARAMS_HELP, check_params_apply, controller_specs
from metronome.erlang import DEFAULT_MAX_REFUSAL
from metronome.cli import STACK_HELP, add_calibration_options, quiet, refuse_unused, stack_specs
from metronome.errors import MetronomeError, run_command
from metronome.kv_policy import (bounded_kinds, check_policy_options, given_params, policy_kinds,
                                 policy_option_values, policy_params)
from metronome.outputs import check_out, write_outputs
from metronome.report.plan import DEFAULT_MC_RUNS, MC_EDGE_RUNS

DEFAULT_CALIBRATION = "moshi-7b-h200"
DEADLINE_HELP = ("frame deadline: 80ms, 0.08s (a bare number is seconds; one over 10 frame periods is refused as a "
                 "likely unit slip); default: the frame period")

# option name -> (parser of one value, help)
SCENARIO_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "calibration": (str, f"preset name or calibration JSON file (default {DEFAULT_CALIBRATION})"),
    "kv": (str, f"KV policy: {' | '.join(policy_kinds())} (default unbounded)"),
    **{name: (int, f"{p.help} (with a --kv that takes it)") for name, p in policy_params().items()},
    "sessions": (int, "N sessions start at t=0 (or over --ramp seconds)"),
    "arrival_rate": (units.RATE, "Poisson session arrivals: 2 or 2/s, 120/min (needs --session-duration)"),
    "ramp_s": (units.DURATION, "spread --sessions evenly over this long: 30 or 30s, 2min"),
    "rate_pattern": (str, "Poisson arrivals with a piecewise rate: SECONDS:RATE,... or a file (needs --session-duration)"),
    "session_duration": (str, "SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,... (each time 300, 300s or "
                              "5min; default: the horizon)"),
    "horizon": (units.DURATION, "simulated time: 600, 600s or 10min (default 600 s)"),
    "seed": (int, "random seed (default 0)"),
    "deadline": (units.DURATION, DEADLINE_HELP),
    "num_blocks": (int, "override the calibration's pool size in blocks"),
    "admission": (str, f"{' | '.join(controller_specs())} (default none)"),
    "phases": (str, f"{' | '.join(serving.PHASES)}: each session's frames on its own clock, the engine stepping while "
                    "any has work (vLLM serving real clients; default), or every session in lockstep (a "
                    "fixed-batch server)"),
    "loop": (str, f"{' | '.join(serving.LOOPS)}: the front end steps vLLM and sees each starved session "
                  "(default, as metronome-probe's driver), or is a client of vLLM's own loop (AsyncLLM, vllm serve) "
                  "and breaks a full pool's deadlock only once a step runs nothing"),
}
FLAG = {"ramp_s": "--ramp", "arrival_rate": "--arrival-rate", "session_duration": "--session-duration",
        "num_blocks": "--num-blocks", "rate_pattern": "--rate-pattern"}


def _duration(flag_name: str):
    """An argparse ``type`` reading a duration with its unit (a bare number is seconds)."""
    return units.argtype(units.duration, flag_name)


# a share refused in (0, 1): 0.01 or 1%
_refusal = units.argtype(units.share, "--max-refusal", closed=False)


def flag(name: str) -> str:
    return FLAG.get(name, "--" + name.replace("_", "-"))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _parse_one(name: str, text: str):
    kind = SCENARIO_OPTIONS[name][0]
    if isinstance(kind, units.Kind):
        return kind.parse(text, flag(name))
    try:
        v = kind(text)
    except ValueError:
        raise MetronomeError(f"{flag(name)}: cannot read {text!r} as {kind.__name__}") from None
    if kind is float and not math.isfinite(v):
        raise MetronomeError(f"{flag(name)}: must be finite, got {text!r}")
    return v


def parse_values(name: str, text: str) -> list:
    """One value, a comma list ``a,b,c`` or an inclusive range ``start:stop:step`` (numbers only)."""
    kind = SCENARIO_OPTIONS[name][0]
    if (kind in (int, float) or isinstance(kind, units.Kind)) and text.count(":") == 2 and "," not in text:
        a, b, c = (_parse_one(name, x) for x in text.split(":"))
        if c <= 0 or b < a:
            raise MetronomeError(f"{flag(name)}: range {text!r} needs start <= stop and step > 0")
        out, k = [], 0
        bare = all(getattr(x, "bare", True) for x in (a, b, c))
        while a + k * c <= b + 1e-9 * max(1.0, abs(b)):
            v = a + k * c
            out.append(units.Quantity(v, bare, f"{v:.6g}") if isinstance(kind, units.Kind) else kind(v))
            k += 1
        return out
    if (name == "session_duration" and text.startswith("list:")) or name == "rate_pattern":
        return [text]
    return [_parse_one(name, x.strip()) for x in text.split(",") if x.strip()]


def add_out_options(p: argparse.ArgumentParser, help_: str, default: str | None = None, required: bool = False):
    """``--out`` and ``--replace``: every command that writes results takes both (see metronome.outputs)."""
    p.add_argument("--out", default=default, required=required,
                   help=help_ + (f" (default {default})" if default else "") + "; refused if it already holds results")
    p.add_argument("--replace", action="store_true",
                   help="replace what --out holds: the new results take its place whole once they are complete")


def out_dir(args) -> Path | None:
    """The checked ``--out`` (None when not given): called first, before any work or any file is made."""
    return check_out(args.out, args.replace) if args.out else None


def add_scenario_options(p: argparse.ArgumentParser, lists: bool, out_default: str | None = None):
    for name, (_, help_) in SCENARIO_OPTIONS.items():
        help_ = help_ + (" — a list a,b,c or a range start:stop:step" if lists else "")
        if name == "calibration":
            add_calibration_options(p, help_)
            continue
        p.add_argument(flag(name), dest=name, default=None, help=help_)
    p.add_argument("--aimd-params", dest="aimd_params", default=None, help=PARAMS_HELP)
    add_out_options(p, "output folder", out_default)


def _plain(v):
    """A value as the simulator takes it (a :class:`metronome.units.Quantity` as its float, checks done)."""
    return float(v) if isinstance(v, units.Quantity) else v


def scenario_kwargs(args) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in SCENARIO_OPTIONS:
        raw = getattr(args, name)
        if raw is None:
            continue
        vals = parse_values(name, raw)
        if len(vals) != 1:
            raise MetronomeError(f"{flag(name)}: 'run' takes one value, got {raw!r} (use what-if for a grid)")
        kw[name] = _plain(vals[0])
    kw.setdefault("calibration", DEFAULT_CALIBRATION)
    if args.aimd_params:
        kw["aimd_params"] = args.aimd_params
    check_params_apply([kw.get("admission", "none")], bool(args.aimd_params))
    return kw


def _console():
    from rich.console import Console

    # piped output keeps whole lines (rich would wrap at 80 columns), unless COLUMNS says how wide to be
    import os

    return Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.1f} ms"


def print_summary(s: dict, out: Path | None):
    con = _console()
    con.print(f"[bold]metronome-sim run[/] · {s['calibration']} ({s['provenance']}) · {s['policy']} · "
              f"{s['workload']} · {s['horizon_s']:g} s · admission {s['admission']} · {s['phases']} phases")
    pred, obs = s["t_sat_predicted_s"], s["t_sat_observed_s"]
    if pred is not None and obs is not None:
        err = f" ({100 * (obs - pred) / pred:+.1f}%)" if pred else ""
        tsat = f"predicted {pred:.1f} s · observed {obs:.1f} s{err}"
    else:
        tsat = (f"predicted {'never' if pred is None else f'{pred:.1f} s'} · "
                f"observed {'never (pool never ran dry)' if obs is None else f'{obs:.1f} s'}")
    rows = [
        ("t_sat", tsat),
        ("pool", f"peak occupancy {_pct(s['peak_pool_occupancy'])} · {s['preemptions']} preemptions · "
                 f"memory ceiling {s['memory_ceiling'] if s['memory_ceiling'] is not None else 'n/a'} sessions"),
        ("sessions", f"{s['sessions_offered']} offered · {s['sessions_admitted']} admitted · "
                     f"{s['sessions_refused']} refused"),
        ("frames", f"{s['frames']:,} answered · silent {_pct(s['silent_frame_fraction'])} · "
                   f"deadline misses {_pct(s['deadline_miss_fraction'])}"),
        ("latency", f"p50 {_ms(s['p50_frame_latency_s'])} · p99 {_ms(s['p99_frame_latency_s'])} "
                    f"(deadline {_ms(s['deadline_s'])})"),
    ]
    for k, v in rows:
        con.print(f"  {k:<9} {v}")
    if s["collapsed"]:
        con.print(f"  [bold red]verdict[/]   COLLAPSED: the pool ran dry at {obs:.1f} s and "
                  f"{_pct(s['silent_frame_fraction'])} of frames were silent, while deadline misses stayed at "
                  f"{_pct(s['deadline_miss_fraction'])}. A latency dashboard would have looked healthy.")
    elif s["deadline_miss_fraction"] and s["deadline_miss_fraction"] > 0.01:
        con.print(f"  [bold yellow]verdict[/]   over the deadline: {_pct(s['deadline_miss_fraction'])} of frames late")
    else:
        con.print("  [bold green]verdict[/]   healthy: no collapse, deadlines met")
    if out is not None:
        con.print(f"  wrote     {out}/{{summary.json, steps.parquet, frames.parquet, sessions.parquet}}")


# ------------------------------------------------------------------------------------- commands
def cmd_run(args) -> int:
    from metronome.sim import scenario as scn

    out = out_dir(args)
    sc = scn.make_scenario(**scenario_kwargs(args))
    compile_notice()
    res = scn.run(sc, fast_forward=not args.no_fast_forward)
    if out is not None:
        scn.write(res, out, args.replace)
    if args.json:
        print(json.dumps(res.summary, indent=2))
    else:
        print_summary(res.summary, out)
    return 0


def cmd_what_if(args) -> int:
    from rich.progress import Progress

    from metronome.sim import sweep

    out = out_dir(args)
    axes: dict[str, list] = {}
    for name in SCENARIO_OPTIONS:
        raw = getattr(args, name)
        if raw is not None:
            axes[name] = [_plain(v) for v in parse_values(name, raw)]
    axes.setdefault("calibration", [DEFAULT_CALIBRATION])
    check_params_apply(axes.get("admission", ["none"]), bool(args.aimd_params))
    if args.aimd_params:
        axes["aimd_params"] = [args.aimd_params]
    points = sweep.grid(axes)
    sweep.validate_points(points)
    con = _console()
    executor = _executor(args)
    with Progress(console=con, transient=False) as bar:
        task = bar.add_task(f"what-if: {len(points)} runs", total=len(points))
        table = sweep.what_if(points, executor=executor, progress=lambda n: bar.advance(task, n))
    write_outputs(out, {"what_if": table}, args.replace)
    varying = [f"opt_{k}" for k, v in axes.items() if len(v) > 1]
    show = varying + ["t_sat_predicted_s", "t_sat_observed_s", "silent_frame_fraction", "deadline_miss_fraction",
                      "p99_frame_latency_s", "peak_pool_occupancy", "collapsed"]
    from rich.table import Table

    t = Table(title=f"what-if ({len(points)} points)")
    for c in show:
        t.add_column(c.replace("opt_", ""), justify="right")
    for _, row in table.iterrows():
        t.add_row(*[_fmt(row[c]) for c in show])
    con.print(t)
    con.print(f"wrote {out}/what_if.parquet and {out}/what_if.csv")
    return 0


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _executor(args):
    from metronome.sim.executors import make_executor

    executor = make_executor(args.executor, args.workers, args.ray_address)
    compile_notice()
    return executor


_NOTICE: list = []


def compile_notice() -> None:
    """Say once, before a command's first simulation, that numba compiles the simulator first when its on-disk
    cache holds no machine code for the compiled loop (asked of numba's cache index: nothing compiled to know)."""
    if _NOTICE:
        return
    _NOTICE.append(True)
    from metronome import compiled
    from metronome.sim import fastpath

    if compiled.cold([getattr(fastpath, n) for n in ("run_span", "flush") if hasattr(fastpath, n)]):
        print("compiling the simulator first (numba; once, then cached): about 1-2 minutes on two idle cores, "
              "longer on a busy machine", flush=True)


def add_executor_options(p: argparse.ArgumentParser):
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local process pool on every core (default) or a Ray cluster")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (HOST:PORT, ray://HOST:PORT or auto)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: every core)")


def cmd_metastability(args) -> int:
    from rich.progress import Progress

    from metronome.sim.montecarlo import metastability

    out = out_dir(args)
    point = scenario_kwargs(args)
    seed = point.pop("seed", 0)
    if args.runs < 1:
        raise MetronomeError(f"--runs must be >= 1, got {args.runs}")
    executor = _executor(args)
    con = _console()
    with Progress(console=con) as bar:
        task = bar.add_task(f"metastability: {args.runs} runs", total=args.runs)
        summary, table = metastability(point, args.runs, seed, executor, progress=lambda n: bar.advance(task, n),
                                       full_runs=args.full_runs)
    if out:
        write_outputs(out, {"summary.json": summary, "runs": table}, args.replace)
    sc = summary["scenario"]
    con.print(f"[bold]metastability[/] · {sc['calibration']} · {sc['policy']} · {sc['workload']} · {sc['horizon_s']:g} s")
    p_sat, p_col = summary["predicted_saturation_probability"], summary["predicted_collapse_probability"]
    con.print(f"  collapsed {summary['collapsed_runs']} of {summary['runs']} runs "
              f"({100 * summary['collapse_fraction']:.0f}%), pool saturated in {summary['saturated_runs']} "
              f"({100 * summary['saturated_fraction']:.0f}%)")
    if p_sat is not None:
        con.print(f"  fill model: P(saturate) = {100 * p_sat:.0f}% · gap to observed saturation "
                  f"{100 * summary['saturation_prediction_gap']:+.0f} points")
    if p_col is not None:
        con.print(f"  fill model: P(collapse) = {100 * p_col:.0f}% · gap to observed collapse "
                  f"{100 * summary['collapse_prediction_gap']:+.0f} points")
    ct = summary["collapse_time_s"]
    if ct:
        con.print(f"  collapse time: min {ct['min']:.1f} s · p50 {ct['p50']:.1f} s · max {ct['max']:.1f} s")
    early = summary["stopped_early_runs"]
    con.print(f"  {summary['wall_s']:.1f} s wall on the {executor.name} executor"
              + (f"; {early} runs stopped once decided (--full-runs simulates each to the horizon)" if early else ""))
    if out:
        con.print(f"  wrote {out}/summary.json and {out}/runs.parquet")
    return 0


def _calibration_and_policy(args, name: str):
    """The calibration ``name`` (with ``--num-blocks``) and the KV policy of ``--kv`` and its parameters."""
    from metronome import calibration as calmod
    from metronome.kv_policy import make_policy

    cal = calmod.load(name)
    if args.num_blocks is not None:
        from dataclasses import replace

        nb = _parse_one("num_blocks", args.num_blocks)
        if nb <= 0:
            raise MetronomeError(f"--num-blocks must be positive, got {nb}")
        cal = replace(cal, engine=replace(cal.engine, num_blocks=nb))
    values = {k: (_parse_one(k, v) if v is not None else None) for k, v in policy_option_values(args).items()}
    check_policy_options(args.kv or "unbounded", values, default=args.kv is None)
    return cal, make_policy(args.kv or "unbounded", cal.engine.block_size_tokens, **values)


def print_ranges(con, res: dict) -> None:
    """``capacity``'s answer with its interval over the step terms' ranges, and the terms that move it."""
    from rich.markup import escape

    from metronome.report.answer import duration as short
    from metronome.sim.capacity import interval_words

    r = res["ranges"]
    con.print(f"  [bold]N* = {res['n_star']:,} sessions[/] ({escape(interval_words(res))})", highlight=False)
    moving = [b for b in r["tornado"] if b["swing_sessions"]]
    if not moving:
        return
    con.print("  deadline-bound N* with one term at its low · at its high (the others at their values; every term "
              "at once gives the interval):", highlight=False)
    width = min(max(len(b["term"]) for b in moving), 48)
    for b in moving:
        unit = b["unit"][2:]
        con.print(f"    {b['term'][:width]:<{width}}  {b['deadline_n_star_at_low_sessions']:>7,} · "
                  f"{b['deadline_n_star_at_high_sessions']:<7,} {b['basis']}, "
                  f"{short(b['low_s'])}–{short(b['high_s'])} {unit}", markup=False, highlight=False)
    still = len(r["tornado"]) - len(moving)
    if still:
        con.print(f"    ({still} more ranged term{'s move' if still > 1 else ' moves'} it by less than one session)",
                  highlight=False)


def cmd_capacity(args) -> int:
    from rich.markup import escape

    from metronome.sim.capacity import capacity
    from metronome.workload import Durations

    out = out_dir(args)
    cal, policy = _calibration_and_policy(args, args.calibration or DEFAULT_CALIBRATION)
    if not 0 < args.target_fraction <= 1:
        raise MetronomeError(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    duration = Durations.parse(args.session_duration).mean_s if args.session_duration else None
    if args.deadline is not None and not args.deadline > 0:
        raise MetronomeError(f"--deadline must be positive seconds, got {args.deadline}")
    compile_notice()
    con = _console()
    with con.status("bisecting on N, then over the step terms' ranges ...") as status:
        res = capacity(cal, policy, args.deadline, args.target_fraction, args.percentile, duration,
                       phases=serving.check_phases(args.phases or "independent"), ranges=True,
                       progress=lambda n, v: status.update(f"N={n}: p{args.percentile:g} {1e3 * v:.1f} ms"))
    con.print(f"[bold]capacity[/] · {res['calibration']} ({res['provenance']}) · {res['policy']} · "
              f"{res['phases']} phases · "
              f"deadline {1e3 * res['deadline_s']:g} ms, target p{res['percentile']:g} <= {1e3 * res['target_latency_s']:.1f} ms"
              + (f" · stack {escape(cal.stack)}" + (" (the default)" if cal.stack == cal.stacks[0] else "")
                 if cal.stack else ""))
    mc = res["memory_ceiling"]
    con.print(f"  memory ceiling      {mc if mc is not None else 'n/a'} sessions"
              + ("" if policy.bounded else f" (sessions of {duration or 600:g} s)"))
    con.print(f"  deadline-bound N*   {res['deadline_n_star']} sessions")
    con.print(f"  binds               [bold]{res['binding']}[/]: N* = {res['n_star']} sessions")
    print_ranges(con, res)
    if out:
        write_outputs(out, {"capacity.json": res}, args.replace)
        con.print(f"  wrote {out}/capacity.json")
    return 0


def _list_floats(flag_name: str, text: str | None) -> list[float] | None:
    if text is None:
        return None
    if flag_name == "--interval":  # (durations, each with its unit or in seconds)
        return [float(x) for x in units.parse_list(units.DURATION, text, flag_name)]
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MetronomeError(f"{flag_name}: cannot read {text!r} as a list of numbers") from None


def cmd_tune_aimd(args) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from metronome.sim.tuning import DEFAULT_GRID, tune_aimd

    out = out_dir(args)
    for given in ("admission", "aimd_params"):
        if getattr(args, given) is not None:
            raise MetronomeError(f"{flag(given)}: tune-aimd searches the AIMD parameters itself; leave it out")
    point = scenario_kwargs(args)
    seed = point.pop("seed", 0)
    grid = {}
    for key, flag_name in (("additive_increase", "--additive-increase"), ("decrease_factor", "--decrease-factor"),
                           ("target_fraction", "--target-fraction"), ("interval_s", "--interval")):
        v = _list_floats(flag_name, getattr(args, key))
        if v is not None:
            grid[key] = v
    n = 1
    for k, v in {**DEFAULT_GRID, **grid}.items():
        n *= len(v)
    total = n * args.seeds
    executor = _executor(args)
    con = _console()
    with Progress(console=con) as bar:
        task = bar.add_task(f"tune-aimd: {n} settings x {args.seeds} seeds", total=total)
        best, table = tune_aimd(point, grid, args.seeds, seed, args.miss_budget, executor=executor,
                                progress=lambda k: bar.advance(task, k))
    write_outputs(out, {"best_aimd.json": best, "tradeoff": table}, args.replace)
    p, f = best["params"], best["figures"]
    con.print(f"[bold]best AIMD[/]: +{p['additive_increase']:g} per {p['interval_s']:g} s, x{p['decrease_factor']:g} on "
              f"congestion, target {p['target_fraction']:g} x deadline (p{p['percentile']:g})")
    con.print(f"  goodput {f['goodput_frames_per_s']:.1f} frames/s (= {f['goodput_sessions']:.1f} healthy sessions), "
              f"worst deadline misses {100 * f['worst_deadline_miss_fraction']:.2f}%, collapsed seeds {f['collapsed_seeds']}")
    t = Table(title="trade-off (top 10 of %d)" % len(table))
    cols = ["additive_increase", "decrease_factor", "target_fraction", "interval_s", "goodput_sessions",
            "worst_deadline_miss_fraction", "collapsed_seeds", "feasible"]
    for c in cols:
        t.add_column(c, justify="right")
    for _, row in table.head(10).iterrows():
        t.add_row(*[_fmt(row[c]) for c in cols])
    con.print(t)
    con.print(f"wrote {out}/best_aimd.json (use: metronome-sim run --admission aimd --aimd-params {out}/best_aimd.json) "
              f"and {out}/tradeoff.parquet/.csv")
    return 0


@contextmanager
def _phases(con, transient: bool = False):
    """A progress display for work in named phases: yields ``phase(label, total) -> advance(n)``, the callback
    the report and the fleet planner take."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=transient) as bar:
        def phase(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        yield phase


def _prices(specs: list[str] | None) -> dict[str, float]:
    """``NAME=USD_PER_HOUR`` flags as a dict (the names and prices are checked by the fleet's check_prices)."""
    out: dict[str, float] = {}
    for spec in specs or []:
        name, eq, usd = spec.partition("=")
        try:
            out[name.strip()] = float(usd)
        except ValueError:
            eq = ""
        if not eq or not name.strip():
            raise MetronomeError(f"--gpu-price wants NAME=USD_PER_HOUR, got {spec!r}")
    return out


def _fleet_inputs(args):
    """Every input of ``fleet``, checked before any work: (calibrations with policies, arrivals, durations, horizon,
    routers, autoscale policy, AIMD params, prices by calibration name)."""
    from metronome.erlang import check_refusal
    from metronome.sim.fleet_config import (ROUTERS, AutoscalePolicy, check_engine_count, check_horizon,
                                             check_offered, check_prices, check_router)
    from metronome.workload import Arrivals, Durations

    loads = [x for x in (args.arrival_rate, args.rate_pattern, args.load_csv) if x is not None]
    if len(loads) != 1:
        raise MetronomeError("give the offered load once: --arrival-rate R, --rate-pattern SPEC or --load-csv FILE")
    if args.arrival_rate is not None:
        arrivals = Arrivals("poisson", rate_per_s=_parse_one("arrival_rate", args.arrival_rate))
    elif args.rate_pattern is not None:
        arrivals = Arrivals.parse_pattern(args.rate_pattern)
    else:
        arrivals = Arrivals.from_csv(args.load_csv)
    check_offered(arrivals)
    durations = Durations.parse(args.session_duration)
    horizon = check_horizon(_parse_one("horizon", args.horizon) if args.horizon is not None
                            else arrivals.pattern_s or 86400.0)
    check_refusal(args.max_refusal, "--max-refusal")
    if args.engines is not None:
        check_engine_count(args.engines)
    if args.seeds < 1:
        raise MetronomeError(f"--seeds must be >= 1, got {args.seeds}")
    if not (args.peak_window > 0 and math.isfinite(args.peak_window)):
        raise MetronomeError(f"--peak-window must be positive seconds, got {args.peak_window:g}")
    if args.deadline is not None and not args.deadline > 0:
        raise MetronomeError(f"--deadline must be positive seconds, got {args.deadline}")
    routers = [check_router(r.strip()) for r in args.routers.split(",") if r.strip()]
    if not routers:
        raise MetronomeError(f"--routers needs one or more of {', '.join(ROUTERS)}")
    autoscale = None
    if args.autoscale:
        autoscale = AutoscalePolicy(min_engines=args.min_engines, max_engines=args.max_engines,
                                    scale_out_after_s=args.scale_out_after, scale_in_after_s=args.scale_in_after,
                                    start_delay_s=args.engine_start_s, scale_out_utilization=args.scale_out_utilization,
                                    scale_in_utilization=args.scale_in_utilization, max_refusal=args.max_refusal)
    params = None
    if args.aimd_params:
        from metronome.admission import AIMDParams

        params = AIMDParams.from_file(args.aimd_params)
    engines = [(name, *_fleet_engine(args, name)) for name in (args.calibration or [DEFAULT_CALIBRATION])]
    by_arg = {name: cal.name for name, cal, _ in engines}  # a calibration is named by its argument or its own name
    prices = check_prices({by_arg.get(k, k): usd for k, usd in _prices(args.gpu_price).items()},
                          [cal.name for _, cal, _ in engines])
    return engines, arrivals, durations, horizon, routers, autoscale, params, prices


def _fleet_engine(args, name: str):
    """fleet's calibration and KV policy: ``--kv`` as given, else the bound the report recommends
    (:func:`metronome.report.plan.recommended_policy`, the one source of that default), its parameters as given or
    sized as the report sizes them."""
    if args.kv is not None:
        return _calibration_and_policy(args, name)
    from metronome.report.plan import DEFAULT_KV, recommended_policy

    given = {k: _parse_one(k, v) for k, v in policy_option_values(args).items() if v is not None}
    cal, _ = _calibration_and_policy(argparse.Namespace(**{**vars(args), **{k: None for k in policy_params()}}), name)
    return cal, recommended_policy(cal, DEFAULT_KV, given)[0]


def _unbounded_beside(types, summary: dict, deadline_s, mean_s: float, cache: dict, phases: str) -> None:
    """For each bounded engine type, the unbounded figure beside it in ``summary``: N* unbounded and its GPUs at the
    peak by Erlang B (what the fleet would need without the bound)."""
    from metronome.erlang import engines_by_routing
    from metronome.kv_policy import KVPolicy
    from metronome.sim.fleet_config import capacity_cached

    for et, c in zip(types, summary["calibrations"]):
        if not et.policy.bounded:
            continue
        cap = capacity_cached(et.calibration, KVPolicy.unbounded(et.policy.block_size), deadline_s, mean_s, cache,
                              phases)
        n = int(cap["n_star"])
        c["unbounded"] = {"n_star": n, "binding": cap["binding"], "closed_form_engines": (
            engines_by_routing(summary["peak_offered_erlangs"], n, summary["max_refusal"]) if n >= 1
            else {"pooled": None, "random": None})}


def cmd_fleet(args) -> int:
    from rich.table import Table

    from metronome.outputs import atomic_dir, write_json
    from metronome.report.answer import fleet_hours_table, fleet_rows, peak_words
    from metronome.sim.fleet_config import EngineType, capacity_cached
    from metronome.sim.fleet_plan import PlanOptions, hour_series, plan

    out = out_dir(args)
    engines, arrivals, durations, horizon, routers, autoscale, params, prices = _fleet_inputs(args)
    phases = serving.check_phases(args.phases or "independent")
    executor = _executor(args)
    con = _console()
    cache: dict = {}
    types = []
    for name, cal, policy in engines:
        with con.status(f"capacity of {cal.name} under {policy.describe()} ..."):
            cap = capacity_cached(cal, policy, args.deadline, durations.mean_s, cache, phases)
        types.append(EngineType.from_capacity(cal, policy, cap))
    seeds = list(range(args.seed, args.seed + args.seeds))
    with _phases(con, transient=True) as phase:
        options = PlanOptions(max_refusal=args.max_refusal, routers=routers, seeds=seeds, engines=args.engines,
                              controller=args.admission, aimd_params=params, autoscale=autoscale, prices=prices,
                              peak_window_s=args.peak_window)
        summary, tables = plan(types, arrivals, durations, horizon, options, executor=executor, progress=phase)
    summary["offered_load"] = arrivals.describe()
    summary["session_durations"] = durations.describe()
    with con.status("capacity without the bound, for comparison ..."):
        _unbounded_beside(types, summary, args.deadline, durations.mean_s, cache, phases)
    target = args.max_refusal
    for c in summary["calibrations"]:
        con.print(f"[bold]fleet[/] · {c['calibration']} ({c['provenance']}) · {c['policy']} · "
                  f"N* = {c['n_star']} sessions per GPU · peak {peak_words(summary)} · refusal target {_pct(target)}")

        for label, text in fleet_rows(c, horizon, target):
            con.print(f"  {label:<28} {text}", markup=False)
        header, rows = fleet_hours_table({c["calibration"]: hour_series(tables["bins"], c["calibration"], routers[0])})
        t = Table(title=f"{c['calibration']} per hour ({routers[0]})")
        for col in header:
            t.add_column(col, justify="right")
        for row in rows:
            t.add_row(*row)
        con.print(t)
    speed = summary["simulated_engine_seconds_per_wall_s"]
    con.print(f"simulation speed: {speed:,.0f} simulated engine-seconds per wall second "
              f"({summary['simulated_engine_seconds'] / 3600:,.0f} engine-hours; {summary['wall_s']:.1f} s wall in all, "
              f"{executor.name} executor)")
    if out is not None:
        with atomic_dir(out, args.replace) as tmp:
            write_json(tmp / "fleet.json", summary)
            for name, table in tables.items():
                table.to_parquet(tmp / f"{name}.parquet", index=False)
                table.to_csv(tmp / f"{name}.csv", index=False)
        con.print(f"wrote {out}/fleet.json, {out}/bins.parquet/.csv and {out}/engines.parquet/.csv")
    return 0


def cmd_calibrations(args) -> int:
    if args.terms is not None:
        return print_terms(args.terms, args.stack)
    if args.stack is not None:
        raise MetronomeError("--stack only applies with --terms NAME here; alone it would change nothing")
    from rich.table import Table

    from metronome import calibration as calmod
    from metronome.fill_model import FillModel
    from metronome.kv_policy import KVPolicy

    header = ("name", "provenance", "hardware", "KiB per token", "pool blocks", "pool tokens", "frame ms",
              "growth tok/s", "t_sat s at N=100", "stacks (default first)")
    rows = []
    for name in calmod.preset_names():
        cal = calmod.load_preset(name)
        ts = FillModel(cal, KVPolicy.unbounded(cal.engine.block_size_tokens)).t_sat(100)
        rows.append((name, cal.provenance.kind, cal.provenance.hardware, f"{cal.kv_bytes_per_token / 1024:g}",
                     f"{cal.engine.num_blocks:,}", f"{cal.engine.num_blocks * cal.engine.block_size_tokens:,}",
                     f"{cal.stream.frame_period_s * 1e3:g}", f"{cal.stream.kv_tokens_per_s:g}",
                     "never" if ts is None else f"{ts:.0f}", ", ".join(cal.stacks) or "-"))
    con = _console()
    # a preset's name is what the user types next and a number is read whole: no column is narrower than its
    # widest cell (rich would cut it) and the headers wrap instead; the hardware (the name's last part says which
    # GPU) is left out where the terminal has no room for it
    shown = [i for i in range(len(header)) if i != 2 or con.width >= 150]
    t = Table(title="calibration presets (t_sat: N sessions, unbounded KV)", box=None, pad_edge=False,
              padding=(0, 1, 0, 0),
              header_style="bold")
    cells = {i: max(len(r[i]) for r in rows) for i in shown}
    whole = sum(max(cells[i], len(header[i])) + 1 for i in shown) <= con.width  # (room for one-line headers)
    for i in shown:
        widest = max([cells[i], len(header[i]) if whole else 0] + [len(w) for w in header[i].split()])
        t.add_column(header[i], justify="left" if i < 3 or i == len(header) - 1 else "right", overflow="fold",
                     width=widest if i not in (2, len(header) - 1) else None)
    for r in rows:
        t.add_row(*(r[i] for i in shown))
    con.print(t)
    con.print("a preset's step terms, their provenance and ranges: metronome-sim calibrations --terms NAME "
              "[--stack S]", highlight=False)
    return 0


def print_terms(spec: str, stack: str | None) -> int:
    """``calibrations --terms NAME``: each step term of the calibration (priced for its default stack or ``stack``)
    with its coefficient, value, range, basis and source; the plugin's apart."""
    from metronome import calibration as calmod
    from metronome.report.answer import duration

    cal = calmod.load(spec, stack=stack)
    con = _console()
    con.print(f"[bold]{cal.name}[/] ({cal.provenance.kind}) · {cal.provenance.hardware}", highlight=False)
    if cal.stack:
        default = cal.stack == cal.stacks[0]
        con.print(f"stack {cal.stack}{' (the default)' if default else ''}: {cal.stack_description(cal.stack)}",
                  markup=False, highlight=False)
        others = [s for s in cal.stacks if s != cal.stack]
        con.print(f"other stacks: {', '.join(others)} (--stack NAME)", markup=False, highlight=False)
    sl = cal.step_latency
    if not sl.terms and not sl.plugin_terms:
        con.print("no terms: a measured calibration's coefficients are fitted as a whole", highlight=False)
    for title, terms in (("step terms (summed into the coefficients)", sl.terms),
                         ("plugin terms (added when the sink+window plugin serves the policy)", sl.plugin_terms)):
        if not terms:
            continue
        con.print(f"[bold]{title}[/]", highlight=False)
        for t in terms:
            lo, hi = t.bounds()
            unit = calmod.COEFFICIENT_UNITS[t.coefficient]
            con.print(f"  {t.name}: {duration(t.value)} {unit} (range {duration(lo)}–{duration(hi)}) · {t.basis}",
                      markup=False, highlight=False)
            if t.source:
                con.print(f"      {t.source}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_report(args) -> int:
    import shlex

    from metronome.report import ReportOptions, build_report, write_report
    from metronome.report.live import calibrations_for
    from metronome.sim.cache import ResultCache

    out = out_dir(args)
    # without --calibration, a --live folder's own calibration (one line if it records none), else the default
    calibrations, from_live = calibrations_for(args.calibration, args.live, DEFAULT_CALIBRATION)
    options = ReportOptions(
        calibrations=calibrations, calibrations_from_live=from_live, kv=args.kv,
        kv_params=given_params(args),
        session_duration=args.session_duration, deadline_s=args.deadline,
        arrival_rate=args.arrival_rate, seed=args.seed, mc_runs=args.mc_runs, mc_edge_runs=args.mc_edge_runs, live=tuple(args.live or ()),
        phases=args.phases, offered_load=args.offered_load, max_refusal=args.max_refusal,
        gpu_prices=tuple(_prices(args.gpu_price).items()))
    executor = _executor(args)
    con = _console()
    command = " ".join(shlex.quote(a) for a in ["metronome-sim", *sys.argv[1:]])
    cache = ResultCache(enabled=not args.no_cache)
    try:
        with _phases(con) as phase:
            data = build_report(options, executor=executor, progress=phase, command=command, cache=cache)
    finally:
        cache.close()
    write_report(data, out, args.replace)
    from metronome.report.answer import gpus_words, headline

    for c in data["calibrations"]:
        con.print(f"[bold]{c['name']}[/] ({c['provenance']['kind']}): {headline(c)}")
        con.print(f"  {gpus_words(c)}", markup=False)
    size_mb = (out / "report.html").stat().st_size / 1e6
    con.print(f"wrote {out}/report.html ({size_mb:.1f} MB), {out}/report.md and {out}/report.json "
              f"in {data['wall_s']:.0f} s ({data['simulated_runs']} simulated runs; "
              + (f"{cache.hits} read from the cache in {cache.directory})" if cache.enabled else "cache off)"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="metronome-sim",
                      description="Simulate a vLLM-like engine serving real-time sessions: the KV cliff, the bound, t_sat.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    r = sub.add_parser("run", help="simulate one scenario")
    add_scenario_options(r, lists=False)
    r.add_argument("--json", action="store_true", help="print summary.json instead of the human summary")
    r.add_argument("--no-fast-forward", action="store_true", help="one SimPy event per step (slow; for checking)")
    r.set_defaults(fn=cmd_run)
    w = sub.add_parser("what-if", help="run a grid of scenarios (any option may be a list or range)")
    add_scenario_options(w, lists=True, out_default="what-if")
    add_executor_options(w)
    w.set_defaults(fn=cmd_what_if)
    m = sub.add_parser("metastability", help="run one scenario R times: collapse statistics vs the fill model")
    add_scenario_options(m, lists=False)
    m.add_argument("--runs", type=int, default=20, help="runs, seeds SEED..SEED+R-1 (default 20)")
    m.add_argument("--full-runs", action="store_true",
                   help="simulate every run to the horizon; by default a run stops once it has collapsed, can no "
                        "longer run the pool dry, or every session has ended (saturation and collapse are the "
                        "same either way; the per-run silence and latency figures then cover the time simulated)")
    add_executor_options(m)
    m.set_defaults(fn=cmd_metastability)
    cp = sub.add_parser("capacity", help="memory ceiling, deadline-bound N* and which binds")
    add_calibration_options(cp, SCENARIO_OPTIONS["calibration"][1])
    for name in ("kv", *policy_params(), "session_duration", "num_blocks", "phases"):
        cp.add_argument(flag(name), dest=name, default=None, help=SCENARIO_OPTIONS[name][1])
    cp.add_argument("--deadline", type=units.argtype(units.duration, "--deadline"), default=None, help=DEADLINE_HELP)
    cp.add_argument("--target-fraction", type=units.argtype(units.share, "--target-fraction"), default=0.8,
                    help="p99 target as a share of the deadline: 0.8 or 80%% (default 0.8)")
    cp.add_argument("--percentile", type=units.argtype(units.percentile, "--percentile"), default=99.0,
                    help="the latency percentile held to the target, in percent: 99 or 99.9 (default 99)")
    add_out_options(cp, "output folder for capacity.json")
    cp.set_defaults(fn=cmd_capacity)
    t = sub.add_parser("tune-aimd", help="search AIMD parameters for goodput under a miss budget and no collapse")
    add_scenario_options(t, lists=False, out_default="tune-aimd")
    t.add_argument("--seeds", type=int, default=2, help="seeds per setting (default 2)")
    t.add_argument("--miss-budget", type=units.argtype(units.share, "--miss-budget", closed=False), default=0.01,
                   help="deadline-miss budget per seed, a share: 0.01 or 1%% (default 0.01)")
    for name in ("additive-increase", "decrease-factor", "target-fraction", "interval"):
        t.add_argument("--" + name, dest=name.replace("-", "_") if name != "interval" else "interval_s", default=None,
                       help="comma list of values to search" + (" (1, 1s or 500ms)" if name == "interval" else ""))
    add_executor_options(t)
    t.set_defaults(fn=cmd_tune_aimd)
    rp = sub.add_parser("report", help="capacity-planning report (report.html + report.md) for one or more calibrations")
    add_calibration_options(rp, "preset name or calibration JSON; repeat to compare side by side (default: the "
                                "calibration each --live folder records, else moshi-7b-h200)", append=True)
    rp.add_argument("--kv", choices=bounded_kinds(), default="sinks", help="the bounded policy to recommend")
    for name, param in policy_params().items():
        rp.add_argument(f"--{name}", dest=name, type=int, default=None,
                        help=f"{param.help} (default: what the policy keeps for about the last 30 s of "
                             "conversation, in whole blocks)")
    rp.add_argument("--session-duration", dest="session_duration", default="exp:300",
                    help="session length mix: SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,... (default exp:300)")
    rp.add_argument("--deadline", type=units.argtype(units.duration, "--deadline"), default=None, help=DEADLINE_HELP)
    rp.add_argument("--arrival-rate", dest="arrival_rate", type=units.argtype(units.rate, "--arrival-rate"),
                    default=None, help="offered sessions for AIMD tuning and goodput: 2 or 2/s, 120/min (default: "
                                       "1.5x what N* carries)")
    rp.add_argument("--phases", choices=serving.PHASES, default="independent",
                    help="the regime the answer assumes: each session's frames on its own clock (vLLM serving "
                         "real clients; default) or all in lockstep (a fixed-batch server); N* is computed under "
                         "both and shown twice when they differ by more than 10%%")
    rp.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    rp.add_argument("--mc-runs", dest="mc_runs", type=int, default=DEFAULT_MC_RUNS,
                    help=f"Monte Carlo runs per metastability cell in the first pass (default {DEFAULT_MC_RUNS}); cells on the edge "
                         "of the collapse band are then topped up to --mc-edge-runs")
    rp.add_argument("--mc-edge-runs", dest="mc_edge_runs", type=int, default=MC_EDGE_RUNS,
                    help="runs of a metastability cell on the collapse band's edge: some runs collapsed and some "
                         f"not, or a neighbour's outcome differs (default {MC_EDGE_RUNS}; never fewer than --mc-runs)")
    rp.add_argument("--no-cache", dest="no_cache", action="store_true",
                    help="simulate every point and store nothing (default: reuse points simulated before, from "
                         "$METRONOME_CACHE_DIR, else $XDG_CACHE_HOME/metronome or ~/.cache/metronome)")
    rp.add_argument("--live", action="append", default=None,
                    help="live results for the fidelity section: the --out folder of metronome-probe validate, of "
                         "metronome-probe run (re-simulated with this calibration unless it has a sim/ folder) or of "
                         "benchmarks/bench_live_aimd.py (its run subfolders); once per --calibration, in order")
    rp.add_argument("--offered-load", dest="offered_load", default=None,
                    help="add a 'How many GPUs' section for this offered load: a rate in sessions/s, a rate "
                         "pattern SECONDS:RATE,... or a time,rate CSV file (e.g. a day in 15-minute buckets)")
    rp.add_argument("--max-refusal", dest="max_refusal", type=_refusal,
                    default=DEFAULT_MAX_REFUSAL,
                    help="with --offered-load: the share of conversations the fleet may refuse at its peak, 0.01 or "
                         f"1%% (default {DEFAULT_MAX_REFUSAL:g})")
    rp.add_argument("--gpu-price", dest="gpu_price", action="append", default=None, metavar="NAME=USD_PER_HOUR",
                    help="with --offered-load: a calibration's GPU price, for the cost per 1,000 session-hours (repeatable)")
    add_out_options(rp, "output folder for report.html, report.md and report.json", required=True)
    add_executor_options(rp)
    rp.set_defaults(fn=cmd_report)
    f = sub.add_parser("fleet", help="how many GPUs: fleet size at peak (Erlang B and simulation), GPU-hours static "
                                     "vs autoscaled, refusals and silent frames per hour, cost")
    add_calibration_options(f, f"preset name or calibration JSON; repeat to compare (default {DEFAULT_CALIBRATION})",
                            append=True)
    f.add_argument("--kv", dest="kv", default=None,
                   help=f"KV policy: {' | '.join(policy_kinds())} (default: the bound the report recommends, sinks "
                        "with S=16 and W about the last 30 s of conversation; the unbounded figure is printed beside it)")
    for name in (*policy_params(), "num_blocks", "phases"):
        f.add_argument(flag(name), dest=name, default=None, help=SCENARIO_OPTIONS[name][1])
    f.add_argument("--deadline", type=units.argtype(units.duration, "--deadline"), default=None, help=DEADLINE_HELP)
    f.add_argument("--arrival-rate", dest="arrival_rate", default=None,
                   help="offered load: a constant rate, 2 or 2/s, 120/min (a bare number is sessions per second)")
    f.add_argument("--rate-pattern", dest="rate_pattern", default=None,
                   help="offered load: SECONDS:RATE,... or a file of it (as run takes it)")
    f.add_argument("--load-csv", dest="load_csv", default=None,
                   help="offered load: a CSV of time,rate rows (seconds from the start or HH:MM; sessions/s), "
                        "e.g. examples/day_of_traffic.csv")
    f.add_argument("--session-duration", dest="session_duration", default="exp:300",
                   help="SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,... (default exp:300)")
    f.add_argument("--horizon", default=None,
                   help="simulated time of the whole run: 86400, 86400s or 24h (default: the pattern's length, or 24 h "
                        "for a constant rate)")
    f.add_argument("--max-refusal", dest="max_refusal", type=_refusal,
                   default=DEFAULT_MAX_REFUSAL,
                   help=f"the share of sessions that may be refused at the door, 0.01 or 1%% (default "
                        f"{DEFAULT_MAX_REFUSAL:g})")
    f.add_argument("--routers", default="least-loaded",
                   help="comma list of round-robin, least-loaded, power-of-two, random (default least-loaded)")
    f.add_argument("--engines", type=int, default=None,
                   help="GPUs of the static fleet (default: the fewest whose simulated peak refusal meets the target, "
                        "searched from the closed form)")
    f.add_argument("--admission", choices=("static", "aimd"), default="static",
                   help="each GPU's controller: a static cap at N* (default) or AIMD fed the GPU's p99 latency")
    f.add_argument("--aimd-params", dest="aimd_params", default=None,
                   help="AIMD parameters JSON (as written by metronome-sim tune-aimd)")
    f.add_argument("--autoscale", action="store_true", help="also run the day with the autoscaler")
    f.add_argument("--min-engines", dest="min_engines", type=int, default=1, help="autoscaler floor (default 1)")
    f.add_argument("--max-engines", dest="max_engines", type=int, default=None,
                   help="autoscaler ceiling (default: twice the static fleet)")
    f.add_argument("--scale-out-after", dest="scale_out_after", type=_duration("--scale-out-after"), default=30.0,
                   help="seconds of sustained pressure before scaling out (default 30)")
    f.add_argument("--scale-in-after", dest="scale_in_after", type=_duration("--scale-in-after"), default=600.0,
                   help="seconds of sustained slack before draining (default 600)")
    f.add_argument("--scale-out-utilization", dest="scale_out_utilization",
                   type=units.argtype(units.share, "--scale-out-utilization"), default=0.9,
                   help="in-flight / places above which the fleet is under pressure (default 0.9)")
    f.add_argument("--scale-in-utilization", dest="scale_in_utilization",
                   type=units.argtype(units.share, "--scale-in-utilization"), default=0.7,
                   help="in-flight / places below which it has slack (default 0.7)")
    f.add_argument("--engine-start-s", dest="engine_start_s", type=_duration("--engine-start-s"), default=180.0,
                   help="seconds from starting a GPU's engine until it takes sessions (default 180)")
    f.add_argument("--gpu-price", dest="gpu_price", action="append", default=None,
                   help="NAME=USD_PER_HOUR for a calibration in the run (repeatable): cost per 1,000 session-hours")
    f.add_argument("--peak-window", dest="peak_window", type=_duration("--peak-window"), default=3600.0,
                   help="measured seconds of each simulated sizing run at the peak rate (default 3600)")
    f.add_argument("--seed", type=int, default=0, help="first random seed (default 0)")
    f.add_argument("--seeds", type=int, default=1, help="seeds SEED..SEED+K-1 per simulation (default 1)")
    add_out_options(f, "output folder: fleet.json, bins and engines tables")
    add_executor_options(f)
    f.set_defaults(fn=cmd_fleet)
    c = sub.add_parser("calibrations", help="list the calibration presets with their provenance and serving stacks; "
                                            "--terms NAME: one calibration's step terms")
    c.add_argument("--terms", metavar="NAME|FILE", default=None,
                   help="print this preset's (or calibration file's) step terms: coefficient, value, range, basis and "
                        "source, for its default stack or --stack")
    c.add_argument("--stack", dest="stack", default=None, metavar="NAME", help=STACK_HELP + "; with --terms")
    c.set_defaults(fn=cmd_calibrations)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="show numba's warnings and those of the numerics (hidden by default)")
    p.commands = sub.choices  # (each command's parser: its defaults tell a given option from an absent one)
    return p


# options that act only with another (alone they would change nothing): (dest, flag, applies(args), what it needs)
# (report's --max-refusal and --gpu-price without --offered-load: ReportOptions.validate says it; --ray-address without
# --executor ray: make_executor)
ONLY_WITH = (
    *((dest, name, lambda a: a.command != "fleet" or a.autoscale, "--autoscale")
      for dest, name in (("min_engines", "--min-engines"), ("max_engines", "--max-engines"),
                         ("scale_out_after", "--scale-out-after"), ("scale_in_after", "--scale-in-after"),
                         ("scale_out_utilization", "--scale-out-utilization"),
                         ("scale_in_utilization", "--scale-in-utilization"), ("engine_start_s", "--engine-start-s"))),
    ("aimd_params", "--aimd-params", lambda a: a.command != "fleet" or a.admission == "aimd", "--admission aimd"),
    ("ramp_s", "--ramp", lambda a: a.sessions is not None and a.arrival_rate is None and a.rate_pattern is None,
     "--sessions (it spreads their starts), not with --arrival-rate or --rate-pattern"),
)


def check_given(args, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """What a command is given that it would misread or not use, refused before any work: a bare deadline too long
    for its calibrations (a unit slip), a KV policy parameter the policy does not take, an option that acts only
    with another."""
    refuse_unused(args, parser.commands[args.command], argv, ONLY_WITH)
    if args.command in ("run", "what-if", "metastability", "tune-aimd"):  # (capacity, fleet: as they read --kv)
        kinds = parse_values("kv", args.kv) if args.kv else ["unbounded"]
        check_policy_options(kinds, {k: v for k, v in policy_option_values(args).items() if v is not None},
                             default=args.kv is None)
    check_deadlines(args)


def _calibration_names(args) -> list[str] | None:
    """The calibrations the command plans with, as given (None: read later, from a ``--live`` run)."""
    cals = getattr(args, "calibration", None)
    if isinstance(cals, list):
        return cals
    if cals:
        return parse_values("calibration", cals)
    if getattr(args, "live", None):
        return None
    return [DEFAULT_CALIBRATION]


def check_deadlines(args) -> None:
    """A bare ``--deadline`` (each of a list) over ten frame periods of a calibration it is used with is refused as
    a likely unit slip (``--deadline 80`` meant 80 ms): one line that suggests the unit."""
    raw = getattr(args, "deadline", None)
    if raw is None:
        return
    values = [raw] if isinstance(raw, float) else parse_values("deadline", raw)
    bare = [v for v in values if getattr(v, "bare", False)]
    if not bare:
        return
    from metronome import calibration as calmod

    names = _calibration_names(args)
    if names is None:  # (the run's own calibration, read later: the most any preset's stream allows)
        cals = [calmod.load_preset(n) for n in calmod.preset_names()]
        cals = [max(cals, key=lambda c: c.stream.frame_period_s)]
    else:
        cals = [calmod.load(n) for n in names]
    for v in bare:
        for cal in cals:
            units.check_deadline(v, cal.stream.frame_period_s, cal.name)


def _apply_stack(args) -> None:
    """``--stack``: each calibration the command plans with, priced for that stack (``NAME@STACK``; one line for a
    calibration that does not ship it). ``calibrations`` reads it with ``--terms`` itself."""
    stack = getattr(args, "stack", None)
    if not stack or args.command == "calibrations":
        return
    names = _calibration_names(args)
    if names is None:
        raise MetronomeError("--stack prices a --calibration: give the calibration with it (a --live folder's own "
                             "calibration is measured, with no stacks)")
    specs = stack_specs(names, stack)
    args.calibration = specs if isinstance(getattr(args, "calibration", None), list) or args.command in (
        "report", "fleet") else ",".join(specs)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except MetronomeError as exc:  # (a value its flag's type could not read: units)
        sys.stderr.write(f"metronome-sim: error: {exc}\n")
        return exc.exit_code
    quiet(args.verbose, vllm=False)  # (the simulator never starts vLLM)

    def command(args):
        if getattr(args, "session_duration", None):
            args.session_duration = units.seconds_spec(args.session_duration, "--session-duration")
        check_given(args, parser, argv)
        _apply_stack(args)
        return args.fn(args)

    return run_command("metronome-sim", command, args, command=f"metronome-sim {args.command}")


if __name__ == "__main__":
    sys.exit(main())
