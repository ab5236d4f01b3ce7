"""The serving rules: how a vLLM v1 engine schedules streaming sessions, written once.

Pure (no clock, no engine, no SimPy, no vLLM import). The simulator (``metronome.sim.engine``) and the
live driver (``metronome.probe.driver``) both call it, and ``tests/live/test_scheduler_differential.py``
drives vLLM's own ``Scheduler`` beside :class:`EngineModel` and asserts they agree step by step.

**A session is one resumable vLLM request** (streaming input). Its life, as vLLM 0.32 runs it:

* a new request waits in the ``waiting`` queue; a session paused between frames
  (``WAITING_FOR_STREAMING_REQ``) keeps its blocks and sits in the ``kv_holding`` queue, where
  ``schedule()`` skips it; appending its next frame's input turns it back to waiting *in place*;
* **one step** (``Scheduler.schedule``): first every RUNNING request, in running order, asks for the
  blocks its new tokens need; when the pool is dry the *last* running request (``running[-1]``) is
  preempted by recompute (all its blocks freed, ``computed = 0``, prepended to ``waiting``) and the
  allocation retried; a request that would preempt itself ends the running pass. Then, **only if nothing
  was preempted**, the ``kv_holding`` queue and after it the ``waiting`` queue are admitted head first;
  the first that does not fit ends the pass (no later, smaller request jumps it);
* a request's blocks (``KVCacheManager.allocate_slots``): sliding/sink blocks that left the window at
  the request's *computed* count are freed first, then ``cdiv(computed + k, bs) − slots`` new blocks are
  taken (``slots`` counts freed slots too: vLLM keeps a null block in them). A waiting request must
  also pass the full-sequence gate first: ``min(cdiv(tokens, bs), cap) − slots`` blocks (``cap`` =
  the policy's admission cap, :meth:`KVPolicy.admission_cap_blocks`) plus the watermark must be free;
* after the step each request whose tokens are all computed samples one token; one that reached its
  frame's ``max_tokens`` pauses (its last sampled token is dropped from its history when the next
  input is appended: the driver re-feeds it).

**What vLLM 0.32 gets wrong, and what we do about it (the one place this is said).** A paused session is
not a preemption candidate, so when the pool runs dry at a frame boundary every resumed session waits for
blocks that only a paused one could free, and the engine stalls (0 running, N waiting, 0 free). The live
driver breaks it the way a serving front end has to, and the simulator models exactly that
(:func:`deadlock_victims`): after a step that left a session with work unscheduled for want of blocks
(or scheduled nothing at all), it aborts the **most recently admitted** session, puts it at the head of
its own waiting queue, and later readmits it as a **new request whose prompt is its whole history**.

The other rules of a session's life are here too: the frame clock (:func:`join_frame`), what a frame may
reach before ``max_model_len`` (:func:`frame_fits`) and what happens then (:func:`length_outcome`), what
a session needs to be (re)admitted (:func:`admission_need_blocks`), what makes a frame silent
(:func:`frame_is_silent`), the admission gate with its queue and timeout (:class:`AdmissionGate`), and
the named reasons a session ends (:class:`EndReason`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, cdiv

# ------------------------------------------------------------------------------------------ frame clock
_TICK_EPS = 1e-9

PHASES = ("independent", "aligned")
"""The two regimes of a session's frame clock. ``aligned``: frame ``f`` of every session ticks at ``f·P``
and the engine serves them in lockstep (a fixed-batch server such as Moshi's own). ``independent``: each
client connected at its own moment, so session ``i``'s frame ``f`` ticks at ``φ_i + f·P``, and vLLM's loop
steps whenever any request has work, batching the frames that have arrived (vLLM serving real clients)."""

PHASE_SLOTS = 64
"""Independent phases are drawn uniformly on a grid of ``P / PHASE_SLOTS``. Sessions on one grid point tick
together, so a run's frames table has at most ``PHASE_SLOTS`` rows per period however many sessions it
has. 64 slots put the phases 1.25 ms apart at Moshi's 80 ms period: below the spread of a step's latency,
so the batches a step meets are those of continuous phases up to one slot."""


LOOPS = ("driver", "vllm")
"""Who steps the engine, and so what the front end can see when the pool runs dry. ``driver``: the front end
steps vLLM itself (the probe's default) and reads its scheduler after each step, so it sees a session whose
work vLLM left waiting for want of blocks, and each request vLLM preempted, at once. ``vllm``: vLLM's own
loop steps on its own in its own process (``AsyncLLM``, ``vllm serve``) and the front end is a client that
sees only what the loop reports: it breaks a deadlock only once a step schedules nothing, and leaves a
request vLLM preempted to vLLM (which re-prefills it in its own queue). :func:`sees_starvation`."""


def check_loop(loop: str) -> str:
    if loop not in LOOPS:
        raise MetronomeError(f"--loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    return loop


def sees_starvation(loop: str) -> bool:
    """True when the front end sees, after each step, which sessions vLLM left waiting for blocks and which it
    preempted (it steps the engine itself); False for a client of vLLM's own loop (:data:`LOOPS`)."""
    return check_loop(loop) == "driver"


def check_phases(phases: str) -> str:
    if phases not in PHASES:
        raise MetronomeError(f"--phases must be one of {', '.join(PHASES)}, got {phases!r}")
    return phases


def phase_offset_s(slot, period_s: float):
    """The phase of a session on grid point ``slot`` (ints or arrays): ``slot · P / PHASE_SLOTS``."""
    return slot * (period_s / PHASE_SLOTS)


def frame_tick(frame, period_s: float, phase_s=0.0):
    """When frame ``frame`` of a session with phase ``phase_s`` ticks: ``f·P + φ`` (ints or arrays)."""
    return frame * period_s + phase_s


def tick_key(frame, slot):
    """An integer that orders ticks exactly (frame, then phase slot): ``f·PHASE_SLOTS + slot``."""
    return frame * PHASE_SLOTS + slot


def join_frame(arrival_s: float, period_s: float, phase_s: float = 0.0) -> int:
    """The first frame a session that arrives at ``arrival_s`` streams: the first ``f`` with
    ``f·P + φ >= t`` (an arrival exactly on a tick streams that tick's frame)."""
    return max(int(math.ceil((arrival_s - phase_s) / period_s - _TICK_EPS)), 0)


# ------------------------------------------------------------------------------------- session endings
class EndReason:
    """Why a session left: the one vocabulary of the simulator's and the live run's sessions tables."""

    DEPARTED = "departed"  # its duration ran out (the client hung up)
    LENGTH = "length"  # it reached max_model_len and the policy finishes rather than rebases
    HORIZON = "horizon"  # still running when the run ended
    REFUSED = "refused"  # the admission controller refused it at the door
    QUEUE_TIMEOUT = "queue_timeout"  # it waited in the admission queue past the timeout
    ENGINE_FINISHED = "engine_finished"  # the engine ended the request on its own (live only)
    STOPPED = "stopped"  # the run was stopped (Ctrl-C, SIGTERM; live only)
    ENGINE_DIED = "engine_died"  # the engine died and was not restarted (live only)

    ALL = (DEPARTED, LENGTH, HORIZON, REFUSED, QUEUE_TIMEOUT, ENGINE_FINISHED, STOPPED, ENGINE_DIED)
    NOT_ADMITTED = (REFUSED, QUEUE_TIMEOUT)


# -------------------------------------------------------------------------------------- length limit
CAPS = ("rebase", "finish")


def frame_fits(tokens_after_frame: int, max_model_len: int) -> bool:
    """May a frame run that leaves its request holding ``tokens_after_frame`` tokens (history, the frame's
    input and its outputs; ints or arrays)? vLLM stops a request once ``num_tokens >= max_model_len`` (and dies if a
    streaming chunk passes it), so the frame must end strictly below."""
    return tokens_after_frame < max_model_len


def default_cap(policy: KVPolicy) -> str:
    """Bounded sessions are rebased at the length limit (S sinks + the last W tokens carry on); unbounded
    ones finish, as a plain vLLM request does."""
    return "rebase" if policy.bounded else "finish"


def length_outcome(policy: KVPolicy, cap: str | None = None) -> str:
    cap = cap or default_cap(policy)
    if cap not in CAPS:
        raise MetronomeError(f"cap must be one of {', '.join(CAPS)}, got {cap!r}")
    return cap


def rebase_keep_tokens(policy: KVPolicy, max_model_len: int) -> int:
    """Tokens a rebased session keeps: S sinks + W window under the bound, half the context otherwise."""
    kept = policy.rebase_tokens()
    return kept if kept is not None else max_model_len // 2


# ------------------------------------------------------------------------------------------- admission
def admission_need_blocks(policy: KVPolicy, tokens: int, cap_blocks: int | None, slots: int = 0) -> int:
    """Blocks vLLM's full-sequence gate wants free to admit a request of ``tokens`` tokens that already has
    ``slots`` block slots: ``max(min(cdiv(tokens, bs), cap) − slots, 0)``. ``cap`` is the KV spec's admission
    cap (None for full attention): a bounded session reserves its peak in-flight residency, not its
    history. Works on ints and on numpy arrays alike."""
    need = cdiv(tokens, policy.block_size)
    if cap_blocks is not None:
        need = np.minimum(need, cap_blocks)
    return np.maximum(need - slots, 0)


def blocks_to_resume(policy: KVPolicy, tokens: int, computed: int, held: int, cap_blocks: int | None) -> int:
    """Free blocks a waiting request of ``tokens`` tokens (``computed`` of them computed, ``held`` blocks held)
    needs before vLLM schedules the rest of it: the full-sequence gate's, or the allocation's once its
    out-of-window blocks are freed, whichever is larger, and at least one (it is starved for *something*)."""
    slots = int(cdiv(computed, policy.block_size))
    gate = admission_need_blocks(policy, tokens, cap_blocks, slots)
    freed = held - int(policy.resident_blocks(computed)) if computed else 0
    alloc = int(cdiv(tokens, policy.block_size)) - slots - freed
    return max(gate, alloc, 1)


def admit_fcfs(waiting, need, free: int) -> list:
    """FCFS admission from a waiting queue (a deque, oldest first): pop the head while ``need(head)`` blocks
    fit in ``free`` (less what the heads admitted before it take), and stop at the first that does not — a
    later, smaller request never jumps the queue (vLLM's waiting pass does the same). Returns the admitted."""
    admitted = []
    while waiting:
        n = need(waiting[0])
        if n > free:
            break
        free -= n
        admitted.append(waiting.popleft())
    return admitted


def frame_is_silent(tokens_delivered: int) -> bool:
    """A frame is silent when the session got no token for it: waiting, re-prefilling or preempted. It is
    answered on time, empty, which is the failure a latency metric cannot see."""
    return tokens_delivered == 0


# ------------------------------------------------------------------------------------ the engine model
WAITING, RUNNING, PAUSED, PREEMPTED = "waiting", "running", "paused", "preempted"


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler settings a step depends on (vLLM's SchedulerConfig and pool)."""

    num_blocks: int  # blocks requests can hold (vLLM's pool less its null block)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    watermark_blocks: int = 0
    max_in_flight_tokens: int | None = None  # default: max_num_batched_tokens (one batch in flight)
    long_prefill_token_threshold: int = 0

    @property
    def in_flight_tokens(self) -> int:
        return self.max_in_flight_tokens if self.max_in_flight_tokens is not None else self.max_num_batched_tokens


_CODE = {WAITING: 1, RUNNING: 2, PAUSED: 3, PREEMPTED: 4}
_NAME = {v: k for k, v in _CODE.items()}
_W, _R, _P, _X = 1, 2, 3, 4  # waiting, running, paused, preempted (0: no request in the slot)


@dataclass
class StepRecord:
    """What one ``schedule()`` did: the fields the differential test compares with vLLM.

    ``slots``/``tokens``: the scheduled requests' slots and tokens, in schedule order (``EngineModel.rid_of``
    turns a slot into its request id; ``scheduled`` is the same as a dict of request ids)."""

    slots: np.ndarray
    tokens: np.ndarray
    preempted: list = field(default_factory=list)  # request ids, in order
    admitted: list = field(default_factory=list)  # request ids moved from a waiting queue to running
    used_blocks: int = 0  # after scheduling
    sampled_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    paused_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rid_of: list = field(default_factory=list, repr=False)

    @property
    def scheduled(self) -> dict:
        return {self.rid_of[s]: k for s, k in zip(self.slots.tolist(), self.tokens.tolist())}

    @property
    def sampled(self) -> list:
        return [self.rid_of[s] for s in self.sampled_slots.tolist()]

    @property
    def paused(self) -> list:
        return [self.rid_of[s] for s in self.paused_slots.tolist()]

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.sum())


class EngineModel:
    """vLLM v1's scheduler and KV cache manager for streaming sessions, at block granularity.

    The interface is the live engine's: :meth:`add` a request, :meth:`append` the next frame's input to a
    paused one, :meth:`abort`, :meth:`step`. No prefix caching, no speculative decoding, one batch in
    flight (what the probe runs). Residency comes from the :class:`KVPolicy` (sink+window blocks freed on
    the computed-token basis before each allocation, as ``remove_skipped_blocks`` does).

    Requests live in slots of numpy arrays (:meth:`add` returns the slot), so a step's common case — every
    running request gets its blocks, a prefix of the waiting queue is admitted — is a few array operations;
    the request that does not fit, and everything after it, goes through the same rules one request at a
    time (:meth:`_run_one`, :meth:`_admit_one`). Both give vLLM's result (the differential test)."""

    WAITING_CODE, RUNNING_CODE, PAUSED_CODE, PREEMPTED_CODE = _W, _R, _P, _X  # status_a values
    # the rules that can decide a step besides "everyone gets their own" (``reached`` counts each time one did, so
    # a test can say which a scenario covers): a dry pool preempting running[-1], out-of-window blocks freed,
    # the token budget cutting a request short, max_num_seqs or the full-sequence gate or the watermark
    # stopping an admission, max_model_len capping a request's tokens
    RULES = ("preemption", "window_free", "token_budget", "max_num_seqs", "full_sequence_gate", "watermark",
             "length_limit")

    def __init__(self, policy: KVPolicy, limits: EngineLimits):
        self.policy, self.limits = policy, limits
        self.bs = policy.block_size
        self.cap = policy.admission_cap_blocks(limits.in_flight_tokens, limits.max_model_len)
        self._bounded = policy.bounded
        self._sink_blocks, self._window = policy.sink_blocks, policy.window_tokens
        self._slot_of: dict = {}
        self.rid_of: list = []
        n = 64
        self.status_a = np.zeros(n, dtype=np.int8)
        self.computed_a = np.zeros(n, dtype=np.int64)
        self.ntok_a = np.zeros(n, dtype=np.int64)  # prompt + outputs kept
        self.slots_a = np.zeros(n, dtype=np.int64)  # block-table length, freed (null) slots included
        self.held_a = np.zeros(n, dtype=np.int64)  # real blocks held
        self.out_a = np.zeros(n, dtype=np.int64)  # tokens sampled this turn
        self.maxtok_a = np.zeros(n, dtype=np.int64)
        self.running: list[int] = []  # slots, in vLLM's running order
        self.waiting: deque[int] = deque()
        self.kv_holding: deque[int] = deque()
        self.n_paused = 0
        self.used = 0
        self.steps = 0
        self.reached = dict.fromkeys(self.RULES, 0)

    # -- slots -----------------------------------------------------------------------------------------
    def _grow(self) -> None:
        for name in ("status_a", "computed_a", "ntok_a", "slots_a", "held_a", "out_a", "maxtok_a"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))

    def _res(self, n: int) -> int:
        """Blocks resident after ``n`` computed tokens (KVPolicy.resident_blocks, on Python ints)."""
        total = cdiv(n, self.bs)
        if not self._bounded:
            return total
        lo = max(n - self._window + 1, 0) // self.bs
        return min(lo, self._sink_blocks) + total - lo

    # -- the engine interface ------------------------------------------------------------------------
    def add(self, rid, prompt_tokens: int, max_tokens: int) -> int:
        if rid in self._slot_of:
            raise MetronomeError(f"request {rid!r} already exists")
        if prompt_tokens < 1 or max_tokens < 1:
            raise MetronomeError("a request needs at least one prompt token and one output token")
        s = len(self.rid_of)
        if s >= self.status_a.size:
            self._grow()
        self.rid_of.append(rid)
        self._slot_of[rid] = s
        self.status_a[s], self.ntok_a[s], self.maxtok_a[s] = _W, prompt_tokens, max_tokens
        self.waiting.append(s)
        return s

    def append(self, rid, chunk_tokens: int, max_tokens: int) -> None:
        """The next frame's input for a paused session: vLLM drops the token it sampled last (not computed;
        the caller re-feeds it inside ``chunk_tokens``) and the session waits again, in place."""
        s = self._slot_of[rid]
        if self.status_a[s] != _P:
            raise MetronomeError(f"request {rid!r} is {_NAME[int(self.status_a[s])]}, not paused between frames")
        self.ntok_a[s] = self.computed_a[s] + chunk_tokens
        self.maxtok_a[s], self.out_a[s] = max_tokens, 0
        self.status_a[s] = _W
        self.n_paused -= 1

    def abort(self, rid) -> None:
        s = self._slot_of.pop(rid)
        st = int(self.status_a[s])
        self.used -= int(self.held_a[s])
        self.held_a[s] = self.slots_a[s] = 0
        self.status_a[s] = 0
        if st == _P:
            self.n_paused -= 1
        if st == _R:
            self.running.remove(s)
        elif s in self.kv_holding:
            self.kv_holding.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)

    def forget(self, rid) -> None:
        """Forget request ``rid``, whose slot the simulator's compiled loop has already aborted in the arrays
        (:func:`metronome.sim.fastpath._depart`, the same changes as :meth:`abort`)."""
        del self._slot_of[rid]

    def status(self, rid) -> str | None:
        s = self._slot_of.get(rid)
        return None if s is None else _NAME[int(self.status_a[s])]

    def computed(self, rid) -> int:
        return int(self.computed_a[self._slot_of[rid]])

    def tokens_of(self, rid) -> int:
        return int(self.ntok_a[self._slot_of[rid]])

    def blocks_of(self, rid) -> int:
        return int(self.held_a[self._slot_of[rid]])

    def free_blocks(self) -> int:
        return self.limits.num_blocks - self.used

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting) or len(self.kv_holding) > self.n_paused

    # -- by slot, for callers that keep arrays (the simulator) -------------------------------------------
    def append_many(self, slots: np.ndarray, chunk_tokens: np.ndarray, max_tokens: int) -> None:
        """:meth:`append` for many paused requests at once (slots from :meth:`add`)."""
        if slots.size == 0:
            return
        if (self.status_a[slots] != _P).any():
            raise MetronomeError("append_many: a request is not paused between frames")
        self.ntok_a[slots] = self.computed_a[slots] + chunk_tokens
        self.maxtok_a[slots], self.out_a[slots] = max_tokens, 0
        self.status_a[slots] = _W
        self.n_paused -= int(slots.size)

    def computed_of(self, slots: np.ndarray) -> np.ndarray:
        return self.computed_a[slots]

    def held_of(self, slots: np.ndarray) -> np.ndarray:
        return self.held_a[slots]

    def waiting_of(self, slots: np.ndarray) -> np.ndarray:
        """True where the request has tokens to compute but sits in a waiting queue (new, resumed, preempted)."""
        st = self.status_a[slots]
        return (st == _W) | (st == _X)

    # -- one request at a time (the rules as vLLM writes them) ---------------------------------------
    def _allocate(self, s: int, k: int, admitting: bool) -> bool:
        """``allocate_slots(s, k)``: True and the blocks taken, or False and nothing taken (frees stay)."""
        watermark = self.limits.watermark_blocks if admitting and self.running else 0
        slots, comp = int(self.slots_a[s]), int(self.computed_a[s])
        if admitting:
            full = min(int(self.ntok_a[s]), self.limits.max_model_len)
            gate = admission_need_blocks(self.policy, full, self.cap, slots)
            if gate + watermark > self.free_blocks():
                if gate <= self.free_blocks():
                    self.reached["watermark"] += 1
                elif max(cdiv(comp + k, self.bs) - slots, 0) + watermark <= self.free_blocks():
                    self.reached["full_sequence_gate"] += 1  # the chunk would fit, the whole sequence not
                return False
        if slots:  # remove_skipped_blocks on the computed count: out-of-window blocks go back to the pool
            keep = self._res(comp)
            held = int(self.held_a[s])
            if keep < held:
                self.used -= held - keep
                self.held_a[s] = keep
                self.reached["window_free"] += 1
        need = max(cdiv(comp + k, self.bs) - slots, 0)
        if need + watermark > self.free_blocks():
            if need <= self.free_blocks():
                self.reached["watermark"] += 1
            return False
        self.slots_a[s] += need
        self.held_a[s] += need
        self.used += need
        return True

    def _tokens_for(self, s: int, budget: int, threshold: int) -> int:
        k = int(self.ntok_a[s] - self.computed_a[s])
        if 0 < threshold < k:
            k = threshold
        if budget < k:
            self.reached["token_budget"] += 1
        return min(k, budget)

    def _preempt(self, v: int, rec: StepRecord) -> None:
        self.used -= int(self.held_a[v])
        self.held_a[v] = self.slots_a[v] = 0
        self.status_a[v], self.computed_a[v] = _X, 0  # its sampled tokens stay
        self.waiting.appendleft(v)
        self.reached["preemption"] += 1
        rec.preempted.append(self.rid_of[v])

    def _run_one(self, i: int, budget: int, threshold: int, rec: StepRecord, out: list) -> tuple[int, int, bool]:
        """Schedule ``running[i]``: returns (next index, budget left, go on)."""
        s = self.running[i]
        k = self._tokens_for(s, budget, threshold)
        room = self.limits.max_model_len - int(self.computed_a[s]) - 1
        if room < k:
            self.reached["length_limit"] += 1
            k = room
        if k <= 0:
            return i + 1, budget, True
        ok = self._allocate(s, k, admitting=False)
        while not ok:
            victim = self.running.pop()
            self._preempt(victim, rec)
            if victim == s:
                break
            ok = self._allocate(s, k, admitting=False)
        if not ok:
            return i, budget, False
        out.append((s, k))
        return i + 1, budget - k, True

    # -- many requests at once (the same rules while nothing fails) ------------------------------------
    def _fit_prefix(self, S: np.ndarray, k: np.ndarray, free: int, admitting: bool, n_running: int):
        """For requests ``S`` taking ``k`` tokens in order: how many in a row get their blocks, and their frees
        and needs. Mirrors :meth:`_allocate` request by request, as arrays."""
        comp, slots, held = self.computed_a[S], self.slots_a[S], self.held_a[S]
        keep = self.policy.resident_blocks(comp) if self._bounded else held
        freed = np.where(slots > 0, np.maximum(held - keep, 0), 0)
        need = np.maximum(cdiv(comp + k, self.bs) - slots, 0)
        before = free + np.concatenate([[0], np.cumsum(freed - need)[:-1]])
        ok = need <= before + freed
        if admitting:
            wm = np.where(n_running + np.arange(S.size) > 0, self.limits.watermark_blocks, 0)
            full = np.minimum(self.ntok_a[S], self.limits.max_model_len)
            gate = admission_need_blocks(self.policy, full, self.cap, slots)
            fits = ok
            ok = fits & (gate + wm <= before) & (need + wm <= before + freed)
        bad = np.flatnonzero(~ok)
        n = int(bad[0]) if bad.size else S.size
        if admitting and bad.size and fits[n]:  # what stopped the admissions (as _allocate counts them)
            if gate[n] <= before[n]:
                self.reached["watermark"] += 1
            elif need[n] + wm[n] <= before[n] + freed[n]:
                self.reached["full_sequence_gate"] += 1
        return n, freed, need

    def _commit(self, S: np.ndarray, freed: np.ndarray, need: np.ndarray) -> None:
        if freed.any():
            self.reached["window_free"] += 1
        self.held_a[S] += need - freed
        self.slots_a[S] += need
        self.used += int(need.sum()) - int(freed.sum())

    def _budgeted(self, S: np.ndarray, budget: int, threshold: int, cap_len: bool):
        """Tokens each of ``S`` would get in order from ``budget`` (vLLM's loop stops when it reaches 0),
        and which the loop reaches."""
        k = self.ntok_a[S] - self.computed_a[S]
        if threshold > 0:
            k = np.where(k > threshold, threshold, k)
        if cap_len:
            room = self.limits.max_model_len - self.computed_a[S] - 1
            if (room < k).any():
                self.reached["length_limit"] += 1
                k = np.minimum(k, room)
        kp = np.maximum(k, 0)
        before = budget - (np.cumsum(kp) - kp)
        if (kp > before).any():
            self.reached["token_budget"] += 1
        return np.maximum(np.minimum(kp, before), 0), before > 0

    # -- one step --------------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        lim = self.limits
        rec = StepRecord(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), rid_of=self.rid_of)
        budget = lim.max_num_batched_tokens
        n_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding)  # paused sessions count
        threshold = lim.long_prefill_token_threshold if n_eligible > 1 else 0
        sched: list[tuple[int, int]] = []  # scalar-path (slot, tokens), after the vector prefix
        parts_s, parts_k = [], []

        # 1. the running requests, in order; a dry pool preempts running[-1]
        i = 0
        if self.running:
            R = np.asarray(self.running, dtype=np.int64)
            eff, reached = self._budgeted(R, budget, threshold, cap_len=True)
            act = np.flatnonzero(reached & (eff > 0))
            n, freed, need = self._fit_prefix(R[act], eff[act], self.free_blocks(), False, 0)
            if n:
                take = act[:n]
                self._commit(R[take], freed[:n], need[:n])
                parts_s.append(R[take])
                parts_k.append(eff[take])
                budget -= int(eff[take].sum())
            i = int(act[n]) if n < act.size else len(self.running)
        go = True
        while go and i < len(self.running) and budget > 0:
            i, budget, go = self._run_one(i, budget, threshold, rec, sched)

        # 2. the waiting queues (kv-holding first), only in a step that preempted nothing
        admitted: list[tuple[int, int]] = []
        if not rec.preempted:
            budget = self._admit(budget, threshold, admitted, rec)

        if sched:
            parts_s.append(np.array([s for s, _ in sched], dtype=np.int64))
            parts_k.append(np.array([k for _, k in sched], dtype=np.int64))
        if admitted:
            parts_s.append(np.array([s for s, _ in admitted], dtype=np.int64))
            parts_k.append(np.array([k for _, k in admitted], dtype=np.int64))
        if parts_s:
            rec.slots, rec.tokens = np.concatenate(parts_s), np.concatenate(parts_k)

        # 3. the model runs: computed advances; a request whose tokens are all computed samples one
        S, K = rec.slots, rec.tokens
        if S.size:
            self.computed_a[S] += K
            done = S[self.computed_a[S] >= self.ntok_a[S]]
            self.ntok_a[done] += 1
            self.out_a[done] += 1
            rec.sampled_slots = done
            paused = done[self.out_a[done] >= self.maxtok_a[done]]
            if paused.size:
                self.status_a[paused] = _P
                self.n_paused += int(paused.size)
                self.running = [s for s in self.running if self.status_a[s] == _R]
                self.kv_holding.extend(paused.tolist())
                rec.paused_slots = paused
        rec.used_blocks = self.used
        self.steps += 1
        return rec

    def _admit(self, budget: int, threshold: int, admitted: list, rec: StepRecord) -> int:
        """vLLM's waiting pass: the kv-holding queue (paused sessions skipped in place), then ``waiting``; the
        first request that does not fit ends it. The resumed sessions that fit in a row are admitted as
        arrays first; the pass then goes on one request at a time. Returns the budget left."""
        lim = self.limits
        paused = self.n_paused  # paused sessions hold a request slot though they are in no running list
        if len(self.kv_holding) > paused and budget > 0:
            Q = np.fromiter(self.kv_holding, dtype=np.int64, count=len(self.kv_holding))
            L = Q[self.status_a[Q] != _P]
            eff, reached = self._budgeted(L, budget, threshold, cap_len=False)
            room = lim.max_num_seqs - len(self.running) - paused - np.arange(L.size) > 0
            ok = reached & room & (eff > 0)
            stop = int(np.flatnonzero(~ok)[0]) if not ok.all() else L.size
            if stop < L.size and not room[stop] and reached[stop] and eff[stop] > 0:
                self.reached["max_num_seqs"] += 1
            n, freed, need = self._fit_prefix(L[:stop], eff[:stop], self.free_blocks(), True, len(self.running))
            if n:
                take = L[:n]
                self._commit(take, freed[:n], need[:n])
                self.status_a[take] = _R
                self.running.extend(take.tolist())
                admitted.extend(zip(take.tolist(), eff[:n].tolist()))
                rec.admitted.extend(self.rid_of[x] for x in take.tolist())
                budget -= int(eff[:n].sum())
                gone = np.zeros(self.status_a.size, dtype=bool)
                gone[take] = True
                self.kv_holding = deque(Q[~gone[Q]].tolist())
        skipped: list[int] = []
        while budget > 0:
            queue = self.kv_holding if self.kv_holding else self.waiting
            if not queue:
                break
            if len(self.running) + paused >= lim.max_num_seqs:
                self.reached["max_num_seqs"] += 1
                break
            s = queue[0]
            if self.status_a[s] == _P:  # waiting for its next frame's input: skipped, keeps its place
                skipped.append(queue.popleft())
                continue
            k = self._tokens_for(s, budget, threshold)
            if k <= 0 or not self._allocate(s, k, admitting=True):
                break
            queue.popleft()
            self.status_a[s] = _R
            self.running.append(s)
            admitted.append((s, k))
            rec.admitted.append(self.rid_of[s])
            budget -= k
        self.kv_holding.extendleft(reversed(skipped))
        return budget

    def check(self) -> None:
        """Pool accounting: used = Σ held, 0 <= used <= pool."""
        held = int(self.held_a.sum())
        assert held == self.used, f"pool accounting drifted: {held} held vs {self.used} used"
        assert 0 <= self.used <= self.limits.num_blocks, f"used {self.used} outside [0, {self.limits.num_blocks}]"


