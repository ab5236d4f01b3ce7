"""``metronome-serve``'s app under uvicorn on 127.0.0.1, over a real gateway on the fake engine (no vLLM), and raw
socket clients: what a hostile or vanishing client does to the server, seen from outside (HTTP answers, events,
close codes) and from the server's own state (its gateway's sessions, the app's clients, the accounts).

Every wait here is bounded in count and time, and none is a horizon: each polls for the state it wants and gives
up after a generous cap.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

from fake_engine import FakeEngine

from metronome.admission import StaticCap
from metronome.calibration import TokenStream
from metronome.probe.driver import DriverConfig
from metronome.probe.metrics import LiveMetrics
from metronome.serve.app import ServeState, make_app, server_config
from metronome.serve.gateway import Gateway

STREAM = TokenStream(0.05, 4, 2)
P, N_IN = STREAM.frame_period_s, STREAM.input_tokens_per_frame
VOCAB = 5000
WAIT_S = 30.0  # the cap on any wait for the server's state: generous, for a busy machine


def wait_for(pred, cap_s: float = WAIT_S, step_s: float = 0.02) -> bool:
    """Poll ``pred`` until it holds, at most ``cap_s`` (bounded: a count of polls)."""
    for _ in range(int(cap_s / step_s) + 1):
        if pred():
            return True
        time.sleep(step_s)
    return bool(pred())


class Served:
    """The app on uvicorn in a thread of its own (its own event loop), the gateway on another; ``stop()`` ends
    both. ``cap``: the admission gate's static limit; ``gateway=False``: a server still starting."""

    def __init__(self, cap: int = 32, api_key: str | None = None, max_message_bytes: int = 65536,
                 gateway: bool = True, engine=None, deadline_s: float = P, stall_s: float = 5.0,
                 idle_s: float = 60.0, headers_timeout_s: float | None = None):
        import uvicorn

        self.metrics = LiveMetrics(None)
        self.engine = engine or FakeEngine(num_blocks=1024, block_size=16)
        cfg = DriverConfig(stream=STREAM, horizon_s=math.inf, phases="independent", deadline_s=deadline_s)
        self.gateway = Gateway(self.engine, cfg, admission=StaticCap(cap), silence_token=1, metrics=self.metrics)
        self.gw_thread = threading.Thread(target=self.gateway.serve, daemon=True)
        self.gw_thread.start()
        self.state = ServeState(api_key=api_key, vocab_size=VOCAB, metrics=self.metrics,
                                gateway=self.gateway if gateway else None, stall_s=stall_s, idle_s=idle_s)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(server_config(make_app(self.state), "127.0.0.1", self.port, max_message_bytes,
                                                   headers_timeout_s=headers_timeout_s))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_for(lambda: self.server.started):
            raise RuntimeError("uvicorn did not start")
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"

    def sessions(self) -> int:
        """Sessions the server holds anywhere: in the gateway (admitted or at its gate) or in the app."""
        return len(self.gateway.clients) + len(self.state.clients)

    def stop(self) -> None:
        """The gateway first (it tells its clients on the app's loop), then the app."""
        self.gateway.stop()
        self.gw_thread.join(WAIT_S)
        self.server.should_exit = True
        self.thread.join(WAIT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- raw clients ------------------------------------------------------------------------------------------------------
def upgrade(port: int, headers: dict | None = None) -> bytes:
    """The opening handshake's request, as a client library writes it."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET /v1/realtime HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def frame(payload: bytes | str, opcode: int = 1, fin: bool = True) -> bytes:
    """One masked client frame (RFC 6455: a client masks every frame)."""
    data = payload.encode() if isinstance(payload, str) else payload
    mask = os.urandom(4)
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(data)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    return head + mask + bytes(b ^ mask[k % 4] for k, b in enumerate(data))


def event(ev: dict) -> bytes:
    return frame(json.dumps(ev))


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return s


def reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed client's kernel does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """The handshake's HTTP answer: status, headers (lower-case names), and what came after it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        if not got:
            break
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


class Frames:
    """A raw client's reader of server frames (unmasked): text events as dicts, and the close frame's code."""

    def __init__(self, s: socket.socket, rest: bytes = b""):
        self.s, self.buf = s, rest
        self.close_code: int | None = None
        self.eof = False

    def _fill(self) -> bool:
        try:
            got = self.s.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            got = b""
        if not got:
            self.eof = True
            return False
        self.buf += got
        return True

    def next(self):
        """The next event (a dict), ``("close", code)``, or None at the end of the stream."""
        while True:
            if len(self.buf) >= 2:
                op, n = self.buf[0] & 0x0F, self.buf[1] & 0x7F
                k = 2
                if n == 126 and len(self.buf) >= 4:
                    n, k = struct.unpack("!H", self.buf[2:4])[0], 4
                elif n == 127 and len(self.buf) >= 10:
                    n, k = struct.unpack("!Q", self.buf[2:10])[0], 10
                if (n < 126 or k > 2) and len(self.buf) >= k + n:
                    data, self.buf = self.buf[k:k + n], self.buf[k + n:]
                    if op == 8:
                        self.close_code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else 1005
                        return ("close", self.close_code)
                    if op == 1:
                        return json.loads(data)
                    continue  # (a ping, a pong: not events)
            if self.eof or not self._fill():
                return None

    def until(self, pred, cap: int = 10_000):
        """Events up to and including the first for which ``pred`` holds (at most ``cap`` events)."""
        out = []
        for _ in range(cap):
            ev = self.next()
            if ev is None:
                break
            out.append(ev)
            if pred(ev):
                break
        return out


def open_session(port: int, headers: dict | None = None) -> tuple[socket.socket, Frames, dict]:
    """A raw client admitted: the socket, its reader, and ``session.created``."""
    s = connect(port)
    s.sendall(upgrade(port, headers))
    status, _, rest = read_response(s)
    assert status == 101, status
    r = Frames(s, rest)
    created = r.next()
    assert isinstance(created, dict) and created["type"] == "session.created", created
    return s, r, created


async def real_client(url: str, frames: int = 5, n: int = N_IN) -> tuple[dict, list]:
    """A well-behaved client (the ``websockets`` library): ``session.created``, then ``frames`` input frames, one a
    period, until each is answered (bounded by a count of events)."""
    from websockets.asyncio.client import connect as ws_connect

    async with ws_connect(url, open_timeout=WAIT_S) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        answered = []
        for k in range(frames):
            await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [100 + k] * n}))
            await asyncio.sleep(P)
        for _ in range(100 * frames):
            if len(answered) == frames:
                break
            ev = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            if ev["type"] == "response.frame" and ev["input"] is not None:
                answered.append(ev["input"])
        return created, answered


