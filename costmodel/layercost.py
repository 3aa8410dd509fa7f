"""Per-layer costs for one micro-batch under a parallel configuration: compute, recomputation, tensor-parallel
communication and saved activations.

Compute is a roofline per captured node: ``max(flops / (peak · eff(flops)), bytes / (hbm_bw · memory_eff))`` with
the size-dependent matmul efficiency of the device (`costmodel.hardware.EfficiencyCurve`). The profile was
captured at batch ``B0``; FLOPs, bytes and saved activations of a transformer scale linearly with the batch, so
a micro-batch ``b`` multiplies them by ``b / B0``.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) divides the work of nodes with a ``column``, ``row``,
``sharded`` or ``vocab`` role (profiler/layers.py) by ``t``; ``replicated`` nodes (norms, residual adds, dropout
outside the attention/MLP) run in full on every rank unless sequence parallelism shards them along the sequence
(Korthikanti et al. 2022 §4.2.2). Communication per micro-batch, on the critical path: forward, one all-reduce of
each row-parallel output; backward, one all-reduce of the input gradient of each group of column-parallel linears
sharing an input (2 + 2 per block, as in Narayanan et al. 2021 §3.3: 8bsh(t−1)/t bytes per layer). With sequence
parallelism each all-reduce becomes an all-gather plus a reduce-scatter of the same total volume, so the time is
the same (Korthikanti §4.2.2). A vocabulary-parallel embedding all-reduces its output; the vocabulary-parallel
head all-reduces its input gradient (loss-parallel statistics are a few bytes per token and are neglected). With
sequence parallelism the runtime (`planner.emit.runtime.apply_tp`) slices the embedding's output into the first
block (backward: an all-gather) and all-gathers the last block's output for the head (forward), each half an
all-reduce's payload. Two things torch adds: DTensor's sequence-parallel collectives copy the whole activation
between its batch-first layout and NCCL's dim 0 (`tp_relayout_bytes`, `seq_relayout_bytes`: read from torch 2.13's
functional collectives, traced by `autopar check`, part of tp_comm's time), and float8 training gathers in float8
(`gather_scale`). A rank's share of a split linear does 1/t of its FLOPs but still reads or writes the
whole activation on its unsplit side (`_whole_bytes`), which is what a skinny GEMM's time is.

Context parallelism (``cp`` ranks share each sequence; `planner.emit.runtime.apply_cp`): the sequence is cut into
2·cp chunks and a rank holds chunks r and 2·cp − 1 − r (torchtitan's and Megatron-LM's load balancing), so every
token-wise op does 1/cp of its work and saves 1/cp of its activations, and so does causal attention: a rank's two
query chunks attend to (r + 1)·c and (2·cp − r)·c keys, (2·cp + 1)·c² score blocks in all, of which the
lower-right-aligned causal kernels skip half of the two diagonal blocks: 2·cp·c² = S²/(2·cp), the causal S²/2 over
cp. The runtime's attention all-gathers each block's keys and values (their grouped-query heads only) over the cp
group before it and reduce-scatters their gradients after the backward (Llama 3's all-gather context parallelism,
Dubey et al. 2024 §3.3.2), on the critical path; a fully checkpointed block gathers again when it recomputes.
FLOPs as torch's counter counts them (whole score rectangles, as for the capture's causal attention) are
(2·cp + 1)·c² per rank against the capture's S² = 4·cp²·c².

Every captured op also pays the device's ``op_overhead_s`` in its forward and in its backward: on a CPU the thread
that dispatches an op runs it too (measured per machine, `costmodel.hardware._measure_cpu_device`); 0 on GPUs.
Under tensor parallelism the ops the runtime runs as DTensors (`dtensor_ops`: the split linears, and the norms of
sequence parallelism) also pay the device's ``dtensor_overhead_s`` (sharding propagation and wrapping, in Python:
~200-400 µs per op on this VM's CPU against ~5 µs for a plain op) and ``dtensor_byte_s`` per byte the op's forward
moves on the rank (`dtensor_bytes`: activations, ~0.13-0.76 ns/B here; a linear of 8×128 tokens moves 2.5 MB, 0.3-1.9
ms more each way); 0 on GPUs; and so does a recomputation of them.

A measured profile (`profiler.measure` on the cluster's device) replaces the roofline's absolute level layer by
layer: the measured forward and backward at the measured batch, times the roofline's ratio between the
configuration and that reference (so TP, SP, EP, the micro-batch and compilation still scale as the roofline says;
the reference is one eager process). Measured at a second, larger batch too (a CPU cluster's layers timed here), a
layer's time is the line through both: a fixed part plus one in proportion to the roofline (`measured_scale`).
The graph's own times (`LayerGraph.timings`, a CPU cluster's) are referred to
the device that measured them (`CostContext.measured_device`), so a device recalibrated to be slower than it
measured scales them too; a --profile's to the cluster's device.

Activation checkpointing (Korthikanti et al. 2022 Table 2 and §5):
- ``none`` keeps every saved activation;
- ``selective`` recomputes the unfused attention core (ops producing or reading seq×seq scores) and drops its
  seq×seq saved tensors, keeping autograd's saved tensors of the rest where the core is checkpointed whole (its
  ``attend`` call) or every op's output where a per-op policy keeps all but the core; with a fused (flash)
  attention kernel it is torchtitan's per-op policy (`CostContext.selective`);
- ``full`` keeps only the layer's input and recomputes its forward (tensor-parallel all-reduces included) just
  before its backward, up to where torch's non-reentrant checkpoint stops early (`recompute_stop`), or whole where
  the checkpoint does not stop early (`CostContext.checkpoint_early_stop`: torch 1.13's, Megatron-LM's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache

from costmodel.cluster import Cluster, GroupSpan
from costmodel.collectives import all_gather_time, all_reduce_time, all_to_all_time, reduce_scatter_time
from costmodel.config import AC
from costmodel.hardware import DeviceSpec
from costmodel.moe import COUNT_BYTES, a2a_calls, is_expert_param, moe_modules
from profiler.graph import LINEAR_OP, Layer, LayerGraph, NodeInfo, ParamInfo

_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "fp32": 4, "float32": 4, "bfloat16": 2, "float16": 2}
_SHARDED_ROLES = ("column", "row", "sharded", "vocab")


def dtype_bytes(name: str) -> int:
    return _BYTES[name]


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer costs one rank for one micro-batch."""

    fwd_s: float  #: forward compute
    bwd_s: float  #: backward compute
    recompute_s: float  #: forward recomputation before the backward (AC)
    tp_comm_fwd_s: float  #: tensor-parallel collectives of the forward, not overlapped
    tp_comm_bwd_s: float  #: tensor-parallel collectives of the backward and the recomputation, not overlapped
    act_bytes: float  #: activations kept from forward to backward
    backward_peak_bytes: float  #: extra bytes alive while this layer's backward runs: the recomputed forward's
    #: activations (under AC) and the gradient working set (twice the widest node output)
    #: the part of ``backward_peak_bytes`` while the layer's parameters' gradients are made (its ops reading them:
    #: `weight_grad_working_set`), when FSDP has gathered them (the head's loss runs before)
    weight_peak_bytes: float = 0.0
    param_numel: float  #: parameters held by one rank before ZeRO sharding (after TP)
    fwd_flops: float  #: forward FLOPs of the whole layer (all TP ranks), for model FLOPs
    recompute_flops: float  #: recomputed FLOPs of the whole layer, for hardware FLOPs
    grad_matrices: tuple[tuple[int, int], ...]  #: local 2-D gradient shapes (for PowerSGD), others count as vectors
    param_tensors: int = 0  #: parameter tensors the layer owns (collectives issued per tensor)
    #: each parameter tensor the layer owns: (its elements on this rank, whether it is a matrix, its rows on this
    #: rank), for ZeRO-1's partition of whole tensors (`costmodel.memory.zero1_partition_numel`) and FSDP's padded
    #: shards (`costmodel.memory.fsdp_padding_numel`)
    param_sizes: tuple[tuple[float, bool, int], ...] = ()
    #: elements on this rank of the parameters its matmuls read directly, which ``torch.autocast`` casts to 16 bits
    #: and caches for its region (`costmodel.memory.AUTOCAST_COPY_BYTES`; of those it owns: a weight another layer
    #: owns and it reads, a tied head's, is `costmodel.estimate.Evaluator.cast_cache_bytes`'s); 0 under autocast
    #: where the layer is selectively checkpointed: its copies are not cached
    cast_numel: float = 0.0
    #: the largest of its matmuls' weights' elements on this rank, whatever its checkpointing (the fp32 copy a
    #: cast-back makes of one 16-bit gradient: `costmodel.estimate.Evaluator.autocast_held_bytes`)
    cast_largest: float = 0.0
    #: what torch's zero-bubble schedule keeps of a micro-batch from its input-gradient pass to its weight pass
    #: (pipelining/_backward.py, ``stage_backward_input``, which runs ``autograd.grad(retain_graph=True)``, then
    #: detaches the stage's output): the retained graph's saved activations, less those of the nodes after the last
    #: op reading a parameter in the head (the loss: nothing the weight pass needs reaches them), and the gradients
    #: at the outputs of the ops reading a parameter, kept for the weight pass. Traced (llama, pp = 2): the last
    #: stage's input pass frees the loss's 1000 MiB and adds 1268 MiB of such gradients per micro-batch
    pending_bytes: float = 0.0
    weight_output_bytes: float = 0.0  #: the outputs of the ops reading a parameter (their gradients: above)
    #: expert parallelism (`costmodel.moe`): the token all-to-alls of the forward, and of the backward and the
    #: recomputation, not overlapped
    ep_comm_fwd_s: float = 0.0
    ep_comm_bwd_s: float = 0.0
    a2a_bytes: float = 0.0  #: payload of the token all-to-alls one micro-batch issues on this rank (all calls)
    a2a_calls: int = 0  #: token all-to-alls per micro-batch (the count exchanges: ``a2a_count_calls``)
    a2a_count_calls: int = 0  #: per-expert count all-to-alls per micro-batch (E int64 each)
    #: expert parameters ZeRO 2/3 shards on this rank beyond ``param_numel``: a rank holds 1/ep of the experts but
    #: FSDP shards them over the dp/ep ranks holding the same ones, so its sharded states are experts/dp, as
    #: without EP (`costmodel.moe`)
    expert_shard_extra: float = 0.0
    expert_numel: float = 0.0  #: the part of ``param_numel`` that is experts (a rank's 1/ep of them)
    #: a block: FSDP2 makes it a group of its own (`planner.emit.runtime.apply_fsdp`), where a stage's other layers
    #: (embedding, final norm, head) share its root's group (`costmodel.overlap.fsdp_groups`)
    block: bool = False
    #: this rank's FLOPs: forward, backward and recomputation, each node's tensor-parallel share (a replicated node,
    #: a mixture-of-experts feed-forward's without sequence parallelism, runs whole on every TP rank)
    rank_flops: float = 0.0
    #: parameters (a rank's, before ZeRO sharding) whose gradient each TP rank computes from its share of the work
    #: only, summed over tp once per step (`planner.emit.runtime.tp_partial_params`): those of nodes on this rank's
    #: heads (``sharded``: per-head q/k norms) and, under sequence parallelism, those of the replicated nodes below
    #: the block's own children (a MoE feed-forward's router and experts; the norms SP runs are its children)
    #: as (elements, is an expert's) per tensor, in the block's forward order (the runtime reduces them in its
    #: modules' order, a part at a time: the same tensors, bucketed within a tensor of it)
    tp_partial_sizes: tuple[tuple[float, bool], ...] = ()
    #: context parallelism: the keys' and values' all-gathers of the forward (and of a full recomputation), their
    #: gradients' reduce-scatters in the backward, not overlapped (see the module docstring)
    cp_comm_fwd_s: float = 0.0
    cp_comm_bwd_s: float = 0.0
    cp_gather_bytes: float = 0.0  #: gathered bytes (outputs) of those all-gathers per micro-batch on a rank
    cp_scatter_bytes: float = 0.0  #: input bytes of those reduce-scatters per micro-batch on a rank
    #: bytes torch copies around the tensor-parallel collectives along the sequence per micro-batch on a rank:
    #: forward, backward and what the recomputation repeats (`tp_relayout_bytes`, `recompute_relayout_bytes`), in
    #: tp_comm's time
    relayout_bytes: float = 0.0

    @property
    def cp_comm_s(self) -> float:
        return self.cp_comm_fwd_s + self.cp_comm_bwd_s

    @property
    def tp_comm_s(self) -> float:
        return self.tp_comm_fwd_s + self.tp_comm_bwd_s

    @property
    def ep_comm_s(self) -> float:
        return self.ep_comm_fwd_s + self.ep_comm_bwd_s

    @property
    def comm_s(self) -> float:
        """Communication on the layer's critical path: tensor- and context-parallel collectives and expert
        all-to-alls."""
        return self.tp_comm_s + self.ep_comm_s + self.cp_comm_s


