"""Kernel modes on the transformers engine, on CPU with gloo (tbik's CPU backend).

The acceptance of the kernel-modes issue: on both built-in models, TP 1,2,4 x batch sizes
1,3,8, score and generate, every tbik cell is bitwise identical to every other tbik cell,
while the stock cells are not all identical.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from repaudit import commands
from repaudit.diff import diff_records
from repaudit.run.jobspec import cell_path
from repaudit.records import load_frame
from repaudit.run.plan import Matrix
from repaudit.run.runner import RunOptions

pytestmark = pytest.mark.slow

TPS, BATCHES, MODES = (1, 2, 4), (1, 3, 8), ("generate", "score")


def _run(out: Path, model: str, kernels: tuple[str, ...], **kw) -> int:
    matrix = Matrix(model=model, device="cpu", dtype="float32", probes="smoke", kernels=kernels,
                    **{"tps": TPS, "batch_sizes": BATCHES, "modes": MODES, **kw})
    return commands.run(matrix, RunOptions(out=out, cell_timeout=900, load_timeout=600))


@pytest.fixture(scope="module", params=["builtin:tiny-qwen3", "builtin:tiny-llama"])
def runs(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(request.param.split(":")[1])
    out = {"model": request.param}
    for kernels, expect in (("tbik", 0), ("stock", 0)):
        out[kernels] = root / kernels
        assert _run(out[kernels], request.param, (kernels,)) == expect
    return out


def _bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def _cells(run: Path, kernels: str) -> list[str]:
    return [f"hf-tp{tp}-bs{bs}-default-{kernels}-{mode}" for tp, bs, mode in itertools.product(TPS, BATCHES, MODES)]


def test_every_tbik_cell_is_bitwise_identical_to_every_other(runs):
    cells = _cells(runs["tbik"], "tbik")
    for mode in MODES:
        same = [cid for cid in cells if cid.endswith(mode)]
        first = cell_path(runs["tbik"], same[0])
        for cid in same[1:]:
            r = diff_records(first, cell_path(runs["tbik"], cid))
            assert r.identical and r.passed and r.comparable > 0, (cid, r.reasons)
            assert r.digest_equal == r.digest_compared > 0
    # Decode steps against one teacher-forced prefill: a score cell's completion rows are the
    # generate cell's rows, bit for bit (a generate cell records the generated tokens only).
    gen = load_frame(cell_path(runs["tbik"], cells[0])).sort_values(["prompt_id", "pos"]).reset_index(drop=True)
    for cid in [c for c in cells if c.endswith("score")]:
        scored = load_frame(cell_path(runs["tbik"], cid))
        done = scored[scored["phase"] == "completion"].sort_values(["prompt_id", "pos"]).reset_index(drop=True)
        assert len(done) == len(gen) > 0
        for col in ("prompt_id", "pos", "token_id", "top1_id", "row_digest"):
            assert done[col].astype(str).tolist() == gen[col].astype(str).tolist(), (cid, col)
        assert np.array_equal(_bits(done["logprob"]), _bits(gen["logprob"])), cid
        assert np.array_equal(_bits(np.stack(done["topk_logprobs"])), _bits(np.stack(gen["topk_logprobs"]))), cid
    summary = json.loads((runs["tbik"] / "summary.json").read_text())
    assert summary["passed"] and summary["identical_cells"] == summary["compared_cells"] == len(cells) - 2


def test_stock_cells_are_not_all_identical(runs):
    summary = json.loads((runs["stock"] / "summary.json").read_text())
    assert not summary["passed"]
    diverged = [r["cell"] for r in summary["cells"] if r.get("identical") is False]
    assert any("-tp2-" in c for c in diverged) and any("-tp4-" in c for c in diverged)


def test_switching_kernels_in_one_job_leaves_stock_untouched(runs, tmp_path):
    """A stock cell that runs after a tbik cell in the same process gives a stock-only job's bits."""
    mixed = tmp_path / "mixed"
    assert _run(mixed, runs["model"], ("tbik", "stock"), tps=(1,), batch_sizes=(3,), modes=("generate",)) == 0
    cid = "hf-tp1-bs3-default-stock-generate"
    manifest = json.loads((mixed / "manifest.json").read_text())
    assert list(manifest["cells"]) == ["hf-tp1-bs3-default-tbik-generate", cid]  # tbik ran first
    assert diff_records(cell_path(mixed, cid), cell_path(runs["stock"], cid)).identical
