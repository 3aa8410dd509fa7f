"""What communication the schedule hides behind compute, and what stays exposed.

- DDP (ZeRO 0/1): gradients are all-reduced in buckets while the last micro-batch's backward runs (Li et al.
  2020, "PyTorch Distributed", §3.2.3). The part longer than that backward is exposed, and never less than the
  reduction of the last bucket (the first layer's gradients, at most the 25 MB bucket cap), which can only start
  when the backward ends. Where the runtime cannot use DDP's hooks (tensor-parallel DTensor parameters, the
  zero-bubble schedule's hand-written weight gradients: `costmodel.runnable.post_step_allreduce`) it all-reduces
  after the backward, and all of it is exposed. ZeRO-1 (torch's ZeroRedundancyOptimizer) then broadcasts the
  updated parameters from their owners inside its ``step()``, one broadcast per parameter tensor, issued together
  and then waited on (exposed, and part of the step's ``optimizer`` time: `zero1_sync_time`).
- ZeRO-2 (FSDP2 without resharding after forward): gradients are reduce-scattered every micro-batch under that
  micro-batch's backward (so they stay sharded through gradient accumulation); parameters are all-gathered once
  per step under the first forward.
- ZeRO-3 (FSDP2): every micro-batch all-gathers each layer's parameters for forward and again for backward,
  prefetching one layer ahead, and reduce-scatters its gradients; the communication longer than the compute it
  overlaps is exposed, plus the first layer's all-gather, which nothing hides. Under pipelining the gradients are
  reduce-scattered once per step and the parameters gathered m + 1 times, not 2m (`fsdp_gather_share`).
- FSDP2 also works on the computing stream, serial with compute whatever the device hides of the collectives
  (`fsdp_serial_time`): it copies every gathered parameter out of the all-gather's buffer and every gradient into
  the reduce-scatter's, and on a CPU its hooks and per-parameter bookkeeping run on the thread that computes.
  Per step a ZeRO-3 group does this for 2m gathers (m + 1 pipelined) and m reductions (1 pipelined), a ZeRO-2 group
  for 1 gather and m reductions (1 pipelined).
- While communication overlaps compute, the compute slows down by the device's ``overlap_slowdown`` (the
  collective kernels take SMs and memory bandwidth); that cost is added to the exposed time. On a device whose
  collectives run on the computing cores (the CPU: `costmodel.hardware.CPU_OVERLAP_SLOWDOWN` = 1) nothing is
  hidden. (DDP then charges its last bucket twice, once as the tail and once as slowed compute: ≤ 25 MB.)
"""

from __future__ import annotations

from costmodel.cluster import group_span
from costmodel.collectives import all_gather_time, all_reduce_time, broadcast_time, reduce_scatter_time
from costmodel.compression import SyncView, compressed_grad_comm
from costmodel.layercost import LayerCost
from costmodel.memory import fsdp_reduce_dtype_bytes, module_param_bytes

#: gradients are reduced in fp32 (DDP's fp32 grads; FSDP2 reduce_dtype=float32 unless the plan compresses them:
#: `costmodel.memory.fsdp_reduce_dtype_bytes`)
GRAD_REDUCE_BYTES = 4
#: bytes the runtime's gradient clipping moves per local gradient element (`planner.emit.train.clip_grad_norm`, fp32
#: gradients): the norm reads it (4), the scaling in place reads and writes it (8); torch's own
#: ``clip_grad_norm_`` (foreach norm, foreach mul) moves the same
CLIP_BYTES = 12
#: operators it dispatches per gradient tensor: the norm and the in-place scaling
CLIP_OPS = 2
#: bytes of the step's scalar all-reduces: the squared norm's and the loss's (one fp32 each)
SCALAR_BYTES = 4


#: bytes of an FSDP shard's element: the sharded parameters are fp32 masters, cast to a 16-bit compute dtype for
#: the all-gather under mixed precision (`planner.emit.runtime.fsdp_policy`; Composer's FSDP1 alike)
SHARD_BYTES = 4


