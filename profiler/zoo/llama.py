"""Llama 2/3-style decoder as a plain ``nn.Module``: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.

Follows Meta's reference implementation and torchtitan's ``llama3`` model (module names ``tok_embeddings``,
``layers.N.attention.{wq,wk,wv,wo}``, ``layers.N.feed_forward.{w1,w2,w3}``, ``norm``, ``output``), except that
RoPE uses the real-valued "rotate half" form and its cos/sin tables are computed in ``forward`` from the input's
static length and device, so the model has no buffers: it builds and exports on the meta device and survives
``to_empty()`` unchanged.

This file imports only torch and the standard library: the code emitter copies it verbatim into a standalone
training script. Heads are derived from each projection's actual output width, so tensor-parallel-sharded
``wq``/``wk``/``wv`` (fewer local heads) work unchanged. For context parallelism the model reads its tokens'
positions from ``Llama.context_positions`` (None: 0..s−1) and computes attention in ``Attention.attend``, which a
runtime may replace (autopar's ``profiler.layers.context_parallel_ready``); left alone, the computation is the
plain one.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
        cos, sin = rope_cos_sin(h.shape[1], self.config.head_dim, self.config.rope_theta, h.device, h.dtype,
                                self.context_positions)
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
