"""What-if over inter-node bandwidth: gpt3-175b on 1024 A100 (dgx-a100-80g:nodes=128), global batch 1536.

Prints the best plan per bandwidth, where it changes, and whether each value's winner is optimal for its value
(`planner.search.sweep.check_optimal`: every other value's winner, fixed, is re-planned there and must not beat it).

    python benchmarks/sweep_175b.py [--html sweep.html]
"""

from __future__ import annotations

import argparse
import time

from planner.search.sweep import check_optimal, sweep

MODEL, CLUSTER, GB = "gpt3-175b", "dgx-a100-80g:nodes=128", 1536
VALUES = [1.5, 3, 6, 12, 24, 48, 96]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--html", help="also write the plot")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = sweep(MODEL, CLUSTER, "inter_bw_GBps", VALUES, global_batch=GB, time_limit=60)
    t1 = time.perf_counter()
    res.render()
    print(f"sweep: {len(VALUES)} values in {t1 - t0:.1f} s")
    bad = check_optimal(res, CLUSTER, time_limit=60)
    print(f"optimality check: {len(bad)} violations in {time.perf_counter() - t1:.1f} s" + (f": {bad}" if bad else ""))
    if args.html:
        from planner.files import write_atomic
        from planner.report.sweep import render_sweep_html

        write_atomic(args.html, render_sweep_html(res.to_dict()))
        print(f"wrote {args.html}")


if __name__ == "__main__":
    main()
