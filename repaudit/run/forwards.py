"""Modules' forwards replaced for the length of a `with` block, then put back as they were."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


@contextmanager
def replaced_forwards(pairs: list[tuple[torch.nn.Module, Callable]]) -> Iterator[int]:
    """Each module runs its new forward in the body; yields how many. An instance attribute is
    what nn.Module calls, so the class's forward (or one set on the instance before) comes back."""
    saved = [(module, module.__dict__.get("forward")) for module, _ in pairs]
    for module, forward in pairs:
        module.forward = forward
    try:
        yield len(pairs)
    finally:
        for module, original in saved:
            if original is None:
                del module.forward
            else:
                module.forward = original
