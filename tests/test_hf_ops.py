"""The vLLM plugin's ops (repaudit.engines.hf_ops) give the transformers engine's tbik bits.

vLLM is not needed: a small forward written the way vLLM lays a batch out (flat tokens, fused
qkv and gate/up weights, a paged KV cache with a shuffled block table, chunked prefill next to
decode steps, requests of different lengths in one step) runs the built-in Qwen3 and Llama
through hf_ops, and every logprob must have the bits of the transformers engine's tbik score of
the same sequences. On the GPU the plugin calls these same functions inside vLLM.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

BLOCK = 4  # small, so sequences straddle blocks and tbik's 64-key attention blocks span several


def _load(model: str, device: str):
    from repaudit import builtin
    from repaudit.engines import hf

    return hf.load(str(builtin.ensure(model)), dtype="bfloat16", device=device, tp=1, stop_ids=(), pad_id=0)


def _weights(model) -> dict:
    cfg = model.config
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(dict(
            qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            o=a.o_proj.weight, gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down=m.down_proj.weight,
            ln_in=layer.input_layernorm.weight, ln_post=layer.post_attention_layernorm.weight,
            q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(layers=layers, embed=model.model.embed_tokens.weight, norm=model.model.norm.weight,
                lm_head=model.lm_head.weight, eps=cfg.rms_norm_eps, hq=cfg.num_attention_heads,
                hkv=cfg.num_key_value_heads, d=head_dim, theta=cfg.rope_parameters["rope_theta"])


class _Cache:
    """One paged K and V cache per layer, blocks handed out in a shuffled order."""

    def __init__(self, w: dict, n_blocks: int, seed: int):
        shape = (n_blocks, BLOCK, w["hkv"], w["d"])
        device = w["embed"].device
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in w["layers"]]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in w["layers"]]
        self.free = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}

    def slots(self, req: str, positions: range) -> torch.Tensor:
        table = self.tables.setdefault(req, [])
        while len(table) * BLOCK < positions.stop:
            table.append(self.free.pop())
        return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in positions], device=self.k[0].device)

    def table(self, reqs: list[str]) -> torch.Tensor:
        width = max(len(self.tables[r]) for r in reqs) + 1
        return torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in reqs], dtype=torch.int32,
                            device=self.k[0].device)


def _row_parallel(x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The plugin's o_proj / down_proj at TP=tp, its ranks in turn: each rank's fp32 root of its K
    shard, the roots summed in the tree's order (vLLM's all-reduce at TP=2), handed on as fp32,
    the cast left to the add-norm after it (vllm_plugin._fold_casts_into_norms)."""
    import tbik

    from repaudit.engines import hf_ops

    if tp == 1:
        return hf_ops.linear(x, weight)
    k = x.shape[-1] // tp
    return tbik.tree_sum(torch.stack([
        tbik.matmul_partial(x[:, r * k:(r + 1) * k].contiguous(), weight[:, r * k:(r + 1) * k].t(), tp_size=tp)
        for r in range(tp)]))


def _step(w: dict, cache: _Cache, batch: list[tuple[str, list[int], int]], tp: int = 1) -> torch.Tensor:
    """One vLLM forward: `batch` is (request, its new tokens, position of the first); returns the
    logprobs of every new token's next-token distribution, [tokens, vocab]."""
    from repaudit.engines import hf_ops

    dev = w["embed"].device
    ids = torch.tensor([t for _, toks, _ in batch for t in toks], device=dev)
    positions = torch.cat([torch.arange(p, p + len(toks)) for _, toks, p in batch]).to(dev)
    lens = torch.tensor([len(toks) for _, toks, _ in batch])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).to(dev)
    seq_lens = torch.tensor([p + len(toks) for _, toks, p in batch], dtype=torch.int32, device=dev)
    slots = torch.cat([cache.slots(r, range(p, p + len(toks))) for r, toks, p in batch])
    table = cache.table([r for r, _, _ in batch])
    n, hq, hkv, d, eps = len(ids), w["hq"], w["hkv"], w["d"], w["eps"]
    inv = hf_ops.inv_freq(w["theta"], d)

    hidden, residual = torch.nn.functional.embedding(ids, w["embed"]), None
    for i, lw in enumerate(w["layers"]):
        if residual is None:
            residual, h = hidden, hf_ops.rms_norm(hidden, lw["ln_in"], eps)
        else:
            h, residual = hf_ops.add_rms_norm(hidden, residual, lw["ln_in"], eps)
        q, k, v = hf_ops.linear(h, lw["qkv"]).split([hq * d, hkv * d, hkv * d], dim=-1)
        if lw["q_norm"] is not None:  # Qwen3: the plugin's fused q/k norms and rotary
            q, k = hf_ops.qk_norm_rope(positions, q, k, lw["q_norm"].weight, lw["k_norm"].weight, eps, inv, d)
        else:
            q, k = hf_ops.rope(positions, q, k, inv, d)
        cache.k[i].flatten(0, 1)[slots] = k.reshape(n, hkv, d)
        cache.v[i].flatten(0, 1)[slots] = v.reshape(n, hkv, d)
        attn = hf_ops.paged_attention(q.reshape(n, hq, d), cache.k[i], cache.v[i], qsl, seq_lens, table,
                                      int(lens.max()), d ** -0.5)
        hidden = _row_parallel(attn.reshape(n, -1), lw["o"], tp)
        h, residual = hf_ops.add_rms_norm(hidden, residual, lw["ln_post"], eps)
        hidden = _row_parallel(hf_ops.silu_and_mul(hf_ops.linear(h, lw["gate_up"])), lw["down"], tp)
    h, _ = hf_ops.add_rms_norm(hidden, residual, w["norm"], eps)
    return hf_ops.log_probs(hf_ops.linear(h, w["lm_head"]))


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model,device", [
    ("builtin:tiny-qwen3", "cpu"), ("builtin:tiny-llama", "cpu"),
    pytest.param("builtin:tiny-qwen3", "cuda", marks=_GPU), pytest.param("builtin:tiny-llama", "cuda", marks=_GPU),
    pytest.param("builtin:qwen3-0.6b", "cuda", marks=_GPU)])
