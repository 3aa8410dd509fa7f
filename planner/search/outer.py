"""The outer search: mesh shapes, schedules, micro-batches and sharding, each candidate solved by `planner.search.ilp`.

Candidates (`candidates`): dp·tp·pp = the cluster's GPUs; tp divides the heads and kv_heads and stays inside a node
(tp ≤ gpus_per_node; larger tp only when no plan inside a node exists); tp and dp·tp divide the GPUs per node or are
multiples of it (regular groups, each priced as the one at rank 0 is); pp·vpp ≤ the number of blocks; dp·mbs divides
the global batch and mbs ≤ `MAX_MBS`; zero ∈ {0, 1, 2, 3} when dp > 1 (with dp = 1 they are all the same job: only
0); sp ∈ {off, on} when tp > 1; with pp > 1 the schedules gpipe, 1f1b, zb (vpp = 1: the cost model's ZB-H1 gains
nothing from virtual stages) and interleaved with 2 ≤ vpp ≤ `MAX_VPP`; for a mixture-of-experts model, ep among the
divisors of dp that divide the number of experts (`costmodel.moe`: expert-parallel ranks borrowed from dp). ``fix``
pins any key.
Per-layer AC and the compression of each group are the ILP's choices (``fix`` pins them too).

Pruning (all exact: the winner is the optimum over the whole space unless the time limit stops the search):
- memory: the most loaded rank's model states with the candidate's sharding plus its smallest activations already
  exceed a GPU, or the activation knapsack of `planner.search.bounds` has no solution ⇒ skip;
- bounds (`planner.search.bounds`, stated and proved there; `tests/test_ilp.py` checks bound ≤ ILP optimum): a
  cheap bound for every candidate (memory-aware work, integral bottleneck, FSDP and data-parallel exposure),
  sorted; a refined bound (per-rank memory on the bottleneck) for those that survive;
- incumbents: before any ILP, the greedy plan (even stages, the least uniform recomputation that fits) of each
  candidate in bound order, evaluated by `Evaluator.evaluate`, until the bound passes the (top_k + 1)-th best of
  them. Every known plan value is an upper bound on a distinct candidate's optimum, so a candidate whose bound
  exceeds the (top_k + 1)-th smallest known value cannot be among the top_k + 1;
- ILP cutoffs: a candidate that may win is solved with the constraint "step ≤ the best known" (INFEASIBLE proves
  it cannot win, usually in well under a second); one whose bound already reaches the best can only be a
  runner-up and is solved with the cutoff of the (top_k + 1)-th best known within `ALT_TIME_S` (a runner-up cut
  short keeps its own gap; the winner's proof does not depend on it); once `ALT_TOTAL_S` has gone into such
  runner-ups, the remaining ones keep their greedy plans as alternatives (counted in ``alt_greedy``).

Dominance (kept unless ``fix`` pins the key): GPipe is dominated by 1F1B (φ = 1 for both, GPipe holds m ≥ p − r
micro-batches in flight: same time, more memory); 1F1B by ZB-H1 (costmodel.memory gives it 1F1B's in-flight
count and costmodel.estimate φ = 1/3 < 1 with every other term equal, unless zero-bubble must all-reduce DDP
gradients after the backward where 1F1B overlaps them); sp=off by sp=on (costmodel.layercost: the same collective
time, replicated work and activations divided by t). These are dominances *under this cost model*; a different
cost model would have to re-check them. A dominating option counts only where the runtime can run it for that
plan (`costmodel.runnable.problems`): sp=off stays when seq is not divisible by tp, and so on.

Runnable: every candidate passes `costmodel.runnable.problems`, the rules the emitter and the runtime apply too
(divisibility, micro-batches per pipeline, schedule × sharding, compression × sharding), so any plan the search
returns emits a script that starts.

Determinism: candidates are sorted by (time bound, dp, tp, pp, vpp, schedule, mbs, zero, sp, ep); ties between plans
go to the earlier candidate in that order; the ILP backend is deterministic. Time limits (the search's, and
`ALT_TIME_S` for runner-ups) can change which runner-ups are proved, never a proved winner. Only
``solver.time_s`` and the provenance's creation stamp depend on the clock.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
import sys
import time
from dataclasses import dataclass, replace
from functools import partial

from costmodel.cluster import Cluster
from costmodel.compression import allowed_options
from costmodel.config import AC, ParallelConfig, Schedule, parse_grad_compress
from costmodel.estimate import (
    ConfigError,
    Evaluator,
    block_acs,
    even_stages,
    selective_of,
    split_layers,
    stage_blocks_problem,
)
from costmodel.layercost import is_tp_layer
from costmodel.runnable import checkpoint_modes, context_problems
from costmodel.runnable import problems as runnable_problems
from planner.plan import Plan
from planner.search import ilp
from planner.search.bounds import Bounds
from profiler.graph import LayerGraph
from profiler.layers import has_attention_core

MAX_MBS = 16  #: largest micro-batch tried (a divisor of global_batch / dp)
MAX_VPP = 8  #: most virtual stages per pipeline rank tried with the interleaved schedule
ALT_TIME_S = 2.0  #: time limit of the ILP of a candidate that can only be a runner-up (it cannot beat the best)
ALT_TOTAL_S = 3.0  #: total seconds for runner-up ILPs; later runner-ups keep their greedy plan (never the winner)
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
    incumbents: int = 0  #: greedy plans evaluated before any ILP (upper bounds for pruning)
    cut_off: int = 0  #: ILPs proved infeasible under the cutoff "step ≤ the (top_k + 1)-th best known plan"
    alt_greedy: int = 0  #: runner-up candidates left at their greedy plan once `ALT_TOTAL_S` was spent


# ------------------------------------------------------------------------------------------------ candidates
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(lg: LayerGraph, cluster: Cluster, global_batch: int, fix: dict, *,
               cross_node_tp: bool = False, refused: list | None = None,
               compiled: bool = False) -> list[ParallelConfig]:
    """Every configuration of the search space that satisfies ``fix`` (see the module docstring). ``refused``
    collects (configuration, the runtime's first reason) for those `costmodel.runnable` rules out; ``compiled``:
    the blocks run under torch.compile (with a pinned ``ac``, the rules decide whether it compiles)."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    arch = lg.model.arch
    experts = int(arch.get("experts") or 0)
    n_blocks = len(split_layers(lg)[1])  # the run of blocks pipeline stages are cut inside
    tp_ok = any(is_tp_layer(layer) for layer in lg.blocks)
    # mixed bf16 where the device has bf16 units; fp32 otherwise (the cpu-local ranks train in fp32)
    precision = fix.get("precision", "bf16" if "bf16" in cluster.device.peak_flops else "fp32")
    out = []
    for tp in _divisors(world):
        if tp > 1 and not tp_ok:
            if refused is not None and "tp" in fix and _norm(fix["tp"]) == tp:  # (say why a pinned tp is out)
                refused.append((ParallelConfig(dp=world // tp, tp=tp, precision=precision), arch.get("tp_split") or (
                    "no block holds column- and row-parallel linears by name (`profiler.layers`); re-plan with "
                    "--fix tp=1")))
            continue
        if tp > 1 and any(arch.get(k) and arch[k] % tp for k in ("heads", "kv_heads")):
            continue
        if (tp > gpn) != cross_node_tp:
            continue
        if not _regular(tp, gpn):
            continue  # some TP groups would straddle nodes: the cost model prices the group at rank 0 only
        for pp, cp in itertools.product(_divisors(world // tp), _divisors(world // tp)):
            if pp > 1 and pp > n_blocks:
                pinned = all(k in fix and _norm(fix[k]) == _norm(v) if k == "pp" else
                             k not in fix or _norm(fix[k]) == _norm(v) for k, v in (("pp", pp), ("tp", tp)))
                if refused is not None and pinned and cp == 1:  # (say why a pinned pp is out, once)
                    refused.append((ParallelConfig(dp=world // (tp * pp), tp=tp, pp=pp, precision=precision),
                                    stage_blocks_problem(lg, pp)))
                continue
            if (world // tp) % (pp * cp) or (cp > 1 and context_problems(
                    {"cp": cp, "tp": tp, "pp": pp, "seq": lg.model.seq, "cp_ready": bool(arch.get("cp_ready"))})):
                continue  # (the rules on context parallelism that hold whatever the rest: once, not per candidate)
            dp = world // (tp * pp * cp)
            if not (_regular(cp * tp, gpn) and _regular(dp * cp * tp, gpn)):
                continue  # likewise for the cp groups (stride tp), dp × cp (stride tp) and the pipeline's
            if global_batch % dp:
                continue
            mbss = [b for b in _divisors(global_batch // dp) if b <= MAX_MBS]
            scheds = [(Schedule.ONE_F_ONE_B, 1)]
            if pp > 1:
                scheds = [(s, 1) for s in SCHEDULES if s != Schedule.INTERLEAVED]
                scheds += [(Schedule.INTERLEAVED, v) for v in range(2, MAX_VPP + 1) if pp * v <= n_blocks]
            # expert parallelism: ep ranks borrowed from dp, dividing the number of experts (`costmodel.moe`)
            eps = [e for e in _divisors(dp) if experts % e == 0] if experts > 1 else [1]
            runnable = {}  # configuration key → the configuration, for those the runtime can run
            for (sched, vpp), mbs, zero, sp, ep in itertools.product(
                    scheds, mbss, (0, 1, 2, 3) if dp * cp > 1 else (0,), (False, True) if tp > 1 else (False,), eps):
                key = {"dp": dp, "tp": tp, "pp": pp, "vpp": vpp, "schedule": sched.value, "mbs": mbs,
                       "zero": zero, "sp": sp, "ep": ep, "cp": cp}
                if any(k in fix and _norm(fix[k]) != _norm(v) for k, v in key.items()):
                    continue
                cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=sched, mbs=mbs, zero=zero, sp=sp,
                                     precision=precision, ep=ep, cp=cp)
                facts = cfg.runnable_facts(global_batch, arch, lg.model.seq)
                facts["grad_compress"] = parse_grad_compress(fix.get("grad_compress", "none"))[0]
                # (pinned; unpinned, AC is the ILP's choice: `_candidate_options` limits it)
                facts["selective_ac"] = getattr(fix.get("ac"), "value", fix.get("ac")) == "selective"
                facts["checkpointed"] = fix.get("ac", "none") != "none"
                if compiled:
                    facts["compile"] = "inductor"
                why = runnable_problems(facts)
                if why:  # the runtime would refuse it (costmodel.runnable): never offered
                    if refused is not None:
                        refused.append((cfg, why[0]))
                    continue
                runnable[_key(cfg)] = cfg
            out += [cfg for cfg in runnable.values() if not _dominated(cfg, runnable, fix)]
    return out


def _regular(span: int, gpus_per_node: int) -> bool:
    """Whether every group of ``span`` consecutive ranks lies on the nodes alike (within one node, or over whole
    nodes): only then is the group at rank 0, which the cost model prices (`costmodel.cluster.group_span`), the
    same as every other. tp = 6 on 8-GPU nodes is not: two of its four groups straddle two nodes."""
    return gpus_per_node % span == 0 if span <= gpus_per_node else span % gpus_per_node == 0


def _key(cfg: ParallelConfig) -> tuple:
    return (cfg.dp, cfg.tp, cfg.pp, cfg.vpp, cfg.schedule, cfg.mbs, cfg.zero, cfg.sp, cfg.ep, cfg.cp)


def _dominated(cfg: ParallelConfig, runnable: dict, fix: dict) -> bool:
    """Whether a runnable configuration that differs from ``cfg`` only in a key ``fix`` leaves free is at least as
    good under this cost model in time and memory (see the module docstring). Only a runnable dominator counts: an
    option the runtime cannot do for this plan dominates nothing."""
    def there(**change) -> ParallelConfig | None:
        return runnable.get(_key(replace(cfg, **change)))

    if "schedule" not in fix and cfg.pp > 1:
        if cfg.schedule == Schedule.GPIPE and there(schedule=Schedule.ONE_F_ONE_B):
            return True
        zb = there(schedule=Schedule.ZERO_BUBBLE) if cfg.schedule == Schedule.ONE_F_ONE_B else None
        # ZB-H1 beats 1F1B only where both reduce gradients alike: with DDP (zero ≤ 1, tp = 1) zero-bubble all-reduces
        # after the backward (costmodel.runnable.post_step_allreduce), which 1F1B overlaps
        if zb is not None and zb.reduces_after_step == cfg.reduces_after_step:
            return True
    return "sp" not in fix and cfg.tp > 1 and not cfg.sp and there(sp=True) is not None


def _norm(v):
    return v.value if isinstance(v, Schedule) else v


def _order_key(cfg: ParallelConfig) -> tuple:
    return (cfg.dp, cfg.tp, cfg.pp, cfg.vpp, SCHEDULES.index(cfg.schedule), cfg.mbs, cfg.zero, cfg.sp, cfg.ep, cfg.cp)


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


def _ilp_options(fix: dict, compress: str) -> dict:
    out: dict = {"policy": compress}
    if "ac" in fix:
        out["acs"] = (AC(fix["ac"]),)
    if "grad_compress" in fix:
        out["grad_opts"] = (fix["grad_compress"],)
    if "pp_compress" in fix:
        out["pp_opts"] = (fix["pp_compress"],)
    return out


def check_fix(fix: dict) -> None:
    """Refuse unknown keys, bad values and pins that contradict each other. A pin constrains only its own key:
    where a rule ties it to a key left free (schedule=interleaved and vpp, vpp > 1 and the schedule and pp, sp=on
    and tp), the free key is validated at a value the search may choose, not at its default."""
    bad = sorted(set(fix) - set(FIXABLE))
    if bad:
        raise ValueError(f"--fix: unknown key {bad[0]!r}; known keys: {', '.join(FIXABLE)}")
    free: dict = {}
    if str(fix.get("schedule")) in ("interleaved", Schedule.INTERLEAVED.value) and "vpp" not in fix:
        free["vpp"] = 2
    if int(fix.get("vpp", 1)) > 1:
        free |= {key: value for key, value in (("schedule", Schedule.INTERLEAVED.value), ("pp", 2)) if key not in fix}
    if str(fix.get("sp", "")).lower() in ("on", "true", "1") and "tp" not in fix:
        free["tp"] = 2
    if int(fix.get("ep", 1)) > 1 and "dp" not in fix:
        free["dp"] = int(fix["ep"])  # ep borrows dp ranks: dp is a multiple of it
    ParallelConfig.from_dict(free | fix)  # validates values (enums, ranges, …)


def search(lg: LayerGraph, cluster: Cluster, global_batch: int, *, fix: dict | None = None, top_k: int = 3,
           time_limit: float = 60.0, progress: bool | None = None, measured: tuple | None = None,
           compress: str = "none", compiled: bool = False) -> SearchResult:
    """The fastest configuration that fits (see the module docstring).

    ``compress``: which gradient and pipeline-boundary compressions the search may choose
    (`costmodel.compression.COMPRESSION_POLICIES`: by default none, nothing that changes the numbers); one pinned in
    ``fix`` is used whatever the policy.

    ``measured``: per-layer times on the cluster's device (`costmodel.measured.load_measured`), used by every
    estimate of the search instead of the roofline's level.

    ``compiled``: the blocks run under torch.compile (the script's ``--compile``): memory-bound ops are priced as
    fused kernels (`costmodel.layercost.compiled_bytes`), and candidates with tensor parallelism are planned without
    activation checkpointing, which torch 2.13 cannot compile with DTensor inputs (`costmodel.runnable`).

    ``time_limit`` caps the whole search (seconds): when it runs out, the best plan so far (an ILP's or a greedy
    incumbent's) is returned with status FEASIBLE and the gap to the smallest lower bound not yet explored (a
    valid global gap)."""
    fix = dict(fix or {})
    check_fix(fix)
    t0 = time.perf_counter()
    cache: dict = ({"measured": measured} if measured else {}) | ({"compiled": True} if compiled else {})
    kw = _ilp_options(fix, compress)
    core = has_attention_core(lg)  # (which selective policy the runtime runs: `costmodel.runnable.selective_policy`)
    bounds = Bounds(lg, cluster, global_batch, cache,
                    grad_opts=kw.get("grad_opts", allowed_options(compress, ilp.GRAD_OPTIONS)),
                    pp_opts=kw.get("pp_opts", allowed_options(compress, ilp.PP_OPTIONS)))
    stats = {"candidates": 0, "pruned": 0, "pruned_memory": 0, "solved": 0, "infeasible": 0, "incumbents": 0,
             "cut_off": 0, "alt_greedy": 0}
    alt_spent = 0.0  # seconds of runner-up-only ILPs
    smallest: list = []  # (memory bound, cfg) of the candidate closest to fitting
    known: dict[int, ilp.Solution] = {}  # live index → its best known plan: a greedy incumbent, then the ILP's
    solved: list[float] = []  # objectives of the solved ILPs, ascending
    weak: list[float] = []  # bounds of the ILPs that stopped at the time limit
    backend = ""
    open_bound = None  # the lowest bound left unexplored when the time limit stopped the search

    def kth(values) -> float:  # the (top_k + 1)-th smallest: the value a candidate must beat to matter
        return values[top_k] if len(values) > top_k else float("inf")

    refused: list = []
    for cross_node in (False, True):  # tensor parallel crosses nodes only when nothing inside a node fits
        cands = candidates(lg, cluster, global_batch, fix, cross_node_tp=cross_node, refused=refused,
                           compiled=compiled)
        stats["candidates"] += len(cands)
        capacity = cluster.memory_budget_bytes
        live = []
        for cfg in cands:
            mem = bounds.memory(cfg, capacity)
            lb = bounds.time(cfg) if mem <= capacity else float("inf")
            if lb == float("inf"):  # no plan of it fits (memory bound, or the activation knapsack)
                stats["pruned_memory"] += 1
                smallest.append((max(mem, capacity) if mem <= capacity else mem, _order_key(cfg), cfg))
                continue
            live.append((lb, _order_key(cfg), cfg))
        live.sort(key=lambda x: (x[0], x[1]))
        known.clear()
        # 1. incumbents: greedy plans (even stages, uniform least recomputation that fits), in bound order, until
        #    the bound reaches the (top_k + 1)-th best of them
        refined: dict[int, float] = {}

        def tight(i: int, live=live, refined=refined) -> float:  # refined bound of live[i], on first use
            if i not in refined:
                refined[i] = max(live[i][0], bounds.time(live[i][2], refine=True))
            return refined[i]

        ub: list[float] = []
        for i, (lb, _, cfg) in enumerate(live):
            if lb > kth(ub) or time.perf_counter() - t0 > time_limit:
                break
            if tight(i) > kth(ub):
                continue
            sol = _greedy(lg, cluster, cfg, global_batch, cache, tight(i), fix,
                          _candidate_options(kw, cfg, compiled, core).get("acs"))
            if sol is not None:
                known[i] = sol
                bisect.insort(ub, sol.objective)
                stats["incumbents"] += 1
        # 2. ILPs in bound order; a candidate matters only if its bound is below the (top_k + 1)-th best known plan
        #    (each known value is an upper bound on a distinct candidate's optimum)
        bar = _Progress(len(live), progress)
        for done, (lb, _, cfg) in enumerate(live):
            best_known = sorted(s.objective for s in known.values())
            if lb > kth(best_known) or lb >= kth(solved):
                stats["pruned"] += len(live) - done
                break
            bar.update(done, best_known[0] if best_known else None)
            if tight(done) > kth(best_known) or tight(done) >= kth(solved):
                stats["pruned"] += 1
                continue
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0 and known:
                open_bound = min([tight(done)] + [live[j][0] for j in range(done + 1, len(live))])
                stats["pruned"] += len(live) - done
                break
            if best_known and tight(done) >= best_known[0] and alt_spent >= ALT_TOTAL_S:
                stats["alt_greedy"] += 1  # cannot win; the runner-up budget is spent: its greedy plan stays
                continue
            sol, may_win = None, False
            try:
                if not best_known or tight(done) < best_known[0]:
                    # it may win: its exact optimum, or a proof that it is no faster than the best known plan
                    cut = best_known[0] if best_known else None
                    may_win = True
                    try:
                        sol = ilp.solve(lg, cluster, cfg, global_batch, time_limit=max(left, 1.0), cost_cache=cache,
                                        cutoff=cut, **_candidate_options(kw, cfg, compiled, core))
                    except ilp.CutOff:
                        stats["cut_off"] += 1
                        may_win = False  # proved no faster than the best known plan
                if sol is None:
                    # a runner-up at best: solved with the cutoff of the (top_k + 1)-th best known plan, within
                    # ALT_TIME_S (a time-limited runner-up keeps its own gap; the winner's proof is unaffected),
                    # while the runner-up budget lasts; after it, its greedy plan (if any) stays
                    if alt_spent >= ALT_TOTAL_S:
                        stats["alt_greedy"] += 1
                        continue
                    cut = kth(best_known)
                    t_alt = time.perf_counter()
                    try:
                        sol = ilp.solve(lg, cluster, cfg, global_batch, time_limit=max(min(left, ALT_TIME_S), 0.1),
                                        cost_cache=cache, cutoff=None if cut == float("inf") else cut,
                                        **_candidate_options(kw, cfg, compiled, core))
                    finally:
                        alt_spent += time.perf_counter() - t_alt
            except ilp.CutOff:  # proved slower than the (top_k + 1)-th best known plan: cannot matter
                stats["cut_off"] += 1
                continue
            except ilp.Infeasible as e:
                if e.status == "NOT_SOLVED":  # out of time without a plan: its greedy plan (if any) stays
                    if may_win:
                        weak.append(tight(done))
                    continue
                stats["infeasible"] += 1
                smallest.append((max(bounds.memory(cfg), capacity), _order_key(cfg), cfg))
                continue
            except (ConfigError, ilp.NotSupportedError):
                continue
            finally:
                stats["solved"] += 1
            if sol.status != "OPTIMAL" and may_win:
                weak.append(sol.bound)  # a time-limited ILP: its bound limits the proof of the winner
            backend = sol.backend
            if done not in known or sol.objective <= known[done].objective:
                known[done] = sol
            bisect.insort(solved, sol.objective)
        bar.close()
        if known:
            break
    stats["pruned"] += stats["pruned_memory"]
    if not known and not stats["candidates"] and refused:
        cfg, why = refused[0]
        which = f"that satisfies --fix {','.join(f'{k}={v}' for k, v in fix.items())} " if fix else ""
        raise NoPlanFits(f"no configuration {which}can run: e.g. {_short(cfg)}: {why}")
    if not known and not stats["candidates"]:
        raise NoPlanFits(f"no configuration satisfies --fix {','.join(f'{k}={v}' for k, v in fix.items())} for "
                         f"{lg.model.name} on {cluster.world_size} GPUs with global batch {global_batch} (dp·tp·pp "
                         f"must equal the GPUs, tp divide the heads, dp·mbs divide the batch); relax --fix")
    if not known:
        raise _no_fit(lg, cluster, global_batch, fix, smallest)
    # ties go to the earlier candidate in bound order
    found = [known[i] for i in sorted(known, key=lambda i: (known[i].objective, i))][:top_k + 1]
    best = found[0]
    alts = tuple(_why(best, s) for s in found[1:top_k + 1])
    # the winner is proved when its own ILP is optimal, every other candidate was pruned by a bound, cut off at
    # or solved above it, and no time-limited ILP's bound lies below it
    lowest = min([best.bound] + weak + ([open_bound] if open_bound is not None else []))
    gap = max(best.gap, (best.objective - lowest) / best.objective)
    status = "OPTIMAL" if best.status == "OPTIMAL" and gap <= 1e-9 else "FEASIBLE"
    if best.backend == GREEDY:
        backend = backend or GREEDY
    return SearchResult(best=best, alternatives=alts, time_s=time.perf_counter() - t0, backend=backend,
                        status=status, gap=gap, **stats)


GREEDY = "greedy"  #: the backend name of an incumbent that no ILP improved (time limit)


def _candidate_options(kw: dict, cfg: ParallelConfig, compiled: bool, attention_core: bool) -> dict:
    """The ILP's options for one candidate: the search's, and the AC modes the runtime can run with it
    (`costmodel.runnable`): with torch.compile and tensor parallelism none (torch 2.13 cannot compile a checkpointed
    block's DTensor inputs), nor under the zero-bubble schedule (its weight pass recomputes a checkpointed block
    once per parameter group); with expert parallelism, or context parallelism where selective AC is the per-op
    policy (the model has no attention core), no selective AC."""
    modes = checkpoint_modes(cfg.tp, cfg.ep, compiled, zero_bubble=cfg.zero_bubble,
                             cp=cfg.cp, attention_core=attention_core)
    if "acs" in kw or len(modes) == len(AC):
        return kw
    return kw | {"acs": tuple(a for a in ilp.AC_ORDER if a.value in modes)}


def _greedy(lg, cluster, cfg, global_batch, cache, lb, fix, acs=None) -> ilp.Solution | None:
    """The greedy plan of a candidate (Megatron's even stages, the least uniform recomputation that fits, the
    pinned or no compression) as a feasible Solution with the candidate's lower bound, or None if it does not fit."""
    t0 = time.perf_counter()
    grad, ppc = fix.get("grad_compress", "none"), fix.get("pp_compress", "none")
    if cfg.pp == 1:
        ppc = "none"
    if cfg.data_ranks == 1 or cfg.zero >= 2:
        grad = "none" if "grad_compress" not in fix else grad
    acs = acs or ((AC(fix["ac"]),) if "ac" in fix else ilp.AC_ORDER)
    try:
        ev = Evaluator(lg, cluster, replace(cfg, grad_compress=grad, pp_compress=ppc), global_batch, cache=cache)
        stage_of = even_stages(lg, cfg.pp * cfg.vpp)
        for a in acs:
            est = ev.evaluate([a] * len(lg.layers), stage_of)
            if est.fits:
                ilp.validate(stage_of, cfg.pp * cfg.vpp)
                obj = est.step_time_s
                bound = min(lb, obj)
                return ilp.Solution(config=replace(ev.cfg, ac=a), acs=tuple([a] * len(lg.layers)),
                                    stage_of=tuple(stage_of), estimate=est, status="FEASIBLE", objective=obj,
                                    bound=bound, gap=max(0.0, (obj - bound) / obj), time_s=time.perf_counter() - t0,
                                    backend=GREEDY)
    except (ConfigError, AssertionError):
        return None
    return None


def _why(best: ilp.Solution, alt: ilp.Solution) -> Alternative:
    b, a = best.estimate.breakdown_s, alt.estimate.breakdown_s
    diffs = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in b | a}  # (ep_comm only where ep > 1)
    key = max(diffs, key=lambda k: (diffs[k], k))
    return Alternative(solution=alt, lost_by=key, lost_by_s=diffs[key])


def _no_fit(lg, cluster, global_batch, fix, smallest) -> NoPlanFits:
    cap = cluster.memory_budget_bytes
    if not smallest:
        where = f" with --fix {','.join(f'{k}={v}' for k, v in fix.items())}" if fix else ""
        return NoPlanFits(f"no configuration of {lg.model.name} fits on {cluster.world_size} GPUs{where} "
                          f"(global batch {global_batch}); every candidate was infeasible in memory: use more GPUs, "
                          "a smaller micro-batch or recomputation")
    bound, _, cfg = min(smallest, key=lambda x: (x[0], x[1]))
    # its least-memory plan as the search may make it: even stages, the recomputation --fix allows that holds least
    # (no recomputation under zero-bubble: `checkpoint_modes`)
    if "ac" in fix:
        ac = AC(fix["ac"])
        what = f"ac={ac.value} as --fix pins it"
    elif cfg.zero_bubble:
        ac, what = AC.NONE, "no recomputation (zero-bubble)"
    else:
        ac, what = AC.FULL, "full recomputation"
    try:
        est = Evaluator(lg, cluster, replace(cfg, ac=ac), global_batch).evaluate(
            [ac] * len(lg.layers), even_stages(lg, cfg.pp * cfg.vpp))
        mem, needs = max(bound, est.memory.peak), "needs"
    except (ConfigError, AssertionError):
        mem, needs = bound, "needs at least"
    if mem <= cap:  # (the memory bound fits, yet no recomputation or stage split did: say no more than is known)
        return NoPlanFits(
            f"no plan fits: the closest ({_short(cfg)}) fits no split of its layers into stages with the "
            f"recomputation --fix allows in {cap / GiB:.1f} GiB per GPU; use more GPUs, a smaller micro-batch, or "
            "recomputation/sharding (ac=full, zero=3) if --fix excludes them")
    more = max(2, -(-int(mem) // int(cap)))
    return NoPlanFits(
        f"no plan fits: the smallest ({_short(cfg)}, {what}) {needs} {mem / GiB:.1f} GiB per GPU but a GPU has "
        f"{cap / GiB:.1f} GiB; use more GPUs (about {more}× as many), a smaller micro-batch, "
        f"or recomputation/sharding (ac=full, zero=3) if --fix excludes them")


def _short(cfg: ParallelConfig) -> str:
    return (f"dp={cfg.dp},tp={cfg.tp},pp={cfg.pp},mbs={cfg.mbs},zero={cfg.zero}"
            + (f",vpp={cfg.vpp}" if cfg.vpp > 1 else "") + (f",cp={cfg.cp}" if cfg.cp > 1 else "")
            + (f",ep={cfg.ep}" if cfg.ep > 1 else ""))


__all__ = ["search", "candidates", "Bounds", "SearchResult", "Alternative", "NoPlanFits"]


# ------------------------------------------------------------------------------------------------------ plans
def _rows(inputs, batch: int) -> list:
    """``inputs`` (a batch of B rows in each tensor's first dimension) as ``batch`` rows: each tensor repeated
    batch / B times along its first dimension; anything else as it is."""
    import torch

    b = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim()), batch)
    if batch % b:
        raise ValueError(f"{batch} rows from inputs of {b}")
    return [t.repeat(batch // b, *[1] * (t.dim() - 1)) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == b
            else t for t in inputs]


def make_plan(lg: LayerGraph, cluster: Cluster, global_batch: int, result: SearchResult, *, model: str,
              cluster_spec: str, compile: str | None = None, profile: str | None = None) -> Plan:
    """The frozen Plan of a search result (per-layer strategies, stages, prediction, solver facts); ``compile``:
    the torch.compile backend it was searched under (`search`'s ``compiled``); ``profile``: the profile file its
    layers were priced from (`search`'s ``measured``)."""
    import yaml

    from costmodel.cluster import dump_cluster
    from costmodel.layercost import is_tp_layer as _tp
    from planner.plan import LayerStrategy, Plan, StageInfo, provenance

    best = result.best
    cfg = best.config
    acs = block_acs(lg, best.acs)
    layers = tuple(LayerStrategy(name=layer.name, stage=best.stage_of[i], ac=acs[i],
                                 tp=cfg.tp > 1 and _tp(layer)) for i, layer in enumerate(lg.layers))
    stages = tuple(StageInfo(index=s.index, rank=s.rank, first=s.first, last=s.last, time_s=s.time_s,
                             memory_bytes=s.memory_bytes, inflight=s.inflight, memory_parts=s.memory_parts)
                   for s in best.estimate.stages)
    solver = {"status": result.status, "objective": best.objective, "bound": best.objective * (1 - result.gap),
              "gap": result.gap, "time_s": round(result.time_s, 3), "candidates": result.candidates,
              "pruned": result.pruned, "solved": result.solved, "infeasible": result.infeasible,
              "backend": result.backend}
    alternatives = tuple({"config": a.solution.config.to_dict(), "predicted": a.solution.estimate.to_json(),
                          "lost_by": a.lost_by, "lost_by_s": a.lost_by_s,
                          # "ilp": the best plan of its configuration; "greedy": a feasible plan of it, not proved
                          "solved_by": "greedy" if a.solution.backend == GREEDY else "ilp"}
                         for a in result.alternatives)
    return Plan(model=model, fingerprint=lg.model.fingerprint, seq=lg.model.seq, global_batch=global_batch,
                cluster=cluster_spec, config=cfg, layers=layers, stages=stages, predicted=best.estimate.to_json(),
                solver=solver, alternatives=alternatives, compile=compile, profile=profile,
                selective=selective_of(lg, best.acs),
                # workaround: plan.provenance returns torch.__version__ as a TorchVersion (a str subclass) that
                # yaml.safe_dump refuses; a JSON round trip makes every value a plain type
                provenance=json.loads(json.dumps(provenance(yaml.safe_load(dump_cluster(cluster))), default=str)))


def profile_for(model: str, cluster, seq: int | None = None):
    """The layer graph the cost model uses for ``model`` on ``cluster`` (`costmodel.measured.layer_graph`; CPU: the
    fp32 capture with CPU kernels, each layer measured on this machine when it fits)."""
    from costmodel.measured import layer_graph

    return layer_graph(model, cluster, seq)


def default_global_batch(cluster: Cluster) -> int:
    """8 sequences per GPU: the default when --global-batch is omitted."""
    return 8 * cluster.world_size


def plan_for_module(model, example_inputs, *, cluster: str = "cpu-local", world_size: int | None = None,
                    global_batch: int | None = None, **kw) -> Plan:
    """Capture ``model`` on ``example_inputs`` and plan it for ``cluster`` (for `auto_parallelize`).

    ``world_size`` (when given) must equal the cluster's GPUs; ``global_batch`` defaults to the example batch
    times the world size; other keywords go to `search` (fix, top_k, time_limit)."""
    import torch

    from costmodel.cluster import load_cluster
    from profiler.api import runnable_facts
    from profiler.capture import capture
    from profiler.layers import group_layers, has_attend
    from profiler.zoo.hf import HFCausalLMLoss, masks_as_trained

    cl = load_cluster(cluster)
    if world_size is not None and world_size != cl.world_size:
        if ":" not in cluster:  # (a host's ranks, sharing its memory: more processes on it; else more nodes)
            if cl.device.host_memory and cl.nodes == 1:
                cluster = f"{cluster}:gpus_per_node={world_size}"
            elif world_size % cl.gpus_per_node == 0:
                cluster = f"{cluster}:nodes={world_size // cl.gpus_per_node}"
            cl = load_cluster(cluster)
        if world_size != cl.world_size:
            raise ValueError(f"world size {world_size} but cluster {cluster} has {cl.world_size} GPUs; pass a "
                             "cluster with that many GPUs")
    name = f"module:{type(model).__name__}"

    facts: dict = {}

    def layers(autocast: str | None = None) -> LayerGraph:
        # (the arch facts the rules read, as for a captured spec: `profiler.api.runnable_facts`, run once; and
        # whether its blocks make attention scores, in attend methods)
        with masks_as_trained():  # (a Hugging Face module: the masks a training step makes, not export's)
            graph = capture(model, example_inputs, name=name, autocast=autocast)
            out = group_layers(graph)
            if not facts:  # (a module of the user's: its forward and its blocks under TP tried on a meta copy)
                facts.update(runnable_facts(model, out.block_container, example_inputs[0],
                                            user_code=not isinstance(model, HFCausalLMLoss)))
        out.model.arch.update(facts)
        out.model.arch["attention_core"] = has_attention_core(out)
        out.model.arch["attends"] = has_attend(model, out)
        return out

    lg = layers()
    fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
    if fp32:  # what its plans that train under autocast keep (`LayerGraph.under_autocast`)
        lg = replace(lg, recapture=partial(layers, "bf16"))
    if fp32 and cl.device.name.startswith("cpu"):  # the module timed here, as `autopar plan` times a CPU's model
        from costmodel.measured import timed_here

        lg = timed_here(lg, build=lambda b: (copy.deepcopy(model), _rows(example_inputs, b)))
    batch = lg.model.batch or 1
    gb = global_batch or batch * cl.world_size
    result = search(lg, cl, gb, **kw)
    return make_plan(lg, cl, gb, result, model=name, cluster_spec=cluster,
                     compile="inductor" if kw.get("compiled") else None)
