"""The CPU backend: the same invariance contracts, in plain torch, fast enough to run models.

The Triton kernels run on CPU only through Triton's interpreter, which is far too slow to
run a model. These functions keep each kernel's contract on CPU by construction:

- every reduction is an explicit fixed order: a sequential loop over K inside a chunk, the
  pairwise tree across chunks, and `_tree_sum` (pairs (i, i + w/2), halving) over a last
  dimension zero-padded to a power of two. Padding with exact zeros leaves that tree's
  result unchanged, so it does not depend on the padded width, the number of rows, or how
  many masked keys a row has;
- everything else is elementwise and position-invariant on CPU. torch's CPU sigmoid, silu
  and gelu are not (their vectorised body and scalar tail round differently), so the
  activations are rebuilt from exp/erf/tanh, +, * and /, which are.

The CPU and GPU backends do not give the same bits as each other; each is invariant to batch
size, TP size and prefill/decode on its own.
"""

from __future__ import annotations

import math

import torch


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (i with i + w/2)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _chunk_tree(parts: torch.Tensor) -> torch.Tensor:
    """parts [C, ...] -> ((p0+p1)+(p2+p3))+... over the leading dim."""
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def _chunk_partials(a: torch.Tensor, b: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """[C, M, N] fp32 leaf values: inside each chunk, products added in ascending k."""
    m, n = a.shape[0], b.shape[1]
    k_pad = chunks * width
    a32 = torch.nn.functional.pad(a.float(), (0, k_pad - a.shape[1])).reshape(m, chunks, width).permute(1, 0, 2)
    b32 = torch.nn.functional.pad(b.float(), (0, 0, 0, k_pad - b.shape[0])).reshape(chunks, width, n)
    acc = torch.zeros((chunks, m, n), dtype=torch.float32)
    for k in range(width):
        acc += a32[:, :, k, None] * b32[:, None, k, :]  # a product, then an add: never fused
    return acc


def tree_matmul(a, b, bias=None, *, num_chunks: int, out_dtype=None) -> torch.Tensor:
    width = -(-a.shape[1] // num_chunks)
    root = _chunk_tree(_chunk_partials(a, b, num_chunks, width))
    if bias is not None:
        root = root + bias.float()
    return root.to(out_dtype or a.dtype)


def matmul_partial(a_shard, b_shard, *, tp_size: int, num_chunks: int) -> torch.Tensor:
    local = num_chunks // tp_size
    return _chunk_tree(_chunk_partials(a_shard, b_shard, local, a_shard.shape[1] // local))


def log_softmax(x: torch.Tensor, dim: int = -1, dtype=None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    h = x.movedim(dim, -1).to(out_dtype).float()
    if h.shape[-1] == 0:  # amax refuses an empty dim; there is nothing to normalise
        return h.to(out_dtype).movedim(-1, dim)
    z = h - h.amax(dim=-1, keepdim=True)
    out = z - torch.log(_tree_sum(torch.exp(z)))[..., None]
    return out.to(out_dtype).movedim(-1, dim)


def mean_last_dim(x: torch.Tensor, keepdim: bool = False, dtype=None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    mean = _tree_sum(x.to(acc)) / x.shape[-1]
    if keepdim:
        mean = mean[..., None]
    return mean.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             mean_sq: torch.Tensor | None = None):
    total = x if residual is None else residual + x.to(residual.dtype)
    h = total.float()
    h = h * torch.rsqrt((mean_last_dim(h.pow(2), keepdim=True) if mean_sq is None else mean_sq) + eps)
    out = weight * h.to(total.dtype)
    return out if residual is None else (out, total)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    # silu(), not torch's: torch's rounds an element by whether it falls in the vectorised body
    # or the scalar tail of a thread's range, which follows the batch's size and the strides.
    return silu(x[..., :d]) * x[..., d:]


def rope(positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """transformers' Qwen3RotaryEmbedding.forward + apply_rotary_pos_emb, op for op (on a GPU's
    tensors too: the GPU kernel's reference)."""
    pos = positions.reshape(1, 1, -1).float()
    freqs = (inv_freq.to(x.device)[None, :, None].float() @ pos).transpose(1, 2)[0]  # [tokens, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    heads = x.reshape(x.shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return ((heads * cos) + (rotated * sin)).reshape(x.shape)


def qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq, head_dim):
    """Each head of q and k through rms_norm, then rope: the two ops the kernel fuses."""
    def normed(x, w):
        return rms_norm(x.reshape(x.shape[0], -1, head_dim), w, eps).reshape(x.shape[0], -1)

    return (rope(positions, normed(q, q_weight), inv_freq, head_dim),
            rope(positions, normed(k, k_weight), inv_freq, head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor, op for op (the GPU kernel's reference)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


ROWS_PER_BLOCK = 128  # query rows per step: bounds the [B, H, rows, S] score block


def attention(q, k, v, *, start=None, end=None, scale=None) -> torch.Tensor:
    """Causal attention, queries aligned to end[b] (default: the end of the keys), keys before
    start[b] excluded.

    Rows are computed with their keys cut at end[b], rows of one end together, so the slots of a
    static KV cache past end[b] take no part in any sum (_tree_sum's shape follows the length).

    Keys are re-indexed from each sequence's first real key, scores are dot products in a fixed
    order over the head dim, and the softmax sums and P@V are `_tree_sum`s over the relative key
    axis where masked keys are exact zeros: a query's bits do not depend on the batch, the
    padding, the number of heads, or whether it is computed in a prefill or a decode step.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = (1.0 / math.sqrt(D)) if scale is None else scale
    start = torch.zeros(B, dtype=torch.long) if start is None else start.long().cpu()
    if end is not None and bool((end.cpu() != S).any()):
        end = end.long().cpu()
        out = torch.empty(q.shape, dtype=q.dtype)
        for e in end.unique().tolist():
            rows = (end == e).nonzero().flatten()
            out[rows] = attention(q[rows], k[rows, :, :e], v[rows, :, :e], start=start[rows], scale=scale)
        return out
    group = Hq // Hkv
    # Relative key index j of row b is absolute index start[b] + j.
    rel = start[:, None] + torch.arange(S)[None, :]
    valid_key = rel < S
    idx = rel.clamp(max=S - 1)[:, None, :, None].expand(B, Hkv, S, D)
    k_rel = torch.gather(k.float(), 2, idx).repeat_interleave(group, dim=1)
    v_rel = torch.gather(v.float(), 2, idx).repeat_interleave(group, dim=1)
    qf = q.float()
    # A key a query must not see gets weight 0, but 0 * inf is NaN: with a non-finite value in
    # such a key (a later query's), the masked products are zeroed, or the query's bits would
    # depend on the keys past its own position, i.e. on prefill versus decode.
    finite_v = bool(torch.isfinite(v_rel).all())
    out = torch.empty((B, Hq, T, D), dtype=torch.float32)
    for t0 in range(0, T, ROWS_PER_BLOCK):
        rows = torch.arange(t0, min(T, t0 + ROWS_PER_BLOCK))
        q_blk = qf[:, :, rows]  # [B, H, R, D]
        scores = torch.zeros((B, Hq, len(rows), S), dtype=torch.float32)
        for d in range(D):
            scores += q_blk[..., d, None] * k_rel[:, :, None, :, d]
        scores = scores * scale
        # Query t sits at absolute key index S - T + t, i.e. relative index S - T + t - start[b].
        q_rel = (S - T + rows)[None, :] - start[:, None]  # [B, R]
        allowed = (torch.arange(S)[None, None, :] <= q_rel[:, :, None]) & valid_key[:, None, :]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # rows with no key (padding)
        e = torch.exp(scores - peak)
        denom = _tree_sum(e)
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # a padding row attends to nothing: output 0
        hidden = None if finite_v else ~allowed[:, None]
        for d in range(D):
            # + 0.0: a sum of zeros is -0.0 or +0.0 depending on the padded width (+0.0 pads),
            # which follows S; the result must not, so a zero is always +0.0 (the GPU's too).
            terms = e * v_rel[:, :, None, :, d]
            if hidden is not None:
                terms = terms.masked_fill(hidden, 0.0)
            out[:, :, rows, d] = (_tree_sum(terms) + 0.0) / denom
    return out.to(q.dtype)
