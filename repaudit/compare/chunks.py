"""Reading a record as validated chunks of numpy arrays, in canonical order, one thread per file."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from ..errors import InputError
from .pages import Lists, direct_topk
from .work import Work


# ------------------------------------------------------------------------------------ reading

_FLAT_COLUMNS = ["prompt_id", "pos", "phase", "token_id", "logprob", "top1_id", "row_digest"]
_COLUMNS = _FLAT_COLUMNS + ["topk_ids", "topk_logprobs"]
_NOT_NULL = ("prompt_id", "pos", "token_id", "logprob", "top1_id")
INF_BITS = 0x7F800000  # magnitude bits of inf; a larger magnitude is a NaN


def _values(arr: pa.Array, dtype: Any) -> np.ndarray:
    """Read-only numpy view of a primitive Arrow array's values, without a copy. (Array.to_numpy
    would do too, but it imports pandas: a third of a second of start-up.)"""
    buf = arr.buffers()[1]
    if buf is None or not len(arr):
        return np.empty(0, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def _validity(arr: pa.Array) -> np.ndarray:
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return np.ones(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=arr.offset + len(arr), bitorder="little")
    return bits[arr.offset :].astype(bool)


def _run_bounds(rank: np.ndarray) -> np.ndarray:
    """Start of each run of equal values in a sorted array, then its length (int64)."""
    chg = np.flatnonzero(rank[1:] != rank[:-1])
    bounds = np.empty(len(chg) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, len(rank)
    np.add(chg, 1, out=bounds[1:-1])
    return bounds if len(rank) else bounds[:1]


def _ordered_runs(rank: np.ndarray, pos: np.ndarray, work: "Work") -> np.ndarray | None:
    """Run bounds of `rank` (see _run_bounds) when the rows are strictly increasing in (rank, pos),
    else None. Comparisons only, on the int32 columns: no int64 key, no overflow."""
    n = len(rank)
    if n == 1:
        return np.array([0, 1], dtype=np.int64)
    step = work.get("step", bool, n - 1)
    chg = np.flatnonzero(np.not_equal(rank[1:], rank[:-1], out=step))  # row i ends a run
    if len(chg) and not (rank[chg + 1] > rank[chg]).all():
        return None
    back = np.flatnonzero(np.less_equal(pos[1:], pos[:-1], out=step))  # allowed only where a new prompt starts
    if len(back):
        if len(back) > len(chg):
            return None
        at = np.searchsorted(chg, back)
        if at[-1] >= len(chg) or not (chg[at] == back).all():
            return None
    bounds = np.empty(len(chg) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, n
    np.add(chg, 1, out=bounds[1:-1])
    return bounds


class Chunk:
    """Consecutive rows of one record, in canonical order, as numpy arrays (views of Arrow memory)."""

    __slots__ = ("rank", "pos", "token", "bits", "digest", "digest_ok", "top1", "topk_ids", "topk_bits", "topk_len",
                 "phase", "prompt_phase", "_bounds", "_key")

    def __init__(self, rank: np.ndarray, pos: np.ndarray, token: np.ndarray, bits: np.ndarray,
                 digest: np.ndarray | None, digest_ok: np.ndarray | None, top1: np.ndarray,
                 topk_ids: np.ndarray, topk_bits: np.ndarray, topk_len: np.ndarray | None,
                 phase: np.ndarray | None = None, prompt_phase: np.ndarray | None = None,
                 bounds: np.ndarray | None = None, key: np.ndarray | None = None):
        self.rank = rank  # int32: index of the prompt in the sorted union of both records' prompts
        self.pos = pos  # int32, >= 0, strictly increasing within a prompt
        self.token = token  # int32
        self.bits = bits  # uint32 logprob bit patterns
        self.digest = digest  # uint64, or None when no row has one
        self.digest_ok = digest_ok  # bool; None means every digest is valid
        self.top1 = top1  # int32, -1 where not recorded
        self.topk_ids = topk_ids  # int32 (rows, w); w = 0 when no row has a top-k list
        self.topk_bits = topk_bits  # uint32 (rows, w): the top-k logprobs' bit patterns
        self.topk_len = topk_len  # int32 entries per row (the rest is zero padding), or None: every row has w
        # int8 phase codes and, per code, whether it is "prompt"; None when the record has no prompt
        # rows. Only rows one side lacks read them (prompt_rows), so the aligned path never does.
        self.phase = phase
        self.prompt_phase = prompt_phase
        self._bounds = bounds
        self._key = key

    def __len__(self) -> int:
        return len(self.pos)

    @property
    def bounds(self) -> np.ndarray:
        """Start of each prompt's run of rows, then len(self)."""
        if self._bounds is None:
            self._bounds = _run_bounds(self.rank)
        return self._bounds

    @property
    def key(self) -> np.ndarray:
        """int64 rank << 32 | pos, strictly increasing; only the general merge needs it."""
        if self._key is None:
            key = self.rank.astype(np.int64)
            key <<= 32
            key |= self.pos
            self._key = key
        return self._key

    def take(self, sl: slice | np.ndarray) -> "Chunk":
        pick = lambda x: None if x is None else x[sl]  # noqa: E731
        return Chunk(self.rank[sl], self.pos[sl], self.token[sl], self.bits[sl], pick(self.digest),
                      pick(self.digest_ok), self.top1[sl], self.topk_ids[sl], self.topk_bits[sl], pick(self.topk_len),
                      pick(self.phase), self.prompt_phase, key=pick(self._key))

    def prompt_rows(self, sel: np.ndarray) -> np.ndarray | None:
        """Whether the rows `sel` are prompt rows; None when none of this record's rows is."""
        return None if self.phase is None else self.prompt_phase[self.phase[sel]]

    def topk_rows(self) -> np.ndarray | None:
        """Which rows hold a top-k list: None when every row does."""
        if not self.topk_ids.shape[1]:
            return np.zeros(len(self), dtype=bool)
        return None if self.topk_len is None else self.topk_len > 0


