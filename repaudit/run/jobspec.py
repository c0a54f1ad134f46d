"""The contract between the launcher and a launch group's workers, passed as a JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptSpec:
    id: str
    tokens: list[int]
    completion: list[int] | None  # from the probe line; None means "use the reference"
    max_new_tokens: int


@dataclass
class JobSpec:
    group_id: str
    engine: str
    model_path: str
    dtype: str
    device: str
    tp: int
    out_dir: str  # run directory; records go to out_dir/cells/<cell>.parquet
    events_dir: str
    cells: list[dict[str, Any]]  # full cell settings, each with "id", in run order
    prompts: list[PromptSpec]
    stop_ids: list[int]  # a generation ends at the first of these (run.model.stop_ids)
    pad_id: int
    topk: int
    reference_cell: str | None  # cell whose greedy completions score cells use
    probes: dict[str, Any]
    tokenizer: dict[str, Any]
    model: dict[str, Any]
    cpu_threads: int = 1
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        raw = json.loads(Path(path).read_text())
        raw["prompts"] = [PromptSpec(**p) for p in raw["prompts"]]
        return cls(**raw)


def cell_path(out_dir: str | Path, cell_id: str) -> Path:
    return Path(out_dir) / "cells" / f"{cell_id}.parquet"
