"""What the report shows, computed once: no formatting here.

Every number comes from `diff_records` (through the gate's pairs) or from the records' rows
compared exactly as the diff compares them (matched rows of shared prompts before their token
divergence); the renderers only format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..compare.diff import diff_records
from ..compare.gate import PairOutcome
from ..compare.result import DiffResult, PromptDiff
from ..errors import InputError
from ..record.floats import ulp_distance_bits
from .arrays import ArrayCache, RecordArrays
from .tokens import TokenText

CONTEXT_CHARS = 72  # shared text shown before a divergence: at least this many characters ...
CONTEXT_TOKENS = 48  # ... from at most this many tokens
AFTER_TOKENS = 8  # tokens shown after a fork, per side


# ------------------------------------------------------------------------------ ULP histogram


@dataclass
class UlpHistogram:
    """Counts of numeric compared rows by ULP distance, log2-binned: bin 0 holds distance 0, bin
    k >= 1 holds [2**(k-1), 2**k - 1]. NaN rows are counted apart, as in the diff."""

    counts: np.ndarray  # int64, one per bin
    nan_vs_number: int = 0
    nan_payload_differs: int = 0

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def max_bin(self) -> int:
        nz = np.flatnonzero(self.counts)
        return int(nz[-1]) if len(nz) else 0


def ulp_bin(d: np.ndarray) -> np.ndarray:
    """Bin index of each distance: 0 for 0, else floor(log2(d)) + 1 (exact, on integers)."""
    d = np.asarray(d, dtype=np.int64)
    out = np.zeros(d.shape, dtype=np.int64)
    nz = d > 0
    # bit_length via frexp is exact for integers below 2**53 (float32 ULP distances are below 2**33)
    out[nz] = np.frexp(d[nz].astype(np.float64))[1]
    return out


def bin_label(k: int) -> str:
    if k == 0:
        return "0"
    lo, hi = 1 << (k - 1), (1 << k) - 1
    if lo == hi:
        return str(lo)
    if lo < 1024:
        return f"{lo}–{hi}"
    return f"2^{k - 1}–"


def compared_rows(p: PromptDiff, a: RecordArrays, b: RecordArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pos, bits_a, bits_b) of one prompt's comparable rows: matched, and before the token divergence."""
    sa, sb = a.rows(p.prompt_id), b.rows(p.prompt_id)
    pos, ia, ib = np.intersect1d(a.pos[sa], b.pos[sb], assume_unique=True, return_indices=True)
    if p.first_token_divergence is not None:
        keep = pos < p.first_token_divergence
        pos, ia, ib = pos[keep], ia[keep], ib[keep]
    return pos, a.bits[sa][ia], b.bits[sb][ib]


def ulp_histogram(r: DiffResult, a: RecordArrays, b: RecordArrays) -> UlpHistogram:
    counts = np.zeros(34, dtype=np.int64)
    nan_vs = nan_payload = 0
    for p in r.shared_prompts:
        _, ba, bb = compared_rows(p, a, b)
        u = ulp_distance_bits(ba, bb)
        payload = u.both_nan & ~u.bits_equal
        nan_vs += int(np.count_nonzero(u.nan_vs_number))
        nan_payload += int(np.count_nonzero(payload))
        numeric = ~(u.nan_vs_number | payload)
        counts += np.bincount(ulp_bin(u.distance[numeric]), minlength=len(counts))[: len(counts)]
    return UlpHistogram(counts, nan_vs, nan_payload)


# ------------------------------------------------------------------------------ RL log-ratio histogram


# |d| decades: below 1e-8, [1e-8, 1e-7), ..., [1, 10), 10 and above. The edges are the doubles the
# decimal literals read as (10.0 ** -5 is 9.999999999999999e-06, one double short of 1e-05), so a d
# falls in the decade its printed value names.
RATIO_EDGES = np.array([float(f"1e{k}") for k in range(-8, 2)])
RATIO_CENTER = len(RATIO_EDGES) + 1  # the bin of d = 0; |d| of decade m sits m + 1 bins to its left or right


@dataclass
class LogRatioHistogram:
    """The RL positions (comparable rows with finite logprobs, as in the diff) by d = logprob B - logprob A,
    in signed decades of |d| (see RATIO_EDGES); the importance ratio is exp(d)."""

    counts: np.ndarray  # int64, 2 * RATIO_CENTER + 1 bins, d ascending
    clip: tuple[float, float]

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def log_ratio_bin(d: np.ndarray) -> np.ndarray:
    decade = np.searchsorted(RATIO_EDGES, np.abs(d), side="right")
    return RATIO_CENTER + np.sign(d).astype(np.int64) * (decade + 1)


