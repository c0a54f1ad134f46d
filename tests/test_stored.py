"""A run's diffs are made once and kept in its directory (repaudit/compare/stored.py): read back
with every bit of every number, used only while both records are the files they were made from,
and judged again under any thresholds."""

from __future__ import annotations

import json
import os

import pytest
from test_diff import random_pair
from test_gate import CELLS, REF, make_run

from repaudit.compare import gate as gate_mod
from repaudit.compare.diff import diff_records
from repaudit.compare.result import Thresholds
from repaudit.compare.stored import FILE, result_from_json, result_to_json


@pytest.mark.parametrize("seed", range(6))
def test_a_diff_reads_back_with_every_bit(tmp_path, seed):
    a, b = random_pair(seed, "generate" if seed % 2 else "score")
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    stored = json.loads(json.dumps(result_to_json(r)))  # through text, as the file holds it
    back = result_from_json(stored, r.thresholds)
    assert back.to_dict() == r.to_dict()
    assert result_to_json(back) == result_to_json(r)  # float.hex of every float: the same bits
    assert (back.passed, back.reasons) == (r.passed, r.reasons)


def test_special_floats_keep_their_bits(tmp_path):
    a, b = random_pair(1)
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    r.abs_max, r.rl.ratio_max, r.ulp_mean, r.prob_max = float("inf"), float("nan"), -0.0, 5e-324
    back = result_from_json(json.loads(json.dumps(result_to_json(r))), r.thresholds)
    assert back.abs_max == float("inf") and back.rl.ratio_max != back.rl.ratio_max
    assert str(back.ulp_mean) == "-0.0" and back.prob_max == 5e-324


def _cell(i: int) -> str:
    return [c for c in CELLS if c != REF][i]


def test_a_gate_reads_the_stored_diffs_and_rediffs_only_a_replaced_record(tmp_path, monkeypatch):
    run = make_run(tmp_path, {_cell(0): {"bits": {("p0", 2): 7}}})
    first = gate_mod.gate_run(gate_mod.load_run(run), Thresholds())
    assert (run / FILE).is_file() and not first.passed
    made = []
    real = gate_mod.diff_records
    monkeypatch.setattr(gate_mod, "diff_records", lambda a, b, **kw: made.append(b.name) or real(a, b, **kw))
    again = gate_mod.gate_run(gate_mod.load_run(run), Thresholds())
    assert made == []  # every pair read back
    assert [(p.name, p.passed, p.reasons) for p in again.pairs] == [(p.name, p.passed, p.reasons) for p in first.pairs]
    assert [p.result.to_dict() for p in again.pairs] == [p.result.to_dict() for p in first.pairs]
    # other thresholds: the same diffs, another verdict
    loose = gate_mod.gate_run(gate_mod.load_run(run), Thresholds(max_ulp=1 << 31))
    assert made == [] and loose.passed
    # a record replaced (as a re-run replaces it: a new file, renamed into place) is diffed again
    path = run / "cells" / f"{_cell(0)}.parquet"
    fresh = path.with_suffix(".new")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)
    os.utime(path, ns=(1, 1))
    third = gate_mod.gate_run(gate_mod.load_run(run), Thresholds())
    assert made == [path.name] and [p.passed for p in third.pairs] == [p.passed for p in first.pairs]


def test_an_unreadable_store_is_made_again_and_a_read_only_run_still_gates(tmp_path, monkeypatch):
    import errno

    from repaudit.compare import stored

    run = make_run(tmp_path)
    (run / FILE).write_text("{not json")
    assert gate_mod.gate_run(gate_mod.load_run(run), Thresholds()).passed
    assert json.loads((run / FILE).read_text())["version"] == stored.VERSION
    # valid JSON of another shape: "pairs" a list raised AttributeError at the first lookup
    for pairs in ([], "x", None):
        (run / FILE).write_text(json.dumps({"version": stored.VERSION, "pairs": pairs}))
        assert gate_mod.gate_run(gate_mod.load_run(run), Thresholds()).passed
        assert isinstance(json.loads((run / FILE).read_text())["pairs"], dict)
    (run / FILE).unlink()

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(stored, "write_text_atomic", read_only)
    assert gate_mod.gate_run(gate_mod.load_run(run), Thresholds()).passed
    assert not (run / FILE).exists()


def test_diffs_stored_under_earlier_rules_are_made_again(tmp_path, monkeypatch):
    """A comparison.json from a repaudit whose diff counted differently (version 1: completion rows
    missing from one record were not a divergence) is not read back: the records are the same
    files, but its numbers are not today's."""
    from repaudit.compare import stored

    run = make_run(tmp_path, {_cell(0): {"bits": {("p0", 2): 7}}})
    gate_mod.gate_run(gate_mod.load_run(run), Thresholds())
    data = json.loads((run / FILE).read_text())
    assert data["version"] == stored.VERSION >= 2
    data["version"] = 1
    (run / FILE).write_text(json.dumps(data))
    made = []
    real = gate_mod.diff_records
    monkeypatch.setattr(gate_mod, "diff_records", lambda a, b, **kw: made.append(b.name) or real(a, b, **kw))
    gate_mod.gate_run(gate_mod.load_run(run), Thresholds())
    assert len(made) == len(CELLS) - 1  # every pair diffed again
    assert json.loads((run / FILE).read_text())["version"] == stored.VERSION
