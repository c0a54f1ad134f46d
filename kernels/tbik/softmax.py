"""Batch-invariant row-wise log-softmax: input checked, backend picked (tl/softmax.py says how the
kernel reduces a row)."""

from __future__ import annotations

import torch

from . import backend, cpu


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """log_softmax along `dim`, batch-invariant; output dtype = `dtype` or x.dtype (fp32 for fp32)."""
    if not x.is_floating_point():
        raise TypeError(f"log_softmax needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        return log_softmax(x.reshape(1), 0, dtype).reshape(())
    if backend.on_cpu(x):
        return cpu.log_softmax(x, dim, dtype)
    from .tl import softmax

    return softmax.log_softmax(x, dim, dtype)
