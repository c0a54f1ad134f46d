"""The values a record keeps of one logits row: the token's logprob, the top-1, the top-k list and
the row digest, from the row's fp32 logits and its log-softmax.

The top-k is defined, not left to a library: the k largest logprobs, equal logprobs by lowest
token id, so the same row gives the same list on every device (torch.topk keeps whichever tied
entries its kernel meets first at the k-th place). A NaN counts as larger than every number,
-0.0 as equal to +0.0. The top-1 is the list's first entry: the lowest id among the largest
logprobs, torch.argmax's answer.

On a GPU Triton kernels make all of them from two reads of each row (row_values_kernel.py), the
digest's read being the fp32 cast's own where widen makes the fp32 rows:
torch.topk's radix passes, argmax and the digest were about 4 of the 5 extra passes over the
logits that made a scored token cost more than the model's forward. Elsewhere, torch ops with
the same definition (the reference the kernel is tested against).
"""

from __future__ import annotations

import torch

from ..record.digest import row_digest


def order_keys(lp: torch.Tensor) -> torch.Tensor:
    """fp32 values -> int32 keys in the order defined above (the kernel's _order_key)."""
    bits = lp.contiguous().view(torch.int32)
    bits = torch.where(bits == torch.iinfo(torch.int32).min, 0, bits)  # -0.0 as +0.0
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return torch.where(torch.isnan(lp), torch.iinfo(torch.int32).max, keys)


def reference_topk(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest logprobs of each row of lp [n, V] fp32, equal values by
    lowest id: torch.topk of one int64 key per entry, (order key, reversed id), which no two
    entries share."""
    vocab = lp.shape[-1]
    rank = order_keys(lp).to(torch.int64) * (1 << 32) + (vocab - 1 - torch.arange(vocab, device=lp.device))
    ids = torch.topk(rank, k, dim=-1).indices
    return lp.gather(1, ids), ids


def _widened_on_gpu(raw: torch.Tensor) -> bool:
    return raw.is_cuda and raw.dtype in (torch.bfloat16, torch.float16) and raw.dim() == 2 and type(raw) is torch.Tensor


def widen_parts(raw: torch.Tensor, rows: int | None = None) -> torch.Tensor | None:
    """A buffer for the digest partials of `rows` (default: all) rows like raw's, where widen
    takes them (16-bit logits on a GPU); None where row_values hashes the fp32 rows itself."""
    if not _widened_on_gpu(raw):
        return None
    from .row_values_kernel import digest_parts

    return digest_parts(raw.shape[0] if rows is None else rows, raw.shape[-1], raw.device)


def widen(raw: torch.Tensor, out: torch.Tensor, parts: torch.Tensor | None) -> None:
    """out <- raw.float() (an exact cast: the same bits). With `parts` from widen_parts, the
    rows' digest partials are taken on the way, for row_values, which then skips its own pass
    over the fp32 rows."""
    if parts is None:
        out.copy_(raw)
        return
    from .row_values_kernel import widen_gpu

    widen_gpu(raw, out, parts)


def top_ids(logits: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 1 + k] int64: each row's own id (first [n, 1]: the sampled one), then the ids of the
    row's k largest logits [n, V] in the order defined above (vLLM's capture of a step's
    candidates: vllm_capture)."""
    first = first.reshape(-1, 1).to(torch.int64)
    if k == 0:
        return first
    if logits.is_cuda and logits.dim() == 2 and type(logits) is torch.Tensor:
        from .row_values_kernel import MAX_K, top_ids_gpu

        if k <= MAX_K:
            return top_ids_gpu(logits, first, k)
    return torch.cat((first, reference_topk(logits.float(), k)[1]), dim=1)


def row_values(logits: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor, topk: int,
               parts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rows of fp32 logits [n, V], their log-softmax [n, V] and the n recorded tokens ->
    logprob [n], top1 [n], digest [n] (int64 holding the uint64), and with topk > 0
    topk_lp [n, topk], topk_ids [n, topk] in the list's order. `parts`: the logits' digest
    partials, where widen took them."""
    if lp.dtype != torch.float32:
        raise TypeError(f"row values are taken from fp32 logprobs, got {lp.dtype}")
    if not 0 <= topk <= lp.shape[-1]:
        raise ValueError(f"top-{topk} of a {lp.shape[-1]}-token vocabulary")
    if lp.is_cuda and lp.shape[0]:
        from .row_values_kernel import MAX_K, row_values_gpu

        out = row_values_gpu(logits, lp, targets, topk if topk <= MAX_K else 0, parts)
        if topk > MAX_K:
            out["topk_lp"], out["topk_ids"] = reference_topk(lp, topk)
        return out
    values, ids = reference_topk(lp, max(topk, 1))
    out = {"logprob": lp.gather(1, targets[:, None])[:, 0], "top1": ids[:, 0], "digest": row_digest(logits)}
    if topk:
        out["topk_lp"], out["topk_ids"] = values, ids
    return out
