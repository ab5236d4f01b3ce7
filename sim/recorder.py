"""Metrics, recorded once: per engine step, per frame tick, per session.

Steps and frame ticks arrive in chunks (one row from a single step, many rows from a fast-forwarded
span), so each table is a list of column chunks concatenated at the end.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from metronome.results import weighted_percentile

STEP_COLUMNS = (
    "t_s", "step_s", "batch", "new_tokens", "context_tokens", "resident_blocks", "free_blocks",
    "tokens_out", "frames_done", "silent_frames", "preemptions", "running", "waiting",
)
FRAME_COLUMNS = ("frame", "tick_s", "done_s", "latency_s", "frames", "silent", "silent_preempted", "late", "tokens")


class Table:
    def __init__(self, columns, dtypes):
        self.columns = columns
        self.dtypes = dtypes
        self.chunks: dict[str, list[np.ndarray]] = {c: [] for c in columns}
        self.rows = 0

    def add(self, **cols):
        n = None
        for c in self.columns:
            v = np.atleast_1d(np.asarray(cols[c], dtype=self.dtypes[c]))
            if n is None:
                n = len(v)
            elif len(v) != n:  # scalars broadcast over the chunk
                v = np.broadcast_to(v, (n,)).copy() if len(v) == 1 else v
            self.chunks[c].append(v)
        self.rows += n or 0

    def column(self, c) -> np.ndarray:
        ch = self.chunks[c]
        return np.concatenate(ch) if ch else np.zeros(0, dtype=self.dtypes[c])

    def frame(self) -> pd.DataFrame:
        # the columns are new arrays (concatenated): the frame takes them as they are, one block each, rather
        # than copying millions of rows into one block per dtype
        return pd.DataFrame({c: self.column(c) for c in self.columns}, copy=False)


def step_table() -> Table:
    dt = {c: np.int64 for c in STEP_COLUMNS}
    dt["t_s"] = dt["step_s"] = np.float64
    return Table(STEP_COLUMNS, dt)


def frame_table() -> Table:
    dt = {c: np.int64 for c in FRAME_COLUMNS}
    dt["tick_s"] = dt["done_s"] = dt["latency_s"] = np.float64
    return Table(FRAME_COLUMNS, dt)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """Nearest-rank quantile (q in (0, 1]) of ``values`` where value ``i`` occurs ``weights[i]`` times.

    The one percentile every report uses (:func:`metronome.results.weighted_percentile`)."""
    return weighted_percentile(values, weights, 100.0 * q)
