"""The transformers engine's head: final hidden states -> the model's own logits, their
log-softmax and the values a record keeps of each row, and those values on the host.

A row's bits depend on how many rows go through lm_head's GEMM together (CPU and GPU libraries
pick kernels and blockings by M; on CPU a 1-row product differs from the same row inside a
2-row one). So the head runs as the model's forward on ONE sequence does: a sequence's rows as
one [1, n, H] GEMM (a sequence longer than LOGIT_ROWS_PER_CHUNK + 1 in chunks of that many rows:
see head_plan), a decode step's B rows as one GEMM of B rows as generate() does at batch B.
The records then equal `model(ids)` on that sequence alone, and a sequence's logits do not
depend on what else is in the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .row_values import row_values, widen, widen_parts
from .source import same_code

LOGIT_ROWS_PER_CHUNK = 256


def base_name(model: torch.nn.Module) -> str:
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


# transformers' CausalLM forward as Llama's modeling file writes it (and every family copying
# it, Qwen3's and Gemma's among them): the logits are lm_head of the base model's hidden states,
# nothing more. A family whose forward reads so gets its logits from lm_head directly, without
# the forward's host work (the output classes alone cost about as much as the GEMM's launch);
# anything else (a scale, a soft cap, a vocabulary cut) runs its own forward (_head).
_LLAMA_CAUSAL_LM_FORWARD = """
def forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> CausalLMOutputWithPast:
    outputs: BaseModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = outputs.last_hidden_state
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden_states[:, slice_indices, :])
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
"""


def head_is_lm_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are lm_head(final hidden states) by its own code: its class's
    forward is Llama's, nothing stands in for it on the instance, and no hook runs around it."""
    return (same_code(type(model).forward, _LLAMA_CAUSAL_LM_FORWARD) and "forward" not in model.__dict__
            and base_name(model) == "model" and not (model._forward_hooks or model._forward_pre_hooks))


def model_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Final hidden states [1, n, H] -> the model's logits [1, n, V], in the model's dtype.

    They are the model's own: for a family that is not head_is_lm_head, its CausalLM forward
    runs on `x` with the base model swapped for a stub that returns them (logits_to_keep=0:
    every row), so a family's own final transform applies by construction (Granite's
    logits_scaling, Gemma 2's softcapping, Cohere's logit_scale, MiniCPM3's and Inkling's
    scaling of the hidden states, Inkling's vocabulary cut, ...)."""
    if head_is_lm_head(model):
        return model.lm_head(x)
    prefix = base_name(model)
    stub = _GivenHidden(x)
    base = model._modules[prefix]
    model._modules[prefix] = stub
    try:
        out = model(logits_to_keep=0, return_dict=True)
    finally:
        model._modules[prefix] = base
    if stub.calls != 1:  # the forward did not take its hidden states from the base model: nothing proven
        raise RuntimeError(f"{type(model).__name__}.forward called its base model {stub.calls} times, expected once")
    if out.logits.shape[:-1] != x.shape[:-1]:
        raise RuntimeError(f"{type(model).__name__}.forward returned logits {tuple(out.logits.shape)} "
                           f"for hidden states {tuple(x.shape)}")
    return out.logits


