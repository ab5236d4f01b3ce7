"""Metrics, recorded once: per engine step, per frame tick, per session.

Rows are written in place: each table's columns live in storage that grows by doubling, and a writer (the
compiled loop, or a step of the step-by-step path) writes its rows straight after the last. A run's frames table
is millions of rows, and writing them into per-call chunks and joining those at the end touched every row
three times.
"""

from __future__ import annotations

import mmap
import sys
from collections import namedtuple

import numba as nb
import numpy as np
import pandas as pd

from metronome import compiled, front_rules, results, serving
from metronome.front_rules import ENDED
from metronome.results import weighted_percentile
from metronome.serving import PHASE_SLOTS, key_order_in, merge_order

compiled.indexes_never_negative(__name__)  # (before anything of this module is compiled)

STEP_COLUMNS = (
    "t_s", "step_s", "batch", "new_tokens", "context_tokens", "resident_blocks", "free_blocks",
    "tokens_out", "frames_done", "silent_frames", "preemptions", "running", "waiting",
)
# silent_preempted, silent_waiting, silent_departed: the silent frames by what they are (metronome.results)
FRAME_COLUMNS = ("frame", "tick_s", "done_s", "latency_s", "frames", "silent", "silent_preempted", "silent_waiting",
                 "silent_departed", "late", "tokens")
# the integer columns, kept as the rows of one array (Table.block: the table grows by one allocation) and written
# through a view of each, by name (Rows); "in_flight" is the writer's own: what a controller deciding in Python is
# told with a frame row, no column of the table, and written only for one (a row of storage never written costs
# nothing)
STEP_BLOCK = ("batch", "new_tokens", "context_tokens", "resident_blocks", "tokens_out", "frames_done", "running",
              "waiting", "silent_frames", "free_blocks", "preemptions")
FRAME_BLOCK = ("frames", "late", "tokens", "silent", "silent_preempted", "silent_waiting", "silent_departed",
               "in_flight")


# the steps and frames tables' storage as a writer writes it (each column by its name, a view of the table's own:
# SimEngine._rows), from the given rows on: a step's start and latency and its integer columns, and the frame
# rows' (FrameRows: a frame row's frame, tick, answer and latency and its integer columns)
FrameRows = namedtuple("FrameRows", ("fr_f", "fr_tick", "fr_done", "fr_lat", *FRAME_BLOCK))
Rows = namedtuple("Rows", ("st_t", "st_lat", *STEP_BLOCK, "fr"))
FRAME_ROWS = ("frame", "tick_s", "done_s", "latency_s", *FRAME_BLOCK)  # (its columns, in FrameRows' order)
# flush's arguments, from both paths: the compiled loop hands it these records too, made of its own arrays, so that
# numba compiles flush once for both (each record of other fields would be another compile of it, seconds each)
Answers = namedtuple("Answers", "key who tok at work")
Owners = namedtuple("Owners", "state s_admitted s_late P_of phase deadline_of")
Clock = namedtuple("Clock", "P Pq eps shaped")
# what a silent frame is, compiled from its one statement into the writer (spliced: its body joins the caller's)
_silent_cause = nb.njit(cache=True, inline="always")(results.silent_cause)


