"""tbik.tree_all_reduce against the stock all_reduce, for one decode step and one 2k-token prefill.

    torchrun --nproc_per_node=P benchmarks/allreduce.py [--iters 200] [--out FILE]

One process per GPU with NCCL when CUDA is there, else CPU processes with gloo. Messages are a
row-parallel layer's output at Qwen3-8B's hidden size 4096: [T, 4096] for T = 1, 8, 32 (decode
batch) and 2048 (prefill). Rows: the stock all_reduce in bf16 (what a TP engine sends) and in
fp32 (the tree's partials are fp32), and tree_all_reduce in fp32 by each algorithm
(tbik.allreduce.ALGORITHMS: "gather", "halving"). Before timing, every rank checks that each
algorithm gave identical bits on all ranks, equal to tbik.tree_sum of all partials. Median
latency over --iters calls; rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# NVLink multicast stays off on shared machines (NVLS can take the host's GPUs down).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tbik  # noqa: E402
from tbik.allreduce import ALGORITHMS  # noqa: E402

HIDDEN = 4096
ROWS = [("decode B=1", 1), ("decode B=8", 8), ("decode B=32", 32), ("prefill 2k", 2048)]


def timed(fn, iters: int, cuda: bool) -> float:
    """Median microseconds of one call; ranks are lined up before each call."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def check_bits(partial: torch.Tensor, world: int, algorithm: str) -> None:
    got = tbik.tree_all_reduce(partial, algorithm=algorithm)
    everyone = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(everyone, got)
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial)
    expected = tbik.tree_sum(parts)
    for r, other in enumerate(everyone):
        if not torch.equal(other.view(torch.int32), expected.view(torch.int32)):
            raise SystemExit(f"rank {r}'s tree_all_reduce ({algorithm}) differs from the pairwise tree")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", help="also write the table here (rank 0)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    rows = []
    for label, tokens in ROWS:
        partial = torch.randn(tokens, HIDDEN, generator=gen, device=device) * (rank + 1)
        half = partial.bfloat16()
        stock_bf16 = timed(lambda: dist.all_reduce(half.clone()), args.iters, cuda)
        stock_fp32 = timed(lambda: dist.all_reduce(partial.clone()), args.iters, cuda)
        trees = []
        for algorithm in ALGORITHMS:
            check_bits(partial, world, algorithm)
            trees.append(timed(lambda a=algorithm: tbik.tree_all_reduce(partial, algorithm=a), args.iters, cuda))
        rows.append((label, f"[{tokens}, {HIDDEN}]", f"{stock_bf16:.1f}", f"{stock_fp32:.1f}",
                     *(f"{t:.1f}" for t in trees), *(f"{t / stock_fp32:.2f}" for t in trees)))

    if rank == 0:
        backend = dist.get_backend()
        where = torch.cuda.get_device_name() if cuda else "CPU processes"
        head = ["message", "shape", "all_reduce bf16 us", "all_reduce fp32 us",
                *(f"tree ({a}) fp32 us" for a in ALGORITHMS), *(f"tree ({a}) / fp32 all_reduce" for a in ALGORITHMS)]
        lines = [f"P={world}, backend {backend}, {where}, torch {torch.__version__}; median of {args.iters} calls "
                 "(each includes a .clone() of the message for the stock all_reduce, which works in place); "
                 "tree_all_reduce bits (each algorithm) identical on every rank and equal to tbik.tree_sum: checked", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
