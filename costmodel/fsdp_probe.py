"""FSDP2's host time and copy rate on this CPU: what a ``fully_shard`` group pays per all-gather and per
reduce-scatter besides the collective's transfer (`costmodel.hardware.DeviceSpec.fsdp_overhead_s`, ``fsdp_copy_bw``).

    python -m costmodel.fsdp_probe [--rounds 100]     # prints the figures as JSON

Run in a process of its own (`costmodel.hardware.measure_cpu_device` starts one): rank 0 of a 2-rank *fake* process
group (torch's ``fake`` backend: every collective returns at once and moves nothing), one thread, so FSDP2 takes
its multi-rank path (a 1-rank group skips the all-gather and its copy-in: torch 2.13 ``FSDPParamGroup.unshard``)
and what is timed is its Python and dispatch work and its copies alone. A model of ``GROUPS`` blocks, each a chain
of ``k`` linears of one width on 4 tokens, runs forward and backward plain and with ``fully_shard`` on each block
and the root, as `planner.emit.runtime` shards (ZeRO-3: resharded after forward; ZeRO-2: not), at each of
``SHAPES``, all stepped in turn.

Per step a ZeRO-3 group gathers twice (before forward and backward) and reduces once, a ZeRO-2 group gathers once
and reduces once (it reshards after backward), each gather followed by its reshard. So per group, from the excess
over the plain model of a step: ``gather = zero3 - zero2`` and ``reduce = 2 * zero2 - zero3``. The root holds no
parameter of its own here, so it is no group (``fully_shard`` makes none) and gathers nothing; its hooks, once a
step, fall in ``reduce``, spread over the blocks (the runtime's root holds the embedding and head: a group). On the
16-wide linears (copies and arithmetic negligible) the growth from k = 1 to k = 8 over 7 is the time per parameter
tensor, the rest the time per group; the 384-wide blocks' excess beyond the 16-wide ones' (the same groups and
tensors) is their copies', whose rate is the bytes `costmodel.overlap.fsdp_serial_time` counts for them
(``STEP_BYTES``) over that time. Each difference is taken from each round's times (the models stepped a few ms
apart, so the machine's drift cancels within a round), then its median over ``rounds`` after 10 warm-up rounds; the
time per tensor at least 0, then the time per group (the one-linear group's less one tensor's), at least 0. A
round's figure combines several single timings, so one preemption spoils it; the median drops those rounds, but a
longer model is preempted more often, so a busy machine still leans the larger differences up.
Medians of each model's times first, then the figures, gave a per-tensor figure of 205 µs and a per-group one of 0
for a reduction once, with another process reading files beside the probe; from the same samples, six runs beside a
calibration on the other core gave 12-18 µs per tensor for a gather this way and 15-43 µs that way, 30-39 µs and
11-39 µs for a reduction.

Measured here (2-vCPU VM, torch 2.13, a calibration running on the other core): 215-225 µs per group and
13-15 µs per tensor for a gather, 285-305 µs per group and 20-24 µs per tensor for a reduce-scatter, copies at
7.5-9.6 GB/s against ~33 GB/s for a copy between kept buffers; ~20 s. (Each model timed alone rather than in turn,
the per-tensor figures moved between 0 and 115 µs from one run to the next.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

#: the model's blocks, each its own group (the root, without parameters, is none)
GROUPS = 8
#: (linears per block, their width): the per-tensor time is taken between the first two, the time per byte of
#: FSDP2's copies between the last two
SHAPES = ((1, 16), (8, 16), (8, 384))
#: bytes `costmodel.overlap.fsdp_serial_time` counts per parameter element of a step here (fp32, 2 ranks, a CPU's
#: overlap slowdown of 1, `costmodel.hardware.CPU_OVERLAP_SLOWDOWN`): a gather's copy-out 2·4 and its copy-in
#: 2·4/2, a reduction's copy-in 4 + 4; ZeRO-3 gathers twice and reduces once, ZeRO-2 once each
STEP_BYTES = {"zero3": 2 * 12 + 8, "zero2": 12 + 8}


def _step_seconds(models: dict, x: dict, rounds: int) -> list[dict]:
    """Seconds of a forward and backward of ``model(x).sum()`` for each of ``models``, stepped in turn, one dict per
    round after 10 warm-up rounds; ``x`` by width."""
    times = []
    for i in range(rounds + 10):
        round_ = {}
        for name, model in models.items():
            t0 = time.perf_counter()
            model(x[name[1]]).sum().backward()
            round_[name] = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
        if i >= 10:
            times.append(round_)
    return times


def _figures(step: dict) -> dict[str, object]:
    """From one round's step times: per event, (a ``k1``-linear group's time, the time per further tensor); and
    the seconds per byte of FSDP2's copies."""
    excess = {(k, w, z): step[k, w, z] - step[k, w, "plain"] for k, w in SHAPES for z in STEP_BYTES}
    (k1, w1), (k2, _), (k3, w3) = SHAPES
    per_group = {}
    for k, w in SHAPES[:2]:
        zero3, zero2 = (excess[k, w, z] / GROUPS for z in ("zero3", "zero2"))
        per_group[k] = {"gather": zero3 - zero2, "reduce": 2 * zero2 - zero3}
    out: dict[str, object] = {}
    for event in ("gather", "reduce"):  # (the k1-linear group's whole time, and the growth per tensor)
        out[event] = (per_group[k1][event], (per_group[k2][event] - per_group[k1][event]) / (k2 - k1))
    # the wide blocks' excess beyond the narrow ones' (same groups and tensors): their copies' extra bytes
    elements = GROUPS * k3 * (w3 * w3 - w1 * w1)
    out["copy_seconds_per_byte"] = sum(excess[k3, w3, z] - excess[k2, w1, z] for z in STEP_BYTES) / (
        elements * sum(STEP_BYTES.values()))
    return out


