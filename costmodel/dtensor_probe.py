"""DTensor's host time per tensor-parallel op on this CPU: what a tensor-parallel block pays besides its arithmetic
and its collectives' transfers (`costmodel.hardware.DeviceSpec.dtensor_overhead_s`).

    python -m costmodel.dtensor_probe [--rounds 200]     # prints the figures as JSON

Run in a process of its own (`costmodel.hardware.measure_cpu_device` starts one), since it needs a process group:
one rank, gloo, a 1-rank mesh, one thread, so no collective moves a byte. A SwiGLU MLP of three linears on tiny
tensors (hidden 16, ffn 32, 2×8 tokens: arithmetic negligible) runs forward and backward plain and with the layout
`planner.emit.runtime.apply_tp` gives it: ``ColwiseParallel`` gate/up and ``RowwiseParallel`` down, the MLP's input
entering as a replicated DTensor (``_as_replicate``), or under sequence parallelism as a sequence-sharded DTensor
redistributed to replicated (``_gather_seq``) with the row-parallel output reduce-scattered back to ``Shard(1)``.
An RMSNorm runs plain and under ``SequenceParallel``. The extra time per linear is a third of the MLP's difference
(the input conversion shared by the module's linears is spread over them); per norm, the difference. Medians over
``rounds`` after 10 warm-up rounds.

Measured here (2-vCPU VM, torch 2.13): ~210/330 µs forward/backward per linear, ~190/350 µs per norm, against
~50/100 µs for the whole plain MLP (`benchmarks/dtensor_overhead.py` prints the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(module, make_input, rounds: int) -> tuple[float, float]:
    """Median forward and backward seconds of ``module(make_input()).sum()``."""
    fwd, bwd = [], []
    for i in range(rounds + 10):
        x = make_input()
        t0 = time.perf_counter()
        y = module(x).sum()  # (every layout here hands back a local tensor: use_local_output)
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        if i >= 10:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def measure(rounds: int = 200) -> dict[str, tuple[float, float]]:
    """The probe's medians in seconds, (forward, backward): ``mlp``, ``mlp_tp``, ``mlp_sp`` (whole MLP),
    ``norm``, ``norm_sp`` (one norm), and the derived ``tp_linear``, ``sp_linear`` (per linear) and ``sp_norm``
    (per norm), each at least 0. Needs an initialised 1-rank process group."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    class MLP(nn.Module):
        def __init__(self, hidden: int, ffn: int) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, ffn, bias=False)
            self.up = nn.Linear(hidden, ffn, bias=False)
            self.down = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    mesh = init_device_mesh("cpu", (1,))
    hidden, ffn = 16, 32
    base = torch.randn(2, 8, hidden)

    def make_input():
        return base.clone().requires_grad_(True)

    out = {"mlp": _timed(MLP(hidden, ffn), make_input, rounds)}
    tp = MLP(hidden, ffn)
    parallelize_module(tp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    tp.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], mesh, [Replicate()], run_check=False),))
    out["mlp_tp"] = _timed(tp, make_input, rounds)
    sp = MLP(hidden, ffn)
    parallelize_module(sp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                  "down": RowwiseParallel(output_layouts=Shard(1))})
    sp.register_forward_pre_hook(lambda m, a: (
        DTensor.from_local(a[0], mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]),))
    out["mlp_sp"] = _timed(sp, make_input, rounds)
    out["norm"] = _timed(nn.RMSNorm(hidden), make_input, rounds)
    norm = nn.RMSNorm(hidden)
    parallelize_module(norm, mesh, SequenceParallel(use_local_output=True))
    out["norm_sp"] = _timed(norm, make_input, rounds)

    def extra(a: str, b: str, per: int) -> tuple[float, float]:
        return tuple(max(0.0, (x - y) / per) for x, y in zip(out[a], out[b]))

    out["tp_linear"] = extra("mlp_tp", "mlp", 3)
    out["sp_linear"] = extra("mlp_sp", "mlp", 3)
    out["sp_norm"] = extra("norm_sp", "norm", 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as a cpu-local rank runs
    # a store of its own: under torchrun (auto_parallelize plans in the ranks) an init_method would join the agent's
    # store named by TORCHELASTIC_USE_AGENT_STORE/MASTER_PORT and wait for a world that never comes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        figures = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(json.dumps({k: list(v) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
