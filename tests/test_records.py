"""Sample journals (metronome.probe.records): plain ones write each row at once; deferred ones (the real-time
driver's) hold rows until flush, close or read_own, and then write them all, in order, as complete lines."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.probe.records import Journal, read_journal


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_plain_journal_writes_each_row_as_it_is_appended(tmp_path):
    j = Journal(tmp_path, "frames")
    j.append({"frame": 0})
    assert _lines(j.path) == [{"frame": 0}] and j.pending == 0
    j.flush()  # nothing pending: a no-op
    j.append({"frame": 1})
    assert _lines(j.path) == [{"frame": 0}, {"frame": 1}]
    j.close()


def test_a_deferred_journal_writes_nothing_until_flushed(tmp_path):
    j = Journal(tmp_path, "frames", deferred=True)
    j.append({"frame": 0, "latency_s": 0.01})
    j.append({"frame": 1, "latency_s": None})
    assert j.path.read_text() == "" and j.pending == 2
    j.flush()
    assert _lines(j.path) == [{"frame": 0, "latency_s": 0.01}, {"frame": 1, "latency_s": None}] and j.pending == 0
    j.append({"frame": 2})
    assert len(_lines(j.path)) == 2  # held again until the next flush
    j.close()  # close flushes
    assert [r["frame"] for r in read_journal(j.path)] == [0, 1, 2]


def test_read_own_flushes_and_returns_only_this_writers_rows(tmp_path):
    first = Journal(tmp_path, "steps")
    first.append({"step": "earlier run"})
    first.close()
    j = Journal(tmp_path, "steps", deferred=True)
    j.append({"step": 0})
    j.append({"step": 1})
    assert j.read_own() == [{"step": 0}, {"step": 1}]  # pending rows are written first
    j.close()
    assert j.read_own() == [{"step": 0}, {"step": 1}]
    assert read_journal(j.path) == [{"step": "earlier run"}, {"step": 0}, {"step": 1}]


rows = st.lists(st.dictionaries(st.sampled_from(["a", "b", "c"]),
                                st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                                          st.lists(st.integers(), max_size=3))), max_size=12)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(rows, max_size=5))
def test_deferred_and_plain_journals_write_the_same_file(tmp_path_factory, batches):
    """Whatever the rows and wherever the flushes fall, a deferred journal ends with the same file a plain one does."""
    d = tmp_path_factory.mktemp("j")
    plain, deferred = Journal(d / "plain", "t"), Journal(d / "deferred", "t", deferred=True)
    for batch in batches:
        for r in batch:
            plain.append(r)
            deferred.append(r)
        deferred.flush()
    plain.close()
    deferred.close()
    assert deferred.path.read_text() == plain.path.read_text()
    assert read_journal(deferred.path) == [r for b in batches for r in b]
