"""report.md: the same report as Markdown tables (no plots; the histograms as counts)."""

from __future__ import annotations

from typing import Any

from ..compare.render import pct
from ..units import rate_text
from .analysis import log_ratio_labels
from .build import ReportData, env_table, value_text
from .headline import tiles, verdict
from .tables import (PAIR_HEADER, RL_HEADER, divergence_cells, failed_cells, hist_bins, hist_labels, hist_summary, pair_row,
                     ratio_summary, rl_row, secs, timing_rows, timing_totals)


def cell(x: Any) -> str:
    """Text safe inside a Markdown table cell: no pipes, no line breaks, no raw HTML."""
    s = str(x)
    for a, b in (("\\", "\\\\"), ("&", "&amp;"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("`", "\\`"), ("*", "\\*"), ("_", "\\_"),
                 ("\r", "␍"), ("\n", "↵")):
        s = s.replace(a, b)
    return s


def code(x: Any, in_table: bool = True) -> str:
    """Inline code: a fence longer than any backtick run inside (pipes escaped for a table cell)."""
    s = str(x).replace("\r", "␍").replace("\n", "↵")
    if in_table:
        s = s.replace("|", "\\|")
    run = longest = 0
    for ch in s:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(rows_cell for rows_cell in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(data: ReportData) -> str:
    text, _ = verdict(data)
    parts = [f"# {cell(data.title)}", ""]
    parts += [f"- {cell(k)}: {code(v, in_table=False)}" for k, v in data.facts]
    parts += ["", f"**Verdict: {cell(text)}**", ""]
    for p in data.gate.failures:
        parts.append(f"- {code(p.cell, in_table=False)}: {cell('; '.join(p.reasons))}")
    if data.gate.failures:
        parts.append("")
    parts += [table(["headline", "value", ""], [[cell(t.label), cell(t.value), cell(t.detail)] for t in tiles(data)]), ""]
    parts += [f"- {cell(n)}" for n in data.notes]

    parts += ["## Each cell against its reference" if data.kind == "run" else "## B against A", "",
              "Rates are truncated, never rounded up: 100% means every row.", ""]
    if data.pairs:
        rows = []
        for p in data.pairs:
            r = pair_row(data, p)
            rows.append([code(r["cell"]) if h == "cell" else cell(r[h]) for h in PAIR_HEADER])
        parts += [table(PAIR_HEADER, rows), ""]
    else:
        parts += ["No cell has a reference other than itself.", ""]
    failed = failed_cells(data) if data.kind == "run" else []
    if failed:
        parts += ["### Cells that did not complete", "",
                  table(["cell", "status", "reason"], [[code(c.id), cell(c.status or "missing"), cell(c.reason or "—")] for c in failed]), ""]

    for mv in data.matrices:
        parts += [f"## Cell × cell: {cell(mv.mode)}", ""]
        if mv.skipped:
            parts += [cell(mv.skipped), ""]
            continue
        parts += ["Bitwise-equal logprobs / max ULP of every pair (★ = reference cell).", ""]
        names = [("★ " if cid in mv.references else "") + lab for cid, lab in zip(mv.ids, mv.labels)]
        rows = []
        for i, name in enumerate(names):
            row = [cell(name)]
            for j in range(len(names)):
                x = mv.entry(i, j)
                row.append("—" if x is None else "n/a" if x.error else cell(f"{pct(x.bitwise_equal, x.comparable)} / {x.ulp_max}"))
            rows.append(row)
        parts += [table([""] + names, rows), ""]
        parts += ["Cells: " + ", ".join(f"{cell(lab)} = {code(cid, in_table=False)}" for cid, lab in zip(mv.ids, mv.labels)), ""]

    with_hist = [p for p in data.pairs if p.hist is not None]
    if with_hist:
        nbins = hist_bins(with_hist)
        parts += ["## ULP distance of compared logprobs", "", "Rows per float32 ULP-distance bin (log2 bins).", ""]
        rows = [[cell(p.label)] + [str(int(c)) for c in p.hist.counts[:nbins]] + [str(p.hist.nan_vs_number), str(p.hist.nan_payload_differs)]
                for p in with_hist]
        parts += [table(["pair"] + [f"{b} ULP" for b in hist_labels(nbins)] + ["NaN vs number", "NaN payload"], rows), ""]
        parts += [f"- {cell(p.label)}: {cell(hist_summary(p.hist))}" for p in with_hist] + [""]

    pairs = [p for p in data.pairs if p.result is not None]
    if pairs:
        parts += ["## RL mismatch", "", "Rollout A against trainer B over positions with the same token, context and finite "
                  "logprobs; d = logprob B − logprob A, importance ratio exp(d) (docs/metrics.md has the formulas).", ""]
        parts += [table(RL_HEADER, [[cell(v) for v in rl_row(p).values()] for p in pairs]), ""]
        with_hist = [p for p in pairs if p.ratio_hist is not None]
        if with_hist:
            parts += ["Positions per signed decade of d (0: d = 0, ratio exactly 1: bitwise-equal logprobs, or +0.0 against -0.0).", ""]
            parts += [table(["pair"] + log_ratio_labels(), [[cell(p.label)] + [str(int(c)) for c in p.ratio_hist.counts] for p in with_hist]), ""]
            parts += [f"- {cell(p.label)}: {cell(ratio_summary(p.ratio_hist))}" for p in with_hist] + [""]

        parts += ["## Where sequences first diverge", ""]
        rows = []
        for p in pairs:
            pos = [d.earliest for d in p.divergences]
            forks = sum(d.fork is not None for d in p.divergences)
            rows.append([cell(p.label), f"{len(pos)}/{len(p.result.shared_prompts)}", str(forks),
                         str(min(pos)) if pos else "—", str(sorted(pos)[(len(pos) - 1) // 2]) if pos else "—",
                         str(max(pos)) if pos else "—", cell(", ".join(map(str, sorted(pos)[:30])) + (" …" if len(pos) > 30 else ""))])
        parts += [table(["pair", "prompts that differ", "of which fork", "earliest", "median", "latest", "positions"], rows), ""]

    div_pairs = [p for p in data.pairs if p.divergences]
    if div_pairs:
        parts += ["## First divergent token, per prompt", "", cell(data.token_note) + ".", ""]
        for p in div_pairs:
            parts += [f"### {code(p.outcome.cell, in_table=False)} vs {code(p.outcome.reference, in_table=False)}", ""]
            rows = []
            for d in p.divergences:
                c = divergence_cells(d)
                ctx = c["context"]
                if d.kind == "token":
                    ctx += f" ⟶ A: {c['token A']}{c['after A']} / B: {c['token B']}{c['after B']}"
                else:
                    ctx += f" ⟶ {c['token A']}"
                rows.append([code(c["prompt"]), cell(f"{c['position']} ({c['where']})"), cell(c["kind"]), cell(c["bits from"]), code(ctx), cell(c["token A"]),
                             code(c["logprob A"]) + " " + cell(c["bits A"]), cell(c["token B"]),
                             code(c["logprob B"]) + " " + cell(c["bits B"]), cell(c["ULP"]), cell(c["prompt bitwise-equal"]),
                             cell(c["prompt max ULP"])])
            parts += [table(["prompt", "position", "what differs", "bits first differ", "text before ⟶ token", "token A", "logprob A",
                             "token B", "logprob B", "ULP", "prompt bitwise-equal", "prompt max ULP"], rows), ""]

    if data.locates:
        parts += ["## Where in the model the bits first change", "",
                  "Traced cell pairs (`repaudit run --trace`), as `repaudit locate` reports them.", ""]
        parts += [table(["cell", "reference", "first divergent module", "summary"],
                        [[code(c), code(r), code(lr.first.name) if lr.first else "—", cell(lr.sentence())]
                         for c, r, lr in data.locates]), ""]

    if data.kind == "run":
        parts += ["## Speed and time", "", cell(timing_totals(data)), ""]
        parts += [table(["cell", "launch group", "status", "seconds", "prefill tok/s", "decode tok/s", "generated tok/s"],
                        [[code(r["cell"]), cell(r["group"]), cell(r["status"]), secs(r["seconds"]), rate_text(r["prefill tok/s"]),
                          rate_text(r["decode tok/s"]), rate_text(r["generated tok/s"])] for r in timing_rows(data)]), ""]
        parts += [table(["launch group", "cells", "model load s", "attempts"],
                        [[code(g.id), str(len(g.cells)), " + ".join(f"{x:.2f}" for x in g.load_s) or "—", cell(value_text(g.attempts))]
                         for g in data.groups]), ""]

    common, differ, per_cell = env_table(data.cells)
    parts += ["## Environment fingerprint", ""]
    if differ:
        parts += [f"Fields that differ between cells ({len(differ)}):", ""]
        parts += [table(["cell"] + differ, [[code(cid)] + [cell(value_text(v[k])) for k in differ] for cid, v in per_cell.items()]), ""]
    elif per_cell:
        parts += ["Every cell with a record ran in the same environment.", ""]
    parts += [table(["field", "value (every cell)"], [[cell(k), code(value_text(v))] for k, v in common.items()]), ""]

    parts += ["## Reproduce", ""]
    for label, cmd in data.commands:
        if cmd:
            parts += [f"{cell(label)}:", "", "```sh", cmd, "```", ""]
    return "\n".join(parts).rstrip() + "\n"
