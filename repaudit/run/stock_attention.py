"""The stock mode's attention: transformers' SDPA path without two copies it makes per layer.

Where transformers' sdpa_attention_forward passes a mask (a static cache's always, a padded
batch's prefill too), two things cost more than they compute:
- a grouped-query layer's keys and values are first repeated to the query heads (repeat_kv:
  over a static cache, a copy of the whole cache, every layer and every step), because
  transformers assumes SDPA's grouped-query path falls back to the math kernel under a mask;
- SDPA turns the boolean mask into an additive one inside each call (three kernels a layer).

Here SDPA reads the key/value heads in place (enable_gqa) wherever torch picks the same backend
for that as for repeated heads: each query head is then computed from the same values by the
same kernel (benchmarks/sdpa_gqa_probe.py: cuDNN, bit for bit; tests: the CPU kernels). The
additive mask is made once per forward, with the values torch's conversion gives (0 and -inf in
the query's dtype). Everything else (no mask, a position bias, output_attentions, a DTensor,
another device, a backend that differs) runs transformers' own function. The records stay
model.generate's (tests/test_hf_decode.py, on the CPU and on a GPU).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

STOCK_ATTENTION = "repaudit_stock_sdpa"

# The forward's additive mask, keyed by its boolean mask and dtype: every layer gets the same
# mask tensor. Cleared as each forward of the base model begins, since a CUDA graph's capture
# reuses the warm-up's mask tensor with new contents and must record the conversion itself.
_MASKS: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
# Whether torch picks one backend for the grouped and the repeated heads, per call signature.
_SAME_BACKEND: dict[tuple, bool] = {}


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              position_bias=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or position_bias is not None or kwargs.get("output_attentions", False) \
            or not _plain(query, key, value, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    mask = additive_mask(attention_mask, query.dtype)
    if groups > 1 and not _same_backend(query, key, value, mask, dropout, scaling, groups):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def _plain(*tensors: torch.Tensor) -> bool:
    return all(type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") for t in tensors)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask as SDPA turns it in each call: a boolean mask becomes 0 where True and -inf where
    False, in the query's dtype, laid out as the mask is; an additive one is passed as it is."""
    if mask.dtype != torch.bool:
        return mask
    held = _MASKS.get((id(mask), dtype))
    if held is not None and held[0] is mask:
        return held[1]
    additive = torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))
    _MASKS[(id(mask), dtype)] = (mask, additive)
    return additive


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


@contextmanager
def masks_per_forward(model: torch.nn.Module) -> Iterator[None]:
    handle = model.base_model.register_forward_pre_hook(lambda *args: _MASKS.clear())
    try:
        yield
    finally:
        handle.remove()
        _MASKS.clear()
