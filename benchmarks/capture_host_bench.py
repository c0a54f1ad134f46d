"""Host time of the vLLM cell's per-step capture (repaudit/engines/vllm_capture.py), without vLLM
running: the sampling wrapper around a stand-in sampler, on logits of vLLM's shape, and each of
its operations alone. A vLLM step at small batches is bound by the host, so these microseconds
are what a cell adds to every step.

    python3 benchmarks/capture_host_bench.py [--rows 32] [--vocab 151936] [--k 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402


def per_call_us(fn, n: int = 400, group: int = 20) -> float:
    """Median host microseconds of fn() over n calls, in groups with a sync before each (the
    GPU never falls so far behind that a launch has to wait for a free slot)."""
    times = []
    for _ in range(n // group):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(group):
            fn()
        times.append((time.perf_counter() - t0) / group * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=6, help="top-k ids per row (the record's top-k plus one)")
    args = ap.parse_args()
    from vllm.v1.worker.gpu.sample import logprob

    from repaudit.engines import row_values, vllm_capture

    logits = torch.randn(args.rows, args.vocab, device="cuda")
    sampled = logits.argmax(-1).to(torch.int32)
    out = SimpleNamespace(logprobs_tensors=None, sampled_token_ids=sampled.view(-1, 1), num_sampled=None)
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(args.rows)])
    wrapped = vllm_capture._sampling_with_capture(lambda self, lg, ib: out)
    vllm_capture._state.k, vllm_capture._state.steps = args.k, []

    def step():
        wrapped(None, logits, batch)
        if len(vllm_capture._state.steps) > 100:
            vllm_capture._state.steps.clear()

    first = sampled.view(-1, 1).to(torch.int64)
    ids = torch.cat((first, torch.topk(logits, args.k, dim=-1).indices), dim=1)

    def aside():
        with vllm_capture._aside(logits, first):
            pass

    # An alternative measured beside the capture: vLLM's log-softmax kernel launched through
    # tbik's CachedKernel (the same binary, so the same bits) and every op in line.
    from tbik.tl.launcher import CachedKernel

    kernel = CachedKernel(logprob._topk_log_softmax_kernel)

    def cached(ids):
        lps = logits.new_empty(ids.shape, dtype=torch.float32)
        kernel((ids.shape[0],), (lps, logits, logits.stride(0), ids, ids.shape[1], logits.shape[1]),
               {"BLOCK_SIZE": 1024, "TOPK_BLOCK_SIZE": 8})
        return lps

    assert torch.equal(cached(ids).view(torch.int32), logprob.compute_token_logprobs(logits, ids).view(torch.int32))

    def lean():
        f = out.sampled_token_ids.view(-1, 1).to(torch.int64, copy=True)
        s = torch.ones_like(f[:, 0])
        i = torch.cat((f, torch.topk(logits, args.k, dim=-1).indices), dim=1)
        return list(batch.req_ids), i, cached(i), s, logits.argmax(dim=-1)

    ops = {
        "capture, whole step": step,
        "ids: view + to(int64)": lambda: sampled.view(-1, 1).to(torch.int64, copy=True),
        "ones_like": lambda: torch.ones_like(first[:, 0]),
        "side stream: wait, enter, exit, record_stream x2": aside,
        "topk": lambda: torch.topk(logits, args.k, dim=-1),
        "row_values.top_ids (the capture's top-k ids, four launches)": lambda: row_values.top_ids(logits, first, args.k),
        "cat": lambda: torch.cat((first, ids[:, 1:]), dim=1),
        "compute_token_logprobs (vLLM's Triton launch)": lambda: logprob.compute_token_logprobs(logits, ids),
        "argmax": lambda: logits.argmax(dim=-1),
        "list(req_ids)": lambda: list(batch.req_ids),
        "vLLM's log-softmax kernel through tbik's CachedKernel": lambda: cached(ids),
        "in line, CachedKernel launch: the ops of a step": lean,
    }
    print(f"| operation | host us a call | (rows {args.rows}, vocab {args.vocab}, k {args.k}, {torch.cuda.get_device_name()}) |")
    print("|---|---|---|")
    for name, fn in ops.items():
        fn()
        print(f"| {name} | {per_call_us(fn):.1f} | |", flush=True)


if __name__ == "__main__":
    main()
