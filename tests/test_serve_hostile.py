"""``metronome-serve`` against clients that vanish, stall or send hostile input: the app under uvicorn on 127.0.0.1
over a real gateway on the fake engine (tests/serve_harness.py), driven by raw sockets, no vLLM. Each check reads
what a client sees (HTTP answers, events, close codes) and what the server holds (its gateway's sessions, the
app's clients, the accounts)."""

from __future__ import annotations

import asyncio
import json
import socket

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


def _vanish(port: int, how: str) -> None:
    """One client that leaves around the opening handshake, ``how``: ``rst`` (a reset right after the upgrade
    request), ``fin`` (a close right after it), ``half`` (half the request, then a reset), ``midframe`` (the
    answer read, half an input frame sent, then a reset)."""
    s = h.connect(port)
    req = h.upgrade(port)
    if how == "half":
        s.sendall(req[: len(req) // 2])
        h.reset(s)
        return
    s.sendall(req)
    if how == "rst":
        h.reset(s)
    elif how == "fin":
        s.shutdown(socket.SHUT_RDWR)
        s.close()
    elif how == "midframe":
        status, _, _ = h.read_response(s)
        f = h.event({"type": "input_tokens.append", "token_ids": [7] * h.N_IN})
        s.sendall(f[: len(f) // 2])
        h.reset(s)


def test_clients_that_vanish_around_the_handshake_leave_no_session_and_a_real_client_is_admitted():
    """100 clients, each gone before its socket is accepted, during the handshake or mid-frame, against a gate of
    32: every session the gate admitted ends and has its accounts row, none is left in the gateway or the app,
    and a well-behaved client is admitted and served right after."""
    with h.Served(cap=32) as srv:
        hows = ["rst", "fin", "rst", "half", "midframe"]
        for k in range(100):
            _vanish(srv.port, hows[k % len(hows)])
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
