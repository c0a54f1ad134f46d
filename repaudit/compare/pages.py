"""Top-k lists read straight from their Parquet pages (see the section comment below), and the
Lists form both this reader and Arrow's give them in."""

from __future__ import annotations

import mmap

from typing import Any

import numpy as np
import pyarrow as pa

from .work import Work


class Lists:
    """A list column's rows as numpy: offsets[i]:offsets[i + 1] are row i's entries in `values`, and
    lengths their difference, except 0 for a null list (not recorded). Lists all of one width w (what
    build_table writes) may come as width=w with no offsets: row i is values[i * w:(i + 1) * w]."""

    __slots__ = ("values", "offsets", "lengths", "width")

    def __init__(self, values: np.ndarray, offsets: np.ndarray | None = None, lengths: np.ndarray | None = None,
                 width: int | None = None):
        self.values, self.offsets, self.lengths, self.width = values, offsets, lengths, width

    def rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, lengths) of rows start..start + n."""
        if self.width is not None:
            offsets = np.arange(start, start + n + 1, dtype=np.int64) * self.width
            return offsets, np.full(n, self.width, np.int64)
        return self.offsets[start : start + n + 1], self.lengths[start : start + n]

# ------------------------------------------------------------------------------------ top-k pages
#
# Arrow turns a list column's repetition and definition levels into list arrays at about 40 ns a row
# (k = 5): ten times the cost of decompressing and copying the values, and most of the diff's time.
# The top-k lists need far less: their values are PLAIN 4-byte patterns at the end of each data page,
# and the levels only say where each row starts. So a row group's two top-k leaf columns are read
# here, page by page, with numpy. Anything this reader does not expect (a dictionary page, another
# encoding or codec, nullable lists, sizes that do not add up, a page it cannot parse) makes it give
# the row group to Arrow, which then reads it (or refuses it) exactly as before: this is a faster
# route to the same values, never a second opinion on a file.

_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "LZ4": "lz4_raw", "ZSTD": "zstd", "BROTLI": "brotli"}
_DIRECT_MAX_BYTES = 256 << 20  # a row group's two top-k columns, decoded; larger ones Arrow streams in batches
_DATA_PAGE, _DATA_PAGE_V2 = 0, 3  # Parquet PageType
_PLAIN, _RLE = 0, 3  # Parquet Encoding


class _NotDirect(Exception):
    """The pages hold something _direct_lists does not read: Arrow reads the row group instead."""


def direct_topk(pf, fd: int, group: int, work: "Work") -> tuple[Lists, Lists] | None:
    """Row group `group`'s top-k ids and logprobs read from their pages, or None: Arrow reads them."""
    meta = pf.metadata
    rg = meta.row_group(group)
    leaves = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    try:
        cols = [leaves[f"{name}.list.element"] for name in ("topk_ids", "topk_logprobs")]
    except KeyError:
        return None
    if sum(rg.column(j).total_uncompressed_size for j in cols) > _DIRECT_MAX_BYTES:
        return None
    try:
        return tuple(_direct_lists(fd, rg.column(j), meta.schema.column(j), rg.num_rows, work) for j in cols)
    except (_NotDirect, LookupError, ValueError, TypeError, RecursionError, OSError, pa.ArrowException):
        return None  # what parsing odd bytes raises


def _direct_lists(fd: int, col, leaf, rows: int, work: "Work") -> Lists:
    """One list<4-byte> leaf column chunk (a required list of optional items, PLAIN values, RLE levels)."""
    if (col.physical_type not in ("INT32", "FLOAT") or col.has_dictionary_page or col.compression not in _CODECS
            or leaf.max_definition_level != 2 or leaf.max_repetition_level != 1):
        raise _NotDirect
    codec = _CODECS[col.compression] and pa.Codec(_CODECS[col.compression])
    raw = _mapped(fd, col.data_page_offset, col.total_compressed_size)
    total = col.num_values  # levels: one per item, and one per empty list
    rep, dfn = work.get("rep", np.uint8, total), work.get("def", np.uint8, total)
    values = work.unshared(np.uint32, total)  # handed on: the chunks are views of it
    at = done = stored = 0
    while done < total:
        header, at = _thrift_struct(raw, at)
        size, unpacked = header.get(3, -1), header.get(2, -1)  # compressed and uncompressed page sizes
        if not (0 <= size <= len(raw) - at and 0 <= unpacked <= col.total_uncompressed_size):
            raise _NotDirect  # (a damaged size could ask for any amount of memory)
        page, at = raw[at : at + size], at + size
        (rep_stream, def_stream), data, count = _page_parts(header, page, codec)
        if not 0 < count <= total - done:
            raise _NotDirect
        _levels(rep_stream, 1, count, rep[done : done + count], work)
        every = _levels(def_stream, 2, count, dfn[done : done + count], work)  # the value of every level, if one
        present = count if every == 2 else 0 if every is not None else int(np.count_nonzero(dfn[done : done + count] == 2))
        if len(data) != 4 * present:
            raise _NotDirect
        values[stored : stored + present] = np.frombuffer(data, np.uint32)
        done, stored = done + count, stored + present
    if at != len(raw):
        raise _NotDirect
    return _level_lists(rep, dfn, values[:stored], rows, work)


