"""A run directory: manifest.json, cells/*.parquet, summary and report files, and a lock.

The manifest is rewritten atomically after every change, so it is valid at any instant;
records are written atomically by the worker, never over an existing one. A lock, held by
the run and by every job it starts, keeps a second `repaudit run` out of the directory: it
refuses, naming the process that holds it, instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..files import write_json_atomic
from .events import EventReader

MANIFEST_VERSION = 1


@dataclass
class ManifestData:
    """manifest.json, key for key. The run writes it and gate, summary and report read it, all
    through this class: from_json(to_json()) gives it back unchanged. A cell's entry is the dict
    the run keeps for it (status, reason, settings, file, and its numbers once done)."""

    manifest_version: int = MANIFEST_VERSION
    command: list[str] = field(default_factory=list)
    matrix: dict[str, Any] = field(default_factory=dict)  # run.plan.Matrix.to_manifest(), plus "groups"
    baseline: str | None = None
    reference_cell: str | None = None
    probes: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float | None = None
    updated: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as they were

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **out}

    @classmethod
    def from_json(cls, data: Any, where: Path | str = "manifest") -> "ManifestData":
        if not isinstance(data, dict):
            raise InputError(f"{where}: not a JSON object")
        names = {f.name for f in fields(cls)} - {"extra"}
        for key, kind in (("command", list), ("matrix", dict), ("probes", dict), ("model", dict), ("tokenizer", dict),
                          ("environment", dict), ("runs", list), ("cells", dict), ("groups", dict)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise InputError(f"{where}: {key!r} must be a JSON {'object' if kind is dict else 'array'}")
        known = {k: v for k, v in data.items() if k in names and v is not None}
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})


@dataclass
class Manifest:
    path: Path
    data: ManifestData = field(default_factory=ManifestData)

    @classmethod
    def load_or_new(cls, run_dir: Path) -> "Manifest":
        path = run_dir / "manifest.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                raise InputError(f"{path} is not valid JSON; move it away to start a new run here") from None
            version = data.get("manifest_version") if isinstance(data, dict) else None
            if version != MANIFEST_VERSION:
                raise InputError(f"{path}: manifest version {version}, this repaudit writes {MANIFEST_VERSION}")
            return cls(path, ManifestData.from_json(data, path))
        return cls(path)

    def save(self) -> None:
        self.data.updated = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_json_atomic(self.path, self.data.to_json())

    def cell(self, cell_id: str) -> dict[str, Any]:
        return self.data.cells.setdefault(cell_id, {})

    def set_cell(self, cell_id: str, **fields: Any) -> None:
        self.cell(cell_id).update(fields)
        self.save()


class RunLock:
    """An exclusive flock on RUN_DIR/.lock, held while the run or any job it started lives.

    A flock belongs to the open file, not to a process: it stays held while any process keeps a
    copy of the descriptor. The launcher hands `fd` to every job it starts (Popen's pass_fds), so
    a job that outlives its run (`repaudit run` SIGKILLed: torchrun and its workers go on) still
    keeps a second run out of the directory. Workers that outlived their torchrun too hold no
    copy; their pids, which they report first thing, are checked instead."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + EXITING_HOLDER_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.read(self.fd, 4096).decode(errors="replace").strip()
                os.lseek(self.fd, 0, os.SEEK_SET)
                # The run that wrote the lock is gone and no process we can see has the file open:
                # the last copy is being closed by a process on its way out (a job just killed).
                if _exiting(self.path, holder) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                self._close()
                raise InputError(_busy(self.path, holder)) from None
        orphans = orphaned_workers(self.path.parent)
        if orphans:
            self.__exit__()
            pids = " ".join(map(str, orphans))
            raise InputError(f"{self.path.parent}: worker process(es) {pids} of an earlier job still run, though the "
                             f"repaudit run and torchrun that started them are gone; end them (kill {pids}), then run again")
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self._close()

    def _close(self) -> None:
        os.close(self.fd)
        self.fd = None


def _busy(lock: Path, holder: str) -> str:
    """Why the lock is taken, in one line: a run, or (its launcher dead) a job it left running."""
    m = re.match(r"pid (\d+) on (\S+),", holder)
    if m and m.group(2) == socket.gethostname() and not _running(int(m.group(1))):
        pids = " ".join(map(str, _holding(lock)))
        still = f"pid {pids} still runs it; wait for it to end or end it (kill {pids})" if pids else "wait for it to end"
        return f"{lock.parent} is in use by a job whose repaudit run is gone ({holder}): {still}, then run again"
    return f"{lock.parent} is in use by another repaudit run ({holder or 'another process'}); wait for it or use another --out"


EXITING_HOLDER_S = 3.0  # how long a lock held by no visible process may take to come free


def _exiting(lock: Path, holder: str) -> bool:
    m = re.match(r"pid (\d+) on (\S+),", holder)
    others = [p for p in _holding(lock) if p != os.getpid()]  # this process has it open to lock it
    return bool(m and m.group(2) == socket.gethostname() and not _running(int(m.group(1))) and not others)


def _running(pid: int) -> bool:
    """Alive and not a zombie (Linux: /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _holding(path: Path) -> list[int]:
    """Processes with `path` open (those we may look at)."""
    target = str(path.resolve())
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                pids.append(int(fd_dir.parent.name))
    return sorted(pids)


def orphaned_workers(run_dir: Path) -> list[int]:
    """Workers of earlier jobs in this directory that still run, from the pids they reported."""
    pids: set[int] = set()
    for events in (run_dir / "jobs").glob("node*/*"):  # EventReader reads directories, and nothing for a file
        reported = {int(ev["pid"]) for ev in EventReader(events).poll() if ev["event"] == "pid"}
        pids.update(p for p in reported if _running(p) and _runs_spec(p, f"{events.name}.json"))
    return sorted(pids)


def _runs_spec(pid: int, spec_name: str) -> bool:
    """The process is still that job's worker: a pid may have been reused since."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return "repaudit.run.worker" in cmdline and any(arg.endswith(spec_name) for arg in cmdline)


def remove_partial_files(run_dir: Path) -> list[Path]:
    """Temporary files of writes that never finished (a killed worker): never valid, always safe to drop."""
    removed = []
    for path in list(run_dir.glob(".*.tmp-*")) + list((run_dir / "cells").glob(".*.tmp-*")):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed
