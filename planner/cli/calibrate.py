"""`autopar calibrate`: fit a cluster's efficiency constants to runs the user measured (`costmodel.runs`)."""

from __future__ import annotations

import argparse


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from costmodel.cluster import dump_cluster, load_cluster
    from costmodel.runs import UNLOCK_ORDER, calibrate, load_runs
    from planner.cli.common import UsageError, print_json
    from planner.files import write_atomic

    if Path(args.out).parent and not Path(args.out).parent.exists():
        raise UsageError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")
    runs = load_runs(args.runs)
    cluster = load_cluster(args.cluster)
    res = calibrate(runs, cluster)
    header = (f"# Written by `autopar calibrate {args.runs} --cluster {args.cluster}`: {', '.join(res.fitted)} fitted "
              f"to {len(runs)} measured run{'s' if len(runs) > 1 else ''}; the rest is {args.cluster}'s.\n"
              "# Read by plan/estimate/check as --cluster FILE (or FILE:nodes=N).\n")
    write_atomic(args.out, header + dump_cluster(res.cluster))
    rows = [{"name": r.name, "model": r.model, "cluster": r.cluster, "measured_s": r.measured_step_s,
             "predicted_before_s": b, "predicted_s": a, "error": a / r.measured_step_s - 1}
            for r, b, a in zip(res.runs, res.before_s, res.after_s, strict=True)]
    if args.json:
        print_json({"cluster_file": args.out, "fitted": {k: res.values[k] for k in res.fitted},
                    "kept": [k for k in UNLOCK_ORDER if k not in res.fitted],
                    "unidentifiable": list(res.unidentifiable), "runs": rows})
        return 0
    print(f"{'run':<40} {'measured':>10} {'before':>10} {'after':>10} {'error':>8}")
    for row in rows:
        print(f"{row['name'][:40]:<40} {row['measured_s']:>9.4g}s {row['predicted_before_s']:>9.4g}s "
              f"{row['predicted_s']:>9.4g}s {row['error']:>+8.1%}")
    fitted = ", ".join(f"{k} {res.values[k]:.4g}" for k in res.fitted)
    n = len(res.fitted)
    rest = [k for k in UNLOCK_ORDER if k not in res.fitted and k not in res.unidentifiable]
    print(f"fitted {fitted} ({len(runs)} run{'s' if len(runs) > 1 else ''} identif{'ies' if n == 1 else 'y'} "
          f"{n} constant{'s' if n > 1 else ''}; more runs, differing in size and parallelism, unlock "
          f"{', '.join(rest)} in that order; the rest are {args.cluster}'s)" if rest else f"fitted {fitted}")
    if res.unidentifiable:
        print(f"no run depends on {', '.join(res.unidentifiable)}: kept at {args.cluster}'s value (runs that use "
              "them, e.g. fused attention or overlapped communication, would identify them)")
    print(f"wrote {args.out}: plan with --cluster {args.out}[:nodes=N]")
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the cluster's efficiency constants to runs you measured")
    p.add_argument("runs", help="RUNS.yaml: a list of {model, cluster, global_batch, seq_len, config, step_time_s "
                                "or tokens_per_s}")
    p.add_argument("--cluster", required=True, help="the cluster (preset or file) whose constants are fitted")
    p.add_argument("--out", required=True, help="the calibrated cluster file to write")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_calibrate)
