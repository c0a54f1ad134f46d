"""tbik on a CUDA GPU: which stock ops move bits, accuracy, and tree matmul speed against cuBLAS.

    python benchmarks/kernels.py [probe] [accuracy] [bench] [sweep] [host] [--out DIR] [--json FILE]

probe     which stock torch ops give a row different bits when the batch (or the head count, or
          prefill vs decode) changes, next to the tbik kernels on the same inputs.
accuracy  ||out - ref|| / ||ref|| against a float64 reference: tree_matmul vs torch.matmul.
bench     tree_matmul vs torch.matmul (cuBLAS), bf16, Qwen3-8B linear shapes, M = 1 .. 8192:
          TFLOP/s, the ratio per shape, geometric means of the ratio for M >= 128 and M <= 32.
          triton.testing.do_bench, median; it flushes L2 before each run, so the weights come
          from HBM as they do in a forward pass. Also CUDA-graph replays (GPU time alone).
sweep     tile configurations (eager) and execution strategies (SPLIT, CUDA graphs) on a subset,
          with the compiled kernels' registers and spills: how tbik/matmul.py was configured.
host      cProfile of the host side of tree_matmul calls.
Tables are printed as Markdown and, with --out, written to DIR/<what>.md. With --json, bench
also writes its rows to FILE (with --repeat N, each value the median of N runs) ({"rows": [...], "summary": {device: {...}}}; rows `device`,
`shape`, `N`, `K`, `M`, `cublas_tflops`, `tbik_tflops`, `ratio`, `relerr_ratio` (the tree's
||out - ref|| / ||ref|| against a float64 reference over cuBLAS's), replacing FILE's rows and
summary of the same device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import tbik
from tbik.tl import matmul as tm

# (name, N, K) of Qwen3-8B's linear layers; gate/up are fused here as one 12288-wide product.
SHAPES = [("q/o_proj", 4096, 4096), ("k/v_proj", 1024, 4096), ("gate_up", 12288, 4096),
          ("down", 4096, 12288), ("lm_head", 151936, 4096)]
MS = [1, 8, 32, 128, 512, 2048, 8192]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def device_name() -> str:
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def operands(m, n, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)).to(dtype)
    return x, w


def same_bits(x, y) -> bool:
    return torch.equal(x.contiguous().view(INT_VIEW[x.dtype]), y.contiguous().view(INT_VIEW[y.dtype]))


def ms_of(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms_of(fn) -> float:
    """Replays of a CUDA graph: GPU time alone, no host overhead, L2 not flushed."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ---------------------------------------------------------------- probe


def _moved_at(fn, batches, make_batch):
    """Batch sizes at which row 0's output bits differ from its output at batch size 1."""
    ref = fn(make_batch(1))[:1]
    return [b for b in batches if not same_bits(fn(make_batch(b))[:1], ref)]


