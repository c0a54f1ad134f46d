"""Diff two token records: align on (prompt_id, pos), compare bit patterns, decide a verdict.

Both records are in canonical order, so alignment is a streaming merge over the int64 key
(prompt rank << 32 | pos); memory is bounded by the batch size, not the file size.

A row's logprob is only comparable when both sides scored the same token after the same
context. In a prompt, the first position where the tokens differ (or where one side has a
row the other lacks) is that prompt's *token divergence*; rows before it are comparable,
the row at it still shares its context (so its distribution digest and top-1 are
compared), rows after it are counted but not compared. In score mode tokens never differ,
so every row is compared; in generate mode, comparison stops where greedy decoding forked.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from .errors import InputError
from .fingerprint import differences as env_differences
from .floats import ulp_distance_bits
from .records import RecordMeta, open_record

NO_DIVERGENCE = np.iinfo(np.int64).max
_SMALL_ULP = 1 << 16  # exact histogram below this, raw values kept above it
_POS_MASK = np.int64(0xFFFFFFFF)


@dataclass(frozen=True)
class Thresholds:
    """None everywhere means strict: any flipped bit, digest or token fails."""

    max_ulp: int | None = None
    max_abs: float | None = None
    max_seq_divergence: float = 0.0

    @property
    def strict(self) -> bool:
        return self.max_ulp is None and self.max_abs is None


@dataclass
class PromptDiff:
    prompt_id: str
    in_a: bool
    in_b: bool
    rows_a: int = 0
    rows_b: int = 0
    matched: int = 0
    comparable: int = 0
    bitwise_equal: int = 0
    max_ulp: int = 0
    first_token_divergence: int | None = None
    first_logprob_divergence: int | None = None

    @property
    def token_match(self) -> bool:
        return self.in_a and self.in_b and self.first_token_divergence is None

    @property
    def bitwise_match(self) -> bool:
        return self.token_match and self.first_logprob_divergence is None


@dataclass
class DiffResult:
    a: RecordMeta
    b: RecordMeta
    thresholds: Thresholds
    rows_a: int = 0
    rows_b: int = 0
    matched: int = 0
    comparable: int = 0
    after_divergence: int = 0
    unmatched_a: int = 0
    unmatched_b: int = 0
    bitwise_equal: int = 0
    nan_vs_number: int = 0
    nan_payload_differs: int = 0
    ulp_max: int = 0
    ulp_mean: float = 0.0
    ulp_p50: int = 0
    ulp_p99: int = 0
    abs_max: float = 0.0
    abs_mean: float = 0.0
    prob_max: float = 0.0
    digest_compared: int = 0
    digest_equal: int = 0
    top1_compared: int = 0
    top1_equal: int = 0
    prompts: list[PromptDiff] = field(default_factory=list)
    env_differences: list[tuple[str, Any, Any]] = field(default_factory=list)
    cell_differences: list[tuple[str, Any, Any]] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # what differed, when --allow-partial let it through
    passed: bool = True
    reasons: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- derived rates
    @staticmethod
    def _rate(num: int, den: int) -> float | None:
        return num / den if den else None

    @property
    def bitwise_equal_rate(self) -> float | None:
        return self._rate(self.bitwise_equal, self.comparable)

    @property
    def digest_equal_rate(self) -> float | None:
        return self._rate(self.digest_equal, self.digest_compared)

    @property
    def top1_agreement(self) -> float | None:
        return self._rate(self.top1_equal, self.top1_compared)

    @property
    def shared_prompts(self) -> list[PromptDiff]:
        return [p for p in self.prompts if p.in_a and p.in_b]

    @property
    def seq_token_match_rate(self) -> float | None:
        shared = self.shared_prompts
        return self._rate(sum(p.token_match for p in shared), len(shared))

    @property
    def seq_bitwise_match_rate(self) -> float | None:
        shared = self.shared_prompts
        return self._rate(sum(p.bitwise_match for p in shared), len(shared))

    @property
    def identical(self) -> bool:
        """Every bit of every shared row, digest and token agrees, and no row is left over."""
        return (
            self.comparable == self.bitwise_equal
            and self.digest_equal == self.digest_compared
            and self.after_divergence == 0
            and self.unmatched_a == 0
            and self.unmatched_b == 0
            and all(p.in_a and p.in_b for p in self.prompts)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": _meta_summary(self.a),
            "b": _meta_summary(self.b),
            "verdict": {"passed": self.passed, "identical": self.identical, "reasons": self.reasons},
            "thresholds": {k: _json_float(v) for k, v in asdict(self.thresholds).items()},
            "rows": {
                "a": self.rows_a, "b": self.rows_b, "matched": self.matched, "comparable": self.comparable,
                "after_divergence": self.after_divergence, "unmatched_a": self.unmatched_a,
                "unmatched_b": self.unmatched_b,
            },
            "logprob": {
                "bitwise_equal": self.bitwise_equal, "bitwise_equal_rate": self.bitwise_equal_rate,
                "nan_vs_number": self.nan_vs_number, "nan_payload_differs": self.nan_payload_differs,
                "ulp_max": self.ulp_max, "ulp_mean": self.ulp_mean, "ulp_p50": self.ulp_p50,
                "ulp_p99": self.ulp_p99, "abs_max": _json_float(self.abs_max),
                "abs_mean": _json_float(self.abs_mean), "prob_max": _json_float(self.prob_max),
            },
            "digest": {"compared": self.digest_compared, "equal": self.digest_equal, "equal_rate": self.digest_equal_rate},
            "top1": {"compared": self.top1_compared, "equal": self.top1_equal, "agreement": self.top1_agreement},
            "sequences": {
                "shared": len(self.shared_prompts),
                "token_match_rate": self.seq_token_match_rate,
                "bitwise_match_rate": self.seq_bitwise_match_rate,
                "only_in_a": [p.prompt_id for p in self.prompts if not p.in_b],
                "only_in_b": [p.prompt_id for p in self.prompts if not p.in_a],
            },
            "prompts": [
                {**asdict(p), "token_match": p.token_match, "bitwise_match": p.bitwise_match} for p in self.prompts
            ],
            "environment_differences": [list(d) for d in self.env_differences],
            "cell_differences": [list(d) for d in self.cell_differences],
            "partial": self.refusals,
        }


def _json_float(x: Any) -> Any:
    """JSON has no inf or NaN: a non-finite float (|Δ| against a ±inf logprob) becomes "inf" / "-inf" / "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _meta_summary(meta: RecordMeta) -> dict[str, Any]:
    return {
        "path": str(meta.path) if meta.path else None, "cell": meta.cell, "probes": meta.probes,
        "model": meta.model, "tokenizer": meta.tokenizer, "rows": meta.num_rows, "env": meta.env,
    }


