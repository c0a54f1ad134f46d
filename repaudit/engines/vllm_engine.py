"""The vLLM engine (optional extra: pip install 'repaudit[vllm]').

vLLM builds its TP group once per process and reads its kernel switches at start-up, so every
(TP size, NCCL preset, kernel mode) is a fresh job (plan.Cell.group_key): one process, vLLM's
driver, which starts vLLM's own TP workers. The kernel mode and NCCL preset reach those workers
through the environment, set before vLLM is imported:

- stock: vLLM as configured below.
- bi:    vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1).
- tbik:  repaudit's vLLM plugin (vllm_plugin.py, entry point `vllm.general_plugins`), which
         runs every op of the model as the transformers engine's tbik mode runs it (hf_ops.py):
         the rollout's bits are the trainer's. vLLM's own batch-invariant mode is off (the
         plugin replaces every op it would touch); attention is tbik's over the paged KV cache
         on the flash-attention backend, inside vLLM's CUDA graphs as it ships them.
         Llama/Qwen3-style decoders only (check_tbik).

Logprobs are vLLM's raw ones (`logprobs_mode="raw_logprobs"`: log-softmax of the model's
logits before any sampling processor), the float32 values vLLM's kernel computed. A generate
cell takes them inside vLLM's workers (vllm_capture.py: the calls vLLM's sampler makes for
them, without vLLM's per-token hand-over to the driver, which costs a generation about 30% of its
speed); a score cell asks vLLM for prompt logprobs, which vLLM hands over as Python floats made
from float32, so np.float32() gives back the same bits. vLLM never shows the full logits row,
so vLLM records carry no row digest (null).

A cell's batch size is how many prompts are handed to vLLM together (LLM.generate on one batch;
max_num_seqs is the job's largest batch size): within a batch vLLM's scheduler is free, with
chunked prefill and finished sequences leaving, as in a server.

A cell runs vLLM as it ships: torch.compile, CUDA graphs, its default attention backend and
memory share. The settings repaudit changes, and why (docs/vllm.md lists them too):
- enable_prefix_caching=False: a cell is a cold prefill of every prompt; a cached prefix
  would change which tokens a forward computes (a scenario of its own, not a default).
- logprobs_mode="raw_logprobs", max_logprobs=max(k, 2): the log-softmax of the model's
  logits before any logits processor, as many as the record's top-k needs and at least two,
  so that a tie at the top resolves to the lowest token id, as the transformers engine's
  argmax does.
- skip_tokenizer_init=True: records hold token ids; vLLM never detokenizes.
- worker_extension_cls=vllm_capture.EXTENSION: the methods that turn the generate cells'
  logprob capture on and off in each worker (off, it costs one flag test per sampling step).
- max_num_seqs = the largest batch size of the job, max_model_len = the longest sequence:
  the batch is what the cell measures, and the KV cache is sized for the suite.
- seed=0 and greedy sampling (temperature 0).
- stop_token_ids: run.model.stop_ids, the tokenizer's EOS (which vLLM cannot know without its
  tokenizer) and the generation config's EOS ids (which vLLM adds itself): where the
  transformers engine stops too.
A scenario (SCENARIO_ARGS, chunked-prefill:N) changes a few of these on purpose, one thing at a
time, and its cells are compared with the cold cells of the same job settings (docs/vllm.md,
"Scenarios"). --vllm-arg KEY=VALUE sets any engine argument and has the last word.
"""

from __future__ import annotations

import copy
import importlib.metadata
import time
from typing import Any

import numpy as np

from ..errors import InputError
from . import vllm_capture
from .base import Sequence, Timing, TokenRows, topk_with_own

