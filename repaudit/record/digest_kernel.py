"""The row digest of digest.py as one Triton kernel, for tensors on a GPU.

The torch version builds the digest from about a dozen int64 element-wise kernels; under
`--trace` that runs for every module at every forward, and on a GPU the launches, not the
arithmetic, were the cost (9-13x the untraced run time on H200). Here one program hashes one
row: it reads the row's bits once, makes the per-feature keys in registers and sums in uint64,
which wraps mod 2^64 exactly as the torch and NumPy versions do, so all three give the same bits
(tests/test_digest_kernel.py). It can also pick the few sampled features the tracer keeps, in
the same launch, and reads only the rows asked for, so the caller never gathers them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tbik.tl.launcher import CachedKernel

from .digest_params import GOLDEN, M1, M2, SEED

BASE = (SEED + GOLDEN) % (1 << 64)
assert (M1, M2) == (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # the literals in mix below
INT_VIEW = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
             torch.float16: (torch.int16, 0xFFFF)}


@triton.jit
def mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _digest_rows_kernel(x_ptr, rows_ptr, stride, n_feat, offset, base, mask,
                        pick_ptr, owned_ptr, digest_ptr, sample_ptr,
                        BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
    r = tl.program_id(0)
    row_ptr = x_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for start in range(0, n_feat, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < n_feat
        # Loaded through an integer view of the row: the bits are the value, no float is formed.
        bits = (tl.load(row_ptr + i, mask=live, other=0).to(tl.int64) & mask).to(tl.uint64)
        key = mix((i + offset).to(tl.uint64) + base)
        acc += tl.where(live, mix(bits ^ key), 0)
    tl.store(digest_ptr + r, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))
    if SAMPLES > 0:
        s = tl.arange(0, SAMPLES)
        picked = tl.load(row_ptr + tl.load(pick_ptr + s)).to(tl.int64) & mask
        tl.store(sample_ptr + r * SAMPLES + s, (picked * tl.load(owned_ptr + s)).to(tl.int32))


# A traced forward launches this once per module (hundreds): Triton's own launch path binds and
# specializes every argument in Python each time, which cost more than the kernel.
_digest_rows = CachedKernel(_digest_rows_kernel)


def digest_rows(x: torch.Tensor, rows: torch.Tensor | None = None, offset: int = 0,
                pick: torch.Tensor | None = None, owned: torch.Tensor | None = None):
    """Digests of rows `rows` of the 2-D float tensor x -> int64 [n] (uint64 bits), and, with
    `pick`/`owned`, the bits of x[rows][:, pick] * owned -> int32 [n, len(pick)] (a float32's
    bits as they are, a 16-bit float's zero-extended)."""
    view, mask = INT_VIEW[x.dtype]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    n = rows.numel()
    digests = torch.empty(n, dtype=torch.int64, device=x.device)
    samples_n = 0 if pick is None else pick.numel()
    samples = torch.empty((n, samples_n), dtype=torch.int32, device=x.device)
    if n:
        _digest_rows((n,), (x.view(view), rows, x.stride(0), x.shape[1], offset, BASE, mask,
                            pick if samples_n else digests, owned if samples_n else digests, digests, samples),
                     {"BLOCK": min(1024, triton.next_power_of_2(x.shape[1])), "SAMPLES": samples_n})
    return digests, samples
