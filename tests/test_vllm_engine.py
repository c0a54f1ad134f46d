"""The vLLM engine: planning, the missing-extra message, the plugin's opt-in, and the conversion
of vLLM's real output objects into records (only where vllm can be imported: the GPU machine's
run in benchmarks/vllm_matrix.sh; never a hand-written stand-in for vLLM's classes).
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from repaudit.engines import vllm_capture, vllm_engine, vllm_plugin
from repaudit.engines.base import canonical_topk
from repaudit.run.plan import Matrix, expand
from repaudit.run.plan import expand_with

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_a_vllm_job_holds_one_kernel_mode_and_hf_jobs_hold_all():
    plan = expand(Matrix(model="x", engines=("hf", "vllm"), tps=(1, 2), batch_sizes=(1, 8), kernels=("stock", "tbik"),
                         modes=("generate",), device="cuda"))
    vllm_groups = [g for g in plan.groups if g.engine == "vllm"]
    assert sorted(g.id for g in vllm_groups) == ["vllm-tp1-default-stock", "vllm-tp1-default-tbik",
                                                 "vllm-tp2-default-stock", "vllm-tp2-default-tbik"]
    assert all({c.kernels for c in g.cells} == {g.id.rsplit("-", 1)[1]} and len(g.cells) == 2 for g in vllm_groups)
    hf_groups = [g for g in plan.groups if g.engine == "hf"]
    assert [len(g.cells) for g in hf_groups] == [4, 4]
    assert plan.groups[0].engine == "hf" and plan.groups[0].tp == 1  # the baseline's group runs first


def test_the_reference_generation_runs_first_in_the_baselines_vllm_job():
    plan = expand(Matrix(model="x", engines=("vllm",), tps=(2,), batch_sizes=(4,), modes=("score",), device="cuda"))
    ref = plan.reference_source
    plan2 = expand_with(plan, ref)
    assert plan2.groups[0].cells[0] == ref and ref.mode == "generate"
    assert len(plan2.groups) == len(plan.groups)


@pytest.mark.skipif(HAVE_VLLM, reason="checks the message shown when vllm is absent")
def test_engine_vllm_without_the_extra_says_how_to_install(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "repaudit", "run", "--engine", "vllm", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'repaudit[vllm]'" in lines[0]


def test_trace_and_vllm_args_are_refused_where_they_mean_nothing(tmp_path):
    from repaudit.errors import InputError

    with pytest.raises(InputError, match="--trace"):
        expand(Matrix(model="x", engines=("vllm",), trace=True, device="cuda"))
    with pytest.raises(InputError, match="--vllm-arg"):
        expand(Matrix(model="x", engines=("hf",), vllm_args={"enforce_eager": False}))


def test_kernel_modes_reach_vllm_through_the_environment():
    assert vllm_engine.process_env("stock")["VLLM_BATCH_INVARIANT"] == "0"
    assert vllm_engine.process_env("bi")["VLLM_BATCH_INVARIANT"] == "1" and vllm_engine.process_env("bi")[vllm_plugin.ENV] == "0"
    tbik_env = vllm_engine.process_env("tbik")
    # tbik: the plugin runs every op itself; vLLM's batch-invariant overrides stay off
    assert tbik_env["VLLM_BATCH_INVARIANT"] == "0" and tbik_env[vllm_plugin.ENV] == "1"
    with pytest.raises(ValueError):
        vllm_engine.process_env("fast")


def test_the_plugin_is_inert_unless_a_tbik_cell_asks(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    vllm_plugin.register()  # must not import vllm, or touch it
    assert "vllm.model_executor.layers.linear" not in sys.modules or not getattr(
        sys.modules["vllm.model_executor.layers.linear"].RowParallelLinear, "_repaudit_tbik", False)


def test_the_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "repaudit_tbik"]
    assert eps and eps[0].value == "repaudit.engines.vllm_plugin:register"


def test_engine_args_are_the_documented_defaults_and_vllm_args_override():
    args = vllm_engine.engine_args(model_path="/m", tp=2, dtype="bfloat16", batch_size=8, max_len=300, topk=0,
                                   extra={"enforce_eager": False})
    assert args["tensor_parallel_size"] == 2 and args["max_num_seqs"] == 8 and args["max_logprobs"] == 2
    assert args["logprobs_mode"] == "raw_logprobs" and args["enable_prefix_caching"] is False
    assert args["enforce_eager"] is False
    plain = vllm_engine.engine_args(model_path="/m", tp=1, dtype="bfloat16", batch_size=8, max_len=300, topk=5)
    # vLLM as it ships: no eager mode, no compilation or memory settings of repaudit's own
    assert not {"enforce_eager", "compilation_config", "gpu_memory_utilization", "attention_backend"} & set(plain)
    tbik = vllm_engine.engine_args(model_path="/m", tp=2, dtype="bfloat16", batch_size=8, max_len=300, topk=5,
                                   kernels="tbik")
    assert tbik["attention_backend"] == "FLASH_ATTN" and "compilation_config" not in tbik  # vLLM's CUDA graphs
    eager = vllm_engine.engine_args(model_path="/m", tp=2, dtype="bfloat16", batch_size=8, max_len=300, topk=5,
                                    kernels="tbik", extra={"compilation_config": {"cudagraph_mode": "NONE"}})
    assert eager["compilation_config"] == {"cudagraph_mode": "NONE"}  # --vllm-arg has the last word


def test_tbik_through_vllm_is_refused_for_a_model_the_plugin_does_not_reproduce(tmp_path):
    import json

    from repaudit import builtin
    from repaudit.errors import InputError

    for name in ("builtin:tiny-qwen3", "builtin:tiny-llama"):
        vllm_engine.check_tbik(str(builtin.ensure(name)), {"enable_lora": False, "max_num_seqs": 8})
    cfg = json.loads((builtin.ensure("builtin:tiny-llama") / "config.json").read_text())
    for change, words in (({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model type 'gemma'"),
                          ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
                           "RoPE type 'llama3'"),
                          ({"attention_bias": True}, "biases")):
        d = tmp_path / words.split()[0]
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(InputError, match=words):
            vllm_engine.check_tbik(str(d), {})
    with pytest.raises(InputError, match="enable_lora"):  # LoRA's own row-parallel layers reduce bf16 partials
        vllm_engine.check_tbik(str(builtin.ensure("builtin:tiny-qwen3")), {"enable_lora": True})


# ---------------------------------------------------------------- with vLLM's own classes


def _flat(entries_per_position):
    """FlatLogprobs in its JSON form: per position, the position's own token then ranks 1..k."""
    out = {"start": [], "end": [], "token_ids": [], "logprobs": [], "ranks": []}
    for entries in entries_per_position:
        out["start"].append(len(out["logprobs"]))
        for tid, lp, rank in entries:
            out["token_ids"].append(tid)
            out["logprobs"].append(lp)
            out["ranks"].append(rank)
        out["end"].append(len(out["logprobs"]))
    return out


