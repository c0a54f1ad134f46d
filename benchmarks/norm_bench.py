"""tbik.rms_norm on a CUDA GPU: its launch against the one it replaced, side by side, bits compared.

    python3 benchmarks/norm_bench.py [--json FILE] [--sweep]

The earlier launch: 4 warps a program for every width, a row read twice (once for its sum of
squares, once to scale it), 16 per-head rows a program. The shipped one (tl/norm.py): a row
that fits one 1,024-wide slice read once and held in registers, one warp a program up to 2,048
wide and two up to 4,096, 8 per-head rows a program at 4 warps. Neither may move a bit: a row's
additions are BLOCK's halving tree whatever the launch, and every case's bits are compared.

Shapes: the hidden RMSNorm with its residual add at widths 1,024 (Qwen3-0.6B), 2,048 and 4,096,
and the per-head q/k norms (128 wide, read through the strided views of a fused q/k/v output, as
vLLM hands them over), at decode row counts (32: the transformers engine's batch; 256: vLLM's
decode batch) and a prefill chunk's 8,192 rows. The eager ops' time is there for scale. Times are
CUDA-graph replays (GPU time alone). --sweep also times the warps x rows-a-program grid the
shipped rule was picked from.
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
CASES = [(name, tokens, 0, width, True) for width, name in ((1024, "hidden+res"), (2048, "hidden+res"),
                                                          (4096, "hidden+res")) for tokens in (32, 256, 8192)]
CASES += [(name, tokens, heads, 128, False) for tokens in (32, 256, 8192) for name, heads in (("q heads", 16),
                                                                                           ("k heads", 8))]
EARLIER = dict(_ONE_SLICE=False, _WARPS=4, _ROW_ELEMENTS=2048, _NARROW=256)
SHIPPED = {name: getattr(norm, name) for name in EARLIER}
# (warps, rows a program) for --sweep; rows a program of a wide row need _NARROW raised.
SWEEP = [(w, r) for w in (1, 2, 4, 8) for r in (1, 2, 4, 8, 16, 32)]


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
    return torch.cat([p.reshape(-1) for p in t]) if isinstance(t, tuple) else t.reshape(-1)


def timed(fn) -> float:
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def run(launch: dict, x, w, res):
    for name, value in launch.items():
        setattr(norm, name, value)
    try:
        out = bits(norm.rms_norm(x, w, 1e-6, residual=res)).clone()
        return out, timed(lambda: norm.rms_norm(x, w, 1e-6, residual=res))
    finally:
        for name, value in SHIPPED.items():
            setattr(norm, name, value)


def eager_us(x, w, res) -> float:
    def eager():
        h = (x if res is None else res + x).float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return timed(eager)


def sweep_launches(width: int):
    block = norm._block(width)
    for warps, rows in SWEEP:
        if block * rows <= 8192 and (block <= norm._NARROW) == (rows >= 4):
            yield f"w{warps} r{rows}", dict(_WARPS=warps, _ROW_ELEMENTS=rows * block, _NARROW=max(256, block))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| case | width | tokens | eager ops, us | earlier launch, us | shipped, us | speed-up | same bits |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, tokens, heads, width, residual in CASES:
        x, w, res = operands(tokens, heads, width, residual)
        before, before_us = run(EARLIER, x, w, res)
        ours, ours_us = run({}, x, w, res)
        same = torch.equal(before.view(torch.int16), ours.view(torch.int16))
        row = dict(device=torch.cuda.get_device_name(), case=name, tokens=tokens, heads=heads, width=width,
                   eager_us=eager_us(x, w, res), earlier_us=before_us, shipped_us=ours_us,
                   speedup=before_us / ours_us, same_bits=same)
        if args.sweep:
            row["sweep_us"] = {}
            for label, launch in sweep_launches(width):
                out, us = run(launch, x, w, res)
                row["sweep_us"][label] = us
                row["same_bits"] &= torch.equal(out.view(torch.int16), ours.view(torch.int16))
        rows.append(row)
        print(f"| {name} | {width} | {tokens} | {row['eager_us']:.1f} | {before_us:.2f} | {ours_us:.2f} | "
              f"{before_us / ours_us:.2f}x | {row['same_bits']} |", flush=True)
        if args.sweep:
            print("|  | sweep, us |  | " + ", ".join(f"{k} {v:.1f}" for k, v in row["sweep_us"].items()) + " |")
    if args.json:
        command = "python3 benchmarks/norm_bench.py" + " --sweep" * args.sweep
        Path(args.json).write_text(json.dumps(dict(command=command, rows=rows), indent=1))
    if not all(r["same_bits"] for r in rows):
        sys.exit("the launch moved bits")


if __name__ == "__main__":
    main()
