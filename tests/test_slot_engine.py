"""The front end over a live engine's interface: :class:`metronome.probe.slot_engine.SlotEngine` over the fake
engine (request ids and token ids) must serve exactly as the front end over the engine model (slots and counts).

The simulator is run twice, step by step, on the same scenario: once over :class:`metronome.serving.EngineModel`,
once over a ``SlotEngine`` wrapping ``tests/fake_engine.py``'s ``FakeEngine`` (whose every scheduling decision is
an ``EngineModel``'s, but which is driven as vLLM is: named requests, token id lists, a re-fed token per chunk).
Every step, frame and session must be equal: the adapter may add nothing and lose nothing. And the ids it handed
the fake must be the ones vLLM's streaming requests need (``fake_engine.token_id_errors``: the re-fed token, a
readmission's whole history, a rebase's sinks and last ids), checked a fair number of times between the scenarios.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pytest

from fake_engine import FakeEngine, token_id_errors
from test_front_end_differential import random_scenarios

from metronome import serving
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.probe.slot_engine import SlotEngine
from metronome.serving import Origin
from metronome.sim import scenario as sc_mod

N_SCENARIOS = 80
REACH = 3


def _over_fake(sc, made: dict):
    """The scenario's engine as the fake, in slots; ``made`` gets the fake."""
    def make(policy, limits):
        eng = FakeEngine(num_blocks=limits.num_blocks + 1, block_size=policy.block_size,
                         max_model_len=limits.max_model_len, policy=policy,
                         max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
                         watermark_blocks=limits.watermark_blocks, sleep_min_s=0.0, own_loop=sc.loop == "vllm")
        rng = np.random.default_rng(sc.seed)
        made["fake"] = eng
        made["slots"] = SlotEngine(eng, policy, limits, serving.rebase_keep_tokens(policy, limits.max_model_len),
                          fresh=lambda i, n: rng.integers(10, 30000, size=n).tolist())
        return made["slots"]
    return make


def test_the_front_end_over_the_fake_in_slots_serves_as_over_the_model():
    checks, kinds = Counter(), Counter()
    for k, sc in random_scenarios(N_SCENARIOS):
        made = {}
        a = sc_mod.run(sc, fast_forward=False, check_invariants=True)
        b = sc_mod.run(sc, fast_forward=False, check_invariants=True, engine_model=_over_fake(sc, made))
        for name in ("steps", "frames", "sessions"):
            pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True,
                                          obj=f"{name} (scenario {k})")
        eng = made["fake"]
        # ids kept for a restart only of sessions still alive (a live run of hours would hold every ended one's)
        alive = set(b.sessions.session[b.sessions.end_reason == "horizon"])
        assert set(made["slots"].gone) <= alive, (k, set(made["slots"].gone) - alive)
        errors, checked = token_id_errors(eng, sc.policy.sink_tokens)
        assert not errors, (k, errors[:3])
        checks.update(checked)
        kinds.update(e["rid"].partition(".")[2][:1] or "first" for e in eng.appends() if e["new"])
    print(dict(checks), dict(kinds))
    assert min(checks[c] for c in ("refeed", "readmit", "rebase")) >= REACH, checks
    assert min(kinds[c] for c in ("first", "p", "r")) >= REACH, kinds


def _adapter(**kw):
    eng = FakeEngine(num_blocks=40, block_size=16, max_model_len=kw.pop("maxlen", 4096))
    ids = iter(range(100, 10_000))
    return SlotEngine(eng, eng.policy, eng.limits, keep_tokens=kw.pop("keep", 32),
                      fresh=lambda i, n: [next(ids) for _ in range(n)]), eng


def _run_frame(se, eng, s):
    """Step until request ``s`` (a slot) samples, return the id it sampled."""
    while True:
        se.step()
        sampled = eng.log[-1]["sampled"]
        name = se.name_of[s]
        if name in sampled:
            return sampled[name]


