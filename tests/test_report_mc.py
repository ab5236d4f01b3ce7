"""The report's Monte Carlo work: runs that stop once decided end as full runs would, the collapse band's edge
is refined where (and only where) it is uncertain, the grids are in units of N*, and the Wilson interval."""

from __future__ import annotations

from dataclasses import replace

import pytest

from metronome.report.plan import MC_EDGE_RUNS, MC_FRACTIONS, ReportOptions, make_plan, mc_refinement
from metronome.results import collapse_decided, wilson_interval
from metronome.sim import scenario as scn


@pytest.fixture(scope="module")
def cal():
    from metronome import calibration

    c = calibration.load("moshi-7b-h200")
    return replace(c, engine=replace(c.engine, num_blocks=1500))


def _both(cal, **kw):
    sc = scn.make_scenario(calibration=cal, **kw)
    return scn.run(sc).summary, scn.run(sc, stop_when_decided=True).summary


# ---------------------------------------------------------------------------------------- stop when decided
def test_a_collapsing_run_stops_early_with_the_full_runs_outcome(cal):
    full, early = _both(cal, kv="unbounded", sessions=60, session_duration="exp:200", horizon=600.0, seed=3)
    assert full["collapsed"] and early["collapsed"]
    assert early["t_sat_observed_s"] == full["t_sat_observed_s"]
    assert full["stopped_early_s"] is None
    assert early["t_sat_observed_s"] < early["stopped_early_s"] < 600.0
    assert early["frames"] < full["frames"]  # it did stop: the rest was not simulated


def test_a_short_lived_crowd_stops_with_the_full_runs_outcome(cal):
    # unbounded, 80 sessions of 40 s on average in a 2000 s horizon: decided long before it
    full, early = _both(cal, kv="unbounded", sessions=80, session_duration="exp:40", horizon=2000.0, seed=1)
    assert early["stopped_early_s"] is not None and early["stopped_early_s"] < 2000.0
    assert all(early[k] == full[k] for k in ("collapsed", "t_sat_observed_s"))


def test_an_undecided_run_is_the_same_run(cal):
    # the pool runs dry (t_sat 160 s) but too few frames go silent to collapse, and sessions outlive the horizon:
    # nothing decides it before the horizon
    full, early = _both(cal, kv="unbounded", sessions=40, session_duration="exp:150", horizon=450.0, seed=6)
    assert full["t_sat_observed_s"] is not None and not full["collapsed"]
    assert early["stopped_early_s"] is None
    assert {k for k in full if full[k] != early[k]} <= {"wall_s"}


def test_sessions_that_never_hold_their_peaks_together_stop_the_run_at_once(cal):
    # unbounded, 30 sessions of 120 s on average (the longest 1,011 s): their histories at the end of their lives
    # would not fit the pool together (3,251 blocks against 1,500), but they never all live at once: the largest
    # sum still ahead, taken as time goes, is 1,190 blocks from the start
    full, early = _both(cal, kv="unbounded", sessions=30, session_duration="exp:120", horizon=600.0, seed=1)
    assert full["t_sat_observed_s"] is None and not full["collapsed"]
    assert early["stopped_early_s"] is not None and early["stopped_early_s"] <= 600.0 / 100
    assert early["t_sat_observed_s"] is None and not early["collapsed"]


# cells where some seeds collapse and some do not; the last three saturate, go briefly silent past 1% of the
# frames since t_sat and end well below it (0.24%, 0.19%, 0.08%): a stop that forgot the frames still to come
# would call them collapsed
EDGE = [(40, 150, s) for s in range(8)] + [(35, 150, 5), (45, 100, 0), (45, 100, 3)]


@pytest.mark.parametrize("n, d, seed", EDGE)
def test_on_the_band_edge_stopping_never_changes_collapsed(cal, n, d, seed):
    full, early = _both(cal, kv="unbounded", sessions=n, session_duration=f"exp:{d}", horizon=3.0 * d, seed=seed)
    assert early["collapsed"] == full["collapsed"]
    assert early["t_sat_observed_s"] == full["t_sat_observed_s"]