def fsdp_serial_time(costs: list[LayerCost], ev: SyncView, event: str) -> float:
    """Seconds one ``event`` (``gather`` or ``reduce``: `costmodel.hardware.FSDP_EVENTS`) of each FSDP2 group holding
    ``costs`` (`fsdp_groups`) keeps the computing stream busy besides the collective (torch 2.13,
    fsdp/_fully_shard/_fsdp_collectives.py):

    - gather: ``foreach_all_gather_copy_out`` copies each parameter out of the gathered buffer
      (``split_with_sizes_copy``, on the current stream after ``wait_for_unshard``): the gathered elements read and
      written in the parameter dtype. Its copy-in, on the all-gather copy-in stream, takes of the compute only what
      an overlapped collective takes, ``overlap_slowdown``: the rank's shard (1/dp of the elements) copied into the
      buffer in the parameter dtype, and under mixed precision first cast from the fp32 shard
      (``_get_param_all_gather_inputs``' foreach copy into a flat 16-bit buffer): 10 bytes a shard element in
      bf16, 8 in fp32. FSDP1 (a published stack's: ``SyncView.fsdp_copy_out`` False) gathers its flat parameter's
      shard in place and uses views of the result: no copy-out and no copy-in, only the low-precision shard's cast
      (``FlatParamHandle._use_low_precision_shard``'s copy, on its pre-unshard stream): 6 bytes, or none in fp32.
    - reduce: ``foreach_reduce_scatter_copy_in`` concatenates the unsharded gradients into the reduce-scatter's
      input (``chunk_cat``, on the current stream before ``reduce_scatter_stream.wait_stream``): read in the
      gradient's dtype (the parameter's), written in the reduce dtype (`fsdp_reduce_dtype_bytes`); FSDP1's
      autograd concatenates them into its flat gradient alike. What follows on the shard (the division, the
      accumulation into the sharded gradient) is 1/dp of it: not priced.

    Both memory-bound (``DeviceSpec.fsdp_copy_rate``: ``hbm_bw × memory_eff``, or a CPU's measured rate), padded
    as FSDP2 gathers (`SyncView.gathered_numel`); plus the device's host time per group (`fsdp_groups`) and per
    parameter tensor (``DeviceSpec.fsdp_overhead_s``: 0 on GPUs). Additive over blocks; a stage's other layers
    count one group together."""
    cfg, dev = ev.cfg, ev.cluster.device
    numel = sum(ev.gathered_numel(c) for c in costs)
    pbytes = cfg.param_bytes
    if event == "gather":
        cast = SHARD_BYTES + pbytes if pbytes != SHARD_BYTES else 0  # the fp32 shard cast to the compute dtype
        copy = 2 * pbytes if ev.fsdp_copy_out else 0  # FSDP2's copy-out, and its copy-in of the shard alike
        moved = numel * (copy + dev.overlap_slowdown * (cast + copy) / cfg.data_ranks)
    else:
        moved = numel * (pbytes + fsdp_reduce_dtype_bytes(cfg))
    group, tensor = dev.fsdp_overhead(event)
    return moved / dev.fsdp_copy_rate + group * fsdp_groups(costs) + tensor * sum(c.param_tensors for c in costs)


def fsdp_events(cfg, m: int) -> dict[str, tuple[float, float]]:
    """(gathers, reductions) each FSDP2 group does per ``micro_batch`` (charged in its stage's time) and per
    ``step`` (after the pipeline): ZeRO-3 gathers 2·`fsdp_gather_share` times a micro-batch and reduces every
    micro-batch, or pipelined once a step; ZeRO-2 gathers once a step and reduces m times (pipelined once). None
    without FSDP or over one rank. What the evaluator, the ILP and the bounds charge `fsdp_serial_time` for."""
    none = (0.0, 0.0)
    if cfg.zero < 2 or cfg.data_ranks == 1:
        return {"micro_batch": none, "step": none}
    pipelined = cfg.fsdp_in_pipeline
    if cfg.zero == 3:
        return {"micro_batch": (2 * fsdp_gather_share(cfg, m), 0.0 if pipelined else 1.0),
                "step": (0.0, 1.0 if pipelined else 0.0)}
    return {"micro_batch": none, "step": (1.0, 1.0 if pipelined else float(m))}


def fsdp_serial(costs: list[LayerCost], ev: SyncView, per: str) -> float:
    """`fsdp_serial_time` of ``costs``' groups for their `fsdp_events` ``per`` micro-batch or step."""
    gathers, reductions = fsdp_events(ev.cfg, ev.m)[per]
    return ((gathers * fsdp_serial_time(costs, ev, "gather") if gathers else 0.0)
            + (reductions * fsdp_serial_time(costs, ev, "reduce") if reductions else 0.0))


