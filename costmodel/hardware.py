"""Device catalog: what one accelerator can do (peak FLOP/s per dtype, memory, HBM bandwidth, efficiency).

Everything is in SI units: FLOP/s, bytes, bytes/s. Units appear only in YAML key names at the edge (see
``costmodel.cluster``). Peaks are the vendor's *dense* figures (calibration/README.md §5.1); what kernels achieve is
an :class:`EfficiencyCurve` over op size (Calculon's idea: efficiency is a curve, not a constant).

The efficiency constants below are priors (``source="prior: unfitted"``); the calibration script fits them on
published runs and overwrites them from a fitted-constants file. The ``cpu`` device is measured on this machine
by :func:`measure_cpu_device` the first time it is looked up, never hard-coded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Generic, TypeVar

from costmodel.stacks import fitted  # (one file holds the kinds' constants and the stacks')

__all__ = [
    "DTENSOR_OPS",
    "FSDP_EVENTS",
    "DTYPES",
    "DEVICES",
    "DeviceSpec",
    "EfficiencyCurve",
    "KIND_ORDER",
    "LazyCatalog",
    "bandwidth_floor",
    "get_device",
    "measure_cpu_device",
]

#: dtype names a peak may be given for (the training precision names of DESIGN.md, plus tf32 and fp8).
DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")

#: the ops the tensor-parallel runtime runs as DTensors, each with its own host overhead (`DeviceSpec`)
DTENSOR_OPS = ("tp_linear", "sp_linear", "sp_norm")

#: what an FSDP2 group does per step, each with its own host overhead (`DeviceSpec.fsdp_overhead_s`): gather its
#: parameters (and reshard them after), reduce-scatter its gradients
FSDP_EVENTS = ("gather", "reduce")

GiB = 2**30
TERA = 1e12


@dataclass(frozen=True, kw_only=True)
class EfficiencyCurve:
    """Achieved fraction of peak for one matmul, as a saturating function of its size.

    ``eff(f) = e_max * f / (f + f_half)`` where ``f`` is the FLOP count of one matmul. Small matmuls cannot fill the
    device (launch overhead, tail effects, too few tiles), large ones approach ``e_max``; at ``f = f_half`` the
    efficiency is ``e_max / 2``. A Michaelis-Menten-shaped stand-in for Calculon's size-dependent efficiency tables
    (calculon-ai/calculon, ``matrix`` efficiency by size), with two parameters so it can be fitted on few points.
    """

    #: asymptotic efficiency of a very large matmul, a fraction of the dense peak in (0, 1].
    e_max: float
    #: matmul size (FLOPs) at which efficiency is half of ``e_max``; > 0.
    f_half: float
    #: where the two numbers come from ("prior: unfitted", or what they were fitted on and when).
    source: str

    def __post_init__(self) -> None:
        if not 0.0 < self.e_max <= 1.0:
            raise ValueError(f"EfficiencyCurve.e_max must be in (0, 1], got {self.e_max!r}")
        if not self.f_half > 0.0:
            raise ValueError(f"EfficiencyCurve.f_half must be > 0 FLOPs, got {self.f_half!r}")

    def __call__(self, flops: float) -> float:
        """Efficiency (fraction of dense peak) of one matmul of ``flops`` FLOPs: ``e_max·f/(f+f_half)``."""
        if flops < 0:
            raise ValueError(f"matmul FLOPs must be >= 0, got {flops!r}")
        return self.e_max * flops / (flops + self.f_half)


def _frozen_map(values: Mapping[str, float]) -> Mapping[str, float]:
    """A read-only copy, so a frozen spec stays frozen."""
    return MappingProxyType(dict(values))


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or the local CPU): peaks, memory and efficiencies, in SI units."""

    #: catalog name, e.g. ``h100-sxm``.
    name: str
    #: dtype name (``bf16``, ``fp16``, ``fp32``, ``tf32``, ``fp8``) → dense peak, FLOP/s.
    peak_flops: Mapping[str, float]
    #: device memory, bytes.
    memory_bytes: float
    #: HBM (or DRAM) bandwidth, bytes/s.
    hbm_bw: float
    #: achieved fraction of the dense peak for one matmul, as a function of its FLOPs.
    matmul_eff: EfficiencyCurve
    #: achieved fraction of ``hbm_bw`` for memory-bound ops (elementwise, norms, softmax), in (0, 1].
    memory_eff: float
    #: efficiency of fused attention kernels (FlashAttention) relative to a GEMM of the same FLOPs, in (0, 1]:
    #: FlashAttention-2 reaches 50-73 % of A100 peak vs ~80 % for GEMMs, and 35-50 % of H100 peak (Dao 2023, §4.1).
    attention_eff: float = 1.0
    #: sequence length (tokens per sequence on a rank) at which a fused causal attention kernel reaches half of
    #: ``attention_eff``: its efficiency is ``attention_eff × L/(L + attention_seq_half)``, a fixed cost per query
    #: tile against work growing with the causal prefix (`costmodel.layercost.attention_len_eff`); fitted on
    #: published runs that vary the sequence (`costmodel.calibrate`). 0: no dependence on the length
    attention_seq_half: float = 0.0
    #: achieved fraction of the fp8 peak relative to the bf16 curve: the float8 GEMMs' own efficiency (their
    #: recipe's casts are kernels priced apart, `costmodel.layercost.float8_cast_costs`), in (0, 1].
    fp8_eff: float = 1.0
    #: fractional slowdown of compute while a collective overlaps it (the collective's kernels take SMs and HBM
    #: bandwidth): overlapped compute time is multiplied by ``1 + overlap_slowdown``, in [0, 1]. 1: the collectives
    #: run on the cores that compute (gloo's threads on a CPU whose every core runs a rank), so nothing hides them
    overlap_slowdown: float = 0.0
    #: host seconds per operator of an eager training step, (forward, backward), charged per captured op on top of
    #: its roofline time: on a CPU the thread that dispatches an op (Python, the dispatcher, autograd's engine) also
    #: runs it, so the two add. 0 on GPUs: kernels are launched asynchronously and overlap the host's dispatch (a
    #: step of kernels shorter than their launch would be host-bound; not modelled)
    op_overhead_s: tuple[float, float] = (0.0, 0.0)
    #: host seconds DTensor adds, (forward, backward), per op the tensor-parallel runtime runs as DTensors, by
    #: ``DTENSOR_OPS`` key: a ``ColwiseParallel``/``RowwiseParallel`` linear without (``tp_linear``) and with
    #: sequence parallelism (``sp_linear``), a ``SequenceParallel`` norm (``sp_norm``): sharding propagation and
    #: the wrapping of inputs and outputs, in Python on the thread that then runs the op (`costmodel.dtensor_probe`).
    #: Empty (0) on GPUs, where it overlaps the kernels as ``op_overhead_s`` does
    dtensor_overhead_s: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: seconds DTensor adds besides, (forward, backward), per byte of activations the op's forward reads and writes
    #: on the rank (`costmodel.layercost.dtensor_bytes`), by the same keys: measured on a CPU to grow with the op's
    #: data (the ops beside DTensor's run slower, and its redistributions' functional collectives copy their inputs:
    #: `costmodel.dtensor_probe`). Empty (0) on GPUs
    dtensor_byte_s: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: host seconds FSDP2 adds per ``FSDP_EVENTS`` event of a ``fully_shard`` group, (per group, per parameter
    #: tensor of the group): its hooks, the bookkeeping of each parameter's sharded and unsharded views, the
    #: gradients' wrapping, in Python on the thread that then computes (`costmodel.fsdp_probe`), on top of the
    #: collective and its copies (`costmodel.overlap.fsdp_serial_time`). Empty (0) on GPUs, where it overlaps the
    #: kernels as ``op_overhead_s`` does
    fsdp_overhead_s: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: bytes/s FSDP2's copies achieve where measured (`costmodel.fsdp_probe`: on a CPU they write into storage
    #: freed and allocated again at every gather, at ~half the rate of a copy between kept buffers); 0: the
    #: device's ``hbm_bw × memory_eff`` (a GPU's caching allocator hands the same blocks back)
    fsdp_copy_bw: float = 0.0
    #: bytes the runtime holds outside torch's caching allocator (CUDA context, NCCL buffers) when measured (a
    #: cluster file's ``runtime_reserved_GiB``); None: modelled per plan (`costmodel.memory.runtime_reserved_bytes`)
    runtime_reserved: float | None = None
    #: ``memory_bytes`` is the host's memory, which every rank of a node shares (a CPU: gloo processes), so a rank
    #: may plan on its share only (`costmodel.cluster.Cluster.memory_per_rank_bytes`); False: each rank's own (a GPU)
    host_memory: bool = False
    #: where the peaks and the memory_eff come from.
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string")
        if not self.peak_flops:
            raise ValueError(f"device {self.name!r}: peak_flops needs at least one dtype, got none")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES:
                raise ValueError(f"device {self.name!r}: unknown dtype {dtype!r} in peak_flops; known: {DTYPES}")
            if not flops > 0:
                raise ValueError(f"device {self.name!r}: peak_flops[{dtype!r}] must be > 0 FLOP/s, got {flops!r}")
        if not self.memory_bytes > 0:
            raise ValueError(f"device {self.name!r}: memory_bytes must be > 0, got {self.memory_bytes!r}")
        if not self.hbm_bw > 0:
            raise ValueError(f"device {self.name!r}: hbm_bw must be > 0 bytes/s, got {self.hbm_bw!r}")
        if not 0.0 < self.memory_eff <= 1.0:
            raise ValueError(f"device {self.name!r}: memory_eff must be in (0, 1], got {self.memory_eff!r}")
        for key in ("attention_eff", "fp8_eff"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(f"device {self.name!r}: {key} must be in (0, 1], got {getattr(self, key)!r}")
        if not 0.0 <= self.attention_seq_half < math.inf:
            raise ValueError(f"device {self.name!r}: attention_seq_half must be ≥ 0 tokens, "
                             f"got {self.attention_seq_half!r}")
        if not 0.0 <= self.overlap_slowdown <= 1.0:
            raise ValueError(f"device {self.name!r}: overlap_slowdown must be in [0, 1], got {self.overlap_slowdown!r}")
        if len(self.op_overhead_s) != 2 or not all(t >= 0 for t in self.op_overhead_s):
            raise ValueError(f"device {self.name!r}: op_overhead_s must be (forward, backward) seconds ≥ 0, "
                             f"got {self.op_overhead_s!r}")
        object.__setattr__(self, "op_overhead_s", tuple(float(t) for t in self.op_overhead_s))
        for name, unit in (("dtensor_overhead_s", "seconds"), ("dtensor_byte_s", "seconds per byte")):
            for key, pair in getattr(self, name).items():
                if key not in DTENSOR_OPS or len(pair) != 2 or not all(t >= 0 for t in pair):
                    raise ValueError(f"device {self.name!r}: {name} maps {', '.join(DTENSOR_OPS)} to "
                                     f"(forward, backward) {unit} ≥ 0, got {key!r}: {pair!r}")
            object.__setattr__(self, name, MappingProxyType(
                {k: tuple(float(t) for t in v) for k, v in getattr(self, name).items()}))
        for key, pair in self.fsdp_overhead_s.items():
            if key not in FSDP_EVENTS or len(pair) != 2 or not all(t >= 0 for t in pair):
                raise ValueError(f"device {self.name!r}: fsdp_overhead_s maps {', '.join(FSDP_EVENTS)} to "
                                 f"(per group, per tensor) seconds ≥ 0, got {key!r}: {pair!r}")
        if not self.fsdp_copy_bw >= 0:
            raise ValueError(f"device {self.name!r}: fsdp_copy_bw must be ≥ 0 bytes/s, got {self.fsdp_copy_bw!r}")
        object.__setattr__(self, "fsdp_overhead_s", MappingProxyType(
            {k: tuple(float(t) for t in v) for k, v in self.fsdp_overhead_s.items()}))
        if self.runtime_reserved is not None and not self.runtime_reserved >= 0:
            raise ValueError(f"device {self.name!r}: runtime_reserved must be ≥ 0 bytes, got {self.runtime_reserved!r}")
        object.__setattr__(self, "peak_flops", _frozen_map(self.peak_flops))

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes, self.hbm_bw,
                     self.matmul_eff, self.memory_eff, self.attention_eff, self.attention_seq_half, self.fp8_eff,
                     self.overlap_slowdown,
                     self.op_overhead_s, tuple(sorted(self.dtensor_overhead_s.items())),
                     tuple(sorted(self.dtensor_byte_s.items())),
                     tuple(sorted(self.fsdp_overhead_s.items())), self.fsdp_copy_bw, self.runtime_reserved,
                     self.host_memory, self.source))

    def dtensor_overhead(self, op: str, nbytes: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds DTensor adds to one ``op`` (a ``DTENSOR_OPS`` key) whose forward reads and
        writes ``nbytes`` of activations on the rank: per op plus per byte; 0 if unmeasured."""
        fixed = self.dtensor_overhead_s.get(op, (0.0, 0.0))
        per = self.dtensor_byte_s.get(op, (0.0, 0.0))
        return fixed[0] + per[0] * nbytes, fixed[1] + per[1] * nbytes

    def fsdp_overhead(self, event: str) -> tuple[float, float]:
        """(per group, per parameter tensor) host seconds FSDP2 adds to one ``event`` (a ``FSDP_EVENTS`` key) of a
        ``fully_shard`` group; 0 if unmeasured."""
        return self.fsdp_overhead_s.get(event, (0.0, 0.0))

    @property
    def fsdp_copy_rate(self) -> float:
        """Bytes/s of FSDP2's copies: ``fsdp_copy_bw`` where measured, else ``hbm_bw × memory_eff``."""
        return self.fsdp_copy_bw or self.hbm_bw * self.memory_eff

    def peak(self, dtype: str) -> float:
        """Dense peak for ``dtype`` in FLOP/s; ValueError naming the dtypes this device has if it is unknown."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"device {self.name!r} has no peak for dtype {dtype!r}; it has {sorted(self.peak_flops)}"
            ) from None


# --- Catalog ---------------------------------------------------------------------------------------------------

#: GPU matmul efficiency prior: large GEMMs reach ~75 % of dense peak in practice (Megatron/torchtitan MFU ranges),
#: half of that at ~2 GFLOP (e.g. a 1024×1024×1024 GEMM). Overwritten by the calibration fit.
GPU_MATMUL_PRIOR = EfficiencyCurve(e_max=0.75, f_half=2e9, source="prior: unfitted")
#: memory-bound ops commonly reach 70-85 % of HBM bandwidth (STREAM-like); prior, unfitted.
GPU_MEMORY_EFF_PRIOR = 0.8
#: fused attention relative to a GEMM of its FLOPs: FlashAttention-2 reaches 50-73 % of the A100's peak where
#: optimised GEMMs reach ~80 % (Dao 2023, abstract and §4.1); the middle of that range over 80 %. Prior, unfitted.
GPU_ATTENTION_EFF_PRIOR = (0.50 + 0.73) / 2 / 0.80

_A100_PEAKS = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_H100_PEAKS = {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}
_PEAK_SOURCE = "NVIDIA datasheets, dense (no sparsity), via calibration/README.md §5.1"


#: Constants fitted by ``python -m costmodel.calibrate`` on shared/calibration data, one set per device *kind*
#: (``a100``: the 40 and 80 GB parts; ``h100``: H100 SXM and H200, the same GH100 compute).
_KIND = {"a100-40g": "a100", "a100-80g": "a100", "h100-sxm": "h100", "h100-hbm2e": "h100", "h200": "h100"}

#: device kinds in increasing bf16 peak, each with the catalogue device its published rows ran on:
#: `costmodel.calibrate` fits a faster kind's constants above the slower kinds' on those devices, and
#: `bandwidth_floor` keeps every other device of a faster kind above them too
KIND_ORDER = (("a100", "a100-80g"), ("h100", "h100-sxm"))


def device_kind(name: str) -> str | None:
    """The kind a catalogue device's fitted constants belong to (None for a device described in a file)."""
    return _KIND.get(name)


def with_stack(device: DeviceSpec, stack: str) -> DeviceSpec:
    """``device`` with the efficiency constants fitted for software stack ``stack`` on its kind, where that stack
    has rows of its own there (`costmodel.stacks`); otherwise ``device`` as it is."""
    from costmodel.stacks import stack_constants

    fit = stack_constants(device_kind(device.name), stack)
    if not fit:
        return device
    effs, note = floored(device.name, device.hbm_bw, _efficiencies(fit), stack)
    return replace(device, **effs, source=device.source.split("; efficiencies")[0]
                   + f"; efficiencies ({stack}): {fit['source']}{note}")


def bandwidth_floor(name: str, hbm_bw: float, stack: str | None = None) -> tuple[float, str]:
    """The least memory efficiency at which catalogue device ``name`` (``hbm_bw`` bytes/s) moves memory-bound ops
    at least as fast as every catalogue device of a slower kind (`KIND_ORDER`) under software stack ``stack`` (None:
    the kinds' own constants), and that device's name; (0, "") for the slowest kind or a device outside the
    catalogue. `costmodel.calibrate` fits a kind's constants above this floor on the kind's own device
    (``memory_eff`` ≥ the slower kind's × its HBM bandwidth ratio, `calibrate._ranges`); a device of the kind with
    less bandwidth needs its own: h100-hbm2e (2.4 TB/s) at the h100 kind's 0.571, fitted on h100-sxm (3.35 TB/s),
    would move memory-bound ops at 0.72× an A100-80G's achieved rate. At most 1: a device whose whole bandwidth
    is under a slower one's is not made faster than its peak (none in the catalogue)."""
    kinds = [kind for kind, _ in KIND_ORDER]
    kind = _KIND.get(name)
    if kind not in kinds:
        return 0.0, ""
    slower = [d for d, k in _KIND.items() if k in kinds[:kinds.index(kind)]]
    achieved = {}
    for d in slower:
        dev = get_device(d) if stack is None else with_stack(get_device(d), stack)
        achieved[d] = dev.hbm_bw * dev.memory_eff
    if not achieved:
        return 0.0, ""
    fastest = max(achieved, key=achieved.get)
    floor = achieved[fastest] / hbm_bw
    if floor * hbm_bw < achieved[fastest]:  # (the division rounded down: one ulp up keeps the device no slower)
        floor = math.nextafter(floor, math.inf)
    return min(floor, 1.0), fastest


def floored(name: str, hbm_bw: float, effs: dict, stack: str | None) -> tuple[dict, str]:
    """``effs`` (`_efficiencies`) with the memory efficiency raised to `bandwidth_floor` where it is under it, and
    a note for the device's source saying so (empty otherwise)."""
    floor, slower = bandwidth_floor(name, hbm_bw, stack)
    if effs["memory_eff"] >= floor:
        return effs, ""
    return ({**effs, "memory_eff": floor},
            f"; memory efficiency {effs['memory_eff']:.4g} raised to {floor:.4g}, {slower}'s achieved HBM bandwidth "
            f"(hardware.bandwidth_floor)")


def fitted_constants(kind: str) -> dict | None:
    """The fitted efficiency constants for a device kind, or None when not fitted yet."""
    return fitted().get(kind)


def _efficiencies(fit: dict) -> dict:
    """A fitted entry of fitted.yaml as `DeviceSpec` fields."""
    return {"matmul_eff": EfficiencyCurve(e_max=fit["matmul_e_max"], f_half=fit["matmul_f_half"], source=fit["source"]),
            "memory_eff": fit["memory_eff"], "overlap_slowdown": fit["overlap_slowdown"],
            "attention_eff": fit.get("attention_eff", GPU_ATTENTION_EFF_PRIOR),
            "attention_seq_half": fit.get("attention_seq_half", 0.0), "fp8_eff": fit.get("fp8_eff", 1.0)}


def _gpu(name: str, peaks: Mapping[str, float], memory_bytes: float, hbm_bw: float, memory_note: str) -> DeviceSpec:
    fit = fitted_constants(_KIND[name])
    if fit:
        effs, note = _efficiencies(fit), f"efficiencies: {fit['source']}"
    else:
        effs = {"matmul_eff": GPU_MATMUL_PRIOR, "memory_eff": GPU_MEMORY_EFF_PRIOR, "overlap_slowdown": 0.0,
                "attention_eff": GPU_ATTENTION_EFF_PRIOR}
        note = "efficiencies: prior: unfitted"
    effs, raised = floored(name, hbm_bw, effs, None)
    return DeviceSpec(name=name, peak_flops=peaks, memory_bytes=memory_bytes, hbm_bw=hbm_bw,
                      source=f"{_PEAK_SOURCE}; {memory_note}; {note}{raised}", **effs)


_T = TypeVar("_T")


class LazyCatalog(Mapping[str, _T], Generic[_T]):
    """A read-only name → spec mapping whose entries are built on first lookup (and cached).

    Used so that importing the catalog never measures the machine: the ``cpu`` device times a matmul only when
    someone asks for it.
    """

    def __init__(self, factories: Mapping[str, Callable[[], _T]]) -> None:
        self._factories = dict(factories)
        self._built: dict[str, _T] = {}

    def rebuild(self) -> None:
        """Forget the built entries (e.g. after new fitted constants were written); they are rebuilt on lookup."""
        self._built.clear()

    def __getitem__(self, name: str) -> _T:
        if name not in self._built:
            self._built[name] = self._factories[name]()  # KeyError for unknown names, as a Mapping should
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)


