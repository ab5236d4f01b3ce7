"""Live results for the report's fidelity section (``--live DIR``), read and checked before any work.

``DIR`` is one of three kinds of folder, told apart by its ``summary.json``:

**validate** (``metronome-probe validate --out DIR``): per KV policy, the live run beside the simulation of
the same scenario. The policies sit under ``"policies"`` (or at the top level), each an object with::

    t_sat_observed_s, t_sat_predicted_s        number or null (null: the pool never ran dry)
    p50_frame_latency_s, p99_frame_latency_s   {"live": s, "simulated": s}  (or flat keys
                                               p50_frame_latency_live_s / p50_frame_latency_sim_s)
    silent_frame_fraction                      optional: a number, or {"live": x, "simulated": y}
    *relative_error*                           optional: recomputed here when absent

**run** (``metronome-probe run --out DIR``): one live admission run. ``summary.json`` has the driver's
figures (``silent_frame_fraction``, ``p50_frame_latency_s``, ``p99_frame_latency_s``, ``preemptions``,
``sessions_admitted``, ``sessions_offered``, ``sessions_planned``, ``num_blocks``: the keys a simulated summary
shares mean the same there, :mod:`metronome.results`), ``controller`` (an object) and, written by the
CLI, ``options`` (the run's workload, policy and controller); ``controller.parquet`` has one row per control
interval (``t_s``, ``limit``, ``in_flight``); ``steps.parquet`` one row per engine step (``t_s``: its start,
as in the simulator's steps; ``sessions``: the admitted sessions alive). The simulated side is ``DIR/sim/``
when there is one (what ``metronome.sim.scenario.write`` writes: ``summary.json``, ``steps.parquet`` with
``t_s``, ``running``, ``waiting``, and ``controller.parquet``); otherwise the report re-simulates the run's workload with its own
calibration (:func:`check_resimulation` checks that up front; ``build.py`` runs it).

**benchmark** (``benchmarks/bench_live_aimd.py --out DIR``): ``summary.json`` with ``results`` (one entry per
run) and ``n_star_sim``, and one run folder per entry (``window/``, ``unbounded/``), each with its ``sim/``.

A run's **settled concurrency** is the mean of the admitted sessions alive over the second half of the run,
over step samples (live: ``steps.sessions``; simulated: ``steps.running + steps.waiting``; both at the
step's start ``t_s``), as the benchmark measures it; the settled limit is the controller's mean limit over the same
half. Relative errors are ``(simulated − measured) / measured``. Anything else in the files is ignored; a
missing or malformed file, field or column is one :class:`MetronomeError` line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from metronome.errors import MetronomeError
from metronome.kv_policy import policy_params
from metronome.results import settled_mean

LATENCIES = ("p50_frame_latency_s", "p99_frame_latency_s")
LIVE_KEYS = ("live", "measured", "observed")
SIM_KEYS = ("simulated", "sim", "predicted")
WRITERS = "metronome-probe validate or run, or benchmarks/bench_live_aimd.py"

# the columns a run folder's tables must have (and the simulator's, in DIR/sim/)
RUN_COLUMNS = {"controller.parquet": ("t_s", "limit", "in_flight"), "steps.parquet": ("t_s", "sessions")}
SIM_COLUMNS = {"steps.parquet": ("t_s", "running", "waiting"), "controller.parquet": ("t_s", "limit")}
# one fidelity row each: live beside simulated
RUN_FIGURES = ("settled_sessions", "settled_limit", "sessions_admitted", "silent_frame_fraction", "preemptions",
               "p50_frame_latency_s", "p99_frame_latency_s")
SERIES_POINTS = 300  # at most this many points per plotted series


def _number(origin: str, field: str, v: Any, nullable: bool = False) -> float | None:
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MetronomeError(f"{origin}: field '{field}' must be a non-negative number"
                             f"{' or null' if nullable else ''}, got {v!r}")
    return float(v)


def _pair(origin: str, policy: str, obj: dict, metric: str, required: bool) -> dict | None:
    """(live, simulated) of one metric, from a nested object or flat ``*_live_s``/``*_sim_s`` keys."""
    stem = metric[:-2] if metric.endswith("_s") else metric
    unit = "_s" if metric.endswith("_s") else ""
    v = obj.get(metric)
    live = sim = None
    field = f"{policy}.{metric}"
    if isinstance(v, dict):
        live = next((v[k] for k in LIVE_KEYS if k in v), None)
        sim = next((v[k] for k in SIM_KEYS if k in v), None)
        if live is None or sim is None:
            raise MetronomeError(f"{origin}: field '{field}' needs 'live' and 'simulated'")
    else:
        flat_live = [f"{stem}_{k}{unit}" for k in LIVE_KEYS] + [f"{k}_{metric}" for k in LIVE_KEYS]
        flat_sim = [f"{stem}_{k}{unit}" for k in SIM_KEYS] + [f"{k}_{metric}" for k in SIM_KEYS]
        live = next((obj[k] for k in flat_live if k in obj), None)
        sim = next((obj[k] for k in flat_sim if k in obj), None)
        if live is None and sim is None and v is not None and not required:
            live = v  # a single number: the live figure only
        if (live is None or sim is None) and required:
            raise MetronomeError(f"{origin}: policy '{policy}' has no live and simulated '{metric}'")
        if live is None and sim is None:
            return None
    live_v = _number(origin, field + ".live", live)
    sim_v = None if sim is None else _number(origin, field + ".simulated", sim)
    return {"live": live_v, "simulated": sim_v, "relative_error": _rel(sim_v, live_v)}


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


# ------------------------------------------------------------------------------------------ files
def _load_json(f: Path, writer: str = WRITERS) -> dict:
    origin = f"--live {f}"
    try:
        obj = json.loads(f.read_text())
    except FileNotFoundError:
        raise MetronomeError(f"{origin}: missing ({writer} writes it)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MetronomeError(f"{origin}: cannot read it ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise MetronomeError(f"{origin}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(obj, dict):
        raise MetronomeError(f"{origin}: must be a JSON object")
    return obj


def _load_table(f: Path, columns: tuple[str, ...], writer: str) -> pd.DataFrame:
    """A Parquet table with the given numeric columns (nulls allowed), rows sorted by the first."""
    import pyarrow as pa

    origin = f"--live {f}"
    if not f.is_file():
        raise MetronomeError(f"{origin}: missing ({writer} writes it)")
    try:
        df = pd.read_parquet(f)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise MetronomeError(f"{origin}: cannot read it as Parquet ({exc.__class__.__name__})") from None
    for c in columns:
        if c not in df.columns:
            raise MetronomeError(f"{origin}: column '{c}' missing (has {', '.join(map(str, df.columns)) or 'none'})")
        v = pd.to_numeric(df[c], errors="coerce")
        if bool((v.isna() & df[c].notna()).any()):
            raise MetronomeError(f"{origin}: column '{c}' must hold numbers")
        df[c] = v.astype(float)
    return df.sort_values(columns[0], kind="stable").reset_index(drop=True)


def _field(origin: str, obj: dict, key: str, required: bool = True) -> float | None:
    """A non-negative number or null from a summary; ``required``: the key must be there."""
    if key not in obj:
        if required:
            raise MetronomeError(f"{origin}: field '{key}' missing")
        return None
    return _number(origin, key, obj[key], nullable=True)


# ------------------------------------------------------------------------------------------ series
def downsample(t: np.ndarray, y: np.ndarray, horizon_s: float, how: str = "mean") -> dict:
    """At most ``SERIES_POINTS`` points: per time bucket the mean (at its middle) or the last value (at its end)."""
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(t) & np.isfinite(y)
    t, y = t[ok], y[ok]
    order = np.argsort(t, kind="stable")
    t, y = t[order], y[order]
    if t.size > SERIES_POINTS:
        width = max(horizon_s, float(t[-1])) / SERIES_POINTS
        b = np.floor(t / width).astype(np.int64)
        keys, start = np.unique(b, return_index=True)
        end = np.r_[start[1:], t.size]
        if how == "mean":
            y = np.add.reduceat(y, start) / (end - start)
            t = (keys + 0.5) * width
        else:
            y = y[end - 1]
            t = (keys + 1.0) * width
    return {"t_s": [round(float(x), 3) for x in t], "value": [round(float(x), 3) for x in y]}


def _side(figures: dict, t_sessions, sessions, ctl: pd.DataFrame | None, horizon_s: float) -> dict:
    """One side (live or simulated) of a run: its figures, settled concurrency and limit, and the series."""
    has_ctl = ctl is not None and len(ctl) and bool(np.isfinite(ctl["limit"].to_numpy()).any())
    out = dict(figures)
    out["horizon_s"] = float(horizon_s)
    out["settled_sessions"] = settled_mean(t_sessions, sessions, horizon_s)
    out["settled_limit"] = settled_mean(ctl["t_s"], ctl["limit"], horizon_s) if has_ctl else None
    out["series"] = {"sessions": downsample(t_sessions, sessions, horizon_s, "mean"),
                     "limit": downsample(ctl["t_s"], ctl["limit"], horizon_s, "last") if has_ctl else None}
    return out


def sim_side(summary: dict, steps: pd.DataFrame, controller: pd.DataFrame | None) -> dict:
    """The simulated side of a run, from a simulator result (``Result.summary``, ``.steps`` and the
    controller trace as a table, or None) or the same read back from a ``sim/`` folder."""
    figures = {k: summary.get(k) for k in ("sessions_admitted", "silent_frame_fraction", "preemptions",
                                           "p50_frame_latency_s", "p99_frame_latency_s")}
    figures["sessions_offered"] = summary.get("sessions_offered")
    admitted = steps["running"].to_numpy(dtype=float) + steps["waiting"].to_numpy(dtype=float)
    return _side(figures, steps["t_s"].to_numpy(dtype=float), admitted, controller, float(summary["horizon_s"]))


def finish_run(entry: dict) -> dict:
    """Fill ``entry["figures"]``: per figure live, simulated and the relative error (simulated − live) / live."""
    live, sim = entry["live"], entry.get("simulated") or {}
    entry["figures"] = {k: {"live": live.get(k), "simulated": sim.get(k),
                            "relative_error": _rel(sim.get(k), live.get(k))} for k in RUN_FIGURES}
    entry["figures"]["sessions_offered"] = {"live": live.get("sessions_offered"),
                                            "simulated": sim.get("sessions_offered"), "relative_error": None}
    return entry


def attach_simulation(entry: dict, side: dict, calibration: str, n_star: int | None = None,
                      n_star_policy: str | None = None) -> dict:
    """Put the report's own re-simulation of a run beside it (and the N* it found, if the run had none)."""
    entry["simulated"] = side
    entry["simulated_with"] = calibration
    entry["simulated_by"] = "report"
    if entry.get("n_star") is None and n_star is not None:
        entry["n_star"], entry["n_star_policy"] = int(n_star), n_star_policy
    return finish_run(entry)


