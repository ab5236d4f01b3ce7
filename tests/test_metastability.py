"""Collapse is metastable: identical scenarios collapse in some runs and not others; the bound in none.

The fill model predicts the two figures the Monte Carlo counts: P(saturate) (the pool runs dry at least
once) and P(collapse) (it runs dry and then at least 1% of the frames are silenced). Each is checked
against the simulator run by run (same seeds, same durations) and as a probability, with tolerances
that say what they allow: the binomial standard error of the simulated fraction at the runs used, plus
the model's own stated error.
"""

import json
import math

import numpy as np
import pandas as pd
import pytest

from sim_cli_helpers import run_cli
from metronome.fill_model import FillModel
from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor, RayExecutor, make_executor
from metronome.sim.montecarlo import metastability, run_one
from metronome.errors import MetronomeError

# the fill races session length: 60 sessions, exponential lengths (mean 80 s), a 1,500-block pool. In lockstep
# (aligned phases) the fill model's saturation tick is exact, run by run; test_phases_are_seeded_... in
# test_sim_scenarios covers independent phases (t_sat within 2%)
RACE = dict(calibration="moshi-7b-h200", sessions=60, session_duration="exp:80", horizon=300.0, num_blocks=1500,
            phases="aligned")
RACE_RUNS = 20

# The metastable band, in a scenario cheap enough for a few hundred runs: 100 sessions, an 800-block pool
# (t_sat = 10 s if nobody left), 100 s. The mean lengths put the predicted P(collapse) at ~0.10, 0.27, 0.52
# and 0.80 (P(saturate) 0.24, 0.49, 0.73, 0.93).
BAND = dict(calibration="moshi-7b-h200", sessions=100, horizon=100.0, num_blocks=800, phases="aligned")
BAND_MEANS_S = (23.0, 25.0, 27.0, 30.0)
BAND_RUNS = 60
# The collapse model's own error, in probability: its silenced fraction φ runs 4–9% (relative) above the
# simulator's (a preempted session's history does not grow while it is silent, so it comes back holding
# fewer blocks and the engine fits a little more than the ceiling); moving the 1% threshold by 10% moves
# P(collapse) by at most 0.02 across these bands, and the model's internal Monte Carlo (4000 duration
# draws) adds a standard error under 0.01.
COLLAPSE_MODEL_ERROR = 0.03


def _se(p: float, runs: int) -> float:
    """Binomial standard error of a fraction over ``runs`` runs whose true probability is ``p``."""
    return math.sqrt(p * (1 - p) / runs)


def _model_runs(point: dict, seeds) -> tuple[np.ndarray, np.ndarray]:
    """The fill model's (t_sat, silenced fraction) for the very durations each seeded run draws."""
    sc = scn.make_scenario(**{**point, "seed": 0})
    fm = FillModel(sc.calibration, sc.policy)
    d = np.stack([scn.workload(sc.with_seed(int(k)))[1] for k in seeds])
    return fm.silenced_fraction(d, sc.horizon_s)


@pytest.fixture(scope="module")
def unbounded():
    return metastability(RACE, runs=RACE_RUNS, seed=0, executor=LocalExecutor(2))


@pytest.fixture(scope="module")
def band():
    return {m: metastability({**BAND, "session_duration": f"exp:{m:g}"}, runs=BAND_RUNS, seed=0,
                             executor=LocalExecutor(2)) for m in BAND_MEANS_S}


def test_unbounded_collapses_in_some_runs_but_not_all(unbounded):
    s, table = unbounded
    assert 0 < s["collapsed_runs"] < s["runs"] == RACE_RUNS
    assert len(table) == RACE_RUNS and list(table.seed) == list(range(RACE_RUNS))
    assert s["collapse_fraction"] == table.collapsed.mean()
    assert s["collapsed_runs"] <= s["saturated_runs"]  # collapse needs saturation first
    # the collapse times are spread: a race, not a fixed deadline
    ct = s["collapse_time_s"]
    assert ct["max"] > ct["min"]
    assert s["t_sat_observed_s"] == [None if pd.isna(v) else v for v in table.t_sat_observed_s]


def _check_saturation_run_by_run(point, table):
    t_model, _ = _model_runs(point, table.seed)
    t_sim = table.t_sat_observed_s.to_numpy(dtype=float)
    # the same durations saturate the pool in the model iff they do in the simulator...
    assert list(np.isnan(t_model)) == list(np.isnan(t_sim))
    # ...at the same frame: the preempting step starts at the tick of the frame that overflows (a step of
    # 100 sessions takes well under a frame period, so none starts late)
    both = ~np.isnan(t_sim)
    assert np.abs(t_sim[both] - t_model[both]).max(initial=0.0) < 1e-6


