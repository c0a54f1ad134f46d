"""Top-k lists, top-1 ids and row digests: compared bit for bit, never read as equal when one record lacks
them, and `identical`, `passed`, the reasons and the exit code of `diff` and `gate` saying one thing.

The reference walks each prompt row by row in Python over plain lists (list equality of ids and of
logprob bit patterns), independently of the diff's padded arrays and masks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repaudit import cli
from repaudit.diff import diff_records
from repaudit.records import write_record

META = dict(probes={"name": "p", "sha256": "0"}, model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"}, env={})
LP = 0xC0200000  # -2.5


# ------------------------------------------------------------------------------ records as rows


def random_rows(seed: int, mode: str, k: int, ragged: bool) -> tuple[dict, dict]:
    """Two records as {(prompt, pos): row}; row = dict(token, bits, top1, ids, lps) with ids / lps lists
    (None: a null list). B copies A, then moves single bits and ids, forks tokens (generate mode) and,
    when ragged, gives rows shorter, empty or null lists."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for i in range(int(rng.integers(3, 9))):
        pid = f"p{i:02d}"
        n = int(rng.integers(1, 30))
        fork = int(rng.integers(0, n)) if mode == "generate" and rng.random() < 0.5 else None
        for pos in range(n):
            ids = rng.integers(0, 50, k).tolist()
            lps = (0xC0000000 + rng.integers(0, 1 << 20, k)).tolist()
            if ragged and rng.random() < 0.3:
                cut = int(rng.integers(0, k + 1))
                ids, lps = ids[:cut], lps[:cut]
            row = dict(token=int(rng.integers(0, 50)), bits=LP + pos, top1=ids[0] if ids else -1, ids=ids, lps=lps)
            if ragged and rng.random() < 0.1:
                row.update(ids=None, lps=None)
            a[pid, pos] = row
            rb = {**row, "ids": None if row["ids"] is None else list(row["ids"]),
                  "lps": None if row["lps"] is None else list(row["lps"])}
            u = rng.random()
            if rb["ids"] and u < 0.15:
                rb["lps"][int(rng.integers(0, len(rb["lps"])))] ^= 1 << int(rng.integers(0, 32))  # one bit
            elif rb["ids"] and u < 0.3:
                rb["ids"][int(rng.integers(0, len(rb["ids"])))] += 1
            elif ragged and u < 0.4:
                cut = int(rng.integers(0, k + 1))
                rb["ids"], rb["lps"] = rng.integers(0, 50, cut).tolist(), (0xC0000000 + rng.integers(0, 9, cut)).tolist()
            if rb["top1"] >= 0 and rng.random() < 0.05:
                rb["top1"] += 1  # the argmax moves, the sampled token's logprob stays
            if fork is not None and pos >= fork:
                rb["token"] = row["token"] + 1 + pos
            b[pid, pos] = rb
    return a, b


def write_rows(path: Path, rows: dict, k: int) -> Path:
    """Through write_record when every row holds k entries, else with the top-k columns built by hand."""
    keys = sorted(rows)
    cols = dict(prompt_id=[p for p, _ in keys], pos=np.array([q for _, q in keys]),
                token_id=np.array([rows[x]["token"] for x in keys]),
                logprob=np.array([rows[x]["bits"] for x in keys], np.uint32).view(np.float32),
                top1_id=np.array([rows[x]["top1"] for x in keys]))
    uniform = all(rows[x]["ids"] is not None and len(rows[x]["ids"]) == k for x in keys)
    if uniform and k:
        write_record(path, **cols, topk_ids=np.array([rows[x]["ids"] for x in keys]),
                     topk_logprobs=np.array([rows[x]["lps"] for x in keys], np.uint32).view(np.float32),
                     cell={"id": path.stem}, **META)
        return path
    write_record(path, **cols, cell={"id": path.stem}, **META)
    if not k:
        return path
    table = pq.read_table(path)
    for name, field, dtype in (("topk_ids", "ids", np.int32), ("topk_logprobs", "lps", np.uint32)):
        lists = [rows[x][field] for x in keys]
        lengths = [0 if v is None else len(v) for v in lists]
        values = np.array([y for v in lists if v for y in v], dtype)
        arr = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
                                       pa.array(values.view(np.float32) if dtype == np.uint32 else values),
                                       mask=pa.array([v is None for v in lists]))
        i = table.schema.get_field_index(name)
        table = table.set_column(i, pa.field(name, arr.type), arr)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)
    return path


