"""Measured per-layer times in the cost model: a profile file, or the model measured on this machine's CPU.

A profile (`autopar profile MODEL --device … --out PROFILE.json`) holds each layer's forward and backward time at
one batch on one device. It applies only to the same model (same spec, sequence length and layer names) on a
cluster of that device; anything else is refused with the reason, never silently mixed (`load_measured`).

A CPU cluster's device is this machine's CPU (`costmodel.hardware.measure_cpu_device`), so the layer graph the cost
model uses for it (`layer_graph`) carries each layer measured here, one thread as a gloo rank runs
(`profiler.measure`, cached on disk), whenever the model is small enough to run here. The roofline prices a
transformer's GEMMs on this CPU to a few % but not the rest: measured on the validation model (llama, 4 blocks of
256; `torch.profiler`, one thread), the elementwise, normalisation and rotary ops ran at ~5 GB/s where the device's
elementwise probe reads 11 (cold operands, broadcasting and strided layouts, SiLU's exponentials), the CPU's
attention kernel 16-30 % below its probe, and a GPT's dropout draws its random mask at ~7 ns an element: a forward
and backward 5-35 % slower than priced (Llamas and GPTs of 4 blocks of 256-384, one process). The measured level
replaces the roofline's layer by layer; the roofline still scales it to each configuration (micro-batch, TP, SP:
`costmodel.layercost.layer_cost`). Each layer is measured at the captured batch and at `LARGER_BATCH` times it, so
that a part of its time that does not grow with the batch is not scaled as if it did
(`costmodel.layercost.measured_scale`).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache, lru_cache
from pathlib import Path

from costmodel.cluster import Cluster
from profiler.graph import LayerGraph, Timings

#: the most of this machine's memory that measuring a model may take (weights, gradients and activations, fp32),
#: leaving the rest to whatever else runs (a validation's ranks, a test suite)
MEASURE_MEMORY_SHARE = 0.25
#: the most seconds the measurement's iterations may take as the roofline prices them
MEASURE_SECONDS = 30.0
#: the larger batch measured beside the captured one, as a multiple of it. With two batches a layer's time is a
#: part that does not grow with the batch plus one that grows as the roofline does (`costmodel.layercost`): the
#: captured batch's time scaled by the roofline alone over-shot by +9-14 % at micro-batch 4-8 (a one-process
#: forward + backward of the validation Llama and of gpt-small, one thread; within ±7 % measured at batch 2 or 4)
LARGER_BATCH = 4

_GPU_KINDS = {"a100-40g": "a100", "a100-80g": "a100", "h100-sxm": "h100", "h200": "h200"}


def _same_device(measured_on: str, cluster: Cluster) -> bool:
    name = cluster.device.name
    if name == "cpu":
        return measured_on.startswith("cpu")
    kind = _GPU_KINDS.get(name)
    return kind is not None and kind in measured_on.lower().replace(" ", "")


def load_measured(path: str | Path, lg: LayerGraph, cluster: Cluster) -> tuple[dict[str, tuple[float, float]], int]:
    """(layer name → (forward s, backward s), measured batch) from a profile file; ValueError if it does not apply."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"profile {path} not found; write one with `autopar profile MODEL --device cpu --out {path}`")
    try:
        stat = path.stat()
        d = _profile_file(str(path), stat.st_mtime_ns, stat.st_size)
        m = d["measured"]
        layers = {k: (float(v["fwd_s"]), float(v["bwd_s"])) for k, v in m["layers"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: not a measured profile (run `autopar profile MODEL --device cpu --out {path}`)") \
            from None
    if d.get("model") != lg.model.name or d.get("seq") != lg.model.seq:
        raise ValueError(f"{path} profiles {d.get('model')} at seq {d.get('seq')}, not {lg.model.name} at seq "
                         f"{lg.model.seq}; profile this model")
    missing = [layer.name for layer in lg.layers if layer.name not in layers]
    if missing:
        raise ValueError(f"{path} has no time for layer {missing[0]}; profile this model again")
    if not _same_device(m["device"], cluster):
        raise ValueError(f"{path} was measured on {m['device']!r} but cluster {cluster.name} has {cluster.device.name} "
                         "devices; measure on that device or drop --profile")
    return layers, int(m["batch"])


@lru_cache(maxsize=16)  # (a recalibration reprices each plan from its profile at every step of its fit)
def _profile_file(path: str, mtime_ns: int, size: int) -> dict:
    """A profile file's JSON, read once while it is unchanged (not to be modified)."""
    return json.loads(Path(path).read_text())


def layer_graph(model: str, cluster: Cluster, seq: int | None = None) -> LayerGraph:
    """The layer graph the cost model uses for ``model`` on ``cluster``. On a CPU: the fp32 capture with the CPU's
    attention kernels, carrying each layer's time measured on this machine (`Timings`; see the module docstring)
    or why none was. Elsewhere the 16-bit capture, its autocast twin on demand."""
    from profiler.api import profile_once

    if cluster.device.name.startswith("cpu"):
        from profiler.zoo.registry import resolve_model

        # (one key per graph, whether the caller spelled out the model's own sequence length or not)
        return _cpu_graph(model, seq if seq is not None else resolve_model(model).seq)
    return profile_once(model, seq=seq)


@cache  # (once per process: a validation prices its plans on one graph, a calibration its runs many times)
def _cpu_graph(model: str, seq: int | None) -> LayerGraph:
    from profiler.api import profile_model

    return timed_here(profile_model(model, seq=seq, dtype="fp32", kernels="native"))


def timed_here(lg: LayerGraph, build=None) -> LayerGraph:
    """``lg`` with its layers measured on this machine (`measure_here`), referred to this machine's CPU as measured
    (`costmodel.hardware.measure_cpu_device`, whatever figures a cluster file holds)."""
    from costmodel.hardware import measure_cpu_device

    here = measure_cpu_device()
    timings = measure_here(lg, here.peak("fp32"), here.memory_bytes, build=build, epoch=device_epoch(here))
    return dataclasses.replace(lg, timings=dataclasses.replace(timings, device=here))


def device_epoch(device) -> str:
    """What identifies one measurement of this machine's CPU (`costmodel.hardware.measure_cpu_device`): a digest of
    its figures, but its memory (the smaller of the measured and the process's cgroup limit, read anew by each
    process). Layer times cached under another are measured again (`measure_here`): priced against a device
    measured after them, on a machine whose speed had moved since, they put every plan of
    `benchmarks/validate_cpu.py` ~25 % fast (MAE 20.6-25.5 %, against 14.4-15.0 % with both measured afresh). A
    model first planned long after the device was measured still has its layers timed today against it."""
    import hashlib

    return hashlib.sha256(repr(dataclasses.replace(device, memory_bytes=1.0)).encode()).hexdigest()[:16]


def measure_here(lg: LayerGraph, peak: float, memory: float, *, build=None, warmup: int = 2,
                 repeats: int = 5, epoch: str = "") -> Timings:
    """Each layer of ``lg`` (an fp32 capture) measured on this machine's CPU with one thread, at the captured batch
    and at `LARGER_BATCH` times it (`profiler.measure`, cached), as far as the model fits in `MEASURE_MEMORY_SHARE`
    of ``memory`` and the iterations of both take at most `MEASURE_SECONDS` at ``peak`` FLOP/s; otherwise the
    captured batch alone, or no times, and the note says why. ``build(batch)``: makes the (module, example inputs
    of that batch) to time (default: the graph's model spec built on the CPU); the global random state is left as
    it was (dropout draws during the measurement). ``epoch``: the device measurement the times will be priced
    against (`device_epoch`), part of their cache key."""
    import torch

    from costmodel.hardware import busy, machine_load
    from profiler.measure import cached, device_name, measure
    from profiler.zoo.registry import resolve_model

    g = lg.model
    state = 8.0 * g.num_params  # fp32 weights and their gradients
    saved = sum(n.saved_bytes for n in g.nodes)
    flops = sum(n.fwd_flops + n.bwd_flops for n in g.nodes)
    need_s = (warmup + repeats) * flops / peak
    cap = MEASURE_MEMORY_SHARE * memory
    if state + saved > cap or need_s > MEASURE_SECONDS:
        return Timings(layers={}, batch=g.batch, note=(
            f"priced by the roofline: {g.name} is too large to measure on this machine ({(state + saved) / 2**30:.1f} "
            f"GiB, ~{need_s:.0f} s; measured up to {MEASURE_MEMORY_SHARE:.0%} of its memory and "
            f"{MEASURE_SECONDS:.0f} s)"))
    larger = LARGER_BATCH * g.batch
    two = state + LARGER_BATCH * saved <= cap and (1 + LARGER_BATCH) * need_s <= MEASURE_SECONDS
    name, keep = "", True

    def one(batch: int):
        nonlocal keep
        prof = cached(lg, name, "float32", batch, epoch)
        if prof is None:
            # measured while every core is busy it reads slow: used, but not cached for the processes after
            # (as `costmodel.hardware.measure_cpu_device` does)
            keep = keep and not busy(machine_load())
            with torch.random.fork_rng(devices=[]):
                if build is None:
                    module, inputs = resolve_model(g.name).build(batch=batch, seq=g.seq or None, device="cpu")
                else:
                    module, inputs = build(batch)
                prof = measure(module.float(), inputs, lg, device="cpu", warmup=warmup, repeats=repeats,
                               use_cache=keep, batch=batch, epoch=epoch)
        missing = [layer.name for layer in lg.layers if layer.name not in prof.layers]
        if missing:  # (a model without a list of blocks is timed whole, which no layer of the graph is)
            raise _NotPerLayer(missing[0])
        return {layer.name: (prof.layers[layer.name].fwd_s, prof.layers[layer.name].bwd_s) for layer in lg.layers}

    def why(exc: Exception) -> str:
        text = str(exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a gloo rank runs (torchrun: OMP_NUM_THREADS=1), and as the device was measured
    try:
        name = device_name(torch.device("cpu"))  # (names the threads: one)
        try:
            first = one(g.batch)
        except _NotPerLayer as exc:
            return Timings(layers={}, batch=g.batch, note=(
                f"priced by the roofline: {g.name}'s layers could not be timed one by one here (no time for {exc})"))
        except Exception as exc:  # noqa: BLE001 (best effort: the plan goes on by the roofline, saying why)
            return Timings(layers={}, batch=g.batch,
                           note=f"priced by the roofline: {g.name} could not be measured here ({why(exc)})")
        second, alone = {}, ""
        if not two:
            alone = (f"; batch {larger} not measured (over {MEASURE_MEMORY_SHARE:.0%} of the memory or "
                     f"{MEASURE_SECONDS:.0f} s): the roofline scales batch {g.batch}'s times in proportion")
        else:
            try:
                second = one(larger)
            except Exception as exc:  # noqa: BLE001 (the captured batch's times stand alone)
                alone = (f"; batch {larger} could not be measured ({why(exc)}): the roofline scales batch "
                         f"{g.batch}'s times in proportion")
    finally:
        torch.set_num_threads(threads)
    batches = f"batches {g.batch} and {larger}" if second else f"batch {g.batch}"
    return Timings(layers=first, batch=g.batch, larger=second, larger_batch=larger if second else 0, note=(
        f"measured on this machine layer by layer ({name}, {batches}, `profiler.measure`"
        f"{'' if keep else '; the machine was busy: not cached'}), the roofline scaling it to each configuration"
        f"{alone}"))


class _NotPerLayer(Exception):
    """A layer of the graph has no time of its own in the measurement."""
