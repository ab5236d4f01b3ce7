"""``metronome-probe validate``: the simulator against the live engine, on the same scenario, in one command.

1. **Calibrate** the engine once (:func:`~metronome.probe.calibrate.run_calibration`, a small grid) on the
   same small pool the live runs use; the calibration lands in ``DIR/calibration/``.
2. **Run live** N sessions that all start at t = 0 and stream frames until the horizon, once per KV
   policy, each on its own engine with a deliberately small pool (``--num-blocks``):

   * ``unbounded``: the pool fills and falls off the cliff (preemptions, silent frames);
   * ``window``: vLLM's own sliding window (``EngineConfig.sliding_window``): bounded, no cliff;
   * ``sinks`` (with ``--sinks``): the metronome sink+window plugin (``EngineConfig.sinks``).

   The driver (:mod:`metronome.probe.driver`) follows the simulator's engine model, including
   recompute preemption of the most recently admitted session when the pool runs dry (vLLM 0.32 would
   deadlock instead: docs/live.md). Frames, steps, sessions and events are journaled into
   ``DIR/<policy>/`` as they happen and converted to Parquet at the end of each run.
3. **Simulate** each scenario with the calibration just measured (``make_scenario(calibration=<it>,
   num_blocks=<the same pool>)``), written to ``DIR/<policy>/sim/``.
4. **Compare**: ``DIR/summary.json`` holds, per policy, ``t_sat_observed_s`` (live), ``t_sat_predicted_s``
   (the simulator's; the fill model's is ``t_sat_predicted_fill_s``), silent-frame fraction, p50/p99 frame
   latency live and simulated, and relative errors ``(simulated − live) / live``. It is rewritten after
   every policy, so a crash keeps the policies already compared.
5. **Know the host** (:mod:`metronome.probe.drift`): right after calibrating and again after the live runs, a few
   of the calibration's own grid points are measured on an engine as calibrated. ``drift`` says how much slower
   the engine ran after the runs than when it was calibrated; each error is also given against the calibration
   scaled by the mean speed over the runs (``*_scaled``, the runs simulated again in ``DIR/<policy>/sim-scaled/``).
   Past ±10 % drift the comparison is not valid: ``verdict`` says why and ``within_target`` holds no verdict.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from metronome.calibration import TokenStream
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.outputs import check_out, run_dir, write_json

from metronome.probe import drift
from metronome.probe.records import RUN_TABLES as TABLES
T_SAT_TARGET, LATENCY_TARGET = 0.05, 0.10
# the simulator's step jitter drawn this many ways on the validate workload: the spread of its p50 and p99
SPREAD_SEEDS = 20


@dataclass(frozen=True)
class ValidateOptions:
    model: str
    out: str
    weights: str = "auto"
    device: str | None = None
    dtype: str | None = None
    num_blocks: int = 96
    block_size: int = 32
    max_model_len: int | None = None  # default: the longest the pool accepts, at most the model's
    max_num_batched_tokens: int = 2048
    window: int = 128
    sinks: int | None = None
    sessions: int = 6
    horizon_s: float = 8.0
    stream: TokenStream | None = None  # default: the model's real-time stream
    deadline_s: float | None = None
    seed: int = 0
    progress: bool = True
    phases: str = "aligned"  # serving.PHASES, for the live runs, the calibration's paced runs and the simulation
    # serving.LOOPS: who steps the engine in the live runs and the calibration's paced runs
    loop: str = "driver"
    replace: bool = False  # write into a temporary folder that replaces out only once validate completes
    # the calibration's grid: small, so that validate takes a minute or two on a 2-core CPU
    grid_sessions: tuple[int, ...] = (1, 2, 4, 8)
    grid_context: tuple[int, ...] = (64, 128, 256, 512)
    decode_steps: int = 8
    fill_seconds: float = 2.0
    fill_sessions: int = 2

    def policies(self) -> list[tuple[str, KVPolicy]]:
        out = [("unbounded", KVPolicy.unbounded(self.block_size)),
               ("window", KVPolicy.window(self.block_size, self.window))]
        if self.sinks is not None:
            out.append(("sinks", KVPolicy.sinks(self.block_size, self.sinks, self.window)))
        return out


def check(opts: ValidateOptions) -> None:
    """Bad input fails here, in one line, before any engine starts or any file is made."""
    from metronome import serving

    check_out(opts.out, opts.replace)
    serving.check_phases(opts.phases)
    serving.check_loop(opts.loop)
    if opts.num_blocks < 2:
        raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {opts.num_blocks}")
    if opts.sessions < 1:
        raise MetronomeError(f"--sessions must be at least 1, got {opts.sessions}")
    if not (opts.horizon_s > 0) or not math.isfinite(opts.horizon_s):
        raise MetronomeError(f"--horizon must be a positive number of seconds, got {opts.horizon_s}")
    if opts.deadline_s is not None and not opts.deadline_s > 0:
        raise MetronomeError(f"--deadline must be positive seconds, got {opts.deadline_s}")
    usable = opts.num_blocks - 1
    # a window under one block, or sinks not under the window, fail here
    bounded = max(p.max_resident_blocks or 0 for _, p in opts.policies())
    if usable < bounded + 1:
        raise MetronomeError(f"--num-blocks {opts.num_blocks} is too small: one session under the window needs "
                             f"{bounded} blocks, and vLLM wants one more")
    if opts.max_model_len is not None and math.ceil(opts.max_model_len / opts.block_size) + 1 > usable:
        raise MetronomeError(f"--max-model-len {opts.max_model_len} does not fit {opts.num_blocks} blocks: vLLM needs "
                             f"ceil(max_model_len/{opts.block_size}) + 1 <= {usable} usable blocks")


def _max_model_len(opts: ValidateOptions, resolved) -> int:
    """The longest context vLLM accepts on this pool (it wants ceil(L/bs) + 1 usable blocks), at most the model's."""
    return opts.max_model_len or resolved.max_len_on_pool(opts.num_blocks, opts.block_size)


