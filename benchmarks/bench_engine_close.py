"""How long closing an engine takes (benchmark, not a test): ``OwnLoopEngine`` (vLLM's EngineCore and its worker,
as ``metronome-serve`` runs it) and ``RemoteEngine`` (the engine in a child process, as ``metronome-probe run``).

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/bench_engine_close.py [--repeat 2] [--sessions 3]

Each round starts the engine on ``tiny`` (256 blocks), opens ``--sessions`` sessions, runs a few steps, and times
``close()``; it prints each time, the bound ``close()`` states (``metronome.probe.lifetime.ENGINE_CLOSE_S``), the
load average, and any process of the engine left (running, or a child of this one not reaped). docs/serve.md
(Operations) quotes the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _left(procs) -> list[str]:
    """The recorded processes still there: running, or ended but not reaped (a zombie)."""
    out = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[19]) == p.start and (fields[0] != "Z" or int(fields[1]) == os.getpid()):
            out.append(f"{p.pid} ({'zombie' if fields[0] == 'Z' else 'running'})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2, help="rounds per engine kind")
    ap.add_argument("--sessions", type=int, default=3, help="sessions open when the engine is closed")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from metronome.probe import lifetime, models
    from metronome.probe.engine import EngineConfig
    from metronome.probe.own_loop import OwnLoopEngine
    from metronome.probe.remote import RemoteEngine

    config = EngineConfig(models.resolve("tiny"), num_blocks=256, max_model_len=2048)
    print(f"bound: ENGINE_CLOSE_S = {lifetime.ENGINE_CLOSE_S:g} s (grace {lifetime.GRACE_S:g} s)")
    for cls in (OwnLoopEngine, RemoteEngine):
        for k in range(args.repeat):
            eng = cls(config, log_path=os.devnull)
            for s in range(args.sessions):
                eng.append(f"s{s}", [5] * 14, 2)
            for _ in range(5):
                eng.step()
            procs = lifetime.tree([eng.pid])
            t0 = time.perf_counter()
            eng.close()
            took = time.perf_counter() - t0
            time.sleep(1.0)  # (a reaper thread may still be joining a child the kernel was slow to free)
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"{cls.__name__}.close(): {took:.2f} s  (load average {load}; processes of the engine left: "
                  f"{_left(procs) or 'none'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