def cpu_cache_file() -> Path:
    """Where `measure_cpu_device` caches this machine's CPU (per machine, torch version and measurement version)."""
    import platform

    import torch

    root = Path(os.environ.get("AUTOPAR_CACHE", Path.home() / ".cache" / "autopar"))
    key = (f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}-torch{torch.__version__}"
           f"-v{_CPU_MEASURE_VERSION}")  # (another version's figures, with other fields, live beside these)
    return root / "devices" / f"cpu-{''.join(c if c.isalnum() or c in '.-' else '_' for c in key)}.json"


#: The CPU device's ``overlap_slowdown``: a ``cpu-local`` rank is one thread on its own core and gloo moves its
#: bytes on CPU threads of the same ranks (ProcessGroupGloo's worker threads), so a collective takes the cycles of
#: the compute it overlaps: none of it is hidden. Not measured: the structure of the machine.
CPU_OVERLAP_SLOWDOWN = 1.0


#: Version of the measurement below; a cached device measured by another version is measured again.
_CPU_MEASURE_VERSION = 6  # (6: `costmodel.fsdp_probe` takes its figures round by round)


#: cgroup files that hold the memory a container may use (v2, then v1); "max" or a figure past the RAM: no limit
_CGROUP_MEMORY = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes(cgroup_files: Sequence[str] = _CGROUP_MEMORY) -> float:
    """The memory this machine's processes may use: its physical RAM (``os.sysconf``), or its cgroup's limit where
    that is lower (a container's)."""
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in cgroup_files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < ram:
            return float(int(text))
    return ram