@compiled.inlined
def flush(now, n, ans, ss, c, rows, nrows, in_flight):
    """``n`` answers (``ans``, :data:`Answers`: tick key, session, tokens got) become one row per tick (and frame
    number, for sessions on clocks of their own) of ``rows`` (:data:`FrameRows`), in tick order, all answered at
    ``now`` with ``in_flight`` sessions in flight (-1: nobody reads it, not written); a frame late for its
    session's deadline counts against it (``ss.s_late``), a silent one is counted by what it is
    (results.silent_cause: a session that ended now was answered at its departure). Both paths record their rows
    with it, with the same records (``ss`` the sessions' :data:`Owners`, ``c`` the frame :data:`Clock`). Returns
    the rows written so far."""
    if n == 0:
        return nrows
    keys, who, shaped = ans.key, ans.who, c.shaped
    # rows are sums over a tick: the order within one does not matter
    key_order_in(keys, n, ans.work)
    order = ans.work[:n]
    if shaped:  # (by each session's own tick, then by key)
        _tick_order(n, keys, who, ans.at, ans.work, ss.P_of, ss.phase)
        order = ans.work[2 * n:3 * n]
    j = np.int64(0)  # (not a literal 0: _row would be compiled for it too)
    while j < n:
        key = keys[order[j]]
        f = key // PHASE_SLOTS
        e = j + 1
        if shaped:  # (a session's own tick: the run's, f·P + slot·Pq, for one on the run's clock)
            i = who[order[j]]
            tick = serving.frame_tick(f, ss.P_of[i], ss.phase[i])
            while (e < n and keys[order[e]] // PHASE_SLOTS == f
                   and serving.frame_tick(f, ss.P_of[who[order[e]]], ss.phase[who[order[e]]]) == tick):
                e += 1
        else:
            tick = serving.frame_tick(f, c.P, (key % PHASE_SLOTS) * c.Pq)
            while e < n and keys[order[e]] == key:
                e += 1
        nrows = _row(now, (f, tick), (order, j, e), ans, ss, rows, nrows, in_flight, c.eps)
        j = e
    return nrows