def fsdp_groups(costs: list[LayerCost]) -> int:
    """The FSDP2 groups that hold ``costs`` (one stage's or rank's layers, or all blocks of a kind): one per block,
    and the root's, which holds the others (`planner.emit.runtime.apply_fsdp`: ``fully_shard`` on each block, then
    on the stage's module; a root whose layers are all in blocks has no parameters and gathers nothing)."""
    return sum(1 for c in costs if c.block) + (1 if any(not c.block for c in costs) else 0)


def grad_accumulation_time(params: float, ev: SyncView) -> float:
    """Per step, the memory-bound work of accumulating a rank's ``params`` unsharded gradients over its ``m``
    micro-batches, on the computing stream (at ``hbm_bw × memory_eff``; 0 with one micro-batch):

    - DDP, ZeRO-1, or any plan without FSDP (under ``no_sync``, or in pipeline stages): autograd's
      ``AccumulateGrad`` adds each new gradient into ``.grad`` in place from the second micro-batch on, reading
      both and writing one in the module's gradient dtype (`costmodel.memory.module_param_bytes`);
    - FSDP (ZeRO 2/3) outside a pipeline: every micro-batch reduce-scatters, so only the rank's shards accumulate
      (1/dp of this): not priced;
    - FSDP inside torch's pipeline stages, whose backwards before the last run without gradient sync
      (pipelining/stage.py): with a reduce dtype other than the parameters' (bf16 parameters, fp32 reduction)
      the first micro-batch casts its gradients to the reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``:
      read p, write r) and every later one adds into that (``accumulate_unsharded_grad_if_needed``: read p and r,
      write r), and the reduce-scatter's ``chunk_cat`` then reads r bytes where `fsdp_serial_time` counts p;
      with equal dtypes autograd accumulates as above.

    0 where the stack fuses the accumulation into the weight-gradient GEMM (``SyncView.fused_grad_accumulation``:
    Megatron-LM's ``gradient_accumulation_fusion``, on by default)."""
    cfg, m = ev.cfg, ev.m
    if m <= 1 or ev.fused_grad_accumulation:
        return 0.0
    if cfg.zero >= 2 and cfg.data_ranks > 1:
        if not cfg.fsdp_in_pipeline:
            return 0.0
        p, r = cfg.param_bytes, fsdp_reduce_dtype_bytes(cfg)
        per = (p + r) + (m - 1) * (p + 2 * r) + (r - p) if p != r else (m - 1) * 3 * p
    else:
        per = (m - 1) * 3 * module_param_bytes(cfg, ev.autocast)
    dev = ev.cluster.device
    return params * per / (dev.hbm_bw * dev.memory_eff)


def zero2_gather_time(params: float, ev: SyncView) -> float:
    """ZeRO-2 (FSDP2 without resharding): the once-per-step all-gather of a rank's parameters."""
    return all_gather_time(params * ev.cfg.param_bytes, ev.dp_span, ev.cluster)


def zero1_sync_time(rank_costs: list[LayerCost], ev: SyncView) -> float:
    """ZeRO-1 (ZeroRedundancyOptimizer): after the step every owner broadcasts its updated parameters, one
    broadcast per tensor, issued asynchronously and then waited on together (torch 2.13,
    ``ZeroRedundancyOptimizer._sync_params`` with ``parameters_as_bucket_view=False``, the runtime's): each a
    broadcast of its tensor (the rank's tensors taken as equal: its parameters over their count) with its call
    latency. The module's parameters, fp32 under autocast (`costmodel.memory.module_param_bytes`). On cpu-local
    (2 gloo ranks, the validate model's 39 fp32 tensors, 13.9 MB, after compute) this prices 12.6 ms where the
    runtime's pattern took 17.5 ms (median of 15; q0.1 9.2 ms); the all-gathers it was priced as before, 68 ms.
    They run inside ``step()``, so the breakdown's ``optimizer`` part holds them (`costmodel.estimate.Evaluator`), as
    `autopar validate` measures that phase (the optimizer's step hooks); 0 but under ZeRO-1 on > 1 data rank."""
    if ev.cfg.zero != 1 or not rank_costs:
        return 0.0
    params = sum(c.param_numel for c in rank_costs)
    n = max(1, sum(c.param_tensors for c in rank_costs))
    pbytes = module_param_bytes(ev.cfg, ev.autocast)
    return broadcast_time(params * pbytes, ev.dp_span, ev.cluster, calls=n)


