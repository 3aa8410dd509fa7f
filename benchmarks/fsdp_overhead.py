"""FSDP2's work beside its collectives on this CPU, measured on the validate model and priced by the cost model.

    python benchmarks/fsdp_overhead.py [--rounds 20]

Rank 0 of a 2-rank fake process group (torch's ``fake`` backend: the collectives move nothing), one thread: the
model of `benchmarks/validate_cpu.py` (4 Llama blocks, hidden 256, 3.5 M fp32 parameters) at micro-batch 4 runs a
forward and backward plain, and with ``fully_shard`` on each block and the root as `planner.emit.runtime` shards
(ZeRO-3: resharded after forward; ZeRO-2: not), the three in turn for ``rounds`` rounds after 5 warm-up ones. What
FSDP2 adds over the plain model (its copies, hooks and bookkeeping) is printed beside what
`costmodel.overlap.fsdp_serial_time` prices for the same step on the ``cpu`` device as cached (2 gathers and 1
reduction per group under ZeRO-3, 1 and 1 under ZeRO-2): the per-group, per-tensor and per-byte figures
`costmodel.fsdp_probe` measured on tiny and wide linears, applied to a model they were not measured on.

Measured here (2-vCPU VM, torch 2.13, another job on the second core): ZeRO-3 +15.3, +19.7 and +22.2 ms over a
~150 ms plain step, priced 12.3 ms; ZeRO-2 +13.3, +19.0 and +17.7 ms, priced 8.4 ms (5 groups: 4 blocks and the
root with the embedding and head). (Priced with the memory bandwidth for the copies and no host time, as before
the probe: 2.8 and 1.9 ms.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from validate_cpu import MODEL  # noqa: E402  (the validate model; this script's directory is on sys.path)

MBS = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from costmodel.cluster import load_cluster
    from costmodel.config import AC, ParallelConfig
    from costmodel.estimate import Evaluator
    from costmodel.overlap import fsdp_serial, fsdp_serial_time
    from planner.search.outer import profile_for
    from profiler.zoo.registry import resolve_model

    cluster = load_cluster("cpu-local")  # (measures the cpu device first if it is not cached: before the timing)
    lg = profile_for(MODEL, cluster)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        models = {}
        for name, reshard in (("plain", None), ("zero3", True), ("zero2", False)):
            torch.manual_seed(0)
            model, (x, y) = resolve_model(MODEL).build(batch=MBS, device="cpu")
            if reshard is not None:
                for block in [m for m in model.modules() if type(m).__name__.endswith("Block")]:
                    fully_shard(block, reshard_after_forward=reshard)
                fully_shard(model, reshard_after_forward=reshard)
            models[name] = model
        times = {name: [] for name in models}
        for i in range(args.rounds + 5):
            for name, model in models.items():
                t0 = time.perf_counter()
                out = model(x)
                logits = out if torch.is_tensor(out) else out[0]
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
                if i >= 5:
                    times[name].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()
    step = {name: statistics.median(t) for name, t in times.items()}
    print(f"plain forward + backward: {step['plain'] * 1e3:.1f} ms (median of {args.rounds})")
    print(f"{'FSDP2':8} {'measured +ms':>12} {'priced ms':>10} {'gather':>8} {'reduce':>8}")
    for zero in (3, 2):
        ev = Evaluator(lg, cluster, ParallelConfig(dp=2, zero=zero, mbs=MBS), 2 * MBS)  # one micro-batch a step
        costs = [ev.cost(i, AC.NONE) for i in range(len(lg.layers))]
        gather, reduce = (fsdp_serial_time(costs, ev, e) for e in ("gather", "reduce"))
        priced = fsdp_serial(costs, ev, "micro_batch") + fsdp_serial(costs, ev, "step")
        print(f"{f'ZeRO-{zero}':8} {(step[f'zero{zero}'] - step['plain']) * 1e3:12.2f} "
              f"{priced * 1e3:10.2f} {gather * 1e3:8.2f} {reduce * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
