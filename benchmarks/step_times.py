"""The plain runs' model steps from a benchmarks/vllm_speed.py --steps row: per run, the steps
that took more than twice the run's median step (those that prefill prompts: vLLM runs them
outside its CUDA graphs once a step holds more than 512 tokens) apart from the rest (decode
steps, graph replays).

    python3 benchmarks/step_times.py reports/vllm/h200x2-prefill-steps/call2/vllm_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def split(steps: list[float]) -> tuple[list[float], list[float]]:
    """(long steps, the others): a long step takes more than twice the run's median step."""
    median = statistics.median(steps)
    return [s for s in steps if s > 2 * median], [s for s in steps if s <= 2 * median]


def table(row: dict) -> list[str]:
    lines = [f"### {row['kernels']}, TP={row['tp']}: plain `LLM.generate` runs",
             "", "| run s | steps | long steps: n, sum s | long steps, ms | other steps: sum s, median ms |",
             "|---|---|---|---|---|"]
    for run, steps in zip(row["plain_runs_s"], row["plain_step_s"]):
        if not steps:  # a worker that timed no step (a model runner without execute_model)
            lines.append(f"| {run:.3f} | 0 | | | |")
            continue
        long, rest = split(steps)
        lines.append(f"| {run:.3f} | {len(steps)} | {len(long)}, {sum(long):.3f} | "
                     f"{', '.join(f'{s * 1e3:.0f}' for s in long)} | {sum(rest):.3f}, {statistics.median(rest) * 1e3:.2f} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", help="vllm_speed.py --json output, run with --steps")
    args = ap.parse_args()
    for row in json.load(open(args.json)):
        if "plain_step_s" in row:
            print("\n".join(table(row)))


if __name__ == "__main__":
    main()
