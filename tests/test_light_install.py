"""The light install: `pip install repaudit` (no extra) gives diff, gate, report and locate,
which must run without torch, triton, transformers or pandas; `repaudit run` asks for the
[run] extra in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from repaudit import commands, records
from repaudit.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "transformers", "pandas")
# A process in which the heavy packages cannot be imported, as on a core-only install.
LIGHT = ("import sys\n"
         f"for m in {HEAVY!r}:\n"
         "    sys.modules[m] = None\n"
         "from repaudit.cli import main\n"
         "sys.exit(main(sys.argv[1:]))\n")


def _light(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LIGHT, *args], cwd=cwd, capture_output=True, text=True,
                          env={"COLUMNS": "120", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=300)


def test_the_core_dependencies_leave_out_the_engines():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]}
    assert core == {"typer", "rich", "numpy", "pyarrow"}
    run = {d.split(">")[0] for d in project["optional-dependencies"]["run"]}
    assert set(HEAVY) <= run
    assert "repaudit[run]" in project["optional-dependencies"]["vllm"]


def _record(path: Path, shift: int) -> Path:
    n = 6
    lp = np.linspace(-3, -0.5, n, dtype=np.float32)
    lp[3] = np.nextafter(lp[3], np.float32(0)) if shift else lp[3]
    records.write_record(path, prompt_id=["p"] * n, pos=np.arange(1, n + 1), token_id=np.arange(10, 10 + n),
                                logprob=lp, cell={"id": path.stem}, env={}, probes={"name": "s", "sha256": "0"},
                                model={"id": "m"}, tokenizer={"name": "t", "sha256": "1"})
    return path


def test_diff_runs_without_the_heavy_packages(tmp_path):
    a, b, c = _record(tmp_path / "a.parquet", 0), _record(tmp_path / "b.parquet", 0), _record(tmp_path / "c.parquet", 1)
    same = _light("diff", str(a), str(b), "--json", str(tmp_path / "d.json"), cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]
    moved = _light("diff", str(a), str(c), cwd=tmp_path)
    assert moved.returncode == 1 and "1 of 6 logprobs differ" in moved.stdout, moved.stdout[-2000:]


@pytest.mark.slow
def test_gate_report_and_locate_run_without_the_heavy_packages(tmp_path):
    """On a traced CPU run (made with the full install), the light process gates it, writes its
    reports and locates the first divergent module."""
    from repaudit.run.plan import Matrix
    from repaudit.run.runner import RunOptions

    out = tmp_path / "run"
    matrix = Matrix(model="builtin:tiny-qwen3", device="cpu", dtype="float32", probes="smoke", tps=(1, 2),
                    batch_sizes=(1,), modes=("score",), trace=True)
    assert commands.run(matrix, RunOptions(out=out, cell_timeout=600, load_timeout=600)) == 0
    gate = _light("gate", str(out), cwd=tmp_path)
    assert gate.returncode == 1 and "hf-tp2-bs1-default-stock-score" in gate.stdout, gate.stdout[-2000:] + gate.stderr[-2000:]
    report = _light("report", str(out), cwd=tmp_path)
    assert report.returncode == 0 and (out / "report.html").stat().st_size > 0, report.stderr[-2000:]
    cells = out / "cells"
    located = _light("locate", str(cells / "hf-tp1-bs1-default-stock-score.parquet"),
                     str(cells / "hf-tp2-bs1-default-stock-score.parquet"), cwd=tmp_path)
    assert located.returncode == 1 and "first divergence" in located.stdout, located.stdout[-2000:] + located.stderr[-2000:]


def test_run_without_the_run_extra_asks_for_it_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(InputError) as err:
        commands.run(None, None)
    assert "pip install 'repaudit[run]'" in str(err.value) and "torch" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_the_core_alone_in_a_fresh_virtual_environment(tmp_path):
    """`pip install repaudit` as a fresh environment gets it, without the network: this checkout's
    wheel, plus exactly the distributions its core requirements name (read from the wheel's own
    metadata, markers evaluated, no extra), found installed here and linked in; then `repaudit
    diff` of two committed records, run by the new environment's interpreter."""
    import email.parser
    import importlib.metadata
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    with zipfile.ZipFile(next((tmp_path / "dist").glob("repaudit-*.whl"))) as whl:
        whl.extractall(site)
        metadata = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        wanted = email.parser.Parser().parsestr(whl.read(metadata).decode()).get_all("Requires-Dist")

    installed, todo = set(), [Requirement(r) for r in wanted]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in installed or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        installed.add(name)
        dist = importlib.metadata.distribution(req.name)
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists() and not top.startswith(".."):
                (site / top).symlink_to(source)
        todo += [Requirement(r) for r in dist.requires or ()]
    assert {"typer", "rich", "numpy", "pyarrow"} <= installed
    assert not installed & {"torch", "triton", "transformers", "pandas", "nvidia-cuda-runtime-cu12"}, installed

    python = venv / "bin" / "python"
    records = ROOT / "tests" / "data" / "records"
    env = {"COLUMNS": "120", "PATH": "/usr/bin:/bin"}
    diff = subprocess.run([str(python), "-m", "repaudit", "diff", str(records / "rollout.parquet"),
                           str(records / "trainer.parquet")], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)
    assert diff.returncode == 1 and "1 of 6 logprobs differ" in diff.stdout, diff.stdout[-2000:] + diff.stderr[-2000:]
    same = subprocess.run([str(python), "-m", "repaudit", "gate", str(records / "rollout.parquet"),
                           str(records / "rollout.parquet")], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    heavy = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True, env=env, timeout=60)
    assert heavy.returncode != 0 and "No module named 'torch'" in heavy.stderr
