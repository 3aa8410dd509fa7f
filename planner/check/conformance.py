"""Predicted vs traced, per rank role: `check_plan` traces each distinct role of a plan (`planner.check.trace`) and
lines it up with what the cost model charges for the same rank, term by term.

Roles: every data- and tensor-parallel rank of one pipeline rank holds the same shapes, so a plan has one role per
pipeline rank (traced at dp = tp = 0). A deep plan's roles are traced folded (`planner.check.fold`: fewer blocks and
micro-batches, extrapolated; equal to the whole trace), each trace in its own process, as many at once as there
are cores.

Predicted (all from `costmodel`, at the precision the traced runtime runs, `traced_precision`: fp32 on CPU, or the
plan's 16-bit precision under CPU autocast where the runtime trains under autocast, see `planner.check.trace`):

- memory: `costmodel.estimate.Evaluator` on the plan's layers, stages and AC: parameters, gradients, optimizer
  state, activations, temporaries (the "other" part less the GPU allowance, which a trace cannot see) and their sum;
- collectives per step, by kind and group: the data-parallel terms of `costmodel.overlap.dp_step_bytes`, the
  tensor-parallel all-reduce payload of `costmodel.layercost.tp_comm_bytes` (traced sequence-parallel
  all-gather + reduce-scatter pairs count as the all-reduce they replace: (AG + RS)/2);
- context parallelism: the keys' and values' all-gathers and their gradients' reduce-scatters of every attention on
  the cp group (`costmodel.layercost.context_parallel_comm`); the gradients reduce over dp × cp, named ``dp``;
- expert parallelism: the token all-to-alls and count exchanges of `costmodel.moe` on the ep group, and the
  experts' data-parallel terms on the edp group (the ranks holding the same experts);
- pipeline sends and receives: `costmodel.estimate.Evaluator.p2p_bytes` at each of the rank's stage boundaries,
  forward and back, every micro-batch, and under TP the all-gathers around each (`pp_gathers`), half on each side;
- the copies torch's functional collectives make around the tensor-parallel collectives along the sequence
  (``relayout@tp``, `costmodel.layercost.LayerCost.relayout_bytes`) and around the pipeline's gathers
  (`Evaluator.pp_gather_copies`), traced where torch makes them (`planner.check.trace._inner_collectives`);
- the step's scalar all-reduces (`costmodel.overlap.step_scalars`: the gradient norm over every rank, the loss over
  the pipeline and the gradient-reduction groups), under the name the trace gives each group (`trace_group`);
- FLOPs: the micro-batches × (forward + backward + recomputation) FLOPs of the rank's layers as captured (the
  profiler's per-node counts; attention's backward is 2.5 × its forward, not the 2 × of the model-FLOP
  convention), ÷ tp on tensor-parallel layers; under PowerSGD its three matmuls per compressed matrix
  (`costmodel.compression.powersgd_rank`);
- PowerSGD (traced compressing, in DDP's rebuilt buckets: `planner.check.trace._powersgd_steady`,
  `_rebuilt_buckets`): its low-rank factors and the tensors it sends whole, all-reduced over dp
  (`costmodel.compression.powersgd_volume`);

A relative error is |traced − predicted| / max(traced, predicted). The plan conforms when each role's peak memory is
within `MEMORY_TOL` (the parts are reported too: the cost model adds each part's maximum, the trace peaks once),
every collective kind predicted or traced within `COMM_TOL` (a kind traced but not predicted is off by 100 %),
FLOPs within `FLOPS_TOL`, and every rank reduces at least as many gradient elements over its data-parallel group as
it holds (under PowerSGD, as many as it sends: its low-rank factors stand for the matrices).
"""

from __future__ import annotations

from dataclasses import replace

from costmodel.cluster import load_cluster
from costmodel.compression import FP32, powersgd_rank, powersgd_volume
from costmodel.config import parse_grad_compress
from costmodel.estimate import Evaluator
from costmodel.layercost import is_tp_layer, recompute_comm_bytes, tp_comm_bytes
from costmodel.memory import FRAGMENTATION, autocast_dtype, runtime_reserved_bytes
from costmodel.moe import COUNT_BYTES
from costmodel.overlap import dp_step_bytes, step_scalars, tp_partial_bytes
from planner.check.fold import extrapolate, fold_plan, makespan, trace_cost, traces_for
from planner.check.tracers import Tracers, check_capture, trace_job, tracer_cores
from planner.plan import Plan

