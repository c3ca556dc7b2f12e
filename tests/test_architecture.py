"""The package stays readable as it grows: rooms of small modules and short functions (the layers themselves are
import-linter contracts in pyproject.toml, run by CI as ``lint-imports``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvrunahead"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                # From ``def`` to the last line: a click command's option decorators are declarations, not code.
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_paper_nouns_are_rooms():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"modes", "search", "bench", "model", "net", "sim", "cli"} <= rooms
    assert {"kvr.py", "tsp.py", "cp_allgather.py", "ring.py"} <= {p.name for p in (PACKAGE / "modes").iterdir()}
