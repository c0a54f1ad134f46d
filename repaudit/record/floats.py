"""ULP distance between IEEE floats, computed on bit patterns.

Floats map to an ordered integer line: non-negative values keep their bits, negative values
map to minus their magnitude bits. +0 and -0 both map to 0, so they are equal; neighbouring
floats differ by one; the distance across zero counts every float in between. NaN is never
given a distance: callers get masks for "both NaN" and "NaN against a number" instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (bit width, exponent mask, mantissa mask) for the formats we record or compare.
_FORMATS = {
    "float32": (32, 0x7F800000, 0x007FFFFF),
    "bfloat16": (16, 0x7F80, 0x007F),
    "float16": (16, 0x7C00, 0x03FF),
}


@dataclass(frozen=True)
class UlpResult:
    distance: np.ndarray  # int64; 0 where either side is NaN (see the masks)
    both_nan: np.ndarray  # bool
    nan_vs_number: np.ndarray  # bool: exactly one side is NaN
    bits_equal: np.ndarray  # bool: identical bit patterns


def _unsigned(bits: np.ndarray, width: int) -> np.ndarray:
    return bits.astype(np.uint32 if width == 32 else np.uint16, copy=False)


def is_nan_bits(bits: np.ndarray, fmt: str = "float32") -> np.ndarray:
    width, exp_mask, man_mask = _FORMATS[fmt]
    u = _unsigned(bits, width)
    return ((u & exp_mask) == exp_mask) & ((u & man_mask) != 0)


def ordered(bits: np.ndarray, fmt: str = "float32") -> np.ndarray:
    """Map bit patterns to int64 positions on the ordered float line (NaNs get garbage)."""
    width = _FORMATS[fmt][0]
    u = _unsigned(bits, width).astype(np.int64)
    sign = np.int64(1 << (width - 1))
    magnitude = u & (sign - 1)
    return np.where(u & sign, -magnitude, magnitude)


def ulp_distance_bits(a_bits: np.ndarray, b_bits: np.ndarray, fmt: str = "float32") -> UlpResult:
    """ULP distance between two arrays of bit patterns of the same format."""
    width = _FORMATS[fmt][0]
    a_u, b_u = _unsigned(a_bits, width), _unsigned(b_bits, width)
    a_nan, b_nan = is_nan_bits(a_u, fmt), is_nan_bits(b_u, fmt)
    any_nan = a_nan | b_nan
    dist = np.abs(ordered(a_u, fmt) - ordered(b_u, fmt))
    dist[any_nan] = 0
    return UlpResult(dist, a_nan & b_nan, a_nan ^ b_nan, a_u == b_u)


def float_bits(values: np.ndarray, fmt: str = "float32") -> np.ndarray:
    """Bit patterns of float32 / float16 arrays, or of bfloat16 given as uint16 (numpy has no bf16)."""
    if fmt == "float32":
        return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if fmt == "float16":
        return np.ascontiguousarray(values, dtype=np.float16).view(np.uint16)
    if fmt == "bfloat16":
        if values.dtype != np.uint16:
            raise TypeError("pass bfloat16 values as their uint16 bit patterns")
        return values
    raise ValueError(f"unknown float format {fmt!r}; expected one of {sorted(_FORMATS)}")


def ulp_distance(a: np.ndarray, b: np.ndarray, fmt: str = "float32") -> UlpResult:
    return ulp_distance_bits(float_bits(a, fmt), float_bits(b, fmt), fmt)
