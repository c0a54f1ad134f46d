"""tbik's attention with a key/value head's query heads in one tile (the kernel as it is) against
one query head a tile (the layout before, run here as the same kernel on keys and values
repeated to every query head, so each query head reads a copy of its own: the reads and the
programs of that layout, and, the rows' arithmetic not depending on their tile-mates, the same
bits, which this checks). CUDA-event times of a decode step at the engine's batch 32 and of a
prefill, Qwen3-0.6B's heads (16 query, 8 key/value, 128 wide), bf16.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2", help="software pipeline stages to time (the kernel ships with 2)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 16, 8, 128
    cases = [("decode, batch 32, 600 keys", 32, 1, 600), ("decode, batch 32, 350 keys", 32, 1, 350),
             ("decode, batch 8, 2,000 keys", 8, 1, 2000), ("prefill, batch 8, 512 tokens", 8, 512, 512)]
    plain_meta = kernels._meta
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
            kernels._meta = lambda q_, dim, stages=stages: {**plain_meta(q_, dim), "num_stages": stages}
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
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
