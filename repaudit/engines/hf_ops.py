"""transformers' op sequence for a Llama/Qwen-style decoder, on vLLM's flat tensors, with tbik.

The vLLM plugin (vllm_plugin.py) routes every op of a vLLM tbik cell through these functions,
so that a vLLM rollout computes, op for op and rounding for rounding, what the transformers
engine computes in its tbik mode (kernelmodes.py): the trainer and the rollout then agree bit
for bit. Each function names the transformers code it mirrors; where vLLM's own layer computes
something else (a fused add-and-norm in fp32, a rotary cache built on the GPU, a paged
flash-attention), the comment says what and why that would move bits.

No vLLM import here: the functions take plain tensors, so tests check them on the CPU against
transformers' modules under tbik's CPU backend.
"""

from __future__ import annotations

import torch

import tbik


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Linear under tbik's aten override: x [..., K] @ weight[N, K].T (+ bias, joined in fp32).

    tbik's bits never depend on M or N (nor on the tiles picked for them), so a fused projection
    (vLLM's qkv_proj, gate_up_proj, a rank's column shard) gives each output column the bits of
    transformers' separate layer.
    """
    x2 = x.reshape(-1, x.shape[-1])
    out = tbik.tree_matmul(x2, weight.t(), bias, num_chunks=tbik.NUM_CHUNKS)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm / Qwen3RMSNorm.forward, with the last-dim mean tbik's (as aten::mean.dim is
    under the override): tbik.rms_norm gives those eager ops' bits in one kernel."""
    return tbik.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's `hidden = residual + hidden` followed by the next norm.

    vLLM fuses the two and normalises the fp32 sum; transformers adds in the model dtype and
    normalises the rounded sum. Returns (normed, new residual) as vLLM's layer expects. x may
    be a row-parallel layer's fp32 sum, rounded to the residual's dtype first (its cast, folded).
    """
    return tbik.rms_norm(x, weight, eps, residual=residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The MLP's act_fn(gate_proj(x)) * up_proj(x) on vLLM's fused [gate | up] output: two
    roundings to the model dtype, where vLLM's fused kernel would round once."""
    return tbik.silu_and_mul(x)


def inv_freq(base: float, dim: int) -> torch.Tensor:
    """Default RoPE inverse frequencies, on the CPU as transformers computes them when it
    initialises the buffer (vLLM builds its cache on the GPU, whose pow rounds differently)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3RotaryEmbedding.forward + apply_rotary_pos_emb on flat [tokens, heads * head_dim],
    default RoPE (whose attention scaling is 1: a multiplication that changes no bit).

    cos and sin are computed from the positions on the fly in fp32, cast to the model dtype,
    and applied as q * cos + rotate_half(q) * sin, each product rounded (tbik.rope): vLLM's
    cached table and fused kernel round elsewhere.
    """
    return tbik.rope(positions, q, inv_freq, head_dim), tbik.rope(positions, k, inv_freq, head_dim)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3Attention's q_norm and k_norm of each head (rms_norm), then rope of both: one
    kernel with the bits of those two functions (tbik.qk_norm_rope), so of transformers' ops."""
    return tbik.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq, head_dim)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    max_query_len: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention interface repaudit registers with transformers (tbik.attention, keys
    counted from each sequence's first real key), over vLLM's paged KV cache: tbik's paged
    kernel gives each query the bits tbik.attention gives it in transformers' left-padded batch,
    whatever the batch, the block table or the prefill/decode split. flash-attention would split
    the keys by the batch's shape instead."""
    return tbik.paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                                max_query_len=max_query_len, scale=scale, out=out)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The transformers engine's log_softmax(logits.float()) with tbik's kernel."""
    return tbik.log_softmax(logits.float(), -1)


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_probs(logits).gather(1, token_ids), without writing the rest of each row."""
    return tbik.log_softmax_at(logits.float(), token_ids)
