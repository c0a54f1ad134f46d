"""README's speed table, made from the measured rows in reports/perf/*.json.

    python3 benchmarks/perf_table.py          # rewrite the table between the markers in README.md
    python3 benchmarks/perf_table.py --check  # exit 1 if README's table is not what the JSON gives

Each row names its device and the command that measured it; nothing here is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "reports" / "perf"
BEGIN, END = "<!-- perf-table:begin (benchmarks/perf_table.py) -->", "<!-- perf-table:end -->"


def _load(name: str, empty=()):
    path = PERF / name
    return json.loads(path.read_text()) if path.exists() else list(empty)


def _tok(x: float) -> str:
    return f"{x:,.0f}"


def rows() -> list[list[str]]:
    out = []
    vllm_rows = _load("vllm_speed.json")
    for r in _load("engine_speed.json"):
        what = _engine_what(r)
        if r.get("ratio") is not None:
            # A row with pair_ratios gives the median of its back-to-back pairs' ratios; the
            # tokens/s are each side's median.
            how = f"median of {len(r['pair_ratios'])} pairs; medians " if r.get("pair_ratios") else ""
            if r["ratio"] < 0.9 <= round(r["ratio"], 3):  # three decimals would read as met
                how = f"{r['ratio']:.4f}, under the target; {how}"
            out.append([f"transformers engine / plain transformers, {what}", "≥ 0.9x",
                        f"{r['ratio']:.3f}x ({how}{_tok(r['repaudit_tok_s'])} / {_tok(r['baseline_tok_s'])} tok/s)",
                        r["device"], r["command"]])
        if r["mode"] == "generate" and r["batch"] == 32 and r.get("workload", "").startswith("random"):
            for v, how in vllm_peers(r, vllm_rows):
                out.append([f"transformers engine, {what} / plain vLLM `LLM.generate` ({v['prompts']} prompts x "
                            f"{v['new_tokens']} new, {how}; another process)", "≥ 0.25x",
                            f"{r['repaudit_tok_s'] / v['plain_tok_s']:.3f}x ({_tok(r['repaudit_tok_s'])} / "
                            f"{_tok(v['plain_tok_s'])} tok/s)", r["device"], f"{r['command']}; {v['command']}"])
    for r in vllm_rows:
        args = "".join(f", {k}={_arg_text(v)}" for k, v in (r.get("vllm_args") or {}).items())
        note = f" ({r['note']})" if r.get("note") else ""
        if r.get("interleaved"):
            args += ", every mode loaded at once, runs taken in turn"
        if r.get("plain_runs_s"):
            args += f", median of {len(r['plain_runs_s'])} runs"
        out.append([f"vLLM cell / plain `LLM.generate`, {r['kernels']}, TP={r['tp']}, {r['prompts']} prompts x "
                    f"{r['new_tokens']} new{args}" + note,
                    "≥ 0.9x", f"{r['ratio']:.3f}x ({_tok(r['repaudit_tok_s'])} / {_tok(r['plain_tok_s'])} tok/s)",
                    r["device"], r["command"]])
        if "plain_logprobs_tok_s" in r:
            out.append([f"vLLM cell / `LLM.generate` with the cell's logprobs (top-{r['topk']}), {r['kernels']}, TP={r['tp']}, "
                        f"{r['prompts']} prompts x {r['new_tokens']} new", "—",
                        f"{r['repaudit_tok_s'] / r['plain_logprobs_tok_s']:.3f}x ({_tok(r['repaudit_tok_s'])} / "
                        f"{_tok(r['plain_logprobs_tok_s'])} tok/s)", r["device"], r["command"]])
        if "ratio_vs_stock" in r:
            out.append([f"vLLM {r['kernels']} cell / plain stock `LLM.generate`, TP={r['tp']}, {r['prompts']} prompts x "
                        f"{r['new_tokens']} new{args}{note}", "≥ 0.8x at TP=2" if r["kernels"] == "tbik" else "—",
                        f"{r['ratio_vs_stock']:.3f}x ({_tok(r['repaudit_tok_s'])} / {_tok(r['stock_plain_tok_s'])} tok/s)",
                        r["device"], r["command"]])
        if "plain_ratio_vs_stock" in r:
            out.append([f"plain `LLM.generate` with {r['kernels']} / plain stock `LLM.generate`, TP={r['tp']}, "
                        f"{r['prompts']} prompts x {r['new_tokens']} new{args}{note}", "≥ 0.8x at TP=2" if r["kernels"] == "tbik" else "—",
                        f"{r['plain_ratio_vs_stock']:.3f}x ({_tok(r['plain_tok_s'])} / {_tok(r['stock_plain_tok_s'])} tok/s)",
                        r["device"], r["command"]])
    for r in _load("trace_overhead.json"):
        note = f" ({r['note']})" if r.get("note") else ""
        out.append([f"`--trace` overhead, {r['mode']}, {r['model']}, `{r['probes']}` suite, batch {r['batch']}{note}",
                    "≤ 2x (CPU), ≤ 1.5x (GPU)", f"{r['ratio']:.3f}x ({r['traced_s']:.2f} s / {r['untraced_s']:.2f} s)",
                    r["device"], r["command"]])
    out += _kernel_rows()
    return out


def _arg_text(value) -> str:
    """An engine argument as the table shows it: a long list (CUDA-graph capture sizes) as its ends
    and its length."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_arg_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > 6:
        return f"[{value[0]}, {value[1]}, ..., {value[-1]}] ({len(value)} values)"
    return str(value)


