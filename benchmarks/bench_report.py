"""The default capacity-planning report: wall time and report.html size.

    python benchmarks/bench_report.py [--calibration moshi-7b-h200] [--workers N] [--out bench-out/report]
                                      [--cache cold|warm|off]

Builds `metronome-sim report --calibration NAME --out DIR` in-process (every core, the CLI's default),
then prints the wall time of each phase and in all, the number of simulated runs, the page sizes, the
load average before and after, and the wall time in units of one reference run (500 unbounded Moshi
sessions for 600 s, timed just before): on a shared machine the ratio moves less than the seconds.
``--cache``: ``cold`` (default) builds into a fresh, empty cache of simulated points; ``warm`` builds once into
it, then times a second build that reads every point back; ``off`` builds with no cache (``--no-cache``).
Targets on 2 cores: cold <= 20 s for moshi-7b-h200 (<= 30 s for qwen3-omni-30b-a3b-b200), warm <= 3 s;
report.html < 10 MB.
"""

import argparse
import os
import tempfile
import time

from metronome.outputs import check_out
from metronome.report import ReportOptions, build_report, write_report
from metronome.sim.cache import ResultCache
from metronome.sim.executors import LocalExecutor
from metronome.sim.scenario import make_scenario, run

REFERENCE = dict(calibration="moshi-7b-h200", sessions=500, horizon=600.0)
TARGET_S = {"moshi-7b-h200": 20.0, "qwen3-omni-30b-a3b-b200": 30.0}  # a cold build on 2 cores


def reference_s(repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(make_scenario(**REFERENCE))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default="moshi-7b-h200")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", default="bench-out/report")
    ap.add_argument("--replace", action="store_true", help="replace the results of an earlier run in --out")
    ap.add_argument("--cache", choices=("cold", "warm", "off"), default="cold")
    a = ap.parse_args(argv)
    check_out(a.out, replace=a.replace)  # before the work, not after it
    cores = os.cpu_count() or 1
    load0 = os.getloadavg()[0]
    ref = reference_s()
    phases, marks = [], [time.perf_counter()]

    def progress(label, total):
        marks.append(time.perf_counter())
        phases.append((label, total))
        return lambda n: None

    options = ReportOptions(calibrations=(a.calibration,))
    with tempfile.TemporaryDirectory(prefix="bench-report-cache-") as folder:
        cache = ResultCache(folder, enabled=a.cache != "off")
        if a.cache == "warm":  # fill it first (untimed)
            build_report(options, LocalExecutor(a.workers), cache=cache)
            cache.hits = cache.misses = cache.writes = 0
            phases.clear()
        t0 = time.perf_counter()
        marks[:] = [t0]
        data = build_report(options, LocalExecutor(a.workers), progress, cache=cache)
        t_build = time.perf_counter() - t0
        cache.close()
    out = write_report(data, a.out, replace=a.replace)
    t_all = time.perf_counter() - t0
    marks.append(t0 + t_build)
    html_mb = (out / "report.html").stat().st_size / 1e6
    md_kb = (out / "report.md").stat().st_size / 1e3
    print(f"default report for {a.calibration} on {a.workers or cores} workers ({cores} cores, "
          f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after):")
    for (label, total), start, end in zip(phases, marks[1:], marks[2:]):
        print(f"  {label:<48} {total:>4} tasks {end - start:7.1f} s")
    print(f"  simulate + render + write: {t_all:.1f} s ({data['simulated_runs']} simulated runs), "
          f"{t_all / ref:,.0f}x one reference run ({ref * 1e3:.0f} ms)")
    print(f"  cache {a.cache}: {cache.hits} points read back, {cache.misses} simulated")
    print(f"  report.html {html_mb:.2f} MB, report.md {md_kb:.0f} kB -> {out}")
    target = 3.0 if a.cache == "warm" else TARGET_S.get(a.calibration)
    if target is not None:
        print(f"  targets: <= {target:g} s ({'met' if t_all <= target else 'MISSED'}), report.html < 10 MB "
              f"({'met' if html_mb < 10 else 'MISSED'})")


if __name__ == "__main__":
    main()