def same_keys(a: Chunk, b: Chunk) -> bool:
    """Do two chunks hold exactly the same (prompt, pos) rows? Usually decided per prompt run, not per row."""
    n = len(a)
    if n != len(b) or not n:
        return False
    ba, bb = a.bounds, b.bounds
    if len(ba) != len(bb) or not np.array_equal(ba, bb):
        return False
    starts, last = ba[:-1], ba[1:] - 1
    if not np.array_equal(a.rank[starts], b.rank[starts]):
        return False  # rank is constant over each run, so now a.rank == b.rank
    pa_, pb_ = a.pos, b.pos
    if np.array_equal(pa_[starts], pb_[starts]) and np.array_equal(pa_[last], pb_[last]):
        # Positions strictly increase within a run: a run whose last - first == length - 1 is
        # exactly first..last, in both chunks.
        if np.array_equal(pa_[last].astype(np.int64) - pa_[starts], last - starts):
            return True
    return np.array_equal(pa_, pb_)


def _refuse_rows(path: Path, dictionary: pa.Array, indices: np.ndarray, rank: np.ndarray, pos: np.ndarray,
                 last: int, n_ranks: int) -> None:
    """The batch broke a rule (checked cheaply by the caller): say which one, as the first bad row."""
    ranks = rank.astype(np.int64)
    if ranks.min() < 0 or ranks.max() >= n_ranks or pos.min() < 0:
        raise InputError(f"{path}: rows name prompts missing from the metadata, or negative positions")
    key = (ranks << 32) | pos
    i = int(np.argmax(np.diff(key, prepend=np.int64(last)) <= 0))
    raise InputError(
        f"{path}: duplicate or out-of-order row at prompt {dictionary[int(indices[i])].as_py()!r} "
        f"pos {int(pos[i])} (records must be sorted by (prompt_id, pos) with no duplicates)"
    )


