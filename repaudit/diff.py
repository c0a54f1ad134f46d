"""Diff two token records: align on (prompt_id, pos), compare bit patterns, decide a verdict.

Both records are in canonical order, so alignment is a streaming merge over the int64 key
(prompt rank << 32 | pos); memory is bounded by the batch size, not the file size, except for
what exact percentiles keep of the rows whose bits differ (ULP distances above 2**16, and the
RL metrics' d: 8 bytes a row).

Speed: one thread per file reads its batches (Arrow decodes without the GIL) and validates them
while the caller compares the previous ones. Arrow assembles a list column about 10 times slower
than it reads a flat one, so the top-k lists are read from their Parquet pages directly where their
layout allows (`_direct_topk`; Arrow reads any other layout). When both files cut their batches at the same rows, which is the usual case,
a batch pair is recognised as aligned per prompt run and compared column against column with no
key at all. Only rows whose logprob bits differ go on to the ULP, |a - b|, probability and RL
statistics. The hot path writes into reused work arrays (`_Work`), since fresh memory costs a
page fault per page, and reads Arrow buffers as numpy views (`_values`; Array.to_numpy would
import pandas).

A row's logprob is only comparable when both sides scored the same token after the same
context. In a prompt, the first position where the tokens differ (or where one side has a
row the other lacks, once both have begun) is that prompt's *token divergence*; rows before it are comparable,
the row at it still shares its context (so its distribution digest, top-1 and top-k are
compared), rows after it are counted but not compared. In score mode tokens never differ,
so every row is compared; in generate mode, comparison stops where greedy decoding forked.
Rows before the other side's first row of a prompt do not end its shared prefix: a generate
record starts at the prompt's end, so a trainer's score record (prompt and completion) and a
rollout's generate record compare on the completion.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import queue
import sys
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from .errors import InputError
from .fingerprint import differences as env_differences
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


_PROMPT_FIELDS = tuple(f.name for f in fields(PromptDiff))  # every field holds a str, bool, int or None

DEFAULT_CLIP = (0.5, 2.0)


@dataclass
class RLMetrics:
    """Trainer / rollout mismatch over the RL positions: comparable rows (same prompt, pos and token after
    the same context) whose logprobs are finite on both sides. d = lp_b - lp_a; a is the rollout (the
    sampling policy), b the trainer. None where there is no position (or, for the flip numbers, no top-1
    or top-k to use). docs/metrics.md gives each formula and its precision."""

    positions: int = 0
    nonfinite: int = 0  # comparable rows left out: a NaN or ±inf logprob on a side
    clip: tuple[float, float] = DEFAULT_CLIP
    kl_k1: float | None = None
    kl_k2: float | None = None
    kl_k3: float | None = None
    ratio_min: float | None = None
    ratio_p50: float | None = None
    ratio_p99: float | None = None
    ratio_max: float | None = None
    abs_diff_mean: float | None = None
    abs_diff_max: float | None = None
    clip_frac: float | None = None
    seq_log_ratio_max: float | None = None
    flip_positions: int = 0  # RL positions where both top-1 ids are recorded
    flips: int = 0
    flip_rate: float | None = None
    flip_margin_p50: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(self.clip) if f.name == "clip" else json_float(getattr(self, f.name)) for f in fields(self)}


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
    digest_only_a: int = 0  # rows of a shared context with a digest in A and none in B
    digest_only_b: int = 0
    top1_compared: int = 0
    top1_equal: int = 0
    top1_only_a: int = 0
    top1_only_b: int = 0
    topk_compared: int = 0
    topk_ids_equal: int = 0
    topk_logprobs_equal: int = 0
    topk_only_a: int = 0
    topk_only_b: int = 0
    rl: RLMetrics = field(default_factory=RLMetrics)
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
    def topk_ids_equal_rate(self) -> float | None:
        return self._rate(self.topk_ids_equal, self.topk_compared)

    @property
    def topk_logprobs_equal_rate(self) -> float | None:
        return self._rate(self.topk_logprobs_equal, self.topk_compared)

    @property
    def coverage(self) -> list[tuple[str, int, int, int]]:
        """(what, rows compared, rows only A holds it, rows only B holds it) of the columns a record may lack."""
        return [("row digests", self.digest_compared, self.digest_only_a, self.digest_only_b),
                ("top-1 ids", self.top1_compared, self.top1_only_a, self.top1_only_b),
                ("top-k lists", self.topk_compared, self.topk_only_a, self.topk_only_b)]

    @property
    def not_compared(self) -> list[str]:
        """What could not be compared, as phrases (JSON `not_compared`)."""
        out = []
        for what, compared, only_a, only_b in self.coverage:
            if not (compared or only_a or only_b):
                out.append(f"{what}: in neither record")
            out += [f"{what}: {n} positions hold them in {side} only" for side, n in (("A", only_a), ("B", only_b)) if n]
        if self.rl.nonfinite:
            out.append(f"RL metrics: {self.rl.nonfinite} positions with a NaN or infinite logprob left out")
        if self.rl.flips and self.rl.flip_margin_p50 is None:
            out.append("flip margin: record A holds no top-k list of 2 or more at the flipped positions")
        return out

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
        """Every prompt is in both records with the same tokens (so no row is left over), and every bit of
        every recorded column agrees: logprob, row digest, top-1 id, top-k ids and logprobs, with no column
        held on one side only (row digests aside when one record holds none: see one_sided_gap). Identical implies the strict verdict passes, and with the same prompts on
        both sides the strict verdict passes only when identical."""
        return (
            self.comparable == self.bitwise_equal
            and self.digest_equal == self.digest_compared
            and self.top1_equal == self.top1_compared
            and self.topk_ids_equal == self.topk_logprobs_equal == self.topk_compared
            and not any(one_sided_gap(*c) for c in self.coverage)
            and all(p.token_match for p in self.prompts)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": _meta_summary(self.a),
            "b": _meta_summary(self.b),
            "verdict": {"passed": self.passed, "identical": self.identical, "reasons": self.reasons},
            "thresholds": {k: json_float(v) for k, v in asdict(self.thresholds).items()},
            "rows": {
                "a": self.rows_a, "b": self.rows_b, "matched": self.matched, "comparable": self.comparable,
                "after_divergence": self.after_divergence, "unmatched_a": self.unmatched_a,
                "unmatched_b": self.unmatched_b,
            },
            "logprob": {
                "bitwise_equal": self.bitwise_equal, "bitwise_equal_rate": self.bitwise_equal_rate,
                "nan_vs_number": self.nan_vs_number, "nan_payload_differs": self.nan_payload_differs,
                "ulp_max": self.ulp_max, "ulp_mean": self.ulp_mean, "ulp_p50": self.ulp_p50,
                "ulp_p99": self.ulp_p99, "abs_max": json_float(self.abs_max),
                "abs_mean": json_float(self.abs_mean), "prob_max": json_float(self.prob_max),
            },
            "digest": {"compared": self.digest_compared, "equal": self.digest_equal, "equal_rate": self.digest_equal_rate,
                       "only_a": self.digest_only_a, "only_b": self.digest_only_b},
            "top1": {"compared": self.top1_compared, "equal": self.top1_equal, "agreement": self.top1_agreement,
                     "only_a": self.top1_only_a, "only_b": self.top1_only_b},
            "topk": {"k_a": self.a.topk, "k_b": self.b.topk, "compared": self.topk_compared,
                     "ids_equal": self.topk_ids_equal, "ids_equal_rate": self.topk_ids_equal_rate,
                     "logprobs_equal": self.topk_logprobs_equal, "logprobs_equal_rate": self.topk_logprobs_equal_rate,
                     "only_a": self.topk_only_a, "only_b": self.topk_only_b},
            "not_compared": self.not_compared,
            "rl": self.rl.to_dict(),
            "sequences": {
                "shared": len(self.shared_prompts),
                "token_match_rate": self.seq_token_match_rate,
                "bitwise_match_rate": self.seq_bitwise_match_rate,
                "only_in_a": [p.prompt_id for p in self.prompts if not p.in_b],
                "only_in_b": [p.prompt_id for p in self.prompts if not p.in_a],
            },
            "prompts": [  # what asdict(p) gives, without its deep copy (5,000 prompts: 40 ms)
                {**{f: getattr(p, f) for f in _PROMPT_FIELDS}, "token_match": p.token_match, "bitwise_match": p.bitwise_match}
                for p in self.prompts
            ],
            "environment_differences": [list(d) for d in self.env_differences],
            "cell_differences": [list(d) for d in self.cell_differences],
            "partial": self.refusals,
        }


def json_float(x: Any) -> Any:
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

_FLAT_COLUMNS = ["prompt_id", "pos", "token_id", "logprob", "top1_id", "row_digest"]
_COLUMNS = _FLAT_COLUMNS + ["topk_ids", "topk_logprobs"]
_NOT_NULL = ("prompt_id", "pos", "token_id", "logprob", "top1_id")
_INF_BITS = 0x7F800000  # magnitude bits of inf; a larger magnitude is a NaN


def _values(arr: pa.Array, dtype: Any) -> np.ndarray:
    """Read-only numpy view of a primitive Arrow array's values, without a copy. (Array.to_numpy
    would do too, but it imports pandas: a third of a second of start-up.)"""
    buf = arr.buffers()[1]
    if buf is None or not len(arr):
        return np.empty(0, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def _validity(arr: pa.Array) -> np.ndarray:
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return np.ones(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=arr.offset + len(arr), bitorder="little")
    return bits[arr.offset :].astype(bool)


def _run_bounds(rank: np.ndarray) -> np.ndarray:
    """Start of each run of equal values in a sorted array, then its length (int64)."""
    chg = np.flatnonzero(rank[1:] != rank[:-1])
    bounds = np.empty(len(chg) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, len(rank)
    np.add(chg, 1, out=bounds[1:-1])
    return bounds if len(rank) else bounds[:1]


def _ordered_runs(rank: np.ndarray, pos: np.ndarray, work: "_Work") -> np.ndarray | None:
    """Run bounds of `rank` (see _run_bounds) when the rows are strictly increasing in (rank, pos),
    else None. Comparisons only, on the int32 columns: no int64 key, no overflow."""
    n = len(rank)
    if n == 1:
        return np.array([0, 1], dtype=np.int64)
    step = work.get("step", bool, n - 1)
    chg = np.flatnonzero(np.not_equal(rank[1:], rank[:-1], out=step))  # row i ends a run
    if len(chg) and not (rank[chg + 1] > rank[chg]).all():
        return None
    back = np.flatnonzero(np.less_equal(pos[1:], pos[:-1], out=step))  # allowed only where a new prompt starts
    if len(back):
        if len(back) > len(chg):
            return None
        at = np.searchsorted(chg, back)
        if at[-1] >= len(chg) or not (chg[at] == back).all():
            return None
    bounds = np.empty(len(chg) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, n
    np.add(chg, 1, out=bounds[1:-1])
    return bounds


class _Chunk:
    """Consecutive rows of one record, in canonical order, as numpy arrays (views of Arrow memory)."""

    __slots__ = ("rank", "pos", "token", "bits", "digest", "digest_ok", "top1", "topk_ids", "topk_bits", "topk_len",
                 "_bounds", "_key")

    def __init__(self, rank: np.ndarray, pos: np.ndarray, token: np.ndarray, bits: np.ndarray,
                 digest: np.ndarray | None, digest_ok: np.ndarray | None, top1: np.ndarray,
                 topk_ids: np.ndarray, topk_bits: np.ndarray, topk_len: np.ndarray | None,
                 bounds: np.ndarray | None = None, key: np.ndarray | None = None):
        self.rank = rank  # int32: index of the prompt in the sorted union of both records' prompts
        self.pos = pos  # int32, >= 0, strictly increasing within a prompt
        self.token = token  # int32
        self.bits = bits  # uint32 logprob bit patterns
        self.digest = digest  # uint64, or None when no row has one
        self.digest_ok = digest_ok  # bool; None means every digest is valid
        self.top1 = top1  # int32, -1 where not recorded
        self.topk_ids = topk_ids  # int32 (rows, w); w = 0 when no row has a top-k list
        self.topk_bits = topk_bits  # uint32 (rows, w): the top-k logprobs' bit patterns
        self.topk_len = topk_len  # int32 entries per row (the rest is zero padding), or None: every row has w
        self._bounds = bounds
        self._key = key

    def __len__(self) -> int:
        return len(self.pos)

    @property
    def bounds(self) -> np.ndarray:
        """Start of each prompt's run of rows, then len(self)."""
        if self._bounds is None:
            self._bounds = _run_bounds(self.rank)
        return self._bounds

    @property
    def key(self) -> np.ndarray:
        """int64 rank << 32 | pos, strictly increasing; only the general merge needs it."""
        if self._key is None:
            key = self.rank.astype(np.int64)
            key <<= 32
            key |= self.pos
            self._key = key
        return self._key

    def take(self, sl: slice | np.ndarray) -> "_Chunk":
        pick = lambda x: None if x is None else x[sl]  # noqa: E731
        return _Chunk(self.rank[sl], self.pos[sl], self.token[sl], self.bits[sl], pick(self.digest),
                      pick(self.digest_ok), self.top1[sl], self.topk_ids[sl], self.topk_bits[sl], pick(self.topk_len),
                      key=pick(self._key))

    def topk_rows(self) -> np.ndarray | None:
        """Which rows hold a top-k list: None when every row does."""
        if not self.topk_ids.shape[1]:
            return np.zeros(len(self), dtype=bool)
        return None if self.topk_len is None else self.topk_len > 0


