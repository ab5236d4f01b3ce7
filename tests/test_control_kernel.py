"""The controllers' compiled statement (metronome/control_kernel.py): what the simulator's loop runs is what every
other caller runs, and a loop can never write past the arrays a controller holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metronome import control_kernel as ck
from metronome.admission import AdmissionController, AIMDController, StaticCap, make_controller
from metronome.results import percentiles, weighted_percentile, weighted_percentiles


def test_the_percentile_by_selection_is_the_percentile_by_sorting():
    """One rule, two ways to it: whole weights (frames, steps; the controllers' intervals) select the value in
    linear time (control_kernel.percentile_whole), others sort (percentile_sorted). Both against values counted
    by hand from the definition (smallest v with W(x <= v) >= q·W/100), and against the samples repeated by weight
    and sorted (nearest rank, 1-based ceil(q·W/100))."""
    v = np.array([0.3, 0.1, 0.2, 0.1, 0.3, 0.2, 0.1])
    w = np.array([1.0, 2.0, 1.0, 1.0, 3.0, 2.0, 1.0])  # W = 11: 0.1 weighs 4, 0.2 weighs 3, 0.3 weighs 4
    by_hand = {10: 0.1, 36: 0.1, 37: 0.2, 63: 0.2, 64: 0.3, 99: 0.3, 100: 0.3}
    order = np.argsort(v, kind="stable")
    for q, want in by_hand.items():
        assert ck.percentile_whole(v, w, float(q)) == want, q
        assert ck.percentile_sorted(v[order], np.cumsum(w[order]), float(q)) == want, q
        assert weighted_percentile(v, w, q) == want, q
    assert weighted_percentiles(v, w, tuple(by_hand)) == list(by_hand.values())
    # 161 of 1,000 samples are exactly 16.1%, but 16.1 · 1000 / 100 rounds to 161.00000000000003: the slack
    # keeps the percentile on them (both ways to it)
    assert weighted_percentile([0.2, 0.9], [161, 839], 16.1) == 0.2
    assert ck.percentile_sorted(np.array([0.2, 0.9]), np.array([161.0, 1000.0]), 16.1) == 0.2
    rng = np.random.default_rng(3)
    for _ in range(300):  # ties and weights anywhere
        n = int(rng.integers(1, 60))
        v, w = rng.integers(0, 8, n) / 8.0, rng.integers(1, 5, n).astype(float)
        q = float(rng.choice([1.0, 50.0, 90.0, 99.0, 99.9, 100.0]))
        rep = np.sort(np.repeat(v, w.astype(int)))
        want = rep[max(math.ceil(q * rep.size / 100 - 1e-9 * rep.size), 1) - 1]
        assert ck.percentile_whole(v, w, q) == want
        order = np.argsort(v, kind="stable")
        assert ck.percentile_sorted(v[order], np.cumsum(w[order]), q) == want


def test_several_percentiles_in_one_selection():
    """percentiles_whole takes its ranks in ascending order, each searching only above the last: every q, asked in
    any order and among zero weights (a frame row of silent frames only), is the value the samples repeated by
    weight and sorted put at its nearest rank."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        n = int(rng.integers(1, 80))
        v, w = rng.integers(0, 10, n) / 10.0, rng.integers(0, 4, n).astype(float)
        if w.sum() == 0:
            w[0] = 1.0
        qs = rng.choice([0.5, 1.0, 25.0, 50.0, 50.0, 90.0, 99.0, 100.0], size=int(rng.integers(1, 5)))
        rep = np.sort(np.repeat(v, w.astype(int)))
        want = [rep[max(math.ceil(q * rep.size / 100 - 1e-9 * rep.size), 1) - 1] for q in qs]
        assert ck.percentiles_whole(v, w, qs.astype(float)).tolist() == want
        assert weighted_percentiles(v, w, tuple(qs.tolist())) == want


def test_what_may_be_selected():
    """whole_weights sends whole weights to the selection and the rest to the sort, and refuses bad weights."""
    v = np.array([0.1, 0.2])
    assert ck.whole_weights(v, np.array([1.0, 2.0])) == 1
    assert ck.whole_weights(v, np.array([1.0, 0.5])) == 0  # a fraction: sorted
    assert ck.whole_weights(np.array([0.1, np.nan]), np.array([1.0, 1.0])) == 0  # a NaN value: sorted
    assert ck.whole_weights(v, np.array([1.0, 2.0 ** 53])) == 0  # sums no longer exact
    assert ck.whole_weights(v, np.array([1.0, -1.0])) == -1
    assert ck.whole_weights(v, np.array([1.0, np.inf])) == -1
    assert ck.whole_weights(v, np.array([np.nan, 1.0])) == -1
    assert ck.whole_weights(v, np.array([0.0, 0.0])) == -2
    assert weighted_percentiles(v, [0, 0], (50, 99)) == [None, None]
    with pytest.raises(ValueError, match="finite and >= 0"):
        weighted_percentiles(v, [1, -1], (50,))
    # the sorting way: 0.1 and 0.2 weigh half, so the median is 0.2
    assert weighted_percentiles([0.3, 0.1, 0.2], [0.5, 0.25, 0.25], (50, 51, 100)) == [0.2, 0.3, 0.3]


def test_percentiles_leave_out_nan_and_sort_once():
    assert percentiles([np.nan, 3.0, 1.0, 2.0], (50, 100)) == [2.0, 3.0]
    assert percentiles([np.nan], (50, 99)) == [None, None]


def test_room_covers_a_loop_from_a_controller_not_yet_anchored():
    """A compiled loop writes the trace rows of every interval it closes; ``room`` must cover them even before
    the first call anchors the grid (the loop may be the first to call)."""
    c = make_controller("aimd", 0.04, {"interval_s": 0.5})
    assert math.isnan(c.arrays.cs[0]["t0"])
    now = np.linspace(10.0, 70.0, 1000)  # 60 s: 120 intervals of 0.5 s
    c.room(10.0, 70.0, now.size)
    ones = np.ones(now.size)
    ck.observe_rows(c.arrays, now, 0.01 * ones, ones, 0 * ones, 3 * ones)
    assert len(c.trace()) == 120  # anchored at 10 s: the 120 intervals of 0.5 s that ended by 70 s (the last at it)
    fresh = make_controller("aimd", 0.04, {"interval_s": 0.5})  # without room the kernel refuses, never corrupts
    with pytest.raises(IndexError):
        ck.observe_rows(fresh.arrays, now, 0.01 * ones, ones, 0 * ones, 3 * ones)


class _Halver(AdmissionController):
    """A controller deciding in Python (as one a user registers): the cap halves when the p99 is over 30 ms."""

    name = spec = "halver"

    def __init__(self, n: int = 40, **kw):
        super().__init__(**kw)
        self.n = n

    @property
    def limit(self) -> int:
        return self.n

    def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
        if p_latency_s is not None and p_latency_s > 0.03:
            self.n = max(1, self.n // 2)
            return "decrease"
        return "hold"


def test_a_controller_deciding_in_python_runs_the_same_interval_machinery():
    """The interval grid, the peak in flight and the percentile are the kernel's for every controller; only the
    decision is the class's. Expected rows worked out by hand: intervals of 1 s from t = 0."""
    c = _Halver(8)
    assert not c.compiled
    c.advance(0.0, 0)
    c.observe(0.2, 0.010, frames=3, silent=1)  # weight 2 at 10 ms
    c.observe(0.7, 0.050, frames=1)  # weight 1 at 50 ms: p99 = 50 ms > 30 ms
    assert c.may_admit(0.9, 7) and not c.may_admit(0.95, 8)
    c.advance(1.0, 5)  # closes [0, 1): its peak is 8, the count the refused call at 0.95 reported
    (row,) = c.trace()
    assert row == {"t_s": 1.0, "limit": 4, "in_flight": 8, "p_latency_s": 0.05, "frames": 4, "silent": 1,
                   "decision": "decrease"}
    assert not c.may_admit(1.5, 4) and c.may_admit(1.5, 3)


@pytest.mark.parametrize("make", [lambda: AIMDController({"initial_limit": 5}, 0.04), lambda: StaticCap(5)],
                         ids=["aimd", "static"])
def test_the_kernel_and_the_interface_are_one_state(make):
    """The loop calls the kernel on the controller's own arrays: what it does shows through the interface."""
    a, b = make(), make()
    assert a.compiled
    # (in flight rising row by row: the row that closes an interval brings its peak)
    rows = [(0.1 * k, 0.02 if k % 7 else 0.09, 1 + k % 3, k % 2, k) for k in range(1, 80)]
    for t, lat, f, s, inf in rows:
        a.advance(t, inf)
        a.observe(t, lat, f, s)
    now, lat, f, s, inf = (np.array(c, dtype=float) for c in zip(*rows))
    b.room(now[0], now[-1], now.size)
    ck.observe_rows(b.arrays, now, lat, f, s, inf)
    assert a.trace() == b.trace() and a.limit == b.limit and len(a.trace()) == 7


def test_rows_of_one_moment_are_observed_as_rows_one_at_a_time():
    """The simulator's loop tells a compiled controller the rows answered at one moment in one call
    (observe_moment: one advance, then each row's frames); the controller must end as if told row by row through
    its interface. Moments cross interval ends (intervals of 0.25 s, a moment every 0.1 s), in flight rises and
    falls (the peak an interval is judged by), some frames are silent and some latencies over the target."""
    a, b = AIMDController({"initial_limit": 5, "interval_s": 0.25}, 0.04), \
        AIMDController({"initial_limit": 5, "interval_s": 0.25}, 0.04)
    moments = []
    for k in range(1, 60):
        rows = [(0.09 if 20 <= k < 26 and j == 0 else 0.02, 1 + j % 3, 1 if k % 13 == 0 and j == 0 else 0)
                for j in range(1 + k % 4)]
        moments.append((0.1 * k, 2 + (k * 7) % 5, rows))
    for t, inf, rows in moments:
        for lat, f, s in rows:
            a.advance(t, inf)
            a.observe(t, lat, f, s)
    b.room(moments[0][0], moments[-1][0], sum(len(r) for _, _, r in moments))
    for t, inf, rows in moments:
        lat, f, s = (np.array(c, dtype=float) for c in zip(*rows))
        ck.observe_moment(b.arrays, t, inf, lat, f, s)
    assert len(a.trace()) == 23  # intervals of 0.25 s ended by 5.9 s, from the first moment at 0.1 s
    assert {r["decision"] for r in a.trace()} == {"increase", "decrease", "hold"}
    assert b.trace() == a.trace() and b.limit == a.limit


def test_a_controller_deciding_in_python_decides_in_python_once_per_interval():
    """A user's controller is called, in Python (it appends to a Python list, which compiled code cannot), once at
    each control interval's end: a gap of several intervals without calls closes each one with its own call, and
    calls within an interval decide nothing. Expected calls worked out by hand: intervals of 0.5 s from t = 2."""
    seen = []

    class Counter(_Halver):
        def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
            seen.append((in_flight, p_latency_s, frames, silent))
            return "hold"

    c = Counter(8, interval_s=0.5)
    c.advance(2.0, 1)  # anchors the grid
    c.observe(2.1, 0.02, frames=2)
    assert c.may_admit(2.4, 3) and seen == []  # still within [2.0, 2.5)
    c.advance(3.6, 2)  # closes [2, 2.5), [2.5, 3) and [3, 3.5): three calls
    assert seen == [(3, 0.02, 2, 0), (2, None, 0, 0), (2, None, 0, 0)]
    assert [r["t_s"] for r in c.trace()] == [2.5, 3.0, 3.5]
    c.observe(3.9, 0.01, frames=1)
    assert len(seen) == 3  # [3.5, 4) still open


def test_a_controller_deciding_in_python_must_state_its_decision():
    """The base class has no decision of its own to fall back on: a Python controller without one says so at its
    first closed interval, rather than holding silently."""

    class Silent(AdmissionController):
        name = spec = "silent"

        @property
        def limit(self) -> int:
            return 4

    c = Silent()
    c.advance(0.0, 1)
    with pytest.raises(NotImplementedError, match="Silent decides in Python"):
        c.advance(1.0, 1)


def test_many_samples_bracket_the_rank_and_fall_back_when_the_sample_misleads():
    """From control_kernel.BRACKET_MIN samples on, each rank is bracketed by a strided sample and only the bracket is
    sorted: every q is still the value the samples repeated by weight and sorted put at its nearest rank, with ties,
    zero weights and the extremes; and where the sample misrepresents the rows (every sampled row weighs 1, the rows
    between weigh 1,000 and sit elsewhere) the bracket misses, says so (NaN), and the selection answers instead."""
    rng = np.random.default_rng(11)
    n = ck.BRACKET_MIN + 12_345
    for ties, shift in ((False, 0.0), (True, 0.0), (False, -7.0)):  # (and values below zero)
        v = (rng.integers(0, 300, n) / 300.0 if ties else rng.gamma(2.0, 0.01, n)) + shift
        w = rng.integers(0, 6, n).astype(float)
        qs = np.array([0.1, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0])
        rep = np.sort(np.repeat(v, w.astype(int)))
        want = [rep[max(math.ceil(q * rep.size / 100 - 1e-9 * rep.size), 1) - 1] for q in qs]
        assert ck.percentiles_whole(v, w, qs).tolist() == want
        total = w.sum()
        assert ck.ranks_in_brackets(v, w, np.array([ck.whole_rank(total, q) for q in qs]), total).tolist() == want
    stride = n // ck.BRACKET_SAMPLE
    v = np.where(np.arange(n) % stride == 0, 0.5, 0.9)  # the sample sees only 0.5s
    w = np.where(np.arange(n) % stride == 0, 1.0, 1000.0)  # but nearly all the weight is at 0.9
    total = w.sum()
    assert math.isnan(ck.ranks_in_brackets(v, w, np.array([ck.whole_rank(total, 50.0)]), total)[0])
    rep_half = 0.9  # the 0.5s weigh about n/stride of some n·1000
    assert ck.percentiles_whole(v, w, np.array([50.0]))[0] == rep_half
    assert weighted_percentiles(v, w, (1.0, 50.0)) == [0.9, 0.9]
