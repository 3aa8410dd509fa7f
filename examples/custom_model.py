"""A model of your own for autopar: ``autopar profile examples/custom_model.py:factory``, ``autopar plan
examples/custom_model.py:factory --cluster cpu-local --global-batch 8 --emit train.py``.

autopar calls ``factory(batch=…, seq=…)`` (each keyword only if the factory takes it) under the meta device, so
the model costs no memory however large it is, and captures ``model(*example_inputs)`` with ``torch.export``. Four
rules make a model capturable and trainable:

- ``forward(input_ids, labels=None)`` returns the scalar training loss when given labels (what the capture
  costs) and the logits [batch, seq, vocab] when not (what the emitted training step calls, taking the cross
  entropy itself: labels[:, t] is the token after input_ids[:, t]);
- no Python ``if`` looks at a tensor's *values* (shapes are fine; use ``torch.where`` for value-dependent choices);
- shapes inside a block come from the tensors, not from the model's settings, where tensor parallelism splits
  them: a rank holds a slice of the heads (``view(b, s, -1, head_dim)``), or autopar plans it without (it runs
  the forward with the linears split to check; it also needs the attention's and MLP's linears in submodules of
  their own for sequence parallelism, which this small model does not do);
- the repeated blocks sit in an ``nn.ModuleList`` attribute of the model: autopar groups the graph into embed, one
  layer per block, and head. For pipeline parallelism each stage is this model with the blocks it does not hold
  removed and the modules before or after them set to None, so ``forward`` skips a None embedding (its input is
  then the previous stage's hidden states) and a None norm or head (it returns the hidden states).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block: causal self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attention_norm(x)
        # (-1 heads: a tensor-parallel rank holds a slice of them, the projections' output rows)
        q, k, v = (w(h).view(b, s, -1, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class TinyLM(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and an untied output projection."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if self.embed is not None else input_ids  # (a later pipeline stage: hidden states)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is None:  # (an earlier pipeline stage)
            return x
        logits = self.lm_head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def factory(batch: int = 1, seq: int = 64):
    """The model and its example inputs ``(input_ids, labels)``, each (batch, seq) token ids."""
    model = TinyLM()
    input_ids = torch.randint(0, 256, (batch, seq))
    labels = torch.randint(0, 256, (batch, seq))
    return model, (input_ids, labels)
