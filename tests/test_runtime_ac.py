"""Activation checkpointing as the runtime applies it changes no gradient, with dropout on."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.emit import runtime
from profiler.zoo.registry import resolve_model


class CountOps(TorchDispatchMode):
    """How many times each op runs inside the mode: ``ops[op overload]``."""

    def __init__(self):
        super().__init__()
        self.ops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] = self.ops.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> int:
        """Runs of the ops of packet ``name`` (``baddbmm``: every overload of it)."""
        return sum(n for op, n in self.ops.items() if op.overloadpacket.__name__ == name)

    def fused(self) -> int:
        """Runs of torch's fused attention kernels (`runtime._FUSED_ATTENTION`)."""
        return sum(n for op, n in self.ops.items() if op in runtime._FUSED_ATTENTION)


def _selective_step(attention: str, policy: str):
    """A 2-block GPT (``attention``) under selective checkpointing ``policy``, and the ops of one forward and of
    its backward (`CountOps`)."""
    model, _ = resolve_model(f"gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,attention={attention},dropout=0") \
        .build(batch=2, device="cpu")
    model._autopar_block_names = ["layers.0", "layers.1"]
    runtime.apply_ac(model, {"block_container": "layers", "ac": {"layers.0": "selective", "layers.1": "selective"},
                             "selective": policy, "mbs": 2, "seq": 32})
    x, y = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    with CountOps() as forward:
        loss = model(x, y)
    with CountOps() as backward:
        loss.backward()
    return model, forward, backward


@pytest.mark.parametrize("spec", ["gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,attention=math,dropout=0.1",
                                  "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,attention=sdpa,dropout=0.1",
                                  "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,seq=32,vocab=128"])
def test_full_and_selective_checkpointing_match_no_checkpointing(spec):
    """Same seed, dropout 0.1 where the model has it: `full` (whole block), `selective` under each policy (the
    attention core, Korthikanti et al. 2022, as Megatron-LM checkpoints it, its ``attend`` call, or as a per-op
    policy over the block; every op but the attention kernel and the odd matmuls, torchtitan's) recompute with the
    preserved RNG state, so loss and every gradient equal the plain run exactly, over two micro-batches (the per-op
    policy counts each call's matmuls afresh)."""
    torch.manual_seed(0)
    model, _ = resolve_model(spec).build(batch=2, device="cpu")
    x, y = torch.randint(0, 128, (2, 2, 32)), torch.randint(0, 128, (2, 2, 32))
    results = {}
    for mode, policy in (("none", None), ("full", None), ("selective", "attention-core"),
                         ("selective", "all-but-attention-core"), ("selective", "every-other-matmul")):
        m = copy.deepcopy(model).train()
        m._autopar_block_names = ["layers.0", "layers.1"]
        runtime.apply_ac(m, {"block_container": "layers", "ac": {"layers.0": mode, "layers.1": mode},
                             "selective": policy, "mbs": 2, "seq": 32})
        torch.manual_seed(123)
        losses = []
        for micro in range(2):
            loss = m(x[micro], y[micro])
            loss.backward()
            losses.append(loss.item())
        results[mode, policy] = (losses, torch.cat([p.grad.flatten() for p in m.parameters()]))
    for key, (losses, grads) in results.items():
        assert losses == results["none", None][0], key
        torch.testing.assert_close(grads, results["none", None][1], rtol=0, atol=0)


