"""`autopar inspect`: the terminal report's content and the JSON for three plans (pure DP, 3-D with interleaving,
compression on), and bad input. Plans are built from the cost model directly (`make_plan`), not by the search."""

from __future__ import annotations

import functools
import json
import re

import pytest

from costmodel.cluster import load_cluster
from costmodel.config import ParallelConfig
from costmodel.estimate import Evaluator
from planner.cli.main import main
from planner.plan import LayerStrategy, Plan, StageInfo
from profiler.api import profile_model


@functools.cache
def _graph(model: str):
    return profile_model(model)


def make_plan(model: str, cluster: str, config: str, global_batch: int, *, alternatives: tuple[str, ...] = (),
              why_key: str | None = "lost_by", solver: dict | None = None) -> Plan:
    """A Plan from `Evaluator.evaluate` for ``config`` (k=v,…), with alternatives evaluated the same way.
    ``why_key``: the key under which each alternative stores the term it lost on (None: not stored)."""
    from costmodel.config import parse_kv

    lg, cl = _graph(model), load_cluster(cluster)

    def est_of(text):
        cfg = ParallelConfig(**parse_kv(text))
        return cfg, Evaluator(lg, cl, cfg, global_batch).evaluate()

    cfg, est = est_of(config)
    stage_of = {i: s.index for s in est.stages for i in range(s.first, s.last + 1)}
    alts = []
    for text in alternatives:
        acfg, aest = est_of(text)
        alt = {"config": acfg.to_dict(), "predicted": aest.to_json()}
        if why_key:
            diffs = {k: aest.breakdown_s[k] - est.breakdown_s[k] for k in est.breakdown_s}
            key = max(diffs, key=diffs.get)
            alt[why_key], alt[f"{why_key}_s"] = key, diffs[key]
        alts.append(alt)
    return Plan(model=model, fingerprint=lg.model.fingerprint, seq=lg.model.seq, global_batch=global_batch,
                cluster=cluster, config=cfg,
                layers=tuple(LayerStrategy(name=lay.name, stage=stage_of[i], ac=cfg.ac, tp=cfg.tp > 1)
                             for i, lay in enumerate(lg.layers)),
                stages=tuple(StageInfo(index=s.index, rank=s.rank, first=s.first, last=s.last, time_s=s.time_s,
                                       memory_bytes=s.memory_bytes, inflight=round(s.inflight))
                             for s in est.stages),
                predicted=est.to_json(),
                solver=solver if solver is not None else {"status": "OPTIMAL", "objective": est.step_time_s,
                                                          "bound": est.step_time_s, "gap": 0.0, "time_s": 0.42,
                                                          "candidates": 17},
                alternatives=tuple(alts), provenance={"autopar_version": "test"})


def dp_plan() -> Plan:
    return make_plan("gpt-tiny", "cpu-local", "dp=2,mbs=1", 8, alternatives=("dp=1,tp=2,mbs=1",))


def three_d_plan() -> Plan:
    return make_plan("gpt-small", "dgx-a100-80g", "dp=2,tp=2,pp=2,vpp=2,schedule=interleaved,mbs=1,ac=selective,"
                     "zero=1,sp=on", 16,
                     alternatives=("dp=2,tp=2,pp=2,schedule=1f1b,mbs=1,ac=selective,zero=1",
                                   "dp=4,tp=2,pp=1,mbs=1,ac=full", "dp=1,tp=8,pp=1,mbs=2"))


def compressed_plan() -> Plan:
    return make_plan("gpt-small", "dgx-a100-80g:nodes=2", "dp=8,tp=1,pp=2,schedule=1f1b,mbs=1,"
                     "grad_compress=powersgd-4,pp_compress=bf16,precision=fp32", 32,
                     alternatives=("dp=16,mbs=1,grad_compress=bf16",), why_key=None)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    out = {}
    for name, build in (("dp", dp_plan), ("3d", three_d_plan), ("compressed", compressed_plan)):
        plan = build()
        plan.save(d / f"{name}.yaml")
        out[name] = (d / f"{name}.yaml", plan)
    return out


