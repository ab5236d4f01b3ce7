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
    (["--model", "tiny", "--idle-timeout", "0"], "--idle-timeout must be positive"),
    (["--model", "tiny", "--stall-timeout=-5s"], "--stall-timeout must be positive"),
    (["--model", "tiny", "--headers-timeout", "0ms"], "--headers-timeout must be positive"),
    (["--model", "tiny", "--headers-timeout", "inf"], "--headers-timeout: cannot read 'inf'"),
    (["--model", "tiny", "--idle-timeout", "soon"], "--idle-timeout: cannot read 'soon'"),
    (["--model", "tiny", "--calibrate-first"], "--calibrate-first writes the calibration to DIR/calibration: give "
                                                "--out DIR"),
    (["--model", "tiny", "--calibrate-first", "slow", "--out", "x"], "argument --calibrate-first: invalid choice"),
    (["--model", "tiny", "--calibrate-first", "--calibration", "moshi-7b-h200"], "give one of them"),
    (["--model", "tiny", "--calibration", "/no/such/cal.json"], "no such calibration file"),
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


def test_the_timeouts_take_their_units_and_default_to_the_servers_constants():
    from metronome.cli.serve_cli import parser
    from metronome.serve import app, transport

    a = parser().parse_args(["--model", "tiny", "--idle-timeout", "2min", "--stall-timeout", "500ms",
                             "--headers-timeout", "3"])
    assert (a.idle_timeout, a.stall_timeout, a.headers_timeout) == (120.0, 0.5, 3.0)
    d = parser().parse_args(["--model", "tiny"])
    assert (d.idle_timeout, d.stall_timeout, d.headers_timeout) == (app.IDLE_S, app.STALL_S,
                                                                      transport.HEADERS_TIMEOUT_S)
    assert d.calibrate_first is None and parser().parse_args(["--model", "tiny", "--calibrate-first"]).calibrate_first \
        == "full"


def test_the_servers_n_star_is_metronome_sim_capacitys_under_its_policy_deadline_and_target(tmp_path):
    """``--calibration``/``--calibrate-first``'s N*: the core's capacity on that calibration, under the server's KV
    policy, its deadline and the latency target its controller steers by (--aimd-params), the figure
    ``metronome-sim capacity`` prints for the same settings; written beside the calibration."""
    import json

    from metronome import calibration
    from metronome.cli.serve_cli import _n_star
    from metronome.kv_policy import make_policy

    cal = calibration.load("moshi-7b-h200")
    policy = make_policy("sinks", cal.engine.block_size_tokens, sinks=16, window=368)
    res = _n_star(cal, None, None, tmp_path, policy, 0.08, {"target_fraction": 0.5, "percentile": 95.0})
    assert res["policy"] == "sinks(S=16, W=368)" and res["phases"] == "independent"
    assert res["target_latency_s"] == pytest.approx(0.04) and res["percentile"] == 95.0
    assert json.loads((tmp_path / "capacity.json").read_text()) == res
    r = subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", "capacity", "--calibration", "moshi-7b-h200",
                        "--kv", "sinks", "--sinks", "16", "--window", "368", "--deadline", "80ms",
                        "--target-fraction", "0.5", "--percentile", "95"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert f"N* = {res['n_star']} sessions" in r.stdout, r.stdout
