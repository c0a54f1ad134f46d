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


def _tree_reference(a, b, bias, num_chunks, out_dtype):
    """docs/tbik.md's tree, written out: leaves of width ceil(K / C) (K zero-padded to C * W),
    each an fp32 accumulator from +0.0 taking one rounded product at a time in ascending k, the
    leaves added pairwise in index order, the bias added to the root, one rounding."""
    m, k = a.shape
    width = -(-k // num_chunks)
    a32 = torch.nn.functional.pad(a.float(), (0, num_chunks * width - k))
    b32 = torch.nn.functional.pad(b.float(), (0, 0, 0, num_chunks * width - k))
    leaves = []
    for c in range(num_chunks):
        acc = torch.zeros(m, b.shape[1])
        for j in range(c * width, (c + 1) * width):
            acc = acc + torch.outer(a32[:, j], b32[j])
        leaves.append(acc)
    while len(leaves) > 1:
        leaves = [leaves[i] + leaves[i + 1] for i in range(0, len(leaves), 2)]
    root = leaves[0] if bias is None else leaves[0] + bias.float()
    return root.to(out_dtype or a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tree_matmul_is_the_documented_tree(dtype):
    import tbik

    for num_chunks in (1, 8, 16):
        for k in (1, 3, 8, 9, 17, 40, 129):
            a, b, bias = torch.randn(5, k).to(dtype), torch.randn(k, 3).to(dtype), torch.randn(3).to(dtype)
            for args in ((None, None), (bias, None), (bias, torch.float32)):
                assert same(tbik.tree_matmul(a, b, args[0], num_chunks=num_chunks, out_dtype=args[1]),
                            _tree_reference(a, b, args[0], num_chunks, args[1])), (num_chunks, k, args[1])


def test_tree_matmul_with_no_k_is_the_empty_leaves_plus_the_bias():
    import tbik

    bias = torch.tensor([-0.0, 1.5, -2.0])
    got = tbik.tree_matmul(torch.zeros(2, 0), torch.zeros(0, 3), bias)
    assert same(got, _tree_reference(torch.zeros(2, 0), torch.zeros(0, 3), bias, 8, None))  # +0.0 + -0.0 = +0.0


def test_tree_matmul_refuses_dtypes_it_would_compute_in_fp32():
    import tbik

    for dtype in (torch.float64, torch.int64):
        a, b = torch.ones(2, 16, dtype=dtype), torch.ones(16, 3, dtype=dtype)
        with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
            tbik.tree_matmul(a, b)
        with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
            tbik.matmul_partial(a, b, tp_size=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_log_softmax_returns_the_input_dtype(dtype):
    import tbik

    x = (torch.randn(5, 300) * 4).to(dtype)
    got = tbik.log_softmax(x)
    assert same(got, tbik.log_softmax(x, dtype=torch.float32).to(dtype))  # fp32 values, one rounding
    assert tbik.log_softmax(x[0, 0]).dtype == dtype
    assert tbik.log_softmax(x[:, :0]).shape == (5, 0)


def test_mean_of_an_empty_last_dim_is_nan_as_torchs():
    import tbik

    for shape, keepdim in (((3, 0), False), ((2, 3, 0), True), ((0,), False)):
        x = torch.ones(shape)
        want = x.mean(-1, keepdim=keepdim)
        got = tbik.mean_last_dim(x, keepdim)
        assert got.shape == want.shape and torch.isnan(got).all()


def test_silu_and_mul_rows_do_not_depend_on_the_batch_or_the_layout():
    """torch's own silu rounds an element by whether it falls in the vectorised body or the scalar
    tail of a thread's range: row 128 of this batch did (two threads), and so does a transposed layout."""
    import tbik

    x = torch.randn(257, 2 * 1001) * 4
    full = tbik.silu_and_mul(x)
    for i in (0, 127, 128, 256):
        assert same(tbik.silu_and_mul(x[i:i + 1]), full[i:i + 1]), i
    x = torch.randn(9, 2 * 16) * 4
    assert same(tbik.silu_and_mul(x.t().contiguous().t()), tbik.silu_and_mul(x))
    assert same(tbik.silu_and_mul(x), cpu.silu(x[:, :16]) * x[:, 16:])  # the CPU mode's eager chain


def test_attention_zeros_and_non_finite_later_values_do_not_depend_on_prefill_or_decode():
    """A query's value column of -0.0 sums to -0.0 over a power-of-two key count and to +0.0 over a
    zero-padded one; an inf in a later key's value times the 0 weight of the mask is NaN."""
    import tbik

    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    v[..., 0] = -0.0
    v[0, 0, 4, 1] = float("inf")
    full = tbik.attention(q, k, v)
    assert not torch.isnan(full[:, :, :4]).any()
    for t in range(1, 6):
        assert same(tbik.attention(q[:, :, t - 1:t], k[:, :, :t], v[:, :, :t]), full[:, :, t - 1:t]), t


def test_attention_refuses_start_and_end_outside_the_keys():
    import tbik

    q = torch.randn(1, 2, 3, 4)
    for kw in (dict(end=torch.tensor([5])), dict(end=torch.tensor([-1])), dict(start=torch.tensor([-2]))):
        with pytest.raises(ValueError, match="start must be"):
            tbik.attention(q, q, q, **kw)
