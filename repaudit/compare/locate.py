"""`repaudit locate A B`: which module first changes the bits, and how the difference grows.

Reads the two cells' traces (cells/<cell>.trace.parquet, written by `repaudit run --trace`),
aligns them on (prompt, position, module) and compares digests. The lm_head is not traced: its
output, the logits row of position p, is compared through the records' row digests (the record
row at p + 1 holds it), as the module after every traced one. Per prompt, the first divergence
is the differing output earliest in execution order: the earliest forward (a generate cell's
prefill, then its decode steps one by one), in it the earliest module, then the lowest position;
the run's first divergence is the earliest forward and module over all prompts. Per module,
per module, the table counts differing positions and the largest ULP distance among the
sampled features (a lower bound on the row's largest distance; for the lm_head, the distance of
the recorded token's logprob where both cells recorded the same token). Separately, each trace says
where its own ranks disagreed on an output every rank should hold whole (a replicated one):
"ranks disagree at module X" is a divergence inside one cell, reported before any other.

Only positions whose inputs are the same in both cells are compared: where the cells' records
(the .parquet next to each trace) hold a different token at some position of a sequence (a
generate cell that picked another token), that position and every later one of the sequence
are left out, since their inputs or contexts differ and every module output there would differ
for that reason alone. The divergence that made the token flip is at an earlier position, which
is compared. The count of positions left out is part of the result.

For a mixture-of-experts model the traces also hold each MoE layer's routing (the experts the
router chose, per token); the routing section gives, per layer in forward order, how many
common tokens got the same set of experts, the first layer where any differs, and the
agreement rate over all (token, layer) pairs. A model without routing rows has no such section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputError
from ..record.floats import ulp_distance_bits
from ..record.tracefile import KEY_CELL, KEY_MODULES, KEY_VERSION, READABLE_VERSIONS, trace_path
from .locate_records import LM_HEAD, dictionary_codes, forks, forward_index, lm_head_rows, read_records


@dataclass
class ModuleDiff:
    name: str
    order: int
    style: str | None
    compared: int
    differing: int
    max_ulp: int  # over the sampled features; NaN-vs-number samples are counted in nan_mismatch
    nan_mismatch: int


@dataclass
class RankDisagreement:
    side: str  # "A" or "B"
    cell: str
    module: str
    order: int
    rows: int  # positions whose output bits are not the same on every rank
    first: dict[str, Any] | None  # {"prompt_id", "pos"} of the first of them

    def sentence(self) -> str:
        where = f", first at {self.first['prompt_id']} pos {self.first['pos']}" if self.first else ""
        return f"ranks disagree at module {self.module} in {self.side} ({self.cell}: {self.rows} positions{where})"


@dataclass
class RoutingLayer:
    name: str  # the experts module whose input is the router's choice, e.g. model.layers.1.mlp.experts
    order: int
    compared: int  # token positions routed in both traces
    agreeing: int  # of them, those whose set of chosen experts is the same
    first: dict[str, Any] | None  # {"prompt_id", "pos"} of the first (prompt, position) that differs


@dataclass
class RoutingDiff:
    layers: list[RoutingLayer]  # MoE layers in forward order

    @property
    def compared(self) -> int:
        return sum(layer.compared for layer in self.layers)

    @property
    def agreeing(self) -> int:
        return sum(layer.agreeing for layer in self.layers)

    @property
    def first_layer(self) -> RoutingLayer | None:
        return next((layer for layer in self.layers if layer.agreeing < layer.compared), None)

    def sentence(self) -> str:
        from .render import pct

        first = self.first_layer
        if first is None:
            return f"routing: the same experts at every (token, MoE layer) pair ({self.compared})"
        return (f"routing first differs at {first.name} ({first.compared - first.agreeing} of {first.compared} "
                f"tokens); {pct(self.agreeing, self.compared)} of (token, MoE layer) pairs choose the same experts "
                f"({self.agreeing}/{self.compared})")

    def to_dict(self) -> dict[str, Any]:
        first = self.first_layer
        return {"first_layer": first.name if first else None, "compared": self.compared, "agreeing": self.agreeing,
                "agreement": self.agreeing / self.compared if self.compared else None,
                "layers": [layer.__dict__ for layer in self.layers]}


@dataclass
class LocateResult:
    a: str
    b: str
    cell_a: dict[str, Any]
    cell_b: dict[str, Any]
    modules: list[ModuleDiff]
    first_by_prompt: dict[str, tuple[str, int] | None] = field(default_factory=dict)
    only_in_one: list[str] = field(default_factory=list)
    rank_disagreements: list[RankDisagreement] = field(default_factory=list)  # in execution order, per side
    routing: RoutingDiff | None = None  # MoE models only
    after_fork: int = 0  # positions left out: at or after a sequence's first differing token

    first_module: str | None = None  # the earliest differing output in execution order (module doc)

    @property
    def first(self) -> ModuleDiff | None:
        return next((m for m in self.modules if m.name == self.first_module), None)

    @property
    def diverged(self) -> bool:
        routed_apart = self.routing is not None and self.routing.first_layer is not None
        return self.first is not None or bool(self.rank_disagreements) or routed_apart

    def sentence(self) -> str:
        firsts = {d.side: d for d in reversed(self.rank_disagreements)}  # each side's earliest module
        parts = [firsts[side].sentence() for side in sorted(firsts)]
        first = self.first
        routing = [self.routing.sentence()] if self.routing is not None else []
        if self.after_fork:
            routing.append(f"{self.after_fork} positions at or after a sequence's first differing token left out "
                           "(their inputs differ)")
        if first is None:
            parts.append("no module output differs between A and B" if parts else
                         "no module output differs: every traced position is bitwise identical")
            return "; ".join(parts + routing)
        worst = max(self.modules, key=lambda m: (m.max_ulp, m.order))
        text = f"first divergence: {first.name}" + (f" ({_style_words(first.style)})" if first.style else "")
        if worst.max_ulp > first.max_ulp:  # a module that only repeats the first's output is no growth
            text += f"; grows to max {worst.max_ulp} ULP by {worst.name}"
        return "; ".join(parts + [text] + routing)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "cell_a": self.cell_a, "cell_b": self.cell_b, "summary": self.sentence(),
            "first_module": self.first_module,
            "first_by_prompt": {k: (None if v is None else {"module": v[0], "pos": v[1]}) for k, v in self.first_by_prompt.items()},
            "modules": [m.__dict__ for m in self.modules], "only_in_one": self.only_in_one,
            "rank_disagreements": [d.__dict__ for d in self.rank_disagreements],
            "routing": None if self.routing is None else self.routing.to_dict(),
            "after_fork_positions": self.after_fork,
        }


def _style_words(style: str | None) -> str:
    if not style:
        return ""
    if style.startswith("rowwise"):
        return "row-parallel"
    if style.startswith("colwise"):
        return "column-parallel"
    if style == "moe_tp_experts":
        return "experts, row-parallel sum"
    return style


def _read(path: Path) -> tuple[pa.Table, dict[str, Any], dict[str, dict[str, Any]]]:
    if not path.is_file():
        raise InputError(f"{path}: no trace here (run the cell with `repaudit run --trace`)")
    try:
        pf = pq.ParquetFile(path)
        meta = pf.schema_arrow.metadata or {}
        if meta.get(KEY_VERSION.encode()) not in {str(v).encode() for v in READABLE_VERSIONS}:
            raise InputError(f"{path}: not a repaudit trace of version {' or '.join(map(str, READABLE_VERSIONS))}")
        table = pf.read()
        modules = {m["name"]: m for m in json.loads(meta[KEY_MODULES.encode()])}
        cell = json.loads(meta[KEY_CELL.encode()])
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise InputError(f"{path}: unreadable trace ({type(exc).__name__})") from None
    return table, cell, modules


def _read_once(path: Path, traces: dict[str, tuple] | None) -> tuple[pa.Table, dict[str, Any], dict[str, dict[str, Any]]]:
    if traces is None:
        return _read(path)
    if str(path) not in traces:
        traces[str(path)] = _read(path)
    return traces[str(path)]


def _same_prompts(ta: pa.Table, tb: pa.Table) -> None:
    """Refuse traces of different prompts: the rows are joined on (prompt, position, module), so a
    prompt traced in one cell only would be left out unseen, and "every traced position is bitwise
    identical" said of two cells that were not compared on it."""
    codes = [dictionary_codes(t, "prompt_id") for t in (ta, tb)]
    traced = [{values[i] for i in np.unique(c)} for c, values in codes]
    only_a, only_b = sorted(traced[0] - traced[1]), sorted(traced[1] - traced[0])
    if only_a or only_b:
        raise InputError(f"traced prompts differ ({len(only_a)} only in A, {len(only_b)} only in B, "
                         f"e.g. {(only_a or only_b)[0]!r}); locate compares two cells of the same prompts")


