"""`repaudit run --trace` and `repaudit locate` on CPU: the located first divergence is the
true one, found independently by comparing whole module outputs; tbik locates nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from repaudit import commands
from repaudit.cli import main
from repaudit.run.jobspec import cell_path
from repaudit.compare.locate import locate
from repaudit.run.plan import Matrix
from repaudit.records import load_frame
from repaudit.run.runner import RunOptions
from repaudit.record.tracefile import SAMPLES, trace_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "run"
    matrix = Matrix(model="builtin:tiny-qwen3", device="cpu", dtype="float32", probes="smoke", tps=(1, 2),
                    batch_sizes=(1,), kernels=("stock", "tbik"), modes=("score",), trace=True)
    assert commands.run(matrix, RunOptions(out=out, cell_timeout=600, load_timeout=600)) == 0
    return out


# Full module outputs at TP=1 and TP=2 for one sequence, compared whole: no digests involved.
TRUTH = textwrap.dedent('''
    import json, sys, torch, torch.distributed as dist
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path, tokens = sys.argv[1], json.loads(sys.argv[2])

    def capture(model):
        outs, order = {}, []
        def keep(name, t):
            if isinstance(t, tuple): t = t[0]
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and name not in outs:
                outs[name] = (t.to_local() if hasattr(t, "to_local") else t).detach().reshape(t.shape[0] * t.shape[1], -1).clone()
                order.append(name)
        plan = {k: v for k, v in (model.tp_plan or {}).items()}
        for name, m in model.named_modules():
            if not name or "rotary" in name or m is model.get_output_embeddings():
                continue
            m.register_forward_hook(lambda mod, a, o, n=name: keep(n, o))
            if any(__import__("fnmatch").fnmatch(name, p) and s.startswith("rowwise") for p, s in plan.items()):
                m.register_forward_pre_hook(lambda mod, a, n=name + ":input": keep(n, a[0]))
        return outs, order

    def forward(model):
        ids = torch.tensor([tokens])
        with torch.inference_mode():
            model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(tokens))[None])

    tp2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
    outs2, order = capture(tp2)
    forward(tp2)
    gathered = {}
    for name in order:
        parts = [torch.empty_like(outs2[name]) for _ in range(2)]
        dist.all_gather(parts, outs2[name])
        gathered[name] = parts
    if dist.get_rank() == 0:
        tp1 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        outs1, _ = capture(tp1)
        forward(tp1)
        first = None
        for name in order:
            full = outs1[name]
            parts = gathered[name]
            # Sharded outputs hold half the features on each rank: join them; replicated ones are whole.
            mine = torch.cat(parts, dim=1) if parts[0].shape[1] * 2 == full.shape[1] else parts[0]
            if not torch.equal(mine.view(torch.int32), full.view(torch.int32)):
                first = name
                break
        print("FIRST", json.dumps(first))
    dist.barrier()  # no rank leaves while another still works (see repaudit/run/worker.py)
    dist.destroy_process_group()
''')


def _true_first_module(model_dir: Path, tokens: list[int], tmp_path: Path) -> str | None:
    script = tmp_path / "truth.py"
    script.write_text(TRUTH)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(model_dir), json.dumps(tokens)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # gloo on CPU, also where a GPU is
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[len("FIRST "):])


def test_locate_names_the_true_first_module(traced: Path, tmp_path: Path):
    a = cell_path(traced, "hf-tp1-bs1-default-stock-score")
    b = cell_path(traced, "hf-tp2-bs1-default-stock-score")
    result = locate(a, b)
    assert result.diverged
    manifest = json.loads((traced / "manifest.json").read_text())
    df = load_frame(a)
    for pid in ("smoke-arith", "smoke-fr"):
        rows = df[df["prompt_id"] == pid].sort_values("pos")
        tokens = _sequence_tokens(traced, pid, rows)
        truth = _true_first_module(Path(manifest["model"]["path"]), tokens, tmp_path)
        assert truth is not None
        assert result.first_by_prompt[pid][0] == truth, (pid, result.first_by_prompt[pid], truth)
    styles = {m.name: m.style for m in result.modules}
    assert "layers.0." in result.first.name and styles[result.first.name].startswith("rowwise")
    assert result.sentence().startswith(f"first divergence: {result.first.name} (row-parallel)")


def _sequence_tokens(run: Path, pid: str, rows) -> list[int]:
    spec = json.loads(sorted((run / "jobs" / "node0").glob("*.json"))[0].read_text())
    prompt = next(p for p in spec["prompts"] if p["id"] == pid)["tokens"]
    return [prompt[0]] + rows["token_id"].astype(int).tolist()


def test_tbik_locates_nothing(traced: Path):
    r = locate(cell_path(traced, "hf-tp1-bs1-default-tbik-score"), cell_path(traced, "hf-tp2-bs1-default-tbik-score"))
    assert not r.diverged and all(m.differing == 0 and m.compared > 0 for m in r.modules)
    assert r.sentence().startswith("no module output differs")


def test_trace_format_and_cli(traced: Path, capsys, tmp_path: Path):
    t = pq.read_table(trace_path(cell_path(traced, "hf-tp2-bs1-default-stock-score")))
    meta = t.schema.metadata
    assert meta[b"repaudit.trace_version"] == b"2"
    modules = json.loads(meta[b"repaudit.trace_modules"])
    by_name = {m["name"]: m for m in modules}
    assert by_name["model.layers.0.self_attn.q_proj"]["sharded"] is True  # column-parallel: half per rank
    assert by_name["model.layers.0.self_attn.o_proj"]["sharded"] is False  # reduced: whole on every rank
    assert by_name["model.layers.0.self_attn.q_proj"]["features"] == 16 * 16
    df = t.to_pandas()
    assert len(df.iloc[0]["sample"]) == SAMPLES
    assert not df.duplicated(["prompt_id", "pos", "module"]).any()
    a = str(cell_path(traced, "hf-tp1-bs1-default-stock-score"))
    b = str(cell_path(traced, "hf-tp2-bs1-default-stock-score"))
    out = tmp_path / "locate.json"
    assert main(["locate", a, b, "--json", str(out)]) == 1
    assert json.loads(out.read_text())["summary"].startswith("first divergence: model.layers.0.")
    assert main(["locate", str(cell_path(traced, "hf-tp1-bs1-default-tbik-score")),
                 str(cell_path(traced, "hf-tp2-bs1-default-tbik-score"))]) == 0
    capsys.readouterr()
    assert main(["locate", a, str(tmp_path / "nope.parquet")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_report_shows_the_first_divergent_module_of_traced_pairs(traced: Path):
    assert main(["report", str(traced)]) == 0
    html = (traced / "report.html").read_text()
    md = (traced / "report.md").read_text()
    truth = locate(cell_path(traced, "hf-tp1-bs1-default-stock-score"), cell_path(traced, "hf-tp2-bs1-default-stock-score"))
    assert 'id="locate"' in html and truth.first is not None
    assert f"<code>{truth.first.name}</code>" in html  # the stock TP=2 pair's first divergent module
    assert "## Where in the model the bits first change" in md and f"`{truth.first.name}`" in md
    assert "no module output differs" in md  # the tbik pair


def test_locating_cells_against_one_reference_reads_it_once(traced: Path, monkeypatch):
    from repaudit.compare import locate as locate_module

    reads = []
    real_read = locate_module._read
    monkeypatch.setattr(locate_module, "_read", lambda path: reads.append(path) or real_read(path))
    ref = cell_path(traced, "hf-tp1-bs1-default-stock-score")
    cells = [cell_path(traced, c) for c in ("hf-tp2-bs1-default-stock-score", "hf-tp1-bs1-default-tbik-score")]
    traces: dict = {}
    shared = [locate(ref, c, traces).to_dict() for c in cells]
    assert reads.count(trace_path(ref)) == 1 and len(reads) == 3
    assert shared == [locate(ref, c).to_dict() for c in cells]


def test_trace_table_rows_are_each_module_call_at_each_token_once():
    """The table built from a traced model whose one Linear runs twice per forward (a shared
    module): every (prompt, position, module) once, the shared module's first call kept, each
    row's digest and sampled bits those of the output row at that token, computed here
    independently."""
    import numpy as np
    import torch

    from repaudit.record.digest import numpy_row_digest
    from repaudit.run.trace import Tracer

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.out(self.inner(self.inner(x)))

        def get_output_embeddings(self):
            return None

    torch.manual_seed(0)
    model = Shared()
    tracer = Tracer(model, tp=1)
    x = [torch.randn(2, 3, 4), torch.randn(1, 2, 4)]
    real = [torch.tensor([1, 2, 4, 5]), torch.tensor([0, 1])]  # flat rows; row 0 and 3 of the first are padding
    pids = [np.array(["b", "b", "a", "a"], dtype=object), np.array(["c", "c"], dtype=object)]
    positions = [np.array([7, 8, 3, 4]), np.array([0, 1])]
    expected = {}
    for xb, rows, pid, pos in zip(x, real, pids, positions):
        tracer.begin(xb.shape[0], xb.shape[1], rows, pid, pos)
        with torch.no_grad():
            model(xb)
        tracer.end()
        with torch.no_grad():
            once = model.inner(xb).reshape(-1, 4)[rows].numpy()  # the first call of the shared module
            out = model.out(model.inner(model.inner(xb))).reshape(-1, 3)[rows].numpy()
        for name, value in (("inner", once), ("out", out)):
            # Negative values: sample bits above 2^31 must come through as they are.
            picked = np.linspace(0, value.shape[1] - 1, SAMPLES).round().astype(int)
            bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32)[:, picked]
            for p, q, row, sample in zip(pid, pos, numpy_row_digest(value), bits):
                expected[(p, int(q), name)] = (int(row), sample.tolist())
    table, infos = tracer.finish()
    got = {(p, q, m): (d, x) for p, q, m, d, x in zip(table["prompt_id"].to_pylist(), table["pos"].to_pylist(),
                                                      table["module"].to_pylist(), table["digest"].to_pylist(),
                                                      table["sample"].to_pylist())}
    assert table.num_rows == len(got) == len(expected) == 12
    assert got == expected
    assert [i.name for i in infos] == ["inner", "out"]
    assert set(zip(table["module"].to_pylist(), table["order"].to_pylist())) == {("inner", 0), ("out", 1)}


def test_an_output_shaped_per_token_only_at_a_decode_step_is_not_traced():
    """MLA attention (DeepSeek-V3) expands the whole cached latents through kv_b_proj:
    [batch, 1, cached, features], which at a decode step (length 1) is shaped like a per-token
    output. It used to be traced there, at decode positions only, ordered after the final norm
    and sampled at the first step's width; it is no token's row, so it is not traced (also where
    a one-token prompt's prefill looked per token), and every other module has a row at every token."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from repaudit.engines import hf
    from repaudit.engines.base import Sequence
    from repaudit.run.trace import Tracer

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                           q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    hfm = hf.HFModel(model=model, device=torch.device("cpu"), tp=1, stop_ids=(), pad_id=0,
                     log_softmax=hf._torch_log_softmax, decode="dynamic")
    hfm.tracer = Tracer(model, 1)
    for batch in ([Sequence("one", (7,), None, 3)], [Sequence("a", (5, 6, 7, 8, 9), None, 3)]):
        hf.generate(hfm, batch, 0)
    hfm.tracer.detach()
    table, infos = hfm.tracer.finish()
    names = [i.name for i in infos]
    assert not [n for n in names if "kv_b_proj" in n]
    assert "model.layers.0.self_attn.kv_a_layernorm" in names and set(table["module"].to_pylist()) == set(names)
    tokens = {("one", 0), ("one", 1), ("one", 2), *(("a", p) for p in range(7))}
    keys = list(zip(table["prompt_id"].to_pylist(), table["pos"].to_pylist(), table["module"].to_pylist()))
    assert len(keys) == len(set(keys)) == len(tokens) * len(names)
    assert np.array_equal(np.unique(table["order"].to_numpy()), np.arange(len(names)))


def test_positions_after_a_differing_token_are_left_out(traced: Path, tmp_path: Path):
    """A generate cell that picked another token feeds other inputs from there on: locate leaves
    those positions out (and counts them) instead of calling the first module a divergence.
    Made from one tbik cell copied twice: in B, the prompt's token at FORK differs in the
    records, and every module's digest at FORK and after differs in the trace."""
    import numpy as np

    src = cell_path(traced, "hf-tp1-bs1-default-tbik-score")
    records, trace = pq.read_table(src), pq.read_table(trace_path(src))
    pid, fork = "smoke-arith", 3
    in_b = np.asarray(records.column("prompt_id").to_pylist()) == pid
    later = (np.asarray(trace.column("prompt_id").to_pylist()) == pid) & (trace.column("pos").to_numpy() >= fork)
    after = len(set(trace.column("pos").to_numpy()[later].tolist()))
    token = records.column("token_id").to_numpy().copy()
    token[in_b & (records.column("pos").to_numpy() == fork)] += 1
    digest = trace.column("digest").to_numpy().copy()
    digest[later] += 1

    a = _copied_cell(tmp_path, "a", records, trace)
    forked = _copied_cell(tmp_path, "forked", _replaced(records, "token_id", token), _replaced(trace, "digest", digest))
    r = locate(a, forked)
    assert not r.diverged and r.after_fork == after > 0
    assert f"{after} positions at or after a sequence's first differing token left out" in r.sentence()
    assert r.to_dict()["after_fork_positions"] == after
    # The same trace with the tokens unchanged: the differing digests are a divergence at FORK.
    same_tokens = _copied_cell(tmp_path, "same_tokens", records, _replaced(trace, "digest", digest))
    r = locate(a, same_tokens)
    assert r.diverged and r.after_fork == 0 and r.first_by_prompt[pid][1] == fork


def _mutating_model():
    """a -> b -> c, where the parent changes a's output after b has read it through `.data` (a
    write torch's version counter does not see, as a raw kernel's) and b's output in place with
    a torch op (one it does see), each only while the flag for it is set."""
    import torch

    class Mutating(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 6)
            self.c = torch.nn.Linear(6, 5)
            self.raw_write = self.torch_write = True

        def forward(self, x):
            h = self.a(x)
            g = self.b(h)
            if self.raw_write:
                h.data.add_(1)
            if self.torch_write:
                g.mul_(2)
            return self.c(g)

        def get_output_embeddings(self):
            return None

    return Mutating()


def _decode_step(tracer):
    import numpy as np
    import torch

    tracer.begin_step(np.array(["p", "q"], dtype=object), torch.tensor([6, 7]), torch.tensor([True, True]))


def test_a_graphs_warm_up_finds_outputs_changed_after_their_hook_and_its_capture_digests_the_rest_together():
    """The warm-up digests every output at its hook and again deferred: a and b, whose outputs
    the model changes after their hooks (through a write the version counter does not see, and
    through one it does), are named in a warning and digested at the hook from then on. The
    capture then holds only c's output for the forward's one launch, and the packed block has
    the digests and samples an ordinary forward gives, bit for bit. A later warm-up checks no
    layout twice."""
    import warnings

    import torch

    from repaudit.run.trace import Tracer

    torch.manual_seed(0)
    model = _mutating_model()
    tracer = Tracer(model, tp=1)
    x = torch.randn(2, 1, 4)
    with torch.no_grad():
        _decode_step(tracer)
        model(x)
        eager = tracer.pack(tracer.take_since(0))
        mark = tracer.mark()
        with warnings.catch_warnings(record=True) as caught, tracer.warming():
            warnings.simplefilter("always")
            model(x)
        assert [str(w.message) for w in caught] == [
            "--trace: the outputs of a, b change in place after their module returns; they are digested at the "
            "hook, a launch each in every decode graph"]
        assert len(tracer.take_since(mark)) == 3
        assert [n for n, c in tracer.calls.items() if c.in_place] == ["a", "b"]
        with tracer.capturing():
            model(x)
            assert [e.calls.info.name for e, _ in tracer._deferred] == ["c"]
            captured = tracer.pack(tracer.take_since(mark))
        assert tracer._deferred == []
        # The next graph's warm-up: c's layout was checked, so c is only held (no digest at its hook).
        with warnings.catch_warnings(record=True) as caught, tracer.warming():
            warnings.simplefilter("always")
            model(x)
        assert caught == []
        assert [(e.calls.info.name, e.digests is None) for e in tracer.take_since(mark)] == [
            ("a", False), ("b", False), ("c", True)]
    assert torch.equal(captured.digests, eager.digests) and torch.equal(captured.samples, eager.samples)
    tracer.end()


def test_a_capture_that_changes_an_output_the_warm_up_did_not_is_refused():
    """An in-place change the warm-up did not see (the step took another path) is caught at the
    capture's launch by the version counter: the capture fails (its steps then run eagerly)."""
    import pytest
    import torch

    from repaudit.run.trace import Tracer

    model = _mutating_model()
    model.raw_write = model.torch_write = False
    tracer = Tracer(model, tp=1)
    with torch.no_grad():
        _decode_step(tracer)
        mark = tracer.mark()
        with tracer.warming():
            model(torch.randn(2, 1, 4))
        tracer.take_since(mark)
        assert not any(c.in_place for c in tracer.calls.values())
        model.torch_write = True
        with pytest.raises(RuntimeError, match="output of b changed in place after its hook during the capture"):
            with tracer.capturing():
                model(torch.randn(2, 1, 4))
                tracer.pack(tracer.take_since(mark))
        assert tracer._deferred == [] and tracer._defer is None
    tracer.end()


def _copied_cell(tmp_path: Path, name: str, records, trace) -> Path:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(records, path)
    pq.write_table(trace, trace_path(path))
    return path


def _replaced(table, column: str, values):
    import pyarrow as pa

    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))


