"""tbik tree_sum and tree_all_reduce on CPU: gloo process groups of 2 and 4, bitwise."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tbik
from tbik.tl.allreduce import tree_sum as tree_sum_triton

pytestmark = pytest.mark.usefixtures("triton_interpreter")

M, K, N = 3, 512, 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operands():
    g = torch.Generator().manual_seed(0)
    return torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()


def worker(rank: int, world: int, port: int, results) -> None:
    tbik.use_interpreter()  # a spawned process starts with tbik's defaults: CPU tensors on the torch backend
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, w = operands()
        shard = K // world
        partial = tbik.matmul_partial(x[:, rank * shard:(rank + 1) * shard], w.t()[rank * shard:(rank + 1) * shard],
                                      tp_size=world)
        noise = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 10.0 ** rank
        results[rank] = (tbik.tree_all_reduce(partial), tbik.tree_all_reduce(noise))
    finally:
        dist.destroy_process_group()


def bad_world_worker(rank: int, world: int, port: int, results) -> None:
    tbik.use_interpreter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tbik.tree_all_reduce(torch.ones(4))
    except ValueError as err:
        results[rank] = str(err)
    finally:
        dist.destroy_process_group()


def spawn(fn, world):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(fn, args=(world, free_port(), results), nprocs=world, join=True)
        return dict(results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tree_all_reduce_gloo_identical_bits_on_every_rank(world):
    results = spawn(worker, world)
    x, w = operands()
    expected = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
    noise = tbik.tree_sum([torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10.0**r
                           for r in range(world)])
    for rank in range(world):
        got, got_noise = results[rank]
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        assert torch.equal(got_noise.view(torch.int32), noise.view(torch.int32))


@pytest.mark.slow
def test_tree_all_reduce_rejects_non_power_of_two_groups():
    results = spawn(bad_world_worker, 3)
    assert len(results) == 3 and all("power of two" in msg for msg in results.values())


def test_tree_sum_order_and_forms():
    parts = [torch.randn(257, generator=torch.Generator().manual_seed(r)) * 10.0**r for r in range(8)]
    expected = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]))
    assert torch.equal(tbik.tree_sum(parts).view(torch.int32), expected.view(torch.int32))
    assert torch.equal(tbik.tree_sum(torch.stack(parts)).view(torch.int32), expected.view(torch.int32))
    single = tbik.tree_sum(parts[:1])
    assert torch.equal(single, parts[0]) and single is not parts[0]
    with pytest.raises(ValueError, match="power of two"):
        tbik.tree_sum(parts[:3])


def test_tree_sum_refuses_partials_that_torch_would_broadcast_or_promote():
    with pytest.raises(ValueError, match="shape"):
        tbik.tree_sum([torch.ones(2, 3), torch.ones(3)])
    with pytest.raises(TypeError, match="dtype"):
        tbik.tree_sum([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="0-d"):
        tbik.tree_sum(torch.tensor(1.0))


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_fused_tree_sum_kernel_matches_torch_adds(p):
    # The CUDA path (one Triton kernel over the gathered buffer), run by the interpreter.
    scales = torch.logspace(0, 6, p)[:, None, None]
    stacked = torch.randn(p, 3, 700, generator=torch.Generator().manual_seed(p)) * scales
    assert torch.equal(tree_sum_triton(stacked).view(torch.int32), tbik.tree_sum(list(stacked)).view(torch.int32))


SIZES = (1000, 3, 1)  # a message shorter than the group too: the halving pads it to P chunks


def partial_of(rank: int, n: int) -> torch.Tensor:
    # Magnitudes 1 to 1000 apart: a sum in any other order than the tree's would round differently.
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n)) * 10.0 ** (rank % 4)


def algorithms_worker(rank: int, world: int, port: int, results) -> None:
    tbik.use_interpreter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        got = {(algorithm, n): tbik.tree_all_reduce(partial_of(rank, n).reshape(n, 1), algorithm=algorithm)
               for algorithm in _algorithms(world) for n in SIZES}
        if world != 2:
            try:
                tbik.tree_all_reduce(partial_of(rank, 3), algorithm="pair")
            except ValueError as err:
                got["pair refused"] = str(err)
        results[rank] = got
    finally:
        dist.destroy_process_group()


def _algorithms(world: int) -> tuple[str, ...]:
    return ("gather", "halving", "auto") + (("pair",) if world == 2 else ())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_tree_all_reduce_algorithm_gives_the_tree_sums_bits_on_every_rank(world):
    """The recursive halving (the bandwidth-optimal algorithm for TP=4 and 8), the gather and, at
    P=2, the collective's own sum (one addition of two partials: no order to choose) give the
    same bits: those of tbik.tree_sum over the partials in rank order, on every rank."""
    results = spawn(algorithms_worker, world)
    for n in SIZES:
        expected = tbik.tree_sum([partial_of(r, n) for r in range(world)]).view(torch.int32)
        flat = torch.stack([partial_of(r, n) for r in range(world)]).sum(0).view(torch.int32)
        for rank in range(world):
            if world != 2:
                assert "adds two partials" in results[rank]["pair refused"]
            for algorithm in _algorithms(world):
                got = results[rank][(algorithm, n)]
                assert got.shape == (n, 1)
                assert torch.equal(got.reshape(-1).view(torch.int32), expected), f"{algorithm}, P={world}, n={n}, rank {rank}"
        if n == 1000 and world > 2:  # the tree's order is not torch's: the test can tell them apart
            assert not torch.equal(flat, expected)


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown tree all-reduce algorithm 'ring'"):
        tbik.tree_all_reduce(torch.ones(2), algorithm="ring")
