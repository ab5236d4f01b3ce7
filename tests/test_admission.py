"""Admission controllers, driven with numbers and no clock (as Netflix's AIMDLimitTest does).

Numbers are the textbook AIMD arithmetic: a cut 30 -> 27 at b = 0.9;
the AIMD sawtooth between about b·K and K + a with mean (1+b)/2·K and period about (1-b)·K/a;
cold start in (K - L0)/a intervals; a knee drop from L to K in ceil(log(K/L)/log b) cuts.

run_server's sessions outlive a control interval and are never evicted, so after a cut the sessions above
the new limit drain as they end, and the AIMD draining rule (no second cut for the congestion already
answered) is met: the sawtooth gains one draining interval per period, and a knee drop waits for each cut's
excess to drain before the next (the tests count this by hand).
"""

from __future__ import annotations

import json
import math
import sys
import weakref

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metronome.admission import (
    AIMDController,
    AIMDParams,
    GradientController,
    GradientParams,
    NoAdmission,
    StaticCap,
    make_controller,
    weighted_percentile,
)
from metronome.errors import MetronomeError

DEADLINE = 1.0          # s; the latency target is 0.8 s with the default target_fraction
FAST = 0.1              # s; well under the target
SLOW = 0.95             # s; over the target, under the deadline


# ---------------------------------------------------------------------------------------------------
# Drivers: one control interval per step, time in whole seconds (interval_s = 1)
# ---------------------------------------------------------------------------------------------------
def interval(c, k, in_flight, latency=FAST, frames=None, silent=0):
    """Play interval k: report in_flight, answer `frames` frames (default: one per session).

    ``in_flight=None`` means the server holds exactly the limit in force once interval k-1 has closed
    (its sessions left at the boundary), so a cut takes effect at once."""
    if in_flight is None:
        c.advance(float(k), 0)
        in_flight = c.limit
    c.advance(float(k), in_flight)
    frames = in_flight if frames is None else frames
    if frames:
        c.observe(k + 0.5, latency, frames=frames, silent=silent)


def knee_server(K, lo=FAST, hi=SLOW):
    """A synthetic server of capacity K: fast at or below K sessions, over the target above."""
    return lambda n: lo if n <= K else hi


# The sessions each controller's server holds, kept across run_server calls on the same controller (a
# test may play one load, then another, against the same running server): the interval each one ends in.
_SESSIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
LIFE = 3                # intervals a session lives (admitted at k + 0.1, it ends at k + LIFE + 0.1)


def run_server(c, latency_of, n_intervals, start=0, demand=10**9, admit_with_may_admit=False, life=LIFE):
    """Demand always exceeds the limit (unless `demand` says otherwise); returns the limit per interval.

    Sessions live ``life`` intervals and are never evicted, as in the simulator and the live driver: the
    controller admits, it cannot end a session. Interval k (from t = k) goes:

    * [k, k + 0.1): the sessions already in flight, n0, answer a frame each at latency_of(n0);
    * k + 0.1: the sessions whose life is over end, then new ones are admitted up to min(limit, demand)
      (one by one through may_admit with admit_with_may_admit: the driver path);
    * [k + 0.1, k + 1): the n1 sessions now in flight answer a frame each at latency_of(n1).

    So after a cut the sessions above the new limit are still there, and still slow, until they end:
    that is what the AIMD draining rule is for. ``lim[j]`` is the limit once j intervals have closed.
    """
    ends = _SESSIONS.setdefault(c, [])     # per session: the interval at whose k + 0.1 it ends
    limits = []
    for k in range(start, start + n_intervals):
        t = float(k)
        c.advance(t, len(ends))             # closes interval k - 1
        if ends:
            c.observe(t + 0.05, latency_of(len(ends)), frames=len(ends))
        ends[:] = [e for e in ends if e > k]
        n = len(ends)
        c.advance(t + 0.1, n)
        d = demand(k) if callable(demand) else demand
        if admit_with_may_admit:
            while n < d and c.may_admit(t + 0.1, n):
                n += 1
        elif not c.dead:
            n = max(n, min(c.limit, d))
        ends.extend([k + life] * (n - len(ends)))
        c.advance(t + 0.1, n)
        if n:
            c.observe(t + 0.5, latency_of(n), frames=n)
        limits.append(c.limit)
    c.advance(float(start + n_intervals), len(ends))   # close the last interval
    return np.array(limits)


def aimd(**kw):
    return AIMDController(AIMDParams(**kw), DEADLINE)


def gradient(**kw):
    return GradientController(AIMDParams(**kw), DEADLINE)


# ---------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------
def test_params_defaults():
    p = AIMDParams()
    assert p.start_limit == p.min_limit == 1
    assert AIMDParams(min_limit=5, max_limit=50).start_limit == 5
    assert AIMDParams(initial_limit=20).start_limit == 20
    c = AIMDController(AIMDParams(initial_limit=20, target_fraction=0.5), deadline_s=0.08)
    assert c.limit == 20 and c.target_s == pytest.approx(0.04)


@pytest.mark.parametrize("d, key, fragment", [
    ({"decrease_factor": 1.5}, "decrease_factor", "decrease factor must be in (0, 1), got 1.5"),
    ({"decrease_factor": 0}, "decrease_factor", "decrease factor must be in (0, 1)"),
    ({"decrease_factor": 1.0}, "decrease_factor", "decrease factor must be in (0, 1)"),
    ({"target_fraction": 0}, "target_fraction", "target fraction must be in (0, 1]"),
    ({"target_fraction": 1.2}, "target_fraction", "target fraction must be in (0, 1]"),
    ({"min_limit": 10, "max_limit": 5}, "max_limit", "must be >= minimum limit"),
    ({"min_limit": 0}, "min_limit", "minimum limit must be >= 1, got 0"),
    ({"percentile": 0}, "percentile", "percentile must be in (0, 100]"),
    ({"percentile": 100.5}, "percentile", "percentile must be in (0, 100]"),
    ({"additive_increase": 0}, "additive_increase", "additive increase must be > 0"),
    ({"interval_s": 0}, "interval_s", "control interval must be > 0 s"),
    ({"initial_limit": 50, "max_limit": 40}, "initial_limit", "initial limit must be in"),
    ({"on_refuse": "drop"}, "on_refuse", "on_refuse must be one of reject, queue"),
    ({"queue_timeout_s": -1}, "queue_timeout_s", "queue timeout must be >= 0 s"),
    ({"silent_tolerance": 1.0}, "silent_tolerance", "silent tolerance must be in [0, 1)"),
    ({"dead_intervals": 0}, "dead_intervals", "dead intervals must be >= 1"),
    ({"decrease_factor": "0.9"}, "decrease_factor", "must be a finite number"),
    ({"decrease_factor": float("nan")}, "decrease_factor", "must be a finite number"),
    ({"min_limit": 2.5}, "min_limit", "must be an integer"),
    ({"max_limit": True}, "max_limit", "must be an integer"),
    ({"backoff": 0.9}, "backoff", "unknown admission parameter 'backoff'"),
])
def test_params_bad_values_one_line_naming_the_key(d, key, fragment):
    with pytest.raises(MetronomeError) as e:
        AIMDParams.from_dict(d)
    msg = str(e.value)
    assert fragment in msg
    assert key in msg
    assert "\n" not in msg


