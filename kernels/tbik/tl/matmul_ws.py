"""Warp-specialized Hopper (sm_90a) tree matmul in Gluon: the same bits as tl/matmul.py.

Only the large-M case (SPLIT == 1: one program reduces a whole output tile over the rank's
LEAVES leaves) of tl/matmul.py, for K-contiguous bf16/fp16 A [M, K] and B^T [N, K] with
K == LEAVES * chunk_width and chunk_width a multiple of BLOCK_K (`eligible`); tl/matmul.py keeps
everything else.

Summation order (identical to tl/matmul.py): inside a leaf, one fp32 accumulator takes the
BLOCK_K-wide K tiles in ascending order through wgmma (k16 steps in order); the leaf results go
into the same binary-counter tree as tl/matmul.py's _tree_push (pending left sibling + value);
the bias is added once in fp32 after the root; then one rounding to the output dtype. A
different tile shape does not change any of this: each output element sees the same sequence
of fp32 operations.

Layout of the work:
  * persistent grid (one CTA per SM), output tiles BLOCK_M x BLOCK_N in grouped order;
  * worker partition (1 warp, few registers): TMA loads of A and B^T K-tiles into a ring of
    STAGES shared-memory stages (ready/empty mbarriers); the K tiles of a tile are simply
    0, BLOCK_K, ... since the leaves are contiguous and BLOCK_K divides the leaf width;
  * two consumer partitions (the default one and a worker, one warpgroup each, CONSUMER_REGS
    registers a thread), each owning 64 rows of the tile: async wgmma m64nBLOCK_N with one group
    in flight, the tree's level-0/1 pending siblings in registers, the level-2 one (8 leaves) in
    the warpgroup's own 32 KB shared buffer, which then stages the output tile for a TMA store
    (TMA_STORE; else plain masked stores from registers). A stage is released when both
    warpgroups have arrived on its `empty` barrier (count 2), so the two never wait for each
    other except through the ring.
tl/matmul.py hands a case over where `eligible` says so (never with fewer output tiles than half
the SMs: the split-K path of tl/matmul.py is faster there). Bits, timings and register counts:
reports/kernels/h100-ws/README.md.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launcher import CachedKernel, num_sms

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
STAGES = 5
GROUP_M = 8
CONSUMER_REGS = 232
PRODUCER_REGS = 40
MAXNREG = 168  # 12 warps (the producer warp takes a warpgroup slot) x 168 <= 64K registers
TMA_STORE = True


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    group = tile // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_pid_n)) % group_m
    pid_n = (tile % (GROUP_M * num_pid_n)) // group_m
    return pid_m, pid_n


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, iters,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    cnt = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        for it in range(iters):
            s = cnt % STAGES
            ph = (cnt // STAGES) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)  # fresh barriers pass phase 1 at once
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, it * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, it * BK], ready.index(s), b_bufs.index(s))
            cnt += 1


@gluon.jit
def _leaf(acc, a_bufs, b_bufs, ready, empty, cnt, tiles_per_leaf, WG: gl.constexpr, STAGES: gl.constexpr):
    """One leaf: the accumulator starts from nothing and takes its K tiles in order."""
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    for j in range(tiles_per_leaf):
        s = cnt % STAGES
        ph = (cnt // STAGES) & 1
        mbarrier.wait(ready.index(s), ph)
        a_s = a_bufs.index(s).slice(WG * HALF, HALF, dim=0)  # this warpgroup's rows
        b_s = b_bufs.index(s)
        acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, use_acc=j > 0, is_async=True)
        # keep one wgmma group in flight: the previous one (and its stage) is then done
        acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_s, b_s))
        mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), pred=j > 0)
        cnt += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES))
    return acc, cnt


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, buf, out_desc, bias_ptr, out_ptr, M, N, stride_om, tiles_per_leaf,
              WG: gl.constexpr, LEAVES: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
    """One warpgroup: rows [WG * BM/2, (WG + 1) * BM/2) of every output tile of this program."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    p2_smem = buf  # this warpgroup's: level-2 pending sibling (8 leaves), then the output staging tile
    if TMA_STORE:
        o_smem = buf._reinterpret(out_desc.dtype, [HALF, BN], out_desc.layout)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    rm = gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    cnt = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((HALF, BN), gl.float32, mma)
        p0 = acc
        p1 = acc
        # Static loop over the leaves: the tree (a binary counter over the leaf index, as in
        # tl/matmul.py's _tree_push) is resolved at compile time.
        for leaf in gl.static_range(LEAVES):
            v, cnt = _leaf(acc, a_bufs, b_bufs, ready, empty, cnt, tiles_per_leaf, WG, STAGES)
            for lvl in gl.static_range(3):
                low = leaf & ((2 << lvl) - 1)
                if (2 << lvl) <= LEAVES:
                    if low == (2 << lvl) - 1:  # left sibling pending at this level: add it
                        if lvl == 0:
                            v = p0 + v
                        elif lvl == 1:
                            v = p1 + v
                        else:
                            v = p2_smem.load(mma) + v
                    elif low == (1 << lvl) - 1:  # the carry stops: v waits for its right sibling
                        if lvl == 0:
                            p0 = v
                        elif lvl == 1:
                            p1 = v
                        else:
                            if TMA_STORE:  # the previous tile's output store still reads buf
                                tma.store_wait(0)
                                gl.thread_barrier()
                            p2_smem.store(v)
            acc = v
        root = acc
        offs_n = pid_n * BN + rn
        if HAS_BIAS:
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            root = root + gl.expand_dims(bias, 0)
        if TMA_STORE:
            if LEAVES < 8:
                tma.store_wait(0)
                gl.thread_barrier()
            else:
                gl.thread_barrier()  # all threads have read p2 before it is overwritten
            o_smem.store(root.to(out_desc.dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(out_desc, [pid_m * BM + WG * HALF, pid_n * BN], o_smem)
        else:
            offs_m = pid_m * BM + WG * HALF + rm
            ptrs = out_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_n, 0)
            mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
            gl.store(ptrs, root.to(out_ptr.dtype.element_ty), mask=mask)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _tree_matmul_ws_kernel(a_desc, b_desc, out_desc, bias_ptr, out_ptr, M, N, stride_om, tiles_per_leaf,
                           LEAVES: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                           STAGES: gl.constexpr, TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    buf_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0])
    buf0 = gl.allocate_shared_memory(gl.float32, [BM // 2, BN], buf_layout)
    buf1 = gl.allocate_shared_memory(gl.float32, [BM // 2, BN], buf_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    fence_async_shared()
    iters = LEAVES * tiles_per_leaf
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, buf0, out_desc, bias_ptr, out_ptr, M, N, stride_om, tiles_per_leaf,
                     0, LEAVES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE)),
        (_consumer, (a_bufs, b_bufs, ready, empty, buf1, out_desc, bias_ptr, out_ptr, M, N, stride_om, tiles_per_leaf,
                     1, LEAVES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, iters, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _smem_layout(dtype):
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)


@functools.lru_cache(maxsize=None)
def _out_layout(dtype):
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, BLOCK_N], _GL_DTYPES[dtype])


_GL_DTYPES = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


# Gluon's API moves between Triton releases; the kernel is written and checked against 3.6.
_TRITON_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6)


