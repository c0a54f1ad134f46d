"""Tree all-reduce: the P fp32 partials added in one pairwise order, the same on every rank.

NCCL's all-reduce picks ring or tree algorithms, channel counts and chunkings from the message
size and the topology, so its summation order (and the bits) can change with P, the message
size and the NCCL version, and ranks are not promised identical bits. Here every rank gathers
all P partials (all_gather_into_tensor, a pure copy) and adds them itself in the fixed order
((p0+p1)+(p2+p3))+..., which is also the top of the TBIK matmul tree.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import backend

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_power_of_two(p: int, what: str) -> None:
    if p < 1 or p & (p - 1):
        raise ValueError(f"{what} must be a power of two (1, 2, 4, 8, ...), got {p}")


def _tree_sum_torch(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0].clone()
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def tree_sum(partials: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Pairwise tree sum in index order: ((p0+p1)+(p2+p3))+... (single-process reference).

    `partials` is a list of same-shaped tensors or one tensor stacked on dim 0; their number
    must be a power of two. On a GPU one fused Triton kernel does all levels; on the CPU torch
    adds do. fp32 addition is correctly rounded either way, so both give the same bits.
    """
    if isinstance(partials, torch.Tensor):
        stacked = partials
        count = stacked.shape[0]
    else:
        count = len(partials)
    _check_power_of_two(count, "the number of partials")
    first = stacked if isinstance(partials, torch.Tensor) else partials[0]
    if backend.on_cpu(first):
        return _tree_sum_torch(list(stacked.unbind(0)) if isinstance(partials, torch.Tensor) else partials)
    from .tl import allreduce

    return allreduce.tree_sum(stacked if isinstance(partials, torch.Tensor) else torch.stack(list(partials)))


def tree_all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce over `group` whose result is the pairwise tree over ranks in rank order.

    Every rank returns identical bits: for P=4, (p0+p1)+(p2+p3). P must be a power of two.
    Works with gloo (CPU tensors) and NCCL (CUDA tensors). Returns a new tensor; `partial`
    is left as it is.
    """
    world = dist.get_world_size(group)
    _check_power_of_two(world, "the process group size")
    x = partial.contiguous()
    if world == 1:
        return x.clone()
    # Flat buffers: gloo and NCCL both accept a 1-D output of world * numel elements.
    gathered = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather(gathered, x.reshape(-1), group=group)
    return tree_sum(gathered.view(world, *x.shape))
