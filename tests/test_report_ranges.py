"""The report's answer with its interval over the step terms' ranges, one row per serving stack the calibration ships,
and the sensitivity (tornado) chart's data, on the session's shared report (test_report.py: two small-pool Moshi
calibrations, so memory binds). The expected numbers come from the sim layer run here (capacity per stack, the plain
search on calibrations moved by hand), not from the report's own functions."""

from __future__ import annotations

import copy
import json

import pytest

from metronome import calibration
from metronome.kv_policy import KVPolicy
from metronome.sim.capacity import capacity, deadline_n_star
from test_report import answer_rows_from_markdown, html_tables, md_section, md_tables, shared_report

POLICY = KVPolicy.sinks(16, 16, 368)  # the report's bound for Moshi (S=16, W=368)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = shared_report(tmp_path_factory)
    return {"md": (out / "report.md").read_text(), "html": (out / "report.html").read_text(),
            "data": json.loads((out / "report.json").read_text())}


def test_report_json_carries_the_interval_and_a_row_per_stack(report):
    for c in report["data"]["calibrations"]:
        cal = calibration.load(c["spec"])
        assert cal.stacks and len(cal.stacks) >= 2
        assert [s["stack"] for s in c["stacks"]] == list(cal.stacks)
        assert [s["default"] for s in c["stacks"]] == [True] + [False] * (len(cal.stacks) - 1)
        assert [s["answer"] for s in c["stacks"]] == [s == cal.stack for s in cal.stacks]
        for s in c["stacks"]:  # each stack's N* is the sim layer's, with that stack's pricing
            direct = capacity(calibration.load(c["spec"], stack=s["stack"]), POLICY, 0.08, duration_s=120.0)
            assert (s["n_star"], s["deadline_n_star"], s["binding"]) == (
                direct["n_star"], direct["deadline_n_star"], direct["binding"])
        r = c["capacity"]["ranges"]
        assert r == next(s for s in c["stacks"] if s["answer"])["ranges"]
        # the ends: every ranged term at its high, then at its low, searched from one session
        slow_cal, fast_cal = cal, cal
        for t in cal.terms_for(POLICY):
            lo, hi = t.bounds()
            if hi > lo:
                slow_cal, fast_cal = slow_cal.with_term(t.name, hi), fast_cal.with_term(t.name, lo)
        ends = [deadline_n_star(x, POLICY, 0.08, duration_s=120.0)[0] for x in (slow_cal, fast_cal)]
        assert r["deadline_n_star_interval_sessions"] == ends
        ceiling = c["capacity"]["memory_ceiling"]
        assert r["n_star_interval_sessions"] == [min(n, ceiling) for n in ends]


def test_the_headline_and_the_answer_table_carry_the_interval_and_the_stacks(report):
    md, data = report["md"], report["data"]
    answer = md_section(md, "The answer")
    header, rows = answer_rows_from_markdown(md)
    table = {r[0]: r[1:] for r in rows}
    for j, c in enumerate(data["calibrations"]):
        cap, r = c["capacity"], c["capacity"]["ranges"]
        lo, hi = r["deadline_n_star_interval_sessions"]
        # (the small pools bind by memory: the ranges move the deadline-bound N* only)
        assert cap["binding"] == "memory"
        (said,) = [p for p in answer.strip().split("\n\n") if p.startswith(f"One {c['hardware']} carries")]  # its headline
        assert (f"The step terms' ranges move only the deadline-bound N*, {cap['deadline_n_star']:,}: it lies in "
                f"{lo:,}–{hi:,}") in said
        assert f'"{r["dominant_term"]}" moves it most' in said
        assert table["N* over the terms' ranges"][j].startswith(
            f"{cap['n_star']:,} sessions (memory binds; the ranges move the deadline-bound N* over {lo:,}–{hi:,})")
        for s in c["stacks"]:
            label = f"stack {s['stack']}" + (" (default)" if s["default"] else "")
            assert table[label][j].startswith(f"N* = {s['n_star']:,} sessions")
            assert ("the answer above" in table[label][j]) == s["answer"]
            assert s["description"] in table[label][j]
    assert "served by the batched-graphs stack (the default)," in answer
    # the page shows the same table as report.md
    assert [header] + rows in html_tables(report["html"])