# ------------------------------------------------------------------------- the front end's deadlock rule
def deadlock_victims(starved: list[tuple[object, int]], in_engine: list[tuple[object, int, int]],
                     free_blocks: int, stalled: bool) -> list[object]:
    """Sessions to abort after a step, most recently admitted first (vLLM's own victim order).

    ``starved``: (session, blocks it still needs) for every session whose work was in the engine before the
    step and got nothing in it. ``in_engine``: (session, admit_seq, blocks held) for every session with a
    request in the engine. ``stalled``: the step scheduled nothing while the engine had work.

    Victims are taken while the starved sessions' need exceeds the free blocks (a starved victim's own need
    goes with it), and at least one when the step stalled. Starved sessions that fit, in a step that did
    not stall, were held back by something else (the token budget): nobody is aborted."""
    total = sum(n for _, n in starved)
    if not stalled and (not starved or total <= free_blocks):
        return []
    need_of = {id(s): n for s, n in starved}
    victims = []
    free = free_blocks
    for s, _seq, held in sorted(in_engine, key=lambda x: -x[1]):
        if starved and total <= free and (victims or not stalled):
            break
        free += held
        total -= need_of.pop(id(s), 0)
        victims.append(s)
        if not starved:
            break  # a stall with no measurable need: one victim, then step again
    return victims


