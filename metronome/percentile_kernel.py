"""Weighted percentiles in the form numba compiles: the one statement of a percentile that a run's report
(:mod:`metronome.results`) and an admission controller's interval (:mod:`metronome.control_kernel`) both read.

A module of its own, below both: the controllers' kernel reaches the controllers' rules in
:mod:`metronome.admission`, which re-exports the report's percentile, so the report's percentile cannot sit in the
kernel without an import cycle.
"""

from __future__ import annotations

import math

import numpy as np

from metronome import compiled

# Cumulative weights are sums of floats, and a controller's interval ends t0 + (k+1)·I floating point
# (control_kernel): an exact hit must not be missed by rounding.
REL_EPS = 1e-9


@compiled.counted
def percentile_sorted(v, cum, q):
    """The weighted nearest-rank percentile of values ``v`` in ascending order, ``cum`` their cumulative weights
    (all > 0), ``q`` in (0, 100]: the smallest value whose cumulative weight reaches ``q/100`` of the total. The
    small relative slack keeps q·W/100 == an exact cumulative weight from being missed by rounding (e.g.
    16.1 · 1000 / 100 = 161.00000000000003)."""
    i = np.searchsorted(cum, percentile_threshold(cum[-1], q), side="left")
    return v[min(i, v.size - 1)]


@compiled.counted
def percentile_threshold(total, q):
    """The cumulative weight the ``q``-th percentile's value is the first to reach, of a total weight ``total``."""
    return q * total / 100.0 - REL_EPS * total


@compiled.counted
def percentile_whole(v, w, q):
    """:func:`percentiles_whole` at one ``q``."""
    qs = np.empty(1)
    qs[0] = q
    return percentiles_whole(v, w, qs)[0]


# From this many samples on, a percentile is bracketed by a sample first (:func:`rank_in_bracket`): a run's
# millions of frame rows are then read twice and not swapped about; a controller's interval stays below it.
BRACKET_MIN = 1 << 16
BRACKET_SAMPLE = 1 << 14  # about this many rows are sampled to bracket a rank


@compiled.counted
def whole_rank(total, q):
    """The 0-based rank, among samples repeated by whole weights totalling ``total``, of the ``q``-th
    percentile's value: the nearest rank of :func:`percentile_threshold`."""
    return min(max(math.ceil(percentile_threshold(total, q)) - 1, 0), total - 1)


@compiled.counted
def percentiles_whole(v, w, qs):
    """:func:`percentile_sorted` at each of ``qs`` of ``v`` whose weights ``w`` are whole numbers (>= 0, a total
    above 0 and below 2**53: every sum of them is exact; no value NaN), without sorting: the value each
    percentile's rank falls on among the samples repeated by weight. Many samples: each rank bracketed by a sample
    (:func:`rank_in_bracket`); few, or a bracket that missed: :func:`select_whole`."""
    if v.size < BRACKET_MIN:
        return select_whole(v, w, qs)
    total = 0.0
    for x in w:
        total += x
    out = np.empty(qs.size)
    for idx in range(qs.size):
        x = rank_in_bracket(v, w, whole_rank(total, qs[idx]), total)
        if math.isnan(x):
            x = select_whole(v, w, qs[idx:idx + 1])[0]
        out[idx] = x
    return out


@compiled.counted
def rank_in_bracket(v, w, rank, total):
    """The value at 0-based ``rank`` among ``v`` repeated by whole weights ``w`` (total ``total``; no value NaN):
    a strided sample of the rows, sorted, brackets the rank with a wide margin; one pass weighs what lies below
    the bracket and takes what lies in it, and only that is sorted. NaN when the rank is
    not in the bracket (a sample that misrepresents the rows; the caller selects instead): exact either way."""
    n = v.size
    stride = max(1, n // BRACKET_SAMPLE)
    sv, sw = v[::stride].copy(), w[::stride]
    order = np.argsort(sv)
    s_total = 0.0
    for x in sw:
        s_total += x
    if s_total <= 0.0:
        return np.nan
    m = sv.size
    frac = rank / total
    # the bracket: the sampled share at the rank, ± several of its standard errors and a few samples more
    margin = 4.0 * math.sqrt(max(frac * (1.0 - frac), 1.0 / m) / m) + 4.0 / m
    lo_w, hi_w = (frac - margin) * s_total, (frac + margin) * s_total
    lo, hi = -np.inf, np.inf
    cum = 0.0
    for j in order:
        cum += sw[j]
        if lo_w > 0.0 and lo == -np.inf and cum >= lo_w:
            lo = sv[j]
        if hi_w < s_total and cum >= hi_w:
            hi = sv[j]
            break
    below, inside, k = 0.0, 0.0, 0
    bv, bw = np.empty(n), np.empty(n)  # (not written past what the bracket holds: a few times n/sample)
    for i in range(n):  # without branches: around a median they would be mispredicted half the time
        x, y = v[i], w[i]
        b = x < lo
        c = (not b) and x <= hi
        below += y * b
        inside += y * c
        bv[k], bw[k] = x, y
        k += c
    if not (below <= rank < below + inside):
        return np.nan
    bv, bw = bv[:k], bw[:k]
    cum = below
    for j in np.argsort(bv):
        cum += bw[j]
        if cum > rank:
            return bv[j]
    return np.nan  # (unreachable: the bracket holds the rank)


@compiled.counted
def select_whole(v, w, qs):
    """:func:`percentiles_whole` by a weighted quickselect (expected linear time, no sort). The ranks are taken
    in ascending order, each searching only what lies at or above the one before."""
    total = 0.0
    for x in w:
        total += x
    out = np.empty(qs.size)
    a, b = v.copy(), w.copy()
    lo, base = 0, 0.0  # everything before lo is below what is left to find, and weighs base
    for idx in np.argsort(qs):
        rank = whole_rank(total, qs[idx]) - base
        hi = v.size
        while True:
            if lo >= hi:  # (cannot happen while the ranks are within the total: a bug, not a slow search)
                raise AssertionError("select_whole: a rank fell outside the samples")
            p = a[lo + (hi - lo) // 2]
            # three ways: [lo, i) below the pivot, [i, j) equal, [j, hi) above
            i, j, k = lo, lo, hi
            below = equal = 0.0
            while j < k:
                if a[j] < p:
                    a[i], a[j] = a[j], a[i]
                    b[i], b[j] = b[j], b[i]
                    below += b[i]
                    i += 1
                    j += 1
                elif a[j] > p:
                    k -= 1
                    a[j], a[k] = a[k], a[j]
                    b[j], b[k] = b[k], b[j]
                else:
                    equal += b[j]
                    j += 1
            if rank < below:
                hi = i
            elif rank < below + equal:
                out[idx] = p
                lo, base = i, base + below  # the next rank is at or above p: from the equal block on
                break
            else:
                rank -= below + equal
                base += below + equal
                lo = j
    return out


@compiled.counted
def whole_weights(v, w):
    """What :func:`percentiles_whole` may take, in one pass: 1 when every weight is a finite whole number >= 0,
    their total is above 0 and below 2**53, and no value is NaN; 0 when they are fine but not that (fractions, a
    NaN value, too large a total); -1 when a weight is negative or not finite; -2 when every weight is 0."""
    total = 0.0
    whole = True
    for j in range(w.size):
        x = w[j]
        if not (x >= 0.0) or np.isinf(x):
            return -1
        total += x
        if whole and (x != math.floor(x) or np.isnan(v[j])):
            whole = False
    if total == 0.0:
        return -2
    return 1 if whole and total < 2.0 ** 53 else 0
