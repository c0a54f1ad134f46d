"""Fault injection for the reliability tests: REPAUDIT_FAULT=KIND:CELL_ID[:RANK][,KIND:CELL_ID[:RANK]...].

KIND is one of
- kill: SIGKILL this rank;
- hang: this rank stops; its peers block in the next collective;
- oom: raise torch.OutOfMemoryError;
- raise: raise a RuntimeError;
- abort-once: abort this rank (SIGABRT, as a heap corruption or a C++ terminate does) in the
  run's first job that reaches the cell, and never again: a crash that a retry survives;
- enospc: the cell's record write fails with "No space left on device" once the bytes are
  in the temporary file, before it is renamed into place (the point where a full disk
  usually shows itself: fsync).
kill, hang, oom, raise and abort-once strike after the cell's first batch, so the cell is half done:
collectives have run and rank 0 holds rows it has not written. CELL_ID `load` strikes a
transformers job as its model is ready, before it reports it loaded. Without RANK the fault hits
every rank. Several faults are separated by commas. The variable is read by workers only;
nothing sets it but a test.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path
from typing import Iterator

LOAD_FAULT = "load"  # the CELL_ID of a fault that strikes as the model finishes loading


def _kinds(cell_id: str, rank: int) -> list[str]:
    out = []
    for item in os.environ.get("REPAUDIT_FAULT", "").split(","):
        kind, _, rest = item.strip().partition(":")
        target, _, on_rank = rest.partition(":")
        if target == cell_id and (not on_rank or int(on_rank) == rank):
            out.append(kind)
    return out


def maybe_inject(cell_id: str, rank: int, job_dir: Path) -> None:
    """`job_dir` outlives the job (the launch group's attempts share it): abort-once's mark."""
    for kind in _kinds(cell_id, rank):
        if kind == "abort-once":
            mark = job_dir / f"abort-once.{cell_id}.{rank}"
            if not mark.exists():
                mark.touch()
                os.abort()
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            while True:
                time.sleep(3600)
        elif kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"injected out-of-memory in {cell_id}")
        elif kind == "raise":
            raise RuntimeError(f"injected failure in {cell_id}")


@contextlib.contextmanager
def write_faults(cell_id: str, rank: int) -> Iterator[None]:
    """Around a record write: with an enospc fault, fsync fails as on a full disk."""
    if "enospc" not in _kinds(cell_id, rank):
        yield
        return

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real, os.fsync = os.fsync, fsync
    try:
        yield
    finally:
        os.fsync = real
