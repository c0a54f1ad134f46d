"""The vLLM engine (optional extra: pip install 'repaudit[vllm]').

vLLM builds its TP group once per process and reads its kernel switches at start-up, so every
(TP size, NCCL preset, kernel mode) is a fresh job (plan.Cell.group_key): one process, vLLM's
driver, which starts vLLM's own TP workers. The kernel mode and NCCL preset reach those workers
through the environment, set before vLLM is imported:

- stock: vLLM as configured below.
- bi:    vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1).
- tbik:  bi, plus repaudit's vLLM plugin (vllm_plugin.py, entry point `vllm.general_plugins`),
         which gives every row-parallel linear layer tbik's tree matmul and tree all-reduce.

Logprobs are vLLM's raw ones (`logprobs_mode="raw_logprobs"`: log-softmax of the model's
logits before any sampling processor), taken as the float32 values vLLM computed: vLLM hands
them over as Python floats made from float32, so np.float32() gives back the same bits.
vLLM never shows the full logits row, so vLLM records carry no row digest (null).

A cell's batch size is how many prompts are handed to vLLM together (LLM.generate on one batch;
max_num_seqs is the job's largest batch size): within a batch vLLM's scheduler is free, with
chunked prefill and finished sequences leaving, as in a server. Prefix caching is off (a cached
prefix would change which tokens a forward computes); CUDA graphs and torch.compile are off by
default so a cell starts in seconds; --vllm-arg changes any engine argument.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import InputError
from .base import Sequence, Timing, TokenRows

INSTALL_HINT = "pip install 'repaudit[vllm]'"
KERNEL_ENV = {
    "stock": {"VLLM_BATCH_INVARIANT": "0", "REPAUDIT_VLLM_TBIK": "0"},
    "bi": {"VLLM_BATCH_INVARIANT": "1", "REPAUDIT_VLLM_TBIK": "0"},
    "tbik": {"VLLM_BATCH_INVARIANT": "1", "REPAUDIT_VLLM_TBIK": "1"},
}
# The worker's torchrun job is one process; vLLM must not mistake it for an external launcher.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def require(device: str = "cuda", nnodes: int = 1) -> None:
    try:
        import vllm  # noqa: F401  (the import is the check)
    except ImportError as exc:
        raise InputError(f"--engine vllm needs vLLM ({exc}): {INSTALL_HINT}") from None
    if device != "cuda":
        raise InputError("--engine vllm runs on GPUs: add --device cuda")
    if nnodes > 1:
        raise InputError("--engine vllm runs on one node here (vLLM's multi-node mode needs a Ray cluster)")


def process_env(kernels: str) -> dict[str, str]:
    """Variables for the cell's process, before vLLM is imported; vLLM's workers inherit them."""
    if kernels not in KERNEL_ENV:
        raise ValueError(f"unknown kernel mode {kernels!r}")
    # spawn, not fork: a forked engine process was seen to hang when the parent had run torch on the CPU.
    return {**KERNEL_ENV[kernels], "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def engine_args(*, model_path: str, tp: int, dtype: str, batch_size: int, max_len: int, topk: int,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    args = dict(
        model=model_path, tensor_parallel_size=tp, dtype=dtype, seed=0, max_num_seqs=batch_size,
        max_model_len=max_len, enable_prefix_caching=False, enforce_eager=True,
        compilation_config={"mode": 0}, skip_tokenizer_init=True, logprobs_mode="raw_logprobs",
        max_logprobs=max(topk, 1), gpu_memory_utilization=0.6, disable_log_stats=True,
    )
    args.update(extra or {})
    return args


def load(args: dict[str, Any]):
    from vllm import LLM

    return LLM(**args)


def _params(max_tokens: int, topk: int, eos_id: int | None, prompt_logprobs: bool):
    from vllm import SamplingParams

    # At least one logprob per row: the rank-1 entry is the row's top-1 token.
    k = max(topk, 1)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k if prompt_logprobs else None,
                          detokenize=False, stop_token_ids=[eos_id] if eos_id is not None else None)


def _run(llm, token_lists: list[list[int]], params: list) -> tuple[list, float]:
    prompts = [{"prompt_token_ids": t} for t in token_lists]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def score(llm, seqs: list[Sequence], topk: int, eos_id: int | None) -> tuple[list[TokenRows], Timing]:
    """Prompt logprobs over prompt + reference completion (one throwaway token generated)."""
    tokens = [list(s.prompt) + list(s.completion or ()) for s in seqs]
    outs, seconds = _run(llm, tokens, [_params(1, topk, eos_id, True)] * len(seqs))
    rows = [rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=False) for o, s in zip(outs, seqs)]
    return rows, Timing(prefill_s=seconds, prefill_tokens=sum(len(t) for t in tokens))


def generate(llm, seqs: list[Sequence], topk: int, eos_id: int | None) -> tuple[list[TokenRows], Timing]:
    """Greedy decoding; the prompt's positions come from prompt logprobs of the same request."""
    outs, seconds = _run(llm, [list(s.prompt) for s in seqs], [_params(s.max_new_tokens, topk, eos_id, True) for s in seqs])
    rows = [rows_from_output(o, s.prompt_id, len(s.prompt), topk, completion=True) for o, s in zip(outs, seqs)]
    # vLLM interleaves prefill and decode; its wall time is charged to the generated tokens.
    return rows, Timing(decode_s=seconds, decode_tokens=sum(len(o.outputs[0].token_ids) for o in outs))


