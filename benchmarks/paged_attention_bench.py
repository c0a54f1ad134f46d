"""tbik's paged attention at a vLLM step's shapes, under launch settings other than the ones it
ships with: the time of each, and whether its output has the shipped kernel's bits.

The shapes are Qwen3-0.6B's at TP=2 (8 query and 4 key/value heads of 128 a rank) over a
cache of 16-token blocks in shuffled order: a decode step of 256 requests whose sequences hold
64-640 keys (what the decode steps of benchmarks/vllm_speed.py run), and a prefill chunk of 32
requests of 256 new tokens after 0-256 cached ones. Settings: warps and pipeline stages, which
change no arithmetic, and the tile's query rows (BLOCK_M), which may change the MMA instruction
Triton picks. CUDA-event time of one call, median of 50.

    python3 benchmarks/paged_attention_bench.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

import tbik  # noqa: E402
from attention_bench import event_us  # noqa: E402  (beside this file)
from tbik.tl import attention as kernels  # noqa: E402

HQ, HKV, D, BLOCK = 8, 4, 128, 16
SETTINGS = [dict(num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3, 4)] + \
    [dict(BLOCK_M=m) for m in (16, 32, 128)]


def _case(g, n_req: int, new: int, cached_lo: int, cached_hi: int):
    """query [n_req * new, HQ, D], the caches, and the step's metadata in vLLM's layout."""
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
    k = torch.randn(n_blocks, BLOCK, HKV, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(n_blocks, BLOCK, HKV, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(n_req * new, HQ, D, generator=g, device="cuda").bfloat16()
    qsl = torch.arange(0, n_req * new + 1, new, dtype=torch.int32, device="cuda")
    return q, k, v, qsl, seq_lens, table, new


def _run(case):
    q, k, v, qsl, seq_lens, table, new = case
    return tbik.paged_attention(q, k, v, qsl, seq_lens, table, max_query_len=new, scale=D ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"decode, 256 requests, 64-640 keys": _case(g, 256, 1, 63, 639),
             "prefill chunk, 32 requests x 256 new, 0-256 cached": _case(g, 32, 256, 0, 256)}
    shipped_meta, shipped_m = kernels._meta, kernels._BLOCK_M
    rows = []
    print("| case | setting | us | shipped us | shipped / this | bits equal |\n|---|---|---|---|---|---|")
    for name, case in cases.items():
        base = _run(case).clone()
        base_us = event_us(lambda: _run(case))
        for setting in SETTINGS:
            m = setting.get("BLOCK_M", shipped_m)
            kernels._BLOCK_M = m
            kernels._meta = lambda q_, dim, s=setting: {**shipped_meta(q_, dim), **s}
            try:
                same = torch.equal(_run(case).view(torch.int16), base.view(torch.int16))
                us = event_us(lambda: _run(case))
            except Exception as e:  # a setting Triton cannot compile: say so, go on
                same, us = f"error: {type(e).__name__}", float("nan")
            finally:
                kernels._meta, kernels._BLOCK_M = shipped_meta, shipped_m
            label = ", ".join(f"{k}={v}" for k, v in setting.items())
            print(f"| {name} | {label} | {us:.1f} | {base_us:.1f} | {base_us / us:.2f} | {same} |", flush=True)
            rows.append({"device": torch.cuda.get_device_name(), "case": name, "setting": setting, "us": us,
                         "shipped_us": base_us, "bits_equal": same,
                         "command": " ".join(["python3 benchmarks/paged_attention_bench.py", *sys.argv[1:]])})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
