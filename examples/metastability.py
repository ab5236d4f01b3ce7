"""Collapse is metastable: the same scenario, 20 seeds — unbounded collapses in some runs, the bound in none.

    python examples/metastability.py [--runs 20] [--out examples-out/metastability]

300 Moshi sessions start together on one H200 (estimated preset), each lasting an exponentially
distributed time (mean 160 s). The pool fills at ρ(t) = N·r·t while sessions end at random: whether a
run collapses depends on that race. The fill model's probabilities (collapse, saturation) are printed
beside the observed ones.
"""

import argparse
import sys
from pathlib import Path

from metronome.errors import run_command
from metronome.sim.montecarlo import metastability

SCENARIO = dict(calibration="moshi-7b-h200", sessions=300, session_duration="exp:160", horizon=600.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default="examples-out/metastability")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for label, extra in (("unbounded", {}), ("sinks S=16, W=368", dict(kv="sinks", sinks=16, window=368))):
        s, table = metastability({**SCENARIO, **extra}, runs=a.runs)
        table.to_csv(out / f"{label.split()[0]}_runs.csv", index=False)
        print(f"{label:<18} collapsed {s['collapsed_runs']:>2}/{s['runs']}  saturated {s['saturated_runs']:>2}/{s['runs']}"
              f"  predicted P(collapse) {s['predicted_collapse_probability']:.2f}"
              f"  P(saturate) {s['predicted_saturation_probability']:.2f}")
        if s["collapse_time_s"]:
            ct = s["collapse_time_s"]
            print(f"{'':<18} collapse times {ct['min']:.0f}–{ct['max']:.0f} s (median {ct['p50']:.0f} s)")
    print(f"per-run tables in {out}/")


if __name__ == "__main__":
    sys.exit(run_command("examples/metastability.py", main))