INSTALL_HINT = "pip install 'repaudit[vllm]'"
KERNEL_ENV = {
    "stock": {"VLLM_BATCH_INVARIANT": "0", "REPAUDIT_VLLM_TBIK": "0"},
    "bi": {"VLLM_BATCH_INVARIANT": "1", "REPAUDIT_VLLM_TBIK": "0"},
    "tbik": {"VLLM_BATCH_INVARIANT": "0", "REPAUDIT_VLLM_TBIK": "1"},
}
# What a tbik cell changes in vLLM's engine arguments, and why: the plugin's attention replaces
# flash-attention's kernel (so that backend, whatever vLLM would pick). CUDA graphs stay vLLM's
# (full graphs for decode-only steps, piecewise ones around attention otherwise): the kernel's
# grid comes from the step's request count and longest query, which a decode graph fixes.
TBIK_ENGINE_ARGS = {"attention_backend": "FLASH_ATTN"}
# What each scenario changes in vLLM's engine arguments (docs/vllm.md, "Scenarios", says why):
# one serving feature at a time, against the cold cell that has none of them.
SCENARIO_ARGS: dict[str, dict[str, Any]] = {
    "cold": {},
    "prefix-hit": {"enable_prefix_caching": True},
    "eager": {"enforce_eager": True},  # vLLM then turns off torch.compile and CUDA graphs both
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    # n-gram drafts need no draft model; 4 tokens drafted from a 2- to 4-token match in the context
    "spec-ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
}
CHUNKED_PREFILL = "chunked-prefill"  # chunked-prefill:N, prefill chunks of at most N tokens
# transformers model types whose every op the plugin reproduces (Llama-style decoder layers,
# RMSNorm, SiLU-and-mul, default RoPE); tests/test_hf_ops.py checks the ops on both.
TBIK_FAMILIES = ("llama", "qwen3")
# vLLM's driver must not look like a torchrun rank: with RANK/WORLD_SIZE it would take itself
# for an external launcher, and with TORCHELASTIC_USE_AGENT_STORE=True every store it creates
# would be a client of an agent that is not there (its process group then waits forever).
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def scrub_launcher_env(env: dict[str, str]) -> None:
    for var in [v for v in env if v in TORCHRUN_VARS or v.startswith("TORCHELASTIC_")]:
        del env[var]


def require(device: str = "cuda", nnodes: int = 1) -> None:
    from .vllm_plugin import TESTED_VLLM

    # The installed version from its metadata: importing vLLM costs the launcher ten seconds or
    # more, and only the jobs need it.
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(f"--engine vllm needs vLLM (it is not installed): {INSTALL_HINT}") from None
    if version not in TESTED_VLLM:
        raise InputError(f"--engine vllm: vLLM {version} is untested; repaudit supports vLLM "
                         f"{', '.join(TESTED_VLLM)} ({INSTALL_HINT})")
    if device != "cuda":
        raise InputError("--engine vllm runs on GPUs: add --device cuda")
    if nnodes > 1:
        raise InputError("--engine vllm runs on one node here (vLLM's multi-node mode needs a Ray cluster)")


def check_tbik(path: str, vllm_args: dict[str, Any]) -> None:
    """Refuse, in one line, a model the plugin's tbik path would not reproduce op for op, or
    engine arguments under which vLLM runs layers the plugin does not replace (with LoRA,
    vLLM's row-parallel LoRA layers all-reduce bf16 partials themselves)."""
    from transformers import AutoConfig

    if vllm_args.get("enable_lora"):
        raise InputError("--engine vllm --kernels tbik: --vllm-arg enable_lora swaps in vLLM's LoRA layers, whose "
                         "row-parallel all-reduce of bf16 partials the plugin does not replace (use --kernels bi or "
                         "stock with LoRA)")
    cfg = AutoConfig.from_pretrained(path)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    problems = [what for what, bad in (
        (f"model type {cfg.model_type!r} (covered: {', '.join(TBIK_FAMILIES)})", cfg.model_type not in TBIK_FAMILIES),
        (f"RoPE type {rope!r}", rope != "default"),
        (f"activation {getattr(cfg, 'hidden_act', None)!r}", getattr(cfg, "hidden_act", "silu") != "silu"),
        ("biases in attention or MLP", getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)),
        ("sliding-window attention", getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)),
    ) if bad]
    if problems:
        raise InputError(f"--engine vllm --kernels tbik: {path} has {'; '.join(problems)}, which repaudit's vLLM "
                         "plugin does not reproduce op for op (use --kernels bi or stock for this model)")


