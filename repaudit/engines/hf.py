"""The transformers engine: transformers' own tensor-parallel plan (DTensor), greedy decoding
with a KV cache, teacher-forced scoring. Logits are produced chunk by chunk from the final
hidden states so a long batch never holds [tokens x vocab] at once.

Padding follows production use: generate pads on the left (as `generate()` requires for
decoder-only models), score pads on the right (as trainers do). Only real positions are
recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..digest import row_digest, to_uint64
from ..errors import InputError
from .base import Sequence, Timing, TokenRows

LOGIT_ROWS_PER_CHUNK = 256
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFModel:
    model: torch.nn.Module
    device: torch.device
    tp: int
    eos_id: int | None
    pad_id: int
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    tracer: Any = None  # a repaudit.trace.Tracer while a traced cell runs


def _forward(hfm: HFModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             real: torch.Tensor, prompt_ids: list[str], **kwargs) -> torch.Tensor:
    """base_model forward; tells the tracer (if any) which flat rows are real and where they sit."""
    if hfm.tracer is not None:
        flat = real.flatten().nonzero().flatten()
        rows_b = (flat // ids.shape[1]).cpu().numpy()
        pos = positions.flatten()[flat].cpu().numpy()
        hfm.tracer.begin(ids.shape[0], ids.shape[1], flat, np.asarray(prompt_ids, dtype=object)[rows_b], pos)
    try:
        return hfm.model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).last_hidden_state
    finally:
        if hfm.tracer is not None:
            hfm.tracer.end()


def load(path: str, *, dtype: str, device: str, tp: int, trust_remote_code: bool = False,
         eos_id: int | None, pad_id: int) -> HFModel:
    from transformers import AutoModelForCausalLM

    cfg_check(path, trust_remote_code)
    if device == "cuda":
        local = torch.device("cuda", torch.cuda.current_device())
    else:
        local = torch.device("cpu")
    kwargs: dict = {"dtype": TORCH_DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if tp > 1:
        kwargs["tp_plan"] = "auto"
    else:
        kwargs["device_map"] = str(local)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return HFModel(model=model, device=local, tp=tp, eos_id=eos_id, pad_id=pad_id,
                   log_softmax=lambda x: torch.log_softmax(x, dim=-1))


def cfg_check(path: str, trust_remote_code: bool) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise InputError(f"model uses {attr}; repaudit computes logits from lm_head directly and does not apply it yet")


def _head(hfm: HFModel, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden rows -> (fp32 logits, fp32 log-softmax)."""
    logits = hfm.model.get_output_embeddings()(hidden).float()
    return logits, hfm.log_softmax(logits)


