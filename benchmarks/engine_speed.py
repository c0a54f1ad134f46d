"""repaudit's transformers engine against the same model run plainly by transformers, side by
side in one process: same loaded model, same kernel mode, same prompts, same batches.

- score: repaudit's hf.score (capture on: logprob, top-k, top-1, row digest, rows on the host)
  against a plain forward `model(input_ids, attention_mask).logits`.
- generate: repaudit's hf.generate against `model.generate` (greedy, the same number of new
  tokens, the same cache implementation as the engine's decode loop: static on one GPU, where
  the engine replays its steps from a CUDA graph, without torch.compile, whose fused kernels
  would compute other bits).

Runs alternate (baseline, repaudit) per batch size: tokens/s are medians of --runs, the ratio the
median of each back-to-back pair's ratio (`pair_ratios`). TP>1 runs under torchrun:

    python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --json reports/perf/engine_speed.json
    torchrun --nproc-per-node 2 benchmarks/engine_speed.py --tp 2 --json reports/perf/engine_speed.json

--profile DIR writes a torch.profiler table per (mode, kernels) at the middle batch size.
`--kernels stock-eager` is stock with transformers' RMSNorm and rotary ops unfused (the stock
mode fuses their element-wise chains, same bits): run beside stock, it times what that saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _prompts(model_id: str, new: int, random: int):
    """The default suite's prompts, or (random > 0) the first `random` prompts of
    benchmarks/vllm_speed.py's workload: the same token ids, for a comparison with vLLM."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from benchmarks.vllm_speed import random_prompts
    from repaudit.probes import load_suite
    from repaudit.run.model import load_tokenizer, resolve_model, tokenize

    ref = resolve_model(model_id)
    tok = load_tokenizer(ref, False)
    if random:
        vocab = AutoConfig.from_pretrained(str(ref.path)).vocab_size  # as vllm_speed reads it
        specs = [SimpleNamespace(id=f"r{i}", tokens=t) for i, t in enumerate(random_prompts(vocab, random))]
    else:
        specs = tokenize(load_suite("default"), tok, new, None)
    return ref, tok, specs


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _plain_score(model, batch, pad_id):
    # The tokens the engine scores: the prompt and its completion, so both sides run the same
    # forwards and count the same tokens.
    seqs = [s.prompt + (s.completion or ()) for s in batch]
    lens = [len(t) for t in seqs]
    T = max(lens)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, t in enumerate(seqs):
        ids[b, : lens[b]] = torch.tensor(t)
        mask[b, : lens[b]] = 1
    dev = next(model.parameters()).device
    with torch.inference_mode():
        # The base model on the batch, lm_head per sequence: [batch x longest x vocab] logits of
        # the long prompts at batch 32 would not fit (67 GiB), and the engine's head runs so too.
        hidden = model.base_model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
        for b, n in enumerate(lens):
            model.lm_head(hidden[b : b + 1, :n])
    return sum(lens)


def _plain_generate(model, batch, pad_id, new, cache):
    lens = [len(s.prompt) for s in batch]
    T = max(lens)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(batch):
        ids[b, T - lens[b]:] = torch.tensor(s.prompt)
        mask[b, T - lens[b]:] = 1
    dev = next(model.parameters()).device
    with torch.inference_mode():
        # disable_compile: transformers would torch.compile the static-cache step, which fuses ops
        # and so computes other bits than the model's eager forward that the records hold.
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None, cache_implementation=cache,
                             disable_compile=True)
    return (out.shape[1] - T) * len(batch)


