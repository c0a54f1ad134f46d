"""SiLU-and-mul and rotary embedding in one kernel each, with the bits of the eager ops.

A model's eager code runs these as a chain of torch kernels, each rounding its output to the
model dtype: `silu(gate) * up` is two roundings, and transformers' rotary embedding is a
matmul, a cat, cos and sin, casts, products and a sum. Here each runs as one kernel that rounds
where the eager chain rounds, so a serving engine gets the training code's bits without the
chain's launches and memory traffic. What keeps the bits:
- compiled without FMA contraction (no eager op fuses a product into a sum);
- exp, cos and sin are the CUDA math library's (libdevice), as torch's CUDA kernels call them,
  and silu's division is IEEE-rounded (div_rn), as torch's is; Triton's own exp and `/` are
  faster approximations;
- a product or sum of two bf16 values is taken in fp32 and rounded to bf16, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .launcher import CachedKernel
from .norm import _halving_sum_rows, _rows

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(dtype)  # torch's silu: x / (1 + exp(-x))
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


@triton.jit
def _rotated(x1, x2, cos_lo, cos_hi, sin_lo, sin_hi, dtype: tl.constexpr):
    """The two halves of x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), all in fp32
    holding dtype values: each product rounded to dtype, then the sum (rounded by the caller)."""
    lo = (x1 * cos_lo).to(dtype).to(tl.float32) + (-x2 * sin_lo).to(dtype).to(tl.float32)
    hi = (x2 * cos_hi).to(dtype).to(tl.float32) + (x1 * sin_hi).to(dtype).to(tl.float32)
    return lo, hi


@triton.jit
def _rope_kernel(pos_ptr, inv_freq_ptr, x_ptr, out_ptr, heads, stride_x, stride_o, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    # One token, every head of one tensor (q or k): x [tokens, heads * 2 * HALF].
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    dtype = out_ptr.dtype.element_ty
    freq = tl.load(inv_freq_ptr + j, mask=mask, other=0.0) * tl.load(pos_ptr + row).to(tl.float32)
    cos = libdevice.cos(freq).to(dtype).to(tl.float32)
    sin = libdevice.sin(freq).to(dtype).to(tl.float32)
    for h in range(heads):
        base = h * 2 * HALF
        x1 = tl.load(x_ptr + row * stride_x + base + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + row * stride_x + base + HALF + j, mask=mask, other=0.0).to(tl.float32)
        lo, hi = _rotated(x1, x2, cos, cos, sin, sin, dtype)
        tl.store(out_ptr + row * stride_o + base + j, lo.to(dtype), mask=mask)
        tl.store(out_ptr + row * stride_o + base + HALF + j, hi.to(dtype), mask=mask)


@triton.jit
def _apply_rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, seq, sx_b, sx_h, sx_t, sc_b, sc_t, ss_b, ss_t,
                       so_b, so_h, so_t, HALF: tl.constexpr, BLOCK: tl.constexpr):
    # One (batch, head, position) row of x [B, H, T, 2 * HALF] (any strides, unit last), with
    # that (batch, position)'s cos and sin rows [2 * HALF] given in x's dtype.
    r = tl.program_id(0).to(tl.int64)
    t = r % seq
    h = (r // seq) % heads
    b = r // (seq * heads)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + b * sx_b + h * sx_h + t * sx_t
    c_row = cos_ptr + b * sc_b + t * sc_t
    s_row = sin_ptr + b * ss_b + t * ss_t
    x1 = tl.load(x_row + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + j, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_row + j, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + HALF + j, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + j, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + HALF + j, mask=mask, other=0.0).to(tl.float32)
    lo, hi = _rotated(x1, x2, c1, c2, s1, s2, dtype)
    o_row = out_ptr + b * so_b + h * so_h + t * so_t
    tl.store(o_row + j, lo.to(dtype), mask=mask)
    tl.store(o_row + HALF + j, hi.to(dtype), mask=mask)


@triton.jit
def _norm_rope_heads(x_row, w_ptr, out_row, first, n_heads, pos, inv_freq_ptr, n_cols, eps, HALF: tl.constexpr,
                     ROWS: tl.constexpr):
    """ROWS heads of one token (x_row: the token's q or k), RMSNorm'd as norm.py's kernel does a
    per-head row, then rotated as _rope_kernel rotates it.

    A head is read as its two rotary halves. The norm kernel's halving tree adds lane i to lane
    i + BLOCK/2 first, and with BLOCK == head_dim (a power of two) those are the halves' lanes i:
    x1^2 + x2^2 is that first level, bit for bit, and _halving_sum_rows over HALF lanes the rest."""
    head = first + tl.arange(0, ROWS)
    j = tl.arange(0, HALF)
    mask = (head < n_heads)[:, None]
    offs = head[:, None] * (2 * HALF) + j[None, :]
    dtype = x_row.dtype.element_ty
    out_dtype = out_row.dtype.element_ty
    x1 = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    mean = _halving_sum_rows(x1 * x1 + x2 * x2, ROWS, HALF) / n_cols
    rstd = tl.math.rsqrt(mean + eps)[:, None]
    w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
    n1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    n2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    freq = tl.load(inv_freq_ptr + j) * pos
    cos = libdevice.cos(freq).to(out_dtype).to(tl.float32)[None, :]
    sin = libdevice.sin(freq).to(out_dtype).to(tl.float32)[None, :]
    lo, hi = _rotated(n1, n2, cos, cos, sin, sin, out_dtype)
    tl.store(out_row + offs, lo.to(out_dtype), mask=mask)
    tl.store(out_row + offs + HALF, hi.to(out_dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(pos_ptr, inv_freq_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, q_heads, k_heads,
                         stride_q, stride_k, n_cols, eps, HALF: tl.constexpr, ROWS: tl.constexpr):
    # One token, ROWS heads of q (the first cdiv(q_heads, ROWS) programs along axis 1) or of k.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(q_heads, ROWS)
    pos = tl.load(pos_ptr + token).to(tl.float32)
    if block < q_blocks:
        _norm_rope_heads(q_ptr + token * stride_q, qw_ptr, q_out_ptr + token * q_heads * n_cols, block * ROWS,
                         q_heads, pos, inv_freq_ptr, n_cols, eps, HALF, ROWS)
    else:
        _norm_rope_heads(k_ptr + token * stride_k, kw_ptr, k_out_ptr + token * k_heads * n_cols,
                         (block - q_blocks) * ROWS, k_heads, pos, inv_freq_ptr, n_cols, eps, HALF, ROWS)


_silu_and_mul = CachedKernel(_silu_and_mul_kernel)
_rope = CachedKernel(_rope_kernel)
_apply_rope = CachedKernel(_apply_rope_kernel)
_qk_norm_rope = CachedKernel(_qk_norm_rope_kernel)
_EXACT = dict(num_warps=4, enable_fp_fusion=False)
_HEAD_ELEMENTS = 1024  # a program's heads hold this many elements at most (norm.py's _ROW_ELEMENTS)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    rows = _rows(x)
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul((rows.shape[0], triton.cdiv(d, block)), (rows, out, d, rows.stride(0), out.stride(0)),
                      dict(BLOCK=block, **_EXACT))
    return out.view(*x.shape[:-1], d)


def rope(positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        half = head_dim // 2
        _rope((rows.shape[0],), (positions.reshape(-1), inv_freq.float().contiguous(), rows, out,
                                 rows.shape[1] // head_dim, rows.stride(0), out.stride(0)),
              dict(HALF=half, BLOCK=max(16, triton.next_power_of_2(half)), **_EXACT))
    return out.view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)  # dense, in x's dimension order: the eager product's layout
    if out.numel():
        B, H, T, D = x.shape
        cos, sin = (c.expand(B, T, D) for c in (cos, sin))
        _apply_rope((B * H * T,), (x, cos, sin, out, H, T, x.stride(0), x.stride(1), x.stride(2),
                                   cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                                   out.stride(0), out.stride(1), out.stride(2)),
                    dict(HALF=D // 2, BLOCK=max(16, triton.next_power_of_2(D // 2)), **_EXACT))
    return out


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    out_dtype = torch.promote_types(q_weight.dtype, q.dtype)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    if q.shape[0]:
        rows = min(max(1, _HEAD_ELEMENTS // head_dim), triton.next_power_of_2(max(q_heads, k_heads)))
        grid = (q.shape[0], triton.cdiv(q_heads, rows) + triton.cdiv(k_heads, rows))
        _qk_norm_rope(grid, (positions.reshape(-1), inv_freq.float().contiguous(), q, k, q_weight.contiguous(),
                             k_weight.contiguous(), q_out, k_out, q_heads, k_heads, q.stride(0), k.stride(0), head_dim,
                             float(eps)), dict(HALF=head_dim // 2, ROWS=rows, **_EXACT))
    return q_out, k_out
