"""Every cell against its reference cell: summary.json, summary.md and the terminal table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .diff import Thresholds, json_float, diff_records
from .errors import InputError
from .files import write_json_atomic, write_text_atomic
from .jobspec import cell_path
from .plan import Cell, Matrix, Plan, expand, expand_with
from .render import pct
from .rundir import Manifest


def reference_pairs(plan: Plan) -> list[tuple[Cell, Cell]]:
    """(cell, reference) for every cell of the plan, in plan order; a reference is paired with itself.

    The one place that decides what each cell is compared with: summary.json, `repaudit gate`
    and `repaudit report` all use it."""
    return [(cell, plan.reference_for(cell)) for cell in plan.cells]


_SETTINGS = ("engine", "tp", "batch_size", "nccl", "kernels", "mode")


def reference_delta(cell: Cell, reference: Cell) -> str:
    """The reference's settings where they differ from the cell's: "tp=1 bs=1"."""
    delta = [f"{k}={getattr(reference, k)}" for k in ("engine", "tp", "batch_size", "nccl", "kernels", "mode")
             if getattr(reference, k) != getattr(cell, k)]
    return " ".join(delta).replace("batch_size", "bs")


def plan_from_manifest(data: dict[str, Any]) -> Plan:
    """The plan a run directory was made with, rebuilt from its manifest (matrix, baseline and
    the score-reference cell that `repaudit run` adds when the matrix lacks it)."""
    try:
        m = data["matrix"]
        matrix = Matrix(
            model=data["model"]["id"], engines=tuple(m["engines"]), tps=tuple(m["tp"]),
            batch_sizes=tuple(m["batch_size"]), nccl=dict(m["nccl"]), kernels=tuple(m["kernels"]),
            modes=tuple(m["mode"]), dtype=m["dtype"], device=m["device"], probes=m["probes"],
            max_new_tokens=m["max_new_tokens"], topk=m["topk"], baseline=data["baseline"],
            reference_per=tuple(m["reference_per"]),
        )
    except (KeyError, TypeError) as exc:
        raise InputError(f"manifest has no complete matrix (missing {exc}); was the run started?") from None
    plan = expand(matrix)
    extra = data.get("reference_cell")
    if extra and extra not in {c.id for c in plan.cells}:
        plan = expand_with(plan, plan.reference_source)
    return plan


def _rate(timing: dict[str, Any] | None, mode: str) -> float | None:
    if not timing:
        return None
    return timing.get("decode_tokens_per_s") if mode == "generate" else timing.get("prefill_tokens_per_s")


def summarize(plan: Plan, run_dir: Path, manifest: Manifest, thresholds: Thresholds) -> dict[str, Any]:
    rows = []
    for cell, reference in reference_pairs(plan):
        entry = manifest.data["cells"].get(cell.id, {})
        row: dict[str, Any] = {
            "cell": cell.id, "settings": {k: getattr(cell, k) for k in _SETTINGS}, "reference": reference.id, "reference_delta": reference_delta(cell, reference), "status": entry.get("status"), "reason": entry.get("reason"),
            "seconds": entry.get("seconds"), "tokens_per_s": _rate(entry.get("timing"), cell.mode),
            "timing": entry.get("timing"), "ranks_differ": entry.get("ranks_differ"),
        }
        a, b = cell_path(run_dir, reference.id), cell_path(run_dir, cell.id)
        if entry.get("status") == "done" and a.exists() and b.exists():
            r = diff_records(a, b, thresholds=thresholds)
            first = [p.first_logprob_divergence for p in r.shared_prompts if p.first_logprob_divergence is not None]
            first_tok = [p.first_token_divergence for p in r.shared_prompts if p.first_token_divergence is not None]
            row.update({
                "compared": r.comparable, "bitwise_equal": r.bitwise_equal, "bitwise_equal_rate": r.bitwise_equal_rate,
                "digest_equal_rate": r.digest_equal_rate, "ulp_max": r.ulp_max, "abs_max": json_float(r.abs_max),
                "prob_max": json_float(r.prob_max), "seq_token_match_rate": r.seq_token_match_rate,
                "seq_bitwise_match_rate": r.seq_bitwise_match_rate, "top1_agreement": r.top1_agreement,
                "first_logprob_divergence_min": min(first) if first else None,
                "first_token_divergence_min": min(first_tok) if first_tok else None,
                "prompts_diverged": len(first), "prompts": len(r.shared_prompts),
                "seq_token_matches": sum(p.token_match for p in r.shared_prompts),
                "identical": r.identical, "passed": r.passed, "reasons": r.reasons,
            })
        rows.append(row)
    compared = [r for r in rows if "passed" in r and r["cell"] != r["reference"]]
    cell_seconds = sum(r["seconds"] or 0 for r in rows)
    loads = {g: v.get("load_s", []) for g, v in manifest.data.get("groups", {}).items()}
    return {
        "baseline": plan.baseline.id,
        "reference_per": list(plan.matrix.reference_per),
        "cells": rows,
        "passed": all(r["passed"] for r in compared) and all(r["status"] == "done" for r in rows),
        "identical_cells": sum(1 for r in compared if r["identical"]),
        "compared_cells": len(compared),
        "wall_s": manifest.data.get("wall_s"),
        "sum_cell_s": cell_seconds,
        "load_s": loads,
    }


def _fmt_rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _bitwise(r: dict[str, Any]) -> str:
    if "compared" not in r:
        return "—"
    return pct(r["bitwise_equal"], r["compared"])


def _seq(r: dict[str, Any]) -> str:
    return "—" if "seq_token_matches" not in r else pct(r["seq_token_matches"], r["prompts"])


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in summary["cells"]:
        is_ref = r["cell"] == r["reference"]
        first = r.get("first_logprob_divergence_min")
        out.append([
            r["cell"], "(reference)" if is_ref else r["reference"], r["status"] or "—",
            "—" if is_ref else _bitwise(r),
            "—" if is_ref or "ulp_max" not in r else str(r["ulp_max"]),
            "—" if is_ref or "abs_max" not in r else repr(r["abs_max"]),
            "—" if is_ref or first is None else f"pos {first} ({r['prompts_diverged']}/{r['prompts']} prompts)",
            "—" if is_ref else _seq(r),
            _fmt_rate(r["tokens_per_s"]),
        ])
    return out


HEADER = ["cell", "reference", "status", "bitwise-equal", "max ULP", "max |Δ lp|", "first divergence", "seq match", "tok/s"]


def verdicts(summary: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(kernel mode, cells bitwise identical to their reference, cells compared), in run order."""
    out: dict[str, list[int]] = {}
    for r in summary["cells"]:
        if r["cell"] != r["reference"] and "identical" in r:
            n = out.setdefault(r["settings"]["kernels"], [0, 0])
            n[0] += r["identical"]
            n[1] += 1
    return [(k, same, total) for k, (same, total) in out.items()]


