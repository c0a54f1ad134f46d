"""Table contents both renderers share, as plain strings (exact numbers; HTML adds colour)."""

from __future__ import annotations

from typing import Any

from ..render import num, pct
from .analysis import PairView, PromptDivergence, UlpHistogram, bin_label
from .build import CellView, ReportData


def ratio(k: int, n: int) -> str:
    return f"{k}/{n} ({pct(k, n)})" if n else "n/a"


def reference_delta(data: ReportData, cell_id: str, ref_id: str) -> str:
    """What the reference has that the cell has not: "tp=1 bs=1"."""
    a, b = data.cell(cell_id), data.cell(ref_id)
    if a is None or b is None:
        return ref_id
    out = []
    for d, short in (("engine", "engine"), ("tp", "tp"), ("batch_size", "bs"), ("nccl", "nccl"), ("kernels", "kernels"), ("mode", "mode")):
        if a.settings.get(d) != b.settings.get(d):
            out.append(f"{short}={b.settings.get(d)}")
    return " ".join(out) or ref_id


PAIR_HEADER = ["cell", "vs reference", "verdict", "bitwise-equal", "equal row digests", "ULP max / p99 / mean",
               "max |Δ logprob|", "max |Δ prob|", "top-1 agreement", "sequences forked", "first divergence"]


def pair_row(data: ReportData, p: PairView) -> dict[str, str]:
    o, r = p.outcome, p.result
    row = {"cell": o.cell, "vs reference": reference_delta(data, o.cell, o.reference)}
    if r is None:
        row["verdict"] = "FAIL: " + (o.failure or "no result")
        return {h: row.get(h, "—") for h in PAIR_HEADER}
    shared = r.shared_prompts
    first = min((d.earliest for d in p.divergences), default=None)
    row.update({
        "verdict": ("IDENTICAL" if r.identical else "pass") if r.passed else "FAIL",
        "bitwise-equal": ratio(r.bitwise_equal, r.comparable),
        "equal row digests": ratio(r.digest_equal, r.digest_compared) if r.digest_compared else "n/a",
        "ULP max / p99 / mean": f"{r.ulp_max} / {r.ulp_p99} / {r.ulp_mean:.6g}",
        "max |Δ logprob|": num(r.abs_max),
        "max |Δ prob|": num(r.prob_max),
        "top-1 agreement": ratio(r.top1_equal, r.top1_compared) if r.top1_compared else "n/a",
        "sequences forked": f"{sum(not x.token_match for x in shared)}/{len(shared)}",
        "first divergence": "—" if first is None else f"pos {first} ({len(p.divergences)}/{len(shared)} prompts)",
    })
    return row


def hist_bins(pairs: list[PairView]) -> int:
    """Bins shown for every histogram: up to the largest bin any pair uses (at least 0..4)."""
    return max([4] + [p.hist.max_bin for p in pairs if p.hist is not None]) + 1


def hist_summary(h: UlpHistogram) -> str:
    n = h.total
    text = f"{int(h.counts[0])}/{n} at 0 ULP ({pct(int(h.counts[0]), n)})"
    if h.nan_vs_number or h.nan_payload_differs:
        text += f"; NaN on one side {h.nan_vs_number}, NaN payloads differ {h.nan_payload_differs}"
    return text


def hist_labels(nbins: int) -> list[str]:
    return [bin_label(k) for k in range(nbins)]


def logprob_text(bits: int | None) -> tuple[str, str]:
    """(exact value as the shortest text that reads back to it, the float32 bit pattern)."""
    if bits is None:
        return "—", ""
    import numpy as np

    return repr(float(np.uint32(bits).view(np.float32))), f"0x{bits:08x}"


def token_text(piece: str, token: int | None) -> str:
    if token is None:
        return "(sequence ended)"
    return f"{piece!r} #{token}"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F)}
_CONTROL.update({0x0A: "↵", 0x09: "⇥", 0x0D: "␍"})


def visible(s: str) -> str:
    """Characters a reader must see: newlines and tabs as symbols (context stays on one line),
    other control characters as \\xNN."""
    return s.translate(_CONTROL)


def divergence_cells(d: PromptDivergence) -> dict[str, Any]:
    la, ba = logprob_text(d.a.bits)
    lb, bb = logprob_text(d.b.bits)
    where = d.phase
    if d.completion_start is not None and d.pos >= d.completion_start:
        where = f"completion +{d.pos - d.completion_start}"
    return {
        "prompt": d.prompt_id, "position": str(d.pos), "where": where,
        "kind": "token fork" if d.kind == "token" else "logprob bits",
        "bits from": "—" if d.first_bits is None else str(d.first_bits),
        "context": ("…" if d.context_cut else "") + visible(d.context),
        "token A": token_text(d.a.piece, d.a.token), "token B": token_text(d.b.piece, d.b.token),
        "logprob A": la, "bits A": ba, "logprob B": lb, "bits B": bb,
        "ULP": "—" if d.ulp is None else str(d.ulp),
        "after A": visible(d.a.after), "after B": visible(d.b.after),
        "prompt bitwise-equal": f"{d.diff.bitwise_equal}/{d.diff.comparable}",
        "prompt max ULP": str(d.diff.max_ulp),
    }


def timing_rows(data: ReportData) -> list[dict[str, Any]]:
    rows = []
    for c in data.cells:
        t = c.timing or {}
        rows.append({
            "cell": c.id, "status": c.status or "—", "seconds": c.seconds,
            "prefill tok/s": t.get("prefill_tokens_per_s"), "decode tok/s": t.get("decode_tokens_per_s"),
            "prefill tokens": t.get("prefill_tokens"), "decode tokens": t.get("decode_tokens"), "group": c.group or "—",
        })
    return rows


def rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def secs(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def timing_totals(data: ReportData) -> str:
    cell_s = sum(c.seconds or 0.0 for c in data.cells)
    loads = sum(sum(g.load_s) for g in data.groups)
    if data.wall_s is None:
        return f"Sum of cell times {cell_s:.2f} s; model loads {loads:.2f} s over {len(data.groups)} launch group(s)."
    other = data.wall_s - cell_s - loads
    text = (f"Whole matrix {data.wall_s:.2f} s wall; sum of cell times {cell_s:.2f} s; model loads {loads:.2f} s over "
            f"{len(data.groups)} launch group(s)")
    if other >= 0:
        text += f"; {other:.2f} s outside cells and loads (process start-up, rendezvous, tokenisation, diffs)"
    return text + "."


def failed_cells(data: ReportData) -> list[CellView]:
    return [c for c in data.cells if c.status != "done"]
