"""Every cell against its reference cell: summary.json, summary.md and the terminal table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..files import write_json_atomic, write_text_atomic
from ..run.plan import CELL_SETTINGS, Plan, reference_delta, reference_pairs
from ..run.rundir import Manifest
from .gate import RunInfo, gate_run
from .render import pct
from .result import Thresholds, json_float


def tokens_per_s(timing: dict[str, Any] | None, mode: str) -> float | None:
    """A cell's engine tokens/s: decoding for generate, prefill for score."""
    if not timing:
        return None
    return timing.get("decode_tokens_per_s") if mode == "generate" else timing.get("prefill_tokens_per_s")


def summarize(plan: Plan, run_dir: Path, manifest: Manifest, thresholds: Thresholds) -> dict[str, Any]:
    """summary.json: the gate's comparison of every cell with its reference (repaudit.compare.gate.gate_run,
    the one comparison and the one verdict that `repaudit gate` and the report use too), with
    each cell's settings and timings from the manifest."""
    gate = gate_run(RunInfo(run_dir, manifest.data, plan), thresholds)
    outcome = {p.cell: p for p in gate.pairs}
    rows = []
    for cell, reference in reference_pairs(plan):
        entry = manifest.data.cells.get(cell.id, {})
        row: dict[str, Any] = {
            "cell": cell.id, "settings": {k: getattr(cell, k) for k in CELL_SETTINGS}, "reference": reference.id,
            "reference_delta": reference_delta(cell, reference), "status": entry.get("status"), "reason": entry.get("reason"),
            "seconds": entry.get("seconds"), "tokens_per_s": tokens_per_s(entry.get("timing"), cell.mode),
            "timing": entry.get("timing"), "ranks_differ": entry.get("ranks_differ"),
        }
        p = outcome.get(cell.id)
        if p is not None:
            row.update({"passed": p.passed, "identical": p.failure is None and p.result is not None and p.result.identical,
                        "reasons": p.reasons})
        if p is not None and p.result is not None:
            r = p.result
            first = [d.first_logprob_divergence for d in r.shared_prompts if d.first_logprob_divergence is not None]
            first_tok = [d.first_token_divergence for d in r.shared_prompts if d.first_token_divergence is not None]
            row.update({
                "compared": r.comparable, "bitwise_equal": r.bitwise_equal, "bitwise_equal_rate": r.bitwise_equal_rate,
                "digest_equal_rate": r.digest_equal_rate, "ulp_max": r.ulp_max, "abs_max": json_float(r.abs_max),
                "prob_max": json_float(r.prob_max), "seq_token_match_rate": r.seq_token_match_rate,
                "seq_bitwise_match_rate": r.seq_bitwise_match_rate, "top1_agreement": r.top1_agreement,
                "first_logprob_divergence_min": min(first) if first else None,
                "first_token_divergence_min": min(first_tok) if first_tok else None,
                "prompts_diverged": len(first), "prompts": len(r.shared_prompts),
                "seq_token_matches": sum(d.token_match for d in r.shared_prompts),
            })
        rows.append(row)
    compared = [r for r in rows if r["cell"] in outcome]
    loads = {g: v.get("load_s", []) for g, v in manifest.data.groups.items()}
    return {
        "price": price_list(rows),
        "baseline": plan.baseline.id,
        "reference_per": list(plan.matrix.reference_per),
        "cells": rows,
        "passed": gate.passed,
        "identical_cells": sum(1 for r in compared if r["identical"]),
        "compared_cells": len(compared),
        "wall_s": manifest.data.wall_s,
        "sum_cell_s": sum(r["seconds"] or 0 for r in rows),
        "load_s": loads,
    }


def price_list(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each kernel mode costs and what it buys, from the same run: per mode, the cells kept
    bitwise identical to their reference, and its tokens/s against stock's, the geometric mean of
    cell / stock cell over the cells whose every other setting (engine, TP, batch, NCCL, mode) has
    a stock cell too. `speed_vs_stock` is None where the run has no such pair."""
    key = lambda r: tuple(sorted((k, str(v)) for k, v in r["settings"].items() if k != "kernels"))  # noqa: E731
    stock = {key(r): r["tokens_per_s"] for r in rows if r["settings"]["kernels"] == "stock" and r["tokens_per_s"]}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        p = out.setdefault(r["settings"]["kernels"], {"kernels": r["settings"]["kernels"], "identical": 0, "compared": 0,
                                                      "speed_vs_stock": None, "speed_pairs": 0, "_logs": []})
        if "identical" in r:
            p["identical"] += bool(r["identical"])
            p["compared"] += 1
        base = stock.get(key(r))
        if base and r["tokens_per_s"]:
            p["_logs"].append(math.log(r["tokens_per_s"] / base))
    for p in out.values():
        logs = p.pop("_logs")
        if logs:
            p["speed_vs_stock"], p["speed_pairs"] = math.exp(math.fsum(logs) / len(logs)), len(logs)
    return list(out.values())


def price_line(p: dict[str, Any]) -> str:
    """"tbik: 6 of 6 cells bitwise identical to their reference, at 0.62x stock's tokens/s"."""
    line = f"{p['kernels']}: {p['identical']} of {p['compared']} cells bitwise identical to their reference"
    if p["kernels"] != "stock" and p["speed_vs_stock"] is not None:
        line += f", at {p['speed_vs_stock']:.2f}x stock's tokens/s ({p['speed_pairs']} cells)"
    return line


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
    for p in summary["price"]:
        if p["compared"]:
            colour = "green" if p["identical"] == p["compared"] else "red"
            console.print(f"[bold {colour}]{price_line(p)}[/]", soft_wrap=True)  # one line in a log, whatever its width


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = ["# repaudit run summary", "", f"Baseline `{summary['baseline']}`; each cell is compared with the baseline "
             f"settings taken with its own {', '.join(summary['reference_per'])}.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    lines += ["", f"{summary['identical_cells']}/{summary['compared_cells']} cells bitwise identical to their reference.", ""]
    lines += ["What each kernel mode buys and costs, from this run (tokens/s: geometric mean of each cell against",
              "the stock cell with the same other settings):", "",
              "| kernels | cells identical to their reference | tokens/s vs stock |", "|---|---|---|"]
    lines += [f"| {p['kernels']} | {p['identical']}/{p['compared']} | "
              + ("—" if p["speed_vs_stock"] is None else f"{p['speed_vs_stock']:.2f}x ({p['speed_pairs']} cells)") + " |"
              for p in summary["price"]]
    lines.append("")
    if summary.get("wall_s") is not None:
        loads = sum(sum(v) for v in summary["load_s"].values())
        lines.append(f"Whole matrix {summary['wall_s']:.1f} s; sum of cell times {summary['sum_cell_s']:.1f} s; "
                     f"model loads {loads:.1f} s over {len(summary['load_s'])} launch group(s).")
    return "\n".join(lines) + "\n"


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "summary.md", summary_markdown(summary))
