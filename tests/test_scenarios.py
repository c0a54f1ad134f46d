"""Scenarios of vLLM cells (`--scenario`): the plan's cells, launch groups and references, the
combinations refused and how a run, its summary, the gate and JUnit show them, the engine
arguments of each scenario, and the price list's scenario rows. CPU only, no vLLM."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from lxml import etree
from rich.console import Console

from conftest import TEST_ENV, TEST_MODEL, TEST_PROBES, TEST_TOKENIZER
from repaudit import cli
from repaudit.engines import vllm_engine
from repaudit.errors import InputError
from repaudit.records import write_record
from repaudit.run.plan import (Cell, Matrix, expand, plan_from_manifest, reference_delta, reference_pairs)

XSD = Path(__file__).parent / "data" / "junit.xsd"
ALL = ("cold", "prefix-hit", "chunked-prefill:256", "eager", "fp8-kv", "spec-ngram")


def vllm_matrix(**kw) -> Matrix:
    base = dict(model="m", engines=("vllm",), tps=(1,), batch_sizes=(1, 8), kernels=("stock",), device="cuda",
                scenarios=ALL)
    return Matrix(**{**base, **kw})


# ------------------------------------------------------------------------------ the plan


def test_each_scenario_is_a_vllm_job_of_its_own_and_its_cells_name_it():
    plan = expand(vllm_matrix())
    assert [g.id for g in plan.groups] == [
        "vllm-tp1-default-stock", "vllm-tp1-default-stock-prefix-hit", "vllm-tp1-default-stock-chunked-prefill256",
        "vllm-tp1-default-stock-eager", "vllm-tp1-default-stock-fp8-kv", "vllm-tp1-default-stock-spec-ngram"]
    for g in plan.groups:
        assert len({c.scenario for c in g.cells}) == 1 and all(c.group_key == g.cells[0].group_key for c in g.cells)
    # cold keeps today's ids (records of earlier runs resume); no ':' in a file name
    assert plan.baseline.id == "vllm-tp1-bs1-default-stock-generate"
    assert plan.cell("vllm-tp1-bs8-default-stock-chunked-prefill256-score").scenario == "chunked-prefill:256"
    assert plan.cell("vllm-tp1-bs8-default-stock-prefix-hit-generate").scenario == "prefix-hit"
    assert not any(":" in c.id for c in plan.cells)
    assert len(plan.cells) == 6 * 2 * 2 - 2  # prefix-hit has no score cells (refused below)


def test_a_scenario_cell_is_compared_with_its_cold_twin():
    plan = expand(vllm_matrix(kernels=("stock", "tbik"), tps=(1, 2)))
    pairs = dict(reference_pairs(plan))
    for cell, ref in pairs.items():
        if cell.scenario == "cold":
            assert ref == plan.reference_for(cell) and ref.tp == 1 and ref.batch_size == 1 and ref.scenario == "cold"
        else:
            assert ref == Cell(cell.engine, cell.tp, cell.batch_size, cell.nccl, cell.kernels, cell.mode, "cold")
            assert ref in plan.cells and reference_delta(cell, ref) == "scenario=cold"
    eager = plan.cell("vllm-tp2-bs8-default-tbik-eager-generate")
    assert pairs[eager].id == "vllm-tp2-bs8-default-tbik-generate"


def test_refused_combinations_are_kept_with_their_reason_and_never_launched():
    plan = expand(vllm_matrix(kernels=("stock", "tbik")))
    refused = {c.id: why for c, why in plan.refused}
    assert set(refused) == {f"vllm-tp1-bs{bs}-default-{k}-prefix-hit-score" for bs in (1, 8) for k in ("stock", "tbik")} | {
        f"vllm-tp1-bs{bs}-default-tbik-fp8-kv-{m}" for bs in (1, 8) for m in ("generate", "score")}
    assert "prompt logprobs" in refused["vllm-tp1-bs1-default-stock-prefix-hit-score"]
    assert "model's dtype" in refused["vllm-tp1-bs8-default-tbik-fp8-kv-generate"]
    launched = {c.id for g in plan.groups for c in g.cells}
    assert not set(refused) & launched and launched == {c.id for c in plan.cells}
    assert "vllm-tp1-default-tbik-fp8-kv" not in {g.id for g in plan.groups}
    notes = [n for n in plan.notes if "refused" in n]
    assert len(notes) == 2 and notes[1].startswith("4 cell(s) refused, not run (fp8-kv with tbik generate; fp8-kv with tbik score)")


def test_cold_is_added_first_and_transformers_cells_stay_cold():
    plan = expand(Matrix(model="m", engines=("hf", "vllm"), tps=(1,), batch_sizes=(1,), modes=("generate",), device="cuda",
                         scenarios=("eager",)))
    assert plan.matrix.scenarios == ("cold", "eager")
    assert {c.scenario for c in plan.cells if c.engine == "hf"} == {"cold"}
    assert {c.scenario for c in plan.cells if c.engine == "vllm"} == {"cold", "eager"}
    assert any(n.startswith("scenario cold added") for n in plan.notes)
    assert any(n.startswith("hf: scenario eager applies to vLLM cells only") for n in plan.notes)
    # names are canonical: a chunk written with a leading zero is the same scenario
    plan = expand(vllm_matrix(scenarios=("chunked-prefill:0256",)))
    assert plan.matrix.scenarios == ("cold", "chunked-prefill:256")


@pytest.mark.parametrize("kwargs, words", [
    (dict(scenarios=("warm",)), "--scenario 'warm': expected names among cold, prefix-hit, eager, fp8-kv, spec-ngram, "
                                "chunked-prefill:N"),
    (dict(scenarios=("chunked-prefill",)), "expected names among"),
    (dict(scenarios=("chunked-prefill:0",)), "needs N, the prefill chunk in tokens, a positive integer"),
    (dict(scenarios=("chunked-prefill:big",)), "needs N"),
    (dict(scenarios=("eager:1",)), "expected names among"),
    (dict(scenarios=("eager", "eager")), "--scenario lists a value twice"),
    (dict(scenarios=()), "--scenario is empty"),
    (dict(engines=("hf",)), "scenarios other than cold are for --engine vllm"),
    (dict(scenarios=("chunked-prefill:4",)), "at least the largest --batch-size (8)"),
    (dict(baseline="vllm-tp1-bs1-default-stock-eager"), "the baseline is a cold cell"),
])
def test_bad_scenarios_are_refused_in_one_line(kwargs, words):
    with pytest.raises(InputError) as exc:
        expand(vllm_matrix(**kwargs))
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_the_command_line_refuses_a_bad_scenario_with_exit_2(tmp_path, capsys):
    for args, words in ((["--scenario", "warm"], "--scenario 'warm'"),
                        (["--scenario", "prefix-hit"], "scenarios other than cold are for --engine vllm")):
        rc = cli.main(["run", "--engine", "hf", "--out", str(tmp_path / "r"), *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "r").exists()


def test_the_manifest_keeps_the_scenarios_and_an_old_one_means_cold():
    m = expand(vllm_matrix()).matrix
    data = json.loads(json.dumps(m.to_manifest()))
    assert data["scenario"] == list(ALL)
    assert Matrix.from_manifest(data, "m", None) == m
    del data["scenario"]
    assert Matrix.from_manifest(data, "m", None).scenarios == ("cold",)
    rebuilt = plan_from_manifest(SimpleNamespace(matrix=m.to_manifest(), model={"id": "m"}, baseline=None, reference_cell=None))
    assert rebuilt.cells == expand(m).cells and rebuilt.refused == expand(m).refused


# ------------------------------------------------------------------------------ vLLM's engine arguments


def test_each_scenario_sets_its_engine_arguments_and_vllm_args_have_the_last_word():
    common = dict(model_path="/m", tp=1, dtype="bfloat16", batch_size=8, max_len=300, topk=5)
    cold = vllm_engine.engine_args(**common)
    assert cold == vllm_engine.engine_args(**common, scenario="cold") and cold["enable_prefix_caching"] is False
    want = {"prefix-hit": {"enable_prefix_caching": True},
            "chunked-prefill:256": {"enable_chunked_prefill": True, "max_num_batched_tokens": 256},
            "eager": {"enforce_eager": True}, "fp8-kv": {"kv_cache_dtype": "fp8"},
            "spec-ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}}}
    for scenario, changed in want.items():
        args = vllm_engine.engine_args(**common, scenario=scenario)
        # one thing changed at a time: everything else is the cold cell's
        assert {k: v for k, v in args.items() if cold.get(k) != v} == changed, scenario
    tbik = vllm_engine.engine_args(**common, kernels="tbik", scenario="eager")
    assert tbik["enforce_eager"] is True and tbik["attention_backend"] == "FLASH_ATTN"
    off = vllm_engine.engine_args(**common, scenario="prefix-hit", extra={"enable_prefix_caching": False})
    assert off["enable_prefix_caching"] is False
    spec = vllm_engine.engine_args(**common, scenario="spec-ngram")
    spec["speculative_config"]["num_speculative_tokens"] = 9  # a cell's arguments never change the table
    assert vllm_engine.SCENARIO_ARGS["spec-ngram"]["speculative_config"]["num_speculative_tokens"] == 4
    with pytest.raises(ValueError):
        vllm_engine.scenario_args("chunked-prefill:0")
    assert "vllm" not in sys.modules  # building arguments never imports vLLM


def test_a_scenario_cells_settings_name_it_and_a_cold_cells_are_as_before():
    from repaudit.run.runner import cell_settings

    plan = expand(vllm_matrix())
    ref, suite = SimpleNamespace(id="m"), SimpleNamespace(name="s", sha256="0")
    cold = cell_settings(plan.cell("vllm-tp1-bs1-default-stock-generate"), plan, ref, suite)
    hit = cell_settings(plan.cell("vllm-tp1-bs1-default-stock-prefix-hit-generate"), plan, ref, suite)
    assert "scenario" not in cold and hit["scenario"] == "prefix-hit"
    assert {k: v for k, v in hit.items() if cold.get(k) != v} == {"id": hit["id"], "scenario": "prefix-hit"}


def test_refused_cells_are_marked_in_the_manifest_with_their_reason(tmp_path):
    from repaudit.run.rundir import Manifest
    from repaudit.run.runner import mark_refused

    plan = expand(vllm_matrix(kernels=("tbik",), scenarios=("fp8-kv",)))
    manifest = Manifest(tmp_path / "manifest.json")
    manifest.cell("vllm-tp1-bs1-default-tbik-fp8-kv-generate").update(status="failed", seconds=3.0)
    mark_refused(manifest, plan, SimpleNamespace(id="m"), SimpleNamespace(name="s", sha256="0"), None)
    entries = {cid: e for cid, e in manifest.data.cells.items()}
    assert set(entries) == {c.id for c, _ in plan.refused} and len(entries) == 4
    e = entries["vllm-tp1-bs1-default-tbik-fp8-kv-generate"]
    assert e["status"] == "refused" and "model's dtype" in e["reason"] and "seconds" not in e
    assert e["settings"]["scenario"] == "fp8-kv"


# ------------------------------------------------------------------------------ a run directory


def _record(path: Path, cid: str, shift: int = 0) -> None:
    n = 4
    bits = (np.uint32(0xC0200000) + np.arange(n, dtype=np.uint32) + np.uint32(shift)).view(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_record(path, prompt_id=["p"] * n, pos=np.arange(1, n + 1), token_id=np.arange(10, 10 + n), logprob=bits,
                 cell={"id": cid}, env=dict(TEST_ENV), probes=dict(TEST_PROBES), model=dict(TEST_MODEL),
                 tokenizer=dict(TEST_TOKENIZER))


def _scenario_run(root: Path) -> Path:
    """A finished `--engine vllm --batch-size 1,4 --scenario prefix-hit` run: the bs4 prefix-hit cell's
    logprobs differ from its cold twin's by one ULP; prefix-hit score cells were refused."""
    matrix = vllm_matrix(batch_sizes=(1, 4), scenarios=("prefix-hit",), topk=0)
    plan = expand(matrix)
    run = root / "run"
    cells = {}
    rates = {"vllm-tp1-bs4-default-stock-generate": 100.0, "vllm-tp1-bs4-default-stock-prefix-hit-generate": 150.0}
    for c in plan.cells:
        _record(run / "cells" / f"{c.id}.parquet", c.id, shift=int(c.id == "vllm-tp1-bs4-default-stock-prefix-hit-generate"))
        key = "generated_tokens_per_s" if c.mode == "generate" else "prefill_tokens_per_s"
        cells[c.id] = {"status": "done", "reason": None, "seconds": 1.0, "timing": {key: rates.get(c.id, 50.0)}}
    for c, reason in plan.refused:
        cells[c.id] = {"status": "refused", "reason": reason}
    manifest = {"manifest_version": 1, "matrix": matrix.to_manifest(), "baseline": plan.baseline.id, "reference_cell": None,
                "model": {"id": "m"}, "probes": dict(TEST_PROBES), "tokenizer": dict(TEST_TOKENIZER), "cells": cells,
                "command": ["repaudit", "run"], "wall_s": 10.0}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_the_gate_pairs_scenario_cells_with_their_cold_twins_and_lists_the_refused(tmp_path, capsys):
    run = _scenario_run(tmp_path)
    junit = tmp_path / "junit.xml"
    rc = cli.main(["gate", str(run), "--junit", str(junit), "--max-ulp", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out  # the refused cells neither pass nor fail
    assert "refused, not run: vllm-tp1-bs1-default-stock-prefix-hit-score: vLLM never reads the prefix cache" in out
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    doc = etree.parse(str(junit))
    assert schema.validate(doc), schema.error_log
    suite = doc.getroot().find("testsuite")
    assert suite.get("skipped") == "2" and suite.get("failures") == "0"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert "vllm-tp1-bs4-default-stock-prefix-hit-generate vs vllm-tp1-bs4-default-stock-generate" in cases
    skipped = cases["vllm-tp1-bs4-default-stock-prefix-hit-score"].find("skipped")
    assert skipped.get("type") == "refused" and "prompt logprobs" in skipped.get("message")
    assert cli.main(["gate", str(run)]) == 1  # strict: the one-ULP prefix-hit cell fails
    assert "FAIL vllm-tp1-bs4-default-stock-prefix-hit-generate vs vllm-tp1-bs4-default-stock-generate" in capsys.readouterr().out


def test_the_summary_shows_refused_cells_and_each_scenarios_price(tmp_path):
    from repaudit.compare.gate import load_run
    from repaudit.compare.result import Thresholds
    from repaudit.compare.summary import print_summary, summarize, summary_markdown
    from repaudit.run.rundir import Manifest

    run_dir = _scenario_run(tmp_path)
    summary = summarize(load_run(run_dir).plan, run_dir, Manifest.load_or_new(run_dir), Thresholds())
    rows = {r["cell"]: r for r in summary["cells"]}
    refused = rows["vllm-tp1-bs4-default-stock-prefix-hit-score"]
    assert refused["status"] == "refused" and "prompt logprobs" in refused["reason"] and "identical" not in refused
    assert refused["reference"] == "vllm-tp1-bs4-default-stock-score" and summary["refused_cells"] == 2
    hit = rows["vllm-tp1-bs4-default-stock-prefix-hit-generate"]
    assert hit["reference_delta"] == "scenario=cold" and hit["identical"] is False and hit["ulp_max"] == 1
    stock, scenario = summary["price"]
    assert (stock["kernels"], stock["compared"], stock["identical"]) == ("stock", 2, 2)  # cold cells only
    assert (scenario["scenario"], scenario["kernels"], scenario["identical"], scenario["compared"]) == ("prefix-hit", "stock", 1, 2)
    assert scenario["speed_pairs"] == 2 and scenario["speed_vs_cold"] == pytest.approx(math.sqrt(1.5))
    md = summary_markdown(summary)
    assert "| prefix-hit | stock | 1/2 | 1.22x (2 cells) |" in md
    assert "- `vllm-tp1-bs1-default-stock-prefix-hit-score`: vLLM never reads the prefix cache" in md
    out = io.StringIO()
    print_summary(summary, Console(file=out, width=80))
    text = out.getvalue()
    assert "stock, prefix-hit, generate: each cell vs its reference" in text
    assert "refused, not run: 2 cell(s): vLLM never reads the prefix cache" in text
    assert text.splitlines()[-1] == ("prefix-hit (stock): 1 of 2 cells bitwise identical to their cold twin, "
                                     "at 1.22x cold's tokens/s (2 cells)")


def test_the_report_has_a_tile_per_scenario_and_notes_the_refused(tmp_path):
    from repaudit.compare.gate import load_run
    from repaudit.compare.result import Thresholds
    from repaudit.report.build import build_run
    from repaudit.report.headline import price_tiles

    data = build_run(load_run(_scenario_run(tmp_path)), Thresholds())
    (tile,) = price_tiles(data)  # stock against itself has no tile
    assert (tile.label, tile.value, tile.tone) == ("prefix-hit (stock): speed vs cold", "1.22x", "fail")
    assert tile.detail == "tokens/s over 2 cells · keeps 1/2 identical"
    assert any(n.startswith("Refused, not run: vllm-tp1-bs4-default-stock-prefix-hit-score: vLLM never") for n in data.notes)
    labels = {c.id: c.label for c in data.cells}
    assert labels["vllm-tp1-bs4-default-stock-prefix-hit-generate"] != labels["vllm-tp1-bs4-default-stock-generate"]
