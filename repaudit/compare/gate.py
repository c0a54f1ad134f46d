"""`repaudit gate`: every cell of a run against its reference (or one record against another),
a verdict per pair, an exit code, and optionally JUnit XML.

A pair fails when its diff is beyond the thresholds, when either cell did not complete, or
when a record is missing or unreadable; the reason says which. A combination the plan refused
(a scenario that cannot give a meaningful cell, run.scenarios.REFUSED) is no pair: it is
listed as refused, with why, and neither passes nor fails. The run directory form never
stops at the first bad cell: every pair gets its verdict, so a CI page lists them all.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import IncomparableRecords, InputError
from ..run.jobspec import cell_path
from ..run.plan import Plan, plan_from_manifest, reference_delta, reference_pairs
from ..run.rundir import Manifest, ManifestData
from .diff import diff_records
from .labels import cell_settings, short_labels
from .render import metric_rows, pct, verdict_line
from .result import DEFAULT_CLIP, DiffResult, Thresholds, json_float
from .stored import Store


@dataclass
class RunInfo:
    """A run directory, read: its manifest and the plan it was made with."""

    run_dir: Path
    manifest: ManifestData
    plan: Plan

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name or "run"

    def entry(self, cell_id: str) -> dict[str, Any]:
        return self.manifest.cells.get(cell_id, {})

    def path(self, cell_id: str) -> Path:
        return cell_path(self.run_dir, cell_id)


def load_run(run_dir: Path) -> RunInfo:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: not a directory (expected a run directory made by `repaudit run`)")
    if not (run_dir / "manifest.json").is_file():
        raise InputError(f"{run_dir}: no manifest.json here (not a run directory made by `repaudit run`)")
    manifest = Manifest.load_or_new(run_dir).data
    return RunInfo(run_dir, manifest, plan_from_manifest(manifest))


@dataclass
class PairOutcome:
    """One cell against its reference. `result` is None when no diff could be made (see `failure`)."""

    cell: str
    reference: str
    result: DiffResult | None = None
    failure: str | None = None  # why the pair fails without a diff: a cell that did not complete, a missing record
    failure_type: str | None = None  # "cell-not-completed", "record-missing", "record-unreadable", "records-incomparable"
    seconds: float | None = None  # the cell's own run time, when known
    path_a: Path | None = None  # the reference record
    path_b: Path | None = None  # the cell's record
    delta: str = ""  # what the reference has that the cell has not ("tp=1 bs=1")
    reference_only: bool = False  # a reference cell on its own (it gets a case only when it did not complete)

    @property
    def passed(self) -> bool:
        return self.failure is None and self.result is not None and self.result.passed

    @property
    def reasons(self) -> list[str]:
        if self.failure is not None:
            return [self.failure]
        return list(self.result.reasons) if self.result is not None else []

    @property
    def name(self) -> str:
        return f"{self.cell} (reference)" if self.reference_only else f"{self.cell} vs {self.reference}"

    def diff_command(self, thresholds: Thresholds | None = None) -> str | None:
        if self.path_a is None or self.path_b is None:
            return None
        return shlex.join(["repaudit", "diff", str(self.path_a), str(self.path_b), *threshold_args(thresholds)])


@dataclass
class GateResult:
    suite: str  # e.g. the run's name
    pairs: list[PairOutcome]
    thresholds: Thresholds
    properties: dict[str, str] = field(default_factory=dict)
    references: list[PairOutcome] = field(default_factory=list)  # reference cells that did not complete
    refused: list[tuple[str, str]] = field(default_factory=list)  # (cell, why) of combinations never run
    labels: dict[str, str] = field(default_factory=dict)  # cell id -> the settings that vary among the run's cells

    @property
    def failures(self) -> list[PairOutcome]:
        return [p for p in self.all_cases if not p.passed]

    @property
    def all_cases(self) -> list[PairOutcome]:
        return self.pairs + self.references

    @property
    def passed(self) -> bool:
        return not self.failures


def threshold_args(th: Thresholds | None) -> list[str]:
    if th is None:
        return []
    out = []
    if th.max_ulp is not None:
        out += ["--max-ulp", str(th.max_ulp)]
    if th.max_abs is not None:
        out += ["--max-abs", repr(th.max_abs)]
    if th.max_seq_divergence:
        out += ["--max-seq-divergence", repr(th.max_seq_divergence)]
    return out


def _not_done(cell_id: str, entry: dict[str, Any]) -> str:
    status = entry.get("status") or "missing from the manifest"
    reason = entry.get("reason")
    return f"cell {cell_id} did not complete ({status}" + (f": {reason})" if reason else ")")


def compare_pair(run: RunInfo, cell_id: str, ref_id: str, thresholds: Thresholds, store: Store | None = None) -> PairOutcome:
    """One cell against its reference, the way summary.json does it; failures instead of exceptions.
    With a store, a diff made before from the same two files is read back instead of made again."""
    entry, ref_entry = run.entry(cell_id), run.entry(ref_id)
    a, b = run.path(ref_id), run.path(cell_id)
    out = PairOutcome(cell_id, ref_id, seconds=entry.get("seconds"), path_a=a, path_b=b)
    for cid, e in ((cell_id, entry), (ref_id, ref_entry)):
        if e.get("status") != "done":
            out.failure, out.failure_type = _not_done(cid, e), "cell-not-completed"
            return out
    for p in (a, b):
        if not p.is_file():
            out.failure, out.failure_type = f"record {p} is missing although the manifest says the cell is done", "record-missing"
            return out
    out.result = store.get(cell_id, ref_id, a, b, DEFAULT_CLIP, thresholds) if store else None
    if out.result is not None:
        return out
    try:
        out.result = diff_records(a, b, thresholds=thresholds)
    except IncomparableRecords as exc:
        out.failure, out.failure_type = str(exc), "records-incomparable"
        return out
    except InputError as exc:
        out.failure, out.failure_type = str(exc), "record-unreadable"
        return out
    if store:
        store.put(cell_id, ref_id, a, b, DEFAULT_CLIP, out.result)
    return out


def gate_run(run: RunInfo, thresholds: Thresholds) -> GateResult:
    """Every cell against its reference, each pair diffed once per pair of files: the diffs are kept
    in the run directory (stored.py) for the next gate, report or summary to read."""
    pairs, refs = [], []
    store = Store(run.run_dir)
    for cell, reference in reference_pairs(run.plan):
        if cell == reference:
            entry = run.entry(cell.id)
            if entry.get("status") != "done":
                refs.append(PairOutcome(cell.id, cell.id, failure=_not_done(cell.id, entry), failure_type="cell-not-completed",
                                        seconds=entry.get("seconds"), reference_only=True))
            continue
        pair = compare_pair(run, cell.id, reference.id, thresholds, store)
        pair.delta = reference_delta(cell, reference)
        pairs.append(pair)
    store.save()
    m = run.manifest
    props = {
        "run_dir": str(run.run_dir), "baseline": run.plan.baseline.id,
        "reference_per": ",".join(run.plan.matrix.reference_per),
        "model": str(m.model.get("id")), "command": shlex.join(m.command),
        "thresholds": json.dumps(_thresholds_dict(thresholds), sort_keys=True, allow_nan=False),
    }
    refused = [(cell.id, reason) for cell, reason in run.plan.refused]
    labels = short_labels({c.id: cell_settings(c) for c in run.plan.cells})
    return GateResult(run.name, pairs, thresholds, props, refs, refused, labels)


def gate_files(a: Path, b: Path, thresholds: Thresholds, allow_partial: bool = False) -> GateResult:
    """Two records: B is compared with A (A is the reference). Unreadable input raises InputError."""
    t0 = time.perf_counter()
    result = diff_records(a, b, thresholds=thresholds, allow_partial=allow_partial)
    seconds = time.perf_counter() - t0
    ida, idb = result.a.cell_id, result.b.cell_id
    cell, ref = (idb, ida) if ida != idb else (str(b), str(a))
    pair = PairOutcome(cell, ref, result=result, seconds=seconds, path_a=Path(a), path_b=Path(b), delta="A")
    props = {"a": str(a), "b": str(b), "thresholds": json.dumps(_thresholds_dict(thresholds), sort_keys=True, allow_nan=False)}
    return GateResult("files", [pair], thresholds, props)


def _thresholds_dict(th: Thresholds) -> dict[str, Any]:
    # `--max-abs inf` is a valid tolerance; json.dumps wrote it as the bare token Infinity, which is
    # not JSON (a strict parser of the JUnit property fails on it): "inf", as every JSON repaudit writes.
    return {"max_ulp": th.max_ulp, "max_abs": json_float(th.max_abs), "max_seq_divergence": th.max_seq_divergence,
            "strict": th.strict}


# ------------------------------------------------------------------------------------ text


def case_message(p: PairOutcome) -> str:
    """One line for a failing case: the verdict with its reasons."""
    if p.failure is not None:
        return p.failure
    assert p.result is not None
    return verdict_line(p.result)


def case_details(p: PairOutcome, thresholds: Thresholds | None = None) -> str:
    """The metrics of a case as plain text, one per line (JUnit failure body and system-out)."""
    lines = [f"cell:      {p.cell}", f"reference: {p.reference}"]
    if p.failure is not None:
        lines += [f"failure:   {p.failure}"]
    if p.result is not None:
        r = p.result
        lines += [f"verdict:   {verdict_line(r)}", ""]
        width = max(len(k) for k, _ in metric_rows(r))
        lines += [f"{k.ljust(width)}  {v}" for k, v in metric_rows(r)]
        if r.cell_differences:
            lines += ["", "cell settings that differ: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in r.cell_differences)]
        if r.env_differences:
            lines += ["environment differs: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in r.env_differences)]
        diverged = sorted((p for p in r.shared_prompts if not p.bitwise_match),
                          key=lambda d: 1 << 62 if d.first_divergence is None else d.first_divergence)
        if diverged:
            lines += ["", "first divergences (prompt: logprob bits / tokens):"]
            for d in diverged[:20]:
                lines.append(f"  {d.prompt_id}: pos {_pos(d.first_logprob_divergence)} / {_pos(d.first_token_divergence)}, "
                             f"{d.bitwise_equal}/{d.comparable} bitwise equal, max {d.max_ulp} ULP")
            if len(diverged) > 20:
                lines.append(f"  ... and {len(diverged) - 20} more prompts")
    cmd = p.diff_command(thresholds)
    if cmd:
        lines += ["", "reproduce: " + cmd]
    return "\n".join(lines) + "\n"


def _pos(x: int | None) -> str:
    return "—" if x is None else str(x)


def print_gate(g: GateResult, console: Console | None = None) -> None:
    """A compact table (one line per pair), then each failure with its reasons."""
    from rich import box

    console = console or Console()
    t = Table(title=f"repaudit gate: {g.suite}", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for h in ("cell", "vs", "result", "bits equal", "max ULP", "1st div."):
        t.add_column(h, no_wrap=True, justify="left" if h in ("cell", "vs", "result") else "right")
    for p in g.all_cases:
        r = p.result
        first = None
        if r is not None:
            first = min((d.first_divergence for d in r.shared_prompts if d.first_divergence is not None), default=None)
        t.add_row(
            g.labels.get(p.cell, p.cell), "(ref)" if p.reference_only else (p.delta or p.reference),
            "[green]pass[/]" if p.passed else "[red]FAIL[/]",
            pct(r.bitwise_equal, r.comparable) if r else "—", str(r.ulp_max) if r else "—",
            "—" if first is None else f"pos {first}",
        )
    console.print(t)
    for p in g.failures:
        console.print(f"[red]FAIL[/] {p.name}: " + "; ".join(p.reasons), soft_wrap=True)
    for cell, reason in g.refused:
        console.print(f"[yellow]refused, not run:[/] {cell}: {escape(reason)}", soft_wrap=True)
    n = len(g.all_cases)
    if not n:
        console.print("[yellow]GATE PASSED: nothing to compare[/] (every cell is its own reference)")
    elif g.passed:
        console.print(f"[bold green]GATE PASSED[/]: {n} of {n} cell pairs within thresholds")
    else:
        console.print(f"[bold red]GATE FAILED[/]: {len(g.failures)} of {n} cell pairs fail")
