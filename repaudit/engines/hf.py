"""The transformers engine: transformers' own tensor-parallel plan (DTensor), greedy decoding
with a KV cache, teacher-forced scoring. Logits are produced chunk by chunk from the final
hidden states (hf_head.py) so a long batch never holds [tokens x vocab] at once.

Padding follows production use: generate pads on the left (as `generate()` requires for
decoder-only models), score pads on the right (as trainers do). Only real positions are
recorded.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InputError
from . import hf_decode
from .base import Sequence, Timing, TokenRows, canonical_topk
from .hf_head import base_name, head_plan, host_values, score_values, step_head
from .row_values import row_values

DECODES = ("dynamic", "static", "graphs")  # KV cache and step of generate(): see hf_decode
# How often (in steps) generate's host looks whether every row is done: each look waits for the
# device; between looks the host queues steps ahead of it.
DONE_CHECK_EVERY = 8
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFModel:
    model: torch.nn.Module
    device: torch.device
    tp: int
    stop_ids: tuple[int, ...]  # a generation ends at the first of these (run.model.stop_ids)
    pad_id: int  # the prompts' padding: the tokenizer's pad (else its EOS), as a user pads a batch
    # fp32 logits [n, V] -> their log-softmax, written into `out` where given (returned)
    log_softmax: Callable[..., torch.Tensor]
    # what a row feeds after its stop id; None: pad_id (feed_pad_id() gives generate()'s choice)
    finished_feed_id: int | None = None
    tracer: Any = None  # a repaudit.run.trace.Tracer while a traced cell runs
    # "dynamic": transformers' DynamicCache, eager steps; "static": StaticCache, eager steps;
    # "graphs": StaticCache, steps replayed from a CUDA graph (same bits as "static").
    decode: str = "dynamic"


def _forward(hfm: HFModel, ids: torch.Tensor, mask: Any, positions: torch.Tensor,
             real: torch.Tensor | None, prompt_ids: list[str], **kwargs) -> torch.Tensor:
    """base_model forward; tells the tracer (if any) which flat rows are real and where they sit
    (`real` None: a decode step, whose rows the caller gave the tracer with begin_step).
    `mask`: a 2-D padding mask, or a 4-D one the base model takes as it is (hf_decode.static_mask)."""
    if hfm.tracer is not None and real is not None:
        flat = real.flatten().nonzero().flatten()
        rows_b = (flat // ids.shape[1]).cpu().numpy()
        pos = positions.flatten()[flat].cpu().numpy()
        hfm.tracer.begin(ids.shape[0], ids.shape[1], flat, np.asarray(prompt_ids, dtype=object)[rows_b], pos)
    try:
        return hfm.model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).last_hidden_state
    finally:
        if hfm.tracer is not None and real is not None:  # a decode step's caller ends what it began
            hfm.tracer.end()


def load(path: str, *, dtype: str, device: str, tp: int, trust_remote_code: bool = False,
         stop_ids: tuple[int, ...], pad_id: int) -> HFModel:
    from transformers import AutoModelForCausalLM

    cfg = cfg_check(path, trust_remote_code)
    if device == "cuda":
        local = torch.device("cuda", torch.cuda.current_device())
    else:
        local = torch.device("cpu")
    kwargs: dict = {"dtype": TORCH_DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if tp > 1:
        kwargs["tp_plan"] = "auto"
    else:
        kwargs["device_map"] = str(local)
    if getattr(cfg.get_text_config(), "attn_logit_softcapping", None) is not None:
        # transformers' default (sdpa) attention takes no soft-capping and would drop it without
        # a word (Gemma 2, VaultGemma): the eager attention computes the model as it is defined.
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    base = base_name(model)
    if model.base_model is not model._modules[base]:
        # Llama4ForCausalLM names its base model `model` but declares base_model_prefix
        # "language_model", so model.base_model would be the CausalLM itself; point it at the
        # module the CausalLM's forward calls (this instance only).
        model.base_model_prefix = base
    # Every TP size decodes the same way, so a TP=1 vs TP=2 diff measures TP, not the cache.
    decode = "graphs" if local.type == "cuda" and hf_decode.static_supported(model) else "dynamic"
    return HFModel(model=model, device=local, tp=tp, stop_ids=tuple(stop_ids), pad_id=pad_id,
                   finished_feed_id=feed_pad_id(model.generation_config), log_softmax=_torch_log_softmax, decode=decode)


def feed_pad_id(generation_config) -> int | None:
    """The token generate() feeds a row that has ended: its generation config's pad_token_id,
    else the first of its eos_token_id (generate()'s _prepare_special_tokens), else None."""
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return None if pad is None or isinstance(pad, (list, tuple)) else int(pad)


def _torch_log_softmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1, out=out)


