"""The web side of ``metronome-serve``: FastAPI on uvicorn, the protocol of docs/serve.md.

``GET /v1/realtime`` is a WebSocket; its upgrade is decided before it is accepted, so that a load balancer sees a
refusal as what it is: 401 without the bearer token (``--api-key``), 503 with ``Retry-After`` while the server
starts or drains, or when the admission gate (the core's controller, fed by the frame latencies the gateway
measures) refuses the session. An admitted session is one streaming request in vLLM, served by the gateway
(:mod:`metronome.serve.gateway`) on its own frame clock; its client sends one input frame per
``input_tokens.append`` and gets one ``response.frame`` per frame of its clock. Bad input gets an ``error`` event
and the session goes on (JSON is parsed within limits: :func:`parse_event`); a message over the size cap closes
that socket with 1009 before it is parsed (uvicorn's ``ws_max_size``). Everything a client can make the server
hold is bounded per client, and a client past a bound is closed with 1008 (docs/serve.md, "Limits and bad
input"). However a client leaves, its admitted session ends and its accounts are written (:func:`_session`).

``/health`` answers while the process lives, ``/ready`` only while sessions are taken (not while the engine starts
or the server drains), ``/metrics`` is Prometheus' text (the gateway's series, then vLLM's own ``vllm:*`` series and
the process's; no session content). ``/`` is a status page drawn from ``/status.json`` (:mod:`metronome.serve.status`:
the last ten minutes of sessions, the admission limit and the p99 frame latency). Like vLLM's server, only the
WebSocket asks for ``--api-key``: the operations routes carry no session content and stay open to probes and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import math
import queue
from collections import deque
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from fastapi import FastAPI, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.websockets import WebSocketDisconnect

from metronome.serve import status as status_page
from metronome.serve.gateway import Client, Gateway

ERROR_TYPES = {"invalid_request_error", "server_error"}
SCOPE_KEY = "metronome.protocol"  # a WebSocket's protocol in its ASGI scope (metronome.serve.transport's)
SHUTDOWN_GRACE_S = 5.0  # after the drain, uvicorn's wait for connections still open
IDLE_S = 60.0  # seconds a session's client may send nothing before it is closed
STALL_S = 5.0  # seconds a client's socket may take nothing (its buffers full) before it is closed
ACCOUNTS_KEPT = 1000  # ended sessions' rows the server keeps in memory (all go to the journal)
BUFFERED_BYTES_MAX = 1 << 20  # more than a socket's buffers hold (metronome.serve.transport bounds them)
ERRORS_IN_A_ROW = 64  # messages in a row that each earn an error: past them, the client is closed (1008)
MAX_DEPTH = 8  # arrays and objects a client event may nest (the protocol's own need 2)
MAX_INT_DIGITS = 18  # an integer's digits (int64's range: token ids, frame counts)
log = logging.getLogger("metronome.serve")


@dataclass
class ServeState:
    """What the app and the CLI share: the gateway (None while the engine starts), the settings, the clients."""

    api_key: str | None = None
    drain_timeout_s: float = 30.0
    retry_after_s: int = 1
    vocab_size: int = 1000
    gateway: Gateway | None = None
    draining: bool = False
    clients: set = field(default_factory=set)
    metrics: object | None = None  # LiveMetrics
    engine_registry: object | None = None  # the registry vLLM's own series are in (the CLI's, once it started)
    status: status_page.StatusHistory = field(default_factory=status_page.StatusHistory)
    # the last ended sessions' rows (sent = answered + counted), newest last; all of them go to on_account
    accounts: deque = field(default_factory=lambda: deque(maxlen=ACCOUNTS_KEPT))
    stall_s: float = STALL_S  # a client whose socket takes nothing for this long is closed (not_reading)
    idle_s: float = IDLE_S  # a client that sends nothing for this long is closed (idle)
    on_account: object | None = None  # called with each row (the CLI journals them)
    # what the server runs, told each session in session.created (a client that plans or re-simulates the same
    # workload needs it: metronome-probe run --target): the admission spec, the KV policy's options, the pool
    server: dict = field(default_factory=dict)
    # the model's tokenizer (a Hugging Face one, from the checkpoint), or None: a model without one takes token ids
    # only (input_text.append is refused) and answers without text
    tokenizer: object | None = None
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def ready(self) -> bool:
        return self.gateway is not None and self.gateway.serving and not self.draining

    def shape(self) -> dict:
        """The server's stream shape: every session's until its ``session.update``."""
        c = self.gateway.cfg
        st = c.stream
        return {"frame_period_s": st.frame_period_s, "deadline_s": c.deadline,
                "input_tokens_per_frame": st.input_tokens_per_frame,
                "output_tokens_per_frame": st.output_tokens_per_frame}

    def shape_limits(self) -> dict:
        """What a session may ask for, each [low, high]. No session may cost more than the server's shape, which is
        what the admission signal was measured on: a period no shorter, no more tokens a frame (a slower stream or a
        smaller frame costs less). Ten periods bound how slow a stream, and how long a deadline, may be (a frame
        still owed holds its account open until its deadline)."""
        sh = self.shape()
        P = sh["frame_period_s"]
        return {"frame_period_s": [P, 10 * P], "deadline_s": [0.001, 10 * P],
                "input_tokens_per_frame": [1, sh["input_tokens_per_frame"]],
                "output_tokens_per_frame": [1, sh["output_tokens_per_frame"]]}

    def session_info(self, shape: dict | None = None) -> dict:
        return {**(shape or self.shape()), "vocab_size": self.vocab_size, "text": self.tokenizer is not None,
                "limits": self.shape_limits(), "server": self.server}


def server_config(app, host: str, port: int, max_message_bytes: int, log_level: str = "warning",
                  headers_timeout_s: float | None = None, shutdown_grace_s: float = SHUTDOWN_GRACE_S):
    """uvicorn's settings for the app: the CLI's and the tests' (one place, so that a test serves what users run).
    The protocols are uvicorn's (httptools, and the sans-I/O WebSocket over ``websockets``) with the changes of
    :mod:`metronome.serve.transport`; ``max_message_bytes``: a longer message closes its socket with 1009 before it
    is parsed."""
    import uvicorn

    from metronome.serve import transport
    from metronome.serve.transport import HttpProtocol, WebSocketProtocol

    # (lifespan "on": the app's lifespan runs the status page's sampler)
    # (timeout_graceful_shutdown: after the drain, uvicorn waits at most this long for connections still open,
    # e.g. one whose client reads nothing, before it stops: the drain closed every session already)
    http = HttpProtocol
    if headers_timeout_s is not None:
        http = type("HttpProtocol", (HttpProtocol,), {"headers_timeout_s": float(headers_timeout_s)})
    return uvicorn.Config(app, host=host, port=port, http=http, ws=WebSocketProtocol,
                          ws_max_size=max_message_bytes, ws_ping_interval=transport.PING_S,
                          ws_ping_timeout=transport.PING_S, lifespan="on", log_level=log_level,
                          timeout_graceful_shutdown=shutdown_grace_s)


def error_event(code: str, message: str, type_: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": type_, "code": code, "message": message}}


def make_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        """The status page's sampler runs while the app does (uvicorn's lifespan, or a TestClient's ``with``)."""
        task = asyncio.create_task(state.status.run(state))
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    # (FastAPI reads the handlers' annotations by name: WebSocket must be a module global)
    app = FastAPI(title="metronome-serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.get("/")
    async def page():
        return HTMLResponse(status_page.PAGE)

    @app.get("/status.json")
    async def status():
        return JSONResponse(state.status.report(state), headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health():
        if state.gateway is not None and state.gateway.error is not None:  # alive, but serving nobody: restart it
            return JSONResponse({"status": "error"}, status_code=503)  # (why: the server's log, not a probe's)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready:
            return {"status": "ready"}
        return JSONResponse({"status": "draining" if state.draining else "starting"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if state.metrics is None:
            return PlainTextResponse("", status_code=503)
        # Two registries, one text: the exposition format is a sequence of families, and the names cannot clash
        # (the gateway's are metronome_*, vLLM's vllm:*, and prometheus_client's own process_* and python_*).
        body = generate_latest(state.metrics.registry)
        if state.engine_registry is not None:
            body += generate_latest(state.engine_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def deny(ws: WebSocket, status: int, code: str, message: str, reason: str | None) -> None:
        """Refuse the upgrade; ``reason``: counted here (the gate's refusals are counted where it decides)."""
        headers = {"Retry-After": str(state.retry_after_s)} if status == 503 else {}
        if state.metrics is not None and reason is not None:
            state.metrics.refused_for(reason)
        await ws.send_denial_response(JSONResponse(error_event(code, message), status_code=status, headers=headers))

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        if state.api_key is not None:
            got = ws.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
                await deny(ws, 401, "invalid_api_key", "a bearer token is required", "unauthorized")
                return
        if not state.ready:
            await deny(ws, 503, "not_ready", "the server is starting or draining", "draining" if state.draining
                       else "starting")
            return
        await _session(state, ws, Client(f"c{next(state._ids)}", asyncio.get_running_loop()), deny)

    return app


async def _session(state: ServeState, ws: WebSocket, client: Client, deny) -> None:
    """A client at the gate, then its session: admission, accept and the session's life in one ``try``, so that
    however the client leaves (before its socket is accepted, during the handshake, mid-frame, by a reset) or the
    handler ends (cancelled), the gateway hears that it left, and an admitted session's accounts settle and are
    written, exactly once.

    While it waits at the gate the client is watched: one that leaves then leaves the gate's queue (or, admitted
    meanwhile, its session) at once. A message that came before the socket was accepted (in the same TCP write as
    the upgrade) is kept and handled first, as if it came after."""
    state.gateway.open(client)
    sender, watch = None, None
    try:
        await ws.receive()  # (the ASGI connect event: always first)
        watch = asyncio.ensure_future(ws.receive())  # (the client's first message, or its leaving)
        await asyncio.wait({watch, client.decision}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and watch.result()["type"] == "websocket.disconnect":
            return  # gone before (or as) the gate decided
        if await client.decision != "admit":
            await deny(ws, 503, "session_refused", f"admission: {client.decision.result()}", None)
            return
        await ws.accept()
        state.clients.add(client)
        proto = ws.scope.get(SCOPE_KEY)  # (uvicorn's protocol, as metronome.serve.transport runs it)

        def kick(code: int, reason: str) -> None:
            log.warning("%s: closed with %d: %s", client.sid, code, reason)
            if proto is not None:
                proto.kick(code, reason)

        client.kick = kick if proto is not None else None
        client.on_limit = lambda reason: kick(1008, reason)
        if proto is not None:
            proto.on_unresponsive = client.past_limit
        sender = asyncio.create_task(_send(ws, client, state.tokenizer, state.stall_s, proto))
        client.shape = state.shape()
        await ws.send_text(json.dumps({"type": "session.created",
                                       "session": {"id": client.sid, **state.session_info(client.shape)}}))
        while True:
            if watch is None:
                watch = asyncio.ensure_future(ws.receive())
            await asyncio.wait({watch}, timeout=state.idle_s)  # (a message, from before the accept or after it)
            if not watch.done():
                client.past_limit("idle")
                if proto is not None:  # (kicked: the receive hears the disconnect)
                    await asyncio.wait({watch}, timeout=state.stall_s)
                if not watch.done():
                    with suppress(Exception):
                        await asyncio.wait_for(ws.close(1008), state.stall_s)
                    break
            msg, watch = watch.result(), None
            if msg["type"] == "websocket.disconnect":
                break
            text = msg.get("text")
            if text is None:
                client.say(error_event("invalid_event", "events are JSON text frames"))
            else:
                _handle(state, client, text)
            if client.closed is not None and proto is None:  # (kicked: the protocol ends the receive itself)
                with suppress(Exception):
                    await asyncio.wait_for(ws.close(1008), state.stall_s)
                break
    except (WebSocketDisconnect, OSError, RuntimeError):  # (gone; RuntimeError: the sender closed the socket)
        pass
    finally:
        if watch is not None:
            watch.cancel()
        state.gateway.close(client)  # (at the gate: it leaves the queue; admitted: its session ends)
        if sender is not None:  # (stopped before the accounts settle: an answer it held is counted by then)
            sender.cancel()
            await asyncio.wait({sender})
        client.socket_done()
        state.clients.discard(client)
        if not client.decision.done() or client.decision.result() == "admit":  # (undecided: it may be admitted)
            await client.final.wait()  # (the gateway decides before it is done with a client)
            if client.decision.result() == "admit":
                _account(state, client)


async def _send(ws, client: Client, tokenizer=None, stall_s: float = math.inf, proto=None) -> None:
    """The client's send queue, in order; a close request closes the socket (the drain, a server-side end). With a
    tokenizer, each frame's tokens are decoded here, on the app's loop, not in the gateway's turn: a frame's text is
    its tokens alone (a character split across two frames shows as a replacement character in each).

    A socket that takes nothing for ``stall_s`` (its buffers full: the client does not read) closes the session
    (``not_reading``, 1008), and what it was not given is counted ``undelivered``: the message that could not be
    sent, what waits behind it, and the answers still in the socket's buffers, unacknowledged by the client (``proto``
    says how many bytes; the answers sent last, that many bytes back, were not delivered). A close that cannot be
    sent for as long is forced."""
    sent, total = deque(), 0  # (end of each recent answer in the bytes written, total written)
    answer = False  # the message taken from the queue is an answer not yet written
    try:
        while True:
            answer = False
            m = await client.out.get()
            if isinstance(m, tuple):
                try:
                    await asyncio.wait_for(ws.close(code=m[1]), stall_s)
                except TimeoutError:
                    if proto is not None:
                        proto.kick(m[1], "not_reading")
                return
            answer = m.get("type") == "response.frame" and m["input"] is not None
            if tokenizer is not None and m.get("type") == "response.frame" and m["token_ids"]:
                m["text"] = tokenizer.decode(m["token_ids"])
            text = json.dumps(m)
            try:
                await asyncio.wait_for(ws.send_text(text), stall_s)
            except TimeoutError:
                lost = _in_buffers(sent, total, proto.unsent_bytes() if proto is not None else 0)
                client.answered -= lost
                client.counted["undelivered"] += lost + answer
                client.past_limit("not_reading")
                return
            total += _frame_bytes(len(text.encode()))
            if answer:
                answer = False
                client.answered += 1
                sent.append(total)
            while sent and sent[0] <= total - BUFFERED_BYTES_MAX:  # (older ones left the buffers)
                sent.popleft()
    except (asyncio.CancelledError, Exception):  # cancelled, or the socket broke mid-send: the receiver sees it
        # an answer taken from the queue and not written (uvicorn writes at once after its only wait) is neither
        # answered nor, once out of the queue, counted when the accounts settle: counted here, as they would
        if answer:
            client.counted["undelivered" if client.closed is not None else "session_ended"] += 1
        return


def _in_buffers(sent, total: int, unsent: int) -> int:
    """Answers still in the socket's buffers: those that end within the last ``unsent`` of ``total`` bytes
    written (``sent``: where each recent answer ended)."""
    return sum(end > total - unsent for end in sent)


def _frame_bytes(n: int) -> int:
    """A server frame's bytes on the wire for a payload of ``n`` (RFC 6455: unmasked, its length in 1, 3 or 9
    bytes after the first)."""
    return n + (2 if n < 126 else 4 if n < 1 << 16 else 10)


class BadEvent(ValueError):
    """A client message the server will not take (``code``: the ``error`` event's)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _int(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_INT_DIGITS:
        raise BadEvent("number_out_of_range", f"an integer of {len(digits)} characters: at most {MAX_INT_DIGITS} "
                       "digits")
    return int(digits)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise BadEvent("number_out_of_range", f"{_show(text)} is not a finite number")
    return v


def _constant(name: str):
    raise BadEvent("number_out_of_range", f"{name} is not a JSON number")


def parse_event(text: str) -> dict:
    """A client's JSON text as an event, within the limits of docs/serve.md: at most :data:`MAX_DEPTH` arrays and
    objects deep, integers of at most :data:`MAX_INT_DIGITS` digits, finite numbers (no NaN or Infinity); an
    object with a string ``type``. Anything else raises :class:`BadEvent`, never another exception."""
    try:
        ev = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except BadEvent:
        raise
    except RecursionError:  # (the parser's own recursion, past the interpreter's limit: far past ours)
        raise BadEvent("too_deep", f"nested deeper than {MAX_DEPTH} arrays and objects") from None
    except ValueError as exc:
        raise BadEvent("invalid_json", f"not JSON: {_cut(str(exc))}") from None
    if _depth(ev) > MAX_DEPTH:
        raise BadEvent("too_deep", f"nested deeper than {MAX_DEPTH} arrays and objects")
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
        raise BadEvent("invalid_event", "an event is a JSON object with a string 'type'")
    return ev


def _depth(v) -> int:
    """How deep arrays and objects nest in ``v`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        items = x.values() if isinstance(x, dict) else x if isinstance(x, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        stack.extend((y, d + 1) for y in items if isinstance(y, (dict, list)))
    return deepest


def _show(v) -> str:
    """A client's value, as an error event or the log quotes it: its repr, cut short (a client's 60 KB string is
    not held again in each error it earns)."""
    return _cut(repr(v), 64)


def _cut(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _refuse_event(client: Client, code: str, message: str) -> None:
    """An ``error`` event for a message the server would not take, and one line in its log (no traceback: a client
    can send such messages as often as it likes)."""
    log.warning("%s: %s: %s", client.sid, code, message)
    client.say(error_event(code, message))


def _handle(state: ServeState, client: Client, text: str) -> None:
    """One client event: input frames go to the gateway's queue; anything wrong gets an ``error`` event, and the
    session goes on. Nothing a client sends raises here: a failure of the server's own (a bug) is an ``error`` of
    type ``server_error`` and one line in the log."""
    errors = client.errors
    try:
        _event(state, client, parse_event(text))
    except BadEvent as exc:
        _refuse_event(client, exc.code, str(exc))
    except Exception as exc:  # noqa: BLE001 (a bug must not end the session without a word: said, and logged)
        log.error("%s: a message failed: %s: %s", client.sid, type(exc).__name__, _cut(str(exc)))
        client.say(error_event("server_error", "the server failed on this message", "server_error"))
    client.bad_in_a_row = client.bad_in_a_row + 1 if client.errors > errors else 0
    if client.bad_in_a_row >= ERRORS_IN_A_ROW:
        client.past_limit("errors")


def _event(state: ServeState, client: Client, ev: dict) -> None:
    kind = ev["type"]
    if kind == "input_tokens.append":
        ids = ev.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            client.say(error_event("invalid_value", "token_ids must be a list of integers"))
            return
        if any(not 0 <= t < state.vocab_size for t in ids):
            client.say(error_event("invalid_value", f"token ids must be in [0, {state.vocab_size})"))
            return
        _input_frame(state, client, ids, "tokens")
    elif kind == "input_text.append":
        text = ev.get("text")
        if state.tokenizer is None:
            client.say(error_event("unsupported", "this server's model runs without a tokenizer: send "
                                              "input_tokens.append"))
        elif not isinstance(text, str):
            client.say(error_event("invalid_value", "text must be a string"))
        else:
            _input_frame(state, client, state.tokenizer.encode(text, add_special_tokens=False), "tokens of text")
    elif kind == "session.update":
        _session_update(state, client, ev.get("session"))
    else:
        client.say(error_event("unknown_event", f"unknown event type {_show(kind)}"))


def _session_update(state: ServeState, client: Client, asked) -> None:
    """A new stream shape for this session, within :meth:`ServeState.shape_limits`. It waits in the session's input
    queue behind the frames sent before it, and the gateway applies it at the session's first frame boundary with
    nothing owed (``FrontEnd.reshape``); ``session.updated`` says when. Input sent after it is held to the new
    shape. The other fields of ``session.created`` are what the server runs: not the session's to set."""
    if not isinstance(asked, dict):
        client.say(error_event("invalid_value", "session.update needs a 'session' object"))
        return
    limits = state.shape_limits()
    fixed = [k for k in asked if k not in limits]
    if fixed:
        client.say(error_event("invalid_value", f"cannot set {_cut(', '.join(sorted(fixed)))}: a "
                                          f"session sets only {', '.join(limits)}"))
        return
    now = client.shape or state.shape()
    shape = dict(now)
    for k, (lo, hi) in limits.items():
        if k not in asked:
            continue
        v = asked[k]
        whole = k.endswith("_per_frame")
        ok_type = isinstance(v, int) if whole else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok_type or not (lo <= v <= hi or math.isclose(v, lo) or math.isclose(v, hi)):
            kind = "an integer" if whole else "a number"
            client.say(error_event("invalid_value", f"{k} must be {kind} in [{lo:g}, {hi:g}], got "
                                              f"{_show(v)}"))
            return
        shape[k] = min(max(v, lo), hi)
    updated = {"type": "session.updated", "session": {"id": client.sid, **state.session_info(shape)}}
    if shape == now:
        client.say(updated)
        return
    try:
        client.inputs.put_nowait(("shape", shape, updated))
    except queue.Full:
        client.say(error_event("input_queue_full", f"more input waiting than {client.inputs.maxsize} "
                                          "frames; the session.update is dropped"))
        return
    client.shape = shape
    state.gateway.update_shape(client)


def _input_frame(state: ServeState, client: Client, ids: list[int], what: str) -> None:
    """One input frame of ``ids`` (a client's token ids, or its text's) for the gateway's queue: at most a frame's
    tokens (the session's shape, as last asked), a short frame padded with silence; every frame the client sent is
    queued, or counted and said why."""
    n = (client.shape or state.shape())["input_tokens_per_frame"]
    if len(ids) > n:
        client.say(error_event("frame_too_long", f"a frame carries at most {n} tokens, got {len(ids)} "
                                          f"{what}"))
        return
    ids = list(ids) + [state.gateway.silence_token] * (n - len(ids))
    seq = client.sent_in
    client.sent_in += 1
    if client.ended is not None:
        client.counted["session_ended"] += 1
        return
    try:
        client.inputs.put_nowait((seq, ids))
    except queue.Full:
        client.counted["input_queue_full"] += 1
        client.say(error_event("input_queue_full", f"frame {seq}: more input frames waiting than "
                                          f"{client.inputs.maxsize}; this one is dropped"))


def _account(state: ServeState, client: Client) -> None:
    row = client.accounts
    state.accounts.append(row)
    if state.metrics is not None:
        state.metrics.client_frames(row)
    if state.on_account is not None:
        state.on_account(row)


async def drain(state: ServeState) -> None:
    """SIGTERM: take no more sessions, tell each its time left, end them as their clients leave, close the rest
    with 1001 at the drain timeout, then stop the gateway (every session still in ends ``stopped``). The close at
    the timeout does not wait on the client: the close frame goes out behind what it has not read, and its
    connection is reset if it has not closed it a second later (``Client.kick``), so that a client that does not
    read holds neither the drain nor the server's exit."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.drain_timeout_s
    for c in list(state.clients):
        c.say({"type": "session.closing", "reason": "server_shutdown",
                          "seconds_left": round(state.drain_timeout_s, 3)})
    while state.clients and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for c in list(state.clients):
        if c.kick is not None:
            c.kick(1001, "drain_timeout")
        else:  # (an ASGI server without metronome.serve.transport's protocol: the sender closes it)
            c.out.put_nowait(("close", 1001))
    grace = loop.time() + 5.0
    while state.clients and loop.time() < grace:
        await asyncio.sleep(0.05)
    if state.gateway is not None:
        state.gateway.stop()
