"""The record format: bitwise round trip, canonical order, refusals, atomic writes, metadata
validation, and the recipes of docs/format.md run as written (pandas, pyarrow, DuckDB)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repaudit.record import io as records
from repaudit.errors import InputError
from repaudit.records import RecordMeta, build_table, load_frame, open_record, read_meta, write_record, write_table
from repaudit.record.schema import KEY_CELL, KEY_ENV, KEY_PHASES, KEY_PROMPTS, KEY_TOPK, KEY_VERSION, REQUIRED_KEYS, SCHEMA

DOCS = Path(__file__).resolve().parent.parent / "docs" / "format.md"

# Bit patterns that a float round trip through Python floats or float64 would lose or change.
SPECIAL_BITS = np.array(
    [0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001,  # NaNs: quiet, payload, negative, signalling
     0x80000000, 0x00000000,  # -0.0, +0.0
     0x00000001, 0x80000001, 0x007FFFFF,  # subnormals
     0x7F800000, 0xFF800000,  # ±inf
     0x3F800000, 0xBF7FFFFF, 0x7F7FFFFF],
    dtype=np.uint32,
)


def _meta_kwargs(**over):
    kw = dict(cell={"id": "c", "tp": 1}, env={"torch": "2.0"}, probes={"name": "p", "sha256": "ab"},
              model={"id": "m", "weights_sha256": None}, tokenizer={"name": "t", "sha256": "cd"})
    kw.update(over)
    return kw


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------------ round trip


def test_round_trip_is_bitwise(tmp_path):
    rng = np.random.default_rng(0)
    n, k = len(SPECIAL_BITS) * 3, 4
    ids = np.array(["ä-prompt", "b", "Z"] * len(SPECIAL_BITS), dtype=object)
    pos = np.repeat(np.arange(len(SPECIAL_BITS)), 3)
    lp_bits = np.concatenate([SPECIAL_BITS, SPECIAL_BITS[::-1], rng.integers(0, 1 << 32, len(SPECIAL_BITS), dtype=np.uint64).astype(np.uint32)])
    topk_bits = rng.integers(0, 1 << 32, (n, k), dtype=np.uint64).astype(np.uint32)
    topk_bits[:, 0] = np.resize(SPECIAL_BITS, n)
    topk_ids = rng.integers(-5, 1 << 31, (n, k), dtype=np.int64).astype(np.int32)
    digests = rng.integers(0, 1 << 64, n, dtype=np.uint64)
    digests[:3] = [0, (1 << 64) - 1, 1 << 63]
    phase = np.where(pos < 4, "prompt", "completion")
    tokens = rng.integers(0, 1 << 31, n, dtype=np.int64).astype(np.int32)
    top1 = rng.integers(-1, 1000, n).astype(np.int32)
    path = tmp_path / "r.parquet"
    meta = write_record(path, prompt_id=ids, pos=pos, token_id=tokens, logprob=lp_bits.view(np.float32),
                        phase=phase, topk_ids=topk_ids, topk_logprobs=topk_bits.view(np.float32),
                        row_digest=digests, top1_id=top1, **_meta_kwargs())
    assert meta.num_rows == n and meta.topk == k and meta.prompts == ["Z", "b", "ä-prompt"]

    order = sorted(range(n), key=lambda i: (ids[i], pos[i]))
    df = load_frame(path)
    assert df["logprob"].dtype == np.float32
    assert df["prompt_id"].astype(str).tolist() == [ids[i] for i in order]
    assert df["pos"].tolist() == [int(pos[i]) for i in order]
    assert np.array_equal(df["logprob"].to_numpy().view(np.uint32), lp_bits[order])
    assert np.array_equal(df["token_id"].to_numpy(), tokens[order])
    assert np.array_equal(df["top1_id"].to_numpy(), top1[order])
    assert df["phase"].astype(str).tolist() == [phase[i] for i in order]
    assert np.array_equal(df["row_digest"].to_numpy(dtype=np.uint64), digests[order])
    assert np.array_equal(np.stack(df["topk_ids"].to_numpy()), topk_ids[order])
    assert np.array_equal(np.stack(df["topk_logprobs"].to_numpy()).astype(np.float32).view(np.uint32), topk_bits[order])
    # and straight from pyarrow, without repaudit's reader
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert np.array_equal(table.column("logprob").to_numpy().view(np.uint32), lp_bits[order])
    assert df.attrs["repaudit"] == read_meta(path)


def test_top1_and_topk_defaults(make_record):
    n = 5
    off = make_record("off.parquet", prompt_id=["p"] * n, pos=np.arange(n), logprob=np.zeros(n, np.float32))
    df = load_frame(off)
    assert df["top1_id"].tolist() == [-1] * n  # not recorded
    assert all(len(x) == 0 for x in df["topk_ids"]) and all(len(x) == 0 for x in df["topk_logprobs"])
    assert df["row_digest"].isna().all()
    assert read_meta(off).topk == 0

    ids = np.arange(n * 3, dtype=np.int32).reshape(n, 3)
    on = make_record("on.parquet", prompt_id=["p"] * n, pos=np.arange(n), logprob=np.zeros(n, np.float32),
                     topk_ids=ids, topk_logprobs=np.zeros((n, 3), np.float32))
    assert load_frame(on)["top1_id"].tolist() == ids[:, 0].tolist()  # defaults to topk_ids[:, 0]
    assert read_meta(on).topk == 3
    explicit = make_record("x.parquet", prompt_id=["p"] * n, pos=np.arange(n), logprob=np.zeros(n, np.float32),
                           topk_ids=ids, topk_logprobs=np.zeros((n, 3), np.float32), top1_id=np.full(n, 7))
    assert load_frame(explicit)["top1_id"].tolist() == [7] * n


def test_canonical_order_on_write(tmp_path):
    rng = np.random.default_rng(1)
    names = ["b", "a", "B", "é", "a10", "a9", "a-1", "z"]
    ids = np.array([nm for nm in names for _ in range(6)], dtype=object)
    pos = np.tile(np.array([5, 0, 3, 100, 2, 1]), len(names))
    tokens = np.array([hash((i, int(p))) % 100000 for i, p in zip(ids, pos)], dtype=np.int32)
    perm = rng.permutation(len(ids))
    path = tmp_path / "r.parquet"
    write_record(path, prompt_id=ids[perm], pos=pos[perm], token_id=tokens[perm],
                 logprob=np.arange(len(ids), dtype=np.float32)[perm], **_meta_kwargs())
    table = pq.read_table(path)
    got = list(zip(table.column("prompt_id").to_pylist(), table.column("pos").to_pylist()))
    assert got == sorted(zip(ids.tolist(), pos.tolist()))  # code-point order of prompt_id, then pos
    # every column moved with its row
    want = {(i, int(p)): int(t) for i, p, t in zip(ids, pos, tokens)}
    assert [want[key] for key in got] == table.column("token_id").to_pylist()
    assert read_meta(path).prompts == sorted(names)


def test_empty_record_writes_and_reads(tmp_path):
    path = tmp_path / "empty.parquet"
    write_record(path, prompt_id=[], pos=np.zeros(0, np.int32), token_id=np.zeros(0, np.int32),
                 logprob=np.zeros(0, np.float32), **_meta_kwargs())
    meta = read_meta(path)
    assert meta.num_rows == 0 and meta.prompts == []
    assert len(load_frame(path)) == 0


# ------------------------------------------------------------------------------ refusals


def _cols(n=4, **over):
    cols = dict(prompt_id=["p"] * n, pos=np.arange(n), token_id=np.arange(n), logprob=np.zeros(n, np.float32))
    cols.update(over)
    return cols


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(prompt_id=["p", "q", "p", "p"], pos=[0, 0, 3, 0]), r"duplicate row for \(prompt_id='p', pos=0\)"),
        (dict(logprob=np.zeros(4, np.float64)), "logprob must be float32"),
        (dict(logprob=[0.0, 0.0, 0.0, 0.0]), "logprob must be float32"),  # Python floats are float64
        (dict(logprob=np.zeros(4, np.float16)), "logprob must be float32"),
        (dict(logprob=np.zeros(3, np.float32)), "logprob has 3 rows, expected 4"),
        (dict(token_id=np.zeros(4, np.float32)), "token_id must be integers"),
        (dict(pos=[0, 1, -1, 2]), "pos must be >= 0"),
        (dict(pos=np.array([0, 1, 2, (1 << 32) + 3])), "pos has values outside int32"),  # would wrap to 3
        (dict(token_id=np.array([0, 1, 2, 1 << 31], dtype=np.uint32)), "token_id has values outside int32"),
        (dict(prompt_id=["p", "", "p", "p"], pos=[0, 0, 1, 2]), "non-empty strings"),
        (dict(prompt_id=["p", None, "p", "p"], pos=[0, 0, 1, 2]), "non-empty strings"),
        (dict(phase=["prompt", "answer", "prompt", "prompt"]), "phase must be one of"),
        (dict(topk_ids=np.zeros((4, 2), np.int32)), "give both topk_ids and topk_logprobs"),
        (dict(topk_ids=np.zeros((4, 2), np.int32), topk_logprobs=np.zeros((4, 3), np.float32)), r"shape \(4, 2\)"),
        (dict(topk_ids=np.zeros((4, 2), np.int32), topk_logprobs=np.zeros((4, 2), np.float64)), "topk_logprobs must be float32"),
        (dict(topk_ids=np.zeros(4, np.int32), topk_logprobs=np.zeros(4, np.float32)), "2-D"),
    ],
)
def test_build_table_refuses_malformed_input(over, message):
    with pytest.raises(InputError, match=message):
        build_table(**_cols(**over))


def test_write_record_refusals_leave_no_file(tmp_path):
    path = tmp_path / "r.parquet"
    with pytest.raises(InputError, match="duplicate row"):
        write_record(path, **_cols(pos=[0, 1, 1, 2]), **_meta_kwargs())
    with pytest.raises(InputError, match="cell metadata needs an 'id'"):
        write_record(path, **_cols(), **_meta_kwargs(cell={"tp": 1}))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ atomic writes


def _write(path, value=0.0):
    return write_record(path, **_cols(logprob=np.full(4, value, np.float32)), **_meta_kwargs())


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_rename_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch, exc):
    path = tmp_path / "r.parquet"

    def boom(src, dst):
        assert Path(src).exists() and Path(src).name.startswith(".")  # the complete temporary file
        raise exc

    monkeypatch.setattr(records.os, "replace", boom)
    with pytest.raises(type(exc)):
        _write(path)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    _write(path, 1.0)
    before = path.read_bytes()
    monkeypatch.setattr(records.os, "replace", boom)
    with pytest.raises(type(exc)):
        _write(path, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]
    assert path.read_bytes() == before


def test_failure_mid_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "r.parquet"
    _write(path, 1.0)
    before = path.read_bytes()

    def half_then_fail(self, table, *args, **kwargs):
        real_write(self, table.slice(0, 1), *args, **kwargs)  # some bytes reach the temporary file
        raise OSError("device went away")

    real_write = pq.ParquetWriter.write_table
    monkeypatch.setattr(pq.ParquetWriter, "write_table", half_then_fail)
    with pytest.raises(OSError, match="device went away"):
        _write(path, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]
    assert path.read_bytes() == before


def test_report_files_are_written_atomically(tmp_path, monkeypatch):
    from repaudit import files

    target = tmp_path / "report.json"
    files.write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}

    def boom(src, dst):
        raise OSError("no space left")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError):
        files.write_json_atomic(target, {"a": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"] and json.loads(target.read_text()) == {"a": 1}
    monkeypatch.undo()
    with pytest.raises(ValueError):  # NaN is not JSON: refused, nothing written
        files.write_json_atomic(tmp_path / "nan.json", {"x": float("nan")})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        files.write_text_atomic(tmp_path / "missing" / "r.md", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_write_table_validates_cell_before_touching_disk(tmp_path):
    table = build_table(**_cols())
    meta = RecordMeta(cell={}, env={}, probes={}, model={}, tokenizer={}, prompts=[], topk=0)
    with pytest.raises(InputError):
        write_table(tmp_path / "r.parquet", table, meta)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ metadata


def test_metadata_keys_and_json_shapes(make_record):
    path = make_record("r.parquet", prompt_id=["q", "p"], pos=[0, 0], logprob=np.zeros(2, np.float32),
                       cell={"id": "cell-1", "tp": 2}, env={"torch": "2.9", "vars": {"NCCL_ALGO": "Ring"}})
    raw = pq.read_schema(path).metadata
    keys = {k.decode() for k in raw}
    assert keys == {KEY_VERSION, KEY_PHASES, *REQUIRED_KEYS}
    assert raw[KEY_VERSION.encode()] == b"1"
    assert json.loads(raw[KEY_PHASES.encode()]) == ["completion"]
    assert json.loads(raw[KEY_CELL.encode()]) == {"id": "cell-1", "tp": 2}
    assert json.loads(raw[KEY_ENV.encode()]) == {"torch": "2.9", "vars": {"NCCL_ALGO": "Ring"}}
    assert json.loads(raw[KEY_PROMPTS.encode()]) == ["p", "q"]
    assert json.loads(raw[KEY_TOPK.encode()]) == 0
    meta = read_meta(path)
    assert (meta.cell_id, meta.num_rows, meta.prompts, meta.env["torch"]) == ("cell-1", 2, ["p", "q"], "2.9")
    pf, meta2 = open_record(path)
    assert meta2 == meta and pf.metadata.num_rows == 2


def test_write_refuses_non_json_metadata(tmp_path):
    with pytest.raises(ValueError):  # NaN has no JSON spelling; nothing is written
        write_record(tmp_path / "r.parquet", **_cols(), **_meta_kwargs(env={"x": float("nan")}))
    assert list(tmp_path.iterdir()) == []


def _rewrite(src: Path, dst: Path, **changes) -> Path:
    """Copy a record with metadata keys changed (value None = removed)."""
    table = pq.read_table(src)
    md = dict(table.schema.metadata)
    for key, value in changes.items():
        key = key.encode()
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value.encode() if isinstance(value, str) else value
    pq.write_table(table.replace_schema_metadata(md), dst)
    return dst


BAD_METADATA = [
    ({KEY_VERSION: "2"}, "schema version 2, this repaudit reads version 1"),
    ({KEY_VERSION: None}, "without repaudit metadata"),
    *[({key: None}, f"metadata key '{key}' is missing") for key in REQUIRED_KEYS],
    ({KEY_CELL: "{not json"}, "is not valid JSON"),
    ({KEY_CELL: '{"tp": 1}'}, "must be an object with an 'id'"),
    ({KEY_PHASES: '["answer"]'}, "must be a list of prompt, completion"),
    ({KEY_PHASES: "[not json"}, "is not valid JSON"),
    # These raised TypeError (set() of unhashable items) and RecursionError: tracebacks, not exit 2.
    ({KEY_PHASES: '[["prompt"]]'}, "must be a list of prompt, completion"),
    ({KEY_PHASES: '[{"a": 1}]'}, "must be a list of prompt, completion"),
    ({KEY_PHASES: "[" * 100_000}, "is not valid JSON"),
    ({KEY_CELL: "[" * 100_000}, "is not valid JSON"),
    ({KEY_CELL: "[1]"}, "must be an object with an 'id'"),
    ({KEY_ENV: "3"}, "'repaudit.env' must be a JSON object"),
    ({"repaudit.probes": "[]"}, "'repaudit.probes' must be a JSON object"),
    ({"repaudit.model": "null"}, "'repaudit.model' must be a JSON object"),
    ({"repaudit.tokenizer": '"t"'}, "'repaudit.tokenizer' must be a JSON object"),
    ({KEY_PROMPTS: '{"p": 1}'}, "must be a list of prompt ids"),
    ({KEY_PROMPTS: "[1, 2]"}, "must be a list of prompt ids"),
    ({KEY_TOPK: '"5"'}, "must be a non-negative integer"),
    ({KEY_TOPK: "-1"}, "must be a non-negative integer"),
    ({KEY_TOPK: "true"}, "must be a non-negative integer"),
]


@pytest.mark.parametrize("changes, message", BAD_METADATA, ids=lambda x: str(x)[:40] if isinstance(x, dict) else None)
def test_reader_validates_metadata(make_record, tmp_path, changes, message):
    good = make_record("good.parquet", **_cols())
    bad = _rewrite(good, tmp_path / "bad.parquet", **changes)
    for reader in (read_meta, load_frame, open_record):
        with pytest.raises(InputError, match=re.escape(message)):
            reader(bad)


def test_reader_validates_columns(make_record, tmp_path):
    good = make_record("good.parquet", **_cols())
    table = pq.read_table(good)
    md = table.schema.metadata
    missing = table.drop_columns(["row_digest"]).replace_schema_metadata(md)
    pq.write_table(missing, tmp_path / "missing.parquet")
    with pytest.raises(InputError, match="missing column 'row_digest'"):
        read_meta(tmp_path / "missing.parquet")
    wrong = table.set_column(4, "logprob", table.column("logprob").cast(pa.float64())).replace_schema_metadata(md)
    pq.write_table(wrong, tmp_path / "wrong.parquet")
    with pytest.raises(InputError, match="column 'logprob' has type double, expected float"):
        read_meta(tmp_path / "wrong.parquet")
    plain = table.set_column(0, "prompt_id", table.column("prompt_id").cast(pa.string())).replace_schema_metadata(md)
    pq.write_table(plain, tmp_path / "plain.parquet")
    with pytest.raises(InputError, match="column 'prompt_id' has type string"):
        read_meta(tmp_path / "plain.parquet")


def test_reader_refuses_files_that_are_not_records(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 but not really" * 10)
    (tmp_path / "dir.parquet").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "other.parquet")
    cases = {
        "missing.parquet": "no such file",
        "dir.parquet": "is a directory",
        "junk.parquet": "not a readable Parquet file",
        "other.parquet": "without repaudit metadata",
    }
    for name, message in cases.items():
        with pytest.raises(InputError, match=message):
            read_meta(tmp_path / name)


def test_load_frame_keeps_uint64_digests_exact_next_to_nulls(make_record, tmp_path):
    n = 3
    digests = np.array([(1 << 64) - 1, (1 << 63) + 1, 0], dtype=np.uint64)
    good = make_record("good.parquet", **_cols(n), row_digest=digests)
    table = pq.read_table(good)
    partial = pa.array([int(digests[0]), None, int(digests[2])], pa.uint64())
    pq.write_table(table.set_column(8, "row_digest", partial).replace_schema_metadata(table.schema.metadata),
                   tmp_path / "partial.parquet")
    col = load_frame(tmp_path / "partial.parquet")["row_digest"]
    assert col.isna().tolist() == [False, True, False]
    assert int(col[0]) == (1 << 64) - 1 and int(col[2]) == 0  # not rounded through float64
    assert load_frame(good)["row_digest"].to_numpy(dtype=np.uint64).tolist() == digests.tolist()


# ------------------------------------------------------------------------------ docs/format.md recipes


def _doc_blocks(lang: str) -> list[str]:
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(), re.S)
    assert blocks, f"docs/format.md has no {lang} block"
    return blocks


@pytest.fixture
def doc_records(tmp_path, monkeypatch):
    """record.parquet, a.parquet and b.parquet (b: one logprob one ULP away) in the working directory."""
    rng = np.random.default_rng(3)
    n = 40
    ids = np.array([f"p{i % 4}" for i in range(n)], dtype=object)
    pos = np.arange(n) // 4
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    bits[:len(SPECIAL_BITS)] = SPECIAL_BITS
    monkeypatch.chdir(tmp_path)
    kw = dict(prompt_id=ids, pos=pos, token_id=pos, topk_ids=rng.integers(0, 100, (n, 2)).astype(np.int32),
              topk_logprobs=np.zeros((n, 2), np.float32), row_digest=rng.integers(0, 1 << 64, n, dtype=np.uint64))
    write_record("record.parquet", logprob=bits.view(np.float32), **kw, **_meta_kwargs())
    steady = np.abs(rng.standard_normal(n)).astype(np.float32) * -1
    write_record("a.parquet", logprob=steady, **kw, **_meta_kwargs())
    moved = steady.copy()
    moved[7] = np.nextafter(moved[7], np.float32(-np.inf))
    write_record("b.parquet", logprob=moved, **kw, **_meta_kwargs())
    order = np.lexsort((pos, ids.astype(str)))
    return bits[order]


def test_doc_python_recipes_run_and_give_exact_bits(doc_records):
    for block in _doc_blocks("python"):
        ns: dict = {}
        exec(compile(block, "docs/format.md", "exec"), ns)  # noqa: S102 - the documented recipe itself
        assert "bits" in ns, "every Python recipe in docs/format.md ends with the logprob bit patterns in `bits`"
        assert ns["bits"].dtype == np.uint32
        assert np.array_equal(ns["bits"], doc_records)
        if "meta" in ns:
            assert ns["meta"]["repaudit.schema_version"] == "1"
            assert json.loads(ns["meta"]["repaudit.cell"])["id"] == "c"


def test_doc_duckdb_sql_reads_the_record(doc_records):
    import duckdb  # a test dependency: this must not be skipped
    con = duckdb.connect()
    seen = set()
    for sql in _doc_blocks("sql"):
        result = con.sql(sql).fetchnumpy()
        if "parquet_kv_metadata" in sql:
            meta = dict(zip(result["key"], result["value"]))
            assert meta["repaudit.schema_version"] == "1" and json.loads(meta["repaudit.topk"]) == 2
            seen.add("metadata")
        elif "b.parquet" in sql:
            assert int(result["differing"][0]) == 1 and int(result["compared"][0]) == 40
            seen.add("compare")
        else:
            assert result["logprob"].dtype == np.float32
            assert np.array_equal(result["logprob"].view(np.uint32), doc_records)  # NaN payloads included
            assert result["row_digest"].dtype == np.uint64
            seen.add("rows")
    assert seen == {"rows", "metadata", "compare"}


def test_doc_describes_every_column_and_metadata_key():
    text = DOCS.read_text()
    for field in SCHEMA:
        assert f"`{field.name}`" in text, field.name
    for key in (KEY_VERSION, KEY_PHASES, *REQUIRED_KEYS):
        assert f"`{key}`" in text, key
