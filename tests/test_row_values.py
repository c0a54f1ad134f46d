"""The values a record keeps of a logits row (repaudit/engines/row_values.py): the defined top-k
against an independent NumPy ordering, and the GPU kernels against the torch reference under
Triton's CPU interpreter (tests/interpreted/row_values_cases.py), bit for bit."""

from pathlib import Path

import numpy as np
import pytest
import torch

from repaudit.engines.row_values import reference_topk, row_values
from repaudit.record.digest import row_digest

CASES = Path(__file__).parent / "interpreted" / "row_values_cases.py"


def _numpy_topk(lp: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values per row by a sort: NaN first, then value descending
    (-0.0 == +0.0 in float comparison), then id ascending."""
    out = []
    for row in lp.astype(np.float64):
        ids = np.arange(len(row))
        nan = np.isnan(row)
        order = np.lexsort((ids, -np.where(nan, 0.0, row), ~nan))
        out.append(order[:k])
    return np.array(out)


def _tied_rows(seed: int, n: int = 6, vocab: int = 500) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 12, (n, vocab), generator=g).float() / 4  # a dozen values: ties everywhere
    lp[0, [3, 9]] = torch.tensor([-0.0, 0.0])
    lp[1, [7, 400]] = float("nan")
    lp[2, :] = float("-inf")
    lp[2, [450, 20]] = -1.0
    return lp


@pytest.mark.parametrize("k", [1, 5, 17])
def test_the_top_k_is_the_largest_values_ties_by_lowest_id(k):
    for seed in range(3):
        lp = _tied_rows(seed)
        values, ids = reference_topk(lp, k)
        want = _numpy_topk(lp.numpy(), k)
        assert np.array_equal(ids.numpy(), want)
        assert np.array_equal(values.numpy().view(np.int32), np.take_along_axis(lp.numpy(), want, 1).view(np.int32))


def test_top1_is_torch_argmax_and_the_lists_first_entry():
    lp = _tied_rows(5)
    lp[1] = torch.nan_to_num(lp[1], nan=-3.0)  # torch.argmax's NaN rule is not what this checks
    got = row_values(lp.clone(), lp, torch.zeros(6, dtype=torch.long), 5)
    assert torch.equal(got["top1"], lp.argmax(dim=-1))
    assert torch.equal(got["top1"], got["topk_ids"][:, 0])


def test_a_nan_is_above_every_number_and_minus_zero_ties_plus_zero():
    lp = torch.tensor([[-1.0, float("nan"), 0.0, float("nan")], [-0.0, 0.0, -1.0, -0.0]])
    values, ids = reference_topk(lp, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 3]]
    assert values[1].view(torch.int32).tolist() == lp[1, [0, 1, 3]].view(torch.int32).tolist()  # the signs kept


def test_row_values_record_the_tokens_logprob_and_the_logits_digest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g)
    lp = torch.log_softmax(logits, -1)
    targets = torch.tensor([0, 299, 17, 17])
    got = row_values(logits, lp, targets, 0)
    assert set(got) == {"logprob", "top1", "digest"}
    assert torch.equal(got["logprob"], lp[torch.arange(4), targets])
    assert torch.equal(got["digest"], row_digest(logits))


def test_bad_requests_are_refused():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        row_values(lp, lp, torch.zeros(2, dtype=torch.long), 4)
    with pytest.raises(TypeError):
        row_values(lp, lp.double(), torch.zeros(2, dtype=torch.long), 1)


@pytest.mark.parametrize("case", [
    "test_kernel_values_are_the_reference_values",
    "test_segments_below_the_rows_threshold_are_skipped_rightly",
    "test_a_list_longer_than_the_kernels_is_refused",
    "test_digests_of_16_bit_and_strided_rows",
    "test_widen_casts_and_takes_the_digest_partials",
    "test_top_ids_are_the_references_ids",
])
def test_row_values_kernels_under_the_interpreter(case, interpreted_case):
    proc = interpreted_case(CASES, case)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,vocab,topk", [(1, 151936, 5), (32, 151936, 5), (300, 32000, 20), (7, 5000, 0), (3, 9000, 40)])
def test_the_gpu_kernels_give_the_references_bits(n, vocab, topk):
    g = torch.Generator().manual_seed(n + vocab)
    logits = (torch.randn(n, vocab, generator=g) * 4).bfloat16().float()  # bf16 logits: ties at every rank
    logits[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    lp = torch.log_softmax(logits, -1)
    targets = torch.randint(0, vocab, (n,), generator=g)
    want = row_values(logits, lp, targets, topk)
    got = row_values(logits.cuda(), lp.cuda(), targets.cuda(), topk)
    assert got.keys() == want.keys()
    for name, w in want.items():
        a = got[name].cpu()
        assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                           w.view(torch.int32) if w.is_floating_point() else w), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widen_gives_float_bits_on_every_16_bit_pattern_on_a_gpu(dtype):
    """The cast that takes the digest on its way writes torch's .float() bits for all 65,536
    patterns (NaN payloads, subnormals, -0 included), and the values made from its digest
    partials are those made from the fp32 rows: also for strided rows of an odd width."""
    from repaudit.engines.row_values import widen, widen_parts

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).view(16, 4096)
    wide = torch.randn(7, 1100, generator=torch.Generator().manual_seed(2)).to(dtype)
    for raw in (every.cuda(), wide[:, :1001].cuda()):
        out = torch.empty(raw.shape, dtype=torch.float32, device="cuda")
        parts = widen_parts(raw)
        assert parts is not None
        widen(raw, out, parts)
        want = raw.float()
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
        lp = torch.log_softmax(want, -1)
        targets = torch.arange(raw.shape[0], device="cuda")
        got = row_values(out, lp, targets, 5, parts)
        ref = row_values(want.cpu(), lp.cpu(), targets.cpu(), 5)
        for name, w in ref.items():
            a = got[name].cpu()
            assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                               w.view(torch.int32) if w.is_floating_point() else w), name


def test_canonical_order_is_the_row_values_order():
    """Lists from any engine are put in row_values' order: a NaN first, -0.0 tied with +0.0."""
    from repaudit.engines.base import canonical_topk

    lp = torch.tensor([[-1.0, float("nan"), 0.0, -0.0, -3.0, float("nan")]])
    values, ids = reference_topk(lp, 6)
    shuffled = np.array([[4, 0, 3, 5, 2, 1]])
    got_ids, got_lps = canonical_topk(shuffled, lp.numpy()[0][shuffled])
    assert got_ids.tolist() == ids.tolist() == [[1, 5, 2, 3, 0, 4]]
    assert np.array_equal(got_lps.view(np.int32), values.numpy().view(np.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,vocab,k,dtype", [(1, 151936, 6, torch.bfloat16), (256, 151936, 6, torch.bfloat16),
                                             (32, 151936, 32, torch.float16), (5, 32000, 21, torch.float32),
                                             (16, 4096, 32, "every")])
def test_top_ids_give_the_references_ids_on_a_gpu(n, vocab, k, dtype):
    """The vLLM capture's top-k ids of a step's logits: the reference's, after each row's own id.
    bf16 rows of random logits tie at every rank; "every" is the 65,536 bf16 patterns, NaNs and
    -0.0 among them."""
    from repaudit.engines.row_values import top_ids

    g = torch.Generator().manual_seed(n + k)
    if dtype == "every":
        logits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(n, vocab)
    else:
        logits = (torch.randn(n, vocab, generator=g) * 4).to(dtype)
        logits[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    first = torch.randint(0, vocab, (n, 1), generator=g, dtype=torch.int32)
    want = torch.cat((first.long(), reference_topk(logits.float(), k)[1]), dim=1)
    got = top_ids(logits.cuda(), first.cuda(), k)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
