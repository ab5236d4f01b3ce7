"""How fast the engine runs now, against the calibration ``validate`` took minutes before: the host's drift.

On a shared host the engine's speed moves with the other processes (measured here: 2 to 8x slower than a
calibration taken a minute earlier), so a live frame latency that misses the simulator's may be the model's miss
or the host's. ``validate`` tells them apart: before its live runs and after them it repeats a few of the
calibration's own grid points (prefill and decode, at the smallest and the largest point: the base, per-sequence
and per-token costs) on an in-process engine, and compares each group's median step time with the calibration's
own steps at the same point and kind. The ratio is how much slower the engine is now (1: as calibrated).

No model is in the ratio (a calibration fitted on paced real-time steps prices a back-to-back grid step
differently from what that step took): it is steps against steps, at the same shapes, on the same engine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

DRIFT_LIMIT = 0.10  # past this, before or after the runs, the comparison is not valid
KINDS = ("prefill", "decode")  # what the reference repeats of each point (chunks wait for the frame clock: slow)


def reference_points(grid_points) -> list[tuple[int, int]]:
    """The calibration's grid points the reference repeats: its smallest and its largest (sessions, context)."""
    pts = sorted({(int(n), int(c)) for n, c in grid_points})
    return pts if len(pts) <= 2 else [pts[0], pts[-1]]


def measure(engine, policy, copts, points) -> pd.DataFrame:
    """The reference: each point's prefill and decode steps on ``engine`` as the calibration measured them
    (:func:`metronome.probe.calibrate.measure_point`, whose rows it keeps), without its frame-like chunks."""
    from metronome.probe.calibrate import measure_point

    quick = replace(copts, chunk_sizes=())
    rows = []
    for n, c in points:
        rows += measure_point(engine, policy, quick, n, c, None, 0, f"grid N={n} C={c}")
    return pd.DataFrame(rows)


def speed_ratio(reference: pd.DataFrame, grid: pd.DataFrame) -> float | None:
    """How many times slower the engine ran the reference than the calibration's grid ran the same points: the
    median, over (point, kind), of the reference's median step time over the calibration's. None: no point in
    common."""
    ratios = []
    for (key, kind), ref in reference.groupby(["phase", "kind"]):
        if kind not in KINDS:
            continue
        cal = grid[(grid["phase"] == key) & (grid["kind"] == kind)]
        if len(cal):
            ratios.append(float(ref["step_s"].median()) / float(cal["step_s"].median()))
    return float(np.median(ratios)) if ratios else None


def assess(before: float | None, after: float | None) -> dict:
    """The drift before and after the runs (ratio − 1), the factor a calibration is scaled by to price the runs'
    engine (the mean of the two ratios), and whether the comparison is valid: both within :data:`DRIFT_LIMIT`,
    else why not."""
    if before is None or after is None:
        return {"before": None, "after": None, "factor": None, "valid": False,
                "reason": "the engine's speed could not be measured against the calibration"}
    out = {"before": before - 1.0, "after": after - 1.0, "factor": (before + after) / 2.0, "limit": DRIFT_LIMIT}
    worst = max(abs(before - 1.0), abs(after - 1.0))
    out["valid"] = worst <= DRIFT_LIMIT
    out["reason"] = None if out["valid"] else (
        f"the engine ran {before - 1.0:+.0%} against its calibration before the live runs and {after - 1.0:+.0%} "
        f"after them (limit ±{DRIFT_LIMIT:.0%}): the host, not the model, sets these latencies")
    return out
