"""A vLLM cell against plain vLLM, side by side in one process: the same LLM object, the same
prompts, the same engine settings. `plain` is what a user runs (LLM.generate, greedy, no
logprobs); `plain_logprobs` the same with the logprobs a cell asks for (top-k, flat), so what
vLLM's own logprobs cost shows apart from repaudit's conversion; `cell` is repaudit's vLLM
engine as `repaudit run` calls it (top-k logprobs of every generated token, converted into
record rows). Runs alternate, median of --runs.

With stock first in --kernels, every later mode's row also gets `stock_plain_tok_s`,
`ratio_vs_stock` (its cell against plain stock vLLM) and `plain_ratio_vs_stock` (plain vLLM in
this mode against plain stock vLLM: what tbik through the plugin costs a user's generation).
Every row has `prefill_only_s`: the prompts alone (one new token each, median of three), and
`main_gc_s`: this process's seconds in garbage collection during each run. Each timed run starts
from a collected heap (--no-collect: not). --steps adds `plain_step_s`, rank 0's seconds from each
model step to the next in every plain run (benchmarks/step_times.py reads them).

One process per kernel mode (vLLM reads its switches at start-up), so the script starts itself
once per mode and gathers the rows. By default the modes run one after the other, each its runs
in a row. With --interleave every mode's vLLM is loaded at once on the same GPUs (each with an
equal share of GPU memory, `gpu_memory_utilization` in the row's vllm_args), and the modes take
their runs in turn, so that what the machine does meanwhile falls on every mode alike:

    python3 benchmarks/vllm_speed.py --model DIR --tp 1 --kernels stock,bi,tbik --json reports/perf/vllm_speed.json
    python3 benchmarks/vllm_speed.py --model DIR --tp 2 --kernels stock,tbik --interleave --steps --runs 7

--fixture F also saves a few of the cell's real vLLM outputs in JSON with the rows repaudit made
of them (tests/test_vllm_engine.py converts them again on CPU and compares bit for bit), and
beside F, vllm_capture.json: the same requests with vLLM's own logprobs and captured in its
workers (tests/test_vllm_capture.py checks that both give the same rows).

--profile DIR then profiles one plain generation and one cell in every worker (GPU time per
kernel); with --timeline the plain one records the host's ops too, and every rank's Chrome trace
and its GPU idle gaps (benchmarks/timeline.py) land in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]


def random_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """The workload: n prompts of 64-512 random token ids below the model's vocabulary size
    (benchmarks/engine_speed.py --random draws the same ones)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=int(rng.integers(64, 513))).tolist() for _ in range(n)]


def _device_name(tp: int) -> str:
    """The GPUs the job uses: tp of them (vLLM takes the first tp visible ones)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = out.stdout.strip().splitlines()
    return f"{tp}x {names[0]}" if names else platform.node()


@dataclass
class Bench:
    """One mode's loaded LLM, its workload and what its timed runs gave so far."""
    llm: object
    prompts: list
    seqs: list
    requests: list
    plain_params: object
    lp_params: object
    clock: dict
    began: float = field(default_factory=time.perf_counter)
    plain: list = field(default_factory=list)  # (seconds, generated tokens) per run
    with_lp: list = field(default_factory=list)
    cell: list = field(default_factory=list)
    capture_host: list = field(default_factory=list)
    gc_s: dict = field(default_factory=lambda: {"plain": [], "plain_logprobs": [], "cell": []})
    plain_steps: list = field(default_factory=list)  # with --steps: rank 0's seconds from each model step to the next, per plain run
    lp_outs: list | None = None  # the last two runs with vLLM's logprobs
    lp_before: list | None = None
    rows: list | None = None  # the last cell's rows

    def say(self, what: str) -> None:
        print(f"{time.perf_counter() - self.began:7.1f}s {what}", flush=True)


