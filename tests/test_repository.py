"""Rules of the repository's own layout, checked on its sources (no MPI, no hpctp import)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every absolute module name an ``import`` or ``from ... import`` names, with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_no_test_file_imports_another() -> None:
    """Shared test code lives in tests/helpers/ (or conftest.py fixtures): no file under tests/
    imports a ``test_*`` module, at the top or inside a function."""
    files = sorted(TESTS.rglob("*.py"))
    assert any(f.name.startswith("test_") for f in files), f"no test files found under {TESTS}"
    bad = [
        f"{f.relative_to(TESTS.parent)}:{line}: imports {module}"
        for f in files
        for line, module in _imported_modules(ast.parse(f.read_text(), filename=str(f)))
        if module.split(".")[0].startswith("test_")
    ]
    assert not bad, "test files import other test files (move the shared code to tests/helpers/):\n" + "\n".join(bad)
