"""Per-bin tallies of a fleet run's tables: the seconds intervals spend in each bin, the most open at once,
and the sessions an arrival rate offers.
"""

from __future__ import annotations

import numpy as np

from metronome.workload import Arrivals


def overlap_by_bin(start, stop, group, n_groups: int, edges: np.ndarray) -> np.ndarray:
    """Seconds each group's intervals ``[start, stop)`` spend in each bin ``[edges[k], edges[k+1])``."""
    cum = np.empty((n_groups, edges.size))
    for k, e in enumerate(edges):
        cum[:, k] = np.bincount(group, weights=np.clip(np.minimum(stop, e) - start, 0, None), minlength=n_groups)
    return np.diff(cum, axis=1)


def level_max_by_bin(start, stop, group, n_groups: int, edges: np.ndarray) -> np.ndarray:
    """The most intervals of each group open at once within each bin (a departure before an arrival at the same
    instant, as the simulation processes them)."""
    n_bins = edges.size - 1
    out = np.zeros((n_groups, n_bins), dtype=np.int64)
    for k in range(n_bins):  # the level carried into each bin
        at = (start <= edges[k]) & (stop > edges[k])
        out[:, k] = np.bincount(group[at], minlength=n_groups)
    inside = stop < edges[-1]
    t = np.concatenate([start, stop[inside]])
    d = np.concatenate([np.ones(start.size, dtype=np.int64), -np.ones(int(inside.sum()), dtype=np.int64)])
    g = np.concatenate([group, group[inside]])
    order = np.lexsort((d, t, g))
    t, d, g = t[order], d[order], g[order]
    level = np.cumsum(d)
    firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    level -= np.repeat(level[firsts] - d[firsts], np.diff(np.append(firsts, g.size)))
    b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n_bins - 1)
    np.maximum.at(out, (g, b), level)
    return out


def expected_by_bin(arrivals: Arrivals, edges: np.ndarray) -> np.ndarray:
    """Sessions the arrival rate offers in each bin (the integral of the rate; ``all``/``ramp``: none)."""
    if arrivals.kind == "poisson":
        return arrivals.rate_per_s * np.diff(edges)
    if arrivals.kind != "pattern":
        return np.zeros(edges.size - 1)
    lengths = np.array([d for d, _ in arrivals.segments], dtype=float)
    rates = np.array([r for _, r in arrivals.segments], dtype=float)
    starts = np.cumsum(lengths) - lengths
    # sessions offered from 0 to each edge: every segment's rate times the part of it before the edge
    cum = np.clip(edges[:, None] - starts[None, :], 0.0, lengths[None, :]) @ rates
    return np.diff(cum)
