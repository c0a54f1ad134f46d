"""Where the record-value kernels' time goes, against the passes a scored token needs anyway
(the fp32 cast of the logits, torch's or tbik's log-softmax): CUDA-event times of each, on rows of
151,936 columns. `rounds_in_every_segment_us` is one kernel that hashes and takes top-k
candidates in every segment (the design before the threshold skip); `digest_only_us` and
`rounds_only_us` are its halves. `widen_us` is the fp32 cast that takes the digest's partials on
its way (row_values_kernel.widen_gpu), `row_values_given_digest_us` the record values after it:
together they replace `float_copy_us` + `row_values_us`.

    python3 benchmarks/row_values_bench.py [--rows 1,32,1100] [--json out.json]
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from repaudit.engines import row_values_kernel as rvk  # noqa: E402
from repaudit.record.digest_kernel import BASE, mix  # noqa: E402


@triton.jit
def _variant_kernel(lp_ptr, logit_ptr, lp_stride, logit_stride, n_cols, base, key_ptr, col_ptr, part_ptr,
                    SEG: tl.constexpr, K: tl.constexpr, DIGEST: tl.constexpr, TOPK: tl.constexpr):
    """Digest and top-k rounds in every segment, either half switched off by a flag."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_seg = tl.num_programs(1)
    cols = s * SEG + tl.arange(0, SEG)
    live = cols < n_cols
    row = r.to(tl.int64)
    if DIGEST:
        bits = (tl.load(logit_ptr + row * logit_stride + cols, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF).to(tl.uint64)
        acc = tl.where(live, mix(bits ^ mix(cols.to(tl.uint64) + base)), 0)
        tl.store(part_ptr + r * n_seg + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))
    if TOPK:
        keys = tl.where(live, rvk._order_key(tl.load(lp_ptr + row * lp_stride + cols, mask=live, other=0)), -2147483648)
        out = (r * n_seg + s) * K
        for j in tl.static_range(K):
            top = tl.max(keys, axis=0)
            col = tl.min(tl.where(keys == top, cols, 2147483647), axis=0)
            tl.store(key_ptr + out + j, top)
            tl.store(col_ptr + out + j, col)
            keys = tl.where(cols == col, -2147483648, keys)


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,1100")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows_out = []
    for n in (int(x) for x in args.rows.split(",")):
        raw = torch.randn(n, args.vocab, device="cuda").to(torch.bfloat16)
        logits = raw.float()
        lp = torch.log_softmax(logits, -1)
        targets = torch.randint(0, args.vocab, (n,), device="cuda")
        k = args.topk
        n_seg = triton.cdiv(args.vocab, rvk.SEGMENT)
        keys = torch.empty((n, n_seg * k), dtype=torch.int32, device="cuda")
        cols, parts = torch.empty_like(keys), torch.empty((n, n_seg), dtype=torch.int64, device="cuda")
        given = rvk.digest_parts(n, args.vocab, torch.device("cuda"))

        def variant(digest: bool, topk: bool):
            return lambda: _variant_kernel[(n, n_seg)](lp.view(torch.int32), logits.view(torch.int32), lp.stride(0),
                                                       logits.stride(0), args.vocab, BASE, keys, cols, parts,
                                                       SEG=rvk.SEGMENT, K=k, DIGEST=digest, TOPK=topk, num_warps=8)

        row = {"rows": n, "vocab": args.vocab, "topk": k, "device": torch.cuda.get_device_name(),
               "float_copy_us": _time(lambda: logits.copy_(raw)),
               "torch_log_softmax_us": _time(lambda: torch.log_softmax(logits, -1, out=lp)),
               "tbik_log_softmax_us": _time(lambda: tbik.log_softmax(logits, -1, out=lp)),
               "row_values_us": _time(lambda: rvk.row_values_gpu(logits, lp, targets, k)),
               "widen_us": _time(lambda: rvk.widen_gpu(raw, logits, given)),
               "row_values_given_digest_us": _time(lambda: rvk.row_values_gpu(logits, lp, targets, k, given)),
               "rounds_in_every_segment_us": _time(variant(True, True)),
               "digest_only_us": _time(variant(True, False)),
               "rounds_only_us": _time(variant(False, True))}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1) + "\n")


if __name__ == "__main__":
    main()
