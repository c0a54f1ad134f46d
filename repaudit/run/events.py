"""Worker -> launcher events: one JSON object per line, one file per rank, append-only.

A worker can be killed at any instant, so events are its only testament: each line is
written with a single write() and flushed, and readers skip a torn last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from ..units import rate_text, seconds_text


class EventWriter:
    def __init__(self, directory: Path, rank: int):
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.directory = directory
        self.rank = rank

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "rank": self.rank, "t": time.time(), **fields}, allow_nan=False) + "\n"
        os.write(self._fd, line.encode())


class EventReader:
    """Tails every rank file in a directory; yields only complete lines."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._offsets: dict[Path, int] = {}

    def poll(self) -> Iterator[dict[str, Any]]:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("rank*.jsonl")):
            with open(path, "rb") as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def done_line(cell: str, event: dict[str, Any]) -> str:
    """The console's line for a cell_done event: its seconds and its tokens/s (generated tokens for
    generate, prefill tokens for score), a slow rate with two significant digits, not 0."""
    t = event["timing"]
    rate = t.get("generated_tokens_per_s") or t.get("prefill_tokens_per_s")
    return f"[green]done[/] {cell}  {seconds_text(event['seconds'])}s" + (f"  {rate_text(rate)} tok/s" if rate else "")
