"""Train a model on cpu-local as autopar 0.1.0 planned it.

Model: llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32
Plan: dp=1 tp=1 pp=2 (vpp=2, interleaved) zero=0 sp=off grad_compress=none pp_compress=bf16.

Run: torchrun --standalone --nproc-per-node 2 THIS_FILE.py

Needs only torch (and transformers for hf: models). Edit get_batch() to train on your data.
"""

import contextlib
import copy
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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
    "optimizer": "adamw",
    "lr": 0.001,
    "seed": 0,
}
STEPS = 10
VOCAB = 128


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


# --- Parallelism: copied from autopar's planner/runtime.py ---


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
    problems = []
    if world != plan["world"]:
        problems.append(
            f"this plan needs {plan['world']} processes ({shape}) but WORLD_SIZE={world}; start it with "
            f"torchrun --nproc-per-node {plan['world']}, or re-plan for {world} devices"
        )
    if plan["tp"] > local:
        problems.append(
            f"tp={plan['tp']} needs that many processes per node, but LOCAL_WORLD_SIZE={local}; "
            f"re-plan with tp ≤ {local}"
        )
    if torch.cuda.is_available() and plan["tp"] > torch.cuda.device_count():
        problems.append(f"tp={plan['tp']} but this node has {torch.cuda.device_count()} GPUs; re-plan with fewer")
    if problems:
        print(f"[rank {rank}] error: {'; '.join(problems)}", file=sys.stderr, flush=True)
        sys.exit(2)


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


def parallelize(build_model, plan: dict, mesh: DeviceMesh) -> Parallel:
    """Build the model with ``build_model()`` after seeding, and apply the plan to it (see the module docstring)."""
    device = current_device()
    torch.manual_seed(plan["seed"])  # identical weights on every rank, and in a one-process reference run
    model = build_model().to(device)
    if plan["pp"] > 1:
        indices, parts = split_pipeline(model, plan, mesh["pp"].get_local_rank())
    else:
        container = model.get_submodule(plan["block_container"])
        model._autopar_block_names = [f"{plan['block_container']}.{i}" for i in range(len(container))]
        indices, parts = [0], [model]
    modules = []
    for index, part in zip(indices, parts):
        # 1. Tensor parallel: Megatron column/row layout per block, sequence parallel on the norms.
        if plan["tp"] > 1:
            apply_tp(part, plan, mesh["tp"])
        # 2. Activation checkpointing, per block as the plan says.
        apply_ac(part, plan)
        # 3. Pipeline-boundary compression: bf16 activations (and their gradients) between stages.
        if plan["pp"] > 1 and plan["pp_compress"] == "bf16":
            apply_pp_compress(part, index, plan)
        # 4. Data parallel: DDP with a comm hook, or FSDP2 by ZeRO stage.
        modules.append(apply_dp(part, plan, mesh))
    par = Parallel(plan=plan, mesh=mesh, parts=parts, modules=modules, stage_indices=indices, device=device)
    # 5. Pipeline schedule over this rank's stages.
    if plan["pp"] > 1:
        build_pipeline(par)
    return par


def block_list(part: nn.Module, plan: dict) -> nn.ModuleList:
    return part.get_submodule(plan["block_container"])


def split_pipeline(model: nn.Module, plan: dict, pp_rank: int) -> tuple[list, list]:
    """This rank's (virtual) stages: copies of ``model`` keeping only the blocks, embedding and head they own."""
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
    ranks = plan["stage_rank"]
    shared: dict[int, set] = {}  # tied weights must not span pipeline ranks
    for name, p in model.named_parameters(remove_duplicate=False):
        top, _, rest = name.partition(".")
        stage = plan["stage_of"][f"{top}.{rest.split('.')[0]}"] if top == container else owner[top]
        shared.setdefault(id(p), set()).add((ranks[stage], name))
    for users in shared.values():
        if len({r for r, _ in users}) > 1:
            names = sorted(n for _, n in users)
            raise ValueError(
                f"tied parameters {names} would live on different pipeline ranks; put the embedding and the head "
                f"on the same rank, or use a model without tied embeddings"
            )
    mine = [s for s, r in enumerate(ranks) if r == pp_rank]
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


