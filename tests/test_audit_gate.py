"""Audit: the gate's pass/fail decision (diff.verdict, which `repaudit gate`, `run --gate`, the
summary and the report all take) against the rules of docs/metrics.md ("Verdict, thresholds and
exit codes"), applied to the independent row-by-row numbers of tests/test_audit_reference.py.

The records reach NaN against a number, NaN payloads, -0.0 against +0.0, ±inf, subnormals, forks,
shorter and longer sequences, holes, and (the hostile generator) row digests, top-1 ids and top-k
lists that differ or are held on one side. The thresholds sit on each pair's own boundaries: the
pair's max ULP and one below it, its max |a - b| and the double just below it, its share of forked
sequences written as the decimal that reads back to it, and one a little below.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from test_audit_reference import SPECIAL, Row, random_logprob, random_pair, reference, write

from repaudit.compare.diff import verdict
from repaudit.compare.gate import gate_files
from repaudit.diff import Thresholds, diff_records


def mild_pair(seed: int) -> tuple[dict, dict]:
    """Records that often pass a tolerance: same prompts and tokens, B's logprob equal to A's, a few
    ULP off, sign-flipped or special; now and then a fork in the last token or a shorter B."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for i in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 12))
        shape = str(rng.choice(["same"] * 6 + ["fork", "shorter"]))
        for pos in range(n):
            bits = random_logprob(rng)
            a[f"p{i}", pos] = Row(pos, bits, -1, None, 7)
            if shape == "shorter" and pos == n - 1 and n > 1:
                continue
            u = rng.random()
            if u < 0.6:
                b_bits = bits
            elif u < 0.8:
                b_bits = (bits + int(rng.integers(-3, 4))) & 0xFFFFFFFF
            elif u < 0.85:
                b_bits = bits ^ 0x80000000
            else:
                b_bits = int(rng.choice(SPECIAL))
            b[f"p{i}", pos] = Row(pos + (shape == "fork" and pos == n - 1), b_bits, -1, None, 7)
    return a, b


def expected(ref: dict, th: Thresholds) -> set[int]:
    """The numbered rules of docs/metrics.md that fail the pair (empty: it passes)."""
    f = ref["fields"]
    strict = th.max_ulp is None and th.max_abs is None
    fail = set()
    if strict:
        if f["bitwise_equal"] != f["comparable"]:
            fail.add(1)
        if f["digest_equal"] != f["digest_compared"]:
            fail.add(2)
        if f["top1_equal"] != f["top1_compared"]:
            fail.add(3)
        if f["topk_ids_equal"] != f["topk_compared"] or f["topk_logprobs_equal"] != f["topk_compared"]:
            fail.add(4)
        if f["top1_only_a"] or f["top1_only_b"] or f["topk_only_a"] or f["topk_only_b"]:
            fail.add(5)
        only_a, only_b = f["digest_only_a"], f["digest_only_b"]
        # Row digests one record holds none of (a vLLM record) are exempt.
        exempt = (not f["digest_compared"] and not (only_a and only_b)
                  and f["digest_rows_b" if only_a else "digest_rows_a"] == 0)
        if (only_a or only_b) and not exempt:
            fail.add(5)
    else:
        if th.max_ulp is not None and f["ulp_max"] > th.max_ulp:
            fail.add(6)
        if th.max_abs is not None and f["abs_max"] > th.max_abs:
            fail.add(6)
    if f["nan_vs_number"]:
        fail.add(7)
    if strict and f["nan_payload_differs"]:
        fail.add(8)
    shared = [p for p in ref["prompts"].values() if p["in_a"] and p["in_b"]]
    forked = sum(p["first_token_divergence"] is not None for p in shared)
    if shared and Fraction(forked, len(shared)) > Fraction(repr(th.max_seq_divergence)):
        fail.add(9)
    return fail


def boundary_thresholds(ref: dict) -> list[Thresholds]:
    f = ref["fields"]
    ulp, dist = f["ulp_max"], f["abs_max"]
    below = float(np.nextafter(dist, -math.inf)) if dist > 0 else 0.0
    shared = [p for p in ref["prompts"].values() if p["in_a"] and p["in_b"]]
    share = sum(p["first_token_divergence"] is not None for p in shared) / max(1, len(shared))
    return [Thresholds(), Thresholds(max_ulp=ulp), Thresholds(max_ulp=max(0, ulp - 1)), Thresholds(max_abs=dist),
            Thresholds(max_abs=below), Thresholds(max_abs=math.inf), Thresholds(max_ulp=ulp, max_abs=below),
            Thresholds(max_ulp=ulp, max_seq_divergence=share), Thresholds(max_abs=dist, max_seq_divergence=share),
            Thresholds(max_ulp=2 * 0x7F800000, max_seq_divergence=float(np.nextafter(share, -1.0)) if share else 0.0),
            Thresholds(max_seq_divergence=1.0)]


