"""RL mismatch metrics (k1/k2/k3, importance ratios, flips) from a finished accumulation."""

from __future__ import annotations

import math

import numpy as np

from .accumulate import Accumulator
from .result import RLMetrics


# ------------------------------------------------------------------------------------ RL metrics


def rl_metrics(acc: Accumulator, clip: tuple[float, float]) -> RLMetrics:
    out = RLMetrics(positions=acc.rl_positions, nonfinite=acc.rl_nonfinite, clip=clip,
                    flip_positions=acc.flip_positions, flips=acc.flips)
    n = acc.rl_positions
    if not n:
        return out
    d = np.concatenate(acc.rl_d) if acc.rl_d else np.empty(0)  # one array, one summation order, any batching
    zeros = n - len(d)  # RL positions whose bits agree: d = 0, ratio 1
    # Sums the rows came in exactly, rounded once; the others in float64 over d in row order.
    out.kl_k1 = acc.rl_sum.scaled / (n << 149)
    out.abs_diff_mean = acc.abs_total.scaled / (n << 149)
    terms = np.square(d)  # the one temporary as large as d: fresh memory costs page faults
    out.kl_k2 = float(np.sum(terms)) / (2 * n)
    out.kl_k3 = _mean_of_sum(_exp_minus_1_minus(d, out=terms), n)
    lo, p50, p99, hi = _nearest_ranks(d, zeros, [(0, 1), (1, 2), (99, 100), (1, 1)])
    with np.errstate(over="ignore"):
        out.ratio_min, out.ratio_p50, out.ratio_p99, out.ratio_max = (float(np.exp(x)) for x in (lo, p50, p99, hi))
    out.abs_diff_max = max(abs(lo), abs(hi))
    out.clip_frac = (_ratios_outside(d, clip) + (0 if clip[0] <= 1.0 <= clip[1] else zeros)) / n
    out.seq_log_ratio_max = _seq_log_ratio_max(d, acc.rl_prompts, acc.rl_counts)
    if acc.flip_positions:
        out.flip_rate = acc.flips / acc.flip_positions
    margins = np.concatenate(acc.flip_margins) if acc.flip_margins else np.empty(0)
    if len(margins):
        (out.flip_margin_p50,) = _nearest_ranks(margins, 0, [(1, 2)])
    return out


def _mean_of_sum(terms: np.ndarray, n: int) -> float:
    """sum(terms) / n in float64, summed like kl_k2. k3's terms reach 1.6e308 (d just below 709.78), so their
    sum can pass DBL_MAX while the mean is finite: then the terms are summed again scaled by 2**-64 (exact,
    a power of two; terms that small add nothing at this size) and the mean scaled back."""
    total = float(np.sum(terms))
    if not math.isinf(total) or np.isinf(terms).any():
        return total / n
    return math.ldexp(float(np.sum(np.ldexp(terms, -64))) / n, 64)


def _nearest_ranks(d: np.ndarray, zeros: int, quantiles: list[tuple[int, int]]) -> list[float]:
    """Nearest-rank quantiles num/den (0/1 is the minimum) of d together with `zeros` more (+0.0) zeros:
    the k-th smallest with k = max(1, ceil(n * num / den)), in integers, -0.0 ordered before +0.0 so
    that a quantile that lands on a zero keeps the sign of the zero it lands on."""
    n = len(d) + zeros
    ranks = [max(1, -(-n * num // den)) for num, den in quantiles]
    below = int(np.count_nonzero(d < 0))
    is_zero = d == 0
    neg_end = below + int(np.count_nonzero(np.signbit(d[is_zero])))
    zero_end = below + zeros + int(np.count_nonzero(is_zero))
    # In the sorted whole: d's negatives, its -0.0s, then every +0.0, then d's positives (index shifted by `zeros`).
    where = [r - 1 if r <= below else None if r <= zero_end else r - 1 - zeros for r in ranks]
    picked = np.partition(d, sorted({i for i in where if i is not None})) if any(i is not None for i in where) else d
    return [(-0.0 if r <= neg_end else 0.0) if i is None else float(picked[i]) for i, r in zip(where, ranks)]


# Element-wise work over d goes block by block, so that a block's intermediate values stay in the CPU
# cache between passes; each element gets the same operations in the same order, so the same bits.
_BLOCK = 1 << 15


def _ratios_outside(d: np.ndarray, clip: tuple[float, float]) -> int:
    """How many importance ratios exp(d) are below clip[0] or above clip[1]."""
    ratio = np.empty(min(len(d), _BLOCK))
    outside = 0
    with np.errstate(over="ignore"):
        for lo in range(0, len(d), _BLOCK):
            r = np.exp(d[lo : lo + _BLOCK], out=ratio[: len(d[lo : lo + _BLOCK])])
            outside += int(np.count_nonzero(r < clip[0])) + int(np.count_nonzero(r > clip[1]))
    return outside


def _exp_minus_1_minus(d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """exp(d) - 1 - d (the k3 term) without cancellation: where |d| <= 1/4, its Taylor series
    d**2/2! + ... + d**J/J!, J as small as keeps the rest below 2**-56 of the sum (J = 5 for |d| up to
    1e-5, as from bit noise); elsewhere expm1(d) - d (at most ~10 ulps off). Written into out if given."""
    top = min(max(-float(d.min()), float(d.max())), 0.25) if len(d) else 0.0  # max |d|: d is finite
    terms = _series_terms(top)
    out = np.empty_like(d) if out is None else out
    for lo in range(0, len(d), _BLOCK):
        x, y = d[lo : lo + _BLOCK], out[lo : lo + _BLOCK]
        y.fill(1 / math.factorial(terms))
        with np.errstate(over="ignore", invalid="ignore"):  # the series is garbage where |d| > 1/4: replaced below
            for j in range(terms - 1, 1, -1):
                y *= x
                y += 1 / math.factorial(j)
            y *= x
            y *= x
        big = np.flatnonzero(np.abs(x) > 0.25)
        if len(big):
            with np.errstate(over="ignore"):
                y[big] = np.expm1(x[big]) - x[big]
    return out


def _series_terms(top: float) -> int:
    """The fewest terms J of d**2/2! + ... + d**J/J! whose omitted rest is below 2**-56 of
    exp(d) - 1 - d for every |d| <= top <= 1/4. The rest is at most the first omitted term
    |d|**(J+1)/(J+1)! over 1 - |d|/(J+2) (the terms shrink at least that fast), and the sum is at
    least d**2/2 * (1 - |d|/3) (d < 0 makes it smallest); their ratio grows with |d|, so
    top bounds it. The first omitted term alone over d**2/2 would be up to 11% short of the
    rest's relative size at |d| = 1/4."""
    terms = 2
    while 2 * top ** (terms - 1) / math.factorial(terms + 1) / ((1 - top / (terms + 2)) * (1 - top / 3)) > 2.0**-56:
        terms += 1
    return terms


def _seq_log_ratio_max(d: np.ndarray, prompts: list[np.ndarray], counts: list[np.ndarray]) -> float:
    """Largest |sum of d| over one prompt's RL positions (its equal rows add 0)."""
    if not len(d):
        return 0.0
    ranks, sizes = np.concatenate(prompts), np.concatenate(counts)
    starts = np.cumsum(sizes) - sizes
    new = np.flatnonzero(np.diff(ranks, prepend=-1))  # a prompt cut by a chunk boundary is one sequence
    return float(np.abs(np.add.reduceat(d, starts[new])).max())
