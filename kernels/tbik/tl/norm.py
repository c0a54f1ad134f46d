"""Batch-invariant RMSNorm and last-dim mean.

A row is reduced in a fixed loop of BLOCK-wide slices into a vector accumulator, then a halving
tree over the lanes (_halving_sum): the order depends on the row length alone, not on how many
rows there are or share a program (stock reductions pick their split from the whole tensor's
shape), nor on the layout Triton gives the accumulator.

The RMSNorm kernel gives, in one pass, the bits of the eager op sequence of transformers'
Llama/Qwen RMSNorm with this file's mean: `h = x.float(); h.pow(2)`, the mean, `+ eps`,
`torch.rsqrt`, `h * r`, `.to(x.dtype)`, `weight * `; with a residual, the decoder's
`residual + x` rounded to x's dtype first. Each step rounds where the eager op rounds: the
kernel is compiled without FMA contraction (eager ops never fuse a product into a sum), its
rsqrt is the GPU's approximate one as torch's CUDA rsqrt is, and its products of two bf16
values are taken in fp32 (exact) and rounded once, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import CachedKernel

_MAX_BLOCK = 1024
# Rows at most _NARROW wide (per-head q/k norms) share a program, _ROW_ELEMENTS elements of them
# (8 rows of 128) at 4 warps. A wider row keeps a program to itself, at one warp up to 2,048 wide
# and two up to 4,096: the halving tree's levels across warps go through shared memory, each
# behind a barrier, and one warp's shuffles won, 1.7-4.1x at 32-8,192 rows of 1,024
# (norm_bench.py). Wider rows keep 4 warps, unmeasured.
_ROW_ELEMENTS = 1024
_NARROW = 256
_WARPS: int | None = None  # None: the widths' rule above
_ONE_SLICE = True  # a row that fits one slice stays in registers from its one read to its store
_SQUARES_BLOCK = 1024


def _block(n_cols: int) -> int:
    # Depends on the row length only (e.g. 128 for per-head q/k norms, 1024 for hidden 4096).
    return min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))


def _warps(n_cols: int) -> int:
    """A launch choice only: the order of a row's additions is BLOCK's, whatever the warps."""
    if _WARPS is not None:
        return _WARPS
    if _block(n_cols) <= _NARROW:
        return 4
    return 1 if n_cols <= 2 * _MAX_BLOCK else 2 if n_cols <= 4 * _MAX_BLOCK else 4


@triton.jit
def _halving_sum(acc, BLOCK: tl.constexpr):
    """lanes i and i + w/2 added, halving w from BLOCK to 1. tl.sum's order follows the layout
    Triton picks for the accumulator (from the loads' dtype and vector width), so two kernels
    reducing the same numbers through it need not agree; this order is BLOCK's alone."""
    for level in tl.static_range(BLOCK.bit_length() - 1):
        acc = tl.sum(tl.reshape(acc, (2, BLOCK >> (level + 1))), axis=0)
    return tl.sum(acc, axis=0)


@triton.jit
def _row_sum(row_ptr, n_cols, ACC: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=ACC)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0).to(ACC)
    return _halving_sum(acc, BLOCK)


