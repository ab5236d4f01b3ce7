"""An engine's processes end with the process that started them, however it ends, and closing one is bounded.

**Dying with the parent.** The kernel ends a process whose parent was SIGKILLed only if the process asked for it:
``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set by the process itself (a fork's child does not inherit it; an exec
keeps it). It is the one mechanism that still works when the parent cannot run any code at all, and it costs
nothing at run time. (A watchdog process would need to learn every engine pid, including those vLLM starts later,
and to outlive the parent's death without becoming an orphan itself; a process group would need vLLM's processes
moved into it before they exec.) So each process of an engine arms it at its start, through the one hook that
runs there:

* the child :class:`~metronome.probe.remote.RemoteEngine` starts: its own code calls :func:`arm_from_env` first;
* the processes vLLM starts with the *spawn* method (EngineCore, its workers; always so on CPU): vLLM runs its
  general plugins at the start of each (EngineCore before it starts its workers, a worker in ``init_worker``),
  and metronome's plugin (``metronome.probe.plugin.register``) calls :func:`arm_from_env`;
* those it starts with the *fork* method (the default on CUDA when the parent has not initialised CUDA): a fork
  inherits ``plugins_loaded`` and runs no plugin, so :func:`arm_from_env` is registered with multiprocessing's
  after-fork hooks, which run in every child it forks, grandchildren included.

It is armed only where :data:`ENV_VAR` says so: :func:`engine_children` sets it while an engine starts, and a
child inherits it with the rest of the environment, so only processes of engines metronome started are touched
(``vllm serve`` with the plugin installed is not). Two caveats from ``man 2 prctl``: the parent is the *thread*
that started the child, so a child must be started from a thread that lives as long as it should
(:func:`start_process`; vLLM starts EngineCore from ``OwnLoopEngine``'s loop thread, which lives until
``close()``, and its workers from EngineCore's main thread); and the parent may die before the child arms
(vLLM's imports take seconds), so the child checks afterwards that its parent is still the one that started it.

**Closing.** :data:`GRACE_S` is how long an engine's processes get to exit after being asked; whatever is left is
SIGKILLed and reaped (:func:`kill_and_reap`), so that ``close()`` does not wait out vLLM's own shutdown timeout.
:data:`ENGINE_CLOSE_S` bounds an engine's whole ``close()``: a server's drain margin names it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue

ENV_VAR = "METRONOME_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# An engine's close(), in the order it runs, each part cut off at its share:
GRACE_S = 1.5  # its processes are asked to exit (a vLLM worker that takes longer is SIGKILLed)
KILL_S = 0.5  # those still there are SIGKILLed, and are gone and reaped (their memory freed)
WIND_DOWN_S = 0.5  # the client's own parts end: vLLM's sockets, the loop's tasks, its thread
ENGINE_CLOSE_S = GRACE_S + KILL_S + WIND_DOWN_S  # 2.5 s: the bound a server's drain margin names


# -- dying with the parent --------------------------------------------------------------------------------------------
def die_with_parent(parent_pid: int | None) -> bool:
    """Have the kernel SIGKILL this process when the thread that started it ends (its process ending included,
    however it ends). If ``parent_pid`` (the process that started this one) is already gone, this process was
    reparented before it could arm, and it ends now. Returns False where ``prctl`` is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # what the death signal would have done, had it been armed in time
    return True


def arm_from_env() -> bool:
    """At a process's start: die with the parent if :data:`ENV_VAR` asks for it (see the module's docstring).
    Idempotent; a no-op outside a multiprocessing child, where the parent that started it is not known."""
    if os.environ.get(ENV_VAR) != "1":
        return False
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    return die_with_parent(parent.pid)


class _AfterFork:
    """The owner multiprocessing's after-fork registry keeps a weak reference to (it must stay alive)."""


_AFTER_FORK = _AfterFork()
multiprocessing.util.register_after_fork(_AFTER_FORK, lambda _: arm_from_env())


@contextlib.contextmanager
def restoring_env(name: str):
    """The environment variable ``name`` as it was before the block, whatever the block set it to (children started
    inside it inherit what the block set)."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def engine_children():
    """Every process started inside this block, and every process those start, dies with its parent."""
    with restoring_env(ENV_VAR):
        os.environ[ENV_VAR] = "1"
        yield


_jobs: SimpleQueue = SimpleQueue()
_launcher: threading.Thread | None = None
_launcher_lock = threading.Lock()


def _launch_forever() -> None:
    while True:
        fn, affinity, done = _jobs.get()
        try:
            if affinity is not None:
                os.sched_setaffinity(0, affinity)  # a child inherits the CPUs of the thread that starts it
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, which raises it)
            done.set_exception(exc)


def start_process(proc) -> None:
    """``proc.start()`` from a thread that lives as long as this process, with the caller's CPUs: a child armed
    with the death signal dies when the thread that started it ends, and a caller's thread may end first."""
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            _launcher = threading.Thread(target=_launch_forever, name="metronome-launcher", daemon=True)
            _launcher.start()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    done: Future = Future()
    _jobs.put((proc.start, affinity, done))
    done.result()


# -- closing ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    """A process as seen once: its pid and its start time (clock ticks since boot), which tell it apart from a later
    process given the same pid, so that a process that is not ours is never signalled."""

    pid: int
    start: int


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # (the command name, in parentheses, may hold spaces)
    return fields[0], int(fields[1]), int(fields[19])


def seen(pid: int) -> Proc | None:
    """The process ``pid`` as it is now, or None if there is none."""
    st = _stat(pid)
    return None if st is None else Proc(pid, st[2])


def tree(pids) -> list[Proc]:
    """The processes ``pids`` and all their descendants, as they are now (Linux: read from /proc)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                kids.setdefault(st[1], []).append(int(name))
    out, todo, visited = [], [p for p in pids if p], set()
    while todo:
        pid = todo.pop()
        if pid in visited:
            continue
        visited.add(pid)
        st = _stat(pid)
        if st is not None:
            out.append(Proc(pid, st[2]))
            todo.extend(kids.get(pid, ()))
    return out


def alive(p: Proc) -> bool:
    """True while the process runs (a zombie has ended: it only waits to be reaped)."""
    st = _stat(p.pid)
    return st is not None and st[2] == p.start and st[0] != "Z"


def kill_and_reap(procs: list[Proc], children=(), timeout_s: float = KILL_S) -> list[Proc]:
    """SIGKILL each of ``procs`` still running, reap ``children`` (this process's ``multiprocessing`` Process
    objects among them: their ``join`` is what reaps them), and wait until all are gone, for at most ``timeout_s``.
    Returns those still running then. A child not gone by then (a killed process frees its memory first, which
    takes a while on a busy host) is reaped by a thread of its own once it is, so that none is left a zombie."""
    for p in procs:
        if alive(p):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    end = time.monotonic() + timeout_s
    for c in children:
        c.join(max(0.0, end - time.monotonic()))
        if c.exitcode is None:
            threading.Thread(target=c.join, name="metronome-reaper", daemon=True).start()
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.01)
        left = [p for p in left if alive(p)]
    return left
