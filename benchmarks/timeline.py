"""Where a GPU waits: the idle gaps of one worker's profiled timeline, and what its host was doing.

Reads a Chrome trace written by torch.profiler with CPU and CUDA activities (vllm_speed.py
--profile DIR --timeline writes one a rank). The GPU's busy time is the union of its kernels,
copies and sets on every stream; a gap is a stretch between two busy spans. Each gap is charged
to the host op that launched the GPU work ending it (the runtime call holding the same
correlation id, and the op stacks around that call on its thread), and the host ops running
during the gap are summed by name: a gap the host fills with Python is host-bound.

    python3 benchmarks/timeline.py TRACE.json[.gz] [--json OUT] [--steps-by EVENT]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

_GPU = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST = {"cpu_op", "user_annotation", "python_function"}
_RUNTIME = {"cuda_runtime", "cuda_driver"}
_SIZES = ((10, "<10us"), (100, "10-100us"), (1000, "0.1-1ms"), (float("inf"), ">=1ms"))


def load(path: str) -> list[dict]:
    """A Chrome trace's complete events (plain or gzipped JSON)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


class _Thread:
    """One host thread's ops, nested as the profiler records them (a child inside its parent)."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.events]
        self.parent: list[int] = []
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and self.events[stack[-1]]["ts"] + self.events[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def stack_at(self, t: float) -> list[str]:
        """Names of the ops holding time t, outermost first."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.events[i]["ts"] + self.events[i]["dur"] < t:
            i = self.parent[i]
        names = []
        while i >= 0:
            names.append(self.events[i]["name"])
            i = self.parent[i]
        return names[::-1]

    def overlap(self, lo: float, hi: float, depth: int) -> dict[str, float]:
        """Microseconds of [lo, hi] inside each op at the given nesting depth (0: outermost).
        Ops of one depth never overlap (one holding another would be deeper), so they are one
        sorted run of disjoint spans."""
        if not hasattr(self, "_levels"):
            self._levels: dict[int, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
            depth_of: list[int] = []
            for i, e in enumerate(self.events):
                d = depth_of[self.parent[i]] + 1 if self.parent[i] >= 0 else 0
                depth_of.append(d)
                starts, ends, names = self._levels[d]
                starts.append(e["ts"])
                ends.append(e["ts"] + e["dur"])
                names.append(e["name"])
        starts, ends, names = self._levels.get(depth, ([], [], []))
        out: dict[str, float] = defaultdict(float)
        for j in range(bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)):
            a, b = max(lo, starts[j]), min(hi, ends[j])
            if b > a:
                out[names[j]] += b - a
        return out


def _busy(gpu: list[dict]) -> list[tuple[float, float, dict]]:
    """The GPU's busy spans (start, end, the event that opened the span)."""
    spans: list[list] = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        if spans and e["ts"] <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([e["ts"], end, e])
    return [tuple(s) for s in spans]


