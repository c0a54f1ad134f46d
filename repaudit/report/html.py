"""report.html: one self-contained page (inline CSS and SVG; no script, no network).

Longer than 450 lines because it is one page: its CSS and each section's markup, in the order
the page shows them, so that the page reads top to bottom here too. The numbers come ready-made
from analysis.py and tables.py."""

from __future__ import annotations

import re
from html import escape
from typing import Any, Iterable

from .. import __version__
from ..compare.render import pct
from ..units import rate_text
from . import svg
from .analysis import MatrixView, PairView, log_ratio_labels
from .build import ReportData, env_table, value_text
from .headline import tiles, verdict
from .tables import (PAIR_HEADER, RL_HEADER, divergence_cells, failed_cells, hist_bins, hist_labels, hist_summary, pair_row,
                     ratio_markers, ratio_summary, rl_row, secs, timing_rows, timing_totals)

DIVERGENCE_ROWS = 50  # per pair in the page; report.md and `repaudit diff --markdown` list them all

CSS = """
:root { --ink:#1f2937; --muted:#6b7280; --line:#e5e7eb; --bg:#ffffff; --soft:#f8fafc;
        --pass:#15803d; --pass-bg:#dcfce7; --fail:#b91c1c; --fail-bg:#fee2e2; --warn:#a16207; --warn-bg:#fef9c3; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--ink); background: var(--bg); }
main { max-width: 1440px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 34px 0 6px; padding-top: 10px; border-top: 1px solid var(--line); }
h3 { font-size: 14px; margin: 18px 0 6px; }
p.lead { color: var(--muted); margin: 0 0 10px; max-width: 980px; }
code, pre, .mono, td.num { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; overflow-x: auto; white-space: pre-wrap; word-break: break-all; margin: 4px 0 12px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 10px 0 0; font-size: 13px; }
dl.facts dt { color: var(--muted); } dl.facts dd { margin: 0; font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; word-break: break-all; }
.verdict { margin: 18px 0 12px; padding: 12px 16px; border-radius: 8px; font-weight: 700; font-size: 17px; }
.verdict.pass { background: var(--pass-bg); color: var(--pass); } .verdict.fail { background: var(--fail-bg); color: var(--fail); }
.verdict.warn { background: var(--warn-bg); color: var(--warn); }
.verdict ul { font-weight: 400; font-size: 13px; margin: 6px 0 0; padding-left: 20px; }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 10px; }
.tile { border: 1px solid var(--line); border-left-width: 4px; border-radius: 6px; padding: 8px 12px; background: #fff; }
.tile.pass { border-left-color: var(--pass); } .tile.fail { border-left-color: var(--fail); } .tile.warn { border-left-color: #eab308; }
.tile .label { color: var(--muted); font-size: 12px; } .tile .value { font: 600 19px/1.3 ui-monospace, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
.tile .value.long { font-size: 14.5px; padding-top: 3px; }
.tile .detail { color: var(--muted); font-size: 11.5px; overflow-wrap: anywhere; }
nav { margin: 10px 0 0; font-size: 13px; } nav a { color: #1d4ed8; text-decoration: none; margin-right: 14px; }
.sub { display: block; color: var(--muted); font-size: 11.5px; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 12.5px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; position: sticky; top: 0; }
td.num { text-align: right; white-space: nowrap; }
tr.fail td:first-child { box-shadow: inset 3px 0 var(--fail); } tr.pass td:first-child { box-shadow: inset 3px 0 var(--pass); }
.badge { display: inline-block; padding: 0 7px; border-radius: 10px; font-size: 11.5px; font-weight: 700; white-space: nowrap; }
.badge.pass { background: var(--pass-bg); color: var(--pass); } .badge.fail { background: var(--fail-bg); color: var(--fail); }
.badge.warn { background: var(--warn-bg); color: var(--warn); }
table.grid { margin: 10px 0; border-collapse: separate; border-spacing: 3px; font-size: 12.5px; }
table.grid th { font-weight: 600; text-align: center; padding: 2px 8px; color: #334155; }
table.grid td { text-align: center; padding: 4px 8px; border-radius: 4px; font-weight: 700; min-width: 64px; }
table.grid td.pass { background: #bbf7d0; color: #14532d; } table.grid td.fail { background: #fecaca; color: #7f1d1d; }
table.grid td.ref { background: #e2e8f0; color: #475569; font-weight: 400; }
.reasons { color: var(--fail); font-size: 11.5px; }
tr.why td { border-top: none; padding-top: 0; padding-left: 22px; }
tr.fail:not(.why):has(+ tr.why) td { border-bottom: none; }
td.id { white-space: nowrap; }
table.pairs td, table.pairs th { padding: 4px 6px; } table.pairs td.num { font-size: 12px; }
.scroll { overflow-x: auto; }
.plots { display: flex; flex-wrap: wrap; gap: 18px 26px; align-items: flex-start; }
svg.plot { max-width: 100%; height: auto; }
svg.bar { vertical-align: middle; margin-right: 6px; }
details { border: 1px solid var(--line); border-radius: 6px; margin: 8px 0; padding: 4px 10px; }
details > summary { cursor: pointer; font-weight: 600; padding: 4px 0; }
details > summary .muted { font-weight: 400; }
.muted { color: var(--muted); }
td.ctx { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; min-width: 300px; max-width: 480px; white-space: pre-wrap; word-break: break-word; }
.ctx .shared { color: #374151; } .ctx .ell { color: var(--muted); }
mark.a { background: #dbeafe; color: #1e3a8a; border-radius: 3px; padding: 0 2px; }
mark.b { background: #fde68a; color: #78350f; border-radius: 3px; padding: 0 2px; }
mark.same { background: #e9d5ff; color: #4c1d95; border-radius: 3px; padding: 0 2px; }
.bits { color: var(--muted); font-size: 11px; }
td.hl { background: var(--warn-bg); font-weight: 600; }
.kv { display: grid; grid-template-columns: repeat(auto-fill, minmax(300px, 1fr)); gap: 2px 18px; font-size: 12.5px; }
.kv div { border-bottom: 1px dotted var(--line); padding: 2px 0; word-break: break-all; } .kv b { font-weight: 600; color: var(--muted); margin-right: 6px; }
footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
"""