def _same_keys(a: _Chunk, b: _Chunk) -> bool:
    """Do two chunks hold exactly the same (prompt, pos) rows? Usually decided per prompt run, not per row."""
    n = len(a)
    if n != len(b) or not n:
        return False
    ba, bb = a.bounds, b.bounds
    if len(ba) != len(bb) or not np.array_equal(ba, bb):
        return False
    starts, last = ba[:-1], ba[1:] - 1
    if not np.array_equal(a.rank[starts], b.rank[starts]):
        return False  # rank is constant over each run, so now a.rank == b.rank
    pa_, pb_ = a.pos, b.pos
    if np.array_equal(pa_[starts], pb_[starts]) and np.array_equal(pa_[last], pb_[last]):
        # Positions strictly increase within a run: a run whose last - first == length - 1 is
        # exactly first..last, in both chunks.
        if np.array_equal(pa_[last].astype(np.int64) - pa_[starts], last - starts):
            return True
    return np.array_equal(pa_, pb_)


def _refuse_rows(path: Path, dictionary: pa.Array, indices: np.ndarray, rank: np.ndarray, pos: np.ndarray,
                 last: int, n_ranks: int) -> None:
    """The batch broke a rule (checked cheaply by the caller): say which one, as the first bad row."""
    ranks = rank.astype(np.int64)
    if ranks.min() < 0 or ranks.max() >= n_ranks or pos.min() < 0:
        raise InputError(f"{path}: rows name prompts missing from the metadata, or negative positions")
    key = (ranks << 32) | pos
    i = int(np.argmax(np.diff(key, prepend=np.int64(last)) <= 0))
    raise InputError(
        f"{path}: duplicate or out-of-order row at prompt {dictionary[int(indices[i])].as_py()!r} "
        f"pos {int(pos[i])} (records must be sorted by (prompt_id, pos) with no duplicates)"
    )


