"""Audit: numbers `repaudit diff` and `repaudit report` print as text, against what they stand for."""

from __future__ import annotations

import shlex

import numpy as np

from repaudit import cli

LENGTH = 6


def rows(prompts, forks=None):
    """Columns of a record: LENGTH rows per prompt; forks {prompt: pos} gives other tokens from pos on."""
    ids, pos, tok = [], [], []
    for p in prompts:
        for i in range(1, LENGTH + 1):
            ids.append(p)
            pos.append(i)
            tok.append(300 if i >= (forks or {}).get(p, LENGTH + 1) else 64 + i)
    lp = -0.5 - 0.125 * np.arange(len(ids), dtype=np.float32)
    return dict(prompt_id=ids, pos=np.array(pos), token_id=np.array(tok), logprob=lp.astype(np.float32))


def test_the_verdicts_first_fork_is_the_earliest(make_record):
    """The reason named the fork of the first prompt in id order ('a' at pos 5) as the "first", while the
    table under it, "first divergences (earliest first)", and the report's earliest-divergence tile put
    'b' at pos 2 first."""
    from repaudit.compare.diff import diff_records

    a = make_record("a.parquet", **rows(["a", "b"]))
    b = make_record("b.parquet", **rows(["a", "b"], forks={"a": 5, "b": 2}))
    r = diff_records(a, b)
    assert "2 of 2 sequences differ in tokens or length (first: 'b' at pos 2)" in r.reasons


def test_the_pair_reports_command_reproduces_its_numbers(make_record, tmp_path, capsys):
    """`repaudit diff --html` printed "this diff" without --clip and --allow-partial: the command gave
    another clip fraction, or refused the records (exit 2) that the page compared."""
    a = make_record("a.parquet", **rows(["x", "y"]))
    b = make_record("b.parquet", **rows(["x", "z"]))
    page = tmp_path / "d.html"
    assert cli.main(["diff", str(a), str(b), "--allow-partial", "--clip", "0.9,1.25", "--html", str(page)]) == 0
    capsys.readouterr()
    command = shlex.join(["repaudit", "diff", str(a), str(b), "--allow-partial", "--clip", "0.9,1.25"])
    assert f"<pre>{command}</pre>" in page.read_text()
    assert cli.main(shlex.split(command)[1:]) == 0


def test_the_terminal_says_how_many_divergent_prompts_it_leaves_out(make_record, capsys):
    """The terminal's "first divergences" table shows the earliest 10 prompts and said nothing of the
    others: 12 divergent prompts read as 10."""
    prompts = [f"p{i:02d}" for i in range(13)]
    a = make_record("a.parquet", **rows(prompts))
    b = make_record("b.parquet", **rows(prompts, forks={p: 2 + i % 4 for i, p in enumerate(prompts[1:])}))
    assert cli.main(["diff", str(a), str(b)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "12 of 13 sequences differ" in out
    assert "… and 2 more divergent prompts (--markdown lists them all)" in out


def test_the_pair_pages_divergences_name_each_side_once(make_record, tmp_path, capsys):
    """The fold-out of a two-record page read "B vs A vs a": its title already names both sides, and
    the reference was added again, as a third record."""
    a = make_record("a.parquet", **rows(["x"]))
    b = make_record("b.parquet", **rows(["x"], forks={"x": 3}))
    page = tmp_path / "d.html"
    assert cli.main(["diff", str(a), str(b), "--html", str(page)]) == 1
    capsys.readouterr()
    html = page.read_text()
    assert '<summary><code>B vs A</code> <span class="muted">1 prompts differ, 1 fork · earliest pos 3 (x)</span>' in html
