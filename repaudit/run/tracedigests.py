"""A traced output's digests: at its hook (digest_now), or held and digested with the others of
its forward in one launch per element width (Held, digest_held; trace.py says when and why).

On a GPU the digests are the Triton kernels' (record/digest_kernel.py), on the CPU torch's
(record/digest.py): the same bits, tests/test_digest_kernel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..record.digest import row_digest
from ..record.digest_params import TABLE_MAX_ROWS

# dtype -> (integer view, mask of its bits, the dtype's name in the trace's metadata)
BITS = {torch.float32: (torch.int32, 0xFFFFFFFF, "float32"), torch.bfloat16: (torch.int16, 0xFFFF, "bfloat16"),
        torch.float16: (torch.int16, 0xFFFF, "float16")}
MAX_HELD_ROWS = TABLE_MAX_ROWS  # digest_many's rows: a decode step's batch
# Outputs held for one launch at most: past this the launch is made and holding starts again, so
# a large model's step never holds all its activations (a few launches then, not hundreds).
MAX_HELD_BYTES = 64 << 20


def version(x: torch.Tensor) -> int | None:
    """x's version counter (moved by torch's in-place ops); None for an inference tensor, which has none."""
    return None if x.is_inference() else x._version


@dataclass
class Held:
    """An output kept for its forward's one digest launch."""
    x: torch.Tensor  # [rows, local features], unit feature stride
    rows: torch.Tensor
    offset: int
    pick: torch.Tensor
    owned: torch.Tensor
    version: int | None  # x's version at the hook
    layout: tuple = ()  # the output's (dtype, features, strides), as the tracer checks it

    @staticmethod
    def of(whole: torch.Tensor, rows: torch.Tensor, offset: int, pick: torch.Tensor, owned: torch.Tensor,
           layout: tuple = ()) -> "Held":
        x = whole if whole.stride(-1) == 1 else whole.contiguous()
        return Held(x, rows, offset, pick, owned, version(x), layout)


def digest_now(whole: torch.Tensor, rows: torch.Tensor, offset: int, pick: torch.Tensor,
               owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The digests of `rows` of an output [tokens, local features] (int64 [rows]) and the bits
    of its features `pick`, times `owned` (int32 [rows, len(pick)])."""
    if whole.is_cuda:
        from ..record.digest_kernel import digest_rows  # triton: imported only where a GPU runs

        return digest_rows(whole, rows, offset, pick, owned)
    flat = whole[rows]
    view, mask, _ = BITS[flat.dtype]
    digests = row_digest(flat, rows_per_chunk=1 << 16, offset=offset)
    return digests, ((flat[:, pick].contiguous().view(view).to(torch.int64) & mask) * owned).to(torch.int32)


def digest_held(held: list[Held], table_for, tables: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """digest_now of every held output: on a GPU in one launch per element width (digest_many,
    with its `table_for`; the tables appended to `tables`); on the CPU, where there are no
    launches to save, one by one."""
    if not held[0].x.is_cuda:
        return [digest_now(h.x, h.rows, h.offset, h.pick, h.owned) for h in held]
    from ..record.digest_kernel import digest_many

    rows = held[0].rows
    if any(h.rows is not rows for h in held):
        raise RuntimeError("the outputs of one forward were digested over different rows")
    answers, made = digest_many([h.x for h in held], rows, [h.offset for h in held], [h.pick for h in held],
                                [h.owned for h in held], table_for)
    tables.extend(made)
    return answers


def differing(now: list[tuple[torch.Tensor, torch.Tensor]],
              held: list[tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
    """Which outputs' (digests, samples) differ between two digestings: bool per output, one host copy."""
    if not now:
        return np.zeros(0, dtype=bool)
    rows = now[0][0].shape[0]
    differ = torch.cat([torch.cat([d for d, _ in now]) != torch.cat([d for d, _ in held]),
                        (torch.cat([s for _, s in now]) != torch.cat([s for _, s in held])).any(1)])
    return differ.reshape(2, len(now), rows).any(2).any(0).cpu().numpy()
