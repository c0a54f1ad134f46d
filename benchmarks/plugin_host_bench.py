"""Host time of each op the tbik vLLM plugin runs, without vLLM: a vLLM step too large for its
CUDA graphs (a prefill of thousands of tokens) launches these one by one from Python, and the GPU
waits for the host between them (benchmarks/timeline.py on a profiled generation shows it).

Per op and row count, host microseconds per call, side by side: the plugin's operator
(torch.ops.repaudit.*, as vLLM's compiled graph calls it), the same function registered with
torch.library.custom_op instead, the function called directly, and the plugin's operator under
torch.profiler with host activity (what a --timeline profile adds); then cProfile's heaviest
functions over the ops of one layer at the largest row count.

    python3 benchmarks/plugin_host_bench.py [--rows 256,16384] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
from capture_host_bench import per_call_us as host_us  # noqa: E402  (beside this file)

# Qwen3-0.6B at TP=2, one rank: 8 query and 4 key/value heads of 128, MLP 3072 (1536 a rank).
HIDDEN, HEAD, QH, KVH, MLP = 1024, 128, 8, 4, 1536


def per_call_us(fn, n: int = 200) -> float:
    """Median host microseconds of fn() in groups of 10, with a sync before each group."""
    us = host_us(fn, n, group=10)
    torch.cuda.synchronize()
    return us


def _as_custom_ops() -> None:
    """The plugin's op table defined a second time with torch.library.custom_op (namespace
    repaudit_bench): the registration the plugin used before, measured beside its own."""
    from repaudit.engines import vllm_plugin

    if hasattr(torch.ops, "repaudit_bench") and hasattr(torch.ops.repaudit_bench, "tbik_linear"):
        return
    for name, (schema, fn, fake) in vllm_plugin._op_table().items():
        op = torch.library.custom_op(f"repaudit_bench::{name}", fn, mutates_args=(), schema=schema[len(name):])
        op.register_fake(fake)


def layer_ops(rows: int) -> dict:
    """name -> (plugin op name or None, its arguments, the direct call) for one decoder layer's
    ops at `rows` tokens."""
    from repaudit.engines import hf_ops, vllm_plugin

    vllm_plugin._define_ops()
    _as_custom_ops()
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(rows, HIDDEN, device=dev, dtype=bf)
    res = torch.randn(rows, HIDDEN, device=dev, dtype=bf)
    w_norm = torch.randn(HIDDEN, device=dev, dtype=bf)
    w_head = torch.randn(HEAD, device=dev, dtype=bf)
    w_qkv = torch.randn((QH + 2 * KVH) * HEAD, HIDDEN, device=dev, dtype=bf)
    w_o = torch.randn(HIDDEN, QH * HEAD, device=dev, dtype=bf)
    w_gu = torch.randn(2 * MLP, HIDDEN, device=dev, dtype=bf)
    w_down = torch.randn(HIDDEN, MLP, device=dev, dtype=bf)
    q = torch.randn(rows, QH * HEAD, device=dev, dtype=bf)
    k = torch.randn(rows, KVH * HEAD, device=dev, dtype=bf)
    q_heads = q.view(rows, QH, HEAD)
    attn = torch.randn(rows, QH * HEAD, device=dev, dtype=bf)
    gu = torch.randn(rows, 2 * MLP, device=dev, dtype=bf)
    mlp = torch.randn(rows, MLP, device=dev, dtype=bf)
    pos = torch.arange(rows, device=dev) % 512
    inv_freq = hf_ops.inv_freq(1_000_000.0, HEAD).to(dev)
    import tbik

    # Paged attention over a cache of 16-token blocks: `rows` new tokens in requests of at most 256
    # (a prefill's chunks) or of one (a decode step), each after 256 cached tokens.
    per_req = min(rows, 256) if rows > 256 else 1
    n_req = rows // per_req
    blocks_per = (256 + per_req + 15) // 16
    cache = torch.randn(2, n_req * blocks_per, 16, KVH, HEAD, device=dev, dtype=bf)
    table = torch.arange(n_req * blocks_per, device=dev, dtype=torch.int32).view(n_req, blocks_per)
    seq_lens = torch.full((n_req,), 256 + per_req, device=dev, dtype=torch.int32)
    qsl = torch.arange(0, rows + 1, per_req, device=dev, dtype=torch.int32)
    q3 = q.view(rows, QH, HEAD)
    att_out = torch.empty_like(q3)

    def attention():
        key_cache, value_cache = cache.unbind(0)
        return hf_ops.paged_attention(q3, key_cache, value_cache, qsl[:n_req + 1], seq_lens, table, per_req,
                                      HEAD ** -0.5, out=att_out)

    return {
        "add_rms_norm": ("hf_add_rms_norm", (x, res, w_norm, 1e-6), lambda: hf_ops.add_rms_norm(x, res, w_norm, 1e-6)),
        "qkv linear": ("tbik_linear", (x, w_qkv, None), lambda: hf_ops.linear(x, w_qkv)),
        "q norm": ("hf_rms_norm", (q_heads, w_head, 1e-6), lambda: hf_ops.rms_norm(q_heads, w_head, 1e-6)),
        "rope": ("hf_rope", (pos, q, k, inv_freq, HEAD), lambda: hf_ops.rope(pos, q, k, inv_freq, HEAD)),
        "attention": (None, (), attention),  # inside vLLM's own attention op
        "o partial": ("tbik_partial", (attn, w_o, 2), lambda: tbik.matmul_partial(attn, w_o.t(), tp_size=2)),
        "gate_up linear": ("tbik_linear", (x, w_gu, None), lambda: hf_ops.linear(x, w_gu)),
        "silu_and_mul": ("hf_silu_and_mul", (gu,), lambda: hf_ops.silu_and_mul(gu)),
        "down partial": ("tbik_partial", (mlp, w_down, 2), lambda: tbik.matmul_partial(mlp, w_down.t(), tp_size=2)),
    }


def _calls(op: str | None, args: tuple, direct) -> dict:
    if op is None:
        return {"direct": direct}
    return {"library op": lambda: getattr(torch.ops.repaudit, op)(*args),
            "custom_op": lambda: getattr(torch.ops.repaudit_bench, op)(*args), "direct": direct}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256,16384")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    result = {"device": torch.cuda.get_device_name(), "command": "python3 benchmarks/plugin_host_bench.py", "ops": []}
    for rows in rows_list:
        for name, (op, op_args, direct) in layer_ops(rows).items():
            calls = _calls(op, op_args, direct)
            for fn in calls.values():
                fn()  # compile and cache
            row = {"op": name, "rows": rows, **{f"{k}_us": per_call_us(fn) for k, fn in calls.items()}}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]):
                row["profiled_us"] = per_call_us(next(iter(calls.values())), 40)
            result["ops"].append(row)
            print(f"{rows:6d} rows  {name:15s} " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items() if k.endswith("_us")),
                  flush=True)
    ops = layer_ops(rows_list[-1])
    calls = [next(iter(_calls(*spec).values())) for spec in ops.values()]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        for fn in calls:
            fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    result["cprofile_layer_x50"] = text.getvalue()
    print(text.getvalue(), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
