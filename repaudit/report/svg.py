"""Plots as inline SVG strings: a heatmap, a log-binned histogram, a strip plot, a bar.

No JavaScript and no external resources: each function returns one <svg> element that a
browser draws as it is. Hover text is SVG <title>. Every text is escaped here.
"""

from __future__ import annotations

import math
from fractions import Fraction
from html import escape
from typing import Callable, Sequence

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
EQUAL = "#1a9850"  # every row bitwise equal: the only green
NA = "#e5e7eb"
INK = "#1f2937"
MUTED = "#6b7280"

_RATE_STOPS = ((0.0, "#a50026"), (0.5, "#f46d43"), (0.9, "#fdae61"), (1.0, "#fee08b"))
_ULP_STOPS = ((0.0, "#fee08b"), (0.5, "#f46d43"), (1.0, "#a50026"))


def _hex(c: str) -> tuple[int, int, int]:
    return int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)


def _lerp(stops: Sequence[tuple[float, str]], t: float) -> str:
    t = min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            rgb = [round(a + (b - a) * f) for a, b in zip(_hex(c0), _hex(c1))]
            return "#" + "".join(f"{x:02x}" for x in rgb)
    return stops[-1][1]


def rate_colour(num: int, den: int, identical: bool | None = None) -> str:
    """Green only when num == den; below that, yellow (almost all) to dark red (none). identical=False:
    every compared logprob agrees, yet the pair is not identical (its tokens fork, or its row digests
    or top-k differ): yellow, the top of the scale, never green."""
    if den == 0:
        return NA
    if num == den:
        return EQUAL if identical is not False else _RATE_STOPS[-1][1]
    return _lerp(_RATE_STOPS, float(Fraction(num, den)))


def ulp_colour(ulp: int, worst: int) -> str:
    if ulp == 0:
        return EQUAL
    top = max(2, worst)
    return _lerp(_ULP_STOPS, math.log2(ulp) / math.log2(top) if ulp > 1 else 0.0)


def text_colour(fill: str) -> str:
    r, g, b = _hex(fill)
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else INK


def _svg(width: float, height: float, body: str, label: str, cls: str = "plot") -> str:
    return (f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}" '
            f'font-family="{escape(FONT)}" font-size="11">{body}</svg>')


def _text(x: float, y: float, s: str, anchor: str = "start", size: float | None = None, fill: str = INK,
          weight: str | None = None, extra: str = "") -> str:
    attrs = f' font-size="{size}"' if size else ""
    attrs += f' font-weight="{weight}"' if weight else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}"{attrs}{extra}>{escape(s)}</text>'


def _char_w(size: float) -> float:
    return size * 0.62  # monospace advance, roughly


# ------------------------------------------------------------------------------ heatmap


Cell = tuple[str, str, str]  # fill, text in the square, hover text


def heatmap(labels: Sequence[str], cell: Callable[[int, int], Cell | None], title: str, marked: set[int] = frozenset(),
            legend: str = "") -> str:
    """A square matrix; cell(i, j) gives (fill, text, hover) or None for the diagonal. Labels of
    `marked` rows and columns (the reference cells) are bold with a star."""
    n = len(labels)
    size = max(26, min(64, int(1000 / max(1, n))))
    font = 11 if size >= 50 else 9.5 if size >= 36 else 0  # no text in small squares: hover has it
    names = [("★ " if i in marked else "") + s for i, s in enumerate(labels)]
    left = 14 + _char_w(11) * max(len(s) for s in names)
    top = 30 + _char_w(11) * max(len(s) for s in names) * 0.72
    width, height = max(left + n * size + 16, left + _char_w(10.5) * len(legend) + 8), top + n * size + 44
    parts = [_text(0, 14, title, size=12.5, weight="600")]
    for i, name in enumerate(names):
        w = "700" if i in marked else None
        y = top + i * size + size / 2 + 4
        parts.append(_text(left - 8, y, name, "end", weight=w))
        x = left + i * size + size / 2
        parts.append(_text(0, 0, name, "start", weight=w, extra=f' transform="translate({x + 3:.1f},{top - 6:.1f}) rotate(-45)"'))
    for i in range(n):
        for j in range(n):
            x, y = left + j * size, top + i * size
            c = cell(i, j)
            if c is None:
                parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{size - 2}" height="{size - 2}" fill="#f3f4f6"/>')
                continue
            fill, txt, hover = c
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{size - 2}" height="{size - 2}" fill="{fill}" rx="2">'
                         f'<title>{escape(hover)}</title></rect>')
            if font and txt and _char_w(font) * len(txt) <= size - 4:
                parts.append(_text(x + (size - 2) / 2, y + (size - 2) / 2 + font * 0.36, txt, "middle", size=font,
                                   fill=text_colour(fill), extra=' pointer-events="none"'))
    if legend:
        parts.append(_text(left, top + n * size + 20, legend, size=10.5, fill=MUTED))
    return _svg(width, height, "".join(parts), title, "plot heatmap")


