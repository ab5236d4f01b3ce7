"""Fleet simulation speed: a 100-engine fleet of Moshi on H200s for a simulated day.

    python benchmarks/bench_fleet.py                       # static caps at N*, least-loaded, sinks S=4 W=1760
    python benchmarks/bench_fleet.py --kv unbounded        # the memory path (silent frames on a grid)
    python benchmarks/bench_fleet.py --controller aimd --hours 1

The offered load is the one at which the 100 engines, pooled, refuse 1% (Erlang B): a busy fleet, every engine
near its cap all day, sessions of exp(300 s). N* comes from ``metronome.sim.capacity.capacity`` for the preset and
policy. Runs in one process. Prints the wall time, the simulated engine-seconds per wall second, the load average
beside it (a busy machine slows the figure down), and the peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from metronome import calibration as calmod
from metronome.erlang import refusal_probability
from metronome.kv_policy import make_policy
from metronome.workload import Arrivals, Durations

from metronome.sim.fleet import simulate
from metronome.sim.fleet_config import EngineType, FleetConfig, capacity_cached


def load_for(refusal: float, places: int, engines: int) -> float:
    """The offered Erlangs at which ``engines`` pooled engines of ``places`` refuse ``refusal`` (bisection)."""
    lo, hi = 0.0, 2.0 * places * engines
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refusal_probability(mid, places, engines, "pooled") < refusal else (lo, mid)
    return lo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="moshi-7b-h200")
    ap.add_argument("--kv", default="sinks")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=1760)
    ap.add_argument("--engines", type=int, default=100)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--mean-session", type=float, default=300.0)
    ap.add_argument("--router", default="least-loaded")
    ap.add_argument("--controller", default="static")
    args = ap.parse_args(argv)
    cal = calmod.load(args.calibration)
    policy = make_policy(args.kv, cal.engine.block_size_tokens, window=args.window, sinks=args.sinks)
    t0 = time.perf_counter()
    cap = capacity_cached(cal, policy, None, args.mean_session, {})
    t_cap = time.perf_counter() - t0
    et = EngineType.from_capacity(cal, policy, cap)
    erlangs = load_for(0.01, et.n_star, args.engines)
    rate = erlangs / args.mean_session
    cfg = FleetConfig(engine=et, engines=args.engines, arrivals=Arrivals("poisson", rate_per_s=rate),
                      durations=Durations("exponential", args.mean_session), horizon_s=args.hours * 3600.0,
                      router=args.router, controller=args.controller)
    print(f"benchmark: {cfg.describe()}")
    print(f"  N* = {et.n_star} ({cap['binding']} binds; capacity took {t_cap:.1f} s), offered {erlangs:,.0f} Erlangs "
          f"= {rate:.2f} sessions/s; python {sys.version.split()[0]}, one process")
    load_before = os.getloadavg()[0]
    res = simulate(cfg)
    t = res.totals
    print(f"  {t['offered']:,} sessions offered, {t['refused_fraction']:.2%} refused, "
          f"{t['silent_frame_fraction']:.2%} of frames silent, {t['gpu_hours']:,.0f} GPU-hours")
    print(f"  wall {t['wall_s']:.1f} s · {t['engine_seconds_per_wall_s']:,.0f} simulated engine-seconds per wall second "
          f"· {t['offered'] / t['wall_s']:,.0f} sessions per wall second")
    print(f"  load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1 min; {os.cpu_count()} cores) · "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
