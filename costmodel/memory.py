"""Memory per GPU: model states under ZeRO/FSDP, activations of the in-flight micro-batches, temporaries and the
allocator allowance.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1 and Figure 1): with mixed-precision Adam a
model of Ψ parameters holds 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ of optimizer state with
K = 12 (fp32 master weights, momentum and variance); stage 1 shards the optimizer state over the data-parallel
group of N ranks, stage 2 also the gradients, stage 3 also the parameters. In fp32 training the parameters and
gradients take 4 bytes each and K = 8 (no separate master copy). Stages 2 and 3 run as FSDP2, which with a bf16
`MixedPrecisionPolicy` keeps fp32 shards of the parameters (the master weights) and of the gradients: 16Ψ/N in all
for stage 3, the same as ZeRO-3's (2 + 2 + 12)Ψ/N; stage 2 adds the unsharded 16-bit parameters it keeps between
forward and backward, 2Ψ + 16Ψ/N (2Ψ/N more than the paper's, the gradient shard being fp32), and in fp32
training 4Ψ + 16Ψ/N (the fp32 shard beside the unsharded parameters). Stages 0 and 1 run as DDP (with
ZeroRedundancyOptimizer) under ``torch.autocast`` over fp32 parameters: 4Ψ + 2Ψ (autocast's cached 16-bit copies)
+ 4Ψ + 8Ψ (/N), not the paper's layout, which Megatron-LM's published rows keep (`state_bytes_per_param`).

Activations of one micro-batch come from `costmodel.layercost`. How many micro-batches a pipeline rank holds at
its peak depends on the schedule (`inflight_chunks`): GPipe holds all m; 1F1B holds p − r on rank r (Narayanan et
al. 2021 §2.2.1); the interleaved schedule holds torch's warm-up chunks plus one, ((v − 1)·q + 2(p − 1 − r) + 1)
chunk-micro-batches on rank r (q = p when m is a multiple of p), on average ((v − 1)·q + 2(p − 1 − r) + 1)/v per
chunk, which for r = 0 is p + (p − 1)/v, Korthikanti et al. 2022 eq. 5's factor (1 + (p − 1)/(p·v)) on p
micro-batches (for v > 2 the later ranks hold more than (p − r) + (p − 1)/v), but unevenly: the last rank's last
chunk, which holds the head, only one; zero-bubble ZB-H1 keeps 1F1B's peak (Qi et al. 2023 §3.1). Never more
than m per chunk.

Temporaries: the recomputed layer's activations and the gradient working set while a layer's backward runs
(`costmodel.layercost`), FSDP's all-gathered parameters of the current and the prefetched layer, the data-parallel
reduction's copy of a bucket where there is one (`dp_reduction_temp_bytes`, after the backward), PowerSGD's
error-feedback buffers.

Allowance (stated, not fitted): 5 % of the allocated peak for caching-allocator fragmentation, and on GPUs what
the runtime holds outside torch's allocator (`runtime_reserved_bytes`): the CUDA context with cuBLAS's workspaces,
and NCCL's buffers for each communicator the plan's runtime uses (measured sizes, sources there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from costmodel.config import Schedule, parse_grad_compress
from costmodel.runnable import pipelined_fsdp, trains_under_autocast

GiB = 2**30
MiB = 2**20
#: the CUDA context, with cuBLAS's workspaces, outside torch's caching allocator: NVIDIA/nccl#2366 measured 484 MiB for
#: a process's CUDA context and a one-rank NCCL communicator's init on one GPU (CUDA 13); torch's cuBLAS workspace is
#: 32 MiB per handle on Hopper (``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8``). Rounded up to 512 MiB.
CUDA_CONTEXT_BYTES = 512 * MiB
#: NCCL's buffers for one communicator running ring/tree collectives, per rank: 544 MB in a group of 2 ranks and
#: 688 MB in larger ones, measured through PyTorch on 4 NVLink A100s after one all-reduce per group
#: (NVIDIA/nccl#964). The buffers are per channel and connection (LL 512 KiB, LL128 4.7 MiB, Simple 4 MiB:
#: NCCL_BUFFSIZE's default), so the figure grows with the channels NCCL opens (sjeaugey, NVIDIA/nccl#986) and stops
#: growing with the group beyond two nodes; Hopper may open more channels than this A100 measurement had (no
#: published H100 figure per communicator).
NCCL_COMM_BYTES_PAIR = 544e6
NCCL_COMM_BYTES = 688e6
#: NCCL's point-to-point buffers per peer (pipeline send/recv): 32 channels per pair of 8 NVLink H100, each a 10 MiB
#: and a 2 MiB buffer (NCCL_DEBUG_SUBSYS=ALLOC, NVIDIA/nccl#1685): 384 MiB.
NCCL_P2P_PEER_BYTES = 32 * 12 * MiB
FRAGMENTATION = 0.05  #: caching-allocator fragmentation allowance, a fraction of the allocated peak
DDP_BUCKET_BYTES = 25 * 2**20  #: torch DDP default bucket_cap_mb = 25
DDP_FIRST_BUCKET_BYTES = 2**20  #: and its first bucket's (``dist._DEFAULT_FIRST_BUCKET_BYTES``)


def ddp_largest_bucket(tensors, first: float = DDP_FIRST_BUCKET_BYTES) -> float:
    """The largest of DDP's buckets over gradient tensors of ``tensors`` bytes each, in the parameters' order: torch
    2.13's ``_compute_bucket_assignment_by_size`` (DDP's bucket rebuild) adds tensors to a bucket until it holds its
    limit, ``first`` (`DDP_FIRST_BUCKET_BYTES`) for the first and `DDP_BUCKET_BYTES` after, so a large tensor (an
    embedding) can make a bucket far beyond the limit. The runtime's all-reduce after the backward
    (`planner.emit.runtime.allreduce_in_buckets`) packs the same way with no smaller first bucket: ``first`` =
    `DDP_BUCKET_BYTES` (traced, llama 6 × 320 dp 4 × tp 2: its 16.7 MiB of gradients in one flat copy, where DDP's
    first bucket would have left 14.9)."""
    largest = size = 0.0
    limit = first
    for nbytes in tensors:
        size += nbytes
        if size >= limit:
            largest, size, limit = max(largest, size), 0.0, DDP_BUCKET_BYTES
    return max(largest, size)


def dp_reduction_temp_bytes(cfg, grad_kind: str, grad_bytes: float, whole: float = 1.0,
                            bucket: float = DDP_BUCKET_BYTES) -> float:
    """Memory the data-parallel gradient reduction adds beyond the gradients (ZeRO 0/1), at the end of the backward
    (`costmodel.estimate.Evaluator`: the moment every gradient exists and no activation does), for a rank holding
    ``grad_bytes`` of fp32 gradients in buckets of at most ``bucket`` (`ddp_largest_bucket`): DDP's buckets are the
    gradients themselves (the runtime's ``gradient_as_bucket_view=True``), so nothing, except a cast hook's 16-bit
    copy of a bucket (bf16/fp16 compression); the explicit post-step all-reduce
    (`costmodel.runnable.post_step_allreduce`) flattens one bucket at a time, after the backward. torch 2.13's DDP
    puts every gradient in one bucket until its first step is over (``compute_bucket_size_limits``: no unused
    parameters), so the cast hook copies every gradient when the first backward ends, not at the activation peak.
    Traced (gpt-tiny, dp = 2, ZeRO-1, bf16 reduction): the copy after the backward, not at the peak (charged there:
    6.4 % over). PowerSGD (torch 2.13 ``powerSGD_hook``, error feedback on) clones a bucket's error-corrected gradients
    (``input_tensor_cp``), concatenates the tensors it sends whole into one buffer (``whole``: their share of the
    bucket, `costmodel.compression.powersgd_memory`), and keeps both until the bucket is decompressed, when it
    makes the new error buffer from the clone (``input_tensor_cp - input_tensor``) before the old one is let go:
    (2 + ``whole``) bucket-sized fp32 copies beside what it holds from step to step (the error feedback and the
    low-rank factors, `costmodel.estimate.Evaluator`). FSDP (ZeRO 2/3) is costed apart."""
    if cfg.data_ranks == 1 or cfg.zero >= 2:
        return 0.0
    bucket = min(bucket, grad_bytes)
    if cfg.reduces_after_step:
        return bucket
    # PowerSGD compresses from its start step on, when DDP has rebuilt its buckets; a cast hook copies the first one
    return {"bf16": grad_bytes / 2, "fp16": grad_bytes / 2, "powersgd": (2 + whole) * bucket}.get(grad_kind, 0.0)


@functools.lru_cache(maxsize=4096)
def fsdp_padding_numel(sizes: tuple[tuple[float, bool, int], ...], dp: int) -> float:
    """Elements a rank's FSDP2 shards hold beyond numel/dp for parameter tensors ``sizes`` ((elements, is a matrix,
    rows) each: a layer's `LayerCost.param_sizes`): FSDP2 shards dim 0 with ``torch.chunk`` over the dp ranks and
    pads every shard to the first chunk's rows, ceil(rows/dp) (torch 2.13 ``FSDPParam._init_sharded_param``). A
    grouped expert weight with fewer experts than ranks is a whole expert on each: traced, a MoE with 4 experts on
    8 ranks under ZeRO-3 kept 7.16 MiB of gradient shards where 5.66 were priced. (Cached: the search asks for the
    same layers' padding at every candidate.)"""
    return sum(-(-rows // dp) * (n / rows) - n / dp for n, _, rows in sizes)


def zero1_partition_numel(sizes: list[tuple[float, bool, int]], dp: int) -> float:
    """The most parameter elements whose optimizer state one of ``dp`` ranks keeps under ZeRO-1, for parameter
    tensors ``sizes`` ((elements, is a matrix, rows) each; the rows do not matter here). torch 2.13's
    ``ZeroRedundancyOptimizer._partition_parameters`` gives whole tensors: each parameter group sorted by size,
    largest first, each tensor to the rank with the fewest elements so far (the first such), the counts carried
    from group to group; autopar's runtime makes the matrices its first group and the vectors its second
    (`planner.emit.train.build_optimizer`). A tensor larger than a rank's even share (an embedding at large dp) is
    one rank's alone: traced, llama 2 × 256 with 32000 words on 8 ranks, rank 0 keeps the 31.25 MiB embedding's two
    moments (62.5 MiB), not 1/8 of the model's 141 MiB."""
    load = [0.0] * dp
    for matrices in (True, False):
        for n in sorted((n for n, m, _ in sizes if m == matrices), reverse=True):
            i = load.index(min(load))
            load[i] += n
    return max(load)


#: bytes per element of autocast's cached 16-bit copy of a parameter it casts: the weights of the ops it runs in 16
#: bits (matmuls; not an embedding's or a norm's, nor a grouped expert weight cast through a transpose, which is
#: not a leaf: `costmodel.layercost.LayerCost.cast_numel`), kept until the outermost autocast region exits
#: (torch/amp/autocast_mode.py, ``clear_autocast_cache``); the runtime's region is a micro-batch's forward and
#: backward, or under pipelining torch's whole schedule (`planner.emit.train.train_step_loss`) (measured here with
#: CPU autocast: an 8192² linear's forward and backward held 128 MiB more inside the region than after it)
AUTOCAST_COPY_BYTES = 2.0


def state_bytes_per_param(precision: str, zero: int, dp: int, pp: int = 1,
                          accumulator: float = 4.0, *, autocast: bool = True) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per parameter on one rank: the ZeRO paper's 2Ψ + 2Ψ + KΨ; under
    pipelining FSDP also holds the unsharded gradients, ``accumulator`` bytes each (the reduce dtype,
    `fsdp_reduce_dtype_bytes`: fp32 unless the plan compresses), and, ZeRO 3, the unsharded parameters across the
    micro-batches (`pipelined_fsdp`).

    ``autocast`` (`module_param_bytes`): outside FSDP (ZeRO 0/1) the module's parameters stay fp32 and 16-bit
    training is ``torch.autocast`` (autopar's runtime, `planner.emit.train.autocast`), so the parameters and their
    gradients take 4 bytes and Adam keeps no master copy (K = 8), the fp32 training figures; ZeRO-1
    (``ZeroRedundancyOptimizer``) shards the two moments only. Autocast also keeps the 16-bit copy of the
    parameters it casts, charged per layer with the parameters (`costmodel.layercost.LayerCost.cast_numel`,
    `AUTOCAST_COPY_BYTES`). False: the paper's mixed precision, 16-bit parameters and gradients beside a master
    copy in the optimizer (Megatron-LM and its distributed optimizer, published rows)."""
    fp32 = precision == "fp32" or (autocast and zero <= 1)
    p, g, k = (4.0, 4.0, 8.0) if fp32 else (2.0, 2.0, 12.0)
    unsharded_param = p
    if zero >= 1:
        k /= dp
    if zero >= 2:  # FSDP2: fp32 shards of the parameters (the master weights) and of the gradients, Adam's two
        # moments; ZeRO 2 also keeps the unsharded (training-precision) parameters from forward to backward
        p, g, k = 4.0 / dp + (unsharded_param if zero == 2 else 0.0), 4.0 / dp, 8.0 / dp
    if pipelined_fsdp(zero, dp, pp):
        g += accumulator
        if zero >= 3:
            p += unsharded_param
    return p, g, k


def grads_always_held(cfg) -> bool:
    """Whether a rank holds its gradients from the step's start: DDP's buckets (ZeRO 0/1 under DDP, the runtime's
    ``gradient_as_bucket_view=True``), which the runtime then zeroes in place with every other gradient
    (`planner.emit.train.zeroes_grads_in_place`). Elsewhere it frees them (``set_to_none=True``): a step starts
    without them, and autograd (or FSDP's post-backward) allocates each layer's in that layer's first backward."""
    return cfg.data_ranks > 1 and cfg.zero <= 1 and not cfg.reduces_after_step


def grads_accumulate(cfg, micro_batches: int) -> bool:
    """Whether a layer's backward can find its parameters' ``.grad`` already there, so that autograd's
    ``AccumulateGrad`` adds the new gradient into it in place and the new one is a temporary beside the held
    gradient (`costmodel.layercost.weight_grad_working_set`): always under DDP (`grads_always_held`); else in every
    micro-batch after a chunk's first where the gradients accumulate unsharded: without a data-parallel wrapper (one
    data rank, or the explicit all-reduce after the step, `costmodel.runnable.post_step_allreduce`) and in torch's
    pipeline stages under FSDP, which turn off its gradient sync until the last micro-batch (`pipelined_fsdp`:
    the unsharded ``.grad`` is kept and added to, torch 2.13's ``FSDPParam.accumulate_unsharded_grad_if_needed``
    where the reduce dtype is the parameter's). FSDP2 outside a pipeline reduce-scatters every micro-batch and drops
    the unsharded ``.grad``, so each backward's new gradient becomes it (`fsdp_transient_grads`)."""
    if grads_always_held(cfg):
        return True
    if pipelined_fsdp(cfg.zero, cfg.data_ranks, cfg.pp):  # (at different dtypes `.grad` is moved to the accumulator
        # after each backward, `_pipelined_grad_beside`, and the next new gradient becomes it)
        return micro_batches > 1 and not _pipelined_grad_beside(cfg)
    return micro_batches > 1 and not fsdp_transient_grads(cfg)


def fsdp_transient_grads(cfg) -> bool:
    """Whether the embedding's and the head's new unsharded gradients are neither a held state nor added into one:
    FSDP2 outside a pipeline, where they live from their layer's backward to the root unit's reduce-scatter (the
    model states hold only the shards; a block's are `fsdp_reduce_bytes`')."""
    return cfg.zero >= 2 and cfg.data_ranks > 1 and not pipelined_fsdp(cfg.zero, cfg.data_ranks, cfg.pp)


def grads_held_at_peak(cfg, micro_batches: int, rank: int | None = None) -> bool:
    """Whether pipeline rank ``rank``'s gradients (every rank's when None) exist at every state that can set its
    activation peak (`held_states`): held from the start (`grads_always_held`), or each such state comes after a
    backward of the rank. With one micro-batch and no pipeline, and under GPipe (every forward before any
    backward), no backward has run at the peak (traced: llama3-8b ZeRO-3 on 8 ranks, one micro-batch, peaks in the
    last block's backward holding the head's gradient only)."""
    if grads_always_held(cfg):
        return True
    ranks = range(cfg.pp) if rank is None else (rank,)
    return all(min(made) for r in ranks for _, _, made, _ in held_states(cfg.schedule, cfg.pp, cfg.vpp, r,
                                                                         micro_batches))


def autocast_dtype(cfg, autocast: bool = True) -> str | None:
    """The dtype ``torch.autocast`` computes in for ``cfg`` (None: it trains without autocast): 16-bit training
    outside FSDP over fp32 parameters, as autopar's runtime does (`costmodel.runnable.trains_under_autocast`;
    ``autocast``: False for stacks that keep 16-bit parameters beside a master copy, `state_bytes_per_param`)."""
    return cfg.precision if autocast and trains_under_autocast(cfg.precision, cfg.zero, cfg.data_ranks) else None


def module_param_bytes(cfg, autocast: bool = True) -> int:
    """Bytes of one of the module's parameters and of its gradient outside FSDP's shards: fp32 where 16-bit
    training is ``torch.autocast`` over fp32 parameters (``autocast``, ZeRO 0/1: `state_bytes_per_param`), else the
    training precision's. What ZeRO-1's broadcasts move, and a gradient the model states do not hold yet."""
    return 4 if autocast and cfg.zero <= 1 else cfg.param_bytes


def plan_state_bytes(cfg, autocast: bool = True) -> tuple[float, float, float]:
    """`state_bytes_per_param` for plan ``cfg`` (its precision, ZeRO stage, data ranks, pipeline and reduce dtype)."""
    return state_bytes_per_param(cfg.precision, cfg.zero, cfg.data_ranks, cfg.pp, fsdp_reduce_dtype_bytes(cfg),
                                 autocast=autocast)


def state_bytes_at_peak(cfg, autocast: bool = True) -> tuple[float, float, float, float, float]:
    """Bytes per parameter at a state of the activation peak (`held_states`): ``(params, grads, optimizer)`` held
    at every state, then what a chunk holds once a backward ran on it (its gradients, where they do not outlive
    the step: `grads_always_held`) and while its last pass was a backward (its unsharded parameters: pipelined
    ZeRO 3). Pipelined FSDP (`costmodel.runnable.pipelined_fsdp`) accumulates unsharded gradients (in the reduce
    dtype) from a chunk's first backward, and makes the gradient shards only with the reduce-scatter after the last one
    (`state_bytes_per_param` counts both: the moment after the backward); under ZeRO 3 each forward reshards its
    module (``reshard_after_forward``) and each backward leaves it gathered (torch 2.13's ``PipelineStage`` turns
    off the reshard after backward). Traced: llama 8×1024, dp4 pp2 v2 interleaved ZeRO-3, rank 0 peaked in a
    forward of its second chunk, holding the first chunk's parameters gathered and both chunks' accumulators, no
    shard of a gradient (6.9 % under the cost model, which held them all)."""
    p, g, k = plan_state_bytes(cfg, autocast)
    unsharded = 0.0
    if pipelined_fsdp(cfg.zero, cfg.data_ranks, cfg.pp):
        g = float(fsdp_reduce_dtype_bytes(cfg))
        if cfg.zero >= 3:
            unsharded = cfg.param_bytes
            p -= unsharded
    if grads_always_held(cfg):
        return p, g, k, 0.0, unsharded
    return p, 0.0, k, g, unsharded


def head_grad_bytes(cfg, layers: list[tuple[str, float]], micro_batches: int, rank: int,
                    autocast: bool = True) -> float:
    """The head's gradient pipeline rank ``rank``, holding ``layers`` ((kind, parameters) pairs), has at a block's
    backward when its gradients are not held at every peak state (`grads_held_at_peak`): the head's backward ran
    first. ZeRO 3 counts it with the root's unsharded state (`fsdp_gathered_bytes`), pipelined FSDP where it stays
    beside the accumulators (`fsdp_reduce_bytes`)."""
    counted = (cfg.zero == 3 and cfg.data_ranks > 1 and not cfg.fsdp_in_pipeline) or _pipelined_grad_beside(cfg)
    if grads_held_at_peak(cfg, micro_batches, rank) or counted:
        return 0.0
    return module_param_bytes(cfg, autocast) * sum(n for kind, n in layers if kind == "head")


def fsdp_reduce_dtype_bytes(cfg) -> int:
    """Bytes per element of FSDP2's reduction (``reduce_dtype``, `planner.emit.runtime.fsdp_policy`): fp32 unless the
    plan compresses the gradients to 16 bits."""
    return 2 if parse_grad_compress(cfg.grad_compress)[0] in ("bf16", "fp16") else 4


def _pipelined_grad_beside(cfg) -> bool:
    """Whether pipelined FSDP keeps a layer's new gradient beside its accumulator until the unit's post-backward
    folds it in: when the reduce dtype differs from the parameters' (torch 2.13 ``FSDPParam.
    to_accumulated_grad_if_needed`` returns early when they are equal, and ``.grad`` is the accumulator itself)."""
    return cfg.fsdp_in_pipeline and cfg.param_bytes != fsdp_reduce_dtype_bytes(cfg)


def fsdp_gathered_bytes(cfg, layers: list[tuple[str, float]]) -> float:
    """ZeRO-3 (FSDP2) memory beyond the shards during a block's backward on a rank holding ``layers`` ((kind,
    parameters) pairs). The root module's parameters (embedding, head, final norm), gathered again by the root's
    pre-backward hook, stay unsharded until the end of the backward, and so does the head's gradient from the head's
    backward on (the root reduce-scatters last; the embedding's gradient comes after the blocks'); a block's
    backward adds that block and the prefetched next one, gathered in the training precision (traced: llama3-8b on 8
    ranks peaks in a block's backward with the root's 3.9 GiB of fp32 parameters and the head's 2.0 GiB gradient
    unsharded). The loss's own backward adds nothing: the runtime computes the loss outside the model, so it runs
    before the root's hook gathers (traced: a 4-block MoE on 8 ranks holds only the shards then, and gathers the
    root's 250 MiB at the head's backward, after the loss's working set). Under pipelining the same root and blocks
    are gathered at a chunk's top block (a forward reshards them, a backward leaves them gathered:
    `fsdp_chunk_gathered` has the chunk's other moments; traced: llama 8×1024, dp4 pp2 1F1B m = 8, a steady
    backward's first block with the root's 125 MiB and one block gathered); the head's gradient is an accumulator
    there (`fsdp_reduce_bytes` and `head_grad_bytes` say when it is not all)."""
    blocks = sorted(n for kind, n in layers if kind == "block")[-2:]
    root = sum(n for kind, n in layers if kind != "block")
    head = 0.0 if cfg.fsdp_in_pipeline else sum(n for kind, n in layers if kind == "head")
    return cfg.param_bytes * (sum(blocks) + root + head)


def fsdp_chunk_gathered(kind: str, chunk: float, root: float, block: float) -> tuple[float, float]:
    """Pipelined ZeRO 3: what the backward of a layer of ``kind`` (the embedding or the head) finds of its chunk,
    as (gathered, all-gather output in flight), given the chunk's unsharded parameters ``chunk``, its root unit's
    ``root`` (its layers other than blocks) and its largest block's ``block``. Under pipelining each forward
    reshards its units and each backward leaves them gathered (torch 2.13's ``PipelineStage`` sets
    ``reshard_after_backward`` off), so a chunk's backward gathers it unit by unit and holds what it gathered. The
    head's backward comes first: the root gathered and the top block's all-gather prefetched (``_backward_prefetch``
    after the root's copy-out; its output buffer is allocated when issued, the block's parameters only at its own
    pre-backward). The embedding's comes last, with the whole chunk gathered. A block's moments are the top block's
    (`fsdp_gathered_bytes`: the root, the block and the next one's buffer) and the lowest's (the whole chunk, nothing
    left to prefetch). A state whose chunk's last pass was a backward holds it whole already
    (`state_bytes_at_peak`), and the moment gathers nothing. Traced, dp 4 pp 2 ZeRO-3 1F1B: the last stage's peak
    is the head's backward with the head gathered and a block's buffer (31.25 + 4.0 MiB, llama 2 × 256 with 32000
    words; 15.6 + 7.0 MiB, a 4-expert MoE); llama 8 × 512 with full checkpointing peaks in each stage's lowest
    block's backward, the chunk's 79.6 MiB gathered whole."""
    return (root, block) if kind == "head" else (chunk, 0.0)


def fsdp_edge_bytes(cfg, layers: list[tuple[str, float]], micro_batches: int) -> float:
    """FSDP2 (ZeRO 2/3 over dp × cp > 1, outside a pipeline) memory beyond the model states at the two ends of a
    micro-batch, when few activations are held and the root's parameter group (embedding, head, final norm: one
    unit, `planner.emit.runtime`) is in flight, on a rank holding ``layers`` ((kind, parameters) pairs); the larger of:

    - the first block's forward: FSDP2 keeps the previous unit's all-gather output until the next unit's all-gather
      has been issued and its unsharded parameters allocated (torch 2.13 ``FSDPParamGroup.wait_for_unshard``,
      ``comm_ctx.all_gather_state``, to overlap the copy-out with the next all-gather), so the root's all-gather
      buffer, the first block's and, under ZeRO 3, both units' unsharded parameters are alive together (ZeRO 2 keeps
      every parameter unsharded anyway: `state_bytes_per_param`). Traced (llama 2 × 256, 32000 words, 16 tokens,
      ZeRO-3 on 8 ranks): the peak is the first block's forward, shards plus 2 × (62.5 + 4.4) MiB;
    - the root's post-backward, the last of the backward: its unsharded gradients (the head's since the head's
      backward, the embedding's just made) and the reduce-scatter input they are copied into, in the reduce dtype
      (``foreach_reduce``), before the backward's activations are all gone only in the head's own shadow. Traced (the
      same model, ZeRO-2): 125 MiB beyond the states, the peak. The root's parameters are resharded first where
      its post-backward reshards (ZeRO 3; ZeRO 2 only in the last micro-batch's, `planner.emit.train`).

    Returned beyond the states after the backward (`plan_state_bytes`), which these moments may not all hold: no
    gradient shard before the first backward, under ZeRO 2 no block after the first gathered yet in the forward, and
    none gathered at the end of the last micro-batch. Blocks are charged at the largest (the search sees a rank's
    blocks as counts). Under pipelining FSDP keeps the gradients unsharded through the micro-batches and reduces
    once after the last (`pipelined_fsdp`), charged with the states."""
    if cfg.zero < 2 or cfg.data_ranks == 1 or cfg.fsdp_in_pipeline:
        return 0.0
    block = max((n for kind, n in layers if kind == "block"), default=0.0)
    root = sum(n for kind, n in layers if kind != "block")
    blocks = sum(n for kind, n in layers if kind == "block")
    unmade = plan_state_bytes(cfg)[1] * (root + blocks)  # the gradient shards, made by the first backward
    if cfg.zero >= 3:
        forward = 2 * cfg.param_bytes * (root + block) - (unmade if micro_batches == 1 else 0.0)
    else:  # ZeRO 2 gathers in the first micro-batch's forward only, the later blocks not yet
        forward = cfg.param_bytes * (root + block) - cfg.param_bytes * (blocks - block) - unmade
    backward = (cfg.param_bytes + fsdp_reduce_dtype_bytes(cfg)) * root
    if cfg.zero == 2 and micro_batches == 1:  # the last backward reshards every unit, the root before it reduces
        backward -= cfg.param_bytes * (root + blocks)
    return max(forward, backward)


def fsdp_root_bytes(cfg, layers: list[tuple[str, float]]) -> float:
    """ZeRO-3 (FSDP2, outside a pipeline): the root unit's unsharded parameters (embedding, head, final norm) on a
    rank holding ``layers``, gathered by the root's pre-backward hook before the head's ops make their weights'
    gradients and held to the embedding's, but after the loss's backward, which the runtime runs outside the model
    (`fsdp_gathered_bytes`). Traced: GPT 2 × 256 with 32000 tied words, ZeRO-3 on 8 ranks, the embedding's backward
    holds the 31.3 MiB root gathered beside its gradients. Under pipelining the chunk's own gathering is charged
    per state (`state_bytes_at_peak`)."""
    if cfg.zero < 3 or cfg.data_ranks == 1 or cfg.fsdp_in_pipeline:
        return 0.0
    return cfg.param_bytes * sum(n for kind, n in layers if kind != "block")


def fsdp_reduce_bytes(cfg, layers: list[tuple[str, float]], gathered: list[tuple[str, float]] | None = None) -> float:
    """FSDP2's gradient buffers during a block's backward (ZeRO 2/3, not under pipelining, where it reduces once
    after the last micro-batch): the block's unsharded gradients (training precision) and one reduce-scatter input
    still in flight (reduce dtype: fp32 unless the plan compresses), which torch 2.13 frees only when the next
    block reduces (``reduce_scatter_max_input_buffers`` = 1, ``FSDPParamGroup.post_backward``). Traced: llama with
    0.81 GiB blocks and small activations, ZeRO-3 on 8 ranks, holds both at its peak. Pipelined, where a new
    gradient stays beside the accumulators until its unit's post-backward (`_pipelined_grad_beside`): the block's,
    and the head's through the whole backward of its chunk (the root's post-backward comes at its end). The
    reduce-scatter input is padded as the shards are (``gathered``: the same layers as FSDP2 gathers them,
    `costmodel.estimate.Evaluator.gathered_numel`; torch 2.13 ``foreach_reduce`` pads each gradient's dim 0),
    the gradients are not."""
    if cfg.zero < 2 or cfg.data_ranks == 1:
        return 0.0
    blocks = [n for kind, n in layers if kind == "block"]
    if cfg.fsdp_in_pipeline:
        head = sum(n for kind, n in layers if kind == "head")
        return cfg.param_bytes * (max(blocks, default=0.0) + head) if _pipelined_grad_beside(cfg) else 0.0
    return cfg.param_bytes * max(blocks, default=0.0) + fsdp_reduce_in_flight_bytes(cfg, gathered or layers)


def fsdp_reduce_in_flight_bytes(cfg, gathered: list[tuple[str, float]]) -> float:
    """One block's reduce-scatter input in flight (ZeRO 2/3, not under pipelining; ``gathered``: the rank's layers
    as FSDP2 gathers them, padded, `costmodel.estimate.Evaluator.gathered_numel`): torch 2.13 frees a unit's input
    only when the next unit reduces (``FSDPParamGroup.post_backward``, ``reduce_scatter_max_input_buffers`` = 1), so
    the lowest block's is still held while the token embedding, in the root unit that reduces last, runs its
    backward (traced: GPT 3 × 192 with 5000 tied words, ZeRO-2 and ZeRO-3 over 8 ranks, a 1.7 MiB block's input
    beside the three tied-weight gradients at the embedding's backward, 6.6 % of the peak). Charged at the rank's
    largest block, as the search sees a rank's blocks (counts)."""
    if cfg.zero < 2 or cfg.data_ranks == 1 or cfg.fsdp_in_pipeline:
        return 0.0
    padded = [n for kind, n in gathered if kind == "block"]
    return fsdp_reduce_dtype_bytes(cfg) * max(padded, default=0.0)


def inflight_chunks(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> list[float]:
    """Micro-batches whose activations each of pipeline rank ``rank``'s ``vpp`` stages (its chunks, in order)
    holds at the rank's peak (see the module docstring). Interleaved: torch 2.13's ScheduleInterleaved1F1B
    (schedules.py, _get_warmup_ops) runs (v − 1)·q + 2(p − 1 − r) forward chunks before its first backward and
    one more in steady state, assigning forwards to the rank's chunks in rounds of q = m // max(1, m // p)
    micro-batches; so the last rank's last chunk (the head's) holds one, its earlier chunks q each."""
    return list(_inflight_chunks(schedule, pp, vpp, rank, micro_batches))


@functools.lru_cache(maxsize=4096)
def _inflight_chunks(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> tuple[float, ...]:
    # the search asks for the same few ranks tens of thousands of times; interleaved counts walk every warm-up op
    if pp == 1:
        return (1.0,) * vpp
    if schedule == Schedule.INTERLEAVED:
        q = micro_batches // max(1, micro_batches // pp)
        ops = min((vpp - 1) * q + 2 * (pp - 1 - rank) + 1, micro_batches * vpp)
        counts = [0] * vpp
        for k in range(ops):
            counts[(k // q) % vpp] += 1
        return tuple(float(min(c, micro_batches)) for c in counts)
    if schedule == Schedule.ZERO_BUBBLE:  # those holding all their activations (the memory model adds those
        # pending a weight pass: `held_states`)
        states = held_states(schedule, pp, vpp, rank, micro_batches)
        return tuple(max(full[c] for full, *_ in states) for c in range(vpp))
    n = micro_batches if schedule == Schedule.GPIPE else pp - rank  # 1F1B: p − r
    return (float(min(n, micro_batches)),) * vpp


def pipeline_buffers(micro_batches: int, received: list[float], sent: list[float],
                     input_is_buffer: bool, zero_bubble: bool = False) -> tuple[float, list[float], float]:
    """What torch.distributed.pipelining itself holds on one pipeline rank beyond its layers' activations, as
    ``(static, per_micro_batch, after_backward)``; ``received[j]``/``sent[j]`` are the bytes per micro-batch of the
    activation the rank's j-th chunk receives / sends (0 for the first / the last stage), the gradients going back
    as many.

    torch 2.13's ``PipelineStage`` (stage.py) allocates its receive buffers once, for every micro-batch of the step,
    and keeps them: ``_setup_forward_recv_info`` one activation buffer per micro-batch in every stage but the
    first, ``_setup_backward_recv_info`` one output-gradient buffer per micro-batch in every stage but the last
    (``static``: m of each). A non-last stage's output stays in ``fwd_cache`` from its forward to its backward,
    where nothing inside the stage saves it (its last op, the residual add, saves nothing): ``sent[j]`` per
    micro-batch in flight. A received buffer is itself the stage's input, which its first layer saves (and the
    capture counts as that layer's activation), unless something runs between them (the tensor-parallel gather of
    Megatron's scatter/gather, a bf16 cast back): ``input_is_buffer`` then takes ``received[j]`` off per micro-batch
    in flight, as the static buffers hold it already. Under zero-bubble ``per_micro_batch`` applies to the
    micro-batches pending a weight pass as well (``backward_state`` keeps the stage output until then), and the input
    pass leaves each received buffer its gradient (``stage_backward_input`` sets ``.grad``, cleared at the next
    step's ``clear_runtime_states``): m more of them in every stage but the first after the backward
    (``after_backward``); at the activations' peak only those of the micro-batches past their input pass exist,
    which the held states do not count, and none is charged there. Traced: `autopar check` of 1F1B, interleaved and
    zero-bubble plans."""
    static = micro_batches * (sum(received) + sum(sent))
    per = [out - (into if input_is_buffer else 0.0) for into, out in zip(received, sent)]
    return static, per, static + (micro_batches * sum(received) if zero_bubble else 0.0)


def held_states(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> tuple[tuple, ...]:
    """The states of the rank's chunks that can set its activation peak, each ``(full, pending, made, gathered)``
    with a value per chunk (in order): the micro-batches holding all their activations; (zero-bubble only) those
    whose input gradient is done but not their weight gradient, which keep only what the weight pass needs
    (`costmodel.layercost.LayerCost.pending_bytes`); 1 where a backward (a weight pass) of the chunk has run, so
    that its gradients exist where the runtime frees them between steps (`state_bytes_at_peak`); 1 where the
    chunk's last pass was a backward, which leaves pipelined ZeRO 3's parameters gathered.

    Read off the order of each rank's passes as torch 2.13 runs them (`_rank_passes`): a state is what the rank
    holds after each forward and as each backward starts (the backward's working set comes on top: the model adds
    it to the heaviest state), Pareto-maximal (`_pareto`). So with few micro-batches a state holding the most may
    come before any backward, with no gradient: 1F1B reaches its p − r micro-batches again after a backward only
    when m > p − r; GPipe never; no pipeline, when m > 1."""
    return _held_states(schedule if pp > 1 else Schedule.ONE_F_ONE_B, pp, vpp, rank, micro_batches)


@functools.lru_cache(maxsize=4096)
def _held_states(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> tuple[tuple, ...]:
    full, pending, made, gathered = ([0] * vpp for _ in range(4))
    states = set()
    for chunk, kind in _rank_passes(schedule, pp, vpp, rank, micro_batches):
        if kind != "F":  # as a backward starts
            states.add((*full, *pending, *made, *gathered))
        if kind == "F":
            full[chunk] += 1
        elif kind == "B":
            full[chunk] -= 1
        elif kind == "I":
            full[chunk] -= 1
            pending[chunk] += 1
        elif kind == "W":
            pending[chunk] -= 1
        if kind in ("B", "W"):  # (an input pass makes no weight gradient)
            made[chunk] = 1
        gathered[chunk] = int(kind != "F")
        if kind == "F":  # as a forward ends
            states.add((*full, *pending, *made, *gathered))
    v = vpp
    return tuple(sorted(tuple(tuple(float(x) for x in s[j * v:(j + 1) * v]) for j in range(4))
                        for s in _pareto(states)))


def _rank_passes(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> list[tuple[int, str]]:
    """The rank's passes in torch 2.13's order, as (chunk, F/B/I/W): interleaved and zero-bubble from the orders
    torch builds (``ScheduleInterleaved1F1B._calculate_single_rank_operations``; ``_get_warmup_ops`` and
    ``_get_1f1b_rank_ops`` with ``enable_zero_bubble``); Schedule1F1B runs min(m, p − r) warm-up forwards, then a
    backward and a forward in turn, then the remaining backwards; GPipe every forward, then every backward; no
    pipeline (pp = 1) a forward and a backward per micro-batch. Under zero-bubble a micro-batch is full from its
    forward to its input-gradient pass (I), then pending until its weight pass (W: the input pass detaches the
    stage outputs, so only the weight ops' part of the graph stays); weight passes trail input passes by the rank's
    index, so later ranks hold more than 1F1B's p − r."""
    m = micro_batches
    if pp == 1:
        return [(0, kind) for _ in range(m) for kind in "FB"]
    if schedule == Schedule.GPIPE:
        return [(0, "F")] * m + [(0, "B")] * m
    if schedule not in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE):
        warm = min(m, pp - rank)
        return [(0, "F")] * warm + [(0, kind) for _ in range(m - warm) for kind in "BF"] + [(0, "B")] * warm
    from torch.distributed.pipelining import schedules as torch_schedules

    rounds = max(1, m // pp)
    per_round = m // rounds
    if schedule == Schedule.INTERLEAVED:
        from types import SimpleNamespace

        state = SimpleNamespace(n_local_stages=vpp, pp_group_size=pp, _n_microbatches=m,
                                microbatches_per_round=per_round)
        ops = torch_schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)
    else:
        warmup = torch_schedules._get_warmup_ops(rank, vpp, per_round, pp, m, multiply_factor=1)
        total = vpp * m
        steady = total - warmup

        def forward_stage(step):
            return ((step // per_round) % vpp) * pp + rank

        def backward_stage(step):
            return (vpp - 1 - ((step - warmup) // per_round) % vpp) * pp + rank

        ops = torch_schedules._get_1f1b_rank_ops(vpp, pp, warmup, steady, total - steady, rank, forward_stage,
                                                backward_stage, rank, enable_zero_bubble=True)
    # (``_value_``: the member's value without the enum's ``value`` descriptor, which dominated this line's time
    # over the thousands of passes of each of the search's ranks)
    return [(op.stage_index // pp, op.computation_type._value_) for op in ops if op is not None]


def _pareto(states: set[tuple]) -> list[tuple]:
    """The states no other is at least as high as in every coordinate. The state of largest sum left is one of them
    (a state that dominates another has a larger sum: the states are distinct), and every state it dominates is not
    (nor is one dominated through it), so each round keeps one and drops those below it, on all states at once: the
    search asks for hundreds of ranks with up to thousands of states each."""
    left = np.array(sorted(states), dtype=np.int64).reshape(len(states), -1)
    keep: list[tuple] = []
    while len(left):
        top = left[int(np.argmax(left.sum(axis=1)))]
        keep.append(tuple(top.tolist()))
        left = left[~(left <= top).all(axis=1)]
    return keep


def interleaved_states(pp: int, vpp: int, rank: int, micro_batches: int) -> tuple[tuple[float, ...], ...]:
    """The per-chunk counts of micro-batches in flight on pipeline rank ``rank`` under torch 2.13's
    ScheduleInterleaved1F1B at its peak states (`held_states`). The rank always holds (v − 1)·q + 2(p − 1 − r) + 1
    chunk-micro-batches at its peaks (`inflight_chunks`, the state at its first backward), but not always in the
    same chunks: in steady state each forward goes to the next chunk in rounds of q while each backward retires one
    from the chunks in reverse, so an early chunk comes to hold up to 2q while a late one holds none. Where the
    chunks' activations differ (the embedding's chunk, blocks with different AC), the peak is the heaviest of these
    states (traced: the 70B interleaved plan, pp = 4, v = 5, m = 16, peaked with rank 0's second and third chunks
    holding 8 and 7 micro-batches, against 4 at its first backward: 32 % over the activations of that state)."""
    return tuple(sorted({full for full, *_ in held_states(Schedule.INTERLEAVED, pp, vpp, rank, micro_batches)}))


def inflight(schedule: Schedule, pp: int, vpp: int, rank: int, micro_batches: int) -> float:
    """Micro-batches in flight on pipeline rank ``rank`` averaged over its chunks (`inflight_chunks`): the weight of
    a block when the blocks are spread evenly over the rank's chunks."""
    counts = inflight_chunks(schedule, pp, vpp, rank, micro_batches)
    return sum(counts) / len(counts)


def edge_inflight(schedule: Schedule, pp: int, vpp: int, micro_batches: int) -> tuple[float, float]:
    """(embedding, head): the micro-batches in flight on the first rank's first chunk and on the last rank's last
    chunk, where the layers outside the blocks live."""
    first = inflight_chunks(schedule, pp, vpp, 0, micro_batches)[0]
    last = inflight_chunks(schedule, pp, vpp, (pp * vpp - 1) % pp, micro_batches)[-1]
    return first, last


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Peak memory of one rank, bytes."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float  #: temporaries + allowance

    @property
    def peak(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "peak": self.peak}


def communicators(cfg) -> list[int]:
    """The sizes of the process groups a rank of ``cfg``'s runtime runs collectives on, each one NCCL communicator:
    the default group (the step's loss and the start's checks), and each mesh dimension of more than one rank
    (`planner.emit.runtime`: a (pp, dp, tp) DeviceMesh, one group per dimension, even one spanning every rank;
    with expert parallelism its ep and edp sub-dimensions too; with context parallelism a cp dimension and the
    flattened dp × cp group the gradients reduce over)."""
    sizes = [cfg.world] if cfg.world > 1 else []
    # expert parallelism adds the ep group and the ranks holding the same experts (costmodel.moe)
    experts = (cfg.ep, cfg.dp // cfg.ep) if getattr(cfg, "ep", 1) > 1 else ()
    context = (cfg.cp, cfg.dp * cfg.cp) if getattr(cfg, "cp", 1) > 1 else ()
    return sizes + [n for n in (cfg.dp, cfg.tp, cfg.pp, *experts, *context) if n > 1]


def runtime_reserved_bytes(cfg, device) -> float:
    """What a GPU rank of ``cfg`` holds outside torch's caching allocator on ``device``: what the device states
    (``runtime_reserved``, measured), else the CUDA context and NCCL's buffers, a communicator per `communicators`
    and, with pipelining, the point-to-point buffers of its two neighbours (one with two stages). Nothing on CPU
    (gloo's buffers are per call)."""
    if device.runtime_reserved is not None:
        return device.runtime_reserved
    if device.name == "cpu":
        return 0.0
    nccl = sum(NCCL_COMM_BYTES_PAIR if n == 2 else NCCL_COMM_BYTES for n in communicators(cfg))
    peers = min(2, cfg.pp - 1)
    return CUDA_CONTEXT_BYTES + nccl + peers * NCCL_P2P_PEER_BYTES


def allowance(allocated: float, reserved: float) -> float:
    """Fragmentation allowance on ``allocated`` bytes, and the runtime's ``reserved`` bytes
    (`runtime_reserved_bytes`)."""
    return FRAGMENTATION * allocated + reserved


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
