"""Writing and reading token records, at the import path the Python API documents
(`from repaudit.records import write_record`); the code is in repaudit.record.io."""

from .record.io import RecordMeta, build_table, iter_batches, load_frame, open_record, read_meta, write_record, write_table

__all__ = ["RecordMeta", "build_table", "iter_batches", "load_frame", "open_record", "read_meta", "write_record", "write_table"]
