"""`autopar plan … --sweep KEY=v1,v2,…`: parse the sweep, run it (`planner.search.sweep`), print or write it."""

from __future__ import annotations

import argparse
import json

from planner.cli.common import UsageError, print_json
from planner.files import write_atomic
from planner.search.sweep import SWEEP_KEYS, sweep


def parse_sweep(text: str) -> tuple[str, list]:
    """``KEY=v1,v2,…`` → (key, values); ints for nodes/global_batch/seq_len, floats for bandwidth."""
    key, eq, rest = text.partition("=")
    key = key.strip()
    if not eq or key not in SWEEP_KEYS:
        raise ValueError(f"--sweep {text!r}: write KEY=v1,v2,… with KEY one of {', '.join(SWEEP_KEYS)}")
    values = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        try:
            v = float(item) if key == "inter_bw_GBps" else int(item)
        except ValueError:
            raise ValueError(f"--sweep {key}: {item!r} is not a {'number' if key == 'inter_bw_GBps' else 'integer'}"
                             ) from None
        if v <= 0:
            raise ValueError(f"--sweep {key}: values must be > 0, got {item}")
        values.append(v)
    if not values:
        raise ValueError(f"--sweep {key}=…: give at least one value (e.g. {key}=1,2,4)")
    return key, values


def register_sweep_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--sweep KEY=v1,v2,…`` to the `plan` sub-command's parser."""
    parser.add_argument("--sweep", metavar="KEY=v1,v2,…",
                        help=f"plan once per value of one parameter ({', '.join(SWEEP_KEYS)}) and show where the "
                             "best plan changes")
    parser.add_argument("--html", help="with --sweep: write the sweep as a self-contained HTML page with a plot")


def run_sweep(args: argparse.Namespace) -> int:
    """Run the sweep ``args.sweep`` with the plan command's other arguments; print a table or JSON."""
    from costmodel.config import parse_kv

    key, values = parse_sweep(args.sweep)
    # (what a sweep does not do is refused, not dropped: each value is a search of its own, on the roofline or this
    # machine's measured layers, and writes a table, not a plan)
    for flag, attr in (("--profile", "profile"), ("--compile", "compile"), ("--baseline", "baseline"),
                       ("--emit", "emit")):
        if getattr(args, attr, None):
            raise UsageError(f"{flag} is not supported with --sweep yet: run `autopar plan` once per value with "
                             f"{flag}")
    if getattr(args, "check", None) == "on":
        raise UsageError("--check on is not supported with --sweep yet: check each plan with `autopar plan` or "
                         "`autopar check PLAN.yaml`")
    fix_text = getattr(args, "fix", None)
    fix = parse_kv(fix_text, what="--fix") if isinstance(fix_text, str) else dict(fix_text or {})
    res = sweep(args.model, args.cluster, key, values, global_batch=getattr(args, "global_batch", None),
                seq_len=getattr(args, "seq_len", None), fix=fix, time_limit=getattr(args, "time_limit", None) or 30.0,
                compress=getattr(args, "compress", None) or "none",
                memory_fraction=getattr(args, "memory_fraction", None))
    out = getattr(args, "out", None)
    if out:
        write_atomic(out, json.dumps(res.to_dict(), indent=2) + "\n")
    html = getattr(args, "html", None)
    if html:
        from planner.report.sweep import render_sweep_html

        write_atomic(html, render_sweep_html(res.to_dict()))
    if getattr(args, "json", False):
        print_json(res.to_dict())
    else:
        res.render()
    return 0
