"""Atomic file writes: a file is either complete or absent."""

from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    if not path.parent.is_dir():  # say so about the target, not about the hidden temporary name
        raise FileNotFoundError(errno.ENOENT, f"directory {path.parent} does not exist", str(path))
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write() names no file: name the target
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | os.PathLike, value: Any) -> Path:
    # allow_nan=False: a NaN metric must be a category, never a non-JSON token
    return write_text_atomic(path, json.dumps(value, indent=2, sort_keys=False, allow_nan=False) + "\n")


@contextmanager
def atomic_target(path: str | os.PathLike) -> Iterator[Path]:
    """Yields the temporary name to write `path` under; once the body returns, the file is synced
    to disk and renamed into place. On any failure the temporary file goes and `path` is untouched."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_parquet_atomic(path: str | os.PathLike, table) -> Path:
    """A pyarrow table to Parquet, under a temporary name renamed into place once complete."""
    import pyarrow.parquet as pq

    with atomic_target(path) as tmp:
        pq.write_table(table, tmp, compression="lz4")
    return Path(path)
