"""Gradient and activation compression: bytes saved on the wire, and the encode/decode work it costs.

- bf16/fp16 gradient reduction (DDP comm hook or FSDP2 ``reduce_dtype``): 2 bytes per element instead of 4. The
  cast costs a read of 4 and a write of 2 bytes per element, and the same back: 12 bytes of memory traffic per
  element on the critical path of the hook.
- PowerSGD of rank r (Vogels et al. 2019, Algorithm 1; torch ``powerSGD_hook``): each m×n gradient matrix is sent
  as P (m×r) and Q (n×r), r(m + n) fp32 elements instead of mn; vectors (biases, norms), and matrices too small to
  gain 2× (torch's ``_should_compress``), are sent uncompressed. Per bucket torch all-reduces those, then the Ps,
  then the Qs (priced as two all-reduces per step, the uncompressed ones with the Ps). Encoding and decoding
  multiply M·Q, Mᵀ·P and P·Qᵀ (3·2mnr FLOPs: the three ``torch.matmul`` of torch's hook, as `autopar check`
  traces them), orthogonalise P and, warm-started, Q (≈ 2(m + n)r²: ``torch.linalg.qr`` beyond rank 2 in fp32,
  Gram-Schmidt otherwise; not counted by torch's FLOP counter) and update the error-feedback buffer (read M and
  error, write error: 12mn bytes). Memory: one fp32 error buffer per gradient (costmodel.estimate adds
  it) and the hook's copies of a bucket (`costmodel.memory.dp_reduction_temp_bytes`).
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
    fsdp_copy_out: bool  #: FSDP copies gathered parameters out of its buffer (FSDP2; `costmodel.overlap`)
    #: the stack accumulates gradients inside the weight-gradient GEMM (`costmodel.overlap.grad_accumulation_time`)
    fused_grad_accumulation: bool

    def gathered_numel(self, c: LayerCost) -> float:
        """A layer's parameters as FSDP2 gathers and reduce-scatters them: padded on every rank's shard."""


def _memory_time(nbytes: float, cluster) -> float:
    dev = cluster.device
    return nbytes / (dev.hbm_bw * dev.memory_eff)


def pp_cast_time(nbytes_bf16: float, cluster) -> float:
    """Cast ``nbytes_bf16`` bytes (their bf16 size) of fp32 activations to bf16 or back: 3 bytes of traffic
    per bf16 byte (read 4 + write 2 per element)."""
    return _memory_time(3 * nbytes_bf16, cluster)


#: torch's ``PowerSGDState`` default ``min_compression_rate``, which the runtime keeps
POWERSGD_MIN_RATE = 2


def powersgd_rank(m: int, n: int, rank: int) -> int:
    """The rank PowerSGD of ``rank`` compresses an m×n gradient matrix to, 0 where it sends the matrix whole
    (torch 2.13 ``powerSGD_hook``: the rank clipped to the matrix, then ``_should_compress``)."""
    r = min(rank, m, n)
    return r if r * (m + n) * POWERSGD_MIN_RATE < m * n else 0


def powersgd_volume(rank_costs, rank: int) -> tuple[float, float, float, float]:
    """PowerSGD of ``rank`` over the layers' gradients: (compressed elements r(m + n) summed over the m×n matrices it
    compresses, uncompressed elements, encode and decode FLOPs 6mnr + 2(m + n)r², compressed matrices' elements).
    A matrix is compressed only where that saves `POWERSGD_MIN_RATE` × or more (`powersgd_rank`); the rest is
    all-reduced whole, with the vectors."""
    compressed = vector = flops = matrix = 0.0
    for c in rank_costs:
        in_matrices = 0.0
        for m, n in c.grad_matrices:
            r = powersgd_rank(m, n, rank)
            if not r:
                continue  # (counted with the vectors)
            compressed += r * (m + n)
            flops += 6 * m * n * r + 2 * (m + n) * r * r
            in_matrices += m * n
        matrix += in_matrices
        vector += max(0.0, c.param_numel - in_matrices)
    return compressed, vector, flops, matrix


def powersgd_memory(rank_costs, rank: int) -> tuple[float, float]:
    """What PowerSGD of ``rank`` holds, over the layers' gradients (`powersgd_volume`): (bytes per gradient element
    kept from step to step: the fp32 error feedback, and the P and Q factors of every compressed matrix, r(m + n)
    fp32 each, torch's ``p_memory_dict`` and ``q_memory_dict``; the share of the elements sent whole, which its
    hook concatenates into one buffer per bucket, `costmodel.memory.dp_reduction_temp_bytes`)."""
    compressed, vector, _, matrix = powersgd_volume(rank_costs, rank)
    total = vector + matrix
    return (FP32 * (1 + compressed / total), vector / total) if total else (FP32, 1.0)


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
