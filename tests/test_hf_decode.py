"""The transformers engine's decode paths (engines/hf_decode.py) change no bit they promise to keep.

CPU: the static cache's eager steps against the dynamic cache, in the bi and tbik modes, over a
left-padded batch whose sequences end at different steps (their records must be the dynamic
cache's bit for bit: tbik's attention stops at the last written key); a decode="graphs" model
off CUDA runs the eager static steps. tbik.attention's `end` (what keeps those bits) is tested
in test_tbik_ops.py; the stock static path against the model's own static-cache forward in
test_conformance.py.

GPU (marked, skipped on CPU): CUDA-graph replays against the eager static steps, every kernel
mode, bit for bit, and stock graph replays against model.generate with a static cache; run by
benchmarks/gpu_decode.sh and benchmarks/gpu_score.sh.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from repaudit import builtin
from repaudit.engines import hf, hf_decode
from repaudit.engines.base import Sequence
from repaudit.run.kernelmodes import kernel_mode


def _batch(seed: int = 0, new: int = 6) -> list[Sequence]:
    g = np.random.default_rng(seed)
    # Uneven prompts (left padding) and uneven limits (rows finish at different steps).
    return [Sequence(f"p{i}", tuple(g.integers(3, 300, n).tolist()), None, new - (i % 3))
            for i, n in enumerate([9, 3, 5, 1, 7])]


def _bits_equal(a, b) -> bool:
    return (np.array_equal(a.token_id, b.token_id) and np.array_equal(a.pos, b.pos)
            and np.array_equal(a.logprob.view(np.uint32), b.logprob.view(np.uint32))
            and np.array_equal(a.digest, b.digest) and np.array_equal(a.top1, b.top1)
            and np.array_equal(a.topk_ids, b.topk_ids)
            and np.array_equal(a.topk_logprobs.view(np.uint32), b.topk_logprobs.view(np.uint32)))


def _generate(hfm, decode: str, batch, mode: str, fused: bool = True):
    hfm.decode = decode
    with kernel_mode(hfm, mode, fused):
        rows, _ = hf.generate(hfm, batch, topk=3)
    return rows


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    path = builtin.ensure(f"builtin:{request.param}")
    return hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)


@pytest.mark.parametrize("mode", ["bi", "tbik"])
def test_static_cache_records_are_the_dynamic_caches_bit_for_bit(tiny, mode):
    batch = _batch()
    dynamic = _generate(tiny, "dynamic", batch, mode)
    static = _generate(tiny, "static", batch, mode)
    assert [len(r.pos) for r in static] == [s.max_new_tokens for s in batch]
    for d, s in zip(dynamic, static):
        assert _bits_equal(d, s), f"{mode}: {s.prompt_id} differs between the static and the dynamic cache"


def test_stock_static_cache_moves_bits_that_tbik_keeps(tiny):
    """Why the modes differ above: stock SDPA sums over every slot of the static cache (masked),
    so its bits are not the dynamic cache's; the test would pass vacuously if they were."""
    batch = _batch()
    dynamic = _generate(tiny, "dynamic", batch, "stock")
    static = _generate(tiny, "static", batch, "stock")
    assert not all(_bits_equal(d, s) for d, s in zip(dynamic, static))