def process_env(kernels: str) -> dict[str, str]:
    """Variables for the cell's process, before vLLM is imported; vLLM's workers inherit them."""
    if kernels not in KERNEL_ENV:
        raise ValueError(f"unknown kernel mode {kernels!r}")
    # spawn, not fork: a forked engine process was seen to hang when the parent had run torch on the CPU.
    return {**KERNEL_ENV[kernels], "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def chunk_tokens(scenario: str) -> int | None:
    """N of a canonical chunked-prefill:N scenario (run/scenarios.parse makes it so), else None."""
    name, colon, n = scenario.partition(":")
    return int(n) if name == CHUNKED_PREFILL and colon and n.isdigit() and int(n) > 0 else None


def scenario_args(scenario: str) -> dict[str, Any]:
    """A scenario's engine arguments. chunked-prefill:N caps the tokens of one scheduler step at N,
    so a prompt longer than N is prefilled in chunks of N (vLLM needs N >= max_num_seqs)."""
    n = chunk_tokens(scenario)
    if n is not None:
        return {"enable_chunked_prefill": True, "max_num_batched_tokens": n}
    if scenario not in SCENARIO_ARGS:
        raise ValueError(f"unknown scenario {scenario!r}")
    return copy.deepcopy(SCENARIO_ARGS[scenario])


def engine_args(*, model_path: str, tp: int, dtype: str, batch_size: int, max_len: int, topk: int,
                kernels: str = "stock", scenario: str = "cold", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    args = dict(
        model=model_path, tensor_parallel_size=tp, dtype=dtype, seed=0, max_num_seqs=batch_size,
        max_model_len=max_len, enable_prefix_caching=False, skip_tokenizer_init=True,
        logprobs_mode="raw_logprobs", max_logprobs=logprobs_k(topk), disable_log_stats=True,
        worker_extension_cls=vllm_capture.EXTENSION,
    )
    if kernels == "tbik":
        args.update(TBIK_ENGINE_ARGS)
    args.update(scenario_args(scenario))
    args.update(extra or {})
    return args


def logprobs_k(topk: int) -> int:
    """Logprobs vLLM returns per row: the record's top-k, and at least two (see the module doc)."""
    return max(topk, 2)


def load(args: dict[str, Any]):
    from vllm import LLM

    return LLM(**args)


def sampling_params(max_tokens: int, topk: int, stop_ids: tuple[int, ...], prompt_logprobs: bool, logprobs: bool = True):
    from vllm import SamplingParams

    # Flat logprobs: vLLM keeps a request's logprobs in a few flat lists instead of a dict per position, which
    # costs vLLM and this conversion far less than (1 + k) Python objects per token.
    k = logprobs_k(topk)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k if logprobs else None, prompt_logprobs=k if prompt_logprobs else None,
                          detokenize=False, stop_token_ids=list(stop_ids) or None, flat_logprobs=True)


def _run(llm, token_lists: list[list[int]], params: list) -> tuple[list, float]:
    prompts = [{"prompt_token_ids": t} for t in token_lists]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def warm_prefixes(llm, seqs: list[Sequence]) -> None:
    """prefix-hit: every prompt once, one token and no logprobs, before the measured requests, so
    their prompts' full KV blocks come from vLLM's prefix cache (a hit stops one token short of the
    whole prompt, and a prompt shorter than one block has nothing to hit). Its time is outside the
    cell's Timing, so out of its tokens/s (the cell's wall seconds include it)."""
    from vllm import SamplingParams

    _run(llm, [list(s.prompt) for s in seqs], [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)] * len(seqs))


def score(llm, seqs: list[Sequence], topk: int, stop_ids: tuple[int, ...]) -> tuple[list[TokenRows], Timing]:
    """Prompt logprobs over prompt + reference completion (one throwaway token generated)."""
    tokens = [list(s.prompt) + list(s.completion or ()) for s in seqs]
    outs, seconds = _run(llm, tokens, [sampling_params(1, topk, stop_ids, True)] * len(seqs))
    rows = [rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=False) for o, s in zip(outs, seqs)]
    return rows, Timing(prefill_s=seconds, prefill_tokens=sum(len(t) for t in tokens))


def generate(llm, seqs: list[Sequence], topk: int, stop_ids: tuple[int, ...],
             capture: bool = True) -> tuple[list[TokenRows], Timing]:
    """Greedy decoding; records the generated tokens (no prompt logprobs: those are a score cell's,
    and asking vLLM for them would cost more than the decoding). With `capture` (and where the
    workers can: vllm_capture.CaptureWorker.repaudit_capture_begin), the logprobs are taken inside
    vLLM's workers and vLLM is asked for none; otherwise vLLM returns them with its outputs."""
    k = logprobs_k(topk)
    t0 = time.perf_counter()
    captured = capture and vllm_capture.installed(llm) and all(llm.collective_rpc("repaudit_capture_begin", args=(k,)))
    made = {n: sampling_params(n, topk, stop_ids, False, logprobs=not captured) for n in {s.max_new_tokens for s in seqs}}
    params = [made[s.max_new_tokens] for s in seqs]
    # begin() starts afresh, so a failed call leaves nothing behind for the next one.
    outs, _ = _run(llm, [list(s.prompt) for s in seqs], params)
    got = llm.collective_rpc("repaudit_capture_end")[0] if captured else None
    seconds = time.perf_counter() - t0
    if captured:
        rows = vllm_capture.rows_from_capture(outs, got, [s.prompt_id for s in seqs], [len(s.prompt) for s in seqs], topk)
    else:
        rows = [rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=True) for o, s in zip(outs, seqs)]
    # vLLM interleaves prefill and decode; its wall time (and the capture's hand-over) is charged
    # to the generated tokens, not to a decode rate it cannot split off.
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return rows, Timing(mixed_s=seconds, generated_tokens=generated)


