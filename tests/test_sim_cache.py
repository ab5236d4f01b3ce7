"""The cache of simulated points (metronome/sim/cache.py): a second build reads what the first stored, a changed
calibration misses, --no-cache writes nothing, and the key follows content, not names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from metronome.sim import cache as cache_mod
from metronome.sim.cache import CACHE_ENV, ResultCache, cache_dir, task_key
from metronome.sim.executors import LocalExecutor


def run_cli(*args, env: dict):
    """metronome-sim in a subprocess (as tests/sim_cli_helpers.py), with its own cache folder."""
    return subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})

CALLS: list = []  # what _square really computed (the serial executor runs it in this process)


def _square(task: dict) -> dict:
    CALLS.append(task["x"])
    return {"y": task["x"] ** 2}


def _small(folder: Path, name: str = "cache-small", blocks: int = 1500) -> Path:
    from metronome import calibration

    cal = calibration.load("moshi-7b-h200")
    cal = replace(cal, name=name, engine=replace(cal.engine, num_blocks=blocks))
    p = folder / f"{name}-{blocks}.json"
    p.write_text(cal.to_json())
    return p


def test_the_folder_honours_the_override_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "metronome"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "metronome"


def test_a_second_map_reads_what_the_first_stored(tmp_path):
    CALLS.clear()
    ex = LocalExecutor(workers=1)
    tasks = [{"x": 1}, {"x": 2}, {"x": 3}]
    first = ResultCache(tmp_path / "c")
    assert first.map(ex, _square, tasks) == [{"y": 1}, {"y": 4}, {"y": 9}]
    assert (first.hits, first.misses, first.writes) == (0, 3, 3)
    first.close()
    again = ResultCache(tmp_path / "c")  # another process, later: the same folder
    assert again.map(ex, _square, tasks + [{"x": 4}]) == [{"y": 1}, {"y": 4}, {"y": 9}, {"y": 16}]
    assert (again.hits, again.misses) == (3, 1)
    assert CALLS == [1, 2, 3, 4]  # each point computed once


def test_the_key_is_the_calibration_contents_not_its_path(tmp_path):
    a = _small(tmp_path)
    b = tmp_path / "copy.json"
    b.write_text(a.read_text())
    changed = _small(tmp_path, blocks=1600)
    key = lambda spec: task_key(_square, {"calibration": str(spec), "x": 1})  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(changed)
    assert key(a) != task_key(_square, {"calibration": str(a), "x": 2})


def test_disabled_runs_everything_and_touches_no_disk(tmp_path):
    CALLS.clear()
    c = ResultCache(tmp_path / "never", enabled=False)
    c.map(LocalExecutor(workers=1), _square, [{"x": 5}])
    c.map(LocalExecutor(workers=1), _square, [{"x": 5}])
    assert CALLS == [5, 5] and not (tmp_path / "never").exists()


def test_a_folder_that_cannot_be_made_runs_the_work_without_the_cache(tmp_path, capsys):
    """The cache is a convenience: a file where its folder should be (or a read-only home) turns it off with one
    line on stderr, and every point is still computed."""
    CALLS.clear()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    c = ResultCache(blocker / "cache")
    assert c.map(LocalExecutor(workers=1), _square, [{"x": 6}, {"x": 7}]) == [{"y": 36}, {"y": 49}]
    assert CALLS == [6, 7] and c.stats()["enabled"] is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cache of simulated points off" in err


# ------------------------------------------------------------------------------------- the code version
@pytest.fixture
def fresh_version():
    """code_version is computed once per process: forget it around a test that changes what it reads."""
    cache_mod.code_version.cache_clear()
    yield
    cache_mod.code_version.cache_clear()


@pytest.fixture
def copied_sources(tmp_path, monkeypatch, fresh_version):
    """The real packages' folders copied to ``tmp_path`` (core, simulator, presets), and the cache's hashing pointed at
    the copies: a test edits a copy, never the source. Returns {package: its copy}."""
    import importlib

    copies = {}
    for package in ("metronome", "metronome.sim", "metronome.presets"):
        real = Path(importlib.import_module(package).__file__).parent
        copies[package] = tmp_path / package
        shutil.copytree(real, copies[package], ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(cache_mod, "_package_dir", lambda package: copies.get(package) or tmp_path / "none")
    return copies


def _key():
    return task_key(_square, {"calibration": "moshi-7b-h200", "x": 1})


@pytest.mark.parametrize("package,name", [("metronome.sim", "scenario.py"), ("metronome.sim", "fastpath.py"),
                                          ("metronome", "serving.py"), ("metronome.presets", "moshi-7b-b200.json")])
def test_a_changed_module_or_preset_changes_the_key(copied_sources, package, name):
    """A result depends on the simulator (sim/), the core (metronome/) and the presets: an edit to any of them (here
    to a copy, a byte appended) must miss, or a changed simulator would serve stale results. (A preset other than
    the task's own counts too: a default may read it.)"""
    before = _key()
    cache_mod.code_version.cache_clear()
    assert _key() == before  # nothing changed: the same key
    f = copied_sources[package] / name
    f.write_bytes(f.read_bytes() + b"\n")
    cache_mod.code_version.cache_clear()
    assert _key() != before, f"{package}/{name} changed and the key did not"


def test_the_key_hashes_every_module_of_the_simulator_and_the_core(fresh_version):
    """Every .py file in the folders the simulator and the core are imported from, and every shipped preset, is
    among the files hashed (found here by where the modules live, not by the cache's own list)."""
    import metronome.front_end
    import metronome.sim.fastpath

    hashed = {p.resolve() for _, p in cache_mod.code_files("metronome.sim.fastpath")}
    want = (set(Path(metronome.sim.fastpath.__file__).parent.glob("*.py"))
            | set(Path(metronome.front_end.__file__).parent.glob("*.py"))
            | set((Path(metronome.front_end.__file__).parents[1] / "calibration").glob("*.json")))
    assert len(want) > 40 and not {p.resolve() for p in want} - hashed


def test_the_report_tasks_key_covers_the_modules_beside_them(fresh_version):
    """A report task (metronome/report/build.py) calls its neighbours (report/live.py, report/plan.py): they are
    hashed with it."""
    import metronome.report.build
    import metronome.report.live

    hashed = {p.resolve() for _, p in cache_mod.code_files("metronome.report.build")}
    assert Path(metronome.report.live.__file__).resolve() in hashed


def test_a_changed_numba_changes_the_key(monkeypatch, fresh_version):
    """The same code under another numba (it compiles the hot loop; numpy draws the streams) may compute another
    result: its version is in the key."""
    from importlib import metadata

    before = _key()
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1" if name == "numba" else real(name))
    cache_mod.code_version.cache_clear()
    assert _key() != before


# ------------------------------------------------------------------------------------------- the report
ARGS = ["--session-duration", "exp:60", "--mc-runs", "1", "--mc-edge-runs", "2", "--workers", "1"]


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    """A cold build into a fresh cache (as a user would: the CLI), then the same build again."""
    base = tmp_path_factory.mktemp("cache-report")
    cal = _small(base)
    env_cache = base / "cache"
    out = {}
    for run in ("cold", "warm"):
        r = run_cli("report", "--calibration", str(cal), *ARGS, "--out", str(base / run),
                    env={CACHE_ENV: str(env_cache)})
        assert r.returncode == 0, r.stderr
        out[run] = json.loads((base / run / "report.json").read_text())
    return {"base": base, "cal": cal, "cache": env_cache, **out}


def test_a_second_report_reads_every_point_from_the_cache(small_report):
    cold, warm = small_report["cold"]["cache"], small_report["warm"]["cache"]
    assert cold["hits"] == 0 and cold["writes"] == cold["misses"] > 0
    assert warm["misses"] == 0 and warm["writes"] == 0 and warm["hits"] == cold["misses"]
    # and the report is the same report
    strip = lambda d: {k: v for k, v in d.items() if k not in ("cache", "wall_s", "command")}  # noqa: E731
    assert strip(small_report["cold"]) == strip(small_report["warm"])


def test_a_changed_calibration_misses(small_report):
    base = small_report["base"]
    changed = base / "changed.json"
    d = json.loads(small_report["cal"].read_text())
    d["engine"]["num_blocks"] += 100
    changed.write_text(json.dumps(d))
    r = run_cli("report", "--calibration", str(changed), *ARGS, "--out", str(base / "changed"),
                env={CACHE_ENV: str(small_report["cache"])})
    assert r.returncode == 0, r.stderr
    c = json.loads((base / "changed" / "report.json").read_text())["cache"]
    # every task carries the calibration, so none is read back (a key on its name would hit the capacity phase)
    assert c["hits"] == 0 and c["misses"] > 0 and c["writes"] == c["misses"]


def test_no_cache_writes_nothing(tmp_path):
    cal = _small(tmp_path)
    r = run_cli("report", "--calibration", str(cal), *ARGS, "--no-cache", "--out", str(tmp_path / "out"),
                env={CACHE_ENV: str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "cache").exists()
    c = json.loads((tmp_path / "out" / "report.json").read_text())["cache"]
    assert c["enabled"] is False and c["hits"] == 0 and c["writes"] == 0
    assert "cache off" in r.stdout
