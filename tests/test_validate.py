"""`autopar validate`: comparison arithmetic, recalibration rediscovering known scales, and one real gloo launch."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from costmodel.cluster import dump_cluster, load_cluster, parse_cluster_yaml
from planner.search.outer import profile_for
from planner.validate.fit import Scales, apply_scales, fit
from planner.validate.loop import (
    Measurement,
    as_runs,
    compare,
    plan_from_config,
    predicted_parts,
    repredict,
    spearman,
)

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


#: a model whose matmuls reach the efficiency curve's plateau and whose collectives are bandwidth-bound, beside the
#: tiny one (latency-bound, small matmuls): together they separate flops from f_half, latency from bandwidth
BIG = "llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=8192,seq=256"
#: ZeRO stages and micro-batch counts that weigh all-gather against reduce-scatter differently
SEPARATE = ["dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3,mbs=4"]
TRUTH = Scales(flops=0.5, memory=0.5, latency=(("all_reduce", 4.0), ("all_gather", 4.0), ("reduce_scatter", 4.0),
                                               ("broadcast", 4.0), ("send_recv", 4.0)))


def _measured_by(truth, held_out: str | None = None, *, timed: bool = False):
    """Plans of both models under every configuration, with the parts ``truth`` makes them take; the one named
    ``held_out`` ("model/config") apart. Priced by the roofline alone unless ``timed`` (the layers as measured on
    this machine, `LayerGraph.timings`)."""
    base = load_cluster("cpu-local")
    fitted, kept = ([], [], []), None
    for spec in (MODEL, BIG):
        lg = profile_for(spec, base)
        lg = lg if timed else dataclasses.replace(lg, timings=None)
        for cfg in CONFIGS + SEPARATE:
            plan = plan_from_config(spec, "cpu-local", 8, cfg, lg=lg)
            m = _fake_measurement(f"{spec}/{cfg}", predicted_parts(repredict(plan, truth, lg)))
            if f"{spec}/{cfg}" == held_out:
                kept = (plan, m, lg)
                continue
            for seq, x in zip(fitted, (plan, m, lg)):
                seq.append(x)
    return base, fitted, kept


def test_recalibration_rediscovers_a_slower_machine():
    """Measurements made by a cluster with half the FLOP/s and memory throughput and 4× every collective latency
    are fitted back to those scales (the weak prior towards 1 moves them by ≤ 3 %), the scales it did not change
    stay at 1, and every plan's step and compute time are reproduced."""
    base, (plans, meas, lgs) = _measured_by(apply_scales(load_cluster("cpu-local"), TRUTH))[:2]
    res = fit(base, plans, meas, lgs)
    got = res.scales.to_dict()
    assert got["flops"] == pytest.approx(0.5, rel=0.03) and got["memory"] == pytest.approx(0.5, rel=0.03)
    assert got["f_half"] == pytest.approx(1.0, rel=0.03)
    assert got["latency"] == pytest.approx(dict.fromkeys(got["latency"], 4.0), rel=0.03)
    assert got["bandwidth"] == pytest.approx(dict.fromkeys(got["bandwidth"], 1.0), rel=0.03)
    assert res.cost_after < 0.05 * res.cost_before
    for p, m, lg in zip(plans, meas, lgs):
        assert repredict(p, res.cluster, lg)["step_time_s"] == pytest.approx(m.step_s, rel=0.02)
        assert predicted_parts(repredict(p, res.cluster, lg))["compute"] == pytest.approx(m.compute_s, rel=0.02)


def test_recalibration_scales_compute_measured_on_this_machine():
    """Every layer measured on this machine (a CPU cluster's graph): a machine with half the FLOP/s computes them
    2× slower than measured, which the fit finds with the rest (half the memory throughput, 4× every collective
    latency), leaving the matmul curve's half-point as measured, and reproducing every plan."""
    base, (plans, meas, lgs) = _measured_by(apply_scales(load_cluster("cpu-local"), TRUTH), timed=True)[:2]
    assert all(lg.timings.measured for lg in lgs)
    res = fit(base, plans, meas, lgs)
    got = res.scales.to_dict()
    assert got["f_half"] == 1.0
    assert got["flops"] == pytest.approx(0.5, rel=0.05) and got["memory"] == pytest.approx(0.5, rel=0.05)
    for p, m, lg in zip(plans, meas, lgs):
        assert repredict(p, res.cluster, lg)["step_time_s"] == pytest.approx(m.step_s, rel=0.03)


