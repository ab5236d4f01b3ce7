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

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, cdiv

# ------------------------------------------------------------------------------------------ frame clock
_TICK_EPS = 1e-9


def join_frame(arrival_s: float, period_s: float) -> int:
    """The first frame a session that arrives at ``arrival_s`` streams: ``ceil(t / P)`` (frame ``f`` ticks
    at ``f·P``; an arrival exactly on a tick streams that tick's frame)."""
    return max(int(math.ceil(arrival_s / period_s - _TICK_EPS)), 0)


def tick_s(frame: int, period_s: float) -> float:
    return frame * period_s


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
    input and its outputs)? vLLM stops a request once ``num_tokens >= max_model_len`` (and dies if a
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
    history."""
    need = cdiv(tokens, policy.block_size)
    if cap_blocks is not None:
        need = min(need, cap_blocks)
    return max(need - slots, 0)


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


@dataclass
class _Request:
    rid: str
    status: str
    num_tokens: int  # prompt + outputs kept
    max_tokens: int
    computed: int = 0
    slots: int = 0  # block-table length, freed (null) slots included
    held: int = 0  # real blocks held
    out: int = 0  # tokens sampled this turn


@dataclass
class StepRecord:
    """What one ``schedule()`` did: the fields the differential test compares with vLLM."""

    scheduled: dict[str, int] = field(default_factory=dict)  # rid -> tokens, in schedule order
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # moved from a waiting queue to running
    used_blocks: int = 0  # after scheduling
    sampled: list[str] = field(default_factory=list)  # requests that produced a token
    paused: list[str] = field(default_factory=list)  # requests that finished their frame's tokens

    @property
    def new_tokens(self) -> int:
        return sum(self.scheduled.values())


class EngineModel:
    """vLLM v1's scheduler and KV cache manager for streaming sessions, at block granularity.

    The interface is the live engine's: :meth:`add` a request, :meth:`append` the next frame's input to a
    paused one, :meth:`abort`, :meth:`step`. No prefix caching, no speculative decoding, one batch in
    flight (what the probe runs). Residency comes from the :class:`KVPolicy` (sink+window blocks freed on
    the computed-token basis before each allocation, as ``remove_skipped_blocks`` does)."""

    def __init__(self, policy: KVPolicy, limits: EngineLimits):
        self.policy, self.limits = policy, limits
        self.bs = policy.block_size
        self.cap = policy.admission_cap_blocks(limits.in_flight_tokens, limits.max_model_len)
        self.requests: dict[str, _Request] = {}
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.kv_holding: deque[_Request] = deque()
        self.used = 0
        self.steps = 0

    # -- the engine interface ------------------------------------------------------------------------
    def add(self, rid: str, prompt_tokens: int, max_tokens: int) -> None:
        if rid in self.requests:
            raise MetronomeError(f"request {rid!r} already exists")
        if prompt_tokens < 1 or max_tokens < 1:
            raise MetronomeError("a request needs at least one prompt token and one output token")
        r = _Request(rid, WAITING, prompt_tokens, max_tokens)
        self.requests[rid] = r
        self.waiting.append(r)

    def append(self, rid: str, chunk_tokens: int, max_tokens: int) -> None:
        """The next frame's input for a paused session: vLLM drops the token it sampled last (not computed;
        the caller re-feeds it inside ``chunk_tokens``) and the session waits again, in place."""
        r = self.requests[rid]
        if r.status != PAUSED:
            raise MetronomeError(f"request {rid!r} is {r.status}, not paused between frames")
        r.num_tokens = r.computed + chunk_tokens
        r.max_tokens, r.out = max_tokens, 0
        r.status = WAITING

    def abort(self, rid: str) -> None:
        r = self.requests.pop(rid)
        self._free(r)
        if r in self.running:
            self.running.remove(r)
        for q in (self.waiting, self.kv_holding):
            if r in q:
                q.remove(r)

    def status(self, rid: str) -> str | None:
        r = self.requests.get(rid)
        return r.status if r else None

    def computed(self, rid: str) -> int:
        return self.requests[rid].computed

    def tokens_of(self, rid: str) -> int:
        return self.requests[rid].num_tokens

    def blocks_of(self, rid: str) -> int:
        return self.requests[rid].held

    def free_blocks(self) -> int:
        return self.limits.num_blocks - self.used

    def has_work(self) -> bool:
        return bool(self.running) or any(r.status != PAUSED for r in self.kv_holding) or bool(self.waiting)

    # -- blocks --------------------------------------------------------------------------------------
    def _free(self, r: _Request) -> None:
        self.used -= r.held
        r.held = r.slots = 0

    def _skip_out_of_window(self, r: _Request) -> None:
        """``remove_skipped_blocks`` on the computed count: blocks that left the window go back to the pool."""
        if r.slots:
            keep = int(self.policy.resident_blocks(r.computed))
            if keep < r.held:
                self.used -= r.held - keep
                r.held = keep

    def _allocate(self, r: _Request, k: int, admitting: bool) -> bool:
        """``allocate_slots(r, k)``: True and the blocks taken, or False and nothing taken (frees stay)."""
        free = self.free_blocks()
        watermark = self.limits.watermark_blocks if admitting and self.running else 0
        if admitting:
            full = min(r.num_tokens, self.limits.max_model_len)
            if admission_need_blocks(self.policy, full, self.cap, r.slots) + watermark > free:
                return False
        self._skip_out_of_window(r)
        need = max(cdiv(r.computed + k, self.bs) - r.slots, 0)
        if need + watermark > self.free_blocks():
            return False
        r.slots += need
        r.held += need
        self.used += need
        return True

    # -- one step --------------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        lim = self.limits
        rec = StepRecord()
        budget = lim.max_num_batched_tokens
        n_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding)  # paused sessions count (vLLM's)
        threshold = lim.long_prefill_token_threshold if n_eligible > 1 else 0

        def tokens_for(r: _Request, computed: int) -> int:
            k = r.num_tokens - computed
            if 0 < threshold < k:
                k = threshold
            return min(k, budget)

        # 1. the running requests, in order; a dry pool preempts running[-1]
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            k = min(tokens_for(r, r.computed), lim.max_model_len - r.computed - 1)
            if k <= 0:
                i += 1
                continue
            ok = self._allocate(r, k, admitting=False)
            while not ok:
                victim = self.running.pop()
                self._free(victim)
                victim.status, victim.computed = PREEMPTED, 0  # its sampled tokens stay
                self.waiting.appendleft(victim)
                rec.preempted.append(victim.rid)
                if victim is r:
                    break
                ok = self._allocate(r, k, admitting=False)
            if not ok:
                break
            rec.scheduled[r.rid] = k
            budget -= k
            i += 1

        # 2. the waiting queues (kv-holding first), only in a step that preempted nothing
        if not rec.preempted:
            skipped: list[_Request] = []
            # paused sessions hold a request slot though they are in no running list
            paused = sum(1 for r in self.requests.values() if r.status == PAUSED)
            while budget > 0:
                queue = self.kv_holding if self.kv_holding else self.waiting
                if not queue:
                    break
                if len(self.running) + paused >= lim.max_num_seqs:
                    break
                r = queue[0]
                if r.status == PAUSED:  # waiting for its next frame's input: skipped, keeps its place
                    skipped.append(queue.popleft())
                    continue
                k = tokens_for(r, r.computed)
                if k <= 0 or not self._allocate(r, k, admitting=True):
                    break
                queue.popleft()
                r.status = RUNNING
                self.running.append(r)
                rec.admitted.append(r.rid)
                rec.scheduled[r.rid] = k
                budget -= k
            self.kv_holding.extendleft(reversed(skipped))

        # 3. the model runs: computed advances; a request whose tokens are all computed samples one
        for rid, k in rec.scheduled.items():
            r = self.requests[rid]
            r.computed += k
            if r.computed >= r.num_tokens:
                r.num_tokens += 1
                r.out += 1
                rec.sampled.append(rid)
                if r.out >= r.max_tokens:
                    r.status = PAUSED
                    rec.paused.append(rid)
        if rec.paused:
            gone = set(rec.paused)
            self.running = [r for r in self.running if r.rid not in gone]
            self.kv_holding.extend(self.requests[rid] for rid in rec.paused)
        rec.used_blocks = self.used
        self.steps += 1
        return rec

    def check(self) -> None:
        """Pool accounting: used = Σ held, 0 <= used <= pool, no session above its policy's bound."""
        held = sum(r.held for r in self.requests.values())
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
