"""Running totals of a diff over aligned chunks: bit equality, ULP and |a - b| statistics, the
distribution columns, per-prompt divergences and what the RL metrics need."""

from __future__ import annotations

import math
import operator

import numpy as np
import pyarrow as pa

from .chunks import INF_BITS, Chunk
from .result import NO_DIVERGENCE
from .work import Work


_SMALL_ULP = 1 << 16  # exact histogram below this, raw values kept above it
_POS_MASK = np.int64(0xFFFFFFFF)

# ------------------------------------------------------------------------------------ accumulation


class Accumulator:
    """Running totals over aligned chunks; per-prompt arrays indexed by prompt rank."""

    def __init__(self, n_prompts: int):
        z = lambda: np.zeros(n_prompts, dtype=np.int64)  # noqa: E731
        self.rows_a, self.rows_b, self.matched, self.comparable, self.bitwise_equal = z(), z(), z(), z(), z()
        self.max_ulp = z()
        self.token_div = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)
        self.first_a = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)  # each side's first position per prompt so far
        self.first_b = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)
        self.bits_div = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)
        self.small_hist = np.zeros(_SMALL_ULP, dtype=np.int64)  # exact counts of distances < 2**16
        self.large: list[np.ndarray] = []  # the distances >= 2**16, as they are
        self.abs_total = _ExactSum()
        self.abs_max = 0.0
        self.prob_max = 0.0
        self.after_divergence = self.nan_vs_number = self.nan_payload = 0
        self.digest_compared = self.digest_equal = self.digest_only_a = self.digest_only_b = 0
        self.digest_rows_a = self.digest_rows_b = 0  # rows of each whole record that hold a row digest
        self.top1_compared = self.top1_equal = self.top1_only_a = self.top1_only_b = 0
        self.topk_compared = self.topk_ids_equal = self.topk_logprobs_equal = self.topk_only_a = self.topk_only_b = 0
        # RL mismatch. d = b - a is 0 on every row whose bits agree, so only the differing rows are kept:
        # d rounded once to float64 (8 bytes a row, with the count of its prompt's rows per chunk), which
        # gives exact nearest-rank ratio percentiles and sums in one fixed order whatever the batching. At
        # most 80 MB for the 10M-row benchmark even if every row differs, within the diff's 1.5 GB target;
        # a bounded sketch would make the percentiles approximate.
        self.rl_positions = self.rl_nonfinite = 0
        self.rl_sum = _ExactSum()  # sum of a - b over the rows kept, exactly: k1
        self.rl_d: list[np.ndarray] = []
        self.rl_prompts: list[np.ndarray] = []  # per chunk: the prompts of the rows kept ...
        self.rl_counts: list[np.ndarray] = []  # ... and how many rows each
        self.flip_positions = self.flips = 0
        self.flip_margins: list[np.ndarray] = []
        self.work = Work()

    @property
    def ulp_total(self) -> int:
        """Exact sum of the ULP distances (Python ints: no overflow)."""
        nz = np.flatnonzero(self.small_hist)
        return sum(map(operator.mul, nz.tolist(), self.small_hist[nz].tolist())) + sum(int(x.sum()) for x in self.large)

    def unmatched(self, keys: np.ndarray, other_first: np.ndarray, prompt_row: np.ndarray | None) -> None:
        """Rows one side has and the other lacks end the shared prefix of their prompt, unless they
        are prompt rows (`prompt_row`; None: none is) before the other side's first position of
        that prompt (`other_first`): a generate record begins at the prompt's end."""
        if len(keys):
            rank, pos = keys >> 32, keys & _POS_MASK
            if prompt_row is not None:
                ends = ~prompt_row | (other_first[rank] < pos)
                rank, pos = rank[ends], pos[ends]
            _first_per_prompt(self.token_div, rank, pos)

    def matched_rows(self, a: Chunk, b: Chunk) -> None:
        """Rows with the same keys, in the same order (a.rank == b.rank, a.pos == b.pos)."""
        n = len(a)
        if not n:
            return
        rank, pos, bounds = a.rank, a.pos, a.bounds
        seg_rank = rank[bounds[:-1]]  # one entry per prompt: unique, since rows are sorted
        seg_len = np.diff(bounds)
        self.matched[seg_rank] += seg_len
        mask = self.work.get("mask", bool, n)
        if np.not_equal(a.token, b.token, out=mask).any():
            t = np.flatnonzero(mask)
            _first_per_prompt(self.token_div, rank[t], pos[t])

        # Masks are None when every row qualifies (the common case: nothing diverged in these prompts).
        same_context = comparable = None
        if self.token_div[seg_rank].min() != NO_DIVERGENCE:
            limit = self.token_div[rank]
            same_context, comparable = pos <= limit, pos < limit
            self.after_divergence += n - int(np.count_nonzero(same_context))

        # Distribution-level checks need only the same context; the RL ones need the same token and finite logprobs.
        rl = _all_of(comparable, _finite(a.bits, b.bits, self.work))
        n_comparable = n if comparable is None else int(np.count_nonzero(comparable))
        n_rl = n if rl is None else int(np.count_nonzero(rl))
        self.rl_positions += n_rl
        self.rl_nonfinite += n_comparable - n_rl
        self._digests(a, b, same_context, mask)
        self._top1(a, b, same_context, rl, mask)
        self._topk(a, b, same_context)

        # Logprob checks need the same token too.
        differ = np.not_equal(a.bits, b.bits, out=mask)
        if comparable is None:
            per_prompt = seg_len
        else:
            differ &= comparable
            per_prompt = seg_len - np.diff(np.searchsorted(np.flatnonzero(~comparable), bounds))
        self.comparable[seg_rank] += per_prompt
        idx = np.flatnonzero(differ)
        k = len(idx)
        self.small_hist[0] += int(per_prompt.sum()) - k
        if not k:
            self.bitwise_equal[seg_rank] += per_prompt
            return
        at = np.searchsorted(idx, bounds)  # idx[at[j]:at[j + 1]] are the differing rows of prompt j
        count = np.diff(at)
        self.bitwise_equal[seg_rank] += per_prompt - count
        has = count > 0
        first, prompts = at[:-1][has], seg_rank[has]
        self.bits_div[prompts] = np.minimum(self.bits_div[prompts], pos[idx[first]])
        abits = np.take(a.bits, idx, out=self.work.get("abits", np.uint32, k), mode="clip")
        bbits = np.take(b.bits, idx, out=self.work.get("bbits", np.uint32, k), mode="clip")
        del idx
        self._differing(abits, bbits, prompts, first)

    def _digests(self, a: Chunk, b: Chunk, ctx: np.ndarray | None, mask: np.ndarray) -> None:
        if a.digest is None:  # neither side has one (_fix_digest gives the other side all-null digests)
            return
        both, n, only_a, only_b = _coverage(len(a), a.digest_ok, b.digest_ok, ctx)
        self.digest_compared += n
        self.digest_only_a += only_a
        self.digest_only_b += only_b
        self.digest_equal += n - _count(np.not_equal(a.digest, b.digest, out=mask), both)

    def _top1(self, a: Chunk, b: Chunk, ctx: np.ndarray | None, rl: np.ndarray | None, mask: np.ndarray) -> None:
        known_a = None if a.top1.min() >= 0 else a.top1 >= 0
        known_b = None if b.top1.min() >= 0 else b.top1 >= 0
        both, n, only_a, only_b = _coverage(len(a), known_a, known_b, ctx)
        self.top1_compared += n
        self.top1_only_a += only_a
        self.top1_only_b += only_b
        moved = np.not_equal(a.top1, b.top1, out=mask)
        self.top1_equal += n - _count(moved, both)
        # RL flips: positions of the RL metrics where both top-1 are known and differ
        at = _all_of(rl, known_a, known_b)
        self.flip_positions += len(a) if at is None else int(np.count_nonzero(at))
        flipped = np.flatnonzero(moved if at is None else moved & at)
        if len(flipped):
            self.flips += len(flipped)
            self._flip_margins(a, flipped)

    def _flip_margins(self, a: Chunk, rows: np.ndarray) -> None:
        """Record A's top-1 minus top-2 logprob at the flipped rows that hold at least two entries."""
        if a.topk_bits.shape[1] < 2:
            return
        if a.topk_len is not None:
            rows = rows[a.topk_len[rows] >= 2]
        with np.errstate(invalid="ignore"):  # a signalling NaN's cast warns; it is left out below anyway
            top = a.topk_bits[rows, :2].view(np.float32).astype(np.float64)
            margin = top[:, 0] - top[:, 1]
        self.flip_margins.append(margin[~np.isnan(margin)])  # a NaN has no place in a median

    def _topk(self, a: Chunk, b: Chunk, ctx: np.ndarray | None) -> None:
        if not a.topk_ids.shape[1] and not b.topk_ids.shape[1]:
            return  # neither side holds a list here
        both, n, only_a, only_b = _coverage(len(a), a.topk_rows(), b.topk_rows(), ctx)
        self.topk_compared += n
        self.topk_only_a += only_a
        self.topk_only_b += only_b
        if n:
            ids_differ, bits_differ = _topk_differ(a, b, self.work)
            self.topk_ids_equal += n - _count(ids_differ, both)
            self.topk_logprobs_equal += n - _count(bits_differ, both)

    def _differing(self, abits: np.ndarray, bbits: np.ndarray, prompts: np.ndarray, first: np.ndarray) -> None:
        """Comparable rows whose bits differ; abits[first[j]:first[j + 1]] belong to prompts[j]."""
        w = self.work
        k = len(abits)
        am = np.bitwise_and(abits, np.uint32(0x7FFFFFFF), out=w.get("am", np.uint32, k))
        bm = np.bitwise_and(bbits, np.uint32(0x7FFFFFFF), out=w.get("bm", np.uint32, k))
        top = max(int(am.max()), int(bm.max()))
        if top > INF_BITS:  # a NaN somewhere
            a_nan, b_nan = am > INF_BITS, bm > INF_BITS
            self.nan_vs_number += int(np.count_nonzero(a_nan ^ b_nan))
            self.nan_payload += int(np.count_nonzero(a_nan & b_nan))
            keep = np.flatnonzero(~(a_nan | b_nan))
            if not len(keep):
                return
            abits, bbits, am, bm = abits[keep], bbits[keep], am[keep], bm[keep]
            first, prompts = _kept_segments(keep, first, prompts)
            k = len(keep)
            top = max(int(am.max()), int(bm.max()))

        # ULP distance. Same sign: |difference of the bit patterns as int32| (the sign bits cancel).
        # Opposite signs: the sum of the magnitudes, up to 2 * 0x7F800000.
        d = np.subtract(abits.view(np.int32), bbits.view(np.int32), out=w.get("d", np.int64, k), dtype=np.int64)
        np.abs(d, out=d)
        x = np.bitwise_xor(abits, bbits, out=w.get("x", np.uint32, k))
        if int(x.max()) >= 0x80000000:
            opposite = np.flatnonzero(x >= np.uint32(0x80000000))
            d[opposite] = am[opposite].astype(np.int64) + bm[opposite]
        dmax = int(d.max())
        if dmax < _SMALL_ULP:
            counts = np.bincount(d)
            self.small_hist[: len(counts)] += counts
        else:
            small = d < _SMALL_ULP
            self.small_hist += np.bincount(d[small], minlength=_SMALL_ULP)
            self.large.append(d[~small])  # a copy
        self.max_ulp[prompts] = np.maximum(self.max_ulp[prompts], np.maximum.reduceat(d, first))

        av = w.get("av", np.float64, k)
        bv = w.get("bv", np.float64, k)
        np.copyto(av, abits.view(np.float32))
        np.copyto(bv, bbits.view(np.float32))
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.subtract(av, bv, out=w.get("delta", np.float64, k))  # rounded once; infinite only against ±inf
            # Same sign and same binade (the top 9 bits of x are 0): a - b is exact in float64 and
            # summed by binade. The other pairs (few: across a power of two or zero, or against ±inf)
            # go to the general exact sum, and weigh 0 in the binade sums.
            other = np.flatnonzero(np.greater_equal(x, np.uint32(0x800000), out=w.get("other", bool, k)))
            if len(other):
                self.abs_total.add(av[other], bv[other], delta[other])
            weights = w.get("weights", np.float64, k)
            np.copyto(weights, delta)
            weights[other] = 0.0
            exponent = _binades(abits, w)
            self._rl_rows(abits, bbits, av, bv, delta, exponent, weights, other, top, prompts, first)
            np.abs(weights, out=weights)
            np.abs(delta, out=delta)
            self.abs_max = max(self.abs_max, float(delta.max()))
            self.abs_total.add_binades(exponent, weights)
            # |exp(a) - exp(b)|, in place. inf - inf where both exps overflow (logprobs > 709.78, which
            # no log-softmax gives): call it inf, never NaN (a NaN would win or lose max() depending
            # on batch order); max() returns NaN when there is one.
            np.exp(av, out=av)
            np.exp(bv, out=bv)
            np.subtract(av, bv, out=av)
            prob = float(np.abs(av, out=av).max())
        self.prob_max = max(self.prob_max, math.inf if math.isnan(prob) else prob)

    def _rl_rows(self, abits: np.ndarray, bbits: np.ndarray, av: np.ndarray, bv: np.ndarray, delta: np.ndarray,
                 exponent: np.ndarray, same_binade: np.ndarray, other: np.ndarray, top: int, prompts: np.ndarray,
                 first: np.ndarray) -> None:
        """Keep d = b - a of the differing rows with finite logprobs (the RL positions among them), and add
        a - b to the exact sum: same_binade holds the exact a - b of same-binade pairs (0 for `other`)."""
        self.rl_sum.add_binades(exponent, same_binade)
        finite = None
        if top == INF_BITS:  # ±inf on a side: not an RL position
            finite = np.flatnonzero(np.isfinite(delta))
            first, prompts = _kept_segments(finite, first, prompts)
            other = other[np.isfinite(delta[other])]
        if len(other):
            self.rl_sum.add_binades(_binades(abits[other]), av[other])
            self.rl_sum.add_binades(_binades(bbits[other]), -bv[other])
        self.rl_d.append(np.negative(delta if finite is None else delta[finite]))
        self.rl_prompts.append(prompts)
        self.rl_counts.append(np.diff(first, append=len(self.rl_d[-1])))


