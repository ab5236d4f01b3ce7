"""Host-side cost of the sink+window compaction per step, per request (the figure the GPU presets price as the
plugin's ``compaction`` term).

    python benchmarks/bench_compaction.py [--requests 16,64,256] [--repeats 50]

Times :func:`metronome.probe.plugin.compaction.compact_tables` (pure PyTorch on the host: the same lines a GPU
engine runs before each step's attention) on decode steps of sessions far past their window (S = 16, W = 1760,
16-token blocks, 5,000+ tokens each), and prints the time per step and per request, with the load average:
the figure is only worth something on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from metronome.kv_policy import cdiv
from metronome.probe.plugin import compaction


def per_step_s(n: int, repeats: int, bs: int = 16, sinks: int = 16, window: int = 1760) -> float:
    seq = [5000 + 37 * i for i in range(n)]
    width = max(cdiv(s, bs) for s in seq) + 1
    table = torch.arange(n * width, dtype=torch.int32).reshape(n, width)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq, dtype=torch.int32)
    sink_blocks = cdiv(sinks, bs)
    for _ in range(3):
        compaction.compact_tables(qsl, lens, table, sink_blocks, window, bs)
    t0 = time.perf_counter()
    for _ in range(repeats):
        compaction.compact_tables(qsl, lens, table, sink_blocks, window, bs)
    return (time.perf_counter() - t0) / repeats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args(argv)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for n in (int(x) for x in a.requests.split(",")):
        dt = per_step_s(n, a.repeats)
        print(f"{n:5d} requests: {dt * 1e3:7.3f} ms a step, {dt / n * 1e6:6.1f} us a request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