@functools.lru_cache(maxsize=None)
def _hopper(device) -> bool:
    return _TRITON_OK and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def eligible(dtype, out_dtype, device, m, n, k_len, leaves, chunk_width, tma_fits) -> bool:
    """Whether tl/matmul.py hands this case to `launch` (called once per shape, from its plan):
    Hopper, bf16/fp16 operands that load through TMA (tma_fits: A and B^T K-contiguous, 16-byte
    aligned), whole leaves of BLOCK_K-wide tiles, at least one whole tile of rows and at least half
    as many output tiles as SMs. Below those, tl/matmul.py's kernel is faster: with fewer tiles
    its SPLIT > 1 path fills the GPU, and with fewer rows (the weight-bound decode shapes) its
    64-row tiles ran gate_up and lm_head at 0.87-0.97x cuBLAS against this kernel's 0.68-0.85x
    (CUDA graphs, one H100, reports/kernels/h100-ws/)."""
    return (dtype in (torch.bfloat16, torch.float16) and out_dtype in _GL_DTYPES and tma_fits and _hopper(device)
            and leaves in (1, 2, 4, 8) and k_len == leaves * chunk_width and chunk_width % BLOCK_K == 0
            and m >= BLOCK_M and triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N) >= num_sms(device) // 2)


_kernel = CachedKernel(_tree_matmul_ws_kernel)


def launch(a, b, bias, out, k_len, leaves, chunk_width, tma_store=None):
    """out = the tree over `leaves` chunks of a [M, K] @ b [K, N] (+ bias), for a case `eligible`
    takes (tests call it on any case with a Hopper GPU, bf16/fp16 TMA operands and whole leaves)."""
    m, n = out.shape
    layout = _smem_layout(_GL_DTYPES[a.dtype])
    a_desc = TensorDescriptor(a, [m, k_len], [a.stride(0), 1], [BLOCK_M, BLOCK_K], layout)
    b_desc = TensorDescriptor(b, [n, k_len], [b.stride(1), 1], [BLOCK_N, BLOCK_K], layout)
    tma_store = TMA_STORE if tma_store is None else tma_store
    tma_store = tma_store and out.stride(1) == 1 and out.data_ptr() % 16 == 0 and out.stride(0) * out.element_size() % 16 == 0
    out_layout = _out_layout(out.dtype)
    out_desc = TensorDescriptor(out if tma_store else a, [m, n] if tma_store else [m, k_len],
                                [out.stride(0) if tma_store else a.stride(0), 1], [BLOCK_M // 2, BLOCK_N],
                                out_layout if tma_store else _out_layout(a.dtype))
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, num_sms(a.device)), )
    _kernel(grid, (a_desc, b_desc, out_desc, bias if bias is not None else out, out, m, n, out.stride(0),
                   chunk_width // BLOCK_K),
            dict(LEAVES=leaves, HAS_BIAS=bias is not None, GROUP_M=GROUP_M, STAGES=STAGES, TMA_STORE=tma_store,
                 CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG))
    return out
