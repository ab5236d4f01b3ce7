"""Pieces of the compiled engine step (metronome/serving.py) checked on their own."""

import numpy as np
import pytest

from metronome.serving import key_order, key_order_in, key_order_work


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


def test_key_order_in_a_reused_buffer_forgets_what_the_last_sort_left():
    # the compiled loop sorts every step's answers in one buffer (flush): whatever the last sort, or anything else,
    # left in it must not reach the next order (counting and merge sorts alternate here: both sort in the buffer)
    rng = np.random.default_rng(7)
    work = key_order_work(300)
    work[:] = 3
    for k, n in enumerate((300, 12, 1, 40, 2, 300, 64)):
        v = rng.integers(50, 50 + (2 * n + 3 if k % 2 else 10**6), n)
        key_order_in(v, n, work)
        assert work[:n].tolist() == np.argsort(v, kind="stable").tolist()