# ------------------------------------------------------------------------------------------ what it ran
def _parameters(deadline_s, frame_period_s, bounds, num_blocks) -> dict:
    """The settings a live folder ran that a plan sets too (None where the folder does not say): the frame deadline,
    the stream's frame period, the bounded KV policies (descriptions) and the pool in blocks."""
    def num(v):
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    blocks = num_blocks if isinstance(num_blocks, int) and not isinstance(num_blocks, bool) else None
    return {"deadline_s": num(deadline_s), "frame_period_s": num(frame_period_s),
            "bounds": sorted(set(bounds)), "num_blocks": blocks}


def _run_parameters(runs: list[dict], obj: dict) -> dict:
    """A run or benchmark folder's parameters: each run's options where it has them, else the folder's summary."""
    first = next((e["options"] for e in runs if e.get("options")), None) or {}
    stream = first.get("stream") if isinstance(first.get("stream"), dict) else obj.get("stream")
    period = stream.get("period_s", stream.get("frame_period_s")) if isinstance(stream, dict) else None
    deadline = first.get("deadline_s") or obj.get("deadline_s") or period  # a run's default: one frame period
    bounds = [e["label"].split(" · ")[0] for e in runs if e["bounded"]]
    return _parameters(deadline, period, bounds, first.get("num_blocks") or obj.get("num_blocks"))


