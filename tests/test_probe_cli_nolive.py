"""metronome-probe without vLLM: it names the extra to install and exits 2 (no engine, runs anywhere)."""

import subprocess
import sys

import pytest

# Run the CLI in a fresh interpreter where `import vllm` fails, whatever this environment has installed.
NO_VLLM = "import sys; sys.modules['vllm'] = None; from metronome.cli.probe_cli import main; sys.exit(main())"


def _probe(*args):
    return subprocess.run([sys.executable, "-c", NO_VLLM, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ["--model", "tiny", "--out", "unused"],
    ["calibrate", "--model", "tiny", "--out", "unused"],
])
def test_without_vllm_names_the_extra_and_exits_2(args, tmp_path):
    res = subprocess.run([sys.executable, "-c", NO_VLLM, *args], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "metronome[live-cpu]" in res.stderr and "metronome[live]" in res.stderr
    assert not (tmp_path / "unused").exists()  # nothing written


def test_help_works_without_vllm():
    res = _probe("--help")
    assert res.returncode == 0 and "--model" in res.stdout and "--resume" in res.stdout


def test_probe_package_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None; import metronome.probe.models, metronome.probe.engine, "
            "metronome.probe.driver, metronome.probe.calibrate, metronome.probe.records; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_usage_errors_are_one_line():
    res = _probe("--model", "tiny")  # --out missing
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--out" in res.stderr
