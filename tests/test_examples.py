"""The examples end as the CLIs do: what a user gets wrong is one line and exit 2, not a traceback."""

import subprocess
import sys
from pathlib import Path

from metronome.outputs import atomic_dir

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_an_example_refusing_its_out_folder_says_so_in_one_line(tmp_path):
    # run twice, the comparison finds its results from the first run in --out: refused before any work
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:  # an earlier run's folder, marked as every command marks its own
        (tmp / "report.md").write_text("an earlier run")
    p = subprocess.run([sys.executable, str(EXAMPLES / "compare_h200_b200_qwen3_omni.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"examples/compare_h200_b200_qwen3_omni.py: error: {out} already holds results; "
                                     "pass --replace to overwrite it"], p.stderr
    assert (out / "report.md").read_text() == "an earlier run"