def _batches(pf, fd: int, path: Path, batch_rows: int, work: "Work",
             read_phase: bool) -> Iterator[tuple[pa.RecordBatch, "Lists", "Lists", int]]:
    """(batch, its top-k ids, its top-k logprobs, where the batch starts in those lists), in batches of
    at most batch_rows rows, one row group at a time: a row group that fits in a batch is read whole, a
    larger one streamed in batches. (iter_batches over the whole file would hold far more of it in
    memory.) The top-k lists of a row group are read from its pages directly when `_direct_lists` can
    (10x faster than Arrow assembling list arrays), else by Arrow with the other columns."""
    meta = pf.metadata
    for i in range(meta.num_row_groups):
        lists = direct_topk(pf, fd, i, work)
        columns = _FLAT_COLUMNS if lists else _COLUMNS
        if not read_phase:
            columns = [c for c in columns if c != "phase"]
        if meta.row_group(i).num_rows <= batch_rows:
            batches = pf.read_row_group(i, columns=columns, use_threads=True).to_batches()
        else:
            batches = pf.iter_batches(batch_size=batch_rows, row_groups=[i], columns=columns, use_threads=True)
        start = 0
        for batch in batches:
            if lists:
                yield batch, lists[0], lists[1], start
            else:
                ids, lps = (_arrow_lists(batch.column(c), path) for c in ("topk_ids", "topk_logprobs"))
                yield batch, ids, lps, 0
            start += batch.num_rows


def read_chunks(pf, path: Path, rank_of: dict[str, int], rows_per_prompt: np.ndarray,
                 batch_rows: int, read_phase: bool = True) -> Iterator[Chunk]:
    """Batches of one record as _Chunks, validated: canonical order, known prompts, pos >= 0.
    read_phase=False: the record holds no prompt rows (its footer says so), and its phase column
    is not read."""
    work = Work()  # this thread's own
    with open(path, "rb") as file:  # for the top-k pages
        yield from _validated_chunks(pf, file.fileno(), path, rank_of, rows_per_prompt, batch_rows, work, read_phase)


def _validated_chunks(pf, fd: int, path: Path, rank_of: dict[str, int], rows_per_prompt: np.ndarray,
                      batch_rows: int, work: "Work", read_phase: bool) -> Iterator[Chunk]:
    last = -1  # key of the previous batch's last row
    dictionary, lut, identity = None, None, False
    phases, prompt_phase = None, np.zeros(0, bool)
    for batch, topk_ids_lists, topk_lp_lists, start in _batches(pf, fd, path, batch_rows, work, read_phase):
        n = batch.num_rows
        if not n:
            continue
        for name in _NOT_NULL:
            if batch.column(name).null_count:
                raise InputError(f"{path}: corrupt data: nulls in column {name!r}")
        ids = batch.column("prompt_id")
        if dictionary is None or not ids.dictionary.equals(dictionary):
            dictionary = ids.dictionary
            lut = np.array([rank_of.get(v, -1) for v in dictionary.to_pylist()], dtype=np.int32)
            identity = bool(np.array_equal(lut, np.arange(len(lut), dtype=np.int32)))
        indices = _values(ids.indices, np.int32)
        pos = _values(batch.column("pos"), np.int32)
        if identity:  # the file's dictionary is the sorted union itself: ranks are the indices
            rank, n_ranks = indices, len(lut)
        else:
            if indices.min() < 0 or indices.max() >= len(lut):
                _refuse_rows(path, dictionary, indices, indices, pos, last, len(lut))
            rank, n_ranks = lut[indices], len(rank_of)
        bounds = _ordered_runs(rank, pos, work)
        # Sorted, so the smallest rank is the first and the smallest pos starts a run.
        if (bounds is None or rank[0] < 0 or rank[-1] >= n_ranks or pos[bounds[:-1]].min() < 0
                or (int(rank[0]) << 32 | int(pos[0])) <= last):
            _refuse_rows(path, dictionary, indices, rank, pos, last, n_ranks)
        last = int(rank[-1]) << 32 | int(pos[-1])
        rows_per_prompt[rank[bounds[:-1]]] += np.diff(bounds)
        dig = batch.column("row_digest")
        if dig.null_count == n:
            digest = digest_ok = None
        else:
            digest = _values(dig, np.uint64)  # under a null: whatever the buffer holds, masked by digest_ok
            digest_ok = _validity(dig) if dig.null_count else None
        topk_ids, topk_bits, topk_len = _topk(topk_ids_lists, topk_lp_lists, start, n, path)
        phase = batch.column("phase") if read_phase else None
        if phase is not None and phase.null_count:
            raise InputError(f"{path}: corrupt data: nulls in column 'phase'")
        if phase is not None and (phases is None or not phase.dictionary.equals(phases)):
            phases = phase.dictionary
            prompt_phase = np.array([v == "prompt" for v in phases.to_pylist()], dtype=bool)
        yield Chunk(
            rank=rank, pos=pos,
            token=_values(batch.column("token_id"), np.int32),
            bits=_values(batch.column("logprob"), np.uint32),
            digest=digest, digest_ok=digest_ok,
            top1=_values(batch.column("top1_id"), np.int32),
            topk_ids=topk_ids, topk_bits=topk_bits, topk_len=topk_len,
            phase=_values(phase.indices, np.int8) if phase is not None and prompt_phase.any() else None,
            prompt_phase=prompt_phase,
            bounds=bounds,
        )


