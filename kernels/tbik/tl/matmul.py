"""Tree matmul: C = A @ B with one fixed summation order over K for every TP size and batch size.

K is cut into `num_chunks` contiguous chunks (the leaves). Inside a leaf, one fp32 accumulator
takes the BLOCK_K tiles in ascending order (`tl.dot` into the same accumulator). The leaf
results are combined in one complete binary tree, ((c0+c1)+(c2+c3))+((c4+c5)+(c6+c7)). A
TP=P rank owns num_chunks/P consecutive leaves, i.e. one subtree, so its fp32 partial is bit
for bit the node that TP=1 computes there; `tree_all_reduce` then rebuilds the top of the tree.

One kernel serves every case. A launch owns LEAVES consecutive leaves (num_chunks for
`tree_matmul`, num_chunks/P for `matmul_partial`). A *work unit* is one output tile times
LEAVES/SPLIT consecutive leaves:
  * SPLIT == 1 (large M): a unit holds the whole subtree; the pending left siblings of the tree
    live in registers (the lowest REG_LEVELS levels) and in a small per-program scratch (the
    levels above), so the tree costs no extra pass over memory.
  * SPLIT > 1 (small M, too few output tiles to fill the GPU): SPLIT programs each reduce their
    own subtree, write it to a workspace, and the last one to arrive (atomic ticket) adds the
    SPLIT subtree roots in the same pairwise order and writes the output.
Operands whose rows run along K (A [M, K] and B^T [N, K], 16-byte aligned) load through TMA
tensor descriptors, others through pointers: the same tiles either way.
Both strategies run the same dot instructions on the same tiles and the same fp32 additions in
the same tree, so the choice (made from M, N and the GPU size) never changes a bit; the tests
check this for every SPLIT. On Hopper a third strategy takes the large-M case: matmul_ws.py, a
warp-specialized Gluon kernel with 128x128 tiles (one TMA producer warp, two MMA warpgroups),
again the same k16 MMA steps per leaf and the same tree.

What decides the bits is only the leaves (chunk width), the k16 MMA steps inside a leaf and the
tree: a row's result must not depend on how many rows come with it (batch invariance), a
column's not on how many columns the rank holds (column-parallel shards), a leaf's not on how
many leaves the rank holds (row-parallel shards). The tile shape does not enter: a tile's
output element is the same chain of k16 MMA steps whatever the tile's width, height or BLOCK_K
(every sweep of reports/kernels/ found one set of bits for all the configurations it timed). So
the tile may follow M: few rows (decode) take narrower tiles, which give the same weights more
programs to stream them (see _FEW_ROWS); tests/test_tbik_gpu.py checks rows across the switch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launcher import CachedKernel, num_sms

# Per input dtype; BLOCK_K shrinks for chunks narrower than it (see _config). REG_LEVELS is how
# many of the lowest tree levels keep their pending left sibling in registers (higher levels go
# through a small per-program fp32 scratch). Each one costs a full fp32 tile of registers: a
# 64x128 tile over 8 warps holds acc + 2 pending tiles without spilling, while 128x128 tiles
# spill even with the pending tiles in scratch (ptxas -v for sm_90a). BLOCK_K=128 halves the
# barriers per K step against 64 (+14% on the H100 sweep, reports/kernels/run2/sweep.md).
# TMA: K-contiguous operands load through tensor descriptors (no per-thread address
# registers), which leaves room for a fourth stage: +8% at M >= 128, +25% at M <= 32 against
# pointer loads on the H200 sweep (reports/engine/h200x2-lanes/lane0.log). Other layouts keep
# the pointer loads; both give the same bits.
_CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, REG_LEVELS=2, TMA=True),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, REG_LEVELS=2, TMA=True),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3, REG_LEVELS=2, TMA=False),
}
# Few rows (a decode step): (most rows, configuration), narrowest tile first; the first whose
# rows fit and whose tiles fit one wave (one per SM) is taken, else _CONFIGS'. 64 rows is one
# wgmma height, so narrower tiles are the only way to more programs: a 1,024-wide projection
# has 32 tiles 32 wide instead of 8 before any K split. More tiles than SMs would run a second
# wave (gate/up, 6,144 wide: 10.7 us at 32 rows with 32-wide tiles, 8.8 with 128-wide).
# CUDA-graph sweep on Qwen3-0.6B's linear shapes (reports/kernels/h200-small-m/call3-final):
# q/k/v/o/down at 32 rows 4.9-7.1 us against 7.1-8.1 us with 64x128 tiles, at 256 rows 7.0-9.3
# against 9.9-12.4 us. Same bits: see the module docstring.
_FEW_ROWS = {
    dtype: ((64, dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, REG_LEVELS=2, TMA=True)),
            (256, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, REG_LEVELS=2, TMA=True)))
    for dtype in (torch.bfloat16, torch.float16)
}
_GROUP_M = 8  # tile swizzle for L2 reuse: only decides which program computes a tile, not how
_PROGRAMS_PER_SM = 2  # persistent grid size (finer load balance); like SPLIT, never changes a bit


@triton.jit
def _slot(scratch, slot, v, leaf):
    """Pointers to scratch slot `slot` of a program's scratch (scalar base), tile-shaped like v.

    Built where used (the `leaf >> 30` keeps the compiler from hoisting it), so that no tile of
    64-bit pointers is held through the K loop. That was meant for 128x128 tiles, which spill
    anyway; for the shipped 64x128 tiles ptxas counts 224 registers a thread with it and 218
    with the hoisted tile (TMA loads), no spills either way."""
    BM: tl.constexpr = v.shape[0]
    BN: tl.constexpr = v.shape[1]
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    # leaf >> 30 is 0 (leaf < 2**30), but the compiler cannot see that, so it will not hoist the tile
    return scratch + (slot + (leaf >> 30)) * (BM * BN) + offs


@triton.jit
def _tree_push(v, leaf, p0, p1, p2, p3, scratch, LEVELS: tl.constexpr, REG_LEVELS: tl.constexpr):
    """Adds leaf number `leaf` (value v) to a pairwise tree built left to right.

    p0..p3 (registers) and scratch slots (memory, SLOT elements apart) hold the pending left
    sibling of each level. This is a binary counter: the carry climbs while `leaf` has 1 bits, adding the pending
    sibling at each level, and parks at the first 0 bit. After the last leaf (all bits 1), v is
    the root. Returns (v, p0, p1, p2, p3).
    """
    for lvl in tl.static_range(LEVELS):
        low = leaf & ((2 << lvl) - 1)
        if low == (2 << lvl) - 1:  # this level's left sibling is pending: add it
            if lvl < REG_LEVELS:
                if lvl == 0:
                    v = p0 + v
                elif lvl == 1:
                    v = p1 + v
                elif lvl == 2:
                    v = p2 + v
                else:
                    v = p3 + v
            else:
                v = tl.load(_slot(scratch, lvl - REG_LEVELS, v, leaf)) + v
        elif low == (1 << lvl) - 1:  # the carry stops here: v waits for its right sibling
            if lvl < REG_LEVELS:
                if lvl == 0:
                    p0 = v
                elif lvl == 1:
                    p1 = v
                elif lvl == 2:
                    p2 = v
                else:
                    p3 = v
            else:
                tl.store(_slot(scratch, lvl - REG_LEVELS, v, leaf), v)
    return v, p0, p1, p2, p3


@triton.jit
def _epilogue(root, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS: tl.constexpr):
    # The bias joins once, in fp32, after the whole K reduction; then the single rounding.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        root = root + bias[None, :]
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on  # M*N may pass 2**31
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(ptrs, root.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _join_parts(parts, bias_ptr, out_ptr, first_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                SPLIT: tl.constexpr, SPLIT_LEVELS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SUB: tl.constexpr):
    """The last program of a tile adds the SPLIT subtree roots pairwise and writes the output.

    SUB rows at a time: the pending values of the tree stay few registers, and at small M
    only the slabs that hold rows are read.
    """
    rs = tl.arange(0, SUB)
    rn = tl.arange(0, BLOCK_N)
    for r0 in tl.static_range(0, BLOCK_M, SUB):
        if first_m + r0 < M:
            offs_m = first_m + r0 + rs
            rows = (offs_m < M)[:, None]
            ptrs = parts + (r0 + rs)[:, None] * BLOCK_N + rn[None, :]
            q = tl.zeros((SUB, BLOCK_N), dtype=tl.float32)
            q0 = q
            q1 = q
            q2 = q
            q3 = q
            for s in tl.static_range(SPLIT):
                v = tl.load(ptrs + s * (BLOCK_M * BLOCK_N), mask=rows, cache_modifier=".cg")
                q, q0, q1, q2, q3 = _tree_push(v, s, q0, q1, q2, q3, ptrs, SPLIT_LEVELS, 4)
            _epilogue(q, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "N", "num_units", "num_progs"])
def _tree_matmul_kernel(
    a_ptr, b_ptr, bias_ptr, out_ptr, ws_ptr, scratch_ptr, ticket_ptr,
    M, N, K, chunk_width, num_units, num_progs,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    LEAVES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UNIT_LEVELS: tl.constexpr, SPLIT_LEVELS: tl.constexpr, SCRATCH_SLOTS: tl.constexpr,
    REG_LEVELS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    UNIT_LEAVES: tl.constexpr = LEAVES // SPLIT
    TILE: tl.constexpr = BLOCK_M * BLOCK_N

    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_leaf = tl.cdiv(chunk_width, BLOCK_K)
    iters = UNIT_LEAVES * tiles_per_leaf

    # Tile-local offsets of the fp32 scratch/workspace tiles (same layout for store and load,
    # so every thread reads back what it wrote itself).
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    tile_offs = rm[:, None] * BLOCK_N + rn[None, :]
    scratch = scratch_ptr + pid * (SCRATCH_SLOTS * TILE)  # scalar: see _slot

    # Persistent loop: a program's units run one after the other, so the scratch is per program.
    for unit in range(pid, num_units, num_progs):
        tile = unit // SPLIT
        part = unit % SPLIT
        group = tile // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * num_pid_n)) % group_m
        pid_n = (tile % (GROUP_M * num_pid_n)) // group_m
        offs_m = pid_m * BLOCK_M + rm
        offs_n = pid_n * BLOCK_N + rn
        # Rows/columns past the edge load a wrapped-around copy instead of a masked zero: they
        # never reach the output and the loads stay unmasked.
        if not TMA:
            a_rows = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am
            b_cols = b_ptr + (offs_n % N).to(tl.int64)[None, :] * stride_bn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        p0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first_leaf = part * UNIT_LEAVES
        # One flat loop over all K tiles of the unit keeps the load pipeline full across leaf
        # boundaries; a leaf's end only closes the accumulator into the tree.
        for it in range(0, iters):
            leaf = it // tiles_per_leaf
            j = it - leaf * tiles_per_leaf
            leaf_start = (first_leaf + leaf) * chunk_width
            k0 = leaf_start + j * BLOCK_K
            if TMA:
                # a_ptr, b_ptr are descriptors of A [M, K] and B^T [N, K]; rows past M load zeros.
                a = a_ptr.load([pid_m * BLOCK_M, k0])
                b = b_ptr.load([pid_n * BLOCK_N, k0]).T
            else:
                offs_k = k0 + rk
                a_ptrs = a_rows + offs_k[None, :] * stride_ak
                b_ptrs = b_cols + offs_k[:, None] * stride_bk
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    # Masked tail: K positions past the leaf (or past K) count as zeros.
                    k_end = tl.minimum(leaf_start + chunk_width, K)
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < k_end, other=0.0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < k_end, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if UNIT_LEAVES > 1:  # (a unit of one leaf keeps a branch-free, fully async loop)
                if (j == tiles_per_leaf - 1) & (leaf < UNIT_LEAVES - 1):
                    _, p0, p1, _, _ = _tree_push(acc, leaf, p0, p1, p0, p0, scratch,
                                                 UNIT_LEVELS, REG_LEVELS)
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        root, _, _, _, _ = _tree_push(acc, UNIT_LEAVES - 1, p0, p1, p0, p0, scratch,
                                      UNIT_LEVELS, REG_LEVELS)

        if SPLIT == 1:
            _epilogue(root, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS)
        else:
            # fp32 workspace tiles carry only the rows that exist: at M=1 full tiles would
            # cost as many bytes as the weights.
            parts = ws_ptr + tile * (SPLIT * TILE)
            tl.store(parts + part * TILE + tile_offs, root, mask=(offs_m < M)[:, None], cache_modifier=".cg")
            # All threads' stores must be issued before the release; the acq_rel ticket then
            # makes them visible to whichever program arrives last.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                _join_parts(parts, bias_ptr, out_ptr, pid_m * BLOCK_M, offs_n, M, N, stride_om, stride_on,
                            HAS_BIAS, SPLIT, SPLIT_LEVELS, BLOCK_M, BLOCK_N, 16)
                tl.store(ticket_ptr + tile, 0)  # re-arm the counter for the next launch


_tickets: dict = {}


def _ticket_buffer(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile; the kernel re-arms each one it uses.

    One buffer per device: launches that may split K (small M) on several streams of one
    device at the same time would share it (documented; engines run one stream). Warm up
    before a CUDA graph capture so the buffer exists outside the graph's pool.
    """
    buf = _tickets.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _tickets[device] = buf
    return buf


