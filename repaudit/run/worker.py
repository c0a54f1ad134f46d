"""One rank of a launch group: load the model once, run every cell of the group, and (rank 0)
write one record per cell. Started by torchrun (or inside an existing torchrun/SLURM job).

Any exception in a cell is reported as an event and ends the process at once (_cell_failed).
A vLLM cell is a job of one process, vLLM's driver; vLLM starts its own TP workers.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

from ..engines.base import Sequence, Timing, TokenRows
from ..record.io import RecordMeta, build_table, load_frame, write_table
from .events import EventWriter
from .faults import LOAD_FAULT, maybe_inject, write_faults
from .jobspec import JobSpec, cell_path

REFERENCE_POLL_S = 0.5


def _reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = "out of memory" if type(exc).__name__ == "OutOfMemoryError" else type(exc).__name__
    return f"{kind}: {first}" if first else kind


_OWN_GROUP = False  # whether this process's default process group was made by _init


def _init(spec: JobSpec):
    global _OWN_GROUP
    import torch
    import torch.distributed as dist

    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(spec.cpu_threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # Hangs are the launcher's to judge (per-cell timeout); keep the backend's own watchdog out of it.
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", timeout=timedelta(hours=24))
        _OWN_GROUP = True
    return dist.get_rank() if dist.is_initialized() else 0


def release_group() -> None:
    """Inside a caller's torchrun job: the ranks wait for each other, then the process group
    _init made goes, so no rank exits while another still talks to it (a rank leaving with its
    gloo threads running can abort the job). A group the caller made stays theirs."""
    global _OWN_GROUP
    import torch.distributed as dist

    if _OWN_GROUP and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _OWN_GROUP = False


def _references(spec: JobSpec, rank: int) -> dict[str, list[int]] | None:
    from ..record.distutil import broadcast_json

    refs = None
    if rank == 0 and spec.reference_cell:
        path = cell_path(spec.out_dir, spec.reference_cell)
        if path.exists():
            df = load_frame(path)
            done = df[df["phase"] == "completion"].sort_values(["prompt_id", "pos"])
            refs = {str(k): g["token_id"].astype(int).tolist() for k, g in done.groupby("prompt_id", observed=True)}
    return broadcast_json(refs)


def _await_reference(spec: JobSpec, cell: dict) -> None:
    """Groups side by side (see repaudit.schedule) start before the reference cell is written:
    a score cell waits for it here, before it starts, so its --timeout does not run meanwhile.
    The launcher writes the marker when the reference will not come; the cell then fails
    with the reason _sequences gives."""
    marker = spec.extra.get("reference_failed_marker")
    if not marker or cell["mode"] != "score" or not spec.reference_cell:
        return
    record = cell_path(spec.out_dir, spec.reference_cell)
    while not record.exists() and not Path(marker).exists():
        time.sleep(REFERENCE_POLL_S)


def _sequences(spec: JobSpec, refs: dict[str, list[int]] | None, mode: str) -> list[Sequence]:
    out = []
    for p in spec.prompts:
        completion = p.completion
        if mode == "score" and completion is None:
            if refs is None or p.id not in refs:
                raise RuntimeError(f"no reference completion for {p.id!r}: reference cell {spec.reference_cell} has not completed")
            completion = refs[p.id]
        out.append(Sequence(p.id, tuple(p.tokens), tuple(completion) if completion is not None else None, p.max_new_tokens))
    return out


def _batches(cid: str, seqs: list[Sequence], batch_size: int, run_batch, events: EventWriter,
             rank: int) -> tuple[list[TokenRows], Timing]:
    """Run a cell's sequences batch by batch, reporting progress in tokens (prompt + completion)."""
    work = lambda s: len(s.prompt) + (len(s.completion) if s.completion else s.max_new_tokens)  # noqa: E731
    rows: list[TokenRows] = []
    timing = Timing()
    total, done = sum(work(s) for s in seqs), 0
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i : i + batch_size]
        out, t = run_batch(batch)
        rows.extend(out)
        timing.add(t)
        done += sum(work(s) for s in batch)
        events.emit("progress", cell=cid, tokens=done, total=total)
        if i == 0:
            maybe_inject(cid, rank, events.directory.parent)  # tests only: a fault with the cell half done
    return rows, timing


