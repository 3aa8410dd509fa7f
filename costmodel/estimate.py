"""Step time and memory of one training step for a model, a cluster and a parallel configuration.

Composition (all per optimizer step; m = global_batch / (dp · mbs) micro-batches per pipeline):

1. Each layer's per-micro-batch cost comes from `costmodel.layercost` (compute, recomputation, tensor-parallel
   collectives, activations). A (virtual) pipeline stage c adds its boundary transfers (`_p2p_time`) and, under
   ZeRO-3, the parameter all-gathers and gradient reduce-scatters it cannot hide behind its own compute
   (`costmodel.overlap.fsdp_exposed`): T_c per micro-batch. A pipeline rank r runs the stages c ≡ r (mod p):
   T_r = Σ T_c.
2. Pipeline: step = m · max_r T_r + φ · (Σ_r T_r − max_r T_r), the bottleneck rank repeated m times plus the
   fill/drain of the others: φ = 1 for GPipe and 1F1B (uniform stages: (m + p − 1)·T, Narayanan et al. 2021
   eq. 1 and the (p − 1)/m bubble), 1/v for the interleaved schedule (bubble (p − 1)/(v·m), ibid. §2.2.2), 1/3
   for zero-bubble ZB-H1 (bubble (p − 1)(T_F + T_B − T_W) ≈ ⅓ of 1F1B's with T_F ≈ T_B ≈ T_W, Qi et al. 2023
   §3.1). With p = 1 the step is m · T.
3. Data-parallel gradient reduction after the last micro-batch overlaps that micro-batch's backward
   (`costmodel.overlap.dp_exposed`); the slowest rank's exposed part is added, then the gradient clipping and the
   optimizer step (memory-bound, `optimizer_part_time`; under ZeRO-1 with its parameter broadcasts,
   `zero1_sync_time`) and the loss's reduction
   (`loss_sync_time`).

The same composition is what the planner's ILP linearises (planner/search/ilp.py); `evaluate` is its reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from costmodel.cluster import Cluster, group_span
from costmodel.collectives import all_gather_time, all_reduce_time, send_recv_time
from costmodel.compression import powersgd_memory, pp_cast_time
from costmodel.config import AC, ParallelConfig, Schedule, parse_grad_compress
from costmodel.layercost import (
    FLOAT8_RECIPES,
    CostContext,
    LayerCost,
    copy_time,
    dtype_bytes,
    is_tp_layer,
    layer_cost,
    owned_params,
    seq_relayout_bytes,
    vocab_output_bytes,
)
from costmodel.memory import (
    AUTOCAST_COPY_BYTES,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    MemoryBreakdown,
    allowance,
    autocast_dtype,
    ddp_largest_bucket,
    dp_reduction_temp_bytes,
    fsdp_chunk_gathered,
    fsdp_edge_bytes,
    fsdp_gathered_bytes,
    fsdp_padding_numel,
    fsdp_reduce_bytes,
    fsdp_reduce_in_flight_bytes,
    fsdp_root_bytes,
    fsdp_transient_grads,
    grads_accumulate,
    grads_always_held,
    head_grad_bytes,
    held_states,
    inflight_chunks,
    pipeline_buffers,
    plan_state_bytes,
    runtime_reserved_bytes,
    state_bytes_at_peak,
    zero1_partition_numel,
)
from costmodel.overlap import (
    dp_exposed,
    fsdp_exposed,
    grad_accumulation_time,
    loss_sync_time,
    optimizer_part_time,
    tp_partial_bytes,
    tp_partial_grads,
    zero1_sync_time,
)
from costmodel.runnable import selective_policy
from profiler.graph import LayerGraph
from profiler.layers import has_attention_core


class ConfigError(ValueError):
    """The configuration cannot run on this cluster or model; the message says why and how to fix it."""


def pipeline_factor(schedule: Schedule, vpp: int) -> float:
    """φ: the share of the non-bottleneck ranks' time that the schedule's fill and drain expose."""
    if schedule == Schedule.INTERLEAVED:
        return 1.0 / vpp
    if schedule == Schedule.ZERO_BUBBLE:
        return 1.0 / 3.0
    return 1.0


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One (virtual) pipeline stage."""

    index: int
    rank: int
    first: int
    last: int
    time_s: float  #: per micro-batch
    inflight: float
    memory_bytes: float  #: peak of its rank
    memory_parts: dict = field(default_factory=dict)  #: its rank's breakdown (MemoryBreakdown.to_dict)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted step of one configuration (the shared/DESIGN.md JSON contract, `to_json`)."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu_model: float
    tflops_per_gpu_hw: float
    mfu: float
    hfu: float
    fits: bool
    memory: MemoryBreakdown
    capacity_bytes: float
    breakdown_s: dict
    stages: tuple[StageEstimate, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu_model": self.tflops_per_gpu_model, "tflops_per_gpu_hw": self.tflops_per_gpu_hw,
            "mfu": self.mfu, "hfu": self.hfu, "fits": self.fits,
            "memory_per_gpu_bytes": self.memory.to_dict(), "capacity_bytes": self.capacity_bytes,
            "breakdown_s": dict(self.breakdown_s),
        }


def check_config(lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int) -> None:
    """Raise ConfigError if ``cfg`` cannot run this model on this cluster."""
    if cfg.world != cluster.world_size:
        raise ConfigError(f"dp·tp·pp·cp = {cfg.dp}·{cfg.tp}·{cfg.pp}·{cfg.cp} = {cfg.world} ranks, but cluster "
                          f"{cluster.name} has {cluster.world_size} GPUs; make the product match")
    if global_batch % (cfg.dp * cfg.mbs):
        raise ConfigError(f"global batch {global_batch} is not a multiple of dp·mbs = {cfg.dp}·{cfg.mbs}; "
                          "change --global-batch, dp or mbs")
    arch = lg.model.arch
    for key in ("heads", "kv_heads"):
        if cfg.tp > 1 and arch.get(key) and arch[key] % cfg.tp:
            raise ConfigError(f"tp={cfg.tp} does not divide {key}={arch[key]}; choose a tp that divides it")
    if cfg.tp > 1 and not any(is_tp_layer(layer) for layer in lg.blocks):
        raise ConfigError(f"tp={cfg.tp}: the blocks of {lg.model.name} have no recognised column/row linear pair, "
                          "so they cannot be tensor-parallelised; use tp=1")
    if cfg.ep > 1:
        experts = int(arch.get("experts") or 0)
        if experts < 2:
            raise ConfigError(f"ep={cfg.ep}: {lg.model.name} has no mixture-of-experts layers to split; use ep=1")
        if experts % cfg.ep:
            raise ConfigError(f"ep={cfg.ep} does not divide the {experts} experts; choose an ep that divides it")
    stages = cfg.pp * cfg.vpp
    if stages > len(lg.layers):
        raise ConfigError(f"pp·vpp = {stages} stages but the model has only {len(lg.layers)} layers")


def _attention_widths(arch: dict) -> tuple[int, int]:
    """(query, key) features per token from the capture's architecture facts: hidden, and kv_heads · hidden / heads
    (grouped-query attention; heads where there is no kv_heads); (0, 0) where the heads are unknown."""
    heads, hidden = int(arch.get("heads") or 0), int(arch.get("hidden") or 0)
    if not heads:
        return 0, 0
    return hidden, int(arch.get("kv_heads") or heads) * hidden // heads


def split_layers(lg: LayerGraph) -> tuple[list[int], list[int], list[int]]:
    """(pre, blocks, post): the run of blocks pipeline stages are cut inside is the longest run of consecutive
    layers that are blocks, whatever their kinds (signatures): alike blocks, dense and MoE blocks in turn, five
    local attention blocks and a global one, DeepSeek's leading dense blocks before its MoE blocks. A stage may
    start and end at any block of it and hold any mix of kinds. Every layer before the run is fixed on the first
    stage with the embedding, every layer after it on the last stage with the head (for the models autopar
    captures, the embedding and the head alone). One rule for the ILP, the outer search, its bounds and
    `even_stages`."""
    lo, hi = _run(_block_signatures(lg))
    n = len(lg.layers)
    return list(range(lo)), list(range(lo, hi)), list(range(hi, n))


