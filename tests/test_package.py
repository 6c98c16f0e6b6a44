"""Properties of the package as a whole."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"


def test_no_runtime_check_is_an_assert():
    """`python -O` strips asserts: every runtime check must be an explicit raise."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert found == []


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (rootdir-relative, no __init__.py): two files of one
    name in different test folders stop the whole run at collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    clashes = {
        name: paths for name, paths in seen.items() if len(paths) > 1 and name != "__init__.py"
    }
    assert clashes == {}