def test_logits_that_differ_first_are_the_lm_heads_divergence(traced: Path, tmp_path: Path):
    """The lm_head is not traced; its logits rows are compared through the records' row digests.
    Where the logits of position P differ (record row P + 1) and no traced output does, locate
    names the lm_head at P (it used to say that nothing differs)."""
    import numpy as np

    src = cell_path(traced, "hf-tp1-bs1-default-tbik-score")
    records, trace = pq.read_table(src), pq.read_table(trace_path(src))
    pid, row_pos = "smoke-arith", 4
    digest = records.column("row_digest").to_numpy().copy()
    at = (np.asarray(records.column("prompt_id").to_pylist()) == pid) & (records.column("pos").to_numpy() == row_pos)
    assert at.sum() == 1
    digest[at] ^= 1
    a = _copied_cell(tmp_path, "a", records, trace)
    b = _copied_cell(tmp_path, "b", _replaced(records, "row_digest", digest), trace)
    r = locate(a, b)
    assert r.first_by_prompt[pid] == ("lm_head", row_pos - 1)
    head = next(m for m in r.modules if m.name == "lm_head")
    assert head.differing == 1 and head.order == max(m.order for m in r.modules)
    assert head.compared == len(records) - records.column("pos").to_numpy().tolist().count(0)
    assert r.diverged and r.first.name == "lm_head" and r.sentence().startswith("first divergence: lm_head")


