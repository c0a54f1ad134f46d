"""The tree sum's Triton kernel: all P partials added level by level in one program per slab."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import CachedKernel

_SUM_BLOCK = 1024


@triton.jit
def _tree_sum_kernel(x_ptr, out_ptr, numel, P: tl.constexpr, LOG_P: tl.constexpr, BLOCK: tl.constexpr):
    # x is [P, numel]; each program loads a [BLOCK, P] slab and halves P level by level,
    # adding neighbours (2i, 2i+1): exactly the pairwise tree in rank order.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ranks = tl.arange(0, P).to(tl.int64)
    vals = tl.load(x_ptr + ranks[None, :] * numel + offs[:, None], mask=mask[:, None], other=0.0)
    for lvl in tl.static_range(LOG_P):
        pairs = tl.reshape(vals, (BLOCK, P >> (lvl + 1), 2))
        left, right = tl.split(pairs)
        vals = left + right
    tl.store(out_ptr + offs, tl.reshape(vals, (BLOCK,)), mask=mask)


# Triton's own launch binds every argument in Python, some 25 us a call: as much as NCCL's whole
# all-gather of a decode step's partials, which the sum follows.
_kernel = CachedKernel(_tree_sum_kernel)


def tree_sum(stacked: torch.Tensor) -> torch.Tensor:
    p = stacked.shape[0]
    flat = stacked.reshape(p, -1).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    numel = flat.shape[1]
    if numel:
        grid = (triton.cdiv(numel, _SUM_BLOCK),)
        _kernel(grid, (flat, out, numel), dict(P=p, LOG_P=p.bit_length() - 1, BLOCK=_SUM_BLOCK, num_warps=4))
    return out
