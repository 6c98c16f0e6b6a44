"""The package's shape: no import cycle among finetune's modules, counting imports inside functions
(a lazy import hides a cycle from Python, not from a reader), and the leaves import nothing above
them. Pure AST reading; no module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "finetune"

# Modules every other module may import: each imports nothing of finetune's.
LEAVES = ("finetune.config", "finetune.commands")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, dict[str, int]]:
    """module → {imported finetune module: line of the first such import}."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, dict[str, int]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = edges.setdefault(mod, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names
                ]
            else:
                continue
            for name in names:
                while name and name not in paths:  # `import finetune.x.y` of a name inside a module
                    name = name.rpartition(".")[0]
                if (
                    name
                    and name != mod
                    and not (name == "finetune" and mod.startswith("finetune."))
                ):
                    out.setdefault(name, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    edges = graph()
    found = cycles(edges)
    described = [
        " ↔ ".join(group)
        + ": "
        + "; ".join(
            f"{a} imports {b} (line {edges[a][b]})" for a in group for b in group if b in edges[a]
        )
        for group in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    edges = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 1}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_leaves_import_nothing_of_finetune():
    edges = graph()
    assert {leaf: sorted(edges[leaf]) for leaf in LEAVES} == {leaf: [] for leaf in LEAVES}


def test_finetune_io_imports_nothing_above_it():
    edges = graph()
    low = {
        mod: sorted(m for m in out if not m.startswith("finetune.io"))
        for mod, out in edges.items()
        if mod.startswith("finetune.io")
    }
    assert low == {mod: [] for mod in low}


# FINETUNE_* variables a user may set (docs/CLUSTERS.md); every other one is a test seam.
USER_SETTINGS = {"FINETUNE_DIST_TIMEOUT_MIN", "FINETUNE_RUN_ID"}


def test_every_test_seam_is_read_in_seams_py_alone():
    from finetune.io import seams

    named: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("FINETUNE_") and node.value.isupper():
                    named.setdefault(node.value, []).append(f"{module_name(path)}:{node.lineno}")
    outside = {
        name: where
        for name, where in named.items()
        if name not in USER_SETTINGS and where != [f"finetune.io.seams:{where[0].split(':')[1]}"]
    }
    assert not outside, f"FINETUNE_* names outside finetune/io/seams.py: {outside}"
    assert set(seams.ALL) == set(named) - USER_SETTINGS


MAX_LINES = 500  # a module one reads in a sitting; past it, a concern has split in two


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
