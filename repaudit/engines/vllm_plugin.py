"""TBIK inside vLLM, loaded through vLLM's plugin entry point (`vllm.general_plugins`).

vLLM calls register() in every process it starts (the engine core and each TP worker) before
it builds the model. It does nothing unless REPAUDIT_VLLM_TBIK=1, which the vLLM engine sets
only for `--kernels tbik` cells, so installing repaudit never changes anyone else's vLLM.

A tbik cell computes what the transformers engine computes in its tbik mode, op for op
(hf_ops.py says how each op differs from vLLM's own):
- every linear layer and the lm_head: tbik's tree matmul over the whole K. Row-parallel
  layers at TP > 1 take the fp32 root of their rank's subtree (tbik.matmul_partial), gather
  the P roots over vLLM's TP group and add them in the tree's order (tbik.tree_sum), then one
  cast: TP=1 and TP=N add the same numbers in the same order. At TP=2 the tree is one
  addition, and vLLM's all-reduce of the two fp32 roots computes it (as tbik.tree_all_reduce's
  "pair" does). In vLLM's Llama, Qwen2 and Qwen3 models the cast is left to the add-norm
  that reads the sum (_fold_casts_into_norms).
- RMSNorm (and the residual add vLLM fuses into it), SiLU-and-mul, rotary embedding: the
  transformers modules' own arithmetic, with tbik's last-dim mean. Qwen3's per-head q and k
  norms and the rotary embedding after them are one op (tbik.qk_norm_rope, the same bits).
- attention: tbik's attention over the paged KV cache (hf_ops.paged_attention), in place of
  flash-attention's kernel; vLLM still writes the cache.
- logprobs: tbik's log-softmax of the fp32 logits (vLLM's own kernel sums each row in another
  order: one ULP apart on about one logprob in six).

The layer ops enter vLLM's graph as torch operators, so torch.compile treats them as opaque
calls and CUDA graphs capture their kernels. The attention kernel's grid comes from the step's
request count and longest query, read on the host: vLLM's full decode graphs fix both (a request
padded into one writes only its own rows), and its piecewise graphs
run attention between the pieces. vllm_engine.engine_args picks the flash-attention backend
this file patches. A layer this plugin cannot reproduce raises, naming it, instead of running
stock.
"""

from __future__ import annotations

import os

ENV = "REPAUDIT_VLLM_TBIK"
# The vLLM versions this plugin and the engine were run against; others are refused up front
# (vllm_engine.require), since the plugin replaces methods of vLLM's own classes.
TESTED_VLLM = ("0.25.1",)


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    import vllm
    from vllm.model_executor.layers import activation, layernorm, linear, vocab_parallel_embedding
    from vllm.model_executor.layers.rotary_embedding import base as rope_base
    from vllm.model_executor.models import llama, qwen2, qwen3
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.sample import sampler
    from vllm.v1.worker.gpu.sample import logprob

    from . import hf_ops

    if vllm.__version__ not in TESTED_VLLM:
        raise RuntimeError(f"repaudit's tbik plugin was tested with vLLM {', '.join(TESTED_VLLM)}, not {vllm.__version__}")
    if getattr(linear.RowParallelLinear, "_repaudit_tbik", False):
        return
    _define_ops()
    linear.UnquantizedLinearMethod.apply = _linear_apply
    vocab_parallel_embedding.UnquantizedEmbeddingMethod.apply = _linear_apply  # the lm_head
    linear.RowParallelLinear.forward = _row_parallel_forward
    layernorm.RMSNorm.forward = _rms_norm_forward
    activation.SiluAndMul.forward = _silu_and_mul_forward
    rope_base.RotaryEmbedding.__init__ = _with_inv_freq(rope_base.RotaryEmbedding.__init__)
    rope_base.RotaryEmbedding.forward = _rope_forward
    flash_attn.FlashAttentionImpl.forward = _attention_forward
    qwen3.Qwen3Attention.forward = _with_fused_qk_norm_rope(qwen3.Qwen3Attention.forward)
    for model in (llama.LlamaModel, qwen2.Qwen2Model):  # Qwen3Model's __init__ is Qwen2Model's, with its layers
        model.__init__ = _with_casts_folded(model.__init__)
    sampler.Sampler.compute_logprobs = staticmethod(hf_ops.log_probs)  # vLLM's first model runner
    logprob.compute_token_logprobs = _token_logprobs  # its second ("V2"), the default in 0.25
    linear.RowParallelLinear._repaudit_tbik = True


# (schema, the function the CPU and CUDA kernels run, its fake for torch.compile's tracing)
def _op_table():
    import torch

    import tbik

    from . import hf_ops

    promoted = lambda x, weight: x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))  # noqa: E731
    return {
        "tbik_linear": ("tbik_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", hf_ops.linear,
                        lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0]))),
        "tbik_partial": ("tbik_partial(Tensor x, Tensor weight, int tp) -> Tensor",
                         lambda x, weight, tp: tbik.matmul_partial(x, weight.t(), tp_size=tp),
                         lambda x, weight, tp: x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)),
        "tbik_tree_sum": ("tbik_tree_sum(Tensor gathered, int parts) -> Tensor",
                          lambda gathered, parts: tbik.tree_sum(gathered.view(parts, -1, gathered.shape[-1])),
                          lambda gathered, parts: gathered.new_empty((gathered.shape[0] // parts, gathered.shape[-1]))),
        "hf_rms_norm": ("hf_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", hf_ops.rms_norm,
                        lambda x, weight, eps: promoted(x, weight)),
        "hf_add_rms_norm": ("hf_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
                            hf_ops.add_rms_norm,
                            lambda x, residual, weight, eps: (promoted(residual, weight), residual.new_empty(x.shape))),
        "hf_silu_and_mul": ("hf_silu_and_mul(Tensor x) -> Tensor", hf_ops.silu_and_mul,
                            lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2))),
        "hf_rope": ("hf_rope(Tensor positions, Tensor q, Tensor k, Tensor inv_freq, int head_dim) -> (Tensor, Tensor)",
                    hf_ops.rope, lambda positions, q, k, inv_freq, head_dim: (q.new_empty(q.shape), k.new_empty(k.shape))),
        "hf_qk_norm_rope": ("hf_qk_norm_rope(Tensor positions, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
                            "float eps, Tensor inv_freq, int head_dim) -> (Tensor, Tensor)", hf_ops.qk_norm_rope,
                            lambda positions, q, k, q_weight, k_weight, eps, inv_freq, head_dim:
                            (promoted(q, q_weight), promoted(k, k_weight))),
    }


_LIB = None  # the registrations last as long as this object


def _define_ops() -> None:
    """The plugin's ops as torch operators (torch.ops.repaudit.*), so torch.compile treats each
    as one opaque call and CUDA graphs capture its kernels.

    They are defined with torch.library.Library, whose Python kernels the dispatcher calls
    directly, not torch.library.custom_op, whose per-call Python layers (autograd wrapper,
    dynamo guard, aliasing check) cost 14-30 us more a call (benchmarks/plugin_host_bench.py):
    host time paid op by op in the steps vLLM runs outside its CUDA graphs (prefills above its
    largest captured size)."""
    global _LIB
    import torch

    if hasattr(torch.ops.repaudit, "tbik_linear"):
        return
    lib = torch.library.Library("repaudit", "FRAGMENT")
    for name, (schema, fn, fake) in _op_table().items():
        lib.define(schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, fn, key)
        torch.library.register_fake(f"repaudit::{name}", fake, lib=lib)
    _LIB = lib


def _refuse(layer, why: str):
    raise RuntimeError(f"tbik: {type(layer).__name__} {why}; repaudit's vLLM plugin covers Llama/Qwen3-style "
                       "decoders only (run this model with --kernels bi or stock)")


def _linear_apply(self, layer, x, bias=None):
    import torch

    return torch.ops.repaudit.tbik_linear(x, layer.weight, bias)


def _row_parallel_forward(self, input_):
    import torch
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if not isinstance(self.quant_method, UnquantizedLinearMethod):
        _refuse(self, f"with {type(self.quant_method).__name__} (unquantized weights only)")
    tp = self.tp_size
    if tp > 1 and not self.reduce_results:
        _refuse(self, "leaves its all-reduce to the caller")
    bias = self.bias if not self.skip_bias_add else None
    x = input_
    if not self.input_is_parallel:
        x = x.tensor_split(tp, dim=-1)[self.tp_rank].contiguous()
    if tp == 1:
        out = torch.ops.repaudit.tbik_linear(x, self.weight, bias)
    else:
        x2 = x.reshape(-1, x.shape[-1])
        root = torch.ops.repaudit.tbik_partial(x2, self.weight, tp)
        if tp == 2:
            # The tree of two roots is one fp32 addition, which has no order: vLLM's own
            # all-reduce of the fp32 roots (its custom kernel or NCCL) gives the tree's bits.
            root = get_tp_group().all_reduce(root)
        else:
            # Rank order along dim 0: the tree's leaves in the order TP=1 adds them.
            root = torch.ops.repaudit.tbik_tree_sum(get_tp_group().all_gather(root, dim=0), tp)
        if bias is not None:
            root = root + bias.float()
        # Where the only reader is the next add-norm (_fold_casts_into_norms), it rounds the
        # fp32 sum itself: the same cast, without a kernel of its own in every layer.
        out = (root if getattr(self, "_repaudit_fp32_out", False) else root.to(x.dtype)).reshape(
            *x.shape[:-1], self.weight.shape[0])
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


def _with_casts_folded(init):
    """A Llama/Qwen model's __init__, then _fold_casts_into_norms on it."""
    import functools

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _fold_casts_into_norms(self, kwargs["vllm_config"])

    return wrapped


def _fold_casts_into_norms(model, vllm_config) -> None:
    """Let each decoder layer's o_proj and down_proj hand their fp32 sums (TP > 1) to the
    add-norm after them, which rounds them to the model dtype as it reads them (tbik.rms_norm
    with a float32 x): the same bits as the cast, one kernel fewer a row-parallel layer.

    Only where those norms are each sum's one reader, as the forwards of vLLM's own Llama,
    Qwen2 and Qwen3 models and layers have it (the output goes to the next layer's input norm
    or the model's final norm, with the residual): every layer of a known kind, no pipeline
    stage to hand a hidden state to, and no speculative drafter that reads hidden states."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.models import llama, qwen2, qwen3

    # Exact classes, not subclasses, whose forwards (in the vLLM versions of TESTED_VLLM) read
    # each layer's output only through the next add-norm.
    models = (llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model)
    layers = {llama.LlamaDecoderLayer: (llama.LlamaAttention, llama.LlamaMLP),
              qwen2.Qwen2DecoderLayer: (qwen2.Qwen2Attention, qwen2.Qwen2MLP),
              qwen3.Qwen3DecoderLayer: (qwen3.Qwen3Attention, qwen2.Qwen2MLP)}
    spec = vllm_config.speculative_config
    if (type(model) not in models or vllm_config.parallel_config.pipeline_parallel_size != 1
            or (spec is not None and spec.method != "ngram") or not _is_llama_rms_norm(model.norm)):
        return
    projections = []
    for layer in model.layers:
        attn_mlp = layers.get(type(layer))
        if (attn_mlp is None or (type(layer.self_attn), type(layer.mlp)) != attn_mlp
                or not _is_llama_rms_norm(layer.input_layernorm) or not _is_llama_rms_norm(layer.post_attention_layernorm)):
            return
        projections += [layer.self_attn.o_proj, layer.mlp.down_proj]
    if all(type(p) is RowParallelLinear and not p.skip_bias_add for p in projections):
        for p in projections:
            p._repaudit_fp32_out = True


def _is_llama_rms_norm(norm) -> bool:
    from vllm.model_executor.layers.layernorm import RMSNorm

    return type(norm) is RMSNorm and norm.variance_size_override is None and norm.has_weight


def _rms_norm_forward(self, x, residual=None):
    import torch

    if not _is_llama_rms_norm(self):
        _refuse(self, "(a norm other than Llama's RMSNorm)")
    if residual is None:
        return torch.ops.repaudit.hf_rms_norm(x, self.weight, self.variance_epsilon)
    return torch.ops.repaudit.hf_add_rms_norm(x, residual, self.weight, self.variance_epsilon)


def _silu_and_mul_forward(self, x):
    import torch
    from vllm.model_executor.layers.activation import SiluAndMul

    if type(self) is not SiluAndMul:
        _refuse(self, "(an activation other than SiLU-and-mul)")
    return torch.ops.repaudit.hf_silu_and_mul(x)


def _with_inv_freq(init):
    """RotaryEmbedding.__init__, plus transformers' inverse frequencies as a buffer: made once,
    on the CPU as transformers makes them, then on the module's device (no copy can happen
    later, while vLLM captures a CUDA graph)."""
    import functools

    import torch

    from . import hf_ops

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        device = self.cos_sin_cache.device if hasattr(self, "cos_sin_cache") else torch.get_default_device()
        self.register_buffer("_repaudit_inv_freq", hf_ops.inv_freq(self.base, self.rotary_dim).to(device),
                             persistent=False)

    return wrapped


def _is_default_rope(rope) -> bool:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return type(rope) is RotaryEmbedding and rope.is_neox_style and rope.rotary_dim == rope.head_size


def _rope_forward(self, positions, query, key=None):
    import torch

    if not _is_default_rope(self) or key is None:
        _refuse(self, "(RoPE other than the default, full-width, neox-style one)")
    return torch.ops.repaudit.hf_rope(positions, query, key, self._repaudit_inv_freq, self.head_size)


def _with_fused_qk_norm_rope(forward):
    """Qwen3Attention.forward with its q norm, k norm and rotary embedding in one op
    (hf_qk_norm_rope): the bits of the three ops it replaces, in one kernel instead of four
    (eager prefill steps pay each op's launch from Python; graphs pay each kernel's start). A layer
    the fused op does not cover runs `forward`, op by op, through this plugin's other ops."""
    import functools

    @functools.wraps(forward)
    def wrapped(self, positions, hidden_states):
        import torch

        import tbik

        rope, d = self.rotary_emb, self.head_dim
        fused = (_is_llama_rms_norm(self.q_norm) and _is_llama_rms_norm(self.k_norm) and _is_default_rope(rope)
                 and rope.head_size == d and tbik.qk_norm_rope_fits(d)
                 and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
                 and self.q_norm.weight.dtype == self.k_norm.weight.dtype)
        if not fused:
            return forward(self, positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = torch.ops.repaudit.hf_qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                                  self.q_norm.variance_epsilon, rope._repaudit_inv_freq, d)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output

    return wrapped


def _attention_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       output_scale=None, output_block_scale=None):
    from vllm.v1.attention.backend import AttentionType

    from . import hf_ops

    if attn_metadata is None:  # vLLM's profiling run
        return output.fill_(0)
    if (self.attn_type != AttentionType.DECODER or self.alibi_slopes is not None or self.sinks is not None
            or self.sliding_window != (-1, -1) or self.logits_soft_cap or self.kv_cache_dtype != "auto"
            or output_scale is not None or getattr(self, "dcp_world_size", 1) > 1):
        _refuse(self, "(attention other than causal, full-window, unquantized-cache decoder attention)")
    key_cache, value_cache = kv_cache.unbind(1)
    n_req = attn_metadata.seq_lens.shape[0]
    hf_ops.paged_attention(query, key_cache, value_cache, attn_metadata.query_start_loc[:n_req + 1],
                           attn_metadata.seq_lens, attn_metadata.block_table, attn_metadata.max_query_len,
                           self.scale, out=output)
    return output


def _token_logprobs(logits, token_ids):
    """vLLM's compute_token_logprobs (the logprobs of token_ids [rows, k] only), from tbik's
    log-softmax of the whole row: vLLM's own kernel sums the row in another order."""
    from . import hf_ops

    return hf_ops.token_log_probs(logits, token_ids)
