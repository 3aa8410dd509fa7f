"""What a plan does and why: the facts `autopar inspect` shows, computed from the plan file alone.

`build_report(plan)` returns one JSON-ready dict (``inspect --json`` prints it; the terminal and HTML reports
render it). Nothing here re-profiles the model, so a report for a 1024-GPU plan takes milliseconds; the cluster
is re-loaded from the plan's cluster spec only for the device mesh and link names (`costmodel.cluster`).

Sections: the configuration; step time, tokens/s, MFU, HFU; memory of the peak rank against the device; the
stages; the per-layer strategies compressed into runs of identical layers; the step-time breakdown with each
communication kind's exposed (and, where the plan allows it, hidden) time; the alternatives with their deltas and
the term that made each lose; the solver facts; warnings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from costmodel.config import parse_grad_compress
from planner.plan import Plan

MEMORY_MARGIN = 0.05  #: warn when the peak is within this fraction of the device memory
DOMINANT_SHARE = 0.30  #: warn when one communication term (or the bubble) is more than this share of the step
GAP_WARN = 0.01  #: warn when the solver's relative gap exceeds this

BREAKDOWN_TERMS = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_comm",
    "dp_comm_exposed",
    "bubble",
    "optimizer",
    "compression",
)
COMM_TERMS = {
    "tp_comm": "tensor-parallel",
    "cp_comm": "context-parallel",
    "ep_comm": "expert-parallel (all-to-all)",
    "pp_comm": "pipeline (p2p)",
    "dp_comm_exposed": "data-parallel",
}
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "other")
#: keys under which `autopar plan` may store why an alternative lost (planner/search/outer.py writes ``lost_by``)
LOST_KEYS = ("lost_by", "why", "lost_on", "reason")


def build_report(plan: Plan) -> dict:
    """Every fact the reports show, as plain JSON values."""
    cfg, pred = plan.config, plan.predicted
    cluster = _load_cluster(plan)
    step = float(pred.get("step_time_s") or 0.0)
    report = {
        "model": plan.model,
        "cluster": plan.cluster,
        "fingerprint": plan.fingerprint,
        "seq": plan.seq,
        "global_batch": plan.global_batch,
        "world": cfg.world,
        "micro_batches": plan.grad_accum,
        "config": cfg.to_dict(),
        "predicted": {
            k: pred.get(k)
            for k in ("step_time_s", "tokens_per_s", "tflops_per_gpu_model", "tflops_per_gpu_hw", "mfu", "hfu", "fits")
        },
        "memory": memory_facts(plan),
        "stages": stage_rows(plan),
        "layer_runs": layer_runs(plan),
        "breakdown": breakdown_rows(plan, cluster),
        "alternatives": alternative_rows(plan),
        "solver": dict(plan.solver),
        "mesh": mesh_facts(plan, cluster),
        "experts": expert_facts(plan, cluster),
        "provenance": dict(plan.provenance),
        "traced": dict(plan.traced),  # what `autopar check` traced of this plan (empty: not checked)
    }
    report["warnings"] = warnings(plan, report)
    report["predicted"]["step_time_s"] = step
    return report


# ------------------------------------------------------------------------------------------------- pieces
def expert_facts(plan: Plan, cluster) -> dict | None:
    """Expert parallelism (`costmodel.moe`): the groups, the all-to-alls' share of the step and the routing
    imbalance the expert GEMMs were costed with; None for a plan without it."""
    cfg = plan.config
    if cfg.ep == 1:
        return None
    bd = plan.predicted.get("breakdown_s") or {}
    step = float(plan.predicted.get("step_time_s") or 0.0)
    a2a = float(bd.get("ep_comm", 0.0))
    return {"ep": cfg.ep, "edp": cfg.dp // cfg.ep, "all_to_all_s": a2a, "share": a2a / step if step else None,
            "imbalance": cluster.moe_imbalance if cluster is not None else None}


def memory_facts(plan: Plan) -> dict:
    pred = plan.predicted
    mem = dict(pred.get("memory_per_gpu_bytes") or {})
    cap = float(pred.get("capacity_bytes") or 0.0)
    peak = float(mem.get("peak") or sum(float(mem.get(k, 0.0)) for k in MEMORY_TERMS))
    return {
        "capacity_bytes": cap,
        "peak_bytes": peak,
        "used_frac": peak / cap if cap else None,
        "breakdown_bytes": {k: float(mem.get(k, 0.0)) for k in MEMORY_TERMS},
    }


def layer_span(plan: Plan, first: int, last: int) -> str:
    names = [lay.name for lay in plan.layers]
    if not names:
        return f"{first}–{last}"
    a, b = names[min(first, len(names) - 1)], names[min(last, len(names) - 1)]
    return a if first == last else f"{a} – {b}"


def stage_rows(plan: Plan) -> list[dict]:
    return [
        {
            "index": s.index,
            "rank": s.rank,
            "layers": layer_span(plan, s.first, s.last),
            "n_layers": s.last - s.first + 1,
            "first": s.first,
            "last": s.last,
            "time_s": s.time_s,
            "memory_bytes": s.memory_bytes,
            "inflight": s.inflight,
            "memory_parts": dict(s.memory_parts),
        }
        for s in plan.stages
    ]


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def layer_runs(plan: Plan) -> list[dict]:
    """Consecutive layers with the same strategy and consecutively numbered names, as one run each."""
    sharding = _sharding(plan)
    runs: list[dict] = []
    for i, lay in enumerate(plan.layers):
        m = _NUMBERED.match(lay.name)
        prefix, num = (m.group(1), int(m.group(2))) if m else (lay.name, None)
        key = (prefix, lay.ac.value, lay.tp)
        last = runs[-1] if runs else None
        if last and num is not None and last["_key"] == key and last["_num"] is not None and num == last["_num"] + 1:
            last.update(
                last_index=i,
                _num=num,
                count=last["count"] + 1,
                stage_last=lay.stage,
                name=f"{prefix}{last['_first_num']}–{num}",
            )
            continue
        runs.append(
            {
                "_key": key,
                "_num": num,
                "_first_num": num,
                "name": lay.name,
                "first_index": i,
                "last_index": i,
                "count": 1,
                "stage_first": lay.stage,
                "stage_last": lay.stage,
                "tp": lay.tp,
                "tp_layout": "column/row (Megatron)" if lay.tp else "replicated",
                "ac": lay.ac.value,
                "sharding": sharding,
            }
        )
    for r in runs:
        for k in ("_key", "_num", "_first_num"):
            r.pop(k)
        r["text"] = (f"{r['name']} ×{r['count']}: " if r["count"] > 1 else f"{r['name']}: ") + ", ".join(
            ([f"tp={plan.config.tp}"] if r["tp"] else ["no tp"]) + [f"ac={r['ac']}", sharding]
        )
    return runs


def _sharding(plan: Plan) -> str:
    z = plan.config.zero
    if plan.config.dp == 1:
        return "not sharded (dp=1)"
    return {
        0: "replicated (DDP)",
        1: "ZeRO-1 (optimizer sharded)",
        2: "ZeRO-2 (optimizer+grads sharded)",
        3: "ZeRO-3/FSDP (all states sharded)",
    }[z]


def breakdown_rows(plan: Plan, cluster) -> list[dict]:
    """Each term of the step with its share; communication terms with exposed vs hidden where known."""
    pred = plan.predicted
    bd = pred.get("breakdown_s") or {}
    step = float(pred.get("step_time_s") or 0.0) or sum(float(v) for v in bd.values()) or 1.0
    rows = []
    for term in list(BREAKDOWN_TERMS) + [k for k in bd if k not in BREAKDOWN_TERMS]:
        if term == "ep_comm" and term not in bd:
            continue  # a plan without expert parallelism has no such term
        v = float(bd.get(term, 0.0))
        row = {"term": term, "seconds": v, "share": v / step, "exposed_s": None, "hidden_s": None, "note": ""}
        if term in ("tp_comm", "cp_comm", "ep_comm", "pp_comm"):
            row["exposed_s"], row["hidden_s"] = v, 0.0
            row["note"] = "on the critical path (not overlapped in the cost model)"
        elif term == "dp_comm_exposed":
            row["exposed_s"] = v
            row["hidden_s"], row["note"] = _dp_hidden(plan, cluster, v)
        rows.append(row)
    return rows


def _dp_hidden(plan: Plan, cluster, exposed: float) -> tuple[float | None, str]:
    """The data-parallel gradient all-reduce hidden behind the last backward, for plain DDP (zero 0, no
    compression): its full time on the dp group's link minus the exposed part. Otherwise unknown here."""
    cfg = plan.config
    if cfg.dp == 1:
        return 0.0, "no data parallelism"
    if cfg.zero == 3:
        return None, "FSDP gathers/reduce-scatters overlap each micro-batch; exposed part shown"
    if cfg.zero != 0 or cfg.grad_compress != "none" or cluster is None:
        return None, "overlapped with the last backward; exposed part shown"
    from costmodel.cluster import group_span
    from costmodel.collectives import all_reduce_time
    from costmodel.overlap import GRAD_REDUCE_BYTES
    from planner.report.textui import human_time

    mem = plan.predicted.get("memory_per_gpu_bytes") or {}
    numel = float(mem.get("params", 0.0)) / (4 if cfg.precision == "fp32" else 2)
    total = all_reduce_time(numel * GRAD_REDUCE_BYTES, group_span(cluster, cfg.dp, cfg.tp * cfg.cp), cluster)
    return max(
        0.0, total - exposed
    ), f"all-reduce ≈ {human_time(total)} in all, the rest hides behind the last backward"


