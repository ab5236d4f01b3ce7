"""The fill model past the engine's throughput: a session's KV grows one frame per frame *served*.

The expected figures are worked out by hand from the rules (a frame is one step of ``in + 1`` tokens and
``out − 1`` steps of one; the step model prices each step), never with the functions under test."""

import math
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from metronome import calibration, throughput
from metronome.fill_model import FillModel
from metronome.jitter import mean_ratio
from metronome.kv_policy import KVPolicy
from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor
from metronome.sim.montecarlo import metastability
from metronome.workload import Durations
from fixed_engine import slow_moshi, write_slow_moshi

# the Moshi H200 pool with the step model its preset had before serving stacks (N* 122): its engine falls behind
# the stream's clock past about 180 sessions, which is what these tests are about (the preset's own now keeps up
# with several hundred)
SLOW = str(write_slow_moshi(Path(tempfile.mkdtemp(prefix="slow-moshi-"))))


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
    st = slow_moshi().step_latency
    k = np.arange(tokens)
    return float(np.maximum(0.08, st.step_s(n, n * k, n)).sum())


@pytest.mark.parametrize("n", [256, 512])
def test_t_sat_past_the_throughput_is_the_engine_clock(n):
    fm = FillModel(slow_moshi(), UNBOUNDED)
    n_sat = (12814 // n) * 16 + 1
    assert fm.t_sat(n) == pytest.approx(_moshi_clock_s(n, n_sat), rel=1e-9)
    assert fm.t_sat(n) > 1.4 * n_sat / 12.5  # far slower than the stream's clock


# 256 sessions on a 2,000-block pool: n_sat = 7·16 + 1 = 113 tokens, 12.5 s on the engine's clock (9.0 s on the
# stream's), short enough to simulate in a second
SHORT = dict(calibration=SLOW, sessions=256, kv="unbounded", num_blocks=2000, horizon=20.0)


@pytest.mark.parametrize("phases", ["independent", "aligned"])
def test_t_sat_past_the_throughput_matches_the_simulator(phases):
    """Within 2%: the simulator's sessions join at their phase (up to one period late under independent phases)
    and compute their first token from a one-token prompt, so its clock runs up to a frame or so off the
    model's 113 frames (under 1% each); the stream's clock is 28% early."""
    sc = scn.make_scenario(**SHORT, phases=phases)
    s = scn.run(sc).summary
    pred, obs = s["t_sat_predicted_s"], s["t_sat_observed_s"]
    # the summary's prediction is the engine's clock to 113 tokens, worked out step by step (the pool: 1,999 usable
    # blocks, 7 a session for 256 sessions), to the summary's 4 decimals
    assert sc.calibration.engine.num_blocks == 2000
    assert pred == pytest.approx(_moshi_clock_s(256, 7 * 16 + 1), abs=5e-5)
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
    cal = slow_moshi()
    cal = replace(cal, engine=replace(cal.engine, num_blocks=6000))
    fm = FillModel(cal, UNBOUNDED)
    dur = Durations("exponential", 60.0)
    p = fm.p_saturate_fixed(400, dur, 120.0)
    mc = _mc_p_saturate_overloaded(fm, 400, dur, 120.0, runs=2000)
    assert abs(p - mc) <= 3 * math.sqrt(mc * (1 - mc) / 2000) + 0.02, (p, mc)
    # the engine that keeps up (no per-sequence cost: 400 sessions in 16 ms a step) is the stream's clock
    stream = FillModel(replace(cal, step_latency=replace(cal.step_latency, per_seq_s=0.0)), UNBOUNDED)
    assert stream.p_saturate_fixed(400, dur, 120.0) - p > 0.2


def test_the_forward_pass_over_hundreds_of_sessions_overflows_nothing():
    """720 Qwen3-Omni sessions past the throughput (2x its deadline-bound N*, 360): the pass's binomial thinning
    from up to 720 alive, with survival ratios within 1e-16 of 1. Its impossible outcomes (more alive after a level
    than before) once had their log-probability exponentiated before being thrown away, and overflowed (numpy's
    RuntimeWarning, printed to every user of the report). Any RuntimeWarning fails here."""
    sc = scn.make_scenario("qwen3-omni-30b-a3b-b200", sessions=720)
    fm = FillModel(sc.calibration, sc.policy, "independent")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        p = fm._p_saturate_overloaded(720, Durations("exponential", 230.0), 690.0)  # (not the per-process cache)
    assert 0.5 < p < 0.9


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


def test_silenced_share_past_the_throughput_counts_departures_as_frames_not_silence():
    """512 sessions past the throughput on the small pool, 3 in 4 of them leaving at 28 s (after t_sat, about 10.7
    s): each leaves with the backlog the slow engine owes it, answered silent as it departs (FrontEnd._end). Those
    frames are answered (15% of the frames ticked from t_sat on) but flushed at departure, not silent after a
    preemption: in the share's denominator, not its numerator. The simulator says 0.588, the model 0.563; left
    out of the denominator, the model says 0.665, and counted as silence more still. Within 0.05: the model's
    simplifications (test_silenced_share_past_the_throughput_matches_the_simulator) cost 0.026 here."""
    sc = scn.make_scenario(**{**SHORT, "sessions": 512, "horizon": 40.0, "session_duration": "list:28,28,28,1000"})
    res = scn.run(sc)
    t, fr = res.summary["t_sat_observed_s"], res.frames
    after = fr.tick_s.to_numpy() >= t
    answered = fr.frames.to_numpy()[after].sum()
    assert t < 20 and fr.silent_departed.to_numpy()[after].sum() > 0.08 * answered  # the case the test is about
    share = fr.silent_preempted.to_numpy()[after].sum() / answered
    t_model, phi = FillModel(sc.calibration, sc.policy, sc.phases).silenced_fraction(scn.workload(sc)[1], 40.0)
    assert abs(t_model[0] - t) <= 0.03 * t
    assert abs(phi[0] - share) <= 0.05, (phi[0], share)


# N* on the slow Moshi engine is 122 (the deadline binds: `metronome-sim capacity`); 183 sessions (1.5x) are at the engine's
# throughput (one step of 183 takes 79.7 of the 80 ms period), 305 (2.5x) far past it. On the small pool each run
# is short, and each mean length puts P(saturate) mid-range, where the share of a few runs tells the most.
N_STAR_CELLS = [(122, 60.0), (183, 36.0), (305, 23.0)]
CELL_RUNS = 100


@pytest.mark.parametrize("n, mean_s", N_STAR_CELLS, ids=["1x", "1.5x", "2.5x"])
def test_predicted_p_saturate_and_p_collapse_match_the_simulator_around_n_star(n, mean_s):
    """N sessions started together, exponential lengths, 40 s: the share of 100 simulated runs (seeds 0-99) that
    saturate and that collapse, against the fill model's P(saturate) and P(collapse). Within 2 binomial standard
    errors of 100 runs at the predicted probability (0.07-0.10 here; the agreement issue 45 asks of the model),
    plus 0.01 for the model's own Monte Carlo of P(collapse) (4,000 draws). The seeds are fixed, so the outcome
    is too: measured, every figure is within 1.5 SE. A model for which every saturated run collapses fails at
    each N (2.2, 2.9 and 5.8 SE off)."""
    point = dict(calibration=SLOW, sessions=n, num_blocks=2000, session_duration=f"exp:{mean_s:g}",
                 horizon=40.0)
    s, _ = metastability(point, runs=CELL_RUNS, executor=LocalExecutor(1))
    for obs, pred in ((s["saturated_fraction"], s["predicted_saturation_probability"]),
                      (s["collapse_fraction"], s["predicted_collapse_probability"])):
        assert 0.1 < pred < 0.9  # (mid-range: else the cell tells little)
        assert abs(obs - pred) <= 2 * math.sqrt(pred * (1 - pred) / CELL_RUNS) + 0.01, (n, obs, pred)
