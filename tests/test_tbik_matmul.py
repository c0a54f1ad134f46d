"""tbik tree matmul on CPU (Triton interpreter): TP, batch and column-shard invariance, bitwise."""

import pytest
import torch

import tbik

pytestmark = pytest.mark.usefixtures("triton_interpreter")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape
    xi, yi = x.contiguous().view(INT_VIEW[x.dtype]), y.contiguous().view(INT_VIEW[y.dtype])
    if not torch.equal(xi, yi):
        diff = (xi != yi).sum().item()
        raise AssertionError(f"{diff} of {x.numel()} elements differ in their bits")


def linear_operands(m, k, n, dtype, seed=0):
    """x [M, K] and an nn.Linear-style weight [N, K]; the engine passes weight.t()."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w


def tp_result(x, w, tp, num_chunks=tbik.NUM_CHUNKS):
    """Row-parallel layer at TP=tp: each rank's K shard, then the pairwise tree over ranks."""
    k = x.shape[1]
    shard = k // tp
    parts = [tbik.matmul_partial(x[:, r * shard:(r + 1) * shard], w.t()[r * shard:(r + 1) * shard],
                                 tp_size=tp, num_chunks=num_chunks) for r in range(tp)]
    return tbik.tree_sum(parts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", [8, 16])
def test_tp_shards_reproduce_tp1_bits(dtype, num_chunks):
    x, w = linear_operands(5, 1024, 96, dtype)
    full = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32)
    for tp in (1, 2, 4, 8):
        assert_bits_equal(tp_result(x, w, tp, num_chunks), full)
    if num_chunks == 16:
        assert_bits_equal(tp_result(x, w, 16, num_chunks), full)


