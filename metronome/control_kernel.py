"""The admission controllers' interval machinery and decisions, in the form numba compiles.

:mod:`metronome.admission` is the controllers' interface (what the live driver, the fleet and the simulator
call); this module is where their rules are stated, once, over a controller's state in arrays, so that the
simulator's compiled loop (:mod:`metronome.sim.fastpath`) can run a controller at every arrival and every
answered frame without leaving machine code, and every other caller runs the very same code through
:class:`metronome.admission.AdmissionController`.

A controller is four arrays:

* ``cp`` its constants (``CP_*``): its kind, the control interval, the percentile, the latency target and its
  own settings;
* ``cs`` its state (``CS_*``): the interval grid's origin and index, the open interval's aggregates (frames,
  silent frames, peak and last in-flight count, latency samples), the limit and what the kind keeps besides;
* ``lat``/``w``: the open interval's non-silent latencies and their weights (``cs[CS_NLAT]`` of them);
* ``tr``: the closed intervals' rows (``TR_*`` columns, ``cs[CS_NTRACE]`` of them).

Callers size ``lat``/``w`` and ``tr`` (:func:`intervals_due`); nothing here allocates, and a write past them
raises.
A kind whose decision is written in Python (a controller registered by a user) is ``K_PYTHON``: its interval
machinery is still this module's (:func:`close_one`, :func:`next_interval`), its decision the class's own.
"""

from __future__ import annotations

import math

import numpy as np

from metronome import compiled

# a controller's kind (cp[CP_KIND]): what decides at an interval's end
K_PYTHON, K_NONE, K_STATIC, K_AIMD, K_GRADIENT = range(5)
# its constants
(CP_KIND, CP_INTERVAL, CP_PCT, CP_TARGET, CP_ADD, CP_DECREASE, CP_MIN, CP_MAX, CP_SILENT_TOL, CP_DEAD_N, CP_LIMIT0,
 CP_SMOOTH, CP_RTT, CP_QUEUE, CP_EMA, CP_WARMUP, CP_DRIFT) = range(17)
N_CP = 17
# its state (CS_T0 is NaN until the first call anchors the grid; CS_LONG NaN until Gradient's first baseline)
(CS_T0, CS_K, CS_FRAMES, CS_SILENT, CS_PEAK, CS_LAST, CS_NLAT, CS_LIMIT, CS_DEAD, CS_DEAD_RUN, CS_LONG, CS_NLONG,
 CS_NTRACE) = range(13)
N_CS = 13
# a closed interval's row: its end, the limit after the decision, the peak in flight, the percentile (NaN: none),
# frames, silent frames and the decision (DECISIONS' index)
TR_END, TR_LIMIT, TR_PEAK, TR_P, TR_FRAMES, TR_SILENT, TR_DECISION = range(7)
N_TR = 7
# decisions, as metronome.admission.DECISIONS names them (the same order)
D_INCREASE, D_DECREASE, D_DRAINING, D_HOLD, D_DEAD = range(5)

# Interval ends are t0 + (k+1)·I in floating point, and cumulative weights sums of floats: an exact hit must not
# be missed by rounding.
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


@compiled.counted
def limit_of(cs, cp):
    """The concurrency limit in sessions (``none``: no limit, +inf)."""
    kind = cp[CP_KIND]
    if kind == K_NONE:
        return np.inf
    if kind == K_STATIC:
        return cp[CP_LIMIT0]
    return math.floor(cs[CS_LIMIT] + 1e-9)


@compiled.counted
def _due(cs, cp, now):
    """Has the open interval ended by ``now``?"""
    return (now - cs[CS_T0]) / cp[CP_INTERVAL] >= cs[CS_K] + 1 - REL_EPS


@compiled.counted
def intervals_due(cs, cp, now):
    """How many intervals a call at ``now`` would close (what ``tr`` must have room for)."""
    if np.isnan(cs[CS_T0]):
        return 0
    n = 0
    elapsed = (now - cs[CS_T0]) / cp[CP_INTERVAL]
    while elapsed >= cs[CS_K] + n + 1 - REL_EPS:
        n += 1
    return n


@compiled.counted
def close_one(cs, cp, lat, w, in_flight):
    """The open interval's figures at its end: (end, peak in flight, percentile or NaN, frames, silent)."""
    end = cs[CS_T0] + (cs[CS_K] + 1) * cp[CP_INTERVAL]
    peak = max(cs[CS_PEAK], in_flight)
    n = int(cs[CS_NLAT])
    p = percentile_whole(lat[:n], w[:n], cp[CP_PCT]) if n else np.nan  # (weights: frames less silent ones)
    return end, peak, p, cs[CS_FRAMES], cs[CS_SILENT]


