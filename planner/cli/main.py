"""The ``autopar`` command line: a thin layer over the library functions.

Exit codes (shared/DESIGN.md): 0 success; 2 the input cannot be served (one line on stderr: what, where, how to
fix; no traceback; no half-written output file); 1 only for bugs.
"""

from __future__ import annotations

import argparse
import json
import sys

from planner.cli.common import UsageError, positive_int, print_json
from planner.files import write_atomic


# ---------------------------------------------------------------------------------------------------- profile
def cmd_profile(args: argparse.Namespace) -> int:
    from planner.report.profile import layer_rows, profile_to_dict
    from planner.report.textui import render_table
    from profiler.api import profile_model

    lg = profile_model(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, kernels=args.kernels)
    prof = None
    if args.device:
        import torch

        from profiler.api import parse_dtype
        from profiler.measure import measure
        from profiler.zoo.registry import resolve_model

        source = resolve_model(args.model)
        model, inputs = source.build(batch=args.batch, seq=args.seq, device="cpu")
        model = model.to(parse_dtype(args.dtype)) if args.dtype != "fp32" else model
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible here; use --device cpu")
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        prof = measure(model, inputs, lg, device=args.device)
    result = profile_to_dict(lg, prof)
    if args.out:
        write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    if args.json:
        print_json(result)
        return 0
    headers, rows = layer_rows(lg, prof)
    g = lg.model
    from planner.report.textui import human_count

    title = (f"{g.name}: {human_count(g.num_params)} parameters, captured by {g.method} at batch {g.batch}, "
             f"seq {g.seq}, {g.dtype}; {len(lg.layers)} layers, {len(lg.signatures)} distinct")
    render_table(title, headers, rows, right=[False] + [True] * (len(headers) - 1))
    if args.out:
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------------- models, clusters
def cmd_models(args: argparse.Namespace) -> int:
    from planner.report.textui import render_table
    from profiler.zoo.registry import list_models

    rows = list_models()
    render_table("model presets", ["name", "description"], rows, right=[False, False])
    print("\nforms: gpt:layers=…,hidden=…,heads=…,seq=…,vocab=…[,ffn=…]   "
          "llama:layers=…,hidden=…,heads=…,kv_heads=…,ffn=…,vocab=…,seq=…   "
          "moe:…,experts=…,top_k=…   hf:MODEL_TYPE[:key=value,…]   path/to/file.py:factory")
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from costmodel.cluster import list_clusters
    from planner.report.textui import render_table

    render_table("cluster presets", ["name", "description"], list_clusters(), right=[False, False])
    print("\nforms: PRESET[:nodes=N]   path/to/cluster.yaml")
    return 0


# ------------------------------------------------------------------------------------------------------ main
class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (what, and where to read the usage), exit 2, as every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar", description="Auto-parallelism planner for PyTorch training.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (before the command)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pr = sub.add_parser("profile", help="capture a model and print its per-layer costs")
    pr.add_argument("model", help="preset, gpt:…, llama:…, moe:…, hf:TYPE[:k=v,…] or file.py:factory")
    pr.add_argument("--device", choices=["cpu", "cuda"], help="also measure per-layer times on this device")
    pr.add_argument("--batch", type=positive_int, default=1, help="micro-batch to capture (default 1)")
    pr.add_argument("--threads", type=positive_int, default=1,
                    help="CPU threads when measuring on cpu (default 1, as each cpu-local rank runs)")
    pr.add_argument("--seq", type=positive_int, help="sequence length (default: the model's)")
    pr.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype")
    pr.add_argument("--kernels", default="gpu", choices=["gpu", "native"],
                    help="model attention/dropout as GPU kernels (flash, fused dropout) or this machine's")
    pr.add_argument("--out", help="write the profile as JSON to this file")
    pr.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    pr.set_defaults(func=cmd_profile)

    sub.add_parser("models", help="list model presets and forms").set_defaults(func=cmd_models)
    sub.add_parser("clusters", help="list cluster presets").set_defaults(func=cmd_clusters)

    # the commands that need the cost model and planner register themselves (imported lazily where they run)
    from planner.cli import calibrate, check, inspect, plan, validate

    for module in (plan, inspect, validate, check, calibrate):
        module.register(sub)
    return p


def entry() -> int:
    """The ``autopar`` command (the console script): `main`, then every object left is moved out of the cyclic
    collector's reach (``gc.freeze``) before the interpreter exits: the collections its teardown ran over what a
    command that imported torch and captured a model leaves took about a second (the README's plan: 11 s → 10 s
    on 2 cores), and nothing after the command needs them."""
    import gc

    code = main()
    gc.freeze()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # user input; anything else is a bug (exit 1, traceback)
        if args.debug:
            raise
        msg = str(exc)
        first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
        print(f"autopar {args.command}: error: {first}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `autopar … --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