def test_bias_joins_once_in_fp32_then_one_cast():
    x, w = linear_operands(6, 512, 80, torch.bfloat16)
    bias = torch.randn(80).to(torch.bfloat16)
    fp32 = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
    assert_bits_equal(tbik.tree_matmul(x, w.t(), bias), (fp32 + bias.float()).to(torch.bfloat16))
    shards = tp_result(x, w, 4)
    assert_bits_equal((shards + bias.float()).to(torch.bfloat16), tbik.tree_matmul(x, w.t(), bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", [1, 8])
def test_rows_do_not_depend_on_batch_size(dtype, num_chunks):
    # 300 rows cross two 128-row tiles; the strategy (SPLIT) also changes with M here.
    x, w = linear_operands(300, 512, 160, dtype, seed=1)
    bias = torch.randn(160).to(dtype)
    full = tbik.tree_matmul(x, w.t(), bias, num_chunks=num_chunks)
    for m in (1, 3, 64, 129):
        for first in (0, 171):
            rows = tbik.tree_matmul(x[first:first + m], w.t(), bias, num_chunks=num_chunks)
            assert_bits_equal(rows, full[first:first + m])


@pytest.mark.parametrize("num_chunks", [8, 16])
def test_every_execution_strategy_gives_the_same_bits(num_chunks):
    # 2 x 2 output tiles; SPLIT=1 keeps the whole tree in one program (registers + scratch
    # levels for 8 and 16 leaves), SPLIT>1 spreads leaves over programs and joins them last.
    x, w = linear_operands(70, 1024, 200, torch.bfloat16, seed=2)
    ref = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32, _split=1)
    split = 2
    while split <= num_chunks:
        got = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32, _split=split)
        assert_bits_equal(got, ref)
        split *= 2
    for tp in (2, 4):
        shard = 1024 // tp
        for split in (1, num_chunks // tp):
            part = tbik.matmul_partial(x[:, :shard], w.t()[:shard], tp_size=tp, num_chunks=num_chunks,
                                       _split=split)
            first = tbik.matmul_partial(x[:, :shard], w.t()[:shard], tp_size=tp, num_chunks=num_chunks)
            assert_bits_equal(part, first)


def test_column_shards_match_full_columns():
    x, w = linear_operands(7, 512, 384, torch.bfloat16, seed=3)
    full = tbik.tree_matmul(x, w.t())
    for tp in (2, 4, 8):
        n = 384 // tp
        for r in range(tp):
            assert_bits_equal(tbik.tree_matmul(x, w[r * n:(r + 1) * n].t()), full[:, r * n:(r + 1) * n])


def test_strides_do_not_change_bits():
    x, w = linear_operands(9, 640, 72, torch.bfloat16, seed=4)
    ref = tbik.tree_matmul(x, w.t().contiguous())
    wide = torch.zeros(9, 1280, dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert_bits_equal(tbik.tree_matmul(wide[:, ::2], w.t()), ref)  # strided a, transposed b
    assert_bits_equal(tbik.tree_matmul(x.t().contiguous().t(), w.t()), ref)  # column-major a


@pytest.mark.parametrize("m", [1, 5, 70])
def test_tma_loads_give_the_pointer_loads_bits(m):
    # K-contiguous operands load through tensor descriptors (rows past M come in as zeros, not
    # as wrapped copies); the bits must be those of the pointer loads, for every SPLIT.
    from tbik.tl import matmul as tm

    x, w = linear_operands(m, 1024, 192, torch.bfloat16, seed=6)
    wide = torch.zeros(m, 2048, dtype=x.dtype)
    wide[:, ::2] = x
    x_cols = wide[:, ::2]  # K stride 2: pointer loads
    assert tm._tma_fits(x, w.t()) and not tm._tma_fits(x_cols, w.t()) and not tm._tma_fits(x, w.t().contiguous())
    assert tm._plan(x.dtype, x.dtype, x.device, m, 192, 1024, 8, 128, False, 1, True).meta["TMA"]
    for split in (1, 2, 8):
        got = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32, _split=split)
        assert_bits_equal(got, tbik.tree_matmul(x_cols, w.t(), out_dtype=torch.float32, _split=split))
    assert_bits_equal(got, tbik.tree_matmul(x, w.t(), out_dtype=torch.float32, _split=1))


@pytest.mark.parametrize("k", [300, 100, 13])
def test_ragged_k_is_zero_padded_chunks(k):
    # Documented: chunk width ceil(K/C); the tail of the last chunk(s) counts as zeros. So the
    # result equals the product with K zero-padded to C * ceil(K/C), bit for bit.
    x, w = linear_operands(4, k, 48, torch.bfloat16, seed=5)
    width = -(-k // 8)
    pad = 8 * width - k
    xp = torch.nn.functional.pad(x, (0, pad))
    wp = torch.nn.functional.pad(w, (0, pad))
    got = tbik.tree_matmul(x, w.t(), out_dtype=torch.float32)
    assert_bits_equal(got, tbik.tree_matmul(xp, wp.t(), out_dtype=torch.float32))
    ref = x.double() @ w.double().t()
    assert ((got.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5), (torch.float16, 1e-5)])
def test_accuracy_against_float64(dtype, tol):
    # Inputs are exact in their dtype, so the only error is the fp32 accumulation.
    x, w = linear_operands(33, 4096, 64, dtype, seed=6)
    ref = x.double() @ w.double().t()
    for num_chunks in (1, 8, 16):
        got = tbik.tree_matmul(x, w.t(), num_chunks=num_chunks, out_dtype=torch.float32)
        assert ((got.double() - ref).norm() / ref.norm()).item() < tol


def test_empty_and_degenerate_shapes():
    x, w = linear_operands(3, 16, 8, torch.float32)
    assert tbik.tree_matmul(x[:0], w.t()).shape == (0, 8)
    bias = torch.randn(8)
    assert_bits_equal(tbik.tree_matmul(x[:, :0], w[:, :0].t(), bias), bias.expand(3, 8).contiguous())


def test_clear_errors():
    x, w = linear_operands(3, 64, 8, torch.bfloat16)
    for tp in (0, 3, 6, 16):
        with pytest.raises(ValueError, match="power of two"):
            tbik.matmul_partial(x, w.t(), tp_size=tp)
    with pytest.raises(ValueError, match="multiple of num_chunks"):
        tbik.matmul_partial(x[:, :30], w.t()[:30], tp_size=2)
    with pytest.raises(ValueError, match="num_chunks"):
        tbik.tree_matmul(x, w.t(), num_chunks=4)
    with pytest.raises(TypeError, match="dtype"):
        tbik.tree_matmul(x, w.t().float())
    with pytest.raises(ValueError, match="shape"):
        tbik.tree_matmul(x, w.t(), torch.zeros(9, dtype=torch.bfloat16))


class _FakeCudaTensor:
    """Stands in for a CUDA tensor as the first argument (the launcher only asks these)."""

    is_cuda = True

    class device:  # noqa: N801
        index = 0


def _fake_kernel(calls, fail_direct=False):
    class Compiled:
        function, packed_metadata = "fn", (4, 1, 0)

        def run(self, *args):  # the launcher: grid, stream, function, metadata, hooks, arguments
            if fail_direct:
                raise IndexError("refused")
            calls.append(("direct", args[:3], args[3:9], args[9:]))

        def __getitem__(self, grid):  # Triton's runner, which a launch hook needs
            def run(*args):
                calls.append(("runner", grid, args))
            return run

    class Fn:
        arg_names = ["x", "n", "BLOCK", "FLAG"]

        def __getitem__(self, grid):
            def launch(*args, **meta):
                calls.append(("triton", grid, args, meta))
                return Compiled()
            return launch

    return Fn()


def test_cached_kernel_replays_tritons_final_call(monkeypatch):
    from tbik.tl import launcher

    monkeypatch.setattr(launcher, "_current_stream", lambda: 77)
    calls = []
    launch = launcher.CachedKernel(_fake_kernel(calls))
    x, meta = _FakeCudaTensor(), dict(BLOCK=64, FLAG=True, num_warps=4)
    for grid, n in (((5,), 7), ((5,), 7), ((6, 2), 16), ((6, 2), 16), ((5,), 1)):
        launch(grid, (x, n), meta)
    kinds = [c[0] for c in calls]
    assert kinds == ["triton", "direct", "triton", "direct", "triton"]  # n=16 and n=1 specialize anew
    # 3-D grid; the stream, handle and metadata, no launch metadata or hooks; constexprs in signature order
    assert calls[1] == ("direct", (5, 1, 1), (77, "fn", (4, 1, 0), None, None, None), (x, 7, 64, True))
    assert calls[3] == ("direct", (6, 2, 1), (77, "fn", (4, 1, 0), None, None, None), (x, 16, 64, True))


def test_cached_kernel_leaves_launch_hooks_to_tritons_runner(monkeypatch):
    """With a launch hook installed (a profiler's), the launch goes through the handle's runner,
    which builds the metadata the hook is called with."""
    from triton import knobs

    from tbik.tl import launcher

    monkeypatch.setattr(launcher, "_current_stream", lambda: 77)
    hook = type(knobs.runtime.launch_enter_hook)()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    calls = []
    launch = launcher.CachedKernel(_fake_kernel(calls))
    x, meta = _FakeCudaTensor(), dict(BLOCK=64, FLAG=True, num_warps=4)
    launch((5,), (x, 7), meta)
    launch((5,), (x, 7), meta)
    assert calls[1] == ("runner", (5, 1, 1), (x, 7, 64, True))


def test_cached_kernel_falls_back_to_triton_when_refused(monkeypatch):
    from tbik.tl import launcher

    monkeypatch.setattr(launcher, "_current_stream", lambda: 77)
    calls = []
    launch = launcher.CachedKernel(_fake_kernel(calls, fail_direct=True))
    x, meta = _FakeCudaTensor(), dict(BLOCK=64, FLAG=True, num_warps=4)
    launch((5,), (x, 7), meta)
    with pytest.warns(UserWarning, match="direct launch"):
        launch((5,), (x, 7), meta)
    launch((5,), (x, 7), meta)
    assert [c[0] for c in calls] == ["triton", "triton", "triton"] and not launch.direct


def test_a_triton_without_gluon_keeps_the_triton_kernel(monkeypatch):
    """tl/matmul_ws.py needs Gluon (Triton >= 3.6); where it cannot be imported, every case stays
    on tl/matmul.py's kernel instead of failing."""
    import sys

    import tbik.tl
    from tbik.tl import matmul as tm

    monkeypatch.delattr(tbik.tl, "matmul_ws", raising=False)
    monkeypatch.setitem(sys.modules, "tbik.tl.matmul_ws", None)  # `import` raises ImportError
    assert tm._gluon_eligible(torch.bfloat16, torch.bfloat16, torch.device("cuda", 0), 4096, 4096, 4096, 8, 512,
                              True) is False