@compiled.counted  # (its slices are views: code without numba's reference counting makes none)
def _tick_order(n, keys, who, at, work, P_of, phase):
    """The order of ``n`` answers (tick ``keys``, sessions ``who``) by their session's own tick, then by tick key
    (``work[2n:3n]``), when sessions tick on clocks of their own (``Clock.shaped``: a tick key then names a frame
    and a phase slot, not a moment). ``work[:n]`` holds their order by tick key (serving.key_order_in). It takes
    arrays, not the records they come in: a function compiled apart unpacks every array of a record it is given."""
    for q in range(n):
        a = work[q]
        i = who[a]
        at[q] = serving.frame_tick(keys[a] // PHASE_SLOTS, P_of[i], phase[i])
    merge_order(at, n, work[n:])  # (stable: in a tick, by key, so a frame number's answers lie together)
    for q in range(n):
        work[2 * n + q] = work[work[n + q]]


@compiled.inlined
def _row(now, frame_tick, members, ans, ss, rows, nrows, in_flight, eps):
    """Row ``nrows``: the answers ``members`` (``order[j:e]``: their positions in ``ans``) of frame f's tick
    (``frame_tick``: f and the tick), answered at ``now``. Returns the next row."""
    f, tick = frame_tick
    order, j, e = members
    who, toks, state, s_admitted = ans.who, ans.tok, ss.state, ss.s_admitted
    s_late, deadline_of = ss.s_late, ss.deadline_of
    latency = now - tick
    tk = pre = wait = dep = late = 0
    for q in range(j, e):
        i = who[order[q]]
        tok = toks[order[q]]
        tk += tok
        if serving.frame_is_silent(tok):
            cause = _silent_cause(tok, state[i] == ENDED, tick, s_admitted[i])
            if cause == results.SILENT_PREEMPTED:
                pre += 1
            elif cause == results.SILENT_WAITING:
                wait += 1
            else:
                dep += 1
        if latency > deadline_of[i] + eps:
            s_late[i] += 1
            late += 1
    rows.fr_f[nrows], rows.fr_tick[nrows], rows.fr_done[nrows], rows.fr_lat[nrows] = f, tick, now, latency
    rows.frames[nrows], rows.late[nrows], rows.tokens[nrows] = e - j, late, tk
    rows.silent[nrows], rows.silent_preempted[nrows] = pre + wait + dep, pre
    rows.silent_waiting[nrows], rows.silent_departed[nrows] = wait, dep
    if in_flight >= 0:
        rows.in_flight[nrows] = in_flight
    return nrows + 1


def _fresh(shape, dtype) -> np.ndarray:
    """Room for a table's storage, mapped page by page as it is first written (or as :meth:`Table.map_ahead` asks),
    private to the process and without numpy's request for huge pages. numpy asks the kernel for huge pages on every
    array of 4 MB or more (``madvise(MADV_HUGEPAGE)``), and under the kernels' usual setting (``defrag`` =
    ``madvise``) the first write to such a region waits while the kernel compacts memory into huge pages. A run
    writes its frames table once, row after row (126 MB in a realistic hour of Moshi): on a host whose memory is
    fragmented that wait was a third of the run (system time 0.1 s without the request, 0.4-0.5 s with it, the
    loop's own time the same), and it varied from one process to the next. Plain anonymous memory gets what the
    system gives without asking (huge pages where the setting is ``always`` and they are free), and never that
    wait. Private, not the mmap module's default of shared: a shared page is the kernel's shared memory, and its
    first write cost half as much again (docs/benchmarks.md)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    if n < (4 << 20):  # (numpy's threshold: below it, numpy's own allocation asks nothing either)
        return np.empty(shape, dtype=dtype)
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        m = mmap.mmap(-1, n)
    return np.frombuffer(m, dtype=dtype).reshape(shape)


# madvise(MADV_POPULATE_WRITE) (Linux 5.14 on): the pages of a range faulted in, writable, in one call, as writes
# would fault them one by one; what they hold is left as it is. The mmap module names it from Python 3.13 on.
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def _populate(a: np.ndarray, lo: int, hi: int) -> None:
    """The pages of ``a[lo:hi]`` faulted in now, ``a`` a view of storage :func:`_fresh` mapped itself (else
    nothing is done). Why: each first write to a page is a fault (on this project's VM 2-4 µs: 36,000 of them in a
    realistic hour, a fifth of its run), and one call for a span's pages costs about two thirds as much
    (docs/benchmarks.md)."""
    global _POPULATE_WRITE
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    m = root.base.obj if isinstance(root.base, memoryview) else None
    if _POPULATE_WRITE is None or not isinstance(m, mmap.mmap):
        return
    start = (a.ctypes.data + lo * a.itemsize - root.ctypes.data) // mmap.PAGESIZE * mmap.PAGESIZE
    end = a.ctypes.data + hi * a.itemsize - root.ctypes.data
    try:
        m.madvise(_POPULATE_WRITE, start, end - start)
    except OSError:  # (a kernel before 5.14: the pages fault as they are written, as before)
        _POPULATE_WRITE = None


class Table:
    """Columns of one dtype each; those named in ``block`` (of ``block_dtype``) are the rows of one 2-D array, so
    that a compiled writer takes them as one argument. :meth:`reserve` makes room, a writer writes rows ``rows`` on
    into :attr:`block` and :meth:`store`, and :meth:`commit` says how far it got."""

    def __init__(self, columns, dtypes, block=(), capacity: int = 1024, block_dtype=np.int64):
        self.columns = tuple(columns)
        self.dtypes = dtypes
        self.block_names = tuple(block)
        self._row_of = {c: j for j, c in enumerate(self.block_names)}
        self.capacity = capacity
        self.block = _fresh((len(self.block_names), capacity), block_dtype)
        self._own = {c: _fresh(capacity, dtypes[c]) for c in self.columns if c not in self._row_of}
        self.rows = 0
        self._ready = 0  # rows whose pages are mapped already (map_ahead)

    def store(self, c) -> np.ndarray:
        """Column ``c``'s whole storage (``capacity`` rows, those from ``rows`` on not yet written)."""
        j = self._row_of.get(c)
        return self.block[j] if j is not None else self._own[c]

    def reserve(self, n: int, expect: int = 0) -> None:
        """Room for ``n`` more rows, and for ``expect`` rows in all if it has to grow. Growing copies the rows
        written into new storage (arrays taken from the old one before, such as a :meth:`frame`, keep what they
        had). Room costs nothing until written (the system maps pages as they are first touched), copying does: a
        writer that can tell how many rows a run will have says so."""
        need = self.rows + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, expect)
        block = _fresh((len(self.block_names), cap), self.block.dtype)
        block[:, :self.rows] = self.block[:, :self.rows]
        self.block = block
        for c, old in self._own.items():
            new = _fresh(cap, old.dtype)
            new[:self.rows] = old[:self.rows]
            self._own[c] = new
        self.capacity = cap
        self._ready = self.rows

    def map_ahead(self, n: int, skip=()) -> None:
        """The pages of the next ``n`` rows (within the room :meth:`reserve` made) faulted in now, one call per column
        (:func:`_populate`), but for the columns in ``skip`` (a writer writes them only at times). A writer
        that knows about how many rows it will write calls it first; rows past those fault as they are written."""
        lo, hi = max(self.rows, self._ready), min(self.capacity, self.rows + n)
        if _POPULATE_WRITE is None or hi <= lo:
            return
        for c in self.columns + tuple(c for c in self.block_names if c not in self.columns):
            if c not in skip:
                _populate(self.store(c), lo, hi)
        self._ready = hi

    def commit(self, rows: int) -> None:
        """A writer wrote up to row ``rows`` (exclusive)."""
        if not self.rows <= rows <= self.capacity:
            raise ValueError(f"commit({rows}): the table has {self.rows} rows and room for {self.capacity}")
        self.rows = rows

    def add(self, **cols) -> None:
        """Append rows: every column's values (scalars are broadcast over the longest)."""
        vals = [np.atleast_1d(np.asarray(cols[c], dtype=self.dtypes[c])) for c in self.columns]
        lengths = {len(v) for v in vals} - {1}
        if len(lengths) > 1:
            raise ValueError(f"add: columns of {sorted(lengths)} rows")
        n = lengths.pop() if lengths else 1
        self.reserve(n)
        r = self.rows
        for c, v in zip(self.columns, vals):
            self.store(c)[r:r + n] = v
        self.rows = r + n

    def column(self, c) -> np.ndarray:
        """Column ``c``'s rows (a view: later rows do not show in it)."""
        return self.store(c)[:self.rows]

    def frame(self) -> pd.DataFrame:
        # views of the storage: the frame takes them as they are, one block each, rather than copying millions of
        # rows into one block per dtype
        return pd.DataFrame({c: self.column(c) for c in self.columns}, copy=False)