def _inspect(capsys, *argv) -> str:
    assert main(["inspect", *map(str, argv)]) == 0
    return capsys.readouterr().out


def test_pure_dp_report(plans, capsys):
    path, plan = plans["dp"]
    out = _inspect(capsys, path)
    p = plan.predicted
    assert "plan for gpt-tiny on cpu-local (2 ranks)" in out
    assert "dp=2 tp=1 pp=1" in out
    for label in ("step time", "tokens/s", "MFU", "HFU"):
        assert label in out
    assert f"{p['mfu'] * 100:.1f} %" in out
    assert re.search(r"memory per GPU \(peak rank\): [\d.]+ MiB of [\d.]+ GiB", out)
    assert "layers.0–1  2" in out  # two identical blocks compressed into one run
    assert "replicated (DDP)" in out
    assert re.search(r"dp_comm_exposed .*all-reduce ≈", out)  # DDP: hidden part of the all-reduce known
    assert "dp groups of 2 (stride 1): 1 node(s), 2 per node, intra-node: gloo over loopback" in out
    alt = plan.alternatives[0]  # the tp=2 alternative: the term it lost on, and by how much
    assert alt["lost_by"] in ("compute", "tp_comm") and f"{alt['lost_by']} (+" in out
    assert "status OPTIMAL" in out and "gap 0.00%" in out


def test_three_d_interleaved_report(plans, capsys):
    path, _ = plans["3d"]
    out = _inspect(capsys, path)
    assert "schedule=interleaved" in out and "vpp=2" in out
    stage_lines = [ln for ln in out.splitlines() if re.match(r"\s+[0-3]\s+[01]\s+(embed|layers|head)", ln)]
    assert len(stage_lines) == 4  # 2 ranks × 2 virtual stages
    assert "layers.0–3  4  0–3     column/row (Megatron)  selective  ZeRO-1 (optimizer sharded)" in out
    assert "tp groups of 2 (stride 1)" in out and "pp groups of 2 (stride 4)" in out
    assert "NVLink" in out
    assert out.count("\n1  ") + out.count("\n2  ") + out.count("\n3  ") >= 3  # three alternatives
    assert "vpp=1,schedule=1f1b" in out


def test_compression_report_warns_about_numerics(plans, capsys):
    path, _ = plans["compressed"]
    out = _inspect(capsys, path)
    assert "grad_compress=powersgd-4" in out
    assert "! grad_compress=powersgd-4: gradients are reduced as rank-4 approximations" in out
    assert "! pp_compress=bf16: activations and their gradients cross pipeline stages in bf16" in out
    assert "pp groups of 2 (stride 8): 2 node(s), 1 per node, network: HDR InfiniBand" in out
    assert re.search(r"\ncompression\s+[\d.]+ (µs|ms|s)\s+[\d.]+ %", out)
    # the alternative was stored without a "why it lost" key: the report derives it from the breakdowns
    assert re.search(r"dp=16,pp=1,grad_compress=bf16.* (dp_comm_exposed|compute|bubble|pp_comm)", out)


def test_memory_margin_and_solver_gap_warnings(plans):
    from planner.report.facts import build_report

    plan = plans["dp"][1]
    pred = dict(plan.predicted)
    pred["capacity_bytes"] = pred["memory_per_gpu_bytes"]["peak"] / 0.97
    rep = build_report(plan.with_(predicted=pred, solver={"status": "FEASIBLE", "gap": 0.04}))
    text = " | ".join(rep["warnings"])
    assert "memory within 5% of the device" in text
    assert "solver gap 4.0%" in text and "solver status FEASIBLE" in text


def test_dominant_link_warning(plans):
    from planner.report.facts import build_report

    plan = plans["3d"][1]
    pred = dict(plan.predicted)
    bd = dict(pred["breakdown_s"])
    bd["tp_comm"] = 0.4 * pred["step_time_s"]
    rep = build_report(plan.with_(predicted=pred | {"breakdown_s": bd}))
    assert any(re.match(r"tp_comm is 40% of the step: the tensor-parallel communication over intra-node: NVLink", w)
               for w in rep["warnings"])


