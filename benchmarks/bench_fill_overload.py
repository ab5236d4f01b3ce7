"""The fill model past the engine's throughput: predicted against simulated, with the load average.

    python benchmarks/bench_fill_overload.py [--runs 100] [--workers 2] [--skip-metastability]

1. t_sat of N unbounded Moshi sessions started together on an H200 (``moshi-7b-h200``, independent phases), N =
   256 and 512: far past the engine's throughput, so each session's KV grows at the engine's frame service
   time, not at the stream's 12.5 tokens/s.
2. The metastability example (``metronome-sim metastability --calibration moshi-7b-h200 --session-duration
   exp:160 --horizon 600``) at 183, 300 and 305 sessions (1.5x, ~2.5x N* = 122): the predicted P(saturate) and
   P(collapse) beside the shares of ``--runs`` simulated runs, with the binomial standard error of those shares.

The simulated figures do not depend on the machine; the wall times do, hence the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import time

from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor
from metronome.sim.montecarlo import metastability


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-metastability", action="store_true")
    a = ap.parse_args()
    t_sat_rows()
    if not a.skip_metastability:
        metastability_rows(runs=a.runs, workers=a.workers)


if __name__ == "__main__":
    main()
