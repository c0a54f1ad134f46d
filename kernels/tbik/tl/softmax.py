"""Batch-invariant row-wise log-softmax.

One program per row. Pass 1 walks the row in fixed BLOCK-wide slices keeping, per lane, a
running max and a running sum of exp(x - max) (online softmax); the lanes are then merged in
one in-register tree. Pass 2 writes x - max - log(sum). Nothing depends on the number of rows.
log_softmax_at runs the same pass 1 and computes pass 2's value at the asked columns only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import CachedKernel

_MAX_BLOCK = 2048


@triton.jit
def _max_and_log_sum(x_row, n_cols, BLOCK: tl.constexpr):
    """Pass 1: the row's max (0 for a row of -inf) and the log of its sum of exp(x - max)."""
    lane_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has only seen -inf keeps sum 0 (avoids exp(-inf - -inf) = nan).
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - ref) + tl.exp(x - ref)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    log_sum = tl.log(tl.sum(lane_sum * tl.exp(lane_max - ref), axis=0))
    return ref, log_sum


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    ref, log_sum = _max_and_log_sum(x_row, n_cols, BLOCK)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (x - ref - log_sum).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _log_softmax_at_kernel(x_ptr, idx_ptr, out_ptr, n_cols, n_idx, stride_x, stride_i, stride_o,
                           BLOCK: tl.constexpr, IDX_BLOCK: tl.constexpr):
    # Pass 1 as _log_softmax_kernel's, from the same loads (so Triton lays its lanes out, and
    # tl.sum adds them, the same way); pass 2 for the asked columns only.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    ref, log_sum = _max_and_log_sum(x_row, n_cols, BLOCK)
    j = tl.arange(0, IDX_BLOCK)
    cols = tl.load(idx_ptr + row * stride_i + j, mask=j < n_idx, other=0)
    inside = (cols >= 0) & (cols < n_cols)
    x = tl.load(x_row + cols, mask=(j < n_idx) & inside, other=0.0).to(tl.float32)
    value = tl.where(inside, x - ref - log_sum, float("nan"))
    tl.store(out_ptr + row * stride_o + j, value.to(out_ptr.dtype.element_ty), mask=j < n_idx)


_launch = CachedKernel(_log_softmax_kernel)
_launch_at = CachedKernel(_log_softmax_at_kernel)


def _block(n_cols: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))


def log_softmax_rows(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each row of `rows` [n, V] (any row stride) into the same row of `out` [n, V] (unit column
    stride, any row stride); returns out."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.numel():
        meta = dict(BLOCK=_block(rows.shape[1]), num_warps=8)
        _launch((rows.shape[0],), (rows, out, rows.shape[1], rows.stride(0), out.stride(0)), meta)
    return out


def log_softmax_at(rows: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log_softmax_rows(rows)[r, index[r, j]] for rows [n, V] and index [n, k]; the rest of each
    row is never written."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    index = index.contiguous()
    out = torch.empty(index.shape, dtype=dtype, device=rows.device)
    if out.numel():
        meta = dict(BLOCK=_block(rows.shape[1]), IDX_BLOCK=max(16, triton.next_power_of_2(index.shape[1])), num_warps=8)
        _launch_at((rows.shape[0],), (rows, index, out, rows.shape[1], index.shape[1], rows.stride(0),
                                      index.stride(0), out.stride(0)), meta)
    return out


def log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None) -> torch.Tensor:
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    log_softmax_rows(rows, out)
    return out.view(moved.shape).movedim(-1, dim).contiguous()