def recorded_calibration(folder: str | Path) -> str | None:
    """The calibration a ``--live`` folder ran with, as a path or a preset name (None when it records none):
    validate's ``calibration/calibration.json``; the benchmark's pooled one or its ``calibration/calibration.json``;
    a run's ``sim/`` calibration (``sim/calibration.json``, or the preset its ``sim/summary.json`` names). An
    in-process ``metronome-probe run`` measures none."""
    from metronome import calibration as calmod

    d = Path(folder)
    for f in (d / "calibration-before-pooled.json", d / "calibration" / "calibration.json",
              d / "sim" / "calibration.json"):
        if f.is_file():
            return str(f)
    try:
        name = json.loads((d / "sim" / "summary.json").read_text()).get("calibration")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name in calmod.preset_names() else None


def calibrations_for(given: list[str] | tuple[str, ...] | None, live: list[str] | tuple[str, ...] | None,
                     default: str) -> tuple[tuple[str, ...], bool]:
    """The calibrations a report plans with: those given; else each ``--live`` folder's own
    (:func:`recorded_calibration`; one line naming the folder when it records none); else ``default``. Returns them
    and whether they came from the live folders."""
    if given:
        return tuple(given), False
    if not live:
        return (default,), False
    out = []
    for folder in live:
        read_live(folder)  # a bad folder is named for what is wrong with it first
        spec = recorded_calibration(folder)
        if spec is None:
            raise MetronomeError(f"--live {folder}: the folder records no calibration to plan with (an in-process "
                                 "metronome-probe run measures none): give --calibration NAME|FILE, e.g. the "
                                 "calibration.json metronome-probe calibrate wrote for the same engine")
        out.append(spec)
    return tuple(out), True


