"""Audit: numbers `repaudit locate` gives, against what they stand for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def _cell(make_record, name: str, model: dict, prompts=("p", "q")) -> Path:
    """A record of `model` with its trace beside it (same rows in every cell)."""
    ids = [p for p in prompts for _ in range(3)]
    path = make_record(name, prompt_id=ids, pos=[0, 1, 2] * len(prompts), logprob=np.full(len(ids), -1.0, np.float32), model=model)
    return _trace(path, prompts)


def test_traces_of_different_models_are_refused(make_record, capsys):
    """docs/trace.md: traces of different models are bad input (exit 2). locate compared them module
    by module and reported "first divergence: model.embed_tokens", exit 1, for two models."""
    a = _cell(make_record, "a.parquet", {"id": "builtin:tiny-qwen3", "weights_sha256": "1" * 64})
    b = _cell(make_record, "b.parquet", {"id": "builtin:tiny-qwen3-moe", "weights_sha256": "2" * 64})
    c = _cell(make_record, "c.parquet", {"id": "builtin:tiny-qwen3", "weights_sha256": "3" * 64})
    with pytest.raises(InputError, match=r"different models \(builtin:tiny-qwen3 vs builtin:tiny-qwen3-moe\)"):
        locate(a, b)
    with pytest.raises(InputError, match=r"different models \(builtin:tiny-qwen3, weights sha256 1{12} vs 3{12}\)"):
        locate(a, c)
    assert main(["locate", str(a), str(b)]) == 2 and "different models" in capsys.readouterr().err
    same = locate(a, _cell(make_record, "d.parquet", {"id": "builtin:tiny-qwen3", "weights_sha256": "1" * 64}))
    assert not same.diverged


def test_a_module_that_repeats_the_first_divergence_is_not_called_growth():
    """The sentence said "first divergence: <down_proj>; grows to max N ULP by <mlp>" when mlp only
    repeats down_proj's output: the worst module tied with the first, and nothing grew."""
    from repaudit.compare.locate import LocateResult, ModuleDiff

    def module(name, order, max_ulp):
        return ModuleDiff(name=name, order=order, style=None, compared=4, differing=1 if max_ulp else 0,
                          max_ulp=max_ulp, nan_mismatch=0)

    tied = [module("l.0.mlp.down_proj", 0, 7), module("l.0.mlp", 1, 7), module("l.1", 2, 0)]
    text = LocateResult("a", "b", {}, {}, modules=tied, first_module="l.0.mlp.down_proj").sentence()
    assert text == "first divergence: l.0.mlp.down_proj"
    grown = tied + [module("l.2", 3, 90)]
    text = LocateResult("a", "b", {}, {}, modules=grown, first_module="l.0.mlp.down_proj").sentence()
    assert text == "first divergence: l.0.mlp.down_proj; grows to max 90 ULP by l.2"