def _batches(pf, fd: int, path: Path, batch_rows: int, work: "_Work") -> Iterator[tuple[pa.RecordBatch, "_Lists", "_Lists", int]]:
    """(batch, its top-k ids, its top-k logprobs, where the batch starts in those lists), in batches of
    at most batch_rows rows, one row group at a time: a row group that fits in a batch is read whole, a
    larger one streamed in batches. (iter_batches over the whole file would hold far more of it in
    memory.) The top-k lists of a row group are read from its pages directly when `_direct_lists` can
    (10x faster than Arrow assembling list arrays), else by Arrow with the other columns."""
    meta = pf.metadata
    for i in range(meta.num_row_groups):
        lists = _direct_topk(pf, fd, i, work)
        columns = _FLAT_COLUMNS if lists else _COLUMNS
        if meta.row_group(i).num_rows <= batch_rows:
            batches = pf.read_row_group(i, columns=columns, use_threads=True).to_batches()
        else:
            batches = pf.iter_batches(batch_size=batch_rows, row_groups=[i], columns=columns, use_threads=True)
        start = 0
        for batch in batches:
            if lists:
                yield batch, lists[0], lists[1], start
            else:
                ids, lps = (_arrow_lists(batch.column(c), path) for c in ("topk_ids", "topk_logprobs"))
                yield batch, ids, lps, 0
            start += batch.num_rows


def _read_chunks(pf, path: Path, rank_of: dict[str, int], rows_per_prompt: np.ndarray,
                 batch_rows: int) -> Iterator[_Chunk]:
    """Batches of one record as _Chunks, validated: canonical order, known prompts, pos >= 0."""
    work = _Work()  # this thread's own
    with open(path, "rb") as file:  # for the top-k pages
        yield from _validated_chunks(pf, file.fileno(), path, rank_of, rows_per_prompt, batch_rows, work)


def _validated_chunks(pf, fd: int, path: Path, rank_of: dict[str, int], rows_per_prompt: np.ndarray,
                      batch_rows: int, work: "_Work") -> Iterator[_Chunk]:
    last = -1  # key of the previous batch's last row
    dictionary, lut, identity = None, None, False
    for batch, topk_ids_lists, topk_lp_lists, start in _batches(pf, fd, path, batch_rows, work):
        n = batch.num_rows
        if not n:
            continue
        for name in _NOT_NULL:
            if batch.column(name).null_count:
                raise InputError(f"{path}: corrupt data: nulls in column {name!r}")
        ids = batch.column("prompt_id")
        if dictionary is None or not ids.dictionary.equals(dictionary):
            dictionary = ids.dictionary
            lut = np.array([rank_of.get(v, -1) for v in dictionary.to_pylist()], dtype=np.int32)
            identity = bool(np.array_equal(lut, np.arange(len(lut), dtype=np.int32)))
        indices = _values(ids.indices, np.int32)
        pos = _values(batch.column("pos"), np.int32)
        if identity:  # the file's dictionary is the sorted union itself: ranks are the indices
            rank, n_ranks = indices, len(lut)
        else:
            if indices.min() < 0 or indices.max() >= len(lut):
                _refuse_rows(path, dictionary, indices, indices, pos, last, len(lut))
            rank, n_ranks = lut[indices], len(rank_of)
        bounds = _ordered_runs(rank, pos, work)
        # Sorted, so the smallest rank is the first and the smallest pos starts a run.
        if (bounds is None or rank[0] < 0 or rank[-1] >= n_ranks or pos[bounds[:-1]].min() < 0
                or (int(rank[0]) << 32 | int(pos[0])) <= last):
            _refuse_rows(path, dictionary, indices, rank, pos, last, n_ranks)
        last = int(rank[-1]) << 32 | int(pos[-1])
        rows_per_prompt[rank[bounds[:-1]]] += np.diff(bounds)
        dig = batch.column("row_digest")
        if dig.null_count == n:
            digest = digest_ok = None
        else:
            digest = _values(dig, np.uint64)  # under a null: whatever the buffer holds, masked by digest_ok
            digest_ok = _validity(dig) if dig.null_count else None
        topk_ids, topk_bits, topk_len = _topk(topk_ids_lists, topk_lp_lists, start, n, path)
        yield _Chunk(
            rank=rank, pos=pos,
            token=_values(batch.column("token_id"), np.int32),
            bits=_values(batch.column("logprob"), np.uint32),
            digest=digest, digest_ok=digest_ok,
            top1=_values(batch.column("top1_id"), np.int32),
            topk_ids=topk_ids, topk_bits=topk_bits, topk_len=topk_len,
            bounds=bounds,
        )


