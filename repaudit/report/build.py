"""Gather everything a report shows, for a run directory or for two records."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..compare.gate import GateResult, PairOutcome, RunInfo, gate_run, threshold_args
from ..compare.result import DEFAULT_CLIP, DiffResult, Thresholds
from ..record.fingerprint import COMPARED, settings
from ..record.io import read_meta
from ..compare.labels import cell_settings, short_labels
from ..run.plan import CELL_SETTINGS
from .analysis import MatrixView, PairView, analyse_pair, cell_matrix
from .arrays import ArrayCache
from .tokens import load_token_text

MATRIX_LIMIT = 40  # cells per mode for the cell x cell matrix (cells^2 / 2 diffs)


@dataclass
class CellView:
    id: str
    label: str
    settings: dict[str, Any]
    status: str | None = None
    reason: str | None = None
    seconds: float | None = None
    timing: dict[str, Any] | None = None
    env: dict[str, Any] | None = None
    path: Path | None = None
    reference: str | None = None  # its reference cell's id (itself for a reference)
    group: str | None = None

    @property
    def mode(self) -> str | None:
        return self.settings.get("mode")

    @property
    def is_reference(self) -> bool:
        return self.reference == self.id


@dataclass
class GroupView:
    id: str
    cells: list[str]
    load_s: list[float]
    attempts: int | None


@dataclass
class ReportData:
    kind: str  # "run" or "pair"
    title: str
    facts: list[tuple[str, str]]  # what was audited: model, probes, device, ...
    gate: GateResult
    cells: list[CellView]
    pairs: list[PairView]
    matrices: list[MatrixView] = field(default_factory=list)
    groups: list[GroupView] = field(default_factory=list)
    wall_s: float | None = None
    commands: list[tuple[str, str]] = field(default_factory=list)
    token_note: str = ""
    notes: list[str] = field(default_factory=list)
    locates: list[tuple[str, str, Any]] = field(default_factory=list)  # (cell, reference, LocateResult) of traced pairs

    @property
    def thresholds(self) -> Thresholds:
        return self.gate.thresholds

    @property
    def max_pos(self) -> int:
        return max((p.max_pos for p in self.pairs), default=0)

    def cell(self, cell_id: str) -> CellView | None:
        return next((c for c in self.cells if c.id == cell_id), None)


def _env(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return read_meta(path).env
    except Exception:  # an unreadable record: its pair already says why
        return None


def _threshold_text(th: Thresholds) -> str:
    if th.strict:
        text = "strict (every bit, digest and token must agree)"
    else:
        text = ", ".join(x for x in (f"max ULP {th.max_ulp}" if th.max_ulp is not None else "",
                                     f"max |Δ logprob| {th.max_abs!r}" if th.max_abs is not None else "") if x)
    if th.max_seq_divergence:
        text += f"; up to {th.max_seq_divergence!r} of sequences may fork"
    return text


def build_run(run: RunInfo, thresholds: Thresholds, matrix_limit: int = MATRIX_LIMIT) -> ReportData:
    m = run.manifest
    gate = gate_run(run, thresholds)
    cache = ArrayCache()
    text = load_token_text(m.model.get("path"), m.tokenizer.get("sha256"), m.model.get("id"))

    group_of = {c.id: g.id for g in run.plan.groups for c in g.cells}
    settings = {c.id: cell_settings(c) for c in run.plan.cells}
    labels = gate.labels
    refs = {c.id: r.id for c, r in ((c, run.plan.reference_for(c)) for c in run.plan.cells)}
    cells = []
    for c in run.plan.cells:
        e = run.entry(c.id)
        path = run.path(c.id)
        cells.append(CellView(
            id=c.id, label=labels[c.id], settings={**settings[c.id], **(e.get("settings") or {})},
            status=e.get("status"), reason=e.get("reason"), seconds=e.get("seconds"), timing=e.get("timing"),
            env=_env(path) if e.get("status") == "done" else None, path=path, reference=refs[c.id], group=group_of.get(c.id),
        ))
    pairs = [analyse_pair(p, labels.get(p.cell, p.cell), cache, text) for p in gate.pairs]

    known: dict[frozenset, DiffResult] = {frozenset((p.cell, p.reference)): p.result for p in gate.pairs if p.result}
    matrices = []
    for mode in dict.fromkeys(c.mode for c in cells):
        ids = [c.id for c in cells if c.mode == mode and c.status == "done" and c.path is not None and c.path.is_file()]
        if len(ids) < 2:
            continue
        mlabels = short_labels({i: settings[i] for i in ids}, tuple(d for d in CELL_SETTINGS if d != "mode"))
        matrices.append(cell_matrix(mode, ids, [mlabels[i] for i in ids], {i: run.path(i) for i in ids},
                                    {i for i in ids if refs[i] == i}, known, matrix_limit))

    groups = [GroupView(g.id, [c.id for c in g.cells], list((m.groups.get(g.id) or {}).get("load_s") or []),
                        (m.groups.get(g.id) or {}).get("attempts")) for g in run.plan.groups]

    rd = str(run.run_dir)
    commands = [("the run (re-running it resumes: completed cells are kept)", shlex.join(m.command or ["repaudit", "run"])),
                ("this report", shlex.join(["repaudit", "report", rd, *threshold_args(thresholds)])),
                ("the gate, with JUnit XML", shlex.join(["repaudit", "gate", rd, "--junit", "junit.xml", *threshold_args(thresholds)]))]
    divergent = [p for p in gate.pairs if p.result is not None and not p.result.identical]
    if divergent:
        worst = min(divergent, key=lambda p: (Fraction(p.result.bitwise_equal, max(1, p.result.comparable)), -p.result.ulp_max))
        commands.append((f"the most divergent pair ({worst.cell} vs its reference)", worst.diff_command(thresholds) or ""))

    probes = m.probes
    mx = m.matrix
    facts = [
        ("model", f"{m.model.get('id')}" + (f" (weights sha256 {str(m.model.get('weights_sha256'))[:12]}…)" if m.model.get("weights_sha256") else "")),
        ("probe suite", f"{probes.get('name')} (sha256 {str(probes.get('sha256'))[:12]}…)"),
        ("device / dtype", f"{mx.get('device')} / {mx.get('dtype')}"),
        ("baseline", run.plan.baseline.id),
        ("reference per", ", ".join(run.plan.matrix.reference_per) + " (each cell is compared with the baseline taken with its own values of these)"),
        ("thresholds", _threshold_text(thresholds)),
        ("updated", str(m.updated)),
    ]
    notes = [f"Cell × cell matrix for {mv.mode}: {mv.skipped}." for mv in matrices if mv.skipped]
    notes += [f"Refused, not run: {cell}: {reason}." for cell, reason in gate.refused]
    notes += [f"Ran again after its job crashed: {c.id} ({'; '.join(run.entry(c.id)['retried'])})."
              for c in run.plan.cells if run.entry(c.id).get("retried")]  # the record is the retry's
    notes += [f"Ran again after its job crashed outside any cell: launch group {g.id} "
              f"({'; '.join(m.groups[g.id]['retried'])})." for g in run.plan.groups if (m.groups.get(g.id) or {}).get("retried")]
    return ReportData("run", f"repaudit report: {run.name}", facts, gate, cells, pairs, matrices, groups,
                      m.wall_s, commands, text.note, notes, _locates(gate.pairs))


def _locates(pairs: list[PairOutcome]) -> list[tuple[str, str, Any]]:
    """`repaudit locate` for every compared pair whose two cells were traced (`run --trace`)."""
    from ..compare.locate import locate
    from ..record.tracefile import trace_path

    todo = [p for p in pairs if p.result is not None and p.path_a is not None and p.path_b is not None
            and trace_path(p.path_a).is_file() and trace_path(p.path_b).is_file()]
    # Grouped by reference, which is read once per group; only it is kept between pairs (a
    # trace of a long suite is hundreds of MB in memory).
    located: dict[int, Any] = {}
    traces: dict[str, tuple] = {}
    for i in sorted(range(len(todo)), key=lambda i: str(todo[i].path_a)):
        p = todo[i]
        if str(trace_path(p.path_a)) not in traces:
            traces.clear()
        located[i] = locate(p.path_a, p.path_b, traces)
        if trace_path(p.path_b) != trace_path(p.path_a):
            traces.pop(str(trace_path(p.path_b)), None)
    return [(p.cell, p.reference, located[i]) for i, p in enumerate(todo)]


def build_pair(outcome: PairOutcome, thresholds: Thresholds, gate: GateResult) -> ReportData:
    """Two records: B against A (A is the reference side)."""
    r = outcome.result
    assert r is not None
    cache = ArrayCache()
    text = load_token_text(None, r.a.tokenizer.get("sha256"), r.a.model.get("id"))
    cells = []
    for side, meta, path in (("A", r.a, outcome.path_a), ("B", r.b, outcome.path_b)):
        cells.append(CellView(id=f"{side}: {meta.cell_id}", label=side, settings=meta.cell, status="done", env=meta.env,
                              path=path, reference=None))
    pair = analyse_pair(outcome, "B vs A", cache, text)
    facts = [
        ("A", f"{outcome.path_a}  ({r.a.cell_id})"),
        ("B", f"{outcome.path_b}  ({r.b.cell_id})"),
        ("model", str(r.a.model.get("id")) + ("" if r.a.model == r.b.model else f" vs {r.b.model.get('id')}")),
        ("probe suite", f"{r.a.probes.get('name')} (sha256 {str(r.a.probes.get('sha256'))[:12]}…)"),
        ("thresholds", _threshold_text(thresholds)),
    ]
    if r.cell_differences:
        facts.append(("settings that differ", ", ".join(f"{k} {a!r} → {b!r}" for k, a, b in r.cell_differences)))
    if r.refusals:
        facts.append(("compared partially", "; ".join(r.refusals)))
    command = outcome.diff_command(thresholds)
    commands = [("this diff", shlex.join([*shlex.split(command), *_diff_args(r)]) if command else "")]
    return ReportData("pair", f"repaudit diff: {r.a.cell_id} vs {r.b.cell_id}", facts, gate, cells, [pair],
                      commands=commands, token_note=text.note)


def _diff_args(r: DiffResult) -> list[str]:
    """The flags besides the thresholds that the diff's numbers depend on: without them the command
    refuses the records (prompt sets differ) or counts clip_frac against other bounds."""
    out = ["--allow-partial"] if r.refusals else []
    if tuple(r.rl.clip) != DEFAULT_CLIP:
        out += ["--clip", ",".join(repr(x) for x in r.rl.clip)]
    return out


# ------------------------------------------------------------------------------ environment


def env_table(cells: list[CellView]) -> tuple[dict[str, Any], list[str], dict[str, dict[str, Any]]]:
    """(fields every cell with a record shares, the fields that differ, per cell the values of those)."""
    have = [c for c in cells if c.env is not None]
    flat = {c.id: _flatten(c.env or {}) for c in have}
    keys = []
    order = [k for k in COMPARED if k != "vars"]
    for f in flat.values():
        for k in f:
            if k not in keys:
                keys.append(k)
    keys.sort(key=lambda k: (order.index(k) if k in order else len(order) + (1 if k.startswith("env ") else 0), k))
    common, differ = {}, []
    for k in keys:
        values = {value_text(f.get(k)) for f in flat.values()}
        if len(values) == 1:
            common[k] = next(iter(flat.values())).get(k)
        else:
            differ.append(k)
    return common, differ, {cid: {k: f.get(k) for k in differ} for cid, f in flat.items()}


def _flatten(env: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in env.items() if k not in ("vars", "ranks")}
    out.update(settings(env))  # per-rank switches: one value, or the list by rank where ranks disagree
    for name, value in sorted((env.get("vars") or {}).items()):
        out[f"env {name}"] = value
    return out


def value_text(v: Any) -> str:
    """A fingerprint value as text: None as a dash, lists comma-separated."""
    if v is None:
        return "—"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) or "—"
    return str(v)

