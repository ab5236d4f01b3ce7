import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent

# Tests never read or write the user's cache of simulated points (metronome/sim/cache.py): a session-wide
# temporary one, which subprocesses inherit; removed at exit. A test that needs its own sets the variable itself.
_CACHE = tempfile.mkdtemp(prefix="metronome-test-cache-")
os.environ["METRONOME_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def small_cal():
    """A small pool so scenarios saturate in seconds: Moshi-like stream, 16-token blocks."""
    from dataclasses import replace

    from metronome import calibration

    cal = calibration.load("moshi-7b-h200")
    return replace(cal, engine=replace(cal.engine, num_blocks=2_000))