def run_validate(opts: ValidateOptions, echo=print) -> dict:
    """Calibrate, run live per policy, simulate, compare. Returns the summary written to ``DIR/summary.json``."""
    from metronome.probe import models
    from metronome.probe.engine import check_build, default_device

    check(opts)
    device = check_build(opts.device or default_device())
    resolved = models.resolve(opts.model, opts.weights, device, opts.dtype, opts.stream)  # bad --model fails here
    with run_dir(opts.out, opts.replace) as work:
        return _validate(opts, work, device, resolved, echo)


def _validate(opts: ValidateOptions, out: Path, device: str, resolved, echo) -> dict:
    """The body of :func:`run_validate`, writing into ``out`` (``--out``, or the folder that replaces it)."""
    from metronome.probe.calibrate import CalibrateOptions, engine_config, run_calibration
    from metronome.probe.engine import Engine, hardware_description

    stream = opts.stream or resolved.stream
    max_len = _max_model_len(opts, resolved)
    horizon_tokens = stream.kv_tokens_per_s * opts.horizon_s + 1
    if horizon_tokens + stream.kv_tokens_per_frame >= max_len:
        echo(f"note: sessions reach max_model_len ({max_len}) before the horizon; unbounded ones finish there")
    copts = CalibrateOptions(
        model=opts.model, out=str(out / "calibration"), weights=opts.weights, device=device, dtype=opts.dtype,
        num_blocks=opts.num_blocks, block_size=opts.block_size, max_model_len=max_len,
        max_num_batched_tokens=opts.max_num_batched_tokens, stream=stream, grid_sessions=opts.grid_sessions,
        grid_context=opts.grid_context, decode_steps=opts.decode_steps,
        chunk_sizes=(stream.input_tokens_per_frame + 1,), chunk_repeats=3, growth_tokens=min(1024, max_len),
        chunk_idle_s=0.9 * stream.frame_period_s,  # chunk steps timed as they come in real time: after idle
        fill_sessions=opts.fill_sessions, fill_seconds=opts.fill_seconds, progress=opts.progress, seed=opts.seed,
        phases=opts.phases, loop=opts.loop)
    base = engine_config(copts, resolved)
    t0 = time.perf_counter()
    summary = {
        "model": resolved.name, "weights": resolved.weights, "device": device, "hardware": hardware_description(device),
        "num_blocks": opts.num_blocks, "usable_blocks": opts.num_blocks - 1, "block_size": opts.block_size,
        "max_model_len": max_len, "sessions": opts.sessions, "horizon_s": opts.horizon_s,
        "stream": {"frame_period_s": stream.frame_period_s, "input_tokens_per_frame": stream.input_tokens_per_frame,
                   "output_tokens_per_frame": stream.output_tokens_per_frame},
        "window": opts.window, "sinks": opts.sinks, "deadline_s": opts.deadline_s or stream.frame_period_s,
        "targets": {"t_sat_relative_error": T_SAT_TARGET, "frame_latency_relative_error": LATENCY_TARGET},
        "calibration": str(Path(opts.out) / "calibration" / "calibration.json"), "phases": opts.phases,
        "loop": opts.loop, "policies": {},
    }
    cal = points = before = None
    lives = {}
    for name, policy in opts.policies():
        config = replace(base, **policy.engine_settings())
        echo(f"[{time.perf_counter() - t0:5.0f} s] {name}: starting the engine ({opts.num_blocks} blocks)")
        engine = Engine(config, log_path=out / "engine.log") if cal is None or opts.loop == "driver" else None
        try:
            if cal is None:  # one calibration, on the unbounded engine (the step cost does not depend on the policy)
                summary.setdefault("engine", engine.describe())
                echo(f"[{time.perf_counter() - t0:5.0f} s] calibrating (small grid)")
                res = run_calibration(copts, engine=engine)
                cal = res.calibration
                err = res.measurements["step_fit"]["error"]
                summary["calibration_fit"] = {k: err[k] for k in ("median_abs_rel", "p90_abs_rel", "max_abs_rel")}
                summary["calibration_seconds"] = round(res.seconds, 1)
                points = drift.reference_points(res.measurements["grid_points"])
                echo(f"[{time.perf_counter() - t0:5.0f} s] the engine's speed as calibrated (a reference)")
                before = _reference(engine, copts, points, out / "drift_before.parquet")
            if opts.loop == "vllm":  # the live run on vLLM's own loop: AsyncLLM, its EngineCore in a process of its own
                from metronome.probe.own_loop import OwnLoopEngine

                if engine is not None:
                    engine.close()
                engine = OwnLoopEngine(config, log_path=out / "engine.log")
                summary["engine_live"] = engine.describe()
            echo(f"[{time.perf_counter() - t0:5.0f} s] {name}: {opts.sessions} sessions live for {opts.horizon_s:g} s")
            live = run_policy_live(engine, policy, stream, opts, out / name, name)
        finally:
            engine.close()
        sim = simulate(cal, policy, opts, out / name / "sim")
        lives[name] = live
        summary["policies"][name] = compare(live, sim, policy, seed_spread(cal, policy, opts))
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        write_json(out / "summary.json", summary)  # after every policy: a crash keeps what was compared
    # after the runs, on an engine as calibrated (the bounded runs' engines run other attention)
    echo(f"[{time.perf_counter() - t0:5.0f} s] the engine's speed after the runs (the reference again)")
    engine = Engine(base, log_path=out / "engine.log")
    try:
        after = _reference(engine, copts, points, out / "drift_after.parquet")
    finally:
        engine.close()
    summary["drift"] = d = drift.assess(drift.speed_ratio(after, before))
    for name, policy in opts.policies():
        row = summary["policies"][name]
        if d["factor"] is not None:  # the same runs priced by the engine the host left them
            scaled = replace(cal, step_latency=cal.step_latency.scaled(d["factor"]))
            add_scaled(row, lives[name], simulate(scaled, policy, opts, out / name / "sim-scaled"))
        if not d["valid"]:  # no verdict on a comparison the host decided
            row["within_target"] = {k: None for k in row["within_target"]}
    summary["verdict"] = "valid" if d["valid"] else f"not valid: {d['reason']}"
    summary["cliff"] = {
        "unbounded": bool(summary["policies"]["unbounded"]["cliff_live"]),
        **{n: bool(summary["policies"][n]["cliff_live"]) for n, _ in opts.policies() if n != "unbounded"},
    }
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out / "summary.json", summary)
    return summary