def test_flat_vllm_logprobs_convert_to_rows_exactly():
    f32 = np.array([-0.1234567, -2.5, -7.75e-5, -3.0000002, -1.0e-30], dtype=np.float32)
    lp = [float(v) for v in f32]  # vLLM hands over float32 values as Python floats
    out = vllm_engine.output_from_json({
        "prompt_token_ids": [11, 12, 13],
        "prompt_logprobs": _flat([[], [(12, lp[0], 1), (12, lp[0], 1), (99, lp[1], 2)],
                                  [(13, lp[1], 2), (98, lp[0], 1), (13, lp[1], 2)]]),
        "token_ids": [21, 2],
        "logprobs": _flat([[(21, lp[2], 1), (21, lp[2], 1), (5, lp[3], 2)], [(2, lp[4], 1), (2, lp[4], 1), (7, lp[3], 2)]]),
    })
    rows = vllm_engine.rows_from_output(out, "p", prompt_len=3, topk=2, completion=True)
    assert rows.pos.tolist() == [3, 4] and rows.token_id.tolist() == [21, 2]
    assert rows.logprob.view(np.uint32).tolist() == f32[[2, 4]].view(np.uint32).tolist()
    assert rows.top1.tolist() == [21, 2]
    assert rows.topk_ids.tolist() == [[21, 5], [2, 7]]
    assert rows.topk_logprobs.view(np.uint32).tolist() == f32[[[2, 3], [4, 3]]].view(np.uint32).tolist()
    assert rows.phase.tolist() == ["completion", "completion"]
    assert rows.digest is None
    scored = vllm_engine.rows_from_output(out, "p", prompt_len=2, topk=2, completion=False)
    assert scored.pos.tolist() == [1, 2] and scored.phase.tolist() == ["prompt", "completion"]
    assert scored.top1.tolist() == [12, 98] and scored.topk_ids.tolist() == [[12, 99], [98, 13]]
    assert scored.logprob.view(np.uint32).tolist() == f32[[0, 1]].view(np.uint32).tolist()
    assert vllm_engine.rows_from_output(out, "p", prompt_len=2, topk=0, completion=False).topk_ids.shape == (2, 0)


