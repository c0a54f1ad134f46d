"""Audit: RL means whose float64 running sum overflows although the mean itself is a finite float.

k3's term exp(d) - 1 - d reaches 1.6e308 for d just below log(DBL_MAX) = 709.78 (a rollout logprob
near -709 against a trainer's near 0). Two such terms sum past DBL_MAX, yet their mean is finite:
the reference is the real-number mean (exact decimals), and the diff must give that number, not inf.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np

from repaudit.diff import diff_records
from repaudit.records import write_record

META = dict(probes={"name": "p", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"}, env={})


def write(path: Path, logprobs: list[float]) -> Path:
    n = len(logprobs)
    write_record(path, prompt_id=["s"] * n, pos=np.arange(n), token_id=np.arange(n), logprob=np.array(logprobs, np.float32),
                 cell={"id": path.stem}, **META)
    return path


def exact_k3(ds: list[float]) -> float:
    with localcontext() as ctx:
        ctx.prec = 60
        return float(sum((Decimal(d).exp() - 1 - Decimal(d) for d in ds), Decimal(0)) / len(ds))


def test_k3_mean_is_finite_where_its_float64_sum_would_overflow(tmp_path):
    a = [-709.0, -709.5, -1.0, -2.0]  # rollout
    b = [0.0, 0.0, -1.0, -2.0]  # trainer: d = 709 and 709.5 on two rows, 0 on two
    lp_a, lp_b = np.array(a, np.float32).astype(np.float64), np.array(b, np.float32).astype(np.float64)
    ds = list(lp_b - lp_a)
    assert math.isinf(sum(math.expm1(d) - d for d in ds))  # the plain float64 sum overflows ...
    want = exact_k3(ds)
    assert math.isfinite(want)  # ... the mean does not
    rl = diff_records(write(tmp_path / "a.parquet", a), write(tmp_path / "b.parquet", b)).rl
    assert rl.positions == 4
    assert math.isfinite(rl.kl_k3) and abs(rl.kl_k3 - want) <= 1e-12 * want, (rl.kl_k3, want)


def test_k3_is_inf_where_a_term_is(tmp_path):
    """A single term past DBL_MAX (d > 709.78) makes the mean infinite: that stays so."""
    rl = diff_records(write(tmp_path / "a.parquet", [-800.0, -1.0]), write(tmp_path / "b.parquet", [0.0, -1.0])).rl
    assert rl.kl_k3 == math.inf