# ------------------------------------------------------------------------------------------ run folders
def _policy_label(origin: str, opts: dict | None, steps: pd.DataFrame, sim_summary: dict | None, name: str) -> str:
    if opts is not None and isinstance(opts.get("kv"), str):
        from metronome.kv_policy import policy_from_options

        try:
            return policy_from_options(opts, int(opts.get("block_size") or 16)).describe()
        except (MetronomeError, TypeError, ValueError) as exc:
            raise MetronomeError(f"{origin}: field 'options.kv' (with its parameters) is not a KV policy: "
                                 f"{exc}") from None
    if "run" in steps.columns and len(steps) and isinstance(steps["run"].iloc[0], str):
        return str(steps["run"].iloc[0])
    if sim_summary is not None and isinstance(sim_summary.get("policy"), str):
        return sim_summary["policy"]
    return name


def _live_phases() -> str:
    from metronome.probe.driver import PHASES  # the regime the live driver runs (it ticks in lockstep)

    return PHASES


def _opt(origin: str, opts: dict, key: str, kind: type | tuple, required: bool = False):
    """One field of a run's ``options``, type-checked (None when absent or null and not required)."""
    v = opts.get(key)
    if v is None:
        if required:
            raise MetronomeError(f"{origin}: field 'options.{key}' missing (needed to re-simulate the run)")
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        what = {int: "an integer", str: "a string", dict: "an object"}.get(kind, "a number")
        raise MetronomeError(f"{origin}: field 'options.{key}' must be {what}, got {v!r}")
    return v


