"""metronome-sim report: the answer first, the same numbers in report.md and report.html, both
calibrations side by side, and one-line failures that write nothing.

One report is built per test session (two small-pool Moshi calibrations given as files, so it takes
seconds) and shared with test_report_browser.py.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest

from metronome.report.answer import fleet_hours_table
from sim_cli_helpers import run_cli

SMALL = {"small-h200": ("moshi-7b-h200", 2000), "small-b200": ("moshi-7b-b200", 2600)}
# an evening of three hours (2, then 6, then 2 sessions/s) for the "How many GPUs" section; small-h200 priced
OFFERED = "3600:2,3600:6,3600:2"
H200_PRICE = 3.5
# --mc-edge-runs 4: the band's edge is refined (to 4 runs a cell, not the default 20) and the build stays short
ARGS = ["--session-duration", "exp:120", "--mc-runs", "2", "--mc-edge-runs", "4", "--workers", "2", "--offered-load", OFFERED,
        "--gpu-price", f"small-h200={H200_PRICE:g}"]


def _write_small_calibrations(folder: Path) -> list[Path]:
    from metronome import calibration

    paths = []
    for name, (preset, blocks) in SMALL.items():
        cal = calibration.load(preset)
        cal = replace(cal, name=name, engine=replace(cal.engine, num_blocks=blocks))
        p = folder / f"{name}.json"
        p.write_text(cal.to_json())
        paths.append(p)
    return paths


LIVE_SUMMARY = {
    "model": "tiny",
    "policies": {
        "unbounded": {"t_sat_observed_s": 4.1, "t_sat_predicted_s": 4.0, "silent_frame_fraction": 0.31,
                      "p50_frame_latency_s": {"live": 0.020, "simulated": 0.021},
                      "p99_frame_latency_s": {"live": 0.050, "simulated": 0.045}},
        "window": {"t_sat_observed_s": None, "t_sat_predicted_s": None,
                   "p50_frame_latency_live_s": 0.018, "p50_frame_latency_sim_s": 0.0175,
                   "p99_frame_latency_live_s": 0.030, "p99_frame_latency_sim_s": 0.033},
    },
}


def shared_report(tmp_path_factory) -> Path:
    """Build the session's report once (as a user would: the CLI in a subprocess) and return its folder."""
    base = tmp_path_factory.getbasetemp() / "shared-report"
    out = base / "out"
    if (out / "report.html").exists():
        return out
    base.mkdir(exist_ok=True)
    cals = _write_small_calibrations(base)
    live = base / "validate"
    live.mkdir(exist_ok=True)
    (live / "summary.json").write_text(json.dumps(LIVE_SUMMARY))
    r = run_cli("report", "--calibration", str(cals[0]), "--calibration", str(cals[1]), *ARGS,
                "--live", str(live), "--out", str(out))
    assert r.returncode == 0, r.stderr
    (base / "stdout.txt").write_text(r.stdout)
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = shared_report(tmp_path_factory)
    return {"out": out, "md": (out / "report.md").read_text(), "html": (out / "report.html").read_text(),
            "data": json.loads((out / "report.json").read_text()),
            "stdout": (out.parent / "stdout.txt").read_text()}


# ------------------------------------------------------------------------------------------ parsing
def md_tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table as a list of rows (header first, the --- line dropped)."""
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= {"-"} and c for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def md_section(md: str, title: str) -> str:
    """The text of report.md's section ``title`` (its number varies: "How many GPUs" comes and goes)."""
    return re.split(r"\n## \d+\. " + re.escape(title) + r"\n", md, maxsplit=1)[1].split("\n## ", 1)[0]


def answer_rows_from_markdown(md: str) -> tuple[list[str], list[list[str]]]:
    """The answer table of report.md: header and rows."""
    section = md_section(md, "The answer")
    t = md_tables(section)[0]
    return t[0], t[1:]


