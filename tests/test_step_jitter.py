"""The real-time terms of the step model: a frame's first step (after the idle gap) and the step-time jitter.

Both come from ``metronome-probe calibrate``'s paced runs; both default to off, so every preset and every older
calibration simulates exactly as before.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome import calibration
from metronome.calibration import StepLatencyModel, from_dict
from metronome.errors import CalibrationError
from metronome.kv_policy import KVPolicy
from metronome.sim.scenario import Scenario, run
from metronome.workload import Arrivals, Durations

JITTER = ((0.0, 0.85), (0.5, 1.0), (0.9, 1.1), (0.99, 1.5), (1.0, 2.0))


def _real_time(c, first_s=0.002, jitter=JITTER):
    return replace(c, step_latency=replace(c.step_latency, frame_first_s=first_s, jitter=jitter))


def test_ratio_is_a_pure_function_of_seed_and_index():
    m = StepLatencyModel(0.001, 0.0, 0.0, 0.0, jitter=JITTER)
    idx = np.arange(1000)
    a = m.ratio(idx, seed=5)
    assert np.array_equal(a[::-1], m.ratio(idx[::-1], seed=5))  # order does not matter
    assert np.array_equal(a[500:], m.ratio(idx[500:], seed=5))  # nor which subset is asked for
    assert m.ratio(17, seed=5)[0] == a[17]
    assert not np.array_equal(a, m.ratio(idx, seed=6))
    assert np.array_equal(StepLatencyModel(0.001, 0.0, 0.0, 0.0).ratio(idx), np.ones(1000))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), start=st.integers(0, 2**40))
def test_ratio_follows_the_jitter_distribution(seed, start):
    m = StepLatencyModel(0.001, 0.0, 0.0, 0.0, jitter=JITTER)
    r = m.ratio(np.arange(start, start + 20_000), seed)
    assert r.min() >= 0.85 and r.max() <= 2.0
    for p, ratio in JITTER[1:-1]:  # the empirical CDF at each point is its p
        assert abs(float(np.mean(r <= ratio)) - p) < 0.015


def test_calibration_file_round_trip_and_old_files_unchanged(tmp_path):
    c = calibration.load("moshi-7b-h200")
    assert "jitter" not in c.to_dict()["step_latency"]  # a preset's file is written as before
    rt = _real_time(c)
    d = json.loads(rt.to_json())
    assert d["step_latency"]["frame_first_s"] == 0.002 and d["step_latency"]["jitter"][3] == [0.99, 1.5]
    back = from_dict(d)
    assert back.step_latency.jitter == JITTER and back.step_latency.frame_first_s == 0.002


@pytest.mark.parametrize("jitter,why", [
    ([[0.1, 1.0], [1.0, 1.2]], "p rising from 0 to 1"),
    ([[0.0, 1.2], [1.0, 1.0]], "non-decreasing"),
    ([[0.0, 0.0], [1.0, 1.0]], "positive"),
    ([[0.0, 1.0], [0.0, 1.1], [1.0, 1.2]], "rising"),
    ([[0.0, "x"], [1.0, 1.0]], "[p, ratio]"),
    ({"p": 1}, "list"),
])
def test_bad_jitter_is_one_line_naming_the_field(jitter, why):
    d = json.loads(calibration.load("moshi-7b-h200").to_json())
    d["step_latency"]["jitter"] = jitter
    with pytest.raises(CalibrationError) as e:
        from_dict(d, "x.json")
    msg = str(e.value)
    assert "step_latency.jitter" in msg and why in msg and "\n" not in msg


def _tables_equal(x, y):
    import pandas as pd

    for name in ("steps", "frames", "sessions"):
        pd.testing.assert_frame_equal(getattr(x, name), getattr(y, name), check_exact=True)


@pytest.mark.parametrize("spells", [None, (0.6, 1.0, 0.1)], ids=["independent", "spells"])
@pytest.mark.parametrize("policy,arrivals,durations", [
    (KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=5.0), Durations("exponential", 20.0)),
    (KVPolicy.sinks(16, 16, 256), Arrivals("ramp", sessions=90, ramp_s=10.0), Durations("lognormal", 30, 0.5)),
], ids=["unbounded-poisson", "sinks-ramp"])
def test_fast_forward_stays_exact_with_jitter_and_the_first_step_term(policy, arrivals, durations, spells):
    """Also with the jitter's slow spells and frame-only part (tests/test_jitter_correlation.py): their draws
    depend on each step's frame, which a fast-forwarded span must get right."""
    c = _real_time(calibration.load("moshi-7b-h200"))
    if spells:
        shared, tau, frame = spells
        c = replace(c, step_latency=replace(c.step_latency, jitter_shared=shared, jitter_tau_s=tau,
                                            jitter_frame=frame))
    c = replace(c, engine=replace(c.engine, num_blocks=1_500))
    sc = Scenario(c, policy, arrivals, 60.0, durations=durations, seed=3)
    slow, fast = run(sc, fast_forward=False, check_invariants=True), run(sc, fast_forward=True)
    _tables_equal(slow, fast)
    # the compiled loop took the steps (with spells too: each step's draw from the frame it is taken on)
    assert slow.fast_steps == 0 and fast.fast_steps > 0.8 * fast.summary["steps"]


def test_frame_latency_gets_the_first_step_and_the_tail():
    c = calibration.load("moshi-7b-h200")
    sc = Scenario(c, KVPolicy.sinks(16, 16, 256), Arrivals("all", sessions=50), 30.0, seed=1, phases="aligned")
    base = run(sc).summary
    first = run(replace(sc, calibration=_real_time(c, jitter=()))).summary
    # in lockstep every frame's first step follows the idle gap: it takes 2 ms more, and nothing else changes
    assert first["p50_frame_latency_s"] == pytest.approx(base["p50_frame_latency_s"] + 0.002, abs=1e-6)
    jit = run(replace(sc, calibration=_real_time(c, first_s=0.0))).summary
    # jitter leaves the median near the model and puts a tail on the 99th percentile
    assert jit["p50_frame_latency_s"] == pytest.approx(base["p50_frame_latency_s"], rel=0.05)
    assert jit["p99_frame_latency_s"] > 1.15 * base["p99_frame_latency_s"]
    # and a different seed draws different steps
    other = run(replace(sc, calibration=_real_time(c, first_s=0.0), seed=2)).summary
    assert other["p99_frame_latency_s"] != jit["p99_frame_latency_s"]


def test_the_first_step_term_is_paid_only_after_the_engine_idled():
    """With independent phases the engine often steps back to back: a step that starts a frame right after
    another step pays no first-step term; one after a wait does."""
    c = calibration.load("moshi-7b-h200")
    # (few sessions: at this preset's ~7 ms base, 40 sessions' ticks already keep the engine stepping back to back)
    sc = Scenario(c, KVPolicy.sinks(16, 16, 256), Arrivals("all", sessions=8), 20.0, seed=1)
    st = run(replace(sc, calibration=_real_time(c, jitter=()))).steps
    gap = np.concatenate([[True], st.t_s.to_numpy()[1:] > (st.t_s + st.step_s).to_numpy()[:-1] + 1e-12])
    model = c.step_latency_for(sc.policy).step_s(st.batch.to_numpy(), st.context_tokens.to_numpy(),
                                                 st.new_tokens.to_numpy())
    paid = st.step_s.to_numpy() - model
    assert np.allclose(paid[gap], 0.002, atol=1e-9) and np.allclose(paid[~gap], 0.0, atol=1e-9)
    assert gap.sum() > 10 and (~gap).sum() > 10  # both kinds of steps occur
