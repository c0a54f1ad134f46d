"""The trace file: one row per traced (prompt, position, module), a 64-bit digest of the module's
output row and a few sampled features' bits, and for a mixture-of-experts layer's routing rows
the experts the router chose (docs/trace.md). Reading and writing it needs no
torch, so `repaudit locate` and `repaudit report` run on the light install; making one is
repaudit.run.trace's job.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

TRACE_VERSION = 2  # 2 added the experts column (routing rows); version 1 traces read as routing-free
READABLE_VERSIONS = (1, 2)
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
    # routing rows (module NAME:routing) only: the chosen expert ids, sorted ascending; null elsewhere
    pa.field("experts", pa.list_(pa.int32()), nullable=True),
])


@dataclass
class ModuleInfo:
    name: str
    order: int  # first-call order in a forward pass: execution order
    dtype: str
    features: int  # of the whole (unsharded) output row
    sharded: bool
    style: str | None  # the module's TP style, when the model's plan names one
    ranks_disagree: int = 0  # rows of a replicated output whose bits are not the same on every rank
    first_disagreement: dict[str, Any] | None = None  # {"prompt_id", "pos"} of the first such row
    routing: bool = False  # a routing row (the router's choice of experts), not a module output


def trace_path(record_path: str | os.PathLike) -> Path:
    p = Path(record_path)
    return p if p.name.endswith(".trace.parquet") else p.with_name(p.name.removesuffix(".parquet") + ".trace.parquet")


def record_path(trace: str | os.PathLike) -> Path:
    """The record a trace belongs to (trace_path's inverse)."""
    p = Path(trace)
    return p.with_name(p.name.removesuffix(".trace.parquet") + ".parquet")


def write_trace(path: Path, table: pa.Table, modules: list[ModuleInfo], cell: dict[str, Any]) -> Path:
    from ..files import write_parquet_atomic

    meta = {KEY_VERSION: str(TRACE_VERSION).encode(), KEY_CELL: json.dumps(cell, sort_keys=True).encode(),
            KEY_MODULES: json.dumps([asdict(m) for m in modules]).encode()}
    return write_parquet_atomic(path, table.replace_schema_metadata(meta))