# ------------------------------------------------------------------------------ histogram


def histogram(counts: Sequence[int], labels: Sequence[str], title: str, subtitle: str, y_max: int,
              colours: Sequence[str], width: float = 300, height: float = 190, unit: str = "ULP",
              markers: Sequence[tuple[float, str]] = ()) -> str:
    """Bars on a log10 count axis (0 draws no bar); exact counts on hover and above the bars that fit.
    markers: (position in bars from the left edge, label) drawn as dashed vertical lines."""
    n = len(counts)
    left, right, top, bottom = 40, 8, 40, 40
    pw, ph = width - left - right, height - top - bottom
    bw = pw / max(1, n)
    decades = max(1, math.ceil(math.log10(max(10, y_max)) + 1e-9))
    parts = [_text(0, 13, title, size=12, weight="600"), _text(0, 28, subtitle, size=10.5, fill=MUTED)]
    for d in range(decades + 1):
        y = top + ph - ph * d / decades
        parts.append(f'<line x1="{left}" x2="{left + pw:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(_text(left - 4, y + 3.5, "1" if d == 0 else f"1e{d}", "end", size=9, fill=MUTED))
    for i, (c, lab) in enumerate(zip(counts, labels)):
        x = left + i * bw
        if c > 0:
            h = max(2.0, ph * math.log10(c) / decades) if c > 1 else 2.0
            parts.append(f'<rect x="{x + 1.5:.1f}" y="{top + ph - h:.1f}" width="{max(1.0, bw - 3):.1f}" height="{h:.1f}" '
                         f'fill="{colours[i]}"><title>{escape(f"{lab} {unit}: {c} rows")}</title></rect>')
            s = str(c)
            if _char_w(8.5) * len(s) <= bw + 2:
                parts.append(_text(x + bw / 2, top + ph - h - 3, s, "middle", size=8.5, fill=INK))
        if n <= 12 or i % 2 == 0:
            parts.append(_text(0, 0, lab, "end", size=9, fill=MUTED,
                               extra=f' transform="translate({x + bw / 2 + 3:.1f},{top + ph + 10:.1f}) rotate(-35)"'))
    parts.append(f'<line x1="{left}" x2="{left + pw:.1f}" y1="{top + ph:.1f}" y2="{top + ph:.1f}" stroke="{MUTED}"/>')
    for at, lab in markers:
        x = left + at * bw
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{top + ph:.1f}" stroke="#b91c1c" '
                     f'stroke-dasharray="4 3"><title>{escape(lab)}</title></line>')
        parts.append(_text(x + 3, top + 8, lab, size=9, fill="#b91c1c"))
    return _svg(width, height, "".join(parts), title, "plot histogram")


# ------------------------------------------------------------------------------ strip plot


def nice_ticks(hi: int, target: int = 8) -> list[int]:
    if hi <= 0:
        return [0]
    raw = hi / target
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    step = max(1, int(step))
    return list(range(0, hi + 1, step))


