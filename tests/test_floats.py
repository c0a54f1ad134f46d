"""ULP distance (repaudit.record.floats) against an independent reference that works from VALUES.

The reference never looks at bit fields to place a float on the line: it decodes the bits to
a value, then counts the representable non-negative values below |x| with math.frexp and
exact fractions (subnormals are multiples of the smallest subnormal, every binade above holds
2**mantissa_bits values). The 16-bit formats are also checked exhaustively against a second
reference: the rank of each value among all 65,536 patterns sorted by value.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repaudit.record.floats import float_bits, is_nan_bits, ordered, ulp_distance, ulp_distance_bits

# exponent bits, mantissa bits
FORMATS = {"float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7)}
WIDTH = {"float32": 32, "float16": 16, "bfloat16": 16}


def decode(bits: int, fmt: str) -> float:
    """The value a bit pattern stands for (exactly representable as a Python float)."""
    if fmt == "float32":
        return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])
    if fmt == "float16":
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])
    # bfloat16 is the top half of a float32
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _magnitude_position(x: float, fmt: str) -> int:
    """How many non-negative representable finite values lie below x (x >= 0, finite)."""
    ebits, mbits = FORMATS[fmt]
    emin = 2 - (1 << (ebits - 1))  # exponent of the smallest normal
    if x == 0:
        return 0
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    exponent = e - 1  # x = (2m) * 2**exponent, 1 <= 2m < 2
    if exponent < emin:  # subnormal: an integer number of the smallest subnormal
        steps = Fraction(x) / Fraction(2) ** (emin - mbits)
        assert steps.denominator == 1
        return int(steps)
    fraction = (Fraction(x) / Fraction(2) ** exponent - 1) * 2**mbits
    assert fraction.denominator == 1 and 0 <= fraction < 2**mbits
    # all subnormals (and zero) first, then 2**mbits values per binade
    return (exponent - emin + 1) * 2**mbits + int(fraction)


def _largest_finite(fmt: str) -> float:
    ebits, mbits = FORMATS[fmt]
    emax = (1 << (ebits - 1)) - 1
    return float((2 - Fraction(1, 2**mbits)) * Fraction(2) ** emax)


def ref_position(x: float, fmt: str) -> int:
    """Signed position of a non-NaN value on the float line; +0 and -0 are both 0."""
    magnitude = abs(x)
    if math.isinf(magnitude):
        pos = _magnitude_position(_largest_finite(fmt), fmt) + 1  # one past the largest finite
    else:
        pos = _magnitude_position(magnitude, fmt)
    return -pos if x < 0 else pos


def ref_compare(a_bits: int, b_bits: int, fmt: str) -> tuple[str, int]:
    """('both_nan' | 'nan_vs_number' | 'numbers', distance)."""
    a, b = decode(a_bits, fmt), decode(b_bits, fmt)
    if math.isnan(a) and math.isnan(b):
        return "both_nan", 0
    if math.isnan(a) or math.isnan(b):
        return "nan_vs_number", 0
    return "numbers", abs(ref_position(a, fmt) - ref_position(b, fmt))


def check_pairs(pairs: list[tuple[int, int]], fmt: str) -> None:
    dtype = np.uint32 if WIDTH[fmt] == 32 else np.uint16
    a = np.array([p[0] for p in pairs], dtype=dtype)
    b = np.array([p[1] for p in pairs], dtype=dtype)
    got = ulp_distance_bits(a, b, fmt)
    assert got.distance.dtype == np.int64
    for i, (x, y) in enumerate(pairs):
        kind, dist = ref_compare(x, y, fmt)
        where = f"{fmt} {x:#x} vs {y:#x}"
        assert bool(got.both_nan[i]) == (kind == "both_nan"), where
        assert bool(got.nan_vs_number[i]) == (kind == "nan_vs_number"), where
        assert bool(got.bits_equal[i]) == (x == y), where
        assert int(got.distance[i]) == dist, where


# ------------------------------------------------------------------ strategies

EDGES = {
    "float32": [0x0, 0x80000000, 0x1, 0x80000001, 0x2, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000,
                0x3F800000, 0xBF800000, 0x3F800001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00001],
    "float16": [0x0, 0x8000, 0x1, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
                0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0xFFFF],
    "bfloat16": [0x0, 0x8000, 0x1, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F,
                 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF],
}


def bit_patterns(fmt: str) -> st.SearchStrategy[int]:
    top = (1 << WIDTH[fmt]) - 1
    near_edges = st.tuples(st.sampled_from(EDGES[fmt]), st.integers(-3, 3)).map(lambda t: (t[0] + t[1]) & top)
    strategies = [st.integers(0, top), st.sampled_from(EDGES[fmt]), near_edges]
    if fmt in ("float32", "float16"):
        width = WIDTH[fmt]
        as_bits = lambda f: int(float_bits(np.array([f]), fmt)[0])  # noqa: E731
        strategies.append(st.floats(width=width, allow_nan=True, allow_infinity=True).map(as_bits))
    return st.one_of(strategies)


def pairs_of(fmt: str) -> st.SearchStrategy[list[tuple[int, int]]]:
    bits = bit_patterns(fmt)
    top = (1 << WIDTH[fmt]) - 1
    close = st.tuples(bits, st.integers(-70000, 70000)).map(lambda t: (t[0], (t[0] + t[1]) & top))
    return st.lists(st.one_of(st.tuples(bits, bits), close), min_size=1, max_size=40)


# ------------------------------------------------------------------ property tests


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_edge_pairs_all_against_reference(fmt):
    edges = EDGES[fmt]
    check_pairs([(x, y) for x in edges for y in edges], fmt)


@settings(max_examples=200, deadline=None)
@given(pairs=pairs_of("float32"))
def test_float32_matches_value_reference(pairs):
    check_pairs(pairs, "float32")


@settings(max_examples=120, deadline=None)
@given(pairs=pairs_of("float16"))
def test_float16_matches_value_reference(pairs):
    check_pairs(pairs, "float16")


@settings(max_examples=120, deadline=None)
@given(pairs=pairs_of("bfloat16"))
def test_bfloat16_matches_value_reference(pairs):
    check_pairs(pairs, "bfloat16")


@settings(max_examples=200, deadline=None)
@given(a=bit_patterns("float32"), b=bit_patterns("float32"))
def test_symmetric_and_signed_int_input(a, b):
    ua, ub = np.array([a], np.uint32), np.array([b], np.uint32)
    ab, ba = ulp_distance_bits(ua, ub), ulp_distance_bits(ub, ua)
    assert ab.distance[0] == ba.distance[0]
    # the same patterns given as int32 (as a torch int32 view would give them) mean the same
    signed = ulp_distance_bits(ua.view(np.int32), ub.view(np.int32))
    assert signed.distance[0] == ab.distance[0] and signed.bits_equal[0] == ab.bits_equal[0]


@settings(max_examples=200, deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_float32_neighbours_are_one_apart(x):
    x32 = np.float32(x)
    with np.errstate(over="ignore"):  # the largest finite's neighbour is inf, one step away
        up, down = np.nextafter(x32, np.float32(np.inf)), np.nextafter(x32, np.float32(-np.inf))
    for other in (up, down):
        r = ulp_distance(np.array([x32]), np.array([other]))
        # nextafter from -0 / +0 reaches the smallest subnormal; ±0 count as one point
        assert int(r.distance[0]) == 1


@settings(max_examples=100, deadline=None)
@given(x=st.floats(width=16, allow_nan=False, allow_infinity=False))
def test_float16_neighbours_are_one_apart(x):
    x16 = np.float16(x)
    with np.errstate(over="ignore"):
        up = np.nextafter(x16, np.float16(np.inf))
    assert int(ulp_distance(np.array([x16]), np.array([up]), "float16").distance[0]) == 1


# ------------------------------------------------------------------ exhaustive 16-bit check


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_16bit_exhaustive_rank_reference(fmt):
    """Every 16-bit pattern: its distance to -inf equals its rank among all distinct values sorted
    by value (±0 one value), and NaN patterns are exactly the NaN values."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    if fmt == "float16":
        values = bits.astype(np.uint16).view(np.float16).astype(np.float64)
    else:
        with np.errstate(invalid="ignore"):  # signalling NaNs
            values = (bits << 16).view(np.float32).astype(np.float64)
    nan = np.isnan(values)
    ranks = np.searchsorted(np.unique(values[~nan]), values[~nan])  # unique() merges -0.0 and 0.0
    neg_inf = 0xFC00 if fmt == "float16" else 0xFF80
    got = ulp_distance_bits(bits.astype(np.uint16), np.full(1 << 16, neg_inf, np.uint16), fmt)
    assert np.array_equal(is_nan_bits(bits.astype(np.uint16), fmt), nan)
    assert np.array_equal(got.nan_vs_number, nan)
    assert not got.both_nan.any()
    assert np.array_equal(got.distance[~nan], ranks)
    assert np.array_equal(got.distance[nan], np.zeros(int(nan.sum()), np.int64))


