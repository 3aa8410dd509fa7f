"""The training step of a parallelised model: optimizer (ZeRO-1 through ZeroRedundancyOptimizer), gradient
accumulation over micro-batches (or the pipeline schedule), data-parallel and tied-weight gradient sync, synthetic
data, and what the loop reports. Like `planner.emit.runtime` it imports only torch and the standard library (and
`planner.emit.runtime` and `costmodel.runnable`, whose sources the emitter inlines alongside this one).
"""

import contextlib
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.runnable import post_step_allreduce
from planner.emit.runtime import DTYPES, Parallel, loss_context, sync_tied_grads


def autocast(plan: dict, device: torch.device):
    """Mixed precision for DDP/pipeline runs on GPUs (FSDP casts through its policy; CPU runs stay fp32)."""
    if device.type != "cuda" or plan["precision"] == "fp32" or (plan["dp"] > 1 and plan["zero"] >= 2):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=DTYPES[plan["precision"]])


def build_optimizer(par: Parallel, plan: dict) -> torch.optim.Optimizer:
    """SGD or AdamW; under ZeRO-1 wrapped in `ZeroRedundancyOptimizer`, which keeps each dp rank's share of the
    optimizer state and broadcasts the updated parameters after its step."""
    params = [p for module in par.modules for p in module.parameters()]
    cls = torch.optim.SGD if plan["optimizer"] == "sgd" else torch.optim.AdamW
    if plan["dp"] > 1 and plan["zero"] == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=par.mesh["dp"].get_group(),
                                       lr=plan["lr"])
    return cls(params, lr=plan["lr"])


def train_step(par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """One optimizer step on the global batch (the same on every rank; each dp rank takes its rows).

    Returns the global mean loss, identical on every rank, as a Python float (`train_step_loss` has it as a tensor).
    """
    return train_step_loss(par, optimizer, inputs, labels).item()


def train_step_loss(par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    """`train_step` up to its loss, a 0-dim tensor on the device (no host synchronisation: `autopar check` runs this
    on fake tensors)."""
    plan, device = par.plan, par.device
    dp_rank = par.mesh["dp"].get_local_rank()
    rows = plan["global_batch"] // plan["dp"]
    x = inputs[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    y = labels[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    optimizer.zero_grad(set_to_none=True)
    with autocast(plan, device), loss_context(plan):
        if plan["pp"] > 1:
            n_stages = plan["pp"] * plan["vpp"]
            args = (x,) if 0 in par.stage_indices else ()
            losses: list = []
            kwargs = {"target": y, "losses": losses} if n_stages - 1 in par.stage_indices else {}
            # return_outputs=False: the last stage would otherwise keep every micro-batch's output (the logits)
            par.schedule.step(*args, **kwargs, return_outputs=False)
            local = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=device)
        else:
            local = torch.zeros((), device=device)
            module, n = par.modules[0], plan["grad_accum"]
            for k, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                last = k == n - 1
                loss = _accumulate(module, par.loss_fn, xm, ym, n, last, keep_gathered=plan["zero"] == 2)
                local += loss.detach().float()
    if post_step_allreduce(plan["dp"], plan["tp"], plan["zero"], plan["schedule"], plan["pp"]):
        for part in par.parts:
            allreduce_grads(part, plan["dp"])
    if plan["pp"] > 1 and plan["tied"]:
        sync_tied_grads(par)
    optimizer.step()
    total = local.reshape(1).clone()
    if plan["pp"] > 1:
        dist.all_reduce(total, group=par.mesh["pp"].get_group())  # only the last stage holds the loss
    if plan["dp"] > 1:
        dist.all_reduce(total, group=par.mesh["dp"].get_group())
    return total[0] / plan["dp"]


GRAD_BUCKET_BYTES = 25 * 2**20  #: DDP's default bucket cap, used for the post-step all-reduce too


def allreduce_grads(part: nn.Module, dp: int) -> None:
    """Average the gradients over the data-parallel group after the backward, where DDP cannot (tensor-parallel
    DTensor parameters; the zero-bubble schedule's hand-written weight gradients). Like DDP, gradients are packed
    into flat buckets of at most `GRAD_BUCKET_BYTES` (one all-reduce each, not one per tensor), in reverse
    parameter order, as their gradients become ready."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in reversed(list(part.parameters())) if p.grad is not None]
    bucket: list = []
    size = 0
    for k, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        last = k == len(grads) - 1
        if size >= GRAD_BUCKET_BYTES or last or grads[k + 1].dtype != grad.dtype:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=part._autopar_grad_group)
            flat.div_(dp)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0


def _accumulate(module: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, n: int, last: bool,
                keep_gathered: bool = False) -> torch.Tensor:
    """Forward and backward of one micro-batch. DDP syncs gradients on the last one only; FSDP2 reduce-scatters
    every micro-batch, so that gradients stay sharded through accumulation (as the cost model assumes). With
    ``keep_gathered`` (ZeRO-2) FSDP2 keeps the parameters gathered after every backward but the last, so they are
    all-gathered once per step, not once per micro-batch (the cost model's ZeRO-2: replicated parameters)."""
    if keep_gathered and isinstance(module, FSDPModule):
        module.set_reshard_after_backward(last)
    ctx = module.no_sync() if isinstance(module, DDP) and not last else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(module(x), y)
        (loss / n).backward()
    return loss / n


def synthetic_batch(step: int, *, batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable synthetic tokens: each row counts from a random start with a random stride 1-3, modulo vocab;
    labels are the next tokens."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def full_parameters(par: Parallel) -> dict:
    """This rank's parameters as full tensors under their names in the original model (a collective: call it on
    every rank)."""
    out = {}
    canonical = {alias: tie["names"][0] for tie in par.plan["tied"] for alias in tie["names"]}
    for part in par.parts:
        names = part._autopar_block_names
        container = par.plan["block_container"]
        for name, p in part.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            if name.startswith(container + "."):
                index, _, rest = name[len(container) + 1 :].partition(".")
                name = f"{names[int(index)]}.{rest}"
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical.get(name, name)] = value.detach().cpu().clone()
    return out
