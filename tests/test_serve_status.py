"""The server's status page and its JSON (metronome.serve.status) through the app (FastAPI's TestClient), with a
real LiveMetrics and a stand-in gateway: what ``/status.json`` says, that it stays bounded, that it carries no
session content, that ``/`` is a self-contained page that reads it, and that ``/metrics`` carries the engine's
registry beside the gateway's. The page's script running in a browser is tests/live/test_serve.py's."""

from __future__ import annotations

import json
import re
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client", reason="the server's metrics are prometheus-client's")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx")

from fastapi.testclient import TestClient  # noqa: E402

from metronome.probe.metrics import LiveMetrics  # noqa: E402
from metronome.serve.app import ServeState, make_app  # noqa: E402
from metronome.serve.status import SERIES, StatusHistory  # noqa: E402

SID = "c-7f3a9e"  # a session id that must never show
TOKENS = [1733, 1931, 1973]  # token ids of that session's frames


class _Client:
    """A connected client, as far as the state holds one: its id and what it last sent."""

    sid = SID
    last_frame = {"token_ids": TOKENS, "text": "hello"}


def _gateway(serving=True, deadline=0.1):
    return SimpleNamespace(serving=serving, cfg=SimpleNamespace(deadline=deadline))


def _state(**kw) -> ServeState:
    """A server two sessions into its run: limit 3, a refusal, frames of ~12 ms, one session ended (``SID``)."""
    m = LiveMetrics(None)
    m.admission(SimpleNamespace(limit=3, dead=False))
    m.sessions(2)
    m.entered()
    m.entered()
    m.refused_for("refused")
    for k in range(100):
        m.frame(0.010 + 0.00002 * k, silent=False)
    row = {"session": SID, "sent": 3, "answered": 3, "counted": 0, "counted_session_ended": 0}
    m.client_frames(row)
    st = ServeState(gateway=_gateway(), metrics=m, accounts=[row], **kw)
    st.clients.add(_Client())
    return st


