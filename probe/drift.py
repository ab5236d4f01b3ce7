"""How fast the engine runs after the live runs, against how fast it ran when ``validate`` calibrated it: the host's
drift.

On a shared host the engine's speed moves with the other processes (measured here: 2 to 8x slower than a
calibration taken a minute earlier), so a live frame latency that misses the simulator's may be the model's miss
or the host's. ``validate`` tells them apart: right after calibrating, and again after the live runs, it measures a
few of the calibration's own grid points (prefill and decode, at the smallest and the largest point: the base,
per-sequence and per-token costs) on an engine as calibrated, the same way both times, and compares each group's
median step time. The ratio is how much slower the engine ran after the runs than when it was calibrated (1: as
calibrated).

The reference is compared with itself, not with the calibration's grid: measured alone it ran 15-20 % faster than
the same points inside the calibration's grid (a warmer engine, steps in a different order), both before and after
the runs, which would read as drift. No model is in the ratio either: it is steps against steps, at the same shapes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

DRIFT_LIMIT = 0.10  # past this drift over the runs, either way, the comparison is not valid
KINDS = ("prefill", "decode")  # what the reference repeats of each point (chunks wait for the frame clock: slow)
# each point measured this many times, in turn (one pass is ~20 steps, a second on the tiny model: alone it swung by
# 15 % from one minute to the next)
REPEATS = 3


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
    for _ in range(REPEATS):
        for n, c in points:
            rows += measure_point(engine, policy, quick, n, c, None, 0, f"grid N={n} C={c}")
    return pd.DataFrame(rows)


def speed_ratio(reference: pd.DataFrame, baseline: pd.DataFrame) -> float | None:
    """How many times slower the engine ran ``reference`` than ``baseline`` (rows as measure_point writes them):
    the median, over (point, kind), of the reference's median step time over the baseline's. None: no point in
    common."""
    ratios = []
    for (key, kind), ref in reference.groupby(["phase", "kind"]):
        if kind not in KINDS:
            continue
        base = baseline[(baseline["phase"] == key) & (baseline["kind"] == kind)]
        if len(base):
            ratios.append(float(ref["step_s"].median()) / float(base["step_s"].median()))
    return float(np.median(ratios)) if ratios else None


def assess(ratio: float | None) -> dict:
    """The drift over the runs (``ratio`` − 1: after against right after calibrating), the factor a calibration is
    scaled by to price the runs' engine (the mean speed over the runs, the drift taken as steady: (1 + ratio) / 2),
    and whether the comparison is valid: within :data:`DRIFT_LIMIT`, else why not."""
    if ratio is None:
        return {"drift": None, "factor": None, "limit": DRIFT_LIMIT, "valid": False,
                "reason": "the engine's speed could not be measured against its calibration"}
    valid = abs(ratio - 1.0) <= DRIFT_LIMIT
    return {"drift": ratio - 1.0, "factor": (1.0 + ratio) / 2.0, "limit": DRIFT_LIMIT, "valid": valid,
            "reason": None if valid else (
                f"the engine ran {ratio - 1.0:+.0%} after the live runs against when it was calibrated (limit "
                f"±{DRIFT_LIMIT:.0%}): the host, not the model, sets these latencies")}
