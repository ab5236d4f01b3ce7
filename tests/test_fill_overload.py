"""The fill model past the engine's throughput: a session's KV grows one frame per frame *served*.

The expected figures are worked out by hand from the rules (a frame is one step of ``in + 1`` tokens and
``out − 1`` steps of one; the step model prices each step), never with the functions under test."""

import math
from dataclasses import replace

import numpy as np
import pytest

from metronome import calibration, throughput
from metronome.fill_model import FillModel
from metronome.jitter import mean_ratio
from metronome.kv_policy import KVPolicy
from metronome.sim import scenario as scn
from metronome.workload import Durations


def hand_cal(budget=8192, jitter=()):
    """P = 0.1 s, 2 input and 3 output tokens a frame (5 KV tokens); a step costs 10 ms + 1 ms a sequence + 1 µs
    a context token + 0.1 ms a computed token."""
    c = calibration.load("moshi-7b-h200")
    step = calibration.StepLatencyModel(base_s=0.01, per_seq_s=0.001, per_context_token_s=1e-6,
                                        per_new_token_s=1e-4, jitter=jitter)
    return replace(c, stream=calibration.TokenStream(0.1, 2, 3, 0), step_latency=step,
                   engine=replace(c.engine, max_num_batched_tokens=budget))


UNBOUNDED = KVPolicy.unbounded(16)


def test_frame_service_by_hand():
    cal = hand_cal()
    # 100 sessions at 1000 computed tokens. Aligned, the three sub-steps of every session go together:
    #   j=0: 100 seqs, 100·1000 context, 100·3 new: 0.01 + 0.1 + 0.1    + 0.03 = 0.2400
    #   j=1: 100 seqs, 100·1003 context, 100 new:   0.01 + 0.1 + 0.1003 + 0.01 = 0.2203
    #   j=2: 100 seqs, 100·1004 context, 100 new:   0.01 + 0.1 + 0.1004 + 0.01 = 0.2204
    aligned = 0.2400 + 0.2203 + 0.2204
    # independent: three steps, each with a third of the sessions at each sub-step
    #   100 seqs, 100·(1000+1003+1004)/3 context, 100·5/3 new: 0.01 + 0.1 + 0.1002333.. + 0.0166666..
    independent = 3 * (0.01 + 0.1 + 1e-6 * 100 * 3007 / 3 + 1e-4 * 500 / 3)
    assert throughput.frame_service_s(cal, UNBOUNDED, "aligned", 100, 1000) == pytest.approx(aligned, rel=1e-12)
    assert throughput.frame_service_s(cal, UNBOUNDED, "independent", 100, 1000) == pytest.approx(independent,
                                                                                                 rel=1e-12)
    # past the period the session's KV grows 5 tokens a frame served
    assert throughput.kv_tokens_per_s(cal, UNBOUNDED, "aligned", 100, 1000) == pytest.approx(5 / aligned)
    # a token budget of 256 splits the aligned chunk step (300 tokens) in two: one more step's fixed costs
    # (10 ms); the independent mix computes 167 tokens a step and is not split
    small = hand_cal(budget=256)
    assert throughput.frame_service_s(small, UNBOUNDED, "aligned", 100, 1000) == pytest.approx(aligned + 0.01)
    assert throughput.frame_service_s(small, UNBOUNDED, "independent", 100, 1000) == pytest.approx(independent)
    # a window of 64 tokens: the steps attend over the resident tokens (72, 75, 76 at 1000, 1003, 1004:
    # 1000 − 58·16 with the window's first block floor((n − 63)/16) = 58), not the history
    windowed = (0.01 + 0.1 + 1e-6 * 7200 + 0.03) + (0.02 + 0.1 + 1e-6 * 7500) + (0.02 + 0.1 + 1e-6 * 7600)
    assert throughput.frame_service_s(cal, KVPolicy.window(16, 64), "aligned", 100, 1000) == pytest.approx(windowed)


def test_jitter_costs_its_mean():
    # quantile points (0, 0.5), (0.5, 1), (1, 2): mean 0.5·0.75 + 0.5·1.5 = 1.125
    cal = hand_cal(jitter=((0.0, 0.5), (0.5, 1.0), (1.0, 2.0)))
    assert mean_ratio(cal.step_latency) == pytest.approx(1.125)
    plain = throughput.frame_service_s(hand_cal(), UNBOUNDED, "independent", 100, 1000)
    assert throughput.frame_service_s(cal, UNBOUNDED, "independent", 100, 1000) == pytest.approx(1.125 * plain)
    # and the draws the simulator takes have that mean
    u = cal.step_latency.ratio(np.arange(200_000), seed=1)
    assert u.mean() == pytest.approx(1.125, abs=0.005)


