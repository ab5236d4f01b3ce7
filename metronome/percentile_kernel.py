"""Weighted percentiles in the form numba compiles: the one statement of a percentile that a run's report
(:mod:`metronome.results`) and an admission controller's interval (:mod:`metronome.control_kernel`) both read.

A module of its own, below both: the controllers' kernel reaches the controllers' rules in
:mod:`metronome.admission`, which re-exports the report's percentile, so the report's percentile cannot sit in the
kernel without an import cycle.
"""

from __future__ import annotations

import math

import numba as nb
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
    """:func:`percentiles_whole` at one ``q``, selected (:func:`select_whole`): an admission controller's interval
    (a few thousand samples) is far below a bracket's worth, and this is compiled into the simulator's loop, where
    the bracket's code would only be more to compile."""
    qs = np.empty(1)
    qs[0] = q
    return select_whole(v, w, qs)[0]


# From this many samples on, a percentile is bracketed by a sample first (:func:`ranks_in_brackets`): a run's
# millions of frame rows are then read once a rank and not swapped about; a controller's interval stays below it.
BRACKET_MIN = 1 << 16
BRACKET_SAMPLE = 1 << 14  # about this many rows are sampled to bracket a rank
BIG = np.finfo(np.float64).max / 2  # (a bracket's open end, as a finite number the one comparison can reach)


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
    (:func:`ranks_in_brackets`); few, or a bracket that missed: :func:`select_whole`."""
    if v.size < BRACKET_MIN:
        return select_whole(v, w, qs)
    total = float(whole_total(w))
    ranks = np.empty(qs.size)
    for idx in range(qs.size):
        ranks[idx] = whole_rank(total, qs[idx])
    out = ranks_in_brackets(v, w, ranks, total)
    for idx in range(qs.size):
        if math.isnan(out[idx]):
            out[idx] = select_whole(v, w, qs[idx:idx + 1])[0]
    return out


@compiled.counted
def whole_total(w):
    """The sum of whole weights ``w`` (each >= 0, the total below 2**53), exactly: added as integers, which the
    processor adds a few at a time (a float sum waits on each addition before the next; a run's frame rows are
    millions)."""
    total = 0
    for x in w:
        total += np.int64(x)
    return total


@compiled.counted
def ranks_in_brackets(v, w, ranks, total):
    """The value at each 0-based rank of ``ranks`` among ``v`` repeated by whole weights ``w`` (total ``total``;
    no value NaN): a strided sample of the rows, sorted once, brackets each rank with a wide margin; one pass per
    rank weighs what lies below its bracket and takes what lies in it (:func:`weigh_bracket`), and only that is
    searched (:func:`select_ranks`). NaN for a rank not in its bracket (a sample that misrepresents the rows; the
    caller selects instead): exact either way."""
    n = v.size
    out = np.full(ranks.size, np.nan)
    stride = max(1, n // BRACKET_SAMPLE)
    sv, sw = v[::stride].copy(), w[::stride]
    order = np.argsort(sv)
    s_total = 0.0
    for x in sw:
        s_total += x
    if s_total <= 0.0:
        return out
    m = sv.size
    bv, bw = np.empty(n), np.empty(n)  # (not written past what a bracket holds: a few times n/sample)
    for idx in range(ranks.size):
        rank = ranks[idx]
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
        below, inside, k = weigh_bracket(v, w, lo, hi, bv, bw)
        if not (below <= rank < below + inside):
            continue
        out[idx] = select_ranks(bv[:k], bw[:k], np.full(1, rank - below))[0]
    return out


@compiled.counted
def weigh_bracket(v, w, lo, hi, bv, bw):
    """The whole weight of the rows of ``v`` below ``lo`` and of those in [``lo``, ``hi``], and how many of these,
    written to ``bv``/``bw``. What lies below is weighed without a branch (around a median one would be mispredicted
    half the time), as integers (whole weights: exact, and no wait on each float addition). The bracket's few rows
    are found by one comparison that may take a few more (its reach: half the bracket and a slack far above
    rounding), then the exact one: two comparisons compile to two branches, the first a coin toss at the median."""
    flo, fhi = max(lo, -BIG), min(hi, BIG)
    mid, reach = 0.5 * flo + 0.5 * fhi, (0.5 * fhi - 0.5 * flo) + 1e-9 * (abs(flo) + abs(fhi)) + 1e-300
    below, inside, k = 0, 0, 0
    for i in range(v.size):
        x, y = v[i], w[i]
        below += np.int64(y) * (x < lo)
        if abs(x - mid) <= reach:
            if lo <= x <= hi:
                bv[k], bw[k] = x, y
                inside += np.int64(y)
                k += 1
    return below, inside, k


# (spliced into each caller, numba IR: compiled apart it was one more function to compile into the simulator's
# loop, which an admission controller's percentile reaches)
@nb.njit(cache=True, inline="always")
def select_whole(v, w, qs):
    """:func:`percentiles_whole` by a weighted quickselect (:func:`select_ranks`)."""
    total = 0.0
    for x in w:
        total += x
    ranks = np.empty(qs.size)
    for idx in range(qs.size):
        ranks[idx] = whole_rank(total, qs[idx])
    return select_ranks(v, w, ranks)


@compiled.counted
def select_ranks(v, w, ranks):
    """The value at each 0-based rank of ``ranks`` among ``v`` repeated by whole weights ``w`` (no value NaN),
    by a weighted quickselect (expected linear time, no sort). The ranks are taken in ascending order, each
    searching only what lies at or above the one before."""
    out = np.empty(ranks.size)
    a, b = v.copy(), w.copy()
    lo, base = 0, 0.0  # everything before lo is below what is left to find, and weighs base
    for idx in np.argsort(ranks):
        rank = ranks[idx] - base
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
    NaN value, too large a total); -1 when a weight is negative or not finite; -2 when every weight is 0. Without
    a branch per row, and the total in four sums (a run's frame rows are millions: a branch or a single float sum
    would wait on each row)."""
    bad = False
    whole = True
    t0 = t1 = t2 = t3 = 0.0
    n4 = w.size - w.size % 4
    for j in range(0, w.size):
        x = w[j]
        bad |= (not (x >= 0.0)) | (x == np.inf)
        whole &= (x == math.floor(x)) & (v[j] == v[j])  # (a NaN value is not equal to itself)
    for j in range(0, n4, 4):
        t0, t1, t2, t3 = t0 + w[j], t1 + w[j + 1], t2 + w[j + 2], t3 + w[j + 3]
    for j in range(n4, w.size):
        t0 += w[j]
    if bad:
        return -1
    total = (t0 + t1) + (t2 + t3)
    if total == 0.0:
        return -2
    return 1 if whole and total < 2.0 ** 53 else 0
