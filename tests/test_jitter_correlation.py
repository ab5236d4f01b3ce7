"""Step jitter that hangs together in time: the Gaussian-copula draws (``jitter_shared``, ``jitter_tau_s``), their
calibration file form, the simulator's use of them, and the estimator ``metronome-probe calibrate`` fits them with.

A real engine's slow steps come in spells; a controller reading one interval's p99 sees spells, not single steps.
Drawn independently, the simulated AIMD settled +7 % above N* where the live one settled +29 % (docs/live.md).
"""

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome import calibration
from metronome.calibration import StepLatencyModel, from_dict
from metronome.errors import CalibrationError
from metronome.kv_policy import KVPolicy
from metronome.fit import fit_jitter_correlation, jitter_correlation, normal_scores, tick_correlations
from metronome.sim.scenario import Scenario, run
from metronome.workload import Arrivals

JITTER = ((0.0, 0.85), (0.5, 1.0), (0.9, 1.1), (0.99, 1.5), (1.0, 2.0))


def _model(shared=0.5, tau=1.0, frame=0.0):
    return StepLatencyModel(0.001, 0.0, 0.0, 0.0, jitter=JITTER, jitter_shared=shared, jitter_tau_s=tau,
                            jitter_frame=frame)


def test_draws_are_pure_in_seed_step_and_frame():
    d = _model().draws(seed=5, frame_period_s=0.1)
    steps = np.arange(30_000)
    frames = steps // 3
    a = d.ratio(steps, frames)
    # a fresh run asked back to front, or for a late subset first (the shared part is built in fixed chunks
    # from frame 0), gets the same numbers
    e = _model().draws(seed=5, frame_period_s=0.1)
    assert np.array_equal(e.ratio(steps[25_000:], frames[25_000:]), a[25_000:])
    assert np.array_equal(e.ratio(steps[::-1], frames[::-1]), a[::-1])
    assert e.ratio(17, 5)[0] == a[17]
    assert not np.array_equal(a, _model().draws(seed=6, frame_period_s=0.1).ratio(steps, frames))
    # the frame matters: the same step on another frame draws another shared part
    assert d.ratio(17, 5)[0] != d.ratio(17, 500)[0]


def test_the_compiled_normal_cdf_is_the_normal_cdf():
    """jitter_kernel.ndtr (compiled, so the simulator's loop can call it) against the CDF to 40 digits, and
    scipy's own to a few ulps where a step's score lies."""
    import mpmath
    from scipy.special import ndtr as scipy_ndtr

    from metronome.jitter_kernel import ndtr

    mpmath.mp.dps = 40
    ys = np.concatenate([np.linspace(-37.0, 8.0, 4001), np.random.default_rng(0).normal(size=2000) * 3])
    got = np.array([ndtr(y) for y in ys])
    exact = np.array([float(mpmath.ncdf(mpmath.mpf(float(y)))) for y in ys])
    # within a few rounding errors of y·√½ (which far in the lower tail moves the CDF by ~y² ulps)
    tol = np.finfo(float).eps * (4 + ys * ys) * exact
    assert np.all(np.abs(got - exact) <= tol), ys[np.argmax(np.abs(got - exact) / tol)]
    core = np.abs(ys) < 8.3
    assert np.allclose(got[core], scipy_ndtr(ys[core]), rtol=4e-15, atol=0)


def test_the_compiled_interpolation_is_numpys_exactly():
    from metronome.jitter_kernel import interp

    p, r = np.array(JITTER).T
    x = np.concatenate([np.random.default_rng(1).random(20_000), p, np.nextafter(p, -1), np.nextafter(p, 2)])
    assert np.array_equal(np.array([interp(v, p, r) for v in x]), np.interp(x, p, r))


def test_independent_draws_are_unchanged_and_need_no_frame():
    m = StepLatencyModel(0.001, 0.0, 0.0, 0.0, jitter=JITTER)
    idx = np.arange(5000)
    assert np.array_equal(m.draws(3, 0.08).ratio(idx, idx // 2), m.ratio(idx, seed=3))
    assert np.array_equal(m.draws(3, 0.08).ratio(idx, 0), m.draws(3, 2.0).ratio(idx, idx))
    with pytest.raises(ValueError, match="frame"):
        _model().ratio(idx, seed=3)
    assert np.array_equal(StepLatencyModel(0.001, 0.0, 0.0, 0.0, jitter_shared=0.5, jitter_tau_s=1.0)
                          .draws(0, 0.1).ratio(idx, idx), np.ones(5000))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), shared=st.floats(0.0, 0.9), tau=st.floats(0.05, 1.0),
       frame=st.floats(0.0, 0.09))
