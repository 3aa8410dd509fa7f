"""The outer search: mesh shapes, schedules, micro-batches and sharding, each candidate solved by `planner.ilp`.

Candidates (`candidates`): dp·tp·pp = the cluster's GPUs; tp divides the heads and kv_heads and stays inside a
node (tp ≤ gpus_per_node; larger tp only when no plan inside a node exists); pp·vpp ≤ the number of blocks; dp·mbs
divides the global batch and mbs ≤ `MAX_MBS`; zero ∈ {0, 1, 2, 3} when dp > 1 (with dp = 1 they are all the
same job: only 0); sp ∈ {off, on} when tp > 1; with pp > 1 the schedules gpipe, 1f1b, zb (vpp = 1: the cost model's
ZB-H1 gains nothing from virtual stages) and interleaved with 2 ≤ vpp ≤ `MAX_VPP`. ``fix`` pins any key.
Per-layer AC and the compression of each group are the ILP's choices (``fix`` pins them too).

Pruning, before any ILP is built:
- memory: the most loaded rank's model states with the candidate's sharding plus its smallest activations (full
  recomputation) already exceed a GPU ⇒ skip (`memory_lower_bound`);
- time: an optimistic step (no recomputation, perfectly balanced stages, boundary transfers and FSDP/ZeRO-1
  gathers that cannot be hidden, nothing else exposed; `time_lower_bound`) ≥ the (top_k + 1)-th best step found ⇒
  skip. Candidates are solved in order of that bound, so once one is pruned all later ones are.

Determinism: candidates are sorted by (time bound, dp, tp, pp, vpp, schedule, mbs, zero, sp); a solution replaces
the best only when strictly faster (so ties go to the earlier candidate); the ILP backend is deterministic. Only
``solver.time_s`` and the provenance's creation stamp depend on the clock.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from costmodel.cluster import Cluster
from costmodel.collectives import all_gather_time, reduce_scatter_time
from costmodel.config import AC, ParallelConfig, Schedule
from costmodel.estimate import ConfigError, Evaluator, pipeline_factor
from costmodel.layercost import is_tp_layer
from costmodel.memory import DDP_BUCKET_BYTES, FRAGMENTATION, RUNTIME_RESERVED_BYTES, inflight, state_bytes_per_param
from costmodel.overlap import GRAD_REDUCE_BYTES, optimizer_time
from planner import ilp
from profiler.graph import LayerGraph

MAX_MBS = 16  #: largest micro-batch tried (a divisor of global_batch / dp)
MAX_VPP = 8  #: most virtual stages per pipeline rank tried with the interleaved schedule
SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED)
FIXABLE = ("dp", "tp", "pp", "vpp", "mbs", "schedule", "zero", "sp", "ac", "grad_compress", "pp_compress",
           "precision", "cp", "ep")
GiB = 2**30


class NoPlanFits(ValueError):
    """No configuration fits in memory; the message says what the smallest plan needs and what would help."""


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A runner-up: its solution and why it lost to the winner."""

    solution: ilp.Solution
    lost_by: str  #: the breakdown term (or "memory") that grew most against the winner
    lost_by_s: float  #: by how much, seconds per step


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: ilp.Solution
    alternatives: tuple[Alternative, ...]
    candidates: int  #: configurations enumerated
    pruned: int  #: skipped by a lower bound (memory or time) without an ILP
    pruned_memory: int
    solved: int  #: ILPs solved
    infeasible: int  #: ILPs with no plan that fits
    time_s: float
    backend: str
    status: str  #: OPTIMAL when every solved ILP was optimal, else FEASIBLE
    gap: float  #: the winner's ILP gap (0 when proved optimal)


