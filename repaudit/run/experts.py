"""Mixture-of-experts layers under the invariant kernel modes: the experts' forward, made of tbik ops.

transformers' fused experts modules (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...: one
[experts, out, in] weight per projection, made by `use_experts_implementation`) run through
grouped_mm, a bmm over gathered weights, or a loop of F.linear per expert. aten::_grouped_mm and
bmm are not among the ops tbik's mode overrides, so their blockings may follow the number of
tokens an expert got, that is the batch. Under TP (`moe_tp_experts`) each rank's output, already
cast to the model dtype and weighted, is summed by one stock all-reduce, so the bits move with
the TP size as well.

In bi and tbik this forward replaces the module's (and the TP wrapper's), for every (token, slot)
pair the router chose:

    h = act(x @ gate_e^T) * (x @ up_e^T)        tree matmul, K = hidden whole on every rank
    y = h @ down_e^T                            fp32 root of the 8-chunk tree (tbik), or of this
                                                rank's chunks, tree-all-reduced over the ranks
    out = cast(y_0) * w_0 + cast(y_1) * w_1 + ...   in the router's slot order, model dtype

The cast, the routing weight and the sum over slots come after the all-reduce, so TP=1 and TP=P
add the same numbers in the same order; the price is an all-gather of [tokens x top_k, hidden]
fp32 partials per layer where stock all-reduces [tokens, hidden] in the model dtype. Under bi at
TP > 1 the fp32 partials go through the stock all-reduce instead (batch-invariant, not
TP-invariant, as bi is for dense layers). The router (a linear layer, softmax, top-k, the top-k
renormalisation) is the family's own code: its matmul goes through tbik's override, its softmax,
top-k and sums are row-wise torch ops.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from .forwards import replaced_forwards


def is_experts(module: torch.nn.Module) -> bool:
    """A fused experts module: 3-D expert weights, called as (hidden, top_k_index, top_k_weights)."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.Tensor) and down.dim() == 3


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """Why this experts module's layout is not one the invariant forward computes, or None."""
    gate_up = getattr(module, "gate_up_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and getattr(module, "has_gate", False)):
        return "its experts have no fused gate/up weight"
    for attr, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True)):
        if getattr(module, attr, None) is not want:
            return f"its experts' weights have {attr}={getattr(module, attr, None)!r}"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def invariant_forward(module: torch.nn.Module, *, num_chunks: int, tp: int, tree: bool, group=None) -> Callable:
    """The module's forward as described above; tree=False (bi) sums TP partials with the stock all-reduce."""
    import torch.distributed as dist

    import tbik

    def down(h: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        if tp == 1:
            return tbik.tree_matmul(h, weight_t, num_chunks=num_chunks, out_dtype=torch.float32)
        if tree:
            return tbik.matmul_partial(h, weight_t, tp_size=tp, num_chunks=num_chunks)
        return tbik.tree_matmul(h, weight_t, num_chunks=1, out_dtype=torch.float32)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = _local(hidden_states)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids = _local(top_k_index).reshape(len(x), -1)
        weights = _local(top_k_weights).reshape(len(x), -1)
        gate_up, down_w = _local(module.gate_up_proj), _local(module.down_proj)
        k, flat = ids.shape[1], ids.reshape(-1)
        y = torch.zeros((flat.numel(), down_w.shape[1]), dtype=torch.float32, device=x.device)
        # Pairs grouped by expert (stable: token order inside a group); the groups' sizes never
        # reach a kernel's configuration, so a pair's bits do not depend on who else was routed.
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            rows = order[start : start + n]
            start += n
            if not 0 <= e < gate_up.shape[0]:  # an expert-parallel sentinel: no expert, zero output
                continue
            h = module._apply_gate(tbik.tree_matmul(x[rows // k], gate_up[e].t(), num_chunks=num_chunks))
            y[rows] = down(h, down_w[e].t())
        if tp > 1:
            if tree:
                y = tbik.tree_all_reduce(y, group)
            else:
                dist.all_reduce(y, group=group)
        terms = (y.to(x.dtype).view(len(x), k, -1) * weights[..., None]).to(x.dtype)
        out = terms[:, 0]
        for j in range(1, k):  # slot by slot: one fixed order, whatever the reduction kernels do
            out = out + terms[:, j]
        return out.reshape(shape)

    return forward


@contextmanager
def invariant_experts(model: torch.nn.Module, *, num_chunks: int, tp: int, tree: bool) -> Iterator[int]:
    """Every fused experts module of the model runs invariant_forward in the body; yields how many."""
    group = None
    if tp > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    with replaced_forwards([(module, invariant_forward(module, num_chunks=num_chunks, tp=tp, tree=tree, group=group))
                            for module in model.modules() if is_experts(module)]) as n:
        yield n
