"""`autopar validate`: comparison arithmetic, recalibration rediscovering known scales, and one real gloo launch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from costmodel.cluster import dump_cluster, load_cluster, parse_cluster_yaml
from planner.search.outer import profile_for
from planner.validate.fit import Scales, apply_scales, fit
from planner.validate.loop import Measurement, compare, plan_from_config, predicted_parts, repredict, spearman

MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
CONFIGS = ["dp=2", "dp=2,zero=3", "tp=2", "pp=2,schedule=gpipe", "pp=2,schedule=1f1b", "dp=2,grad_compress=fp16"]


def test_spearman_known_answers():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_identity_scales_change_nothing_and_round_trip():
    base = load_cluster("cpu-local")
    same = apply_scales(base, Scales())
    lg = profile_for(MODEL, base)
    for cfg in CONFIGS:
        plan = plan_from_config(MODEL, "cpu-local", 8, cfg, lg=lg)
        assert repredict(plan, same, lg)["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    back = parse_cluster_yaml(dump_cluster(same))
    assert back.intra.bandwidth_by_kind == pytest.approx(dict(same.intra.bandwidth_by_kind))
    assert back.device.peak_flops["fp32"] == pytest.approx(same.device.peak_flops["fp32"])


def _fake_measurement(name: str, parts: dict) -> Measurement:
    return Measurement(
        name=name,
        step_s=parts["step"],
        compute_s=parts["compute"],
        comm_s=parts["comm"],
        optimizer_s=parts["optimizer"],
        forward_s=parts["compute"] / 3,
        backward_s=parts["compute"] * 2 / 3,
        peak_memory_bytes=0.0,
    )


def test_recalibration_rediscovers_a_slower_machine():
    """Measurements made by a cluster with half the FLOP/s and 4× the collective latency are fitted back."""
    base = load_cluster("cpu-local")
    truth = apply_scales(
        base,
        Scales(
            flops=0.5,
            memory=0.5,
            latency=(("all_reduce", 4.0), ("all_gather", 4.0), ("reduce_scatter", 4.0), ("send_recv", 4.0)),
        ),
    )
    lg = profile_for(MODEL, base)
    plans = [plan_from_config(MODEL, "cpu-local", 8, cfg, lg=lg) for cfg in CONFIGS]
    meas = [_fake_measurement(f"p{i}", predicted_parts(repredict(p, truth, lg))) for i, p in enumerate(plans)]
    res = fit(base, plans, meas, [lg] * len(plans))
    assert res.cost_after < 0.05 * res.cost_before
    for p, m in zip(plans, meas):
        got = repredict(p, res.cluster, lg)["step_time_s"]
        assert got == pytest.approx(m.step_s, rel=0.05)
        assert predicted_parts(repredict(p, res.cluster, lg))["compute"] == pytest.approx(m.compute_s, rel=0.05)


def test_compare_reports_relative_error():
    base = load_cluster("cpu-local")
    plan = plan_from_config(MODEL, "cpu-local", 8, "dp=2", lg=profile_for(MODEL, base))
    parts = {k: 2 * v for k, v in predicted_parts(plan.predicted).items()}
    comp = compare("dp", plan, _fake_measurement("dp", parts))
    assert comp.error("step") == pytest.approx(-0.5)


@pytest.mark.dist
def test_validate_cli_measures_plans_and_recalibrates(tmp_path):
    """One launch measures three plans (DP, TP, PP); --recalibrate writes a cluster that estimate/validate read."""
    base = load_cluster("cpu-local")
    lg = profile_for(MODEL, base)
    paths = []
    for name, cfg in (("dp", "dp=2"), ("tp", "tp=2"), ("pp", "pp=2,schedule=1f1b")):
        path = tmp_path / f"{name}.yaml"
        plan_from_config(MODEL, "cpu-local", 8, cfg, lg=lg).save(path)
        paths.append(str(path))
    out = tmp_path / "recal.yaml"
    cmd = [
        sys.executable,
        "-m",
        "planner",
        "validate",
        *paths,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        "--recalibrate",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["plans"]) == {"dp", "tp", "pp"}
    for entry in result["plans"].values():
        m = entry["measured"]
        assert m["backend"] == "gloo" and m["step_s"] > 0 and len(m["steps_s"]) == 2
        assert all(math.isfinite(x) and x >= 0 for x in m["parts_s"].values())
        assert m["parts_s"]["compute"] > 0 and m["parts_s"]["optimizer"] > 0
    assert result["plans"]["tp"]["measured"]["parts_s"]["comm"] > 0  # TP all-reduces are seen
    rec = result["recalibrated"]
    assert rec["cost_after"] <= rec["cost_before"]
    cluster = load_cluster(str(out))
    assert cluster.name == "cpu-local-recalibrated" and cluster.world_size == 2
    est = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner",
            "estimate",
            MODEL,
            "--cluster",
            str(out),
            "--config",
            "dp=2,precision=fp32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert est.returncode == 0, est.stderr[-2000:]
    assert json.loads(est.stdout)["step_time_s"] > 0
