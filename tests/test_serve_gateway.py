"""The gateway's own rules (metronome.serve.gateway) on the fake engine, on the wall clock, no network: which
clients the gate lets in, whose input ids reach the engine in which order, and the accounts that say every input
frame a client sent was answered or counted. The network side is tests/live/test_serve.py's (real clients, vLLM).
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from fake_engine import FakeEngine

from metronome.admission import StaticCap
from metronome.calibration import TokenStream
from metronome.probe.driver import DriverConfig
from metronome.serve.gateway import INPUT_QUEUE_FRAMES, Client, Gateway

STREAM = TokenStream(0.05, 4, 2)
P, N_IN = STREAM.frame_period_s, STREAM.input_tokens_per_frame
A_IDS, B_IDS = 2000, 3000


def _gateway(eng, cap=2, cls=Gateway, metrics=None):
    cfg = DriverConfig(stream=STREAM, horizon_s=math.inf, phases="independent", deadline_s=P)
    gw = cls(eng, cfg, admission=StaticCap(cap), silence_token=1, metrics=metrics)
    th = threading.Thread(target=gw.serve, daemon=True)
    th.start()
    return gw, th


def _drain(c: Client) -> list:
    out = []
    while not c.out.empty():
        out.append(c.out.get_nowait())
    return out


async def _admit(gw, sid: str = "c") -> Client:
    """A client the gateway admits."""
    c = Client(sid, asyncio.get_running_loop())
    gw.open(c)
    assert await asyncio.wait_for(c.decision, 5) == "admit"
    return c


async def _finish(gw, th, c: Client) -> None:
    """The client leaves, its accounts settle, the gateway stops."""
    gw.close(c)
    c.socket_done()
    await asyncio.wait_for(c.final.wait(), 5)
    gw.stop()
    await asyncio.get_running_loop().run_in_executor(None, th.join, 5)


async def _run(frames: int):
    loop = asyncio.get_running_loop()
    eng = FakeEngine(num_blocks=128, block_size=16)
    gw, th = _gateway(eng)
    clients = [Client(f"c{k}", loop) for k in range(3)]
    for c in clients:
        gw.open(c)
    verdicts = [await asyncio.wait_for(c.decision, 5) for c in clients]
    a, b = clients[:2]
    got = {a.sid: [], b.sid: []}
    for k in range(frames):  # one input frame per period each: ids base + 10·frame + j (the fake samples < 1000)
        for c, base in ((a, A_IDS), (b, B_IDS)):
            c.inputs.put_nowait((k, [base + 10 * k + j for j in range(N_IN)]))
            c.sent_in += 1
        await asyncio.sleep(P)
        for c in (a, b):
            got[c.sid] += _drain(c)
    for _ in range(INPUT_QUEUE_FRAMES + 5):  # a floods its queue: the overflow is the app's to count
        try:
            a.inputs.put_nowait((a.sent_in, [999] * N_IN))
        except Exception:
            a.counted["input_queue_full"] += 1
        a.sent_in += 1
    for c in (a, b):
        gw.close(c)
        c.socket_done()
    await asyncio.wait_for(asyncio.gather(a.final.wait(), b.final.wait()), 5)
    gw.stop()
    await loop.run_in_executor(None, th.join, 5)
    return eng, verdicts, got, (a, b), clients[2]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """A gateway's first run compiles the front end's engine model (numba) when its cache is cold: seconds in which
    these wall-clock tests' inputs would pile up unanswered. One session first, with time to spare: admitted, one
    input answered, closed, the gateway stopped."""
    async def warm():
        loop = asyncio.get_running_loop()
        gw, th = _gateway(FakeEngine(num_blocks=128, block_size=16))
        c = Client("warm", loop)
        gw.open(c)
        assert await asyncio.wait_for(c.decision, 300) == "admit"
        c.inputs.put_nowait((0, [A_IDS] * N_IN))
        c.sent_in = 1
        for _ in range(3000):
            if any(isinstance(m, dict) and m.get("input") == 0 for m in _drain(c)):
                break
            await asyncio.sleep(0.1)
        gw.close(c)
        c.socket_done()
        await asyncio.wait_for(c.final.wait(), 300)
        gw.stop()
        await loop.run_in_executor(None, th.join, 300)

    asyncio.run(warm())


def test_the_gate_admits_two_and_each_input_frame_is_answered_once_or_counted():
    eng, verdicts, got, (a, b), third = asyncio.run(_run(40))
    assert verdicts == ["admit", "admit", "refused"]
    assert third.index >= 0 and not third.final.is_set()  # offered, refused, never a session with accounts
    for c in (a, b):
        frames = [m for m in got[c.sid] if isinstance(m, dict) and m["type"] == "response.frame"]
        inputs = [m["input"] for m in frames if m["input"] is not None]
        assert inputs == sorted(set(inputs)), inputs  # each once, in order
        assert len(inputs) >= 30  # the fake engine keeps up: most of the 40 are answered before the close
        assert [m["frame"] for m in frames] == list(range(len(frames)))  # its own clock, frame after frame
        c.answered = len(inputs)  # (the app's sender counts what it sends; here, what reached the queue)
        acc = c.accounts
        assert acc["sent"] == acc["answered"] + acc["counted"], acc
    assert a.counted["input_queue_full"] == 5 and a.counted["session_ended"] >= INPUT_QUEUE_FRAMES


def test_the_engine_gets_each_clients_ids_in_the_order_of_its_ticks():
    eng, _, _, (a, b), _ = asyncio.run(_run(20))
    for c, base in ((a, A_IDS), (b, B_IDS)):
        sent = [t for e in eng.appends() if e["rid"].split(".")[0] == c.sid for t in e["tokens"]]
        theirs = [t for t in sent if t >= 1000]
        # only its own ids, in the order it sent them: its frames from its first, each whole and in order
        frames = sorted({(t - base) // 10 for t in theirs})
        assert theirs == [base + 10 * k + j for k in frames for j in range(N_IN)], theirs
        assert frames == list(range(len(frames))) and len(frames) >= 10
        assert sent[0] == 1  # the first frame's prompt: the silence token (no client input goes in front of it)
    # each session's request was aborted when its client left: the pool is empty again
    assert eng.pool().used_blocks == 0


class _Held(FakeEngine):
    """The fake engine, whose steps wait while ``go`` is clear: the test holds a frame in the engine."""

    def __post_init__(self):
        super().__post_init__()
        self.go = threading.Event()
        self.go.set()

    def step(self, wait_s=None):
        self.go.wait(10)
        return super().step(wait_s)


def test_a_frame_in_the_engine_when_its_client_leaves_is_counted():
    """The client's frame 5 is in the engine (submitted, its step held) when the client leaves; its deadline (10 s)
    has not passed, so it is never answered: the gateway counts it for the client (sent = answered + counted)."""
    async def main():
        loop = asyncio.get_running_loop()
        eng = _Held(num_blocks=128, block_size=16)
        cfg = DriverConfig(stream=STREAM, horizon_s=math.inf, phases="independent", deadline_s=10.0)
        gw = Gateway(eng, cfg, admission=StaticCap(1), silence_token=1)
        th = threading.Thread(target=gw.serve, daemon=True)
        th.start()
        c = Client("c", loop)
        gw.open(c)
        assert await asyncio.wait_for(c.decision, 5) == "admit"
        for k in range(5):
            c.inputs.put_nowait((k, [A_IDS + k] * N_IN))
            c.sent_in += 1
            await asyncio.sleep(P)
        await asyncio.sleep(2 * P)
        sent = _drain(c)  # as the app's sender does: what it sent that names an input frame is answered
        c.answered = sum(isinstance(m, dict) and m.get("input") is not None for m in sent)
        eng.go.clear()
        c.inputs.put_nowait((5, [A_IDS + 5] * N_IN))
        c.sent_in += 1
        for _ in range(200):  # until frame 5's chunk reached the engine (its step now held)
            if any(A_IDS + 5 in e["tokens"] for e in eng.appends()):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("frame 5 never reached the engine")
        gw.close(c)
        await asyncio.sleep(0.05)
        c.socket_done()
        eng.go.set()
        await asyncio.wait_for(c.final.wait(), 5)
        gw.stop()
        await loop.run_in_executor(None, th.join, 5)
        return c, _drain(c)

    c, left = asyncio.run(main())
    assert c.answered == 5 and not left  # frames 0-4 answered before; nothing of frame 5 was sent
    assert c.counted == {"input_queue_full": 0, "send_queue_full": 0, "session_ended": 1, "undelivered": 0}
    assert c.sent_in == c.answered + sum(c.counted.values())


def test_sessions_that_arrive_at_run_time_grow_the_front_end():
    """40 clients at once (the front end starts with none and makes room as they come: 16, then 32, then 64): the
    gate (static:30) admits the first 30 in order and refuses the rest, and each admitted one is served."""
    async def main():
        loop = asyncio.get_running_loop()
        eng = FakeEngine(num_blocks=1024, block_size=16)
        gw, th = _gateway(eng, cap=30)
        clients = [Client(f"c{k}", loop) for k in range(40)]
        for c in clients:
            gw.open(c)
        verdicts = [await asyncio.wait_for(c.decision, 5) for c in clients]
        await asyncio.sleep(4 * P)
        served = [any(isinstance(m, dict) and m.get("type") == "response.frame" for m in _drain(c)) for c in clients]
        gw.stop()
        await loop.run_in_executor(None, th.join, 5)
        return verdicts, served, gw

    verdicts, served, gw = asyncio.run(main())
    assert verdicts == ["admit"] * 30 + ["refused"] * 10
    assert served == [True] * 30 + [False] * 10
    assert gw.arrival.size == 64 and gw.offered == 40


class _Broken(FakeEngine):
    """The fake engine, whose steps raise once ``broken`` is set: a failure of the gateway's own code path (not an
    engine that died, which the front end handles)."""

    def __post_init__(self):
        super().__post_init__()
        self.broken = threading.Event()

    def step(self, wait_s=None):
        if self.broken.is_set():
            raise KeyError("a bug")
        return super().step(wait_s)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (raised again, for the log)
def test_a_gateway_that_fails_stops_serving_says_so_and_closes_every_client():
    """The gateway's thread fails mid-session: it stops taking sessions (``serving`` false: /ready fails) and
    says why (``error``: /health fails), the admitted client is closed with 1011 and its accounts settle, the
    sessions it says it holds (``metronome_sessions_active``) go to 0, and the app then refuses anyone else at the
    door (its /ready check)."""
    from fastapi.testclient import TestClient

    from metronome.probe.metrics import LiveMetrics
    from metronome.serve.app import ServeState, make_app

    metrics = LiveMetrics(None)

    async def main():
        loop = asyncio.get_running_loop()
        eng = _Broken(num_blocks=128, block_size=16)
        gw, th = _gateway(eng, metrics=metrics)
        c = await _admit(gw)
        c.inputs.put_nowait((0, [A_IDS] * N_IN))
        c.sent_in += 1
        await asyncio.sleep(3 * P)
        assert metrics.active._value.get() == 1
        eng.broken.set()
        await loop.run_in_executor(None, th.join, 5)
        assert not th.is_alive() and not gw.serving and gw.error == "KeyError: 'a bug'"
        assert metrics.active._value.get() == 0
        for _ in range(50):
            await asyncio.sleep(0.01)
            if c.ended is not None:
                break
        sent = _drain(c)
        assert ("close", 1011) in sent and c.ended == "gateway_error"
        c.answered = sum(isinstance(m, dict) and m.get("input") is not None for m in sent)
        c.socket_done()
        await asyncio.wait_for(c.final.wait(), 5)
        acc = c.accounts
        assert acc["sent"] == acc["answered"] + acc["counted"], acc
        return gw

    gw = asyncio.run(main())
    with TestClient(make_app(ServeState(gateway=gw))) as http:
        assert http.get("/ready").status_code == 503 and http.get("/health").status_code == 503


class _Recording(Gateway):
    """The gateway, keeping each frame row it delivers (the driver's own rows: tick, period, tokens expected)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows = []

    def _deliver(self, i, f, row, ids):
        self.rows.append(dict(row))
        super()._deliver(i, f, row, ids)


def test_a_session_takes_its_own_shape_at_a_frame_boundary_and_its_clock_runs_on():
    """``session.update`` (the app's handler, over a real gateway on the fake engine): the new shape waits behind
    the frames sent before it, takes effect at a frame boundary, and from there the session's frames tick one new
    period apart, carry the new input and ask for the new output, with their frame numbers running on."""
    import json

    from metronome.serve.app import ServeState, _handle

    async def main():
        eng = FakeEngine(num_blocks=128, block_size=16)
        gw, th = _gateway(eng, cls=_Recording)
        state = ServeState(gateway=gw, vocab_size=5000)
        c = await _admit(gw)
        events = []

        def send(k):
            _handle(state, c, json.dumps({"type": "input_tokens.append",
                                          "token_ids": [A_IDS + 10 * k + j for j in range(c_n())]}))

        def c_n():
            return (c.shape or state.shape())["input_tokens_per_frame"]

        for k in range(4):
            send(k)
            await asyncio.sleep(P)
            events += _drain(c)
        _handle(state, c, json.dumps({"type": "session.update", "session": {
            "frame_period_s": 2 * P, "input_tokens_per_frame": 2, "output_tokens_per_frame": 1,
            "deadline_s": 3 * P}}))
        for k in range(4, 10):
            send(k)
            await asyncio.sleep(2 * P)
            events += _drain(c)
        await asyncio.sleep(4 * P)
        events += _drain(c)
        await _finish(gw, th, c)
        return eng, gw, c, events

    eng, gw, c, events = asyncio.run(main())
    kinds = [e["type"] for e in events]
    assert kinds.count("session.updated") == 1 and "error" not in kinds, events
    upd = events[kinds.index("session.updated")]["session"]
    assert (upd["frame_period_s"], upd["input_tokens_per_frame"], upd["output_tokens_per_frame"],
            upd["deadline_s"]) == (2 * P, 2, 1, 3 * P)
    rows = [r for r in gw.rows if not r["censored"]]
    old = [r for r in rows if r["period_s"] == P]
    new = [r for r in rows if r["period_s"] == 2 * P]
    assert len(old) >= 3 and len(new) >= 4 and rows == old + new  # one change, at a frame's boundary
    assert [r["frame"] for r in rows] == list(range(len(rows)))  # the numbers run on
    assert {r["tokens_expected"] for r in old} == {2} and {r["tokens_expected"] for r in new} == {1}
    ticks = [r["tick_s"] for r in rows]
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    k = len(old)
    # (1e-9 s: the ticks are sums of the periods, so only rounding separates them)
    assert all(abs(g - P) < 1e-9 for g in gaps[:k]), gaps  # the tick due next stayed where it was
    assert all(abs(g - 2 * P) < 1e-9 for g in gaps[k:]), gaps
    # the engine was asked for the new output, and got the new input: the re-fed token and 2 ids a frame
    asks = [e for e in eng.appends() if not e["new"]]
    assert {e["max_tokens"] for e in asks[-3:]} == {1} and {len(e["tokens"]) for e in asks[-3:]} == {3}
    after = [t for e in eng.appends() for t in e["tokens"] if t >= A_IDS + 40]  # the frames sent after the update
    frames = sorted({(t - A_IDS) // 10 for t in after})
    assert after == [A_IDS + 10 * k + j for k in frames for j in range(2)] and len(frames) >= 4, after
    answered = sum(e["type"] == "response.frame" and e["input"] is not None for e in events)
    assert c.accounts["sent"] == 10 and answered + c.accounts["counted"] == 10 and answered >= 8


def test_an_engine_on_its_own_loop_is_waited_on_no_longer_than_the_next_tick_is_away():
    """While the engine has work, the gateway asks it for a step report with a wait no longer than its next tick
    (or event) is away, so that a frame coming due mid-step is handed over at its tick (an engine on vLLM's own
    loop otherwise waits out its poll, ``own_loop.POLL_S``)."""

    class Asked(FakeEngine):
        def __post_init__(self):
            super().__post_init__()
            self.waits = []

        def step(self, wait_s=None):
            self.waits.append(wait_s)
            return super().step(wait_s)

    async def main():
        eng = Asked(num_blocks=128, block_size=16)
        gw, th = _gateway(eng)
        c = await _admit(gw)
        for k in range(6):
            c.inputs.put_nowait((k, [A_IDS + 10 * k + j for j in range(N_IN)]))
            c.sent_in += 1
            await asyncio.sleep(P)
        await _finish(gw, th, c)
        return eng.waits

    waits = asyncio.run(main())
    assert len(waits) >= 6 and None not in waits
    # (a tick is at most a period away; 1 ms: the turn's own time between reading the clock and asking)
    assert all(w <= P + 1e-3 for w in waits), waits


def test_a_client_that_leaves_before_the_gate_decides_leaves_no_session():
    """A client arrives and leaves within one turn (its socket reset before the gate decided): the gate admits it
    at that turn, and its session ends at the next, so the gateway holds nothing of it and its accounts settle.
    A client that comes after the gateway stopped is refused at once, never left waiting at the gate."""
    async def main():
        loop = asyncio.get_running_loop()
        gw, th = _gateway(FakeEngine(num_blocks=128, block_size=16))
        c = Client("gone", loop)
        gw._inbox.extend([("open", c), ("close", c)])  # (both at once: one turn takes them together)
        gw._wake.set()
        c.socket_done()
        assert await asyncio.wait_for(c.decision, 5) == "admit"
        await asyncio.wait_for(c.final.wait(), 5)
        for _ in range(500):
            if not gw.clients and gw._in_flight() == 0:
                break
            await asyncio.sleep(0.01)
        held = (dict(gw.clients), gw._in_flight())
        gw.stop()
        await loop.run_in_executor(None, th.join, 5)
        late = Client("late", loop)
        gw.open(late)
        verdict = await asyncio.wait_for(late.decision, 5)
        return held, verdict

    held, verdict = asyncio.run(main())
    assert held == ({}, 0)
    assert verdict == "stopped"


def test_an_update_sent_behind_queued_frames_takes_effect_and_the_frames_behind_it_are_answered():
    """A client sends three frames at once, a ``session.update`` right behind them while they still wait for their
    ticks, then three frames in the new shape: the update takes effect once the first three are served (one
    ``session.updated``), and all six frames are answered, in order."""
    import json

    from metronome.serve.app import ServeState, _handle

    async def main():
        gw, th = _gateway(FakeEngine(num_blocks=128, block_size=16))
        state = ServeState(gateway=gw, vocab_size=5000)
        c = await _admit(gw)

        def send(k, n):
            _handle(state, c, json.dumps({"type": "input_tokens.append",
                                          "token_ids": [A_IDS + 10 * k + j for j in range(n)]}))

        for k in range(3):
            send(k, N_IN)
        assert c.inputs.qsize() == 3  # (queued: the ticks have not taken them yet)
        _handle(state, c, json.dumps({"type": "session.update", "session": {"output_tokens_per_frame": 1}}))
        for k in range(3, 6):
            send(k, N_IN)
        events = []
        for _ in range(400):  # (40 frames' time at most: 20 are enough)
            events += _drain(c)
            if sum(isinstance(e, dict) and e.get("input") is not None for e in events) == 6:
                break
            await asyncio.sleep(P / 4)
        await _finish(gw, th, c)
        return events

    events = asyncio.run(main())
    kinds = [e["type"] for e in events]
    assert kinds.count("session.updated") == 1 and "error" not in kinds, kinds
    inputs = [e["input"] for e in events if e["type"] == "response.frame" and e["input"] is not None]
    assert inputs == list(range(6)), inputs
    at = kinds.index("session.updated")
    before = [e for e in events[:at] if e["type"] == "response.frame"]
    after = [e for e in events[at:] if e["type"] == "response.frame"]
    assert [e["input"] for e in before if e["input"] is not None] == [0, 1, 2]  # served in the old shape
    assert all(len(e["token_ids"]) <= 1 for e in after)  # the new shape: one token a frame


def test_a_client_past_its_send_queue_is_closed_once_and_its_waiting_answers_count_as_undelivered():
    """Events said to a client that reads nothing: the send queue keeps at most its bound of messages (answers
    included), the one past it closes the client (``send_backlog``, once), and at settling the answers still
    waiting are counted ``undelivered``."""
    from metronome.serve.gateway import SEND_QUEUE_FRAMES, SEND_QUEUE_MESSAGES

    async def main():
        c = Client("c", asyncio.get_running_loop())
        told = []
        c.on_limit = told.append
        for k in range(SEND_QUEUE_FRAMES):
            c.sent_in += 1
            c.frame({"type": "response.frame", "input": k})
        for _ in range(2 * SEND_QUEUE_MESSAGES):
            c.say({"type": "error", "error": {}})
        size = c.out.qsize()
        c.gateway_done()
        c.socket_done()
        return c, told, size

    c, told, size = asyncio.run(main())
    assert size == SEND_QUEUE_MESSAGES and told == ["send_backlog"] and c.closed == "send_backlog"
    assert c.counted["undelivered"] == SEND_QUEUE_FRAMES and c.accounts["closed"] == "send_backlog"
    assert c.accounts["sent"] == c.accounts["answered"] + c.accounts["counted"]
