"""benchmarks/rank_skew.py: two ranks' hand-made timelines, one host-bound, whose answers are known."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("rank_skew", ROOT / "benchmarks" / "rank_skew.py")
rank_skew = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rank_skew)


def _x(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat == "kernel" else 1, "tid": 7 if cat == "kernel" else 1,
         "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _layers(host: list[tuple[float, float]], gpu: list[tuple[float, float]]) -> list[dict]:
    """Two layers of (a plugin op launching a matmul, vLLM's all-reduce): host[i] and gpu[i] are
    the i-th op's host span and its kernel's GPU span."""
    events = []
    for i, ((h0, h1), (g0, g1)) in enumerate(zip(host, gpu)):
        op, kernel = (("repaudit::tbik_partial", "_tree_matmul_ws_kernel") if i % 2 == 0
                      else ("vllm::all_reduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"))
        events += [_x("cpu_op", op, h0, h1 - h0), _x("cuda_runtime", "cuLaunchKernelEx", h1 - 1, 1, corr=i),
                   _x("kernel", kernel, g0, g1 - g0, corr=i)]
    return events


# Matmuls take 10 us on the GPU, the all-reduce's transfer 5 us. Rank 1's plugin op takes 40 us on
# the host, rank 0's 5 us: rank 1's GPU waits for its host (55 to 85), and rank 0's all-reduces
# wait for rank 1 (each ends 5 us after rank 1's starts).
RANK0 = _layers(host=[(0, 5), (5, 10), (10, 15), (15, 20)], gpu=[(5, 15), (15, 55), (55, 65), (65, 100)])
RANK1 = _layers(host=[(0, 40), (40, 45), (45, 85), (85, 90)], gpu=[(40, 50), (50, 55), (85, 95), (95, 100)])


def test_the_rank_the_others_wait_for_shows_its_idle_gpu_and_its_slower_host():
    fast, slow = rank_skew.rank_summary(RANK0), rank_skew.rank_summary(RANK1)
    assert fast["idle_us"] == 0 and slow["idle_us"] == 30
    assert fast["collective_us"] == 40 + 35 and slow["collective_us"] == 5 + 5  # the wait sits on the fast rank
    assert fast["other_kernels_us"] == slow["other_kernels_us"] == 20
    assert fast["host_ops"]["repaudit::tbik_partial"] == {"calls": 2, "median_us": 5, "sum_us": 10}
    assert slow["host_ops"]["repaudit::tbik_partial"] == {"calls": 2, "median_us": 40, "sum_us": 80}
    assert set(slow["host_ops"]) == {"repaudit::tbik_partial", "vllm::all_reduce"}
    table = rank_skew.markdown([fast, slow])
    assert "| collective kernels | 0.1 ms | 0.0 ms |" in table  # milliseconds: 75 and 10 us
    assert "| host: `repaudit::tbik_partial`, median | 5 us x 2 | 40 us x 2 |" in table


def test_only_the_named_host_ops_are_listed():
    events = RANK1 + [_x("cpu_op", "aten::empty", 100, 3)]
    assert "aten::empty" not in rank_skew.rank_summary(events)["host_ops"]
    assert "aten::empty" in rank_skew.rank_summary(events, prefixes=("aten::",))["host_ops"]


def test_collectives_are_told_from_compute_kernels_by_name():
    assert rank_skew.is_collective("ncclDevKernel_AllGather_RING_LL")
    assert rank_skew.is_collective("void vllm::cross_device_reduce_1stage<float, 2>")
    assert not rank_skew.is_collective("_tree_matmul_ws_kernel")
    assert not rank_skew.is_collective("_rms_norm_kernel")
