"""Does torch's SDPA give the same bits when it reads a static cache's key/value heads directly
(enable_gqa=True), with or without its boolean mask made additive beforehand, as when it reads
them repeated to the query heads (transformers' repeat_kv, which it does whenever it passes a
mask)? The first, with the boolean mask, is what repaudit's stock attention relies on
(repaudit/run/stock_attention.py). And does a decode step's attention keep its bits when the
masked slots at the cache's end are left out? Qwen3-0.6B's heads (16 query, 8 key/value, 128
wide), bf16, boolean masks with left padding as transformers builds them for a static cache.
Prints one line per case: bitwise equal or not, each variant's CUDA-event microseconds, and the
kernels each ran.

    python3 benchmarks/sdpa_gqa_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.attention_bench import event_us  # noqa: E402


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def case(batch: int, queries: int, slots: int, filled: int, gen: torch.Generator) -> dict:
    """`filled` slots written (the prompt, left-padded per row, then the decoded tokens); the
    query rows are the last `queries` of them."""
    dev = "cuda"
    q = torch.randn(batch, queries, 16, 128, generator=gen, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, 8, slots, 128, generator=gen, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch, 8, slots, 128, generator=gen, device=dev, dtype=torch.bfloat16)
    pads = torch.randint(0, max(1, filled - queries), (batch,), generator=gen, device=dev)
    slot = torch.arange(slots, device=dev)
    rows = torch.arange(filled - queries, filled, device=dev)
    mask = (slot[None, None, :] >= pads[:, None, None]) & (slot[None, None, :] <= rows[None, :, None])
    mask = mask[:, None]  # [batch, 1, queries, slots]
    kr, vr = repeat_kv(k, 2), repeat_kv(v, 2)
    additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    runs = {
        "repeated": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask),
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        # repaudit's stock attention is "gqa": it passes the mask as transformers does, since SDPA's
        # own conversion of a boolean mask fills with a backend- and version-dependent value
        "gqa-additive": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True),
    }
    cut = -(-filled // 128) * 128
    if cut < slots:
        runs["repeated-cut"] = lambda: F.scaled_dot_product_attention(
            q, kr[:, :, :cut], vr[:, :, :cut], attn_mask=mask[..., :cut])
    ref = runs["repeated"]()
    row = {"batch": batch, "queries": queries, "slots": slots, "filled": filled}
    for name, fn in runs.items():
        out = fn()
        row[name] = {"equal": bool(torch.equal(out.view(torch.int16), ref.view(torch.int16))),
                     "us": round(event_us(fn, reps=30), 2), "kernels": kernels(fn)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, queries, slots, filled in [(32, 1, 640, 520), (32, 1, 640, 600), (32, 1, 640, 639), (8, 1, 300, 200),
                                          (1, 1, 144, 100), (32, 1, 2048, 1500), (8, 1, 96, 40),
                                          (32, 512, 640, 512), (8, 77, 93, 77), (1, 300, 316, 300)]:
        row = case(batch, queries, slots, filled, gen)
        rows.append(row)
        parts = [f"{k} {'==' if v['equal'] else '!='} {v['us']}us" for k, v in row.items() if isinstance(v, dict)]
        print(f"batch {batch} queries {queries} slots {slots} filled {filled}: " + ", ".join(parts), flush=True)
        for k, v in row.items():
            if isinstance(v, dict):
                print(f"    {k}: {v['kernels']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
