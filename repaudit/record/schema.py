"""Record format, schema version 1: the Arrow schema and the file-level metadata keys.

docs/format.md is the human-readable copy of this module; keep them in step.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("phase", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("logprob", pa.float32(), nullable=False),
        # The most likely token at pos: the lowest id holding the row's largest logprob (two logits
        # can round to one logprob, so a greedy token_id, the logits' argmax, may be a higher
        # id), -1 when not recorded.
        # Redundant with topk_ids[0] when k > 0, but a flat column reads ~4x faster than a list
        # column and keeps top-1 agreement available when top-k is off (k = 0).
        pa.field("top1_id", pa.int32(), nullable=False),
        pa.field("topk_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("topk_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("row_digest", pa.uint64(), nullable=True),
    ]
)

PHASES = ("prompt", "completion")

# File metadata keys. Every value is a UTF-8 JSON document except the schema version.
KEY_VERSION = "repaudit.schema_version"
KEY_CELL = "repaudit.cell"  # object: the cell's settings; "id" is required
KEY_ENV = "repaudit.env"  # object: environment fingerprint (see fingerprint.py)
KEY_PROBES = "repaudit.probes"  # object: {"name", "sha256"}
KEY_MODEL = "repaudit.model"  # object: {"id", "weights_sha256" (or null)}
KEY_TOKENIZER = "repaudit.tokenizer"  # object: {"name", "sha256"}
KEY_PROMPTS = "repaudit.prompts"  # array of the prompt ids present, sorted
KEY_TOPK = "repaudit.topk"  # integer k (0 = top-k columns hold empty lists)
KEY_PHASES = "repaudit.phases"  # optional: array of the phases present, sorted (absent in older records)

REQUIRED_KEYS = (KEY_CELL, KEY_ENV, KEY_PROBES, KEY_MODEL, KEY_TOKENIZER, KEY_PROMPTS, KEY_TOPK)

# Row groups of this many rows bound the memory of a streaming reader.
ROW_GROUP_ROWS = 1 << 20
