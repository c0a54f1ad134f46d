"""SiLU-and-mul and rotary embedding with the bits of transformers' eager ops: inputs checked,
backend picked (tl/elementwise.py says how one kernel keeps the eager chain's roundings).

Unlike the other tbik ops these change no order of summation (there is none to change); they
exist so that a serving engine can run the training code's arithmetic, rounding for rounding,
at the cost of one kernel instead of a chain of them.
"""

from __future__ import annotations

import torch

from . import backend, cpu


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for x [..., 2d]: an MLP's act_fn(gate) * up on a fused
    [gate | up] projection, rounded twice to x's dtype as the eager ops round."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim ([gate | up]), got {x.shape[-1]}")
    if backend.on_cpu(x):
        return cpu.silu_and_mul(x)
    backend.check_kernel_dtypes("silu_and_mul", x)
    from .tl import elementwise

    return elementwise.silu_and_mul(x)


def rope(positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Default (neox-style, full-width) rotary embedding of x [tokens, heads * head_dim] at
    `positions` [tokens], as transformers computes it: freqs = inv_freq * position in fp32 (its
    batched matmul with K = 1), cos and sin of them cast to x's dtype, then
    `x * cos + rotate_half(x) * sin` with each product rounded. inv_freq [head_dim / 2] fp32."""
    if x.dim() != 2 or x.shape[-1] % head_dim or head_dim % 2:
        raise ValueError(f"rope needs x [tokens, heads * head_dim] with an even head_dim, got {tuple(x.shape)} "
                         f"and head_dim {head_dim}")
    if positions.numel() != x.shape[0] or inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"rope needs {x.shape[0]} positions and inv_freq [{head_dim // 2}], got "
                         f"{positions.numel()} and {tuple(inv_freq.shape)}")
    if backend.on_cpu(x):
        return cpu.rope(positions, x, inv_freq, head_dim)
    backend.check_kernel_dtypes("rope", x)
    from .tl import elementwise

    return elementwise.rope(positions, x, inv_freq.to(x.device), head_dim)


def qk_norm_rope_fits(head_dim: int) -> bool:
    """Whether qk_norm_rope takes this head size: a power of two from 16 to 1024, so that the
    norm's row is one slice whose halving tree splits it into the two rotary halves."""
    return 16 <= head_dim <= 1024 and not head_dim & (head_dim - 1)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention inputs: each head of q [tokens, Hq * head_dim] and k [tokens, Hk *
    head_dim] RMSNorm'd (rms_norm with q_weight / k_weight [head_dim]), then both rotated (rope),
    in one kernel with the bits of those two ops, so of transformers' eager chain. q and k may be
    column slices of a fused qkv output (unit last stride, any row stride); the results are dense.
    head_dim must pass qk_norm_rope_fits."""
    if not qk_norm_rope_fits(head_dim):
        raise ValueError(f"qk_norm_rope needs a power-of-two head_dim from 16 to 1024, got {head_dim}")
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 2 or x.shape[1] % head_dim or x.stride(-1) != 1 or x.shape[0] != positions.numel():
            raise ValueError(f"qk_norm_rope needs {name} [{positions.numel()} tokens, heads * {head_dim}] with a "
                             f"unit last stride, got {tuple(x.shape)}")
    if q.dtype != k.dtype or q_weight.dtype != k_weight.dtype or q_weight.shape != (head_dim,) \
            or k_weight.shape != (head_dim,) or inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"qk_norm_rope needs q and k of one dtype, q_weight and k_weight [{head_dim}] of one dtype "
                         f"and inv_freq [{head_dim // 2}]")
    if backend.on_cpu(q):
        return cpu.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq, head_dim)
    backend.check_kernel_dtypes("qk_norm_rope", q, q_weight)
    from .tl import elementwise

    return elementwise.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq.to(q.device), head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` (apply_rotary_pos_emb, one tensor, cos and
    sin unsqueezed at dim 1) for x [B, H, T, D] and cos, sin [B or 1, T, D] in x's dtype, each
    product rounded, then the sum: one kernel with the eager ops' bits, the result laid out as
    the eager sum is (dense, in x's dimension order)."""
    if x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"apply_rope needs x [B, H, T, D] with an even, unit-stride D, got {tuple(x.shape)}")
    want = (x.shape[2], x.shape[3])
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 3 or tuple(c.shape[1:]) != want or c.shape[0] not in (1, x.shape[0]) or c.dtype != x.dtype \
                or c.stride(-1) != 1:
            raise ValueError(f"apply_rope needs {name} [{x.shape[0]} or 1, {want[0]}, {want[1]}] {x.dtype} with a "
                             f"unit-stride last dim, got {tuple(c.shape)} {c.dtype}")
    if backend.on_cpu(x):
        return cpu.apply_rope(x, cos, sin)
    backend.check_kernel_dtypes("apply_rope", x, cos, sin)
    from .tl import elementwise

    return elementwise.apply_rope(x, cos, sin)
