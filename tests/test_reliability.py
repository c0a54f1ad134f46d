"""Faults `repaudit run` must survive, each injected for real on CPU with gloo.

Distributed jobs cost ~10 s each to start here, so one module-scoped run carries several
faults at once (REPAUDIT_FAULT takes a comma-separated list, each aimed at one cell), and
each test asserts on the cell its fault hit. docs/reliability.md lists what each test proves.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from repaudit import cli
from repaudit.run import runner as run_mod
from repaudit.run.rundir import Manifest

pytestmark = pytest.mark.slow

BASE = ["run", "--model", "builtin:tiny-qwen3", "--device", "cpu", "--probes", "smoke", "--mode", "generate", "--kernels", "stock",
        "--max-new-tokens", "4"]


def cid(tp: int, bs: int) -> str:
    return f"hf-tp{tp}-bs{bs}-default-stock-generate"


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def records(out: Path) -> dict[str, tuple[str, int]]:
    """cell id -> (sha256, mtime_ns) of every record in the run."""
    return {p.stem: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted((out / "cells").glob("*.parquet"))}


def partial_files(out: Path) -> list[Path]:
    return sorted(out.rglob(".*.tmp-*"))


def job_specs(out: Path, since: float = 0.0) -> dict[str, list[str]]:
    """launch group attempt -> the cells its job was asked to run, from the spec files written since `since`."""
    return {p.stem: [c["id"] for c in json.loads(p.read_text())["cells"]]
            for p in sorted((out / "jobs" / "node0").glob("*.json")) if p.stat().st_mtime >= since}


def worker_pids(out: Path) -> set[int]:
    """Every worker process of the run, as the workers themselves reported them."""
    pids = set()
    for path in (out / "jobs").rglob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev["event"] == "pid":
                pids.add(int(ev["pid"]))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def survivors(out: Path) -> list[str]:
    """Worker pids still alive, and any process whose command line names this run directory
    (torchrun and its workers carry the job spec path): both must be empty after a run."""
    left = [f"worker pid {p}" for p in sorted(worker_pids(out)) if _alive(p)]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmdline and _alive(int(proc.name)):
            left.append(f"pid {proc.name}: {cmdline[:200]}")
    return left


@pytest.fixture(scope="module", autouse=True)
def _builtin_model_made():
    """Make the built-in model before any test reads stderr (its first save draws a progress bar)."""
    from repaudit import builtin

    builtin.ensure("builtin:tiny-qwen3")


def main(argv: list[str], capsys) -> tuple[int, list[str]]:
    """repaudit.cli.main in this process: (exit code, stderr lines)."""
    capsys.readouterr()
    rc = cli.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------ kill, hang, OOM, ENOSPC

FAULTED_ARGS = BASE + ["--tp", "1,2", "--batch-size", "1,2,4,8", "--timeout", "10"]
FAULTS = ",".join([
    f"oom:{cid(1, 8)}",  # the largest batch size of the TP=1 job
    f"kill:{cid(2, 1)}:1",  # SIGKILL rank 1 halfway through the first TP=2 cell
    f"hang:{cid(2, 2)}:1",  # rank 1 stops, rank 0 blocks in the next collective
    f"enospc:{cid(2, 8)}",  # rank 0's record write hits a full disk
])


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    """One run with four faults, then the same command again with no fault."""
    out = tmp_path_factory.mktemp("faults") / "run"
    args = FAULTED_ARGS + ["--out", str(out)]
    before_tp2: dict = {}
    real_run_group = run_mod.run_group

    def spy(spec, *a, **kw):  # the records that exist before the first fault in a TP=2 job
        if spec.tp == 2 and not before_tp2:
            before_tp2.update(records(out))
        return real_run_group(spec, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPAUDIT_FAULT", FAULTS)
        mp.setattr(run_mod, "run_group", spy)
        t0 = time.monotonic()
        rc = cli.main(args)
        seconds = time.monotonic() - t0
    first = SimpleNamespace(rc=rc, seconds=seconds, manifest=manifest(out), records=records(out),
                            partial=partial_files(out), survivors=survivors(out), pids=worker_pids(out),
                            specs=job_specs(out), before_tp2=before_tp2)
    t2 = time.time()
    rc2 = cli.main(args)  # the fault is gone: a plain re-run of the same command
    second = SimpleNamespace(rc=rc2, manifest=manifest(out), records=records(out), specs=job_specs(out, t2),
                             survivors=survivors(out), partial=partial_files(out))
    return SimpleNamespace(out=out, first=first, second=second)


def test_faults_end_only_their_own_cell(faulted):
    cells = faulted.first.manifest["cells"]
    assert faulted.first.rc == 1  # some cells did not complete
    assert {c: cells[c]["status"] for c in cells} == {
        cid(1, 1): "done", cid(1, 2): "done", cid(1, 4): "done", cid(1, 8): "failed",
        cid(2, 1): "failed", cid(2, 2): "timeout", cid(2, 4): "done", cid(2, 8): "failed",
    }
    assert sorted(faulted.first.records) == [cid(1, 1), cid(1, 2), cid(1, 4), cid(2, 4)]
    assert faulted.first.partial == []
    assert faulted.first.survivors == [] and len(faulted.first.pids) == 1 + 2 * 3  # 1 TP=1 job, 3 TP=2 jobs
    # after each failure the rest of the group went on in a new job
    assert faulted.first.specs == {
        "hf-tp1-default.1": [cid(1, 1), cid(1, 2), cid(1, 4), cid(1, 8)],
        "hf-tp2-default.1": [cid(2, 1), cid(2, 2), cid(2, 4), cid(2, 8)],
        "hf-tp2-default.2": [cid(2, 2), cid(2, 4), cid(2, 8)],
        "hf-tp2-default.3": [cid(2, 4), cid(2, 8)],
    }


def test_killed_rank_fails_its_cell_and_loses_nothing(faulted):
    cell = faulted.first.manifest["cells"][cid(2, 1)]
    assert cell["reason"] == "rank 1 killed by SIGKILL"
    # records written before the kill are byte-for-byte the same, and so is their mtime
    assert faulted.first.before_tp2 == {k: faulted.first.records[k] for k in (cid(1, 1), cid(1, 2), cid(1, 4))}


def test_hang_in_a_collective_times_out_and_ends_the_whole_job(faulted):
    cell = faulted.first.manifest["cells"][cid(2, 2)]
    assert cell["status"] == "timeout"
    assert cell["reason"] == "no result within --timeout 10s; job ended"
    assert faulted.first.survivors == []  # rank 0 (blocked in gloo) and rank 1 (asleep) are both gone
    # the rest went on in a new job: bs4 completed there
    assert faulted.first.specs["hf-tp2-default.3"] == [cid(2, 4), cid(2, 8)]
    assert faulted.first.manifest["cells"][cid(2, 4)]["status"] == "done" and cid(2, 4) in faulted.first.records


def test_out_of_memory_fails_the_largest_batch_and_keeps_the_smaller(faulted):
    cell = faulted.first.manifest["cells"][cid(1, 8)]
    assert cell["status"] == "failed"
    assert cell["reason"].startswith("out of memory: ")
    for bs in (1, 2, 4):
        assert faulted.first.manifest["cells"][cid(1, bs)]["status"] == "done"
        assert cid(1, bs) in faulted.first.records


def test_disk_full_on_a_record_write_leaves_no_half_file(faulted):
    cell = faulted.first.manifest["cells"][cid(2, 8)]
    assert cell["status"] == "failed"
    record = faulted.out / "cells" / f"{cid(2, 8)}.parquet"  # named, not its temporary file
    assert cell["reason"] == f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: '{record}'"
    assert cid(2, 8) not in faulted.first.records and faulted.first.partial == []


def test_rerun_recomputes_only_the_failed_cells(faulted):
    first, second = faulted.first, faulted.second
    assert second.rc == 0, second.manifest["cells"]
    assert all(c["status"] == "done" and c["reason"] is None for c in second.manifest["cells"].values())
    assert second.specs == {"hf-tp1-default.1": [cid(1, 8)], "hf-tp2-default.1": [cid(2, 1), cid(2, 2), cid(2, 8)]}
    for cell, sha_mtime in first.records.items():
        assert second.records[cell] == sha_mtime  # never rewritten
    assert sorted(second.records) == sorted(first.manifest["cells"])
    assert len(second.manifest["runs"]) == 2
    assert second.survivors == [] and second.partial == []


# ------------------------------------------------------------------ a crash under a cell: one retry


def test_a_cell_whose_job_crashed_runs_again_and_an_error_of_its_own_does_not(faulted, tmp_path, capsys):
    """Rank 1 aborts in bs1 (as a heap corruption does): bs1 runs again in the next job and
    completes, with the bits of the same cell run without a fault; bs2's own error is not retried."""
    from repaudit import commands
    from repaudit.diff import diff_records

    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPAUDIT_FAULT", f"abort-once:{cid(2, 1)}:1,raise:{cid(2, 2)}")
        rc, _ = main(BASE + ["--tp", "2", "--batch-size", "1,2,4", "--out", str(out)], capsys)
    cells = manifest(out)["cells"]
    assert rc == 1 and {c: v["status"] for c, v in cells.items()} == {cid(2, 1): "done", cid(2, 2): "failed", cid(2, 4): "done"}
    assert job_specs(out) == {"hf-tp2-default.1": [cid(2, 1), cid(2, 2), cid(2, 4)],
                              "hf-tp2-default.2": [cid(2, 1), cid(2, 2), cid(2, 4)],
                              "hf-tp2-default.3": [cid(2, 4)]}
    [why] = cells[cid(2, 1)]["retried"]
    assert why == "rank 1 killed by SIGABRT (Fatal Python error: Aborted)", why  # the worker's fault handler spoke
    assert "retried" not in cells[cid(2, 2)] and cells[cid(2, 2)]["reason"] == f"RuntimeError: injected failure in {cid(2, 2)}"
    assert survivors(out) == []
    same = diff_records(out / "cells" / f"{cid(2, 1)}.parquet", faulted.out / "cells" / f"{cid(2, 1)}.parquet")
    assert same.identical and same.comparable > 0
    assert f"- `{cid(2, 1)}`: {why}" in (out / "summary.md").read_text()
    rows = {r["cell"]: r for r in json.loads((out / "summary.json").read_text())["cells"]}
    assert rows[cid(2, 1)]["retried"] == [why] and rows[cid(2, 4)]["retried"] == []
    assert commands.report(out) == 0
    [note] = [ln for ln in (out / "report.md").read_text().splitlines() if "Ran again after its job crashed" in ln]
    assert cid(2, 1) in note and note.endswith(f"({why})."), note


