"""Tracing overhead: engine time of one cell with and without `--trace`'s hooks.

    python benchmarks/trace_bench.py [--model builtin:tiny-qwen3] [--device cpu|cuda] [--probes smoke] [--batch-size 4]
                                     [--json reports/perf/trace_overhead.json]

Loads the model once (TP=1), runs score and generate over the suite untraced, traced,
untraced, traced, and reports the median engine time of each. Target: traced <= 2x.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

from repaudit import builtin  # noqa: E402
from repaudit.engines import hf  # noqa: E402
from repaudit.files import write_json_atomic  # noqa: E402
from repaudit.engines.base import Sequence  # noqa: E402
from repaudit.probes import load_suite  # noqa: E402
from repaudit.run.model import ModelRef, load_tokenizer, stop_ids, tokenize  # noqa: E402
from repaudit.run.trace import Tracer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-qwen3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--probes", default="smoke")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="then print cProfile's most expensive calls of one traced cell per mode")
    ap.add_argument("--gpu-profile", help="then write torch.profiler's kernel table of one traced and one untraced "
                    "cell per mode to this file")
    ap.add_argument("--ablate", action="store_true", help="then time traced cells with parts of the trace left out "
                    "(hooks that return at once; hooks without the digest kernel; no Tracer.finish): where the time goes")
    ap.add_argument("--json", help="merge the rows into this JSON list (rows of the same device and batch are replaced)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = builtin.ensure(args.model)
    tok = load_tokenizer(ModelRef(args.model, path, None), False)
    prompts = tokenize(load_suite(args.probes), tok, args.max_new_tokens, None)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    m = hf.load(str(path), dtype=dtype, device=args.device, tp=1, stop_ids=stop_ids(path, tok), pad_id=tok.pad_token_id)
    seqs = [Sequence(p.id, tuple(p.tokens), None, p.max_new_tokens) for p in prompts]

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def cell(mode: str, traced: bool, part: str = "all") -> tuple[float, float]:
        """Seconds of the whole cell, and of the trace's assembly at its end (Tracer.finish).
        `part` (--ablate) leaves a part of the trace out: "hooks" (hooks that return at once),
        "no-kernel" (hooks that do all but launch the digest kernel), "no-finish"."""
        m.tracer = Tracer(m.model, 1) if traced else None
        if part == "hooks":
            m.tracer._record = lambda *a, **k: None
        t0 = time.perf_counter()
        run = hf.generate if mode == "generate" else hf.score
        batch_seqs = seqs if mode == "generate" else [Sequence(s.prompt_id, s.prompt, tuple(s.prompt[:8]), 0) for s in seqs]
        for i in range(0, len(batch_seqs), args.batch_size):
            run(m, batch_seqs[i:i + args.batch_size], 5)
        finish_s = 0.0
        if traced:
            m.tracer.detach()
            sync()
            t1 = time.perf_counter()
            if part == "all":
                m.tracer.finish()
            finish_s = time.perf_counter() - t1
            m.tracer = None
        sync()
        return time.perf_counter() - t0, finish_s

    print(f"| mode | untraced s | traced s | traced / untraced | of which Tracer.finish s |  ({args.model}, "
          f"{args.device}, {args.probes}, batch {args.batch_size}, median of {args.repeats})")
    print("|---|---|---|---|---|")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU {platform.machine()}, 1 thread"
    rows = []
    for mode in ("score", "generate"):
        cell(mode, False)  # warm-up (and, traced, the digest kernel's one compile)
        cell(mode, True)
        plain = statistics.median(cell(mode, False)[0] for _ in range(args.repeats))
        runs = [cell(mode, True) for _ in range(args.repeats)]
        traced, finish = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"| {mode} | {plain:.3f} | {traced:.3f} | {traced / plain:.2f} | {finish:.3f} |")
        rows.append({"device": device, "model": args.model, "probes": args.probes, "mode": mode, "batch": args.batch_size,
                     "untraced_s": plain, "traced_s": traced, "ratio": traced / plain, "traced_finish_s": finish,
                     "command": " ".join(["python3 benchmarks/trace_bench.py", *sys.argv[1:]])})
        if args.json:  # after every mode: a run cut short keeps what it measured
            _write(Path(args.json), device, args, rows)
    if args.ablate:
        _ablate(cell, args.repeats)
    if args.gpu_profile:
        from torch.profiler import ProfilerActivity, profile

        with open(args.gpu_profile, "w") as f:
            for mode in ("score", "generate"):
                for traced in (False, True):
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        cell(mode, traced)
                    f.write(f"\n## {mode}, {'traced' if traced else 'untraced'}\n")
                    f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    if args.profile:
        for mode in ("score", "generate"):
            prof = cProfile.Profile()
            prof.runcall(cell, mode, True)
            print(f"\n## cProfile, one traced {mode} cell (tottime)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)


def _ablate(cell, repeats: int) -> None:
    from repaudit.record import digest_kernel

    real = digest_kernel.digest_rows, digest_kernel.digest_many
    zeros: dict = {}

    def no_kernel(x, rows=None, offset=0, pick=None, owned=None):
        # Views of one zeroed buffer: no launch, and a graph's warm-up finds the two digests equal.
        n, k = x.shape[0] if rows is None else rows.numel(), 0 if pick is None else pick.numel()
        if (n, k, x.device) not in zeros:
            zeros[n, k, x.device] = (torch.zeros(n, dtype=torch.int64, device=x.device),
                                     torch.zeros((n, k), dtype=torch.int32, device=x.device))
        return zeros[n, k, x.device]

    def no_kernel_many(xs, rows, offsets, picks, owneds, table_for=None):
        return [no_kernel(x, rows, 0, p) for x, p in zip(xs, picks)], []

    print("\n| mode | untraced s | hooks that return | hooks without the kernel | all but finish | traced s |")
    print("|---|---|---|---|---|---|")
    for mode in ("score", "generate"):
        times = {}
        for name, traced, part in (("untraced", False, "all"), ("hooks", True, "hooks"), ("no-kernel", True, "no-kernel"),
                                   ("no-finish", True, "no-finish"), ("traced", True, "all")):
            digest_kernel.digest_rows, digest_kernel.digest_many = (no_kernel, no_kernel_many) if part == "no-kernel" else real
            try:
                cell(mode, traced, part)
                times[name] = statistics.median(cell(mode, traced, part)[0] for _ in range(repeats))
            finally:
                digest_kernel.digest_rows, digest_kernel.digest_many = real
        print(f"| {mode} | " + " | ".join(f"{t:.3f}" for t in times.values()) + " |", flush=True)


def _write(path: Path, device: str, args, rows: list[dict]) -> None:
    old = json.loads(path.read_text()) if path.exists() else []
    keep = [r for r in old if (r["device"], r["batch"], r["probes"]) != (device, args.batch_size, args.probes)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, keep + rows)


if __name__ == "__main__":
    main()
