"""Batch-invariant row-wise log-softmax: input checked, backend picked (tl/softmax.py says how the
kernel reduces a row)."""

from __future__ import annotations

import torch

from . import backend, cpu


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax along `dim`, batch-invariant; output dtype = `dtype` or x.dtype (fp32 for fp32).
    `out`: a tensor of the result's shape and dtype to write it into (returned), as torch's out=;
    a row's bits do not depend on where it is written."""
    if not x.is_floating_point():
        raise TypeError(f"log_softmax needs a floating-point tensor, got {x.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != (dtype or x.dtype) or out.device != x.device):
        raise ValueError(f"out= must be {tuple(x.shape)} {dtype or x.dtype} on {x.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if x.dim() == 0:
        result = log_softmax(x.reshape(1), 0, dtype).reshape(())
    elif backend.on_cpu(x):
        result = cpu.log_softmax(x, dim, dtype)
    else:
        from .tl import softmax

        if out is not None and dim in (-1, x.dim() - 1) and x.dim() == 2 and out.stride(-1) == 1:
            return softmax.log_softmax_rows(x, out)
        result = softmax.log_softmax(x, dim, dtype)
    return result if out is None else out.copy_(result)


def log_softmax_at(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`log_softmax(x, -1, dtype).gather(-1, index)` for x [rows, V] and index [rows, k] (int32 or
    int64): the same bits, without writing the rows' other entries (a sampler's logprobs of its
    chosen and top-k tokens out of a vocabulary-wide row). An index outside [0, V) gives NaN where
    gather would raise (checking it would wait for the device)."""
    if not x.is_floating_point():
        raise TypeError(f"log_softmax_at needs a floating-point tensor, got {x.dtype}")
    if x.dim() != 2 or index.dim() != 2 or index.shape[0] != x.shape[0] or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"log_softmax_at takes x [rows, V] and an int32/int64 index [rows, k], got "
                         f"{tuple(x.shape)} and {tuple(index.shape)} {index.dtype}")
    if backend.on_cpu(x):
        inside = (index >= 0) & (index < x.shape[1])
        picked = cpu.log_softmax(x, -1, dtype).gather(-1, index.clamp(0, max(x.shape[1] - 1, 0)).long())
        return picked.masked_fill(~inside, float("nan"))
    from .tl import softmax

    return softmax.log_softmax_at(x, index, dtype or x.dtype)
