"""The engine in a child process, so the driver outlives it.

``metronome-probe run`` drives the engine through :class:`RemoteEngine`: the same interface as
:class:`~metronome.probe.engine.Engine` (``append``, ``abort``, ``step``, ``pool``, the per-request
accessors), with the in-process engine living in a spawned child that serves one request at a time over a
pipe. If that process dies (killed, out of memory, a crash inside vLLM), the next call raises
:class:`EngineDied` with one line saying how it ended, while everything the driver recorded stays in the
driver's process. The child dies with the driver's process, however that ends (``probe/lifetime.py``), and
:meth:`RemoteEngine.close` ends it within ``lifetime.ENGINE_CLOSE_S``. :meth:`RemoteEngine.restart` starts a
fresh child without blocking, so the driver can keep its frame clock (answering frames silent) while the new
engine loads.

Cost: a step is one round trip (the reply carries the step's :class:`StepInfo` and a snapshot of the pool
and of every request, so the driver's per-session questions are answered locally). ``append`` and ``abort``
are one-way messages; a failure inside them is reported by the next call that waits for a reply.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field

from metronome.errors import MetronomeError
from metronome.probe import lifetime
from metronome.probe.engine import Engine, EngineConfig, PoolState, StepInfo, _one_line


class EngineDied(MetronomeError):
    """The engine's process ended (or stopped answering) while the driver needed it; ``log_path`` is its log."""

    exit_code = 1
    log_path: str | None = None


@dataclass(frozen=True)
class _Request:
    tokens: int
    blocks: int
    computed: int
    waiting: bool  # has tokens to compute but sits in a waiting queue


@dataclass
class _Snapshot:
    pool: PoolState
    has_work: bool
    requests: dict[str, _Request] = field(default_factory=dict)


def _snapshot(eng: Engine) -> _Snapshot:
    reqs = {}
    for rid, r in eng.scheduler.requests.items():
        reqs[rid] = _Request(tokens=int(r.num_tokens), blocks=eng.blocks_of(rid),
                             computed=int(r.num_computed_tokens), waiting=eng.is_scheduled_waiting(rid))
    return _Snapshot(pool=eng.pool(), has_work=eng.has_work(), requests=reqs)


def _static(eng: Engine) -> dict:
    """What the driver asks of the engine itself (the pool, the context cap, the KV policy it runs)."""
    return {"num_blocks": eng.num_blocks, "max_model_len": eng.max_model_len, "policy": eng.policy,
            "describe": eng.describe()}


def _own_resource_tracker() -> None:
    """Give the engine's process its own multiprocessing resource tracker (a spawned child shares its parent's).

    vLLM makes named semaphores in the engine's process; if that process is killed, a shared tracker would clean
    them up only when the *driver* exits, and warn about "leaked semaphore objects" on the driver's stderr. With
    its own tracker they are cleaned up as soon as the engine dies, and the warning goes to the engine's log.
    """
    from multiprocessing import resource_tracker as rt

    tracker = rt.ResourceTracker()
    rt._resource_tracker = tracker
    for name in ("ensure_running", "register", "unregister", "getfd"):
        setattr(rt, name, getattr(tracker, name))