def test_params_constructor_validates_too():
    with pytest.raises(MetronomeError, match=r"decrease factor must be in \(0, 1\), got 1.5"):
        AIMDParams(decrease_factor=1.5)
    with pytest.raises(MetronomeError, match="must be a JSON object"):
        AIMDParams.from_dict([("decrease_factor", 0.5)])


@settings(max_examples=60, deadline=None)
@given(a=st.floats(0.01, 100), b=st.floats(0.01, 0.99), tf=st.floats(0.01, 1.0),
       pct=st.floats(0.1, 100), iv=st.floats(0.01, 10), lo=st.integers(1, 100), span=st.integers(0, 1000),
       init=st.none() | st.floats(0, 1), refuse=st.sampled_from(["reject", "queue"]),
       qt=st.floats(0, 600), tol=st.floats(0, 0.99), dead=st.integers(1, 20))
def test_params_json_round_trip(a, b, tf, pct, iv, lo, span, init, refuse, qt, tol, dead):
    hi = lo + span
    initial = None if init is None else lo + int(init * span)
    p = AIMDParams(additive_increase=a, decrease_factor=b, target_fraction=tf, percentile=pct, interval_s=iv,
                   min_limit=lo, max_limit=hi, initial_limit=initial, on_refuse=refuse, queue_timeout_s=qt,
                   silent_tolerance=tol, dead_intervals=dead)
    q = AIMDParams.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p
    assert set(p.to_dict()) == {"additive_increase", "decrease_factor", "target_fraction", "percentile",
                                "interval_s", "min_limit", "max_limit", "initial_limit", "on_refuse",
                                "queue_timeout_s", "silent_tolerance", "dead_intervals"}


def test_partial_dict_takes_defaults():
    assert AIMDParams.from_dict({"decrease_factor": 0.5}) == AIMDParams(decrease_factor=0.5)


# ---------------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------------
def test_make_controller_specs():
    assert isinstance(make_controller("none", DEADLINE), NoAdmission)
    s = make_controller(" Static:64 ", DEADLINE)
    assert isinstance(s, StaticCap) and s.limit == 64 and s.name == "static:64"
    p = AIMDParams(initial_limit=7, on_refuse="queue", queue_timeout_s=5.0, interval_s=0.5)
    a = make_controller("aimd", 0.08, p)
    assert isinstance(a, AIMDController) and a.limit == 7 and a.params is p and a.deadline_s == 0.08
    assert (a.on_refuse, a.queue_timeout_s, a.interval_s) == ("queue", 5.0, 0.5)
    g = make_controller("GRADIENT", DEADLINE)
    assert isinstance(g, GradientController) and g.name == "gradient"
    n = make_controller("none", DEADLINE, p)
    assert (n.on_refuse, n.interval_s) == ("queue", 0.5)


@pytest.mark.parametrize("spec, message", [
    ("static:0", "static admission limit must be >= 1, got 0"),
    ("static:-3", "static admission limit must be >= 1, got -3"),
    ("static:x", "bad admission spec 'static:x': static needs an integer limit, e.g. static:64"),
    ("static", "bad admission spec 'static': static needs an integer limit, e.g. static:64"),
    ("static:2.5", "bad admission spec 'static:2.5'"),
    ("vegas", "unknown admission controller 'vegas' (one of none, static:N, aimd, gradient)"),
    ("", "unknown admission controller ''"),
])
def test_make_controller_bad_spec(spec, message):
    with pytest.raises(MetronomeError) as e:
        make_controller(spec, DEADLINE)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_deadline_and_static_direct():
    for kind in ("aimd", "gradient"):
        with pytest.raises(MetronomeError, match="frame deadline must be > 0 s"):
            make_controller(kind, 0.0)
    with pytest.raises(MetronomeError, match="static admission limit must be >= 1, got 0"):
        StaticCap(0)
    with pytest.raises(MetronomeError, match="gradient smoothing"):
        GradientController(AIMDParams(), DEADLINE, smoothing=0)


# ---------------------------------------------------------------------------------------------------
# Weighted percentile
# ---------------------------------------------------------------------------------------------------
def test_weighted_percentile_nearest_rank():
    assert weighted_percentile([3.0, 1.0, 2.0], [1, 1, 1], 50) == 2.0
    assert weighted_percentile([1.0, 2.0, 3.0], [1, 1, 98], 50) == 3.0
    assert weighted_percentile([1.0, 2.0, 3.0], [1, 1, 98], 1) == 1.0
    assert weighted_percentile([1.0, 2.0, 3.0], [1, 1, 98], 2) == 2.0
    assert weighted_percentile([1.0, 2.0, 3.0], [1, 1, 98], 100) == 3.0
    # p99 of 100 frames is the 99th-fastest frame, not an interpolation
    assert weighted_percentile(np.arange(1.0, 101.0), np.ones(100), 99) == 99.0
    assert weighted_percentile([0.2, 0.9], [999, 1], 99.9) == 0.2
    assert weighted_percentile([], [], 99) is None
    assert weighted_percentile([0.5], [0], 99) is None
    with pytest.raises(ValueError):
        weighted_percentile([1.0], [1], 0)


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5)), min_size=1, max_size=30),
       q=st.integers(1, 100))