def step_table() -> Table:
    dt = {c: np.int64 for c in STEP_COLUMNS}
    dt["t_s"] = dt["step_s"] = np.float64
    return Table(STEP_COLUMNS, dt, STEP_BLOCK)


def frame_table() -> Table:
    """The frames table. Its counts and frame indices are int32 (a row's counts are one tick's sessions; a frame
    index reaches 2**31 after five years of 80 ms frames): a run writes the table once, row after row (1.9 M rows
    in a realistic hour of Moshi), every new page of it a page fault, and the rows are 48 bytes instead of 80."""
    dt = {c: np.int32 for c in FRAME_COLUMNS}
    dt["tick_s"] = dt["done_s"] = dt["latency_s"] = np.float64
    return Table(FRAME_COLUMNS, dt, FRAME_BLOCK, block_dtype=np.int32)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """Nearest-rank quantile (q in (0, 1]) of ``values`` where value ``i`` occurs ``weights[i]`` times.

    The one percentile every report uses (:func:`metronome.results.weighted_percentile`)."""
    return weighted_percentile(values, weights, 100.0 * q)


# what flush compiles in from other modules (its cache is guarded against their changes, as the loop's is)
ROWS_PARTS = (serving, results.silent_cause, front_rules)
ROWS_FORM = compiled.guard(flush, ROWS_PARTS)