def _hidden(comm: float, window: float, slowdown: float) -> tuple[float, float]:
    """(exposed, slowdown cost) of ``comm`` seconds overlapped with ``window`` seconds of compute."""
    return max(0.0, comm - window), slowdown * min(comm, window)


def dp_exposed(rank_costs: list[LayerCost], ev: SyncView) -> tuple[float, float]:
    """(exposed data-parallel communication after the last backward, compression encode/decode) of one rank.
    ZeRO-1's parameter broadcasts come after the optimizer step, inside it: `zero1_sync_time`."""
    cfg = ev.cfg
    if cfg.data_ranks == 1 or not rank_costs:
        return 0.0, 0.0
    span, cluster = ev.dp_span, ev.cluster
    slow = cluster.device.overlap_slowdown
    window = sum(c.bwd_s + c.recompute_s for c in rank_costs)  # the last micro-batch's backward on this rank
    if cfg.reduces_after_step:
        window = 0.0  # the runtime all-reduces after the whole backward (costmodel.runnable): nothing hides it
    params = sum(c.param_numel for c in rank_costs)
    first = rank_costs[0].param_numel
    pipelined = cfg.fsdp_in_pipeline
    gathered = sum(ev.gathered_numel(c) for c in rank_costs)  # (FSDP's collectives carry its shards' padding)
    if cfg.zero == 3:  # reduce-scatters happen per micro-batch (fsdp_exposed), or once after the pipeline
        if not pipelined:
            return 0.0, 0.0
        rs = reduce_scatter_time(gathered * fsdp_reduce_dtype_bytes(cfg), span, cluster)
        return rs + fsdp_serial(rank_costs, ev, "step"), 0.0
    if cfg.zero == 2:
        # every micro-batch reduce-scatters its gradients under its own backward (gradients stay sharded), or,
        # pipelined, once after the last backward, hidden by nothing; the once-per-step all-gather hides under the
        # first forward
        rs = reduce_scatter_time(gathered * fsdp_reduce_dtype_bytes(cfg), span, cluster)
        ag = zero2_gather_time(gathered, ev)
        fwd = sum(c.fwd_s for c in rank_costs)
        e1, s1 = (rs, 0.0) if pipelined else _hidden(rs, window, slow)
        e2, s2 = _hidden(ag, fwd, slow)
        return (1 if pipelined else ev.m) * (e1 + s1) + e2 + s2 + fsdp_serial(rank_costs, ev, "step"), 0.0
    comm, last, encode = compressed_grad_comm(rank_costs, params, first, ev)
    exposed, slowdown = _hidden(comm, window, slow)
    return max(exposed, last) + slowdown, encode


def fsdp_gather_share(cfg, m: int) -> float:
    """ZeRO-3's parameter all-gathers per micro-batch, as a share of one before the forward and one before the
    backward. Under pipelining torch's PipelineStage keeps the parameters unsharded after every backward but the
    last (``set_reshard_after_backward(False)``, pipelining/stage.py) while FSDP still reshards after each forward,
    so a stage gathers before an op only when its previous op was a forward (or it is the first): a stage's ops
    run F^w (F B)^k B^w in every torch 2.13 schedule, m + 1 gathers per step instead of 2m (traced by
    `autopar check`)."""
    return (m + 1) / (2 * m) if cfg.fsdp_in_pipeline else 1.0


