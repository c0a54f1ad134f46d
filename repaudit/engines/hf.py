"""The transformers engine: transformers' own tensor-parallel plan (DTensor), greedy decoding
with a KV cache, teacher-forced scoring. Logits are produced chunk by chunk from the final
hidden states so a long batch never holds [tokens x vocab] at once.

Padding follows production use: generate pads on the left (as `generate()` requires for
decoder-only models), score pads on the right (as trainers do). Only real positions are
recorded.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InputError
from ..record.digest import to_uint64
from . import hf_decode
from .base import Sequence, Timing, TokenRows, canonical_topk
from .row_values import row_values

LOGIT_ROWS_PER_CHUNK = 256
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
    pad_id: int
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
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
    base = _base_name(model)
    if model.base_model is not model._modules[base]:
        # Llama4ForCausalLM names its base model `model` but declares base_model_prefix
        # "language_model", so model.base_model would be the CausalLM itself; point it at the
        # module the CausalLM's forward calls (this instance only).
        model.base_model_prefix = base
    # Every TP size decodes the same way, so a TP=1 vs TP=2 diff measures TP, not the cache.
    decode = "graphs" if local.type == "cuda" and hf_decode.static_supported(model) else "dynamic"
    return HFModel(model=model, device=local, tp=tp, stop_ids=tuple(stop_ids), pad_id=pad_id,
                   log_softmax=lambda x: torch.log_softmax(x, dim=-1), decode=decode)


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


def _base_name(model: torch.nn.Module) -> str:
    """The attribute under which the CausalLM holds its base model (the module its forward calls
    for the final hidden states): base_model_prefix where that names a child, else the one child
    that is not the output embeddings."""
    if model.base_model_prefix in model._modules:
        return model.base_model_prefix
    head = model.get_output_embeddings()
    names = [name for name, child in model.named_children() if child is not head]
    if len(names) != 1:
        raise RuntimeError(f"{type(model).__name__}: cannot tell its base model among {names}")
    return names[0]


@functools.cache
def _hidden_only() -> type:
    """The base model's output as the CausalLM's forward reads it: the final hidden states, and
    None for every other field it may ask for (router_logits, shared_kv_states, ...). Made on
    first use, so importing this module does not import transformers."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class HiddenOnly(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            return None

    return HiddenOnly


class _GivenHidden(torch.nn.Module):
    """Stands in for the base model inside the CausalLM's own forward and returns hidden states
    already computed, so the forward runs only its head: lm_head and whatever the family does
    around it (Granite's and MiniCPM3's logits_scaling, Gemma's final_logit_softcapping,
    Cohere's logit_scale, ...)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return _hidden_only()(last_hidden_state=self.hidden)


def _head(hfm: HFModel, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states ([n, H] rows or [B, T, H]) -> (fp32 logits, fp32 log-softmax), same
    leading shape.

    The logits are the model's own: its CausalLM forward runs on `hidden` with the base model
    swapped for a stub that returns them (logits_to_keep=0: every row), so a family's own final
    transform applies by construction (Granite's logits_scaling, Gemma's softcapping, Cohere's
    logit_scale, MiniCPM3's and Inkling's scaling of the hidden states, Inkling's vocabulary
    cut, ...) and a recorded logprob is log_softmax of `model(ids).logits.float()`. The base
    model still runs once per batch in `_forward`, and the callers pass rows chunk by chunk, so
    [tokens x vocab] never exists for a whole batch. The log-softmax is hfm.log_softmax (the
    kernel modes replace it).

    Shapes: a row's bits depend on how many rows go through lm_head's GEMM together (CPU and
    GPU libraries pick kernels and blockings by M; on CPU a 1-row product differs from the same
    row inside a 2-row one). So the head runs as the model's forward on ONE sequence does:
    [n, H] as [1, n, H] (one GEMM of n rows), [B, T, H] one sequence at a time as [1, T, H].
    The records then equal `model(ids)` on that sequence alone when the caller passes the
    sequence's hidden states as they are ([1, T, H] with T its length, or the [T, H] rows,
    the last position included: see _sequence_rows), and a sequence's logits do not depend on
    what else is in the batch. A decode step's [B, H] (one row per sequence) runs as one GEMM
    of B rows, as generate() does at batch B; [B, 1, H] would be B GEMVs that each read all of
    lm_head, far slower on a GPU.
    """
    if hidden.dim() == 3 and hidden.shape[0] > 1:
        parts = [_head(hfm, hidden[b : b + 1]) for b in range(hidden.shape[0])]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    model = hfm.model
    prefix = _base_name(model)
    x = hidden[None] if hidden.dim() == 2 else hidden
    stub = _GivenHidden(x)
    base = model._modules[prefix]
    model._modules[prefix] = stub
    try:
        out = model(logits_to_keep=0, return_dict=True)
    finally:
        model._modules[prefix] = base
    if stub.calls != 1:  # the forward did not take its hidden states from the base model: nothing proven
        raise RuntimeError(f"{type(model).__name__}.forward called its base model {stub.calls} times, expected once")
    logits = out.logits.float()
    if logits.shape[:-1] != x.shape[:-1]:
        raise RuntimeError(f"{type(model).__name__}.forward returned logits {tuple(logits.shape)} "
                           f"for hidden states {tuple(x.shape)}")
    if hidden.dim() == 2:
        logits = logits[0]
    return logits, hfm.log_softmax(logits)