def _mapped(fd: int, start: int, size: int) -> memoryview:
    """Bytes start..start + size of the file, mapped: no copy, and no page fault per page as a read into
    fresh memory would have. Mapped per column chunk, so that the process does not go on holding the
    whole file in its RSS: the mapping goes when the last view of it does (not closed explicitly: a view
    still held by an exception's traceback would make close() fail)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page now, not fault by fault
    mapped = mmap.mmap(fd, start + size - base, flags=flags, prot=mmap.PROT_READ, offset=base)  # ValueError past the end
    return memoryview(mapped)[start - base :]


def _page_parts(header: dict, page: memoryview, codec) -> tuple[tuple[memoryview, memoryview], memoryview, int]:
    """A data page's repetition and definition level streams, its PLAIN values, and its number of levels."""
    kind, size = header.get(1), header.get(2)
    if kind == _DATA_PAGE and 5 in header:
        h = header[5]  # DataPageHeader: num_values, encoding, definition / repetition level encodings
        if (h.get(2), h.get(3), h.get(4)) != (_PLAIN, _RLE, _RLE):
            raise _NotDirect
        body = _decompressed(page, codec, size)
        rep_len = int.from_bytes(body[:4], "little")
        def_at = 4 + rep_len
        def_len = int.from_bytes(body[def_at : def_at + 4], "little")
        if def_at + 4 + def_len > len(body):
            raise _NotDirect
        rep, dfn, data = body[4:def_at], body[def_at + 4 : def_at + 4 + def_len], body[def_at + 4 + def_len :]
        count = h[1]
    elif kind == _DATA_PAGE_V2 and 8 in header:
        h = header[8]  # DataPageHeaderV2: levels stored uncompressed before the (maybe compressed) values
        if h.get(4) != _PLAIN:  # (its num_nulls counts empty lists too: the definition levels tell)
            raise _NotDirect
        def_len, rep_len = h[5], h[6]
        if not (0 <= rep_len and 0 <= def_len and rep_len + def_len <= min(len(page), size)):
            raise _NotDirect
        rep, dfn = page[:rep_len], page[rep_len : rep_len + def_len]
        rest = page[rep_len + def_len :]
        data = _decompressed(rest, codec if h.get(7, True) else None, size - rep_len - def_len)
        count = h[1]
    else:
        raise _NotDirect
    return (rep, dfn), data, count


def _decompressed(data: memoryview, codec, size: int) -> memoryview:
    if codec is None:
        if len(data) != size:
            raise _NotDirect
        return data
    out = memoryview(codec.decompress(data, decompressed_size=size)).cast("B")  # Arrow's buffers are signed chars
    if len(out) != size:
        raise _NotDirect
    return out


def _level_lists(rep: np.ndarray, dfn: np.ndarray, values: np.ndarray, rows: int, work: "Work") -> Lists:
    """The rows from the levels: a row starts at repetition level 0; definition level 2 is an item, 0 an
    empty list (1, a null item, Arrow's reading refuses)."""
    total = len(rep)
    if len(values) == total and rows and total % rows == 0:  # every level an item: one width for all?
        width = total // rows  # then a row starts (level 0) every width levels
        uniform = work.tiled(f"rep{width}", np.array([0] + [1] * (width - 1), np.uint8), total)
        if pa.py_buffer(rep).equals(pa.py_buffer(uniform)):  # a memcmp
            return Lists(values, width=width)
    starts = np.flatnonzero(rep == 0)
    if len(starts) != rows or (rows and starts[0] != 0):
        raise _NotDirect
    if len(values) == total:  # offsets are the row starts
        offsets = np.append(starts, total)
    else:
        if (dfn == 1).any() or (dfn > 2).any():
            raise _NotDirect
        before = np.zeros(total + 1, np.int64)  # items before each level
        np.cumsum(dfn == 2, out=before[1:])
        offsets = before[np.append(starts, total)]
    return Lists(values, offsets, np.diff(offsets))


