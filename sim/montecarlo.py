"""Metastability: the same scenario R times with different seeds, collapse statistics beside the fill
model's predicted probabilities.

Two figures, two predictions (see :mod:`metronome.fill_model`):

* **saturated** — the pool ran dry at least once (a preemption). ``saturated_fraction`` is the share of
  runs that did; ``predicted_saturation_probability`` is the fill model's exact P(saturate).
* **collapsed** — saturated *and* at least ``COLLAPSE_SILENT_FRACTION`` (1%) of the frames answered from
  then to the horizon were silent after a preemption (:mod:`metronome.results`; not the frames flushed silent
  at departure).
  ``collapse_fraction`` is the share of runs that did; ``predicted_collapse_probability`` is
  :meth:`FillModel.p_collapse_fixed`: P(saturate) times the chance that the sessions past the pool's
  ceiling after ``t_sat`` silence at least that share of the frames.

Both predictions are for N sessions started together with no admission controller; for other
workloads ``predicted_collapse_probability`` is None (the saturation one is the Poisson approximation
for Poisson arrivals, None otherwise).

Run k uses seed ``seed + k``; each run is independent of the executor and worker that runs it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pandas as pd

from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.workload import Durations

from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor

RUN_COLUMNS = ("seed", "collapsed", "t_sat_observed_s", "silent_frame_fraction", "silent_preempted_fraction",
               "silent_waiting_fraction", "silent_departed_fraction", "deadline_miss_fraction",
               "p99_frame_latency_s", "preemptions", "peak_pool_occupancy", "sessions_offered", "sessions_admitted",
               "frames")


def run_one(point: dict[str, Any], stop_when_decided: bool = False) -> dict[str, Any]:
    """One Monte Carlo run's figures. ``stop_when_decided``: stop once collapsed or every session has ended
    (:func:`metronome.sim.scenario.run`): ``collapsed`` and ``t_sat_observed_s`` are the full run's, the other
    figures cover only the time simulated (``stopped_early_s``)."""
    s = scn.run(scn.make_scenario(**point), stop_when_decided=stop_when_decided).summary
    return {k: s[k] for k in RUN_COLUMNS} | {"p_saturate_predicted": s["p_saturate_predicted"],
                                             "stopped_early_s": s["stopped_early_s"]}


def run_decided(point: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_one` stopped once decided (module-level, so a process pool can pickle it)."""
    return run_one(point, stop_when_decided=True)


def predicted_collapse_probability(sc: scn.Scenario) -> float | None:
    """The fill model's P(collapse) for a scenario of N sessions started together (None otherwise)."""
    if sc.arrivals.kind != "all" or sc.admission is not None:
        return None
    fm = FillModel(sc.calibration, sc.policy, sc.phases)
    durations = sc.durations or Durations("fixed", sc.horizon_s * 2)
    return fm.p_collapse_fixed(sc.arrivals.sessions, durations, sc.horizon_s,
                               silent_fraction=scn.COLLAPSE_SILENT_FRACTION)


def _gap(observed: float, predicted: float | None) -> float | None:
    return None if predicted is None else round(observed - predicted, 6)


def metastability(point: dict[str, Any], runs: int = 20, seed: int = 0, executor=None,
                  progress: Callable[[int], None] | None = None, full_runs: bool = False) -> tuple[dict, pd.DataFrame]:
    """``runs`` runs of ``point``, seeds ``seed``.. on; the summary's figures (saturated, collapsed, when) and the
    table, a row per run. Each run stops once its outcome is decided (:func:`run_decided`) unless ``full_runs``:
    the table's other figures (silent frames, latency, frames) then cover the whole horizon, not only the
    ``stopped_early_s`` seconds simulated."""
    if runs < 1:
        raise MetronomeError(f"--runs must be >= 1, got {runs}")
    base = scn.make_scenario(**{**point, "seed": seed})  # validates before any work
    t0 = time.perf_counter()
    points = [{**point, "seed": seed + k} for k in range(runs)]
    rows = (executor or LocalExecutor()).map(run_one if full_runs else run_decided, points, progress=progress)
    table = pd.DataFrame(rows)
    collapsed = table["collapsed"].to_numpy(dtype=bool)
    t_sat = [None if (v is None or (isinstance(v, float) and np.isnan(v))) else float(v)
             for v in table["t_sat_observed_s"]]
    collapse_times = np.array([t for t, c in zip(t_sat, collapsed) if c and t is not None])
    p_sat = rows[0]["p_saturate_predicted"]
    p_col = predicted_collapse_probability(base)
    p_col = None if p_col is None else round(p_col, 6)
    frac = float(collapsed.mean())
    saturated = sum(t is not None for t in t_sat)
    summary = {
        "scenario": {"calibration": base.calibration.name, "policy": base.policy.describe(),
                     "workload": base.arrivals.describe() + (f", durations {base.durations.describe()}"
                                                             if base.durations else ""),
                     "horizon_s": base.horizon_s, "admission": base.admission_label},
        "runs": runs,
        "seeds": [seed, seed + runs - 1],
        "saturated_runs": int(saturated),
        "saturated_fraction": saturated / runs,
        "predicted_saturation_probability": p_sat,
        "saturation_prediction_gap": _gap(saturated / runs, p_sat),
        "collapsed_runs": int(collapsed.sum()),
        "collapse_fraction": frac,
        "predicted_collapse_probability": p_col,
        "collapse_prediction_gap": _gap(frac, p_col),
        "t_sat_observed_s": t_sat,
        "collapse_time_s": None if collapse_times.size == 0 else {
            "min": float(collapse_times.min()), "p10": float(np.quantile(collapse_times, 0.1)),
            "p50": float(np.median(collapse_times)), "p90": float(np.quantile(collapse_times, 0.9)),
            "max": float(collapse_times.max())},
        "stopped_early_runs": int(table["stopped_early_s"].notna().sum()),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    return summary, table
