"""Offline AIMD tuning for the live benchmark: where does AIMD settle against N*, per control interval?

    python benchmarks/sweep_aimd_interval.py runs/live-aimd*/calibration/calibration.json \
        [--deadline 0.04] [--num-blocks 384] [--window 128] [--intervals 2.5,3,4,5,6,8] [--seeds 6] \
        [--jitter-correlation SHARED:TAU[:FRAME]]

For each calibration (as ``benchmarks/bench_live_aimd.py`` writes them) and each control interval, simulates the
benchmark's bounded scenario (vLLM's window on the pool, Poisson arrivals well above capacity, the benchmark's AIMD
from N*/2) over several seeds and prints the settled concurrency (mean admitted sessions over the second
half, as the benchmark measures it) relative to that calibration's deadline-bound N* (``metronome.sim.capacity``),
the interval the benchmark would pick on it (:func:`metronome.probe.live_aimd.tune_interval`), then each
interval's mean and worst error over all calibrations and seeds. ``--jitter-correlation`` replaces the
calibrations' slow-spell terms (``jitter_shared``, ``jitter_tau_s``, ``jitter_frame``), e.g. to see what spells
do to calibrations taken before they were measured.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from metronome.probe.driver import PHASES
from metronome.probe.live_aimd import AIMD, INTERVALS, TUNING_SEEDS, tune_interval


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibrations", nargs="+", help="calibration.json files")
    ap.add_argument("--deadline", type=float, default=0.04, help="frame deadline, seconds")
    ap.add_argument("--num-blocks", type=int, default=384)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--intervals", default=",".join(f"{i:g}" for i in INTERVALS),
                    help="control intervals to try, seconds (comma-separated)")
    ap.add_argument("--seeds", type=int, default=TUNING_SEEDS)
    ap.add_argument("--horizon", type=float, default=240.0)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", default="exp:60")
    ap.add_argument("--jitter-correlation", default=None, metavar="SHARED:TAU[:FRAME]",
                    help="use these slow-spell share, correlation time (s) and frame-only share of the step jitter "
                         "instead of the files'")
    args = ap.parse_args(argv)

    from metronome.calibration import load_file
    from metronome.errors import MetronomeError
    from metronome.kv_policy import KVPolicy
    from metronome.sim.capacity import capacity

    try:
        intervals = [float(x) for x in args.intervals.split(",")]
        cals = [load_file(p) for p in args.calibrations]
        corr = None
        if args.jitter_correlation:
            parts = [float(x) for x in args.jitter_correlation.split(":")]
            shared, tau, frame = (parts + [0.0])[:3] if len(parts) in (2, 3) else (-1.0, 0.0, 0.0)
            if not (0 <= shared and 0 <= frame and shared + frame < 1 and tau > 0):
                raise ValueError("--jitter-correlation: want SHARED:TAU[:FRAME] with SHARED, FRAME >= 0, "
                                 f"SHARED + FRAME < 1 and TAU > 0, got {args.jitter_correlation}")
            corr = dict(jitter_shared=shared, jitter_tau_s=tau, jitter_frame=frame)
    except (ValueError, MetronomeError) as exc:
        print(f"sweep_aimd_interval: error: {exc}", file=sys.stderr)
        return 2
    policy = KVPolicy.window(cals[0].engine.block_size_tokens, args.window)
    errors: dict[float, list[float]] = {i: [] for i in intervals}
    for path, cal in zip(args.calibrations, cals):
        cal = replace(cal, engine=replace(cal.engine, num_blocks=args.num_blocks))
        if corr is not None:
            cal = replace(cal, step_latency=replace(cal.step_latency, **corr))
        cap = capacity(cal, policy, deadline_s=args.deadline, phases=PHASES)
        n_star = cap["n_star"]
        pick, tuning = tune_interval(cal, AIMD, n_star, intervals=intervals, seeds=range(1, args.seeds + 1),
                                     window=args.window, num_blocks=args.num_blocks, rate=args.rate,
                                     duration=args.duration, horizon=args.horizon, deadline=args.deadline)
        cells = []
        for interval, errs in tuning.items():
            errors[interval] += errs
            cells.append(f"{interval:g} s {np.mean(errs):+.1%} [{min(errs):+.0%}, {max(errs):+.0%}]")
        sl = cal.step_latency
        print(f"{path}: N* {n_star} ({cap['binding']} binds), jitter shared {sl.jitter_shared:.2f} tau "
              f"{sl.jitter_tau_s:.2f} s frame {sl.jitter_frame:.2f} | " + " | ".join(cells) + f" | picks {pick:g} s",
              flush=True)
    print("settled vs N*, all calibrations and seeds:")
    for interval, errs in errors.items():
        print(f"  {interval:g} s: mean {np.mean(errs):+.1%}, worst |error| {max(abs(e) for e in errs):.1%} "
              f"({len(errs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