def test_collapse_is_decided_only_when_no_remaining_frame_can_undo_it():
    assert collapse_decided(1, 99, 1)  # 1 / 100 = 1%, even if the last frame is not silent
    assert not collapse_decided(1, 99, 2)  # 1 / 101 < 1%: not yet
    assert not collapse_decided(0, 0, 0)


# ---------------------------------------------------------------------------------------------- intervals
def test_wilson_interval_known_values():
    # Wilson (1927), z = 1.96: 0 of 5 -> [0, 43.4%], 3 of 10 -> [10.8%, 60.3%] (standard tables)
    lo, hi = wilson_interval(0, 5)
    assert lo == 0.0 and hi == pytest.approx(0.4345, abs=1e-4)
    lo, hi = wilson_interval(3, 10)
    assert (lo, hi) == (pytest.approx(0.1078, abs=1e-4), pytest.approx(0.6032, abs=1e-4))
    lo, hi = wilson_interval(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-4)


# ---------------------------------------------------------------------------------------------- the grids
@pytest.fixture(scope="module")
def plan():
    return make_plan("moshi-7b-h200", _load(), ReportOptions(calibrations=("moshi-7b-h200",), mc_runs=5))


def _load():
    from metronome import calibration

    return calibration.load("moshi-7b-h200")


def test_grids_are_in_units_of_the_binding_n(plan):
    assert MC_FRACTIONS == (0.1, 0.25, 0.5, 1.0, 1.5)
    assert plan.sessions_grid(MC_FRACTIONS, 122) == [12, 30, 61, 122, 183]  # N* = 122, not the ceiling of 512


def test_only_the_band_edge_is_refined(plan):
    n_star = 122
    ns, ds = plan.sessions_grid(MC_FRACTIONS, n_star), plan.mc_durations_s(n_star)
    # unbounded: none collapsed up to N=61, all from N=122, except one mixed cell at (d0, 61)
    counts = {}
    for pol in ("unbounded", "bounded"):
        for i, d in enumerate(ds):
            for j, n in enumerate(ns):
                counts[(pol, n, d)] = (5 if (pol == "unbounded" and j >= 3) else 0, 5)
    counts[("unbounded", 61, ds[0])] = (2, 5)
    extra = mc_refinement(plan, n_star, counts)
    cells = {p.key for p in extra}
    # the edge: every cell at N=61 and N=122 borders the other outcome; (d0, 30) borders the mixed cell
    want = {("unbounded", n, d) for n in (61, 122) for d in ds} | {("unbounded", 30, ds[0])}
    assert cells == want
    assert len(extra) == len(want) * (MC_EDGE_RUNS - 5)
    # the runs added are the next seeds of their cell
    seeds = sorted(p.point["seed"] for p in extra if p.key == ("unbounded", 61, ds[0]))
    assert seeds == list(range(5, MC_EDGE_RUNS))
    # once topped up, nothing more is asked for
    done = dict(counts)
    for key in want:
        c, _ = counts[key]
        done[key] = (c * 4, MC_EDGE_RUNS)
    assert mc_refinement(plan, n_star, done) == []


@pytest.mark.parametrize("kv, n, d", [("sinks", 60, "exp:100"), ("unbounded", 15, "exp:60"), ("unbounded", 30, "exp:30")])
def test_a_run_that_can_no_longer_run_dry_stops_with_the_full_runs_outcome(cal, kv, n, d):
    # under the bound's memory ceiling (1500 blocks, 24 each: 62), or unbounded with histories that all fit
    opts = {"sinks": 16, "window": 368} if kv == "sinks" else {}
    full, early = _both(cal, kv=kv, **opts, sessions=n, session_duration=d, horizon=300.0, seed=4)
    assert full["t_sat_observed_s"] is None and not full["collapsed"]
    assert early["stopped_early_s"] is not None and early["stopped_early_s"] < 300.0 / 10
    assert early["t_sat_observed_s"] is None and not early["collapsed"]
