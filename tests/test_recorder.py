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


def _big_table(rows: int):
    """A frames table whose storage is the system's pages (each column 4 MB or more: recorder._fresh), ``rows``
    rows written, each row's values its own number."""
    t = frame_table()
    t.reserve(1 << 20)
    t.add(**{c: np.arange(rows) for c in FRAME_COLUMNS})
    return t


def test_pages_mapped_ahead_keep_the_rows_written():
    # 1,001 rows: the last page a column has written is part written, part not; faulting its pages in ahead
    # must leave what they hold
    t = _big_table(1001)
    t.map_ahead(200_000)
    t.map_ahead(300_000)  # (again, further: the pages it mapped already are left as they are)
    want = np.arange(1001)
    for c in FRAME_COLUMNS:
        assert np.array_equal(t.column(c), want), c
    r0 = t.rows
    t.store("tick_s")[r0:r0 + 5000] = np.arange(r0, r0 + 5000)
    t.block[FRAME_BLOCK.index("frames"), r0:r0 + 5000] = np.arange(r0, r0 + 5000)
    t.commit(r0 + 5000)
    t.map_ahead(100_000)  # (from past the rows written since)
    assert np.array_equal(t.column("tick_s"), np.arange(r0 + 5000))
    assert np.array_equal(t.column("frames"), np.arange(r0 + 5000))
    t.reserve(t.capacity)  # grown: new storage, the rows copied into it, its pages mapped ahead from there
    t.map_ahead(10_000)
    assert np.array_equal(t.column("frames"), np.arange(r0 + 5000))


def _faults_writing(a: np.ndarray) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a[:] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_pages_mapped_ahead_are_written_without_a_fault_each():
    from metronome.sim import recorder

    if recorder._POPULATE_WRITE is None:
        pytest.skip("pages are not faulted in ahead on this system (MADV_POPULATE_WRITE is Linux's, 5.14 on)")
    n = 100_000  # 800 kB of a float column: about 200 pages
    plain = _big_table(10)
    faults = _faults_writing(plain.store("tick_s")[10:10 + n])
    if faults < 100:
        pytest.skip(f"the system mapped the pages before they were written ({faults} faults): nothing to tell apart")
    t = _big_table(10)
    t.map_ahead(n, skip=("in_flight",))
    assert _faults_writing(t.store("tick_s")[10:10 + n]) < faults / 10
    assert _faults_writing(t.store("frames")[10:10 + n]) < faults / 10
    # a column skipped (one a writer writes only at times) is mapped as it is written, as before
    assert _faults_writing(t.store("in_flight")[10:10 + n]) > faults / 4


def _flush(answers, *, P_of, phase, deadline_of, shaped, now=1.0, P=0.08):
    """Rows of ``answers`` (tick key, session, tokens) answered at ``now``, as both paths write them."""
    from metronome import serving
    from metronome.sim import recorder

    key, who, tok = (np.array(x, np.int64) for x in zip(*answers))
    n, M = key.size, len(P_of)
    t = frame_table()
    t.reserve(n)
    owners = recorder.Owners(np.full(M, 3, np.int8), np.zeros(M), np.zeros(M, np.int64), np.array(P_of, float),
                             np.array(phase, float), np.array(deadline_of, float))
    clock = recorder.Clock(P, float(serving.phase_offset_s(1, P)), 1e-12, shaped)
    stores = (t.store(c) for c in recorder.FRAME_ROWS)
    t.commit(recorder.flush(now, n, recorder.Answers(key, who, tok, np.empty(n), serving.key_order_work(n)), owners,
                            clock, recorder.FrameRows(*stores), 0, -1))
    return t.frame()[["frame", "tick_s", "frames", "late", "tokens"]], owners.s_late


def test_a_frame_row_is_one_tick_of_each_sessions_own_clock():
    """Sessions on clocks of their own (``Clock.shaped``): each row is one tick of the sessions' own clocks (frame
    f of session i ticks at f·P_i + φ_i), rows in tick order, and a frame is late by its own session's deadline.
    Sessions 0 and 1 are on the run's clock (80 ms, phase slots 0 and 32: φ 0 and 40 ms); session 2 ticks every
    120 ms from 10 ms, session 3 every 120 ms from 10 ms too but with a 20 ms deadline, session 4 every 40 ms."""
    P_of, phase = [0.08, 0.08, 0.12, 0.12, 0.04], [0.0, 0.04, 0.01, 0.01, 0.0]
    deadline_of = [0.08, 0.08, 0.12, 0.02, 0.04]
    k = lambda f, slot: f * 64 + slot  # noqa: E731 (serving.tick_key: the frame and the session's phase slot)
    # answered at 1.0 s: session 0 frame 12 (0.96), session 1 frame 11 (0.92), sessions 2 and 3 frame 8 (0.97),
    # session 4 frames 23 (0.92) and 24 (0.96: the tick of session 0's frame 12, numbered 24 on its clock)
    answers = [(k(24, 0), 4, 1), (k(8, 5), 2, 2), (k(12, 0), 0, 3), (k(11, 32), 1, 0), (k(8, 5), 3, 4),
               (k(23, 0), 4, 5)]
    rows, s_late = _flush(answers, P_of=P_of, phase=phase, deadline_of=deadline_of, shaped=True)
    assert rows.frame.tolist() == [11, 23, 12, 24, 8]
    assert np.allclose(rows.tick_s, [0.92, 0.92, 0.96, 0.96, 0.97], atol=1e-12)
    assert rows.frames.tolist() == [1, 1, 1, 1, 2] and rows.tokens.tolist() == [0, 5, 3, 1, 6]
    # late: latency 80 ms past a 40 ms deadline (session 4's frame 23), 30 ms past 20 ms (session 3; session 2,
    # on the same tick, has 120 ms)
    assert rows.late.tolist() == [0, 1, 0, 0, 1] and s_late.tolist() == [0, 0, 0, 1, 1]


def test_rows_of_the_runs_clock_are_the_same_read_either_way():
    """On the run's clock a tick key names a moment: reading each session's own clock (``shaped``) must give the
    very rows the run's clock gives, bit for bit, deadlines per session included."""
    r = np.random.default_rng(3)
    M, P = 40, 0.08
    slot = r.integers(0, 64, M)
    phase = slot * (P / 64)  # serving.phase_offset_s
    deadline_of = r.choice([0.04, 0.08], M)
    who = r.integers(0, M, 300)
    answers = [(int(r.integers(100, 104)) * 64 + int(slot[i]), int(i), int(r.integers(0, 3))) for i in who]
    a, late_a = _flush(answers, P_of=[P] * M, phase=phase, deadline_of=deadline_of, shaped=False, now=8.3)
    b, late_b = _flush(answers, P_of=[P] * M, phase=phase, deadline_of=deadline_of, shaped=True, now=8.3)
    assert len(a) > 60 and a.late.sum() > 0 and (a.frames > 1).any()
    assert a.equals(b) and (late_a == late_b).all()