def _label(settings: dict[str, Any], varying: list[str]) -> str:
    names = {"tp": "tp{}", "batch_size": "bs{}", "engine": "{}", "nccl": "{}"}
    return " ".join(names[k].format(settings[k]) for k in varying) or "—"


def print_summary(summary: dict[str, Any], console: Console) -> None:
    """One short table per kernel mode and mode (a cell named by the settings that vary), so a
    log 80 columns wide shows every column whole; summary.md has every column and full names.
    Then the verdict per kernel mode."""
    from rich import box

    cells = summary["cells"]
    varying = [k for k in ("engine", "tp", "batch_size", "nccl") if len({str(r["settings"][k]) for r in cells}) > 1]
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], list[str]]]] = {}
    for r, row in zip(cells, table_rows(summary)):
        groups.setdefault((r["settings"]["kernels"], r["settings"]["mode"]), []).append((r, row))
    for (kernels, mode), rows in groups.items():
        t = Table(title=f"{kernels}, {mode}: each cell vs its reference", title_justify="left", box=box.SIMPLE_HEAD,
                  header_style="bold", pad_edge=False)
        for h in ("cell", "vs", "bits equal", "max ULP", "1st div.", "seq match", "tok/s"):
            t.add_column(h, no_wrap=True, justify="left" if h in ("cell", "vs") else "right")
        for r, row in rows:
            vs = "(reference)" if r["cell"] == r["reference"] else r["reference_delta"]
            first = r.get("first_logprob_divergence_min")
            status = "" if r["status"] == "done" else f" [red]{r['status'] or 'pending'}[/]"
            t.add_row(_label(r["settings"], varying) + status, vs, row[3], row[4], "—" if first is None else f"pos {first}",
                      row[7], row[8])
        console.print(t)
    for kernels, same, total in verdicts(summary):
        colour = "green" if same == total else "red"
        console.print(f"[bold {colour}]{kernels}: {same} of {total} cells bitwise identical to their reference[/]")


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = ["# repaudit run summary", "", f"Baseline `{summary['baseline']}`; each cell is compared with the baseline "
             f"settings taken with its own {', '.join(summary['reference_per'])}.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    lines += ["", f"{summary['identical_cells']}/{summary['compared_cells']} cells bitwise identical to their reference.", ""]
    if summary.get("wall_s") is not None:
        loads = sum(sum(v) for v in summary["load_s"].values())
        lines.append(f"Whole matrix {summary['wall_s']:.1f} s; sum of cell times {summary['sum_cell_s']:.1f} s; "
                     f"model loads {loads:.1f} s over {len(summary['load_s'])} launch group(s).")
    return "\n".join(lines) + "\n"


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "summary.md", summary_markdown(summary))
