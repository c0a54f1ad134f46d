"""tbik: tree-based invariant kernels.

Triton kernels whose results do not move with the tensor-parallel size or the batch size:
the TBIK tree matmul and its per-rank partial, a tree all-reduce, and batch-invariant
log-softmax, RMSNorm, last-dim mean and causal attention (also over a paged KV cache); plus a
mode that routes aten's mm/addmm/_log_softmax/mean.dim to them. Depends on torch and triton
only. See docs/tbik.md.
"""

from . import _interpret

_interpret.apply()  # before any kernel is defined: fixes for the CPU interpreter, if it is on

from .allreduce import tree_all_reduce, tree_sum  # noqa: E402
from .attention import attention, paged_attention  # noqa: E402
from .matmul import NUM_CHUNKS, SUPPORTED_CHUNKS, matmul_partial, tree_matmul  # noqa: E402
from .modes import (  # noqa: E402
    batch_invariant_mode,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from .norm import mean_last_dim, rms_norm  # noqa: E402
from .softmax import log_softmax  # noqa: E402

__all__ = [
    "NUM_CHUNKS",
    "SUPPORTED_CHUNKS",
    "attention",
    "batch_invariant_mode",
    "disable_batch_invariant_mode",
    "enable_batch_invariant_mode",
    "is_batch_invariant_mode_enabled",
    "log_softmax",
    "matmul_partial",
    "mean_last_dim",
    "paged_attention",
    "rms_norm",
    "tree_all_reduce",
    "tree_matmul",
    "tree_sum",
]