Point = tuple[int, str, str]  # position, kind ("token" | "logprob"), hover text


def strip(rows: Sequence[tuple[str, Sequence[Point], str]], max_pos: int, title: str, width: float = 960) -> str:
    """One row per label; a mark per prompt at its first divergence position. Circles: first
    logprob difference; red diamonds: first token difference (the sequences fork)."""
    label_w = 12 + _char_w(11) * max((len(r[0]) for r in rows), default=4)
    note_w = 12 + _char_w(10.5) * max((len(r[2]) for r in rows), default=4)
    left, right, top, row_h = label_w, note_w, 44, 24
    pw = max(200.0, width - left - right)
    height = top + row_h * len(rows) + 34
    hi = max(1, max_pos)
    sx = lambda p: left + pw * p / hi  # noqa: E731
    parts = [_text(0, 14, title, size=12.5, weight="600"),
             f'<circle cx="{left + 4}" cy="30" r="4" fill="#f59e0b" fill-opacity="0.55" stroke="#b45309"/>',
             _text(left + 12, 33.5, "first logprob bits differ", size=10.5, fill=MUTED),
             f'<path d="M{left + 194},25 l5,5 l-5,5 l-5,-5 z" fill="#dc2626" fill-opacity="0.8" stroke="#7f1d1d"/>',
             _text(left + 204, 33.5, "first token differs (sequences fork)", size=10.5, fill=MUTED)]
    axis_y = top + row_h * len(rows) + 4
    for t in nice_ticks(hi):
        x = sx(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{axis_y:.1f}" stroke="#eef0f3"/>')
        parts.append(_text(x, axis_y + 14, str(t), "middle", size=9.5, fill=MUTED))
    parts.append(_text(left + pw / 2, axis_y + 28, "position in the sequence (prompt + completion)", "middle", size=10, fill=MUTED))
    for i, (label, points, note) in enumerate(rows):
        cy = top + i * row_h + row_h / 2
        if i % 2 == 0:
            parts.append(f'<rect x="0" y="{cy - row_h / 2:.1f}" width="{left + pw + right:.1f}" height="{row_h}" fill="#f9fafb"/>')
        parts.append(_text(left - 8, cy + 4, label, "end"))
        parts.append(f'<line x1="{left}" x2="{left + pw:.1f}" y1="{cy:.1f}" y2="{cy:.1f}" stroke="#d1d5db"/>')
        for pos, kind, hover in points:
            x = sx(pos)
            tip = f"<title>{escape(hover)}</title>"
            if kind == "token":
                parts.append(f'<path d="M{x:.1f},{cy - 6:.1f} l6,6 l-6,6 l-6,-6 z" fill="#dc2626" fill-opacity="0.8" stroke="#7f1d1d">{tip}</path>')
            else:
                parts.append(f'<circle cx="{x:.1f}" cy="{cy:.1f}" r="4.5" fill="#f59e0b" fill-opacity="0.55" stroke="#b45309">{tip}</circle>')
        parts.append(_text(left + pw + 10, cy + 4, note, size=10.5, fill=MUTED))
    parts.append(f'<line x1="{left}" x2="{left + pw:.1f}" y1="{axis_y:.1f}" y2="{axis_y:.1f}" stroke="{MUTED}"/>')
    return _svg(left + pw + right, height, "".join(parts), title, "plot strip")


# ------------------------------------------------------------------------------ bar


def bar(value: float, top: float, hover: str, width: float = 140, height: float = 12, colour: str = "#3b82f6") -> str:
    w = 0.0 if top <= 0 else max(1.0, width * value / top)
    body = (f'<rect x="0" y="0" width="{width}" height="{height}" fill="#eef2f7" rx="2"/>'
            f'<rect x="0" y="0" width="{w:.1f}" height="{height}" fill="{colour}" rx="2"><title>{escape(hover)}</title></rect>')
    return _svg(width, height, body, hover, "plot bar")
