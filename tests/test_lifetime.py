"""probe/lifetime.py without vLLM: a child armed at its start dies with its parent however the parent dies (SIGKILL),
whichever way it was started (fork: multiprocessing's after-fork hook; spawn: the vLLM plugin's entry point, which vLLM
runs at the start of every process it starts), even when the parent died before the child could arm, and even when
the thread that started it ended long before; a child started outside an engine's start is left alone; and closing
kills only the processes it recorded, never a later one given the same pid.

Each parent is a small script in its own process, so that the test can SIGKILL it. Every wait is a poll with a
generous cap; every process a test starts is killed at its end, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from metronome.probe import lifetime

CAP_S = 30.0  # the cap on any wait: generous, for a busy host

PARENT = textwrap.dedent('''
    import multiprocessing as mp, os, sys, threading, time
    from metronome.probe import lifetime

    def hooked(ready):  # what vLLM does at the start of each process it spawns: run its general plugins
        from metronome.probe import plugin
        plugin.register()
        ready.set()
        time.sleep(600)

    def hooked_late(parent, ready):  # the same, but only once its parent has died (vLLM's imports take seconds)
        ready.set()
        while os.getppid() == parent:
            time.sleep(0.01)
        hooked(ready)

    def plain(ready):  # a forked child runs nothing of ours: the after-fork hook is all there is
        ready.set()
        time.sleep(600)

    if __name__ == "__main__":
        how = sys.argv[1]
        ctx = mp.get_context("fork" if how in ("fork", "fork-unarmed") else "spawn")
        ready = ctx.Event()
        if how == "fork-unarmed":  # started outside an engine's start: not ours to end
            p = ctx.Process(target=plain, args=(ready,))
            p.start()
        elif how in ("fork", "spawn", "late"):
            args = (os.getpid(), ready) if how == "late" else (ready,)
            with lifetime.engine_children():
                p = ctx.Process(target={"fork": plain, "spawn": hooked, "late": hooked_late}[how], args=args)
                p.start()
        else:  # "thread", "thread-plain": started from a thread that ends once the child has armed
            box = []
            def launch():
                with lifetime.engine_children():
                    box.append(ctx.Process(target=hooked, args=(ready,)))
                    (lifetime.start_process if how == "thread" else mp.Process.start)(box[0])
                ready.wait(60)
            t = threading.Thread(target=launch)
            t.start()
            t.join()
            p = box[0]
        ready.wait(60)
        print(p.pid, flush=True)
        time.sleep(600)
''')


def _state(pid: int) -> str | None:
    """The process's state letter (Z: ended, waiting to be reaped), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _until(pred, cap_s: float = CAP_S) -> bool:
    for _ in range(int(cap_s / 0.05) + 1):
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def parent(tmp_path):
    """``parent(how)``: start the parent script; returns (its Popen, its child's pid). Kills both at the end."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    started = []

    def start(how: str):
        proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
        child = int(proc.stdout.readline())
        started.append((proc, child, lifetime.seen(child)))
        return proc, child

    yield start
    for proc, child, seen in started:
        proc.kill()
        proc.wait()
        if seen is not None and lifetime.alive(seen):  # (still the child we started: same start time)
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_a_child_started_for_an_engine_dies_when_its_parent_is_sigkilled(parent, how):
    proc, child = parent(how)  # (the parent reports its child once the child has armed)
    assert _running(child)
    proc.kill()
    proc.wait()
    assert _until(lambda: not _running(child)), f"the {how} child outlived its SIGKILLed parent"


def test_a_child_whose_parent_died_before_it_could_arm_ends_at_once(parent):
    proc, child = parent("late")
    assert _running(child)
    proc.kill()
    proc.wait()
    assert _until(lambda: not _running(child)), "the child outlived its parent, which died before it armed"


def test_a_child_started_from_a_thread_that_ended_lives_until_its_process_dies(parent):
    proc, child = parent("thread")  # the thread that asked for it ended once it had armed
    time.sleep(1.0)
    assert _running(child), "the child died with the thread that asked for it, its process alive"
    proc.kill()
    proc.wait()
    assert _until(lambda: not _running(child))


def test_start_process_is_what_keeps_it_alive(parent):
    """The same child started by the short-lived thread itself dies with that thread (man 2 prctl): why
    ``start_process`` starts children from a thread of its own."""
    proc, child = parent("thread-plain")
    assert _until(lambda: not _running(child)), "expected PR_SET_PDEATHSIG to fire when the starting thread ended"


def test_a_child_started_outside_an_engine_start_is_not_touched(parent):
    proc, child = parent("fork-unarmed")
    proc.kill()
    proc.wait()
    time.sleep(1.0)
    assert _running(child), "a process that is not an engine's died with its parent"


def test_kill_and_reap_ends_a_running_child_and_reaps_it():
    import multiprocessing as mp

    p = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    p.start()
    try:
        seen = lifetime.seen(p.pid)
        left = lifetime.kill_and_reap([seen], [p], timeout_s=CAP_S)
        assert left == [] and not p.is_alive() and p.exitcode == -signal.SIGKILL
        assert _state(p.pid) is None  # reaped: no zombie left
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_kill_and_reap_never_signals_a_later_process_given_the_same_pid():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        now = lifetime.seen(other.pid)
        recorded = lifetime.Proc(other.pid, now.start - 1)  # as if recorded before the pid was given out again
        assert lifetime.kill_and_reap([recorded], timeout_s=0.5) == []
        time.sleep(0.2)
        assert other.poll() is None, "a process that was not the recorded one was killed"
    finally:
        other.kill()
        other.wait()


def test_tree_finds_a_process_and_its_descendants():
    inner = ("import subprocess, sys, time; c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); "
             "time.sleep(600)")
    outer = subprocess.Popen([sys.executable, "-c", inner], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(outer.stdout.readline())
        assert {p.pid for p in lifetime.tree([outer.pid])} == {outer.pid, grandchild}
    finally:
        os.kill(grandchild, signal.SIGKILL)
        outer.kill()
        outer.wait()


def test_a_child_not_gone_within_the_timeout_is_reaped_once_it_is():
    import multiprocessing as mp

    p = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    p.start()
    try:
        lifetime.kill_and_reap([], [p], timeout_s=0.1)  # (nothing to kill: the child outlives the timeout)
        assert _state(p.pid) not in (None, "Z")
        os.kill(p.pid, signal.SIGKILL)  # it ends later; nobody here joins it
        assert _until(lambda: _state(p.pid) is None), f"left a zombie: {_state(p.pid)}"
    finally:
        if p.exitcode is None:
            p.kill()
            p.join()