@compiled.counted
def next_interval(cs, in_flight):
    """Open the next interval: nothing observed yet; what is in flight now was in flight when it began."""
    cs[CS_K] += 1
    cs[CS_NLAT] = 0
    cs[CS_FRAMES] = 0
    cs[CS_SILENT] = 0
    cs[CS_PEAK] = in_flight


@compiled.counted
def record(cs, tr, end, limit, peak, p, frames, silent, decision):
    """A closed interval's row in the trace."""
    r = int(cs[CS_NTRACE])
    if r >= tr.shape[0]:  # (the caller makes room; writing past it would corrupt memory unchecked)
        raise IndexError("control_kernel.record: no room in the trace")
    tr[r, TR_END], tr[r, TR_LIMIT], tr[r, TR_PEAK], tr[r, TR_P] = end, limit, peak, p
    tr[r, TR_FRAMES], tr[r, TR_SILENT], tr[r, TR_DECISION] = frames, silent, decision
    cs[CS_NTRACE] = r + 1


@compiled.uncounted
def close_through(cs, cp, lat, w, tr, now, in_flight):
    """Close every interval that ended at or before ``now``, each with one decision (a compiled kind's); the
    first call anchors the grid."""
    if np.isnan(cs[CS_T0]):
        cs[CS_T0] = now
        return
    while _due(cs, cp, now):
        end, peak, p, frames, silent = close_one(cs, cp, lat, w, in_flight)
        d = decide(cs, cp, peak, p, frames, silent)
        record(cs, tr, end, limit_of(cs, cp), peak, p, frames, silent, d)
        next_interval(cs, in_flight)


@compiled.uncounted
def advance(cs, cp, lat, w, tr, now, in_flight):
    """Close every interval that ended at or before ``now`` (``in_flight`` sessions in flight now)."""
    cs[CS_LAST] = in_flight
    close_through(cs, cp, lat, w, tr, now, in_flight)
    cs[CS_PEAK] = max(cs[CS_PEAK], in_flight)


@compiled.uncounted
def take_frames(cs, cp, lat, w, latency, frames, silent):
    """``frames`` frames answered with ``latency``, ``silent`` of them empty, into the open interval: silent
    frames only count; the others are one latency sample of weight ``frames - silent``. A frame clears a dead
    signal."""
    if frames == 0:
        return
    cs[CS_FRAMES] += frames
    cs[CS_SILENT] += silent
    if frames > silent:
        n = int(cs[CS_NLAT])
        if n >= lat.size:
            raise IndexError("control_kernel.take_frames: no room for the latency sample")
        lat[n], w[n] = latency, frames - silent
        cs[CS_NLAT] = n + 1
    cs[CS_DEAD] = 0.0
    cs[CS_DEAD_RUN] = 0.0


@compiled.counted
def observe(cs, cp, lat, w, tr, now, latency, frames, silent):
    """Frames answered at ``now``: the intervals ended by then close (with the last in-flight count reported),
    then the frames join the open one."""
    close_through(cs, cp, lat, w, tr, now, cs[CS_LAST])
    take_frames(cs, cp, lat, w, latency, frames, silent)


@compiled.counted
def may_admit(cs, cp, lat, w, tr, now, in_flight):
    """Advance to ``now``, then: may one more session start with ``in_flight`` in flight? (``none``: always.)"""
    advance(cs, cp, lat, w, tr, now, in_flight)
    if cp[CP_KIND] == K_NONE:
        return True
    return cs[CS_DEAD] == 0.0 and in_flight < limit_of(cs, cp)


# ------------------------------------------------------------------------------------------------ decisions
@compiled.counted
def decide(cs, cp, in_flight, p, frames, silent):
    """Judge one closed interval (its peak in flight, percentile, frames, silent frames); may change the limit;
    returns a D_* decision. ``none`` and ``static`` hold."""
    kind = cp[CP_KIND]
    if kind == K_AIMD:
        return _aimd(cs, cp, in_flight, p, frames, silent)
    if kind == K_GRADIENT:
        return _gradient(cs, cp, in_flight, p, frames, silent)
    return D_HOLD


@compiled.counted
def _no_frames(cs, cp, in_flight):
    """An interval without a single frame: with sessions in flight it counts toward a dead signal
    (``dead_intervals`` in a row refuse everything); with none, it clears it (cold start must admit)."""
    if in_flight > 0:
        cs[CS_DEAD_RUN] += 1
        if cs[CS_DEAD_RUN] >= cp[CP_DEAD_N]:
            cs[CS_DEAD] = 1.0
    else:
        cs[CS_DEAD_RUN] = 0.0
        cs[CS_DEAD] = 0.0
    return D_DEAD if cs[CS_DEAD] != 0.0 else D_HOLD


