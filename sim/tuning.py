"""Offline AIMD tuning: search the controller's parameters on a scenario.

Objective: the most **goodput** (frames delivered non-silent and on time, per second), averaged over
seeds, subject to a deadline-miss budget in every seed and **zero collapse** in every seed. Every
candidate is scored the same way, so the trade-off table shows what each constraint costs.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import pandas as pd

from metronome.admission import AIMDParams
from metronome.errors import MetronomeError

from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor

DEFAULT_GRID = {
    "additive_increase": [1.0, 4.0],
    "decrease_factor": [0.5, 0.75, 0.9],
    "target_fraction": [0.7, 0.8, 0.9],
    "interval_s": [0.5, 1.0],
}


def _run(task: tuple[dict, dict, int]) -> dict:
    point, params, seed = task
    s = scn.run(scn.make_scenario(**{**point, "seed": seed, "admission": "aimd", "aimd_params": params})).summary
    return {"seed": seed, **{k: s[k] for k in ("goodput_frames_per_s", "goodput_sessions", "deadline_miss_fraction",
                                               "silent_frame_fraction", "collapsed", "p99_frame_latency_s",
                                               "sessions_admitted", "sessions_refused")}}


def tune_aimd(point: dict[str, Any], grid: dict[str, list] | None = None, seeds: int = 2, seed: int = 0,
              miss_budget: float = 0.01, base_params: dict | None = None, executor=None,
              progress: Callable[[int], None] | None = None) -> tuple[dict, pd.DataFrame]:
    grid = {**DEFAULT_GRID, **(grid or {})}
    if seeds < 1:
        raise MetronomeError(f"--seeds must be >= 1, got {seeds}")
    if not 0 <= miss_budget <= 1:
        raise MetronomeError(f"--miss-budget must be in [0, 1], got {miss_budget}")
    keys = list(grid)
    candidates = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        params = {**(base_params or {}), **dict(zip(keys, combo))}
        AIMDParams.from_dict(params)  # one-line error for a bad grid value, before any work
        candidates.append(params)
    scn.make_scenario(**{**point, "admission": "aimd", "aimd_params": candidates[0]})  # validate the scenario
    tasks = [(point, p, seed + k) for p in candidates for k in range(seeds)]
    t0 = time.perf_counter()
    results = (executor or LocalExecutor()).map(_run, tasks, progress=progress)
    rows = []
    for i, params in enumerate(candidates):
        rs = results[i * seeds:(i + 1) * seeds]
        feasible = all(not r["collapsed"] and r["deadline_miss_fraction"] <= miss_budget for r in rs)
        rows.append({**params,
                     "goodput_frames_per_s": sum(r["goodput_frames_per_s"] for r in rs) / seeds,
                     "goodput_sessions": sum(r["goodput_sessions"] for r in rs) / seeds,
                     "worst_deadline_miss_fraction": max(r["deadline_miss_fraction"] for r in rs),
                     "worst_silent_frame_fraction": max(r["silent_frame_fraction"] for r in rs),
                     "collapsed_seeds": sum(bool(r["collapsed"]) for r in rs),
                     "worst_p99_frame_latency_s": max((r["p99_frame_latency_s"] or 0.0) for r in rs),
                     "feasible": feasible})
    table = pd.DataFrame(rows).sort_values(["feasible", "goodput_frames_per_s"], ascending=[False, False])
    table = table.reset_index(drop=True)
    best_row = table.iloc[0]
    if not bool(best_row["feasible"]):
        raise MetronomeError("no AIMD setting met the deadline-miss budget without collapse on every seed "
                             "(widen the grid or relax --miss-budget)")
    best = AIMDParams.from_dict({**(base_params or {}), **{k: best_row[k].item() if hasattr(best_row[k], "item")
                                                            else best_row[k] for k in keys}})
    result = {
        "params": best.to_dict(),
        "figures": {k: (v.item() if hasattr(v, "item") else v) for k, v in best_row.items() if k not in keys},
        "objective": "max mean goodput (non-silent, on-time frames/s) s.t. deadline misses <= budget and no "
                     "collapse on every seed",
        "miss_budget": miss_budget,
        "seeds": [seed, seed + seeds - 1],
        "grid": grid,
        "candidates": len(candidates),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    return result, table