def _resimulation(origin: str, obj: dict, ctl_info: dict) -> dict:
    """``make_scenario`` keywords (all but the calibration) for a run's workload, and what to check against
    the calibration: the stream and the block size the run used."""
    opts = obj.get("options")
    if not isinstance(opts, dict):
        raise MetronomeError(f"{origin}: field 'options' missing: a run folder without sim/ is re-simulated from "
                             "the options metronome-probe run writes")
    num = (int, float)
    horizon = _opt(origin, opts, "horizon_s", num, required=True)
    if not (horizon > 0 and math.isfinite(horizon)):
        raise MetronomeError(f"{origin}: field 'options.horizon_s' must be positive seconds, got {horizon!r}")
    rate, pattern = _opt(origin, opts, "arrival_rate", num), _opt(origin, opts, "rate_pattern", str)
    if (rate is None) == (pattern is None):
        raise MetronomeError(f"{origin}: fields 'options.arrival_rate' and 'options.rate_pattern': exactly one "
                             "must be set")
    duration = _opt(origin, opts, "session_duration", (str, int, float), required=True)
    stream = _opt(origin, opts, "stream", dict)
    if stream is not None:
        for k in ("period_s", "in", "out"):
            _number(origin, f"options.stream.{k}", stream.get(k))
    deadline = _opt(origin, opts, "deadline_s", num) or (stream["period_s"] if stream else None)
    if "params" in ctl_info:
        params = ctl_info["params"]
        if params is not None and not isinstance(params, dict):
            raise MetronomeError(f"{origin}: field 'controller.params' must be an object or null, got {params!r}")
    elif _opt(origin, opts, "aimd_params", str):
        from metronome.admission import read_params_file

        params = read_params_file(opts["aimd_params"])
    else:
        params = None
    blocks = obj.get("num_blocks", opts.get("num_blocks"))
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise MetronomeError(f"{origin}: field 'num_blocks' must be a positive integer, got {blocks!r}")
    kw = {"kv": _opt(origin, opts, "kv", str) or "unbounded",
          **{name: _opt(origin, opts, name, int) for name in policy_params() if name in opts}, "arrival_rate": rate,
          "rate_pattern": pattern,
          "session_duration": str(duration), "horizon": float(horizon), "seed": _opt(origin, opts, "seed", int) or 0,
          "deadline": deadline, "admission": _opt(origin, opts, "admission", str) or "none", "aimd_params": params,
          "num_blocks": blocks,
          "phases": _opt(origin, opts, "phases", str) or _live_phases()}
    return {"options": kw, "stream": stream, "block_size": _opt(origin, opts, "block_size", int)}


def _read_sim(d: Path) -> tuple[dict, dict]:
    """A run's ``sim/`` folder: (the simulated side, its summary)."""
    writer = "the simulator (metronome.sim.scenario.write)"
    f = d / "summary.json"
    obj = _load_json(f, writer)
    origin = f"--live {f}"
    if not (_field(origin, obj, "horizon_s") or 0) > 0:
        raise MetronomeError(f"{origin}: field 'horizon_s' must be positive seconds, got {obj['horizon_s']!r}")
    for key in ("silent_frame_fraction", "p50_frame_latency_s", "p99_frame_latency_s", "preemptions",
                "sessions_admitted"):
        _field(origin, obj, key)
    _field(origin, obj, "sessions_offered", required=False)
    steps = _load_table(d / "steps.parquet", SIM_COLUMNS["steps.parquet"], writer)
    ctl = None
    if (d / "controller.parquet").exists():
        ctl = _load_table(d / "controller.parquet", SIM_COLUMNS["controller.parquet"], writer)
    return sim_side(obj, steps, ctl), obj