def _kernels(hfm, kernels: str):
    """kernel_mode, or for "stock-eager" the stock mode with its fused norms and rotary left out."""
    from repaudit.run.kernelmodes import kernel_mode

    return kernel_mode(hfm, "stock", fused=False) if kernels == "stock-eager" else kernel_mode(hfm, kernels)


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    n = fn()
    _sync()
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:qwen3-0.6b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kernels", default="stock,bi,tbik")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--mode", default="score,generate")
    ap.add_argument("--chunks", type=int, default=2, help="batches per measurement: batch x chunks prompts, "
                    "the suite's first ones, repeated if it has fewer")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--random", type=int, default=0, help="this many random prompts of 64-512 tokens instead of the suite")
    ap.add_argument("--no-baseline", action="store_true", help="time repaudit's engine only (rows without a ratio)")
    ap.add_argument("--json")
    ap.add_argument("--profile")
    args = ap.parse_args()

    from repaudit.engines import hf
    from repaudit.engines.base import Sequence, Timing
    from repaudit.files import write_json_atomic

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    ref, tok, specs = _prompts(args.model, args.new, args.random)
    on_gpu = torch.cuda.is_available()
    hfm = hf.load(str(ref.path), dtype="bfloat16" if on_gpu else "float32", device="cuda" if on_gpu else "cpu",
                  tp=args.tp, stop_ids=(), pad_id=tok.pad_token_id)
    seqs = {"generate": [Sequence(p.id, tuple(p.tokens), None, args.new) for p in specs]}
    # Score the prompt plus a fixed completion of `new` tokens (what a reference generation gives).
    seqs["score"] = [Sequence(p.id, tuple(p.tokens), tuple(p.tokens[:args.new]), 0) for p in specs]
    batches = [int(b) for b in args.batch.split(",")]
    device = torch.cuda.get_device_name() if on_gpu else "CPU (a check of the script, not a measurement)"
    rows: list[dict] = []
    workload = f"random:{args.random}x64-512" if args.random else "suite:default"
    old_rows = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else []

    def cell(r):
        return r.get("device"), r.get("tp"), r.get("kernels"), r.get("mode"), r.get("batch"), r.get("workload", "suite:default")

    for kernels in args.kernels.split(","):
        with _kernels(hfm, kernels):
            for mode in args.mode.split(","):
                for bs in batches:
                    pool = seqs[mode] * (-(-bs * args.chunks // len(seqs[mode])))
                    chunks = [pool[i * bs:(i + 1) * bs] for i in range(args.chunks)]
                    last: list[Timing] = []  # the engine's own split of its last run: prefill vs decode steps

                    def mine(mode=mode, chunks=chunks):
                        timing, n = Timing(), 0
                        for c in chunks:
                            rows, t = (hf.score if mode == "score" else hf.generate)(hfm, c, args.topk)
                            timing.add(t)
                            n += sum(len(r.pos) + 1 if mode == "score" else int((r.pos >= r.prompt_len).sum()) for r in rows)
                        last[:] = [timing]
                        return n

                    if mode == "score":
                        base = lambda: sum(_plain_score(hfm.model, c, hfm.pad_id) for c in chunks)  # noqa: E731
                    else:
                        cache = "dynamic" if hfm.decode == "dynamic" else "static"
                        base = lambda: sum(_plain_generate(hfm.model, c, hfm.pad_id, args.new, cache)  # noqa: E731
                                           for c in chunks)
                    if args.no_baseline:
                        base = None
                    b_runs, m_runs = [], []
                    try:
                        for i in range(args.runs + 1):  # the first is a warm-up: autotuning, allocator, graph capture
                            b_run = _timed(base) if base else None
                            m_run = _timed(mine)
                            if i:
                                b_runs.append(b_run)
                                m_runs.append(m_run)
                    except torch.OutOfMemoryError as err:  # this batch size does not fit: the next rows still run
                        if rank == 0:
                            print(f"out of memory: {kernels} {mode} batch {bs}: {str(err).splitlines()[0]}", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    tok_s = lambda runs: statistics.median(n / s for s, n in runs)  # noqa: E731
                    row = {"device": device, "engine": "hf", "kernels": kernels, "mode": mode, "tp": args.tp, "batch": bs,
                           "workload": workload,
                           "new_tokens": args.new if mode == "generate" else None,
                           "repaudit_tok_s": tok_s(m_runs), "baseline_tok_s": tok_s(b_runs) if base else None,
                           "decode": hfm.decode if mode == "generate" else None}
                    if base:
                        # Each pair ran back to back, so the machine's drift between pairs (clocks,
                        # other tenants of the host) cancels in a pair's ratio: the row's ratio is
                        # their median, not the ratio of the two medians.
                        row["pair_ratios"] = [(mn / ms) / (bn / bs_) for (bs_, bn), (ms, mn) in zip(b_runs, m_runs)]
                        row["ratio"] = statistics.median(row["pair_ratios"])
                    else:
                        row["ratio"] = None
                    if mode == "generate":  # where a generation's time goes (the last run): prefill, then the steps
                        t = last[0]
                        row["repaudit_prefill_s"], row["repaudit_decode_s"] = t.prefill_s, t.decode_s
                        row["repaudit_decode_step_tok_s"] = t.decode_tokens / t.decode_s if t.decode_s else None
                    row["command"] = " ".join(["benchmarks/engine_speed.py", *sys.argv[1:]])
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                        if args.json:  # after every row, whole or not at all: a run cut short keeps what it measured
                            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                            done = {cell(r) for r in rows}  # a row replaces only its own cell's old row
                            write_json_atomic(args.json, [r for r in old_rows if cell(r) not in done] + rows)
                    if args.profile and bs == batches[len(batches) // 2]:  # every rank: the forwards are collectives
                        _profile(args.profile if rank == 0 else None, f"{mode}-{kernels}-tp{args.tp}-bs{bs}", base, mine)
    if dist.is_initialized():
        dist.destroy_process_group()


def _profile(out_dir: str | None, name: str, base, mine) -> None:
    from torch.profiler import ProfilerActivity, profile

    for label, fn in (("baseline", base), ("repaudit", mine)):
        if fn is None:  # --no-baseline
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _timed(fn)
        if out_dir is None:
            continue
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / f"{name}.txt", "a") as f:
            f.write(f"== {label}\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))


if __name__ == "__main__":
    main()
