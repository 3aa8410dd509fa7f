"""examples/plan_preset.sh: plan → inspect → emit on a small preset, end to end through the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_plan_preset_script(tmp_path):
    out = tmp_path / "out"
    env_cmd = f"{sys.executable} -m planner"
    r = subprocess.run(["bash", str(ROOT / "examples/plan_preset.sh"), "gpt-small",
                        "cpu-local", "4", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "AUTOPAR": env_cmd})
    assert r.returncode == 0, r.stderr
    assert (out / "plan.yaml").is_file() and (out / "plan.json").is_file() and (out / "report.html").is_file()
    ast.parse((out / "train.py").read_text())  # valid Python
    assert "plan:" in r.stdout


@pytest.mark.dist
def test_hf_model_script(tmp_path):
    """examples/hf_model.sh: a Hugging Face Llama planned for cpu-local with tp=2, emitted, trained 3 steps."""
    r = subprocess.run(["bash", str(ROOT / "examples/hf_model.sh"), str(tmp_path / "hf"), "3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, "AUTOPAR": f"{sys.executable} -m planner"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tp=2" in (tmp_path / "hf" / "plan.yaml").read_text().replace(" ", "").replace("tp:2", "tp=2")
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(" loss " in line and " grad norm " in line for line in steps), r.stdout[-2000:]
