"""The training step of a parallelised model: optimizer (ZeRO-1 through ZeroRedundancyOptimizer), gradient
accumulation over micro-batches (or the pipeline schedule), data-parallel and tied-weight gradient sync, synthetic
data, and what the loop reports. Like `planner.emit.runtime` it imports only torch and the standard library (and
`planner.emit.runtime`, whose source the emitter inlines alongside this one).
"""

import contextlib
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.emit.runtime import DTYPES, Parallel, sync_tied_grads


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

    Returns the global mean loss, identical on every rank.
    """
    plan, device = par.plan, par.device
    dp_rank = par.mesh["dp"].get_local_rank()
    rows = plan["global_batch"] // plan["dp"]
    x = inputs[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    y = labels[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    optimizer.zero_grad(set_to_none=True)
    with autocast(plan, device):
        if plan["pp"] > 1:
            n_stages = plan["pp"] * plan["vpp"]
            args = (x,) if 0 in par.stage_indices else ()
            losses: list = []
            kwargs = {"target": y, "losses": losses} if n_stages - 1 in par.stage_indices else {}
            par.schedule.step(*args, **kwargs)
            local = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=device)
        else:
            local = torch.zeros((), device=device)
            module, n = par.modules[0], plan["grad_accum"]
            for k, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                last = k == n - 1
                loss = _accumulate(module, xm, ym, n, last)
                local += loss.detach().float()
    if plan["dp"] > 1 and plan["zero"] == 0 and plan["tp"] > 1:
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
    return total.item() / plan["dp"]


def allreduce_grads(part: nn.Module, dp: int) -> None:
    """Average the gradients over the data-parallel group (DDP's job, for tensor-parallel DTensor parameters)."""
    for p in part.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=part._autopar_grad_group)
            grad.div_(dp)


def _accumulate(module: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, last: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch. DDP syncs gradients on the last one only; FSDP2 reduce-scatters
    every micro-batch, so that gradients stay sharded through accumulation (as the cost model assumes)."""
    ctx = module.no_sync() if isinstance(module, DDP) and not last else contextlib.nullcontext()
    with ctx:
        loss = module(x, y)
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
