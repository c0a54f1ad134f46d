"""tbik.rms_norm on a CUDA GPU: one row a program against several rows a program, side by side.

    python3 benchmarks/norm_bench.py [--json FILE]

The shapes are a decode step's norms at Qwen3-0.6B widths: the hidden RMSNorm with its residual
add (1,024 wide) and the per-head q/k norms (128 wide, read through the strided views of a fused
q/k/v output, as vLLM hands them over), at the row counts of the transformers engine's batch 32
and of vLLM's decode batch of 256 at TP=2, and one prefill. Times are CUDA-graph replays (GPU
time alone). Every case's output bits are compared between the two launch shapes: the rows a
program holds must not move a bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "kernels")]

from tbik.tl import norm  # noqa: E402

# (name, tokens, heads of the view (0: a plain [tokens, width] tensor), width, residual)
CASES = [("hidden+res", 32, 0, 1024, True), ("q heads", 32, 16, 128, False), ("k heads", 32, 8, 128, False),
         ("hidden+res", 256, 0, 1024, True), ("q heads", 256, 8, 128, False), ("k heads", 256, 4, 128, False),
         ("hidden+res", 8192, 0, 1024, True), ("q heads", 8192, 16, 128, False)]


def operands(tokens, heads, width, residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    if heads:  # q or k heads of a fused q/k/v output, [tokens, 2 * heads * width] with k/v after
        qkv = torch.randn(tokens, 2 * heads * width, generator=g, device="cuda").to(torch.bfloat16)
        x = qkv[:, :heads * width].view(tokens, heads, width)
    else:
        x = torch.randn(tokens, width, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(width, generator=g, device="cuda").to(torch.bfloat16)
    res = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16) if residual else None
    return x, w, res


def bits(t):
    return t if isinstance(t, torch.Tensor) else torch.cat([p.reshape(-1) for p in t])


def run(rows_elements: int, x, w, res):
    norm._ROW_ELEMENTS = rows_elements
    out = bits(norm.rms_norm(x, w, 1e-6, residual=res)).clone()
    us = 1000 * triton.testing.do_bench_cudagraph(lambda: norm.rms_norm(x, w, 1e-6, residual=res), rep=50,
                                                  return_mode="median")
    return out, us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    shipped = norm._ROW_ELEMENTS
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| case | tokens | one row a program, us | shipped, us | ratio | same bits |\n|---|---|---|---|---|---|")
    for name, tokens, heads, width, residual in CASES:
        x, w, res = operands(tokens, heads, width, residual)
        one, one_us = run(1, x, w, res)
        ours, ours_us = run(shipped, x, w, res)
        same = torch.equal(one.view(torch.int16), ours.view(torch.int16))
        rows.append(dict(device=torch.cuda.get_device_name(), case=name, tokens=tokens, heads=heads, width=width,
                         one_row_us=one_us, shipped_us=ours_us, ratio=one_us / ours_us, same_bits=same))
        print(f"| {name} | {tokens} | {one_us:.2f} | {ours_us:.2f} | {one_us / ours_us:.2f}x | {same} |")
    norm._ROW_ELEMENTS = shipped
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command="python3 benchmarks/norm_bench.py", rows=rows), indent=1))
    if not all(r["same_bits"] for r in rows):
        sys.exit("the rows a program holds moved bits")


if __name__ == "__main__":
    main()