# transformers model types (of the checkpoint's config, which AutoModelForCausalLM dispatches on)
# whose records tests/test_conformance.py proves bitwise equal to log_softmax(model(ids).logits):
# every decoder family with a TP plan, less the ones that test skips with its reason. Anything
# else is refused by cfg_check; a family joins this list when it passes that test.
VERIFIED_FAMILIES = frozenset({
    "apertus", "arcee", "aria_text", "axk1", "axk2", "cohere", "cohere2", "cohere2_moe", "cohere_compass_text",
    "cwm", "deepseek_v2", "deepseek_v3", "deepseek_v32", "doge", "dots1", "ernie4_5", "ernie4_5_moe", "exaone4",
    "exaone_moe", "flex_olmo", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text",
    "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_neox", "granite",
    "granite_swa", "granitemoe_swa", "helium", "hrm_text", "hy_v3", "hy_v4", "hyperclovax", "inkling_text",
    "jais2", "kimi_linear", "laguna", "llama", "llama4", "llama4_text", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3",
    "mistral", "mixtral", "nanochat", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "phi", "phi3",
    "phi4_multimodal", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
    "qwen3_next", "qwen4_exp_text", "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma", "youtu",
})


def cfg_check(path: str, trust_remote_code: bool):
    """Refuse, in one line (InputError), a model whose logprobs this engine cannot prove are the
    model's own; returns its config. Reads the config only: cheap enough for the planner to call
    before a run starts."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_type = getattr(cfg, "model_type", None)
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {}):
        remote = cfg.auto_map["AutoModelForCausalLM"]
        raise InputError(f"{path}: the model's code comes from the Hub (remote code, {remote}); repaudit's "
                         "transformers engine records logprobs only for transformers' own families, whose logits "
                         "it has verified")
    if model_type not in VERIFIED_FAMILIES:
        raise InputError(f"{path}: model type {model_type!r} is not one of the families whose logprobs repaudit's "
                         "transformers engine reproduces bit for bit (repaudit.engines.hf.VERIFIED_FAMILIES)")
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_fields(host: dict[str, np.ndarray], topk: int) -> dict[str, np.ndarray]:
    """Row values on the host (leading dims any) -> the record's dtypes and top-k order, for all
    rows at once."""
    out = dict(host, top1=host["top1"].astype(np.int32))
    lead = host["logprob"].shape
    if topk:
        ids, lps = canonical_topk(host["topk_ids"].reshape(-1, topk), host["topk_lp"].reshape(-1, topk))
        out["topk_ids"], out["topk_lp"] = ids.astype(np.int32).reshape(*lead, topk), lps.reshape(*lead, topk)
    else:
        out["topk_ids"], out["topk_lp"] = np.zeros((*lead, 0), np.int32), np.zeros((*lead, 0), np.float32)
    return out


def _to_rows(prompt_id: str, prompt_len: int, pos: np.ndarray, tokens: np.ndarray,
             vals: dict[str, np.ndarray], sel) -> TokenRows:
    return TokenRows(
        prompt_id=prompt_id, prompt_len=prompt_len, pos=pos.astype(np.int32), token_id=tokens.astype(np.int32),
        logprob=vals["logprob"][sel], top1=vals["top1"][sel], topk_ids=vals["topk_ids"][sel],
        topk_logprobs=vals["topk_lp"][sel], digest=vals["digest"][sel],
    )


@torch.inference_mode()
def score(hfm: HFModel, batch: list[Sequence], topk: int) -> tuple[list[TokenRows], Timing]:
    """Teacher forcing over prompt + reference completion; right padding."""
    seqs = [list(s.prompt) + list(s.completion or ()) for s in batch]
    lens = [len(s) for s in seqs]
    T = max(lens)
    ids = torch.full((len(seqs), T), hfm.pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    ids, mask = ids.to(hfm.device), mask.to(hfm.device)
    positions = torch.arange(T, device=hfm.device).expand(len(seqs), T)
    plan = head_plan(seqs, hfm.device)  # before the forward: its copy to the device then waits for nothing

    _sync(hfm.device)
    t0 = time.perf_counter()
    hidden = _forward(hfm, ids, mask, positions, mask.bool(), [s.prompt_id for s in batch])
    # Row (b, t) predicts the token at t + 1; the head sees each sequence as model(ids) does.
    vals = score_values(hfm.model, hfm.log_softmax, hidden, plan, topk)  # on the host: the device is done
    timing = Timing(prefill_s=time.perf_counter() - t0, prefill_tokens=sum(lens))

    host = _record_fields(vals, topk)
    rows, offset = [], 0
    for s, seq, n in zip(batch, seqs, lens):
        sel = slice(offset, offset + n - 1)
        offset += n - 1
        rows.append(_to_rows(s.prompt_id, len(s.prompt), np.arange(1, n), np.asarray(seq[1:]), host, sel))
    return rows, timing


@torch.inference_mode()
def generate(hfm: HFModel, batch: list[Sequence], topk: int) -> tuple[list[TokenRows], Timing]:
    """Greedy decoding with a KV cache (hfm.decode says which, and whether a CUDA graph replays
    the steps); left padding. Records every generated token, the EOS included (the prompt's
    positions are a score cell's job).

    The loop never waits for the device between steps: which rows are done, and what they feed
    next, is decided on the device from the step's own outputs, and the host looks only every
    DONE_CHECK_EVERY steps whether every row is done (a batch may thus run a few steps past its
    end; those steps' rows are not recorded, and no recorded row depends on them)."""
    from transformers import DynamicCache

    B = len(batch)
    plens = [len(s.prompt) for s in batch]
    T = max(plens)
    decode = hfm.decode
    if decode == "graphs" and not hf_decode.graphs_available(hfm.device):
        decode = "static"
    if decode not in DECODES:
        raise ValueError(f"unknown decode {decode!r}: one of {', '.join(DECODES)}")
    max_new = max(s.max_new_tokens for s in batch)
    # A static cache's mask spans every slot from the start; the steps fill it in. Its slots are
    # generate()'s (max_length - 1: the last new token is never fed back), since SDPA sums over
    # every slot, masked ones too, and a stock record is generate(cache_implementation="static",
    # disable_compile=True)'s.
    width = T + max_new - 1 if decode != "dynamic" else T
    ids = torch.full((B, T), hfm.pad_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, T - plens[b] :] = torch.tensor(s.prompt)
        mask[b, T - plens[b] : T] = 1
    ids, mask = ids.to(hfm.device), mask.to(hfm.device)
    positions = (mask[:, :T].cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=hfm.model.config) if decode == "dynamic" else hf_decode.new_cache(hfm.model, width)
    pids = [s.prompt_id for s in batch]
    multi_rank = dist.is_initialized() and dist.get_world_size() > 1

    def choose(hidden_last: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, lp, parts = step_head(hfm.model, hfm.log_softmax, hidden_last)
        nxt = logits.argmax(dim=-1)
        if multi_rank:
            # One rank decides, as serving engines do, so ranks whose logits differ cannot fork.
            dist.broadcast(nxt, src=0)
        return {**row_values(logits, lp, nxt, topk, parts), "chosen": nxt}

    def eager_step(feed: torch.Tensor, step_mask: Any, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = _forward(hfm, feed, step_mask, pos, None, pids, past_key_values=cache, use_cache=True)
        return choose(hidden[:, -1])

    # The whole step, head, record values and the tracer's digests included, is one graph:
    # between replays the host only copies the next inputs in.
    graphed = hf_decode.GraphedStep(eager_step, cache, tracer=hfm.tracer) if decode == "graphs" else None
    traced_ids = np.asarray(pids, dtype=object)

    _sync(hfm.device)
    t0 = time.perf_counter()
    first = mask if decode == "dynamic" else hf_decode.static_mask(hfm.model, mask, cache, T)
    hidden = _forward(hfm, ids, first, positions, mask[:, :T].bool(), pids, past_key_values=cache, use_cache=True)
    step = choose(hidden[:, -1])
    _sync(hfm.device)
    timing = Timing(prefill_s=time.perf_counter() - t0, prefill_tokens=sum(plens))

    limits = torch.tensor([s.max_new_tokens for s in batch], device=hfm.device)
    finished_feed = hfm.pad_id if hfm.finished_feed_id is None else hfm.finished_feed_id
    stop = torch.tensor(hfm.stop_ids or (-1,), device=hfm.device)
    gen_len = torch.zeros(B, dtype=torch.long, device=hfm.device)  # generated tokens so far, per sequence
    done = torch.zeros(B, dtype=torch.bool, device=hfm.device)  # recorded all its tokens
    ended = torch.zeros(B, dtype=torch.bool, device=hfm.device)  # chose a stop id
    steps: list[dict[str, torch.Tensor]] = []
    step_mask = None
    t1 = time.perf_counter()
    for n in range(1, max_new + 1):  # step n's values are each row's n-th generated token
        steps.append(step)
        # What a finished row feeds is never recorded, but it moves other rows' bits where rows
        # share work by content (a mixture of experts routes each token), so it is what
        # generate() over the batch with its largest limit feeds: a stop id once, then its
        # generation config's pad, and past a row's own limit its greedy tokens.
        feed = torch.where(ended, finished_feed, step["chosen"])[:, None]
        gen_len += ~done
        ended |= torch.isin(step["chosen"], stop)
        done |= ended | (gen_len >= limits)
        if n == max_new or (n % DONE_CHECK_EVERY == 0 and bool(done.all())):
            break
        positions = positions[:, -1:] + 1
        slot = T + n - 1  # the cache slot this step's token goes to
        if decode == "dynamic":
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=hfm.device)], dim=1)
            step_mask = mask
        elif step_mask is None:
            mask[:, slot] = 1
            step_mask = hf_decode.static_mask(hfm.model, mask, cache, 1)
        else:
            step_mask = hf_decode.advance_mask(step_mask, slot)
        if hfm.tracer is not None:  # the rows whose step makes a recorded row
            hfm.tracer.begin_step(traced_ids, positions[:, -1], ~done)
        step = graphed(feed, step_mask, positions) if graphed is not None else eager_step(feed, step_mask, positions)
        if hfm.tracer is not None:
            hfm.tracer.end()
    gen_len = gen_len.cpu().numpy()
    timing.decode_s = time.perf_counter() - t1
    timing.generated_tokens = int(gen_len.sum())
    timing.decode_tokens = timing.generated_tokens - B  # every row's first token came from the prefill
    if graphed is not None and graphed.failed:
        warnings.warn(f"decode steps ran without a CUDA graph (same bits, slower): {graphed.failed}", stacklevel=2)

    stacked = _record_fields(host_values({k: torch.stack([s[k] for s in steps]) for k in steps[0]}), topk)
    # stacked: [steps, B, ...]
    rows = []
    for b, s in enumerate(batch):
        n_gen = int(gen_len[b])
        per_b = {k: v[:n_gen, b] for k, v in stacked.items()}
        rows.append(_to_rows(s.prompt_id, plens[b], np.arange(plens[b], plens[b] + n_gen), per_b["chosen"],
                             per_b, slice(None)))
    return rows, timing
