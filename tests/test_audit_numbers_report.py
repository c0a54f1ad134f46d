"""Audit: numbers the run summary and `repaudit report` print, against what they stand for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("tok_s, text", [(0.4, "0.4"), (0.004, "0.004"), (3.25, "3.2"), (12_345.6, "12,346")])
def test_a_slow_cells_tokens_per_s_never_reads_as_zero(tok_s, text):
    """Tokens/s printed as whole numbers made a 0.4 tok/s cell (a large model on CPU) read "0" in
    summary.md, the terminal table and the report's speed table."""
    from repaudit.compare.summary import summary_markdown, table_rows
    from repaudit.report.tables import timing_rows
    from repaudit.units import rate_text

    row = {"cell": "r", "reference": "r", "status": "done", "tokens_per_s": tok_s}
    summary = {"baseline": "r", "reference_per": ["kernels"], "cells": [row], "identical_cells": 0,
               "compared_cells": 0, "price": []}
    assert table_rows(summary)[0][-1] == text
    assert f"| {text} |" in summary_markdown(summary)
    timing = {"prefill_tokens_per_s": tok_s, "decode_tokens_per_s": tok_s, "generated_tokens_per_s": tok_s}
    cells = [SimpleNamespace(id="c", status="done", seconds=1.0, timing=timing, group="g")]
    shown = timing_rows(SimpleNamespace(cells=cells))[0]
    assert [rate_text(shown[k]) for k in ("prefill tok/s", "decode tok/s", "generated tok/s")] == [text] * 3


def test_token_counts_show_only_where_the_engine_timed_that_phase():
    """A vLLM generate cell times prefill and decode as one (mixed_s) and so holds prefill_tokens = 0
    and decode_tokens = 0: the report's speed table said it prefilled 0 tokens and decoded 0, and had
    no column for the tokens it did generate."""
    from repaudit.engines.base import Timing
    from repaudit.report.tables import timing_rows

    timings = {"vllm-generate": Timing(mixed_s=4.0, generated_tokens=32), "hf-score": Timing(prefill_s=1.0, prefill_tokens=90),
               "hf-generate": Timing(prefill_s=1.0, prefill_tokens=40, decode_s=1e-5, decode_tokens=0, generated_tokens=4)}
    cells = [SimpleNamespace(id=k, status="done", seconds=5.0, timing=t.as_dict(), group="g") for k, t in timings.items()]
    rows = {r["cell"]: r for r in timing_rows(SimpleNamespace(cells=cells))}
    counts = lambda r: (r["prefill tokens"], r["decode tokens"], r["generated tokens"])  # noqa: E731
    assert counts(rows["vllm-generate"]) == (None, None, 32)
    assert counts(rows["hf-score"]) == (90, None, None)
    assert counts(rows["hf-generate"]) == (40, 0, 4)  # a decode loop that ran no step: truly 0 decoded


@pytest.mark.parametrize("ratio, text", [(0.0042, "0.0042x"), (0.05, "0.05x"), (0.62, "0.62x"), (1.234, "1.23x")])
def test_a_small_speed_ratio_never_reads_as_zero(ratio, text):
    """Ratios printed with two decimals made a mode at 0.004x of stock's tokens/s read "0.00x" in the
    run summary's price line and the report's tiles."""
    from repaudit.compare.summary import price_line
    from repaudit.units import ratio_text

    assert ratio_text(ratio) == text
    p = {"kernels": "tbik", "identical": 1, "compared": 2, "speed_vs_stock": ratio, "speed_pairs": 3}
    assert price_line(p).endswith(f", at {text} stock's tokens/s (3 cells)")
    cold = {"scenario": "prefix-hit", "kernels": "stock", "identical": 1, "compared": 1, "speed_vs_cold": ratio,
            "speed_pairs": 1}
    assert f", at {text} cold's tokens/s" in price_line(cold)


@pytest.mark.parametrize("timing, text", [({"generated_tokens_per_s": 0.4, "prefill_tokens_per_s": 9.0}, "0.4 tok/s"),
                                          ({"prefill_tokens_per_s": 0.03}, "0.03 tok/s"),
                                          ({"prefill_tokens_per_s": 1234.5}, "1,234 tok/s")])
def test_the_runners_done_line_prints_a_slow_rate(timing, text):
    """The runner's `done <cell> ... tok/s` line printed rates as whole numbers: 0.4 tok/s read 0."""
    from repaudit.run.events import done_line

    assert done_line("c", {"seconds": 2.0, "timing": timing}) == f"[green]done[/] c  2.0s  {text}"
    assert done_line("c", {"seconds": 2.0, "timing": {}}) == "[green]done[/] c  2.0s"


@pytest.mark.parametrize("seconds, one, two", [(0.03, "0.03", "0.03"), (0.004, "0.004", "0.004"), (0.0, "0.0", "0.00"),
                                               (2.345, "2.3", "2.35"), (0.25, "0.2", "0.25")])
def test_a_short_duration_never_reads_as_zero(seconds, one, two):
    """Seconds printed with fixed decimals made a 0.03 s cell read "0.0s" in the runner's done line and
    "0.00" in the report's speed table."""
    from repaudit.report.tables import secs
    from repaudit.run.events import done_line
    from repaudit.units import seconds_text

    assert seconds_text(seconds) == one and seconds_text(seconds, 2) == two and secs(seconds) == two
    assert done_line("c", {"seconds": seconds, "timing": {}}) == f"[green]done[/] c  {one}s"
