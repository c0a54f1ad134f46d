"""One function per CLI command. Each returns the exit code; the CLI only parses arguments.

Exit codes everywhere (repaudit/errors.py): 0 within thresholds, 1 divergence beyond thresholds,
2 bad input, 5 the machine failed (disk full, read-only file system).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from .compare.diff import diff_records
from .compare.render import diff_markdown, print_diff
from .compare.result import DEFAULT_CLIP, Thresholds
from .files import write_json_atomic, write_text_atomic


def diff(
    a: Path,
    b: Path,
    *,
    thresholds: Thresholds = Thresholds(),
    allow_partial: bool = False,
    clip: tuple[float, float] = DEFAULT_CLIP,
    json_path: Path | None = None,
    markdown_path: Path | None = None,
    html_path: Path | None = None,
    console: Console | None = None,
) -> int:
    result = diff_records(a, b, thresholds=thresholds, allow_partial=allow_partial, clip=clip)
    print_diff(result, console)
    if json_path:
        write_json_atomic(json_path, result.to_dict())
    if markdown_path:
        write_text_atomic(markdown_path, diff_markdown(result))
    if html_path:
        _diff_html(a, b, result, html_path)
    return 0 if result.passed else 1


def _diff_html(a: Path, b: Path, result, html_path: Path) -> None:
    from .compare.gate import GateResult, PairOutcome
    from .report import write_pair_html

    ida, idb = result.a.cell_id, result.b.cell_id
    cell, ref = (idb, ida) if ida != idb else (str(b), str(a))
    pair = PairOutcome(cell, ref, result=result, path_a=Path(a), path_b=Path(b))
    write_pair_html(GateResult("files", [pair], result.thresholds), html_path)


def report(
    run_dir: Path,
    *,
    thresholds: Thresholds = Thresholds(),
    html_path: Path | None = None,
    markdown_path: Path | None = None,
    console: Console | None = None,
) -> int:
    """RUN_DIR/report.html and RUN_DIR/report.md. Exit 0 once written (the verdict is the gate's job), 2 on bad input."""
    from .compare.gate import load_run
    from .report import write_run_report
    from .report.headline import verdict

    console = console or Console()
    run = load_run(run_dir)
    data = write_run_report(run, thresholds, html_path, markdown_path)
    text, tone = verdict(data)
    console.print(f"[{'green' if tone == 'pass' else 'red' if tone == 'fail' else 'yellow'}]{text}[/]")
    console.print(f"wrote {html_path or run.run_dir / 'report.html'} and {markdown_path or run.run_dir / 'report.md'}")
    return 0


def gate(
    paths: list[Path],
    *,
    thresholds: Thresholds = Thresholds(),
    junit_path: Path | None = None,
    allow_partial: bool = False,
    console: Console | None = None,
) -> int:
    """A run directory (every cell vs its reference) or two records (B vs A). 0 pass, 1 fail, 2 bad input."""
    from .compare.gate import gate_files, gate_run, load_run, print_gate
    from .errors import InputError
    from .report.junit import write_junit

    if len(paths) == 1:
        if not paths[0].exists():
            raise InputError(f"{paths[0]}: no such file or directory")
        if not paths[0].is_dir():
            raise InputError(f"{paths[0]}: expected a run directory (or two records: repaudit gate A.parquet B.parquet)")
        if allow_partial:
            raise InputError("--allow-partial applies to two records, not to a run directory")
        result = gate_run(load_run(paths[0]), thresholds)
    elif len(paths) == 2:
        result = gate_files(paths[0], paths[1], thresholds, allow_partial)
    else:
        raise InputError(f"gate takes a run directory or two records, got {len(paths)} paths")
    print_gate(result, console)
    if junit_path:
        write_junit(junit_path, result)
    return 0 if result.passed else 1


RUN_NEEDS = ("torch", "transformers", "pandas")  # the [run] extra; diff, gate, report and locate need none


def run(matrix, opts, console: Console | None = None, thresholds: Thresholds = Thresholds()) -> int:
    """`repaudit run`: the run stage, then summary.json from the gate's comparison of every cell with its
    reference (inside the run's lock, on the leader)."""
    import importlib.util

    from .errors import InputError

    missing = [m for m in RUN_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"repaudit run needs {', '.join(missing)}, which this install lacks: pip install 'repaudit[run]'")
    from .compare.summary import print_summary, summarize, write_summary
    from .run.runner import run as run_matrix

    def summary(plan, run_dir: Path, manifest, console: Console) -> bool:
        data = summarize(plan, run_dir, manifest, thresholds)
        write_summary(data, run_dir)
        print_summary(data, console)
        return data["passed"]

    return run_matrix(matrix, opts, console, summary)


def _one_cell(path: Path) -> Path:
    """locate's argument: a cell's record or trace. A run directory holds many cells: say which could be meant."""
    from .errors import InputError

    if not path.is_dir():
        return path
    traced = [p.name.removesuffix(".trace.parquet") for p in sorted((path / "cells").glob("*.trace.parquet"))]
    hint = f" (traced cells there: {', '.join(traced[:4])}{', ...' if len(traced) > 4 else ''})" if traced else ""
    raise InputError(f"{path} is a directory; locate compares two cells: give each one's record, "
                     f"RUN/cells/CELL.parquet{hint}")


def locate(a: Path, b: Path, *, json_path: Path | None = None, console: Console | None = None) -> int:
    from .compare.locate import locate as locate_cells, print_locate

    result = locate_cells(_one_cell(a), _one_cell(b))
    print_locate(result, console or Console())
    if json_path:
        write_json_atomic(json_path, result.to_dict())
    return 1 if result.diverged else 0