def test_json_is_one_object(plans, capsys):
    path, plan = plans["3d"]
    rep = json.loads(_inspect(capsys, path, "--json"))
    assert rep["predicted"]["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])
    assert rep["config"]["schedule"] == "interleaved"
    assert [s["rank"] for s in rep["stages"]] == [0, 1, 0, 1]
    assert [r["count"] for r in rep["layer_runs"]] == [1, 4, 1]
    assert {a["lost_by"] for a in rep["alternatives"]} <= set(plan.predicted["breakdown_s"]) | {"memory"}
    assert {g["kind"]: g["link"] for g in rep["mesh"]["groups"]}["tp"].startswith("intra-node")
    assert {b["term"] for b in rep["breakdown"]} >= {"compute", "bubble", "dp_comm_exposed"}


def test_layer_runs_break_on_strategy_changes():
    from costmodel.config import AC
    from planner.report.facts import layer_runs

    plan = dp_plan()
    lays = [LayerStrategy(name="embed", stage=0)] + [
        LayerStrategy(name=f"layers.{i}", stage=0, ac=AC.FULL if i >= 3 else AC.NONE) for i in range(6)] + [
        LayerStrategy(name="head", stage=0)]
    runs = layer_runs(plan.with_(layers=tuple(lays)))
    assert [r["text"] for r in runs] == [
        "embed: no tp, ac=none, replicated (DDP)", "layers.0–2 ×3: no tp, ac=none, replicated (DDP)",
        "layers.3–5 ×3: no tp, ac=full, replicated (DDP)", "head: no tp, ac=none, replicated (DDP)"]


@pytest.mark.parametrize("content", [None, "just a string\n", "schema_version: 1\nmodel: x\n", "{{{: ["])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "plan.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["inspect", str(path), "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar inspect: error: ") and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()


def test_memory_bars_are_exact_per_rank_when_the_plan_has_them():
    """Plans from `autopar plan` carry every rank's memory breakdown: the bars use it, no estimate."""
    from dataclasses import replace

    from planner.report.facts import build_report
    from planner.report.svg import rank_memory

    lg, cl = _graph("gpt-small"), load_cluster("dgx-a100-80g")
    cfg = ParallelConfig(dp=2, pp=4, mbs=1)
    est = Evaluator(lg, cl, cfg, 16).evaluate()
    plan = make_plan("gpt-small", "dgx-a100-80g", "dp=2,pp=4", 16)
    plan = replace(plan, stages=tuple(replace(s, memory_parts=e.memory_parts) for s, e in zip(plan.stages,
                                                                                              est.stages)))
    rows = rank_memory(build_report(plan))
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and all(r["exact"] for r in rows)
    for r, s in zip(rows, est.stages):
        assert sum(r["parts"].values()) == pytest.approx(s.memory_bytes)
    assert len({round(r["parts"]["activations"]) for r in rows}) > 1  # 1F1B: earlier ranks hold more


def test_inspect_names_what_made_each_alternative_lose(plans):
    """Stored or derived (a plan file without the key), the term `inspect` names is the breakdown term that grew
    most against the winner, by the seconds it shows: computed here from the two predicted breakdowns."""
    from planner.report.facts import build_report

    for name in ("3d", "compressed"):  # "compressed" stores no "why it lost": the report derives it
        _, plan = plans[name]
        rep = build_report(plan)
        assert len(rep["alternatives"]) == len(plan.alternatives) > 0
        for shown, alt in zip(rep["alternatives"], plan.alternatives):
            grew = {k: v - plan.predicted["breakdown_s"].get(k, 0.0)
                    for k, v in alt["predicted"]["breakdown_s"].items()}
            assert shown["lost_by"] == max(grew, key=lambda k: (grew[k], k)), (name, grew)
            assert shown["lost_by_s"] == pytest.approx(max(grew.values()))
