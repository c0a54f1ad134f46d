"""tbik: tree-based invariant kernels.

Triton kernels whose results do not move with the tensor-parallel size or the batch size:
the TBIK tree matmul and its per-rank partial, a tree all-reduce, and batch-invariant
log-softmax, RMSNorm (or its scaling alone, given each row's mean of squares), last-dim mean
and causal attention (also over a paged KV cache); SiLU-and-mul and rotary embedding with the
bits of transformers' eager ops in one kernel each (Qwen3's q/k norms and rotary in one);
plus a mode that routes aten's mm/addmm/_log_softmax/mean.dim to them. Depends on torch and
triton only. See docs/tbik.md.

The tensors' device picks the backend: the Triton kernels (tbik.tl) on a GPU, a torch backend
with the same invariance contracts on the CPU (tbik.cpu). Importing tbik imports no triton and patches nothing;
use_interpreter() runs the Triton kernels in Triton's CPU interpreter instead (kernel tests).
"""

from .allreduce import tree_all_reduce, tree_sum
from .attention import attention, paged_attention
from .backend import use_interpreter
from .elementwise import apply_rope, qk_norm_rope, qk_norm_rope_fits, rope, silu_and_mul
from .matmul import NUM_CHUNKS, SUPPORTED_CHUNKS, matmul_partial, tree_matmul
from .modes import batch_invariant_mode, disable_batch_invariant_mode, enable_batch_invariant_mode, is_batch_invariant_mode_enabled
from .norm import float_squares, mean_last_dim, rms_norm
from .softmax import log_softmax, log_softmax_at

__all__ = [
    "NUM_CHUNKS",
    "SUPPORTED_CHUNKS",
    "apply_rope",
    "attention",
    "batch_invariant_mode",
    "disable_batch_invariant_mode",
    "enable_batch_invariant_mode",
    "float_squares",
    "is_batch_invariant_mode_enabled",
    "log_softmax",
    "log_softmax_at",
    "matmul_partial",
    "mean_last_dim",
    "paged_attention",
    "qk_norm_rope",
    "qk_norm_rope_fits",
    "rms_norm",
    "rope",
    "silu_and_mul",
    "tree_all_reduce",
    "tree_matmul",
    "tree_sum",
    "use_interpreter",
]