# ------------------------------------------------------------------------------------------------ candidates
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(lg: LayerGraph, cluster: Cluster, global_batch: int, fix: dict, *,
               cross_node_tp: bool = False) -> list[ParallelConfig]:
    """Every configuration of the search space that satisfies ``fix`` (see the module docstring)."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    arch = lg.model.arch
    n_blocks = sum(1 for layer in lg.layers if layer.kind == "block")
    uniform = len({layer.signature for layer in lg.layers if layer.kind == "block"}) <= 1 and n_blocks > 0
    tp_ok = any(is_tp_layer(layer) for layer in lg.blocks)
    precision = fix.get("precision", "bf16")
    out = []
    for tp in _divisors(world):
        if tp > 1 and (not tp_ok or any(arch.get(k) and arch[k] % tp for k in ("heads", "kv_heads"))):
            continue
        if (tp > gpn) != cross_node_tp:
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and (not uniform or pp > n_blocks):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            mbss = [b for b in _divisors(global_batch // dp) if b <= MAX_MBS]
            scheds = [(Schedule.ONE_F_ONE_B, 1)]
            if pp > 1:
                # dominated unless pinned: GPipe by 1F1B (same time, more in flight), 1F1B by ZB-H1 (same memory,
                # φ = 1/3 < 1) under costmodel.estimate/memory
                keep = SCHEDULES if "schedule" in fix else (Schedule.ZERO_BUBBLE,)
                scheds = [(s, 1) for s in SCHEDULES if s != Schedule.INTERLEAVED and s in keep]
                scheds += [(Schedule.INTERLEAVED, v) for v in range(2, MAX_VPP + 1) if pp * v <= n_blocks]
            for (sched, vpp) in scheds:
                for mbs in mbss:
                    for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                        # sp=off is dominated by sp=on (same collectives, less compute and memory) unless pinned
                        for sp in (((False, True) if "sp" in fix else (True,)) if tp > 1 else (False,)):
                            key = {"dp": dp, "tp": tp, "pp": pp, "vpp": vpp, "schedule": sched.value, "mbs": mbs,
                                   "zero": zero, "sp": sp}
                            if any(k in fix and _norm(fix[k]) != _norm(v) for k, v in key.items()):
                                continue
                            out.append(ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=sched, mbs=mbs,
                                                      zero=zero, sp=sp, precision=precision))
    return out


def _norm(v):
    return v.value if isinstance(v, Schedule) else v


def _order_key(cfg: ParallelConfig) -> tuple:
    return (cfg.dp, cfg.tp, cfg.pp, cfg.vpp, SCHEDULES.index(cfg.schedule), cfg.mbs, cfg.zero, cfg.sp)


# ---------------------------------------------------------------------------------------------------- bounds
class Bounds:
    """Lower bounds on a candidate's step time and peak memory per GPU, from layer costs shared across
    candidates with the same (tp, sp, mbs, precision)."""

    def __init__(self, lg: LayerGraph, cluster: Cluster, global_batch: int, cost_cache: dict) -> None:
        self.lg, self.cluster, self.gb, self.cache = lg, cluster, global_batch, cost_cache
        self._groups: dict = {}
        self._evs: dict = {}
        self.blocks = [i for i, layer in enumerate(lg.layers) if layer.kind == "block"]
        self.pre = list(range(self.blocks[0])) if self.blocks else list(range(len(lg.layers)))
        self.post = list(range(self.blocks[-1] + 1, len(lg.layers))) if self.blocks else []

    def _ev(self, cfg: ParallelConfig) -> Evaluator:
        key = (cfg.dp, cfg.tp, cfg.pp, cfg.mbs, cfg.sp, cfg.precision)
        if key not in self._evs:
            base = ParallelConfig(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, mbs=cfg.mbs, sp=cfg.sp, precision=cfg.precision,
                                  schedule=Schedule.ONE_F_ONE_B)
            self._evs[key] = ilp._evaluator(self.lg, self.cluster, base, self.gb, self.cache)
        return self._evs[key]

    def _group(self, cfg: ParallelConfig) -> dict:
        key = (cfg.tp, cfg.sp, cfg.mbs, cfg.precision)
        if key not in self._groups:
            ev = self._ev(cfg)
            n = len(self.lg.layers)
            none = [ev.cost(i, AC.NONE) for i in range(n)]
            least_act = [min(ev.cost(i, a).act_bytes for a in AC) for i in range(n)]
            b = self.blocks[0] if self.blocks else None
            self._groups[key] = {
                "work": sum(c.fwd_s + c.bwd_s + c.tp_comm_s for c in none),
                "params": sum(c.param_numel for c in none),
                "pre_params": sum(none[i].param_numel for i in self.pre),
                "post_params": sum(none[i].param_numel for i in self.post),
                "block_params": none[b].param_numel if b is not None else 0.0,
                "pre_act": sum(least_act[i] for i in self.pre),
                "post_act": sum(least_act[i] for i in self.post),
                "block_act": least_act[b] if b is not None else 0.0,
                "fwd": sum(c.fwd_s for c in none), "bwd": sum(c.bwd_s for c in none),
                "ag": _PerSpan(lambda span, ev=ev, none=none, pb=(4 if cfg.precision == "fp32" else 2): [
                    all_gather_time(c.param_numel * pb, span, self.cluster) for c in none]),
                "rs": _PerSpan(lambda span, ev=ev, none=none: [
                    reduce_scatter_time(c.param_numel * GRAD_REDUCE_BYTES, span, self.cluster) for c in none]),
            }
        return self._groups[key]

    def time(self, cfg: ParallelConfig) -> float:
        """Optimistic step time: Σ work without recomputation over pp perfectly balanced ranks."""
        g, ev = self._group(cfg), self._ev(cfg)
        m = self.gb // (cfg.dp * cfg.mbs)
        S = cfg.pp * cfg.vpp
        total = g["work"]
        if S > 1:
            total += (S - 1) * ev.p2p_time(self.blocks[-1])  # bf16 boundary casts never beat plain 16-bit
            if cfg.precision == "fp32":
                total -= (S - 1) * ev.p2p_time(self.blocks[-1]) / 2  # bf16 at best halves the transfer
        if cfg.zero == 3 and cfg.dp > 1:
            # per stage: ag of the first and last layer and rs of the first are never hidden; the rest is hidden
            # at best by the whole forward (all-gathers) and the whole backward with full recomputation;
            # Σ_c max(0, x_c) ≥ max(0, Σ_c x_c)
            ag, rs = g["ag"][ev.dp_span], g["rs"][ev.dp_span]
            total += S * (2 * min(ag) + min(rs))
            total += max(0.0, sum(ag) - S * max(ag) - g["fwd"])
            total += max(0.0, sum(ag) + sum(rs) - S * (max(ag) + max(rs)) - g["fwd"] - g["bwd"])
        phi = pipeline_factor(cfg.schedule, cfg.vpp)
        pipe = (m - phi) * total / cfg.pp + phi * total if cfg.pp > 1 else m * total
        params = g["params"] / cfg.pp
        finish = optimizer_time(params, _OptView(cfg, self.cluster))
        if cfg.zero == 1 and cfg.dp > 1:
            finish += all_gather_time(params * 2, ev.dp_span, self.cluster)
        return pipe + finish

    def memory(self, cfg: ParallelConfig) -> float:
        """Peak memory of the most loaded rank with full recomputation and the fewest layers it can hold."""
        g = self._group(cfg)
        m = self.gb // (cfg.dp * cfg.mbs)
        per = sum(state_bytes_per_param(cfg.precision, cfg.zero, cfg.dp))
        temp = 2 * DDP_BUCKET_BYTES if (cfg.zero == 0 and cfg.dp > 1) else 0.0
        first = (per * (g["pre_params"] + cfg.vpp * g["block_params"])
                 + inflight(cfg.schedule, cfg.pp, cfg.vpp, 0, m) * (g["pre_act"] + cfg.vpp * g["block_act"]))
        last_rank = (cfg.pp * cfg.vpp - 1) % cfg.pp
        last = (per * (g["post_params"] + cfg.vpp * g["block_params"])
                + inflight(cfg.schedule, cfg.pp, cfg.vpp, last_rank, m) * (g["post_act"] + cfg.vpp * g["block_act"]))
        if cfg.pp == 1:
            n = len(self.blocks)
            first = per * g["params"] + g["pre_act"] + g["post_act"] + n * g["block_act"]
        allocated = max(first, last, per * g["params"] / cfg.pp) + temp
        on_gpu = self.cluster.device.name != "cpu"
        return (1 + FRAGMENTATION) * allocated + (RUNTIME_RESERVED_BYTES if on_gpu else 0.0)


class _PerSpan(dict):
    """span → f(span), computed on first use."""

    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def __missing__(self, span):
        self[span] = v = self.f(span)
        return v


@dataclass
class _OptView:
    """What `optimizer_time` reads from an Evaluator."""

    cfg: ParallelConfig
    cluster: Cluster


# ---------------------------------------------------------------------------------------------------- search
class _Progress:
    """A one-line progress bar with an ETA on stderr, shown once the search has run for a second."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total, self.t0, self.shown = total, time.perf_counter(), False
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, done: int, best: float | None) -> None:
        elapsed = time.perf_counter() - self.t0
        if not self.enabled or elapsed < 1.0 or not self.total:
            return
        frac = done / self.total
        eta = elapsed * (1 - frac) / frac if frac else float("inf")
        bar = "#" * int(30 * frac)
        best_s = f"best {best:.3f} s" if best is not None else "no plan yet"
        sys.stderr.write(f"\rsearching [{bar:<30}] {done}/{self.total} candidates, {best_s}, ETA {eta:5.1f} s ")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _ilp_options(fix: dict) -> dict:
    out = {}
    if "ac" in fix:
        out["acs"] = (AC(fix["ac"]),)
    if "grad_compress" in fix:
        out["grad_opts"] = (fix["grad_compress"],)
    if "pp_compress" in fix:
        out["pp_opts"] = (fix["pp_compress"],)
    return out


