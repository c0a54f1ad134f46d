"""Whether a traced output is a shard of a tensor-parallel layer's output, from the model's TP
plan: the style's declared layout where it declares one, else from the output's inputs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def sharded_output(style: str | None, at_input: bool, input_is_shard) -> bool:
    """Is this output (or, at_input, a row-parallel layer's input) a shard? From the TP style's
    declared layout where it declares one, else from the inputs (input_is_shard, called lazily)."""
    declared = _declared_layouts(style)[0 if at_input else 1] if style else None
    return declared if declared is not None else input_is_shard()


def shard_span(local: int, device) -> tuple[int, int]:
    """A sharded output's (first feature of this rank's shard, whole row's width), from every
    rank's shard width: torch splits a width the TP size does not divide into unequal shards
    (the first ranks one feature more), so rank * local and local * tp would misplace them. A
    collective: every rank classifies the same outputs in the same order (one forward's code)."""
    import torch
    import torch.distributed as dist

    widths = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    widths[dist.get_rank()] = local
    dist.all_reduce(widths)
    return int(widths[:dist.get_rank()].sum()), int(widths.sum())


# packed_colwise shards its output as colwise does, but its style object declares no layout.
_UNDECLARED_OUTPUT = {"packed_colwise": True}


@lru_cache(maxsize=None)
def _declared_layouts(style: str) -> tuple[bool | None, bool | None]:
    """(input sharded, output sharded) as transformers' TP style declares them; None: not declared."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    layer = ALL_PARALLEL_STYLES[style] if style in ALL_PARALLEL_STYLES else None

    def has_shard(layouts: Any) -> bool | None:
        if layouts is None:
            return None
        return any(isinstance(p, Shard) for p in (layouts if isinstance(layouts, tuple) else (layouts,)))

    output = _UNDECLARED_OUTPUT.get(style, has_shard(getattr(layer, "output_layouts", None)))
    return has_shard(getattr(layer, "input_layouts", None)), output
