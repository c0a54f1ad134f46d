"""The host side of `--trace` at a real model's row count: Tracer.finish() on a trace of some
14 million rows (tokens x hooked module outputs), made by a 28-layer model as narrow as
tiny-qwen3 so that the forwards stay cheap on a CPU.

    python3 benchmarks/trace_finish.py [--prompts 216] [--profile]

A 28-layer model at Qwen3 widths records about 500 rows per token; the default suite has 27,477
tokens, so a traced cell of Qwen3-0.6B shapes ends with about this many rows. On a GPU the
concatenations run on the device; the key columns and the Arrow table are host work either way.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import numpy as np  # noqa: E402

from repaudit import builtin  # noqa: E402
from repaudit.engines import hf  # noqa: E402
from repaudit.engines.base import Sequence  # noqa: E402
from repaudit.run.model import ModelRef, load_tokenizer, stop_ids  # noqa: E402
from repaudit.run.trace import Tracer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=216, help="prompts of 128 random tokens, scored in batches of 8")
    ap.add_argument("--profile", action="store_true", help="print finish()'s most expensive calls")
    args = ap.parse_args()
    tiny = builtin.BUILTINS["tiny-qwen3"]
    builtin.BUILTINS["deep-tiny-qwen3"] = builtin.BuiltinSpec("deep-tiny-qwen3", "qwen3",
                                                              {**tiny.config, "num_hidden_layers": 28}, tiny.seed)
    path = builtin.ensure("builtin:deep-tiny-qwen3")
    tok = load_tokenizer(ModelRef("deep-tiny-qwen3", path, None), False)
    m = hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=stop_ids(path, tok), pad_id=tok.pad_token_id)
    rng = np.random.default_rng(0)
    seqs = [Sequence(f"p{i}", tuple(rng.integers(0, 250, 128).tolist()), tuple(rng.integers(0, 250, 8).tolist()), 0)
            for i in range(args.prompts)]
    m.tracer = Tracer(m.model, 1)
    t0 = time.perf_counter()
    for i in range(0, len(seqs), 8):
        hf.score(m, seqs[i:i + 8], 5)
    forwards = time.perf_counter() - t0
    m.tracer.detach()
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    table, _ = m.tracer.finish()
    if prof:
        prof.disable()
    print(f"{table.num_rows:,} rows; traced forwards {forwards:.2f} s; finish {time.perf_counter() - t0:.3f} s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
