"""metronome-sim fleet as a user runs it: what it prints, what it writes, and how it fails."""

import json
from dataclasses import replace
from fractions import Fraction

import pandas as pd
import pytest

from metronome.report.answer import fleet_hours_table
from metronome.sim.fleet_plan import hour_series
from sim_cli_helpers import run_cli

# Moshi on an H200 under a bound with a small pool: its memory ceiling, 600 // 25 blocks = 24 sessions, is its N*
SMALL = ["--calibration", "moshi-7b-h200", "--kv", "sinks", "--sinks", "16", "--window", "368", "--num-blocks", "600"]


def exact_b(c: int, a: Fraction) -> Fraction:
    terms, t = [Fraction(1)], Fraction(1)
    for k in range(1, c + 1):
        t = t * a / k
        terms.append(t)
    return terms[-1] / sum(terms)


def test_fleet_answers_how_many_gpus_and_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the per-hour table on one line per row, as a wide terminal shows it
    load = tmp_path / "day.csv"
    load.write_text("time,rate\n00:00,0.05\n00:30,0.4\n01:00,0.05\n")  # 1.5 h with a 30-minute peak
    out = tmp_path / "fleet"
    r = run_cli("fleet", *SMALL, "--load-csv", str(load), "--session-duration", "exp:120", "--autoscale",
                "--engine-start-s", "60", "--routers", "least-loaded,random", "--peak-window", "1800",
                "--gpu-price", "moshi-7b-h200=3.5", "--out", str(out), "--workers", "1")
    assert r.returncode == 0, r.stderr
    for needle in ("GPUs at peak, closed form", "GPUs at peak, simulated", "GPU-hours", "autoscaled",
                   "cost per 1,000 session-h", "simulation speed", "per hour (least-loaded)"):
        assert needle in r.stdout, needle
    assert sorted(p.name for p in out.iterdir()) == [".metronome.json", "bins.csv", "bins.parquet", "engines.csv",
                                                     "engines.parquet", "fleet.json"]
    s = json.loads((out / "fleet.json").read_text())
    (c,) = s["calibrations"]
    assert c["n_star"] == 24 and c["gpu_price_per_hour"] == 3.5
    # the closed form at the peak (0.4/s x 120 s = 48 Erlangs), checked against Erlang's formula in fractions
    a = Fraction(48)
    pooled = next(g for g in range(1, 50) if exact_b(24 * g, a) <= Fraction(1, 100))
    random = next(g for g in range(1, 50) if exact_b(24, a / g) <= Fraction(1, 100))
    assert c["closed_form_engines"] == {"pooled": pooled, "random": random}
    assert f"{pooled} with a router that finds any free GPU" in r.stdout
    for router in ("least-loaded", "random"):
        row = c["routers"][router]
        assert row["simulated"]["refused_fraction"] <= 0.01
        assert row["static"]["engines"] == row["simulated"]["engines"]
        assert row["static"]["gpu_hours"] == pytest.approx(row["static"]["engines"] * 1.5)
        assert row["static"]["cost_per_1000_session_hours"] == pytest.approx(
            1000 * row["static"]["gpu_hours"] * 3.5 / row["static"]["session_hours"])
    assert c["routers"]["random"]["simulated"]["engines"] >= c["routers"]["least-loaded"]["simulated"]["engines"]
    bins = pd.read_parquet(out / "bins.parquet")
    assert set(bins["mode"]) == {"static", "autoscaled"} and set(bins.router) == {"least-loaded", "random"}
    assert len(bins) == 2 * 2 * 2  # two hours (1.5 h) x 2 routers x 2 modes
    # the per-hour table is the report's: its one builder over the first router's rows of the bins written
    header, rows = fleet_hours_table({"moshi-7b-h200": hour_series(bins, "moshi-7b-h200", "least-loaded")})
    lines = r.stdout.splitlines()
    shown_header = next([c.strip() for c in line.split("┃")[1:-1]] for line in lines if line.startswith("┃"))
    shown_rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert shown_header == header and shown_rows == rows and len(rows) == 2
    assert header[-1] == "silent frames static · autoscaled"  # one calibration: the title names it
    assert s["simulated_engine_seconds_per_wall_s"] > 0


