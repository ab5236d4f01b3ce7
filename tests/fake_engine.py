"""A fake engine for the driver's unit tests: vLLM 0.32's scheduler, as :class:`metronome.serving.EngineModel`
models it, on virtual time.

:class:`FakeEngine` implements the interface the driver uses (:class:`metronome.probe.engine.DrivenEngine`:
``append``, ``abort``, ``step`` -> :class:`StepInfo`, ``pool`` -> :class:`PoolState`, ``has_work``,
``is_scheduled_waiting``, ``tokens_of``, ``blocks_of``, ``computed_tokens``, ``reset``, ``policy``,
``max_model_len``, ``max_num_batched_tokens``, ``num_blocks``) as an engine that never dies (``pid`` None);
:class:`FakeRemoteEngine` is one in a 'child process', as :class:`metronome.probe.remote.RemoteEngine`
(``pid``, ``check_alive``, ``ready``, ``restart``), and can be killed at a virtual time.

Time is virtual: hand ``clock=eng.clock, sleep=eng.sleep`` to the Driver. Only ``step()`` (by its modelled
latency) and ``sleep()`` advance the clock, so a run is deterministic and takes no wall time.

**The scheduler is not the fake's own.** Every scheduling decision (who runs, with how many tokens, who is
preempted, who is admitted, how many blocks each request holds) is :class:`metronome.serving.EngineModel`'s,
the one model of vLLM 0.32's v1 scheduler and KV cache manager in the project, which
``tests/live/test_scheduler_differential.py`` proves step by step equal to vLLM's own ``Scheduler``. Its rules
(see ``metronome/serving.py``): running requests first, in running order, a dry pool preempting ``running[-1]``
by recompute (prepended to ``waiting``); then, only in a step that preempted nothing, the kv-holding queue
(paused sessions, and resumed ones in place) and after it the waiting queue, head first, each past the
full-sequence gate, the first that does not fit ending the pass; out-of-window blocks freed at the computed
count before each allocation; a paused session (``WAITING_FOR_STREAMING_REQ``) holds its blocks and is never
a preemption candidate, so a pool such sessions fill deadlocks the engine (0 running, work waiting, 0 free),
which the driver must break.

What the fake adds around the model:

* **Tokens.** The driver hands over token id lists; the model counts tokens. The fake keeps each request's
  list (prompt, chunks, sampled tokens; the last sampled one included) for the tests' log, hands the model
  counts (a new rid is ``EngineModel.add``, a paused one ``EngineModel.append``, which drops the last
  sampled token: the fake drops it from the list too, the caller re-feeds it) and samples token ids
  ``10, 11, ...`` for the requests the model says sampled. After every step it checks that each list's
  length is the model's token count and the model's pool accounting (``EngineModel.check``).
* **Pool.** ``num_blocks`` is vLLM's count, its null block included: the model gets ``num_blocks - 1``.
* **Plain requests.** ``resumable=False`` (vLLM's one-shot request): when the model pauses it, the fake
  aborts it and reports it in ``StepInfo.finished``, as vLLM finishes it.
* **Latency.** A step takes ``step_base_s + step_token_s * new_tokens`` virtual seconds, or what ``latency``
  says of the model's step record (the front-end differential hands it the simulator's step model).
* **Guards.** The fake raises :class:`FakeEngineMisuse` (an AssertionError) where real vLLM would reject the
  call or crash: an empty chunk, no token to sample, a chunk for a request that is not paused (one chunk in
  flight at a time), a request that would pass ``max_model_len``; and :class:`DriverSpins` when the driver
  reads the clock very many times without time moving on.

Every call that changes state is logged in ``eng.log`` as a dict (``op``, ``t``, ``step`` = steps done so
far, ...): ``append`` rows carry the exact ``tokens`` handed over, ``abort`` rows the request's tokens and
the pool as they were just before (``held_tokens``, ``status``, ``blocks``, ``free``, ``paused``), ``step``
rows the scheduled, preempted and admitted requests and the free blocks after the step. Tests read what the
driver told the engine from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metronome.kv_policy import KVPolicy
from metronome.probe.engine import PoolState, StepInfo
from metronome.probe.remote import EngineDied
from metronome.serving import PAUSED, PREEMPTED, WAITING, EngineLimits, EngineModel

SLEEP_MIN_S = 1e-6  # a real sleep never returns in zero time; it also keeps a spinning loop moving
SPIN_LIMIT = 100_000  # clock reads in a row without time moving on: the driver spins


class FakeEngineMisuse(AssertionError):
    """The driver did something vLLM would reject or crash on."""


class DriverSpins(AssertionError):
    """The driver kept reading the clock while nothing advanced it (neither a step nor a sleep)."""


@dataclass
class _Req:
    """What the fake keeps beside the model's request: the token ids, for the log, and the model's slot for it
    (the model names requests by slot; the fake, as vLLM, by id)."""

    tokens: list[int]
    resumable: bool
    slot: int


@dataclass
class FakeEngine:
    num_blocks: int  # vLLM's count, the null block included
    block_size: int = 16
    max_model_len: int = 4096
    policy: KVPolicy | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    step_base_s: float = 0.004
    step_token_s: float = 2e-5
    latency: object = None  # (serving.StepRecord) -> seconds, in place of the two terms above
    watermark_blocks: int = 0
    sleep_min_s: float = SLEEP_MIN_S  # 0: a sleep ends exactly when asked (the differential compares times)
    # the driver a client of vLLM's own loop (probe.own_loop's view): it never sees whom a step left waiting
    # or preempted (vLLM re-prefills a preempted request in its own queue)
    own_loop: bool = False
    now: float = 0.0
    log: list[dict] = field(default_factory=list)
    steps: int = 0
    pid: int | None = None  # an engine in this process: it never dies (FakeRemoteEngine can)

    def __post_init__(self):
        if self.policy is None:
            self.policy = KVPolicy.unbounded(self.block_size)
        assert self.policy.block_size == self.block_size
        self.limits = EngineLimits(num_blocks=self.num_blocks - 1, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, watermark_blocks=self.watermark_blocks)
        self._new_model()
        self._reqs: dict[str, _Req] = {}
        self._token = 0
        self._reads = 0
        self._last_read = -1.0

    def _new_model(self) -> None:
        """A new scheduler (a new engine process), whose slots start from 0 again."""
        self.model = EngineModel(self.policy, self.limits)
        self._rid_of: list[str] = []  # the model's slot -> the request's id

    # -- virtual time (pass to Driver(clock=..., sleep=...)) ---------------------------------------------
    def clock(self) -> float:
        if self.now == self._last_read:
            self._reads += 1
            if self._reads > SPIN_LIMIT:
                raise DriverSpins(f"{SPIN_LIMIT} clock reads at t={self.now} with no step or sleep")
        else:
            self._reads, self._last_read = 0, self.now
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += max(dt, 0.0) + self.sleep_min_s

    # -- what the driver reads ---------------------------------------------------------------------------
    def _count(self, *statuses: str) -> int:
        return sum(1 for r in self._reqs.values() if self.model.status(r.slot) in statuses)

    def pool(self) -> PoolState:
        free = self.model.free_blocks()
        used = self.limits.num_blocks - free
        return PoolState(free_blocks=free, used_blocks=used, kv_usage=used / self.limits.num_blocks,
                         running=len(self.model.running), waiting=self._count(WAITING, PREEMPTED),
                         paused=self._count(PAUSED))

    def has_work(self) -> bool:
        return self.model.has_work()

    def is_scheduled_waiting(self, rid: str) -> bool:
        return not self.own_loop and self.status_of(rid) in (WAITING, PREEMPTED)

    def tokens_of(self, rid: str) -> int:
        return self.model.tokens_of(self._reqs[rid].slot) if rid in self._reqs else 0

    def blocks_of(self, rid: str) -> int:
        return self.model.blocks_of(self._reqs[rid].slot) if rid in self._reqs else 0

    def computed_tokens(self, rid: str) -> int:
        return self.model.computed(self._reqs[rid].slot) if rid in self._reqs else 0

    def held_tokens(self, rid: str) -> list[int]:
        """The request's tokens (prompt, chunks, sampled tokens; the last sampled one included)."""
        r = self._reqs.get(rid)
        return [] if r is None else list(r.tokens)

    def status_of(self, rid: str) -> str | None:
        r = self._reqs.get(rid)
        return None if r is None else self.model.status(r.slot)

    def check_alive(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def restart(self) -> None:
        raise FakeEngineMisuse("the driver restarted an engine that never died")

    def describe(self) -> str:
        return "fake vLLM 0.32 (metronome.serving.EngineModel)"

    # -- calls that change state -------------------------------------------------------------------------
    def append(self, rid: str, tokens: list[int], max_tokens: int, resumable: bool = True) -> None:
        if not tokens:
            raise FakeEngineMisuse(f"empty chunk for {rid} (vLLM rejects it)")
        if max_tokens < 1:
            raise FakeEngineMisuse(f"{rid} asks for {max_tokens} tokens (vLLM needs at least one)")
        r = self._reqs.get(rid)
        new = r is None
        if not new and self.status_of(rid) != PAUSED:
            raise FakeEngineMisuse(f"chunk for {rid} while it is {self.status_of(rid)} "
                                   "(one chunk in flight at a time)")
        # a paused request's last sampled token was never computed: vLLM drops it, the caller re-feeds it
        after = len(tokens) if new else len(r.tokens) - 1 + len(tokens)
        if after + max_tokens > self.max_model_len:
            raise FakeEngineMisuse(f"{rid} would reach {after + max_tokens} tokens, over max_model_len "
                                   f"{self.max_model_len} (vLLM dies)")
        if new:
            self._reqs[rid] = _Req(list(tokens), resumable, self.model.add(len(tokens), max_tokens))
            self._rid_of.append(rid)
        else:
            self.model.append(r.slot, len(tokens), max_tokens)
            r.tokens.pop()
            r.tokens.extend(tokens)
        self.log.append({"op": "append", "t": self.now, "step": self.steps, "rid": rid, "tokens": list(tokens),
                         "max_tokens": max_tokens, "new": new})

    def abort(self, rid: str) -> None:
        r = self._reqs.get(rid)
        row = {"op": "abort", "t": self.now, "step": self.steps, "rid": rid, "known": r is not None}
        if r is not None:
            row.update(held_tokens=list(r.tokens), status=self.status_of(rid), blocks=self.blocks_of(rid),
                       free=self.model.free_blocks(), paused=self._count(PAUSED))
            self._drop(rid)
        self.log.append(row)

    def _drop(self, rid: str) -> None:
        self.model.abort(self._reqs.pop(rid).slot)

    def reset(self) -> None:
        for rid in list(self._reqs):
            self._drop(rid)

    def step(self, wait_s: float | None = None) -> StepInfo:
        t0 = self.now
        rec = self.model.step()
        ids = self._rid_of
        scheduled = {ids[s]: k for s, k in rec.scheduled.items()}
        info = StepInfo(t_start=t0, duration_s=0.0, batch=len(scheduled), new_tokens=rec.new_tokens,
                        context_tokens=0, prefill_tokens=sum(n for n in scheduled.values() if n > 1),
                        preempted=[] if self.own_loop else [ids[s] for s in rec.preempted], scheduled=scheduled)
        for rid in scheduled:
            info.computed[rid] = self.computed_tokens(rid)
            info.context_tokens += info.computed[rid]
        for rid in (ids[s] for s in rec.sampled):
            tok = 10 + self._token % 990
            self._token += 1
            self._reqs[rid].tokens.append(tok)
            info.outputs[rid] = [tok]
        for rid in [ids[s] for s in rec.paused]:
            if not self._reqs[rid].resumable:  # a plain request finishes where a streaming one pauses
                self._drop(rid)
                info.finished.append(rid)
        self.model.check()
        for rid, r in self._reqs.items():
            assert len(r.tokens) == self.tokens_of(rid), (rid, len(r.tokens), self.tokens_of(rid))
        info.duration_s = (self.step_base_s + self.step_token_s * info.new_tokens if self.latency is None
                           else float(self.latency(rec)))
        self.now += info.duration_s
        self.steps += 1
        self.log.append({"op": "step", "t": self.now, "t_start": t0, "step": self.steps,
                         "scheduled": scheduled, "preempted": [ids[s] for s in rec.preempted],
                         "admitted": [ids[s] for s in rec.admitted],
                         "sampled": {r: t[0] for r, t in info.outputs.items()},
                         "free": self.model.free_blocks()})
        return info

    # -- helpers for tests ------------------------------------------------------------------------------
    def appends(self, rid: str | None = None) -> list[dict]:
        return [e for e in self.log if e["op"] == "append" and (rid is None or e["rid"] == rid)]

    def aborts(self, rid: str | None = None) -> list[dict]:
        return [e for e in self.log if e["op"] == "abort" and (rid is None or e["rid"] == rid)]


@dataclass
class FakeRemoteEngine(FakeEngine):
    """The fake in a 'child process': it can die (:meth:`kill`), and then every call raises
    :class:`EngineDied`, as :class:`~metronome.probe.remote.RemoteEngine`'s would. :meth:`restart` throws the
    state away and loads a fresh engine for ``load_s`` virtual seconds (``ready()`` is False meanwhile, the
    pool reads empty and ``append`` raises, as RemoteEngine does while restarting)."""

    load_s: float = 0.5
    pid: int | None = 1000
    die_at_s: float | None = None  # the process dies once the virtual clock reaches this
    restarted_at: list[float] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        self._loading_until: float | None = None
        self._dead = False

    def kill(self, at_s: float | None = None) -> None:
        self.die_at_s = self.now if at_s is None else at_s

    def _died(self) -> bool:
        if (not self._dead and self._loading_until is None and self.die_at_s is not None
                and self.now >= self.die_at_s):
            self._dead = True  # its requests' KV is gone with it; log what they held
            self.log.append({"op": "died", "t": self.now, "step": self.steps,
                             "held_tokens": {rid: list(r.tokens) for rid, r in self._reqs.items()}})
        return self._dead

    def _alive_or_raise(self) -> None:
        if self._died():
            raise EngineDied(f"the engine process (pid {self.pid}) was killed by SIGKILL")
        if self._loading_until is not None:
            raise EngineDied("the engine is not running (it is restarting)")

    def check_alive(self) -> None:
        if self._loading_until is None and self._died():
            raise EngineDied(f"the engine process (pid {self.pid}) was killed by SIGKILL")

    def ready(self) -> bool:
        if self._loading_until is None:
            return True
        if self.now < self._loading_until:
            return False
        self._loading_until = None
        return True

    def restart(self) -> None:
        FakeEngine.reset(self)
        self._new_model()
        self._dead, self.die_at_s = False, None
        self.pid = (self.pid or 0) + 1
        self._loading_until = self.now + self.load_s
        self.restarted_at.append(self.now)
        self.log.append({"op": "restart", "t": self.now, "step": self.steps})

    # every call the driver makes goes through the 'process'
    def step(self, wait_s: float | None = None) -> StepInfo:
        self._alive_or_raise()
        return super().step()

    def append(self, rid, tokens, max_tokens, resumable=True) -> None:
        self._alive_or_raise()
        super().append(rid, tokens, max_tokens, resumable)

    def abort(self, rid) -> None:
        self._alive_or_raise()
        super().abort(rid)

    def reset(self) -> None:
        if self._loading_until is None:
            self._alive_or_raise()
            super().reset()

    def _loading(self) -> bool:
        return self._loading_until is not None

    def pool(self) -> PoolState:
        if self._loading():
            return PoolState(0, 0, 0.0, 0, 0, 0)
        self._alive_or_raise()
        return super().pool()

    def has_work(self) -> bool:
        if self._loading():
            return False
        self._alive_or_raise()
        return super().has_work()

    def is_scheduled_waiting(self, rid) -> bool:
        if self._loading():
            return False
        self._alive_or_raise()
        return super().is_scheduled_waiting(rid)

    def tokens_of(self, rid) -> int:
        if self._loading():
            return 0
        self._alive_or_raise()
        return super().tokens_of(rid)

    def blocks_of(self, rid) -> int:
        if self._loading():
            return 0
        self._alive_or_raise()
        return super().blocks_of(rid)

    def computed_tokens(self, rid) -> int:
        if self._loading():
            return 0
        self._alive_or_raise()
        return super().computed_tokens(rid)


def rebased_readmissions(events: list[dict]) -> set[str]:
    """The rids of readmissions that came back rebased (the driver's ``rebase`` event at the same moment)."""
    rebased = {(e["session"], e["t_s"]) for e in events if e["event"] == "rebase"}
    return {e["rid"] for e in events if e["event"] == "readmit" and (e["session"], e["t_s"]) in rebased}


def token_id_errors(eng: FakeEngine, sink_tokens: int = 0,
                    rebased: set[str] = frozenset()) -> tuple[list[str], dict[str, int]]:
    """Replay the fake's log and check the token ids the driver handed it against what the engine held
    (vLLM's rules for a streaming request, and the session's own history). Returns what broke them, and how
    many of each check ran (``refeed``, ``readmit``, ``rebase``), so a test can tell that it checked something:

    * every chunk appended to a paused request starts with the token that request sampled last (vLLM dropped
      it from the history; the caller must re-feed exactly that one);
    * a readmitted request (``sid.pN``) after an abort starts with everything the aborted request held, in
      order, the tokens it sampled included: nothing lost, nothing reordered, at a preemption;
    * a rebased request (``sid.rN``, or a readmission in ``rebased``: :func:`rebased_readmissions`) keeps the
      previous request's first ``sink_tokens`` ids and then a run of its last ids ending at the token it sampled
      last (when it keeps that one), as ``serving.rebase_ids`` says.
    """
    held: dict[str, list[int]] = {}  # by rid: what the engine holds, replayed
    gone: dict[str, list[int]] = {}  # by session: what its last aborted request held
    current: dict[str, str] = {}  # by session: its live rid
    errors: list[str] = []
    checked = {"refeed": 0, "readmit": 0, "rebase": 0}
    for e in eng.log:
        if e["op"] == "step":
            for rid, tok in e.get("sampled", {}).items():
                held[rid].append(tok)
        elif e["op"] == "abort" and e["known"]:
            sid = e["rid"].split(".")[0]
            if held[e["rid"]] != e["held_tokens"]:
                errors.append(f"replay of {e['rid']} differs from what the engine held")
            gone[sid] = held.pop(e["rid"])
            current.pop(sid, None)
        elif e["op"] == "append":
            rid, toks = e["rid"], e["tokens"]
            sid, _, kind = rid.partition(".")
            if not e["new"]:
                checked["refeed"] += 1
                if toks[0] != held[rid][-1]:
                    errors.append(f"{rid}: chunk starts with {toks[0]}, not the sampled {held[rid][-1]}")
                held[rid] = held[rid][:-1] + list(toks)
                continue
            aborted = sid not in current  # (a request lost with its engine was never aborted)
            prev = gone.pop(sid, None) if aborted else held.get(current[sid])
            if kind.startswith("p") and prev is not None and aborted and rid not in rebased:
                checked["readmit"] += 1
                if toks[:len(prev)] != prev:
                    errors.append(f"{rid}: readmission prompt does not start with the {len(prev)} ids it held")
            elif ((kind.startswith("r") or rid in rebased) and prev is not None
                  and prev[-1] in toks[sink_tokens:]):
                s = min(sink_tokens, len(prev))
                # (where the re-fed token sits: input ids are random and may repeat it, so any place that makes
                # the ids before it a run of the last ones will do)
                checked["rebase"] += 1
                ends = [p + 1 for p in range(s, len(toks)) if toks[p] == prev[-1]]
                if toks[:s] != prev[:s] or not any(prev[len(prev) - (p - s):] == toks[s:p] for p in ends):
                    errors.append(f"{rid}: rebase kept {toks[:ends[0]]}, not the sinks and a run of the last ids")
            held[rid] = list(toks)
            current[sid] = rid
    return errors, checked
