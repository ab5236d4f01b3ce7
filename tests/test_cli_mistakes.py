"""A sweep of plausible user mistakes across metronome-sim, metronome-probe and metronome-serve.

Each case is a command line as a user would type it with one mistake in it: a wrong unit, an option that would change
nothing, a typo in a flag, a choice or a preset, a missing or malformed file, an --out that holds the user's own
files. Every one must end in exactly one line on stderr, exit code 2, no traceback, and nothing written: the folder
the command runs in (its --out included) is byte for byte what it was. The error must come before any work, so no
case starts vLLM or a simulation; they run in-process through each CLI's ``main(argv)``, except the one whose
check comes after vLLM's logging is set (a subprocess keeps that setting out of the test process).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from metronome.cli import probe_cli, serve_cli, sim_cli

CLIS = {"sim": sim_cli.main, "probe": probe_cli.main, "serve": serve_cli.main}

# (cli, argv, a word the one line must hold); OUT is an --out that does not exist yet, USERDIR a folder of the
# user's own files, BROKEN a calibration that is not JSON, PARAMS an AIMD parameter file, MISSING a path that does
# not exist
CASES = [
    # -- wrong units: a bare number that must have meant another unit, or a unit no flag takes
    ("sim", ["capacity", "--deadline", "80"], "80ms"),
    ("sim", ["what-if", "--sessions", "10", "--deadline", "60,80", "--out", "OUT"], "60ms"),
    ("sim", ["run", "--sessions", "5", "--deadline", "100", "--out", "OUT"], "100ms"),
    ("sim", ["run", "--sessions", "5", "--calibration", "qwen3-omni-30b-a3b-h200", "--deadline", "40"], "40ms"),
    ("sim", ["run", "--sessions", "5", "--deadline", "80xs"], "unknown unit"),
    ("sim", ["report", "--deadline", "40", "--out", "OUT"], "40ms"),
    ("sim", ["fleet", "--arrival-rate", "1", "--deadline", "80", "--out", "OUT"], "80ms"),
    ("sim", ["report", "--offered-load", "10", "--max-refusal", "1", "--out", "OUT"], "1%"),
    ("sim", ["fleet", "--arrival-rate", "1", "--max-refusal", "5", "--out", "OUT"], "5%"),
    ("sim", ["capacity", "--percentile", "0.99"], "percent"),
    ("sim", ["capacity", "--target-fraction", "80"], "80%"),
    ("sim", ["tune-aimd", "--sessions", "2", "--miss-budget", "1", "--out", "OUT"], "1%"),
    ("sim", ["run", "--sessions", "5", "--horizon", "10parsecs"], "unknown unit"),
    ("sim", ["run", "--arrival-rate", "2/fortnight", "--session-duration", "10"], "unknown unit"),
    ("sim", ["what-if", "--sessions", "10", "--session-duration", "5mn", "--out", "OUT"], "unknown unit"),
    ("sim", ["fleet", "--arrival-rate", "1", "--autoscale", "--scale-out-utilization", "90", "--out", "OUT"], "90%"),
    ("probe", ["validate", "--model", "tiny", "--deadline", "80", "--out", "OUT"], "80ms"),
    ("probe", ["--model", "tiny", "--stream", "80:0:1", "--out", "OUT"], "80ms"),
    ("probe", ["--model", "tiny", "--kv-cache-gib", "100000", "--out", "OUT"], "MiB"),
    ("probe", ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "10", "--deadline", "100",
               "--out", "OUT"], "100ms"),
    ("probe", ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "10", "--session-duration", "5mn",
               "--out", "OUT"], "unknown unit"),
    ("serve", ["--model", "tiny", "--deadline", "100", "--out", "OUT"], "100ms"),
    ("serve", ["--model", "tiny", "--max-message-bytes", "64kb"], "unknown unit"),
    ("serve", ["--model", "tiny", "--drain-timeout", "30parsecs"], "unknown unit"),
    # -- options that would change nothing
    ("sim", ["what-if", "--sessions", "10", "--window", "368,736", "--out", "OUT"], "bounded --kv"),
    ("sim", ["capacity", "--window", "368"], "bounded --kv"),
    ("sim", ["run", "--sessions", "5", "--kv", "window", "--window", "368", "--sinks", "16"], "--sinks"),
    ("sim", ["metastability", "--sessions", "5", "--kv", "sinks", "--sinks", "16", "--window", "368",
             "--budget", "400"], "--budget"),
    ("sim", ["tune-aimd", "--sessions", "2", "--window", "368", "--out", "OUT"], "bounded --kv"),
    ("sim", ["fleet", "--arrival-rate", "1", "--kv", "unbounded", "--window", "368", "--out", "OUT"], "--window"),
    ("sim", ["report", "--kv", "window", "--sinks", "16", "--out", "OUT"], "--sinks"),
    ("sim", ["report", "--max-refusal", "0.02", "--out", "OUT"], "--offered-load"),
    ("sim", ["report", "--gpu-price", "moshi-7b-h200=3", "--out", "OUT"], "--offered-load"),
    ("sim", ["fleet", "--arrival-rate", "1", "--min-engines", "2", "--out", "OUT"], "--autoscale"),
    ("sim", ["fleet", "--arrival-rate", "1", "--aimd-params", "PARAMS", "--out", "OUT"], "--admission aimd"),
    ("sim", ["what-if", "--sessions", "10", "--ray-address", "auto", "--out", "OUT"], "--executor ray"),
    ("sim", ["run", "--sessions", "5", "--aimd-params", "PARAMS"], "--admission"),
    ("sim", ["run", "--arrival-rate", "2", "--session-duration", "10", "--ramp", "30"], "--ramp"),
    ("probe", ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "10", "--api-key", "k", "--out", "OUT"],
     "--target"),
    ("probe", ["--model", "tiny", "--window", "128", "--out", "OUT"], "bounded --kv"),
    ("probe", ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "10", "--poll", "2", "--out", "OUT"],
     "--target"),
    ("probe", ["run", "--model", "tiny", "--arrival-rate", "1", "--horizon", "10", "--max-restarts", "5",
               "--out", "OUT"], "--restart"),
    ("probe", ["--model", "tiny", "--num-blocks", "64", "--kv-cache-gib", "2", "--out", "OUT"], "--num-blocks"),
    ("serve", ["--model", "tiny", "--queue-timeout", "5"], "--admission"),
    ("serve", ["--model", "tiny", "--window", "128"], "bounded --kv"),
    # -- a bound that cannot work: what a rebase keeps plus one frame passes the model's max_model_len (65,536)
    ("sim", ["run", "--sessions", "2", "--kv", "sinks", "--sinks", "16", "--window", "65530", "--out", "OUT"],
     "max_model_len"),
    # -- typos in commands, flags, choices and preset names
    ("sim", ["capcity"], "invalid choice"),
    ("sim", ["run", "--sesions", "5"], "unrecognized"),
    ("sim", ["run", "--sessions", "5", "--kv", "sink"], "unknown KV policy"),
    ("sim", ["run", "--sessions", "5", "--calibration", "moshi-7b-a100"], "moshi-7b-a100"),
    ("sim", ["what-if", "--sessions", "10", "--phases", "independant", "--out", "OUT"], "--phases"),
    ("sim", ["fleet", "--arrival-rate", "1", "--routers", "least_loaded", "--out", "OUT"], "least_loaded"),
    ("probe", ["calbrate", "--model", "tiny"], "did you mean calibrate"),
    ("probe", ["--model", "tiny", "--kv", "sink", "--out", "OUT"], "invalid choice"),
    ("probe", ["--model", "tiyn", "--out", "OUT"], "tiyn"),
    ("serve", ["--model", "tiny", "--kv", "sink"], "invalid choice"),
    ("serve", ["--model", "tiny", "--admision", "aimd"], "unrecognized"),
    # -- missing or malformed files
    ("sim", ["run", "--sessions", "5", "--calibration", "MISSING.json"], "MISSING"),
    ("sim", ["run", "--sessions", "5", "--calibration", "BROKEN", "--out", "OUT"], "not valid JSON"),
    ("sim", ["run", "--rate-pattern", "MISSING.txt", "--session-duration", "10", "--out", "OUT"], "MISSING"),
    ("sim", ["fleet", "--load-csv", "MISSING.csv", "--out", "OUT"], "MISSING"),
    ("sim", ["run", "--sessions", "5", "--admission", "aimd", "--aimd-params", "MISSING.json"], "MISSING"),
    ("sim", ["report", "--calibration", "BROKEN", "--out", "OUT"], "not valid JSON"),
    ("probe", ["pool", "MISSING", "MISSING2", "--out", "OUT.json"], "MISSING"),
    ("probe", ["run", "--model", "tiny", "--rate-pattern", "MISSING.txt", "--horizon", "10", "--out", "OUT"],
     "MISSING"),
    ("serve", ["--model", "tiny", "--admission", "aimd", "--aimd-params", "MISSING.json"], "MISSING"),
    # -- --out hazards: the working folder, a folder of the user's own files (with and without --replace), a file
    ("sim", ["run", "--sessions", "5", "--out", "."], "--out"),
    ("sim", ["run", "--sessions", "5", "--out", "USERDIR", "--replace"], "did not write"),
    ("sim", ["what-if", "--sessions", "10", "--out", "USERDIR"], "did not write"),
    ("sim", ["report", "--out", "USERDIR", "--replace"], "did not write"),
    ("sim", ["capacity", "--out", "USERFILE"], "userfile.txt"),
    ("probe", ["--model", "tiny", "--out", "USERDIR", "--replace"], "did not write"),
    ("probe", ["validate", "--model", "tiny", "--out", ".", "--replace"], "--out"),
    ("serve", ["--model", "tiny", "--out", "USERDIR"], "did not write"),
    # a folder an earlier run wrote: the server has no --replace, so it must not advise one
    ("serve", ["--model", "tiny", "--out", "PREVRUN"], "choose another --out"),
]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder): what "nothing written" compares."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working folder holding the user's files the cases name, the command run from inside it."""
    (tmp_path / "broken.json").write_text('{"name": ')
    (tmp_path / "params.json").write_text('{"additive_increase": 2}')
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("my notes\n")
    (user / "sub" / "keep.py").write_text("print('keep me')\n")
    (tmp_path / "userfile.txt").write_text("not a folder\n")
    prev = tmp_path / "prev"  # what an earlier metronome-serve wrote, marked as metronome.outputs marks it
    prev.mkdir()
    (prev / "accounts.jsonl").write_text("{}\n")
    (prev / ".metronome.json").write_text(json.dumps({"program": "metronome", "command": "metronome-serve",
                                                     "version": "0.1.0", "written_at": "2026-12-04T00:00:00+00:00",
                                                     "files": ["accounts.jsonl"]}))
    monkeypatch.chdir(tmp_path)
    # what a live command sets for the engine it would start stays out of the test process
    for name in ("VLLM_LOGGING_LEVEL", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    return tmp_path


def _argv(argv: list[str], root: Path) -> list[str]:
    names = {"OUT": "out", "OUT.json": "out.json", "USERDIR": "mine", "USERFILE": "userfile.txt", "PREVRUN": "prev",
             "BROKEN": "broken.json", "PARAMS": "params.json"}
    return [str(root / names[a]) if a in names else a for a in argv]


@pytest.mark.parametrize("cli, argv, says", CASES, ids=[f"{c}-{' '.join(a)}" for c, a, _ in CASES])
def test_a_mistake_is_one_line_exit_2_and_nothing_written(workdir, capsys, cli, argv, says):
    before = _tree(workdir)
    try:
        rc = CLIS[cli](_argv(argv, workdir))
    except SystemExit as exc:  # (argparse's own usage errors exit from inside parse_args)
        rc = exc.code
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "error: " in lines[0], err
    assert "Traceback" not in err
    assert says in lines[0], lines[0]
    assert _tree(workdir) == before  # nothing written: no --out, no temp folder, the user's files as they were


def test_a_gpu_preset_on_a_machine_without_one_says_so_once(tmp_path):
    """``metronome-probe --model qwen3-omni`` on a host whose vLLM runs on the CPU: one message that it needs a GPU
    host and offers ``--model tiny`` to try the probe here (no advice that then fails on memory)."""
    from metronome.probe.engine import default_device

    if default_device() != "cpu":
        pytest.skip("this host's vLLM runs on a GPU")
    r = subprocess.run([sys.executable, "-m", "metronome.cli.probe_cli", "--model", "qwen3-omni", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "needs a GPU host" in lines[0] and "--model tiny" in lines[0] and "--weights dummy" not in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_holds_at_least_40_mistakes_over_the_three_clis():
    assert len(CASES) >= 40 and {c for c, _, _ in CASES} == set(CLIS)
    # the README says how many mistakes the sweep tries: the parametrised cases and the GPU preset's own test
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"tries {len(CASES) + 1} such mistakes" in readme