def reference(a: dict, b: dict) -> dict:
    out = dict(topk_compared=0, topk_ids_equal=0, topk_logprobs_equal=0, topk_only_a=0, topk_only_b=0,
               top1_compared=0, top1_equal=0)
    for pid in sorted({p for p, _ in a} & {p for p, _ in b}):
        pa_, pb_ = {q for p, q in a if p == pid}, {q for p, q in b if p == pid}
        breaks = [q for q in pa_ ^ pb_] + [q for q in pa_ & pb_ if a[pid, q]["token"] != b[pid, q]["token"]]
        div = min(breaks, default=None)
        for q in sorted(pa_ & pb_):
            if div is not None and q > div:
                continue
            ra, rb = a[pid, q], b[pid, q]
            if ra["top1"] >= 0 and rb["top1"] >= 0:
                out["top1_compared"] += 1
                out["top1_equal"] += ra["top1"] == rb["top1"]
            has_a, has_b = bool(ra["ids"]), bool(rb["ids"])
            out["topk_only_a"] += has_a and not has_b
            out["topk_only_b"] += has_b and not has_a
            if has_a and has_b:
                out["topk_compared"] += 1
                out["topk_ids_equal"] += ra["ids"] == rb["ids"]
                out["topk_logprobs_equal"] += ra["lps"] == rb["lps"]
    return out


def got(r) -> dict:
    return {k: getattr(r, k) for k in ("topk_compared", "topk_ids_equal", "topk_logprobs_equal", "topk_only_a",
                                       "topk_only_b", "top1_compared", "top1_equal")}


@pytest.mark.parametrize("seed, mode, k, ragged", [(0, "score", 5, False), (1, "generate", 5, False), (2, "score", 4, True),
                                                   (3, "generate", 3, True), (4, "generate", 1, True), (5, "score", 2, True)])
def test_random_records_match_the_reference(tmp_path, seed, mode, k, ragged):
    a, b = random_rows(seed, mode, k, ragged)
    pa_, pb_ = write_rows(tmp_path / "a.parquet", a, k), write_rows(tmp_path / "b.parquet", b, k)
    want = reference(a, b)
    base = diff_records(pa_, pb_)
    assert got(base) == want
    assert want["topk_compared"] > want["topk_ids_equal"] and want["topk_compared"] > want["topk_logprobs_equal"]
    for batch_rows in (1, 3, 7, 1 << 20):  # chunks cut anywhere, aligned or not, give the same counts
        assert diff_records(pa_, pb_, batch_rows=batch_rows).to_dict() == base.to_dict(), batch_rows


def test_streaming_with_other_row_groups(tmp_path, monkeypatch):
    from repaudit.record import io as records

    a, b = random_rows(9, "generate", 5, True)
    base = diff_records(write_rows(tmp_path / "a.parquet", a, 5), write_rows(tmp_path / "b.parquet", b, 5))
    monkeypatch.setattr(records, "ROW_GROUP_ROWS", 7)
    a2, b2 = random_rows(10, "generate", 5, False)  # uniform lists: written by write_record, in row groups of 7
    pa_, pb_ = write_rows(tmp_path / "a2.parquet", a2, 5), write_rows(tmp_path / "b2.parquet", b2, 5)
    assert pq.ParquetFile(pa_).metadata.num_row_groups > 3
    r = diff_records(pa_, pb_, batch_rows=5)
    assert got(r) == reference(a2, b2) and got(base) == reference(a, b)


# ------------------------------------------------------------------------------ the defects, end to end