def e(x: Any) -> str:
    return escape(str(x), quote=True)


def _table(header: list[str], rows: Iterable[list[str]], cls: str = "", row_cls: Iterable[str] | None = None) -> str:
    """Cells are HTML already (escape before calling)."""
    rcls = list(row_cls) if row_cls is not None else None
    body = "".join(f'<tr class="{rcls[i] if rcls else ""}">' + "".join(r) + "</tr>" for i, r in enumerate(rows))
    return (f'<div class="scroll"><table class="{cls}"><thead><tr>' + "".join(f"<th>{e(h)}</th>" for h in header)
            + f"</tr></thead><tbody>{body}</tbody></table></div>")


def _td(x: Any, cls: str = "", raw: bool = False, title: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    t = f' title="{e(title)}"' if title else ""
    return f"<td{c}{t}>{x if raw else e(x)}</td>"


# ------------------------------------------------------------------------------ sections


# A cell id (plan.Cell.id): engine-tpN-bsN-nccl-kernels[-scenario]-mode. The kernel modes and the
# modes are named, so a scenario suffix ("-prefix-hit") is not read as part of the NCCL preset.
_CELL_ID = re.compile(r"^(?P<engine>[^-]+)-tp(?P<tp>\d+)-bs(?P<bs>\d+)-(?P<nccl>.+?)-(?P<kernels>stock|bi|tbik)"
                      r"(?:-(?P<scenario>.+?))?-(?P<mode>generate|score)$")


def _grid(data: ReportData) -> str:
    """The verdicts at a glance: a row per (engine, kernel mode, mode), a column per (TP, batch
    size, NCCL preset); each square is that cell against its reference, green or red."""
    cases = [p for p in data.gate.all_cases if _CELL_ID.match(p.cell)]
    if data.kind != "run" or not cases:
        return ""
    parts = {p.cell: _CELL_ID.match(p.cell).groupdict() for p in cases}
    many_engines = len({v["engine"] for v in parts.values()}) > 1
    row_key = lambda v: (((v["engine"],) if many_engines else ()) + (v["kernels"],)  # noqa: E731
                         + ((v["scenario"],) if v["scenario"] else ()) + (v["mode"],))
    col_key = lambda v: (int(v["tp"]), int(v["bs"]), v["nccl"])  # noqa: E731
    ref_at = {(row_key(m.groupdict()), col_key(m.groupdict())) for m in map(_CELL_ID.match, {p.reference for p in cases}) if m}
    rows = list(dict.fromkeys([row_key(v) for v in parts.values()] + [r for r, _ in sorted(ref_at)]))
    cols = sorted({col_key(v) for v in parts.values()} | {c for _, c in ref_at})
    by = {(row_key(parts[p.cell]), col_key(parts[p.cell])): p for p in cases}
    head = "".join(f"<th>TP {tp}<br>bs {bs}<br>{e(nccl)}</th>" for tp, bs, nccl in cols)
    body = []
    for r in rows:
        tds = []
        for c in cols:
            p = by.get((r, c))
            if p is None:  # a reference cell has a square of its own only when it failed
                tds.append('<td class="ref">reference</td>' if (r, c) in ref_at else "<td></td>")
                continue
            rate = pct(p.result.bitwise_equal, p.result.comparable) if p.result is not None else "did not complete"
            tds.append(f'<td class="{"pass" if p.passed else "fail"}" title="{e(p.cell)} vs {e(p.reference)}">'
                       f'{"pass" if p.passed else "FAIL"}<br><span class="sub">{e(rate)}</span></td>')
        body.append(f"<tr><th>{e(' '.join(r))}</th>{''.join(tds)}</tr>")
    return f'<table class="grid"><tr><th></th>{head}</tr>{"".join(body)}</table>'


def _header(data: ReportData) -> str:
    facts = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in data.facts)
    text, tone = verdict(data)
    reasons = ""
    if data.gate.failures and data.kind == "run":
        items = "".join(f"<li><code>{e(p.cell)}</code>: {e('; '.join(p.reasons))}</li>" for p in data.gate.failures[:8])
        more = f"<li>… and {len(data.gate.failures) - 8} more (table below)</li>" if len(data.gate.failures) > 8 else ""
        reasons = f"<ul>{items}{more}</ul>"
    tl = "".join(
        f'<div class="tile {t.tone}"><div class="label">{e(t.label)}</div><div class="value{" long" if len(t.value) > 14 else ""}">{e(t.value)}</div>'
        f'<div class="detail">{e(t.detail)}</div></div>' for t in tiles(data))
    links = [("pairs", "cells vs reference"), ("matrix", "cell × cell"), ("ulp", "ULP histograms"), ("rl", "RL mismatch"),
             ("first", "first divergence"),
             ("tokens", "divergent tokens"), ("speed", "speed"), ("env", "environment"), ("repro", "reproduce")]
    if data.locates:
        links.insert(6, ("locate", "first divergent module"))
    if data.kind != "run":
        links = [x for x in links if x[0] not in ("matrix", "speed")]
    nav = "<nav>" + "".join(f'<a href="#{k}">{e(v)}</a>' for k, v in links) + "</nav>"
    return (f"<header><h1>{e(data.title)}</h1><dl class=\"facts\">{facts}</dl>{nav}</header>"
            f'<div class="verdict {tone}" id="verdict">{e(text)}{_grid(data)}{reasons}</div><div class="tiles">{tl}</div>')


