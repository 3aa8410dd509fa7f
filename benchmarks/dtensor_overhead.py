"""DTensor's host time per tensor-parallel op on this CPU: what a tensor-parallel block pays besides its arithmetic.

    python benchmarks/dtensor_overhead.py [--rounds 200]

One process, a gloo group of one rank, a 1-rank mesh (no collective moves a byte): a SwiGLU MLP of three linears on
tiny tensors (hidden 16, ffn 32, 2×8 tokens, so arithmetic is negligible), forward and backward, timed plain and
with autopar's tensor-parallel layout (`ColwiseParallel` gate/up, `RowwiseParallel` down, the input entering as a
replicated DTensor as `planner.emit.runtime.apply_tp` does), and an RMSNorm plain and under `SequenceParallel`
(which makes its input a sequence-sharded DTensor itself). Prints the median time of each and the extra host time
per tensor-parallel linear and per sequence-parallel norm.

The cost model does not price this yet (`costmodel.hardware.DeviceSpec.op_overhead_s` is the plain op's): on
cpu-local it is why TP plans measure 30-40 % slower than predicted (issue 15's notes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def timed(module: nn.Module, x: torch.Tensor, rounds: int) -> tuple[float, float]:
    """Median forward and backward seconds of ``module(x).sum()`` over ``rounds`` (after 10 warm-up rounds)."""
    fwd, bwd = [], []
    for i in range(rounds + 10):
        t0 = time.perf_counter()
        y = module(x).sum()  # (both layouts hand back a local tensor: use_local_output)
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        if i >= 10:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1,))
    hidden, ffn = 16, 32
    x = torch.randn(2, 8, hidden, requires_grad=True)

    plain = timed(MLP(hidden, ffn), x, args.rounds)
    tp = MLP(hidden, ffn)
    parallelize_module(tp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    tp.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], mesh, [Replicate()], run_check=False),))
    wrapped = timed(tp, x, args.rounds)

    norm = timed(nn.RMSNorm(hidden), x, args.rounds)
    sp = nn.RMSNorm(hidden)
    parallelize_module(sp, mesh, SequenceParallel(use_local_output=True))
    sp_norm = timed(sp, x, args.rounds)
    dist.destroy_process_group()

    us = 1e6
    print(f"torch {torch.__version__}, 1 thread, 1-rank gloo mesh; median of {args.rounds} rounds (µs)")
    print(f"{'':32} {'forward':>9} {'backward':>9}")
    for name, (f, b) in (("MLP, plain", plain), ("MLP, tensor-parallel", wrapped), ("RMSNorm, plain", norm),
                         ("RMSNorm, sequence-parallel", sp_norm)):
        print(f"{name:32} {f * us:9.1f} {b * us:9.1f}")
    print(f"{'per tensor-parallel linear':32} {(wrapped[0] - plain[0]) / 3 * us:9.1f} "
          f"{(wrapped[1] - plain[1]) / 3 * us:9.1f}")
    print(f"{'per sequence-parallel norm':32} {(sp_norm[0] - norm[0]) * us:9.1f} {(sp_norm[1] - norm[1]) * us:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
