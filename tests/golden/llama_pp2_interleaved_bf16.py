"""Train a model on cpu-local as autopar 0.1.0 planned it.

Model: llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32
Plan: dp=1 tp=1 pp=2 (vpp=2, interleaved) zero=0 sp=off grad_compress=none pp_compress=bf16.

Run: torchrun --standalone --nproc-per-node 2 THIS_FILE.py

Needs only torch (and transformers for hf: models). Edit get_batch() to train on your data.
"""

import argparse
import contextlib
import copy
import gc
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

# --- The plan (module names are plain strings) ---


PLAN = {
    "model": "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32",
    "world": 2,
    "pp": 2,
    "dp": 1,
    "tp": 1,
    "vpp": 2,
    "schedule": "interleaved",
    "zero": 0,
    "sp": False,
    "grad_compress": "none",
    "powersgd_rank": 0,
    "powersgd_start_iter": 2,
    "pp_compress": "bf16",
    "precision": "fp32",
    "mbs": 2,
    "grad_accum": 4,
    "global_batch": 8,
    "seq": 32,
    "block_container": "layers",
    "stage_of": {"embed": 0, "layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 3, "head": 3},
    "stage_rank": [0, 1, 0, 1],
    "ac": {},
    "tp_blocks": [],
    "tp_layout": {
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
        "feed_forward.w3": "colwise",
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


# --- copied from profiler/zoo/llama.py (autopar 0.1.0) ---


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width."""
    heads: int
    """Query heads; must divide ``hidden``."""
    kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``heads``."""
    ffn: int
    """SwiGLU inner width (w1/w3 output, w2 input)."""
    vocab: int
    """Vocabulary size."""
    seq: int = 8192
    """Training sequence length (RoPE positions are computed for the actual input length)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    tie_embeddings: bool = False
    """Tie the output head to the token embedding."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"heads={self.heads} does not divide hidden={self.hidden}; choose heads among the divisors of hidden"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} does not divide heads={self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim=hidden/heads={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(
    seq: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq, head_dim] for rotary embeddings (computed in float32, cast to ``dtype``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, head_dim] by position ("rotate half" form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE, no biases, via ``F.scaled_dot_product_attention``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        hd = hidden // heads
        self.head_dim = hd
        self.wq = nn.Linear(hidden, heads * hd, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * hd, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * hd, bias=False)
        self.wo = nn.Linear(heads * hd, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallelism
        kv_heads = k.shape[-1] // self.head_dim
        q = apply_rope(q.view(b, s, heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(b, s, kv_heads, self.head_dim), cos, sin)
        v = v.view(b, s, kv_heads, self.head_dim)
        if kv_heads != heads:  # query head j reads kv head j // rep (repeat_interleave order)
            rep = heads // kv_heads
            k = k[:, :, :, None, :].expand(b, s, kv_heads, rep, self.head_dim).reshape(b, s, heads, self.head_dim)
            v = v[:, :, :, None, :].expand(b, s, kv_heads, rep, self.head_dim).reshape(b, s, heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config.hidden, config.heads, config.kv_heads)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward = FeedForward(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama language model; ``forward(input_ids, labels=None)`` returns the mean loss, or logits without labels.

    For manual pipeline splitting, ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` on stages
    that do not own them (then the stage takes/returns hidden states), as in torchtitan.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for linears and embeddings, N(0, 0.02/√(2l)) for wo and w2, unit norms.

        Call after ``model.to_empty(device=...)`` when the model was built on the meta device.
        """
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.config.layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=out_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=out_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        cos, sin = rope_cos_sin(h.shape[1], self.config.head_dim, self.config.rope_theta, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_model() -> nn.Module:
    return Llama(
        LlamaConfig(
            layers=4,
            hidden=64,
            heads=4,
            kv_heads=2,
            ffn=128,
            vocab=128,
            seq=32,
            norm_eps=1e-05,
            rope_theta=500000.0,
            tie_embeddings=False,
        )
    )


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
    indices, parts = split_pipeline(model, plan, mesh["pp"].get_local_rank())
    modules = []
    for index, part in zip(indices, parts):
        module = part  # what trains: the part itself, or its data-parallel wrapper
        # 4b. Pipeline-boundary compression: bf16 activations (and their gradients) between stages.
        apply_pp_compress(part, index, plan)
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
    # 7. Pipeline schedule over this rank's stages.
    build_pipeline(par)
    return par


def split_pipeline(model: nn.Module, plan: dict, pp_rank: int) -> tuple[list, list]:
    """This rank's (virtual) stages: copies of ``model`` keeping only the blocks, embedding and head they own.

    A weight tied between the embedding and the head stays in both copies (identical: every rank built the model from
    the same seed); summing their gradients after each backward keeps them equal.
    """
    container = plan["block_container"]
    if "." in container or not isinstance(getattr(model, container, None), nn.ModuleList):
        raise ValueError(
            f"pipeline parallelism needs the blocks in a top-level nn.ModuleList and None-able embedding/head "
            f"attributes (the zoo convention); this model keeps them at {container!r}; plan it with pp=1"
        )
    children = [name for name, _ in model.named_children()]
    at = children.index(container)
    owner = {name: plan["stage_of"]["embed"] for name in children[:at]}
    owner.update({name: plan["stage_of"]["head"] for name in children[at + 1 :]})
    mine = [s for s, r in enumerate(plan["stage_rank"]) if r == pp_rank]
    parts = []
    for k, stage in enumerate(mine):
        part = model if k == len(mine) - 1 else copy.deepcopy(model)
        blocks = getattr(part, container)
        keep = [i for i in range(len(blocks)) if plan["stage_of"][f"{container}.{i}"] == stage]
        setattr(part, container, nn.ModuleList(blocks[i] for i in keep))
        part._autopar_block_names = [f"{container}.{i}" for i in keep]
        for name, s in owner.items():
            if s != stage:
                setattr(part, name, None)
        parts.append(part)
    return mine, parts


def apply_pp_compress(part: nn.Module, stage: int, plan: dict) -> None:
    """Send bf16 activations between stages: cast the output of every non-last stage, cast back on entry."""
    n_stages = plan["pp"] * plan["vpp"]
    if stage < n_stages - 1:
        part.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    if stage > 0:
        dtype = torch.float32 if current_device().type == "cpu" else DTYPES[plan["precision"]]
        part.register_forward_pre_hook(lambda module, args: (args[0].to(dtype), *args[1:]))


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
        par.schedule = schedule_cls(par.stages, plan["grad_accum"], loss_fn=par.loss_fn)


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
        n_stages = plan["pp"] * plan["vpp"]
        args = (x,) if 0 in par.stage_indices else ()
        losses: list = []
        kwargs = {"target": y, "losses": losses} if n_stages - 1 in par.stage_indices else {}
        # return_outputs=False: the last stage would otherwise keep every micro-batch's output (the logits)
        par.schedule.step(*args, **kwargs, return_outputs=False)
        local = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=device)
    optimizer.step()
    total = local.reshape(1).clone()
    dist.all_reduce(total, group=par.mesh["pp"].get_group())  # only the last stage holds the loss
    return total[0] / plan["dp"]


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
