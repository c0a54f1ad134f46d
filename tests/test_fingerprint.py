"""The fingerprint's per-rank switches: every rank's own values reach the record, and `repaudit
diff` lists the ones that differ, in its text and its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repaudit import cli
from repaudit.record.fingerprint import differences, settings
from repaudit.run.jobspec import cell_path
from repaudit.records import read_meta

RANK = {"gpu": "H100", "driver": "550.1", "nccl": "2.21.5", "tf32_matmul": False, "deterministic_algorithms": False,
        "cublas_workspace_config": None, "torch_threads": 1}
TOP = {"torch": "2.9", "driver": "550.1", "nccl": "2.21.5", "gpus": ["H100", "H100"], "torch_threads": 1, "vars": {}}


def test_settings_collapse_where_ranks_agree_and_list_where_they_do_not():
    env = {**TOP, "ranks": [RANK, {**RANK, "tf32_matmul": True}]}
    got = settings(env)
    assert got["tf32_matmul"] == [False, True] and got["gpu"] == "H100" and got["cublas_workspace_config"] is None
    assert settings({**TOP, "ranks": [RANK]}) == settings({**TOP, "ranks": [RANK, RANK]})  # TP=1 vs TP=2: same
    assert settings(TOP) == {}


def test_differences_name_each_switch_once():
    a = {**TOP, "ranks": [RANK, RANK]}
    b = {**TOP, "nccl": "2.27.3", "ranks": [{**RANK, "nccl": "2.27.3"},
                                           {**RANK, "nccl": "2.27.3", "deterministic_algorithms": True}]}
    assert differences(a, b) == [("nccl", "2.21.5", "2.27.3"), ("deterministic_algorithms", False, [False, True])]
    # A record without per-rank settings (older, or another tool's) is compared on the rest only.
    assert differences(TOP, b) == [("nccl", "2.21.5", "2.27.3")]


# Rank 1 of every job turns TF32 and deterministic algorithms on before the worker starts, as a
# library imported on one rank might: the record must say so for that rank.
SITECUSTOMIZE = textwrap.dedent('''
    import os
    if os.environ.get("RANK") == "1" and os.environ.get("REPAUDIT_TEST_FLIP") == "1":
        import torch
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.use_deterministic_algorithms(True, warn_only=True)
''')


@pytest.mark.slow
def test_every_ranks_switches_reach_the_record_and_the_diff(tmp_path: Path, capsys):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "REPAUDIT_TEST_FLIP": "1"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "repaudit", "run", "--tp", "1,2", "--batch-size", "1", "--mode", "generate", "--kernels", "stock",
                           "--probes", "smoke", "--max-new-tokens", "2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = cell_path(out, "hf-tp1-bs1-default-stock-generate"), cell_path(out, "hf-tp2-bs1-default-stock-generate")
    ranks = read_meta(b).env["ranks"]
    assert [r["tf32_matmul"] for r in ranks] == [False, True]
    assert [r["deterministic_algorithms"] for r in ranks] == [False, True]
    assert len(read_meta(a).env["ranks"]) == 1
    js = tmp_path / "diff.json"
    capsys.readouterr()
    cli.main(["diff", str(a), str(b), "--json", str(js)])
    text = " ".join(capsys.readouterr().out.split())
    assert "tf32_matmul False → [False, True]" in text
    assert "deterministic_algorithms False → [False, True]" in text
    got = json.loads(js.read_text())["environment_differences"]
    assert ["tf32_matmul", False, [False, True]] in got and ["deterministic_algorithms", False, [False, True]] in got