def machine_load() -> float | None:
    """Runnable threads on this machine, averaged over the last minute (``os.getloadavg``), or None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy(load: float | None, cpus: int | None = None) -> bool:
    """Whether a machine with ``load`` (`machine_load`) leaves no core free for one more thread: a single-thread
    benchmark run then shares its core and reads slow. On this 2-vCPU VM, beside a 3-process cross-validation
    (load ~5), the linear benchmark read 55 GFLOP/s; quiet, 121-132, an hour later."""
    return load is not None and load > (cpus or _cpus()) - 0.5


def _load_during(before: float | None, seconds: float) -> float | None:
    """The machine's load while this process measured for ``seconds`` (one thread of its own throughout):
    the larger of the load before and after, less what its own thread added to the 1-minute average after
    (Linux damps it with a 60 s time constant), so that work that started meanwhile counts too."""
    after = machine_load()
    if after is not None:
        after -= 1.0 - math.exp(-seconds / 60.0)
    known = [x for x in (before, after) if x is not None]
    return max(known) if known else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time (an exclusive ``flock`` on ``path``, where the platform has it): processes that start
    together would otherwise all measure at once and share the cores they measure."""
    try:
        import fcntl
    except ImportError:  # (no flock: measure unlocked)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached_cpu_device(path: Path) -> DeviceSpec | None:
    """The cached device at ``path``, or None when there is none, it was measured by another version of the
    measurement, or it was measured while the machine was `busy` and the machine is quiet now."""
    import json

    if not path.exists():
        return None
    d = json.loads(path.read_text())
    if d.pop("version", 1) != _CPU_MEASURE_VERSION or (busy(d.pop("load", None)) and not busy(machine_load())):
        return None
    curve = EfficiencyCurve(**d.pop("matmul_eff"))
    d["op_overhead_s"] = tuple(d["op_overhead_s"])
    d["dtensor_overhead_s"] = {k: tuple(v) for k, v in d["dtensor_overhead_s"].items()}
    d["dtensor_byte_s"] = {k: tuple(v) for k, v in d["dtensor_byte_s"].items()}
    d["fsdp_overhead_s"] = {k: tuple(v) for k, v in d["fsdp_overhead_s"].items()}
    # (the memory a container may use now, which can differ from when it was measured)
    d["memory_bytes"] = min(d["memory_bytes"], host_memory_bytes())
    d["host_memory"] = d.get("host_memory", True)
    return DeviceSpec(**d, matmul_eff=curve, overlap_slowdown=CPU_OVERLAP_SLOWDOWN)