def test_weighted_percentile_matches_numpy_inverted_cdf(data, q):
    values = np.array([v / 10 for v, _ in data])
    weights = np.array([w for _, w in data])
    got = weighted_percentile(values, weights, q)
    expanded = np.repeat(values, weights)
    if expanded.size == 0:
        assert got is None
    else:
        assert got == float(np.percentile(expanded, q, method="inverted_cdf"))


# ---------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------
def test_no_admission_always_admits():
    c = NoAdmission()
    assert c.limit == sys.maxsize
    assert all(c.may_admit(t * 0.3, n) for t, n in enumerate([0, 10, 10**6, 10**12]))
    interval(c, 5, 100, latency=SLOW, silent=100)
    c.advance(6.0, 0)
    assert c.may_admit(6.0, 10**9)
    assert {r["decision"] for r in c.trace()} == {"hold"}


def test_static_cap():
    c = StaticCap(3)
    assert [c.may_admit(0.0, n) for n in range(5)] == [True, True, True, False, False]
    interval(c, 1, 3, latency=SLOW, silent=3)
    c.advance(10.0, 3)
    assert c.limit == 3 and c.may_admit(10.0, 2)


# ---------------------------------------------------------------------------------------------------
# AIMD update rule (one interval at a time)
# ---------------------------------------------------------------------------------------------------
def test_aimd_cut_30_to_27_on_latency_and_on_silence():
    c = aimd(initial_limit=30, max_limit=200)
    interval(c, 0, 30, latency=SLOW)
    c.advance(1.0, 30)
    assert c.limit == 27
    assert c.trace()[-1]["decision"] == "decrease"
    c = aimd(initial_limit=30, max_limit=200)
    interval(c, 0, 30, latency=0.001, silent=1)       # one empty frame, answered "fast"
    c.advance(1.0, 30)
    assert c.limit == 27


def test_aimd_latency_target_is_a_fraction_of_the_deadline():
    c = aimd(initial_limit=30, max_limit=200)          # target 0.8 s
    interval(c, 0, 30, latency=0.79)
    interval(c, 1, 30, latency=0.81)
    c.advance(2.0, 30)
    assert [r["decision"] for r in c.trace()] == ["increase", "decrease"]
    assert c.limit == math.floor(31 * 0.9)


def test_aimd_growth_needs_half_the_limit_in_flight():
    # Netflix AIMDLimitTest: initial 20, inflight 10 -> 21
    c = aimd(initial_limit=20, max_limit=200)
    interval(c, 0, 10)
    c.advance(1.0, 10)
    assert c.limit == 21
    c = aimd(initial_limit=20, max_limit=200)
    for k in range(50):
        interval(c, k, 9)                                # 9 < 20/2: app-limited
    c.advance(50.0, 9)
    assert c.limit == 20
    assert {r["decision"] for r in c.trace()} == {"hold"}


def test_aimd_bursty_demand_still_grows():
    # Netflix #147: the guard must not block growth under bursty demand. The peak in flight counts.
    c = aimd(initial_limit=20, max_limit=200)
    c.advance(0.0, 0)                                    # anchor the interval grid at 0
    for k in range(10):
        c.advance(k + 0.1, c.limit)                      # a burst fills the limit ...
        c.observe(k + 0.2, FAST, frames=c.limit)
        c.advance(k + 0.3, 0)                            # ... then the sessions end
    c.advance(10.0, 0)
    assert c.limit == 30


def test_aimd_clamps_at_min_and_max():
    c = aimd(min_limit=5, max_limit=8, initial_limit=7)
    for k in range(5):
        interval(c, k, None)
    c.advance(5.0, 8)
    assert c.limit == 8
    for k in range(5, 40):
        interval(c, k, None, latency=SLOW)
    c.advance(40.0, 5)
    assert c.limit == 5
    assert c.may_admit(40.0, 4) and not c.may_admit(40.0, 5)


def test_aimd_small_limit_still_decreases():
    # 5.5 · 0.95 = 5.2: floor keeps 5 = floor(5.5), so the at-least-one rule gives 4
    c = aimd(initial_limit=5, additive_increase=0.5, decrease_factor=0.95, max_limit=100)
    interval(c, 0, 5)
    c.advance(1.0, 5)
    assert c.limit == 5                                  # 5.5 internally
    interval(c, 1, 5, latency=SLOW)
    c.advance(2.0, 5)
    assert c.limit == 4
    c = aimd(initial_limit=2, decrease_factor=0.99)
    interval(c, 0, 2, latency=SLOW)
    c.advance(1.0, 2)
    assert c.limit == 1


def test_aimd_fractional_increase():
    c = aimd(initial_limit=10, additive_increase=0.25, max_limit=100)
    for k in range(8):
        interval(c, k, 10)
    c.advance(8.0, 10)
    assert c.limit == 12


def test_one_outlier_interval_costs_at_most_one_cut():
    c = aimd(initial_limit=30, max_limit=200)
    c.advance(0.0, 30)
    for j in range(50):                                  # a long spike inside one interval
        c.observe(0.01 + j * 0.01, 5.0, frames=30)
    c.advance(0.9, 30)
    interval(c, 1, 30)
    interval(c, 2, 30)
    c.advance(3.0, 30)
    assert [r["limit"] for r in c.trace()] == [27, 28, 29]
    assert [r["decision"] for r in c.trace()] == ["decrease", "increase", "increase"]


def test_no_samples_and_nothing_in_flight_holds_and_admits():
    c = aimd(initial_limit=4)
    for t in np.arange(0.0, 20.0, 0.25):
        assert c.may_admit(float(t), 0)
    assert c.limit == 4
    assert len(c.trace()) == 19 and {r["decision"] for r in c.trace()} == {"hold"}
    assert all(r["p_latency_s"] is None and r["frames"] == 0 for r in c.trace())