def test_recalibration_predicts_a_plan_it_did_not_see():
    """Out of sample: fitted without the larger model's 1F1B pipeline, the recalibrated cluster predicts that
    plan's step as the slower machine ran it (before recalibration: 2× off)."""
    truth = apply_scales(load_cluster("cpu-local"), TRUTH)
    base, (plans, meas, lgs), (plan, m, lg) = _measured_by(truth, held_out=f"{BIG}/pp=2,schedule=1f1b")
    res = fit(base, plans, meas, lgs)
    assert repredict(plan, base, lg)["step_time_s"] < 0.7 * m.step_s
    assert repredict(plan, res.cluster, lg)["step_time_s"] == pytest.approx(m.step_s, rel=0.02)


def test_recalibration_frees_the_links_of_the_collectives_each_plan_calls():
    """ZeRO-1 is DDP's all-reduce and ZeroRedundancyOptimizer's broadcasts, not FSDP's all-gather and
    reduce-scatter; sequence parallelism adds all-gathers and reduce-scatters; every plan on more than one rank
    all-reduces the gradient norm and the loss; a pipeline with tensor parallelism gathers what it receives."""
    from planner.validate.fit import kinds_used

    base = load_cluster("cpu-local")
    lg = profile_for(MODEL, base)

    def kinds(config: str, cluster: str = "cpu-local") -> list[str]:
        return kinds_used([plan_from_config(MODEL, cluster, 8, config, lg=lg)], load_cluster(cluster), [lg])

    assert kinds("dp=2") == kinds("tp=2") == ["all_reduce"]
    assert kinds("dp=2,zero=1") == ["all_reduce", "broadcast"]
    assert kinds("dp=2,zero=2") == kinds("dp=2,zero=3") == kinds("tp=2,sp=on") == [
        "all_reduce", "all_gather", "reduce_scatter"]
    assert kinds("pp=2,schedule=1f1b") == ["all_reduce", "send_recv"]
    assert kinds("pp=2,tp=2,schedule=1f1b", "cpu-local:gpus_per_node=4") == ["all_reduce", "all_gather", "send_recv"]


def test_only_this_machines_measured_cpu_is_compared_with_its_speed_now():
    """`autopar validate` prints the cached cpu's benchmark beside the same benchmark now, for plans priced with
    those cached figures only."""
    from costmodel.hardware import is_measured_cpu

    cpu = load_cluster("cpu-local").device
    assert is_measured_cpu(cpu) and not is_measured_cpu(load_cluster("dgx-h100").device)
    recalibrated = apply_scales(load_cluster("cpu-local"), Scales(flops=2.0)).device  # figures of its own
    assert recalibrated.name == "cpu" and not is_measured_cpu(recalibrated)


def test_compare_reports_relative_error():
    base = load_cluster("cpu-local")
    plan = plan_from_config(MODEL, "cpu-local", 8, "dp=2", lg=profile_for(MODEL, base))
    parts = {k: 2 * v for k, v in predicted_parts(plan.predicted).items()}
    comp = compare("dp", plan, _fake_measurement("dp", parts))
    assert comp.error("step") == pytest.approx(-0.5)