def _top(d: dict[str, float], n: int = 25) -> list[list]:
    return [[k, round(v, 1)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


def analyse(events: list[dict]) -> dict:
    gpu = [e for e in events if e.get("cat") in _GPU]
    busy = _busy(gpu)
    threads = {}
    for key, evs in _group(e for e in events if e.get("cat") in _HOST).items():
        threads[key] = _Thread(evs)
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") in _RUNTIME and "args" in e}
    by_size: dict[str, list] = {label: [0, 0.0] for _, label in _SIZES}
    by_launcher: dict[str, float] = defaultdict(float)
    by_outer: dict[str, float] = defaultdict(float)
    host_during: dict[str, float] = defaultdict(float)
    host_during_inner: dict[str, float] = defaultdict(float)
    total = 0.0
    for (_, end0, _), (start1, _, opener) in zip(busy, busy[1:]):
        gap = start1 - end0
        if gap <= 0:
            continue
        total += gap
        label = next(lbl for limit, lbl in _SIZES if gap < limit)
        by_size[label][0] += 1
        by_size[label][1] += gap
        call = runtime.get(opener.get("args", {}).get("correlation"))
        if call is None:
            by_launcher["(no launching call found)"] += gap
            continue
        thread = threads.get((call["pid"], call["tid"]))
        stack = thread.stack_at(call["ts"]) if thread else []
        by_launcher[f"{call['name']} in {stack[-1] if stack else '(no op)'}"] += gap
        by_outer[stack[0] if stack else "(no op)"] += gap
        if thread:
            for name, us in thread.overlap(end0, start1, 0).items():
                host_during[name] += us
            for name, us in thread.overlap(end0, start1, 1).items():
                host_during_inner[name] += us
    kernels_us = sum(e["dur"] for e in gpu)
    window = (busy[-1][1] - busy[0][0]) if busy else 0.0
    return {
        "gpu_window_us": round(window, 1), "gpu_busy_us": round(sum(b - a for a, b, _ in busy), 1),
        "gpu_event_us": round(kernels_us, 1), "idle_us": round(total, 1),
        "gaps_by_size": {k: [n, round(us, 1)] for k, (n, us) in by_size.items()},
        "idle_by_launching_call": _top(by_launcher), "idle_by_outermost_host_op": _top(by_outer),
        "host_ops_during_idle": _top(host_during), "host_ops_during_idle_depth1": _top(host_during_inner),
    }


def steps(events: list[dict], marker: str) -> list[dict]:
    """Per step, a step running from one host event named `marker` to the next (vLLM's sampler
    gathers its logits once a step: "nccl:_all_gather_base"): its span, the GPU's busy time
    in it, its kernels, and whether a CUDA graph replay launched them."""
    marks = sorted(e["ts"] for e in events if e["name"] == marker and e.get("cat") in _HOST)
    busy = _busy([e for e in events if e.get("cat") in _GPU])
    graphs = sorted(e["ts"] for e in events if e["name"] == "cudaGraphLaunch")
    kernels = sorted(e["ts"] for e in events if e.get("cat") == "kernel")
    ends = [b for _, b, _ in busy]
    out = []
    for lo, hi in zip(marks, marks[1:]):
        used = 0.0
        for a, b, _ in busy[bisect.bisect_right(ends, lo):]:
            if a >= hi:
                break
            used += min(b, hi) - max(a, lo)
        out.append({"span_us": round(hi - lo, 1), "gpu_busy_us": round(used, 1),
                    "kernels": bisect.bisect_left(kernels, hi) - bisect.bisect_left(kernels, lo),
                    "graph_replay": bisect.bisect_left(graphs, hi) > bisect.bisect_left(graphs, lo)})
    return out


def graph_step_kernels(events: list[dict], marker: str, top: int = 20) -> list[list]:
    """Kernel time per name, in microseconds per step, over the steps a CUDA graph replay ran
    (steps() delimits them): what a decode step's GPU time is made of."""
    marks = sorted(e["ts"] for e in events if e["name"] == marker and e.get("cat") in _HOST)
    graphs = sorted(e["ts"] for e in events if e["name"] == "cudaGraphLaunch")
    spans = [(lo, hi) for lo, hi in zip(marks, marks[1:])
             if bisect.bisect_left(graphs, hi) > bisect.bisect_left(graphs, lo)]
    starts = [lo for lo, _ in spans]
    per: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") != "kernel":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] < spans[i][1]:
            per[e["name"]] += e["dur"]
    return [[name, round(us / max(len(spans), 1), 1)] for name, us in _top(per, top)]


def _group(events) -> dict:
    out: dict = defaultdict(list)
    for e in events:
        out[(e["pid"], e["tid"])].append(e)
    return out


def summarise(trace: str, out: Path, wall_s: float | None = None) -> dict:
    """analyse() of `trace`, written to `out` (JSON); the trace is then gzipped beside itself."""
    result = analyse(load(trace))
    if wall_s is not None:
        result["wall_us"] = round(wall_s * 1e6, 1)
    out.write_text(json.dumps(result, indent=1))
    if not trace.endswith(".gz"):
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
    print(f"timeline: GPU idle {result['idle_us'] / 1e6:.3f} s of a {result['gpu_window_us'] / 1e6:.3f} s window ({out})",
          flush=True)
    for name, us in result["idle_by_launching_call"][:10]:
        print(f"  {us / 1e3:9.1f} ms idle before work launched by {name[:120]}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json")
    ap.add_argument("--steps-by", metavar="EVENT", help="also each step's span and GPU time, a step running from one "
                    "host event of this name to the next")
    args = ap.parse_args()
    events = load(args.trace)
    result = analyse(events)
    if args.steps_by:
        result["steps_by"] = args.steps_by
        result["steps"] = steps(events, args.steps_by)
        result["graph_step_kernels_us_per_step"] = graph_step_kernels(events, args.steps_by)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