def step_head(model: torch.nn.Module, log_softmax: Callable[..., torch.Tensor],
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decode step's final hidden states [B, H] -> (fp32 logits, fp32 log-softmax) [B, V] and
    the logits' digest partials (row_values.widen): a recorded logprob is log_softmax of
    `model(ids).logits.float()` (`log_softmax`: the engine's, which the kernel modes replace).
    The B rows go through lm_head as one GEMM of B rows, as generate() does at batch B;
    [B, 1, H] would be B GEMVs that each read all of lm_head, far slower on a GPU."""
    raw = model_logits(model, hidden[None])[0]
    logits = torch.empty(raw.shape, dtype=torch.float32, device=raw.device)
    parts = widen_parts(raw)
    widen(raw, logits, parts)
    return logits, log_softmax(logits), parts


# A head chunk's rows start at a multiple of this many rows in the group's buffers, so every fp32
# row sits at the 16-byte alignment it has in a tensor of its own (4 * 4 * V bytes from the
# buffer's start): torch's CUDA softmax picks its vector path by that alignment and reduces
# unaligned rows in another order, and Triton specializes a kernel on its pointers' alignment.
ROW_ALIGN = 4
# fp32 logits of the rows whose values one row_values call takes (as much again for their log-softmax)
GROUP_BYTES = 1 << 28


def _aligned(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


@dataclass
class HeadPlan:
    """Where each head chunk's rows go, made before the base model's forward is queued.

    Chunks are laid end to end in one row space, each starting at a multiple of ROW_ALIGN;
    a group is a run of whole chunks. The tokens the rows predict go to the device here, in one
    copy: a copy from pageable host memory waits for the stream to drain, which costs nothing
    while the stream is idle and a whole bubble once the forward is queued."""

    chunks: list[tuple[int, int, int, int]]  # (sequence, first row, rows through the head, rows recorded)
    starts: list[int]  # each chunk's first row in the row space
    targets: torch.Tensor  # int64 [rows], on the device; 0 on rows nothing is recorded from
    recorded: np.ndarray  # the rows recorded, in sequence order


def head_plan(seqs: list[list[int]], device: torch.device) -> HeadPlan:
    """The head chunks of right-padded sequences. Rows 0 .. n_b - 2 of sequence b are recorded
    (row t predicts token t + 1). A sequence of at most LOGIT_ROWS_PER_CHUNK + 1 tokens runs as
    one chunk of all n rows, the last one included: the shape `model(ids)` gives lm_head for
    this sequence, so the records are bitwise those logits (the extra row costs 1/n of the
    head). A longer one goes in chunks of LOGIT_ROWS_PER_CHUNK rows, the last chunk taking row
    n - 1 too where it has room (the memory bound wins there; only such sequences can differ
    from a one-GEMM forward)."""
    chunks, starts, recorded = [], [], []
    at = 0
    for b, seq in enumerate(seqs):
        n = len(seq)
        if n < 2:
            raise ValueError(f"a sequence of {n} token(s) has no row to record")
        # n - 1 rows to record fit one chunk: all n rows go in it, as model(ids) runs them.
        step = n if n <= LOGIT_ROWS_PER_CHUNK + 1 else LOGIT_ROWS_PER_CHUNK
        for i in range(0, n - 1, step):
            j = min(i + step, n)
            kept = min(j, n - 1) - i
            chunks.append((b, i, j, kept))
            starts.append(at)
            recorded.append(np.arange(at, at + kept))
            at += _aligned(j - i)
    targets = np.zeros(at, dtype=np.int64)
    for (b, i, _, kept), start in zip(chunks, starts):
        targets[start : start + kept] = seqs[b][i + 1 : i + 1 + kept]
    return HeadPlan(chunks, starts, torch.from_numpy(targets).to(device), np.concatenate(recorded))


def score_values(model: torch.nn.Module, log_softmax: Callable[..., torch.Tensor], hidden: torch.Tensor,
                 plan: HeadPlan, topk: int) -> dict[str, np.ndarray]:
    """Final hidden states [B, T, H] of right-padded sequences -> the values (on the host) of
    the rows plan.recorded: sequence b's positions 0 .. n_b - 2, sequences in order.

    Each chunk's logits are written, cast to fp32, into a group buffer (on a GPU the cast takes
    their digest partials on the way: row_values.widen), their log-softmax next to them; one
    row_values call then reads the whole group (a few launches per group, not per
    sequence). A row's values depend only on its own logits (row_values is row-wise), so
    grouping changes no bit."""
    total = len(plan.targets)
    values: list[dict[str, torch.Tensor]] = []
    logits_buf = lp_buf = digest_buf = None
    first = 0  # the current group's first row in the row space

    def flush(end: int) -> None:
        rows = end - first
        values.append(row_values(logits_buf[:rows], lp_buf[:rows], plan.targets[first:end], topk,
                                 None if digest_buf is None else digest_buf[:rows]))

    for (b, i, j, _), start in zip(plan.chunks, plan.starts):
        raw = model_logits(model, hidden[b, i:j][None])[0]
        end = start + _aligned(j - i)
        if logits_buf is None or end - first > len(logits_buf):
            if logits_buf is not None:
                flush(start)
                logits_buf = lp_buf = digest_buf = None  # their memory can serve the next group's buffers
            first = start
            vocab = raw.shape[-1]
            size = min(total - start, max(end - start, GROUP_BYTES // (4 * vocab) // ROW_ALIGN * ROW_ALIGN))
            logits_buf = torch.empty((size, vocab), dtype=torch.float32, device=raw.device)
            lp_buf = torch.empty_like(logits_buf)
            digest_buf = widen_parts(raw, size)
        rows = slice(start - first, start - first + j - i)
        widen(raw, logits_buf[rows], None if digest_buf is None else digest_buf[rows])  # .float()'s bits
        log_softmax(logits_buf[rows], out=lp_buf[rows])
    flush(total)
    host = host_values_of(values)  # one wait for the device
    return {k: np.concatenate([h[k] for h in host])[plan.recorded] for k in host[0]}


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def host_values(vals: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Row values -> numpy (the digest as uint64), in one copy from the device."""
    return host_values_of([vals])[0]


def host_values_of(parts: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    """Several dicts of row values -> numpy, in one copy from the device: their bytes packed
    into one tensor (each copy from a GPU is a wait of its own)."""
    # Widest first within each dict, so the first dict's views are aligned to their width; a later
    # one's may not be (numpy reads them all the same, and the caller's concatenate copies them).
    fields = [(g, k, v.contiguous()) for g, p in enumerate(parts)
              for k, v in sorted(p.items(), key=lambda kv: -kv[1].element_size())]
    flat = [v.reshape(-1) for _, _, v in fields]
    # A 0- or 1-element tensor counts as contiguous whatever its stride, which view() refuses.
    flat = [f if f.numel() > 1 else f.as_strided((f.numel(),), (1,)) for f in flat]
    packed = torch.cat([f.view(torch.uint8) for f in flat]).cpu().numpy()
    out: list[dict[str, np.ndarray]] = [{} for _ in parts]
    at = 0
    for g, k, v in fields:
        size = v.numel() * v.element_size()
        out[g][k] = packed[at : at + size].view(np.uint64 if k == "digest" else _NUMPY[v.dtype]).reshape(v.shape)
        at += size
    return out
