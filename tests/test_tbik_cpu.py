"""tbik's CPU backend: the invariance contracts proved bitwise, at shapes that run in seconds."""

from __future__ import annotations

import pytest
import torch

from tbik import cpu


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_matmul_is_tp_batch_and_column_invariant(dtype):
    M, K, N, C = 37, 256, 48, 8
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    bias = torch.randn(N).to(dtype)
    full = cpu.tree_matmul(a, b, bias, num_chunks=C)
    for p in (1, 2, 4, 8):
        w = K // p
        parts = [cpu.matmul_partial(a[:, r * w:(r + 1) * w], b[r * w:(r + 1) * w], tp_size=p, num_chunks=C) for r in range(p)]
        root = cpu._chunk_tree(torch.stack(parts))
        assert same((root + bias.float()).to(dtype), full), p
    for m in (1, 5, 36):  # rows do not depend on the batch they are in
        assert same(cpu.tree_matmul(a[m - 1:m + 1] if m < M else a[-2:], b, bias, num_chunks=C),
                    full[m - 1:m + 1] if m < M else full[-2:])
    for lo, hi in ((0, 24), (24, 48), (5, 17)):  # column-parallel shards
        assert same(cpu.tree_matmul(a, b[:, lo:hi], bias[lo:hi], num_chunks=C), full[:, lo:hi])


def test_tree_matmul_accuracy_matches_fp32():
    a, b = torch.randn(64, 512), torch.randn(512, 64)
    ref = (a.double() @ b.double())
    err = ((cpu.tree_matmul(a, b, num_chunks=8).double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6


def test_row_ops_do_not_depend_on_the_batch():
    x = torch.randn(9, 383) * 5
    w = torch.randn(383)
    for fn in (lambda t: cpu.log_softmax(t), lambda t: cpu.mean_last_dim(t, True), lambda t: cpu.rms_norm(t, w, 1e-6)):
        full = fn(x)
        for i in range(9):
            assert same(fn(x[i:i + 1]), full[i:i + 1])


def test_tree_sum_ignores_zero_padding_width():
    x = torch.randn(4, 13)
    assert same(cpu._tree_sum(x), cpu._tree_sum(torch.nn.functional.pad(x, (0, 51))))


def test_activations_are_position_invariant_where_torch_is_not():
    x = torch.randn(4099) * 4
    for fn in (cpu.silu, cpu.sigmoid, cpu.gelu, lambda t: cpu.gelu(t, "tanh")):
        full = fn(x)
        for off in range(1, 20):
            for n in (1, 3, 9, 17):
                assert same(fn(x[off:off + n].clone()), full[off:off + n])
    assert torch.allclose(cpu.silu(x), torch.nn.functional.silu(x), rtol=1e-6, atol=1e-6)


def _attn_case(B=3, Hq=8, Hkv=4, D=16, lens=(5, 11, 8), dtype=torch.float32):
    S = max(lens)
    q = torch.randn(B, Hq, S, D).to(dtype)
    k = torch.randn(B, Hkv, S, D).to(dtype)
    v = torch.randn(B, Hkv, S, D).to(dtype)
    # left padding: sequence b occupies the last lens[b] positions
    for b, n in enumerate(lens):
        for t in (q, k, v):
            t[b, :, : S - n] = float("nan")  # padding must never leak into real rows
    start = torch.tensor([S - n for n in lens])
    return q, k, v, start, lens


def test_attention_is_batch_padding_head_and_decode_invariant():
    q, k, v, start, lens = _attn_case()
    S = q.shape[2]
    full = cpu.attention(q, k, v, start=start, scale=0.25)
    for b, n in enumerate(lens):
        alone = cpu.attention(q[b:b + 1, :, S - n:], k[b:b + 1, :, S - n:], v[b:b + 1, :, S - n:], scale=0.25)
        assert same(alone, full[b:b + 1, :, S - n:])  # batch of one, no padding
        heads = cpu.attention(q[b:b + 1, 2:4, S - n:], k[b:b + 1, 1:2, S - n:], v[b:b + 1, 1:2, S - n:], scale=0.25)
        assert same(heads, full[b:b + 1, 2:4, S - n:])  # a TP shard of the heads
        for t in range(1, n + 1):  # decode: the query at relative position t-1 alone over keys [0, t)
            one = cpu.attention(q[b:b + 1, :, S - n + t - 1:S - n + t], k[b:b + 1, :, S - n:S - n + t],
                                v[b:b + 1, :, S - n:S - n + t], scale=0.25)
            assert same(one, full[b:b + 1, :, S - n + t - 1:S - n + t])
    assert not torch.isnan(torch.cat([full[b, :, S - n:] for b, n in enumerate(lens)], dim=1)).any()


def test_attention_matches_sdpa():
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(cpu.attention(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_importing_tbik_and_running_it_on_cpu_needs_no_triton():
    """The backend follows the tensors' device: CPU ops run the torch backend and never import
    triton; importing tbik patches nothing (Triton's interpreter stays as Triton left it)."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch, tbik\n"
        "a = torch.randn(4, 64).bfloat16(); b = torch.randn(64, 8).bfloat16()\n"
        "tbik.tree_matmul(a, b); tbik.log_softmax(a.float()); tbik.rms_norm(a, torch.ones(64), 1e-6)\n"
        "tbik.tree_sum(torch.ones(2, 3)); tbik.attention(*(torch.randn(1, 2, 3, 16),) * 3)\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)[:5]\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