class _Lists:
    """A list column's rows as numpy: offsets[i]:offsets[i + 1] are row i's entries in `values`, and
    lengths their difference, except 0 for a null list (not recorded). Lists all of one width w (what
    build_table writes) may come as width=w with no offsets: row i is values[i * w:(i + 1) * w]."""

    __slots__ = ("values", "offsets", "lengths", "width")

    def __init__(self, values: np.ndarray, offsets: np.ndarray | None = None, lengths: np.ndarray | None = None,
                 width: int | None = None):
        self.values, self.offsets, self.lengths, self.width = values, offsets, lengths, width

    def rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, lengths) of rows start..start + n."""
        if self.width is not None:
            offsets = np.arange(start, start + n + 1, dtype=np.int64) * self.width
            return offsets, np.full(n, self.width, np.int64)
        return self.offsets[start : start + n + 1], self.lengths[start : start + n]


def _arrow_lists(arr: pa.ListArray, path: Path) -> _Lists:
    """Views of an Arrow list array (values as raw 4-byte patterns); refuses nulls inside the lists."""
    if arr.values.null_count:
        raise InputError(f"{path}: corrupt data: nulls inside the top-k lists")
    offsets = _values(arr.offsets, np.int32)
    lengths = np.diff(offsets)
    if arr.null_count:
        lengths[~_validity(arr)] = 0
    return _Lists(_values(arr.values, np.uint32), offsets, lengths)


def _topk(ids: _Lists, lps: _Lists, start: int, n: int, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows start..start + n of the top-k lists as (rows, w) arrays of ids and logprob bit patterns: views
    when every row holds w entries (what build_table writes), else zero-padded copies with each row's length."""
    vi, vl = ids.values.view(np.int32), lps.values.view(np.uint32)
    w = ids.width
    if w is not None and w == lps.width:  # known uniform from the levels: no per-row lengths to check
        return vi[start * w : (start + n) * w].reshape(n, w), vl[start * w : (start + n) * w].reshape(n, w), None
    off_i, lengths = ids.rows(start, n)
    off_l, lengths_l = lps.rows(start, n)
    if len(lengths) != n or not np.array_equal(lengths, lengths_l):
        raise InputError(f"{path}: corrupt data: topk_ids and topk_logprobs lists differ in length")
    w = int(lengths.max()) if n else 0
    if (lengths == w).all():
        i0, l0 = int(off_i[0]), int(off_l[0])
        return vi[i0 : i0 + n * w].reshape(n, w), vl[l0 : l0 + n * w].reshape(n, w), None
    held = np.arange(w) < lengths[:, None]
    out_i, out_l = np.zeros((n, w), np.int32), np.zeros((n, w), np.uint32)
    out_i[held] = vi[(off_i[:-1, None] + np.arange(w))[held]]
    out_l[held] = vl[(off_l[:-1, None] + np.arange(w))[held]]
    return out_i, out_l, lengths.astype(np.int32)


# ------------------------------------------------------------------------------------ top-k pages
#
# Arrow turns a list column's repetition and definition levels into list arrays at about 40 ns a row
# (k = 5): ten times the cost of decompressing and copying the values, and most of the diff's time.
# The top-k lists need far less: their values are PLAIN 4-byte patterns at the end of each data page,
# and the levels only say where each row starts. So a row group's two top-k leaf columns are read
# here, page by page, with numpy. Anything this reader does not expect (a dictionary page, another
# encoding or codec, nullable lists, sizes that do not add up, a page it cannot parse) makes it give
# the row group to Arrow, which then reads it (or refuses it) exactly as before: this is a faster
# route to the same values, never a second opinion on a file.

_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "LZ4": "lz4_raw", "ZSTD": "zstd", "BROTLI": "brotli"}
_DIRECT_MAX_BYTES = 256 << 20  # a row group's two top-k columns, decoded; larger ones Arrow streams in batches
_DATA_PAGE, _DATA_PAGE_V2 = 0, 3  # Parquet PageType
_PLAIN, _RLE = 0, 3  # Parquet Encoding


class _NotDirect(Exception):
    """The pages hold something _direct_lists does not read: Arrow reads the row group instead."""


def _direct_topk(pf, fd: int, group: int, work: "_Work") -> tuple[_Lists, _Lists] | None:
    """Row group `group`'s top-k ids and logprobs read from their pages, or None: Arrow reads them."""
    meta = pf.metadata
    rg = meta.row_group(group)
    leaves = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    try:
        cols = [leaves[f"{name}.list.element"] for name in ("topk_ids", "topk_logprobs")]
    except KeyError:
        return None
    if sum(rg.column(j).total_uncompressed_size for j in cols) > _DIRECT_MAX_BYTES:
        return None
    try:
        return tuple(_direct_lists(fd, rg.column(j), meta.schema.column(j), rg.num_rows, work) for j in cols)
    except (_NotDirect, LookupError, ValueError, TypeError, RecursionError, OSError, pa.ArrowException):
        return None  # what parsing odd bytes raises