@compiled.counted
def _congested(cp, p, frames, silent):
    """Absolute congestion: too many silent frames, or the latency percentile over the target."""
    if silent / frames > cp[CP_SILENT_TOL]:
        return True
    return not np.isnan(p) and p > cp[CP_TARGET]


@compiled.counted
def _clamp(cp, x):
    return min(cp[CP_MAX], max(cp[CP_MIN], x))


@compiled.counted
def _aimd(cs, cp, in_flight, p, frames, silent):
    """AIMD (:class:`metronome.admission.AIMDController` says why each rule is as it is)."""
    if frames == 0:
        return _no_frames(cs, cp, in_flight)
    L = cs[CS_LIMIT]
    if _congested(cp, p, frames, silent):
        if in_flight > math.floor(L + 1e-9):
            return D_DRAINING  # the last cut has not taken effect yet
        cut = min(math.floor(L * cp[CP_DECREASE] + 1e-9), math.floor(L + 1e-9) - 1)
        cs[CS_LIMIT] = _clamp(cp, float(cut))
        return D_DECREASE
    if not np.isnan(p) and 2 * in_flight >= L:
        cs[CS_LIMIT] = _clamp(cp, L + cp[CP_ADD])
        return D_INCREASE
    return D_HOLD


@compiled.counted
def _update_long(cs, cp, short):
    """Gradient's baseline: a plain mean over the warm-up, then an EMA that follows a rise ``drift`` times as
    fast as a fall; Netflix's recovery rule; never past target / tolerance."""
    if np.isnan(cs[CS_LONG]) or cs[CS_NLONG] < cp[CP_WARMUP]:
        n = cs[CS_NLONG]
        cs[CS_LONG] = short if np.isnan(cs[CS_LONG]) else (cs[CS_LONG] * n + short) / (n + 1)
    else:
        rate = cp[CP_EMA] if short <= cs[CS_LONG] else cp[CP_EMA] * cp[CP_DRIFT]
        cs[CS_LONG] += rate * (short - cs[CS_LONG])
    cs[CS_NLONG] += 1
    if short > 0 and cs[CS_LONG] / short > 2.0:
        cs[CS_LONG] *= 0.95
    cs[CS_LONG] = min(cs[CS_LONG], cp[CP_TARGET] / cp[CP_RTT])


@compiled.counted
def _gradient(cs, cp, in_flight, p, frames, silent):
    """Gradient2 (:class:`metronome.admission.GradientController` says why each rule is as it is)."""
    if frames == 0:
        return _no_frames(cs, cp, in_flight)
    L = cs[CS_LIMIT]
    smoothing = cp[CP_SMOOTH]
    if _congested(cp, p, frames, silent):
        cs[CS_LIMIT] = _clamp(cp, L * (1.0 - smoothing * 0.5))
        return D_DECREASE
    if np.isnan(p):  # only silent frames, within the tolerance: nothing to learn
        return D_HOLD
    short = p
    if np.isnan(cs[CS_LONG]) or short <= cp[CP_RTT] * cs[CS_LONG]:
        _update_long(cs, cp, short)
    if short <= 0:
        gradient = 1.0
    else:
        gradient = min(1.0, max(0.5, cp[CP_RTT] * cs[CS_LONG] / short))
    new = (1.0 - smoothing) * L + smoothing * (gradient * L + cp[CP_QUEUE])
    if new > L and 2 * in_flight < L:
        new = L  # app-limited: do not grow
    new = _clamp(cp, new)
    cs[CS_LIMIT] = new
    if new > L + 1e-12:
        return D_INCREASE
    if new < L - 1e-12:
        return D_DECREASE
    return D_HOLD


@compiled.uncounted
def observe_moment(cs, cp, lat, w, tr, now, in_flight, latency, frames, silent):
    """Rows answered together at ``now`` with ``in_flight`` sessions in flight: what :func:`observe_rows` does
    with their one time and count, the intervals closed once (the same call again would close none)."""
    advance(cs, cp, lat, w, tr, now, float(in_flight))
    for j in range(latency.size):
        take_frames(cs, cp, lat, w, latency[j], float(frames[j]), float(silent[j]))


@compiled.counted
def observe_rows(cs, cp, lat, w, tr, now, latency, frames, silent, in_flight):
    """Row by row: ``advance(now, in_flight)`` then ``observe(now, latency, frames, silent)`` (a front end
    answering its frames a moment at a time)."""
    for j in range(now.size):
        # (counts as floats, as every other caller gives them: one compiled form of advance and take_frames)
        advance(cs, cp, lat, w, tr, now[j], float(in_flight[j]))
        take_frames(cs, cp, lat, w, latency[j], float(frames[j]), float(silent[j]))  # (advance closed through now[j])