def test_a_generate_cells_prefill_comes_before_its_decode_steps(traced: Path, tmp_path: Path):
    """Execution order is forward first: a late module that differs in the prefill diverged
    before an early module that differs in a decode step."""
    import json as _json

    import numpy as np

    from repaudit.record.tracefile import KEY_CELL

    src = cell_path(traced, "hf-tp1-bs1-default-tbik-score")
    records, trace = pq.read_table(src), pq.read_table(trace_path(src))
    pid = "smoke-arith"
    mine = np.asarray(records.column("prompt_id").to_pylist()) == pid
    pos = records.column("pos").to_numpy()
    prompt_len = 5  # rows from here on count as generated: the prefill runs positions 0..4
    phase = ["completion" if p >= prompt_len else "prompt" for p in pos]
    records = _replaced(records, "phase", phase)
    meta = dict(trace.schema.metadata)
    meta[KEY_CELL.encode()] = _json.dumps({**_json.loads(meta[KEY_CELL.encode()]), "mode": "generate"}).encode()
    trace = trace.replace_schema_metadata(meta)
    modules = trace.column("module").to_pylist()
    orders = trace.column("order").to_numpy()
    tpos = trace.column("pos").to_numpy()
    tpid = np.asarray(trace.column("prompt_id").to_pylist())
    early, late = modules[int(np.argmin(orders))], modules[int(np.argmax(orders))]
    digest = trace.column("digest").to_numpy().copy()
    decode_early = (tpid == pid) & (np.asarray(modules) == early) & (tpos == prompt_len + 1)  # decode step 2
    prefill_late = (tpid == pid) & (np.asarray(modules) == late) & (tpos == 2)
    assert decode_early.sum() == 1 and prefill_late.sum() == 1 and mine.any()
    digest[decode_early | prefill_late] += 1
    a = _copied_cell(tmp_path, "a", records, trace)
    b = _copied_cell(tmp_path, "b", records, _replaced(trace, "digest", digest))
    r = locate(a, b)
    assert r.first_by_prompt[pid] == (late, 2)
    assert r.first.name == late
    # The same differences in a score cell (one forward): the earliest module wins.
    score_meta = dict(meta)
    score_meta[KEY_CELL.encode()] = _json.dumps({**_json.loads(meta[KEY_CELL.encode()]), "mode": "score"}).encode()
    a = _copied_cell(tmp_path, "a2", records, trace.replace_schema_metadata(score_meta))
    b = _copied_cell(tmp_path, "b2", records, _replaced(trace, "digest", digest).replace_schema_metadata(score_meta))
    assert locate(a, b).first_by_prompt[pid] == (early, prompt_len + 1)
    # Generate again: the logits of decode step 1 (position prompt_len, record row prompt_len + 1)
    # are computed before decode step 2's first module.
    row_digest = records.column("row_digest").to_numpy().copy()
    row_digest[mine & (pos == prompt_len + 1)] ^= 1
    only_decode = digest.copy()
    only_decode[prefill_late] -= 1
    a = _copied_cell(tmp_path, "a3", records, trace)
    b = _copied_cell(tmp_path, "b3", _replaced(records, "row_digest", row_digest), _replaced(trace, "digest", only_decode))
    assert locate(a, b).first_by_prompt[pid] == ("lm_head", prompt_len)


