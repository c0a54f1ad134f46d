"""row_values.py's values on a GPU, in four Triton kernels, and the fp32 cast that can take the
digest's partial sums on its way.

0. (widen_gpu, before the log-softmax) 16-bit logits -> fp32, and each (row, segment)'s digest
   partial sum from the values in registers: the digest then costs no pass of its own over the
   fp32 row, and a segment's column keys are hashed once for WIDEN_ROWS rows.
1. One program per (row, segment of SEGMENT columns): the segment's digest partial sum (unless
   widen_gpu took it) and its largest order key. Segments, not rows, are the unit of work: a
   decode step has 1 to 32 rows of 150k columns, too few programs for a GPU if each read a
   whole row.
2. One program per row: the row's threshold T, the K-th largest of its segments' largest keys
   (counted with repeats). K segments each hold a key >= T, so the row's K-th largest key is
   >= T, and a segment whose largest key is below T holds none of the row's top K.
3. One program per (row, segment): a segment below T writes empty candidates without reading
   its columns; the others (usually K or fewer of the row's 38) give their top-K candidates
   (K rounds of: largest order key, lowest column among its ties, struck out). The rounds cost
   as much as the digest's hashing; most segments skip them.
4. One program per row: the row's top-k among its segments' candidates (same rounds; columns
   are global, so "lowest column" is the row's lowest id), the digest as the partials' sum
   (uint64, mod 2^64: the order of the additions changes no bit), the top-1 and the recorded
   token's logprob.

In steps 3 and 4 each (order key, column) pair is packed into one int64 whose order is the
pair's, so a round is one max reduction.

Values are moved as bits (the logprob rows are read through an int32 view, the outputs written
through one): the kernels compare and copy, never compute a float, so every value is the
log-softmax's own bits.

top_ids_gpu is the vLLM capture's top-k of a step's 16-bit logits in the same order, by the same
kernels 1-3 (reading the 16-bit row, without the digest) and a step 4 that writes only the ids:
a capture runs it beside vLLM's next step, where torch.topk's radix passes over the rows were
most of the capture's GPU time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tbik.tl.launcher import CachedKernel

from ..record.digest_kernel import BASE, INT_VIEW, mix

SEGMENT = 4096
WIDEN_ROWS = 4  # rows per widen program: its column keys are hashed once for them
MAX_K = 32  # k rounds are unrolled; row_values takes a longer list from reference_topk
# In the kernels, -2**31 is below every value's key (a dead column) and -2**63 + 1 below every
# packed (key, column) pair (an empty candidate slot).


@triton.jit
def _order_key(bits):
    """An fp32's bits (int32) -> a key whose int order is the value order; NaN above all, -0 == +0."""
    bits = tl.where(bits == -2147483648, 0, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _widen_kernel(raw_ptr, raw_stride, out_ptr, out_stride, n_rows, n_cols, base, part_ptr,
                  SEG: tl.constexpr, ROWS: tl.constexpr):
    g = tl.program_id(0)
    s = tl.program_id(1)
    n_seg = tl.num_programs(1)
    cols = s * SEG + tl.arange(0, SEG)
    live = cols < n_cols
    key = mix(cols.to(tl.uint64) + base)
    for i in tl.static_range(ROWS):
        r = g * ROWS + i
        ok = r < n_rows
        row = r.to(tl.int64)
        # The widening conversion is exact: these are .float()'s values (tested against it on
        # every 16-bit pattern), and the digest hashes the bits stored.
        x = tl.load(raw_ptr + row * raw_stride + cols, mask=live & ok, other=0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, x, mask=live & ok)
        bits = (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF).to(tl.uint64)
        acc = tl.where(live, mix(bits ^ key), 0)
        tl.store(part_ptr + r * n_seg + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True), mask=ok)


@triton.jit
def _keys(x_ptr, x_stride, r, cols, live):
    """Order keys of row r's columns: fp32 bits read through an int32 view (the logprob rows), or
    16-bit or fp32 values (logits) widened, which is exact, so the keys order the values
    themselves. Dead columns: -2**31."""
    x = tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=live, other=0)
    if x.dtype != tl.int32:
        x = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(live, _order_key(x), -2147483648)


@triton.jit
def _segment_kernel(x_ptr, logit_ptr, x_stride, logit_stride, n_cols, offset, base, mask,
                    part_ptr, top_ptr, SEG: tl.constexpr, DIGEST: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_seg = tl.num_programs(1)
    cols = s * SEG + tl.arange(0, SEG)
    live = cols < n_cols

    if DIGEST:
        row = r.to(tl.int64)
        bits = (tl.load(logit_ptr + row * logit_stride + cols, mask=live, other=0).to(tl.int64) & mask).to(tl.uint64)
        acc = tl.where(live, mix(bits ^ mix((cols + offset).to(tl.uint64) + base)), 0)
        tl.store(part_ptr + r * n_seg + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))
    tl.store(top_ptr + r * n_seg + s, tl.max(_keys(x_ptr, x_stride, r, cols, live), axis=0))


