"""The run directory's guards, without a distributed job: the lock outlives a killed run through
the job it started, workers of an earlier job keep a new run out, and a record is never
written over. tests/test_reliability.py::test_rerun_beside_an_orphaned_job_refuses_and_rewrites_nothing
does the same with a real `repaudit run` SIGKILLed mid-job."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from repaudit.run import worker
from repaudit.engines.base import TokenRows
from repaudit.errors import InputError
from repaudit.run.jobspec import cell_path
from repaudit.run.rundir import RunLock, orphaned_workers


def _wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still alive")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_the_lock_outlives_a_killed_run_through_its_job(tmp_path: Path):
    """A launcher takes the lock, starts a job with the lock's descriptor, and is SIGKILLed: while the
    job lives a new run is refused, naming the job's pid; once it ends, the directory is free."""
    script = (
        "import os, signal, subprocess, sys\n"
        "from pathlib import Path\n"
        "from repaudit.run.rundir import RunLock\n"
        "lock = RunLock(Path(sys.argv[1])).__enter__()\n"
        "job = subprocess.Popen(['sleep', '60'], pass_fds=(lock.fd,), start_new_session=True,\n"
        "                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(job.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    launcher = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert launcher.returncode == -signal.SIGKILL, launcher.stderr
    job = int(launcher.stdout.split()[0])
    try:
        with pytest.raises(InputError) as refused:
            RunLock(tmp_path).__enter__()
        message = str(refused.value)
        assert f"{tmp_path} is in use by a job whose repaudit run is gone (pid " in message
        assert f"pid {job} still runs it" in message and f"(kill {job})" in message
        assert "\n" not in message
    finally:
        os.kill(job, signal.SIGKILL)
    _wait_gone(job)
    with RunLock(tmp_path):  # the job is gone: so is the lock
        pass


def test_a_lock_on_its_way_out_is_waited_for(tmp_path: Path, monkeypatch):
    """The run that wrote the lock is gone and no process shows the file open, yet the flock is
    still held: the last holder is exiting (a job just SIGKILLed). The next run waits for it
    (up to rundir.EXITING_HOLDER_S) instead of refusing with "wait for it to end"."""
    import socket

    from repaudit.run import rundir

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"pid {dead.pid} on {socket.gethostname()}, started 2026-01-01 00:00:00")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(0.6)", str(tmp_path / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(rundir, "_holding", lambda lock: [])  # as while the kernel closes its files
        monkeypatch.setattr(rundir, "EXITING_HOLDER_S", 0.0)
        with pytest.raises(InputError, match="wait for it to end"):
            RunLock(tmp_path).__enter__()
        monkeypatch.setattr(rundir, "EXITING_HOLDER_S", 10.0)
        t0 = time.monotonic()
        with RunLock(tmp_path):
            assert time.monotonic() - t0 < 10
            assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        _stop(holder)


def _events(run_dir: Path, job: str, *pids: int) -> None:
    events = run_dir / "jobs" / "node0" / job
    events.mkdir(parents=True)
    (events / "rank0.jsonl").write_text("".join(json.dumps({"event": "pid", "rank": 0, "t": 0, "pid": p}) + "\n"
                                                for p in pids))


def test_workers_that_outlived_their_job_keep_a_new_run_out(tmp_path: Path):
    """Their torchrun is gone, and with it the lock; the pids the workers reported are checked instead,
    and only a process that is still that job's worker counts (a pid may have been reused)."""
    spec = tmp_path / "jobs" / "node0" / "hf-tp2-default.1.json"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "repaudit.run.worker", str(spec)])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a reused pid
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        _events(tmp_path, "hf-tp2-default.1", orphan.pid, other.pid, dead.pid, os.getpid())
        assert orphaned_workers(tmp_path) == [orphan.pid]
        with pytest.raises(InputError, match=f"worker process\\(es\\) {orphan.pid} of an earlier job still run"):
            RunLock(tmp_path).__enter__()
        _stop(orphan)
        assert orphaned_workers(tmp_path) == []
        with RunLock(tmp_path):
            assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        _stop(orphan)
        _stop(other)


def _rows(logprob: float) -> list[TokenRows]:
    pos = np.array([1, 2], dtype=np.int32)
    return [TokenRows(prompt_id="p", prompt_len=2, pos=pos, token_id=pos, logprob=np.full(2, logprob, np.float32),
                      top1=pos, topk_ids=np.zeros((2, 0), np.int32), topk_logprobs=np.zeros((2, 0), np.float32),
                      digest=None)]


def test_the_worker_never_writes_over_an_existing_record(tmp_path: Path):
    """A second writer of the same cell (a job that outlived its run, racing a new one) fails; the
    record on disk keeps every byte, and no temporary file is left."""
    spec = SimpleNamespace(out_dir=str(tmp_path), probes={"name": "unit"}, model={"id": "m"}, tokenizer={}, topk=0)
    cell = {"id": "hf-tp1-bs1-default-stock-generate"}
    worker._write(spec, cell, _rows(-1.0), {}, None)
    path = cell_path(tmp_path, cell["id"])
    before = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    with pytest.raises(FileExistsError) as exists:
        worker._write(spec, cell, _rows(-2.0), {}, None)
    assert exists.value.filename == str(path)  # the record, not the temporary name
    assert (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns) == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
