"""A driven engine in slots: what the front end asks of an engine, answered over vLLM's request ids and token ids.

:class:`metronome.front_end.FrontEnd` decides on counts and talks to its engine in slots, with
:class:`metronome.serving.EngineModel`'s interface (``add``, ``append``, ``append_many``, ``abort``, ``step`` ->
:class:`metronome.serving.StepRecord`, ``free_blocks``, ``waiting_of``, ...). A live engine
(:class:`metronome.probe.engine.DrivenEngine`: vLLM in process, on its own loop, or the tests' fake) takes request
ids and token ids. :class:`SlotEngine` stands between them:

* **Slots and names.** Each request the front end adds gets the next slot (slots are never reused: the front end
  names a request by its slot, as it does the engine model's) and a name
  vLLM sees: the session's label (``s<i>`` unless told) for its first request, ``<label>.p<n>`` for a
  readmission, ``<label>.r<n>`` for a rebase (a readmission the length limit cut down included), ``n`` counting
  the session's requests.
* **Token ids.** It keeps the ids each live request holds, exactly as vLLM holds them (the prompt, each chunk after
  vLLM dropped the re-fed token, every sampled id), and the ids of each session's last aborted request, so that
  a new request can be built from what the old one held (:class:`metronome.serving.Origin` says which new request
  it is). Fresh ids (a prompt, a frame's input, the input of frames heard as silence) come from ``fresh(session,
  n)``: drawn at random by the load generator, a client's own by a server. A rebase keeps the ids
  :func:`metronome.serving.rebase_request_ids` says, the count rule's own statement on ids.
* **Engine death.** Nothing is half done when the engine dies inside a call: each call changes its books only once
  the engine took it, and :meth:`SlotEngine.lost` keeps every live request's ids for the session's next request.
* **Checks.** Every new request's ids must number what the front end counted, and be built from a history as
  long as the front end's; :meth:`SlotEngine.check` compares every live request's ids with the engine's token
  count. A front end whose counts drift from the engine fails there, not in a wrong prompt sent to vLLM.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from metronome import serving
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.serving import EngineLimits, Origin, StepRecord

_LIVE = "live"  # status of a request the engine holds (the front end only asks whether it holds one)


class SlotEngine:
    """``engine`` (a :class:`metronome.probe.engine.DrivenEngine`) in slots, for ``FrontEnd``. ``keep_tokens``:
    what a rebase keeps (``serving.rebase_keep_tokens``); ``fresh(session, n)``: ``n`` new input ids."""

    def __init__(self, engine, policy: KVPolicy, limits: EngineLimits, keep_tokens: int,
                 fresh: Callable[[int, int], list[int]], label: Callable[[int], str] | None = None):
        self.engine, self.policy, self.limits = engine, policy, limits
        self.keep = int(keep_tokens)
        self.fresh = fresh
        self.label = label if label is not None else "s{}".format
        self.current: dict[int, str] = {}  # session -> the name of its latest request
        self.last_freed = 0  # blocks the last aborted request held
        self.finished: list[int] = []  # sessions whose request the engine ended on its own in the last step
        self.name_of: list[str] = []  # slot -> the engine's request id
        self.session_of: list[int] = []  # slot -> the front end's session
        self._slot_by_name: dict[str, int] = {}  # live engine request id -> slot
        self.held: dict[int, list[int]] = {}  # live slot -> the ids its request holds
        self.gone: dict[int, list[int]] = {}  # session -> the ids its last aborted request held
        self.requests: dict[int, int] = {}  # session -> requests it has had
        self.steps = 0
        self.last_info = None  # the engine's report of the last step (a live front end reads its times, its ids)

    # -- new requests ------------------------------------------------------------------------------------
    def _ids(self, prompt_tokens: int, max_tokens: int, o: Origin) -> tuple[list[int], str]:
        """The ids of ``o``'s new request and the letter of its name."""
        i = o.session
        prev = self.gone.get(i, [])
        if o.kind == "first":
            if prev:
                raise MetronomeError(f"session {i}: a first request after one was aborted")
            ids, tag = self.fresh(i, o.tokens), ""
        elif o.kind == "readmit":  # everything the aborted request held, then the input heard as silence
            if len(prev) != o.history:
                raise MetronomeError(f"session {i}: readmitted with a history of {o.history} tokens; its request "
                                     f"held {len(prev)}")
            ids, tag = prev + self.fresh(i, o.tokens - o.history), "p"
            if prompt_tokens < len(ids):  # past max_model_len: what a rebase keeps of it
                ids, tag = serving.rebase_ids(self.policy, ids, self.keep), "r"
        elif o.kind == "rebase":  # the history before the token sampled last, then the chunk re-feeding that token
            history, head = (prev[:-1], prev[-1:]) if prev else ([], [])
            if len(history) != o.history:
                raise MetronomeError(f"session {i}: rebased with a history of {o.history} tokens; its request "
                                     f"held {len(history)} before the token it sampled last")
            chunk = head + self.fresh(i, o.tokens - len(head))
            kept, chunk = serving.rebase_request_ids(self.policy, history, chunk, max_tokens, self.keep,
                                                     self.limits.max_model_len)
            ids, tag = kept + chunk, "r"
        else:
            raise MetronomeError(f"unknown kind of request {o.kind!r}")
        if len(ids) != prompt_tokens:
            raise MetronomeError(f"session {i}: a {o.kind} request of {len(ids)} ids where the front end counted "
                                 f"{prompt_tokens}")
        return ids, tag

    def add(self, prompt_tokens: int, max_tokens: int, origin: Origin | None = None) -> int:
        if origin is None:
            raise MetronomeError("a live engine needs each request's origin to build its token ids")
        ids, tag = self._ids(prompt_tokens, max_tokens, origin)
        i = origin.session
        n = self.requests.get(i, 0)
        name = self.label(i) if not n and not tag else f"{self.label(i)}.{tag or 'p'}{n}"
        self.engine.append(name, ids, max_tokens)
        self.requests[i] = n + 1
        self.gone.pop(i, None)
        self.current[i] = name
        s = len(self.name_of)
        self.name_of.append(name)
        self.session_of.append(i)
        self._slot_by_name[name] = s
        self.held[s] = list(ids)
        return s

    # -- the next frame, and the end of a request ------------------------------------------------------------
    def append(self, s: int, chunk_tokens: int, max_tokens: int) -> None:
        """The next frame's ``chunk_tokens`` for paused request ``s``: the token it sampled last (vLLM dropped it
        from the request: it is re-fed), then fresh input."""
        held = self._held(s)
        ids = held[-1:] + self.fresh(self.session_of[s], chunk_tokens - 1)
        self.engine.append(self.name_of[s], ids, max_tokens)
        held[-1:] = ids

    def append_many(self, slots: np.ndarray, chunk_tokens, max_tokens) -> None:
        """:meth:`append` for each slot (chunks and max tokens one for all or one per slot); if the engine dies part
        way, the books are as before the call."""
        done = []
        try:
            for s, k, m in zip(slots.tolist(), np.broadcast_to(chunk_tokens, slots.shape).tolist(),
                               np.broadcast_to(max_tokens, slots.shape).tolist()):
                last = self.held[s][-1:]
                self.append(s, k, m)
                done.append((s, last, k))
        except BaseException:
            for s, last, k in done:
                self.held[s][-k:] = last  # the chunk (the re-fed token, then its input) back to the token alone
            raise

    def abort(self, s: int) -> None:
        """Abort request ``s``; its ids are kept for the session's next request (a readmission or a rebase starts
        from them) until the session ends."""
        self._held(s)
        name = self.name_of[s]
        freed = self.engine.blocks_of(name)
        self.engine.abort(name)
        self.last_freed = freed
        del self._slot_by_name[name]
        self.gone[self.session_of[s]] = self.held.pop(s)

    def lost(self) -> None:
        """The engine died with every request: each live request's ids are kept for its session's next request,
        as an abort's are, and nothing is aborted."""
        for s, ids in self.held.items():
            self.gone[self.session_of[s]] = ids
        self.held, self._slot_by_name = {}, {}
        self.last_freed = 0

    def session_ended(self, session: int) -> None:
        self.gone.pop(session, None)

    # -- one step ------------------------------------------------------------------------------------------
    def step(self, wait_s: float | None = None) -> StepRecord | None:
        """One engine step; None when an engine on its own loop has reported none within ``wait_s``. A request the
        engine ended on its own (a streaming request only pauses, but vLLM ends one at its own length cap) is still
        the front end's to end: its session is in :attr:`finished`."""
        info = self.engine.step(wait_s)
        if info is None:
            return None
        self.steps += 1
        self.last_info = info
        by = self._slot_by_name
        self.finished = [self.session_of[by[n]] for n in info.finished if n in by]
        slots = np.array([by[n] for n in info.scheduled], dtype=np.int64)
        sampled = []
        for n, toks in info.outputs.items():
            if toks:
                s = by[n]
                self.held[s].extend(toks)
                sampled.append(s)
        rec = StepRecord(slots, np.array(list(info.scheduled.values()), dtype=np.int64),
                         preempted=[by[n] for n in info.preempted], used_blocks=self.used,
                         sampled_slots=np.array(sampled, dtype=np.int64),
                         engine_batch=info.batch)
        # the context the step model prices: what the policy keeps of each scheduled request after the step
        computed = np.array([info.computed[n] for n in info.scheduled], dtype=np.int64)
        rec.context_tokens = int(self.policy.resident_tokens(computed).sum())
        return rec

    # -- what the front end reads ------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks held now (as ``EngineModel.used``: an abort since the last step shows)."""
        return self.engine.pool().used_blocks

    def _held(self, s: int) -> list[int]:
        """The ids live request ``s`` holds (one aborted, or lost with the engine, holds none)."""
        held = self.held.get(s)
        if held is None:
            raise MetronomeError(f"no live request in slot {s}")
        return held

    def status(self, s: int) -> str | None:
        return _LIVE if s in self.held else None

    def free_blocks(self) -> int:
        return self.engine.pool().free_blocks

    def has_work(self) -> bool:
        return self.engine.has_work()

    def tokens_of(self, s: int) -> int:
        self._held(s)
        return self.engine.tokens_of(self.name_of[s])

    def computed(self, s: int) -> int:
        self._held(s)
        return self.engine.computed_tokens(self.name_of[s])

    def blocks_of(self, s: int) -> int:
        self._held(s)
        return self.engine.blocks_of(self.name_of[s])

    def held_of(self, slots: np.ndarray) -> np.ndarray:
        return np.array([self.engine.blocks_of(self.name_of[s]) for s in slots.tolist()], dtype=np.int64)

    def waiting_of(self, slots: np.ndarray) -> np.ndarray:
        return np.array([self.engine.is_scheduled_waiting(self.name_of[s]) for s in slots.tolist()], dtype=bool)

    def name(self, session: int) -> str:
        """The name of session ``session``'s latest request (its label before it had one)."""
        return self.current.get(session, self.label(session))

    def held_tokens(self) -> int:
        """Tokens the engine has computed for the live requests."""
        return sum(self.engine.computed_tokens(self.name_of[s]) for s in self.held)

    def check(self) -> None:
        """Every live request's ids are as many as the engine's tokens (vLLM keeps its own books)."""
        for s, ids in self.held.items():
            n = self.engine.tokens_of(self.name_of[s])
            assert len(ids) == n, f"{self.name_of[s]}: {len(ids)} ids kept, the engine holds {n} tokens"
