"""Every cell against its reference cell: summary.json, summary.md and the terminal table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..files import write_json_atomic, write_text_atomic
from ..run.plan import CELL_SETTINGS, Cell, Plan, reference_delta, reference_pairs
from ..run.scenarios import COLD
from ..run.rundir import Manifest
from ..units import rate_text, ratio_text, seconds_text
from .gate import RunInfo, gate_run
from .render import pct
from .result import Thresholds, json_float


def tokens_per_s(timing: dict[str, Any] | None, mode: str) -> float | None:
    """A cell's engine tokens/s. generate: every generated token over the time of prefill and
    decoding (how vLLM counts throughput; an engine that splits the two, as the transformers
    engine does, and one that interleaves them, as vLLM does, give the same measure); score:
    every token through the forward (prompt and completion, the first one included, which has
    no row: n tokens give n - 1 rows) over the prefill. None where nothing was generated or timed."""
    if not timing:
        return None
    return timing.get("generated_tokens_per_s") if mode == "generate" else timing.get("prefill_tokens_per_s")


def summarize(plan: Plan, run_dir: Path, manifest: Manifest, thresholds: Thresholds) -> dict[str, Any]:
    """summary.json: the gate's comparison of every cell with its reference (repaudit.compare.gate.gate_run,
    the one comparison and the one verdict that `repaudit gate` and the report use too), with
    each cell's settings and timings from the manifest."""
    gate = gate_run(RunInfo(run_dir, manifest.data, plan), thresholds)
    outcome = {p.cell: p for p in gate.pairs}
    rows = []
    for cell, reference in reference_pairs(plan):
        entry = manifest.data.cells.get(cell.id, {})
        row = _row(cell, reference, entry.get("status"), entry.get("reason"))
        row.update({"seconds": entry.get("seconds"), "tokens_per_s": tokens_per_s(entry.get("timing"), cell.mode),
                    "timing": entry.get("timing"), "ranks_differ": entry.get("ranks_differ"),
                    "retried": entry.get("retried", [])})
        p = outcome.get(cell.id)
        if p is not None:
            row.update({"passed": p.passed, "identical": p.failure is None and p.result is not None and p.result.identical,
                        "reasons": p.reasons})
        if p is not None and p.result is not None:
            r = p.result
            first = [d.first_logprob_divergence for d in r.shared_prompts if d.first_logprob_divergence is not None]
            first_tok = [d.first_token_divergence for d in r.shared_prompts if d.first_token_divergence is not None]
            # A fork with equal bits before it counts, as gate and the report count it.
            earliest = [d.first_divergence for d in r.shared_prompts if not d.bitwise_match]
            row.update({
                "compared": r.comparable, "bitwise_equal": r.bitwise_equal, "bitwise_equal_rate": r.bitwise_equal_rate,
                "digest_equal_rate": r.digest_equal_rate, "ulp_max": r.ulp_max, "abs_max": json_float(r.abs_max),
                "prob_max": json_float(r.prob_max), "seq_token_match_rate": r.seq_token_match_rate,
                "seq_bitwise_match_rate": r.seq_bitwise_match_rate, "top1_agreement": r.top1_agreement,
                "first_logprob_divergence_min": min(first) if first else None,
                "first_token_divergence_min": min(first_tok) if first_tok else None,
                "first_divergence_min": min(earliest) if earliest else None,
                "prompts_diverged": len(earliest), "prompts": len(r.shared_prompts),
                "seq_token_matches": sum(d.token_match for d in r.shared_prompts),
            })
        rows.append(row)
    # Combinations the plan refused (scenarios.REFUSED): rows that say so and why, never compared.
    rows += [_row(cell, plan.reference_for(cell), "refused", reason) for cell, reason in plan.refused]
    compared = [r for r in rows if r["cell"] in outcome]
    loads = {g: v.get("load_s", []) for g, v in manifest.data.groups.items()}
    group_retries = {g: v["retried"] for g, v in manifest.data.groups.items() if v.get("retried")}
    return {
        "price": price_list(rows),
        "baseline": plan.baseline.id,
        "reference_per": list(plan.matrix.reference_per),
        "cells": rows,
        "passed": gate.passed,
        "identical_cells": sum(1 for r in compared if r["identical"]),
        "compared_cells": len(compared),
        "refused_cells": len(plan.refused),
        "wall_s": manifest.data.wall_s,
        "sum_cell_s": sum(r["seconds"] or 0 for r in rows),
        "load_s": loads,
        "group_retries": group_retries,  # jobs that crashed outside any cell (loading) and ran again
    }