def plans(opts: ValidateOptions):
    from metronome.probe.driver import SessionPlan

    from metronome.workload import draw_phases

    slots = draw_phases(opts.sessions, opts.phases, opts.seed)
    return [SessionPlan(f"s{i}", arrival_s=0.0, phase_slot=int(slots[i])) for i in range(opts.sessions)]


LIVE_CAP = 20  # a live run waits for its horizon's frames at most this many horizons (a host 20x slower)


def run_policy_live(engine, policy: KVPolicy, stream: TokenStream, opts: ValidateOptions, out_dir: Path, name: str):
    """One live run: N sessions at t = 0 until every frame ticking before the horizon is answered (on a quiet host,
    the horizon; a busy one takes longer for the same frames, the simulated run's), at most ``LIVE_CAP`` horizons,
    journaled into ``out_dir`` (Parquet at the end).

    Sessions finish at max_model_len (``cap="finish"``), as unbounded sessions do in the simulator; a
    bounded one is rebased there, also as in the simulator."""
    from metronome.probe.driver import frames_before, run_live
    from metronome.probe.records import journal_to_parquet

    load = os.getloadavg()[0]
    try:
        res = run_live(engine, stream, plans(opts), LIVE_CAP * opts.horizon_s, policy=policy, out_dir=out_dir,
                       run=name, cap="rebase" if policy.bounded else "finish", deadline_s=opts.deadline_s,
                       seed=opts.seed, phases=opts.phases, until=lambda d: frames_before(d, opts.horizon_s))
    finally:
        for t in TABLES:
            journal_to_parquet(out_dir / f"{t}.jsonl")
    res.summary["load_avg_start"], res.summary["load_avg_end"] = load, os.getloadavg()[0]
    write_json(out_dir / "summary.json", res.summary)
    return res


