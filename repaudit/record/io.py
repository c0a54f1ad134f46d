"""Token records: write one from plain arrays, read and validate one, load one as a DataFrame.

This is the Python API that the CLI uses too, so other tools (an RL trainer, a rollout
engine) can produce records that `repaudit diff` and `repaudit report` accept.

Rows are stored in canonical order, sorted by (prompt_id, pos) with no duplicates, so the
diff can align two records by a streaming merge. Files are written to a hidden temporary
name in the target directory and renamed into place once complete: a record is either
whole or absent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputError
from ..files import atomic_target
from .schema import (KEY_CELL, KEY_ENV, KEY_MODEL, KEY_PHASES, KEY_PROBES, KEY_PROMPTS, KEY_TOKENIZER, KEY_TOPK, KEY_VERSION, PHASES,
                     REQUIRED_KEYS, ROW_GROUP_ROWS, SCHEMA, SCHEMA_VERSION)


@dataclass(frozen=True)
class RecordMeta:
    """Everything a record says about itself, read from the file footer."""

    cell: dict[str, Any]
    env: dict[str, Any]
    probes: dict[str, Any]
    model: dict[str, Any]
    tokenizer: dict[str, Any]
    prompts: list[str]
    topk: int
    num_rows: int = 0
    phases: list[str] | None = None  # the phases present in the rows; None: the record does not say
    path: Path | None = field(default=None, compare=False)

    @property
    def cell_id(self) -> str:
        return str(self.cell.get("id", "?"))

    @property
    def label(self) -> str:
        return str(self.path) if self.path else self.cell_id


# --------------------------------------------------------------------------- writing


def _as_array(name: str, values: Any, dtype: np.dtype, n: int | None) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor: take its exact bits, never via Python floats
        if values.is_floating_point() and values.dtype.itemsize < 4:
            raise InputError(f"{name} must be float32 (got {values.dtype}); convert explicitly if you mean it")
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.dtype.kind == "f" and np.dtype(dtype).kind == "f" and arr.dtype != dtype:
        raise InputError(f"{name} must be {np.dtype(dtype).name} (got {arr.dtype.name}); convert explicitly if you mean it")
    if arr.dtype.kind == "f" and np.dtype(dtype).kind in "iu":
        raise InputError(f"{name} must be integers (got {arr.dtype.name})")
    if np.dtype(dtype) == np.int32 and arr.dtype.kind in "iu" and arr.dtype.itemsize >= 4 and arr.dtype != np.int32 and arr.size:
        if int(arr.min()) < -(1 << 31) or int(arr.max()) >= 1 << 31:  # astype would wrap silently
            raise InputError(f"{name} has values outside int32")
    arr = arr.astype(dtype, copy=False)
    if n is not None and arr.shape[0] != n:
        raise InputError(f"{name} has {arr.shape[0]} rows, expected {n}")
    return arr


def _list_column(name: str, values: Any, dtype: np.dtype, n: int, k: int) -> pa.Array:
    if k == 0:
        offsets = np.zeros(n + 1, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.empty(0, dtype=dtype)))
    arr = _as_array(name, values, dtype, n)
    if arr.ndim != 2 or arr.shape[1] != k:
        raise InputError(f"{name} must have shape ({n}, {k}), got {arr.shape}")
    offsets = np.arange(0, (n + 1) * k, k, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ascontiguousarray(arr).reshape(-1)))


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def string_codes(values: list[str]) -> tuple[list[str], np.ndarray]:
    """The sorted distinct strings and each value's index among them (int64). Python strings, not
    numpy's fixed-width str, which drops trailing NULs: "a\0" would be "a"."""
    uniq = sorted(set(values))
    code_of = {v: i for i, v in enumerate(uniq)}
    return uniq, np.fromiter(map(code_of.__getitem__, values), np.int64, len(values))


