"""DTensor's host time per tensor-parallel op on this CPU: what a tensor-parallel block pays besides its arithmetic.

    python benchmarks/dtensor_overhead.py [--rounds 200]

Runs `costmodel.dtensor_probe` (a 1-rank gloo mesh: a SwiGLU MLP on tiny tensors plain and with the runtime's
tensor-parallel layouts, an RMSNorm plain and under ``SequenceParallel``) and prints its table: the medians it
measured and the extra host time per tensor-parallel linear and per sequence-parallel norm. These are the figures
the ``cpu`` device carries as ``dtensor_overhead_s`` (measured once per machine, `costmodel.hardware`), which
`costmodel.layercost` charges per DTensor op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from costmodel.dtensor_probe import measure  # noqa: E402

ROWS = (("mlp", "MLP, plain"), ("mlp_tp", "MLP, tensor-parallel"), ("mlp_sp", "MLP, TP + sequence-parallel"),
        ("norm", "RMSNorm, plain"), ("norm_sp", "RMSNorm, sequence-parallel"),
        ("tp_linear", "per tensor-parallel linear"), ("sp_linear", "per linear, with SP"),
        ("sp_norm", "per sequence-parallel norm"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        figures = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"torch {torch.__version__}, 1 thread, 1-rank gloo mesh; median of {args.rounds} rounds (µs)")
    print(f"{'':32} {'forward':>9} {'backward':>9}")
    for key, name in ROWS:
        f, b = figures[key]
        print(f"{name:32} {f * 1e6:9.1f} {b * 1e6:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
