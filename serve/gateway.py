"""The gateway's engine side: the live driver's front end, serving sessions that arrive over the network.

:class:`Gateway` is :class:`metronome.probe.driver.Driver` (the core's front end on the wall clock, over the engine
in slots) on a thread of its own, with sessions that arrive unannounced. The web app (:mod:`metronome.serve.app`)
posts each client's arrival and departure to the gateway's inbox and queues its input frames; the gateway's turn
takes them, and the front end's rules decide everything else (the admission gate and its queue, the frame clock,
silence, preemption, the rebase at ``max_model_len``). Each answered frame goes back to its client's send queue
on the app's event loop. Nothing here decides how a session is served.

**Input.** A session's frame clock ticks on its own phase (the phase of its arrival: its first frame is due at
once). At each tick the gateway takes the client's oldest queued input frame, or the silence token if there is
none, so a frame answered is the answer to at most one input frame (``input``: the client's frame number, or null).
The ids wait in the session's order of ticks until the front end sends them to the engine (``SlotEngine``'s
``fresh``), which is in that same order.

**Accounting.** Every input frame a client sent is answered (a ``response.frame`` that names it) or counted
(``Client.counted``, by reason: the input queue was full, the send queue was full, the session ended first, or
the server closed a client past one of its limits before the answer reached it: ``undelivered``), so that
sent = answered + counted per session.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
from collections import deque

import numpy as np

from metronome import serving
from metronome.front_end import NOT_ARRIVED, QUEUED, RUNNING, WAITING
from metronome.probe.driver import Driver, DriverConfig
from metronome.serving import EndReason

INPUT_QUEUE_FRAMES = 32  # input frames a client may have waiting for their ticks; more are refused and counted
SEND_QUEUE_FRAMES = 64  # answers waiting for a slow client; more are counted, never buffered
SEND_QUEUE_MESSAGES = 96  # messages of any kind waiting for it (answers, errors, updates); past it, it is closed
GAUGES_EVERY_S = 0.5  # while the gateway naps (no step runs), the pool's gauges are read again this often
DROP_REASONS = ("input_queue_full", "send_queue_full", "session_ended", "undelivered")
GATEWAY_ERROR = "gateway_error"  # why sessions end, and the server stops, when the gateway itself fails


class Client:
    """One WebSocket client as both threads see it. Fields without a lock are touched on the app's event loop only;
    the gateway thread reaches the client through ``loop.call_soon_threadsafe``."""

    def __init__(self, sid: str, loop: asyncio.AbstractEventLoop):
        self.sid, self.loop = sid, loop
        self.decision: asyncio.Future = loop.create_future()  # "admit", or why it was refused
        self.inputs: queue.Queue = queue.Queue(maxsize=INPUT_QUEUE_FRAMES)  # (frame number, ids), for the ticks
        self.out: asyncio.Queue = asyncio.Queue()  # messages to send: answers (bounded by hand) and control
        self.sent_in = 0  # input frames the client sent (its next frame number)
        self.answered = 0  # answers naming an input frame, sent
        self.counted = {r: 0 for r in DROP_REASONS}
        self.ended: str | None = None  # the server ended the session (why)
        self.index = -1  # the front end's session (set by the gateway thread)
        self.shape: dict = {}  # its stream shape as last asked (the app's; the gateway applies it in turn)
        self._gateway_done = self._socket_done = False
        self.final = asyncio.Event()  # set once the accounting is closed (both sides are done)
        self.closed: str | None = None  # why the server closed it for a limit (past_limit), if it did
        self.errors = 0  # error events it earned
        self.bad_in_a_row = 0  # its last messages that each earned an error (the app's count)
        self.on_limit = None  # called with the reason when it passes a limit (the app closes its socket)
        self.kick = None  # the app's: close its socket now, kick(code, reason) (None: not possible)

    # -- on the event loop ----------------------------------------------------------------------------------
    def decide(self, verdict: str) -> None:
        if not self.decision.done():
            self.decision.set_result(verdict)

    def frame(self, message: dict) -> None:
        """An answer to send; one that names an input frame is counted instead when the client is too slow."""
        if self.out.qsize() >= SEND_QUEUE_FRAMES:
            if message["input"] is not None:
                self.counted["send_queue_full"] += 1
            return
        self.out.put_nowait(message)

    def say(self, message: dict) -> None:
        """An event to send (an ``error``, ``session.updated``, ``session.closing``): one past the send queue's
        bound (:data:`SEND_QUEUE_MESSAGES`, answers included) is not kept, and the client, which sends without
        reading, is closed (``send_backlog``)."""
        if self.closed is not None:
            return
        if self.out.qsize() >= SEND_QUEUE_MESSAGES:
            self.past_limit("send_backlog")
            return
        self.errors += message.get("type") == "error"
        self.out.put_nowait(message)

    def updated(self, message: dict) -> None:
        """The gateway applied a ``session.update``: say so."""
        self.say(message)

    def past_limit(self, reason: str) -> None:
        """The client passed a limit of what the server holds for it: its socket is closed (1008) and what it was
        owed is counted ``undelivered``."""
        if self.closed is None:
            self.closed = reason
            if self.on_limit is not None:
                self.on_limit(reason)

    def lost(self, n: int) -> None:
        """``n`` input frames will never be answered: the session ended before their answers."""
        self.counted["session_ended"] += n

    def end(self, reason: str) -> None:
        """The server ended the session (a stop, the engine): the sender closes the socket."""
        self.ended = reason
        self.out.put_nowait(("close", 1001 if reason == EndReason.STOPPED else 1011))

    def gateway_done(self, _=None) -> None:
        """The gateway ended the session: it takes no more input and answers no more frames."""
        self._gateway_done = True
        self._settle()

    def socket_done(self) -> None:
        """The socket is closed: nothing more is received or sent."""
        self._socket_done = True
        self._settle()

    def _settle(self) -> None:
        """Both sides done: what was sent and is neither answered nor counted yet never will be (input its ticks
        did not take, answers the socket did not send)."""
        if not (self._gateway_done and self._socket_done) or self.final.is_set():
            return
        left = sum(item[0] != "shape" for item in list(self.inputs.queue))  # (a shape is not a frame)
        while not self.out.empty():
            m = self.out.get_nowait()
            left += isinstance(m, dict) and m.get("type") == "response.frame" and m["input"] is not None
        self.counted["undelivered" if self.closed is not None else "session_ended"] += left
        self.final.set()

    @property
    def accounts(self) -> dict:
        """sent = answered + counted, once :attr:`final` is set."""
        return {"session": self.sid, "sent": self.sent_in, "answered": self.answered,
                "counted": sum(self.counted.values()), **{f"counted_{k}": v for k, v in self.counted.items()},
                "closed": self.closed}


class Gateway(Driver):
    """The front end serving network clients; :meth:`serve` is its thread's body."""

    HEARS_TICKS = True

    def __init__(self, engine, config: DriverConfig, admission=None, out_dir=None, metrics=None,
                 silence_token: int = 0, notify=None):
        self._wake = threading.Event()
        self._inbox: deque = deque()
        self._door = threading.Lock()  # (open against the stop's last look at the inbox)
        self._closed: str | None = None  # set once the gateway stopped: why
        super().__init__(engine, config, admission=admission, out_dir=out_dir, retain=False, notify=notify,
                         sleep=self._wait, metrics=metrics)
        self.silence_token = int(silence_token)
        self.clients: dict[int, Client] = {}  # by front-end session
        self.labels: list[str] = []  # per front-end session: its client's id
        self._ids: dict[int, deque] = {}  # per session: the ids its ticks took, until sent
        self._input_of: dict[tuple[int, int], int] = {}  # (session, frame) -> the client's input frame number
        self._reshaping: set[int] = set()  # sessions with a session.update in their input queue
        self.t0 = 0.0  # the gateway's clock starts here (perf_counter)
        self._gauges_at = -math.inf  # when the pool's gauges were last read while napping (clock())
        self.error: str | None = None  # why the gateway itself failed (serve), if it did

    # -- the app's side (any thread) -----------------------------------------------------------------------------
    def open(self, client: Client) -> None:
        """A client wants in: the gate decides at the gateway's next turn (``client.decision``); once the gateway
        stopped, it is refused at once."""
        with self._door:
            if self._closed is None:
                self._post(("open", client))
                return
        client.loop.call_soon_threadsafe(client.decide, self._closed)
        client.loop.call_soon_threadsafe(client.gateway_done)

    def update_shape(self, client: Client) -> None:
        """The client put a new shape in its input queue: the gateway applies it when it reaches the queue's head
        and the front end can (:meth:`FrontEnd.reshape`: a frame boundary with nothing of the session owed)."""
        self._post(("shape", client))

    def close(self, client: Client) -> None:
        """The client left (or was closed): its session ends, its request is aborted in the engine."""
        self._post(("close", client))

    def stop(self, reason: str = EndReason.STOPPED) -> None:
        super().stop(reason)
        self._wake.set()

    def _post(self, item) -> None:
        self._inbox.append(item)
        self._wake.set()

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()
        self._idle_gauges()

    def _idle_gauges(self) -> None:
        """While no step runs, the pool's gauges (usage, running, waiting) are read from the engine at least every
        :data:`GAUGES_EVERY_S`: a step sets them, and once every session left no step runs to set them to the
        idle pool (not while the engine is down: the supervisor looks at it)."""
        m = self.sink.metrics
        now = self.clock()
        if m is None or now - self._gauges_at < GAUGES_EVERY_S or self.supervisor.down_since is not None:
            return
        self._gauges_at = now
        m.pool(self.engine.pool())

    def _interrupted(self) -> bool:
        return bool(self._inbox)

    # -- the gateway's thread ----------------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """Taking sessions: not stopped (the engine may have died for good)."""
        return self._stop_reason is None

    def serve(self) -> None:
        """Serve until :meth:`stop`: then every session still in is ended (``stopped``) and its client closed.

        A failure of the gateway itself (a bug: the engine's death is the front end's to handle) ends it too: the
        server stops taking sessions and says why (:attr:`error`; ``/ready`` and ``/health`` fail, so an
        orchestrator restarts it), every client is told (refused at the gate, or closed with 1011) and its
        accounts settle. The exception is raised again, for the thread's log."""
        try:
            self._serve([])
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self._stop_reason = GATEWAY_ERROR
            for i in list(self.clients):
                self._tell(i, "decide", GATEWAY_ERROR)  # (a client still at the gate: refused)
                self._tell(i, "end", GATEWAY_ERROR)
                self._tell(i, "gateway_done", None)
                self._forget(i)
            self._turn_away(GATEWAY_ERROR)
            if self.sink.metrics is not None:  # (it holds nobody now: its gauge, set at each turn, would stay)
                self.sink.metrics.sessions(0)
            raise
        self._turn_away(self._stop_reason or EndReason.STOPPED)

    def _turn_away(self, reason: str) -> None:
        """The gateway stopped: the clients it never decided on (offered at its last turn, or still in its inbox)
        are refused, so that no one waits at its gate for ever; a client that arrives later is refused at once
        (:meth:`open`)."""
        with self._door:
            self._closed = reason
            for i in list(self.clients):  # (the live and queued ones were ended or refused: the undecided are left)
                self._tell(i, "decide", reason)
                self._tell(i, "gateway_done", None)
                self._forget(i)
            while self._inbox:
                kind, client = self._inbox.popleft()
                if kind == "open":
                    client.loop.call_soon_threadsafe(client.decide, reason)
                    client.loop.call_soon_threadsafe(client.gateway_done)

    def _label(self, i: int) -> str:
        return self.labels[i]

    def _live_turn(self, now: float, t0: float) -> None:
        self.t0 = t0
        undecided = []
        while self._inbox:
            kind, client = self._inbox.popleft()
            if kind == "shape":
                if client.index in self.clients:
                    self._reshaping.add(client.index)
            elif kind == "open":
                self._arrive(client, now)
            elif client.index in self.clients and self.state[client.index] == NOT_ARRIVED:
                undecided.append((kind, client))  # (left before the gate decided: it leaves once it has)
            else:
                self._leave(client, now)
        self._inbox.extend(undecided)  # (the next turn's: this one's gate decides on it)
        for i in list(self._reshaping):
            self._apply_shapes(i)
        if self.sink.metrics is not None:
            self.sink.metrics.sessions(self._in_flight())
        super()._live_turn(now, t0)

    def _arrive(self, client: Client, now: float) -> None:
        # its own clock: the phase slot of its arrival (rounded up), so its first frame is due at once
        P = self.P
        slot = int(math.ceil((now % P) / P * serving.PHASE_SLOTS - 1e-9)) % serving.PHASE_SLOTS
        i = self.offer(now, phase_slot=slot)
        self.labels.append(client.sid)
        client.index = i
        self.clients[i] = client
        self._ids[i] = deque()

    def _apply_shapes(self, i: int) -> None:
        """The shapes at the head of session ``i``'s input queue that the front end takes now, in order. The
        session stays in :attr:`_reshaping` while any shape waits in its queue: one behind frames sent before it
        is applied at a later turn, once their ticks have taken them."""
        c = self.clients.get(i)
        while c is not None:
            head = _head(c.inputs)
            if head is None or head[0] != "shape":
                if _holds_shape(c.inputs):
                    return  # (frames sent before the shape go first: their ticks take them)
                break
            _, shape, message = head
            if not self.reshape(i, shape["frame_period_s"], shape["input_tokens_per_frame"],
                                shape["output_tokens_per_frame"], shape["deadline_s"]):
                return
            c.inputs.get_nowait()
            self._tell(i, "updated", message)
        self._reshaping.discard(i)

    def _leave(self, client: Client, now: float) -> None:
        i = client.index
        if i < 0 or i not in self.clients:
            return
        if self.state[i] == QUEUED:
            self.gate.queue = deque((s, t) for s, t in self.gate.queue if s != i)
            self._refuse(i, now, EndReason.DEPARTED)
        elif WAITING <= self.state[i] <= RUNNING:
            self._end(i, now, EndReason.DEPARTED)

    def _enter(self, i: int, t_enter: float) -> None:
        super()._enter(i, t_enter)
        self._ids[i].extend([self.silence_token] * int(self.prompt_of[i]))  # the first frame's prompt
        self._tell(i, "decide", "admit")

    def _refuse(self, i: int, now: float, reason: str) -> None:
        super()._refuse(i, now, reason)
        self._tell(i, "decide", reason)
        self._tell(i, "gateway_done", None)
        self._forget(i)

    def _ticked(self, idx: np.ndarray, f: np.ndarray) -> None:
        for i, fr in zip(idx.tolist(), f.tolist()):
            n = int(self.n_in_of[i])
            q = self.clients[i].inputs
            head = _head(q)  # (only this thread takes from the queue: the head stays until taken)
            if head is None or head[0] == "shape":  # nothing sent, or a new shape waits for its boundary
                seq, ids = None, [self.silence_token] * n
            else:
                seq, ids = q.get_nowait()
                if len(ids) != n:  # the app holds each frame to the shape in force at its place in the queue
                    raise RuntimeError(f"session {i}: an input frame of {len(ids)} ids under a shape of {n}")
            self._ids[i].extend(ids)
            if seq is not None:
                self._input_of[(i, fr)] = seq

    def _fresh(self, i: int, n: int) -> list[int]:
        q = self._ids[i]
        if len(q) < n:  # the ticks took every id the front end counts: a shortfall is a bug, not a client's doing
            raise RuntimeError(f"session {i}: {n} input ids wanted, {len(q)} taken by its ticks")
        return [q.popleft() for _ in range(n)]

    def _deliver(self, i: int, f: int, row: dict, ids: list[int]) -> None:
        seq = self._input_of.pop((i, f), None)
        if i not in self.clients:
            return
        if row["censored"]:
            if seq is not None:
                self._tell(i, "lost", 1)
            return
        latency = row["latency_s"]
        self._tell(i, "frame", {"type": "response.frame", "frame": row["frame"], "input": seq, "token_ids": ids,
                                "text": None, "silent": row["silent"], "late": not row["met_deadline"],
                                "latency_ms": None if latency is None else round(latency * 1e3, 3)})

    def _end(self, i: int, now: float, reason: str) -> None:
        super()._end(i, now, reason)  # (every frame it was owed is answered or censored there: _deliver)
        if i in self.clients:
            if reason != EndReason.DEPARTED:
                self._tell(i, "end", reason)
            self._tell(i, "gateway_done", None)
            self._forget(i)

    def _forget(self, i: int) -> None:
        self.clients.pop(i, None)
        self._reshaping.discard(i)
        self._ids.pop(i, None)

    def _tell(self, i: int, what: str, arg) -> None:
        c = self.clients[i]
        c.loop.call_soon_threadsafe(getattr(c, what), arg)


def _head(q: queue.Queue):
    """The oldest item of ``q`` without taking it, or None."""
    with q.mutex:
        return q.queue[0] if q.queue else None


def _holds_shape(q: queue.Queue) -> bool:
    """Whether a shape waits anywhere in ``q``."""
    with q.mutex:
        return any(item[0] == "shape" for item in q.queue)
