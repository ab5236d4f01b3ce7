"""``metronome-serve``'s bad flags: one line on stderr and exit 2, before any engine starts (no vLLM needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "metronome.cli.serve_cli", *args], capture_output=True, text=True,
                          timeout=120)


def _held_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


HELD = _held_port()


@pytest.mark.parametrize("args, says", [
    (["--model", "tiny", "--port", "0"], "--port must be in 1..65535"),
    (["--model", "tiny", "--port", str(HELD.getsockname()[1]), "--host", "127.0.0.1"], "is not available"),
    (["--model", "tiny", "--drain-timeout", "-1"], "--drain-timeout must be positive"),
    (["--model", "tiny", "--admission", "aimd", "--queue-timeout", "-1"], "--queue-timeout must be >= 0"),
    (["--model", "tiny", "--queue-timeout", "nan"], "--queue-timeout: cannot read 'nan'"),
    (["--model", "tiny", "--max-message-bytes", "10"], "--max-message-bytes must be at least 256"),
    (["--model", "tiny", "--admission", "static:0"], "static"),
    (["--model", "tiny", "--kv", "sinks", "--window", "128"], "sinks"),
    (["--model", "tiny", "--api-key", " "], "--api-key is empty"),
    (["--model", "tiny", "--no-such-flag"], "unrecognized arguments"),
    (["--model", "tiny", "--engine-cpus", "1-x"], "not a CPU list"),
    (["--model", "tiny", "--engine-cpus", "4096"], "CPU 4096 is not one this process may use"),
    (["--model", "tiny", "--engine-cpus", ",".join(map(str, sorted(os.sched_getaffinity(0))))],
     "takes every CPU this process may use"),
    (["--model", "tiny", "--engine-cpus", "0", "--device", "cuda"], "not with --device cuda"),
    ([], "--model"),
])
def test_a_bad_flag_is_one_line_and_exit_2(args, says):
    r = _serve(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metronome-serve: error: ") and says in lines[0], r.stderr
