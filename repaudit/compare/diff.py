"""Diff two token records: align on (prompt_id, pos), compare bit patterns, decide a verdict.

Both records are in canonical order, so alignment is a streaming merge over the int64 key
(prompt rank << 32 | pos); memory is bounded by the batch size, not the file size, except for
what exact percentiles keep of the rows whose bits differ (ULP distances above 2**16, and the
RL metrics' d: 8 bytes a row).

Speed: one thread per file reads its batches (Arrow decodes without the GIL) and validates them
while the caller compares the previous ones. Arrow assembles a list column about 10 times slower
than it reads a flat one, so the top-k lists are read from their Parquet pages directly where their
layout allows (`pages.direct_topk`; Arrow reads any other layout). When both files cut their batches at the same rows, which is the usual case,
a batch pair is recognised as aligned per prompt run and compared column against column with no
key at all. Only rows whose logprob bits differ go on to the ULP, |a - b|, probability and RL
statistics. The hot path writes into reused work arrays (`work.Work`), since fresh memory costs a
page fault per page, and reads Arrow buffers as numpy views (`chunks._values`; Array.to_numpy would
import pandas).

A row's logprob is only comparable when both sides scored the same token after the same
context. In a prompt, the first position where the tokens differ (or where one side has a
row the other lacks, once both have begun) is that prompt's *token divergence*; rows before it are comparable,
the row at it still shares its context (so its distribution digest, top-1 and top-k are
compared), rows after it are counted but not compared. In score mode tokens never differ,
so every row is compared; in generate mode, comparison stops where greedy decoding forked.
A prompt row (phase "prompt") before the other side's first row of a prompt does not end its
shared prefix: a generate record starts at the prompt's end, so a trainer's score record
(prompt and completion) and a rollout's generate record compare on the completion. A
completion row the other side lacks ends it wherever it is.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import IncomparableRecords, InputError
from ..record.fingerprint import differences as env_differences
from ..record.io import RecordMeta, open_record
from .accumulate import Accumulator, note_first, percentile
from .chunks import Chunk, prefetched, read_chunks, same_keys
from .result import (DEFAULT_CLIP, NO_DIVERGENCE, DiffResult, PromptDiff, Thresholds, cell_differences, comparability,
                     one_sided_gap)
from .rl import rl_metrics

# ------------------------------------------------------------------------------------ the merge


def _align(acc: Accumulator, a: Chunk, b: Chunk) -> None:
    # Every row of either side up to these chunks' last key is here or was before, so the first
    # positions below are final for any row that unmatched() weighs.
    note_first(acc.first_a, a)
    note_first(acc.first_b, b)
    if same_keys(a, b):
        acc.matched_rows(a, b)
        return
    ka, kb = a.key, b.key
    ia = np.searchsorted(kb, ka)
    ia_clip = np.minimum(ia, max(len(b) - 1, 0))
    hit = (ia < len(b)) & (kb[ia_clip] == ka) if len(b) else np.zeros(len(a), dtype=bool)
    hit_b = np.zeros(len(b), dtype=bool)
    hit_b[ia[hit]] = True
    acc.unmatched(ka[~hit], acc.first_b, a.prompt_rows(~hit))
    acc.unmatched(kb[~hit_b], acc.first_a, b.prompt_rows(~hit_b))
    acc.matched_rows(a.take(hit), b.take(ia[hit]))


_EMPTY = Chunk(np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.uint32),
                None, None, np.empty(0, np.int32), np.empty((0, 0), np.int32), np.empty((0, 0), np.uint32), None,
                key=np.empty(0, np.int64))


def _merge(acc: Accumulator, sa: Iterator[Chunk], sb: Iterator[Chunk]) -> None:
    buf_a, buf_b = _EMPTY, _EMPTY
    done_a = done_b = False
    while True:
        if not done_a and not len(buf_a):
            nxt = next(sa, None)
            done_a = nxt is None
            buf_a = _EMPTY if done_a else nxt
            acc.digest_rows_a += _digests_held(buf_a)
        if not done_b and not len(buf_b):
            nxt = next(sb, None)
            done_b = nxt is None
            buf_b = _EMPTY if done_b else nxt
            acc.digest_rows_b += _digests_held(buf_b)
        if not len(buf_a) and not len(buf_b) and done_a and done_b:
            return
        if same_keys(buf_a, buf_b):  # the usual case: both files cut into batches at the same rows
            note_first(acc.first_a, buf_a)
            note_first(acc.first_b, buf_b)
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


def _digests_held(c: Chunk) -> int:
    """Rows of a chunk as read from its file (matched or not) that hold a row digest."""
    if c.digest is None:
        return 0
    return len(c) if c.digest_ok is None else int(np.count_nonzero(c.digest_ok))


def _fix_digest(c: Chunk, other: Chunk) -> Chunk:
    # A chunk from a file with digests in some batches and not others: treat the absent ones as invalid.
    if c.digest is None and other.digest is not None:
        return Chunk(c.rank, c.pos, c.token, c.bits, np.zeros(len(c), np.uint64), np.zeros(len(c), bool), c.top1,
                      c.topk_ids, c.topk_bits, c.topk_len, c.phase, c.prompt_phase, bounds=c._bounds, key=c._key)
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
        raise IncomparableRecords(f"cannot compare {path_a} with {path_b}: {'; '.join(problems)}; "
                                  "--allow-partial compares the prompts they share")

    union = sorted(set(meta_a.prompts) | set(meta_b.prompts))
    rank_of = {p: i for i, p in enumerate(union)}
    acc = Accumulator(len(union))
    _merge(
        acc,
        prefetched(read_chunks(pf_a, path_a, rank_of, acc.rows_a, batch_rows, _has_prompt_rows(meta_a)), path_a),
        prefetched(read_chunks(pf_b, path_b, rank_of, acc.rows_b, batch_rows, _has_prompt_rows(meta_b)), path_b),
    )
    result = _finish(acc, meta_a, meta_b, union, thresholds, clip)
    result.refusals = problems
    return result


def _has_prompt_rows(meta: RecordMeta) -> bool:
    """Whether a record may hold prompt rows: its footer's phase list says, else assume it may."""
    return meta.phases is None or "prompt" in meta.phases


