"""Mixture of experts on CPU: the built-in Qwen3-MoE models, each MoE layer's routing in the trace,
`repaudit locate`'s routing section, and bi / tbik keeping MoE records bitwise identical across
batch sizes (and, tbik, TP sizes) as they do for dense models."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from repaudit.cli import main
from repaudit.compare.locate import locate
from repaudit.record.tracefile import SAMPLES, SCHEMA, ModuleInfo, trace_path, write_trace

TINY = "builtin:tiny-qwen3-moe"

# ---------------------------------------------------------------------------- the built-ins


def test_builtin_moe_specs_have_the_shapes_their_names_and_docs_say():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from repaudit.builtin import BUILTINS

    counts = {}
    for name in ("tiny-qwen3-moe", "qwen3-moe-1.6b"):
        spec = BUILTINS[name]
        cfg = AutoConfig.for_model(spec.family, **spec.config)
        assert cfg.model_type == "qwen3_moe" and cfg.norm_topk_prob and cfg.decoder_sparse_step == 1
        assert cfg.moe_intermediate_size % 16 == 0  # whole tbik chunks at TP 1 and 2
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    tiny, gpu = BUILTINS["tiny-qwen3-moe"].config, BUILTINS["qwen3-moe-1.6b"].config
    assert (tiny["num_experts"], tiny["num_experts_per_tok"], tiny["num_hidden_layers"]) == (8, 2, 2)
    assert (gpu["num_experts"], gpu["num_experts_per_tok"], gpu["head_dim"]) == (128, 8, 128)  # Qwen3-30B-A3B's
    assert counts["tiny-qwen3-moe"] < 300_000
    assert round(counts["qwen3-moe-1.6b"] / 1e9, 2) == 1.58


@pytest.fixture(scope="module")
def tiny_model():
    from repaudit import builtin
    from repaudit.engines import hf

    path = builtin.ensure(TINY)
    hf.cfg_check(str(path), False)  # a verified family: the engine takes it
    return hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=(256,), pad_id=256)


def test_tiny_moe_is_small_and_every_layer_has_fused_experts(tiny_model):
    from repaudit import builtin
    from repaudit.run.experts import is_experts, unsupported_reason

    path = builtin.ensure(TINY)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert sum(f.stat().st_size for f in path.glob("*.safetensors")) < 2 << 20
    experts = [n for n, m in tiny_model.model.named_modules() if is_experts(m)]
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(unsupported_reason(tiny_model.model.get_submodule(n)) is None for n in experts)


# ---------------------------------------------------------------------------- the experts under bi / tbik


@pytest.mark.parametrize("mode", ["bi", "tbik"])
def test_invariant_experts_forward_is_batch_invariant_and_computes_the_experts(tiny_model, mode):
    import torch

    from repaudit.run.kernelmodes import kernel_mode

    layer = tiny_model.model.model.layers[0].mlp
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    _, weights, ids = layer.gate(x)
    assert len(torch.unique(ids)) == 8  # every expert gets tokens: groups of many sizes
    stock = layer.experts(x, ids, weights)
    with torch.inference_mode(), kernel_mode(tiny_model, mode):
        assert "forward" in layer.experts.__dict__  # the mode's forward, not transformers'
        whole = layer.experts(x, ids, weights)
        alone = torch.cat([layer.experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1]) for i in range(len(x))])
        reversed_ = layer.experts(x.flip(0), ids.flip(0), weights.flip(0)).flip(0)
    assert "forward" not in layer.experts.__dict__  # back to stock after the cell
    assert torch.equal(whole.view(torch.int32), alone.view(torch.int32))
    assert torch.equal(whole.view(torch.int32), reversed_.view(torch.int32))
    torch.testing.assert_close(whole, stock, rtol=1e-5, atol=1e-6)  # the same function, other roundings


def test_an_experts_layout_tbik_does_not_compute_is_refused_by_name(tiny_model):
    from repaudit.run.kernelmodes import UnsupportedLayer, kernel_mode

    experts = tiny_model.model.model.layers[1].mlp.experts
    experts.is_transposed = True
    try:
        with pytest.raises(UnsupportedLayer, match=r"'model.layers.1.mlp.experts'.*is_transposed=True"):
            with kernel_mode(tiny_model, "tbik"):
                pass
    finally:
        experts.is_transposed = False


# ---------------------------------------------------------------------------- locate's routing section

LAYERS, PROMPTS, POSITIONS = 2, ("p", "q"), range(5)


def _ids(layer: int, prompt: str, pos: int) -> list[int]:
    first = (layer * 3 + len(prompt) + pos) % 7
    return [first, first + 1 + pos % 2]  # sorted, as the tracer stores them


def _write(path: Path, changed: dict | None = None, dense: bool = False, version: str | None = None) -> Path:
    """A trace of an MoE model's layers (router logits, routing, experts output per token);
    changed {(layer, prompt, pos): ids} makes those rows route elsewhere, their outputs differ."""
    changed = changed or {}
    names = []
    for layer in range(LAYERS):
        mlp = f"model.layers.{layer}.mlp"
        names += [f"{mlp}.gate"] + ([] if dense else [f"{mlp}.experts:routing"]) + [f"{mlp}.experts"]
    rows = []
    for prompt, pos in itertools.product(PROMPTS, POSITIONS):
        for order, name in enumerate(names):
            layer = int(name.split(".")[2])
            moved = (layer, prompt, pos) in changed
            ids = changed.get((layer, prompt, pos), _ids(layer, prompt, pos))
            digest = (hash((name, prompt, pos)) + (1 if moved and not name.endswith(":routing") else 0)) % (1 << 64)
            if name.endswith(":routing"):
                digest = hash(tuple(ids)) % (1 << 64)
            rows.append((prompt, pos, name, order, digest, [0] * SAMPLES, ids if name.endswith(":routing") else None))
    cols = list(zip(*rows))
    table = pa.Table.from_arrays([
        pa.array(cols[0]).dictionary_encode(), pa.array(cols[1], pa.int32()), pa.array(cols[2]).dictionary_encode(),
        pa.array(cols[3], pa.int32()), pa.array(cols[4], pa.uint64()),
        pa.array(cols[5], pa.list_(pa.uint32(), SAMPLES)), pa.array(cols[6], pa.list_(pa.int32())),
    ], schema=SCHEMA)
    modules = [ModuleInfo(name=n, order=i, dtype="int32" if n.endswith(":routing") else "float32",
                          features=2 if n.endswith(":routing") else 64, sharded=False, style=None,
                          routing=n.endswith(":routing")) for i, n in enumerate(names)]
    if version == "1":  # what repaudit wrote before routing: no experts column, no routing rows
        table = table.drop_columns(["experts"])
    out = write_trace(trace_path(path), table, modules, {"id": path.stem})
    if version:
        import pyarrow.parquet as pq

        t = pq.read_table(out)
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"repaudit.trace_version": version.encode()}), out)
    return path


def test_locate_reports_the_first_layer_whose_routing_differs_and_the_agreement_rate(tmp_path):
    a = _write(tmp_path / "a.parquet")
    b = _write(tmp_path / "b.parquet", {(1, "q", 3): [1, 6]})
    r = locate(a, b)
    assert r.routing is not None and r.diverged
    assert [(x.name, x.compared, x.agreeing, x.first) for x in r.routing.layers] == [
        ("model.layers.0.mlp.experts", 10, 10, None),
        ("model.layers.1.mlp.experts", 10, 9, {"prompt_id": "q", "pos": 3})]
    assert r.routing.first_layer.name == "model.layers.1.mlp.experts"
    assert (r.routing.agreeing, r.routing.compared) == (19, 20)
    assert r.first.name == "model.layers.1.mlp.gate"  # the router's logits moved first
    assert all(not m.name.endswith(":routing") for m in r.modules)  # routing has its own section
    assert r.sentence() == ("first divergence: model.layers.1.mlp.gate; routing first differs at "
                            "model.layers.1.mlp.experts (1 of 10 tokens); 95.00% of (token, MoE layer) pairs "
                            "choose the same experts (19/20)")
    d = r.to_dict()["routing"]
    assert (d["first_layer"], d["agreeing"], d["compared"], d["agreement"]) == ("model.layers.1.mlp.experts", 19, 20, 0.95)
    assert d["layers"][1]["first"] == {"prompt_id": "q", "pos": 3}


def test_the_earliest_layer_in_forward_order_is_first_whatever_the_positions(tmp_path):
    a = _write(tmp_path / "a.parquet")
    b = _write(tmp_path / "b.parquet", {(1, "p", 0): [0, 7], (0, "q", 4): [2, 3], (0, "p", 2): [5, 6]})
    routing = locate(a, b).routing
    assert routing.first_layer.name == "model.layers.0.mlp.experts"
    assert routing.layers[0].first == {"prompt_id": "p", "pos": 2}  # prompt order, then position
    assert [(x.agreeing, x.compared) for x in routing.layers] == [(8, 10), (9, 10)]
    same = locate(a, _write(tmp_path / "c.parquet")).routing
    assert same.first_layer is None and (same.agreeing, same.compared) == (20, 20)


def test_locate_cli_prints_the_routing_section_and_writes_it_to_json(tmp_path, capsys):
    a = _write(tmp_path / "a.parquet")
    b = _write(tmp_path / "b.parquet", {(0, "p", 1): [3, 4]})
    out = tmp_path / "locate.json"
    assert main(["locate", str(a), str(b), "--json", str(out)]) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "router choices" in text and "9/10 (90.00%)" in text and "p pos 1" in text
    assert "routing first differs at model.layers.0.mlp.experts (1 of 10 tokens); 95.00% of (token, MoE layer)" in text
    data = json.loads(out.read_text())
    assert data["routing"]["first_layer"] == "model.layers.0.mlp.experts" and data["routing"]["agreement"] == 0.95
    assert main(["locate", str(a), str(a)]) == 0


def test_locate_reads_routing_on_the_light_install(tmp_path):
    """No torch, transformers or pandas: locate's routing section is plain pyarrow and numpy."""
    import subprocess
    import sys

    a = _write(tmp_path / "a.parquet")
    b = _write(tmp_path / "b.parquet", {(1, "p", 2): [0, 1]})
    light = ("import sys\nfor m in ('torch', 'triton', 'transformers', 'pandas'):\n    sys.modules[m] = None\n"
             "from repaudit.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", light, "locate", str(a), str(b)], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1])},
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "routing first differs at model.layers.1.mlp.experts (1 of 10 tokens)" in " ".join(proc.stdout.split())


