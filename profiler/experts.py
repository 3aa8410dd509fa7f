"""Which modules expert parallelism can split: one rule for the capture (the arch fact ``ep_experts``, which the
search's `costmodel.runnable` check reads), the emitter (`planner.emit.config`) and so the runtime
(`planner.emit.runtime.apply_ep`).

An expert module holds stacked expert weights (every direct parameter has the number of experts E first; at least
one is a matrix per expert, [E, …, …]; biases [E, …] may ride along) and has one of two interfaces:

- ``counts``: ``forward(rows sorted by expert, counts)`` → each row through its expert (the zoo MoE's
  ``GroupedExperts``, `profiler.zoo.moe`);
- ``top_k``: ``forward(hidden_states, top_k_index, top_k_weights)`` → the routing-weighted sum over each token's
  experts (Hugging Face transformers' experts classes: Mixtral, Qwen2/3-MoE, DeepSeek-V3, …).

Everything else (a router, shared experts, a dense feed-forward) is an ordinary module, replicated like any other.
"""

from __future__ import annotations

import inspect
import math

from torch import nn

INTERFACES = {"counts": ("counts",), "top_k": ("top_k_index", "top_k_weights")}


def _interface(module: nn.Module) -> str | None:
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    for kind, needed in INTERFACES.items():
        if all(n in names for n in needed):
            return kind
    return None


def expert_modules(blocks) -> dict:
    """The expert modules of ``blocks`` (an iterable of blocks, or one module): ``{"experts": E (0: none),
    "ep_modules": [names relative to a block, in any block], "ep_interface": "counts" | "top_k" | None,
    "expert_dim1": the greatest common divisor of their weights' second dimensions (how FSDP may split them along
    it, `planner.emit.runtime.apply_fsdp_experts`)}``.
    A model whose expert modules disagree (numbers of experts, interfaces) cannot be split: ValueError."""
    if isinstance(blocks, nn.Module):
        blocks = [blocks]
    names, sizes, kinds = [], set(), set()
    dim1 = 0
    for block in blocks:
        for name, module in block.named_modules():
            params = list(module.parameters(recurse=False))
            if not name or not params or not any(p.dim() == 3 for p in params):
                continue
            lead = {p.shape[0] for p in params}
            kind = _interface(module)
            if len(lead) != 1 or lead == {1} or kind is None:
                continue
            if name not in names:
                names.append(name)
            sizes |= lead
            kinds.add(kind)
            for p in params:  # (a vector [E] cannot be split along a second dimension: 1)
                dim1 = math.gcd(dim1, p.shape[1] if p.dim() >= 2 else 1)
    if len(sizes) > 1 or len(kinds) > 1:
        raise ValueError(f"expert modules {names} hold different numbers of experts {sorted(sizes)} or interfaces "
                         f"{sorted(kinds)}; expert parallelism cannot split them: plan with --fix ep=1")
    return {"experts": sizes.pop() if sizes else 0, "ep_modules": names,
            "ep_interface": kinds.pop() if kinds else None, "expert_dim1": dim1}
