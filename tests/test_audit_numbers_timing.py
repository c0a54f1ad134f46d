"""Audit: the per-cell timing numbers (engines.base.Timing.as_dict, which every manifest,
summary.json, summary.md and report table reads) count the tokens the cell recorded, and give a
rate only for tokens that were timed."""

from __future__ import annotations

import numpy as np
import pytest

from repaudit import builtin
from repaudit.engines import hf
from repaudit.engines.base import Sequence, Timing


@pytest.fixture(scope="module")
def tiny():
    path = builtin.ensure("builtin:tiny-qwen3")
    return hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)


def _batch(new: list[int]) -> list[Sequence]:
    g = np.random.default_rng(3)
    return [Sequence(f"p{i}", tuple(g.integers(3, 300, 2 + 3 * i).tolist()), None, n) for i, n in enumerate(new)]


def test_a_cell_that_decodes_nothing_has_no_decode_rate(tiny):
    """max_new_tokens=1: every token comes out of the prefill, no decode step runs. The decode
    loop's bookkeeping still takes a few microseconds, which made decode_tokens_per_s 0.0: a
    "0 tok/s" decode speed in the manifest and the report for a cell that decoded nothing."""
    rows, timing = hf.generate(tiny, _batch([1, 1, 1]), topk=0)
    t = timing.as_dict()
    assert t["decode_tokens"] == 0 and t["generated_tokens"] == sum(len(r.pos) for r in rows) == 3
    assert t["decode_tokens_per_s"] is None
    assert t["generated_tokens_per_s"] == 3 / (timing.prefill_s + timing.decode_s)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_token_counts_are_the_recorded_rows_whatever_the_batching(tiny, batch_size):
    """Batches that do not divide the prompts, and rows that end at different steps: the generated
    tokens are the rows recorded, the decode tokens those not made by a prefill (one per sequence)."""
    seqs = _batch([1, 4, 2, 5, 3])
    total, rows = Timing(), []
    for i in range(0, len(seqs), batch_size):
        got, t = hf.generate(tiny, seqs[i : i + batch_size], topk=0)
        rows += got
        total.add(t)
    t = total.as_dict()
    assert t["generated_tokens"] == sum(len(r.pos) for r in rows) == 15
    assert t["decode_tokens"] == 15 - len(seqs)
    assert t["prefill_tokens"] == sum(len(s.prompt) for s in seqs)
    assert t["decode_tokens_per_s"] == t["decode_tokens"] / t["decode_s"]


@pytest.mark.parametrize("timing, key", [
    (Timing(prefill_s=0.5, prefill_tokens=10, decode_s=2e-6, decode_tokens=0, generated_tokens=3), "decode_tokens_per_s"),
    (Timing(prefill_s=0.5, prefill_tokens=0), "prefill_tokens_per_s"),
])
def test_no_rate_for_zero_tokens(timing, key):
    assert timing.as_dict()[key] is None

