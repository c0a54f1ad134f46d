"""Short cell labels for tables: only the settings that vary among the cells shown."""

from __future__ import annotations

from typing import Any

from ..run.plan import CELL_SETTINGS, Cell


def short_labels(settings: dict[str, dict[str, Any]], dims: tuple[str, ...] = CELL_SETTINGS) -> dict[str, str]:
    """Label each cell with only the settings that vary among the given cells ("tp2 bs4")."""
    vary = [d for d in dims if len({str(s.get(d)) for s in settings.values()}) > 1]
    out = {}
    for cid, s in settings.items():
        parts = []
        for d in vary:
            v = s.get(d)
            parts.append({"tp": f"tp{v}", "batch_size": f"bs{v}"}.get(d, f"nccl={v}" if d == "nccl" else str(v)))
        out[cid] = " ".join(parts) or cid
    return out


def cell_settings(cell: Cell) -> dict[str, Any]:
    return {d: getattr(cell, d) for d in CELL_SETTINGS}