def _scenario(cal, policy: KVPolicy, opts: ValidateOptions):
    from metronome.sim import scenario as sc_mod

    return sc_mod.make_scenario(calibration=cal, **policy.options(), sessions=opts.sessions, horizon=opts.horizon_s,
                                deadline=opts.deadline_s, num_blocks=opts.num_blocks, seed=opts.seed,
                                phases=opts.phases, loop=opts.loop)


def simulate(cal, policy: KVPolicy, opts: ValidateOptions, out_dir: Path):
    from metronome.sim import scenario as sc_mod

    result = sc_mod.run(_scenario(cal, policy, opts))
    sc_mod.write(result, out_dir)
    return result


def seed_spread(cal, policy: KVPolicy, opts: ValidateOptions, seeds: int = SPREAD_SEEDS) -> dict:
    """The simulator's p50 and p99 frame latency over ``seeds`` draws of its step jitter (the calibration's) on
    the validate workload, the sessions and their phases fixed: {"p50": {min, median, max}, "p99": ..., "seeds"}.
    The first draw is :func:`simulate`'s own. One run's p99 is in effect its slowest tick (README, "Live
    validation"): a live p99 outside this range missed by more than the jitter the calibration measured."""
    from metronome.results import percentile
    from metronome.sim import scenario as sc_mod

    sc = _scenario(cal, policy, opts)
    got = {q: [] for q in ("p50", "p99")}
    for k in range(seeds):
        s = sc_mod.run(replace(sc, jitter_seed=opts.seed + k)).summary
        for q, v in got.items():
            if s[f"{q}_frame_latency_s"] is not None:
                v.append(s[f"{q}_frame_latency_s"])
    out = {q: ({"min": min(v), "median": percentile(v, 50), "max": max(v)} if v else None) for q, v in got.items()}
    return {**out, "seeds": seeds}


def _rel(sim, live):
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def compare(live, sim, policy: KVPolicy, spread: dict | None = None) -> dict:
    """One policy's row of summary.json: live against simulated, with relative errors (sim − live) / live, and
    where ``spread`` (:func:`seed_spread`) is given, the simulator's range over draws of its jitter and whether the
    live figure falls in it (information beside the verdict, which stays the relative error's)."""
    ls, ss = live.summary, sim.summary
    t_live, t_sim, t_fill = ls["t_sat_observed_s"], ss["t_sat_observed_s"], ss["t_sat_predicted_s"]
    row = {
        "policy": policy.describe(),
        "t_sat_observed_s": t_live,
        "t_sat_predicted_s": t_sim,
        "t_sat_predicted_fill_s": t_fill,
        "t_sat_relative_error": _rel(t_sim, t_live),
        "t_sat_fill_relative_error": _rel(t_fill, t_live),
        "silent_frame_fraction": {"live": ls["silent_frame_fraction"], "simulated": ss["silent_frame_fraction"]},
        "preemptions": {"live": ls["preemptions"], "simulated": ss["preemptions"]},
        # the summaries share these keys, with one meaning (metronome.results): no translation between them
        **{k: {"live": ls[k], "simulated": ss[k]} for k in ("frames", "peak_used_blocks", "peak_pool_occupancy",
                                                            "silent_preempted_fraction", "silent_waiting_fraction",
                                                            "silent_departed_fraction", "collapsed")},
        "cliff_live": bool(ls["preemptions"] > 0 and ls["silent_frame_fraction"] > 0),
        "cliff_simulated": bool(ss["preemptions"] > 0 and ss["silent_frame_fraction"] > 0),
        "live": {k: ls[k] for k in ("preemptions_by_reason", "readmissions", "stalls", "steps", "p50_step_latency_s",
                                    "deadline_miss_fraction", "load_avg_start", "load_avg_end") if k in ls},
        "simulated": {k: ss[k] for k in ("collapsed", "steps", "p50_step_latency_s", "steps_outside_fit",
                                         "deadline_miss_fraction")},
    }
    for q in ("p50", "p99"):
        k = f"{q}_frame_latency_s"
        row[k] = {"live": ls[k], "simulated": ss[k], "relative_error": _rel(ss[k], ls[k])}
        rng = (spread or {}).get(q)
        if rng is not None:
            row[k]["simulated_over_seeds"] = {**rng, "seeds": spread["seeds"]}
            row[k]["live_within_seed_range"] = (None if ls[k] is None
                                                else bool(rng["min"] <= ls[k] <= rng["max"]))
    e = row["t_sat_relative_error"]
    row["within_target"] = {
        "t_sat": None if t_live is None and t_sim is None else (e is not None and abs(e) <= T_SAT_TARGET),
        "p50": _ok(row["p50_frame_latency_s"]["relative_error"]),
        "p99": _ok(row["p99_frame_latency_s"]["relative_error"]),
    }
    return row


