"""The sink+window bound's block-table compaction, as a pure function of host-side tensors (no vLLM import).

A paged attention kernel reads, for each request, the blocks its block-table row names up to ``seq_len``.
Under the bound the KV manager has freed the blocks between the sinks and the window (their slots hold the
null block), so the plugin hands the kernel *pseudo-requests* instead: each request's queries are split into
runs that share a first window block ``ws = floor(max(q − W + 1, 0) / bs)``, and a run whose window has moved
past the sink blocks gets the row ``[sink blocks] + [blocks ws .. last]`` and ``seq_len = S* + (end − ws·bs)``;
the kernel then runs plain causal attention over it, exactly the block-granular mask of ``semantics.py``. Runs
whose window still overlaps the sinks keep the real row. The runs partition the query tokens in order, so
the output needs no reordering and the new K/V slots (computed from the real table) are untouched.

Everything here works on host tensors (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound`` and the block
table) and the result is moved to the device once by the caller, so the CPU tests run the very lines a GPU
runs. ``tests/test_compaction.py`` checks it without vLLM: a plain-PyTorch paged attention over the compacted
tables against the dense masked reference, for random bounds, block sizes, chunks and mixes of decodes and
prefills.

**Decode-first order.** vLLM reorders a batch so that requests with at most ``reorder_batch_threshold`` queries
come first, and backends that split decodes from prefills (``split_decodes_and_prefills``) take the requests
before the first longer one as decodes. Compaction keeps every request's runs in its place, so the original
decodes stay first, each one run; a prefill's runs follow it. A short run *inside* a prefill (its first or
last, where the chunk crosses a block boundary) is classified by its length like any request: a run of one
query before the first long run is a decode (one query over its KV prefix: decode semantics), one after it goes
to the prefill path, which takes any length. :func:`decode_prefix` is that classification, for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def max_runs(max_num_seqs: int, max_num_batched_tokens: int, bs: int) -> int:
    """The most pseudo-requests one step can need: each request is one run, plus one more each time a
    request's queries cross a block boundary past its first run (at most one per ``bs`` tokens of the step,
    and one per request for a chunk starting mid-block)."""
    return 2 * max_num_seqs + cdiv(max_num_batched_tokens, bs)


@dataclass(frozen=True)
class Compacted:
    """Host tensors of the pseudo-requests (move them to the device once)."""

    query_start_loc: torch.Tensor  # [R + 1], the dtype of the input query_start_loc
    seq_lens: torch.Tensor  # [R], the dtype of the input seq_lens
    block_table: torch.Tensor  # [R, width], the dtype of the input block table
    req: torch.Tensor  # [R] int64: the original request of each run
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.numel())


def needs_compaction(seq_lens: list[int], sink_blocks: int, window: int, bs: int) -> bool:
    """False when every request's last query (the one with the latest window) still sees its whole prefix:
    nothing has been freed yet and plain causal attention over the real rows is the mask."""
    return any(max(L - window, 0) // bs > sink_blocks for L in seq_lens)


def compact_tables(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_table: torch.Tensor,
                   sink_blocks: int, window: int, bs: int, limit: int | None = None) -> Compacted | None:
    """The pseudo-requests of one step (module docstring), or None when no compaction is needed.

    ``query_start_loc_cpu`` [n + 1] and ``seq_lens_cpu`` [≥ n] are host tensors; ``block_table`` [≥ n, width]
    may live on any device (only its first n rows are read, once, to the host). ``limit``: the most
    pseudo-requests the attention backend was sized for (its per-request buffers); more raise a one-line
    error instead of overrunning them."""
    n = int(query_start_loc_cpu.numel()) - 1
    qsl = query_start_loc_cpu[: n + 1].tolist()
    seq = seq_lens_cpu[:n].tolist()
    if not needs_compaction(seq, sink_blocks, window, bs):
        return None
    runs = plan_runs(qsl, seq, sink_blocks, window, bs)
    if limit is not None and len(runs) > limit:
        raise MetronomeError(
            f"the sink+window bound needs {len(runs)} attention pseudo-requests in this step, more than the {limit} "
            "the attention backend was sized for (max_num_seqs); raise --max-num-seqs or lower "
            "--max-num-batched-tokens")
    width = block_table.shape[1]
    src = block_table[:n].cpu() if block_table.device.type != "cpu" else block_table[:n]
    if sink_blocks + max(cdiv(end, bs) - ws for _, ws, _, end in runs if ws is not None) > width:
        raise MetronomeError("the block table is narrower than a compacted row: the kernel's block size differs "
                             "from the KV manager's, which the sink+window bound does not support")
    new_bt = torch.zeros((len(runs), width), dtype=block_table.dtype)
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
    return Compacted(query_start_loc=torch.tensor(new_qsl, dtype=query_start_loc_cpu.dtype),
                     seq_lens=torch.tensor(new_seq, dtype=seq_lens_cpu.dtype), block_table=new_bt,
                     req=torch.tensor([r[0] for r in runs], dtype=torch.int64),
                     max_query_len=max(r[2] for r in runs), max_seq_len=max(new_seq))


def decode_prefix(query_start_loc: torch.Tensor, threshold: int) -> int:
    """How many leading requests a backend splitting decodes from prefills takes as decodes: those before
    the first with more than ``threshold`` queries (vLLM's ``split_decodes_and_prefills``)."""
    q = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    for i, n in enumerate(q):
        if n > threshold:
            return i
    return len(q)