def _pairs(data: ReportData) -> str:
    if not data.pairs:
        return "<h2 id=\"pairs\">Each cell against its reference</h2><p class=\"lead\">No cell has a reference other than itself.</p>"
    # verdict and reference go under the cell id: the table stays within a laptop screen's width
    header = [h for h in PAIR_HEADER if h not in ("vs reference", "verdict")]
    rows, classes = [], []
    for p in data.pairs:
        row = pair_row(data, p)
        ok = p.outcome.passed
        cells = []
        for h in header:
            v = row[h]
            if h == "cell":
                vs = f"vs {row['vs reference']}" if data.kind == "run" else f"vs {p.outcome.reference}"
                badge = f'<span class="badge {"pass" if ok else "fail"}">{e(row["verdict"].split(":")[0])}</span>'
                cells.append(_td(f'<code>{e(v)}</code><span class="sub" title="{e(p.outcome.reference)}">{badge} {e(vs)}</span>',
                                 "id", raw=True))
            else:
                cells.append(_td(v, "num"))
        rows.append(cells)
        classes.append("pass" if ok else "fail")
        if not ok:
            rows.append([f'<td class="reasons" colspan="{len(header)}">{e("; ".join(p.outcome.reasons))}</td>'])
            classes.append("fail why")
    lead = ("Every completed cell diffed with its reference cell (the baseline taken with the cell's own "
            + e(", ".join(data.gate.properties.get("reference_per", "").split(","))) + "), exactly as "
            "<code>repaudit gate</code> does. Rates are truncated, never rounded up: 100% means every row.")
    if data.kind == "pair":
        lead = "B diffed with A, exactly as <code>repaudit diff</code> does. Rates are truncated, never rounded up: 100% means every row."
    failed = failed_cells(data)
    extra = ""
    if failed and data.kind == "run":
        extra = "<h3>Cells that did not complete</h3>" + _table(
            ["cell", "status", "reason"],
            [[_td(f"<code>{e(c.id)}</code>", raw=True), _td(c.status or "missing"), _td(c.reason or "—")] for c in failed])
    heading = "Each cell against its reference" if data.kind == "run" else "B against A"
    return (f'<h2 id="pairs">{e(heading)}</h2><p class="lead">{lead}</p>'
            + _table(header, rows, "pairs", classes) + extra)


