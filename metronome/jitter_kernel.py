"""The correlated jitter ratio, compiled: the one statement both simulator paths run.

:meth:`metronome.jitter.JitterDraws.ratio` (a step taken one at a time) and the simulator's compiled loop
(:func:`metronome.sim.fastpath.run_span`, which calls :func:`correlated_ratio` per step with the frame the step is
taken on) run this same machine code, so both get the same bits. scipy's ``ndtr`` cannot be called from compiled
code: it is restated here with its branches on the C library's erf/erfc (within an ulp of scipy's,
tests/test_jitter_correlation.py), and ``np.interp`` with its arithmetic (equal to it exactly).
"""

from __future__ import annotations

import math

import numpy as np

from metronome import compiled

_SQRT1_2 = 0.7071067811865476


@compiled.counted
def ndtr(y):
    """The standard normal CDF at ``y``: scipy.special.ndtr's branches (erf near 0, erfc in the tails)."""
    x = y * _SQRT1_2
    z = abs(x)
    if z < _SQRT1_2:
        return 0.5 + 0.5 * math.erf(x)
    t = 0.5 * math.erfc(z)
    return 1.0 - t if x > 0 else t


@compiled.counted
def interp(x, p, r):
    """np.interp at one point ``x`` through the points ``(p, r)``, ``p`` rising: its arithmetic, exactly."""
    n = p.size
    if x >= p[n - 1]:
        return r[n - 1]
    if x < p[0]:
        return r[0]
    lo, hi = 0, n - 1  # p[lo] <= x < p[hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if p[mid] <= x:
            lo = mid
        else:
            hi = mid
    slope = (r[lo + 1] - r[lo]) / (p[lo + 1] - p[lo])
    return slope * (x - p[lo]) + r[lo]


@compiled.counted
def correlated_ratio(z, shared, own, w_z, w_shared, w_own, p, r):
    """One step's ratio: its own score ``z``, its frame's ``shared`` (AR(1)) and ``own`` parts, weighted
    (:meth:`JitterDraws.weights`), through the normal CDF to the jitter table ``(p, r)``."""
    y = w_z * z
    if w_shared != 0.0:
        y = y + w_shared * shared
    if w_own != 0.0:
        y = y + w_own * own
    return interp(ndtr(y), p, r)


@compiled.counted
def correlated_ratios(z, shared, own, w_z, w_shared, w_own, p, r):
    """:func:`correlated_ratio` over arrays of steps."""
    out = np.empty(z.size)
    for k in range(z.size):
        out[k] = correlated_ratio(z[k], shared[k], own[k], w_z, w_shared, w_own, p, r)
    return out