def test_rounds_of_one_plan_are_pooled():
    """The driver measures a plan once per round; its steps are pooled (the step time is their median), each part
    the median over rounds, the peak memory the largest, the losses the first round's."""
    from planner.validate.driver import combine

    def run(steps, forward, peak, losses):
        return {"step_s": sorted(steps)[len(steps) // 2], "steps_s": steps, "forward_s": forward, "backward_s": 2.0,
                "optimizer_s": 0.1, "comm_s": 0.0, "comm_in_compute_s": 0.0, "profiled_step_s": 1.0,
                "peak_memory_bytes": peak, "losses": losses, "wall_s": 1.0}

    one = run([1.0, 3.0], 0.5, 10, [2.0, 1.9])
    assert combine([one]) is one
    both = combine([one, run([2.0], 0.7, 30, [2.0, 1.9]), run([9.0], 0.6, 20, [2.0, 1.9])])
    assert both["steps_s"] == [1.0, 3.0, 2.0, 9.0] and both["step_s"] == 2.5
    assert both["forward_s"] == 0.6 and both["peak_memory_bytes"] == 30 and both["rounds"] == 3
    assert both["losses"] == [2.0, 1.9] and both["wall_s"] == 3.0


@pytest.mark.dist
def test_validate_cli_measures_plans_and_recalibrates(tmp_path):
    """One launch measures three plans (DP, TP, PP), in two rounds of one step each (pooled: two steps a plan);
    --recalibrate writes a cluster that estimate/validate read."""
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
        "1",
        "--rounds",
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
    # priced on this machine's cpu as cached: its speed now beside the cached figure, before and after the plans
    assert set(result["machine_speed"]) == {"cached_flops", "before_flops", "after_flops"}
    assert result["machine_speed"]["cached_flops"] == base.device.peak("fp32")
    assert all(v > 0 for v in result["machine_speed"].values())
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


def test_measured_plans_become_runs_calibrate_reads(tmp_path):
    """`validate --runs-out`: each measured plan with one recomputation choice and even stages is written as a run
    of `autopar calibrate` (its configuration, sp included, and measured step time read back as they were); a plan
    whose layers differ is left out, by name."""
    import dataclasses

    import yaml

    from costmodel.config import AC
    from costmodel.runs import load_runs
    from planner.validate.loop import as_runs

    model = "llama-tiny"
    cluster = load_cluster("cpu-local")
    lg = profile_for(model, cluster)
    even = plan_from_config(model, "cpu-local", 8, "tp=2,sp=on,mbs=4,ac=full", lg=lg)
    mixed = even.with_(layers=tuple(dataclasses.replace(lay, ac=AC.NONE) if k == 1 else lay
                                    for k, lay in enumerate(even.layers)))
    seen = {name: Measurement(name=name, step_s=0.25, compute_s=0.2, comm_s=0.03, optimizer_s=0.01, forward_s=0.1,
                              backward_s=0.13, peak_memory_bytes=1e8) for name in ("even", "mixed")}
    runs, left_out = as_runs({"even": even, "mixed": mixed}, seen, [lg, lg])
    assert left_out == ["mixed"] and len(runs) == 1
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(runs, sort_keys=False))
    (run,) = load_runs(path)
    assert (run.model, run.global_batch, run.measured_step_s) == (model, 8, 0.25)
    assert run.config == even.config and run.config.sp is True and run.config.ac == AC.FULL


def test_a_plan_priced_from_a_profile_is_repriced_from_it(tmp_path):
    """`plan --profile` records the profile in the plan file, and `validate` (``repredict``, the recalibration's
    fit) prices the plan from it again, not from this machine's own layer times; a profile gone is said, not
    replaced."""
    from planner.cli.main import main
    from planner.plan import Plan

    base = load_cluster("cpu-local")
    lg = profile_for(MODEL, base)
    prof = tmp_path / "prof.json"  # every layer ten times slower than this machine measured it
    prof.write_text(json.dumps({"model": lg.model.name, "seq": lg.model.seq, "measured": {
        "device": "cpu:test", "batch": lg.timings.batch,
        "layers": {k: {"fwd_s": 10 * f, "bwd_s": 10 * b} for k, (f, b) in lg.timings.layers.items()}}}))
    out = tmp_path / "plan.yaml"
    assert main(["plan", MODEL, "--cluster", "cpu-local", "--global-batch", "8", "--fix", "dp=2,mbs=1",
                 "--profile", str(prof), "--check", "off", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.profile == str(prof)
    assert repredict(plan, base, lg)["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    own = repredict(dataclasses.replace(plan, profile=None), base, lg)
    assert own["breakdown_s"]["compute"] < 0.2 * plan.predicted["breakdown_s"]["compute"]
    # its compute measured layer by layer, the recalibration keeps the matmul curve's half-point (as for a graph
    # timed here); and it is no run for `autopar calibrate`, which prices runs on the cluster's own compute
    parts = predicted_parts(plan.predicted)
    meas = _fake_measurement("p", parts | {"step": 1.5 * parts["step"], "compute": 1.7 * parts["compute"]})
    bare = dataclasses.replace(lg, timings=None)  # (on the roofline alone the half-point moves: 1.7 seen)
    assert fit(base, [plan], [meas], [bare]).scales.f_half == 1.0
    assert fit(base, [dataclasses.replace(plan, profile=None)], [meas], [bare]).scales.f_half != pytest.approx(1.0)
    assert as_runs({"p": plan}, {"p": meas}, [lg]) == ([], ["p"])
    prof.unlink()
    with pytest.raises(ValueError, match="priced from profile .*prof.json.* not found.*delete the plan file's"):
        repredict(plan, base, lg)
    # validate says so before it runs the plans, not after
    rc = main(["validate", str(out), "--recalibrate", str(tmp_path / "recal.yaml"), "--steps", "1"])
    assert rc == 2 and not (tmp_path / "recal.yaml").exists()
