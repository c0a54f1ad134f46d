"""The package's imports go one way: no cycles among repaudit's modules (imports inside
functions count too), and no module takes another's private name. Modules stay small: one
over MAX_LINES says why at its top."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "repaudit"
MAX_LINES = 450
# The stages in the order data flows through them (engines make rows, run writes them as records,
# compare reads records and run directories, report renders comparisons). A module may import its
# own stage and earlier ones; shared modules (errors, files, builtin, probes, units) import no stage, and
# the entry points (cli, commands, the package's public API) may import any.
STAGES = ["record", "engines", "run", "compare", "report"]
SHARED = {"repaudit.errors", "repaudit.files", "repaudit.builtin", "repaudit.probes", "repaudit.units"}
REASON = "Longer than 450 lines because"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, list[str]]]:
    """(imported repaudit module, names taken from it) for every import in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target not in modules:
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest or not subs:
                out.append((target, rest))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    edges, private = {m: set() for m in modules}, []
    for m, path in files.items():
        for target, names in _imports(path, modules):
            # A module's own package is initialised before it, whatever either imports: no edge.
            if target != m and not m.startswith(target + "."):
                edges[m].add(target)
            private += [f"{m} takes {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycles():
    edges, _ = _graph()
    assert len(edges) > 30 and "repaudit.compare.result" in edges["repaudit.compare.summary"]  # the scan sees the package
    assert _cycles(edges) == []


def test_no_private_name_crosses_a_module():
    _, private = _graph()
    assert private == []


def test_the_checks_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_a_long_module_says_why():
    long = {p.relative_to(PACKAGE.parent).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = [f"{m} ({n} lines)" for m, n in long.items() if REASON not in (ast.get_docstring(ast.parse((PACKAGE.parent / m).read_text())) or "")]
    assert unexplained == []


def _stage(module: str) -> int | None:
    """Index in STAGES, -1 for a shared module, None for an entry point."""
    if module in SHARED:
        return -1
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 2 and parts[1] in STAGES else None


def reaching_up(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for m, targets in edges.items():
        own = _stage(m)
        if own is None:
            continue
        out += [f"{m} imports {t}" for t in sorted(targets) if _stage(t) is None or _stage(t) > own]
    return out


def test_no_stage_reaches_up_into_a_later_one():
    edges, _ = _graph()
    assert {_stage(m) for m in edges} >= {-1, 0, 1, 2, 3, 4, None}  # every stage is a package of its own
    assert reaching_up(edges) == []
    assert reaching_up({"repaudit.record.io": {"repaudit.run.plan"}, "repaudit.errors": {"repaudit.cli"}}) == [
        "repaudit.record.io imports repaudit.run.plan", "repaudit.errors imports repaudit.cli"]