def probe() -> str:
    rows = []
    batches = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]

    def verdict(moved):
        return "stable" if not moved else "MOVES at B=" + ",".join(map(str, moved))

    for name, n, k in SHAPES[:4] + [SHAPES[4]]:
        x, w = operands(2048, n, k, seed=1)
        rows.append((f"F.linear bf16 {name} (N={n},K={k})", verdict(_moved_at(lambda a: F.linear(a, w), batches,
                                                                                  lambda b: x[:b]))))
        rows.append((f"tbik.tree_matmul {name}", verdict(_moved_at(lambda a: tbik.tree_matmul(a, w.t()), batches,
                                                                     lambda b: x[:b]))))
    logits = torch.randn(2048, 151936, device="cuda") * 3
    rows.append(("torch.log_softmax fp32 [B,151936]", verdict(_moved_at(lambda a: torch.log_softmax(a, -1), batches,
                                                                          lambda b: logits[:b]))))
    rows.append(("tbik.log_softmax", verdict(_moved_at(tbik.log_softmax, batches, lambda b: logits[:b]))))
    h = torch.randn(2048, 4096, device="cuda").bfloat16()
    wn = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()

    def hf_rms(a):
        af = a.float()
        return wn * (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()

    rows.append(("RMSNorm via x.pow(2).mean(-1) bf16 [B,4096]", verdict(_moved_at(hf_rms, batches, lambda b: h[:b]))))
    rows.append(("tbik.rms_norm", verdict(_moved_at(lambda a: tbik.rms_norm(a, wn, 1e-6), batches, lambda b: h[:b]))))

    # Attention: Qwen3-8B heads (32 query, 8 kv, d=128). Row 0 is the same sequence every time.
    g = torch.Generator(device="cuda").manual_seed(2)
    hq, hkv, d, s = 32, 8, 128, 2048

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()

    q_all, k_all, v_all = rnd(64, hq, s, d), rnd(64, hkv, s, d), rnd(64, hkv, s, d)

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def tb(q, k, v, causal):
        return tbik.attention(q, k, v)

    for label, fn in (("F.scaled_dot_product_attention", sdpa), ("tbik.attention", tb)):
        pre = lambda b: fn(q_all[:b, :, :512], k_all[:b, :, :512], v_all[:b, :, :512], True)  # noqa: E731
        ref = pre(1)[:1]
        moved = [b for b in (2, 4, 8, 16) if not same_bits(pre(b)[:1], ref)]
        rows.append((f"{label} prefill T=512, batch", verdict(moved)))
        dec = lambda b: fn(q_all[:b, :, -1:], k_all[:b], v_all[:b], False)  # noqa: E731
        ref = dec(1)[:1]
        moved = [b for b in (2, 4, 8, 16, 32, 64) if not same_bits(dec(b)[:1], ref)]
        rows.append((f"{label} decode S=2048, batch", verdict(moved)))
        moved = []
        for tp in (2, 4, 8):  # a TP rank holds 32/tp query heads and 8/tp kv heads
            full = fn(q_all[:4, :, -1:], k_all[:4], v_all[:4], False)
            shard = fn(q_all[:4, :hq // tp, -1:], k_all[:4, :hkv // tp], v_all[:4, :hkv // tp], False)
            if not same_bits(shard, full[:, :hq // tp]):
                moved.append(tp)
        rows.append((f"{label} decode S=2048 B=4, heads per rank (TP)",
                     "stable" if not moved else "MOVES at TP=" + ",".join(map(str, moved))))
        full = fn(q_all[:1, :, :s], k_all[:1], v_all[:1], True)
        moved = [p for p in (63, 511, 1000, 2047)
                 if not same_bits(fn(q_all[:1, :, p:p + 1], k_all[:1, :, :p + 1], v_all[:1, :, :p + 1], False),
                                  full[:, :, p:p + 1])]
        rows.append((f"{label} decode step vs prefill row",
                     "stable" if not moved else "MOVES at positions " + ",".join(map(str, moved))))
    return table(["op", "row 0's bits vs batch size 1 (or TP=1 / prefill)"], rows)


# ---------------------------------------------------------------- accuracy


def accuracy() -> str:
    rows = []
    for name, n, k in SHAPES:
        m = 256
        x, w = operands(m, n, k, seed=3)
        ref = x.double() @ w.double().t()

        def err(y):
            return f"{((y.double() - ref).norm() / ref.norm()).item():.3e}"

        try:  # cuBLAS with an fp32 output (torch >= 2.9)
            cublas32 = err(torch.mm(x, w.t(), out_dtype=torch.float32))
        except TypeError:
            cublas32 = "n/a"
        rows.append((name, m, n, k, err(x @ w.t()), err(tbik.tree_matmul(x, w.t())),
                     err(tbik.tree_matmul(x, w.t(), num_chunks=1)), cublas32,
                     err(tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)),
                     err(tbik.tree_matmul(x, w.t(), num_chunks=16, out_dtype=torch.float32))))
    x, w = operands(256, 4096, 4096, dtype=torch.float32, seed=4)
    ref = x.double() @ w.double().t()
    fp32 = [f"{((y.double() - ref).norm() / ref.norm()).item():.3e}" for y in
            (x @ w.t(), tbik.tree_matmul(x, w.t()))]
    head = ["shape", "M", "N", "K", "cuBLAS bf16 out", "tree C=8 bf16 out", "tree C=1 bf16 out",
            "cuBLAS fp32 out", "tree C=8 fp32 out", "tree C=16 fp32 out"]
    return (table(head, rows) + "\n\nfp32 inputs (4096x4096, M=256): torch.matmul (TF32 allowed: "
            f"{torch.backends.cuda.matmul.allow_tf32}) {fp32[0]}, tree_matmul (IEEE) {fp32[1]}")


# ---------------------------------------------------------------- bench


def strategy(x, w, k, num_chunks=tbik.NUM_CHUNKS) -> int | str:
    """What tree_matmul runs for x @ w.t() (execution strategy, never the bits): "ws" for the
    warp-specialized kernel (tl/matmul_ws.py), else the SPLIT of tl/matmul.py's kernel."""
    plan = tm._plan(x.dtype, x.dtype, x.device, x.shape[0], w.shape[0], k, num_chunks, k // num_chunks, False, None,
                    tm._tma_fits(x, w.t()))
    return "ws" if plan.gluon else plan.meta["SPLIT"]


def host_overhead_us(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def relerr(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


BENCH_ROWS: list[dict] = []  # bench's measurements, for --json


def bench(shapes=SHAPES, ms=MS) -> str:
    rows, big, small, gbig, gsmall = [], [], [], [], []
    for name, n, k in shapes:
        w = operands(1, n, k, seed=5)[1]
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            flop = 2.0 * m * n * k
            t_ref = ms_of(lambda: torch.matmul(x, w.t()))
            t_tree = ms_of(lambda: tbik.tree_matmul(x, w.t()))
            ratio = t_ref / t_tree
            (big if m >= 128 else small if m <= 32 else []).append(ratio)
            g_ref = graph_ms_of(lambda: torch.matmul(x, w.t()))
            g_tree = graph_ms_of(lambda: tbik.tree_matmul(x, w.t()))
            (gbig if m >= 128 else gsmall if m <= 32 else []).append(g_ref / g_tree)
            split = strategy(x, w, k)
            ref = x.double() @ w.double().t()
            err = relerr(tbik.tree_matmul(x, w.t()), ref) / relerr(torch.matmul(x, w.t()), ref)
            del ref
            BENCH_ROWS.append({"shape": name, "N": n, "K": k, "M": m, "cublas_tflops": flop / t_ref / 1e9,
                               "tbik_tflops": flop / t_tree / 1e9, "ratio": ratio, "relerr_ratio": err,
                               "graph_ratio": g_ref / g_tree})
            rows.append((name, n, k, m, f"{t_ref * 1e3:.1f}", f"{flop / t_ref / 1e9:.1f}", f"{t_tree * 1e3:.1f}",
                         f"{flop / t_tree / 1e9:.1f}", f"{ratio:.2f}", f"{g_ref * 1e3:.1f}", f"{g_tree * 1e3:.1f}",
                         f"{g_ref / g_tree:.2f}", split))
        del w
        torch.cuda.empty_cache()
    x, w = operands(1, 4096, 4096, seed=6)
    launch = (f"host time per call, M=1 4096x4096 (Python + launch, no sync): torch.matmul "
              f"{host_overhead_us(lambda: torch.matmul(x, w.t())):.1f} us, tree_matmul "
              f"{host_overhead_us(lambda: tbik.tree_matmul(x, w.t())):.1f} us")
    head = ["shape", "N", "K", "M", "cuBLAS us", "cuBLAS TFLOP/s", "tree us", "tree TFLOP/s",
            "ratio (cuBLAS time / tree time)", "graph: cuBLAS us", "graph: tree us", "graph: ratio", "SPLIT"]
    return (table(head, rows) + f"\n\ngeometric mean of the ratio (do_bench, L2 flushed, eager launch): "
            f"M >= 128: {geomean(big):.3f} (target 0.8); M <= 32: {geomean(small):.3f} (target 0.7)\n"
            f"geometric mean of the ratio in CUDA graphs (GPU time only, L2 warm): M >= 128: {geomean(gbig):.3f}; "
            f"M <= 32: {geomean(gsmall):.3f}\n\n" + launch)


# ---------------------------------------------------------------- host


def host() -> str:
    """Where the host time of one tree_matmul call goes (cProfile over many calls)."""
    import cProfile
    import io
    import pstats

    x, w = operands(1, 4096, 4096, seed=10)
    for _ in range(10):
        tbik.tree_matmul(x, w.t())
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        tbik.tree_matmul(x, w.t())
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return "```\n" + buf.getvalue()[-6000:] + "\n```"


# ---------------------------------------------------------------- sweep


def compiled_kernels():
    out = {}
    for cache in tm._tree_matmul_kernel.device_caches.values():
        for key, kernel in cache[0].items():
            out[key] = kernel
    return out


def set_config(cfg, few_rows=()):
    """One tile configuration for every M (few_rows: tl/matmul.py's _FEW_ROWS entries for bf16)."""
    tm._CONFIGS[torch.bfloat16] = cfg
    tm._FEW_ROWS[torch.bfloat16] = few_rows
    tm._plan.cache_clear()


SWEEP_CONFIGS = [
    "64x128x128 w8 s4 R2 TMA",  # shipped above 256 rows
    "shipped",  # tl/matmul.py's choice: narrower tiles for fewer rows
    "64x128x128 w8 s3 R2 TMA",
    "64x128x64 w4 s3 R1 TMA",  # one warpgroup, m64n128 wgmma; two programs fit an SM
    "64x128x64 w4 s4 R1 TMA",
    "64x128x128 w4 s2 R1 TMA",
    "128x128x64 w8 s3 R1 TMA",
    "128x128x64 w8 s4 R1 TMA",
    "128x128x128 w8 s2 R1 TMA",
]


def parse_config(text: str) -> dict:
    """'64x128x128 w8 s4 R2 TMA' (or 'ptr' for pointer loads) -> a _CONFIGS entry."""
    tile, warps, stages, reg, loads = text.split()
    bm, bn, bk = map(int, tile.split("x"))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=int(warps[1:]), num_stages=int(stages[1:]),
                REG_LEVELS=int(reg[1:]), TMA=loads == "TMA")


def sweep(configs=SWEEP_CONFIGS, shapes=SHAPES, ms=MS) -> str:
    """Tile configurations (eager timings, and CUDA-graph timings: GPU time alone, as a decode
    step replays them) and execution strategies (CUDA-graph timings)."""
    default, default_few = dict(tm._CONFIGS[torch.bfloat16]), tm._FEW_ROWS[torch.bfloat16]
    # "shipped": tl/matmul.py's own choice, its tiles by the number of rows
    variants = {name: (default, default_few) if name == "shipped" else (parse_config(name), ())
                for name in configs}
    rows, kernel_rows, graph_rows = [], [], []
    seen = set(compiled_kernels())
    refs, graph_refs, bits, moved = {}, {}, {}, []
    cells = [(sname, m) for sname, _, _ in shapes for m in ms]
    for name, variant in variants.items():
        set_config(*variant)
        ratios, graph_us = {}, {}
        for sname, n, k in shapes:
            x8, w = operands(max(ms), n, k, seed=7)
            for m in ms:
                x = x8[:m]
                if (sname, m) not in refs:
                    refs[(sname, m)] = ms_of(lambda: torch.matmul(x, w.t()))
                    graph_refs[(sname, m)] = graph_ms_of(lambda: torch.matmul(x, w.t()))
                try:
                    ratios[(sname, m)] = refs[(sname, m)] / ms_of(lambda: tbik.tree_matmul(x, w.t()))
                    graph_us[(sname, m)] = graph_ms_of(lambda: tbik.tree_matmul(x, w.t())) * 1e3
                    out = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
                    first = bits.setdefault((sname, m), out)
                    if not same_bits(out, first):  # every configuration must give the default's bits
                        moved.append(f"{name} {sname} M={m}")
                except Exception as err:  # a configuration that does not compile: say so, go on
                    print(f"{name} {sname} M={m}: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
        big = [r for (_, m), r in ratios.items() if m >= 128]
        small = [r for (_, m), r in ratios.items() if m <= 32]
        rows.append((name, f"{geomean(big):.3f}", f"{geomean(small):.3f}",
                     *(f"{ratios[c]:.2f}" if c in ratios else "-" for c in cells)))
        graph_rows.append((name, f"{sum(graph_us.values()):.1f}",
                           *(f"{graph_us[c]:.1f}" if c in graph_us else "-" for c in cells)))
        print(" | ".join(map(str, rows[-1])), flush=True)
        for key, kernel in compiled_kernels().items():
            if key in seen:
                continue
            seen.add(key)
            kernel_rows.append((name, getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?"),
                                getattr(kernel.metadata, "shared", "?")))
    set_config(default, default_few)

    split_rows = []
    for sname, n, k in shapes:
        x8, w = operands(max(ms), n, k, seed=8)
        for m in ms:
            x = x8[:m]
            ref = graph_ms_of(lambda: torch.matmul(x, w.t()))
            times = [graph_ms_of(lambda: tbik.tree_matmul(x, w.t(), _split=split)) for split in (1, 2, 4, 8)]
            best = (1, 2, 4, 8)[times.index(min(times))]
            split_rows.append((sname, m, f"{ref * 1e3:.1f}", *(f"{t * 1e3:.1f}" for t in times), best,
                               strategy(x, w, k)))
    head = ["config (bf16), eager", "geomean M>=128", "geomean M<=32", *(f"{s} M={m}" for s, m in cells)]
    verdict = ("every configuration gave the first one's fp32 bits in every cell" if not moved
               else "BITS DIFFER from the first configuration: " + "; ".join(moved))
    graph_head = ["config (bf16), CUDA graph us", "sum", *(f"{s} M={m}" for s, m in cells)]
    graph_ref = ("cuBLAS", f"{sum(graph_refs.values()) * 1e3:.1f}", *(f"{graph_refs[c] * 1e3:.1f}" for c in cells))
    return (table(head, rows) + "\n\n" + table(graph_head, [graph_ref, *graph_rows]) + "\n\n" + verdict + "\n\n"
            + table(["config", "registers", "spills", "shared bytes"], kernel_rows) + "\n\n"
            + table(["shape", "M", "graph: cuBLAS us", "SPLIT=1 us", "2 us", "4 us", "8 us", "best", "heuristic"],
                    split_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", default=["probe", "accuracy", "bench"],
                        choices=["probe", "accuracy", "bench", "sweep", "host"])
    parser.add_argument("--out", help="folder for <what>.md")
    parser.add_argument("--json", help="bench's rows and geometric means, kept with other devices' (see above)")
    parser.add_argument("--configs", help="sweep's tile configurations, ';'-separated, e.g. '64x128x64 w4 s3 R1 TMA' "
                        "('shipped': tl/matmul.py's choice by the number of rows)")
    parser.add_argument("--shapes", help="bench's and sweep's linear shapes, ','-separated NAME:N:K "
                        "(default: Qwen3-8B's)")
    parser.add_argument("--ms", help="bench's and sweep's row counts, ','-separated (default: 1,8,32,128,512,2048,8192)")
    parser.add_argument("--repeat", type=int, default=1, help="run bench this many times; --json keeps each row's median")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {device_name()}\n", flush=True)
    shapes = [(name, int(n), int(k)) for name, n, k in (s.split(":") for s in args.shapes.split(","))] \
        if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS
    for what in [w for w in args.what for _ in range(args.repeat if w == "bench" else 1)]:
        t = time.time()
        text = {"probe": probe, "accuracy": accuracy, "bench": lambda: bench(shapes, ms), "host": host,
                "sweep": lambda: sweep(args.configs.split(";") if args.configs else SWEEP_CONFIGS, shapes, ms)}[what]()
        text = f"## {what}\n\ndevice: {device_name()}\n\n{text}\n\n({time.time() - t:.0f} s)\n"
        print(text, flush=True)
        if args.out:
            with open(os.path.join(args.out, f"{what}.md"), "w") as f:
                f.write(text)
    if args.json and BENCH_ROWS:
        write_bench_json(args.json)


def write_bench_json(path: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from repaudit.files import write_json_atomic

    device = torch.cuda.get_device_name()
    runs: dict[tuple, list[dict]] = {}
    for r in BENCH_ROWS:  # one entry per bench run (--repeat)
        runs.setdefault((r["shape"], r["M"]), []).append(r)
    mine = [{"device": device, **same[0], "runs": len(same),
             **{k: statistics.median(r[k] for r in same) for k in same[0] if isinstance(same[0][k], float)}}
            for same in runs.values()]
    old = json.load(open(path)) if os.path.exists(path) else {"rows": [], "summary": {}}
    rows = [r for r in old["rows"] if r["device"] != device] + mine
    ratios = lambda keep: [r["ratio"] for r in mine if keep(r["M"])]  # noqa: E731
    summary = {**old["summary"], device: {
        "geomean_m_ge_128": geomean(ratios(lambda m: m >= 128)), "geomean_m_le_32": geomean(ratios(lambda m: m <= 32)),
        "relerr_ratio_max": max(r["relerr_ratio"] for r in mine), "runs": len(next(iter(runs.values()))),
        "versions": device_name(), "command": " ".join(["python3 benchmarks/kernels.py", *sys.argv[1:]])}}
    write_json_atomic(path, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