class _ExactSum:
    """Exact running sum of |a - b| over float32 pairs (or of a - b, for RL's k1), so the mean cannot
    depend on how the rows were cut into batches: it is rounded once, at the end. Every value is a
    multiple of 2**-149, so the total is kept as an integer scaled by 2**149.

    Pairs of the same sign and binade (biased exponent field E): a - b is exact in float64, a
    whole number of units 2**(max(E, 1) - 150) below 2**23 units, so a float64 sum of fewer than
    2**29 of them per binade is exact too. Other pairs: a - b in float64 plus its TwoSum error is
    exactly a - b; each part is summed exactly by Rump-Ogita-Oishi extraction (split onto a grid
    whose sums float64 holds without rounding, repeat on the remainders)."""

    def __init__(self) -> None:
        self.scaled = 0  # the sum * 2**149, exact
        self.infinite = False

    def add_binades(self, exponent: np.ndarray, diff: np.ndarray) -> None:
        """exponent: a's binades (`_binades`); diff: the exact a - b or |a - b| (float64) where b has a's
        sign and binade, 0 elsewhere. (Also any float32 values with their own binades.)"""
        n = len(exponent)
        step = 1 << 29
        for lo in range(0, n, step):
            sums = np.bincount(exponent[lo : lo + step], weights=diff[lo : lo + step], minlength=256)
            for e in np.flatnonzero(sums).tolist():
                self.scaled += int(math.ldexp(float(sums[e]), 149))  # a power-of-two scaling: exact

    def add(self, a: np.ndarray, b: np.ndarray, delta: np.ndarray) -> None:
        """a, b: float32 values as float64 (no NaN); delta: fl(a - b)."""
        finite = np.isfinite(delta)
        if not finite.all():
            self.infinite = True
            a, b, delta = a[finite], b[finite], delta[finite]
        # TwoSum, in place: err = (a - (delta - back)) + (-b - back) with back = delta - a
        back = np.subtract(delta, a)
        err = np.subtract(delta, back)
        np.subtract(a, err, out=err)
        np.add(b, back, out=back)
        np.subtract(err, back, out=err)  # a - b == delta + err exactly
        x = np.abs(delta)
        if err.any():  # |a - b| = |delta| + sign(delta) * err
            np.multiply(np.sign(delta), err, out=err)
            x = np.concatenate([x, err])
        self.scaled += _exact_sum_scaled(x, back)

    def mean(self, n: int) -> float:
        if not n:
            return 0.0
        if self.infinite:
            return math.inf
        return self.scaled / (n << 149)  # int / int is correctly rounded