def fsdp_exposed(stage_costs: list[LayerCost], ev: SyncView) -> float:
    """Per micro-batch, the ZeRO-3 parameter all-gathers and gradient reduce-scatters not hidden by compute, and
    FSDP2's work on the computing stream (`fsdp_serial_time`)."""
    span, cluster = ev.dp_span, ev.cluster
    slow = cluster.device.overlap_slowdown
    pbytes = 4 if ev.cfg.precision == "fp32" else 2
    share = fsdp_gather_share(ev.cfg, ev.m)
    # (each layer as FSDP2 gathers and reduces it: padded on every rank's shard, `SyncView.gathered_numel`)
    ag = [share * all_gather_time(ev.gathered_numel(c) * pbytes, span, cluster) for c in stage_costs]
    # pipelined, the reduce-scatter runs once per step after the last backward (dp_exposed), not per micro-batch
    rs_bytes = 0.0 if ev.cfg.fsdp_in_pipeline else fsdp_reduce_dtype_bytes(ev.cfg)
    rs = [reduce_scatter_time(ev.gathered_numel(c) * rs_bytes, span, cluster) for c in stage_costs]
    fwd = sum(c.fwd_s for c in stage_costs)
    bwd = sum(c.bwd_s + c.recompute_s for c in stage_costs)
    e_f, s_f = _hidden(sum(ag[1:]), fwd, slow)
    e_b, s_b = _hidden(sum(ag[:-1]) + sum(rs[1:]), bwd, slow)
    # and what FSDP2 does on the computing stream (`fsdp_serial`)
    return ag[0] + e_f + s_f + ag[-1] + e_b + s_b + rs[0] + fsdp_serial(stage_costs, ev, "micro_batch")


def optimizer_time(params: float, ev: SyncView, extra: float = 0.0) -> float:
    """Adam(W) step on the local shard: memory-bound. Per parameter it reads the fp32 weight, gradient and two
    moments (16 bytes), writes weight and moments (12) and the 16-bit copy (2): 30 bytes (fp32 training: 28).
    ``extra``: expert parameters FSDP shards beyond the rank's own (`LayerCost.expert_shard_extra`, ZeRO 2/3)."""
    cfg = ev.cfg
    local = (params + (extra if cfg.zero >= 2 else 0.0)) / (cfg.data_ranks if cfg.zero >= 1 else 1)
    per = 28 if cfg.precision == "fp32" else 30
    dev = ev.cluster.device
    return local * per / (dev.hbm_bw * dev.memory_eff)


def clip_time(params: float, tensors: float, ev: SyncView, extra: float = 0.0) -> float:
    """The runtime's gradient clipping before the optimizer step (`planner.emit.train.clip_grad_norm`), exposed:
    the squared L2 norm of the rank's gradients as the optimizer holds them (ZeRO 2/3: FSDP's fp32 shards, 1/(dp·cp)
    of them with the expert shards beyond the rank's own, ``extra``, as in `optimizer_time`; otherwise the module's
    fp32 gradients, whole), one all-reduce of that scalar over every rank, then every gradient scaled in place.
    Memory-bound, `CLIP_BYTES` per element, plus the device's host time per op for `CLIP_OPS` ops per parameter
    tensor (``tensors``; 0 on GPUs, `costmodel.hardware.DeviceSpec.op_overhead_s`). Priced with clipping on, the
    emitted script's default (``--clip-norm 0`` still takes the norm, for the log, and skips only the scaling).
    Measured on cpu-local (2 gloo ranks, the 3.5 M-parameter validate model, 39 fp32 tensors, DDP): median 2.15 ms
    (2.0-8.9 over 8 steps, its all-reduce included) against 1.9 ms priced without the all-reduce and 4.6 ms with it:
    the all-reduce's call latency (all_reduce's, 2.7 ms, measured after compute by `costmodel.gloo_bench`) was paid
    in 2 of the 8 steps."""
    cfg = ev.cfg
    local = (params + extra) / cfg.data_ranks if cfg.zero >= 2 else params
    dev = ev.cluster.device
    norm = (all_reduce_time(SCALAR_BYTES, group_span(ev.cluster, cfg.world, 1), ev.cluster)
            if "world" in step_scalars(cfg) else 0.0)
    return local * CLIP_BYTES / (dev.hbm_bw * dev.memory_eff) + tensors * CLIP_OPS * dev.op_overhead_s[0] + norm


def optimizer_part_time(params: float, tensors: float, ev: SyncView, extra: float = 0.0) -> float:
    """The step's ``optimizer`` part on one rank: the gradient clipping, then the optimizer step (`clip_time`,
    `optimizer_time`); what `costmodel.estimate.Evaluator`, the ILP and the search bounds charge."""
    return clip_time(params, tensors, ev, extra) + optimizer_time(params, ev, extra)