def test_vllm_shaped_forward_gives_the_transformers_tbik_bits(model, device, tp):
    """vLLM's schedule of chunked prefills and decode steps through the plugin's ops, at TP=1 and
    at TP=2 (row-parallel layers as their ranks compute them, the fp32 sum handed to the add-norm),
    gives every logprob of the transformers engine's tbik mode at TP=1."""
    import contextlib

    import tbik
    from repaudit.engines import hf
    from repaudit.engines.base import Sequence
    from repaudit.run.kernelmodes import kernel_mode

    hfm = _load(model, device)
    rng = np.random.default_rng(7)
    vocab = hfm.model.config.vocab_size
    seqs = {name: rng.integers(1, vocab, size=n).tolist() for name, n in (("a", 150), ("b", 37), ("c", 9))}
    with kernel_mode(hfm, "tbik"):
        rows, _ = hf.score(hfm, [Sequence(r, tuple(t), (), 0) for r, t in seqs.items()], topk=0)
    want = {r.prompt_id: r for r in rows}

    # vLLM's schedule: a's prompt in two chunks beside b's whole prompt, then c, then a's and
    # b's last tokens as decode steps (teacher-forced: the logprob of the known next token).
    w = _weights(hfm.model)
    cache = _Cache(w, n_blocks=80, seed=3)
    a, b, c = seqs["a"], seqs["b"], seqs["c"]
    plan = [[("a", a[:70], 0), ("b", b[:-2], 0)],
            [("a", a[70:-3], 70), ("c", c, 0)],
            [("b", b[-2:-1], len(b) - 2), ("a", a[-3:-2], len(a) - 3)],
            [("a", a[-2:], len(a) - 2), ("b", b[-1:], len(b) - 1)]]
    got: dict[str, dict[int, float]] = {r: {} for r in seqs}
    # On the CPU, tbik's silu (the engine's CPU kernel mode has it); on a GPU the plain ops, as in vLLM.
    cpu_mode = tbik.batch_invariant_mode("cpu", tbik.NUM_CHUNKS) if device == "cpu" else contextlib.nullcontext()
    with cpu_mode, torch.no_grad():
        for batch in plan:
            lp = _step(w, cache, batch, tp)
            row = 0
            for r, toks, first in batch:
                for j in range(len(toks)):
                    nxt = first + j + 1
                    if nxt < len(seqs[r]):
                        got[r][nxt] = float(lp[row, seqs[r][nxt]])
                    row += 1
    for r, rows_r in want.items():
        assert sorted(got[r]) == rows_r.pos.tolist()
        mine = np.asarray([got[r][p] for p in rows_r.pos.tolist()], dtype=np.float32)
        bad = np.flatnonzero(_bits(mine) != _bits(rows_r.logprob))
        assert bad.size == 0, f"{model} on {device}, {r}: {bad.size}/{len(mine)} logprobs differ, first at pos {rows_r.pos[bad[0]]}"


def test_vllm_fused_add_norm_would_move_bits():
    """The reason add_rms_norm rounds the sum first: normalising vLLM's fp32 sum gives other bits."""
    from repaudit.engines import hf_ops

    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(256, generator=g).to(torch.bfloat16)
    ours, _ = hf_ops.add_rms_norm(x, res, weight, 1e-6)
    total = x.float() + res.float()
    fused = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert not torch.equal(ours.view(torch.int16), fused.view(torch.int16))
