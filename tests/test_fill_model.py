"""The fill model: ρ(t) = ρ0 + N·r·t, t_sat, the memory ceiling and the race between fill and length."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metronome import calibration
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.workload import Durations


def cal(num_blocks=2000, prompt=0):
    c = calibration.load("moshi-7b-h200")
    return replace(c, engine=replace(c.engine, num_blocks=num_blocks), stream=replace(c.stream, prompt_tokens=prompt))


@given(st.integers(1, 400), st.integers(50, 20000), st.integers(0, 300))
def test_t_sat_is_the_linear_law_up_to_one_block(n, blocks, prompt):
    fm = FillModel(cal(blocks, prompt), KVPolicy.unbounded(16))
    t = fm.t_sat(n)
    if t is None:  # only when the sessions reach max_model_len first
        assert (blocks // n) * 16 + 1 > fm.max_tokens
        return
    linear = (blocks - fm.rho_linear(0, n)) / (n * fm.fill_rate_blocks_per_s)
    assert abs(t - max(linear, 0)) <= 16 / fm.tokens_per_s + 1e-9
    # block-granular: just before t_sat the pool holds them all, at t_sat it does not
    assert fm.occupancy_blocks(t + 1e-9, n) > blocks  # (t_sat itself is a float round-trip of n_sat)
    if t > 1 / fm.tokens_per_s:
        assert fm.occupancy_blocks(t - 1 / fm.tokens_per_s, n) <= blocks


def test_bounded_policy_never_saturates_below_its_memory_ceiling():
    fm = FillModel(cal(2000), KVPolicy.sinks(16, 16, 368))
    ceiling = fm.memory_ceiling()
    assert ceiling == 2000 // fm.peak_resident_blocks
    assert fm.t_sat(ceiling) is None
    assert fm.t_sat(ceiling + 1) is not None


def test_memory_ceiling_of_unbounded_depends_on_session_length():
    fm = FillModel(cal(2000), KVPolicy.unbounded(16))
    assert fm.memory_ceiling() is None
    short, long = fm.memory_ceiling(60), fm.memory_ceiling(600)
    assert short > long > 0


def _mc_p_saturate(fm, n, durations, horizon, runs=4000, seed=1):
    """Monte Carlo of the same block-granular fill law: sessions alive at age t hold blocks(t) each."""
    rng = np.random.default_rng(seed)
    times, blocks = fm._levels(horizon)
    d = durations.sample(rng, (runs * n)).reshape(runs, n)
    sat = np.zeros(runs, dtype=bool)
    for t, b in zip(times, blocks):
        alive = (d > t).sum(axis=1)
        sat |= alive * b > fm.usable_blocks
    return sat.mean()


@pytest.mark.parametrize("n,mean", [(60, 60.0), (60, 120.0), (80, 40.0)])
def test_exact_race_probability_matches_monte_carlo(n, mean):
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    dur = Durations("exponential", mean)
    p = fm.p_saturate_fixed(n, dur, 300.0)
    mc = _mc_p_saturate(fm, n, dur, 300.0)
    assert 0.0 <= p <= 1.0
    assert abs(p - mc) < 0.03, (p, mc)


def test_race_is_metastable_only_in_between():
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    p = [fm.p_saturate_fixed(60, Durations("exponential", m), 600.0) for m in (10.0, 80.0, 100_000.0)]
    assert p[0] < 0.01  # sessions end long before the pool fills
    assert 0.05 < p[1] < 0.95  # the race: some runs collapse, some do not
    assert p[2] > 0.99  # sessions outlive the fill
    # a bounded policy under its ceiling never saturates, whatever the durations
    fb = FillModel(cal(1500), KVPolicy.sinks(16, 16, 368))
    assert fb.p_saturate_fixed(fb.memory_ceiling(), Durations("exponential", 1e6), 600.0) == 0.0


def test_fixed_durations_are_deterministic():
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    t = fm.t_sat(60)
    assert fm.p_saturate_fixed(60, Durations("fixed", t + 5), 600.0) == 1.0
    assert fm.p_saturate_fixed(60, Durations("fixed", t - 5), 600.0) == 0.0


def test_poisson_occupancy_obeys_littles_law():
    fm = FillModel(cal(10**6), KVPolicy.sinks(16, 16, 368))
    lam, mean_d = 0.2, 1000.0
    m, v = fm.occupancy_poisson(lam, Durations("exponential", mean_d), 20000.0)
    # long after start, sessions alive ~ Poisson(λ·E[D]); each holds about the steady window (the 30 s
    # warm-up of a 1000 s session is under 10% of its life)
    steady = fm.policy.resident_blocks(10**5)
    assert m == pytest.approx(lam * mean_d * steady, rel=0.1)
    assert v > 0
    assert v == pytest.approx(lam * mean_d * steady**2, rel=0.1)  # compound Poisson: λ·E[∫ b²]
    p_lo = fm.p_saturate_poisson(lam, Durations("exponential", mean_d), 20000.0)
    assert p_lo < 1e-6
    small = FillModel(cal(int(m * 0.8)), KVPolicy.sinks(16, 16, 368))
    assert small.p_saturate_poisson(lam, Durations("exponential", mean_d), 20000.0) > 0.99