# ------------------------------------------------------------------------------------ checks


def _short(h: Any) -> str:
    return str(h)[:12] if h else "?"


def comparability(a: RecordMeta, b: RecordMeta) -> list[str]:
    """What makes two records incomparable, as phrases; empty when they are comparable."""
    issues = []
    if (a.probes.get("name"), a.probes.get("sha256")) != (b.probes.get("name"), b.probes.get("sha256")):
        issues.append(
            f"probe suite differs ({a.probes.get('name')} sha256 {_short(a.probes.get('sha256'))} vs "
            f"{b.probes.get('name')} sha256 {_short(b.probes.get('sha256'))})"
        )
    if a.tokenizer.get("sha256") != b.tokenizer.get("sha256"):
        issues.append(
            f"tokenizer differs ({a.tokenizer.get('name')} sha256 {_short(a.tokenizer.get('sha256'))} vs "
            f"{b.tokenizer.get('name')} sha256 {_short(b.tokenizer.get('sha256'))})"
        )
    only_a, only_b = sorted(set(a.prompts) - set(b.prompts)), sorted(set(b.prompts) - set(a.prompts))
    if only_a or only_b:
        example = (only_a or only_b)[0]
        issues.append(f"prompt sets differ ({len(only_a)} only in A, {len(only_b)} only in B, e.g. {example!r})")
    return issues


