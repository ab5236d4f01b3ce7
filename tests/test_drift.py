"""validate's measure of the host (probe/drift.py): how much slower the engine runs after the live runs than when
it was calibrated, steps against steps at the calibration's own points, and when that makes a comparison invalid.
No engine: the two references are rows as measure_point writes them."""

import math

import pandas as pd
import pytest

from metronome import calibration as cal_mod
from metronome.probe import drift


def rows(key: str, kind: str, times) -> list[dict]:
    return [{"phase": key, "kind": kind, "step_s": t} for t in times]


BEFORE = pd.DataFrame(rows("grid N=1 C=64", "prefill", [0.010, 0.012, 0.011])
                      + rows("grid N=1 C=64", "decode", [0.004, 0.004, 0.005])
                      + rows("grid N=8 C=512", "prefill", [0.100, 0.100, 0.100])
                      + rows("grid N=8 C=512", "decode", [0.020, 0.021, 0.019])
                      + rows("grid N=8 C=512", "chunk", [0.5])  # (chunks are not repeated: no ratio)
                        + rows("paced N=2", "decode", [0.001]))


def test_the_ratio_is_steps_against_steps_at_the_same_point_and_kind():
    # medians: prefill 0.011 -> 0.0132 (1.2), decode 0.004 -> 0.005 (1.25), 0.1 -> 0.13 (1.3), 0.02 -> 0.022 (1.1);
    # their median: (1.2 + 1.25) / 2
    ref = pd.DataFrame(rows("grid N=1 C=64", "prefill", [0.0132]) + rows("grid N=1 C=64", "decode", [0.005, 0.005])
                         + rows("grid N=8 C=512", "prefill", [0.13]) + rows("grid N=8 C=512", "decode", [0.022])
                         + rows("grid N=8 C=512", "chunk", [5.0]))
    assert drift.speed_ratio(ref, BEFORE) == pytest.approx(1.225)
    assert drift.speed_ratio(pd.DataFrame(rows("grid N=2 C=9", "decode", [1.0])), BEFORE) is None  # nothing shared


def test_the_reference_repeats_the_smallest_and_the_largest_point():
    assert drift.reference_points([[4, 128], [1, 64], [8, 512], [1, 512]]) == [(1, 64), (8, 512)]
    assert drift.reference_points([[2, 64]]) == [(2, 64)]


def test_past_ten_percent_the_comparison_is_not_valid():
    ok = drift.assess(0.92)
    assert ok["valid"] and ok["reason"] is None
    assert (ok["drift"], ok["factor"]) == pytest.approx((-0.08, 0.96))  # the mean speed over the runs
    slow = drift.assess(1.34)
    assert not slow["valid"] and "+34%" in slow["reason"]
    assert not drift.assess(0.89)["valid"] and drift.assess(1.09)["valid"]
    assert drift.assess(None)["valid"] is False


def test_a_scaled_step_model_is_the_same_engine_that_much_slower():
    from dataclasses import replace

    lat = replace(cal_mod.load("moshi-7b-h200").step_latency, frame_first_s=0.002)  # (the preset has none)
    s = lat.scaled(1.5)
    for b, ctx, new in ((1, 100, 1), (64, 50_000, 64), (200, 1_000_000, 3_000)):
        assert s.step_s(b, ctx, new) == pytest.approx(1.5 * lat.step_s(b, ctx, new))
    assert s.frame_first_s == pytest.approx(1.5 * lat.frame_first_s) and s.jitter == lat.jitter
    assert sum(t.value for t in s.terms) == pytest.approx(1.5 * sum(t.value for t in lat.terms))
    with pytest.raises(ValueError):
        lat.scaled(math.nan)
