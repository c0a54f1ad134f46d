"""--trace under TP=2 (gloo, CPU): sharded vs replicated comes from the TP plan and the inputs,
never from the bits, and ranks that disagree on a replicated output are a finding of their own
that `repaudit locate` reports, instead of a "shard" summed across ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from repaudit import builtin
from repaudit.compare.locate import locate, print_locate

pytestmark = pytest.mark.slow

PLANTED = "model.layers.0.post_attention_layernorm"  # no TP style: replicated because its input is

# Two traces of one forward at TP=2: "clean", and "planted", where rank 1's copy of PLANTED's
# output is one ULP off in feature 0 at every position. Rank 0's bits are the same in both.
SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path
    import numpy as np, torch, torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from repaudit.run.trace import Tracer
    from repaudit.record.tracefile import write_trace
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path, out, planted = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    n = ids.shape[1]

    def one_ulp_up(module, args, output):
        out = output.clone()
        out[..., 0] = torch.nextafter(out[..., 0], torch.tensor(float("inf")))
        return out

    for name in ("clean", "planted"):
        handle = None
        if name == "planted" and dist.get_rank() == 1:
            handle = model.get_submodule(planted).register_forward_hook(one_ulp_up)
        tracer = Tracer(model, 2)
        tracer.begin(1, n, torch.arange(n), np.array(["p"] * n, dtype=object), np.arange(n))
        with torch.inference_mode():
            model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(n)[None])
        tracer.end()
        tracer.detach()
        if handle is not None:
            handle.remove()
        result = tracer.finish()
        if dist.get_rank() == 0:
            write_trace(out / f"{name}.trace.parquet", result[0], result[1], {"id": name})
    dist.barrier()  # no rank leaves while rank 0 still writes (see repaudit/run/worker.py)
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    (out / "script.py").write_text(SCRIPT)
    model = builtin.ensure("builtin:tiny-qwen3")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(out / "script.py"), str(model), str(out), PLANTED],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def _modules(path: Path) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(pq.read_schema(path).metadata[b"repaudit.trace_modules"])}


def test_sharding_comes_from_the_plan_and_the_inputs(traces: Path):
    mods = _modules(traces / "clean.trace.parquet")
    shards = {n for n, m in mods.items() if m["sharded"]}
    layer = "model.layers.0."
    # colwise outputs, the per-head norms and the MLP activation that take them, and row-parallel inputs
    assert {layer + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_norm",
                                "self_attn.k_norm", "self_attn.o_proj:input", "mlp.gate_proj", "mlp.act_fn",
                                "mlp.up_proj", "mlp.down_proj:input")} <= shards
    for n in ("model.embed_tokens", layer + "input_layernorm", layer + "self_attn.o_proj", layer + "self_attn",
              layer + "post_attention_layernorm", layer + "mlp.down_proj", layer + "mlp", "model.layers.0", "model.norm"):
        assert not mods[n]["sharded"], n
    assert mods[layer + "self_attn.q_norm"]["features"] == 16 * 16 and mods[PLANTED]["features"] == 64
    assert all(m["ranks_disagree"] == 0 for m in mods.values())


def test_a_rank_disagreement_is_reported_not_summed(traces: Path):
    clean, planted = _modules(traces / "clean.trace.parquet"), _modules(traces / "planted.trace.parquet")
    assert planted[PLANTED]["sharded"] is False and planted[PLANTED]["features"] == 64
    assert planted[PLANTED]["ranks_disagree"] == 6
    assert planted[PLANTED]["first_disagreement"] == {"prompt_id": "p", "pos": 0}
    # The all-reduce after it makes the ranks agree again: only the planted module disagrees.
    assert [n for n, m in planted.items() if m["ranks_disagree"]] == [PLANTED]
    assert {n: m["sharded"] for n, m in planted.items()} == {n: m["sharded"] for n, m in clean.items()}


def test_locate_names_the_module_where_ranks_disagree(traces: Path):
    r = locate(traces / "clean.trace.parquet", traces / "planted.trace.parquet")
    assert [(d.side, d.module, d.rows) for d in r.rank_disagreements] == [("B", PLANTED, 6)]
    # Between A and B, the planted module itself agrees (a trace keeps rank 0's bits); the first
    # difference is the shard rank 1 computed from its own copy. The sentence leads with the cause.
    assert r.first.name == "model.layers.0.mlp.gate_proj"
    assert r.sentence().startswith(f"ranks disagree at module {PLANTED} in B (planted: 6 positions, first at p pos 0); "
                                   "first divergence: model.layers.0.mlp.gate_proj (column-parallel)")
    same = locate(traces / "planted.trace.parquet", traces / "planted.trace.parquet")
    assert same.first is None and same.diverged  # identical traces, yet the cell's ranks disagreed
    assert same.sentence().endswith("; no module output differs between A and B")
    assert r.to_dict()["rank_disagreements"][0]["module"] == PLANTED
    console = Console(record=True, width=400)
    print_locate(r, console)
    assert f"ranks disagree at module {PLANTED}" in console.export_text()
