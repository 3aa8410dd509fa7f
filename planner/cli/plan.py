"""The commands that need the cost model and the planner: `estimate` (and `plan`, `inspect`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from costmodel.compression import COMPRESSION_POLICIES
from costmodel.memory import communicators, runtime_reserved_bytes
from costmodel.stacks import DEFAULT_STACK, STACKS
from planner.cli.common import count, fraction, positive_float, positive_int


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset, gpt:…, llama:…, moe:…, hf:TYPE[:k=v,…] or file.py:factory")
    p.add_argument("--cluster", required=True, help="PRESET[:nodes=N] or a cluster YAML file")
    p.add_argument("--global-batch", type=positive_int,
                   help="sequences per optimizer step (default: 8 per data-parallel rank of the configuration, or the "
                        "world size)")
    p.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.add_argument("--memory-fraction", type=fraction,
                   help="share of each rank's memory a plan may fill (a GPU's own; on a CPU its share of the host's; "
                        "default: the cluster file's memory_fraction, "
                        "else 0.90; the CUDA context and NCCL's buffers are counted inside it, the rest is headroom "
                        "for what the memory model leaves out)")
    p.add_argument("--stack", choices=sorted(STACKS),
                   help="the software stack whose measured efficiency the prediction uses (a preset's stack=NAME "
                        f"option; default {DEFAULT_STACK}, what autopar emits)")


def name_stack(args) -> None:
    """``--stack NAME`` as the preset's ``stack=NAME`` option, so that the plan file's cluster names it (once)."""
    if getattr(args, "stack", None) and f":stack={args.stack}" not in args.cluster:
        args.cluster = f"{args.cluster}:stack={args.stack}"


def load_job(args):
    """(layer graph, cluster) for the model and cluster arguments."""
    from dataclasses import replace

    from costmodel.cluster import load_cluster
    from costmodel.measured import layer_graph

    name_stack(args)
    cluster = load_cluster(args.cluster)
    if args.memory_fraction is not None:
        cluster = replace(cluster, memory_fraction=args.memory_fraction)
    lg = layer_graph(args.model, cluster, args.seq_len)
    return lg, cluster


def compute_note(lg, args) -> str | None:
    """Where the prediction's compute comes from, when not the roofline alone: a --profile, or this machine."""
    if args.profile:
        return f"each layer's time from {args.profile} (measured), the roofline scaling it to each configuration"
    return lg.timings.note if lg.timings is not None else None


def cmd_estimate(args: argparse.Namespace) -> int:
    from costmodel.config import ParallelConfig, parse_kv
    from costmodel.estimate import estimate
    from planner.cli.common import print_json
    from planner.report.estimate import print_estimate

    cfg = ParallelConfig(**parse_kv(args.config, what="--config"))
    lg, cluster = load_job(args)
    gb = args.global_batch or cfg.dp * cfg.mbs * 8
    measured = None
    if args.profile:
        from costmodel.measured import load_measured

        measured = load_measured(args.profile, lg, cluster)
    est = estimate(lg, cluster, cfg, gb, measured=measured, compiled=bool(args.compile))
    if args.json:
        out = est.to_json() | {"config": cfg.to_dict(), "global_batch": gb, "seq": lg.model.seq,
                               "model": args.model, "cluster": args.cluster, "compile": bool(args.compile),
                               "stack": cluster.stack, "compute": compute_note(lg, args)}
        print_json(out)
        return 0
    print_estimate(args.model, args.cluster, cfg, gb, lg, est, file=sys.stdout)
    if (note := compute_note(lg, args)) is not None:
        print(f"compute: {note}", file=sys.stdout)
    if args.compile:
        print("blocks compiled (torch.compile): memory-bound ops priced as fused kernels", file=sys.stdout)
    return 0