def measure(rounds: int = 100) -> dict[str, object]:
    """``gather`` and ``reduce``: (seconds per group, seconds per parameter tensor), each at least 0; ``copy_bw``:
    the bytes per second FSDP2's copies achieve, as `costmodel.overlap.fsdp_serial_time` counts their bytes. Needs
    the fake 2-rank process group initialised."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self, k: int, width: int) -> None:
            super().__init__()
            self.linears = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(k))

        def forward(self, x):
            for linear in self.linears:
                x = linear(x)
            return x

    class Model(nn.Module):
        def __init__(self, k: int, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(k, width) for _ in range(GROUPS))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    def sharded(k: int, width: int, reshard: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Model(k, width)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        return fully_shard(model, reshard_after_forward=reshard)

    x = {w: torch.randn(4, w, requires_grad=True) for _, w in SHAPES}
    models = {}
    for k, w in SHAPES:
        torch.manual_seed(0)
        models[k, w, "plain"] = Model(k, w)
        models[k, w, "zero3"] = sharded(k, w, True)
        models[k, w, "zero2"] = sharded(k, w, False)
    # each round's figures from that round's times, then their medians: a figure is a difference of models stepped
    # a few ms apart, so the machine's drift (another process starting beside the probe) cancels within a round,
    # and a round a preemption fell in is one outlier among the rounds
    per_round = [_figures(step) for step in _step_seconds(models, x, rounds)]
    (k1, _), *_ = SHAPES
    out: dict[str, object] = {}
    for event in ("gather", "reduce"):  # (the tensor's figure at least 0 before the group's is taken from it)
        whole, tensor = (statistics.median(r[event][i] for r in per_round) for i in (0, 1))
        tensor = max(0.0, tensor)
        out[event] = (max(0.0, whole - k1 * tensor), tensor)
    seconds = statistics.median(r["copy_seconds_per_byte"] for r in per_round)
    out["copy_bw"] = 1 / seconds if seconds > 0 else 0.0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)  # as a cpu-local rank runs
    # (a store of its own, never the launcher's: see `costmodel.dtensor_probe`)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        figures = measure(args.rounds)
    finally:
        dist.destroy_process_group()
    print(json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
