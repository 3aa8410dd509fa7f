"""`autopar check`: trace the runtime of a plan on a fake world of its size and compare with the cost model."""

from __future__ import annotations

import argparse


def cmd_check(args: argparse.Namespace) -> int:
    from planner.check.conformance import check_plan, traced_summary
    from planner.cli.common import print_json
    from planner.files import write_atomic
    from planner.plan import Plan
    from planner.report.check import print_check, render_check_html

    plan = Plan.load(args.plan)  # ValueError with the reason ⇒ exit 2
    result = check_plan(plan, fold=not args.full, script=args.script)
    if args.html:
        write_atomic(args.html, render_check_html(result, f"autopar check {args.plan}"))
    if args.write:  # the plan file keeps what was traced beside what was predicted (`autopar inspect` shows both)
        write_atomic(args.plan, plan.with_(traced=traced_summary(result)).dumps())
    if args.json:
        print_json(result | ({"html": str(args.html)} if args.html else {}))
        return 0
    print_check(result)
    if args.html:
        print(f"wrote {args.html}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("check", help="run the plan's runtime on a fake world of its size and compare, term by term, "
                                     "with what the cost model predicted (memory, collectives, FLOPs)")
    p.add_argument("plan", help="plan file written by `autopar plan --out PLAN.yaml`")
    p.add_argument("--html", metavar="REPORT.html", help="also write the comparison as a self-contained HTML page")
    p.add_argument("--write", action="store_true",
                   help="record the traced figures in the plan file, beside the predicted ones (inspect shows both)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.add_argument("--full", action="store_true",
                   help="trace every block and micro-batch (default: a deep plan is traced at two shallow depths and "
                        "three micro-batches and extrapolated, exactly where its blocks are alike)")
    p.add_argument("--script", metavar="TRAIN.py",
                   help="trace this training script's own code (written by `autopar plan --emit`, edited or not) "
                        "instead of autopar's runtime; every block and micro-batch")
    p.set_defaults(func=cmd_check)
