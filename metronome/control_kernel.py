"""The admission controllers' interval machinery, in the form numba compiles.

:mod:`metronome.admission` is the controllers' interface (what the live driver, the fleet and the simulator
call) and states each built-in controller's decision beside the class that explains it (``aimd_decide``,
``gradient_decide``); this module is the interval machinery every controller shares, stated once over a
controller's state in arrays, and the one dispatch to a compiled decision (:func:`decide`). The simulator's
compiled loop (:mod:`metronome.sim.fastpath`) runs a controller at every arrival and every answered frame
without leaving machine code, and every other caller runs the very same code through
:class:`metronome.admission.AdmissionController`.

A controller is a :class:`ControllerArrays`, five arrays:

* ``cp`` its constants, one :data:`PARAMS` record: its kind, the control interval, the percentile, the latency
  target and its own settings;
* ``cs`` its state, one :data:`STATE` record: the interval grid's origin and index, the open interval's
  aggregates (frames, silent frames, peak and last in-flight count, latency samples), the limit and what the kind
  keeps besides;
* ``lat``/``w``: the open interval's non-silent latencies and their weights (``cs[0].n_lat`` of them);
* ``tr``: the closed intervals' rows, :data:`TRACE` records (``cs[0].n_trace`` of them).

Callers size ``lat``/``w`` and ``tr`` (:func:`intervals_due`); nothing here allocates, and a write past them
raises. A kind whose decision is written in Python (a controller registered by a user) is ``K_PYTHON``: its
interval machinery is still this module's (:func:`close_one`, :func:`record`, :func:`next_interval`), its decision
the class's own, called from Python.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# (module objects: admission's rules are resolved when numba compiles the dispatch, at its first call, so the two
# modules may import each other in either order)
from metronome import admission as adm
from metronome import compiled, percentile_kernel
# the percentiles the interval reads, re-exported: they were stated here before the report shared them
from metronome.percentile_kernel import (BRACKET_MIN, BRACKET_SAMPLE, REL_EPS, percentile_sorted,  # noqa: F401
                                         percentile_threshold, percentile_whole, percentiles_whole, ranks_in_brackets,
                                         select_whole, whole_rank, whole_weights)

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

# A controller's records are numpy structured arrays, not named tuples: numba compiles a field of a record to a
# load or store at a fixed offset (what an index into a float array was), the state must be written in place (a
# named tuple is immutable), a record handed to a function is one pointer (a named tuple of 17 floats is 17
# words), and compiled.borrowed takes arrays. One record type for every controller: the compiled loop is compiled
# once whichever controller it runs, the kind (a field) choosing the decision. Every field is a float64, as the
# arrays were: the arithmetic is the same (counts are exact below 2**53).
PARAMS = np.dtype([(name, np.float64) for name in (
    "kind",  # adm.K_*: what decides at an interval's end
    "interval_s", "percentile",
    # the adaptive controllers' (AIMDParams): static_limit is StaticCap's
    "target_s", "additive_increase", "decrease_factor", "min_limit", "max_limit", "silent_tolerance",
    "dead_intervals", "static_limit",
    # Gradient's (GradientParams; ema is 2 / (long_window + 1))
    "smoothing", "rtt_tolerance", "queue_size", "ema", "warmup", "drift_fraction")])
# t0 is NaN until the first call anchors the grid; long NaN until Gradient's first baseline
STATE = np.dtype([(name, np.float64) for name in (
    "t0", "k", "frames", "silent", "peak", "last", "n_lat", "limit", "dead", "dead_run", "long", "n_long",
    "n_trace")])
# a closed interval's row: its end, the limit after the decision, the peak in flight, the percentile (NaN: none),
# frames, silent frames and the decision (adm.D_*: DECISIONS' index)
TRACE = np.dtype([(name, np.float64) for name in ("end", "limit", "peak", "p", "frames", "silent", "decision")])


class ControllerArrays(NamedTuple):
    """A controller's arrays, handed to every function here as one argument (numba passes a named tuple of arrays
    as it passes its arrays). ``cs``/``cp``: one :data:`STATE`/:data:`PARAMS` record each; ``lat``/``w``: the open
    interval's latency samples and their weights; ``tr``: :data:`TRACE` rows."""

    cs: np.ndarray
    cp: np.ndarray
    lat: np.ndarray
    w: np.ndarray
    tr: np.ndarray