def _matrix_svgs(mv: MatrixView) -> str:
    if mv.skipped:
        return f"<p class=\"lead\">{e(mv.mode)}: {e(mv.skipped)}.</p>"
    worst = max((x.ulp_max for x in mv.entries.values() if x.error is None), default=0)

    def heat_cell(show):
        """(colour, text, hover) of entry (i, j) from show(entry) -> (colour, text, detail)."""
        def cell(i: int, j: int):
            x = mv.entry(i, j)
            if x is None:
                return None
            hover = f"{mv.ids[i]}\nvs {mv.ids[j]}\n"
            if x.error:
                return (svg.NA, "n/a", hover + x.error)
            colour, text, detail = show(x)
            return colour, text, hover + detail
        return cell

    rate_cell = heat_cell(lambda x: (
        # Green means every bit of the pair agrees (docs/ci.md): 100% of the logprobs before a fork, or
        # beside differing row digests or top-k, is yellow.
        svg.rate_colour(x.bitwise_equal, x.comparable, x.identical), pct(x.bitwise_equal, x.comparable),
        f"bitwise-equal {x.bitwise_equal}/{x.comparable} ({pct(x.bitwise_equal, x.comparable)}); max {x.ulp_max} ULP"
        + ("; identical" if x.identical else "")))
    ulp_cell = heat_cell(lambda x: (
        svg.ulp_colour(x.ulp_max, worst), str(x.ulp_max),
        f"max {x.ulp_max} ULP; bitwise-equal {x.bitwise_equal}/{x.comparable} ({pct(x.bitwise_equal, x.comparable)})"))

    marked = {i for i, cid in enumerate(mv.ids) if cid in mv.references}
    return ('<div class="plots">'
            + svg.heatmap(mv.labels, rate_cell, f"{mv.mode}: bitwise-equal logprobs", marked,
                          "green = 100% (every bit); yellow → red = fewer equal")
            + svg.heatmap(mv.labels, ulp_cell, f"{mv.mode}: max ULP distance", marked,
                          f"green = 0; yellow → red = 1 … {worst} ULP (log scale)" if worst else "green = 0 ULP: every pair")
            + "</div>")


