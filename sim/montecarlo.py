"""Metastability: the same scenario R times with different seeds, collapse statistics beside the fill
model's predicted probability.

The fill model predicts whether the pool **saturates** (runs dry at least once) — the necessary
condition for collapse. A run that saturates only briefly (a preemption or two, under 1% of frames
silenced afterwards) is counted as saturated but not collapsed (see :mod:`metronome.sim.scenario`), so
both observed fractions are reported beside the prediction, each with its gap.

Run k uses seed ``seed + k``; each run is independent of the executor and worker that runs it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pandas as pd

from metronome.errors import MetronomeError

from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor

RUN_COLUMNS = ("seed", "collapsed", "t_sat_observed_s", "silent_frame_fraction", "silent_preempted_fraction",
               "deadline_miss_fraction", "p99_frame_latency_s", "preemptions", "peak_pool_occupancy",
               "sessions_offered", "sessions_admitted", "frames_total")


def run_one(point: dict[str, Any]) -> dict[str, Any]:
    s = scn.run(scn.make_scenario(**point)).summary
    return {k: s[k] for k in RUN_COLUMNS} | {"p_saturate_predicted": s["p_saturate_predicted"]}


def metastability(point: dict[str, Any], runs: int = 20, seed: int = 0, executor=None,
                  progress: Callable[[int], None] | None = None) -> tuple[dict, pd.DataFrame]:
    if runs < 1:
        raise MetronomeError(f"--runs must be >= 1, got {runs}")
    base = scn.make_scenario(**{**point, "seed": seed})  # validates before any work
    t0 = time.perf_counter()
    points = [{**point, "seed": seed + k} for k in range(runs)]
    rows = (executor or LocalExecutor()).map(run_one, points, progress=progress)
    table = pd.DataFrame(rows)
    collapsed = table["collapsed"].to_numpy(dtype=bool)
    t_sat = [None if (v is None or (isinstance(v, float) and np.isnan(v))) else float(v)
             for v in table["t_sat_observed_s"]]
    collapse_times = np.array([t for t, c in zip(t_sat, collapsed) if c and t is not None])
    predicted = rows[0]["p_saturate_predicted"]
    frac = float(collapsed.mean())
    saturated = sum(t is not None for t in t_sat)
    summary = {
        "scenario": {"calibration": base.calibration.name, "policy": base.policy.describe(),
                     "workload": base.arrivals.describe() + (f", durations {base.durations.describe()}"
                                                             if base.durations else ""),
                     "horizon_s": base.horizon_s, "admission": base.admission_label},
        "runs": runs,
        "seeds": [seed, seed + runs - 1],
        "collapsed_runs": int(collapsed.sum()),
        "collapse_fraction": frac,
        "predicted_collapse_probability": predicted,
        "prediction_gap": None if predicted is None else round(frac - predicted, 6),
        "saturated_runs": int(saturated),
        "saturation_fraction": saturated / runs,
        "saturation_prediction_gap": None if predicted is None else round(saturated / runs - predicted, 6),
        "t_sat_observed_s": t_sat,
        "collapse_time_s": None if collapse_times.size == 0 else {
            "min": float(collapse_times.min()), "p10": float(np.quantile(collapse_times, 0.1)),
            "p50": float(np.median(collapse_times)), "p90": float(np.quantile(collapse_times, 0.9)),
            "max": float(collapse_times.max())},
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    return summary, table