def add_scaled(row: dict, live, sim) -> None:
    """Errors against the calibration scaled by the host's measured drift (``*_scaled``), beside those against the
    calibration as taken."""
    ls, ss = live.summary, sim.summary
    row["t_sat_predicted_scaled_s"] = ss["t_sat_observed_s"]
    row["t_sat_relative_error_scaled"] = _rel(ss["t_sat_observed_s"], ls["t_sat_observed_s"])
    for q in ("p50", "p99"):
        k = f"{q}_frame_latency_s"
        row[k]["simulated_scaled"] = ss[k]
        row[k]["relative_error_scaled"] = _rel(ss[k], ls[k])


def _reference(engine, copts, points, path: Path):
    """The reference steps on ``engine``, kept in ``path``."""
    ref = drift.measure(engine, KVPolicy.unbounded(copts.block_size), copts, points)
    ref.to_parquet(path, index=False)
    return ref


def _ok(e):
    return None if e is None else abs(e) <= LATENCY_TARGET


def _range(r: dict | None) -> str:
    """The simulator's range over its jitter draws, in ms (- where there is none)."""
    return "-" if r is None else f"{r['min'] * 1e3:.1f}-{r['max'] * 1e3:.1f}"


def table(summary: dict) -> str:
    """The comparison as a fixed-width text table."""
    def f(v, unit=""):
        if v is None:
            return "-"
        if unit == "ms":
            return f"{v * 1e3:.1f}"
        if unit == "%":
            return f"{v * 100:+.1f}%"
        if unit == "frac":
            return f"{v:.3f}"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    head = ("policy", "t_sat live", "t_sat sim", "t_sat fill", "err", "silent live", "silent sim",
            "p50 live ms", "p50 sim ms", "err", "scaled", "p99 live ms", "p99 sim ms", "err", "scaled",
            "p99 sim range ms", "preempt live/sim")
    rows = [head]
    for name, r in summary["policies"].items():
        rows.append((name, f(r["t_sat_observed_s"]), f(r["t_sat_predicted_s"]), f(r["t_sat_predicted_fill_s"]),
                     f(r["t_sat_relative_error"], "%"), f(r["silent_frame_fraction"]["live"], "frac"),
                     f(r["silent_frame_fraction"]["simulated"], "frac"),
                     f(r["p50_frame_latency_s"]["live"], "ms"), f(r["p50_frame_latency_s"]["simulated"], "ms"),
                     f(r["p50_frame_latency_s"]["relative_error"], "%"),
                     f(r["p50_frame_latency_s"].get("relative_error_scaled"), "%"),
                     f(r["p99_frame_latency_s"]["live"], "ms"), f(r["p99_frame_latency_s"]["simulated"], "ms"),
                     f(r["p99_frame_latency_s"]["relative_error"], "%"),
                     f(r["p99_frame_latency_s"].get("relative_error_scaled"), "%"),
                     _range(r["p99_frame_latency_s"].get("simulated_over_seeds")),
                     f"{r['preemptions']['live']}/{r['preemptions']['simulated']}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    d = summary.get("drift")
    if d is not None and d["factor"] is not None:
        lines.append(f"engine speed after the runs against when it was calibrated: {d['drift']:+.1%} (\"scaled\": "
                     f"errors against the calibration scaled by {d['factor']:.3f}, the mean speed over the runs)")
    seeds = next((r["p99_frame_latency_s"]["simulated_over_seeds"]["seeds"] for r in summary["policies"].values()
                  if "simulated_over_seeds" in r["p99_frame_latency_s"]), None)
    if seeds:
        lines.append(f"p99 sim range: the simulator's p99 over {seeds} draws of its step jitter (one run's p99 is in "
                     "effect its slowest tick); a live p99 outside it missed by more than the calibration's jitter")
    if "verdict" in summary:
        lines.append(f"comparison: {summary['verdict']}")
    return "\n".join(lines)


def dumps(summary: dict) -> str:
    return json.dumps(summary, indent=2, default=float)
