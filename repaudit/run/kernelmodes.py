"""Kernel modes of the transformers engine, switched per cell inside one loaded model.

- stock: transformers' own kernels, bit for bit. Two chains of element-wise ops run fused, with
  the eager chains' bits: Llama-form RMSNorms (their squares in one kernel, torch's own mean, the
  scaling in one more) and Llama's rotary embedding (tbik.apply_rope); and SDPA under a mask
  reads grouped key/value heads in place (stock_attention.py).
- bi: batch-invariant. Every matmul (aten mm/addmm), log-softmax and last-dim mean goes to
  tbik's fixed-configuration kernels, attention to tbik's attention (fixed KV blocks counted
  from each sequence's first real token). Row-parallel layers still sum their bf16 outputs
  with the stock all-reduce, so bits move with the TP size.
- tbik: bi, plus the TBIK tree: every matmul cuts K into tbik.NUM_CHUNKS chunks combined in
  one pairwise tree, and each row-parallel layer returns its rank's fp32 subtree root, which
  tbik.tree_all_reduce combines in the same pairwise order on every rank before the one
  cast. TP=1 and TP=P then add the same numbers in the same order.
- In both, a mixture-of-experts layer's fused experts run experts.invariant_forward (tbik's
  matmuls per expert, the TP reduction before the routing weights; see experts.py).

The switch lives here, not in model files: it reads the model's own TP plan, so any family
whose plan uses colwise/rowwise linear layers is covered; anything else is refused by name.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Iterator

import torch

from ..engines.source import same_code
from .experts import invariant_experts, is_experts, unsupported_reason
from . import stock_attention
from .forwards import replaced_forwards
from .plan import attention_refusal

# TP styles whose forward tbik can take over or leave alone without changing invariance.
_COLUMN = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"}  # K whole: the aten override covers them
_ROW = {"rowwise", "rowwise_rep"}  # K sharded: partial + tree all-reduce
_NEUTRAL = {"replicated_with_grad_allreduce", "embedding_rowwise"}  # no reduction, or sums of exact zeros
_EXPERTS = {"moe_tp_experts"}  # fused experts: experts.invariant_forward does their TP reduction

ATTENTION_NAME = "repaudit_tbik"


class UnsupportedLayer(Exception):
    """A layer tbik cannot make invariant; the message names it."""


def tp_styles(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> TP style, from transformers' resolved plan."""
    from transformers.distributed.tensor_parallel import _get_parameter_tp_plan

    plan = getattr(model, "tp_plan", None) or {}
    styles = {}
    for name, _ in model.named_modules():
        style = _get_parameter_tp_plan(parameter_name=name, tp_plan=plan, is_weight=False) if plan else None
        if style:
            styles[name] = style
    return styles


def check_supported(model: torch.nn.Module, tp: int) -> None:
    """Refuse, naming the layer, what the tree kernels cannot cover."""
    refusal = attention_refusal(model.config.get_text_config())
    if refusal:
        raise UnsupportedLayer(f"{refusal} ({type(model).__name__}) is not covered by tbik's attention")
    for name, module in model.named_modules():
        reason = unsupported_reason(module) if is_experts(module) else None
        if reason:
            raise UnsupportedLayer(f"layer {name!r} ({type(module).__name__}) is not covered by the tbik kernels: {reason}")
    if tp == 1:
        return
    for name, style in tp_styles(model).items():
        module = model.get_submodule(name)
        if style in _NEUTRAL or (style in _EXPERTS and is_experts(module)):
            continue
        if style in _COLUMN | _ROW and isinstance(module, torch.nn.Linear):
            continue
        raise UnsupportedLayer(f"layer {name!r} ({type(module).__name__}, TP style {style!r}) is not covered by the tbik kernels")


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    # A 2-D padding mask (or None): the kernel needs where each sequence starts, not a dense mask.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, flash_attention_mask)


