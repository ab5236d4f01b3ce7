"""Where a live run's records go: the tables in memory, the journals on disk, the Prometheus export.

The driver decides what a row says (its rules); this sink only keeps it. It is the live side of the one
records interface the front end writes through (docs/front-end.md, step (b)): the simulator's tables keep one
row per tick and moment, this sink one row per frame, step, session and event, in the schema of
:mod:`metronome.results`.

Rows are journaled off the timing path (:class:`metronome.probe.records.Journal`, deferred): the driver calls
:meth:`LiveSink.flush` when its engine is idle and :meth:`LiveSink.flush_due` tells it when an engine that is
never idle has gone ``FLUSH_EVERY_S`` without one, so a crash or Ctrl-C keeps what was measured and no file
I/O sits between two steps of a frame.
"""

from __future__ import annotations

from pathlib import Path

from metronome.probe.metrics import LiveMetrics
from metronome.probe.records import Journal

TABLES = ("frames", "steps", "sessions", "events")
FLUSH_EVERY_S = 1.0  # an engine that is never idle still gets its rows on disk this often


class LiveSink:
    """The records of one live run. ``retain=False``: rows go only to the journals (with ``out_dir``) while the
    run lasts, so a long run's memory stays flat; :meth:`close` reads them back for the summary."""

    def __init__(self, run: str, out_dir: str | Path | None = None, retain: bool = True,
                 metrics: LiveMetrics | None = None):
        self.run = run
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.retain = retain  # (neither retained nor journaled: the rows only reach the metrics, as a server's)
        self.metrics = metrics
        self.tables: dict[str, list[dict]] = {t: [] for t in TABLES}
        self._journals: dict[str, Journal] = {}
        self._flushed_at = 0.0  # when the journals were last written (the caller's clock)

    def record(self, table: str, row: dict) -> None:
        row = {"run": self.run, **row}
        if self.retain:
            self.tables[table].append(row)
        if self.out_dir is not None:
            if table not in self._journals:
                self._journals[table] = Journal(self.out_dir, table, deferred=True)
            self._journals[table].append(row)

    def frame(self, row: dict, observed_s: float | None) -> None:
        """A frame's row; ``observed_s``: the latency it counts for (None: censored, not exported)."""
        self.record("frames", row)
        if self.metrics and observed_s is not None:
            self.metrics.frame(observed_s, row["silent"], row["met_deadline"])

    def step(self, row: dict, limit: int | None) -> None:
        """A step's row, exported with the admission limit that held during it."""
        self.record("steps", row)
        if self.metrics:
            self.metrics.step(row, limit)

    def admission(self, controller) -> None:
        if self.metrics:
            self.metrics.admission(controller)

    def entered(self) -> None:
        if self.metrics:
            self.metrics.entered()

    def refused(self, reason: str) -> None:
        if self.metrics:
            self.metrics.refused_for(reason)

    def flush_due(self, now: float) -> bool:
        """A second passed since the last flush (``now`` on the clock :meth:`flush` was given)."""
        return now - self._flushed_at >= FLUSH_EVERY_S

    def flush(self, now: float) -> None:
        """Write the journals' pending rows (when the engine is idle, and at least every FLUSH_EVERY_S)."""
        for j in self._journals.values():
            j.flush()
        self._flushed_at = now

    def close(self) -> None:
        """Close the journals and the export; without ``retain``, read the run's rows back into the tables."""
        for j in self._journals.values():
            j.close()
        if self.metrics:
            self.metrics.close()
        if not self.retain:
            for table, j in self._journals.items():
                self.tables[table].extend(j.read_own())
