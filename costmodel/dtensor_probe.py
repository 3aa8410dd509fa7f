"""DTensor's time per tensor-parallel op on this CPU: what a tensor-parallel block pays besides its arithmetic and
its collectives' transfers (`costmodel.hardware.DeviceSpec.dtensor_overhead_s` and ``dtensor_byte_s``).

    python -m costmodel.dtensor_probe [--rounds 100]     # prints the figures as JSON

Run in a process of its own (`costmodel.hardware.measure_cpu_device` starts one), since it needs a process group:
rank 0 of a 2-rank *fake* process group (`torch.testing._internal.distributed.fake_pg`), one thread, so DTensor takes
its multi-rank path (its redistributions call the functional collectives, which a 1-rank mesh skips) while no
collective moves a byte. A SwiGLU MLP of three linears runs forward and backward plain, at a tensor-parallel rank's
local shapes (half the feed-forward width), and with the layout `planner.emit.runtime.apply_tp` gives it:
``ColwiseParallel`` gate/up and ``RowwiseParallel`` down, the MLP's input entering as a replicated DTensor
(``_as_replicate``), or under sequence parallelism as a sequence-sharded DTensor redistributed to replicated
(``_gather_seq``) with the row-parallel output reduce-scattered back to ``Shard(1)``. An RMSNorm runs plain and
under ``SequenceParallel`` on the rank's half of the sequence. The variants run in turn, round after round (this
VM's speed drifts by tens of per cent within minutes), and the figures are medians after 5 warm-up rounds.

At two sizes: tiny tensors (hidden 16, ffn 32, 2×8 tokens: arithmetic negligible) give the time per op; a
cpu-local model's (hidden 256, ffn 704, 8×128 tokens) gives how the extra time grows with the op's data, per byte
of activations its forward reads and writes on the rank (`linear_bytes`, `norm_bytes`: inputs and outputs, not
weights; `costmodel.layercost.dtensor_bytes` counts the same for a planned model's ops). It grows: interleaved with its
plain twin, a linear's extra time went from ~0.3/0.4 ms (forward/backward) at 16 tokens to ~0.5/0.65 at 256,
~0.8-1.3/1.0-1.5 at 1024 and ~1.5/1.6 at 2048 (hidden 256), while DTensor's Python work per op does not depend on the
data. Profiled, the memory-bound ops beside the DTensor ops (SiLU, the gate product, their backward) run slower inside
the tensor-parallel layer than the same ops on the same shapes in the plain one (not page faults: the same with glibc's
mmap and trim thresholds raised, and no faults counted), and each redistribution's functional collective copies its
input; the per-byte figure prices what is measured, not its mechanism. The linear's per-byte figure is measured without
sequence parallelism, whose redistributions also re-lay out the sequence (copies
`costmodel.layercost.seq_relayout_bytes` prices apart), and applied to both. The figure per op is the line's intercept:
the small size's extra time less its bytes at that slope.

Extra time per linear: a third of the MLP's difference from its plain twin (the input conversion shared by the module's
linears spread over them); per norm, the difference. Measured here (2-vCPU VM, torch 2.13, six runs): ~340-520/410-700
µs forward/backward per linear plus ~130-410/200-760 µs per MB of its activations (a cpu-local linear of 8×128 tokens
moves ~2.5 MB: 0.3-1.9 ms more each way); ~230-320/440-700 µs per norm plus ~200-310/140-460 µs per MB. The spread is
this VM's: the per-byte figure is the difference of two ~10 ms medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

#: (batch, sequence, hidden, ffn) of the two sizes: tiny (the time per op) and a cpu-local model's (per byte)
SMALL = (2, 8, 16, 32)
LARGE = (8, 128, 256, 704)
WORLD = 2  #: ranks of the fake process group (a rank of a tensor-parallel pair)
FP32 = 4


def _variants(size, mesh) -> dict:
    """{name: (module, make_input)} at ``size``: the plain MLP and norm at a rank's local shapes, and the runtime's
    tensor-parallel and sequence-parallel layouts of the same."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
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

    b, s, hidden, ffn = size
    whole = torch.randn(b, s, hidden)
    half = torch.randn(b, s // WORLD, hidden)  # a rank's slice of the sequence

    def of(base):
        return lambda: base.clone().requires_grad_(True)

    tp = MLP(hidden, ffn)
    parallelize_module(tp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    tp.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], mesh, [Replicate()], run_check=False),))
    sp = MLP(hidden, ffn)
    parallelize_module(sp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                  "down": RowwiseParallel(output_layouts=Shard(1))})
    sp.register_forward_pre_hook(lambda m, a: (
        DTensor.from_local(a[0], mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]),))
    norm_sp = nn.RMSNorm(hidden)
    parallelize_module(norm_sp, mesh, SequenceParallel(use_local_output=True))
    return {"mlp": (MLP(hidden, ffn // WORLD), of(whole)), "mlp_tp": (tp, of(whole)), "mlp_sp": (sp, of(half)),
            "norm": (nn.RMSNorm(hidden), of(half)), "norm_sp": (norm_sp, of(half))}


def _timed(variants: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """Median forward and backward seconds of ``module(make_input()).sum()`` per variant, the variants in turn each
    round (every layout hands back a local tensor: use_local_output)."""
    times = {name: ([], []) for name in variants}
    for i in range(rounds + 5):
        for name, (module, make_input) in variants.items():
            x = make_input()
            t0 = time.perf_counter()
            y = module(x).sum()
            t1 = time.perf_counter()
            y.backward()
            t2 = time.perf_counter()
            module.zero_grad(set_to_none=True)
            if i >= 5:
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


def linear_bytes(size) -> float:
    """Activation bytes one of the MLP's linears reads and writes forward on a rank: its input and output (gate/up:
    hidden in, ffn/2 out; down: the reverse), fp32."""
    b, s, hidden, ffn = size
    return FP32 * b * s * (hidden + ffn / WORLD)


def norm_bytes(size) -> float:
    """Bytes the norm's first op reads and writes forward on a rank (the square of its input: the rank's slice of
    the sequence in, the same out), fp32: what `costmodel.layercost` charges a sequence-parallel norm's time on."""
    b, s, hidden, _ = size
    return FP32 * 2 * b * (s // WORLD) * hidden


def measure(rounds: int = 100) -> dict[str, tuple[float, float]]:
    """The probe's figures in seconds, (forward, backward), from rank 0 of an initialised 2-rank process group:
    ``{op}_byte`` for ``tp_linear``, ``sp_linear``, ``sp_norm`` (extra time per byte of activations the op's forward
    reads and writes, `linear_bytes`, `norm_bytes`: the slope between the two sizes) and ``{op}`` (extra time per
    op: the small size's less its bytes at that slope), each ≥ 0; and the medians behind them,
    ``{variant}@small`` / ``{variant}@large``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    out: dict[str, tuple[float, float]] = {}
    extra = {}
    for tag, size, n in (("small", SMALL, rounds), ("large", LARGE, max(5, rounds // 2))):
        med = _timed(_variants(size, mesh), n)
        out.update({f"{name}@{tag}": t for name, t in med.items()})
        extra[tag] = {
            "tp_linear": tuple((t - p) / 3 for t, p in zip(med["mlp_tp"], med["mlp"])),
            "sp_linear": tuple((t - p) / 3 for t, p in zip(med["mlp_sp"], med["mlp"])),
            "sp_norm": tuple(t - p for t, p in zip(med["norm_sp"], med["norm"])),
        }
    # per op and per byte: the line through the two sizes (the linear's slope from tensor parallelism alone, for both)
    for op, slope_of, nbytes in (("tp_linear", "tp_linear", linear_bytes), ("sp_linear", "tp_linear", linear_bytes),
                                 ("sp_norm", "sp_norm", norm_bytes)):
        span = nbytes(LARGE) - nbytes(SMALL)
        slope = tuple(max(0.0, (big - small) / span) for big, small in zip(extra["large"][slope_of],
                                                                             extra["small"][slope_of]))
        out[f"{op}_byte"] = slope
        out[op] = tuple(max(0.0, t - k * nbytes(SMALL)) for t, k in zip(extra["small"][op], slope))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)  # as a cpu-local rank runs
    # a store of its own: under torchrun (auto_parallelize plans in the ranks) an init_method would join the agent's
    # store named by TORCHELASTIC_USE_AGENT_STORE/MASTER_PORT and wait for a world that never comes
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        figures = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(json.dumps({k: list(v) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