def new_arrays(kind: int, interval_s: float, percentile: float) -> ControllerArrays:
    """A fresh controller's arrays: no grid, no baseline, room for 64 samples and 16 closed intervals (grown by
    the caller)."""
    cp = np.zeros(1, PARAMS)
    cp["kind"], cp["interval_s"], cp["percentile"] = kind, interval_s, percentile
    cs = np.zeros(1, STATE)
    cs["t0"] = cs["long"] = np.nan
    return ControllerArrays(cs, cp, np.zeros(64), np.zeros(64), np.zeros(16, TRACE))


def no_controller(n_latencies: int) -> ControllerArrays:
    """Arrays a compiled loop is given when it runs no compiled controller (it never reads them; it checks
    :func:`open_samples` against ``n_latencies``)."""
    return ControllerArrays(np.zeros(1, STATE), np.zeros(1, PARAMS), np.zeros(n_latencies), np.zeros(n_latencies),
                            np.zeros(0, TRACE))


@compiled.inlined
def open_samples(ctl):
    """How many latency samples the open interval holds (``ctl.lat`` must have room for those to come)."""
    return ctl.cs[0].n_lat


@compiled.counted
def limit_of(ctl):
    """The concurrency limit in sessions (``none``: no limit, +inf)."""
    return _limit(ctl.cs[0], ctl.cp[0])


@compiled.counted
def _limit(s, c):
    kind = c.kind
    if kind == adm.K_NONE:
        return np.inf
    if kind == adm.K_STATIC:
        return c.static_limit
    return math.floor(s.limit + 1e-9)


@compiled.counted
def _due(s, c, now):
    """Has the open interval ended by ``now``?"""
    return (now - s.t0) / c.interval_s >= s.k + 1 - REL_EPS


@compiled.counted
def intervals_due(ctl, now):
    """How many intervals a call at ``now`` would close (what ``tr`` must have room for)."""
    s, c = ctl.cs[0], ctl.cp[0]
    if np.isnan(s.t0):
        return 0
    n = 0
    elapsed = (now - s.t0) / c.interval_s
    while elapsed >= s.k + n + 1 - REL_EPS:
        n += 1
    return n


@compiled.counted
def close_one(ctl, in_flight):
    """The open interval's figures at its end: (end, peak in flight, percentile or NaN, frames, silent)."""
    s, c = ctl.cs[0], ctl.cp[0]
    end = s.t0 + (s.k + 1) * c.interval_s
    peak = max(s.peak, in_flight)
    n = int(s.n_lat)
    p = percentile_whole(ctl.lat[:n], ctl.w[:n], c.percentile) if n else np.nan  # (weights: frames less silent)
    return end, peak, p, s.frames, s.silent


@compiled.counted
def next_interval(ctl, in_flight):
    """Open the next interval: nothing observed yet; what is in flight now was in flight when it began."""
    s = ctl.cs[0]
    s.k += 1
    s.n_lat = 0
    s.frames = 0
    s.silent = 0
    s.peak = in_flight


@compiled.counted
def record(ctl, end, limit, peak, p, frames, silent, decision):
    """A closed interval's row in the trace."""
    s, tr = ctl.cs[0], ctl.tr
    r = int(s.n_trace)
    if r >= tr.shape[0]:  # (the caller makes room; writing past it would corrupt memory unchecked)
        raise IndexError("control_kernel.record: no room in the trace")
    row = tr[r]
    row.end, row.limit, row.peak, row.p = end, limit, peak, p
    row.frames, row.silent, row.decision = frames, silent, decision
    s.n_trace = r + 1