def _write_cached(path: Path, dev: DeviceSpec, load: float | None) -> None:
    """`_cached_cpu_device`'s file: ``dev`` and the machine's ``load`` while it was measured, written whole (each
    process to a file of its own first, then renamed over ``path``)."""
    import json

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": _CPU_MEASURE_VERSION, "load": load, "name": dev.name,
                               "peak_flops": dict(dev.peak_flops), "memory_bytes": dev.memory_bytes,
                               "host_memory": dev.host_memory,
                               "hbm_bw": dev.hbm_bw, "memory_eff": dev.memory_eff,
                               "attention_eff": dev.attention_eff, "op_overhead_s": list(dev.op_overhead_s),
                               "dtensor_overhead_s": {k: list(v) for k, v in dev.dtensor_overhead_s.items()},
                               "dtensor_byte_s": {k: list(v) for k, v in dev.dtensor_byte_s.items()},
                               "fsdp_overhead_s": {k: list(v) for k, v in dev.fsdp_overhead_s.items()},
                               "fsdp_copy_bw": dev.fsdp_copy_bw, "source": dev.source,
                               "matmul_eff": {"e_max": dev.matmul_eff.e_max, "f_half": dev.matmul_eff.f_half,
                                              "source": dev.matmul_eff.source}}))
    tmp.replace(path)


