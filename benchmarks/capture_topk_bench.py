"""The vLLM capture's top-k ids of a step's logits: repaudit's four kernels (row_values.top_ids)
against what the capture ran before, torch.topk and a cat behind the sampled ids. bf16 rows of
Qwen3's vocabulary, as vLLM's sampler hands them over. GPU time: CUDA-event medians of one call
in a CUDA graph; host time: the median of eager calls; and whether each gives the records' ids
(row_values.reference_topk: the k largest, equal values by lowest id).

    python3 benchmarks/capture_topk_bench.py [--rows 1,32,256] [--k 6] [--json reports/perf/capture_topk.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

from benchmarks.capture_host_bench import per_call_us  # noqa: E402
from benchmarks.paged_attention_bench import graph_us  # noqa: E402
from repaudit.engines.row_values import reference_topk, top_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=6, help="top-k ids per row (the record's top-k plus one)")
    ap.add_argument("--json", type=Path, help="append the rows to this JSON list")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    command = f"python3 benchmarks/capture_topk_bench.py --rows {args.rows} --vocab {args.vocab} --k {args.k}"
    print(f"| rows | torch.topk + cat: GPU us | top_ids: GPU us | GPU ratio | host us (torch / top_ids) | "
          f"records' ids (torch / top_ids) |\n|---|---|---|---|---|---|")
    for n in (int(r) for r in args.rows.split(",")):
        logits = (torch.randn(n, args.vocab, generator=g, device="cuda") * 3).bfloat16()
        first = logits.argmax(-1, keepdim=True).to(torch.int64)
        outs = {}
        fns = {"torch": lambda: outs.__setitem__("torch", torch.cat((first, torch.topk(logits, args.k, dim=-1).indices), dim=1)),
               "top_ids": lambda: outs.__setitem__("top_ids", top_ids(logits, first, args.k))}
        gpu = graph_us(fns)
        host = {name: per_call_us(fn) for name, fn in fns.items()}
        want = torch.cat((first, reference_topk(logits.float(), args.k)[1]), dim=1)
        same = {name: bool(torch.equal(outs[name], want)) for name in fns}
        print(f"| {n} | {gpu['torch']:.1f} | {gpu['top_ids']:.1f} | {gpu['top_ids'] / gpu['torch']:.3f} | "
              f"{host['torch']:.1f} / {host['top_ids']:.1f} | {same['torch']} / {same['top_ids']} |", flush=True)
        rows.append({"device": device, "rows": n, "vocab": args.vocab, "k": args.k, "dtype": "bfloat16",
                     "torch_topk_us": gpu["torch"], "top_ids_us": gpu["top_ids"], "ratio": gpu["top_ids"] / gpu["torch"],
                     "torch_topk_host_us": host["torch"], "top_ids_host_us": host["top_ids"],
                     "records_ids": same, "command": command})
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(old + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
