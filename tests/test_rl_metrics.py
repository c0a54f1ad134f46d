"""The RL mismatch metrics (`DiffResult.rl`, `--json` "rl") against a straightforward independent
computation on random records: a pandas merge, a row-by-row walk, exact fractions for the exact sums,
60-digit decimals for k3, a sorted list for the nearest-rank percentiles.

Records have ties (logprobs on a coarse grid, so many equal d and equal top-1 / top-2 margins), forks
and holes (generate mode), NaN and ±inf logprobs, unrecorded top-1 ids and top-k lists of 0, 1 or 3.
"""

from __future__ import annotations

import json
import math
import warnings
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from repaudit import cli
from repaudit.diff import diff_records
from repaudit.records import write_record

META = dict(probes={"name": "p", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"}, env={})
SPECIAL = [0x7FC00000, 0xFF800000, 0x7F800000, 0x80000000, 0x00000000]  # NaN, -inf, +inf, -0, +0


def f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def random_frames(seed: int, mode: str, k: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two records as DataFrames (prompt_id, pos, token, bits, top1, tk_ids, tk_bits); B derives from A."""
    rng = np.random.default_rng(seed)
    rows_a, rows_b = [], []
    for i in range(int(rng.integers(4, 10))):
        pid = f"s{i:02d}"
        n = int(rng.integers(1, 50))
        cut = int(rng.integers(1, n + 1)) if mode == "generate" and rng.random() < 0.3 else n  # B shorter or with a fork
        fork = int(rng.integers(0, n)) if mode == "generate" and rng.random() < 0.3 else None
        for pos in range(n):
            grid = -float(rng.integers(0, 64)) / 8  # coarse: ties in d and in margins
            bits = int(np.float32(grid).view(np.uint32))
            if rng.random() < 0.03:
                bits = int(rng.choice(SPECIAL))
            tk_lp = np.sort(-rng.integers(0, 6, k).astype(np.float32) / 4)[::-1]
            tk = dict(tk_ids=list(rng.integers(0, 9, k)), tk_bits=[int(x) for x in tk_lp.view(np.uint32)])
            top1 = int(rng.integers(0, 4)) if rng.random() < 0.9 else -1
            rows_a.append(dict(prompt_id=pid, pos=pos, token=pos + 100, bits=bits, top1=top1, **tk))
            if pos >= cut:
                continue
            u = rng.random()
            bits_b = bits if u < 0.4 else (bits + int(rng.integers(-3, 4))) & 0xFFFFFFFF if u < 0.6 else (
                int(np.float32(-float(rng.integers(0, 64)) / 8).view(np.uint32)) if u < 0.95 else int(rng.choice(SPECIAL)))
            top1_b = top1 if rng.random() < 0.8 else int(rng.integers(-1, 4))
            token_b = pos + 100 + (1 if fork is not None and pos >= fork else 0)
            rows_b.append(dict(prompt_id=pid, pos=pos, token=token_b, bits=bits_b, top1=top1_b, **tk))
    return pd.DataFrame(rows_a), pd.DataFrame(rows_b)


def write(path: Path, df: pd.DataFrame, k: int) -> Path:
    topk = {}
    if k:
        topk = dict(topk_ids=np.array(df.tk_ids.tolist(), np.int32), topk_logprobs=f32(np.array(df.tk_bits.tolist())))
    write_record(path, prompt_id=df.prompt_id.tolist(), pos=df.pos.to_numpy(), token_id=df.token.to_numpy(),
                 logprob=f32(df.bits.to_numpy()), top1_id=df.top1.to_numpy(), cell={"id": path.stem}, **topk, **META)
    return path


def nearest_rank(values: list[float], num: int, den: int) -> float:
    ordered = sorted(values)
    return ordered[max(1, -(-num * len(ordered) // den)) - 1]


def reference(fa: pd.DataFrame, fb: pd.DataFrame, clip=(0.5, 2.0)) -> dict:
    m = fa.merge(fb, on=["prompt_id", "pos"], how="outer", suffixes=("_a", "_b"), indicator=True)
    ds, exact, sums, margins = [], [], {}, []
    nonfinite = flip_positions = flips = 0
    for pid, g in m.groupby("prompt_id"):
        both = g[g._merge == "both"]
        breaks = list(g.pos[g._merge != "both"]) + list(both.pos[both.token_a != both.token_b])
        div = min(breaks) if breaks else None
        for row in both.sort_values("pos").itertuples():
            if div is not None and row.pos >= div:
                continue
            va, vb = float(f32([row.bits_a])[0]), float(f32([row.bits_b])[0])
            if not (math.isfinite(va) and math.isfinite(vb)):
                nonfinite += 1
                continue
            ds.append(vb - va)  # float64, rounded once
            exact.append(Fraction(vb) - Fraction(va))
            sums[pid] = sums.get(pid, Fraction(0)) + exact[-1]
            if row.top1_a >= 0 and row.top1_b >= 0:
                flip_positions += 1
                if row.top1_a != row.top1_b:
                    flips += 1
                    if len(row.tk_bits_a) >= 2:
                        top = f32(row.tk_bits_a[:2])
                        margins.append(float(top[0]) - float(top[1]))
    n = len(ds)
    out = dict(positions=n, nonfinite=nonfinite, flip_positions=flip_positions, flips=flips)
    if not n:
        return out
    with localcontext() as ctx:
        ctx.prec = 60
        k3 = sum((Decimal(d).exp() - 1 - Decimal(d) for d in ds), Decimal(0)) / n
    exp = np.exp(np.array(ds))
    out.update(
        kl_k1=float(-sum(exact) / n), kl_k2=float(sum(Fraction(d) ** 2 for d in ds) / (2 * n)), kl_k3=float(k3),
        ratio_min=float(np.exp(min(ds))), ratio_max=float(np.exp(max(ds))),
        ratio_p50=float(np.exp(nearest_rank(ds, 1, 2))), ratio_p99=float(np.exp(nearest_rank(ds, 99, 100))),
        abs_diff_mean=float(sum(abs(x) for x in exact) / n), abs_diff_max=max(abs(d) for d in ds),
        clip_frac=int(np.count_nonzero((exp < clip[0]) | (exp > clip[1]))) / n,
        seq_log_ratio_max=float(max(abs(s) for s in sums.values())) if sums else 0.0,
        flip_rate=flips / flip_positions if flip_positions else None,
        flip_margin_p50=nearest_rank(margins, 1, 2) if margins else None,
    )
    return out


EXACT = ("positions", "nonfinite", "flip_positions", "flips", "kl_k1", "ratio_min", "ratio_p50", "ratio_p99", "ratio_max",
         "abs_diff_mean", "abs_diff_max", "clip_frac", "flip_rate", "flip_margin_p50")
CLOSE = ("kl_k2", "kl_k3", "seq_log_ratio_max")  # float64 sums: to their stated precision


def assert_matches(rl, want: dict) -> None:
    for name in EXACT:
        if name in want:
            assert getattr(rl, name) == want[name], (name, getattr(rl, name), want[name])
    for name in CLOSE:
        if name in want:
            assert getattr(rl, name) == pytest.approx(want[name], rel=1e-12, abs=1e-300), name


@pytest.mark.parametrize("seed, mode, k", [(0, "score", 3), (1, "generate", 3), (2, "score", 1), (3, "generate", 0),
                                           (4, "generate", 3), (5, "score", 3)])
def test_random_records_match_the_reference(tmp_path, seed, mode, k):
    fa, fb = random_frames(seed, mode, k)
    pa_, pb_ = write(tmp_path / "a.parquet", fa, k), write(tmp_path / "b.parquet", fb, k)
    want = reference(fa, fb)
    r = diff_records(pa_, pb_, allow_partial=True)
    assert_matches(r.rl, want)
    assert want["positions"] > 50 and want["flips"] > 0 and (k < 2) == (want.get("flip_margin_p50") is None)
    for batch_rows in (1, 4, 1 << 20):  # every number is the same however the rows are cut
        assert diff_records(pa_, pb_, allow_partial=True, batch_rows=batch_rows).to_dict()["rl"] == r.to_dict()["rl"]


@pytest.mark.parametrize("clip", [(0.8, 1.25), (0.0, 1.5), (1.5, math.inf)])
def test_clip_bounds(tmp_path, clip):
    fa, fb = random_frames(7, "score", 2)
    r = diff_records(write(tmp_path / "a.parquet", fa, 2), write(tmp_path / "b.parquet", fb, 2), clip=clip)
    want = reference(fa, fb, clip)
    assert r.rl.clip == clip and r.rl.clip_frac == want["clip_frac"]
    if clip[0] > 1:  # equal rows (ratio 1) lie outside the bounds too
        assert r.rl.clip_frac > 1 - r.bitwise_equal / r.rl.positions


def test_identical_records_give_zeros_and_ratio_one(tmp_path):
    fa, _ = random_frames(8, "score", 3)
    fa = fa[[math.isfinite(float(f32([b])[0])) for b in fa.bits]]
    pa_ = write(tmp_path / "a.parquet", fa, 3)
    rl = diff_records(pa_, pa_).rl
    assert (rl.positions, rl.nonfinite, rl.flips) == (len(fa), 0, 0)
    assert (rl.kl_k1, rl.kl_k2, rl.kl_k3, rl.abs_diff_mean, rl.abs_diff_max, rl.seq_log_ratio_max, rl.clip_frac) == (0.0,) * 7
    assert (rl.ratio_min, rl.ratio_p50, rl.ratio_p99, rl.ratio_max) == (1.0,) * 4
    assert rl.flip_rate == 0.0 and rl.flip_margin_p50 is None
    assert not any(math.copysign(1, x) < 0 for x in (rl.kl_k1, rl.abs_diff_max))  # no -0.0 in the JSON


def test_k3_keeps_its_precision_where_exp_minus_one_cancels(tmp_path):
    """d ~ 1e-37 (confident tokens: logprobs near -1e-30): expm1(d) - d gives 0; k3 is d**2 / 2."""
    a_bits = [int(np.float32(-1e-30).view(np.uint32))] * 2
    b_bits = [a_bits[0] + 1, a_bits[0]]
    rows = dict(prompt_id=["x", "x"], pos=[0, 1], token_id=[1, 2], **META)
    write_record(tmp_path / "a.parquet", **rows, logprob=f32(a_bits), cell={"id": "a"})
    write_record(tmp_path / "b.parquet", **rows, logprob=f32(b_bits), cell={"id": "b"})
    rl = diff_records(tmp_path / "a.parquet", tmp_path / "b.parquet").rl
    d = float(f32(b_bits[:1])[0]) - float(f32(a_bits[:1])[0])
    assert np.expm1(d) - d == 0.0 and d != 0
    assert rl.kl_k3 == pytest.approx(d * d / 4, rel=1e-15) and rl.kl_k2 == pytest.approx(d * d / 4, rel=1e-15)
    assert rl.kl_k1 == -d / 2 and rl.ratio_max == float(np.exp(d)) and rl.ratio_min == 1.0


def test_cli_json_and_clip_option(tmp_path, capsys):
    fa, fb = random_frames(11, "score", 3)
    pa_, pb_ = write(tmp_path / "a.parquet", fa, 3), write(tmp_path / "b.parquet", fb, 3)
    js, md = tmp_path / "d.json", tmp_path / "d.md"
    rc = cli.main(["diff", str(pa_), str(pb_), "--json", str(js), "--markdown", str(md), "--clip", "0.9,1.1"])
    out = capsys.readouterr().out
    assert rc == 1 and "RL KL k1 / k2 / k3" in out
    rl = json.loads(js.read_text(), parse_constant=lambda c: pytest.fail(f"JSON has {c}"))["rl"]
    want = reference(fa, fb, (0.9, 1.1))
    assert rl["clip"] == [0.9, 1.1] and rl["clip_frac"] == want["clip_frac"] and rl["kl_k1"] == want["kl_k1"]
    assert rl["positions"] == want["positions"] and rl["nonfinite"] == want["nonfinite"]
    text = md.read_text()
    assert "| RL ratio outside [0.9, 1.1] |" in text and f"{want['kl_k1']!r}" in text


def test_infinite_ratio_is_spelled_in_json(tmp_path, capsys):
    # a logprob of -100 in the rollout against -1e-30 in the trainer: d = 100, exp(d) finite; -3e38 vs 0: exp overflows
    rows = dict(prompt_id=["x", "x"], pos=[0, 1], token_id=[1, 2], **META)
    write_record(tmp_path / "a.parquet", **rows, logprob=np.array([-100, -3e38], np.float32), cell={"id": "a"})
    write_record(tmp_path / "b.parquet", **rows, logprob=np.array([-1e-30, 0], np.float32), cell={"id": "b"})
    js = tmp_path / "d.json"
    assert cli.main(["diff", str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), "--json", str(js)]) == 1
    capsys.readouterr()
    rl = json.loads(js.read_text())["rl"]
    assert rl["ratio_max"] == "inf" and rl["kl_k3"] == "inf" and rl["clip_frac"] == 1.0 and rl["positions"] == 2


def test_a_signalling_nan_margin_is_left_out_quietly(tmp_path):
    # Record A's top-1 logprob at the one flipped position is a signalling NaN: its float64 cast
    # must not warn (or raise under -W error), and the median has no margin to take.
    rows = dict(prompt_id=["x", "x"], pos=[0, 1], token_id=[1, 2], **META)
    ids = np.array([[5, 6], [5, 6]], np.int32)
    write_record(tmp_path / "a.parquet", **rows, logprob=np.array([-1.0, -2.0], np.float32), top1_id=[5, 5],
                 topk_ids=ids, topk_logprobs=f32([[0x3F800000, 0], [0x7F800001, 0]]), cell={"id": "a"})
    write_record(tmp_path / "b.parquet", **rows, logprob=np.array([-1.0, -2.0], np.float32), top1_id=[5, 6],
                 topk_ids=ids[:, ::-1].copy(), topk_logprobs=f32([[0x3F800000, 0], [0, 0]]), cell={"id": "b"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = diff_records(tmp_path / "a.parquet", tmp_path / "b.parquet")
    rl = r.to_dict()["rl"]
    assert rl["flip_rate"] == 0.5 and rl["flip_margin_p50"] is None
    assert any("numeric margin" in s for s in r.not_compared)


def test_a_negative_zero_flip_margin_keeps_its_sign(tmp_path):
    # Record A's top two logprobs at the flipped position are -0.0 and +0.0: the margin is
    # -0.0 - +0.0 = -0.0, and the median of that one margin is -0.0, not +0.0.
    rows = dict(prompt_id=["x"], pos=[0], token_id=[1], **META)
    ids = np.array([[5, 6]], np.int32)
    write_record(tmp_path / "a.parquet", **rows, logprob=np.array([-1.0], np.float32), top1_id=[5],
                 topk_ids=ids, topk_logprobs=f32([[0x80000000, 0]]), cell={"id": "a"})
    write_record(tmp_path / "b.parquet", **rows, logprob=np.array([-1.0], np.float32), top1_id=[6],
                 topk_ids=ids[:, ::-1].copy(), topk_logprobs=f32([[0, 0x80000000]]), cell={"id": "b"})
    rl = diff_records(tmp_path / "a.parquet", tmp_path / "b.parquet").to_dict()["rl"]
    assert rl["flip_rate"] == 1.0 and rl["flip_margin_p50"] == 0 and math.copysign(1, rl["flip_margin_p50"]) == -1


def test_k3_series_leaves_out_less_than_its_stated_share_at_every_size():
    """docs/metrics.md: the k3 term's Taylor series is cut where the rest is below 2**-56 of the
    term. Exact remainders (60-digit decimals) at both signs of d, on a grid of largest |d| up to
    1/4: cutting by the first omitted term alone leaves out more than that where d < 0."""
    from decimal import Decimal, getcontext

    from repaudit.compare.rl import _series_terms

    getcontext().prec = 60
    limit = Decimal(2) ** -56
    for i in range(1, 2001):
        top = 0.25 * i / 2000
        terms = _series_terms(top)
        for d in (Decimal(top), Decimal(-top)):
            whole = d.exp() - 1 - d
            partial = sum((d ** j / math.factorial(j) for j in range(2, terms + 1)), Decimal(0))
            assert abs(whole - partial) <= limit * whole, (top, terms)