def _row(cell: Cell, reference: Cell, status: str | None, reason: str | None) -> dict[str, Any]:
    return {"cell": cell.id, "settings": {k: getattr(cell, k) for k in CELL_SETTINGS}, "reference": reference.id,
            "reference_delta": reference_delta(cell, reference), "status": status, "reason": reason,
            "seconds": None, "tokens_per_s": None, "timing": None, "ranks_differ": None}


def _scenario(r: dict[str, Any]) -> str:
    return r["settings"].get("scenario") or COLD  # rows made before scenarios existed: cold


def price_list(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each kernel mode and each scenario costs and what it buys, from the same run.

    Per kernel mode, over the cold cells: the cells kept bitwise identical to their reference, and
    its tokens/s against stock's, the geometric mean of cell / stock cell over the cells whose every
    other setting (engine, TP, batch, NCCL, mode) has a stock cell too (`speed_vs_stock`). Then per
    scenario other than cold and kernel mode: the cells identical to their reference, which is
    their cold twin, and tokens/s against the cold twin's (`speed_vs_cold`). A speed is None where
    the run has no such pair."""
    rows = [r for r in rows if r.get("status") != "refused"]
    cold = [r for r in rows if _scenario(r) == COLD]
    out = [{"kernels": kernels, **_priced(group, "kernels", "stock", cold)}
           for kernels, group in _by(cold, lambda r: r["settings"]["kernels"]).items()]
    for (scenario, kernels), group in _by([r for r in rows if _scenario(r) != COLD],
                                          lambda r: (_scenario(r), r["settings"]["kernels"])).items():
        out.append({"scenario": scenario, "kernels": kernels, **_priced(group, "scenario", COLD, rows)})
    return out


def _by(rows: list[dict[str, Any]], key) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def _priced(group: list[dict[str, Any]], dim: str, base: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Cells of `group` identical to their reference, and the geometric mean of their tokens/s over
    their twin's in `rows`: the cell with every setting equal but `dim`, which is `base`."""
    twin = lambda r: tuple(sorted((k, str(base if k == dim else v)) for k, v in r["settings"].items()))  # noqa: E731
    rate = {twin(r): r["tokens_per_s"] for r in rows if (r["settings"].get(dim) or COLD) == base and r["tokens_per_s"]}
    logs = [math.log(r["tokens_per_s"] / rate[twin(r)]) for r in group if r["tokens_per_s"] and twin(r) in rate]
    speed = math.exp(math.fsum(logs) / len(logs)) if logs else None
    compared = [r for r in group if "identical" in r]
    return {"identical": sum(bool(r["identical"]) for r in compared), "compared": len(compared),
            f"speed_vs_{base}": speed, "speed_pairs": len(logs)}


def price_line(p: dict[str, Any]) -> str:
    """"tbik: 6 of 6 cells bitwise identical to their reference, at 0.62x stock's tokens/s";
    "prefix-hit (stock): 2 of 4 cells bitwise identical to their cold twin, at 1.10x cold's tokens/s"."""
    if "scenario" in p:
        line = f"{p['scenario']} ({p['kernels']}): {p['identical']} of {p['compared']} cells bitwise identical to their cold twin"
        speed, against = p["speed_vs_cold"], "cold"
    else:
        line = f"{p['kernels']}: {p['identical']} of {p['compared']} cells bitwise identical to their reference"
        speed, against = (p["speed_vs_stock"] if p["kernels"] != "stock" else None), "stock"
    if speed is not None:
        line += f", at {ratio_text(speed)} {against}'s tokens/s ({p['speed_pairs']} cells)"
    return line


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
        first = r.get("first_divergence_min")
        out.append([
            r["cell"], "(reference)" if is_ref else r["reference"], r["status"] or "—",
            "—" if is_ref else _bitwise(r),
            "—" if is_ref or "ulp_max" not in r else str(r["ulp_max"]),
            "—" if is_ref or "abs_max" not in r else str(r["abs_max"]),  # a float's shortest text, or "inf"/"nan"
            "—" if is_ref or first is None else f"pos {first} ({r['prompts_diverged']}/{r['prompts']} prompts)",
            "—" if is_ref else _seq(r),
            rate_text(r["tokens_per_s"]),
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
    groups: dict[tuple[str, str, str], list[tuple[dict[str, Any], list[str]]]] = {}
    for r, row in zip(cells, table_rows(summary)):
        groups.setdefault((r["settings"]["kernels"], _scenario(r), r["settings"]["mode"]), []).append((r, row))
    for (kernels, scenario, mode), rows in groups.items():
        what = f"{kernels}, {mode}" if scenario == COLD else f"{kernels}, {scenario}, {mode}"
        t = Table(title=f"{what}: each cell vs its reference", title_justify="left", box=box.SIMPLE_HEAD,
                  header_style="bold", pad_edge=False)
        for h in ("cell", "vs", "bits equal", "max ULP", "1st div.", "seq match", "tok/s"):
            t.add_column(h, no_wrap=True, justify="left" if h in ("cell", "vs") else "right")
        for r, row in rows:
            vs = "(reference)" if r["cell"] == r["reference"] else r["reference_delta"]
            first = r.get("first_divergence_min")
            status = "" if r["status"] == "done" else f" [{'yellow' if r['status'] == 'refused' else 'red'}]{r['status'] or 'pending'}[/]"
            t.add_row(_label(r["settings"], varying) + status, vs, row[3], row[4], "—" if first is None else f"pos {first}",
                      row[7], row[8])
        console.print(t)
    for reason, n in _refusals(cells).items():
        console.print(f"[yellow]refused, not run:[/] {n} cell(s): {escape(reason)}", soft_wrap=True)
    for what, why in _retries(summary):
        console.print(f"[yellow]ran again after its job crashed:[/] {what}: {escape('; '.join(why))}", soft_wrap=True)
    for p in summary["price"]:
        if p["compared"]:
            colour = "green" if p["identical"] == p["compared"] else "red"
            console.print(f"[bold {colour}]{price_line(p)}[/]", soft_wrap=True)  # one line in a log, whatever its width


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = ["# repaudit run summary", "", f"Baseline `{summary['baseline']}`; each cell is compared with the baseline "
             f"settings taken with its own {', '.join(summary['reference_per'])}.", "",
             "| " + " | ".join(h.replace("|", "\\|") for h in HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    lines += ["", f"{summary['identical_cells']}/{summary['compared_cells']} cells bitwise identical to their reference.", ""]
    refused = [r for r in summary["cells"] if r["status"] == "refused"]
    if refused:
        lines += ["Refused, not run (the combination cannot give a meaningful cell):", ""]
        lines += [f"- `{r['cell']}`: {r['reason']}" for r in refused] + [""]
    retried = _retries(summary)
    if retried:
        lines += ["Ran again after its job crashed (a process aborted or faulted; the record is the retry's):", ""]
        lines += [f"- `{what}`: {'; '.join(why)}" for what, why in retried] + [""]
    lines += ["What each kernel mode buys and costs, from this run (tokens/s: geometric mean of each cell against",
              "the stock cell with the same other settings):", "",
              "| kernels | cells identical to their reference | tokens/s vs stock |", "|---|---|---|"]
    lines += [f"| {p['kernels']} | {p['identical']}/{p['compared']} | {_speed(p['speed_vs_stock'], p)} |"
              for p in summary["price"] if "scenario" not in p]
    scenarios = [p for p in summary["price"] if "scenario" in p]
    if scenarios:
        lines += ["", "What each scenario changes and costs (each cell against its cold twin: same engine, TP, batch, "
                  "NCCL, kernels and mode):", "",
                  "| scenario | kernels | cells identical to their cold twin | tokens/s vs cold |", "|---|---|---|---|"]
        lines += [f"| {p['scenario']} | {p['kernels']} | {p['identical']}/{p['compared']} | {_speed(p['speed_vs_cold'], p)} |"
                  for p in scenarios]
    lines.append("")
    if summary.get("wall_s") is not None:
        loads = sum(sum(v) for v in summary["load_s"].values())
        lines.append(f"Whole matrix {seconds_text(summary['wall_s'])} s; sum of cell times {seconds_text(summary['sum_cell_s'])} s; "
                     f"model loads {seconds_text(loads)} s over {len(summary['load_s'])} launch group(s).")
    return "\n".join(lines) + "\n"


def _speed(x: float | None, p: dict[str, Any]) -> str:
    return "—" if x is None else f"{ratio_text(x)} ({p['speed_pairs']} cells)"


def _retries(summary: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(cell, or launch group for a job that crashed outside any cell, why each crashed try ended)."""
    return ([(r["cell"], r["retried"]) for r in summary["cells"] if r.get("retried")]
            + [(f"launch group {g}", why) for g, why in summary.get("group_retries", {}).items()])


def _refusals(cells: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in cells:
        if r["status"] == "refused":
            out[r["reason"]] = out.get(r["reason"], 0) + 1
    return out


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "summary.md", summary_markdown(summary))
