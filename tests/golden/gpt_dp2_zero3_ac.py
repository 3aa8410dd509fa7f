"""Train a model on cpu-local as autopar 0.1.0 planned it.

Model: gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,dropout=0
Plan: dp=2 tp=1 pp=1 (vpp=1, 1f1b) zero=3 sp=off grad_compress=none pp_compress=none.

Run: torchrun --standalone --nproc-per-node 2 THIS_FILE.py

Needs only torch (and transformers for hf: models). Edit get_batch() to train on your data.
"""

import argparse
import contextlib
import gc
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# --- The plan (module names are plain strings) ---


PLAN = {
    "model": "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,dropout=0",
    "world": 2,
    "pp": 1,
    "dp": 2,
    "tp": 1,
    "vpp": 1,
    "schedule": "1f1b",
    "zero": 3,
    "sp": False,
    "grad_compress": "none",
    "powersgd_rank": 0,
    "powersgd_start_iter": 2,
    "pp_compress": "none",
    "precision": "fp32",
    "mbs": 1,
    "grad_accum": 4,
    "global_batch": 8,
    "seq": 32,
    "block_container": "layers",
    "stage_of": {"embed": 0, "layers.0": 0, "layers.1": 0, "head": 0},
    "stage_rank": [0],
    "ac": {"layers.1": "full"},
    "tp_blocks": [],
    "tp_layout": {
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
    },
    "sp_norms": ["attention_norm", "ffn_norm"],
    "sp_gather": ["attention", "feed_forward"],
    "tied": [],
    "optimizer": "adamw",
    "lr": 0.001,
    "seed": 0,
    "init": "full",
    "vocab": 128,
    "vocab_embed": "tok_embeddings",
    "vocab_head": "output",
}
STEPS = 10
VOCAB = 128
# init=full: 0.00 GiB of fp32 parameters ≤ 2 GiB on CPU: every rank builds the whole model, seeded


# --- The model ---


# --- copied from profiler/zoo/gpt.py (autopar 0.1.0) ---


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    layers: int
    """Number of transformer blocks (l)."""
    hidden: int
    """Model width (h)."""
    heads: int
    """Attention heads (a); must divide ``hidden``."""
    seq: int
    """Maximum sequence length (s): rows of the learned position embedding."""
    vocab: int
    """Vocabulary size (V); the output head is tied to the token embedding."""
    ffn: int | None = None
    """MLP inner width; ``None`` means 4·hidden."""
    dropout: float = 0.1
    """Dropout probability (embeddings, attention probabilities, attention output, MLP output)."""
    attention: Literal["sdpa", "math"] = "sdpa"
    """``"sdpa"``: ``F.scaled_dot_product_attention``; ``"math"``: explicit Megatron softmax(QKᵀ/√d)·V."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"heads={self.heads} does not divide hidden={self.hidden}; choose heads among the divisors of hidden"
            )
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"ffn={self.ffn} must be >= 1 (or omitted for 4*hidden={4 * self.hidden})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention={self.attention!r} must be 'sdpa' or 'math'")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (column-parallel friendly) and biases."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.use_sdpa = config.attention == "sdpa"
        self.wq = nn.Linear(h, h)
        self.wk = nn.Linear(h, h)
        self.wv = nn.Linear(h, h)
        self.wo = nn.Linear(h, h)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallelism
        q = q.view(b, s, heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, heads, self.head_dim).transpose(1, 2)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            out = self._math_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, heads * self.head_dim)
        return self.resid_dropout(self.wo(out))

    def _math_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Megatron-LM (2022) core attention: baddbmm(QKᵀ)/√d, causal mask, softmax, dropout, ·V."""
        b, heads, s, d = q.shape
        q2 = q.reshape(b * heads, s, d)
        k2 = k.reshape(b * heads, s, d)
        v2 = v.reshape(b * heads, s, d)
        scores = torch.baddbmm(
            torch.empty(b * heads, s, s, dtype=q.dtype, device=q.device),
            q2,
            k2.transpose(1, 2),
            beta=0.0,
            alpha=1.0 / math.sqrt(d),
        )
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # True above the diagonal: masked
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        return torch.bmm(probs, v2).view(b, heads, s, d)