def test_the_row_index_made_on_a_device_is_the_hosts():
    """Rows.index_on_device (what a GPU runs) against numpy's concatenation (what the CPU runs):
    blocks of several layouts, a module called twice per forward, decode keys whose live rows are
    a subset (finished sequences left out), a key with no live row."""
    import numpy as np
    import torch

    from repaudit.run.tracerows import Block, Layout, Rows

    calls = ["a", "b", "c"]
    prefill = Layout(["a", "b", "b", "c"], 5, np.zeros(4, np.int64), np.zeros(4, np.int64))
    step = Layout(["a", "b", "c"], 3, np.zeros(3, np.int64), np.zeros(3, np.int64))
    blocks = [Block(k, lay, torch.zeros(len(lay.calls) * lay.rows, dtype=torch.int64),
                    torch.zeros((len(lay.calls) * lay.rows, 8), dtype=torch.int32), None)
              for k, lay in enumerate([prefill, step, step, prefill, step])]
    live = {1: np.array([0, 2]), 2: np.array([], dtype=np.int64), 4: np.array([1])}
    token_of_key = [np.arange(5), np.arange(2), np.arange(0), np.arange(5), np.arange(1)]
    rows = Rows.build(blocks, calls, live, token_of_key)
    host = rows.index_on_host()
    assert len(host) == rows.counts.sum() == 2 * (5 + 2 * 5 + 5) + 2 * 3 + 1 * 3
    assert torch.equal(rows.index_on_device(torch.device("cpu")), host)
    # Module "b": its two calls in the first prefill, then the steps' live rows, then the second prefill.
    b = host[rows.counts[0]:rows.counts[0] + rows.counts[1]].tolist()
    assert b == [*range(5, 15), 23, 25, *range(43, 53), 62]


@pytest.mark.gpu
def test_copies_off_the_device_keep_every_byte_on_a_gpu():
    """to_host's staged copy: several staging pieces and a ragged last one, twice in a row
    (the staging buffers are reused), an empty tensor, and a 2-D one keeps its shape."""
    import torch

    from repaudit.run.tracerows import to_host

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(3)
    for n in (9_000_011, 9_000_011, 0):
        t = torch.randint(-2**62, 2**62, (n,), generator=g, device="cuda", dtype=torch.int64)
        got = to_host(t)
        assert got.dtype == np.int64 and np.array_equal(got, t.cpu().numpy())
        del got
    t = torch.randint(0, 2**31 - 1, (1_000_003, 8), generator=g, device="cuda", dtype=torch.int32)
    got = to_host(t)
    assert got.shape == (1_000_003, 8) and np.array_equal(got, t.cpu().numpy())
