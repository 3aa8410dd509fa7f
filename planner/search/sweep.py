"""What-if: plan once per value of one cluster or job parameter and show where the best plan changes.

Keys (`SWEEP_KEYS`): ``inter_bw_GBps`` (inter-node bus bandwidth per GPU; the link's per-collective figures scale
with it, its latency stays), ``nodes``, ``global_batch``, ``seq_len``. Each value is planned from scratch by
`planner.search.outer.search`; `SweepResult.changes` lists the values at which the winning configuration differs
from the previous value's, and `SweepResult.to_dict` is plain data for the HTML report's plot.

`check_optimal` re-plans every value with each *other* value's winner fixed (its mesh, schedule, micro-batch and
sharding; AC and compression stay the ILP's choice) and reports any that beat the sweep's own winner there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from costmodel.cluster import GB, Cluster, Link, load_cluster

SWEEP_KEYS = ("inter_bw_GBps", "nodes", "global_batch", "seq_len")
#: configuration keys that identify a winner when it is fixed at another value (AC/compression left to the ILP)
PLAN_KEYS = ("dp", "tp", "pp", "vpp", "mbs", "schedule", "zero", "sp", "precision")


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """The best plan at one value."""

    value: float  #: the swept parameter's value
    config: dict  #: the winner's configuration (ParallelConfig.to_dict)
    label: str  #: the winner in short (dp=…,tp=…,pp=…,…)
    step_time_s: float  #: predicted step time
    mfu: float  #: predicted model FLOPs utilisation
    breakdown_s: dict  #: predicted breakdown
    global_batch: int  #: the job's global batch at this value
    error: str = ""  #: why no plan was found (then config is empty)

    def to_dict(self) -> dict:
        return {"value": self.value, "config": self.config, "label": self.label, "step_time_s": self.step_time_s,
                "mfu": self.mfu, "breakdown_s": self.breakdown_s, "global_batch": self.global_batch,
                "error": self.error}


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    model: str
    cluster: str
    key: str
    points: tuple[SweepPoint, ...]
    plan_kwargs: dict = field(default_factory=dict)

    @property
    def changes(self) -> list[tuple[float, str, str]]:
        """(value, previous winner, new winner) wherever the winner changes from one value to the next."""
        out = []
        for a, b in zip(self.points, self.points[1:]):
            if a.label != b.label:
                out.append((b.value, a.label, b.label))
        return out

    def to_dict(self) -> dict:
        return {"model": self.model, "cluster": self.cluster, "key": self.key,
                "points": [p.to_dict() for p in self.points],
                "changes": [{"value": v, "from": a, "to": b} for v, a, b in self.changes],
                "plan_kwargs": {k: v for k, v in self.plan_kwargs.items() if k != "lg"}}

    def render(self, file=sys.stdout) -> None:
        print(f"sweep of {self.key} for {self.model} on {self.cluster}", file=file)
        print(f"{self.key:>14s} {'step s':>9s} {'MFU':>6s}  best plan", file=file)
        prev = None
        for p in self.points:
            mark = "  <- changes" if prev is not None and p.label != prev else ""
            if p.error:
                print(f"{p.value:14g} {'-':>9s} {'-':>6s}  {p.error}", file=file)
            else:
                print(f"{p.value:14g} {p.step_time_s:9.3f} {p.mfu * 100:5.1f}%  {p.label}{mark}", file=file)
            prev = p.label
        if not self.changes:
            print("the best plan is the same at every value", file=file)


def label(cfg: dict) -> str:
    parts = [f"dp={cfg['dp']}", f"tp={cfg['tp']}", f"pp={cfg['pp']}", f"mbs={cfg['mbs']}"]
    if int(cfg["pp"]) > 1:
        parts.append(str(cfg["schedule"]) + (f"×{cfg['vpp']}" if int(cfg["vpp"]) > 1 else ""))
    if int(cfg["zero"]):
        parts.append(f"zero={cfg['zero']}")
    if cfg.get("sp") in ("on", True):
        parts.append("sp")
    if cfg.get("ac", "none") != "none":
        parts.append(f"ac={cfg['ac']}")
    if cfg.get("grad_compress", "none") != "none":
        parts.append(f"grad={cfg['grad_compress']}")
    if cfg.get("pp_compress", "none") != "none":
        parts.append(f"pp_act={cfg['pp_compress']}")
    return ",".join(parts)


def with_inter_bandwidth(cluster: Cluster, gbps: float) -> Cluster:
    """``cluster`` with its inter-node bus bandwidth set to ``gbps`` GB/s (per-kind figures scaled alike)."""
    link = cluster.inter
    r = gbps * GB / link.bandwidth
    inter = Link(name=f"{link.name} at {gbps:g} GB/s", bandwidth=gbps * GB, latency=link.latency,
                 source=f"what-if: {link.source}", latency_by_kind=dict(link.latency_by_kind),
                 bandwidth_by_kind={k: v * r for k, v in link.bandwidth_by_kind.items()},
                 curve_by_kind=dict(link.curve_by_kind))
    return replace(cluster, inter=inter)


def _job(model: str, cluster: Cluster, key: str, value, *, global_batch: int | None, seq_len: int | None, lgs: dict):
    """(layer graph, cluster, global batch) at one value."""
    from planner.search.outer import profile_for

    seq = int(value) if key == "seq_len" else seq_len
    if key == "inter_bw_GBps":
        cluster = with_inter_bandwidth(cluster, float(value))
    elif key == "nodes":
        cluster = replace(cluster, nodes=int(value))
    gb = int(value) if key == "global_batch" else global_batch
    if gb is None:
        gb = cluster.world_size
    if seq not in lgs:
        lgs[seq] = profile_for(model, cluster, seq=seq)
    return lgs[seq], cluster, gb


def sweep(model: str, cluster: str | Cluster, key: str, values, *, global_batch: int | None = None,
          seq_len: int | None = None, fix: dict | None = None, time_limit: float = 30.0, top_k: int = 1,
          compress: str = "none", memory_fraction: float | None = None) -> SweepResult:
    """The best plan (`planner.search.outer.search`, under the compression policy ``compress``) at each value of
    ``key`` (`SWEEP_KEYS`)."""
    from planner.search.outer import NoPlanFits, search

    if key not in SWEEP_KEYS:
        raise ValueError(f"--sweep: unknown key {key!r}; sweepable keys: {', '.join(SWEEP_KEYS)}")
    values = list(values)
    if not values:
        raise ValueError(f"--sweep {key}=…: give at least one value")
    spec = cluster if isinstance(cluster, str) else cluster.name
    base = load_cluster(cluster) if isinstance(cluster, str) else cluster
    if memory_fraction is not None:
        base = replace(base, memory_fraction=memory_fraction)
    fix = dict(fix or {})
    if base.device.name.startswith("cpu"):
        fix.setdefault("precision", "fp32")
    lgs: dict = {}
    points = []
    for v in values:
        lg, cl, gb = _job(model, base, key, v, global_batch=global_batch, seq_len=seq_len, lgs=lgs)
        try:
            res = search(lg, cl, gb, fix=fix, top_k=top_k, time_limit=time_limit, progress=False, compress=compress)
        except NoPlanFits as exc:
            points.append(SweepPoint(value=v, config={}, label="(no plan fits)", step_time_s=float("nan"),
                                     mfu=0.0, breakdown_s={}, global_batch=gb, error=str(exc).splitlines()[0]))
            continue
        est = res.best.estimate
        cfg = res.best.config.to_dict()
        points.append(SweepPoint(value=v, config=cfg, label=label(cfg), step_time_s=est.step_time_s, mfu=est.mfu,
                                 breakdown_s=dict(est.breakdown_s), global_batch=gb))
    return SweepResult(model=model, cluster=spec, key=key, points=tuple(points),
                       plan_kwargs={"global_batch": global_batch, "seq_len": seq_len, "fix": fix,
                                    "compress": compress, "memory_fraction": base.memory_fraction})


def check_optimal(result: SweepResult, base: str | Cluster, *, time_limit: float = 30.0, rel_tol: float = 1e-9
                  ) -> list[dict]:
    """Re-plan each value with every other value's winner fixed; the cases where that beats the sweep's winner."""
    from planner.search.outer import NoPlanFits, search

    cluster = load_cluster(base) if isinstance(base, str) else base
    kw = result.plan_kwargs
    cluster = replace(cluster, memory_fraction=kw.get("memory_fraction", cluster.memory_fraction))
    winners = {p.label: p.config for p in result.points if p.config}
    lgs: dict = {}
    bad = []
    for p in result.points:
        if not p.config:
            continue
        lg, cl, gb = _job(result.model, cluster, result.key, p.value, global_batch=kw.get("global_batch"),
                          seq_len=kw.get("seq_len"), lgs=lgs)
        for other, cfg in winners.items():
            if other == p.label:
                continue
            fix = dict(kw.get("fix") or {}) | {k: cfg[k] for k in PLAN_KEYS}
            fix["sp"] = cfg["sp"] in ("on", True)
            try:
                res = search(lg, cl, gb, fix=fix, top_k=1, time_limit=time_limit, progress=False,
                             compress=kw.get("compress", "none"))
            except (NoPlanFits, ValueError):
                continue  # the other winner does not fit (or is not valid) here: it cannot be better
            t = res.best.estimate.step_time_s
            if t < p.step_time_s * (1 - rel_tol):
                bad.append({"value": p.value, "winner": p.label, "winner_s": p.step_time_s, "better": other,
                            "better_s": t})
    return bad
