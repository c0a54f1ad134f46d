"""Kernel modes for the transformers engine: stock (engine defaults), bi, tbik."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def kernel_mode(model, mode: str) -> Iterator[None]:
    if mode != "stock":
        raise NotImplementedError(f"kernel mode {mode!r} is not available yet")
    yield
