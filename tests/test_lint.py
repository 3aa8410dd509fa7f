"""The tree passes the project's linter (ruff, rules in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (it comes with the test extra: pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
