"""Time `repaudit diff` end to end on two synthetic 10M-row records, next to a naive pandas baseline.

    .venv/bin/python benchmarks/diff_bench.py [--rows 10000000] [--runs 3] [--out benchmarks/results/diff_bench.json]

The records look like a real score-mode audit: 5,000 prompts x 2,000 positions, top-5 lists,
row digests; B differs from A in about a third of the logprobs by 1..2,000 ULP (what fp32
TP=1 vs TP=2 looks like on CPU). Each command runs as a fresh subprocess (interpreter start-up,
imports, terminal table and --json report included); `repaudit_s` is the median of the runs.
Peak memory is the max RSS of that child alone (wait4), and the records are made in a
separate process: a child's ru_maxrss also counts the RSS of the process that spawned it
(Linux carries the parent's high-water mark over fork/exec), so a parent that had just built
10M-row arrays would be billed to every child.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from repaudit.records import RecordMeta, build_table, write_table  # noqa: E402

K = 5


def make_pair(rows: int, directory: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    per_prompt = 2000
    n_prompts = rows // per_prompt
    ids = np.repeat(np.array([f"prompt-{i:05d}" for i in range(n_prompts)], dtype=object), per_prompt)
    pos = np.tile(np.arange(per_prompt, dtype=np.int32), n_prompts)
    tok = rng.integers(0, 151936, rows, dtype=np.int32)
    lp = -rng.exponential(2.0, rows).astype(np.float32)
    topk_ids = rng.integers(0, 151936, (rows, K), dtype=np.int32)
    topk_lp = -np.sort(rng.exponential(2.0, (rows, K)).astype(np.float32), axis=1)
    digest = rng.integers(0, 2**63, rows, dtype=np.int64).view(np.uint64)
    moved = rng.random(rows) < 0.33
    lp_b = lp.copy()
    delta = rng.integers(1, 2000, int(moved.sum()), dtype=np.int32)
    lp_b[moved] = (lp[moved].view(np.int32) + delta).view(np.float32)
    digest_b = digest.copy()
    digest_b[moved] ^= np.uint64(1)
    paths = []
    for name, logprob, dig in (("a", lp, digest), ("b", lp_b, digest_b)):
        table = build_table(prompt_id=ids, pos=pos, token_id=tok, logprob=logprob, phase=None,
                            topk_ids=topk_ids, topk_logprobs=topk_lp, row_digest=dig)
        meta = RecordMeta(cell={"id": name}, env={}, probes={"name": "synthetic", "sha256": "0"},
                          model={"id": "synthetic"}, tokenizer={"name": "synthetic", "sha256": "0"}, prompts=[], topk=K)
        paths.append(write_table(directory / f"{name}.parquet", table, meta).path)
    return paths[0], paths[1]


NAIVE = r"""
import sys, numpy as np, pandas as pd
a = pd.read_parquet(sys.argv[1], columns=["prompt_id", "pos", "token_id", "logprob", "row_digest", "topk_ids"])
b = pd.read_parquet(sys.argv[2], columns=["prompt_id", "pos", "token_id", "logprob", "row_digest", "topk_ids"])
m = a.merge(b, on=["prompt_id", "pos"], suffixes=("_a", "_b"))
ab = m["logprob_a"].to_numpy().view(np.int32).astype(np.int64)
bb = m["logprob_b"].to_numpy().view(np.int32).astype(np.int64)
oa = np.where(ab < 0, -(ab & 0x7FFFFFFF), ab); ob = np.where(bb < 0, -(bb & 0x7FFFFFFF), bb)
ulp = np.abs(oa - ob)
d = (m["logprob_a"].astype("float64") - m["logprob_b"].astype("float64")).abs()
p = (np.exp(m["logprob_a"].astype("float64")) - np.exp(m["logprob_b"].astype("float64"))).abs()
top1 = m["topk_ids_a"].str[0] == m["topk_ids_b"].str[0]
first = m[ulp > 0].groupby("prompt_id", observed=True)["pos"].min()
print((ulp == 0).mean(), ulp.max(), np.percentile(ulp, 99), d.max(), p.max(), (m["row_digest_a"] == m["row_digest_b"]).mean(), top1.mean(), len(first))
"""


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (GiB) of this child alone, exit code."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        if rc not in (0, 1):
            err.seek(0)
            raise SystemExit(f"{cmd[:3]} failed: {err.read().decode(errors='replace')[-2000:]}")
    return wall, usage.ru_maxrss / 1024 / 1024, rc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=3, help="repaudit diff runs (the median is reported)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "diff_bench.json")
    ap.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # internal: write the two records into this directory
    args = ap.parse_args()
    if args.make:
        make_pair(args.rows, args.make)
        return
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--make", tmp], check=True)
        a, b = Path(tmp) / "a.parquet", Path(tmp) / "b.parquet"
        os.sync()  # the records' writeback (1.2 GB) would otherwise run during the timed commands
        print(f"made two records of {args.rows} rows in {time.perf_counter() - t0:.1f}s "
              f"({os.path.getsize(a) / 2**20:.0f} MiB each)")
        load = os.getloadavg()[0]
        exe = [sys.executable, "-m", "repaudit", "diff", str(a), str(b), "--json", str(Path(tmp) / "d.json")]
        runs = [timed(exe) for _ in range(max(1, args.runs))]
        walls = sorted(r[0] for r in runs)
        wall = statistics.median(walls)
        peak = max(r[1] for r in runs)
        naive_wall, naive_peak, _ = timed([sys.executable, "-c", NAIVE, str(a), str(b)])
    result = {
        "rows": args.rows, "repaudit_s": wall, "repaudit_rows_per_s": args.rows / wall,
        "repaudit_min_s": walls[0], "repaudit_runs_s": [r[0] for r in runs],
        "repaudit_peak_gib": peak, "naive_s": naive_wall, "naive_peak_gib": naive_peak,
        "speedup": naive_wall / wall, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_avg_1min_before": load, "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
