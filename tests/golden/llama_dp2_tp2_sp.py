"""Train a model on cpu-local as autopar 0.1.0 planned it.

Model: llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32
Plan: dp=2 tp=2 pp=1 (vpp=1, 1f1b) zero=2 sp=on grad_compress=bf16 pp_compress=none.

Run: on each of the 2 nodes,
  torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
    --rdzv-endpoint FIRST_NODE_HOST:29500 --rdzv-id JOB_ID THIS_FILE.py

Needs only torch (and transformers for hf: models). Train on a token file with --data,
or edit get_batch(). Flags: --steps --lr --warmup-steps --clip-norm --data --checkpoint-dir --save-every
--resume --stop-after --compile (see --help).
"""

import argparse
import contextlib
import datetime
import functools
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
    "cp": 1,
    "ep": 1,
    "experts": 0,
    "ep_modules": [],
    "ep_interface": None,
    "expert_dim1": 0,
    "vpp": 1,
    "schedule": "1f1b",
    "zero": 2,
    "sp": True,
    "grad_compress": "bf16",
    "powersgd_rank": 0,
    "powersgd_start_iter": 1000,
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
    "selective": None,
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
    "weight_decay": 0.1,
    "clip_norm": 1.0,
    "warmup_steps": 0,
    "min_lr_ratio": 0.1,
    "seed": 0,
    "init": "full",
    "compile": None,
    "mfu_per_token_rate": None,
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
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq, head_dim] for rotary embeddings (computed in float32, cast to ``dtype``), for
    positions 0..seq−1, or for ``positions`` (seq integers) when given: the global positions of the tokens a
    context-parallel rank holds (`Llama.context_positions`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if positions is None:
        positions = torch.arange(seq, device=device, dtype=torch.float32)
    else:
        positions = positions.to(device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, head_dim] by position ("rotate half" form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE, no biases, via ``F.scaled_dot_product_attention``.

    The attention core is `attend`, a method of its own so that a context-parallel runtime can replace it per
    instance (autopar's ``planner.emit.runtime.apply_cp`` gathers the other ranks' keys and values there).
    """

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
        out = self.attend(q, k, v)
        return self.wo(out.reshape(b, s, heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q`` [b, s, heads, head_dim] over ``k``, ``v`` [b, s, kv_heads, head_dim] (after
        RoPE, before the grouped-query expansion: a context-parallel replacement gathers the smaller tensors);
        returns [b, s, heads, head_dim]."""
        b, s, heads, _ = q.shape
        kv_heads = k.shape[2]
        if kv_heads != heads:  # query head j reads kv head j // rep (repeat_interleave order)
            rep = heads // kv_heads
            k = k[:, :, :, None, :].expand(b, s, kv_heads, rep, self.head_dim).reshape(b, s, heads, self.head_dim)
            v = v[:, :, :, None, :].expand(b, s, kv_heads, rep, self.head_dim).reshape(b, s, heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


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

    context_positions: torch.Tensor | None = None
    """The global positions (a 1-D integer tensor, one per input token) of the tokens this model sees, for RoPE;
    None: 0..s−1. A context-parallel runtime (autopar's ``planner.emit.runtime.apply_cp``) sets it on each rank to
    the positions of the part of the sequence that rank holds, on the device it computes on."""

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
        cos, sin = rope_cos_sin(
            h.shape[1], self.config.head_dim, self.config.rope_theta, h.device, h.dtype, self.context_positions
        )
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


RUNNABLE_PRECISIONS = ("fp32", "bf16")


def post_step_allreduce(dp: int, tp: int, zero: int, schedule: str, pp: int) -> bool:
    """True where data-parallel gradients are averaged by an explicit all-reduce after the whole backward instead of
    DDP's overlapped bucket hooks: tensor parallelism without FSDP (DDP takes no DTensor parameters), and the
    zero-bubble schedule (torch computes its weight gradients with ``autograd.grad`` and writes ``.grad`` by hand,
    so DDP's reducer hooks never fire for them: replicas would silently diverge)."""
    return dp > 1 and zero <= 1 and (tp > 1 or (pp > 1 and schedule == "zb"))


def trains_under_autocast(precision: str, zero: int, data_ranks: int) -> bool:
    """Whether autopar's runtime trains under ``torch.autocast`` over fp32 parameters: 16-bit training outside
    FSDP (DDP, ZeRO-1, one data-parallel rank); FSDP2 (ZeRO 2/3 over dp × cp > 1) casts through its
    mixed-precision policy instead. What the runtime does on GPUs (`planner.emit.train.autocast`), what a check
    traces under CPU autocast, and which capture prices the plan's activations (`costmodel.memory.autocast_dtype`)."""
    return precision in ("bf16", "fp16") and not (data_ranks > 1 and zero >= 2)


def selective_policy(attention_core, attends=True) -> str:
    """What ``ac=selective`` does to a model's blocks; the cost model (`costmodel.layercost.CostContext.selective`)
    and the runtime (`planner.emit.runtime.apply_ac`) read this one rule.

    - ``attention-core`` where the blocks make seq×seq attention scores (``attention_core`` true or not known) in
      an ``attend(q, k, v)`` method (``attends``: `profiler.layers.has_attend`; the zoo models' protocol): Korthikanti
      et al. 2022 §4.2, Megatron-LM's selective recomputation, which checkpoints its core attention module: each
      ``attend`` runs under torch's checkpoint, which drops the core's saved tensors and recomputes the core in the
      backward; the rest of the block saves what autograd saves.
    - ``all-but-attention-core`` where such a core is not in an ``attend`` method (a Hugging Face model's eager
      attention, a model of the user's): the block runs under torch's selective checkpoint with a policy that
      recomputes the ops reading or making scores and keeps every other op's output, which is more than autograd
      saves (a norm's intermediates, a residual sum's operands: traced, a zoo GPT with unfused attention held
      more so than without checkpointing).
    - ``every-other-matmul`` where the attention is a fused kernel (``attention_core`` False), which leaves no core
      to recompute: torchtitan's per-op policy (``selective_ac_option = "op"``, the default of its Llama 3
      configurations): the attention kernel's output, every second matmul's (the 1st, 3rd, … of a block's forward)
      and reduce-scatters' are kept, every other op is recomputed."""
    if attention_core is False:
        return "every-other-matmul"
    return "all-but-attention-core" if attends is False else "attention-core"


def grad_compress_options(
    dp: int, tp: int, zero: int, schedule: str = "1f1b", pp: int = 1, ep: int = 1
) -> tuple[str, ...]:
    """The gradient compressions (``none``, ``bf16``, ``fp16``, ``powersgd``) the runtime can apply: DDP comm hooks
    (ZeRO 0/1 under DDP) take all; FSDP2 (ZeRO 2/3) reduces in bf16/fp16 through its ``reduce_dtype`` but has no
    PowerSGD; the explicit post-step all-reduces (`post_step_allreduce`; with expert parallelism under DDP, the
    experts' reduction over edp) compress nothing."""
    if dp == 1 or post_step_allreduce(dp, tp, zero, schedule, pp) or (ep > 1 and zero == 0):
        return ("none",)
    if zero >= 2:
        return ("none", "bf16", "fp16")
    return ("none", "bf16", "fp16", "powersgd")


def problems(facts: dict) -> list:
    """Every reason the runtime cannot run ``facts`` as planned (empty when it can), one actionable line each."""
    f = facts
    dp, tp, pp, zero = f["dp"], f["tp"], f["pp"], f["zero"]
    ranks = dp * f.get("cp", 1)  # those reducing gradients together: data- and context-parallel
    schedule = f["schedule"] if pp > 1 else "1f1b"
    out = []
    if f["precision"] == "fp16":
        out.append(
            "precision=fp16 is not supported by the runtime yet (fp16 gradients need loss scaling, which it "
            "does not do; the cost model only predicts it); re-plan with --fix precision=bf16"
        )
    elif f["precision"] not in RUNNABLE_PRECISIONS:
        out.append(
            f"precision={f['precision']} is not supported by the runtime yet (float8 training needs torchao; "
            "the cost model only predicts it); re-plan with --fix precision=bf16"
        )
    if zero == 1 and tp > 1 and ranks > 1:
        out.append(
            "zero=1 with tp>1 is not supported yet (ZeroRedundancyOptimizer takes no DTensor parameters); "
            "re-plan with --fix zero=2 or tp=1"
        )
    if tp > 1 and f.get("tp_split"):  # (`profiler.layers.tp_split_problem`)
        out.append(f"tp={tp} cannot run: {f['tp_split']}")
    if tp > 1 and f.get("tp_unsplit"):
        out.append(
            f"tp={tp} cannot run {f['tp_unsplit']}: a linear beside the column-parallel ones whose name has no "
            "tensor-parallel layout (multi-head latent attention's projections have none yet); re-plan with "
            "--fix tp=1"
        )
    if tp > 1 and (why := (f.get("tp_forward") or {}).get(str(tp))):  # (`profiler.layers.tensor_parallel_problems`)
        out.append(f"tp={tp}: {why}")
    if tp > 1 and f.get("sp") and f.get("sp_layout"):
        out.append(f"sp=on: {f['sp_layout']}")
    for key in ("heads", "kv_heads"):
        if tp > 1 and f.get(key) and f[key] % tp:
            out.append(f"tp={tp} does not divide {key}={f[key]}; choose a tp that divides it")
    if f.get("sp") and tp > 1 and f.get("seq") and f["seq"] % tp:
        out.append(
            f"sequence parallel needs seq={f['seq']} divisible by tp={tp}; re-plan with --fix sp=off or a "
            "tp that divides the sequence"
        )
    if f.get("forward"):  # (`profiler.layers.forward_problem`: "" when the training step can call the model)
        out.append(f["forward"])
    if pp > 1 and f.get("pp_split"):  # (`profiler.layers.pipeline_split_problem`: "" when the model splits)
        out.append(f"pp={pp}: {f['pp_split']}")
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
    policy = selective_policy(f.get("attention_core"), f.get("attends", True))
    if f.get("selective_ac") and f.get("cp", 1) > 1 and policy != "all-but-attention-core":
        out.append(
            f"selective activation checkpointing with cp={f['cp']} is not supported yet where its policy is "
            f"{policy} (it recomputes the context-parallel all-gather of the keys and values, which the cost "
            "model does not price); re-plan with --fix ac=full or cp=1"
        )
    if pp > 1 and schedule == "zb" and (f.get("checkpointed") or f.get("selective_ac")):
        out.append(
            "activation checkpointing with the zero-bubble schedule is not supported (torch 2.13's weight "
            "pass asks autograd once per parameter group, stage_backward_weight: a selective region refuses "
            "the second ask, 'Trying to backward an extra time', and a fully checkpointed block is recomputed "
            "at each, as its non-reentrant checkpoint recomputes per graph task: the check traced 2.5x the "
            "priced FLOPs on the last stage); re-plan with --fix ac=none or schedule=1f1b"
        )
    if pp > 1 and schedule == "zb" and zero >= 3 and ranks > 1:
        out.append(
            "zero=3 with the zero-bubble schedule is not supported yet (torch 2.13 with FSDP2 resharding after "
            "each forward: the last stage's weight gradients are never computed nor reduced, so it trains "
            "wrong; `autopar check` and a 4-rank gloo run against one process both show it); re-plan with "
            "--fix zero=2 or schedule=1f1b"
        )
    if f.get("compile") and tp > 1 and f.get("checkpointed"):
        out.append(
            "torch.compile with tensor parallelism and activation checkpointing is not supported yet (torch "
            "2.13's AOTAutograd fails on a checkpointed block's DTensor inputs: it saves their DeviceMesh for "
            "backward); drop --compile, or re-plan with --fix ac=none or tp=1"
        )
    out += expert_problems(f)
    out += context_problems(f)
    kind = f.get("grad_compress", "none")
    ep = f.get("ep", 1)
    allowed = grad_compress_options(ranks, tp, zero, schedule, pp, ep)
    if kind not in allowed:
        why = (
            "FSDP2 (zero ≥ 2) reduces in bf16/fp16 only"
            if zero >= 2
            else f"with ep={ep} the experts' gradients are all-reduced after the step, where no compression hook "
            "applies (part of the model only would be compressed)"
            if ep > 1 and zero == 0
            else "gradients are all-reduced after the step here (tensor parallel or zero-bubble without FSDP), where "
            "no compression hook applies"
        )
        cp = f" cp={f['cp']}" if f.get("cp", 1) > 1 else ""
        out.append(
            f"grad_compress={kind} cannot run with dp={dp} tp={tp}{cp} zero={zero} schedule={schedule}: {why}; "
            f"choose one of {', '.join(allowed)}"
        )
    return out


def expert_problems(facts: dict) -> list:
    """Why expert parallelism (``ep`` > 1) cannot run as planned: the ep ranks are a sub-group of the dp group,
    each holding E/ep experts (`planner.emit.runtime.apply_ep`)."""
    f = facts
    ep, dp, pp, zero = f.get("ep", 1), f["dp"], f["pp"], f["zero"]
    if ep <= 1:
        return []
    out = []
    if dp % ep:
        out.append(
            f"ep={ep} must divide dp={dp} (expert-parallel ranks are borrowed from the data-parallel group); "
            "re-plan with --fix ep=<a divisor of dp>"
        )
    if "experts" in f and not f["experts"]:
        out.append(
            f"ep={ep} needs a mixture-of-experts model whose experts the runtime can split (a zoo moe: "
            "model); re-plan with --fix ep=1"
        )
    elif f.get("experts") and f["experts"] % ep:
        out.append(
            f"ep={ep} does not divide experts={f['experts']}; re-plan with --fix ep=<a divisor of {f['experts']}>"
        )
    experts, dim1 = f.get("experts") or 0, f.get("expert_dim1")
    edp = dp // ep if dp % ep == 0 else 1
    if zero >= 2 and edp > 1 and experts and experts % ep == 0 and (experts // ep) % edp and dim1 and dim1 % edp:
        out.append(
            f"ep={ep} with zero={zero} and dp={dp}: the {experts // ep} experts a rank holds do not split over "
            f"the {edp} ranks sharing them (dp/ep), nor do their weights' second dimensions (divisible by "
            f"{dim1}), which torch's FSDP2 needs; re-plan with --fix ep=<a divisor of dp with (experts/ep) "
            "divisible by dp/ep>"
        )
    if zero == 1:
        out.append(
            f"ep={ep} with zero=1 is not supported (ZeroRedundancyOptimizer would broadcast one rank's experts "
            "over the whole dp group); re-plan with --fix zero=0, zero=2 or zero=3"
        )
    if pp > 1 and f.get("schedule") == "zb":
        out.append(
            f"ep={ep} with the zero-bubble schedule is not supported yet (its split weight-gradient pass "
            "bypasses the experts' gradient reduction); re-plan with --fix schedule=1f1b"
        )
    if f.get("selective_ac"):
        out.append(
            f"selective activation checkpointing with ep={ep} is not supported yet (torch 2.13's selective "
            "checkpoint cannot replay the autograd all-to-all it saved); re-plan with --fix ac=full or ac=none"
        )
    if f.get("compile"):
        out.append(
            f"torch.compile with ep={ep} is not supported yet (the dropless dispatch's split sizes depend on "
            "the data); drop --compile, or re-plan with --fix ep=1"
        )
    return out


def context_problems(facts: dict) -> list:
    """Why context parallelism (``cp`` > 1) cannot run as planned: each sequence is cut into 2·cp chunks and a cp
    rank holds chunks r and 2·cp − 1 − r, so that every rank does the same share of causal attention
    (`planner.emit.runtime.apply_cp`); its gradients are reduced over dp × cp."""
    f = facts
    cp, tp, seq = f.get("cp", 1), f["tp"], f.get("seq")
    if cp <= 1:
        return []
    out = []
    if f.get("cp_ready") is False:
        out.append(
            f"cp={cp} needs a model whose attention and positions the runtime can split along the sequence "
            "(the zoo llama: and gpt: models; Hugging Face and file.py models not yet); re-plan with --fix "
            "cp=1"
        )
    if seq and seq % (2 * cp):
        out.append(
            f"cp={cp} cuts each sequence into 2·cp = {2 * cp} chunks (two per rank, for balanced causal "
            f"attention), which seq={seq} does not divide into; choose a cp with 2·cp dividing the sequence"
        )
    elif seq and f.get("sp") and tp > 1 and (seq // cp) % tp:
        out.append(
            f"sequence parallel with cp={cp} needs each rank's {seq // cp} tokens divisible by tp={tp}; "
            "re-plan with --fix sp=off or another tp"
        )
    if f["pp"] > 1:
        out.append(
            f"cp={cp} with pipeline parallelism is not supported yet (stages would have to pass each chunk's "
            "positions on); re-plan with --fix pp=1 or cp=1"
        )
    if f.get("ep", 1) > 1:
        out.append(f"cp={cp} with expert parallelism is not supported yet; re-plan with --fix ep=1 or cp=1")
    if f.get("compile"):
        out.append(f"torch.compile with cp={cp} is not supported yet; drop --compile, or re-plan with --fix cp=1")
    return out


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
        errors.append(
            f"LOCAL_WORLD_SIZE={local} processes on this node but it has {torch.cuda.device_count()} "
            f"visible GPUs; start --nproc-per-node {torch.cuda.device_count()} per node (and more nodes)"
        )
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
    # (a PLAN from before ep, or before cp, has none of these)
    facts.update({key: plan[key] for key in ("ep", "experts", "expert_dim1", "cp") if key in plan})
    selective = selective_of(plan)
    return problems(
        {
            **facts,
            "micro_batches": plan["grad_accum"],
            "compile": plan["compile"],
            "checkpointed": bool(plan["ac"]),
            "selective_ac": "selective" in plan["ac"].values(),
            "attention_core": selective != "every-other-matmul",
            "attends": selective != "all-but-attention-core",
        }
    )


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
    shape = (plan["pp"], plan["dp"], plan["tp"])
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "tp"))


def data_parallel_mesh(plan: dict, mesh: DeviceMesh) -> DeviceMesh:
    """The group over which gradients are averaged, ZeRO shards and the loss is averaged: the dp group, or with
    context parallelism the dp × cp ranks (``dp_cp``: each cp rank computes its gradients from its part of every
    sequence, as in torchtitan's FSDP over dp × cp). Batch rows are still split by the dp coordinate only
    (`planner.emit.train.data_rows`)."""
    return batch_mesh(plan, mesh)


def batch_mesh(plan: dict, mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dimension that splits the batch's rows: ``dp``, with expert parallelism the flattened
    (edp, ep) `expert_mesh` made (taken as made: torch 2.13 warns that slicing a flattened dimension from the root
    mesh is deprecated)."""
    return mesh["dp"]


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
        # 2d. The parameters whose gradients each TP rank computes from its share only (summed over tp per step).
        part._autopar_tp_partial = tp_partial_params(part, plan)
        # 3b. torch.compile per block (the script's --compile), after AC and before data parallelism, as torchtitan
        #     does; in place, so parameter and checkpoint names do not change.
        if plan["compile"]:
            for block in block_list(part, plan):
                block.compile(backend=plan["compile"])
        # 5. Data parallel, wrapping what the steps above built: DDP with a comm hook (ZeRO 0, and ZeRO 1 whose
        #    optimizer state `build_optimizer` shards), or FSDP2 for ZeRO 2/3; over dp × cp with context parallelism
        #    (`data_parallel_mesh`), so a plan with dp = 1 and cp > 1 reduces too.
        module = apply_fsdp(part, plan, data_parallel_mesh(plan, mesh))
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


def tied_copies(par: Parallel, tie: dict) -> list:
    """The distinct parameters on this rank that hold a copy of the tied weight ``tie`` (none on middle stages)."""
    copies = {}
    for part in par.parts:
        for name in tie["names"]:
            p = _local_parameter(part, name)
            if p is not None:
                copies.setdefault(id(p), p)
    return list(copies.values())


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


def attention_modules(part: nn.Module) -> list:
    """The modules whose attention core `apply_cp` replaces: those with an ``attend(q, k, v)`` method (the zoo
    models' protocol, `profiler.layers.context_parallel_ready`)."""
    return [m for m in part.modules() if callable(getattr(m, "attend", None))]


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


def selective_of(plan: dict, block: nn.Module | None = None) -> str:
    """The plan's selective-checkpointing policy (`costmodel.runnable.selective_policy`). A plan from before the
    field ran its blocks under torch's selective checkpoint recomputing the attention core: so again
    (``all-but-attention-core``), but where ``block`` computes its core in attend methods and the sequence is whole,
    which checkpoints those (``attention-core``)."""
    if plan.get("selective"):
        return plan["selective"]
    whole = plan.get("cp", 1) == 1 and block is not None and attention_modules(block)
    return "attention-core" if whole else "all-but-attention-core"


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


def tp_partial_params(part: nn.Module, plan: dict) -> list:
    """``(module, name)`` of the parameters of this part's tensor-parallel blocks whose gradient on one TP rank
    covers only that rank's share of the work, so that their sum over the TP group is the gradient: the plain
    parameters (not DTensors after `apply_tp`) inside the modules split by heads (``sp_gather``: Qwen3's, OLMo2's
    and Gemma 3's per-head q/k norms run on this rank's heads) and, under sequence parallelism, the plain
    parameters anywhere else in the block (a mixture-of-experts feed-forward's router and experts run on this
    rank's slice of the sequence). The norms sequence parallelism runs on the slice are DTensors, which torch's
    ``SequenceParallel`` reduces itself. Megatron-LM sums such gradients once per step (``finalize_model_grads``):
    `reduce_tp_partial_grads`. Taken after `apply_tp` and `apply_ep`, before data parallelism swaps parameters."""
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
            if (
                isinstance(g, DTensor)
                and any(pl.is_partial() for pl in g.placements)
                and all(type(pl) is Partial and pl.reduce_op == "sum" for pl in g.placements if pl.is_partial())
            ):
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


def _local_parameter(part: nn.Module, name: str):
    """``part``'s parameter under its original name, or None where the module holding it was split off."""
    module = part
    *path, leaf = name.split(".")
    for attr in path:
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module._parameters.get(leaf)


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, tp_mesh: DeviceMesh, vocab: int) -> torch.Tensor:
    """`lm_loss` when ``logits`` is this rank's slice of a ``vocab``-wide vocabulary (`apply_vocab_parallel`): torch's
    ``loss_parallel`` cross-entropy over the slices, whose backward must run inside that context too (`loss_context`,
    which `planner.emit.train.train_step_loss` holds for the whole step). The loss is returned as a tensor of its
    own, not the view ``to_local`` gives: torch 2.13's zero-bubble schedule detaches the last stage's loss in place
    after its input pass (``stage_backward_input``), which a view refuses."""
    shape = (*logits.shape[:-1], vocab)
    stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    logits = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape, stride=stride)
    return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1)).to_local().clone()


def loss_function(plan: dict, mesh: DeviceMesh):
    """``(logits, labels) → loss`` for this plan: on vocabulary slices when the head is split."""
    return partial(vocab_parallel_loss, tp_mesh=mesh["tp"], vocab=plan["vocab"])


def loss_context(plan: dict):
    """The context a training step's forward and backward run in: torch's ``loss_parallel`` when the loss works on
    vocabulary slices."""
    return loss_parallel()


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
    groups = [
        {"params": ps, "weight_decay": plan["weight_decay"] if matrix else 0.0}
        for (matrix, _), ps in sorted(by_key.items(), key=lambda kv: not kv[0][0])
    ]
    cls = torch.optim.SGD if plan["optimizer"] == "sgd" else torch.optim.AdamW
    # AdamW runs fused: one pass over weight, gradient and moments per parameter group, the memory traffic the cost
    # model prices (`costmodel.overlap.optimizer_time`). torch's default is not fused: per tensor on CPU, foreach on
    # CUDA, each ~8 passes (decay, lerp, mul, addcmul, sqrt, div, add, addcdiv: `torch.optim.adam`). One CPU thread,
    # 3.5 M fp32 parameters in 39 tensors: per tensor 20.8 ms, foreach 13.0 ms, fused 4.4 ms (24 bytes per parameter
    # at the measured copy bandwidth; the cost model's 28)
    kw = {"lr": plan["lr"]} if cls is torch.optim.SGD else {"lr": plan["lr"], "fused": True}
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
                grad = p.grad = grad.redistribute(
                    grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements]
                )
            if isinstance(grad, DTensor):
                # every placement left but Replicate splits the tensor (Shard, and FSDP's _StridedShard over TP,
                # which torch 2.13 does not count as is_shard())
                shards = math.prod(
                    grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate()
                )
                grad = grad.to_local()
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


