"""What N* over the step terms' ranges costs (metronome.sim.capacity.sensitivity): simulations and wall time per
way of starting each variant's search.

    python benchmarks/bench_capacity_ranges.py [--calibration moshi-7b-h200,qwen3-omni-30b-a3b-h200] [--phases independent]

For each preset (its default stack, the report's bound, 5-minute sessions) it runs the central deadline-bound N*
once, then every variant the interval and the tornado need (each ranged term at its low and its high, every term at
once at each end) three ways: searched from one session (doubling, then bisection: what capacity does for the
central N*), from the central N* outward, and from the step model's guess (guess_n_star: what the report and
`metronome-sim capacity` do). The three must agree on every N*; the figures are the simulations (p99 evaluations)
and the seconds each way took. Wall time depends on the machine: the load average is printed with it.
"""

from __future__ import annotations

import argparse
import os
import time

from metronome import calibration
from metronome.report.plan import recommended_policy
from metronome.sim import capacity as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="moshi-7b-h200,qwen3-omni-30b-a3b-h200")
    ap.add_argument("--phases", default="independent", choices=("independent", "aligned"))
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    for spec in args.calibration.split(","):
        cal = calibration.load(spec)
        policy, _ = recommended_policy(cal)
        t = time.perf_counter()
        cap = K.capacity(cal, policy, None, duration_s=300.0, phases=args.phases)
        central_s = time.perf_counter() - t
        variants = K.range_variants(cal, policy)
        print(f"{spec} ({cal.stack or 'no stack'}), {policy.describe()}, {args.phases}: central deadline-bound N* "
              f"{cap['deadline_n_star']} in {len(cap['evaluations'])} simulations, {central_s:.2f} s; "
              f"{len(variants)} variants")
        found = {}
        for how in ("from one session", "from the central N*", "from the step model's guess"):
            t, sims, ns = time.perf_counter(), 0, []
            for ov in variants:
                v = K.with_overrides(cal, ov)
                start = {"from one session": None, "from the central N*": cap["deadline_n_star"]}.get(
                    how, K.guess_n_star(cal, v, policy, cap["deadline_n_star"], 300.0, args.phases))
                n, evals = K.deadline_n_star(v, policy, cap["deadline_s"], 0.8, 99.0, 300.0, phases=args.phases,
                                             start=start)
                sims += len(evals)
                ns.append(n)
            found[how] = ns
            print(f"  {how:28s} {sims:4d} simulations ({sims / len(variants):.1f} a variant), "
                  f"{time.perf_counter() - t:6.2f} s")
        assert len({tuple(v) for v in found.values()}) == 1, "the searches disagree"
        print(f"  (every way finds the same N*; interval {min(ns)}–{max(ns)})")


if __name__ == "__main__":
    main()
