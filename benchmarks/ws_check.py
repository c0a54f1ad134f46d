"""Bit check + timing of the warp-specialized Gluon tree matmul (tbik/tl/matmul_ws.py) on Hopper.

    PYTHONPATH=$PWD/kernels python benchmarks/ws_check.py [--quick] [--ms 128,512,...] [--no-time]

Bits: matmul_ws fp32 output vs tl/matmul.py's kernel (tbik.tree_matmul(..., _split=1), 8 leaves,
with and without bias), bf16 output likewise, and the TP partials vs tbik.matmul_partial(..., _split=1)
(tp_size 2 and 4, every rank), compared as int32 views with torch.equal.
Time: triton.testing.do_bench median of torch.matmul(x, w.t()), tl/matmul.py's kernel ("tree",
the SPLIT its heuristic picks) and matmul_ws (bf16 out), ratio = cublas_time / time.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton

import tbik
from tbik.tl import matmul as tm
from tbik.tl import matmul_ws

SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]  # Qwen3-8B (N, K)


def bench(fn):
    return triton.testing.do_bench(fn, return_mode="median")


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype == torch.float32:
        return torch.equal(x.view(torch.int32), y.view(torch.int32))
    return torch.equal(x.view(torch.int16), y.view(torch.int16))


def ws(a, b, bias, out_dtype, leaves, k_len=None):
    k_len = k_len or a.shape[1]
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    return matmul_ws.launch(a, b, bias, out, k_len, leaves, k_len // leaves)


def sweep(spec: str):
    """Time matmul_ws variants: spec 'NAME:KEY=VAL/KEY=VAL,...' (KEY: module constants or leaves)."""
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), flush=True)
    defaults = {key: getattr(matmul_ws, key) for key in ("STAGES", "GROUP_M", "CONSUMER_REGS", "PRODUCER_REGS",
                                                          "MAXNREG", "BLOCK_K")}
    for (n, k, m) in [(4096, 12288, 8192), (12288, 4096, 2048), (151936, 4096, 2048), (4096, 4096, 2048)]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        b = w.t()
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        t_cub = triton.testing.do_bench(lambda: torch.matmul(x, b), return_mode="median")
        line = f"N={n:6d} K={k:5d} M={m:5d} cublas {t_cub * 1e3:8.1f}us"
        for var in spec.split(","):
            name, _, kv = var.partition(":")
            over = dict(item.split("=") for item in kv.split("/") if item)
            leaves = int(over.pop("leaves", 8))
            for key, val in defaults.items():
                setattr(matmul_ws, key, int(over.get(key, val)))
            fn = lambda: matmul_ws.launch(x, b, None, out, k, leaves, k // leaves)
            try:
                fn()
                t = triton.testing.do_bench(fn, return_mode="median")
                line += f" | {name} {t * 1e3:8.1f}us {t_cub / t:.3f}x"
            except Exception as err:  # noqa: BLE001
                line += f" | {name} FAILED {type(err).__name__}: {str(err)[:120]}"
        for key, val in defaults.items():
            setattr(matmul_ws, key, val)
        print(line, flush=True)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ms", default="128,200,512,1000,2048,8192")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-bits", action="store_true")
    ap.add_argument("--variants", default="tma", help="timed extra variants: tma (TMA-store epilogue), reg")
    ap.add_argument("--sweep", default="")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args.sweep)
    ms_list = [int(m) for m in args.ms.split(",")]
    global bench
    if args.graph:
        bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")  # noqa: E731
    shapes = SHAPES[:1] if args.quick else SHAPES
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    torch.manual_seed(0)
    all_ok = True
    ratios_ws, ratios_tree = {}, {}  # ratios_ws: variant -> {(n, k, m): ratio}
    for (n, k) in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        b = w.t()  # [K, N], K-contiguous (B^T = w)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            line = f"N={n:6d} K={k:5d} M={m:5d}"
            if not args.no_bits:
                t0 = time.time()
                checks = {}
                ref = tbik.tree_matmul(x, b, out_dtype=torch.float32, _split=1)
                checks["fp32"] = same_bits(ws(x, b, None, torch.float32, 8), ref)
                ref = tbik.tree_matmul(x, b, bias, out_dtype=torch.float32, _split=1)
                checks["fp32+bias"] = same_bits(ws(x, b, bias, torch.float32, 8), ref)
                ref = tbik.tree_matmul(x, b, bias, _split=1)
                checks["bf16+bias"] = same_bits(ws(x, b, bias, torch.bfloat16, 8), ref)
                del ref
                for tp in (2, 4):
                    kl = k // tp
                    ok = True
                    for r in range(tp):
                        xs, bs = x[:, r * kl:(r + 1) * kl], b[r * kl:(r + 1) * kl]
                        ref = tbik.matmul_partial(xs, bs, tp_size=tp, _split=1)
                        ok &= same_bits(ws(xs, bs, None, torch.float32, 8 // tp, kl), ref)
                    checks[f"tp{tp}"] = ok
                all_ok &= all(checks.values())
                line += " bits " + " ".join(f"{key}={'ok' if v else 'DIFF'}" for key, v in checks.items())
                line += f" ({time.time() - t0:.1f}s)"
                torch.cuda.empty_cache()
            if not args.no_time:
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                cfg = tm._config(x.dtype, k // 8, m, n, x.device)  # tl/matmul.py's own tiles and SPLIT for these rows
                split = tm._pick_split(8, triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), x.device)
                t_cub = bench(lambda: torch.matmul(x, b))
                t_tree = bench(lambda: tbik.tree_matmul(x, b, _split=split))
                ratios_tree[(n, k, m)] = t_cub / t_tree
                line += f" | cublas {t_cub * 1e3:8.1f}us tree {t_tree * 1e3:8.1f}us ({t_cub / t_tree:.2f}x)"
                for var in args.variants.split(","):
                    if var == "dispatch":  # what tbik.tree_matmul runs: matmul_ws where eligible, else tl/matmul.py
                        if not matmul_ws.eligible(x.dtype, x.dtype, x.device, m, n, k, 8, k // 8, True):
                            t_ws = t_tree
                            ratios_ws.setdefault(var, {})[(n, k, m)] = t_cub / t_ws
                            line += f" ws[{var}] -> tree"
                            continue
                        fn = lambda: tbik.tree_matmul(x, b)
                    else:
                        fn = lambda: matmul_ws.launch(x, b, None, out, k, 8, k // 8, tma_store=var == "tma")
                    fn()  # compile
                    t_ws = bench(fn)
                    tflops = 2 * m * n * k / t_ws * 1e-9
                    ratios_ws.setdefault(var, {})[(n, k, m)] = t_cub / t_ws
                    line += f" ws[{var}] {t_ws * 1e3:8.1f}us ({t_cub / t_ws:.2f}x, {tflops:.0f} TFLOP/s)"
                del out
            print(line, flush=True)
        torch.cuda.empty_cache()
    if not args.no_bits:
        print("ALL BITS OK" if all_ok else "BIT MISMATCH", flush=True)

    def gm(d, keep):
        v = [r for key, r in d.items() if keep(key[2])]
        return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")

    if ratios_ws:
        for name, keep in (("M in {128,512,2048,8192}", lambda m: m in (128, 512, 2048, 8192)),
                           ("all M >= 128", lambda m: m >= 128), ("M >= 512", lambda m: m >= 512)):
            print(f"geomean cublas/x over {name}: tree {gm(ratios_tree, keep):.3f} "
                  + " ".join(f"ws[{var}] {gm(d, keep):.3f}" for var, d in ratios_ws.items()))


if __name__ == "__main__":
    main()