def start(args) -> Bench:
    """This process's vLLM for args.kernels, loaded and warmed up on the workload."""
    from repaudit.engines import vllm_engine

    vllm_engine.scrub_launcher_env(os.environ)
    os.environ.update(vllm_engine.process_env(args.kernels))
    from transformers import AutoConfig
    from vllm import SamplingParams

    from repaudit.engines.base import Sequence

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = random_prompts(vocab, args.prompts)
    llm = vllm_engine.load(vllm_engine.engine_args(model_path=args.model, tp=args.tp, dtype="bfloat16",
                                                   batch_size=args.prompts, max_len=512 + args.new + 1, topk=args.topk,
                                                   kernels=args.kernels, extra=json.loads(args.vllm_args)))
    b = Bench(llm=llm, prompts=prompts, seqs=[Sequence(f"p{i}", tuple(p), None, args.new) for i, p in enumerate(prompts)],
              requests=[{"prompt_token_ids": p} for p in prompts],
              plain_params=SamplingParams(temperature=0.0, max_tokens=args.new, detokenize=False),
              # What the cell asks vLLM for, without repaudit's conversion: vLLM's own cost of logprobs.
              lp_params=vllm_engine.sampling_params(args.new, args.topk, (), False), clock=_gc_clock())
    # Warm-up of every path at full size: compilation, graph capture, allocator growth.
    llm.generate(b.requests, b.plain_params, use_tqdm=False)
    b.say("warm-up: plain")
    llm.generate(b.requests, b.lp_params, use_tqdm=False)
    b.say("warm-up: with logprobs")
    vllm_engine.generate(llm, b.seqs, args.topk, stop_ids=())
    b.say("warm-up: cell")
    return b


def run_once(b: Bench, args) -> None:
    """One timed run of each: plain, with vLLM's logprobs, the cell."""
    from repaudit.engines import vllm_engine

    llm = b.llm
    for params, runs, label in ((b.plain_params, b.plain, "plain"), (b.lp_params, b.with_lp, "plain_logprobs")):
        if args.steps and label == "plain":
            llm.collective_rpc("repaudit_steps_begin")
        _before_run(args, b.clock)
        t0 = time.perf_counter()
        outs = llm.generate(b.requests, params, use_tqdm=False)
        runs.append((time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)))
        b.gc_s[label].append(b.clock["s"])
        if args.steps and label == "plain":
            b.plain_steps.append(llm.collective_rpc("repaudit_steps_end")[0])
        if params is b.lp_params:
            b.lp_before, b.lp_outs = b.lp_outs, outs
    _before_run(args, b.clock)
    t0 = time.perf_counter()
    b.rows, _ = vllm_engine.generate(llm, b.seqs, args.topk, stop_ids=())
    b.cell.append((time.perf_counter() - t0, _generated(b.rows)))
    b.gc_s["cell"].append(b.clock["s"])
    b.capture_host.append(llm.collective_rpc("repaudit_capture_host_s")[0])
    gc_s = b.gc_s
    b.say(f"run: plain {b.plain[-1][0]:.2f}s, with logprobs {b.with_lp[-1][0]:.2f}s, cell {b.cell[-1][0]:.2f}s "
          f"(this process's GC: {gc_s['plain'][-1]:.3f} / {gc_s['plain_logprobs'][-1]:.3f} / {gc_s['cell'][-1]:.3f}s)")