def _records(tmp_path: Path, **change) -> tuple[Path, Path]:
    """Two score-mode records of 3 prompts x 4 positions with top-5 and digests; `change` edits B's arrays."""
    n = 12
    rng = np.random.default_rng(0)
    cols = dict(prompt_id=[f"q{i // 4}" for i in range(n)], pos=np.arange(n) % 4, token_id=np.arange(n) + 7,
                logprob=(LP + np.arange(n, dtype=np.uint32)).view(np.float32),
                topk_ids=rng.integers(0, 1000, (n, 5)).astype(np.int32),
                topk_logprobs=-np.sort(rng.exponential(2.0, (n, 5)).astype(np.float32), axis=1),
                row_digest=rng.integers(0, 1 << 63, n).astype(np.uint64))
    a = tmp_path / "a.parquet"
    write_record(a, **cols, cell={"id": "a"}, **META)
    cols_b = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in cols.items()}
    for key, fn in change.items():
        cols_b[key] = fn(cols_b[key])
    b = tmp_path / "b.parquet"
    write_record(b, **cols_b, cell={"id": "b"}, **META)
    return a, b


def _flip_lp(x):
    x.view(np.uint32)[5, 3] ^= 1
    return x


def _flip_id(x):
    x[7, 2] ^= 1 << 4
    return x


def _diff(capsys, tmp_path, a, b, *extra):
    js = tmp_path / "d.json"
    rc = cli.main(["diff", str(a), str(b), "--json", str(js), *extra])
    out = " ".join(capsys.readouterr().out.split())
    return rc, out, json.loads(js.read_text())


@pytest.mark.parametrize("change, reason, key", [
    (dict(topk_logprobs=_flip_lp), "1 of 12 positions differ in their top-k logprob bits", "logprobs_equal"),
    (dict(topk_ids=_flip_id), "1 of 12 positions differ in their top-k ids", "ids_equal"),
])
def test_one_flipped_topk_bit_fails_diff_and_gate(tmp_path, capsys, change, reason, key):
    a, b = _records(tmp_path, **change)
    rc, out, d = _diff(capsys, tmp_path, a, b)
    assert rc == 1 and "DIVERGENT" in out and reason in out
    assert d["verdict"] == {"passed": False, "identical": False, "reasons": [reason]}
    assert d["topk"]["compared"] == 12 and d["topk"][key] == 11 and (d["topk"]["k_a"], d["topk"]["k_b"]) == (5, 5)
    assert d["logprob"]["bitwise_equal"] == 12 and d["digest"]["equal"] == 12  # only the top-k moved
    assert cli.main(["gate", str(a), str(b)]) == 1 and reason in " ".join(capsys.readouterr().out.split())
    assert cli.main(["diff", str(a), str(b), "--max-ulp", "0"]) == 0  # a tolerance relaxes it, like digests
    capsys.readouterr()


def test_identical_topk_passes(tmp_path, capsys):
    a, b = _records(tmp_path)
    rc, out, d = _diff(capsys, tmp_path, a, b)
    assert rc == 0 and "IDENTICAL" in out and d["verdict"]["identical"] and d["topk"]["ids_equal"] == d["topk"]["logprobs_equal"] == 12
    assert d["not_compared"] == []


def test_a_moved_argmax_alone_fails_and_is_not_identical(tmp_path, capsys):
    """The same sampled-token logprobs, but B's most likely token moved at one position (top1_id and the
    top-k list with it): strict fails, and JSON says not identical (it used to say identical and failed)."""
    def moved(x):
        x[4, [0, 1]] = x[4, [1, 0]]
        return x
    a, b = _records(tmp_path, topk_ids=moved)
    rc, out, d = _diff(capsys, tmp_path, a, b)
    assert rc == 1 and d["verdict"]["passed"] is False and d["verdict"]["identical"] is False
    assert "1 of 12 positions change their most likely token" in d["verdict"]["reasons"]
    assert d["logprob"]["bitwise_equal"] == 12 and d["top1"]["equal"] == 11
    assert d["rl"]["flips"] == 1 and d["rl"]["flip_rate"] == 1 / 12
    assert cli.main(["gate", str(a), str(b)]) == 1
    capsys.readouterr()


