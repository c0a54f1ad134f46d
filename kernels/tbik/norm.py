"""Batch-invariant RMSNorm (with the residual add before it) and last-dim mean: inputs checked,
backend picked (tl/norm.py says how the kernels reduce a row)."""

from __future__ import annotations

import torch

from . import backend, cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             mean_sq: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama/Qwen RMSNorm, `weight * (h * torch.rsqrt(mean(h.pow(2)) + eps)).to(x.dtype)`
    with h = x in fp32 and mean = mean_last_dim, in one kernel with the bits of those eager ops.

    With `residual`, the decoder layer's `residual + x` (rounded to x's dtype) is normalised
    instead, and (normed, that sum) is returned. The result dtype follows torch's promotion of
    (weight, x), as in `self.weight * hidden`.

    x may also be float32 with a 16-bit residual (a row-parallel layer's fp32 sum): x is then
    rounded to the residual's dtype first, which then stands for x's dtype above. The bits are
    those of `rms_norm(x.to(residual.dtype), weight, eps, residual)`, without the cast's own pass.

    With `mean_sq` (fp32, x.shape[:-1] + (1,)), each row's mean of h.pow(2) computed elsewhere
    (torch's own `mean` of float_squares(x), as the stock eager norm computes it), the kernel
    only scales: the eager ops' bits with any reduction order.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype and not (
            x.dtype == torch.float32 and residual.dtype in (torch.bfloat16, torch.float16))):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} (or 16-bit with a float32 x), "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    if mean_sq is not None:
        want = (*x.shape[:-1], 1)
        if residual is not None or tuple(mean_sq.shape) != want or mean_sq.dtype != torch.float32:
            raise ValueError(f"mean_sq must be float32 {want} and come without residual, got "
                             f"{tuple(mean_sq.shape)} {mean_sq.dtype}" + (" with residual" if residual is not None else ""))
    if backend.on_cpu(x):
        return cpu.rms_norm(x, weight, eps, residual, mean_sq)
    backend.check_kernel_dtypes("rms_norm", x, weight)
    from .tl import norm

    return norm.rms_norm(x, weight, eps, residual, mean_sq)


def float_squares(x: torch.Tensor) -> torch.Tensor:
    """`x.to(torch.float32).pow(2)` in one kernel, contiguous, with those two ops' bits (pow(2) is
    x * x in torch): the input of the stock RMSNorm's own mean (rms_norm's mean_sq)."""
    if not x.is_contiguous():
        raise ValueError("float_squares needs a contiguous x (the eager ops' output follows x's layout)")
    if backend.on_cpu(x):
        return x.to(torch.float32).pow(2)
    backend.check_kernel_dtypes("float_squares", x)
    from .tl import norm

    return norm.float_squares(x)


def mean_last_dim(x: torch.Tensor, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant mean over the last dim (fp32 accumulation, fp64 for fp64), cast to dtype."""
    if x.shape[-1] == 0:  # NaN, as torch's mean of nothing; the kernel's row view cannot hold it
        shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
        return torch.full(shape, float("nan"), dtype=dtype or x.dtype, device=x.device)
    if backend.on_cpu(x):
        return cpu.mean_last_dim(x, keepdim, dtype)
    from .tl import norm

    return norm.mean_last_dim(x, keepdim, dtype)
