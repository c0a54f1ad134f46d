"""Audit: numbers `repaudit locate` gives, against what they stand for."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from repaudit.cli import main
from repaudit.compare.locate import locate
from repaudit.errors import InputError
from repaudit.record.tracefile import SAMPLES, SCHEMA, ModuleInfo, trace_path, write_trace

MODULES = ("model.embed_tokens", "model.norm")


def _trace(path: Path, prompts: tuple[str, ...], positions: int = 3) -> Path:
    """A trace whose every row has the same bits in any file made by this function."""
    rows = [(p, pos, name, order, hash((p, pos, name)) % (1 << 64))
            for p in prompts for pos in range(positions) for order, name in enumerate(MODULES)]
    cols = list(zip(*rows))
    table = pa.Table.from_arrays([
        pa.array(cols[0]).dictionary_encode(), pa.array(cols[1], pa.int32()), pa.array(cols[2]).dictionary_encode(),
        pa.array(cols[3], pa.int32()), pa.array(cols[4], pa.uint64()),
        pa.array([[0] * SAMPLES] * len(rows), pa.list_(pa.uint32(), SAMPLES)), pa.nulls(len(rows), pa.list_(pa.int32())),
    ], schema=SCHEMA)
    modules = [ModuleInfo(name=n, order=i, dtype="float32", features=16, sharded=False, style=None)
               for i, n in enumerate(MODULES)]
    write_trace(trace_path(path), table, modules, {"id": path.stem})
    return path


def test_traces_of_different_prompts_are_refused_not_called_identical(tmp_path, capsys):
    """A prompt traced in one cell only was left out without a word: locate said "no module output
    differs: every traced position is bitwise identical" and exited 0 although none of that prompt's
    positions was compared. docs/trace.md: traces of different prompts are bad input (exit 2)."""
    a = _trace(tmp_path / "a.parquet", ("p", "q", "r"))
    b = _trace(tmp_path / "b.parquet", ("p", "q"))
    with pytest.raises(InputError, match=r"traced prompts differ \(1 only in A, 0 only in B, e.g. 'r'\)"):
        locate(a, b)
    assert main(["locate", str(b), str(a)]) == 2
    assert "traced prompts differ (0 only in A, 1 only in B, e.g. 'r')" in capsys.readouterr().err
    same = locate(a, _trace(tmp_path / "c.parquet", ("r", "q", "p")))
    assert not same.diverged and [m.compared for m in same.modules] == [9, 9]