def test_below_the_throughput_the_stream_rate_holds():
    cal = hand_cal()
    # 10 sessions from 0 tokens: 0.023 + 0.02103 + 0.02104 s a frame, well inside the 0.1 s period
    for phases in ("aligned", "independent"):
        assert throughput.kv_tokens_per_s(cal, UNBOUNDED, phases, 10, 0) == cal.stream.kv_tokens_per_s
    # so the fill model is the stream's linear law there: N = 100 Moshi sessions on the full H200 pool
    fm = FillModel(calibration.load("moshi-7b-h200"), UNBOUNDED)
    n_sat = (12814 // 100) * 16 + 1
    assert fm.t_sat(100) == pytest.approx(n_sat / 12.5, rel=1e-12)


def _moshi_clock_s(n, tokens):
    """Seconds for N Moshi sessions (one token a frame, one step a frame) to compute ``tokens`` tokens each:
    every frame is one step of N sequences over N·k context tokens, never shorter than the period."""
    st = calibration.load("moshi-7b-h200").step_latency
    k = np.arange(tokens)
    return float(np.maximum(0.08, st.step_s(n, n * k, n)).sum())


@pytest.mark.parametrize("n", [256, 512])
def test_t_sat_past_the_throughput_is_the_engine_clock(n):
    fm = FillModel(calibration.load("moshi-7b-h200"), UNBOUNDED)
    n_sat = (12814 // n) * 16 + 1
    assert fm.t_sat(n) == pytest.approx(_moshi_clock_s(n, n_sat), rel=1e-9)
    assert fm.t_sat(n) > 1.4 * n_sat / 12.5  # far slower than the stream's clock


# 256 sessions on a 2,000-block pool: n_sat = 7·16 + 1 = 113 tokens, 12.5 s on the engine's clock (9.0 s on the
# stream's), short enough to simulate in a second
SHORT = dict(calibration="moshi-7b-h200", sessions=256, kv="unbounded", num_blocks=2000, horizon=20.0)


@pytest.mark.parametrize("phases", ["independent", "aligned"])
def test_t_sat_past_the_throughput_matches_the_simulator(phases):
    """Within 2%: the simulator's sessions join at their phase (up to one period late under independent phases)
    and compute their first token from a one-token prompt, so its clock runs up to a frame or so off the
    model's 113 frames (under 1% each); the stream's clock is 28% early."""
    sc = scn.make_scenario(**SHORT, phases=phases)
    s = scn.run(sc).summary
    pred, obs = s["t_sat_predicted_s"], s["t_sat_observed_s"]
    assert pred == pytest.approx(FillModel(sc.calibration, sc.policy, phases).t_sat(256), abs=1e-4)  # 4 digits
    assert abs(pred - obs) <= 0.02 * obs, (pred, obs)


def _mc_p_saturate_overloaded(fm, n, durations, horizon, runs=3000, seed=3):
    """Monte Carlo of the clock rules, frame by frame and run by run: frame k starts at max(k·P, the last frame's
    start + its service with the run's sessions alive then), computing token k + 1 (Moshi: one a frame); the run
    saturates at the first frame with alive·blocks(k + 1) > B."""
    st = fm.calibration.step_latency
    rng = np.random.default_rng(seed)
    d = durations.sample(rng, runs * n).reshape(runs, n)
    s = np.zeros(runs)
    sat = np.zeros(runs, dtype=bool)
    live = np.ones(runs, dtype=bool)
    k = 0
    while live.any():
        a = (d > s[:, None]).sum(axis=1)
        sat |= live & (a * ((k + 1 + 15) // 16) > fm.usable_blocks)
        serve = st.step_s(a, a * k, a)
        k += 1
        s = np.maximum(k * 0.08, s + serve)
        live &= ~sat & (s < horizon)
    return sat.mean()


def test_p_saturate_past_the_throughput_follows_each_runs_clock():
    """The forward pass over (alive, mean time) against the frame-by-frame Monte Carlo of the same rules: within
    3 standard errors of 2,000 runs plus 0.02 for what the pass leaves out (the spread of times within a
    state, the alive count inside one block level). 400 sessions, exponential lengths (mean 60 s), a 6,000-block
    pool: on the stream's clock the pool would run dry in nearly every run (P = 0.999)."""
    cal = calibration.load("moshi-7b-h200")
    cal = replace(cal, engine=replace(cal.engine, num_blocks=6000))
    fm = FillModel(cal, UNBOUNDED)
    dur = Durations("exponential", 60.0)
    p = fm.p_saturate_fixed(400, dur, 120.0)
    mc = _mc_p_saturate_overloaded(fm, 400, dur, 120.0, runs=2000)
    assert abs(p - mc) <= 3 * math.sqrt(mc * (1 - mc) / 2000) + 0.02, (p, mc)
    # the engine that keeps up (no per-sequence cost: 400 sessions in 16 ms a step) is the stream's clock
    stream = FillModel(replace(cal, step_latency=replace(cal.step_latency, per_seq_s=0.0)), UNBOUNDED)
    assert stream.p_saturate_fixed(400, dur, 120.0) - p > 0.2


def test_silenced_share_past_the_throughput_matches_the_simulator():
    """256 sessions that never leave, past the throughput (SHORT, 30 s): the share of frames ticked from t_sat on
    that are silent. Running sessions answer frames of old ticks (their backlog) and each one the pool pushes
    out answers its whole backlog silent, so the share is not the (N − K)/N of sessions silenced. Within 0.03:
    the model keeps every session at the common token count (a readmitted one comes back with its old history)
    and steps whole frames; measured 0.519 against 0.516."""
    sc = scn.make_scenario(**{**SHORT, "horizon": 30.0})
    res = scn.run(sc)
    t = res.summary["t_sat_observed_s"]
    fr = res.frames
    after = fr.tick_s.to_numpy() >= t
    share = fr.silent_preempted.to_numpy()[after].sum() / fr.frames.to_numpy()[after].sum()
    fm = FillModel(sc.calibration, sc.policy, sc.phases)
    t_model, phi = fm.silenced_fraction(scn.workload(sc)[1], 30.0)
    assert abs(t_model[0] - t) <= 0.02 * t
    assert abs(phi[0] - share) <= 0.03, (phi[0], share)
