"""The tree matmul's tiles for few rows, side by side in one process: the transformers engine's
generate (CUDA-graph decode steps) with tbik/tl/matmul.py's tiles chosen by the number of rows
against one 64x128 tile for every M (and the SPLIT cost model that came with it), alternating
run by run on the same loaded model, prompts and batches. The two runs' records must be the
same bit for bit (every logprob, top-k entry, row digest and token); the script says so or
exits 1.

    python3 benchmarks/tiles_ab.py [--kernels tbik,bi] [--batch 32] [--random 64] [--new 128] \\
        [--runs 3] [--json FILE]

Rows: device, kernels, batch, workload, one_size_tok_s, by_rows_tok_s, ratio (median of the
pairs' by_rows / one_size), pair_ratios, decode step times, same_bits, command.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _one_size_split(m, n, k_len, leaves, tiles, elem_bytes, device):
    """The SPLIT cost model that went with one tile size: least bytes per occupied SM."""
    from tbik.tl.launcher import num_sms

    sms = num_sms(device)
    best, best_cost, split = 1, None, 1
    while split <= leaves:
        traffic = n * k_len * elem_bytes + (split > 1) * split * m * n * 4
        cost = traffic / min(1.0, tiles * split / sms)
        if best_cost is None or cost < best_cost:
            best, best_cost = split, cost
        split *= 2
    return best


@contextmanager
def one_size():
    """tl/matmul.py as it was: 64x128 tiles for every M, SPLIT from the cost model."""
    from tbik.tl import matmul as tm

    few, pick, plan = dict(tm._FEW_ROWS), tm._pick_split, tm._plan
    shape = {}

    def pick_one_size(leaves, tiles, device):
        return _one_size_split(shape["m"], shape["n"], shape["k"], leaves, tiles, shape["elem"], device)

    @functools.lru_cache(maxsize=None)
    def plan_one_size(dtype, out_dtype, device, m, n, k_len, *rest):
        shape.update(m=m, n=n, k=k_len, elem=dtype.itemsize)
        return plan.__wrapped__(dtype, out_dtype, device, m, n, k_len, *rest)

    for dtype in few:
        tm._FEW_ROWS[dtype] = ()
    tm._pick_split, tm._plan = pick_one_size, plan_one_size
    try:
        yield
    finally:
        tm._FEW_ROWS.update(few)
        tm._pick_split, tm._plan = pick, plan


def _same(a, b) -> bool:
    fields = ("pos", "token_id", "logprob", "top1", "topk_ids", "topk_logprobs", "digest")
    def bits(v):
        return np.ascontiguousarray(v).view(np.uint8)

    return len(a) == len(b) and all(
        x.prompt_id == y.prompt_id and all((getattr(x, f) is None) == (getattr(y, f) is None)
                                           and (getattr(x, f) is None or np.array_equal(bits(getattr(x, f)),
                                                                                        bits(getattr(y, f))))
                                           for f in fields)
        for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:qwen3-0.6b")
    ap.add_argument("--kernels", default="tbik,bi")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--random", type=int, default=64, help="random prompts of 64-512 tokens (vllm_speed.py's)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from benchmarks.engine_speed import _prompts
    from repaudit.engines import hf
    from repaudit.engines.base import Sequence, Timing
    from repaudit.files import write_json_atomic
    from repaudit.run.kernelmodes import kernel_mode
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    ref, tok, specs = _prompts(args.model, args.new, args.random)
    hfm = hf.load(str(ref.path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=tok.pad_token_id)
    seqs = [Sequence(p.id, tuple(p.tokens), None, args.new) for p in specs]
    batches = [seqs[i:i + args.batch] for i in range(0, len(seqs), args.batch)]

    def run():
        torch.cuda.synchronize()
        t0, rows, timing = time.perf_counter(), [], Timing()
        for b in batches:
            r, t = hf.generate(hfm, b, args.topk)
            rows += r
            timing.add(t)
        torch.cuda.synchronize()
        n = sum(int((r.pos >= r.prompt_len).sum()) for r in rows)
        return time.perf_counter() - t0, n, rows, timing

    out = []
    for kernels in args.kernels.split(","):
        with kernel_mode(hfm, kernels):
            pairs, same = [], True
            for i in range(args.runs + 1):  # the first pair warms up (compiles, allocator, captures)
                with one_size():
                    old = run()
                new = run()
                same &= _same(old[2], new[2])
                if i:
                    pairs.append((old, new))
            tok_s = lambda k: statistics.median(p[k][1] / p[k][0] for p in pairs)  # noqa: E731
            step_ms = lambda k: statistics.median(p[k][3].decode_s / max(1, p[k][3].decode_tokens) * args.batch * 1e3  # noqa: E731
                                                  for p in pairs)
            ratios = [(n[1] / n[0]) / (o[1] / o[0]) for o, n in pairs]
            row = {"device": torch.cuda.get_device_name(), "engine": "hf", "kernels": kernels, "mode": "generate",
                   "batch": args.batch, "workload": f"random:{args.random}x64-512", "new_tokens": args.new,
                   "one_size_tok_s": tok_s(0), "by_rows_tok_s": tok_s(1), "ratio": statistics.median(ratios),
                   "pair_ratios": ratios, "one_size_step_ms": step_ms(0), "by_rows_step_ms": step_ms(1),
                   "same_bits": same, "command": " ".join(["python3 benchmarks/tiles_ab.py", *sys.argv[1:]])}
            print(json.dumps(row), flush=True)
            out.append(row)
            if args.json:
                write_json_atomic(args.json, out)
    if not all(r["same_bits"] for r in out):
        print("RECORDS DIFFER between the two tile choices", file=sys.stderr)
        sys.exit(1)
    print("records bitwise identical with either tile choice, every kernel mode", flush=True)


if __name__ == "__main__":
    main()
