"""The training step of a parallelised model: optimizer (AdamW with decoupled weight decay on matrices only; ZeRO-1
through ZeroRedundancyOptimizer), learning-rate warm-up and cosine decay, gradient accumulation over micro-batches
(or the pipeline schedule), data-parallel and tied-weight gradient sync, clipping by the global gradient norm,
synthetic data, and what the loop reports. Like `planner.emit.runtime` it imports only torch and the standard
library (and `planner.emit.runtime` and `costmodel.runnable`, whose sources the emitter inlines alongside this one).
"""

import contextlib
import functools
import math
import os
import resource

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.runnable import post_step_allreduce, trains_under_autocast
from planner.emit.runtime import (
    DTYPES,
    Parallel,
    allreduce_in_buckets,
    batch_mesh,
    context_shard,
    data_parallel_mesh,
    expert_param_ids,
    is_expert_parameter,
    loss_context,
    reduce_expert_grads,
    reduce_tp_partial_grads,
    sync_tied_grads,
    tied_copies,
)


def autocast(plan: dict, device: torch.device):
    """Mixed precision for DDP/pipeline runs on GPUs (FSDP casts through its policy; CPU runs stay fp32)."""
    if device.type != "cuda" or not trains_under_autocast(plan["precision"], plan["zero"], plan["dp"] * plan["cp"]):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=DTYPES[plan["precision"]])


def build_optimizer(par: Parallel, plan: dict) -> torch.optim.Optimizer:
    """SGD or AdamW. Weight decay (``plan["weight_decay"]``, decoupled in AdamW) applies to matrices only:
    embeddings and linear weights, not norms' scales or biases (GPT-3, Llama). Under ZeRO-1 wrapped in
    `ZeroRedundancyOptimizer`, which keeps each dp rank's share of the optimizer state and broadcasts the updated
    parameters after its step (dp × cp ranks with context parallelism: `planner.emit.runtime.data_parallel_mesh`)."""
    seen = {id(p): p for module in par.modules for p in module.parameters()}
    # one group per (decay, device mesh): torch's foreach and fused steps run a group's tensors in one call, which
    # DTensor refuses when the list mixes plain tensors and DTensors or DTensors of different meshes (a layer left
    # replicated beside tensor-parallel ones, 1-D and 2-D FSDP×TP parameters: torch/distributed/tensor/_dispatch.py)
    by_key: dict = {}
    for p in seen.values():
        key = (p.ndim >= 2, getattr(p, "device_mesh", None))
        by_key.setdefault(key, []).append(p)
    groups = [{"params": ps, "weight_decay": plan["weight_decay"] if matrix else 0.0}
              for (matrix, _), ps in sorted(by_key.items(), key=lambda kv: not kv[0][0])]
    cls = torch.optim.SGD if plan["optimizer"] == "sgd" else torch.optim.AdamW
    # AdamW runs fused: one pass over weight, gradient and moments per parameter group, the memory traffic the cost
    # model prices (`costmodel.overlap.optimizer_time`). torch's default is not fused: per tensor on CPU, foreach on
    # CUDA, each ~8 passes (decay, lerp, mul, addcmul, sqrt, div, add, addcdiv: `torch.optim.adam`). One CPU thread,
    # 3.5 M fp32 parameters in 39 tensors: per tensor 20.8 ms, foreach 13.0 ms, fused 4.4 ms (24 bytes per parameter
    # at the measured copy bandwidth; the cost model's 28)
    kw = {"lr": plan["lr"]} if cls is torch.optim.SGD else {"lr": plan["lr"], "fused": True}
    if plan["zero"] == 1 and plan["dp"] * plan["cp"] > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = data_parallel_mesh(plan, par.mesh).get_group()
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **kw)
    return cls(groups, **kw)


def lr_factor(step: int, plan: dict, total_steps: int | None) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``plan["lr"]``: linear warm-up over
    ``plan["warmup_steps"]`` steps (the first at 1/warmup), then cosine decay to ``plan["min_lr_ratio"]`` at
    ``total_steps`` (constant after the warm-up when ``total_steps`` is None)."""
    warmup = plan["warmup_steps"]
    if step < warmup:
        return (step + 1) / warmup
    if total_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = plan["min_lr_ratio"]
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_schedule(optimizer: torch.optim.Optimizer, plan: dict, total_steps: int | None):
    """`lr_factor` as torch's LambdaLR: call its ``step()`` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, plan, total_steps))