def _matrices(data: ReportData) -> str:
    if data.kind != "run":
        return ""
    if not data.matrices:
        return ('<h2 id="matrix">Cell × cell</h2><p class="lead">Fewer than two completed cells per mode: '
                "nothing to cross-compare.</p>")
    return ('<h2 id="matrix">Cell × cell</h2><p class="lead">Every completed cell against every other cell of the same mode '
            "(one <code>repaudit diff</code> per pair; ★ marks reference cells). Labels show only the settings that vary; "
            "hover a square for the full cell ids and counts.</p>" + "".join(_matrix_svgs(mv) for mv in data.matrices))


def _histograms(data: ReportData) -> str:
    with_hist = [p for p in data.pairs if p.hist is not None]
    head = ('<h2 id="ulp">ULP distance of compared logprobs</h2><p class="lead">Every compared logprob (matched rows '
            "before any token fork) binned by its float32 ULP distance: 0, 1, 2–3, 4–7, … Count axis is logarithmic; "
            "the number over a bar is its exact count.</p>")
    if not with_hist:
        return head + "<p class=\"lead\">No pair could be compared.</p>"
    nbins = hist_bins(with_hist)
    labels = hist_labels(nbins)
    y_max = max(int(p.hist.counts.max()) for p in with_hist)
    colours = [svg.EQUAL] + [svg.ulp_colour(1 << (k - 1), 1 << max(1, nbins - 2)) for k in range(1, nbins)]
    charts = []
    for p in with_hist:
        title = p.label if data.kind == "pair" else f"{p.label}  vs {_short_ref(data, p)}"
        charts.append(svg.histogram([int(c) for c in p.hist.counts[:nbins]], labels, title, hist_summary(p.hist), y_max, colours))
    return head + '<div class="plots">' + "".join(charts) + "</div>"


def _rl(data: ReportData) -> str:
    """The RL mismatch metrics of each pair, and its log-ratio d = logprob B - logprob A as a histogram."""
    pairs = [p for p in data.pairs if p.result is not None]
    head = ('<h2 id="rl">RL mismatch</h2><p class="lead">What an RL trainer logs between rollout (A, the reference) and '
            "trainer (B), over positions where both hold the same token after the same context and finite logprobs: "
            "d = logprob B − logprob A; KL estimators k1 = mean(−d), k2 = mean(d²/2), k3 = mean(exp(d) − 1 − d); the "
            "importance ratio exp(d) and the share outside the clip bounds; the largest |Σd| over one sequence; top-1 "
            "flips and record A's top-1 − top-2 margin where they flip. Exact floats; docs/metrics.md gives each "
            "formula.</p>")
    if not pairs:
        return head + "<p class=\"lead\">No pair could be compared.</p>"
    table = _table(RL_HEADER, [[_td(v, "id" if h == "pair" else "num") for h, v in rl_row(p).items()] for p in pairs])
    with_hist = [p for p in pairs if p.ratio_hist is not None and p.ratio_hist.total]
    if not with_hist:
        return head + table
    labels = log_ratio_labels()
    y_max = max(int(p.ratio_hist.counts.max()) for p in with_hist)
    colours = [svg.EQUAL if lab == "0" else "#3b82f6" for lab in labels]
    charts = []
    for p in with_hist:
        title = p.label if data.kind == "pair" else f"{p.label}  vs {_short_ref(data, p)}"
        charts.append(svg.histogram([int(c) for c in p.ratio_hist.counts], labels, f"log-ratio d: {title}",
                                    ratio_summary(p.ratio_hist), y_max, colours, width=520, unit="(decade of d)",
                                    markers=ratio_markers(p.ratio_hist)))
    note = ('<p class="lead">Positions by d in signed decades of |d| (the ratio is exp(d); 0 = d of 0, ratio exactly 1: bitwise-equal logprobs, '
            "or +0.0 against -0.0). Dashed lines: the clip bounds log LO and log HI. Count axis is logarithmic.</p>")
    return head + table + note + '<div class="plots">' + "".join(charts) + "</div>"