def test_a_readmission_carries_what_the_aborted_request_held_then_the_silent_input():
    se, eng = _adapter()
    se.add(5, 1, Origin(7, "first", 0, 5))
    last = _run_frame(se, eng, 0)
    assert eng.held_tokens("s7") == [100, 101, 102, 103, 104, last]
    se.abort(0)  # preempted: the session waits with what it held (6 tokens) and 2 silent inputs
    assert se.status(0) is None  # (a slot names one request: aborted, it holds none)
    with pytest.raises(MetronomeError, match="no live request in slot 0"):
        se.append(0, 2, 1)
    se.add(8, 1, Origin(7, "readmit", 6, 8))
    assert eng.appends("s7.p1")[0]["tokens"] == [100, 101, 102, 103, 104, last, 105, 106]
    # a front end that counts a history other than what the engine held is caught, not sent
    se.abort(1)
    with pytest.raises(MetronomeError, match="history of 9 tokens; its request held 8"):
        se.add(11, 1, Origin(7, "readmit", 9, 11))


def test_a_chunk_re_feeds_the_sampled_token_and_a_rebase_keeps_the_sinks_and_the_last_ids():
    policy = KVPolicy.sinks(4, sink_tokens=2, window_tokens=4)
    eng = FakeEngine(num_blocks=40, block_size=4, policy=policy)
    ids = iter(range(100, 10_000))
    se = SlotEngine(eng, policy, eng.limits, keep_tokens=5, fresh=lambda i, n: [next(ids) for _ in range(n)])
    se.add(6, 1, Origin(3, "first", 0, 6))
    a = _run_frame(se, eng, 0)
    se.append(0, 3, 1)  # the sampled token, then two fresh ids
    assert eng.appends("s3")[-1]["tokens"] == [a, 106, 107]
    b = _run_frame(se, eng, 0)
    # it holds 100..105, a, 106, 107, b; its next frame does not fit: the new request keeps (keep_tokens=5) S=2
    # sinks and the last 3 ids of the history before b, then the frame's chunk, b re-fed first
    se.abort(0)
    se.add(5 + 3, 1, Origin(3, "rebase", 9, 3))
    assert eng.appends("s3.r1")[0]["tokens"] == [100, 101, a, 106, 107, b, 108, 109]
    # a session that ends keeps no ids behind
    se.abort(1)
    se.session_ended(3)
    assert not se.gone and not se.held


def test_append_many_asks_each_request_for_its_own_output_tokens():
    """A server's sessions may each ask for their own tokens a frame: ``append_many`` with one max-tokens per slot
    leaves each request as its own ``append`` would, in the engine model and in the engine in slots alike."""
    policy = KVPolicy.unbounded(16)
    limits = serving.EngineLimits(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)

    def paused_pair(model):
        slots = np.array([model.add(5, 1) for _ in range(2)], dtype=np.int64)
        while model.has_work():
            model.step()
        return slots

    def run(append):
        m = serving.EngineModel(policy, limits)
        slots = paused_pair(m)
        append(m, slots)
        steps = 0
        while m.has_work():
            m.step()
            steps += 1
        return [m.out_a[s] for s in slots], steps

    one_each = run(lambda m, sl: (m.append(0, 2, 1), m.append(1, 2, 3)))
    assert run(lambda m, sl: m.append_many(sl, 2, np.array([1, 3]))) == one_each
    assert run(lambda m, sl: m.append_many(sl, 2, 1)) != one_each  # (the check tells the two apart)

    asked = []
    eng = FakeEngine(num_blocks=65, block_size=16, sleep_min_s=0.0)
    eng.append = lambda rid, ids, max_tokens, **kw: asked.append((rid, len(ids), max_tokens))
    slot_engine = SlotEngine(eng, policy, limits, 0, fresh=lambda i, n: [7] * n)
    sl = np.array([slot_engine.add(5, 1, Origin(r, "first", 0, 5)) for r in (0, 1)], dtype=np.int64)
    asked.clear()
    slot_engine.append_many(sl, 2, np.array([1, 3]))
    assert [a[2] for a in asked] == [1, 3]
