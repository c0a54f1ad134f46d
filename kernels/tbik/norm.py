"""Batch-invariant RMSNorm and last-dim mean: inputs checked, backend picked (tl/norm.py says how
the kernels reduce a row)."""

from __future__ import annotations

import torch

from . import backend, cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-style RMSNorm over the last dim: weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype).

    The result dtype follows torch's promotion of (weight, x), as in `self.weight * hidden`.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if backend.on_cpu(x):
        return cpu.rms_norm(x, weight, eps)
    from .tl import norm

    return norm.rms_norm(x, weight, eps)


def mean_last_dim(x: torch.Tensor, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant mean over the last dim (fp32 accumulation, fp64 for fp64), cast to dtype."""
    if backend.on_cpu(x) and x.shape[-1]:
        return cpu.mean_last_dim(x, keepdim, dtype)
    from .tl import norm

    return norm.mean_last_dim(x, keepdim, dtype)
