"""A record's rows as numpy arrays, with each prompt's slice: what the report needs beyond the diff
(ULP distances row by row, the tokens around a divergence). Reports read whole records; the
streaming diff is what bounds memory for files too big to hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ..record.io import open_record

COLUMNS = ["prompt_id", "pos", "phase", "token_id", "logprob"]


@dataclass
class RecordArrays:
    prompts: dict[str, tuple[int, int]]  # prompt id -> [start, end) rows
    pos: np.ndarray  # int64
    phase: np.ndarray  # int8: 0 prompt, 1 completion
    token: np.ndarray  # int32
    bits: np.ndarray  # uint32 logprob bit patterns

    def rows(self, prompt_id: str) -> slice:
        start, end = self.prompts.get(prompt_id, (0, 0))
        return slice(start, end)

    @property
    def max_pos(self) -> int:
        return int(self.pos.max()) if len(self.pos) else 0


def read_arrays(path: Path) -> RecordArrays:
    pf, _ = open_record(path)
    try:
        table = pf.read(columns=COLUMNS)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: corrupt data: {str(exc).strip().splitlines()[0]}") from None
    ids = table.column("prompt_id").combine_chunks()
    if isinstance(ids.type, pa.DictionaryType):
        names = np.array(ids.dictionary.to_pylist(), dtype=object)[ids.indices.to_numpy(zero_copy_only=False)]
    else:
        names = np.array(ids.to_pylist(), dtype=object)
    phase = table.column("phase").combine_chunks()
    phase_names = np.array(phase.dictionary.to_pylist(), dtype=object)[phase.indices.to_numpy(zero_copy_only=False)]
    prompts: dict[str, tuple[int, int]] = {}
    if len(names):
        cut = np.flatnonzero(names[1:] != names[:-1]) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [len(names)]))
        for s, e in zip(starts, ends):
            prompts[str(names[s])] = (int(s), int(e))
    return RecordArrays(
        prompts=prompts,
        pos=table.column("pos").to_numpy().astype(np.int64),
        phase=(phase_names == "completion").astype(np.int8),
        token=table.column("token_id").to_numpy(),
        bits=table.column("logprob").to_numpy().view(np.uint32),
    )


class ArrayCache:
    """Each record read once per report."""

    def __init__(self) -> None:
        self._cache: dict[Path, RecordArrays] = {}

    def get(self, path: Path) -> RecordArrays:
        key = Path(path).resolve()
        if key not in self._cache:
            self._cache[key] = read_arrays(Path(path))
        return self._cache[key]
