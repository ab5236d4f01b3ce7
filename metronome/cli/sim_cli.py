"""``metronome-sim``: run, what-if and calibrations (and, from later issues, more).

Every error a user can cause prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from metronome.errors import MetronomeError

DEFAULT_CALIBRATION = "moshi-7b-h200"

# option name -> (parser of one value, help)
SCENARIO_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "calibration": (str, f"preset name or calibration JSON file (default {DEFAULT_CALIBRATION})"),
    "kv": (str, "KV policy: unbounded | window | sinks (default unbounded)"),
    "window": (int, "window W in tokens (with --kv window or sinks)"),
    "sinks": (int, "sink tokens S (with --kv sinks)"),
    "sessions": (int, "N sessions start at t=0 (or over --ramp seconds)"),
    "arrival_rate": (float, "Poisson session arrivals per second (needs --session-duration)"),
    "ramp_s": (float, "spread --sessions evenly over this many seconds"),
    "session_duration": (str, "SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,... (default: the horizon)"),
    "horizon": (float, "simulated seconds (default 600)"),
    "seed": (int, "random seed (default 0)"),
    "deadline": (float, "frame deadline in seconds (default: the frame period)"),
    "num_blocks": (int, "override the calibration's pool size in blocks"),
    "admission": (str, "none | static:N | aimd | gradient (default none)"),
}
FLAG = {"ramp_s": "--ramp", "arrival_rate": "--arrival-rate", "session_duration": "--session-duration",
        "num_blocks": "--num-blocks"}


def flag(name: str) -> str:
    return FLAG.get(name, "--" + name.replace("_", "-"))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _parse_one(name: str, text: str):
    kind = SCENARIO_OPTIONS[name][0]
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
    if kind in (int, float) and text.count(":") == 2 and "," not in text:
        a, b, c = (_parse_one(name, x) for x in text.split(":"))
        if c <= 0 or b < a:
            raise MetronomeError(f"{flag(name)}: range {text!r} needs start <= stop and step > 0")
        out, k = [], 0
        while a + k * c <= b + 1e-9 * max(1.0, abs(b)):
            out.append(kind(a + k * c))
            k += 1
        return out
    if name == "session_duration" and text.startswith("list:"):
        return [text]
    return [_parse_one(name, x.strip()) for x in text.split(",") if x.strip()]


def add_scenario_options(p: argparse.ArgumentParser, lists: bool):
    for name, (_, help_) in SCENARIO_OPTIONS.items():
        p.add_argument(flag(name), dest=name, default=None,
                       help=help_ + (" — a list a,b,c or a range start:stop:step" if lists else ""))
    p.add_argument("--aimd-params", dest="aimd_params", default=None,
                   help="AIMD parameters JSON (as written by metronome-sim tune-aimd)")
    p.add_argument("--out", default=None, help="output folder")


def scenario_kwargs(args) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in SCENARIO_OPTIONS:
        raw = getattr(args, name)
        if raw is None:
            continue
        vals = parse_values(name, raw)
        if len(vals) != 1:
            raise MetronomeError(f"{flag(name)}: 'run' takes one value, got {raw!r} (use what-if for a grid)")
        kw[name] = vals[0]
    kw.setdefault("calibration", DEFAULT_CALIBRATION)
    if args.aimd_params:
        kw["aimd_params"] = args.aimd_params
    return kw


def _console():
    from rich.console import Console

    # piped output keeps whole lines (rich would wrap at 80 columns)
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.1f} ms"


def print_summary(s: dict, out: Path | None):
    con = _console()
    con.print(f"[bold]metronome-sim run[/] · {s['calibration']} ({s['provenance']}) · {s['policy']} · "
              f"{s['workload']} · {s['horizon_s']:g} s · admission {s['admission']}")
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
        ("frames", f"{s['frames_total']:,} answered · silent {_pct(s['silent_frame_fraction'])} · "
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

    sc = scn.make_scenario(**scenario_kwargs(args))
    res = scn.run(sc, fast_forward=not args.no_fast_forward)
    out = Path(args.out) if args.out else None
    if out is not None:
        scn.write(res, out)
    if args.json:
        print(json.dumps(res.summary, indent=2))
    else:
        print_summary(res.summary, out)
    return 0


def cmd_what_if(args) -> int:
    from rich.progress import Progress

    from metronome.sim import sweep

    axes: dict[str, list] = {}
    for name in SCENARIO_OPTIONS:
        raw = getattr(args, name)
        if raw is not None:
            axes[name] = parse_values(name, raw)
    axes.setdefault("calibration", [DEFAULT_CALIBRATION])
    if args.aimd_params:
        axes["aimd_params"] = [args.aimd_params]
    points = sweep.grid(axes)
    sweep.validate_points(points)
    out = Path(args.out or "what-if")
    con = _console()
    with Progress(console=con, transient=False) as bar:
        task = bar.add_task(f"what-if: {len(points)} runs", total=len(points))
        table = sweep.what_if(points, workers=args.workers, progress=lambda n: bar.advance(task, n))
    _write_table_atomic(table, out, "what_if")
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


def _write_table_atomic(table, out: Path, stem: str):
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        table.to_parquet(tmp / f"{stem}.parquet", index=False)
        table.to_csv(tmp / f"{stem}.csv", index=False)
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_calibrations(args) -> int:
    from rich.table import Table

    from metronome import calibration as calmod
    from metronome.fill_model import FillModel
    from metronome.kv_policy import KVPolicy

    t = Table(title="calibration presets")
    for c in ("name", "provenance", "hardware", "KV/token", "pool blocks", "pool tokens", "frame", "tokens/s",
              "t_sat @100 unbounded"):
        t.add_column(c)
    for name in calmod.preset_names():
        cal = calmod.load_preset(name)
        fm = FillModel(cal, KVPolicy.unbounded(cal.engine.block_size_tokens))
        ts = fm.t_sat(100)
        t.add_row(name, cal.provenance.kind, cal.provenance.hardware, f"{cal.kv_bytes_per_token / 1024:g} KiB",
                  f"{cal.engine.num_blocks:,}", f"{cal.engine.num_blocks * cal.engine.block_size_tokens:,}",
                  f"{cal.stream.frame_period_s * 1e3:g} ms", f"{cal.stream.kv_tokens_per_s:g}",
                  "never" if ts is None else f"{ts:.0f} s")
    _console().print(t)
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
    add_scenario_options(w, lists=True)
    w.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    w.set_defaults(fn=cmd_what_if)
    c = sub.add_parser("calibrations", help="list the calibration presets with their provenance")
    c.set_defaults(fn=cmd_calibrations)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MetronomeError as exc:
        sys.stderr.write(f"metronome-sim: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("metronome-sim: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