def check_fix(fix: dict) -> None:
    bad = sorted(set(fix) - set(FIXABLE))
    if bad:
        raise ValueError(f"--fix: unknown key {bad[0]!r}; known keys: {', '.join(FIXABLE)}")
    ParallelConfig.from_dict({k: v for k, v in fix.items()})  # validates values (cp/ep must be 1, enums, …)


def search(lg: LayerGraph, cluster: Cluster, global_batch: int, *, fix: dict | None = None, top_k: int = 3,
           time_limit: float = 60.0, progress: bool | None = None) -> SearchResult:
    """The fastest configuration that fits (see the module docstring).

    ``time_limit`` caps the whole search (seconds): when it runs out, the best plan so far is returned with
    status FEASIBLE and the gap to the smallest lower bound not yet explored (a valid global gap)."""
    fix = dict(fix or {})
    check_fix(fix)
    t0 = time.perf_counter()
    cache: dict = {}
    bounds = Bounds(lg, cluster, global_batch, cache)
    kw = _ilp_options(fix)
    stats = {"candidates": 0, "pruned": 0, "pruned_memory": 0, "solved": 0, "infeasible": 0}
    smallest: list = []  # (memory bound, cfg) of the candidate closest to fitting
    found: list[ilp.Solution] = []
    statuses = set()
    backend = ""
    open_bound = None  # the lowest bound left unexplored when the time limit stopped the search
    for cross_node in (False, True):  # tensor parallel crosses nodes only when nothing inside a node fits
        cands = candidates(lg, cluster, global_batch, fix, cross_node_tp=cross_node)
        stats["candidates"] += len(cands)
        capacity = cluster.device.memory_bytes
        live = []
        for cfg in cands:
            mem = bounds.memory(cfg)
            if mem > capacity:
                stats["pruned_memory"] += 1
                smallest.append((mem, _order_key(cfg), cfg))
                continue
            live.append((bounds.time(cfg), _order_key(cfg), cfg))
        live.sort(key=lambda x: (x[0], x[1]))
        bar = _Progress(len(live), progress)
        for done, (lb, _, cfg) in enumerate(live):
            ranked = sorted(s.objective for s in found)
            if len(ranked) > top_k and lb >= ranked[top_k]:
                stats["pruned"] += len(live) - done
                break
            bar.update(done, ranked[0] if ranked else None)
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0 and found:
                open_bound = lb
                stats["pruned"] += len(live) - done
                break
            try:
                sol = ilp.solve(lg, cluster, cfg, global_batch, time_limit=max(left, 1.0), cost_cache=cache, **kw)
            except ilp.Infeasible:
                stats["infeasible"] += 1
                smallest.append((max(bounds.memory(cfg), capacity), _order_key(cfg), cfg))
                continue
            except (ConfigError, ilp.NotSupportedError):
                continue
            finally:
                stats["solved"] += 1
            backend = sol.backend
            statuses.add(sol.status)
            found.append(sol)
            found.sort(key=lambda s: s.objective)  # stable: ties keep the earlier candidate first
            del found[top_k + 1:]
        bar.close()
        if found:
            break
    stats["pruned"] += stats["pruned_memory"]
    if not found and not stats["candidates"]:
        raise NoPlanFits(f"no configuration satisfies --fix {','.join(f'{k}={v}' for k, v in fix.items())} for "
                         f"{lg.model.name} on {cluster.world_size} GPUs with global batch {global_batch} (dp·tp·pp "
                         f"must equal the GPUs, tp divide the heads, dp·mbs divide the batch); relax --fix")
    if not found:
        raise _no_fit(lg, cluster, global_batch, fix, smallest)
    best = found[0]
    alts = tuple(_why(best, s) for s in found[1:top_k + 1])
    gap = best.gap
    status = "OPTIMAL" if statuses == {"OPTIMAL"} and open_bound is None else "FEASIBLE"
    if open_bound is not None:
        gap = max(gap, (best.objective - min(open_bound, best.bound)) / best.objective)
    return SearchResult(best=best, alternatives=alts, time_s=time.perf_counter() - t0, backend=backend,
                        status=status, gap=gap, **stats)


