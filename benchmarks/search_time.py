"""Search wall time of `autopar plan` on the issue's three jobs (capture time printed separately).

    python benchmarks/search_time.py [--time-limit S]
"""

from __future__ import annotations

import argparse
import time

from costmodel.cluster import load_cluster
from planner.search import search
from profiler.api import profile_model

JOBS = (("gpt3-175b", "dgx-a100-80g:nodes=128", 1536),
        ("gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200", "dgx-a100-80g:nodes=384", 3072),
        ("llama3-70b", "dgx-h100:nodes=8", 512))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    for model, cluster, gb in JOBS:
        t0 = time.perf_counter()
        lg = profile_model(model)
        t1 = time.perf_counter()
        r = search(lg, load_cluster(cluster), gb, time_limit=args.time_limit, progress=False)
        t2 = time.perf_counter()
        c = r.best.config
        print(f"{model} on {cluster} (gb {gb}): capture {t1 - t0:.1f} s, search {t2 - t1:.1f} s; "
              f"{r.candidates} candidates, {r.pruned} pruned, {r.solved} ILPs, status {r.status}, gap {r.gap:.3g}; "
              f"dp={c.dp} tp={c.tp} pp={c.pp} vpp={c.vpp} {c.schedule.value} mbs={c.mbs} zero={c.zero} "
              f"grad={c.grad_compress}: step {r.best.objective:.3f} s, MFU {r.best.estimate.mfu:.1%}", flush=True)


if __name__ == "__main__":
    main()
