"""DTensor's time per tensor-parallel op on this CPU: what a tensor-parallel block pays besides its arithmetic.

    python benchmarks/dtensor_overhead.py [--rounds 100]

Runs `costmodel.dtensor_probe` (rank 0 of a 2-rank fake process group: a SwiGLU MLP plain, at a rank's local
shapes, and with the runtime's tensor-parallel layouts; an RMSNorm plain and under ``SequenceParallel``; at a tiny
size and at a cpu-local model's) and prints its table: the medians it measured, the extra time per tensor-parallel
linear and per sequence-parallel norm, and how it grows per byte of the op's data. These are the figures the ``cpu``
device carries as ``dtensor_overhead_s`` and ``dtensor_byte_s`` (measured once per machine, `costmodel.hardware`),
which `costmodel.layercost` charges per DTensor op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from costmodel.dtensor_probe import LARGE, SMALL, WORLD, measure  # noqa: E402

ROWS = (("mlp", "MLP, plain (a rank's shapes)"), ("mlp_tp", "MLP, tensor-parallel"),
        ("mlp_sp", "MLP, TP + sequence-parallel"), ("norm", "RMSNorm, plain (half the sequence)"),
        ("norm_sp", "RMSNorm, sequence-parallel"))
DERIVED = (("tp_linear", "per tensor-parallel linear"), ("sp_linear", "per linear, with SP"),
           ("sp_norm", "per sequence-parallel norm"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        figures = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"torch {torch.__version__}, 1 thread, rank 0 of a {WORLD}-rank fake process group; medians (µs)")
    for tag, size in (("small", SMALL), ("large", LARGE)):
        print(f"\n{tag}: batch {size[0]} × seq {size[1]}, hidden {size[2]}, ffn {size[3]}")
        print(f"{'':36} {'forward':>9} {'backward':>9}")
        for key, name in ROWS:
            f, b = figures[f"{key}@{tag}"]
            print(f"{name:36} {f * 1e6:9.1f} {b * 1e6:9.1f}")
    print(f"\n{'extra time':36} {'forward':>9} {'backward':>9}")
    for key, name in DERIVED:
        f, b = figures[key]
        print(f"{name:36} {f * 1e6:9.1f} {b * 1e6:9.1f}")
        f, b = figures[f"{key}_byte"]
        print(f"{'  and per MB of its data':36} {f * 1e12:9.1f} {b * 1e12:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