def test_interval_boundaries_and_gaps():
    c = aimd(initial_limit=10, max_limit=100)
    c.advance(0.0, 10)
    c.observe(0.999, FAST, frames=10)
    c.observe(1.0, SLOW, frames=10)            # at the boundary: belongs to the second interval
    assert len(c.trace()) == 1 and c.trace()[0]["p_latency_s"] == FAST and c.limit == 11
    c.advance(5.5, 0)                          # a gap: intervals 2..5 closed one by one
    t = c.trace()
    assert [r["t_s"] for r in t] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert t[1]["p_latency_s"] == SLOW and t[1]["decision"] == "decrease"
    assert [r["frames"] for r in t[2:]] == [0, 0, 0]
    # an interval grid anchored at the first call, with a non-integer interval
    c = AIMDController(AIMDParams(interval_s=0.08), DEADLINE)
    c.advance(100.0, 0)
    c.advance(100.0 + 0.08 * 25, 0)
    assert len(c.trace()) == 25


def test_gap_equals_step_by_step():
    a, b = aimd(initial_limit=10), aimd(initial_limit=10)
    for c in (a, b):
        interval(c, 0, 4)
    for k in range(1, 8):
        a.advance(float(k), 4)
    b.advance(7.0, 4)
    assert a.trace() == b.trace()


# ---------------------------------------------------------------------------------------------------
# Signal hygiene: refusals, silent frames, the dead signal
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [aimd, gradient])
def test_refused_admissions_are_never_latency_samples(make):
    c = make(initial_limit=10, max_limit=100)
    c.advance(0.0, 10)
    c.observe(0.1, SLOW, frames=1)
    refused = sum(not c.may_admit(0.2 + i * 1e-4, 10) for i in range(1000))
    assert refused == 1000
    c.advance(1.0, 10)
    row = c.trace()[-1]
    assert (row["p_latency_s"], row["frames"], row["decision"]) == (SLOW, 1, "decrease")
    assert c.limit < 10
    # an interval with only refusals has no latency and does not grow the limit
    before = c.limit
    for i in range(1000):
        c.may_admit(1.1 + i * 1e-4, c.limit)
    c.advance(2.0, c.limit)
    row = c.trace()[-1]
    assert row["p_latency_s"] is None and row["frames"] == 0 and row["decision"] == "hold"
    assert c.limit == before


