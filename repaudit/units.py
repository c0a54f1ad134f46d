"""How a rate, a ratio or a duration reads as text, for every stage that prints one: a small
non-zero value never reads as zero."""

from __future__ import annotations


def rate_text(x: float | None) -> str:
    """Tokens/s: whole numbers from 10 up, two significant digits below, so that a slow cell (a large
    model on CPU, 0.4 tok/s) never reads as 0 tok/s."""
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def ratio_text(x: float | None) -> str:
    """A speed ratio: two decimals from 0.1 up, two significant digits below (0.0042x, not 0.00x)."""
    if x is None:
        return "—"
    return f"{x:.2f}x" if abs(x) >= 0.1 else f"{x:.2g}x"


def seconds_text(x: float, decimals: int = 1) -> str:
    """Seconds with `decimals` decimals, and two significant digits below 0.1 s: a cell of 0.03 s
    does not read as 0.0 s."""
    return f"{x:.2g}" if 0 < abs(x) < 0.1 else f"{x:.{decimals}f}"
