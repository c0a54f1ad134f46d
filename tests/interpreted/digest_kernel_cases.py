"""The cases of tests/test_digest_kernel.py, run in a process of their own with Triton's CPU
interpreter on from the start: TRITON_INTERPRET must be set before triton is first imported,
and torch imports triton, so a pytest process that has imported torch cannot switch to it.

    TRITON_INTERPRET=1 python tests/interpreted/digest_kernel_cases.py CASE
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (tests/test_digest_kernel.py does)"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tbik.tl import interpret as _interpret  # noqa: E402

from repaudit.record.digest import numpy_row_digest, row_digest  # noqa: E402
from repaudit.record.digest_kernel import digest_many, digest_rows  # noqa: E402

_interpret.apply()  # NumPy 2.4 vs the interpreter's loop bounds


def _rows(dtype, n=6, f=1500, seed=0):
    x = torch.randn(n, f, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    return x.to(dtype)


def test_kernel_digest_equals_torch_digest():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _rows(dtype)
        got, _ = digest_rows(x)
        assert torch.equal(got, row_digest(x))
        if dtype == torch.float32:
            assert np.array_equal(got.numpy().view(np.uint64), numpy_row_digest(x.numpy()))


def test_kernel_reads_only_the_rows_asked_for_and_shard_offsets_add_up():
    x = _rows(torch.bfloat16, n=9, f=1000)
    rows = torch.tensor([7, 2, 2, 0])
    got, _ = digest_rows(x, rows)
    assert torch.equal(got, row_digest(x[rows]))
    # two column shards digested with their offsets sum (mod 2^64) to the whole row's digest
    left, _ = digest_rows(x[:, :600], rows, 0)
    right, _ = digest_rows(x[:, 600:].contiguous(), rows, 600)
    assert torch.equal(left + right, got)


def test_rows_taken_four_to_a_program_give_the_same_bits():
    """The layout the tracer uses for a prefill's thousands of rows, forced onto a few: a row
    count that is not a multiple of four, rows out of order and repeated, a shard offset."""
    x = _rows(torch.bfloat16, n=9, f=700)
    rows = torch.tensor([7, 2, 2, 0, 8, 5, 1])
    pick = torch.tensor([0, 3, 50, 699, 7, 8, 9, 10])
    owned = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1])
    one = digest_rows(x, rows, 300, pick, owned, per_program=1)
    four = digest_rows(x, rows, 300, pick, owned, per_program=4)
    assert torch.equal(four[0], row_digest(x[rows], offset=300))
    assert torch.equal(four[0], one[0]) and torch.equal(four[1], one[1])
    assert torch.equal(four[1], (x[rows][:, pick].view(torch.int16).to(torch.int64) & 0xFFFF).to(torch.int32) * owned)
    left = x[:, :600]  # rows 700 apart in memory: a column shard's view
    assert torch.equal(digest_rows(left, rows, 0, per_program=4)[0], row_digest(x[rows][:, :600]))


def test_kernel_samples_are_the_bits_of_the_picked_features():
    x = _rows(torch.float32, n=5, f=300)
    rows = torch.tensor([4, 1])
    pick = torch.tensor([0, 3, 50, 299, 7, 8, 9, 10])
    owned = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1])
    _, samples = digest_rows(x, rows, 0, pick, owned)
    want = x[rows][:, pick].view(torch.int32) * owned
    assert samples.dtype == torch.int32 and torch.equal(samples, want)


def test_one_flipped_bit_changes_the_kernel_digest():
    x = _rows(torch.float32, n=1, f=2049)
    y = x.clone()
    y.view(torch.int32)[0, 2048] ^= 1
    assert digest_rows(x)[0].item() != digest_rows(y)[0].item()



def test_one_launch_for_many_tensors_gives_each_the_bits_of_its_own():
    """digest_many over tensors of three dtypes (two element widths: two tables), one of them a
    column slice of a wider tensor (a row stride that is not its width), one narrower than a
    block, with shard offsets and sampled features: each answer is digest_rows' for that tensor."""
    wide = _rows(torch.bfloat16, n=9, f=2000, seed=1)
    xs = [_rows(torch.float32, n=9, f=1500), wide[:, 300:1000], _rows(torch.float16, n=9, f=40, seed=2),
          _rows(torch.bfloat16, n=9, f=3000, seed=3)]
    offsets = [0, 700, 40, 0]
    picks = [torch.tensor([0, 3, 50, 1499]), torch.tensor([0, 1, 2, 699]), torch.tensor([39, 0, 5, 7]),
             torch.tensor([2999, 1024, 1023, 0])]
    owned = [torch.tensor([1, 1, 0, 1]), torch.tensor([1, 0, 1, 1]), torch.tensor([1, 1, 1, 1]),
             torch.tensor([0, 1, 1, 1])]
    rows = torch.tensor([7, 2, 2, 0, 8])
    answers, tables = digest_many(xs, rows, offsets, picks, owned)
    assert len(tables) == 2
    for x, off, p, o, (d, s) in zip(xs, offsets, picks, owned, answers):
        want = digest_rows(x, rows, off, p, o)
        assert torch.equal(d, want[0]) and torch.equal(s, want[1])
        assert torch.equal(d, row_digest(x[rows], offset=off))


if __name__ == "__main__":
    globals()[sys.argv[1]]()