@pytest.mark.parametrize("make", [aimd, gradient])
def test_silent_frames_with_tiny_latency_are_congestion(make):
    """The central point: an empty frame answered in 1 ms is a failure, not a fast sample."""
    c = make(initial_limit=50, max_limit=1000)
    start = c.limit
    for k in range(15):
        interval(c, k, None, latency=0.001, silent=max(1, c.limit // 10))
    c.advance(15.0, c.limit)
    assert c.limit < start * 0.5
    assert all(r["decision"] == "decrease" for r in c.trace())
    assert all(r["p_latency_s"] == 0.001 for r in c.trace())
    # the same frames, none silent, grow the limit: the test above can fail
    c = make(initial_limit=50, max_limit=1000)
    for k in range(30):
        interval(c, k, None, latency=0.001)
    c.advance(30.0, c.limit)
    assert c.limit > start


def test_all_silent_interval_has_no_latency_and_cuts():
    c = aimd(initial_limit=30, max_limit=100, silent_tolerance=0.5)
    interval(c, 0, 30, latency=0.0, silent=30)
    c.advance(1.0, 30)
    row = c.trace()[0]
    assert row["p_latency_s"] is None and row["silent"] == 30 and row["decision"] == "decrease"
    assert c.limit == 27


def test_silent_frames_never_enter_the_percentile():
    # 98 silent frames at 1 ms, 2 real frames at 0.9 s. With the silent ones excluded the p50 is
    # 0.9 s > 0.8 s target: congestion. Were they counted, the p50 would be 1 ms.
    c = aimd(initial_limit=30, max_limit=100, percentile=50, silent_tolerance=0.99)
    c.advance(0.0, 30)
    c.observe(0.5, 0.001, frames=98, silent=98)
    c.observe(0.6, 0.9, frames=2)
    c.advance(1.0, 30)
    assert c.trace()[0]["p_latency_s"] == 0.9
    assert c.limit == 27
    # mixed reports: weights are frames - silent (1 real frame at 1 ms, 2 at 0.9 s -> p50 = 0.9 s)
    c = aimd(initial_limit=30, max_limit=100, percentile=50, silent_tolerance=0.99)
    c.advance(0.0, 30)
    c.observe(0.5, 0.001, frames=98, silent=97)
    c.observe(0.6, 0.9, frames=2)
    c.advance(1.0, 30)
    assert c.trace()[0]["p_latency_s"] == 0.9


def test_silent_tolerance():
    grows = aimd(initial_limit=30, max_limit=100, silent_tolerance=0.1)
    interval(grows, 0, 30, frames=100, silent=5)           # 5 % silent, within 10 %
    grows.advance(1.0, 30)
    assert grows.limit == 31
    cuts = aimd(initial_limit=30, max_limit=100, silent_tolerance=0.1)
    interval(cuts, 0, 30, frames=100, silent=20)           # 20 % silent
    cuts.advance(1.0, 30)
    assert cuts.limit == 27


@pytest.mark.parametrize("make", [aimd, gradient])
def test_dead_signal_stops_admission_and_growth_then_recovers(make):
    c = make(initial_limit=20, max_limit=100, dead_intervals=3)
    interval(c, 0, 15)
    c.advance(1.0, 15)
    lim = c.limit
    for k in range(1, 9):                                  # sessions in flight, not a frame answered
        assert c.may_admit(k + 0.5, 15) == (k < 4)       # intervals 1, 2, 3 empty: dead at t = 4
    c.advance(9.0, 15)
    assert [r["decision"] for r in c.trace()[1:]] == ["hold", "hold", "dead", "dead", "dead", "dead",
                                                      "dead", "dead"]
    assert c.dead and c.limit == lim
    assert not c.may_admit(9.1, 0 + 1)
    c.observe(9.2, FAST, frames=15)                        # frames are back
    assert not c.dead and c.may_admit(9.3, 15)
    for k in range(10, 20):
        interval(c, k, None)
    c.advance(20.0, c.limit)
    assert c.limit > lim


def test_dead_signal_clears_when_nothing_is_in_flight():
    c = aimd(initial_limit=10, dead_intervals=2)
    for k in range(4):
        c.advance(float(k), 3)
    assert c.dead and not c.may_admit(4.0, 3)
    c.advance(5.0, 0)                                      # the sessions left (interval 4 still had 3)
    c.advance(6.0, 0)                                      # interval 5: nothing in flight
    assert not c.dead and c.may_admit(6.0, 0)              # no deadlock
    assert c.trace()[-1]["decision"] == "hold"


def test_dead_signal_needs_consecutive_intervals():
    c = aimd(initial_limit=10, dead_intervals=3)
    for k in range(12):
        c.advance(float(k), 3)
        if k % 2 == 0:
            c.observe(k + 0.5, FAST, frames=1)   # a session with a 2 s frame period
    c.advance(12.0, 3)
    assert "dead" not in {r["decision"] for r in c.trace()}


# ---------------------------------------------------------------------------------------------------
# Against a synthetic server of capacity K
# ---------------------------------------------------------------------------------------------------
def _peaks_troughs(x):
    x = [v for i, v in enumerate(x) if i == 0 or v != x[i - 1]]   # a flat bottom (draining) is one trough
    peaks = [x[i] for i in range(1, len(x) - 1) if x[i] > x[i - 1] and x[i] > x[i + 1]]
    troughs = [x[i] for i in range(1, len(x) - 1) if x[i] < x[i - 1] and x[i] < x[i + 1]]
    return np.array(peaks), np.array(troughs)


# The settled sawtooth against knee_server(K) and run_server's sessions, by hand (a = 1):
# the limit climbs to K + 1, where the K+1st session makes the interval slow: one cut, to floor(b(K+1));
# the next interval still starts with those K + 1 sessions in flight (none has ended yet), slow, above the
# new limit: draining, no second cut; at its k + 0.1 the sessions admitted 3 intervals before (LIFE = 3,
# while the limit was still climbing, so at least one) end, in flight drops to <= K, fast, and from the
# next interval the limit climbs again by 1 per interval.
# Period = 1 cut + 1 draining + (K + 1 - floor(b(K+1))) increases:
#   b = 0.9, K = 100: floor(90.9)  = 90,  101 - 90 + 2  = 13
#   b = 0.5, K = 60:  floor(30.5)  = 30,  61 - 30 + 2   = 33
#   b = 0.8, K = 150: floor(120.8) = 120, 151 - 120 + 2 = 33
# (the textbook "about (1-b)K/a" = 10, 30, 30 ignores the floor and the draining interval).
@pytest.mark.parametrize("b, K, trough, period", [(0.9, 100, 90, 13), (0.5, 60, 30, 33), (0.8, 150, 120, 33)])
def test_aimd_converges_to_a_sawtooth_around_the_knee(b, K, trough, period):
    a, L0 = 1.0, 1
    c = aimd(decrease_factor=b, max_limit=10_000)
    lim = run_server(c, knee_server(K), 600, admit_with_may_admit=True)
    reach = int(np.argmax(lim >= b * K))
    assert lim[reach] >= b * K and reach <= (K - L0) / a + 3            # cold start in (K-L0)/a
    skip = int((K - L0) / a) + 20
    settled = lim[skip:]
    assert settled.max() == K + a                                       # no overshoot past K + a(d+1), d=0
    # a second cut while the excess drains (no draining rule) would take the limit to floor(b·trough)
    assert settled.min() == trough
    peaks, troughs = _peaks_troughs(settled)
    assert len(peaks) >= 3
    assert abs(np.median(troughs) / np.median(peaks) - b) <= 1.5 * a / K + 0.01
    assert abs(settled.mean() / ((1 + b) / 2 * K) - 1) <= 0.05
    cut_at = [i for i in range(1, len(settled)) if settled[i] < settled[i - 1]]
    assert len(cut_at) >= 3 and set(np.diff(cut_at)) == {period}
    # the draining rule was met, once per cut: the interval after each cut (decisions[i] made lim[i + 1])
    decisions = [r["decision"] for r in c.trace()][skip:]
    cuts = [i for i, d in enumerate(decisions) if d == "decrease"]
    assert [i for i, d in enumerate(decisions) if d == "draining"] == [i + 1 for i in cuts if i + 1 < len(decisions)]


def test_aimd_step_load_tracks_the_knee():
    """Netflix Example.java's step scenario, as a knee that moves 50 -> 90 -> 200 -> 100."""
    b, a = 0.9, 1.0
    c = aimd(decrease_factor=b, max_limit=10_000)
    start, L = 0, c.limit
    for K in (50, 90, 200, 100):
        # windows to reach the new knee: (K - L)/a going up; going down ceil(log(K/L)/log b) cuts, each at
        # most LIFE + 1 intervals after the last: the sessions in flight at a cut end within LIFE intervals
        # and no more than the new limit are admitted meanwhile, so by then the cut has taken effect
        down = math.ceil(math.log(K / L) / math.log(b)) if K < L else 0
        settle = int((K - L) / a) if K > L else down * (LIFE + 1)
        lim = run_server(c, knee_server(K), settle + 150, start=start)
        assert lim[settle + 2:].max() <= K + a
        tail = lim[settle + 20:]
        assert abs(tail.mean() / ((1 + b) / 2 * K) - 1) <= 0.06
        rows = c.trace()[start + settle + 20: start + settle + 150]
        cuts = sum(r["decision"] == "decrease" for r in rows)
        assert cuts <= len(rows) / ((1 - b) * K / a) + 2                # one cut per sawtooth period
        if down:                                                        # 200 -> 100: the excess drained
            assert "draining" in {r["decision"] for r in c.trace()[start: start + settle]}
        start += settle + 150
        L = c.limit


def test_aimd_capacity_step_down():
    b = 0.9
    c = aimd(decrease_factor=b, initial_limit=200, max_limit=1000)
    lim = run_server(c, knee_server(100), 30)
    need = math.ceil(math.log(100 / 200) / math.log(b))                 # 7 at b = 0.9
    assert need == 7
    # 200 -> 180 -> 162 -> 145 -> 130 -> 117 -> 105 -> 94 (floor(0.9 L)): 7 cuts. Sessions are not evicted,
    # so each cut waits until the sessions above it have ended (LIFE = 3 intervals), by hand:
    #   interval 0: 200 admitted at 0.1 (they end at 3.1), slow: cut 1 -> 180
    #   intervals 1-3: the 200 are still in flight at the start, above 180: draining; at 3.1 they end and
    #     180 are admitted (ending at 6.1)
    #   interval 4: 180 in flight = the limit, slow: cut 2 -> 162; intervals 5-6 draining, 162 admitted at 6.1
    #   interval 7: cut 3; ... cut j (j >= 2) at interval 1 + 3(j - 1): cut 7 at interval 19
    assert LIFE == 3
    assert [r["decision"] for r in c.trace()[:20]] == (
        ["decrease"] + ["draining"] * 3 + (["decrease"] + ["draining"] * 2) * 5 + ["decrease"])
    assert lim[20] <= 100 < lim[19]                       # lim[j] has seen j closed intervals
    assert list(lim[[1, 5, 8, 11, 14, 17, 20]]) == [180, 162, 145, 130, 117, 105, 94]


@pytest.mark.parametrize("make", [aimd, gradient])
def test_sustained_overload_never_creeps_up(make):
    # Every frame misses the target for 300 intervals: the limit must fall and never rise.
    c = make(initial_limit=150, min_limit=1, max_limit=1000)
    lim = run_server(c, lambda n: SLOW, 300)
    assert np.all(np.diff(lim) <= 0)
    assert lim[-1] == 1
    # from under Gradient2's fixed point (queue_size/0.5 = 8) too: no creep toward it
    c = make(initial_limit=5, min_limit=1, max_limit=1000)
    lim = run_server(c, lambda n: SLOW, 50)
    assert np.all(np.diff(lim) <= 0) and lim.max() <= 5


def test_constant_but_bad_latency_shrinks_the_gradient_limit():
    # Netflix #137 "stable timeout": latency is constant, so the ratio is 1, yet it is over the target.
    c = gradient(initial_limit=100, max_limit=1000)
    lim = run_server(c, lambda n: 0.9, 100)
    assert lim[-1] <= 5 and np.all(np.diff(lim) <= 0)
    assert c.long_latency_s is None                  # overload never became the baseline


@pytest.mark.parametrize("make, a", [(aimd, 1.0), (gradient, 0.8)])
def test_recovery_after_overload(make, a):
    K, L_min = 100, 1
    c = make(min_limit=L_min, initial_limit=80, max_limit=1000)
    lim = run_server(c, lambda n: SLOW, 100)                      # overload drives it to the floor
    assert lim[-1] == L_min
    lim = run_server(c, knee_server(K), 300, start=100)
    back = int(np.argmax(lim >= 0.9 * K))
    assert lim[back] >= 0.9 * K
    assert back <= (K - L_min) / a + 5                              # not stuck at the minimum
    assert lim[back:].max() <= K + 1


def test_demand_below_the_knee_does_not_inflate_the_limit():
    D = 30
    c = aimd(initial_limit=1, max_limit=10_000)
    lim = run_server(c, knee_server(500), 300, demand=D)
    assert lim.max() <= 2 * D + 1


def test_gradient_grows_0_8_per_interval_when_unloaded():
    c = gradient(initial_limit=20, max_limit=1000)
    lim = run_server(c, lambda n: FAST, 10)
    assert c.limit == 28                                  # 20 + 10 · 0.8
    assert list(lim) == [20, 20, 21, 22, 23, 24, 24, 25, 26, 27]


def test_gradient_sawtooth_around_the_knee():
    K = 100
    c = gradient(max_limit=10_000)
    lim = run_server(c, knee_server(K), 500)
    settled = lim[150:]
    assert settled.max() <= K + 1
    assert abs(settled.mean() / (0.95 * K) - 1) <= 0.06


def test_gradient_baseline_does_not_ratchet_under_modest_overload():
    # Netflix #134: latency rises with load but stays under the target; Gradient2's long EMA drifts up
    # to the short one and the limit creeps up forever. Here the limit settles and stays.
    c = gradient(initial_limit=40, max_limit=10_000)
    lim = run_server(c, lambda n: 0.05 * max(1.0, n / 40), 3000)
    first, last = lim[500:1000], lim[2500:]
    assert last.max() <= first.max() + 2
    assert last.mean() <= first.mean() * 1.03
    assert c.long_latency_s <= 0.055                                  # baseline 0.05 s, not the 0.075 s seen
    assert c.long_latency_s <= c.target_s / c.rtt_tolerance


def test_gradient_relative_cut_without_slo_breach():
    # latency doubles (2 > 1.5 tolerance) but stays under the target: the gradient still cuts
    c = gradient(initial_limit=50, max_limit=1000)
    run_server(c, lambda n: 0.1, 20)
    before = c.limit
    run_server(c, lambda n: 0.3, 10, start=20)
    assert c.limit < before
    assert c.long_latency_s == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------
interval_events = st.lists(
    st.tuples(st.integers(0, 300),                     # in flight
              st.integers(0, 40),                      # frames
              st.floats(0, 1),                         # silent share of the frames
              st.floats(0, 2.0),                       # latency (s)
              st.integers(0, 3)),                      # extra intervals of gap after this one
    min_size=1, max_size=40)

param_sets = st.builds(
    AIMDParams,
    additive_increase=st.floats(0.1, 5), decrease_factor=st.floats(0.3, 0.95),
    min_limit=st.integers(1, 10), max_limit=st.integers(10, 200),
    silent_tolerance=st.sampled_from([0.0, 0.1]), dead_intervals=st.integers(1, 4))


def _play(c, events, congested_only=False):
    t = 0.0
    limits = []
    for in_flight, frames, share, lat, gap in events:
        silent = int(frames * share)
        if congested_only:                     # every frame over the target, and at least one silent
            frames, silent, lat = max(frames, 1), max(silent, 1), SLOW + lat
        before = c.limit
        c.advance(t, in_flight)
        closed_before = len(c.trace())
        lim_after_close = c.limit
        admitted = c.may_admit(t + 0.1, in_flight)
        assert admitted == (not c.dead and in_flight < c.limit)
        if frames:
            c.observe(t + 0.5, lat, frames=frames, silent=silent)
        # nothing within an interval changes the limit; only closing intervals does
        assert c.limit == lim_after_close and len(c.trace()) == closed_before
        limits.append((before, c.limit))
        t += 1.0 + gap
    c.advance(t, 0)
    return limits


@pytest.mark.parametrize("kind", [AIMDController, GradientController])
@settings(max_examples=60, deadline=None)
@given(params=param_sets, events=interval_events)
def test_property_limit_bounded_and_one_decision_per_interval(kind, params, events):
    c = kind(params, DEADLINE)
    _play(c, events)
    t = c.trace()
    assert [r["t_s"] for r in t] == [float(i + 1) for i in range(len(t))]
    prev = params.start_limit
    for r in t:
        assert params.min_limit <= r["limit"] <= params.max_limit
        if r["decision"] in ("hold", "dead"):
            assert r["limit"] == prev
        elif r["decision"] == "decrease":
            assert r["limit"] <= prev
            if kind is AIMDController:
                assert r["limit"] <= max(params.min_limit, prev - 1)
        else:
            assert r["limit"] >= prev
            if kind is AIMDController:
                assert r["limit"] <= prev + math.ceil(params.additive_increase)
        prev = r["limit"]


@pytest.mark.parametrize("kind", [AIMDController, GradientController])
@settings(max_examples=60, deadline=None)
@given(params=param_sets, events=interval_events)
def test_property_all_congested_input_never_raises_the_limit(kind, params, events):
    c = kind(params, DEADLINE)
    _play(c, events, congested_only=True)
    limits = [params.start_limit] + [r["limit"] for r in c.trace()]
    assert all(b <= a for a, b in zip(limits, limits[1:]))
    assert "increase" not in {r["decision"] for r in c.trace()}


@settings(max_examples=60, deadline=None)
@given(params=param_sets, events=interval_events)
def test_property_silent_frames_never_move_the_percentile(params, events):
    # Adding silent frames (at any latency) to an interval never changes its latency statistic.
    a, b = AIMDController(params, DEADLINE), AIMDController(params, DEADLINE)
    for k, (in_flight, frames, share, lat, _) in enumerate(events):
        for c in (a, b):
            c.advance(float(k), in_flight)
            if frames:
                c.observe(k + 0.5, lat, frames=frames)
        b.observe(k + 0.6, 0.0, frames=5, silent=5)
    a.advance(float(len(events)), 0)
    b.advance(float(len(events)), 0)
    assert [r["p_latency_s"] for r in a.trace()] == [r["p_latency_s"] for r in b.trace()]
    for ra, rb in zip(a.trace(), b.trace()):
        assert rb["decision"] in ("decrease", "draining", "dead") or ra["decision"] in ("hold", "dead")


def test_bad_observations_are_caller_bugs():
    c = aimd()
    with pytest.raises(ValueError):
        c.observe(0.0, 0.1, frames=2, silent=3)
    with pytest.raises(ValueError):
        c.observe(0.0, float("nan"))
    with pytest.raises(ValueError):
        c.observe(0.0, -1.0)
    with pytest.raises(ValueError):
        c.may_admit(0.0, -1)


def test_a_cut_is_not_repeated_while_the_load_it_asked_to_shed_is_still_draining():
    # admission never evicts: after a cut, in-flight sessions leave only as they end. Congestion seen
    # while in-flight is still above the new limit is the congestion already answered.
    c = AIMDController(AIMDParams(initial_limit=100, decrease_factor=0.9), DEADLINE)
    interval(c, 0, 100, latency=SLOW)
    c.advance(1.0, 100)
    assert c.limit == 90
    for k in range(1, 6):  # sessions drain slowly: 100, 98, 96, 94, 92 still in flight, all slow
        interval(c, k, 100 - 2 * (k - 1), latency=SLOW)
    c.advance(6.0, 90)
    assert c.limit == 90
    assert [r["decision"] for r in c.trace()] == ["decrease"] + ["draining"] * 5
    interval(c, 6, 90, latency=SLOW)  # drained to the limit and still slow: cut again
    c.advance(7.0, 81)
    assert c.limit == 81 and c.trace()[-1]["decision"] == "decrease"


# ---------------------------------------------------------------------------------------------------
# A new controller with its own parameters: the class and its registry entry, nothing else
# ---------------------------------------------------------------------------------------------------
NEW_CONTROLLER = '''
from dataclasses import dataclass
from metronome.admission import AdmissionController, ControllerParams, register
from metronome.errors import MetronomeError


@dataclass(frozen=True, kw_only=True)
class HalfParams(ControllerParams):
    cap: int = 4

    def validate(self):
        super().validate()
        if not isinstance(self.cap, int) or self.cap < 1:
            raise MetronomeError(f"cap must be an integer >= 1, got {self.cap!r} (cap)")


@register
class HalfCap(AdmissionController):
    name = spec = "halfcap"
    Params = HalfParams

    def __init__(self, params=None, deadline_s=1.0):
        p = HalfParams.take(params)
        super().__init__(p.interval_s, p.percentile, p.on_refuse, p.queue_timeout_s)
        self.params = p

    @classmethod
    def from_spec(cls, arg, deadline_s, params):
        return cls(params, deadline_s)

    @property
    def limit(self):
        return self.params.cap

    def _decide(self, in_flight, p_latency_s, frames, silent):
        return "hold"
'''


@pytest.fixture
def halfcap(monkeypatch):
    """Registers the controller above for one test (the registry is restored after)."""
    from metronome import admission as adm

    monkeypatch.setattr(adm, "CONTROLLERS", dict(adm.CONTROLLERS))
    ns = {}
    exec(NEW_CONTROLLER, ns)
    return ns["HalfCap"]


def test_a_registered_controller_takes_its_own_parameters(halfcap):
    from metronome.admission import check_params, controller_specs

    c = make_controller("HalfCap", DEADLINE, {"cap": 7, "interval_s": 0.5})
    assert isinstance(c, halfcap) and c.limit == 7 and c.interval_s == 0.5
    assert "halfcap" in controller_specs()
    # one file serves a grid of controllers: AIMD ignores the new controller's key, and it AIMD's
    a = make_controller("aimd", DEADLINE, {"cap": 7, "decrease_factor": 0.5})
    assert a.params.decrease_factor == 0.5 and not hasattr(a.params, "cap")
    assert make_controller("halfcap", DEADLINE, {"decrease_factor": 0.5}).limit == 4
    with pytest.raises(MetronomeError, match=r"cap must be an integer >= 1, got 0 \(cap\)"):
        check_params({"cap": 0})
    with pytest.raises(MetronomeError, match="bad admission spec 'aimd:3': aimd takes no argument"):
        make_controller("aimd:3", DEADLINE)


def test_an_unregistered_controllers_parameter_is_unknown():
    with pytest.raises(MetronomeError, match="unknown admission parameter 'cap'"):
        make_controller("aimd", DEADLINE, {"cap": 7})
    with pytest.raises(MetronomeError, match="unknown admission controller 'halfcap'"):
        make_controller("halfcap", DEADLINE)


def test_gradient_reads_its_own_parameters_from_a_file_and_aimd_ignores_them():
    g = make_controller("gradient", DEADLINE, {"smoothing": 0.5, "additive_increase": 3})
    assert isinstance(g.params, GradientParams) and g.smoothing == 0.5 and g.params.additive_increase == 3
    a = make_controller("aimd", DEADLINE, {"smoothing": 0.5, "additive_increase": 3})
    assert type(a.params) is AIMDParams and a.params.additive_increase == 3
    with pytest.raises(MetronomeError, match=r"gradient smoothing must be in \(0, 1\], got 0 \(smoothing\)"):
        make_controller("aimd", DEADLINE, {"smoothing": 0})  # a bad value fails whoever reads it


def test_a_registered_controller_runs_from_the_cli(tmp_path):
    """As a user adds one: the class and its ``register`` line; the CLI's help, --admission and
    --aimd-params then know it with no other edit."""
    import subprocess
    import sys

    from fixed_engine import write_fast_moshi

    params = tmp_path / "half.json"
    params.write_text('{"cap": 3}')
    out = tmp_path / "run"
    script = NEW_CONTROLLER + (
        "\nimport sys\nfrom metronome.cli.sim_cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    cal = write_fast_moshi(tmp_path)
    run = lambda *a: subprocess.run([sys.executable, "-c", script, *a], capture_output=True, text=True, timeout=300)
    r = run("run", "--help")
    assert r.returncode == 0 and "halfcap" in r.stdout, r.stderr
    r = run("run", "--calibration", str(cal), "--sessions", "6", "--horizon", "5", "--admission", "halfcap",
            "--aimd-params", str(params), "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["sessions_admitted"] == 3 and s["sessions_refused"] == 3


@pytest.mark.parametrize("make, message", [
    (lambda: StaticCap(3, interval_s=0), "control interval must be > 0 s, got 0 (interval_s)"),
    (lambda: NoAdmission(percentile=0), "percentile must be in (0, 100], got 0 (percentile)"),
    (lambda: NoAdmission(on_refuse="drop"), "on_refuse must be one of reject, queue, got 'drop'"),
    (lambda: StaticCap(3, queue_timeout_s=-1), "queue timeout must be >= 0 s, got -1 (queue_timeout_s)"),
])
def test_a_controller_built_directly_checks_the_common_settings(make, message):
    """The constructors check what every controller reads the way a parameter file is checked."""
    with pytest.raises(MetronomeError) as e:
        make()
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Many rows at once (the simulator's compiled loop hands a span's rows over together)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: aimd(initial_limit=20), lambda: gradient(initial_limit=20),
                                  lambda: StaticCap(30)], ids=["aimd", "gradient", "static"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "one-count"])
def test_observe_many_is_advance_then_observe_row_by_row(make, per_row):
    # rows over 12 intervals, several to an interval and some intervals empty, latencies around the target; the
    # sessions in flight change from row to row (sessions leave and arrive between answers) or stay one count
    rng = np.random.default_rng(4)
    t = np.sort(rng.uniform(0.0, 12.0, 300))
    t = t[(t < 3.0) | (t > 5.0)]  # two intervals with no rows
    lat = rng.uniform(0.3, 1.2, t.size)
    fr = rng.integers(1, 6, t.size)
    si = np.minimum(rng.integers(0, 3, t.size), fr)
    inf = rng.integers(0, 40, t.size) if per_row else np.full(t.size, 17)
    one, many = make(), make()
    for k in range(t.size):
        one.advance(float(t[k]), int(inf[k]))
        one.observe(float(t[k]), float(lat[k]), frames=int(fr[k]), silent=int(si[k]))
    many.observe_many(t, lat, fr, si, in_flight=inf if per_row else 17)
    one.advance(13.0, 5)
    many.advance(13.0, 5)
    assert one.trace() == many.trace() and len(one.trace()) == 12  # (the clock starts at the first row)
    assert len({row["in_flight"] for row in one.trace()}) > (3 if per_row else 0)


def test_observe_many_refuses_a_negative_count():
    with pytest.raises(ValueError, match="in_flight"):
        aimd().observe_many([0.1, 0.2], [0.1, 0.1], [1, 1], [0, 0], in_flight=[3, -1])


# -- the gate's queue -----------------------------------------------------------------------------------------
class _Door:
    """A controller that says yes ``room`` more times, then no (what the gate asks of a controller)."""

    on_refuse, queue_timeout_s, interval_s = "queue", 10.0, 0.5

    def __init__(self):
        self.room = 0

    def may_admit(self, now_s, in_flight):
        if self.room <= 0:
            return False
        self.room -= 1
        return True


def test_the_gates_queue_is_first_in_first_out():
    """Refused sessions wait in arrival order: a, b, c queued at 0, 1, 2 s; room for one at 3 s lets in a (the
    oldest), room for two at 4 s lets in b then c. A last-in-first-out queue would let in c first."""
    from metronome.serving import AdmissionGate

    door = _Door()
    gate = AdmissionGate(door)
    assert [gate.offer(s, t, t, 0) for s, t in (("a", 0.0), ("b", 1.0), ("c", 2.0))] == ["queue"] * 3
    door.room = 1
    assert gate.retry(3.0, lambda: 0) == (["a"], [])
    door.room = 2
    assert gate.retry(4.0, lambda: 1) == (["b", "c"], []) and not gate.queue


def test_the_gates_queue_times_out_from_the_head_in_arrival_order():
    """queue_timeout_s = 10 s from arrival: at 11.5 s a (0 s) and b (1 s) have waited past it, c (2 s) has not; they
    leave in arrival order and c, still inside its timeout, is the one admitted."""
    from metronome.serving import AdmissionGate

    door = _Door()
    gate = AdmissionGate(door)
    for s, t in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        gate.offer(s, t, t, 0)
    door.room = 1
    assert gate.retry(11.5, lambda: 0) == (["c"], ["a", "b"])