def _row(entries, token: int, topk: int) -> tuple[np.float32, int, list[int], list[np.float32]]:
    """One position's logprob dict {token_id: Logprob} -> (logprob of token, top-1 id, top-k)."""
    if token not in entries:
        raise RuntimeError(f"vLLM returned no logprob for token {token} (got ids {sorted(entries)[:8]})")
    ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None))
    if not ranked or ranked[0][0] != 1:
        raise RuntimeError("vLLM returned no rank-1 entry; repaudit asks for at least one logprob per position")
    top = ranked[:topk]
    return np.float32(entries[token].logprob), ranked[0][1], [t for _, t, _ in top], [np.float32(v) for _, _, v in top]


def rows_from_output(out, prompt_id: str, prompt_len: int, topk: int, completion: bool) -> TokenRows:
    """A vLLM RequestOutput -> the rows repaudit records: positions 1.. of the prompt (from
    prompt_logprobs) and, with `completion`, every generated token (EOS included)."""
    ptoks = list(out.prompt_token_ids)
    plps = out.prompt_logprobs
    if plps is None or len(plps) != len(ptoks):
        raise RuntimeError(f"{prompt_id}: vLLM returned {0 if plps is None else len(plps)} prompt logprobs for {len(ptoks)} tokens")
    pos, tok, vals = [], [], []
    for p in range(1, len(ptoks)):
        pos.append(p)
        tok.append(ptoks[p])
        vals.append(_row(plps[p], ptoks[p], topk))
    if completion:
        gen = out.outputs[0]
        if gen.logprobs is None or len(gen.logprobs) != len(gen.token_ids):
            raise RuntimeError(f"{prompt_id}: vLLM returned logprobs for {0 if gen.logprobs is None else len(gen.logprobs)} "
                               f"of {len(gen.token_ids)} generated tokens")
        for i, t in enumerate(gen.token_ids):
            pos.append(len(ptoks) + i)
            tok.append(t)
            vals.append(_row(gen.logprobs[i], t, topk))
    n = len(pos)
    k_ids = np.zeros((n, topk), np.int32)
    k_lp = np.zeros((n, topk), np.float32)
    for i, (_, _, ids, lps) in enumerate(vals):
        if len(ids) < topk:
            raise RuntimeError(f"{prompt_id}: vLLM returned {len(ids)} of the {topk} top logprobs asked for at pos {pos[i]}")
        k_ids[i], k_lp[i] = ids, lps
    return TokenRows(prompt_id=prompt_id, prompt_len=prompt_len, pos=np.asarray(pos, np.int32),
                     token_id=np.asarray(tok, np.int32), logprob=np.asarray([v[0] for v in vals], np.float32),
                     top1=np.asarray([v[1] for v in vals], np.int32), topk_ids=k_ids, topk_logprobs=k_lp, digest=None)
