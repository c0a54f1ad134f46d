"""TBIK inside vLLM, loaded through vLLM's plugin entry point (`vllm.general_plugins`).

vLLM calls register() in every process it starts (the engine core and each TP worker) before
it builds the model. It does nothing unless REPAUDIT_VLLM_TBIK=1, which the vLLM engine sets
only for `--kernels tbik` cells, so installing repaudit never changes anyone else's vLLM.

What changes: RowParallelLinear (o_proj and down_proj in Llama/Qwen-style models) is the only
layer whose reduction is split across ranks. Its forward becomes tbik.matmul_partial over this
rank's K shard (the fp32 root of its subtree of the fixed 8-leaf tree), tbik.tree_all_reduce
over vLLM's TP group (the same pairwise order on every rank), bias, one cast. TP=1 runs the
whole tree in one kernel, so TP=1 and TP=N add the same numbers in the same order. Everything
else (column-parallel matmuls, attention, norms, log-softmax) is made batch-invariant by
vLLM's own batch-invariant mode, which the engine turns on with it; those layers do not reduce
across ranks, so batch invariance there is TP invariance too.
"""

from __future__ import annotations

import os

ENV = "REPAUDIT_VLLM_TBIK"


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.model_executor.layers import linear

    if getattr(linear.RowParallelLinear, "_repaudit_tbik", False):
        return
    linear.RowParallelLinear.forward = _tree_forward
    linear.RowParallelLinear._repaudit_tbik = True


def _tree_forward(self, input_):
    import tbik
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
    root = tbik.matmul_partial(x2, self.weight.t(), tp_size=tp)
    if tp > 1:
        root = tbik.tree_all_reduce(root, get_tp_group().device_group)
    if self.bias is not None and not self.skip_bias_add:
        root = root + self.bias.float()
    out = root.to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)