def _assert_generate_with_a_static_cache(hfm, decode: str) -> None:
    new = 6
    batch = [Sequence(s.prompt_id, s.prompt, None, new) for s in _batch(seed=4)]
    rows = _generate(hfm, decode, batch, "stock")
    T = max(len(s.prompt) for s in batch)
    ids = torch.zeros((len(batch), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(batch):
        ids[b, T - len(s.prompt):] = torch.tensor(s.prompt)
        mask[b, T - len(s.prompt):] = 1
    # disable_compile: on CUDA, generate torch.compiles the static-cache step by default, whose
    # fused kernels compute other bits than the model's own forward (docs/engine.md).
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              eos_token_id=None, cache_implementation="static", disable_compile=True)
    with torch.inference_mode():
        out = hfm.model.generate(input_ids=ids.to(hfm.device), attention_mask=mask.to(hfm.device),
                                 generation_config=config, output_logits=True, return_dict_in_generate=True)
    for b, r in enumerate(rows):
        logits = torch.stack([step[b] for step in out.logits]).float()
        want = torch.log_softmax(logits, -1)[torch.arange(new), out.sequences[b, T:]]
        assert np.array_equal(r.token_id, out.sequences[b, T:].cpu().numpy())
        assert np.array_equal(r.logprob.view(np.uint32), want.cpu().numpy().view(np.uint32)), r.prompt_id


def test_stock_static_records_are_generate_with_a_static_cache_bit_for_bit(tiny):
    """What docs/engine.md promises: a stock static-cache record is
    model.generate(cache_implementation="static", disable_compile=True)'s, whose cache has
    max_length - 1 slots. SDPA
    sums over every slot, so a cache one slot longer (the engine's before) moved bits."""
    _assert_generate_with_a_static_cache(tiny, "static")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stock_graph_records_are_generate_with_a_static_cache_on_a_gpu():
    """The same on a GPU, bf16, from the CUDA-graph decode (CUDA's default)."""
    path = builtin.ensure("builtin:qwen3-0.6b")
    hfm = hf.load(str(path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=0)
    _assert_generate_with_a_static_cache(hfm, "graphs")


def _counting_repeats(monkeypatch) -> list[int]:
    """Every call of transformers' repeat_kv from here on, by its n_rep."""
    from transformers.integrations import sdpa_attention

    calls, repeat = [], sdpa_attention.repeat_kv

    def counting(x, n_rep):
        calls.append(n_rep)
        return repeat(x, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    return calls


def test_stock_sdpa_reads_the_grouped_heads_in_place_bit_for_bit(monkeypatch):
    """Stock SDPA under a static cache's mask reads each layer's key/value heads in place
    (run/stock_attention.py) where transformers repeats the whole cache to the query heads every
    step: the records are transformers' own (fused=False), bit for bit, and no repeat runs."""
    tiny = hf.load(str(builtin.ensure("builtin:tiny-qwen3")), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    assert tiny.model.config.num_attention_heads > tiny.model.config.num_key_value_heads  # GQA: a copy to leave out
    batch = _batch()
    calls = _counting_repeats(monkeypatch)
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def watching(*args, **kwargs):
        seen.append((kwargs.get("enable_gqa", False), kwargs["attn_mask"].dtype))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watching)
    in_place = _generate(tiny, "static", batch, "stock")
    assert not [n for n in calls if n > 1]
    # The mask goes as transformers passes it (boolean): SDPA's own conversion of it depends on
    # the backend and torch's version, and shows in fully masked rows.
    assert seen and set(seen) == {(True, torch.bool)}
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    plain = _generate(tiny, "static", batch, "stock", fused=False)
    assert [n for n in calls if n > 1]  # transformers' own path repeats: the comparison is not vacuous
    for a, b in zip(in_place, plain):
        assert _bits_equal(a, b), f"{a.prompt_id}: reading the heads in place moved bits"
    assert tiny.model.config._attn_implementation == "sdpa"  # the mode's attention is put back


def test_stock_sdpa_repeats_the_heads_where_torch_would_pick_another_backend(monkeypatch):
    """Where torch's SDPA would choose a different backend for the grouped heads than for repeated
    ones (on some GPUs the grouped path under a mask is the math kernel), the attention is
    transformers' own, repeat included: other kernels would give other bits."""
    from repaudit.run import stock_attention

    tiny = hf.load(str(builtin.ensure("builtin:tiny-qwen3")), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    batch = _batch()
    want = _generate(tiny, "static", batch, "stock", fused=False)
    choose = torch._fused_sdp_choice
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: choose(*a, **k) + (10 if k.get("enable_gqa") else 0))
    monkeypatch.setattr(stock_attention, "_SAME_BACKEND", {})
    calls = _counting_repeats(monkeypatch)
    got = _generate(tiny, "static", batch, "stock")
    assert [n for n in calls if n > 1]
    for a, b in zip(got, want):
        assert _bits_equal(a, b)


def test_load_picks_the_dynamic_cache_on_cpu(tiny):
    fresh = hf.load(str(tiny.model.name_or_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    assert fresh.decode == "dynamic"
    assert hf_decode.static_supported(fresh.model)


@pytest.mark.parametrize("window, supported", [(4096, False), (None, True)])
def test_a_sliding_window_keeps_the_dynamic_cache(window, supported):
    """The static path builds the plain causal mask: Mistral's default 4096-token window would
    be dropped for longer sequences, so such a model must not take it."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, sliding_window=window)
    cfg._attn_implementation = "sdpa"
    assert hf_decode.static_supported(MistralForCausalLM(cfg)) is supported


def test_unknown_decode_is_refused(tiny):
    tiny.decode = "paged"
    try:
        with pytest.raises(ValueError, match="unknown decode 'paged'"):
            hf.generate(tiny, _batch(), topk=0)
    finally:
        tiny.decode = "dynamic"


def test_graphs_fall_back_to_eager_static_steps_off_cuda(tiny):
    """decode="graphs" on the CPU (or under a tracer) runs the static cache's eager steps: the
    same records, bit for bit."""
    batch = _batch(seed=3)
    static = _generate(tiny, "static", batch, "tbik")
    graphs = _generate(tiny, "graphs", batch, "tbik")
    assert all(_bits_equal(a, b) for a, b in zip(static, graphs))


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_rows_end_at_their_first_stop_id_with_the_bits_of_a_run_without_one(tiny, decode):
    """generate() decides on the device which rows are done and looks only every few steps
    whether all are: a row ends at the first of its stop ids (recorded; two of them here, as a
    chat model's generation config lists), and every recorded value is the one a run without
    stop ids computes at that step (tbik: rows do not depend on each other)."""
    batch = _batch(seed=5, new=20)
    full = _generate(tiny, decode, batch, "tbik")
    stops = (int(full[0].token_id[3]), int(full[1].token_id[2]))
    tiny.stop_ids = stops
    try:
        tiny.decode = decode
        with kernel_mode(tiny, "tbik"):
            ended, timing = hf.generate(tiny, batch, topk=3)
    finally:
        tiny.stop_ids = ()
    for f, e in zip(full, ended):
        hits = np.flatnonzero(np.isin(f.token_id, stops))
        n = int(hits[0]) + 1 if len(hits) else len(f.pos)
        assert len(e.pos) == n, f"{f.prompt_id}: {len(e.pos)} rows, its first EOS is row {n}"
        cut = {k: getattr(f, k)[:n] for k in ("pos", "token_id", "logprob", "top1", "topk_ids", "topk_logprobs", "digest")}
        assert _bits_equal(type(f)(prompt_id=f.prompt_id, prompt_len=f.prompt_len, **cut), e)
    assert len(ended[0].pos) <= 4 and len(ended[1].pos) <= 3
    assert timing.decode_tokens == sum(len(e.pos) for e in ended) - len(batch)
    assert timing.generated_tokens == sum(len(e.pos) for e in ended)



def _moe_prompts() -> list[tuple[int, ...]]:
    g = np.random.default_rng(0)
    return [tuple(g.integers(3, 512, n).tolist()) for n in [9, 3, 5, 12, 7]]


def _left_padded(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of the prompts left-padded with 0, as generate() takes them."""
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    return ids, mask


def _assert_rows_are_generates(rows, out, T: int) -> None:
    """Each row's tokens and logprob bits are generate()'s (`out`, prompts padded to T), cut
    where the row ends."""
    for b, r in enumerate(rows):
        n = len(r.pos)
        tokens = out.sequences[b, T:T + n]
        lp = torch.log_softmax(torch.stack([step[b] for step in out.logits[:n]]).float(), -1)
        assert np.array_equal(r.token_id, tokens.numpy()), r.prompt_id
        assert np.array_equal(r.logprob.view(np.uint32), lp[torch.arange(n), tokens].numpy().view(np.uint32)), r.prompt_id


def _save_tiny_moe(model_type: str, path) -> None:
    """A two-layer mixture of experts of `model_type`, random weights (seed 7), pad id 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               initializer_range=0.1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)


@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe"])
def test_finished_rows_feed_what_generate_feeds_them(model_type, tmp_path):
    """The records of a batch whose rows end at different steps (a stop id, their own token
    limits) are model.generate()'s over the batch with its largest limit, each row cut where it
    ends. A finished row's own rows are not recorded, but in a mixture of experts the tokens it
    feeds share the experts' GEMMs with the other rows: feeding a pad in place of a stop id, or
    pads past a row's own limit (as the engine did), moved the other rows' logprobs."""
    _save_tiny_moe(model_type, tmp_path)
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    prompts, new = _moe_prompts(), 6
    free, _ = hf.generate(hfm, [Sequence(f"p{i}", p, None, new) for i, p in enumerate(prompts)], topk=0)
    hfm.stop_ids = (int(free[0].token_id[1]),)  # the first row ends at its second token
    limits = [new, 2, new, 4, new]

    ids, mask = _left_padded(prompts)
    T = ids.shape[1]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=list(hfm.stop_ids))
    with torch.inference_mode():
        out = hfm.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True,
                                 return_dict_in_generate=True)
    for cut in (False, True):  # rows that end at a stop id; and some at their own limits too
        batch = [Sequence(f"p{i}", p, None, limits[i] if cut else new) for i, p in enumerate(prompts)]
        rows, _ = hf.generate(hfm, batch, topk=0)
        assert [len(r.pos) for r in rows] == ([2, 2, 6, 4, 6] if cut else [2, 6, 6, 6, 6])
        _assert_rows_are_generates(rows, out, T)

@pytest.mark.parametrize("pad", [5, None])
def test_a_finished_row_feeds_the_generation_configs_pad_as_generate_does(pad, tmp_path):
    """generate() feeds an ended row its generation config's pad_token_id, else the first of its
    eos_token_id, not the tokenizer's pad the prompts are padded with. In a mixture of experts
    that token shares the experts' GEMMs with the other rows: fed the prompts' pad (0) instead,
    the other rows' logprobs moved off generate()'s."""
    import json

    _save_tiny_moe("olmoe", tmp_path)
    prompts, new = _moe_prompts(), 6
    batch = [Sequence(f"p{i}", p, None, new) for i, p in enumerate(prompts)]
    free, _ = hf.generate(hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0), batch, topk=0)
    stop = int(free[0].token_id[1])  # the first row ends at its second token
    # The model's own generation config: the stop id (and another), and `pad` or none.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 11], "pad_token_id": pad}))
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(stop, 11), pad_id=0)
    assert hfm.finished_feed_id == (pad if pad is not None else stop)

    ids, mask = _left_padded(prompts)
    T = ids.shape[1]
    with torch.inference_mode():  # generate() with the model's generation config, as a user calls it
        out = hfm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    rows, _ = hf.generate(hfm, batch, topk=0)
    assert [len(r.pos) for r in rows][0] == 2 and max(len(r.pos) for r in rows) == new
    _assert_rows_are_generates(rows, out, T)


def test_a_generate_cell_that_stops_after_its_first_token_has_a_rate(tiny):
    """Every sequence ends on the token the prefill made: nothing decoded, but the cell generated
    tokens, and its tokens/s counts them over the prefill (it used to say 0 tok/s)."""
    from repaudit.compare.summary import tokens_per_s

    batch = [Sequence(s.prompt_id, s.prompt, None, 1) for s in _batch(seed=6, new=1)]
    rows, timing = hf.generate(tiny, batch, topk=0)
    assert [len(r.pos) for r in rows] == [1] * len(batch)
    t = timing.as_dict()
    assert t["decode_tokens"] == 0 and t["generated_tokens"] == len(batch)
    assert tokens_per_s(t, "generate") == len(batch) / (timing.prefill_s + timing.decode_s) > 0


@pytest.mark.parametrize("mode, attn", [("stock", "sdpa"), ("stock", "eager"), ("tbik", None)])
def test_advanced_masks_are_the_mask_functions_answers_bit_for_bit(tiny, mode, attn):
    """generate() makes each decode step's mask after the first with advance_mask, on the device;
    at every step it must be exactly what the model's own mask function (static_mask) answers
    for that step, in every form a mask function gives: sdpa's boolean 4-D, eager's additive
    4-D, the 2-D padding mask tbik's attention takes."""
    batch = _batch(new=7)
    B, T = len(batch), max(len(s.prompt) for s in batch)
    width = T + 7
    ids = torch.zeros((B, T), dtype=torch.long)
    mask2d = torch.zeros((B, width), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, T - len(s.prompt):] = torch.tensor(s.prompt)
        mask2d[b, T - len(s.prompt):T] = 1
    positions = (mask2d[:, :T].cumsum(-1) - 1).clamp(min=0)
    before = tiny.model.config._attn_implementation
    try:
        if attn:
            tiny.model.set_attn_implementation(attn)
        with kernel_mode(tiny, mode), torch.inference_mode():
            cache = hf_decode.new_cache(tiny.model, width)
            forward = lambda x, m, p: tiny.model.base_model(input_ids=x, attention_mask=m, position_ids=p,  # noqa: E731
                                                            past_key_values=cache, use_cache=True)
            forward(ids, hf_decode.static_mask(tiny.model, mask2d, cache, T), positions)
            advanced = None
            forms = set()
            for slot in range(T, width - 1):
                mask2d[:, slot] = 1
                own = hf_decode.static_mask(tiny.model, mask2d, cache, 1)
                advanced = own if advanced is None else hf_decode.advance_mask(advanced, slot)
                forms.add((own.dtype, own.shape[-2]))
                assert advanced.dtype == own.dtype and advanced.shape == own.shape
                assert torch.equal(advanced, own), f"slot {slot}: the advanced mask is not the mask function's"
                positions = positions[:, -1:] + 1
                forward(torch.full((B, 1), 5), advanced, positions)
    finally:
        tiny.model.set_attn_implementation(before)
    assert len(forms) == 1 and slot == width - 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["stock", "bi", "tbik"])
def test_graph_replays_are_the_eager_static_steps_bit_for_bit(mode):
    path = builtin.ensure("builtin:qwen3-0.6b")
    hfm = hf.load(str(path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=0)
    assert hfm.decode == "graphs"
    batch = _batch(new=12)
    eager = _generate(hfm, "static", batch, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused capture falls back to eager steps with a warning
        graphs = _generate(hfm, "graphs", batch, mode)
    for a, b in zip(eager, graphs):
        assert _bits_equal(a, b), f"{mode}: {a.prompt_id} differs between graph replays and eager steps"
    if mode != "stock":
        dynamic = _generate(hfm, "dynamic", batch, mode)
        assert all(_bits_equal(a, b) for a, b in zip(dynamic, graphs)), f"{mode}: graphs differ from the dynamic cache"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["stock", "tbik"])
def test_traced_graph_replays_are_the_eager_static_steps_trace_bit_for_bit(mode):
    """--trace on a GPU: the step captured with the tracer's digests (held and launched together)
    gives the records and the trace of eager static steps, bit for bit, without falling back to
    eager steps. Stock too: its step's allocations differ, and a digest table allocated inside
    the capture was once overwritten there by the step's own kernels at every replay."""
    from repaudit.run.trace import Tracer

    path = builtin.ensure("builtin:qwen3-0.6b")
    hfm = hf.load(str(path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=0)
    out = {}
    for decode in ("static", "graphs"):
        hfm.tracer = Tracer(hfm.model, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rows = _generate(hfm, decode, _batch(new=12), mode)
        hfm.tracer.detach()
        out[decode] = rows, hfm.tracer.finish()[0]
        hfm.tracer = None
    (eager_rows, eager_trace), (graph_rows, graph_trace) = out["static"], out["graphs"]
    assert all(_bits_equal(a, b) for a, b in zip(eager_rows, graph_rows))
    assert graph_trace.num_rows == eager_trace.num_rows > 0 and graph_trace.equals(eager_trace)


def test_a_refused_capture_leaves_the_cache_where_it_was_and_steps_eagerly(monkeypatch):
    """When the capture raises (a host sync inside the step), the warm-up's advance of the cache
    is undone and the step runs eagerly: the cache ends one step further, not two, and every
    later step is eager too. CUDA is faked; the replay path itself is the GPU test's."""
    import contextlib
    from types import SimpleNamespace

    class Refused:
        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

        def __exit__(self, *exc):
            return False

    fake = SimpleNamespace(Stream=lambda: SimpleNamespace(wait_stream=lambda s: None),
                           current_stream=lambda: SimpleNamespace(wait_stream=lambda s: None),
                           stream=lambda s: contextlib.nullcontext(), CUDAGraph=object, graph=lambda g, **kw: Refused(),
                           synchronize=lambda: None)
    monkeypatch.setattr(hf_decode.torch, "cuda", fake)
    cache = SimpleNamespace(layers=[SimpleNamespace(cumulative_length=torch.tensor(5)) for _ in range(2)])
    calls = []

    def forward(ids, mask, positions):
        calls.append(ids.clone())
        for layer in cache.layers:
            layer.cumulative_length.add_(1)
        return {"twice": ids * 2}

    step = hf_decode.GraphedStep(forward, cache)
    out = step(torch.tensor([[3]]), torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.tensor([[5]]))
    assert out["twice"].tolist() == [[6]]
    assert step.failed == "operation not permitted when stream is capturing"
    assert [int(layer.cumulative_length) for layer in cache.layers] == [6, 6]  # warm-up undone, one real step
    step(torch.tensor([[4]]), torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.tensor([[6]]))
    assert len(calls) == 3 and step.graph is None  # warm-up, the eager step, then eager again


def test_traced_graph_replays_give_the_eager_steps_trace(tiny, monkeypatch):
    """Under --trace the decode step is captured with the tracer's hooks, and each replay hands
    the tracer copies of what they computed. With a stand-in graph whose replay recomputes the
    step into the captured tensors in place (what a CUDA graph replay does), the trace and the
    records are the eager static steps', bit for bit, with rows finishing at different steps
    (the warm-up's and the capture's own calls are dropped, each step's dead rows settled)."""
    import contextlib
    from types import SimpleNamespace

    from repaudit.run.trace import Tracer

    made = []
    real_step = hf_decode.GraphedStep
    monkeypatch.setattr(hf_decode, "GraphedStep", lambda *a, **k: made.append(real_step(*a, **k)) or made[-1])

    class Graph:
        def replay(self):
            step = made[-1]
            mark = step.tracer.mark()
            new = step.forward(*step.inputs)
            now = step.tracer.pack(step.tracer.take_since(mark))
            assert now.layout.calls == step.traced.layout.calls
            for name in ("digests", "samples", "experts"):
                if getattr(now, name) is not None:
                    getattr(step.traced, name).copy_(getattr(now, name))
            for k, v in new.items():
                step.outputs[k].copy_(v)

    def traced(decode: str):
        tiny.tracer = Tracer(tiny.model, 1)
        try:
            rows = _generate(tiny, decode, _batch(new=7), "tbik")
            tiny.tracer.detach()
            return rows, tiny.tracer.finish()[0]
        finally:
            tiny.tracer = None

    @contextlib.contextmanager
    def capture(graph, **kwargs):  # a capture runs nothing: the cache stays where it was
        lengths = hf_decode._cache_lengths(made[-1].cache)
        yield
        hf_decode._set_cache_lengths(made[-1].cache, lengths)

    eager_rows, eager_trace = traced("static")
    fake = SimpleNamespace(Stream=lambda: SimpleNamespace(wait_stream=lambda s: None), is_available=lambda: False,
                           current_stream=lambda: SimpleNamespace(wait_stream=lambda s: None),
                           stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
                           graph=capture, synchronize=lambda: None)
    monkeypatch.setattr(hf_decode.torch, "cuda", fake)
    monkeypatch.setattr(hf_decode, "graphs_available", lambda device: True)
    graph_rows, graph_trace = traced("graphs")
    assert len(made) == 1 and made[0].graph is not None and made[0].traced  # captured, and replayed
    assert all(_bits_equal(a, b) for a, b in zip(eager_rows, graph_rows))
    assert graph_trace.num_rows == eager_trace.num_rows > 0 and graph_trace.equals(eager_trace)


def _fused_norms_against_eager(hfm, monkeypatch, batch) -> None:
    import tbik

    from repaudit.run import kernelmodes

    fused = kernelmodes._fused_norms(hfm.model)
    layers = hfm.model.config.num_hidden_layers
    assert len(fused) >= 2 * layers + 1, "the decoder's RMSNorms were not recognised as Llama's"
    assert len(kernelmodes._stock_norms(hfm.model)) == len(fused)
    assert len(kernelmodes._rope_modules(hfm.model)) == 1, "the rotary embedding was not recognised as Llama's"
    for mode in ("stock", "bi", "tbik"):
        squares = []
        with monkeypatch.context() as m:
            m.setattr(tbik, "float_squares", lambda x, f=tbik.float_squares: squares.append(1) or f(x))
            with_fused = _generate(hfm, "static", batch, mode)
        assert bool(squares) == (mode == "stock"), "only the stock norms take torch's mean of tbik's squares"
        fused_calls = []
        with monkeypatch.context() as m:
            for name in ("rms_norm", "float_squares", "apply_rope"):
                m.setattr(tbik, name,
                          lambda *a, _n=name, _f=getattr(tbik, name), **k: fused_calls.append(_n) or _f(*a, **k))
            eager = _generate(hfm, "static", batch, mode, fused=False)
        assert fused_calls == [], f"{mode}: fused=False still ran {sorted(set(fused_calls))}"
        for a, b in zip(with_fused, eager):
            assert _bits_equal(a, b), f"{mode}: {a.prompt_id} differs between the fused ops and the eager ones"


def test_fused_norms_give_the_eager_norms_records(tiny, monkeypatch):
    """Every mode runs Llama-form RMSNorms and Llama's apply_rotary_pos_emb fused (bi and tbik:
    tbik.rms_norm, one kernel; stock: tbik's squares, torch's own mean, tbik's scaling; all:
    tbik.apply_rope): the records are those of transformers' own code under the mode's
    overrides, bit for bit."""
    _fused_norms_against_eager(tiny, monkeypatch, _batch())


def test_float64_norms_and_rotary_run_transformers_own_ops(monkeypatch):
    """tbik's element-wise kernels compute in fp32, so a float64 layer (a model cast by its user;
    the engine loads the three kernel dtypes) keeps transformers' own norm and rotary, whose
    products stay in float64, in every mode."""
    import tbik

    from repaudit.run import kernelmodes

    path = builtin.ensure("builtin:tiny-qwen3")
    hfm = hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    hfm.model.double()
    calls = []
    for name in ("rms_norm", "float_squares", "apply_rope"):
        monkeypatch.setattr(tbik, name, lambda *a, _n=name, **k: calls.append(_n))
    for mode in ("stock", "bi", "tbik"):
        rows = _generate(hfm, "static", _batch(new=3), mode)
        assert all(np.isfinite(r.logprob).all() for r in rows)
    assert calls == []
    x, cos = torch.zeros(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 3, 4, dtype=torch.float64)
    assert not kernelmodes._rope_fits(x, cos, cos) and kernelmodes._rope_fits(x.float(), cos.float(), cos.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_norms_give_the_eager_norms_records_on_a_gpu(monkeypatch):
    path = builtin.ensure("builtin:qwen3-0.6b")
    hfm = hf.load(str(path), dtype="bfloat16", device="cuda", tp=1, stop_ids=(), pad_id=0)
    _fused_norms_against_eager(hfm, monkeypatch, _batch(new=12))


def test_key_bounds_are_made_once_per_forward(tiny):
    """tbik attention's key bounds come from the first layer's mask and are reused by the
    others, until the next forward of the base model begins: a graph's capture reuses the
    warm-up's mask tensor with new contents and must compute its own."""
    from repaudit.run import kernelmodes

    query = torch.zeros(2, 4, 1, 8)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 1:4] = True
    mask[1, ..., 0:4] = True
    with kernelmodes._bounds_per_forward(tiny.model):
        start, end = kernelmodes._key_bounds(mask, query)
        assert start.tolist() == [1, 0] and end.tolist() == [4, 4]
        mask[..., 4] = True  # the same tensor, new contents, within the same forward
        assert kernelmodes._key_bounds(mask, query)[1] is end
        tiny.model.base_model(input_ids=torch.ones(1, 2, dtype=torch.long))  # the next forward begins
        assert kernelmodes._key_bounds(mask, query)[1].tolist() == [5, 5]
    assert not kernelmodes._BOUNDS



def test_stock_mode_moves_only_the_sdpa_parts_of_a_model_to_its_attention():
    """A part of the model on another attention (eager here) keeps it in the stock mode: the
    in-place SDPA keeps SDPA's bits, not eager's."""
    from repaudit.run import stock_attention

    tiny = hf.load(str(builtin.ensure("builtin:tiny-qwen3")), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    attn = tiny.model.model.layers[0].self_attn
    assert tiny.model.config._attn_implementation == "sdpa"
    with kernel_mode(tiny, "stock"):
        assert attn.config._attn_implementation == stock_attention.STOCK_ATTENTION
    assert attn.config._attn_implementation == "sdpa"
    tiny.model.config._attn_implementation = "eager"
    try:
        with kernel_mode(tiny, "stock"):
            assert attn.config._attn_implementation == "eager"
    finally:
        tiny.model.config._attn_implementation = "sdpa"
