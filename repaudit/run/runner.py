"""`repaudit run`: validate the matrix, launch each group, keep the manifest, summarise.

Everything that can be checked without loading a model is checked before the first job
starts. Completed cells are never recomputed or rewritten: a re-run resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import builtin
from ..errors import InputError
from ..files import write_text_atomic
from ..probes import Suite, load_suite
from ..record.fingerprint import environment
from ..record.io import RecordMeta, read_meta
from .events import EventReader, done_line
from .jobspec import JobSpec, PromptSpec, cell_path
from .launch import CellOutcome, GroupOutcome, Rendezvous, run_group
from .model import ModelRef, load_tokenizer, model_shape, resolve_model, stop_ids, tokenize, tokenizer_meta
from .nccl import debug_env as nccl_debug_env, group_observation, torch_nccl_version
from .plan import Cell, Matrix, Plan, expand, expand_with, validate_against_model
from .rundir import Manifest, RunLock, remove_partial_files
from .schedule import run_side_by_side, visible_gpus


@dataclass
class RunOptions:
    out: Path
    cell_timeout: float = 3600.0
    load_timeout: float = 1800.0
    retries: int = 1  # runs of a cell, or of a launch group's load, after its job crashed (launch.run_group)
    cpu_threads: int = 1
    trust_remote_code: bool = False
    rdzv: Rendezvous = field(default_factory=Rendezvous)
    gate: bool = False
    argv: list[str] = field(default_factory=list)
    side_by_side: bool = True  # launch groups that fit on the node's GPUs at the same time


# ------------------------------------------------------------------------------ the run


def cell_settings(cell: Cell, plan: Plan, ref: ModelRef, suite: Suite, reference: Cell | None = None) -> dict[str, Any]:
    """What makes a cell's record what it is; a record on disk is reused only with the same.
    A score cell scores `reference`'s greedy tokens, so that cell is one of its settings."""
    m = plan.matrix
    return {
        "id": cell.id, "engine": cell.engine, "tp": cell.tp, "batch_size": cell.batch_size, "nccl": cell.nccl,
        "nccl_env": m.nccl[cell.nccl], "kernels": cell.kernels, "mode": cell.mode, "model": ref.id,
        "dtype": m.dtype, "device": m.device, "probes": suite.name, "probes_sha256": suite.sha256, "topk": m.topk,
        "max_new_tokens": m.max_new_tokens, **({"trace": True} if m.trace else {}),
        **({"vllm_args": m.vllm_args} if cell.engine == "vllm" and m.vllm_args else {}),
        # Only where not cold, so that a record made before scenarios existed still resumes.
        **({"scenario": cell.scenario} if cell.scenario != "cold" else {}),
        **({"scores_tokens_of": reference.id} if reference is not None and cell.mode == "score" else {}),
    }


def needs_reference(plan: Plan, prompts: list[PromptSpec]) -> bool:
    return "score" in plan.matrix.modes and any(p.completion is None for p in prompts)


