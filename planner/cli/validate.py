"""`autopar validate`: run plans, compare measured with predicted part by part, recalibrate the cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planner.cli.common import count, positive_int


def cmd_validate(args: argparse.Namespace) -> int:
    from costmodel.cluster import load_cluster
    from costmodel.hardware import cpu_cache_file, cpu_peak_now, is_measured_cpu
    from planner.cli.common import UsageError, print_json
    from planner.files import write_atomic
    from planner.plan import Plan
    from planner.search.outer import profile_for
    from planner.validate.loop import compare, plan_profile, render, repredict, run_plans, summary

    if args.steps < 1 or args.warmup < 0:
        raise UsageError(f"--steps {args.steps} must be ≥ 1 and --warmup {args.warmup} ≥ 0")
    plans = {}
    for path in args.plans:
        name = Path(path).stem
        while name in plans:
            name += "_"
        plans[name] = Plan.load(path)
    clusters = {p.cluster for p in plans.values()}
    if args.recalibrate and len(clusters) > 1 and not args.cluster:
        raise UsageError(f"--recalibrate: the plans were made for different clusters ({', '.join(sorted(clusters))});"
                         " pass --cluster to say which one to recalibrate")
    for flag, path in (("--recalibrate", args.recalibrate), ("--runs-out", args.runs_out)):
        if path and Path(path).parent and not Path(path).parent.exists():
            raise UsageError(f"{flag} {path}: folder {Path(path).parent} does not exist")
    # a plan priced on this machine's CPU as measured once and cached: its speed now beside the cached figure, before
    # and after the plans run (an error of the size of the drift is the machine's, not the cost model's)
    cpu = next((d for d in map(_device_of, sorted(clusters)) if d is not None and is_measured_cpu(d)), None)
    speed = {"cached_flops": cpu.peak("fp32"), "before_flops": cpu_peak_now()} if cpu else None
    if args.recalibrate or args.runs_out:  # each plan's layer graph, captured once for both
        base = load_cluster(args.cluster or next(iter(clusters)))
        lgs = [profile_for(p.model, base, seq=p.seq) for p in plans.values()]
        for p, lg in zip(plans.values(), lgs, strict=True):  # (a profile gone is said before the plans run)
            plan_profile(p, lg, base)
    measured = run_plans(plans, steps=args.steps, warmup=args.warmup, nproc=args.nproc, rounds=args.rounds)
    if speed:
        speed["after_flops"] = cpu_peak_now()
    comps = [compare(n, plans[n], measured[n]) for n in plans]
    result = {"plans": {n: c.to_dict() | {"measured": measured[n].to_dict()} for n, c in zip(plans, comps)},
              "summary": summary(comps)}
    if speed:
        result["machine_speed"] = speed
    if args.runs_out:  # the measurements as runs for `autopar calibrate`
        import yaml

        from planner.validate.loop import as_runs

        runs, left_out = as_runs(plans, measured, lgs)
        write_atomic(args.runs_out, yaml.safe_dump(runs, sort_keys=False))
        result["runs_out"] = {"file": args.runs_out, "runs": len(runs), "left_out": left_out}
    after = None
    if args.recalibrate:
        from planner.validate.fit import fit

        res = fit(base, list(plans.values()), [measured[n] for n in plans], lgs)
        write_atomic(args.recalibrate, res.yaml(list(plans)))
        after = [compare(n, p, measured[n], repredict(p, res.cluster, lg))
                 for (n, p), lg in zip(plans.items(), lgs)]
        result["recalibrated"] = {"cluster_file": args.recalibrate, "scales": res.scales.to_dict(),
                                  "cost_before": res.cost_before, "cost_after": res.cost_after,
                                  "plans": {c.name: c.to_dict() for c in after}, "summary": summary(after)}
    if args.json:
        print_json(result)
        return 0
    if speed:
        c, b, a = (speed[k] / 1e9 for k in ("cached_flops", "before_flops", "after_flops"))
        print(f"this machine's cpu (one thread, linear forward + backward): {c:.1f} GFLOP/s as measured and cached, "
              f"{b:.1f} before the plans ran ({b / c - 1:+.0%}), {a:.1f} after ({a / c - 1:+.0%}); delete "
              f"{cpu_cache_file()} to measure it again\n")
    render(comps, title="predicted (as planned) vs measured")
    if after is not None:
        print()
        render(after, title=f"predicted with the recalibrated cluster ({args.recalibrate}) vs measured")
        print(f"wrote {args.recalibrate}: use it with `autopar plan … --cluster {args.recalibrate}`", file=sys.stdout)
    if args.runs_out:
        out = result["runs_out"]
        print(f"wrote {args.runs_out}: {out['runs']} measured runs for `autopar calibrate {args.runs_out} --cluster "
              f"…`" + (f" (left out, per-layer choices or priced from a profile: {', '.join(out['left_out'])})"
                       if out["left_out"] else ""))
    return 0


def _device_of(cluster: str):
    """The device of a plan's cluster, or None when its file can no longer be read (validate runs the plan anyway)."""
    from costmodel.cluster import load_cluster

    try:
        return load_cluster(cluster).device
    except (OSError, ValueError):
        return None


def register(sub) -> None:
    v = sub.add_parser("validate", help="run plans for a few steps and compare measured with predicted")
    v.add_argument("plans", nargs="+", metavar="PLAN.yaml", help="plan files written by `autopar plan --out`")
    v.add_argument("--steps", type=positive_int, default=5, help="timed steps after warm-up (default 5)")
    v.add_argument("--warmup", type=count, default=2, help="untimed warm-up steps (default 2)")
    v.add_argument("--rounds", type=positive_int, default=1,
                   help="measure every plan this many times, the plans in turn each round, and pool the rounds: a "
                        "drift in the machine's speed then falls on every plan (default 1)")
    v.add_argument("--nproc", type=positive_int, help="processes per launch (default: each plan's world size)")
    v.add_argument("--recalibrate", metavar="OUT.yaml",
                   help="fit the cluster's device efficiency and link latency/bandwidth to the measurements and "
                        "write a cluster file for --cluster")
    v.add_argument("--cluster", help="the cluster to recalibrate (default: the plans' cluster)")
    v.add_argument("--runs-out", metavar="RUNS.yaml",
                   help="also write the measured step times as runs for `autopar calibrate` (plans with one "
                        "recomputation choice and even stages)")
    v.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    v.set_defaults(func=cmd_validate)