def test_a_job_that_crashed_while_loading_runs_again(tmp_path, capsys):
    """Rank 1 aborts as its model is ready, before any cell: the whole job runs again, once."""
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPAUDIT_FAULT", "abort-once:load:1")
        rc, _ = main(BASE + ["--tp", "2", "--batch-size", "1", "--out", str(out)], capsys)
    m = manifest(out)
    assert rc == 0 and m["cells"][cid(2, 1)]["status"] == "done" and "retried" not in m["cells"][cid(2, 1)]
    assert job_specs(out) == {"hf-tp2-default.1": [cid(2, 1)], "hf-tp2-default.2": [cid(2, 1)]}
    [why] = m["groups"]["hf-tp2-default"]["retried"]
    assert why == "rank 1 killed by SIGABRT (Fatal Python error: Aborted)", why
    assert m["groups"]["hf-tp2-default"]["attempts"] == 2 and survivors(out) == []
    assert f"- `launch group hf-tp2-default`: {why}" in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["group_retries"] == {"hf-tp2-default": [why]}


# ------------------------------------------------------------------ SIGINT / SIGTERM, lock

SIGNAL_ARGS = BASE + ["--tp", "1", "--batch-size", "1,2,4", "--timeout", "300"]


def _start(out: Path, fault: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("REPAUDIT_FAULT", None)
    if fault:
        env["REPAUDIT_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "repaudit", *SIGNAL_ARGS, "--out", str(out)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_running(proc: subprocess.Popen, out: Path, cell: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        with contextlib.suppress(FileNotFoundError, KeyError):
            if manifest(out)["cells"][cell]["status"] == "running":
                # the hang strikes after the cell's first batch: wait for it, so a worker is mid-cell
                if any(json.loads(ln).get("event") == "progress" and json.loads(ln).get("cell") == cell
                       for p in (out / "jobs").rglob("rank0.jsonl") for ln in p.read_text().splitlines()):
                    return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"{cell} never started running")


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    text = proc.communicate(timeout=timeout)[0]
    return proc.returncode, text


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """SIGINT while bs2 runs, then a re-run stopped by SIGTERM while bs4 runs, then a plain re-run."""
    out = tmp_path_factory.mktemp("signals") / "run"
    steps = SimpleNamespace(out=out)

    proc = _start(out, f"hang:{cid(1, 2)}")
    _wait_running(proc, out, cid(1, 2))
    steps.lock_holder = proc.pid
    steps.lock_rc, steps.lock_err = _second_run(out)  # a second run on the same directory, now
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    steps.sigint_rc, steps.sigint_log = _finish(proc)
    steps.sigint_seconds = time.monotonic() - t0
    steps.sigint = SimpleNamespace(manifest=manifest(out), records=records(out), partial=partial_files(out),
                                   survivors=survivors(out), pids=worker_pids(out))

    # a writer killed mid-write by an earlier crash leaves a hidden temporary file: the next run drops it
    stale = out / "cells" / f".{cid(1, 4)}.parquet.tmp-999999"
    stale.write_bytes(b"PAR1 half a file")
    t2 = time.time()
    proc = _start(out, f"hang:{cid(1, 4)}")
    _wait_running(proc, out, cid(1, 4))
    steps.stale_gone_at_start = not stale.exists()
    proc.send_signal(signal.SIGTERM)
    steps.sigterm_rc, steps.sigterm_log = _finish(proc)
    steps.sigterm = SimpleNamespace(manifest=manifest(out), records=records(out), partial=partial_files(out),
                                    survivors=survivors(out), specs=job_specs(out, t2))

    t3 = time.time()
    proc = _start(out, None)
    steps.final_rc, steps.final_log = _finish(proc, timeout=300)
    steps.final = SimpleNamespace(manifest=manifest(out), records=records(out), specs=job_specs(out, t3),
                                  survivors=survivors(out))
    return steps


def _second_run(out: Path) -> tuple[int, list[str]]:
    """`repaudit run` on the same directory, in this process (no interpreter start-up to pay)."""
    err, sink = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(sink):
        rc = cli.main(SIGNAL_ARGS + ["--out", str(out)])
    return rc, err.getvalue().strip().splitlines()


def _no_cell_running(m: dict) -> bool:
    return all(c["status"] != "running" for c in m["cells"].values())


def test_sigint_stops_workers_and_keeps_the_manifest_valid(interrupted):
    s = interrupted
    assert s.sigint_rc == 130, s.sigint_log[-3000:]
    assert s.sigint_seconds < 30
    assert "interrupted (SIGINT)" in s.sigint_log
    assert {c: v["status"] for c, v in s.sigint.manifest["cells"].items()} == {
        cid(1, 1): "done", cid(1, 2): "pending", cid(1, 4): "pending"}
    assert _no_cell_running(s.sigint.manifest)
    assert sorted(s.sigint.records) == [cid(1, 1)]
    assert s.sigint.partial == [] and s.sigint.survivors == [] and s.sigint.pids


def test_sigterm_stops_the_resumed_run_the_same_way(interrupted):
    s = interrupted
    assert s.stale_gone_at_start  # partial files are removed before any job starts
    assert s.sigterm_rc == 130, s.sigterm_log[-3000:]
    assert "interrupted (SIGTERM)" in s.sigterm_log
    assert s.sigterm.specs == {"hf-tp1-default.1": [cid(1, 2), cid(1, 4)]}  # bs1 was not run again
    assert {c: v["status"] for c, v in s.sigterm.manifest["cells"].items()} == {
        cid(1, 1): "done", cid(1, 2): "done", cid(1, 4): "pending"}
    assert s.sigterm.records[cid(1, 1)] == s.sigint.records[cid(1, 1)]
    assert s.sigterm.partial == [] and s.sigterm.survivors == []


def test_next_run_resumes_only_the_unfinished_cells(interrupted):
    s = interrupted
    assert s.final_rc == 0, s.final_log[-3000:]
    assert s.final.specs == {"hf-tp1-default.1": [cid(1, 4)]}
    assert all(c["status"] == "done" for c in s.final.manifest["cells"].values())
    for cell in (cid(1, 1), cid(1, 2)):
        assert s.final.records[cell] == s.sigterm.records[cell]
    assert len(s.final.manifest["runs"]) == 3 and s.final.survivors == []


def test_second_run_on_the_same_directory_refuses_naming_the_first(interrupted):
    s = interrupted
    assert s.lock_rc == 2
    assert len(s.lock_err) == 1, s.lock_err
    line = s.lock_err[0]
    assert line.startswith("repaudit: error: ") and "in use by another repaudit run" in line
    assert f"pid {s.lock_holder} on {socket.gethostname()}, started " in line
    # the refused run touched nothing: bs1 was done before and still is, bs2 stayed the first run's
    assert len(s.sigint.manifest["runs"]) == 1


# ------------------------------------------------------------------ a run SIGKILLed: its job runs on

def _torchrun_pids(out: Path) -> list[int]:
    """The run's torchrun agents, by their command line (they carry the job spec's path)."""
    return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _alive(int(p.name))
                  and "torch.distributed.run" in _cmdline(p) and str(out) in _cmdline(p))


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_and_wait(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"{pids} survived SIGKILL"
        time.sleep(0.05)


def _state(out: Path) -> dict:
    """Everything a second run could spoil: the records, the manifest, the job's events."""
    events = {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "jobs").rglob("rank*.jsonl"))}
    return {"records": records(out), "manifest": (out / "manifest.json").read_bytes(), "events": events}


