"""A run's comparisons, kept in its directory (`comparison.json`): each cell against its reference,
diffed once and read again by `repaudit gate`, `repaudit report` and the run summary.

A stored diff is used only while both records are the files it was made from (same size and
modification time, to the nanosecond: records are only ever replaced by an atomic rename, which
changes both) and with the same importance-ratio clip. The verdict is not stored: it is a function of
the numbers and the thresholds (diff.verdict), so any thresholds reuse the same diff. Floats are
kept as float.hex(), so every number reads back with its exact bits, infinities and NaN included.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..files import write_text_atomic
from ..record.io import RecordMeta
from .diff import verdict
from .result import DiffResult, PromptDiff, RLMetrics, Thresholds

FILE = "comparison.json"
# The diff's rules, not only its inputs, decide the numbers: a stored diff made under other rules
# (version 1: before completion rows missing from one record counted as divergence; version 2:
# before row digests missing from the compared rows were told from those missing from the whole
# record) is made again.
VERSION = 3


def _encode(value: Any) -> Any:
    if isinstance(value, float):
        return {"f": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if value.keys() == {"f"}:
            return float.fromhex(value["f"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _meta(meta: RecordMeta) -> dict[str, Any]:
    return {f.name: str(meta.path) if f.name == "path" and meta.path else getattr(meta, f.name) for f in fields(meta)}


def result_to_json(r: DiffResult) -> dict[str, Any]:
    """Every number of a diff (not its verdict, which the thresholds decide)."""
    out: dict[str, Any] = {}
    for f in fields(r):
        value = getattr(r, f.name)
        if f.name in ("a", "b"):
            out[f.name] = _meta(value)
        elif f.name == "rl":
            out[f.name] = {g.name: getattr(value, g.name) for g in fields(value)}
        elif f.name == "prompts":
            out[f.name] = [[getattr(p, g.name) for g in fields(p)] for p in value]
        elif f.name not in ("thresholds", "passed", "reasons"):
            out[f.name] = value
    return _encode(out)


def result_from_json(data: dict[str, Any], thresholds: Thresholds) -> DiffResult:
    d = _decode(data)
    a, b = (RecordMeta(**{**d[k], "path": Path(d[k]["path"]) if d[k]["path"] else None}) for k in ("a", "b"))
    rl = RLMetrics(**{**d["rl"], "clip": tuple(d["rl"]["clip"])})
    prompts = [PromptDiff(*p) for p in d["prompts"]]
    simple = {k: v for k, v in d.items() if k not in ("a", "b", "rl", "prompts")}
    for k in ("env_differences", "cell_differences"):
        simple[k] = [tuple(x) for x in simple[k]]
    r = DiffResult(a=a, b=b, thresholds=thresholds, rl=rl, prompts=prompts, **simple)
    r.passed, r.reasons = verdict(r, thresholds)
    return r


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


class Store:
    """The run directory's stored diffs: get() what is still valid, put() what was made, save() once."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / FILE
        self.pairs: dict[str, Any] = {}
        self.changed = False
        try:
            data = json.loads(self.path.read_text())
            # "pairs" of another shape (a list) would raise at the first get(), not read as unreadable
            if data.get("version") == VERSION and isinstance(data["pairs"], dict):
                self.pairs = data["pairs"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # absent or unreadable: every pair is diffed again, and the file rewritten

    @staticmethod
    def _key(cell: str, reference: str) -> str:
        return f"{cell} vs {reference}"

    def get(self, cell: str, reference: str, a: Path, b: Path, clip: tuple[float, float],
            thresholds: Thresholds) -> DiffResult | None:
        entry = self.pairs.get(self._key(cell, reference))
        try:
            if entry is None or entry["a"] != _stamp(a) or entry["b"] != _stamp(b) or _decode(entry["clip"]) != list(clip):
                return None
            return result_from_json(entry["result"], thresholds)
        except (OSError, KeyError, TypeError, ValueError):
            return None

    def put(self, cell: str, reference: str, a: Path, b: Path, clip: tuple[float, float], result: DiffResult) -> None:
        self.pairs[self._key(cell, reference)] = {"a": _stamp(a), "b": _stamp(b), "clip": _encode(list(clip)),
                                                  "result": result_to_json(result)}
        self.changed = True

    def save(self) -> None:
        """Written whole or not at all; a run directory that cannot be written (a read-only copy) keeps
        working, it only diffs again next time."""
        if not self.changed:
            return
        try:
            write_text_atomic(self.path, json.dumps({"version": VERSION, "pairs": self.pairs}, separators=(",", ":"),
                                                    allow_nan=False))
            self.changed = False
        except OSError:
            pass
