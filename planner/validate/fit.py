"""Recalibrate a cluster to measured plans: least squares over the plans' parts, written with `dump_cluster`.

Free parameters (all multiplicative, fitted in log space, 1 = unchanged):

- device: ``flops`` scales the matmul throughput (folded into ``matmul_eff.e_max`` up to 1, the rest into the
  peak), ``f_half`` is the size at which a matmul reaches half of ``e_max`` (small matmuls are slower), ``memory``
  scales the memory-bound throughput (``memory_eff`` up to 1, the rest into ``hbm_bw``). Where every plan's
  compute was measured layer by layer (`LayerGraph.timings` on a CPU cluster, or the plan's ``--profile``),
  ``f_half`` stays 1; ``flops`` scales the part of the level measured here that grows with the work (ranks sharing
  the cores compute slower than the one process measured; `costmodel.layercost.measured_scale`) but not a
  profile's, which is referred to the cluster's device (`costmodel.layercost`);
- links: for each collective kind the measured plans' predictions read (`kinds_used`: all_reduce: DDP, TP and the
  step's scalars; broadcast: ZeRO-1; all_gather and reduce_scatter: ZeRO-2/3, sequence and context parallelism;
  all_to_all: experts; send_recv: pipelines), a bandwidth scale and a latency scale applied to both links'
  figures of that kind (and to the default figures with all_reduce), so the shape gloo_bench/NCCL-tests gave them
  is kept.

Residuals, per measured plan: log(predicted / measured) of the step time (weight 2), of compute (1), of exposed
communication plus idle time (1, when ≥ 2 ms were measured) and of the optimizer step (0.5), plus a weak pull of
every log-scale to 0 (0.05) so that a parameter the data do not see stays put. Solved by `scipy.optimize.least_squares`
(trust-region reflective, soft-L1 loss against the odd outlier step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.cluster import Cluster, Link, dump_cluster
from costmodel.hardware import EfficiencyCurve
from planner.plan import Plan
from planner.validate.loop import Measurement, predicted_parts, repredict

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
WEIGHTS = {"step": 2.0, "compute": 1.0, "comm": 1.0, "optimizer": 0.5}
PRIOR_WEIGHT = 0.05
MIN_COMM_S = 2e-3


def kinds_used(plans: list[Plan], base: Cluster, lgs: list) -> list[str]:
    """The collective kinds of `KINDS` whose links the plans' predictions on ``base`` read (``lgs``: each plan's
    layer graph): those whose bandwidth or latency, doubled, moves some plan's predicted parts. The cost model
    says which collectives a plan calls (ZeRO-1: DDP's all-reduce and the parameters' broadcasts; sequence
    parallelism: all-gathers and reduce-scatters; every plan on more than one rank: the gradient norm's and the
    loss's all-reduces; ...), so no list of them kept here can fall behind it."""
    def parts(cluster: Cluster) -> list[dict]:
        return [predicted_parts(repredict(p, cluster, lg)) for p, lg in zip(plans, lgs)]

    same = parts(apply_scales(base, Scales()))  # (through the same arithmetic as the scaled ones)
    return [k for k in KINDS if any(parts(apply_scales(base, s)) != same
                                    for s in (Scales(bandwidth=((k, 2.0),)), Scales(latency=((k, 2.0),))))]


def _scale_link(link: Link, bw: dict, lat: dict, note: str) -> Link:
    kinds = set(link.bandwidth_by_kind) | set(link.latency_by_kind) | set(bw)
    calls = set(link.call_latency_by_kind)
    return replace(  # a latency scale moves both fixed costs: the ring step's α and the per-call latency
        link,
        call_latency=link.call_latency * lat.get("all_reduce", 1.0),
        call_latency_by_kind={k: link.call_latency_for(k) * lat.get(k, 1.0) for k in calls},
        bandwidth=link.bandwidth * bw.get("all_reduce", 1.0),
        latency=link.latency * lat.get("all_reduce", 1.0),
        source=f"{link.source}; {note}" if link.source else note,
        bandwidth_by_kind={k: link.bandwidth_for(k) * bw.get(k, 1.0) for k in kinds},
        latency_by_kind={k: link.latency_for(k) * lat.get(k, 1.0) for k in kinds},
        curve_by_kind=dict(link.curve_by_kind),  # relative to each kind's bandwidth: scales with it
    )


@dataclass(frozen=True, kw_only=True)
class Scales:
    """The fitted multipliers (1 = as the base cluster had it)."""

    flops: float = 1.0
    f_half: float = 1.0
    memory: float = 1.0
    bandwidth: tuple[tuple[str, float], ...] = ()
    latency: tuple[tuple[str, float], ...] = ()

    def to_dict(self) -> dict:
        return {
            "flops": self.flops,
            "f_half": self.f_half,
            "memory": self.memory,
            "bandwidth": dict(self.bandwidth),
            "latency": dict(self.latency),
        }


def apply_scales(base: Cluster, s: Scales, note: str = "recalibrated") -> Cluster:
    dev = base.device
    e0 = dev.matmul_eff
    e_max = min(1.0, e0.e_max * s.flops)
    peak_factor = s.flops * e0.e_max / e_max
    mem_eff = min(1.0, dev.memory_eff * s.memory)
    hbm_factor = s.memory * dev.memory_eff / mem_eff
    device = replace(
        dev,
        peak_flops={k: v * peak_factor for k, v in dev.peak_flops.items()},
        matmul_eff=EfficiencyCurve(e_max=e_max, f_half=e0.f_half * s.f_half, source=f"{note} (autopar validate)"),
        memory_eff=mem_eff,
        hbm_bw=dev.hbm_bw * hbm_factor,
        source=f"{dev.source}; {note}" if dev.source else note,
    )
    bw, lat = dict(s.bandwidth), dict(s.latency)
    return replace(
        base,
        name=f"{base.name}-recalibrated" if not base.name.endswith("-recalibrated") else base.name,
        device=device,
        intra=_scale_link(base.intra, bw, lat, note),
        inter=_scale_link(base.inter, bw, lat, note),
    )


@dataclass(frozen=True, kw_only=True)
class FitResult:
    cluster: Cluster  #: the recalibrated cluster
    scales: Scales
    cost_before: float
    cost_after: float
    residuals: int

    def yaml(self, plans: list[str]) -> str:
        head = (
            "# written by `autopar validate --recalibrate` from the measured plans: "
            + ", ".join(plans)
            + "\n# fitted scales against the base cluster: "
            + ", ".join(f"{k}={v}" for k, v in _rounded(self.scales.to_dict()).items())
            + "\n"
        )
        return head + dump_cluster(self.cluster)


def _rounded(d):
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return float(f"{d:.4g}")


def _fit_parts(parts: dict) -> dict:
    """Communication and idle time fitted together: gloo's blocking receives show up as collectives in the
    profile, while the cost model calls the same wait a pipeline bubble."""
    return {**parts, "comm": parts["comm"] + parts["idle"]}


def fit(base: Cluster, plans: list[Plan], measured: list[Measurement], lgs: list | None = None) -> FitResult:
    """Least-squares fit of the scales (module docstring) to ``measured``; returns the recalibrated cluster."""
    import numpy as np
    from scipy.optimize import least_squares

    from planner.search.outer import profile_for

    if not plans:
        raise ValueError("--recalibrate needs at least one measured plan")
    lgs = lgs or [profile_for(p.model, base, seq=p.seq) for p in plans]
    kinds = kinds_used(plans, base, lgs)
    # compute measured layer by layer (on this machine, `LayerGraph.timings`, or the plan's profile) leaves the
    # matmul curve's half-point only the shape of the compute's scaling with the micro-batch to fit, which a handful
    # of plans over-fit (0.14 seen): it keeps the device's measured value; ``flops`` still moves the level measured
    # here (`CostContext.measured_device`): how much slower the ranks compute than the one process measured
    timed = all(plan.profile or (lg.timings is not None and lg.timings.measured)
                for plan, lg in zip(plans, lgs, strict=True))
    names = ["flops"] + ([] if timed else ["f_half"]) + ["memory"] + [f"bw:{k}" for k in kinds] + [
        f"lat:{k}" for k in kinds]

    def scales_of(x) -> Scales:
        v = {n: float(e) for n, e in zip(names, np.exp(x))}
        return Scales(
            flops=v["flops"],
            f_half=v.get("f_half", 1.0),
            memory=v["memory"],
            bandwidth=tuple((k, float(v[f"bw:{k}"])) for k in kinds),
            latency=tuple((k, float(v[f"lat:{k}"])) for k in kinds),
        )

    def residuals(x):
        cluster = apply_scales(base, scales_of(x))
        out = []
        for plan, meas, lg in zip(plans, measured, lgs):
            pred = _fit_parts(predicted_parts(repredict(plan, cluster, lg)))
            got = _fit_parts(meas.parts())
            for part, w in WEIGHTS.items():
                if part == "comm" and got[part] < MIN_COMM_S:
                    continue
                out.append(w * (math.log(max(pred[part], 1e-5)) - math.log(max(got[part], 1e-5))))
        out.extend(PRIOR_WEIGHT * xi for xi in x)
        return np.array(out)

    x0 = np.zeros(len(names))
    r0 = residuals(x0)
    sol = least_squares(
        residuals,
        x0,
        bounds=(-np.log(1e3) * np.ones(len(names)), np.log(1e3) * np.ones(len(names))),
        loss="soft_l1",
        f_scale=0.2,
        method="trf",
    )
    s = scales_of(sol.x)
    note = f"recalibrated by autopar validate on {len(plans)} measured plans"
    return FitResult(
        cluster=apply_scales(base, s, note),
        scales=s,
        cost_before=float(0.5 * r0 @ r0),
        cost_after=float(0.5 * sol.fun @ sol.fun),
        residuals=len(r0),
    )
