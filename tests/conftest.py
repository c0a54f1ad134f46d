"""Fixtures shared by the test files. Keep this small, generic and cheap to import:
no torch, and the Triton interpreter only through the triton_interpreter fixture."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

# A fixed environment fingerprint: passing one stops write_record from importing torch to
# take the real one, and keeps records from two calls comparable field by field.
TEST_ENV: dict[str, Any] = {"repaudit": "test", "torch": "2.0.0", "cuda": None, "gpus": [], "vars": {}}
TEST_PROBES: dict[str, Any] = {"name": "unit", "sha256": "0" * 64}
TEST_MODEL: dict[str, Any] = {"id": "unit/model", "weights_sha256": None}
TEST_TOKENIZER: dict[str, Any] = {"name": "unit-tokenizer", "sha256": "1" * 64}


@pytest.fixture
def make_record(tmp_path: Path) -> Callable[..., Path]:
    """make_record(name, prompt_id=..., pos=..., logprob=..., **write_record_kwargs) -> path.

    Writes tmp_path/name with repaudit.records.write_record. token_id defaults to pos, the
    metadata (cell, env, probes, model, tokenizer) to fixed test values; any keyword of
    write_record overrides them. The cell id defaults to the file name's stem.
    """
    from repaudit.records import write_record

    def make(name: str = "a.parquet", **kw: Any) -> Path:
        path = tmp_path / name
        kw.setdefault("token_id", kw["pos"])
        kw.setdefault("cell", {"id": path.stem})
        kw.setdefault("env", dict(TEST_ENV))
        kw.setdefault("probes", dict(TEST_PROBES))
        kw.setdefault("model", dict(TEST_MODEL))
        kw.setdefault("tokenizer", dict(TEST_TOKENIZER))
        write_record(path, **kw)
        return path

    return make


@pytest.fixture(scope="session", autouse=True)
def _repaudit_cache(tmp_path_factory) -> None:
    """Built-in models are made once per test session in a temporary cache (never in ~/.cache),
    unless REPAUDIT_CACHE is already set."""
    import os

    if not os.environ.get("REPAUDIT_CACHE"):
        os.environ["REPAUDIT_CACHE"] = str(tmp_path_factory.mktemp("repaudit-cache"))


@pytest.fixture(scope="module")
def triton_interpreter():
    """tbik's Triton kernels in Triton's CPU interpreter for one test module (use it with
    `pytestmark = pytest.mark.usefixtures("triton_interpreter")`); off again after."""
    import tbik

    tbik.use_interpreter(True)
    yield
    tbik.use_interpreter(False)


@pytest.fixture
def interpreted_case():
    """Run one case of a tests/interpreted/*_cases.py file in a process of its own with Triton's
    CPU interpreter on from the start (TRITON_INTERPRET must be set before triton is imported);
    returns the finished process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def run(cases: Path, case: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(root), str(root / "kernels"), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([sys.executable, str(cases), case], env=env, capture_output=True, text=True, timeout=600)

    return run