def _short_ref(data: ReportData, p: PairView) -> str:
    from .tables import reference_delta

    return reference_delta(data, p.outcome.cell, p.outcome.reference)


def _strip(data: ReportData) -> str:
    with_res = [p for p in data.pairs if p.result is not None]
    head = ('<h2 id="first">Where sequences first diverge</h2><p class="lead">One mark per prompt at the first position '
            "where the two records differ; prompts that never differ have no mark. The note on the right counts "
            "prompts with any difference and, of those, prompts whose tokens fork.</p>")
    if not with_res:
        return head + "<p class=\"lead\">No pair could be compared.</p>"
    rows = []
    for p in with_res:
        r = p.result
        shared = len(r.shared_prompts)
        forks = sum(d.fork is not None for d in p.divergences)
        points = []
        for d in p.divergences:
            if d.first_bits is not None:
                points.append((d.first_bits, "logprob", f"{d.prompt_id}: logprob bits first differ at pos {d.first_bits}"))
            if d.fork is not None:
                points.append((d.fork, "token", f"{d.prompt_id}: tokens fork at pos {d.fork} ({d.phase})"))
        label = p.label if data.kind == "pair" else f"{p.label} vs {_short_ref(data, p)}"
        rows.append((label, points, f"{len(p.divergences)}/{shared} differ, {forks} fork"))
    return head + svg.strip(rows, data.max_pos, "first divergence position per prompt")


def _context_html(d: dict[str, Any], kind: str, ta: str, tb: str) -> str:
    ctx = d["context"]
    ell = ""
    if ctx.startswith("…"):
        ell, ctx = '<span class="ell">…</span>', ctx[1:]
    if kind == "token fork":
        return (f'{ell}<span class="shared">{e(ctx)}</span><br>A: <mark class="a">{e(ta)}</mark>{e(d["after A"])}'
                f'<br>B: <mark class="b">{e(tb)}</mark>{e(d["after B"])}')
    return f'{ell}<span class="shared">{e(ctx)}</span><mark class="same">{e(ta)}</mark>'


