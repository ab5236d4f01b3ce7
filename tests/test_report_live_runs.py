"""metronome-sim report --live with live admission runs: a ``metronome-probe run`` folder (re-simulated with the
report's calibration) and a ``bench_live_aimd.py`` folder (its run subfolders, each with the simulator's sim/),
read and checked up front, and shown in the Fidelity section as a live-vs-simulated figure and table rows.

The run folders are synthetic but shaped as the probe writes them (summary.json, controller.parquet,
steps.parquet, frames/sessions/events Parquet) with a Moshi-like stream, so the small-pool Moshi calibrations
of test_report.py can simulate them in seconds; the benchmark's sim/ folders are written by the simulator.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from metronome.errors import MetronomeError
from sim_cli_helpers import run_cli
from test_report import html_tables, md_section, md_tables

SMALL = {"small-h200": ("moshi-7b-h200", 2000), "small-b200": ("moshi-7b-b200", 2600)}
REPORT_ARGS = ["--session-duration", "exp:120", "--mc-runs", "2", "--workers", "2"]
AIMD = {"additive_increase": 1.0, "decrease_factor": 0.9, "target_fraction": 0.8, "interval_s": 1.0,
        "initial_limit": 2, "max_limit": 64}
STREAM = {"period_s": 0.08, "in": 0, "out": 1}  # Moshi: a frame every 80 ms, one token out
HORIZON = 40.0
SETTLED = 10  # the synthetic live runs hold this many sessions over their second half
LABEL = {"window": "window(W=368)", "sinks": "sinks(S=16, W=368)", "unbounded": "unbounded"}


def _small_calibrations(folder: Path) -> dict[str, Path]:
    from metronome import calibration

    out = {}
    for name, (preset, blocks) in SMALL.items():
        cal = calibration.load(preset)
        cal = replace(cal, name=name, engine=replace(cal.engine, num_blocks=blocks))
        out[name] = folder / f"{name}.json"
        out[name].write_text(cal.to_json())
    return out


def run_options(kv: str, num_blocks: int, **kw) -> dict:
    """``summary.json["options"]`` as ``metronome-probe run`` writes it."""
    opts = {"model": "moshi-tiny", "out": "runs/x", "admission": "aimd", "aimd_params": None, "arrival_rate": 2.0,
            "rate_pattern": None, "session_duration": "exp:20", "horizon_s": HORIZON, "kv": kv,
            "window": None if kv == "unbounded" else 368, "sinks": 16 if kv == "sinks" else None,
            "num_blocks": num_blocks, "block_size": 16, "max_model_len": None, "deadline_s": 0.08,
            "metrics_port": None, "seed": 0, "prompt_tokens": 1, "weights": "auto", "device": None, "dtype": None,
            "stream": dict(STREAM)}
    opts.update(kw)
    return opts


def write_run(d: Path, kv: str = "sinks", num_blocks: int = 600, options: dict | None | bool = True,
              silent: float = 0.0, preemptions: int = 0) -> dict:
    """A ``metronome-probe run --out d`` folder: AIMD climbing from 2 to 12, then cutting between 11 and 12,
    with ``SETTLED`` admitted sessions over the second half. Returns the summary written."""
    d.mkdir(parents=True)
    label = LABEL[kv]
    k = np.arange(int(HORIZON))
    t_ctl = k + 1.41
    limit = np.where(t_ctl < HORIZON / 2, np.minimum(k + 2, 12), np.where(k % 2 == 0, 11, 12))
    in_flight = np.minimum(limit, np.minimum(1 + (t_ctl // 2).astype(int), SETTLED))
    frames = (in_flight * 12).astype(int)
    n_silent = np.round(frames * silent).astype(int)
    ctl = pd.DataFrame({"t_s": t_ctl, "limit": limit, "in_flight": in_flight,
                        "p_latency_s": 0.012 + 0.002 * in_flight, "frames": frames, "silent": n_silent,
                        "silent_fraction": n_silent / frames,
                        "decision": np.where(np.diff(limit, append=limit[-1]) < 0, "decrease", "increase"),
                        "dead": False})
    ctl.to_parquet(d / "controller.parquet", index=False)
    t0 = np.arange(0.5, HORIZON, 0.04)
    sessions = np.minimum(1 + (t0 // 2).astype(int), SETTLED)
    step_s = 0.003 + 0.0004 * sessions
    used = np.minimum(sessions * 24, num_blocks - 1)
    steps = pd.DataFrame({"run": label, "t_s": t0, "t_end_s": t0 + step_s, "stalled": False, "step_s": step_s,
                          "batch": sessions, "new_tokens": sessions, "context_tokens": sessions * 200,
                          "prefill_tokens": 0, "preemptions": 0, "free_blocks": num_blocks - 1 - used,
                          "used_blocks": used, "kv_usage": used / (num_blocks - 1), "running": sessions, "waiting": 0,
                          "paused": 0, "sessions": sessions, "sessions_waiting": 0, "sessions_prefill": 0,
                          "held_tokens": sessions * 200})
    steps.to_parquet(d / "steps.parquet", index=False)
    tick = np.arange(0.5, HORIZON, STREAM["period_s"])
    pd.DataFrame({"run": label, "session": "s0", "frame": np.arange(tick.size), "tick_s": tick,
                  "latency_s": 0.011, "silent": False, "met_deadline": True}).to_parquet(d / "frames.parquet",
                                                                                         index=False)
    pd.DataFrame({"run": label, "session": ["s0", "s1"], "arrival_s": [0.5, 1.2], "admitted": [True, False],
                  "reason": ["departed", "refused"]}).to_parquet(d / "sessions.parquet", index=False)
    pd.DataFrame({"run": label, "t_s": [28.0], "event": ["rebase"], "session": ["s0"]}).to_parquet(
        d / "events.parquet", index=False)
    summary = {"frames": int(frames.sum()), "silent_frames": int(n_silent.sum()), "silent_frame_fraction": silent,
               "deadline_miss_fraction": 0.004, "p50_frame_latency_s": 0.0112, "p99_frame_latency_s": 0.0341,
               "preemptions": preemptions, "num_blocks": num_blocks, "steps": int(t0.size),
               "sessions_admitted": 14, "sessions_refused": 66, "sessions_offered": 80, "sessions_planned": 80,
               "stopped": False,
               "stop_reason": None, "t_stopped_s": None, "wall_s": HORIZON + 0.01,
               "controller": {"name": "aimd", "params": dict(AIMD), "intervals": int(k.size),
                              "final_limit": int(limit[-1]), "max_limit": int(limit.max()), "dead_intervals": 0,
                              "cuts": int((ctl.decision == "decrease").sum())}}
    if options is True:
        summary["options"] = run_options(kv, num_blocks)
    elif isinstance(options, dict):
        summary["options"] = options
    (d / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_benchmark(d: Path, calibration: Path) -> dict:
    """A ``bench_live_aimd.py --out d`` folder: window/ and unbounded/ runs, each with the simulator's sim/."""
    from metronome.sim import scenario as scn

    d.mkdir(parents=True)
    results = {}
    for name, kv, blocks, silent, pre in (("window", "window", 2000, 0.0, 0),
                                          ("unbounded", "unbounded", 2000, 0.21, 9)):
        summ = write_run(d / name, kv=kv, num_blocks=blocks, options=False, silent=silent, preemptions=pre)
        res = scn.run(scn.make_scenario(calibration=str(calibration), kv=kv, window=368 if kv == "window" else None,
                                        arrival_rate=2.0, session_duration="exp:20", horizon=HORIZON, seed=0,
                                        deadline=0.08, admission="aimd", aimd_params=AIMD, num_blocks=blocks))
        scn.write(res, d / name / "sim")
        results[name] = {"horizon_s": HORIZON, "live": {"settled_sessions": float(SETTLED),
                                                        "preemptions": summ["preemptions"]},
                         "sim": {"preemptions": res.summary["preemptions"]}}
    summary = {"command": "python benchmarks/bench_live_aimd.py --out x", "num_blocks": 2000, "window": 368,
               "deadline_s": 0.08, "stream": dict(STREAM), "arrival_rate": 2.0, "durations": "exp:20", "aimd": AIMD,
               "capacity": {"calibration": "small-h200", "policy": "window(W=368)", "n_star": 23, "binding": "memory"},
               "n_star_sim": 23, "results": results, "wall_s": 95.0}
    (d / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def second_half(t, y, horizon=HORIZON) -> float:
    t, y = np.asarray(t, float), np.asarray(y, float)
    return float(y[t >= horizon / 2].mean())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("live-runs")
    cals = _small_calibrations(base)
    bench = base / "bench"
    write_benchmark(bench, cals["small-h200"])
    run = base / "run"
    write_run(run, kv="sinks", num_blocks=600, silent=0.0)
    return {"base": base, "cals": cals, "bench": bench, "run": run}


# ------------------------------------------------------------------------------------------ the reader
def test_a_run_folder_is_read_with_its_settled_concurrency_and_what_to_resimulate(folders):
    from metronome.report.live import read_live

    live = read_live(folders["run"])
    assert live["kind"] == "runs" and live["origin"] == "run" and list(live["runs"]) == ["run"]
    r = live["runs"]["run"]
    assert r["label"] == "sinks(S=16, W=368)" and r["bounded"] and r["controller"] == "aimd"
    ctl = pd.read_parquet(folders["run"] / "controller.parquet")
    assert r["live"]["settled_sessions"] == pytest.approx(float(SETTLED))  # steps.sessions over t_s >= 20 s
    assert r["live"]["settled_limit"] == pytest.approx(second_half(ctl.t_s, ctl.limit))
    assert 11 < r["live"]["settled_limit"] < 12
    f = r["figures"]
    assert f["p99_frame_latency_s"]["live"] == 0.0341 and f["p50_frame_latency_s"]["live"] == 0.0112
    assert f["sessions_admitted"]["live"] == 14 and f["sessions_offered"]["live"] == 80
    assert f["preemptions"]["live"] == 0 and f["silent_frame_fraction"]["live"] == 0.0
    assert r["simulated"] is None and f["settled_sessions"]["simulated"] is None and r["n_star"] is None
    # the series are downsampled for the page: at most 300 points, the first half's climb kept
    s = r["live"]["series"]["sessions"]
    assert 100 < len(s["t_s"]) <= 300 and s["value"][0] < 3 and s["value"][-1] == SETTLED
    assert r["live"]["series"]["limit"]["value"] == [float(x) for x in ctl.limit]
    # the same workload for the simulator: the run's options, its pool and the controller's own parameters
    sc = r["scenario"]
    assert sc["options"] == {"kv": "sinks", "window": 368, "sinks": 16, "arrival_rate": 2.0, "rate_pattern": None,
                             "session_duration": "exp:20", "horizon": HORIZON, "seed": 0, "deadline": 0.08,
                             "admission": "aimd", "aimd_params": AIMD, "num_blocks": 600,
                             "phases": "aligned"}  # a run that does not say ran the driver's default, lockstep
    assert sc["stream"] == STREAM and sc["block_size"] == 16


def test_a_benchmark_folder_is_read_run_by_run_with_the_simulators_side(folders):
    from metronome.report.live import read_live

    live = read_live(folders["bench"])
    assert live["kind"] == "runs" and live["origin"] == "benchmark"
    assert list(live["runs"]) == ["window", "unbounded"]  # bounded first
    assert live["meta"] == {"deadline_s": 0.08, "num_blocks": 2000, "window": 368, "arrival_rate": 2.0,
                            "durations": "exp:20"}
    for name, r in live["runs"].items():
        assert r["n_star"] == 23 and r["n_star_policy"] == "window(W=368), 80 ms deadline, memory binds"
        assert r["simulated_by"] == "sim/" and r["simulated_with"] == "small-h200" and r["scenario"] is None
        sim_dir = folders["bench"] / name / "sim"
        steps = pd.read_parquet(sim_dir / "steps.parquet")
        ctl = pd.read_parquet(sim_dir / "controller.parquet")
        sim_summary = json.loads((sim_dir / "summary.json").read_text())
        f = r["figures"]
        want = second_half(steps.t_s, steps.running + steps.waiting)
        assert f["settled_sessions"]["simulated"] == pytest.approx(want)
        assert f["settled_sessions"]["live"] == pytest.approx(float(SETTLED))
        assert f["settled_sessions"]["relative_error"] == pytest.approx((want - SETTLED) / SETTLED)
        assert f["settled_limit"]["simulated"] == pytest.approx(second_half(ctl.t_s, ctl.limit))
        for k in ("p50_frame_latency_s", "p99_frame_latency_s", "silent_frame_fraction", "preemptions",
                  "sessions_admitted"):
            assert f[k]["simulated"] == sim_summary[k]
        assert f["sessions_offered"]["simulated"] == sim_summary["sessions_offered"]
    assert live["runs"]["window"]["label"] == "window(W=368)" and live["runs"]["window"]["bounded"]
    u = live["runs"]["unbounded"]
    assert u["label"] == "unbounded" and not u["bounded"]
    assert u["figures"]["preemptions"]["live"] == 9 and u["figures"]["silent_frame_fraction"]["live"] == 0.21


def test_a_validate_folder_reads_as_before(tmp_path):
    from metronome.report.live import read_live
    from test_report import LIVE_SUMMARY

    (tmp_path / "summary.json").write_text(json.dumps(LIVE_SUMMARY))
    live = read_live(tmp_path)
    assert live["kind"] == "validate" and set(live["policies"]) == {"unbounded", "window"}
    assert live["policies"]["unbounded"]["t_sat_relative_error"] == pytest.approx(-0.1 / 4.1)


def _rewrite(d: Path, name: str, fn) -> None:
    df = pd.read_parquet(d / name)
    fn(df).to_parquet(d / name, index=False)


BAD_RUNS = {
    "no controller.parquet": (lambda d: (d / "controller.parquet").unlink(), "controller.parquet: missing"),
    "bad JSON": (lambda d: (d / "summary.json").write_text('{"frames": 3, "controller": '),
                 "summary.json: not valid JSON"),
    "steps without sessions": (lambda d: _rewrite(d, "steps.parquet", lambda df: df.drop(columns=["sessions"])),
                               "steps.parquet: column 'sessions' missing"),
    "controller without limit": (lambda d: _rewrite(d, "controller.parquet", lambda df: df.drop(columns=["limit"])),
                                 "controller.parquet: column 'limit' missing"),
    "limit not numbers": (lambda d: _rewrite(d, "controller.parquet", lambda df: df.assign(limit="ten")),
                          "controller.parquet: column 'limit' must hold numbers"),
    "controller.parquet not Parquet": (lambda d: (d / "controller.parquet").write_text("t_s,limit\n1,2\n"),
                                       "controller.parquet: cannot read it as Parquet"),
    "p99 not a number": (lambda d: _edit(d, p99_frame_latency_s="fast"),
                         "summary.json: field 'p99_frame_latency_s' must be a non-negative number"),
    "controller not an object": (lambda d: _edit(d, controller=3),
                                 "summary.json: field 'controller' must be an object"),
    "no options, no sim/": (lambda d: _edit(d, options=None), "summary.json: field 'options' missing"),
    "no horizon": (lambda d: _edit(d, options=run_options("sinks", 600, horizon_s=None)),
                   "field 'options.horizon_s' missing"),
    "both rate and pattern": (lambda d: _edit(d, options=run_options("sinks", 600, rate_pattern="10:1")),
                              "'options.arrival_rate' and 'options.rate_pattern': exactly one"),
    "params not an object": (lambda d: _edit(d, controller={"name": "aimd", "params": [1]}),
                             "field 'controller.params' must be an object or null"),
}


def _edit(d: Path, **fields) -> None:
    obj = json.loads((d / "summary.json").read_text())
    obj.update(fields)
    (d / "summary.json").write_text(json.dumps(obj))


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_a_bad_run_folder_is_one_line_naming_the_file_and_field(tmp_path, case):
    from metronome.report.live import read_live

    d = tmp_path / "run"
    write_run(d)
    breaks, needle = BAD_RUNS[case]
    breaks(d)
    with pytest.raises(MetronomeError) as exc:
        read_live(d)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"--live {d}") and needle in msg, msg


