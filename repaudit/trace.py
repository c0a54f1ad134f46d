"""Tracing: a digest of every module's output at every real position, computed on the device.

Each traced (prompt, position, module) gets a 64-bit digest of the output row's bit patterns
and the bits of a few sampled features (for ULP distances), so `repaudit locate` can name the
first module whose bits differ between two cells without the tensors ever leaving the GPU.

Under tensor parallelism a column-parallel output holds only this rank's features. The digest
is a sum over features (mod 2^64) with a key per global feature index, so each rank digests its
shard with its offset and one integer all-reduce gives the digest of the whole row; nothing
is gathered. Whether an output is sharded is found once per module, on its first call: a
replicated output has the same digest on every rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from .digest import row_digest

TRACE_VERSION = 1
SAMPLES = 8  # features per row whose bits are kept, evenly spaced over the whole row
KEY_VERSION = "repaudit.trace_version"
KEY_CELL = "repaudit.cell"
KEY_MODULES = "repaudit.trace_modules"

SCHEMA = pa.schema([
    pa.field("prompt_id", pa.dictionary(pa.int32(), pa.string()), nullable=False),
    pa.field("pos", pa.int32(), nullable=False),
    pa.field("module", pa.dictionary(pa.int32(), pa.string()), nullable=False),
    pa.field("order", pa.int32(), nullable=False),
    pa.field("digest", pa.uint64(), nullable=False),
    pa.field("sample", pa.list_(pa.uint32(), SAMPLES), nullable=False),
])
_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF, "float32"), torch.bfloat16: (torch.int16, 0xFFFF, "bfloat16"),
         torch.float16: (torch.int16, 0xFFFF, "float16")}


@dataclass
class ModuleInfo:
    name: str
    order: int  # first-call order in a forward pass: execution order
    dtype: str
    features: int  # of the whole (unsharded) output row
    sharded: bool
    style: str | None  # the module's TP style, when the model's plan names one


@dataclass
class _Calls:
    info: ModuleInfo
    pick: torch.Tensor | None = None  # local column of each sampled feature
    owned: torch.Tensor | None = None  # which sampled features this rank holds
    digests: list[torch.Tensor] = field(default_factory=list)
    samples: list[torch.Tensor] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # index into Tracer._keys, per call


class Tracer:
    """Attach to a model for one cell; the engine brackets each forward with begin()/end()."""

    def __init__(self, model: torch.nn.Module, tp: int):
        from .kernelmodes import tp_styles

        self.tp = tp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.styles = tp_styles(model)
        self.calls: dict[str, _Calls] = {}
        self._keys: list[tuple[np.ndarray, np.ndarray]] = []
        self._ctx: tuple[tuple[int, int], torch.Tensor] | None = None
        self.handles = []
        for name, module in model.named_modules():
            if not name or "rotary" in name or module is model.get_output_embeddings():
                continue
            self.handles.append(module.register_forward_hook(self._hook(name)))
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

    def end(self) -> None:
        self._ctx = None

    # ------------------------------------------------------------------ hooks
    def _hook(self, name: str):
        def hook(module, args, output):
            self._record(name, output[0] if isinstance(output, tuple) else output)
        return hook

    def _pre_hook(self, name: str):
        def hook(module, args):
            if args:
                self._record(name, args[0])
        return hook

    def _record(self, name: str, out: Any) -> None:
        if self._ctx is None or not isinstance(out, torch.Tensor) or out.dtype not in _BITS:
            return
        (batch, length), rows = self._ctx
        if out.dim() < 3 or tuple(out.shape[:2]) != (batch, length):
            return
        if hasattr(out, "to_local"):
            out = out.to_local()
        whole = out.reshape(batch * length, -1)
        calls = self.calls.get(name)
        if calls is None:
            calls = self.calls[name] = _Calls(self._classify(name, whole[rows]))
        info = calls.info
        local = whole.shape[1]
        offset = self.rank * local if info.sharded else 0
        if calls.pick is None:
            idx = torch.linspace(0, info.features - 1, SAMPLES, device=whole.device).round().long() - offset
            calls.owned = ((idx >= 0) & (idx < local)).long()
            calls.pick = idx.clamp(0, local - 1)
        # Features another rank owns count 0 in the samples; the all-reduce in finish() adds them in.
        if whole.is_cuda:
            from .digest_kernel import digest_rows  # triton: imported only where a GPU runs

            digests, samples = digest_rows(whole, rows, offset, calls.pick, calls.owned)
        else:
            flat = whole[rows]
            view, mask, _ = _BITS[flat.dtype]
            digests = row_digest(flat, rows_per_chunk=1 << 16, offset=offset)
            samples = (flat[:, calls.pick].contiguous().view(view).to(torch.int64) & mask) * calls.owned
        calls.digests.append(digests)
        calls.samples.append(samples)
        calls.keys.append(len(self._keys) - 1)

    def _classify(self, name: str, flat: torch.Tensor) -> ModuleInfo:
        sharded = False
        if self.tp > 1:
            # The same row digests on every rank mean a replicated output. (Every rank calls the
            # same modules in the same order, so this collective lines up.)
            mine = row_digest(flat)
            everyone = [torch.empty_like(mine) for _ in range(self.tp)]
            dist.all_gather(everyone, mine)
            sharded = not all(torch.equal(everyone[0], d) for d in everyone[1:])
        return ModuleInfo(name=name, order=len(self.calls), dtype=_BITS[flat.dtype][2],
                          features=flat.shape[1] * (self.tp if sharded else 1), sharded=sharded,
                          style=self.styles.get(name.split(":")[0]))

    # ------------------------------------------------------------------ results
    def finish(self) -> tuple[pa.Table, list[ModuleInfo]] | None:
        """Combine shards across ranks (every rank must call this); rank 0 gets the table."""
        names = sorted(self.calls, key=lambda n: self.calls[n].info.order)
        sharded = [n for n in names if self.calls[n].info.sharded]
        if sharded:
            flat = torch.cat([torch.cat(self.calls[n].digests) for n in sharded]
                             + [torch.cat(self.calls[n].samples).reshape(-1) for n in sharded])
            dist.all_reduce(flat)  # int64 sums wrap mod 2^64, as the digest does
            d_sizes = [sum(len(d) for d in self.calls[n].digests) for n in sharded]
            digests, samples = flat[: sum(d_sizes)].split(d_sizes), flat[sum(d_sizes):].split([s * SAMPLES for s in d_sizes])
            for n, d, s in zip(sharded, digests, samples):
                self.calls[n].digests, self.calls[n].samples = [d], [s.reshape(-1, SAMPLES)]
        if self.rank != 0 or not names:
            return None
        columns: dict[str, list] = {k: [] for k in ("prompt_id", "pos", "module", "order", "digest", "sample")}
        for n in names:
            c = self.calls[n]
            pids = np.concatenate([self._keys[k][0] for k in c.keys])
            pos = np.concatenate([self._keys[k][1] for k in c.keys])
            columns["prompt_id"].append(pids)
            columns["pos"].append(pos.astype(np.int32))
            columns["module"].append(np.full(len(pos), n, dtype=object))
            columns["order"].append(np.full(len(pos), c.info.order, dtype=np.int32))
            columns["digest"].append(torch.cat(c.digests).cpu().numpy().view(np.uint64))
            columns["sample"].append(torch.cat(c.samples).cpu().numpy().astype(np.uint32))
        cat = {k: np.concatenate(v) for k, v in columns.items()}
        order = np.lexsort((cat["order"], cat["pos"], cat["prompt_id"].astype(str)))
        keep = _first_of_each(cat["prompt_id"][order], cat["pos"][order], cat["order"][order])
        sel = order[keep]
        samples = cat["sample"][sel]
        table = pa.Table.from_arrays([
            pa.array(cat["prompt_id"][sel].astype(str)).dictionary_encode(),
            pa.array(cat["pos"][sel]),
            pa.array(cat["module"][sel].astype(str)).dictionary_encode(),
            pa.array(cat["order"][sel]),
            pa.array(cat["digest"][sel]),
            pa.FixedSizeListArray.from_arrays(pa.array(samples.reshape(-1)), SAMPLES),
        ], schema=SCHEMA)
        return table, [self.calls[n].info for n in names]


def _first_of_each(pid: np.ndarray, pos: np.ndarray, order: np.ndarray) -> np.ndarray:
    """A module called twice at one position (a shared module) keeps its first call."""
    if not len(pid):
        return np.zeros(0, dtype=bool)
    same = (pid[1:] == pid[:-1]) & (pos[1:] == pos[:-1]) & (order[1:] == order[:-1])
    return np.concatenate(([True], ~same))


def trace_path(record_path: str | os.PathLike) -> Path:
    p = Path(record_path)
    return p if p.name.endswith(".trace.parquet") else p.with_name(p.name.removesuffix(".parquet") + ".trace.parquet")


def write_trace(path: Path, table: pa.Table, modules: list[ModuleInfo], cell: dict[str, Any]) -> Path:
    from .files import write_parquet_atomic

    meta = {KEY_VERSION: str(TRACE_VERSION).encode(), KEY_CELL: json.dumps(cell, sort_keys=True).encode(),
            KEY_MODULES: json.dumps([asdict(m) for m in modules]).encode()}
    return write_parquet_atomic(path, table.replace_schema_metadata(meta))
