"""Train a model on cpu-local as autopar 0.1.0 planned it.

Model: llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32
Plan: dp=2 tp=2 pp=1 (vpp=1, 1f1b) zero=2 sp=on grad_compress=bf16 pp_compress=none.

Run: torchrun --standalone --nproc-per-node 4 THIS_FILE.py

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

# --- The plan (module names are plain strings) ---


PLAN = {
    "model": "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32",
    "world": 4,
    "pp": 1,
    "dp": 2,
    "tp": 2,
    "vpp": 1,
    "schedule": "1f1b",
    "zero": 2,
    "sp": True,
    "grad_compress": "bf16",
    "powersgd_rank": 0,
    "powersgd_start_iter": 2,
    "pp_compress": "none",
    "precision": "fp32",
    "mbs": 1,
    "grad_accum": 4,
    "global_batch": 8,
    "seq": 32,
    "block_container": "layers",
    "stage_of": {"embed": 0, "layers.0": 0, "layers.1": 0, "layers.2": 0, "layers.3": 0, "head": 0},
    "stage_rank": [0],
    "ac": {},
    "tp_blocks": ["layers.0", "layers.1", "layers.2", "layers.3"],
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
        # 2. Tensor parallel: Megatron column/row layout per block, sequence parallel on the norms.
        apply_tp(part, plan, mesh["tp"])
        apply_vocab_parallel(part, plan, mesh["tp"])
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
    if sp and plan["seq"] % plan["tp"]:
        raise ValueError(f"sequence parallel needs seq={plan['seq']} divisible by tp={plan['tp']}")
    names = part._autopar_block_names
    blocks = block_list(part, plan)
    flags = [name in plan["tp_blocks"] for name in names]
    for i, (block, on) in enumerate(zip(blocks, flags)):
        if not on:
            continue
        layout = {}
        for rel, kind in plan["tp_layout"].items():
            if kind == "colwise":
                layout[rel] = ColwiseParallel()
            else:
                layout[rel] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            for rel in plan["sp_norms"]:
                layout[rel] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, layout)
        for rel in plan["sp_gather"]:  # the modules whose input feeds column-parallel linears
            block.get_submodule(rel).register_forward_pre_hook(
                _convert_input(_gather_seq if sp else _as_replicate, tp_mesh), with_kwargs=True
            )
        if sp:
            if i == 0 or not flags[i - 1]:
                block.register_forward_pre_hook(_convert_input(_to_shard, tp_mesh), with_kwargs=True)
            if i == len(blocks) - 1 or not flags[i + 1]:
                block.register_forward_hook(_convert_output(_to_replicate, tp_mesh))


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
        embed.weight = nn.Parameter(
            distribute_tensor(embed.weight, tp_mesh, [Shard(0)]), requires_grad=embed.weight.requires_grad
        )
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
        return (
            DTensor.from_local(rows, self.mesh, [Partial()], run_check=False)
            .redistribute(self.mesh, [Replicate()])
            .to_local()
        )


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


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, tp_mesh: DeviceMesh, vocab: int) -> torch.Tensor:
    """`lm_loss` when ``logits`` is this rank's slice of a ``vocab``-wide vocabulary (`apply_vocab_parallel`): torch's
    ``loss_parallel`` cross-entropy over the slices, whose backward must run inside that context too (`loss_context`,
    which `planner.emit.train.train_step_loss` holds for the whole step)."""
    shape = (*logits.shape[:-1], vocab)
    stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    logits = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape, stride=stride)
    return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1)).to_local()


def loss_function(plan: dict, mesh: DeviceMesh):
    """``(logits, labels) → loss`` for this plan: on vocabulary slices when the head is split."""
    return partial(vocab_parallel_loss, tp_mesh=mesh["tp"], vocab=plan["vocab"])


def loss_context(plan: dict):
    """The context a training step's forward and backward run in: torch's ``loss_parallel`` when the loss works on
    vocabulary slices."""
    return loss_parallel()


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