def test_saturation_is_predicted_run_by_run(unbounded, band):
    s, table = unbounded
    _check_saturation_run_by_run(RACE, table)
    for m, (_, table) in band.items():
        _check_saturation_run_by_run({**BAND, "session_duration": f"exp:{m:g}"}, table)
    # so the saturated fraction is the exact P(saturate) up to the binomial error of the runs (3 SE)
    for s, runs in [(s, RACE_RUNS)] + [(b[0], BAND_RUNS) for b in band.values()]:
        p = s["predicted_saturation_probability"]
        assert abs(s["saturated_fraction"] - p) <= 3 * _se(p, runs), s


def test_collapse_is_predicted_across_the_metastable_band(band):
    pred, sim, sat = [], [], []
    for m, (s, _) in band.items():
        p = s["predicted_collapse_probability"]
        assert 0.05 < p < 0.95, (m, p)  # every point is inside the band, not a near-certain 0 or 1
        pred.append(p)
        sim.append(s["collapse_fraction"])
        sat.append(s["predicted_saturation_probability"])
        # one point: 3 binomial standard errors of the runs, plus the model's stated error
        assert abs(s["collapse_fraction"] - p) <= 3 * _se(p, BAND_RUNS) + COLLAPSE_MODEL_ERROR, (m, p, s)
    pred, sim = np.array(pred), np.array(sim)
    # all points together: the mean gap within 3 standard errors of a mean of 4 fractions, plus the model
    # error (it has one sign, the model's φ is high, so it does not shrink by averaging)
    tol = 3 * math.sqrt(sum(_se(p, BAND_RUNS) ** 2 for p in pred)) / len(pred) + COLLAPSE_MODEL_ERROR
    assert abs((sim - pred).mean()) <= tol, (sim, pred, tol)
    # the prediction is about collapse, not saturation: here the two differ by more than the tolerance
    assert (np.array(sat) - pred).mean() > tol


def test_collapse_is_predicted_run_by_run(band):
    """Each run's verdict from its own durations: φ ≥ 1% in the model iff the simulator called it collapsed.

    Runs whose silenced fraction lies within the model's few-percent bias of the threshold can disagree;
    that was about one run in 100 over 1,800 runs of the band scenarios measured, so at least 95% must
    agree."""
    agree = total = 0
    for m, (_, table) in band.items():
        t_model, phi = _model_runs({**BAND, "session_duration": f"exp:{m:g}"}, table.seed)
        verdict = ~np.isnan(t_model) & (phi >= scn.COLLAPSE_SILENT_FRACTION)
        agree += int((verdict == table.collapsed.to_numpy(dtype=bool)).sum())
        total += len(table)
    assert agree >= 0.95 * total, (agree, total)


# 60 sessions that stay the whole run on a 1,500-block pool: unbounded, the pool runs dry at 27 s and the
# sessions past its ceiling stay silent to the end
LONG = dict(calibration="moshi-7b-h200", sessions=60, horizon=90.0, num_blocks=1500)
# sinks S=16, W=368 hold at most 25 blocks a session: 60 x 25 = 1,500, exactly the pool
BOUND = dict(kv="sinks", sinks=16, window=368)


def test_the_bound_is_what_prevents_collapse():
    s, _ = metastability(LONG, runs=3, executor=LocalExecutor(2))
    assert s["predicted_collapse_probability"] == 1.0
    assert s["collapsed_runs"] == 3  # without the bound this load collapses
    s, _ = metastability({**LONG, **BOUND}, runs=4, executor=LocalExecutor(2))
    # with it, never: the memory ceiling is a hard bound, so these are exact zeros, not tolerances
    assert s["saturated_runs"] == 0 and s["collapsed_runs"] == 0
    assert s["predicted_saturation_probability"] == 0.0 and s["predicted_collapse_probability"] == 0.0
    sc = scn.make_scenario(**{**LONG, **BOUND})
    assert FillModel(sc.calibration, sc.policy).memory_ceiling() == LONG["sessions"]
    # and the bound has no slack: a window one block longer (26 blocks a session, 57 fit) or one session
    # more (1 of 61 silent) saturates the pool and silences more than 1% of the frames
    for extra in (dict(window=384), dict(sessions=61)):
        s, _ = metastability({**LONG, **BOUND, **extra, "horizon": 60.0}, runs=1)
        assert s["saturated_runs"] == 1 and s["collapsed_runs"] == 1, extra
        assert s["predicted_collapse_probability"] == 1.0, extra


