"""Time of one collective on a cluster: the alpha-beta (Hockney) model with NCCL-tests bus-bandwidth conventions.

For a ring over n ranks moving S bytes (NVIDIA/nccl-tests ``doc/PERFORMANCE.md``):

====================  =======================  ==========================  =================
collective            S is                     time                        ring steps
====================  =======================  ==========================  =================
all_reduce            the buffer on each rank  2(n−1)/n · S / B + steps·α  2(n−1)
all_gather            the total output         (n−1)/n · S / B + steps·α   n−1
reduce_scatter        the total input          (n−1)/n · S / B + steps·α   n−1
all_to_all            the buffer on each rank  (n−1)/n · S / B + steps·α   n−1
send_recv             the message              S / B + α                   1
broadcast             the buffer               S / B + steps·α             n−1
====================  =======================  ==========================  =================

B is the bus bandwidth (busbw = algbw · factor, the factor being 2(n−1)/n for all_reduce, (n−1)/n for
all_gather/reduce_scatter/all_to_all, 1 for send/recv and broadcast, whose pipelined ring passes every byte
once along the chain), which is what ``Link.bandwidth`` holds. α is the latency of
one ring step. Only the ring algorithm is modelled (no tree/LL small-message protocols, no NVLS): simple, and it is
what the bandwidth figures were measured with; small messages are therefore predicted somewhat pessimistically.

Groups that span nodes. A group of n = k·g ranks on k > 1 nodes with g ranks per node is modelled as NCCL runs it:
one ring per channel, each ring leaving a node through a different NIC, so the g NICs of the group's GPUs work in
parallel and the ring's bus bandwidth is ``B = min(B_intra, g · B_inter)`` with ``B_inter`` per GPU. This
reproduces the published figures: 8 NICs × 24 GB/s → 192 GB/s all_reduce busbw on DGX-A100 (AddyLaddy,
NVIDIA/nccl#812), one 24 GB/s NIC per node → 24 GB/s (sjeaugey, nccl#412). We prefer it to the explicit
hierarchical model (reduce-scatter in the node, all-reduce of 1/g of the data across nodes, all-gather in the node),
which adds the phases instead of pipelining them and so predicts ~25 % less busbw than nccl#812 measured. The ring
moves in lock step, so each step costs the slowest hop: α = α_inter for a group that crosses nodes.

Calls. Every function prices ``calls`` equal calls sharing ``nbytes`` (default one): each call moves its share in
its own ring steps and also pays the link's ``call_latency`` once (the wake-up of a rank that was computing; only
the gloo loopback fit has one, `costmodel.gloo_bench`). The callers say how many collectives the runtime issues
(two all-reduces per tensor-parallel block in each pass, one gather per FSDP unit, …), not how many bytes only.
On the gloo loopback this holds for calls issued back to back too: 39 broadcasts of 356 KB in a row took
0.26-0.36 ms each (median of 8 rounds, 2026-12-04), the lock-step fit 0.13 ms and the call latency 0.19 ms.

A link may give a kind's bandwidth as a curve over message size (``cluster.SizeCurve``; only the gloo loopback fit
has one: host-memory copies slow down in steps as buffers outgrow the L2 and L3 caches). A group inside a node uses
the intra link's curve, a group across nodes the inter link's.
"""

from __future__ import annotations

import enum

from costmodel.cluster import COLLECTIVE_KINDS, Cluster, GroupSpan, SizeCurve

__all__ = [
    "Collective",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "broadcast_time",
    "bus_bandwidth",
    "collective_time",
    "reduce_scatter_time",
    "ring_time",
    "send_recv_time",
]