def _max_pos(*tables: pa.Table) -> int:
    return max([int(pc.max(t.column("pos")).as_py() or 0) for t in tables if len(t)] or [0])


def _keys(table: pa.Table, prompts: dict[str, int], modules: dict[str, int], max_pos: int) -> np.ndarray:
    """(prompt, module, pos) of each row as one int64, in a numbering both traces share."""
    p_codes, p_values = dictionary_codes(table, "prompt_id")
    m_codes, m_values = dictionary_codes(table, "module")
    p = np.array([prompts[v] for v in p_values], dtype=np.int64)[p_codes]
    m = np.array([modules[v] for v in m_values], dtype=np.int64)[m_codes]
    pos = table.column("pos").to_numpy().astype(np.int64)
    return (p * len(modules) + m) * (max_pos + 1) + pos


def _samples(table: pa.Table) -> np.ndarray:
    """The sampled features' bits, [rows, SAMPLES] (one copy of the column)."""
    return table.column("sample").combine_chunks().flatten().to_numpy().reshape(len(table), -1)


def locate(path_a: str | Path, path_b: str | Path, traces: dict[str, tuple] | None = None) -> LocateResult:
    """`traces`: read traces by path, filled as they are read; a caller that locates several
    cells against one reference passes the same dict, so the reference is read once."""
    pa_, pb_ = trace_path(path_a), trace_path(path_b)
    ta, cell_a, mods_a = _read_once(pa_, traces)
    tb, cell_b, mods_b = _read_once(pb_, traces)
    _same_prompts(ta, tb)
    prompt_names = sorted(set(dictionary_codes(ta, "prompt_id")[1]) | set(dictionary_codes(tb, "prompt_id")[1]))
    module_names = sorted(set(dictionary_codes(ta, "module")[1]) | set(dictionary_codes(tb, "module")[1]))
    prompts = {v: i for i, v in enumerate(prompt_names)}
    codes = {v: i for i, v in enumerate(module_names)}
    records = read_records(pa_, pb_)
    max_pos = _max_pos(ta, tb, *records)
    if len(prompts) * (len(codes) + 1) * (max_pos + 1) >= 1 << 62:
        raise InputError(f"{pa_}: too many prompts, modules and positions to align in one key")
    ka, kb = _keys(ta, prompts, codes, max_pos), _keys(tb, prompts, codes, max_pos)
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    key = ka[ia]
    module = (key // (max_pos + 1)) % len(codes)
    prompt, pos = key // (max_pos + 1) // len(codes), key % (max_pos + 1)
    fork = forks(records, prompts, max_pos + 1)
    same_inputs = pos < fork[prompt]
    after_fork = len(np.unique((prompt * (max_pos + 1) + pos)[~same_inputs]))
    ia, ib, key, module, prompt, pos = (x[same_inputs] for x in (ia, ib, key, module, prompt, pos))
    routers = sorted((n for n in mods_a if n in mods_b and n in codes and mods_a[n].get("routing")),
                     key=lambda n: mods_a[n]["order"])
    routing = _routing(ta, tb, [(n, mods_a[n], np.flatnonzero(module == codes[n])) for n in routers],
                       ia, ib, prompt, pos, prompt_names) if routers else None
    shared = [n for n in mods_a if n in mods_b and not mods_a[n].get("routing")]
    keep = np.isin(module, [codes[n] for n in shared if n in codes])
    ia, ib, key, module, prompt, pos = ia[keep], ib[keep], key[keep], module[keep], prompt[keep], pos[keep]
    differ = ta.column("digest").to_numpy()[ia] != tb.column("digest").to_numpy()[ib]

    # Per module: its compared rows, and its differing ones (in row order) from one sort.
    compared = np.bincount(module, minlength=len(codes))
    by_module = np.flatnonzero(differ)
    by_module = by_module[np.argsort(module[by_module], kind="stable")]
    bounds = np.searchsorted(module[by_module], np.arange(len(codes) + 1))
    samples_a = samples_b = None
    modules = []
    for name in sorted(shared, key=lambda n: mods_a[n]["order"]):
        c = codes.get(name)
        d = by_module[bounds[c]:bounds[c + 1]] if c is not None else by_module[:0]
        max_ulp = nan = 0
        if len(d):
            if samples_a is None:
                samples_a, samples_b = _samples(ta), _samples(tb)
            u = ulp_distance_bits(samples_a[ia[d]], samples_b[ib[d]], mods_a[name]["dtype"])
            max_ulp, nan = int(u.distance.max()), int(u.nan_vs_number.sum())
        modules.append(ModuleDiff(name=name, order=int(mods_a[name]["order"]), style=mods_a[name].get("style"),
                                 compared=int(compared[c]) if c is not None else 0, differing=len(d),
                                 max_ulp=max_ulp, nan_mismatch=nan))
    order_of = np.full(len(codes) + 1, 1 << 30, dtype=np.int64)
    for m in modules:
        order_of[codes[m.name]] = m.order
    order = order_of[module]
    head = lm_head_rows(records, prompts, fork, max_pos)
    if head is not None:
        head_order = max((m.order for m in modules), default=-1) + 1
        modules.append(ModuleDiff(name=LM_HEAD, order=head_order, style=None, compared=len(head.prompt),
                                  differing=int(head.differ.sum()), max_ulp=head.max_ulp, nan_mismatch=head.nan))
        prompt, pos, differ = (np.concatenate(x) for x in ((prompt, head.prompt), (pos, head.pos), (differ, head.differ)))
        order = np.concatenate((order, np.full(len(head.prompt), head_order, dtype=np.int64)))
        module = np.concatenate((module, np.full(len(head.prompt), len(codes), dtype=np.int64)))
    names = [*module_names, LM_HEAD]
    forward = forward_index(pos, prompt, records, prompts, cell_a)

    first: dict[str, tuple[str, int] | None] = {prompt_names[p]: None for p in np.unique(prompt)}
    d = np.flatnonzero(differ)
    d = d[np.lexsort((pos[d], order[d], forward[d], prompt[d]))]
    if len(d):
        lead = d[np.concatenate(([True], prompt[d][1:] != prompt[d][:-1]))]
        for i in lead:
            first[prompt_names[prompt[i]]] = (names[module[i]], int(pos[i]))
    first_module = names[module[d[np.lexsort((order[d], forward[d]))[0]]]] if len(d) else None
    only = sorted(set(mods_a) ^ set(mods_b))
    disagreements = _rank_disagreements("A", cell_a, mods_a) + _rank_disagreements("B", cell_b, mods_b)
    return LocateResult(str(pa_), str(pb_), cell_a, cell_b, modules, first, only, disagreements, routing, after_fork,
                        first_module)


def _routing(ta: pa.Table, tb: pa.Table, routers: list[tuple[str, dict[str, Any], np.ndarray]], ia: np.ndarray,
             ib: np.ndarray, prompt: np.ndarray, pos: np.ndarray, prompt_names: list[str]) -> RoutingDiff:
    """Per MoE layer (routers: name, module info, indices into the aligned rows), the common
    tokens whose chosen experts (sorted ids) are the same in both traces."""
    ids_a, ids_b = _experts(ta), _experts(tb)
    layers = []
    for name, info, rows in routers:
        a, b = ids_a(ia[rows]), ids_b(ib[rows])
        same = (a == b).all(axis=1) if a.shape == b.shape else np.zeros(len(rows), dtype=bool)
        differ = np.flatnonzero(~same)
        first = None
        if len(differ):  # the first in (prompt, position) order
            i = differ[np.lexsort((pos[rows][differ], prompt[rows][differ]))[0]]
            first = {"prompt_id": prompt_names[prompt[rows][i]], "pos": int(pos[rows][i])}
        layers.append(RoutingLayer(name=name.removesuffix(":routing"), order=int(info["order"]), compared=len(rows),
                                   agreeing=int(same.sum()), first=first))
    return RoutingDiff(layers)


def _experts(table: pa.Table):
    """rows -> their experts [len(rows), k] (all of them the same k), from the `experts` column."""
    arr = table.column("experts").combine_chunks()
    # Raw offsets into the backing values (a null row's length is never read: only routing rows are).
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    starts, lengths = offsets[:-1], np.diff(offsets)

    def take(rows: np.ndarray) -> np.ndarray:
        widths = np.unique(lengths[rows])
        if len(widths) > 1:
            raise InputError("a trace's routing rows of one layer hold different numbers of experts")
        k = int(widths[0]) if len(widths) else 0
        return values[starts[rows][:, None] + np.arange(k)]

    return take


def _rank_disagreements(side: str, cell: dict[str, Any], modules: dict[str, dict[str, Any]]) -> list[RankDisagreement]:
    """The trace's own finding: replicated outputs whose ranks disagreed (traces made before it
    was recorded say nothing, and count as none)."""
    found = [RankDisagreement(side, str(cell.get("id")), name, int(m["order"]), int(m["ranks_disagree"]),
                              m.get("first_disagreement"))
             for name, m in modules.items() if m.get("ranks_disagree")]
    return sorted(found, key=lambda d: d.order)


def print_locate(r: LocateResult, console) -> None:
    from rich.table import Table

    from .render import pct

    t = Table(title=f"{r.cell_a.get('id')} vs {r.cell_b.get('id')}: module outputs, in execution order", header_style="bold")
    for col in ("module", "TP style", "positions differing", "max ULP (sampled)"):
        t.add_column(col, overflow="fold")
    for m in r.modules:
        style = "[red]" if m.differing else ""
        t.add_row(f"{style}{m.name}", m.style or "", f"{m.differing}/{m.compared} ({pct(m.differing, m.compared)})",
                  str(m.max_ulp) + (f" (+{m.nan_mismatch} NaN vs number)" if m.nan_mismatch else ""))
    console.print(t)
    diverged = {k: v for k, v in r.first_by_prompt.items() if v}
    if diverged:
        t2 = Table(title="first differing module per prompt", header_style="bold")
        t2.add_column("prompt")
        t2.add_column("module")
        t2.add_column("position")
        for pid, (mod, pos) in sorted(diverged.items(), key=lambda kv: (order_index(r, kv[1][0]), kv[1][1])):
            t2.add_row(pid, mod, str(pos))
        console.print(t2)
    if r.only_in_one:
        console.print(f"[yellow]traced in one cell only (not compared):[/] {', '.join(r.only_in_one)}")
    if r.routing is not None:
        print_routing(r.routing, console)
    for d in r.rank_disagreements:
        console.print(f"[red]{d.sentence()}[/]")
    console.print(f"[bold {'red' if r.diverged else 'green'}]{r.sentence()}[/]")


def print_routing(routing: RoutingDiff, console) -> None:
    from rich.table import Table

    from .render import pct

    t = Table(title="router choices: tokens whose experts are the same, MoE layers in forward order", header_style="bold")
    for col in ("MoE layer", "same experts", "first differing (prompt, position)"):
        t.add_column(col, overflow="fold")
    for layer in routing.layers:
        differs = layer.agreeing < layer.compared
        t.add_row(("[red]" if differs else "") + layer.name, f"{layer.agreeing}/{layer.compared} ({pct(layer.agreeing, layer.compared)})",
                  f"{layer.first['prompt_id']} pos {layer.first['pos']}" if layer.first else "")
    console.print(t)


def order_index(r: LocateResult, name: str) -> int:
    return next((m.order for m in r.modules if m.name == name), 1 << 30)
