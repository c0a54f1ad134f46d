"""Launch groups side by side on a node's GPUs (repaudit.run.schedule), with fake launches."""

import threading
import time

import pytest

from repaudit.run.schedule import run_side_by_side, visible_gpus

WAIT_S = 5.0


def test_groups_that_fit_run_at_once_on_their_own_gpus():
    started = {name: threading.Event() for name in "abcd"}
    seen: dict[str, list[str]] = {}
    busy: set[str] = set()
    overlap: list[set[str]] = []
    lock = threading.Lock()

    def launch(group, ids):
        name = group[0]
        with lock:
            assert not busy & set(ids), f"{name} got GPUs {ids} that are in use"
            busy.update(ids)
            seen[name] = ids
            overlap.append(set(busy))
        started[name].set()
        if name == "a":  # a ends only once b runs beside it: proves the two ran at once
            assert started["b"].wait(WAIT_S)
        with lock:
            busy.difference_update(ids)

    groups = [("a", 1), ("b", 1), ("c", 1), ("d", 2)]
    run_side_by_side(groups, ["4", "5"], need=lambda g: g[1], launch=launch, stopping=lambda: False)
    assert {seen["a"][0], seen["b"][0]} == {"4", "5"}
    assert sorted(seen["d"]) == ["4", "5"]
    assert {"4", "5"} in overlap


def test_a_failed_launch_is_raised_and_nothing_new_starts():
    stop = threading.Event()
    launched: list[str] = []

    def launch(group, ids):
        launched.append(group)
        if group == "bad":
            stop.set()
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        run_side_by_side(["bad", "x", "y"], ["0"], need=lambda g: 1, launch=launch, stopping=stop.is_set)
    assert launched == ["bad"]


def test_a_group_larger_than_the_node_is_refused():
    with pytest.raises(ValueError, match="needs 4 GPUs, 2 are visible"):
        run_side_by_side(["big"], ["0", "1"], need=lambda g: 4, launch=lambda g, i: None, stopping=lambda: False)


def test_children_name_the_parents_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus(2) == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(3) == ["0", "1", "2"]


@pytest.mark.parametrize("arrives", ["record", "marker"])
def test_a_score_cell_waits_for_the_reference_or_the_word_that_it_will_not_come(tmp_path, arrives):
    from repaudit.run.jobspec import JobSpec, cell_path
    from repaudit.run.worker import _await_reference

    marker = tmp_path / "jobs" / "reference-failed"
    marker.parent.mkdir()
    spec = JobSpec(group_id="g", engine="hf", model_path="m", dtype="float32", device="cuda", tp=1, out_dir=str(tmp_path),
                   events_dir="", cells=[], prompts=[], stop_ids=[], pad_id=0, topk=0, reference_cell="ref-generate",
                   probes={}, tokenizer={}, model={}, cpu_threads=1, trust_remote_code=False,
                   extra={"reference_failed_marker": str(marker)})
    target = cell_path(tmp_path, "ref-generate") if arrives == "record" else marker
    target.parent.mkdir(parents=True, exist_ok=True)
    timer = threading.Timer(0.6, target.write_text, args=("x",))
    timer.start()
    t0 = time.monotonic()
    _await_reference(spec, {"mode": "generate"})  # only score cells wait
    assert time.monotonic() - t0 < 0.3
    _await_reference(spec, {"mode": "score"})
    assert time.monotonic() - t0 >= 0.6 and target.exists()
    timer.join()


def _torchrun_failures(*ranks: tuple[int, int]) -> str:
    """The tail torchrun prints when ranks fail: (rank, exitcode) each."""
    out = "Failures:\n"
    for rank, code in ranks:
        out += f"[{rank}]:\n  time      : now\n  host      : h\n  rank      : {rank} (local_rank: {rank})\n"
        out += f"  exitcode  : {code} (pid: 1)\n  error_file: <N/A>\n  traceback : Signal {-code} received\n"
    return out