def _direct_lists(fd: int, col, leaf, rows: int, work: "_Work") -> _Lists:
    """One list<4-byte> leaf column chunk (a required list of optional items, PLAIN values, RLE levels)."""
    if (col.physical_type not in ("INT32", "FLOAT") or col.has_dictionary_page or col.compression not in _CODECS
            or leaf.max_definition_level != 2 or leaf.max_repetition_level != 1):
        raise _NotDirect
    codec = _CODECS[col.compression] and pa.Codec(_CODECS[col.compression])
    raw = _mapped(fd, col.data_page_offset, col.total_compressed_size)
    total = col.num_values  # levels: one per item, and one per empty list
    rep, dfn = work.get("rep", np.uint8, total), work.get("def", np.uint8, total)
    values = work.unshared(np.uint32, total)  # handed on: the chunks are views of it
    at = done = stored = 0
    while done < total:
        header, at = _thrift_struct(raw, at)
        size, unpacked = header.get(3, -1), header.get(2, -1)  # compressed and uncompressed page sizes
        if not (0 <= size <= len(raw) - at and 0 <= unpacked <= col.total_uncompressed_size):
            raise _NotDirect  # (a damaged size could ask for any amount of memory)
        page, at = raw[at : at + size], at + size
        (rep_stream, def_stream), data, count = _page_parts(header, page, codec)
        if not 0 < count <= total - done:
            raise _NotDirect
        _levels(rep_stream, 1, count, rep[done : done + count], work)
        every = _levels(def_stream, 2, count, dfn[done : done + count], work)  # the value of every level, if one
        present = count if every == 2 else 0 if every is not None else int(np.count_nonzero(dfn[done : done + count] == 2))
        if len(data) != 4 * present:
            raise _NotDirect
        values[stored : stored + present] = np.frombuffer(data, np.uint32)
        done, stored = done + count, stored + present
    if at != len(raw):
        raise _NotDirect
    return _level_lists(rep, dfn, values[:stored], rows, work)


def _mapped(fd: int, start: int, size: int) -> memoryview:
    """Bytes start..start + size of the file, mapped: no copy, and no page fault per page as a read into
    fresh memory would have. Mapped per column chunk, so that the process does not go on holding the
    whole file in its RSS: the mapping goes when the last view of it does (not closed explicitly: a view
    still held by an exception's traceback would make close() fail)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page now, not fault by fault
    mapped = mmap.mmap(fd, start + size - base, flags=flags, prot=mmap.PROT_READ, offset=base)  # ValueError past the end
    return memoryview(mapped)[start - base :]


def _page_parts(header: dict, page: memoryview, codec) -> tuple[tuple[memoryview, memoryview], memoryview, int]:
    """A data page's repetition and definition level streams, its PLAIN values, and its number of levels."""
    kind, size = header.get(1), header.get(2)
    if kind == _DATA_PAGE and 5 in header:
        h = header[5]  # DataPageHeader: num_values, encoding, definition / repetition level encodings
        if (h.get(2), h.get(3), h.get(4)) != (_PLAIN, _RLE, _RLE):
            raise _NotDirect
        body = _decompressed(page, codec, size)
        rep_len = int.from_bytes(body[:4], "little")
        def_at = 4 + rep_len
        def_len = int.from_bytes(body[def_at : def_at + 4], "little")
        if def_at + 4 + def_len > len(body):
            raise _NotDirect
        rep, dfn, data = body[4:def_at], body[def_at + 4 : def_at + 4 + def_len], body[def_at + 4 + def_len :]
        count = h[1]
    elif kind == _DATA_PAGE_V2 and 8 in header:
        h = header[8]  # DataPageHeaderV2: levels stored uncompressed before the (maybe compressed) values
        if h.get(4) != _PLAIN:  # (its num_nulls counts empty lists too: the definition levels tell)
            raise _NotDirect
        def_len, rep_len = h[5], h[6]
        if not (0 <= rep_len and 0 <= def_len and rep_len + def_len <= min(len(page), size)):
            raise _NotDirect
        rep, dfn = page[:rep_len], page[rep_len : rep_len + def_len]
        rest = page[rep_len + def_len :]
        data = _decompressed(rest, codec if h.get(7, True) else None, size - rep_len - def_len)
        count = h[1]
    else:
        raise _NotDirect
    return (rep, dfn), data, count


def _decompressed(data: memoryview, codec, size: int) -> memoryview:
    if codec is None:
        if len(data) != size:
            raise _NotDirect
        return data
    out = memoryview(codec.decompress(data, decompressed_size=size)).cast("B")  # Arrow's buffers are signed chars
    if len(out) != size:
        raise _NotDirect
    return out


def _level_lists(rep: np.ndarray, dfn: np.ndarray, values: np.ndarray, rows: int, work: "_Work") -> _Lists:
    """The rows from the levels: a row starts at repetition level 0; definition level 2 is an item, 0 an
    empty list (1, a null item, Arrow's reading refuses)."""
    total = len(rep)
    if len(values) == total and rows and total % rows == 0:  # every level an item: one width for all?
        width = total // rows  # then a row starts (level 0) every width levels
        uniform = work.tiled(f"rep{width}", np.array([0] + [1] * (width - 1), np.uint8), total)
        if pa.py_buffer(rep).equals(pa.py_buffer(uniform)):  # a memcmp
            return _Lists(values, width=width)
    starts = np.flatnonzero(rep == 0)
    if len(starts) != rows or (rows and starts[0] != 0):
        raise _NotDirect
    if len(values) == total:  # offsets are the row starts
        offsets = np.append(starts, total)
    else:
        if (dfn == 1).any() or (dfn > 2).any():
            raise _NotDirect
        before = np.zeros(total + 1, np.int64)  # items before each level
        np.cumsum(dfn == 2, out=before[1:])
        offsets = before[np.append(starts, total)]
    return _Lists(values, offsets, np.diff(offsets))


def _levels(stream: memoryview, width: int, count: int, out: np.ndarray, work: "_Work") -> int | None:
    """_hybrid, remembering the last stream of each width: pages of lists of one length (k = 5: 20,000
    rows a page as Arrow writes) hold the same level bytes page after page, and the same bytes are the
    same levels."""
    key = bytes(stream)
    last = work.levels.get(width)
    if last is not None and last[0] == count and last[1] == key:
        out[:] = last[2]
        return last[3]
    every = _hybrid(stream, width, count, out)
    work.levels[width] = (count, key, out.copy(), every)
    return every


