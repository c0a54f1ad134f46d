"""Atomic file writes: a file is either complete or absent."""

from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# What link() says on a file system without hard links (some FUSE and object-store mounts).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_target(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | os.PathLike, value: Any) -> Path:
    # allow_nan=False: a NaN metric must be a category, never a non-JSON token
    return write_text_atomic(path, json.dumps(value, indent=2, sort_keys=False, allow_nan=False) + "\n")


@contextmanager
def atomic_target(path: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yields the temporary name to write `path` under; once the body returns, the file is synced
    to disk and moved into place. On any failure the temporary file goes and `path` is untouched.

    overwrite=False never replaces an existing `path` (FileExistsError): the file is linked into
    place, which fails atomically where a rename would silently replace."""
    path = Path(path)
    if not path.parent.is_dir():  # say so about the target, not about the hidden temporary name
        raise FileNotFoundError(errno.ENOENT, f"directory {path.parent} does not exist", str(path))
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_into_place(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):
            raise _about_target(exc, tmp, path) from exc
        raise


def _link_into_place(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # Without hard links: look, then rename. Only a writer racing between the two could be
        # replaced, and the run lock keeps a second run's writers out of the directory.
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(tmp)) from None
        os.rename(tmp, path)
    else:
        tmp.unlink()


def _about_target(exc: OSError, tmp: Path, path: Path) -> OSError:
    """The same failure, told about the file the caller named: the temporary name means nothing to
    a user. (pyarrow's errors carry no file name, only a message that quotes the temporary one.)"""
    text = os.strerror(exc.errno) if exc.errno else str(exc).replace(str(tmp), str(path))
    return OSError(exc.errno, text, str(path))  # OSError(errno, ...) is the errno's own subclass


def write_parquet_atomic(path: str | os.PathLike, table) -> Path:
    """A pyarrow table to Parquet, under a temporary name renamed into place once complete."""
    import pyarrow.parquet as pq

    with atomic_target(path) as tmp:
        pq.write_table(table, tmp, compression="lz4")
    return Path(path)