def test_the_per_op_policy_keeps_the_odd_matmuls_of_each_call():
    """`runtime._op_policy` (torchtitan's per-op selective AC) keeps the 1st, 3rd, … matmul of a block's forward, the
    attention kernel and reduce-scatters, and recomputes the rest. torch 2.13 asks it in the forward only; earlier
    releases ask again in the recomputation, which must decide alike (its own count: a block of 7 matmuls would
    otherwise flip parity, as torch 2.11 on CUDA showed). A matmul reading attention scores (SDPA's math path on
    CPU) belongs to the attention: recomputed and not counted, as the capture costs the attention as one kernel."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    x, w, scores = torch.zeros(64, 8), torch.zeros(8, 8), torch.zeros(2, 4, 32, 32)
    mm, add, sdpa = (torch.ops.aten.mm.default, torch.ops.aten.add.Tensor,
                     torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    rs = torch.ops._c10d_functional.reduce_scatter_tensor.default
    calls = [(mm, (x, w)), (add, (x, x)), (mm, (x, w)), (sdpa, (scores, scores, scores)), (mm, (x, w)),
             (torch.ops.aten.bmm.default, (torch.zeros(8, 32, 32), torch.zeros(8, 32, 4))), (rs, (x, "sum", 2, "g")),
             (mm, (x, w))]
    want = [save, recompute, recompute, save, save, recompute, save, recompute]
    policy = runtime._op_policy(2, 32)
    forward = [policy(SelectiveCheckpointContext(is_recompute=False), op, *args) for op, args in calls]
    again = [policy(SelectiveCheckpointContext(is_recompute=True), op, *args) for op, args in calls]
    assert forward == again == want
    assert [runtime._op_policy(2, 32)(SelectiveCheckpointContext(is_recompute=False), mm, x, w)
            for _ in range(2)] == [save, save]  # a fresh policy per call of a block


def test_selective_checkpointing_keeps_a_fused_attention_kernel():
    """A fused attention kernel makes no seq×seq tensor: selective AC keeps its outputs (as the cost model reads it,
    `profiler.graph.NodeInfo.is_attention_core`), though torch 2.13 tags it ``nondeterministic_seeded``; the backward
    runs it no second time."""
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in runtime._FUSED_ATTENTION
    _, forward, backward = _selective_step("sdpa", "all-but-attention-core")
    assert (forward.fused(), backward.fused()) == (2, 0)


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


@pytest.mark.parametrize("policy", ["every-other-matmul", "all-but-attention-core"])
def test_an_in_place_write_into_a_kept_output_is_refused(policy):
    """torch serves a kept output back after checking its version, but a write through a view with a version counter
    of its own (``linear`` on a 3-D input returns ``_unsafe_view(mm(…))``) escapes that check: the backward would
    read the written values (gradients 3.2 off in a reviewer's reproduction). The runtime refuses it, one line
    naming the op and the fix; the same block written out of place trains."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, in_place: bool):
            super().__init__()
            self.a, self.b, self.in_place = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False), in_place

        def forward(self, x):
            h = self.a(x)
            h = h.mul_(2) if self.in_place else h * 2
            return self.b(torch.tanh(h))

    class Model(nn.Module):
        def __init__(self, in_place: bool):
            super().__init__()
            self.layers = nn.ModuleList([Block(in_place)])

        def forward(self, x):
            return self.layers[0](x).sum()

    x = torch.randn(2, 8, 16)
    for in_place in (True, False):
        torch.manual_seed(0)
        m = Model(in_place)
        m._autopar_block_names = ["layers.0"]
        runtime.apply_ac(m, {"block_container": "layers", "ac": {"layers.0": "selective"}, "selective": policy,
                             "mbs": 2, "seq": 8})
        if in_place:
            with pytest.raises(RuntimeError, match=r"changes in place \(aten.mul_.Tensor\).*ac=full or ac=none"):
                m(x)
            continue
        m(x).backward()
        plain = Model(False)
        plain.load_state_dict(m.state_dict())
        plain(x).backward()
        torch.testing.assert_close(m.layers[0].a.weight.grad, plain.layers[0].a.weight.grad, rtol=0, atol=0)


def test_the_attention_core_policy_recomputes_the_attend_call_only():
    """``attention-core`` checkpoints each attention's ``attend`` (Megatron-LM's checkpointed core attention): in
    the backward the core's ops run again (QKᵀ, softmax, ·V) and nothing else of the block does, so the block saves
    what autograd saves but the core's seq×seq tensors, as the cost model prices it (`costmodel.layercost`). A block
    with no ``attend`` method cannot run it: one line, before any step."""
    from torch import nn

    model, forward, backward = _selective_step("math", "attention-core")
    assert forward.named("baddbmm") == forward.named("_softmax") == 2
    assert (backward.named("baddbmm"), backward.named("_softmax")) == (2, 2)  # the cores, once more each
    assert backward.named("native_layer_norm") == backward.named("gelu") == 0  # the rest, not at all
    # a deep copy calls its own modules, and wrapping again wraps nothing twice
    twin = copy.deepcopy(model)
    runtime.apply_ac(twin, {"block_container": "layers", "ac": {"layers.0": "selective"},
                            "selective": "attention-core", "mbs": 2, "seq": 32})
    attention = twin.layers[0].attention
    assert attention.attend.func is runtime._checkpointed_attend and attention.attend.args == (attention,)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    plain = Plain()
    plain._autopar_block_names = ["layers.0"]
    with pytest.raises(ValueError, match="no attention module with an attend"):
        runtime.apply_ac(plain, {"block_container": "layers", "ac": {"layers.0": "selective"},
                                 "selective": "attention-core", "mbs": 2, "seq": 4})
