"""docs/serve.md's client, run as written, ends cleanly however its session ends.

A user copies the "A client" block into a file and runs it. Here it runs in a subprocess against a small local
WebSocket server (the ``websockets`` package, no vLLM) that speaks the protocol of docs/serve.md and ends the
session as ``metronome-serve`` can: a drain (``session.closing``, then 1001 for a client that stays), a 1001 without
notice, a gateway failure (1011), a dropped connection (no close frame), a refusal at the door (503 with
``Retry-After``). The client must exit 0 with nothing on stderr (no traceback, no "Task exception was never
retrieved") and say what happened. tests/live/test_serve.py drains the real server under clients of its own.
"""

from __future__ import annotations

import asyncio
import http
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

websockets = pytest.importorskip("websockets", reason="the docs' client needs websockets (the live extras)")

DOC = Path(__file__).resolve().parents[1] / "docs" / "serve.md"
ANSWERED = 5  # the server ends the session after answering this many input frames
SECONDS_LEFT = 5


def docs_client() -> str:
    """The first python block under docs/serve.md's "## A client", as a user would copy it."""
    text = DOC.read_text()
    section = text[text.index("\n## A client\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class Server:
    """The protocol's server side, on its own thread and loop. The path picks how a session ends (after ANSWERED
    answers): ``/drain``, ``/1001``, ``/1011``, ``/drop``, ``/refuse`` (503 at the door), ``/full`` (never)."""

    def __init__(self):
        self.outcome: dict[str, str] = {}  # path -> how the session ended, seen from the server
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the test server did not start"

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self):
        from websockets.asyncio.server import serve

        self.stop = asyncio.Event()
        async with serve(self._session, "127.0.0.1", 0, process_request=self._door) as srv:
            self.port = srv.sockets[0].getsockname()[1]
            self.ready.set()
            await self.stop.wait()

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)

    @staticmethod
    def _door(connection, request):
        if request.path == "/refuse":
            r = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, '{"type": "error"}\n')
            r.headers["Retry-After"] = "3"
            return r
        return None

    async def _session(self, ws):
        mode = ws.request.path.strip("/")
        await ws.send(json.dumps({"type": "session.created", "session": {
            "id": "s1", "frame_period_s": 0.01, "deadline_s": 0.01, "input_tokens_per_frame": 2,
            "output_tokens_per_frame": 2, "vocab_size": 1000, "text": False}}))
        k = 0
        async for msg in ws:
            assert json.loads(msg)["type"] == "input_tokens.append"
            await ws.send(json.dumps({"type": "response.frame", "frame": k, "input": k, "token_ids": [11, 12],
                                      "text": None, "silent": False, "late": False, "latency_ms": 1.0}))
            k += 1
            if k == ANSWERED and mode != "full":
                await self._end(ws, mode)
                return
        self.outcome[mode] = "client closed"

    async def _end(self, ws, mode: str):
        if mode == "drain":  # as metronome-serve drains: notice first, 1001 for a session still open at the end
            await ws.send(json.dumps({"type": "session.closing", "reason": "draining",
                                      "seconds_left": SECONDS_LEFT}))

            async def until_closed():
                async for _ in ws:
                    pass

            try:
                await asyncio.wait_for(until_closed(), 5)
                self.outcome[mode] = "client left"
            except TimeoutError:
                await ws.close(1001, "server draining")
                self.outcome[mode] = "closed 1001"
        elif mode in ("1001", "1011"):
            await ws.close(int(mode))
            self.outcome[mode] = f"closed {mode}"
        elif mode == "drop":
            ws.transport.abort()
            self.outcome[mode] = "dropped"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "client.py"
    path.write_text(docs_client())
    return path


def run_client(client: Path, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(client), url], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode, says", [
    ("full", "50 of 50 frames answered"),
    ("drain", f"server closing (draining, {SECONDS_LEFT} s left): leaving"),
    ("1001", "closed by the server: 1001"),
    ("1011", "closed by the server: 1011"),
    ("drop", "closed by the server: no close frame"),
])
def test_the_docs_client_ends_cleanly_however_the_session_ends(server, client, mode, says):
    p = run_client(client, f"ws://127.0.0.1:{server.port}/{mode}")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert says in lines, p.stdout[-2000:]
    if mode != "full":  # every frame answered before the end was read and printed, then the count
        assert sum(ln.startswith(tuple(f"{k} [11, 12]" for k in range(ANSWERED))) for ln in lines) == ANSWERED
        assert lines[-1] == f"{ANSWERED} of 50 frames answered", p.stdout[-2000:]
    if mode == "drain":  # told the server drains, it left by itself, before the server's 1001
        assert server.outcome[mode] == "client left"


def test_a_refusal_at_the_door_is_one_line(server, client):
    p = run_client(client, f"ws://127.0.0.1:{server.port}/refuse")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    assert p.stdout.splitlines() == ["refused: HTTP 503, retry after 3 s"]