def log_ratio_labels() -> list[str]:
    names = ["<1e-8"] + [f"1e{k}" for k in range(-8, 1)] + ["≥10"]
    return [f"−{x}" for x in reversed(names)] + ["0"] + [f"+{x}" for x in names]


def log_ratio_position(v: float) -> float:
    """Where d = v falls on the histogram's axis, in bins from its left edge (log-interpolated in a decade)."""
    if v == 0:
        return RATIO_CENTER + 0.5
    decade = int(np.searchsorted(RATIO_EDGES, abs(v), side="right"))
    within = 0.5 if decade in (0, len(RATIO_EDGES)) else math.log10(abs(v)) - math.log10(RATIO_EDGES[decade - 1])
    return RATIO_CENTER + decade + 1 + within if v > 0 else RATIO_CENTER - decade - 1 + (1 - within)


def log_ratio_histogram(r: DiffResult, a: RecordArrays, b: RecordArrays) -> LogRatioHistogram:
    counts = np.zeros(2 * RATIO_CENTER + 1, dtype=np.int64)
    for p in r.shared_prompts:
        _, ba, bb = compared_rows(p, a, b)
        va, vb = ba.view(np.float32).astype(np.float64), bb.view(np.float32).astype(np.float64)
        finite = np.isfinite(va) & np.isfinite(vb)
        counts += np.bincount(log_ratio_bin(vb[finite] - va[finite]), minlength=len(counts))
    return LogRatioHistogram(counts, r.rl.clip)


# ------------------------------------------------------------------------------ first divergences


@dataclass
class Side:
    token: int | None  # None: this side has no row at the position (it ended earlier)
    bits: int | None  # logprob bit pattern
    piece: str = ""  # the token as text
    after: str = ""  # the text this side continues with (token forks only)

    @property
    def logprob(self) -> float | None:
        return None if self.bits is None else float(np.uint32(self.bits).view(np.float32))


@dataclass
class PromptDivergence:
    """The first divergent token of one prompt: where the tokens fork when they do (generate mode),
    else where the logprob bits first differ (same token)."""

    prompt_id: str
    pos: int  # the position shown: the fork, or the first logprob difference when tokens never fork
    kind: str  # "token": the tokens differ (or one side ended); "logprob": same token, other bits
    phase: str  # phase of that position: prompt or completion
    completion_start: int | None  # first completion position of the prompt, if any
    context: str  # decoded shared text before pos (last CONTEXT_TOKENS tokens)
    context_cut: bool  # True when earlier tokens were left out
    a: Side
    b: Side
    ulp: int | None  # ULP distance at pos when both logprobs are numbers of the same token
    diff: PromptDiff

    @property
    def fork(self) -> int | None:
        return self.diff.first_token_divergence

    @property
    def first_bits(self) -> int | None:
        return self.diff.first_logprob_divergence

    @property
    def earliest(self) -> int:
        return min(x for x in (self.fork, self.first_bits) if x is not None)


def _row(arr: RecordArrays, sl: slice, pos: int) -> int | None:
    p = arr.pos[sl]
    i = int(np.searchsorted(p, pos))
    return sl.start + i if i < len(p) and p[i] == pos else None


