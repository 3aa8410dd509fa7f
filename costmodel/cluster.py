"""Where a plan runs: devices, links, clusters, presets, YAML loading, and where a communication group's ranks sit.

SI units inside (bytes/s, seconds, bytes). Units appear only in YAML key names (``bw_GBps`` = 1e9 bytes/s,
``latency_us``, ``memory_GiB`` = 2**30 bytes, ``peak_tflops`` = 1e12 FLOP/s); conversion happens here, once.

Link bandwidths are NCCL-tests *bus bandwidths* per GPU and direction for a large ring collective
(NVIDIA/nccl-tests ``doc/PERFORMANCE.md``), so that ``costmodel.collectives`` can use them directly in
``time = (bus factor)·bytes / busbw``. Presets cite the published figures in shared/calibration/README.md §5.2.

Rank placement (``group_span``): ranks are laid out with the mesh order pp (outermost), dp, cp, tp (innermost),
and node = rank // gpus_per_node. So a tp group has stride 1, a cp group stride tp, a dp group stride tp·cp and a
pp group stride dp·cp·tp.
"""

from __future__ import annotations

import decimal
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from costmodel.hardware import (
    DEVICES,
    DTENSOR_OPS,
    DTYPES,
    FSDP_EVENTS,
    GPU_MATMUL_PRIOR,
    GPU_MEMORY_EFF_PRIOR,
    DeviceSpec,
    EfficiencyCurve,
    LazyCatalog,
)

__all__ = [
    "CLUSTER_PRESETS",
    "COLLECTIVE_KINDS",
    "CPU_LOCAL_FILE",
    "Cluster",
    "GroupSpan",
    "Link",
    "SizeCurve",
    "dump_cluster",
    "group_span",
    "list_clusters",
    "load_cluster",
    "parse_cluster_yaml",
]

#: Collective kinds a link may carry per-kind figures for (the values of ``costmodel.collectives.Collective``).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")

#: Where ``python -m costmodel.gloo_bench`` writes the fitted loopback link of the ``cpu-local`` cluster.
CPU_LOCAL_FILE = Path(__file__).parent / "data" / "cpu_local.yaml"

GB = 1e9
GiB = 2**30
KiB = 2**10
US = 1e-6


def _round12(x: float) -> float:
    """12 significant digits, so unit conversions at the YAML edge round-trip exactly."""
    return float(f"{x:.12g}")