def alternative_rows(plan: Plan) -> list[dict]:
    """The runners-up with their deltas against the plan and the term that made each lose."""
    pred = plan.predicted
    step = float(pred.get("step_time_s") or 0.0)
    peak = float((pred.get("memory_per_gpu_bytes") or {}).get("peak", 0.0))
    base_cfg = plan.config.to_dict()
    base_bd = pred.get("breakdown_s") or {}
    rows = []
    for i, alt in enumerate(plan.alternatives, 1):
        if not isinstance(alt, dict):
            continue
        cfg = dict(alt.get("config") or {})
        ap = alt.get("predicted") or {}
        a_step = float(ap.get("step_time_s") or 0.0)
        a_peak = float((ap.get("memory_per_gpu_bytes") or {}).get("peak", 0.0))
        lost, lost_s = _lost_by(alt, ap, base_bd)
        diff = {k: v for k, v in cfg.items() if str(base_cfg.get(k)) != str(v)}
        rows.append(
            {
                "rank": i,
                "config": cfg,
                "differs": diff,
                "step_time_s": a_step,
                "delta_s": a_step - step,
                "delta_frac": (a_step - step) / step if step else None,
                "peak_bytes": a_peak,
                "delta_bytes": a_peak - peak,
                "fits": ap.get("fits"),
                "mfu": ap.get("mfu"),
                "lost_by": lost,
                "lost_by_s": lost_s,
            }
        )
    return rows


