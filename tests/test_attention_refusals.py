"""bi and tbik run transformers' attention through tbik's kernel, which computes causal
attention over the whole sequence and nothing else. A model whose attention is anything more
is refused by name (from its config before a run, or when a layer passes an argument the
kernel does not implement), never run as another model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from repaudit.run.kernelmodes import UnsupportedLayer, _attention
from repaudit.run.plan import attention_refusal


@pytest.mark.parametrize("config, refusal", [
    (dict(sliding_window=4096), "sliding-window attention"),  # Mistral: one window for every layer
    (dict(sliding_window=4096, use_sliding_window=False), None),  # Qwen2 as shipped
    (dict(sliding_window=4096, layer_types=["full_attention"] * 4), None),  # dots1: a window no layer uses
    (dict(sliding_window=512, layer_types=["sliding_attention", "full_attention"]), "attention layers of type sliding_attention"),
    (dict(layer_types=["linear_attention", "full_attention"]), None),  # Qwen3-Next's hybrid
    (dict(layer_types=["minimax_m3_sparse", "full_attention"]), "attention layers of type minimax_m3_sparse"),
    (dict(layer_types=["linear_attention", "qwen_sparse_attention"]), "attention layers of type qwen_sparse_attention"),
    (dict(attention_chunk_size=8192), "chunked attention (chunks of 8192 tokens)"),  # Llama 4
    (dict(index_topk=2048), "indexer-selected sparse attention (DSA)"),  # DeepSeek-V3.2, GLM-MoE-DSA
    (dict(keep_window_size=2048), "dynamic-mask attention"),  # Doge
    (dict(), None),
])
def test_attention_the_kernel_does_not_compute_is_refused_from_the_config(config, refusal):
    assert attention_refusal(SimpleNamespace(**config)) == refusal


@pytest.mark.parametrize("arg, value, what", [
    ("softcap", 50.0, "attention logit soft-capping"),  # Gemma 2
    ("s_aux", torch.zeros(2), "attention sinks"),  # gpt-oss style sinks
    ("block_indices", torch.zeros(1, dtype=torch.long), "block-sparse attention"),
    ("indices", torch.zeros(1, dtype=torch.long), "indexer-selected sparse attention"),
    ("position_bias", torch.zeros(1), "an attention position bias"),
    ("sliding_window", 4, "sliding-window attention"),
    ("is_causal", False, "bidirectional attention"),
])
def test_a_layer_passing_what_the_kernel_does_not_implement_is_refused(arg, value, what):
    q = k = v = torch.zeros(1, 2, 3, 8)
    with pytest.raises(UnsupportedLayer, match=what):
        _attention(torch.nn.Identity(), q, k, v, None, **{arg: value})


def test_the_arguments_every_causal_model_passes_are_accepted():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    out, _ = _attention(torch.nn.Identity(), q, k, v, None, scaling=8 ** -0.5, dropout=0.0, sliding_window=None,
                        softcap=None, is_causal=True, position_ids=torch.arange(3)[None])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.shape == (1, 3, 2, 8) and torch.allclose(out, want, atol=1e-5)
