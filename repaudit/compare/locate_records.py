"""What `repaudit locate` reads from the two cells' records (the .parquet next to each trace):
where each sequence's tokens fork, the lm_head's logits rows (through the records' row
digests), and which forward of its sequence computed a position."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ..record.floats import float_bits, ulp_distance_bits
from ..record.io import open_record
from ..record.tracefile import record_path


def dictionary_codes(table: pa.Table, name: str) -> tuple[np.ndarray, list[str]]:
    """A dictionary column as (codes, values), without building a string per row."""
    arr = table.column(name).combine_chunks()
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    return arr.indices.to_numpy(zero_copy_only=False).astype(np.int64), arr.dictionary.to_pylist()


LM_HEAD = "lm_head"
_RECORD_COLUMNS = ["prompt_id", "pos", "phase", "token_id", "logprob", "row_digest"]


def read_records(trace_a: Path, trace_b: Path) -> list[pa.Table]:
    """The two cells' records (the .parquet next to each trace), or [] where one is not there.
    Records of different models are refused: a trace does not name its model, its record does, and
    module outputs of two models differ from the embeddings on for a reason no kernel explains."""
    records = [record_path(t) for t in (trace_a, trace_b)]
    if not all(r.is_file() for r in records):
        return []
    opened = [open_record(r) for r in records]
    models = [_model(meta.model) for _, meta in opened]
    if models[0] != models[1]:
        (id_a, sha_a), (id_b, sha_b) = models
        what = f"{id_a} vs {id_b}" if id_a != id_b else f"{id_a}, weights sha256 {str(sha_a)[:12]} vs {str(sha_b)[:12]}"
        raise InputError(f"the traces are of different models ({what}); locate compares two cells of one model")
    tables = []
    for record, (pf, _) in zip(records, opened):
        try:
            tables.append(pf.read(columns=_RECORD_COLUMNS))
        except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
            raise InputError(f"{record}: unreadable record ({type(exc).__name__})") from None
    return tables


def _model(model: dict[str, Any]) -> tuple[Any, Any]:
    return model.get("id"), model.get("weights_sha256")


def _record_keys(records: list[pa.Table], prompts: dict[str, int], span: int):
    """Per record: (prompt * span + pos) of its rows of traced prompts, and those rows' indices."""
    out = []
    for table in records:
        codes, values = dictionary_codes(table, "prompt_id")
        prompt = np.array([prompts.get(v, -1) for v in values], dtype=np.int64)[codes]
        rows = np.flatnonzero(prompt >= 0)
        out.append((prompt[rows] * span + table.column("pos").to_numpy().astype(np.int64)[rows], rows))
    return out


def forks(records: list[pa.Table], prompts: dict[str, int], none: int) -> np.ndarray:
    """Per prompt (numbered as `prompts`), the first position whose token differs between the
    two cells' records, or `none` where no token differs or there are no records."""
    fork = np.full(len(prompts), none, dtype=np.int64)
    if not records:
        return fork
    (ka, ra), (kb, rb) = _record_keys(records, prompts, none)
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    tokens = [t.column("token_id").to_numpy() for t in records]
    flipped = common[tokens[0][ra[ia]] != tokens[1][rb[ib]]]
    np.minimum.at(fork, flipped // none, flipped % none)
    return fork


@dataclass
class HeadRows:
    prompt: np.ndarray  # per compared logits row: prompt number
    pos: np.ndarray  # the position whose logits these are (the record row's pos - 1)
    differ: np.ndarray
    max_ulp: int
    nan: int


def lm_head_rows(records: list[pa.Table], prompts: dict[str, int], fork: np.ndarray, max_pos: int) -> HeadRows | None:
    """The lm_head's output compared through the records' row digests: the record row at p holds
    the digest of the logits row of position p - 1. Rows of positions before the fork only (their
    inputs are the same); None without records or row digests."""
    if not records or any(t.column("row_digest").null_count for t in records):
        return None
    span = max_pos + 2
    (ka, ra), (kb, rb) = _record_keys(records, prompts, span)
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    ra, rb = ra[ia], rb[ib]
    prompt, pos = common // span, common % span - 1
    keep = (pos >= 0) & (pos < fork[prompt])
    prompt, pos, ra, rb = prompt[keep], pos[keep], ra[keep], rb[keep]
    (a, b) = (t.column("row_digest").to_numpy() for t in records)
    differ = a[ra] != b[rb]
    # The recorded token's logprob, where both cells recorded the same token.
    same_token = records[0].column("token_id").to_numpy()[ra] == records[1].column("token_id").to_numpy()[rb]
    both = differ & same_token
    max_ulp = nan = 0
    if both.any():
        bits = [float_bits(t.column("logprob").to_numpy()[r[both]]) for t, r in zip(records, (ra, rb))]
        u = ulp_distance_bits(*bits)
        max_ulp, nan = int(u.distance.max()), int(u.nan_vs_number.sum())
    return HeadRows(prompt, pos, differ, max_ulp, nan)


def forward_index(pos: np.ndarray, prompt: np.ndarray, records: list[pa.Table], prompts: dict[str, int],
                   cell: dict[str, Any]) -> np.ndarray:
    """Which forward of its sequence computed each output: a generate cell's prefill (0) runs the
    prompt's positions, decode step t the position prompt_len - 1 + t; a score cell runs one."""
    if cell.get("mode") != "generate" or not records:
        return np.zeros(len(pos), dtype=np.int64)
    table = records[0]
    codes, values = dictionary_codes(table, "prompt_id")
    number = np.array([prompts.get(v, -1) for v in values], dtype=np.int64)[codes]
    phase_codes, phases = dictionary_codes(table, "phase")
    generated = (phase_codes == phases.index("completion")) & (number >= 0) if "completion" in phases \
        else np.zeros(len(number), dtype=bool)
    prompt_len = np.full(len(prompts), 1 << 40, dtype=np.int64)
    np.minimum.at(prompt_len, number[generated], table.column("pos").to_numpy().astype(np.int64)[generated])
    return np.maximum(pos - (prompt_len[prompt] - 1), 0)