def train_step(
    par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor | None, labels: torch.Tensor | None
) -> float:
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


def train_step_loss(
    par: Parallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor | None, labels: torch.Tensor | None
) -> torch.Tensor:
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
            raise ValueError(
                f"a batch of {inputs.shape[0]} rows: pass the global batch ({plan['global_batch']} "
                f"rows) or this data-parallel rank's rows of it ({plan['global_batch'] // plan['dp']})"
            )
        x, y = inputs.to(device), labels.to(device)
    optimizer.zero_grad(set_to_none=not zeroes_grads_in_place(par))
    with loss_context(plan):
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
    reduce_tp_partial_grads(par)
    par.grad_norm = clip_grad_norm(par, plan["clip_norm"])
    optimizer.step()
    total = local.reshape(1).clone()
    # each rank's loss is the mean over its tokens, and every data-parallel (and context-parallel) rank holds as
    # many: their mean is the global batch's mean
    dist.all_reduce(total, group=data_parallel_mesh(plan, par.mesh).get_group())
    return total[0] / (plan["dp"] * plan["cp"])


def _accumulate(
    module: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, n: int, last: bool, keep_gathered: bool = False
) -> torch.Tensor:
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


def synthetic_batch(
    step: int, *, batch: int, seq: int, vocab: int, seed: int, rows: slice = slice(None)
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return (
        f"step {step} loss {loss:.5f} grad norm {norm:.4g} lr {lr:.3g} {tokens_per_s:,.0f} tokens/s{mfu} "
        f"time {seconds * 1e3:.1f} ms peak memory {peak:.0f} MiB"
    )


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
            out[canonical.get(name, name)] = value.detach().cpu().clone()
    return out


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
            state[f"model.{name}"] = p
    for group in local.param_groups:
        for p in group["params"]:
            if isinstance(local, torch.optim.AdamW) and not local.state[p]:  # as `Adam._init_group` makes it
                fused = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
                local.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for key, value in local.state[p].items():
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
    done = (
        sorted(
            d
            for d in os.listdir(directory)
            if d.startswith("step-") and os.path.exists(os.path.join(directory, d, ".metadata"))
        )
        if os.path.isdir(directory)
        else []
    )
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
            raise ValueError(
                f"{path}: expected a 1-D array of token ids (uint16/uint32/int32/int64), got "
                f"{header['descr']} of shape {header['shape']}"
            )
        dtype, offset = types[header["descr"]], 8 + width + size
    kind = getattr(torch, dtype)
    with warnings.catch_warnings():  # read-only map: the tensor is never written
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=kind, count=(len(buf) - offset) // kind.itemsize, offset=offset)


def token_file_batch(
    path: str, step: int, rows: slice, *, batch: int, seq: int, dtype: str = "uint16"
) -> tuple[torch.Tensor, torch.Tensor]:
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


# --- Data and training loop ---


DATA = None  # a token file (--data): 1-D .npy, or raw token ids of DATA_DTYPE (nanoGPT's .bin); None: synthetic
DATA_DTYPE = "uint16"


def get_batch(step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """>>> YOUR DATA HERE <<< Rows ``rows`` of the global batch of ``step``: (input_ids, labels), each
    [rows, SEQ] int64, with labels[:, t] the token after input_ids[:, t] (-100: ignored).

    Each data-parallel rank asks for its own rows; every rank of one data-parallel replica for the same rows,
    except middle pipeline stages, which read no batch (`feeds_data`). Whole sequences: with context parallelism
    (cp > 1) the training step keeps each rank's part of them.
    """
    if DATA is not None:
        return token_file_batch(DATA, step, rows, batch=PLAN["global_batch"], seq=PLAN["seq"], dtype=DATA_DTYPE)
    return synthetic_batch(step, batch=PLAN["global_batch"], seq=PLAN["seq"], vocab=VOCAB, seed=PLAN["seed"], rows=rows)


def train(
    steps: int = STEPS,
    *,
    checkpoint_dir: str | None = None,
    save_every: int = 0,
    resume: bool = False,
    stop_after: int | None = None,
) -> tuple[Parallel, list[float]]:
    """Apply the plan and train up to optimizer step ``steps``; returns the parallel model and this launch's losses.

    With ``checkpoint_dir``: save every ``save_every`` steps and at the end of the launch; ``resume`` continues from
    its latest checkpoint (model, optimizer, learning-rate schedule, step and so the data position); ``stop_after``
    ends this launch after that many steps (a job's time limit), to be resumed.
    """
    mesh = init_distributed(PLAN)  # checks the launch against the plan before any collective
    par = parallelize(build_model, PLAN, mesh)
    optimizer = build_optimizer(par, PLAN)
    lr_schedule = build_lr_schedule(optimizer, PLAN, steps)  # warm-up, then cosine decay to the last step
    rank = dist.get_rank()
    first = 0
    if resume:
        path = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        if path is None:
            if rank == 0:
                print(f"no checkpoint in {checkpoint_dir}: starting from step 0", flush=True)
        else:
            first = load_checkpoint(path, par, optimizer, lr_schedule)
            if rank == 0:
                print(f"resumed from {path} after step {first - 1}", flush=True)
    last = steps if stop_after is None else min(steps, first + stop_after)
    losses = []
    for step in range(first, last):
        inputs, labels = get_batch(step, data_rows(par)) if feeds_data(par) else (None, None)
        start = time.perf_counter()
        loss = train_step(par, optimizer, inputs, labels)
        elapsed = time.perf_counter() - start
        lr = lr_schedule.get_last_lr()[0]
        lr_schedule.step()
        losses.append(loss)
        if rank == 0:
            print(step_report(par, step, loss, lr, elapsed), flush=True)
        if checkpoint_dir and ((save_every and (step + 1) % save_every == 0) or step + 1 == last):
            save_checkpoint(checkpoint_dir, par, optimizer, lr_schedule, step + 1)
    return par, losses


def main() -> None:
    global DATA, DATA_DTYPE
    parser = argparse.ArgumentParser(description="Train with the plan above (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    parser.add_argument("--lr", type=float, default=PLAN["lr"], help=f"peak learning rate (default {PLAN['lr']})")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear learning-rate warm-up steps (default: a tenth of --steps), then cosine decay to "
        f"{PLAN['min_lr_ratio']} of --lr at the last step",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=PLAN["clip_norm"],
        help=f"clip the global gradient norm to this (0: off; default {PLAN['clip_norm']})",
    )
    parser.add_argument("--data", help="token file: .npy, or raw token ids (see --data-dtype); default synthetic")
    parser.add_argument(
        "--data-dtype",
        default=DATA_DTYPE,
        choices=["uint16", "uint32", "int32", "int64"],
        help=f"element type of a raw token file (default {DATA_DTYPE}, nanoGPT's .bin)",
    )
    parser.add_argument("--checkpoint-dir", help="save checkpoints here (torch.distributed.checkpoint, sharded)")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (and at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--stop-after", type=int, help="end this launch after N steps (resume later with --resume)")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=PLAN["compile"],
        metavar="BACKEND",
        help="torch.compile each block (default backend inductor; the plan prices it when planned "
        "with autopar plan --compile)",
    )
    args = parser.parse_args()
    if args.compile and args.compile not in torch.compiler.list_backends(exclude_tags=()):
        parser.error(
            f"--compile {args.compile}: not a torch.compile backend; choose one of "
            f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}"
        )
    if args.steps < 1 or args.lr <= 0 or args.clip_norm < 0 or (args.warmup_steps or 0) < 0 or args.save_every < 0:
        parser.error("--steps and --lr must be > 0; --warmup-steps, --clip-norm and --save-every ≥ 0")
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        parser.error("--resume and --save-every need --checkpoint-dir")
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    DATA, DATA_DTYPE = args.data, args.data_dtype
    warmup = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    PLAN.update(lr=args.lr, warmup_steps=warmup, clip_norm=args.clip_norm, compile=args.compile)
    train(
        args.steps,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        resume=args.resume,
        stop_after=args.stop_after,
    )
    shutdown()  # (the model went with train's frame)


if __name__ == "__main__":
    main()
