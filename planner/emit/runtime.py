"""Apply a plan with stock torch.distributed: the one implementation behind emitted scripts and auto_parallelize.

This module imports only torch, the standard library and `costmodel.runnable` (the rules of what can run, itself
standard library only): `planner.emit.script` copies all three sources into every emitted training script, and
`planner.emit.apply.auto_parallelize` calls the same functions in-process. The plan arrives as a plain dict of
literals (``PLAN``, built by `planner.emit.config.runtime_config`), so a script needs nothing else.

Order of application (as in torchtitan's ``parallelize`` functions), per pipeline stage; each technique is one
function and `parallelize` calls them in this order, each under the plan condition that selects it (emitted scripts
keep only the branches and functions their plan uses):

0. the model: with ``plan["init"] == "full"`` every rank builds the full model with real weights from the same seed
   (so all runs equal one process); with ``"meta"`` (large models) it is built on the meta device, steps 1-5 run
   on meta tensors, and each rank then allocates only its own shards (``to_empty``) and initialises them with the
   model's ``init_weights()`` from the same seed (torchtitan's recipe; DDP needs real tensors, so a ZeRO-0 part is
   materialised just before it is wrapped: it is replicated anyway);
1. pipeline split: each rank keeps the blocks of its (virtual) stages; ``tok_embeddings``/``norm``/``output``
   become ``None`` where not owned; a weight tied between the embedding and the head is then held by both the
   first and the last stage;
2. tensor parallel: first, because it turns weights into DTensors that the later wrappers take as they are; the
   token embedding and the head are split along the vocabulary (Megatron-LM), the loss computed on each rank's
   slice of the logits under torch's ``loss_parallel``;
2b. expert parallel (``plan["ep"]`` > 1, `apply_ep`): before the wrappers, which must see each rank's own experts;
   the ep ranks are borrowed from the data-parallel group (dp = edp · ep, ep innermost: an expert group stays
   inside a node first), each holds experts [e·E/ep, (e+1)·E/ep) of every MoE layer as plain parameters, and tokens
   travel to them and back by all-to-all over the ep group. Their gradients are reduced over the edp group (the
   ranks holding the same experts), not dp: DDP ignores them (`reduce_expert_grads` after the backward), FSDP2
   shards them over edp in their own unit (`apply_fsdp_experts`), both dividing by dp (the loss convention);
2c. context parallel (``plan["cp"]`` > 1, `apply_cp`): after tensor parallelism, whose local heads it attends
   with, and before activation checkpointing, which then recomputes its all-gather inside the block; each sequence
   is cut into 2·cp chunks and cp rank r keeps chunks r and 2·cp − 1 − r (the same share of causal attention on
   every rank), the model reads these tokens' positions from its ``context_positions``, and each attention
   all-gathers keys and values over the cp group. Gradients, ZeRO shards and the loss are then reduced over the
   dp × cp ranks (`data_parallel_mesh`), batch rows still split by dp;
3. activation checkpointing: after TP, before data parallel, so checkpoint wrappers sit inside FSDP units (selective:
   the plan's policy, `apply_ac`: a checkpointed attend call, or torch's selective checkpoint over the block);
4. pipeline boundaries: each tensor-parallel rank sends its 1/tp slice (Megatron's scatter/gather); bf16
   activations between stages when the plan compresses;
5. data parallel: DDP (ZeRO 0, and ZeRO 1 whose optimizer state `planner.emit.train.build_optimizer` shards)
   with the compression comm hook, or FSDP2 ``fully_shard`` per block then the root (ZeRO 2:
   ``reshard_after_forward=False``; ZeRO 3: resharded after forward);
6. embedding groups for tied weights across pipeline ranks (Megatron-LM): the copies' gradients are summed after
   each backward, so they stay equal;
7. pipeline schedule over the local stages, the loss on the last stage.

The training step, the optimizer and the synthetic data live in `planner.emit.train`; the emitter inlines both.
"""

import contextlib
import copy
import datetime
import gc
import math
import os
import sys
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

from costmodel.runnable import attention_scores, post_step_allreduce, problems

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_world(plan: dict) -> None:
    """Stop every rank with one clear message when the launch does not match the plan (before any collective)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    rank = os.environ.get("RANK", "0")
    shape = f"pp={plan['pp']} × dp={plan['dp']} × cp={plan['cp']} × tp={plan['tp']}"
    errors = []
    if world != plan["world"]:
        errors.append(
            f"this plan needs {plan['world']} processes ({shape}) but WORLD_SIZE={world}; start it with "
            f"torchrun --nproc-per-node {plan['world']}, or re-plan for {world} devices"
        )
    if plan["tp"] > local:
        errors.append(
            f"tp={plan['tp']} needs that many processes per node, but LOCAL_WORLD_SIZE={local}; "
            f"re-plan with tp ≤ {local}"
        )
    if torch.cuda.is_available() and local > torch.cuda.device_count():  # set_device(LOCAL_RANK) would fail
        errors.append(f"LOCAL_WORLD_SIZE={local} processes on this node but it has {torch.cuda.device_count()} "
                      f"visible GPUs; start --nproc-per-node {torch.cuda.device_count()} per node (and more nodes)")
    errors += plan_problems(plan)
    if errors:
        print(f"[rank {rank}] error: {'; '.join(errors)}", file=sys.stderr, flush=True)
        sys.exit(2)


def plan_problems(plan: dict) -> list:
    """Why this runtime cannot run ``plan`` as it stands (``costmodel.runnable.problems``, the rules the planner's
    search and emitter apply too): a hand-edited ``PLAN`` fails here, before any collective."""
    facts = {key: plan[key] for key in ("dp", "tp", "pp", "vpp", "schedule", "zero", "sp", "grad_compress",
                                        "precision", "seq")}
    # (a PLAN from before ep, or before cp, has none of these)
    facts.update({key: plan[key] for key in ("ep", "experts", "expert_dim1", "cp") if key in plan})
    selective = selective_of(plan)
    return problems({**facts, "micro_batches": plan["grad_accum"], "compile": plan["compile"],
                     "checkpointed": bool(plan["ac"]), "selective_ac": "selective" in plan["ac"].values(),
                     "attention_core": selective != "every-other-matmul",
                     "attends": selective != "all-but-attention-core"})


#: how long a collective may wait before the job fails (torch's NCCL default is 10 minutes; a large model's first
#: step or a checkpoint save of hundreds of GB on a shared file system can take longer)
PG_TIMEOUT_MIN = 30


def init_distributed(plan: dict) -> DeviceMesh:
    """Check the launch, start the process group (NCCL with CUDA, else gloo) and build the plan's mesh
    (`build_mesh`)."""
    check_world(plan)
    return build_mesh(plan, start_process_group())


def start_process_group() -> str:
    """Start the launch's process group unless started (NCCL on this rank's GPU with CUDA, else gloo); returns the
    device type."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        # before the allocator starts: expandable segments keep fragmentation down as activations come and go
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=PG_TIMEOUT_MIN)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    return device_type


def shutdown() -> None:
    """End the launch's process groups so that none outlives the interpreter. The parallel model sits in reference
    cycles (module hooks) that hold its DTensors, meshes and so the groups: they are collected here, and the groups'
    last references go with ``destroy_process_group``, whose destructor joins gloo's worker threads. Left alive to
    interpreter exit, a worker that frees a finished collective (a barrier holds the works still in flight when it
    was queued) takes the GIL of a finalising interpreter and aborts the process: "terminate called without an active
    exception" (core dump, 2026-12-04: ``~AsyncBarrierWork`` → ``~AsyncAllgatherWork`` → ``decref_pyobject`` in
    ``ProcessGroupGloo::runLoop`` during ``Py_FinalizeEx``). Call it after dropping the parallel model."""
    gc.collect()
    dist.barrier()  # every rank done with its last collective before the process group goes away
    dist.destroy_process_group()


def build_mesh(plan: dict, device_type: str) -> DeviceMesh:
    """The plan's device mesh over the started process group: (pp, dp, tp), pp outermost and tp innermost (a
    tensor-parallel group stays inside a node); with ep > 1 `expert_mesh`; with cp > 1 (pp, dp, cp, tp), cp between
    dp and tp as the cost model orders ranks, and (dp, cp) flattened into ``dp_cp``: the ranks that hold the same
    parameters and reduce their gradients together (`data_parallel_mesh`)."""
    if plan["ep"] > 1:
        return expert_mesh(plan, device_type)
    if plan["cp"] == 1:
        shape = (plan["pp"], plan["dp"], plan["tp"])
        return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "tp"))
    shape = (plan["pp"], plan["dp"], plan["cp"], plan["tp"])
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "cp", "tp"))
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def data_parallel_mesh(plan: dict, mesh: DeviceMesh) -> DeviceMesh:
    """The group over which gradients are averaged, ZeRO shards and the loss is averaged: the dp group, or with
    context parallelism the dp × cp ranks (``dp_cp``: each cp rank computes its gradients from its part of every
    sequence, as in torchtitan's FSDP over dp × cp). Batch rows are still split by the dp coordinate only
    (`planner.emit.train.data_rows`)."""
    if plan["cp"] > 1:
        # the group `build_mesh` made: torch keeps flattened meshes by name and returns it (slicing ``mesh["dp_cp"]``
        # works too, but torch 2.13 warns that slicing a flattened dimension from the root mesh is deprecated)
        return mesh["dp", "cp"]._flatten("dp_cp")
    return batch_mesh(plan, mesh)


def batch_mesh(plan: dict, mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dimension that splits the batch's rows: ``dp``, with expert parallelism the flattened
    (edp, ep) `expert_mesh` made (taken as made: torch 2.13 warns that slicing a flattened dimension from the root
    mesh is deprecated)."""
    if plan["ep"] > 1:
        return mesh["edp", "ep"]._flatten("dp")
    return mesh["dp"]


def expert_mesh(plan: dict, device_type: str) -> DeviceMesh:
    """The (pp, edp, ep, tp) mesh of expert parallelism, with (edp, ep) flattened into ``dp``: the data-parallel
    group is the same as without ep (``mesh["dp"]``, dp rank = edp rank · ep + ep rank), and its ``ep`` sub-groups
    (consecutive dp ranks, inside a node first) exchange tokens while its ``edp`` sub-groups (the ranks holding the
    same experts) reduce the experts' gradients."""
    shape = (plan["pp"], plan["dp"] // plan["ep"], plan["ep"], plan["tp"])
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))
    mesh["edp", "ep"]._flatten("dp")
    return mesh