# --------------------------------------------------------------------------------------- admission gate
class AdmissionGate:
    """The door in front of the engine: the controller admits, refuses or (``on_refuse="queue"``) parks a
    session in a FIFO queue that is retried in order and times out after ``queue_timeout_s`` from arrival.

    Decisions: ``"admit"``, ``"queue"``, ``"refuse"``; :meth:`retry` returns ``(admitted, timed_out)``."""

    def __init__(self, controller=None):
        self.controller = controller
        self.on_refuse = getattr(controller, "on_refuse", "reject") if controller is not None else "reject"
        self.timeout_s = float(getattr(controller, "queue_timeout_s", math.inf)) if controller is not None else math.inf
        self.queue: deque[tuple[object, float]] = deque()

    def offer(self, session, arrival_s: float, now_s: float, in_flight: int) -> str:
        ctl = self.controller
        if ctl is None or ctl.may_admit(now_s, in_flight):
            return "admit"
        if self.on_refuse == "queue":
            self.queue.append((session, arrival_s))
            return "queue"
        return "refuse"

    def retry(self, now_s: float, in_flight) -> tuple[list, list]:
        """Admit queued sessions in order while the controller says yes; drop those past the timeout.
        ``in_flight`` is a callable (it grows as sessions are admitted)."""
        admitted, timed_out = [], []
        while self.queue:
            s, arrived = self.queue[0]
            if now_s - arrived > self.timeout_s:
                self.queue.popleft()
                timed_out.append(s)
                continue
            if not self.controller.may_admit(now_s, in_flight()):
                break
            self.queue.popleft()
            admitted.append(s)
        return admitted, timed_out

    @property
    def poll_s(self) -> float:
        """How often a non-empty queue is retried: once per control interval."""
        return max(float(getattr(self.controller, "interval_s", 1.0)), 1e-6)
