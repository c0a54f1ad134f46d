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

from repaudit.engines import vllm_engine, vllm_plugin
from repaudit.plan import Matrix, expand
from repaudit.run import expand_with

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
    assert tbik_env["VLLM_BATCH_INVARIANT"] == "1" and tbik_env[vllm_plugin.ENV] == "1"
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
    assert args["tensor_parallel_size"] == 2 and args["max_num_seqs"] == 8 and args["max_logprobs"] == 1
    assert args["logprobs_mode"] == "raw_logprobs" and args["enable_prefix_caching"] is False
    assert args["enforce_eager"] is False


# ---------------------------------------------------------------- with vLLM's own classes


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (optional extra repaudit[vllm])")
def test_real_vllm_outputs_convert_to_rows_exactly():
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    f32 = np.array([-0.1234567, -2.5, -7.75e-5, -3.0000002, -1.0e-30], dtype=np.float32)
    lp = [float(v) for v in f32]  # vLLM hands over float32 values as Python floats
    prompt = [11, 12, 13]
    prompt_lps = [None,
                  {12: Logprob(lp[0], rank=1), 99: Logprob(lp[1], rank=2)},
                  {13: Logprob(lp[1], rank=2), 98: Logprob(lp[0], rank=1)}]
    gen = CompletionOutput(index=0, text="", token_ids=[21, 2], cumulative_logprob=None,
                           logprobs=[{21: Logprob(lp[2], rank=1), 5: Logprob(lp[3], rank=2)},
                                     {2: Logprob(lp[4], rank=1), 7: Logprob(lp[3], rank=2)}],
                           finish_reason="stop")
    out = RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=prompt_lps,
                        outputs=[gen], finished=True)
    rows = vllm_engine.rows_from_output(out, "p", prompt_len=3, topk=2, completion=True)
    assert rows.pos.tolist() == [1, 2, 3, 4] and rows.token_id.tolist() == [12, 13, 21, 2]
    assert rows.logprob.view(np.uint32).tolist() == f32[[0, 1, 2, 4]].view(np.uint32).tolist()
    assert rows.top1.tolist() == [12, 98, 21, 2]
    assert rows.topk_ids.tolist() == [[12, 99], [98, 13], [21, 5], [2, 7]]
    assert rows.phase.tolist() == ["prompt", "prompt", "completion", "completion"]
    assert rows.digest is None
    scored = vllm_engine.rows_from_output(out, "p", prompt_len=2, topk=0, completion=False)
    assert scored.pos.tolist() == [1, 2] and scored.phase.tolist() == ["prompt", "completion"]
    assert scored.topk_ids.shape == (2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM or not os.environ.get("REPAUDIT_VLLM_MODEL"),
                    reason="needs vllm, a GPU and REPAUDIT_VLLM_MODEL (a local model directory)")
def test_real_vllm_generate_and_score_on_a_gpu():
    from repaudit.engines.base import Sequence

    llm = vllm_engine.load(vllm_engine.engine_args(model_path=os.environ["REPAUDIT_VLLM_MODEL"], tp=1, dtype="bfloat16",
                                                   batch_size=4, max_len=128, topk=3))
    seqs = [Sequence("a", (1, 2, 3, 4), None, 6), Sequence("b", (5, 6), None, 6)]
    rows, timing = vllm_engine.generate(llm, seqs, 3, eos_id=None)
    assert [len(r.pos) for r in rows] == [3 + 6, 1 + 6] and timing.decode_tokens == 12
    # greedy: every generated token is its row's top-1, and its logprob is the top-1 logprob
    for r in rows:
        gen = r.pos >= r.prompt_len
        assert (r.token_id[gen] == r.top1[gen]).all()
        assert (r.logprob[gen].view(np.uint32) == r.topk_logprobs[gen, 0].view(np.uint32)).all()
    again, _ = vllm_engine.score(llm, [Sequence(s.prompt_id, s.prompt, tuple(r.completion_tokens), 0)
                                       for s, r in zip(seqs, rows)], 3, eos_id=None)
    assert [a.token_id.tolist() for a in again] == [r.token_id.tolist() for r in rows]


def test_vllm_engine_arguments_are_part_of_a_vllm_cells_settings_only():
    """A resumed run must not reuse a vLLM cell made with other engine arguments (they can move bits)."""
    from pathlib import Path

    from repaudit.run import ModelRef, cell_settings
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
