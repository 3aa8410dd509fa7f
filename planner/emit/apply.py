"""`auto_parallelize`: apply a plan to a model inside a torchrun process, with the functions emitted scripts use."""

from __future__ import annotations

import copy as _copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from costmodel.compression import POWERSGD_START_ITER
from planner.emit import runtime, train
from planner.emit.config import runtime_config
from planner.plan import Plan
from profiler.layers import meta_copy


@dataclass
class ParallelHandle:
    """A parallelised model: ``step(batch)`` trains one optimizer step; the parts are there for your own loop."""

    parallel: runtime.Parallel  #: everything `planner.emit.runtime.parallelize` built
    optimizer: torch.optim.Optimizer  #: over this rank's parameters
    plan: Plan  #: the plan applied
    lr_schedule: object = field(default=None)  #: torch LambdaLR: warm-up, then cosine decay (`train.lr_factor`)
    name_prefix: str = ""  #: what names in the trained module start with beyond the caller's model's
    steps_done: int = 0  #: optimizer steps taken (or loaded from a checkpoint)

    @property
    def module(self) -> nn.Module:
        """The (DDP/FSDP-wrapped) model; with pipeline parallelism, this rank's first stage module."""
        return self.parallel.modules[0]

    @property
    def stages(self) -> list:
        """This rank's PipelineStage objects (empty without pipeline parallelism)."""
        return self.parallel.stages

    @property
    def schedule(self):
        """The pipeline schedule (None without pipeline parallelism)."""
        return self.parallel.schedule

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the **global** batch ``(input_ids, labels)`` (the same on every rank, rows =
        ``plan.global_batch``); returns the global mean loss."""
        if self.parallel is None:
            raise RuntimeError("this handle was closed (handle.close() ends the process groups); build a new one")
        inputs, labels = batch
        if inputs.shape[0] != self.plan.global_batch:
            raise ValueError(f"batch has {inputs.shape[0]} rows but the plan's global batch is "
                             f"{self.plan.global_batch}; pass the whole global batch on every rank")
        loss = train.train_step(self.parallel, self.optimizer, inputs, labels)
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        self.steps_done += 1
        return loss

    def save(self, directory: str | Path) -> str:
        """Save a sharded checkpoint (model, optimizer, schedule, steps) under ``directory`` with
        torch.distributed.checkpoint, as emitted scripts do (`planner.emit.train.save_checkpoint`); a collective.
        Returns the checkpoint's path."""
        return train.save_checkpoint(str(directory), self.parallel, self.optimizer, self.lr_schedule,
                                     self.steps_done)

    def load(self, directory: str | Path) -> int:
        """Load the latest checkpoint under ``directory`` (or ``directory`` itself when it is one) into the model,
        optimizer and schedule; a collective. Returns the steps it had done, which `step` continues from."""
        path = train.latest_checkpoint(str(directory)) or str(directory)
        if not Path(path, ".metadata").exists():
            raise ValueError(f"no checkpoint in {directory} (save one with handle.save(directory))")
        self.steps_done = train.load_checkpoint(path, self.parallel, self.optimizer, self.lr_schedule)
        return self.steps_done

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm, before clipping (NaN before the first step)."""
        norm = self.parallel.grad_norm
        return float("nan") if norm is None else norm.item()

    def close(self) -> None:
        """End training on every rank (a collective): drop the parallel model and optimizer and end the process
        groups (`planner.emit.runtime.shutdown`), so that none outlives the interpreter, where gloo's worker
        threads can abort the process at exit. Hold no other reference to the model's parts when calling it."""
        self.parallel = self.optimizer = self.lr_schedule = None
        runtime.shutdown()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, unsharded, under their names in the model passed in (collective: call on every
        rank)."""
        cut = len(self.name_prefix)
        return {name[cut:]: value for name, value in train.full_parameters(self.parallel).items()}


def _load_plan(plan: Plan | str | Path | None, model: nn.Module, example_inputs, cluster: str | None,
               plan_kwargs: dict | None) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    try:
        from planner.search.outer import plan_for_module  # noqa: F401 (here: a build without it fails at once)
    except ImportError:
        raise ValueError("automatic planning (planner.search.outer.plan_for_module) is not available in this build; "
                         "pass plan=Plan(...) or plan='plan.yaml' written by `autopar plan`") from None
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        # one rank plans and the others take its plan: ranks planning each for themselves could differ (a device
        # measured by each at once, an ILP stopped by its time limit) and then hang in mismatched collectives
        runtime.start_process_group()
        answer: list = [None]
        if dist.get_rank() == 0:
            try:
                answer[0] = ("plan", _plan_here(model, example_inputs, cluster, world, plan_kwargs))
            except Exception as exc:  # (every rank raises it, not only rank 0 while the others wait)
                answer[0] = ("error", type(exc).__name__, str(exc))
        dist.broadcast_object_list(answer, src=0)
        if answer[0][0] == "error":
            raise (ValueError if answer[0][1] == "ValueError" else RuntimeError)(
                f"planning on rank 0 failed: {answer[0][2]}")
        return answer[0][1]
    return _plan_here(model, example_inputs, cluster, world, plan_kwargs)


def _plan_here(model: nn.Module, example_inputs, cluster: str | None, world: int, plan_kwargs: dict | None) -> Plan:
    from planner.search.outer import plan_for_module

    if cluster is None:
        from costmodel.cluster import detect_cluster

        cluster = detect_cluster()
    return plan_for_module(model, example_inputs, cluster=cluster, world_size=world, **(plan_kwargs or {}))


def auto_parallelize(model: nn.Module, example_inputs, *, cluster: str | None = None,
                     plan: Plan | str | Path | None = None, plan_kwargs: dict | None = None, copy: bool = True,
                     optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0,
                     init: str | None = None, weight_decay: float | None = None, clip_norm: float = 1.0,
                     warmup_steps: int = 0, total_steps: int | None = None,
                     powersgd_start_iter: int = POWERSGD_START_ITER, compile: str | None = None) -> ParallelHandle:
    """Parallelise ``model`` by ``plan`` (a Plan, a plan file, or None to plan it for ``cluster`` now: rank 0 plans
    and broadcasts its plan, so every rank runs the same one) in a torchrun process, and return a handle that trains
    it. ``cluster`` None: the hardware this runs on (`costmodel.cluster.detect_cluster`: the GPU's preset, nodes and
    GPUs per node from torchrun's environment; ``cpu-local`` without a GPU).

    Applies exactly what an emitted script applies (`planner.emit.runtime.parallelize`). The caller's ``model`` is left
    untouched: it is deep-copied first. With ``copy=False`` the model itself is modified in place (wrapped, sharded,
    and with pipeline parallelism stripped of the blocks other stages own). Rank 0's weights are broadcast to every
    rank first, so all ranks start from the same model. The process group is started if needed (gloo on CPU, NCCL
    with CUDA), after checking the world size against the plan.

    ``init="meta"`` (chosen automatically for models above `planner.emit.config.meta_threshold`, or forced; ``"full"``
    forces the above): only the model's structure is used. A meta-device copy is sharded and each rank initialises
    its shards with the model's ``init_weights()`` (seeded by ``seed``), so the model's current weights are *not*
    kept; pass a model built under ``torch.device("meta")`` to never allocate it whole. Load a checkpoint after.

    Optimisation as in emitted scripts: ``weight_decay`` on matrices only (None: 0.1 for AdamW, 0 for SGD), the global
    gradient norm clipped to ``clip_norm`` (0: off), ``warmup_steps`` of linear warm-up then cosine decay to a tenth of
    ``lr`` at ``total_steps`` (None: constant after the warm-up). ``compile``: a ``torch.compile`` backend
    (``"inductor"``) to compile each block with, as the script's ``--compile`` (None: the plan's, `Plan.compile`;
    planned here, the search prices the blocks compiled).
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    wrapped = _is_hf_lm(model)
    if wrapped:  # as transformers returns it: the loss per autopar's batch contract, no key/value cache
        from profiler.zoo.hf import HFCausalLMLoss

        model = HFCausalLMLoss(model)
    # planned here with compile on: the search prices compiled blocks (`planner.search.outer.search`)
    kwargs = (plan_kwargs or {}) | ({"compiled": True} if compile and plan is None else {})
    the_plan = _load_plan(plan, model, example_inputs, cluster, kwargs)
    config = runtime_config(the_plan, model, seed=seed, optimizer=optimizer, lr=lr, init=init,
                            weight_decay=weight_decay, clip_norm=clip_norm, warmup_steps=warmup_steps,
                            powersgd_start_iter=powersgd_start_iter, compile=compile or the_plan.compile)
    mesh = runtime.init_distributed(config)
    if config["init"] == "meta":
        source = meta_copy(model) if copy or any(not t.is_meta for t in [*model.parameters(), *model.buffers()]) \
            else model
    else:
        source = (_copy.deepcopy(model) if copy else model).to(runtime.current_device())
        with torch.no_grad():
            for tensor in [*source.parameters(), *source.buffers()]:
                dist.broadcast(tensor.data, src=0)
    par = runtime.parallelize(lambda: source, config, mesh)
    optim = train.build_optimizer(par, config)
    return ParallelHandle(parallel=par, optimizer=optim, plan=the_plan,
                          lr_schedule=train.build_lr_schedule(optim, config, total_steps),
                          name_prefix="model." if wrapped else "")


def _is_hf_lm(model: nn.Module) -> bool:
    """A Hugging Face language model as transformers builds it (``from_config``/``from_pretrained``), not yet in
    the loss wrapper the planner captures and trains (`profiler.zoo.hf.HFCausalLMLoss`)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
