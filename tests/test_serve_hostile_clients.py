"""``metronome-serve`` against clients that vanish, stall or send hostile input: the app under uvicorn on 127.0.0.1
over a real gateway on the fake engine (tests/serve_harness.py), driven by raw sockets, no vLLM. Each check reads
what a client sees (HTTP answers, events, close codes) and what the server holds (its gateway's sessions, the
app's clients, the accounts)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
import serve_harness as h

pytest.importorskip("uvicorn", reason="the server runs on uvicorn")
pytest.importorskip("websockets", reason="the protocol is websockets'")


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """A gateway's first run compiles the front end's kernels (numba) when the cache is cold: one session served
    first, with time to spare."""
    with h.Served(cap=4) as srv:
        asyncio.run(asyncio.wait_for(h.real_client(srv.url, frames=1), 600))


def test_clients_that_vanish_around_the_handshake_leave_no_session_and_a_real_client_is_admitted():
    """100 clients, each gone before its socket is accepted, during the handshake or mid-frame, against a gate of
    32: every session the gate admitted ends and has its accounts row, none is left in the gateway or the app,
    and a well-behaved client is admitted and served right after."""
    with h.Served(cap=32) as srv:
        hows = ["rst", "fin", "rst", "half", "midframe"]
        for k in range(100):
            h.vanish(srv.port, hows[k % len(hows)])
        assert h.wait_for(lambda: srv.sessions() == 0 and srv.gateway._in_flight() == 0), (
            len(srv.gateway.clients), len(srv.state.clients), srv.gateway._in_flight())
        admitted = srv.metrics.admitted._value.get()
        assert admitted >= 1  # (some were admitted before they left: the case that leaked)
        assert h.wait_for(lambda: len(srv.state.accounts) == admitted), (len(srv.state.accounts), admitted)
        for row in srv.state.accounts:
            assert row["sent"] == row["answered"] + row["counted"], row
        created, answered = asyncio.run(h.real_client(srv.url, frames=3))
        assert created["type"] == "session.created" and answered == [0, 1, 2]


def _input(k: int) -> bytes:
    return h.event({"type": "input_tokens.append", "token_ids": [100 + k] * h.N_IN})


def test_frames_in_the_same_write_as_the_upgrade_are_answered():
    """Three input frames sent in the same TCP write as the upgrade request: each is answered, and the session's
    accounts say three were sent."""
    with h.Served(cap=4) as srv:
        s = h.connect(srv.port)
        s.sendall(h.upgrade(srv.port) + b"".join(_input(k) for k in range(3)))
        status, _, rest = h.read_response(s)
        assert status == 101
        r = h.Frames(s, rest)
        events = r.until(lambda ev: isinstance(ev, dict) and ev.get("input") == 2, cap=500)
        answered = [ev["input"] for ev in events if isinstance(ev, dict) and ev.get("type") == "response.frame"
                    and ev["input"] is not None]
        s.close()
        assert answered == [0, 1, 2], events[:5]
        assert h.wait_for(lambda: len(srv.state.accounts) == 1)
        row = srv.state.accounts[0]
        assert row["sent"] == 3 and row["answered"] == 3, row


class _Lines(logging.Handler):
    """Every record the server logs (uvicorn's loggers do not propagate to the root: each is listened to)."""

    NAMES = ("", "uvicorn", "uvicorn.error", "metronome.serve")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if not any(r is record for r in self.records):  # (a record that propagates reaches two of them)
            self.records.append(record)

    def __enter__(self):
        for n in self.NAMES:
            logging.getLogger(n).addHandler(self)
        return self

    def __exit__(self, *exc):
        for n in self.NAMES:
            logging.getLogger(n).removeHandler(self)

    def lines(self) -> list[str]:
        """What the handlers write: a record with a traceback is many lines."""
        fmt = logging.Formatter("%(message)s")
        return [fmt.format(r) for r in self.records]


def test_hostile_json_gets_an_error_event_one_log_line_and_the_session_goes_on():
    """Each message past the parser's limits (a 400-digit integer, nesting 1,100 deep and past the stated 8, NaN,
    1e400, a 5,000-digit id) gets an ``error`` event with its code, is logged in one line without a traceback,
    and the session goes on: an input frame sent after them all is answered."""
    with h.Served(cap=4) as srv, _Lines() as log:
        s, r, _ = h.open_session(srv.port)
        codes = []
        for text, _code in h.HOSTILE:
            s.sendall(h.frame(text))
            evs = r.until(lambda ev: isinstance(ev, dict) and ev["type"] == "error" or not isinstance(ev, dict))
            assert evs and isinstance(evs[-1], dict), evs[-3:]  # (not a close: the session goes on)
            codes.append(evs[-1]["error"]["code"])
        s.sendall(_input(0))
        evs = r.until(lambda ev: not isinstance(ev, dict) or ev.get("input") == 0)
        assert isinstance(evs[-1], dict) and evs[-1]["input"] == 0
        s.close()
        assert h.wait_for(lambda: len(srv.state.accounts) == 1)
    assert codes == [code for _, code in h.HOSTILE]
    assert not any(rec.exc_info for rec in log.records), [rec.getMessage() for rec in log.records if rec.exc_info]
    said = [ln for ln in log.lines() if ln.startswith("c1: ")]
    assert len(said) == len(h.HOSTILE) and all("\n" not in ln and len(ln) < 400 for ln in said), said


def test_invalid_utf8_closes_with_1007_and_one_log_line():
    with h.Served(cap=4) as srv, _Lines() as log:
        s, r, _ = h.open_session(srv.port)
        s.sendall(h.frame(b'{"type": "\xff\xfe"}'))
        evs = r.until(lambda ev: not isinstance(ev, dict))
        s.close()
        assert evs[-1] == ("close", 1007), evs[-3:]
        assert h.wait_for(lambda: len(srv.state.accounts) == 1)
    assert not any(rec.exc_info for rec in log.records)
    said = [ln for ln in log.lines() if "1007" in ln]
    assert len(said) == 1 and "\n" not in said[0], said


def _flood(s: socket.socket, messages, cap: int) -> int:
    """Send ``messages`` (bytes) until the server resets the connection; how many went (at most ``cap``)."""
    sent = 0
    for m in messages:
        if sent >= cap:
            break
        try:
            s.sendall(m)
        except OSError:  # (reset, or a broken pipe: the server closed it)
            break
        sent += 1
    return sent


def test_a_client_that_floods_errors_without_reading_is_closed_with_1008_and_its_accounts_say_why():
    """1,000 unknown events of 60 KB, nothing read: the server holds a bounded number of small error events (the
    type is quoted cut short), closes the socket with 1008 once 64 messages in a row earned errors, and the
    session's accounts say so; nothing of the client is left."""
    with h.Served(cap=4) as srv:
        s, _, _ = h.open_session(srv.port)
        junk = h.event({"type": "x" * 60_000})
        sent = _flood(s, (junk for _ in range(1000)), 1000)
        assert sent < 1000  # (closed under the client: its sends failed)
        assert h.wait_for(lambda: len(srv.state.accounts) == 1 and srv.sessions() == 0)
        row = srv.state.accounts[0]
        assert row["closed"] == "errors" and row["sent"] == row["answered"] + row["counted"], row
        # what the client could still read: errors with the type cut short, then the close frame's 1008
        r = h.Frames(s)
        evs = r.until(lambda ev: not isinstance(ev, dict), cap=200)
        s.close()
        errors = [ev for ev in evs if isinstance(ev, dict) and ev.get("type") == "error"]  # (not the answers)
        assert errors and all(len(ev["error"]["message"]) < 200 for ev in errors)
        assert evs[-1] == ("close", 1008) or r.eof, evs[-1:]


def test_a_client_that_sends_without_reading_is_closed_and_its_unsent_answers_count_as_undelivered(monkeypatch):
    """Input frames one a period, nothing read, buffers held small: once its socket takes nothing for ``stall_s``
    the server closes it (``not_reading``), and what it could not send is counted ``undelivered``:
    sent = answered + counted."""
    from metronome.serve import transport

    monkeypatch.setattr(transport, "SEND_BUFFER_BYTES", 4096)
    with h.Served(cap=4, stall_s=0.5) as srv:
        s = h.connect(srv.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(h.upgrade(srv.port))
        assert h.read_response(s)[0] == 101

        for k in range(2000):  # one a period, as a client streams (about 150 frames fill the buffers)
            if srv.state.accounts:
                break
            try:
                s.sendall(_input(k))
            except OSError:  # (reset: the server closed it)
                break
            time.sleep(h.P)
        assert h.wait_for(lambda: len(srv.state.accounts) == 1 and srv.sessions() == 0)
        s.close()
        row = srv.state.accounts[0]
        assert row["closed"] == "not_reading", row
        assert row["counted_undelivered"] >= 1 and row["sent"] == row["answered"] + row["counted"], row


def test_a_client_that_never_answers_a_ping_is_closed_as_not_reading_with_1008(monkeypatch):
    """A client that streams input but reads nothing, its buffers far from full (small answers, a short run):
    its first ping goes unanswered, and at the ping's timeout it is closed with 1008 ``not_reading``, its accounts
    say why, and every answer the accounts call answered is one it can read (uvicorn alone failed such a
    connection with 1011, and the accounts called it a client that left)."""
    from metronome.serve import transport

    monkeypatch.setattr(transport, "PING_S", 0.5)
    with h.Served(cap=4, stall_s=3600.0) as srv:  # (only the ping may find it)
        s = h.connect(srv.port)
        s.sendall(h.upgrade(srv.port))
        assert h.read_response(s)[0] == 101
        for k in range(400):
            if srv.state.accounts:
                break
            try:
                s.sendall(_input(k))
            except OSError:
                break
            time.sleep(h.P)
        assert h.wait_for(lambda: len(srv.state.accounts) == 1 and srv.sessions() == 0)
        row = srv.state.accounts[0]
        assert row["closed"] == "not_reading", row
        assert row["sent"] == row["answered"] + row["counted"], row
        # what it can still read (its kernel took them: delivered, if late): the answers the accounts say were
        # answered, then the close frame's 1008
        r = h.Frames(s)
        evs = r.until(lambda ev: not isinstance(ev, dict), cap=2000)
        s.close()
        assert evs and evs[-1] == ("close", 1008), evs[-3:]
        got = sum(isinstance(ev, dict) and ev.get("type") == "response.frame" and ev["input"] is not None
                  for ev in evs)
        assert got == row["answered"], (got, row)


def test_the_drain_ends_a_client_that_does_not_read_and_the_server_stops(monkeypatch):
    """A client that stopped reading, its socket's buffers full, when the server drains: at the drain timeout its
    socket is closed at once (1001, then reset), not politely waited on, so the drain ends and uvicorn stops (it
    waits for every connection to close)."""
    from metronome.serve import transport
    from metronome.serve.app import drain

    monkeypatch.setattr(transport, "SEND_BUFFER_BYTES", 4096)
    srv = h.Served(cap=4, stall_s=3600.0)  # (only the drain may close it)
    try:
        s = h.connect(srv.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(h.upgrade(srv.port))
        assert h.read_response(s)[0] == 101
        assert h.wait_for(lambda: len(srv.state.clients) == 1)
        c = next(iter(srv.state.clients))
        assert h.wait_for(lambda: c.out.qsize() >= 3, cap_s=120)  # (its answers pile up: the sender is stuck)
        srv.state.drain_timeout_s = 0.2
        done = asyncio.run_coroutine_threadsafe(drain(srv.state), c.loop)
        done.result(h.WAIT_S)
        assert h.wait_for(lambda: srv.sessions() == 0) and len(srv.state.accounts) == 1
        srv.gw_thread.join(h.WAIT_S)
        srv.server.should_exit = True
        srv.thread.join(h.WAIT_S)
        assert not srv.thread.is_alive()  # uvicorn stopped: no connection held it
        s.close()
    finally:
        srv.stop()


def test_slow_headers_and_an_idle_session_are_closed():
    """A client that sends half its request headers, one that connects and sends nothing, and an admitted one that
    sends nothing: each is closed (the first two at the headers timeout; the third with 1008, its accounts saying
    ``idle``), and a client that keeps sending stays."""
    with h.Served(cap=4, idle_s=2.0, headers_timeout_s=0.5) as srv:
        half = h.connect(srv.port)
        half.sendall(h.upgrade(srv.port)[:40])
        silent = h.connect(srv.port)
        idle, r, _ = h.open_session(srv.port)
        for s in (half, silent):
            assert s.recv(1024) == b""  # (closed by the server: end of stream)
            s.close()
        evs = r.until(lambda ev: not isinstance(ev, dict), cap=5000)
        idle.close()
        assert evs[-1] == ("close", 1008), evs[-1:]
        assert h.wait_for(lambda: len(srv.state.accounts) == 1)
        assert srv.state.accounts[0]["closed"] == "idle"
        created, answered = asyncio.run(h.real_client(srv.url, frames=60))  # (60 periods: longer than idle_s)
        assert answered == list(range(60))


def test_an_answer_the_sender_held_when_it_was_stopped_is_counted():
    """The sender takes an answer from the queue, then waits for the socket to be writable; stopped there (its
    client left: the session's handler cancels it), the answer was neither written nor left in the queue, and the
    accounts must still say what became of it: sent = answered + counted."""
    from metronome.serve.app import _send
    from metronome.serve.gateway import Client

    class Blocked:  # a socket that never becomes writable
        async def send_text(self, text):
            await asyncio.Event().wait()

    async def main():
        c = Client("c1", asyncio.get_running_loop())
        c.sent_in = 2
        c.frame({"type": "response.frame", "input": 0, "token_ids": []})
        c.frame({"type": "response.frame", "input": 1, "token_ids": []})
        sender = asyncio.create_task(_send(Blocked(), c))
        await asyncio.sleep(0.05)  # (it took the first answer and waits on the socket)
        sender.cancel()
        await asyncio.wait({sender})
        c.gateway_done()
        c.socket_done()  # (settles: the second answer, still queued, is counted there)
        return c.accounts

    row = asyncio.run(main())
    assert row["sent"] == 2 and row["answered"] == 0 and row["counted_session_ended"] == 2, row