@pytest.mark.parametrize("csv,args,needle", [
    ("0,1\n900,-1\n", [], "line 2: the rate must be a finite number of sessions/s >= 0, got -1"),
    ("0,1\n900,1\n2700,1\n", [], "a gap, or uneven rows"),
    ("0,1\n900,1\n600,1\n", [], "rows must be in time order"),
    ("0,1\n900,1\n", ["--max-refusal", "0"], "--max-refusal must be in (0, 1), got 0"),
    ("0,1\n900,1\n", ["--max-refusal", "1"], "--max-refusal must be in (0, 1), got 1"),
    ("0,1\n900,1\n", ["--engines", "0"], "--engines must be an integer >= 1, got 0"),
    ("0,1\n900,1\n", ["--gpu-price", "moshi-7b-b200=5"], "'moshi-7b-b200' is not a calibration in this run"),
    ("0,1\n900,1\n", ["--gpu-price", "moshi-7b-h200=free"], "--gpu-price wants NAME=USD_PER_HOUR"),
    ("0,1\n900,1\n", ["--arrival-rate", "2"], "give the offered load once"),
    ("0,1\n900,1\n", ["--routers", "sticky"], "unknown router 'sticky'"),
    ("0,0\n900,0\n", [], "the offered load is zero at every time"),
    ("0,1\n900,1\n", ["--autoscale", "--scale-in-utilization", "0.95"], "0 < --scale-in-utilization"),
])
def test_fleet_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, csv, args, needle):
    load = tmp_path / "load.csv"
    load.write_text(csv)
    out = tmp_path / "out"
    # a 1 us deadline that no session meets: were the input checked only after the capacity search, the error
    # would be that N* is 0, so the needle shows that each check comes first
    r = run_cli("fleet", *SMALL, "--deadline", "1e-6", "--load-csv", str(load), *args, "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_fleet_needs_an_offered_load(tmp_path):
    r = run_cli("fleet", *SMALL, "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "give the offered load once" in r.stderr
    assert not (tmp_path / "out").exists()


def test_fleet_says_when_unbounded_memory_silences_what_refusals_do_not_show(tmp_path):
    # unbounded KV with a small pool: N* is the memory ceiling for a session of the mean length (12), so the
    # sessions that run longer than the mean overflow their engine while hardly anyone is refused
    out = tmp_path / "unbounded"
    r = run_cli("fleet", "--calibration", "moshi-7b-h200", "--kv", "unbounded", "--num-blocks", "1200",
                "--arrival-rate", "0.35", "--session-duration", "exp:120", "--horizon", "7200", "--peak-window", "1800",
                "--workers", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    st = json.loads((out / "fleet.json").read_text())["calibrations"][0]["routers"]["least-loaded"]["static"]
    assert st["worst_bin_silent_frame_fraction"] >= 0.01 > st["refused_fraction"]
    assert "of frames silent: sessions that run long overflow an engine's pool" in r.stdout
    bounded = run_cli("fleet", *SMALL, "--arrival-rate", "0.35", "--session-duration", "exp:120", "--horizon", "7200",
                      "--peak-window", "1800", "--workers", "1")
    assert bounded.returncode == 0 and "frames silent:" not in bounded.stdout


def _erlang_b_by_logs(servers: int, erlangs: float) -> float:
    """Erlang B from its definition, A^c/c! over the sum of A^k/k!, in logarithms (independent of metronome.erlang)."""
    import math

    logs = [k * math.log(erlangs) - math.lgamma(k + 1) for k in range(servers + 1)]
    top = max(logs)
    return math.exp(logs[-1] - top) / sum(math.exp(x - top) for x in logs)


def test_fleet_defaults_to_the_reports_bound_and_prints_the_unbounded_figure_beside_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # each answer on one line, as a wide terminal shows it
    from metronome import calibration
    from metronome.fill_model import FillModel
    from metronome.kv_policy import KVPolicy

    # no --kv: the bound the report recommends for Moshi (S=16, W=368: 30 s of conversation in whole blocks)
    out = tmp_path / "fleet"
    args = ["--calibration", "moshi-7b-h200", "--num-blocks", "600", "--arrival-rate", "0.4", "--session-duration",
            "exp:120", "--horizon", "3600", "--peak-window", "1800", "--workers", "1"]
    r = run_cli("fleet", *args, "--out", str(out))
    assert r.returncode == 0, r.stderr
    (c,) = json.loads((out / "fleet.json").read_text())["calibrations"]
    assert c["policy"] == "sinks(S=16, W=368)" and c["n_star"] == 24  # 600 blocks // 25 a session
    # beside it, unbounded KV: N* is the memory ceiling for a 120 s session (the fill model's block arithmetic),
    # and its GPUs at the peak (0.4/s x 120 s = 48 Erlangs) from Erlang's formula
    cal = calibration.load("moshi-7b-h200")
    small = replace(cal, engine=replace(cal.engine, num_blocks=600))
    n_u = FillModel(small, KVPolicy.unbounded(16)).memory_ceiling(120.0)
    g = next(g for g in range(1, 200) if _erlang_b_by_logs(g * n_u, 48.0) <= 0.01)
    assert c["unbounded"]["n_star"] == n_u and c["unbounded"]["closed_form_engines"]["pooled"] == g
    assert (f"unbounded KV, for comparison N* = {n_u} sessions per GPU (memory binds) → {g} GPUs at peak by Erlang B"
            in r.stdout)
    assert f"against {c['closed_form_engines']['pooled']} with sinks(S=16, W=368)" in r.stdout
    # --kv unbounded asked for: no comparison line
    plain = run_cli("fleet", *args, "--kv", "unbounded")
    assert plain.returncode == 0, plain.stderr
    assert "unbounded KV, for comparison" not in plain.stdout and "· unbounded · N* = " in plain.stdout


def test_fleet_reports_an_interval_that_means_something_and_the_worst_hour_against_the_target(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # each answer on one line, as a wide terminal shows it
    # Unbounded Moshi on a small pool (N* = its memory ceiling for a 120 s session) offered near its 1% point:
    # one simulated hour's four quarters can all refuse nobody and print "95% CI 0.00%-0.00%" beside an hour at
    # over 1% in the day's run. The sizing now draws independent runs until its interval leaves the target (at most
    # 64) and says how many; the day's hours over the target are counted.
    out = tmp_path / "fleet"
    r = run_cli("fleet", "--calibration", "moshi-7b-h200", "--kv", "unbounded", "--num-blocks", "1200",
                "--arrival-rate", "0.35", "--session-duration", "exp:120", "--horizon", "14400", "--workers", "1",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "fleet.json").read_text())
    (c,) = s["calibrations"]
    sim = c["routers"]["least-loaded"]["simulated"]
    assert sim["runs"] >= 8 and len(set(sim["seeds"])) == sim["runs"]  # independent seeds, at least eight
    lo, hi = sim["refused_fraction_ci"]
    assert lo < hi  # an interval with a width, not a point
    assert sim["decided"] == (hi <= 0.01 or lo > 0.01)
    assert sim["decided"] or sim["runs"] == 64  # undecided only once every run allowed was drawn
    line = next(x for x in r.stdout.splitlines() if "GPUs at peak, simulated" in x)
    assert f"95% CI {100 * lo:.2f}%-{100 * hi:.2f}% over {sim['runs']} runs of 1 h at the peak" in line
    st = c["routers"]["least-loaded"]["static"]
    bins = pd.read_parquet(out / "bins.parquet")
    over = int((bins[bins["mode"] == "static"].refused_fraction > 0.01).sum())
    assert st["bins_over_target"] == over and st["bins"] == 4
    assert f"hours over the 1.00% target  [least-loaded] static {over} of 4" in r.stdout


def test_a_fleet_no_one_is_refused_in_says_so_without_an_interval(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # each answer on one line, as a wide terminal shows it
    r = run_cli("fleet", *SMALL, "--arrival-rate", "0.05", "--session-duration", "exp:120", "--horizon", "3600",
                "--peak-window", "1800", "--workers", "1", "--out", str(tmp_path / "f"))
    assert r.returncode == 0, r.stderr
    sim = json.loads((tmp_path / "f" / "fleet.json").read_text())["calibrations"][0]["routers"]["least-loaded"][
        "simulated"]
    assert sim["refused"] == 0 and sim["refused_fraction_ci"] is None and sim["runs"] == 8
    line = next(x for x in r.stdout.splitlines() if "GPUs at peak, simulated" in x)
    assert f"none of {sim['offered']:,} sessions refused over 8 runs of 0.5 h at the peak" in line
    assert "95% CI" not in line