def _levels(stream: memoryview, width: int, count: int, out: np.ndarray, work: "Work") -> int | None:
    """_hybrid, remembering the last stream of each width: pages of lists of one length (k = 5: 20,000
    rows a page as Arrow writes) hold the same level bytes page after page, and the same bytes are the
    same levels."""
    key = bytes(stream)
    last = work.levels.get(width)
    if last is not None and last[0] == count and last[1] == key:
        out[:] = last[2]
        return last[3]
    every = _hybrid(stream, width, count, out)
    work.levels[width] = (count, key, out.copy(), every)
    return every


def _hybrid(stream: memoryview, width: int, count: int, out: np.ndarray) -> int | None:
    """Decode `count` levels of Parquet's RLE / bit-packed hybrid encoding into out; return their value
    when one run holds them all, else None. Arrow writes runs of 504 bit-packed levels with the same
    header, so a stretch of such runs is decoded at once."""
    data = np.frombuffer(stream, np.uint8)
    at = got = 0
    every = None
    while got < count:
        start = at
        header, at = _varint(stream, at)
        if not header & 1:  # RLE: one value (one byte for widths up to 8) repeated header >> 1 times
            take = min(header >> 1, count - got)
            value = stream[at]
            out[got : got + take] = value
            every = value if take == count else None
            at += 1
            got += take
            continue
        if header < 2:
            raise _NotDirect  # a bit-packed run of no groups
        head, block = at - start, at - start + (header >> 1) * width  # bit-packed: groups of 8 levels
        runs = (len(stream) - start) // block
        blocks = data[start : start + runs * block].reshape(runs, block)
        same = (blocks[:, :head] == data[start:at]).all(axis=1)
        runs = min(runs if same.all() else int(np.argmin(same)), -(-(count - got) // (8 * (header >> 1))))
        if runs < 1:
            raise _NotDirect
        levels = _unpack(blocks[:runs, head:], width)
        take = min(len(levels), count - got)
        out[got : got + take] = levels[:take]
        got += take
        at = start + runs * block
    if at > len(stream):
        raise _NotDirect
    return every


def _unpack(packed: np.ndarray, width: int) -> np.ndarray:
    """Bit-packed levels (little-endian bit order, `width` bits each) as uint8."""
    bits = np.unpackbits(packed.reshape(-1), bitorder="little")
    if width == 1:
        return bits
    bits = bits.reshape(-1, width)
    return bits[:, 0] | (bits[:, 1] << 1)


def _varint(buf: memoryview, at: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        byte = buf[at]
        at += 1
        out |= (byte & 0x7F) << shift
        if byte < 0x80:
            return out, at
        shift += 7


def _thrift_struct(buf: memoryview, at: int) -> tuple[dict, int]:
    """A Thrift compact-protocol struct (a page header) as {field id: value}; nested structs as dicts,
    integers as ints; binaries, doubles, lists and maps are skipped (None)."""
    out: dict = {}
    field_id = 0
    while True:
        head = buf[at]
        at += 1
        if head == 0:
            return out, at
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field_id += delta
        else:
            raw, at = _varint(buf, at)
            field_id = (raw >> 1) ^ -(raw & 1)
        out[field_id], at = _thrift_value(buf, at, kind)


def _thrift_value(buf: memoryview, at: int, kind: int) -> tuple[Any, int]:
    if kind in (1, 2):  # booleans hold their value in the type
        return kind == 1, at
    if kind == 3:
        return buf[at], at + 1
    if kind in (4, 5, 6):  # zigzag varints
        raw, at = _varint(buf, at)
        return (raw >> 1) ^ -(raw & 1), at
    if kind == 7:
        return None, at + 8
    if kind == 8:
        size, at = _varint(buf, at)
        return None, at + size
    if kind in (9, 10):  # list, set
        head = buf[at]
        at += 1
        size, item = head >> 4, head & 0x0F
        if size == 15:
            size, at = _varint(buf, at)
        for _ in range(size):
            at = at + 1 if item in (1, 2) else _thrift_value(buf, at, item)[1]
        return None, at
    if kind == 11:  # map
        size, at = _varint(buf, at)
        if size:
            types = buf[at]
            at += 1
            for _ in range(size):
                at = _thrift_value(buf, at, types >> 4)[1]
                at = _thrift_value(buf, at, types & 0x0F)[1]
        return None, at
    if kind == 12:
        return _thrift_struct(buf, at)
    raise _NotDirect
