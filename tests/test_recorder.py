"""The simulator's tables (sim/recorder.py): rows written in place into storage that grows, by a compiled writer
or by ``add``, read back as they were written."""

import os

import numpy as np
import pytest

from metronome.sim.recorder import FRAME_BLOCK, FRAME_COLUMNS, Table, frame_table


def test_rows_survive_growth_and_earlier_views_keep_what_they_had():
    t = Table(("a", "x", "y"), {"a": np.float64, "x": np.int64, "y": np.int64}, block=("x", "y", "scratch"),
              capacity=2)
    t.add(a=[0.5, 1.5], x=[1, 2], y=7)  # a scalar is broadcast over the rows
    before = t.frame()
    t.add(a=2.5, x=3, y=8)  # past the capacity: the storage grows
    assert t.capacity >= 3 and t.rows == 3
    assert t.column("a").tolist() == [0.5, 1.5, 2.5]
    assert t.column("x").tolist() == [1, 2, 3] and t.column("y").tolist() == [7, 7, 8]
    assert before["x"].tolist() == [1, 2] and before["y"].tolist() == [7, 7]
    assert list(t.frame().columns) == ["a", "x", "y"]  # the block's scratch row is no column


def test_a_writer_writes_after_the_last_row_and_commits():
    t = frame_table()
    t.add(**{c: 1 for c in FRAME_COLUMNS})
    t.reserve(2000, expect=5000)  # (past its first capacity)
    assert t.capacity == 5000  # growing, it makes the room it is told the run will need
    r0 = t.rows
    t.store("tick_s")[r0:r0 + 2] = [0.08, 0.16]
    t.block[FRAME_BLOCK.index("frames"), r0:r0 + 2] = [4, 5]
    t.commit(r0 + 2)
    assert t.column("tick_s").tolist() == [1.0, 0.08, 0.16] and t.column("frames").tolist() == [1, 4, 5]
    with pytest.raises(ValueError, match="commit"):
        t.commit(1)  # rows are never taken back
    with pytest.raises(ValueError, match="commit"):
        t.commit(t.capacity + 1)
    with pytest.raises(ValueError, match="rows"):
        t.add(**{c: [1, 2] if c == "frame" else [1, 2, 3] if c == "tokens" else 0 for c in FRAME_COLUMNS})


def _vm_flags(a: np.ndarray) -> set[str]:
    """The kernel's flags for the mappings that hold ``a`` (/proc/self/smaps; numpy's advice splits a mapping at
    the huge pages' boundaries, so one array may span several)."""
    lo_a = a.__array_interface__["data"][0]
    hi_a = lo_a + a.nbytes
    flags, inside = set(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < hi_a and lo_a < hi
            elif inside and head == "VmFlags:":
                flags.update(line.split()[1:])
    assert flags, "no mapping holds the array"
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc tells a mapping's flags")
def test_a_large_table_does_not_ask_for_huge_pages():
    # numpy advises huge pages (VmFlags "hg") for arrays of 4 MB or more, and the first write into such memory
    # can wait on the kernel compacting memory (sim/recorder.py _fresh). A table's storage must not ask.
    plain = np.empty(1 << 20)  # 8 MB through numpy's own allocation
    if "hg" not in _vm_flags(plain):
        pytest.skip("numpy asks for no huge pages on this kernel: nothing to tell apart")
    t = frame_table()
    t.reserve(1 << 20)
    for c in FRAME_COLUMNS:
        assert "hg" not in _vm_flags(t.store(c)), c
    t.add(**{c: 1 for c in FRAME_COLUMNS})  # the storage is written as any other
    assert t.column("tick_s").tolist() == [1.0]
