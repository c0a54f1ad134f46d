"""A run directory: manifest.json, cells/*.parquet, summary and report files, and a lock.

The manifest is rewritten atomically after every change, so it is valid at any instant;
records are written atomically by the worker. A lock file names the run holding the
directory, so a second `repaudit run` on it refuses instead of racing.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .files import write_json_atomic

MANIFEST_VERSION = 1


@dataclass
class Manifest:
    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load_or_new(cls, run_dir: Path) -> "Manifest":
        path = run_dir / "manifest.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                raise InputError(f"{path} is not valid JSON; move it away to start a new run here") from None
            if data.get("manifest_version") != MANIFEST_VERSION:
                raise InputError(f"{path}: manifest version {data.get('manifest_version')}, this repaudit writes {MANIFEST_VERSION}")
            return cls(path, data)
        return cls(path, {"manifest_version": MANIFEST_VERSION, "cells": {}, "groups": {}, "runs": []})

    def save(self) -> None:
        self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_json_atomic(self.path, self.data)

    def cell(self, cell_id: str) -> dict[str, Any]:
        return self.data["cells"].setdefault(cell_id, {})

    def set_cell(self, cell_id: str, **fields: Any) -> None:
        self.cell(cell_id).update(fields)
        self.save()


class RunLock:
    """An exclusive flock on RUN_DIR/.lock; released by the kernel if the process dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            self.fd = None
            raise InputError(f"{self.path.parent} is in use by another repaudit run ({holder}); wait for it or use another --out") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def remove_partial_files(run_dir: Path) -> list[Path]:
    """Temporary files of writes that never finished (a killed worker): never valid, always safe to drop."""
    removed = []
    for path in list(run_dir.glob(".*.tmp-*")) + list((run_dir / "cells").glob(".*.tmp-*")):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed
