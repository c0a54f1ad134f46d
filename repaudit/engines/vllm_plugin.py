"""TBIK inside vLLM, loaded through vLLM's plugin entry point (`vllm.general_plugins`).

vLLM calls register() in every process it starts (the engine core and each TP worker) before
it builds the model. It does nothing unless REPAUDIT_VLLM_TBIK=1, which the vLLM engine sets
only for `--kernels tbik` cells, so installing repaudit never changes anyone else's vLLM.

What changes: RowParallelLinear (o_proj and down_proj in Llama/Qwen-style models) is the only
layer whose reduction is split across ranks. Its forward becomes tbik.matmul_partial over this
rank's K shard (the fp32 root of its subtree of the fixed tree), an all-gather of the P roots
over vLLM's TP group and tbik.tree_sum (the same pairwise order on every rank), bias, one
cast. TP=1 runs the whole tree in one kernel, so TP=1 and TP=N add the same numbers in the
same order. Everything else is made batch-invariant by vLLM's own batch-invariant mode, which
the engine turns on with it; those layers do not reduce across ranks, so batch invariance
there is TP invariance too.

The tbik kernels enter vLLM's graph as two torch custom ops: torch.compile (on by default in
vLLM) then treats them as opaque calls instead of tracing Triton launchers, and CUDA graphs
capture them like any other kernel. The all-gather is vLLM's own (its custom op, graph-safe).
"""

# No `from __future__ import annotations` here: torch.library.custom_op reads the type
# annotations of the op functions below as objects to infer the ops' schemas.
import os

ENV = "REPAUDIT_VLLM_TBIK"
# The vLLM versions this plugin and the engine were run against; others are refused up front
# (vllm_engine.require), since the plugin replaces a method of vLLM's own layer class.
TESTED_VLLM = ("0.25.1",)


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    import vllm
    from vllm.model_executor.layers import linear

    if vllm.__version__ not in TESTED_VLLM:
        raise RuntimeError(f"repaudit's tbik plugin was tested with vLLM {', '.join(TESTED_VLLM)}, not {vllm.__version__}")
    if getattr(linear.RowParallelLinear, "_repaudit_tbik", False):
        return
    _define_ops()
    linear.RowParallelLinear.forward = _tree_forward
    linear.RowParallelLinear._repaudit_tbik = True


def _define_ops() -> None:
    import torch

    @torch.library.custom_op("repaudit::tbik_partial", mutates_args=())
    def tbik_partial(x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        import tbik

        return tbik.matmul_partial(x, weight.t(), tp_size=tp)

    @tbik_partial.register_fake
    def _(x, weight, tp):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.custom_op("repaudit::tbik_tree_sum", mutates_args=())
    def tbik_tree_sum(gathered: torch.Tensor, parts: int) -> torch.Tensor:
        import tbik

        return tbik.tree_sum(gathered.view(parts, -1, gathered.shape[-1]))

    @tbik_tree_sum.register_fake
    def _(gathered, parts):
        return gathered.new_empty((gathered.shape[0] // parts, gathered.shape[-1]))


def _tree_forward(self, input_):
    import torch
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if not isinstance(self.quant_method, UnquantizedLinearMethod):
        raise RuntimeError(f"tbik: {type(self).__name__} with {type(self.quant_method).__name__} is not covered "
                           "(unquantized weights only)")
    tp = self.tp_size
    if tp > 1 and not self.reduce_results:
        raise RuntimeError("tbik: a row-parallel layer that leaves its all-reduce to the caller is not covered")
    x = input_
    if not self.input_is_parallel:
        x = x.tensor_split(tp, dim=-1)[self.tp_rank].contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    root = torch.ops.repaudit.tbik_partial(x2, self.weight, tp)
    if tp > 1:
        # Rank order along dim 0: the tree's leaves in the order TP=1 adds them.
        root = torch.ops.repaudit.tbik_tree_sum(get_tp_group().all_gather(root, dim=0), tp)
    if self.bias is not None and not self.skip_bias_add:
        root = root + self.bias.float()
    out = root.to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)