# Arguments transformers' attention functions take that change what attention computes; tbik's
# kernel implements none of them, so a layer that passes one is refused, never run without it.
_SEMANTIC_ARGS = {"sliding_window": "sliding-window attention", "softcap": "attention logit soft-capping",
                  "s_aux": "attention sinks", "sinks": "attention sinks", "block_indices": "block-sparse attention",
                  "indices": "indexer-selected sparse attention", "position_bias": "an attention position bias",
                  "alibi_slopes": "ALiBi", "head_mask": "a head mask"}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    import tbik

    for arg, what in _SEMANTIC_ARGS.items():
        if kwargs.get(arg) is not None and kwargs.get(arg) is not False:
            raise UnsupportedLayer(f"{what} in {type(module).__name__} is not covered by tbik's attention")
    if kwargs.get("is_causal") is False:
        raise UnsupportedLayer(f"bidirectional attention in {type(module).__name__} is not covered by tbik's attention")
    start, end = _key_bounds(attention_mask, query)
    out = tbik.attention(query, key, value, start=start, end=end, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


# Every layer of one forward gets the same mask, so its key bounds are made once, by the first
# layer (eight small kernels a layer otherwise: a decode step's share was 6%). Cleared as each
# forward of the base model begins: a CUDA graph's capture reuses the warm-up's mask tensor with
# new contents, and must record the bounds' kernels itself.
_BOUNDS: dict[str, tuple] = {}


def _key_bounds(attention_mask, query) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(first real key, end of the written keys or None) per sequence, from the layer's mask."""
    batch = query.shape[0]
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.int32, device=query.device), None
    held = _BOUNDS.get("mask")
    if held is not None and held[0] is attention_mask:
        return held[1], held[2]
    if attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
        raise ValueError("tbik attention takes a boolean 4-D mask (True: attend), got an additive one")
    end = None  # the queries are the last Tq of the keys
    mask = attention_mask.bool().int()
    if mask.dim() == 4:
        # A static KV cache's [B, 1, Tq, slots] mask (engines/hf_decode.static_mask): the
        # last query's row ends at the last key written, and the slots after it, not written
        # yet, must not be seen.
        mask = mask[:, 0, -1]
        end = (mask.shape[1] - mask.flip(1).argmax(dim=1)).to(torch.int32)
    start = mask.argmax(dim=1).to(torch.int32)  # first real key; left padding ends there
    _BOUNDS["mask"] = (attention_mask, start, end)
    return start, end


@contextmanager
def _bounds_per_forward(model: torch.nn.Module) -> Iterator[None]:
    handle = model.base_model.register_forward_pre_hook(lambda *args: _BOUNDS.clear())
    try:
        yield
    finally:
        handle.remove()
        _BOUNDS.clear()


def _row_parallel_forward(module: torch.nn.Linear, group, tp: int):
    """y = tree_all_reduce(fp32 partial of this rank's K shard) + bias, then one cast."""
    from torch.distributed.tensor import DTensor

    import tbik

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    def forward(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            x = x.to_local()
        weight = local(module.weight)
        x2 = x.reshape(-1, x.shape[-1])
        root = tbik.tree_all_reduce(tbik.matmul_partial(x2, weight.t(), tp_size=tp), group)
        if module.bias is not None:
            root = root + local(module.bias).float()
        return root.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    return forward


@contextmanager
def _row_parallel_tree(model: torch.nn.Module, tp: int) -> Iterator[None]:
    if tp == 1:  # nothing is sharded: the aten override already runs the whole tree in one kernel
        yield
        return
    import torch.distributed as dist

    rows = [model.get_submodule(name) for name, style in tp_styles(model).items() if style in _ROW]
    with replaced_forwards([(m, _row_parallel_forward(m, dist.group.WORLD, tp)) for m in rows]):
        yield


# Llama's RMSNorm forward, which most families copy. Under the mode's aten overrides these ops
# are seven kernels (cast, pow, tbik's mean, add, rsqrt, mul, cast, mul) that tbik.rms_norm does
# in one with their bits (tests/test_tbik_gpu.py::test_rms_norm_gives_the_eager_ops_bits; the same
# eager ops on the CPU). A norm whose forward reads otherwise (Gemma's 1 + weight, ...) keeps it.
_LLAMA_RMS_NORM = """
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""


def _is_llama_rms_norm(module: torch.nn.Module) -> bool:
    return same_code(type(module).forward, _LLAMA_RMS_NORM)


def _replaced_norms(model: torch.nn.Module, norm) -> list[tuple[torch.nn.Module, object]]:
    """Every Llama-form RMSNorm, its forward norm(module, x), or the module's own where norm
    declines (None) or the operands are a DTensor or float64."""

    def replaced(module):
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            out = norm(module, hidden_states) if _kernel_dtypes(hidden_states, module.weight.data) else None
            return type(module).forward(module, hidden_states) if out is None else out

        return forward

    return [(m, replaced(m)) for m in model.modules() if _is_llama_rms_norm(m)]


def _fused_norms(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    import tbik

    return _replaced_norms(model, lambda m, x: tbik.rms_norm(x, m.weight, m.variance_epsilon))


# The stock mode's RMSNorm: the same eight kernels, of which only the mean reduces, and whose
# order (torch's, picked from the tensor's shape, strides and alignment) no other kernel can
# promise to follow. So torch's own mean runs on the squares the eager ops would hand it (a new
# contiguous fp32 tensor of x's shape), and the two element-wise chains around it run as one
# kernel each: three kernels with the eager ops' bits
# (tests/test_tbik_gpu.py::test_rms_norm_with_torchs_mean_gives_the_stock_ops_bits).
def _stock_norms(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    import tbik

    def norm(module, x):
        if not x.is_contiguous():  # the eager squares would keep x's strides, and the mean follow them
            return None
        mean_sq = tbik.float_squares(x).mean(-1, keepdim=True)
        return tbik.rms_norm(x, module.weight, module.variance_epsilon, mean_sq=mean_sq)

    return _replaced_norms(model, norm)


# transformers' apply_rotary_pos_emb and rotate_half as Llama's modeling file (and every family
# copying it) writes them: in every mode ten kernels a layer (a product, a negation, a cat,
# a product and a sum, for q and for k; no reduction) that tbik.apply_rope does in two with their bits
# (tests/test_tbik_gpu.py::test_apply_rope_gives_transformers_apply_rotary_pos_emb_bits).
_LLAMA_ROPE = ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""", """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""")