def vllm_peers(engine_row: dict, vllm_rows: list[dict]) -> list[tuple[dict, str]]:
    """Plain stock vLLM measured in the engine row's own call (the same `evidence`) on its GPU and
    TP: the latest row with vLLM's own batching and the latest with max_num_seqs capped at the
    engine's batch size. vLLM's tokens/s moves a lot from call to call, so a ratio against
    another call's vLLM would say little; such engine rows get no vLLM row."""
    if not engine_row.get("evidence"):
        return []
    rows = [v for v in vllm_rows if v["kernels"] == "stock" and v["tp"] == engine_row["tp"]
            and v["device"].split("x ", 1)[-1] == engine_row["device"] and v.get("evidence") == engine_row["evidence"]]
    own = [v for v in rows if not v.get("vllm_args")]
    capped = [v for v in rows if (v.get("vllm_args") or {}) == {"max_num_seqs": engine_row["batch"]}]
    return ([(own[-1], "its own batching")] if own else []) + \
        ([(capped[-1], f"max_num_seqs={engine_row['batch']}")] if capped else [])


def _kernel_rows() -> list[list[str]]:
    out = []
    matmul = _load("tbik_matmul.json", {"rows": [], "summary": {}})
    for device, s in (matmul or {}).get("summary", {}).items():
        for key, target, which in (("geomean_m_ge_128", "≥ 0.80x", "M ≥ 128"), ("geomean_m_le_32", "≥ 0.75x", "M ≤ 32")):
            out.append([f"tbik.tree_matmul / cuBLAS (torch.matmul), bf16, Qwen3-8B linear shapes, {which}, geometric mean "
                        f"(median of {s['runs']} runs; error vs fp64 at most {s['relerr_ratio_max']:.3f}x cuBLAS's)", target,
                        f"{s[key]:.3f}x", device, s["command"]])
    for r in _load("capture_topk.json"):
        out.append([f"the vLLM cell's top-{r['k']} ids of a step (row_values.top_ids) / torch.topk + cat, {r['dtype']} "
                    f"[{r['rows']}, {r['vocab']}], CUDA graph replays", "—",
                    f"{r['ratio']:.3f}x ({r['top_ids_us']:.1f} / {r['torch_topk_us']:.1f} us)", r["device"], r["command"]])
    for r in _load("allreduce.json"):
        ratios = "; ".join(f"{a} {r[f'ratio_{a}']:.3f}x ({r[f'tree_{a}_us']:.1f} / {r['all_reduce_fp32_us']:.1f} us)"
                           for a in ("gather", "halving", "pair") if f"ratio_{a}" in r)
        out.append([f"tbik.tree_all_reduce / all_reduce fp32 (bf16: {r['all_reduce_bf16_us']:.1f} us), P={r['P']}, "
                    f"{r['message']} {r['shape']}, {'CUDA graph replays' if r['timing'] == 'graph' else 'eager calls'}",
                    "≤ 1.3x", ratios, r["device"], r["command"]])
    return out


def _engine_what(r: dict) -> str:
    what = f"{r['mode']}, {r['kernels']}, TP={r['tp']}, batch {r['batch']}"
    if r["mode"] == "generate":
        cache = {"graphs": "static KV cache, CUDA graphs; plain: static, eager", "static": "static KV cache",
                 "dynamic": "dynamic KV cache"}[r.get("decode") or "dynamic"]
        what += f", {r.get('new_tokens') or '?'} new tokens ({cache})"
    workload = r.get("workload", "suite:default")
    return what + (f", {workload.split(':', 1)[1]} random prompts" if workload.startswith("random") else ", default suite")


def table() -> str:
    lines = ["| what | target | measured (repaudit / baseline) | device | command |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows()]
    return "\n".join(lines)


def readme_block(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    want = table()
    if args.check:
        if readme_block(text) != want:
            print("README.md's speed table differs from reports/perf/*.json: run python3 benchmarks/perf_table.py",
                  file=sys.stderr)
            return 1
        return 0
    readme_block(text)
    head, tail = text.split(BEGIN, 1)[0], text.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{want}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