@triton.jit
def _threshold_kernel(top_ptr, n_seg, threshold_ptr, K: tl.constexpr, SEGS: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.arange(0, SEGS)
    tops = tl.load(top_ptr + r * n_seg + slot, mask=slot < n_seg, other=-2147483648)
    threshold = -2147483648
    for j in tl.static_range(K):  # the K-th largest, repeats counted: strike one slot a round
        threshold = tl.max(tops, axis=0)
        first = tl.min(tl.where(tops == threshold, slot, SEGS), axis=0)
        tops = tl.where(slot == first, -2147483648, tops)
    tl.store(threshold_ptr + r, threshold)


@triton.jit
def _packed(keys, cols):
    """(order key, column) -> one int64, larger for a larger key and, among equal keys, for a
    lower column: a round's winner is one max, and no two columns share a value."""
    return (keys.to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)


@triton.jit
def _pop(packed):
    """The largest pair's column, and the pairs without it (its slot emptied)."""
    top = tl.max(packed, axis=0)
    return 2147483647 - (top & 0xFFFFFFFF), tl.where(packed == top, -9223372036854775807, packed)


@triton.jit
def _candidate_kernel(x_ptr, x_stride, n_cols, top_ptr, threshold_ptr, cand_ptr,
                      SEG: tl.constexpr, K: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_seg = tl.num_programs(1)
    out = (r * n_seg + s) * K
    if tl.load(top_ptr + r * n_seg + s) < tl.load(threshold_ptr + r):
        for i in tl.static_range(K):
            tl.store(cand_ptr + out + i, -9223372036854775807)
    else:
        cols = s * SEG + tl.arange(0, SEG)
        live = cols < n_cols
        packed = tl.where(live, _packed(_keys(x_ptr, x_stride, r, cols, live), cols), -9223372036854775807)
        for i in tl.static_range(K):
            top = tl.max(packed, axis=0)
            tl.store(cand_ptr + out + i, top)
            packed = tl.where(packed == top, -9223372036854775807, packed)


@triton.jit
def _row_kernel(lp_ptr, lp_stride, target_ptr, cand_ptr, part_ptr, n_seg,
                logprob_ptr, top1_ptr, digest_ptr, topk_lp_ptr, topk_id_ptr,
                K: tl.constexpr, TOPK: tl.constexpr, CANDS: tl.constexpr, SEGS: tl.constexpr):
    r = tl.program_id(0)
    row = r.to(tl.int64)
    slot = tl.arange(0, CANDS)
    packed = tl.load(cand_ptr + r * n_seg * K + slot, mask=slot < n_seg * K, other=-9223372036854775807)
    for j in tl.static_range(K):
        col, packed = _pop(packed)
        if j == 0:
            tl.store(top1_ptr + r, col)
        if TOPK:
            tl.store(topk_id_ptr + r * K + j, col)
            tl.store(topk_lp_ptr + r * K + j, tl.load(lp_ptr + row * lp_stride + col))

    seg = tl.arange(0, SEGS)
    parts = tl.load(part_ptr + r * n_seg + seg, mask=seg < n_seg, other=0).to(tl.uint64, bitcast=True)
    tl.store(digest_ptr + r, tl.sum(parts, axis=0).to(tl.int64, bitcast=True))
    tl.store(logprob_ptr + r, tl.load(lp_ptr + row * lp_stride + tl.load(target_ptr + r)))


@triton.jit
def _row_top_ids_kernel(cand_ptr, n_cand, first_ptr, ids_ptr, K: tl.constexpr, CANDS: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.arange(0, CANDS)
    packed = tl.load(cand_ptr + r * n_cand + slot, mask=slot < n_cand, other=-9223372036854775807)
    row = ids_ptr + r.to(tl.int64) * (K + 1)
    tl.store(row, tl.load(first_ptr + r).to(tl.int64))
    for j in tl.static_range(K):
        col, packed = _pop(packed)
        tl.store(row + 1 + j, col)


_widens = CachedKernel(_widen_kernel)
_segments = CachedKernel(_segment_kernel)
_thresholds = CachedKernel(_threshold_kernel)
_candidates = CachedKernel(_candidate_kernel)
_rows = CachedKernel(_row_kernel)
_row_top_ids = CachedKernel(_row_top_ids_kernel)


def digest_parts(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """A buffer for n rows' digest partial sums, one per segment (int64 holding uint64)."""
    return torch.empty((n, triton.cdiv(vocab, SEGMENT)), dtype=torch.int64, device=device)


def _check_parts(parts: torch.Tensor, n: int, vocab: int) -> None:
    if parts.shape != (n, triton.cdiv(vocab, SEGMENT)) or not parts.is_contiguous():
        raise ValueError(f"digest partials of shape {tuple(parts.shape)} for {n} rows of {vocab}")


def widen_gpu(raw: torch.Tensor, out: torch.Tensor, parts: torch.Tensor) -> None:
    """out <- raw [n, V] (bf16 or fp16) as fp32, the bits of raw.float(); parts (digest_parts)
    <- the digest's partial sums of out's rows, taken in the same pass."""
    n, vocab = raw.shape
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    if out.stride(-1) != 1 or out.shape != raw.shape or out.dtype != torch.float32:
        raise ValueError(f"widen_gpu writes a row-major fp32 [{n}, {vocab}], got {out.dtype} {tuple(out.shape)}")
    _check_parts(parts, n, vocab)
    if n:
        _widens((triton.cdiv(n, WIDEN_ROWS), parts.shape[1]),
                (raw, raw.stride(0), out, out.stride(0), n, vocab, BASE, parts),
                {"SEG": SEGMENT, "ROWS": WIDEN_ROWS, "num_warps": 8})


def row_values_gpu(logits: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor, topk: int,
                   parts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """row_values.row_values for rows on a GPU (same values, same bits), top-k up to MAX_K.
    `parts`: the digest partials widen_gpu took of these logits (then not hashed again)."""
    n, vocab = lp.shape
    if not 0 <= topk <= min(MAX_K, vocab):
        raise ValueError(f"the kernels keep top-k lists of 0 to {min(MAX_K, vocab)} entries here, not {topk}")
    dev = lp.device
    k = max(1, topk)
    if lp.stride(-1) != 1:
        lp = lp.contiguous()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    view, mask = INT_VIEW[logits.dtype]
    n_seg = triton.cdiv(vocab, SEGMENT)
    cands = torch.empty((n, n_seg * k), dtype=torch.int64, device=dev)
    digest = parts is None
    if digest:
        parts = digest_parts(n, vocab, dev)
    else:
        _check_parts(parts, n, vocab)
    tops = torch.empty((n, n_seg), dtype=torch.int32, device=dev)
    lp_bits = lp.view(torch.int32)
    _segments((n, n_seg), (lp_bits, logits.view(view), lp.stride(0), logits.stride(0), vocab, 0, BASE, mask,
                           parts, tops), {"SEG": SEGMENT, "DIGEST": digest, "num_warps": 8})
    thresholds = torch.empty(n, dtype=torch.int32, device=dev)
    _thresholds((n,), (tops, n_seg, thresholds), {"K": k, "SEGS": triton.next_power_of_2(n_seg), "num_warps": 1})
    _candidates((n, n_seg), (lp_bits, lp.stride(0), vocab, tops, thresholds, cands),
                {"SEG": SEGMENT, "K": k, "num_warps": 8})
    out = {"logprob": torch.empty(n, dtype=torch.float32, device=dev),
           "top1": torch.empty(n, dtype=torch.int64, device=dev),
           "digest": torch.empty(n, dtype=torch.int64, device=dev)}
    lists = (torch.empty((n, k), dtype=torch.float32, device=dev), torch.empty((n, k), dtype=torch.int64, device=dev))
    _rows((n,), (lp_bits, lp.stride(0), targets.contiguous(), cands, parts, n_seg,
                 out["logprob"].view(torch.int32), out["top1"], out["digest"],
                 lists[0].view(torch.int32), lists[1]),
          {"K": k, "TOPK": topk > 0, "CANDS": triton.next_power_of_2(n_seg * k),
           "SEGS": triton.next_power_of_2(n_seg), "num_warps": 4})
    if topk:
        out["topk_lp"], out["topk_ids"] = lists
    return out


def top_ids_gpu(logits: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 1 + k] int64: first [n, 1] (any int dtype), then the ids of each row's k largest
    logits [n, V] (bf16, fp16 or fp32), largest first, equal values by lowest id (row_values's
    order, on the logits), k from 1 to MAX_K."""
    n, vocab = logits.shape
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"the kernels take top-k lists of 1 to {min(MAX_K, vocab)} ids here, not {k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    first = first.reshape(n).contiguous()
    n_seg = triton.cdiv(vocab, SEGMENT)
    dev = logits.device
    tops = torch.empty((n, n_seg), dtype=torch.int32, device=dev)
    thresholds = torch.empty(n, dtype=torch.int32, device=dev)
    cands = torch.empty((n, n_seg * k), dtype=torch.int64, device=dev)
    ids = torch.empty((n, 1 + k), dtype=torch.int64, device=dev)
    if n:
        _segments((n, n_seg), (logits, logits, logits.stride(0), 0, vocab, 0, 0, 0, tops, tops),
                  {"SEG": SEGMENT, "DIGEST": False, "num_warps": 8})
        _thresholds((n,), (tops, n_seg, thresholds), {"K": k, "SEGS": triton.next_power_of_2(n_seg), "num_warps": 1})
        _candidates((n, n_seg), (logits, logits.stride(0), vocab, tops, thresholds, cands),
                    {"SEG": SEGMENT, "K": k, "num_warps": 8})
        _row_top_ids((n,), (cands, n_seg * k, first, ids), {"K": k, "CANDS": triton.next_power_of_2(n_seg * k), "num_warps": 4})
    return ids
