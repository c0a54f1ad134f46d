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

paged_attention is the same computation over a serving engine's paged KV cache (vLLM's layout):
queries flat, request after request, keys read through a block table. Both kernels update a
query's state with one function (_update), key block by key block counted from the sequence's
first key, so a query gets the same bits from either.
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
def _update(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One key block (keys offs_n, counted in the same frame as the queries' positions q_pos)
    into the queries' online-softmax state. Keys out of range were loaded as zeros."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
    alpha = tl.exp2(m_i - ref)
    p = tl.exp2(s - ref[:, None])
    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    # A query that sees no key of this block (it sits before kb) keeps its state bit for bit,
    # so the extra blocks its neighbours need cannot touch it.
    live = kb <= q_pos
    acc = tl.where(live[:, None], acc * alpha[:, None] + pv, acc)
    l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=1), l_i)
    m_i = tl.where(live, m_new, m_i)
    return m_i, l_i, acc


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
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :] * sv_d,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _update(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc, qk_scale, PRECISION)
    # Queries with no visible key (left padding) get zeros instead of 0/0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=(offs_m < Tq)[:, None] & d_mask[None, :])


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, qsl_ptr, seq_lens_ptr, table_ptr,
    sq_t, sq_h, sq_d, sk_blk, sk_s, sk_h, sk_d, sv_blk, sv_s, sv_h, sv_d, so_t, so_h, so_d, s_table,
    Hq, group, block_size, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_rh = tl.program_id(1)
    r = pid_rh // Hq
    h = pid_rh % Hq
    hk = h // group
    q_first = tl.load(qsl_ptr + r).to(tl.int64)
    q_len = (tl.load(qsl_ptr + r + 1) - q_first).to(tl.int32)
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)

    # Positions are counted from the sequence's first key (the other kernel's start[b] is 0
    # here): the request's new tokens are its last q_len positions.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = seq_len - q_len + offs_m
    rows = (q_first + offs_m)[:, None]
    q = tl.load(q_ptr + rows * sq_t + h * sq_h + offs_d[None, :] * sq_d,
                mask=(offs_m < q_len)[:, None] & d_mask[None, :], other=0.0)
    table = table_ptr + r.to(tl.int64) * s_table

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(seq_len - q_len + (pid_m + 1) * BLOCK_M, seq_len)
    for kb in range(0, end, BLOCK_N):
        offs_n = kb + tl.arange(0, BLOCK_N)
        in_range = offs_n < seq_len
        # Slots past the sequence hold whatever the cache held (even NaN bits): never loaded.
        block = tl.load(table + offs_n // block_size, mask=in_range, other=0).to(tl.int64)
        within = (offs_n % block_size).to(tl.int64)
        k = tl.load(kc_ptr + (block * sk_blk + within * sk_s + hk * sk_h)[:, None] + offs_d[None, :] * sk_d,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(vc_ptr + (block * sv_blk + within * sv_s + hk * sv_h)[:, None] + offs_d[None, :] * sv_d,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _update(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc, qk_scale, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + rows * so_t + h * so_h + offs_d[None, :] * so_d, out.to(o_ptr.dtype.element_ty),
             mask=(offs_m < q_len)[:, None] & d_mask[None, :])


_launch = CachedKernel(_attention_kernel)
_launch_paged = CachedKernel(_paged_attention_kernel)


def _meta(q: torch.Tensor, dim: int) -> dict:
    return dict(HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)


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
    meta = _meta(q, dim)
    args = (q, k, v, out, start.to(device=q.device).contiguous(), *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), hq, tq, s_len, hq // hkv, float(scale * _LOG2E))
    _launch(grid, args, meta)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                    max_query_len: int, scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """attention() for a serving batch over a paged KV cache; a query gets attention()'s bits.

    query [N, Hq, D]: the batch's new tokens, request after request; request r's are rows
    query_start_loc[r] .. query_start_loc[r + 1] - 1 (query_start_loc [R + 1]) and are the last
    of its seq_lens[r] tokens, whose keys and values are already in the caches
    [blocks, block_size, Hkv, D] at the blocks block_table[r] (vLLM's flash-attention layout).
    Writes and returns `out` [N, Hq, D] (default: a new tensor); rows past query_start_loc[R]
    are left as they are.
    """
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("query must be [N, Hq, D] and the caches [blocks, block_size, Hkv, D] alike")
    n_tok, hq, dim = query.shape
    hkv, block_size = key_cache.shape[2], key_cache.shape[1]
    if key_cache.shape[3] != dim or hq % hkv:
        raise ValueError(f"query [.., {hq}, {dim}] does not fit caches of {hkv} heads of {key_cache.shape[3]}")
    n_req = seq_lens.shape[0]
    if query_start_loc.shape != (n_req + 1,) or block_table.dim() != 2 or block_table.shape[0] != n_req:
        raise ValueError("query_start_loc must be [R + 1] and block_table [R, blocks] for seq_lens [R]")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if out is None:
        out = torch.empty_like(query)
    if n_req == 0 or n_tok == 0 or max_query_len == 0:
        return out
    if cpu.active(query):
        return _paged_by_gather(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                                max_query_len, scale, out)
    grid = (triton.cdiv(max_query_len, _BLOCK_M), n_req * hq)
    args = (query, key_cache, value_cache, out, query_start_loc.contiguous(), seq_lens.contiguous(),
            block_table, *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
            block_table.stride(0), hq, hq // hkv, block_size, float(scale * _LOG2E))
    _launch_paged(grid, args, _meta(query, dim))
    return out


def _paged_by_gather(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, max_query_len,
                     scale, out):
    """The batch laid out as attention() takes it (left-padded keys ending together, each
    request's new tokens the last queries), for backends without the paged kernel."""
    dev = query.device
    n_req = seq_lens.shape[0]
    block_size = key_cache.shape[1]
    max_seq = int(seq_lens.max())
    start = (max_seq - seq_lens).to(torch.int32)
    pos = (torch.arange(max_seq, device=dev)[None, :] - start[:, None]).clamp(min=0)  # [R, S]
    slots = block_table.gather(1, (pos // block_size).to(block_table.dtype)).long() * block_size + pos % block_size
    k = key_cache.flatten(0, 1)[slots]  # [R, S, Hkv, D]
    v = value_cache.flatten(0, 1)[slots]
    ends = query_start_loc[1:].long()
    src = (ends[:, None] - max_query_len + torch.arange(max_query_len, device=dev)[None, :]).clamp(min=0)
    padded = attention(query[src].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start=start, scale=scale)
    padded = padded.transpose(1, 2).reshape(n_req * max_query_len, *query.shape[1:])
    n = int(ends[-1])
    token = torch.arange(n, device=dev)
    req = torch.searchsorted(ends, token, right=True)
    out[:n] = padded[req * max_query_len + max_query_len - ends[req] + token]
    return out
