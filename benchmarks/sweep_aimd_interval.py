"""Offline AIMD tuning for the live benchmark: where does AIMD settle against N*, per control interval?

    python benchmarks/sweep_aimd_interval.py runs/live-aimd*/calibration/calibration.json \
        [--deadline 0.04] [--num-blocks 384] [--window 128] [--intervals 1.5,2,2.5,3] [--seeds 4]

For each calibration (as ``benchmarks/bench_live_aimd.py`` writes them) and each control interval, simulates the
benchmark's bounded scenario (vLLM's window on the pool, Poisson arrivals well above capacity, AIMD from 2
sessions) over several seeds and prints the settled concurrency (mean admitted sessions over the second half, as
the benchmark measures it) relative to that calibration's deadline-bound N* (``metronome.sim.capacity``), then
each interval's mean and worst error over all calibrations and seeds. This is how the benchmark's 2.5 s interval
was chosen: a short interval holds few frame ticks, so its p99 is its slowest tick and AIMD settles above N*; a
long one ramps up slowly (+1 session an interval) and spends the run below it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibrations", nargs="+", help="calibration.json files")
    ap.add_argument("--deadline", type=float, default=0.04, help="frame deadline, seconds")
    ap.add_argument("--num-blocks", type=int, default=384)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--intervals", default="1.5,2,2.5,3", help="control intervals to try, seconds (comma-separated)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--horizon", type=float, default=240.0)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", default="exp:60")
    args = ap.parse_args(argv)

    from bench_live_aimd import AIMD, second_half_mean, sim_admitted  # the benchmark's controller and measure

    from metronome.calibration import load_file
    from metronome.errors import MetronomeError
    from metronome.kv_policy import KVPolicy
    from metronome.sim import scenario as sc_mod
    from metronome.sim.capacity import capacity

    try:
        intervals = [float(x) for x in args.intervals.split(",")]
        cals = [load_file(p) for p in args.calibrations]
    except (ValueError, MetronomeError) as exc:
        print(f"sweep_aimd_interval: error: {exc}", file=sys.stderr)
        return 2
    policy = KVPolicy.window(cals[0].engine.block_size_tokens, args.window)
    errors: dict[float, list[float]] = {i: [] for i in intervals}
    for path, cal in zip(args.calibrations, cals):
        cal = replace(cal, engine=replace(cal.engine, num_blocks=args.num_blocks))
        cap = capacity(cal, policy, deadline_s=args.deadline)
        n_star = cap["n_star"]
        cells = []
        for interval in intervals:
            aimd = {**AIMD, "interval_s": interval}
            errs = []
            for seed in range(args.seeds):
                sc = sc_mod.make_scenario(calibration=cal, kv="window", window=args.window, arrival_rate=args.rate,
                                          session_duration=args.duration, horizon=args.horizon, seed=seed,
                                          deadline=args.deadline, admission="aimd", aimd_params=aimd,
                                          num_blocks=args.num_blocks)
                errs.append(second_half_mean(*sim_admitted(sc_mod.run(sc).steps), args.horizon) / n_star - 1)
            errors[interval] += errs
            cells.append(f"{interval:g} s {np.mean(errs):+.1%} [{min(errs):+.0%}, {max(errs):+.0%}]")
        print(f"{path}: N* {n_star} ({cap['binding']} binds) | " + " | ".join(cells), flush=True)
    print("settled vs N*, all calibrations and seeds:")
    for interval, errs in errors.items():
        print(f"  {interval:g} s: mean {np.mean(errs):+.1%}, worst |error| {max(abs(e) for e in errs):.1%} "
              f"({len(errs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
