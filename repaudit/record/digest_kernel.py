"""The row digest of digest.py as one Triton kernel, for tensors on a GPU.

The torch version builds the digest from about a dozen int64 element-wise kernels; under
`--trace` that runs for every module at every forward, and on a GPU the launches, not the
arithmetic, were the cost (9-13x the untraced run time on H200). Here one program hashes one
row or a few: it reads the rows' bits once, makes the per-feature keys in registers and sums in
uint64, which wraps mod 2^64 exactly as the torch and NumPy versions do, so all three give the same bits
(tests/test_digest_kernel.py). It can also pick the few sampled features the tracer keeps, in
the same launch, and reads only the rows asked for, so the caller never gathers them first.

digest_many does the same for many tensors in one launch, from a table of their addresses: a
traced decode step's hundreds of outputs of a few rows each, where one launch a tensor cost
more than the hashing.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from tbik.tl.launcher import CachedKernel

from .digest_params import GOLDEN, M1, M2, SEED, TABLE_MAX_ROWS

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
def _terms(loaded, i, live, offset, base, mask):
    """Each feature's term of the digest, mix(bits ^ key(global index)), 0 past the row's end.
    `loaded` is read through an integer view of the row: the bits are the value, no float is
    formed. i and live [BLOCK]; loaded [BLOCK] or [ROWS, BLOCK], the keys made once for all rows."""
    key = mix((i + offset).to(tl.uint64) + base)
    bits = (loaded.to(tl.int64) & mask).to(tl.uint64)
    return tl.where(live, mix(bits ^ key), 0)


@triton.jit
def _digest_rows_kernel(x_ptr, rows_ptr, n_rows, stride, n_feat, offset, base, mask,
                        pick_ptr, owned_ptr, digest_ptr, sample_ptr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
    # ROWS rows a program: a feature's key (half of the integer work, which bounds this kernel)
    # is made once for all of them. The sums are mod 2^64, so no grouping changes a bit.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    here = r < n_rows
    row_ptr = x_ptr + tl.load(rows_ptr + r, mask=here, other=0).to(tl.int64) * stride  # [ROWS]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.uint64)
    for start in range(0, n_feat, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < n_feat
        acc += _terms(tl.load(row_ptr[:, None] + i[None, :], mask=here[:, None] & live[None, :], other=0),
                      i[None, :], live[None, :], offset, base, mask)
    tl.store(digest_ptr + r, tl.sum(acc, axis=1).to(tl.int64, bitcast=True), mask=here)
    if SAMPLES > 0:
        s = tl.arange(0, SAMPLES)
        at = here[:, None]
        picked = tl.load(row_ptr[:, None] + tl.load(pick_ptr + s)[None, :], mask=at, other=0).to(tl.int64) & mask
        tl.store(sample_ptr + r[:, None] * SAMPLES + s[None, :], (picked * tl.load(owned_ptr + s)[None, :]).to(tl.int32),
                 mask=at)


# A traced forward launches this once per module (hundreds): Triton's own launch path binds and
# specializes every argument in Python each time, which cost more than the kernel.
_digest_rows = CachedKernel(_digest_rows_kernel)


def digest_rows(x: torch.Tensor, rows: torch.Tensor | None = None, offset: int = 0,
                pick: torch.Tensor | None = None, owned: torch.Tensor | None = None, per_program: int | None = None):
    """Digests of rows `rows` of the 2-D float tensor x -> int64 [n] (uint64 bits), and, with
    `pick`/`owned`, the bits of x[rows][:, pick] * owned -> int32 [n, len(pick)] (a float32's
    bits as they are, a 16-bit float's zero-extended). `per_program` (1 or 4; tests) forces how
    many rows a program takes, which never changes a bit."""
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
        # A decode step's few rows keep a program each (more programs, less latency); a
        # prefill's thousands share keys four rows at a time.
        per = per_program or (4 if n >= 1024 else 1)
        _digest_rows((triton.cdiv(n, per),), (x.view(view), rows, n, x.stride(0), x.shape[1], offset, BASE, mask,
                                              pick if samples_n else digests, owned if samples_n else digests, digests,
                                              samples),
                     {"ROWS": per, "BLOCK": min(1024 // per, triton.next_power_of_2(x.shape[1])), "SAMPLES": samples_n})
    return digests, samples


_TABLE_BLOCK = 1024  # fixed, so that every table of a dtype takes the one binary built before a capture


@triton.jit
def _digest_table_kernel(table_ptr, rows_ptr, n_rows, base, mask, digest_ptr, sample_ptr,
                         WIDE: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
    # One program: one row of one tensor of the table; the arithmetic of _digest_rows_kernel.
    # A table row, six int64: the tensor's address, its row stride and feature count (elements),
    # the global index of its first feature, and the addresses of its pick and owned vectors.
    e = tl.program_id(0)
    r = tl.program_id(1)
    entry = table_ptr + e * 6
    if WIDE:
        x_ptr = tl.load(entry).to(tl.pointer_type(tl.int32))
    else:
        x_ptr = tl.load(entry).to(tl.pointer_type(tl.int16))
    stride = tl.load(entry + 1)
    n_feat = tl.load(entry + 2)
    offset = tl.load(entry + 3)
    row_ptr = x_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for start in range(0, n_feat, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < n_feat
        acc += _terms(tl.load(row_ptr + i, mask=live, other=0), i, live, offset, base, mask)
    out = e.to(tl.int64) * n_rows + r
    tl.store(digest_ptr + out, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))
    if SAMPLES > 0:
        s = tl.arange(0, SAMPLES)
        pick = tl.load(entry + 4).to(tl.pointer_type(tl.int64))
        owned = tl.load(entry + 5).to(tl.pointer_type(tl.int64))
        picked = tl.load(row_ptr + tl.load(pick + s)).to(tl.int64) & mask
        tl.store(sample_ptr + out * SAMPLES + s, (picked * tl.load(owned + s)).to(tl.int32))


_digest_table = CachedKernel(_digest_table_kernel)


def digest_many(xs: list[torch.Tensor], rows: torch.Tensor, offsets: list[int], picks: list[torch.Tensor],
                owneds: list[torch.Tensor], table_for=None):
    """digest_rows(x, rows, offset, pick, owned) for every x of `xs` (2-D, unit feature stride,
    any dtype digest_rows takes), one launch per element width. Returns the per-tensor answers
    (views into one output per width) and the device tables, which the caller keeps as long as
    a graph that replays the launch lives.

    The tables hold addresses, so a launch reads its tensors wherever they are, as long as they
    are not freed or rewritten before it runs. `table_for(host)` gives the device tensor that
    will hold a host table (int64 [tensors, 6]) when the launch runs; by default a copy made
    now, through page-locked memory on a GPU (from pageable memory torch waits for the device
    to finish all it was given). Inside a CUDA graph capture a host-to-device copy cannot be
    captured, and a table allocated in the capture would share memory the graph's earlier
    kernels write on every replay: the caller then hands out space allocated before the capture
    and fills it after.
    """
    n = rows.numel()
    if n > TABLE_MAX_ROWS:
        raise ValueError(f"digest_many takes at most {TABLE_MAX_ROWS} rows (the grid's second axis), got {n}")
    device = rows.device
    answers: list = [None] * len(xs)
    tables = []
    samples_n = picks[0].numel() if picks else 0
    for wide in (False, True):
        idx = [i for i, x in enumerate(xs) if (x.element_size() == 4) == wide]
        if not idx:
            continue
        for i in idx:
            if xs[i].dim() != 2 or xs[i].stride(1) != 1 or xs[i].dtype not in INT_VIEW:
                raise ValueError(f"digest_many takes 2-D float rows with unit feature stride, got {xs[i].dtype} "
                                 f"{tuple(xs[i].shape)} strides {xs[i].stride()}")
        host = torch.from_numpy(np.array([[xs[i].data_ptr(), xs[i].stride(0), xs[i].shape[1], offsets[i],
                                            picks[i].data_ptr(), owneds[i].data_ptr()] for i in idx], dtype=np.int64))
        if table_for is not None:
            table = table_for(host)
        elif device.type == "cuda":
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host.to(device)
        tables.append(table)
        digests = torch.empty((len(idx), n), dtype=torch.int64, device=device)
        samples = torch.empty((len(idx), n, samples_n), dtype=torch.int32, device=device)
        if n:
            _digest_table((len(idx), n), (table, rows, n, BASE, INT_VIEW[xs[idx[0]].dtype][1], digests, samples),
                          {"WIDE": wide, "BLOCK": _TABLE_BLOCK, "SAMPLES": samples_n})
        for j, i in enumerate(idx):
            answers[i] = (digests[j], samples[j])
    return answers, tables
