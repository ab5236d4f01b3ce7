"""Paced calibration sessions start with histories spread over a live session's rebase cycle (bounded KV)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metronome.calibration import TokenStream
from metronome.kv_policy import KVPolicy

STREAM = TokenStream(frame_period_s=0.1, input_tokens_per_frame=14, output_tokens_per_frame=2)


def _prompts(*args, **kwargs):
    from metronome.probe.calibrate import paced_prompts

    return paced_prompts(*args, **kwargs)


def test_bounded_sessions_spread_evenly_from_the_rebase_to_max_model_len():
    policy = KVPolicy.window(32, 128)
    lo, hi = 128, 4096 - 3 * STREAM.kv_tokens_per_frame
    assert _prompts(policy, 4096, STREAM, 4) == [int(lo + (i + 0.5) / 4 * (hi - lo)) for i in range(4)]
    assert _prompts(KVPolicy.sinks(32, 32, 128), 4096, STREAM, 1) == [int(160 + 0.5 * (hi - 160))]


def test_unbounded_or_too_short_a_cycle_or_too_small_a_pool_gives_fresh_sessions():
    assert _prompts(KVPolicy.unbounded(32), 4096, STREAM, 3) == [1, 1, 1]
    assert _prompts(KVPolicy.window(32, 128), 128 + 3 * STREAM.kv_tokens_per_frame, STREAM, 2) == [1, 1]
    w = KVPolicy.window(32, 128)
    assert _prompts(w, 4096, STREAM, 2, room_blocks=64, chunk_blocks=65) == [1, 1]  # a prefill chunk would not fit
    assert _prompts(w, 4096, STREAM, 2, room_blocks=65, chunk_blocks=65) == _prompts(w, 4096, STREAM, 2)


@given(n=st.integers(1, 64), max_len=st.integers(256, 40_000), window=st.sampled_from([32, 64, 128, 512]))
def test_prompts_stay_inside_the_cycle_and_increase(n, max_len, window):
    policy = KVPolicy.window(32, window)
    p = _prompts(policy, max_len, STREAM, n)
    assert len(p) == n
    hi = max_len - 3 * STREAM.kv_tokens_per_frame
    if hi > window:
        assert all(window <= x < hi for x in p) and p == sorted(p)
    else:
        assert p == [1] * n