def finish(b: Bench, args) -> dict:
    """The mode's row from its runs, then the prompts alone, and --profile and --fixture's work."""
    from vllm import SamplingParams

    from repaudit.engines import vllm_engine

    llm, requests, seqs = b.llm, b.requests, b.seqs
    tok_s = lambda runs: statistics.median(n / s for s, n in runs)  # noqa: E731
    lp_rows = _rows(b.lp_outs, seqs, args.topk)
    row = {"device": _device_name(args.tp), "engine": "vllm", "kernels": args.kernels, "tp": args.tp, "prompts": args.prompts,
           "new_tokens": args.new, "topk": args.topk, "plain_tok_s": tok_s(b.plain), "repaudit_tok_s": tok_s(b.cell),
           "plain_logprobs_tok_s": tok_s(b.with_lp),
           "plain_runs_s": [s for s, _ in b.plain], "repaudit_runs_s": [s for s, _ in b.cell],
           # rank 0's host seconds in the capture's part of the sampling steps, per cell run
           "capture_host_s": b.capture_host,
           # this process's seconds in garbage collection during each run (vLLM's output
           # processing runs here; its engine core and workers freeze their own heaps)
           "main_gc_s": b.gc_s, "collect_before_runs": not args.no_collect,
           **({"plain_step_s": b.plain_steps} if args.steps else {}),
           # The cell's rows against the rows of vLLM's own logprobs for the same batch: tokens
           # whose token id, logprob and top-k ids and logprobs are all the same bits.
           "cell_rows_equal_vllm_logprobs": _same_rows(b.rows, lp_rows)}
    if b.lp_before is not None:  # the same share between two of vLLM's own runs: how far the batch itself moves the bits
        row["vllm_logprobs_runs_equal"] = _same_rows(_rows(b.lp_before, seqs, args.topk), lp_rows)
    row["ratio"] = row["repaudit_tok_s"] / row["plain_tok_s"]
    # The prompts alone (one new token each): the prefill steps, which run outside vLLM's CUDA
    # graphs once a step holds more tokens than its largest captured size.
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    prefill = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(requests, one, use_tqdm=False)
        prefill.append(time.perf_counter() - t0)
    row["prefill_only_s"] = statistics.median(prefill)
    if json.loads(args.vllm_args):
        row["vllm_args"] = json.loads(args.vllm_args)
    if args.profile:
        _profile(llm, lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(requests, b.plain_params, use_tqdm=False)),
                 args, "plain")
        _profile(llm, lambda: _generated(vllm_engine.generate(llm, seqs, args.topk, stop_ids=())[0]), args, "cell")
    if args.fixture:
        _fixture(llm, b.prompts, args)
        _capture_fixture(llm, b.prompts, args)
    return row


def one(args) -> dict:
    b = start(args)
    for _ in range(args.runs):
        run_once(b, args)
    return finish(b, args)


def serve(args) -> None:
    """--interleave's child: loads and warms up, says READY, then runs once per `run` line on
    stdin (answering RAN) and ends with its row on `finish`."""
    b = start(args)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            run_once(b, args)
            print("RAN", flush=True)
        elif line.strip() == "finish":
            print("ROW " + json.dumps(finish(b, args)), flush=True)
            return


def _gc_clock() -> dict:
    """Seconds this process spends in garbage collection from the last reset (clock["s"])."""
    import gc

    clock = {"s": 0.0, "t0": 0.0}

    def tick(phase, info):
        if phase == "start":
            clock["t0"] = time.perf_counter()
        else:
            clock["s"] += time.perf_counter() - clock["t0"]

    gc.callbacks.append(tick)
    return clock


def _before_run(args, clock: dict) -> None:
    """Each timed run starts from a collected heap (unless --no-collect): this process keeps
    the runs' outputs, and a full collection over them would otherwise land in whichever run
    crosses the collector's threshold."""
    import gc

    if not args.no_collect:
        gc.collect()
    clock["s"] = 0.0


# Kernel names to the op they serve, first match wins (tbik's Triton kernels, cuBLAS/CUTLASS,
# FlashAttention (a CUTLASS kernel too, hence before matmul), NCCL, vLLM's and Inductor's own).
COLLECTIVES = "all-reduce / all-gather"
_KINDS = ((COLLECTIVES, ("nccl", "allreduce", "all_reduce", "cross_device")),
          ("tree sum", ("_tree_sum",)),
          ("attention", ("attention", "flash", "fmha", "reshape_and_cache")),
          ("matmul", ("_tree_matmul", "gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")),
          ("norm / softmax / mean", ("norm", "softmax", "_mean", "rms")),
          ("rotary", ("rotary", "rope")),
          ("sampling / top-k", ("topk", "argmax", "sort", "sampl", "gumbel")))


def kernel_kind(name: str) -> str:
    """The op kind a kernel serves, by its name (_KINDS)."""
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other (elementwise, copies)")