def block_classes(lg: LayerGraph) -> list[list[int]]:
    """`split_layers`' run by kind: per block signature (in order of first appearance), the run's layers with it.
    The ILP counts each kind per stage; one kind for a model whose blocks are alike."""
    blocks = split_layers(lg)[1]
    by_kind: dict[str, list[int]] = {}
    for i in blocks:
        by_kind.setdefault(lg.layers[i].signature, []).append(i)
    return list(by_kind.values())


def _block_signatures(lg: LayerGraph) -> tuple:
    """Each layer's signature, None for a layer that is not a block: the key of the cached functions below."""
    return tuple(layer.signature if layer.kind == "block" else None for layer in lg.layers)


def _first_of_signature(lg: LayerGraph) -> dict[str, int]:
    """Block signature → the index of the first block with it (`Evaluator.cost`'s representative)."""
    return _firsts(_block_signatures(lg))


@functools.lru_cache(maxsize=256)
def _firsts(sig: tuple) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, s in enumerate(sig):
        if s is not None:
            out.setdefault(s, i)
    return out


@functools.lru_cache(maxsize=256)
def _run(sig: tuple) -> tuple[int, int]:
    """(start, end) of the longest run of consecutive blocks (the first of equal ones); (n, n) when there is no
    block. Cached: the search asks per candidate."""
    n = len(sig)
    best, i = (n, n), 0
    while i < n:
        if sig[i] is None:
            i += 1
            continue
        j = i
        while j < n and sig[j] is not None:
            j += 1
        if j - i > best[1] - best[0] or best[0] == n:
            best = (i, j)
        i = j
    return best


def stage_blocks_problem(lg: LayerGraph, n_stages: int) -> str:
    """Why ``n_stages`` pipeline stages cannot each get a block of `split_layers`' run ('' when they can): the one
    message of the ILP and the outer search."""
    run = len(split_layers(lg)[1])
    if n_stages <= 1 or n_stages <= run:
        return ""
    total = sum(1 for layer in lg.layers if layer.kind == "block")
    which = f"{run} blocks" if run == total else (
        f"{run} blocks in a row (of {total}: stages are cut only inside the longest run of consecutive blocks, "
        "costmodel.estimate.split_layers)")
    return f"pp·vpp = {n_stages} stages need a block each, and the model has only {which}; lower pp or vpp"


