"""The Python-API example in docs/rl.md runs as written and prints what it says it prints."""

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "rl.md"


def test_rl_doc_example_runs_and_its_output_comment_is_true(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 14  # "a dozen lines"
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    promised = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    assert out.getvalue().strip() == promised
    assert (tmp_path / "trainer.parquet").exists() and (tmp_path / "rollout.parquet").exists()