def test_when_the_deadline_binds_the_headline_gives_n_stars_interval(report):
    """(A calibration whose deadline binds, built from the shared one: the headline's and the row's words.)"""
    from metronome.report.answer import answer_rows, headline

    c = copy.deepcopy(report["data"]["calibrations"][0])
    cap, r = c["capacity"], c["capacity"]["ranges"]
    lo, hi = r["deadline_n_star_interval_sessions"]
    cap.update(binding="deadline", n_star=cap["deadline_n_star"], memory_ceiling=10 * hi)
    r["n_star_interval_sessions"] = [lo, hi]
    words = headline(c)
    assert f"carries {cap['n_star']:,} concurrent Moshi 7B sessions" in words
    assert f"Over the step terms' ranges N* lies in {lo:,}–{hi:,} (every term at its slow end, then at its fast end)" \
        in words
    row = dict(answer_rows(c))["N* over the terms' ranges"]
    assert row.startswith(f"{lo:,}–{hi:,} sessions (every ranged step term at its slow end · at its fast end); "
                          f"moved most by \"{r['dominant_term']}\"")


def test_the_tornado_table_and_figure_carry_each_terms_n_star_at_its_low_and_high(report):
    from metronome.report.figures import tornado

    md, data = report["md"], report["data"]
    answer = md_section(md, "The answer")
    tables = [t for t in md_tables(answer) if t[0][0] == "term"]
    assert len(tables) == len(data["calibrations"])
    fig = tornado(data)
    bars = [t for t in fig.data if t.type == "bar"]
    for c, table, (low, high) in zip(data["calibrations"], tables, zip(bars[::2], bars[1::2])):
        r = c["capacity"]["ranges"]
        cal = calibration.load(c["spec"])
        central = r["deadline_n_star_sessions"]
        assert [row[0] for row in table[1:]] == [b["term"] for b in r["tornado"]]
        top = r["tornado"][0]  # the widest bar: its two N* by the plain search
        t = next(t for t in cal.terms_for(POLICY) if t.name == top["term"])
        want = [deadline_n_star(cal.with_term(t.name, v), POLICY, 0.08, duration_s=120.0)[0] for v in t.bounds()]
        assert table[1][4:6] == [f"{n:,}" for n in want]
        # the figure: bars from the central N* to each term's N* at its low (first trace) and high (second)
        n = len(low.y)
        assert low.base == high.base == central
        assert [central + x for x in low.x] == [b["deadline_n_star_at_low_sessions"] for b in r["tornado"][:n]]
        assert [central + x for x in high.x] == [b["deadline_n_star_at_high_sessions"] for b in r["tornado"][:n]]
        assert [central + x for x in low.x][0] == want[0] and [central + x for x in high.x][0] == want[1]
    assert 'data-figure="tornado"' in report["html"]


def test_the_tornados_title_says_when_memory_caps_the_interval():
    """The chart's interval is the deadline-bound N*'s; the headline's is N*'s, capped by the memory ceiling. When the
    fast end passes the ceiling (Moshi on an H200: 121–520 against 512), the title says that memory caps N* there,
    so the two figures do not seem to disagree; when it does not, it says nothing of it."""
    from metronome.report.figures import tornado

    def cal(name, interval, ceiling):
        bar = {"term": "a term", "basis": "estimated", "value_s": 1e-5, "low_s": 5e-6, "high_s": 2e-5,
               "unit": "s per sequence", "deadline_n_star_at_low_sessions": interval[1],
               "deadline_n_star_at_high_sessions": interval[0]}
        return {"name": name, "capacity": {"ranges": {
            "tornado": [bar], "deadline_n_star_sessions": 264, "deadline_n_star_interval_sessions": list(interval),
            "memory_ceiling_sessions": ceiling}}}

    fig = tornado({"calibrations": [cal("capped", (121, 520), 512), cal("free", (121, 400), 512)]})
    titles = [a.text for a in fig.layout.annotations if "deadline-bound N*" in a.text]
    assert len(titles) == 2
    assert "every term at once: 121–520 (shaded) · memory caps N* at 512" in titles[0]
    assert titles[1].endswith("every term at once: 121–400 (shaded)")
