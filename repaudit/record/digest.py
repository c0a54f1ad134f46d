"""Row digest: a 64-bit hash of a full float32 logits row, computed where the logits live.

digest(row) = sum_i mix(bits(row[i]) XOR key(i))  (mod 2^64)

Addition mod 2^64 is associative and commutative, so the digest does not depend on the
reduction order the device picks: the same bits give the same digest on any GPU, on the
CPU, at any batch size. `mix` is the splitmix64 finaliser, so one flipped bit anywhere in
the row changes the digest. `numpy_row_digest` is an independent uint64 reference.
"""

from __future__ import annotations

import numpy as np

from .digest_params import GOLDEN, M1, M2, SEED


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# ----------------------------------------------------------------------------- numpy reference


def _np_mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
    return z ^ (z >> np.uint64(31))


def _np_keys(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _np_mix(np.arange(n, dtype=np.uint64) + np.uint64(SEED) + np.uint64(GOLDEN))


def numpy_row_digest(rows: np.ndarray) -> np.ndarray:
    """Reference digest of float32 rows [..., V] -> uint64 [...]."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    with np.errstate(over="ignore"):
        return _np_mix(bits ^ _np_keys(rows.shape[-1])).sum(axis=-1, dtype=np.uint64)


# ----------------------------------------------------------------------------- torch


_KEY_CACHE: dict = {}


def _lsr(torch, z, s: int):
    # torch's >> on int64 is arithmetic; mask off the copied sign bits for a logical shift
    return (z >> s) & ((1 << (64 - s)) - 1)


def _torch_mix(torch, z):
    z = (z ^ _lsr(torch, z, 30)) * _signed(M1)
    z = (z ^ _lsr(torch, z, 27)) * _signed(M2)
    return z ^ _lsr(torch, z, 31)


def _torch_keys(torch, n: int, device, offset: int = 0):
    key = (n, offset, str(device))
    if key not in _KEY_CACHE:
        base = torch.arange(offset, offset + n, dtype=torch.int64, device=device) + _signed((SEED + GOLDEN) % (1 << 64))
        _KEY_CACHE[key] = _torch_mix(torch, base)
    return _KEY_CACHE[key]


def row_digest(rows, rows_per_chunk: int = 64, offset: int = 0):
    """Digest of each row of a float tensor [..., F] -> int64 tensor [...] (same bits as uint64).

    float32 rows hash their 32-bit patterns, bfloat16/float16 rows their 16-bit patterns.
    `offset` is the global index of the first column: a row sharded by columns across ranks
    hashes to partial digests whose sum (mod 2^64) is the digest of the whole row.
    """
    import torch

    widths = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF), torch.float16: (torch.int16, 0xFFFF)}
    if rows.dtype not in widths:
        raise TypeError(f"row_digest hashes float32, bfloat16 or float16 rows, got {rows.dtype}")
    view, mask = widths[rows.dtype]
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.is_cuda:
        from .digest_kernel import digest_rows

        return digest_rows(flat, offset=offset)[0].reshape(rows.shape[:-1])
    keys = _torch_keys(torch, flat.shape[-1], flat.device, offset)
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[0], rows_per_chunk):
        block = flat[start : start + rows_per_chunk]
        bits = block.contiguous().view(view).to(torch.int64) & mask
        out[start : start + rows_per_chunk] = _torch_mix(torch, bits ^ keys).sum(dim=-1)
    return out.reshape(rows.shape[:-1])


def to_uint64(digests) -> np.ndarray:
    """int64 torch digests -> uint64 numpy (bit-preserving)."""
    return digests.detach().cpu().numpy().view(np.uint64)
