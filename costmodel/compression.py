"""Gradient and activation compression: bytes saved on the wire, and the encode/decode work it costs.

- bf16/fp16 gradient reduction (DDP comm hook or FSDP2 ``reduce_dtype``): 2 bytes per element instead of 4. The
  cast costs a read of 4 and a write of 2 bytes per element, and the same back: 12 bytes of memory traffic per
  element on the critical path of the hook.
- PowerSGD of rank r (Vogels et al. 2019, Algorithm 1; torch ``powerSGD_hook``): each m×n gradient matrix is sent
  as P (m×r) and Q (n×r), two all-reduce rounds of r(m + n) fp32 elements instead of mn; vectors (biases, norms)
  are all-reduced uncompressed. Encoding multiplies M·Q and Mᵀ·P (2·2mnr FLOPs), orthogonalises P (≈ 2mr²) and
  updates the error-feedback buffer (read M and error, write error: 12mn bytes). Memory: one fp32 error buffer per
  gradient (costmodel.estimate adds it).
- Pipeline-boundary casts to bf16: a read of 4 and a write of 2 bytes per element on each side.

Compression shrinks the communication, not the time when the communication was already hidden: `overlap`
applies it to the exposed part only, so a fully hidden reduction gains nothing and pays the encode cost.
"""

from __future__ import annotations

from typing import Protocol

from costmodel.cluster import Cluster, GroupSpan
from costmodel.collectives import all_reduce_time
from costmodel.config import ParallelConfig
from costmodel.layercost import LayerCost

FP32 = 4

#: what each ``--compress`` policy lets the search choose, by kind (`costmodel.config.parse_grad_compress`); a
#: compression pinned with ``--fix`` is always allowed. ``none`` (the default) keeps the numbers of the plan's
#: training precision: fp32 gradient reduction, pipeline boundaries as computed. ``low-precision`` adds 16-bit
#: gradient reduction and bf16 pipeline boundaries (rounding, no approximation). ``lossy`` adds PowerSGD, a low-rank
#: approximation of the gradients that changes convergence (error feedback; the runtime starts it after
#: ``powersgd_start_iter`` uncompressed steps, torch's default 1000).
COMPRESSION_POLICIES = {
    "none": ("none",),
    "low-precision": ("none", "bf16", "fp16"),
    "lossy": ("none", "bf16", "fp16", "powersgd"),
}


#: uncompressed steps before PowerSGD starts: torch's ``PowerSGDState`` default (``start_powerSGD_iter``), its
#: documentation's warm-up ("vanilla allreduce ... prior to step start_powerSGD_iter ... can effectively improve the
#: accuracy")
POWERSGD_START_ITER = 1000


def allowed_options(policy: str, options) -> tuple[str, ...]:
    """Those of ``options`` (``none``, ``bf16``, ``powersgd-4``, …) the policy lets the search choose."""
    return tuple(k for k in options if compression_allowed(policy, k))


def compression_allowed(policy: str, option: str) -> bool:
    """Whether ``--compress policy`` lets the search choose the compression ``option`` (``bf16``, ``powersgd-4``)."""
    from costmodel.config import parse_grad_compress

    if policy not in COMPRESSION_POLICIES:
        raise ValueError(f"--compress {policy!r}: choose one of {', '.join(COMPRESSION_POLICIES)}")
    return parse_grad_compress(option)[0] in COMPRESSION_POLICIES[policy]


class SyncView(Protocol):
    """What the gradient-sync formulas (here and in `costmodel.overlap`) read of a configuration being costed.
    `costmodel.estimate.Evaluator` is one; the formulas never import it (the evaluator composes them)."""

    cfg: ParallelConfig  #: the parallel configuration
    cluster: Cluster  #: where it runs
    dp_span: GroupSpan  #: how a data-parallel group lies on the cluster
    m: int  #: micro-batches per pipeline per step
    grad_kind: str  #: ``none``, ``bf16``, ``fp16`` or ``powersgd``
    grad_rank: int  #: PowerSGD's rank (0 otherwise)
    autocast: bool  #: outside FSDP the module's parameters stay fp32 (`costmodel.memory.module_param_bytes`)


def _memory_time(nbytes: float, cluster) -> float:
    dev = cluster.device
    return nbytes / (dev.hbm_bw * dev.memory_eff)


def pp_cast_time(nbytes_bf16: float, cluster) -> float:
    """Cast ``nbytes_bf16`` bytes (their bf16 size) of fp32 activations to bf16 or back: 3 bytes of traffic
    per bf16 byte (read 4 + write 2 per element)."""
    return _memory_time(3 * nbytes_bf16, cluster)


def powersgd_volume(rank_costs, rank: int) -> tuple[float, float, float, float]:
    """PowerSGD of ``rank`` over the layers' gradients: (compressed elements r(m + n) summed over the m×n matrices,
    uncompressed vector elements, encode FLOPs 4mnr + 2mr², matrix elements)."""
    compressed = vector = flops = matrix = 0.0
    for c in rank_costs:
        in_matrices = 0.0
        for m, n in c.grad_matrices:
            r = min(rank, m, n)
            compressed += r * (m + n)
            flops += 4 * m * n * r + 2 * m * r * r
            in_matrices += m * n
        matrix += in_matrices
        vector += max(0.0, c.param_numel - in_matrices)
    return compressed, vector, flops, matrix


def compressed_grad_comm(rank_costs: list[LayerCost], params: float, first_layer_params: float,
                         ev: SyncView) -> tuple[float, float, float]:
    """(all-reduce time of the rank's gradients, time of its last bucket, encode+decode time) under the
    configuration's ``grad_compress``."""
    span, cluster = ev.dp_span, ev.cluster
    last_elems = min(first_layer_params, 25 * 2**20 / FP32)
    kind, rank = ev.grad_kind, ev.grad_rank
    if kind == "none":
        return (all_reduce_time(params * FP32, span, cluster), all_reduce_time(last_elems * FP32, span, cluster),
                0.0)
    if kind in ("bf16", "fp16"):
        return (all_reduce_time(params * 2, span, cluster), all_reduce_time(last_elems * 2, span, cluster),
                _memory_time(12 * params, cluster))
    # PowerSGD
    compressed, vector_elems, flops, matrix_elems = powersgd_volume(rank_costs, rank)
    # two rounds (P, then Q) over the compressed matrices, vectors in the first round
    p_share = 0.5 * compressed
    comm = (all_reduce_time((p_share + vector_elems) * FP32, span, cluster)
            + all_reduce_time(p_share * FP32, span, cluster))
    dev = cluster.device
    dtype = "fp32" if "fp32" in dev.peak_flops else next(iter(dev.peak_flops))
    encode = flops / (dev.peak(dtype) * dev.matmul_eff(max(flops / max(len(rank_costs), 1), 1.0)))
    encode += _memory_time(12 * matrix_elems, cluster)
    last = all_reduce_time(min(last_elems, 1.0) * FP32, span, cluster)  # compressed tail: latency-bound
    return comm, last, encode
