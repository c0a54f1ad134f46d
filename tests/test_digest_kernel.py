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
    "test_one_launch_for_many_tensors_gives_each_the_bits_of_its_own",
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


@pytest.mark.gpu
def test_gpu_digests_of_many_tensors_replay_from_a_graph_with_their_table_filled_after_the_capture():
    """digest_many captured in a CUDA graph, its tables carved from space allocated before the
    capture and filled after it (as a traced decode step's capture does), while the capture's
    own allocations come and go around it: every replay digests the tensors' current bits, as
    digest_rows does, for both element widths."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from repaudit.record.digest_kernel import digest_many, digest_rows

    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(8, 1024, torch.bfloat16), (8, 3072, torch.bfloat16), (8, 128, torch.float32), (8, 2048, torch.float16)]
    src = [torch.randn(n, f, generator=g, device="cuda").to(dt) for n, f, dt in shapes]
    rows = torch.arange(8, device="cuda")
    offsets = [0, 3072, 0, 11]
    picks = [torch.tensor([0, 5, x.shape[1] - 1, 7], device="cuda") for x in src]
    owned = [torch.tensor([1, 0, 1, 1], device="cuda") for _ in src]
    digest_many(src, rows, offsets, picks, owned)  # built outside the capture, as the warm-up does
    torch.cuda.synchronize()
    space = torch.empty((len(src), 6), dtype=torch.int64, device="cuda")
    fill: list = []

    def table_for(host):
        table = space[sum(len(h) for _, h in fill):][:len(host)]
        fill.append((table, host))
        return table

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Tensors made and freed inside the capture before the launch: their memory is the
        # graph's, written at every replay.
        for x in src:
            torch.empty(1 << 20, device="cuda").fill_(7.0)
        xs = [x * 1 for x in src]
        answers, tables = digest_many(xs, rows, offsets, picks, owned, table_for)
    assert len(fill) == 2
    for table, host in fill:
        table.copy_(host)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for x, off, p, o, (d, s) in zip(xs, offsets, picks, owned, answers):
            want = digest_rows(x, rows, off, p, o)
            assert torch.equal(d, want[0]) and torch.equal(s, want[1])
        for x in src:  # new bits in the inputs: the next replay reads them
            x.copy_(torch.randn(x.shape, generator=g, device="cuda").to(x.dtype))
