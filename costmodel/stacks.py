"""Software stacks: the efficiency a device reaches depends on the code running on it as much as on the device.

Most of the error between published tables is the stack (Megatron-LM of 2022, Composer's FSDP, torchtitan), not the
hardware. The efficiency constants therefore belong to a (device kind, stack) pair: ``costmodel/data/fitted.yaml``
holds each kind's constants fitted on every published row of that kind (``a100``, ``h100``), and under ``stacks:``
the constants of a stack fitted on that stack's own rows where it has any (`python -m costmodel.calibrate`). A stack
without rows of its own on a kind uses the kind's constants, and says so (`describe`).

A cluster preset takes a stack with the ``stack=NAME`` option (``dgx-h100:nodes=8:stack=megatron``; ``autopar
plan/estimate --stack NAME`` adds it), so a plan file that names its cluster names its stack too. The default is the
stack autopar emits, ``torch-native``.

What a stack changes here is the device's efficiency constants. What the emitted runtime does (its loss, the inputs
its linears save, its selective checkpointing) is autopar's own code whatever the stack, so that memory and the
check stay about the code that runs; the calibration passes the published stacks' own behaviour for their rows
(`costmodel.calibrate.Row`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STACK = "torch-native"
#: the fitted constants (written by `python -m costmodel.calibrate`; `costmodel.hardware` reads the kinds' own)
FITTED_FILE = Path(__file__).parent / "data" / "fitted.yaml"


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    rows: str  #: the published rows its constants are fitted on (`costmodel.calibrate`)
    #: the float8 recipe its float8 training runs (`costmodel.layercost.FLOAT8_RECIPES`), whose casts its published
    #: float8 rows are priced with, so that its fitted ``fp8_eff`` is the float8 GEMMs' own
    float8_recipe: str = "torchao"
    #: whether its code is autopar's runtime (FSDP2, DTensor, autocast over fp32 parameters, torch's loss): the
    #: other stacks differ from it as `runtime_options` lists
    autopar_runtime: bool = False
    #: whether it accumulates gradients inside its weight-gradient GEMMs (Megatron-LM's
    #: ``gradient_accumulation_fusion``, on unless ``--no-gradient-accumulation-fusion``)
    fused_grad_accumulation: bool = False
    #: whether its full checkpointing stops recomputing early (`costmodel.layercost.CostContext.
    #: checkpoint_early_stop`): torch's non-reentrant checkpoint since 2.1; not Megatron-LM's ``CheckpointFunction``
    #: (megatron/core/tensor_parallel/random.py, megatron/mpu/random.py in 2022), whose backward calls the
    #: checkpointed function whole (``outputs = ctx.run_function(*detached_inputs)``)
    checkpoint_early_stop: bool = True
    #: whether its loss is one fused cross-entropy kernel on the 16-bit logits (`costmodel.layercost.
    #: fused_loss_bytes`): llm-foundry's ``loss_fn: fused_crossentropy``, flash-attn's, its MPT's default
    fused_loss: bool = False
    #: cross entropies its trainer computes again on each micro-batch's logits, without gradient, for its training
    #: metrics (Composer's ``Trainer._eval_train_metrics``: two for MPT, `costmodel.layercost.fused_loss_bytes`)
    train_metrics: int = 0

    def runtime_options(self) -> dict:
        """How the stack's code computes where it differs from autopar's runtime, as `costmodel.estimate.Evaluator`
        options: what a published run of it is priced with (`costmodel.calibrate.Row`, `costmodel.moe_runs`);
        autopar's own plans never are. Megatron-LM's vocab-parallel cross entropy and llm-foundry's fused one
        compute the loss gradient in place; neither saves a column-parallel linear's whole input; Megatron-LM's
        sequence-first activations need no copy around its sequence-parallel collectives; Megatron-LM keeps 16-bit
        parameters beside fp32 master weights where autopar's runtime autocasts fp32 ones
        (`costmodel.memory.state_bytes_per_param`); Composer's FSDP (FSDP1) computes on views of its gathered flat
        parameter where FSDP2 copies each parameter out; Megatron-LM accumulates gradients inside its
        weight-gradient GEMMs (``fused_grad_accumulation``) and reruns a checkpointed block whole
        (``checkpoint_early_stop``); llm-foundry's loss is one fused kernel on 16-bit logits (``fused_loss``), and
        Composer computes two more cross entropies on them for its training metrics (``train_metrics``); each
        prices the casts of its own float8 recipe. torchtitan is torch-native:
        autopar's runtime."""
        native = self.autopar_runtime
        return {"in_place_loss": not native, "gathered_column_inputs": native, "autocast": native,
                "seq_relayout": native, "float8_recipe": self.float8_recipe, "fsdp_copy_out": native,
                "fused_grad_accumulation": self.fused_grad_accumulation,
                "checkpoint_early_stop": self.checkpoint_early_stop, "fused_loss": self.fused_loss,
                "train_metrics": self.train_metrics}