def cell_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k != "id" and a.get(k) != b.get(k)]


# ------------------------------------------------------------------------------------ reading


@dataclass
class _Chunk:
    key: np.ndarray  # int64, strictly increasing
    token: np.ndarray  # int32
    bits: np.ndarray  # uint32 logprob bit patterns
    digest: np.ndarray | None  # uint64
    digest_ok: np.ndarray | None  # bool; None means all valid
    top1: np.ndarray  # int32, -1 where not recorded

    def __len__(self) -> int:
        return len(self.key)

    def take(self, sl: slice | np.ndarray) -> "_Chunk":
        pick = lambda x: None if x is None else x[sl]  # noqa: E731
        return _Chunk(self.key[sl], self.token[sl], self.bits[sl], pick(self.digest), pick(self.digest_ok), pick(self.top1))

    @staticmethod
    def concat(a: "_Chunk", b: "_Chunk") -> "_Chunk":
        if not len(a):
            return b
        cat = lambda x, y: None if x is None else np.concatenate([x, y])  # noqa: E731
        return _Chunk(*(cat(getattr(a, f), getattr(b, f)) for f in ("key", "token", "bits", "digest", "digest_ok", "top1")))


def _read_chunks(pf, path: Path, rank_of: dict[str, int], rows_per_prompt: np.ndarray,
                 batch_rows: int) -> Iterator[_Chunk]:
    columns = ["prompt_id", "pos", "token_id", "logprob", "top1_id", "row_digest"]
    last = np.int64(-1)
    dictionary, lut = None, None
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns, use_threads=True):
        if not batch.num_rows:
            continue
        ids = batch.column("prompt_id")
        if dictionary is None or not ids.dictionary.equals(dictionary):
            dictionary = ids.dictionary
            lut = np.array([rank_of.get(v, -1) for v in dictionary.to_pylist()], dtype=np.int64)
        ranks = lut[ids.indices.to_numpy(zero_copy_only=False)]
        pos = batch.column("pos").to_numpy()
        if ranks.min() < 0 or pos.min() < 0:
            raise InputError(f"{path}: rows name prompts missing from the metadata, or negative positions")
        key = (ranks << 32) | pos
        if key[0] <= last or not (key[1:] > key[:-1]).all():
            i = int(np.argmax(np.diff(key, prepend=last) <= 0))
            raise InputError(
                f"{path}: duplicate or out-of-order row at prompt {dictionary[ids.indices[i].as_py()].as_py()!r} "
                f"pos {int(pos[i])} (records must be sorted by (prompt_id, pos) with no duplicates)"
            )
        last = key[-1]
        starts = _segments(ranks)
        rows_per_prompt[ranks[starts]] += np.diff(np.append(starts, len(ranks)))
        dig = batch.column("row_digest")
        if dig.null_count == len(dig):
            digest = digest_ok = None
        elif dig.null_count == 0:
            digest, digest_ok = dig.to_numpy(), None
        else:
            digest, digest_ok = dig.fill_null(0).to_numpy(), dig.is_valid().to_numpy(zero_copy_only=False)
        yield _Chunk(
            key=key,
            token=batch.column("token_id").to_numpy(),
            bits=batch.column("logprob").to_numpy().view(np.uint32),
            digest=digest,
            digest_ok=digest_ok,
            top1=batch.column("top1_id").to_numpy(),
        )