@pytest.mark.parametrize("hostile", [False, True])
def test_the_verdict_follows_the_documented_rules(tmp_path, hostile):
    outcomes = set()
    for seed in range(24):  # about 2 s each on two cores
        a, b = random_pair(seed) if hostile else mild_pair(seed)
        pa_ = write(tmp_path / "a.parquet", a, seed % 2 == 0, 3)
        pb_ = write(tmp_path / "b.parquet", b, seed % 2 == 0, 4)
        ref = reference(a, b, (0.5, 2.0))
        r = diff_records(pa_, pb_, allow_partial=True)
        for th in boundary_thresholds(ref):
            want = expected(ref, th)
            passed, reasons = verdict(r, th)
            assert passed == (not want), (seed, th, reasons, want)
            outcomes.add(passed)
    assert outcomes == {True, False}


def test_the_gate_decides_special_values_at_their_thresholds(tmp_path):
    """One row each: (A bits, B bits, thresholds that pass, thresholds that fail), through `repaudit gate`'s
    two-record form."""
    cases = [
        (0x00000000, 0x80000000, [Thresholds(max_ulp=0), Thresholds(max_abs=0.0)], [Thresholds()]),  # +0.0 / -0.0
        (0x00000001, 0x80000001, [Thresholds(max_ulp=2), Thresholds(max_abs=3e-45)],  # subnormals across zero
         [Thresholds(max_ulp=1), Thresholds(max_abs=2e-45)]),
        (0x7F7FFFFF, 0x7F800000, [Thresholds(max_ulp=1), Thresholds(max_abs=math.inf)],  # FLT_MAX / +inf
         [Thresholds(max_ulp=0), Thresholds(max_abs=1e308)]),
        (0xFF800000, 0x7F800000, [Thresholds(max_ulp=2 * 0x7F800000), Thresholds(max_abs=math.inf)],  # -inf / +inf
         [Thresholds(max_ulp=2 * 0x7F800000 - 1), Thresholds()]),
        (0x7FC00000, 0xFFC00001, [Thresholds(max_ulp=0), Thresholds(max_abs=0.0)], [Thresholds()]),  # NaN payloads
        (0x7FC00000, 0xBF800000, [], [Thresholds(max_ulp=10 ** 12), Thresholds(max_abs=math.inf)]),  # NaN / -1.0
    ]
    for x, y, passing, failing in cases:
        pa_ = write(tmp_path / "a.parquet", {("p", 1): Row(1, x, -1, None, 7)}, False, 1)
        pb_ = write(tmp_path / "b.parquet", {("p", 1): Row(1, y, -1, None, 7)}, False, 1)
        for th in passing:
            assert gate_files(pa_, pb_, th).passed, (hex(x), hex(y), th)
        for th in failing:
            assert not gate_files(pa_, pb_, th).passed, (hex(x), hex(y), th)


@pytest.mark.parametrize("kw", [dict(max_abs=math.nan), dict(max_abs=np.float64("nan")), dict(max_abs=-1e-9),
                                dict(max_ulp=-1), dict(max_ulp=math.inf), dict(max_seq_divergence=math.nan),
                                dict(max_seq_divergence=1.5), dict(max_seq_divergence=-0.1)])
def test_a_threshold_that_would_gate_nothing_is_refused(kw):
    """Every check is "value > threshold": a NaN max_abs (a tolerance computed from data holding a NaN)
    used to pass every pair, 3 ULP apart or a million; a NaN max_seq_divergence raised inside the
    verdict. The API refuses what the CLI flags refuse."""
    with pytest.raises(ValueError):
        Thresholds(**kw)


def test_the_junit_thresholds_property_is_json_for_an_infinite_tolerance(tmp_path):
    """`--max-abs inf` is a valid tolerance; the JUnit property said `"max_abs": Infinity`, which a
    strict JSON parser refuses. It reads "inf", as every JSON repaudit writes."""
    import json
    from xml.etree import ElementTree as ET

    from repaudit.report.junit import junit_xml

    pa_ = write(tmp_path / "a.parquet", {("p", 1): Row(1, 0xFF800000, -1, None, 7)}, False, 1)
    pb_ = write(tmp_path / "b.parquet", {("p", 1): Row(1, 0x7F800000, -1, None, 7)}, False, 1)
    g = gate_files(pa_, pb_, Thresholds(max_abs=math.inf))
    assert g.passed  # |-inf - +inf| = inf is within inf
    props = {p.get("name"): p.get("value") for p in ET.fromstring(junit_xml(g, 0.0, "host")).iter("property")}

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    assert json.loads(props["thresholds"], parse_constant=refuse) == {
        "max_abs": "inf", "max_seq_divergence": 0.0, "max_ulp": None, "strict": False}