def test_a_benchmarks_second_calibration_shows_beside_its_n_star(folders, tmp_path):
    """The benchmark calibrates the engine again after its run; the N* row says what that calibration gives."""
    import shutil

    from metronome.report.live import read_live

    bench = tmp_path / "bench"
    shutil.copytree(folders["bench"], bench)
    _edit(bench, n_star_after=21)
    runs = read_live(bench)["runs"]
    assert runs["window"]["n_star"] == 23
    assert runs["window"]["n_star_policy"] == ("window(W=368), 80 ms deadline, memory binds; "
                                               "21 from a calibration after the run")
    _edit(bench, n_star_pooled=22, calibrations_pooled=["calibration", "calibration-after"])
    assert read_live(bench)["runs"]["window"]["n_star_policy"].endswith(
        "21 from a calibration after the run; 22 from all 2 calibrations pooled")
    _edit(bench, repeat={"runs": 3})  # bench_live_aimd.py --repeat: the after-run calibration is the last one's
    policy = read_live(bench)["runs"]["window"]["n_star_policy"]
    assert "21 from a calibration after the last run; 22 from all 2" in policy
    _edit(bench, n_star_after="21")
    with pytest.raises(MetronomeError, match="field 'n_star_after' must be a non-negative number or null"):
        read_live(bench)
    _edit(bench, n_star_after=21, n_star_pooled=-1)
    with pytest.raises(MetronomeError, match="field 'n_star_pooled' must be a non-negative number or null"):
        read_live(bench)


