"""A model of a user's own whose attention is unfused and inline, not in an ``attend(q, k, v)`` method: selective
activation checkpointing runs the ``all-but-attention-core`` policy on it (`costmodel.runnable.selective_policy`).
Pre-norm GPT blocks with biases; tensor- and sequence-parallel ready (the shapes are read from the projections,
which see the whole sequence)."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        b, s, heads = q.shape[0], q.shape[1], q.shape[-1] // self.head_dim  # (this rank's heads under TP)
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        return self.wo(attn.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(h)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class UnfusedLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        """Fill every parameter in place (after sharding: ``init=meta``)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if self.embed is not None else input_ids
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is None:
            return x
        logits = self.lm_head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def factory(batch: int = 1, seq: int = 128):
    """3 blocks, width 256, 4 heads, 2048 words."""
    model = UnfusedLM(vocab=2048, dim=256, heads=4, layers=3)
    return model, (torch.randint(0, 2048, (batch, seq)), torch.randint(0, 2048, (batch, seq)))
