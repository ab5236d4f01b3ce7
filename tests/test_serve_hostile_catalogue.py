"""The hostile-message catalogue (tests/serve_harness.py: :func:`hostile_catalogue`, which
benchmarks/bench_serve_faults.py sends by the thousand to the real server) against the app under uvicorn over the
fake engine, no vLLM: every message gets the answer its entry states (an ``error`` event with its code, after which
the session goes on, or a close with its code), never a dropped socket; a request that is not HTTP gets 400, and
connections that never finish their headers are closed. So the benchmark's "unexpected" column means the server,
not the catalogue."""

from __future__ import annotations

import asyncio

import pytest
import serve_harness as h

pytest.importorskip("uvicorn", reason="the server runs on uvicorn")
pytest.importorskip("websockets", reason="the protocol is websockets'")

MAX_BYTES = 8192


@pytest.fixture(scope="module")
def srv():
    with h.Served(cap=8, max_message_bytes=MAX_BYTES, headers_timeout_s=0.5) as s:
        # (a gateway's first run compiles the front end's kernels when numba's cache is cold)
        asyncio.run(asyncio.wait_for(h.real_client(s.url, frames=1), 600))
        yield s


def test_every_message_gets_the_answer_its_entry_states_and_the_session_goes_on(srv):
    """A session per class: each message in turn, then an input frame, which is answered (the errors changed
    nothing); a message that closes its session, on a session of its own."""
    got, want = [], []
    for kind, items in h.hostile_catalogue(h.N_IN, h.VOCAB, MAX_BYTES).items():
        going_on = [it for it in items if it.expect[0] == "error"]
        if going_on:
            s, r, _ = h.open_session(srv.port)
            for it in going_on:
                got.append((kind, h.answer_to(s, r, it.wire)))
                want.append((kind, it.expect))
            s.sendall(h.event({"type": "input_tokens.append", "token_ids": [7] * h.N_IN}))
            evs = r.until(lambda ev: not isinstance(ev, dict) or ev.get("input") is not None)
            s.close()
            assert isinstance(evs[-1], dict) and evs[-1]["input"] == 0, (kind, evs[-3:])
        for it in items:
            if it.expect[0] == "close":
                s, r, _ = h.open_session(srv.port)
                got.append((kind, h.answer_to(s, r, it.wire)))
                want.append((kind, it.expect))
                s.close()
    assert got == want, [(g, w) for g, w in zip(got, want) if g != w]
    assert h.wait_for(lambda: srv.sessions() == 0)


def test_a_request_that_is_not_http_gets_400_and_unfinished_headers_are_closed(srv):
    assert h.bad_request(srv.port) == ("http", 400)
    outcomes = h.slow_clients(srv.port, ["slowloris", "silent"], every_s=0.05, cap_s=h.WAIT_S)
    assert [o[0] for o in outcomes] == ["closed", "closed"], outcomes
    assert all(o[1] < h.WAIT_S for o in outcomes)