def clip_grad_norm(par: Parallel, max_norm: float) -> torch.Tensor:
    """The global L2 norm of this step's gradients over the whole model, and (``max_norm`` > 0) every gradient
    scaled by ``min(1, max_norm / norm)``, as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    Each rank sums the squares of its local gradients (a DTensor's local shard), weighting each by how many ranks
    of its pipeline stage hold the same values: the stage's dp·cp·tp ranks over the product of the mesh sizes the
    tensor is sharded along (a replica counts once, a shard once; an expert shard is also split over ep); a tied
    weight counts on its first stage only. One all-reduce over every rank adds the stages. Call after the
    data-parallel and tied-weight reductions.

    One pass reads each gradient for its norm (``torch.linalg.vector_norm`` in fp32, nothing written) and one scales
    it in place: 12 bytes per fp32 element, as ``torch.nn.utils.clip_grad_norm_`` moves, the figure the cost model
    prices (`costmodel.overlap.clip_time`). Like torch's, on a CPU the norm of a whole tensor accumulates in fp32
    (a relative error ~1e-5 at 1 M elements, ~1e-3 at 10 M, against ~1e-8 for ``pow(2).sum()``); GPUs reduce in a
    tree."""
    plan = par.plan
    stage_ranks = plan["dp"] * plan["cp"] * plan["tp"]
    counted = {id(p) for tie in plan["tied"] for p in tied_copies(par, tie)[:1]} if 0 in par.stage_indices else set()
    tied = {id(p) for tie in plan["tied"] for p in tied_copies(par, tie)} - counted
    norms: dict[float, list] = {}  # by weight: a few kinds of tensor (replicated, sharded, expert)
    grads = {}
    for part in par.parts:
        for p in part.parameters():
            if p.grad is None or id(p) in grads:
                continue
            grad = p.grad
            shards = 1
            if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
                # sequence parallelism leaves the norms' gradients Partial (each tp rank has its sequence slice's
                # sum): reduced here, as the optimizer's DTensor ops would otherwise do when they read them
                grad = p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl
                                                                     for pl in grad.placements])
            if isinstance(grad, DTensor):
                # every placement left but Replicate splits the tensor (Shard, and FSDP's _StridedShard over TP,
                # which torch 2.13 does not count as is_shard())
                shards = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements)
                                   if not pl.is_replicate())
                grad = grad.to_local()
            if plan["ep"] > 1 and is_expert_parameter(part, p):  # also split over ep (plain local tensors)
                shards *= plan["ep"]
            grads[id(p)] = grad
            if id(p) not in tied:
                norms.setdefault(shards / stage_ranks, []).append(torch.linalg.vector_norm(grad, dtype=torch.float32))
    total = torch.zeros((), device=par.device, dtype=torch.float32)
    for weight, ns in norms.items():
        total += torch.stack(ns).square().sum() * weight
    dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads.values():
            grad.mul_(scale.to(grad.dtype))
    return norm


def train_step(par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor | None,
               labels: torch.Tensor | None) -> float:
    """One optimizer step on the global batch (the same on every rank; each dp rank takes its rows), or on this
    rank's rows of it (`data_rows`); None on the ranks that read no batch (`feeds_data`: middle pipeline stages).
    With context parallelism each rank then keeps its part of every sequence (`context_tokens`).

    Returns the global mean loss, identical on every rank, as a Python float (`train_step_loss` has it as a tensor).
    """
    return train_step_loss(par, optimizer, inputs, labels).item()


def zeroes_grads_in_place(par: Parallel) -> bool:
    """Whether a step zeroes the gradients in place, so that every gradient (not only DDP's) outlives the step, rather
    than freeing them. DDP's gradients are views into its reduction buckets (gradient_as_bucket_view): zeroed in
    place they stay views; set to None, the next no_sync micro-batches would build a second copy of every gradient
    beside the buckets."""
    return any(isinstance(m, DDP) for m in par.modules)


