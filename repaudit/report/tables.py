"""Table contents both renderers share, as plain strings (exact numbers; HTML adds colour)."""

from __future__ import annotations

import math
from typing import Any

from ..compare.render import held, num, one_sided, pct
from ..compare.result import DiffResult
from ..units import seconds_text
from .analysis import RATIO_CENTER, LogRatioHistogram, PairView, PromptDivergence, UlpHistogram, bin_label, log_ratio_position
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
               "max |Δ logprob|", "max |Δ prob|", "top-1 agreement", "equal top-k ids / logprobs", "sequences forked",
               "first divergence"]


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
        "equal row digests": held(r.digest_equal, r.digest_compared, r.digest_only_a, r.digest_only_b, "n/a"),
        "ULP max / p99 / mean": f"{r.ulp_max} / {r.ulp_p99} / {num(r.ulp_mean)}",
        "max |Δ logprob|": num(r.abs_max),
        "max |Δ prob|": num(r.prob_max),
        "top-1 agreement": held(r.top1_equal, r.top1_compared, r.top1_only_a, r.top1_only_b, "n/a"),
        "equal top-k ids / logprobs": _topk_cell(r),
        "sequences forked": f"{sum(not x.token_match for x in shared)}/{len(shared)}",
        "first divergence": "—" if first is None else f"pos {first} ({len(p.divergences)}/{len(shared)} prompts)",
    })
    return row


def _topk_cell(r: DiffResult) -> str:
    """Equal ids k/n (rate) / equal logprob bits rate, and where only one side holds a top-k list."""
    if not r.topk_compared:
        return held(0, 0, r.topk_only_a, r.topk_only_b, "n/a")
    one_side = one_sided(r.topk_only_a, r.topk_only_b)
    return (f"{ratio(r.topk_ids_equal, r.topk_compared)} / {pct(r.topk_logprobs_equal, r.topk_compared)}"
            + (f"; {one_side}" if one_side else ""))


RL_HEADER = ["pair", "positions", "KL k1", "KL k2", "KL k3", "ratio min", "ratio p50", "ratio p99", "ratio max",
             "outside clip", "|d| mean", "|d| max", "max |Σd| of a sequence", "top-1 flips", "flip margin p50"]


def rl_row(p: PairView) -> dict[str, str]:
    """The RL metrics of a pair (d = logprob B - logprob A; exact floats, "—" where undefined)."""
    m = p.result.rl
    show = lambda x: "—" if x is None else num(x)  # noqa: E731
    return {
        "pair": p.label, "positions": str(m.positions) + (f" (+{m.nonfinite} non-finite left out)" if m.nonfinite else ""),
        "KL k1": show(m.kl_k1), "KL k2": show(m.kl_k2), "KL k3": show(m.kl_k3),
        "ratio min": show(m.ratio_min), "ratio p50": show(m.ratio_p50), "ratio p99": show(m.ratio_p99),
        "ratio max": show(m.ratio_max), "outside clip": f"{show(m.clip_frac)} of [{num(m.clip[0])}, {num(m.clip[1])}]",
        "|d| mean": show(m.abs_diff_mean), "|d| max": show(m.abs_diff_max), "max |Σd| of a sequence": show(m.seq_log_ratio_max),
        "top-1 flips": f"{m.flips}/{m.flip_positions} ({pct(m.flips, m.flip_positions)})" if m.flip_positions else "n/a",
        "flip margin p50": show(m.flip_margin_p50),
    }


def ratio_markers(h: LogRatioHistogram) -> list[tuple[float, str]]:
    """The clip bounds on the log-ratio axis: d = log(LO) and log(HI), where they are finite."""
    lo, hi = h.clip
    out = [(log_ratio_position(math.log(lo)), f"log {num(lo)}")] if lo > 0 else []
    return out + ([(log_ratio_position(math.log(hi)), f"log {num(hi)}")] if math.isfinite(hi) else [])


def ratio_summary(h: LogRatioHistogram) -> str:
    zero = int(h.counts[RATIO_CENTER])
    return f"{zero}/{h.total} at d = 0 (ratio exactly 1, {pct(zero, h.total)})"


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
            "generated tok/s": t.get("generated_tokens_per_s"),
            # A count is shown only where the engine timed that phase apart: a vLLM generate cell
            # (prefill and decode interleaved, all in mixed_s) holds 0 for both, not its real counts.
            "prefill tokens": t.get("prefill_tokens") if t.get("prefill_s") else None,
            "decode tokens": t.get("decode_tokens") if t.get("decode_s") else None,
            "generated tokens": t.get("generated_tokens") or None, "group": c.group or "—",
        })
    return rows


def secs(x: float | None) -> str:
    return "—" if x is None else seconds_text(x, 2)


def timing_totals(data: ReportData) -> str:
    cell_s = sum(c.seconds or 0.0 for c in data.cells)
    loads = sum(sum(g.load_s) for g in data.groups)
    if data.wall_s is None:
        return f"Sum of cell times {seconds_text(cell_s, 2)} s; model loads {seconds_text(loads, 2)} s over {len(data.groups)} launch group(s)."
    other = data.wall_s - cell_s - loads
    text = (f"Whole matrix {seconds_text(data.wall_s, 2)} s wall; sum of cell times {seconds_text(cell_s, 2)} s; "
            f"model loads {seconds_text(loads, 2)} s over {len(data.groups)} launch group(s)")
    if other >= 0:
        text += f"; {seconds_text(other, 2)} s outside cells and loads (process start-up, rendezvous, tokenisation, diffs)"
    return text + "."


def failed_cells(data: ReportData) -> list[CellView]:
    return [c for c in data.cells if c.status != "done"]
