"""Batch-, head- and prefill/decode-invariant causal attention (GQA, left padding).

Stock attention kernels choose how to split the keys (split-KV / flash-decoding) from batch x
heads x length, and bucket the keys from index 0, so a query's softmax is summed in a
different order when the batch, the padding, the head count per rank or the prefill/decode
phase changes. Here each program owns one batch row, one key/value head and BLOCK_M tile rows,
each a (query, query head) pair, query-major: the query heads that share the key/value head sit
in adjacent rows, so a decode step reads each key once per GQA group instead of once per query
head. A program walks the keys from the row's first real key, start[b], in BLOCK_N-wide
blocks: block boundaries are relative to the first real key, so a query meets the same key blocks, in the same order, with
the same online-softmax updates, whatever the padding, the batch, the heads per call, or
whether it is computed in a prefill block or alone in a decode step. Blocks past a query's own
position (other queries of its block need them) leave its state exactly untouched.

paged_attention is the same computation over a serving engine's paged KV cache (vLLM's layout):
queries flat, request after request, keys read through a block table. Both kernels update a
query's state with one function (_update), key block by key block counted from the sequence's
first key, with the same tile rows, so a query gets the same bits from either. A row's
arithmetic does not depend on which rows share its tile (the property the prefill/decode and
heads-per-call invariances rest on), so neither does it on how the rows are laid out.

A decode step fills 2 of those 64 rows at Qwen3's GQA group of 2 (64 is sm90's smallest MMA
tile, wgmma's M; fewer rows make Triton issue another instruction, with other bits). Where a
paged call has at most 16 (query, query head) rows per key/value head (a serving engine's decode
step), the kernel runs keys-major: a block's 64 keys in the MMA's rows and the query rows in its
N, S^T = K Q^T and O^T = V^T P^T. (In the dense kernel, at the transformers engine's batches,
keys-major ran slower than row-major: reports/kernels/h200-keys-major/.)
An element of a wgmma product has the same bits wherever it sits in the tile, so S and P V are
the row-major kernel's own; what moves with the layout is tl.sum's order over a block's 64 keys
for the softmax denominator, which row_sum_in_mma_order spells out. A query then gets the same
bits from either layout (tests/test_tbik_gpu.py compares fp32 and bf16 outputs, GQA groups
1-16, head sizes 64-256). That order is Triton's and sm90's: elsewhere (mma_order_known) every
call runs row-major.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launcher import CachedKernel

_BLOCK_M = 64
_BLOCK_N = 64
_LOG2E = 1.4426950408889634
KEYS_MAJOR_ROWS = 16  # query rows a key/value head up to which a call runs keys-major (0: never)
KEYS_MAJOR_TRITON = ("3.6.",)  # Triton versions whose row-sum order row_sum_in_mma_order spells out
# Software pipeline depth (key blocks loaded ahead), a launch choice: the arithmetic, and so the
# bits, are the same at any depth (benchmarks/paged_attention_bench.py --stages checks it).
STAGES = 2


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
def _split8(y):
    """y [..., 2, 2, 2] (index 4a + 2b + c) -> its 8 slices in index order."""
    even, odd = tl.split(y)
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def row_sum_in_mma_order(p_t, BLOCK_Q: tl.constexpr):
    """Sum over the 64 keys (rows) of p_t [64, BLOCK_Q], in the order tl.sum(p, axis=1) takes
    over the columns of _update's p (sm90, 4 warps): lane t of a quad holds keys 8c + 2t + j
    (c = 0..7, j = 0, 1) and adds them in that order; then (lane 0 + lane 2) + (lane 1 + lane 3)."""
    x = tl.permute(tl.reshape(p_t, [8, 4, 2, BLOCK_Q]), [1, 3, 0, 2])  # [lane, query, c, j]
    a, b = tl.split(tl.reshape(x, [4, BLOCK_Q, 2, 2, 2, 2]))  # j = 0, 1: [lane, query, c]
    a0, a1, a2, a3, a4, a5, a6, a7 = _split8(a)
    b0, b1, b2, b3, b4, b5, b6, b7 = _split8(b)
    acc = a0 + b0
    acc = acc + a1
    acc = acc + b1
    acc = acc + a2
    acc = acc + b2
    acc = acc + a3
    acc = acc + b3
    acc = acc + a4
    acc = acc + b4
    acc = acc + a5
    acc = acc + b5
    acc = acc + a6
    acc = acc + b6
    acc = acc + a7
    acc = acc + b7  # [lane, query]
    low, high = tl.split(tl.permute(tl.reshape(acc, [2, 2, BLOCK_Q]), [2, 1, 0]))  # lanes 0, 1 | 2, 3
    u, w = tl.split(low + high)
    return u + w


@triton.jit
def _update_keys_major(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc_t, qk_scale,
                       PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr):
    """_update with the keys in the MMA's rows: acc_t is acc transposed, [D, BLOCK_Q]."""
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
    visible = (offs_n[:, None] <= q_pos[None, :]) & in_range[:, None]
    s_t = tl.where(visible, s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - ref)
    p_t = tl.exp2(s_t - ref[None, :])
    pv_t = tl.dot(tl.trans(v), p_t.to(v.dtype), input_precision=PRECISION)
    live = kb <= q_pos
    acc_t = tl.where(live[None, :], acc_t * alpha[None, :] + pv_t, acc_t)
    l_i = tl.where(live, l_i * alpha + row_sum_in_mma_order(p_t, BLOCK_Q), l_i)
    m_i = tl.where(live, m_new, m_i)
    return m_i, l_i, acc_t


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, end_ptr,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, so_b, so_h, so_t, so_d,
    Hkv, Tq, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One program: one batch row, one key/value head, BLOCK_M rows of (query, query head)
    # pairs, query-major, as in the paged kernel: a decode step reads its keys once per GQA group.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)  # int64: a long KV cache's offsets pass 2**31
    hk = pid_bh % Hkv
    start = tl.load(start_ptr + b).to(tl.int32)
    S = tl.load(end_ptr + b).to(tl.int32)  # keys present; slots past them are never read

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = offs_r // group
    h = hk * group + offs_r % group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = S - Tq + qi  # key index each query sits at (queries are aligned to the end)
    row_mask = (qi < Tq)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + qi[:, None] * sq_t + offs_d[None, :] * sq_d,
                mask=row_mask, other=0.0)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Keys this block's queries can see: [start, its last query's position].
    last_q = ((pid_m + 1) * BLOCK_M - 1) // group
    end = tl.minimum(S - Tq + last_q + 1, S)
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
    tl.store(o_ptr + b * so_b + h[:, None] * so_h + qi[:, None] * so_t + offs_d[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, qsl_ptr, seq_lens_ptr, table_ptr,
    sq_t, sq_h, sq_d, sk_blk, sk_s, sk_h, sk_d, sv_blk, sv_s, sv_h, sv_d, so_t, so_h, so_d, s_table,
    Hkv, group, block_size, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KEYS_MAJOR: tl.constexpr,
):
    # One program: one request, one key/value head, BLOCK_M rows of (query, query head) pairs,
    # query-major: the `group` query heads that share the key/value head sit in adjacent rows.
    # A decode step's query thus reads its keys and values once for the whole group, not once
    # per query head; each row's arithmetic is the same whoever shares its tile.
    pid_m = tl.program_id(0)
    pid_rh = tl.program_id(1)
    r = pid_rh // Hkv
    hk = pid_rh % Hkv
    q_first = tl.load(qsl_ptr + r).to(tl.int64)
    q_len = (tl.load(qsl_ptr + r + 1) - q_first).to(tl.int32)
    if pid_m * BLOCK_M >= q_len * group:
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)

    # Positions are counted from the sequence's first key (the other kernel's start[b] is 0
    # here): the request's new tokens are its last q_len positions.
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = offs_r // group
    h = hk * group + offs_r % group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = seq_len - q_len + qi
    row_mask = (qi < q_len)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_first + qi)[:, None] * sq_t + h[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=row_mask, other=0.0)
    table = table_ptr + r.to(tl.int64) * s_table

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if KEYS_MAJOR:
        acc = tl.zeros((BLOCK_D, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    last_q = ((pid_m + 1) * BLOCK_M - 1) // group  # the block's last query (or past the request's)
    end = tl.minimum(seq_len - q_len + last_q + 1, seq_len)
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
        if KEYS_MAJOR:
            m_i, l_i, acc = _update_keys_major(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc, qk_scale,
                                               PRECISION, BLOCK_M)
        else:
            m_i, l_i, acc = _update(q, k, v, offs_n, in_range, kb, q_pos, m_i, l_i, acc, qk_scale, PRECISION)
    if KEYS_MAJOR:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[None, :]
        tl.store(o_ptr + (q_first + qi)[None, :] * so_t + h[None, :] * so_h + offs_d[:, None] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=(qi < q_len)[None, :] & d_mask[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + (q_first + qi)[:, None] * so_t + h[:, None] * so_h + offs_d[None, :] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=row_mask)


_launch = CachedKernel(_attention_kernel)
_launch_paged = CachedKernel(_paged_attention_kernel)


@functools.cache
def mma_order_known(device: torch.device) -> bool:
    """row_sum_in_mma_order is tl.sum's order here: sm90, under a Triton version checked on it."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and triton.__version__.startswith(KEYS_MAJOR_TRITON))


def keys_major(q: torch.Tensor, rows: int) -> bool:
    """Whether a call of `rows` (query, query head) rows a key/value head runs keys-major."""
    return rows <= KEYS_MAJOR_ROWS and q.dtype in (torch.bfloat16, torch.float16) and mma_order_known(q.device)


def _meta(q: torch.Tensor, dim: int, block_m: int = _BLOCK_M) -> dict:
    return dict(HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=STAGES)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              scale: float) -> torch.Tensor:
    bsz, hq, tq, dim = q.shape
    hkv = k.shape[1]
    out = torch.empty((bsz, hq, tq, dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    group = hq // hkv
    grid = (triton.cdiv(tq * group, _BLOCK_M), bsz * hkv)
    meta = _meta(q, dim)
    args = (q, k, v, out, start.to(device=q.device).contiguous(), end.to(device=q.device).contiguous(), *q.stride(),
            *k.stride(), *v.stride(), *out.stride(), hkv, tq, group, float(scale * _LOG2E))
    _launch(grid, args, meta)
    return out


def paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, max_query_len: int,
                    scale: float, out: torch.Tensor) -> torch.Tensor:
    n_req, hq, dim = seq_lens.shape[0], query.shape[1], query.shape[2]
    hkv, block_size = key_cache.shape[2], key_cache.shape[1]
    group = hq // hkv
    major = keys_major(query, max_query_len * group)
    block_m = KEYS_MAJOR_ROWS if major else _BLOCK_M
    grid = (triton.cdiv(max_query_len * group, block_m), n_req * hkv)
    args = (query, key_cache, value_cache, out, query_start_loc.contiguous(), seq_lens.contiguous(),
            block_table, *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
            block_table.stride(0), hkv, group, block_size, float(scale * _LOG2E))
    _launch_paged(grid, args, {**_meta(query, dim, block_m), "KEYS_MAJOR": major})
    return out
