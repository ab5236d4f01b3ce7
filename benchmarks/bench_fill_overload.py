"""The fill model past the engine's throughput: predicted against simulated, with the load average.

    python benchmarks/bench_fill_overload.py [--runs 100] [--workers 2] [--skip-metastability] [--only-twice-n-star]

1. t_sat of N unbounded Moshi sessions started together on an H200 (``moshi-7b-h200``, independent phases), N =
   256 and 512: far past the engine's throughput, so each session's KV grows at the engine's frame service
   time, not at the stream's 12.5 tokens/s.
2. The metastability example (``metronome-sim metastability --calibration moshi-7b-h200 --session-duration
   exp:160 --horizon 600``) at 183, 300 and 305 sessions (1.5x, ~2.5x N* = 122): the predicted P(saturate) and
   P(collapse) beside the shares of ``--runs`` simulated runs, with the binomial standard error of those shares.
3. 2x N* on ``qwen3-omni-30b-a3b-b200`` and ``minicpm-o-4.5-h200`` (N*: the deadline-bound N* of ``metronome-sim
   capacity --calibration NAME``, unbounded, computed here), N sessions started together with exponential lengths
   and a horizon of 3 mean lengths (the report's metastability cells). The mean is where P(saturate) is mid-range
   (0.7 and 0.4 predicted), where a share of 100 runs tells the most. Each run is simulated to its horizon, so the
   share that collapses is given twice: by the collapse rule (frames silent after a preemption,
   :mod:`metronome.results`), and counting the frames flushed silent at departure too (the rule before the
   silent frames were split), beside the fill model's P(collapse), which predicts the first.

The simulated figures do not depend on the machine; the wall times do, hence the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

from metronome import calibration, results
from metronome.fill_model import FillModel
from metronome.sim import scenario as scn
from metronome.sim.capacity import deadline_n_star
from metronome.sim.executors import LocalExecutor
from metronome.sim.montecarlo import metastability
from metronome.workload import Durations

# preset, mean session length (s): see the module docstring, 3.
TWICE_N_STAR = (("qwen3-omni-30b-a3b-b200", 230.0), ("minicpm-o-4.5-h200", 210.0))


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def t_sat_rows(sessions=(256, 512)) -> None:
    for n in sessions:
        t0 = time.perf_counter()
        s = scn.run(scn.make_scenario("moshi-7b-h200", sessions=n, kv="unbounded", horizon=150.0)).summary
        pred, obs = s["t_sat_predicted_s"], s["t_sat_observed_s"]
        print(f"t_sat  N={n:4d}: predicted {pred:7.2f} s  simulated {obs:7.2f} s  "
              f"error {100 * (pred - obs) / obs:+5.1f}%  ({time.perf_counter() - t0:.1f} s wall, {load()})", flush=True)


def metastability_rows(sessions=(183, 300, 305), runs: int = 100, workers: int = 2) -> None:
    for n in sessions:
        point = dict(calibration="moshi-7b-h200", sessions=n, session_duration="exp:160", horizon=600.0)
        s, _ = metastability(point, runs=runs, executor=LocalExecutor(workers))
        for what, obs, pred in (("P(saturate)", s["saturated_fraction"], s["predicted_saturation_probability"]),
                                ("P(collapse)", s["collapse_fraction"], s["predicted_collapse_probability"])):
            se = math.sqrt(max(pred * (1 - pred), 1e-12) / runs)
            print(f"N={n:3d} {what}: predicted {pred:.3f}  observed {obs:.3f} over {runs} runs  "
                  f"gap {(obs - pred) / se:+.2f} SE  ({s['wall_s']:.0f} s wall, {load()})", flush=True)


def _both_rules(point: dict) -> tuple[bool, bool, bool]:
    """One run to its horizon: (saturated, collapsed, collapsed counting the frames flushed at departure)."""
    res = scn.run(scn.make_scenario(**point))
    t, fr = res.summary["t_sat_observed_s"], res.frames
    with_departed = fr.silent_preempted.to_numpy() + fr.silent_departed.to_numpy()
    return (t is not None, bool(res.summary["collapsed"]),
            bool(results.collapsed(t, fr.tick_s.to_numpy(), fr.frames.to_numpy(), with_departed)))


def twice_n_star_rows(runs: int = 100, workers: int = 2) -> None:
    for name, mean in TWICE_N_STAR:
        t0 = time.perf_counter()
        cal = calibration.load(name)
        policy = scn.make_scenario(name, sessions=1).policy  # (unbounded)
        n_star, _ = deadline_n_star(cal, policy, cal.stream.frame_period_s)
        n, horizon = 2 * n_star, 3.0 * mean
        fm = FillModel(cal, policy, "independent")
        dur = Durations("exponential", mean)
        pred_sat, pred_col = fm.p_saturate_fixed(n, dur, horizon), fm.p_collapse_fixed(n, dur, horizon)
        points = [dict(calibration=name, sessions=n, session_duration=f"exp:{mean:g}", horizon=horizon, seed=k)
                  for k in range(runs)]
        obs = np.array(LocalExecutor(workers).map(_both_rules, points), dtype=bool)
        print(f"{name}: N* {n_star}, N={n}, exp({mean:g} s), horizon {horizon:g} s, {runs} runs "
              f"({time.perf_counter() - t0:.0f} s wall, {load()})", flush=True)
        for what, o, pred in (("P(saturate)", obs[:, 0].mean(), pred_sat), ("P(collapse)", obs[:, 1].mean(), pred_col),
                              ("P(collapse), departure flushes counted", obs[:, 2].mean(), pred_col)):
            se = math.sqrt(max(pred * (1 - pred), 1e-12) / runs)
            print(f"  {what}: predicted {pred:.3f}  observed {o:.3f}  gap {(o - pred) / se:+.2f} SE", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-metastability", action="store_true")
    ap.add_argument("--only-twice-n-star", action="store_true", help="only part 3 (qwen3, minicpm at 2x N*)")
    a = ap.parse_args()
    if not a.only_twice_n_star:
        t_sat_rows()
        if not a.skip_metastability:
            metastability_rows(runs=a.runs, workers=a.workers)
    twice_n_star_rows(runs=a.runs, workers=a.workers)


if __name__ == "__main__":
    main()
