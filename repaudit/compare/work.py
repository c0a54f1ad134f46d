"""Work arrays the diff reuses from chunk to chunk."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class Work:
    """Work arrays reused from chunk to chunk. Fresh memory costs a page fault per page on first
    touch (with transparent huge pages, zeroing 2 MiB at a time): more than the arithmetic done on
    it, so the hot path writes into these with out= instead of allocating temporaries."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._handed: list[np.ndarray] = []  # see unshared
        self._tiled: dict[str, np.ndarray] = {}
        self.levels: dict[int, tuple] = {}  # see _levels

    def tiled(self, name: str, unit: np.ndarray, n: int) -> np.ndarray:
        """`unit` repeated to n items (the same unit for the same name), kept for the next call."""
        arr = self._tiled.get(name)
        if arr is None or len(arr) < n:
            arr = self._tiled[name] = np.tile(unit, -(-(n + n // 4) // len(unit)))
        return arr[:n]

    def unshared(self, dtype: Any, n: int) -> np.ndarray:
        """An array of n items that may be handed on (chunks hold views of it), reused once nothing
        refers to it any more: every numpy view holds a reference to the array that owns the memory,
        so a reference count of 3 (this list, the loop variable, getrefcount's argument) means that no
        view is left, and none can be made. As many are kept as were ever in use at once."""
        for arr in self._handed:
            if sys.getrefcount(arr) == 3 and arr.dtype == dtype and len(arr) >= n:
                return arr[:n]
        arr = np.empty(n + n // 4, dtype=dtype)  # room for a larger row group
        self._handed.append(arr)
        return arr[:n]

    def get(self, name: str, dtype: Any, n: int) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None or len(arr) < n:
            arr = self._arrays[name] = np.empty(max(n + n // 4, 1024), dtype=dtype)  # room for the next chunk's
        return arr[:n]
