"""The diff's public names at the import path the Python API documents
(`from repaudit.diff import diff_records`); the code is in repaudit.compare."""

from .compare.diff import diff_records, verdict
from .compare.result import (DEFAULT_CLIP, DiffResult, PromptDiff, RLMetrics, Thresholds, cell_differences, comparability,
                             json_float)

__all__ = ["DEFAULT_CLIP", "DiffResult", "PromptDiff", "RLMetrics", "Thresholds", "cell_differences", "comparability",
           "diff_records", "json_float", "verdict"]