def test_dense_and_version_1_traces_have_no_routing_section(tmp_path, capsys):
    for name, kw in (("dense", {"dense": True}), ("v1", {"dense": True, "version": "1"})):
        a, b = _write(tmp_path / f"{name}-a.parquet", **kw), _write(tmp_path / f"{name}-b.parquet", **kw)
        out = tmp_path / f"{name}.json"
        assert main(["locate", str(a), str(b), "--json", str(out)]) == 0
        assert "router" not in capsys.readouterr().out
        data = json.loads(out.read_text())
        assert data["routing"] is None and data["summary"] == "no module output differs: every traced position is bitwise identical"


# ---------------------------------------------------------------------------- the matrix, traced (gloo for TP=2)

TPS, BATCHES, MODES, KERNELS = (1, 2), (1, 8), ("generate", "score"), ("stock", "bi", "tbik")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from repaudit import commands
    from repaudit.run.plan import Matrix
    from repaudit.run.runner import RunOptions

    out = tmp_path_factory.mktemp("moe") / "run"
    matrix = Matrix(model=TINY, device="cpu", dtype="float32", probes="smoke", tps=TPS, batch_sizes=BATCHES,
                    kernels=KERNELS, modes=MODES, trace=True)
    commands.run(matrix, RunOptions(out=out, cell_timeout=900, load_timeout=600))
    return out