def _hf_values(logits, targets, topk):
    """What the transformers engine records for these logits rows (engines/row_values.py)."""
    import torch

    from repaudit.engines.row_values import row_values

    logits = torch.tensor(logits, dtype=torch.float32)
    got = row_values(logits, torch.log_softmax(logits, -1), torch.tensor(targets), topk)
    return {k: v.numpy() for k, v in got.items()}


def test_a_tie_of_three_at_the_top_gives_the_transformers_engines_top1_and_top_k():
    """Tokens 1, 2 and 3 share the largest logit and vLLM's top-2 names 3 and 2 (torch.topk on a
    GPU may): the row's own token, greedy's argmax or a given token, is the lowest tied id, so the
    record holds what the transformers engine holds for the row."""
    import torch

    logits = [[0.0, 2.0, 2.0, 2.0, 1.0]]
    lp = [float(v) for v in torch.log_softmax(torch.tensor(logits), -1)[0]]
    want = _hf_values(logits, [1], 2)
    assert want["top1"].tolist() == [1] and want["topk_ids"].tolist() == [[1, 2]]
    top2 = [(3, lp[3], 1), (2, lp[2], 2)]
    out = vllm_engine.output_from_json({"prompt_token_ids": [5, 1], "prompt_logprobs": _flat([[], [(1, lp[1], 1)] + top2]),
                                        "token_ids": [1], "logprobs": _flat([[(1, lp[1], 1)] + top2])})
    for completion in (True, False):
        rows = vllm_engine.rows_from_output(out, "p", prompt_len=2, topk=2, completion=completion)
        assert rows.top1.tolist() == want["top1"].tolist() and rows.topk_ids.tolist() == want["topk_ids"].tolist()
        assert rows.topk_logprobs.view(np.uint32).tolist() == want["topk_lp"].view(np.uint32).tolist()
        assert rows.logprob.view(np.uint32).tolist() == want["logprob"].view(np.uint32).tolist()
    # A given token below the tie leaves vLLM's tied pair as it is, in id order.
    out = vllm_engine.output_from_json({"prompt_token_ids": [5, 4], "prompt_logprobs": _flat([[], [(4, lp[4], 4)] + top2]),
                                        "token_ids": [], "logprobs": _flat([])})
    rows = vllm_engine.rows_from_output(out, "p", prompt_len=1, topk=2, completion=False)
    assert rows.top1.tolist() == [2] and rows.topk_ids.tolist() == [[2, 3]]


def test_vllm_logprobs_that_do_not_match_the_sequence_are_refused():
    out = vllm_engine.output_from_json({
        "prompt_token_ids": [11, 12], "prompt_logprobs": _flat([[], [(77, -1.0, 3), (12, -0.5, 1), (13, -0.7, 2)]]),
        "token_ids": [], "logprobs": _flat([])})
    with pytest.raises(RuntimeError, match="other tokens"):
        vllm_engine.rows_from_output(out, "p", prompt_len=2, topk=1, completion=False)
    short = vllm_engine.output_from_json({
        "prompt_token_ids": [11, 12], "prompt_logprobs": _flat([[], [(12, -0.5, 1)]]), "token_ids": [], "logprobs": _flat([])})
    with pytest.raises(RuntimeError, match="1 logprob entries at position 0, expected 3"):
        vllm_engine.rows_from_output(short, "p", prompt_len=2, topk=1, completion=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM or not os.environ.get("REPAUDIT_VLLM_MODEL"),
                    reason="needs vllm, a GPU and REPAUDIT_VLLM_MODEL (a local model directory)")