class Collective(str, enum.Enum):
    """The collectives the cost model prices; values are the ``Link.bandwidth_by_kind`` keys."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


assert tuple(c.value for c in Collective) == COLLECTIVE_KINDS, "Collective and cluster.COLLECTIVE_KINDS disagree"


def ring_time(nbytes: float, n: int, bus_factor: float, steps: int, bandwidth: float, latency: float,
              curve: SizeCurve | None = None) -> float:
    """Alpha-beta ring time, seconds: ``bus_factor · nbytes / bandwidth + steps · latency``.

    Hockney's model; ``bandwidth`` is a bus bandwidth in the nccl-tests sense, ``bus_factor`` the matching
    algbw→busbw factor (PERFORMANCE.md), ``steps`` the number of ring steps, each paying ``latency`` once. A
    :class:`~costmodel.cluster.SizeCurve` makes the bandwidth ``bandwidth · curve.factor(nbytes)``.
    """
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes!r}")
    if n <= 1 or nbytes == 0:
        return 0.0
    if curve is not None:
        bandwidth *= curve.factor(nbytes)
    return bus_factor * nbytes / bandwidth + steps * latency


def _check_span(span: GroupSpan, cluster: Cluster) -> None:
    if span.per_node > cluster.gpus_per_node or span.nodes > cluster.nodes:
        raise ValueError(f"group of {span.size} ranks on {span.nodes} node(s) × {span.per_node} does not fit "
                         f"cluster {cluster.name!r} ({cluster.nodes} nodes × {cluster.gpus_per_node})")


def bus_bandwidth(kind: Collective, span: GroupSpan, cluster: Cluster) -> float:
    """Ring bus bandwidth of a group, bytes/s: the intra link inside one node, ``min(B_intra, g·B_inter)`` across.

    The cross-node rule is NCCL's multi-ring layout (one NIC per ring; nccl#812: 8 × 24 = 192 GB/s; nccl#412).
    """
    _check_span(span, cluster)
    intra = cluster.intra.bandwidth_for(kind.value)
    if not span.crosses_nodes:
        return intra
    return min(intra, span.per_node * cluster.inter.bandwidth_for(kind.value))


def _latency(kind: Collective, span: GroupSpan, cluster: Cluster) -> float:
    """Per-step latency: the slowest hop of the ring (the inter-node hop when the group crosses nodes)."""
    intra = cluster.intra.latency_for(kind.value)
    return max(intra, cluster.inter.latency_for(kind.value)) if span.crosses_nodes else intra


def _call_latency(kind: Collective, span: GroupSpan, cluster: Cluster) -> float:
    """Per-call latency: the link that carries the group's (the slower of the two when the group crosses nodes)."""
    intra = cluster.intra.call_latency_for(kind.value)
    return max(intra, cluster.inter.call_latency_for(kind.value)) if span.crosses_nodes else intra


def _priced(nbytes: float, calls: int, n: int, bus_factor: float, steps: int, bandwidth: float, latency: float,
            curve: SizeCurve | None, call_latency: float) -> float:
    """``calls`` rings of ``nbytes / calls`` each (`ring_time`), each paying ``call_latency`` once."""
    if calls < 1 or int(calls) != calls:
        raise ValueError(f"calls must be a whole number ≥ 1, got {calls!r}")
    if nbytes == 0:
        return 0.0
    return calls * (ring_time(nbytes / calls, n, bus_factor, steps, bandwidth, latency, curve) + call_latency)


def _curve(kind: Collective, span: GroupSpan, cluster: Cluster) -> SizeCurve | None:
    """The size curve of the link that carries the group: intra inside a node, inter across nodes."""
    return (cluster.inter if span.crosses_nodes else cluster.intra).curve_for(kind.value)


def _group(kind: Collective, span: GroupSpan, cluster: Cluster,
           bandwidth: float | None = None) -> tuple[float, float, SizeCurve | None, float]:
    """(bus bandwidth, per-step latency, size curve, per-call latency) of the group's ring; ``bandwidth``: one the
    caller derived itself (all-to-all's), instead of `bus_bandwidth`."""
    return (bus_bandwidth(kind, span, cluster) if bandwidth is None else bandwidth, _latency(kind, span, cluster),
            _curve(kind, span, cluster), _call_latency(kind, span, cluster))