def build_table(
    *,
    prompt_id: Sequence[str],
    pos: Any,
    token_id: Any,
    logprob: Any,
    phase: Sequence[str] | None = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    row_digest: Any = None,
    top1_id: Any = None,
) -> pa.Table:
    """Arrays -> an Arrow table in canonical order. Raises InputError on malformed input.

    top1_id defaults to topk_ids[:, 0] when top-k is given, else -1 (not recorded).
    """
    ids = np.asarray(prompt_id, dtype=object)
    n = ids.shape[0]
    pos_a = _as_array("pos", pos, np.int32, n)
    tok_a = _as_array("token_id", token_id, np.int32, n)
    lp_a = _as_array("logprob", logprob, np.float32, n)
    if (topk_ids is None) != (topk_logprobs is None):
        raise InputError("give both topk_ids and topk_logprobs, or neither")
    k = 0 if topk_ids is None else int(np.shape(topk_ids)[1]) if np.ndim(topk_ids) == 2 else -1
    if k < 0:
        raise InputError("topk_ids must be a 2-D array (rows x k)")
    if phase is None:
        phase_a = np.full(n, "completion", dtype=object)
    else:
        phase_a = np.asarray(phase, dtype=object)
        if phase_a.shape[0] != n:
            raise InputError(f"phase has {phase_a.shape[0]} rows, expected {n}")
        bad = set(np.unique(phase_a.astype(str))) - set(PHASES)
        if bad:
            raise InputError(f"phase must be one of {PHASES}, got {sorted(bad)}")
    if n and not all(isinstance(x, str) and x for x in set(ids.tolist())):
        raise InputError("prompt_id values must be non-empty strings")
    if n and pos_a.min() < 0:
        raise InputError(f"pos must be >= 0 (got {int(pos_a.min())})")

    uniq, codes = string_codes(ids.tolist())
    order = np.lexsort((pos_a, codes))
    codes, pos_sorted = codes[order], pos_a[order]
    dup = (codes[1:] == codes[:-1]) & (pos_sorted[1:] == pos_sorted[:-1])
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise InputError(f"duplicate row for (prompt_id={str(uniq[codes[i]])!r}, pos={int(pos_sorted[i])})")

    if top1_id is not None:
        top1 = _as_array("top1_id", top1_id, np.int32, n)
    elif k > 0:
        top1 = _as_array("topk_ids", topk_ids, np.int32, n)[:, 0]
    else:
        top1 = np.full(n, -1, dtype=np.int32)
    phase_codes = np.where(phase_a[order] == "prompt", 0, 1).astype(np.int8)
    digest = (
        pa.nulls(n, pa.uint64())
        if row_digest is None
        else pa.array(_as_array("row_digest", row_digest, np.uint64, n)[order])
    )
    columns = [
        pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(uniq, pa.string())),
        pa.array(pos_sorted),
        pa.DictionaryArray.from_arrays(pa.array(phase_codes), pa.array(list(PHASES), pa.string())),
        pa.array(tok_a[order]),
        pa.array(lp_a[order]),
        pa.array(top1[order]),
        _list_column("topk_ids", None if k == 0 else np.asarray(topk_ids)[order], np.int32, n, k),
        _list_column("topk_logprobs", None if k == 0 else _as_array("topk_logprobs", topk_logprobs, np.float32, n)[order], np.float32, n, k),
        digest,
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def _present(table: pa.Table, column: str) -> list[str]:
    """The values a dictionary column's rows hold, sorted."""
    col = table.column(column).combine_chunks()
    return sorted({col.dictionary.to_pylist()[i] for i in pc.unique(col.indices).to_pylist()})


def write_table(path: str | os.PathLike, table: pa.Table, meta: RecordMeta, *, overwrite: bool = True) -> RecordMeta:
    """Write a canonical-order table atomically (temporary name, fsync, rename). With
    overwrite=False an existing record is never replaced: FileExistsError instead."""
    path = Path(path)
    prompts, phases = _present(table, "prompt_id"), _present(table, "phase")
    metadata = {
        KEY_VERSION: str(SCHEMA_VERSION).encode(),
        KEY_CELL: _json(meta.cell),
        KEY_ENV: _json(meta.env),
        KEY_PROBES: _json(meta.probes),
        KEY_MODEL: _json(meta.model),
        KEY_TOKENIZER: _json(meta.tokenizer),
        KEY_PROMPTS: _json(prompts),
        KEY_TOPK: _json(int(meta.topk)),
        KEY_PHASES: _json(phases),
    }
    if "id" not in meta.cell:
        raise InputError("cell metadata needs an 'id'")
    table = table.replace_schema_metadata(metadata)
    with atomic_target(path, overwrite=overwrite) as tmp, pq.ParquetWriter(
        tmp,
        table.schema,
        # LZ4 decodes about twice as fast as zstd here, and the diff is read-bound.
        compression="lz4",
        use_dictionary=["prompt_id", "phase"],
        write_statistics=["prompt_id", "pos"],
    ) as writer:
        writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
    return RecordMeta(**{**meta.__dict__, "prompts": prompts, "num_rows": table.num_rows, "phases": phases, "path": path})


def write_record(
    path: str | os.PathLike,
    *,
    prompt_id: Sequence[str],
    pos: Any,
    token_id: Any,
    logprob: Any,
    cell: dict[str, Any],
    probes: dict[str, Any],
    model: dict[str, Any],
    tokenizer: dict[str, Any],
    phase: Sequence[str] | None = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    row_digest: Any = None,
    top1_id: Any = None,
    env: dict[str, Any] | None = None,
) -> RecordMeta:
    """Write one record from plain arrays (numpy, lists, or CPU torch tensors).

    `logprob` must already be float32: the record stores its bit patterns, and a silent
    float64 -> float32 rounding would fake agreement or disagreement.
    """
    if env is None:
        from .fingerprint import environment

        env = environment()
    table = build_table(
        prompt_id=prompt_id, pos=pos, token_id=token_id, logprob=logprob, phase=phase,
        topk_ids=topk_ids, topk_logprobs=topk_logprobs, row_digest=row_digest, top1_id=top1_id,
    )
    k = 0 if topk_ids is None else int(np.shape(topk_ids)[1])
    meta = RecordMeta(cell=cell, env=env, probes=probes, model=model, tokenizer=tokenizer, prompts=[], topk=k)
    return write_table(path, table, meta)