def test_real_vllm_generate_and_score_on_a_gpu():
    from repaudit.engines.base import Sequence

    llm = vllm_engine.load(vllm_engine.engine_args(model_path=os.environ["REPAUDIT_VLLM_MODEL"], tp=1, dtype="bfloat16",
                                                   batch_size=4, max_len=128, topk=3,
                                                   extra={"gpu_memory_utilization": 0.3}))  # shares its GPU
    seqs = [Sequence("a", (1, 2, 3, 4), None, 6), Sequence("b", (5, 6), None, 6)]
    # every worker can capture (so generate below does, rather than falling back to vLLM's logprobs)
    assert vllm_capture.installed(llm) and all(llm.collective_rpc("repaudit_capture_begin", args=(3,)))
    assert vllm_capture.unpack(llm.collective_rpc("repaudit_capture_end")[0])["code"].shape == (0,)
    rows, timing = vllm_engine.generate(llm, seqs, 3, stop_ids=())
    assert [r.pos.tolist() for r in rows] == [list(range(4, 10)), list(range(2, 8))]
    # vLLM interleaves prefill and decode: its time is the generated tokens' alone, no decode rate
    assert timing.generated_tokens == 12 and timing.mixed_s > 0 and timing.as_dict()["decode_tokens_per_s"] is None
    # greedy: every generated token is its row's top-1, and its logprob is the top-1 logprob
    for r in rows:
        gen = r.pos >= r.prompt_len
        assert (r.token_id[gen] == r.top1[gen]).all()
        assert (r.logprob[gen].view(np.uint32) == r.topk_logprobs[gen, 0].view(np.uint32)).all()
    # the capture inside vLLM's workers (the default) gives what vLLM's own logprobs give, bit for bit
    own, _ = vllm_engine.generate(llm, seqs, 3, stop_ids=(), capture=False)
    for a, b in zip(rows, own):
        assert a.token_id.tolist() == b.token_id.tolist() and a.topk_ids.tolist() == b.topk_ids.tolist()
        assert a.logprob.view(np.uint32).tolist() == b.logprob.view(np.uint32).tolist()
        assert a.topk_logprobs.view(np.uint32).tolist() == b.topk_logprobs.view(np.uint32).tolist()
    again, _ = vllm_engine.score(llm, [Sequence(s.prompt_id, s.prompt, tuple(r.completion_tokens), 0)
                                       for s, r in zip(seqs, rows)], 3, stop_ids=())
    assert [a.token_id[a.pos >= a.prompt_len].tolist() for a in again] == [r.token_id.tolist() for r in rows]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM or not os.environ.get("REPAUDIT_VLLM_MODEL"),
                    reason="needs vllm, a GPU and REPAUDIT_VLLM_MODEL (a local model directory)")
