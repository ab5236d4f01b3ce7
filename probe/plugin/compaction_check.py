"""The compaction's check, runnable anywhere PyTorch is: ``python -m metronome.probe.plugin.compaction_check``.

A plain-PyTorch paged attention over the compacted block tables against dense attention under
``semantics.mask``, with the blocks the KV manager freed set to NaN (a single read of one poisons the output).
``tests/test_compaction.py`` drives it with hypothesis on CPU; ``scripts/gpu_check.sh`` runs it on CUDA tensors
(the block table on the device, as vLLM's is), with random cases, where no pytest or vLLM is installed.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from metronome.kv_policy import cdiv
from metronome.probe.plugin import compaction
from metronome.probe.plugin.semantics import SinkWindow, mask

H, D = 2, 8


def paged_attention(q, k_cache, v_cache, qsl, seq_lens, table, bs):
    """What a paged kernel computes: request r's queries are the last ones of its sequence of seq_lens[r]
    tokens, whose keys are read block by block through its table row; plain causal attention."""
    out = torch.empty_like(q)
    for r in range(len(seq_lens)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        L = int(seq_lens[r])
        if b == a:
            continue
        blocks = table[r, :cdiv(L, bs)].long()
        k = k_cache[blocks].reshape(-1, H, D)[:L]
        v = v_cache[blocks].reshape(-1, H, D)[:L]
        pos = torch.arange(L - (b - a), L, device=q.device)  # the mask lives where the scores do
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k) / D ** 0.5
        scores = scores.masked_fill(~(torch.arange(L, device=q.device)[None, :] <= pos[:, None])[None], float("-inf"))
        w = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.nan_to_num(w, nan=0.0), v)
    return out


def dense_reference(q_of, K, V, L, Q, sw, bs):
    """Request of L tokens whose last Q are queries, under the bound's mask (None: causal)."""
    m = mask(L, sw, bs)[L - Q:]
    scores = torch.einsum("qhd,khd->hqk", q_of, K) / D ** 0.5
    scores = scores.masked_fill(~m[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), V)


def build(bs, sinks, window, reqs, seed):
    """Physical KV for each request (random distinct blocks), the blocks the manager freed (out of the first
    query's window, sinks kept) set to NaN and pointed at the null block 0, as vLLM's table holds them."""
    g = torch.Generator().manual_seed(seed)
    sw = SinkWindow(sinks, window)
    sink_blocks = cdiv(sinks, bs)
    width = max(cdiv(L, bs) for L, _ in reqs) + 1
    nblocks = 1 + sum(cdiv(L, bs) for L, _ in reqs)
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()
    k_cache = torch.randn(nblocks, bs, H, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(nblocks, bs, H, D, generator=g, dtype=torch.float64)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    dense, qs, qsl = [], [], [0]
    for r, (L, Q) in enumerate(reqs):
        ids = [perm.pop() for _ in range(cdiv(L, bs))]
        table[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        K = k_cache[ids].reshape(-1, H, D)[:L].clone()
        V = v_cache[ids].reshape(-1, H, D)[:L].clone()
        dense.append((K, V))
        qs.append(torch.randn(Q, H, D, generator=g, dtype=torch.float64))
        qsl.append(qsl[-1] + Q)
        first_ws = max(L - Q - window + 1, 0) // bs  # the manager frees below the first query's window
        for b in range(sink_blocks, first_ws):
            k_cache[ids[b]] = float("nan")
            v_cache[ids[b]] = float("nan")
            table[r, b] = 0
    k_cache[0] = float("nan")  # the null block
    v_cache[0] = float("nan")
    seq = torch.tensor([L for L, _ in reqs], dtype=torch.int32)
    return sw, torch.cat(qs), k_cache, v_cache, torch.tensor(qsl, dtype=torch.int32), seq, table, dense


def run_case(bs, sinks, window, reqs, seed, device="cpu"):
    """(got, want, compacted or None) for one batch: the paged attention over what the plugin hands the
    kernel, and the dense reference. The caches and the block table live on ``device``."""
    sw, q, kc, vc, qsl, seq, table, dense = build(bs, sinks, window, reqs, seed)
    kc, vc, table = kc.to(device), vc.to(device), table.to(device)
    c = compaction.compact_tables(qsl, seq, table, cdiv(sinks, bs), window, bs)
    if c is None:
        got = paged_attention(q.to(device), kc, vc, qsl, seq, table, bs)
    else:
        got = paged_attention(q.to(device), kc, vc, c.query_start_loc, c.seq_lens, c.block_table.to(device), bs)
    want = torch.cat([dense_reference(q[qsl[r]:qsl[r + 1]], K, V, L, Q, sw, bs)
                      for r, ((L, Q), (K, V)) in enumerate(zip(reqs, dense))])
    return got.cpu(), want, c


def random_case(rng: random.Random):
    """A random bound, block size and batch (decodes first, as vLLM orders them), as the tests draw them."""
    bs = rng.choice([16, 32])
    sink_blocks = rng.randint(0, 2)
    sinks = rng.randint((sink_blocks - 1) * bs + 1, sink_blocks * bs) if sink_blocks else 0
    window = max(rng.randint(bs, 4 * bs), sinks + bs)
    n_dec = rng.randint(0, 3)
    n_pre = rng.randint(0 if n_dec else 1, 3)
    reqs = [(rng.randint(1, 12 * bs), 1) for _ in range(n_dec)]
    for _ in range(n_pre):
        L = rng.randint(2, 12 * bs)
        reqs.append((L, rng.randint(2, min(L, 3 * bs))))
    return bs, sinks, window, reqs, rng.randrange(2**31)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metronome.probe.plugin.compaction_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    worst, compacted = 0.0, 0
    for _ in range(args.cases):
        case = random_case(rng)
        got, want, c = run_case(*case, device=args.device)
        if torch.isnan(got).any():
            print(f"compaction_check: FAILED: a freed block was read: {case[:4]}", file=sys.stderr)
            return 1
        err = float((got - want).abs().max())
        worst = max(worst, err)
        compacted += c is not None
        if err > 1e-12:
            print(f"compaction_check: FAILED: max |error| {err:.3g} on {case[:4]}", file=sys.stderr)
            return 1
    print(f"compaction_check: {args.cases} batches on {args.device} ({compacted} compacted), "
          f"max |error| {worst:.1e}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