def _generated(rows) -> int:
    """A cell's generated tokens: its rows past each prompt."""
    return sum(int((r.pos >= r.prompt_len).sum()) for r in rows)


def _profile(llm, run, args, label: str) -> None:
    """One generation (`run`: a plain one or a cell's; it answers its generated tokens) with
    torch.profiler in every worker: GPU time per kernel and per op kind, written to --profile
    DIR/vllm-<kernels>-tp<N>[-cell].json and printed for rank 0."""
    timeline = args.timeline and label == "plain"
    trace = str(Path(args.profile).resolve() / f"timeline-{args.kernels}-tp{args.tp}-rank{{rank}}.json") if timeline else None
    if timeline:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    llm.collective_rpc("repaudit_profile_begin", args=(timeline,))
    t0 = time.perf_counter()
    tokens = run()
    wall = time.perf_counter() - t0
    ranks = llm.collective_rpc("repaudit_profile_end", args=(trace,))
    if trace:
        import timeline as gaps  # benchmarks/timeline.py, beside this file

        for rank in range(args.tp):
            gaps.summarise(trace.format(rank=rank), Path(args.profile) / f"gaps-{args.kernels}-tp{args.tp}-rank{rank}.json", wall)
    summary = []
    for rank, kernels in enumerate(ranks):
        kinds: dict[str, float] = {}
        for k in kernels:
            kind = kernel_kind(k["name"])
            kinds[kind] = kinds.get(kind, 0.0) + k["us"]
        summary.append({"rank": rank, "gpu_us": sum(kinds.values()),
                        "by_kind_us": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "kernels": kernels[:60]})
    out = {"run": label, "kernels": args.kernels, "tp": args.tp, "device": _device_name(args.tp), "prompts": args.prompts,
           "new_tokens": args.new, "wall_s_profiled": wall, "tokens": tokens, "ranks": summary}
    path = Path(args.profile) / f"vllm-{args.kernels}-tp{args.tp}{'' if label == 'plain' else '-' + label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    r0 = summary[0]
    print(f"profile, {label} ({args.kernels}, TP={args.tp}, rank 0): {r0['gpu_us'] / 1e6:.3f} s of kernels in {wall:.3f} s", flush=True)
    for kind, us in r0["by_kind_us"].items():
        print(f"  {kind:32s} {us / 1e6:8.3f} s  {us / r0['gpu_us']:6.1%}", flush=True)
    for k in r0["kernels"][:15]:
        print(f"  {k['us'] / 1e3:10.1f} ms {k['count']:7d}x  {k['name'][:110]}", flush=True)


def _rows(outs, seqs, topk: int) -> list:
    """The rows of vLLM's own logprobs, as a cell would have made them before the capture."""
    from repaudit.engines import vllm_engine

    return [vllm_engine.rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=True) for o, s in zip(outs, seqs)]


def _same_rows(rows, others) -> float:
    """Share of generated tokens whose id, logprob and top-k are the same bits in both."""
    same = total = 0
    for r, v in zip(rows, others):
        n = min(len(r.pos), len(v.pos))
        eq = ((r.token_id[:n] == v.token_id[:n]) & (r.logprob[:n].view(np.uint32) == v.logprob[:n].view(np.uint32))
              & (r.topk_ids[:n] == v.topk_ids[:n]).all(1)
              & (r.topk_logprobs[:n].view(np.uint32) == v.topk_logprobs[:n].view(np.uint32)).all(1))
        same += int(eq.sum()) if len(r.pos) == len(v.pos) else 0
        total += max(len(r.pos), len(v.pos))
    return same / total if total else 1.0