def test_results_do_not_depend_on_the_executor(unbounded):
    pts = [{**RACE, "seed": k} for k in range(4)]
    serial = LocalExecutor(1).map(run_one, pts)
    assert LocalExecutor(2).map(run_one, pts) == serial
    t = unbounded[1].head(4).reset_index(drop=True)
    assert [bool(x) for x in t.collapsed] == [r["collapsed"] for r in serial]


def test_runs_stop_once_decided_with_the_full_runs_outcome(unbounded):
    # `unbounded` ran with the default (each run stops once decided); the same seeds to the horizon must
    # saturate and collapse in the very same runs, at the same times
    s, early = unbounded
    full_s, full = metastability(RACE, runs=RACE_RUNS, seed=0, executor=LocalExecutor(2), full_runs=True)
    assert s["stopped_early_runs"] > 0 and full_s["stopped_early_runs"] == 0
    assert early.stopped_early_s.notna().sum() == s["stopped_early_runs"] and full.stopped_early_s.isna().all()
    assert list(early.collapsed) == list(full.collapsed)
    assert s["t_sat_observed_s"] == full_s["t_sat_observed_s"]
    for k in ("saturated_runs", "collapsed_runs", "collapse_time_s"):
        assert s[k] == full_s[k]
    stopped = early.stopped_early_s.notna().to_numpy()
    assert (early.frames[stopped] < full.frames[stopped]).all()  # they did stop: the rest was not simulated


def test_ray_gives_the_same_results_as_the_process_pool():
    pytest.importorskip("ray")
    pts = [{**RACE, "seed": k} for k in range(3)]
    try:
        assert RayExecutor(workers=2).map(run_one, pts) == LocalExecutor(1).map(run_one, pts)
    finally:
        import ray

        ray.shutdown()


def test_unreachable_ray_address_fails_before_any_work(tmp_path):
    pytest.importorskip("ray")
    with pytest.raises(MetronomeError, match="unreachable"):
        make_executor("ray", None, "127.0.0.1:9")
    r = run_cli("metastability", "--sessions", "10", "--horizon", "10", "--runs", "2", "--executor", "ray",
                "--ray-address", "127.0.0.1:9", "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "unreachable" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "m").exists()


def test_cli_writes_summary_and_runs(tmp_path):
    out = tmp_path / "meta"
    r = run_cli("metastability", "--calibration", "moshi-7b-h200", "--sessions", "60", "--session-duration",
                "exp:80", "--horizon", "300", "--num-blocks", "1500", "--runs", "6", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "collapsed" in r.stdout and "P(saturate)" in r.stdout and "P(collapse)" in r.stdout
    s = json.loads((out / "summary.json").read_text())
    for k in ("runs", "collapsed_runs", "collapse_fraction", "predicted_collapse_probability", "saturated_runs",
              "saturated_fraction", "predicted_saturation_probability", "t_sat_observed_s"):
        assert k in s
    assert s["predicted_collapse_probability"] <= s["predicted_saturation_probability"]
    assert s["runs"] == 6 and len(s["t_sat_observed_s"]) == 6
    runs = pd.read_parquet(out / "runs.parquet")
    assert len(runs) == 6 and s["stopped_early_runs"] == runs.stopped_early_s.notna().sum() > 0
    assert "stopped once decided" in r.stdout
    full = run_cli("metastability", "--calibration", "moshi-7b-h200", "--sessions", "60", "--session-duration",
                   "exp:80", "--horizon", "300", "--num-blocks", "1500", "--runs", "6", "--full-runs")
    assert full.returncode == 0, full.stderr
    assert "stopped once decided" not in full.stdout
    assert f"collapsed {s['collapsed_runs']} of 6" in full.stdout


@pytest.mark.parametrize("args,needle", [
    (["--runs", "0"], "--runs must be >= 1"),
    (["--runs", "2", "--ray-address", "127.0.0.1:9"], "--ray-address needs --executor ray"),
])
def test_bad_metastability_input(tmp_path, args, needle):
    r = run_cli("metastability", "--sessions", "10", "--horizon", "10", *args, "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "m").exists()
