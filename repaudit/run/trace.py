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
graph: the graph holds the hooks' kernels and packs their outputs into one block (mark /
take_since / pack at the capture), and after each replay the tracer keeps a copy of the block
(replay). Every forward ends as one such block; tracerows.py puts their rows in the table's order.

Inside a capture (capturing()) a hook only holds its output; the forward's outputs are digested
together, one launch per element width (digest_many), where one launch an output cost more than
its few rows' hashing. That reads an output after its module returned, so one changed in place
later in the step would be digested changed: the graph's warm-up forward (warming()) digests
each module's output at its hook and deferred, once per output layout, and a module whose two
digests differ, or whose output's version counter moved, is digested at its hook from then on
(with a warning). The capture runs the warm-up's code (no host branch on the device's values);
where outputs have a version counter (not under inference mode) a change the warm-up did not
see fails the capture.

A mixture-of-experts layer's fused experts module is called with the router's choice
(hidden, top_k_index, top_k_weights), whatever router made it: its pre-hook records, per real
token, the chosen expert ids sorted ascending (the set, not the router's ranking) as the row
`NAME:routing`, the ids' int32 bits digested like any output and kept whole for `locate`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from ..record.tracefile import SAMPLES, SCHEMA, ModuleInfo
from .experts import is_experts
from .tplayouts import shard_span, sharded_output
from .tracedigests import BITS, MAX_HELD_BYTES, MAX_HELD_ROWS, Held, differing, digest_held, digest_now, version
from .tracerows import Block, Layout, Rows, experts_column, kept_rows, to_host, traced_tokens

@dataclass
class _Calls:
    """A traced output: a module's, a row-parallel layer's input, or a router's choice."""
    info: ModuleInfo
    pick: torch.Tensor | None = None  # local column of each sampled feature
    owned: torch.Tensor | None = None  # which sampled features this rank holds
    in_place: bool = False  # its output is changed after the hook: never deferred
    checked: set = field(default_factory=set)  # output layouts a warm-up found unchanged after the hook
    offset: int = 0  # a shard's first feature in the whole row
    width: int = 0  # this rank's features: every call's the same


@dataclass
class _Entry:
    """One call recorded in the current forward."""
    calls: _Calls
    digests: torch.Tensor  # int64 [rows]
    samples: torch.Tensor  # int32 [rows, SAMPLES]: each sampled feature's bits (zero-extended)
    experts: torch.Tensor | None = None  # a router's choice: sorted expert ids, int32 [rows, k]


class Tracer:
    """Attach to a model for one cell; the engine brackets each forward with begin()/end()."""

    def __init__(self, model: torch.nn.Module, tp: int):
        from .kernelmodes import tp_styles

        self.tp = tp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.styles = tp_styles(model)
        self.calls: dict[str, _Calls] = {}
        self._skipped: set[str] = set()  # a float output not one row per token at some call: never traced
        self._keys: list[tuple[np.ndarray, np.ndarray]] = []
        self._fwd: list[_Entry] = []  # the current forward's calls
        self._blocks: list[Block] = []  # every finished forward's, in the order they ran
        # Decode steps' keys, settled in finish(): key index -> (positions, live rows), on the device.
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._all_rows: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._ctx: tuple[tuple[int, int], torch.Tensor] | None = None
        self._defer: str | None = None  # "warming" or "capturing" while a decode graph is made
        self._deferred: list[tuple[_Entry, Held]] = []
        self._held = 0  # bytes of the outputs in _deferred
        self._tables: list[torch.Tensor] = []  # digest_many's tables of the forward being captured
        self._unfilled: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host) to copy after it
        self._table_for = None  # capturing: digest_many's table_for
        self._warmed: tuple[int, torch.device | None] = (0, None)  # the warm-up's held outputs, and their device
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
        if self._fwd:
            block = self.pack(self._fwd)
            block.key = len(self._keys) - 1
            self._blocks.append(block)
            self._fwd = []
        self._ctx = None
        self._shards.clear()

    # ------------------------------------------------------------------ CUDA graphs
    @contextlib.contextmanager
    def warming(self):
        """A graph's warm-up forward, whose calls the caller drops: outputs are held and digested
        together, as the capture will, so the kernels are built outside the capture; an output in
        a layout its module has not been checked in is digested at its hook too, and where the two
        digests differ it was changed in place after the hook: its module is then digested at the
        hook from then on."""
        self._defer = "warming"
        self._warmed = (0, None)
        try:
            yield
            self._flush()
        finally:
            self._defer, self._deferred, self._held, self._tables = None, [], 0, []

    @contextlib.contextmanager
    def capturing(self):
        """A graph's capture: outputs are digested together at the end of the forward (pack).
        Enter before the capture begins and exit after it has ended: the launches' tables are
        allocated before (a table allocated inside would share memory that the graph's earlier
        kernels write on every replay), sized by the warm-up, and filled after."""
        count, device = self._warmed
        space = torch.empty((count, 6), dtype=torch.int64, device=device) if count else None
        used = 0

        def table_for(host: torch.Tensor) -> torch.Tensor:
            nonlocal used
            if space is None or used + len(host) > len(space):
                raise RuntimeError("--trace: the capture holds more outputs than its warm-up did")
            table = space[used:used + len(host)]
            used += len(host)
            self._unfilled.append((table, host))
            return table

        self._defer, self._table_for = "capturing", table_for
        try:
            yield
            for table, host in self._unfilled:
                table.copy_(host)
        finally:
            self._defer, self._table_for, self._deferred, self._held = None, None, [], 0
            self._tables, self._unfilled = [], []

    def mark(self) -> int:
        """Where the current forward's recorded calls end now."""
        return len(self._fwd)

    def take_since(self, mark: int) -> list[_Entry]:
        """Remove and return the calls recorded after `mark`."""
        taken = self._fwd[mark:]
        del self._fwd[mark:]
        return taken

    def pack(self, entries: list[_Entry]) -> Block | None:
        """The calls as one block: one tensor per column. Run inside a graph capture (on the
        capture's calls, take_since's answer), these concatenations are the graph's own kernels,
        so a replay's trace costs replay(): two or three copies, whatever the model's size."""
        self._flush()
        keep, self._tables = tuple(self._tables), []
        if not entries:
            return None
        rows = entries[0].digests.shape[0]
        if any(e.digests.shape[0] != rows for e in entries):
            raise RuntimeError("the calls of one forward digested different rows")
        width = np.array([0 if e.experts is None else e.experts.shape[1] for e in entries], dtype=np.int64)
        ids = [e.experts.reshape(-1) for e in entries if e.experts is not None]
        return Block(-1, Layout([e.calls for e in entries], rows, np.cumsum(width * rows) - width * rows, width),
                     torch.cat([e.digests for e in entries]), torch.cat([e.samples for e in entries]),
                     torch.cat(ids) if ids else None, keep)

    def replay(self, packed: Block | None) -> None:
        """Record a replayed graph's block (pack's answer at its capture) for the current
        forward: copies, since the next replay rewrites it."""
        if packed is None:
            return
        experts = packed.experts.clone() if packed.experts is not None else None
        self._blocks.append(Block(len(self._keys) - 1, packed.layout, packed.digests.clone(), packed.samples.clone(),
                                  experts))

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
            entry = self._record(f"{name}:routing", chosen.view(torch.float32), [], routing=True)
            if entry is not None:
                entry.experts = chosen[self._ctx[1]]
        return hook

    def _record(self, name: str, out: Any, inputs: list[Any], routing: bool = False) -> _Entry | None:
        if self._ctx is None or not isinstance(out, torch.Tensor) or out.dtype not in BITS or name in self._skipped:
            return None
        (batch, length), rows = self._ctx
        # [batch, length, ...] or, as MoE layers flatten them, [batch * length, features]
        per_token = (out.dim() >= 3 and tuple(out.shape[:2]) == (batch, length)) or \
            (out.dim() == 2 and out.shape[0] == batch * length)
        if hasattr(out, "to_local"):
            out = out.to_local()
        whole = out.reshape(batch * length, -1) if per_token else None
        calls = self.calls.get(name)
        # Shaped per token at one call only, or a row that changes width (MLA's kv_b_proj expands the whole
        # cached latents: [batch, 1, cached, features], per token in shape at a decode step): no token's row.
        if whole is None or (calls is not None and whole.shape[1] != calls.width):
            self._skipped.add(name)
            return None
        if calls is None:
            calls = self.calls[name] = self._classify(name, whole, inputs, routing)
        info, local, offset = calls.info, whole.shape[1], calls.offset
        if info.sharded:
            self._shards.add(StorageWeakRef(out.untyped_storage()))
        if calls.pick is None:
            idx = torch.linspace(0, info.features - 1, SAMPLES, device=whole.device).round().long() - offset
            calls.owned = ((idx >= 0) & (idx < local)).long()
            calls.pick = idx.clamp(0, local - 1)
        # Features another rank owns count 0 in the samples; the all-reduce in finish() adds them in.
        deferred = (self._defer is not None and not routing and not calls.in_place and rows.numel() <= MAX_HELD_ROWS)
        layout = (whole.dtype, whole.shape[1], whole.stride())
        # A warm-up checks each output layout once (a digest at the hook to compare); later ones only hold.
        if deferred and (self._defer == "capturing" or layout in calls.checked):
            entry = _Entry(calls, None, None)
        else:
            entry = _Entry(calls, *digest_now(whole, rows, offset, calls.pick, calls.owned))
        if deferred:
            held = Held.of(whole, rows, offset, calls.pick, calls.owned, layout)
            self._deferred.append((entry, held))
            self._held += held.x.numel() * held.x.element_size()
            if self._held > MAX_HELD_BYTES:
                self._flush()
        self._fwd.append(entry)
        return entry

    def _flush(self) -> None:
        """Digest the held outputs in one launch per element width. Warming, compare with their
        digests at the hook; capturing, fill in their entries."""
        items, self._deferred, self._held = self._deferred, [], 0
        if not items:
            return
        moved = [e for e, h in items if version(h.x) != h.version]
        if moved and self._defer == "capturing":  # the warm-up saw no such change: refuse the capture
            raise RuntimeError(f"--trace: the output of {moved[0].calls.info.name} changed in place after "
                               "its hook during the capture")
        answers = digest_held([h for _, h in items], self._table_for, self._tables)
        if self._defer == "capturing":
            for (entry, _), (digests, samples) in zip(items, answers):
                entry.digests, entry.samples = digests, samples
            return
        count, _ = self._warmed
        self._warmed = (count + len(items), items[0][1].x.device)
        checks = [(e, h, a) for (e, h), a in zip(items, answers) if e.digests is not None]
        differ = differing([(e.digests, e.samples) for e, _, _ in checks], [a for _, _, a in checks])
        changed = {e.calls.info.name: e.calls for (e, _, _), bad in zip(checks, differ) if bad}
        changed.update({e.calls.info.name: e.calls for e in moved})
        for calls in changed.values():
            calls.in_place = True
        for e, h, _ in checks:
            e.calls.checked.add(h.layout)
        if changed:
            warnings.warn(f"--trace: the outputs of {', '.join(sorted(changed))} change in place after their module "
                          "returns; they are digested at the hook, a launch each in every decode graph", stacklevel=2)

    def _classify(self, name: str, flat: torch.Tensor, inputs: list[Any], routing: bool = False) -> _Calls:
        base, _, port = name.partition(":")
        style = self.styles.get(base)
        if routing:  # the router's choice: the same on every rank by construction of TP, never a shard
            return _Calls(ModuleInfo(name=name, order=len(self.calls), dtype="int32", features=flat.shape[1],
                                     sharded=False, style=style, routing=True), width=flat.shape[1])
        sharded = self.tp > 1 and sharded_output(style, port == "input", lambda: any(self._is_shard(t) for t in inputs))
        offset, features = shard_span(flat.shape[1], flat.device) if sharded else (0, flat.shape[1])
        return _Calls(ModuleInfo(name=name, order=len(self.calls), dtype=BITS[flat.dtype][2], features=features,
                                 sharded=sharded, style=style), offset=offset, width=flat.shape[1])

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
        """Combine shards across ranks (every rank must call this); rank 0 gets the table.

        Rows go module by module in execution order, each module's rows in the order of its
        calls: a trace holds tokens x modules rows, tens of millions for a suite of long prompts,
        and no reader needs another order (locate joins on keys). The blocks are put in that
        order by one gather per column, its index made on the host from the layouts alone."""
        live = self._settle_keys()
        names = sorted((n for n in self.calls if n not in self._skipped), key=lambda n: self.calls[n].info.order)
        if not names or not self._blocks:
            return None
        calls = [self.calls[n] for n in names]
        for i, c in enumerate(calls):  # a module classified before it was skipped leaves no gap
            c.info.order = i
        prompts, (code, pos), token_of_key, disjoint = traced_tokens(self._keys)
        rows = Rows.build(self._blocks, calls, live, token_of_key)
        counts, bounds = rows.counts, np.concatenate(([0], np.cumsum(rows.counts)))
        device = self._blocks[0].digests.device
        where = rows.index(device)
        digest = torch.cat([b.digests for b in self._blocks])[where]
        sample = torch.cat([b.samples for b in self._blocks])[where]

        def module_rows(js: list[int]) -> np.ndarray:
            return np.concatenate([np.arange(bounds[j], bounds[j + 1]) for j in js])

        sharded = [j for j, c in enumerate(calls) if c.info.sharded]
        if sharded:
            at = torch.from_numpy(module_rows(sharded)).to(device)
            # int64 sums wrap mod 2^64, as the digest does; a sample is one rank's bits plus zeros
            flat = torch.cat([digest[at], sample[at].reshape(-1).to(torch.int64)])
            dist.all_reduce(flat)
            digest[at], sample[at] = flat[:len(at)], flat[len(at):].reshape(-1, SAMPLES).to(torch.int32)
        replicated = [j for j, c in enumerate(calls) if not c.info.sharded]
        if self.tp > 1 and replicated:
            self._find_rank_disagreements(calls, replicated, digest, bounds, module_rows, rows.token, prompts, code, pos)
        if self.rank != 0:
            return None
        row_code = rows.per_row([code[t] for t in token_of_key])
        row_pos = rows.per_row([pos[t] for t in token_of_key])
        module = np.repeat(np.arange(len(calls), dtype=np.int32), counts)  # also the order: renumbered above
        sel = kept_rows(rows, disjoint)
        # One copy off the device per column.
        digest = to_host(digest).view(np.uint64)
        sample = to_host(sample).view(np.uint32)
        experts = [rows.experts(self._blocks, j) if c.info.routing else None for j, c in enumerate(calls)]
        if sel is not None:
            row_code, row_pos, module = row_code[sel], row_pos[sel], module[sel]
            digest, sample = digest[sel], sample[sel]
        module = pa.array(module)
        table = pa.Table.from_arrays([
            pa.DictionaryArray.from_arrays(pa.array(row_code), pa.array(prompts, pa.string())),
            pa.array(row_pos),
            pa.DictionaryArray.from_arrays(module, pa.array(names, pa.string())),
            module,
            pa.array(digest),
            pa.FixedSizeListArray.from_arrays(pa.array(sample.reshape(-1)), SAMPLES),
            experts_column(counts, experts, sel),
        ], schema=SCHEMA)
        return table, [c.info for c in calls]

    def _settle_keys(self) -> dict[int, np.ndarray]:
        """Decode steps' keys keep their live rows and get their positions: one host copy for
        all steps. Returns each decode key's live rows (indices into the step's rows)."""
        if not self._pending:
            return {}
        steps = list(self._pending.items())
        self._pending.clear()
        pos = torch.cat([p.reshape(-1) for _, (p, _) in steps]).cpu().numpy().astype(np.int64)
        live = torch.cat([v.reshape(-1) for _, (_, v) in steps]).cpu().numpy().astype(bool)
        split = np.cumsum([p.numel() for _, (p, _) in steps])[:-1]
        kept = {}
        for (k, _), p, v in zip(steps, np.split(pos, split), np.split(live, split)):
            self._keys[k] = (self._keys[k][0][v], p[v])
            kept[k] = np.flatnonzero(v)
        return kept

    def _find_rank_disagreements(self, calls, js, digest, bounds, module_rows, token, prompts, code, pos) -> None:
        """Rows of replicated outputs whose bits differ between ranks. The trace keeps rank 0's
        digests; this says where the others differ from them. The row's max and min over ranks
        (two all-reduces, nothing gathered) differ exactly where some rank disagrees."""
        at = module_rows(js)
        mine = digest[torch.from_numpy(at).to(digest.device)]
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        differ = (high != low).cpu().numpy()
        sizes = [bounds[j + 1] - bounds[j] for j in js]
        for j, rows, first_row in zip(js, np.split(differ, np.cumsum(sizes)[:-1]), bounds[js]):
            info = calls[j].info
            info.ranks_disagree = int(rows.sum())
            if info.ranks_disagree:
                t = token[first_row + int(np.argmax(rows))]
                info.first_disagreement = {"prompt_id": str(prompts[code[t]]), "pos": int(pos[t])}
