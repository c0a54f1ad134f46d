"""The verdict and the headline numbers, as text both renderers use (exact: rates via render.pct)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..compare.render import num, pct, verdict_line
from ..compare.summary import price_list, tokens_per_s
from ..run.plan import CELL_SETTINGS
from ..units import ratio_text, seconds_text
from .build import ReportData


@dataclass
class Tile:
    label: str
    value: str
    detail: str = ""
    tone: str = ""  # "pass", "fail", "warn" or "" (neutral)


def verdict(data: ReportData) -> tuple[str, str]:
    """(headline sentence, tone)."""
    g = data.gate
    cases = g.all_cases
    if data.kind == "pair" and data.pairs and data.pairs[0].result is not None:
        r = data.pairs[0].result
        return verdict_line(r), "pass" if r.passed else "fail"
    if not cases:
        return "NOTHING TO COMPARE: no cell has a reference other than itself", "warn"
    if not g.passed:
        return f"DIVERGENT: {len(g.failures)} of {len(cases)} cell pairs fail the gate", "fail"
    if all(p.result is not None and p.result.identical for p in g.pairs):
        return f"IDENTICAL: every one of {len(cases)} cell pairs agrees bit for bit", "pass"
    return f"WITHIN THRESHOLDS: {len(cases)} of {len(cases)} cell pairs pass (not all bitwise identical)", "pass"


def price_tiles(data: ReportData) -> list[Tile]:
    """A tile per kernel mode other than stock, where the run has stock twins: its tokens/s against
    stock's, with the cells it keeps identical; and one per scenario and kernel mode, where the run
    has cold twins: its tokens/s against cold's, with the cells identical to their cold twin
    (compare.summary.price_list, the run summary's)."""
    identical = {p.cell: p.result is not None and p.failure is None and p.result.identical for p in data.gate.pairs}
    rows = [{"settings": {d: c.settings.get(d) for d in CELL_SETTINGS}, "tokens_per_s": tokens_per_s(c.timing, c.settings["mode"]),
             **({"identical": identical[c.id]} if c.id in identical else {})} for c in data.cells]
    out = []
    for p in price_list(rows):
        if "scenario" in p:
            label, speed = f"{p['scenario']} ({p['kernels']}): speed vs cold", p["speed_vs_cold"]
        else:
            label, speed = f"{p['kernels']}: speed vs stock", (p["speed_vs_stock"] if p["kernels"] != "stock" else None)
        if speed is not None:
            out.append(Tile(label, ratio_text(speed), f"tokens/s over {p['speed_pairs']} cells · keeps "
                            f"{p['identical']}/{p['compared']} identical", "pass" if p["identical"] == p["compared"] else "fail"))
    return out


def tiles(data: ReportData) -> list[Tile]:
    out = []
    results = [(p.label, p.outcome, p.result) for p in data.pairs if p.result is not None]
    if data.kind == "run":
        done = sum(c.status == "done" for c in data.cells)
        out.append(Tile("cells completed", f"{done}/{len(data.cells)}", "", "pass" if done == len(data.cells) else "fail"))
        ident = sum(r.identical for _, _, r in results)
        out.append(Tile("identical to their reference", f"{ident}/{len(data.pairs)}", "cell pairs, every bit",
                        "pass" if ident == len(data.pairs) else "fail"))
        out += price_tiles(data)
    if results:
        # A pair with no comparable row (every prompt forks at its first token) has no rate: it
        # is not taken for the lowest one (the fork shows in the earliest-divergence tile).
        label, _, r = min(results, key=lambda x: (x[2].comparable == 0,
                                                  Fraction(x[2].bitwise_equal, max(1, x[2].comparable)), x[0]))
        # Only when every pair has none is such a pair shown: 0/0 is "n/a", not a pass (0 == 0 made it green).
        tone = "warn" if r.comparable == 0 else "pass" if r.bitwise_equal == r.comparable else "fail"
        out.append(Tile("lowest bitwise-equal", pct(r.bitwise_equal, r.comparable),
                        f"{r.bitwise_equal}/{r.comparable} logprobs · {label}", tone))
        label, _, r = max(results, key=lambda x: x[2].ulp_max)
        out.append(Tile("largest ULP distance", str(r.ulp_max), label if r.ulp_max else "", "pass" if r.ulp_max == 0 else "fail"))
        label, _, r = max(results, key=lambda x: x[2].prob_max)
        out.append(Tile("max |Δ prob|", num(r.prob_max), label if r.prob_max else "", "pass" if r.prob_max == 0 else "warn"))
        firsts = [(d.earliest, p.label, d.prompt_id) for p in data.pairs for d in p.divergences]
        if firsts:
            pos, label, prompt = min(firsts)
            out.append(Tile("earliest divergence", f"pos {pos}", f"{label} · {prompt}", "fail"))
        elif all(r.identical for _, _, r in results):
            out.append(Tile("earliest divergence", "none", "", "pass"))
        else:  # no token or logprob differs, yet a pair is not identical: its top-k or row digests are
            out.append(Tile("earliest divergence", "none in tokens or logprobs", "other columns differ (top-k, row digests)",
                            "warn"))
        shared = sum(len(r.shared_prompts) for _, _, r in results)
        forked = sum(not p.token_match for _, _, r in results for p in r.shared_prompts)
        out.append(Tile("sequences that fork", f"{forked}/{shared}", "tokens differ (prompt × pair)",
                        "pass" if forked == 0 else "fail"))
    if data.kind == "run" and data.wall_s is not None:
        cell_s = sum(c.seconds or 0.0 for c in data.cells)
        loads = sum(sum(g.load_s) for g in data.groups)
        out.append(Tile("whole matrix", f"{seconds_text(data.wall_s)} s",
                        f"cells {seconds_text(cell_s)} s · model loads {seconds_text(loads)} s"))
    return out
