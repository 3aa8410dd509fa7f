"""Closed loop: run plans for a few steps, put measured time and memory beside the prediction, part by part.

`run_plans` emits each plan's script (`planner.emit.script`), launches `planner/validate/driver.py` once per world size
with ``python -m torch.distributed.run --standalone --nproc-per-node N`` (``OMP_NUM_THREADS=1``; gloo on CPU, NCCL
on GPUs: the emitted script picks the backend), and merges the ranks' measurements into `Measurement`s.
`compare` lines them up with the plan's prediction (`Comparison`). Recalibration is in `planner.validate.fit`.

Parts compared (predicted ← the estimate's ``breakdown_s``; measured ← the driver):

- compute: predicted compute + recompute + compression; measured forward + backward minus the communication
  inside them, on the rank that computes most;
- comm: predicted tp_comm + cp_comm + dp_comm_exposed; measured main-thread time in collectives (profiled step;
  the copies DTensor makes around sequence-parallel collectives, which tp_comm includes, `costmodel.layercost.
  seq_relayout_bytes`, are ops of their own and measure as compute);
- optimizer: predicted optimizer (the step, the gradient clipping before it with its norm's all-reduce, and ZeRO-1's
  parameter broadcasts, which ZeroRedundancyOptimizer's step makes); measured the optimizer step (its hooks) and the
  script's clipping, the collectives inside them included;
- idle: predicted bubble + pp_comm; measured step − compute − comm − optimizer (pipeline waits);
- step: the step time (median over the timed steps of the slowest rank).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from planner.plan import LayerStrategy, Plan, StageInfo, provenance
from planner.search.outer import profile_for

DRIVER = Path(__file__).with_name("driver.py")
PARTS = ("compute", "comm", "optimizer", "idle", "step")


# ------------------------------------------------------------------------------------------- plans from configs
def plan_from(lg, cluster, cluster_spec: str, model: str, global_batch: int, cfg, *, acs=None,
              stage_of=None, solver: dict | None = None) -> Plan:
    """A `Plan` for ``cfg`` from the cost model (even stages unless ``stage_of``; ``cfg.ac`` unless ``acs``)."""
    from costmodel.estimate import Evaluator, block_acs, even_stages, selective_of
    from costmodel.layercost import is_tp_layer

    n = len(lg.layers)
    acs = list(acs) if acs is not None else [cfg.ac] * n
    stage_of = list(stage_of) if stage_of is not None else even_stages(lg, cfg.pp * cfg.vpp)
    est = Evaluator(lg, cluster, cfg, global_batch).evaluate(acs, stage_of)
    planned = block_acs(lg, acs)  # (the runtime checkpoints blocks only)
    layers = tuple(LayerStrategy(name=layer.name, stage=stage_of[i], ac=planned[i],
                                 tp=cfg.tp > 1 and layer.kind == "block" and is_tp_layer(layer))
                   for i, layer in enumerate(lg.layers))
    stages = tuple(StageInfo(index=s.index, rank=s.rank, first=s.first, last=s.last, time_s=s.time_s,
                             memory_bytes=s.memory_bytes, inflight=s.inflight, memory_parts=s.memory_parts)
                   for s in est.stages)
    return Plan(model=model, fingerprint=lg.model.fingerprint, seq=lg.model.seq, global_batch=global_batch,
                cluster=cluster_spec, config=cfg, layers=layers, stages=stages, predicted=est.to_json(),
                solver=solver or {"status": "GIVEN", "objective": est.step_time_s}, selective=selective_of(lg, acs),
                provenance=_plain(provenance({"name": cluster.name, "world": cluster.world_size})))


def _plain(d: dict) -> dict:
    """Plain ``str`` values (``torch.__version__`` is a str subclass that ``yaml.safe_dump`` refuses)."""
    return {k: _plain(v) if isinstance(v, dict) else str(v) if isinstance(v, str) else v for k, v in d.items()}


def plan_from_config(model: str, cluster_spec: str, global_batch: int, config: str | dict, *, lg=None) -> Plan:
    """A plan for ``k=v,…`` (``precision`` defaults to fp32 on CPU clusters) without search."""
    from costmodel.cluster import load_cluster
    from costmodel.config import ParallelConfig, parse_kv

    cluster = load_cluster(cluster_spec)
    kv = parse_kv(config) if isinstance(config, str) else dict(config)
    if cluster.device.name.startswith("cpu"):
        kv.setdefault("precision", "fp32")
    lg = lg or profile_for(model, cluster)
    return plan_from(lg, cluster, cluster_spec, model, global_batch, ParallelConfig(**kv))


def plan_from_search(model: str, cluster_spec: str, global_batch: int, *, fix: dict | None = None, lg=None,
                     time_limit: float = 30.0) -> Plan:
    """The plan `planner.search.outer.search` picks (CPU clusters: ``precision=fp32`` fixed)."""
    from costmodel.cluster import load_cluster
    from planner.search.outer import search

    cluster = load_cluster(cluster_spec)
    fix = dict(fix or {})
    if cluster.device.name.startswith("cpu"):
        fix.setdefault("precision", "fp32")
    lg = lg or profile_for(model, cluster)
    res = search(lg, cluster, global_batch, fix=fix, time_limit=time_limit, progress=False)
    b = res.best
    solver = {"status": res.status, "objective": b.objective, "bound": b.bound, "gap": b.gap, "time_s": res.time_s,
              "candidates": res.candidates}
    return plan_from(lg, cluster, cluster_spec, model, global_batch, b.config, acs=b.acs, stage_of=b.stage_of,
                     solver=solver)


def as_runs(plans: dict[str, Plan], measured: dict[str, Measurement], lgs: list) -> tuple[list[dict], list[str]]:
    """The measured plans as `autopar calibrate` runs (`costmodel.runs`; ``validate --runs-out``), and the names of
    those left out. A run is a configuration with one recomputation choice for every layer and even pipeline stages,
    which is what `costmodel.runs.predict` evaluates; a plan whose ILP chose per layer or placed the stages itself is
    not one, nor one priced from a profile file (``lgs``: the plans' layer graphs, in order, for the even split)."""
    from costmodel.estimate import even_stages

    runs, left_out = [], []
    for (name, plan), lg in zip(plans.items(), lgs, strict=True):
        if plan.profile:  # (a run is priced on the cluster's own compute, which the plan's was not)
            left_out.append(name)
            continue
        # (the blocks': the runtime checkpoints nothing else, `costmodel.estimate.block_acs`)
        acs = {lay.ac for lay, layer in zip(plan.layers, lg.layers) if layer.kind == "block"}
        stages = [lay.stage for lay in plan.layers]
        if len(acs) != 1 or stages != list(even_stages(lg, plan.config.pp * plan.config.vpp)):
            left_out.append(name)
            continue
        config = plan.config.to_dict() | {"ac": next(iter(acs)).value}
        runs.append({"name": name, "model": plan.model, "cluster": plan.cluster, "global_batch": plan.global_batch,
                     "seq_len": plan.seq, "config": config, "step_time_s": measured[name].step_s})
    return runs, left_out


def plan_profile(plan: Plan, lg, cluster) -> tuple[dict, int] | None:
    """The measured layer times the plan was priced from (its ``profile``, `costmodel.measured.load_measured`), or
    None when it was priced from the cluster's own compute; ValueError saying what to do when it cannot be read."""
    if not plan.profile:
        return None
    from costmodel.measured import load_measured

    try:
        return load_measured(plan.profile, lg, cluster)
    except ValueError as exc:
        raise ValueError(f"the plan was priced from profile {plan.profile}: {exc}; or delete the plan file's "
                         "`profile:` line to price it on the cluster's own compute") from None


def repredict(plan: Plan, cluster, lg=None) -> dict:
    """The plan's estimate on another cluster (e.g. a recalibrated one), same layers, stages and AC, its compute
    priced as the plan's was (from its profile file when it was made with one)."""
    from costmodel.estimate import Evaluator

    lg = lg or profile_for(plan.model, cluster, seq=plan.seq)
    measured = plan_profile(plan, lg, cluster)
    acs = [lay.ac for lay in plan.layers]
    stage_of = [lay.stage for lay in plan.layers]
    return Evaluator(lg, cluster, plan.config, plan.global_batch, measured=measured,
                     compiled=bool(plan.compile)).evaluate(acs, stage_of).to_json()


# ------------------------------------------------------------------------------------------------ measurement
@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one plan did on the machine, merged over ranks (seconds, bytes)."""

    name: str  #: the plan's label
    step_s: float  #: median step time of the slowest rank after warm-up
    compute_s: float  #: forward + backward minus the communication inside them, on the busiest rank
    comm_s: float  #: exposed communication (main thread inside collectives) on the busiest rank
    optimizer_s: float  #: optimizer step on the busiest rank
    forward_s: float  #: forward, busiest rank (communication inside included)
    backward_s: float  #: backward, busiest rank (communication inside included)
    peak_memory_bytes: float  #: largest peak over ranks
    per_rank: tuple[dict, ...] = field(default_factory=tuple)  #: the raw driver output of each rank

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.comm_s - self.optimizer_s)

    def parts(self) -> dict:
        return {"compute": self.compute_s, "comm": self.comm_s, "optimizer": self.optimizer_s, "idle": self.idle_s,
                "step": self.step_s}

    def to_dict(self) -> dict:
        return {"name": self.name, "step_s": self.step_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "parts_s": self.parts(), "peak_memory_bytes": self.peak_memory_bytes,
                "steps_s": [r["steps_s"] for r in self.per_rank], "losses": self.per_rank[0]["losses"],
                "backend": self.per_rank[0]["backend"], "device": self.per_rank[0]["device"]}


def merge_ranks(name: str, ranks: list[dict]) -> Measurement:
    per_step = [max(vals) for vals in zip(*(r["steps_s"] for r in ranks))]
    busiest = max(ranks, key=lambda r: r["forward_s"] + r["backward_s"] - r["comm_in_compute_s"])
    compute = max(0.0, busiest["forward_s"] + busiest["backward_s"] - busiest["comm_in_compute_s"])
    return Measurement(name=name, step_s=statistics.median(per_step), compute_s=compute, comm_s=busiest["comm_s"],
                       optimizer_s=busiest["optimizer_s"], forward_s=busiest["forward_s"],
                       backward_s=busiest["backward_s"], peak_memory_bytes=max(r["peak_memory_bytes"] for r in ranks),
                       per_rank=tuple(ranks))


def launch(cases: list[dict], nproc: int, workdir: Path, *, timeout: float = 600) -> dict[str, list[dict]]:
    """Run the driver over ``cases`` with ``nproc`` ranks; {case name: [rank 0 result, rank 1 result, …]}."""
    cases_file = workdir / f"cases_{nproc}.json"
    cases_file.write_text(json.dumps(cases))
    out = workdir / f"out_{nproc}"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(DRIVER), str(cases_file), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
    ranks = [json.loads((out / f"rank{r}.json").read_text())["cases"] for r in range(nproc)]
    return {c["name"]: [rk[c["name"]] for rk in ranks] for c in cases}


def run_plans(plans: dict[str, Plan], *, steps: int = 5, warmup: int = 2, nproc: int | None = None,
              workdir: str | Path | None = None, rounds: int = 1) -> dict[str, Measurement]:
    """Emit and measure every plan; one torchrun launch per world size. ``nproc`` overrides the world size.
    ``rounds``: each plan measured that many times, all the plans of a launch in turn each round (the driver
    pools the rounds: `planner.validate.driver.combine`), so that a drift in the machine's speed falls on every
    plan rather than on the few measured while it lasted."""
    from planner.emit.script import write_script

    if steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"--steps {steps} and --rounds {rounds} must be ≥ 1 and warm-up {warmup} ≥ 0")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="autopar-validate-")
        workdir = tmp.name
    workdir = Path(workdir)
    try:
        groups: dict[int, list[dict]] = {}
        for name, plan in plans.items():
            script = write_script(plan, workdir / f"train_{_safe(name)}.py", steps=steps)
            groups.setdefault(nproc or plan.config.world, []).append(
                {"name": name, "script": str(script), "steps": steps, "warmup": warmup})
        out: dict[str, Measurement] = {}
        for n, cases in sorted(groups.items()):
            for name, ranks in launch(cases * rounds, n, workdir, timeout=600 * rounds).items():
                out[name] = merge_ranks(name, ranks)
        return {name: out[name] for name in plans}
    finally:
        if tmp is not None:
            tmp.cleanup()


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)[:60]


# ------------------------------------------------------------------------------------------------- comparison
def predicted_parts(predicted: dict) -> dict:
    b = predicted["breakdown_s"]
    return {"compute": b["compute"] + b["recompute"] + b["compression"],
            "comm": b["tp_comm"] + b["cp_comm"] + b.get("ep_comm", 0.0) + b["dp_comm_exposed"],
            "optimizer": b["optimizer"],
            "idle": b["bubble"] + b["pp_comm"], "step": predicted["step_time_s"]}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Predicted beside measured for one plan."""

    name: str
    config: dict
    predicted: dict  #: part → seconds (PARTS)
    measured: dict  #: part → seconds
    predicted_memory_bytes: float
    measured_memory_bytes: float

    def error(self, part: str) -> float | None:
        """(predicted − measured) / measured, or None when the measured part is below 1 ms (noise)."""
        m = self.measured[part]
        return None if m < 1e-3 else (self.predicted[part] - m) / m

    def to_dict(self) -> dict:
        return {"name": self.name, "config": self.config, "predicted_s": self.predicted, "measured_s": self.measured,
                "error": {p: self.error(p) for p in PARTS},
                "memory": {"predicted_bytes": self.predicted_memory_bytes,
                           "measured_bytes": self.measured_memory_bytes}}


def compare(name: str, plan: Plan, meas: Measurement, predicted: dict | None = None) -> Comparison:
    pred = predicted or plan.predicted
    if not pred:
        raise ValueError(f"plan {name} has no prediction; write it with `autopar plan` (or re-estimate it)")
    return Comparison(name=name, config=plan.config.to_dict(), predicted=predicted_parts(pred),
                      measured=meas.parts(), predicted_memory_bytes=pred["memory_per_gpu_bytes"]["peak"],
                      measured_memory_bytes=meas.peak_memory_bytes)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 1.0


def summary(comps: list[Comparison]) -> dict:
    """Mean absolute relative error of the step time and Spearman's rank correlation, predicted vs measured."""
    pred = [c.predicted["step"] for c in comps]
    meas = [c.measured["step"] for c in comps]
    mae = statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas))
    return {"plans": len(comps), "step_mae": mae, "spearman": spearman(pred, meas) if len(comps) > 1 else 1.0}