def _rope_modules(model: torch.nn.Module) -> list:
    """The modeling modules of the model's layers whose rotary embedding is Llama's."""
    import sys

    found = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        funcs = [getattr(module, f, None) for f in ("apply_rotary_pos_emb", "rotate_half")]
        if module is not None and all(callable(f) and same_code(f, src) for f, src in zip(funcs, _LLAMA_ROPE)):
            found.append(module)
    return found


def _kernel_dtypes(*tensors: torch.Tensor) -> bool:
    """Whether tbik's element-wise kernels give these operands the eager ops' bits: plain tensors
    (a DTensor runs its own ops) of a dtype the kernels compute exactly (not float64)."""
    from tbik.backend import KERNEL_DTYPES

    return all(type(t) is torch.Tensor and t.dtype in KERNEL_DTYPES for t in tensors)


def _rope_fits(x, cos, sin) -> bool:
    """The shapes tbik.apply_rope takes (anything else, a DTensor or float64 included, runs
    transformers' own)."""
    if not _kernel_dtypes(x, cos, sin) or x.dim() != 4 or x.stride(-1) != 1:
        return False
    return all(c.dim() == 3 and c.shape[1:] == x.shape[2:] and c.shape[0] in (1, x.shape[0]) and c.dtype == x.dtype
               and c.stride(-1) == 1 for c in (cos, sin))


@contextmanager
def _fused_rope(model: torch.nn.Module) -> Iterator[None]:
    import tbik

    modules = _rope_modules(model)
    saved = [(m, m.apply_rotary_pos_emb) for m in modules]

    def fused(original):
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim != 1 or not _rope_fits(q, cos, sin) or not _rope_fits(k, cos, sin):
                return original(q, k, cos, sin, unsqueeze_dim)
            return tbik.apply_rope(q, cos, sin), tbik.apply_rope(k, cos, sin)

        return apply_rotary_pos_emb

    for module, original in saved:
        module.apply_rotary_pos_emb = fused(original)
    try:
        yield
    finally:
        for module, original in saved:
            module.apply_rotary_pos_emb = original


@contextmanager
def _attention_impl(model: torch.nn.Module, name: str, replacing: str | None = None) -> Iterator[None]:
    """Every config of the model on attention `name` for the body (only those on `replacing`,
    where given), then back."""
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules())]
               if c is not None and (replacing is None or getattr(c, "_attn_implementation", None) == replacing)}
    before = {k: c._attn_implementation for k, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = name
    try:
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = before[k]


@contextmanager
def _stock_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """The layers on transformers' SDPA run stock_attention's; a part of the model on another
    attention (a vision tower on eager, ...) keeps it."""
    stock_attention.register()
    with _attention_impl(model, stock_attention.STOCK_ATTENTION, replacing="sdpa"):
        yield


@contextmanager
def kernel_mode(hfm, mode: str, fused: bool = True) -> Iterator[None]:
    """Run the body with the cell's kernels; the model is back to transformers' own afterwards.
    fused=False leaves the RMSNorms, the rotary embedding and stock's SDPA to transformers' own
    ops (the same bits, more kernels): what the fused ops are timed and tested against."""
    rope = _fused_rope(hfm.model) if fused else nullcontext()
    if mode == "stock":
        with replaced_forwards(_stock_norms(hfm.model) if fused else []), rope, \
                (_stock_sdpa(hfm.model) if fused else nullcontext()):
            yield
        return
    if mode not in ("bi", "tbik"):
        raise ValueError(f"unknown kernel mode {mode!r}")
    import tbik

    check_supported(hfm.model, hfm.tp)
    _register_attention()
    chunks = tbik.NUM_CHUNKS if mode == "tbik" else 1
    with ExitStack() as stack:
        stack.enter_context(tbik.batch_invariant_mode(hfm.device.type, num_chunks=chunks))
        stack.enter_context(_attention_impl(hfm.model, ATTENTION_NAME))
        stack.enter_context(_bounds_per_forward(hfm.model))
        stack.enter_context(replaced_forwards(_fused_norms(hfm.model) if fused else []))
        stack.enter_context(rope)
        if mode == "tbik":
            stack.enter_context(_row_parallel_tree(hfm.model, hfm.tp))
        stack.enter_context(invariant_experts(hfm.model, num_chunks=chunks, tp=hfm.tp, tree=mode == "tbik"))
        previous = hfm.log_softmax
        hfm.log_softmax = lambda x, out=None: tbik.log_softmax(x, -1, out=out)
        stack.callback(setattr, hfm, "log_softmax", previous)
        yield