def _cell(run: Path, tp: int, bs: int, kernels: str, mode: str) -> Path:
    from repaudit.run.jobspec import cell_path

    return cell_path(run, f"hf-tp{tp}-bs{bs}-default-{kernels}-{mode}")


@pytest.mark.slow
@pytest.mark.parametrize("kernels, tps", [("bi", (1,)), ("tbik", TPS)])
def test_invariant_modes_keep_moe_records_bitwise_identical(runs, kernels, tps):
    from repaudit.diff import diff_records

    for mode in MODES:
        ref = _cell(runs, 1, 1, kernels, mode)
        for tp, bs in itertools.product(tps, BATCHES):
            if (tp, bs) == (1, 1):
                continue
            r = diff_records(ref, _cell(runs, tp, bs, kernels, mode))
            assert r.identical and r.comparable > 0 and r.digest_equal == r.digest_compared > 0, (kernels, mode, tp, bs)


@pytest.mark.slow
def test_stock_moe_records_move_with_batch_and_tp(runs):
    from repaudit.diff import diff_records

    ref = _cell(runs, 1, 1, "stock", "score")
    assert not diff_records(ref, _cell(runs, 2, 1, "stock", "score")).identical
    assert not diff_records(ref, _cell(runs, 1, 8, "stock", "score")).identical


