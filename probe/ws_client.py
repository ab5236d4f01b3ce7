"""``metronome-probe run --target ws://HOST:PORT``: the probe's workload as WebSocket clients of a
``metronome-serve`` (docs/serve.md), over the network.

The sessions are the ones an in-process run draws for the same seed (:func:`metronome.probe.live_run.make_plans`:
arrival times, durations and phases). Each is one client: it connects at its arrival time (a refusal, HTTP 503
before the upgrade, ends it as ``refused``: the server's gate decides, as the driver's controller does in process),
sends one ``input_tokens.append`` per frame period on its own clock from its admission until its duration or the
horizon ends, and reads one ``response.frame`` per frame of the server's clock for it. A frame's latency is the
server's (its tick to its answer, ``latency_ms``), the latency an in-process run records; the client's own round
trip (input sent to the frame that carried it answered) is kept beside it. While the run lasts the server's
``/metrics`` is read once a ``--poll`` interval: the admission limit and the sessions active, the controller's trace
of an in-process run.

Rows are kept in memory and written when the run ends, stopped or not (SIGTERM, Ctrl-C): ``frames``,
``sessions`` and ``steps`` (here one row per poll: ``t_s`` and ``sessions``, this client's sessions alive, which
is what the report's settled concurrency reads), ``controller.parquet`` and ``summary.json`` with the keys an
in-process run's summary has (:func:`metronome.probe.summary.summarize`; no engine step is seen from outside,
so the step figures are null).
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from metronome.errors import MetronomeError
from metronome.serving import EndReason

PATH = "/v1/realtime"
METRIC_NAMES = {"limit": "metronome_admission_limit", "active": "metronome_sessions_active",
                "p99": "metronome_frame_latency_p99_seconds", "usage": "metronome_kv_pool_usage"}


def endpoints(target: str) -> tuple[str, str]:
    """``(websocket URL, metrics URL)`` of ``--target`` (``ws://HOST:PORT`` or ``wss://``; the path defaults to
    the server's ``/v1/realtime``). One line and exit 2 for anything else."""
    u = urllib.parse.urlsplit(target)
    if u.scheme not in ("ws", "wss") or not u.hostname:
        raise MetronomeError(f"--target must be ws://HOST:PORT or wss://HOST:PORT, got {target!r}")
    try:
        u.port
    except ValueError:
        raise MetronomeError(f"--target {target!r}: the port is not a number in 0..65535") from None
    path = u.path if u.path not in ("", "/") else PATH
    ws = urllib.parse.urlunsplit((u.scheme, u.netloc, path, u.query, ""))
    http = urllib.parse.urlunsplit(("https" if u.scheme == "wss" else "http", u.netloc, "/metrics", "", ""))
    return ws, http


def read_metrics(text: str) -> dict:
    """The gateway's series this client follows, from Prometheus' text (``None``: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return {k: got.get(name) for k, name in METRIC_NAMES.items()}


@dataclass
class TargetRun:
    """What a run against a server collected (rows as :mod:`metronome.probe.summary` reads them)."""

    frames: list = field(default_factory=list)
    sessions: list = field(default_factory=list)
    polls: list = field(default_factory=list)  # t_s, sessions (ours alive), limit, in_flight, p99, usage
    info: dict | None = None  # the first session.created's session object: the server's stream and settings
    errors: Counter = field(default_factory=Counter)  # error events by code
    round_trip_s: list = field(default_factory=list)
    stopped: str | None = None
    t_stopped_s: float | None = None
    wall_s: float = 0.0


class _Stop(Exception):
    pass


async def run_target(target: str, plans, horizon_s: float, *, api_key: str | None = None, seed: int = 0,
                     poll_s: float = 1.0, stop: asyncio.Event | None = None, echo=None) -> TargetRun:
    """Run ``plans`` (:class:`metronome.probe.driver.SessionPlan`) against the server at ``target`` until
    ``horizon_s`` or ``stop`` is set, and return what ran (a session the server would not take, for whatever
    reason, is a row with its reason; :func:`check_reachable` first says whether there is a server at all)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    ws_url, metrics_url = endpoints(target)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = TargetRun()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    alive: set = set()
    t0 = loop.time()

    def now() -> float:
        return loop.time() - t0

    async def session(k: int, plan) -> None:
        row = {"session": plan.sid, "arrival_s": plan.arrival_s, "duration_s": plan.duration_s, "admitted": False,
               "reason": None, "admitted_s": None, "ended_s": None, "sent": 0, "answered": 0, "frames": 0}
        out.sessions.append(row)
        if not await _sleep_until(loop, t0 + plan.arrival_s, stop):
            row["reason"] = EndReason.STOPPED  # (stopped before it arrived)
            return
        try:
            ws = await connect(ws_url, additional_headers=headers, open_timeout=10, max_size=2**20)
        except InvalidStatus as exc:
            code = exc.response.status_code
            row["reason"] = EndReason.REFUSED if code == 503 else EndReason.UNREACHED
            row["ended_s"] = now()
            if code != 503:
                out.errors["unauthorized" if code == 401 else f"http_{code}"] += 1
            return
        except (OSError, asyncio.TimeoutError) as exc:
            row["reason"], row["ended_s"] = EndReason.UNREACHED, now()
            out.errors[f"connect_failed: {type(exc).__name__}"] += 1
            return
        row["admitted"], row["admitted_s"] = True, now()
        alive.add(k)
        sent_at: dict[int, float] = {}
        try:
            created = json.loads(await asyncio.wait_for(ws.recv(), 10))
            info = created.get("session", {})
            if out.info is None:
                out.info = info
            period = float(info["frame_period_s"])
            n_in = int(info["input_tokens_per_frame"])
            vocab = int(info.get("vocab_size", 2))
            rng = np.random.default_rng([seed, k])
            end = min(plan.arrival_s + plan.duration_s, horizon_s)
            reader = asyncio.create_task(_read(ws, row, sent_at, out, now))
            j = 0
            start = loop.time()
            while not stop.is_set() and now() < end:
                ids = rng.integers(0, vocab, n_in).tolist() if n_in else []
                sent_at[j] = now()
                await ws.send(json.dumps({"type": "input_tokens.append", "token_ids": ids}))
                row["sent"] += 1
                j += 1
                if not await _sleep_until(loop, start + j * period, stop, until=t0 + end):
                    break
            # the frames in flight are answered within a deadline or two: wait for them, not forever
            wait_until = loop.time() + 2 * float(info.get("deadline_s", period)) + 2 * period
            while row["answered"] < row["sent"] and loop.time() < wait_until and not reader.done():
                await asyncio.sleep(period / 4)
            row["reason"] = row["reason"] or (EndReason.STOPPED if stop.is_set() else EndReason.DEPARTED
                                              if plan.arrival_s + plan.duration_s <= horizon_s else EndReason.HORIZON)
            await ws.close()
            await asyncio.wait_for(reader, 5)
        except Exception as exc:  # the server closed it, or the socket broke: the session ends, the run goes on
            row["reason"] = row["reason"] or EndReason.CLOSED
            out.errors[f"closed: {type(exc).__name__}"] += 1
        finally:
            alive.discard(k)
            row["ended_s"] = now()
            await ws.close()

    async def poller() -> None:
        while not stop.is_set():
            try:
                text = await asyncio.to_thread(_get, metrics_url)
                m = read_metrics(text)
            except OSError:
                m = dict.fromkeys(METRIC_NAMES)
            out.polls.append({"t_s": now(), "sessions": len(alive), **m})
            if not await _sleep_until(loop, loop.time() + poll_s, stop, until=t0 + horizon_s):
                return

    tasks = [asyncio.create_task(session(k, p)) for k, p in enumerate(plans)]
    poll = asyncio.create_task(poller())
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        stop.set()
        await asyncio.gather(poll, return_exceptions=True)
    out.wall_s = now()
    return out


async def _read(ws, row: dict, sent_at: dict, out: TargetRun, now) -> None:
    """One session's events until the socket closes: a row per ``response.frame``, errors counted."""
    async for text in ws:
        t = now()
        m = json.loads(text)
        kind = m.get("type")
        if kind == "response.frame":
            lat = m.get("latency_ms")
            lat = None if lat is None else lat / 1e3
            inp = m.get("input")
            if inp is not None:
                row["answered"] += 1
                if inp in sent_at:
                    out.round_trip_s.append(t - sent_at.pop(inp))
            row["frames"] += 1
            out.frames.append({"session": row["session"], "frame": m.get("frame"), "input": inp,
                               "tick_s": t - (lat or 0.0), "done_s": t, "latency_s": lat,
                               "silent": bool(m.get("silent")), "met_deadline": not m.get("late"),
                               "silent_by_deadline": bool(m.get("silent")) and bool(m.get("late")),
                               "tokens_delivered": len(m.get("token_ids") or []), "state": "running",
                               "censored": False, "rebased": False})
        elif kind == "error":
            out.errors[(m.get("error") or {}).get("code", "error")] += 1
        elif kind == "session.closing":
            row["reason"] = EndReason.CLOSED


async def _sleep_until(loop, t: float, stop: asyncio.Event, until: float = math.inf) -> bool:
    """Sleep to loop time ``t`` (or ``until``, if sooner); False when ``stop`` was set or ``until`` came first."""
    wait = min(t, until) - loop.time()
    if wait > 0:
        try:
            await asyncio.wait_for(stop.wait(), wait)
            return False
        except asyncio.TimeoutError:
            pass
    return not stop.is_set() and t <= until


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def check_reachable(target: str) -> None:
    """One line (:class:`MetronomeError`) if nothing answers HTTP at ``target``'s host and port."""
    metrics_url = endpoints(target)[1]
    try:
        _get(metrics_url)
    except urllib.error.HTTPError:
        return  # it answers (the metrics may be refused while it starts): the sessions will say more
    except OSError as exc:
        raise MetronomeError(f"--target: cannot reach {metrics_url.rsplit('/', 1)[0]} ({exc})") from None


def summary_of(res: TargetRun) -> dict:
    """The in-process run's summary keys from what the clients saw (:func:`metronome.probe.summary.summarize`),
    then the client's own figures."""
    from metronome.probe.summary import summarize
    from metronome.results import percentiles

    info = res.info or {}
    server = info.get("server") or {}
    num_blocks = int(server.get("num_blocks") or 1)
    usage = [p["usage"] for p in res.polls if p.get("usage") is not None]
    sessions = [{"session": r["session"], "admitted": r["admitted"], "reason": r["reason"]} for r in res.sessions]
    s = summarize(res.frames, [], sessions, num_blocks)
    if usage and num_blocks > 1:  # the pool as the server's gauge saw it at the polls (its peak between them unseen)
        s["peak_used_blocks"] = int(round(max(usage) * (num_blocks - 1)))
        s["peak_pool_occupancy"] = round(max(usage), 6)
    rt50, rt99 = percentiles(res.round_trip_s, (50, 99)) if res.round_trip_s else (None, None)
    s["client"] = {"frames_sent": sum(r["sent"] for r in res.sessions),
                   "inputs_answered": sum(r["answered"] for r in res.sessions),
                   "p50_round_trip_s": rt50, "p99_round_trip_s": rt99, "errors": dict(res.errors),
                   "end_reasons": dict(Counter(r["reason"] for r in res.sessions))}
    return s
