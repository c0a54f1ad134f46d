"""One function per CLI command. Each returns the exit code; the CLI only parses arguments.

Exit codes everywhere: 0 within thresholds, 1 divergence beyond thresholds, 2 bad input.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from .diff import Thresholds, diff_records
from .files import write_json_atomic, write_text_atomic
from .render import diff_markdown, print_diff


def diff(
    a: Path,
    b: Path,
    *,
    thresholds: Thresholds = Thresholds(),
    allow_partial: bool = False,
    json_path: Path | None = None,
    markdown_path: Path | None = None,
    console: Console | None = None,
) -> int:
    result = diff_records(a, b, thresholds=thresholds, allow_partial=allow_partial)
    print_diff(result, console)
    if json_path:
        write_json_atomic(json_path, result.to_dict())
    if markdown_path:
        write_text_atomic(markdown_path, diff_markdown(result))
    return 0 if result.passed else 1


def run(matrix, opts, console: Console | None = None) -> int:
    from .run import run as run_matrix

    return run_matrix(matrix, opts, console)