def _to_replicate(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence-sharded local tensor → full tensor (all-gather; backward keeps this rank's slice)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


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
    output projections (attention heads split with them: the models derive local heads from the weight shape).

    With sequence parallel the residual stream is sharded along the sequence inside each run of TP blocks: norms
    run on their slice (``SequenceParallel``), the attention/MLP inputs are all-gathered, the row-parallel outputs
    reduce-scattered; the run's first block slices its input and its last block all-gathers its output.
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
        if sp:
            for rel in plan["sp_gather"]:
                block.get_submodule(rel).register_forward_pre_hook(
                    _convert_input(_to_replicate, tp_mesh), with_kwargs=True
                )
            if i == 0 or not flags[i - 1]:
                block.register_forward_pre_hook(_convert_input(_to_shard, tp_mesh), with_kwargs=True)
            if i == len(blocks) - 1 or not flags[i + 1]:
                block.register_forward_hook(_convert_output(_to_replicate, tp_mesh))


def _selective_policy(ctx, op, *args, **kwargs):
    """Selective AC (Korthikanti et al. 2022 §4.2): keep the linear outputs, recompute the rest (attention core,
    softmax, activations, norms)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(part: nn.Module, plan: dict) -> None:
    """Wrap the blocks the plan checkpoints: ``full`` recomputes the block, ``selective`` keeps matmul outputs."""
    blocks = block_list(part, plan)
    for i, name in enumerate(part._autopar_block_names):
        mode = plan["ac"].get(name, "none")
        if mode == "full":
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False)
        elif mode == "selective":
            context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False, context_fn=context_fn)


def apply_pp_compress(part: nn.Module, stage: int, plan: dict) -> None:
    """Send bf16 activations between stages: cast the output of every non-last stage, cast back on entry."""
    n_stages = plan["pp"] * plan["vpp"]
    if stage < n_stages - 1:
        part.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    if stage > 0:
        dtype = torch.float32 if current_device().type == "cpu" else DTYPES[plan["precision"]]
        part.register_forward_pre_hook(lambda module, args: (args[0].to(dtype), *args[1:]))


def bf16_cast_hook(process_group, bucket):
    """DDP comm hook: all-reduce the gradient bucket in bf16 (``bf16_compress_hook`` is NCCL-only in torch 2.13)."""
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return future.then(decompress)


def apply_dp(part: nn.Module, plan: dict, mesh: DeviceMesh) -> nn.Module:
    """Data parallel over the dp mesh dimension: DDP (ZeRO 0) or FSDP2 (ZeRO 1-3)."""
    if plan["dp"] == 1:
        return part
    dp_mesh = mesh["dp"]
    compress, rank = plan["grad_compress"], plan["powersgd_rank"]
    if plan["zero"] == 0 and plan["tp"] > 1:
        # DDP does not take DTensor parameters: all-reduce the gradients after backward (see train_step) instead.
        if compress != "none":
            raise ValueError(
                f"grad_compress={compress} with tp={plan['tp']} needs FSDP: use zero ≥ 1 (bf16/fp16) "
                "or tp=1 (DDP comm hooks)"
            )
        part._autopar_grad_group = dp_mesh.get_group()
        return part
    if plan["zero"] == 0:
        cuda = current_device().type == "cuda"
        ddp = DDP(part, process_group=dp_mesh.get_group(), device_ids=[current_device()] if cuda else None)
        group = dp_mesh.get_group()
        if compress == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif compress == "bf16":
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook if cuda else bf16_cast_hook)
        elif compress == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=plan["powersgd_start_iter"],
                random_seed=plan["seed"],
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp
    # FSDP2: mixed precision only on GPUs (CPU runs stay fp32); reduce in bf16/fp16 when the plan compresses.
    on_gpu = current_device().type == "cuda"
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[plan["precision"]] if on_gpu and plan["precision"] != "fp32" else None,
        reduce_dtype=DTYPES[compress] if compress in ("bf16", "fp16") else None,
    )
    reshard = plan["zero"] == 3  # ZeRO 1/2: keep parameters gathered between forward and backward
    for block in block_list(part, plan):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    return part


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, as the zoo models compute it."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


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
        par.schedule = schedule_cls(par.stages[0], plan["grad_accum"], loss_fn=lm_loss)
    else:
        par.schedule = schedule_cls(par.stages, plan["grad_accum"], loss_fn=lm_loss)


def autocast(plan: dict, device: torch.device):
    """Mixed precision for DDP/pipeline runs on GPUs (FSDP casts through its policy; CPU runs stay fp32)."""
    if device.type != "cuda" or plan["precision"] == "fp32" or (plan["dp"] > 1 and plan["zero"] > 0):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=DTYPES[plan["precision"]])


def build_optimizer(par: Parallel, plan: dict) -> torch.optim.Optimizer:
    params = [p for module in par.modules for p in module.parameters()]
    if plan["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=plan["lr"])
    return torch.optim.AdamW(params, lr=plan["lr"])


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
    for part in par.parts:
        if hasattr(part, "_autopar_grad_group"):
            allreduce_grads(part, plan["dp"])
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
    """Forward and backward of one micro-batch, syncing gradients only on the last one."""
    if isinstance(module, DDP) and not last:
        ctx = module.no_sync()
    else:
        ctx = contextlib.nullcontext()
        if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(last)
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
    for part in par.parts:
        names = part._autopar_block_names
        container = par.plan["block_container"]
        for name, p in part.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            if name.startswith(container + "."):
                index, _, rest = name[len(container) + 1 :].partition(".")
                name = f"{names[int(index)]}.{rest}"
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = value.detach().cpu().clone()
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
    train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
