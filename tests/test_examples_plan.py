"""examples/plan_preset.sh: plan → inspect → emit on a small preset, end to end through the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_preset_script(tmp_path):
    out = tmp_path / "out"
    env_cmd = f"{sys.executable} -m planner"
    r = subprocess.run(["bash", str(ROOT / "examples/plan_preset.sh"), "gpt-small",
                        "cpu-local", "4", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "AUTOPAR": env_cmd})
    assert r.returncode == 0, r.stderr
    assert (out / "plan.yaml").is_file() and (out / "plan.json").is_file()
    ast.parse((out / "train.py").read_text())  # valid Python
    assert "plan:" in r.stdout
