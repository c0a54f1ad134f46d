"""Batch-invariant mode: route aten's matmuls, log-softmax and last-dim mean to tbik kernels.

Overrides the kernels of aten::mm, aten::addmm, aten::_log_softmax and aten::mean.dim for one
dispatch key ("CUDA" or "CPU") through torch.library, so unmodified model code (nn.Linear,
F.log_softmax, RMSNorm's x.pow(2).mean(-1)) runs on them. With num_chunks=1 the matmul is a
plain fixed-tile matmul (batch-invariant); with 8 or 16 it is the TBIK tree matmul.

The replacements never call the ops they replace: dtypes the kernels do not take go through
bmm / sum, which stay stock. On the CPU key (tbik.cpu's backend) aten::silu, sigmoid and gelu
are replaced too, by compositions of position-invariant ops.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from . import cpu
from .matmul import DTYPES, SUPPORTED_CHUNKS, tree_matmul
from .norm import mean_last_dim
from .softmax import log_softmax


_lib: torch.library.Library | None = None
_active: tuple[str, int] | None = None


def _mm(num_chunks):
    def mm(a, b):
        if a.dtype in DTYPES and a.dtype == b.dtype:
            return tree_matmul(a, b, num_chunks=num_chunks)
        return torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)

    return mm


def _addmm(num_chunks):
    mm = _mm(num_chunks)

    def addmm(bias, a, b, *, beta=1, alpha=1):
        if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] \
                and a.dtype in DTYPES and a.dtype == b.dtype:
            return tree_matmul(a, b, bias, num_chunks=num_chunks)  # bias joins in fp32
        prod = mm(a, b)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:  # torch ignores the bias then, NaNs included
            return prod
        return prod + (bias if beta == 1 else bias * beta)

    return addmm


def _log_softmax(x, dim, half_to_float):
    return log_softmax(x, dim, torch.float32 if half_to_float else None)


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    dims = [d % max(x.dim(), 1) for d in dim] if dim else list(range(x.dim()))
    if dims == [x.dim() - 1] and x.is_floating_point():
        return mean_last_dim(x, keepdim, dtype)
    out_dtype = dtype or x.dtype
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    count = 1
    for d in dims:
        count *= x.shape[d]
    total = torch.sum(x, dims, keepdim=keepdim, dtype=acc_dtype)
    return (total / count).to(out_dtype)


def _dispatch_key(device_type: str) -> str:
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device_type.lower())
    if key is None:
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    return key


def enable_batch_invariant_mode(device_type: str = "cuda", num_chunks: int = 1) -> None:
    """Install the overrides for `device_type` ("cuda"/"CUDA" or "cpu"/"CPU")."""
    global _lib, _active
    key = _dispatch_key(device_type)
    if num_chunks != 1 and num_chunks not in SUPPORTED_CHUNKS:
        raise ValueError(f"num_chunks must be 1 or one of {SUPPORTED_CHUNKS}, got {num_chunks}")
    if _active == (key, num_chunks):
        return
    disable_batch_invariant_mode()
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # overriding stock kernels is the point
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("aten::mm", _mm(num_chunks), key)
        lib.impl("aten::addmm", _addmm(num_chunks), key)
        lib.impl("aten::_log_softmax", _log_softmax, key)
        lib.impl("aten::mean.dim", _mean_dim, key)
        if key == "CPU":
            # torch's CPU sigmoid/silu/gelu round differently in the vectorised body and the
            # scalar tail, so an element's bits depend on where it sits in the tensor.
            lib.impl("aten::silu", cpu.silu, key)
            lib.impl("aten::sigmoid", cpu.sigmoid, key)
            lib.impl("aten::gelu", cpu.gelu, key)
    _lib, _active = lib, (key, num_chunks)


def disable_batch_invariant_mode() -> None:
    """Restore the stock kernels."""
    global _lib, _active
    if _lib is not None:
        _lib._destroy()
    _lib, _active = None, None


def is_batch_invariant_mode_enabled() -> bool:
    return _active is not None


@contextlib.contextmanager
def batch_invariant_mode(device_type: str = "cuda", num_chunks: int = 1):
    """Context manager around enable/disable; restores whatever mode was active before."""
    previous = _active
    enable_batch_invariant_mode(device_type, num_chunks)
    try:
        yield
    finally:
        disable_batch_invariant_mode()
        if previous is not None:
            enable_batch_invariant_mode(*previous)
