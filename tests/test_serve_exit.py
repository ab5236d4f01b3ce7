"""``metronome-serve``'s exit after SIGTERM is bounded by the server itself (no vLLM needed): once
``--drain-timeout`` plus ``EXIT_MARGIN_S`` have passed, its exit timer kills what the process started (vLLM's
EngineCore and workers: here, a shell and its sleep) and exits, 0 when the drain had ended every session, else 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from metronome.cli.serve_cli import EXIT_MARGIN_S, EXIT_PARTS_S

# a process that starts a child with a grandchild (as the server starts vLLM's EngineCore, which starts its
# workers), then arms the exit timer and hangs (as an engine whose shutdown waits)
HANGS = textwrap.dedent("""
    import subprocess, sys, time
    from metronome.cli.serve_cli import _exit_timer
    subprocess.Popen(["sh", "-c", "sleep {mark} & sleep {mark}; wait"], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)  # (not this process's pipes: the test reads them to their end)
    time.sleep(0.5)  # (the grandchild started)
    _exit_timer(0.5, lambda: {drained}).start()
    print("armed", flush=True)
    time.sleep(600)
""")


def _ours(mark: str) -> list[int]:
    """The processes whose command line carries ``mark`` (this test's own sleeps)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("drained, code", [(True, 0), (False, 1)])
def test_the_exit_timer_kills_what_the_server_started_and_exits(drained, code):
    mark = f"600.{uuid.uuid4().int % 10**9}"  # (a sleep of 600.x seconds: this test's alone)
    p = subprocess.Popen([sys.executable, "-c", HANGS.format(mark=mark, drained=drained)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "armed"
        assert len(_ours(mark)) >= 2  # the shell and its sleeps, started and running
        rc = p.wait(timeout=60)  # (a cap: the timer fires half a second after it is armed)
        assert rc == code, p.stderr.read()
        assert "still running" in p.stderr.read()
        for _ in range(250):  # (killed and reaped by the timer; a cap on the look, not a timing)
            if not _ours(mark):
                break
            time.sleep(0.02)
        assert not _ours(mark), "the server's children outlived it"
    finally:
        for pid in _ours(mark):  # (a failed check leaves nothing of this test behind)
            os.kill(pid, 9)
        if p.poll() is None:
            p.kill()


def test_the_exit_margin_is_its_parts_and_at_most_5_s():
    from metronome.serve.transport import KICK_GRACE_S

    assert EXIT_MARGIN_S == sum(EXIT_PARTS_S.values()) <= 5.0
    assert EXIT_PARTS_S["clients"] > KICK_GRACE_S  # the sessions closed at the drain's end get their reset