def _lost_by(alt: dict, ap: dict, base_bd: dict) -> tuple[str | None, float | None]:
    for key in LOST_KEYS:
        v = alt.get(key)
        if isinstance(v, dict):  # {"term": …, "seconds": …} or similar
            term = v.get("term") or v.get("name")
            secs = v.get("seconds", v.get("s", v.get("delta_s")))
            return (str(term) if term else None), (float(secs) if secs is not None else None)
        if v:
            secs = alt.get(f"{key}_s")
            return str(v), (float(secs) if secs is not None else None)
    if ap.get("fits") is False:
        return "memory", None
    bd = ap.get("breakdown_s") or {}
    if not bd or not base_bd:
        return None, None
    diffs = {k: float(bd.get(k, 0.0)) - float(base_bd.get(k, 0.0)) for k in set(bd) | set(base_bd)}
    key = max(diffs, key=lambda k: (diffs[k], k))
    return key, diffs[key]


def mesh_facts(plan: Plan, cluster) -> dict:
    """Rank layout (pp outermost, dp, cp, tp innermost) and the link each group uses (`group_span`)."""
    cfg = plan.config
    gpn = cluster.gpus_per_node if cluster else int(_prov_cluster(plan).get("gpus_per_node") or 8)
    groups = []
    for kind, size, stride in (
        ("tp", cfg.tp, 1),
        ("cp", cfg.cp, cfg.tp),
        ("dp", cfg.dp, cfg.tp * cfg.cp),
        # context parallelism: the gradients reduce over dp × cp (`ParallelConfig.data_ranks`)
        *((("dp×cp", cfg.dp * cfg.cp, cfg.tp),) if cfg.cp > 1 else ()),
        # expert parallelism: consecutive dp ranks (costmodel.moe); edp: the ranks holding the same experts
        *((("ep", cfg.ep, cfg.tp * cfg.cp), ("edp", cfg.dp // cfg.ep, cfg.tp * cfg.cp * cfg.ep))
          if cfg.ep > 1 else ()),
        ("pp", cfg.pp, cfg.dp * cfg.cp * cfg.tp),
    ):
        g = {
            "kind": kind,
            "size": size,
            "stride": stride,
            "nodes": None,
            "per_node": None,
            "link": None,
            "crosses_nodes": None,
        }
        if cluster is not None and size > 1:
            from costmodel.cluster import group_span

            span = group_span(cluster, size, stride)
            g.update(
                nodes=span.nodes,
                per_node=span.per_node,
                crosses_nodes=span.crosses_nodes,
                link=("network: " + cluster.inter.name)
                if span.crosses_nodes
                else ("intra-node: " + cluster.intra.name),
            )
        groups.append(g)
    return {
        "gpus_per_node": gpn,
        "nodes": -(-cfg.world // gpn),
        "world": cfg.world,
        "order": ["pp", "dp", "cp", "tp"],
        "groups": groups,
    }


def _prov_cluster(plan: Plan) -> dict:
    c = plan.provenance.get("cluster") if isinstance(plan.provenance, dict) else None
    return c if isinstance(c, dict) else {}


def _load_cluster(plan: Plan):
    """The plan's cluster topology and links, or None when its spec no longer loads here (a YAML file left behind).

    ``cpu-local`` is not loaded through `load_cluster`, which measures this machine's CPU (seconds, and torch);
    the report needs only the ranks per node and the fitted loopback link."""
    from costmodel import cluster as cl

    name, _, opts = plan.cluster.partition(":")
    if name == "cpu-local":
        kv = dict(o.split("=", 1) for o in opts.replace(",", ":").split(":") if "=" in o)
        nodes = int(kv.get("nodes", 1))
        gpn = int(kv.get("gpus_per_node", max(1, plan.config.world // nodes)))
        link = cl._cpu_local_link()
        return _Topology(name=plan.cluster, gpus_per_node=gpn, nodes=nodes, intra=link, inter=link)
    try:
        cluster = cl.load_cluster(plan.cluster)
    except (ValueError, OSError):
        return None
    return cluster if cluster.world_size == plan.config.world else None


@dataclass(frozen=True)
class _Topology:
    """What `group_span` and the collective formulas read from a cluster (no device)."""

    name: str
    gpus_per_node: int
    nodes: int
    intra: object
    inter: object

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def warnings(plan: Plan, rep: dict) -> list[str]:
    out = []
    mem = rep["memory"]
    if mem["used_frac"] is not None:
        if mem["used_frac"] > 1.0:
            out.append(
                f"does not fit: peak {mem['peak_bytes'] / 2**30:.1f} GiB > device "
                f"{mem['capacity_bytes'] / 2**30:.1f} GiB"
            )
        elif mem["used_frac"] > 1.0 - MEMORY_MARGIN:
            out.append(
                f"memory within {MEMORY_MARGIN:.0%} of the device: peak {mem['peak_bytes'] / 2**30:.1f} GiB "
                f"of {mem['capacity_bytes'] / 2**30:.1f} GiB ({mem['used_frac']:.1%}); fragmentation or a "
                "longer sequence may run out of memory"
            )
    cfg = plan.config
    kind, rank = parse_grad_compress(cfg.grad_compress)
    if kind in ("bf16", "fp16") and cfg.dp > 1:
        out.append(
            f"grad_compress={kind}: gradients are reduced in {kind}, not fp32; this changes the numerics "
            "(rounding in the sum); check the loss curve"
        )
    elif kind == "powersgd" and cfg.dp > 1:
        out.append(
            f"grad_compress=powersgd-{rank}: gradients are reduced as rank-{rank} approximations with error "
            "feedback; this changes the numerics and may change convergence; check the loss curve"
        )
    if cfg.pp_compress == "bf16" and cfg.pp > 1 and cfg.precision == "fp32":
        out.append(
            "pp_compress=bf16: activations and their gradients cross pipeline stages in bf16 while training "
            "in fp32; this changes the numerics"
        )
    for row in rep["breakdown"]:
        if row["term"] in COMM_TERMS and row["share"] > DOMINANT_SHARE:
            link = _link_of(row["term"], rep["mesh"])
            out.append(
                f"{row['term']} is {row['share']:.0%} of the step: the {COMM_TERMS[row['term']]} "
                f"communication{(' over ' + link) if link else ''} dominates"
            )
        if row["term"] == "bubble" and row["share"] > DOMINANT_SHARE:
            out.append(
                f"pipeline bubble is {row['share']:.0%} of the step: more micro-batches or virtual stages "
                "would shrink it"
            )
    solver = plan.solver
    gap = solver.get("gap")
    if isinstance(gap, (int, float)) and gap > GAP_WARN:
        out.append(f"solver gap {gap:.1%}: the plan may be up to that far from the best; raise --time-limit")
    status = solver.get("status")
    if status and str(status).upper() not in ("OPTIMAL",):
        out.append(f"solver status {status}: not proven optimal")
    if plan.predicted.get("fits") is False and not any(w.startswith("does not fit") for w in out):
        out.append("the cost model predicts this plan does not fit in memory")
    return out


def _link_of(term: str, mesh: dict) -> str | None:
    kind = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep", "pp_comm": "pp", "dp_comm_exposed": "dp"}[term]
    for g in mesh["groups"]:
        if g["kind"] == kind:
            return g["link"]
    return None