def _config(dtype: torch.dtype, chunk_width: int, m: int, n: int, device: torch.device) -> dict:
    if dtype not in _CONFIGS:
        raise TypeError(f"tbik matmul supports bfloat16, float16 and float32, not {dtype}")
    sms = num_sms(device)
    cfg = next((c for rows, c in _FEW_ROWS.get(dtype, ())
                if m <= rows and triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]) <= sms), _CONFIGS[dtype])
    return _sized(dtype, chunk_width, tuple(cfg.items()))


@functools.lru_cache(maxsize=None)
def _sized(dtype: torch.dtype, chunk_width: int, items: tuple) -> dict:
    cfg = dict(items)
    # A chunk narrower than BLOCK_K would be mostly masked; 16 is tl.dot's minimum.
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(chunk_width)))
    return cfg


def _pick_split(leaves: int, tiles: int, device: torch.device) -> int:
    """Execution strategy only (never the bits). With few output tiles (small M) the GPU is
    not filled; splitting a tile's leaves over SPLIT programs fills it, at the price of writing,
    and one program per tile reading, SPLIT fp32 partials. The largest SPLIT whose programs
    still fit one wave (one per SM). In the CUDA-graph split table of Qwen3-0.6B's shapes at
    32, 64 and 256 rows with 64x128 tiles (reports/kernels/h200-small-m) it is the fastest
    SPLIT, or within 0.3 us of it, in 19 of 21 cells (1.0 us off in the worst); the fitted
    cost model before it split past one wave and lost up to 1.5x (gate, 32 and 64 rows)."""
    split, sms = 1, num_sms(device)
    while split * 2 <= leaves and tiles * split * 2 <= sms:
        split *= 2
    return split