@dataclass(frozen=True, kw_only=True)
class CostContext:
    """Everything a layer's cost depends on besides the layer."""

    cluster: Cluster  #: the hardware
    tp: int  #: tensor-parallel degree
    sp: bool  #: sequence parallel
    mbs: int  #: micro-batch size
    captured_batch: int  #: batch the profile was captured at
    precision: str  #: training precision (compute dtype of matmuls; fp8 matmuls keep 16-bit activations)
    act_scale: float = 1.0  #: bytes of an activation element in training / in the capture
    tp_span: GroupSpan | None = None  #: placement of the tensor-parallel group (None when tp == 1)
    #: measured (forward, backward) seconds per layer name on this cluster's device, at batch ``measured_batch``
    #: without parallelism (`profiler.measure`); they replace the roofline's absolute level, see `layer_cost`
    measured: Mapping[str, tuple[float, float]] | None = None
    measured_batch: int = 1  #: batch the measured times are for
    #: the device the times were measured on (a CPU cluster's: this machine's as measured, `LayerGraph.timings`);
    #: None: the cluster's. The level is the measured time × the roofline's ratio between this configuration on the
    #: cluster's device and the measured batch on that one, so a recalibrated device (a slower machine) moves it
    measured_device: DeviceSpec | None = None
    #: the same layers measured at ``measured_larger_batch`` too (`profiler.graph.Timings.larger`); None: at
    #: ``measured_batch`` only (the level then scales in proportion to the roofline)
    measured_larger: Mapping[str, tuple[float, float]] | None = None
    measured_larger_batch: int = 0
    #: the software stack's loss computes its gradient in place (flash-attn's fused CrossEntropyLoss, which
    #: llm-foundry's ``loss_fn: fused_crossentropy`` uses; Megatron-LM's vocab-parallel cross entropy): the head adds
    #: no backward working set. autopar's runtime uses ``F.cross_entropy``, which does (traced by `autopar check`)
    in_place_loss: bool = False
    #: the stack's loss is one fused cross-entropy kernel on the 16-bit logits (flash-attn's, llm-foundry's
    #: ``loss_fn: fused_crossentropy``): the head's ops after its matmul move that kernel's bytes
    #: (`fused_loss_bytes`); autopar's runtime upcasts the logits and runs ``F.cross_entropy``
    fused_loss: bool = False
    #: cross entropies the stack's trainer computes again on each micro-batch's logits without gradient, its
    #: training metrics (Composer's, two for llm-foundry's MPT: `fused_loss_bytes`, beside ``fused_loss``);
    #: autopar's runtime: none
    train_metrics: int = 0
    #: the column-parallel linears save their input whole, as torch's DTensor linears do (the replicated input, or
    #: under sequence parallelism the all-gathered one; autopar's runtime, traced by `autopar check`); Megatron-LM
    #: saves only the sequence shard under SP and all-gathers it again in backward (Korthikanti et al. 2022 §4.2.2)
    gathered_column_inputs: bool = True
    #: what ``selective`` checkpointing keeps (`costmodel.runnable.selective_policy`, the runtime's choice per
    #: model): ``attention-core`` (Korthikanti et al. 2022 §5, Megatron-LM and autopar's runtime where the blocks
    #: make seq×seq scores in an ``attend`` method: the attention core is recomputed, with a fused attention kernel
    #: nothing), ``all-but-attention-core`` (the same core outside such a method: every other op's output kept), or
    #: ``every-other-matmul`` (torchtitan's per-op policy, ``selective_ac_option = "op"``, and autopar's runtime
    #: where the attention is fused: the outputs of the attention kernel and of every second matmul of a block are
    #: saved, every other op is recomputed)
    selective: str = "attention-core"
    #: the runtime's collectives along the sequence copy to and from NCCL's layout (torch's DTensor on batch-first
    #: activations: `seq_relayout_bytes`); False for Megatron-LM, whose sequence-first activations are gathered and
    #: scattered along dim 0 in place
    seq_relayout: bool = True
    #: the blocks run compiled (the script's ``--compile``; torchtitan's torch.compile per block): memory-bound
    #: ops move the bytes of their fused kernels (`compiled_bytes`)
    compiled: bool = False
    #: full checkpointing stops its recomputation early (`recompute_stop`), as torch's non-reentrant checkpoint does
    #: since 2.1 (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default; autopar's runtime); False for
    #: a checkpoint that reruns the whole block: torch 1.13's non-reentrant one (its ``unpack`` hook calls the
    #: function whole on the first saved tensor the backward reads) and Megatron-LM's ``CheckpointFunction``
    checkpoint_early_stop: bool = True
    #: mixture of experts (`costmodel.moe`): experts per MoE layer (0: none), experts chosen per token, the
    #: expert-parallel degree and its group's placement, the busiest expert's load over the balanced one
    experts: int = 0
    top_k: int = 0
    tokens: int = 0  #: tokens of one sequence (the capture's sequence length)
    hidden: int = 0  #: model width (the rows the all-to-alls move)
    ep: int = 1
    ep_span: GroupSpan | None = None
    imbalance: float = 1.0
    cp: int = 1  #: context-parallel degree: ranks sharing each sequence (see the module docstring)
    cp_span: GroupSpan | None = None  #: placement of the context-parallel group (None when cp == 1)
    kv_width: int = 0  #: features of one token's keys (as of its values): kv_heads · head_dim, before TP
    q_width: int = 0  #: features of one token's queries: heads · head_dim, before TP
    #: the capture replays this machine's CPU kernels (`profiler.capture`, ``kernels="native"``: what `autopar check`
    #: predicts from), whose attention materialises a lower-right causal mask (`context_parallel_comm`)
    native_kernels: bool = False
    #: a parameter's ``.grad`` exists when this layer's backward makes its new gradient, so that autograd's
    #: ``AccumulateGrad`` adds the new one into it (in place) and both are alive at once
    #: (`costmodel.memory.grads_accumulate`); else the new gradient becomes ``.grad`` itself
    grad_exists: bool = False
    #: the embedding's and the head's new gradients are temporaries wherever they are made: FSDP outside a pipeline
    #: (`costmodel.memory.fsdp_transient_grads`)
    transient_grads: bool = False
    grad_bytes: int = 4  #: bytes of an element of such a new gradient (the ``.grad``'s dtype)
    #: bytes of an element of a matmul's weight gradient before its cast to the parameter's dtype: 2 under
    #: ``torch.autocast`` (the matmul ran on a 16-bit copy of the fp32 weight), else 0 (no cast)
    weight_cast_bytes: int = 0
    #: under autocast, whether each micro-batch casts the weights anew: the runtime's autocast region is a
    #: micro-batch's outside pipelines (`planner.emit.train.train_step_loss`); one over the step within one casts them
    #: once per step, left unpriced
    casts_per_micro_batch: bool = False
    #: the graph was captured under ``torch.autocast`` (`LayerGraph.under_autocast`): its fp32 parameters are read
    #: whole where no autocast copy stands in, and its matmuls' backward casts their 16-bit weight gradients to fp32
    autocast_capture: bool = False
    #: under float8 training, whose recipe casts the float8 linears' operands (`FLOAT8_RECIPES`): kernels of their
    #: own, priced by their bytes (`float8_cast_costs`); None leaves them unpriced (the GEMMs alone)
    float8_recipe: str | None = "torchao"

    @property
    def scale(self) -> float:
        """A rank's tokens of one micro-batch over the capture's: the micro-batch over the captured batch, each
        sequence shared by ``cp`` ranks."""
        return self.mbs / self.captured_batch / self.cp


def _node_time(flops: float, nbytes: float, ctx: CostContext, *, attention: bool = False,
               float8: bool = False, attention_len: float = 0.0) -> float:
    """Roofline of one op: the slower of its FLOPs at the size-dependent matmul efficiency (scaled for fused
    attention kernels, by their sequence length ``attention_len`` too: `attention_len_eff`, and fp8) and its bytes
    at the achieved memory bandwidth. ``float8``: a float8 linear (`is_float8_linear`), run at the fp8 peak under
    float8 training; every other op keeps 16 bits."""
    dev = ctx.cluster.device
    t_mem = nbytes / (dev.hbm_bw * dev.memory_eff) if nbytes else 0.0
    if not flops:
        return t_mem
    dtype = ctx.precision if ctx.precision in dev.peak_flops else max(dev.peak_flops, key=dev.peak_flops.get)
    eff = dev.matmul_eff(flops)
    if attention:
        eff *= dev.attention_eff * attention_len_eff(attention_len, dev.attention_seq_half)
    if dtype == "fp8" and float8:  # (only linears: `is_float8_linear`)
        eff *= dev.fp8_eff
    elif dtype == "fp8":
        dtype = "bf16"
    t_flop = flops / (dev.peak(dtype) * eff)
    return max(t_flop, t_mem)


def attention_len_eff(length: float, seq_half: float) -> float:
    """A fused causal attention kernel's efficiency at sequence ``length`` relative to a very long one:
    ``length / (length + seq_half)``. FlashAttention tiles the queries and walks each query tile along the keys
    before it (causal: the i-th of ``length/B`` query tiles visits i + 1 key tiles, Dao 2023 Algorithm 1, §3.1):
    a fixed cost per query tile (loading its queries, the softmax's rescaling and writing its output; the
    backward's dQ) against work that grows with the causal prefix, on average ``length/2B`` key tiles. At
    ``seq_half`` the two are equal (`DeviceSpec.attention_seq_half`, fitted on published runs that vary the
    sequence; 0: no dependence). Every published run it is fitted on is causal; a non-causal kernel, whose query
    tiles each walk all ``length/B`` key tiles, has about half the half-point, and is priced as causal here."""
    return length / (length + seq_half) if seq_half > 0 and length > 0 else 1.0


def attention_call_length(n: NodeInfo, cp: int) -> float:
    """The sequence length a fused attention call runs at on one rank: its query's (``(…, L, E)``, as every
    scaled-dot-product-attention op takes it), each sequence split over ``cp`` context-parallel ranks: the rank's
    S/cp tokens against one rank's keys per ring step, an upper estimate where a load-balanced step runs one of its
    two S/(2·cp) chunks."""
    shape = n.input_shapes[0] if n.input_shapes else ()
    return shape[-2] / cp if len(shape) >= 2 else 0.0


def _token_and_weight_bytes(scaled: float, weight: float, scale: float, held: float, busy: float) -> float:
    """A node's bytes on this rank: ``scaled``, its captured bytes scaled to the rank's tokens (``scale`` times the
    capture's), counts its ``weight`` bytes (`_weight_traffic`) ``scale`` times where the rank moves its share
    ``held`` of them once; the tokens' part times ``busy`` (the busiest expert's share of them, `costmodel.moe`)."""
    return max(0.0, scaled - (scale - held) * weight) + (busy - 1.0) * max(0.0, scaled - scale * weight)