def loss_sync_time(ev: SyncView) -> tuple[float, float]:
    """(data-parallel, pipeline) seconds of the step's loss reductions (`planner.emit.train.train_step_loss`): the
    mean loss is one fp32 scalar all-reduced over the pipeline group (only the last stage holds it) and then over
    the data- and context-parallel group, after the optimizer step: exposed, latency only."""
    cfg, cluster = ev.cfg, ev.cluster
    groups = step_scalars(cfg)
    dp = all_reduce_time(SCALAR_BYTES, ev.dp_span, cluster) if "dp" in groups else 0.0
    pp = (all_reduce_time(SCALAR_BYTES, group_span(cluster, cfg.pp, cfg.dp * cfg.cp * cfg.tp), cluster)
          if "pp" in groups else 0.0)
    return dp, pp


def step_scalars(cfg) -> dict[str, float]:
    """The scalars the runtime all-reduces once per step, bytes by group (`planner.emit.train`): the squared
    gradient norm over every rank (``world``, `clip_time`), and the loss over the pipeline group (``pp``, only the
    last stage holds it) and then over the gradient-reduction group (``dp``: dp × cp, `loss_sync_time`). A group of
    one rank is left out: nothing is sent. What `clip_time` and `loss_sync_time` price, and what `autopar check`
    compares with the trace."""
    sizes = {"world": cfg.world, "pp": cfg.pp, "dp": cfg.data_ranks}
    return {group: SCALAR_BYTES for group, ranks in sizes.items() if ranks > 1}


def dp_step_bytes(cfg, params: float, m: int, autocast: bool = True) -> dict[str, float]:
    """The data-parallel collectives the terms above charge one rank per step, as payload bytes by kind (an
    all-gather's gathered size, a reduce-scatter's full input): what `autopar check` compares with the traced
    runtime. ``params``: the rank's parameters before ZeRO sharding (under ZeRO 2/3 as FSDP2 gathers them, padded:
    `SyncView.gathered_numel`); ``m``: micro-batches per step. PowerSGD's
    compressed rounds are not listed (their volume depends on the matrices: the check adds
    `costmodel.compression.powersgd_volume`'s).
    """
    pbytes = cfg.param_bytes
    kind = cfg.grad_compress.split("-")[0]
    if cfg.data_ranks == 1:
        return {}
    rs = 1 if cfg.fsdp_in_pipeline else m  # reduce-scatters per step
    if cfg.zero == 3:  # fsdp_exposed: per micro-batch, gathered for forward and again for backward
        gathers = 2 * m * fsdp_gather_share(cfg, m)
        return {"all_gather": gathers * params * pbytes, "reduce_scatter": rs * params * fsdp_reduce_dtype_bytes(cfg)}
    if cfg.zero == 2:  # dp_exposed: a reduce-scatter per micro-batch (pipelined: per step), one all-gather
        return {"all_gather": params * pbytes, "reduce_scatter": rs * params * fsdp_reduce_dtype_bytes(cfg)}
    out = {} if kind == "powersgd" else {"all_reduce": params * (2 if kind in ("bf16", "fp16") else GRAD_REDUCE_BYTES)}
    if cfg.zero == 1:  # zero1_sync_time: the owners' broadcasts, each tensor once
        out["broadcast"] = params * module_param_bytes(cfg, autocast)
    return out


def tp_partial_grads(rank_costs: list[LayerCost], cfg) -> list[float]:
    """The bytes of each gradient one rank sums over its TP group once per step, in the runtime's order, for the
    parameters whose gradient each TP rank computes from its share only (`LayerCost.tp_partial_sizes`;
    `planner.emit.runtime.reduce_tp_partial_grads`): fp32 gradients of this rank's parameters, or of its ZeRO 2/3
    shards of them (over dp; experts over the dp/ep ranks holding the same ones)."""
    if cfg.tp == 1:
        return []
    sharded = cfg.zero >= 2 and cfg.data_ranks > 1  # (ep divides dp: costmodel.runnable)
    return [4.0 * n / ((cfg.dp // cfg.ep if expert else cfg.data_ranks) if sharded else 1)
            for c in rank_costs for n, expert in c.tp_partial_sizes]


def tp_partial_bytes(rank_costs: list[LayerCost], cfg) -> float:
    """Bytes one rank all-reduces over its TP group once per step (`tp_partial_grads`)."""
    return sum(tp_partial_grads(rank_costs, cfg))