MEMORY_TOL = 0.05  #: on each role's peak memory (issue 12's acceptance)
COMM_TOL = 0.02  #: per collective kind
FLOPS_TOL = 0.02
#: traced kinds compared through the all-reduce they add up to (`_traced_collectives`)
FOLDED = frozenset({"all_reduce@tp", "all_gather@tp", "reduce_scatter@tp"})
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "peak")


def traced_summary(result: dict) -> dict:
    """What a plan file records of a check (`Plan.traced`): the verdict, the worst errors, and per role the traced
    peak memory and collective bytes beside the predicted ones."""
    roles = []
    for role in result["roles"]:
        got, pred = role["traced"], role["predicted"]
        roles.append({"stage": role["stage"], "rank": role["rank"],
                      "peak_bytes": {"predicted": pred["memory"]["peak"],
                                     "traced": got["memory"]["peak"]},
                      "collective_bytes": {k: {"predicted": pred["collectives"].get(k, 0.0),
                                               "traced": role["traced_equivalent"].get(k, 0.0)}
                                           for k in role["errors"]["collectives"]},
                      "flops": {"predicted": pred["flops"], "traced": got["flops"]}})
    return {k: result[k] for k in ("ok", "memory_error_max", "comm_error_max", "flops_error_max",
                                   "unreduced_params", "precision_traced")} | {"roles": roles}


def rel_error(traced: float, predicted: float) -> float:
    top = max(abs(traced), abs(predicted))
    return abs(traced - predicted) / top if top else 0.0


def traced_precision(plan: Plan) -> str:
    """The precision a check traces ``plan`` at: the plan's 16-bit one where the runtime trains under autocast
    (traced under CPU autocast, `planner.check.trace`), else fp32 (FSDP's mixed-precision policy applies on GPUs
    only)."""
    return autocast_dtype(plan.config) or "fp32"


