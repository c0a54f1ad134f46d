"""Matrix expansion and the up-front refusals of a bad matrix or probe suite."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from repaudit.run import nccl
from repaudit.errors import InputError
from repaudit.run.plan import Matrix, ModelShape, expand, validate_against_model
from repaudit.probes import builtin_suites, load_suite

QWEN_LIKE = ModelShape("qwen3", num_attention_heads=16, num_key_value_heads=8, intermediate_size=192, vocab_size=384,
                       tp_styles={"layers.*.self_attn.o_proj": "rowwise", "lm_head": "colwise_gather_output"})


def test_groups_share_a_job_and_baseline_group_runs_first():
    plan = expand(Matrix(model="m", tps=(2, 1), batch_sizes=(8, 1), device="cuda",
                         nccl={"default": {}, "tree": nccl.PRESETS["tree"]}, kernels=("stock", "tbik"),
                         baseline="hf-tp2-bs1-tree-stock"))
    assert plan.baseline.id == "hf-tp2-bs1-tree-stock-generate"
    assert [g.id for g in plan.groups][0] == "hf-tp2-tree"
    assert sorted(g.id for g in plan.groups) == ["hf-tp1-default", "hf-tp2-default", "hf-tp2-tree"]
    for g in plan.groups:
        modes = [c.mode for c in g.cells]
        assert modes == sorted(modes, key=["generate", "score"].index)  # references before scoring
        assert all(c.group_key == (g.engine, g.tp, g.nccl) for c in g.cells)
    assert any("TP=1 runs no collective" in n for n in plan.notes)
    ref = plan.reference_for(plan.cell("hf-tp1-bs8-default-tbik-score"))
    assert ref.id == "hf-tp2-bs1-tree-tbik-score"


def test_every_reference_is_a_cell_of_the_plan_when_nccl_is_kept():
    """TP=1 runs only the first NCCL preset: with --reference-per naming nccl, a TP=2 `tree`
    cell's reference at TP=1 was the `tree` TP=1 cell, which the plan never makes, and the gate
    failed the run on a cell 'missing from the manifest'."""
    plan = expand(Matrix(model="m", tps=(1, 2), batch_sizes=(1,), device="cuda",
                         nccl={"default": {}, "tree": nccl.PRESETS["tree"]}, kernels=("stock",),
                         reference_per=("kernels", "mode", "nccl")))
    assert plan.baseline.tp == 1
    for cell in plan.cells:
        assert plan.reference_for(cell) in plan.cells, cell.id
    assert plan.reference_for(plan.cell("hf-tp2-bs1-tree-stock-score")).id == "hf-tp1-bs1-default-stock-score"
    assert plan.reference_for(plan.cell("hf-tp2-bs1-default-stock-score")).id == "hf-tp1-bs1-default-stock-score"


def test_a_tp1_reference_of_a_tree_baseline_is_the_tp1_cell_that_runs():
    """--baseline at TP=2 with the `tree` preset and --reference-per naming tp: a TP=1 cell's
    reference was hf-tp1-...-tree, which the plan never makes (TP=1 runs only the first preset),
    so the gate failed the TP=1 cells on a reference 'missing from the manifest'."""
    plan = expand(Matrix(model="m", tps=(1, 2), batch_sizes=(1,), device="cuda", modes=("score",),
                         nccl={"default": {}, "tree": nccl.PRESETS["tree"]}, kernels=("stock",),
                         reference_per=("tp", "kernels", "mode"), baseline="hf-tp2-bs1-tree-stock"))
    refs = {c.id: plan.reference_for(c).id for c in plan.cells}
    assert refs == {"hf-tp1-bs1-default-stock-score": "hf-tp1-bs1-default-stock-score",
                    "hf-tp2-bs1-default-stock-score": "hf-tp2-bs1-tree-stock-score",
                    "hf-tp2-bs1-tree-stock-score": "hf-tp2-bs1-tree-stock-score"}


def test_cell_ids_are_stable():
    plan = expand(Matrix(model="m", tps=(1,), batch_sizes=(1,)))
    assert [c.id for c in plan.cells] == ["hf-tp1-bs1-default-stock-generate", "hf-tp1-bs1-default-stock-score"]


@pytest.mark.parametrize("kwargs, message", [
    ({"tps": ()}, "--tp is empty"),
    ({"batch_sizes": ()}, "--batch-size is empty"),
    ({"modes": ()}, "--mode is empty"),
    ({"tps": (3,), "kernels": ("tbik",)}, "powers of two"),
    ({"tps": (16,), "kernels": ("tbik",)}, "powers of two up to 8"),
    ({"kernels": ("fast",)}, "--kernels 'fast'"),
    ({"engines": ("tgi",)}, "--engine 'tgi'"),
    ({"baseline": "hf-tp8-bs1-default-stock"}, "not a cell of the matrix"),
    ({"batch_sizes": (0,)}, "positive"),
    ({"tps": (1, 1)}, "lists a value twice"),
    ({"dtype": "fp8"}, "--dtype"),
])
def test_bad_matrix_is_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        expand(Matrix(model="m", **kwargs))


@pytest.mark.parametrize("tp, visible, message", [
    (3, None, "does not divide the model's 16 attention heads"),
    (16, None, "does not divide the model's 8 key/value heads"),
    (4, 2, "needs 4 GPUs but 2 are visible"),
])
def test_matrix_checked_against_model_and_machine(tp, visible, message):
    plan = expand(Matrix(model="m", tps=(tp,), device="cuda"))
    with pytest.raises(InputError, match=message):
        validate_against_model(plan, QWEN_LIKE, visible)


def test_vllm_cells_may_outnumber_the_key_value_heads_by_a_multiple():
    """vLLM copies key/value heads to several ranks where TP is a multiple of their count
    (Qwen3-30B-A3B's 4 at TP=8); transformers' TP plan shards them, so its cells are refused."""
    vllm_at = lambda tp, engines=("vllm",): expand(Matrix(model="m", tps=(tp,), device="cuda", engines=engines))  # noqa: E731
    validate_against_model(vllm_at(16), QWEN_LIKE, None)  # 8 heads, 2 ranks each
    with pytest.raises(InputError, match="--tp 16 does not divide the model's 8 key/value heads"):
        validate_against_model(vllm_at(16, ("hf", "vllm")), QWEN_LIKE, None)
    six = ModelShape("qwen3", num_attention_heads=24, num_key_value_heads=6, intermediate_size=192, vocab_size=384,
                     tp_styles=QWEN_LIKE.tp_styles)
    with pytest.raises(InputError, match="--tp 4 neither divides the model's 6 key/value heads nor is a multiple"):
        validate_against_model(vllm_at(4), six, None)
    with pytest.raises(InputError, match="--tp 32 does not divide the model's 16 attention heads"):
        validate_against_model(vllm_at(32), QWEN_LIKE, None)


def test_nccl_presets():
    assert nccl.PRESETS["tree"] == {"NCCL_ALGO": "allreduce:tree"}
    assert nccl.PRESETS["deterministic"]["NCCL_PROTO"] == "Simple"
    name, env = nccl.parse_custom("lowlat:NCCL_PROTO=LL,NCCL_ALGO=Ring")
    assert (name, env) == ("lowlat", {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"})
    with pytest.raises(InputError, match="not an NCCL_"):
        nccl.parse_custom("x:OMP_NUM_THREADS=4")
    with pytest.raises(InputError, match="unknown NCCL preset 'fastest'"):
        nccl.resolve(["fastest"], {})


def test_builtin_suites_are_valid_and_documented():
    names = builtin_suites()
    assert {"smoke", "default", "chat"} <= set(names)
    assert len(load_suite("smoke").probes) == 4
    assert len(load_suite("default").probes) >= 32
    assert all(p.messages for p in load_suite("chat").probes)
    readme = (load_suite("smoke").path.parent / "README.md").read_text()
    for name in names:
        assert f"`{name}`" in readme


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], ":2: duplicate prompt id 'a' (first on line 1)"),
    (['{"id": "a", "prompt": "x"}', "not json"], ":2: invalid JSON"),
    (['{"id": "a"}'], ":1: give exactly one of 'prompt' or 'messages'"),
    (['{"id": "a", "prompt": "x", "temperature": 1}'], ":1: unknown key"),
    (['{"id": "", "prompt": "x"}'], ":1: 'id' must be a non-empty string"),
    (['{"id": "a", "messages": [{"role": "user"}]}'], ":1: 'messages' must be"),
    (['{"id": "a", "prompt": "x", "max_new_tokens": 0}'], ":1: 'max_new_tokens' must be a positive integer"),
    ([""], "has no prompts"),
    # json.loads keeps the last of a repeated key silently: this line would have been prompt 'b'.
    (['{"id": "a", "id": "b", "prompt": "x"}'], ":1: invalid JSON (repeated key"),
])
def test_malformed_probe_files_name_the_line(tmp_path, lines, message):
    path = tmp_path / "suite.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=json.dumps(message)[1:-1].replace("(", r"\(").replace(")", r"\)")):
        load_suite(str(path))


def test_probe_lines_end_at_newlines_only(tmp_path):
    # str.splitlines cut a prompt holding a raw U+2028, U+2029 or U+0085 (valid inside a JSON string,
    # and how json.dumps(ensure_ascii=False) writes them) into two invalid lines.
    path = tmp_path / "suite.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": f"x{ch}y"}, ensure_ascii=False) for i, ch in enumerate("\u2028\u2029\x85")]
    path.write_bytes(("\r\n".join(lines[:2]) + "\n\n" + lines[2]).encode())  # CRLF, a blank line, no final newline
    suite = load_suite(str(path))
    assert [(p.id, p.prompt) for p in suite.probes] == [("p0", "x\u2028y"), ("p1", "x\u2029y"), ("p2", "x\x85y")]
    path.write_bytes(f'{lines[0]}\n{{"id": "p0", "prompt": "z"}}\n'.encode())
    with pytest.raises(InputError, match=":2: duplicate prompt id 'p0' \\(first on line 1\\)"):
        load_suite(str(path))


def test_unknown_suite_lists_the_builtin_ones():
    with pytest.raises(InputError, match="unknown probe suite 'nope'.*smoke"):
        load_suite("nope")


def test_invariant_kernels_refuse_layers_they_cannot_cover():
    # Llama4's experts keep gate/up transposed and shard it by rows: not a layout tbik covers.
    llama4 = ModelShape("llama4_text", 16, 8, 192, 384, {"layers.*.feed_forward.experts": "moe_tp_experts",
                                                         "layers.*.feed_forward.experts.gate_up_proj": "packed_rowwise"})
    plan = expand(Matrix(model="m", tps=(1, 2), kernels=("stock", "tbik")))
    with pytest.raises(InputError, match="layer 'layers.\\*.feed_forward.experts.gate_up_proj' \\(TP style 'packed_rowwise'\\) is not covered"):
        validate_against_model(plan, llama4, None)
    validate_against_model(expand(Matrix(model="m", tps=(1, 2))), llama4, None)  # stock runs it
    # Qwen3-MoE's fused experts (packed_colwise gate/up, rowwise down) run repaudit's invariant forward.
    qwen_moe = ModelShape("qwen3_moe", 16, 8, 192, 384, {"layers.*.mlp.experts": "moe_tp_experts",
                                                          "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                                          "layers.*.mlp.experts.down_proj": "rowwise"},
                          moe_intermediate_size=32)
    validate_against_model(plan, qwen_moe, None)
    with pytest.raises(InputError, match="--tp 4 does not divide the model's 6 expert MLP width"):
        validate_against_model(expand(Matrix(model="m", tps=(4,))), replace(qwen_moe, moe_intermediate_size=6), None)
    windowed = ModelShape("mistral", 16, 8, 192, 384, QWEN_LIKE.tp_styles, attention="sliding-window attention")
    with pytest.raises(InputError, match="sliding-window attention is not covered"):
        validate_against_model(expand(Matrix(model="m", tps=(1,), kernels=("bi",))), windowed, None)


def test_auto_device_and_dtype_are_resolved_by_the_plan(monkeypatch):
    """The Python API's defaults (dtype="auto") reach the workers as real values, as the CLI's do."""
    import torch

    plan = expand(Matrix(model="m"))
    assert (plan.matrix.device, plan.matrix.dtype) == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = expand(Matrix(model="m", device="auto"))
    assert (plan.matrix.device, plan.matrix.dtype) == ("cuda", "bfloat16")
    assert expand(Matrix(model="m", device="auto", dtype="float16")).matrix.dtype == "float16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert expand(Matrix(model="m", device="auto")).matrix.device == "cpu"
    with pytest.raises(InputError, match="--device 'tpu': expected auto, cpu or cuda"):
        expand(Matrix(model="m", device="tpu"))


def test_the_matrix_round_trips_through_the_manifest():
    """One writer and one reader of the manifest's matrix: every field comes back, through JSON."""
    import json

    from repaudit.run.plan import plan_from_manifest
    from repaudit.run.rundir import ManifestData

    m = Matrix(model="builtin:tiny-qwen3", engines=("hf",), tps=(1, 2, 4), batch_sizes=(1, 8), kernels=("stock", "tbik"),
               modes=("score",), dtype="bfloat16", device="cuda", probes="default", max_new_tokens=7, topk=3,
               baseline="hf-tp2-bs8-default-tbik-score", reference_per=("kernels",), trace=True,
               nccl={"default": {}, "tree": {"NCCL_ALGO": "Tree"}})
    text = json.dumps(m.to_manifest())
    assert Matrix.from_manifest(json.loads(text), m.model, m.baseline) == m
    manifest = ManifestData.from_json({"matrix": json.loads(text), "model": {"id": m.model}, "baseline": m.baseline})
    assert plan_from_manifest(manifest).matrix == expand(m).matrix
    v = Matrix(model="m", engines=("vllm",), vllm_args={"enforce_eager": True, "max_num_batched_tokens": 512})
    assert Matrix.from_manifest(json.loads(json.dumps(v.to_manifest())), v.model, None) == v


def test_the_manifest_round_trips_through_one_dataclass(tmp_path):
    import json

    import pytest

    from repaudit.errors import InputError
    from repaudit.run.rundir import Manifest, ManifestData

    m = Manifest.load_or_new(tmp_path)
    m.data.command, m.data.baseline, m.data.wall_s = ["repaudit", "run"], "hf-tp1-bs1-default-stock-score", 1.5
    m.data.matrix = Matrix(model="x").to_manifest()
    m.cell("c")["status"] = "done"
    m.data.groups["g"] = {"load_s": [0.25], "attempts": 1}
    m.data.extra["from_a_later_version"] = {"kept": True}
    m.save()
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["cells"] == {"c": {"status": "done"}} and on_disk["from_a_later_version"] == {"kept": True}
    back = Manifest.load_or_new(tmp_path).data
    assert back == m.data and ManifestData.from_json(json.loads(json.dumps(back.to_json()))) == back
    with pytest.raises(InputError, match="'cells' must be a JSON object"):
        ManifestData.from_json({**on_disk, "cells": []})
