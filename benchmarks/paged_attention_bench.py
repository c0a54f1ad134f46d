"""tbik's paged attention at a vLLM step's shapes: the kernel each call runs (keys-major for a
decode step, row-major for a prefill chunk) against the row-major kernel (KEYS_MAJOR_ROWS=0),
which decode steps ran before; GPU time of one call in CUDA graphs (as vLLM replays its decode
steps), both in turn, and whether the two give the same bits. Outputs in the query's dtype, as
vLLM has them written (with fp32 outputs keys-major gains nothing: reports/kernels/h200-keys-major/).

The shapes are Qwen3-0.6B's at TP=2 (8 query and 4 key/value heads of 128 a rank) and TP=1
(16 and 8) over a cache of 16-token blocks in shuffled order: a decode step of 256 requests
whose sequences hold 64-640 keys (what the decode steps of benchmarks/vllm_speed.py run), and a
prefill chunk of 32 requests of 256 new tokens after 0-256 cached ones.

    python3 benchmarks/paged_attention_bench.py [--stages 2,3,4] [--json FILE]

With --stages, the kernel each call runs is also timed at each software pipeline depth, with
its bits checked against the shipped depth's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

import tbik  # noqa: E402
from tbik.tl import attention as kernels  # noqa: E402

D, BLOCK = 128, 16


def _case(g, n_req: int, new: int, cached_lo: int, cached_hi: int, hq: int = 8, hkv: int = 4):
    """query [n_req * new, hq, D], the caches, and the step's metadata in vLLM's layout."""
    cached = torch.randint(cached_lo, cached_hi + 1, (n_req,), generator=g, device="cuda")
    seq_lens = (cached + new).int()
    blocks_per = (seq_lens + BLOCK - 1) // BLOCK
    n_blocks = int(blocks_per.sum())
    order = torch.randperm(n_blocks, generator=g, device="cuda").int()
    width = int(blocks_per.max())
    table = torch.zeros(n_req, width, dtype=torch.int32, device="cuda")
    at = 0
    for r, nb in enumerate(blocks_per.tolist()):
        table[r, :nb] = order[at:at + nb]
        at += nb
    k = torch.randn(n_blocks, BLOCK, hkv, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(n_blocks, BLOCK, hkv, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(n_req * new, hq, D, generator=g, device="cuda").bfloat16()
    qsl = torch.arange(0, n_req * new + 1, new, dtype=torch.int32, device="cuda")
    return q, k, v, qsl, seq_lens, table, new


def graph_us(fns: dict, calls: int = 20, rounds: int = 15) -> dict:
    """GPU microseconds a call of each of `fns` (name -> fn), without the host's launch time:
    `calls` calls captured in one CUDA graph a function, the graphs replayed in turn round after
    round (clocks that ramp weigh on each alike), median over `rounds`."""
    graphs = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for _ in range(calls):
                fn()
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000 / calls)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def at_depth(run, out, rows: int, depth: int) -> None:
    """run(out, rows) with the kernel compiled for `depth` pipeline stages."""
    shipped = kernels.STAGES
    kernels.STAGES = depth
    try:
        run(out, rows)
    finally:
        kernels.STAGES = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--stages", default="", help="pipeline depths to time the shipped kernel at, e.g. 2,3,4")
    args = ap.parse_args()
    depths = [int(d) for d in args.stages.split(",") if d]
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"decode, TP=2 heads (8/4), 256 requests, 64-640 keys": _case(g, 256, 1, 63, 639),
             "decode, TP=1 heads (16/8), 256 requests, 64-640 keys": _case(g, 256, 1, 63, 639, 16, 8),
             "prefill chunk, TP=2 heads, 32 requests x 256 new, 0-256 cached": _case(g, 32, 256, 0, 256)}
    shipped_rows = kernels.KEYS_MAJOR_ROWS
    rows = []
    print("| case | shipped kernel | us | row-major us | row-major / shipped | bits equal |\n|---|---|---|---|---|---|")
    for name, (q, k, v, qsl, seq_lens, table, new) in cases.items():
        outs = [torch.empty_like(q) for _ in range(2)]

        def run(out, keys_major_rows):
            kernels.KEYS_MAJOR_ROWS = keys_major_rows
            try:
                tbik.paged_attention(q, k, v, qsl, seq_lens, table, max_query_len=new, scale=D ** -0.5, out=out)
            finally:
                kernels.KEYS_MAJOR_ROWS = shipped_rows

        fns = {"shipped": lambda: run(outs[0], shipped_rows), "row-major": lambda: run(outs[1], 0)}
        deep = {d: torch.empty_like(q) for d in depths}
        for d in depths:
            fns[f"stages={d}"] = functools.partial(at_depth, run, deep[d], shipped_rows, d)
        times = graph_us(fns)
        same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
        by_depth = {d: {"us": times[f"stages={d}"], "bits_equal": torch.equal(outs[0].view(torch.int16),
                                                                              deep[d].view(torch.int16))}
                    for d in depths}
        shipped = "keys-major" if kernels.keys_major(q, new * q.shape[1] // k.shape[2]) else "row-major"
        print(f"| {name} | {shipped} | {times['shipped']:.1f} | {times['row-major']:.1f} "
              f"| {times['row-major'] / times['shipped']:.2f} | {same} |", flush=True)
        for d, row in by_depth.items():
            print(f"|   at {d} stages | | {row['us']:.1f} | | {times['shipped'] / row['us']:.2f} (shipped / this) "
                  f"| {row['bits_equal']} |", flush=True)
        rows.append({"device": torch.cuda.get_device_name(), "case": name, "shipped": shipped,
                     "us": times["shipped"], "row_major_us": times["row-major"],
                     "ratio": times["row-major"] / times["shipped"], "bits_equal": same,
                     "stages": kernels.STAGES, "by_stages": by_depth,
                     "command": " ".join(["python3 benchmarks/paged_attention_bench.py", *sys.argv[1:]])})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