def test_top1_id_alone_fails_too(tmp_path, capsys):
    # top1_id given apart from top-k: only it moves
    a = tmp_path / "a.parquet"
    cols = dict(prompt_id=["x"] * 3, pos=[0, 1, 2], token_id=[5, 6, 7], logprob=np.array([-1, -2, -3], np.float32))
    write_record(a, **cols, top1_id=[5, 6, 7], cell={"id": "a"}, **META)
    b = tmp_path / "b.parquet"
    write_record(b, **cols, top1_id=[5, 9, 7], cell={"id": "b"}, **META)
    r = diff_records(a, b)
    assert (r.passed, r.identical, r.reasons) == (False, False, ["1 of 3 positions change their most likely token"])


def without(x):
    return None


def test_top_k_missing_on_one_side_fails_strict(tmp_path, capsys):
    message = "record B has no top-k lists (A has them at 12 positions); cannot compare the top-k"
    a, b = _records(tmp_path, topk_ids=without, topk_logprobs=without)
    rc, out, d = _diff(capsys, tmp_path, a, b)
    assert rc == 1 and message in d["verdict"]["reasons"] and not d["verdict"]["identical"]
    assert (d["topk"]["compared"], d["topk"]["only_a"], d["topk"]["only_b"]) == (0, 12, 0)
    assert "top-k lists: 12 positions hold them in A only" in d["not_compared"]
    assert cli.main(["gate", str(a), str(b)]) == 1 and message in " ".join(capsys.readouterr().out.split())
    # the other way round names the other record
    rc, _, d = _diff(capsys, tmp_path, b, a)
    assert rc == 1 and any(x.startswith("record A has no") for x in d["verdict"]["reasons"])


def test_row_digests_missing_from_a_whole_record_are_listed_not_failed(tmp_path, capsys):
    """A vLLM record has no row digest at all: the pair is judged on the columns both hold."""
    a, b = _records(tmp_path, row_digest=without)
    rc, out, d = _diff(capsys, tmp_path, a, b)
    assert rc == 0 and d["verdict"]["identical"] and d["verdict"]["reasons"] == []
    assert (d["digest"]["compared"], d["digest"]["only_a"], d["digest"]["only_b"]) == (0, 12, 0)
    assert "row digests: 12 positions hold them in A only" in d["not_compared"]
    assert "not compared (12 only in A)" in out


def test_both_sides_without_digests_or_topk_is_not_a_failure(tmp_path, capsys):
    """vLLM records carry no row digest on either side: not compared, nothing wrong."""
    a, b = _records(tmp_path, row_digest=lambda x: None, topk_ids=lambda x: None, topk_logprobs=lambda x: None)
    rc, out, d = _diff(capsys, tmp_path, b, b)
    assert rc == 0 and d["verdict"]["identical"] and d["topk"]["compared"] == d["digest"]["compared"] == 0
    assert d["not_compared"] == ["row digests: in neither record", "top-1 ids: in neither record", "top-k lists: in neither record"]
    assert (d["topk"]["k_a"], d["topk"]["k_b"]) == (0, 0)


def test_topk_of_other_lengths_never_equal(tmp_path):
    a, b = _records(tmp_path, topk_ids=lambda x: x[:, :3].copy(), topk_logprobs=lambda x: x[:, :3].copy())
    r = diff_records(a, b)
    assert (r.topk_compared, r.topk_ids_equal, r.topk_logprobs_equal) == (12, 0, 0)
    assert r.to_dict()["topk"]["k_a"] == 5 and r.to_dict()["topk"]["k_b"] == 3 and not r.passed


