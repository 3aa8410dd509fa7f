"""Activation checkpointing as the runtime applies it changes no gradient, with dropout on."""

from __future__ import annotations

import copy

import pytest
import torch

from planner.emit import runtime
from profiler.zoo.registry import resolve_model


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_full_and_selective_checkpointing_match_no_checkpointing(attention):
    """Same seed, dropout 0.1: `full` (whole block) and `selective` (the seq×seq attention core, Korthikanti et
    al. 2022) recompute with the preserved RNG state, so loss and every gradient equal the plain run exactly."""
    torch.manual_seed(0)
    model, _ = resolve_model(f"gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,attention={attention},dropout=0.1") \
        .build(batch=2, device="cpu")
    x, y = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    results = {}
    for mode in ("none", "full", "selective"):
        m = copy.deepcopy(model).train()
        m._autopar_block_names = ["layers.0", "layers.1"]
        runtime.apply_ac(m, {"block_container": "layers", "ac": {"layers.0": mode, "layers.1": mode},
                             "mbs": 2, "seq": 32})
        torch.manual_seed(123)
        loss = m(x, y)
        loss.backward()
        results[mode] = (loss.item(), torch.cat([p.grad.flatten() for p in m.parameters()]))
    for mode in ("full", "selective"):
        assert results[mode][0] == results["none"][0]
        torch.testing.assert_close(results[mode][1], results["none"][1], rtol=0, atol=0)


def test_selective_checkpointing_keeps_a_fused_attention_kernel():
    """A fused attention kernel makes no seq×seq tensor: selective AC keeps its outputs (as the cost model reads it,
    `profiler.graph.NodeInfo.is_attention_core`), though torch 2.13 tags it ``nondeterministic_seeded``; the backward
    runs it no second time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fused = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.fused += func in runtime._FUSED_ATTENTION
            return func(*args, **(kwargs or {}))

    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in runtime._FUSED_ATTENTION
    model, _ = resolve_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,attention=sdpa,dropout=0") \
        .build(batch=2, device="cpu")
    model._autopar_block_names = ["layers.0", "layers.1"]
    runtime.apply_ac(model, {"block_container": "layers", "ac": {"layers.0": "selective", "layers.1": "selective"},
                             "mbs": 2, "seq": 32})
    x, y = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    with Count() as forward:
        loss = model(x, y)
    with Count() as backward:
        loss.backward()
    assert (forward.fused, backward.fused) == (2, 0)


def test_a_fused_attention_with_dropout_is_recomputed():
    """A kept kernel is not run again in the recomputation, which replays the block's random draws from its start:
    one that draws dropout would shift every later draw (torch/utils/checkpoint.py), so only dropout-free fused
    kernels are kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    policy = runtime._selective_policy(2, 32)
    q = torch.zeros(2, 4, 32, 16)
    for op, args in ((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q)),
                     (torch.ops.aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True))):
        assert policy(None, op, *args) == CheckpointPolicy.MUST_SAVE
        assert policy(None, op, *args, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(None, op, *args, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
