"""Helpers shared by the simulator-side tests (a plain module: conftest names collide across folders)."""

import subprocess
import sys


def run_cli(*args, cwd=None):
    """Run metronome-sim in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