@pytest.mark.slow
def test_the_routing_trace_is_the_routers_own_choice(runs):
    """Per token and MoE layer, the trace's experts are top-k of softmax(router logits) as
    transformers returns those logits (output_router_logits) for the sequence alone."""
    import pandas as pd
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    cell = _cell(runs, 1, 1, "stock", "score")
    trace = pq.read_table(trace_path(cell))
    modules = {m["name"]: m for m in json.loads(trace.schema.metadata[b"repaudit.trace_modules"])}
    routing = [n for n in modules if modules[n]["routing"]]
    assert routing == ["model.layers.0.mlp.experts:routing", "model.layers.1.mlp.experts:routing"]
    assert all(modules[n]["dtype"] == "int32" and modules[n]["features"] == 2 for n in routing)
    df = trace.to_pandas()
    assert df[~df["module"].isin(routing)]["experts"].isna().all()
    manifest = json.loads((runs / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(manifest["model"]["path"], dtype=torch.float32).eval()
    spec = json.loads(sorted((runs / "jobs" / "node0").glob("hf-tp1-*.json"))[0].read_text())
    record = pd.read_parquet(cell)
    for prompt in spec["prompts"]:
        rows = record[record["prompt_id"] == prompt["id"]].sort_values("pos")
        tokens = [prompt["tokens"][0]] + rows["token_id"].astype(int).tolist()
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([tokens]), output_router_logits=True).router_logits
        for layer, name in enumerate(routing):
            want = torch.topk(torch.softmax(logits[layer].float(), -1), 2, dim=-1).indices.sort(-1).values.numpy()
            got = df[(df["module"] == name) & (df["prompt_id"] == prompt["id"])].sort_values("pos")
            assert got["pos"].tolist() == list(range(len(tokens)))  # every real position, once
            assert np.array_equal(np.stack(got["experts"].to_numpy()), want), (prompt["id"], name)


@pytest.mark.slow
def test_locate_on_moe_cells(runs, tmp_path):
    tbik = locate(_cell(runs, 1, 1, "tbik", "score"), _cell(runs, 2, 8, "tbik", "score"))
    assert not tbik.diverged and tbik.routing.first_layer is None and tbik.routing.compared > 0
    assert tbik.sentence().endswith(f"routing: the same experts at every (token, MoE layer) pair ({tbik.routing.compared})")
    stock = locate(_cell(runs, 1, 1, "stock", "score"), _cell(runs, 2, 1, "stock", "score"))
    assert stock.diverged and {m.name for m in stock.modules} >= {"model.layers.0.mlp.gate", "model.layers.0.mlp.experts"}
    out = tmp_path / "l.json"
    assert main(["locate", str(_cell(runs, 1, 1, "tbik", "generate")), str(_cell(runs, 2, 1, "tbik", "generate")),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())["routing"]
    assert data["agreement"] == 1.0 and [x["name"] for x in data["layers"]] == ["model.layers.0.mlp.experts",
                                                                               "model.layers.1.mlp.experts"]
