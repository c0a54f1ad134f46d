"""repaudit.diff against an independent, slow, row-by-row reference on random records, plus the
generate-mode rules, streaming invariance, comparability refusals and fingerprint differences.

The reference aligns rows with a pandas merge and walks each prompt in Python; ULP distances
come from values (math.frexp), absolute differences from exact fractions, percentiles from a
sorted list with nearest rank. Every float it produces is compared with the diff's bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repaudit.record import io as records
from repaudit.diff import DiffResult, Thresholds, cell_differences, comparability, diff_records, verdict
from repaudit.errors import InputError

F32_MAX = float(np.finfo(np.float32).max)
NAN_BITS = [0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF]


# ------------------------------------------------------------------------------ the reference


def f32_position(x: float) -> int:
    """Signed position of a float32 value on the float line, from its value (±0 -> 0)."""
    a = abs(x)
    if math.isinf(a):
        p = f32_position(F32_MAX) + 1
    elif a < 2.0**-126:  # subnormal: a whole number of 2**-149
        p = int(Fraction(a) / Fraction(2) ** -149)
    else:
        m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1; normal binades start after 2**23 subnormals
        p = (e + 126) * 2**23 + int((2 * m - 1) * 2**23)
    return -p if x < 0 else p


def as_value(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def prob_divergence(xa: float, xb: float) -> float:
    """|exp(a) - exp(b)| in float64; inf where exp overflows (both overflowing included)."""
    def exp(x):
        try:
            return math.exp(x)
        except OverflowError:
            return math.inf
    ea, eb = exp(xa), exp(xb)
    return math.inf if math.inf in (ea, eb) else abs(ea - eb)


def nearest_rank(sorted_values: list[int], numerator: int, denominator: int) -> int:
    if not sorted_values:
        return 0
    n = len(sorted_values)
    rank = max(1, -(-numerator * n // denominator))  # ceil(q * n), exactly
    return sorted_values[rank - 1]


@dataclass
class Side:
    prompt_id: list
    pos: np.ndarray
    token_id: np.ndarray
    bits: np.ndarray  # uint32
    top1: np.ndarray
    digest: np.ndarray | None  # uint64 or None
    phase: list | None = None  # None: every row a completion row

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame({"prompt_id": self.prompt_id, "pos": self.pos, "token_id": self.token_id,
                           "bits": self.bits.astype(np.int64), "top1": self.top1,
                           "prompt_row": [p == "prompt" for p in self.phase] if self.phase else False})
        # object dtype: pandas would hold uint64 hashes as float64 (rounded) once the merge adds holes
        df["digest"] = pd.Series([None] * len(df) if self.digest is None else [int(d) for d in self.digest], dtype=object)
        return df

    def write(self, path: Path, **meta) -> Path:
        kw = dict(cell={"id": path.stem}, env={"torch": "2.0"}, probes={"name": "p", "sha256": "0"},
                  model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"})
        kw.update(meta)
        records.write_record(path, prompt_id=self.prompt_id, pos=self.pos, token_id=self.token_id,
                             logprob=self.bits.view(np.float32), top1_id=self.top1, row_digest=self.digest,
                             phase=self.phase, **kw)
        return path


def reference(a: Side, b: Side) -> dict:
    """Every metric of the diff, computed the slow way."""
    fa, fb = a.frame(), b.frame()
    shared = sorted(set(fa.prompt_id) & set(fb.prompt_id))
    m = fa.merge(fb, on=["prompt_id", "pos"], how="outer", suffixes=("_a", "_b"), indicator=True)
    out = dict(matched=0, comparable=0, after=0, bitwise_equal=0, nan_vs_number=0, nan_payload=0,
               digest_compared=0, digest_equal=0, top1_compared=0, top1_equal=0, unmatched_a=0, unmatched_b=0)
    ulps, abs_diffs, probs, prompts = [], [], [], {}
    for pid in shared:
        g = m[m.prompt_id == pid].sort_values("pos")
        both = g[g._merge == "both"]
        out["unmatched_a"] += int((g._merge == "left_only").sum())
        out["unmatched_b"] += int((g._merge == "right_only").sum())
        # A row one side lacks ends the shared prefix, except a prompt row before the other side's
        # first row (a generate record has none of the prompt's rows).
        first_a, first_b = g.pos[g._merge != "right_only"].min(), g.pos[g._merge != "left_only"].min()
        early_prompt_a = (g.pos < first_b) & (g.prompt_row_a == True)  # noqa: E712 (NaN where absent)
        early_prompt_b = (g.pos < first_a) & (g.prompt_row_b == True)  # noqa: E712
        lacking = g[((g._merge == "left_only") & ~early_prompt_a) | ((g._merge == "right_only") & ~early_prompt_b)]
        breaks = list(lacking.pos) + list(both.pos[both.token_id_a != both.token_id_b])
        div = min(breaks) if breaks else None
        first_lp, max_ulp, n_cmp, n_eq = None, 0, 0, 0
        for row in both.itertuples():
            out["matched"] += 1
            same_context = div is None or row.pos <= div
            if not same_context:
                out["after"] += 1
                continue
            if row.digest_a is not None and row.digest_b is not None and not pd.isna(row.digest_a) and not pd.isna(row.digest_b):
                out["digest_compared"] += 1
                out["digest_equal"] += int(row.digest_a) == int(row.digest_b)
            if row.top1_a >= 0 and row.top1_b >= 0:
                out["top1_compared"] += 1
                out["top1_equal"] += row.top1_a == row.top1_b
            if div is not None and row.pos == div:
                continue  # same context, different token: logprob not comparable
            n_cmp += 1
            xa, xb = as_value(int(row.bits_a)), as_value(int(row.bits_b))
            if int(row.bits_a) == int(row.bits_b):
                n_eq += 1
                ulps.append(0)
                abs_diffs.append(Fraction(0))
                continue
            first_lp = row.pos if first_lp is None else min(first_lp, row.pos)
            if math.isnan(xa) and math.isnan(xb):
                out["nan_payload"] += 1
            elif math.isnan(xa) or math.isnan(xb):
                out["nan_vs_number"] += 1
            else:
                d = abs(f32_position(xa) - f32_position(xb))
                ulps.append(d)
                max_ulp = max(max_ulp, d)
                abs_diffs.append(math.inf if math.isinf(xa) or math.isinf(xb) else abs(Fraction(xa) - Fraction(xb)))
                probs.append(prob_divergence(xa, xb))
        out["comparable"] += n_cmp
        out["bitwise_equal"] += n_eq
        prompts[pid] = dict(first_token_divergence=div, first_logprob_divergence=first_lp, max_ulp=max_ulp,
                            comparable=n_cmp, bitwise_equal=n_eq, matched=len(both),
                            rows_a=int((fa.prompt_id == pid).sum()), rows_b=int((fb.prompt_id == pid).sum()))
    ulps.sort()
    n = len(ulps)
    finite = [x for x in abs_diffs if x != math.inf]
    out.update(
        ulp_max=ulps[-1] if ulps else 0,
        ulp_mean=float(Fraction(sum(ulps), n)) if n else 0.0,
        ulp_p50=nearest_rank(ulps, 50, 100), ulp_p99=nearest_rank(ulps, 99, 100),
        abs_max=float(max(abs_diffs)) if abs_diffs else 0.0,
        abs_mean=(math.inf if len(finite) < len(abs_diffs) else float(sum(finite) / n)) if n else 0.0,
        prob_max=max(probs, default=0.0),
        prompts=prompts,
        seq_token=sum(p["first_token_divergence"] is None for p in prompts.values()),
        seq_bitwise=sum(p["first_token_divergence"] is None and p["first_logprob_divergence"] is None for p in prompts.values()),
    )
    return out


def same_float(x: float, y: float) -> bool:
    return np.array([x]).view(np.uint64)[0] == np.array([y]).view(np.uint64)[0]


def assert_matches_reference(r: DiffResult, ref: dict) -> None:
    got = dict(matched=r.matched, comparable=r.comparable, after=r.after_divergence, bitwise_equal=r.bitwise_equal,
               nan_vs_number=r.nan_vs_number, nan_payload=r.nan_payload_differs, digest_compared=r.digest_compared,
               digest_equal=r.digest_equal, top1_compared=r.top1_compared, top1_equal=r.top1_equal,
               unmatched_a=r.unmatched_a, unmatched_b=r.unmatched_b, ulp_max=r.ulp_max, ulp_p50=r.ulp_p50,
               ulp_p99=r.ulp_p99)
    assert got == {k: ref[k] for k in got}
    for name in ("ulp_mean", "abs_max", "abs_mean", "prob_max"):
        assert same_float(getattr(r, name), ref[name]), (name, getattr(r, name), ref[name])
    shared = {p.prompt_id: p for p in r.shared_prompts}
    assert set(shared) == set(ref["prompts"])
    for pid, want in ref["prompts"].items():
        p = shared[pid]
        assert {k: getattr(p, k) for k in want} == want, pid
    assert sum(p.token_match for p in r.shared_prompts) == ref["seq_token"]
    assert sum(p.bitwise_match for p in r.shared_prompts) == ref["seq_bitwise"]
    if ref["comparable"]:
        assert r.bitwise_equal_rate == ref["bitwise_equal"] / ref["comparable"]


# ------------------------------------------------------------------------------ random records


def random_pair(seed: int, mode: str = "generate", digests: str = "both", n_prompts: int = 9) -> tuple[Side, Side]:
    rng = np.random.default_rng(seed)
    names = [f"p{rng.integers(0, 10**6)}-{i}" for i in range(n_prompts)]
    rows_a, rows_b = [], []
    for name in names:
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, 50, length)
        kind = rng.choice(["same", "same", "fork", "shorter", "longer", "hole"]) if mode == "generate" else "same"
        tb, len_b = tokens.copy(), length
        if kind == "fork" and length > 1:
            at = int(rng.integers(0, length))
            tb[at:] = (tokens[at:] + 1 + rng.integers(0, 5, length - at)) % 50
        elif kind == "shorter" and length > 1:
            len_b = int(rng.integers(1, length))
        elif kind == "longer":
            len_b = length + int(rng.integers(1, 5))
            tb = np.concatenate([tokens, rng.integers(0, 50, len_b - length)])
        positions_b = list(range(len_b))
        if kind == "hole" and length > 2:
            positions_b.remove(int(rng.integers(1, length - 1)))
        rows_a += [(name, p, int(tokens[p])) for p in range(length)]
        rows_b += [(name, p, int(tb[p])) for p in positions_b]

    def logprobs(n: int) -> np.ndarray:
        v = (-rng.exponential(3.0, n)).astype(np.float32)
        tiny = rng.random(n) < 0.05  # confident tokens: logprobs just below zero, many binades down
        v[tiny] = -np.exp(rng.uniform(-40, -10, int(tiny.sum()))).astype(np.float32)
        bits = v.view(np.uint32).copy()
        special = rng.random(n) < 0.08
        bits[special] = rng.choice(np.array(NAN_BITS + [0x80000000, 0x0, 0x1, 0x80000001, 0xFF800000, 0x7F800000, 0x80400000],
                                            dtype=np.uint32), int(special.sum()))
        return bits

    def side(rows, bits, top1, digest) -> Side:
        return Side([r[0] for r in rows], np.array([r[1] for r in rows]), np.array([r[2] for r in rows]), bits, top1, digest)

    na = len(rows_a)
    bits_a = logprobs(na)
    top1_a = rng.integers(-1, 6, na)
    dig_a = rng.integers(0, 1 << 64, na, dtype=np.uint64)
    a = side(rows_a, bits_a, top1_a, dig_a if digests in ("both", "a") else None)

    index_a = {(r[0], r[1]): i for i, r in enumerate(rows_a)}
    nb = len(rows_b)
    bits_b, top1_b = logprobs(nb), rng.integers(-1, 6, nb)
    dig_b = rng.integers(0, 1 << 64, nb, dtype=np.uint64)
    for j, r in enumerate(rows_b):
        i = index_a.get((r[0], r[1]))
        if i is None:
            continue
        u = rng.random()
        ab = int(bits_a[i])
        if u < 0.45:
            bits_b[j] = ab  # bitwise equal
        elif u < 0.65:
            bits_b[j] = (ab + int(rng.integers(-3, 4))) & 0xFFFFFFFF  # a few ULP (may cross into NaN/inf space)
        elif u < 0.72:
            bits_b[j] = (ab + int(rng.integers(65536, 1 << 24))) & 0xFFFFFFFF  # far: above the exact histogram
        elif u < 0.76:
            bits_b[j] = ab ^ 0x80000000  # sign flip: distance across zero
        # else: an unrelated random value or special
        if rng.random() < 0.7:
            top1_b[j] = top1_a[i]
        if rng.random() < 0.6:
            dig_b[j] = dig_a[i]
    b = side(rows_b, bits_b, top1_b, dig_b if digests in ("both", "b") else None)
    return a, b


@pytest.mark.parametrize("seed", range(8))
def test_random_generate_records_match_reference(tmp_path, seed):
    a, b = random_pair(seed, "generate", digests=["both", "a", "b", "none"][seed % 4])
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    assert_matches_reference(r, reference(a, b))


@pytest.mark.parametrize("seed", range(100, 104))
def test_random_score_records_match_reference(tmp_path, seed):
    a, b = random_pair(seed, "score")
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    ref = reference(a, b)
    assert_matches_reference(r, ref)
    assert ref["after"] == 0 and r.comparable == r.matched == len(a.pos)  # score mode compares every row


@pytest.mark.parametrize("seed", [7, 8])
def test_streaming_gives_identical_results(tmp_path, monkeypatch, seed):
    """Batch sizes and row-group boundaries that cut prompts in different places change nothing."""
    a, b = random_pair(seed, "generate", n_prompts=14)
    pa_, pb_ = a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet")
    base = diff_records(pa_, pb_).to_dict()
    assert_matches_reference(diff_records(pa_, pb_), reference(a, b))
    for batch_rows in (7, 1000, 1 << 20, 3):
        assert diff_records(pa_, pb_, batch_rows=batch_rows).to_dict() == base, batch_rows
    for rg_a, rg_b in ((5, 13), (1, 64), (17, 3)):
        out = tmp_path / f"rg-{rg_a}-{rg_b}"
        out.mkdir()
        monkeypatch.setattr(records, "ROW_GROUP_ROWS", rg_a)
        ga = a.write(out / "a.parquet")
        monkeypatch.setattr(records, "ROW_GROUP_ROWS", rg_b)
        gb = b.write(out / "b.parquet")
        assert records.open_record(ga)[0].metadata.num_row_groups == -(-len(a.pos) // rg_a)
        for batch_rows in (7, 1 << 20):
            got = diff_records(ga, gb, batch_rows=batch_rows).to_dict()
            for side in ("a", "b"):
                got[side]["path"] = base[side]["path"]
            assert got == base, (rg_a, rg_b, batch_rows)


# ------------------------------------------------------------------------------ explicit cases


def _side(prompt_rows: dict[str, list[tuple[int, int, int]]], digest: bool = True, top1: int | None = None,
          prompt_len: dict[str, int] | None = None) -> Side:
    """prompt -> [(pos, token, logprob bits)] ; digest = token * 1000 + pos, top1 = token unless given;
    rows before prompt_len[prompt] are prompt rows (none unless given)."""
    ids, pos, tok, bits = [], [], [], []
    for pid, rows in prompt_rows.items():
        for p, t, lb in rows:
            ids.append(pid), pos.append(p), tok.append(t), bits.append(lb)
    phase = None if prompt_len is None else ["prompt" if p < prompt_len.get(i, 0) else "completion"
                                             for i, p in zip(ids, pos)]
    tok_a = np.array(tok)
    dig = (np.array(pos, dtype=np.uint64) + np.uint64(1000) * np.array([hash(i) % 997 for i in ids], dtype=np.uint64)) if digest else None
    return Side(ids, np.array(pos), tok_a, np.array(bits, dtype=np.uint32),
                tok_a.copy() if top1 is None else np.full(len(ids), top1), dig, phase)


ONE = 0x3F800000  # 1.0 (a logprob above 0 is fine for the arithmetic)
M2 = 0xC0000000  # -2.0


def test_token_divergence_rules(tmp_path):
    seq = [(p, 10 + p, M2 + p) for p in range(8)]
    fork = [(p, t if p < 5 else t + 1, lb) for p, t, lb in seq]
    hole = [row for row in seq if row[0] != 3]
    # "late" and "late-hole": A is a score record whose rows 0-2 are the prompt's; "dropped": A
    # holds completion rows 0-2 that B, begun at 3, lacks.
    a = _side({"fork": seq, "short": seq, "hole": seq, "same": seq, "late": seq, "late-hole": seq, "dropped": seq},
              prompt_len={"late": 3, "late-hole": 3})
    late_hole = [row for row in seq[3:] if row[0] != 5]
    b = _side({"fork": fork, "short": seq[:6], "hole": hole, "same": seq, "late": seq[3:], "late-hole": late_hole,
               "dropped": seq[3:]})
    b.digest[[i for i, (pid, p) in enumerate(zip(b.prompt_id, b.pos)) if pid == "fork" and p >= 6]] += np.uint64(1)
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    assert_matches_reference(r, reference(a, b))
    by = {p.prompt_id: p for p in r.prompts}
    # fork: tokens differ from pos 5; rows 0-4 compared, row 5 compares digest/top1 only, 6-7 not compared
    assert (by["fork"].first_token_divergence, by["fork"].comparable, by["fork"].matched) == (5, 5, 8)
    # short: B ends at 6, the length difference ends the shared prefix there
    assert (by["short"].first_token_divergence, by["short"].comparable, by["short"].rows_b) == (6, 6, 6)
    # hole: B lacks pos 3; rows after it are not compared either
    assert (by["hole"].first_token_divergence, by["hole"].comparable, by["hole"].matched) == (3, 3, 7)
    assert by["same"].first_token_divergence is None and by["same"].comparable == 8
    # late: B begins at pos 3 (as a generate record begins at the prompt's end): rows 3-7 compare
    assert (by["late"].first_token_divergence, by["late"].comparable, by["late"].matched) == (None, 5, 5)
    # late-hole: begun at 3, B then lacks pos 5: that ends the shared prefix
    assert (by["late-hole"].first_token_divergence, by["late-hole"].comparable) == (5, 2)
    # dropped: a completion row B lacks ends the shared prefix even before B's first row
    assert (by["dropped"].first_token_divergence, by["dropped"].comparable, by["dropped"].token_match) == (0, 0, False)
    assert r.after_divergence == 2 + 4 + 2 + 5  # fork 6,7; hole 4..7; late-hole 6,7; dropped 3..7
    assert (r.unmatched_a, r.unmatched_b) == (2 + 1 + 3 + 4 + 3, 0)
    assert not r.identical
    # digests at fork pos 6, 7 differ but sit after the divergence: not compared, so all compared are equal
    assert r.digest_equal == r.digest_compared == 8 + 6 + 6 + 3 + 5 + 2  # same; fork, short: 0-5; hole: 0-2; late; late-hole: 3-4
    # top1 = token on each side: at fork pos 5 they differ, and that row is compared
    assert (r.top1_compared, r.top1_compared - r.top1_equal) == (30, 1)
    assert r.bitwise_equal == r.comparable and r.seq_token_match_rate == 2 / 7  # same, late
    assert not r.passed
    assert any("5 of 7 sequences differ in tokens or length (first: 'dropped' at pos 0)" in x for x in r.reasons)
    assert "1 of 30 positions change their most likely token" in r.reasons  # strict: a moved argmax fails too
    assert not r.identical


def test_score_mode_first_logprob_divergence(tmp_path):
    seq = [(p, 10 + p, M2 + p) for p in range(6)]
    moved = [(p, t, lb + (2 if p in (2, 4) else 0)) for p, t, lb in seq]
    a, b = _side({"x": seq, "y": seq}), _side({"x": moved, "y": seq})
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    x = next(p for p in r.prompts if p.prompt_id == "x")
    assert (x.first_token_divergence, x.first_logprob_divergence, x.max_ulp, x.bitwise_equal) == (None, 2, 2, 4)
    assert x.token_match and not x.bitwise_match
    assert (r.seq_token_match_rate, r.seq_bitwise_match_rate) == (1.0, 0.5)
    assert (r.ulp_max, r.ulp_p50, r.ulp_p99, r.comparable, r.bitwise_equal) == (2, 0, 2, 12, 10)
    assert r.ulp_mean == 4 / 12
    assert r.reasons == ["2 of 12 logprobs differ in their bits (max 2 ULP)"]


def test_nan_and_inf_categories(tmp_path):
    rows_a = [(0, 1, 0x7FC00000), (1, 1, 0x7FC00000), (2, 1, 0x7FC00000), (3, 1, 0xFF800000),
              (4, 1, 0xFF800000), (5, 1, 0x80000000), (6, 1, ONE)]
    rows_b = [(0, 1, 0x7FC00000), (1, 1, 0x7FC00001), (2, 1, ONE), (3, 1, 0xFF800000),
              (4, 1, 0xC1200000), (5, 1, 0x00000000), (6, 1, ONE)]
    a, b = _side({"p": rows_a}), _side({"p": rows_b})
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    assert_matches_reference(r, reference(a, b))
    # same NaN bits and same -inf are equal; -0.0 vs +0.0 differ in bits at distance 0
    assert (r.bitwise_equal, r.nan_payload_differs, r.nan_vs_number) == (3, 1, 1)
    assert r.ulp_max == 0xFF800000 - 0xC1200000 and r.abs_max == math.inf and r.abs_mean == math.inf
    assert r.prob_max == math.exp(-10.0)  # |exp(-inf) - exp(-10)|
    assert r.ulp_p50 == 0  # distances: 0 (x3 equal), 0 (±0), huge -> nearest rank 3 of 5
    assert "1 logprobs are NaN on one side only" in r.reasons
    assert "1 logprobs are NaN on both sides with different bits" in r.reasons
    d = r.to_dict()
    text = json.dumps(d, allow_nan=False)  # JSON has no inf/NaN tokens: they are spelled as strings
    assert d["logprob"]["abs_max"] == "inf" and d["logprob"]["abs_mean"] == "inf"
    assert json.loads(text)["logprob"]["nan_vs_number"] == 1


def test_large_ulp_distances_enter_percentiles_exactly(tmp_path):
    # 100 compared rows: distances 0..39 (small) and 70000 + 1000*k for 60 rows (all above 2**16)
    base = 0xC0000000
    dists = list(range(40)) + [70000 + 1000 * k for k in range(60)]
    a = _side({"p": [(i, 1, base) for i in range(100)]})
    b = _side({"p": [(i, 1, base + d) for i, d in enumerate(dists)]})
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"), batch_rows=9)
    s = sorted(dists)
    assert (r.ulp_p50, r.ulp_p99, r.ulp_max) == (s[49], s[98], s[99])
    assert r.ulp_mean == sum(dists) / 100
    assert_matches_reference(r, reference(a, b))
    # only large ones
    b2 = _side({"p": [(i, 1, base + 65536 + 7 * i) for i in range(100)]})
    r2 = diff_records(a.write(tmp_path / "a.parquet"), b2.write(tmp_path / "c.parquet"))
    assert (r2.ulp_p50, r2.ulp_p99) == (65536 + 7 * 49, 65536 + 7 * 98)


def test_percentile_nearest_rank_small_counts(tmp_path):
    a = _side({"p": [(0, 1, M2), (1, 1, M2), (2, 1, M2)]})
    b = _side({"p": [(0, 1, M2 + 5), (1, 1, M2 + 1), (2, 1, M2 + 9)]})
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    # sorted 1, 5, 9: p50 -> rank ceil(1.5) = 2 -> 5; p99 -> rank 3 -> 9
    assert (r.ulp_p50, r.ulp_p99, r.ulp_max) == (5, 9, 9)


def test_abs_mean_is_exact_and_independent_of_batching(tmp_path):
    """The mean |Δ| is the exact mean rounded once, so no batch size can move its last bit."""
    rng = np.random.default_rng(11)
    n = 3000
    va = -np.exp(rng.uniform(-25, 4, n)).astype(np.float32)
    vb = (va * (1 + rng.normal(0, 1e-3, n))).astype(np.float32)
    vb[:50] = -np.exp(rng.uniform(-60, -40, 50)).astype(np.float32)  # far apart: float64 a - b rounds
    a = _side({"p": [(i, 1, int(x)) for i, x in enumerate(va.view(np.uint32))]})
    b = _side({"p": [(i, 1, int(x)) for i, x in enumerate(vb.view(np.uint32))]})
    pa_, pb_ = a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet")
    exact = float(sum(abs(Fraction(float(x)) - Fraction(float(y))) for x, y in zip(va, vb)) / n)
    for batch_rows in (7, 13, 100, 1000, 4096, 1 << 20):
        assert same_float(diff_records(pa_, pb_, batch_rows=batch_rows).abs_mean, exact), batch_rows


def test_abs_mean_counts_what_float64_a_minus_b_rounds_away(tmp_path):
    # |-1 - 2**-60| = 1 + 2**-60 rounds to 1.0 in float64; with |-2**-53 - (-0.0)| = 2**-53 the exact
    # sum 1 + 2**-53 + 2**-60 lies just above a tie, so the mean rounds up; without the 2**-60 it would not
    a = _side({"p": [(0, 1, 0xBF800000), (1, 1, 0xA5000000)]})  # -1.0, -2**-53
    b = _side({"p": [(0, 1, 0x21800000), (1, 1, 0x80000000)]})  # 2**-60, -0.0
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"))
    assert r.abs_mean == 0.5 + 2.0**-53 and r.abs_max == 1.0
    assert_matches_reference(r, reference(a, b))


def test_prob_divergence_never_nan(tmp_path):
    # logprobs > 709.78 (no log-softmax gives them) overflow exp on both sides: inf - inf must read
    # as inf, in any batch, not as a NaN that max() drops or keeps depending on order
    a = _side({"p": [(0, 1, 0xC0000000), (1, 1, 0x447A0000), (2, 1, 0xC0000000)]})  # -2, 1000, -2
    b = _side({"p": [(0, 1, 0xC0000001), (1, 1, 0x447A4000), (2, 1, 0xC0000002)]})  # ..., 1001, ...
    pa_, pb_ = a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet")
    for batch_rows in (1, 2, 1 << 20):
        assert diff_records(pa_, pb_, batch_rows=batch_rows).prob_max == math.inf


def test_identical_records(tmp_path):
    a, _ = random_pair(3, "score")
    r = diff_records(a.write(tmp_path / "a.parquet"), a.write(tmp_path / "b.parquet"))
    assert r.identical and r.passed and r.reasons == []
    assert r.bitwise_equal == r.comparable == len(a.pos) and r.ulp_max == 0 and r.abs_max == 0.0
    assert r.digest_equal == r.digest_compared == len(a.pos)


def test_columns_on_one_side_only_are_never_read_as_equal(tmp_path):
    a = _side({"p": [(0, 1, M2), (1, 1, M2)]}, digest=False, top1=-1)
    b = _side({"p": [(0, 1, M2), (1, 1, M2)]}, digest=True, top1=3)
    pa_, pb_ = a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet")
    r = diff_records(pa_, pb_)
    assert (r.digest_compared, r.top1_compared, r.digest_equal_rate, r.top1_agreement) == (0, 0, None, None)
    assert (r.digest_only_a, r.digest_only_b, r.top1_only_a, r.top1_only_b) == (0, 2, 0, 2)
    assert not r.passed and not r.identical
    # a record without any row digest is an engine that cannot see the logits row (vLLM): listed, not failed
    assert r.reasons == ["record A has no top-1 ids (B has them at 2 positions); cannot compare the most likely tokens"]
    d = r.to_dict()
    assert (d["digest"]["only_b"], d["top1"]["only_b"]) == (2, 2)
    assert "row digests: 2 positions hold them in B only" in d["not_compared"]
    assert verdict(r, Thresholds(max_ulp=0)) == (True, [])  # a tolerance relaxes distribution checks
    # digests alone on one side: the pair is judged (and identical) on everything else
    b_top1 = _side({"p": [(0, 1, M2), (1, 1, M2)]}, digest=False, top1=3)
    r = diff_records(b_top1.write(tmp_path / "c.parquet"), pb_)
    assert r.passed and r.identical and r.reasons == [] and (r.digest_compared, r.digest_only_b) == (0, 2)
    # both sides without digests (vLLM records): nothing to compare, and nothing wrong
    r = diff_records(pa_, pa_)
    assert r.passed and r.identical and r.digest_compared == 0
    assert "row digests: in neither record" in r.to_dict()["not_compared"]


def test_digests_on_part_of_the_rows(tmp_path):
    a = _side({"p": [(i, 1, M2) for i in range(4)]})
    pa_ = a.write(tmp_path / "a.parquet")
    table = pq.read_table(pa_)
    digests = table.column("row_digest").to_pylist()
    holed = table.set_column(table.schema.get_field_index("row_digest"), "row_digest",
                             pa.array([None, digests[1], None, digests[3]], pa.uint64()))
    pb_ = tmp_path / "b.parquet"
    pq.write_table(holed, pb_)
    r = diff_records(pa_, pb_)
    assert (r.digest_compared, r.digest_equal, r.digest_only_a, r.digest_only_b) == (2, 2, 2, 0)
    assert r.reasons == ["2 positions hold row digests in record A only; cannot prove the distributions equal there"]
    assert not r.identical


def test_digests_missing_from_the_shared_rows_only_are_a_gap(tmp_path):
    """Record B holds digests, but only for a prompt A lacks: its engine can make them, so the
    shared rows' missing digests fail the verdict; with no digest anywhere in B they would not."""
    a = _side({"p": [(i, 1, M2) for i in range(2)]})
    pa_ = a.write(tmp_path / "a.parquet")
    b = _side({"p": [(i, 1, M2) for i in range(2)], "q": [(0, 1, M2)]})
    table = pq.read_table(b.write(tmp_path / "full.parquet"))
    keep = table.column("row_digest").to_pylist()
    ids = table.column("prompt_id").to_pylist()
    holed = table.set_column(table.schema.get_field_index("row_digest"), "row_digest",
                             pa.array([d if p == "q" else None for d, p in zip(keep, ids)], pa.uint64()))
    pb_ = tmp_path / "b.parquet"
    pq.write_table(holed, pb_)
    r = diff_records(pa_, pb_, allow_partial=True)
    assert (r.digest_compared, r.digest_only_a, r.digest_rows_a, r.digest_rows_b) == (0, 2, 2, 1)
    assert "2 positions hold row digests in record A only" in " ".join(r.reasons) and not r.identical
    none = table.set_column(table.schema.get_field_index("row_digest"), "row_digest", pa.nulls(len(ids), pa.uint64()))
    pq.write_table(none, pb_)
    r = diff_records(pa_, pb_, allow_partial=True)
    assert (r.digest_only_a, r.digest_rows_b) == (2, 0) and not any("digest" in x for x in r.reasons)
    assert r.to_dict()["digest"]["record_rows_b"] == 0