def _capture_fixture(llm, prompts, args) -> None:
    """The same requests on one LLM with vLLM's own logprobs and captured in its workers, raw
    (tests/test_vllm_capture.py converts both on CPU and compares them bit for bit)."""
    import vllm

    from repaudit.engines import vllm_capture, vllm_engine

    topk, new = 3, 6
    reqs = [{"prompt_token_ids": p[:n]} for p, n in zip(prompts[:3], (9, 17, 33))]
    own = llm.generate(reqs, vllm_engine.sampling_params(new, topk, (), False), use_tqdm=False)
    assert all(llm.collective_rpc("repaudit_capture_begin", args=(vllm_engine.logprobs_k(topk),)))
    outs = llm.generate(reqs, vllm_engine.sampling_params(new, topk, (), False, logprobs=False), use_tqdm=False)
    packed = llm.collective_rpc("repaudit_capture_end")[0]
    cap = vllm_capture.unpack(packed)
    Path(args.fixture).with_name("vllm_capture.json").write_text(json.dumps({
        "vllm": vllm.__version__, "kernels": args.kernels, "topk": topk,
        "own": [vllm_engine.output_to_json(o) for o in own],
        "captured_outputs": [vllm_engine.output_to_json(o) for o in outs], "request_ids": [o.request_id for o in outs],
        "capture": {"req_ids": packed["req_ids"], "code": cap["code"].tolist(), "ids": cap["ids"].tolist(),
                    "logprob_bits": cap["logprobs"].view(np.uint32).tolist(), "sampled": cap["sampled"].tolist()}}, indent=1))


