"""A trace's rows, from the tracer's blocks to the table: where each module call's rows sit,
the order the table puts them in (module by module, each module's calls in the order they ran),
the rows a module names twice, the routers' expert ids, and the copy off the device."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ..record.io import string_codes


@dataclass
class Layout:
    """Where each call of a forward sits in its block (the same for every replay of a graph).
    Every call of a forward digests the forward's rows, so call i holds rows [i * rows, (i + 1) * rows)."""
    calls: list[Any]
    rows: int
    expert_start: np.ndarray  # per call: its ids' first element in the block's `experts`
    expert_width: np.ndarray  # per call: k of a router's choice, 0 for any other call


@dataclass
class Block:
    """A forward's calls packed into one tensor per column; finish() puts them module by module."""
    key: int  # index into Tracer._keys
    layout: Layout
    digests: torch.Tensor  # [calls * rows]
    samples: torch.Tensor  # [calls * rows, SAMPLES]
    experts: torch.Tensor | None  # int32, the routers' [rows, k] ids laid end to end
    keep: tuple = ()  # what a captured graph's digest launches read (their tables): alive as long as the block


@dataclass
class Rows:
    """The trace's rows, module by module, as places in the blocks. A *segment* is one call's
    kept rows: segments go module by module, each module's calls in order. Per segment: its
    block and call number in the block, its first row in the blocks' columns laid end to end,
    its kept row count and its key; per module its row count and its calls' keys."""
    counts: np.ndarray
    module_keys: list[np.ndarray]
    module_segs: np.ndarray  # module j's calls are segments [module_segs[j], module_segs[j + 1])
    seg_block: np.ndarray
    seg_call: np.ndarray
    seg_first: np.ndarray
    seg_rows: np.ndarray
    seg_key: np.ndarray
    sel: list[np.ndarray]  # per block: its kept rows
    token_of_key: list[np.ndarray]

    @staticmethod
    def build(blocks: list[Block], calls: list[Any], live: dict[int, np.ndarray],
              token_of_key: list[np.ndarray]) -> "Rows":
        number = {id(c): j for j, c in enumerate(calls)}
        per_layout: dict[int, np.ndarray] = {}
        for b in blocks:
            if id(b.layout) not in per_layout:
                per_layout[id(b.layout)] = np.array([number.get(id(c), -1) for c in b.layout.calls], dtype=np.int64)
        n_calls = np.array([len(b.layout.calls) for b in blocks], dtype=np.int64)
        seg_module = np.concatenate([per_layout[id(b.layout)] for b in blocks])
        seg_block = np.repeat(np.arange(len(blocks)), n_calls)
        seg_call = np.arange(len(seg_block)) - np.repeat(np.cumsum(n_calls) - n_calls, n_calls)
        traced = seg_module >= 0  # calls of a module left out of `calls` (not one row per token) are dropped
        seg_module, seg_block, seg_call = seg_module[traced], seg_block[traced], seg_call[traced]
        by_module = np.argsort(seg_module, kind="stable")  # module by module, each module's calls in order
        seg_module, seg_block, seg_call = seg_module[by_module], seg_block[by_module], seg_call[by_module]

        sel = [live[b.key] if b.key in live else np.arange(b.layout.rows) for b in blocks]
        size = np.array([b.digests.shape[0] for b in blocks], dtype=np.int64)
        first = (np.cumsum(size) - size)[seg_block] + seg_call * np.array([b.layout.rows for b in blocks])[seg_block]
        keys = np.array([b.key for b in blocks], dtype=np.int64)[seg_block]
        n = np.array([len(s) for s in sel], dtype=np.int64)[seg_block]  # kept rows of each call
        counts = np.bincount(seg_module, weights=n, minlength=len(calls)).astype(np.int64)
        module_segs = np.concatenate(([0], np.cumsum(np.bincount(seg_module, minlength=len(calls)))))
        module_keys = np.split(keys, module_segs[1:-1])
        return Rows(counts, module_keys, module_segs, seg_block, seg_call, first, n, keys, sel, token_of_key)

    def index(self, device: torch.device) -> torch.Tensor:
        """Each row's place in the blocks' columns laid end to end: segment s's rows are
        seg_first[s] + its block's kept rows. A trace runs to tens of millions of rows, so on a
        GPU the index is made there from the segments alone (no host array of it, no copy);
        on the CPU numpy's concatenation is the cheaper way to the same index."""
        return self.index_on_host() if device.type == "cpu" else self.index_on_device(device)

    def index_on_host(self) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(
            [f + self.sel[b] for f, b in zip(self.seg_first.tolist(), self.seg_block.tolist())]))

    def index_on_device(self, device: torch.device) -> torch.Tensor:
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        seg = torch.repeat_interleave(put(self.seg_rows))  # each row's segment
        sizes = np.array([len(s) for s in self.sel], dtype=np.int64)
        kept, kept_start = put(np.concatenate(self.sel).astype(np.int64)), put(np.cumsum(sizes) - sizes)
        within = torch.arange(len(seg), device=device) - put(np.cumsum(self.seg_rows) - self.seg_rows)[seg]
        return put(self.seg_first)[seg] + kept[kept_start[put(self.seg_block)[seg]] + within]

    def per_row(self, of_key: list[np.ndarray]) -> np.ndarray:
        """A value per row, from one array per key (its kept rows' values, in order)."""
        return np.concatenate([of_key[k] for k in self.seg_key.tolist()])

    @functools.cached_property
    def token(self) -> np.ndarray:
        """Each row's token (an index into Tracer._tokens' tokens)."""
        return self.per_row(self.token_of_key)

    def experts(self, blocks: list[Block], j: int) -> np.ndarray:
        """Module j's (a router's choice) ids, [rows, k], in its rows' order."""
        parts = []
        for s in range(self.module_segs[j], self.module_segs[j + 1]):
            b, c = blocks[self.seg_block[s]], self.seg_call[s]
            k = int(b.layout.expert_width[c])
            start = int(b.layout.expert_start[c])
            ids = b.experts[start:start + b.layout.rows * k].reshape(b.layout.rows, k)
            parts.append(ids[torch.from_numpy(self.sel[self.seg_block[s]]).to(ids.device)])
        return torch.cat(parts).cpu().numpy()