def test_prefix_hit_serves_the_measured_prompt_from_vllms_prefix_cache():
    """The prefix-hit scenario's warm-up leaves the prompt's full KV blocks in vLLM's cache."""
    from vllm import SamplingParams

    from repaudit.engines.base import Sequence

    llm = vllm_engine.load(vllm_engine.engine_args(
        model_path=os.environ["REPAUDIT_VLLM_MODEL"], tp=1, dtype="bfloat16", batch_size=2, max_len=128, topk=3,
        scenario="prefix-hit", extra={"gpu_memory_utilization": 0.3, "enforce_eager": True}))  # eager: a quick load
    prompt = list(range(1, 41))
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    (cold,) = llm.generate([{"prompt_token_ids": [p + 100 for p in prompt]}], params, use_tqdm=False)
    vllm_engine.warm_prefixes(llm, [Sequence("a", tuple(prompt), None, 4)])
    (hit,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 16  # at least one full block of 16


def test_vllm_engine_arguments_are_part_of_a_vllm_cells_settings_only():
    """A resumed run must not reuse a vLLM cell made with other engine arguments (they can move bits)."""
    from pathlib import Path

    from repaudit.run.model import ModelRef
    from repaudit.run.runner import cell_settings
    from repaudit.probes import load_suite

    m = Matrix(model="x", engines=("hf", "vllm"), tps=(1,), batch_sizes=(1,), modes=("generate",), device="cuda",
               vllm_args={"enforce_eager": False})
    plan = expand(m)
    ref, suite = ModelRef("x", Path("/m"), None), load_suite("smoke")
    by_engine = {c.engine: cell_settings(c, plan, ref, suite) for c in plan.cells}
    assert by_engine["vllm"]["vllm_args"] == {"enforce_eager": False}
    assert "vllm_args" not in by_engine["hf"]
    plain = expand(Matrix(model="x", engines=("vllm",), tps=(1,), batch_sizes=(1,), modes=("generate",), device="cuda"))
    assert "vllm_args" not in cell_settings(plain.cells[0], plain, ref, suite)  # records made before stay reusable


def test_a_vllm_job_is_one_plain_process_without_torchrun_variables():
    from pathlib import Path

    from repaudit.run.launch import worker_command

    cmd = worker_command(Path("/r/spec.json"))
    assert "torch.distributed.run" not in cmd and cmd[-3:] == ["-m", "repaudit.run.worker", "/r/spec.json"]
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_PORT": "29500", "PATH": "/bin", "NCCL_ALGO": "Tree"}
    vllm_engine.scrub_launcher_env(env)
    assert env == {"PATH": "/bin", "NCCL_ALGO": "Tree"}


_STORE = """
import datetime, socket, sys, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
try:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=3))
except Exception as exc:
    sys.exit(f"no process group: {type(exc).__name__}")
"""


def test_torchruns_agent_store_variable_is_why_a_vllm_driver_under_torchrun_hangs():
    """What vLLM's driver does at start-up (its own tcp:// process group) never completes with
    torchrun's TORCHELASTIC_USE_AGENT_STORE=True in the environment, and does once scrubbed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    hung = subprocess.run([sys.executable, "-c", _STORE], env={**base, "TORCHELASTIC_USE_AGENT_STORE": "True"},
                          capture_output=True, text=True, timeout=120)
    assert hung.returncode != 0 and "no process group" in hung.stderr
    env = {**base, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    vllm_engine.scrub_launcher_env(env)
    ok = subprocess.run([sys.executable, "-c", _STORE], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_the_plugins_tbik_ops_are_custom_ops_that_torch_compile_can_trace():
    """vLLM compiles its model with torch.compile: the plugin's ops must have a schema and a fake
    implementation, and give tbik's bits, traced or not (CPU backend here)."""
    import torch

    import tbik

    if not hasattr(torch.ops.repaudit, "tbik_partial"):
        vllm_plugin._define_ops()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g)  # w as vLLM holds it: [N, K]
    halves = [torch.ops.repaudit.tbik_partial(x[:, i * 32:(i + 1) * 32].contiguous(), w[:, i * 32:(i + 1) * 32], 2)
              for i in range(2)]
    whole = torch.ops.repaudit.tbik_partial(x, w, 1)
    assert torch.equal(whole, tbik.matmul_partial(x, w.t(), tp_size=1))
    joined = torch.ops.repaudit.tbik_tree_sum(torch.cat(halves), 2)
    assert joined.view(torch.int32).equal(whole.view(torch.int32))  # TP=2 gives TP=1's bits
    # What the TP=2 layer takes instead: vLLM's all-reduce of the two roots, one addition in
    # either order.
    for a, b in (halves, halves[::-1]):
        assert (a + b).view(torch.int32).equal(whole.view(torch.int32))

    def row_parallel(xa, xb):
        parts = torch.cat([torch.ops.repaudit.tbik_partial(xa, w[:, :32], 2), torch.ops.repaudit.tbik_partial(xb, w[:, 32:], 2)])
        return torch.ops.repaudit.tbik_tree_sum(parts, 2)

    traced = torch.compile(row_parallel, backend="aot_eager", fullgraph=True)
    out = traced(x[:, :32].contiguous(), x[:, 32:].contiguous())
    assert out.view(torch.int32).equal(whole.view(torch.int32))


