"""Paced calibration sessions start with histories spread over a live session's rebase cycle (bounded KV)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from metronome.calibration import TokenStream
from metronome.kv_policy import KVPolicy

STREAM = TokenStream(frame_period_s=0.1, input_tokens_per_frame=14, output_tokens_per_frame=2)


def _prompts(*args, **kwargs):
    from metronome.probe.calibrate import paced_prompts

    return paced_prompts(*args, **kwargs)


def test_bounded_sessions_spread_evenly_from_the_rebase_to_max_model_len():
    # A frame adds 14 + 2 = 16 tokens; the cycle runs from the rebase (S + W tokens) up to max_model_len less
    # three frames' tokens: 4096 - 3 * 16 = 4048. n sessions sit at the midpoints of n equal slices of it.
    # window W = 128: 128 .. 4048, span 3920; n = 4, slice 980, midpoints 490, 1470, 2450, 3430 past 128.
    assert STREAM.kv_tokens_per_frame == 16
    assert _prompts(KVPolicy.window(32, 128), 4096, STREAM, 4) == [618, 1598, 2578, 3558]
    # sinks S = 32, W = 128: 160 .. 4048, span 3888; n = 1: 160 + 1944
    assert _prompts(KVPolicy.sinks(32, 32, 128), 4096, STREAM, 1) == [2104]
    # a span that is not a multiple of n truncates: window 128, max_len 1000: 128 .. 952, span 824;
    # n = 3: 128 + 824/6 = 265.33, 128 + 824/2 = 540, 128 + 5 * 824/6 = 814.67
    assert _prompts(KVPolicy.window(32, 128), 1000, STREAM, 3) == [265, 540, 814]


def test_unbounded_or_too_short_a_cycle_or_too_small_a_pool_gives_fresh_sessions():
    assert _prompts(KVPolicy.unbounded(32), 4096, STREAM, 3) == [1, 1, 1]
    # max_len 176 = 128 + 48: the cycle's top (176 - 48 = 128) is the rebase itself; nothing to spread over
    assert _prompts(KVPolicy.window(32, 128), 176, STREAM, 2) == [1, 1]
    # one token more and there is a cycle (128 .. 129): both sessions sit at 128 + 0.25 and 128 + 0.75
    assert _prompts(KVPolicy.window(32, 128), 177, STREAM, 2) == [128, 128]
    w = KVPolicy.window(32, 128)
    assert _prompts(w, 4096, STREAM, 2, room_blocks=64, chunk_blocks=65) == [1, 1]  # a prefill chunk would not fit
    # room for exactly one chunk: spread as without a pool limit (128 .. 4048, n = 2: 128 + 980, 128 + 2940)
    assert _prompts(w, 4096, STREAM, 2, room_blocks=65, chunk_blocks=65) == [1108, 3068]
    assert _prompts(w, 4096, STREAM, 2) == [1108, 3068]


@given(n=st.integers(1, 64), max_len=st.integers(256, 40_000), window=st.sampled_from([32, 64, 128, 512]))
@example(n=18, max_len=12368, window=512)  # found by a CI run: float slices truncated to 655 and 657 for 656
def test_prompts_stay_inside_the_cycle_and_increase(n, max_len, window):
    policy = KVPolicy.window(32, window)
    p = _prompts(policy, max_len, STREAM, n)
    assert len(p) == n
    hi = max_len - 48  # three frames of 16 tokens below max_model_len
    if hi > window:
        assert all(window <= x < hi for x in p) and p == sorted(p)
        # evenly spread: consecutive sessions one slice (span / n) apart, up to the truncation to whole tokens;
        # the first half a slice above the rebase, the last half a slice below the top
        step = (hi - window) / n
        assert all(abs((b - a) - step) < 1 for a, b in zip(p, p[1:]))
        assert abs(p[0] - (window + step / 2)) < 1 and abs(p[-1] - (hi - step / 2)) < 1
    else:
        assert p == [1] * n