def _table(rows: list[TokenRows]):
    cat = lambda name: np.concatenate([getattr(r, name) for r in rows])  # noqa: E731
    ids = np.concatenate([np.full(len(r.pos), r.prompt_id, dtype=object) for r in rows])
    return build_table(prompt_id=ids, pos=cat("pos"), token_id=cat("token_id"), logprob=cat("logprob"),
                       phase=cat("phase"), topk_ids=cat("topk_ids") if rows[0].topk_ids.shape[1] else None,
                       topk_logprobs=cat("topk_logprobs") if rows[0].topk_ids.shape[1] else None,
                       row_digest=None if rows[0].digest is None else cat("digest"), top1_id=cat("top1"))


def _write(spec: JobSpec, cell: dict, rows: list[TokenRows], env: dict, traced) -> None:
    """Rank 0: the cell's record (and its trace first: a completed record always has its trace)."""
    meta = RecordMeta(cell=cell, env=env, probes=spec.probes, model=spec.model, tokenizer=spec.tokenizer,
                      prompts=[], topk=spec.topk)
    path = cell_path(spec.out_dir, cell["id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    if traced is not None:
        from ..record.tracefile import trace_path, write_trace

        write_trace(trace_path(path), traced[0], traced[1], cell)
    with write_faults(cell["id"], 0):
        # Never over an existing record: whoever wrote it (a job that outlived its run) got there first.
        write_table(path, _table(rows), meta, overwrite=False)


# What a collective raises when another process of the job is gone: the cause is elsewhere.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport/tcp",
              "remote process exited")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` says a peer of this rank went away (a gloo/NCCL transport error), not that
    this rank's own work failed."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistNetworkError) or any(m in str(exc) for m in _PEER_LOST)


def _cell_failed(events: EventWriter, cid: str, exc: BaseException) -> None:
    """Reported, then the process ends: peers may be blocked in a collective, and only the
    launcher can end the whole job cleanly."""
    events.emit("cell_failed", cell=cid, reason=_reason(exc), peer_lost=lost_peer(exc),
                traceback=traceback.format_exc()[-4000:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def _run_vllm(spec: JobSpec, events: EventWriter, todo: list[dict]) -> None:
    """A vLLM job: this process is vLLM's driver (vLLM starts the TP workers itself); one kernel
    mode, its batch sizes and modes run on one LLM, as a transformers job's do on one model."""
    from ..engines import vllm_engine
    from ..record.fingerprint import environment

    vllm_engine.scrub_launcher_env(os.environ)
    os.environ.update(vllm_engine.process_env(todo[0]["kernels"]))
    scenario = todo[0].get("scenario", "cold")  # one per job, like the kernel mode (plan.Cell.group_key)
    # Reference completions are greedy generations of at most max_new_tokens tokens.
    longest = max(len(p.tokens) + max(p.max_new_tokens, len(p.completion or ())) for p in spec.prompts)
    refs = None
    t0 = time.perf_counter()
    llm = vllm_engine.load(vllm_engine.engine_args(
        model_path=spec.model_path, tp=spec.tp, dtype=spec.dtype, batch_size=max(c["batch_size"] for c in todo),
        max_len=longest + 1, topk=spec.topk, kernels=todo[0]["kernels"], scenario=scenario,
        extra=spec.extra.get("vllm_args")))
    events.emit("loaded", seconds=time.perf_counter() - t0)
    env = environment(spec.device)
    for cell in todo:
        cid = cell["id"]
        _await_reference(spec, cell)
        events.emit("cell_start", cell=cid)
        t_cell = time.perf_counter()
        try:
            if cell["mode"] == "score" and refs is None and any(p.completion is None for p in spec.prompts):
                refs = _references(spec, 0)
            run = vllm_engine.score if cell["mode"] == "score" else vllm_engine.generate

            def run_batch(batch):
                if scenario == "prefix-hit":  # the prompts' prefixes cached first, outside the cell's timing
                    vllm_engine.warm_prefixes(llm, batch)
                return run(llm, batch, spec.topk, tuple(spec.stop_ids))

            rows, timing = _batches(cid, _sequences(spec, refs, cell["mode"]), cell["batch_size"], run_batch, events, 0)
            _write(spec, cell, rows, env, None)
        except BaseException as exc:  # noqa: BLE001
            _cell_failed(events, cid, exc)
        events.emit("cell_done", cell=cid, seconds=time.perf_counter() - t_cell, rows=sum(len(r.pos) for r in rows),
                    ranks_differ=0, timing=timing.as_dict())


def run_job(spec: JobSpec) -> None:
    import torch

    from ..engines import hf
    from ..record.distutil import broadcast_json, rows_where_ranks_differ
    from ..record.fingerprint import environment, gather_rank_settings
    from .kernelmodes import kernel_mode

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The pid first, before the process group: a rank stuck in rendezvous must still be killable by its id.
    events = EventWriter(Path(spec.events_dir), int(os.environ.get("RANK", "0")))
    events.emit("pid", pid=os.getpid(), local_rank=local_rank)
    # A vLLM job's one process must not touch CUDA: vLLM's workers would then have to be spawned, not forked.
    rank = _init(spec) if spec.engine != "vllm" else 0
    # Rank 0 decides what is left to do, so nodes that cannot see the run directory agree.
    todo = broadcast_json([c for c in spec.cells if not cell_path(spec.out_dir, c["id"]).exists()] if rank == 0 else None)
    for c in spec.cells:
        if c not in todo:
            events.emit("cell_skip", cell=c["id"])
    if not todo:
        return
    if spec.engine == "vllm":
        _run_vllm(spec, events, todo)
        return
    t0 = time.perf_counter()
    model = hf.load(spec.model_path, dtype=spec.dtype, device=spec.device, tp=spec.tp,
                    trust_remote_code=spec.trust_remote_code, stop_ids=tuple(spec.stop_ids), pad_id=spec.pad_id)
    maybe_inject(LOAD_FAULT, rank, events.directory.parent)  # tests only: a fault as the model is ready
    events.emit("loaded", seconds=time.perf_counter() - t0)
    env = environment(spec.device)
    env["ranks"] = gather_rank_settings(spec.device)  # a collective: every rank's switches, not rank 0's alone
    refs = None
    for cell in todo:
        cid = cell["id"]
        _await_reference(spec, cell)  # every rank: any rank's cell_start starts the cell's clock
        events.emit("cell_start", cell=cid)
        t_cell = time.perf_counter()
        try:
            if cell["mode"] == "score" and refs is None and any(p.completion is None for p in spec.prompts):
                refs = _references(spec, rank)
            run = hf.score if cell["mode"] == "score" else hf.generate
            if spec.extra.get("trace"):
                from .trace import Tracer

                model.tracer = Tracer(model.model, spec.tp)
            with kernel_mode(model, cell["kernels"]):
                rows, timing = _batches(cid, _sequences(spec, refs, cell["mode"]), cell["batch_size"],
                                        lambda batch: run(model, batch, spec.topk), events, rank)
            traced = None
            if model.tracer is not None:
                model.tracer.detach()
                traced = model.tracer.finish()  # a collective: every rank takes part
                model.tracer = None
            digests = torch.from_numpy(np.concatenate([r.digest for r in rows]).view(np.int64))
            ranks_differ = rows_where_ranks_differ(digests)
            n_rows = sum(len(r.pos) for r in rows)
            if rank == 0:
                _write(spec, cell, rows, env, traced)
        except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
            _cell_failed(events, cid, exc)
        events.emit("cell_done", cell=cid, seconds=time.perf_counter() - t_cell, rows=n_rows,
                    ranks_differ=ranks_differ, timing=timing.as_dict())


def main(argv: list[str] | None = None) -> int:
    # A crash in native code (a heap corruption glibc catches, a bad access) leaves the Python
    # stack of every thread in the job's log, beside the line the launcher quotes.
    faulthandler.enable(all_threads=True)
    argv = sys.argv[1:] if argv is None else argv
    spec = JobSpec.read(Path(argv[0]))
    try:
        run_job(spec)
    except BaseException as exc:  # a failure outside any cell: loading, init, references
        try:
            EventWriter(Path(spec.events_dir), int(os.environ.get("RANK", "0"))).emit(
                "job_failed", reason=_reason(exc), peer_lost=lost_peer(exc), traceback=traceback.format_exc()[-4000:])
        finally:
            os._exit(4)
    import torch.distributed as dist

    if dist.is_initialized():
        # The ranks leave together: a gloo rank that tears its group down while another still
        # writes its record aborts in C++ ("terminate called without an active exception",
        # SIGABRT), and the launcher then ends the job and its cell as failed.
        dist.barrier()
        dist.destroy_process_group()
    # Every cell is done and written, and every rank past the barrier: leave without Python's
    # finalization, where a gloo thread still joinable can abort the process ("terminate called
    # without an active exception", seen on CPU at TP=4 after the last cell) and torchrun then
    # reports a failed job that failed nothing. vLLM's driver finalizes: its exit handlers end
    # vLLM's own workers.
    if spec.engine != "vllm":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
