"""Simulator speed: simulated seconds per wall second, against a naive per-frame-event SimPy model.

    python benchmarks/bench_sim.py            # 500 Moshi sessions, 80 ms frames, 1 simulated hour

Runs in one process (one core). Prints, for the bounded and unbounded policies, the simulated seconds per
wall second of the real simulator over one simulated hour; the same for a deliberately naive SimPy model
(one process per session, one event per frame) over 60 simulated seconds; the speed-up of one over the
other (ratios measured in the same run, so a noisy machine cancels out); and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from dataclasses import replace

import numpy as np
import simpy

from metronome import calibration
from metronome.kv_policy import KVPolicy
from metronome.workload import Arrivals
from metronome.sim.scenario import Scenario, run


def naive_model(cal, policy: KVPolicy, n_sessions: int, horizon_s: float) -> int:
    """One SimPy process per session and one event per frame: the design the engine loop replaces.

    Each session sleeps until its tick, hands its frame to the engine and waits for the answer; the
    engine batches whatever is pending, charges the same step-latency model and answers the batch."""
    env = simpy.Environment()
    P = cal.stream.frame_period_s
    tokens = [0] * n_sessions
    pending: list[tuple[int, simpy.Event]] = []
    wake = [env.event()]
    frames = [0]

    def session(i):
        t = 0.0
        while True:
            yield env.timeout(max(0.0, t - env.now))
            done = env.event()
            pending.append((i, done))
            if not wake[0].triggered:
                wake[0].succeed()
            yield done
            frames[0] += 1
            t += P

    def engine():
        while True:
            if not pending:
                wake[0] = env.event()
                yield wake[0]
            batch = pending[:]
            pending.clear()
            for i, _ in batch:
                tokens[i] += cal.stream.kv_tokens_per_frame
            ctx = int(policy.resident_tokens(np.array([tokens[i] for i, _ in batch])).sum())  # one numpy call per step
            yield env.timeout(cal.step_latency.step_s(len(batch), ctx, len(batch) * (cal.stream.input_tokens_per_frame + 1)))
            for _, ev in batch:
                ev.succeed()

    for i in range(n_sessions):
        env.process(session(i))
    env.process(engine())
    env.run(until=horizon_s)
    return frames[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--horizon", type=float, default=3600.0)
    ap.add_argument("--naive-horizon", type=float, default=60.0)
    ap.add_argument("--calibration", default="moshi-7b-h200")
    args = ap.parse_args(argv)

    cal = calibration.load(args.calibration)
    bs = cal.engine.block_size_tokens
    bounded = KVPolicy.sinks(bs, 16, 368)  # ~512-session memory ceiling on the H200 preset
    print(f"benchmark: {args.sessions} sessions of {cal.name}, {cal.stream.frame_period_s * 1e3:g} ms frames")
    print(f"python {sys.version.split()[0]}, one process")
    rates = {}
    for label, pol in (("bounded sinks(S=16, W=368)", bounded), ("unbounded", KVPolicy.unbounded(bs))):
        sc = Scenario(cal, pol, Arrivals("all", sessions=args.sessions), args.horizon)
        t0 = time.perf_counter()
        res = run(sc)
        wall = time.perf_counter() - t0
        rates[label] = args.horizon / wall
        s = res.summary
        print(f"  metronome-sim {label:<27} {args.horizon:>6.0f} sim-s in {wall:6.3f} s = {rates[label]:>9,.0f}x real time"
              f"  ({s['steps']:,} steps, {s['frames']:,} frames, collapsed={s['collapsed']})")
    sc = Scenario(cal, bounded, Arrivals("all", sessions=args.sessions), args.naive_horizon)
    t0 = time.perf_counter()
    run(sc, fast_forward=False)
    wall = time.perf_counter() - t0
    print(f"  metronome-sim, fast-forward off       {args.naive_horizon:>6.0f} sim-s in {wall:6.3f} s = "
          f"{args.naive_horizon / wall:>9,.0f}x real time  (one SimPy event per engine step)")
    t0 = time.perf_counter()
    frames = naive_model(cal, bounded, args.sessions, args.naive_horizon)
    wall = time.perf_counter() - t0
    naive = args.naive_horizon / wall
    print(f"  naive per-frame SimPy model          {args.naive_horizon:>6.0f} sim-s in {wall:6.3f} s = {naive:>9,.0f}x real time"
          f"  ({frames:,} frames)")
    for label, r in rates.items():
        print(f"  speed-up over naive, {label}: {r / naive:,.0f}x")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS: {rss_mb:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
