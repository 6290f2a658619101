"""docs/compatibility.md names a test for every cell it claims: each named test exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def test_every_cell_of_the_matrix_names_a_test_that_exists():
    text = (ROOT / "docs" / "compatibility.md").read_text()
    refs = REF.findall(text)
    assert len(refs) >= 15, "the matrix lost its test references"
    missing = [f"{f}::{t}" for f, t in refs
               if not (ROOT / f).is_file() or t not in _tests_in(ROOT / f)]
    assert not missing, f"docs/compatibility.md names tests that do not exist: {missing}"