def _read_run(d: Path, obj: dict | None = None, horizon_s: float | None = None) -> dict:
    """One ``metronome-probe run`` folder: its live side, and the simulated side when ``sim/`` holds one."""
    writer = "metronome-probe run"
    f = d / "summary.json"
    origin = f"--live {f}"
    obj = _load_json(f, writer) if obj is None else obj
    ctl_info = obj.get("controller")
    if not isinstance(ctl_info, dict):
        raise MetronomeError(f"{origin}: field 'controller' must be an object (is this a metronome-probe run summary?)")
    figures = {k: _field(origin, obj, k) for k in ("silent_frame_fraction", "p50_frame_latency_s",
                                                   "p99_frame_latency_s", "preemptions", "sessions_admitted")}
    planned = _field(origin, obj, "sessions_planned", required=False)
    figures["sessions_offered"] = planned if planned is not None else _field(origin, obj, "sessions_offered",
                                                                             required=False)
    for k in ("preemptions", "sessions_admitted", "sessions_offered"):  # counts stay integers in report.json
        if figures[k] is not None and float(figures[k]).is_integer():
            figures[k] = int(figures[k])
    opts = obj.get("options")
    if opts is not None and not isinstance(opts, dict):
        raise MetronomeError(f"{origin}: field 'options' must be an object, got {opts!r}")
    ctl = _load_table(d / "controller.parquet", RUN_COLUMNS["controller.parquet"], writer)
    steps = _load_table(d / "steps.parquet", RUN_COLUMNS["steps.parquet"], writer)
    # how long the run lasted: where it was stopped, else its horizon (options, the benchmark's, wall time)
    if obj.get("stopped") and obj.get("t_stopped_s") is not None:
        horizon, field = obj["t_stopped_s"], "t_stopped_s"
    elif opts is not None and opts.get("horizon_s") is not None:
        horizon, field = opts["horizon_s"], "options.horizon_s"
    elif horizon_s is not None:
        horizon, field = horizon_s, "horizon_s"
    else:
        horizon, field = obj.get("wall_s"), "wall_s"
    horizon = _number(origin, field, horizon)
    if not horizon > 0:
        raise MetronomeError(f"{origin}: field '{field}' must be positive seconds, got {horizon!r}")

    sim = sim_summary = scenario = None
    if (d / "sim").is_dir():
        sim, sim_summary = _read_sim(d / "sim")
    else:
        scenario = _resimulation(origin, obj, ctl_info)
    label = _policy_label(origin, opts, steps, sim_summary, d.name)
    entry = {
        "name": d.name, "path": str(d), "label": label, "bounded": not label.startswith("unbounded"),
        "controller": ctl_info.get("name") if isinstance(ctl_info.get("name"), str) else None,
        "live": _side(figures, steps["t_s"].to_numpy(), steps["sessions"].to_numpy(), ctl, horizon),
        "simulated": sim, "simulated_with": sim_summary.get("calibration") if sim_summary else None,
        "simulated_by": "sim/" if sim is not None else None, "scenario": scenario,
        "n_star": None, "n_star_policy": None, "options": opts,
    }
    return finish_run(entry)


def _runs(d: Path, origin: str, kind: str, runs: list[dict], meta: dict, obj: dict) -> dict:
    runs = sorted(runs, key=lambda e: not e["bounded"])  # the bounded runs first, as the benchmark plots them
    params = _run_parameters(runs, obj)
    same = Counter(e["label"] for e in runs)
    for e in runs:  # several runs of one policy (a benchmark's --repeat): each row and panel names its folder
        if same[e["label"]] > 1:
            e["label"] = f"{e['label']} · {e['name']}"
        e.pop("options", None)
    return {"kind": "runs", "origin": kind, "source": str(d), "runs": {e["name"]: e for e in runs}, "meta": meta,
            "parameters": params}


