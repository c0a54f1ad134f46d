"""`repaudit gate` on synthetic run directories and record pairs: the cell -> reference mapping,
exit codes, failed and missing cells, thresholds, and JUnit XML validated against the schema CI
systems read (tests/data/junit.xsd)."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest
from lxml import etree

from conftest import TEST_ENV, TEST_MODEL, TEST_PROBES, TEST_TOKENIZER
from repaudit import cli
from repaudit.diff import Thresholds
from repaudit.records import write_record

XSD = Path(__file__).parent / "data" / "junit.xsd"
PROMPTS = ("p0", "p1", "p2")
LENGTH = 5
BASE = 0xC0200000  # -2.5
REF = "hf-tp1-bs1-default-stock-score"
CELLS = (REF, "hf-tp1-bs4-default-stock-score", "hf-tp2-bs1-default-stock-score", "hf-tp2-bs4-default-stock-score")


def columns(bits=None, tokens=None, prompts=PROMPTS, topk=None, digests=True):
    """topk: None for no top-k lists, else {(prompt, pos): bits} overrides of each row's second top-2 logprob."""
    ids, pos, tok, lp, second = [], [], [], [], []
    for p in prompts:
        for i in range(LENGTH):
            ids.append(p)
            pos.append(i)
            tok.append((tokens or {}).get((p, i), 65 + i))
            lp.append((bits or {}).get((p, i), BASE + i))
            second.append((topk or {}).get((p, i), BASE + 100 + i))
    out = dict(prompt_id=ids, pos=np.array(pos), token_id=np.array(tok), logprob=np.array(lp, np.uint32).view(np.float32),
               row_digest=np.arange(len(ids), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) if digests else None)
    if topk is not None:
        out.update(topk_ids=np.stack([np.array(tok), np.ones(len(ids), int)], axis=1),
                   topk_logprobs=np.stack([np.array(lp, np.uint32), np.array(second, np.uint32)], axis=1).view(np.float32))
    return out


