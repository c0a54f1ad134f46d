"""Tracing: a digest of every module's output at every real position, computed on the device.

Each traced (prompt, position, module) gets a 64-bit digest of the output row's bit patterns
and the bits of a few sampled features (for ULP distances), so `repaudit locate` can name the
first module whose bits differ between two cells without the tensors ever leaving the GPU.

Under tensor parallelism a column-parallel output holds only this rank's features. The digest
is a sum over features (mod 2^64) with a key per global feature index, so each rank digests its
shard with its offset and one integer all-reduce gives the digest of the whole row; nothing
is gathered. Whether an output is sharded comes from the model's TP plan, never from the bits
(ranks that disagree on a replicated output are the very fault to find, not a sign of a
shard): a style that declares its output layout decides; any other module's output is a shard
exactly when one of its inputs is (Qwen3's per-head q_norm, the MLP activation). Ranks that
disagree on a replicated output are counted per module, a finding of their own.

A decode step tells the tracer its rows without reading anything from the device
(begin_step): every row of the step is digested, and finish() keeps the rows that were live.
So a traced decode loop never waits for the device, and its steps can be replayed from a CUDA
graph: the graph holds the hooks' kernels, and after each replay the caller hands the tracer
copies of their outputs (mark / take_since / replay).

A mixture-of-experts layer's fused experts module is called with the router's choice
(hidden, top_k_index, top_k_weights), whatever router made it: its pre-hook records, per real
token, the chosen expert ids sorted ascending (the set, not the router's ranking) as the row
`NAME:routing`, the ids' int32 bits digested like any output and kept whole for `locate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from ..record.digest import row_digest
from ..record.tracefile import SAMPLES, SCHEMA, ModuleInfo
from .experts import is_experts

_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF, "float32"), torch.bfloat16: (torch.int16, 0xFFFF, "bfloat16"),
         torch.float16: (torch.int16, 0xFFFF, "float16")}


@dataclass
class _Calls:
    info: ModuleInfo
    pick: torch.Tensor | None = None  # local column of each sampled feature
    owned: torch.Tensor | None = None  # which sampled features this rank holds
    digests: list[torch.Tensor] = field(default_factory=list)
    samples: list[torch.Tensor] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # index into Tracer._keys, per call
    experts: list[torch.Tensor] = field(default_factory=list)  # routing rows: sorted expert ids [rows, k]


class Tracer:
    """Attach to a model for one cell; the engine brackets each forward with begin()/end()."""

    def __init__(self, model: torch.nn.Module, tp: int):
        from .kernelmodes import tp_styles

        self.tp = tp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.styles = tp_styles(model)
        self.calls: dict[str, _Calls] = {}
        self._keys: list[tuple[np.ndarray, np.ndarray]] = []
        # Decode steps' keys, settled in finish(): key index -> (positions, live rows), on the device.
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._all_rows: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._ctx: tuple[tuple[int, int], torch.Tensor] | None = None
        # Storages of this forward's sharded outputs. A weak reference keeps a storage's identity
        # unique while it lives on, so freed memory handed to a new tensor is never taken for a shard.
        self._shards: set[StorageWeakRef] = set()
        self.handles = []
        experts = [name for name, module in model.named_modules() if is_experts(module)]
        for name, module in model.named_modules():
            if not name or "rotary" in name or module is model.get_output_embeddings():
                continue
            if any(name.startswith(e + ".") for e in experts):
                continue  # inside the experts, rows are (token, slot) pairs grouped by expert: no token's row
            self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
            if name in experts:
                self.handles.append(module.register_forward_pre_hook(self._routing_hook(name), with_kwargs=True))
            if self.styles.get(name, "").startswith("rowwise"):
                # A row-parallel layer's input is the attention output / MLP activation: no module makes it.
                self.handles.append(module.register_forward_pre_hook(self._pre_hook(f"{name}:input")))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ engine side
    def begin(self, batch: int, length: int, rows: torch.Tensor, prompt_ids: np.ndarray, pos: np.ndarray) -> None:
        """The next forward runs on [batch, length] tokens; `rows` are the real ones (flat indices)."""
        self._keys.append((prompt_ids, pos))
        self._ctx = ((batch, length), rows)

    def begin_step(self, prompt_ids: np.ndarray, pos: torch.Tensor, live: torch.Tensor) -> None:
        """The next forward is one decode step of len(prompt_ids) rows (one token each) at
        positions `pos`, of which `live` (bool) are real; both stay on the device until finish()."""
        batch = len(prompt_ids)
        key = (batch, pos.device)
        if key not in self._all_rows:  # kept: a captured graph reads this very tensor
            self._all_rows[key] = torch.arange(batch, device=pos.device)
        self._pending[len(self._keys)] = (pos.clone(), live.clone())
        self._keys.append((np.asarray(prompt_ids, dtype=object), np.zeros(0, dtype=np.int64)))
        self._ctx = ((batch, 1), self._all_rows[key])

    def end(self) -> None:
        self._ctx = None
        self._shards.clear()

    # ------------------------------------------------------------------ CUDA graphs
    def mark(self) -> dict[str, int]:
        """Where every module's recorded calls end now."""
        return {name: len(c.digests) for name, c in self.calls.items()}

    def take_since(self, mark: dict[str, int]) -> list[tuple[_Calls, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Remove and return the calls recorded after `mark` (a graph capture's: their tensors
        are the graph's, rewritten by every replay), in each module's call order."""
        taken = []
        for name, c in self.calls.items():
            n = mark.get(name, 0)
            for i in range(n, len(c.digests)):
                taken.append((c, c.digests[i], c.samples[i], c.experts[i] if c.info.routing else None))
            del c.digests[n:], c.samples[n:], c.keys[n:]
            if c.info.routing:
                del c.experts[n:]
        return taken

    def replay(self, taken: list[tuple[_Calls, torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """Record a replayed graph's calls (take_since's answer at its capture) for the current
        forward: copies, since the next replay rewrites them."""
        if not taken:
            return
        key = len(self._keys) - 1
        # Two copies for the whole step, not two per module: a step of a 28-layer model would
        # otherwise launch some 900 small copies after a replay that is itself one launch.
        digests = torch.cat([d for _, d, _, _ in taken]).split([d.shape[0] for _, d, _, _ in taken])
        samples = torch.cat([s for _, _, s, _ in taken]).split([s.shape[0] for _, _, s, _ in taken])
        for (calls, _, _, experts), d, s in zip(taken, digests, samples):
            calls.digests.append(d)
            calls.samples.append(s)
            calls.keys.append(key)
            if experts is not None:
                calls.experts.append(experts.clone())

    # ------------------------------------------------------------------ hooks
    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            self._record(name, output[0] if isinstance(output, tuple) else output, [*args, *kwargs.values()])
        return hook

    def _pre_hook(self, name: str):
        def hook(module, args):
            if args:
                self._record(name, args[0], [args[0]])
        return hook

    def _routing_hook(self, name: str):
        def hook(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if self._ctx is None or not isinstance(ids, torch.Tensor) or ids.is_floating_point():
                return
            if hasattr(ids, "to_local"):
                ids = ids.to_local()
            ids = ids[:, None] if ids.dim() == 1 else ids  # top-1 routers may hand over [tokens]
            chosen = ids.reshape(-1, ids.shape[-1]).sort(dim=-1).values.to(torch.int32)  # [tokens, k]
            # The ids' bits go through the float digest path unchanged (a view, no arithmetic).
            calls = self._record(f"{name}:routing", chosen.view(torch.float32), [], routing=True)
            if calls is not None:
                calls.experts.append(chosen[self._ctx[1]])
        return hook

    def _record(self, name: str, out: Any, inputs: list[Any], routing: bool = False) -> _Calls | None:
        if self._ctx is None or not isinstance(out, torch.Tensor) or out.dtype not in _BITS:
            return None
        (batch, length), rows = self._ctx
        # [batch, length, ...] or, as MoE layers flatten them, [batch * length, features]
        per_token = (out.dim() >= 3 and tuple(out.shape[:2]) == (batch, length)) or \
            (out.dim() == 2 and out.shape[0] == batch * length)
        if not per_token:
            return None
        if hasattr(out, "to_local"):
            out = out.to_local()
        whole = out.reshape(batch * length, -1)
        calls = self.calls.get(name)
        if calls is None:
            calls = self.calls[name] = _Calls(self._classify(name, whole, inputs, routing))
        info = calls.info
        if info.sharded:
            self._shards.add(StorageWeakRef(out.untyped_storage()))
        local = whole.shape[1]
        offset = self.rank * local if info.sharded else 0
        if calls.pick is None:
            idx = torch.linspace(0, info.features - 1, SAMPLES, device=whole.device).round().long() - offset
            calls.owned = ((idx >= 0) & (idx < local)).long()
            calls.pick = idx.clamp(0, local - 1)
        # Features another rank owns count 0 in the samples; the all-reduce in finish() adds them in.
        if whole.is_cuda:
            from ..record.digest_kernel import digest_rows  # triton: imported only where a GPU runs

            digests, samples = digest_rows(whole, rows, offset, calls.pick, calls.owned)
        else:
            flat = whole[rows]
            view, mask, _ = _BITS[flat.dtype]
            digests = row_digest(flat, rows_per_chunk=1 << 16, offset=offset)
            samples = (flat[:, calls.pick].contiguous().view(view).to(torch.int64) & mask) * calls.owned
        calls.digests.append(digests)
        calls.samples.append(samples)
        calls.keys.append(len(self._keys) - 1)
        return calls

    def _classify(self, name: str, flat: torch.Tensor, inputs: list[Any], routing: bool = False) -> ModuleInfo:
        base, _, port = name.partition(":")
        style = self.styles.get(base)
        if routing:  # the router's choice: the same on every rank by construction of TP, never a shard
            return ModuleInfo(name=name, order=len(self.calls), dtype="int32", features=flat.shape[1],
                              sharded=False, style=style, routing=True)
        sharded = self.tp > 1 and _sharded(style, port == "input", lambda: any(self._is_shard(t) for t in inputs))
        return ModuleInfo(name=name, order=len(self.calls), dtype=_BITS[flat.dtype][2],
                          features=flat.shape[1] * (self.tp if sharded else 1), sharded=sharded, style=style)

    def _is_shard(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if hasattr(t, "to_local"):
            t = t.to_local()
        try:
            return StorageWeakRef(t.untyped_storage()) in self._shards
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: no shard of ours
            return False

    # ------------------------------------------------------------------ results
    def finish(self) -> tuple[pa.Table, list[ModuleInfo]] | None:
        """Combine shards across ranks (every rank must call this); rank 0 gets the table."""
        self._settle()
        names = sorted(self.calls, key=lambda n: self.calls[n].info.order)
        replicated = [n for n in names if not self.calls[n].info.sharded]
        if self.tp > 1 and replicated:
            self._find_rank_disagreements(replicated)
        sharded = [n for n in names if self.calls[n].info.sharded]
        if sharded:
            flat = torch.cat([torch.cat(self.calls[n].digests) for n in sharded]
                             + [torch.cat(self.calls[n].samples).reshape(-1) for n in sharded])
            dist.all_reduce(flat)  # int64 sums wrap mod 2^64, as the digest does
            d_sizes = [sum(d.shape[0] for d in self.calls[n].digests) for n in sharded]
            digests, samples = flat[: sum(d_sizes)].split(d_sizes), flat[sum(d_sizes):].split([s * SAMPLES for s in d_sizes])
            for n, d, s in zip(sharded, digests, samples):
                self.calls[n].digests, self.calls[n].samples = [d], [s.reshape(-1, SAMPLES)]
        if self.rank != 0 or not names:
            return None
        calls = [self.calls[n] for n in names]
        prompts, (code, pos), token_of_key, disjoint = self._tokens()
        # Rows stay as they were recorded, module by module in execution order (each module's
        # rows in the order of its calls): a trace holds tokens x modules rows, tens of millions
        # for a suite of long prompts, and no reader needs another order (locate joins on keys).
        # The key columns are each forward's, laid end to end: no gather over the whole trace.
        counts = [sum(len(token_of_key[k]) for k in c.keys) for c in calls]
        key_code, key_pos = [code[t] for t in token_of_key], [pos[t] for t in token_of_key]
        row_code = np.concatenate([key_code[k] for c in calls for k in c.keys])
        row_pos = np.concatenate([key_pos[k] for c in calls for k in c.keys])
        module = np.repeat(np.arange(len(calls), dtype=np.int32), counts)
        order = np.repeat(np.array([c.info.order for c in calls], dtype=np.int32), counts)
        sel = _kept_rows(calls, token_of_key, counts, disjoint)
        # One copy off the device per column; a sample's uint32 bits are made on the device.
        digest = _host(torch.cat([d for c in calls for d in c.digests])).view(np.uint64)
        sample = _host(torch.cat([x for c in calls for x in c.samples]).to(torch.int32)).view(np.uint32)
        experts = [torch.cat(c.experts).cpu().numpy() if c.info.routing else None for c in calls]
        if sel is not None:
            row_code, row_pos, module, order = row_code[sel], row_pos[sel], module[sel], order[sel]
            digest, sample = digest[sel], sample[sel]
        table = pa.Table.from_arrays([
            pa.DictionaryArray.from_arrays(pa.array(row_code), pa.array(prompts, pa.string())),
            pa.array(row_pos),
            pa.DictionaryArray.from_arrays(pa.array(module), pa.array(names, pa.string())),
            pa.array(order),
            pa.array(digest),
            pa.FixedSizeListArray.from_arrays(pa.array(sample.reshape(-1)), SAMPLES),
            _experts_column(counts, experts, sel),
        ], schema=SCHEMA)
        return table, [c.info for c in calls]

    def _settle(self) -> None:
        """Decode steps' rows that were not live go; their keys get their positions. One host
        copy per step's two vectors, one gather per module and column. Only finish() reads the
        rows after this, module by module, so each module's rows stay one tensor (splitting
        them back per forward cost more than the gather, for finish to concatenate again)."""
        if not self._pending:
            return
        keep: dict[int, np.ndarray] = {}
        for k, (pos, live) in self._pending.items():
            keep[k] = live.cpu().numpy().astype(bool)
            self._keys[k] = (self._keys[k][0][keep[k]], pos.cpu().numpy().astype(np.int64)[keep[k]])
        self._pending.clear()
        # One gather for all modules at once: per module it would be some 500 rounds of a
        # concatenation, an index upload and a gather, each mostly launch overhead.
        settle = [c for c in self.calls.values() if any(k in keep for k in c.keys)]
        if not settle:
            return
        rows = np.concatenate([keep[k] if k in keep else np.ones(d.shape[0], dtype=bool)
                               for c in settle for k, d in zip(c.keys, c.digests)])
        sizes = [sum(d.shape[0] for d in c.digests) for c in settle]
        starts = np.cumsum([0, *sizes[:-1]])
        device = settle[0].digests[0].device
        index = torch.from_numpy(np.flatnonzero(rows)).to(device)
        kept = np.add.reduceat(rows, starts, dtype=np.int64).tolist()
        digests = torch.cat([d for c in settle for d in c.digests])[index].split(kept)
        samples = torch.cat([x for c in settle for x in c.samples])[index].split(kept)
        for c, d, x, start, size in zip(settle, digests, samples, starts, sizes):
            c.digests, c.samples = [d], [x]
            if c.info.routing:  # a router's experts rows are its digest rows: the same slice of `rows`
                mine = torch.from_numpy(np.flatnonzero(rows[start:start + size])).to(device)
                c.experts = [torch.cat(c.experts)[mine]]

    def _tokens(self) -> tuple[list[str], tuple[np.ndarray, np.ndarray], list[np.ndarray], bool]:
        """The traced tokens (prompt, position): the sorted prompt ids, each token's (prompt code,
        position), per forward the token of each of its rows, and whether no token is in two
        forwards."""
        pids = np.concatenate([p for p, _ in self._keys]).astype(str)
        pos = np.concatenate([q for _, q in self._keys]).astype(np.int64)
        prompts, code = np.unique(pids, return_inverse=True)
        span = int(pos.max()) + 1 if len(pos) else 1
        tokens, token = np.unique(code.astype(np.int64) * span + pos, return_inverse=True)
        split = np.cumsum([len(q) for _, q in self._keys])[:-1]
        return (prompts.tolist(), ((tokens // span).astype(np.int32), (tokens % span).astype(np.int32)),
                np.split(token, split), len(tokens) == len(pos))

    def _rows_of(self, calls: _Calls) -> tuple[np.ndarray, np.ndarray]:
        """(prompt id, position) of each digest row of a module, in the order they were recorded."""
        return (np.concatenate([self._keys[k][0] for k in calls.keys]),
                np.concatenate([self._keys[k][1] for k in calls.keys]))

    def _find_rank_disagreements(self, names: list[str]) -> None:
        """Rows of replicated outputs whose bits differ between ranks. The trace keeps rank 0's
        digests; this says where the others differ from them. The row's max and min over ranks
        (two all-reduces, nothing gathered) differ exactly where some rank disagrees."""
        mine = torch.cat([d for n in names for d in self.calls[n].digests])
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        differ = (high != low).cpu().numpy()
        sizes = [sum(d.shape[0] for d in self.calls[n].digests) for n in names]
        for n, rows in zip(names, np.split(differ, np.cumsum(sizes)[:-1])):
            info = self.calls[n].info
            info.ranks_disagree = int(rows.sum())
            if info.ranks_disagree:
                pids, pos = self._rows_of(self.calls[n])
                first = int(np.argmax(rows))
                info.first_disagreement = {"prompt_id": str(pids[first]), "pos": int(pos[first])}


def _host(t: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host: one copy into page-locked memory, which runs at
    the link's speed (a pageable copy of a trace's hundreds of MB goes through a bounce
    buffer), and which torch's host allocator keeps for the next cell's trace."""
    if not t.is_cuda:
        return t.numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host.numpy()