def test_correlated_draws_keep_the_jitter_distribution(seed, shared, tau, frame):
    """The copula leaves every step's marginal as the calibrated jitter, whatever the correlation."""
    r = _model(shared, tau, frame).draws(seed, 0.1).ratio(np.arange(120_000), np.arange(120_000) // 2)
    assert r.min() >= 0.85 and r.max() <= 2.0
    for p, ratio in JITTER[1:-1]:
        assert abs(float(np.mean(r <= ratio)) - p) < 0.03


@pytest.mark.parametrize("shared,tau,frame", [(0.3, 0.3, 0.0), (0.6, 1.0, 0.0), (0.8, 2.5, 0.0), (0.4, 1.0, 0.2),
                                              (0.0, 1.0, 0.5)])
def test_correlations_are_what_the_parameters_say(shared, tau, frame):
    """Normal scores of the draws: two steps of one frame correlate by ρ + ρ_f, frames k ≥ 1 apart by
    ρ·exp(−k·P/τ)."""
    P, per = 0.1, 2
    n = 200_000
    steps = np.arange(n)
    frames = steps // per
    r = _model(shared, tau, frame).draws(11, P).ratio(steps, frames)
    y = normal_scores(r)
    tc = tick_correlations(np.zeros(n), frames, y, 20)
    want = shared * np.exp(-tc["lags"] * P / tau) + frame * (tc["lags"] == 0)
    # ratios tie at the table's flat ends, so scores lose a little correlation there
    assert np.allclose(tc["corr"], want, atol=0.03 + 0.08 * (shared + frame)), (tc["corr"], want)


@pytest.mark.parametrize("shared,tau,frame", [(0.5, 0.4, 0.0), (0.6, 1.5, 0.0), (0.3, 0.8, 0.0), (0.45, 2.0, 0.15)])
def test_the_estimator_recovers_the_parameters_from_short_paced_runs(shared, tau, frame):
    """Paced runs as calibrate takes them (runs of ~100 ticks, two steps a tick, each run ranked on its own): the
    fit allows for each run's own mean being taken out, so it finds ρ, τ and ρ_f back."""
    P, per, ticks, runs = 0.1, 2, 100, 60
    d = _model(shared, tau, frame).draws(2, P)
    run_id, tick, ys = [], [], []
    for k in range(runs):
        frames = 1_000 * k + np.repeat(np.arange(ticks), per)  # runs far apart: independent
        steps = 10_000 * k + np.arange(ticks * per)
        y = normal_scores(d.ratio(steps, frames))
        run_id.append(np.full(y.size, k)), tick.append(frames), ys.append(y)
    fit = fit_jitter_correlation(np.concatenate(run_id), np.concatenate(tick).astype(float), np.concatenate(ys), P)
    assert fit["shared"] == pytest.approx(shared, abs=0.12)
    assert tau / 1.8 <= fit["tau_s"] <= tau * 1.8
    assert fit["frame"] == pytest.approx(frame, abs=0.1)
    assert len(fit["observed"]) == len(fit["fitted"]) == len(fit["lags"]) and fit["lags"][0] == 0


def test_independent_steps_fit_no_shared_part():
    rng = np.random.default_rng(0)
    runs, ticks = 40, 60
    run_id = np.repeat(np.arange(runs), ticks * 2)
    tick = np.tile(np.repeat(np.arange(ticks), 2), runs).astype(float)
    y = np.concatenate([normal_scores(rng.normal(size=ticks * 2)) for _ in range(runs)])
    fit = fit_jitter_correlation(run_id, tick, y, 0.1)
    assert fit["shared"] <= 0.05 and fit["frame"] <= 0.05
    assert fit_jitter_correlation(run_id[:100], tick[:100], y[:100], 0.1) is None  # too few steps to say


def test_calibration_grid_fits_its_paced_steps():
    grid = pd.DataFrame({"kind": ["paced"] * 300, "phase": ["paced N=4"] * 300, "batch": 4, "new_tokens": 4,
                         "first": False, "step_s": np.linspace(0.01, 0.02, 300), "preemptions": 0,
                         "tick": np.arange(300) // 2})
    fit = jitter_correlation(grid, 0.1)
    assert fit is not None and fit["steps"] == 300
    assert jitter_correlation(grid[:199], 0.1) is None  # too few steps to say


# ------------------------------------------------------------------------------------------ file form
def test_file_round_trip_and_files_without_it_unchanged():
    c = calibration.load("moshi-7b-h200")
    sl = replace(c.step_latency, jitter=JITTER)
    plain = json.loads(replace(c, step_latency=sl).to_json())["step_latency"]
    assert "jitter_correlation" not in plain and "jitter_shared" not in plain
    d = json.loads(replace(c, step_latency=replace(sl, jitter_shared=0.55, jitter_tau_s=1.25)).to_json())
    assert d["step_latency"]["jitter_correlation"] == {"shared": 0.55, "tau_s": 1.25}
    back = from_dict(d).step_latency
    assert (back.jitter_shared, back.jitter_tau_s, back.jitter_frame) == (0.55, 1.25, 0.0)
    spells = replace(sl, jitter_shared=0.4, jitter_tau_s=2.0, jitter_frame=0.2)
    d = json.loads(replace(c, step_latency=spells).to_json())
    assert d["step_latency"]["jitter_correlation"] == {"shared": 0.4, "tau_s": 2.0, "frame": 0.2}
    assert from_dict(d).step_latency.jitter_frame == 0.2


@pytest.mark.parametrize("corr,field,why", [
    ({"shared": 1.0, "tau_s": 1.0}, "jitter_correlation.shared", "[0, 1)"),
    ({"shared": -0.1, "tau_s": 1.0}, "jitter_correlation.shared", ">= 0"),
    ({"shared": 0.5, "tau_s": 0}, "jitter_correlation.tau_s", "> 0"),
    ({"shared": 0.5}, "jitter_correlation.tau_s", "missing"),
    ({"shared": 0.6, "tau_s": 1.0, "frame": 0.4}, "jitter_correlation.frame", "shared + frame must be < 1"),
    ({"shared": 0.6, "tau_s": 1.0, "frame": -0.1}, "jitter_correlation.frame", ">= 0"),
    ({"shared": "x", "tau_s": 1.0}, "jitter_correlation.shared", ""),
    ([0.5, 1.0], "jitter_correlation", "object"),
])
def test_bad_correlation_is_one_line_naming_the_field(corr, field, why):
    d = json.loads(calibration.load("moshi-7b-h200").to_json())
    d["step_latency"]["jitter"] = [list(p) for p in JITTER]
    d["step_latency"]["jitter_correlation"] = corr
    with pytest.raises(CalibrationError) as e:
        from_dict(d, "x.json")
    msg = str(e.value)
    assert f"step_latency.{field}" in msg and why in msg and "\n" not in msg


def test_correlation_without_a_jitter_table_is_refused():
    d = json.loads(calibration.load("moshi-7b-h200").to_json())
    d["step_latency"]["jitter_correlation"] = {"shared": 0.5, "tau_s": 1.0}
    with pytest.raises(CalibrationError, match=r"step_latency.jitter_correlation'.*needs the jitter"):
        from_dict(d, "x.json")


# ------------------------------------------------------------------------------------------ simulator
# (the fast-forward's exactness with spells: tests/test_step_jitter.py)
def _correlated(c, shared=0.6, tau=1.0, frame=0.1):
    return replace(c, step_latency=replace(c.step_latency, frame_first_s=0.001, jitter=JITTER,
                                           jitter_shared=shared, jitter_tau_s=tau, jitter_frame=frame))


def test_spells_keep_the_median_frame_latency_but_make_slow_frames_come_in_runs():
    """Same jitter table, same load (one step a frame, in lockstep): with spells one frame's latency predicts the
    next's."""
    c = calibration.load("moshi-7b-h200")
    sc = Scenario(_correlated(c, shared=0.0), KVPolicy.sinks(16, 16, 256), Arrivals("all", sessions=50), 120.0,
                  seed=1, phases="aligned")
    lat = []
    for cal in (_correlated(c, shared=0.0, frame=0.0), _correlated(c, shared=0.8, tau=2.0, frame=0.0)):
        f = run(replace(sc, calibration=cal)).frames
        lat.append(f.latency_s[f.tick_s >= 10].to_numpy())
    assert np.median(lat[1]) == pytest.approx(np.median(lat[0]), rel=0.05)
    lag1 = [float(np.corrcoef(x[:-1], x[1:])[0, 1]) for x in lat]
    lag10 = [float(np.corrcoef(x[:-10], x[10:])[0, 1]) for x in lat]
    assert abs(lag1[0]) < 0.1 and abs(lag10[0]) < 0.1  # independent draws: no memory
    # 0.8·exp(-0.08/2) ≈ 0.77 and 0.8·exp(-0.8/2) ≈ 0.54 in scores; a little less on the latencies themselves
    assert lag1[1] > 0.5 and lag10[1] > 0.2


def test_spells_longer_than_the_runs_resolve_are_capped():
    """τ is at most a quarter of the median run: longer spells cannot be told from a run's own mean."""
    P, per, ticks, runs = 0.1, 2, 100, 40
    d = _model(0.6, 6.0).draws(4, P)
    run_id, tick, ys = [], [], []
    for k in range(runs):
        frames = 1_000 * k + np.repeat(np.arange(ticks), per)
        y = normal_scores(d.ratio(10_000 * k + np.arange(ticks * per), frames))
        run_id.append(np.full(y.size, k)), tick.append(frames), ys.append(y)
    fit = fit_jitter_correlation(np.concatenate(run_id), np.concatenate(tick).astype(float), np.concatenate(ys), P)
    assert fit["tau_s"] <= ticks * P / 4 + 1e-9
    assert fit["shared"] + fit["frame"] <= 0.95
