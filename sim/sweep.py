"""Fan runs out over cores: what-if grids (and, built on the same helper, Monte Carlo and tuning).

Each run is seeded by its own point, never by the worker that runs it, so the results are identical
whichever executor runs them and in whatever order the runs finish.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import pandas as pd

from metronome.errors import MetronomeError

from metronome.sim import scenario as scn


def fan_out(fn: Callable[[Any], Any], items: Sequence[Any], workers: int | None = None,
            progress: Callable[[int], None] | None = None) -> list[Any]:
    """``[fn(x) for x in items]`` on a local process pool (``workers`` defaults to every core).

    Results come back in the order of ``items``. With one worker (or one item) it runs in-process."""
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or len(items) <= 1:
        out = []
        for x in items:
            out.append(fn(x))
            if progress:
                progress(1)
        return out
    results: list[Any] = [None] * len(items)
    with ProcessPoolExecutor(max_workers=min(workers, len(items))) as pool:
        futures = {pool.submit(fn, x): k for k, x in enumerate(items)}
        from concurrent.futures import as_completed

        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if progress:
                progress(1)
    return results


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


def what_if(points: list[dict[str, Any]], workers: int | None = None,
            progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    validate_points(points)
    rows = fan_out(run_point, points, workers=workers, progress=progress)
    return pd.DataFrame(rows)
