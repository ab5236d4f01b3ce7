"""Will my deployment hit the wall? (user story 1): t_sat for a preset and a session mix.

    python examples/will_my_deployment_hit_the_wall.py [--calibration moshi-7b-h200] [--sessions 300]
        [--session-duration exp:300] [--sinks 16 --window 368]

You plan to run N real-time sessions of a model on one GPU, conversations of some length. With unbounded
KV, when does the block pool run dry (t_sat), how likely is that before the sessions end, and what does
the failure look like? The fill model answers in microseconds; one simulated run of each policy shows it.
"""

import argparse
import sys

from metronome import calibration
from metronome.errors import run_command
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.sim.scenario import make_scenario, run
from metronome.workload import Durations


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default="moshi-7b-h200")
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--session-duration", default="exp:300", help="SECONDS, exp:MEAN or lognormal:MEAN:SIGMA")
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--window", type=int, default=368)
    a = ap.parse_args()

    cal = calibration.load(a.calibration)
    mix = Durations.parse(a.session_duration)
    bs = cal.engine.block_size_tokens
    unbounded, bound = KVPolicy.unbounded(bs), KVPolicy.sinks(bs, a.sinks, a.window)
    fm_u, fm_b = FillModel(cal, unbounded), FillModel(cal, bound)
    horizon = 3 * mix.mean_s

    print(f"{cal.name} ({cal.provenance.kind}): a {cal.engine.num_blocks:,}-block pool, "
          f"{cal.stream.kv_tokens_per_s:g} KV tokens/s per session, sessions {mix.describe()}")
    t_sat = fm_u.t_sat(a.sessions)
    p = fm_u.p_saturate_fixed(a.sessions, mix, horizon)
    print(f"\nunbounded KV, {a.sessions} sessions started together:")
    print(f"  t_sat = {t_sat:.1f} s if nobody leaves (fill model)" if t_sat is not None else "  the pool never runs dry")
    print(f"  P(the pool runs dry before the sessions end) = {100 * p:.0f}% (race between fill and session length)")
    print(f"  the pool holds {fm_u.memory_ceiling(mix.mean_s)} sessions of {mix.mean_s:g} s")
    print(f"\n{bound.describe()}: every session stops at {fm_b.peak_resident_blocks} blocks; "
          f"the pool holds {fm_b.memory_ceiling()} sessions of any length")

    print("\none simulated run of each (seed 0):")
    for kv in ("unbounded", "sinks"):
        s = run(make_scenario(cal, kv, window=a.window, sinks=a.sinks, sessions=a.sessions,
                              session_duration=a.session_duration, horizon=horizon)).summary
        tsat = "never" if s["t_sat_observed_s"] is None else f"{s['t_sat_observed_s']:.1f} s"
        print(f"  {s['policy']:<20} pool dry at {tsat:<7} silent frames {100 * s['silent_frame_fraction']:5.1f}%  "
              f"deadline misses {100 * s['deadline_miss_fraction']:.2f}%  p99 {1e3 * s['p99_frame_latency_s']:.1f} ms  "
              f"{'COLLAPSED' if s['collapsed'] else 'healthy'}")
    print("\nA collapsed run answers its frames on time, only empty: watch silent frames, not latency.")
    print(f"The full plan: metronome-sim report --calibration {a.calibration} --session-duration {a.session_duration} "
          f"--out report-{a.calibration}")


if __name__ == "__main__":
    sys.exit(run_command("examples/will_my_deployment_hit_the_wall.py", main))