def test_every_plugin_op_runs_its_function_and_its_fake_matches_what_it_returns():
    """Each torch.ops.repaudit op gives its function's bits (CPU backend here), and its fake,
    which torch.compile traces vLLM's graph with, gives the real output's shapes and dtypes: a
    wrong fake would compile a graph around tensors the op never returns."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from repaudit.engines import hf_ops

    vllm_plugin._define_ops()
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    x, res = torch.randn(6, 64, generator=g).to(bf), torch.randn(6, 64, generator=g).to(bf)
    qkv = torch.randn(6, 4 * 16, generator=g).to(bf)
    args = {
        "tbik_linear": (x, torch.randn(24, 64, generator=g).to(bf), torch.randn(24, generator=g).to(bf)),
        "tbik_partial": (x, torch.randn(24, 64, generator=g).to(bf), 2),
        "tbik_tree_sum": (torch.randn(12, 24, generator=g), 2),
        "hf_rms_norm": (qkv.view(6, 4, 16)[:, :2], torch.randn(16, generator=g).to(bf), 1e-6),
        "hf_add_rms_norm": (x, res, torch.randn(64, generator=g), 1e-6),  # fp32 weight: a promoted output
        # a row-parallel layer's fp32 sum, its cast folded into the norm
        "hf_add_rms_norm fp32 x": (x.float() * 1.001, res, torch.randn(64, generator=g).to(bf), 1e-6),
        "hf_silu_and_mul": (x,),
        "hf_rope": (torch.arange(6), qkv[:, :32], qkv[:, 32:], hf_ops.inv_freq(10000.0, 16), 16),
        "hf_qk_norm_rope": (torch.arange(6), qkv[:, :32], qkv[:, 32:48], torch.randn(16, generator=g).to(bf),
                            torch.randn(16, generator=g).to(bf), 1e-6, hf_ops.inv_freq(10000.0, 16), 16),
    }
    table = vllm_plugin._op_table()
    assert {case.split()[0] for case in args} == set(table)
    for case, op_args in args.items():
        name = case.split()[0]
        real = getattr(torch.ops.repaudit, name)(*op_args)
        expected = table[name][1](*op_args)
        real_t, expected_t = (real, expected) if isinstance(real, tuple) else ((real,), (expected,))
        assert all(a.view(torch.uint8).equal(b.view(torch.uint8)) for a, b in zip(real_t, expected_t)), name
        with FakeTensorMode() as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in op_args)
            fake = getattr(torch.ops.repaudit, name)(*fake_args)
        fake_t = fake if isinstance(fake, tuple) else (fake,)
        assert [(f.shape, f.dtype) for f in fake_t] == [(r.shape, r.dtype) for r in real_t], name


def test_outputs_recorded_from_a_real_vllm_run_convert_to_the_same_rows():
    """tests/data/vllm_outputs.json: real vLLM 0.25.1 outputs (flat logprobs, H200, greedy) with the
    rows repaudit made of them on that machine (benchmarks/vllm_speed.py --fixture)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "vllm_outputs.json").read_text())
    assert data["vllm"] in vllm_plugin.TESTED_VLLM and len(data["cases"]) == 4
    ties = 0
    for case in data["cases"]:
        rows = vllm_engine.rows_from_output(vllm_engine.output_from_json(case["output"]), case["prompt_id"],
                                            case["prompt_len"], case["topk"], completion=case["completion"])
        want = case["rows"]
        assert (min(want["pos"]) >= case["prompt_len"]) == case["completion"]  # generate: generated tokens only
        assert rows.pos.tolist() == want["pos"] and rows.token_id.tolist() == want["token_id"]
        assert rows.logprob.view(np.uint32).tolist() == want["logprob_bits"]
        # The fixture's rows hold vLLM's rank order; the conversion reorders ties only.
        want_ids = np.array(want["topk_ids"], np.int64)
        want_lps = np.array(want["topk_logprob_bits"], np.uint32).view(np.float32)
        ids, lps = canonical_topk(want_ids, want_lps)
        assert rows.topk_ids.tolist() == ids.tolist() and rows.top1.tolist() == ids[:, 0].tolist()
        assert rows.topk_logprobs.view(np.uint32).tolist() == lps.view(np.uint32).tolist()
        ties += int((want_ids != ids).any(axis=1).sum())
        # greedy takes the first of tied maxima, and so does the record's top-1 now
        gen = rows.pos >= rows.prompt_len
        assert (rows.token_id[gen] == rows.top1[gen]).all()
        assert (rows.logprob[gen].view(np.uint32) == rows.topk_logprobs[gen, 0].view(np.uint32)).all()
    assert ties >= 1  # this fixture holds an exact tie (two tokens at -9.012621) that vLLM ranked the other way


@pytest.mark.parametrize("installed, words", [(None, "not installed"), ("0.1.0", "vLLM 0.1.0 is untested")])
def test_vllm_that_is_missing_or_untested_is_refused_in_one_line_without_importing_it(monkeypatch, installed, words):
    import importlib.metadata
    import sys

    from repaudit.errors import InputError

    def version(name):
        assert name == "vllm"
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm would raise ImportError
    with pytest.raises(InputError) as err:
        vllm_engine.require("cuda")
    assert words in str(err.value) and "\n" not in str(err.value)
