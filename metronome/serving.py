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

The step is written once, in the form numba compiles, over the engine's arrays (:func:`engine_step`; residency
is the policy's own formula, :meth:`KVPolicy.residency`): :class:`EngineModel` takes a step with it, the
simulator's compiled loop calls it from inside its own loop on the same arrays, and the differential test runs it
beside vLLM.

**What vLLM 0.32 gets wrong, and what we do about it (the one place this is said).** A paused session is
not a preemption candidate, so when the pool runs dry at a frame boundary every resumed session waits for
blocks that only a paused one could free, and the engine stalls (0 running, N waiting, 0 free). The live
driver breaks it the way a serving front end has to, and the simulator models exactly that
(:func:`deadlock_pick`, which :class:`metronome.front_end.FrontEnd` asks for both): after a step that left a
session with work unscheduled for want of blocks (or scheduled nothing at all), it aborts the **most recently
admitted** session, puts it at the head of its own waiting queue, and later readmits it as a **new request whose
prompt is its whole history**.

The other rules of a session's life are here too: the frame clock (:func:`join_frame`), what a frame may
reach before ``max_model_len`` (:func:`frame_fits`) and what happens then (:func:`length_outcome`), what
a session needs to be (re)admitted (:func:`admission_need_blocks`), what makes a frame silent
(:func:`frame_is_silent`), the admission gate with its queue and timeout (:class:`AdmissionGate`), and
the named reasons a session ends (:class:`EndReason`).
"""

from __future__ import annotations

import math
from collections import deque, namedtuple
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba.core import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import overload, register_jitable

from metronome import compiled
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, blocks_in, resident_blocks_of, resident_tokens_of

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

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


@register_jitable  # (Python's function as it is, and compiled into the compiled code that calls it)
def phase_offset_s(slot, period_s: float):
    """The phase of a session on grid point ``slot`` (ints or arrays): ``slot · P / PHASE_SLOTS``."""
    return slot * (period_s / PHASE_SLOTS)


@register_jitable  # (the frame clock's one statement: the compiled rules call it too)
def frame_tick(frame, period_s: float, phase_s=0.0):
    """When frame ``frame`` of a session with phase ``phase_s`` ticks: ``f·P + φ`` (ints or arrays)."""
    return frame * period_s + phase_s


@register_jitable  # (the compiled rules key their answers with it)
def tick_key(frame, slot):
    """An integer that orders ticks exactly (frame, then phase slot): ``f·PHASE_SLOTS + slot``."""
    return frame * PHASE_SLOTS + slot


def tick_frame(key, slot):
    """The frame of tick ``key`` (:func:`tick_key`) of a session in phase slot ``slot``."""
    return (key - slot) // PHASE_SLOTS


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
    CLOSED = "closed"  # the server closed it, or its socket broke (a client of metronome-serve only)
    UNREACHED = "unreached"  # no session began: the server did not answer, or refused it for another reason than
    # admission (a client of metronome-serve only)

    ALL = (DEPARTED, LENGTH, HORIZON, REFUSED, QUEUE_TIMEOUT, ENGINE_FINISHED, STOPPED, ENGINE_DIED, CLOSED, UNREACHED)
    NOT_ADMITTED = (REFUSED, QUEUE_TIMEOUT)


# a session ended by the run's own end: the frames it is owed are left out (censored), never answered
RUN_OVER = (EndReason.HORIZON, EndReason.STOPPED, EndReason.ENGINE_DIED)


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


def rebase_keep_tokens(policy: KVPolicy, max_model_len: int, unbounded: int | None = None) -> int:
    """Tokens a rebased session keeps: S sinks + W window under the bound; otherwise ``unbounded`` (a live run's
    choice), else half the context."""
    kept = policy.rebase_tokens()
    if kept is not None:
        return kept
    return unbounded if unbounded else max_model_len // 2


def check_rebase_room(policy: KVPolicy, keep: int, input_tokens: int, output_tokens: int, max_model_len: int) -> None:
    """A rebased session must hold one frame on top of what it keeps: its ``keep`` tokens
    (:func:`rebase_keep_tokens`), the token sampled last, the frame's input and its outputs, strictly below
    ``max_model_len`` (:func:`frame_fits`). Otherwise every rebase meets the length limit again at once: vLLM
    stops the request part-way through the frame (the engine model's room in its running pass), the session
    stalls and is rebased over and over, and half its frames come back silent. Such a bound is refused as bad
    input, in one line naming what does fit."""
    frame = 1 + input_tokens + output_tokens
    if not frame_fits(keep + frame, max_model_len):
        raise MetronomeError(f"{policy.describe()} keeps {keep} tokens: with a frame of {frame} more ({input_tokens} "
                             f"in, {output_tokens} out, the token sampled last) a rebased session reaches "
                             f"max_model_len {max_model_len}; keep at most {max_model_len - 1 - frame} tokens "
                             "(a smaller --window or --sinks) or raise max_model_len")


def rebase_ids(policy: KVPolicy, tokens: list[int], keep: int) -> list[int]:
    """What a rebased session keeps of its token ids ``tokens``: ``keep`` of them (:func:`rebase_keep_tokens`), its
    sinks first (the policy's S, none unbounded) and then its last tokens, so that under the bound the new
    request's sinks are the conversation's own."""
    if len(tokens) <= keep:
        return list(tokens)
    s = min(policy.sink_tokens, keep)
    return list(tokens[:s]) + list(tokens[len(tokens) - (keep - s):])


def rebase_counts(history: int, chunk: int, out: int, keep: int, max_model_len: int) -> tuple[int, int]:
    """A frame that does not fit rebases its session: the new request is (what it keeps of its ``history``, the
    frame's ``chunk``), in tokens. It keeps ``keep`` tokens of its history (:func:`rebase_keep_tokens`); when even
    that and the chunk leave no room for the ``out`` tokens (a first frame carrying a long prompt and the input
    of the frames it waited through), the request is what a rebase keeps of all of it, as its chunk."""
    kept = min(history, keep)
    if frame_fits(kept + chunk + out, max_model_len):
        return kept, chunk
    return 0, min(kept + chunk, keep)


def rebase_request_ids(policy: KVPolicy, history: list[int], chunk: list[int], out: int, keep: int,
                       max_model_len: int) -> tuple[list[int], list[int]]:
    """:func:`rebase_counts` on token ids (a live session's): (the history's ids the new request keeps, its chunk's
    ids), each what :func:`rebase_ids` keeps; the counts decide."""
    n_kept, n_chunk = rebase_counts(len(history), len(chunk), out, keep, max_model_len)
    kept = rebase_ids(policy, history, keep)
    if n_kept == len(kept) and n_chunk == len(chunk):
        return kept, list(chunk)
    return [], rebase_ids(policy, kept + list(chunk), keep)


# ------------------------------------------------------------------------------------------- admission
NO_CAP = 1 << 62
"""The admission cap of full attention (none): :func:`gate_blocks` with it is plain ``cdiv(tokens, bs)``."""


def gate_blocks(tokens, bs, cap, slots):
    """Blocks vLLM's full-sequence gate wants free to admit a request of ``tokens`` tokens that already has
    ``slots`` block slots: ``max(min(cdiv(tokens, bs), cap) − slots, 0)``. The one statement of the gate: the
    front end asks it through :func:`admission_need_blocks`, and the engine step compiles it (ints, numpy arrays
    and numba alike)."""
    return np.maximum(np.minimum(blocks_in(tokens + bs - 1, bs), cap) - slots, 0)


def admission_need_blocks(policy: KVPolicy, tokens: int, cap_blocks: int | None, slots: int = 0) -> int:
    """:func:`gate_blocks` for ``policy``. ``cap_blocks`` is the KV spec's admission cap (None for full attention):
    a bounded session reserves its peak in-flight residency, not its history."""
    return gate_blocks(tokens, policy.block_size, NO_CAP if cap_blocks is None else cap_blocks, slots)


def blocks_to_resume(policy: KVPolicy, tokens: int, computed: int, held: int, cap_blocks: int | None) -> int:
    """Free blocks a waiting request of ``tokens`` tokens (``computed`` of them computed, ``held`` blocks held)
    needs before vLLM schedules the rest of it (:func:`resume_need`, for ``policy``)."""
    bs, sink_blocks, window = policy.residency()
    return int(resume_need(tokens, computed, held, bs, NO_CAP if cap_blocks is None else cap_blocks, sink_blocks,
                           window))


def admit_fcfs(waiting, need, free: int) -> int:
    """FCFS admission from a waiting queue (oldest first): how many of its heads get in, each while ``need(head)``
    blocks fit in ``free`` (less what the heads admitted before it take), stopping at the first that does not — a
    later, smaller request never jumps the queue (vLLM's waiting pass does the same)."""
    n = 0
    for i in waiting:
        k = need(i)
        if k > free:
            break
        free -= k
        n += 1
    return n


@register_jitable  # (the compiled rules and records ask it too)
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

# The engine's state is arrays, so that one compiled step (:func:`engine_step`) serves the step-by-step
# simulator, the compiled loop (metronome.sim.fastpath, which calls it from inside its own loop) and the
# differential test against vLLM alike. Per request slot: status, computed tokens, tokens (prompt + outputs
# kept), block-table length (freed null slots included), real blocks held, tokens sampled this turn, the
# frame's max_tokens and the request's place in the kv-holding queue. The queues: ``run`` (vLLM's running
# list, in order), ``kw`` (the kv-holding queue's *waiting* entries: the paused ones keep their place, ``kseq``,
# and are only counted, since the waiting pass skips them) and ``wq`` (vLLM's waiting queue: new and
# preempted requests). Its counters, limits, what a step did and the rules reached are numpy records (one
# element each, ``np.recarray`` so that the step's Python form, which the differential test mutates, reads their
# fields by name as numba does): numba reads and writes a field as a load or a store at its offset.
# The counters (``cnt``): blocks used, requests paused, the lengths of ``run``, ``kw`` and ``wq``, the next
# kv-holding sequence number, steps taken and the next request slot to hand out
COUNTS = np.dtype([(f, np.int64) for f in ("used", "paused", "n_run", "n_kw", "n_wq", "next_kseq", "steps",
                                            "next_slot")], align=True)
# the engine's arrays by name, in engine_step's order (what EngineModel.arrays gives a compiled caller)
EngineArrays = namedtuple("EngineArrays", "lim cnt status computed ntok slots held out maxtok kseq run kw wq o_s o_k "
                                          "o_pre o_sam o_pau o_n reached")
# the limits and the policy's residency, as the compiled step reads them (``lim``): the pool, max_num_seqs, the
# token budget, max_model_len, the watermark, the long-prefill threshold, the admission cap, and the block size,
# sink blocks and window of KVPolicy.residency
LIMITS = np.dtype([(f, np.int64) for f in ("num_blocks", "max_seqs", "budget", "max_len", "watermark",
                                            "long_prefill", "cap", "block_size", "sink_blocks", "window")],
                  align=True)
# what a step did (``o_n``): scheduled (running pass, then admitted), admitted, preempted, sampled, paused, new
# tokens, context tokens (resident after the step, summed over the scheduled), blocks used after scheduling
DID = np.dtype([(f, np.int64) for f in ("sched", "admitted", "preempted", "sampled", "paused", "new_tokens",
                                         "ctx_tokens", "used")], align=True)
# the rules that can decide a step besides "everyone gets their own" (``reached`` counts each time one did, so a
# test can say which a scenario covers): a dry pool preempting running[-1], out-of-window blocks freed, the token
# budget cutting a request short, max_num_seqs or the full-sequence gate or the watermark stopping an admission,
# max_model_len capping a request's tokens, the long-prefill threshold capping them
RULES = ("preemption", "window_free", "token_budget", "max_num_seqs", "full_sequence_gate", "watermark",
         "length_limit", "long_prefill")
REACHED = np.dtype([(r, np.int64) for r in RULES], align=True)


def record(dtype, **fields) -> np.recarray:
    """A record of ``dtype`` (one element, as the engine's arrays hold it), its ``fields`` set, the rest 0."""
    r = np.zeros(1, dtype).view(np.recarray)
    for name, value in fields.items():
        r[name] = value
    return r


@overload(blocks_in)
def _blocks_in_compiled(n, bs):
    """:func:`metronome.kv_policy.blocks_in` in compiled code: a block size that is a power of two (vLLM's are)
    divides by a shift (an arithmetic shift floors, negatives included, as ``//`` does). A division by a
    number known only at run time takes tens of cycles, and the engine step divides by the block size several
    times for each request it schedules: a few per cent of the simulator's loop."""
    if not (isinstance(n, types.Integer) and isinstance(bs, types.Integer)):
        return lambda n, bs: n // bs

    def impl(n, bs):
        if bs > 0 and bs & (bs - 1) == 0:
            return n >> trailing_zeros(bs)
        return n // bs
    return impl


# what compiles the policy's residency into its caller: a caller's cache guard names these (compiled.guard)
RESIDENCY_PARTS = (blocks_in, _blocks_in_compiled, resident_blocks_of, resident_tokens_of)
# the policy's residency, compiled: the engine step's and the fill model's clock (one dispatcher each, one cache)
resident_blocks_jit = compiled.counted(resident_blocks_of)
resident_tokens_jit = compiled.counted(resident_tokens_of)
# (numba keeps their machine code under kv_policy's name and checks kv_policy.py alone: guarded against a change of
# the compiled blocks_in above, which they compile in)
RESIDENT_FORM = compiled.guard(resident_blocks_jit, (_blocks_in_compiled,))
gate_blocks_jit = compiled.counted(gate_blocks)  # (the compiled loop's front end asks it too)


@compiled.counted
def resume_need(tokens, computed, held, bs, cap, sink_blocks, window):
    """Free blocks a waiting request of ``tokens`` tokens (``computed`` of them computed, ``held`` blocks held)
    needs before vLLM schedules the rest of it: the full-sequence gate's, or the allocation's once its
    out-of-window blocks are freed, whichever is larger, and at least one (it is starved for *something*). The one
    statement: :func:`blocks_to_resume` asks it for a policy, the compiled loop on the engine's arrays."""
    slots = blocks_in(computed + bs - 1, bs)
    gate = gate_blocks_jit(tokens, bs, cap, slots)
    freed = held - resident_blocks_jit(computed, bs, sink_blocks, window) if computed else 0
    alloc = blocks_in(tokens + bs - 1, bs) - slots - freed
    return max(gate, alloc, 1)


@compiled.counted
def deadlock_pick(need, seq, held, free, stalled, out):
    """The deadlock rule over the sessions with a request in the engine: ``need[k]`` blocks session ``k`` is
    starved for (0: not starved; a starved one's work was in the engine before the step and got nothing in it),
    ``seq[k]`` its admission's sequence number, ``held[k]`` its blocks; ``free`` blocks are free and ``stalled``
    says the step scheduled nothing while the engine had work. Writes the victims (indices into these arrays) to
    ``out``, most recently admitted first (vLLM's own victim order), and returns how many.

    Victims are taken while the starved sessions' need exceeds the free blocks (a starved victim's own need goes
    with it), and at least one when the step stalled. Starved sessions that fit, in a step that did not stall,
    were held back by something else (the token budget): nobody is aborted. Both front ends (the simulator's,
    compiled or not, and the live driver, which is the same front end) decide with it."""
    total = 0
    starved = False
    for k in range(need.size):
        if need[k] > 0:
            total += need[k]
            starved = True
    if not stalled and (not starved or total <= free):
        return 0
    order = np.argsort(-seq, kind="mergesort")
    n = 0
    for k in order:
        if starved and total <= free and (n > 0 or not stalled):
            break
        free += held[k]
        total -= need[k]
        out[n] = k
        n += 1
        if not starved:
            break  # a stall with no measurable need: one victim, then step again
    return n


@compiled.uncounted
def _chunk(s, budget, thr, ntok, computed, reached):
    """Tokens request ``s`` is scheduled from ``budget``: what it has left, at most the long-prefill threshold."""
    k = ntok[s] - computed[s]
    if 0 < thr < k:
        reached.long_prefill += 1
        k = thr
    if budget < k:
        reached.token_budget += 1
        return budget
    return k


# (an argument that is a literal constant has a type of its own, Literal[bool](False): numba compiles a function
# once for each literal it is handed, and once more for a variable; a call makes its constant with np.bool_)
@compiled.inlined
def _alloc(s, k, admitting, lim, cnt, computed, ntok, slots, held, reached):
    """``KVCacheManager.allocate_slots(s, k)``: True and the blocks taken, or False and nothing taken (the frees
    stay). Admitting a waiting request, the full-sequence gate and the watermark (once anything runs) come first;
    then blocks that left the window at the *computed* count go back to the pool; then the chunk's new blocks."""
    bs = lim.block_size
    wm = lim.watermark if admitting and cnt.n_run > 0 else 0
    free = lim.num_blocks - cnt.used
    need = max(blocks_in(computed[s] + k + bs - 1, bs) - slots[s], 0)
    if admitting:
        gate = gate_blocks_jit(min(ntok[s], lim.max_len), bs, lim.cap, slots[s])
        if gate + wm > free:
            if gate <= free:
                reached.watermark += 1
            elif need + wm <= free:
                reached.full_sequence_gate += 1  # the chunk would fit, the whole sequence not
            return False
    if slots[s] > 0:  # remove_skipped_blocks
        keep = resident_blocks_jit(computed[s], bs, lim.sink_blocks, lim.window)
        if keep < held[s]:
            cnt.used -= held[s] - keep
            free += held[s] - keep
            held[s] = keep
            reached.window_free += 1
    if need + wm > free:
        if need <= free:
            reached.watermark += 1
        return False
    slots[s] += need
    held[s] += need
    cnt.used += need
    return True


@compiled.uncounted
def _preempt(v, cnt, status, computed, slots, held, wq, reached):
    """Recompute preemption of ``v``: all its blocks freed, nothing computed, at the head of ``waiting`` (its
    sampled tokens stay)."""
    cnt.used -= held[v]
    held[v] = 0
    slots[v] = 0
    status[v] = _X
    computed[v] = 0
    for j in range(cnt.n_wq, 0, -1):
        wq[j] = wq[j - 1]
    wq[0] = v
    cnt.n_wq += 1
    reached.preemption += 1


@compiled.counted
def key_order_in(v, n, work):
    """Positions ``0 .. n-1`` in ascending order of ``v[:n]`` (ties in position order), written to ``work[:n]``.

    A step's keys (queue places, tick keys) span little more than their count: a counting sort, linear, in ``work``
    (:func:`key_order_work` of at least ``n``: the compiled loop sorts every step's answers, and an allocation a
    step cost it more than the sort); a merge sort, in the same room, when they span more than 4n + 64. Nothing is
    allocated and nothing returned (code without numba's reference counting returns no view): the compiled loop's
    turn, which runs without it, calls this."""
    lo = hi = v[0]
    for j in range(1, n):
        lo = min(lo, v[j])
        hi = max(hi, v[j])
    span = hi - lo + 1
    if span > 4 * n + 64:
        merge_order(v, n, work)
        return
    order, start = work[:n], work[n:n + span + 1]
    start[:] = 0
    for j in range(n):
        start[v[j] - lo + 1] += 1
    for k in range(span):
        start[k + 1] += start[k]
    for j in range(n):
        c = v[j] - lo
        order[start[c]] = j
        start[c] += 1


@compiled.counted
def merge_order(v, n, work):
    """Positions ``0 .. n-1`` in ascending order of ``v[:n]`` (any ordered values; ties in position order): a
    bottom-up merge sort of positions (stable, as numpy's ``argsort(kind="mergesort")``), the order in
    ``work[:n]``, ``work[n:2n]`` its scratch. :func:`key_order_in` sorts keys spread wide with it."""
    order, tmp = work[:n], work[n:2 * n]
    for j in range(n):
        order[j] = j
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                if v[order[b]] < v[order[a]]:  # (strictly: a tie keeps the earlier position first)
                    tmp[k] = order[b]
                    b += 1
                else:
                    tmp[k] = order[a]
                    a += 1
                k += 1
            while a < mid:
                tmp[k] = order[a]
                a += 1
                k += 1
            while b < hi:
                tmp[k] = order[b]
                b += 1
                k += 1
        for j in range(n):
            order[j] = tmp[j]
        width *= 2


@compiled.counted
def key_order_work(n):
    """Room for :func:`key_order_in` to sort up to ``n`` keys in: the order (n) and the counts of a span of up to
    4n + 64 keys (4n + 66)."""
    return np.empty(5 * n + 66, np.int64)


@compiled.counted
def key_order(v, n):
    """:func:`key_order_in` in an array of its own."""
    work = key_order_work(n)
    key_order_in(v, n, work)
    return work[:n]


@compiled.counted  # (it allocates, when many are out of order)
def _kv_order(kw, n, kseq):
    """The kv-holding queue's waiting entries in queue order (their places ``kseq``): insertion sort when they are
    few or nearly in order, a sort of their places when many come out of order (past N* every session's frame
    waits in every step)."""
    if n > 32:
        inv = 0
        for a in range(1, n):
            if kseq[kw[a - 1]] > kseq[kw[a]]:
                inv += 1
        if inv > 8:
            places = np.empty(n, np.int64)
            for a in range(n):
                places[a] = kseq[kw[a]]
            order = key_order(places, n)  # places are distinct: any sort gives the one order
            keep = kw[:n].copy()
            for a in range(n):
                kw[a] = keep[order[a]]
            return
    for a in range(1, n):
        s = kw[a]
        b = a - 1
        while b >= 0 and kseq[kw[b]] > kseq[s]:
            kw[b + 1] = kw[b]
            b -= 1
        kw[b + 1] = s


@compiled.inlined
def _running_pass(eng, thr):
    """The running requests in order, each its chunk (within the budget and below max_model_len); when the pool
    is dry the last running request is preempted and the allocation retried, and a request that would preempt
    itself ends the pass. Returns the budget left."""
    lim, cnt, status, computed, ntok, slots, held, run, wq = (eng.lim[0], eng.cnt[0], eng.status, eng.computed,
                                                              eng.ntok, eng.slots, eng.held, eng.run, eng.wq)
    o_s, o_k, o_pre, o_n, reached = eng.o_s, eng.o_k, eng.o_pre, eng.o_n[0], eng.reached[0]
    budget = lim.budget
    i = 0
    while i < cnt.n_run and budget > 0:
        s = run[i]
        k = _chunk(s, budget, thr, ntok, computed, reached)
        room = lim.max_len - computed[s] - 1
        if room < k:
            reached.length_limit += 1
            k = room
        if k <= 0:
            i += 1
            continue
        ok = _alloc(s, k, np.bool_(False), lim, cnt, computed, ntok, slots, held, reached)
        while not ok:
            cnt.n_run -= 1
            v = run[cnt.n_run]
            _preempt(v, cnt, status, computed, slots, held, wq, reached)
            o_pre[o_n.preempted] = v
            o_n.preempted += 1
            if v == s:
                break
            ok = _alloc(s, k, np.bool_(False), lim, cnt, computed, ntok, slots, held, reached)
        if not ok:
            break
        o_s[o_n.sched], o_k[o_n.sched] = s, k
        o_n.sched += 1
        budget -= k
        i += 1
    if budget <= 0 and i < cnt.n_run:
        reached.token_budget += 1  # the budget ran out before the last running requests
    return budget


@compiled.uncounted
def _waiting_pass(budget, eng, thr):
    """vLLM's waiting pass: the kv-holding queue in order (its paused entries skipped in place), then ``waiting``,
    head first, each admitted to the running list while max_num_seqs (paused requests hold a place), the budget,
    the full-sequence gate, the watermark and the pool allow; the first that does not fit ends the pass (no later,
    smaller request jumps it)."""
    lim, cnt, status, computed, ntok, slots, held, kseq, run, kw, wq = (
        eng.lim[0], eng.cnt[0], eng.status, eng.computed, eng.ntok, eng.slots, eng.held, eng.kseq, eng.run, eng.kw,
        eng.wq)
    o_s, o_k, o_n, reached = eng.o_s, eng.o_k, eng.o_n[0], eng.reached[0]
    _kv_order(kw, cnt.n_kw, kseq)
    a = q = 0  # admitted from kw, from wq
    while budget > 0:
        if a < cnt.n_kw:
            s = kw[a]
        elif q < cnt.n_wq:
            s = wq[q]
        else:
            break
        if cnt.n_run + cnt.paused >= lim.max_seqs:
            reached.max_num_seqs += 1
            break
        k = _chunk(s, budget, thr, ntok, computed, reached)
        if k <= 0 or not _alloc(s, k, np.bool_(True), lim, cnt, computed, ntok, slots, held, reached):
            break
        status[s] = _R
        run[cnt.n_run] = s
        cnt.n_run += 1
        o_s[o_n.sched], o_k[o_n.sched] = s, k
        o_n.sched += 1
        o_n.admitted += 1
        budget -= k
        if a < cnt.n_kw:
            a += 1
        else:
            q += 1
    if budget <= 0 and (a < cnt.n_kw or q < cnt.n_wq):
        reached.token_budget += 1  # the budget ran out before the waiting requests
    cnt.n_kw = _pop_front(kw, cnt.n_kw, a)
    cnt.n_wq = _pop_front(wq, cnt.n_wq, q)


@compiled.uncounted
def _pop_front(queue, n, k):
    """``queue[:n]`` without its first ``k`` (in place, no allocation: this runs every step); the new length."""
    if k:
        for j in range(n - k):
            queue[j] = queue[j + k]
    return n - k


@compiled.inlined
def _model_run(eng):
    """The model runs: each scheduled request computes its tokens; one whose tokens are all computed samples one;
    one that reached its frame's max_tokens pauses and joins the kv-holding queue's tail, in schedule order."""
    lim, cnt, status, computed, ntok, out, maxtok, kseq, run = (eng.lim[0], eng.cnt[0], eng.status, eng.computed,
                                                                eng.ntok, eng.out, eng.maxtok, eng.kseq, eng.run)
    o_s, o_k, o_sam, o_pau, o_n = eng.o_s, eng.o_k, eng.o_sam, eng.o_pau, eng.o_n[0]
    new = ctx = n_sam = n_pau = 0
    for j in range(o_n.sched):
        s = o_s[j]
        computed[s] += o_k[j]
        new += o_k[j]
        ctx += resident_tokens_jit(computed[s], lim.block_size, lim.sink_blocks, lim.window)
        if computed[s] >= ntok[s]:
            ntok[s] += 1
            out[s] += 1
            o_sam[n_sam] = s
            n_sam += 1
            if out[s] >= maxtok[s]:
                status[s] = _P
                kseq[s] = cnt.next_kseq
                cnt.next_kseq += 1
                o_pau[n_pau] = s
                n_pau += 1
    if n_pau:
        m = 0
        for j in range(cnt.n_run):
            if status[run[j]] == _R:
                run[m] = run[j]
                m += 1
        cnt.n_run = m
        cnt.paused += n_pau
    o_n.sampled, o_n.paused, o_n.new_tokens, o_n.ctx_tokens = n_sam, n_pau, new, ctx


@compiled.inlined
def engine_step(eng):
    """One ``Scheduler.schedule()`` and the model run after it, on the engine's arrays (the layout above): the
    running pass, then, only in a step that preempted nothing, the waiting pass; then sampling and pausing. What
    it did is written to ``o_*`` (``o_n`` counts them) and each rule that decided something is counted in
    ``reached``. The one statement of vLLM's step: every path of the simulator and the differential test run it."""
    lim, cnt, o_n = eng.lim[0], eng.cnt[0], eng.o_n[0]
    o_n.sched = o_n.admitted = o_n.preempted = o_n.sampled = o_n.paused = o_n.new_tokens = o_n.ctx_tokens = 0
    o_n.used = 0
    thr = lim.long_prefill if cnt.n_run + cnt.n_wq + cnt.n_kw + cnt.paused > 1 else 0  # paused sessions count
    budget = _running_pass(eng, thr)
    if o_n.preempted == 0:
        _waiting_pass(budget, eng, thr)
    o_n.used = cnt.used
    _model_run(eng)
    cnt.steps += 1


@compiled.counted
def _drop(arr, n, x):
    """``arr[:n]`` without ``x``, in order; returns the new length."""
    m = 0
    for j in range(n):
        if arr[j] != x:
            arr[m] = arr[j]
            m += 1
    return m


@compiled.counted
def abort_slot(s, cnt, status, slots, held, run, kw, wq):
    """Abort request ``s`` (``EngineModel.abort``; the compiled loop's departures call it too): its blocks go back,
    and it leaves whichever list or queue holds it."""
    st = status[s]
    cnt.used -= held[s]
    held[s] = 0
    slots[s] = 0
    status[s] = 0
    if st == _R:
        cnt.n_run = _drop(run, cnt.n_run, s)
    elif st == _P:
        cnt.paused -= 1
    elif st != 0:  # waiting: in the kv-holding queue (resumed) or in vLLM's waiting queue
        n = _drop(kw, cnt.n_kw, s)
        if n < cnt.n_kw:
            cnt.n_kw = n
        else:
            cnt.n_wq = _drop(wq, cnt.n_wq, s)


@compiled.counted
def add_slot(prompt_tokens, max_tokens, cnt, status, ntok, maxtok, kseq, wq):
    """A new request (``EngineModel.add``; the compiled loop adds a session's first frame with it too): the next
    slot, waiting at the tail of ``waiting``. Returns the slot."""
    s = cnt.next_slot
    cnt.next_slot += 1
    status[s], ntok[s], maxtok[s], kseq[s] = _W, prompt_tokens, max_tokens, -1
    wq[cnt.n_wq] = s
    cnt.n_wq += 1
    return s


@compiled.counted
def resume_slot(s, chunk, max_tokens, cnt, status, computed, ntok, out, maxtok, kw):
    """The next frame's input for paused request ``s`` (``EngineModel.append``): vLLM drops the token it sampled
    last (not computed; the caller re-feeds it inside ``chunk``) and the request waits again, in its place in the
    kv-holding queue."""
    ntok[s] = computed[s] + chunk
    maxtok[s] = max_tokens
    out[s] = 0
    status[s] = _W
    cnt.paused -= 1
    kw[cnt.n_kw] = s
    cnt.n_kw += 1


@compiled.counted
def _resume_many(slots_, chunks, max_tokens, cnt, status, computed, ntok, out, maxtok, kw):
    for j in range(slots_.size):
        resume_slot(slots_[j], chunks[j], max_tokens[j], cnt, status, computed, ntok, out, maxtok, kw)


# what the compiled step takes in from another module: the policy's residency
STEP_FORM = compiled.guard(engine_step, RESIDENCY_PARTS)


@dataclass
class StepRecord:
    """What one ``schedule()`` did: the fields the differential test compares with vLLM.

    Requests are named by their slots, which an engine hands out in the order of ``add`` and never reuses.
    ``slots``/``tokens``: the scheduled requests' slots and tokens, in schedule order (``scheduled`` is the same as
    a dict)."""

    slots: np.ndarray
    tokens: np.ndarray
    preempted: list = field(default_factory=list)  # slots, in order
    admitted: list = field(default_factory=list)  # slots moved from a waiting queue to running
    used_blocks: int = 0  # after scheduling
    sampled_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    paused_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    context_tokens: int = 0  # resident after the step, summed over the scheduled requests
    # requests the engine says it scheduled, when it names fewer in ``slots`` (a client of vLLM's own loop learns
    # only which requests sampled); -1: ``slots`` names them all
    engine_batch: int = -1

    @property
    def batch(self) -> int:
        """Requests the step scheduled (0: it scheduled nothing, a stall when the engine had work)."""
        return self.engine_batch if self.engine_batch >= 0 else int(self.slots.size)

    @property
    def scheduled(self) -> dict:
        return dict(zip(self.slots.tolist(), self.tokens.tolist()))

    @property
    def sampled(self) -> list:
        return self.sampled_slots.tolist()

    @property
    def paused(self) -> list:
        return self.paused_slots.tolist()

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.sum())


class Origin(NamedTuple):
    """What a new request is, as the front end hands it to its engine (:meth:`EngineModel.add`). The model counts
    tokens and ignores it; an engine of token ids (``metronome.probe.slot_engine``, a live session's vLLM requests)
    builds the request's ids from it and checks that its ids and the front end's counts agree.

    ``session``: the front end's session; ``kind``: ``"first"`` (its first frame: prompt and input), ``"readmit"``
    (a restart after its request was aborted: the ids that request held, then the input of the frames it heard as
    silence) or ``"rebase"`` (its frame did not fit ``max_model_len``: what the policy keeps of the history, then the
    frame's chunk, the re-fed token first); ``history``: the tokens of the session's history the request is built
    from (for a rebase, before the token sampled last); ``tokens``: the request's tokens before any rebase cut them
    down (for a rebase, the frame's chunk)."""

    session: int
    kind: str
    history: int
    tokens: int


class EngineModel:
    """vLLM v1's scheduler and KV cache manager for streaming sessions, at block granularity.

    The interface is the live engine's: :meth:`add` a request, :meth:`append` the next frame's input to a
    paused one, :meth:`abort`, :meth:`step`. No prefix caching, no speculative decoding, one batch in
    flight (what the probe runs). Residency comes from the :class:`KVPolicy` (:meth:`KVPolicy.residency`: blocks
    that left the window freed on the computed-token basis before each allocation, as ``remove_skipped_blocks``
    does). A step is :func:`engine_step` on this model's arrays (the layout at ``COUNTS``); the simulator's compiled
    loop calls the same function on the same arrays."""

    WAITING_CODE, RUNNING_CODE, PAUSED_CODE, PREEMPTED_CODE = _W, _R, _P, _X  # status_a values
    RULES = RULES
    _ARRAYS = ("status_a", "computed_a", "ntok_a", "slots_a", "held_a", "out_a", "maxtok_a", "kseq_a", "run_a",
               "kw_a", "wq_a", "o_s", "o_k", "o_pre", "o_sam", "o_pau")
    _kernel = staticmethod(engine_step)  # (the differential test's mutations run its Python form)

    def __init__(self, policy: KVPolicy, limits: EngineLimits):
        self.policy, self.limits = policy, limits
        self.bs = policy.block_size
        self.cap = policy.admission_cap_blocks(limits.in_flight_tokens, limits.max_model_len)
        block_size, sink_blocks, window = policy.residency()
        self.lim = record(LIMITS, num_blocks=limits.num_blocks, max_seqs=limits.max_num_seqs,
                          budget=limits.max_num_batched_tokens, max_len=limits.max_model_len,
                          watermark=limits.watermark_blocks, long_prefill=limits.long_prefill_token_threshold,
                          cap=NO_CAP if self.cap is None else self.cap, block_size=block_size,
                          sink_blocks=sink_blocks, window=window)
        self.cnt, self.o_n, self.reached_a = record(COUNTS), record(DID), record(REACHED)
        # the records' one element (a view: compiled code writes through it, and r["name"] reads it 4x faster than
        # a record's attribute)
        self._c, self._did = self.cnt[0], self.o_n[0]
        n = 64
        self.status_a = np.zeros(n, dtype=np.int8)
        for name in self._ARRAYS[1:]:
            setattr(self, name, np.zeros(n, dtype=np.int64))

    # -- slots -----------------------------------------------------------------------------------------
    def _grow(self) -> None:
        for name in self._ARRAYS:
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))

    # -- the counters, by name ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return int(self._c["used"])

    @property
    def steps(self) -> int:
        return int(self._c["steps"])

    @property
    def n_paused(self) -> int:
        return int(self._c["paused"])

    @property
    def running(self) -> list:
        """Slots in vLLM's running order."""
        return self.run_a[:self._c["n_run"]].tolist()

    @property
    def reached(self) -> dict:
        """How often each of :data:`RULES` decided something in a step."""
        return {r: int(self.reached_a[0][r]) for r in RULES}

    # -- the engine interface ------------------------------------------------------------------------
    def add(self, prompt_tokens: int, max_tokens: int, origin: Origin | None = None) -> int:
        """A new request of ``prompt_tokens`` tokens, to sample ``max_tokens`` (``origin``: see :class:`Origin`);
        returns its slot, the request's name from then on (the next one: slots go in the order of ``add``, here as
        in the compiled loop's :func:`add_slot`, and are never reused)."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise MetronomeError("a request needs at least one prompt token and one output token")
        self.reserve(1)
        return int(add_slot(prompt_tokens, max_tokens, self._c, self.status_a, self.ntok_a, self.maxtok_a,
                            self.kseq_a, self.wq_a))

    def reserve(self, n: int) -> None:
        """Room for ``n`` more requests in the arrays (the compiled loop adds requests without growing them)."""
        while self._c["next_slot"] + n > self.status_a.size:
            self._grow()

    def _held(self, s: int) -> int:
        """Slot ``s``, checked to hold a request (one aborted holds none, here or in the compiled loop)."""
        if not 0 <= s < self._c["next_slot"] or self.status_a[s] == 0:
            raise MetronomeError(f"no request in slot {s}")
        return s

    def append(self, s: int, chunk_tokens: int, max_tokens: int) -> None:
        """The next frame's input for a paused session (:func:`resume_slot`)."""
        if self.status_a[self._held(s)] != _P:
            raise MetronomeError(f"request {s} is {_NAME[int(self.status_a[s])]}, not paused between frames")
        resume_slot(s, chunk_tokens, max_tokens, self._c, self.status_a, self.computed_a, self.ntok_a, self.out_a,
                    self.maxtok_a, self.kw_a)

    def abort(self, s: int) -> None:
        abort_slot(self._held(s), self._c, self.status_a, self.slots_a, self.held_a, self.run_a, self.kw_a,
                   self.wq_a)

    def session_ended(self, session: int) -> None:
        """The front end's ``session`` is over: nothing will restart from its requests. The model keeps nothing by
        session; an engine of token ids forgets the ids it kept for a restart."""

    def status(self, s: int) -> str | None:
        """What request ``s`` is doing; None once aborted (or never added)."""
        return _NAME[int(self.status_a[s])] if 0 <= s < self._c["next_slot"] and self.status_a[s] else None

    def computed(self, s: int) -> int:
        return int(self.computed_a[self._held(s)])

    def tokens_of(self, s: int) -> int:
        return int(self.ntok_a[self._held(s)])

    def blocks_of(self, s: int) -> int:
        return int(self.held_a[self._held(s)])

    def free_blocks(self) -> int:
        return self.limits.num_blocks - int(self._c["used"])

    def has_work(self) -> bool:
        c = self._c
        return bool(c["n_run"] or c["n_wq"] or c["n_kw"])

    # -- by slot, for callers that keep arrays (the simulator) -------------------------------------------
    def append_many(self, slots: np.ndarray, chunk_tokens, max_tokens) -> None:
        """:meth:`append` for many paused requests at once (slots from :meth:`add`; chunks and max tokens one for
        all or one per slot)."""
        if slots.size == 0:
            return
        if (self.status_a[slots] != _P).any():
            raise MetronomeError("append_many: a request is not paused between frames")
        _resume_many(np.asarray(slots, np.int64), np.broadcast_to(np.asarray(chunk_tokens, np.int64), slots.shape),
                     np.broadcast_to(np.asarray(max_tokens, np.int64), slots.shape), self._c, self.status_a,
                     self.computed_a, self.ntok_a, self.out_a, self.maxtok_a, self.kw_a)

    def computed_of(self, slots: np.ndarray) -> np.ndarray:
        return self.computed_a[slots]

    def held_of(self, slots: np.ndarray) -> np.ndarray:
        return self.held_a[slots]

    def waiting_of(self, slots: np.ndarray) -> np.ndarray:
        """True where the request has tokens to compute but sits in a waiting queue (new, resumed, preempted)."""
        st = self.status_a[slots]
        return (st == _W) | (st == _X)

    # -- one step --------------------------------------------------------------------------------------
    def arrays(self) -> EngineArrays:
        """The engine's state as :func:`engine_step` takes it, in its order (the compiled loop reads it by name)."""
        return EngineArrays(self.lim, self.cnt, self.status_a, self.computed_a, self.ntok_a, self.slots_a, self.held_a,
                self.out_a, self.maxtok_a, self.kseq_a, self.run_a, self.kw_a, self.wq_a, self.o_s, self.o_k,
                self.o_pre, self.o_sam, self.o_pau, self.o_n, self.reached_a)

    def step(self) -> StepRecord:
        self._kernel(self.arrays())
        return self.last_step()

    def last_step(self) -> StepRecord:
        """The record of the step just taken (by :meth:`step`, or by the compiled loop on these arrays)."""
        n = self._did
        ns, na = int(n["sched"]), int(n["admitted"])
        slots = self.o_s[:ns].copy()
        return StepRecord(slots, self.o_k[:ns].copy(), preempted=self.o_pre[:n["preempted"]].tolist(),
                          admitted=slots[ns - na:].tolist(), used_blocks=int(n["used"]),
                          sampled_slots=self.o_sam[:n["sampled"]].copy(), paused_slots=self.o_pau[:n["paused"]].copy(),
                          context_tokens=int(n["ctx_tokens"]))

    def check(self) -> None:
        """Pool accounting: used = Σ held, 0 <= used <= pool; every request with work is in exactly one queue."""
        held = int(self.held_a.sum())
        assert held == self.used, f"pool accounting drifted: {held} held vs {self.used} used"
        assert 0 <= self.used <= self.limits.num_blocks, f"used {self.used} outside [0, {self.limits.num_blocks}]"
        c = self._c
        queued = np.concatenate([self.run_a[:c["n_run"]], self.kw_a[:c["n_kw"]], self.wq_a[:c["n_wq"]]])
        st = self.status_a
        assert np.unique(queued).size == queued.size, "a request is in two queues"
        assert ((st == _R) | (st == _W) | (st == _X)).sum() == queued.size, "a request with work is in no queue"
        assert int((st == _P).sum()) == int(c["paused"]), "paused requests miscounted"


# ------------------------------------------------------------------------- the front end's deadlock rule
def compile_front_end_rules() -> None:
    """Compile the front end's rules that numba compiles (:func:`deadlock_pick`, :func:`resume_need`) now, once per
    process: a live driver calls it before its clock starts, so that the first deadlock it meets does not stop the
    frame clock while numba compiles (seconds on an empty cache)."""
    none = np.zeros(0, dtype=np.int64)
    deadlock_pick(none, none, none, np.int64(0), np.bool_(False), none.copy())
    resume_need(1, 0, 0, 16, NO_CAP, 0, 1)


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