def current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Parallel:
    """The model as this rank holds it after `parallelize`."""

    plan: dict  #: the runtime plan dict
    mesh: DeviceMesh  #: (pp, dp, tp); ep > 1: (pp, edp, ep, tp), dp flattened; cp > 1: (pp, dp, cp, tp), dp_cp too
    parts: list  #: local model parts before data-parallel wrapping (one per local pipeline stage)
    modules: list  #: the same parts as trained (DDP/FSDP-wrapped where data parallel)
    stages: list = field(default_factory=list)  #: PipelineStage objects (empty without pipeline parallelism)
    stage_indices: list = field(default_factory=list)  #: (virtual) stage index of each local part
    schedule: object = None  #: the pipeline schedule (None without pipeline parallelism)
    device: torch.device | None = None  #: where this rank computes
    tied_groups: list = field(default_factory=list)  #: this rank's embedding group per ``plan["tied"]`` entry
    loss_fn: object = None  #: ``(logits, labels) → loss`` (`loss_function`)
    grad_norm: object = None  #: the last step's global gradient norm before clipping (a 0-dim tensor)


def parallelize(build_model, plan: dict, mesh: DeviceMesh) -> Parallel:
    """Build the model with ``build_model()`` after seeding, and apply the plan to it (see the module docstring)."""
    device = current_device()
    if device.type == "cpu" and plan["precision"] != "fp32" and dist.get_rank() == 0:
        print(f"note: precision={plan['precision']} applies on GPUs only; this CPU run trains in fp32", flush=True)
    torch.manual_seed(plan["seed"])  # identical weights on every rank, and in a one-process reference run
    # 0. The model: real weights on every rank, or (large models) shapes only, materialised after sharding.
    if plan["init"] == "meta":
        with torch.device("meta"):
            model = build_model()
        find_init(model)  # fail now, not after sharding, when the model cannot initialise itself
    else:
        model = build_model().to(device)
    # 1. Pipeline split: this rank's (virtual) stages, each a copy of the model keeping only the blocks it owns;
    #    without pipeline parallelism the whole model is the one local part.
    if plan["pp"] > 1:
        indices, parts = split_pipeline(model, plan, mesh["pp"].get_local_rank())
    else:
        container = model.get_submodule(plan["block_container"])
        model._autopar_block_names = [f"{plan['block_container']}.{i}" for i in range(len(container))]
        indices, parts = [0], [model]
    modules = []
    for index, part in zip(indices, parts):
        module = part  # what trains: the part itself, or its data-parallel wrapper
        # 2. Tensor parallel: Megatron column/row layout per block, sequence parallel on the norms.
        if plan["tp"] > 1:
            apply_tp(part, plan, mesh["tp"])
            apply_vocab_parallel(part, plan, mesh["tp"])
        # 2b. Expert parallel: this rank's experts only, tokens sent to their experts by all-to-all.
        if plan["ep"] > 1:
            apply_ep(part, plan, mesh["ep"])
        # 2c. Context parallel: this rank's two chunks of every sequence, attending over all earlier tokens.
        if plan["cp"] > 1:
            apply_cp(part, plan, mesh["cp"])
        # 2d. The parameters whose gradients each TP rank computes from its share only (summed over tp per step).
        part._autopar_tp_partial = tp_partial_params(part, plan)
        # 3. Activation checkpointing, per block as the plan says.
        if plan["ac"]:
            apply_ac(part, plan)
        # 3b. torch.compile per block (the script's --compile), after AC and before data parallelism, as torchtitan
        #     does; in place, so parameter and checkpoint names do not change.
        if plan["compile"]:
            for block in block_list(part, plan):
                block.compile(backend=plan["compile"])
        # 4a. Pipeline boundaries: each tensor-parallel rank sends its 1/tp slice (Megatron's scatter/gather).
        if plan["pp"] > 1 and plan["tp"] > 1:
            apply_pp_scatter(part, index, plan, mesh["tp"])
        # 4b. Pipeline-boundary compression: bf16 activations (and their gradients) between stages.
        if plan["pp"] > 1 and plan["pp_compress"] == "bf16":
            apply_pp_compress(part, index, plan)
        # 5. Data parallel, wrapping what the steps above built: DDP with a comm hook (ZeRO 0, and ZeRO 1 whose
        #    optimizer state `build_optimizer` shards), or FSDP2 for ZeRO 2/3; over dp × cp with context parallelism
        #    (`data_parallel_mesh`), so a plan with dp = 1 and cp > 1 reduces too.
        if post_step_allreduce(plan["dp"] * plan["cp"], plan["tp"], plan["zero"], plan["schedule"], plan["pp"]):
            module = apply_dp_allreduce(part, plan, data_parallel_mesh(plan, mesh))
        elif plan["dp"] * plan["cp"] > 1 and plan["zero"] <= 1:
            if plan["init"] == "meta":
                materialize(part, index, plan, device)  # DDP takes real tensors (each dp rank holds the whole part)
            if plan["ep"] > 1:  # experts are reduced over edp by `reduce_expert_grads`, not by DDP over dp
                DDP._set_params_and_buffers_to_ignore_for_model(part, expert_param_names(part))
            module = apply_ddp(part, plan, data_parallel_mesh(plan, mesh))
        elif plan["dp"] * plan["cp"] > 1:
            if plan["ep"] > 1:  # experts first, in their own units over edp: the blocks' units then skip them
                apply_fsdp_experts(part, plan, mesh["edp"])
            module = apply_fsdp(part, plan, data_parallel_mesh(plan, mesh))
        # Meta init: allocate this rank's shards only, then initialise them (no-op when DDP already did).
        if plan["init"] == "meta":
            materialize(part, index, plan, device)
        modules.append(module)
    par = Parallel(plan=plan, mesh=mesh, parts=parts, modules=modules, stage_indices=indices, device=device,
                   loss_fn=loss_function(plan, mesh))
    # 6. Tied weights across pipeline ranks: one embedding group per (dp, tp) coordinate, built on every rank.
    if plan["pp"] > 1 and plan["tied"]:
        par.tied_groups = build_tied_groups(plan, mesh)
        if plan["init"] == "meta":
            sync_tied_weights(par)  # each stage initialised its own copy: take the first stage's
    # 7. Pipeline schedule over this rank's stages.
    if plan["pp"] > 1:
        build_pipeline(par)
    return par


def find_init(model: nn.Module):
    """The function that initialises ``model``'s parameters in place after ``to_empty``: the model's own
    ``init_weights()`` (zoo models, your ``file.py`` models), or for Hugging Face models (found inside wrappers)
    ``initialize_weights()`` of each outermost ``PreTrainedModel``, which also recomputes the rotary ``inv_freq``
    buffers; its ``init_weights()`` would re-tie weights that sharding has already placed."""
    hf = [m for _, m in model.named_modules() if callable(getattr(m, "initialize_weights", None))
          and callable(getattr(m, "_init_weights", None))]
    outer = [m for m in hf if not any(o is not m and any(c is m for c in o.modules()) for o in hf)]
    if outer:
        return lambda: [m.initialize_weights() for m in outer]
    if callable(getattr(model, "init_weights", None)):
        return model.init_weights
    raise ValueError(
        f"init=meta: {type(model).__name__} has no init_weights() method to initialise its parameters after they "
        "are sharded; add one (it must fill every parameter and non-persistent buffer in place, as after "
        "model.to_empty(device=...)), or plan with init='full' (every rank then builds the whole model first)"
    )


@torch.no_grad()
def materialize(part: nn.Module, index: int, plan: dict, device: torch.device) -> None:
    """Allocate ``part``'s (sharded) meta parameters and buffers on ``device`` and initialise them with the model's
    own init, seeded alike on every rank so that replicated weights agree (DTensor's RNG tracker offsets sharded
    ones on GPUs; on CPU each shard draws from the same seed). ``to_empty`` swaps tensors in place so weights tied
    within the part stay one parameter. Nothing to do when the part holds no meta tensor."""
    if not any(t.is_meta for t in [*part.parameters(), *part.buffers()]):
        return
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        part.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    torch.manual_seed(plan["seed"] + index)
    with ShardSeeds(plan["seed"] + index, device), _dtensor_rng_off(part, device):
        find_init(part)()


@contextlib.contextmanager
def _dtensor_rng_off(part: nn.Module, device: torch.device):
    """GPUs: keep DTensor's RNG tracker out of initialisation, where `ShardSeeds` seeds each shard. Left alone it
    would draw every shard from rank 0's state (broadcast over the world when it first runs) at an offset set by
    the shard's place in its own mesh, the same on every pipeline stage: stages with as many layers would get
    identical weights (torch 2.13, distributed/tensor/_random.py, _dispatch.py). Made here without that broadcast
    (each rank's own state, seeded alike per stage), its region off until the weights are drawn."""
    mesh = next((p.device_mesh for p in part.parameters() if isinstance(p, DTensor)), None)
    if device.type != "cuda" or mesh is None:
        yield
        return
    from torch.distributed.tensor import _random as dtensor_random

    if dtensor_random._rng_tracker is None:
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    tracker = dtensor_random._rng_tracker
    enabled, tracker.distribute_region_enabled = tracker.distribute_region_enabled, False
    try:
        yield
    finally:
        tracker.distribute_region_enabled = enabled


class ShardSeeds(TorchDispatchMode):
    """A random fill of a sharded DTensor draws from a generator seeded by the shard's mesh coordinates, so shards
    differ (one seed everywhere would repeat the same block in every shard) while copies of a shard on other ranks
    agree; the main stream, which replicated parameters draw from, is left where it was, the same on every rank of
    a stage. On GPUs with DTensor's RNG tracker off (`_dtensor_rng_off`), so that these seeds apply there too."""

    def __init__(self, seed: int, device: torch.device | None = None):
        super().__init__()
        self.seed, self.calls = seed, 0
        self.devices = [device] if device is not None and device.type == "cuda" else []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, DTensor) and torch.Tag.nondeterministic_seeded in func.tags:
            coords = target.device_mesh.get_coordinate() or []
            # every placement but Replicate splits the tensor: Shard, and FSDP's _StridedShard over TP, which torch
            # 2.13 does not count as is_shard() (its dp shards would all draw the same numbers)
            key = tuple(c for c, placement in zip(coords, target.placements) if not placement.is_replicate())
            if key:
                self.calls += 1
                with torch.random.fork_rng(devices=self.devices):
                    torch.manual_seed(hash((self.seed, self.calls, key)) % 2**63)
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def tied_copies(par: Parallel, tie: dict) -> list:
    """The distinct parameters on this rank that hold a copy of the tied weight ``tie`` (none on middle stages)."""
    copies = {}
    for part in par.parts:
        for name in tie["names"]:
            p = _local_parameter(part, name)
            if p is not None:
                copies.setdefault(id(p), p)
    return list(copies.values())