def _shard(node: NodeInfo, tp: int, sp: bool, tp_layer: bool) -> float:
    """Fraction of the node's work one tensor-parallel rank does."""
    if not tp_layer or tp == 1:
        return 1.0
    if node.tp_role in _SHARDED_ROLES:
        return 1.0 / tp
    if node.tp_role == "replicated" and sp:
        return 1.0 / tp
    return 1.0


def _weight_traffic(n: NodeInfo, ctx: CostContext, numel: Mapping[str, int]) -> tuple[float, float]:
    """(forward, backward) bytes of its weights a node moves, whole, at the plan's dtypes: what the capture's byte
    count of the node (every tensor an ATen op reads or writes, `profiler.capture`) holds once, and which does not
    grow with the tokens as the rest of its bytes does (a micro-batch of 56 sequences reads a linear's weight once,
    not 56 times). ``numel``: the layer's own parameters' elements by name (a weight another layer owns, the head's
    tied to the embedding, is a linear's second operand).

    - A matmul reads its weights (and bias) forward at its compute dtype (under autocast the 16-bit copy, whose
      cast the capture leaves out, `LayerCost` prices it per micro-batch), reads them again for its input's gradient
      and writes their gradients backward; under an autocast capture its backward also casts the 16-bit gradients
      to the fp32 parameters' dtype (2 read, 4 written).
    - An embedding reads its whole table forward, as the capture counts it, and writes its whole gradient backward,
      at the parameter's dtype (fp32 under an autocast capture).
    - A copy of a weight made per call (an expert weight's transposed autocast copy) is the weight's bytes alone.

    Other ops' weights (a norm's vector) are left with the tokens' bytes."""
    if not n.params or n.kind == "view":
        return 0.0, 0.0
    if n.op == "aten._to_copy.default":
        return n.fwd_bytes * ctx.act_scale, n.bwd_bytes * ctx.act_scale
    names = list(dict.fromkeys(n.params))
    w = float(sum(numel.get(p, 0) for p in names))
    if any(p not in numel for p in names) and n.op == LINEAR_OP and len(n.input_shapes) > 1:
        w = float(sum(_prod(s) for s in n.input_shapes[1:]))  # (a tied weight: the linear's weight and bias)
    compute = 4 if ctx.precision == "fp32" else 2  # (a plain capture's bytes are rescaled to the plan's dtypes)
    if n.kind == "matmul":
        return w * compute, w * (2 * compute + (2 + 4 if ctx.autocast_capture else 0))
    if n.op == "aten.embedding.default":
        table = w * (4 if ctx.autocast_capture else compute)
        return table, table
    return 0.0, 0.0


def _whole_bytes(n: NodeInfo, f: float, layer: Layer, by_name: dict) -> tuple[float, float]:
    """(forward, backward) bytes at the captured batch that a tensor-parallel rank's share ``f`` of a split matmul
    does not shrink, on top of ``f`` of its captured bytes: a column-parallel (or vocabulary-parallel) linear reads
    its whole input (`_column_input`), forward and again for its weight's gradient, and writes its input's whole
    gradient (partial sums); a row-parallel one writes whole partial sums forward and reads the whole output
    gradient twice backward (for its input's gradient and its weight's). A skinny GEMM's time is these bytes (8B at
    tp = 8: the key and value projections' 128 output columns)."""
    if f >= 1 or n.kind != "matmul" or n.tp_role not in ("column", "row", "vocab"):
        return 0.0, 0.0
    whole = n.output_bytes if n.tp_role == "row" else _column_input(n, by_name, layer)[1]
    return whole * (1 - f), 2 * whole * (1 - f)


def is_float8_linear(n: NodeInfo, layer: Layer) -> bool:
    """Whether float8 training runs ``n`` in float8: torchao's float8 conversion swaps a model's ``nn.Linear``
    modules (not other matmuls: attention's, grouped experts'), skipping those with a weight dimension that is not a
    multiple of 16 (``torch._scaled_mm``'s requirement, as torchtitan's converter filters them); torchtitan's
    Llama 3 configs leave the output projection out (``filter_fqns = ["output"]``), and the same rule decides
    which sequence-parallel all-gathers move float8 (`gather_scale`)."""
    return (layer.kind == "block" and n.kind == "matmul" and n.op == LINEAR_OP
            and n.module_type == "Linear" and len(n.input_shapes) > 1
            and all(d % 16 == 0 for d in n.input_shapes[1]))


def gather_scale(layer: Layer, ctx: CostContext) -> float:
    """Bytes a sequence-parallel all-gather of ``layer`` moves per byte of the 16-bit tensor it gathers: ½ where
    float8 training runs the linears it feeds in float8 (`is_float8_linear`), which cast before they gather
    (torchao's tensorwise ``PrepareFloat8ModuleInput`` and ``Float8ColwiseParallel`` the inputs forward,
    ``Float8RowwiseParallel`` the output gradients backward, as torchtitan runs them; Transformer Engine's modules
    likewise), while reductions stay 16-bit; else 1 (the embedding, the head, a block none of whose linears runs in
    float8)."""
    if ctx.precision != "fp8" or not ctx.sp:
        return 1.0
    return 0.5 if any(is_float8_linear(n, layer) for n in layer.nodes) else 1.0


#: float8 training recipes whose casts `float8_cast_costs` prices (`CostContext.float8_recipe`)
FLOAT8_RECIPES = {
    "torchao": "torchao's dynamic tensorwise scaling: the torch-native stack's float8, as torchtitan runs it",
    "transformer-engine": "Transformer Engine's delayed scaling (te.Linear): llm-foundry's fc_type te, Megatron-Core",
}


@dataclass(frozen=True)
class Float8Casts:
    """What a float8 linear's casts cost one rank per micro-batch (`float8_cast_costs`)."""

    fwd_bytes: float  #: bytes its forward's casts move
    bwd_bytes: float  #: bytes its backward's casts move
    fwd_amax: int  #: max-abs all-reduces over the tensor-parallel group its forward waits for
    bwd_amax: int  #: likewise, its backward


def float8_cast_costs(n: NodeInfo, ctx: CostContext, tp: int, cast: set[str]) -> Float8Casts:
    """What the casts of a float8 linear (`is_float8_linear`) cost one rank per micro-batch: kernels of their own
    under torchao's dynamic tensorwise scaling, the recipe torchtitan runs (autopar's runtime trains no float8 yet),
    and the max-abs all-reduces they wait for. Kernels, per element of a 16-bit tensor: a max-abs pass reads it
    (2 bytes), a cast reads it and writes one byte per layout made (2 + 1 or 2 + 1 + 1), and putting a float8
    tensor in the other layout copies it (1 + 1: ``torch._scaled_mm`` takes its first operand row-major, its second
    column-major, and torchao's ``preprocess_addmm`` copies whichever is not).

    - Compiled, torchao's roofline model of the recipe (``torchao/testing/training/roofline_utils.py``,
      ``get_tensor_memory_traffic_ovhd_s``, with fusion modeling): the input forward and the output gradient
      backward each a cast into both layouts, the max-abs fused into the op that made it (4 bytes); the weight a
      max-abs and a cast forward, a cast into the other layout backward (2 + 3 + 3). An input several linears read
      (the attention's q, k and v projections) is one common subexpression: cast once.
    - Eager, torchao's code (``matmul_with_hp_or_float8_args``): the input is cast forward and cast again from its
      saved 16-bit copy backward, then copied to the other layout (5, 5 + 2), by each linear; the output gradient is
      cast twice, once per backward matmul, one of them copied (5 + 5 + 2); the weight is cast once forward, and its
      float8 copied backward (5, 2).
    - Tensor parallelism (torchao's ``PrepareFloat8ModuleInput``, ``Float8ColwiseParallel``,
      ``Float8RowwiseParallel``): a column-parallel linear's input is cast once by the module, before it is
      gathered where sequence parallelism shards it, a row-parallel linear's output gradient likewise; a tensor
      cast before it is gathered is gathered in one layout and copied whole into the other. A split tensor's scale
      is its max-abs over the group, a 4-byte all-reduce its cast waits for ("the overhead is communicating
      max(abs) across ranks", torchtitan's docs/float8.md): the weight's (reused backward), the split inputs' and
      output gradients', one per cast.

    Transformer Engine's delayed scaling (``transformer-engine``, `te_float8_cast_costs`) is priced by its own
    kernels. ``cast`` holds the inputs already cast once for several linears, and grows."""
    if ctx.float8_recipe == "transformer-engine":
        return te_float8_cast_costs(n, ctx, tp)
    x, g, w, share, row, column = _float8_operands(n, ctx, tp)
    compiled = ctx.compiled
    amax = 0 if compiled else 2  # (bytes an element: fused into the op before it, compiled)
    fwd, bwd = (2 + 3) * w, (3 if compiled else 2) * w
    fwd_amax, bwd_amax = int(row or column), 0  # (the weight's, split over the group)

    def by_module(cast_n: float, used_n: float) -> tuple[float, float]:
        # cast once where it is made (before its gather), and laid out again where the matmuls take it
        if cast_n == used_n and compiled:
            return (amax + 2 + 1 + 1) * cast_n, 0.0
        return (amax + 2 + 1) * cast_n, (1 + 1) * used_n

    # the input: its rank's share is whole for a column-parallel linear, split for a row-parallel one
    x_used = x * share if row else x
    source = n.inputs[0] if n.inputs else "(the layer's input)"
    shared = source in cast
    cast.add(source)
    if column or compiled:  # cast once for all the linears that read it
        x_cast = x * share if column and ctx.sp else x_used
        once, copied = by_module(x_cast, x_used)
        fwd += 0.0 if shared else once
        bwd += copied if not (shared and compiled) else 0.0
        fwd_amax += int(not shared and x_cast < x)
    else:  # each linear casts its own, forward and again backward
        fwd += (amax + 2 + 1) * x_used
        bwd += (amax + 2 + 1 + 1 + 1) * x_used
        fwd_amax += int(row)
        bwd_amax += int(row)
    # the output gradient: split for a column-parallel linear, whole for a row-parallel one
    g_used = g * share if column else g
    if row or compiled:  # cast once (by the module under TP, before its gather under SP)
        g_cast = g * share if row and ctx.sp else g_used
        once, copied = by_module(g_cast, g_used)
        bwd += once + copied
        bwd_amax += int(g_cast < g)
    else:  # cast once per backward matmul, one of them copied
        bwd += (2 * (amax + 2 + 1) + 1 + 1) * g_used
        bwd_amax += 2 * int(column)
    return Float8Casts(fwd, bwd, fwd_amax, bwd_amax)


def _float8_operands(n: NodeInfo, ctx: CostContext, tp: int) -> tuple[float, float, float, float, bool, bool]:
    """A float8 linear's operands as its casts see them, in elements on one rank per micro-batch: (input, output
    gradient, weight (its rank's share under TP), 1/tp, row-parallel, column-parallel)."""
    k = ctx.scale
    x, g, w = _prod(n.input_shapes[0]) * k, _prod(n.output_shapes[0]) * k, _prod(n.input_shapes[1])
    share = 1.0 / tp
    row = n.tp_role == "row" and tp > 1
    column = n.tp_role == "column" and tp > 1
    return x, g, w * share if row or column else w, share, row, column


