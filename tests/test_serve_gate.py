"""``metronome-serve``'s door without vLLM: the app under uvicorn on 127.0.0.1 over a real gateway on the fake
engine (tests/serve_harness.py), asked by raw upgrade requests. A request without the bearer token gets 401; one
that comes while the server starts or drains, or that the admission gate refuses, gets 503 with ``Retry-After``;
each refusal's body is an ``error`` event and is counted by why. The live ones are tests/live/test_serve.py's."""

from __future__ import annotations

import json

import pytest
import serve_harness as h

pytest.importorskip("uvicorn", reason="the server runs on uvicorn")
pytest.importorskip("prometheus_client", reason="the server's metrics are prometheus-client's")


def _ask(port: int, headers: dict | None = None) -> tuple[int, dict, dict]:
    """An upgrade request's answer: status, headers, and the body as JSON (None for a 101)."""
    s = h.connect(port)
    s.sendall(h.upgrade(port, headers))
    status, head, rest = h.read_response(s)
    body = rest
    n = int(head.get("content-length", 0))
    while status != 101 and len(body) < n:
        got = s.recv(65536)
        if not got:
            break
        body += got
    s.close()
    return status, head, json.loads(body) if status != 101 else None


def _refused(srv) -> dict:
    return {s.labels["reason"]: s.value for m in srv.metrics.refused.collect() for s in m.samples
            if s.name.endswith("_total")}


def test_without_the_bearer_token_the_upgrade_gets_401_and_with_it_101():
    with h.Served(cap=2, api_key="sesame") as srv:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, head, body = _ask(srv.port, headers)
            assert status == 401 and "retry-after" not in head, (headers, status, head)
            assert body["type"] == "error" and body["error"]["code"] == "invalid_api_key"
        assert _refused(srv) == {"unauthorized": 3}
        assert _ask(srv.port, {"Authorization": "Bearer sesame"})[0] == 101
        assert h.wait_for(lambda: srv.sessions() == 0)


def test_a_starting_or_draining_server_and_the_gate_refuse_with_503_and_retry_after():
    with h.Served(cap=1, gateway=False) as srv:  # no engine yet: starting
        srv.state.retry_after_s = 3
        status, head, body = _ask(srv.port)
        assert (status, head.get("retry-after"), body["error"]["code"]) == (503, "3", "not_ready")
        srv.state.gateway = srv.gateway  # the engine is up: a session is admitted
        s, r, _ = h.open_session(srv.port)
        status, head, body = _ask(srv.port)  # the gate (static:1) is full
        assert (status, head.get("retry-after"), body["error"]["code"]) == (503, "3", "session_refused")
        assert "refused" in body["error"]["message"]
        srv.state.draining = True
        status, head, body = _ask(srv.port)
        assert (status, head.get("retry-after"), body["error"]["code"]) == (503, "3", "not_ready")
        s.close()
        assert h.wait_for(lambda: srv.sessions() == 0)
        assert _refused(srv) == {"starting": 1, "refused": 1, "draining": 1}