def predicted_roles(plan: Plan, lg=None) -> list[dict]:
    """What the cost model charges each pipeline rank of ``plan`` at the precision it is traced at
    (`traced_precision`)."""
    cluster = load_cluster(plan.cluster) if isinstance(plan.cluster, str) else plan.cluster
    precision = traced_precision(plan)
    cfg = replace(plan.config, precision=precision)
    autocast = precision if precision != "fp32" else None
    if lg is not None and lg.model.arch.get("autocast") != autocast:
        lg = None
    lg = lg or check_capture(plan.model, plan.seq, autocast)
    names = [layer.name for layer in lg.layers]
    by_name = {lay.name: lay for lay in plan.layers}
    if set(names) != set(by_name):
        raise ValueError(f"{plan.model}: the plan's layers do not match the captured model's; re-plan it")
    acs = [by_name[n].ac for n in names]
    stage_of = [by_name[n].stage for n in names]
    ev = Evaluator(lg, cluster, cfg, plan.global_batch)
    est = ev.evaluate(acs, stage_of)
    kind, rank = parse_grad_compress(cfg.grad_compress)
    roles = []
    for r in range(cfg.pp):
        parts = next(s.memory_parts for s in est.stages if s.rank == r)
        allocated = (parts["peak"] - runtime_reserved_bytes(cfg, cluster.device)) / (1 + FRAGMENTATION)
        # autocast's cast cache (16-bit copies of the parameters, held through its region) is a parameter state to
        # the cost model (`costmodel.memory.state_bytes_per_param`) and tensors made in the step to torch's tracker
        cache = ev.cast_cache_bytes([ev.cost(i, acs[i]) for i, s in enumerate(stage_of) if s % cfg.pp == r])
        memory = {"params": parts["params"] - cache, "grads": parts["grads"], "optimizer": parts["optimizer"],
                  "activations": parts["activations"] + cache}
        memory["temporaries"] = allocated - sum(memory.values())
        memory["peak"] = allocated
        mine = [i for i, s in enumerate(stage_of) if s % cfg.pp == r]
        costs = [ev.cost(i, acs[i]) for i in mine]
        flops = ev.m * sum(c.rank_flops for c in costs)
        collectives = {}
        reduced = None  # gradient elements the rank must reduce over dp: all it holds (None), or PowerSGD's
        if cfg.data_ranks > 1:  # with ep the experts reduce over the ranks holding the same ones (edp)
            experts = sum(c.expert_numel for c in costs) if cfg.ep > 1 else 0.0
            # (under ZeRO 2/3 as FSDP2 gathers them, padded: `costmodel.estimate.Evaluator.gathered_numel`)
            params = sum(ev.gathered_numel(c) for c in costs) - experts
            # the gradient-reduction group is dp × cp: named after cp where it is the cp group (dp = 1), as the
            # trace names a group by its ranks (`planner.check.trace._mesh_groups`)
            group = trace_group(cfg, "dp")
            for k, nbytes in dp_step_bytes(cfg, params, ev.m).items():
                collectives[f"{k}@{group}"] = collectives.get(f"{k}@{group}", 0.0) + nbytes
            if kind == "powersgd":  # its all-reduces (sent whole, Ps, Qs), once per step (DDP: ZeRO 0 and 1)
                compressed, vector, _, _ = powersgd_volume(costs, rank)
                collectives[f"all_reduce@{group}"] = (compressed + vector) * FP32
                reduced = compressed + vector  # (elements: the low-rank factors stand for the matrices)
                # and its three matmuls per compressed matrix, as traced (6mnr: the orthogonalisation's QR or
                # Gram-Schmidt is not counted by torch's FLOP counter)
                flops += sum(6 * m * n * powersgd_rank(m, n, rank) for c in costs for m, n in c.grad_matrices)
            if experts and cfg.dp > cfg.ep:
                for k, nbytes in dp_step_bytes(replace(cfg, dp=cfg.dp // cfg.ep, ep=1), experts, ev.m).items():
                    collectives[f"{k}@edp"] = nbytes
        if cfg.cp > 1:  # every attention's keys and values, and their gradients (costmodel.layercost)
            for kind, nbytes in (("all_gather", sum(c.cp_gather_bytes for c in costs)),
                                 ("reduce_scatter", sum(c.cp_scatter_bytes for c in costs))):
                collectives[f"{kind}@cp"] = collectives.get(f"{kind}@cp", 0.0) + ev.m * nbytes
        if cfg.ep > 1:  # the token all-to-alls and the per-expert count exchanges (costmodel.moe)
            a2a = sum(c.a2a_bytes for c in costs) + COUNT_BYTES * ev.ctx.experts * sum(c.a2a_count_calls
                                                                                        for c in costs)
            if a2a:
                collectives["all_to_all@ep"] = ev.m * a2a
        if cfg.tp > 1 and kind:
            tp_bytes = 0.0
            for i in mine:
                if is_tp_layer(lg.layers[i]):
                    bf, bb = tp_comm_bytes(lg.layers[i], ev.ctx)
                    block = lg.layers[i].kind == "block"  # (the runtime checkpoints blocks only)
                    tp_bytes += bf + bb + (recompute_comm_bytes(lg.layers[i], ev.ctx, acs[i]) if block else 0.0)
            # and once per step, the sum of the gradients TP ranks compute from their share only
            collectives["all_reduce_equivalent@tp"] = ev.m * tp_bytes + tp_partial_bytes(costs, cfg)
            # the copies torch makes around collectives along the sequence (compared even where none is predicted:
            # a traced copy the cost model does not know of is an error)
            collectives["relayout@tp"] = ev.m * sum(c.relayout_bytes for c in costs)
        if cfg.pp > 1:  # each boundary: the activation forward, its gradient back, every micro-batch
            n_stages = cfg.pp * cfg.vpp
            starts = {s: stage_of.index(s) for s in range(n_stages)}
            sent = received = gathered = copied = 0.0
            for c in range(r, n_stages, cfg.pp):
                if c < n_stages - 1:  # sends its output, receives its gradient; under TP gathers its side's half
                    sent += ev.p2p_bytes(starts[c + 1])
                    received += ev.p2p_bytes(starts[c + 1])
                    gathered += sum(ev.pp_gathers(starts[c + 1])) / 2
                    copied += ev.pp_gather_copies(starts[c + 1]) / 2
                if c > 0:  # receives its input, sends the input's gradient
                    received += ev.p2p_bytes(starts[c])
                    sent += ev.p2p_bytes(starts[c])
                    gathered += sum(ev.pp_gathers(starts[c])) / 2
                    copied += ev.pp_gather_copies(starts[c]) / 2
            collectives["send@pp"], collectives["recv@pp"] = ev.m * sent, ev.m * received
            if gathered:  # an all-gather counts as half the all-reduce of its gathered size, as traced
                collectives["all_reduce_equivalent@tp"] = collectives.get("all_reduce_equivalent@tp", 0.0) + (
                    ev.m * gathered / 2)
                if copied:  # and the copies torch makes around them
                    collectives["relayout@tp"] = collectives.get("relayout@tp", 0.0) + ev.m * copied
            if ev.tied_sync_time(r):  # the embedding group: the first and the last pipeline rank
                collectives["all_reduce@" + ("pp" if cfg.pp == 2 else "2 ranks")] = ev.tied_bytes()
        for group, nbytes in step_scalars(cfg).items():  # the gradient norm's and the loss's all-reduces
            label = trace_group(cfg, group)
            key = "all_reduce_equivalent@tp" if label == "tp" else f"all_reduce@{label}"
            collectives[key] = collectives.get(key, 0.0) + nbytes
        roles.append({"pp_rank": r, "rank": r * cfg.dp * cfg.tp, "memory": memory, "collectives": collectives,
                      "flops": flops, "reduced_elements": reduced})
    return roles


def trace_group(cfg, group: str) -> str:
    """The name the trace gives a rank's ``group`` (``world``, ``pp``, or ``dp``: the gradient-reduction group, dp ×
    cp) under ``cfg``: the first of the mesh's groups with the same ranks, in `planner.check.trace._mesh_groups`'
    order. Two groups of different mesh dimensions share only the rank itself, so one of them equals the world
    exactly when its size is the world's, and the dp × cp group is the cp group when dp is 1."""
    if cfg.ep > 1:
        sizes = [("tp", cfg.tp), ("dp", cfg.dp), ("pp", cfg.pp), ("edp", cfg.dp // cfg.ep), ("ep", cfg.ep)]
    elif cfg.cp > 1:
        sizes = [("tp", cfg.tp), ("cp", cfg.cp), ("dp", cfg.dp * cfg.cp), ("dp rows", cfg.dp), ("pp", cfg.pp)]
    else:
        sizes = [("tp", cfg.tp), ("dp", cfg.dp), ("pp", cfg.pp)]
    if group == "world":
        return next((name for name, n in sizes if n == cfg.world), "world")
    if group == "dp":
        return "cp" if cfg.cp > 1 and cfg.dp == 1 else "dp"
    return group


def check_work(plan: Plan, fold: bool = True, cores: int | None = None) -> float:
    """How long `check_plan` traces, in the unit of `planner.check.fold.trace_cost` (one block's forward and
    backward for one micro-batch: its time is about proportional to this): when the last of its traces (each rank
    role, and under folding every depth) ends, all run side by side on ``cores`` cores (default: this machine's),
    as `check_plan` runs them."""
    c = plan.config
    cores = cores or tracer_cores()
    folding = fold_plan(plan, cores) if fold else None
    if folding is None:
        per_rank = [sum(1 for lay in plan.layers if lay.stage % c.pp == r) for r in range(c.pp)]
        return makespan([trace_cost(n, plan.grad_accum) for n in per_rank], cores)
    return makespan([trace_cost(folding.blocks_traced(r)[w], folding.micro_traced)
                     for r in range(c.pp) for w in traces_for(folding, r)], cores)


def _traced_collectives(trace) -> dict:
    out = {k: float(v["bytes"]) for k, v in trace.collectives.items()}
    ar = out.get("all_reduce@tp", 0.0) + (out.get("all_gather@tp", 0.0) + out.get("reduce_scatter@tp", 0.0)) / 2
    if ar:
        out["all_reduce_equivalent@tp"] = ar
    return out


def check_plan(plan: Plan, *, prepare=None, fold: bool = True, tracers: Tracers | None = None,
               script: str | None = None) -> dict:
    """Trace every role of ``plan`` and compare (see the module docstring); the JSON of `autopar check`.
    ``prepare``: a module-level function each tracing process calls first (tests inject runtime faults with it).
    ``fold``: trace deep plans folded (`planner.check.fold`); False traces every block and micro-batch.
    ``tracers``: what `start_tracers` returned (its capture of ``plan.model`` is used when it has one).
    ``script``: trace the runtime of this emitted training script (as written, or as its user edited it) instead of
    autopar's, every block and micro-batch (its model has the plan's depth)."""
    ranks = {r: r * plan.config.dp * plan.config.tp for r in range(plan.config.pp)}
    if script is not None:
        from planner.check.tracers import load_script

        # a file that is not a script: one line here, not a failed trace per rank
        whole_init = load_script(script).PLAN.get("init") != "meta"
        fold = False
    tracers = tracers or Tracers()
    folding = fold_plan(plan, tracers.cores) if fold else None
    tracers.prepare = prepare
    if script is not None and whole_init:  # a real model per trace, and under a pipeline real activations too
        tracers.width = 1  # (a 170M-parameter model: 14 GB a trace)
    for r, rank in ranks.items():
        what = f"tracing pipeline rank {r} (rank {rank})"
        if folding is None:
            tracers.submit(r, trace_job, plan, rank, script, what=what)
            continue
        kwargs = {"micro_batches": folding.micro_batches} if folding.micro_batches else {}
        for w in traces_for(folding, r):
            tracers.submit((r, w), trace_job, folding.plans[w], rank, source=folding.sources[w], what=what, **kwargs)
    try:  # while the traces run
        lg = None
        if tracers.captures(plan.model):
            lg = tracers.results("capture")["capture"]
            lg = lg if lg.model.seq == plan.seq else None
        predicted = predicted_roles(plan, lg)
        done = tracers.results()
    except BaseException:
        tracers.close()
        raise
    traces, refolded = {}, []
    for r, rank in ranks.items():
        if folding is None:
            traces[r] = done[r]
            continue
        traces[r] = extrapolate(folding, r, {w: done[(r, w)] for w in traces_for(folding, r)})
        if traces[r] is None:  # a place where a folded trace peaks could not be followed: traced whole
            refolded.append(r)
            tracers.submit(r, trace_job, plan, rank, what=f"tracing pipeline rank {r} (rank {rank}) whole")
    if refolded:
        traces |= {r: tracers.results()[r] for r in refolded}
    roles, unreduced = [], []
    worst = {"memory": 0.0, "comm": 0.0, "flops": 0.0}
    for pred in predicted:
        tr = traces[pred["pp_rank"]]
        mem_err = {k: rel_error(tr.memory[k], pred["memory"][k]) for k in MEMORY_PARTS}
        traced_comm = _traced_collectives(tr)
        # every kind predicted, and every kind traced (a collective the cost model does not know of is an error)
        kinds = set(pred["collectives"]) | (set(traced_comm) - FOLDED)
        comm_err = {k: rel_error(traced_comm.get(k, 0.0), pred["collectives"].get(k, 0.0)) for k in sorted(kinds)}
        flops_err = rel_error(tr.flops, pred["flops"])
        worst["memory"] = max(worst["memory"], mem_err.get("peak", 0.0))  # the figure that decides if a plan fits
        worst["comm"] = max([worst["comm"], *comm_err.values()])
        worst["flops"] = max(worst["flops"], flops_err)
        need = tr.grad_elements if pred["reduced_elements"] is None else min(tr.grad_elements,
                                                                             pred["reduced_elements"])
        if tr.dp_reduced_elements < need * (1 - 1e-9):
            unreduced.append(f"pipeline rank {pred['pp_rank']}: {need - tr.dp_reduced_elements:.0f} of "
                             f"{need:.0f} gradient elements never reduced over the data-parallel group")
        roles.append({
            "ranks": f"pp={pred['pp_rank']} (each of its dp×tp = {plan.config.dp * plan.config.tp} ranks)",
            "rank": pred["rank"], "stage": pred["pp_rank"],
            "predicted": {"memory": pred["memory"], "collectives": pred["collectives"], "flops": pred["flops"]},
            "traced": {"memory": tr.memory, "collectives": tr.collectives, "flops": tr.flops,
                       "grad_elements": tr.grad_elements, "dp_reduced_elements": tr.dp_reduced_elements,
                       "memory_at_peak": tr.memory_at_peak, "peak_at": tr.peak_at},
            "traced_equivalent": traced_comm,
            "errors": {"memory": mem_err, "collectives": comm_err, "flops": flops_err},
        })
    judged = worst["memory"] if script is None or not whole_init else 0.0
    ok = judged <= MEMORY_TOL and worst["comm"] <= COMM_TOL and worst["flops"] <= FLOPS_TOL and not unreduced
    how = folding.describe() if folding else "traced at full depth, every micro-batch"
    if script is not None:
        how += f", running the code of {script}"
        if whole_init:  # (`planner.check.trace.trace_rank`: its whole model is real on this machine)
            how += " (memory not judged: the script initialises the whole model before sharding it)"
    if refolded:
        how += f" (pipeline rank(s) {', '.join(map(str, refolded))} traced whole: their peak could not be followed)"
    return {"ok": ok, "memory_error_max": worst["memory"], "comm_error_max": worst["comm"],
            "flops_error_max": worst["flops"], "unreduced_params": unreduced, "roles": roles, "traced_how": how,
            "precision_traced": traced_precision(plan),
            "tolerances": {"memory": MEMORY_TOL, "comm": COMM_TOL, "flops": FLOPS_TOL}}