@pytest.fixture(scope="module")
def orphaned(tmp_path_factory):
    """`repaudit run` SIGKILLed while its job is in bs2 (which hangs): its torchrun job runs on. Then a run
    on the same directory; again once that torchrun is SIGKILLed too (its worker lives on); and once
    the worker is gone."""
    out = tmp_path_factory.mktemp("orphan") / "run"
    s = SimpleNamespace(out=out)
    proc = _start(out, f"hang:{cid(1, 2)}")
    _wait_running(proc, out, cid(1, 2))
    proc.kill()  # SIGKILL: nothing runs in the launcher, so nothing ends its job
    proc.wait()
    s.torchrun = _torchrun_pids(out)
    s.workers = sorted(p for p in worker_pids(out) if _alive(p))
    try:
        s.before = _state(out)
        s.beside_job = _second_run(out)
        s.after_beside_job = _state(out)
        _kill_and_wait(s.torchrun)
        s.workers_left = sorted(p for p in s.workers if _alive(p))
        s.beside_workers = _second_run(out)
        s.after_beside_workers = _state(out)
    finally:
        _kill_and_wait(s.torchrun + s.workers)
    t = time.time()
    s.resumed = _second_run(out)
    s.final = SimpleNamespace(manifest=manifest(out), records=records(out), specs=job_specs(out, t),
                              survivors=survivors(out))
    return s