# --------------------------------------------------------------------------- reading


def _open_parquet(path: Path) -> pq.ParquetFile:
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a .parquet record")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: not a readable Parquet file (truncated or not Parquet): {reason}") from None


def _check_schema(path: Path, schema: pa.Schema) -> None:
    for want in SCHEMA:
        if want.name not in schema.names:
            raise InputError(f"{path}: missing column {want.name!r}")
        got = schema.field(want.name).type
        if got != want.type:
            raise InputError(f"{path}: column {want.name!r} has type {got}, expected {want.type}")


def read_meta(path: str | os.PathLike) -> RecordMeta:
    """Validate a record's footer (version, columns, metadata) without reading its rows."""
    return _validated(Path(path))[1]


def _validated(path: Path) -> tuple[pq.ParquetFile, RecordMeta]:
    pf = _open_parquet(path)
    schema = pf.schema_arrow  # built on each access; costs milliseconds
    raw = schema.metadata or {}
    if KEY_VERSION.encode() not in raw:
        raise InputError(f"{path}: Parquet file without repaudit metadata (written by another tool?)")
    version = raw[KEY_VERSION.encode()].decode(errors="replace")
    if version != str(SCHEMA_VERSION):
        raise InputError(f"{path}: record schema version {version}, this repaudit reads version {SCHEMA_VERSION}")
    values = {}
    for key in REQUIRED_KEYS:
        blob = raw.get(key.encode())
        if blob is None:
            raise InputError(f"{path}: metadata key {key!r} is missing")
        try:
            values[key] = json.loads(blob)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            raise InputError(f"{path}: metadata key {key!r} is not valid JSON") from None
    _check_schema(path, schema)
    if not isinstance(values[KEY_CELL], dict) or "id" not in values[KEY_CELL]:
        raise InputError(f"{path}: metadata {KEY_CELL!r} must be an object with an 'id'")
    for key in (KEY_ENV, KEY_PROBES, KEY_MODEL, KEY_TOKENIZER):
        if not isinstance(values[key], dict):
            raise InputError(f"{path}: metadata {key!r} must be a JSON object")
    if not isinstance(values[KEY_PROMPTS], list) or not all(isinstance(p, str) for p in values[KEY_PROMPTS]):
        raise InputError(f"{path}: metadata {KEY_PROMPTS!r} must be a list of prompt ids")
    topk = values[KEY_TOPK]
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise InputError(f"{path}: metadata {KEY_TOPK!r} must be a non-negative integer")
    phases = raw.get(KEY_PHASES.encode())
    if phases is not None:
        try:
            phases = json.loads(phases)
        except (ValueError, RecursionError):
            raise InputError(f"{path}: metadata key {KEY_PHASES!r} is not valid JSON") from None
        # isinstance first: set() of a list holding a list or an object raises TypeError
        if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases) or not set(phases) <= set(PHASES):
            raise InputError(f"{path}: metadata {KEY_PHASES!r} must be a list of {', '.join(PHASES)}")
    meta = RecordMeta(
        phases=phases,
        cell=values[KEY_CELL],
        env=values[KEY_ENV],
        probes=values[KEY_PROBES],
        model=values[KEY_MODEL],
        tokenizer=values[KEY_TOKENIZER],
        prompts=list(values[KEY_PROMPTS]),
        topk=topk,
        num_rows=pf.metadata.num_rows,
        path=path,
    )
    return pf, meta


def open_record(path: str | os.PathLike) -> tuple[pq.ParquetFile, RecordMeta]:
    """A validated ParquetFile and its metadata, for streaming readers."""
    return _validated(Path(path))


def iter_batches(
    path: str | os.PathLike, columns: Sequence[str], batch_size: int = ROW_GROUP_ROWS
) -> Iterator[pa.RecordBatch]:
    pf, _ = _validated(Path(path))
    try:
        yield from pf.iter_batches(batch_size=batch_size, columns=list(columns), use_threads=True)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: corrupt data: {str(exc).strip().splitlines()[0]}") from None


def load_frame(path: str | os.PathLike):
    """The whole record as a pandas DataFrame (logprob stays float32; row_digest is a nullable
    UInt64 column, so a missing digest never turns the others into rounded float64)."""
    import pandas as pd

    pf, meta = _validated(Path(path))
    try:
        df = pf.read().to_pandas(types_mapper={pa.uint64(): pd.UInt64Dtype()}.get)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: corrupt data: {str(exc).strip().splitlines()[0]}") from None
    df.attrs["repaudit"] = meta
    return df
