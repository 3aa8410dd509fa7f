"""`autopar inspect`: reports that explain a plan (terminal, HTML, JSON)."""

from __future__ import annotations

import argparse
import sys


def cmd_inspect(args: argparse.Namespace) -> int:
    from planner.cli.common import print_json
    from planner.files import write_atomic
    from planner.plan import Plan
    from planner.report.facts import build_report

    plan = Plan.load(args.plan)  # ValueError with the reason ⇒ exit 2
    rep = build_report(plan)
    if args.html:
        from planner.report.html import render_html

        write_atomic(args.html, render_html(plan, rep))
    if args.json:
        print_json(rep | ({"html": str(args.html)} if args.html else {}))
        return 0
    from planner.report.text import print_report

    print_report(rep, file=sys.stdout)
    if args.html:
        print(f"\nwrote {args.html}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("inspect", help="explain a plan: terminal report, --html page with pictures, --json")
    p.add_argument("plan", help="plan file written by `autopar plan --out PLAN.yaml`")
    p.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report with pictures")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_inspect)
