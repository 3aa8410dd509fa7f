"""Megatron-style GPT (GPT-2/GPT-3 architecture) as a plain ``nn.Module``.

Learned position embeddings, pre-LayerNorm blocks with biases, GELU MLP, dropout after the embeddings, on the
attention probabilities, after the attention output projection and after the MLP, a final LayerNorm and an output
head tied to the token embedding. The parameter count is therefore

    P = 12·l·h² + 13·l·h + V·h + s·h + 2·h = 12·l·h² (1 + 13/(12h) + (V + s)/(12·l·h))   (for ffn = 4h)

which is eq. 2 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), plus the final LayerNorm's 2h.

This file imports only torch and the standard library: the code emitter copies it verbatim into a standalone
training script. Everything here works on the meta device and under ``torch.export.export(..., strict=False)``
(static shapes, no data-dependent control flow). Attention heads are derived from the projection's actual output
width, so a tensor-parallel-sharded ``wq``/``wk``/``wv`` (fewer local heads) works unchanged. For context
parallelism the model reads its tokens' positions from ``GPT.context_positions`` (None: 0..s−1) and computes
attention in ``Attention.attend``, which a runtime may replace (autopar's
``profiler.layers.context_parallel_ready``).
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


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
    """Causal self-attention with separate q/k/v projections (column-parallel friendly) and biases.

    The attention core is `attend`, a method of its own so that a context-parallel runtime can replace it per
    instance (autopar's ``planner.emit.runtime.apply_cp`` gathers the other ranks' keys and values there).
    """

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
        q = q.view(b, s, heads, self.head_dim)
        k = k.view(b, s, heads, self.head_dim)
        v = v.view(b, s, heads, self.head_dim)
        out = self.attend(q, k, v).reshape(b, s, heads * self.head_dim)
        return self.resid_dropout(self.wo(out))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q``, ``k``, ``v`` [b, s, heads, head_dim], with dropout ``self.dropout`` on the
        probabilities while training; returns [b, s, heads, head_dim]."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            out = self._math_attention(q, k, v)
        return out.transpose(1, 2)

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

    context_positions: torch.Tensor | None = None
    """The global positions (a 1-D integer tensor, one per input token) of the tokens this model sees, for the
    position embedding; None: 0..s−1. A context-parallel runtime (autopar's ``planner.emit.runtime.apply_cp``) sets
    it on each rank to the positions of the part of the sequence that rank holds, on the device it computes on."""

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
            positions = self.context_positions
            if positions is None:
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
