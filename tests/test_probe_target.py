"""``metronome-probe run --target ws://…`` without a server: the flags that belong to the server are refused, a
target that is not a WebSocket URL or does not answer is one line and exit 2, and nothing is written. The client
needs no vLLM (it runs where the engine does not). The run against a real server is tests/live/test_serve.py's."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from metronome.errors import MetronomeError
from metronome.probe.ws_client import endpoints, read_metrics

NO_VLLM = "import sys; sys.modules['vllm'] = None; from metronome.cli.probe_cli import main; sys.exit(main())"
WORKLOAD = ["--arrival-rate", "1", "--session-duration", "3", "--horizon", "4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-c", NO_VLLM, "run", *args, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--target", "ws://127.0.0.1:9", "--admission", "aimd"], "--admission is the server's with --target"),
    (["--target", "ws://127.0.0.1:9", "--model", "tiny"], "--model is the server's with --target"),
    (["--target", "ws://127.0.0.1:9", "--num-blocks", "64"], "--num-blocks is the server's with --target"),
    (["--target", "ws://127.0.0.1:9", "--loop", "vllm"], "--loop is the server's with --target"),
    (["--target", "http://127.0.0.1:9"], "--target must be ws://HOST:PORT"),
    (["--target", "ws://127.0.0.1:notaport"], "the port is not a number"),
    (["--target", "ws://127.0.0.1:9", "--poll", "0"], "--poll must be positive seconds"),
    (["--target", "ws://127.0.0.1:9", "--calibration", "no-such-calibration"], "no-such-calibration"),
    (["--model", "tiny", "--calibration", "moshi-7b-h200"], "--calibration needs --target"),
])
def test_bad_target_flags_are_one_line_and_exit_2(tmp_path, args, needle):
    r = _run(tmp_path, *args, *WORKLOAD)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_target_that_does_not_answer_is_one_line_and_nothing_is_written(tmp_path):
    """Nothing listens on the port: the run says so before any folder is made (and vLLM is not needed)."""
    r = _run(tmp_path, "--target", f"ws://127.0.0.1:{_free_port()}", *WORKLOAD)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "cannot reach http://127.0.0.1:" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_the_target_names_the_sessions_socket_and_the_servers_metrics():
    assert endpoints("ws://h:8000") == ("ws://h:8000/v1/realtime", "http://h:8000/metrics")
    assert endpoints("wss://h:443/") == ("wss://h:443/v1/realtime", "https://h:443/metrics")
    assert endpoints("ws://h:8000/other?x=1") == ("ws://h:8000/other?x=1", "http://h:8000/metrics")
    with pytest.raises(MetronomeError):
        endpoints("h:8000")


def test_the_servers_series_are_read_from_its_metrics_text():
    text = "\n".join([
        "# HELP metronome_admission_limit Admission controller's session limit",
        "metronome_admission_limit 7.0",
        "metronome_admission_limit_other 99",  # another series whose name starts the same: not it
        "metronome_sessions_active 3.0",
        'metronome_sessions_refused_total{reason="refused"} 4.0',
        "vllm:num_requests_running 3.0",
    ])
    assert read_metrics(text) == {"limit": 7.0, "active": 3.0, "p99": None, "usage": None}