def short_config(cfg: dict) -> str:
    """The non-default keys of a configuration, ``dp=2,zero=3``."""
    from costmodel.config import ParallelConfig

    default = ParallelConfig().to_dict()
    keep = {k: v for k, v in cfg.items() if v != default.get(k) and k != "precision"}
    if int(cfg.get("pp", 1)) == 1:
        keep.pop("schedule", None)
    return ",".join(f"{k}={v}" for k, v in keep.items()) or "single"


def render(comps: list[Comparison], file=sys.stdout, title: str = "predicted vs measured") -> None:
    """A terminal table: per plan and part, predicted / measured ms and the error."""
    print(title, file=file)
    head = f"{'plan':28s} {'config':34s}" + "".join(f" {p + ' ms (pred/meas, err)':>30s}" for p in PARTS) \
        + f" {'mem MiB (pred/meas)':>20s}"
    print(head, file=file)
    for c in comps:
        cells = []
        for p in PARTS:
            e = c.error(p)
            err = f"{e * 100:+.0f}%" if e is not None else "-"
            cells.append(f" {c.predicted[p] * 1e3:11.1f} /{c.measured[p] * 1e3:8.1f} {err:>7s}")
        mem = f" {c.predicted_memory_bytes / 2**20:9.0f} /{c.measured_memory_bytes / 2**20:8.0f}"
        print(f"{c.name[:28]:28s} {short_config(c.config)[:34]:34s}" + "".join(cells) + mem, file=file)
    if comps:
        s = summary(comps)
        print(f"step time: mean |error| {s['step_mae'] * 100:.1f} %, Spearman {s['spearman']:.2f} over "
              f"{s['plans']} plans", file=file)