def compression_note(grad_compress: str, pp_compress: str) -> str:
    """What a plan's compression changes in training, in one line (empty without compression)."""
    from costmodel.compression import POWERSGD_START_ITER
    from costmodel.config import parse_grad_compress

    kind, rank = parse_grad_compress(grad_compress)
    parts = []
    if kind == "powersgd":
        parts.append(f"PowerSGD rank {rank} on the data-parallel gradients (lossy: a low-rank approximation with "
                     f"error feedback; changes convergence; starts after {POWERSGD_START_ITER} uncompressed steps)")
    elif kind in ("bf16", "fp16"):
        parts.append(f"data-parallel gradients reduced in {kind} (rounded, not approximated)")
    if pp_compress != "none":
        parts.append(f"pipeline boundaries sent in {pp_compress}")
    return "; ".join(parts)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from costmodel.config import parse_kv
    from planner.cli.common import print_json
    from planner.files import write_atomic
    from planner.search.outer import default_global_batch, make_plan, search

    if args.html and not args.sweep:
        from planner.cli.common import UsageError

        raise UsageError("--html writes a sweep's page: add --sweep KEY=v1,v2,… (or drop --html; `autopar inspect "
                         "PLAN.yaml --html` renders a plan)")
    if args.sweep:
        from planner.cli.sweep import run_sweep

        name_stack(args)  # (each value's cluster with the stack asked for)

        return run_sweep(args)
    fix = parse_kv(args.fix or "", what="--fix")
    tracers = None
    if args.check != "off":  # the tracer's start-up (import torch) runs beside the capture
        from planner.check.tracers import start_tracers

        tracers = start_tracers()
    lg, cluster = load_job(args)
    if tracers is not None:  # the check's own capture (fp32, CPU kernels) runs beside the search
        tracers.prefetch_capture(args.model, args.seq_len)
    gb = args.global_batch or default_global_batch(cluster)
    measured = None
    if args.profile:
        from costmodel.measured import load_measured

        measured = load_measured(args.profile, lg, cluster)
    result = search(lg, cluster, gb, fix=fix, top_k=args.top_k, time_limit=args.time_limit, measured=measured,
                    compress=args.compress, compiled=bool(args.compile))
    plan = make_plan(lg, cluster, gb, result, model=args.model, cluster_spec=args.cluster, compile=args.compile,
                     profile=str(Path(args.profile).resolve()) if args.profile else None)
    baseline = _baseline(args.baseline, lg, cluster, gb, plan.predicted["step_time_s"], measured=measured,
                         compiled=bool(args.compile)) if args.baseline else None
    plan, check_note = _maybe_check(plan, args.check, tracers)
    script = None
    if args.emit:  # emit first: a plan the emitter refuses leaves no file behind
        from planner.emit.script import emit

        script = emit(plan)
    if args.out:
        write_atomic(args.out, plan.dumps())
    if script is not None:
        write_atomic(args.emit, script)
    if args.json:
        d = plan.to_dict()
        print_json({"predicted": d["predicted"], "config": d["config"], "stages": d["stages"],
                     "solver": d["solver"], "alternatives": d["alternatives"], "layers": d["layers"],
                     "global_batch": gb, "seq": plan.seq, "model": args.model, "cluster": args.cluster,
                     "traced": plan.traced, "check": check_note, "compute": compute_note(lg, args)}
                   | ({"baseline": baseline} if baseline else {}))
        return 0
    p, c = plan.predicted, plan.config
    print(f"{args.model} on {args.cluster} ({cluster.world_size} GPUs), global batch {gb}: "
          f"dp={c.dp} tp={c.tp} pp={c.pp} vpp={c.vpp} schedule={c.schedule.value} mbs={c.mbs} zero={c.zero} "
          f"sp={'on' if c.sp else 'off'} grad_compress={c.grad_compress} pp_compress={c.pp_compress}"
          + (f" ep={c.ep}" if c.ep > 1 else "") + (f" cp={c.cp}" if c.cp > 1 else ""))
    acs = {}
    for lay in plan.layers:
        acs[lay.ac.value] = acs.get(lay.ac.value, 0) + 1
    peak = p['memory_per_gpu_bytes']['peak']
    reserved = runtime_reserved_bytes(c, cluster.device)
    share = (f": 1/{cluster.gpus_per_node} of the host's {cluster.device.memory_bytes / 2**30:.1f} GiB, which its "
             f"{cluster.gpus_per_node} ranks share" if cluster.device.host_memory and cluster.gpus_per_node > 1 else "")
    print(f"  step {p['step_time_s']:.4g} s, {p['tokens_per_s']:.4g} tokens/s, MFU {p['mfu']:.1%}, "
          f"peak memory {peak / 2**30:.2f} GiB per GPU of a "
          f"{cluster.memory_budget_bytes / 2**30:.1f} GiB budget ({cluster.memory_fraction:.0%} of "
          f"{cluster.memory_per_rank_bytes / 2**30:.1f} GiB{share}); AC per layer {json.dumps(acs)}")
    print(f"  memory: {(cluster.memory_per_rank_bytes - peak) / 2**30:.2f} GiB of headroom on the device"
          + (f"; the peak includes {reserved / 2**30:.2f} GiB for the CUDA context and NCCL's buffers "
             f"({len(communicators(c))} communicators{', pipeline peers' if c.pp > 1 else ''})" if reserved else ""))
    if cluster.stack:
        from costmodel.hardware import device_kind
        from costmodel.stacks import describe

        print(f"  stack: {describe(device_kind(cluster.device.name), cluster.stack)}; --stack picks another")
    if (note := compute_note(lg, args)) is not None:
        print(f"  compute: {note}")
    sv = plan.solver
    print(f"  solver: {sv['status']} gap {sv['gap']:.2g}, {sv['candidates']} candidates, {sv['pruned']} pruned, "
          f"{sv['solved']} ILPs ({sv['backend']}), {sv['time_s']:.2f} s")
    if plan.compile:
        print(f"  compiled: blocks under torch.compile ({plan.compile}), memory-bound ops priced as fused kernels; "
              "the emitted script compiles by default")
    note = compression_note(c.grad_compress, c.pp_compress)
    if note:
        print(f"  compression: {note}")
    print(f"  check: {check_note}")
    winner = c.to_dict()
    for a in plan.alternatives:
        ac = a["config"]
        differs = " ".join(f"{k}={ac[k]}" for k in ac if ac[k] != winner.get(k)) or "same configuration"
        print(f"  alternative {differs} (winner's otherwise): {a['predicted']['step_time_s']:.4g} s "
              f"(lost by {a['lost_by']} +{a['lost_by_s']:.3g} s)")
    if baseline:
        b = baseline["predicted"]
        parts = ", ".join(f"{k} {v:.3g}" for k, v in b["breakdown_s"].items() if v > 0)
        fits = "fits" if b["fits"] else f"DOES NOT FIT the {cluster.memory_budget_bytes / 2**30:.1f} GiB budget"
        print(f"  baseline {baseline['given']}: {b['step_time_s']:.4g} s ({parts}); peak "
              f"{b['memory_per_gpu_bytes']['peak'] / 2**30:.2f} GiB, {fits}{baseline['runs']}; this plan is "
              f"{baseline['speedup']:.2f}× its speed")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _baseline(text: str, lg, cluster, gb: int, plan_step_s: float, *, measured=None, compiled: bool = False) -> dict:
    """The user's current configuration, predicted on the same job (shared/DESIGN.md: ``baseline`` {config,
    predicted, speedup}); dp fills the cluster when not given."""
    from costmodel.config import ParallelConfig, parse_kv
    from costmodel.estimate import estimate
    from costmodel.runnable import problems
    from planner.cli.common import UsageError

    given = parse_kv(text, what="--baseline")
    keys = dict(given)
    if "dp" not in keys:
        rest = keys.get("tp", 1) * keys.get("pp", 1) * keys.get("cp", 1)
        if cluster.world_size % rest:
            raise UsageError(f"--baseline {text}: tp·pp = {rest} does not divide the cluster's "
                             f"{cluster.world_size} GPUs")
        keys["dp"] = cluster.world_size // rest
    try:
        cfg = ParallelConfig(**keys)
    except ValueError as exc:
        raise UsageError(f"--baseline {text}: {exc}") from None
    if cfg.world != cluster.world_size:
        raise UsageError(f"--baseline {text}: dp·tp·pp = {cfg.world} GPUs, the cluster has {cluster.world_size}")
    if gb % (cfg.dp * cfg.mbs):
        raise UsageError(f"--baseline {text}: global batch {gb} is not a multiple of dp·mbs = {cfg.dp}·{cfg.mbs}")
    est = estimate(lg, cluster, cfg, gb, measured=measured, compiled=compiled)  # (priced as the plan is)
    why = problems(cfg.runnable_facts(gb, arch=lg.model.arch, seq=lg.model.seq))
    return {"config": cfg.to_dict(), "given": text, "predicted": est.to_json(),
            "speedup": est.step_time_s / plan_step_s,
            "runs": f" (autopar's runtime would refuse it: {why[0]})" if why else ""}