def even_stages(lg: LayerGraph, n_stages: int) -> list[int]:
    """Megatron's split: the blocks divided evenly by count (extra ones to the middle stages), the embedding on the
    first stage and the head on the last; layers outside the run (`split_layers`) with the embedding or the
    head."""
    pre, blocks, _ = split_layers(lg)
    if not blocks:
        per = -(-len(lg.layers) // n_stages)
        return [min(i // per, n_stages - 1) for i in range(len(lg.layers))]
    base, extra = divmod(len(blocks), n_stages)
    counts = [base] * n_stages
    middle = list(range(n_stages))[1:-1] or list(range(n_stages))
    for j in range(extra):
        counts[middle[j % len(middle)]] += 1
    stage_of = [0] * len(pre)
    for c, k in enumerate(counts):
        stage_of += [c] * k
    stage_of += [n_stages - 1] * (len(lg.layers) - len(stage_of))
    return stage_of


def block_acs(lg: LayerGraph, acs) -> tuple[AC, ...]:
    """Per-layer AC modes as the runtime applies them: it checkpoints blocks only, so every other layer (embedding,
    head) is none, whatever a pinned ``--fix ac=…`` gave it (`Evaluator.cost` prices them so)."""
    return tuple(a if layer.kind == "block" else AC.NONE for layer, a in zip(lg.layers, acs))


def selective_of(lg: LayerGraph, acs) -> str | None:
    """The selective-checkpointing policy a plan of ``lg`` with per-layer modes ``acs`` runs (`Plan.selective`):
    the runtime's policy for the model (`costmodel.runnable.selective_policy`) where any block is selective, else
    None."""
    return model_selective_policy(lg) if AC.SELECTIVE in block_acs(lg, acs) else None


def model_selective_policy(lg: LayerGraph) -> str:
    """The selective-checkpointing policy the runtime runs on ``lg``'s model (`costmodel.runnable.selective_policy`
    of its capture's facts)."""
    return selective_policy(has_attention_core(lg), lg.model.arch.get("attends"))


class Evaluator:
    """Costs of one (model, cluster, configuration, global batch); `evaluate` composes a step."""

    def __init__(self, lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
                 cache: dict | None = None, measured: tuple[dict, int] | None = None,
                 in_place_loss: bool = False, gathered_column_inputs: bool = True, compiled: bool = False,
                 selective: str | None = None, autocast: bool = True, seq_relayout: bool = True,
                 float8_recipe: str | None = "torchao", fsdp_copy_out: bool = True,
                 fused_grad_accumulation: bool = False, checkpoint_early_stop: bool = True,
                 fused_loss: bool = False, train_metrics: int = 0) -> None:
        """``cache``: optional dict shared by Evaluators of the *same* ``lg`` and ``cluster`` (e.g. a planner's
        candidates): the parameter ownership is computed once and layer costs are shared between
        configurations whose (tp, sp, mbs, precision, pp > 1) agree, the only configuration fields they depend on.
        Results are identical with and without it; it may carry ``"measured"`` for all of them.
        ``measured``: (layer name → measured (forward, backward) seconds, batch) from
        `costmodel.measured.load_measured`, used instead of the roofline's level (default: the graph's own
        `LayerGraph.timings`, measured on this machine for a CPU cluster). ``in_place_loss``: the
        stack's loss computes its gradient in place (`costmodel.layercost.CostContext.in_place_loss`; published runs
        of other stacks), unlike autopar's runtime; ``gathered_column_inputs``: its column-parallel linears save
        their whole input, as autopar's runtime does (`CostContext.gathered_column_inputs`; False for Megatron-LM);
        ``compiled``: the blocks run under torch.compile (`CostContext.compiled`); ``selective``: what selective
        checkpointing keeps (`CostContext.selective`; None: the runtime's policy for this model,
        `costmodel.runnable.selective_policy`); ``autocast``: outside FSDP the module's parameters stay
        fp32 under ``torch.autocast``, as in autopar's runtime (`costmodel.memory.state_bytes_per_param`; False
        for Megatron-LM's 16-bit parameters beside a master copy); ``seq_relayout``: the collectives along the
        sequence copy around NCCL's layout, as torch's DTensor does on autopar's batch-first activations
        (`costmodel.layercost.seq_relayout_bytes`; False for Megatron-LM's sequence-first ones); ``float8_recipe``:
        the recipe whose casts float8 training runs as kernels of their own (`costmodel.layercost.FLOAT8_RECIPES`,
        priced by `costmodel.layercost.float8_cast_costs`): torchao's, the torch-native stack's, by default;
        ``fsdp_copy_out``: sharded data parallelism copies each gathered parameter out of the all-gather's buffer,
        as FSDP2 does (`costmodel.overlap.fsdp_serial_time`; False for FSDP1's flat parameter, Composer's, whose
        parameters are views into the buffer it gathers into: torch 2.13 ``FlatParamHandle._all_gather_flat_param``
        and ``_get_unflat_views``); ``fused_grad_accumulation``: the stack accumulates gradients over
        micro-batches inside its weight-gradient GEMMs (Megatron-LM's ``gradient_accumulation_fusion``), where
        autopar's runtime adds them in memory-bound kernels (`costmodel.overlap.grad_accumulation_time`);
        ``checkpoint_early_stop``: full checkpointing stops recomputing once the backward's tensors are back, as
        torch's non-reentrant checkpoint does since 2.1 (`costmodel.layercost.CostContext.checkpoint_early_stop`;
        False for Megatron-LM's and torch 1.13's, which rerun the whole block); ``fused_loss``: the loss is one
        fused cross-entropy kernel on the 16-bit logits (`costmodel.layercost.fused_loss_bytes`; llm-foundry's), where
        autopar's runtime upcasts them and runs ``F.cross_entropy``; ``train_metrics``: cross entropies its trainer
        computes again on each micro-batch's logits without gradient (Composer's training metrics)."""
        check_config(lg, cluster, cfg, global_batch)
        if train_metrics and not fused_loss:  # (`fused_loss_bytes` adds them to the fused kernel's bytes only)
            raise ValueError("train_metrics are priced beside a fused loss only (fused_loss=True); "
                             "an unfused loss with training metrics is not supported yet")
        if float8_recipe is not None and float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"unknown float8 recipe {float8_recipe!r}; known: {', '.join(FLOAT8_RECIPES)}")
        if selective is None:
            selective = model_selective_policy(lg)
        self.autocast = autocast
        self.fsdp_copy_out = fsdp_copy_out
        self.fused_grad_accumulation = fused_grad_accumulation
        # a plan that trains under torch.autocast keeps its activations at the dtypes autocast gives them (the
        # fp32 residual stream, norms' fp32 inputs, the loss's fp32 logits): priced from the model captured
        # under autocast (`LayerGraph.under_autocast`) where it can be made, else from the 16-bit capture
        under = autocast_dtype(cfg, autocast)
        if under and not lg.model.arch.get("autocast"):
            lg = lg.under_autocast() or lg
        autocast_capture = bool(lg.model.arch.get("autocast"))
        if autocast_capture and not under:
            raise ValueError(f"a graph captured under autocast prices only plans that train under it (16-bit, "
                             f"zero ≤ 1), not precision={cfg.precision} zero={cfg.zero}")
        self.lg, self.cluster, self.cfg, self.global_batch = lg, cluster, cfg, global_batch
        self.m = global_batch // (cfg.dp * cfg.mbs)
        captured = dtype_bytes(lg.model.dtype)
        # the autocast capture holds each activation's real dtype; a plain capture is rescaled to the precision
        self.act_scale = 1.0 if autocast_capture else (4 if cfg.precision == "fp32" else 2) / captured
        gpn = cluster.gpus_per_node
        self.tp_span = group_span(cluster, cfg.tp, 1) if cfg.tp > 1 else None
        # the gradient-reduction group: dp × cp consecutive ranks of stride tp (`ParallelConfig.data_ranks`)
        self.dp_span = group_span(cluster, cfg.data_ranks, cfg.tp)
        # expert parallelism borrows consecutive dp ranks (`costmodel.moe`): stride tp·cp, like the dp group's
        self.ep_span = group_span(cluster, cfg.ep, cfg.tp * cfg.cp) if cfg.ep > 1 else None
        self.pp_cross_node = cfg.pp > 1 and cfg.dp * cfg.tp * cfg.cp >= gpn
        self.cp_span = group_span(cluster, cfg.cp, cfg.tp) if cfg.cp > 1 else None  # inside a node first, after tp
        arch = lg.model.arch
        q_width, kv_width = _attention_widths(arch)
        shared = cache if cache is not None else {}
        measured = measured if measured is not None else shared.get("measured")
        measured_device, larger = None, None
        if measured is None and lg.timings is not None:  # (a CPU cluster's model measured here: `layer_graph`)
            measured, measured_device = lg.timings.measured, lg.timings.device
            if measured and lg.timings.larger:
                larger = (lg.timings.larger, lg.timings.larger_batch)
        compiled = compiled or bool(shared.get("compiled"))  # (a search's candidates, `planner.search.outer`)
        self.ctx = CostContext(cluster=cluster, tp=cfg.tp, sp=cfg.sp, mbs=cfg.mbs,
                               captured_batch=lg.model.batch, precision=cfg.precision, act_scale=self.act_scale,
                               tp_span=self.tp_span, measured=measured[0] if measured else None,
                               measured_batch=measured[1] if measured else 1, measured_device=measured_device,
                               measured_larger=larger[0] if larger else None,
                               measured_larger_batch=larger[1] if larger else 0,
                               in_place_loss=in_place_loss,
                               gathered_column_inputs=gathered_column_inputs, seq_relayout=seq_relayout,
                               compiled=compiled,
                               selective=selective, experts=int(lg.model.arch.get("experts") or 0),
                               top_k=int(lg.model.arch.get("top_k") or 0), tokens=lg.model.seq,
                               hidden=int(lg.model.arch.get("hidden") or 0), ep=cfg.ep, ep_span=self.ep_span,
                               imbalance=cluster.moe_imbalance, cp=cfg.cp, cp_span=self.cp_span,
                               kv_width=kv_width, q_width=q_width, native_kernels=arch.get("kernels") == "native",
                               grad_exists=grads_accumulate(cfg, self.m), transient_grads=fsdp_transient_grads(cfg),
                               grad_bytes=4 if under else cfg.param_bytes, weight_cast_bytes=2 if under else 0,
                               casts_per_micro_batch=cfg.pp == 1, float8_recipe=float8_recipe,
                               autocast_capture=autocast_capture, checkpoint_early_stop=checkpoint_early_stop,
                               fused_loss=fused_loss, train_metrics=train_metrics)
        pipelined = cfg.pp > 1  # tied embedding/head weights have a copy on each end of the pipeline
        if ("owned", pipelined) not in shared:
            shared["owned", pipelined] = owned_params(lg, pipelined=pipelined)
        self.owned = shared["owned", pipelined]
        self._tied_numel: float | None = None  # elements of the embedding/head tied weight per rank (pp > 1)
        self._cache: dict[tuple[str, str, AC], LayerCost] = shared.setdefault(
            ("layer_costs", cfg.tp, cfg.sp, cfg.mbs, cfg.precision, bool(measured), in_place_loss,
             gathered_column_inputs, seq_relayout, compiled, selective, pipelined, cfg.ep, cfg.cp, autocast_capture,
             self.ctx.grad_exists, self.ctx.transient_grads, self.ctx.grad_bytes, self.ctx.weight_cast_bytes,
             float8_recipe, checkpoint_early_stop, fused_loss, train_metrics),
            {})
        self.grad_kind, self.grad_rank = parse_grad_compress(cfg.grad_compress)

    @functools.cached_property
    def _gradient_layers(self) -> list[LayerCost]:
        """Every layer's costs (their parameters and gradient shapes do not depend on the AC mode)."""
        return [self.cost(i, AC.NONE) for i in range(len(self.lg.layers))]

    @functools.cached_property
    def largest_bucket(self) -> float:
        """The largest of DDP's gradient buckets over the model's layers (`costmodel.memory.ddp_largest_bucket`; fp32:
        each layer's matrices, then the rest of its parameters as one), here and in the ILP; where the runtime reduces
        after the backward (`ParallelConfig.reduces_after_step`), its own buckets', which have no smaller first."""
        tensors = []
        for c in self._gradient_layers:
            in_matrices = [4.0 * m * n for m, n in c.grad_matrices]
            tensors += [*in_matrices, max(0.0, 4.0 * c.param_numel - sum(in_matrices))]
        return ddp_largest_bucket(tensors, DDP_BUCKET_BYTES if self.cfg.reduces_after_step else DDP_FIRST_BUCKET_BYTES)

    def powersgd_memory(self, rank: int) -> tuple[float, float]:
        """PowerSGD of ``rank`` over the model's layers (`costmodel.compression.powersgd_memory`): bytes per
        parameter it keeps from step to step, and the share of the gradients it sends whole; here and in the ILP."""
        return powersgd_memory(self._gradient_layers, rank)

    # -- per-layer and per-boundary pieces (the ILP's coefficients) ------------------------------------------
    def cost(self, i: int, ac: AC) -> LayerCost:
        """Layer ``i``'s costs at AC mode ``ac``. Blocks of one signature cost the same: the first of them in the
        model's order is costed for all (its captured input may hold tensors every block reads, such as rotary
        tables, counted once), whatever order the layers are asked for in."""
        layer = self.lg.layers[i]
        if layer.kind != "block":
            ac = AC.NONE  # the runtime checkpoints blocks only (planner.emit.runtime.apply_ac)
        else:
            layer = self.lg.layers[_first_of_signature(self.lg)[layer.signature]]
        key = (layer.signature, layer.name if layer.kind != "block" else "", ac)
        if key not in self._cache:
            c = layer_cost(layer, ac, self.ctx, self.owned[layer.name])
            if self.cfg.pp > 1 and layer.kind == "head":  # torch's PipelineStage keeps the last stage's output,
                # the logits (this rank's vocabulary slice under TP), from its forward to its backward (fwd_cache)
                c = replace(c, act_bytes=c.act_bytes + self.head_output_bytes(layer))
            self._cache[key] = c
        return self._cache[key]

    def head_output_bytes(self, layer) -> float:
        """Bytes of the head's output per micro-batch on one rank: its vocabulary projection's output."""
        tp = self.cfg.tp if self.cfg.tp > 1 and is_tp_layer(layer) else 1
        return vocab_output_bytes(layer) * self.ctx.scale * self.act_scale / tp

    def p2p_bytes(self, i: int) -> float:
        """Bytes one rank sends per micro-batch into a stage that starts at layer ``i`` (the gradient comes back
        with as many): each TP rank sends its 1/t slice (scatter/gather, Narayanan et al. 2021 §4.1; the runtime's
        ``apply_pp_scatter``), halved by bf16 boundaries."""
        nbytes = self.lg.layers[i].input_bytes * self.ctx.scale * self.act_scale / self.cfg.tp
        return nbytes / 2 if self._pp_cast() else nbytes

    def pipeline_buffers(self, rank: int, firsts: list[int]) -> tuple[float, list[float], float]:
        """torch's pipelining buffers on pipeline rank ``rank`` (`costmodel.memory.pipeline_buffers`), for stages
        starting at layers ``firsts``: each boundary carries `p2p_bytes` of its next stage's first layer. The
        received buffer is the first layer's saved input unless a tensor-parallel gather or a bf16 cast runs
        between them."""
        n_stages, pp = len(firsts), self.cfg.pp
        mine = range(rank, n_stages, pp)
        received = [self.p2p_bytes(firsts[c]) if c > 0 else 0.0 for c in mine]
        sent = [self.p2p_bytes(firsts[c + 1]) if c < n_stages - 1 else 0.0 for c in mine]
        return pipeline_buffers(self.m, received, sent, self.cfg.tp == 1 and not self._pp_cast(),
                                zero_bubble=self.cfg.zero_bubble)

    @property
    def wide_boundaries(self) -> bool:
        """Whether stage boundaries carry activations wider than 16 bits (fp32 training, and the fp32 residual
        stream under autocast), which ``pp_compress=bf16`` halves."""
        return self.act_scale * dtype_bytes(self.lg.model.dtype) > 2

    def _pp_cast(self) -> bool:
        return self.cfg.pp_compress == "bf16" and self.wide_boundaries

    def pp_gathers(self, i: int) -> list[float]:
        """Tensor-parallel all-gathers (gathered bytes) one micro-batch adds at a stage boundary before layer ``i``,
        as the runtime does it: each scattered transfer is completed by an all-gather (the receiver gathers the
        activation forward, the sender the gradient backward: `planner.emit.runtime.apply_pp_scatter`); with
        sequence parallelism the sender's last block also gathers its output and the receiver's first block's
        sequence slice gathers its gradient (`apply_tp`'s run edges). None without tensor parallelism."""
        if self.cfg.tp == 1:
            return []
        scattered = self.p2p_bytes(i) * self.cfg.tp
        out = [scattered, scattered]
        if self.cfg.sp:
            full = self.lg.layers[i].input_bytes * self.ctx.scale * self.act_scale
            out += [full, full]
        return out

    def p2p_time(self, i: int) -> float:
        """Per micro-batch, the activation into layer ``i`` and its gradient back, when a stage starts at i, with
        the tensor-parallel all-gathers around them (`pp_gathers`)."""
        nbytes = self.p2p_bytes(i)
        cast = 2 * pp_cast_time(nbytes, self.cluster) if self._pp_cast() else 0.0
        gather = sum(all_gather_time(g, self.tp_span, self.cluster) for g in self.pp_gathers(i))
        gather += copy_time(self.pp_gather_copies(i), self.ctx)
        return 2 * send_recv_time(nbytes, self.pp_cross_node, self.cluster) + cast + gather

    def pp_gather_copies(self, i: int) -> float:
        """Bytes torch copies around `pp_gathers` (`costmodel.layercost.seq_relayout_bytes`): the scattered
        transfer is gathered along the hidden dimension (`planner.emit.runtime._hidden_gather`), with the sequence
        before it, so always; sequence parallelism's two along the sequence beyond one sequence per micro-batch."""
        gathers = self.pp_gathers(i)
        return seq_relayout_bytes(sum(gathers[2:]), 0.0, self.ctx, hidden=sum(gathers[:2]))

    def tp_partial_sync_time(self, rank_costs: list) -> float:
        """The once-per-step sum over tp of the gradients TP ranks compute from their share only
        (`costmodel.overlap.tp_partial_bytes`), after the backward: exposed."""
        nbytes = tp_partial_bytes(rank_costs, self.cfg)
        return all_reduce_time(nbytes, self.tp_span, self.cluster) if nbytes else 0.0

    def tp_partial_bucket(self, rank_costs: list) -> float:
        """The largest flat copy of the gradients summed over tp after the backward (`costmodel.overlap.
        tp_partial_grads`), which the runtime packs as its other all-reduces after the backward
        (`planner.emit.runtime.allreduce_in_buckets`: `ddp_largest_bucket` with no smaller first), a part's at a time
        (one bucket over a rank's chunks here: at most a bucket over). Traced, MoE 3 × 256 (4 experts, top-2), tp 4
        with SP: its router and experts, 18 MiB, in one copy after the backward, the step's peak (unpriced: −13 %)."""
        return ddp_largest_bucket(tp_partial_grads(rank_costs, self.cfg), DDP_BUCKET_BYTES)

    @functools.cached_property
    def tied_in_flight_bytes(self) -> float:
        """Bytes of the head's gradient of a weight it shares with the token embedding on one rank (pp = 1), held in
        flight from the head's backward to the embedding's: autograd sums a tensor's gradients in the input buffer
        of its ``AccumulateGrad`` until every use has sent one (torch/csrc/autograd/input_buffer.cpp), so the head's
        waits through the blocks' backward. The embedding's backward then makes its own beside it and sums the two
        out of place (the head's arrives through a transpose, a view, which the buffer does not add into): three
        copies at once, the sum a temporary where ``.grad`` exists (`costmodel.layercost.weight_grad_working_set`
        counts the embedding's own). Traced: GPT 2 × 256 with 32000 tied words, DDP, 93.75 MiB of temporaries at the
        embedding's backward, three of its 31.25 MiB gradients. Under pipelining each end holds a copy of its own
        (`tied_bytes`)."""
        return self._tied_numel_here * self.ctx.grad_bytes

    @functools.cached_property
    def _tied_numel_here(self) -> float:
        """Elements on a rank of the weight the head reads and the token embedding owns (pp = 1; else 0)."""
        embed = next((layer for layer in self.lg.layers if layer.kind == "embed"), None)
        head = next((layer for layer in self.lg.layers if layer.kind == "head"), None)
        if self.cfg.pp > 1 or embed is None or head is None:
            return 0.0
        read = {p for n in head.nodes if n.kind == "matmul" for p in n.params}
        return sum(p.numel for p in self.owned[embed.name] if p.fqn in read) / self.cfg.tp

    def cast_cache_bytes(self, costs: list[LayerCost]) -> float:
        """Autocast's cached 16-bit copies of the weights it casts (`costmodel.memory.AUTOCAST_COPY_BYTES`), on a
        rank holding the layers of ``costs``, where the plan trains under ``torch.autocast``: the matmuls' own
        weights and a tied head's (`LayerCost.cast_numel`). Held through each autocast region (a micro-batch's, or
        torch's pipeline schedule's: `planner.emit.train.train_step_loss`), charged with the parameters."""
        if not autocast_dtype(self.cfg, self.autocast):
            return 0.0
        # (a tied head's weight is the embedding's only where one rank holds both: pp = 1)
        return AUTOCAST_COPY_BYTES * (sum(c.cast_numel for c in costs) + self._tied_numel_here)

    @functools.cached_property
    def cache_after_backward(self) -> bool:
        """Whether a rank still holds `cast_cache_bytes` at the step's moment after the backward (`_rank_memory`'s
        ``after_backward``): the runtime's autocast regions end with the backward (a micro-batch's each, or torch's
        schedule's: `planner.emit.train.train_step_loss`), and a region's end frees its copies, so the post-step
        reductions and the optimizer step run without them; only DDP's reduction of its last bucket, inside the last
        backward (`costmodel.memory.grads_always_held`: DDP reducing as it goes), sees them. Traced, llama 6 × 320
        bf16 full AC, dp 4 × tp 2 (the gradients all-reduced after the step): 6.5 % over with them."""
        return grads_always_held(self.cfg)

    @functools.cached_property
    def holds_cast_grads(self) -> bool:
        """Whether a pipeline stage's backward holds the 16-bit gradients of autocast's copies to its end
        (`autocast_held_bytes`): 16-bit training under autocast (`costmodel.memory.autocast_dtype`) in torch's
        pipeline schedules, the runtime's one region over all the micro-batches; not zero-bubble's, whose input
        pass on a stage past the first stops at the stage's inputs and whose weight pass asks `autograd.grad` for a
        parameter group at a time (traced, llama 6 × 320 bf16 without checkpointing, dp 4 × pp 2: −1.5 % / +1.8 %
        unpriced)."""
        return self.cfg.pp > 1 and not self.cfg.zero_bubble and autocast_dtype(self.cfg, self.autocast) is not None

    def cast_grad_excess(self, c: LayerCost) -> float:
        """What a block's 16-bit weight gradients held to the end of a backward (`autocast_held_bytes`) exceed the
        activations its backward frees by (0 where they do not)."""
        return max(0.0, AUTOCAST_COPY_BYTES * c.cast_numel - c.act_bytes) if self.holds_cast_grads else 0.0

    def autocast_held_bytes(self, chunk: list[int], costs: list[LayerCost]) -> tuple[float, float, float]:
        """The 16-bit weight gradients a backward of pipeline chunk ``chunk`` (layer indices; ``costs`` by layer)
        holds to its end, where a micro-batch after the first runs it (`holds_cast_grads`): autocast's copy of a
        weight is the first micro-batch's, reused by every later one, and autograd runs the nodes of a backward in
        the order they were made, latest first, so in a later micro-batch's backward the copies' cast-backs come
        after all of its own nodes and each 16-bit weight gradient (`AUTOCAST_COPY_BYTES` per element of
        `LayerCost.cast_numel`) waits for the end of the stage's backward (measured on real tensors, CPU autocast, 4
        blocks: 8 of 8 alive at the second micro-batch's embedding backward, none at the first's). Returns (at the
        embedding's backward, its chunk's last node: all of them; at a block's, on top of what its moment holds: the
        head's and each block's `cast_grad_excess`, less the lowest block's, which `Evaluator._rank_memory` takes
        off with that block's working set; as the cast-backs run, with the micro-batch's activations gone: all of
        them, beside which each cast-back makes its gradient's fp32 copy, `_rank_memory`'s ``cast_back``)."""
        if not self.holds_cast_grads:
            return 0.0, 0.0, 0.0
        kinds = [self.lg.layers[i].kind for i in chunk]
        every = AUTOCAST_COPY_BYTES * sum(costs[i].cast_numel for i in chunk)
        above = sum(AUTOCAST_COPY_BYTES * costs[i].cast_numel if kind == "head" else self.cast_grad_excess(costs[i])
                    for i, kind in zip(chunk, kinds) if kind in ("head", "block"))
        return (every if "embed" in kinds else 0.0), above, every

    def tied_sync_time(self, rank: int) -> float:
        """Megatron's embedding-group all-reduce (`planner.emit.runtime.sync_tied_grads`): with pp > 1 the first and
        the last pipeline rank each hold a copy of a weight tied between the embedding and the head, and sum its
        fp32 gradient over the two after the backward, before the optimizer: exposed. Zero on other ranks."""
        cfg, nbytes = self.cfg, self.tied_bytes()
        if cfg.pp == 1 or rank not in (0, cfg.pp - 1) or not nbytes:
            return 0.0
        span = group_span(self.cluster, 2, cfg.dp * cfg.tp * cfg.cp * (cfg.pp - 1))
        return all_reduce_time(nbytes, span, self.cluster)

    def tied_bytes(self) -> float:
        """fp32 gradient bytes of the tied weight's copy on one end of the pipeline (0 without pipelining or ties);
        the embedding and the head are vocabulary-parallel under TP, and under ZeRO 2/3 the runtime sums the rank's
        FSDP2 gradient shard, 1/(dp·cp) of it (`sync_tied_grads`: both copies hold the same shard. Traced: GPT-3
        175B, dp 32 ZeRO-2, 18.8 MiB where the whole copy, 600 MiB, was priced)."""
        if self._tied_numel is None:
            embed = next((layer.name for layer in self.lg.layers if layer.kind == "embed"), None)
            head = next((layer.name for layer in self.lg.layers if layer.kind == "head"), None)
            numel = 0.0
            if self.cfg.pp > 1 and embed and head:
                both = {p.fqn for p in self.owned[embed]} & {p.fqn for p in self.owned[head]}
                numel = sum(p.numel for p in self.owned[embed] if p.fqn in both)
            shards = self.cfg.data_ranks if self.cfg.zero >= 2 else 1
            self._tied_numel = numel / (self.cfg.tp * shards)
        return 4.0 * self._tied_numel

    def static_bytes(self, params: float, extra: float = 0.0) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes of ``params`` parameters after the backward (ZeRO's model
        states, `state_bytes_per_param`); ``extra``: expert parameters ZeRO 2/3 shards beyond those
        (`LayerCost.expert_shard_extra`), whose fp32 shards, gradient shards and moments are held 1/dp each."""
        p, g, k = plan_state_bytes(self.cfg, self.autocast)
        xp, xg, xk = self.extra_bytes_per_param()
        return params * p + extra * xp, params * g + extra * xg, params * k + extra * xk

    def zero1_excess_bytes(self, costs: list[LayerCost]) -> float:
        """Optimizer bytes a rank holding the layers of ``costs`` keeps under ZeRO-1 beyond its even share (what
        `static_bytes` charges): ``ZeroRedundancyOptimizer`` partitions whole tensors, and its most loaded rank keeps
        the state of `costmodel.memory.zero1_partition_numel` elements. Autopar's runtime only: Megatron-LM's
        distributed optimizer shards its flat buffer evenly (``autocast`` False)."""
        dp = self.cfg.data_ranks
        if self.cfg.zero != 1 or dp == 1 or not self.autocast:
            return 0.0
        sizes = [s for c in costs for s in c.param_sizes]
        k = plan_state_bytes(self.cfg, self.autocast)[2] * dp  # the state's bytes per element, before sharding
        return k * max(0.0, zero1_partition_numel(sizes, dp) - sum(n for n, _, _ in sizes) / dp)

    def fsdp_padding(self, c: LayerCost) -> float:
        """Elements of layer ``c``'s FSDP2 shards on a rank beyond its even share (`costmodel.memory.
        fsdp_padding_numel`), where FSDP2 shards it over the data ranks: ZeRO 2/3 without expert parallelism (under
        it the experts' shards are `LayerCost.expert_shard_extra`'s, not padded here); else 0."""
        dp = self.cfg.data_ranks
        if self.cfg.zero < 2 or dp == 1 or self.cfg.ep > 1:
            return 0.0
        return fsdp_padding_numel(c.param_sizes, dp)

    def fsdp_padding_bytes(self, costs: list[LayerCost]) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes of the padding of a rank's FSDP2 shards holding the layers of
        ``costs`` (`fsdp_padding`), beyond the even share `static_bytes` charges: the fp32 shard, the gradient shard
        and Adam's two moments of each padded element, and under ZeRO 2 its gathered parameters, padded on every
        rank's shard (`gathered_numel`)."""
        x = sum(self.fsdp_padding(c) for c in costs)
        # ZeRO 2 keeps the gathered parameters (`state_bytes_per_param`), padded as gathered (`gathered_numel`)
        gathered = self.cfg.param_bytes * self.cfg.data_ranks * x if self.cfg.zero == 2 else 0.0
        return 4.0 * x + gathered, 4.0 * x, 8.0 * x

    def gathered_numel(self, c: LayerCost) -> float:
        """Elements of a layer's parameters as FSDP2 gathers them: its padded shards from every rank
        (`fsdp_padding`). The all-gather output and the unsharded parameters, views into it, are that size (torch
        2.13 ``FSDPParam.init_all_gather_outputs``, ``init_unsharded_param``): a grouped expert weight of 4 experts
        on 8 ranks gathers 8. Traced (moe 2 × 256, 4 experts, ZeRO-3 on 8 ranks): the first block's forward holds a
        13.0 MiB gathered block where its parameters are 7.0."""
        return c.param_numel + self.cfg.data_ranks * self.fsdp_padding(c)

    def gathered_padding_bytes(self, costs: list[LayerCost]) -> float:
        """Pipelined ZeRO 3: the padding of the chunks' gathered parameters at the end of the backward, where they
        all stay gathered (`static_bytes` holds them unpadded; the peak states, padded through `gathered_numel`)."""
        if not (self.cfg.zero >= 3 and self.cfg.fsdp_in_pipeline):
            return 0.0
        return self.cfg.param_bytes * self.cfg.data_ranks * sum(self.fsdp_padding(c) for c in costs)

    def rank_state_extras(self, costs: list[LayerCost]) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes a rank holding the layers of ``costs`` keeps beyond the per-parameter
        states of `static_bytes`, at every moment of the step: autocast's cached 16-bit weights
        (`cast_cache_bytes`), FSDP's padded shards (`fsdp_padding_bytes`, the gradient shards charged from the
        start) and ZeRO-1's uneven partition (`zero1_excess_bytes`). The estimate and the ILP read them here."""
        pad_p, pad_g, pad_o = self.fsdp_padding_bytes(costs)
        return self.cast_cache_bytes(costs) + pad_p, pad_g, pad_o + self.zero1_excess_bytes(costs)

    def extra_bytes_per_param(self) -> tuple[float, float, float]:
        """Bytes per `LayerCost.expert_shard_extra` parameter: FSDP's fp32 shard, gradient shard and two moments
        over dp (ZeRO 2/3); nothing otherwise (a rank then holds its own experts only)."""
        dp = self.cfg.dp
        return (4.0 / dp, 4.0 / dp, 8.0 / dp) if self.cfg.zero >= 2 and dp > 1 else (0.0, 0.0, 0.0)

    def peak_static_bytes(self, params: float, extra: float = 0.0) -> tuple[float, float, float, float, float]:
        """Model-state bytes at a state of the activation peak (`costmodel.memory.state_bytes_at_peak`): ``(params,
        grads, optimizer)`` held at every state, then the gradients of a chunk a backward ran on and the gathered
        parameters of a chunk whose last pass was a backward, for ``params`` parameters (``extra``, expert shards
        beyond them, `extra_bytes_per_param`: their gradients come with the rank's first backward)."""
        p, g, k, made, gathered = state_bytes_at_peak(self.cfg, self.autocast)
        xp, xg, xk = self.extra_bytes_per_param()
        x_made = 0.0 if grads_always_held(self.cfg) else xg
        return (params * p + extra * xp, params * g + extra * (xg - x_made), params * k + extra * xk,
                params * made + extra * x_made, params * gathered)

    # -- composition -----------------------------------------------------------------------------------------
    def evaluate(self, acs: list[AC] | None = None, stage_of: list[int] | None = None) -> Estimate:
        cfg, lg = self.cfg, self.lg
        n_layers = len(lg.layers)
        acs = acs or [cfg.ac] * n_layers
        n_stages = cfg.pp * cfg.vpp
        stage_of = stage_of or even_stages(lg, n_stages)
        costs = [self.cost(i, acs[i]) for i in range(n_layers)]
        stages = [[i for i in range(n_layers) if stage_of[i] == c] for c in range(n_stages)]
        if any(not s for s in stages):
            raise ConfigError(f"{n_stages} pipeline stages but a stage got no layer; use fewer stages")

        t_stage, parts = [], []
        for c, idx in enumerate(stages):
            comp = sum(costs[i].fwd_s + costs[i].bwd_s for i in idx)
            rec = sum(costs[i].recompute_s for i in idx)
            tpc = sum(costs[i].tp_comm_s for i in idx)
            epc = sum(costs[i].ep_comm_s for i in idx)
            cpc = sum(costs[i].cp_comm_s for i in idx)
            p2p = self.p2p_time(idx[0]) if c > 0 else 0.0
            fsdp = 0.0
            if cfg.zero == 3 and cfg.data_ranks > 1:
                fsdp = fsdp_exposed([costs[i] for i in idx], self)
            t_stage.append(comp + rec + tpc + epc + cpc + p2p + fsdp)
            parts.append({"compute": comp, "recompute": rec, "tp_comm": tpc, "ep_comm": epc, "cp_comm": cpc,
                          "pp_comm": p2p, "fsdp": fsdp})
        rank_of = [c % cfg.pp for c in range(n_stages)]
        t_rank = [sum(t for c, t in enumerate(t_stage) if rank_of[c] == r) for r in range(cfg.pp)]
        bottleneck = max(range(cfg.pp), key=lambda r: t_rank[r])
        phi = pipeline_factor(cfg.schedule, cfg.vpp)
        pipe = self.m * t_rank[bottleneck] + phi * (sum(t_rank) - t_rank[bottleneck])

        # data-parallel gradient reduction and the optimizer, per rank; the slowest rank finishes the step
        dp_exp, opt, comp_cost, mems, partial, accumulate = [], [], [], [], [], []
        for r in range(cfg.pp):
            idx = [i for c in range(n_stages) if rank_of[c] == r for i in stages[c]]
            rc = [costs[i] for i in idx]
            params = sum(x.param_numel for x in rc)
            extra = sum(x.expert_shard_extra for x in rc)
            exposed, encode = dp_exposed(rc, self)
            dp_exp.append(exposed)
            comp_cost.append(encode)
            # (ZeRO-1's parameter broadcasts run inside the optimizer's step: its part of the breakdown)
            opt.append(optimizer_part_time(params, sum(x.param_tensors for x in rc), self, extra)
                       + zero1_sync_time(rc, self))
            accumulate.append(grad_accumulation_time(params, self))
            partial.append(self.tp_partial_sync_time(rc))
            mems.append(self._rank_memory(r, rank_of, stages, costs, acs, params, extra))
        tied = [self.tied_sync_time(r) for r in range(cfg.pp)]
        loss_dp, loss_pp = loss_sync_time(self)  # the step's loss, averaged over the ranks: every rank waits for it
        finish = [dp_exp[r] + comp_cost[r] + opt[r] + tied[r] + partial[r] + accumulate[r] + loss_dp + loss_pp
                  for r in range(cfg.pp)]
        last = max(range(cfg.pp), key=lambda r: finish[r])
        step = pipe + finish[last]

        b = [c for c in range(n_stages) if rank_of[c] == bottleneck]
        agg = {k: sum(parts[c][k] for c in b) for k in parts[0]}
        breakdown = {
            # (the gradients' accumulation over the micro-batches runs in their backwards: compute)
            "compute": self.m * agg["compute"] + accumulate[last], "recompute": self.m * agg["recompute"],
            "tp_comm": self.m * agg["tp_comm"] + partial[last], "cp_comm": self.m * agg["cp_comm"],
            "pp_comm": self.m * agg["pp_comm"] + tied[last] + loss_pp,
            "dp_comm_exposed": self.m * agg["fsdp"] + dp_exp[last] + loss_dp,
            "bubble": pipe - self.m * t_rank[bottleneck],
            "optimizer": opt[last], "compression": comp_cost[last],
        }
        if cfg.ep > 1:  # the expert all-to-alls (a key beyond shared/DESIGN.md's set, only where there are any)
            breakdown["ep_comm"] = self.m * agg["ep_comm"]
        worst = max(range(cfg.pp), key=lambda r: mems[r].peak)
        model_flops = 3 * sum(c.fwd_flops for c in costs) * self.m * cfg.dp  # per step, all ranks
        hw_flops = model_flops + sum(c.recompute_flops for c in costs) * self.m * cfg.dp
        world = cfg.world
        dev = self.cluster.device
        peak = dev.peak(cfg.precision) if cfg.precision in dev.peak_flops else max(dev.peak_flops.values())
        tokens = self.global_batch * lg.model.seq
        stage_est = tuple(
            StageEstimate(index=c, rank=rank_of[c], first=stages[c][0], last=stages[c][-1], time_s=t_stage[c],
                          inflight=inflight_chunks(cfg.schedule, cfg.pp, cfg.vpp, rank_of[c], self.m)[
                              sum(1 for b in range(c) if rank_of[b] == rank_of[c])],
                          memory_bytes=mems[rank_of[c]].peak, memory_parts=mems[rank_of[c]].to_dict())
            for c in range(n_stages))
        return Estimate(
            step_time_s=step, tokens_per_s=tokens / step,
            tflops_per_gpu_model=model_flops / step / world / 1e12, tflops_per_gpu_hw=hw_flops / step / world / 1e12,
            mfu=model_flops / step / world / peak, hfu=hw_flops / step / world / peak,
            fits=mems[worst].peak <= self.cluster.memory_budget_bytes, memory=mems[worst],
            capacity_bytes=self.cluster.memory_budget_bytes,
            breakdown_s=breakdown, stages=stage_est,
        )

    def _freed_before(self, i: int, chunk: list[int], costs: list[LayerCost]) -> float:
        """Activations of its micro-batch gone by the time layer ``i`` of ``chunk`` runs its backward, which the
        rank's held activations count: the token embedding's backward is the chunk's last, after every other layer's
        has freed what it saved (zero-bubble's weight pass excepted, charged as it is)."""
        if self.lg.layers[i].kind != "embed" or self.cfg.zero_bubble:
            return 0.0
        return sum(costs[j].act_bytes for j in chunk if j != i)

    def edge_peak_bytes(self, i: int, ac: AC, root: float, prefetch: float = 0.0) -> float:
        """The backward working set of the embedding or the head (layer ``i`` at checkpointing ``ac``), the
        largest of its moments: its own (`LayerCost.backward_peak_bytes`: the loss's, before FSDP gathers the root);
        while its ops make their weights' gradients (`LayerCost.weight_peak_bytes`), with ZeRO-3's gathered root
        unit ``root`` (`costmodel.memory.fsdp_root_bytes`) and a tied weight's gradients in flight
        (`tied_in_flight_bytes`: the head's own from its matmul on; at the embedding, the head's, the embedding's
        own, counted by its layer cost where it is a temporary, and their sum); and, for the head under ZeRO-3, the
        root's pre-backward unshard, whose flat all-gather output lives through the copy-out into the unsharded
        parameters (torch 2.13 ``FSDPParamGroup.wait_for_unshard``, freed at its end in backward) beside the
        logits' gradient, before the head's weight gradient exists; the next unit's all-gather output ``prefetch``
        is in flight from then on (pipelined ZeRO 3, `costmodel.memory.fsdp_chunk_gathered`). Traced (llama 2 × 256,
        32000 words, seq 256, ZeRO-3 on 8 ranks): the head's backward at 2 × 62.5 MiB of root beside the 31.25 MiB
        logits' gradient."""
        return max(self.edge_moments(i, ac, root, prefetch))

    def edge_moments(self, i: int, ac: AC, root: float, prefetch: float = 0.0) -> list[float]:
        """`edge_peak_bytes`' moments, in order: the layer's own, its weights' gradients (the only one ``root``'s
        gathering adds to beyond the head's, and ``prefetch`` to), and for the head under ZeRO-3 the root's
        copy-out (the ILP adds its expressions to the second)."""
        c, kind = self.cost(i, ac), self.lg.layers[i].kind
        own = self.ctx.grad_exists or self.ctx.transient_grads  # (the layer cost counts its own new gradient)
        tied = self.tied_in_flight_bytes * {"head": 1, "embed": 2 if own else 3}.get(kind, 0)
        moments = [c.backward_peak_bytes, c.weight_peak_bytes + root + prefetch + tied]
        if kind == "head" and root:
            made = c.param_numel * self.ctx.grad_bytes if own else 0.0
            moments.append(c.weight_peak_bytes - made + 2 * root)
        return moments

    def _rank_memory(self, r, rank_of, stages, costs, acs, params, extra=0.0) -> MemoryBreakdown:
        cfg = self.cfg
        p_b, always, o_b, _, _ = self.peak_static_bytes(params, extra)
        _, _, _, made_pp, gathered_pp = state_bytes_at_peak(cfg, self.autocast)
        rank_costs = [costs[i] for c, idx in enumerate(stages) if rank_of[c] == r for i in idx]
        more_p, more_g, more_o = self.rank_state_extras(rank_costs)
        p_b, always, o_b = p_b + more_p, always + more_g, o_b + more_o
        x_made = self.peak_static_bytes(0.0, extra)[3]  # the expert shards' gradients, with the first backward
        # torch's own receive buffers (static, kept from step to step) and the outputs its stages keep for their
        # backward (per micro-batch in flight, pending a weight pass included)
        buffers, per_micro_batch, buffers_after = self.pipeline_buffers(r, [idx[0] for idx in stages])
        # every gradient, no activation left (nor autocast's copies but where `cache_after_backward`)
        after_backward = sum(self.static_bytes(params, extra)) + buffers_after + more_p + more_g + more_o
        if not self.cache_after_backward:
            after_backward -= self.cast_cache_bytes(rank_costs)
        after_backward += self.gathered_padding_bytes(rank_costs)
        chunks = [c for c in range(len(stages)) if rank_of[c] == r]  # the rank's chunks, in order
        mine = [stages[c] for c in chunks]
        full = [sum(costs[i].act_bytes for i in idx) for idx in mine]
        # zero-bubble (`held_states`' pending): the first stage's input pass has no input gradient to compute (the
        # tokens need none) and does nothing, so its micro-batches stay as the forward left them until the weight
        # pass; elsewhere the input pass builds the weight ops' output gradients on top of the full activations
        pending = [full[k] if c == 0 else sum(costs[i].pending_bytes for i in idx)
                   for k, (c, idx) in enumerate(zip(chunks, mine))]
        building = [0.0 if c == 0 else sum(costs[i].weight_output_bytes for i in idx) for c, idx in zip(chunks, mine)]
        states = held_states(cfg.schedule, cfg.pp, cfg.vpp, r, self.m)
        held_by = [buffers + sum(f * a + p * b + (f + p) * x
                                 for f, p, a, b, x in zip(fs, ps, full, pending, per_micro_batch))
                   for fs, ps, _, _ in states]
        # the chunks' gradients once a backward ran on them, their parameters gathered while their last pass was one
        chunk_params = [sum(costs[i].param_numel for i in idx) for idx in mine]
        grads_at = [sum(d * n for d, n in zip(made, chunk_params)) * made_pp + (x_made if max(made) else 0.0)
                    for _, _, made, _ in states]
        kinds = [[self.lg.layers[i].kind for i in idx] for idx in mine]
        numel = [[self.gathered_numel(costs[i]) for i in idx] for idx in mine]  # as FSDP2 gathers them, padded
        chunk_gathered = [sum(n) for n in numel]
        gathered_at = [sum(d * n for d, n in zip(gath, chunk_gathered)) * gathered_pp for *_, gath in states]
        with_grads = [h + g + q for h, g, q in zip(held_by, grads_at, gathered_at)]
        held = [(kind, costs[i].param_numel) for idx, ks in zip(mine, kinds) for i, kind in zip(idx, ks)]
        gathering = [(kind, n) for ks, ns in zip(kinds, numel) for kind, n in zip(ks, ns)]
        root = fsdp_root_bytes(cfg, gathering)  # (gathered when the head's weight gradients are made, not for its loss)
        blocks = [(costs[i].backward_peak_bytes, costs[i].act_bytes) for idx, ks in zip(mine, kinds)
                  for i, kind in zip(idx, ks) if kind == "block"]
        block_peak = max((b for b, _ in blocks), default=0.0)  # the largest backward working set of a block
        # ...and, beside the 16-bit weight gradients a later micro-batch's backward holds (`autocast_held_bytes`),
        # the lowest block's: its own excess is not held yet
        lowest_cast = max((costs[i].backward_peak_bytes - self.cast_grad_excess(costs[i]) for idx, ks in
                           zip(mine, kinds) for i, kind in zip(idx, ks) if kind == "block"), default=0.0)
        # pipelined ZeRO 3 (`costmodel.memory.fsdp_chunk_gathered`): what a backward gathers of its chunk where the
        # state does not hold it gathered already; elsewhere nothing beyond ZeRO-3's own `root` and `in_block`
        chunk_whole = [gathered_pp * n for n in chunk_gathered]
        chunk_root = [gathered_pp * sum(n for kind, n in zip(ks, ns) if kind != "block")
                      for ks, ns in zip(kinds, numel)]
        largest = gathered_pp * max((n for kind, n in gathering if kind == "block"), default=0.0)
        reducing = fsdp_reduce_in_flight_bytes(cfg, gathering)
        # a pipelined backward under autocast, where the chunk's backward is a later micro-batch's: the 16-bit weight
        # gradients held to its end, at the embedding's moment and on top of a block's (`autocast_held_bytes`)
        cast_held = [self.autocast_held_bytes(idx, costs) for idx in mine]
        # ...and as the cast-backs run: all of them, the micro-batch's activations on the chunk gone, and the fp32
        # copy of one (at most the rank's largest; the first, the weight cast last in the forward, is the head's or
        # a block's down projection) on its way to ``.grad``
        cast_back = 4.0 * max((c.cast_largest for c in rank_costs), default=0.0)
        # (charged wherever autocast's gradients are held: an upper bound on a chunk whose blocks all run under one of
        # torch's selective checkpoint policies, which cast nothing they cache, as the ILP sees it, `cast_largest`
        # being any checkpointing's)
        cast_backs = [(k, every + cast_back - f) for k, ((_, _, every), f) in enumerate(zip(cast_held, full))] \
            if self.holds_cast_grads else []
        edges = []  # the embedding's and head's: (chunk, bytes with the chunk gathered at the state, without, and
        # what a later micro-batch's backward adds)
        for k, (idx, ks) in enumerate(zip(mine, kinds)):
            for i, kind in zip(idx, ks):
                if kind != "block":
                    # what its moments shed: the micro-batch's other activations, less (the embedding's backward,
                    # the root unit's last) the lowest block's reduction beside it
                    shed = self._freed_before(i, idx, costs) - (reducing if kind == "embed" else 0.0)
                    gathered = self.edge_peak_bytes(i, acs[i], root) - shed
                    later = cast_held[k][0] if kind == "embed" else 0.0
                    if gathered_pp:
                        held_here, prefetch = fsdp_chunk_gathered(kind, chunk_whole[k], chunk_root[k], largest)
                        edges.append((k, gathered, self.edge_peak_bytes(i, acs[i], held_here, prefetch) - shed,
                                      later))
                    else:
                        edges.append((k, gathered, gathered, later))
        # ZeRO-3 outside a pipeline: a block's backward with the root and two blocks gathered
        in_block = fsdp_gathered_bytes(cfg, gathering) if cfg.zero == 3 and cfg.data_ranks > 1 and not gathered_pp \
            else 0.0
        extra = head_grad_bytes(cfg, held, self.m, r, self.autocast) + fsdp_reduce_bytes(cfg, held, gathering)
        extra += self.tied_in_flight_bytes
        zero_bubble = cfg.zero_bubble
        # pipelined ZeRO 3: a chunk's lowest block's backward, with its chunk gathered whole and the micro-batch's
        # other blocks' activations freed (an input pass frees none); and, in a chunk whose output is its top block's
        # (no head), the root's pre-backward copy-out beside the top block and the next one's buffer: the root's
        # flat all-gather output and its unsharded parameters (traced, llama 4 × 256 at 256 tokens, stage 0: the
        # 7.8 MiB embedding twice, a 3.0 MiB block and the next one's buffer)
        highest, lowest, copy_out = [], [], []  # (chunk, working set, its gathering)
        if gathered_pp and blocks:
            # the top block's: its chunk's root, the rank's two largest blocks (the search sees a rank's blocks as
            # counts: `fsdp_gathered_bytes`)
            two = fsdp_gathered_bytes(cfg, [(kind, n) for kind, n in gathering if kind == "block"])
            highest = [(k, block_peak, two + chunk_root[k]) for k in range(len(mine))]
            own = max(b + (0.0 if zero_bubble else a) for b, a in blocks)
            lowest = [(k, own - (0.0 if zero_bubble else sum(costs[i].act_bytes for i, kind in zip(idx, ks)
                                                             if kind == "block")), chunk_whole[k])
                      for k, (idx, ks) in enumerate(zip(mine, kinds))]
            copy_out = [(k, 0.0, two + 2 * chunk_root[k]) for k, ks in enumerate(kinds)
                        if "head" not in ks and chunk_root[k]]
        # a block's backward comes after the head's: that micro-batch's head activations (the logits) are gone
        head_act = sum(costs[i].act_bytes for idx in mine for i in idx if self.lg.layers[i].kind == "head")

        def moment(gath, made):  # the backward working sets beyond the state, its chunks gathered as ``gath``
            # says, and (autocast) holding the 16-bit weight gradients of the chunks ``made`` says ran a backward
            edge = max([(e_in if gathered_pp and gath[k] else e_out) + (later if made[k] else 0.0)
                        for k, e_in, e_out, later in edges] + [b for k, b in cast_backs if made[k]], default=0.0)
            if not blocks:
                return 0.0, edge
            if not gathered_pp:
                held = max((above for (_, above, _), m in zip(cast_held, made) if m), default=0.0)
                work = max(block_peak, lowest_cast + held) if held else block_peak
                return work + in_block + extra - (0.0 if zero_bubble else head_act), edge
            block = max(b + w * (1 - gath[k]) for k, b, w in highest + lowest + copy_out) + extra
            return block - (0.0 if zero_bubble else head_act), edge

        # the heaviest state of each gathering of the rank's chunks, with the moments that gathering leaves
        peaks = []
        for gath in sorted({g for *_, g in states}):
            at = [s for s, (*_, g) in enumerate(states) if g == gath]
            top = max(at, key=with_grads.__getitem__)
            if zero_bubble:  # ...and while a block's input pass runs, those gradients built so far on top
                block, edge = moment(gath, states[top][2])
                built = max(with_grads[s] + max((g for f, g in zip(states[s][0], building) if f >= 1), default=0.0)
                            for s in at) - with_grads[top]
                temp = max(block + built, edge)
            else:  # (each state with its own moments: which chunks' backwards hold 16-bit weight gradients; ties
                # to the heaviest state, then to the first)
                temps = {s: max(moment(gath, states[s][2])) for s in at}
                top = max(at, key=lambda s, heaviest=top: (with_grads[s] + temps[s], s == heaviest))
                temp = temps[top]
            peaks.append((with_grads[top] + temp, top, temp))
        _, top, temp = max(peaks)
        act, g_b, p_b = held_by[top], always + grads_at[top], p_b + gathered_at[top]
        whole = 1.0
        if self.grad_kind == "powersgd" and cfg.data_ranks > 1:
            # error feedback (one fp32 copy of the local gradients) and the low-rank factors, held step to step
            per, whole = self.powersgd_memory(self.grad_rank)
            temp += per * params
            after_backward += per * params
        # a peak after the backward: every gradient, and the reduction's copies of the last bucket, then the TP sum's
        # (one after the other); FSDP's at the ends of a micro-batch, with the root's parameter group in flight
        after_backward += max(dp_reduction_temp_bytes(cfg, self.grad_kind, 4.0 * params, whole, self.largest_bucket),
                              self.tp_partial_bucket(rank_costs))
        after_backward += fsdp_edge_bytes(cfg, gathering, self.m)
        temp += max(0.0, after_backward - (p_b + g_b + o_b + act + temp))
        allocated = p_b + g_b + o_b + act + temp
        return MemoryBreakdown(params=p_b, grads=g_b, optimizer=o_b, activations=act,
                               other=temp + allowance(allocated, runtime_reserved_bytes(cfg, self.cluster.device)))


def estimate(lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
             acs: list[AC] | None = None, stage_of: list[int] | None = None,
             measured: tuple[dict, int] | None = None, compiled: bool = False) -> Estimate:
    """Predict one training step: `Evaluator(lg, cluster, cfg, global_batch).evaluate(acs, stage_of)`."""
    return Evaluator(lg, cluster, cfg, global_batch, measured=measured, compiled=compiled).evaluate(acs, stage_of)
