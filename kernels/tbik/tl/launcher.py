"""Cheaper launches of a @triton.jit kernel on CUDA.

Triton binds and specializes every argument in Python on every call (about 25 us of a small
tree_matmul's 78 us host time on the H100 host, cProfile in reports/kernels/run2/host.md).
Once Triton has compiled the kernel for a given specialization, CachedKernel makes the same
final call Triton makes (the compiled handle's launcher with a 3-D grid, the current stream and
every argument, constexprs included, in signature order) without the binding. Its cache key is
at least as fine as Triton's own specialization (dtype and 16-byte alignment of every tensor;
for every int: == 1, divisible by 16, 32- or 64-bit), so a handle is only reused where Triton
would pick the same binary. If a direct call raises (it fails before anything is launched), the
kernel goes back to Triton's launch path for good, with a warning.
"""

from __future__ import annotations

import functools
import warnings

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # a Triton without Gluon: tl/matmul_ws.py never runs, nothing to launch
    GluonTensorDescriptor = TensorDescriptor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's SM count, which sizes the persistent kernels' grids."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # TRITON_INTERPRET on CPU: any small number; it only sets the persistent grid


def _hooks_idle() -> bool:
    """No launch hook is installed (Triton keeps empty hook chains, or None in older versions)."""
    return all(h is None or getattr(h, "calls", None) == [] for h in (knobs.runtime.launch_enter_hook,
                                                                       knobs.runtime.launch_exit_hook))


def _current_stream() -> int:
    """The current device's current stream, as Triton's own runner finds it."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _spec(x):
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    if isinstance(x, TensorDescriptor):  # Triton specializes on the dtype and the block shape
        return x.base.dtype, tuple(x.block_shape)
    if isinstance(x, GluonTensorDescriptor):  # and Gluon on its shared-memory layout too
        return x.base.dtype, tuple(x.block_shape), id(x.layout)
    if isinstance(x, bool):
        return "b", x
    if isinstance(x, int):
        return x == 1, x % 16 == 0, -(2**31) <= x < 2**31
    return type(x)


class CachedKernel:
    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}
        self.direct = True

    def __call__(self, grid: tuple, args: tuple, meta: dict) -> None:
        """fn[grid](*args, **meta): `args` the run-time arguments in order, `meta` the constexprs
        and the launch options."""
        first = args[0].base if isinstance(args[0], (TensorDescriptor, GluonTensorDescriptor)) else args[0]
        if not self.direct or not first.is_cuda:
            self.fn[grid](*args, **meta)
            return
        key = (tuple(meta.items()), first.device.index, *map(_spec, args))
        kernel = self.compiled.get(key)
        if kernel is None:  # Triton's path: compiles (once) and launches
            self.compiled[key] = self.fn[grid](*args, **meta)
            return
        grid3 = (*grid, 1, 1)[:3]  # the compiled handle takes the grid's three dimensions
        full = (*args, *(meta[name] for name in self.fn.arg_names[len(args):]))
        try:
            if _hooks_idle():
                # What the handle's own runner does, less its Python: no launch metadata to
                # build, no empty hook chains to call.
                kernel.run(*grid3, _current_stream(), kernel.function, kernel.packed_metadata,
                           None, None, None, *full)
            else:  # a launch hook is installed (a profiler): it gets what it expects
                kernel[grid3](*full)
        except Exception as err:  # noqa: BLE001 - any refusal: Triton's own path still works
            warnings.warn(f"tbik: direct launch of {getattr(self.fn, '__name__', 'a kernel')} failed ({err!r}); "
                          "using Triton's launch path from now on")
            self.direct = False
            self.fn[grid](*args, **meta)
