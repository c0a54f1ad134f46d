"""tbik invariance on a CUDA GPU at Qwen3-8B sizes (hidden 4096, MLP 12288, vocab 151936).

Skipped cleanly without CUDA. Run by benchmarks/gpu_kernels.sh on the lent GPU machine.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import tbik
    from tbik.allreduce import _tree_sum_torch

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
HIDDEN, MLP, VOCAB = 4096, 12288, 151936


def assert_bits_equal(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape
    xi, yi = x.contiguous().view(INT_VIEW[x.dtype]), y.contiguous().view(INT_VIEW[y.dtype])
    if not torch.equal(xi, yi):
        raise AssertionError(f"{(xi != yi).sum().item()} of {x.numel()} elements differ in their bits")


def operands(m, k, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    return x, w


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- matmul


@pytest.mark.parametrize("n,k", [(HIDDEN, MLP), (HIDDEN, HIDDEN), (MLP, HIDDEN)])
@pytest.mark.parametrize("num_chunks", [8, 16])
def test_tp_shards_reproduce_tp1(n, k, num_chunks):
    for m in (1, 37, 512):
        x, w = operands(m, k, n, seed=m)
        full = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32)
        for tp in (1, 2, 4, 8):
            s = k // tp
            parts = [tbik.matmul_partial(x[:, r * s:(r + 1) * s], w.t()[r * s:(r + 1) * s], tp_size=tp,
                                         num_chunks=num_chunks) for r in range(tp)]
            assert_bits_equal(tbik.tree_sum(parts), full)


@pytest.mark.parametrize("n,k", [(HIDDEN, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)])
@pytest.mark.parametrize("num_chunks", [1, 8])
def test_rows_do_not_depend_on_batch_size(n, k, num_chunks):
    x, w = operands(4096, k, n, seed=1)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    full = tbik.tree_matmul(x, w.t(), bias, num_chunks=num_chunks)
    for m in (1, 2, 8, 32, 64, 65, 100, 128, 256, 257, 512, 2048):
        for first in (0, 1111):
            assert_bits_equal(tbik.tree_matmul(x[first:first + m], w.t(), bias, num_chunks=num_chunks),
                              full[first:first + m])


@pytest.mark.parametrize("n,k", [(1024, 1024), (3072, 1024), (1024, 3072)])
def test_the_tiles_for_few_rows_give_the_one_size_tiles_bits(n, k):
    """Decode shapes (Qwen3-0.6B): rows on both sides of each tile switch, every SPLIT, and the
    rows of a TP=2 partial, against the 64x128 tiles used for every M."""
    from tbik.tl import matmul as tm

    x, w = operands(300, k, n, seed=4)
    rows = (1, 32, 64, 65, 256, 257, 300)
    widths = {m: tm._plan(x.dtype, torch.float32, x.device, m, n, k, 8, k // 8, False, 1, True).meta["BLOCK_N"]
              for m in rows}
    assert widths[32] == 32 and widths[65] == 64 and widths[257] == 128  # the switch is in use
    got = {m: tbik.tree_matmul(x[:m], w.t(), out_dtype=torch.float32) for m in rows}
    half = k // 2
    partial = {m: tbik.matmul_partial(x[:m, half:], w.t()[half:], tp_size=2) for m in rows}
    few = tm._FEW_ROWS[torch.bfloat16]
    tm._FEW_ROWS[torch.bfloat16] = ()
    tm._plan.cache_clear()
    try:
        for m in rows:
            for split in (1, 2, 8):
                assert_bits_equal(tbik.tree_matmul(x[:m], w.t(), out_dtype=torch.float32, _split=split), got[m])
            assert_bits_equal(tbik.matmul_partial(x[:m, half:], w.t()[half:], tp_size=2), partial[m])
            assert_bits_equal(got[m], got[300][:m])
    finally:
        tm._FEW_ROWS[torch.bfloat16] = few
        tm._plan.cache_clear()


def test_every_execution_strategy_gives_the_same_bits():
    x, w = operands(300, MLP, HIDDEN, seed=2)
    for num_chunks in (8, 16):
        ref = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32, _split=1)
        split = 2
        while split <= num_chunks:
            assert_bits_equal(tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32,
                                               _split=split), ref)
            split *= 2


def test_lm_head_column_shards_and_rows():
    x, w = operands(64, HIDDEN, VOCAB, seed=3)
    full = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
    for tp in (2, 4, 8):
        n = VOCAB // tp
        for r in (0, tp - 1):
            assert_bits_equal(tbik.tree_matmul(x, w[r * n:(r + 1) * n].t(), out_dtype=torch.float32),
                              full[:, r * n:(r + 1) * n])
    assert_bits_equal(tbik.tree_matmul(x[5:6], w.t(), out_dtype=torch.float32), full[5:6])


def test_column_parallel_mlp_shards():
    x, w = operands(200, HIDDEN, MLP, seed=4)
    full = tbik.tree_matmul(x, w.t())
    for tp in (2, 4, 8):
        n = MLP // tp
        for r in range(tp):
            assert_bits_equal(tbik.tree_matmul(x, w[r * n:(r + 1) * n].t()), full[:, r * n:(r + 1) * n])


def test_strides_and_ragged_k():
    x, w = operands(33, 4000, 1000, seed=5)  # K % 8 == 0 but chunk 500 is not a tile multiple
    ref = x.double() @ w.double().t()
    got = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
    assert_bits_equal(tbik.tree_matmul(x, w.t().contiguous(), out_dtype=torch.float32), got)
    assert_bits_equal(tbik.tree_matmul(x.t().contiguous().t(), w.t(), out_dtype=torch.float32), got)
    assert rel_err(got, ref) < 1e-5
    xr, wr = x[:, :3999], w[:, :3999]  # K % 8 != 0: zero-padded last chunk
    got = tbik.tree_matmul(xr, wr.t(), out_dtype=torch.float32)
    padded = tbik.tree_matmul(F.pad(xr, (0, 1)), F.pad(wr, (0, 1)).t(), out_dtype=torch.float32)
    assert_bits_equal(got, padded)


def test_accuracy_matches_cublas():
    for n, k in [(HIDDEN, HIDDEN), (HIDDEN, MLP)]:
        x, w = operands(512, k, n, seed=6)
        ref = x.double() @ w.double().t()
        cublas = rel_err(x @ w.t(), ref)
        tree = rel_err(tbik.tree_matmul(x, w.t()), ref)
        assert tree <= 1.1 * cublas, (tree, cublas)  # both dominated by the final bf16 rounding
        tree32 = rel_err(tbik.tree_matmul(x, w.t(), out_dtype=torch.float32), ref)
        assert tree32 < 1e-5  # fp32 accumulation, fp32 partials
    x, w = operands(256, HIDDEN, 512, dtype=torch.float32, seed=7)
    ref = x.double() @ w.double().t()
    assert rel_err(tbik.tree_matmul(x, w.t()), ref) < 1e-6  # IEEE fp32, not tf32 (~1e-4)


def test_tma_loads_give_the_pointer_loads_bits():
    # TMA is only a way to load: K-contiguous operands go through tensor descriptors, others
    # through pointers, and both must give the same bits (TP shards, every SPLIT, ragged M).
    from tbik.tl import matmul as tm

    x, w = operands(300, HIDDEN, MLP, seed=9)
    x_cols = torch.zeros(300, 2 * HIDDEN, dtype=x.dtype, device=x.device)[:, ::2].copy_(x)  # K stride 2: pointer loads
    for m in (1, 8, 32, 100, 300):
        plan = tm._plan(x.dtype, torch.float32, x.device, m, MLP, HIDDEN, 8, HIDDEN // 8, False, 1, tm._tma_fits(x, w.t()))
        assert plan.meta["TMA"] and not tm._tma_fits(x_cols, w.t())
        for split in (1, 2, 8):
            assert_bits_equal(tbik.tree_matmul(x[:m], w.t(), out_dtype=torch.float32, _split=split),
                              tbik.tree_matmul(x_cols[:m], w.t(), out_dtype=torch.float32, _split=split))
    for tp in (2, 4):
        shard = HIDDEN // tp
        for r in range(tp):
            xs, ws = x[:, r * shard:(r + 1) * shard], w[:, r * shard:(r + 1) * shard]
            assert_bits_equal(tbik.matmul_partial(xs.contiguous(), ws.t(), tp_size=tp),
                              tbik.matmul_partial(xs.t().contiguous().t(), ws.t(), tp_size=tp))


def test_direct_launch_gives_the_same_bits():
    # The first call goes through Triton's launch path (and compiles), later ones through the
    # cached compiled handle; both must run the same binary.
    from tbik.tl import matmul as tm

    x, w = operands(48, HIDDEN, 1024, seed=8)
    first = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32, _split=4)
    for _ in range(3):
        assert_bits_equal(tbik.tree_matmul(x, w.t(), out_dtype=torch.float32, _split=4), first)
    assert tm._kernel.direct and tm._kernel.compiled


def test_fused_tree_sum_matches_torch_adds():
    for p in (2, 4, 8):
        stacked = torch.randn(p, 32, HIDDEN, device="cuda") * torch.logspace(0, 6, p, device="cuda")[:, None, None]
        assert_bits_equal(tbik.tree_sum(stacked), _tree_sum_torch(list(stacked)))


# ---------------------------------------------------------------- invariant ops


def test_log_softmax_at_gives_the_gathered_bits_of_log_softmax():
    """A vLLM sampling step's logprobs in a tbik cell: fp32 rows as wide as Qwen3's vocabulary,
    the chosen token and a top-k of each, against the whole log-softmax gathered."""
    logits = (torch.randn(300, 151936, device="cuda") * 3).bfloat16().float()
    logits[7, 5000:] = float("-inf")
    index = torch.randint(0, 151936, (300, 6), device="cuda")
    index[7, 0] = 5000
    want = tbik.log_softmax(logits).gather(1, index)
    assert_bits_equal(tbik.log_softmax_at(logits, index), want)
    assert_bits_equal(tbik.log_softmax_at(logits[100:133], index[100:133].int()), want[100:133])


def test_log_softmax_and_rms_norm_batch_invariant():
    logits = torch.randn(512, VOCAB, device="cuda") * 3
    full = tbik.log_softmax(logits)
    for lo, hi in ((0, 1), (100, 108), (7, 300)):
        assert_bits_equal(tbik.log_softmax(logits[lo:hi]), full[lo:hi])
    assert (full - torch.log_softmax(logits.double(), -1)).abs().max().item() < 1e-4
    x = torch.randn(2048, HIDDEN, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).bfloat16()
    full = tbik.rms_norm(x, w, 1e-6)
    for lo, hi in ((0, 1), (1000, 1032)):
        assert_bits_equal(tbik.rms_norm(x[lo:hi], w, 1e-6), full[lo:hi])
    heads = x.view(2048, 32, 128)
    assert_bits_equal(tbik.rms_norm(heads[:5, :8], w[:128], 1e-6), tbik.rms_norm(heads, w[:128], 1e-6)[:5, :8])


def _sequences(lengths, hq=32, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()

    return [(r(hq, t, d), r(hkv, t, d), r(hkv, t, d)) for t in lengths]


def _left_pad(seqs, width):
    qs, ks, vs, pads = [], [], [], []
    for q, k, v in seqs:
        pad = width - k.shape[1]
        pads.append(pad)
        qs.append(F.pad(q, (0, 0, pad, 0), value=7.0))  # garbage in the padding
        ks.append(F.pad(k, (0, 0, pad, 0), value=-3.0))
        vs.append(F.pad(v, (0, 0, pad, 0), value=5.0))
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.tensor(pads, device="cuda", dtype=torch.int32)


def test_attention_invariances():
    seqs = _sequences([2048, 700, 1500, 64])
    alone = [tbik.attention(q[None], k[None], v[None]) for q, k, v in seqs]
    # (a) batch size and left padding
    for width in (2048, 2100):
        q, k, v, start = _left_pad(seqs, width)
        out = tbik.attention(q, k, v, start=start)
        for b, pad in enumerate(start.tolist()):
            assert_bits_equal(out[b:b + 1, :, pad:], alone[b])
    # (b) heads per call: TP 2, 4, 8 shards of 32 query / 8 kv heads
    q, k, v = (t[None] for t in seqs[0])
    for tp in (2, 4, 8):
        hq, hk = 32 // tp, 8 // tp
        for r in (0, tp - 1):
            shard = tbik.attention(q[:, r * hq:(r + 1) * hq], k[:, r * hk:(r + 1) * hk], v[:, r * hk:(r + 1) * hk])
            assert_bits_equal(shard, alone[0][:, r * hq:(r + 1) * hq])
    # (c) decode steps equal the prefill rows, alone and inside a padded batch of 4
    for pos in (0, 63, 64, 1000, 2047):
        step = tbik.attention(q[:, :, pos:pos + 1], k[:, :, :pos + 1], v[:, :, :pos + 1])
        assert_bits_equal(step, alone[0][:, :, pos:pos + 1])
    qb, kb, vb, start = _left_pad(seqs, 2100)
    step = tbik.attention(qb[:, :, -1:], kb, vb, start=start)
    for b in range(4):
        assert_bits_equal(step[b:b + 1], alone[b][:, :, -1:])


@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (8, 8)])
def test_paged_attention_gives_each_query_the_bits_of_attention(hq, hkv):
    """A serving batch over a paged cache (block size 16, shuffled table, NaN in unused slots):
    a decode step, a whole prefill, a prefill chunk after cached keys, and decode steps of a
    short and a long request; every query head's rows packed by key/value head in the kernel."""
    seqs = _sequences([700, 130, 1500, 9, 2100], hq=hq, hkv=hkv, seed=hq)
    block_size, d = 16, seqs[0][0].shape[2]
    width = max(-(-k.shape[1] // block_size) for _, k, _ in seqs) + 1
    free = torch.randperm(len(seqs) * width, generator=torch.Generator().manual_seed(3)).tolist()
    table = torch.tensor([[free.pop() for _ in range(width)] for _ in seqs], dtype=torch.int32, device="cuda")
    kc = torch.full((len(seqs) * width, block_size, hkv, d), float("nan"), device="cuda").bfloat16()
    vc = kc.clone()
    for r, (_, k, v) in enumerate(seqs):
        pos = torch.arange(k.shape[1], device="cuda")
        blocks = table[r, pos // block_size].long()
        kc[blocks, pos % block_size], vc[blocks, pos % block_size] = k.transpose(0, 1), v.transpose(0, 1)
    prefill = [tbik.attention(q[None], k[None], v[None]) for q, k, v in seqs]
    new = [1, 130, 75, 1, 1]
    queries = torch.cat([q[:, -n:].transpose(0, 1) for (q, _, _), n in zip(seqs, new)])  # [N, Hq, D]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([k.shape[1] for _, k, _ in seqs], dtype=torch.int32, device="cuda")
    out = tbik.paged_attention(queries, kc, vc, qsl, seq_lens, table, max_query_len=max(new))
    assert not out.isnan().any()
    for r, n in enumerate(new):
        assert_bits_equal(out[qsl[r]:qsl[r + 1]].transpose(0, 1)[None], prefill[r][:, :, -n:])


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 128), (16, 8, 128), (16, 16, 64), (32, 4, 128), (64, 4, 128),
                                      (12, 4, 96), (16, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keys_major_paged_kernel_gives_the_row_major_bits(hq, hkv, d, dtype, monkeypatch):
    """Paged calls of at most 16 query rows a key/value head (decode steps, short chunks) run with
    the keys in the MMA's rows; every output element, written as fp32 and in the query's dtype,
    has the bits the row-major kernel gives it. 48 requests of up to 700 keys over a shuffled
    table with NaN in the unused slots."""
    from tbik.tl import attention as kernels

    if not kernels.mma_order_known(torch.device("cuda")):
        pytest.skip("the keys-major kernel runs on sm90 under a checked Triton only")
    group = hq // hkv
    g = torch.Generator(device="cuda").manual_seed(hq * d + group)
    for q_len in sorted({1, 16 // group}):
        n_req, block = 48, 16
        seq_lens = torch.randint(q_len, 701, (n_req,), generator=g, device="cuda").int()
        width = 700 // block + 1
        table = torch.randperm(n_req * width, generator=g, device="cuda").int().view(n_req, width)
        kc = torch.full((n_req * width, block, hkv, d), float("nan"), device="cuda", dtype=dtype)
        vc = kc.clone()
        for r, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n, device="cuda")
            slots = table[r, pos // block].long()
            kc[slots, pos % block] = torch.randn(n, hkv, d, generator=g, device="cuda").to(dtype)
            vc[slots, pos % block] = torch.randn(n, hkv, d, generator=g, device="cuda").to(dtype)
        query = (2 * torch.randn(n_req * q_len, hq, d, generator=g, device="cuda")).to(dtype)
        qsl = torch.arange(0, n_req * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        assert kernels.keys_major(query, q_len * group)

        def paged(out_dtype):
            out = torch.zeros(query.shape, device="cuda", dtype=out_dtype)
            return tbik.paged_attention(query, kc, vc, qsl, seq_lens, table, max_query_len=q_len, out=out)

        fast = [paged(torch.float32), paged(dtype)]
        assert not fast[0].isnan().any()
        monkeypatch.setattr(kernels, "KEYS_MAJOR_ROWS", 0)
        assert_bits_equal(fast[0], paged(torch.float32))
        assert_bits_equal(fast[1], paged(dtype))
        monkeypatch.undo()


def test_attention_accuracy():
    (q, k, v), = _sequences([512], hq=8, hkv=2)
    out = tbik.attention(q[None], k[None], v[None])
    ref = F.scaled_dot_product_attention(q[None].double(), k[None].double().repeat_interleave(4, 1),
                                         v[None].double().repeat_interleave(4, 1), is_causal=True)
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_batch_invariant_mode_on_cuda():
    lin = torch.nn.Linear(HIDDEN, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, HIDDEN, device="cuda").bfloat16()
    with torch.no_grad(), tbik.batch_invariant_mode("cuda", num_chunks=8):
        full = lin(x)
        one = lin(x[9:10])
        ls = torch.log_softmax(full.float(), -1)
    assert_bits_equal(one, full[9:10])
    assert_bits_equal(full, tbik.tree_matmul(x, lin.weight.t(), lin.bias))
    assert_bits_equal(ls, tbik.log_softmax(full.float()))


# ---------------------------------------------------------------- fused ops with the eager ops' bits


def _spread(*shape, dtype, seed):
    """Normal values with rows scaled from 1e-3 to 1e3, so every exponent range is exercised."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, generator=g, device="cuda")
    return (x * torch.logspace(-3, 3, shape[0], device="cuda").view(-1, *[1] * (len(shape) - 1))).to(dtype)


def _eager_rms_norm(x, w, eps, residual=None):
    """transformers' RMSNorm with tbik's mean, op by op (what the engine's tbik mode runs)."""
    total = x if residual is None else residual + x
    h = total.float()
    return w * (h * torch.rsqrt(tbik.mean_last_dim(h.pow(2), keepdim=True) + eps)).to(x.dtype), total


@pytest.mark.parametrize("n", [64, 128, 200, 1024, 2048])
@pytest.mark.parametrize("launch", [dict(_ROW_ELEMENTS=1), dict(_ONE_SLICE=False), dict(_WARPS=1), dict(_WARPS=8),
                                    dict(_NARROW=4096, _ROW_ELEMENTS=4096),
                                    dict(_ONE_SLICE=False, _WARPS=4, _ROW_ELEMENTS=2048)])
def test_rms_norm_launch_shape_does_not_move_bits(n, launch, monkeypatch):
    """How the RMSNorm is launched (rows a program, a row held in registers from its one read or
    read twice, warps) leaves each row's additions in the same pairs and order: the same bits for
    row counts on both sides of a program's rows, with a residual, and through a strided view. The
    mean kernel's warps likewise. The last launch is the one the shipped rule replaced."""
    from tbik.tl import norm

    x, res = _spread(611, n, dtype=torch.bfloat16, seed=n), _spread(611, n, dtype=torch.bfloat16, seed=n + 1)
    w = (1 + 0.1 * _spread(n, dtype=torch.float32, seed=2)).to(torch.bfloat16)
    qkv = _spread(37, 3 * 1024, dtype=torch.bfloat16, seed=5)
    w_head = (1 + 0.1 * _spread(128, dtype=torch.float32, seed=3)).to(torch.bfloat16)
    cases = [(x[:rows], w, None) for rows in (1, 2, 15, 16, 17, 611)] + [(x[:33], w, res[:33]),
                                                                      (qkv[:, :1024].view(37, 8, 128), w_head, None)]
    shipped = [tbik.rms_norm(a, weight, 1e-6, residual=r) for a, weight, r in cases]
    mean = tbik.mean_last_dim(x.float(), keepdim=True, dtype=None)
    for name, value in launch.items():
        monkeypatch.setattr(norm, name, value)
    for (a, weight, r), got in zip(cases, shipped):
        want = tbik.rms_norm(a, weight, 1e-6, residual=r)
        for g, wt in zip(got if r is not None else [got], want if r is not None else [want]):
            assert_bits_equal(g, wt)
    assert_bits_equal(tbik.mean_last_dim(x.float(), keepdim=True, dtype=None), mean)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [128, 1024, 1500, 4096])
def test_rms_norm_gives_the_eager_ops_bits(n, dtype):
    x, res = _spread(600, n, dtype=dtype, seed=n), _spread(600, n, dtype=dtype, seed=n + 1).flip(0)
    w = (1 + 0.1 * _spread(n, dtype=torch.float32, seed=2)).to(dtype)
    assert_bits_equal(tbik.rms_norm(x, w, 1e-6), _eager_rms_norm(x, w, 1e-6)[0])
    out, total = tbik.rms_norm(x, w, 1e-6, residual=res)
    want, want_total = _eager_rms_norm(x, w, 1e-6, res)
    assert_bits_equal(total, want_total)
    assert_bits_equal(out, want)
    if dtype != torch.float32:  # a row-parallel layer's fp32 sum, its cast folded into the norm
        wide = _spread(600, n, dtype=torch.float32, seed=n + 2) * 3
        out, total = tbik.rms_norm(wide, w, 1e-6, residual=res)
        want, want_total = _eager_rms_norm(wide.to(dtype), w, 1e-6, res)
        assert_bits_equal(total, want_total)
        assert_bits_equal(out, want)
    # Per-head norms of a fused qkv output: a two-level strided view, read in place.
    qkv = _spread(300, 3 * 1024, dtype=dtype, seed=5)
    q = qkv[:, :1024].view(300, 8, 128)
    assert_bits_equal(tbik.rms_norm(q, w[:128], 1e-6), _eager_rms_norm(q, w[:128], 1e-6)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (32, 1, 1024), (8, 300, 1024), (32, 1, 16, 128), (4, 77, 8, 128),
                                   (3, 50, 1500), (2, 9, 4096), (64, 5120), (1, 1, 2048)])
def test_rms_norm_with_torchs_mean_gives_the_stock_ops_bits(shape, dtype):
    """The stock mode's RMSNorm (kernelmodes._stock_norms): tbik's squares, torch's own mean of
    them, tbik's scaling; the bits of transformers' eight eager ops, at decode, prefill and
    per-head shapes, whatever order torch's mean picks for them."""
    x = _spread(math.prod(shape[:-1]), shape[-1], dtype=dtype, seed=shape[-1]).reshape(shape)
    w = (1 + 0.1 * _spread(shape[-1], dtype=torch.float32, seed=3)).to(dtype)
    h = x.to(torch.float32)
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    squares = tbik.float_squares(x)
    assert_bits_equal(squares, h.pow(2))
    assert_bits_equal(tbik.rms_norm(x, w, 1e-6, mean_sq=squares.mean(-1, keepdim=True)), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_gives_the_eager_ops_bits(dtype):
    x = _spread(700, 2 * 3072, dtype=torch.float32, seed=7) * 30
    x[0, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 90.0, -90.0, 110.0, -110.0,
                              float("inf"), float("-inf")])
    x = x.to(dtype)
    d = x.shape[-1] // 2
    assert_bits_equal(tbik.silu_and_mul(x), F.silu(x[:, :d]) * x[:, d:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,theta", [(128, 1e6), (128, 1e4), (64, 5e5)])
def test_rope_gives_the_eager_ops_bits(head_dim, theta, dtype):
    from tbik import cpu

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # as transformers, on the CPU
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    positions = torch.cat([torch.arange(64, device="cuda"), torch.randint(0, 40960, (960,), generator=g, device="cuda")])
    qkv = _spread(1024, 24 * head_dim, dtype=dtype, seed=9).flip(0)
    for x in (qkv[:, :16 * head_dim], qkv[:, 16 * head_dim:20 * head_dim]):  # q and k of a fused qkv output
        # cpu.rope is transformers' op sequence in plain torch: on CUDA tensors, the eager GPU ops.
        assert_bits_equal(tbik.rope(positions, x, inv_freq, head_dim), cpu.rope(positions, x, inv_freq.cuda(), head_dim))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 16, 8), (128, 8, 4), (64, 32, 8), (256, 4, 1)])
def test_qk_norm_rope_gives_the_bits_of_rms_norm_then_rope(head_dim, hq, hkv, dtype):
    """The fused kernel against the two kernels it replaces, on q and k slices of a fused qkv
    output, at decode and prefill token counts."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    g = torch.Generator(device="cuda").manual_seed(head_dim + hq)
    positions = torch.randint(0, 40960, (1000,), generator=g, device="cuda")
    qkv = _spread(1000, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=hq)
    q, k = qkv[:, :hq * head_dim], qkv[:, hq * head_dim:(hq + hkv) * head_dim]
    qw, kw = ((1 + 0.1 * _spread(head_dim, dtype=torch.float32, seed=s)).to(dtype) for s in (1, 2))

    def normed(x, w):
        return tbik.rms_norm(x.view(x.shape[0], -1, head_dim), w, 1e-6).reshape(x.shape[0], -1)

    for n in (1, 7, 256, 1000):
        got = tbik.qk_norm_rope(positions[:n], q[:n], k[:n], qw, kw, 1e-6, inv_freq, head_dim)
        want = (tbik.rope(positions[:n], normed(q[:n], qw), inv_freq, head_dim),
                tbik.rope(positions[:n], normed(k[:n], kw), inv_freq, head_dim))
        for a, b in zip(got, want):
            assert_bits_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch_cos", [True, False])
def test_apply_rope_gives_transformers_apply_rotary_pos_emb_bits(dtype, batch_cos):
    """tbik.apply_rope against transformers' own apply_rotary_pos_emb on the GPU, on q and k as
    the attention gives them ([B, T, H, D] projections transposed to [B, H, T, D]): values,
    layout (strides) and bits."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    B, T = 5, 37
    proj = _spread(B * T, 24 * 128, dtype=torch.float32, seed=11).to(dtype).view(B, T, 24, 128)
    q, k = proj[:, :, :16].transpose(1, 2), proj[:, :, 16:].transpose(1, 2)
    angles = _spread(B * T, 128, dtype=torch.float32, seed=12).view(B, T, 128) * 50
    if not batch_cos:
        angles = angles[:1]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    for got, want in ((tbik.apply_rope(q, cos, sin), want_q), (tbik.apply_rope(k, cos, sin), want_k)):
        assert got.stride() == want.stride()
        assert_bits_equal(got, want)


# ---------------------------------------------------------------- repaudit's digest kernel (for --trace)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_digest_kernel_equals_the_reference_digest(dtype):
    import numpy as np

    from repaudit.record.digest import numpy_row_digest, row_digest
    from repaudit.record.digest_kernel import digest_rows

    x = torch.randn(64, VOCAB, device="cuda").to(dtype)
    rows = torch.tensor([63, 0, 5], device="cuda")
    got, _ = digest_rows(x, rows)
    cpu = row_digest(x.cpu()[rows.cpu()])  # the torch element-wise path, on the CPU
    assert torch.equal(got.cpu(), cpu)
    if dtype == torch.float32:
        assert np.array_equal(got.cpu().numpy().view(np.uint64), numpy_row_digest(x[rows].cpu().numpy()))


def test_the_warp_specialized_kernel_gives_the_tree_kernels_bits():
    """Hopper: matmul_ws.py (Gluon, 128x128 tiles, producer warp + two MMA warpgroups) against
    tl/matmul.py's kernel, bit for bit: every leaf count a TP shard holds, bias, bf16 and fp32
    out, ragged M, and few output tiles (launch takes any case; tree_matmul hands it only eligible ones)."""
    from tbik.tl import matmul_ws

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("matmul_ws runs on Hopper (sm_90) only")
    for n, k in [(HIDDEN, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]:
        x, w = operands(2048, k, n, seed=11)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in (1, 200, 1000, 2048):
            for out_dtype in (torch.float32, torch.bfloat16):
                for b in (None, bias):
                    ref = tbik.tree_matmul(x[:m], w.t(), b, out_dtype=out_dtype, _split=1)
                    got = torch.empty(m, n, dtype=out_dtype, device="cuda")
                    assert_bits_equal(matmul_ws.launch(x[:m], w.t(), b, got, k, 8, k // 8), ref)
        for tp in (2, 4, 8):
            s = k // tp
            for r in (0, tp - 1):
                xs, ws = x[:, r * s:(r + 1) * s], w.t()[r * s:(r + 1) * s]
                got = torch.empty(2048, n, dtype=torch.float32, device="cuda")
                assert_bits_equal(matmul_ws.launch(xs, ws, None, got, s, 8 // tp, s // (8 // tp)),
                                  tbik.matmul_partial(xs, ws, tp_size=tp, _split=1))
    # Ragged N: TMA stores clip the last column tile (18992: an lm_head shard at TP=8; 1000, fp16);
    # an output row that is not a multiple of 16 bytes (N=4095) takes the masked stores.
    for n, dtype in ((18992, torch.bfloat16), (4095, torch.bfloat16), (1000, torch.float16)):
        x, w = operands(1000, HIDDEN, n, dtype=dtype, seed=13)
        bias = torch.randn(n, device="cuda").to(dtype)
        for out_dtype in (torch.float32, dtype):
            ref = tbik.tree_matmul(x, w.t(), bias, out_dtype=out_dtype, _split=1)
            got = torch.empty(1000, n, dtype=out_dtype, device="cuda")
            assert_bits_equal(matmul_ws.launch(x, w.t(), bias, got, HIDDEN, 8, HIDDEN // 8), ref)
    # tree_matmul takes this kernel by itself where the output fills half the GPU, and not below;
    # later calls go through the cached launch (the same binary).
    from tbik.tl import matmul as tm

    x, w = operands(2048, HIDDEN, MLP, seed=12)
    for m, n, taken in ((2048, MLP, True), (128, MLP, True), (127, MLP, False), (8, VOCAB, False), (128, 1024, False)):
        plan = tm._plan(x.dtype, x.dtype, x.device, m, n, HIDDEN, 8, HIDDEN // 8, False, None, True)
        assert plan.gluon is taken
    first = tbik.tree_matmul(x, w.t())
    for _ in range(2):
        assert_bits_equal(tbik.tree_matmul(x, w.t()), first)
    assert matmul_ws._kernel.direct and matmul_ws._kernel.compiled