STACKS = {
    "torch-native": Stack(
        "torch-native",
        "stock PyTorch as autopar emits it: FSDP2, DTensor tensor parallelism, torch.distributed.pipelining, "
        "torch.compile per block when asked",
        "torchtitan's published Llama 3.1 runs on H100 (pytorch/torchtitan benchmarks/"
        "llama3_h100_202412_torchtitan.md Tables 1, 3, 4; asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP "
        "columns, bf16 and float8 tensorwise)", autopar_runtime=True),
    "megatron": Stack(
        "megatron", "Megatron-LM (2022): tensor, sequence and pipeline parallelism with interleaving",
        "Korthikanti et al. 2022 Table 5 (A100)", float8_recipe="transformer-engine", fused_grad_accumulation=True,
        checkpoint_early_stop=False),
    "composer": Stack(
        "composer", "MosaicML Composer / llm-foundry: PyTorch FSDP with FlashAttention and fused cross entropy",
        "llm-foundry's MPT benchmarks (A100 40/80 GB, H100)",
        # (its benchmarks run float8 as te.Linear: fc_type te on H100, scripts/train/benchmarking/submit_benchmarks.py)
        float8_recipe="transformer-engine", fused_loss=True, train_metrics=2),
}


def check_stack(name: str) -> str:
    if name not in STACKS:
        raise ValueError(f"unknown software stack {name!r}; known stacks: {', '.join(STACKS)}")
    return name


def stack_constants(kind: str | None, stack: str) -> dict | None:
    """The constants fitted for ``stack`` on device kind ``kind``, or None when the stack has no rows of its own
    there (the kind's constants then apply)."""
    if kind is None:
        return None
    return ((fitted().get("stacks") or {}).get(stack) or {}).get(kind)


#: what `fitted` returns instead of the file while a fit is in progress (`fitted_as`); None: the file's contents
_IN_PROGRESS: dict | None = None


def fitted() -> dict:
    """fitted.yaml's contents ({} before any fit), read once per version of the file; inside `fitted_as`, the
    contents it was given."""
    if _IN_PROGRESS is not None:
        return _IN_PROGRESS
    return _fitted(FITTED_FILE.stat().st_mtime_ns) if FITTED_FILE.exists() else {}


@contextlib.contextmanager
def fitted_as(contents: dict):
    """Inside the block, `fitted` returns ``contents`` (fitted.yaml's, as a fit in progress would write it), not the
    file's. Devices and clusters built before it keep what they read (`costmodel.calibrate._priced_under` rebuilds
    the catalogues on entry and exit)."""
    global _IN_PROGRESS
    before, _IN_PROGRESS = _IN_PROGRESS, contents
    try:
        yield
    finally:
        _IN_PROGRESS = before


@functools.cache
def _fitted(mtime: int) -> dict:  # (keyed by the file's time: `python -m costmodel.calibrate` rewrites it)
    import yaml

    return yaml.safe_load(FITTED_FILE.read_text()) or {}


def describe(kind: str | None, stack: str) -> str:
    """Where a device's constants come from under ``stack``, in a few words (`autopar plan` prints it)."""
    if stack_constants(kind, stack):
        return f"{stack} (its own constants, fitted on its published runs)"
    return f"{stack} (no {stack} rows on {kind or 'this device'}: the device's constants, fitted on all its rows)"
