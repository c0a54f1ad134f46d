"""README's speed table is what reports/perf/*.json holds (benchmarks/perf_table.py made it)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("perf_table", ROOT / "benchmarks" / "perf_table.py")
perf_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(perf_table)


def test_readme_speed_table_matches_the_measured_json():
    assert perf_table.readme_block((ROOT / "README.md").read_text()) == perf_table.table()


def test_every_measured_row_reaches_the_table_with_its_ratio_and_command():
    rows = perf_table.rows()
    files = [ROOT / "reports" / "perf" / name for name in ("engine_speed.json", "vllm_speed.json", "trace_overhead.json")]
    measured = [r for f in files if f.exists() for r in json.loads(f.read_text())]
    assert measured
    expected = 0
    for r in measured:
        # The row's own ratio, then the ratios derived from it: against vLLM with the same
        # logprobs, and against stock's plain tokens/s (the cell's, and plain generation's).
        ratios = [r["ratio"]] if r.get("ratio") is not None else []
        if "plain_logprobs_tok_s" in r:
            ratios.append(r["repaudit_tok_s"] / r["plain_logprobs_tok_s"])
        ratios += [r[k] for k in ("ratio_vs_stock", "plain_ratio_vs_stock") if k in r]
        for ratio in ratios:
            assert any(row[2].startswith(f"{ratio:.3f}x") and row[3] == r["device"] and row[4] == r["command"]
                       for row in rows), (ratio, r["command"])
        expected += len(ratios)
    # The engine at batch 32 on vLLM's workload against plain stock vLLM on the same GPU and TP,
    # measured in the same call (the same evidence): with vLLM's own batching and with vLLM capped
    # at the engine's batch size, each the latest; no row against another call's vLLM.
    engine = json.loads(files[0].read_text())
    vllm = [v for v in json.loads(files[1].read_text()) if v["kernels"] == "stock"]
    for r in engine:
        if r["mode"] != "generate" or r["batch"] != 32 or not r.get("workload", "").startswith("random"):
            continue
        same = [v for v in vllm if v["device"].split("x ", 1)[-1] == r["device"] and v["tp"] == r["tp"]
                and r.get("evidence") and v.get("evidence") == r["evidence"]]
        for want in ({}, {"max_num_seqs": 32}):
            peers = [v for v in same if (v.get("vllm_args") or {}) == want]
            if peers:
                ratio = r["repaudit_tok_s"] / peers[-1]["plain_tok_s"]
                assert any(row[2].startswith(f"{ratio:.3f}x") and row[4] == f"{r['command']}; {peers[-1]['command']}"
                           for row in rows), want
                expected += 1
    # tbik's kernels: the matmul's geometric means per device, every all-reduce row.
    matmul_file, allreduce_file = ROOT / "reports" / "perf" / "tbik_matmul.json", ROOT / "reports" / "perf" / "allreduce.json"
    summary = json.loads(matmul_file.read_text())["summary"] if matmul_file.exists() else {}
    for device, s in summary.items():
        for key in ("geomean_m_ge_128", "geomean_m_le_32"):
            assert any(row[2] == f"{s[key]:.3f}x" and row[3] == device and row[4] == s["command"] for row in rows), key
            expected += 1
    for r in json.loads(allreduce_file.read_text()) if allreduce_file.exists() else []:
        assert any(row[2].startswith(f"gather {r['ratio_gather']:.3f}x") and r["message"] in row[0]
                   and row[3] == r["device"] and row[4] == r["command"] for row in rows), r["message"]
        expected += 1
    capture_file = ROOT / "reports" / "perf" / "capture_topk.json"
    for r in json.loads(capture_file.read_text()) if capture_file.exists() else []:
        assert any(row[2].startswith(f"{r['ratio']:.3f}x") and f"[{r['rows']}, {r['vocab']}]" in row[0]
                   and row[3] == r["device"] and row[4] == r["command"] for row in rows), r["rows"]
        expected += 1
    assert len(rows) == expected


def test_a_long_engine_argument_shows_its_ends_and_length():
    sizes = [1, 2, 4, 8, 16, 512, 16384]
    assert perf_table._arg_text({"cudagraph_capture_sizes": sizes}) == "{cudagraph_capture_sizes: [1, 2, ..., 16384] (7 values)}"
    assert perf_table._arg_text([1, 2, 4]) == "[1, 2, 4]"
    assert perf_table._arg_text(0.45) == "0.45"