def test_a_rank_killed_from_outside_is_the_cause_but_an_abort_is_not():
    """SIGKILL (the OOM killer, a user) is named as the cause; SIGABRT is a rank aborting itself after
    a peer failed first (gloo), and SIGTERM is torchrun ending the survivors: the peer's own reason stands."""
    import signal

    from repaudit.run.launch import killed_rank

    assert killed_rank(_torchrun_failures((1, -signal.SIGKILL), (0, 1))) == "rank 1 killed by SIGKILL"
    assert killed_rank(_torchrun_failures((1, -signal.SIGABRT), (0, 1))) is None
    assert killed_rank(_torchrun_failures((0, -signal.SIGTERM))) is None


def test_a_crash_without_an_error_of_its_own_is_retried_and_a_kill_or_an_error_is_not(tmp_path):
    """launch._settle on what a job left: the cell's try is retried only where its processes died
    of their own crash (SIGABRT, SIGSEGV, ...) and no rank raised an error other than losing a peer,
    and only `retries` times. The reason names the crashed rank, not the peer that lost it."""
    import signal

    from repaudit.run.launch import GroupOutcome, _Attempt, _settle, crash_reason, signal_deaths

    abort = _torchrun_failures((0, -signal.SIGABRT), (1, -signal.SIGTERM))
    assert signal_deaths(abort, 1) == [("0", signal.SIGABRT)]
    assert crash_reason("", -signal.SIGSEGV) == "killed by SIGSEGV"  # a vLLM job's one process
    assert crash_reason(_torchrun_failures((1, -signal.SIGKILL), (0, -signal.SIGABRT)), 1) is None

    def settle(log: str, retries: int, own_error: bool = False, retried: int = 0):
        path = tmp_path / "job.log"
        path.write_text(log)
        outcome = GroupOutcome(retried={"c1": ["earlier"] * retried} if retried else {})
        attempt = _Attempt(ranks=2, loaded=True, started={"c1": 0.0})
        attempt.failure_reason["c1"] = (1.0, "RuntimeError: Read error: Connection reset by peer")
        if own_error:
            attempt.own_failure.add("c1")
        last = _settle(outcome, attempt, ["c1", "c2"], 0, path, 1, retries)
        return last, outcome, attempt

    last, outcome, attempt = settle(abort, retries=1)
    assert not last and "c1" not in outcome.cells
    assert attempt.retry == ("c1", "rank 0 killed by SIGABRT")
    assert outcome.retried == {"c1": ["rank 0 killed by SIGABRT"]}
    for log, kw in ((abort, {"retries": 0}), (abort, {"retries": 1, "retried": 1}),
                    (abort, {"retries": 1, "own_error": True}),
                    (_torchrun_failures((1, -signal.SIGKILL), (0, 1)), {"retries": 1})):
        last, outcome, attempt = settle(log, **kw)
        assert attempt.retry is None and outcome.cells["c1"].status == "failed", kw
    assert outcome.cells["c1"].reason == "rank 1 killed by SIGKILL"


def test_a_crash_names_the_line_the_process_printed_as_it_died(tmp_path):
    """A heap corruption that glibc caught: the cell's reason carries glibc's line."""
    import signal

    from repaudit.run.launch import GroupOutcome, _Attempt, _settle, crash_line

    log = "Loading weights: 100%\nmalloc(): unaligned tcache chunk detected\nW1127 Sending process 2 closing signal SIGTERM\n"
    log += "Root Cause (first observed failure):\n" + _torchrun_failures((0, -signal.SIGABRT))
    assert crash_line(log) == "malloc(): unaligned tcache chunk detected"
    assert crash_line("RuntimeError: boom\n") is None
    (tmp_path / "job.log").write_text(log)
    outcome = GroupOutcome()
    _settle(outcome, _Attempt(ranks=2, loaded=True, started={"c1": 0.0}), ["c1"], 0, tmp_path / "job.log", 1, 0)
    assert outcome.cells["c1"].reason == "rank 0 killed by SIGABRT (malloc(): unaligned tcache chunk detected)"