# ------------------------------------------------------------------------------ comparability


def test_refuses_different_probe_suites_tokenizers_and_prompt_sets(tmp_path):
    a, _ = random_pair(1, "score", n_prompts=4)
    pa_ = a.write(tmp_path / "a.parquet")
    cases = [
        (dict(probes={"name": "other", "sha256": "0"}), "probe suite differs (p sha256 0 vs other sha256 0)"),
        (dict(probes={"name": "p", "sha256": "9"}), "probe suite differs"),
        (dict(tokenizer={"name": "t2", "sha256": "2"}), "tokenizer differs (t sha256 1 vs t2 sha256 2)"),
    ]
    for meta, message in cases:
        pb_ = a.write(tmp_path / "b.parquet", **meta)
        with pytest.raises(InputError) as err:
            diff_records(pa_, pb_)
        assert message in str(err.value) and "--allow-partial" in str(err.value)
        r = diff_records(pa_, pb_, allow_partial=True)
        assert any(message in x for x in r.refusals) and r.identical

    keep = [i for i, p in enumerate(a.prompt_id) if p != a.prompt_id[0]]
    fewer = Side([a.prompt_id[i] for i in keep], a.pos[keep], a.token_id[keep], a.bits[keep], a.top1[keep], a.digest[keep])
    pb_ = fewer.write(tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"prompt sets differ \(1 only in A, 0 only in B, e\.g\. '" + a.prompt_id[0]):
        diff_records(pa_, pb_)
    r = diff_records(pa_, pb_, allow_partial=True)
    assert r.refusals == [f"prompt sets differ (1 only in A, 0 only in B, e.g. {a.prompt_id[0]!r})"]
    d = r.to_dict()
    assert d["sequences"]["only_in_a"] == [a.prompt_id[0]] and d["sequences"]["only_in_b"] == []
    assert d["partial"] == r.refusals
    assert (r.unmatched_a, r.unmatched_b, r.comparable) == (0, 0, len(keep))  # left-out rows are not "unmatched"
    assert r.passed and not r.identical and r.seq_token_match_rate == 1.0
    assert r.rows_a - r.matched == len(a.pos) - len(keep)


