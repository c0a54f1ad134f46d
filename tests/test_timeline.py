"""benchmarks/timeline.py: a GPU's idle gaps charged to the host ops that launched the work
ending them, and per-step spans, on a hand-made trace whose answers are known."""

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("timeline", ROOT / "benchmarks" / "timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat not in timeline._GPU else 0, "tid": tid, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    # Host: step markers on their own thread; on another, two ops each launching one kernel; the GPU idles from 20 to 38
    # (waiting for "attn"'s launch at 35) and from 48 to 78 (waiting for "norm"'s at 75). A
    # second stream's copy overlapping the first kernel closes no gap. A graph replay at 100
    # launches the last kernel, in the step from the marker at 90 to the one at 120.
    return [
        _x("user_annotation", "step", 0, 1, tid=2), _x("user_annotation", "step", 90, 1, tid=2),
        _x("user_annotation", "step", 120, 1, tid=2),
        _x("cpu_op", "layer", 0, 85),
        _x("cpu_op", "attn", 10, 30), _x("cuda_runtime", "cudaLaunchKernel", 35, 2, corr=7),
        _x("cpu_op", "norm", 50, 30), _x("cuda_runtime", "cudaLaunchKernel", 75, 2, corr=8),
        _x("cuda_runtime", "cudaGraphLaunch", 100, 3, corr=9),
        _x("kernel", "k1", 0, 20, tid=7, corr=6), _x("gpu_memcpy", "copy", 5, 10, tid=8, corr=5),
        _x("kernel", "k2", 38, 10, tid=7, corr=7), _x("kernel", "k3", 78, 10, tid=7, corr=8),
        _x("kernel", "k4", 104, 6, tid=7, corr=9),
    ]


def test_gaps_are_charged_to_the_op_that_launched_the_work_ending_them():
    r = timeline.analyse(_trace())
    assert r["gpu_window_us"] == 110 and r["gpu_busy_us"] == 46
    assert r["idle_us"] == 18 + 30 + 16
    assert dict(map(tuple, r["idle_by_launching_call"])) == {
        "cudaLaunchKernel in norm": 30, "cudaLaunchKernel in attn": 18, "cudaGraphLaunch in (no op)": 16}
    assert dict(map(tuple, r["idle_by_outermost_host_op"])) == {"layer": 48, "(no op)": 16}
    # What the launching thread ran while the GPU waited: the layer (outermost), inside it attn
    # and norm; nothing while the graph replay's kernel waited (the layer had ended).
    assert dict(map(tuple, r["host_ops_during_idle"])) == {"layer": 18 + 30}
    assert dict(map(tuple, r["host_ops_during_idle_depth1"])) == {"attn": 18, "norm": 28}
    assert r["gaps_by_size"]["10-100us"] == [3, 64]


def test_steps_run_from_one_marker_to_the_next_with_their_gpu_time(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    events = timeline.load(str(path))
    # Two steps: from the marker at 0 to the one at 90, k1 (the copy inside it), k2, k3; then the
    # graph replay's k4.
    assert timeline.steps(events, "step") == [{"span_us": 90, "gpu_busy_us": 40, "kernels": 3, "graph_replay": False},
                                              {"span_us": 30, "gpu_busy_us": 6, "kernels": 1, "graph_replay": True}]
    assert timeline.graph_step_kernels(events, "step") == [["k4", 6]]
    written = timeline.summarise(str(path), tmp_path / "gaps.json", wall_s=0.5)
    assert json.loads((tmp_path / "gaps.json").read_text()) == written and written["wall_us"] == 5e5
