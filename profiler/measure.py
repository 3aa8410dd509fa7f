"""Measure each layer's forward and backward time on a real device, cached on disk.

Timing uses module hooks around the blocks and the model: on CPU ``time.perf_counter`` (the work is synchronous),
on CUDA events recorded at every boundary and read after the step. The embed layer is the time from the start
of the forward to the first block, the head the time from the last block to the loss; in backward the other way
round. Per-op times are not measured (per-layer times are what the cost model uses). Each figure is the median of
``repeats`` iterations after ``warmup`` iterations.

Results are cached per layer under ``$AUTOPAR_CACHE`` (default ``~/.cache/autopar``), keyed by the layer's
structural signature, the device name, the dtype, the batch shape and the torch version, so identical blocks share
one figure (the median over all their samples) and a second run is instant.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from profiler.graph import LayerGraph


@dataclass(frozen=True, kw_only=True)
class LayerTime:
    """Measured time of one layer at the profile's batch."""

    fwd_s: float  #: forward seconds
    bwd_s: float  #: backward seconds


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Measured per-layer times of a model on one device."""

    device: str  #: device name, e.g. ``NVIDIA H100 80GB HBM3`` or ``cpu:x86_64:1 threads``
    dtype: str  #: parameter/activation dtype measured
    torch_version: str  #: torch version that measured
    batch: int  #: batch size measured
    seq: int  #: sequence length measured
    layers: dict[str, LayerTime] = field(default_factory=dict)  #: layer name → time
    cached: int = 0  #: how many layers came from the cache

    def to_dict(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "torch_version": self.torch_version,
                "batch": self.batch, "seq": self.seq, "cached": self.cached,
                "layers": {k: {"fwd_s": v.fwd_s, "bwd_s": v.bwd_s} for k, v in self.layers.items()}}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{torch.get_num_threads()} threads"


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPAR_CACHE", Path.home() / ".cache" / "autopar")) / "profile"


def _key(signature: str, dev: str, dtype: str, batch: int, seq: int, epoch: str = "") -> str:
    raw = f"{signature}|{dev}|{dtype}|{batch}|{seq}|{torch.__version__}" + (f"|{epoch}" if epoch else "")
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


class _Clock:
    """Timestamps at module boundaries: CUDA events recorded on the current stream on a GPU (no host
    synchronisation inside the step; read after it), ``time.perf_counter`` on the CPU (the work is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, object]] = []

    def mark(self, label: str) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((label, event))
        else:
            self.marks.append((label, time.perf_counter()))

    def seconds(self) -> dict[str, list[float]]:
        """label → times in seconds since the first mark."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            first = self.marks[0][1]
            stamps = [(label, first.elapsed_time(ev) / 1e3) for label, ev in self.marks]
        else:
            stamps = self.marks
        out: dict[str, list[float]] = {}
        for label, ts in stamps:
            out.setdefault(label, []).append(ts)
        return out


def _one_iteration(model, inputs, blocks, clock: _Clock) -> dict[str, tuple[float, float]]:
    clock.marks.clear()
    clock.mark("fwd_start")
    loss = model(*inputs)
    clock.mark("fwd_end")
    loss.backward()
    clock.mark("bwd_end")
    t = clock.seconds()
    out = {}
    names = [name for name, _ in blocks]
    for name in names:
        fwd = t[f"{name}:f1"][0] - t[f"{name}:f0"][0]
        bwd = t[f"{name}:b1"][0] - t[f"{name}:b0"][0]
        out[name] = (fwd, bwd)
    if names:
        out["embed"] = (t[f"{names[0]}:f0"][0] - t["fwd_start"][0], t["bwd_end"][0] - t[f"{names[0]}:b1"][0])
        out["head"] = (t["fwd_end"][0] - t[f"{names[-1]}:f1"][0], t[f"{names[-1]}:b0"][0] - t["fwd_end"][0])
    else:
        out["model"] = (t["fwd_end"][0] - t["fwd_start"][0], t["bwd_end"][0] - t["fwd_end"][0])
    return out


def cached(layers: LayerGraph, device: str, dtype: str, batch: int | None = None, epoch: str = "") -> Profile | None:
    """The profile of ``layers`` on ``device`` (`device_name`) in ``dtype`` at ``batch`` (default: the capture's)
    as an earlier `measure` with the same ``epoch`` cached it, or None unless every layer is cached."""
    batch, seq = batch or layers.model.batch, layers.model.seq
    hits = {layer.name: cache_dir() / f"{_key(layer.signature, device, dtype, batch, seq, epoch)}.json"
            for layer in layers.layers}
    if not all(p.exists() for p in hits.values()):
        return None
    loaded = {n: LayerTime(**json.loads(p.read_text())) for n, p in hits.items()}
    return Profile(device=device, dtype=dtype, torch_version=torch.__version__, batch=batch, seq=seq,
                   layers=loaded, cached=len(loaded))


def measure(model: torch.nn.Module, example_inputs, layers: LayerGraph, *, device: str = "cpu",
            warmup: int = 2, repeats: int = 5, use_cache: bool = True, batch: int | None = None,
            epoch: str = "") -> Profile:
    """Time every layer of ``model`` (real weights) on ``device`` with ``example_inputs`` of ``batch`` rows (default:
    the batch ``layers`` were captured at); see the module docstring. ``epoch``: part of the cache's key, so that
    times cached under another are measured again (`costmodel.measured.measure_here`: the measurement of the device
    they are priced against)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; use --device cpu or run on a GPU machine")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("measure needs real weights: build the model on a real device, not 'meta'")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    name = device_name(dev)
    batch, seq = batch or layers.model.batch, layers.model.seq
    first = example_inputs[0] if example_inputs else None
    if isinstance(first, torch.Tensor) and first.dim() and first.shape[0] != batch:  # (the cache and the cost
        # model read the times as this batch's)
        raise ValueError(f"measure: the inputs hold a batch of {first.shape[0]}, not {batch}; build the model's "
                         f"inputs at batch {batch}")
    keys = {layer.name: _key(layer.signature, name, dtype, batch, seq, epoch) for layer in layers.layers}
    cdir = cache_dir()
    if use_cache and (hit := cached(layers, name, dtype, batch, epoch)) is not None:
        return hit
    model = model.to(dev).train()
    inputs = [t.to(dev) for t in example_inputs]
    clock = _Clock(dev)
    blocks = [(layer.name, model.get_submodule(layer.name)) for layer in layers.blocks]
    handles = []
    for bname, mod in blocks:
        handles.append(mod.register_forward_pre_hook(lambda *_, n=bname: clock.mark(f"{n}:f0")))
        handles.append(mod.register_forward_hook(lambda *_, n=bname: clock.mark(f"{n}:f1")))
        handles.append(mod.register_full_backward_pre_hook(lambda *_, n=bname: clock.mark(f"{n}:b0")))
        handles.append(mod.register_full_backward_hook(lambda *_, n=bname: clock.mark(f"{n}:b1")))
    try:
        samples: dict[str, list[tuple[float, float]]] = {}
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            times = _one_iteration(model, inputs, blocks, clock)
            if i >= warmup:
                for k, v in times.items():
                    samples.setdefault(k, []).append(v)
    finally:
        for h in handles:
            h.remove()
    # layers with one cache key (identical blocks) get one figure: the median over all of their samples, which
    # is also what the cache holds, so a second run reports exactly what the first did
    pooled: dict[str, list[tuple[float, float]]] = {}
    for k, v in samples.items():
        pooled.setdefault(keys.get(k, k), []).extend(v)
    result = {}
    for k in samples:
        v = pooled[keys.get(k, k)]
        result[k] = LayerTime(fwd_s=statistics.median(f for f, _ in v), bwd_s=statistics.median(b for _, b in v))
    if use_cache:
        cdir.mkdir(parents=True, exist_ok=True)
        for n, lt in result.items():
            if n in keys:
                tmp = cdir / f".{keys[n]}.json.{os.getpid()}.tmp"  # (one per process: runs at once)
                tmp.write_text(json.dumps({"fwd_s": lt.fwd_s, "bwd_s": lt.bwd_s}))
                tmp.replace(cdir / f"{keys[n]}.json")
    return Profile(device=name, dtype=dtype, torch_version=torch.__version__, batch=batch, seq=seq, layers=result)
