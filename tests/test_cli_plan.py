"""`autopar plan`: --json fields, --out loads, --fix, no-fit and bad --fix exit 2."""

from __future__ import annotations

import json

import pytest

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


def test_two_block_kinds_pipeline_anywhere_and_say_why_not_beyond(capsys):
    """Blocks of two kinds (a dense block before MoE blocks; dense and MoE in turn; one of each) are cut into stages
    between any two blocks: every stage holds a block and the head's stage ends the model; more stages than blocks
    are refused naming the rule."""
    ends = "moe:layers=3,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=4,top_k=2,dense_layers=1"
    turns = ends.replace("layers=3", "layers=4").replace("dense_layers=1", "moe_every=2")
    one_each = ends.replace("layers=3", "layers=2")
    for spec, n_layers in ((ends, 5), (turns, 6), (one_each, 4)):
        assert main(["plan", spec, "--cluster", "cpu-local", "--global-batch", "8", "--fix", "pp=2", "--check",
                     "off", "--json"]) == 0
        first, second = json.loads(capsys.readouterr().out)["stages"]
        assert first["first"] == 0 and 1 < first["last"] + 1 == second["first"] < n_layers - 1
        assert second["last"] == n_layers - 1
    assert main(["plan", one_each, "--cluster", "dgx-h100:nodes=1", "--global-batch", "8", "--fix", "pp=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only 2 blocks" in err and "lower pp" in err


def test_bad_fix_exits_2(capsys):
    assert main(["plan", MODEL, "--cluster", "dgx-a100-80g", "--fix", "foo=3"]) == 2
    assert "unknown key 'foo'" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--global-batch", "0"],
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--time-limit", "-5"],
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--time-limit", "nan"],
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--top-k", "-1"],
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--seq-len", "x"],
    ["plan", "gpt-tiny", "--cluster", "cpu-local", "--compress", "maybe"],
    ["estimate", "gpt-tiny", "--cluster", "cpu-local", "--config", "dp=2", "--global-batch", "-8"],
    ["profile", "gpt-tiny", "--batch", "0"],
])
def test_numeric_flags_out_of_range_are_one_line_errors(tmp_path, args):
    """Every numeric flag is checked at the edge: exit 2, one line on stderr, no traceback, no file written."""
    import subprocess
    import sys

    out = tmp_path / "plan.yaml"
    r = subprocess.run([sys.executable, "-m", "planner", *args, "--out", str(out)] if args[0] == "plan" else
                       [sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in r.stderr and lines[-1].startswith("autopar"), r.stderr
    assert not out.exists()


def test_compression_policy_default_is_none_and_the_summary_names_a_lossy_choice():
    """--compress: by default no compression that changes the numbers; a chosen one is named with what it changes."""
    from planner.cli.plan import compression_note

    assert compression_note("none", "none") == ""
    assert "lossy" in compression_note("powersgd-4", "none") and "1000" in compression_note("powersgd-4", "none")
    assert "bf16" in compression_note("bf16", "none") and "pipeline" in compression_note("none", "bf16")


def test_baseline_is_predicted_beside_the_plan(capsys):
    """--baseline: the user's configuration predicted on the same job (dp fills the cluster), with the plan's
    speedup over it; equal to `autopar estimate` of that configuration, and ≥ 1 (the search's space contains it)."""
    job = ["gpt-small", "--cluster", "dgx-a100-80g", "--global-batch", "32", "--check", "off"]
    assert main(["plan", *job, "--baseline", "tp=2,mbs=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    base = out["baseline"]
    assert base["config"]["dp"] == 4 and base["config"]["tp"] == 2 and base["config"]["mbs"] == 2
    assert base["speedup"] == pytest.approx(base["predicted"]["step_time_s"] / out["predicted"]["step_time_s"])
    assert base["speedup"] >= 1 - 1e-9 or not base["predicted"]["fits"]
    assert main(["estimate", "gpt-small", "--cluster", "dgx-a100-80g", "--global-batch", "32", "--config",
                 "dp=4,tp=2,mbs=2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert base["predicted"]["step_time_s"] == pytest.approx(est["step_time_s"])
    assert main(["plan", *job, "--baseline", "tp=2,mbs=2"]) == 0
    assert "baseline tp=2,mbs=2: " in capsys.readouterr().out
    assert main(["plan", *job, "--baseline", "tp=3"]) == 2
    assert "--baseline tp=3: tp·pp = 3 does not divide the cluster's 8 GPUs" in capsys.readouterr().err


def test_plan_compile_prices_fused_blocks_and_keeps_the_runtime_rule(tmp_path, capsys):
    """`plan --compile`: the search prices the blocks compiled (faster than the same plan eager), a plan with tensor
    parallelism checkpoints nothing (torch 2.13 cannot compile a checkpointed block's DTensor inputs), the plan file
    records the backend and the emitted script compiles by default; pinning AC with TP under --compile names the
    rule."""
    out, script = tmp_path / "p.yaml", tmp_path / "t.py"
    job = ["plan", "llama:layers=4,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048", "--cluster",
           "dgx-h100", "--global-batch", "16", "--check", "off", "--fix", "tp=2,dp=4"]
    assert main([*job, "--compile", "--out", str(out), "--emit", str(script)]) == 0
    plan = Plan.load(out)
    assert plan.compile == "inductor" and {lay.ac.value for lay in plan.layers} == {"none"}
    assert "PLAN = {" in script.read_text() and '"compile": "inductor"' in script.read_text()
    eager_out = tmp_path / "e.yaml"
    assert main([*job, "--fix", f"tp=2,dp=4,mbs={plan.config.mbs},zero={plan.config.zero},"
                 f"sp={'on' if plan.config.sp else 'off'},ac=none",
                 "--out", str(eager_out)]) == 0
    eager = Plan.load(eager_out)
    assert eager.compile is None and plan.predicted["step_time_s"] < eager.predicted["step_time_s"]
    capsys.readouterr()
    assert main([*job[:-1], "tp=2,dp=4,ac=full", "--compile"]) == 2
    assert "torch.compile with tensor parallelism and activation checkpointing" in capsys.readouterr().err


@pytest.mark.parametrize("pins, holds", [
    ("schedule=interleaved,pp=2", lambda c: c.schedule.value == "interleaved" and c.pp == 2 and c.vpp >= 2),
    ("vpp=2", lambda c: c.vpp == 2 and c.schedule.value == "interleaved"),
    ("sp=on", lambda c: c.sp and c.tp > 1),
])
def test_a_pin_constrains_only_its_key(pins, holds, tmp_path):
    """A key pinned alone lets the keys a rule ties to it vary (issue 14): interleaving with pp pinned chooses vpp,
    vpp chooses the schedule, sequence parallelism chooses tp; before, each was refused as if the free key kept its
    default (vpp=1, 1f1b, tp=1)."""
    out = tmp_path / "p.yaml"
    assert main(["plan", "llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=8000,seq=1024", "--cluster",
                 "dgx-h100:nodes=2", "--global-batch", "64", "--fix", pins, "--check", "off", "--out",
                 str(out)]) == 0
    assert holds(Plan.load(out).config), Plan.load(out).config
