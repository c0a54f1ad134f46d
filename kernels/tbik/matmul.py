"""Tree matmul: C = A @ B with one fixed summation order over K for every TP size and batch size.

The operands are checked here and the backend picked (backend.py); the order and the kernel that
keeps it are described in tl/matmul.py, the CPU backend's version of it in cpu.py.
"""

from __future__ import annotations

import torch

from . import backend, cpu

NUM_CHUNKS = 8
SUPPORTED_CHUNKS = (8, 16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the tree matmul computes in


def _check_chunks(num_chunks: int) -> None:
    if num_chunks != 1 and num_chunks not in SUPPORTED_CHUNKS:
        raise ValueError(f"num_chunks must be 1 or one of {SUPPORTED_CHUNKS}, got {num_chunks}")


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.dtype not in DTYPES:  # the CPU backend would run them in fp32 and cast back
        raise TypeError(f"tbik matmul supports bfloat16, float16 and float32, not {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")


def tree_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                num_chunks: int = NUM_CHUNKS, out_dtype: torch.dtype | None = None,
                _split: int | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) with the TBIK summation order; any strides.

    K is cut into `num_chunks` chunks of width ceil(K / num_chunks); when K is not a multiple,
    the last chunk is short and any chunk starting past K is empty (adds +0.0). num_chunks=1
    is a plain fixed-tile batch-invariant matmul. The result is cast once to `out_dtype`
    (default a.dtype) after the fp32 bias add. `_split` forces the execution strategy (tests).
    """
    _check_chunks(num_chunks)
    _check_operands(a, b)
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        # Every leaf is empty (+0.0), and the bias joins that root: a -0.0 bias gives +0.0.
        root = torch.zeros(m, n, device=a.device)
        return out.copy_(root + bias.float() if bias is not None else root)
    if backend.on_cpu(a):
        return out.copy_(cpu.tree_matmul(a, b, bias, num_chunks=num_chunks, out_dtype=out.dtype))
    if bias is not None:
        bias = bias.contiguous()
    from .tl.matmul import launch

    return launch(a, b, bias, out, k, num_chunks, -(-k // num_chunks), _split)


def matmul_partial(a_shard: torch.Tensor, b_shard: torch.Tensor, *, tp_size: int,
                   num_chunks: int = NUM_CHUNKS, _split: int | None = None) -> torch.Tensor:
    """fp32 partial of a rank's contiguous K shard: the root of its num_chunks/tp_size leaves.

    a_shard [M, K/tp_size], b_shard [K/tp_size, N]. The full K must be a multiple of
    num_chunks, so every rank sees the leaves TP=1 sees. Combining the tp_size partials with
    `tree_sum`/`tree_all_reduce` in rank order gives tree_matmul's fp32 result bit for bit.
    """
    _check_chunks(num_chunks)
    if tp_size < 1 or tp_size & (tp_size - 1) or tp_size > num_chunks:
        raise ValueError(f"tp_size must be a power of two <= num_chunks={num_chunks}, got {tp_size}")
    _check_operands(a_shard, b_shard)
    m, k_local = a_shard.shape
    n = b_shard.shape[1]
    leaves = num_chunks // tp_size
    if k_local % leaves:
        raise ValueError(f"the K shard ({k_local}) must hold {leaves} whole chunks: "
                         f"full K must be a multiple of num_chunks={num_chunks}")
    out = torch.empty((m, n), dtype=torch.float32, device=a_shard.device)
    if m == 0 or n == 0:
        return out
    if k_local == 0:
        return out.zero_()
    if backend.on_cpu(a_shard):
        return cpu.matmul_partial(a_shard, b_shard, tp_size=tp_size, num_chunks=num_chunks)
    from .tl.matmul import launch

    return launch(a_shard, b_shard, None, out, k_local, leaves, k_local // leaves, _split)
