"""Which backend runs an op: the tensor's device decides. CUDA tensors run the Triton kernels
(tbik.tl); CPU tensors run the torch backend (cpu.py: the same invariance contracts, not the
GPU's bits), unless use_interpreter() asked for the Triton kernels in Triton's CPU interpreter
(the kernel tests).

Nothing here imports triton; only the first op on a GPU (or under the interpreter) does.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

_interpreter = False


def on_cpu(t: torch.Tensor) -> bool:
    """Whether the torch backend runs for this tensor."""
    return t.device.type == "cpu" and not _interpreter


def use_interpreter(on: bool = True) -> None:
    """Run the Triton kernels in Triton's interpreter, on CPU tensors too (or stop, with on=False).

    Triton decides at decoration time whether a kernel is compiled or interpreted, so the kernel
    modules already loaded are loaded again under the new setting. The interpreter gets the
    fixes in tl/interpret.py. Triton's switch is also its TRITON_INTERPRET variable: processes
    started meanwhile inherit it, and must call this themselves to run the kernels that way."""
    global _interpreter
    if on == _interpreter:
        return
    import triton

    from .tl import interpret

    if on:
        interpret.apply()
        triton.knobs.runtime.interpret = True
    else:
        del triton.knobs.runtime.interpret
        os.environ.pop("TRITON_INTERPRET", None)
    interpret.standard_library(on)
    _interpreter = on
    for name in ("launcher", "allreduce", "norm", "softmax", "attention", "matmul_ws", "matmul", "elementwise"):  # dependencies first
        module = sys.modules.get(f"{__package__}.tl.{name}")
        if module is not None:
            importlib.reload(module)


# The element-wise kernels (norm, SiLU, rotary) take each value to fp32 and round the result to
# the output dtype: the eager ops' bits for these dtypes, not for float64 (whose products the
# eager ops keep in float64).
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_kernel_dtypes(op: str, *tensors: torch.Tensor) -> None:
    """TypeError where a GPU kernel would round a float64 (or non-float) operand to fp32."""
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"tbik.{op} on a GPU takes bfloat16, float16 or float32 tensors, not {t.dtype}")
