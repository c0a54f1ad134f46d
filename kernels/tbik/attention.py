"""Batch-, head- and prefill/decode-invariant causal attention (GQA, left padding).

Stock attention kernels choose how to split the keys (split-KV / flash-decoding) from batch x
heads x length, and bucket the keys from index 0, so a query's softmax is summed in a
different order when the batch, the padding, the head count per rank or the prefill/decode
phase changes. Here each program owns (one batch row, one query head, BLOCK_M queries) and walks
the keys from the row's first real key, start[b], in BLOCK_N-wide blocks: block boundaries are
relative to the first real key, so a query meets the same key blocks, in the same order, with
the same online-softmax updates, whatever the padding, the batch, the heads per call, or
whether it is computed in a prefill block or alone in a decode step. Blocks past a query's own
position (other queries of its block need them) leave its state exactly untouched.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cpu
from ._launcher import CachedKernel

_BLOCK_M = 64
_BLOCK_N = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, start_ptr,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, so_b, so_h, so_t, so_d,
    Hq, Tq, S, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)  # int64: a long KV cache's offsets pass 2**31
    h = pid_bh % Hq
    hk = h // group
    start = tl.load(start_ptr + b).to(tl.int32)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = S - Tq + offs_m  # key index each query sits at (queries are aligned to the end)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :] * sq_d,
                mask=(offs_m < Tq)[:, None] & d_mask[None, :], other=0.0)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Keys this block of queries can see: [start, last query's position].
    end = tl.minimum(S - Tq + (pid_m + 1) * BLOCK_M, S)
    for kb in range(start, end, BLOCK_N):
        offs_n = kb + tl.arange(0, BLOCK_N)
        in_range = offs_n < S
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        alpha = tl.exp2(m_i - ref)
        p = tl.exp2(s - ref[:, None])
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :] * sv_d,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        # A query that sees no key of this block (it sits before kb) keeps its state bit for
        # bit, so the extra blocks its neighbours need cannot touch it.
        live = kb <= q_pos
        acc = tl.where(live[:, None], acc * alpha[:, None] + pv, acc)
        l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=1), l_i)
        m_i = tl.where(live, m_new, m_i)
    # Queries with no visible key (left padding) get zeros instead of 0/0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=(offs_m < Tq)[:, None] & d_mask[None, :])


_launch = CachedKernel(_attention_kernel)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention, queries aligned to the end of the keys; keys before start[b] excluded.

    q [B, Hq, Tq, D], k and v [B, Hkv, S, D] (any strides; Hq a multiple of Hkv for GQA),
    start int tensor [B] (left padding; None = no padding), scale default 1/sqrt(D).
    Query i of row b sits at key index S - Tq + i and sees keys start[b] .. S - Tq + i.
    Returns [B, Hq, Tq, D] in q's dtype (fp32 accumulation, online softmax). Query rows that
    see no key (left-padded queries) come out as zeros.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D]")
    bsz, hq, tq, dim = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != dim:
        raise ValueError(f"k and v must be [B={bsz}, Hkv, S, D={dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tq > s_len:
        raise ValueError(f"more queries ({tq}) than keys ({s_len})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if start is None:
        start = torch.zeros(bsz, dtype=torch.int32, device=q.device)
    elif start.shape != (bsz,):
        raise ValueError(f"start must have shape ({bsz},), got {tuple(start.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    if cpu.active(q):
        return cpu.attention(q, k, v, start=start, scale=scale)
    out = torch.empty((bsz, hq, tq, dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(tq, _BLOCK_M), bsz * hq)
    meta = dict(HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    args = (q, k, v, out, start.to(device=q.device).contiguous(), *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), hq, tq, s_len, hq // hkv, float(scale * _LOG2E))
    _launch(grid, args, meta)
    return out
