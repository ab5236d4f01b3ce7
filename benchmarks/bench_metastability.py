"""Monte Carlo fan-out and prediction quality.

    python benchmarks/bench_metastability.py             # 20-run study serial vs every core, then 200 runs
    python benchmarks/bench_metastability.py --tune      # also time tune-aimd with its default grid

Prints the serial and parallel wall times of the paper-like 20-run study (ratio measured in one run),
then, over many more runs, the fill model's predicted saturation and collapse probabilities beside the
observed fractions, with their gaps.
"""

import argparse
import os
import sys
import time

from metronome.sim.executors import LocalExecutor
from metronome.sim.montecarlo import metastability
from metronome.sim.tuning import tune_aimd

# examples/metastability.py: 300 Moshi sessions on one H200, exponential lengths racing the pool fill
PAPER_LIKE = dict(calibration="moshi-7b-h200", sessions=300, session_duration="exp:160", horizon=600.0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--tune", action="store_true")
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    serial, _ = metastability(PAPER_LIKE, 20, 0, LocalExecutor(1))
    t_serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    par, _ = metastability(PAPER_LIKE, 20, 0, LocalExecutor(cores))
    t_par = time.perf_counter() - t0
    assert serial["t_sat_observed_s"] == par["t_sat_observed_s"]
    print(f"20-run study ({PAPER_LIKE}):")
    print(f"  unbounded collapsed {par['collapsed_runs']}/20, saturated {par['saturated_runs']}/20, "
          f"predicted P(collapse) {par['predicted_collapse_probability']:.3f}, "
          f"P(saturate) {par['predicted_saturation_probability']:.3f}")
    print(f"  serial {t_serial:.2f} s, {cores} workers {t_par:.2f} s: speed-up {t_serial / t_par:.2f}x (identical results)")
    bound, _ = metastability({**PAPER_LIKE, "kv": "sinks", "sinks": 16, "window": 368}, 20, 0, LocalExecutor(cores))
    print(f"  sinks(S=16, W=368) collapsed {bound['collapsed_runs']}/20")
    t0 = time.perf_counter()
    many, _ = metastability(PAPER_LIKE, a.runs, 1000, LocalExecutor(cores))
    print(f"{a.runs} runs (seeds 1000..): predicted P(saturate) {many['predicted_saturation_probability']:.3f}, "
          f"observed saturation {many['saturated_fraction']:.3f} (gap {many['saturation_prediction_gap']:+.3f}); "
          f"predicted P(collapse) {many['predicted_collapse_probability']:.3f}, "
          f"observed collapse {many['collapse_fraction']:.3f} (gap {many['collapse_prediction_gap']:+.3f}) "
          f"in {time.perf_counter() - t0:.1f} s")
    if a.tune:
        t0 = time.perf_counter()
        best, table = tune_aimd(dict(calibration="moshi-7b-h200", kv="sinks", sinks=16, window=368, deadline=0.04,
                                     arrival_rate=10.0, session_duration="exp:300", horizon=600.0),
                                executor=LocalExecutor(cores))
        print(f"tune-aimd, default grid ({len(table)} settings x 2 seeds): {time.perf_counter() - t0:.0f} s; "
              f"best {best['params']['additive_increase']:g}/{best['params']['decrease_factor']:g}/"
              f"{best['params']['target_fraction']:g}/{best['params']['interval_s']:g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