def test_comparability_helper_lists_every_problem():
    from repaudit.records import RecordMeta

    a = RecordMeta(cell={"id": "a"}, env={}, probes={"name": "s", "sha256": "1"}, model={}, tokenizer={"name": "t", "sha256": "x"},
                   prompts=["p", "q"], topk=0)
    b = RecordMeta(cell={"id": "b"}, env={}, probes={"name": "s2", "sha256": "1"}, model={}, tokenizer={"name": "t", "sha256": "y"},
                   prompts=["q", "r", "s"], topk=0)
    problems = comparability(a, b)
    assert [p.split(" (")[0] for p in problems] == ["probe suite differs", "tokenizer differs", "prompt sets differ"]
    assert "1 only in A, 2 only in B" in problems[2]
    assert comparability(a, a) == []


def test_environment_and_cell_differences_are_listed(tmp_path):
    a, _ = random_pair(2, "score", n_prompts=3)
    env_a = {"torch": "2.5.1", "cuda": "12.4", "gpus": ["H100"], "vars": {"NCCL_ALGO": "Ring"}, "python": "3.11"}
    env_b = {"torch": "2.6.0", "cuda": "12.4", "gpus": ["H200"], "vars": {"NCCL_PROTO": "LL"}, "python": "3.11"}
    pa_ = a.write(tmp_path / "a.parquet", env=env_a, cell={"id": "x", "tp": 1, "engine": "hf"})
    pb_ = a.write(tmp_path / "b.parquet", env=env_b, cell={"id": "y", "tp": 2, "engine": "hf", "nccl": "ring"})
    r = diff_records(pa_, pb_)
    assert r.env_differences == [("torch", "2.5.1", "2.6.0"), ("gpus", ["H100"], ["H200"]),
                                 ("env NCCL_ALGO", "Ring", None), ("env NCCL_PROTO", None, "LL")]
    assert r.cell_differences == [("nccl", None, "ring"), ("tp", 1, 2)]  # the id is not a setting
    assert r.identical and r.passed  # a different environment alone is not a divergence
    d = r.to_dict()
    assert ["torch", "2.5.1", "2.6.0"] in d["environment_differences"]
    assert cell_differences({"id": "a", "x": 1}, {"id": "b", "x": 1}) == []