# ------------------------------------------------------------------ explicit cases


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32)


def test_signed_zeros_are_equal_but_not_bitwise_equal():
    r = ulp_distance_bits(f32(0x00000000), f32(0x80000000))
    assert r.distance[0] == 0 and not r.bits_equal[0] and not r.nan_vs_number[0] and not r.both_nan[0]


def test_across_zero_counts_every_float_between():
    # -min_subnormal .. +min_subnormal: -tiny, 0, +tiny -> 2 steps
    assert ulp_distance_bits(f32(0x80000001), f32(0x00000001)).distance[0] == 2
    # -1.0 .. +1.0: twice the count of floats in [0, 1)
    assert ulp_distance_bits(f32(0xBF800000), f32(0x3F800000)).distance[0] == 2 * 0x3F800000
    # -inf .. +inf is the whole line and needs 64-bit arithmetic
    assert ulp_distance_bits(f32(0xFF800000), f32(0x7F800000)).distance[0] == 2 * 0x7F800000 == 4278190080


def test_infinity_is_one_past_the_largest_finite():
    assert ulp_distance_bits(f32(0x7F7FFFFF), f32(0x7F800000)).distance[0] == 1
    assert ulp_distance_bits(f32(0xFF7FFFFF), f32(0xFF800000)).distance[0] == 1
    r = ulp_distance_bits(f32(0x7F800000), f32(0x7F800000))
    assert r.distance[0] == 0 and r.bits_equal[0]