def test_a_repeated_benchmarks_runs_of_one_policy_are_told_apart(folders, tmp_path):
    """``bench_live_aimd.py --repeat`` writes several bounded runs of one policy: each row and panel names its
    folder, so the runs do not read as one repeated."""
    import shutil

    from metronome.report.live import read_live

    bench = tmp_path / "bench"
    shutil.copytree(folders["bench"], bench)
    shutil.copytree(bench / "window", bench / "window-2")
    obj = json.loads((bench / "summary.json").read_text())
    _edit(bench, results={"window": obj["results"]["window"], "window-2": obj["results"]["window"],
                          "unbounded": obj["results"]["unbounded"]})
    runs = read_live(bench)["runs"]
    assert [r["label"] for r in runs.values()] == ["window(W=368) · window", "window(W=368) · window-2",
                                                   "unbounded"]
    assert [r["bounded"] for r in runs.values()] == [True, True, False]


def test_a_bad_benchmark_folder_names_the_missing_run_or_sim_file(folders, tmp_path):
    import shutil

    from metronome.report.live import read_live

    bench = tmp_path / "bench"
    shutil.copytree(folders["bench"], bench)
    (bench / "unbounded" / "sim" / "steps.parquet").unlink()
    with pytest.raises(MetronomeError, match=re.escape(f"--live {bench}/unbounded/sim/steps.parquet: missing")):
        read_live(bench)
    shutil.rmtree(bench / "unbounded")
    with pytest.raises(MetronomeError, match=re.escape(f"--live {bench}/unbounded: missing (the benchmark's "
                                                       "summary.json has results for 'unbounded')")):
        read_live(bench)
    _edit(bench, results=None)  # no results: the run subfolders are found by their controller.parquet
    assert list(read_live(bench)["runs"]) == ["window"]
    _edit(bench, n_star_sim="29")
    with pytest.raises(MetronomeError, match="field 'n_star_sim' must be a non-negative number or null"):
        read_live(bench)


