"""The diff reads the top-k lists straight from their Parquet pages (pages.direct_topk): for every writer
setting that reader accepts it gives what Arrow reads, and anything else (dictionary pages, null items,
nullable lists, damaged pages) it leaves to Arrow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repaudit.compare import chunks, pages, work

N = 2000


def lengths_of(shape: str, rng: np.random.Generator) -> np.ndarray:
    return {"k5": np.full(N, 5), "k1": np.full(N, 1), "k0": np.zeros(N, int),
            "ragged": rng.integers(0, 7, N)}[shape]


def table(lengths: np.ndarray, rng: np.random.Generator, nullable_lists: bool = False) -> pa.Table:
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    n = int(np.sum(lengths))
    ids = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(-(1 << 31), 1 << 31, n).astype(np.int32)))
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)  # NaN payloads and all
    lps = pa.ListArray.from_arrays(offsets, pa.array(bits.view(np.float32)))
    schema = pa.schema([pa.field("topk_ids", ids.type, nullable=nullable_lists),
                        pa.field("topk_logprobs", lps.type, nullable=nullable_lists)])
    return pa.Table.from_arrays([ids, lps], schema=schema)


def direct(path: Path) -> list:
    pf = pq.ParquetFile(path)
    with open(path, "rb") as f:
        return [pages.direct_topk(pf, f.fileno(), g, work.Work()) for g in range(pf.metadata.num_row_groups)]


def assert_same_as_arrow(path: Path, got: list) -> None:
    pf = pq.ParquetFile(path)
    for g, lists in enumerate(got):
        want = pf.read_row_group(g)
        for mine, column in zip(lists, ("topk_ids", "topk_logprobs")):
            arrow = chunks._arrow_lists(want.column(column).combine_chunks(), path)
            n = want.num_rows
            (off, lengths), (a_off, a_lengths) = mine.rows(0, n), arrow.rows(0, n)
            assert np.array_equal(lengths, a_lengths)
            # Equal lengths, so the rows' values are equal when the values they span are.
            assert np.array_equal(mine.values[off[0] : off[-1]], arrow.values[a_off[0] : a_off[-1]])


WRITERS = {
    "lz4": dict(compression="lz4"), "zstd": dict(compression="zstd"), "snappy": dict(compression="snappy"),
    "gzip": dict(compression="gzip"), "brotli": dict(compression="brotli"), "none": dict(compression="none"),
    "v2-lz4": dict(compression="lz4", data_page_version="2.0"), "v2-none": dict(compression="none", data_page_version="2.0"),
    "small-pages": dict(compression="zstd", data_page_size=512, write_batch_size=64),
}


@pytest.mark.parametrize("shape", ["k5", "k1", "k0", "ragged"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_pages_read_directly_equal_arrow(tmp_path, shape, writer):
    rng = np.random.default_rng(len(shape) * 31 + len(writer))
    path = tmp_path / "t.parquet"
    pq.write_table(table(lengths_of(shape, rng), rng), path, row_group_size=700, use_dictionary=False, **WRITERS[writer])
    got = direct(path)
    assert all(g is not None for g in got)  # every one of these the direct reader takes
    if shape in ("k5", "k1"):
        assert all(lists.width == int(shape[1]) for g in got for lists in g)  # recognised as uniform
    assert_same_as_arrow(path, got)


@pytest.mark.parametrize("case", ["dictionary", "nullable lists", "null items"])
def test_what_the_direct_reader_leaves_to_arrow(tmp_path, case):
    rng = np.random.default_rng(1)
    t = table(lengths_of("ragged", rng), rng, nullable_lists=case == "nullable lists")
    if case == "null items":
        ids = pa.array([[1, None, 3]] * N, pa.list_(pa.int32()))
        t = t.set_column(0, pa.field("topk_ids", ids.type, nullable=False), ids)
    path = tmp_path / "t.parquet"
    pq.write_table(t, path, use_dictionary=case == "dictionary")
    assert direct(path) == [None]


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_damaged_pages_are_never_read_differently(tmp_path, compression):
    """A damaged top-k page either goes to Arrow or, where the damage leaves it well-formed (a flipped
    value bit), gives what Arrow gives."""
    rng = np.random.default_rng(2)
    path = tmp_path / "t.parquet"
    pq.write_table(table(lengths_of("k5", rng), rng), path, compression=compression, use_dictionary=False)
    good = path.read_bytes()
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start, size = col.data_page_offset, col.total_compressed_size
    for i, at in enumerate(rng.integers(start, start + size, 100)):
        bad = tmp_path / f"bad{i}.parquet"
        data = bytearray(good)
        data[at] ^= 1 << int(rng.integers(0, 8))
        bad.write_bytes(bytes(data))
        got = direct(bad)
        if got != [None]:
            assert_same_as_arrow(bad, got)
