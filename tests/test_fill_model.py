"""The fill model: ρ(t) = ρ0 + N·r·t, t_sat, the memory ceiling and the race between fill and length."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metronome import calibration
from metronome.fill_model import WHOLE_TOKENS_EPS, FillModel
from metronome.kv_policy import KVPolicy
from metronome.workload import Durations


def cal(num_blocks=2000, prompt=0):
    c = calibration.load("moshi-7b-h200")
    return replace(c, engine=replace(c.engine, num_blocks=num_blocks), stream=replace(c.stream, prompt_tokens=prompt))


def _engine_clock_s(fm, n, tokens):
    """Seconds for N Moshi sessions started together to grow from the prompt to ``tokens`` tokens (continuous):
    one token a frame, each frame one step of N sequences over their N·(tokens so far) context, never shorter
    than the period (past the engine's throughput the sessions fall behind the stream)."""
    P, prompt = fm.calibration.stream.frame_period_s, fm.calibration.stream.prompt_tokens
    k = np.arange(int(math.ceil(tokens - prompt)) + 1)
    frame = np.maximum(P, fm.calibration.step_latency.step_s(n, n * (prompt + k), n))
    starts = np.concatenate([[0.0], np.cumsum(frame)])
    return float(np.interp(tokens, prompt + np.arange(starts.size), starts))


@given(st.integers(1, 400), st.integers(50, 20000), st.integers(0, 300))
def test_t_sat_is_the_linear_law_up_to_one_block(n, blocks, prompt):
    """The first-order law ρ(t) = N·tokens(t)/block_size reaches the pool within one block of t_sat; tokens grow
    at the stream's rate below the engine's throughput (up to ~183 sessions here) and one a frame served past it."""
    fm = FillModel(cal(blocks, prompt), KVPolicy.unbounded(16))
    t = fm.t_sat(n)
    if t is None:  # only when the sessions reach max_model_len first
        assert (blocks // n) * 16 + 1 > fm.max_tokens
        return
    linear = _engine_clock_s(fm, n, max(blocks * 16 / n, prompt))
    n_sat = (blocks // n) * 16 + 1
    slowest = max(fm.calibration.stream.frame_period_s,  # seconds a token, at most (the last frame before t_sat)
                  float(fm.calibration.step_latency.step_s(n, n * max(n_sat, prompt), n)))
    assert abs(t - linear) <= 16 * slowest + 1e-9
    # block-granular: just before t_sat the pool holds them all, at t_sat it does not
    assert fm.occupancy_blocks(t + 1e-9, n) > blocks  # (t_sat itself is a float round-trip of n_sat)
    if t > slowest:
        assert fm.occupancy_blocks(t - slowest, n) <= blocks


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


# -- collapse: how far past the ceiling the survivors push, and for how long ----------------------------
def _phi_by_frames(fm, d, horizon):
    """Reference for silenced_fraction, frame by frame in plain Python (no cells, no vectorisation)."""
    st = fm.calibration.stream
    P = st.frame_period_s
    alive_k = []
    for f in range(int(math.ceil(horizon / P - 1e-9))):
        a = int((d > f * P + 1e-9).sum())  # answered in frame f iff f < ceil(D/P)
        k = fm.usable_blocks // int(fm.policy.resident_blocks(st.prompt_tokens + (f + 1) * st.kv_tokens_per_frame))
        alive_k.append((a, k))
    first = next((f for f, (a, k) in enumerate(alive_k) if a > k), None)
    if first is None:
        return math.nan, 0.0
    after = alive_k[first:]
    return first * P, sum(max(a - k, 0) for a, k in after) / sum(a for a, _ in after)


def test_sessions_that_never_leave_silence_all_but_the_ceiling():
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    n, horizon = 60, 300.0
    t_sat, phi = fm.silenced_fraction(np.full(n, 1e9), horizon)
    # the frame clock puts t_sat one frame before the continuous law's (frame f computes token f+1)
    assert abs(t_sat[0] - fm.t_sat(n)) <= fm.calibration.stream.frame_period_s + 1e-9
    P = fm.calibration.stream.frame_period_s
    f = np.arange(int(round(t_sat[0] / P)), int(round(horizon / P)))
    k = 1500 // fm.policy.resident_blocks((f + 1) * fm.calibration.stream.kv_tokens_per_frame)
    assert phi[0] == pytest.approx(np.maximum(n - k, 0).sum() / (n * f.size), rel=1e-12)
    # none saturate, none silenced, when N fits for the whole horizon
    t, p = fm.silenced_fraction(np.full(n, 1e9), fm.t_sat(n) - 1.0)
    assert np.isnan(t[0]) and p[0] == 0.0


@pytest.mark.parametrize("n,mean,seed", [(60, 80.0, 0), (60, 80.0, 1), (100, 60.0, 2), (30, 200.0, 3)])
def test_silenced_fraction_matches_the_frame_by_frame_reference(n, mean, seed):
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    d = np.random.default_rng(seed).exponential(mean, (6, n))
    t_sat, phi = fm.silenced_fraction(d, 300.0)  # 3750 frames: one frame per cell, so exact
    for row, t, p in zip(d, t_sat, phi):
        t_ref, p_ref = _phi_by_frames(fm, row, 300.0)
        assert (np.isnan(t) and np.isnan(t_ref)) or t == pytest.approx(t_ref)
        assert p == pytest.approx(p_ref, rel=1e-12, abs=1e-15)


def test_coarse_cells_stay_close_to_the_frames():
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    d = np.random.default_rng(5).exponential(400.0, (4, 60))
    t_sat, phi = fm.silenced_fraction(d, 900.0)  # 11,250 frames: cells of 3 frames
    for row, t, p in zip(d, t_sat, phi):
        t_ref, p_ref = _phi_by_frames(fm, row, 900.0)
        assert abs(t - t_ref) <= 3 * fm.calibration.stream.frame_period_s
        assert p == pytest.approx(p_ref, rel=0.01)


def _plain_p_collapse(fm, n, durations, horizon, runs, seed, threshold=0.01):
    """The obvious estimator: the share of duration draws whose silenced fraction reaches the threshold."""
    rng = np.random.default_rng(seed)
    t_sat, phi = fm.silenced_fraction(durations.sample(rng, runs * n).reshape(runs, n), horizon)
    return float((~np.isnan(t_sat) & (phi >= threshold)).mean())


@pytest.mark.parametrize("mean", [70.0, 80.0, 90.0])
def test_collapse_probability_is_the_share_of_draws_that_collapse(mean):
    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    dur = Durations("exponential", mean)
    p = fm.p_collapse_fixed(60, dur, 300.0)
    p_sat = fm.p_saturate_fixed(60, dur, 300.0)
    plain = _plain_p_collapse(fm, 60, dur, 300.0, runs=4000, seed=99)
    # both are Monte Carlo over 4000 draws (independent seeds): 4 standard errors of their difference
    se = math.sqrt(2 * max(p * (1 - p), 0.01) / 4000)
    assert abs(p - plain) < 4 * se, (p, plain)
    # and in this band collapse is well below saturation (the old figure): the gap is what is predicted
    assert p_sat - p > 0.1


def test_collapse_probability_invariants():

    fm = FillModel(cal(1500), KVPolicy.unbounded(16))
    for mean in (10.0, 60.0, 80.0, 120.0, 1e6):
        dur = Durations("exponential", mean)
        p, p_sat = fm.p_collapse_fixed(60, dur, 300.0, runs=1000), fm.p_saturate_fixed(60, dur, 300.0)
        assert 0.0 <= p <= p_sat <= 1.0
        # counting any silence as collapse gives back saturation; a stricter threshold, less collapse
        assert fm.p_collapse_fixed(60, dur, 300.0, silent_fraction=0.0, runs=1000) == pytest.approx(p_sat)
        assert fm.p_collapse_fixed(60, dur, 300.0, silent_fraction=0.05, runs=1000) <= p
    dur = Durations("exponential", 80.0)
    assert fm.p_collapse_fixed(60, dur, 300.0, seed=3) == fm.p_collapse_fixed(60, dur, 300.0, seed=3)
    # fixed durations: no randomness left, the verdict is 0 or 1
    t = fm.t_sat(60)
    assert fm.p_collapse_fixed(60, Durations("fixed", 1e6), 300.0) == 1.0
    assert fm.p_collapse_fixed(60, Durations("fixed", t - 5), 300.0) == 0.0
    # a bounded policy at its memory ceiling never saturates, so never collapses; one more session does
    fb = FillModel(cal(1500), KVPolicy.sinks(16, 16, 368))
    ceiling = fb.memory_ceiling()
    assert fb.p_collapse_fixed(ceiling, Durations("fixed", 1e6), 300.0) == 0.0
    assert fb.p_collapse_fixed(ceiling + 1, Durations("fixed", 1e6), 300.0) == 1.0


def test_poisson_clock_is_its_definition(monkeypatch):
    """The mean-field clock of Poisson arrivals (FillModel._poisson_clock, its cohorts compiled) against its
    definition, written out by brute force on a short grid: at each point the cohorts alive (rate × survival at
    their age × the grid step), each holding the resident tokens of the frames served to it, where a cohort that
    arrived at s has been served min over r in [s, t] of (r − s)/P + V(t) − V(r) frames (one queue per session,
    behind the clock while overloaded) and at most V(t) − s/P (frames served in the order of their ticks: one that
    arrives while the engine is behind the stream's clock waits for it to catch up), and V grows by
    dt / T(alive, mean context). Moshi at 8 sessions/s
    lasting exp(300 s) is overloaded within a minute (about 480 alive against an N* near 260), so the minimum is
    not the trivial one. Tolerance: the compiled sums run in another order than numpy's (1e-9 relative)."""
    monkeypatch.setattr(FillModel, "POISSON_CLOCK_POINTS", 61)
    cal = calibration.load("moshi-7b-h200")
    bs = cal.engine.block_size_tokens
    for policy in (KVPolicy.unbounded(bs), KVPolicy.sinks(bs, 16, 368)):
        fm = FillModel(cal, policy, "independent")
        rate, dur = 8.0, Durations("exponential", 300.0)
        grid, V = fm._poisson_clock(rate, dur, 600.0)
        st = cal.stream
        P, tpf, prompt = st.frame_period_s, st.kv_tokens_per_frame, st.prompt_tokens
        dt = np.diff(grid, prepend=0.0)
        want = np.zeros(grid.size)
        for i in range(1, grid.size):
            t = i - 1
            served = [max(min(min((grid[r] - grid[j]) / P + want[t] - want[r] for r in range(j, t + 1)),
                              want[t] - grid[j] / P), 0.0) for j in range(i)]
            # (a whole number of frames, reached in float arithmetic a hair under, is that number)
            n = np.minimum(np.floor(prompt + tpf * np.array(served) + WHOLE_TOKENS_EPS), fm.max_tokens).astype(np.int64)
            w = rate * dur.survival(grid[t] - grid[:i]) * dt[1:i + 1]
            alive = w.sum()
            T = fm.frame_service_s(int(round(alive)), int(w @ policy.resident_tokens(n) / alive)) if alive >= 1 else 0
            want[i] = want[i - 1] + dt[i] / max(float(T), 1e-12)
        assert want[-1] < grid[-1] / P * 0.9  # overloaded: the engine served fewer frames than the stream's clock
        np.testing.assert_allclose(V, want, rtol=1e-9)
