"""metronome-sim as a user runs it: what it prints, what it writes, and how it fails."""

import json
import re

import pandas as pd
import pytest

from fixed_engine import write_fast_moshi
from sim_cli_helpers import run_cli

SUMMARY_KEYS = {"t_sat_predicted_s", "t_sat_observed_s", "silent_frame_fraction", "deadline_miss_fraction",
                "p50_frame_latency_s", "p99_frame_latency_s", "peak_pool_occupancy", "collapsed",
                "sessions_admitted", "frames", "seed", "wall_s"}


def test_run_prints_t_sat_and_writes_its_files(tmp_path):
    out = tmp_path / "run"
    r = run_cli("run", "--sessions", "800", "--horizon", "90", "--num-blocks", "16000", "--out", str(out))
    assert r.returncode == 0, r.stderr
    # 800 sessions are past this preset's throughput (N* 263), so their KV grows on the engine's clock, not the
    # stream's 25.7 s (20 blocks each of 16000, 321 tokens at 12.5 tokens/s): the line prints both t_sat, and they
    # agree to within a frame period (the simulator's sessions join up to one period late)
    m = re.search(r"predicted ([0-9.]+) s · observed ([0-9.]+) s", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) > 30.0 and abs(float(m.group(1)) - float(m.group(2))) <= 0.08 + 0.05, r.stdout
    assert "COLLAPSED" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [".metronome.json", "frames.parquet", "sessions.parquet",
                                                     "steps.parquet", "summary.json"]
    s = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(s)
    assert s["collapsed"] is True and s["seed"] == 0
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"t_s", "batch", "resident_blocks", "free_blocks", "step_s", "tokens_out", "silent_frames",
            "preemptions"} <= set(steps.columns)
    sessions = pd.read_parquet(out / "sessions.parquet")
    assert {"admitted_s", "ended_s", "frames", "silent_frames", "deadline_misses"} <= set(sessions.columns)
    assert len(sessions) == 800


