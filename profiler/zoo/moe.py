"""Mixtral-style mixture-of-experts decoder: a Llama block whose feed-forward is a top-k routed set of experts.

Routing: ``gate`` (hidden → experts, no bias), softmax in float32, ``topk``, renormalise the top-k weights. Then one
of two dispatches (``MoEConfig.capacity_factor``):

- **dropless** (``capacity_factor=None``, the default, as torchtitan and Megatron-LM's dropless MoE train): every
  (token, choice) pair is computed. The pairs are sorted by expert (a stable sort, so a segment keeps token order),
  each expert runs on its contiguous segment (split sizes from the per-expert counts: `GroupedExperts` takes the
  sorted rows and the counts), the results are un-permuted and combined with the routing weights. The segment sizes
  depend on the data, so this path needs real tensors;
- **capacity** (a factor given): every expert has C = min(⌈capacity_factor · tokens · top_k / experts⌉, tokens)
  slots; each pair takes the next free slot of its expert, first choices of all tokens before second choices
  (GShard priority), via a cumulative sum of the one-hot assignment; pairs past C are dropped (sent to an overflow
  row that is sliced off). Tokens are scattered with ``index_add`` into an [experts·C, hidden] buffer, the experts
  run as batched matmuls (``torch.bmm``) over [experts, C, hidden], and results are gathered back and combined with
  the routing weights. Shapes never depend on the data.

Static shapes where the counts cannot be known: ``torch.export`` on fake tensors (the profiler's capture) and
`autopar check`'s fake-tensor trace see no values, so on fake, meta or exporting tensors the dropless layer takes
the **balanced** case: every expert gets exactly ⌈tokens · top_k / experts⌉ pairs, i.e. the capacity path with
capacity factor 1 (nothing is dropped when the load is balanced). The captured FLOPs are therefore the dropless
expectation: the router (2·tokens·hidden·experts) plus 3 · 2·tokens·top_k·hidden·ffn for the experts (up to the
rounding of C), with no one-hot einsum. There is no auxiliary load-balancing loss.

Expert parallelism (`planner.emit.runtime.apply_ep`) replaces `GroupedExperts.forward` by one that sends each
segment to the rank holding its expert: the interface it relies on is ``experts(rows sorted by expert, counts)``
with ``counts`` the per-expert segment sizes (None: equal segments, the capacity and balanced cases).

This file imports only torch and the standard library (the code emitter copies it verbatim); ``RMSNorm``,
``rope_cos_sin``, ``apply_rope``, ``Attention`` and ``FeedForward`` are copies of those in ``llama.py`` (a test keeps
them equal).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width."""
    heads: int
    """Query heads; must divide ``hidden``."""
    kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``heads``."""
    ffn: int
    """Inner width of each SwiGLU expert."""
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
    experts: int = 8
    """Number of experts per MoE layer."""
    top_k: int = 2
    """Experts chosen per token."""
    capacity_factor: float | None = None
    """None: dropless routing (every routed pair is computed). A number: slots per expert relative to a perfectly
    balanced load (C = ⌈capacity_factor·tokens·top_k/experts⌉); pairs past C are dropped."""
    dense_layers: int = 0
    """The first blocks with a dense SwiGLU feed-forward instead of experts (DeepSeek-V3's first_k_dense_replace)."""
    dense_ffn: int = 0
    """Inner width of those dense feed-forwards (0: top_k · ffn, the width an MoE block activates per token)."""
    moe_every: int = 1
    """After the ``dense_layers``, every ``moe_every``-th block has experts and the others a dense feed-forward
    (Llama 4's ``interleave_moe_layer_step``: 2 alternates dense and MoE blocks, the MoE one second)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "experts", "top_k"):
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
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0")
        if not 0 <= self.dense_layers < self.layers:
            raise ValueError(f"dense_layers={self.dense_layers} must be in [0, layers={self.layers}): at least one "
                             f"block has experts")
        if self.dense_ffn < 0:
            raise ValueError(f"dense_ffn={self.dense_ffn} must be >= 0 (0: top_k * ffn)")
        if not 1 <= self.moe_every <= self.layers - self.dense_layers:
            raise ValueError(f"moe_every={self.moe_every} must be in [1, layers - dense_layers = "
                             f"{self.layers - self.dense_layers}]: at least one block has experts")

    def is_dense(self, i: int) -> bool:
        """Whether block ``i`` has a dense feed-forward (``dense_layers``, ``moe_every``) rather than experts."""
        return i < self.dense_layers or (i - self.dense_layers) % self.moe_every != self.moe_every - 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ⌈capacity_factor · tokens · top_k / experts⌉, at most ``tokens`` (an expert can receive
    each token at most once), at least 1."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


def dispatch_slots(expert_index: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Buffer row for each routed pair: ``expert·capacity + position``, or ``experts·capacity`` (overflow) if dropped.

    ``expert_index`` is [pairs] in priority order; the position of a pair inside its expert is the number of earlier
    pairs routed to the same expert (cumulative sum of the one-hot assignment), so shapes never depend on data.
    """
    one_hot = (expert_index[:, None] == torch.arange(experts, device=expert_index.device)).long()
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    slot = expert_index * capacity + position
    return torch.where(position < capacity, slot, torch.full_like(slot, experts * capacity))


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


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked weights ([experts, …]), run on rows sorted by expert."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))

    def forward(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """``x`` [rows, hidden], sorted by expert: ``counts[e]`` rows for expert e (a loop of matmuls), or with
        ``counts`` None equal segments (one batched matmul over [experts, rows/experts, hidden])."""
        if counts is None:
            xe = x.view(self.w1.shape[0], -1, x.shape[-1])
            h = F.silu(torch.bmm(xe, self.w1.transpose(1, 2))) * torch.bmm(xe, self.w3.transpose(1, 2))
            return torch.bmm(h, self.w2.transpose(1, 2)).reshape(x.shape[0], -1)
        outs = []
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        return torch.cat(outs)


def values_unknown(x: torch.Tensor) -> bool:
    """Whether ``x`` carries no values to route by: a fake or meta tensor, or ``torch.export`` tracing."""
    return x.is_meta or is_fake(x) or torch.compiler.is_exporting()


class MoEFeedForward(nn.Module):
    """Top-k router (``gate``) plus dropless or capacity-based dispatch to ``experts`` (see the module docstring)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts = config.experts
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.gate = nn.Linear(config.hidden, config.experts, bias=False)
        self.experts = GroupedExperts(config.experts, config.hidden, config.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        xt = x.reshape(b * s, hidden)
        probs = torch.softmax(self.gate(xt).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.capacity_factor is None and not values_unknown(xt):
            out = self.dropless(xt, chosen, weights)
        else:  # a capacity factor, or the balanced case of dropless routing (no values: see the module docstring)
            out = self.with_capacity(xt, chosen, weights, 1.0 if self.capacity_factor is None else self.capacity_factor)
        return out.view(b, s, hidden)

    def dropless(self, xt: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every (token, choice) pair: sorted by expert, each expert on its segment, un-permuted, combined."""
        tokens, hidden = xt.shape
        k = self.top_k
        flat = chosen.reshape(-1)  # pair p is token p // k's choice p % k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = self.experts(xt.index_select(0, order // k), counts)
        pairs = torch.empty_like(out).index_copy(0, order, out)  # back in (token, choice) order
        return (pairs.view(tokens, k, hidden) * weights.unsqueeze(-1).to(xt.dtype)).sum(1)

    def with_capacity(self, xt: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                      capacity_factor: float) -> torch.Tensor:
        """C slots per expert, pairs past them dropped; static shapes (see the module docstring)."""
        tokens, hidden = xt.shape
        experts, k = self.num_experts, self.top_k
        capacity = expert_capacity(tokens, experts, k, capacity_factor)
        # Pairs in choice-major order: every token's first choice takes priority over any second choice.
        slot = dispatch_slots(chosen.t().reshape(-1), experts, capacity)  # [k * tokens]
        buffer = xt.new_zeros(experts * capacity + 1, hidden).index_add(0, slot, xt.repeat(k, 1))
        out = self.experts(buffer[: experts * capacity])
        out = torch.cat([out, out.new_zeros(1, hidden)])  # overflow row = 0
        combined = out.index_select(0, slot) * weights.t().reshape(-1, 1).to(xt.dtype)
        return combined.view(k, tokens, hidden).sum(0)


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then x + moe(norm(x)) (a dense SwiGLU where `MoEConfig.is_dense`)."""

    def __init__(self, config: MoEConfig, dense: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config.hidden, config.heads, config.kv_heads)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward = (FeedForward(config.hidden, config.dense_ffn or config.top_k * config.ffn) if dense
                             else MoEFeedForward(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """Mixtral-style language model; ``forward(input_ids, labels=None)`` returns the mean loss, or logits.

    For manual pipeline splitting, ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` on stages
    that do not own them (then the stage takes/returns hidden states), as in torchtitan.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(TransformerBlock(config, config.is_dense(i)) for i in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for linears, embeddings and experts, N(0, 0.02/√(2l)) for wo and expert w2, unit norms.

        Call after ``model.to_empty(device=...)`` when the model was built on the meta device.
        """
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.config.layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                nn.init.normal_(module.w1, std=std)
                nn.init.normal_(module.w3, std=std)
                nn.init.normal_(module.w2, std=out_std)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=out_std)
            if isinstance(layer.feed_forward, FeedForward):  # a dense block's output projection, as in llama
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