@triton.jit
def _halving_sum_rows(acc, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """_halving_sum of each row of a [ROWS, BLOCK] accumulator: the same pairs added in the same
    order, so a row's sum has the same bits however many rows share the program."""
    for level in tl.static_range(BLOCK.bit_length() - 1):
        acc = tl.sum(tl.reshape(acc, (ROWS, 2, BLOCK >> (level + 1))), axis=1)
    return tl.sum(acc, axis=1)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, mean_ptr, n_rows, rows_inner, n_cols, stride_xo,
                     stride_xi, stride_r, stride_o, stride_s, eps, HAS_RESIDUAL: tl.constexpr,
                     MEAN_GIVEN: tl.constexpr, ONE_SLICE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows a program: a per-head q/k norm row is 128 wide, one element a thread with one row a
    # program. Rows of x may be two-level strided (vLLM's per-head q/k views of a fused qkv output).
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = row < n_rows
    x_row = x_ptr + (row // rows_inner) * stride_xo + (row % rows_inner) * stride_xi
    dtype = res_ptr.dtype.element_ty  # the residual's dtype, or x's (res_ptr is x without one)
    if MEAN_GIVEN:  # each row's mean of squares came from elsewhere (torch's own reduction)
        mean = tl.load(mean_ptr + row, mask=row_ok, other=1.0)
    if ONE_SLICE:  # the row fits one slice: held in registers from its one read to its store
        cols = tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        h = _row_slice(x_row, res_ptr, sum_ptr, row, cols, mask, stride_r, stride_s, HAS_RESIDUAL).to(tl.float32)
        if not MEAN_GIVEN:  # 0 + h * h is h * h to the bit (a square is never -0), so this is the loop's sum
            mean = _halving_sum_rows(h * h, ROWS, BLOCK) / n_cols
        _store_scaled(h, tl.math.rsqrt(mean + eps), w_ptr, out_ptr, row, cols, n_cols, mask, stride_o, dtype)
    else:
        if not MEAN_GIVEN:
            acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = row_ok[:, None] & (cols < n_cols)[None, :]
                h = _row_slice(x_row, res_ptr, sum_ptr, row, cols, mask, stride_r, stride_s,
                               HAS_RESIDUAL).to(tl.float32)
                acc += h * h  # the square rounded, then added: h.pow(2), then the mean kernel's loop
            mean = _halving_sum_rows(acc, ROWS, BLOCK) / n_cols
        rstd = tl.math.rsqrt(mean + eps)
        src = sum_ptr + row * stride_s if HAS_RESIDUAL else x_row
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (cols < n_cols)[None, :]
            h = tl.load(src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _store_scaled(h, rstd, w_ptr, out_ptr, row, cols, n_cols, mask, stride_o, dtype)


@triton.jit
def _row_slice(x_row, res_ptr, sum_ptr, row, cols, mask, stride_r, stride_s, HAS_RESIDUAL: tl.constexpr):
    """One slice of the rows as the norm sees it: x, or the decoder's `residual + x` rounded to
    the residual's dtype, which is also written out as the next residual. A wider x (a
    row-parallel layer's fp32 sum) is first rounded to that dtype: the layer's cast, folded in."""
    x = tl.load(x_row[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(res_ptr.dtype.element_ty).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(sum_ptr + row[:, None] * stride_s + cols[None, :], x, mask=mask)
    return x


@triton.jit
def _store_scaled(h, rstd, w_ptr, out_ptr, row, cols, n_cols, mask, stride_o, dtype: tl.constexpr):
    """`weight * (h * rstd).to(dtype)`, each product rounded where the eager ops round it."""
    y = (h * rstd[:, None]).to(dtype)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    tl.store(out_ptr + row[:, None] * stride_o + cols[None, :],
             (w[None, :].to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _squares_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, h * h, mask=i < n)


@triton.jit
def _mean_kernel(x_ptr, out_ptr, n_cols, stride_x, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    total = _row_sum(x_ptr + row * stride_x, n_cols, ACC, BLOCK)
    tl.store(out_ptr + row, (total / n_cols).to(out_ptr.dtype.element_ty))


_rms_norm = CachedKernel(_rms_norm_kernel)
_mean = CachedKernel(_mean_kernel)
_squares = CachedKernel(_squares_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, n_cols] with a unit last stride, whose rows the kernel steps two-level:
    a view where the strides allow it (vLLM's per-head q/k views of a fused qkv output), else a copy."""
    x3 = x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             mean_sq: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    rows = _row_view(x)
    model_dtype = x.dtype if residual is None else residual.dtype
    out = torch.empty((*x.shape[:-1], n_cols), dtype=torch.promote_types(weight.dtype, model_dtype), device=x.device)
    total = torch.empty(x.shape, dtype=model_dtype, device=x.device) if residual is not None else out
    res = residual.reshape(-1, n_cols).contiguous() if residual is not None else rows
    if out.numel():
        n_rows = out.numel() // n_cols
        block = _block(n_cols)
        per_program = min(max(1, _ROW_ELEMENTS // block), triton.next_power_of_2(n_rows)) if block <= _NARROW else 1
        meta = dict(HAS_RESIDUAL=residual is not None, MEAN_GIVEN=mean_sq is not None,
                    ONE_SLICE=_ONE_SLICE and n_cols <= block, ROWS=per_program, BLOCK=block,
                    num_warps=_warps(n_cols), enable_fp_fusion=False)
        mean = out if mean_sq is None else mean_sq.reshape(-1).contiguous()  # out: a pointer never read
        _rms_norm((triton.cdiv(n_rows, per_program),), (rows, res, weight.contiguous(), out, total, mean, n_rows,
                                                        rows.shape[1], n_cols, rows.stride(0), rows.stride(1),
                                                        res.stride(0), n_cols, n_cols, float(eps)), meta)
    return out if residual is None else (out, total)


def float_squares(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.numel():
        _squares((triton.cdiv(out.numel(), _SQUARES_BLOCK),), (x.contiguous(), out, out.numel()),
                 dict(BLOCK=_SQUARES_BLOCK, num_warps=4))
    return out


def mean_last_dim(x: torch.Tensor, keepdim: bool, dtype: torch.dtype | None) -> torch.Tensor:
    rows = _rows(x)
    out_dtype = dtype or x.dtype
    out = torch.empty(rows.shape[0], dtype=out_dtype, device=x.device)
    if rows.numel():
        acc = tl.float64 if torch.float64 in (x.dtype, out_dtype) else tl.float32
        meta = dict(ACC=acc, BLOCK=_block(rows.shape[1]), num_warps=_warps(rows.shape[1]))
        _mean((rows.shape[0],), (rows, out, rows.shape[1], rows.stride(0)), meta)
    elif rows.shape[0]:
        out.fill_(float("nan"))  # mean of nothing, as torch
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.view(shape)