def _flat(flat, positions: slice, k: int, what: str) -> dict[str, np.ndarray]:
    """vLLM's FlatLogprobs for `positions` -> per-position arrays. Each position holds 1 + k
    entries: the position's own token (with its rank), then ranks 1..k in rank order."""
    start = np.asarray(flat.start_indices[positions], dtype=np.int64)
    count = np.asarray(flat.end_indices[positions], dtype=np.int64) - start
    if len(start) and not (count >= 1 + k).all():
        bad = int(np.argmax(count < 1 + k))
        raise RuntimeError(f"{what}: vLLM returned {count[bad]} logprob entries at position {bad}, expected {1 + k}")
    idx = start[:, None] + np.arange(1 + k)
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    # Python floats made from float32: the float64 -> float32 cast gives back the exact bits.
    lps = np.asarray(flat.logprobs, dtype=np.float64).astype(np.float32)
    ranks = np.asarray([r if r is not None else -1 for r in flat.ranks], dtype=np.int64)
    if len(start) and not (ranks[idx[:, 1:]] == np.arange(1, 1 + k)).all():
        raise RuntimeError(f"{what}: vLLM's top-{k} entries are not in rank order")
    return {"token": ids[idx[:, 0]], "logprob": lps[idx[:, 0]], "ids": ids[idx[:, 1:]], "lps": lps[idx[:, 1:]]}


def rows_from_output(out, prompt_id: str, prompt_len: int, topk: int, completion: bool) -> TokenRows:
    """A vLLM RequestOutput (flat logprobs) -> the rows repaudit records: with `completion`, every
    generated token (EOS included); without, positions 1.. of the request's prompt (from
    prompt_logprobs: a score cell's prompt is prompt + reference completion)."""
    k = logprobs_k(topk)
    if completion:
        gen = out.outputs[0]
        if gen.logprobs is None or len(gen.logprobs) != len(gen.token_ids):
            raise RuntimeError(f"{prompt_id}: vLLM returned logprobs for {0 if gen.logprobs is None else len(gen.logprobs)} "
                               f"of {len(gen.token_ids)} generated tokens")
        vals = _flat(gen.logprobs, slice(None), k, prompt_id)
        token = np.asarray(gen.token_ids, dtype=np.int64)
        first = len(out.prompt_token_ids)
    else:
        ptoks = np.asarray(out.prompt_token_ids, dtype=np.int64)
        plps = out.prompt_logprobs
        if plps is None or len(plps) != len(ptoks):
            raise RuntimeError(f"{prompt_id}: vLLM returned {0 if plps is None else len(plps)} prompt logprobs for {len(ptoks)} tokens")
        vals = _flat(plps, slice(1, None), k, prompt_id)
        token = ptoks[1:]
        first = 1
    if not (vals["token"] == token).all():
        raise RuntimeError(f"{prompt_id}: vLLM's logprob entries name other tokens than the sequence holds")
    ids, lps = topk_with_own(vals["token"], vals["logprob"], vals["ids"], vals["lps"])
    return TokenRows(prompt_id=prompt_id, prompt_len=prompt_len, pos=np.arange(first, first + len(token), dtype=np.int32),
                     token_id=token.astype(np.int32), logprob=vals["logprob"], top1=ids[:, 0].astype(np.int32),
                     topk_ids=ids[:, :topk].astype(np.int32), topk_logprobs=lps[:, :topk], digest=None)


# ------------------------------------------------------------------ JSON form of vLLM's outputs
# The fields rows_from_output reads, as JSON: a real run's outputs are saved in this form
# (benchmarks/vllm_speed.py --fixture) so CI tests the conversion on them without vLLM. Logprobs
# travel as Python floats: vLLM made them from float32, and repr() round-trips every double.


def _flat_to_json(flat) -> dict[str, list] | None:
    if flat is None:
        return None
    return {"start": list(flat.start_indices), "end": list(flat.end_indices), "token_ids": list(flat.token_ids),
            "logprobs": list(flat.logprobs), "ranks": list(flat.ranks)}


def output_to_json(out) -> dict[str, Any]:
    gen = out.outputs[0]
    return {"prompt_token_ids": list(out.prompt_token_ids), "prompt_logprobs": _flat_to_json(out.prompt_logprobs),
            "token_ids": list(gen.token_ids), "logprobs": _flat_to_json(gen.logprobs)}


def output_from_json(d: dict[str, Any]):
    from types import SimpleNamespace as NS

    class Flat(NS):  # len() is what rows_from_output checks against the token count
        def __len__(self) -> int:
            return len(self.start_indices)

    as_flat = lambda f: None if f is None else Flat(  # noqa: E731
        start_indices=f["start"], end_indices=f["end"], token_ids=f["token_ids"], logprobs=f["logprobs"], ranks=f["ranks"])
    gen = NS(token_ids=d["token_ids"], logprobs=as_flat(d["logprobs"]))
    return NS(prompt_token_ids=d["prompt_token_ids"], prompt_logprobs=as_flat(d.get("prompt_logprobs")), outputs=[gen])