@dataclass(frozen=True, kw_only=True)
class SizeCurve:
    """A link's bus bandwidth as a curve over message size: ``B(S) = bandwidth · factor(S)``.

    Only the gloo loopback fit has one (``costmodel.gloo_bench`` says why and how it is measured): there the time per
    byte steps up 1.5-3× as buffers outgrow the L2 and L3 caches, at sizes that differ by collective. GPU links have
    none (NCCL-tests busbw is flat at the sizes the presets describe). ``factors`` are measured at ``sizes`` (bytes,
    in the collective's own ``nbytes`` convention); between two sizes the time per byte (``1/factor``) is
    interpolated linearly in log2(size), outside them the end values hold. Only the bandwidth term is scaled.
    """

    #: message sizes of the knots, bytes, strictly increasing.
    sizes: tuple[float, ...]
    #: bandwidth multiplier at each size (> 0).
    factors: tuple[float, ...]

    def __post_init__(self) -> None:
        sizes, factors = tuple(float(x) for x in self.sizes), tuple(float(x) for x in self.factors)
        if not sizes or len(sizes) != len(factors):
            raise ValueError(f"SizeCurve needs as many factors as sizes (at least one), got {len(sizes)} sizes "
                             f"and {len(factors)} factors")
        if any(not x > 0 for x in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"SizeCurve sizes must be > 0 bytes and strictly increasing, got {sizes}")
        if any(not f > 0 for f in factors):
            raise ValueError(f"SizeCurve factors must be > 0, got {factors}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "factors", factors)

    def factor(self, nbytes: float) -> float:
        """The bandwidth multiplier for a message of ``nbytes`` (see the class docstring)."""
        sizes, factors = self.sizes, self.factors
        if nbytes <= sizes[0]:
            return factors[0]
        if nbytes >= sizes[-1]:
            return factors[-1]
        hi = next(i for i, x in enumerate(sizes) if x >= nbytes)
        lo = hi - 1
        w = (math.log2(nbytes) - math.log2(sizes[lo])) / (math.log2(sizes[hi]) - math.log2(sizes[lo]))
        return 1.0 / ((1 - w) / factors[lo] + w / factors[hi])

    @property
    def fastest(self) -> float:
        """The largest factor: ``bandwidth · fastest`` bounds the curve from above at every size."""
        return max(self.factors)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A network between ranks: bus bandwidth per GPU and direction, and a per-step latency.

    ``bandwidth`` is what NCCL-tests reports as busbw for a large ring all-reduce on this link, per GPU
    (so 8 GPUs × 1 NIC each at 24 GB/s effective gives an inter-node ring busbw of 8·24 = 192 GB/s, nccl#812).
    Some transports are far from uniform across collectives (gloo on loopback: all-gather moves bytes ~2-3×
    slower than all-reduce, FINDINGS.md), so a link may override both figures per collective kind, and give a
    kind's bandwidth as a curve over message size (:class:`SizeCurve`).
    """

    #: what the link is, e.g. "NVLink3 + NVSwitch".
    name: str
    #: bus bandwidth per GPU and direction, bytes/s (NCCL-tests busbw convention).
    bandwidth: float
    #: latency of one algorithm step (one ring hop), seconds.
    latency: float
    #: where the figures come from (issue, measurement, fit).
    source: str = ""
    #: collective kind (``COLLECTIVE_KINDS``) → bus bandwidth, bytes/s, overriding ``bandwidth`` for that kind.
    bandwidth_by_kind: Mapping[str, float] = field(default_factory=dict)
    #: collective kind → per-step latency, seconds, overriding ``latency`` for that kind.
    latency_by_kind: Mapping[str, float] = field(default_factory=dict)
    #: collective kind → bandwidth curve over message size (see :class:`SizeCurve`); none by default.
    curve_by_kind: Mapping[str, SizeCurve] = field(default_factory=dict)
    #: seconds each call pays once, beyond its ring steps, when the calling rank has been computing (not waiting in
    #: lock step with its peers): the wake-up of blocked threads on a link whose transport runs on the ranks' own
    #: cores (gloo on a VM's vCPUs: ~0.8-3 ms per call, `costmodel.gloo_bench`). 0: none (NCCL's figures are
    #: measured back to back, as training issues them).
    call_latency: float = 0.0
    #: collective kind → ``call_latency`` for that kind.
    call_latency_by_kind: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 s, got {self.latency!r}")
        if not self.call_latency >= 0:
            raise ValueError(f"link {self.name!r}: call_latency must be >= 0 s, got {self.call_latency!r}")
        for label, table, ok in (("bandwidth_by_kind", self.bandwidth_by_kind, lambda v: v > 0),
                                 ("latency_by_kind", self.latency_by_kind, lambda v: v >= 0),
                                 ("curve_by_kind", self.curve_by_kind, lambda v: isinstance(v, SizeCurve)),
                                 ("call_latency_by_kind", self.call_latency_by_kind, lambda v: v >= 0)):
            for kind, value in table.items():
                if kind not in COLLECTIVE_KINDS:
                    raise ValueError(f"link {self.name!r}: {label} has unknown collective {kind!r}; "
                                     f"known: {COLLECTIVE_KINDS}")
                if not ok(value):
                    raise ValueError(f"link {self.name!r}: {label}[{kind!r}] out of range: {value!r}")
            object.__setattr__(self, label, MappingProxyType(dict(table)))

    def __hash__(self) -> int:
        return hash((self.name, self.bandwidth, self.latency, self.source,
                     tuple(sorted(self.bandwidth_by_kind.items())), tuple(sorted(self.latency_by_kind.items())),
                     tuple(sorted(self.curve_by_kind.items())), self.call_latency,
                     tuple(sorted(self.call_latency_by_kind.items()))))

    def bandwidth_for(self, kind: str) -> float:
        """Bus bandwidth (bytes/s) for collective ``kind``: its override if there is one, else ``bandwidth``."""
        return self.bandwidth_by_kind.get(kind, self.bandwidth)

    def latency_for(self, kind: str) -> float:
        """Per-step latency (s) for collective ``kind``: its override if there is one, else ``latency``."""
        return self.latency_by_kind.get(kind, self.latency)

    def call_latency_for(self, kind: str) -> float:
        """Seconds per call (s) for collective ``kind``: its override if there is one, else ``call_latency``."""
        return self.call_latency_by_kind.get(kind, self.call_latency)

    def curve_for(self, kind: str) -> SizeCurve | None:
        """The bandwidth curve over message size for collective ``kind``, if the link has one."""
        return self.curve_by_kind.get(kind)

    def without_curves(self) -> Link:
        """This link with every size curve replaced by its fastest factor: no collective is slower on it.

        Its times are affine in the message size, which the search's convexity (Jensen) bounds need.
        """
        if not self.curve_by_kind:
            return self
        bandwidths = {k: self.bandwidth_for(k) * c.fastest for k, c in self.curve_by_kind.items()}
        return replace(self, bandwidth_by_kind={**self.bandwidth_by_kind, **bandwidths}, curve_by_kind={},
                       source=f"{self.source} (size curves at their fastest)")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` nodes of ``gpus_per_node`` identical devices."""

    #: name shown in plans and reports (preset name or the YAML ``name``).
    name: str
    #: the device every rank runs on.
    device: DeviceSpec
    #: ranks per node (GPUs, or gloo processes for ``cpu-local``).
    gpus_per_node: int
    #: number of nodes.
    nodes: int
    #: link between ranks of one node (NVLink/NVSwitch; loopback for cpu-local).
    intra: Link
    #: link between nodes, per GPU (one NIC per GPU on DGX; a shared NIC is its bandwidth / gpus_per_node).
    inter: Link
    #: the share of the device's memory a plan may fill (`plan --memory-fraction`), its predicted peak with the
    #: allocator and runtime allowance (`costmodel.memory.allowance`: fragmentation, the CUDA context, NCCL's
    #: buffers per communicator and pipeline peer) included. The rest is headroom for what the memory model leaves
    #: out: NCCL channel counts above the measured ones (Hopper, all-to-all), other libraries' workspaces, and
    #: allocator behaviour across steps. 0.90 is a margin, not a fit: NVIDIA's and PyTorch's documentation give no
    #: single figure; frameworks that reserve memory up front use similar fractions (vLLM's default
    #: gpu_memory_utilization is 0.9).
    memory_fraction: float = 0.90
    #: the software stack whose efficiency constants the device carries (`costmodel.stacks`; a preset's
    #: ``stack=NAME`` option; a cluster file's optional ``stack``, which says where its own constants came from).
    stack: str | None = None
    #: mixture of experts: the busiest expert's tokens over the balanced share (tokens·top_k/experts), which sets
    #: the expert GEMMs' time (`costmodel.moe`). 1.0, the balanced case, is what published Megatron-Bridge MoE runs
    #: measure (they force balanced routing, shared/calibration/README.md §6); state your routing's measured value
    #: in a cluster file (``moe_imbalance``) to plan for it.
    moe_imbalance: float = 1.0

    def __post_init__(self) -> None:
        for label, value in (("gpus_per_node", self.gpus_per_node), ("nodes", self.nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {self.name!r}: {label} must be an integer >= 1, got {value!r}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"cluster {self.name!r}: memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if not self.moe_imbalance >= 1.0:
            raise ValueError(f"cluster {self.name!r}: moe_imbalance must be ≥ 1 (the busiest expert over the "
                             f"balanced load), got {self.moe_imbalance!r}")

    @property
    def memory_per_rank_bytes(self) -> float:
        """The memory one rank has: its device's, or its share of the host's where the ranks of a node share it (a
        CPU's, ``DeviceSpec.host_memory``)."""
        return self.device.memory_bytes / (self.gpus_per_node if self.device.host_memory else 1)

    @property
    def memory_budget_bytes(self) -> float:
        """What a plan's peak may reach on one rank: ``memory_fraction`` of its memory (`memory_per_rank_bytes`)."""
        return self.memory_fraction * self.memory_per_rank_bytes

    def without_curves(self) -> Cluster:
        """This cluster with both links' size curves at their fastest (:meth:`Link.without_curves`)."""
        return replace(self, intra=self.intra.without_curves(), inter=self.inter.without_curves())

    @property
    def world_size(self) -> int:
        """Total number of ranks, ``gpus_per_node · nodes``."""
        return self.gpus_per_node * self.nodes


# --- Rank placement ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GroupSpan:
    """How a communication group sits on the cluster's nodes."""

    #: ranks in the group.
    size: int
    #: distinct nodes the group's ranks are on.
    nodes: int
    #: most group ranks on any one node (all nodes hold the same number when the layout is regular).
    per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"GroupSpan needs size, nodes, per_node >= 1, got {self.size}, {self.nodes}, "
                             f"{self.per_node}")
        if self.nodes > self.size or self.per_node > self.size or self.nodes * self.per_node < self.size:
            raise ValueError(f"GroupSpan(size={self.size}, nodes={self.nodes}, per_node={self.per_node}) is "
                             f"impossible: need nodes <= size, per_node <= size, nodes·per_node >= size")

    @property
    def crosses_nodes(self) -> bool:
        """True when the group's ranks are on more than one node."""
        return self.nodes > 1


def group_span(cluster: Cluster, size: int, stride: int) -> GroupSpan:
    """Nodes spanned by the group {0, stride, 2·stride, …, (size−1)·stride} and its ranks per node.

    Ranks follow the mesh order pp (outermost), dp, cp, tp (innermost); node = rank // gpus_per_node. Use
    stride 1 for tp, tp for cp, tp·cp for dp, dp·cp·tp for pp. Every group of a regular mesh (sizes and strides
    dividing or multiplying gpus_per_node) has the same span as the one at rank 0, which is the one computed.
    """
    if size < 1 or stride < 1:
        raise ValueError(f"group size and stride must be >= 1, got size={size}, stride={stride}")
    last = (size - 1) * stride
    if last >= cluster.world_size:
        raise ValueError(f"a group of {size} ranks with stride {stride} needs rank {last}, but cluster "
                         f"{cluster.name!r} has {cluster.world_size} ranks ({cluster.nodes} nodes × "
                         f"{cluster.gpus_per_node})")
    counts: dict[int, int] = {}
    for i in range(size):
        node = i * stride // cluster.gpus_per_node
        counts[node] = counts.get(node, 0) + 1
    return GroupSpan(size=size, nodes=len(counts), per_node=max(counts.values()))


# --- Presets -----------------------------------------------------------------------------------------------------


def _link(name: str, bw_GBps: float, latency_us: float, source: str) -> Link:
    return Link(name=name, bandwidth=bw_GBps * GB, latency=latency_us * US, source=source)


# NVLink per-hop latency: NCCL src/graph/tuning.cc hwLat[NVLINK][RING][SIMPLE] = 3.4 µs.
# InfiniBand per-hop latency: 8 µs, a prior inside the 5-10 µs usually seen for NCCL over IB (unfitted).
_NVLINK_A100 = _link("NVLink3 + NVSwitch", 230, 3.4,
                     "busbw ~230 GB/s all_reduce 8×A100 (sjeaugey, NVIDIA/nccl-tests#149; 232.5 in #175); "
                     "latency: NCCL tuning.cc NVLink ring/simple hop")
_NVLINK_H100 = _link("NVLink4 + NVSwitch", 370, 3.4,
                     "busbw ~370 GB/s ring, 8×H100 (sjeaugey, nccl-tests#212, nccl#1442); NVLS all_reduce "
                     "(~480) not used: ring is what every other collective gets; latency: NCCL tuning.cc")
_IB_HDR = _link("HDR InfiniBand 200 Gb/s, one NIC per GPU", 24, 8,
                "25 GB/s line, ~24 GB/s effective per NIC: 192 GB/s all_reduce busbw with 8 NICs "
                "(AddyLaddy, NVIDIA/nccl#812), 24 GB/s with one NIC (sjeaugey, nccl#412); latency prior")
_IB_NDR = _link("NDR InfiniBand 400 Gb/s (ConnectX-7), one NIC per GPU", 48, 8,
                "46-48 GB/s per NIC (AddyLaddy, NVIDIA/nccl-tests#290, #267); latency prior")


def _dgx(name: str, device: str, intra: Link, inter: Link) -> Cluster:
    return Cluster(name=name, device=DEVICES[device], gpus_per_node=8, nodes=1, intra=intra, inter=inter)


#: FINDINGS.md figures for gloo on loopback, 2 ranks, used when costmodel/data/cpu_local.yaml is absent.
#: Read as t = α + S/β at 2 ranks, i.e. per-step latency α/2 for all_reduce (2 steps), α for the others (1 step).
_CPU_LOCAL_FALLBACK = Link(
    name="gloo over loopback (fallback)", bandwidth=1.5 * GB, latency=0.5e-3,
    source="FINDINGS.md gloo loopback figures (±50 % run to run); run python -m costmodel.gloo_bench to fit",
    bandwidth_by_kind={"all_reduce": 1.5 * GB, "all_gather": 0.6 * GB, "send_recv": 3.0 * GB},
    latency_by_kind={"all_reduce": 0.5e-3, "all_gather": 1.0e-3, "send_recv": 1.0e-3},
)


def _cpu_local_link() -> Link:
    """The fitted loopback link from ``CPU_LOCAL_FILE`` (its ``intra`` section), or the FINDINGS.md fallback."""
    if not CPU_LOCAL_FILE.exists():
        return _CPU_LOCAL_FALLBACK
    data = yaml.safe_load(CPU_LOCAL_FILE.read_text())
    ctx = _Ctx(str(CPU_LOCAL_FILE))
    return _parse_link(ctx, "intra", _get(ctx, data, "intra", dict), default_name="gloo over loopback")


def _cpu_local() -> Cluster:
    link = _cpu_local_link()
    return Cluster(name="cpu-local", device=DEVICES["cpu"], gpus_per_node=2, nodes=1, intra=link, inter=link)


_PRESET_DESCRIPTIONS = {
    "dgx-a100-80g": "DGX A100 80GB: 8× A100-SXM4-80GB per node, NVLink3 230 GB/s busbw, 8× HDR 200 Gb/s IB",
    "dgx-a100-40g": "DGX A100 40GB: 8× A100-SXM4-40GB per node, NVLink3 230 GB/s busbw, 8× HDR 200 Gb/s IB",
    "dgx-h100": "DGX H100: 8× H100-SXM5-80GB per node, NVLink4 370 GB/s ring busbw, 8× NDR 400 Gb/s IB",
    "dgx-h200": "DGX H200: 8× H200-141GB per node, NVLink4 370 GB/s ring busbw, 8× NDR 400 Gb/s IB",
    "grand-teton": "Meta Grand Teton (torchtitan's published runs): 8× H100 96GB HBM2e at 500 W per node, NVLink "
                   "(the DGX H100 figures), 400 Gb/s RDMA per GPU (the NDR figures)",
    "cpu-local": "this machine: 2 gloo ranks (1 thread each) on loopback, fitted by python -m costmodel.gloo_bench",
}

#: Cluster presets (one node each; ``load_cluster("NAME:nodes=N")`` scales them). Built on first lookup.
CLUSTER_PRESETS: Mapping[str, Cluster] = LazyCatalog({
    "dgx-a100-80g": lambda: _dgx("dgx-a100-80g", "a100-80g", _NVLINK_A100, _IB_HDR),
    "dgx-a100-40g": lambda: _dgx("dgx-a100-40g", "a100-40g", _NVLINK_A100, _IB_HDR),
    "dgx-h100": lambda: _dgx("dgx-h100", "h100-sxm", _NVLINK_H100, _IB_NDR),
    "dgx-h200": lambda: _dgx("dgx-h200", "h200", _NVLINK_H100, _IB_NDR),
    "grand-teton": lambda: _dgx("grand-teton", "h100-hbm2e", _NVLINK_H100, _IB_NDR),
    "cpu-local": _cpu_local,
})


def list_clusters() -> list[tuple[str, str]]:
    """(name, description) of every preset, for ``autopar clusters``."""
    return [(name, _PRESET_DESCRIPTIONS[name]) for name in CLUSTER_PRESETS]


# --- Loading -----------------------------------------------------------------------------------------------------

_PRESET_OPTIONS = ("nodes", "gpus_per_node", "stack")


def load_cluster(spec: str) -> Cluster:
    """A cluster from ``PRESET[:nodes=N][:gpus_per_node=N]`` or a YAML file path (optionally with the same options).

    Options may be separated by ``:`` or ``,``. ``gpus_per_node`` is meant for ``cpu-local`` (more gloo ranks;
    note they oversubscribe a 2-core machine, which the fitted link does not model). ``stack=NAME`` (presets only)
    gives the device the efficiency constants of that software stack (`costmodel.stacks`; default
    ``torch-native``, the stack autopar emits).
    """
    from costmodel.hardware import with_stack
    from costmodel.stacks import DEFAULT_STACK, check_stack

    base, _, opts = spec.partition(":")
    overrides: dict = _parse_options(spec, opts)
    stack = overrides.pop("stack", None)
    if os.path.exists(base) or base.endswith((".yaml", ".yml")):
        if not os.path.exists(base):
            raise ValueError(f"cluster file {base!r} does not exist")
        if stack is not None:
            raise ValueError(f"cluster {spec!r}: stack= applies to presets; a cluster file's device carries its own "
                             "efficiency constants (write them with `autopar calibrate`)")
        cluster = parse_cluster_yaml(Path(base).read_text(), origin=base)
    elif base in CLUSTER_PRESETS:
        cluster = CLUSTER_PRESETS[base]
        stack = check_stack(stack or DEFAULT_STACK)
        overrides |= {"device": with_stack(cluster.device, stack), "stack": stack}
    else:
        raise ValueError(f"unknown cluster {base!r}: give a preset ({', '.join(CLUSTER_PRESETS)}) or a YAML file path")
    return replace(cluster, **overrides) if overrides else cluster


#: GPU model (a substring of torch.cuda.get_device_name, upper case) → its preset; A100s told apart by memory
_GPU_PRESETS = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80g"))


def detect_cluster(environ: Mapping[str, str] | None = None, gpu: tuple[str, int] | None = None) -> str:
    """The cluster this process runs in, as a spec for `load_cluster`: the GPU model (``gpu``: torch's device name and
    memory in bytes, read from torch when None) as its preset, nodes and GPUs per node from torchrun's environment
    (WORLD_SIZE, LOCAL_WORLD_SIZE); ``cpu-local`` with as many gloo ranks per node when there is no GPU."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; launch with torchrun")
    nodes = world // local
    if gpu is None:
        import torch

        if not torch.cuda.is_available():
            return f"cpu-local:nodes={nodes}:gpus_per_node={local}"
        gpu = (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    name, memory = gpu
    for key, preset in _GPU_PRESETS:
        if key in name.upper():
            if preset == "dgx-a100-80g" and memory < 60 * 2**30:
                preset = "dgx-a100-40g"
            return f"{preset}:nodes={nodes}:gpus_per_node={local}"
    raise ValueError(f"no cluster preset for GPU {name!r} ({', '.join(CLUSTER_PRESETS)} known); describe it in a "
                     "cluster YAML file and pass cluster='that.yaml'")


def _parse_options(spec: str, opts: str) -> dict:
    overrides: dict = {}
    for item in filter(None, opts.replace(",", ":").split(":")):
        key, eq, value = item.partition("=")
        if key not in _PRESET_OPTIONS or not eq:
            raise ValueError(f"cluster {spec!r}: unknown option {item!r}; use nodes=N, gpus_per_node=N or "
                             "stack=NAME")
        if key == "stack":
            overrides[key] = value
            continue
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"cluster {spec!r}: {key} must be an integer >= 1, got {value!r}")
        overrides[key] = int(value)
    return overrides


class _Ctx:
    """Where a YAML value came from, for error messages: ``cluster.yaml: inter.bw_GBps must be …``."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, msg: str) -> ValueError:
        return ValueError(f"{self.origin}: {msg}")


#: spoken names of unit-suffixed keys, so that "bandwith" suggests bw_GBps.
_SPOKEN = {"bw_GBps": "bandwidth", "latency_us": "latency", "hbm_bw_GBps": "hbm_bandwidth", "memory_GiB": "memory",
           "memory_GB": "memory_gb", "peak_tflops": "peak_flops", "f_half_gflop": "f_half"}


def _suggest(key: str, allowed: tuple[str, ...]) -> list[str]:
    names = {a.lower(): a for a in allowed} | {_SPOKEN[a]: a for a in allowed if a in _SPOKEN}
    return [names[m] for m in difflib.get_close_matches(key.lower(), list(names), n=1)]


def _check_keys(ctx: _Ctx, where: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            close = _suggest(str(key), allowed)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(allowed)})"
            raise ctx.error(f"unknown key {_join(where, str(key))!r}{hint}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _get(ctx: _Ctx, data: Mapping[str, Any], key: str, kind: type, where: str = "", default: Any = ...) -> Any:
    """``data[key]`` checked to be a ``kind`` (dict, str, int, or float = a positive number)."""
    path = _join(where, key)
    if key not in data:
        if default is ...:
            raise ctx.error(f"missing key {path!r}")
        return default
    value = data[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ctx.error(f"{path} must be a positive number, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ctx.error(f"{path} must be an integer >= 1, got {value!r}")
        return value
    if kind is dict and not isinstance(value, dict):
        raise ctx.error(f"{path} must be a mapping, got {value!r}")
    if kind is str and not (isinstance(value, str) and value):
        raise ctx.error(f"{path} must be a non-empty string, got {value!r}")
    return value


def _nonneg(ctx: _Ctx, data: Mapping[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ctx.error(f"{_join(where, key)} must be a number >= 0, got {value!r}")
    return float(value)


_LINK_KEYS = ("name", "bw_GBps", "latency_us", "call_latency_us", "source", "by_kind")


def _parse_link(ctx: _Ctx, where: str, data: Mapping[str, Any], default_name: str) -> Link:
    _check_keys(ctx, where, data, _LINK_KEYS)
    bandwidths: dict[str, float] = {}
    latencies: dict[str, float] = {}
    calls: dict[str, float] = {}
    curves: dict[str, SizeCurve] = {}
    by_kind = _get(ctx, data, "by_kind", dict, where, default={})
    _check_keys(ctx, f"{where}.by_kind", by_kind, COLLECTIVE_KINDS)
    for kind, entry in by_kind.items():
        kw = f"{where}.by_kind.{kind}"
        if not isinstance(entry, dict):
            raise ctx.error(f"{kw} must be a mapping with bw_GBps and/or latency_us, got {entry!r}")
        _check_keys(ctx, kw, entry, ("bw_GBps", "latency_us", "call_latency_us", "size_curve"))
        if "bw_GBps" in entry:
            bandwidths[kind] = _get(ctx, entry, "bw_GBps", float, kw) * GB
        if "latency_us" in entry:
            latencies[kind] = _nonneg(ctx, entry, "latency_us", kw) * US
        if "call_latency_us" in entry:
            calls[kind] = _nonneg(ctx, entry, "call_latency_us", kw) * US
        if "size_curve" in entry:
            curves[kind] = _parse_curve(ctx, f"{kw}.size_curve", _get(ctx, entry, "size_curve", dict, kw))
    return Link(
        name=_get(ctx, data, "name", str, where, default=default_name),
        bandwidth=_get(ctx, data, "bw_GBps", float, where) * GB,
        latency=_nonneg(ctx, data, "latency_us", where) * US,
        source=str(data.get("source", f"from {ctx.origin}")),
        bandwidth_by_kind=bandwidths,
        latency_by_kind=latencies,
        curve_by_kind=curves,
        call_latency=_nonneg(ctx, data, "call_latency_us", where) * US if "call_latency_us" in data else 0.0,
        call_latency_by_kind=calls,
    )


def _parse_curve(ctx: _Ctx, where: str, data: Mapping[str, Any]) -> SizeCurve:
    _check_keys(ctx, where, data, ("sizes_KiB", "factor"))
    lists = {}
    for key in ("sizes_KiB", "factor"):
        value = data.get(key)
        if (not isinstance(value, list) or not value
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in value)):
            raise ctx.error(f"{where}.{key} must be a non-empty list of positive numbers, got {value!r}")
        lists[key] = value
    try:
        return SizeCurve(sizes=tuple(x * KiB for x in lists["sizes_KiB"]), factors=tuple(lists["factor"]))
    except ValueError as exc:
        raise ctx.error(f"{where}: {exc}") from None


_DEVICE_KEYS = ("name", "host_memory", "peak_tflops", "memory_GiB", "memory_GB", "hbm_bw_GBps", "matmul_eff",
                "memory_eff", "attention_eff", "attention_seq_half", "fp8_eff", "overlap_slowdown", "op_overhead_us",
                "dtensor_overhead_us", "dtensor_us_per_MB", "fsdp_overhead_us", "fsdp_copy_GBps",
                "runtime_reserved_GiB", "source")


def _parse_device(ctx: _Ctx, value: Any) -> DeviceSpec:
    if isinstance(value, str):
        if value not in DEVICES:
            raise ctx.error(f"device {value!r} is not in the catalog ({', '.join(DEVICES)}); "
                            f"give a catalog name or a mapping")
        return DEVICES[value]
    if not isinstance(value, dict):
        raise ctx.error(f"device must be a catalog name or a mapping, got {value!r}")
    _check_keys(ctx, "device", value, _DEVICE_KEYS)
    peaks = _get(ctx, value, "peak_tflops", dict, "device")
    _check_keys(ctx, "device.peak_tflops", peaks, DTYPES)
    if not peaks:
        raise ctx.error("device.peak_tflops needs at least one dtype")
    if ("memory_GiB" in value) == ("memory_GB" in value):
        raise ctx.error("device needs exactly one of memory_GiB (2**30 bytes) or memory_GB (1e9 bytes)")
    memory = (_get(ctx, value, "memory_GiB", float, "device") * GiB if "memory_GiB" in value
              else _get(ctx, value, "memory_GB", float, "device") * GB)
    curve = GPU_MATMUL_PRIOR
    if "matmul_eff" in value:
        eff = _get(ctx, value, "matmul_eff", dict, "device")
        _check_keys(ctx, "device.matmul_eff", eff, ("e_max", "f_half_gflop", "source"))
        e_max = _get(ctx, eff, "e_max", float, "device.matmul_eff")
        if e_max > 1:
            raise ctx.error(f"device.matmul_eff.e_max must be in (0, 1], got {e_max!r}")
        curve = EfficiencyCurve(e_max=e_max, f_half=_get(ctx, eff, "f_half_gflop", float, "device.matmul_eff") * GB,
                                source=str(eff.get("source", f"from {ctx.origin}")))
    memory_eff = _get(ctx, value, "memory_eff", float, "device", default=GPU_MEMORY_EFF_PRIOR)
    effs = {key: _get(ctx, value, key, float, "device", default=1.0) for key in ("attention_eff", "fp8_eff")}
    for key, eff in (("memory_eff", memory_eff), *effs.items()):
        if eff > 1:
            raise ctx.error(f"device.{key} must be in (0, 1], got {eff!r}")
    # the sequence length at which fused attention reaches half its efficiency (0 or absent: no dependence)
    seq_half = value.get("attention_seq_half", 0.0)
    if isinstance(seq_half, bool) or not isinstance(seq_half, (int, float)) or not 0 <= seq_half < math.inf:
        raise ctx.error(f"device.attention_seq_half must be a finite number of tokens ≥ 0 (0: attention's efficiency "
                        f"does not depend on the sequence length), got {seq_half!r}")
    slowdown = value.get("overlap_slowdown", 0.0)
    if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 0 <= slowdown <= 1:
        raise ctx.error(f"device.overlap_slowdown must be a number in [0, 1], got {slowdown!r}")
    overhead = value.get("op_overhead_us", [0.0, 0.0])  # host µs per op, forward and backward (a CPU device)
    if (not isinstance(overhead, list) or len(overhead) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in overhead)):
        raise ctx.error(f"device.op_overhead_us must be [forward, backward] microseconds ≥ 0, got {overhead!r}")
    dtensor = _pairs_us(ctx, value, "dtensor_overhead_us", DTENSOR_OPS, "[forward, backward]")  # (a CPU device)
    # and per MB (1e6 bytes) of activations the op's forward reads and writes on the rank (a CPU device)
    dtensor_byte = _pairs_us(ctx, value, "dtensor_us_per_MB", DTENSOR_OPS, "[forward, backward]", per="per MB",
                             exponent=-12)
    # host µs FSDP2 adds per group and per parameter tensor of each all-gather and reduce-scatter (a CPU device)
    fsdp = _pairs_us(ctx, value, "fsdp_overhead_us", FSDP_EVENTS, "[per group, per tensor]")
    # the rate of FSDP2's copies where measured (a CPU device); absent or 0: the device's memory bandwidth
    copy_bw = value.get("fsdp_copy_GBps", 0.0)
    if isinstance(copy_bw, bool) or not isinstance(copy_bw, (int, float)) or copy_bw < 0:
        raise ctx.error(f"device.fsdp_copy_GBps must be a number ≥ 0 (0: the memory bandwidth), got {copy_bw!r}")
    # the host's memory, shared by a node's ranks (a CPU device); a file without the key: a CPU's is
    host = value.get("host_memory", str(value.get("name", "")).startswith("cpu"))
    if not isinstance(host, bool):
        raise ctx.error(f"device.host_memory must be true or false (the ranks of a node share the memory), got "
                        f"{host!r}")
    reserved = None
    if "runtime_reserved_GiB" in value:  # measured: what the CUDA context and NCCL hold outside torch's allocator
        reserved = _get(ctx, value, "runtime_reserved_GiB", float, "device")
        if reserved < 0:
            raise ctx.error(f"device.runtime_reserved_GiB must be ≥ 0, got {reserved!r}")
        reserved *= GiB
    return DeviceSpec(
        name=_get(ctx, value, "name", str, "device"),
        runtime_reserved=reserved,
        peak_flops={d: _decimal(_get(ctx, peaks, d, float, "device.peak_tflops"), 12) for d in peaks},
        memory_bytes=memory,
        hbm_bw=_get(ctx, value, "hbm_bw_GBps", float, "device") * GB,
        matmul_eff=curve,
        memory_eff=memory_eff,
        overlap_slowdown=float(slowdown),
        attention_seq_half=float(seq_half),
        op_overhead_s=(_decimal(overhead[0], -6), _decimal(overhead[1], -6)),
        dtensor_overhead_s=dtensor,
        dtensor_byte_s=dtensor_byte,
        fsdp_overhead_s=fsdp,
        fsdp_copy_bw=_decimal(copy_bw, 9),
        host_memory=host,
        source=str(value.get("source", f"from {ctx.origin}")),
        **effs,
    )


def _pairs_us(ctx: _Ctx, value: dict, key: str, names: tuple[str, ...], pair: str, *, per: str = "",
              exponent: int = -6) -> dict[str, tuple[float, float]]:
    """A device's ``key``: a mapping of some of ``names`` to a ``pair`` of microseconds (``per`` something) ≥ 0, in
    seconds (per its unit): each figure × 10**``exponent``."""
    got = value.get(key, {})
    if not isinstance(got, dict) or any(
            k not in names or not isinstance(v, list) or len(v) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in v)
            for k, v in got.items()):
        raise ctx.error(f"device.{key} must map {', '.join(names)} to {pair} microseconds{' ' + per if per else ''} "
                        f"≥ 0, got {got!r}")
    return {k: (_decimal(v[0], exponent), _decimal(v[1], exponent)) for k, v in got.items()}


def _decimal(value: float, exponent: int) -> float:
    """``value`` × 10**``exponent``, scaled in decimal, so that a dumped figure reads back as the one it was (66.9
    TFLOP/s as 66.9e12, not 66.9 × 1e12), whatever notation its repr takes (1e-05 too)."""
    return float(decimal.Decimal(repr(float(value))).scaleb(exponent))


_CLUSTER_KEYS = ("name", "device", "gpus_per_node", "nodes", "intra", "inter", "memory_fraction", "stack",
                 "moe_imbalance")


def parse_cluster_yaml(text: str, origin: str = "<string>") -> Cluster:
    """A cluster from YAML text with unit-suffixed keys; ``origin`` (the file name) prefixes every error."""
    ctx = _Ctx(origin)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ctx.error(f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ctx.error(f"a cluster file must be a mapping of {', '.join(_CLUSTER_KEYS)}, got {data!r}")
    _check_keys(ctx, "", data, _CLUSTER_KEYS)
    if "device" not in data:
        raise ctx.error("missing key 'device'")
    stack = _stack(ctx, _get(ctx, data, "stack", str, default=None))
    device = _parse_device(ctx, data["device"])
    if isinstance(data["device"], str) and stack is not None:  # a catalogue device with that stack's constants
        from costmodel.hardware import with_stack

        device = with_stack(device, stack)
    return Cluster(
        name=_get(ctx, data, "name", str, default=Path(origin).stem),
        device=device,
        gpus_per_node=_get(ctx, data, "gpus_per_node", int),
        nodes=_get(ctx, data, "nodes", int),
        intra=_parse_link(ctx, "intra", _get(ctx, data, "intra", dict), default_name="intra-node"),
        inter=_parse_link(ctx, "inter", _get(ctx, data, "inter", dict), default_name="inter-node"),
        memory_fraction=_fraction(ctx, _get(ctx, data, "memory_fraction", float, default=Cluster.memory_fraction)),
        stack=stack,
        moe_imbalance=_imbalance(ctx, _get(ctx, data, "moe_imbalance", float, default=Cluster.moe_imbalance)),
    )


def _imbalance(ctx: _Ctx, value: float) -> float:
    if not value >= 1.0:
        raise ctx.error(f"moe_imbalance must be a number ≥ 1 (the busiest expert's load over the balanced one), "
                        f"got {value!r}")
    return float(value)


def _stack(ctx: _Ctx, value: str | None) -> str | None:
    """A file's ``stack``: the software stack its device's constants describe. A device the file names from the
    catalogue takes that stack's constants; a device it describes keeps its own (the key then says where they came
    from)."""
    from costmodel.stacks import check_stack

    try:
        return None if value is None else check_stack(value)
    except ValueError as exc:
        raise ctx.error(str(exc)) from None


def _fraction(ctx: _Ctx, value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ctx.error(f"memory_fraction must be in (0, 1] (the share of each device's memory a plan may fill), "
                        f"got {value!r}")
    return value


# --- Dumping -----------------------------------------------------------------------------------------------------


def _dump_link(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"name": link.name, "bw_GBps": _round12(link.bandwidth / GB),
                           "latency_us": _round12(link.latency / US)}
    if link.call_latency:
        out["call_latency_us"] = _round12(link.call_latency / US)
    if link.source:
        out["source"] = link.source
    kinds = [k for k in COLLECTIVE_KINDS if k in link.bandwidth_by_kind or k in link.latency_by_kind
             or k in link.curve_by_kind or k in link.call_latency_by_kind]
    if kinds:
        out["by_kind"] = {}
        for kind in kinds:
            entry: dict[str, Any] = {}
            if kind in link.bandwidth_by_kind:
                entry["bw_GBps"] = _round12(link.bandwidth_by_kind[kind] / GB)
            if kind in link.latency_by_kind:
                entry["latency_us"] = _round12(link.latency_by_kind[kind] / US)
            if kind in link.call_latency_by_kind:
                entry["call_latency_us"] = _round12(link.call_latency_by_kind[kind] / US)
            if kind in link.curve_by_kind:
                curve = link.curve_by_kind[kind]
                entry["size_curve"] = {"sizes_KiB": [_round12(x / KiB) for x in curve.sizes],
                                       "factor": [_round12(f) for f in curve.factors]}
            out["by_kind"][kind] = entry
    return out


def _dump_device(device: DeviceSpec, stack: str | None = None) -> str | dict[str, Any]:
    from costmodel.hardware import with_stack

    if device.name in DEVICES and (DEVICES[device.name] == device or (
            stack is not None and with_stack(DEVICES[device.name], stack) == device)):
        return device.name  # (with the file's stack, `parse_cluster_yaml` builds it again)
    return {
        "name": device.name,
        "peak_tflops": {d: _round12(f / 1e12) for d, f in device.peak_flops.items()},
        "memory_GiB": device.memory_bytes / GiB,  # a power-of-two scale: exact both ways
        "hbm_bw_GBps": _round12(device.hbm_bw / GB),
        "matmul_eff": {"e_max": device.matmul_eff.e_max, "f_half_gflop": _round12(device.matmul_eff.f_half / GB),
                       "source": device.matmul_eff.source},
        "memory_eff": device.memory_eff,
        "attention_eff": device.attention_eff,
        **({"attention_seq_half": device.attention_seq_half} if device.attention_seq_half else {}),
        "fp8_eff": device.fp8_eff,
        "overlap_slowdown": device.overlap_slowdown,
        **({"op_overhead_us": [_round12(t / US) for t in device.op_overhead_s]} if any(device.op_overhead_s) else {}),
        **({"dtensor_overhead_us": {k: [_round12(t / US) for t in v] for k, v in device.dtensor_overhead_s.items()}}
           if device.dtensor_overhead_s else {}),
        **({"dtensor_us_per_MB": {k: [_round12(t * 1e12) for t in v] for k, v in device.dtensor_byte_s.items()}}
           if device.dtensor_byte_s else {}),
        **({"fsdp_overhead_us": {k: [_round12(t / US) for t in v] for k, v in device.fsdp_overhead_s.items()}}
           if device.fsdp_overhead_s else {}),
        **({"fsdp_copy_GBps": _round12(device.fsdp_copy_bw / GB)} if device.fsdp_copy_bw else {}),
        "host_memory": device.host_memory,
        "source": device.source,
    } | ({"runtime_reserved_GiB": device.runtime_reserved / GiB} if device.runtime_reserved is not None else {})


def dump_cluster(cluster: Cluster) -> str:
    """YAML text that ``parse_cluster_yaml``/``load_cluster`` read back into an equal cluster."""
    data = {
        "name": cluster.name,
        "device": _dump_device(cluster.device, cluster.stack),
        "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes,
        "intra": _dump_link(cluster.intra),
        "inter": _dump_link(cluster.inter),
        "memory_fraction": cluster.memory_fraction,
    } | ({"stack": cluster.stack} if cluster.stack else {}) | (
        {"moe_imbalance": cluster.moe_imbalance} if cluster.moe_imbalance != 1.0 else {})
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)