def _experts_column(row_counts: list[int], ids: list[np.ndarray | None], sel: np.ndarray | None) -> pa.Array:
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


def _kept_rows(calls: list[_Calls], token_of_key: list[np.ndarray], counts: list[int], disjoint: bool) -> np.ndarray | None:
    """The trace's rows to keep, None for all of them: only a token that is in two forwards, or
    a module called twice in one forward, can make a module name a token twice."""
    distinct = [disjoint and len(set(c.keys)) == len(c.keys) for c in calls]
    if all(distinct):
        return None
    kept = [None if d else _first_calls(np.concatenate([token_of_key[k] for k in c.keys])) for d, c in zip(distinct, calls)]
    if all(k is None for k in kept):
        return None
    return np.concatenate([np.arange(n) + start if k is None else k + start
                           for k, n, start in zip(kept, counts, np.cumsum([0, *counts]))])


def _first_calls(token: np.ndarray) -> np.ndarray | None:
    """Which of a module's rows to keep: a module called twice at one token (a shared module)
    keeps its first call. None: every row."""
    first = np.sort(np.unique(token, return_index=True)[1])
    return None if len(first) == len(token) else first


def _sharded(style: str | None, at_input: bool, input_is_shard) -> bool:
    """Is this output (or, at_input, a row-parallel layer's input) a shard? From the TP style's
    declared layout where it declares one, else from the inputs (input_is_shard, called lazily)."""
    declared = _declared_layouts(style)[0 if at_input else 1] if style else None
    return declared if declared is not None else input_is_shard()


# packed_colwise shards its output as colwise does, but its style object declares no layout.
_UNDECLARED_OUTPUT = {"packed_colwise": True}


@lru_cache(maxsize=None)
def _declared_layouts(style: str) -> tuple[bool | None, bool | None]:
    """(input sharded, output sharded) as transformers' TP style declares them; None: not declared."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    layer = ALL_PARALLEL_STYLES[style] if style in ALL_PARALLEL_STYLES else None

    def has_shard(layouts: Any) -> bool | None:
        if layouts is None:
            return None
        return any(isinstance(p, Shard) for p in (layouts if isinstance(layouts, tuple) else (layouts,)))

    output = _UNDECLARED_OUTPUT.get(style, has_shard(getattr(layer, "output_layouts", None)))
    return has_shard(getattr(layer, "input_layouts", None)), output
