"""Simulator speed: simulated seconds per wall second on three workloads, both phase regimes.

    python benchmarks/bench_sim.py            # 1 simulated hour of each scenario on moshi-7b-h200

Each run in a process of its own (one core): a run that follows another in one process meets the memory that one
left behind, and on this machine that alone moved a run's time by up to half. Scenarios (all on the Moshi H200
preset, 80 ms frames):

* **steady**: 500 sessions from t=0 with the bound (sinks S=16, W=368; ceiling 512), and unbounded (the cliff);
* **realistic**: Poisson arrivals at 1.5/s lasting exp(300 s), AIMD at a 40 ms deadline, the same bound
  (the churn that keeps a lockstep fast-forward from engaging);
* **overloaded**: 500 sessions with S=64, W=2048 (memory ceiling 96): 404 wait at the front end, silent.

For each, the simulated seconds per wall second of the default run (fast paths on) over ``--horizon``, the
share of engine steps the fast paths took, and the speed-up over the ``--no-fast-forward`` reference (one SimPy
event per step) measured in the same run over ``--reference-horizon`` (ratios, so a noisy machine cancels
out). Prints the load average and each run's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from metronome.sim.scenario import make_scenario, run

BOUND = dict(kv="sinks", sinks=16, window=368)
SCENARIOS = {
    "steady bounded": dict(BOUND, sessions=500),
    "steady unbounded": dict(kv="unbounded", sessions=500),
    "realistic (Poisson, AIMD)": dict(BOUND, arrival_rate=1.5, session_duration="exp:300", admission="aimd",
                                      deadline=0.04),
    "overloaded (ceiling 96)": dict(kv="sinks", sinks=64, window=2048, sessions=500),
    # a measured calibration's step jitter: slow spells (shared AR(1) over frames) and a frame-only part
    "realistic, correlated jitter": dict(BOUND, arrival_rate=1.5, session_duration="exp:300", admission="aimd",
                                         deadline=0.04, jitter=True),
}
# the jitter of "correlated jitter" (tests/test_jitter_correlation.py's form of a measured one)
JITTER = dict(jitter=((0.0, 0.85), (0.5, 1.0), (0.9, 1.1), (0.99, 1.5), (1.0, 2.0)), frame_first_s=0.001,
              jitter_shared=0.6, jitter_tau_s=1.0, jitter_frame=0.1)


def timed(calibration: str, kw: dict, phases: str, horizon: float, fast: bool):
    kw = dict(kw)
    if kw.pop("jitter", False):
        from dataclasses import replace

        from metronome import calibration as cal_mod

        c = cal_mod.load(calibration)
        calibration = replace(c, step_latency=replace(c.step_latency, **JITTER))
    sc = make_scenario(calibration, phases=phases, horizon=horizon, **kw)
    t0 = time.perf_counter()
    res = run(sc, fast_forward=fast)
    return time.perf_counter() - t0, res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizon", type=float, default=3600.0)
    ap.add_argument("--reference-horizon", type=float, default=60.0)
    ap.add_argument("--calibration", default="moshi-7b-h200")
    ap.add_argument("--phases", default="independent,aligned")
    ap.add_argument("--only", default=None, help="run the scenarios whose name contains this")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child: NAME|PHASES, prints one JSON line)
    args = ap.parse_args(argv)
    if args.one:
        name, phases = args.one.split("|")
        print(json.dumps(measure(args, name, phases)))
        return 0
    import llvmlite.binding
    import numba

    # (the loop's machine code is LLVM's, and numba versions differ in it: say which ran)
    llvm = ".".join(map(str, llvmlite.binding.llvm_version_info))
    print(f"benchmark: {args.calibration}, {args.horizon:g} simulated s per run; python {sys.version.split()[0]}, "
          f"numba {numba.__version__} (LLVM {llvm}), each run in a process of its own; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  {'scenario':<28} {'phases':<12} {'wall s':>8} {'x real time':>12} {'fast steps':>11} "
          f"{'steps':>10} {'vs no-FF':>9} {'peak RSS':>9}")
    passed = ["--horizon", str(args.horizon), "--reference-horizon", str(args.reference_horizon),
              "--calibration", args.calibration]
    for name in SCENARIOS:
        if args.only and args.only not in name:
            continue
        for phases in args.phases.split(","):
            out = subprocess.run([sys.executable, __file__, *passed, "--one", f"{name}|{phases}"], check=True,
                                 capture_output=True, text=True).stdout
            m = json.loads(out.strip().splitlines()[-1])
            rate = args.horizon / m["wall_s"]
            ref_rate = args.reference_horizon / m["ref_wall_s"]
            print(f"  {name:<28} {phases:<12} {m['wall_s']:>8.2f} {rate:>11,.0f}x {m['fast_share']:>10.1%} "
                  f"{m['steps']:>10,} {rate / ref_rate:>8,.0f}x {m['rss_mb']:>6,.0f} MB", flush=True)
    print(f"  load average after {os.getloadavg()[0]:.2f}")
    return 0


def measure(args, name: str, phases: str) -> dict:
    """One scenario in this process, as a user's command runs it: its compiled code loaded (a short run first),
    then the timed run and the no-fast-forward reference. A process of its own per run, so that no run meets the
    memory an earlier one left behind."""
    kw = SCENARIOS[name]
    timed(args.calibration, kw, phases, 2.0, True)  # load (or compile) the compiled code the run takes
    wall, res = timed(args.calibration, kw, phases, args.horizon, True)
    ref_wall, _ = timed(args.calibration, kw, phases, args.reference_horizon, False)
    s = res.summary
    return {"wall_s": wall, "ref_wall_s": ref_wall, "steps": s["steps"],
            "fast_share": res.fast_steps / max(s["steps"], 1),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


if __name__ == "__main__":
    sys.exit(main())
