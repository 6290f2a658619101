"""Tier-1: mypy --strict over the typed scope (pyproject.toml [tool.mypy]: mtcfs/base,
mtcfs/tiers, mtcfs/core/ports.py and the check that the core satisfies every port).

The test fails with mypy's own report, so the fix starts from its output. See
docs/architecture.md ("Type checking").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_strict_scope_type_checks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"mypy (strict) found problems:\n{report}"
