"""Per-step decode latency of long sessions vs session age: sinks + window (the plugin) vs unbounded.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_plugin_decode.py \
        [--sessions 4] [--tokens 3000] [--sinks 32] [--window 256] [--block-size 32] [--out FILE.json]

On vllm-cpu with ``tiny``: one in-process engine per policy, ``--sessions`` sessions decoding ``--tokens``
tokens each in lockstep (40-token prompts). Every decode step's wall time is regressed on the sessions'
age (tokens computed): the 20th percentile of the step time in each of 10 age bins (contention only adds
time), a line through them, its slope in ms per 1000 tokens of age with the standard error, and the
20th-percentile step time in the first and last tenth of the run. Under the bound the attended context stops
growing at S + W, so the slope should be zero within noise; unbounded, every step reads the whole
history, so it grows. Timings on a shared machine are noisy: read the slope against its standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time


def run_policy(model, bound, args) -> dict:
    from metronome.probe import plugin
    from metronome.probe.engine import Engine, EngineConfig

    if bound:
        plugin.activate(*bound)
    try:
        e = Engine(EngineConfig(model=model, block_size=args.block_size, max_num_seqs=max(args.sessions, 1),
                                max_num_batched_tokens=2048, max_model_len=args.tokens + 64, kv_cache_gib=1.0))
    finally:
        plugin.deactivate()
    spec = type(e.kv_spec).__name__
    rng = random.Random(0)
    for i in range(args.sessions):
        e.add(f"s{i}", [rng.randrange(10, 2000) for _ in range(40)], args.tokens)
    ages, times, blocks = [], [], []
    while e.has_work():
        info = e.step()
        if info.prefill_tokens or not info.computed or info.finished:
            continue  # prefill steps, and the last step (finished requests report no age)
        ages.append(sum(info.computed.values()) / len(info.computed))
        times.append(info.duration_s * 1e3)
        blocks.append(e.pool().used_blocks)
    e.close()
    import numpy as np

    from metronome.results import percentile  # the one percentile every report uses (nearest rank)

    a, t = np.asarray(ages), np.asarray(times)
    # Robust to a shared, noisy machine: contention only ever adds time, so take the 20th percentile of
    # the step time in each of 10 age bins and fit the line through those (slope ± standard error).
    bins = [(float(np.mean(ab)), percentile(tb, 20))
            for ab, tb in zip(np.array_split(a, 10), np.array_split(t, 10))]
    x = np.array([b[0] for b in bins]) / 1000.0
    y = np.array([b[1] for b in bins])
    A = np.vstack([x, np.ones_like(x)]).T
    coef, res, *_ = np.linalg.lstsq(A, y, rcond=None)
    sigma2 = float(res[0]) / max(len(y) - 2, 1) if len(res) else 0.0
    se = float(np.sqrt(sigma2 * np.linalg.inv(A.T @ A)[0, 0]))
    tenth = max(len(t) // 10, 1)
    deciles = [round(percentile(c, 20), 2) for c in np.array_split(t, 10)]
    return dict(p20_ms_by_age_decile=deciles, policy=("sinks S=%d W=%d" % bound) if bound else "unbounded", spec=spec, steps=len(t),
                slope_ms_per_1k_tokens=float(coef[0]), slope_se=se, intercept_ms=float(coef[1]),
                p20_first_tenth_ms=percentile(t[:tenth], 20), p20_last_tenth_ms=percentile(t[-tenth:], 20),
                peak_used_blocks=int(max(blocks)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--sinks", type=int, default=32)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", help="write the figures as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from metronome.probe.models import resolve

    model = resolve("tiny")
    cmd = "VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_plugin_decode.py " + shlex.join(sys.argv[1:])
    results = []
    for bound in [(args.sinks, args.window), None]:
        t0 = time.perf_counter()
        r = run_policy(model, bound, args)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
    print(f"command: {cmd}")
    print(f"{args.sessions} sessions x {args.tokens} decode tokens, tiny, block size {args.block_size}")
    print(f"{'policy':<22} {'slope ms/1k tok':>18} {'p20 first 10%':>13} {'p20 last 10%':>12} {'peak blocks':>12}")
    for r in results:
        print(f"{r['policy']:<22} {r['slope_ms_per_1k_tokens']:>+9.3f} ± {r['slope_se']:<6.3f} "
              f"{r['p20_first_tenth_ms']:>13.2f} {r['p20_last_tenth_ms']:>12.2f} {r['peak_used_blocks']:>12}")
    for r in results:
        print(f"{r['policy']:<22} p20 ms per age decile: {r['p20_ms_by_age_decile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=cmd, results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