def _serve(config: EngineConfig, conn, log_path: str | None, env: dict) -> None:
    """The child: start the engine, then answer requests until told to close or the pipe breaks."""
    os.environ.update(env)
    lifetime.arm_from_env()  # first: it dies with the driver, however the driver ends (probe/lifetime.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it closes us)
    if log_path:  # everything vLLM prints goes to the log, for the engine's whole life
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _own_resource_tracker()
    try:
        eng = Engine(config)
    except Exception as exc:
        conn.send(("error", exc.args[0] if isinstance(exc, MetronomeError) else
                   f"the vLLM engine failed to start: {type(exc).__name__}: {_one_line(exc)}"))
        return
    conn.send(("ready", _static(eng)))
    deferred: str | None = None  # a failure in a one-way call, reported with the next reply
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if op == "append":
                if deferred is None:
                    eng.append(*args)
                continue
            if op == "abort":
                if deferred is None:
                    eng.abort(*args)
                continue
            if op == "close":
                break
            if deferred is not None:
                conn.send(("error", deferred))
                deferred = None
                continue
            if op == "step":
                info = eng.step()
                conn.send(("ok", (info, _snapshot(eng))))
            elif op == "state":
                conn.send(("ok", _snapshot(eng)))
            elif op == "reset":
                eng.reset()
                conn.send(("ok", _snapshot(eng)))
            else:
                conn.send(("error", f"unknown engine request {op!r}"))
        except Exception as exc:  # the engine raised: the driver gets one line, the engine stays up
            msg = f"the engine failed in {op}: {type(exc).__name__}: {_one_line(exc)}"
            if op in ("append", "abort"):
                deferred = msg
            else:
                conn.send(("error", msg))
    eng.close()


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class RemoteEngine:
    """An :class:`Engine` in a child process, with the part of its interface the driver uses. Construct it to
    start the engine and wait until it is ready. ``log_path`` receives everything vLLM prints."""

    def __init__(self, config: EngineConfig, log_path: str | os.PathLike | None = None,
                 start_timeout_s: float = 600.0):
        self.config = config
        self.log_path = None if log_path is None else str(log_path)
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self._info: dict | None = None  # what the running engine reported when it became ready
        self._known: dict | None = None  # the same, kept while a restart loads (same config, same answers)
        self._snap: _Snapshot | None = None  # the engine's state after the last call; None once a call changed it
        self._started_at = 0.0
        self._start()
        self.wait_ready()

    # -- life cycle -------------------------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "METRONOME_", "KMP_"))}
        env[lifetime.ENV_VAR] = "1"  # the child, and any process it starts, dies with its parent
        self._proc = self._ctx.Process(target=_serve, args=(self.config, child, self.log_path, env),
                                       name="metronome-engine", daemon=True)
        lifetime.start_process(self._proc)  # (from a thread that lives as long as this process)
        child.close()
        self._conn = parent
        self._info = None
        self._snap = None
        self._started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def check_alive(self) -> None:
        """Raise :class:`EngineDied` if the running engine's process has ended (a no-op while restarting)."""
        if self._info is not None and not self._proc.is_alive():
            raise self._died("")

    def _died(self, where: str) -> EngineDied:
        self._proc.join(timeout=2.0)
        how = _how_it_ended(self._proc.exitcode)
        where = f" {where}" if where else ""
        exc = EngineDied(f"the engine process (pid {self._proc.pid}) {how}{where}")
        exc.log_path = self.log_path
        return exc

    def ready(self) -> bool:
        """True once the engine answers; raises :class:`EngineDied` if it failed to start."""
        if self._info is not None:
            return True
        try:
            has = self._conn.poll()
        except (EOFError, OSError):
            raise self._died("while starting") from None
        if not has:
            if not self._proc.is_alive():
                raise self._died("while starting")
            if time.monotonic() - self._started_at > self.start_timeout_s:
                self._kill()
                raise EngineDied(f"the engine did not start within {self.start_timeout_s:.0f} s")
            return False
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise self._died("while starting") from None
        if kind == "error":
            self._proc.join(timeout=10)
            raise MetronomeError(payload)
        self._info = self._known = payload
        return True

    def wait_ready(self) -> None:
        while not self.ready():
            time.sleep(0.05)

    def restart(self) -> None:
        """Throw the old process away and start a new engine; returns at once (poll :meth:`ready`)."""
        self._kill()
        self._start()

    def _kill(self) -> None:
        """SIGKILL the engine's process and reap it. (Its resource tracker, if it started one, is not killed: it
        exits by itself once the engine is gone, after unlinking what the engine left.)"""
        if self._proc is not None and self._proc.pid is not None:
            me = lifetime.seen(self._proc.pid)
            lifetime.kill_and_reap([me] if me else [], [self._proc])
        if self._conn is not None:
            self._conn.close()

    def close(self) -> None:
        """Ask the engine's process to close its engine, wait ``lifetime.GRACE_S``, then SIGKILL it if it is still
        there: within ``lifetime.ENGINE_CLOSE_S`` it has ended and is reaped."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(("close", ()))
            except (OSError, ValueError):
                pass
            self._proc.join(timeout=lifetime.GRACE_S)
        self._kill()

    # -- calls ---------------------------------------------------------------------------------------------
    def _send(self, op: str, args: tuple = ()) -> None:
        if self._info is None:
            raise EngineDied("the engine is not running (it is restarting)")
        try:
            self._conn.send((op, args))
        except (OSError, ValueError):
            raise self._died(f"during {op}") from None

    def _call(self, op: str, args: tuple = ()):
        self._send(op, args)
        while True:
            try:
                if self._conn.poll(0.5):
                    kind, payload = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._died(f"during {op}") from None
            if not self._proc.is_alive():
                raise self._died(f"during {op}")
        if kind == "error":
            raise MetronomeError(payload)
        return payload

    def _state(self) -> _Snapshot:
        if self._info is None:  # restarting: an empty pool that admits nobody and has no work
            return _Snapshot(PoolState(0, 0, 0.0, 0, 0, 0), False)
        if self._snap is None:
            self._snap = self._call("state")
        return self._snap

    def append(self, sid: str, tokens: list[int], max_tokens: int, resumable: bool = True) -> None:
        self._send("append", (sid, list(tokens), int(max_tokens), resumable))
        self._snap = None

    def abort(self, sid: str) -> None:
        self._send("abort", (sid,))
        self._snap = None

    def step(self, wait_s: float | None = None) -> StepInfo:
        info, self._snap = self._call("step")
        return info

    def reset(self) -> None:
        if self._info is None:
            return
        self._snap = self._call("reset")

    # -- state, answered from the last snapshot ------------------------------------------------------------
    def pool(self) -> PoolState:
        return self._state().pool

    def has_work(self) -> bool:
        return self._state().has_work

    def _req(self, sid: str) -> _Request | None:
        return self._state().requests.get(sid)

    def blocks_of(self, sid: str) -> int:
        r = self._req(sid)
        return 0 if r is None else r.blocks

    def tokens_of(self, sid: str) -> int:
        r = self._req(sid)
        return 0 if r is None else r.tokens

    def computed_tokens(self, sid: str) -> int:
        r = self._req(sid)
        return 0 if r is None else r.computed

    def is_scheduled_waiting(self, sid: str) -> bool:
        r = self._req(sid)
        return r is not None and r.waiting

    # -- what the engine is (from its ready message; kept across a restart of the same config) -------------
    def _static(self, key: str):
        if self._known is None:
            self.wait_ready()
        return self._known[key]

    @property
    def num_blocks(self) -> int:
        return self._static("num_blocks")

    @property
    def max_model_len(self) -> int:
        return self._static("max_model_len")

    @property
    def max_num_batched_tokens(self) -> int:
        return int(self.config.max_num_batched_tokens)

    @property
    def policy(self):
        return self._static("policy")

    def describe(self) -> str:
        return self._static("describe")
