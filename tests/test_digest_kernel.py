"""The Triton row digest (used on GPUs) gives the same bits as the torch and NumPy digests.

Runs in Triton's CPU interpreter, in a process of its own per case (see
tests/interpreted/digest_kernel_cases.py for why); GPU runs use the same kernel.
"""

from pathlib import Path

import pytest

CASES = Path(__file__).parent / "interpreted" / "digest_kernel_cases.py"


@pytest.mark.parametrize("case", [
    "test_kernel_digest_equals_torch_digest",
    "test_kernel_reads_only_the_rows_asked_for_and_shard_offsets_add_up",
    "test_kernel_samples_are_the_bits_of_the_picked_features",
    "test_rows_taken_four_to_a_program_give_the_same_bits",
    "test_one_flipped_bit_changes_the_kernel_digest",
])
def test_digest_kernel_under_the_interpreter(case, interpreted_case):
    proc = interpreted_case(CASES, case)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_digests_and_samples_are_the_torch_ones(dtype):
    """On a GPU, through the cached launch the tracer's hooks use: the digests of the rows asked
    for (repeated, out of order, a shard offset) and the picked features' bits, against torch
    on the CPU; twice, so the second call takes the cached handle."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from repaudit.record.digest import row_digest
    from repaudit.record.digest_kernel import digest_rows

    x = (torch.randn(9, 1500, generator=torch.Generator().manual_seed(4)) * 3).to(getattr(torch, dtype))
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    rows, pick, owned = torch.tensor([7, 2, 2, 0]), torch.tensor([0, 3, 999, 1499]), torch.tensor([1, 1, 0, 1])
    bits = {torch.float32: (torch.int32, 0xFFFFFFFF)}.get(x.dtype, (torch.int16, 0xFFFF))
    want_samples = ((x[rows][:, pick].view(bits[0]).to(torch.int64) & bits[1]) * owned).to(torch.int32)
    for per_program in (None, None, 4):  # the second call takes the cached handle
        got, samples = digest_rows(x.cuda(), rows.cuda(), 300, pick.cuda(), owned.cuda(), per_program)
        assert torch.equal(got.cpu(), row_digest(x[rows], offset=300))
        assert torch.equal(samples.cpu(), want_samples)