def _sequence_rows(hfm: HFModel, hidden: torch.Tensor, targets: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """One sequence's final hidden states [n, H], every position of it (the last included), and
    the n - 1 tokens its rows 0..n-2 predict -> the per-row values of those n - 1 rows.

    The head runs on all n rows, the shape `model(ids)` gives lm_head for this sequence, so
    the records are bitwise those logits (see _head; the one extra row costs 1/n of the head).
    A sequence longer than LOGIT_ROWS_PER_CHUNK goes through in chunks of that many rows (the
    memory bound wins there; only such sequences can differ from a one-GEMM forward). n >= 2."""
    n = hidden.shape[0]
    if n < 2:
        raise ValueError(f"a sequence of {n} token(s) has no row to record")
    parts = []
    for i in range(0, n - 1, LOGIT_ROWS_PER_CHUNK):
        j = min(i + LOGIT_ROWS_PER_CHUNK, n)
        logits, lp = _head(hfm, hidden[i:j])
        keep = min(j, n - 1) - i
        parts.append(row_values(logits[:keep], lp[:keep], targets[i : i + keep], topk))
    return _cat_rows(parts)


def _cat_rows(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_rows(prompt_id: str, prompt_len: int, pos: np.ndarray, tokens: np.ndarray,
             vals: dict[str, np.ndarray], sel: np.ndarray, topk: int) -> TokenRows:
    k_ids, k_lp = (canonical_topk(vals["topk_ids"][sel], vals["topk_lp"][sel]) if topk
                   else (np.zeros((len(sel), 0), np.int32), np.zeros((len(sel), 0), np.float32)))
    return TokenRows(
        prompt_id=prompt_id, prompt_len=prompt_len, pos=pos.astype(np.int32), token_id=tokens.astype(np.int32),
        logprob=vals["logprob"][sel], top1=vals["top1"][sel].astype(np.int32),
        topk_ids=k_ids.astype(np.int32), topk_logprobs=k_lp, digest=vals["digest"][sel],
    )


def _host(vals: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    host = {k: v.cpu().numpy() for k, v in vals.items() if k != "digest"}
    host["digest"] = to_uint64(vals["digest"])
    return host


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

    _sync(hfm.device)
    t0 = time.perf_counter()
    hidden = _forward(hfm, ids, mask, positions, mask.bool(), [s.prompt_id for s in batch])
    # Row (b, t) predicts the token at t + 1; the head sees each sequence as model(ids) does.
    vals = _cat_rows([_sequence_rows(hfm, hidden[b, :n], ids[b, 1:n], topk) for b, n in enumerate(lens)])
    _sync(hfm.device)
    timing = Timing(prefill_s=time.perf_counter() - t0, prefill_tokens=sum(lens))

    host = _host(vals)
    rows, offset = [], 0
    for s, seq, n in zip(batch, seqs, lens):
        sel = np.arange(offset, offset + n - 1)
        offset += n - 1
        rows.append(_to_rows(s.prompt_id, len(s.prompt), np.arange(1, n), np.asarray(seq[1:]), host, sel, topk))
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
    # A static cache's mask spans every slot from the start; the steps fill it in.
    width = T + max_new if decode != "dynamic" else T
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
        logits, lp = _head(hfm, hidden_last)
        nxt = logits.argmax(dim=-1)
        if multi_rank:
            # One rank decides, as serving engines do, so ranks whose logits differ cannot fork.
            dist.broadcast(nxt, src=0)
        return {**row_values(logits, lp, nxt, topk), "chosen": nxt}

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
    stop = torch.tensor(hfm.stop_ids or (-1,), device=hfm.device)
    gen_len = torch.zeros(B, dtype=torch.long, device=hfm.device)  # generated tokens so far, per sequence
    done = torch.zeros(B, dtype=torch.bool, device=hfm.device)
    steps: list[dict[str, torch.Tensor]] = []
    step_mask = None
    t1 = time.perf_counter()
    for n in range(1, max_new + 1):  # step n's values are each row's n-th generated token
        steps.append(step)
        gen_len += ~done
        done |= torch.isin(step["chosen"], stop) | (gen_len >= limits)
        if n == max_new or (n % DONE_CHECK_EVERY == 0 and bool(done.all())):
            break
        # Finished rows keep decoding a pad token, as generate() does; their rows are not recorded.
        feed = torch.where(done, hfm.pad_id, step["chosen"])[:, None]
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
        if hfm.tracer is not None:  # the rows that feed a real token; a finished row feeds a pad
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

    stacked = _host({k: torch.stack([s[k] for s in steps]) for k in steps[0]})  # [steps, B, ...]
    rows = []
    for b, s in enumerate(batch):
        n_gen = int(gen_len[b])
        per_b = {k: v[:n_gen, b] for k, v in stacked.items()}
        rows.append(_to_rows(s.prompt_id, plens[b], np.arange(plens[b], plens[b] + n_gen), per_b["chosen"],
                             per_b, np.arange(n_gen), topk))
    return rows, timing
