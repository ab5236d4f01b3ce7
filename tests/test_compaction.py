"""The sink+window compaction without vLLM (``metronome.probe.plugin.compaction``): a plain-PyTorch paged
attention over the compacted block tables must equal dense attention under ``semantics.mask``, for random
bounds, block sizes, chunk boundaries and mixes of decodes and prefills, while the blocks the KV manager freed
hold NaN (a single read of one poisons the output). These are the lines a GPU runs: the compaction works on
host tensors and its result is moved to the device once."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.errors import MetronomeError
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
        pos = torch.arange(L - (b - a), L)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k) / D ** 0.5
        scores = scores.masked_fill(~(torch.arange(L)[None, :] <= pos[:, None])[None], float("-inf"))
        w = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.nan_to_num(w, nan=0.0), v)
    return out


def dense_reference(q_of, K, V, L, Q, sw, bs):
    """Request of L tokens whose last Q are queries, under the bound's mask (None: causal)."""
    m = mask(L, sw, bs)[L - Q:]
    scores = torch.einsum("qhd,khd->hqk", q_of, K) / D ** 0.5
    scores = scores.masked_fill(~m[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), V)


@st.composite
def batches(draw):
    bs = draw(st.sampled_from([16, 32]))
    sink_blocks = draw(st.integers(0, 2))
    sinks = draw(st.integers(max(0, (sink_blocks - 1) * bs + 1), sink_blocks * bs)) if sink_blocks else 0
    window = draw(st.integers(bs, 4 * bs))
    if sinks >= window:
        window = sinks + bs
    n_dec = draw(st.integers(0, 3))
    n_pre = draw(st.integers(0 if n_dec else 1, 3))
    reqs = []
    for _ in range(n_dec):
        reqs.append((draw(st.integers(1, 12 * bs)), 1))
    for _ in range(n_pre):
        L = draw(st.integers(2, 12 * bs))
        reqs.append((L, draw(st.integers(2, min(L, 3 * bs)))))
    return bs, sinks, window, reqs, draw(st.integers(0, 2**31 - 1))


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


@settings(max_examples=60, deadline=None)
@given(batches())
def test_paged_attention_over_the_compacted_tables_equals_the_dense_mask(batch):
    bs, sinks, window, reqs, seed = batch
    sw, q, kc, vc, qsl, seq, table, dense = build(bs, sinks, window, reqs, seed)
    c = compaction.compact_tables(qsl, seq, table, cdiv(sinks, bs), window, bs)
    if c is None:  # nothing freed yet: the real rows are the mask
        assert not compaction.needs_compaction(seq.tolist(), cdiv(sinks, bs), window, bs)
        got = paged_attention(q, kc, vc, qsl, seq, table, bs)
    else:
        assert c.query_start_loc.dtype == qsl.dtype and c.seq_lens.dtype == seq.dtype
        assert c.block_table.dtype == table.dtype and c.block_table.shape[1] == table.shape[1]
        got = paged_attention(q, kc, vc, c.query_start_loc, c.seq_lens, c.block_table, bs)
    want = torch.cat([dense_reference(q[qsl[r]:qsl[r + 1]], K, V, L, Q, sw, bs)
                      for r, ((L, Q), (K, V)) in enumerate(zip(reqs, dense))])
    assert not torch.isnan(got).any(), "a freed block was read"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64: the same sums in another order


@settings(max_examples=60, deadline=None)
@given(batches())
def test_decodes_stay_first_and_runs_keep_their_request_order(batch):
    bs, sinks, window, reqs, seed = batch
    sw, q, kc, vc, qsl, seq, table, dense = build(bs, sinks, window, reqs, seed)
    c = compaction.compact_tables(qsl, seq, table, cdiv(sinks, bs), window, bs)
    if c is None:
        return
    n_dec = sum(1 for _, Q in reqs if Q == 1)
    req = c.req.tolist()
    assert req == sorted(req) and set(req) == set(range(len(reqs)))  # runs in request order, all requests
    assert req[:n_dec] == list(range(n_dec))  # each decode is one run, at the front
    assert compaction.decode_prefix(c.query_start_loc, 1) >= n_dec  # a decode-splitting backend still sees them
    lens = (c.query_start_loc[1:] - c.query_start_loc[:-1]).tolist()
    for r, (_, Q) in enumerate(reqs):  # the runs partition each request's queries
        assert sum(n for n, i in zip(lens, req) if i == r) == Q
    assert len(req) <= compaction.max_runs(len(reqs), int(qsl[-1]), bs)


def test_too_many_pseudo_requests_is_one_line():
    bs, window = 16, 32
    qsl = torch.tensor([0, 160], dtype=torch.int32)  # one chunk of 160 queries: 10+ runs
    seq = torch.tensor([400], dtype=torch.int32)
    table = torch.arange(1, 26, dtype=torch.int32)[None]
    with pytest.raises(MetronomeError, match="pseudo-requests in this step, more than the 4"):
        compaction.compact_tables(qsl, seq, table, 1, window, bs, limit=4)
    assert compaction.compact_tables(qsl, seq, table, 1, window, bs, limit=64) is not None
    with pytest.raises(MetronomeError, match="kernel's block size"):  # a table in smaller kernel blocks
        compaction.compact_tables(qsl, seq, table[:, :2], 1, window, bs)


# ------------------------------------------------------------------ the metadata rewrite (attention.compact)
@dataclasses.dataclass
class FakeMetadata:
    """The fields of vLLM's CommonAttentionMetadata that compact() reads or rewrites, plus what a newer vLLM
    might add."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    rswa_prefix_lens: torch.Tensor | None = None
    per_request_newthing: torch.Tensor | None = None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _metadata(**extra):
    qsl = torch.tensor([0, 1, 161], dtype=torch.int32)
    seq = torch.tensor([300, 400], dtype=torch.int32)
    table = torch.arange(1, 53, dtype=torch.int32).reshape(2, 26)
    return FakeMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=2, num_actual_tokens=161,
                        max_query_len=160, max_seq_len=400, block_table_tensor=table,
                        slot_mapping=torch.arange(161), seq_lens_cpu_upper_bound=seq, **extra)


def test_compact_rewrites_the_metadata_and_refuses_what_it_cannot_split():
    from metronome.probe.plugin.attention import compact  # no vLLM import: only patch_builders needs vLLM

    cm = _metadata(is_prefilling=torch.tensor([False, True]))
    new = compact(cm, 1, 32, 16)
    c = compaction.compact_tables(cm.query_start_loc_cpu, cm.seq_lens, cm.block_table_tensor, 1, 32, 16)
    assert new.num_reqs == c.num_reqs > 2 and torch.equal(new.query_start_loc, c.query_start_loc)
    assert torch.equal(new.is_prefilling, torch.tensor([False, True])[c.req])  # gathered per pseudo-request
    assert torch.equal(new.slot_mapping, cm.slot_mapping)  # per token: untouched
    with pytest.raises(MetronomeError, match="per_request_newthing holds one value per request"):
        compact(_metadata(per_request_newthing=torch.zeros(2)), 1, 32, 16)
    with pytest.raises(MetronomeError, match="rswa_prefix_lens set"):
        compact(_metadata(rswa_prefix_lens=torch.zeros(2)), 1, 32, 16)