def _prefetched(chunks: Iterator[_Chunk], path: Path, depth: int = 2) -> Iterator[_Chunk]:
    """Decode the next batches in a thread while the caller compares: Parquet decoding and
    numpy both release the GIL, so the two files and the comparison share the cores."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        q.put(("chunk", chunk), timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            q.put(("end", None))
        except (pa.ArrowException, OSError) as exc:
            q.put(("error", InputError(f"{path}: corrupt data: {str(exc).strip().splitlines()[0]}")))
        except BaseException as exc:  # InputError and bugs alike surface in the caller
            q.put(("error", exc))

    thread = threading.Thread(target=work, daemon=True, name=f"read {path.name}")
    thread.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()


# ------------------------------------------------------------------------------------ accumulation


class _Acc:
    """Running totals over aligned chunks; per-prompt arrays indexed by prompt rank."""

    def __init__(self, n_prompts: int):
        z = lambda: np.zeros(n_prompts, dtype=np.int64)  # noqa: E731
        self.rows_a, self.rows_b, self.matched, self.comparable, self.bitwise_equal = z(), z(), z(), z(), z()
        self.max_ulp = z()
        self.token_div = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)
        self.bits_div = np.full(n_prompts, NO_DIVERGENCE, dtype=np.int64)
        self.small_hist = np.zeros(_SMALL_ULP, dtype=np.int64)
        self.large: list[np.ndarray] = []
        self.ulp_total = 0
        self.abs_total = _ExactSum()
        self.abs_max = 0.0
        self.prob_max = 0.0
        self.after_divergence = self.nan_vs_number = self.nan_payload = 0
        self.digest_compared = self.digest_equal = 0
        self.top1_compared = self.top1_equal = 0

    def unmatched(self, keys: np.ndarray) -> None:
        """Rows one side has and the other lacks end the shared prefix of their prompt."""
        if len(keys):
            _first_per_prompt(self.token_div, keys >> 32, keys & _POS_MASK)

    def matched_rows(self, a: _Chunk, b: _Chunk) -> None:
        n = len(a)
        if not n:
            return
        rank, pos = a.key >> 32, a.key & _POS_MASK
        starts = _segments(rank)
        seg_rank = rank[starts]
        seg_len = np.diff(np.append(starts, n))
        self.matched[seg_rank] += seg_len
        tok_diff = a.token != b.token
        if tok_diff.any():
            _first_per_prompt(self.token_div, rank[tok_diff], pos[tok_diff])

        # Masks are None when every row qualifies (the common case: nothing diverged in these prompts).
        same_context = comparable = None
        if self.token_div[seg_rank[0] : seg_rank[-1] + 1].min() != NO_DIVERGENCE:
            limit = self.token_div[rank]
            same_context, comparable = pos <= limit, pos < limit
            self.after_divergence += n - int(np.count_nonzero(same_context))

        # Distribution-level checks need only the same context.
        if a.digest is not None and b.digest is not None:
            ok = _all_of(same_context, a.digest_ok, b.digest_ok)
            equal = a.digest == b.digest
            self.digest_compared += n if ok is None else int(np.count_nonzero(ok))
            self.digest_equal += int(np.count_nonzero(equal if ok is None else equal & ok))
        known = None if a.top1.min() >= 0 and b.top1.min() >= 0 else (a.top1 >= 0) & (b.top1 >= 0)
        ok = _all_of(same_context, known)
        equal = a.top1 == b.top1
        self.top1_compared += n if ok is None else int(np.count_nonzero(ok))
        self.top1_equal += int(np.count_nonzero(equal if ok is None else equal & ok))

        # Logprob checks need the same token too.
        differ = a.bits != b.bits
        if comparable is None:
            per_prompt = seg_len
        else:
            differ &= comparable
            per_prompt = np.add.reduceat(comparable, starts, dtype=np.int64)
        self.comparable[seg_rank] += per_prompt
        n_comparable = int(per_prompt.sum())
        idx = np.flatnonzero(differ)
        self.small_hist[0] += n_comparable - len(idx)
        if not len(idx):
            self.bitwise_equal[seg_rank] += per_prompt
            return
        self.bitwise_equal[seg_rank] += per_prompt - np.add.reduceat(differ, starts, dtype=np.int64)
        drank, dpos = rank[idx], pos[idx]
        _first_per_prompt(self.bits_div, drank, dpos)
        abits, bbits = a.bits[idx], b.bits[idx]
        u = ulp_distance_bits(abits, bbits)
        self.nan_vs_number += int(np.count_nonzero(u.nan_vs_number))
        self.nan_payload += int(np.count_nonzero(u.both_nan))
        numeric = ~(u.nan_vs_number | u.both_nan)
        if not numeric.all():
            abits, bbits, drank, d = abits[numeric], bbits[numeric], drank[numeric], u.distance[numeric]
        else:
            d = u.distance
        if not len(d):
            return
        small = d < _SMALL_ULP
        self.small_hist += np.bincount(d[small], minlength=_SMALL_ULP)
        if not small.all():
            self.large.append(d[~small])
        self.ulp_total += int(d.sum())
        _max_per_prompt(self.max_ulp, drank, d)
        av = abits.view(np.float32).astype(np.float64)
        bv = bbits.view(np.float32).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            delta = av - bv  # |a - b| rounded once; infinite only where one side is ±inf
            prob = np.abs(np.exp(av) - np.exp(bv))
        self.abs_total.add(av, bv, delta)
        self.abs_max = max(self.abs_max, float(np.abs(delta).max()))
        # inf - inf where both exps overflow (logprobs > 709.78, which no log-softmax gives):
        # call it inf, never NaN (a NaN here would win or lose max() depending on batch order)
        self.prob_max = max(self.prob_max, float(np.where(np.isnan(prob), np.inf, prob).max()))


class _ExactSum:
    """Exact running sum of |a - b| over float32 pairs, so the mean cannot depend on how the rows
    were cut into batches: it is rounded once, at the end. a - b in float64 plus its TwoSum error
    is exactly a - b; each part is summed exactly by Rump-Ogita-Oishi extraction (split onto a
    grid whose sums float64 holds without rounding, repeat on the remainders). Every value is a
    multiple of 2**-149, so the total is kept as an integer scaled by 2**149."""

    def __init__(self) -> None:
        self.scaled = 0  # sum |a - b| * 2**149, exact
        self.infinite = False

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


def _segments(rank: np.ndarray) -> np.ndarray:
    """Start index of each run of equal values in a sorted array."""
    return np.flatnonzero(np.concatenate(([True], rank[1:] != rank[:-1])))


def _first_per_prompt(target: np.ndarray, rank: np.ndarray, pos: np.ndarray) -> None:
    if not len(rank):
        return
    starts = _segments(rank)
    np.minimum.at(target, rank[starts], np.minimum.reduceat(pos, starts))


def _max_per_prompt(target: np.ndarray, rank: np.ndarray, values: np.ndarray) -> None:
    starts = _segments(rank)
    np.maximum.at(target, rank[starts], np.maximum.reduceat(values, starts))


def _percentile(acc: _Acc, total: int, q: float) -> int:
    """Exact nearest-rank percentile of the integer ULP distances."""
    if total == 0:
        return 0
    rank = max(1, math.ceil(q * total))
    cum = np.cumsum(acc.small_hist)
    if cum[-1] >= rank:
        return int(np.searchsorted(cum, rank))
    large = np.sort(np.concatenate(acc.large))
    return int(large[rank - int(cum[-1]) - 1])


# ------------------------------------------------------------------------------------ the merge


def _align(acc: _Acc, a: _Chunk, b: _Chunk) -> None:
    if len(a) == len(b) and np.array_equal(a.key, b.key):
        acc.matched_rows(a, b)
        return
    ia = np.searchsorted(b.key, a.key)
    ia_clip = np.minimum(ia, max(len(b) - 1, 0))
    hit = (ia < len(b)) & (b.key[ia_clip] == a.key) if len(b) else np.zeros(len(a), dtype=bool)
    hit_b = np.zeros(len(b), dtype=bool)
    hit_b[ia[hit]] = True
    acc.unmatched(a.key[~hit])
    acc.unmatched(b.key[~hit_b])
    acc.matched_rows(a.take(hit), b.take(ia[hit]))


def _empty() -> _Chunk:
    return _Chunk(np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.uint32), None, None, np.empty(0, np.int32))


def _merge(acc: _Acc, sa: Iterator[_Chunk], sb: Iterator[_Chunk]) -> None:
    buf_a, buf_b = _empty(), _empty()
    done_a = done_b = False
    while True:
        if not done_a and not len(buf_a):
            nxt = next(sa, None)
            done_a = nxt is None
            buf_a = _Chunk.concat(buf_a, nxt) if nxt is not None else buf_a
        if not done_b and not len(buf_b):
            nxt = next(sb, None)
            done_b = nxt is None
            buf_b = _Chunk.concat(buf_b, nxt) if nxt is not None else buf_b
        if not len(buf_a) and not len(buf_b) and done_a and done_b:
            return
        # Everything up to the smaller of the two last keys can be decided now.
        ends = [c.key[-1] for c, done in ((buf_a, done_a), (buf_b, done_b)) if len(c) and not done]
        frontier = min(ends) if ends else np.iinfo(np.int64).max
        cut_a = int(np.searchsorted(buf_a.key, frontier, side="right"))
        cut_b = int(np.searchsorted(buf_b.key, frontier, side="right"))
        a_now, b_now = buf_a.take(slice(0, cut_a)), buf_b.take(slice(0, cut_b))
        buf_a, buf_b = buf_a.take(slice(cut_a, None)), buf_b.take(slice(cut_b, None))
        _align(acc, _fix_digest(a_now, b_now), _fix_digest(b_now, a_now))


def _fix_digest(c: _Chunk, other: _Chunk) -> _Chunk:
    # A chunk from a file with digests in some batches and not others: treat the absent ones as invalid.
    if c.digest is None and other.digest is not None:
        return _Chunk(c.key, c.token, c.bits, np.zeros(len(c), np.uint64), np.zeros(len(c), bool), c.top1)
    return c


# ------------------------------------------------------------------------------------ entry point


def diff_records(
    path_a: str | os.PathLike,
    path_b: str | os.PathLike,
    thresholds: Thresholds = Thresholds(),
    allow_partial: bool = False,
    batch_rows: int = 1 << 20,
) -> DiffResult:
    """Compare two records. Raises InputError when they cannot be compared."""
    path_a, path_b = Path(path_a), Path(path_b)
    pf_a, meta_a = open_record(path_a)
    pf_b, meta_b = open_record(path_b)
    for meta in (meta_a, meta_b):
        if meta.num_rows == 0:
            raise InputError(f"{meta.path}: record has no rows")
    problems = comparability(meta_a, meta_b)
    if problems and not allow_partial:
        raise InputError(f"cannot compare {path_a} with {path_b}: {'; '.join(problems)}; --allow-partial compares the prompts they share")

    union = sorted(set(meta_a.prompts) | set(meta_b.prompts))
    rank_of = {p: i for i, p in enumerate(union)}
    acc = _Acc(len(union))
    _merge(
        acc,
        _prefetched(_read_chunks(pf_a, path_a, rank_of, acc.rows_a, batch_rows), path_a),
        _prefetched(_read_chunks(pf_b, path_b, rank_of, acc.rows_b, batch_rows), path_b),
    )
    result = _finish(acc, meta_a, meta_b, union, thresholds)
    result.refusals = problems
    return result


def _finish(acc: _Acc, a: RecordMeta, b: RecordMeta, union: list[str], th: Thresholds) -> DiffResult:
    in_a, in_b = set(a.prompts), set(b.prompts)
    prompts = []
    for i, pid in enumerate(union):
        tdiv, bdiv = int(acc.token_div[i]), int(acc.bits_div[i])
        prompts.append(
            PromptDiff(
                prompt_id=pid, in_a=pid in in_a, in_b=pid in in_b,
                rows_a=int(acc.rows_a[i]), rows_b=int(acc.rows_b[i]), matched=int(acc.matched[i]),
                comparable=int(acc.comparable[i]), bitwise_equal=int(acc.bitwise_equal[i]),
                max_ulp=int(acc.max_ulp[i]),
                first_token_divergence=None if tdiv == NO_DIVERGENCE else tdiv,
                first_logprob_divergence=None if bdiv == NO_DIVERGENCE else bdiv,
            )
        )
    # Rows of prompts present on one side only are not "unmatched" noise inside a shared prompt.
    shared = np.array([p.in_a and p.in_b for p in prompts], dtype=bool)
    numeric = int(acc.small_hist.sum()) + sum(len(x) for x in acc.large)
    r = DiffResult(
        a=a, b=b, thresholds=th,
        rows_a=a.num_rows, rows_b=b.num_rows,
        matched=int(acc.matched.sum()), comparable=int(acc.comparable.sum()),
        after_divergence=acc.after_divergence,
        unmatched_a=int(acc.rows_a[shared].sum() - acc.matched[shared].sum()),
        unmatched_b=int(acc.rows_b[shared].sum() - acc.matched[shared].sum()),
        bitwise_equal=int(acc.bitwise_equal.sum()),
        nan_vs_number=acc.nan_vs_number, nan_payload_differs=acc.nan_payload,
        ulp_max=int(max(x.max() for x in acc.large)) if acc.large else int(np.flatnonzero(acc.small_hist)[-1]) if numeric else 0,
        ulp_mean=acc.ulp_total / numeric if numeric else 0.0,
        ulp_p50=_percentile(acc, numeric, 0.50), ulp_p99=_percentile(acc, numeric, 0.99),
        abs_max=acc.abs_max, abs_mean=acc.abs_total.mean(numeric), prob_max=acc.prob_max,
        digest_compared=acc.digest_compared, digest_equal=acc.digest_equal,
        top1_compared=acc.top1_compared, top1_equal=acc.top1_equal,
        prompts=prompts,
        env_differences=env_differences(a.env, b.env),
        cell_differences=cell_differences(a.cell, b.cell),
    )
    r.passed, r.reasons = verdict(r, th)
    return r


def verdict(r: DiffResult, th: Thresholds) -> tuple[bool, list[str]]:
    reasons = []
    if th.strict:
        if r.bitwise_equal != r.comparable:
            reasons.append(f"{r.comparable - r.bitwise_equal} of {r.comparable} logprobs differ in their bits (max {r.ulp_max} ULP)")
        if r.digest_equal != r.digest_compared:
            reasons.append(f"{r.digest_compared - r.digest_equal} of {r.digest_compared} logits rows differ (row digest)")
        if r.top1_equal != r.top1_compared:
            reasons.append(f"{r.top1_compared - r.top1_equal} of {r.top1_compared} positions change their most likely token")
    else:
        if th.max_ulp is not None and r.ulp_max > th.max_ulp:
            reasons.append(f"max ULP {r.ulp_max} > {th.max_ulp}")
        if th.max_abs is not None and r.abs_max > th.max_abs:
            reasons.append(f"max |Δ logprob| {r.abs_max!r} > {th.max_abs!r}")
    if r.nan_vs_number:
        reasons.append(f"{r.nan_vs_number} logprobs are NaN on one side only")
    if th.strict and r.nan_payload_differs:
        reasons.append(f"{r.nan_payload_differs} logprobs are NaN on both sides with different bits")
    shared = r.shared_prompts
    diverged = [p for p in shared if not p.token_match]
    if shared and len(diverged) / len(shared) > th.max_seq_divergence:
        first = diverged[0]
        reasons.append(
            f"{len(diverged)} of {len(shared)} sequences differ in tokens or length "
            f"(first: {first.prompt_id!r} at pos {first.first_token_divergence})"
        )
    return (not reasons), reasons