@compiled.uncounted
def close_through(ctl, now, in_flight):
    """Close every interval that ended at or before ``now``, each with one decision (a compiled kind's); the
    first call anchors the grid."""
    s, c = ctl.cs[0], ctl.cp[0]
    if np.isnan(s.t0):
        s.t0 = now
        return
    while _due(s, c, now):
        end, peak, p, frames, silent = close_one(ctl, in_flight)
        d = decide(s, c, peak, p, frames, silent)
        record(ctl, end, _limit(s, c), peak, p, frames, silent, d)
        next_interval(ctl, in_flight)


@compiled.uncounted
def advance(ctl, now, in_flight):
    """Close every interval that ended at or before ``now`` (``in_flight`` sessions in flight now)."""
    s = ctl.cs[0]
    s.last = in_flight
    close_through(ctl, now, in_flight)
    s.peak = max(s.peak, in_flight)


@compiled.uncounted
def take_frames(ctl, latency, frames, silent):
    """``frames`` frames answered with ``latency``, ``silent`` of them empty, into the open interval: silent
    frames only count; the others are one latency sample of weight ``frames - silent``. A frame clears a dead
    signal."""
    _take(ctl.cs[0], ctl.lat, ctl.w, latency, frames, silent)


@compiled.uncounted
def _take(s, lat, w, latency, frames, silent):
    """:func:`take_frames` on the state record and the sample arrays: what a caller taking many rows hands on per
    row (the record is one pointer, the five arrays 35 words)."""
    if frames == 0:
        return
    s.frames += frames
    s.silent += silent
    if frames > silent:
        n = int(s.n_lat)
        if n >= lat.size:
            raise IndexError("control_kernel.take_frames: no room for the latency sample")
        lat[n], w[n] = latency, frames - silent
        s.n_lat = n + 1
    s.dead = 0.0
    s.dead_run = 0.0


@compiled.counted
def observe(ctl, now, latency, frames, silent):
    """Frames answered at ``now``: the intervals ended by then close (with the last in-flight count reported),
    then the frames join the open one."""
    close_through(ctl, now, ctl.cs[0].last)
    take_frames(ctl, latency, frames, silent)


@compiled.counted
def may_admit(ctl, now, in_flight):
    """Advance to ``now``, then: may one more session start with ``in_flight`` in flight? (``none``: always.)"""
    advance(ctl, now, in_flight)
    s, c = ctl.cs[0], ctl.cp[0]
    if c.kind == adm.K_NONE:
        return True
    return s.dead == 0.0 and in_flight < _limit(s, c)


@compiled.counted
def decide(s, c, in_flight, p, frames, silent):
    """Judge one closed interval (its peak in flight, percentile, frames, silent frames) by the kind's rule, stated
    beside its class in :mod:`metronome.admission`; may change the limit; returns a decision (``adm.D_*``).
    ``none`` and ``static`` hold."""
    kind = c.kind
    if kind == adm.K_AIMD:
        return adm.aimd_decide(s, c, in_flight, p, frames, silent)
    if kind == adm.K_GRADIENT:
        return adm.gradient_decide(s, c, in_flight, p, frames, silent)
    return adm.D_HOLD


@compiled.uncounted
def observe_moment(ctl, now, in_flight, latency, frames, silent):
    """Rows answered together at ``now`` with ``in_flight`` sessions in flight: what :func:`observe_rows` does
    with their one time and count, the intervals closed once (the same call again would close none)."""
    advance(ctl, now, float(in_flight))
    s, lat, w = ctl.cs[0], ctl.lat, ctl.w
    for j in range(latency.size):
        _take(s, lat, w, latency[j], float(frames[j]), float(silent[j]))


@compiled.counted
def observe_rows(ctl, now, latency, frames, silent, in_flight):
    """Row by row: ``advance(now, in_flight)`` then ``observe(now, latency, frames, silent)`` (a front end
    answering its frames a moment at a time)."""
    for j in range(now.size):
        # (counts as floats, as every other caller gives them: one compiled form of advance and take_frames)
        advance(ctl, now[j], float(in_flight[j]))
        take_frames(ctl, latency[j], float(frames[j]), float(silent[j]))  # (advance closed through now[j])


# this module's compiled code has admission's rules and the percentiles compiled in: its cache goes with them
CONTROL_FORM = compiled.guard(decide, (adm, percentile_kernel))