def _check_existing(run_dir: Path, plan: Plan, settings: dict[str, dict[str, Any]], ref: ModelRef,
                    tok_meta: dict[str, Any]) -> dict[str, RecordMeta]:
    """Cells already on disk: reused when made with the same settings, refused otherwise."""
    done = {}
    for cid, want in settings.items():
        path = cell_path(run_dir, cid)
        if not path.exists():
            continue
        meta = read_meta(path)
        # The settings name the model by id only; a Hub repo (or a local directory) updated since
        # keeps its id, and its records would put two models' numbers in one matrix.
        for what, had, has in (("weights", meta.model.get("weights_sha256"), ref.weights_sha256),
                               ("tokenizer", meta.tokenizer.get("sha256"), tok_meta.get("sha256"))):
            if had != has:
                raise InputError(f"{run_dir} already holds cell {cid} made with other {what} of {ref.id} "
                                 f"(sha256 {had} → {has}); use another --out")
        have = meta.cell
        if have != want:
            diff = ", ".join(f"{k}: {have.get(k)!r} → {want.get(k)!r}" for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
            raise InputError(f"{run_dir} already holds cell {cid} made with other settings ({diff}); use another --out")
        done[cid] = meta
    return done


def _mark_reused(entry: dict[str, Any], meta: RecordMeta) -> None:
    """A cell whose record was on disk before this run: done, with its row count from the record and
    the time of the run that made it where the manifest kept it (a record written by a job that
    outlived its run has none); `reused` says this run did not compute it."""
    entry.update(status="done", reason=None, rows=meta.num_rows, reused=True)


_CELL_NUMBERS = ("seconds", "rows", "timing", "ranks_differ")


def mark_refused(manifest: Manifest, plan: Plan, ref: ModelRef, suite: Suite, reference: Cell | None) -> None:
    """A refused combination (plan.refused) has an entry that says so and why, and is never launched."""
    for cell, reason in plan.refused:
        entry = manifest.cell(cell.id)
        for key in _CELL_NUMBERS:
            entry.pop(key, None)
        entry.update(status="refused", reason=reason, reused=False, settings=cell_settings(cell, plan, ref, suite, reference))


class _Stop:
    """SIGINT/SIGTERM set a flag; the launcher ends the job and the run exits cleanly."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:  # noqa: ANN001
        self.signal = signum

    def __bool__(self) -> bool:
        return self.signal is not None


def _job_env(group_env: dict[str, str], device: str, cpu_threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE"]:
        del env[key]  # a preset is the whole NCCL environment of its job
    if device == "cuda":  # NCCL's own account of what it chose; a preset that sets these wins
        env.update(nccl_debug_env(torch_nccl_version()))
    env.update(group_env)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(cpu_threads)
    if device == "cpu":
        env.pop("TRITON_INTERPRET", None)  # tbik's CPU backend, not Triton's (far slower) interpreter
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def check_options(matrix: Matrix, opts: RunOptions) -> None:
    """The run's own settings, refused before anything is loaded or created."""
    for flag, seconds in (("--timeout", opts.cell_timeout), ("--load-timeout", opts.load_timeout)):
        if not seconds > 0:  # NaN too
            raise InputError(f"{flag} {seconds:g}: must be a positive number of seconds")
    if opts.cpu_threads < 1:
        raise InputError("--cpu-threads must be at least 1")
    r = opts.rdzv
    if r.nnodes < 1 or not 0 <= r.node_rank < r.nnodes:
        raise InputError(f"--node-rank {r.node_rank} must be in [0, --nnodes {r.nnodes})")
    if r.nnodes > 1 and (not r.endpoint or not r.endpoint.rpartition(":")[2].isdigit()):
        raise InputError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    if r.nnodes > 1 and any(t % r.nnodes for t in matrix.tps):
        raise InputError(f"--tp {','.join(map(str, matrix.tps))}: every TP size must be a multiple of --nnodes {r.nnodes}")


def run(matrix: Matrix, opts: RunOptions, console: Console | None = None,
        summarize: Callable[[Plan, Path, Manifest, Console], bool] | None = None) -> int:
    """Run the matrix; then, on the leader, `summarize` compares the cells (the compare stage's job,
    handed in so the run stage never imports it) and says whether every pair passed."""
    console = console or Console(stderr=False)
    started = time.perf_counter()
    check_options(matrix, opts)
    # torch makes its compile cache in the system temp dir on import, triton in ~/.triton: both belong in
    # repaudit's own cache (unless the user chose a place), so a run writes only there and in --out.
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ.setdefault(var, str(builtin.cache_dir() / sub))
    suite = load_suite(matrix.probes)
    plan = expand(matrix)
    matrix = plan.matrix  # with `auto` resolved
    ref = resolve_model(matrix.model)
    shape, max_positions = model_shape(ref, opts.trust_remote_code)
    visible = None
    if matrix.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if not visible:
            raise InputError("--device cuda: no CUDA GPU is visible (torch.cuda.device_count() is 0); use --device cpu")
    validate_against_model(plan, shape, visible, opts.rdzv.nnodes)
    if "hf" in matrix.engines:
        from ..engines import hf

        hf.cfg_check(str(ref.path), opts.trust_remote_code)  # what the engine cannot run, refused before any job
    if "vllm" in matrix.engines:
        from ..engines import vllm_engine

        vllm_engine.require(matrix.device, opts.rdzv.nnodes)
        if "tbik" in matrix.kernels:
            vllm_engine.check_tbik(str(ref.path), matrix.vllm_args)
    tok = load_tokenizer(ref, opts.trust_remote_code)
    prompts = tokenize(suite, tok, matrix.max_new_tokens, max_positions)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise InputError(f"--model {ref.id}: the tokenizer has neither a pad nor an EOS token")
    tok_meta = tokenizer_meta(tok, ref.id)
    reference_cell = plan.reference_source if needs_reference(plan, prompts) else None
    if reference_cell is not None and reference_cell not in plan.cells:
        plan = expand_with(plan, reference_cell)
    for note in plan.notes:
        console.print(f"[dim]note: {escape(note)}[/]")

    run_dir = opts.out
    run_dir.mkdir(parents=True, exist_ok=True)
    inplace = inside_torchrun()
    if inplace:
        _check_inplace(plan)
    leader = opts.rdzv.node_rank == 0 and int(os.environ.get("RANK", "0")) == 0
    settings = {c.id: cell_settings(c, plan, ref, suite, reference_cell) for c in plan.cells}
    with RunLock(run_dir) if leader else contextlib.nullcontext() as lock:
        if leader:
            remove_partial_files(run_dir)
        already = _check_existing(run_dir, plan, settings, ref, tok_meta) if leader else {}
        manifest = Manifest.load_or_new(run_dir)
        m = manifest.data
        m.command, m.matrix, m.baseline = opts.argv, _matrix_json(plan), plan.baseline.id
        m.reference_cell = reference_cell.id if reference_cell else None
        m.probes, m.tokenizer, m.environment = suite.meta, tok_meta, environment(matrix.device)
        m.model = {"id": ref.id, "path": str(ref.path), "weights_sha256": ref.weights_sha256}
        m.runs.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": opts.argv})
        for cid in settings:
            entry = manifest.cell(cid)
            entry["settings"] = settings[cid]
            entry["file"] = str(cell_path(run_dir, cid).relative_to(run_dir))
            if cid in already:
                _mark_reused(entry, already[cid])
            else:  # never run, failed, or done but its record is gone: computed afresh
                for key in _CELL_NUMBERS:
                    entry.pop(key, None)
                entry.update(status="pending", reason=None, reused=False)
        mark_refused(manifest, plan, ref, suite, reference_cell)
        if leader:
            manifest.save()
        stop = _Stop()
        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            _run_groups(plan, opts, run_dir, manifest, settings, already, prompts, ref, suite, tok_meta,
                        pad_id, stop_ids(ref.path, tok), reference_cell, stop, console, leader, inplace,
                        (lock.fd,) if lock else ())
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            if leader:
                remove_partial_files(run_dir)
        if inplace and not stop:
            from .worker import release_group

            release_group()
        # The matrix's wall time is every invocation's that worked on this directory: a resumed
        # run's cells and loads come from earlier invocations too, which its own wall time alone
        # would leave out (a matrix shorter than the cells it holds).
        m.runs[-1]["wall_s"] = time.perf_counter() - started
        m.wall_s = sum(r.get("wall_s", 0.0) for r in m.runs)
        if leader:
            manifest.save()
        if stop:
            console.print(f"[yellow]interrupted ({signal.Signals(stop.signal).name}); completed cells are kept, re-run the same command to resume[/]")
            return 130
        if not leader:
            return 0
        passed = summarize(plan, run_dir, manifest, console) if summarize else True
    failed = [cid for cid, c in manifest.data.cells.items() if cid in settings and c.get("status") != "done"]
    if failed:
        console.print(f"[red]{len(failed)} cell(s) did not complete: {', '.join(failed)}[/] (reasons in {escape(str(run_dir / 'manifest.json'))})")
        return 1
    if opts.gate and not passed:
        return 1
    return 0


def inside_torchrun() -> bool:
    """`repaudit run` started by torchrun (or srun + torchrun): run the worker in this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _check_inplace(plan: Plan) -> None:
    if "vllm" in plan.matrix.engines:
        raise InputError("--engine vllm starts its own TP workers and cannot run inside torchrun; run repaudit outside it")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    wrong = sorted({g.tp for g in plan.groups if g.tp != world})
    if wrong:
        raise InputError(f"inside torchrun with WORLD_SIZE={world}, every TP size must be {world}; got {wrong}")
    if len(plan.matrix.nccl) > 1:
        raise InputError("inside torchrun, NCCL is set up once per process: give one --nccl preset per launch")


def _matrix_json(plan: Plan) -> dict[str, Any]:
    return {**plan.matrix.to_manifest(), "groups": [g.id for g in plan.groups]}


def _run_groups(plan, opts, run_dir, manifest, settings, already, prompts, ref, suite, tok_meta, pad_id, stops,
                reference_cell, stop, console, leader, inplace, lock_fds) -> None:
    job_dir = run_dir / "jobs" / f"node{opts.rdzv.node_rank}"
    job_dir.mkdir(parents=True, exist_ok=True)
    todo_total = sum(1 for c in plan.cells if c.id not in already)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)
    with progress:
        cells_task = progress.add_task("cells", total=todo_total)
        tokens_task = progress.add_task("tokens", total=1, visible=False)

        lock = threading.Lock()  # groups side by side report from their own threads
        reference_failed = job_dir / "reference-failed"

        def on_event(ev: dict) -> None:
            with lock:
                _on_event(ev)

        def _on_event(ev: dict) -> None:
            kind, cid = ev["event"], ev.get("cell")
            if ev.get("rank", 0) != 0 and kind in ("cell_start", "progress", "cell_done"):
                return  # every rank reports; rank 0 speaks for the job (the launcher weighs all ranks)
            if kind == "cell_start":
                progress.update(tokens_task, description=f"  {cid}", completed=0, total=1, visible=True)
                if leader:
                    manifest.set_cell(cid, status="running")
            elif kind == "progress":
                progress.update(tokens_task, completed=ev["tokens"], total=ev["total"])
            elif kind == "cell_done":
                if leader:  # rank 0 reports done once the record is on disk: what a re-run counts as done
                    manifest.set_cell(cid, status="done", reason=None, reused=False,
                                      **{k: ev[k] for k in _CELL_NUMBERS})
                progress.advance(cells_task)
                progress.console.print(done_line(cid, ev))
            elif kind == "cell_retry":
                progress.console.print(f"[yellow]retry[/] {cid} (try {ev['attempt']}): {escape(ev['reason'])}")
            elif kind == "job_retry":
                progress.console.print(f"[yellow]retry[/] launch group {ev['group']}: {escape(ev['reason'])}")
            elif kind == "cell_settled" and ev["status"] not in ("done", "skipped", "interrupted"):
                progress.console.print(f"[red]{ev['status']}[/] {cid}: {escape(str(ev['reason']))}")
                if reference_cell and cid == reference_cell.id:
                    # Score cells waiting for its record (in other groups, or in the next attempt of its
                    # own) fail now, with this reason, instead of waiting out the run.
                    write_text_atomic(reference_failed, f"{reference_cell.id}: {ev['status']}: {ev['reason']}\n")

        abort = threading.Event()
        stopping = lambda: bool(stop) or abort.is_set()  # noqa: E731
        # Where other processes cannot see what this one skips, the workers decide (rank 0 broadcasts).
        shared_view = opts.rdzv.nnodes == 1 and not inplace
        todo = lambda g: [c for c in g.cells if c.id not in already] if shared_view else list(g.cells)  # noqa: E731

        def launch(group, gpus: list[str] | None) -> None:
            try:
                _launch(group, todo(group), gpus)
            except BaseException:
                abort.set()
                raise

        def _launch(group, cells, gpus: list[str] | None) -> None:
            spec = JobSpec(
                group_id=group.id, engine=group.engine, model_path=str(ref.path), dtype=plan.matrix.dtype,
                device=plan.matrix.device, tp=group.tp, out_dir=str(run_dir), events_dir="",
                cells=[settings[c.id] for c in cells], prompts=prompts, stop_ids=list(stops), pad_id=pad_id, topk=plan.matrix.topk,
                reference_cell=reference_cell.id if reference_cell else None, probes=suite.meta, tokenizer=tok_meta,
                model={"id": ref.id, "weights_sha256": ref.weights_sha256}, cpu_threads=opts.cpu_threads,
                trust_remote_code=opts.trust_remote_code, extra={"trace": plan.matrix.trace, "vllm_args": plan.matrix.vllm_args,
                       **({"reference_failed_marker": str(reference_failed)} if gpus is not None else {})},
            )
            if inplace:
                outcome = _run_inplace(spec, job_dir, group.nccl_env, on_event)
            else:
                env = _job_env(group.nccl_env, plan.matrix.device, opts.cpu_threads)
                if gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
                outcome = run_group(spec, job_dir,
                    nproc=1 if group.engine == "vllm" else group.tp // opts.rdzv.nnodes, rdzv=opts.rdzv, cell_timeout=opts.cell_timeout,
                    load_timeout=opts.load_timeout, env=env, on_event=on_event, should_stop=stopping, pass_fds=lock_fds,
                    retries=opts.retries)
            with lock:
                if leader:
                    _record_group(group, outcome)

        def _record_group(group, outcome) -> None:
            g = manifest.data.groups.setdefault(group.id, {})
            # A group run again by a resumed run keeps the earlier invocations' loads: the matrix's
            # wall time sums every invocation's too.
            g.update(load_s=[*g.get("load_s", []), *outcome.load_seconds],
                     attempts=g.get("attempts", 0) + outcome.attempts)
            if outcome.job_retried:  # jobs that crashed outside any cell (loading), then ran again
                g["retried"] = [*g.get("retried", []), *outcome.job_retried]
            if plan.matrix.device == "cuda" and group.tp > 1 and outcome.logs:
                g["nccl_observed"] = group_observation(outcome.logs, group.nccl_env)
                for warning in g["nccl_observed"]["warnings"]:
                    progress.console.print(f"[yellow]warning:[/] {group.id}: {escape(warning)}")
            for cid, oc in outcome.cells.items():
                entry = manifest.cell(cid)
                if oc.status == "skipped":  # the workers found its record (where they decide what is left)
                    _mark_reused(entry, read_meta(cell_path(run_dir, cid)))
                    continue
                fields = {"status": "pending" if oc.status == "interrupted" else oc.status, "reason": oc.reason}
                if oc.status == "done":
                    fields.update(seconds=oc.seconds, rows=oc.rows, timing=oc.timing, ranks_differ=oc.ranks_differ)
                entry.update(fields)
                # Why its crashed tries ended: a crash is news even when a retry got through.
                entry.pop("retried", None)
                if cid in outcome.retried:
                    entry["retried"] = outcome.retried[cid]
            manifest.save()


        groups = [g for g in plan.groups if todo(g)]
        gpus = _side_by_side_gpus(plan, opts, inplace)
        if gpus:
            reference_failed.unlink(missing_ok=True)
            run_side_by_side(groups, gpus, need=lambda g: g.tp, launch=launch, stopping=stopping)
        else:
            for group in groups:
                if stopping():
                    break
                launch(group, None)

def _side_by_side_gpus(plan: Plan, opts: RunOptions, inplace: bool) -> list[str] | None:
    """The GPUs to share out among groups running at once, or None to run groups one by one
    (CPU, several nodes, inside the caller's torchrun, or fewer GPUs than two groups need)."""
    if not opts.side_by_side or plan.matrix.device != "cuda" or opts.rdzv.nnodes > 1 or inplace or len(plan.groups) < 2:
        return None
    import torch

    gpus = visible_gpus(torch.cuda.device_count())
    return gpus if len(gpus) >= 2 * min(g.tp for g in plan.groups) else None


def _run_inplace(spec: JobSpec, job_dir: Path, nccl_env: dict[str, str], on_event) -> GroupOutcome:
    """One group inside the caller's torchrun job: no supervisor (a failing cell ends the
    processes, torchrun reports it), no timeouts."""
    from .worker import run_job

    os.environ.update(nccl_env)  # read by NCCL when the worker creates its communicator
    spec.events_dir = str(job_dir / f"{spec.group_id}.inplace")
    begun = time.time()  # the folder outlives a run: an earlier run's events in it are not this one's
    run_job(spec)
    outcome = GroupOutcome(attempts=1)
    for ev in (e for e in EventReader(Path(spec.events_dir)).poll() if e["t"] >= begun):
        on_event(ev)
        if ev["event"] == "loaded" and ev["rank"] == 0:
            outcome.load_seconds.append(ev["seconds"])
        elif ev["event"] == "cell_skip":
            outcome.cells.setdefault(ev["cell"], CellOutcome("skipped"))
        elif ev["event"] == "cell_done" and ev["rank"] == 0:
            outcome.cells[ev["cell"]] = CellOutcome("done", seconds=ev["seconds"], rows=ev["rows"],
                                                    timing=ev["timing"], ranks_differ=ev["ranks_differ"])
    return outcome
