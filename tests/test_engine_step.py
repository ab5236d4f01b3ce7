"""Pieces of the compiled engine step (metronome/serving.py) checked on their own."""

import numpy as np
import pytest

from metronome.serving import key_order


@pytest.mark.parametrize("span", [3, 40, 10_000_000], ids=["ties", "counting", "comparison"])
def test_key_order_is_a_stable_ascending_order(span):
    # keys spanning little more than their count take the counting sort, a wide span the comparison sort; both
    # must give numpy's stable order (ties in position order)
    rng = np.random.default_rng(span)
    for n in (1, 2, 7, 300):
        v = rng.integers(1_000, 1_000 + span, n)
        assert key_order(v, n).tolist() == np.argsort(v, kind="stable").tolist()
    wide = np.array([10**7, 0, 10**7, 5, 0, 0, 10**7, 5] * 40)  # ties across a wide span
    assert key_order(wide, wide.size).tolist() == np.argsort(wide, kind="stable").tolist()
    v = np.array([5, 3, 9, 3, 0, 0, 0])  # only the first n count
    assert key_order(v, 4).tolist() == [1, 3, 0, 2]
