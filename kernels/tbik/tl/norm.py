"""Batch-invariant RMSNorm and last-dim mean.

One program per row, and the row is reduced in a fixed loop of BLOCK-wide slices into a
vector accumulator, then one in-register tree: the order depends on the row length alone, not
on how many rows there are (stock reductions pick their split from the whole tensor's shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import CachedKernel

_MAX_BLOCK = 1024


def _block(n_cols: int) -> int:
    # Depends on the row length only (e.g. 128 for per-head q/k norms, 1024 for hidden 4096).
    return min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))


@triton.jit
def _row_sum(row_ptr, n_cols, SQUARE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=ACC)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0).to(ACC)
        if SQUARE:
            acc += x * x
        else:
            acc += x
    return tl.sum(acc, axis=0)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    mean_sq = _row_sum(x_row, n_cols, True, tl.float32, BLOCK) / n_cols
    rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        # HF order: normalise in fp32, round to the input dtype, then multiply by the weight
        # (a bf16 x bf16 product is computed in fp32 and rounded once, as torch does).
        y = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mean_kernel(x_ptr, out_ptr, n_cols, stride_x, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    total = _row_sum(x_ptr + row * stride_x, n_cols, False, ACC, BLOCK)
    tl.store(out_ptr + row, (total / n_cols).to(out_ptr.dtype.element_ty))


_rms_norm = CachedKernel(_rms_norm_kernel)
_mean = CachedKernel(_mean_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.numel():
        meta = dict(BLOCK=_block(rows.shape[1]), num_warps=4)
        _rms_norm((rows.shape[0],), (rows, weight.contiguous(), out, rows.shape[1], rows.stride(0), out.stride(0),
                                     float(eps)), meta)
    return out.view(x.shape)


def mean_last_dim(x: torch.Tensor, keepdim: bool, dtype: torch.dtype | None) -> torch.Tensor:
    rows = _rows(x)
    out_dtype = dtype or x.dtype
    out = torch.empty(rows.shape[0], dtype=out_dtype, device=x.device)
    if rows.numel():
        acc = tl.float64 if torch.float64 in (x.dtype, out_dtype) else tl.float32
        meta = dict(ACC=acc, BLOCK=_block(rows.shape[1]), num_warps=4)
        _mean((rows.shape[0],), (rows, out, rows.shape[1], rows.stride(0)), meta)
    elif rows.shape[0]:
        out.fill_(float("nan"))  # mean of nothing, as torch
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.view(shape)