def test_rerun_beside_an_orphaned_job_refuses_and_rewrites_nothing(orphaned):
    s = orphaned
    assert len(s.torchrun) == 1 and len(s.workers) == 1
    rc, err = s.beside_job
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"repaudit: error: {s.out} is in use by a job whose repaudit run is gone (pid ")
    assert f"pid {s.torchrun[0]} still runs it" in err[0]  # the process that holds the lock: torchrun
    assert s.after_beside_job == s.before  # no record rewritten, no event deleted, the manifest untouched
    assert sorted(s.before["records"]) == [cid(1, 1)]


def test_rerun_beside_workers_that_outlived_their_torchrun_refuses(orphaned):
    s = orphaned
    assert s.workers_left == s.workers  # torchrun put the worker in a session of its own: it ran on
    rc, err = s.beside_workers
    assert rc == 2 and len(err) == 1, err
    assert f"worker process(es) {s.workers[0]} of an earlier job still run" in err[0]
    assert s.after_beside_workers == s.before


def test_once_the_orphan_is_gone_the_run_resumes(orphaned):
    s = orphaned
    rc, err = s.resumed
    assert rc == 0, err
    assert s.final.specs == {"hf-tp1-default.1": [cid(1, 2), cid(1, 4)]}
    assert s.final.records[cid(1, 1)] == s.before["records"][cid(1, 1)]  # never rewritten
    cells = s.final.manifest["cells"]
    assert all(c["status"] == "done" for c in cells.values())
    assert cells[cid(1, 1)]["reused"] and not cells[cid(1, 2)]["reused"]
    assert s.final.survivors == []