def test_empty_record_is_refused(tmp_path):
    a, _ = random_pair(4, "score", n_prompts=2)
    pa_ = a.write(tmp_path / "a.parquet")
    empty = Side([], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.uint32), np.zeros(0, np.int32), None)
    pe = empty.write(tmp_path / "e.parquet")
    with pytest.raises(InputError, match="record has no rows"):
        diff_records(pa_, pe)


# ------------------------------------------------------------------------------ verdict


def _result(**kw) -> DiffResult:
    from repaudit.records import RecordMeta

    meta = RecordMeta(cell={"id": "a"}, env={}, probes={}, model={}, tokenizer={}, prompts=[], topk=0)
    return DiffResult(a=meta, b=meta, thresholds=Thresholds(), **kw)


def test_verdict_thresholds():
    r = _result(comparable=10, bitwise_equal=9, ulp_max=3, abs_max=0.5)
    assert verdict(r, Thresholds()) == (False, ["1 of 10 logprobs differ in their bits (max 3 ULP)"])
    assert verdict(r, Thresholds(max_ulp=3)) == (True, [])
    assert verdict(r, Thresholds(max_ulp=2)) == (False, ["max ULP 3 > 2"])
    assert verdict(r, Thresholds(max_abs=0.5)) == (True, [])
    assert verdict(r, Thresholds(max_abs=0.4999)) == (False, ["max |Δ logprob| 0.5 > 0.4999"])
    assert verdict(r, Thresholds(max_ulp=3, max_abs=0.1))[0] is False
    digest = _result(comparable=1, bitwise_equal=1, digest_compared=4, digest_equal=3)
    assert verdict(digest, Thresholds()) == (False, ["1 of 4 logits rows differ (row digest)"])
    assert verdict(digest, Thresholds(max_ulp=0)) == (True, [])  # a tolerance relaxes digests too
    nan = _result(comparable=2, bitwise_equal=1, nan_vs_number=1)
    assert verdict(nan, Thresholds(max_ulp=10**9))[0] is False  # NaN vs number is never tolerated


