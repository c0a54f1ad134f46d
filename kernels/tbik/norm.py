"""Batch-invariant RMSNorm (with the residual add before it) and last-dim mean: inputs checked,
backend picked (tl/norm.py says how the kernels reduce a row)."""

from __future__ import annotations

import torch

from . import backend, cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama/Qwen RMSNorm, `weight * (h * torch.rsqrt(mean(h.pow(2)) + eps)).to(x.dtype)`
    with h = x in fp32 and mean = mean_last_dim, in one kernel with the bits of those eager ops.

    With `residual`, the decoder layer's `residual + x` (rounded to x's dtype) is normalised
    instead, and (normed, that sum) is returned. The result dtype follows torch's promotion of
    (weight, x), as in `self.weight * hidden`.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    if backend.on_cpu(x):
        return cpu.rms_norm(x, weight, eps, residual)
    from .tl import norm

    return norm.rms_norm(x, weight, eps, residual)


def mean_last_dim(x: torch.Tensor, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant mean over the last dim (fp32 accumulation, fp64 for fp64), cast to dtype."""
    if x.shape[-1] == 0:  # NaN, as torch's mean of nothing; the kernel's row view cannot hold it
        shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
        return torch.full(shape, float("nan"), dtype=dtype or x.dtype, device=x.device)
    if backend.on_cpu(x):
        return cpu.mean_last_dim(x, keepdim, dtype)
    from .tl import norm

    return norm.mean_last_dim(x, keepdim, dtype)
