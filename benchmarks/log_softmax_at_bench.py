"""tbik.log_softmax_at against the whole tbik.log_softmax gathered (what a tbik vLLM cell's
sampling steps ran before), fp32 rows of Qwen3's vocabulary, the sampled token and a top-5 of
each: CUDA-event medians of one call in a CUDA graph, and whether the two give the same bits.

    python3 benchmarks/log_softmax_at_bench.py [--rows 32,256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

import tbik  # noqa: E402
from benchmarks.paged_attention_bench import graph_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,256")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| rows | log_softmax + gather us | log_softmax_at us | ratio | bits equal |\n|---|---|---|---|---|")
    for n in (int(r) for r in args.rows.split(",")):
        logits = (torch.randn(n, 151936, generator=g, device="cuda") * 3).bfloat16()
        index = torch.randint(0, 151936, (n, 6), generator=g, device="cuda")
        outs = {}
        fns = {"whole": lambda: outs.__setitem__("whole", tbik.log_softmax(logits.float()).gather(1, index)),
               "at": lambda: outs.__setitem__("at", tbik.log_softmax_at(logits.float(), index))}
        us = graph_us(fns)
        same = torch.equal(outs["whole"].view(torch.int32), outs["at"].view(torch.int32))
        print(f"| {n} | {us['whole']:.1f} | {us['at']:.1f} | {us['whole'] / us['at']:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