def train_step_loss(par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor | None,
                    labels: torch.Tensor | None) -> torch.Tensor:
    """`train_step` up to its loss, a 0-dim tensor on the device (no host synchronisation: `autopar check` runs this
    on fake tensors)."""
    plan, device = par.plan, par.device
    if inputs is None or labels is None:  # a middle pipeline stage reads no batch (`feeds_data`)
        if feeds_data(par):
            raise ValueError("no batch given: this rank holds the first or the last pipeline stage, which reads it")
        x = y = None
    else:
        if inputs.shape[0] == plan["global_batch"]:  # the global batch: this rank's rows of it
            inputs, labels = inputs[data_rows(par)], labels[data_rows(par)]
        elif inputs.shape[0] != plan["global_batch"] // plan["dp"]:
            raise ValueError(f"a batch of {inputs.shape[0]} rows: pass the global batch ({plan['global_batch']} "
                             f"rows) or this data-parallel rank's rows of it ({plan['global_batch'] // plan['dp']})")
        if plan["cp"] > 1:  # this rank's two chunks of every sequence (the positions `apply_cp` gave the model)
            inputs, labels = context_tokens(par, inputs), context_tokens(par, labels)
        x, y = inputs.to(device), labels.to(device)
    optimizer.zero_grad(set_to_none=not zeroes_grads_in_place(par))
    with loss_context(plan):
        if plan["pp"] > 1:
            n_stages = plan["pp"] * plan["vpp"]
            args = (x,) if 0 in par.stage_indices else ()
            losses: list = []
            kwargs = {"target": y, "losses": losses} if n_stages - 1 in par.stage_indices else {}
            # return_outputs=False: the last stage would otherwise keep every micro-batch's output (the logits).
            # One autocast region over torch's schedule, which runs the micro-batches: one cached 16-bit copy of
            # each weight for all of them (a region per forward would keep a copy per micro-batch in flight)
            with _first_backward_synced(par.stages, plan["grad_accum"]), autocast(plan, device):
                par.schedule.step(*args, **kwargs, return_outputs=False)
            local = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=device)
        else:
            local = torch.zeros((), device=device)
            module, n = par.modules[0], plan["grad_accum"]
            # DDP makes a gradient a view of its bucket in a synchronised backward only, so a step that starts
            # without gradients (the first) synchronises its first micro-batch too: the later ones then accumulate
            # into the buckets. Exact (the average over the group of an average is itself; a compressed reduction
            # rounds that micro-batch's share once more), and once per launch.
            attach = isinstance(module, DDP) and n > 1 and any(p.grad is None for p in module.parameters())
            for k, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                sync = k == n - 1 or (attach and k == 0)
                # an autocast region per micro-batch: a region keeps a weight's 16-bit copy to its end, and the
                # backward of a later micro-batch reaching a copy an earlier one made would run the copy's
                # cast-back last (autograd goes by the order nodes were made), holding every 16-bit weight
                # gradient to its end (`costmodel.estimate.Evaluator.autocast_held_bytes`)
                with autocast(plan, device):
                    loss = _accumulate(module, par.loss_fn, xm, ym, n, sync, keep_gathered=plan["zero"] == 2)
                local += loss.detach().float()
    if post_step_allreduce(plan["dp"] * plan["cp"], plan["tp"], plan["zero"], plan["schedule"], plan["pp"]):
        for part in par.parts:
            allreduce_grads(part, plan["dp"] * plan["cp"])
    if plan["ep"] > 1 and plan["zero"] == 0:  # the experts' gradients, which DDP left alone
        reduce_expert_grads(par)
    if plan["tp"] > 1:  # the gradients each TP rank computed from its heads or its slice of the sequence only
        reduce_tp_partial_grads(par)
    if plan["pp"] > 1 and plan["tied"]:
        sync_tied_grads(par)
    par.grad_norm = clip_grad_norm(par, plan["clip_norm"])
    optimizer.step()
    total = local.reshape(1).clone()
    if plan["pp"] > 1:
        dist.all_reduce(total, group=par.mesh["pp"].get_group())  # only the last stage holds the loss
    # each rank's loss is the mean over its tokens, and every data-parallel (and context-parallel) rank holds as
    # many: their mean is the global batch's mean
    if plan["dp"] * plan["cp"] > 1:
        dist.all_reduce(total, group=data_parallel_mesh(plan, par.mesh).get_group())
    return total[0] / (plan["dp"] * plan["cp"])