def test_thresholds_given_as_numpy_scalars(tmp_path):
    """Thresholds computed with numpy (np.float64, np.int64) decide, print and serialise exactly like
    Python numbers: no crash in the exact seq-divergence check, no "np.float64(...)" in the text."""
    from repaudit.compare.gate import threshold_args

    th = Thresholds(max_ulp=np.int64(2), max_abs=np.float64(0.4999), max_seq_divergence=np.float64(0.5))
    assert threshold_args(th) == ["--max-ulp", "2", "--max-abs", "0.4999", "--max-seq-divergence", "0.5"]
    r = _result(comparable=10, bitwise_equal=9, ulp_max=3, abs_max=0.5)
    assert verdict(r, th) == (False, ["max ULP 3 > 2", "max |Δ logprob| 0.5 > 0.4999"])
    json.dumps(vars(th), allow_nan=False)  # np.int64 is not JSON
    side = dict(probes={"name": "p", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"}, env={})
    for name, tokens in (("a", [5, 5]), ("b", [5, 6])):
        records.write_record(tmp_path / f"{name}.parquet", prompt_id=["p", "q"], pos=[1, 1], token_id=tokens,
                             logprob=np.float32([-1, -1]), cell={"id": name}, **side)
    res = diff_records(tmp_path / "a.parquet", tmp_path / "b.parquet", thresholds=th)
    assert res.passed  # 1 of 2 sequences forked: within 0.5
    with pytest.raises(ValueError, match="whole number"):
        Thresholds(max_ulp=2.5)


def test_a_record_without_a_phase_list_is_read_with_its_phase_column(tmp_path):
    """Records written before `repaudit.phases` existed: the diff reads their phase column, so a
    score record's prompt rows are still exempt and a generate record's missing rows are not."""
    import pyarrow.parquet as pq

    seq = [(p, 10 + p, M2 + p) for p in range(8)]
    a = _side({"late": seq, "dropped": seq}, prompt_len={"late": 3})
    b = _side({"late": seq[3:], "dropped": seq[3:]})
    path_a = a.write(tmp_path / "a.parquet")
    table = pq.read_table(path_a)
    md = {k: v for k, v in table.schema.metadata.items() if k != b"repaudit.phases"}
    old = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata(md), old)
    assert records.read_meta(old).phases is None and records.read_meta(path_a).phases == ["completion", "prompt"]
    for path in (path_a, old):
        by = {p.prompt_id: p for p in diff_records(path, b.write(tmp_path / "b.parquet")).prompts}
        assert by["late"].first_token_divergence is None and by["dropped"].first_token_divergence == 0


def test_first_divergences_are_listed_by_where_the_prompt_first_diverges():
    """A fork at position 1 comes before logprob bits moving at 5 (the run summary's order): the
    table sorted by the logprob position alone put forks last, past its ten rows."""
    from types import SimpleNamespace

    from repaudit.compare.render import divergent_prompts
    from repaudit.compare.result import PromptDiff

    prompts = [PromptDiff("late", True, True, first_logprob_divergence=5),
               PromptDiff("fork", True, True, first_token_divergence=1),
               PromptDiff("same", True, True),
               PromptDiff("both", True, True, first_token_divergence=7, first_logprob_divergence=3)]
    rows = divergent_prompts(SimpleNamespace(shared_prompts=prompts))
    assert [r["prompt"] for r in rows] == ["fork", "both", "late"]


def test_ulp_percentiles_take_the_nearest_rank_in_integers():
    """At 657,247,381,085,762,037 distances, ceil(0.99 * n) in floats is rank 650,674,907,274,904,448,
    31 past the exact one; the 99th percentile must still be the distance at the exact rank."""
    from repaudit.compare.accumulate import Accumulator, percentile

    n = 657_247_381_085_762_037
    exact = -(-n * 99 // 100)
    assert math.ceil(0.99 * n) > exact  # the case the integer rank is for
    acc = Accumulator(1)
    acc.small_hist[0], acc.small_hist[1] = exact, n - exact  # ranks 1..exact hold 0 ULP, the rest 1
    assert percentile(acc, n, 99, 100) == 0
    acc.small_hist[0], acc.small_hist[1] = exact - 1, n - exact + 1
    assert percentile(acc, n, 99, 100) == 1
    assert percentile(acc, 3, 1, 2) == 0 and percentile(acc, 0, 1, 2) == 0


def test_prompt_ids_that_differ_only_by_trailing_nuls_stay_apart(tmp_path):
    # numpy's fixed-width str drops trailing NULs: "a\0" must not be taken for "a" (nor refused as its duplicate).
    a = _side({"a": [(0, 1, M2)], "a\x00": [(0, 2, M2)]})
    pa_ = a.write(tmp_path / "a.parquet")
    assert sorted(pq.read_table(pa_).column("prompt_id").to_pylist()) == ["a", "a\x00"]
    r = diff_records(pa_, pa_)
    assert [p.prompt_id for p in r.prompts] == ["a", "a\x00"] and r.matched == 2 and r.identical


def test_a_prompt_on_one_side_only_has_no_token_divergence(tmp_path):
    # Its rows all look unmatched to the merge, which used to give it the position of its first completion
    # row (pos 4 here, past a prompt row) as a "first token divergence", but null when all its rows were
    # prompt rows. There is only one sequence, so there is no fork: null either way.
    a = _side({"s": [(0, 1, M2), (1, 2, M2)], "only": [(3, 7, M2), (4, 8, M2), (5, 9, M2)],
               "prompt-only": [(0, 5, M2)]}, prompt_len={"only": 4, "prompt-only": 1})
    b = _side({"s": [(0, 1, M2), (1, 2, M2)]})
    r = diff_records(a.write(tmp_path / "a.parquet"), b.write(tmp_path / "b.parquet"), allow_partial=True)
    one_sided = {p["prompt_id"]: p for p in r.to_dict()["prompts"] if not p["in_b"]}
    assert sorted(one_sided) == ["only", "prompt-only"]
    for p in one_sided.values():
        assert (p["first_token_divergence"], p["first_logprob_divergence"], p["token_match"]) == (None, None, False)
    assert (one_sided["only"]["rows_a"], one_sided["only"]["rows_b"], one_sided["only"]["matched"]) == (3, 0, 0)
    assert r.passed and not r.identical and r.seq_token_match_rate == 1.0
