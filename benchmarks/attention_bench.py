"""tbik's attention with a key/value head's query heads in one tile (the kernel as it is) against
one query head a tile (the layout before, run here as the same kernel on keys and values
repeated to every query head, so each query head reads a copy of its own: the reads and the
programs of that layout, and, the rows' arithmetic not depending on their tile-mates, the same
bits, which this checks). CUDA-event times of a decode step at the engine's batch 32 and of a
prefill, Qwen3-0.6B's heads (16 query, 8 key/value, 128 wide), bf16. Then, in CUDA graphs (GPU
time alone), the kernel each call runs against the row-major kernel (KEYS_MAJOR_ROWS=0), which
decode steps ran before the keys-major one, and whether the two give the same bits.

    python3 benchmarks/attention_bench.py [--stages 2,3] [--json reports/perf/attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import tbik  # noqa: E402
import torch  # noqa: E402
from tbik.tl import attention as kernels  # noqa: E402


def event_us(fn, reps: int = 50) -> float:
    """Median microseconds of one call, over `reps` calls each timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def graph_us(fns: dict, calls: int = 20, rounds: int = 15) -> dict:
    """GPU microseconds a call of each of `fns` (name -> fn), without the host's launch time (an
    engine's decode steps replay CUDA graphs too): `calls` calls captured in one graph a
    function, the graphs replayed in turn round after round, median over `rounds`."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2", help="software pipeline stages to time (the kernel ships with 2)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 16, 8, 128
    cases = [("decode, batch 32, 600 keys", 32, 1, 600), ("decode, batch 32, 350 keys", 32, 1, 350),
             ("decode, batch 8, 2,000 keys", 8, 1, 2000), ("prefill, batch 8, 512 tokens", 8, 512, 512)]
    plain_meta, plain_rows = kernels._meta, kernels.KEYS_MAJOR_ROWS
    rows = []
    print("| case | stages | grouped us | one head a tile us | one head a tile / grouped | bits equal |")
    print("|---|---|---|---|---|---|")
    for name, b, tq, s in cases:
        q = torch.randn(b, hq, tq, d, generator=g, device="cuda").bfloat16()
        k = torch.randn(b, hkv, s, d, generator=g, device="cuda").bfloat16()
        v = torch.randn(b, hkv, s, d, generator=g, device="cuda").bfloat16()
        start = torch.randint(0, s // 4, (b,), generator=g, device="cuda").int()
        end = torch.full((b,), s, dtype=torch.int32, device="cuda")
        k1, v1 = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        for stages in (int(x) for x in args.stages.split(",")):
            def staged(q_, dim, rows, stages=stages):
                block_m, meta = plain_meta(q_, dim, rows)
                return block_m, {**meta, "num_stages": stages}

            kernels._meta = staged
            try:
                grouped = event_us(lambda: tbik.attention(q, k, v, start=start, end=end))
                single = event_us(lambda: tbik.attention(q, k1, v1, start=start, end=end))
                same = torch.equal(tbik.attention(q, k, v, start=start, end=end).view(torch.int16),
                                   tbik.attention(q, k1, v1, start=start, end=end).view(torch.int16))
            finally:
                kernels._meta = plain_meta
            print(f"| {name} | {stages} | {grouped:.1f} | {single:.1f} | {single / grouped:.2f} | {same} |", flush=True)
            rows.append({"device": torch.cuda.get_device_name(), "case": name, "batch": b, "queries": tq, "keys": s,
                         "num_stages": stages, "grouped_us": grouped, "one_head_a_tile_us": single,
                         "ratio": single / grouped, "bits_equal": same,
                         "command": " ".join(["python3 benchmarks/attention_bench.py", *sys.argv[1:]])})
    print("\n| case | shipped kernel | us (CUDA graph) | row-major us | row-major / shipped | bits equal (fp32 out) |")
    print("|---|---|---|---|---|---|")
    for name, b, tq, s in cases:
        q = torch.randn(b, hq, tq, d, generator=g, device="cuda").bfloat16()
        k = torch.randn(b, hkv, s, d, generator=g, device="cuda").bfloat16()
        v = torch.randn(b, hkv, s, d, generator=g, device="cuda").bfloat16()
        start = torch.randint(0, s // 4, (b,), generator=g, device="cuda").int()
        end = torch.full((b,), s, dtype=torch.int32, device="cuda")
        outs = [torch.empty(q.shape, device="cuda") for _ in range(2)]

        def run(out, rows):
            kernels.KEYS_MAJOR_ROWS = rows
            try:
                return kernels.attention(q, k, v, start, end, d ** -0.5, out=out)
            finally:
                kernels.KEYS_MAJOR_ROWS = plain_rows

        times = graph_us({"shipped": lambda: run(outs[0], plain_rows), "row-major": lambda: run(outs[1], 0)})
        same = torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
        shipped = "keys-major" if kernels.keys_major(q, tq * hq // hkv) else "row-major"
        print(f"| {name} | {shipped} | {times['shipped']:.1f} | {times['row-major']:.1f} "
              f"| {times['row-major'] / times['shipped']:.2f} | {same} |", flush=True)
        rows.append({"device": torch.cuda.get_device_name(), "case": name, "batch": b, "queries": tq, "keys": s,
                     "shipped": shipped, "graph_us": times["shipped"], "row_major_graph_us": times["row-major"],
                     "ratio": times["row-major"] / times["shipped"], "bits_equal": same,
                     "command": " ".join(["python3 benchmarks/attention_bench.py", *sys.argv[1:]])})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