class _Plan(NamedTuple):
    grid: tuple
    units: int
    tiles: int
    ws_numel: int  # fp32 elements of the SPLIT partials (0: none)
    scratch_numel: int  # fp32 elements of the per-program tree scratch (0: none)
    meta: dict
    gluon: bool = False  # matmul_ws.py's kernel takes the launch (then nothing above is used)


def _tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA reads rows of A [M, K] and of B^T [N, K]: both K-contiguous, 16-byte aligned."""
    e = a.element_size()
    return (a.stride(1) == 1 and b.stride(0) == 1 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and a.stride(0) * e % 16 == 0 and b.stride(1) * e % 16 == 0)


def _gluon_eligible(*case) -> bool:
    try:
        from . import matmul_ws
    except ImportError:  # a Triton without Gluon
        return False
    return matmul_ws.eligible(*case)


@functools.lru_cache(maxsize=4096)
def _plan(dtype, out_dtype, device, m, n, k_len, leaves, chunk_width, has_bias, split, tma_fits) -> _Plan:
    """Everything about a launch that follows from the shapes, computed once per shape."""
    if split is None and device.type == "cuda" and _gluon_eligible(dtype, out_dtype, device, m, n, k_len, leaves,
                                                                   chunk_width, tma_fits):
        return _Plan((0,), 0, 0, 0, 0, {}, gluon=True)
    cfg = _config(dtype, chunk_width, m, n, device)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split is None:
        split = _pick_split(leaves, tiles, device)
    if leaves % split:
        raise ValueError(f"split={split} must divide the {leaves} leaves")
    units = tiles * split
    unit_levels = (leaves // split).bit_length() - 1
    scratch_slots = max(unit_levels - cfg["REG_LEVELS"], 1)
    num_progs, scratch_numel = units, 0
    if unit_levels > cfg["REG_LEVELS"]:
        # Tree levels in scratch: the grid is persistent, so the scratch is per program and
        # stays small (and L2-resident) whatever M and N are.
        num_progs = min(units, num_sms(device) * _PROGRAMS_PER_SM)
        scratch_numel = num_progs * scratch_slots * bm * bn
    even_k = chunk_width % cfg["BLOCK_K"] == 0 and chunk_width * leaves == k_len
    meta = dict(
        LEAVES=leaves, SPLIT=split, HAS_BIAS=has_bias, EVEN_K=even_k,
        # TMA loads the same tiles as the pointer loads (rows past M as zeros instead of
        # wrapped copies, which never reach the output): a way to load, never a change of bits.
        TMA=cfg["TMA"] and tma_fits and even_k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=_GROUP_M,
        UNIT_LEVELS=unit_levels, SPLIT_LEVELS=split.bit_length() - 1, SCRATCH_SLOTS=scratch_slots,
        REG_LEVELS=cfg["REG_LEVELS"], PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    ws_numel = tiles * split * bm * bn if split > 1 else 0
    return _Plan((num_progs,), units, tiles, ws_numel, scratch_numel, meta)


_workspaces: dict = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """fp32 workspace reused launch after launch (stream order keeps them apart), saving an
    allocation per call. Inside a CUDA graph capture a fresh tensor from the graph's pool is
    used instead, so a later regrowth can never free memory that a graph still uses."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
        _workspaces[device] = buf
    return buf