def _fixture(llm, prompts, args) -> None:
    from repaudit.engines import vllm_engine
    from repaudit.engines.base import Sequence

    topk, cases = 3, []
    for completion in (True, False):
        seqs = [Sequence(f"p{i}", tuple(p[:9]), None, 4) for i, p in enumerate(prompts[:2])]
        params = [vllm_engine.sampling_params(4 if completion else 1, topk, (), not completion)] * len(seqs)
        outs = llm.generate([{"prompt_token_ids": list(s.prompt)} for s in seqs], params, use_tqdm=False)
        for s, o in zip(seqs, outs):
            r = vllm_engine.rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=completion)
            cases.append({"prompt_id": s.prompt_id, "prompt_len": len(s.prompt), "topk": topk, "completion": completion,
                          "output": vllm_engine.output_to_json(o),
                          "rows": {"pos": r.pos.tolist(), "token_id": r.token_id.tolist(), "top1": r.top1.tolist(),
                                   "logprob_bits": r.logprob.view(np.uint32).tolist(),
                                   "topk_ids": r.topk_ids.tolist(),
                                   "topk_logprob_bits": r.topk_logprobs.view(np.uint32).tolist()}})
    import vllm

    Path(args.fixture).write_text(json.dumps({"vllm": vllm.__version__, "kernels": args.kernels, "cases": cases}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kernels", default="stock,bi,tbik")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vllm-args", default="{}", help="JSON object of extra engine arguments")
    ap.add_argument("--json", help="append rows to this JSON file (a list)")
    ap.add_argument("--fixture")
    ap.add_argument("--profile", metavar="DIR", help="then profile one plain generation in every worker: GPU time per kernel, in DIR")
    ap.add_argument("--timeline", action="store_true",
                    help="with --profile: the plain generation's host ops too; every rank's Chrome trace (gzipped) and GPU idle gaps, in DIR")
    ap.add_argument("--steps", action="store_true",
                    help="record rank 0's time from each model step to the next in every plain run (plain_step_s)")
    ap.add_argument("--no-collect", action="store_true", help="do not collect this process's garbage before each timed run")
    ap.add_argument("--stall", type=float, default=480, help="seconds after which a mode's process prints its stack and exits")
    ap.add_argument("--interleave", action="store_true",
                    help="load every mode at once (each with a share of GPU memory) and take their runs in turn")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one or args.serve:
        import faulthandler

        if args.one:  # a hung mode shows where it stopped (a serving child waits on its parent)
            faulthandler.dump_traceback_later(args.stall, exit=True)
            print("ROW " + json.dumps(one(args)), flush=True)
        else:
            serve(args)
        return
    modes = args.kernels.split(",")
    children: list[subprocess.Popen] = []
    # Every child in a process group of its own, ended with this process: a time limit that
    # stops this script must not leave a mode's vLLM processes running on the GPUs under the
    # next measurement.
    signal.signal(signal.SIGTERM, lambda *_: (_kill(children), sys.exit(143)))
    found = _interleaved(args, modes, children) if args.interleave else _one_by_one(args, modes, children)
    rows = []
    for k in modes:
        if k not in found:
            print(f"== {k} failed", flush=True)
            continue
        row = found[k]
        row["command"] = " ".join(["python3", "benchmarks/vllm_speed.py", *sys.argv[1:]])
        if args.interleave:
            row["interleaved"] = True
        stock = next((r for r in rows if r["kernels"] == "stock"), None)
        if stock is not None:
            row["stock_plain_tok_s"] = stock["plain_tok_s"]
            row["ratio_vs_stock"] = row["repaudit_tok_s"] / stock["plain_tok_s"]
            row["plain_ratio_vs_stock"] = row["plain_tok_s"] / stock["plain_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            path = Path(args.json)
            old = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(old + [row], indent=1))


def child_cmd(args, kernels: str, role: str) -> list[str]:
    """The command of one mode's process (`role`: --one or --serve)."""
    extra = json.loads(args.vllm_args)
    if args.interleave:  # every mode's vLLM on the same GPUs at once
        extra.setdefault("gpu_memory_utilization", round(0.9 / len(args.kernels.split(",")), 2))
    return [sys.executable, __file__, role, "--model", args.model, "--tp", str(args.tp), "--kernels", kernels,
            "--prompts", str(args.prompts), "--new", str(args.new), "--topk", str(args.topk), "--runs", str(args.runs),
            "--vllm-args", json.dumps(extra), "--stall", str(args.stall)] + (["--no-collect"] if args.no_collect else []) \
        + (["--steps"] if args.steps else []) + (["--fixture", args.fixture] if args.fixture and kernels == "stock" else []) \
        + (["--profile", args.profile] if args.profile else []) + (["--timeline"] if args.timeline else [])


def _start(cmd: list[str], children: list, stdin=None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    children.append(proc)
    return proc


def _kill(children: list) -> None:
    for proc in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _relay(proc: subprocess.Popen, kernels: str, until: str) -> str | None:
    """The child's output, passed through (vLLM's progress bars left out) so that a log shows how
    far a mode got even when a time limit ends it, up to the first line that starts with `until`:
    that line, or None if the child ended first."""
    for line in proc.stdout:
        if line.startswith(until):
            return line
        if "it/s]" not in line:
            print(f"[{kernels}] {line}", end="", flush=True)
    return None


def _one_by_one(args, modes: list[str], children: list) -> dict[str, dict]:
    """Each mode in its own process, one after the other, its runs in a row."""
    found = {}
    for k in modes:
        proc = _start(child_cmd(args, k, "--one"), children)
        line = _relay(proc, k, "ROW ")
        proc.wait()
        if line is not None:
            found[k] = json.loads(line[4:])
    return found


def _interleaved(args, modes: list[str], children: list) -> dict[str, dict]:
    """Every mode's process loaded at once (one after the other, so each sizes its memory with
    the others' already taken), then one run of each mode in turn, --runs times: the modes'
    runs share whatever the machine does meanwhile."""
    live = {}
    for k in modes:
        proc = _start(child_cmd(args, k, "--serve"), children, stdin=subprocess.PIPE)
        if _relay(proc, k, "READY") is not None:
            live[k] = proc
    for _ in range(args.runs):
        for k, proc in list(live.items()):
            if _ask(proc, k, "run", "RAN") is None:
                del live[k]
    found = {}
    for k, proc in live.items():
        line = _ask(proc, k, "finish", "ROW ")
        if line is not None:
            found[k] = json.loads(line[4:])
    for proc in children:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        proc.wait()
    return found


def _ask(proc: subprocess.Popen, kernels: str, command: str, until: str) -> str | None:
    """Send a serving child one command; its answer line, or None if it has ended."""
    try:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        return None
    return _relay(proc, kernels, until)


if __name__ == "__main__":
    main()
