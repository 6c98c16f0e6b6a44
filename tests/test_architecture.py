"""The package's shape: no import cycle among finetune's modules, counting imports inside functions
(a lazy import hides a cycle from Python, not from a reader); the layers (the checkpoint's format
below both halves, the shared procedures below the online component and the offline tools, the
offline tools and the data apart from the online component); module sizes as ruff formats them;
the code map naming every module. AST reading and ruff; no module of finetune is imported."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

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
    """A leaf may be a package: its modules import each other, nothing else of finetune's."""
    edges = graph()
    found = {
        mod: sorted(t for t in out if not _under(t, leaf))
        for leaf in LEAVES
        for mod, out in edges.items()
        if _under(mod, leaf)
    }
    assert set(LEAVES) <= set(found)
    assert found == {mod: [] for mod in found}


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


# --- layers ---------------------------------------------------------------------------------------

# The loop and the entry points: nothing below them imports them.
LOOP = ("finetune.trainer", "finetune.build", "finetune.run", "finetune.cli", "finetune.preemption")
# The online component and the running job's bucket copy.
ONLINE = ("finetune.checkpoint", "finetune.remote.copy")

# layer (a package or module prefix) -> the prefixes it may not import, and why.
FORBIDDEN = {
    "finetune.checkpoint_format": (
        ("finetune.",),
        "the checkpoint's format is pure: it imports only config, io/ and itself",
    ),
    "finetune.weights": (
        LOOP + ONLINE + ("finetune.offline", "finetune.remote", "finetune.listing"),
        "the shared procedures sit below both halves and the bucket",
    ),
    "finetune.remote": (
        LOOP + ("finetune.checkpoint", "finetune.offline", "finetune.listing"),
        "the bucket sits below the online component and the offline tools",
    ),
    "finetune.checkpoint": (
        LOOP + ("finetune.remote.copy", "finetune.offline", "finetune.listing", "finetune.plot"),
        "the online component sees the bucket through its protocol and never the loop",
    ),
    "finetune.offline": (LOOP + ONLINE, "an offline tool runs without the online component"),
    "finetune.listing": (LOOP + ONLINE, "`finetune ls` runs without the online component"),
    "finetune.plot": (LOOP + ONLINE, "`finetune plot` runs without the online component"),
    "finetune.data": (LOOP + ONLINE, "the data imports no part of the checkpoint's online side"),
}
# What the format layer may import despite FORBIDDEN's "finetune.": config, io/, itself.
FORMAT_MAY = ("finetune.config", "finetune.io", "finetune.checkpoint_format")


def _under(mod: str, prefix: str) -> bool:
    return (
        mod == prefix
        or mod.startswith(prefix + ".")
        or prefix.endswith(".")
        and mod.startswith(prefix)
    )


def layer_violations(edges: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for layer, (forbidden, why) in FORBIDDEN.items():
        for mod, out in edges.items():
            if not _under(mod, layer):
                continue
            for target, line in out.items():
                if layer == "finetune.checkpoint_format" and any(
                    _under(target, p) for p in FORMAT_MAY
                ):
                    continue
                if any(_under(target, p) for p in forbidden):
                    found.append(f"{mod} imports {target} (line {line}): {why}")
    return found


def test_the_layers_hold():
    assert layer_violations(graph()) == []


def test_the_layer_rules_catch_an_import_upward():
    edges = {
        "finetune.weights.shards": {"finetune.checkpoint.writer": 3},
        "finetune.checkpoint_format.manifest": {"finetune.io.durable": 1, "finetune.lora": 9},
        "finetune.offline.export": {"finetune.remote.fetch": 2, "finetune.remote.copy": 5},
    }
    assert [v.split(" (")[0] for v in layer_violations(edges)] == [
        "finetune.checkpoint_format.manifest imports finetune.lora",
        "finetune.weights.shards imports finetune.checkpoint.writer",
        "finetune.offline.export imports finetune.remote.copy",
    ]


# --- sizes ----------------------------------------------------------------------------------------

MAX_LINES = 600  # a module one reads in a sitting; past it, a concern has split in two
RUFF = Path(sys.executable).parent / "ruff"
# Layout is the formatter's: a comment that switches it off, or a long line let through, is a
# module squeezed to look short.
SQUEEZE = re.compile(r"#.*(fmt:\s*(skip|off)|noqa:[^#]*E501)")


def formatted_lines(path: Path) -> int:
    """The module's length as `ruff format` writes it (the project's settings)."""
    out = subprocess.run(
        [str(RUFF), "format", "--quiet", "--stdin-filename", str(path), "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return len(out.stdout.splitlines())


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed (the test extra pins it)")
def test_no_module_is_over_600_lines_as_ruff_formats_it():
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := formatted_lines(p)) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines as formatted: {long}"


def squeezed(source: str) -> list[int]:
    """Lines whose comment switches the formatter off or lets a long line through."""
    return [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and SQUEEZE.search(tok.string)
    ]


def test_nothing_switches_the_formatter_off():
    found = {
        str(p.relative_to(REPO)): lines
        for folder in ("finetune", "tests", "bench", "scripts")
        for p in sorted((REPO / folder).rglob("*.py"))
        if (lines := squeezed(p.read_text()))
    }
    assert not found, f"`# fmt: skip`, `# fmt: off` or an E501 noqa: {found}"


def test_the_squeeze_finder_finds_each_kind():
    source = "x = 1  # fmt: skip\ny = 2  # noqa: E501,E731\nz = '# fmt: skip'  # noqa: BLE001\n"
    assert squeezed(source) == [1, 2]


# --- the code map ---------------------------------------------------------------------------------

ENTRY = re.compile(r"^( {2}| {4})(\S+?\.py|\S+?/)(\s|$)")


def mapped_modules(text: str) -> set[str]:
    """The module paths (relative to finetune/) the code map's tree names: a folder at two spaces'
    indent, its modules at four."""
    block = text.split("```\nfinetune/\n", 1)[1].split("```", 1)[0]
    names, folder = set(), ""
    for line in block.splitlines():
        m = ENTRY.match(line)
        if not m:
            continue
        indent, name = m.group(1), m.group(2)
        if len(indent) == 2:
            folder = name if name.endswith("/") else ""
            if not folder:
                names.add(name)
        elif folder:
            names.add(folder + name)
    return names


def test_the_code_map_names_every_module():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    modules = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "resources" not in p.parts
    }
    mapped = mapped_modules(text)
    assert sorted(modules - mapped) == [], "modules missing from docs/ARCHITECTURE.md"
    assert sorted(mapped - modules) == [], "docs/ARCHITECTURE.md names modules that do not exist"