def _hybrid(stream: memoryview, width: int, count: int, out: np.ndarray) -> int | None:
    """Decode `count` levels of Parquet's RLE / bit-packed hybrid encoding into out; return their value
    when one run holds them all, else None. Arrow writes runs of 504 bit-packed levels with the same
    header, so a stretch of such runs is decoded at once."""
    data = np.frombuffer(stream, np.uint8)
    at = got = 0
    every = None
    while got < count:
        start = at
        header, at = _varint(stream, at)
        if not header & 1:  # RLE: one value (one byte for widths up to 8) repeated header >> 1 times
            take = min(header >> 1, count - got)
            value = stream[at]
            out[got : got + take] = value
            every = value if take == count else None
            at += 1
            got += take
            continue
        if header < 2:
            raise _NotDirect  # a bit-packed run of no groups
        head, block = at - start, at - start + (header >> 1) * width  # bit-packed: groups of 8 levels
        runs = (len(stream) - start) // block
        blocks = data[start : start + runs * block].reshape(runs, block)
        same = (blocks[:, :head] == data[start:at]).all(axis=1)
        runs = min(runs if same.all() else int(np.argmin(same)), -(-(count - got) // (8 * (header >> 1))))
        if runs < 1:
            raise _NotDirect
        levels = _unpack(blocks[:runs, head:], width)
        take = min(len(levels), count - got)
        out[got : got + take] = levels[:take]
        got += take
        at = start + runs * block
    if at > len(stream):
        raise _NotDirect
    return every


def _unpack(packed: np.ndarray, width: int) -> np.ndarray:
    """Bit-packed levels (little-endian bit order, `width` bits each) as uint8."""
    bits = np.unpackbits(packed.reshape(-1), bitorder="little")
    if width == 1:
        return bits
    bits = bits.reshape(-1, width)
    return bits[:, 0] | (bits[:, 1] << 1)


def _varint(buf: memoryview, at: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        byte = buf[at]
        at += 1
        out |= (byte & 0x7F) << shift
        if byte < 0x80:
            return out, at
        shift += 7


def _thrift_struct(buf: memoryview, at: int) -> tuple[dict, int]:
    """A Thrift compact-protocol struct (a page header) as {field id: value}; nested structs as dicts,
    integers as ints; binaries, doubles, lists and maps are skipped (None)."""
    out: dict = {}
    field_id = 0
    while True:
        head = buf[at]
        at += 1
        if head == 0:
            return out, at
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field_id += delta
        else:
            raw, at = _varint(buf, at)
            field_id = (raw >> 1) ^ -(raw & 1)
        out[field_id], at = _thrift_value(buf, at, kind)


def _thrift_value(buf: memoryview, at: int, kind: int) -> tuple[Any, int]:
    if kind in (1, 2):  # booleans hold their value in the type
        return kind == 1, at
    if kind == 3:
        return buf[at], at + 1
    if kind in (4, 5, 6):  # zigzag varints
        raw, at = _varint(buf, at)
        return (raw >> 1) ^ -(raw & 1), at
    if kind == 7:
        return None, at + 8
    if kind == 8:
        size, at = _varint(buf, at)
        return None, at + size
    if kind in (9, 10):  # list, set
        head = buf[at]
        at += 1
        size, item = head >> 4, head & 0x0F
        if size == 15:
            size, at = _varint(buf, at)
        for _ in range(size):
            at = at + 1 if item in (1, 2) else _thrift_value(buf, at, item)[1]
        return None, at
    if kind == 11:  # map
        size, at = _varint(buf, at)
        if size:
            types = buf[at]
            at += 1
            for _ in range(size):
                at = _thrift_value(buf, at, types >> 4)[1]
                at = _thrift_value(buf, at, types & 0x0F)[1]
        return None, at
    if kind == 12:
        return _thrift_struct(buf, at)
    raise _NotDirect


def _prefetched(chunks: Iterator[_Chunk], path: Path, depth: int = 4) -> Iterator[_Chunk]:
    """Decode and validate the next batches in a thread while the caller compares: Parquet
    decoding and numpy both release the GIL, so the two files and the comparison share the cores.
    The top-k lists of a row group (4 batches as written) are decoded at once: `depth` batches
    queued keep the comparison going meanwhile."""
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
        self.work = _Work()

    @property
    def ulp_total(self) -> int:
        """Exact sum of the ULP distances (Python ints: no overflow)."""
        nz = np.flatnonzero(self.small_hist)
        return sum(map(operator.mul, nz.tolist(), self.small_hist[nz].tolist())) + sum(int(x.sum()) for x in self.large)

    def unmatched(self, keys: np.ndarray, other_first: np.ndarray) -> None:
        """Rows one side has and the other lacks end the shared prefix of their prompt, unless the
        other side has not begun that prompt yet (`other_first`: its first position per prompt)."""
        if len(keys):
            rank, pos = keys >> 32, keys & _POS_MASK
            late = other_first[rank] < pos
            _first_per_prompt(self.token_div, rank[late], pos[late])

    def matched_rows(self, a: _Chunk, b: _Chunk) -> None:
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

    def _digests(self, a: _Chunk, b: _Chunk, ctx: np.ndarray | None, mask: np.ndarray) -> None:
        if a.digest is None:  # neither side has one (_fix_digest gives the other side all-null digests)
            return
        both, n, only_a, only_b = _coverage(len(a), a.digest_ok, b.digest_ok, ctx)
        self.digest_compared += n
        self.digest_only_a += only_a
        self.digest_only_b += only_b
        self.digest_equal += n - _count(np.not_equal(a.digest, b.digest, out=mask), both)

    def _top1(self, a: _Chunk, b: _Chunk, ctx: np.ndarray | None, rl: np.ndarray | None, mask: np.ndarray) -> None:
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

    def _flip_margins(self, a: _Chunk, rows: np.ndarray) -> None:
        """Record A's top-1 minus top-2 logprob at the flipped rows that hold at least two entries."""
        if a.topk_bits.shape[1] < 2:
            return
        if a.topk_len is not None:
            rows = rows[a.topk_len[rows] >= 2]
        top = a.topk_bits[rows, :2].view(np.float32).astype(np.float64)
        margin = top[:, 0] - top[:, 1]
        self.flip_margins.append(margin[~np.isnan(margin)])  # a NaN has no place in a median

    def _topk(self, a: _Chunk, b: _Chunk, ctx: np.ndarray | None) -> None:
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
        if top > _INF_BITS:  # a NaN somewhere
            a_nan, b_nan = am > _INF_BITS, bm > _INF_BITS
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
        if top == _INF_BITS:  # ±inf on a side: not an RL position
            finite = np.flatnonzero(np.isfinite(delta))
            first, prompts = _kept_segments(finite, first, prompts)
            other = other[np.isfinite(delta[other])]
        if len(other):
            self.rl_sum.add_binades(_binades(abits[other]), av[other])
            self.rl_sum.add_binades(_binades(bbits[other]), -bv[other])
        self.rl_d.append(np.negative(delta if finite is None else delta[finite]))
        self.rl_prompts.append(prompts)
        self.rl_counts.append(np.diff(first, append=len(self.rl_d[-1])))


class _Work:
    """Work arrays reused from chunk to chunk. Fresh memory costs a page fault per page on first
    touch (with transparent huge pages, zeroing 2 MiB at a time): more than the arithmetic done on
    it, so the hot path writes into these with out= instead of allocating temporaries."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._handed: list[np.ndarray] = []  # see unshared
        self._tiled: dict[str, np.ndarray] = {}
        self.levels: dict[int, tuple] = {}  # see _levels

    def tiled(self, name: str, unit: np.ndarray, n: int) -> np.ndarray:
        """`unit` repeated to n items (the same unit for the same name), kept for the next call."""
        arr = self._tiled.get(name)
        if arr is None or len(arr) < n:
            arr = self._tiled[name] = np.tile(unit, -(-(n + n // 4) // len(unit)))
        return arr[:n]

    def unshared(self, dtype: Any, n: int) -> np.ndarray:
        """An array of n items that may be handed on (chunks hold views of it), reused once nothing
        refers to it any more: every numpy view holds a reference to the array that owns the memory,
        so a reference count of 3 (this list, the loop variable, getrefcount's argument) means that no
        view is left, and none can be made. As many are kept as were ever in use at once."""
        for arr in self._handed:
            if sys.getrefcount(arr) == 3 and arr.dtype == dtype and len(arr) >= n:
                return arr[:n]
        arr = np.empty(n + n // 4, dtype=dtype)  # room for a larger row group
        self._handed.append(arr)
        return arr[:n]

    def get(self, name: str, dtype: Any, n: int) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None or len(arr) < n:
            arr = self._arrays[name] = np.empty(max(n + n // 4, 1024), dtype=dtype)  # room for the next chunk's
        return arr[:n]


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


def _binades(bits: np.ndarray, work: _Work | None = None) -> np.ndarray:
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


def _finite(a_bits: np.ndarray, b_bits: np.ndarray, work: "_Work") -> np.ndarray | None:
    """Rows where both logprobs are finite numbers (no NaN, no ±inf): None when every row is."""
    n = len(a_bits)
    am = np.bitwise_and(a_bits, np.uint32(0x7FFFFFFF), out=work.get("finite_a", np.uint32, n))
    bm = np.bitwise_and(b_bits, np.uint32(0x7FFFFFFF), out=work.get("finite_b", np.uint32, n))
    if max(int(am.max()), int(bm.max())) < _INF_BITS:
        return None
    return (am < _INF_BITS) & (bm < _INF_BITS)


def _rows_differ(x: np.ndarray, y: np.ndarray, work: "_Work") -> np.ndarray | None:
    """Rows of two (rows, w) integer arrays that differ anywhere: None when none does. Equal arrays, the
    usual case, are told by one memcmp (pyarrow's Buffer.equals), without writing a mask."""
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    if pa.py_buffer(x).equals(pa.py_buffer(y)):
        return None
    return np.not_equal(x, y, out=work.get("topk", bool, x.size).reshape(x.shape)).any(axis=1)


def _topk_differ(a: _Chunk, b: _Chunk, work: "_Work") -> tuple[np.ndarray | None, np.ndarray | None]:
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


def _note_first(target: np.ndarray, c: _Chunk) -> None:
    """target[prompt] = the smallest position seen of that prompt (rows are sorted by position)."""
    if len(c):
        starts = c.bounds[:-1]
        np.minimum.at(target, c.rank[starts], c.pos[starts])


def _first_per_prompt(target: np.ndarray, rank: np.ndarray, pos: np.ndarray) -> None:
    if not len(rank):
        return
    starts = _segments(rank)
    np.minimum.at(target, rank[starts], np.minimum.reduceat(pos, starts))


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
    # Every row of either side up to these chunks' last key is here or was before, so the first
    # positions below are final for any row that unmatched() weighs.
    _note_first(acc.first_a, a)
    _note_first(acc.first_b, b)
    if _same_keys(a, b):
        acc.matched_rows(a, b)
        return
    ka, kb = a.key, b.key
    ia = np.searchsorted(kb, ka)
    ia_clip = np.minimum(ia, max(len(b) - 1, 0))
    hit = (ia < len(b)) & (kb[ia_clip] == ka) if len(b) else np.zeros(len(a), dtype=bool)
    hit_b = np.zeros(len(b), dtype=bool)
    hit_b[ia[hit]] = True
    acc.unmatched(ka[~hit], acc.first_b)
    acc.unmatched(kb[~hit_b], acc.first_a)
    acc.matched_rows(a.take(hit), b.take(ia[hit]))


_EMPTY = _Chunk(np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.uint32),
                None, None, np.empty(0, np.int32), np.empty((0, 0), np.int32), np.empty((0, 0), np.uint32), None,
                key=np.empty(0, np.int64))


def _merge(acc: _Acc, sa: Iterator[_Chunk], sb: Iterator[_Chunk]) -> None:
    buf_a, buf_b = _EMPTY, _EMPTY
    done_a = done_b = False
    while True:
        if not done_a and not len(buf_a):
            nxt = next(sa, None)
            done_a = nxt is None
            buf_a = _EMPTY if done_a else nxt
        if not done_b and not len(buf_b):
            nxt = next(sb, None)
            done_b = nxt is None
            buf_b = _EMPTY if done_b else nxt
        if not len(buf_a) and not len(buf_b) and done_a and done_b:
            return
        if _same_keys(buf_a, buf_b):  # the usual case: both files cut into batches at the same rows
            _note_first(acc.first_a, buf_a)
            _note_first(acc.first_b, buf_b)
            acc.matched_rows(_fix_digest(buf_a, buf_b), _fix_digest(buf_b, buf_a))
            buf_a, buf_b = _EMPTY, _EMPTY
            continue
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
        return _Chunk(c.rank, c.pos, c.token, c.bits, np.zeros(len(c), np.uint64), np.zeros(len(c), bool), c.top1,
                      c.topk_ids, c.topk_bits, c.topk_len, bounds=c._bounds, key=c._key)
    return c


# ------------------------------------------------------------------------------------ entry point


def diff_records(
    path_a: str | os.PathLike,
    path_b: str | os.PathLike,
    thresholds: Thresholds = Thresholds(),
    allow_partial: bool = False,
    batch_rows: int = 1 << 18,
    clip: tuple[float, float] = DEFAULT_CLIP,
) -> DiffResult:
    """Compare two records (A is the rollout / reference side of the RL metrics; `clip` bounds the
    importance ratio for clip_frac). Raises InputError when they cannot be compared."""
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
    result = _finish(acc, meta_a, meta_b, union, thresholds, clip)
    result.refusals = problems
    return result


def _finish(acc: _Acc, a: RecordMeta, b: RecordMeta, union: list[str], th: Thresholds,
            clip: tuple[float, float]) -> DiffResult:
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
        digest_only_a=acc.digest_only_a, digest_only_b=acc.digest_only_b,
        top1_compared=acc.top1_compared, top1_equal=acc.top1_equal,
        top1_only_a=acc.top1_only_a, top1_only_b=acc.top1_only_b,
        topk_compared=acc.topk_compared, topk_ids_equal=acc.topk_ids_equal,
        topk_logprobs_equal=acc.topk_logprobs_equal, topk_only_a=acc.topk_only_a, topk_only_b=acc.topk_only_b,
        rl=_rl_metrics(acc, clip),
        prompts=prompts,
        env_differences=env_differences(a.env, b.env),
        cell_differences=cell_differences(a.cell, b.cell),
    )
    r.passed, r.reasons = verdict(r, th)
    return r


_CANNOT = {"row digests": "cannot prove the distributions equal", "top-1 ids": "cannot compare the most likely tokens",
           "top-k lists": "cannot compare the top-k"}


def one_sided_gap(what: str, compared: int, only_a: int, only_b: int) -> bool:
    """Whether a column held by one record only counts against the pair. It does, so that a missing
    column is never taken as equal, except row digests missing from a whole record: an engine that
    never sees the full logits row (vLLM) records none, and a trainer-versus-rollout pair is then
    judged on every column both hold (diff lists the digests under not_compared)."""
    if not (only_a or only_b):
        return False
    return not (what == "row digests" and compared == 0 and not (only_a and only_b))


def _one_sided(r: DiffResult) -> list[str]:
    out = []
    for what, compared, only_a, only_b in r.coverage:
        if not one_sided_gap(what, compared, only_a, only_b):
            continue
        for side, other, n, n_other in (("A", "B", only_a, only_b), ("B", "A", only_b, only_a)):
            if not n:
                continue
            if compared or n_other:
                out.append(f"{n} positions hold {what} in record {side} only; {_CANNOT[what]} there")
            else:
                out.append(f"record {other} has no {what} ({side} has them at {n} positions); {_CANNOT[what]}")
    return out


def verdict(r: DiffResult, th: Thresholds) -> tuple[bool, list[str]]:
    reasons = []
    if th.strict:
        if r.bitwise_equal != r.comparable:
            reasons.append(f"{r.comparable - r.bitwise_equal} of {r.comparable} logprobs differ in their bits (max {r.ulp_max} ULP)")
        if r.digest_equal != r.digest_compared:
            reasons.append(f"{r.digest_compared - r.digest_equal} of {r.digest_compared} logits rows differ (row digest)")
        if r.top1_equal != r.top1_compared:
            reasons.append(f"{r.top1_compared - r.top1_equal} of {r.top1_compared} positions change their most likely token")
        if r.topk_ids_equal != r.topk_compared:
            reasons.append(f"{r.topk_compared - r.topk_ids_equal} of {r.topk_compared} positions differ in their top-k ids")
        if r.topk_logprobs_equal != r.topk_compared:
            reasons.append(f"{r.topk_compared - r.topk_logprobs_equal} of {r.topk_compared} positions differ in their top-k logprob bits")
        reasons += _one_sided(r)
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


# ------------------------------------------------------------------------------------ RL metrics


def _rl_metrics(acc: _Acc, clip: tuple[float, float]) -> RLMetrics:
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
    out.kl_k3 = float(np.sum(_exp_minus_1_minus(d, out=terms))) / n
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


def _nearest_ranks(d: np.ndarray, zeros: int, quantiles: list[tuple[int, int]]) -> list[float]:
    """Nearest-rank quantiles num/den (0/1 is the minimum) of d together with `zeros` more zeros: the k-th
    smallest with k = max(1, ceil(n * num / den)), in integers."""
    n = len(d) + zeros
    ranks = [max(1, -(-n * num // den)) for num, den in quantiles]
    below = int(np.count_nonzero(d < 0))
    zero_end = below + zeros + int(np.count_nonzero(d == 0))
    # In the sorted whole: d's negatives, then every zero, then d's positives (index shifted by `zeros`).
    where = [r - 1 if r <= below else None if r <= zero_end else r - 1 - zeros for r in ranks]
    picked = np.partition(d, sorted({i for i in where if i is not None})) if any(i is not None for i in where) else d
    return [0.0 if i is None else float(picked[i]) for i in where]


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
    terms = 2
    while 2 * top ** (terms - 1) / math.factorial(terms + 1) > 2.0**-56:
        terms += 1
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


def _seq_log_ratio_max(d: np.ndarray, prompts: list[np.ndarray], counts: list[np.ndarray]) -> float:
    """Largest |sum of d| over one prompt's RL positions (its equal rows add 0)."""
    if not len(d):
        return 0.0
    ranks, sizes = np.concatenate(prompts), np.concatenate(counts)
    starts = np.cumsum(sizes) - sizes
    new = np.flatnonzero(np.diff(ranks, prepend=-1))  # a prompt cut by a chunk boundary is one sequence
    return float(np.abs(np.add.reduceat(d, starts[new])).max())
