"""tbik log-softmax, RMSNorm, mean, attention and batch-invariant mode on CPU (Triton interpreter)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tbik
import triton
import triton.language as tl
from tbik.tl import attention as attention_kernels

pytestmark = pytest.mark.usefixtures("triton_interpreter")

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape
    xi, yi = x.contiguous().view(INT_VIEW[x.dtype]), y.contiguous().view(INT_VIEW[y.dtype])
    if not torch.equal(xi, yi):
        raise AssertionError(f"{(xi != yi).sum().item()} of {x.numel()} elements differ in their bits")


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- log-softmax, norms, mean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_rows_do_not_depend_on_batch(dtype):
    x = randn(37, 5000, dtype=dtype) * 4  # > one 2048-wide block, ragged tail
    full = tbik.log_softmax(x)
    assert full.dtype == dtype
    for lo, hi in ((0, 1), (5, 6), (3, 20)):
        assert_bits_equal(tbik.log_softmax(x[lo:hi]), full[lo:hi])
    ref = torch.log_softmax(x.double(), -1)
    rel = 1e-6 if dtype == torch.float32 else 2**-8  # one rounding to the output dtype
    assert ((full.double() - ref).abs() <= rel * ref.abs() + 1e-5).all()


def test_log_softmax_other_dim_masked_entries_and_fp32_output():
    x = randn(6, 9, 11)
    assert torch.allclose(tbik.log_softmax(x, 1), torch.log_softmax(x, 1), atol=1e-5)
    x[0, 0, :] = float("-inf")
    x[0, 0, 4] = 2.0
    out = tbik.log_softmax(x)
    assert out[0, 0, 4].item() == 0.0 and torch.isinf(out[0, 0, :4]).all()
    half = tbik.log_softmax(x.bfloat16(), dtype=torch.float32)
    assert half.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_at_gives_the_gathered_bits_of_log_softmax(dtype):
    """The asked entries of each row, from the same first pass over the row as log_softmax's,
    whatever the rows around them; an index outside the row is NaN instead of a stray read."""
    x = randn(9, 5000, dtype=dtype, seed=3) * 4
    x[2, 100:] = float("-inf")
    index = torch.randint(0, 5000, (9, 6), generator=torch.Generator().manual_seed(4))
    index[2, 0] = 100
    want = tbik.log_softmax(x, -1, torch.float32).gather(-1, index)
    got = tbik.log_softmax_at(x, index, torch.float32)
    assert_bits_equal(got, want)
    assert_bits_equal(tbik.log_softmax_at(x[3:5], index[3:5].int(), torch.float32), want[3:5])
    assert torch.isinf(got[2, 0]) and got[2, 0] < 0
    bad = index.clone()
    bad[1, 2], bad[4, 0] = -1, 5000
    out = tbik.log_softmax_at(x, bad, torch.float32)
    assert out[1, 2].isnan() and out[4, 0].isnan() and out.isnan().sum() == 2
    with pytest.raises(ValueError, match="int32/int64 index"):
        tbik.log_softmax_at(x, index.float())


def _eager_rms_norm(x, w, eps, residual=None):
    """transformers' RMSNorm op by op, with tbik's mean (the engine's tbik mode)."""
    total = x if residual is None else residual + x
    h = total.float()
    return w * (h * torch.rsqrt(tbik.mean_last_dim(h.pow(2), keepdim=True) + eps)).to(x.dtype), total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_batch_invariant_and_the_eager_ops_bits(dtype):
    x = randn(4, 9, 1500, dtype=dtype, seed=1)
    w = (1 + 0.1 * randn(1500, seed=2)).to(dtype)
    out = tbik.rms_norm(x, w, 1e-6)
    for b in range(4):
        assert_bits_equal(tbik.rms_norm(x[b:b + 1], w, 1e-6), out[b:b + 1])
        assert_bits_equal(tbik.rms_norm(x[b, 3:5], w, 1e-6), out[b, 3:5])
    # NumPy's sqrt and division round as torch's CPU rsqrt does, so the interpreter gives the bits too.
    assert_bits_equal(out, _eager_rms_norm(x, w, 1e-6)[0])
    res = randn(4, 9, 1500, dtype=dtype, seed=3)
    normed, total = tbik.rms_norm(x, w, 1e-6, residual=res)
    want, want_total = _eager_rms_norm(x, w, 1e-6, res)
    assert_bits_equal(total, want_total)
    assert_bits_equal(normed, want)
    qkv = randn(5, 3 * 4 * 128, dtype=dtype, seed=4)
    q = qkv[:, :512].view(5, 4, 128)  # per-head norm of a fused qkv output: read through its strides
    assert_bits_equal(tbik.rms_norm(q, w[:128], 1e-6), _eager_rms_norm(q, w[:128], 1e-6)[0])


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("one_slice", [True, False])
def test_rms_norm_of_a_float32_x_is_the_norm_of_its_cast(half, one_slice, monkeypatch):
    """A row-parallel layer's fp32 sum handed to the add-norm as it is: the kernel's rounding of
    x to the residual's dtype is torch's cast (ties to even, overflow to inf), so the sum, the
    residual and the normed rows are those of the cast x. (A NaN stays a NaN; its payload bits
    are the platform's, torch's CPU cast and the GPU's differ, so it is checked apart.)"""
    from tbik.tl import norm

    monkeypatch.setattr(norm, "_ONE_SLICE", one_slice)
    x = randn(5, 1024, seed=11) * 3
    res = randn(5, 1024, dtype=half, seed=12)
    # exact ties between two 16-bit neighbours, both parities, and values past the format's range
    step = 2.0 ** -7 if half == torch.bfloat16 else 2.0 ** -10
    x[0, :4] = torch.tensor([1 + step / 2, 1 + 3 * step / 2, -(1 + step / 2), 7e4 if half == torch.float16 else 4e38])
    w = (1 + 0.1 * randn(1024, seed=13)).to(half)
    normed, total = tbik.rms_norm(x, w, 1e-6, residual=res)
    want, want_total = tbik.rms_norm(x.to(half), w, 1e-6, residual=res)
    assert total.dtype == half and normed.dtype == half
    assert_bits_equal(total, want_total)
    assert_bits_equal(normed, want)
    assert_bits_equal(total, res + x.to(half))
    # the fold rounds x before the add: adding the fp32 x itself would give other bits
    assert not torch.equal(total.view(torch.int16), (res.float() + x).to(half).view(torch.int16))
    x[1, 7] = float("nan")
    normed, total = tbik.rms_norm(x, w, 1e-6, residual=res)
    assert total[1, 7].isnan() and normed[1].isnan().all() and not normed[2:].isnan().any()
    assert_bits_equal(total[[0, 2, 3, 4]], want_total[[0, 2, 3, 4]])
    with pytest.raises(ValueError, match="residual must be"):
        tbik.rms_norm(x.to(half), w, 1e-6, residual=res.float())


def test_rms_norm_held_in_registers_or_read_twice_gives_the_same_bits(monkeypatch):
    """A row that fits one slice is held in registers from its one read to its store; read twice
    (the path of wider rows) it is added in the same pairs and order."""
    from tbik.tl import norm

    cases = [(randn(6, 1024, dtype=torch.bfloat16, seed=7), randn(6, 1024, dtype=torch.bfloat16, seed=8)),
             (randn(5, 3, 128, dtype=torch.float32, seed=9), None)]
    weights = [(1 + 0.1 * randn(x.shape[-1], seed=10)).to(x.dtype) for x, _ in cases]
    held = [tbik.rms_norm(x, w, 1e-6, residual=r) for (x, r), w in zip(cases, weights)]
    monkeypatch.setattr(norm, "_ONE_SLICE", False)
    for ((x, r), w), got in zip(zip(cases, weights), held):
        want = tbik.rms_norm(x, w, 1e-6, residual=r)
        for g, wt in zip(got if r is not None else [got], want if r is not None else [want]):
            assert_bits_equal(g, wt)


@pytest.mark.parametrize("width", [1024, 1500])  # a row held in one slice, and one read twice
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_a_given_mean_gives_the_stock_ops_bits(dtype, width):
    """The stock mode's norm: tbik's squares, torch's own mean of them, then tbik's scaling, is
    transformers' RMSNorm op by op with torch's mean, whatever order that mean adds in."""
    x = randn(3, 7, width, dtype=dtype, seed=5) * 3
    w = (1 + 0.1 * randn(width, seed=6)).to(dtype)
    h = x.float()
    assert_bits_equal(tbik.float_squares(x), h.pow(2))
    mean_sq = h.pow(2).mean(-1, keepdim=True)
    want = w * (h * torch.rsqrt(mean_sq + 1e-6)).to(dtype)
    assert_bits_equal(tbik.rms_norm(x, w, 1e-6, mean_sq=tbik.float_squares(x).mean(-1, keepdim=True)), want)
    # A mean the kernel did not compute is the one it uses: another mean, other bits.
    assert not torch.equal(tbik.rms_norm(x, w, 1e-6, mean_sq=mean_sq * 4), want)
    with pytest.raises(ValueError, match="mean_sq must be float32"):
        tbik.rms_norm(x, w, 1e-6, mean_sq=mean_sq[..., 0])
    with pytest.raises(ValueError, match="contiguous"):
        tbik.float_squares(x.transpose(0, 1))


def test_elementwise_kernels_refuse_float64():
    """The kernels take values to fp32 and round to the output dtype: right for bf16/fp16/fp32,
    wrong for float64, whose eager products stay in float64. So they refuse it by name."""
    x = randn(4, 64, dtype=torch.float64)
    w = torch.ones(64, dtype=torch.float64)
    cos = torch.ones(1, 3, 8, dtype=torch.float64)
    for call, op in ((lambda: tbik.rms_norm(x, w, 1e-6), "rms_norm"), (lambda: tbik.float_squares(x), "float_squares"),
                     (lambda: tbik.silu_and_mul(x), "silu_and_mul"),
                     (lambda: tbik.apply_rope(randn(1, 2, 3, 8, dtype=torch.float64), cos, cos), "apply_rope")):
        with pytest.raises(TypeError, match=f"tbik.{op} on a GPU takes bfloat16, float16 or float32"):
            call()


def _bf16(a) -> torch.Tensor:
    return torch.from_numpy(a).to(torch.bfloat16)


def test_silu_and_mul_rounds_as_the_eager_ops():
    """In the interpreter exp is NumPy's, so the reference is torch's formula on NumPy's exp."""
    x = (randn(6, 2 * 700) * 8).bfloat16()
    gate, up = x[:, :700].float().numpy(), x[:, 700:]
    silu = _bf16(gate / (1.0 + np.exp(-gate)))  # x / (1 + exp(-x)) in fp32, rounded to bf16
    assert_bits_equal(tbik.silu_and_mul(x), (silu.float() * up.float()).bfloat16())


def test_rope_rounds_as_the_eager_ops():
    head_dim, half = 128, 64
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.tensor([0, 1, 17, 4095, 32000])
    x = randn(5, 3 * 4 * head_dim, dtype=torch.bfloat16, seed=5)[:, :2 * head_dim]  # 2 heads, strided rows
    freqs = (inv_freq[None, :] * positions[:, None].float()).numpy()
    cos, sin = _bf16(np.cos(freqs)).repeat(1, 2)[:, None], _bf16(np.sin(freqs)).repeat(1, 2)[:, None]
    heads = x.reshape(5, 2, head_dim)
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    want = ((heads * cos) + (rotated * sin)).reshape(x.shape)
    assert_bits_equal(tbik.rope(positions, x, inv_freq, head_dim), want)


def _norm_then_rope(positions, q, k, qw, kw, inv_freq, head_dim):
    """The two kernels the fused one replaces: each head's rms_norm, then rope."""
    def normed(x, w):
        return tbik.rms_norm(x.view(x.shape[0], -1, head_dim), w, 1e-6).reshape(x.shape[0], -1)

    return (tbik.rope(positions, normed(q, qw), inv_freq, head_dim),
            tbik.rope(positions, normed(k, kw), inv_freq, head_dim))


@pytest.mark.parametrize("head_dim,hq,hkv,dtype", [(128, 4, 2, torch.bfloat16), (64, 3, 1, torch.float32),
                                                   (32, 16, 8, torch.bfloat16)])
def test_qk_norm_rope_gives_the_bits_of_its_two_kernels(head_dim, hq, hkv, dtype):
    """q and k as slices of a fused qkv output; rows from 1e-3 to 1e3 and a zero head, so the
    norm's sum runs through every exponent range, and heads that fill a program's rows or not."""
    n = 6
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.tensor([0, 1, 17, 4095, 32000, 5])
    qkv = randn(n, (hq + 2 * hkv) * head_dim, seed=11) * torch.logspace(-3, 3, n)[:, None]
    qkv[2, :head_dim] = 0.0
    qkv = qkv.to(dtype)
    q, k = qkv[:, :hq * head_dim], qkv[:, hq * head_dim:(hq + hkv) * head_dim]
    qw, kw = ((1 + 0.1 * randn(head_dim, seed=s)).to(dtype) for s in (12, 13))
    got = tbik.qk_norm_rope(positions, q, k, qw, kw, 1e-6, inv_freq, head_dim)
    want = _norm_then_rope(positions, q, k, qw, kw, inv_freq, head_dim)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        assert_bits_equal(g, w)
    # One token alone gets the bits it gets among the others.
    alone = tbik.qk_norm_rope(positions[3:4], q[3:4], k[3:4], qw, kw, 1e-6, inv_freq, head_dim)
    for a, g in zip(alone, got):
        assert_bits_equal(a, g[3:4])
    # fp32 weights on bf16 heads: the norm's output is promoted to fp32, and the rotary runs in fp32.
    if dtype == torch.bfloat16:
        got = tbik.qk_norm_rope(positions, q, k, qw.float(), kw.float(), 1e-6, inv_freq, head_dim)
        want = _norm_then_rope(positions, q, k, qw.float(), kw.float(), inv_freq, head_dim)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32
            assert_bits_equal(g, w)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        tbik.qk_norm_rope(positions, q, k, qw, kw, 1e-6, inv_freq[:-1], head_dim - 2)
    # the plugin asks this before calling the fused op, and takes the two ops where it says no
    assert [d for d in range(2049) if tbik.qk_norm_rope_fits(d)] == [16, 32, 64, 128, 256, 512, 1024]


def test_apply_rope_gives_apply_rotary_pos_emb_bits():
    """The kernel against transformers' own function, on transposed q/k views and cos/sin of one
    row per batch or one for all."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    proj = (randn(3, 7, 6, 64, seed=8) * 20).bfloat16()
    q, k = proj[:, :, :4].transpose(1, 2), proj[:, :, 4:].transpose(1, 2)
    for rows in (3, 1):
        angles = randn(rows, 7, 64, seed=9) * 30
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = tbik.apply_rope(q, cos, sin), tbik.apply_rope(k, cos, sin)
        assert got_q.stride() == want_q.stride()
        assert_bits_equal(got_q, want_q)
        assert_bits_equal(got_k, want_k)
    with pytest.raises(ValueError):
        tbik.apply_rope(q, cos[:, :, :32], sin)


def test_mean_last_dim_batch_invariant():
    x = randn(50, 3000, seed=3)
    full = tbik.mean_last_dim(x, keepdim=True)
    assert full.shape == (50, 1)
    assert_bits_equal(tbik.mean_last_dim(x[7:8], keepdim=True), full[7:8])
    assert torch.allclose(full, x.mean(-1, keepdim=True), atol=1e-6)
    assert tbik.mean_last_dim(x.bfloat16()).dtype == torch.bfloat16


# ---------------------------------------------------------------- attention


def reference_attention(q, k, v, start):
    b, hq, tq, d = q.shape
    s = k.shape[2]
    rep = hq // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / d**0.5
    qpos = torch.arange(tq)[:, None] + s - tq
    kpos = torch.arange(s)[None, :]
    mask = (kpos <= qpos)[None] & (kpos[None] >= start[:, None, None])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def left_padded(seqs_q, seqs_k, seqs_v, width):
    """Stack per-sequence [H, T, D] tensors into a left-padded batch [B, H, width, D]."""
    pads = [width - t.shape[1] for t in seqs_k]

    def stack(seqs):
        out = []
        for t, pad in zip(seqs, pads):
            filler = randn(t.shape[0], pad, t.shape[2], dtype=t.dtype, seed=99 + pad)  # garbage
            out.append(torch.cat([filler, t], 1))
        return torch.stack(out)

    return stack(seqs_q), stack(seqs_k), stack(seqs_v), torch.tensor(pads, dtype=torch.int32)


@pytest.fixture(scope="module")
def gqa_sequences():
    hq, hkv, d = 4, 2, 32
    lengths = [70, 23, 130]
    seqs = [(randn(hq, t, d, dtype=torch.bfloat16, seed=10 + i), randn(hkv, t, d, dtype=torch.bfloat16, seed=20 + i),
             randn(hkv, t, d, dtype=torch.bfloat16, seed=30 + i)) for i, t in enumerate(lengths)]
    return seqs


def test_attention_matches_reference(gqa_sequences):
    q, k, v, start = left_padded(*zip(*gqa_sequences), width=140)
    out = tbik.attention(q, k, v, start=start)
    ref = reference_attention(q, k, v, start)
    for b, pad in enumerate(start.tolist()):
        err = (out[b, :, pad:].double() - ref[b, :, pad:]).abs().max().item()
        assert err < 2e-2
        assert out[b, :, :pad].abs().max().item() == 0  # padded queries see no key: zeros


def test_attention_invariant_to_batch_and_padding(gqa_sequences):
    alone = [tbik.attention(q[None], k[None], v[None]) for q, k, v in gqa_sequences]
    for width in (130, 141, 200):
        q, k, v, start = left_padded(*zip(*gqa_sequences), width=width)
        out = tbik.attention(q, k, v, start=start)
        for b, pad in enumerate(start.tolist()):
            assert_bits_equal(out[b:b + 1, :, pad:], alone[b])


def test_attention_invariant_to_heads_per_call(gqa_sequences):
    q, k, v = (t[None] for t in gqa_sequences[2])
    full = tbik.attention(q, k, v)
    # TP=2 shards: each rank holds 2 query heads and their 1 kv head.
    for r in range(2):
        shard = tbik.attention(q[:, 2 * r:2 * r + 2], k[:, r:r + 1], v[:, r:r + 1])
        assert_bits_equal(shard, full[:, 2 * r:2 * r + 2])


def test_attention_decode_equals_prefill(gqa_sequences):
    q, k, v = (t[None] for t in gqa_sequences[2])  # 130 tokens
    prefill = tbik.attention(q, k, v)
    for pos in (0, 63, 64, 100, 129):
        step = tbik.attention(q[:, :, pos:pos + 1], k[:, :, :pos + 1], v[:, :, :pos + 1])
        assert_bits_equal(step, prefill[:, :, pos:pos + 1])
    # A chunked prefill (second chunk of 30 queries over all keys) too.
    chunk = tbik.attention(q[:, :, 100:], k, v)
    assert_bits_equal(chunk, prefill[:, :, 100:])
    # Decode inside a left-padded batch, with a longer neighbour.
    qb, kb, vb, start = left_padded(*zip(gqa_sequences[2], gqa_sequences[0]), width=150)
    step = tbik.attention(qb[:, :, -1:], kb, vb, start=start)
    assert_bits_equal(step[:1], prefill[:, :, 129:])


def _paged(seqs, block_size=8, n_blocks=64, seed=5):
    """Keys and values of whole sequences ([H, T, D] each) in a paged cache with a shuffled
    block table; unused slots hold NaN bits, as an engine's recycled cache may."""
    hkv, d = seqs[0][1].shape[0], seqs[0][1].shape[2]
    kc = torch.full((n_blocks, block_size, hkv, d), float("nan"), dtype=seqs[0][1].dtype)
    vc = kc.clone()
    free = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-q.shape[1] // block_size) for q, _, _ in seqs) + 1
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for r, (_, k, v) in enumerate(seqs):
        for pos in range(k.shape[1]):
            if pos % block_size == 0:
                table[r, pos // block_size] = free.pop()
            blk = table[r, pos // block_size]
            kc[blk, pos % block_size], vc[blk, pos % block_size] = k[:, pos], v[:, pos]
    return kc, vc, table


def _serving_batch(seqs, new):
    """Each sequence's last new[r] queries, flat ([N, Hq, D]), with query_start_loc and seq_lens."""
    queries = torch.cat([q[:, -n:].transpose(0, 1) for (q, _, _), n in zip(seqs, new)])
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([k.shape[1] for _, k, _ in seqs], dtype=torch.int32)
    return queries, qsl, seq_lens


def test_paged_attention_gives_each_query_the_bits_of_attention(gqa_sequences):
    kc, vc, table = _paged(gqa_sequences)
    prefill = [tbik.attention(q[None], k[None], v[None]) for q, k, v in gqa_sequences]
    # One batch as a serving engine schedules it: request 0 decodes its last token, request 1
    # prefills in full, request 2 prefills its last 75 tokens as a chunk after 55 cached ones.
    new = [1, gqa_sequences[1][0].shape[1], 75]
    queries, qsl, seq_lens = _serving_batch(gqa_sequences, new)
    out = tbik.paged_attention(queries, kc, vc, qsl, seq_lens, table, max_query_len=max(new))
    assert not out.isnan().any()
    for r, n in enumerate(new):
        assert_bits_equal(out[qsl[r]:qsl[r + 1]].transpose(0, 1)[None], prefill[r][:, :, -n:])


def test_row_sum_in_mma_order_adds_each_lanes_keys_in_turn_then_the_lanes():
    """The keys-major paged kernel's softmax denominator: key 8c + 2t + j goes to lane t, each lane
    adds its keys in (c, j) order, then (lane 0 + lane 2) + (lane 1 + lane 3). Values over 40
    binades, so another order gives other bits (torch's sum does)."""

    @triton.jit  # decorated here: the interpreter is on inside the tests only
    def row_sum_kernel(p_ptr, out_ptr, Q: tl.constexpr):
        rows, cols = tl.arange(0, 64), tl.arange(0, Q)
        p_t = tl.load(p_ptr + rows[:, None] * Q + cols[None, :])
        tl.store(out_ptr + cols, attention_kernels.row_sum_in_mma_order(p_t, Q))

    g = torch.Generator().manual_seed(0)
    p_t = torch.rand(64, 16, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 16), generator=g).float())
    got = torch.empty(16)
    row_sum_kernel[(1,)](p_t, got, Q=16)
    x = p_t.reshape(8, 4, 2, 16)  # [c, lane, j, query]
    lanes = []
    for t in range(4):
        acc = x[0, t, 0] + x[0, t, 1]
        for c in range(1, 8):
            acc = acc + x[c, t, 0]
            acc = acc + x[c, t, 1]
        lanes.append(acc)
    assert_bits_equal(got, (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]))
    assert not torch.equal(got, p_t.sum(0))


