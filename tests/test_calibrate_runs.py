"""`autopar calibrate`: a cluster fitted to measured runs (here, published llm-foundry H100 rows written as the
user's RUNS.yaml) reproduces each run, fits only what the runs identify, and is a cluster file `plan` reads."""

from __future__ import annotations

import json

import pytest
import yaml

from costmodel.cluster import load_cluster
from costmodel.runs import UNLOCK_ORDER, calibrate, load_runs
from planner.cli.main import main

# llm-foundry's MPT benchmark table on H100 (costmodel/data/published_runs.json): FSDP FULL_SHARD, bf16
RUNS = [
    {"name": "7b seq2048 8 GPUs", "model": "gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=50368,dropout=0",
     "cluster": "dgx-h100:nodes=1", "global_batch": 48, "config": {"dp": 8, "zero": 3, "mbs": 6},
     "step_time_s": 1.1545616837357888},
    {"name": "7b seq4096 8 GPUs full AC", "model": "gpt:layers=32,hidden=4096,heads=32,seq=4096,vocab=50368,dropout=0",
     "cluster": "dgx-h100:nodes=1", "global_batch": 256, "config": {"dp": 8, "zero": 3, "mbs": 16, "ac": "full"},
     "step_time_s": 15.220356204549084},
    {"name": "13b seq2048 16 GPUs", "model": "gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=50368,dropout=0",
     "cluster": "dgx-h100:nodes=2", "global_batch": 32, "config": {"dp": 16, "zero": 3, "mbs": 2},
     "tokens_per_s": 32 * 2048 / 0.8591504981646565, "seq_len": 2048},
]


def test_calibrate_reproduces_published_runs_and_writes_a_cluster_plan_reads(tmp_path, capsys):
    runs = tmp_path / "runs.yaml"
    runs.write_text(yaml.safe_dump(RUNS))
    out = tmp_path / "h100.yaml"
    # (Composer's runs: the constants the fit keeps are that stack's)
    assert main(["calibrate", str(runs), "--cluster", "dgx-h100:stack=composer", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["fitted"]) == set(UNLOCK_ORDER[:3]) and result["kept"] == list(UNLOCK_ORDER[3:])
    for row in result["runs"]:
        assert abs(row["error"]) <= 0.02, row
        assert row["predicted_s"] == pytest.approx(row["measured_s"], rel=0.02)
    fitted = load_cluster(f"{out}:nodes=2")
    assert fitted.nodes == 2 and fitted.device.matmul_eff.e_max == pytest.approx(result["fitted"]["e_max"])
    assert main(["estimate", RUNS[0]["model"], "--cluster", f"{out}:nodes=1", "--config", "dp=8,zero=3,mbs=6",
                 "--global-batch", "48", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_time_s"] == pytest.approx(RUNS[0]["step_time_s"], rel=0.02)  # the file predicts the run


def test_one_run_fits_one_constant(tmp_path):
    """One run is one equation: only the matmul efficiency moves, and the run is reproduced."""
    runs = tmp_path / "runs.yaml"
    runs.write_text(yaml.safe_dump(RUNS[:1]))
    base = load_cluster("dgx-h100")
    res = calibrate(load_runs(runs), base)
    assert res.fitted == ("e_max",)
    assert abs(res.errors()[0]) < 1e-3
    dev, old = res.cluster.device, base.device
    assert dev.matmul_eff.f_half == old.matmul_eff.f_half and dev.memory_eff == old.memory_eff
    assert dev.overlap_slowdown == old.overlap_slowdown and dev.attention_eff == old.attention_eff


def test_a_run_config_may_be_written_as_config_takes_it(tmp_path):
    """``config: "dp=8,zero=3,mbs=6"``, as --config and --baseline write it, is the same run as the mapping."""
    runs = tmp_path / "runs.yaml"
    runs.write_text(yaml.safe_dump([RUNS[0], dict(RUNS[0], config="dp=8,zero=3,mbs=6")]))
    first, second = load_runs(runs)
    assert first.config == second.config and second.config.zero == 3 and second.config.mbs == 6


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r.pop("step_time_s"), "run 1: give exactly one of step_time_s or tokens_per_s"),
    (lambda r: r["config"].update(tpp=2), "run 1: unknown config key tpp"),
    (lambda r: r.update(cluster="dgx-a100-80g"), "has a100-80g devices, the cluster to calibrate has h100-sxm"),
    (lambda r: r.update(global_batch=0), "run 1: global_batch must be an integer ≥ 1, got 0"),
    (lambda r: r.update(step_time_s=-1), "run 1: step_time_s / tokens_per_s must be a positive number"),
    (lambda r: r.update(config="dp=8,zero3"), "run 1: config: 'zero3' is not key=value"),
])
def test_bad_runs_are_one_line_and_write_nothing(tmp_path, capsys, edit, needle):
    run = json.loads(json.dumps(RUNS[0]))
    edit(run)
    runs = tmp_path / "runs.yaml"
    runs.write_text(yaml.safe_dump([run]))
    out = tmp_path / "out.yaml"
    assert main(["calibrate", str(runs), "--cluster", "dgx-h100", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not out.exists()



def test_a_constant_no_run_depends_on_is_skipped_and_said(tmp_path, capsys):
    """Megatron-style runs, unfused attention on tp = every GPU (no data-parallel gradient to overlap), cannot
    identify the fused-attention efficiency or the overlap slowdown: four runs fit e_max, f_half and memory_eff,
    not the overlap slowdown (fourth in order), and the CLI says which constants no run depends on."""
    model = "gpt:layers=4,hidden=2048,heads=16,seq=2048,vocab=32000,attention=math"
    runs = [{"name": f"mbs{mbs}", "model": model, "cluster": "dgx-h100:nodes=1", "global_batch": 16,
             "config": {"tp": 8, "mbs": mbs}, "step_time_s": step}
            for mbs, step in ((1, 0.080), (2, 0.060), (4, 0.052), (8, 0.050))]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(runs))
    out = tmp_path / "h100.yaml"
    assert main(["calibrate", str(path), "--cluster", "dgx-h100", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["unidentifiable"] == ["overlap_slowdown", "attention_eff"]
    assert list(result["fitted"]) == ["e_max", "f_half", "memory_eff"]
    base = load_cluster("dgx-h100").device
    dev = load_cluster(str(out)).device
    assert (dev.overlap_slowdown, dev.attention_eff) == (base.overlap_slowdown, base.attention_eff)
    assert main(["calibrate", str(path), "--cluster", "dgx-h100", "--out", str(out)]) == 0
    assert "no run depends on overlap_slowdown, attention_eff: kept" in capsys.readouterr().out