class _Tables(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self._cell, self._row = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def html_tables(page: str) -> list[list[list[str]]]:
    p = _Tables()
    p.feed(page)
    return p.tables


# ------------------------------------------------------------------------------------------ the files
def test_report_writes_a_self_contained_page_and_markdown(report):
    out, page = report["out"], report["html"]
    assert sorted(p.name for p in out.iterdir()) == [".metronome.json", "report.html", "report.json", "report.md"]
    assert (out / "report.html").stat().st_size < 10e6
    assert page.count("Plotly.newPlot(") == 6  # six figures (with "How many GPUs" and the tornado) ...
    assert len(re.findall(r"plotly\.js v\d", page)) == 1  # ... drawn by one inlined copy of plotly.js
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", page), "the page must open offline"
    for sid in ("answer", "gpus", "fill", "metastability", "signal", "admission", "fidelity", "provenance"):
        assert f'<section id="{sid}">' in page
    md = report["md"]
    for n, title in enumerate(("The answer", "How many GPUs", "Pool fill", "Metastability", "The signal", "Admission",
                               "Fidelity", "Provenance"), start=1):
        assert f"## {n}. {title}" in md and f"<h2>{n}. {title}</h2>" in page


def test_long_work_shows_progress(report):
    for phase in ("capacity", "tuning AIMD", "simulating"):
        assert phase in report["stdout"]
    assert "wrote" in report["stdout"] and "report.html" in report["stdout"]


def test_markdown_and_html_carry_the_same_numbers(report):
    md, page = md_tables(report["md"]), html_tables(report["html"])
    assert len(md) >= 10
    for t in md:
        assert t in page, f"a report.md table is not in report.html: {t[:2]}"


def test_the_answer_comes_first_in_plain_words(report):
    md, data = report["md"], report["data"]
    answer = md_section(md, "The answer")
    for c in data["calibrations"]:
        n = c["capacity"]["n_star"]
        assert f"carries {n:,} concurrent Moshi 7B sessions" in answer
        assert f"{c['capacity']['binding']} binds" in answer
        assert "Without the bound" in answer
    header, rows = answer_rows_from_markdown(md)
    assert header[1:] == ["small-h200", "small-b200"]  # side by side
    questions = [r[0] for r in rows]
    for q in ("memory ceiling", "deadline-bound N*", "which binds", "recommended S, W", "recommended admission",
              "expected goodput", "unbounded at N*"):
        assert q in questions


def test_answer_numbers_are_the_sim_layers(report):
    from metronome import calibration
    from metronome.fill_model import FillModel
    from metronome.kv_policy import KVPolicy
    from metronome.sim.capacity import capacity

    _, rows = answer_rows_from_markdown(report["md"])
    table = {r[0]: r[1:] for r in rows}
    for j, c in enumerate(report["data"]["calibrations"]):
        cal = calibration.load(c["spec"])
        policy = KVPolicy.sinks(16, 16, 368)  # the default bound: S=16, W = 30 s of Moshi rounded to blocks
        assert (c["policy"]["sinks"], c["policy"]["window"]) == (16, 368)
        cap = capacity(cal, policy, deadline_s=0.08, duration_s=120.0)
        assert c["capacity"]["n_star"] == cap["n_star"] and c["capacity"]["binding"] == cap["binding"]
        assert table["memory ceiling"][j].startswith(f"{cap['memory_ceiling']:,} sessions")
        assert table["deadline-bound N*"][j].startswith(f"{cap['deadline_n_star']:,} sessions")
        assert table["which binds"][j] == f"{cap['binding']} → N* = {cap['n_star']:,} sessions"
        t_sat = FillModel(cal, KVPolicy.unbounded(16)).t_sat(cap["n_star"])
        assert c["unbounded_at_n_star"]["t_sat_predicted_s"] == pytest.approx(t_sat, abs=1e-3)
        p = c["tuning"]["params"]
        assert re.match(rf"AIMD \+{p['additive_increase']:g} sessions? per {p['interval_s']:g} s, "
                        rf"×{p['decrease_factor']:g} on congestion", table["recommended admission"][j])
        assert p["max_limit"] == cap["n_star"] and f"max_limit {cap['n_star']}" in table["recommended admission"][j]
        assert f"{c['tuning']['figures']['goodput_sessions']:,.0f} healthy sessions" in table["expected goodput"][j]


def test_the_bound_prevents_collapse_and_latency_becomes_the_signal(report):
    for c in report["data"]["calibrations"]:
        ceiling = c["capacity"]["memory_ceiling"]
        u, b = c["signal"]["unbounded"], c["signal"]["bounded"]
        below = [i for i, n in enumerate(b["sessions"]) if n <= ceiling]
        assert all(b["silent_frame_fraction"][i] == 0 for i in below)
        assert max(u["silent_frame_fraction"]) > 0.1  # unbounded goes silent ...
        assert max(u["deadline_miss_fraction"]) < 0.05  # ... while deadline metrics look fine
        p99 = [b["p99_frame_latency_s"][i] for i in below]
        # bounded latency ramps with load. Independent phases (the report's default): a step batches only the
        # frames that arrived, so it rises more gently than in lockstep (here 1.2-1.7x from 5% of the ceiling to
        # it), and each N draws its own phases, so p99 may dip by a few percent from one N to the next
        assert all(q >= 0.95 * p for p, q in zip(p99, p99[1:])) and p99[-1] > 1.2 * p99[0], p99
        for k in c["fill"]["curves"]:
            if k["t_sat_predicted_s"] is not None:
                assert k["t_sat_observed_s"] == pytest.approx(k["t_sat_predicted_s"], rel=0.05)
            else:
                assert k["policy"] == "bounded" and k["sessions"] <= ceiling and k["t_sat_observed_s"] is None


def test_every_label_in_the_figures_has_its_text(report):
    """An annotation without text is drawn by plotly as the placeholder "new text" (the signal figure's upper
    panel had two, beside its memory ceilings). Every figure the page draws from the report's data labels what it
    marks, and the ceilings are labelled where they are."""
    from metronome.report.figures import all_figures

    texts = []
    for key, fig in all_figures(report["data"]).items():
        for a in fig.layout.annotations:
            assert a.text, (key, a)
            texts.append(a.text)
    ceiling = report["data"]["calibrations"][0]["capacity"]["memory_ceiling"]
    assert any(t.endswith(f"ceiling {ceiling:,}") or t == f"max_num_seqs {ceiling:,}" for t in texts), texts


def test_metastability_grid_is_predicted_and_simulated_side_by_side(report):
    for c in report["data"]["calibrations"]:
        m = c["metastability"]
        # the grid is in units of the binding N (here the deadline's N*), both sides of it
        assert m["sessions"][-1] == round(1.5 * c["capacity"]["n_star"]) and m["n_star"] == c["capacity"]["n_star"]
        assert m["past_n_star"] == [n > c["capacity"]["deadline_n_star"] for n in m["sessions"]]
        for key in ("unbounded", "bounded"):
            p = m["policies"][key]
            assert len(p["predicted"]) == len(p["simulated_collapse"]) == len(m["mean_duration_s"])
            assert all(0 <= x <= 1 for row in p["predicted"] + p["simulated_collapse"] for x in row)
        for key in ("unbounded", "bounded"):  # each cell's Wilson interval holds its simulated share
            p = m["policies"][key]
            for row_c, row_i, row_n in zip(p["simulated_collapse"], p["collapse_interval"], p["runs"]):
                for share, (lo, hi), runs in zip(row_c, row_i, row_n):
                    assert lo <= share <= hi and runs >= c["metastability"]["runs_per_cell"]
                    if 0 < share < 1:  # on the band's edge: topped up (--mc-edge-runs 4)
                        assert runs == m["edge_runs"] == 4
        u = m["policies"]["unbounded"]
        assert max(map(max, u["predicted"])) > 0.9 and min(map(min, u["predicted"])) < 0.1  # both sides of the race
        b = m["policies"]["bounded"]
        ceiling = c["capacity"]["memory_ceiling"]
        for i, _ in enumerate(m["mean_duration_s"]):
            for j, n in enumerate(m["sessions"]):
                if n <= ceiling:
                    assert b["predicted"][i][j] == 0 and b["simulated_collapse"][i][j] == 0


def test_admission_traces_cover_both_policies(report):
    for c in report["data"]["calibrations"]:
        for key in ("unbounded", "bounded"):
            tr = c["admission"]["policies"][key]["trace"]
            assert len(tr["t_s"]) > 50 and max(tr["limit"]) > 1 and max(tr["in_flight"]) > 1
        assert c["admission"]["policies"]["bounded"]["summary"]["collapsed"] is False


def test_fidelity_shows_live_errors_or_says_estimated(report):
    md = report["md"]
    fid = md_section(md, "Fidelity")
    t = md_tables(fid)[0]
    assert t[0] == ["policy", "figure", "measured", "predicted", "error"]
    assert ["unbounded", "t_sat", "4.1 s", "4.0 s", "-2.4%"] in t
    assert ["unbounded", "p99 frame latency", "50.0 ms", "45.0 ms", "-10.0%"] in t
    assert ["window", "p50 frame latency", "18.0 ms", "17.5 ms", "-2.8%"] in t
    assert "small-b200 is estimated" in fid and "roofline" in fid  # no --live for the second one


def test_provenance_gives_sources_seeds_and_the_command(report):
    from metronome.cli.sim_cli import build_parser

    md, data = report["md"], report["data"]
    prov = md_section(md, "Provenance")
    assert "metronome.roofline" in prov and "Seeds: scenario seed 0" in prov
    cmd = data["reproduce"]
    assert cmd in prov and cmd in report["html"].replace("&#x27;", "'")
    args = shlex.split(cmd)
    assert args[:2] == ["metronome-sim", "report"]
    ns = build_parser().parse_args(args[1:])
    assert ns.session_duration == "exp:120" and ns.mc_runs == 2 and len(ns.calibration) == 2 and len(ns.live) == 1


def test_provenance_lists_what_each_step_term_is_and_where_it_comes_from(report):
    """Every term of the calibration's step model, with its basis and source, in both files; the fidelity
    sentence counts them by basis and says whether the plugin's own costs are in the answer."""
    from metronome import calibration

    md, page = report["md"], report["html"]
    header = ["coefficient", "term", "value", "basis", "source"]
    in_md = [t for t in md_tables(md_section(md, "Provenance")) if t[0] == header]
    in_html = [t for t in html_tables(page) if t and t[0] == header]
    assert len(in_md) == 2 and in_md == in_html  # one per calibration, the same in both files
    cal = calibration.load("moshi-7b-h200")  # small-h200 is this preset with a smaller pool
    rows = in_md[0][1:]
    want = [(t.coefficient, t.name, t.basis) for t in cal.step_latency.terms] + \
        [(t.coefficient, t.name + " (sink+window plugin only)", t.basis) for t in cal.step_latency.plugin_terms]
    assert [(r[0], r[1], r[3]) for r in rows] == want
    assert ["base_s", "block table copied to the host (the sync) (sink+window plugin only)", "2 ms per step",
            "anchored"] in [r[:4] for r in rows]
    fid = md_section(md, "Fidelity")
    # small-b200 has no --live: its sentence says what its terms are made of; the report's policy is sinks
    b200 = calibration.load("moshi-7b-b200")  # small-b200 is this preset with a smaller pool
    named = len(b200.step_latency.terms) + len(b200.step_latency.plugin_terms)
    assert f"Its step model is {named} named terms (" in fid and "so they are priced in" in fid


def _erlang_b_by_logs(servers: int, erlangs: float) -> float:
    """Erlang B from its definition, A^c/c! over the sum of A^k/k!, in logarithms (an independent check of
    metronome.erlang's recursion)."""
    import math

    logs = [k * math.log(erlangs) - math.lgamma(k + 1) for k in range(servers + 1)]
    top = max(logs)
    return math.exp(logs[-1] - top) / sum(math.exp(x - top) for x in logs)


def test_how_many_gpus_sizes_the_fleet_for_the_offered_peak(report):
    md, page, data = report["md"], report["html"], report["data"]
    assert "\n## 2. How many GPUs\n" in md and "\n## 3. Pool fill\n" in md  # right after the answer
    sec = md_section(md, "How many GPUs")
    fleet_md = md_tables(sec)[0]
    assert fleet_md in html_tables(page) and fleet_md[0] == ["", "small-h200", "small-b200"]  # md = html
    rows = {r[0]: r[1:] for r in fleet_md[1:]}
    # the closed form: each GPU a loss system with the answer's N* places; the peak offers 6/s x 120 s = 720 Erlangs
    for j, c in enumerate(data["calibrations"]):
        n_star = c["capacity"]["n_star"]
        g = 1
        while _erlang_b_by_logs(g * n_star, 6 * 120) > 0.01:
            g += 1
        assert rows["GPUs at peak, closed form"][j].startswith(f"{g} with a router that finds any free GPU")
    # the simulated fleet, the day's GPU-hours and the price line, from the same run's numbers
    entry = data["fleet"]["summary"]["calibrations"][0]["routers"]["least-loaded"]
    st, au = entry["static"], entry["autoscaled"]
    assert st["gpu_hours"] == pytest.approx(st["engines"] * 3.0)  # a static fleet for the 3 h run
    assert au["gpu_hours"] < st["gpu_hours"]  # two of the three hours need a third of the peak's GPUs
    assert rows["cost per 1,000 session-h"][0] == (
        f"[least-loaded] static ${1000 * st['gpu_hours'] * H200_PRICE / st['session_hours']:,.0f} · autoscaled "
        f"${1000 * au['gpu_hours'] * H200_PRICE / au['session_hours']:,.0f} (at ${H200_PRICE:g} per GPU-hour)")
    assert rows["cost per 1,000 session-h"][1] == ""  # small-b200 has no price
    assert 'data-figure="gpus"' in page and "Per hour of the run:" in sec
    hours = md_tables(sec)[1]
    assert [r[0] for r in hours[1:]] == ["0", "1", "2"] and [r[1] for r in hours[1:]] == ["2.00", "6.00", "2.00"]
    # the same builder as metronome-sim fleet's per-hour table, over the series kept in report.json
    header, rows = fleet_hours_table(data["fleet"]["series"])
    assert hours == [header] + rows and hours in html_tables(page)
    assert header[2:5] == ["small-h200: GPUs static · autoscaled", "small-h200: refused static · autoscaled",
                           "small-h200: silent frames static · autoscaled"]


def test_default_bound_is_thirty_seconds_of_conversation():
    from metronome import calibration
    from metronome.report.plan import default_window_tokens

    assert default_window_tokens(calibration.load("moshi-7b-h200"), 16) == 368  # S+W = 24 blocks = 30.7 s
    for name in calibration.preset_names():
        cal = calibration.load(name)
        w = default_window_tokens(cal, 16)
        assert (16 + w) % cal.engine.block_size_tokens == 0
        half_block_s = cal.engine.block_size_tokens / 2 / cal.stream.kv_tokens_per_s
        assert abs(w / cal.stream.kv_tokens_per_s - 30.0) <= half_block_s + 1e-9


# ------------------------------------------------------------------------------------------ bad input
def _live(tmp_path, obj, name="live") -> str:
    d = tmp_path / name
    d.mkdir()
    if obj is not None:
        (d / "summary.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(d)


@pytest.mark.parametrize("args,needle", [
    (["--calibration", "no-such-preset"], "unknown calibration preset"),
    (["--kv", "unbounded"], "invalid choice"),
    (["--window", "8"], "under one block"),
    (["--sinks", "400", "--window", "368"], "fewer than the window"),
    (["--mc-runs", "0"], "--mc-runs must be >= 1"),
    (["--mc-edge-runs", "0"], "--mc-edge-runs must be >= 1"),
    (["--deadline", "-1"], "--deadline must be positive"),
    (["--arrival-rate", "0"], "--arrival-rate must be a positive"),
    (["--session-duration", "exp:-3"], "session duration must be positive"),
    (["--deadline", "0.001"], "even one session misses"),
    (["--live", "MISSING"], "no such folder"),
    (["--live", "NOSUMMARY"], "summary.json: missing"),
    (["--live", "BADJSON"], "not valid JSON"),
    (["--live", "NOPOLICY"], "no policy with 't_sat_observed_s'"),
    (["--live", "BADFIELD"], "field 'unbounded.p99_frame_latency_s.live' must be a non-negative number"),
    (["--live", "NOLATENCY"], "has no live and simulated 'p50_frame_latency_s'"),
    (["--calibration", "moshi-7b-h200", "--calibration", "moshi-7b-h200"], "given twice"),
    (["--offered-load", "-3"], "the rate must be a positive number"),
    (["--offered-load", "60:1,60:-1"], "the rate must be a finite number of sessions/s >= 0"),
    (["--offered-load", "LOADCSV"], "rows must be in time order"),
    (["--offered-load", "2", "--max-refusal", "1.5"], "--max-refusal must be in (0, 1)"),
    (["--offered-load", "2", "--gpu-price", "moshi-7b-b200=4"], "is not a calibration in this run"),
    (["--gpu-price", "moshi-7b-h200=4"], "give the load with --offered-load"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, needle):
    bad_field = json.loads(json.dumps(LIVE_SUMMARY))
    bad_field["policies"]["unbounded"]["p99_frame_latency_s"]["live"] = "fast"
    no_latency = {"unbounded": {"t_sat_observed_s": 1.0, "t_sat_predicted_s": 1.0}}
    unsorted = tmp_path / "load.csv"
    unsorted.write_text("time,rate\n0,1\n900,2\n600,1\n")
    subst = {"MISSING": str(tmp_path / "nope"), "LOADCSV": str(unsorted), "NOSUMMARY": lambda: _live(tmp_path, None),
             "BADJSON": lambda: _live(tmp_path, '{"policies": '), "NOPOLICY": lambda: _live(tmp_path, {"a": 1}),
             "BADFIELD": lambda: _live(tmp_path, bad_field), "NOLATENCY": lambda: _live(tmp_path, no_latency)}
    args = [(subst[a]() if callable(subst[a]) else subst[a]) if a in subst else a for a in args]
    out = tmp_path / "out"
    r = run_cli("report", *args, "--workers", "1", "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


def test_out_that_is_a_file_fails_before_any_work(tmp_path):
    f = tmp_path / "taken"
    f.write_text("mine")
    r = run_cli("report", "--out", str(f))
    assert r.returncode == 2 and "not a folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f.read_text() == "mine"


def test_the_answer_names_its_phase_regime_and_n_star_under_the_other(report):
    from metronome import calibration
    from metronome.kv_policy import KVPolicy
    from metronome.sim.capacity import capacity

    _, rows = answer_rows_from_markdown(report["md"])
    table = {r[0]: r[1:] for r in rows}
    assert "The answer assumes independent phases" in report["md"]
    for j, c in enumerate(report["data"]["calibrations"]):
        cap, alt = c["capacity"], c["capacity"]["other_regime"]
        assert cap["phases"] == "independent" and alt["phases"] == "aligned"
        lockstep = capacity(calibration.load(c["spec"]), KVPolicy.sinks(16, 16, 368), deadline_s=0.08,
                            duration_s=120.0, phases="aligned")
        assert (alt["n_star"], alt["deadline_n_star"]) == (lockstep["n_star"], lockstep["deadline_n_star"])
        row = table["phase regime"][j]
        assert row.startswith("independent")
        differ = abs(alt["n_star"] - cap["n_star"]) > 0.10 * cap["n_star"]
        assert (f"under aligned: N* = {alt['n_star']:,}" in row) == differ


def test_both_regimes_are_shown_when_their_n_star_differ_by_more_than_ten_percent():
    from metronome.report.answer import regime_words

    def c(n, n_alt):
        return {"capacity": {"phases": "independent", "n_star": n, "other_regime": {
            "phases": "aligned", "n_star": n_alt, "deadline_n_star": n_alt, "binding": "deadline"}}}

    assert "Under aligned phases N* would be 283" in regime_words(c(512, 283))
    assert "45% fewer than under independent phases" in regime_words(c(512, 283))
    assert "Under aligned" not in regime_words(c(512, 470))  # 8% apart: one answer
    assert "Under aligned phases N* would be 450" in regime_words(c(400, 450))  # 12.5% more


def test_past_n_star_is_marked_and_intervals_shown_in_the_metastability_tables(report):
    from metronome.report.answer import PAST_N_STAR, mc_sessions_labels, pct

    # (the small pools bind by memory, so no cell of the shared report is past the deadline's N*)
    assert mc_sessions_labels({"sessions": [61, 122, 183], "past_n_star": [False, False, True]}) == [
        "61", "122", f"183 {PAST_N_STAR}"]

    section = md_section(report["md"], "Metastability")
    tables = md_tables(section)
    c = report["data"]["calibrations"][0]
    m = c["metastability"]
    header = tables[0][0]
    assert [h.endswith(PAST_N_STAR) for h in header[1:]] == m["past_n_star"]
    lo, hi = m["policies"]["unbounded"]["collapse_interval"][0][0]
    runs = m["policies"]["unbounded"]["runs"][0][0]
    assert f"[{pct(lo)}–{pct(hi)}, {runs} runs]" in tables[0][1][1]


def test_the_memory_ceiling_row_is_memory_and_max_num_seqs_has_its_own():
    """qwen3-omni-30b-a3b-b200: the pool holds 1,804 bounded sessions, vLLM's max_num_seqs caps them at 1,024."""
    from metronome import calibration
    from metronome.report.plan import ReportOptions, make_plan

    plan = make_plan("qwen3-omni-30b-a3b-b200", calibration.load("qwen3-omni-30b-a3b-b200"),
                     ReportOptions(calibrations=("qwen3-omni-30b-a3b-b200",)))
    assert (plan.pool_ceiling, plan.memory_ceiling) == (1804, 1024)
    assert plan.fill_bounded.seqs_bind


def test_answer_rows_say_when_max_num_seqs_caps_first(report):
    import copy

    from metronome.report.answer import answer_rows

    c = copy.deepcopy(report["data"]["calibrations"][0])
    rows = dict(answer_rows(c))
    assert "max_num_seqs" not in rows and rows["memory ceiling"].startswith(f"{c['pool_ceiling']:,} sessions")
    c.update(seqs_bind=True, max_num_seqs=7, pool_ceiling=900)
    rows = dict(answer_rows(c))
    assert rows["memory ceiling"].startswith("900 sessions")
    assert rows["max_num_seqs"].startswith("7 sessions") and "before memory" in rows["max_num_seqs"]


@pytest.mark.parametrize("phases", ["aligned", "independent"])
def test_the_report_predicts_under_the_phase_regime_it_assumes(phases):
    """Past N* the fill model's clock depends on the regime: the plan's fill models and the metastability cells'
    predictions must be the ones for --phases, not the default's."""
    from metronome import calibration
    from metronome.report.plan import ReportOptions, make_plan, prediction_points

    plan = make_plan("moshi-7b-h200", calibration.load("moshi-7b-h200"),
                     ReportOptions(calibrations=("moshi-7b-h200",), phases=phases))
    assert plan.fill_bounded.phases == plan.fill_unbounded.phases == phases
    assert {t.point["phases"] for t in prediction_points(plan, 122)} == {phases}


# ------------------------------------------------------------------------------------------ the next question
def _fewest(ok, start: int = 1) -> int:
    g = start
    while not ok(g):
        g += 1
    return g


def test_the_answer_tabulates_gpus_for_a_few_offered_loads(report):
    """Without --offered-load too: GPUs for 100, 1,000 and 10,000 concurrent sessions at 1% refused, each GPU a loss
    system of the answer's N* places (Erlang B from its definition here), and the CLI names --offered-load."""
    md, page, data = report["md"], report["html"], report["data"]
    tables = [t for t in md_tables(md_section(md, "The answer")) if t[0][0] == "concurrent sessions offered"]
    assert len(tables) == 1 and tables[0] in html_tables(page)
    header, *rows = tables[0]
    assert header == ["concurrent sessions offered", "arrivals (sessions/s, mean 120 s)", "small-h200: GPUs",
                      "small-b200: GPUs"]
    assert [r[0] for r in rows] == ["100", "1,000", "10,000"]
    assert [r[1] for r in rows] == ["0.833", "8.33", "83.3"]  # sessions / 120 s
    for j, c in enumerate(data["calibrations"]):
        n = c["capacity"]["n_star"]
        words = []
        for load, row in zip((100, 1000, 10000), rows):
            pooled = _fewest(lambda g: _erlang_b_by_logs(g * n, load) <= 0.01, max(1, load // n))
            rand = _fewest(lambda g: _erlang_b_by_logs(n, load / g) <= 0.01, max(1, load // n))
            assert row[2 + j] == f"{pooled:,} · {rand:,} with random routing"
            words.append(f"{load:,} → {pooled:,}")
        # the CLI's line names the loads' answers and the flag for the planner's own load (a narrow terminal wraps
        # it between words: compared with the spaces normalised)
        assert (f"GPUs at ≤ 1.00% refused (Erlang B on N* = {n:,}), concurrent sessions → GPUs: {', '.join(words)}; "
                f"for your own load add --offered-load RATE|PATTERN|CSV") in " ".join(report["stdout"].split())


def test_each_unbounded_figure_says_which_workload_it_is(report):
    """The answer's "unbounded at N*" is N* sessions of the mix (they end); the pool-fill section's are sessions that
    never end: each says so, and the answer points at the other when the two disagree."""
    import copy

    from metronome.report.answer import answer_rows, secs

    md, data = report["md"], report["data"]
    _, rows = answer_rows_from_markdown(md)
    table = {r[0]: r[1:] for r in rows}
    for j, c in enumerate(data["calibrations"]):
        n = c["capacity"]["n_star"]
        assert table["unbounded at N*"][j].startswith(f"{n:,} sessions of exp(mean 120 s) started together: ")
        # a mix that never runs the pool dry, beside never-ending sessions that do (Moshi/H200 at N* = 122)
        quiet = copy.deepcopy(c)
        quiet["unbounded_at_n_star"].update(collapsed=False, t_sat_observed_s=None)
        (curve,) = [k for k in c["fill"]["curves"] if k["policy"] == "unbounded" and k["sessions"] == n]
        row = dict(answer_rows(quiet))["unbounded at N*"]
        assert row == (f"{n:,} sessions of exp(mean 120 s) started together: no collapse in "
                       f"{secs(quiet['unbounded_at_n_star']['horizon_s'])} (the pool never ran dry: enough of them "
                       f"end first); the same number of sessions that never end run it dry after "
                       f"{secs(curve['t_sat_predicted_s'])} (the pool-fill section)")
    fill = md_section(md, "Pool fill")
    assert fill.lstrip().startswith("Here N sessions start together and never end")
    assert 'The answer\'s "unbounded at N*" is another workload: N* sessions of exp(mean 120 s)' in fill
    assert md_tables(fill)[0][0][2] == "N (never ending)"


def test_n_star_zero_from_the_reports_own_window_names_window(tmp_path):
    """A slow engine (its step costs 0.25 ms per token of context): the report's 30 s window (S=16, W=368) leaves
    even one session over the 64 ms p99 target, a shorter window does not. The error names --window and a W that
    works; capacity, asked for that W and the next block, agrees."""
    from metronome import calibration

    cal = calibration.load("moshi-7b-h200")
    step = replace(cal.step_latency, per_context_token_s=2.5e-4, terms=(), plugin_terms=())
    path = tmp_path / "slow.json"
    path.write_text(replace(cal, name="slow-context", step_latency=step).to_json())
    out = tmp_path / "out"
    r = run_cli("report", "--calibration", str(path), "--workers", "1", "--out", str(out))
    assert r.returncode == 2 and not out.exists()
    (line,) = r.stderr.strip().splitlines()
    assert "N* is 0 because of the window the report chose (sinks S=16, W=368: about the last 30 s" in line
    assert "raise --deadline" not in line
    w = int(re.search(r"give --window (\d+) or less", line).group(1))

    def n_star(window: int) -> int:
        d = tmp_path / f"cap-{window}"
        c = run_cli("capacity", "--calibration", str(path), "--kv", "sinks", "--sinks", "16", "--window", str(window),
                    "--out", str(d))
        assert c.returncode == 0, c.stderr
        return json.loads((d / "capacity.json").read_text())["n_star"]

    assert 16 < w < 368 and (16 + w) % 16 == 0  # whole blocks, shorter than the report's
    assert n_star(w) >= 1 and n_star(w + 16) == 0