def context_tokens(par: Parallel, x: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's tokens of every row of ``x`` [rows, seq] (`planner.emit.runtime.context_shard`:
    chunks r and 2·cp − 1 − r), for a batch of whole sequences of the planned length: the model's positions
    (`planner.emit.runtime.apply_cp`) are those of these tokens."""
    plan = par.plan
    if x.shape[1] != plan["seq"]:
        raise ValueError(f"a batch of sequences of {x.shape[1]} tokens: with cp={plan['cp']} pass whole sequences of "
                         f"the planned {plan['seq']} tokens (each context-parallel rank keeps its part of them)")
    return context_shard(x, plan["cp"], par.mesh["cp"].get_local_rank())


def allreduce_grads(part: nn.Module, dp: int) -> None:
    """Average the gradients over the data-parallel group (``dp`` ranks: dp · cp with context parallelism,
    `planner.emit.runtime.data_parallel_mesh`) after the backward, where DDP cannot (tensor-parallel
    DTensor parameters; the zero-bubble schedule's hand-written weight gradients), in DDP's reverse parameter
    order and buckets (`allreduce_in_buckets`). Expert parameters (ep > 1) are left to `reduce_expert_grads`, over
    the ranks holding the same experts."""
    experts = expert_param_ids(part)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in reversed(list(part.parameters())) if p.grad is not None and id(p) not in experts]
    allreduce_in_buckets(grads, part._autopar_grad_group, divide=dp)


@contextlib.contextmanager
def _first_backward_synced(stages: list, micro_batches: int):
    """The pipeline's version of the first step's extra synchronisation (`train_step_loss`): torch 2.13's
    ``PipelineStage.backward_maybe_with_nosync`` synchronises a DDP stage's last micro-batch only, so a stage whose
    step starts without gradients has its first backward synchronised too (it then holds them as bucket views)."""
    patched = [s for s in stages if isinstance(s.submod, DDP) and micro_batches > 1
               and any(p.grad is None for p in s.submod.parameters())]
    for stage in patched:
        original = stage.backward_maybe_with_nosync

        def first(*args, original=original, stage=stage, **kwargs):
            del stage.backward_maybe_with_nosync  # the class's method from now on
            return original(*args, **{**kwargs, "last_backward": True})

        stage.backward_maybe_with_nosync = first
    try:
        yield
    finally:
        for stage in patched:
            stage.__dict__.pop("backward_maybe_with_nosync", None)


def _accumulate(module: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, n: int, last: bool,
                keep_gathered: bool = False) -> torch.Tensor:
    """Forward and backward of one micro-batch. DDP syncs gradients when ``last`` (the last micro-batch; see
    `train_step_loss` for the first step's first one); FSDP2 reduce-scatters every micro-batch, so that gradients
    stay sharded through accumulation (as the cost model assumes). With ``keep_gathered`` (ZeRO-2) FSDP2 keeps the
    parameters gathered after every backward but the last, so they are all-gathered once per step, not once per
    micro-batch (the cost model's ZeRO-2: replicated parameters)."""
    if keep_gathered and isinstance(module, FSDPModule):
        module.set_reshard_after_backward(last)
    ctx = module.no_sync() if isinstance(module, DDP) and not last else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(module(x), y)
        (loss / n).backward()
    return loss / n


def synthetic_batch(step: int, *, batch: int, seq: int, vocab: int, seed: int,
                    rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of step ``step``'s global batch of learnable synthetic tokens: each row counts from a random
    start with a random stride 1-3, modulo vocab; labels are the next tokens. Only these rows' tokens are built
    (the draws are two numbers per row of the global batch), and they are the same whichever rows are asked for."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)[rows]
    stride = torch.randint(1, 4, (batch, 1), generator=g)[rows]
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def feeds_data(par: Parallel) -> bool:
    """Whether this rank reads batches: with pipelining only the ranks holding the first stage (the inputs) or the
    last (the labels); a middle stage gets its activations from its neighbours."""
    if par.plan["pp"] == 1:
        return True
    return 0 in par.stage_indices or par.plan["pp"] * par.plan["vpp"] - 1 in par.stage_indices


def step_report(par: Parallel, step: int, loss: float, lr: float, seconds: float) -> str:
    """The line the loop prints on rank 0 after each step: loss, global gradient norm (before clipping), learning
    rate, throughput, MFU on the plan's devices (from the prediction's FLOPs per token), time and peak memory."""
    plan = par.plan
    tokens_per_s = plan["global_batch"] * plan["seq"] / seconds
    norm = par.grad_norm.item() if par.grad_norm is not None else float("nan")
    mfu = f" MFU {plan['mfu_per_token_rate'] * tokens_per_s:.1%}" if plan.get("mfu_per_token_rate") else ""
    peak = peak_memory_bytes(par.device) / 2**20
    return (f"step {step} loss {loss:.5f} grad norm {norm:.4g} lr {lr:.3g} {tokens_per_s:,.0f} tokens/s{mfu} "
            f"time {seconds * 1e3:.1f} ms peak memory {peak:.0f} MiB")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_name(part: nn.Module, name: str, plan: dict) -> str:
    """A parameter's name in the original model: activation-checkpoint wrappers dropped, and a pipeline stage's
    blocks (renumbered from 0 in each stage) under their original indices, so names are the same on every stage and
    in one process."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    container = plan["block_container"]
    if name.startswith(container + "."):
        index, _, rest = name[len(container) + 1 :].partition(".")
        name = f"{part._autopar_block_names[int(index)]}.{rest}"
    return name


def full_parameters(par: Parallel) -> dict:
    """This rank's parameters as full tensors under their names in the original model (a collective: call it on
    every rank)."""
    out = {}
    plan = par.plan
    canonical = {alias: tie["names"][0] for tie in plan["tied"] for alias in tie["names"]}
    for part in par.parts:
        for name, p in part.named_parameters():
            name = model_name(part, name, plan)
            value = p.full_tensor() if isinstance(p, DTensor) else p
            if plan["ep"] > 1 and is_expert_parameter(part, p):  # every ep rank's experts, in order
                value = funcol.all_gather_tensor(value.detach().contiguous(), 0, par.mesh["ep"].get_group())
            out[canonical.get(name, name)] = value.detach().cpu().clone()
    return out


def expert_checkpoint_view(par: Parallel, value: torch.Tensor) -> DTensor:
    """An expert parameter (or its optimizer state) of this rank, ``value`` [E/ep, …] or its FSDP shard over edp,
    as a DTensor of the whole [E, …] tensor, for `torch.distributed.checkpoint`: its key and global shape are then
    those of a plan without expert parallelism, so a checkpoint reshards across ep (and loads into one process),
    and each rank writes its own experts (as a plain tensor DCP would take it for a replica and keep one rank's).
    The view shares storage with ``value``: loading fills it in place. Without FSDP the experts are split over ep:
    Shard(0) on the ep group; with FSDP the ep split comes first and edp shards each rank's experts (right-to-left,
    as FSDP over tensor parallelism: torch's ``_StridedShard`` on edp, Shard(0) on ep; where FSDP shards dim 1,
    Shard(1) on edp)."""
    plan, mesh = par.plan, par.mesh
    if isinstance(value, DTensor):  # FSDP2's shard over edp of this rank's E/ep experts (dim 0, or dim 1)
        rows, local = value.shape, value.to_local().detach()
        dim = value.placements[0].dim
        edp = _StridedShard(0, split_factor=plan["ep"]) if dim == 0 else Shard(dim)
        target, placements = mesh["edp", "ep"], [edp, Shard(0)]
    else:
        rows, local = value.shape, value.detach()
        target, placements = mesh["ep"], [Shard(0)]
    shape = torch.Size([rows[0] * plan["ep"], *rows[1:]])
    return DTensor.from_local(local, target, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def checkpoint_state(par: Parallel, optimizer: torch.optim.Optimizer, lr_schedule=None, step: int = 0) -> dict:
    """What a checkpoint holds, as `torch.distributed.checkpoint` saves it (each rank its own shards; replicas
    once): ``model.NAME`` (the parameters under their original names, `model_name`), ``optim.NAME.KEY`` (this rank's
    optimizer state: AdamW's moments, sharded like their parameters; under ZeRO-1 each dp rank's own share),
    ``train`` (the steps done, which also fixes the data position, and the learning-rate schedule). Loading fills
    these tensors in place, so the same call serves save and load (AdamW's state is created first if empty)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's share
    state: dict = {"train": {"step": step, "lr_schedule": lr_schedule.state_dict() if lr_schedule else {}}}
    plan = par.plan
    names = {}  # a parameter → its first name (the optimizer state's key)
    for part in par.parts:
        for name, p in part.named_parameters():
            name = model_name(part, name, plan)
            names.setdefault(id(p), name)
            if plan["ep"] > 1 and is_expert_parameter(part, p):  # a view of the whole [E, …] tensor
                state[f"model.{name}"] = expert_checkpoint_view(par, p)
            else:
                state[f"model.{name}"] = p
    for group in local.param_groups:
        for p in group["params"]:
            if isinstance(local, torch.optim.AdamW) and not local.state[p]:  # as `Adam._init_group` makes it
                fused = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
                local.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for key, value in local.state[p].items():
                if plan["ep"] > 1 and value.shape == p.shape and any(is_expert_parameter(part, p)
                                                                     for part in par.parts):  # (not the step)
                    value = expert_checkpoint_view(par, value)
                state[f"optim.{names[id(p)]}.{key}"] = value
    return state


def save_checkpoint(directory: str, par: Parallel, optimizer: torch.optim.Optimizer, lr_schedule, step: int) -> str:
    """Save after ``step`` optimizer steps to ``directory/step-NNNNNNNN`` with `torch.distributed.checkpoint` (a
    collective: every rank writes its shards, nothing is gathered) and return that path."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(directory, f"step-{step:08d}")
    dcp.save(checkpoint_state(par, optimizer, lr_schedule, step), checkpoint_id=path)
    return path


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory`` (DCP writes its ``.metadata`` last), or None."""
    done = sorted(d for d in os.listdir(directory) if d.startswith("step-")
                  and os.path.exists(os.path.join(directory, d, ".metadata"))) if os.path.isdir(directory) else []
    return os.path.join(directory, done[-1]) if done else None


def load_checkpoint(path: str, par: Parallel, optimizer: torch.optim.Optimizer, lr_schedule=None) -> int:
    """Load a `save_checkpoint` directory into the parallel model, optimizer and schedule (a collective, resharding
    as torch.distributed.checkpoint does); returns the steps it had done."""
    import torch.distributed.checkpoint as dcp

    state = checkpoint_state(par, optimizer, lr_schedule)
    dcp.load(state, checkpoint_id=path)
    if lr_schedule is not None:
        lr_schedule.load_state_dict(state["train"]["lr_schedule"])
        for group, lr in zip(optimizer.param_groups, lr_schedule.get_last_lr()):
            group["lr"] = lr  # the schedule's state does not set it: the next step would run at the first step's
    return int(state["train"]["step"])


def data_rows(par: Parallel) -> slice:
    """The rows of the global batch this rank trains on: its data-parallel rank's share (the context-parallel ranks
    of one dp rank take the same rows, each its part of their sequences)."""
    rows = par.plan["global_batch"] // par.plan["dp"]
    first = batch_mesh(par.plan, par.mesh).get_local_rank() * rows
    return slice(first, first + rows)


@functools.lru_cache(maxsize=4)
def token_file(path: str, dtype: str = "uint16") -> torch.Tensor:
    """A token file as a 1-D tensor over its memory map (nothing read until indexed): a NumPy ``.npy`` file of one
    dimension (its header gives the type), or raw values of ``dtype`` (nanoGPT's ``.bin``: uint16)."""
    import ast
    import mmap
    import warnings

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    offset = 0
    if path.endswith(".npy"):  # NumPy's format: magic, version, header length, then the header as a dict literal
        if buf[:6] != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        width = 2 if buf[6] == 1 else 4
        size = int.from_bytes(buf[8 : 8 + width], "little")
        header = ast.literal_eval(buf[8 + width : 8 + width + size].decode("latin1"))
        types = {"<u2": "uint16", "<u4": "uint32", "<i4": "int32", "<i8": "int64"}
        if header["descr"] not in types or header["fortran_order"] or len(header["shape"]) != 1:
            raise ValueError(f"{path}: expected a 1-D array of token ids (uint16/uint32/int32/int64), got "
                             f"{header['descr']} of shape {header['shape']}")
        dtype, offset = types[header["descr"]], 8 + width + size
    kind = getattr(torch, dtype)
    with warnings.catch_warnings():  # read-only map: the tensor is never written
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=kind, count=(len(buf) - offset) // kind.itemsize, offset=offset)


def token_file_batch(path: str, step: int, rows: slice, *, batch: int, seq: int,
                     dtype: str = "uint16") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of the global batch of ``step`` from a token file (`token_file`), only these rows read. Row i
    of step s is the (s·batch + i)-th window of seq + 1 tokens (consecutive windows share one token), wrapping
    around at the end of the file: a deterministic pass that a resumed run continues from its step."""
    tokens = token_file(path, dtype)
    windows = (len(tokens) - 1) // seq
    if windows < 1:
        raise ValueError(f"{path}: {len(tokens)} tokens, fewer than one sequence of {seq} + 1")
    first = rows.start or 0
    last = batch if rows.stop is None else rows.stop
    starts = [((step * batch + i) % windows) * seq for i in range(first, last)]
    window = torch.stack([tokens[s : s + seq + 1].to(torch.int64) for s in starts])
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()
