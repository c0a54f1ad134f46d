"""Tree all-reduce: the P fp32 partials added in one pairwise order, the same on every rank.

NCCL's all-reduce picks ring or tree algorithms, channel counts and chunkings from the message
size and the topology, so its summation order (and the bits) can change with P, the message
size and the NCCL version, and ranks are not promised identical bits. Here the partials are
added in the fixed order ((p0+p1)+(p2+p3))+..., which is also the top of the TBIK matmul tree,
by one of two algorithms that give the same bits:

- "gather": every rank gathers all P partials (one all-gather, a pure copy) and adds them
  itself. One collective; each rank receives (P-1) x the message.
- "halving": recursive halving, then an all-gather (Rabenseifner's all-reduce). At level k a
  rank and its partner rank ^ 2^k swap halves of the segment they hold and each adds the half
  it keeps: partners at level k hold the trees of 2^k neighbouring ranks, so level by level the
  sums are exactly the pairwise tree's (fp32 addition is commutative, so which side adds does
  not matter). Each rank then holds the finished tree of 1/P of the message, and an all-gather
  (a copy) gives everyone the whole. 2 log2(P) steps; each rank sends and receives 2(P-1)/P x
  the message, as a ring all-reduce does, where "gather" moves (P-1) x.
- "pair" (P=2 only): the collective's own sum. The tree of two partials is one addition, and
  fp32 addition is commutative and correctly rounded, so any all-reduce that adds the two
  partials once gives p0 + p1 on both ranks, whatever ring, tree, protocol or channel count it
  picks: one NCCL all-reduce, no gather, no extra kernel.
"auto" (the default) takes "pair" at P=2 and "gather" above.
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
        if partials.dim() == 0:
            raise ValueError("tree_sum needs the partials stacked on dim 0, got a 0-d tensor")
        stacked = partials
        count = stacked.shape[0]
    else:
        count = len(partials)
    _check_power_of_two(count, "the number of partials")
    if not isinstance(partials, torch.Tensor):
        # torch's adds would broadcast or promote them without a word
        p0 = partials[0]
        for p in partials[1:]:
            if p.shape != p0.shape or p.device != p0.device:
                raise ValueError(f"partials must share a shape and device, got {tuple(p0.shape)} on {p0.device} "
                                 f"and {tuple(p.shape)} on {p.device}")
            if p.dtype != p0.dtype:
                raise TypeError(f"partials must share a dtype, got {p0.dtype} and {p.dtype}")
    first = stacked if isinstance(partials, torch.Tensor) else partials[0]
    if backend.on_cpu(first):
        return _tree_sum_torch(list(stacked.unbind(0)) if isinstance(partials, torch.Tensor) else partials)
    from .tl import allreduce

    return allreduce.tree_sum(stacked if isinstance(partials, torch.Tensor) else torch.stack(list(partials)))


ALGORITHMS = ("gather", "halving", "pair")


def tree_all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None = None,
                    algorithm: str = "auto") -> torch.Tensor:
    """All-reduce over `group` whose result is the pairwise tree over ranks in rank order.

    Every rank returns identical bits: for P=4, (p0+p1)+(p2+p3), whichever `algorithm` (module
    doc). P must be a power of two. Works with gloo (CPU tensors) and NCCL (CUDA tensors).
    Returns a new tensor; `partial` is left as it is.
    """
    if algorithm not in ALGORITHMS + ("auto",):
        raise ValueError(f"unknown tree all-reduce algorithm {algorithm!r}: auto or one of {', '.join(ALGORITHMS)}")
    world = dist.get_world_size(group)
    _check_power_of_two(world, "the process group size")
    x = partial.contiguous()
    if world == 1:
        return x.clone()
    if algorithm == "auto":
        algorithm = "pair" if world == 2 else "gather"
    if algorithm == "pair":
        if world != 2:
            raise ValueError(f"the pair algorithm adds two partials; this group has {world} ranks")
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out
    if algorithm == "halving":
        return _halving(x.reshape(-1), world, group).view(x.shape)
    # Flat buffers: gloo and NCCL both accept a 1-D output of world * numel elements.
    gathered = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather(gathered, x.reshape(-1), group=group)
    return tree_sum(gathered.view(world, *x.shape))


def _halving(flat: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    rank = dist.get_rank(group)
    n = flat.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world, dtype=flat.dtype, device=flat.device)  # padded to P equal chunks
    buf[:n] = flat
    lo, hi = 0, buf.numel()
    for level in range(world.bit_length() - 1):
        bit = 1 << level
        peer = rank ^ bit
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & bit else ((lo, mid), (mid, hi))
        received = torch.empty(mid - lo, dtype=buf.dtype, device=buf.device)
        to = dist.get_global_rank(group, peer) if group is not None else peer
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf[give[0]:give[1]], to, group),
                                               dist.P2POp(dist.irecv, received, to, group)]):
            request.wait()
        buf[keep[0]:keep[1]] += received
        lo, hi = keep
    # Rank r now holds the finished tree of segment bit_reverse(r): at level k, bit k of r chose
    # the upper or lower half, so the first level's choice is the segment index's highest bit.
    gathered = torch.empty_like(buf)
    _all_gather(gathered, buf[lo:hi].contiguous(), group=group)
    # Views put back in order, not a list index: that would copy the index from the host, which
    # a CUDA graph cannot capture.
    segments = gathered.view(world, chunk)
    return torch.cat([segments[_bit_reverse(s, world.bit_length() - 1)] for s in range(world)])[:n]


def _bit_reverse(value: int, bits: int) -> int:
    return int(format(value, f"0{bits}b")[::-1], 2) if bits else 0
