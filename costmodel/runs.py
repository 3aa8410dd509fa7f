"""Calibrate a cluster from runs the user measured (`autopar calibrate RUNS.yaml --cluster C --out C.yaml`).

A user does not need a cost model that is right about every software stack, only about theirs. Each run they
measured, with any framework, is a step time of one configuration; this module fits the device's efficiency
constants (the ones `python -m costmodel.calibrate` fits on published runs) so that the cost model reproduces
those runs, and writes the cluster with them.

RUNS.yaml (the shared/DESIGN.md contract) is a list of runs::

    - model: llama3-8b                 # any model spec autopar takes
      cluster: dgx-h100:nodes=4        # its cluster (same device as --cluster; nodes may differ)
      global_batch: 256
      seq_len: 8192                    # optional: the model's default otherwise
      config: {tp: 2, zero: 3, mbs: 2, ac: selective}   # the keys that are known (`ParallelConfig`), or as
                                       # --config writes them: "tp=2,zero=3,mbs=2,ac=selective"
      step_time_s: 6.2                 # or tokens_per_s: 338000

What a set of runs can identify: step times constrain the constants through the time they predict, and one run
is one equation. So the constants are unlocked in order of how much of a step they set, one per run: the matmul
peak efficiency ``e_max`` (most of a training step is GEMMs), then the matmul curve's half-efficiency size
``f_half`` (small against large GEMMs: runs that differ in tp or hidden size), the memory-bound efficiency
``memory_eff`` (norms, element-wise ops), the slowdown of compute that overlaps communication
``overlap_slowdown``, and the fused-attention efficiency ``attention_eff``. The others keep the cluster's values
(its fused attention's sequence half-point ``attention_seq_half`` among them: `python -m costmodel.calibrate` fits
it on runs at many lengths).
A constant no run depends on is skipped whatever the number of runs (`costmodel.calibrate.depends_on`: the
fused-attention efficiency for runs whose attention is unfused, the overlap slowdown for runs that overlap no
communication) and reported as such: it keeps the cluster's value, and the next constant takes its place.
The fit minimises the relative error of the step time: for one constant, the mean absolute error (a bounded
one-dimensional search); for more, the sum of squared relative errors (trust-region least squares on bounded,
transformed parameters), polished by Nelder-Mead on the mean absolute error when runs outnumber constants. Start
from the stack the runs were measured with (``--cluster dgx-h100:stack=composer``): the constants a fit keeps are
that stack's. Links are not fitted: a step time alone does
not separate bandwidth from latency (`autopar validate --recalibrate` fits them from its per-part measurements).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from costmodel.cluster import Cluster, load_cluster
from costmodel.config import ParallelConfig, parse_kv
from costmodel.hardware import EfficiencyCurve

#: the constants in the order runs unlock them, with their bounds (the fit never leaves them)
UNLOCK_ORDER = ("e_max", "f_half", "memory_eff", "overlap_slowdown", "attention_eff")
_BOUNDS = {"e_max": (0.05, 1.0), "f_half": (1e6, 1e14), "memory_eff": (0.05, 1.0), "overlap_slowdown": (0.0, 0.9),
           "attention_eff": (0.05, 1.0)}


def _space(name: str):
    """(to, from) the space a constant is searched in: the matmul curve's half-point in log space (its bounds span
    eight decades), the efficiencies as they are."""
    return (math.log, math.exp) if name == "f_half" else (float, float)


_RUN_KEYS = ("model", "cluster", "global_batch", "seq_len", "config", "step_time_s", "tokens_per_s", "name")


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured run: what ran, and its step time."""

    name: str
    model: str
    cluster: str
    global_batch: int
    seq_len: int | None
    config: ParallelConfig
    measured_step_s: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted cluster and how well it reproduces each run."""

    cluster: Cluster
    #: the constants fitted: the first len(runs) of those in `UNLOCK_ORDER` that some run depends on
    fitted: tuple[str, ...]
    values: dict  #: each fitted constant's value
    before_s: tuple[float, ...]  #: each run predicted with the given cluster
    after_s: tuple[float, ...]  #: … and with the fitted one
    runs: tuple[Run, ...]
    unidentifiable: tuple[str, ...] = ()  #: the constants of `UNLOCK_ORDER` no run depends on (kept)

    def errors(self) -> list[float]:
        return [p / r.measured_step_s - 1 for p, r in zip(self.after_s, self.runs, strict=True)]


def load_runs(path: str | Path) -> list[Run]:
    """The runs of a RUNS.yaml file; ValueError naming the file, the run and the key for anything wrong."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"runs file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of runs (each with model, cluster, global_batch, config, "
                         "step_time_s or tokens_per_s)")
    return [_run(path, k, item) for k, item in enumerate(data)]


