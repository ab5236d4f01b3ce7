import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
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
