"""Run one launch group as a real distributed job and follow it to the end.

Each attempt is `python -m torch.distributed.run ... -m repaudit.run.worker SPEC` in a new
process session (a vLLM job: `python -m repaudit.run.worker SPEC` alone, see worker_command). The launcher tails the workers' events, enforces the per-cell timeout, and
after any failure starts a new attempt with the cells that are left, so one bad cell never
costs the others. A cell whose job crashed under it (a process aborted or faulted, and no rank
raised an error of its own) runs again in that new attempt, up to `retries` times, and so does
a job that crashed while loading the model: such a crash can be a one-off of the process, not
of the cell. A job is ended by its own process ids (the
torchrun session and every worker pid the workers reported), never by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..files import write_text_atomic
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
    logs: list[Path] = field(default_factory=list)  # each attempt's stdout + stderr (NCCL's debug lines too)
    retried: dict[str, list[str]] = field(default_factory=dict)  # cell -> why each crashed try ended
    job_retried: list[str] = field(default_factory=list)  # why each job that crashed outside any cell ended


class Interrupted(Exception):
    pass


def worker_command(spec_path: Path) -> list[str]:
    """A vLLM job: one plain process, vLLM's driver. Never under torchrun: torchrun sets
    TORCHELASTIC_USE_AGENT_STORE=True, which makes every torch.distributed store a client of
    torchrun's agent, so vLLM's own process group (a tcp:// store it means to host) waits
    forever for a server that does not exist."""
    return [sys.executable, "-m", "repaudit.run.worker", str(spec_path)]


def torchrun_command(spec_path: Path, nproc: int, rdzv: Rendezvous, attempt: int, log_dir: Path) -> list[str]:
    # --log-dir: torchrun's own files go to the run directory, not to a torchelastic_* folder left in /tmp.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.2", f"--log-dir={log_dir}"]
    if rdzv.nnodes == 1:
        cmd += ["--standalone"]
    else:
        # The static rendezvous numbers ranks by --node-rank, so global rank 0 (the one that writes
        # records) is on node 0; c10d's dynamic rendezvous orders nodes by arrival instead.
        host, _, port = rdzv.endpoint.rpartition(":")
        cmd += [f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    return cmd + ["-m", "repaudit.run.worker", str(spec_path)]


_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+).*?traceback\s*:\s*([^\n]*)", re.S)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def killed_rank(log_text: str) -> str | None:
    """'rank R killed by SIGX' when torchrun saw a rank die of a signal it did not send itself.

    Such a death is the cause, whatever its peers reported afterwards (a gloo/NCCL error,
    torchrun's SIGTERM), and torchrun's "root cause" may name a peer when both were seen in
    the same monitor pass. SIGTERM is what torchrun sends to the survivors of a failure, and
    SIGABRT is what a rank sends itself (gloo aborts when a peer that failed first closes the
    connection), so neither counts here.
    """
    return next((f"rank {rank} killed by {_signal_name(sig)}" for rank, sig in signal_deaths(log_text, None)
                 if sig != signal.SIGABRT), None)


# A process's own crash: heap corruption, a C++ terminate, a bad access. SIGKILL is not one (the
# kernel's OOM killer, or a person), nor SIGTERM (torchrun ending the survivors of a failure).
_CRASH_SIGNALS = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}

# What a process prints as it crashes: glibc's heap checks, C++'s terminate, Python's fault handler.
_CRASH_LINE = re.compile(r"^(?:(?:malloc|free|realloc|munmap_chunk|malloc_consolidate)\(\): |double free|corrupted "
                         r"|terminate called|Fatal Python error)[^\n]*", re.M)


def signal_deaths(log_text: str, returncode: int | None) -> list[tuple[str | None, int]]:
    """(rank, signal) of each process of the job that a signal ended, torchrun's SIGTERM to the
    survivors left out; rank None for a vLLM job's one process."""
    tail = log_text[log_text.rfind("Failures:"):] if "Failures:" in log_text else ""
    found = [(m.group(1), -int(m.group(2))) for m in _FAILURE.finditer(tail) if int(m.group(2)) < 0]
    if returncode is not None and returncode < 0:
        found.append((None, -returncode))
    return [(rank, sig) for rank, sig in found if sig != signal.SIGTERM]


def crash_line(log_text: str) -> str | None:
    """The first line in the job's output that says how a process crashed, if one does."""
    m = _CRASH_LINE.search(log_text)
    return m.group(0).strip() if m else None


def crash_reason(log_text: str, returncode: int | None) -> str | None:
    """'rank 1 killed by SIGABRT (malloc(): ...)' where every process that died, died of its own
    crash; None where none did, or where one was killed (its peers' aborts then follow from it)."""
    died = signal_deaths(log_text, returncode)
    if not died or any(sig not in _CRASH_SIGNALS for _, sig in died):
        return None
    who = ", ".join(f"rank {rank} killed by {_signal_name(sig)}" if rank is not None else f"killed by {_signal_name(sig)}"
                    for rank, sig in died)
    said = crash_line(log_text)
    return who + (f" ({said})" if said else "")


def exit_reason(log_text: str, returncode: int | None) -> str:
    """The first failure torchrun observed, in one line."""
    m = _FAILURE.search(log_text.split("Root Cause", 1)[-1]) if "Root Cause" in log_text else None
    if m:
        rank, code, tb = m.group(1), int(m.group(2)), m.group(3).strip()
        if code < 0:
            return f"rank {rank} killed by {_signal_name(-code)}"
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

    ranks: int  # ranks of this job on this node: a cell is done when each has finished it
    pids: set[int] = field(default_factory=set)
    loaded: bool = False
    started: dict[str, float] = field(default_factory=dict)  # cell -> when its first cell_start was seen, in run order
    failure_reason: dict[str, tuple[float, str]] = field(default_factory=dict)  # cell -> (worker time, reason), earliest
    own_failure: set[str] = field(default_factory=set)  # cells some rank failed by itself (not by losing a peer)
    job_failure: str | None = None  # the first failure outside any cell (loading, the set-up's collectives)
    job_failed_itself: bool = False  # some rank's, or the launcher's, own: not a lost peer
    ended_by_us: bool = False  # the launcher ended the job (timeout): no other cell is to blame
    retry: tuple[str | None, str] | None = None  # (cell or None for the whole job, why it ended): it runs again
    done_by: dict[str, dict[int, dict]] = field(default_factory=dict)  # cell -> rank -> its cell_done event

    def current(self, outcome: GroupOutcome) -> str | None:
        """The cell in progress: the first started cell without an outcome. Ranks drift apart
        (rank 0 still writes cell A while rank 1 has started B), so "the last cell_start seen"
        or "nothing since the last cell_done" would blame the wrong cell or none."""
        return next((cid for cid in self.started if cid not in outcome.cells), None)


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
    pass_fds: tuple[int, ...] = (),
    retries: int = 1,
) -> GroupOutcome:
    """Run the spec's cells, re-launching after failures, until each cell has an outcome; a cell
    whose job crashed is tried again, at most `retries` times.
    `pass_fds` go to the job (the run directory's lock: the job holds it as long as it lives)."""
    outcome = GroupOutcome()
    remaining = [c["id"] for c in spec.cells]
    while remaining:
        outcome.attempts += 1
        n = outcome.attempts
        spec.events_dir = str(job_dir / f"{spec.group_id}.{n}")
        # Job files are named by attempt, so a re-run in the same directory reuses the names: a previous
        # run's events (appended to, they would be replayed as this job's: old cell_done, old cell_start) go.
        for old in (Path(spec.events_dir), job_dir / f"{spec.group_id}.{n}.torchrun"):
            shutil.rmtree(old, ignore_errors=True)
        spec.cells = [c for c in spec.cells if c["id"] in remaining]
        spec_path = write_text_atomic(job_dir / f"{spec.group_id}.{n}.json", json.dumps(asdict(spec)))
        log_path = job_dir / f"{spec.group_id}.{n}.log"
        outcome.logs.append(log_path)
        attempt = _Attempt(ranks=nproc)
        known = len(outcome.cells)
        with open(log_path, "wb") as log:
            cmd = (worker_command(spec_path) if spec.engine == "vllm"
                   else torchrun_command(spec_path, nproc, rdzv, n, job_dir / f"{spec.group_id}.{n}.torchrun"))
            proc = subprocess.Popen(cmd,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, pass_fds=pass_fds)
            try:
                _follow(proc, attempt, EventReader(Path(spec.events_dir)), outcome, cell_timeout, load_timeout,
                        on_event, should_stop)
            except BaseException:
                # The caller failed (e.g. the manifest cannot be written: disk full): never leave the job running.
                _kill(proc, attempt.pids)
                raise
        last = _settle(outcome, attempt, remaining, known, log_path, proc.returncode, retries)
        # The cells this attempt settled, as events, before the next attempt starts: the caller acts on
        # final outcomes while the group goes on (a failed reference cell releases the score cells of
        # the next attempt, and of other groups, which wait for its record).
        for cid in list(outcome.cells)[known:]:
            oc = outcome.cells[cid]
            on_event({"event": "cell_settled", "cell": cid, "status": oc.status, "reason": oc.reason})
        if attempt.retry is not None:
            cid, why = attempt.retry
            if cid is None:
                on_event({"event": "job_retry", "group": spec.group_id, "reason": why})
            else:
                on_event({"event": "cell_retry", "cell": cid, "reason": why, "attempt": len(outcome.retried[cid]) + 1})
        if last:
            break
        remaining = [c for c in remaining if c not in outcome.cells]
    return outcome


def _settle(outcome: GroupOutcome, attempt: _Attempt, remaining: list[str], known: int, log_path: Path,
            returncode: int | None, retries: int) -> bool:
    """After an attempt: the outcome of the cell it was running when it ended (or its retry), and
    whether another attempt would be pointless (interrupted, or the job can only end the same way
    again)."""
    if outcome.interrupted:
        return True
    log = log_path.read_text(errors="replace")
    crash = crash_reason(log, returncode)
    current = None if attempt.ended_by_us else attempt.current(outcome)
    if current:
        own = attempt.failure_reason.get(current)
        reason = killed_rank(log) or (own[1] if own else exit_reason(log, returncode))
        # No rank failed by itself, and no process was killed: the job crashed under the cell (the
        # crashed rank, not its peers' lost connections, is the reason), or its peers' links broke.
        if current not in attempt.own_failure and (crash or not signal_deaths(log, returncode)):
            reason = crash or reason
            if len(outcome.retried.get(current, ())) < retries:
                outcome.retried.setdefault(current, []).append(reason)
                attempt.retry = (current, reason)
                return False
        outcome.cells[current] = CellOutcome("failed", reason)
    left = [c for c in remaining if c not in outcome.cells]
    if left and (not attempt.loaded or len(outcome.cells) == known):  # no cell settled: the job failed as a whole
        if crash and not attempt.job_failed_itself and not attempt.ended_by_us and len(outcome.job_retried) < retries:
            # A crash while loading, or between cells: the job's, not a cell's.
            outcome.job_retried.append(crash)
            attempt.retry = (None, crash)
            return False
        # A failed load, or a job that ran no cell, would end the same way again.
        why = exit_reason(log, returncode)
        reason = ((attempt.job_failure if attempt.job_failed_itself else None) or killed_rank(log) or crash
                  or attempt.job_failure
                  or (f"model load failed: {why}" if not attempt.loaded else f"the job ended without running this cell ({why})"))
        for cid in left:
            outcome.cells[cid] = CellOutcome("failed", reason)
        return True
    return False


def _apply(ev: dict, attempt: _Attempt, outcome: GroupOutcome) -> None:
    kind, cid = ev["event"], ev.get("cell")
    if kind == "pid":
        attempt.pids.add(int(ev["pid"]))
    elif kind == "loaded" and not attempt.loaded:
        attempt.loaded = True
        outcome.load_seconds.append(float(ev["seconds"]))
    elif kind == "cell_start":
        attempt.started.setdefault(cid, time.monotonic())
    elif kind == "cell_skip":
        outcome.cells.setdefault(cid, CellOutcome("skipped"))
    elif kind == "cell_done" and cid not in outcome.cells:
        # Done when every rank is: rank 1 finishing says nothing about rank 0 writing the record.
        done = attempt.done_by.setdefault(cid, {})
        done[int(ev["rank"])] = ev
        if len(done) >= attempt.ranks:
            ev = done[min(done)]
            outcome.cells[cid] = CellOutcome("done", seconds=ev["seconds"], rows=ev["rows"], timing=ev["timing"],
                                             ranks_differ=ev["ranks_differ"])
    elif kind == "cell_failed":
        # The first rank to fail is the cause; its peers' errors (a broken collective) are consequences.
        if cid not in attempt.failure_reason or ev["t"] < attempt.failure_reason[cid][0]:
            attempt.failure_reason[cid] = (ev["t"], ev["reason"])
        if not ev.get("peer_lost"):
            attempt.own_failure.add(cid)
    elif kind == "job_failed":
        attempt.job_failure = attempt.job_failure or ev["reason"]
        attempt.job_failed_itself |= not ev.get("peer_lost")


def _follow(proc: subprocess.Popen, attempt: _Attempt, reader: EventReader, outcome: GroupOutcome, cell_timeout: float,
            load_timeout: float, on_event: Callable[[dict], None], should_stop: Callable[[], bool]) -> _Attempt:
    started_at = time.monotonic()
    while True:
        exited = proc.poll() is not None
        for ev in reader.poll():  # after an exit this drains what the workers wrote last
            _apply(ev, attempt, outcome)
            on_event(ev)
        if exited:
            return attempt
        now = time.monotonic()
        current = attempt.current(outcome)
        if should_stop():
            _kill(proc, attempt.pids)
            outcome.interrupted = True
            if current:
                outcome.cells[current] = CellOutcome("interrupted", "stopped by the user")
            return attempt
        if current and now - attempt.started[current] > cell_timeout:
            _kill(proc, attempt.pids)
            # The cells after it go on in a new job (run_group relaunches what is left).
            outcome.cells[current] = CellOutcome("timeout", f"no result within --timeout {cell_timeout:g}s; job ended")
            attempt.ended_by_us = True
            return attempt
        if not attempt.loaded and not current and now - started_at > load_timeout:
            _kill(proc, attempt.pids)
            attempt.job_failure = f"model load did not finish within {load_timeout:g}s"
            attempt.job_failed_itself = True
            return attempt
        time.sleep(POLL_S)