def _divergences(data: ReportData) -> str:
    head = ('<h2 id="tokens">First divergent token, per prompt</h2><p class="lead">For each prompt that differs: the shared '
            "text before the first divergent token, then the token(s) there: where the tokens fork if they do (with the "
            "position where logprob bits first differed), else the first token whose logprob bits differ. Logprobs are the exact float32 values (shortest "
            "text that reads back to the same float) with their bit patterns. " + e(data.token_note) + ".</p>")
    blocks = []
    first_open = True
    for p in data.pairs:
        if not p.divergences:
            continue
        title = p.label if data.kind == "pair" else f"{p.outcome.cell}"
        earliest = p.divergences[0]
        forks = sum(d.fork is not None for d in p.divergences)
        against = "" if data.kind == "pair" else f"vs {e(p.outcome.reference)} · "  # a pair's title names both sides
        summary = (f"<code>{e(title)}</code> <span class=\"muted\">{against}{len(p.divergences)} prompts differ"
                   f"{f', {forks} fork' if forks else ''} · earliest pos {earliest.earliest} ({e(earliest.prompt_id)})</span>")
        rows = []
        for d in p.divergences[:DIVERGENCE_ROWS]:
            c = divergence_cells(d)
            ta = repr(d.a.piece) if d.a.token is not None else "(ended)"
            tb = repr(d.b.piece) if d.b.token is not None else "(ended)"
            text_a = e(c["token A"])
            text_b = e(c["token B"])
            rows.append([
                _td(f"<code>{e(c['prompt'])}</code>", "id", raw=True), _td(f'{e(c["position"])}<span class="sub">{e(c["where"])}</span>', "num", raw=True),
                _td(f'<span class="badge {"fail" if d.kind == "token" else "warn"}">{e(c["kind"])}</span>'
                    + (f'<span class="sub">bits differ from pos {e(c["bits from"])}</span>' if d.kind == "token" and d.first_bits is not None else ""),
                    raw=True),
                _td(_context_html(c, c["kind"], d.a.piece if d.a.token is not None else ta,
                                  d.b.piece if d.b.token is not None else tb), "ctx", raw=True),
                _td(f'<mark class="a">{text_a}</mark><br>{e(c["logprob A"])}<br><span class="bits">{e(c["bits A"])}</span>', "num", raw=True),
                _td(f'<mark class="b">{text_b}</mark><br>{e(c["logprob B"])}<br><span class="bits">{e(c["bits B"])}</span>', "num", raw=True),
                _td(c["ULP"], "num"), _td(c["prompt bitwise-equal"], "num"), _td(c["prompt max ULP"], "num"),
            ])
        more = ""
        if len(p.divergences) > DIVERGENCE_ROWS:
            more = f'<p class="muted">… and {len(p.divergences) - DIVERGENCE_ROWS} more prompts: report.md lists them all.</p>'
        table = _table(["prompt", "position", "what differs", "text before → token", "A (reference): token, logprob",
                        "B: token, logprob", "ULP", "prompt bitwise-equal", "prompt max ULP"], rows, "div")
        cmd = p.outcome.diff_command(data.thresholds)
        cmd_html = f"<pre>{e(cmd)}</pre>" if cmd and data.kind == "run" else ""
        blocks.append(f"<details{' open' if first_open else ''}><summary>{summary}</summary>{table}{more}{cmd_html}</details>")
        first_open = False
    if not blocks:
        return head + "<p class=\"lead\">No prompt differs in any compared pair.</p>"
    return head + "".join(blocks)


def _speed(data: ReportData) -> str:
    if data.kind != "run":
        return ""
    rows = timing_rows(data)
    top_p = max((r["prefill tok/s"] or 0 for r in rows), default=0)
    top_d = max((r["decode tok/s"] or 0 for r in rows), default=0)
    top_g = max((r["generated tok/s"] or 0 for r in rows), default=0)
    body = []
    for r in rows:
        def cell(key: str, top: float) -> str:
            v = r[key]
            if v is None:
                return _td("—", "num")
            return _td(svg.bar(v, top, f"{r['cell']}: {rate_text(v)} {key}") + e(rate_text(v)), "num", raw=True)
        body.append([_td(f"<code>{e(r['cell'])}</code>", raw=True), _td(r["group"]),
                     _td(r["status"], "" if r["status"] == "done" else "hl"), _td(secs(r["seconds"]), "num"),
                     cell("prefill tok/s", top_p), cell("decode tok/s", top_d), cell("generated tok/s", top_g),
                     _td(value_text(r["prefill tokens"]), "num"), _td(value_text(r["decode tokens"]), "num"),
                     _td(value_text(r["generated tokens"]), "num")])
    groups = _table(["launch group", "cells", "model load s", "attempts"],
                    [[_td(f"<code>{e(g.id)}</code>", raw=True), _td(len(g.cells), "num"),
                      _td(" + ".join(f"{x:.2f}" for x in g.load_s) or "—", "num"), _td(value_text(g.attempts), "num")]
                     for g in data.groups])
    return ('<h2 id="speed">Speed and time</h2><p class="lead">Tokens per second as each cell measured them (prefill: '
            "prompt and teacher-forced tokens over the prefill time; decode: the tokens of the decode steps over their "
            "time, where the engine times them apart (vLLM interleaves prefill and decode, so it does not); generated: "
            "every generated token over all the cell's engine time). A launch group loads the model once for all "
            f"its cells.</p><p>{e(timing_totals(data))}</p>"
            + _table(["cell", "launch group", "status", "seconds", "prefill tok/s", "decode tok/s", "generated tok/s",
                      "prefill tokens", "decode tokens", "generated tokens"], body) + groups)


