"""`repaudit diff --clip LO,inf --json` (docs/metrics.md: HI may be inf; JSON has no infinity
token, a non-finite float is written as "inf") must write the clip bounds, not crash."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repaudit import cli
from repaudit.records import write_record

META = dict(probes={"name": "p", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"}, env={})


@pytest.mark.parametrize("clip, want", [("0.5,inf", [0.5, "inf"]), ("0,inf", [0.0, "inf"])])
def test_infinite_clip_bound_is_spelled_in_json(tmp_path, capsys, clip, want):
    rows = dict(prompt_id=["x", "x"], pos=[0, 1], token_id=[1, 2], **META)
    a, b, js = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "d.json"
    write_record(a, **rows, logprob=np.array([-1.0, -2.0], np.float32), cell={"id": "a"})
    write_record(b, **rows, logprob=np.array([-1.0, -2.5], np.float32), cell={"id": "b"})
    rc = cli.main(["diff", str(a), str(b), "--clip", clip, "--json", str(js)])
    capsys.readouterr()
    assert rc == 1
    rl = json.loads(js.read_text(), parse_constant=lambda c: pytest.fail(f"JSON has {c}"))["rl"]
    assert rl["clip"] == want
    # d = -0.5 at one position: ratio exp(-0.5) = 0.61, inside [LO, inf) for both LO
    assert rl["clip_frac"] == 0.0 and rl["positions"] == 2
