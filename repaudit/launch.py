"""Run one launch group as a real distributed job and follow it to the end.

Each attempt is `python -m torch.distributed.run ... -m repaudit.worker SPEC` in a new
process session. The launcher tails the workers' events, enforces the per-cell timeout, and
after any failure starts a new attempt with the cells that are left, so one bad cell never
costs the others. A job is ended by its own process ids (the torchrun session and every
worker pid the workers reported), never by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .events import EventReader
from .jobspec import JobSpec

POLL_S = 0.2
KILL_GRACE_S = 5.0


@dataclass
class Rendezvous:
    """How the job's ranks find each other. The default is one node, on localhost."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None  # host:port of node 0, for several nodes
    run_id: str = "repaudit"


@dataclass
class CellOutcome:
    status: str  # done | skipped | failed | timeout | interrupted
    reason: str | None = None
    seconds: float | None = None
    rows: int | None = None
    timing: dict | None = None
    ranks_differ: int | None = None


@dataclass
class GroupOutcome:
    cells: dict[str, CellOutcome] = field(default_factory=dict)
    load_seconds: list[float] = field(default_factory=list)
    attempts: int = 0
    interrupted: bool = False


class Interrupted(Exception):
    pass


def torchrun_command(spec_path: Path, nproc: int, rdzv: Rendezvous, attempt: int, log_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.2"]
    if rdzv.nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += [f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}-{spec_path.stem}-{attempt}"]
    return cmd + ["-m", "repaudit.worker", str(spec_path)]


_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+).*?traceback\s*:\s*([^\n]*)", re.S)


def exit_reason(log_text: str, returncode: int | None) -> str:
    """The first failure torchrun observed, in one line."""
    m = _ROOT_CAUSE.search(log_text.split("Root Cause", 1)[-1]) if "Root Cause" in log_text else None
    if m:
        rank, code, tb = m.group(1), int(m.group(2)), m.group(3).strip()
        if code < 0:
            try:
                return f"rank {rank} killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"rank {rank} killed by signal {-code}"
        detail = "" if tb.startswith("To enable") else f": {tb}"
        return f"rank {rank} exited with code {code}{detail}"
    return f"job exited with code {returncode}"


def _kill(proc: subprocess.Popen, pids: set[int]) -> None:
    """End the job: SIGTERM to the torchrun session and every worker, then SIGKILL what is left."""
    targets = set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            alive = {p for p in targets if _alive(p)}
            if proc.poll() is not None and not alive:
                return
            time.sleep(0.05)
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes; /proc tells them apart.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class _Attempt:
    """What one torchrun job told us before it ended."""

    pids: set[int] = field(default_factory=set)
    loaded: bool = False
    current: str | None = None  # the cell in progress
    current_since: float | None = None
    failure_reason: dict[str, str] = field(default_factory=dict)
    job_failure: str | None = None


def run_group(
    spec: JobSpec,
    job_dir: Path,
    *,
    nproc: int,
    rdzv: Rendezvous,
    cell_timeout: float,
    load_timeout: float,
    env: dict[str, str],
    on_event: Callable[[dict], None],
    should_stop: Callable[[], bool],
) -> GroupOutcome:
    """Run the spec's cells, re-launching after failures, until each cell has an outcome."""
    outcome = GroupOutcome()
    remaining = [c["id"] for c in spec.cells]
    while remaining:
        outcome.attempts += 1
        n = outcome.attempts
        spec.events_dir = str(job_dir / f"{spec.group_id}.{n}")
        spec.cells = [c for c in spec.cells if c["id"] in remaining]
        spec_path = spec.write(job_dir / f"{spec.group_id}.{n}.json")
        log_path = job_dir / f"{spec.group_id}.{n}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(torchrun_command(spec_path, nproc, rdzv, n, job_dir), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            attempt = _follow(proc, EventReader(Path(spec.events_dir)), outcome, cell_timeout, load_timeout,
                              on_event, should_stop)
        if outcome.interrupted:
            break
        why = lambda: exit_reason(log_path.read_text(errors="replace"), proc.returncode)  # noqa: E731
        left = [c for c in remaining if c not in outcome.cells]
        if left and not attempt.loaded:
            # Died before the model was ready: every remaining cell shares that fate, and a retry would repeat it.
            reason = attempt.job_failure or f"model load failed: {why()}"
            for cid in left:
                outcome.cells[cid] = CellOutcome("failed", reason)
            break
        if attempt.current and attempt.current not in outcome.cells:
            outcome.cells[attempt.current] = CellOutcome("failed", attempt.failure_reason.get(attempt.current) or why())
        remaining = [c for c in remaining if c not in outcome.cells]
        if remaining and not attempt.current:
            reason = attempt.job_failure or f"the job ended without running this cell ({why()})"
            for cid in remaining:
                outcome.cells[cid] = CellOutcome("failed", reason)
            break
    return outcome


def _apply(ev: dict, attempt: _Attempt, outcome: GroupOutcome) -> None:
    kind, cid = ev["event"], ev.get("cell")
    if kind == "pid":
        attempt.pids.add(int(ev["pid"]))
    elif kind == "loaded" and not attempt.loaded:
        attempt.loaded = True
        outcome.load_seconds.append(float(ev["seconds"]))
    elif kind == "cell_start":
        attempt.current, attempt.current_since = cid, time.monotonic()
    elif kind == "cell_skip":
        outcome.cells.setdefault(cid, CellOutcome("skipped"))
    elif kind == "cell_done" and cid not in outcome.cells:
        outcome.cells[cid] = CellOutcome("done", seconds=ev["seconds"], rows=ev["rows"], timing=ev["timing"],
                                         ranks_differ=ev["ranks_differ"])
        attempt.current = None
    elif kind == "cell_failed":
        attempt.failure_reason.setdefault(cid, ev["reason"])
    elif kind == "job_failed":
        attempt.job_failure = attempt.job_failure or ev["reason"]


def _follow(proc: subprocess.Popen, reader: EventReader, outcome: GroupOutcome, cell_timeout: float,
            load_timeout: float, on_event: Callable[[dict], None], should_stop: Callable[[], bool]) -> _Attempt:
    attempt = _Attempt()
    started_at = time.monotonic()
    while True:
        exited = proc.poll() is not None
        for ev in reader.poll():  # after an exit this drains what the workers wrote last
            _apply(ev, attempt, outcome)
            on_event(ev)
        if exited:
            return attempt
        now = time.monotonic()
        if should_stop():
            _kill(proc, attempt.pids)
            outcome.interrupted = True
            if attempt.current:
                outcome.cells[attempt.current] = CellOutcome("interrupted", "stopped by the user")
            return attempt
        if attempt.current and now - attempt.current_since > cell_timeout:
            _kill(proc, attempt.pids)
            outcome.cells[attempt.current] = CellOutcome("timeout", f"no result within --timeout {cell_timeout:g}s; job ended")
            attempt.current = None
            return attempt
        if not attempt.loaded and not attempt.current and now - started_at > load_timeout:
            _kill(proc, attempt.pids)
            attempt.job_failure = f"model load did not finish within {load_timeout:g}s"
            return attempt
        time.sleep(POLL_S)
