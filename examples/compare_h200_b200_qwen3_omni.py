"""Compare H200 and B200 for Qwen3-Omni (user story 4): one report, both GPUs side by side.

    python examples/compare_h200_b200_qwen3_omni.py [--out examples-out/qwen3-omni-h200-vs-b200] [--workers N]

Builds the capacity-planning report for qwen3-omni-30b-a3b on both estimated presets (the same as
`metronome-sim report --calibration qwen3-omni-30b-a3b-h200 --calibration qwen3-omni-30b-a3b-b200`),
prints the answer table, and says what the bigger GPU buys: sessions per GPU, and how much later the
unbounded pool runs dry. Open report.html in a browser for the figures.
"""

import argparse
import sys

from rich.console import Console
from rich.progress import Progress

from metronome import calibration
from metronome.errors import run_command
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.outputs import check_out
from metronome.report import ReportOptions, answer_markdown, build_report, write_report
from metronome.sim.executors import LocalExecutor

PRESETS = ("qwen3-omni-30b-a3b-h200", "qwen3-omni-30b-a3b-b200")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="examples-out/qwen3-omni-h200-vs-b200")
    ap.add_argument("--replace", action="store_true", help="replace the results of an earlier run in --out")
    ap.add_argument("--workers", type=int, default=None)
    a = ap.parse_args()
    check_out(a.out, replace=a.replace)  # before the work, not after it

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    with Progress(console=con) as bar:
        def phase(label, total):
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        data = build_report(ReportOptions(calibrations=PRESETS), LocalExecutor(a.workers), phase)
    out = write_report(data, a.out, replace=a.replace)
    print(answer_markdown(data))

    h, b = data["calibrations"]
    n_h, n_b = h["capacity"]["n_star"], b["capacity"]["n_star"]
    print(f"\nB200 vs H200: {n_b:,} vs {n_h:,} sessions per GPU ({n_b / n_h:.2f}x), "
          f"{b['capacity']['binding']} vs {h['capacity']['binding']} binds.")
    t_h, t_b = (FillModel(cal, KVPolicy.unbounded(cal.engine.block_size_tokens)).t_sat(n_h)
                for cal in (calibration.load(p) for p in PRESETS))
    print(f"Without the bound, {n_h:,} sessions run the pool dry after {t_h:.0f} s on the H200 and {t_b:.0f} s on "
          f"the B200: a bigger pool only delays the wall; the bound removes it.")
    print(f"wrote {out}/report.html and {out}/report.md ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(run_command("examples/compare_h200_b200_qwen3_omni.py", main))