def test_run_bounded_is_healthy():
    r = run_cli("run", "--sessions", "300", "--horizon", "90", "--num-blocks", "9000", "--kv", "sinks",
                "--sinks", "16", "--window", "368", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["collapsed"] is False and s["t_sat_observed_s"] is None and s["silent_frame_fraction"] == 0


@pytest.mark.parametrize("args,needle", [
    (["--calibration", "no-such-preset", "--sessions", "2"], "unknown calibration preset"),
    (["--calibration", "BROKEN", "--sessions", "2"], "not valid JSON"),
    (["--kv", "window", "--window", "8", "--sessions", "2"], "under one block"),
    (["--kv", "sinks", "--sinks", "400", "--window", "368", "--sessions", "2"], "fewer than the window"),
    (["--arrival-rate", "-2", "--session-duration", "10"], "--arrival-rate must be a positive"),
    (["--sessions", "5", "--horizon", "0"], "--horizon must be a positive"),
    (["--sessions", "5", "--num-blocks", "3", "--kv", "sinks", "--sinks", "16", "--window", "368"], "too small"),
    (["--sessions", "5", "--session-duration", "exp:-3"], "session duration must be positive"),
    (["--sessions", "5", "--admission", "static:0"], "static admission limit must be >= 1"),
    (["--sessions", "x"], "cannot read 'x'"),
    (["--sessions", "5", "--phases", "lockstep"], "--phases must be one of independent, aligned"),
    (["--bogus"], "unrecognized arguments"),
    # a flag that cannot apply is refused, whether or not its file exists
    (["--sessions", "5", "--admission", "none", "--aimd-params", "MISSING"], "does not apply to --admission none"),
    (["--sessions", "5", "--aimd-params", "PARAMS"], "does not apply to --admission none"),
    (["--sessions", "5", "--admission", "aimd", "--aimd-params", "MISSING"], "no such AIMD parameter file"),
    (["--sessions", "5", "--admission", "static:4", "--aimd-params", "MISSING"], "no such AIMD parameter file"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, needle):
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": ')
    params = tmp_path / "params.json"
    params.write_text('{"additive_increase": 2}')
    files = {"BROKEN": broken, "PARAMS": params, "MISSING": tmp_path / "missing.json"}
    args = [str(files.get(a, a)) for a in args]
    out = tmp_path / "out"
    r = run_cli("run", *args, "--out", str(out))
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp leftovers


def test_what_if_writes_one_row_per_point(tmp_path):
    out = tmp_path / "wi"
    r = run_cli("what-if", "--calibration", str(write_fast_moshi(tmp_path)), "--sessions", "100:300:100", "--kv",
                "unbounded,sinks", "--window", "368", "--sinks", "16", "--horizon", "60", "--num-blocks", "9000",
                "--out", str(out), "--workers", "2")
    assert r.returncode == 0, r.stderr
    table = pd.read_parquet(out / "what_if.parquet")
    assert len(table) == 6 and len(pd.read_csv(out / "what_if.csv")) == 6
    assert SUMMARY_KEYS <= set(table.columns)
    assert set(table.opt_kv) == {"unbounded", "sinks"} and set(table.opt_sessions) == {100, 200, 300}
    unb = table[table.opt_kv == "unbounded"].set_index("opt_sessions")
    assert unb.loc[300, "collapsed"] and not unb.loc[100, "collapsed"]
    assert not table[table.opt_kv == "sinks"].collapsed.any()  # 300 sessions < the 360-session ceiling


def test_what_if_bad_point_fails_before_any_work(tmp_path):
    out = tmp_path / "wi"
    r = run_cli("what-if", "--sessions", "10", "--kv", "window", "--window", "64,8", "--out", str(out))
    assert r.returncode == 2 and "under one block" in r.stderr and "window=8" in r.stderr
    assert not out.exists()


def test_calibrations_lists_presets_with_provenance():
    r = run_cli("calibrations")
    assert r.returncode == 0
    for name in ("moshi-7b-h200", "qwen3-omni-30b-a3b-b200", "minicpm-o-4.5-h200", "qwen2.5-omni-7b-b200"):
        assert name in r.stdout
    assert "estimated" in r.stdout


@pytest.mark.parametrize("flag_args", [["--admission", "aimd"], ["--aimd-params", "params.json"]])
def test_tune_aimd_refuses_the_flags_it_searches_itself(tmp_path, flag_args):
    out = tmp_path / "out"
    r = run_cli("tune-aimd", "--sessions", "2", "--horizon", "5", *flag_args, "--out", str(out), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "tune-aimd searches the AIMD parameters" in r.stderr
    assert not out.exists()


def test_calibrations_never_cut_a_preset_name_in_an_80_column_terminal(monkeypatch, capsys):
    """A real rich Console 80 columns wide (COLUMNS, as a terminal sets it): every preset's name whole on its row,
    no line past the width, and the headers carry units."""
    from metronome import calibration as calmod
    from metronome.cli import sim_cli

    monkeypatch.setenv("COLUMNS", "80")
    assert sim_cli.main(["calibrations"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    for name in calmod.preset_names():
        assert any(line.split()[:1] == [name] for line in lines), name
    monkeypatch.setenv("COLUMNS", "200")
    sim_cli.main(["calibrations"])
    header = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["name"])
    for unit in ("KiB", "blocks", "tokens", "ms", "tok/s", "t_sat s"):
        assert unit in header, (unit, header)


def test_durations_and_rates_take_their_units():
    """``80ms``, ``0.5min`` and ``120/min`` mean 0.08 s, 30 s and 2 sessions/s (a bare number stays seconds)."""
    r = run_cli("run", "--json", "--arrival-rate", "120/min", "--session-duration", "exp:10s", "--horizon", "0.5min",
                "--deadline", "80ms", "--kv", "sinks", "--sinks", "16", "--window", "368")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["deadline_s"] == pytest.approx(0.08) and s["horizon_s"] == 30  # (approx: 80 * 1e-3 in binary)
    assert "2/s" in s["workload"] or "rate 2" in s["workload"], s["workload"]


def test_the_first_simulation_says_it_compiles_once(tmp_path):
    """With numba's cache empty for the compiled loop (NUMBA_CACHE_DIR: a fresh folder), the notice comes once; the
    check reads numba's cache index and compiles nothing (the folder holds no machine code after it)."""
    import os
    import subprocess
    import sys

    code = "from metronome.cli import sim_cli; sim_cli.compile_notice(); sim_cli.compile_notice()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("compiling the simulator") == 1, r.stdout
    assert not list(tmp_path.rglob("*.nbc"))


def test_cold_reads_numbas_cache_index(tmp_path):
    """compiled.cold: True for a cached function never compiled, False once its machine code is on disk (a fresh
    process asks), True again when its source changed."""
    import os
    import subprocess
    import sys

    src = tmp_path / "tinymod.py"
    src.write_text("import numba\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    ask = ("import sys; sys.path.insert(0, %r); import tinymod; from metronome.compiled import cold; "
           "print(cold([tinymod.f])); tinymod.f(1)" % str(tmp_path))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def cold_now():
        r = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()[-1]

    assert cold_now() == "True"
    assert cold_now() == "False"
    src.write_text("import numba\n@numba.njit(cache=True)\ndef f(x):\n    return x + 2\n\n")
    assert cold_now() == "True"