def _finish(acc: Accumulator, a: RecordMeta, b: RecordMeta, union: list[str], th: Thresholds,
            clip: tuple[float, float]) -> DiffResult:
    in_a, in_b = set(a.prompts), set(b.prompts)
    prompts = []
    for i, pid in enumerate(union):
        tdiv, bdiv = int(acc.token_div[i]), int(acc.bits_div[i])
        if pid not in in_a or pid not in in_b:
            # The merge saw this prompt's rows as unmatched and gave it the position of its first completion
            # row (or none, if all were prompt rows): no fork of two sequences, since there is one.
            tdiv = NO_DIVERGENCE
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
        ulp_p50=percentile(acc, numeric, 1, 2), ulp_p99=percentile(acc, numeric, 99, 100),
        abs_max=acc.abs_max, abs_mean=acc.abs_total.mean(numeric), prob_max=acc.prob_max,
        digest_compared=acc.digest_compared, digest_equal=acc.digest_equal,
        digest_only_a=acc.digest_only_a, digest_only_b=acc.digest_only_b,
        digest_rows_a=acc.digest_rows_a, digest_rows_b=acc.digest_rows_b,
        top1_compared=acc.top1_compared, top1_equal=acc.top1_equal,
        top1_only_a=acc.top1_only_a, top1_only_b=acc.top1_only_b,
        topk_compared=acc.topk_compared, topk_ids_equal=acc.topk_ids_equal,
        topk_logprobs_equal=acc.topk_logprobs_equal, topk_only_a=acc.topk_only_a, topk_only_b=acc.topk_only_b,
        rl=rl_metrics(acc, clip),
        prompts=prompts,
        env_differences=env_differences(a.env, b.env),
        cell_differences=cell_differences(a.cell, b.cell),
    )
    r.passed, r.reasons = verdict(r, th)
    return r


_CANNOT = {"row digests": "cannot prove the distributions equal", "top-1 ids": "cannot compare the most likely tokens",
           "top-k lists": "cannot compare the top-k"}


def _one_sided(r: DiffResult) -> list[str]:
    out = []
    for what, compared, only_a, only_b in r.coverage:
        if not one_sided_gap(what, compared, only_a, only_b, r.digest_rows):
            continue
        for side, other, n, n_other in (("A", "B", only_a, only_b), ("B", "A", only_b, only_a)):
            if not n:
                continue
            # Row digests count here only when the other record holds some elsewhere (one_sided_gap),
            # so they are never "none".
            if compared or n_other or what == "row digests":
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
    # Exactly, against the decimal the threshold reads as (its shortest repr): 1 of 3 is above
    # 0.3333333333333333, and 7 of 10 is not above 0.7 (whose double is a little below 7/10).
    if shared and Fraction(len(diverged), len(shared)) > Fraction(repr(th.max_seq_divergence)):
        # The earliest fork, as the divergence tables and the report's tile name it: the first prompt
        # in id order could fork much later than another.
        first = min(diverged, key=lambda p: p.first_token_divergence)
        reasons.append(
            f"{len(diverged)} of {len(shared)} sequences differ in tokens or length "
            f"(first: {first.prompt_id!r} at pos {first.first_token_divergence})"
        )
    return (not reasons), reasons