def _environment(data: ReportData) -> str:
    common, differ, per_cell = env_table(data.cells)
    head = ('<h2 id="env">Environment fingerprint</h2><p class="lead">From each record\'s own metadata. A new torch, '
            "driver or library with the same settings is one of the commonest reasons bits move.</p>")
    if not per_cell:
        return head + '<p class="lead">No record could be read.</p>'
    if differ:
        base = data.cells[0].id if data.cells[0].id in per_cell else next(iter(per_cell))
        rows = []
        for c in data.cells:
            if c.id not in per_cell:
                rows.append([_td(f"<code>{e(c.id)}</code>", raw=True)] + [_td("no record", "muted")] * len(differ))
                continue
            vals = per_cell[c.id]
            rows.append([_td(f"<code>{e(c.id)}</code>", raw=True)] + [
                _td(value_text(vals[k]), "hl" if value_text(vals[k]) != value_text(per_cell[base][k]) else "") for k in differ])
        diff_html = (f"<h3>Fields that differ ({len(differ)}) — highlighted where a cell differs from "
                     f"<code>{e(base)}</code></h3>" + _table(["cell"] + differ, rows))
    else:
        diff_html = f"<p><span class=\"badge pass\">same</span> Every cell with a record ran in the same environment ({len(common)} fields).</p>"
    kv = "".join(f"<div><b>{e(k)}</b><span class=\"mono\">{e(value_text(v))}</span></div>" for k, v in common.items())
    return head + diff_html + f"<h3>Shared by every cell</h3><div class=\"kv\">{kv}</div>"


def _locate(data: ReportData) -> str:
    if not data.locates:
        return ""
    rows = []
    for cell, ref, lr in data.locates:
        first = lr.first
        rows.append([_td(f"<code>{e(cell)}</code><span class=\"sub\">vs {e(ref)}</span>", "id", raw=True),
                     _td(f"<code>{e(first.name)}</code>" if first else "—", raw=True), _td(lr.sentence())])
    details = []
    for cell, ref, lr in data.locates:
        if not lr.diverged:
            continue
        body = _table(["module", "TP style", "positions differing", "max ULP (sampled)"],
                      [[_td(f"<code>{e(m.name)}</code>", raw=True), _td(m.style or ""), _td(f"{m.differing}/{m.compared}", "num"),
                        _td(m.max_ulp, "num")] for m in lr.modules],
                      row_cls=["fail" if m.differing else "pass" for m in lr.modules])
        details.append(f"<details><summary><code>{e(cell)}</code> vs <code>{e(ref)}</code>: every module</summary>{body}</details>")
    return ('<h2 id="locate">Where in the model the bits first change</h2><p class="lead">For each traced cell pair '
            '(<code>repaudit run --trace</code>), the first module in execution order whose output bits differ at any '
            'position, from per-module digests of every real position; the same as <code>repaudit locate</code>.</p>'
            + _table(["cell", "first divergent module", "summary"], rows) + "".join(details))


def _commands(data: ReportData) -> str:
    items = "".join(f"<h3>{e(label)}</h3><pre>{e(cmd)}</pre>" for label, cmd in data.commands if cmd)
    return f'<h2 id="repro">Reproduce</h2>{items}'


def _notes(data: ReportData) -> str:
    if not data.notes:
        return ""
    return "<ul class=\"muted\">" + "".join(f"<li>{e(n)}</li>" for n in data.notes) + "</ul>"


def render_html(data: ReportData) -> str:
    sections = [_header(data), _notes(data), _pairs(data), _matrices(data), _histograms(data), _rl(data), _strip(data),
                _divergences(data), _locate(data), _speed(data), _environment(data), _commands(data)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            "<link rel=\"icon\" href=\"data:,\">"
            f"<title>{e(data.title)}</title><style>{CSS}</style></head><body><main>"
            + "".join(sections)
            + f"<footer>Written by repaudit {e(__version__)}. Self-contained: no script, no network.</footer>"
            + "</main></body></html>\n")