def _run(path: Path, k: int, item: Any) -> Run:
    where = f"{path}: run {k + 1}"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping, got {item!r}")
    unknown = sorted(set(item) - set(_RUN_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; a run has {', '.join(_RUN_KEYS)}")
    for key in ("model", "cluster", "global_batch"):
        if key not in item:
            raise ValueError(f"{where}: missing key {key!r}")
    if not isinstance(item["model"], str) or not isinstance(item["cluster"], str):
        raise ValueError(f"{where}: model and cluster must be specs (strings)")
    gb, seq = item["global_batch"], item.get("seq_len")
    for key, value in (("global_batch", gb), ("seq_len", seq)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {key} must be an integer ≥ 1, got {value!r}")
    if ("step_time_s" in item) == ("tokens_per_s" in item):
        raise ValueError(f"{where}: give exactly one of step_time_s or tokens_per_s")
    measured = item.get("step_time_s", item.get("tokens_per_s"))
    if isinstance(measured, bool) or not isinstance(measured, (int, float)) or not measured > 0:
        raise ValueError(f"{where}: step_time_s / tokens_per_s must be a positive number, got {measured!r}")
    config = item.get("config") or {}
    if isinstance(config, str):  # (as --config and --baseline write it: "tp=2,zero=3,ac=selective")
        config = parse_kv(config, what=f"{where}: config")
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config must be a mapping of ParallelConfig keys or k=v,… as --config takes "
                         f"them, got {config!r}")
    known = [f.name for f in dataclasses.fields(ParallelConfig)]
    bad = sorted(set(config) - set(known))
    if bad:
        raise ValueError(f"{where}: unknown config key {bad[0]}; known: {', '.join(known)}")
    try:  # (from_dict: ``sp: "off"`` is off, not a true-looking string)
        cfg = ParallelConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if "tokens_per_s" in item:
        if seq is None:
            raise ValueError(f"{where}: tokens_per_s needs seq_len (the tokens of one sequence)")
        measured = gb * seq / measured
    return Run(name=str(item.get("name", f"run {k + 1}")), model=item["model"], cluster=item["cluster"],
               global_batch=gb, seq_len=seq, config=cfg, measured_step_s=float(measured))


def _graph(model: str, seq_len: int | None, cluster: Cluster):
    """The layer graph the cost model uses for the run's model on its cluster (`costmodel.measured.layer_graph`,
    captured once per process there)."""
    from costmodel.measured import layer_graph

    return layer_graph(model, cluster, seq_len)


def _with(cluster: Cluster, values: dict, source: str) -> Cluster:
    dev = cluster.device
    curve = EfficiencyCurve(e_max=values.get("e_max", dev.matmul_eff.e_max),
                            f_half=values.get("f_half", dev.matmul_eff.f_half), source=source)
    kept = {k: v for k, v in values.items() if k in ("memory_eff", "overlap_slowdown", "attention_eff")}
    return dataclasses.replace(cluster, device=dataclasses.replace(dev, matmul_eff=curve, **kept))


def predict(run: Run, device_from: Cluster) -> float:
    """The run's predicted step time on its own cluster, with ``device_from``'s device (the constants)."""
    from costmodel.calibrate import _cluster  # a measured run's cluster (whole-card memory), parsed once per spec
    from costmodel.estimate import Evaluator

    own = dataclasses.replace(_cluster(run.cluster), device=device_from.device)
    return Evaluator(_graph(run.model, run.seq_len, own), own, run.config, run.global_batch).evaluate().step_time_s


def calibrate(runs: Sequence[Run], cluster: Cluster) -> Calibration:
    """Fit the first ``len(runs)`` constants of `UNLOCK_ORDER` that the runs depend on, of ``cluster``'s device,
    to ``runs`` (see the module)."""
    if not runs:
        raise ValueError("calibrate needs at least one run")
    for run in runs:
        theirs, ours = load_cluster(run.cluster).device, cluster.device
        if (dict(theirs.peak_flops), theirs.memory_bytes, theirs.hbm_bw) != (dict(ours.peak_flops),
                                                                            ours.memory_bytes, ours.hbm_bw):
            raise ValueError(f"{run.name}: its cluster {run.cluster} has {theirs.name} devices, the cluster to "
                             f"calibrate has {ours.name}; calibrate the runs of one device kind")
    from costmodel.calibrate import depends_on

    dev = cluster.device
    start = {"e_max": dev.matmul_eff.e_max, "f_half": dev.matmul_eff.f_half, "memory_eff": dev.memory_eff,
             "overlap_slowdown": dev.overlap_slowdown, "attention_eff": dev.attention_eff}
    unidentifiable = tuple(
        name for name in UNLOCK_ORDER
        if not depends_on(runs, lambda run, v, name=name: predict(run, _with(cluster, {name: v}, "probe")),
                          _BOUNDS[name]))
    names = tuple(n for n in UNLOCK_ORDER if n not in unidentifiable)[:len(runs)]
    if not names:
        raise ValueError("no run's predicted step time depends on any constant calibrate fits; check the runs")

    def error(values: dict) -> float:
        trial = _with(cluster, values, "fit in progress")
        return sum(abs(predict(r, trial) / r.measured_step_s - 1) for r in runs) / len(runs)

    if len(names) == 1:  # (e_max, unless no run depends on it)
        from scipy.optimize import minimize_scalar

        name, (lo, hi) = names[0], _BOUNDS[names[0]]
        to, back = _space(name)
        res = minimize_scalar(lambda v: error({name: back(v)}), bounds=(to(lo), to(hi)), method="bounded",
                              options={"xatol": 1e-5})
        values = {name: back(float(res.x))}
    else:
        from scipy.optimize import minimize

        def unpack(x) -> dict:  # each constant through a sigmoid into its bounds, in its `_space`
            out = {}
            for name, v in zip(names, x, strict=True):
                (lo, hi), (to, back) = _BOUNDS[name], _space(name)
                s = 1 / (1 + math.exp(-v))
                out[name] = back(to(lo) + s * (to(hi) - to(lo)))
            return out

        def pack(name: str, value: float) -> float:
            (lo, hi), (to, _) = _BOUNDS[name], _space(name)
            s = (to(value) - to(lo)) / (to(hi) - to(lo))
            s = min(max(s, 1e-4), 1 - 1e-4)
            return math.log(s / (1 - s))

        from scipy.optimize import least_squares

        def residuals(x) -> list[float]:
            trial = _with(cluster, unpack(x), "fit in progress")
            return [predict(r, trial) / r.measured_step_s - 1 for r in runs]

        x0 = [pack(n, start[n]) for n in names]
        x = least_squares(residuals, x0, method="trf", xtol=1e-8, ftol=1e-10, max_nfev=100 * len(names)).x
        if len(runs) > len(names):  # more equations than unknowns: the mean absolute error is the objective
            x = minimize(lambda x: error(unpack(x)), x, method="Nelder-Mead",
                         options={"maxiter": 300 * len(names), "xatol": 1e-4, "fatol": 1e-6}).x
        values = unpack(x)
    source = (f"autopar calibrate: {', '.join(names)} fitted to {len(runs)} measured run"
              f"{'s' if len(runs) > 1 else ''}")
    fitted = _with(cluster, values, source)
    fitted = dataclasses.replace(fitted, name=f"{cluster.name}-calibrated",
                                 device=dataclasses.replace(fitted.device, name=f"{dev.name}-calibrated",
                                                            source=source))
    return Calibration(cluster=fitted, fitted=names, values=values,
                       before_s=tuple(predict(r, cluster) for r in runs),
                       after_s=tuple(predict(r, fitted) for r in runs), runs=tuple(runs),
                       unidentifiable=unidentifiable)