class FeedForward(nn.Module):
    """GELU MLP: w2(gelu(w1 x)), with biases."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn_dim)
        self.w2 = nn.Linear(config.ffn_dim, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.hidden)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """GPT language model; ``forward(input_ids, labels=None)`` returns the mean loss, or logits without labels.

    For manual pipeline splitting, ``tok_embeddings``/``pos_embeddings``, ``norm`` and ``output`` may be set to
    ``None`` on stages that do not own them (then the stage takes/returns hidden states), as in torchtitan.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.pos_embeddings = nn.Embedding(config.seq, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.output = nn.Linear(config.hidden, config.vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied head
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2/Megatron init: N(0, 0.02), output projections N(0, 0.02/√(2l)), zero biases, unit LayerNorms.

        Call after ``model.to_empty(device=...)`` when the model was built on the meta device.
        """
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.config.layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=out_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=out_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_embeddings is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            h = self.dropout(self.tok_embeddings(input_ids) + self.pos_embeddings(positions))
        else:
            h = input_ids  # hidden states from the previous pipeline stage
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_model() -> nn.Module:
    return GPT(GPTConfig(layers=2, hidden=64, heads=4, seq=32, vocab=128, ffn=None, dropout=0.0, attention="sdpa"))


# --- Parallelism: autopar's costmodel/runnable.py, planner/emit/runtime.py and train.py, as used here ---


RUNNABLE_PRECISIONS = ("fp32", "bf16", "fp16")


def post_step_allreduce(dp: int, tp: int, zero: int, schedule: str, pp: int) -> bool:
    """True where data-parallel gradients are averaged by an explicit all-reduce after the whole backward instead of
    DDP's overlapped bucket hooks: tensor parallelism without FSDP (DDP takes no DTensor parameters), and the
    zero-bubble schedule (torch computes its weight gradients with ``autograd.grad`` and writes ``.grad`` by hand,
    so DDP's reducer hooks never fire for them: replicas would silently diverge)."""
    return dp > 1 and zero <= 1 and (tp > 1 or (pp > 1 and schedule == "zb"))


def grad_compress_options(dp: int, tp: int, zero: int, schedule: str = "1f1b", pp: int = 1) -> tuple[str, ...]:
    """The gradient compressions (``none``, ``bf16``, ``fp16``, ``powersgd``) the runtime can apply: DDP comm hooks
    (ZeRO 0/1 under DDP) take all; FSDP2 (ZeRO 2/3) reduces in bf16/fp16 through its ``reduce_dtype`` but has no
    PowerSGD; the explicit post-step all-reduce (`post_step_allreduce`) compresses nothing."""
    if dp == 1 or post_step_allreduce(dp, tp, zero, schedule, pp):
        return ("none",)
    if zero >= 2:
        return ("none", "bf16", "fp16")
    return ("none", "bf16", "fp16", "powersgd")


def problems(facts: dict) -> list:
    """Every reason the runtime cannot run ``facts`` as planned (empty when it can), one actionable line each."""
    f = facts
    dp, tp, pp, zero = f["dp"], f["tp"], f["pp"], f["zero"]
    schedule = f["schedule"] if pp > 1 else "1f1b"
    out = []
    if f["precision"] not in RUNNABLE_PRECISIONS:
        out.append(
            f"precision={f['precision']} is not supported by the runtime yet (float8 training needs torchao; "
            "the cost model only predicts it); re-plan with --fix precision=bf16"
        )
    if zero == 1 and tp > 1 and dp > 1:
        out.append(
            "zero=1 with tp>1 is not supported yet (ZeroRedundancyOptimizer takes no DTensor parameters); "
            "re-plan with --fix zero=2 or tp=1"
        )
    for key in ("heads", "kv_heads"):
        if tp > 1 and f.get(key) and f[key] % tp:
            out.append(f"tp={tp} does not divide {key}={f[key]}; choose a tp that divides it")
    if f.get("sp") and tp > 1 and f.get("seq") and f["seq"] % tp:
        out.append(
            f"sequence parallel needs seq={f['seq']} divisible by tp={tp}; re-plan with --fix sp=off or a "
            "tp that divides the sequence"
        )
    m = f["micro_batches"]
    # torch runs GPipe and the interleaved schedules with fewer micro-batches than ranks (1F1B refuses), but the cost
    # model prices a full pipeline: m ≥ pp for every schedule
    if pp > 1 and m < pp:
        out.append(
            f"pp={pp} needs at least {pp} micro-batches per step, but global_batch/(dp·mbs) = {m}; raise "
            "--global-batch or lower mbs"
        )
    rounds = max(1, m // pp)  # torch 2.13's interleaved schedules run m micro-batches in rounds of m // rounds
    if pp > 1 and schedule in ("interleaved", "zb") and m % rounds:
        out.append(
            f"schedule={schedule} runs the {m} micro-batches per step in {rounds} equal rounds (torch's "
            f"ScheduleInterleaved*: m divisible by max(1, m // pp)), which {m} is not; change --global-batch "
            "or mbs"
        )
    kind = f.get("grad_compress", "none")
    allowed = grad_compress_options(dp, tp, zero, schedule, pp)
    if kind not in allowed:
        why = (
            "FSDP2 (zero ≥ 2) reduces in bf16/fp16 only"
            if zero >= 2
            else "gradients are all-reduced after the step here (tensor parallel or zero-bubble without FSDP), where "
            "no compression hook applies"
        )
        out.append(
            f"grad_compress={kind} cannot run with dp={dp} tp={tp} zero={zero} schedule={schedule}: {why}; "
            f"choose one of {', '.join(allowed)}"
        )
    return out


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_world(plan: dict) -> None:
    """Stop every rank with one clear message when the launch does not match the plan (before any collective)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    rank = os.environ.get("RANK", "0")
    shape = f"pp={plan['pp']} × dp={plan['dp']} × tp={plan['tp']}"
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
    if torch.cuda.is_available() and plan["tp"] > torch.cuda.device_count():
        errors.append(f"tp={plan['tp']} but this node has {torch.cuda.device_count()} GPUs; re-plan with fewer")
    errors += plan_problems(plan)
    if errors:
        print(f"[rank {rank}] error: {'; '.join(errors)}", file=sys.stderr, flush=True)
        sys.exit(2)


def plan_problems(plan: dict) -> list:
    """Why this runtime cannot run ``plan`` as it stands (``costmodel.runnable.problems``, the rules the planner's
    search and emitter apply too): a hand-edited ``PLAN`` fails here, before any collective."""
    facts = {
        key: plan[key]
        for key in ("dp", "tp", "pp", "vpp", "schedule", "zero", "sp", "grad_compress", "precision", "seq")
    }
    return problems({**facts, "micro_batches": plan["grad_accum"]})


def init_distributed(plan: dict) -> DeviceMesh:
    """Check the launch, start the process group (NCCL with CUDA, else gloo) and build the (pp, dp, tp) mesh."""
    check_world(plan)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    shape = (plan["pp"], plan["dp"], plan["tp"])
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "tp"))


def current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Parallel:
    """The model as this rank holds it after `parallelize`."""

    plan: dict  #: the runtime plan dict
    mesh: DeviceMesh  #: the (pp, dp, tp) mesh
    parts: list  #: local model parts before data-parallel wrapping (one per local pipeline stage)
    modules: list  #: the same parts as trained (DDP/FSDP-wrapped where data parallel)
    stages: list = field(default_factory=list)  #: PipelineStage objects (empty without pipeline parallelism)
    stage_indices: list = field(default_factory=list)  #: (virtual) stage index of each local part
    schedule: object = None  #: the pipeline schedule (None without pipeline parallelism)
    device: torch.device | None = None  #: where this rank computes
    tied_groups: list = field(default_factory=list)  #: this rank's embedding group per ``plan["tied"]`` entry
    loss_fn: object = None  #: ``(logits, labels) → loss`` (`loss_function`)


def parallelize(build_model, plan: dict, mesh: DeviceMesh) -> Parallel:
    """Build the model with ``build_model()`` after seeding, and apply the plan to it (see the module docstring)."""
    device = current_device()
    torch.manual_seed(plan["seed"])  # identical weights on every rank, and in a one-process reference run
    # 0. The model: real weights on every rank, or (large models) shapes only, materialised after sharding.
    model = build_model().to(device)
    # 1. Pipeline split: this rank's (virtual) stages, each a copy of the model keeping only the blocks it owns;
    #    without pipeline parallelism the whole model is the one local part.
    container = model.get_submodule(plan["block_container"])
    model._autopar_block_names = [f"{plan['block_container']}.{i}" for i in range(len(container))]
    indices, parts = [0], [model]
    modules = []
    for index, part in zip(indices, parts):
        module = part  # what trains: the part itself, or its data-parallel wrapper
        # 3. Activation checkpointing, per block as the plan says.
        apply_ac(part, plan)
        # 5. Data parallel, wrapping what the steps above built: DDP with a comm hook (ZeRO 0, and ZeRO 1 whose
        #    optimizer state `build_optimizer` shards), or FSDP2 for ZeRO 2/3.
        module = apply_fsdp(part, plan, mesh["dp"])
        modules.append(module)
    par = Parallel(
        plan=plan,
        mesh=mesh,
        parts=parts,
        modules=modules,
        stage_indices=indices,
        device=device,
        loss_fn=loss_function(plan, mesh),
    )
    return par


def block_list(part: nn.Module, plan: dict) -> nn.ModuleList:
    return part.get_submodule(plan["block_container"])


def _is_square(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2] > 1


def _selective_policy(ctx, op, *args, **kwargs):
    """Selective AC (Korthikanti et al. 2022 §4.2): recompute the attention core, i.e. the ops that read or make
    the seq×seq scores and probabilities (QKᵀ, mask, softmax, dropout, ·V); keep everything else. A fused
    attention kernel materialises no such tensor, so it is kept like any other op. Random ops (dropout masks)
    allocations and in-place ops are recomputed too: with the RNG state preserved they replay identically, and
    a tensor filled in place must not be served from the cache."""
    if torch.Tag.nondeterministic_seeded in op.tags or op.name().startswith("aten::empty") or op._schema.is_mutable:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if any(_is_square(a) for a in args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default) and len(args) >= 2:
        a, b = args[-2], args[-1]  # batched Q·Kᵀ makes [batch, seq, seq]
        if a.dim() == 3 and b.dim() == 3 and a.shape[-2] == b.shape[-1] > 1:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def apply_ac(part: nn.Module, plan: dict) -> None:
    """Wrap the blocks the plan checkpoints: ``full`` recomputes the block, ``selective`` its attention core.
    The RNG state is preserved so that recomputed dropout draws the same masks."""
    blocks = block_list(part, plan)
    for i, name in enumerate(part._autopar_block_names):
        mode = plan["ac"].get(name, "none")
        if mode == "full":
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=True)
        elif mode == "selective":
            context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=True, context_fn=context_fn)


def apply_fsdp(part: nn.Module, plan: dict, dp_mesh: DeviceMesh) -> nn.Module:
    """ZeRO 2-3: FSDP2 per block, then the root. Mixed precision only on GPUs (CPU runs stay fp32); gradients
    reduced in fp32 (as torchtitan does), in bf16/fp16 when the plan compresses."""
    on_gpu = current_device().type == "cuda"
    compress = plan["grad_compress"]
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[plan["precision"]] if on_gpu and plan["precision"] != "fp32" else None,
        # fp32 reduction (and accumulation across micro-batches) unless the plan compresses: torch's default (None)
        # would reduce in the bf16 compute dtype, which the cost model does not charge and the user did not ask for
        reduce_dtype=DTYPES[compress] if compress in ("bf16", "fp16") else torch.float32,
    )
    reshard = plan["zero"] == 3  # ZeRO 1/2: keep parameters gathered between forward and backward
    for block in block_list(part, plan):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    return part


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits[:, t]`` against ``labels[:, t]`` (no further shift; label −100 is
    ignored), as the zoo models compute it."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def loss_function(plan: dict, mesh: DeviceMesh):
    """``(logits, labels) → loss`` for this plan: on vocabulary slices when the head is split."""
    return lm_loss


def loss_context(plan: dict):
    """The context a training step's forward and backward run in: torch's ``loss_parallel`` when the loss works on
    vocabulary slices."""
    return contextlib.nullcontext()


def autocast(plan: dict, device: torch.device):
    """Mixed precision for DDP/pipeline runs on GPUs (FSDP casts through its policy; CPU runs stay fp32)."""
    return contextlib.nullcontext()


def build_optimizer(par: Parallel, plan: dict) -> torch.optim.Optimizer:
    """SGD or AdamW; under ZeRO-1 wrapped in `ZeroRedundancyOptimizer`, which keeps each dp rank's share of the
    optimizer state and broadcasts the updated parameters after its step."""
    params = [p for module in par.modules for p in module.parameters()]
    cls = torch.optim.SGD if plan["optimizer"] == "sgd" else torch.optim.AdamW
    return cls(params, lr=plan["lr"])


def train_step(par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """One optimizer step on the global batch (the same on every rank; each dp rank takes its rows).

    Returns the global mean loss, identical on every rank, as a Python float (`train_step_loss` has it as a tensor).
    """
    return train_step_loss(par, optimizer, inputs, labels).item()


def train_step_loss(
    par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """`train_step` up to its loss, a 0-dim tensor on the device (no host synchronisation: `autopar check` runs this
    on fake tensors)."""
    plan, device = par.plan, par.device
    dp_rank = par.mesh["dp"].get_local_rank()
    rows = plan["global_batch"] // plan["dp"]
    x = inputs[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    y = labels[dp_rank * rows : (dp_rank + 1) * rows].to(device)
    optimizer.zero_grad(set_to_none=True)
    with autocast(plan, device), loss_context(plan):
        local = torch.zeros((), device=device)
        module, n = par.modules[0], plan["grad_accum"]
        for k, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
            last = k == n - 1
            loss = _accumulate(module, par.loss_fn, xm, ym, n, last, keep_gathered=plan["zero"] == 2)
            local += loss.detach().float()
    optimizer.step()
    total = local.reshape(1).clone()
    dist.all_reduce(total, group=par.mesh["dp"].get_group())
    return total[0] / plan["dp"]


def _accumulate(
    module: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, n: int, last: bool, keep_gathered: bool = False
) -> torch.Tensor:
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


# --- Data and training loop ---


def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """>>> YOUR DATA HERE <<< The global batch of ``step``: (input_ids, labels), each [GLOBAL_BATCH, SEQ] int64.

    Return the same global batch on every rank; each data-parallel rank trains on its own rows of it.
    """
    return synthetic_batch(step, batch=PLAN["global_batch"], seq=PLAN["seq"], vocab=VOCAB, seed=PLAN["seed"])


def train(steps: int = STEPS) -> tuple[Parallel, list[float]]:
    """Apply the plan and train ``steps`` optimizer steps; returns the parallel model and the losses."""
    mesh = init_distributed(PLAN)  # checks the launch against the plan before any collective
    par = parallelize(build_model, PLAN, mesh)
    optimizer = build_optimizer(par, PLAN)
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        inputs, labels = get_batch(step)
        start = time.perf_counter()
        loss = train_step(par, optimizer, inputs, labels)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        peak = peak_memory_bytes(par.device) / 2**20
        print(
            f"[rank {rank}] step {step} loss {loss:.5f} time {elapsed * 1e3:.1f} ms peak memory {peak:.0f} MiB",
            flush=True,
        )
    return par, losses


def main() -> None:
    parser = argparse.ArgumentParser(description="Train with the plan above (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    train(parser.parse_args().steps)
    # The parallel model sits in reference cycles (module hooks) that hold its DTensors, their device mesh and so
    # the process groups. Collected here, while the groups are alive, not at interpreter exit: left to exit, one
    # rank in ~20 aborted there ("terminate called without an active exception", after destroy_process_group).
    gc.collect()
    dist.barrier()  # every rank done with its last collective before the process group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