def _extract(logits: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    out = {
        "logprob": lp.gather(1, targets[:, None])[:, 0],
        "top1": logits.argmax(dim=-1),
        "digest": row_digest(logits),
    }
    if topk:
        out["topk_lp"], out["topk_ids"] = torch.topk(lp, topk, dim=-1)
    return out


def _logit_rows(hfm: HFModel, hidden: torch.Tensor, targets: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """hidden [n, H], targets [n] -> per-row values, chunk by chunk so [n x vocab] never exists."""
    parts = [
        _extract(*_head(hfm, hidden[i : i + LOGIT_ROWS_PER_CHUNK]), targets[i : i + LOGIT_ROWS_PER_CHUNK], topk)
        for i in range(0, hidden.shape[0], LOGIT_ROWS_PER_CHUNK)
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_rows(prompt_id: str, prompt_len: int, pos: np.ndarray, tokens: np.ndarray,
             vals: dict[str, np.ndarray], sel: np.ndarray, topk: int) -> TokenRows:
    k_ids = vals["topk_ids"][sel] if topk else np.zeros((len(sel), 0), np.int32)
    k_lp = vals["topk_lp"][sel] if topk else np.zeros((len(sel), 0), np.float32)
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
    # Row (b, t) predicts the token at t + 1; gather the real ones.
    b_idx = torch.cat([torch.full((n - 1,), b, dtype=torch.long) for b, n in enumerate(lens)]).to(hfm.device)
    t_idx = torch.cat([torch.arange(n - 1) for n in lens]).to(hfm.device)
    vals = _logit_rows(hfm, hidden[b_idx, t_idx], ids[b_idx, t_idx + 1], topk)
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
    """Greedy decoding with a KV cache; left padding. Records the prompt's positions (from the
    prefill) and every generated token, the EOS included."""
    from transformers import DynamicCache

    B = len(batch)
    plens = [len(s.prompt) for s in batch]
    T = max(plens)
    ids = torch.full((B, T), hfm.pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, T - plens[b] :] = torch.tensor(s.prompt)
        mask[b, T - plens[b] :] = 1
    ids, mask = ids.to(hfm.device), mask.to(hfm.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=hfm.model.config)
    multi_rank = dist.is_initialized() and dist.get_world_size() > 1

    def choose(hidden_last: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, lp = _head(hfm, hidden_last)
        nxt = logits.argmax(dim=-1)
        if multi_rank:
            # One rank decides, as serving engines do, so ranks whose logits differ cannot fork.
            dist.broadcast(nxt, src=0)
        return {**_extract(logits, lp, nxt, topk), "chosen": nxt}

    _sync(hfm.device)
    t0 = time.perf_counter()
    pids = [s.prompt_id for s in batch]
    hidden = _forward(hfm, ids, mask, positions, mask.bool(), pids, past_key_values=cache, use_cache=True)
    # Row (b, t) of a real prompt token predicts the token at t + 1.
    b_idx = torch.cat([torch.full((n - 1,), b, dtype=torch.long) for b, n in enumerate(plens)]).to(hfm.device)
    t_idx = torch.cat([torch.arange(T - n, T - 1) for n in plens]).to(hfm.device)
    prompt_vals = _logit_rows(hfm, hidden[b_idx, t_idx], ids[b_idx, t_idx + 1], topk) if len(b_idx) else None
    step = choose(hidden[:, -1])
    _sync(hfm.device)
    timing = Timing(prefill_s=time.perf_counter() - t0, prefill_tokens=sum(plens))

    limits = np.array([s.max_new_tokens for s in batch])
    gen_len = np.zeros(B, dtype=np.int64)  # generated tokens so far, per sequence
    done = np.zeros(B, dtype=bool)
    steps: list[dict[str, np.ndarray]] = []
    t1 = time.perf_counter()
    while True:
        vals = _host(step)
        steps.append(vals)
        gen_len[~done] += 1
        done |= (vals["chosen"] == hfm.eos_id) | (gen_len >= limits)
        if done.all():
            break
        timing.decode_tokens += int((~done).sum())
        # Finished rows keep decoding a pad token, as generate() does; their rows are not recorded.
        feed = torch.where(torch.from_numpy(done).to(hfm.device), torch.full_like(step["chosen"], hfm.pad_id), step["chosen"])
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=hfm.device)], dim=1)
        positions = positions[:, -1:] + 1
        live = torch.from_numpy(~done).to(hfm.device)[:, None]
        h = _forward(hfm, feed[:, None], mask, positions, live, pids, past_key_values=cache, use_cache=True)[:, -1]
        step = choose(h)
    _sync(hfm.device)
    timing.decode_s = time.perf_counter() - t1

    host_prompt = _host(prompt_vals) if prompt_vals is not None else None
    stacked = {k: np.stack([s[k] for s in steps]) for k in steps[0]}  # [steps, B, ...]
    rows, offset = [], 0
    for b, s in enumerate(batch):
        n_prompt, n_gen = plens[b] - 1, int(gen_len[b])
        parts = []
        if n_prompt:
            sel = np.arange(offset, offset + n_prompt)
            parts.append(_to_rows(s.prompt_id, plens[b], np.arange(1, plens[b]), np.asarray(s.prompt[1:]), host_prompt, sel, topk))
        offset += n_prompt
        per_b = {k: v[:n_gen, b] for k, v in stacked.items()}
        parts.append(_to_rows(s.prompt_id, plens[b], np.arange(plens[b], plens[b] + n_gen), per_b["chosen"],
                              per_b, np.arange(n_gen), topk))
        rows.append(_concat_rows(parts))
    return rows, timing


def _concat_rows(parts: list[TokenRows]) -> TokenRows:
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return TokenRows(prompt_id=parts[0].prompt_id, prompt_len=parts[0].prompt_len, pos=cat("pos"),
                     token_id=cat("token_id"), logprob=cat("logprob"), top1=cat("top1"), topk_ids=cat("topk_ids"),
                     topk_logprobs=cat("topk_logprobs"), digest=cat("digest"))