def test_keys_major_paged_kernel_computes_the_same_attention(gqa_sequences, monkeypatch):
    """The paged kernel keys-major (calls of at most 16 query rows a key/value head, on sm90)
    under the interpreter: a batch of a decode step and short chunks over NaN-filled unused
    slots gives each query the dense kernel's attention. (The interpreter sums in NumPy's order,
    not the MMA's: the bits are compared on a GPU, tests/test_tbik_gpu.py.)"""
    monkeypatch.setattr(attention_kernels, "mma_order_known", lambda device: True)
    q = gqa_sequences[0][0][None]  # 4 query heads over 2 key/value heads
    assert attention_kernels.keys_major(q, 8 * 2) and not attention_kernels.keys_major(q, 9 * 2)
    assert not attention_kernels.keys_major(q.float(), 2)
    kc, vc, table = _paged(gqa_sequences)
    new = [1, 8, 3]
    queries, qsl, seq_lens = _serving_batch(gqa_sequences, new)
    out = tbik.paged_attention(queries, kc, vc, qsl, seq_lens, table, max_query_len=max(new))
    assert not out.isnan().any()
    for r, n in enumerate(new):
        alone = tbik.attention(*(t[None] for t in gqa_sequences[r]))
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].transpose(0, 1)[None], alone[:, :, -n:],
                                   atol=0, rtol=2 ** -7)


