"""KV policies: block-granular residency, the way a paged engine frees blocks."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, make_policy

block_sizes = st.sampled_from([1, 2, 16, 32])


@st.composite
def policies(draw):
    bs = draw(block_sizes)
    kind = draw(st.sampled_from(["unbounded", "window", "sinks"]))
    if kind == "unbounded":
        return KVPolicy.unbounded(bs)
    w = draw(st.integers(max(bs, 2), 40 * bs))
    if kind == "window":
        return KVPolicy.window(bs, w)
    s = draw(st.integers(1, w - 1))
    return KVPolicy.sinks(bs, s, w)


def kept_positions(p: KVPolicy, n: int) -> set[int]:
    """Brute force: the token positions the next query (at n) may attend to, from the cache.

    Block-granular sinks+window: k < S* (sinks rounded up to whole blocks) or k >= bs*floor((n-W+1)/bs)."""
    if not p.bounded:
        return set(range(n))
    bs = p.block_size
    s_star = -(-p.sink_tokens // bs) * bs
    first = max(n - p.window_tokens + 1, 0) // bs * bs
    return {k for k in range(n) if k < s_star or k >= first}


def blocks_brute(p: KVPolicy, n: int) -> int:
    """A paged engine keeps a block while any position in it is kept (blocks past n are not allocated)."""
    return len({k // p.block_size for k in kept_positions(p, n)} | ({(n - 1) // p.block_size} if n else set()))


@given(policies(), st.integers(0, 3000))
def test_resident_blocks_match_a_brute_force_paged_cache(p, n):
    assert int(p.resident_blocks(n)) == blocks_brute(p, n)


@given(policies(), st.integers(0, 3000))
def test_blocks_never_negative_and_tokens_fill_blocks(p, n):
    b, t = int(p.resident_blocks(n)), int(p.resident_tokens(n))
    assert b >= 0 and t >= 0
    assert t <= b * p.block_size  # resident tokens live in resident blocks
    assert t >= len(kept_positions(p, n))  # and include every kept position


@given(policies(), st.integers(0, 3000))
def test_unbounded_is_monotone_and_bounded_is_capped(p, n):
    if not p.bounded:
        assert p.resident_tokens(n + 1) == p.resident_tokens(n) + 1
        assert p.resident_blocks(n + 1) >= p.resident_blocks(n)
    else:
        cap = p.sink_blocks + p.window_blocks + 1
        assert p.max_resident_blocks == cap
        assert p.resident_blocks(n) <= cap
        assert p.resident_tokens(n) <= cap * p.block_size


@given(st.integers(1, 64), st.integers(1, 200), st.integers(0, 5000))
def test_sink_blocks_are_never_freed(bs, s, n):
    w = s + bs + 7
    p = KVPolicy.sinks(bs, s, w)
    kept = {k // bs for k in kept_positions(p, n)}
    sink_blocks = set(range(min(p.sink_blocks, -(-n // bs))))
    assert sink_blocks <= kept
    # and the count includes them: dropping sinks (window only) never holds more
    assert p.resident_blocks(n) >= KVPolicy.window(bs, w).resident_blocks(n)


@given(policies(), st.integers(0, 3000), st.integers(0, 500))
def test_canonical_form_preserves_residency_for_every_future(p, n, d):
    n_c, b_off, t_off = p.canonical(n)
    assert p.resident_blocks(n + d) == p.resident_blocks(n_c + d) + b_off
    assert p.resident_tokens(n + d) == p.resident_tokens(n_c + d) + t_off


@given(policies(), st.integers(0, 3000))
def test_attended_tokens_is_the_mask_size(p, n):
    q = n  # the next query attends to the kept positions and itself
    assert p.attended_tokens(n) == len(kept_positions(p, n)) + 1


@given(st.integers(2, 200), st.integers(0, 3000))
def test_with_one_token_blocks_the_mask_is_streaming_llms(w, n):
    s = max(1, w // 4)
    p = KVPolicy.sinks(1, s, w)
    mask = [k for k in range(n + 1) if k < s or n - k < w]
    assert p.attended_tokens(n) == len(mask)


def test_the_window_keeps_between_w_and_w_plus_a_block_of_recent_keys():
    p = KVPolicy.window(32, 64)
    recent = [int(p.attended_tokens(n)) for n in range(200, 400)]
    assert min(recent) == 64 and max(recent) == 64 + 31


def test_vectorised_equals_scalar():
    p = KVPolicy.sinks(16, 20, 100)
    n = np.arange(0, 1000)
    assert list(p.resident_blocks(n)) == [int(p.resident_blocks(int(x))) for x in n]


def test_window_example_by_hand():
    # W=64, bs=32: after 65 tokens the next query needs positions 2..64 -> blocks 0,1,2 all still held
    p = KVPolicy.window(32, 64)
    assert p.resident_blocks(65) == 3
    # after 96 tokens: positions 33..95 -> blocks 1,2 (block 0 wholly out of the window is freed)
    assert p.resident_blocks(96) == 2
    s = KVPolicy.sinks(32, 4, 64)
    assert s.resident_blocks(96) == 3  # sink block 0 stays pinned


@pytest.mark.parametrize("kind,w,s,msg", [
    ("window", 8, None, "under one block"),
    ("sinks", 64, 64, "fewer than the window"),
    ("sinks", 64, 0, "needs --sinks"),
    ("window", None, None, "needs --window"),
    ("bogus", 64, None, "unknown KV policy"),
])
def test_bad_policies_are_one_line_errors(kind, w, s, msg):
    with pytest.raises(MetronomeError, match=msg) as e:
        make_policy(kind, 16, w, s)
    assert "\n" not in str(e.value)


@given(needs=st.lists(st.integers(0, 50), max_size=30), free=st.integers(0, 300))
def test_admit_fcfs_admits_the_longest_prefix_that_fits(needs, free):
    from collections import deque

    from metronome.serving import admit_fcfs

    queue = deque(range(len(needs)))
    admitted = admit_fcfs(queue, lambda i: needs[i], free)
    k = len(admitted)
    assert admitted == list(range(k)) and list(queue) == list(range(k, len(needs)))  # order kept, head first
    assert sum(needs[:k]) <= free  # what it admitted fits
    assert k == len(needs) or sum(needs[:k + 1]) > free  # and it stopped at the first head that did not


# ------------------------------------------------------------------------------ the policy answers for itself
def test_the_policy_says_how_it_is_named_served_and_selected():
    from metronome.kv_policy import make_policy

    s, w, u = KVPolicy.sinks(16, 16, 368), KVPolicy.window(16, 368), KVPolicy.unbounded(16)
    assert [p.short_words() for p in (s, w, u)] == ["sinks S=16, W=368", "window W=368", "unbounded"]
    assert [p.slug() for p in (s, w, u)] == ["-sinks16-window368", "-window368", ""]
    assert [p.cli_args() for p in (s, w, u)] == [["--kv", "sinks", "--window", "368", "--sinks", "16"],
                                                 ["--kv", "window", "--window", "368"], ["--kv", "unbounded"]]
    assert s.engine_settings() == {"sliding_window": 368, "sinks": 16}  # the plugin
    assert w.engine_settings() == {"sliding_window": 368, "sinks": None}  # vLLM's own window
    assert u.engine_settings() == {"sliding_window": None, "sinks": None}
    assert [p.runs_plugin for p in (s, w, u)] == [True, False, False]
    for p in (s, w, u):  # the options read back into the same policy
        o = p.options()
        assert make_policy(o["kv"], 16, o["window"], o["sinks"]) == p


def test_no_code_outside_kv_policy_branches_on_a_policy_kind():
    """A new policy is a new KVPolicy, not a new branch in every caller: outside metronome/kv_policy.py no code
    compares a policy's kind (or a --kv value) with a policy name."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    branch = re.compile(r"""\b(kind|kv)\s*(==|!=)\s*["'](unbounded|window|sinks)["']"""
                        r"""|(==|!=)\s*["'](window|sinks)["']|\bin\s*\(\s*["'](window|sinks)["']""")
    found = []
    for folder in ("metronome", "sim", "probe", "benchmarks", "examples"):
        for f in sorted((root / folder).rglob("*.py")):
            if f == root / "metronome" / "kv_policy.py":
                continue
            for no, line in enumerate(f.read_text().splitlines(), 1):
                if branch.search(line) and not line.lstrip().startswith("for "):  # a loop over policies is fine
                    found.append(f"{f.relative_to(root)}:{no}: {line.strip()}")
    assert found == [], "\n".join(found)