#: `--check auto` traces the winner when `planner.check.conformance.check_work` (when its last trace ends, in one
#: block's forward and backward for one micro-batch, `planner.check.fold.trace_cost`: about 0.13 s each on 2 cores)
#: stays at or under this, about eight seconds of tracing beside the plan's own five (the README's job, llama3-70b
#: on 64 H100s: its dp=16 tp=2 cp=2 winner counts 32, three traces of 6, 7 and 7 blocks × 2 micro-batches side by
#: side on two cores; the ZeRO-3 winner it had before the search offered cp, 30: two of 10 and 11 blocks)
CHECK_AUTO_WORK = 64


def _maybe_check(plan, mode: str, tracers=None):
    """(plan with what `autopar check` traced, one line saying what happened) under ``--check``; ``tracers``: what
    `planner.check.conformance.start_tracers` returned, if the caller started them."""
    from planner.check.conformance import check_plan, check_work, traced_summary

    work = check_work(plan)
    how = "run `autopar check PLAN.yaml --write` to trace it and record the result in the plan"
    if mode == "off" or (mode == "auto" and work > CHECK_AUTO_WORK):
        if tracers is not None:
            tracers.close()
        why = "--check off" if mode == "off" else (f"not traced automatically (its traces count {work:.0f} block "
                                                  f"passes > {CHECK_AUTO_WORK}; --check on forces it)")
        return plan, f"{why}; {how}"
    try:
        result = check_plan(plan, tracers=tracers)
    except (RuntimeError, ValueError) as exc:
        if mode == "on":
            raise
        # the plan stands without it; the failure is worth a report (autopar check PLAN.yaml shows it whole)
        first = next((s for s in reversed(str(exc).strip().splitlines()) if s.strip()), type(exc).__name__)
        return plan, f"could not trace this plan ({first.strip()[:160]}); {how}"
    verdict = "conforms" if result["ok"] else "DIVERGES"
    note = (f"traced on a fake world of {plan.config.world}: {verdict} (worst peak memory "
            f"{result['memory_error_max']:.1%}, collectives {result['comm_error_max']:.1%}, FLOPs "
            f"{result['flops_error_max']:.1%}{'; UNREDUCED gradients' if result['unreduced_params'] else ''}); "
            "details: autopar check PLAN.yaml")
    return plan.with_(traced=traced_summary(result)), note