_STAGE_BYTES = 32 << 20
_stages: dict[torch.device, list[torch.Tensor]] = {}


def to_host(t: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host, through two page-locked staging buffers per device
    (kept for the process): a piece is copied off the device into one while the other's is
    copied into the array. A pageable copy of a trace's hundreds of MB goes through the
    driver's bounce buffer; a page-locked buffer the trace's size costs more to allocate than
    to fill, and torch's own cache of them is emptied by every CUDA graph capture. (The array is
    NumPy's own, which NumPy backs with huge pages where the system allows; one in Arrow's pool,
    which the table could take without a copy, was not faster.)"""
    if not t.is_cuda:
        return t.numpy()
    out = np.empty(t.shape, dtype=torch.empty(0, dtype=t.dtype).numpy().dtype)
    src, dst = t.contiguous().reshape(-1).view(torch.uint8), out.reshape(-1).view(np.uint8)
    stages = _stages.get(t.device)
    if stages is None:
        stages = _stages[t.device] = [torch.empty(_STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    pending = None
    for i, start in enumerate(range(0, src.numel(), _STAGE_BYTES)):
        n = min(_STAGE_BYTES, src.numel() - start)
        stage = stages[i % 2]  # its last piece was taken out in the previous round
        stage[:n].copy_(src[start:start + n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if pending is not None:
            _unstage(dst, *pending)
        pending = (start, n, stage, done)
    if pending is not None:
        _unstage(dst, *pending)
    return out


def _unstage(dst: np.ndarray, start: int, n: int, stage: torch.Tensor, done: Any) -> None:
    done.synchronize()
    dst[start:start + n] = stage[:n].numpy()


def experts_column(row_counts: list[int], ids: list[np.ndarray | None], sel: np.ndarray | None) -> pa.Array:
    """The trace's `experts` column in row order `sel` (None: every row as concatenated): each
    routing row's sorted ids, null on every other row. Per module, in the order its rows were
    concatenated: its row count and its ids [rows, k] (None for a module that is not a router's
    choice)."""
    if all(e is None for e in ids):
        return pa.nulls(sum(row_counts) if sel is None else len(sel), pa.list_(pa.int32()))
    width = np.concatenate([np.full(n, -1 if e is None else e.shape[1], dtype=np.int64)
                            for n, e in zip(row_counts, ids)])
    values = np.concatenate([e.reshape(-1) for e in ids if e is not None]).astype(np.int32)
    length = np.maximum(width, 0)
    start = np.cumsum(length) - length  # where each row's ids begin in `values`
    if sel is not None:
        width, length, start = width[sel], length[sel], start[sel]
    offsets = np.concatenate(([0], np.cumsum(length))).astype(np.int32)
    gather = np.repeat(start - offsets[:-1], length) + np.arange(offsets[-1])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[gather], type=pa.int32()),
                                    mask=pa.array(width < 0))


def kept_rows(rows: Rows, disjoint: bool) -> np.ndarray | None:
    """The trace's rows to keep, None for all of them: only a token that is in two forwards, or
    a module called twice in one forward, can make a module name a token twice."""
    counts = rows.counts
    distinct = [disjoint and len(np.unique(keys)) == len(keys) for keys in rows.module_keys]
    if all(distinct):
        return None
    starts = np.cumsum(counts) - counts
    token = rows.token
    kept = [None if d else first_calls(token[s:s + n]) for d, s, n in zip(distinct, starts, counts)]
    if all(k is None for k in kept):
        return None
    return np.concatenate([np.arange(n) + start if k is None else k + start
                           for k, n, start in zip(kept, counts, starts)])


def first_calls(token: np.ndarray) -> np.ndarray | None:
    """Which of a module's rows to keep: a module called twice at one token (a shared module)
    keeps its first call. None: every row."""
    first = np.sort(np.unique(token, return_index=True)[1])
    return None if len(first) == len(token) else first


def traced_tokens(keys: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list[str], tuple[np.ndarray, np.ndarray],
                                                                     list[np.ndarray], bool]:
    """The traced tokens (prompt, position) of the forwards' keys (prompt ids, positions): the sorted
    prompt ids, each token's (prompt code, position), per forward the token of each of its rows,
    and whether no token is in two forwards."""
    pids = np.concatenate([p for p, _ in keys]).tolist()
    pos = np.concatenate([q for _, q in keys]).astype(np.int64)
    prompts, code = string_codes(pids)
    span = int(pos.max()) + 1 if len(pos) else 1
    tokens, token = np.unique(code * span + pos, return_inverse=True)
    split = np.cumsum([len(q) for _, q in keys])[:-1]
    return (prompts, ((tokens // span).astype(np.int32), (tokens % span).astype(np.int32)),
            np.split(token, split), len(tokens) == len(pos))
