"""Capacity-planning reports: from a calibration to a decision, as report.html and report.md.

``build_report`` computes every number from the sim layer (:mod:`metronome.report.build`);
``render_html`` and ``render_markdown`` print the same numbers (:mod:`metronome.report.answer` formats
them once); ``write_report`` writes the folder all at once, or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from metronome.errors import MetronomeError
from metronome.report.build import build_report, reproduce_command
from metronome.report.html import render_html
from metronome.report.markdown import answer_markdown, render_markdown
from metronome.report.plan import ReportOptions

REPORT_FILES = ("report.html", "report.md", "report.json")

__all__ = ["ReportOptions", "build_report", "render_html", "render_markdown", "answer_markdown", "write_report",
           "reproduce_command", "check_out_dir", "REPORT_FILES"]


def check_out_dir(out: str | Path) -> Path:
    """Fail before any work if ``out`` cannot become the report folder."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise MetronomeError(f"--out {p}: exists and is not a folder")
    parent = p.parent if str(p.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise MetronomeError(f"--out {p}: {parent} is not a folder")
    return p


def write_report(data: dict, out: str | Path) -> Path:
    """Render both pages and write report.html, report.md and report.json (the data) into ``out``.

    Everything is rendered into a temporary folder beside ``out`` first and moved in at the end, so a
    failure leaves ``out`` as it was."""
    out = check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "report.json").write_text(json.dumps(data, indent=1) + "\n")
        (tmp / "report.md").write_text(render_markdown(data))
        (tmp / "report.html").write_text(render_html(data))
        out.mkdir(parents=True, exist_ok=True)
        for name in REPORT_FILES:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
