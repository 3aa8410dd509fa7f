"""The commands that need the cost model and the planner: `estimate` (and `plan`, `inspect`)."""

from __future__ import annotations

import argparse
import sys


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset, gpt:…, llama:…, moe:…, hf:TYPE[:k=v,…] or file.py:factory")
    p.add_argument("--cluster", required=True, help="PRESET[:nodes=N] or a cluster YAML file")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: 8 per data-parallel "
                                                     "rank of the configuration, or the world size)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def load_job(args):
    """(layer graph, cluster) for the model and cluster arguments."""
    from costmodel.cluster import load_cluster
    from profiler.api import profile_model

    cluster = load_cluster(args.cluster)
    lg = profile_model(args.model, seq=args.seq_len)
    return lg, cluster


def cmd_estimate(args: argparse.Namespace) -> int:
    from costmodel.config import ParallelConfig, parse_kv
    from costmodel.estimate import estimate
    from planner.cli import _print_json
    from planner.estimate_report import print_estimate

    cfg = ParallelConfig(**parse_kv(args.config, what="--config"))
    lg, cluster = load_job(args)
    gb = args.global_batch or cfg.dp * cfg.mbs * 8
    est = estimate(lg, cluster, cfg, gb)
    if args.json:
        out = est.to_json() | {"config": cfg.to_dict(), "global_batch": gb, "seq": lg.model.seq,
                               "model": args.model, "cluster": args.cluster}
        _print_json(out)
        return 0
    print_estimate(args.model, args.cluster, cfg, gb, lg, est, file=sys.stdout)
    return 0


def register(sub) -> None:
    es = sub.add_parser("estimate", help="predict step time and memory of one configuration")
    _add_job_args(es)
    es.add_argument("--config", required=True, help="k=v,… e.g. dp=8,tp=8,pp=4,mbs=1,schedule=1f1b,ac=selective")
    es.set_defaults(func=cmd_estimate)
