"""The transformers engine's decode steps over a static KV cache, replayed from a CUDA graph.

Why: an eager decode step of a transformers model is hundreds of small kernel launches issued
from Python, and at decode sizes the GPU spends most of the step waiting for them. A CUDA graph
replays the same kernels with one launch; it needs fixed shapes and addresses, hence
transformers' StaticCache (prompt + new - 1 slots, generate()'s max_length - 1) and the step's
inputs in fixed buffers.

Bits:
- A replay runs the kernels the eager step launches, on the same buffers: graphed and eager
  steps give the same bits (benchmarks/gpu_decode.sh checks it on the GPU for every mode).
- The masks are made outside the graph by the model's own mask function each step and copied
  into the graph's buffers, so a step sees the mask transformers would build for it.
- What the static cache changes is the attention's key count: the cache has all its slots from
  the start, masked past the current position. tbik's attention (bi and tbik modes) stops at
  the last written key, so those records are the dynamic cache's bit for bit; stock SDPA sums
  over the whole masked cache, so stock records are model.generate(cache_implementation="static",
  disable_compile=True)'s, which are not "dynamic"'s.
- Stock SDPA reads a grouped-query layer's cache of key/value heads in place instead of a copy
  of it repeated to the query heads every step (run/stock_attention.py): the same bits.

Tensor parallelism: each rank captures its own graph, collectives included (transformers'
row-parallel all-reduces, tbik's all-gather, the broadcast of the chosen tokens). NCCL
collectives replay from a graph as they ran when captured, on the same buffers, and every rank
replays the same sequence of them, so the ranks stay in step. The static cache holds each rank's
own KV heads (it is sized from the first keys it is given).

Used where it is known to hold: CUDA and a family whose layers are all full attention from
STATIC_FAMILIES. Anything else decodes eagerly with a dynamic cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

# Dense families whose static-cache decode is checked on the CPU against the model's own
# static-cache forward (test_conformance.py, stock) and against the dynamic cache
# (test_hf_decode.py, bi and tbik), and whose captured step is checked on a GPU. MoE families
# stay out: their expert dispatch reads routing counts on the host, which a graph cannot replay.
STATIC_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def static_supported(model: torch.nn.Module) -> bool:
    """Whether generate() may decode this model over a static cache from CUDA graphs."""
    cfg = model.config.get_text_config()
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    # static_mask builds the plain causal mask: a sliding window (Mistral's default 4096, or a
    # family's sliding layers) would need the model's other mask function; and it hands the
    # attention a 4-D mask, which flash-attention-2 would take for a 2-D one.
    return (cfg.model_type in STATIC_FAMILIES and layer_types == {"full_attention"}
            and getattr(cfg, "sliding_window", None) is None and cfg._attn_implementation in ("sdpa", "eager"))


def graphs_available(device: torch.device) -> bool:
    """Whether decode steps on `device` can be replayed from CUDA graphs (else they run eagerly)."""
    return device.type == "cuda"


def new_cache(model: torch.nn.Module, slots: int) -> Any:
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=slots)


@dataclass
class GraphedStep:
    """One decode step of a batch, captured once and replayed.

    `forward(ids, mask, positions)` must be the eager step (the base model's forward on the
    static cache, then whatever the caller computes from its hidden states), returning a dict
    of tensors; the graph records exactly it. A call returns fresh tensors: the graph's own
    outputs are rewritten by the next replay.
    """

    forward: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], dict[str, torch.Tensor]]
    cache: Any
    tracer: Any = None  # a repaudit.run.trace.Tracer: its hooks' kernels are captured too
    traced: Any = None  # the capture's trace, packed by the graph's own kernels (Tracer.pack)
    inputs: tuple[torch.Tensor, ...] = ()  # ids, mask, positions: the graph's fixed buffers
    outputs: dict[str, torch.Tensor] | None = None
    graph: Any = None
    failed: str | None = None  # why the capture was refused; the steps then run eagerly

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.failed is not None or mask is None:  # a graph's inputs are fixed tensors
            return self.forward(ids, mask, positions)
        if self.graph is None:
            return self._capture(ids, mask, positions)
        for buf, x in zip(self.inputs, (ids, mask, positions)):
            if buf.shape != x.shape or buf.dtype != x.dtype:
                raise RuntimeError(f"a decode step's input changed from {tuple(buf.shape)} {buf.dtype} to "
                                   f"{tuple(x.shape)} {x.dtype} after the graph was captured")
            buf.copy_(x)
        self.graph.replay()
        return self._outputs()

    def _outputs(self) -> dict[str, torch.Tensor]:
        if self.tracer is not None:
            self.tracer.replay(self.traced)
        return {k: v.clone() for k, v in self.outputs.items()}

    def _capture(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        self.inputs = (ids.clone(), mask.clone(), positions.clone())
        lengths = _cache_lengths(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        mark = self.tracer.mark() if self.tracer is not None else None
        warming = self.tracer.warming() if self.tracer is not None else contextlib.nullcontext()
        with torch.cuda.stream(stream), warming:
            # Warm-up on the capture's stream: Triton compiles and cuBLAS sets up here, not
            # inside the capture. It writes this step's cache slot, which the replay rewrites;
            # what it traced is dropped, the replay traces the step.
            self.forward(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        _set_cache_lengths(self.cache, lengths)
        if mark is not None:
            self.tracer.take_since(mark)
        graph = torch.cuda.CUDAGraph()
        # With several ranks, NCCL's watchdog thread polls events while this thread captures;
        # "thread_local" keeps its calls from invalidating the capture.
        mode = "thread_local" if dist.is_initialized() and dist.get_world_size() > 1 else "global"
        # The tracer's exit comes after the graph's: it fills in what its launches read (Tracer.capturing).
        capturing = self.tracer.capturing() if self.tracer is not None else contextlib.nullcontext()
        try:
            with capturing, torch.cuda.graph(graph, capture_error_mode=mode):
                self.outputs = self.forward(*self.inputs)
                if mark is not None:  # packed inside the graph: a replay's trace is then a few copies
                    self.traced = self.tracer.pack(self.tracer.take_since(mark))
        except RuntimeError as exc:  # a host sync or an unsupported op inside the step
            self.failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            torch.cuda.synchronize()
            _set_cache_lengths(self.cache, lengths)
            if mark is not None:
                self.tracer.take_since(mark)
                self.traced = None
            return self.forward(ids, mask, positions)
        self.graph = graph
        graph.replay()
        return self._outputs()


def _cache_lengths(cache: Any) -> list[torch.Tensor]:
    return [layer.cumulative_length.clone() for layer in cache.layers]


def _set_cache_lengths(cache: Any, lengths: list[torch.Tensor]) -> None:
    for layer, n in zip(cache.layers, lengths):
        layer.cumulative_length.copy_(n)


def static_mask(model: torch.nn.Module, mask2d: torch.Tensor, cache: Any, queries: int) -> torch.Tensor | None:
    """The 4-D mask the base model would build for the next `queries` tokens over the static
    cache, given the 2-D padding mask over every slot (1 where a real token's key is or goes).
    The base model takes a 4-D mask as it is, so the forward does no mask work of its own (a
    graph could not replay the host checks some mask functions make). Made eagerly, outside
    any graph, by the model's own mask function; a 2-D answer (flash-style functions,
    repaudit's tbik attention) becomes [B, 1, 1, slots]: the last query's row, from which
    tbik's attention reads where the written keys end. None where the model's own function
    answers None (no mask: sdpa's is_causal, or every slot holds a real key)."""
    from transformers.masking_utils import create_causal_mask

    dtype = next(model.parameters()).dtype
    probe = torch.empty((mask2d.shape[0], queries, 1), dtype=dtype, device=mask2d.device)
    mask = create_causal_mask(config=model.base_model.config, inputs_embeds=probe, attention_mask=mask2d,
                              past_key_values=cache, position_ids=None)
    if mask is None:  # the causal mask alone (sdpa's is_causal), or every slot is a real key
        return None
    return mask[:, None, None, :] if mask.dim() == 2 else mask


def advance_mask(step_mask: torch.Tensor, slot: int) -> torch.Tensor:
    """The next decode step's mask from this step's (static_mask's answer for one query), made
    on the device without the mask function's host work: the step's query moves to `slot`, and
    the only entry that changes is that slot's key, which becomes what the previous slot's is.
    Both are keys of real tokens at or before the query (the last prompt token or a generated
    one, in every row, finished rows included: they decode their stop id, pad tokens or greedy
    tokens, which the padding mask counts as real, as generate() does), so the value is "allowed"
    in whatever form the mask function gave (True, 0.0, 1). tests/test_hf_decode.py checks it
    equals static_mask's answer at every step, bit for bit."""
    nxt = step_mask.clone()
    nxt[..., slot] = step_mask[..., slot - 1]
    return nxt