@functools.lru_cache(maxsize=1)
def measure_cpu_device() -> DeviceSpec:
    """This machine's CPU as a device, measured once per machine and cached on disk (``$AUTOPAR_CACHE/devices``),
    so every process plans with the same figures; delete the file to measure again. One process measures at a
    time; the others wait and read what it wrote. A measurement made while the machine was `busy` (before or
    during it) is kept, so that busy processes share it, until a process finds the machine quiet and measures
    again."""
    path = cpu_cache_file()
    dev = _cached_cpu_device(path)
    if dev is not None:
        return dev
    with _locked(path.with_name(f".{path.name}.lock")):
        dev = _cached_cpu_device(path)  # (measured by the process this one waited for)
        if dev is not None:
            return dev
        before, t0 = machine_load(), time.perf_counter()
        dev = _measure_cpu_device()
        load = _load_during(before, time.perf_counter() - t0)
        if busy(load):
            dev = replace(dev, source=f"{dev.source}; measured while the machine was busy (load {load:.1f} on "
                                      f"{_cpus()} CPUs): measured again once it is quiet")
        _write_cached(path, dev, load)
    return dev


def _median_seconds(fn: Callable[[], object], *, budget: float = 0.04, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``fn`` over a batch of calls lasting about ``budget`` seconds,
    after one warm-up call: the sustained rate, not the best moment (on this 2-vCPU VM the best of five single
    1024³ matmuls read 92 GFLOP/s in one session and 66-72 in the next, whose sustained median was ~65)."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(budget / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    times.sort()
    return times[len(times) // 2]


def linear_rate(n: int, budget: float = 0.04) -> float:
    """FLOP/s of a linear layer's forward and backward on n×n (x·Wᵀ, then dY·W and dYᵀ·x: 3·2n³ FLOPs) in this
    thread, `_median_seconds` of it: the cpu device's peak and matmul-curve benchmark."""
    import torch
    import torch.nn.functional as F

    x, w = torch.randn(n, n, requires_grad=True), torch.randn(n, n, requires_grad=True)
    return 3 * 2.0 * n**3 / _median_seconds(lambda: F.linear(x, w).sum().backward(), budget=budget)


def cpu_peak_now() -> float:
    """The cpu device's peak benchmark run now (`linear_rate`'s median over n = 256, 512, 1024, one thread, as
    `_measure_cpu_device` takes it), in FLOP/s: what the cached figure can be compared with when this machine's
    speed drifts (this 2-vCPU VM's moved 20-40 % within minutes, and 2× between days)."""
    import statistics

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return statistics.median(linear_rate(n, budget=0.1) for n in (256, 512, 1024))
    finally:
        torch.set_num_threads(threads)


def is_measured_cpu(device: DeviceSpec) -> bool:
    """Whether ``device`` is this machine's CPU as `measure_cpu_device` gives it to this process (what
    ``cpu-local`` holds; a recalibrated cluster file's figures are not)."""
    return device.name == "cpu" and device == measure_cpu_device()


def _measure_cpu_device() -> DeviceSpec:
    """Measure this machine's CPU as a device: one thread, as the ``cpu-local`` gloo ranks run. Every figure is the
    median rate of a training-shaped microbenchmark (`_median_seconds`), each named for the cost model's term:

    - peak fp32 and the matmul curve: a linear layer's forward and backward (x·Wᵀ, then dY·W and dYᵀ·x: the three
      GEMMs of training, 3·2n³ FLOPs) on n×n at n = 32…1024; peak = the median rate of n = 256, 512, 1024 (the
      plateau; the fastest single size read 64-84 GFLOP/s minutes apart), and f_half the least-squares fit of
      ``eff(f) = f/(f + f_half)`` (e_max 1) to every size's rate over the peak (at most 1), f = 2n³;
    - hbm_bw: a 64 MiB copy (read + write);
    - memory_eff: a forward of 16 elementwise links (x·c, + x, SiLU) on 1 MiB tensors, autograd recording and
      every output kept for the backward as a training step's forward keeps them (~13 GB/s here; ~20-40 GB/s
      without autograd or when each output is freed at once), bytes as the profiler counts them (inputs + output),
      the per-op overhead below taken out, over hbm_bw, at most 1;
    - attention_eff: causal scaled-dot-product attention forward and backward (8 heads of 64, sequence 256, as
      torch's counter counts it: 3·4·h·s²·d) over the peak at that size's matmul efficiency, at most 1;
    - op_overhead_s: a chain of tiny ops (mul, add, transpose, matmul, SiLU on 4×4 tensors, autograd on), the
      forward's and the backward's time per op: what a step pays per op besides its arithmetic;
    - dtensor_overhead_s, dtensor_byte_s: what DTensor adds per tensor-parallel linear and per sequence-parallel
      norm, per op and per byte of its data (`_measure_dtensor_overhead`, a process of its own);
    - fsdp_overhead_s, fsdp_copy_bw: what FSDP2 adds per group and per parameter tensor to each all-gather and
      reduce-scatter, and the rate of its copies (`_measure_fsdp_overhead`, a process of its own).

    Memory = physical RAM, or the container's cgroup limit where lower (`host_memory_bytes`), which the ranks on
    the machine share (``host_memory``). ~30 s, once per machine.
    """
    import numpy as np
    import torch  # local: importing the catalog must not import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {}
        for n in (32, 64, 128, 256, 512, 1024):
            rates[n] = linear_rate(n)
        peak = float(np.median([rates[n] for n in (256, 512, 1024)]))  # the plateau: robust to one lucky size
        f = np.array([2.0 * n**3 for n in rates])
        e = np.array([min(r / peak, 0.999) for r in rates.values()])
        # eff = f/(f + h) ⇔ f·(1/eff − 1) = h: least squares of relative error over the sizes, in closed form
        h_each = f * (1.0 / e - 1.0)
        f_half = float(max(np.sum(h_each / f**2) / np.sum(1.0 / f**2), 1.0))

        src = torch.empty(16 * 2**20, dtype=torch.float32)  # 64 MiB
        dst = torch.empty_like(src)
        mem_bw = 2.0 * src.numel() * src.element_size() / _median_seconds(lambda: dst.copy_(src), budget=0.1)

        h, s, d_head = 8, 256, 64
        q, k, v = (torch.randn(1, h, s, d_head, requires_grad=True) for _ in range(3))
        attn_flops = 3 * 4.0 * h * s * s * d_head
        t_attn = _median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
        curve = EfficiencyCurve(e_max=1.0, f_half=f_half, source=(
            f"fitted on this machine: linear forward + backward at n = {', '.join(map(str, rates))}, "
            f"{time.strftime('%Y-%m-%d')}"))
        attention_eff = min(1.0, attn_flops / t_attn / (peak * curve(4.0 * h * s * s * d_head)))

        tiny = torch.randn(4, 4, requires_grad=True)
        m4 = torch.randn(4, 4)
        per_op = 5  # ops per link of the chain below
        links = 200
        fwd, bwd = [], []
        for _ in range(10):  # (the first is a warm-up)
            t0 = time.perf_counter()
            y = tiny
            for _ in range(links):
                y = F.silu((y * 1.0001 + y).t() @ m4)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            fwd.append((t1 - t0) / (links * per_op))
            bwd.append((t2 - t1) / (links * per_op))
        overhead = (sorted(fwd[1:])[4], sorted(bwd[1:])[4])

        x = torch.randn(2**18, requires_grad=True)  # 1 MiB
        links = 16

        def forward_chain():  # each link: x·c (2 MiB read + written), + x (3), SiLU (2); all kept for the backward
            y = x
            for _ in range(links):
                y = F.silu(y * 1.0001 + y)
            return y

        t_chain = _median_seconds(forward_chain) - 3 * links * overhead[0]
        memory_eff = min(1.0, 7 * links * x.numel() * 4 / max(t_chain, 1e-9) / mem_bw)
    finally:
        torch.set_num_threads(threads)

    dtensor, dtensor_byte, probe = _measure_dtensor_overhead()
    fsdp, copy_bw, fsdp_probe = _measure_fsdp_overhead()
    ram = host_memory_bytes()
    return DeviceSpec(
        name="cpu",
        peak_flops={"fp32": peak},
        memory_bytes=ram,
        hbm_bw=mem_bw,
        matmul_eff=curve,
        memory_eff=memory_eff,
        attention_eff=attention_eff,
        op_overhead_s=overhead,
        dtensor_overhead_s=dtensor,
        dtensor_byte_s=dtensor_byte,
        fsdp_overhead_s=fsdp,
        fsdp_copy_bw=copy_bw,
        overlap_slowdown=CPU_OVERLAP_SLOWDOWN,
        host_memory=True,
        source=f"measured on this machine, 1 thread, torch {torch.__version__}, {time.strftime('%Y-%m-%d')} "
               f"(`costmodel.hardware._measure_cpu_device`); {probe}; {fsdp_probe}",
    )


def _measure_dtensor_overhead() -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]], str]:
    """DTensor's time per tensor-parallel op and per byte of its data (`costmodel.dtensor_probe`), measured in a
    process of its own: it needs a process group, which the planner's process must not get. (per op, per byte,
    what the device's source says of them); a probe that cannot run leaves them 0 and says why."""
    byte_keys = tuple(f"{op}_byte" for op in DTENSOR_OPS)
    figures, says = _probe("costmodel.dtensor_probe", DTENSOR_OPS + byte_keys, "DTensor overhead",
                           "DTensor overhead per tensor-parallel op and per byte of its data: "
                           "`costmodel.dtensor_probe`, a 2-rank fake process group")
    per_byte = {op: figures.pop(f"{op}_byte") for op in DTENSOR_OPS if f"{op}_byte" in figures}
    return figures, per_byte, says


