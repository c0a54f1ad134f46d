"""Which rank the others wait for at TP > 1: every rank's GPU idle time, collective kernel time
and host time per op, side by side, each from the rank's own timeline (vllm_speed.py --profile DIR
--timeline writes one a rank).

A collective's kernel time on one rank is mostly its wait for the slowest rank, so a rank-0
profile alone reads a host-bound peer as a slow all-reduce. The rank whose GPU idles longest is
the one the others wait for; where its ops take longer on the host than on the GPU, it is
host-bound.

    python3 benchmarks/rank_skew.py DIR/timeline-tbik-tp2-rank0.json.gz DIR/timeline-tbik-tp2-rank1.json.gz [--md OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timeline  # noqa: E402  (benchmarks/timeline.py)
import vllm_speed  # noqa: E402  (benchmarks/vllm_speed.py: its kernel kinds)

HOST_PREFIXES = ("repaudit::", "vllm::")


def is_collective(kernel: str) -> bool:
    return vllm_speed.kernel_kind(kernel) == vllm_speed.COLLECTIVES


def rank_summary(events: list[dict], prefixes: tuple[str, ...] = HOST_PREFIXES) -> dict:
    """One rank: GPU window and idle time (timeline.analyse), kernel time in collectives and in
    the rest, and per host op named with one of `prefixes`: its calls and median host time."""
    gaps = timeline.analyse(events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    host: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"].startswith(prefixes):
            host.setdefault(e["name"], []).append(e["dur"])
    return {
        "gpu_window_us": gaps["gpu_window_us"], "idle_us": gaps["idle_us"],
        "collective_us": round(sum(e["dur"] for e in kernels if is_collective(e["name"])), 1),
        "other_kernels_us": round(sum(e["dur"] for e in kernels if not is_collective(e["name"])), 1),
        "host_ops": {name: {"calls": len(d), "median_us": round(statistics.median(d), 1), "sum_us": round(sum(d), 1)}
                     for name, d in sorted(host.items(), key=lambda kv: -sum(kv[1]))},
    }


def markdown(summaries: list[dict]) -> str:
    head = "| | " + " | ".join(f"rank {r}" for r in range(len(summaries))) + " |"
    rule = "|---" * (len(summaries) + 1) + "|"
    ms = lambda us: f"{us / 1e3:.1f} ms"  # noqa: E731
    lines = [head, rule]
    for label, key in (("GPU window", "gpu_window_us"), ("GPU idle", "idle_us"),
                       ("collective kernels", "collective_us"), ("other kernels", "other_kernels_us")):
        lines.append(f"| {label} | " + " | ".join(ms(s[key]) for s in summaries) + " |")
    names = list(dict.fromkeys(n for s in summaries for n in s["host_ops"]))
    for name in names:
        cells = []
        for s in summaries:
            op = s["host_ops"].get(name)
            cells.append(f"{op['median_us']:.0f} us x {op['calls']}" if op else "—")
        lines.append(f"| host: `{name}`, median | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="one Chrome trace per rank, in rank order")
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args()
    text = markdown([rank_summary(timeline.load(t)) for t in args.traces])
    print(text, end="")
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