def register(sub) -> None:
    pl = sub.add_parser("plan", help="search the fastest parallel plan that fits")
    _add_job_args(pl)
    pl.set_defaults(func=cmd_plan)
    for action in pl._actions:
        if action.dest == "global_batch":
            action.help = "sequences per optimizer step (default: 8 per GPU, i.e. 8 × the cluster's GPUs)"
    pl.add_argument("--fix", help="pin configuration keys, k=v,… e.g. tp=8,pp=4 (any --config key)")
    pl.add_argument("--top-k", type=count, default=3, help="alternatives to keep (default 3)")
    pl.add_argument("--baseline", metavar="k=v,…",
                    help="your current configuration (e.g. tp=8,pp=4,mbs=1,ac=selective; dp fills the cluster): "
                         "predicted on the same job, with the plan's speedup over it")
    pl.add_argument("--compress", choices=list(COMPRESSION_POLICIES), default="none",
                    help="compressions the search may choose: none (default; nothing that changes the numbers), "
                         "low-precision (16-bit gradient reduction, bf16 pipeline boundaries), lossy (also "
                         "PowerSGD); a --fix grad_compress=… is used whatever this says")
    pl.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                    help="plan for blocks run under torch.compile (backend inductor by default): memory-bound ops "
                         "priced as fused kernels, no activation checkpointing with tensor parallelism (torch "
                         "2.13 cannot compile it); the emitted script then compiles by default")
    pl.add_argument("--time-limit", type=positive_float, default=60.0,
                    help="seconds for the whole search; when exceeded the best plan so far is returned with its gap")
    pl.add_argument("--out", help="write the plan as YAML to this file")
    pl.add_argument("--emit", help="also write a torchrun training script for the plan")
    pl.add_argument("--check", choices=["auto", "on", "off"], default="auto",
                    help="trace the winner's runtime on a fake world of its size and record predicted vs traced in "
                         "the plan (auto: when it is quick, see `autopar check`)")
    pl.add_argument("--profile", help="per-layer times measured by `autopar profile MODEL --device … --out FILE` on "
                                      "the cluster's device, used instead of the roofline's level")
    from planner.cli.sweep import register_sweep_arg

    register_sweep_arg(pl)

    es = sub.add_parser("estimate", help="predict step time and memory of one configuration")
    _add_job_args(es)
    es.add_argument("--config", required=True, help="k=v,… e.g. dp=8,tp=8,pp=4,mbs=1,schedule=1f1b,ac=selective")
    es.add_argument("--profile", help="per-layer times measured by `autopar profile MODEL --device … --out FILE` on "
                                      "the cluster's device, used instead of the roofline's level")
    es.add_argument("--compile", action="store_true",
                    help="price the blocks as the emitted script's --compile runs them (torch.compile: memory-bound "
                         "ops fused)")
    es.set_defaults(func=cmd_estimate)