def _read_benchmark(d: Path, obj: dict) -> dict:
    """A ``bench_live_aimd.py`` folder: its run subfolders (``results`` names them) and the simulator's N*."""
    f = d / "summary.json"
    origin = f"--live {f}"
    results = obj.get("results")
    if results is not None and not isinstance(results, dict):
        raise MetronomeError(f"{origin}: field 'results' must be an object of run -> figures")
    if results:
        names = list(results)
    else:
        names = [p.name for p in sorted(d.iterdir()) if p.is_dir() and (p / "controller.parquet").is_file()]
    if not names:
        raise MetronomeError(f"{origin}: field 'results' is empty and no run subfolder holds controller.parquet")
    n_star = _number(origin, "n_star_sim", obj.get("n_star_sim"), nullable=True)
    cap = obj.get("capacity") if isinstance(obj.get("capacity"), dict) else {}
    n_star_policy = cap.get("policy") if isinstance(cap.get("policy"), str) else None
    deadline = _number(origin, "deadline_s", obj.get("deadline_s"), nullable=True)
    if n_star_policy and deadline:
        n_star_policy += f", {1e3 * deadline:g} ms deadline"
    if n_star_policy and cap.get("binding") in ("memory", "deadline", "max_num_seqs"):
        n_star_policy += f", {cap['binding']} binds"
    after = _number(origin, "n_star_after", obj.get("n_star_after"), nullable=True)
    if n_star_policy and after is not None:  # the benchmark calibrates the engine again after its run (drift)
        n_star_policy += f"; {int(after)} from a calibration after the " + (
            "last run" if isinstance(obj.get("repeat"), dict) else "run")
    pooled = _number(origin, "n_star_pooled", obj.get("n_star_pooled"), nullable=True)
    n_pooled = obj.get("calibrations_pooled")
    if n_star_policy and pooled is not None and isinstance(n_pooled, list):  # every calibration of the span, one fit
        n_star_policy += f"; {int(pooled)} from all {len(n_pooled)} calibrations pooled"
    runs = []
    for name in names:
        sub = d / name
        if not sub.is_dir():
            raise MetronomeError(f"--live {sub}: missing (the benchmark's summary.json has results for '{name}')")
        r = results.get(name) if results else None
        h = r.get("horizon_s") if isinstance(r, dict) else None
        e = _read_run(sub, horizon_s=_number(origin, f"results.{name}.horizon_s", h, nullable=True))
        if n_star is not None:
            e["n_star"], e["n_star_policy"] = int(n_star), n_star_policy
        runs.append(e)
    meta = {k: obj[k] for k in ("deadline_s", "num_blocks", "window", "arrival_rate", "durations") if
            isinstance(obj.get(k), (str, int, float)) and not isinstance(obj.get(k), bool)}
    return _runs(d, origin, "benchmark", runs, meta, obj)


def _is_validate(origin: str, obj: dict) -> bool:
    raw = obj.get("policies", obj)
    if not isinstance(raw, dict):
        raise MetronomeError(f"{origin}: field 'policies' must be an object of policy -> figures")
    return any(isinstance(v, dict) and "t_sat_observed_s" in v for v in raw.values())


def _read_validate(d: Path, obj: dict) -> dict:
    origin = f"--live {d / 'summary.json'}"
    raw = obj.get("policies", obj)
    entries = {k: v for k, v in raw.items() if isinstance(v, dict) and "t_sat_observed_s" in v}
    policies = {}
    for name, e in entries.items():
        if "t_sat_predicted_s" not in e:
            raise MetronomeError(f"{origin}: field '{name}.t_sat_predicted_s' missing")
        obs = _number(origin, f"{name}.t_sat_observed_s", e["t_sat_observed_s"], nullable=True)
        pred = _number(origin, f"{name}.t_sat_predicted_s", e["t_sat_predicted_s"], nullable=True)
        fig = {"t_sat_observed_s": obs, "t_sat_predicted_s": pred, "t_sat_relative_error": _rel(pred, obs)}
        for metric in LATENCIES:
            fig[metric] = _pair(origin, name, e, metric, required=True)
        fig["silent_frame_fraction"] = _pair(origin, name, e, "silent_frame_fraction", required=False)
        policies[str(name)] = fig
    meta = {k: obj[k] for k in ("model", "calibration", "num_blocks", "device", "hardware") if
            isinstance(obj.get(k), (str, int, float))}
    stream = obj.get("stream") if isinstance(obj.get("stream"), dict) else {}
    bounds = []
    if isinstance(obj.get("window"), int) and isinstance(obj.get("block_size"), int):
        from metronome.kv_policy import make_policy

        for kind in ("window", "sinks"):
            if kind in policies:
                try:
                    # (make_policy takes from the run's options only what the policy declares)
                    bounds.append(make_policy(kind, obj["block_size"], window=obj["window"],
                                              sinks=obj.get("sinks")).describe())
                except MetronomeError:
                    pass
    params = _parameters(obj.get("deadline_s"), stream.get("frame_period_s"), bounds, obj.get("num_blocks"))
    return {"kind": "validate", "source": str(d), "policies": policies, "meta": meta, "parameters": params}


