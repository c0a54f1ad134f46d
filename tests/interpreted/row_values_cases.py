"""The cases of tests/test_row_values.py that run the Triton kernels, in a process of their own
with Triton's CPU interpreter on from the start (see digest_kernel_cases.py for why).

    TRITON_INTERPRET=1 python tests/interpreted/row_values_cases.py CASE
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (tests/test_row_values.py does)"

import torch  # noqa: E402
from tbik.tl import interpret as _interpret  # noqa: E402

from repaudit.engines import row_values_kernel as kernel  # noqa: E402
from repaudit.engines.row_values import reference_topk, row_values, top_ids  # noqa: E402
from repaudit.record.digest import row_digest  # noqa: E402

_interpret.apply()


def _rows(n, vocab, seed):
    """Logprob-like rows with many ties (values from a small set), the specials, and ties that
    straddle segment boundaries."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 40, (n, vocab), generator=g).float() / 8
    lp[0, :5] = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), 0.0])
    lp[1, ::997] = -0.0  # the row's maximum, tied across every segment
    logits = lp + torch.randn(n, vocab, generator=g)
    return logits, lp


def _same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        a, b = got[name], want[name]
        if a.is_floating_point():
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), name


def test_kernel_values_are_the_reference_values():
    kernel.SEGMENT = 1024  # several segments per row at a size the interpreter runs quickly
    for vocab, topk in ((3000, 5), (1024, 1), (2500, 0), (700, 7), (3000, 32)):
        logits, lp = _rows(4, vocab, vocab + topk)
        targets = torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(1))
        got = kernel.row_values_gpu(logits, lp, targets, topk)
        _same(got, row_values(logits, lp, targets, topk))


def test_segments_below_the_rows_threshold_are_skipped_rightly():
    """The candidate kernel skips a segment whose largest key is under the K-th largest of the
    segments' largest keys: top-k lists all in one segment, in a segment's last columns, across
    segments whose maxima tie the threshold, and rows with fewer segments than k."""
    kernel.SEGMENT = 1024
    vocab = 5000
    g = torch.Generator().manual_seed(9)
    lp = -torch.rand(6, vocab, generator=g) * 10 - 5
    lp[0, 2048:2055] = torch.arange(7.0) * -0.5  # row 0: the top 7 in segment 2
    lp[1, 1017:1024] = torch.arange(7.0) * -0.5  # row 1: in segment 0's last columns
    lp[2, ::1024] = -1.0  # row 2: every segment's maximum is -1.0, ties everywhere
    lp[2, 3000] = -1.0
    lp[3, 4999] = 0.0  # row 3: the maximum in the last, short segment
    lp[4, [5, 1500, 2600, 4000]] = torch.tensor([-2.0, -2.0, -3.0, -2.0])  # row 4: ties between segments' maxima
    lp[5, :] = float("-inf")  # row 5: every key equal
    logits = lp + 1.0
    targets = torch.arange(6)
    for topk in (1, 3, 5, 7, 32):
        _same(kernel.row_values_gpu(logits, lp, targets, topk), row_values(logits, lp, targets, topk))
    small = lp[:, :1500]  # two segments, fewer than k
    _same(kernel.row_values_gpu(small + 1.0, small, targets, 7), row_values(small + 1.0, small, targets, 7))


def test_a_list_longer_than_the_kernels_is_refused():
    logits, lp = _rows(2, 100, 3)
    try:
        kernel.row_values_gpu(logits, lp, torch.tensor([0, 5]), kernel.MAX_K + 1)
    except ValueError:
        return
    raise AssertionError("a top-k longer than MAX_K was not refused")


def test_digests_of_16_bit_and_strided_rows():
    kernel.SEGMENT = 1024
    logits, lp = _rows(3, 2100, 4)
    wide = torch.zeros(3, 2200)
    wide[:, :2100] = lp
    targets = torch.tensor([1, 2, 3])
    for x in (logits.bfloat16(), logits.half()):
        got = kernel.row_values_gpu(x, wide[:, :2100], targets, 5)
        assert torch.equal(got["digest"], row_digest(x))
        assert torch.equal(got["topk_ids"], reference_topk(lp, 5)[1])


def test_widen_casts_and_takes_the_digest_partials():
    """widen_gpu's fp32 rows are .float()'s, and row_values from its digest partials gives the
    values row_values takes of the fp32 rows itself: strided 16-bit rows, a short last segment,
    row counts on both sides of a multiple of WIDEN_ROWS. (No subnormals here: the interpreter's
    bf16 conversion flushes them; the GPU test takes every 16-bit pattern.)"""
    kernel.SEGMENT = 1024
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1, 5, 8):
            wide = (torch.randn(n, 2600, generator=g) * 8).to(dtype)
            wide[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 65504.0])
            raw = wide[:, :2500]
            out = torch.full((n, 2500), 7.0)
            parts = kernel.digest_parts(n, 2500, raw.device)
            kernel.widen_gpu(raw, out, parts)
            assert torch.equal(out.view(torch.int32), raw.float().view(torch.int32))
            lp = torch.log_softmax(out, -1)
            targets = torch.randint(0, 2500, (n,), generator=g)
            _same(kernel.row_values_gpu(out, lp, targets, 5, parts), row_values(raw.float(), lp, targets, 5))


def test_top_ids_are_the_references_ids():
    """The capture's top-k ids of 16-bit and fp32 logits: the reference's ids on the widened rows,
    after each row's own id, for ties within and across segments, NaN, -inf, -0.0, strided rows,
    a short last segment, lists as long as a segment's live columns and a list of MAX_K."""
    kernel.SEGMENT = 1024
    for vocab, k in ((3000, 5), (1024, 1), (700, 7), (2100, kernel.MAX_K), (1030, 7)):
        logits, _ = _rows(4, vocab, vocab + k)
        logits[2, ::997] = 9.0  # the row's maximum, tied across segments
        logits[3, -6:] = float("inf")  # in the short last segment
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = logits.to(dtype)
            first = torch.arange(4, dtype=torch.int32).view(4, 1) * 3
            want = torch.cat((first.long(), reference_topk(x.float(), k)[1]), dim=1)
            assert torch.equal(kernel.top_ids_gpu(x, first, k), want), (vocab, k, dtype)
    wide = torch.randn(3, 2600, generator=torch.Generator().manual_seed(5)).bfloat16()
    first = torch.tensor([[1], [2], [3]])
    assert torch.equal(kernel.top_ids_gpu(wide[:, :2500], first, 6), top_ids(wide[:, :2500].float(), first, 6))
    for bad in (0, kernel.MAX_K + 1):
        try:
            kernel.top_ids_gpu(wide, first, bad)
        except ValueError:
            continue
        raise AssertionError(f"a top-{bad} list was not refused")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