def vanish(port: int, how: str) -> None:
    """One client that leaves around the opening handshake, ``how``: ``rst`` (a reset right after the upgrade
    request), ``fin`` (a close right after it), ``half`` (half the request, then a reset), ``midframe`` (the
    answer read, half an input frame sent, then a reset)."""
    s = connect(port)
    req = upgrade(port)
    if how == "half":
        s.sendall(req[: len(req) // 2])
        reset(s)
        return
    s.sendall(req)
    if how == "rst":
        reset(s)
    elif how == "fin":
        s.shutdown(socket.SHUT_RDWR)
        s.close()
    elif how == "midframe":
        status, _, _ = read_response(s)
        f = event({"type": "input_tokens.append", "token_ids": [7] * N_IN})
        s.sendall(f[: len(f) // 2])
        reset(s)


# -- hostile messages ------------------------------------------------------------------------------------------------
DEEP = "[" * 1100 + "]" * 1100
HOSTILE = [  # (message, the error event's code)
    (json.dumps({"type": "session.update", "session": {"deadline_s": 10 ** 400}}), "number_out_of_range"),
    ('{"type": "input_tokens.append", "token_ids": ' + DEEP + "}", "too_deep"),
    (DEEP, "too_deep"),
    ('{"type": "x", "v": ' + "[" * 9 + "]" * 9 + "}", "too_deep"),  # (past the stated limit, well within Python's)
    ('{"type": "session.update", "session": {"deadline_s": 1e400}}', "number_out_of_range"),
    ('{"type": "session.update", "session": {"deadline_s": NaN}}', "number_out_of_range"),
    ('{"type": "input_tokens.append", "token_ids": [-Infinity]}', "number_out_of_range"),
    ('{"type": "input_tokens.append", "token_ids": [' + "9" * 5000 + "]}", "number_out_of_range"),
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
]


def http_get(port: int, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """GET ``path`` of the server on 127.0.0.1:``port``: (status, body), an HTTP error's too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus series' samples on ``/metrics`` (all label sets)."""
    _, text = http_get(port, "/metrics")
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or
               ln.startswith(name + "{"))