_kernel = CachedKernel(_tree_matmul_kernel)


def launch(a, b, bias, out, k_len, leaves, chunk_width, split=None):
    """out = the tree over `leaves` chunks of width chunk_width of a @ b (+ bias), checked operands.

    On Hopper, where the output has enough tiles to fill the GPU, the warp-specialized Gluon
    kernel of matmul_ws.py runs instead: the same bits (the same MMA steps and tree), faster at
    large M. `split` (tests) forces this file's kernel with that strategy."""
    m, n = out.shape
    plan = _plan(a.dtype, out.dtype, a.device, m, n, k_len, leaves, chunk_width, bias is not None, split,
                 _tma_fits(a, b))
    if plan.gluon:
        from . import matmul_ws

        return matmul_ws.launch(a, b, bias, out, k_len, leaves, chunk_width)
    # Buffers the kernel does not touch in this specialization are stood in for by `out`.
    ws = scratch = tickets = out
    if plan.ws_numel or plan.scratch_numel:
        buf = _workspace(a.device, plan.ws_numel + plan.scratch_numel)
        if plan.ws_numel:
            ws = buf[:plan.ws_numel]
            tickets = _ticket_buffer(a.device, plan.tiles)
        if plan.scratch_numel:
            scratch = buf[plan.ws_numel:plan.ws_numel + plan.scratch_numel]
    sa, sb, so = a.stride(), b.stride(), out.stride()
    if plan.meta["TMA"]:
        meta = plan.meta
        a = TensorDescriptor(a, [m, k_len], [a.stride(0), 1], [meta["BLOCK_M"], meta["BLOCK_K"]])
        b = TensorDescriptor(b, [n, k_len], [b.stride(1), 1], [meta["BLOCK_N"], meta["BLOCK_K"]])
    args = (a, b, bias if bias is not None else out, out, ws, scratch, tickets,
            m, n, k_len, chunk_width, plan.units, plan.grid[0], sa[0], sa[1], sb[0], sb[1], so[0], so[1])
    _kernel(plan.grid, args, plan.meta)
    return out
