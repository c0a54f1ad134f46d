"""tbik.tree_all_reduce against the stock all_reduce, for one decode step and one 2k-token prefill.

    torchrun --nproc_per_node=P benchmarks/allreduce.py [--iters 200] [--out FILE]

One process per GPU with NCCL when CUDA is there, else CPU processes with gloo. Messages are a
row-parallel layer's output at Qwen3-8B's hidden size 4096: [T, 4096] for T = 1, 8, 32 (decode
batch) and 2048 (prefill). Rows: the stock all_reduce in bf16 (what a TP engine sends) and in
fp32 (the tree's partials are fp32), and tree_all_reduce in fp32 by each algorithm
(tbik.allreduce.ALGORITHMS: "gather", "halving", and "pair" at P=2). Before timing, every rank checks that each
algorithm gave identical bits on all ranks, equal to tbik.tree_sum of all partials.

Two timings per row, median over --iters: "eager" (one call launched from Python, ranks lined up
before it) and, on GPUs, "graph" (GRAPH_CALLS calls captured in one CUDA graph and replayed,
per call: what a decode step replayed from a graph pays, launch overheads gone). Rank 0 prints
a Markdown table and, with --json, writes the rows (`device`, `P`, `message`, `shape`, `timing`,
`all_reduce_bf16_us`, `all_reduce_fp32_us` (torch.distributed.all_reduce: NCCL on GPUs), `tree_<algorithm>_us`, `ratio_<algorithm>` = tree / all_reduce fp32)
into FILE, replacing that file's rows of the same device and P.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# NVLink multicast stays off on shared machines (NVLS can take the host's GPUs down).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tbik  # noqa: E402
from tbik.allreduce import ALGORITHMS  # noqa: E402

HIDDEN = 4096
ROWS = [("decode B=1", 1), ("decode B=8", 8), ("decode B=32", 32), ("prefill 2k", 2048)]
GRAPH_CALLS = 20


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


def graphed(fn, calls: int = GRAPH_CALLS):
    """A function that replays `calls` calls of fn from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # NCCL's watchdog thread polls events during the capture: "thread_local" lets it.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return graph.replay


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
    parser.add_argument("--json", help="write the rows here (rank 0), keeping other machines' rows")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    algorithms = [a for a in ALGORITHMS if a != "pair" or world == 2]  # pair adds exactly two partials
    rows = []
    for label, tokens in ROWS:
        partial = torch.randn(tokens, HIDDEN, generator=gen, device=device) * (rank + 1)
        half = partial.bfloat16()
        for algorithm in algorithms:
            check_bits(partial, world, algorithm)
        calls = {"all_reduce_bf16": lambda: dist.all_reduce(half.clone()), "all_reduce_fp32": lambda: dist.all_reduce(partial.clone()),
                 **{f"tree_{a}": (lambda a=a: tbik.tree_all_reduce(partial, algorithm=a)) for a in algorithms}}
        timings = [("eager", 1, calls)]
        if cuda:
            timings.append(("graph", GRAPH_CALLS, {k: graphed(fn) for k, fn in calls.items()}))
        for timing, per_run, fns in timings:
            row = {"message": label, "shape": [tokens, HIDDEN], "timing": timing}
            row.update({f"{k}_us": timed(fn, args.iters, cuda) / per_run for k, fn in fns.items()})
            row.update({f"ratio_{a}": row[f"tree_{a}_us"] / row["all_reduce_fp32_us"] for a in algorithms})
            rows.append(row)

    if rank == 0:
        backend = dist.get_backend()
        where = torch.cuda.get_device_name() if cuda else "CPU processes"
        head = ["message", "shape", "timing", "all_reduce bf16 us", "all_reduce fp32 us",
                *(f"tree ({a}) fp32 us" for a in algorithms), *(f"tree ({a}) / fp32 all_reduce" for a in algorithms)]
        lines = [f"P={world}, backend {backend}, {where}, torch {torch.__version__}; median of {args.iters} runs "
                 f"(eager: one call; graph: {GRAPH_CALLS} calls replayed from one CUDA graph, per call; each stock "
                 "all_reduce includes a .clone() of the message, as it works in place); tree_all_reduce bits (each "
                 "algorithm) identical on every rank and equal to tbik.tree_sum: checked", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["message"], str(r["shape"]), r["timing"], f"{r['all_reduce_bf16_us']:.1f}", f"{r['all_reduce_fp32_us']:.1f}",
                     *(f"{r[f'tree_{a}_us']:.1f}" for a in algorithms), *(f"{r[f'ratio_{a}']:.2f}" for a in algorithms)]
            lines.append("| " + " | ".join(cells) + " |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if args.json:
            _write_json(args.json, where, world, rows)
    # Every rank done with its graphs' NCCL work before the group goes: a rank tearing down
    # while another still replays can hang the exit.
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _write_json(path: str, where: str, world: int, rows: list[dict]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from repaudit.files import write_json_atomic

    command = " ".join(["torchrun", f"--nproc_per_node={world}", "benchmarks/allreduce.py", *sys.argv[1:]])
    others = []
    if Path(path).exists():
        others = [r for r in json.loads(Path(path).read_text()) if (r.get("device"), r.get("P")) != (where, world)]
    write_json_atomic(path, others + [{"device": where, "P": world, **r, "command": command} for r in rows])


if __name__ == "__main__":
    main()
