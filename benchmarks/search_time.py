"""Search wall time of `autopar plan` on the issue's three jobs (capture time printed separately), the README's job
end to end as a user runs it (the `autopar` command, its check of the winner included), then the Korthikanti et al.
2022 Table 3 comparison (searched plan vs the published configuration, both predicted).

    python benchmarks/search_time.py [--time-limit S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from costmodel.cluster import load_cluster
from costmodel.estimate import estimate
from planner.search.outer import search
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

    readme = ["autopar", "plan", "llama3-70b", "--cluster", "dgx-h100:nodes=8", "--global-batch", "512"]
    for _ in range(3):
        t0 = time.perf_counter()
        out = subprocess.run(readme, capture_output=True, text=True, check=True).stdout
        solver = next(line.strip() for line in out.splitlines() if line.strip().startswith("solver:"))
        print(f"{' '.join(readme)}: {time.perf_counter() - t0:.1f} s wall, check included ({solver})", flush=True)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_table3 import TABLE3, published

    for row in TABLE3:
        spec, cluster, gb, cfg = published(row)
        lg, cl = profile_model(spec), load_cluster(cluster)
        pub = estimate(lg, cl, cfg, gb)
        t0 = time.perf_counter()
        r = search(lg, cl, gb, time_limit=args.time_limit, progress=False)
        c = r.best.config
        print(f"Table 3 {row[0]} on {cl.world_size} GPUs (gb {gb}): published tp=8 pp={cfg.pp} vpp={cfg.vpp} "
              f"mbs={cfg.mbs} selective+sp {pub.tokens_per_s:,.0f} tok/s (MFU {pub.mfu:.1%}); searched "
              f"dp={c.dp} tp={c.tp} pp={c.pp} vpp={c.vpp} {c.schedule.value} mbs={c.mbs} zero={c.zero} "
              f"ac={c.ac.value} {r.best.estimate.tokens_per_s:,.0f} tok/s (MFU {r.best.estimate.mfu:.1%}), "
              f"×{r.best.estimate.tokens_per_s / pub.tokens_per_s:.3f}, search {time.perf_counter() - t0:.1f} s "
              f"{r.status} gap {r.gap:.2g}", flush=True)


if __name__ == "__main__":
    main()