@torch.no_grad()
def sync_tied_weights(par: Parallel) -> None:
    """After meta init, make every copy of a weight tied across pipeline stages equal to the first stage's: copy
    within this rank's parts, then broadcast over the embedding group from its first member."""
    for tie, group in zip(par.plan["tied"], par.tied_groups):
        copies = [p.to_local() if isinstance(p, DTensor) else p for p in tied_copies(par, tie)]
        if not copies:
            continue
        first, *rest = copies
        for other in rest:
            other.copy_(first)
        if group is not None:
            dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
            for other in rest:
                other.copy_(first)


def block_list(part: nn.Module, plan: dict) -> nn.ModuleList:
    return part.get_submodule(plan["block_container"])


def split_pipeline(model: nn.Module, plan: dict, pp_rank: int) -> tuple[list, list]:
    """This rank's (virtual) stages: copies of ``model`` keeping only the blocks, embedding and head they own (a
    Hugging Face causal LM: `_hf_stage`).

    A weight tied between the embedding and the head stays in both copies (identical: every rank built the model from
    the same seed); summing their gradients after each backward keeps them equal.
    """
    container = plan["block_container"]
    parent, _, leaf = container.rpartition(".")
    if parent and not callable(getattr(model, "pipeline_stage", None)):  # (the emitter judged the rest of the rule:
        # `profiler.layers.pipeline_split_problem`)
        raise ValueError(f"pipeline parallelism cuts models whose blocks sit in a top-level nn.ModuleList or Hugging "
                         f"Face causal LMs; this model keeps them at {container!r}; plan it with pp=1")
    base = model.get_submodule(parent) if parent else model
    children = [name for name, _ in base.named_children()]
    at = children.index(leaf)
    owner = {name: plan["stage_of"]["embed"] for name in children[:at]}
    owner.update({name: plan["stage_of"]["head"] for name in children[at + 1 :]})
    mine = [s for s, r in enumerate(plan["stage_rank"]) if r == pp_rank]
    parts = []
    for k, stage in enumerate(mine):
        part = model if k == len(mine) - 1 else copy.deepcopy(model)
        host = part.get_submodule(parent) if parent else part
        blocks = getattr(host, leaf)
        keep = [i for i in range(len(blocks)) if plan["stage_of"][f"{container}.{i}"] == stage]
        setattr(host, leaf, nn.ModuleList(blocks[i] for i in keep))
        part._autopar_block_names = [f"{container}.{i}" for i in keep]
        if parent:  # a Hugging Face causal LM (`profiler.layers.pipeline_split_problem`)
            _hf_stage(part, host, plan, stage, keep, len(blocks))
            parts.append(part)
            continue
        for name, s in owner.items():
            if s != stage:
                setattr(part, name, None)
        parts.append(part)
    return mine, parts


def _hf_stage(part: nn.Module, base: nn.Module, plan: dict, stage: int, keep: list, n_blocks: int) -> None:
    """Make ``part`` (a `HFCausalLMLoss` whose base model ``base`` holds only this stage's blocks) one stage: the
    embedding dropped unless the stage owns it, the final norm an identity and the output head dropped unless it
    owns the head; parameter-free modules (rotary tables) stay, since every stage's base model makes its own
    positions, rotary tables and masks. A per-layer config list the base model indexes by a block's position in its
    list (Qwen2's ``layer_types[i]``) is cut to the blocks kept."""
    first, last = stage == plan["stage_of"]["embed"], stage == plan["stage_of"]["head"]
    names = [name for name, _ in base.named_children()]
    at = names.index(plan["block_container"].rpartition(".")[2])
    for i, name in enumerate(names):
        if i == at or not any(True for _ in getattr(base, name).parameters()):
            continue
        if i < at and not first:
            setattr(base, name, None)
        elif i > at and not last:
            setattr(base, name, nn.Identity())
    config = getattr(base, "config", None)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) == n_blocks:
        config.layer_types = [types[i] for i in keep]
    if not last:
        part.model.lm_head = None
    part.pipeline_stage(first=first, last=last)


def _to_replicate(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence-sharded local tensor → full tensor (all-gather; backward keeps this rank's slice)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _gather_seq(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Sequence-sharded local tensor → replicated DTensor for the column-parallel linears (all-gather). Kept a
    DTensor (torchtitan's ``PrepareModuleInput(..., use_local_output=False)``) so that those linears' input gradient
    stays Partial and this redistribution's backward reduce-scatters it: Megatron-LM's sequence parallelism, the
    same bytes as plain TP's all-reduce (a local tensor here would be all-reduced by ``ColwiseParallel``, then
    sliced)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])


def _as_replicate(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Replicated local tensor → replicated DTensor for the column-parallel linears (no communication). Their input
    gradients then add up as one Partial DTensor, all-reduced once by this conversion's backward: Megatron-LM's f
    operator, one all-reduce per attention or MLP. Left a local tensor, each ``ColwiseParallel`` would all-reduce
    its own (q, k and v: three)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


def _to_shard(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Full tensor → this rank's sequence slice (no communication; backward all-gathers)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def _convert_input(convert, mesh: DeviceMesh):
    """Forward pre-hook applying ``convert`` to the hidden states (first positional or ``hidden_states``)."""

    def hook(module, args, kwargs):
        if args:
            return (convert(args[0], mesh), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"], mesh)}

    return hook


def _convert_output(convert, mesh: DeviceMesh):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (convert(output[0], mesh), *output[1:])
        return convert(output, mesh)

    return hook


def apply_tp(part: nn.Module, plan: dict, tp_mesh: DeviceMesh) -> None:
    """Megatron tensor parallel on the blocks the plan names: column-parallel q/k/v and up-projections, row-parallel
    output projections (attention heads split with them: the models derive local heads from the weight shape). The
    attention and MLP inputs enter as replicated DTensors, so their backward all-reduces once per module (Megatron's
    f), not once per column-parallel linear.

    With sequence parallel the residual stream is sharded along the sequence inside each run of TP blocks: norms
    run on their slice (``SequenceParallel``), the attention/MLP inputs are all-gathered into a replicated DTensor
    (backward: one reduce-scatter of the column-parallel linears' Partial input gradient), the row-parallel outputs
    reduce-scattered (backward: all-gather), as in Megatron-LM and torchtitan; other arguments of those modules
    (rotary tables, masks) pass through untouched; the run's first block slices its input and its last block
    all-gathers its output.
    """
    sp = plan["sp"]
    if sp and (plan["seq"] // plan["cp"]) % plan["tp"]:  # (each context-parallel rank's part of the sequence)
        raise ValueError(f"sequence parallel needs the {plan['seq'] // plan['cp']} tokens of a rank's sequence "
                         f"(seq={plan['seq']} / cp={plan['cp']}) divisible by tp={plan['tp']}")
    names = part._autopar_block_names
    blocks = block_list(part, plan)
    flags = [name in plan["tp_blocks"] for name in names]
    for i, (block, on) in enumerate(zip(blocks, flags)):
        if not on:
            continue
        own, gather = block_tp_layout(block, plan)
        layout = {}
        for rel, kind in own.items():
            if kind == "colwise":
                layout[rel] = ColwiseParallel()
            else:
                layout[rel] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            for rel in plan["sp_norms"]:
                if _submodule(block, rel) is not None:
                    layout[rel] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, layout)
        for rel in gather:  # the modules whose input feeds column-parallel linears
            block.get_submodule(rel).register_forward_pre_hook(
                _convert_input(_gather_seq if sp else _as_replicate, tp_mesh), with_kwargs=True
            )
        if sp:
            if i == 0 or not flags[i - 1]:
                block.register_forward_pre_hook(_convert_input(_to_shard, tp_mesh), with_kwargs=True)
            if i == len(blocks) - 1 or not flags[i + 1]:
                block.register_forward_hook(_convert_output(_to_replicate, tp_mesh))


def block_tp_layout(block: nn.Module, plan: dict) -> tuple[dict, list]:
    """This block's entries of the plan's tensor-parallel layout (``{relative linear: "colwise" | "rowwise"}``, the
    union over the model's blocks) and the modules whose input it gathers (``sp_gather``: those holding one of its
    column-parallel linears): a MoE block beside dense ones holds no dense feed-forward projections, and its
    feed-forward's input stays a plain tensor."""
    own = {rel: kind for rel, kind in plan["tp_layout"].items() if _submodule(block, rel) is not None}
    parents = {rel.rpartition(".")[0] for rel, kind in own.items() if kind == "colwise"}
    return own, [rel for rel in plan["sp_gather"] if rel in parents]


def apply_vocab_parallel(part: nn.Module, plan: dict, tp_mesh: DeviceMesh) -> None:
    """Megatron-LM's vocabulary parallelism on the modules ``plan`` names (`planner.emit.config.vocab_modules`), where
    this part holds them. Each tensor-parallel rank keeps rows ``[r·⌈V/tp⌉, (r+1)·⌈V/tp⌉)`` of the token embedding
    (`VocabLookup`: other ids look up zeros, the output is all-reduced; the gradient stays sharded) and the same rows
    of the head's weight, so it computes its slice of the logits from the replicated hidden states (backward: one
    all-reduce of the input gradient); `lm_loss` takes the cross-entropy on those slices under ``loss_parallel``.
    A weight tied between the two (one parameter in this part) is sharded once and tied again: both shard its rows.

    Not torch's ``RowwiseParallel`` for the embedding: in torch 2.13 its backward computes the whole V×h gradient on
    every rank (``embedding_dense_backward`` on replicated inputs) and leaves it Replicate in ``.grad``."""
    embed = _submodule(part, plan["vocab_embed"])
    head = _submodule(part, plan["vocab_head"])
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        embed.weight = nn.Parameter(distribute_tensor(embed.weight, tp_mesh, [Shard(0)]),
                                    requires_grad=embed.weight.requires_grad)
        lookup = partial(VocabLookup, embed, tp_mesh, plan["vocab"])
        original = embed.forward

        def forward(*args, **kwargs):
            with lookup():
                return original(*args, **kwargs)

        embed.forward = forward
    if head is not None:
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)))
        if tied:
            head.weight = embed.weight