def _binades(bits: np.ndarray, work: Work | None = None) -> np.ndarray:
    """The biased exponent field of float32 bit patterns, as int64 (bincount's index type)."""
    n = len(bits)
    exponent = np.right_shift(bits, np.uint32(23), out=work.get("exp32", np.uint32, n) if work else None)
    return np.bitwise_and(exponent, np.uint32(0xFF), out=work.get("exp", np.int64, n) if work else None)


def _exact_sum_scaled(x: np.ndarray, scratch: np.ndarray | None = None) -> int:
    """sum(x) * 2**149, exactly, for float64 values that are multiples of 2**-149 (x is overwritten)."""
    total = 0
    m = max(len(x) + 2, 2).bit_length() + 1  # 2**m >= 2 * (n + 2)
    q = scratch if scratch is not None and len(scratch) == len(x) else np.empty_like(x)
    while len(x):
        top = max(float(x.max()), -float(x.min()))
        if top == 0.0:
            break
        sigma = math.ldexp(1.0, math.frexp(top)[1] + m)  # sigma >= 2**m * max|x|
        np.add(x, sigma, out=q)
        np.subtract(q, sigma, out=q)  # x on sigma's grid; partial sums of q are exact in any order
        total += int(math.ldexp(float(q.sum()), 149))
        np.subtract(x, q, out=x)  # exact; |x| <= ulp(sigma)
    return total


