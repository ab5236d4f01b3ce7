"""What-if grids: the cartesian product of option lists, one simulated run per point.

Each run is seeded by its own point, never by the worker that runs it, so the results are identical
whichever executor (:mod:`metronome.sim.executors`) runs them.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import pandas as pd

from metronome.errors import MetronomeError

from metronome.sim import scenario as scn
from metronome.sim.executors import LocalExecutor


def grid(axes: dict[str, Iterable[Any]]) -> list[dict[str, Any]]:
    """The cartesian product of the axes, as a list of option dicts (the last axis varies fastest)."""
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(list(axes[k]) for k in keys))]


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One what-if point: its options, then every summary key."""
    res = scn.run(scn.make_scenario(**point))
    return {**{f"opt_{k}": v for k, v in point.items()}, **res.summary}


def validate_points(points: list[dict[str, Any]]) -> None:
    """Build every scenario before running any, so a bad point fails in one line before work starts."""
    for p in points:
        try:
            scn.make_scenario(**p)
        except MetronomeError as exc:
            shown = ", ".join(f"{k}={v}" for k, v in p.items() if v is not None)
            raise MetronomeError(f"{exc} (at what-if point {shown})") from None


def what_if(points: list[dict[str, Any]], executor=None,
            progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    validate_points(points)
    rows = (executor or LocalExecutor()).map(run_point, points, progress=progress)
    return pd.DataFrame(rows)