def prompt_divergence(p: PromptDiff, a: RecordArrays, b: RecordArrays, text: TokenText) -> PromptDivergence | None:
    if p.first_token_divergence is not None:
        pos, kind = p.first_token_divergence, "token"
    elif p.first_logprob_divergence is not None:
        pos, kind = p.first_logprob_divergence, "logprob"
    else:
        return None
    sa, sb = a.rows(p.prompt_id), b.rows(p.prompt_id)
    ra, rb = _row(a, sa, pos), _row(b, sb, pos)
    ctx_tokens = a.token[sa][a.pos[sa] < pos]
    context, used = "", 0
    for n in (4, 8, 16, 32, CONTEXT_TOKENS):  # grow the window until it holds enough text
        used = min(n, len(ctx_tokens))
        context = text.decode(ctx_tokens[len(ctx_tokens) - used:])
        if len(context) >= CONTEXT_CHARS or used == len(ctx_tokens):
            break
    # Records hold no row for position 0 (nothing predicts it), so a context that reaches the start still lacks it.
    cut = used < len(ctx_tokens) or (sa.stop > sa.start and int(a.pos[sa.start]) > 0)

    def side(arr: RecordArrays, sl: slice, r: int | None) -> Side:
        if r is None:
            return Side(None, None)
        s = Side(int(arr.token[r]), int(arr.bits[r]), text.piece(int(arr.token[r])))
        if kind == "token":
            s.after = text.decode(arr.token[r + 1 : min(r + 1 + AFTER_TOKENS, sl.stop)])
        return s

    side_a, side_b = side(a, sa, ra), side(b, sb, rb)
    ulp = None
    if kind == "logprob" and side_a.bits is not None and side_b.bits is not None:
        u = ulp_distance_bits(np.array([side_a.bits], np.uint32), np.array([side_b.bits], np.uint32))
        if not (u.nan_vs_number[0] or u.both_nan[0]):
            ulp = int(u.distance[0])
    ref, r = (a, ra) if ra is not None else (b, rb)
    phase = "completion" if r is not None and ref.phase[r] else "prompt"
    comp = np.flatnonzero(a.phase[sa] == 1)
    return PromptDivergence(
        prompt_id=p.prompt_id, pos=pos, kind=kind, phase=phase,
        completion_start=int(a.pos[sa][comp[0]]) if len(comp) else None,
        context=context, context_cut=cut, a=side_a, b=side_b, ulp=ulp, diff=p,
    )


def divergences(r: DiffResult, a: RecordArrays, b: RecordArrays, text: TokenText) -> list[PromptDivergence]:
    out = [d for p in r.shared_prompts if (d := prompt_divergence(p, a, b, text)) is not None]
    return sorted(out, key=lambda d: (d.earliest, d.pos, d.prompt_id))


# ------------------------------------------------------------------------------ pairs and matrices


@dataclass
class PairView:
    outcome: PairOutcome
    label: str  # short label of the cell (what differs from its reference)
    hist: UlpHistogram | None = None
    ratio_hist: LogRatioHistogram | None = None
    divergences: list[PromptDivergence] = field(default_factory=list)
    max_pos: int = 0  # longest sequence position in either record

    @property
    def result(self) -> DiffResult | None:
        return self.outcome.result


def analyse_pair(outcome: PairOutcome, label: str, cache: ArrayCache, text: TokenText) -> PairView:
    view = PairView(outcome, label)
    r = outcome.result
    if r is None or outcome.path_a is None or outcome.path_b is None:
        return view
    a, b = cache.get(outcome.path_a), cache.get(outcome.path_b)
    view.hist = ulp_histogram(r, a, b)
    view.ratio_hist = log_ratio_histogram(r, a, b)
    view.divergences = divergences(r, a, b, text)
    view.max_pos = max(a.max_pos, b.max_pos)
    return view


@dataclass
class MatrixEntry:
    bitwise_equal: int = 0
    comparable: int = 0
    ulp_max: int = 0
    identical: bool = False
    error: str | None = None  # the pair could not be compared


@dataclass
class MatrixView:
    mode: str
    ids: list[str]
    labels: list[str]
    references: set[str]
    entries: dict[tuple[int, int], MatrixEntry]
    skipped: str | None = None  # why no matrix was computed

    def entry(self, i: int, j: int) -> MatrixEntry | None:
        if i == j:
            return None
        return self.entries.get((min(i, j), max(i, j)))


def _entry(r: DiffResult) -> MatrixEntry:
    return MatrixEntry(r.bitwise_equal, r.comparable, r.ulp_max, r.identical)


def cell_matrix(mode: str, ids: list[str], labels: list[str], paths: dict[str, Any], references: set[str],
                known: dict[frozenset, DiffResult], limit: int) -> MatrixView:
    """Every cell against every other (the metrics used are symmetric: one diff per unordered pair)."""
    view = MatrixView(mode, ids, labels, references, {})
    if len(ids) > limit:
        view.skipped = f"{len(ids)} cells is more than {limit}: {len(ids) * (len(ids) - 1) // 2} diffs left out"
        return view
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            key = frozenset((ids[i], ids[j]))
            r = known.get(key)
            if r is None:
                try:
                    r = diff_records(paths[ids[i]], paths[ids[j]])
                except InputError as exc:
                    view.entries[(i, j)] = MatrixEntry(error=str(exc))
                    continue
                known[key] = r
            view.entries[(i, j)] = _entry(r)
    return view


# ------------------------------------------------------------------------------ labels
