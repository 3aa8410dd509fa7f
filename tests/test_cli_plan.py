"""`autopar plan`: --json fields, --out loads, --fix, no-fit and bad --fix exit 2."""

from __future__ import annotations

import json

from planner.cli.main import main
from planner.plan import Plan

MODEL = "gpt:layers=2,hidden=256,heads=8,seq=128,vocab=1000"


def test_plan_json_and_out(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", MODEL, "--cluster", "dgx-a100-80g", "--json", "--out", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("predicted", "config", "stages", "solver", "alternatives"):
        assert key in d
    for key in ("status", "objective", "bound", "gap", "time_s", "candidates"):
        assert key in d["solver"]
    plan = Plan.load(out)
    assert plan.config.to_dict() == d["config"] and plan.global_batch == 64


def test_fix_pins_keys(capsys):
    assert main(["plan", MODEL, "--cluster", "dgx-a100-80g", "--fix", "tp=2,pp=2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["tp"] == 2 and d["config"]["pp"] == 2


def test_no_fit_exits_2_with_one_line(capsys):
    assert main(["plan", "gpt:layers=4,hidden=8192,heads=8,seq=2048,vocab=1000", "--cluster", "cpu-local"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GiB per GPU" in err and "more GPUs" in err


def test_bad_fix_exits_2(capsys):
    assert main(["plan", MODEL, "--cluster", "dgx-a100-80g", "--fix", "foo=3"]) == 2
    assert "unknown key 'foo'" in capsys.readouterr().err