def test_a_run_the_calibration_cannot_simulate_fails_before_any_work(folders, tmp_path):
    from metronome import calibration
    from metronome.report.live import check_resimulation, read_live

    cal = calibration.load(folders["cals"]["small-b200"])
    check_resimulation(read_live(folders["run"]), cal)  # the Moshi-like run: fine
    cases = {"stream": (run_options("sinks", 600, stream={"period_s": 0.1, "in": 14, "out": 2}),
                        "field 'options.stream': the run streamed a frame every 100 ms (14 in / 2 out), small-b200 "
                        "every 80 ms"),
             "blocks": (run_options("sinks", 600, block_size=32), "field 'options.block_size': the run used 32-token"),
             "admission": (run_options("sinks", 600, admission="bogus"), "cannot re-simulate the run with small-b200")}
    for name, (opts, needle) in cases.items():
        d = tmp_path / name
        write_run(d, options=opts)
        with pytest.raises(MetronomeError) as exc:
            check_resimulation(read_live(d), cal)
        assert needle in str(exc.value) and str(exc.value).startswith(f"--live {d}/summary.json"), str(exc.value)


def test_the_cli_rejects_a_bad_run_folder_in_one_line_and_writes_nothing(folders, tmp_path):
    d = tmp_path / "run"
    write_run(d)
    (d / "controller.parquet").unlink()
    out = tmp_path / "out"
    r = run_cli("report", "--calibration", str(folders["cals"]["small-b200"]), "--live", str(d), "--workers", "1",
                "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{d}/controller.parquet: missing" in lines[0], r.stderr
    assert "capacity" not in r.stdout and not out.exists()


# ------------------------------------------------------------------------------------------ the report
@pytest.fixture(scope="module")
def report(folders):
    """One report, two calibrations: the benchmark folder beside small-h200 (its sim/ was simulated with it) and
    the bare run folder beside small-b200 (re-simulated by the report)."""
    out = folders["base"] / "out"
    r = run_cli("report", "--calibration", str(folders["cals"]["small-h200"]), "--calibration",
                str(folders["cals"]["small-b200"]), *REPORT_ARGS, "--live", str(folders["bench"]),
                "--live", str(folders["run"]), "--out", str(out))
    assert r.returncode == 0, r.stderr
    md = (out / "report.md").read_text()
    return {"out": out, "md": md, "html": (out / "report.html").read_text(),
            "data": json.loads((out / "report.json").read_text()),
            "fidelity": md_section(md, "Fidelity")}


def _rows_by_run(table: list[list[str]]) -> dict[tuple[str, str], list[str]]:
    return {(row[0], row[1]): row[2:] for row in table[1:]}


def test_report_json_carries_the_runs_and_the_resimulation(report, folders):
    from metronome.results import settled_mean
    from metronome.sim import scenario as scn

    bench, run = (c["live"] for c in report["data"]["calibrations"])
    assert bench["kind"] == run["kind"] == "runs" and bench["origin"] == "benchmark" and run["origin"] == "run"
    assert bench["runs"]["window"]["figures"]["settled_sessions"]["live"] == pytest.approx(float(SETTLED))
    r = run["runs"]["run"]
    assert r["simulated_by"] == "report" and r["simulated_with"] == "small-b200" and "scenario" not in r
    assert r["simulated_options"]["num_blocks"] == 600 and r["simulated_options"]["aimd_params"] == AIMD
    # the report's simulation is the simulator's run of the same workload with its calibration
    res = scn.run(scn.make_scenario(calibration=str(folders["cals"]["small-b200"]), **r["simulated_options"]))
    f = r["figures"]
    want = settled_mean(res.steps.t_s, res.steps.running + res.steps.waiting, HORIZON)
    assert f["settled_sessions"]["simulated"] == pytest.approx(want)
    assert f["settled_sessions"]["relative_error"] == pytest.approx((want - SETTLED) / SETTLED)
    for k in ("p99_frame_latency_s", "silent_frame_fraction", "preemptions", "sessions_admitted"):
        assert f[k]["simulated"] == res.summary[k]
    # N*: the simulator's for the run's policy, pool and deadline
    assert isinstance(r["n_star"], int) and 0 < r["n_star"] <= 600
    assert re.fullmatch(r"sinks\(S=16, W=368\), 80 ms deadline, (memory|deadline) binds", r["n_star_policy"])
    assert len(r["simulated"]["series"]["sessions"]["t_s"]) > 50 and r["simulated"]["series"]["limit"] is not None


def test_report_md_has_the_fidelity_rows_of_every_run(report):
    data, fid = report["data"], report["fidelity"]
    tables = md_tables(fid)
    assert len(tables) == 2  # one per calibration
    for table, c in zip(tables, data["calibrations"]):
        assert table[0] == ["policy", "figure", "measured", "predicted", "error"]
        rows = _rows_by_run(table)
        for r in c["live"]["runs"].values():
            f = r["figures"]
            lab = r["label"]
            live, sim = f["settled_sessions"]["live"], f["settled_sessions"]["simulated"]
            assert rows[(lab, "settled concurrency (mean admitted, 2nd half)")] == [
                f"{live:.1f}", f"{sim:.1f}", f"{100 * (sim - live) / live:+.1f}%"]
            assert rows[(lab, "settled AIMD limit")][0] == f"{f['settled_limit']['live']:.1f}"
            assert rows[(lab, f"N* (simulator: {r['n_star_policy']})")] == ["n/a", f"{r['n_star']:,}", "n/a"]
            p99_sim = f["p99_frame_latency_s"]["simulated"]
            assert rows[(lab, "p99 frame latency")][:2] == ["34.1 ms", f"{1e3 * p99_sim:.1f} ms"]
            assert rows[(lab, "p50 frame latency")][0] == "11.2 ms"
            pre = f["preemptions"]
            assert rows[(lab, "preemptions")][:2] == [str(pre["live"]), f"{pre['simulated']:,}"]
            assert rows[(lab, "sessions admitted")][0] == "14 of 80"
            assert (lab, "silent frames") in rows
    bench_rows = _rows_by_run(tables[0])
    assert bench_rows[("unbounded", "silent frames")][0] == "21%" and bench_rows[("unbounded", "preemptions")][0] == "9"
    assert ("sinks(S=16, W=368)", "settled concurrency (mean admitted, 2nd half)") in _rows_by_run(tables[1])


def test_the_fidelity_sentence_says_where_the_simulation_comes_from(report, folders):
    fid = report["fidelity"]
    h200, b200 = fid.split("**small-b200.**", 1)
    assert "Live AIMD runs of benchmarks/bench_live_aimd.py" in h200 and str(folders["bench"]) in h200
    assert "simulated by the benchmark itself (its sim/ folder) with the calibration small-h200." in h200
    assert "window(W=368): live settled at 10.0 sessions" in h200 and "N* = 23: live -56.5%" in h200
    assert "A live admission run (metronome-probe run)" in b200 and str(folders["run"]) in b200
    assert (f"sinks(S=16, W=368): re-simulated here with this report's calibration small-b200 (estimated, "
            f"{folders['cals']['small-b200']}) on the run's own workload") in b200
    n_star = report["data"]["calibrations"][1]["live"]["runs"]["run"]["n_star"]
    assert "sinks(S=16, W=368): live settled at 10.0 sessions, simulated" in b200 and f"(N* = {n_star}: live" in b200
    assert "Poisson 2/s" in b200 and "80 ms deadline" in b200 and "600 blocks" in b200


def test_report_html_shows_the_live_vs_simulated_figure(report):
    page, data = report["html"], report["data"]
    assert page.count("Plotly.newPlot(") == 6 and 'data-figure="live"' in page  # (the tornado first)
    fidelity = page.split('<section id="fidelity">', 1)[1].split("</section>", 1)[0]
    assert 'id="fig-live"' in fidelity
    for t in md_tables(report["md"]):
        assert t in html_tables(page), f"a report.md table is not in report.html: {t[:2]}"
    from metronome.report.figures import live_runs

    fig = live_runs(data)
    names = [t.name for t in fig.data]
    # per run: live admitted and limit, simulated admitted and limit (3 runs over 2 calibrations)
    assert len(fig.data) == 12 and names.count("simulated admitted") == 3 and names.count("simulated limit") == 3
    assert {"window(W=368): live admitted", "unbounded: live limit", "sinks(S=16, W=368): live admitted"} <= set(names)
    live_adm = next(t for t in fig.data if t.name == "window(W=368): live admitted")
    assert max(live_adm.y) == SETTLED and min(live_adm.y) < 3
    n_star_lines = [s for s in fig.layout.shapes if s.line.dash == "dash"]
    run_n_star = data["calibrations"][1]["live"]["runs"]["run"]["n_star"]
    assert sorted(s.y0 for s in n_star_lines) == sorted([23, 23, run_n_star])
    titles = [a.text for a in fig.layout.annotations]
    assert "<b>small-h200</b> · window(W=368) · N* = 23" in titles


def test_a_report_without_run_data_has_no_live_figure():
    from metronome.report.figures import live_runs

    data = {"calibrations": [{"name": "x", "live": None}, {"name": "y", "live": {"kind": "validate", "policies": {}}}]}
    assert live_runs(data) is None


def test_a_simulation_from_another_calibration_is_said_so(report):
    import copy

    from metronome.report.answer import runs_fidelity

    c = copy.deepcopy(report["data"]["calibrations"][0])
    text, rows = runs_fidelity(c, c["live"])
    assert "with the calibration small-h200." in text and "not with this report's" not in text
    c["name"] = "other-cal"
    text, rows2 = runs_fidelity(c, c["live"])
    assert "with the calibration small-h200, not with this report's other-cal." in text and rows2 == rows


def test_the_live_figure_draws_in_a_browser(report, tmp_path):
    from test_report_browser import CHROMIUM, render

    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    result = render(report["out"] / "report.html", tmp_path)
    assert result["errors"] == []
    figs = {f["id"]: f for f in result["state"]["figures"]}
    assert list(figs) == ["fig-tornado", "fig-fill", "fig-metastability", "fig-signal", "fig-admission", "fig-live"]
    live = figs["fig-live"]
    assert live["hasLayout"] and live["width"] > 800 and live["height"] > 400
    assert sum(t["points"] > 0 for t in live["traces"]) == 12 and live["scatterPaths"] >= 12
    assert "sessions" in live["ytitles"]


def test_a_run_without_a_limit_has_no_limit_row(tmp_path):
    from metronome.report.answer import run_rows
    from metronome.report.live import attach_simulation, read_live, sim_side
    from metronome.sim import scenario as scn

    d = tmp_path / "run"
    write_run(d, options=run_options("sinks", 600, admission="none"))
    _rewrite(d, "controller.parquet", lambda df: df.assign(limit=None))  # admission none: no limit to trace
    _edit(d, controller={"name": "none", "params": None, "intervals": 40})
    r = read_live(d)["runs"]["run"]
    assert r["live"]["settled_limit"] is None and r["live"]["series"]["limit"] is None
    assert r["scenario"]["options"]["admission"] == "none" and r["scenario"]["options"]["aimd_params"] is None
    res = scn.run(scn.make_scenario(calibration="moshi-7b-h200", **r["scenario"]["options"]))
    assert res.controller_trace is None
    attach_simulation(r, sim_side(res.summary, res.steps, None), "moshi-7b-h200")
    figures = [row[1] for row in run_rows(r)]
    assert "settled concurrency (mean admitted, 2nd half)" in figures and not any("limit" in f for f in figures)
    assert r["figures"]["settled_sessions"]["simulated"] > 0 and r["simulated_with"] == "moshi-7b-h200"


# ------------------------------------------------------------------------------------------ the run's own calibration
def test_the_calibration_a_live_folder_records_is_the_one_planned_with(folders, tmp_path):
    from metronome.report.live import calibrations_for

    # validate and the benchmark keep theirs in calibration/ (the benchmark's pooled one first when it pooled)
    bench = tmp_path / "bench"
    write_benchmark(bench, folders["cals"]["small-h200"])
    (bench / "calibration").mkdir()
    (bench / "calibration" / "calibration.json").write_text(folders["cals"]["small-h200"].read_text())
    assert calibrations_for(None, [str(bench)], "moshi-7b-h200") == (
        (str(bench / "calibration" / "calibration.json"),), True)
    (bench / "calibration-before-pooled.json").write_text(folders["cals"]["small-b200"].read_text())
    assert calibrations_for(None, [str(bench)], "moshi-7b-h200")[0] == (str(bench / "calibration-before-pooled.json"),)
    # a run against a server simulated beside it with a preset: its sim/summary.json names it
    run = tmp_path / "run"
    write_run(run)
    scn_summary = {"calibration": "moshi-7b-b200", "horizon_s": HORIZON}
    (run / "sim").mkdir()
    (run / "sim" / "summary.json").write_text(json.dumps(scn_summary))
    from metronome.report.live import recorded_calibration

    assert recorded_calibration(run) == "moshi-7b-b200"
    # given, --calibration wins; neither given nor recorded: the default
    assert calibrations_for(["x.json"], [str(bench)], "moshi-7b-h200") == (("x.json",), False)
    assert calibrations_for(None, None, "moshi-7b-h200") == (("moshi-7b-h200",), False)


def test_a_live_run_that_records_no_calibration_is_not_planned_as_moshi(folders, tmp_path):
    """An in-process metronome-probe run (a tiny model on a CPU) records no calibration: without --calibration the
    report refuses in one line instead of attaching it to a Moshi/H200 plan."""
    out = tmp_path / "out"
    r = run_cli("report", "--live", str(folders["run"]), "--workers", "1", "--out", str(out))
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"--live {folders['run']}: the folder records no calibration to plan with" in line
    assert "give --calibration" in line and not out.exists() and "capacity" not in r.stdout


def test_the_page_names_every_setting_the_live_run_and_the_plan_do_not_share(report, folders):
    """The benchmark ran window(W=368) while the plan recommends sinks(S=16, W=368) (same deadline and pool); the run
    folder ran 600 blocks while small-b200 plans 2,600: each difference is named, in report.md and report.html."""
    md, page = report["md"], report["html"]
    h200, b200 = report["data"]["calibrations"]
    assert h200["live_differences"] == [{"parameter": "KV bound", "run": "window(W=368)", "plan": "sinks(S=16, W=368)",
                                         "flag": "--kv and its parameters"}]
    assert b200["live_differences"] == [{"parameter": "KV pool", "run": "600 blocks", "plan": "2,600 blocks",
                                         "flag": "a calibration of the run's pool"}]
    answer = md_section(md, "The answer")
    want_h200 = ("The live run and this plan differ in: KV bound (run window(W=368), plan sinks(S=16, W=368); --kv "
                 "and its parameters plans at the run's).")
    want_b200 = ("The live run and this plan differ in: KV pool (run 600 blocks, plan 2,600 blocks; a calibration of "
                 "the run's pool plans at the run's).")
    for want in (want_h200, want_b200):
        assert want in answer and want in report["fidelity"]
        assert want.replace("'", "&#x27;") in page
    assert "frame deadline (" not in answer  # both ran the plan's 80 ms


def test_a_deadline_that_differs_is_named_with_the_flag_that_plans_at_it(folders):
    from metronome import calibration
    from metronome.report.build import live_differences
    from metronome.report.live import read_live
    from metronome.report.plan import ReportOptions, make_plan

    spec = str(folders["cals"]["small-b200"])
    live = read_live(folders["run"])  # a run at 80 ms, the frame period
    plan = make_plan(spec, calibration.load(spec), ReportOptions(calibrations=(spec,), deadline_s=2.0))
    diff = {d["parameter"]: d for d in live_differences(plan, live)}
    assert diff["frame deadline"] == {"parameter": "frame deadline", "run": "80 ms", "plan": "2000 ms",
                                      "flag": "--deadline 0.08"}
    same = make_plan(spec, calibration.load(spec), ReportOptions(calibrations=(spec,)))
    assert "frame deadline" not in {d["parameter"] for d in live_differences(same, live)}


def test_report_live_without_calibration_plans_with_the_folders_own(folders, tmp_path):
    """`report --live DIR` alone: a validate folder's calibration/calibration.json is the plan's, the page says so,
    and the run's 100 ms deadline beside the plan's 80 ms (the frame period) is named with --deadline 0.1."""
    from test_report import LIVE_SUMMARY

    d = tmp_path / "validate"
    (d / "calibration").mkdir(parents=True)
    cal = d / "calibration" / "calibration.json"
    cal.write_text(folders["cals"]["small-h200"].read_text())
    (d / "summary.json").write_text(json.dumps({**LIVE_SUMMARY, "deadline_s": 0.1, "window": 368, "block_size": 16,
                                                "num_blocks": 2000, "stream": {"frame_period_s": 0.08}}))
    out = tmp_path / "out"
    r = run_cli("report", "--live", str(d), "--session-duration", "exp:120", "--mc-runs", "1", "--mc-edge-runs", "1",
                "--workers", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "report.json").read_text())
    (c,) = data["calibrations"]
    assert c["name"] == "small-h200" and c["spec"] == str(cal) and data["options"]["calibrations_from_live"]
    assert f"--calibration {cal}" in data["reproduce"]
    md = (out / "report.md").read_text()
    answer = md_section(md, "The answer")
    assert f"Planned with the calibration the live folder {d} records: small-h200 (estimated, {cal})." in answer
    # the folder ran unbounded and window(W=368): its bound is not the plan's sinks(S=16, W=368); same pool
    assert ("frame deadline (run 100 ms, plan 80 ms; --deadline 0.1 plans at the run's); KV bound (run "
            "window(W=368), plan sinks(S=16, W=368)") in answer
    assert "frame deadline (run 100 ms, plan 80 ms" in (out / "report.html").read_text()
