"""repaudit: does this model, on this engine, give the same numbers when the deployment changes?

The Python API: write and read token records, diff two of them in memory.
"""

from .compare.diff import diff_records
from .compare.result import DiffResult, Thresholds
from .errors import InputError
from .record.io import RecordMeta, load_frame, read_meta, write_record

__version__ = "0.1.0"

__all__ = ["DiffResult", "InputError", "RecordMeta", "Thresholds", "diff_records", "load_frame", "read_meta", "write_record"]