# ------------------------------------------------------------------ writes that fail

def _can_mount() -> bool:
    return os.geteuid() == 0 and sys.platform == "linux"


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(path: Path):
    """A read-only view of `path`: a read-only bind mount as root (chmod does not stop root), chmod otherwise."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield path
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    view = path.parent / (path.name + "-ro")
    view.mkdir()
    r = subprocess.run(["mount", "--bind", str(path), str(view)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount here: {r.stderr.decode().strip()}")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
        view.rmdir()


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_read_only_run_directory_is_a_clear_error_and_changes_nothing(interrupted, capsys):
    done = interrupted.out  # a finished run
    before = _tree(done)
    # A read-only mount is the machine's failure (exit 5); a directory the user may not write, their input (2).
    expected = (5, "Read-only file system") if os.geteuid() == 0 else (2, "permission denied")
    with read_only(done) as view:
        rc, err = main(SIGNAL_ARGS + ["--out", str(view)], capsys)
        assert len(err) == 1 and (rc, err[0].split(": ")[2]) == expected, (rc, err)
        assert err[0].startswith("repaudit: error: ") and str(view) in err[0]
        assert _tree(view) == before
        rc, err = main(SIGNAL_ARGS + ["--out", str(view / "new")], capsys)  # a new run under it
        assert rc == expected[0] and len(err) == 1 and str(view / "new") in err[0], err
    assert _tree(done) == before


def test_out_under_a_regular_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, err = main(SIGNAL_ARGS + ["--out", str(tmp_path / "file" / "run")], capsys)
    assert rc == 2 and err == [f"repaudit: error: Not a directory: {tmp_path / 'file' / 'run'}"]


def test_disk_full_mid_run_ends_the_job_and_keeps_the_manifest(tmp_path, capsys, monkeypatch):
    """The disk fills up while a cell runs: the launcher cannot save the manifest. The job must
    be ended (not orphaned), the error be one line, and the files on disk stay whole."""
    real = _can_mount()
    disk = tmp_path / "disk"
    with (tmpfs(disk, "2m") if real else contextlib.nullcontext(tmp_path)):
        out = disk / "run"
        set_cell = Manifest.set_cell

        def filling_set_cell(self, cell_id, **fields):
            if fields.get("status") == "running":
                if real:  # fill the file system to the last byte
                    with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:
                        while True:
                            fh.write(b"\0" * 65536)
                            fh.flush()
                else:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            return set_cell(self, cell_id, **fields)

        monkeypatch.setattr(Manifest, "set_cell", filling_set_cell)
        rc, err = main(BASE + ["--tp", "2", "--batch-size", "1", "--out", str(out)], capsys)
        assert rc == 5 and len(err) == 1, err  # the machine failed, not the input
        assert err[0] == f"repaudit: error: {os.strerror(errno.ENOSPC)}: {out / 'manifest.json'}"
        assert survivors(out) == [] and len(worker_pids(out)) == 2
        m = manifest(out)  # the last complete version
        assert m["cells"][cid(2, 1)]["status"] == "pending"
        assert partial_files(out) == [] and not list((out / "cells").glob("*.parquet"))