def _all_of(*masks: np.ndarray | None) -> np.ndarray | None:
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


def _coverage(n: int, has_a: np.ndarray | None, has_b: np.ndarray | None,
              ctx: np.ndarray | None) -> tuple[np.ndarray | None, int, int, int]:
    """A column that may be absent from some of n rows (None: present in every row), over the rows ctx
    selects: (rows where both sides hold it, or None for all; their count; rows only A holds; only B holds)."""
    both = _all_of(ctx, has_a, has_b)
    count = n if both is None else int(np.count_nonzero(both))
    only_a = 0 if has_b is None else int(np.count_nonzero(_all_of(ctx, has_a, ~has_b)))
    only_b = 0 if has_a is None else int(np.count_nonzero(_all_of(ctx, has_b, ~has_a)))
    return both, count, only_a, only_b


def _count(rows: np.ndarray | None, among: np.ndarray | None) -> int:
    """How many of `rows` (None: none) are in `among` (None: every row)."""
    if rows is None:
        return 0
    return int(np.count_nonzero(rows if among is None else rows & among))


def _finite(a_bits: np.ndarray, b_bits: np.ndarray, work: "Work") -> np.ndarray | None:
    """Rows where both logprobs are finite numbers (no NaN, no ±inf): None when every row is."""
    n = len(a_bits)
    am = np.bitwise_and(a_bits, np.uint32(0x7FFFFFFF), out=work.get("finite_a", np.uint32, n))
    bm = np.bitwise_and(b_bits, np.uint32(0x7FFFFFFF), out=work.get("finite_b", np.uint32, n))
    if max(int(am.max()), int(bm.max())) < INF_BITS:
        return None
    return (am < INF_BITS) & (bm < INF_BITS)