def _json(client) -> dict:
    r = client.get("/status.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def test_status_json_says_what_the_metrics_say_now_and_over_time():
    st = _state()
    for k in range(5):
        st.status.sample(st, now=1000.0 + k)
    s = _json(TestClient(make_app(st)))
    c = s["current"]
    assert c["state"] == "ready" and c["ready"] is True and c["draining"] is False
    assert c["sessions_active"] == 2 and c["admission_limit"] == 3 and c["deadline_ms"] == 100.0
    assert c["p99_ms"] == pytest.approx(11.96) and c["p50_ms"] == pytest.approx(10.98)  # nearest rank
    assert c["refused"] == 1 and c["refused_by_reason"] == {"refused": 1} and c["admitted"] == 2
    assert c["frames"] == 100 and c["silent_rate"] == 0.0 and c["engine_up"] is True
    assert s["period_s"] == 1.0 and s["capacity"] == 600 and s["sampler_errors"] == 0
    assert set(s["series"]) == set(SERIES)
    assert s["series"]["t"] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    assert s["series"]["sessions_active"] == [2] * 5 and s["series"]["admission_limit"] == [3] * 5
    assert s["series"]["p99_ms"] == [pytest.approx(11.96)] * 5


def test_no_limit_no_frames_and_a_starting_server_read_as_null():
    m = LiveMetrics(None)
    m.admission(SimpleNamespace(limit=sys.maxsize, dead=False))  # NoAdmission's
    st = ServeState(gateway=_gateway(), metrics=m)
    c = _json(TestClient(make_app(st)))["current"]
    assert c["admission_limit"] is None and c["p99_ms"] is None and c["p50_ms"] is None
    starting = ServeState()  # no engine yet, no metrics
    s = _json(TestClient(make_app(starting)))
    assert s["current"]["state"] == "starting" and s["current"]["sessions_active"] is None
    assert all(v == [] for v in s["series"].values())
    assert _json(TestClient(make_app(ServeState(gateway=_gateway(), draining=True))))["current"]["state"] == \
        "draining"
    assert _json(TestClient(make_app(ServeState(gateway=_gateway(serving=False)))))["current"]["state"] == \
        "stopped"


def test_the_servers_n_star_is_on_metrics_and_the_status_page_beside_the_limit_and_absent_without_one():
    st = _state()
    client = TestClient(make_app(st))
    assert _json(client)["current"]["n_star"] is None  # no calibration: no N*, and no series claims one
    assert "metronome_n_star" not in client.get("/metrics").text
    st.metrics.n_star(27)  # (the CLI's, once its calibration's capacity is known)
    c = _json(client)["current"]
    assert c["n_star"] == 27 and c["admission_limit"] == 3
    assert re.search(r"^metronome_n_star 27\.0$", client.get("/metrics").text, re.M)
    html = client.get("/").text  # the page shows it: a card, and a line on the sessions chart
    assert 'id="nstar"' in html and "c.n_star" in html and 'cls: "nstar"' in html


def test_the_history_is_a_bounded_ring():
    st = _state(status=StatusHistory(period_s=1.0, span_s=10.0))
    client = TestClient(make_app(st))
    for k in range(1000):
        st.status.sample(st, now=float(k))
    s = _json(client)
    assert s["capacity"] == 10 and s["span_s"] == 10.0
    assert all(len(col) == 10 for col in s["series"].values())
    assert s["series"]["t"] == [float(k) for k in range(990, 1000)]  # the newest ten
    assert StatusHistory().samples.maxlen == 600  # the default: ten minutes, one sample a second


def test_status_json_carries_no_session_content():
    st = _state()
    st.status.sample(st)
    text = TestClient(make_app(st)).get("/status.json").text
    assert SID not in text and "hello" not in text
    assert not any(str(t) in text for t in TOKENS)

    def keys(o):
        if isinstance(o, dict):
            for k, v in o.items():
                yield k
                yield from keys(v)
        elif isinstance(o, list):
            for v in o:
                yield from keys(v)

    assert not {"session", "sessions", "id", "sid", "token_ids", "text"} & set(keys(json.loads(text)))


def test_the_page_is_self_contained_html_that_reads_status_json_and_needs_no_key():
    st = _state(api_key="k")
    client = TestClient(make_app(st))
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert re.search(r"fetch\(\s*[\"']status\.json[\"']", html)  # the script polls the JSON (relative: proxies)
    assert "<script src" not in html and "<link" not in html and "@import" not in html and "url(" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}  # (the SVG namespace)
    for id_ in ("state", "sessions", "limit", "p99", "refused", "chart-sessions", "chart-p99"):
        assert f'id="{id_}"' in html, id_
    # like /metrics and /health: open without the bearer token (docs/serve.md)
    assert client.get("/status.json").status_code == 200


def test_the_sampler_runs_with_the_app():
    st = _state(status=StatusHistory(period_s=0.05, span_s=5.0))
    with TestClient(make_app(st)) as client:  # (the lifespan: the sampler starts and stops with the app)
        t0 = time.time()
        while len(st.status.samples) < 3 and time.time() - t0 < 5:
            time.sleep(0.02)
        s = _json(client)
    assert len(s["series"]["t"]) >= 3 and s["series"]["sessions_active"][-1] == 2
    n = len(st.status.samples)
    time.sleep(0.2)
    assert len(st.status.samples) == n  # stopped with the app


def test_metrics_carries_the_engines_registry_after_the_gateways():
    from prometheus_client import CollectorRegistry, Gauge

    engine = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", ["model_name"],
          registry=engine).labels(model_name="tiny").set(2)
    st = _state()
    client = TestClient(make_app(st))
    alone = client.get("/metrics").text
    assert "metronome_sessions_active 2.0" in alone and "vllm:" not in alone
    st.engine_registry = engine
    both = client.get("/metrics").text
    assert both.startswith(alone)
    assert 'vllm:num_requests_running{model_name="tiny"} 2.0' in both
    assert SID not in both
