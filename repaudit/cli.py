"""The `repaudit` command line: argument parsing and exit codes, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from . import commands
from .compare.result import Thresholds
from .errors import EXIT_INPUT, EXIT_INTERRUPTED, InputError, os_error_exit_code

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Audit the numerical reproducibility of LLM inference, bit by bit.",
)


@app.callback()
def _root() -> None:
    """Audit the numerical reproducibility of LLM inference, bit by bit."""


@app.command()
def diff(
    a: Path = typer.Argument(..., help="first record (.parquet)"),
    b: Path = typer.Argument(..., help="second record (.parquet)"),
    max_ulp: Optional[int] = typer.Option(None, "--max-ulp", min=0, help="pass if every logprob is within N ULP"),
    max_abs: Optional[float] = typer.Option(None, "--max-abs", min=0.0, help="pass if every |Δ logprob| <= X"),
    max_seq_divergence: float = typer.Option(0.0, "--max-seq-divergence", min=0.0, max=1.0,
                                             help="fraction of sequences whose tokens may differ"),
    allow_partial: bool = typer.Option(False, "--allow-partial", help="compare only the prompts both records share"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the full result as JSON"),
    markdown_out: Optional[Path] = typer.Option(None, "--markdown", help="write a Markdown report"),
    html_out: Optional[Path] = typer.Option(None, "--html", help="write an HTML report with plots (self-contained)"),
    clip: str = typer.Option("0.5,2.0", "--clip", help="RL metrics: importance-ratio bounds LO,HI for clip_frac (0 <= LO < HI)"),
) -> None:
    """Compare two records bit by bit (A: rollout / reference). Exit 0 within thresholds (default: identical), 1 beyond, 2 bad input."""
    th = Thresholds(max_ulp=max_ulp, max_abs=max_abs, max_seq_divergence=max_seq_divergence)
    raise typer.Exit(commands.diff(a, b, thresholds=th, allow_partial=allow_partial, clip=_clip(clip),
                                   json_path=json_out, markdown_path=markdown_out, html_path=html_out))


def _clip(text: str) -> tuple[float, float]:
    bounds = _csv(text, "--clip", float)
    if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1]:  # NaN fails the comparison too
        raise InputError(f"--clip {text!r}: expected LO,HI with 0 <= LO < HI (e.g. 0.8,1.25)")
    return bounds


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="run directory (made by repaudit run)"),
    max_ulp: Optional[int] = typer.Option(None, "--max-ulp", min=0, help="verdict: tolerate logprobs within N ULP"),
    max_abs: Optional[float] = typer.Option(None, "--max-abs", min=0.0, help="verdict: tolerate |Δ logprob| <= X"),
    max_seq_divergence: float = typer.Option(0.0, "--max-seq-divergence", min=0.0, max=1.0,
                                             help="verdict: fraction of sequences whose tokens may differ"),
    html_out: Optional[Path] = typer.Option(None, "--html", help="where to write the HTML report (default RUN_DIR/report.html)"),
    markdown_out: Optional[Path] = typer.Option(None, "--markdown", help="where to write the Markdown report (default RUN_DIR/report.md)"),
) -> None:
    """Write RUN_DIR/report.html (plots, self-contained) and RUN_DIR/report.md. Exit 0 once written, 2 bad input."""
    th = Thresholds(max_ulp=max_ulp, max_abs=max_abs, max_seq_divergence=max_seq_divergence)
    raise typer.Exit(commands.report(run_dir, thresholds=th, html_path=html_out, markdown_path=markdown_out))


@app.command()
def gate(
    paths: list[Path] = typer.Argument(..., help="a run directory, or two records A.parquet B.parquet (A is the reference)"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="write JUnit XML: one test case per cell pair"),
    max_ulp: Optional[int] = typer.Option(None, "--max-ulp", min=0, help="pass if every logprob is within N ULP"),
    max_abs: Optional[float] = typer.Option(None, "--max-abs", min=0.0, help="pass if every |Δ logprob| <= X"),
    max_seq_divergence: float = typer.Option(0.0, "--max-seq-divergence", min=0.0, max=1.0,
                                             help="fraction of sequences whose tokens may differ"),
    allow_partial: bool = typer.Option(False, "--allow-partial", help="two records: compare only the prompts both share"),
) -> None:
    """Every cell against its reference (or B against A). Exit 0 all within thresholds, 1 any beyond or failed, 2 bad input."""
    th = Thresholds(max_ulp=max_ulp, max_abs=max_abs, max_seq_divergence=max_seq_divergence)
    raise typer.Exit(commands.gate(paths, thresholds=th, junit_path=junit, allow_partial=allow_partial))


def _csv(text: str, flag: str, cast=str) -> tuple:
    if not text.strip():
        return ()  # the empty list (--reference-per "": keep no dimension)
    items = [x.strip() for x in text.split(",")]
    # An empty item ("1,,2", a trailing comma) or Python's digit separators ("1_0") are typos,
    # not values: refused rather than read as something else.
    bad = any(not x for x in items) or (cast is not str and any("_" in x for x in items))
    try:
        if bad:
            raise ValueError
        return tuple(cast(x) for x in items)
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected a comma-separated list of {cast.__name__} values") from None


def _key_values(items: list[str], flag: str) -> dict:
    import json

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@app.command()
def run(
    model: str = typer.Option("builtin:tiny-qwen3", "--model", help="Hugging Face id, local path, or builtin:NAME"),
    engine: str = typer.Option("hf", "--engine", help="engines, comma-separated: hf, vllm"),
    tp: str = typer.Option("1,2", "--tp", help="tensor-parallel sizes, e.g. 1,2,4,8"),
    batch_size: str = typer.Option("1,4", "--batch-size", help="batch sizes, e.g. 1,8,32"),
    nccl: str = typer.Option("default", "--nccl", help="NCCL presets: default, ring, tree, deterministic, or --nccl-set names"),
    nccl_set: list[str] = typer.Option([], "--nccl-set", help="define a preset: NAME:NCCL_VAR=VALUE[,NCCL_VAR=VALUE]"),
    kernels: str = typer.Option("stock,tbik", "--kernels", help="kernel modes: stock, bi, tbik"),
    mode: str = typer.Option("generate,score", "--mode", help="generate (greedy) and/or score (teacher forcing)"),
    scenario: str = typer.Option("cold", "--scenario", help="vLLM cells: cold, prefix-hit, chunked-prefill:N, eager, "
                                 "fp8-kv, spec-ngram (each compared with its cold twin; docs/vllm.md)"),
    probes: str = typer.Option("smoke", "--probes", help="probe suite name (smoke, default, chat) or path to a .jsonl"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="override every prompt's generation length"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    topk: int = typer.Option(5, "--topk", help="top-k logprobs to record per position (0 = off)"),
    out: Path = typer.Option(Path("reports/run"), "--out", help="run directory"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="baseline cell id (default: the first cell)"),
    reference_per: str = typer.Option("kernels,mode", "--reference-per",
                                      help="dimensions a cell keeps when picking its reference from the baseline"),
    timeout: float = typer.Option(3600.0, "--timeout", help="seconds a cell may run before its job is ended"),
    load_timeout: float = typer.Option(1800.0, "--load-timeout", help="seconds a model load may take"),
    retries: int = typer.Option(1, "--retries", min=0, help="times a cell (or a launch group's load) runs again after its job "
                                "crashed (a process aborted or faulted, no rank raised an error of its own)"),
    cpu_threads: int = typer.Option(1, "--cpu-threads", help="intra-op threads per rank on CPU (fixed: thread count changes bits)"),
    side_by_side: bool = typer.Option(True, "--side-by-side/--one-group-at-a-time",
                                      help="on GPUs, run launch groups that fit on the node at the same time"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow model code from the Hub"),
    nnodes: int = typer.Option(1, "--nnodes", help="nodes in the job (same command on every node)"),
    node_rank: int = typer.Option(0, "--node-rank", help="this node's rank"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="host:port of node 0 (several nodes)"),
    trace: bool = typer.Option(False, "--trace", help="record a digest of every module's output (for `repaudit locate`)"),
    vllm_arg: list[str] = typer.Option([], "--vllm-arg", help="a vLLM engine argument, KEY=VALUE (VALUE as JSON if it parses)"),
    gate: bool = typer.Option(False, "--gate", help="exit 1 if any cell diverges from its reference"),
    max_ulp: Optional[int] = typer.Option(None, "--max-ulp", min=0, help="with --gate: tolerated ULP distance"),
    max_abs: Optional[float] = typer.Option(None, "--max-abs", min=0.0, help="with --gate: tolerated |Δ logprob|"),
) -> None:
    """Run the audit matrix and compare every cell with its reference."""
    import sys as _sys

    from .run import nccl as nccl_presets
    from .run.launch import Rendezvous
    from .run.plan import Matrix
    from .run.runner import RunOptions

    custom = dict(nccl_presets.parse_custom(s) for s in nccl_set)
    names = list(_csv(nccl, "--nccl"))
    names += [n for n in custom if n not in names]
    # `auto` device and dtype are resolved, and the options checked, by the run: the Python API shares them.
    matrix = Matrix(
        model=model, engines=_csv(engine, "--engine"), tps=_csv(tp, "--tp", int),
        batch_sizes=_csv(batch_size, "--batch-size", int),
        nccl=nccl_presets.resolve(names, custom), kernels=_csv(kernels, "--kernels"), modes=_csv(mode, "--mode"),
        dtype=dtype, device=device, probes=probes, max_new_tokens=max_new_tokens, topk=topk, baseline=baseline,
        reference_per=_csv(reference_per, "--reference-per"), trace=trace, vllm_args=_key_values(vllm_arg, "--vllm-arg"),
        scenarios=_csv(scenario, "--scenario"),
    )
    opts = RunOptions(
        out=out, cell_timeout=timeout, load_timeout=load_timeout, retries=retries, cpu_threads=cpu_threads,
        trust_remote_code=trust_remote_code, gate=gate, argv=["repaudit"] + _sys.argv[1:], side_by_side=side_by_side,
        rdzv=Rendezvous(nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint),
    )
    raise typer.Exit(commands.run(matrix, opts, thresholds=Thresholds(max_ulp=max_ulp, max_abs=max_abs)))


@app.command()
def locate(
    a: Path = typer.Argument(..., help="first cell: its record (RUN/cells/CELL.parquet) or trace (.trace.parquet)"),
    b: Path = typer.Argument(..., help="second cell, the same way"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the result as JSON"),
) -> None:
    """Name the first module whose output bits differ between two traced cells. Exit 0 none, 1 found, 2 bad input."""
    raise typer.Exit(commands.locate(a, b, json_path=json_out))


def _fail(message: str, code: int = EXIT_INPUT) -> int:
    print(f"repaudit: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point. Every bad input ends as one line on stderr and exit code 2; a failure of the
    machine (disk full, read-only file system) as one line and exit code 5."""
    try:
        result = app(args=argv, standalone_mode=False)
    except InputError as exc:
        return _fail(str(exc))
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):  # outside a command's body (typer answers 130 inside it)
        return _fail("interrupted", EXIT_INTERRUPTED)
    except PermissionError as exc:
        return _fail(f"permission denied: {exc.filename or exc}")
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), os_error_exit_code(exc))
    except Exception as exc:
        if not hasattr(exc, "format_message"):  # not a usage error (click's or typer's): a real bug
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(exc.format_message(), file=sys.stderr)
            return 2
        return _fail(" ".join(exc.format_message().split()))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