def _arrow_lists(arr: pa.ListArray, path: Path) -> Lists:
    """Views of an Arrow list array (values as raw 4-byte patterns); refuses nulls inside the lists."""
    if arr.values.null_count:
        raise InputError(f"{path}: corrupt data: nulls inside the top-k lists")
    offsets = _values(arr.offsets, np.int32)
    lengths = np.diff(offsets)
    if arr.null_count:
        lengths[~_validity(arr)] = 0
    return Lists(_values(arr.values, np.uint32), offsets, lengths)


def _topk(ids: Lists, lps: Lists, start: int, n: int, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows start..start + n of the top-k lists as (rows, w) arrays of ids and logprob bit patterns: views
    when every row holds w entries (what build_table writes), else zero-padded copies with each row's length."""
    vi, vl = ids.values.view(np.int32), lps.values.view(np.uint32)
    w = ids.width
    if w is not None and w == lps.width:  # known uniform from the levels: no per-row lengths to check
        return vi[start * w : (start + n) * w].reshape(n, w), vl[start * w : (start + n) * w].reshape(n, w), None
    off_i, lengths = ids.rows(start, n)
    off_l, lengths_l = lps.rows(start, n)
    if len(lengths) != n or not np.array_equal(lengths, lengths_l):
        raise InputError(f"{path}: corrupt data: topk_ids and topk_logprobs lists differ in length")
    w = int(lengths.max()) if n else 0
    if (lengths == w).all():
        i0, l0 = int(off_i[0]), int(off_l[0])
        return vi[i0 : i0 + n * w].reshape(n, w), vl[l0 : l0 + n * w].reshape(n, w), None
    held = np.arange(w) < lengths[:, None]
    out_i, out_l = np.zeros((n, w), np.int32), np.zeros((n, w), np.uint32)
    out_i[held] = vi[(off_i[:-1, None] + np.arange(w))[held]]
    out_l[held] = vl[(off_l[:-1, None] + np.arange(w))[held]]
    return out_i, out_l, lengths.astype(np.int32)


def prefetched(chunks: Iterator[Chunk], path: Path, depth: int = 4) -> Iterator[Chunk]:
    """Decode and validate the next batches in a thread while the caller compares: Parquet
    decoding and numpy both release the GIL, so the two files and the comparison share the cores.
    The top-k lists of a row group (4 batches as written) are decoded at once: `depth` batches
    queued keep the comparison going meanwhile."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        q.put(("chunk", chunk), timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            q.put(("end", None))
        except (pa.ArrowException, OSError) as exc:
            q.put(("error", InputError(f"{path}: corrupt data: {str(exc).strip().splitlines()[0]}")))
        except BaseException as exc:  # InputError and bugs alike surface in the caller
            q.put(("error", exc))

    thread = threading.Thread(target=work, daemon=True, name=f"read {path.name}")
    thread.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
