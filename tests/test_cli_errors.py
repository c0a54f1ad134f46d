"""What a failure tells a CI job: bad input (exit 2) apart from a machine that failed (exit 5),
each as one line on stderr naming the path the user gave, never a hidden temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from repaudit import cli, files
from repaudit.errors import EXIT_ENVIRONMENT, EXIT_INPUT, os_error_exit_code


@pytest.fixture
def pair(make_record) -> tuple[Path, Path]:
    cols = dict(prompt_id=["p"] * 3, pos=np.arange(3), logprob=np.full(3, -1.0, np.float32))
    return make_record("a.parquet", **cols), make_record("b.parquet", **cols)


def main(capsys, *args) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err.strip().splitlines()


def _no_partial_files(directory: Path) -> bool:
    return not list(directory.glob(".*.tmp-*"))


def test_disk_full_is_the_machine_not_the_input(pair, tmp_path, capsys, monkeypatch):
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "result.json"
    rc, err = main(capsys, "diff", *pair, "--json", out)
    assert rc == EXIT_ENVIRONMENT == 5
    assert err == [f"repaudit: error: {os.strerror(errno.ENOSPC)}: {out}"]
    assert not out.exists() and _no_partial_files(tmp_path)


def test_read_only_file_system_names_the_file_asked_for(pair, tmp_path, capsys, monkeypatch):
    """open() of the temporary file is what fails on a read-only mount: the user hears of their own path."""
    real_open = open

    def read_only(path, *a, **kw):
        if ".tmp-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(files, "open", read_only, raising=False)
    out = tmp_path / "report.md"
    rc, err = main(capsys, "diff", *pair, "--markdown", out)
    assert rc == EXIT_ENVIRONMENT
    assert err == [f"repaudit: error: {os.strerror(errno.EROFS)}: {out}"]


@pytest.mark.parametrize("code", [errno.EIO, None])
def test_parquet_write_errors_name_the_file_not_its_temporary_name(tmp_path, monkeypatch, code):
    """pyarrow's errors name no file, only quote the one it was writing: the temporary one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def failing(table, where, **kw):
        raise OSError(*(() if code is None else (code,)), f"Failed to open local file '{where}'. Detail: I/O error")

    monkeypatch.setattr(pq, "write_table", failing)
    path = tmp_path / "x.trace.parquet"
    with pytest.raises(OSError) as failed:
        files.write_parquet_atomic(path, pa.table({"a": [1]}))
    assert failed.value.filename == str(path) and failed.value.errno == code
    assert ".tmp-" not in str(failed.value) and _no_partial_files(tmp_path)


def test_missing_input_stays_bad_input(pair, tmp_path, capsys):
    rc, err = main(capsys, "diff", tmp_path / "missing.parquet", pair[1])
    assert rc == EXIT_INPUT and len(err) == 1 and str(tmp_path / "missing.parquet") in err[0]
    rc, err = main(capsys, "diff", *pair, "--json", tmp_path / "no" / "such" / "dir" / "r.json")
    assert rc == EXIT_INPUT and err == [f"repaudit: error: directory {tmp_path / 'no' / 'such' / 'dir'} does not exist: "
                                        f"{tmp_path / 'no' / 'such' / 'dir' / 'r.json'}"]


@pytest.mark.parametrize("code, exit_code", [
    (errno.ENOENT, 2), (errno.ENOTDIR, 2), (errno.EISDIR, 2), (errno.EACCES, 2),
    (errno.ENOSPC, 5), (errno.EROFS, 5), (errno.EIO, 5), (errno.EDQUOT, 5), (errno.EMFILE, 5), (None, 5),
])
def test_os_errors_are_sorted_into_input_and_machine(code, exit_code):
    assert os_error_exit_code(OSError(code, "x")) == exit_code


def test_locate_on_run_directories_says_what_to_give(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "cells").mkdir(parents=True)
    for name in ("hf-tp1-bs1-default-stock-score", "hf-tp2-bs1-default-stock-score"):
        (run / "cells" / f"{name}.trace.parquet").write_bytes(b"")
    rc, err = main(capsys, "locate", run, run)
    assert rc == EXIT_INPUT
    assert err == [f"repaudit: error: {run} is a directory; locate compares two cells: give each one's record, "
                   "RUN/cells/CELL.parquet (traced cells there: hf-tp1-bs1-default-stock-score, "
                   "hf-tp2-bs1-default-stock-score)"]


@pytest.mark.parametrize("args", [("--clip", "0.5,,2.0"), ("--clip", ",0.5,2.0,"), ("--clip", "1_0,2_0")])
def test_a_malformed_list_is_bad_input_not_another_value(pair, capsys, args):
    """An empty item or a digit separator was read as the list without it ("0.5,,2.0" as 0.5,2.0)
    or as another number ("1_0" as 10)."""
    rc, err = main(capsys, "diff", *pair, *args)
    assert rc == EXIT_INPUT == 2
    assert len(err) == 1 and args[1] in err[0]


def test_run_refuses_a_trailing_comma_in_a_list(tmp_path, capsys):
    rc, err = main(capsys, "run", "--model", "builtin:tiny-qwen3", "--tp", "1,2,", "--out", tmp_path / "run")
    assert rc == EXIT_INPUT and len(err) == 1 and "--tp" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["command", "parsing"])
def test_ctrl_c_exits_130_wherever_it_lands(capsys, monkeypatch, pair, where):
    """Ctrl-C inside a command's body exits 130 (typer's answer); one that landed outside it,
    while typer parsed the arguments, exited 2, the code of bad input."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((cli.commands, "diff") if where == "command" else (cli, "app")), interrupted)
    rc, err = main(capsys, "diff", *pair)
    assert rc == 130 and err in ([], ["repaudit: error: interrupted"])