def test_subnormal_normal_boundary():
    assert ulp_distance_bits(f32(0x007FFFFF), f32(0x00800000)).distance[0] == 1
    assert ulp_distance_bits(f32(0x00000000), f32(0x00800000)).distance[0] == 0x00800000


def test_nan_categories():
    quiet, payload, neg_nan, signalling = 0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001
    r = ulp_distance_bits(f32(quiet, quiet, payload, signalling, quiet, 0x3F800000, quiet),
                          f32(quiet, payload, neg_nan, signalling, 0x3F800000, quiet, 0x7F800000))
    assert r.both_nan.tolist() == [True, True, True, True, False, False, False]
    assert r.nan_vs_number.tolist() == [False, False, False, False, True, True, True]
    assert r.bits_equal.tolist() == [True, False, False, True, False, False, False]
    assert r.distance.tolist() == [0] * 7  # NaN never gets a distance


def test_value_api_and_format_checks():
    a = np.array([1.0, -0.0, np.nan], np.float32)
    b = np.array([np.nextafter(np.float32(1), np.float32(2)), 0.0, np.nan], np.float32)
    r = ulp_distance(a, b)
    assert r.distance.tolist() == [1, 0, 0] and r.both_nan.tolist() == [False, False, True]
    with pytest.raises(TypeError):
        ulp_distance(np.array([1.0], np.float32), np.array([1.0], np.float32), "bfloat16")
    with pytest.raises(ValueError, match="unknown float format"):
        float_bits(np.array([1.0], np.float32), "float8")
    # bfloat16 1.0 (0x3F80) and its neighbour
    assert ulp_distance(np.array([0x3F80], np.uint16), np.array([0x3F81], np.uint16), "bfloat16").distance[0] == 1


def test_ordered_is_monotone_in_value_for_float32_samples():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    keep = ~np.isnan(values)
    bits, values = bits[keep], values[keep].astype(np.float64)
    order = np.argsort(values, kind="stable")
    pos = ordered(bits)[order]
    assert (np.diff(pos) >= 0).all()
    assert ((np.diff(pos) == 0) == (np.diff(values[order]) == 0)).all()