def te_float8_cast_costs(n: NodeInfo, ctx: CostContext, tp: int) -> Float8Casts:
    """What Transformer Engine's casts of a float8 linear cost one rank per micro-batch under its delayed scaling
    recipe, as ``te.Linear`` runs them (transformer_engine/pytorch/module/linear.py, ``_Linear``, and
    ``grad_output_preprocess`` in module/base.py): a tensor's scale comes from the max-abs history of earlier
    steps, so each cast is one kernel that records the new max-abs as it goes (no pass of its own, and no
    all-reduce a cast waits for: the new max-abs values of all the modules are reduced together after each
    micro-batch's forward and backward, one small all-reduce each, left unpriced, as are the scale updates).
    ``fp8_cast_transpose_fused`` reads the 16-bit tensor (2 bytes an element) and writes it in both layouts the
    float8 GEMMs take (1 + 1): the input forward (its transpose is saved for the weight's gradient), the weight
    every forward (a module is not told which micro-batch is the first, so none reuses a cast), the output
    gradient backward. Each module casts its own input (there is no common subexpression across modules).
    Under sequence parallelism a column-parallel linear casts its input's shard (2 + 1), gathers it in float8 and
    transposes the gathered tensor backward (1 + 1); a row-parallel linear's output gradient likewise."""
    x, g, w, share, row, column = _float8_operands(n, ctx, tp)
    fwd, bwd = (2 + 1 + 1) * w, 0.0
    x_used = x * share if row else x
    if column and ctx.sp:  # the shard cast, gathered in float8, transposed whole backward
        fwd += (2 + 1) * x * share
        bwd += (1 + 1) * x_used
    else:
        fwd += (2 + 1 + 1) * x_used
    g_used = g * share if column else g
    if row and ctx.sp:
        bwd += (2 + 1) * g * share + (1 + 1) * g_used
    else:
        bwd += (2 + 1 + 1) * g_used
    return Float8Casts(fwd, bwd, 0, 0)


#: bytes of a max-abs all-reduce (`float8_cast_costs`): one fp32 scalar
AMAX_BYTES = 4


def amax_time(calls: int, ctx: CostContext) -> float:
    """Seconds of ``calls`` max-abs all-reduces over the tensor-parallel group (`float8_cast_costs`)."""
    if not calls or ctx.tp_span is None:
        return 0.0
    return all_reduce_time(AMAX_BYTES * calls, ctx.tp_span, ctx.cluster, calls)


def is_tp_layer(layer: Layer) -> bool:
    """Whether the layer has a tensor-parallel layout (a column/row pair, or a vocabulary-parallel op)."""
    roles = {n.tp_role for n in layer.nodes}
    return {"column", "row"} <= roles or "vocab" in roles


def dtensor_ops(layer: Layer, ctx: CostContext, tp_layer: bool) -> dict[str, str]:
    """The captured nodes the tensor-parallel runtime runs as DTensor ops, each with its `DTENSOR_OPS` kind: a
    block's column- and row-parallel linears (``ColwiseParallel``/``RowwiseParallel``: ``tp_linear``, or
    ``sp_linear`` under sequence parallelism) and the vocabulary-parallel head's linear (``tp_linear``), each an
    ``nn.Linear`` (``aten.linear``: the only module `planner.emit.config` splits); under
    sequence parallelism a block's norms (``SequenceParallel`` on the block's children named norms by their class,
    as `planner.emit.config` picks them) once each, on the norm's first node: a norm is several captured ops but
    one DTensor module. The vocabulary-parallel embedding (a lookup of this rank's rows, not a DTensor op) has
    none. Empty without tensor parallelism."""
    if not tp_layer or ctx.tp == 1:
        return {}
    out = {}
    if layer.kind == "head":
        for n in layer.nodes:
            if n.tp_role == "vocab" and n.op == LINEAR_OP and n.params:
                out[n.name] = "tp_linear"
        return out
    if layer.kind != "block":
        return {}
    linear = "sp_linear" if ctx.sp else "tp_linear"
    norms: set[str] = set()
    for n in layer.nodes:
        if n.tp_role in ("column", "row") and n.op == LINEAR_OP and n.params:
            out[n.name] = linear
        elif (ctx.sp and n.module_path.startswith(layer.name + ".") and "." not in n.module_path[len(layer.name) + 1:]
              and "norm" in n.module_type.lower() and n.module_path not in norms):
            norms.add(n.module_path)
            out[n.name] = "sp_norm"
    return out


def dtensor_bytes(n: NodeInfo, op: str, ctx: CostContext) -> float:
    """Activation bytes DTensor's op ``n`` (its `dtensor_ops` kind ``op``) reads and writes forward on a
    tensor-parallel rank, as `costmodel.dtensor_probe` counts them for the device's per-byte figure
    (``DeviceSpec.dtensor_byte_s``): a linear's input and output, each its rank's part (a column-parallel or
    vocabulary linear reads its whole input, under sequence parallelism the gathered sequence, and writes its slice
    of the features; a row-parallel one reads its slice and writes whole partial sums); a sequence-parallel norm's
    input and output, the rank's slice of the sequence. Not the weights: what grows is the work on the tokens (the
    ops beside, the redistributions' copies). At the training dtype (the capture's times ``act_scale``). A linear is
    ``aten.linear(x, W[out, in])``, the only op `dtensor_ops` wraps as one."""
    x = n.input_shapes[0]
    elem = dtype_bytes(n.input_dtypes[0]) * ctx.act_scale
    tokens = math.prod(x[:-1]) * ctx.scale  # (the rank's micro-batch; a context-parallel rank's share of the tokens)
    if op == "sp_norm":
        return 2.0 * tokens * x[-1] / ctx.tp * elem
    w_out, w_in = n.input_shapes[1]
    return tokens * (w_in / ctx.tp + w_out if n.tp_role == "row" else w_in + w_out / ctx.tp) * elem


def _tp_comm(layer: Layer) -> tuple[float, float, int, int]:
    """(forward, backward) all-reduce payload bytes of one micro-batch at the captured batch, and how many
    all-reduces carry each: one per row-parallel output, per distinct column-parallel input, per vocabulary op."""
    by_name = {n.name: n for n in layer.nodes}
    rows = [n for n in layer.nodes if n.tp_role == "row"]
    fwd, n_fwd = float(sum(n.output_bytes for n in rows)), len(rows)
    col_inputs: set[str] = set()
    bwd, n_bwd = 0.0, 0
    for n in layer.nodes:
        if n.tp_role == "column":
            key, nbytes = _column_input(n, by_name, layer)
            if key not in col_inputs:
                col_inputs.add(key)
                bwd += nbytes
                n_bwd += 1
        elif n.tp_role == "vocab" and "embedding" in n.op:
            fwd += n.output_bytes
            n_fwd += 1
        elif n.tp_role == "vocab":
            if n.input_shapes:  # the head's input gradient
                bwd += _prod(n.input_shapes[0]) * _elt(n.input_dtypes[0])
                n_bwd += 1
    return fwd, bwd, n_fwd, n_bwd


def _column_input(n: NodeInfo, by_name: dict, layer: Layer) -> tuple[str, float]:
    """What a column-parallel node reads whole (its input's gradient is all-reduced, or under sequence parallelism
    the input all-gathered): its input from a node that is not sharded itself, else the layer's input; (a key that
    names it, its bytes at the captured batch). The runtime makes that input one replicated tensor for all the
    linears of the module holding them (`planner.emit.runtime.apply_tp`'s ``sp_gather``), so they share its
    reduction; a linear directly in the block (examples/custom_model.py's) takes its input alone, and reduces it
    alone (traced: q, k and v's three all-reduces where one was priced, 30 % of a block's TP traffic)."""
    src = next((i for i in n.inputs if i in by_name and by_name[i].tp_role not in _SHARDED_ROLES), None)
    nbytes = by_name[src].output_bytes if src else layer.input_bytes
    if "." not in n.module_path.removeprefix(layer.name + "."):  # (directly in the block)
        return f"<{n.name}>", nbytes
    return (src, nbytes) if src else (f"<input of {n.name}>", nbytes)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _elt(dtype: str) -> int:
    return _BYTES.get(dtype, 4)


def vocab_output_bytes(layer: Layer) -> float:
    """Output bytes (at the captured batch) of the layer's vocabulary-parallel op: the token embedding's lookup,
    or the head's logits; 0 when it has none."""
    return float(max((n.output_bytes for n in layer.nodes if n.tp_role == "vocab"), default=0))


def tp_traffic(layer: Layer, ctx: CostContext) -> tuple[float, float, int, int]:
    """(forward, backward) tensor-parallel all-reduce payload bytes of one micro-batch at the configuration's
    micro-batch and precision (Megatron's f and g; with sequence parallelism the same bytes move as an all-gather
    plus a reduce-scatter; full recomputation repeats the forward's), then how many collectives carry each:
    all-reduces, or with sequence parallelism reduce-scatter + all-gather pairs (the embedding's and the head's
    extra all-gathers count as pairs too: an upper count by one call)."""
    bf, bb, n_fwd, n_bwd = _tp_comm(layer)
    if ctx.sp and layer.kind == "embed":  # the first sequence-parallel block slices the replicated embedding:
        # its backward all-gathers a gradient of the embedding's size (half an all-reduce's payload)
        bb += vocab_output_bytes(layer) / 2
        n_bwd += 1
    elif ctx.sp and layer.kind == "head":  # the last one all-gathers its output for the head
        bf += layer.input_bytes / 2
        n_fwd += 1
    return bf * ctx.scale * ctx.act_scale, bb * ctx.scale * ctx.act_scale, max(n_fwd, 1), max(n_bwd, 1)


def tp_comm_bytes(layer: Layer, ctx: CostContext) -> tuple[float, float]:
    """The (forward, backward) bytes of `tp_traffic`."""
    return tp_traffic(layer, ctx)[:2]


def tp_comm_calls(layer: Layer, ctx: CostContext) -> tuple[int, int]:
    """The (forward, backward) collective counts of `tp_traffic`."""
    return tp_traffic(layer, ctx)[2:]


def recompute_stop(layer: Layer, early_stop: bool = True) -> int:
    """Index of the node where full recomputation stops: torch's non-reentrant checkpoint (``early_stop``, the
    default since torch 2.1) ends the recomputed forward as soon as every tensor the original forward saved has been
    saved again, which happens as the last saving op packs its inputs, before it computes (measured by `autopar
    check`: a llama block's recomputation skips its down projection and the row-parallel reduction after it).
    Without early stopping (``early_stop`` False: `CostContext.checkpoint_early_stop`) the whole block reruns."""
    savers = [j for j, n in enumerate(layer.nodes) if n.saved]
    return savers[-1] if savers and early_stop else len(layer.nodes)


def tp_comm_time(nbytes: float, calls: int, ctx: CostContext, *, scale: float = 1.0) -> float:
    """Seconds of ``calls`` tensor-parallel reductions moving ``nbytes`` in all: all-reduces, or with sequence
    parallelism a reduce-scatter and an all-gather each (the same ring bytes, each a call of its own; the
    all-gather's bytes times ``scale``, `gather_scale`). The copies around them are `tp_relayout_bytes`'."""
    if not nbytes or ctx.tp_span is None:
        return 0.0
    if ctx.sp:
        return sp_comm_time(nbytes, calls, nbytes, calls, ctx, scale=scale)
    return all_reduce_time(nbytes, ctx.tp_span, ctx.cluster, calls)


def sp_comm_time(gathered: float, gathers: int, scattered: float, scatters: int, ctx: CostContext, *,
                 scale: float = 1.0) -> float:
    """Seconds of ``gathers`` sequence-parallel all-gathers of ``gathered`` 16-bit bytes in all (their outputs,
    times ``scale``: in float8 under float8 training, `gather_scale`) and ``scatters`` reduce-scatters of
    ``scattered`` bytes (their inputs)."""
    t = 0.0
    if gathered:
        t += all_gather_time(gathered * scale, ctx.tp_span, ctx.cluster, gathers)
    if scattered:
        t += reduce_scatter_time(scattered, ctx.tp_span, ctx.cluster, scatters)
    return t