def _rows_differ(x: np.ndarray, y: np.ndarray, work: "Work") -> np.ndarray | None:
    """Rows of two (rows, w) integer arrays that differ anywhere: None when none does. Equal arrays, the
    usual case, are told by one memcmp (pyarrow's Buffer.equals), without writing a mask."""
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    if pa.py_buffer(x).equals(pa.py_buffer(y)):
        return None
    return np.not_equal(x, y, out=work.get("topk", bool, x.size).reshape(x.shape)).any(axis=1)


def _topk_differ(a: Chunk, b: Chunk, work: "Work") -> tuple[np.ndarray | None, np.ndarray | None]:
    """Rows whose top-k ids / top-k logprob bits differ (None: no row), lists of other lengths included."""
    wa, wb = a.topk_ids.shape[1], b.topk_ids.shape[1]
    if a.topk_len is None and b.topk_len is None and wa == wb:
        return _rows_differ(a.topk_ids, b.topk_ids, work), _rows_differ(a.topk_bits, b.topk_bits, work)
    # Padding is zero on both sides, so two lists of one length compare equal over the shorter width.
    n, w = len(a), min(wa, wb)
    lengths = np.not_equal(np.full(n, wa) if a.topk_len is None else a.topk_len,
                           np.full(n, wb) if b.topk_len is None else b.topk_len)
    ids = _rows_differ(a.topk_ids[:, :w], b.topk_ids[:, :w], work)
    bits = _rows_differ(a.topk_bits[:, :w], b.topk_bits[:, :w], work)
    return _all_differ(lengths, ids), _all_differ(lengths, bits)