def test_topk_lists_of_unequal_length_inside_a_record_are_refused(tmp_path, capsys):
    a, _ = _records(tmp_path)
    table = pq.read_table(a)
    ids = pa.ListArray.from_arrays(pa.array(np.arange(13, dtype=np.int32) * 4), pa.array(np.zeros(48, np.int32)))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("topk_ids"), "topk_ids", ids)
                   .replace_schema_metadata(table.schema.metadata), bad)
    rc = cli.main(["diff", str(a), str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "topk_ids and topk_logprobs lists differ in length" in err


def test_a_null_inside_a_top_k_list_is_refused_and_a_null_list_is_none(tmp_path, capsys):
    """docs/format.md: a null top-k list reads as an empty one (top-k not recorded there); a null
    value inside a list is corrupt data (exit 2, one line)."""
    a, _ = _records(tmp_path)
    table = pq.read_table(a)
    col = table.schema.get_field_index("topk_logprobs")
    values = table.column(col).combine_chunks().values
    offsets = pa.array(np.arange(13, dtype=np.int32) * 5)
    row4 = pa.array([i == 4 for i in range(12)])
    holed = pa.array([None] + values.to_pylist()[1:], pa.float32())
    for name, lists, ok in (("null-list", pa.ListArray.from_arrays(offsets, values, mask=row4), True),
                            ("null-value", pa.ListArray.from_arrays(offsets, holed), False)):
        path = tmp_path / f"{name}.parquet"
        ids = table.column("topk_ids").combine_chunks()
        if ok:  # the ids' list at the same row is null too: the row holds no top-k
            ids = pa.ListArray.from_arrays(offsets, ids.values, mask=row4)
        pq.write_table(table.set_column(col, "topk_logprobs", lists)
                       .set_column(table.schema.get_field_index("topk_ids"), "topk_ids", ids)
                       .replace_schema_metadata(table.schema.metadata), path)
        rc = cli.main(["diff", str(a), str(path), "--json", str(tmp_path / f"{name}.json")])
        err = capsys.readouterr().err
        if ok:
            got = json.loads((tmp_path / f"{name}.json").read_text())["topk"]
            assert rc == 1 and got["compared"] == 11, got  # the row without a top-k is not compared
        else:
            assert rc == 2 and err.count("\n") == 1 and "nulls inside the top-k lists" in err


def test_generate_mode_compares_topk_up_to_the_fork(tmp_path):
    rows = {("x", q): dict(token=q, bits=LP, top1=1, ids=[1, 2], lps=[LP, LP + 1]) for q in range(6)}
    moved = {key: {**row, "token": row["token"] + (9 if key[1] >= 3 else 0), "ids": [1, 2 + key[1]]} for key, row in rows.items()}
    r = diff_records(write_rows(tmp_path / "a.parquet", rows, 2), write_rows(tmp_path / "b.parquet", moved, 2))
    # fork at pos 3: rows 0-3 compare their top-k (pos 3 shares the context), 4-5 not; only pos 0 keeps [1, 2]
    assert (r.topk_compared, r.topk_ids_equal, r.topk_logprobs_equal) == (4, 1, 4)


@pytest.mark.parametrize("seed", range(6))
def test_strict_passes_exactly_when_identical(tmp_path, seed):
    """With the same prompts on both sides, the strict verdict and `identical` agree (they did not when
    only the argmax moved: identical, yet failed)."""
    a, b = random_rows(seed + 20, "score", 3, bool(seed % 3))
    if seed % 2:  # only the argmax moves: same tokens, logprobs and top-k lists
        b = {k: {**v, "top1": v["top1"] + 1 if k[1] == 1 and v["top1"] >= 0 else v["top1"]} for k, v in a.items()}
    r = diff_records(write_rows(tmp_path / "a.parquet", a, 3), write_rows(tmp_path / "b.parquet", b, 3))
    assert r.top1_equal < r.top1_compared
    assert r.passed == r.identical == (not r.reasons) is False
    same = diff_records(tmp_path / "a.parquet", tmp_path / "a.parquet")
    assert same.passed == same.identical == (not same.reasons) is True