def record(path: Path, cell_id: str, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    env = kw.pop("env", dict(TEST_ENV))
    prompts = kw.pop("prompts", PROMPTS)
    write_record(path, **columns(prompts=prompts, **kw), cell={"id": cell_id}, env=env, probes=dict(TEST_PROBES),
                 model=dict(TEST_MODEL), tokenizer=dict(TEST_TOKENIZER))
    return path


def make_run(root: Path, cells: dict[str, dict] | None = None, name: str = "unit-run", topk: bool = False) -> Path:
    """A run directory as `repaudit run` leaves it: TP 1,2 x batch 1,4, score mode, 4 cells (with top-2 lists
    when topk). cells: {cell_id: {"status": ..., "reason": ..., "bits": {...}, "tokens": {...}, "topk": {...},
    "file": False}}."""
    run = root / name
    spec = cells or {}
    manifest = {
        "manifest_version": 1, "groups": {"hf-tp1-default": {"load_s": [1.5], "attempts": 1},
                                          "hf-tp2-default": {"load_s": [2.5], "attempts": 1}},
        "runs": [], "command": ["repaudit", "run", "--tp", "1,2", "--batch-size", "1,4", "--mode", "score", "--out", str(run)],
        "matrix": {"engines": ["hf"], "tp": [1, 2], "batch_size": [1, 4], "nccl": {"default": {}}, "kernels": ["stock"],
                   "mode": ["score"], "dtype": "float32", "device": "cpu", "probes": "unit", "max_new_tokens": None,
                   "topk": 0, "reference_per": ["kernels", "mode"], "groups": ["hf-tp1-default", "hf-tp2-default"]},
        "baseline": REF, "reference_cell": None, "probes": dict(TEST_PROBES),
        "model": {"id": TEST_MODEL["id"], "path": str(root / "no-such-model"), "weights_sha256": None},
        "tokenizer": dict(TEST_TOKENIZER), "environment": dict(TEST_ENV), "wall_s": 12.0, "cells": {},
    }
    for cid in CELLS:
        s = spec.get(cid, {})
        status = s.get("status", "done")
        entry = {"settings": {"id": cid}, "file": f"cells/{cid}.parquet", "status": status, "reason": s.get("reason")}
        if status == "done":
            entry.update(seconds=0.5, rows=len(PROMPTS) * LENGTH,
                         timing={"prefill_s": 0.1, "prefill_tokens": 15, "prefill_tokens_per_s": 150.0})
            if s.get("file", True):
                record(run / "cells" / f"{cid}.parquet", cid, bits=s.get("bits"), tokens=s.get("tokens"),
                       env=s.get("env", dict(TEST_ENV)), topk=s.get("topk", {} if topk else None))
        manifest["cells"][cid] = entry
    run.mkdir(parents=True, exist_ok=True)
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def gate(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main(["gate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def validate(path: Path) -> ET.Element:
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    doc = etree.parse(str(path))
    assert schema.validate(doc), schema.error_log
    return ET.parse(path).getroot()


def cases(root: ET.Element) -> dict[str, ET.Element]:
    return {c.get("name"): c for c in root.iter("testcase")}


# ------------------------------------------------------------------------------ the mapping


def test_reference_pairs_follow_the_plan(tmp_path):
    from repaudit.compare.gate import load_run
    from repaudit.run.plan import reference_pairs

    run = load_run(make_run(tmp_path))
    pairs = [(c.id, r.id) for c, r in reference_pairs(run.plan)]
    assert pairs == [(cid, REF) for cid in CELLS]


def test_manifest_with_another_baseline_and_reference_per(tmp_path):
    from repaudit.compare.gate import load_run
    from repaudit.run.plan import reference_pairs

    run_dir = make_run(tmp_path)
    m = json.loads((run_dir / "manifest.json").read_text())
    m["baseline"] = "hf-tp2-bs1-default-stock-score"
    m["matrix"]["reference_per"] = ["kernels", "mode", "batch_size"]
    (run_dir / "manifest.json").write_text(json.dumps(m))
    pairs = dict((c.id, r.id) for c, r in reference_pairs(load_run(run_dir).plan))
    assert pairs["hf-tp1-bs4-default-stock-score"] == "hf-tp2-bs4-default-stock-score"
    assert pairs["hf-tp1-bs1-default-stock-score"] == "hf-tp2-bs1-default-stock-score"


# ------------------------------------------------------------------------------ run directory


def test_identical_run_passes_with_junit(tmp_path, capsys):
    run = make_run(tmp_path)
    junit = tmp_path / "junit.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    assert (rc, err) == (0, "")
    assert "GATE PASSED: 3 of 3 cell pairs within thresholds" in out
    root = validate(junit)
    suite = root.find("testsuite")
    assert suite.get("name") == "repaudit.unit-run" and suite.get("tests") == "3" and suite.get("failures") == "0"
    names = list(cases(root))
    assert names == [f"{cid} vs {REF}" for cid in CELLS[1:]]
    for c in root.iter("testcase"):
        assert c.get("classname") == "repaudit.unit-run" and c.find("failure") is None
        assert "bitwise-equal logprobs" in c.find("system-out").text
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["baseline"] == REF and json.loads(props["thresholds"])["strict"] is True


def test_one_flipped_bit_fails_that_pair_only(tmp_path, capsys):
    cid = "hf-tp2-bs4-default-stock-score"
    run = make_run(tmp_path, {cid: {"bits": {("p1", 3): (BASE + 3) ^ 1}}})
    junit = tmp_path / "junit.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    assert (rc, err) == (1, "")
    flat = " ".join(out.split())
    assert "GATE FAILED: 1 of 3 cell pairs fail" in flat
    assert f"FAIL {cid} vs {REF}: 1 of 15 logprobs differ in their bits (max 1 ULP)" in flat
    root = validate(junit)
    assert root.get("failures") == "1"
    fail = cases(root)[f"{cid} vs {REF}"].find("failure")
    assert fail.get("type") == "divergence"
    assert fail.get("message").startswith("DIVERGENT: 1 of 15 logprobs differ in their bits (max 1 ULP)")
    body = fail.text
    assert "bitwise-equal logprobs               14/15 (93.33%)" in body
    assert "p1: pos 3 / —, 4/5 bitwise equal, max 1 ULP" in body
    assert f"repaudit diff {run}/cells/{REF}.parquet {run}/cells/{cid}.parquet" in body
    # a tolerance lets it through; the JUnit case then passes
    rc, out, _ = gate(capsys, run, "--max-ulp", "1", "--junit", junit)
    assert rc == 0 and validate(junit).get("failures") == "0"
    assert gate(capsys, run, "--max-abs", "1e-9")[0] == 1


def test_one_flipped_topk_bit_fails_that_pair(tmp_path, capsys):
    """Top-k lists are compared bit for bit: one flipped bit of one top-k logprob fails its pair."""
    cid = "hf-tp2-bs1-default-stock-score"
    run = make_run(tmp_path, {cid: {"topk": {("p2", 1): (BASE + 101) ^ 1}}}, topk=True)
    junit = tmp_path / "junit.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    flat = " ".join(out.split())
    assert (rc, err) == (1, "") and "GATE FAILED: 1 of 3 cell pairs fail" in flat
    assert f"FAIL {cid} vs {REF}: 1 of 15 positions differ in their top-k logprob bits" in flat
    fail = cases(validate(junit))[f"{cid} vs {REF}"].find("failure")
    assert fail.get("message") == "DIVERGENT: 1 of 15 positions differ in their top-k logprob bits"
    assert "equal top-k logprob bits             14/15 (93.33%)" in fail.text


def test_a_record_without_any_digest_is_judged_on_the_rest(tmp_path, capsys):
    """A vLLM record (no row digests) against a transformers one: trainer versus rollout passes when
    every other column agrees, and fails on the first that does not."""
    a = record(tmp_path / "a.parquet", "a")
    b = record(tmp_path / "b.parquet", "b", digests=False)
    assert gate(capsys, a, b)[0] == 0
    assert gate(capsys, b, b)[0] == 0  # neither has digests: nothing to compare
    rc, out, _ = gate(capsys, a, record(tmp_path / "c.parquet", "c", digests=False, bits={(PROMPTS[0], 2): 7}))
    assert rc == 1 and "logprobs differ in their bits" in " ".join(out.split())


def test_forked_sequences_and_max_seq_divergence(tmp_path, capsys):
    cid = "hf-tp1-bs4-default-stock-score"
    run = make_run(tmp_path, {cid: {"tokens": {("p2", i): 7 for i in range(2, LENGTH)}}})
    rc, out, _ = gate(capsys, run)
    assert rc == 1 and "1 of 3 sequences differ in tokens or length (first: 'p2' at pos 2)" in " ".join(out.split())
    assert gate(capsys, run, "--max-seq-divergence", "0.34")[0] == 0


def test_failed_and_missing_cells_are_failures_with_reasons(tmp_path, capsys):
    run = make_run(tmp_path, {
        "hf-tp2-bs1-default-stock-score": {"status": "failed", "reason": "rank 1 exited with code 9 (killed: out of memory?)"},
        "hf-tp2-bs4-default-stock-score": {"status": "timeout", "reason": "no progress for 600 s"},
        "hf-tp1-bs4-default-stock-score": {"file": False},
    })
    junit = tmp_path / "junit.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    assert (rc, err) == (1, "")
    root = validate(junit)
    got = {n: (c.find("failure").get("type"), c.find("failure").get("message")) for n, c in cases(root).items()}
    assert got[f"hf-tp2-bs1-default-stock-score vs {REF}"] == (
        "cell-not-completed", "cell hf-tp2-bs1-default-stock-score did not complete (failed: rank 1 exited with code 9 (killed: out of memory?))")
    assert got[f"hf-tp2-bs4-default-stock-score vs {REF}"] == (
        "cell-not-completed", "cell hf-tp2-bs4-default-stock-score did not complete (timeout: no progress for 600 s)")
    kind, msg = got[f"hf-tp1-bs4-default-stock-score vs {REF}"]
    assert kind == "record-missing" and "is missing although the manifest says the cell is done" in msg


def test_failed_reference_fails_its_dependents_and_itself(tmp_path, capsys):
    run = make_run(tmp_path, {REF: {"status": "failed", "reason": "could not load the model"}})
    junit = tmp_path / "junit.xml"
    assert gate(capsys, run, "--junit", junit)[0] == 1
    root = validate(junit)
    c = cases(root)
    assert len(c) == 4 and root.get("failures") == "4"
    assert c[f"{REF} (reference)"].find("failure").get("message") == f"cell {REF} did not complete (failed: could not load the model)"
    assert all(f"cell {REF} did not complete" in x.find("failure").get("message") for x in c.values())


def test_cell_missing_from_the_manifest(tmp_path, capsys):
    run = make_run(tmp_path)
    m = json.loads((run / "manifest.json").read_text())
    del m["cells"]["hf-tp2-bs4-default-stock-score"]
    (run / "manifest.json").write_text(json.dumps(m))
    rc, out, _ = gate(capsys, run)
    assert rc == 1 and "did not complete (missing from the manifest)" in " ".join(out.split())


def test_unreadable_record_in_a_run_is_a_failure_not_a_crash(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "cells" / "hf-tp2-bs1-default-stock-score.parquet").write_bytes(b"PAR1 truncated")
    junit = tmp_path / "j.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    assert (rc, err) == (1, "")
    fail = cases(validate(junit))[f"hf-tp2-bs1-default-stock-score vs {REF}"].find("failure")
    assert fail.get("type") == "record-unreadable" and "not a readable Parquet file" in fail.get("message")


def test_records_of_other_prompts_are_a_failure_of_their_own_type(tmp_path, capsys):
    """A readable record that holds other prompts than its reference's was reported as
    `record-unreadable`, which sends the reader to check the file instead of the run's prompts."""
    run = make_run(tmp_path)
    cell = "hf-tp2-bs1-default-stock-score"
    record(run / "cells" / f"{cell}.parquet", cell, prompts=("p0", "p1"))
    junit = tmp_path / "j.xml"
    rc, out, err = gate(capsys, run, "--junit", junit)
    assert (rc, err) == (1, "")
    fail = cases(validate(junit))[f"{cell} vs {REF}"].find("failure")
    assert fail.get("type") == "records-incomparable" and "prompt sets differ (1 only in A, 0 only in B" in fail.get("message")


# ------------------------------------------------------------------------------ two records


def test_two_records(tmp_path, capsys):
    a = record(tmp_path / "a.parquet", "cell-a")
    b = record(tmp_path / "b.parquet", "cell-b", bits={("p0", 0): BASE + 5})
    junit = tmp_path / "j.xml"
    rc, out, err = gate(capsys, a, a, "--junit", junit)
    assert (rc, err) == (0, "") and "GATE PASSED: 1 of 1" in out
    assert list(cases(validate(junit))) == [f"{a} vs {a}"]  # same cell id on both sides: named by path
    rc, out, err = gate(capsys, a, b, "--junit", junit)
    assert (rc, err) == (1, "")
    root = validate(junit)
    assert root.find("testsuite").get("name") == "repaudit.files"
    assert cases(root)["cell-b vs cell-a"].find("failure").get("message").startswith("DIVERGENT: 1 of 15 logprobs")
    assert gate(capsys, a, b, "--max-ulp", "5")[0] == 0


def test_two_records_partial(tmp_path, capsys):
    a = record(tmp_path / "a.parquet", "a")
    b = record(tmp_path / "b.parquet", "b", prompts=PROMPTS[:2])
    rc, _, err = gate(capsys, a, b)
    assert rc == 2 and "prompt sets differ" in err
    assert gate(capsys, a, b, "--allow-partial")[0] == 0


# ------------------------------------------------------------------------------ bad input


def _one_line(rc: int, err: str, needle: str) -> None:
    assert rc == 2 and err.startswith("repaudit: error: ") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("setup, needle", [
    (lambda t: t, "no manifest.json here"),
    (lambda t: t / "nope", "no such file or directory"),
    (lambda t: (t / "f.txt").write_text("x") and t / "f.txt", "expected a run directory"),
])
def test_bad_run_directory_exit_2(tmp_path, capsys, setup, needle):
    rc, _, err = gate(capsys, setup(tmp_path))
    _one_line(rc, err, needle)


def test_bad_manifests_exit_2(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("{not json")
    _one_line(*gate(capsys, tmp_path)[::2], "is not valid JSON")
    (tmp_path / "manifest.json").write_text(json.dumps({"manifest_version": 1, "cells": {}}))
    _one_line(*gate(capsys, tmp_path)[::2], "manifest has no complete matrix")
    (tmp_path / "manifest.json").write_text(json.dumps({"manifest_version": 7}))
    _one_line(*gate(capsys, tmp_path)[::2], "manifest version 7")


def test_usage_exit_2(tmp_path, capsys):
    a = record(tmp_path / "a.parquet", "a")
    _one_line(*gate(capsys, a, a, a)[::2], "gate takes a run directory or two records, got 3 paths")
    _one_line(*gate(capsys, a, tmp_path / "missing.parquet")[::2], "no such file")
    _one_line(*gate(capsys, make_run(tmp_path), "--allow-partial")[::2], "--allow-partial applies to two records")
    rc = cli.main(["gate"])
    assert rc == 2 and "Missing argument" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the XML itself


def test_junit_escapes_hostile_text(tmp_path):
    from repaudit.compare.gate import PairOutcome, GateResult
    from repaudit.report.junit import junit_xml

    evil = 'cell <&> "quoted" \x01\x1b[31m \ud800 ]]> end'
    g = GateResult("run.with dots", [PairOutcome(evil, "ref", failure=f"reason {evil}", failure_type="cell-not-completed")],
                   Thresholds(), {"note": evil})
    path = tmp_path / "j.xml"
    path.write_bytes(junit_xml(g, timestamp=0, hostname="h"))
    root = validate(path)
    case = root.find("testsuite/testcase")
    assert case.get("classname") == "repaudit.run_with_dots"  # one component: CI splits classnames on dots
    assert case.get("name").startswith('cell <&> "quoted" \\x01\\x1b[31m')
    assert "]]> end" in case.find("failure").text


@pytest.mark.parametrize("bad", [
    '<testsuites><testsuite name="s" tests="1"><testcase classname="c"/></testsuite></testsuites>',  # no name
    '<testsuites><testsuite name="s" tests="1"><testcase name="n" time="-1"/></testsuite></testsuites>',
    '<testsuites><testsuite name="s" tests="x"/></testsuites>',
    '<testsuites><testsuite tests="1"/></testsuites>',
    '<testsuites><testsuite name="s" tests="1"><testcase name="n"><failure><b/></failure></testcase></testsuite></testsuites>',
    '<testsuites><testsuite name="s" tests="1"><testcase name="n"><system-out/><failure/></testcase></testsuite></testsuites>',
    '<testsuites><testsuite name="s" tests="1" timestamp="yesterday"/></testsuites>',
    '<testsuites><testsuite name="s" tests="1"><bogus/></testsuite></testsuites>',
])
def test_the_schema_rejects_malformed_junit(bad):
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    assert not schema.validate(etree.fromstring(bad.encode()))


def test_the_schema_accepts_the_common_dialect():
    good = ('<testsuites name="x" tests="3" failures="1" errors="1" skipped="1" time="1.5" timestamp="2024-01-02T03:04:05">'
            '<testsuite name="s" tests="3" failures="1" errors="1" skipped="1" time="1.500" hostname="h" timestamp="2024-01-02T03:04:05">'
            '<properties><property name="k" value="v"/></properties>'
            '<testcase name="a" classname="c" time="0.5"><failure message="m" type="t">body</failure><system-out>o</system-out></testcase>'
            '<testcase name="b" classname="c"><error message="m">trace</error><system-err>e</system-err></testcase>'
            '<testcase name="c" classname="c"><skipped message="why"/></testcase>'
            '<system-out>suite out</system-out></testsuite></testsuites>')
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    assert schema.validate(etree.fromstring(good.encode())), schema.error_log
