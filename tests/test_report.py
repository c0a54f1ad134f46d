"""The report's pieces on synthetic records: ULP histogram and first divergences against the diff,
exact rates, escaping, SVG well-formedness, the run report on a run with failed cells, and
`repaudit report` / `repaudit diff --html` through the CLI. (The real run, Chromium and the
screenshot are in test_report_e2e.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

from repaudit import cli
from repaudit.diff import Thresholds, diff_records
from repaudit.compare.gate import load_run
from repaudit.report import build_run, render_html, render_markdown
from repaudit.report.analysis import (RATIO_CENTER, bin_label, log_ratio_bin, log_ratio_histogram, log_ratio_labels,
                                      log_ratio_position, prompt_divergence, ulp_bin, ulp_histogram)
from repaudit.report.arrays import read_arrays
from repaudit.report.tokens import TokenText
from conftest import TEST_ENV
from test_gate import BASE, CELLS, REF, make_run, record


def _html_problems(html: str) -> list[str]:
    """Anything that would make the page load something or run something."""
    out = re.findall(r"<script|<iframe|<object|<embed|<img|<link(?![^>]*href=\"data:)", html, flags=re.I)
    out += [u for u in re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html) if not u.startswith(("#", "data:"))]
    out += [u for u in re.findall(r"url\(([^)]*)\)", html)]
    return out


# ------------------------------------------------------------------------------ numbers


def test_ulp_bins_are_exact_log2():
    d = np.array([0, 1, 2, 3, 4, 7, 8, 2**20 - 1, 2**20, 2**31, 2 * 0x7F800000, 2**33 - 1], dtype=np.int64)
    assert ulp_bin(d).tolist() == [0 if x == 0 else int(x).bit_length() for x in d.tolist()]
    assert [bin_label(k) for k in range(5)] == ["0", "1", "2–3", "4–7", "8–15"]
    assert bin_label(12) == "2^11–"


def _random_pair(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    prompts = [f"q{i}" for i in range(7)]
    ids, pos, tok, bits = [], [], [], []
    for p in prompts:
        n = int(rng.integers(3, 40))
        ids += [p] * n
        pos += list(range(n))
        tok += rng.integers(0, 50, n).tolist()
        bits += (0xC0000000 + rng.integers(0, 1 << 22, n)).tolist()
    a_bits = np.array(bits, np.uint32)
    b_bits = a_bits.copy()
    b_tok = np.array(tok)
    n = len(ids)
    flip = rng.random(n) < 0.4
    b_bits[flip] += rng.integers(1, 1 << rng.integers(1, 24), flip.sum()).astype(np.uint32)
    specials = rng.choice(n, 6, replace=False)
    a_bits[specials[:2]] = 0x7FC00001  # NaN vs number
    a_bits[specials[2]], b_bits[specials[2]] = 0x7FC00001, 0x7FC00002  # NaN payloads
    a_bits[specials[3]], b_bits[specials[3]] = 0x00000000, 0x80000000  # +0 / -0: 0 ULP, not bitwise equal
    starts = [i for i in range(n) if i == 0 or ids[i] != ids[i - 1]]
    fork = starts[2] + 2  # prompt q2 forks at pos 2
    b_tok[fork] += 1
    common = dict(cell={"id": "x"}, probes={"name": "u", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"},
                  env={}, prompt_id=ids, pos=np.array(pos))
    from repaudit.records import write_record

    a, b = tmp_path / f"a{seed}.parquet", tmp_path / f"b{seed}.parquet"
    write_record(a, token_id=np.array(tok), logprob=a_bits.view(np.float32), **common)
    keep = np.ones(n, bool)
    keep[starts[4] + 1 :][:3] = False  # a hole / shorter sequence in q4 (within its rows or the next prompt's start)
    write_record(b, token_id=b_tok[keep], logprob=b_bits[keep].view(np.float32),
                 **{**common, "prompt_id": [x for x, k in zip(ids, keep) if k], "pos": np.array(pos)[keep]})
    return a, b


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_histogram_agrees_with_the_diff(tmp_path, seed):
    a, b = _random_pair(tmp_path, seed)
    r = diff_records(a, b, allow_partial=True)
    h = ulp_histogram(r, read_arrays(a), read_arrays(b))
    assert h.nan_vs_number == r.nan_vs_number and h.nan_payload_differs == r.nan_payload_differs
    assert h.total == r.comparable - r.nan_vs_number - r.nan_payload_differs  # every numeric compared row, once
    assert h.max_bin == int(ulp_bin(np.array([r.ulp_max]))[0])
    # 0-ULP rows: the bitwise-equal rows (equal NaNs included) plus the +0/-0 pair when it is compared
    assert 0 <= int(h.counts[0]) - r.bitwise_equal <= 1
    cum = np.cumsum(h.counts)
    p50_bin = int(np.searchsorted(cum, max(1, -(-h.total // 2))))
    assert p50_bin == int(ulp_bin(np.array([r.ulp_p50]))[0])


@pytest.mark.parametrize("seed", [1, 2])
def test_log_ratio_histogram_agrees_with_the_diff(tmp_path, seed):
    a, b = _random_pair(tmp_path, seed)
    r = diff_records(a, b, allow_partial=True)
    h = log_ratio_histogram(r, read_arrays(a), read_arrays(b))
    assert h.total == r.rl.positions and h.clip == r.rl.clip
    # d = 0 exactly: the bitwise-equal rows (none is NaN here) plus the +0/-0 pair when it is compared
    assert 0 <= int(h.counts[RATIO_CENTER]) - r.bitwise_equal <= 1
    # the outermost bars hold the smallest and the largest d, whose exps are the diff's ratio min and max
    lo, hi = np.flatnonzero(h.counts)[[0, -1]] - RATIO_CENTER
    assert lo < 0 <= hi and (log_ratio_bin(np.log([r.rl.ratio_min, r.rl.ratio_max])) - RATIO_CENTER).tolist() == [lo, hi]


def test_log_ratio_bins_are_signed_decades():
    d = np.array([0.0, -0.0, 1e-9, -1e-9, 1e-8, 9.99e-8, -0.5, 0.7, 1.0, 9.0, 10.0, -1e30])
    want = [0, 0, 1, -1, 2, 2, -9, 9, 10, 10, 11, -11]
    assert (log_ratio_bin(d) - RATIO_CENTER).tolist() == want
    labels = log_ratio_labels()
    assert len(labels) == 2 * RATIO_CENTER + 1 and labels[RATIO_CENTER] == "0" and labels[RATIO_CENTER + 1] == "+<1e-8"
    assert labels[0] == "−≥10" and labels[RATIO_CENTER + 10] == "+1e0"
    # log 2 = 0.69 lies in [0.1, 1): 84% of the way through that decade's bar; log 0.5 mirrors it
    assert log_ratio_position(np.log(2.0)) == pytest.approx(RATIO_CENTER + 9 + np.log10(np.log(2.0)) + 1)
    assert log_ratio_position(np.log(0.5)) == pytest.approx(2 * RATIO_CENTER + 1 - log_ratio_position(np.log(2.0)))
    assert log_ratio_position(0.0) == RATIO_CENTER + 0.5


def test_log_ratio_decades_are_those_of_the_printed_value():
    """Every decade edge is the double its decimal literal reads as: 9.999999999999999e-06 (the double
    just below 1e-05, and what 10.0 ** -5 gives) is in [1e-6, 1e-5), 1e-05 in [1e-5, 1e-4), on both
    sides of zero. That d comes out of two float32 logprobs: -1e-05 against +2.5262125e-13."""
    below = float(np.float32(2.5262125e-13)) - float(np.float32(-1e-05))
    assert repr(below) == "9.999999999999999e-06"
    for d, decade in ((below, 4), (1e-05, 5), (np.nextafter(1e-07, 0), 2), (1e-07, 3), (1e-06, 4)):
        assert (log_ratio_bin(np.array([d, -d])) - RATIO_CENTER).tolist() == [decade, -decade], d
    assert log_ratio_labels()[RATIO_CENTER + 4] == "+1e-6" and log_ratio_labels()[RATIO_CENTER + 5] == "+1e-5"


def test_first_divergence_in_context(tmp_path):
    a = record(tmp_path / "a.parquet", "a")
    b = record(tmp_path / "b.parquet", "b", tokens={("p1", 3): 90, ("p1", 4): 91}, bits={("p1", 3): BASE + 77, ("p0", 2): BASE + 2 + 5})
    r = diff_records(a, b)
    ra, rb = read_arrays(a), read_arrays(b)
    by = {p.prompt_id: p for p in r.prompts}
    d = prompt_divergence(by["p1"], ra, rb, TokenText(None))
    assert (d.pos, d.kind, d.phase) == (3, "token", "completion")
    assert d.context == "⟨65⟩⟨66⟩⟨67⟩" and not d.context_cut  # token ids when no tokenizer
    assert (d.a.token, d.b.token) == (68, 90) and d.a.after == "⟨69⟩" and d.b.after == "⟨91⟩"
    assert d.a.logprob == float(np.uint32(BASE + 3).view(np.float32)) and d.b.bits == BASE + 77
    assert d.ulp is None  # different tokens: no ULP distance
    d = prompt_divergence(by["p0"], ra, rb, TokenText(None))
    assert (d.pos, d.kind, d.ulp, d.a.token, d.b.token) == (2, "logprob", 5, 67, 67)
    assert prompt_divergence(by["p2"], ra, rb, TokenText(None)) is None


class _Tok:
    """A stand-in tokenizer: ids are code points."""

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def test_decoded_text_shows_control_characters(tmp_path):
    from repaudit.report.tables import divergence_cells

    a = record(tmp_path / "a.parquet", "a", tokens={("p0", 1): 10, ("p0", 2): 7})
    b = record(tmp_path / "b.parquet", "b", tokens={("p0", 1): 10, ("p0", 2): 7}, bits={("p0", 3): BASE + 4})
    r = diff_records(a, b)
    d = prompt_divergence(r.prompts[0], read_arrays(a), read_arrays(b), TokenText(_Tok()))
    c = divergence_cells(d)
    assert c["context"] == "A↵\\x07" and c["token A"] == "'D' #68"
    assert c["logprob A"] == repr(float(np.uint32(BASE + 3).view(np.float32))) and c["bits A"] == f"0x{BASE + 3:08x}"


# ------------------------------------------------------------------------------ pages


def test_svg_pieces_are_well_formed_xml():
    from repaudit.report import svg

    parts = [
        svg.heatmap(["a<b", "c&d", "e"], lambda i, j: None if i == j else (svg.rate_colour(i, 3), f"{i}{j}", "<hover>"), "t<", {0}, "legend"),
        svg.histogram([5, 0, 3, 1], ["0", "1", "2–3", "4–7"], "h&", "sub", 5, ["#000000"] * 4),
        svg.histogram([5, 0, 3], ["a", "b", "c"], "h", "sub", 5, ["#000000"] * 3, unit="d<", markers=[(0.5, "log <0.5")]),
        svg.strip([("row<", [(3, "token", "x<y"), (5, "logprob", "z")], "1/2")], 10, "s"),
        svg.bar(3.0, 10.0, "b<"),
    ]
    for p in parts:
        root = ET.fromstring(p)
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and float(root.get("width")) > 0 and float(root.get("height")) > 0
    assert svg.rate_colour(10**12 - 1, 10**12) != svg.EQUAL and svg.rate_colour(7, 7) == svg.EQUAL


@pytest.mark.parametrize("identical", [True, False])
def test_the_cell_matrix_is_green_only_for_an_identical_pair(identical):
    """docs/ci.md: green means every bit agrees. A generate pair whose tokens fork where its logits first
    move has every compared logprob equal (5/5, 0 ULP) and is not identical; it was drawn green."""
    from repaudit.report import svg
    from repaudit.report.analysis import MatrixEntry, MatrixView
    from repaudit.report.html import _matrix_svgs

    mv = MatrixView("generate", ["c0", "c1"], ["bs1", "bs4"], {"c0"}, {(0, 1): MatrixEntry(5, 5, 0, identical)})
    rates = _matrix_svgs(mv).split("</svg>")[0]  # the bitwise-equal map (the max-ULP map's green is 0 ULP)
    assert "100%" in rates and (svg.EQUAL in rates) == identical
    assert svg.ulp_colour(0, 10) == svg.EQUAL and svg.ulp_colour(1, 10) != svg.EQUAL
    assert svg.nice_ticks(77) == [0, 10, 20, 30, 40, 50, 60, 70] and svg.nice_ticks(0) == [0]


def test_the_max_ulp_legend_names_a_range_only_where_one_exists():
    """With every pair at 0 ULP the legend read "yellow → red = 1 … 0 ULP (log scale)"."""
    from repaudit.report.analysis import MatrixEntry, MatrixView
    from repaudit.report.html import _matrix_svgs

    same = MatrixView("score", ["c0", "c1"], ["bs1", "bs4"], {"c0"}, {(0, 1): MatrixEntry(5, 5, 0, True)})
    assert "green = 0 ULP: every pair" in _matrix_svgs(same) and "1 … 0 ULP" not in _matrix_svgs(same)
    apart = MatrixView("score", ["c0", "c1"], ["bs1", "bs4"], {"c0"}, {(0, 1): MatrixEntry(4, 5, 9, False)})
    assert "yellow → red = 1 … 9 ULP (log scale)" in _matrix_svgs(apart)


def test_run_report_with_failures_divergence_and_hostile_text(tmp_path, capsys):
    evil = "<script>alert('x')</script> | `tick` & <b>"
    run = make_run(tmp_path, {
        "hf-tp1-bs4-default-stock-score": {"bits": {("p1", 2): BASE + 2 + 3}, "env": {**TEST_ENV, "torch": "9.9.9", "vars": {"NCCL_ALGO": "Tree"}}},
        "hf-tp2-bs1-default-stock-score": {"status": "failed", "reason": evil},
        "hf-tp2-bs4-default-stock-score": {"tokens": {("p0", 1): 99}},
    })
    rc = cli.main(["report", str(run)])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "") and "DIVERGENT: 3 of 3 cell pairs fail the gate" in " ".join(out.split())
    html = (run / "report.html").read_text()
    md = (run / "report.md").read_text()
    assert "<script" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert _html_problems(html) == []
    # the first screen: a square per cell against (TP, batch, NCCL), green or red, the reference in grey
    grid = re.search(r'<table class="grid">.*?</table>', html, re.S).group(0)
    assert grid.count('<td class="fail"') == 3 and grid.count('<td class="pass"') == 0
    assert grid.count('<td class="ref">reference</td>') == 1 and "did not complete" in grid and "14/15" not in grid
    assert html.index('<table class="grid">') < html.index('<ul>')  # the grid, then the failure list
    assert "&lt;script&gt;alert('x')&lt;/script&gt; \\| \\`tick\\` &amp; &lt;b&gt;" in md  # a Markdown table cell
    # the numbers: exact counts and truncated rates
    assert "14/15 (93.33%)" in html and "14/15 (93.33%)" in md
    assert "token fork" in html and "logprob bits" in html
    # every compared pair has its RL numbers (3 ULP at -2.5: d = 3 * 2**-22), and a log-ratio histogram with the clip marks
    assert '<h2 id="rl">RL mismatch</h2>' in html and "## RL mismatch" in md
    d = 3 * 2.0**-22
    assert repr(d / 15) in html and repr(d / 15) in md.split("## RL mismatch")[1]  # k1 = mean(-d), d = lp_b - lp_a < 0
    assert html.count('aria-label="log-ratio d:') == 2 and "log 0.5" in html and "log 2.0" in html
    # the matrix holds the completed cells only, and both renderers show it
    data = build_run(load_run(run), Thresholds())
    (mv,) = data.matrices
    assert mv.ids == [c for c in CELLS if c != "hf-tp2-bs1-default-stock-score"] and mv.references == {REF}
    e = mv.entry(0, 1)
    assert (e.bitwise_equal, e.comparable, e.ulp_max) == (14, 15, 3) and mv.entry(1, 0) is e
    assert "## Cell × cell: score" in md
    # the environment: the differing fields, highlighted where they differ from the first cell
    assert re.search(r'<td class="hl">9\.9\.9</td>', html) and re.search(r'<td class="hl">Tree</td>', html)
    env_md = md.split("## Environment fingerprint")[1]
    assert "| cell | torch | env NCCL\\_ALGO |" in env_md and "| 9.9.9 | Tree |" in env_md
    assert "did not complete" in html and "did not complete" in md
    # the commands to reproduce
    assert "repaudit run --tp 1,2 --batch-size 1,4 --mode score --out" in html
    assert f"repaudit diff {run}/cells/{REF}.parquet {run}/cells/hf-tp2-bs4-default-stock-score.parquet" in html


def test_rates_never_round_up_to_100(tmp_path):
    from repaudit.report.build import build_pair
    from repaudit.compare.gate import gate_files

    prompts = tuple(f"p{i:04d}" for i in range(2000))  # 10,000 rows
    a = record(tmp_path / "a.parquet", "a", prompts=prompts)
    b = record(tmp_path / "b.parquet", "b", prompts=prompts, bits={("p1234", 4): BASE + 4 + 1})
    g = gate_files(a, b, Thresholds())
    data = build_pair(g.pairs[0], Thresholds(), g)
    html, md = render_html(data), render_markdown(data)
    for text in (html, md):
        assert "9999/10000 (99.99%)" in text and "10000/10000" not in text.split("bitwise-equal")[1][:200]
    assert "lowest bitwise-equal" in html and ">99.99%<" in html


def test_diff_html(tmp_path, capsys):
    a = record(tmp_path / "a.parquet", "cell-a")
    b = record(tmp_path / "b.parquet", "cell-b", tokens={("p2", 3): 70}, env={"torch": "2.0.1", "repaudit": "test"})
    out_html = tmp_path / "pair.html"
    rc = cli.main(["diff", str(a), str(b), "--html", str(out_html)])
    assert rc == 1
    html = out_html.read_text()
    assert "<h2 id=\"pairs\">B against A</h2>" in html and "token fork" in html and "cell × cell" not in html
    assert "DIVERGENT: 1 of 3 sequences differ in tokens or length" in html
    assert html.count("<svg") == 3 and _html_problems(html) == []  # ULP and log-ratio histograms, strip
    assert '<h2 id="rl">RL mismatch</h2>' in html and "13/13 at d = 0 (ratio exactly 1, 100%)" in html  # p2 forks at pos 3
    assert re.search(r'<td class="hl">2\.0\.1</td>', html)
    rc = cli.main(["diff", str(a), str(a), "--html", str(out_html)])
    capsys.readouterr()
    assert rc == 0 and "IDENTICAL" in out_html.read_text() and "No prompt differs" in out_html.read_text()


def test_reports_show_topk_and_columns_held_on_one_side(tmp_path, capsys):
    from repaudit.compare.gate import gate_files
    from repaudit.report.build import build_pair

    a = record(tmp_path / "a.parquet", "cell-a", topk={})
    b = record(tmp_path / "b.parquet", "cell-b", topk={("p0", 2): (BASE + 102) ^ 1}, digests=False)
    g = gate_files(a, b, Thresholds())
    html, md = render_html(build_pair(g.pairs[0], Thresholds(), g)), render_markdown(build_pair(g.pairs[0], Thresholds(), g))
    for text in (html, md):
        assert "15/15 (100%) / 93.33%" in text  # equal top-k ids / logprob bits
        assert "not compared (15 only in A)" in text  # row digests
    assert "1 of 15 positions differ in their top-k logprob bits" in html and "record B has no row digests" not in html
    run = make_run(tmp_path, {"hf-tp2-bs4-default-stock-score": {"topk": {("p1", 0): BASE}}}, topk=True)
    assert cli.main(["report", str(run)]) == 0
    capsys.readouterr()
    assert "15/15 (100%) / 93.33%" in (run / "report.md").read_text()  # one top-2 logprob moved, no id


def test_report_bad_input_exit_2(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("repaudit: error: ") and "no manifest.json" in err and err.count("\n") == 1


def test_report_with_thresholds_and_custom_paths(tmp_path, capsys):
    run = make_run(tmp_path, {"hf-tp1-bs4-default-stock-score": {"bits": {("p1", 2): BASE + 2 + 3}}})
    h, m = tmp_path / "x.html", tmp_path / "x.md"
    assert cli.main(["report", str(run), "--max-ulp", "3", "--html", str(h), "--markdown", str(m)]) == 0
    out = capsys.readouterr().out
    assert "WITHIN THRESHOLDS" in out and "max ULP 3" in h.read_text()
    assert "repaudit gate " + str(run) + " --junit junit.xml --max-ulp 3" in h.read_text()
    assert not (run / "report.html").exists()


def test_the_report_shows_each_kernel_modes_speed_against_stocks():
    """The price list's tiles (the run summary's numbers): tokens/s against the stock twin, with the
    cells the mode keeps identical; none for stock itself."""
    from types import SimpleNamespace

    from repaudit.report.headline import price_tiles

    def cell(kernels, bs, rate):
        settings = {"engine": "hf", "tp": 1, "batch_size": bs, "nccl": "default", "kernels": kernels, "mode": "score",
                    "id": f"{kernels}-{bs}", "model": "m"}
        return SimpleNamespace(id=f"{kernels}-{bs}", settings=settings, timing={"prefill_tokens_per_s": rate})

    cells = [cell("stock", 1, 200.0), cell("stock", 4, 800.0), cell("tbik", 1, 100.0), cell("tbik", 4, 200.0)]
    identical = SimpleNamespace(identical=True)
    pairs = [SimpleNamespace(cell="stock-4", result=SimpleNamespace(identical=False), failure=None),
             SimpleNamespace(cell="tbik-4", result=identical, failure=None)]
    (tile,) = price_tiles(SimpleNamespace(cells=cells, gate=SimpleNamespace(pairs=pairs)))
    assert (tile.label, tile.value, tile.tone) == ("tbik: speed vs stock", "0.35x", "pass")
    assert tile.detail == "tokens/s over 2 cells · keeps 1/1 identical"


def test_the_lowest_bitwise_equal_tile_skips_a_pair_with_no_comparable_row():
    """A pair whose every prompt forks at its first token has no rate (0/0): taken as the lowest,
    it showed n/a in green while another pair sat at 12/15."""
    from types import SimpleNamespace

    from repaudit.report.headline import tiles

    def pair(label, equal, comparable):
        result = SimpleNamespace(bitwise_equal=equal, comparable=comparable, ulp_max=1, prob_max=0.0, shared_prompts=[],
                                 identical=False)
        return SimpleNamespace(label=label, outcome="fail", result=result, divergences=[])

    data = SimpleNamespace(kind="diff", pairs=[pair("forked", 0, 0), pair("tp1 bs4", 12, 15), pair("tp2", 15, 15)])
    (tile,) = [t for t in tiles(data) if t.label == "lowest bitwise-equal"]
    assert tile.value == "80.00%" and "12/15" in tile.detail and "tp1 bs4" in tile.detail and tile.tone == "fail"


def test_the_lowest_bitwise_equal_tile_is_not_green_when_no_pair_has_a_comparable_row():
    """Every pair forks at its first token (0 of 0 logprobs compared): the tile read "n/a" in green
    beside a FAIL verdict, since 0 == 0. No rate is no pass."""
    from types import SimpleNamespace

    from repaudit.report.headline import tiles

    result = SimpleNamespace(bitwise_equal=0, comparable=0, ulp_max=0, prob_max=0.0, shared_prompts=[], identical=False)
    data = SimpleNamespace(kind="diff", pairs=[SimpleNamespace(label="tp2", outcome="fail", result=result, divergences=[])])
    (tile,) = [t for t in tiles(data) if t.label == "lowest bitwise-equal"]
    assert (tile.value, tile.tone) == ("n/a", "warn")


@pytest.mark.parametrize("identical, value, tone", [(True, "none", "pass"),
                                                     (False, "none in tokens or logprobs", "warn")])
def test_the_earliest_divergence_tile_is_not_green_for_a_pair_that_differs_elsewhere(identical, value, tone):
    """A pair whose tokens and logprob bits all agree but whose top-k or row digests differ fails
    the gate; the tile said "none" in green beside the FAIL verdict."""
    from types import SimpleNamespace

    from repaudit.report.headline import tiles

    result = SimpleNamespace(bitwise_equal=15, comparable=15, ulp_max=0, prob_max=0.0, shared_prompts=[],
                             identical=identical)
    data = SimpleNamespace(kind="diff", pairs=[SimpleNamespace(label="tp2", outcome="x", result=result, divergences=[])])
    (tile,) = [t for t in tiles(data) if t.label == "earliest divergence"]
    assert (tile.value, tile.tone) == (value, tone)


@pytest.mark.parametrize("cell, want", [
    ("vllm-tp1-bs8-default-stock-prefix-hit-generate", ("default", "stock", "prefix-hit", "generate")),
    ("vllm-tp2-bs32-my-preset-bi-chunked-prefill256-score", ("my-preset", "bi", "chunked-prefill256", "score")),
    ("hf-tp2-bs1-tree-tbik-score", ("tree", "tbik", None, "score")),
])
def test_the_verdict_grid_reads_scenario_cells(cell, want):
    """A scenario suffix was read into the NCCL preset and the kernel mode ("default-stock-prefix",
    "hit"), which put the cell in a row and column of its own under wrong labels."""
    from repaudit.report.html import _CELL_ID

    parts = _CELL_ID.match(cell).groupdict()
    assert (parts["nccl"], parts["kernels"], parts["scenario"], parts["mode"]) == want


def test_speed_rows_keep_decode_and_generated_rates_apart():
    """A transformers cell times its decode steps apart from its prefill; a vLLM cell, whose
    scheduler interleaves them, does not: its time goes to the generated tokens' rate only, so
    the decode column never holds a rate of another kind."""
    from types import SimpleNamespace

    from repaudit.engines.base import Timing
    from repaudit.report.tables import timing_rows

    hf = Timing(prefill_s=1.0, prefill_tokens=100, decode_s=2.0, decode_tokens=28, generated_tokens=32).as_dict()
    vllm = Timing(mixed_s=4.0, generated_tokens=32).as_dict()
    assert vllm["decode_tokens_per_s"] is None and vllm["prefill_tokens_per_s"] is None
    assert vllm["generated_tokens_per_s"] == 8.0 and hf["generated_tokens_per_s"] == 32 / 3
    total = Timing()
    total.add(Timing(mixed_s=1.5, generated_tokens=3))
    total.add(Timing(mixed_s=2.5, generated_tokens=5))
    assert total.as_dict()["generated_tokens_per_s"] == 2.0
    cells = [SimpleNamespace(id=i, status="done", seconds=5.0, timing=t, group="g") for i, t in (("hf", hf), ("vllm", vllm))]
    rows = {r["cell"]: r for r in timing_rows(SimpleNamespace(cells=cells))}
    assert rows["hf"]["decode tok/s"] == 14.0 and rows["hf"]["generated tok/s"] == 32 / 3
    assert rows["vllm"]["decode tok/s"] is None and rows["vllm"]["generated tok/s"] == 8.0
