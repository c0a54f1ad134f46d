"""The stock mode's attention: transformers' SDPA path without the copy it makes per layer.

Where transformers' sdpa_attention_forward passes a mask (a static cache's always, a padded
batch's prefill too), it first repeats a grouped-query layer's keys and values to the query
heads (repeat_kv: over a static cache, a copy of the whole cache, every layer and every step),
because it assumes SDPA's grouped-query path falls back to the math kernel under a mask.

Here SDPA reads the key/value heads in place (enable_gqa) wherever torch picks the same backend
for that as for repeated heads: each query head is then computed from the same values by the
same kernel (benchmarks/sdpa_gqa_probe.py: cuDNN, bit for bit; tests: the CPU kernels). The
mask goes to SDPA as transformers passes it: SDPA turns a boolean mask into an additive one with
a fill value that depends on the backend and on torch's version (cuDNN's has been -65504, not
-inf), which a fully masked row (a left-padded prefill's padding queries) would show. Everything
else (no mask, a position bias, output_attentions, a DTensor, another device, a backend that
differs) runs transformers' own function. The records stay model.generate's
(tests/test_hf_decode.py, on the CPU and on a GPU).
"""

from __future__ import annotations

import torch

STOCK_ATTENTION = "repaudit_stock_sdpa"

# Whether torch picks one backend for the grouped and the repeated heads, per call signature.
_SAME_BACKEND: dict[tuple, bool] = {}


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              position_bias=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or position_bias is not None or kwargs.get("output_attentions", False) \
            or not _plain(query, key, value, attention_mask) \
            or not _same_backend(query, key, value, attention_mask, dropout, scaling, groups):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _plain(*tensors: torch.Tensor) -> bool:
    return all(type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") for t in tensors)


def _same_backend(query, key, value, mask, dropout, scaling, groups: int) -> bool:
    """Whether torch's SDPA picks the same backend for these key/value heads read in place as for
    them repeated to the query heads (repeat_kv's output: new contiguous tensors)."""
    flags = tuple(f() for f in (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                                torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.math_sdp_enabled))
    sig = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in (query, key, value, mask)) \
        + (dropout, scaling, groups, flags)
    same = _SAME_BACKEND.get(sig)
    if same is None:
        choose = getattr(torch, "_fused_sdp_choice", None)
        same = False
        if choose is not None and key.shape[-1] == value.shape[-1]:
            repeated = [torch.empty((t.shape[0], t.shape[1] * groups, *t.shape[2:]), dtype=t.dtype, device=t.device)
                        for t in (key, value)]
            try:
                same = choose(query, key, value, mask, dropout, False, scale=scaling, enable_gqa=True) \
                    == choose(query, *repeated, mask, dropout, False, scale=scaling)
            except (RuntimeError, TypeError):  # a torch whose private choice takes other arguments
                same = False
        _SAME_BACKEND[sig] = same
    return same


def register() -> None:
    """The attention under STOCK_ATTENTION, with SDPA's mask function (so the same masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(STOCK_ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(STOCK_ATTENTION, sdpa_mask)
