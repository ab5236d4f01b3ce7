"""Capacity-planning reports: from a calibration to a decision, as report.html and report.md.

``build_report`` computes every number from the sim layer (:mod:`metronome.report.build`);
``render_html`` and ``render_markdown`` print the same numbers (:mod:`metronome.report.answer` formats
them once); ``write_report`` writes the folder all at once, or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from metronome.outputs import atomic_dir
from metronome.report.build import build_report, reproduce_command
from metronome.report.html import render_html
from metronome.report.markdown import answer_markdown, render_markdown
from metronome.report.plan import ReportOptions

REPORT_FILES = ("report.html", "report.md", "report.json")

__all__ = ["ReportOptions", "build_report", "render_html", "render_markdown", "answer_markdown", "write_report",
           "reproduce_command", "REPORT_FILES"]


def write_report(data: dict, out: str | Path, replace: bool = False) -> Path:
    """Render both pages and write report.html, report.md and report.json (the data) into ``out``, all at once
    (:func:`metronome.outputs.atomic_dir`: a failure leaves ``out`` as it was)."""
    with atomic_dir(out, replace) as tmp:
        (tmp / "report.json").write_text(json.dumps(data, indent=1) + "\n")
        (tmp / "report.md").write_text(render_markdown(data))
        (tmp / "report.html").write_text(render_html(data))
    return Path(out)