def _all_differ(lengths: np.ndarray, values: np.ndarray | None) -> np.ndarray:
    return lengths if values is None else lengths | values


def _kept_segments(keep: np.ndarray, first: np.ndarray, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments (start of each prompt's rows, the prompts) of the rows `keep` selects out of segmented rows."""
    start = np.searchsorted(keep, first)
    has = np.append(start[1:], len(keep)) > start
    return start[has], prompts[has]


def _segments(rank: np.ndarray) -> np.ndarray:
    """Start index of each run of equal values in a sorted array."""
    return np.flatnonzero(np.concatenate(([True], rank[1:] != rank[:-1])))


def note_first(target: np.ndarray, c: Chunk) -> None:
    """target[prompt] = the smallest position seen of that prompt (rows are sorted by position)."""
    if len(c):
        starts = c.bounds[:-1]
        np.minimum.at(target, c.rank[starts], c.pos[starts])


def _first_per_prompt(target: np.ndarray, rank: np.ndarray, pos: np.ndarray) -> None:
    if not len(rank):
        return
    starts = _segments(rank)
    np.minimum.at(target, rank[starts], np.minimum.reduceat(pos, starts))


def percentile(acc: Accumulator, total: int, num: int, den: int) -> int:
    """Exact nearest-rank quantile num/den of the integer ULP distances: the k-th smallest,
    k = max(1, ceil(total * num / den)) in integers (a float 0.99 * total can land one rank off)."""
    if total == 0:
        return 0
    rank = max(1, -(-total * num // den))
    cum = np.cumsum(acc.small_hist)
    if cum[-1] >= rank:
        return int(np.searchsorted(cum, rank))
    large = np.sort(np.concatenate(acc.large))
    return int(large[rank - int(cum[-1]) - 1])