def test_attention_fp32_and_right_padding_do_not_crash():
    q, k, v = randn(2, 2, 5, 16, seed=5), randn(2, 1, 9, 16, seed=6), randn(2, 1, 9, 16, seed=7)
    out = tbik.attention(q, k, v, start=torch.zeros(2, dtype=torch.int64))
    ref = reference_attention(q, k, v, torch.zeros(2, dtype=torch.int64))
    assert (out.double() - ref).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="multiple"):
        tbik.attention(randn(1, 3, 2, 16), randn(1, 2, 4, 16), randn(1, 2, 4, 16))


# ---------------------------------------------------------------- batch-invariant mode


def test_mode_routes_linear_softmax_and_mean():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96).to(torch.bfloat16)
    x = randn(3, 5, 256, dtype=torch.bfloat16, seed=8)
    with torch.no_grad(), tbik.batch_invariant_mode("cpu", num_chunks=8):
        assert tbik.is_batch_invariant_mode_enabled()
        y = lin(x)
        y_one = lin(x[1:2, 2:3])
        y_nobias = F.linear(x[0], lin.weight)
        ls = F.log_softmax(x.float(), -1)
        ms = x.float().pow(2).mean(-1, keepdim=True)
        m0 = x.float().mean(0)
        d = torch.randn(3, 4, dtype=torch.float64) @ torch.randn(4, 2, dtype=torch.float64)
    assert not tbik.is_batch_invariant_mode_enabled()
    assert_bits_equal(y, tbik.tree_matmul(x.reshape(15, 256), lin.weight.t(), lin.bias).view(3, 5, 96))
    assert_bits_equal(y_one, y[1:2, 2:3])
    assert_bits_equal(y_nobias, tbik.tree_matmul(x[0], lin.weight.t()))
    assert_bits_equal(ls, tbik.log_softmax(x.float()))
    assert_bits_equal(ms, tbik.mean_last_dim(x.float().pow(2), keepdim=True))
    assert torch.allclose(m0, x.float().mean(0), atol=1e-6)
    assert d.shape == (3, 2)


def test_attention_end_equals_the_keys_cut_there():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=g)
    k = torch.randn(3, 2, 12, 16, generator=g)
    v = torch.randn(3, 2, 12, 16, generator=g)
    start = torch.tensor([0, 2, 5], dtype=torch.int32)
    end = torch.tensor([7, 7, 9], dtype=torch.int32)
    got = tbik.attention(q, k, v, start=start, end=end)
    for b in range(3):
        e = int(end[b])
        want = tbik.attention(q[b:b + 1], k[b:b + 1, :, :e], v[b:b + 1, :, :e], start=start[b:b + 1])
        assert torch.equal(got[b:b + 1].view(torch.int32), want.view(torch.int32))
    # Garbage past the end (a static cache's unwritten slots can hold anything) changes nothing.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 9:] = float("nan")
    v2[:, :, 9:] = 1e30
    assert torch.equal(tbik.attention(q, k2, v2, start=start, end=end).view(torch.int32), got.view(torch.int32))


def test_attention_end_must_match_the_batch():
    q, k = torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 4, 16)
    with pytest.raises(ValueError, match="end must have shape"):
        tbik.attention(q, k, k, end=torch.tensor([4]))
