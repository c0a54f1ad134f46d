"""`repaudit report` and `repaudit diff --html`: report.html (inline SVG plots) and report.md.

build.py gathers the numbers (diffs through the gate, rows through arrays.py, text through
tokens.py); headline.py and tables.py turn them into text; html.py and md.py lay them out;
svg.py draws.
"""

from __future__ import annotations

from pathlib import Path

from ..compare.gate import GateResult, RunInfo
from ..compare.result import Thresholds
from ..files import write_text_atomic
from .build import ReportData, build_pair, build_run
from .html import render_html
from .md import render_markdown

__all__ = ["ReportData", "build_pair", "build_run", "render_html", "render_markdown", "write_run_report", "write_pair_html"]


def write_run_report(run: RunInfo, thresholds: Thresholds, html_path: Path | None = None,
                     md_path: Path | None = None) -> ReportData:
    data = build_run(run, thresholds)
    write_text_atomic(html_path or run.run_dir / "report.html", render_html(data))
    write_text_atomic(md_path or run.run_dir / "report.md", render_markdown(data))
    return data


def write_pair_html(gate: GateResult, html_path: Path) -> ReportData:
    data = build_pair(gate.pairs[0], gate.thresholds, gate)
    write_text_atomic(html_path, render_html(data))
    return data