def all_reduce_time(nbytes: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2(n−1)/n · S/B + 2(n−1)·α`` (nccl-tests PERFORMANCE.md)."""
    n, kind = span.size, Collective.ALL_REDUCE
    if n <= 1:
        return 0.0
    return _priced(nbytes, calls, n, 2 * (n - 1) / n, 2 * (n - 1), *_group(kind, span, cluster))


def all_gather_time(nbytes_total_output: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """Ring all-gather producing ``nbytes_total_output`` on each rank: ``(n−1)/n · S/B + (n−1)·α``."""
    n, kind = span.size, Collective.ALL_GATHER
    if n <= 1:
        return 0.0
    return _priced(nbytes_total_output, calls, n, (n - 1) / n, n - 1, *_group(kind, span, cluster))


def reduce_scatter_time(nbytes_total_input: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """Ring reduce-scatter of ``nbytes_total_input`` per rank: ``(n−1)/n · S/B + (n−1)·α``."""
    n, kind = span.size, Collective.REDUCE_SCATTER
    if n <= 1:
        return 0.0
    return _priced(nbytes_total_input, calls, n, (n - 1) / n, n - 1, *_group(kind, span, cluster))


def all_to_all_time(nbytes: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """All-to-all of ``nbytes`` per rank (it keeps 1/n, sends (n−1)/n): ``(n−1)/n · S/B + (n−1)·α``.

    Across nodes, (n−g)/n of each rank's buffer leaves the node through its own NIC, so in busbw terms
    ``B = min(B_intra, B_inter·(n−1)/(n−g))`` (never more than inside a node, so crossing is never faster).
    """
    n, kind = span.size, Collective.ALL_TO_ALL
    if n <= 1:
        return 0.0
    _check_span(span, cluster)
    bandwidth = cluster.intra.bandwidth_for(kind.value)
    if span.crosses_nodes:
        off_node = n - span.per_node
        bandwidth = min(bandwidth, cluster.inter.bandwidth_for(kind.value) * (n - 1) / off_node)
    return _priced(nbytes, calls, n, (n - 1) / n, n - 1, *_group(kind, span, cluster, bandwidth))


def broadcast_time(nbytes: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """Broadcast of ``nbytes`` from one rank to the group: ``S/B + (n−1)·α`` (nccl-tests: busbw = algbw; a pipelined
    chain passes every byte once)."""
    n, kind = span.size, Collective.BROADCAST
    if n <= 1:
        return 0.0
    return _priced(nbytes, calls, n, 1.0, n - 1, *_group(kind, span, cluster))


def send_recv_time(nbytes: float, cross_node: bool, cluster: Cluster, calls: int = 1) -> float:
    """Point-to-point message of ``nbytes``: ``S/B + α`` on the intra link, or the inter link (one NIC) across nodes.

    nccl-tests sendrecv: busbw = algbw.
    """
    link = cluster.inter if cross_node else cluster.intra
    kind = Collective.SEND_RECV.value
    return _priced(nbytes, calls, 2, 1.0, 1, link.bandwidth_for(kind), link.latency_for(kind), link.curve_for(kind),
                   link.call_latency_for(kind))


def collective_time(kind: Collective | str, nbytes: float, span: GroupSpan, cluster: Cluster, calls: int = 1) -> float:
    """Dispatch on ``kind``; ``nbytes`` has the meaning of the matching function (see the module table).

    For ``send_recv`` the span says whether the two ranks are on different nodes (``span.nodes > 1``).
    """
    kind = Collective(kind)
    if kind is Collective.SEND_RECV:
        return 0.0 if span.size <= 1 else send_recv_time(nbytes, span.crosses_nodes, cluster, calls)
    return _DISPATCH[kind](nbytes, span, cluster, calls)


_DISPATCH = {
    Collective.ALL_REDUCE: all_reduce_time,
    Collective.BROADCAST: broadcast_time,
    Collective.ALL_GATHER: all_gather_time,
    Collective.REDUCE_SCATTER: reduce_scatter_time,
    Collective.ALL_TO_ALL: all_to_all_time,
}