class VocabLookup(TorchFunctionMode):
    """Inside a vocabulary-parallel embedding's forward (its own code runs unchanged: a scaled embedding still
    scales), a lookup in its weight reads this rank's rows of the table, with zeros for ids outside them, and sums
    the partial results over the tensor-parallel group: one all-reduce forward, none backward, and a gradient that
    is this rank's rows only."""

    def __init__(self, module: nn.Module, tp_mesh: DeviceMesh, vocab: int):
        super().__init__()
        self.module, self.mesh, self.vocab = module, tp_mesh, vocab

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and args[1] is self.module.weight:
            return self.lookup(args[0], padding_idx=kwargs.get("padding_idx", args[2] if len(args) > 2 else None))
        return func(*args, **kwargs)

    def lookup(self, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        weight = self.module.weight
        table = weight.to_local() if isinstance(weight, DTensor) else weight
        start = self.mesh.get_local_rank() * -(-self.vocab // self.mesh.size())
        local = ids - start
        outside = (local < 0) | (local >= table.shape[0])
        if padding_idx is not None:
            padding_idx = padding_idx % self.vocab - start
            padding_idx = padding_idx if 0 <= padding_idx < table.shape[0] else None
        rows = F.embedding(local.masked_fill(outside, 0), table, padding_idx=padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(rows, self.mesh, [Partial()], run_check=False).redistribute(
            self.mesh, [Replicate()]).to_local()


def context_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Context-parallel rank ``rank``'s tokens of ``x`` along ``dim`` (the sequence): of 2·cp equal chunks, chunk
    ``rank`` followed by chunk 2·cp − 1 − ``rank``. A causal query's work grows with its position, so pairing an
    early chunk with a late one gives every rank the same share of the attention (Llama 3, Grattafiori et al. 2024
    §3.3.2; Megatron-LM's ``get_batch_on_this_cp_rank``; torch 2.13's ``_HeadTailLoadBalancer`` in
    torch/distributed/tensor/experimental/_context_parallel). The same cut serves the batch
    (`planner.emit.train.context_tokens`) and the positions (`apply_cp`)."""
    chunk, rest = divmod(x.shape[dim], 2 * cp)
    if rest or not chunk:
        raise ValueError(f"context parallelism cuts the sequence into 2·cp = {2 * cp} equal chunks, which its "
                         f"{x.shape[dim]} tokens do not make; use a sequence length that 2·cp divides")
    return torch.cat([x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * cp - 1 - rank) * chunk, chunk)], dim)


def context_masks(seq: int, cp: int, rank: int) -> list:
    """The causal masks of rank ``rank``'s two query chunks (global chunks a = rank and 2·cp − 1 − rank, c = seq /
    (2·cp) tokens each) over the keys before and in their chunk, [0, (a+1)·c): torch's lower-right-aligned causal
    bias, under which query i of the chunk sees keys up to a·c + i. Built once, when the model is parallelised:
    torch 2.13 cannot create its ``CausalBias`` tensor subclass under a dispatch mode (a fake-tensor trace,
    selective AC: "Creating a new Tensor subclass CausalBias but the raw Tensor object is already associated to a
    python object"), but takes an existing one there. On CUDA SDPA runs it as a flash or memory-efficient kernel with
    that alignment; on CPU it materialises the mask for its CPU kernel (torch/nn/attention/bias.py).

    Not built with ``causal_lower_right``: ``CausalBias`` defines no ``__new__``, so torch 2.13's legacy
    ``torch.Tensor(variant, seq_len_q, seq_len_kv)`` constructor allocates an uninitialised float32 tensor of that
    shape, 2·c·(a+1)·c·4 bytes of host memory per mask (137 GB for llama3-8b at 1M tokens over cp = 32, which
    `autopar check` failed to allocate). The bias carries no data (SDPA reads its variant and lengths), so it is
    made here on an empty meta tensor."""
    chunk = seq // (2 * cp)

    def lower_right(seq_q: int, seq_kv: int) -> CausalBias:
        bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0, device="meta"))
        bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, seq_q, seq_kv
        return bias

    return [lower_right(chunk, (a + 1) * chunk) for a in (rank, 2 * cp - 1 - rank)]


class ContextGather(torch.autograd.Function):
    """The cp group's keys or values in sequence order: ``x`` [b, 2·c, kv, d] holds this rank's two chunks
    (`context_shard`); returns [b, kv, 2·cp·c, d] (SDPA's layout), chunks 0 … 2·cp − 1. Forward: one all-gather
    (torch's functional op, waited on at once) and one copy that puts the chunks in order and in that layout (rank
    r sent chunks r and 2·cp − 1 − r). Backward: one copy of the gradient back into the order the ranks sent their
    chunks, and one reduce-scatter (sum): each rank's gradient collects the other ranks' queries' share.

    A function of its own, not the all-gather op's registered autograd formula followed by views: torch's autograd
    turns each ``select``, ``flip`` or ``permute`` of the gathered tensor into whole-sequence gradients of its own;
    here the backward holds the incoming gradient and one reordered copy. Under selective AC the ops inside run
    without autograd in the forward and in its recomputation alike, so the policy sees the same ops both times (it
    caches outputs by their order per op; the all-gather's among them, so a recomputation does not gather again).
    The collective ops are called directly, not through ``funcol``'s wrappers, whose ``AsyncCollectiveTensor``
    would wait at whichever op reads it first, another op in the recomputation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, cp: int) -> torch.Tensor:
        ctx.group_name, ctx.cp = group_name, cp
        local = x.permute(1, 0, 2, 3).contiguous()  # the sequence first: the all-gather concatenates along dim 0
        full = torch.ops._c10d_functional.all_gather_into_tensor(local, cp, group_name)
        torch.ops._c10d_functional.wait_tensor(full)  # (in place: the result is ``full`` itself)
        sent = full.view(2 * cp, x.shape[1] // 2, *local.shape[1:])  # rank r's chunks r, 2·cp − 1 − r: 2r, 2r + 1
        # (one out-of-place copy: selective AC caches the views it reads, which must not be written to)
        return torch.cat([sent[k].permute(1, 2, 0, 3) for k in _sent_index(cp)], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        b, kv, total, d = grad.shape
        chunks = grad.view(b, kv, 2 * cp, total // (2 * cp), d)
        order = _sent_index(cp)  # chunk j came from position order[j] of the gathered tensor
        where = sorted(range(2 * cp), key=order.__getitem__)  # position k holds chunk where[k]
        sent = torch.cat([chunks[:, :, j].permute(2, 0, 1, 3) for j in where])
        mine = torch.ops._c10d_functional.reduce_scatter_tensor(sent, "sum", cp, ctx.group_name)
        torch.ops._c10d_functional.wait_tensor(mine)
        return mine.permute(1, 0, 2, 3), None, None


def _sent_index(cp: int) -> list:
    """Where sequence chunk j (0 … 2·cp − 1) sits in the cp group's all-gathered chunks: rank r sends chunks r and
    2·cp − 1 − r, which land at 2r and 2r + 1."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


def _gqa_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float) -> bool:
    """Whether SDPA takes these grouped-query keys and values [b, kv_heads, s, d] as they are: torch 2.13's flash
    kernel does (CUDA, fp16/bf16; ``check_batch_size_and_num_heads_dense<true>`` in its sdp_utils), and
    ``CausalBias`` picks it first for a lower-right mask (torch/nn/attention/bias.py). Its memory-efficient kernel
    does not, and on CPU or under it the mask would be materialised, so elsewhere the keys are expanded to the
    query heads first."""
    if query.device.type != "cuda" or key.shape[1] == query.shape[1]:
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(query, key, value, None, dropout_p, False, True))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, rank: int,
                               masks: list, dropout_p: float = 0.0) -> torch.Tensor:
    """Exact causal attention of this context-parallel rank's queries over the whole sequence. ``q`` [b, s, heads,
    d], ``k``, ``v`` [b, s, kv_heads, d] hold the rank's two chunks (`context_shard`, s = 2·c tokens); returns [b, s,
    heads, d] for the same tokens.

    1. gather keys and values over the cp group in sequence order (`ContextGather`), before grouped-query
       expansion: GQA's smaller K/V is what travels;
    2. per local query chunk a, SDPA over keys [0, (a+1)·c) with a lower-right causal mask (`context_masks`): the
       keys are a view of the gathered ones, given to the kernel as grouped-query heads where it takes them
       (`_gqa_kernel`: flash on CUDA), else expanded to the query heads for that chunk only (query head j reads kv
       head j // rep, repeat_interleave order, as the zoo models).

    Memory (`costmodel.layercost.context_parallel_comm` prices it, `tests/test_cp.py` traces it): the attention
    saves the chunks' keys and values: views of the gathered kv-head tensors with the flash kernel, the chunks'
    expanded copies elsewhere ((2·cp + 1)·c positions of query heads). Its backward makes each chunk's key and value
    gradients at the query heads (flash expands them inside its kernel too) and sums the two chunks' into
    whole-sequence kv-head buffers.

    Rank r's two chunks see (r + 1) + (2·cp − r) = 2·cp + 1 chunks of keys, the same on every rank. This is the
    all-gather form of context parallelism (Llama 3's, Grattafiori et al. 2024 §3.3.2), in plain torch on every
    device; torch's experimental ``context_parallel`` (ring attention) is not used yet: in torch 2.13 it replaces
    only the CUDA SDPA kernels, so it would not run on CPU/gloo."""
    b, s, heads, d = q.shape
    kv_heads, chunk = k.shape[2], s // 2
    if torch.is_autocast_enabled(q.device.type):  # (DDP under autocast: RoPE's fp32 tables leave q and k in fp32
        # while v is in the autocast dtype; SDPA's autocast would cast them, but a CausalBias mask dispatches
        # before autocast and refuses mixed dtypes: torch/nn/attention/_utils.py, _validate_sdpa_input)
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    keys, values = (ContextGather.apply(x, group.group_name, cp) for x in (k, v))  # [b, kv, 2·cp·c, d]
    out = []
    for half, (a, mask) in enumerate(zip((rank, 2 * cp - 1 - rank), masks)):
        query = q[:, half * chunk : (half + 1) * chunk].transpose(1, 2)
        seen = (a + 1) * chunk
        key, value = keys[:, :, :seen], values[:, :, :seen]
        gqa = kv_heads != heads and _gqa_kernel(query, key, value, dropout_p)
        if kv_heads != heads and not gqa:
            rep = heads // kv_heads  # (a copy, also for one kv head, where a reshape would make a stride-0 view
            # that SDPA copies inside, out of the cost model's sight)
            key = key[:, :, None].expand(b, kv_heads, rep, seen, d).contiguous().view(b, heads, seen, d)
            value = value[:, :, None].expand(b, kv_heads, rep, seen, d).contiguous().view(b, heads, seen, d)
        out.append(F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                                  enable_gqa=gqa).transpose(1, 2))
    return torch.cat(out, dim=1)


def attention_modules(part: nn.Module) -> list:
    """The modules whose attention core `apply_cp` replaces: those with an ``attend(q, k, v)`` method (the zoo
    models' protocol, `profiler.layers.context_parallel_ready`)."""
    return [m for m in part.modules() if callable(getattr(m, "attend", None))]


def apply_cp(part: nn.Module, plan: dict, cp_mesh: DeviceMesh) -> None:
    """Context parallelism: the model sees this rank's two chunks of every sequence (`context_shard`; the training
    step cuts the batch the same way) at their global positions (``part.context_positions``, read by the model's
    RoPE or position embedding), and each attention's ``attend`` becomes `context_parallel_attention` over the cp
    group. Tensor parallelism composes: the attention sees this rank's heads, and under sequence parallelism the
    norms see a 1/tp slice of the rank's tokens, gathered back before the attention. Dropout on the attention
    probabilities (the zoo GPT's ``dropout``, while training) is kept, drawn per rank."""
    if getattr(part, "context_positions", False) is not None or not attention_modules(part):
        raise ValueError(f"cp={plan['cp']}: {type(part).__name__} has no context_positions attribute (None) or no "
                         "attention module with an attend(q, k, v) method, which context parallelism replaces; use "
                         "a zoo llama: or gpt: model, or plan with cp=1")
    cp, rank, group = plan["cp"], cp_mesh.get_local_rank(), cp_mesh.get_group()
    part.context_positions = context_shard(torch.arange(plan["seq"], device=current_device()), cp, rank, dim=0)
    masks = context_masks(plan["seq"], cp, rank)
    for module in attention_modules(part):

        def attend(q, k, v, module=module):
            dropout = getattr(module, "dropout", 0.0)
            p = dropout if module.training and isinstance(dropout, float) else 0.0
            return context_parallel_attention(q, k, v, group, cp, rank, masks, dropout_p=p)

        module.attend = attend


def _submodule(part: nn.Module, name: str | None):
    """``part``'s module at the dotted ``name``, or None (no name, or split off on this pipeline stage)."""
    if not name:
        return None
    module = part
    for attr in name.split("."):
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module


#: torch's fused attention kernels: saved whole by selective AC (their outputs, log-sum-exp and RNG state are all their
#: backward needs), as torchtitan's op-level policy saves them
_FUSED_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name)}


def _dropout_p(op, args, kwargs) -> float:
    """The ``dropout_p`` an attention op is called with (its schema's argument, by name)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            return kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value or 0.0)
    return 0.0


def _selective_policy(batch: int, seq: int):
    """Selective AC (Korthikanti et al. 2022 §4.2) for micro-batches of ``batch`` sequences of ``seq`` tokens (this
    rank's): recompute the attention core, i.e. the ops that read or make the seq×seq scores and probabilities (QKᵀ,
    mask, softmax, dropout, ·V: `costmodel.runnable.attention_scores`, the capture's rule); keep everything else.
    Random ops (dropout masks), allocations and in-place ops are recomputed too: with the RNG state preserved they
    replay identically, and a tensor filled in place must not be served from the cache. A fused attention kernel
    makes no seq×seq tensor and is kept (`_FUSED_ATTENTION`) where it draws no dropout: torch 2.13 tags those
    kernels ``nondeterministic_seeded``, which would otherwise recompute them, where the cost model reads selective
    AC on a fused kernel as keeping everything (`profiler.graph.NodeInfo.is_attention_core`). With dropout it is
    recomputed: the recomputation replays the block's random draws from its start (preserve_rng_state), and a kept
    kernel would skip its own, so every later dropout would draw other masks (torch/utils/checkpoint.py)."""

    def policy(ctx, op, *args, **kwargs):
        if op in _FUSED_ATTENTION and not _dropout_p(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if torch.Tag.nondeterministic_seeded in op.tags or op.name().startswith("aten::empty") or \
                op._schema.is_mutable:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _in_attention_core(op, args, batch, seq):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _in_attention_core(op, args, batch: int, seq: int) -> bool:
    """Whether ``op`` reads or makes attention scores (`costmodel.runnable.attention_scores`): an op of the
    attention core, as the capture judges it."""
    if any(isinstance(a, torch.Tensor) and attention_scores(tuple(a.shape), batch, seq) for a in args):
        return True
    if op in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default) and len(args) >= 2:
        a, b = args[-2], args[-1]  # batched Q·Kᵀ makes [batch·heads, seq, seq]
        return a.dim() == 3 and b.dim() == 3 and attention_scores((a.shape[0], a.shape[-2], b.shape[-1]), batch, seq)
    return False


def _is_matmul(op) -> bool:
    """A matmul of the per-op policy: an op torch's FLOP counter counts (`torch.utils.flop_counter.flop_registry`:
    mm, addmm, bmm, baddbmm, convolutions, scaled mm), attention kernels aside. The capture calls a node a matmul
    by the same counter (`profiler.capture`: a node with FLOPs), so the runtime's 1st, 2nd, … matmul of a block is
    the cost model's."""
    return op.overloadpacket in flop_registry and "attention" not in op.name()


#: the collectives whose outputs the per-op policy keeps, as torchtitan's does: a reduce-scatter (sequence
#: parallelism's row-parallel output) is not repeated in the recomputation; all-gathers and all-reduces are
_SAVED_COLLECTIVES = {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _op_policy(batch: int, seq: int):
    """Selective AC where the attention is a fused kernel (`costmodel.runnable.selective_policy`:
    ``every-other-matmul``, torchtitan's ``selective_ac_option = "op"``) for micro-batches of ``batch`` sequences of
    ``seq`` tokens: keep the outputs of the attention kernel, of reduce-scatters and of the odd matmuls of the
    block's forward (1st, 3rd, …), recompute every other op. A fresh policy per call of a block (`apply_ac`'s
    ``context_fn`` runs once per call), so every micro-batch keeps the same ops, as the cost model prices
    (`costmodel.layercost.layer_cost`; torchtitan counts over all calls of a block). torch 2.13 asks the policy in
    the forward only and serves each kept output back by its op's count (torch/utils/checkpoint.py,
    ``_CachedTorchDispatchMode``); earlier releases ask it again in the recomputation (``is_recompute``) and pop a
    kept output where it says keep, so the recomputation counts its matmuls apart: a shared count would flip the
    parity of a block with an odd number of matmuls and serve one matmul another's output (measured on torch 2.11,
    CUDA: "shape '[8, 2048, 1024]' is invalid for input of size 33554432").

    Attention with dropout is recomputed, as in `_selective_policy`. Where SDPA runs it unfused (torch 2.13 on CPU:
    its flash kernel takes no dropout, so SDPA falls back to its math path), the batched matmuls of that core are
    part of the attention, which the capture costs as one kernel, not matmuls: they are recomputed and not counted.

    A block that writes in place into a kept output is refused (`_selective_contexts`), under either policy."""
    count = {False: 0, True: 0}  # (forward, recomputation)

    def policy(ctx, op, *args, **kwargs):
        if op in _FUSED_ATTENTION:
            return CheckpointPolicy.PREFER_RECOMPUTE if _dropout_p(op, args, kwargs) else CheckpointPolicy.MUST_SAVE
        if op in _SAVED_COLLECTIVES:
            return CheckpointPolicy.MUST_SAVE
        if _in_attention_core(op, args, batch, seq):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _is_matmul(op):
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _storage_key(t):
    """An identity of the storage under ``t`` (a DTensor's: its local shard's), or None (no tensor)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (a tensor without storage)
        return None


def _selective_contexts(policy):
    """The contexts of one call of a selectively checkpointed block: torch's (`create_selective_checkpoint_contexts`)
    with ``policy``, which also refuses an in-place write into a tensor it keeps for the backward. torch checks a
    kept output's version when it serves it back, but a write through a view with a version counter of its own
    escapes that check (``linear`` on a 3-D input returns ``_unsafe_view(mm(…))``: ``h = linear(x); h.mul_(2)``),
    and the backward would read the written values where the recomputation assumed the op's: wrong gradients,
    without a word. torch asks the policy about every op of the forward, the output at hand in 2.13
    (``SelectiveCheckpointContext.op_output``), so the storages kept are known, and a later op writing into one is
    refused before any backward runs (with no ``op_output``, as in earlier releases, nothing is checked)."""
    kept: set = set()

    def keeping(ctx, op, *args, **kwargs):
        if kept and op._schema.is_mutable:
            for i, arg in enumerate(op._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write and \
                        _storage_key(kwargs.get(arg.name, args[i] if i < len(args) else None)) in kept:
                    raise RuntimeError(
                        f"selective activation checkpointing keeps a tensor that this block then changes in place "
                        f"({op}): its backward would read the changed values; write the block out of place "
                        "(y = y * 2, not y.mul_(2)) or re-plan with --fix ac=full or ac=none")
        decision = policy(ctx, op, *args, **kwargs)
        out = getattr(ctx, "op_output", None)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not ctx.is_recompute and tensors and (
                (op is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter))
                or all(getattr(a, "_autopar_weight_copy", False) for a in tensors)):
            # a weight's cast (autocast's, the cache off: `_WithoutCastCache`) and its views: recast, not kept, or
            # every call would keep a copy of the block's weights till its backward (marked on the tensors
            # themselves: a storage's address is reused once it is freed)
            for t in outs:
                if isinstance(t, torch.Tensor):
                    t._autopar_weight_copy = True
            return CheckpointPolicy.PREFER_RECOMPUTE
        if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE) and not ctx.is_recompute:
            for t in outs:
                if (key := _storage_key(t)) is not None:
                    kept.add(key)
        return decision

    forward, recompute = create_selective_checkpoint_contexts(keeping)
    if torch.compiler.is_compiling() or not any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu")):
        return forward, recompute  # (compiling, torch wants its own two modes: torch/_higher_order_ops/wrap.py)
    return _WithoutCastCache(forward), _WithoutCastCache(recompute)


class _WithoutCastCache:
    """A selective checkpoint's context ``inner`` with autocast's weight cache off. Under ``torch.autocast`` the
    forward of a selectively checkpointed block (the first in its region) cast each weight and the recomputation
    found the copy cached and cast none, so torch's replay of the forward's ops by their count
    (``_CachedTorchDispatchMode``) served the recomputation's casts the outputs kept for others: a kept cast of
    another input of the same shape silently (wrong gradients), else a failure at the first backward (measured with
    real tensors, one gloo rank under CPU autocast: llama 3 × 256 with 4 heads, DDP bf16, the per-op policy then run:
    "aten.mul.Scalar encountered during backward but not found in storage"). Without the cache both cast every
    weight they use (the same values: the same loss to the last bit as full checkpointing with the cache),
    `_selective_contexts` keeps none of those copies (recast in the recomputation), and the cost model prices no
    cached copy for the block, its recomputation's in its backward (`costmodel.layercost.layer_cost`). Not under
    ``torch.compile`` (whose checkpoint takes torch's two dispatch modes only), where this is untested."""

    def __init__(self, inner):
        self.inner, self.cached = inner, []

    def __enter__(self):
        self.cached.append(torch.is_autocast_cache_enabled())
        torch.set_autocast_cache_enabled(False)
        try:
            return self.inner.__enter__()
        except BaseException:
            torch.set_autocast_cache_enabled(self.cached.pop())
            raise

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            torch.set_autocast_cache_enabled(self.cached.pop())


def _op_contexts(batch: int, seq: int):
    """The selective-checkpoint contexts of one call of a block under `_op_policy` (a policy of its own)."""
    return _selective_contexts(_op_policy(batch, seq))


def _checkpointed_attend(module: nn.Module, *args, **kwargs):
    """``module``'s own ``attend`` (its class's) under torch's (non-reentrant) checkpoint: Megatron-LM's checkpointed
    core attention. Its saved tensors (the seq×seq scores and probabilities, a dropout's mask) are dropped and the
    core is recomputed from its inputs, which the checkpoint holds, just before its backward; the RNG state is
    preserved so that recomputed dropout draws the same mask. Installed as ``functools.partial(…, module)``, which a
    deep copy of the model copies with it (a closure would keep calling the original module)."""
    return torch.utils.checkpoint.checkpoint(type(module).attend, module, *args, use_reentrant=False,
                                             preserve_rng_state=True, **kwargs)


def selective_of(plan: dict, block: nn.Module | None = None) -> str:
    """The plan's selective-checkpointing policy (`costmodel.runnable.selective_policy`). A plan from before the
    field ran its blocks under torch's selective checkpoint recomputing the attention core: so again
    (``all-but-attention-core``), but where ``block`` computes its core in attend methods and the sequence is whole,
    which checkpoints those (``attention-core``)."""
    if plan.get("selective"):
        return plan["selective"]
    whole = plan.get("cp", 1) == 1 and block is not None and attention_modules(block)
    return "attention-core" if whole else "all-but-attention-core"


def apply_ac(part: nn.Module, plan: dict) -> None:
    """Wrap the blocks the plan checkpoints: ``full`` recomputes the block; ``selective`` (the plan's policy,
    `costmodel.runnable.selective_policy`) its attention core: ``attention-core`` checkpoints each attention's
    ``attend`` (`_checkpointed_attend`); ``all-but-attention-core`` (a core not in an ``attend`` method) runs the block
    under torch's selective checkpoint recomputing the ops of the core (`_selective_policy`); and
    ``every-other-matmul`` (the model's attention is a fused kernel) keeps the outputs of its attention kernel and
    odd matmuls (`_op_policy`). The RNG state is preserved so that recomputed dropout draws the same masks."""
    blocks = block_list(part, plan)
    for i, name in enumerate(part._autopar_block_names):
        mode = plan["ac"].get(name, "none")
        policy = selective_of(plan, blocks[i])
        if mode == "full":
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=True)
        elif mode == "selective" and policy == "every-other-matmul":
            # (a fresh policy per call; cp > 1 is refused with this policy: `costmodel.runnable.problems`)
            context_fn = partial(_op_contexts, plan.get("mbs", 1), plan.get("seq", 0))
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=True, context_fn=context_fn)
        elif mode == "selective" and policy == "attention-core":
            modules = attention_modules(blocks[i])
            if not modules:
                raise ValueError(f"block {name} has no attention module with an attend(q, k, v) method, whose call "
                                 "the plan's selective policy attention-core checkpoints; re-plan this model")
            for module in modules:
                wrapped = module.__dict__.get("attend")
                if isinstance(wrapped, partial) and wrapped.func is _checkpointed_attend:
                    continue  # (wrapped already: not twice)
                if wrapped is not None or not callable(getattr(type(module), "attend", None)):
                    raise ValueError(f"{type(module).__name__}.attend is set on the module, not a method of its "
                                     "class, which selective checkpointing wraps; define it in the class")
                module.attend = partial(_checkpointed_attend, module)
        elif mode == "selective":
            # (this rank's sequence: context parallelism splits it)
            core = _selective_policy(plan.get("mbs", 1), plan.get("seq", 0) // plan.get("cp", 1))
            context_fn = partial(_selective_contexts, core)
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=True, context_fn=context_fn)


def _hidden_slice(x: torch.Tensor, mesh: DeviceMesh, own: bool = False) -> torch.Tensor:
    """Replicated tensor → this rank's slice of the last dimension (no communication; backward all-gathers); a
    copy of its own with ``own``, not a view."""
    last = x.dim() - 1
    out = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(last)]).to_local()
    return out.clone() if own else out


def _hidden_gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Slices of the last dimension → the whole tensor on every rank (all-gather; backward keeps this slice)."""
    last = x.dim() - 1
    return DTensor.from_local(x, mesh, [Shard(last)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def apply_pp_scatter(part: nn.Module, stage: int, plan: dict, tp_mesh: DeviceMesh) -> None:
    """Megatron-LM's scatter/gather across pipeline boundaries (Narayanan et al. 2021 §4.1): the activation leaving
    a stage is the same on every tensor-parallel rank, so each sends only its 1/tp slice of the hidden dimension
    and the next stage all-gathers the slices over its tensor-parallel group (inside a node) before its first
    block; the gradients go back the same way. The pipeline carries 1/tp of the bytes, as the cost model charges."""
    n_stages = plan["pp"] * plan["vpp"]
    if stage < n_stages - 1:
        # zero-bubble: torch 2.13's input pass detaches a stage's outputs in place (``stage_backward_input``, on
        # every stage but the first), which the view ``to_local`` gives refuses; the slice is sent as a tensor of its
        # own there (a copy of 1/tp of the activation), as the last stage's loss is (`vocab_parallel_loss`)
        own = plan["schedule"] == "zb" and stage > 0
        part.register_forward_hook(lambda module, args, out: _hidden_slice(out, tp_mesh, own))
    if stage > 0:
        part.register_forward_pre_hook(lambda module, args: (_hidden_gather(args[0], tp_mesh), *args[1:]))


def apply_pp_compress(part: nn.Module, stage: int, plan: dict) -> None:
    """Send bf16 activations between stages: cast the output of every non-last stage, cast back on entry."""
    n_stages = plan["pp"] * plan["vpp"]
    if stage < n_stages - 1:
        part.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    if stage > 0:
        dtype = torch.float32 if current_device().type == "cpu" else DTYPES[plan["precision"]]
        part.register_forward_pre_hook(lambda module, args: (args[0].to(dtype), *args[1:]))


def cast_hook(dtype: torch.dtype):
    """DDP comm hook: all-reduce the gradient bucket in ``dtype`` (bf16/fp16), torch's ``fp16_compress_hook`` on any
    backend (its ``bf16_compress_hook`` is NCCL-only in torch 2.13). The all-reduce is in place, so the result is
    read from the sent buffer (a fake process group's future carries no value: `autopar check` traces this too)."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        compressed = bucket.buffer().to(dtype).div_(group.size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            out = bucket.buffer()
            out.copy_(compressed)
            return out

        return future.then(decompress)

    return hook


def apply_dp_allreduce(part: nn.Module, plan: dict, dp_mesh: DeviceMesh) -> nn.Module:
    """Data parallel without DDP, where DDP cannot reduce correctly (`costmodel.runnable.post_step_allreduce`):
    tensor-parallel DTensor parameters (DDP takes none), and the zero-bubble schedule, whose weight gradients torch
    computes with ``autograd.grad`` and writes to ``.grad`` by hand, so DDP's reducer hooks would never fire and the
    replicas would drift apart. `allreduce_grads` averages the gradients over the dp group after the whole backward
    (see `train_step`); the part is returned as it is."""
    part._autopar_grad_group = dp_mesh.get_group()
    return part


def apply_ddp(part: nn.Module, plan: dict, dp_mesh: DeviceMesh) -> nn.Module:
    """ZeRO 0: DDP over the dp group, with the plan's gradient compression as a comm hook."""
    cuda = current_device().type == "cuda"
    group = dp_mesh.get_group()
    # gradients as views into the reduction buckets: without it DDP keeps a second copy of every gradient
    ddp = DDP(part, process_group=group, device_ids=[current_device()] if cuda else None, gradient_as_bucket_view=True)
    if plan["grad_compress"] in ("bf16", "fp16"):
        ddp.register_comm_hook(group, cast_hook(DTYPES[plan["grad_compress"]]))
    elif plan["grad_compress"] == "powersgd":
        # PowerSGD counts synchronised backwards, and the first step of a run with micro-batches has two
        # (`planner.emit.train.train_step_loss`): one more keeps compression starting at the plan's step
        extra = 1 if plan["grad_accum"] > 1 else 0
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=plan["powersgd_rank"],
            start_powerSGD_iter=plan["powersgd_start_iter"] + extra, random_seed=plan["seed"],
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def fsdp_policy(plan: dict) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision: only on GPUs (CPU runs stay fp32); gradients reduced in fp32 (as torchtitan does),
    in bf16/fp16 when the plan compresses."""
    on_gpu = current_device().type == "cuda"
    compress = plan["grad_compress"]
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[plan["precision"]] if on_gpu and plan["precision"] != "fp32" else None,
        # fp32 reduction (and accumulation across micro-batches) unless the plan compresses: torch's default (None)
        # would reduce in the bf16 compute dtype, which the cost model does not charge and the user did not ask for
        reduce_dtype=DTYPES[compress] if compress in ("bf16", "fp16") else torch.float32,
    )


def apply_fsdp(part: nn.Module, plan: dict, dp_mesh: DeviceMesh) -> nn.Module:
    """ZeRO 2-3: FSDP2 per block, then the root, with `fsdp_policy`'s mixed precision."""
    mp = fsdp_policy(plan)
    reshard = plan["zero"] == 3  # ZeRO 1/2: keep parameters gathered between forward and backward
    for block in block_list(part, plan):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    return part


def expert_modules(part: nn.Module) -> list:
    """The expert modules `apply_ep` split on this part (each holding this rank's E/ep experts)."""
    return [m for m in part.modules() if getattr(m, "_autopar_experts", False)]


def expert_param_ids(part: nn.Module) -> set:
    """``id`` of each expert parameter of ``part`` (this rank's E/ep experts, as the part holds them now)."""
    return {id(p) for m in expert_modules(part) for p in m.parameters()}


def is_expert_parameter(part: nn.Module, p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert parameter of ``part`` (this rank's E/ep experts)."""
    return id(p) in expert_param_ids(part)


def expert_param_names(part: nn.Module) -> list:
    """Names in ``part`` of the expert parameters (DDP ignores them: they are reduced over edp)."""
    ids = expert_param_ids(part)
    return [name for name, p in part.named_parameters() if id(p) in ids]


def apply_ep(part: nn.Module, plan: dict, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism (GShard; torchtitan's ``ExpertParallel``): in every block, each expert module named by
    ``plan["ep_modules"]`` keeps experts [e·E/ep, (e+1)·E/ep) of its stacked weights (dim 0) for ep rank e, as plain
    parameters (DDP and FSDP2 then treat them as any other local tensor, over the edp group), and its forward becomes
    `expert_parallel_forward`: the rows each rank routed to an expert go to the rank holding it and come back."""
    rank, ep, experts = ep_mesh.get_local_rank(), plan["ep"], plan["experts"]
    local = experts // ep
    wrap = expert_parallel_forward if plan["ep_interface"] == "counts" else expert_parallel_topk_forward
    for block in block_list(part, plan):
        for rel in plan["ep_modules"]:
            module = _submodule(block, rel)
            if module is None:  # a dense block (DeepSeek's first layers): no experts
                continue
            for name, p in list(module.named_parameters(recurse=False)):
                mine = p.detach()[rank * local : (rank + 1) * local].clone()
                setattr(module, name, nn.Parameter(mine, requires_grad=p.requires_grad))
            if hasattr(module, "num_experts"):  # (transformers' experts size their routing tables by it)
                module.num_experts = local
            module._autopar_experts = True
            module.forward = partial(wrap, module.forward, ep_mesh.get_group(), ep, experts)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def expert_parallel_forward(local_forward, group, ep: int, experts: int, x: torch.Tensor,
                            counts: list | None = None) -> torch.Tensor:
    """The experts of all ep ranks applied to ``x`` (rows sorted by global expert, ``counts[e]`` rows for expert e;
    None: equal segments), each rank computing its own experts' rows:

    1. the per-expert counts are exchanged (one all-to-all of E integers), so each rank knows how many rows it gets
       from every other for each of its experts;
    2. dispatch: all-to-all of the rows (each rank's segments for rank r's experts go to r), with autograd (torch's
       functional ``all_to_all_single``: its backward is the reverse all-to-all);
    3. the received rows, ordered by (source rank, local expert), are regrouped by local expert, run through the
       local experts (``local_forward``, the model's own forward on the local weights) and put back in order;
    4. combine: the reverse all-to-all returns every row to the rank that routed it.

    With equal segments (capacity routing, and the balanced case the model takes on fake tensors, where counts have
    no values: `autopar check`) every rank sends E/ep equal segments to each rank: the received counts are the sent
    ones and the exchange's result is not read (it is still issued, as in a real step)."""
    local = experts // ep
    if x.is_meta:  # shapes only (nothing to exchange): the output has the input's shape
        return torch.empty_like(x)
    hidden = x.shape[-1]
    balanced = counts is None
    if balanced:
        counts = [x.shape[0] // experts] * experts
    got = _waited(funcol.all_to_all_single(torch.tensor(counts, device=x.device), None, None, group))
    sent = [counts[r * local : (r + 1) * local] for r in range(ep)]  # [to rank r][its local expert j]
    received = sent if balanced else got.view(ep, local).tolist()  # [from rank r][my local expert j]
    send_splits, recv_splits = [sum(c) for c in sent], [sum(c) for c in received]
    rows = _waited(funcol.all_to_all_single(x, recv_splits, send_splits, group))
    if balanced:
        per = counts[0]
        by_expert = rows.view(ep, local, per, hidden).transpose(0, 1).reshape(-1, hidden)
        out = local_forward(by_expert, None).view(local, ep, per, hidden).transpose(0, 1).reshape(-1, hidden)
    else:
        pieces = rows.split([received[r][j] for r in range(ep) for j in range(local)])
        by_expert = torch.cat([pieces[r * local + j] for j in range(local) for r in range(ep)])
        done = local_forward(by_expert, [sum(received[r][j] for r in range(ep)) for j in range(local)])
        pieces = done.split([received[r][j] for j in range(local) for r in range(ep)])
        out = torch.cat([pieces[j * ep + r] for r in range(ep) for j in range(local)])
    return _waited(funcol.all_to_all_single(out, send_splits, recv_splits, group))


def expert_parallel_topk_forward(local_forward, group, ep: int, experts: int, hidden_states: torch.Tensor,
                                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Expert parallelism for Hugging Face transformers' experts interface (``forward(hidden_states, top_k_index,
    top_k_weights)`` → the weighted sum over each token's experts): the (token, choice) pairs are sorted by expert
    (a stable sort), sent to their experts by `expert_parallel_forward`, where the local experts run each received
    row as a token with one choice of weight 1 (``local_forward``, the model's own experts code on this rank's
    experts), and the returned rows are put back in (token, choice) order and combined with the routing weights."""
    tokens, k = top_k_index.shape
    if hidden_states.is_meta:
        return torch.empty_like(hidden_states)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = None if _values_unknown(flat) else torch.bincount(flat, minlength=experts).tolist()
    local = experts // ep

    def run_local(rows: torch.Tensor, local_counts: list | None) -> torch.Tensor:
        n = rows.shape[0]
        if n == 0:  # nothing routed to this rank: stay in the graph (zero gradients for the experts), so that the
            # all-to-alls' backward runs here as on the other ranks (transformers' eager expert loops return a new
            # zeros tensor then, and the peers' reverse all-to-alls would wait for this rank for ever)
            params = local_forward.__self__.parameters()  # (apply_ep passes the experts module's bound forward)
            return rows + sum((p.reshape(-1)[:1].sum() * 0 for p in params), rows.new_zeros(()))
        sizes = local_counts if local_counts is not None else [n // local] * local
        ids = torch.repeat_interleave(torch.arange(local, device=rows.device),
                                      torch.tensor(sizes, device=rows.device), output_size=n)
        return local_forward(rows, ids.view(n, 1), rows.new_ones(n, 1))

    out = expert_parallel_forward(run_local, group, ep, experts, hidden_states.index_select(0, order // k), counts)
    # back in (token, choice) order: a gather by the inverse permutation (its backward keeps the index only, where
    # an index_copy into the sorted order would keep a copy of the rows for its backward)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    pairs = out.index_select(0, inverse)
    return (pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1)


def _values_unknown(x: torch.Tensor) -> bool:
    """Whether ``x`` has no values to count (meta, fake: `autopar check`'s trace takes the balanced case)."""
    return x.is_meta or is_fake(x)


def apply_fsdp_experts(part: nn.Module, plan: dict, edp_mesh: DeviceMesh) -> None:
    """ZeRO 2-3 for the experts (torchtitan's recipe): each expert module its own FSDP2 unit over the edp group (the
    ranks holding the same experts), before the blocks' units, which then leave its parameters alone. The
    reduce-scatter sums over edp; dividing by dp, not edp, gives the mean over the global batch: a rank's expert
    gradient already sums the contributions of the ep ranks whose rows it computed.

    FSDP2 shards dim 0, the rank's E/ep experts; where they do not split evenly over edp (Mixtral's 8 experts at
    ep = 8 leave one per rank, and edp ranks > 1 would hold it whole on one and nothing on the others, gathering
    edp padded copies), the weights are sharded along dim 1 instead, as torchtitan does when edp · ep > E."""
    reshard = plan["zero"] == 3
    local, edp = plan["experts"] // plan["ep"], edp_mesh.size()
    placement = None if local % edp == 0 else (lambda p: Shard(1))  # (None: FSDP2's default, Shard(0))
    for module in expert_modules(part):
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=reshard, mp_policy=fsdp_policy(plan),
                    shard_placement_fn=placement)
        module.set_gradient_divide_factor(plan["dp"])
        # gloo has no pre-multiplied sum: sum, then divide (not on one rank, where torch 2.13 divides the copy it
        # makes instead of a reduce-scatter, and would divide again after)
        if current_device().type != "cuda" and edp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)


GRAD_BUCKET_BYTES = 25 * 2**20  #: DDP's default bucket cap, used for the gradient all-reduces after the backward


def allreduce_in_buckets(grads: list, group, divide: int = 1) -> None:
    """Sum ``grads`` (plain tensors, in place) over ``group`` and divide by ``divide``: packed, like DDP, into flat
    buckets of at most `GRAD_BUCKET_BYTES` of one dtype (one all-reduce each, not one per tensor, and no copy of
    them all at once)."""
    bucket: list = []
    size = 0
    for k, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        last = k == len(grads) - 1
        if size >= GRAD_BUCKET_BYTES or last or grads[k + 1].dtype != grad.dtype:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            if divide != 1:
                flat.div_(divide)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def reduce_expert_grads(par: Parallel) -> None:
    """ZeRO 0: the experts' gradients (which DDP ignores) summed over the edp group and divided by dp, after the
    whole backward (see `apply_fsdp_experts` for why dp), in buckets (`allreduce_in_buckets`)."""
    edp = par.mesh["edp"]
    for part in par.parts:
        grads = [p.grad for m in expert_modules(part) for p in m.parameters() if p.grad is not None]
        if edp.size() > 1:
            allreduce_in_buckets(grads, edp.get_group(), divide=par.plan["dp"])
        else:
            for g in grads:
                g.div_(par.plan["dp"])


def tp_partial_params(part: nn.Module, plan: dict) -> list:
    """``(module, name)`` of the parameters of this part's tensor-parallel blocks whose gradient on one TP rank
    covers only that rank's share of the work, so that their sum over the TP group is the gradient: the plain
    parameters (not DTensors after `apply_tp`) inside the modules split by heads (``sp_gather``: Qwen3's, OLMo2's
    and Gemma 3's per-head q/k norms run on this rank's heads) and, under sequence parallelism, the plain
    parameters anywhere else in the block (a mixture-of-experts feed-forward's router and experts run on this
    rank's slice of the sequence). The norms sequence parallelism runs on the slice are DTensors, which torch's
    ``SequenceParallel`` reduces itself. Megatron-LM sums such gradients once per step (``finalize_model_grads``):
    `reduce_tp_partial_grads`. Taken after `apply_tp` and `apply_ep`, before data parallelism swaps parameters."""
    if plan["tp"] == 1:
        return []
    out = []
    for name, block in zip(part._autopar_block_names, block_list(part, plan)):
        if name not in plan["tp_blocks"]:
            continue
        gather = block_tp_layout(block, plan)[1]
        for rel, module in block.named_modules():
            by_heads = any(rel == g or rel.startswith(g + ".") for g in gather)
            if not (by_heads or plan["sp"]):
                continue  # (without SP the rest of the block sees the whole sequence on every TP rank)
            out += [(module, n) for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
    return out


def reduce_tp_partial_grads(par: Parallel) -> None:
    """Sum the gradients of `tp_partial_params` over the TP group, once per step after the whole backward and the
    data-parallel reduction (a sum commutes with it), in buckets; a ZeRO shard sums with the same shard of the
    other TP ranks. Then the DTensor gradients DTensor left Partial (sequence parallelism's norms: each TP rank's
    sum over its slice of the sequence), likewise in buckets (`reduce_partial_dtensor_grads`)."""
    group = par.mesh["tp"].get_group()
    for part in par.parts:
        grads = [_local_grad(getattr(module, n)) for module, n in getattr(part, "_autopar_tp_partial", ())]
        allreduce_in_buckets([g for g in grads if g is not None], group)
    reduce_partial_dtensor_grads(par)


def reduce_partial_dtensor_grads(par: Parallel) -> None:
    """Make every Partial (sum) placement of a DTensor gradient Replicate: the local tensors of the gradients that
    share a mesh and placements summed over each Partial mesh dimension's group in buckets (`allreduce_in_buckets`),
    one all-reduce per bucket as the cost model prices them (`costmodel.overlap.tp_partial_grads`), where
    ``redistribute`` makes one per tensor (on gloo, 8 calls a step for 4 blocks' norms: ~15 ms on cpu-local). The
    same sums as ``redistribute``'s; other reductions (avg, max, a norm's) are left to it (`clip_grad_norm`
    redistributes what is still Partial)."""
    by_layout: dict = {}
    for part in par.parts:
        for p in part.parameters():
            g = p.grad
            if (isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements)
                    and all(type(pl) is Partial and pl.reduce_op == "sum" for pl in g.placements if pl.is_partial())):
                by_layout.setdefault((g.device_mesh, tuple(g.placements)), {})[id(p)] = p
    for (mesh, placements), params in by_layout.items():
        params = list(params.values())
        local = [p.grad.to_local() for p in params]
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                allreduce_in_buckets(local, mesh.get_group(dim))
        done = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
        for p, g in zip(params, local):
            p.grad = DTensor.from_local(g, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride())


def build_tied_groups(plan: dict, mesh: DeviceMesh) -> list:
    """Megatron-LM's embedding groups: for each tied weight held on several pipeline ranks (``plan["tied"]``), one
    process group over those ranks per (dp, tp) coordinate. ``dist.new_group`` is collective, so every rank creates
    every group in the same order; each rank keeps its own (None where it holds no copy or needs no group)."""
    ranks = mesh.mesh.reshape(plan["pp"], plan["dp"], plan["tp"])  # global ranks (with ep: dp = edp · ep)
    mine = []
    for tie in plan["tied"]:
        own = None
        if len(tie["pp_ranks"]) > 1:
            for d in range(plan["dp"]):
                for t in range(plan["tp"]):
                    members = [int(ranks[r, d, t]) for r in tie["pp_ranks"]]
                    group = dist.new_group(members)
                    if dist.get_rank() in members:
                        own = group
        mine.append(own)
    return mine


def _local_parameter(part: nn.Module, name: str):
    """``part``'s parameter under its original name, or None where the module holding it was split off."""
    module = part
    *path, leaf = name.split(".")
    for attr in path:
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module._parameters.get(leaf)


def sync_tied_grads(par: Parallel) -> None:
    """Keep the copies of a tied weight equal (Megatron-LM's embedding all-reduce): sum their gradients over this
    rank's parts, then over the embedding group; after data-parallel reduction, before the optimizer step.

    Both copies are sharded alike: tensor parallelism leaves the embedding and the head replicated, and FSDP2 gives
    both the same dp shard (same shape, same dp rank), so summing the local gradient shards is exact.
    """
    for tie, group in zip(par.plan["tied"], par.tied_groups):
        copies = tied_copies(par, tie)
        if not copies:
            continue  # a middle pipeline rank: no copy here
        grads = []
        for p in copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if group is not None:
            dist.all_reduce(total, group=group)
        for grad in grads:
            if grad is not total:
                grad.copy_(total)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits[:, t]`` against ``labels[:, t]`` (no further shift; label −100 is
    ignored), as the zoo models compute it."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, tp_mesh: DeviceMesh, vocab: int) -> torch.Tensor:
    """`lm_loss` when ``logits`` is this rank's slice of a ``vocab``-wide vocabulary (`apply_vocab_parallel`): torch's
    ``loss_parallel`` cross-entropy over the slices, whose backward must run inside that context too (`loss_context`,
    which `planner.emit.train.train_step_loss` holds for the whole step). The loss is returned as a tensor of its
    own, not the view ``to_local`` gives: torch 2.13's zero-bubble schedule detaches the last stage's loss in place
    after its input pass (``stage_backward_input``), which a view refuses."""
    shape = (*logits.shape[:-1], vocab)
    stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    logits = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape,
                                stride=stride)
    return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1)).to_local().clone()


def loss_function(plan: dict, mesh: DeviceMesh):
    """``(logits, labels) → loss`` for this plan: on vocabulary slices when the head is split."""
    if plan["tp"] > 1 and plan["vocab_head"]:
        return partial(vocab_parallel_loss, tp_mesh=mesh["tp"], vocab=plan["vocab"])
    return lm_loss


def loss_context(plan: dict):
    """The context a training step's forward and backward run in: torch's ``loss_parallel`` when the loss works on
    vocabulary slices."""
    if plan["tp"] > 1 and plan["vocab_head"]:
        return loss_parallel()
    return contextlib.nullcontext()


def build_pipeline(par: Parallel) -> None:
    """One PipelineStage per local part, and the plan's schedule over them with ``grad_accum`` micro-batches."""
    plan = par.plan
    n_stages = plan["pp"] * plan["vpp"]
    group = par.mesh["pp"].get_group()
    par.stages = [
        PipelineStage(module, index, n_stages, par.device, group=group)
        for index, module in zip(par.stage_indices, par.modules)
    ]
    schedule_cls = SCHEDULES[plan["schedule"]]
    if schedule_cls in (ScheduleGPipe, Schedule1F1B):
        par.schedule = schedule_cls(par.stages[0], plan["grad_accum"], loss_fn=par.loss_fn)
    else:
        with _stages_stay_unsharded(len(par.stages)):
            par.schedule = schedule_cls(par.stages, plan["grad_accum"], loss_fn=par.loss_fn)


@contextlib.contextmanager
def _stages_stay_unsharded(local_stages: int):
    """Build a multi-stage schedule whose FSDP stages, once gathered, stay gathered through the step, as the cost
    model prices pipelined FSDP (`costmodel.runnable.pipelined_fsdp`: one all-gather per stage under ZeRO 2).

    torch 2.13 lowers the interleaved and zero-bubble schedules with ``_add_unshard_reshard`` (pipelining/
    schedules.py), which keeps at most ``max_active_stages`` = 3 of a rank's stages unsharded and reshards the one
    it evicts, to gather it again at its next compute: with more than 3 local stages a ZeRO-2 step gathered rank 0's
    parameters 2.8 times (pp = 2, vpp = 4, m = 8; `autopar check`: all_gather@dp 64 % over the cost model's), and
    the 70B plan with vpp = 5, 4.7 times. With a window as wide as the rank's stages, each is gathered at its first
    compute and resharded at the end, as with 3 or fewer. The schedule is built at the top level of this call
    (its ``__init__`` lowers), so the wider window holds for that construction only."""
    from torch.distributed.pipelining import schedules as torch_schedules

    lower = torch_schedules._add_unshard_reshard
    torch_schedules._add_unshard_reshard = partial(lower, max_active_stages=max(3, local_stages))
    try:
        yield
    finally:
        torch_schedules._add_unshard_reshard = lower