def read_live(folder: str | Path) -> dict:
    """Read and validate a ``--live`` folder of any of the three kinds (see the module docstring).

    A validate folder gives ``{"kind": "validate", "source", "policies": {name: figures}, "meta"}``; a run or
    benchmark folder ``{"kind": "runs", "origin": "run"|"benchmark", "source", "runs": {name: run}, "meta"}``,
    each run with its ``label`` (the KV policy), ``live`` and ``simulated`` sides (figures, settled
    concurrency and limit, downsampled series), ``figures`` (the fidelity rows), ``n_star`` when known and,
    without a ``sim/`` folder, ``scenario``: the ``make_scenario`` keywords to re-simulate it with
    (``simulated`` is None until :func:`attach_simulation`)."""
    d = Path(folder)
    if not d.is_dir():
        raise MetronomeError(f"--live {d}: no such folder (give the --out folder of {WRITERS})")
    f = d / "summary.json"
    origin = f"--live {f}"
    obj = _load_json(f)
    if _is_validate(origin, obj):
        return _read_validate(d, obj)
    if "controller" in obj:
        meta = {}
        opts = obj.get("options")
        if isinstance(opts, dict):
            meta = {k: opts[k] for k in ("model", "admission", "arrival_rate", "rate_pattern", "session_duration",
                                         "deadline_s", "seed") if isinstance(opts.get(k), (str, int, float))}
        if isinstance(obj.get("num_blocks"), int):
            meta["num_blocks"] = obj["num_blocks"]
        return _runs(d, origin, "run", [_read_run(d, obj)], meta, obj)
    if isinstance(obj.get("results"), dict) or any(p.is_dir() and (p / "controller.parquet").is_file()
                                                   for p in d.iterdir()):
        return _read_benchmark(d, obj)
    raise MetronomeError(f"{origin}: no policy with 't_sat_observed_s' (validate), no 'controller' (run) and no "
                         "run subfolders (benchmark) found")


def check_resimulation(live: dict | None, calibration) -> None:
    """For every run without a ``sim/`` folder: the run's workload must be one the report can simulate with
    ``calibration`` (same frame stream and block size; a valid scenario). One line naming the file if not."""
    if not live or live.get("kind") != "runs":
        return
    from metronome.sim.scenario import make_scenario

    cal = calibration
    for e in live["runs"].values():
        sc = e.get("scenario")
        if sc is None:
            continue
        origin = f"--live {Path(e['path']) / 'summary.json'}"
        s = sc["stream"]
        cs = cal.stream
        if s is not None and (not math.isclose(s["period_s"], cs.frame_period_s, rel_tol=1e-6)
                              or int(s["in"]) != cs.input_tokens_per_frame
                              or int(s["out"]) != cs.output_tokens_per_frame):
            raise MetronomeError(
                f"{origin}: field 'options.stream': the run streamed a frame every {1e3 * s['period_s']:g} ms "
                f"({s['in']:g} in / {s['out']:g} out), {cal.name} every {1e3 * cs.frame_period_s:g} ms "
                f"({cs.input_tokens_per_frame} in / {cs.output_tokens_per_frame} out): give the calibration of the "
                "run's model, or a run folder with sim/")
        if sc["block_size"] is not None and sc["block_size"] != cal.engine.block_size_tokens:
            raise MetronomeError(f"{origin}: field 'options.block_size': the run used {sc['block_size']}-token blocks, "
                                 f"{cal.name} {cal.engine.block_size_tokens}")
        try:
            make_scenario(calibration=cal, **sc["options"])
        except MetronomeError as exc:
            raise MetronomeError(f"{origin}: cannot re-simulate the run with {cal.name}: {exc}") from None
