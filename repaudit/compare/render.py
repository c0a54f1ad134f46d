"""Human-readable views of a diff: a rich table for the terminal and a Markdown page.

Rates are truncated, never rounded up: 100% means every row, and 99.99% means not all; 0.00%
means none, and a rate above zero but under 0.01% reads "<0.01%".
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from .result import DiffResult


def pct(num: int, den: int) -> str:
    if den == 0:
        return "n/a"
    if num == den:
        return "100%"
    basis_points = 10000 * num // den  # integer floor: a float quotient can round up to 100.00%
    if basis_points == 0 and num:
        return "<0.01%"
    return f"{basis_points // 100}.{basis_points % 100:02d}%"


def num(x: Any) -> str:
    """Exact float text (shortest repr that round-trips), ints as ints."""
    return repr(float(x)) if isinstance(x, float) else str(x)


def metric_rows(r: DiffResult) -> list[tuple[str, str]]:
    shared = r.shared_prompts
    seq_tok = sum(p.token_match for p in shared)
    seq_bit = sum(p.bitwise_match for p in shared)
    rows = [
        ("rows (A / B / matched)", f"{r.rows_a} / {r.rows_b} / {r.matched}"),
        ("compared logprobs", f"{r.comparable}" + (f" ({r.after_divergence} after token divergence not compared)" if r.after_divergence else "")),
        ("bitwise-equal logprobs", f"{r.bitwise_equal}/{r.comparable} ({pct(r.bitwise_equal, r.comparable)})"),
        ("equal row digests", held(r.digest_equal, r.digest_compared, r.digest_only_a, r.digest_only_b, "n/a (no digests)")),
        ("ULP max / mean / p50 / p99", f"{r.ulp_max} / {num(r.ulp_mean)} / {r.ulp_p50} / {r.ulp_p99}"),
        ("|Δ logprob| max / mean", f"{num(r.abs_max)} / {num(r.abs_mean)}"),
        ("max |Δ prob|", num(r.prob_max)),
        ("NaN vs number / NaN payload differs", f"{r.nan_vs_number} / {r.nan_payload_differs}"),
        ("top-1 agreement", held(r.top1_equal, r.top1_compared, r.top1_only_a, r.top1_only_b, "n/a (no top-1)")),
        ("equal top-k ids", held(r.topk_ids_equal, r.topk_compared, r.topk_only_a, r.topk_only_b, "n/a (no top-k)")),
        ("equal top-k logprob bits", held(r.topk_logprobs_equal, r.topk_compared, r.topk_only_a, r.topk_only_b, "n/a (no top-k)")),
        ("sequences token-identical", f"{seq_tok}/{len(shared)} ({pct(seq_tok, len(shared))})"),
        ("sequences bitwise-identical", f"{seq_bit}/{len(shared)} ({pct(seq_bit, len(shared))})"),
    ]
    if r.unmatched_a or r.unmatched_b:
        rows.append(("rows on one side only (A / B)", f"{r.unmatched_a} / {r.unmatched_b}"))
    only_a = [p.prompt_id for p in r.prompts if not p.in_b]
    only_b = [p.prompt_id for p in r.prompts if not p.in_a]
    if only_a or only_b:
        rows.append(("prompts left out (only A / only B)", f"{len(only_a)} / {len(only_b)}"))
    return rows + rl_rows(r)


def one_sided(only_a: int, only_b: int) -> str:
    """"3 only in A, 1 only in B": rows where one record holds a column and the other not ("" for none)."""
    return ", ".join(f"{n} only in {side}" for side, n in (("A", only_a), ("B", only_b)) if n)


def held(equal: int, compared: int, only_a: int, only_b: int, none: str) -> str:
    """k/n (rate) of a column a record may lack, saying where only one side holds it."""
    one_side = one_sided(only_a, only_b)
    if not compared:
        return f"not compared ({one_side})" if one_side else none
    return f"{equal}/{compared} ({pct(equal, compared)})" + (f"; {one_side}" if one_side else "")


def rl_rows(r: DiffResult) -> list[tuple[str, str]]:
    """The RL mismatch metrics (d = logprob B - logprob A), exact floats."""
    m = r.rl
    used = f"{m.positions}" + (f" ({m.nonfinite} with a NaN or ±inf logprob left out)" if m.nonfinite else "")
    if not m.positions:
        return [("RL positions (same token)", used)]
    flips = f"{m.flips}/{m.flip_positions}" if m.flip_positions else "n/a (no top-1)"
    if m.flip_margin_p50 is not None:
        flips += f", margin p50 {num(m.flip_margin_p50)}"
    return [
        ("RL positions (same token)", used),
        ("RL KL k1 / k2 / k3", f"{num(m.kl_k1)} / {num(m.kl_k2)} / {num(m.kl_k3)}"),
        ("RL ratio min / p50 / p99 / max", f"{num(m.ratio_min)} / {num(m.ratio_p50)} / {num(m.ratio_p99)} / {num(m.ratio_max)}"),
        (f"RL ratio outside [{num(m.clip[0])}, {num(m.clip[1])}]", num(m.clip_frac)),
        ("RL |d| mean / max", f"{num(m.abs_diff_mean)} / {num(m.abs_diff_max)}"),
        ("RL max |sum d| of a sequence", num(m.seq_log_ratio_max)),
        ("RL top-1 flips", flips),
    ]


def divergent_prompts(r: DiffResult, limit: int | None = 10) -> list[dict[str, Any]]:
    out = []
    # Earliest first by where the prompt first diverges, its tokens forking or its logprob bits
    # moving (PromptDiff.first_divergence, the run summary's order); then by prompt id.
    for p in sorted((p for p in r.shared_prompts if not p.bitwise_match),
                    key=lambda p: (1 << 62 if p.first_divergence is None else p.first_divergence, p.prompt_id)):
        out.append({
            "prompt": p.prompt_id,
            "first token divergence": "—" if p.first_token_divergence is None else p.first_token_divergence,
            "first logprob divergence": "—" if p.first_logprob_divergence is None else p.first_logprob_divergence,
            "bitwise-equal": f"{p.bitwise_equal}/{p.comparable}",
            "max ULP": p.max_ulp,
        })
    return out if limit is None else out[:limit]


def verdict_line(r: DiffResult) -> str:
    if r.passed:
        return "IDENTICAL" if r.identical else "WITHIN THRESHOLDS"
    return "DIVERGENT: " + "; ".join(r.reasons)


def print_diff(r: DiffResult, console: Console | None = None) -> None:
    console = console or Console()
    title = f"{r.a.label}  vs  {r.b.label}"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", overflow="fold")
    for name, value in metric_rows(r):
        table.add_row(name, value)
    console.print(table)
    if r.cell_differences:
        console.print("cell settings that differ: " + ", ".join(f"{k} {a} → {b}" for k, a, b in r.cell_differences))
    if r.env_differences:
        console.print("[yellow]environment differs:[/] " + ", ".join(f"{k} {a} → {b}" for k, a, b in r.env_differences))
    if r.refusals:
        console.print("[yellow]compared partially:[/] " + "; ".join(r.refusals))
    rows = divergent_prompts(r)
    if rows:
        t = Table(title="first divergences (earliest first)", header_style="bold")
        for col in rows[0]:
            t.add_column(col)
        for row in rows:
            t.add_row(*(str(v) for v in row.values()))
        console.print(t)
        left_out = sum(not p.bitwise_match for p in r.shared_prompts) - len(rows)
        if left_out:  # else the table reads as every prompt that differs
            console.print(f"… and {left_out} more divergent prompts (--markdown lists them all)")
    style = "bold green" if r.passed else "bold red"
    console.print(f"[{style}]{verdict_line(r)}[/]")


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    esc = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def diff_markdown(r: DiffResult) -> str:
    parts = [
        f"# repaudit diff: `{r.a.cell_id}` vs `{r.b.cell_id}`",
        "",
        f"**Verdict: {verdict_line(r)}**",
        "",
        f"- A: `{r.a.label}`",
        f"- B: `{r.b.label}`",
        "",
        _md_table(["metric", "value"], [list(x) for x in metric_rows(r)]),
    ]
    if r.cell_differences:
        parts += ["", "## Cell settings that differ", "", _md_table(["setting", "A", "B"], [list(d) for d in r.cell_differences])]
    if r.env_differences:
        parts += ["", "## Environment differences", "", _md_table(["field", "A", "B"], [list(d) for d in r.env_differences])]
    if r.refusals:
        parts += ["", "## Compared partially", ""] + [f"- {x}" for x in r.refusals]
    rows = divergent_prompts(r, limit=None)
    if rows:
        parts += ["", "## Divergent prompts", "", _md_table(list(rows[0]), [list(x.values()) for x in rows])]
    return "\n".join(parts) + "\n"
