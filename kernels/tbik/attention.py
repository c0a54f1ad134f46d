"""Batch-, head- and prefill/decode-invariant causal attention (GQA, left padding), also over a
serving engine's paged KV cache.

The inputs are checked here and the backend picked (backend.py); why stock attention moves and
how the kernels keep a query's bits is in tl/attention.py.
"""

from __future__ import annotations

import math

import torch

from . import backend, cpu


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: torch.Tensor | None = None,
              end: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention, queries aligned to the end of the keys; keys before start[b] excluded.

    q [B, Hq, Tq, D], k and v [B, Hkv, S, D] (any strides; Hq a multiple of Hkv for GQA),
    start int tensor [B] (left padding; None = no padding), end int tensor [B] (keys from end[b]
    on are not there yet, as in a static KV cache of S slots; None = S), scale default
    1/sqrt(D). Query i of row b sits at key index end[b] - Tq + i and sees keys
    start[b] .. end[b] - Tq + i. A query's bits do not depend on the slots past end[b]: the
    kernels never read them, so a static cache gives the bits of a cache that holds end[b] keys.
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
    if end is None:
        end = torch.full((bsz,), s_len, dtype=torch.int32, device=q.device)
    elif end.shape != (bsz,):
        raise ValueError(f"end must have shape ({bsz},), got {tuple(end.shape)}")
    if start.device.type == "cpu" and end.device.type == "cpu" \
            and bool(((start < 0) | (end < 0) | (end > s_len)).any()):
        # (checked where it costs no device sync) a kernel would read keys outside the tensors
        raise ValueError(f"start must be >= 0 and end within [0, S={s_len}], got start {start.tolist()} "
                         f"and end {end.tolist()}")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    if backend.on_cpu(q):
        return cpu.attention(q, k, v, start=start, end=end, scale=scale)
    from .tl import attention as kernels

    return kernels.attention(q, k, v, start, end, scale)


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
    hkv = key_cache.shape[2]
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
    if backend.on_cpu(query):
        return _paged_by_gather(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                                max_query_len, scale, out)
    from .tl import attention as kernels

    return kernels.paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                                   max_query_len, scale, out)


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
