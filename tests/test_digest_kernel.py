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
    "test_one_flipped_bit_changes_the_kernel_digest",
])
def test_digest_kernel_under_the_interpreter(case, interpreted_case):
    proc = interpreted_case(CASES, case)
    assert proc.returncode == 0, proc.stderr[-3000:]