def _measure_fsdp_overhead() -> tuple[dict[str, tuple[float, float]], float, str]:
    """FSDP2's host time per group and parameter tensor of each all-gather and reduce-scatter, and the rate of its
    copies (`costmodel.fsdp_probe`), in a process of its own for the same reason: (figures, bytes/s, what the
    source says); ({}, 0, why) where it cannot run."""
    figures, says = _probe("costmodel.fsdp_probe", FSDP_EVENTS + ("copy_bw",), "FSDP2 overhead",
                           "FSDP2 overhead per group and tensor and its copies' rate: `costmodel.fsdp_probe`, a 2-rank "
                           "fake process group")
    copy_bw = figures.pop("copy_bw", 0.0)
    return figures, copy_bw, says


def _probe(module: str, keys: tuple[str, ...], what: str, says: str) -> tuple[dict[str, tuple[float, float]], str]:
    """Run ``python -m module`` (one thread, outside any torchrun world) and read each of ``keys`` (a pair, or a
    number) from the JSON of its last line: (figures, ``says``), or ({}, why it could not run)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", module]
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"  # (not a torchrun rank: planning inside one must not make the probe join its world)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        out = {k: (float(figures[k][0]), float(figures[k][1])) if isinstance(figures[k], list) else float(figures[k])
               for k in keys}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as exc:
        err = getattr(exc, "stderr", None) or str(exc)
        return {}, f"{what} not measured ({err.strip().splitlines()[-1] if err.strip() else exc!r})"
    return out, says


#: The device catalog. GPU entries are constants; ``cpu`` is measured on first lookup. Memory is what torch can
#: allocate on the card (``torch.cuda.get_device_properties(d).total_memory``, printed as the "total capacity" of
#: its out-of-memory errors), less than the marketed size: the driver keeps the rest. Read from public OOM reports:
#: A100-SXM4-80GB 79.25 GiB (levihsu/OOTDiffusion#235, wbfwonderful/Vad-R1#11), A100 40GB 39.50 GiB
#: (TianheWu/CoSeR#10), H100 80GB HBM3 79.11 GiB (a vLLM report on 8×H100 nodes), H200 139.80 GiB (reports on 8×H200
#: nodes); nvidia-smi shows a little more (81559 MiB on the H100, modal-labs/modal-client#2797).
DEVICES: Mapping[str, DeviceSpec] = LazyCatalog({
    "a100-40g": lambda: _gpu("a100-40g", _A100_PEAKS, 39.50 * GiB, 1.555e12,
                             "memory 40 GB card, 39.50 GiB to torch; HBM2 1555 GB/s"),
    "a100-80g": lambda: _gpu("a100-80g", _A100_PEAKS, 79.25 * GiB, 2.039e12,
                             "memory 80 GB card, 79.25 GiB to torch; HBM2e 2039 GB/s"),
    "h100-sxm": lambda: _gpu("h100-sxm", _H100_PEAKS, 79.11 * GiB, 3.35e12,
                             "memory 80 GB card, 79.11 GiB to torch; HBM3 3.35 TB/s"),
    # H100 96 GB HBM2e (Meta's Grand Teton, torchtitan's published runs): GH100 compute at a 500 W power limit, the
    # SXM peaks (torchtitan states its MFU against them); torch's share of the 96 GB not published: the H100 80 GB
    # card's ratio (79.11 GiB of 80 GB)
    "h100-hbm2e": lambda: _gpu("h100-hbm2e", _H100_PEAKS, 96e9 * 79.11 * GiB / 80e9, 2.4e12,
                               "memory 96 GB HBM2e card at 500 W (Grand Teton); HBM2e 2.4 TB/s"),
    # H200: same GH100 compute as H100 SXM; the 141 GB card gives torch 139.80 GiB
    "h200": lambda: _gpu("h200", _H100_PEAKS, 139.80 * GiB, 4.8e12,
                         "memory 141 GB card, 139.80 GiB to torch; HBM3e 4.8 TB/s"),
    "cpu": measure_cpu_device,
})


def get_device(name: str) -> DeviceSpec:
    """Catalog lookup with an error that lists the known names."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return DEVICES[name]