def tp_relayout_bytes(layer: Layer, ctx: CostContext) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch copies on a rank around the layer's tensor-parallel collectives
    along the sequence (`seq_relayout_bytes`), as the runtime runs them under sequence parallelism
    (`planner.emit.runtime.apply_tp`): a block's all-gathers and reduce-scatters, in pairs (`tp_traffic`; the
    all-gathers in float8 under float8 training); the head's all-gather of the last block's output (forward; its
    input's gradient is all-reduced whole); the backward all-gather of the embedding's gradient into the first
    block's slice (its forward output is all-reduced whole). Nothing without sequence parallelism: plain TP
    all-reduces whole tensors."""
    if not ctx.sp or ctx.tp == 1 or ctx.tp_span is None or not is_tp_layer(layer):
        return 0.0, 0.0
    k = ctx.scale * ctx.act_scale
    if layer.kind == "head":
        return seq_relayout_bytes(layer.input_bytes * k, 0.0, ctx), 0.0
    if layer.kind == "embed":
        return 0.0, seq_relayout_bytes(vocab_output_bytes(layer) * k, 0.0, ctx)
    # forward: the column-parallel inputs gathered (`_tp_comm`'s backward bytes: the same tensors), the row-parallel
    # outputs scattered; backward the other way round: the rows' output gradients gathered, the columns' input
    # gradients scattered (their sizes differ under autocast: a norm's fp32 output, a 16-bit row output)
    rows, columns = tp_comm_bytes(layer, ctx)
    g = gather_scale(layer, ctx)
    return seq_relayout_bytes(columns * g, rows, ctx), seq_relayout_bytes(rows * g, columns, ctx)


def seq_relayout_bytes(gathered: float, scattered: float, ctx: CostContext, *, hidden: float = 0.0) -> float:
    """Bytes copied (each read once and written once) around collectives that all-gather ``gathered`` bytes (their
    outputs) and reduce-scatter ``scattered`` bytes (their inputs) along the sequence: sequence parallelism's, and
    those around a pipeline boundary under tensor parallelism (`costmodel.estimate.Evaluator.pp_gather_copies`);
    and ``hidden`` bytes all-gathered along the hidden dimension (the boundary's scattered transfer), which the
    sequence precedes: always a copy.

    NCCL gathers and scatters along dim 0, and the runtime's activations are batch-first with the sequence on
    dim 1 (``Shard(1)``). torch 2.13's functional collectives, which DTensor's redistributions call, bridge the two
    with a copy of the whole tensor (`torch.distributed._functional_collectives`): ``reduce_scatter_single`` first
    rewrites its input with the sequence chunks outermost (``_chunk_or_narrow_cat``), always; ``all_gather_single``
    re-interleaves the gathered chunks (``_maybe_view_chunk_cat``) unless every dim before the sequence has size
    one, where a view does: a micro-batch of one sequence (traced on a fake process group in
    tests/test_costmodel.py, and in the runtime by `autopar check`). Nothing for a stack whose activations are
    sequence-first (`CostContext.seq_relayout`)."""
    if not ctx.seq_relayout:
        return 0.0
    return scattered + (gathered if ctx.mbs > 1 else 0.0) + hidden


def copy_time(nbytes: float, ctx: CostContext) -> float:
    """Seconds to copy ``nbytes`` (read and write each once) at the achieved memory bandwidth. A copy around a
    collective runs on the compute stream between the collective and the op waiting for it, so it adds to the step
    as the collective does."""
    dev = ctx.cluster.device
    return 2 * nbytes / (dev.hbm_bw * dev.memory_eff)


def recompute_comm_bytes(layer: Layer, ctx: CostContext, ac: AC = AC.FULL) -> float:
    """Tensor-parallel all-reduce payload (as `tp_comm_bytes`) that recomputation under ``ac`` repeats
    (`recompute_traffic`)."""
    return recompute_traffic(layer, ctx, ac)[0]


def recompute_traffic(layer: Layer, ctx: CostContext, ac: AC = AC.FULL) -> tuple[float, int]:
    """(bytes, collectives) that recomputation under ``ac`` repeats (`recompute_comm_bytes`), one per row-parallel
    op whose reduction it repeats; at least one call. Full recomputation runs the block's forward again up to
    `recompute_stop` (torch >= 2.1 stops once every tensor the backward needs is back; the whole block where
    `CostContext.checkpoint_early_stop` is False): each row-parallel reduction before
    it whole, and under sequence parallelism the all-gather half of each later one (it runs at the start of the
    attention or MLP). The per-op selective policy (`CostContext.selective` ``every-other-matmul``) runs the same
    forward, but serves reduce-scatters' outputs from its cache: under sequence parallelism only the all-gather
    halves are repeated, without it the same all-reduces. Nothing for the policies recomputing the attention core
    (which holds no collective) or none."""
    parts = _recomputed_collectives(layer, ctx, ac)
    if ctx.sp:
        nbytes = sum(g + s for g, s in parts) / 2  # an all-gather or a reduce-scatter: half an all-reduce's payload
    else:
        nbytes = sum(s for _, s in parts)
    return nbytes * ctx.scale * ctx.act_scale, max(len(parts), 1)


def recompute_comm_time(layer: Layer, ctx: CostContext, ac: AC) -> float:
    """Seconds of the tensor-parallel collectives recomputation under ``ac`` repeats (`recompute_traffic`): the
    all-reduces, or under sequence parallelism each all-gather and reduce-scatter as itself."""
    if ctx.tp_span is None:
        return 0.0
    if not ctx.sp:
        nbytes, calls = recompute_traffic(layer, ctx, ac)
        return all_reduce_time(nbytes, ctx.tp_span, ctx.cluster, calls) if nbytes else 0.0
    k = ctx.scale * ctx.act_scale
    parts = _recomputed_collectives(layer, ctx, ac)  # (once: `recompute_traffic` is their sum)
    gathered, scattered = [g for g, _ in parts], [s for _, s in parts]
    return sp_comm_time(sum(gathered) * k, sum(1 for g in gathered if g), sum(scattered) * k,
                        sum(1 for s in scattered if s), ctx, scale=gather_scale(layer, ctx))


def recompute_relayout_bytes(layer: Layer, ctx: CostContext, ac: AC) -> float:
    """Bytes the recomputation under ``ac`` copies around sequence-parallel collectives (`seq_relayout_bytes`; the
    all-gathers' in float8 under float8 training): those of the collectives it repeats (`recompute_traffic`), and
    under the per-op selective policy also the copy before each reduce-scatter it serves from its cache, an op of
    its own that it runs again (traced by `autopar check`). Nothing without sequence parallelism."""
    if not ctx.sp or ctx.tp_span is None:
        return 0.0
    k = ctx.scale * ctx.act_scale
    parts = _recomputed_collectives(layer, ctx, ac)
    scattered = sum(s for _, s in parts)
    if parts and ac == AC.SELECTIVE and ctx.selective == "every-other-matmul":
        stop = recompute_stop(layer, ctx.checkpoint_early_stop)
        scattered = sum(n.output_bytes for j, n in enumerate(layer.nodes) if n.tp_role == "row" and j < stop)
    return seq_relayout_bytes(sum(g for g, _ in parts) * k * gather_scale(layer, ctx), scattered * k, ctx)


def _recomputed_collectives(layer: Layer, ctx: CostContext, ac: AC) -> list[tuple[float, float]]:
    """(bytes all-gathered, bytes reduce-scattered or all-reduced) at the captured batch of each tensor-parallel
    collective that recomputation under ``ac`` repeats (see `recompute_traffic`)."""
    op_policy = ac == AC.SELECTIVE and ctx.selective == "every-other-matmul"
    if ac != AC.FULL and not op_policy:
        return []
    stop = recompute_stop(layer, ctx.checkpoint_early_stop)
    gathered = _gathered_inputs(layer)
    parts = []
    for j, n in enumerate(layer.nodes):
        if n.tp_role != "row" or not (j < stop or ctx.sp):
            continue
        if not ctx.sp:  # the row's all-reduce
            parts.append((0.0, float(n.output_bytes)))
        elif j < stop and not op_policy:  # its reduce-scatter and the all-gather of its region's input
            parts.append((float(gathered[n.name]), float(n.output_bytes)))
        else:  # the all-gather only
            parts.append((float(gathered[n.name]), 0.0))
    return parts


def _expert_dtypes(layer: Layer, owned, ctx: CostContext) -> tuple[int, int]:
    """Bytes per element of the tokens the experts take and of the outputs they give: the dtypes the capture saw at
    the expert modules' first input and last output (under autocast the tokens come from a norm of the fp32
    residual stream and the experts' matmuls give 16 bits); the training precision's where the capture shows none
    (a plain capture is in one dtype: `CostContext.act_scale` rescales it)."""
    plain = 4 if ctx.precision == "fp32" else 2
    if ctx.act_scale != 1.0:
        return plain, plain
    paths = {p.fqn.rsplit(".", 1)[0] for p in owned if is_expert_param(p, ctx.experts)}
    mine = [n for n in layer.nodes if n.module_path in paths or any(n.module_path.startswith(q + ".") for q in paths)]
    if not mine:
        return plain, plain
    first = next((n for n in mine if n.input_dtypes and n.kind != "view"), mine[0])
    last = next((n for n in reversed(mine) if n.output_dtypes and n.kind != "view"), mine[-1])
    into = _elt(first.input_dtypes[0]) if first.input_dtypes else plain
    return into, _elt(last.output_dtypes[0]) if last.output_dtypes else plain


def _gathered_inputs(layer: Layer) -> dict[str, float]:
    """Row-parallel node → bytes of the distinct column-parallel inputs of its region (the column-parallel ops since
    the previous row-parallel one): what sequence parallelism all-gathers before the region, where the row's
    reduce-scatter moves its output. The two differ where the dtypes do (under autocast the residual stream's norm
    output is fp32, the row's output 16-bit)."""
    by_name = {n.name: n for n in layer.nodes}
    out, pending, seen = {}, 0.0, set()
    for n in layer.nodes:
        if n.tp_role == "column":
            key, nbytes = _column_input(n, by_name, layer)
            if key not in seen:
                seen.add(key)
                pending += nbytes
        elif n.tp_role == "row":
            out[n.name], pending, seen = (pending or n.output_bytes), 0.0, set()
    return out


@cache
def compiled_bytes(layer: Layer) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes of each memory-bound node of ``layer`` when the layer is compiled: TorchInductor
    fuses connected memory-bound ops (pointwise and reductions) into one kernel that reads the region's inputs once
    and writes only what leaves it (Ansel et al., "PyTorch 2", ASPLOS 2024, §4.3: "Inductor ... fuses pointwise and
    reduction operations"). A node's output stays inside the kernel when every op reading it (through views) is a
    memory-bound op of the same layer at the same depth (no matmul or attention kernel between them): it is neither
    written nor read back. Matmuls and attention are library kernels, outside any fusion. The backward of a fused
    region fuses the same way: a node's backward bytes shrink in the proportion of its forward bytes (an
    approximation: autograd's recomputation choices under AOTAutograd's min-cut partitioner are not modelled).
    No constant is fitted: torchtitan's compiled rows (Llama 3.1 8B, FSDP on 8 and 128 H100) are predicted within
    −2.5 % and −3.3 % with the composer-fitted constants, where eager pricing was +17 % and +16 %."""
    nodes = {n.name: n for n in layer.nodes}
    readers: dict[str, list] = {}
    for n in layer.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)

    def real_readers(name: str) -> list:  # the ops reading a tensor, through views
        out = []
        for r in readers.get(name, ()):
            out += real_readers(r.name) if r.kind == "view" else [r]
        return out

    def producer(name: str):  # the op that wrote a tensor, through views (None: from outside the layer)
        n = nodes.get(name)
        while n is not None and n.kind == "view" and n.inputs:
            n = nodes.get(n.inputs[0])
        return n

    # a fused kernel cannot span a library kernel: ops fuse only at the same depth, the number of matmuls and
    # attention kernels on the longest path from the layer's input to them
    depth: dict[str, int] = {}
    for n in layer.nodes:  # (execution order is a topological order)
        depth[n.name] = max((depth[i] + (nodes[i].kind in ("matmul", "attention")) for i in n.inputs if i in depth),
                            default=0)
    inside = {n.name for n in layer.nodes if n.kind == "memory" and real_readers(n.name)
              and all(r.kind == "memory" and depth[r.name] == depth[n.name] for r in real_readers(n.name))}
    out = {}
    for n in layer.nodes:
        if n.kind != "memory" or not n.fwd_bytes:
            continue
        read = max(0, n.fwd_bytes - n.output_bytes)
        for i in dict.fromkeys(n.inputs):
            src = producer(i)
            if src is not None and src.name in inside:
                read -= min(read, nodes[i].output_bytes)
        written = 0 if n.name in inside else n.output_bytes
        share = (read + written) / n.fwd_bytes
        out[n.name] = (read + written, n.bwd_bytes * share)
    return out


def fused_loss_bytes(layer: Layer, metrics: int = 0) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes of the head's ops after its matmul (the loss: an upcast of the logits, views, the
    cross entropy) where the stack runs the loss as one fused kernel on the matmul's 16-bit logits: flash-attn's
    ``CrossEntropyLoss`` (csrc/xentropy/xentropy_kernel.cu, adapted from Apex's xentropy), which llm-foundry's MPT
    uses by default (``loss_fn: fused_crossentropy``, llmfoundry/models/mpt/modeling_mpt.py at the May and
    October 2023 benchmark commits, on logits it does not upcast). Its forward reads the logits (a row at a time,
    twice, the second pass from L2: a row of 50K 16-bit logits is 100 KB) and writes a loss and a log-sum-exp per
    row; its backward reads them and writes their gradient. ``metrics``: cross entropies the trainer computes
    again on the same logits, forward only: Composer's training metrics, updated after every micro-batch's backward
    (``Trainer._eval_train_metrics`` in Composer 0.14 and 0.16, the versions of those commits), two for MPT
    (``LanguageCrossEntropy`` and ``LanguagePerplexity``, each a ``torch.nn.CrossEntropyLoss`` under autocast: a
    log-softmax reading the 16-bit logits and writing fp32, the NLL reading that). The last such op carries it
    all, the others move nothing. Priced as autopar's runtime runs the loss instead (an fp32 copy of the logits,
    then ``F.cross_entropy``'s log-softmax and its backward), a 125M model's head moved 2.5 times the bytes of its
    twelve blocks."""
    matmuls = [j for j, n in enumerate(layer.nodes) if n.kind == "matmul"]
    if layer.kind != "head" or not matmuls:
        return {}
    logits = layer.nodes[matmuls[-1]].output_bytes  # (16-bit: two bytes an element)
    loss = [n for n in layer.nodes[matmuls[-1] + 1:] if n.kind == "memory"]
    out = {n.name: (0.0, 0.0) for n in loss}
    if loss:
        out[loss[-1].name] = ((1 + metrics * (1 + 2 + 2)) * logits, 2 * logits)
    return out


def _kept_outside_core(n: NodeInfo) -> bool:
    """Whether the selective policy ``all-but-attention-core`` keeps ``n``'s output (`planner.emit.runtime.
    _selective_policy`): an op outside the attention core that allocates (a view holds nothing of its own) and is
    not random (a dropout that draws), an allocation (``empty``) or in place, which that policy recomputes; a fused
    attention kernel without dropout is kept."""
    op = n.op.split(".")[1] if n.op.count(".") >= 1 else n.op
    if n.kind == "view" or n.is_attention_core or op.endswith("_") or op.startswith(("empty", "new_empty")):
        return False
    return not (n.dropout or any(r in op for r in ("dropout", "rand", "bernoulli")))


def _kept_outside_core_bytes(n: NodeInfo, by_name: Mapping[str, NodeInfo], viewed: set) -> float:
    """Bytes (at the captured batch) the policy ``all-but-attention-core`` keeps for node ``n`` until the block's
    backward: its output (`_kept_outside_core`); for a core node, the inputs it saves that no kept node made (the
    core's operands, which a composite matmul copies in ops of their own outside the core: kept); for a view of a
    recomputed node's output, that output, which the kept view holds (``viewed``: once per base)."""
    if _kept_outside_core(n):
        return float(n.output_bytes)
    made = [by_name[i] for i in n.inputs if i in by_name]
    if n.is_attention_core:
        fed = sum(m.output_bytes for m in made if _kept_outside_core(m))
        return float(max(0, n.saved_bytes - n.saved_square_bytes - n.saved_weight_bytes - fed))
    if n.kind == "view" and made and not _kept_outside_core(made[0]) and made[0].kind != "view" \
            and made[0].name not in viewed:
        viewed.add(made[0].name)
        return float(made[0].output_bytes)
    return 0.0


def measured_scale(m: float, r: float, x: float, m2: float | None = None, r2: float = 0.0) -> float:
    """The measured level over the roofline's at a configuration the roofline prices at ``x`` seconds, from a time
    ``m`` measured where the roofline prices ``r``: ``m / r`` (in proportion), or, with a second time ``m2`` where
    it prices ``r2`` > ``r``, the line through both: a part that does not grow with the work (the host's dispatch,
    caches, allocation beyond the per-op overhead the roofline holds) plus one in proportion to the roofline,
    ``β + c·x`` with ``c = (m2 − m) / (r2 − r)``. A line steeper than proportional (β < 0: the time grows faster
    than the roofline says, as caches overflow) holds above the first point and gives way to proportion below it,
    where it would reach 0; one falling with the work (β > m: noise) is flat at ``m``."""
    if r <= 0 or x <= 0:
        return 1.0
    if m2 is None or r2 <= r:
        return m / r
    c = (m2 - m) / (r2 - r)
    if c <= 0:
        return m / x
    fixed = m - c * r
    line = fixed + c * x
    return (max(line, m / r * x) if fixed < 0 else line) / x


def layer_cost(layer: Layer, ac: AC, ctx: CostContext, owned: tuple[ParamInfo, ...], *,
               tp_layer: bool | None = None) -> LayerCost:
    """Cost of ``layer`` with checkpointing ``ac`` for one micro-batch on one rank (see the module docstring).

    ``owned``: the parameters this layer owns (`owned_params`)."""
    if tp_layer is None:
        tp_layer = is_tp_layer(layer)
    tp = ctx.tp if tp_layer else 1
    cp = ctx.cp
    k = ctx.scale  # (a context-parallel rank runs 1/cp of every sequence's tokens, and of its causal attention)
    fwd = bwd = core_fwd = 0.0
    act_sharded = act_repl = core_act = 0.0
    fwd_flops = core_flops = 0.0
    widest = 0.0  # the largest output of any node: its gradient, and the gradient of its input, meet in backward
    weight_outputs = 0.0
    tail = 0.0  # saved by the nodes after the last one reading a parameter (a head's loss)
    after_attention = 0.0  # saved by the nodes after the last attention: freed when the attention's backward runs
    stop = recompute_stop(layer, ctx.checkpoint_early_stop)
    rec_fwd = rec_full_flops = 0.0  # the forward full recomputation repeats (up to `recompute_stop`)
    # this rank's FLOPs (each node's share under tensor parallelism: a replicated node runs whole without sequence
    # parallelism): forward + backward, and what each recomputation choice repeats
    rank_fb = rank_rec_full = rank_op_rec = rank_core = 0.0
    fused = compiled_bytes(layer) if ctx.compiled and layer.kind == "block" else {}
    if ctx.fused_loss and layer.kind == "head":
        fused = fused_loss_bytes(layer, ctx.train_metrics)  # (a head is never compiled: `compiled_bytes` fuses blocks)
    # torchtitan's per-op selective checkpointing (`CostContext.selective`): what it keeps and recomputes
    op_policy = ctx.selective == "every-other-matmul"
    matmuls = 0
    op_act = op_rec = op_rec_flops = 0.0
    # the selective policy of a core outside an ``attend`` method: every op's output kept but the core's
    kept_all = ac == AC.SELECTIVE and ctx.selective == "all-but-attention-core"
    all_act = 0.0
    viewed: set[str] = set()  # recomputed nodes whose output a kept view holds
    o_f, o_b = ctx.cluster.device.op_overhead_s  # the host's time per op, where it adds (a CPU: `DeviceSpec`)
    # what DTensor adds to the ops the tensor-parallel runtime wraps (a CPU: `DeviceSpec.dtensor_overhead_s`), kept
    # apart from the compute a measured profile rescales: forward, backward, and the recomputations' share
    wrapped = dtensor_ops(layer, ctx, tp_layer)
    dt_f = dt_b = dt_rec_full = dt_op_rec = 0.0
    experts = {p.fqn for p in owned if is_expert_param(p, ctx.experts)}
    by_name = {n.name: n for n in layer.nodes}
    saved_by: dict[str, float] = {}  # what each node saves for the backward, as the activations count it
    float8_cast: set[str] = set()  # the inputs float8 linears have cast (`float8_cast_costs`)
    own_numel = {p.fqn: p.numel for p in owned}  # (`_weight_traffic`)
    for j, n in enumerate(layer.nodes):
        f = _shard(n, ctx.tp, ctx.sp, tp_layer)
        if n.kind != "view":  # a view allocates nothing, nor does its gradient (a view of the output's gradient)
            widest = max(widest, n.output_bytes * k * f * ctx.act_scale)
        if n.params and n.kind != "view":  # (a view of a weight, the experts' w.transpose, is not on the input's
            # gradient path: torch keeps the gradient of the op consuming it, `get_param_groups`' intermediates)
            weight_outputs += n.output_bytes * k * f * ctx.act_scale
        attn = n.kind == "attention"
        b_f, b_b = fused.get(n.name, (n.fwd_bytes, n.bwd_bytes))
        w_f, w_b = _whole_bytes(n, f, layer, by_name)
        # the busiest expert sets an expert GEMM's time (`costmodel.moe`: the capture is the balanced case): its
        # FLOPs and the bytes of its tokens scale, its weights are read once however many tokens it takes; its
        # larger GEMM runs at the matmul efficiency of its own size
        expert = bool(experts.intersection(n.params))
        busy = ctx.imbalance if expert else 1.0
        f8 = ctx.precision == "fp8" and is_float8_linear(n, layer)
        # the weights' bytes, which the capture counts once, do not grow with the tokens as the rest does: the
        # rank's share of them (split by TP, and by EP for the experts') is read once per micro-batch
        p_f, p_b = _weight_traffic(n, ctx, own_numel)
        held = _shard(n, ctx.tp, False, tp_layer) / (ctx.ep if expert else 1)
        a_len = attention_call_length(n, ctx.cp) if attn else 0.0
        t_f = _node_time(busy * n.fwd_flops * k * f, _token_and_weight_bytes(
            (b_f * f + w_f) * k * ctx.act_scale, p_f, k * f, held, busy), ctx, attention=attn, float8=f8,
            attention_len=a_len) + o_f
        t_b = _node_time(busy * n.bwd_flops * k * f, _token_and_weight_bytes(
            (b_b * f + w_b) * k * ctx.act_scale, p_b, k * f, held, busy), ctx, attention=attn, float8=f8,
            attention_len=a_len) + o_b
        if f8 and ctx.float8_recipe:  # (kernels of their own, and the max-abs all-reduces they wait for)
            casts = float8_cast_costs(n, ctx, tp, float8_cast)
            t_f += _node_time(0.0, casts.fwd_bytes, ctx) + amax_time(casts.fwd_amax, ctx)
            t_b += _node_time(0.0, casts.bwd_bytes, ctx) + amax_time(casts.bwd_amax, ctx)
        fwd += t_f
        bwd += t_b
        fwd_flops += n.fwd_flops * k * cp  # model FLOPs: the whole layer, all TP and CP ranks
        # torch's counter charges a rank's two chunks of attention (2·cp + 1)·c² score blocks, not S²/cp
        counted = (2 * cp + 1) / (4 * cp) if attn and cp > 1 else 1.0
        rank_fb += (n.fwd_flops + n.bwd_flops) * k * f * counted
        d_f, d_b = (ctx.cluster.device.dtensor_overhead(wrapped[n.name], dtensor_bytes(n, wrapped[n.name], ctx))
                    if n.name in wrapped else (0.0, 0.0))
        dt_f += d_f
        dt_b += d_b
        dt_rec_full += d_f if j < stop else 0.0
        if j < stop:
            rec_fwd += t_f
            rec_full_flops += n.fwd_flops * k * cp
            rank_rec_full += n.fwd_flops * k * f * counted
        whole = n.tp_role == "column" and ctx.gathered_column_inputs  # its saved input is not split
        # copies of weights it saves (`NodeInfo.saved_weight_bytes`) are the rank's shard of the weight, whatever
        # the batch: an expert's under expert parallelism on 1/ep of the ranks; a replicated op's whole under
        # sequence parallelism too, which splits its tokens, not its weights (traced, MoE 3 × 256 bf16, tp 4 with
        # SP, GPipe: a (4, 256, 512) copy of each expert weight per micro-batch, where 1/4 of it was priced: −48 %)
        copies = n.saved_weight_bytes * _shard(n, ctx.tp, False, tp_layer) / (
            ctx.ep if expert else 1)
        saved = (n.saved_bytes - n.saved_weight_bytes) * k * (1.0 if whole else f) * ctx.act_scale + copies
        if n.tp_role in _SHARDED_ROLES and tp_layer and not whole:
            act_sharded += saved
        else:
            act_repl += saved
        saved_by[n.name] = saved
        tail = 0.0 if n.params else tail + saved
        after_attention = 0.0 if n.kind == "attention" else after_attention + saved
        if op_policy and n.kind != "view":
            matmuls += n.kind == "matmul"
            row = n.tp_role == "row" and tp > 1
            if row and ctx.sp:  # the reduce-scatter of its partial sums, whose output the policy keeps
                op_act += n.output_bytes * k / tp * ctx.act_scale
            if (n.kind == "attention" and not n.dropout) or (n.kind == "matmul" and matmuls % 2 == 1):
                # (a row-parallel matmul's output is its partial sums: whole, before they are reduced)
                op_act += n.output_bytes * k * (1.0 if row else f) * ctx.act_scale
            elif j < stop:  # recomputed, up to where torch's recomputation stops (`recompute_stop`)
                op_rec += t_f
                dt_op_rec += d_f
                op_rec_flops += n.fwd_flops * k * cp
                rank_op_rec += n.fwd_flops * k * f
        if kept_all and n is not layer.nodes[-1]:
            # (the block's output is the next layer's input, which its checkpoint holds: priced there)
            all_act += _kept_outside_core_bytes(n, by_name, viewed) * k * (
                1.0 if n.tp_role == "row" and tp > 1 else f) * ctx.act_scale
        if n.is_attention_core:
            core_fwd += t_f
            core_flops += n.fwd_flops * k * cp
            rank_core += n.fwd_flops * k * f
            core_act += n.saved_square_bytes * k * f * ctx.act_scale
    cp_f, cp_b, cp_gather, cp_scatter, kv_held, kv_grads = context_parallel_comm(layer, ac, ctx, tp)
    act_none = act_sharded + act_repl + kv_held
    if ctx.measured and layer.name in ctx.measured:
        # measured times anchor the level; the roofline supplies how it changes with TP, SP and micro-batch
        m_fwd, m_bwd = ctx.measured[layer.name]
        # the reference is what was measured: one eager process, every expert on it (at the capture's balanced
        # routing), on the device that measured it
        ref = replace(ctx, tp=1, sp=False, mbs=ctx.measured_batch, measured=None, tp_span=None, cp=1, cp_span=None,
                      compiled=False, ep=1, ep_span=None, imbalance=1.0, measured_device=None, measured_larger=None,
                      measured_larger_batch=0)
        if ctx.measured_device is not None:
            ref = replace(ref, cluster=replace(ctx.cluster, device=ctx.measured_device))
        r = layer_cost(layer, AC.NONE, ref, owned, tp_layer=False)
        big = (ctx.measured_larger or {}).get(layer.name)
        r2 = layer_cost(layer, AC.NONE, replace(ref, mbs=ctx.measured_larger_batch), owned, tp_layer=False) \
            if big else None
        s_f = measured_scale(m_fwd, r.fwd_s, fwd, big[0] if big else None, r2.fwd_s if r2 else 0.0)
        s_b = measured_scale(m_bwd, r.bwd_s, bwd, big[1] if big else None, r2.bwd_s if r2 else 0.0)
        fwd, bwd, core_fwd, rec_fwd, op_rec = fwd * s_f, bwd * s_b, core_fwd * s_f, rec_fwd * s_f, op_rec * s_f
    fwd, bwd, rec_fwd, op_rec = fwd + dt_f, bwd + dt_b, rec_fwd + dt_rec_full, op_rec + dt_op_rec

    comm_f = comm_b = relayout = 0.0
    if tp > 1 and ctx.tp_span is not None:
        bf, bb, calls_f, calls_b = tp_traffic(layer, ctx)
        copy_f, copy_b = tp_relayout_bytes(layer, ctx)
        g = gather_scale(layer, ctx)
        comm_f = tp_comm_time(bf, calls_f, ctx, scale=g) + copy_time(copy_f, ctx)
        comm_b = tp_comm_time(bb, calls_b, ctx, scale=g) + copy_time(copy_b, ctx)
        relayout = copy_f + copy_b

    rank_rec = {AC.NONE: 0.0, AC.FULL: rank_rec_full}.get(ac, rank_op_rec if op_policy else rank_core)
    if ac == AC.NONE:
        act, rec, rec_flops, rec_comm, rec_peak = act_none, 0.0, 0.0, 0.0, 0.0
        rec_copy = 0.0
    elif ac == AC.SELECTIVE and op_policy:  # the saved outputs and the block's input; the rest recomputed
        keep = layer.input_bytes * k * ctx.act_scale / (ctx.tp if (ctx.sp and tp_layer) else 1)
        act, rec, rec_flops = min(act_none, op_act + keep), op_rec, op_rec_flops
        # the policy saves reduce-scatters' outputs but not all-gathers' or all-reduces' (`recompute_traffic`)
        rec_comm = rec_copy = 0.0
        if tp > 1:
            rec_copy = recompute_relayout_bytes(layer, ctx, ac)
            rec_comm = recompute_comm_time(layer, ctx, ac) + copy_time(rec_copy, ctx)
        rec_peak = act_none - act
    elif kept_all:  # every output but the core's, and the block's input
        keep = layer.input_bytes * k * ctx.act_scale / (ctx.tp if (ctx.sp and tp_layer) else 1)
        if tp > 1:  # and the tensor-parallel collectives' outputs: a row's all-reduced sum (whole), or under
            # sequence parallelism its reduce-scattered slice and the all-gathered input of its region, with the
            # copies around them (`seq_relayout_bytes`: the partial sums' before the reduce-scatter, the gathered
            # input's after the all-gather), which are ops of their own, kept too
            gathered = _gathered_inputs(layer)
            copies = 1.0 if ctx.seq_relayout else 0.0
            all_act += sum((n.output_bytes / tp + gathered[n.name] + copies * (n.output_bytes + gathered[n.name]))
                           if ctx.sp else n.output_bytes
                           for n in layer.nodes if n.tp_role == "row") * k * ctx.act_scale
        act, rec, rec_flops, rec_comm, rec_peak = all_act + keep, core_fwd, core_flops, 0.0, core_act
        rec_copy = 0.0
    elif ac == AC.SELECTIVE:  # autograd's saved tensors but the core's
        act, rec, rec_flops, rec_comm, rec_peak = act_none - core_act, core_fwd, core_flops, 0.0, core_act
        rec_copy = 0.0
    else:  # FULL: keep the input (sharded along the sequence with SP), recompute up to `recompute_stop`
        keep = layer.input_bytes * k * ctx.act_scale / (ctx.tp if (ctx.sp and tp_layer) else 1)
        rec_comm = rec_copy = 0.0
        if tp > 1:
            rec_copy = recompute_relayout_bytes(layer, ctx, ac)
            rec_comm = recompute_comm_time(layer, ctx, ac) + copy_time(rec_copy, ctx)
        act, rec, rec_flops, rec_peak = keep, rec_fwd, rec_full_flops, act_none

    param_numel = shard_extra = expert_numel = 0.0
    partial_sizes = []  # (`LayerCost.tp_partial_sizes`)
    matrices = []
    counted: set[str] = set()
    rank_numel: dict[str, float] = {}  # each owned parameter's elements on this rank
    sizes: list[tuple[float, bool]] = []
    numel = {p.fqn: (p.numel, p.shape) for p in owned}
    for n in layer.nodes:
        f = 1.0 / tp if (n.tp_role in ("column", "row", "vocab") and tp > 1) else 1.0
        rel = n.module_path[len(layer.name) + 1:] if n.module_path.startswith(layer.name + ".") else ""
        partial = tp > 1 and layer.kind == "block" and (
            n.tp_role == "sharded" or (ctx.sp and n.tp_role == "replicated" and "." in rel))
        for p in n.params:
            if p in numel and p not in counted:
                counted.add(p)
                cnt, shape = numel[p]
                if p in experts and ctx.ep > 1:  # this rank holds 1/ep of the experts (`costmodel.moe`)
                    shard_extra += cnt * (1 - 1 / ctx.ep)
                    cnt, shape = cnt / ctx.ep, (shape[0] // ctx.ep, *shape[1:])
                if p in experts:
                    expert_numel += cnt * f
                param_numel += cnt * f
                rank_numel[p] = cnt * f
                rows = shape[0] // (tp if f < 1 and n.tp_role in ("column", "vocab") else 1) if shape else 1
                sizes.append((cnt * f, len(shape) >= 2, max(1, int(rows))))
                if partial:
                    partial_sizes.append((cnt * f, p in experts))
                if len(shape) >= 2:
                    cols = _prod(shape[1:]) // (tp if f < 1 and n.tp_role == "row" else 1)
                    matrices.append((int(rows), int(cols)))
    # backward's working set: while a node's backward runs, the gradient of its output and the gradient it makes for
    # its input are alive together; the widest node (a language model's logits and their log-softmax) sets it
    grad_working_set = 2 * widest
    if layer.kind == "head" and ctx.in_place_loss:
        grad_working_set = 0.0
    elif layer.kind == "head" and tp > 1:  # torch 2.13's loss_parallel backward (tensor/parallel/loss.py,
        # _nll_loss_and_log_softmax_backward, on the local slices): zeros_like(x), exp(x) and their sum live at once
        # before the product with the output's gradient, one slice more than a plain log-softmax backward (MemTracker
        # on a fake process group: 5 slices against 4 at tp = 2 and 4). An earlier trace's 2·tp× was the sharding
        # propagator's global-shape fake tensors, which hold no memory on a GPU (`planner.check.trace`)
        grad_working_set = 3 * widest
    # a context-parallel attention's backward: whole-sequence key and value gradients, once the saved tensors of
    # the nodes after it are freed; the weights' gradients
    weights = weight_grad_working_set(layer, ctx, rank_numel, saved_by)
    grad_working_set = max(grad_working_set, kv_grads - after_attention, weights)
    # expert parallelism: the token all-to-alls (dispatch and combine) of each MoE feed-forward, and the counts
    ep_f = ep_b = a2a_bytes = 0.0
    calls = count_calls = 0
    ffns = moe_modules(owned, ctx.experts)
    if ffns and ctx.ep > 1 and ctx.ep_span is not None:
        # mbs·seq tokens (under sequence parallelism each TP rank routes its slice of them), top_k rows of hidden
        # each, in the dtypes the experts take and give (`_expert_dtypes`): the dispatch and its gradient move the
        # tokens, the combine and its gradient the experts' outputs, half the calls each
        rows = ctx.mbs * ctx.tokens * ctx.top_k * ctx.hidden / (tp if ctx.sp else 1)
        into, out_of = _expert_dtypes(layer, owned, ctx)
        payload = rows * (into + out_of) / 2
        calls, count_calls = a2a_calls(ffns, ac == AC.FULL)
        one = all_to_all_time(payload, ctx.ep_span, ctx.cluster)
        counts = all_to_all_time(ctx.experts * COUNT_BYTES, ctx.ep_span, ctx.cluster)
        ep_f = ffns * (2 * one + counts)
        ep_b = (calls - 2 * ffns) * one + (count_calls - ffns) * counts
        a2a_bytes = calls * payload
    cast = {p for n in layer.nodes if n.kind == "matmul" for p in n.params}  # (autocast's: `LayerCost.cast_numel`)
    cast_numel = sum(rank_numel.get(p, 0.0) for p in cast)
    # autocast's casts of the weights (fp32 read, 16 bits written), which the capture leaves out of its nodes'
    # traffic (`profiler.capture._ParamCasts`: its cache's, once per region): a micro-batch's where each has a region
    # of its own; and a block under one of torch's selective checkpoint policies, whose cache is off, in its forward
    # and its recomputation (a checkpointed attend call casts no weight)
    uncached = ac == AC.SELECTIVE and ctx.selective != "attention-core" and ctx.weight_cast_bytes > 0
    if uncached or (ctx.weight_cast_bytes and ctx.casts_per_micro_batch):
        t_cast = _node_time(0.0, (4 + ctx.weight_cast_bytes) * cast_numel, ctx)
        fwd += t_cast
        rec += t_cast if uncached else 0.0
    if uncached:
        # under autocast such a block runs with autocast's cache off and recasts its weights in
        # the recomputation, keeping none of its forward's copies (`planner.emit.runtime._WithoutCastCache`): no
        # cached copies (nor their shared cast-backs), and the recomputation's own live through its backward
        rec_peak += ctx.weight_cast_bytes * cast_numel
        cast_numel = 0.0
    return LayerCost(
        fwd_s=fwd, bwd_s=bwd, recompute_s=rec, tp_comm_fwd_s=comm_f, tp_comm_bwd_s=comm_b + rec_comm, act_bytes=act,
        backward_peak_bytes=rec_peak + grad_working_set, weight_peak_bytes=rec_peak + weights,
        param_numel=param_numel, fwd_flops=fwd_flops,
        recompute_flops=rec_flops, grad_matrices=tuple(matrices), param_tensors=len(counted),
        param_sizes=tuple(sizes), cast_numel=cast_numel,
        cast_largest=max((rank_numel.get(p, 0.0) for p in cast), default=0.0),
        pending_bytes=act + weight_outputs - (tail if layer.kind == "head" and ac == AC.NONE else 0.0),
        weight_output_bytes=weight_outputs, ep_comm_fwd_s=ep_f, ep_comm_bwd_s=ep_b, a2a_bytes=a2a_bytes,
        a2a_calls=calls, a2a_count_calls=count_calls, expert_shard_extra=shard_extra,
        expert_numel=expert_numel, rank_flops=rank_fb + rank_rec, tp_partial_sizes=tuple(partial_sizes),
        cp_comm_fwd_s=cp_f, cp_comm_bwd_s=cp_b, cp_gather_bytes=cp_gather,
        cp_scatter_bytes=cp_scatter, relayout_bytes=relayout + rec_copy, block=layer.kind == "block",
    )


def weight_grad_working_set(layer: Layer, ctx: CostContext, rank_numel: Mapping[str, float],
                            saved_by: Mapping[str, float]) -> float:
    """The largest working set of the backward of an op reading parameters, with its new weight gradients: the op's
    output gradient, its input's gradient and the new gradients of its weights (``rank_numel``: each parameter's
    elements on this rank) are alive together when its backward returns. Under ``torch.autocast`` a matmul's weight
    gradient comes in 16 bits (``CostContext.weight_cast_bytes``) and its cast to the fp32 parameter's dtype is made
    while it is alive (the output gradient freed by then). Where ``.grad`` already exists
    (``CostContext.grad_exists``: DDP's bucket views, or micro-batches after the first that accumulate unsharded),
    autograd's ``AccumulateGrad`` adds the new gradient into it, so the new one is a temporary on top of the held
    gradients, as are the embedding's and the head's under FSDP (``CostContext.transient_grads``); else it becomes
    ``.grad`` and counts among the gradients (`costmodel.memory.state_bytes_at_peak`).
    Traced (MemTracker, one process): a 32000 × 256 head at 16 tokens peaks at 1.95 MiB of logits' gradient plus the
    31.25 MiB new fp32 weight gradient beside the existing one, and under bf16 autocast at the 15.6 MiB 16-bit one
    plus its 31.25 MiB cast; the token embedding's backward makes a dense gradient of the whole table the same way.
    A view of a weight (the experts' ``w.transpose``) passes its gradient to the op reading it; under a loss that
    computes its gradient in place (``CostContext.in_place_loss``) the head's output gradient is its logits' buffer,
    already counted among its activations. Returned beyond the layer's activations, less what the nodes after the
    op saved (``saved_by``): their backward ran first and freed it (the loss's log-probabilities at the head's
    matmul)."""
    by_name = {n.name: n for n in layer.nodes}
    k = ctx.scale * ctx.act_scale
    tp_layer = is_tp_layer(layer)
    weight_views = {n.name: n.params for n in layer.nodes if n.kind == "view" and n.params}
    best = 0.0
    after = sum(saved_by.values())  # saved by the nodes from this one on
    for n in layer.nodes:
        after -= saved_by.get(n.name, 0.0)
        if n.kind == "view":
            continue
        params = [p for p in (*n.params, *(q for i in n.inputs for q in weight_views.get(i, ()))) if p in rank_numel]
        if not params:
            continue
        numel = sum(rank_numel[p] for p in dict.fromkeys(params))
        out = 0.0 if (layer.kind == "head" and ctx.in_place_loss) else (
            n.output_bytes * k * _shard(n, ctx.tp, ctx.sp, tp_layer))
        inputs = [by_name[i] for i in n.inputs if i in by_name and i not in weight_views]
        grad_in = (sum(i.output_bytes * k * _shard(i, ctx.tp, ctx.sp, tp_layer) for i in inputs) if inputs
                   else layer.input_bytes * k / (ctx.tp if (ctx.sp and tp_layer and ctx.tp > 1) else 1))
        if layer.kind == "embed":
            grad_in = 0.0  # (token ids)
        w16 = numel * ctx.weight_cast_bytes if n.kind == "matmul" else 0.0
        new = numel * ctx.grad_bytes if ctx.grad_exists or (ctx.transient_grads and layer.kind != "block") else 0.0
        if w16:
            best = max(best, out + grad_in + w16 - after, grad_in + w16 + new - after)
        else:
            best = max(best, out + grad_in + new - after)
    return best


def context_parallel_comm(layer: Layer, ac: AC, ctx: CostContext, tp: int) -> tuple[float, ...]:
    """(forward seconds, backward seconds, all-gathered bytes, reduce-scattered bytes, kept bytes, backward working
    set) of a layer's context-parallel attention for one micro-batch on one rank (see the module docstring): each
    attention gathers the whole sequence's keys and values (this TP rank's grouped-query heads) over the cp group,
    and reduce-scatters their gradients; a full recomputation gathers them again. Zero without context
    parallelism.

    Memory, as the runtime computes it (`planner.emit.runtime.context_parallel_attention`: rank r's query chunks
    see the first (r + 1)·c and (2·cp − r)·c keys, (2·cp + 1)·c in all; S = 2·cp·c):
    - kept: where SDPA takes grouped-query keys as they are (torch's flash kernel: the cost model's GPU kernels in
      fp16/bf16), the attention saves views of the gathered keys and values, 2·S kv-features; elsewhere each
      chunk's keys and values expanded to the query heads, 2·(2·cp + 1)·c q-features. The capture (scaled by 1/cp)
      already counts this rank's own tokens' expanded keys and values, 2·S/cp q-features, which the runtime does
      not make: "kept" is the difference. On CPU, torch 2.13 has no attention kernel for a lower-right causal mask
      of more keys than queries (torch/nn/attention/bias.py, ``CausalBias._dispatch``: flash and memory-efficient
      kernels are CUDA's), so it materialises the mask in the queries' dtype and the attention saves it:
      c·(r + 1)·c + c·(2·cp − r)·c = (2·cp + 1)·c² elements per attention;
    - backward working set, the largest on any rank (traced with torch's memory tracker on a fake process group,
      every rank of cp = 4 and 8: `tests/test_cp.py`). With grouped-query heads it is the first attention backward
      to run, the later chunk's over (2·cp − r)·c keys: rank 0's, over all S, makes the keys' and values'
      gradients at the query heads, 2·S q-features, beside the chunk's query gradient, c q-features (flash expands
      them inside its kernel and sums them to the kv heads after: 2·S kv-features more). Without (as many kv heads
      as query heads) rank cp − 1's second chunk sets it: the two whole-sequence gradients the first chunk's
      backward left (2·S), the queries' gradients (3·c) and the chunk's key and value gradients over cp·c keys
      (2·cp·c = S), 3·S + 3·c kv-features."""
    calls = sum(1 for n in layer.nodes if n.kind == "attention")
    if ctx.cp == 1 or not calls or ctx.cp_span is None or not ctx.kv_width:
        return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    elt = 4 if ctx.precision == "fp32" else 2
    row = ctx.mbs * elt / tp  # bytes per feature of one position over the micro-batch, this TP rank's heads
    seq, chunk = ctx.tokens, ctx.tokens / (2 * ctx.cp)
    q_width = ctx.q_width or ctx.kv_width
    kv = seq * ctx.kv_width * row  # one of K and V, the whole sequence
    gathers = 2 * calls * (2 if ac == AC.FULL else 1)
    gather = all_gather_time(kv, ctx.cp_span, ctx.cluster)
    scatter = reduce_scatter_time(kv, ctx.cp_span, ctx.cluster)
    forward = 2 * calls * gather
    backward = (gathers - 2 * calls) * gather + 2 * calls * scatter
    grouped = q_width != ctx.kv_width and not ctx.native_kernels and ctx.precision in ("bf16", "fp16", "fp8")
    own = 2 * seq / ctx.cp * q_width * row
    kept = (2 * kv if grouped or q_width == ctx.kv_width else 2 * (2 * ctx.cp + 1) * chunk * q_width * row) - own
    if ctx.native_kernels:  # the materialised masks (one per query chunk, broadcast over the batch and heads)
        kept += (2 * ctx.cp + 1) * chunk * chunk * elt
    if q_width == ctx.kv_width:
        grads = (3 * seq + 3 * chunk) * q_width * row
    else:
        grads = (2 * seq + chunk) * q_width * row + (2 * kv if grouped else 0.0)
    return forward, backward, gathers * kv, 2 * calls * kv, calls * kept, grads


def owned_params(lg: LayerGraph, *, pipelined: bool = False) -> dict[str, tuple[ParamInfo, ...]]:
    """Layer name → the parameters it owns: each parameter belongs to the first layer that reads it. ``pipelined``
    (pp > 1): a weight tied between the embedding and the head is held, and trained, by both the first and the last
    stage (Megatron-LM's embedding group; `planner.emit.runtime.split_pipeline`), so the head owns its copy too."""
    by_fqn = {p.fqn: p for p in lg.model.params if not p.is_buffer}
    seen: dict[str, str] = {}  # parameter → the kind of the layer that owns it
    out = {}
    for layer in lg.layers:
        owned: dict[str, ParamInfo] = {}
        for n in layer.nodes:
            for p in n.params:
                if p in by_fqn and p not in owned and (
                        p not in seen or (pipelined and layer.kind == "head" and seen[p] == "embed")):
                    seen.setdefault(p, layer.kind)
                    owned[p] = by_fqn[p]
        out[layer.name] = tuple(owned.values())
    return out
