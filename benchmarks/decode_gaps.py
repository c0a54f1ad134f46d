"""Where a CUDA-graph decode step's wall time goes, per kernel mode, at batch 32 on vLLM's
workload (benchmarks/vllm_speed.py's random prompts): one generation by the engine, then its
last captured step replayed alone, back to back, and profiled.

- loop ms/step: the engine's decode loop (replay, the inputs copied in, the outputs copied out,
  the loop's own bookkeeping on the device), the batch's graph capture included;
- capture ms: that capture (an eager warm-up step, the captured step, the first replay), once a
  batch, between two synchronizations;
- replay ms/step: graph.replay() alone, N times, between two CUDA events;
- kernels ms/step: the sum of the replay's kernel durations (torch.profiler), and how many;
- the difference between the last two is the device idle between a graph's kernels.

    python3 benchmarks/decode_gaps.py [--kernels stock,bi,tbik] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402


def main() -> None:
    from benchmarks.engine_speed import _prompts
    from repaudit.engines import hf, hf_decode
    from repaudit.engines.base import Sequence
    from repaudit.run.kernelmodes import kernel_mode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:qwen3-0.6b")
    ap.add_argument("--kernels", default="stock,bi,tbik")
    ap.add_argument("--replays", type=int, default=100, help="at most 110: the steps of a 128-token generation")
    ap.add_argument("--json")
    args = ap.parse_args()
    ref, tok, specs = _prompts(args.model, 128, 32)
    hfm = hf.load(str(ref.path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=tok.pad_token_id)
    batch = [Sequence(p.id, tuple(p.tokens), None, 128) for p in specs]
    made: list = []
    plain = hf_decode.GraphedStep

    def recording(*a, **k):
        made.append(plain(*a, **k))
        return made[-1]

    hf.hf_decode.GraphedStep = recording
    captures: list[float] = []
    capture = plain._capture

    def timed_capture(self, *a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = capture(self, *a)
        torch.cuda.synchronize()
        captures.append(time.perf_counter() - t0)
        return out

    plain._capture = timed_capture
    rows = []
    for kernels in args.kernels.split(","):
        with kernel_mode(hfm, kernels), torch.inference_mode():
            hf.generate(hfm, batch, 5)  # warm-up: Triton, cuBLAS, the allocator
            made.clear()
            captures.clear()
            _, timing = hf.generate(hfm, batch, 5)
            graph, cache = made[-1].graph, made[-1].cache
            # Each replay writes the next cache slot: step back so that the replays fit the cache.
            hf_decode._set_cache_lengths(cache, [n - args.replays - 10 for n in hf_decode._cache_lengths(cache)])
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            end.synchronize()
            replay_ms = start.elapsed_time(end) / args.replays
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
            kernels_run = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            row = {"device": torch.cuda.get_device_name(), "kernels": kernels, "batch": len(batch),
                   "loop_ms_per_step": timing.decode_s * 1000 / (timing.decode_tokens / len(batch)),
                   "capture_ms": sum(captures) * 1000,
                   "replay_ms_per_step": replay_ms,
                   "kernel_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels_run) / 1000 / 10,
                   "kernels_per_step": len(kernels_run) / 10,
                   "command": " ".join(["benchmarks/decode_gaps.py", *sys.argv[1:]])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    hf.hf_decode.GraphedStep = plain
    plain._capture = capture
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
