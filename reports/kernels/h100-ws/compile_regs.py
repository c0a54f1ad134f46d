import sys, subprocess, os, importlib, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../kernels"))
import triton, torch
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
import tbik.tl.matmul_ws as W
for _k in ("CONSUMER_REGS","PRODUCER_REGS","STAGES"):
    if _k in os.environ: setattr(W, _k, int(os.environ[_k]))
TMA = os.environ.get('TMA', '1') == '1'

def comp(leaves=8, bias=False, out="fp32", dump=None):
    fn = W._tree_matmul_ws_kernel
    a = torch.empty(256, 512, dtype=torch.bfloat16)
    lay = W._smem_layout(W.gl.bfloat16)
    da = TensorDescriptor(a, [256, 512], [512, 1], [W.BLOCK_M, W.BLOCK_K], lay)
    db = TensorDescriptor(a, [256, 512], [512, 1], [W.BLOCK_N, W.BLOCK_K], lay)
    od = torch.empty(256, 256, dtype=torch.float32 if out == "fp32" else torch.bfloat16)
    dc = TensorDescriptor(od, [256, 256], [256, 1], [W.BLOCK_M // 2, W.BLOCK_N], W._out_layout(od.dtype))
    const = dict(LEAVES=leaves, HAS_BIAS=bias, GROUP_M=W.GROUP_M, STAGES=W.STAGES, TMA_STORE=TMA, CONSUMER_REGS=W.CONSUMER_REGS, PRODUCER_REGS=W.PRODUCER_REGS)
    sig = dict(a_desc=mangle_type(da), b_desc=mangle_type(db), out_desc=mangle_type(dc), bias_ptr="*bf16", out_ptr="*"+out, M="i32", N="i32", stride_om="i32", tiles_per_leaf="i32")
    for k in const: sig[k] = "constexpr"
    attrs = {(3,): [["tt.divisibility", 16]], (4,): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn, sig, const, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=W.MAXNREG))
    d = tempfile.mkdtemp(); p = f"{d}/k.cubin"; open(p, "wb").write(k.asm["cubin"])
    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    res = subprocess.run([cuobj, "-res-usage", p], capture_output=True, text=True).stdout
    if dump:
        for key in ("ttgir", "ptx"): open(f"{d}/{dump}.{key}", "w").write(k.asm[key])
        open(f"{d}/{dump}.sass", "w").write(subprocess.run([cuobj, "-sass", p], capture_output=True, text=True).stdout)
    return k, res

if __name__ == "__main__":
    for leaves in map(int, sys.argv[1].split(",")):
        for bias in (False, True):
            for out in ("fp32", "bf16"):
                k, res = comp(leaves, bias, out, dump=f"l{leaves}{'b' if bias else ''}{out}")
                line = [l for l in res.splitlines() if "REG" in l]
                print(leaves, bias, out, "shared", k.metadata.shared, line[0].strip() if line else res[-300:])
