"""`repaudit diff` through the command line: exit codes, thresholds, report files, and every
kind of bad input ending as exactly one line on stderr with exit code 2 (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repaudit import cli
from repaudit.records import build_table
from repaudit.record.schema import KEY_VERSION

PROMPTS = ("p0", "p1", "p2", "p3")
LENGTH = 6
BASE_BITS = 0xC0200000  # -2.5


def columns(bits: dict | None = None, tokens: dict | None = None, prompts=PROMPTS, length=LENGTH) -> dict:
    """4 prompts x 6 positions; bits / tokens: {(prompt, pos): value} overrides."""
    ids, pos, tok, lp = [], [], [], []
    for p in prompts:
        for i in range(length):
            ids.append(p)
            pos.append(i)
            tok.append((tokens or {}).get((p, i), 100 + i))
            lp.append((bits or {}).get((p, i), BASE_BITS + i))
    n = len(ids)
    return dict(prompt_id=ids, pos=np.array(pos), token_id=np.array(tok),
                logprob=np.array(lp, dtype=np.uint32).view(np.float32),
                row_digest=np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def run(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.startswith("repaudit: error: "), err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture
def good(make_record) -> Path:
    return make_record("good.parquet", **columns())


# ------------------------------------------------------------------------------ exit codes and thresholds


def test_identical_records_exit_0(make_record, capsys):
    a = make_record("a.parquet", **columns())
    b = make_record("b.parquet", **columns())
    rc, out, err = run(capsys, "diff", a, b)
    assert (rc, err) == (0, "")
    assert "IDENTICAL" in out and "24/24 (100%)" in out


def test_one_flipped_bit_exits_1(make_record, capsys):
    a = make_record("a.parquet", **columns())
    b = make_record("b.parquet", **columns(bits={("p2", 3): (BASE_BITS + 3) ^ 1}))
    rc, out, err = run(capsys, "diff", a, b)
    assert (rc, err) == (1, "")
    assert "DIVERGENT" in out and "1 of 24 logprobs differ in their bits (max 1 ULP)" in " ".join(out.split())
    assert "23/24 (95.83%)" in out  # truncated, never rounded up


def test_rates_are_truncated_never_rounded_up():
    from repaudit.compare.render import pct

    assert [pct(2, 3), pct(1, 3), pct(0, 7), pct(7, 7), pct(1, 0)] == ["66.66%", "33.33%", "0.00%", "100%", "n/a"]
    assert pct(10**17 - 1, 10**17) == "99.99%"  # a float quotient would round this to 100.00%
    assert pct(9999, 10000) == "99.99%" and pct(19999, 20000) == "99.99%"
    # A rate above zero never reads as none: 1 of 10,001 floors to 0.00% but is not 0.
    assert [pct(1, 10001), pct(1, 10000), pct(0, 10001)] == ["<0.01%", "0.01%", "0.00%"]


def test_one_flipped_digest_bit_exits_1(make_record, capsys):
    cols = columns()
    a = make_record("a.parquet", **cols)
    cols["row_digest"] = cols["row_digest"].copy()
    cols["row_digest"][5] ^= np.uint64(1 << 63)
    b = make_record("b.parquet", **cols)
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 1 and "logits rows differ (row digest)" in " ".join(out.split())
    assert run(capsys, "diff", a, b, "--max-ulp", "0")[0] == 0  # a tolerance relaxes the digest check


def test_max_ulp_boundary(make_record, capsys):
    a = make_record("a.parquet", **columns())
    b = make_record("b.parquet", **columns(bits={("p1", 2): BASE_BITS + 2 + 3}))  # 3 ULP away
    assert run(capsys, "diff", a, b)[0] == 1
    assert run(capsys, "diff", a, b, "--max-ulp", "2")[0] == 1
    rc, out, _ = run(capsys, "diff", a, b, "--max-ulp", "3")
    assert rc == 0 and "WITHIN THRESHOLDS" in out
    assert run(capsys, "diff", a, b, "--max-ulp", "4")[0] == 0


def test_max_abs_boundary(make_record, capsys):
    a = make_record("a.parquet", **columns())
    b = make_record("b.parquet", **columns(bits={("p0", 0): BASE_BITS + 1000}))
    va = float(np.array([BASE_BITS], np.uint32).view(np.float32)[0])
    vb = float(np.array([BASE_BITS + 1000], np.uint32).view(np.float32)[0])
    delta = abs(va - vb)  # exact: both are float32
    assert run(capsys, "diff", a, b, "--max-abs", repr(delta))[0] == 0
    assert run(capsys, "diff", a, b, "--max-abs", repr(float(np.nextafter(delta, 0.0))))[0] == 1
    assert run(capsys, "diff", a, b, "--max-abs", "1", "--max-ulp", "999")[0] == 1  # both must hold


def test_max_seq_divergence_boundary(make_record, capsys):
    a = make_record("a.parquet", **columns())
    forked = {("p3", i): 7 for i in range(2, LENGTH)}  # p3 forks at pos 2: 1 of 4 sequences
    b = make_record("b.parquet", **columns(tokens=forked))
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 1 and "1 of 4 sequences differ in tokens or length (first: 'p3' at pos 2)" in " ".join(out.split())
    assert run(capsys, "diff", a, b, "--max-seq-divergence", "0.24")[0] == 1
    rc, out, _ = run(capsys, "diff", a, b, "--max-seq-divergence", "0.25")
    assert rc == 0 and "WITHIN THRESHOLDS" in out


def test_max_seq_divergence_compares_the_fraction_exactly(make_record, capsys):
    """1 of 3 forked is above 0.3333333333333333 (a float64 division says equal); 7 of 10 is
    within 0.7 (whose double is below 7/10)."""
    three = ("p0", "p1", "p2")
    a = make_record("a.parquet", **columns(prompts=three))
    b = make_record("b.parquet", **columns(prompts=three, tokens={("p2", i): 7 for i in range(2, LENGTH)}))
    assert run(capsys, "diff", a, b, "--max-seq-divergence", "0.3333333333333333")[0] == 1
    assert run(capsys, "diff", a, b, "--max-seq-divergence", "0.3333333333333334")[0] == 0
    ten = tuple(f"q{i}" for i in range(10))
    a = make_record("c.parquet", **columns(prompts=ten))
    b = make_record("d.parquet", **columns(prompts=ten, tokens={(f"q{j}", i): 7 for j in range(7) for i in range(2, LENGTH)}))
    assert run(capsys, "diff", a, b, "--max-seq-divergence", "0.7")[0] == 0
    assert run(capsys, "diff", a, b, "--max-seq-divergence", "0.6999999999999999")[0] == 1


def test_json_and_markdown_reports(make_record, capsys, tmp_path):
    a = make_record("a.parquet", **columns(), env={"torch": "2.5.1"})
    b = make_record("b.parquet", **columns(bits={("p0", 1): 0xFF800000, ("p1", 1): 0x7FC00000}), env={"torch": "2.6.0"})
    js, md = tmp_path / "out" / "r.json", tmp_path / "out" / "r.md"
    js.parent.mkdir()
    rc, out, err = run(capsys, "diff", a, b, "--json", js, "--markdown", md)
    assert (rc, err) == (1, "")
    assert "environment differs" in out and "torch 2.5.1 → 2.6.0" in out

    def no_constants(name):
        raise AssertionError(f"JSON has a {name} token")

    d = json.loads(js.read_text(), parse_constant=no_constants)
    assert d["verdict"]["passed"] is False and d["verdict"]["identical"] is False
    assert d["logprob"]["abs_max"] == "inf" and d["logprob"]["abs_mean"] == "inf"  # -inf against a number
    assert d["logprob"]["nan_vs_number"] == 1 and d["rows"]["comparable"] == 24
    assert d["environment_differences"] == [["torch", "2.5.1", "2.6.0"]]
    assert d["thresholds"] == {"max_ulp": None, "max_abs": None, "max_seq_divergence": 0.0}
    assert d["not_compared"] == ["top-1 ids: in neither record", "top-k lists: in neither record",
                                 "RL metrics: 2 positions with a NaN or infinite logprob left out"]
    assert d["topk"]["compared"] == 0 and d["rl"]["positions"] == 22 and d["rl"]["clip"] == [0.5, 2.0]
    assert d["rl"]["ratio_p50"] == 1.0 and d["rl"]["kl_k1"] == 0.0  # the two that differ are left out
    text = md.read_text()
    assert text.startswith("# repaudit diff: `a` vs `b`") and "**Verdict: DIVERGENT" in text
    assert "| torch | 2.5.1 | 2.6.0 |" in text
    assert sorted(p.name for p in js.parent.iterdir()) == ["r.json", "r.md"]  # no temporary files left


def test_nan_and_inf_logprobs_are_metrics_not_errors(make_record, capsys):
    same = {("p0", 0): 0x7FC00001, ("p0", 1): 0xFF800000, ("p0", 2): 0x80000000}
    a = make_record("a.parquet", **columns(bits=same))
    b = make_record("b.parquet", **columns(bits=same))
    rc, out, err = run(capsys, "diff", a, b)
    assert (rc, err) == (0, "") and "IDENTICAL" in out  # same NaN bits, same -inf, same -0.0

    payload = make_record("c.parquet", **columns(bits={**same, ("p0", 0): 0x7FC00002}))
    rc, out, err = run(capsys, "diff", a, payload)
    assert (rc, err) == (1, "") and "NaN on both sides with different bits" in " ".join(out.split())
    assert run(capsys, "diff", a, payload, "--max-ulp", "0")[0] == 0

    number = make_record("d.parquet", **columns(bits={**same, ("p0", 0): BASE_BITS}))
    rc, out, err = run(capsys, "diff", a, number, "--max-ulp", "4000000000")
    assert (rc, err) == (1, "") and "NaN on one side only" in " ".join(out.split())


def test_allow_partial(make_record, capsys):
    a = make_record("a.parquet", **columns())
    b = make_record("b.parquet", **columns(prompts=PROMPTS[:3]))
    rc, _, err = run(capsys, "diff", a, b)
    assert_one_line_error(rc, err, "prompt sets differ (1 only in A, 0 only in B, e.g. 'p3')", "--allow-partial")
    rc, out, err = run(capsys, "diff", a, b, "--allow-partial")
    assert (rc, err) == (0, "")
    flat = " ".join(out.split())
    assert "compared partially" in flat and "prompts left out (only A / only B) │ 1 / 0" in flat


# ------------------------------------------------------------------------------ bad input: exit 2, one line


def _rewrite(src: Path, dst: Path, table=None, row_group_size=None, **meta) -> Path:
    table = pq.read_table(src) if table is None else table
    md = dict(pq.read_schema(src).metadata)
    md.update({k.encode(): v.encode() for k, v in meta.items()})
    pq.write_table(table.replace_schema_metadata(md), dst, row_group_size=row_group_size)
    return dst


def _corrupt_page(src: Path, dst: Path) -> Path:
    data = bytearray(src.read_bytes())
    col = pq.ParquetFile(src).metadata.row_group(0).column(4)  # logprob
    assert col.path_in_schema == "logprob"
    for i in range(col.data_page_offset, col.data_page_offset + 16):
        data[i] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _directory(good: Path, d: Path) -> Path:
    (d / "dir.parquet").mkdir()
    return d / "dir.parquet"


def _other_tool(good: Path, d: Path) -> Path:
    pq.write_table(pa.table({"prompt_id": ["a"], "pos": [0]}), d / "o.parquet")
    return d / "o.parquet"


def _rows(good: Path, d: Path, name: str, order: list[int], row_group_size=None) -> Path:
    """The good record's rows in another order (repeats = duplicates), written without the writer's checks."""
    return _rewrite(good, d / name, table=pq.read_table(good).take(order), row_group_size=row_group_size)


DUP = [0, 1, 2, 3, 3, 4, 5]
BAD_FILES = {
    "missing": (lambda good, d: d / "nope.parquet", "nope.parquet: no such file"),
    "directory": (_directory, "is a directory"),
    "not parquet": (lambda good, d: _write(d / "x.parquet", b"id,pos\n" * 50), "not a readable Parquet file"),
    "zero bytes": (lambda good, d: _write(d / "z.parquet", b""), "not a readable Parquet file"),
    "other tool": (_other_tool, "Parquet file without repaudit metadata (written by another tool?)"),
    "truncated half": (lambda good, d: _write(d / "t.parquet", good.read_bytes()[: good.stat().st_size // 2]),
                       "not a readable Parquet file"),
    "truncated tail": (lambda good, d: _write(d / "t.parquet", good.read_bytes()[:-1]), "not a readable Parquet file"),
    "corrupt page": (lambda good, d: _corrupt_page(good, d / "c.parquet"), "c.parquet: corrupt data"),
    "schema version 2": (lambda good, d: _rewrite(good, d / "v2.parquet", **{KEY_VERSION: "2"}),
                         "record schema version 2, this repaudit reads version 1"),
    "bad metadata": (lambda good, d: _rewrite(good, d / "m.parquet", **{"repaudit.topk": '"five"'}),
                     "'repaudit.topk' must be a non-negative integer"),
    "duplicate rows": (lambda good, d: _rows(good, d, "dup.parquet", DUP),
                       "duplicate or out-of-order row at prompt 'p0' pos 3"),
    "duplicate across row groups": (lambda good, d: _rows(good, d, "dup.parquet", DUP, row_group_size=4),
                                    "duplicate or out-of-order row at prompt 'p0' pos 3"),
    "out of order": (lambda good, d: _rows(good, d, "ooo.parquet", [0, 2, 1, 3]),
                     "duplicate or out-of-order row at prompt 'p0' pos 1"),
    "prompt order": (lambda good, d: _rows(good, d, "ooo.parquet", list(range(6, 12)) + list(range(6))),
                     "duplicate or out-of-order row at prompt 'p0' pos 0"),
    # the same prompt list in the metadata, but rows of a fifth prompt in the file
    "prompt not in metadata": (lambda good, d: _rewrite(good, d / "pm.parquet", table=build_table(**columns(prompts=PROMPTS + ("p9",)))),
                               "rows name prompts missing from the metadata"),
    "other probe suite": (lambda good, d: _rewrite(good, d / "ps.parquet", **{"repaudit.probes": '{"name": "chat", "sha256": "ff"}'}),
                          "probe suite differs"),
    "other tokenizer": (lambda good, d: _rewrite(good, d / "tk.parquet", **{"repaudit.tokenizer": '{"name": "t", "sha256": "ee"}'}),
                        "tokenizer differs"),
}


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_input_is_one_line_and_exit_2(good, tmp_path, capsys, case, which):
    build, message = BAD_FILES[case]
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = build(good, bad_dir)
    args = ("diff", bad, good) if which == "a" else ("diff", good, bad)
    rc, out, err = run(capsys, *args)
    assert_one_line_error(rc, err, message)


def test_empty_record_is_bad_input(make_record, good, capsys):
    empty = make_record("empty.parquet", prompt_id=[], pos=np.zeros(0, np.int32), logprob=np.zeros(0, np.float32))
    rc, _, err = run(capsys, "diff", good, empty)
    assert_one_line_error(rc, err, "empty.parquet: record has no rows")


@pytest.mark.parametrize(
    "extra, message",
    [
        ((), "Missing argument"),
        (("{good}", "--bogus"), "No such option: --bogus"),
        (("{good}", "--max-ulp", "-1"), "--max-ulp"),
        (("{good}", "--max-ulp", "three"), "--max-ulp"),
        (("{good}", "--max-abs", "-0.5"), "--max-abs"),
        (("{good}", "--max-seq-divergence", "1.5"), "--max-seq-divergence"),
        (("{good}", "--json", "{missing}/r.json"), "r.json"),
        (("{good}", "--clip", "2,1"), "--clip '2,1': expected LO,HI with 0 <= LO < HI"),
        (("{good}", "--clip", "0.5"), "--clip '0.5': expected LO,HI"),
        (("{good}", "--clip", "-1,2"), "--clip '-1,2': expected LO,HI"),
        (("{good}", "--clip", "nan,2"), "--clip 'nan,2': expected LO,HI"),
        (("{good}", "--clip", "low,high"), "--clip 'low,high': expected a comma-separated list of float values"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(good, tmp_path, capsys, extra, message):
    args = [x.format(good=good, missing=tmp_path / "no-such-dir") for x in extra]
    rc, _, err = run(capsys, "diff", good, *args)
    assert_one_line_error(rc, err, message)


def test_python_dash_m_exit_codes(good, tmp_path):
    """The real entry point: exit status from main(), stderr one line, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    bad = tmp_path / "junk.parquet"
    bad.write_bytes(b"not parquet")
    proc = subprocess.run([sys.executable, "-m", "repaudit", "diff", str(good), str(bad)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "repaudit", "diff", str(good), str(good)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "" and "IDENTICAL" in proc.stdout