def _why(best: ilp.Solution, alt: ilp.Solution) -> Alternative:
    b, a = best.estimate.breakdown_s, alt.estimate.breakdown_s
    diffs = {k: a[k] - b[k] for k in b}
    key = max(diffs, key=lambda k: (diffs[k], k))
    return Alternative(solution=alt, lost_by=key, lost_by_s=diffs[key])


def _no_fit(lg, cluster, global_batch, fix, smallest) -> NoPlanFits:
    cap = cluster.device.memory_bytes
    if not smallest:
        where = f" with --fix {','.join(f'{k}={v}' for k, v in fix.items())}" if fix else ""
        return NoPlanFits(f"no configuration of {lg.model.name} fits on {cluster.world_size} GPUs{where} "
                          f"(global batch {global_batch}); every candidate was infeasible in memory: use more GPUs, "
                          "a smaller micro-batch or recomputation")
    mem, _, cfg = min(smallest, key=lambda x: (x[0], x[1]))
    more = max(2, -(-int(mem) // int(cap)))
    return NoPlanFits(
        f"no plan fits: the smallest ({_short(cfg)}, full recomputation) needs at least {mem / GiB:.1f} GiB per GPU "
        f"but a GPU has {cap / GiB:.1f} GiB; use more GPUs (about {more}× as many), a smaller micro-batch, "
        f"or recomputation/sharding (ac=full, zero=3) if --fix excludes them")


def _short(cfg: ParallelConfig) -> str:
    return (f"dp={cfg.dp},tp={cfg.tp},pp={cfg.pp},mbs={cfg.mbs},zero={cfg.zero}"
            + (f",vpp={cfg.vpp}" if cfg.vpp > 1 else ""))


__all__ = ["search", "candidates", "Bounds", "SearchResult", "Alternative", "NoPlanFits"]


# ------------------------------------------------------------------------------------------------------ plans
def make_plan(lg: LayerGraph, cluster: Cluster, global_batch: int, result: SearchResult, *, model: str,
              cluster_spec: str) -> "Plan":
    """The frozen Plan of a search result (per-layer strategies, stages, prediction, solver facts)."""
    from costmodel.cluster import dump_cluster
    from costmodel.layercost import is_tp_layer as _tp
    from planner.plan import LayerStrategy, Plan, StageInfo, provenance
    import yaml

    best = result.best
    cfg = best.config
    layers = tuple(LayerStrategy(name=layer.name, stage=best.stage_of[i], ac=best.acs[i],
                                 tp=cfg.tp > 1 and _tp(layer)) for i, layer in enumerate(lg.layers))
    stages = tuple(StageInfo(index=s.index, rank=s.rank, first=s.first, last=s.last, time_s=s.time_s,
                             memory_bytes=s.memory_bytes, inflight=int(round(s.inflight)))
                   for s in best.estimate.stages)
    solver = {"status": result.status, "objective": best.objective, "bound": best.objective * (1 - result.gap),
              "gap": result.gap, "time_s": round(result.time_s, 3), "candidates": result.candidates,
              "pruned": result.pruned, "solved": result.solved, "infeasible": result.infeasible,
              "backend": result.backend}
    alternatives = tuple({"config": a.solution.config.to_dict(), "predicted": a.solution.estimate.to_json(),
                          "lost_by": a.lost_by, "lost_by_s": a.lost_by_s} for a in result.alternatives)
    return Plan(model=model, fingerprint=lg.model.fingerprint, seq=lg.model.seq, global_batch=global_batch,
                cluster=cluster_spec, config=cfg, layers=layers, stages=stages, predicted=best.estimate.to_json(),
                solver=solver, alternatives=alternatives,
                # workaround: plan.provenance returns torch.__version__ as a TorchVersion (a str subclass) that
                # yaml.safe_dump refuses; a JSON round trip makes every value a plain type
                provenance=json.loads(json.dumps(provenance(yaml.safe_load(dump_cluster(cluster))), default=str)))


def default_global_batch(cluster: Cluster) -> int:
    """8 sequences per GPU: the default when --global-batch is omitted."""
    return 8 * cluster.world_size


def plan_for_module(model, example_inputs, *, cluster: str = "cpu-local", world_size: int | None = None,
                    global_batch: int | None = None, **kw) -> "Plan":
    """Capture ``model`` on ``example_inputs`` and plan it for ``cluster`` (for `auto_parallelize`).

    ``world_size`` (when given) must equal the cluster's GPUs; ``global_batch`` defaults to the example batch
    times the world size; other keywords go to `search` (fix, top_k, time_limit)."""
    from costmodel.cluster import load_cluster
    from profiler.capture import capture
    from profiler.layers import group_layers

    cl = load_cluster(cluster)
    if world_size is not None and world_size != cl.world_size:
        cl = load_cluster(f"{cluster}:nodes={world_size // cl.gpus_per_node}") \
            if world_size % cl.gpus_per_node == 0 and ":" not in cluster else cl
        if world_size != cl.world_size:
            raise ValueError(f"world size {world_size} but cluster {cluster} has {cl.world_size} GPUs; pass a "
                             "cluster with that many GPUs")
    name = f"module:{type(model).__name__}"
    lg = group_layers(capture(model, example_inputs, name=name))
    batch = lg.model.batch or 1
    gb = global_batch or batch * cl.world_size
    result = search(lg, cl, gb, **kw)
    return make_plan(lg, cl, gb, result, model=name, cluster_spec=cluster)
