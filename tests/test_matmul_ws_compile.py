"""The warp-specialized Gluon tree matmul (kernels/tbik/tl/matmul_ws.py) compiles for sm_90a
without spilling, on a machine with no GPU (Triton's own ptxas). Its bits are checked on a GPU
(tests/test_tbik_gpu.py::test_the_warp_specialized_kernel_gives_the_tree_kernels_bits)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import triton

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no CUDA binutils")


def _resources(leaves: int, bias: bool, out_dtype: torch.dtype, tmp_path: Path) -> dict[str, int]:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    import importlib

    # Loaded afresh: a module first imported while a test ran Triton's interpreter would hold
    # interpreted functions, which do not compile.
    W = importlib.reload(importlib.import_module("tbik.tl.matmul_ws"))

    a = torch.empty(256, 512, dtype=torch.bfloat16)
    layout = W._smem_layout(W.gl.bfloat16)
    out = torch.empty(256, 256, dtype=out_dtype)
    descs = dict(a_desc=TensorDescriptor(a, [256, 512], [512, 1], [W.BLOCK_M, W.BLOCK_K], layout),
                 b_desc=TensorDescriptor(a, [256, 512], [512, 1], [W.BLOCK_N, W.BLOCK_K], layout),
                 out_desc=TensorDescriptor(out, [256, 256], [256, 1], [W.BLOCK_M // 2, W.BLOCK_N],
                                           W._out_layout(out_dtype)))
    const = dict(LEAVES=leaves, HAS_BIAS=bias, GROUP_M=W.GROUP_M, STAGES=W.STAGES, TMA_STORE=W.TMA_STORE,
                 CONSUMER_REGS=W.CONSUMER_REGS, PRODUCER_REGS=W.PRODUCER_REGS)
    sig = {**{k: mangle_type(d) for k, d in descs.items()}, "bias_ptr": "*bf16",
           "out_ptr": "*fp32" if out_dtype == torch.float32 else "*bf16",
           "M": "i32", "N": "i32", "stride_om": "i32", "tiles_per_leaf": "i32", **{k: "constexpr" for k in const}}
    src = GluonASTSource(W._tree_matmul_ws_kernel, sig, const, {(3,): [["tt.divisibility", 16]],
                                                               (4,): [["tt.divisibility", 16]]})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=W.MAXNREG))
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = next(line for line in usage.splitlines() if "REG:" in line).split()
    return {k: int(v) for k, v in (f.split(":") for f in fields if ":" in f and f.split(":")[1].isdigit())}


@pytest.mark.parametrize("leaves, bias, out_dtype", [(8, True, torch.bfloat16), (2, False, torch.float32)])
def test_the_gluon_kernel_compiles_for_hopper_without_spills(leaves, bias, out_dtype, tmp_path):
    res = _resources(leaves, bias, out_dtype, tmp_path)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res  # nothing spilled to local memory
    assert res["REG"] <= 168, res  # 12 warps x 168 registers: one CTA of it fits an SM
