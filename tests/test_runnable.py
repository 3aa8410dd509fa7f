"""One rule set for what can run (costmodel.runnable): each rule, and that the search, the emitter and the runtime
all apply it: every plan the search offers emits, and the dominances only prune where the dominator can run."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from costmodel.cluster import load_cluster
from costmodel.config import ParallelConfig
from costmodel.runnable import (
    checkpoint_modes,
    grad_compress_options,
    post_step_allreduce,
    problems,
    selective_policy,
)
from planner.emit.config import runtime_config
from planner.emit.runtime import plan_problems
from planner.search.outer import NoPlanFits, candidates, make_plan, search
from profiler.api import profile_model
from profiler.zoo.registry import resolve_model

BASE = {"dp": 2, "tp": 1, "pp": 1, "vpp": 1, "schedule": "1f1b", "zero": 0, "sp": False, "grad_compress": "none",
        "precision": "bf16", "micro_batches": 4, "seq": 32}


def facts(**change) -> dict:
    return {**BASE, **change}


def test_each_rule_names_the_fix():
    assert problems(facts()) == []
    cases = {
        "precision=fp8": facts(precision="fp8"),
        "precision=fp16 is not supported by the runtime yet (fp16 gradients need loss scaling": facts(
            precision="fp16"),  # one rule for the search, the emitter and the runtime (issue 13)
        "zero=1 with tp>1": facts(tp=2, zero=1),
        "zero=3 with the zero-bubble schedule": facts(pp=2, dp=2, zero=3, schedule="zb"),
        # its weight pass recomputes a fully checkpointed block once per parameter group (traced 2.5x the FLOPs)
        "activation checkpointing with the zero-bubble schedule": facts(pp=2, schedule="zb", checkpointed=True),
        "tp=2 cannot run layers.0.attn.kv_b_proj": facts(tp=2, tp_unsplit="layers.0.attn.kv_b_proj"),
        "tp=2 cannot run: block h.0 holds no pair": facts(tp=2, tp_split="block h.0 holds no pair …; re-plan with "
                                                                    "--fix tp=1"),
        "does not divide heads=6": facts(tp=4, heads=6),
        "sequence parallel needs seq=30": facts(tp=4, sp=True, seq=30),
        "needs at least 4 micro-batches": facts(pp=4, micro_batches=2),
        "5 micro-batches per step in 2 equal rounds": facts(pp=2, vpp=2, schedule="interleaved", micro_batches=5),
        "grad_compress=powersgd cannot run": facts(zero=2, grad_compress="powersgd"),
        "torch.compile with tensor parallelism and activation checkpointing": facts(
            tp=2, compile="inductor", checkpointed=True),  # measured on gloo: AOTAutograd saves a DeviceMesh
    }
    for needle, f in cases.items():
        found = problems(f)
        assert len(found) == 1 and needle in found[0], (needle, found)
        assert "\n" not in found[0] and ("re-plan" in found[0] or "choose" in found[0] or "change" in found[0]
                                         or "raise" in found[0])
    assert problems(facts(tp=2, compile="inductor")) == problems(facts(compile="inductor", checkpointed=True)) == []
    # torch 2.13's rounds rule, not "a multiple of pp": m = 3 < 2·2 runs in one round, m = 6 in three rounds of 2
    assert problems(facts(pp=2, vpp=2, schedule="interleaved", micro_batches=3)) == []
    assert problems(facts(pp=2, schedule="zb", micro_batches=6)) == []
    assert problems(facts(pp=4, schedule="zb", micro_batches=9)) != []


def test_gradient_reduction_mechanism():
    # DDP hooks only where torch lets them fire: not for DTensor parameters, not for zero-bubble weight gradients
    assert not post_step_allreduce(2, 1, 0, "1f1b", 2)
    assert post_step_allreduce(2, 1, 0, "zb", 2) and post_step_allreduce(2, 1, 1, "zb", 2)
    assert post_step_allreduce(2, 2, 0, "1f1b", 1)
    assert not post_step_allreduce(2, 1, 2, "zb", 2) and not post_step_allreduce(1, 1, 0, "zb", 2)
    assert grad_compress_options(2, 1, 0) == ("none", "bf16", "fp16", "powersgd")
    assert grad_compress_options(2, 1, 3) == ("none", "bf16", "fp16")
    assert grad_compress_options(2, 2, 0) == ("none",) == grad_compress_options(2, 1, 0, "zb", 2)
    assert problems(facts(tp=2, grad_compress="bf16")) and problems(facts(pp=2, schedule="zb", grad_compress="bf16"))


def test_expert_parallel_rules():
    """What the runtime's expert parallelism (`planner.emit.runtime.apply_ep`) cannot run, one line each; the
    search's candidates and the ILP's compressions obey the same rules."""
    assert problems(facts(ep=2, experts=4)) == problems(facts(dp=4, ep=2, experts=8, zero=3)) == []
    assert problems(facts(dp=2, tp=2, ep=2, experts=4, zero=2, sp=True)) == []  # (experts whole on TP ranks)
    cases = {
        "ep=4 must divide dp=2": facts(ep=4, experts=8),
        "needs a mixture-of-experts model whose experts the runtime can split": facts(ep=2, experts=0),
        "ep=2 does not divide experts=3": facts(ep=2, experts=3),
        "ep=2 with zero=1": facts(ep=2, experts=4, zero=1),
        "zero-bubble": facts(pp=2, schedule="zb", ep=2, experts=4),
        "selective activation checkpointing with ep=2": facts(ep=2, experts=4, selective_ac=True),
        "torch.compile with ep=2": facts(ep=2, experts=4, compile="inductor"),
        "experts' gradients are all-reduced after the step": facts(ep=2, experts=4, grad_compress="bf16"),
    }
    for needle, f in cases.items():
        found = problems(f)
        assert len(found) == 1 and needle in found[0], (needle, found)
        assert "\n" not in found[0] and ("re-plan" in found[0] or "choose" in found[0] or "drop" in found[0])
    # the AC modes the ILP is offered are those `problems` lets through
    for tp, ep, compiled, zb, mode in itertools.product((1, 2), (1, 2), (False, True), (False, True),
                                                        ("none", "selective", "full")):
        f = facts(**{"dp": 4, "tp": tp, "ep": ep, "experts": 4, "compile": "inductor" if compiled else None,
                     "checkpointed": mode != "none", "selective_ac": mode == "selective"}
                  | ({"pp": 2, "schedule": "zb", "dp": 2} if zb else {}))
        ac_rules = [p for p in problems(f) if "checkpoint" in p]
        assert (mode in checkpoint_modes(tp, ep, compiled, zb)) == (not ac_rules), (tp, ep, compiled, zb, mode,
                                                                                     ac_rules)
    assert grad_compress_options(2, 1, 0, ep=2) == ("none",)
    assert grad_compress_options(4, 1, 3, ep=2) == ("none", "bf16", "fp16")
    assert problems(facts(ep=2, experts=4, zero=2, grad_compress="bf16")) == []


def test_runtime_applies_the_same_rules():
    plan = {**BASE, "grad_accum": 1, "pp": 2, "schedule": "1f1b", "compile": None, "ac": {}}
    plan.pop("micro_batches")
    assert plan_problems(plan) and "needs at least 2 micro-batches" in plan_problems(plan)[0]
    # the launch's --compile against the plan's checkpointed blocks (an emitted script with tp and AC)
    plan = {**plan, "grad_accum": 2, "tp": 2, "compile": "inductor", "ac": {"layers.0": "full"}}
    assert len(plan_problems(plan)) == 1 and "torch.compile with tensor parallelism" in plan_problems(plan)[0]


SMALL_SEQ_JOB = "llama:layers=4,hidden=128,heads=8,kv_heads=8,ffn=256,vocab=256,seq=36"  # seq % 8 ≠ 0


@pytest.fixture(scope="module")
def odd_seq():
    return profile_model(SMALL_SEQ_JOB)


def test_sp_off_stays_when_sp_cannot_run(odd_seq):
    """seq = 36 is not divisible by tp = 8: sp=on cannot run, so it dominates nothing and sp=off is offered."""
    cluster = load_cluster("dgx-h100:nodes=1")
    cands = candidates(odd_seq, cluster, 16, {"tp": 8})
    assert cands and all(not c.sp for c in cands)
    tp4 = candidates(odd_seq, cluster, 16, {"tp": 4, "cp": 1})  # 36 % 4 == 0: sp=off dominated by sp=on again
    assert tp4 and all(c.sp for c in tp4)
    # with cp = 2 a rank holds 18 tokens, which tp = 4 does not divide: sp=on cannot run there
    cp2 = candidates(odd_seq, cluster, 16, {"tp": 4, "cp": 2})
    assert cp2 and all(not c.sp for c in cp2)


def test_zero_bubble_does_not_dominate_ddp_1f1b(odd_seq):
    """With DDP (zero ≤ 1, tp = 1) zero-bubble all-reduces after the backward; 1F1B overlaps it, so 1F1B stays."""
    cluster = load_cluster("dgx-h100:nodes=1")
    cands = candidates(odd_seq, cluster, 16, {"tp": 1, "pp": 2, "mbs": 1})
    scheds = {(c.zero, c.schedule.value) for c in cands if c.vpp == 1}
    assert (0, "1f1b") in scheds and (0, "zb") in scheds and (1, "1f1b") in scheds
    assert (2, "1f1b") not in scheds and (2, "zb") in scheds  # FSDP: zb dominates where it runs
    assert (3, "zb") not in scheds and (3, "1f1b") in scheds  # (ZeRO-3 with zb trains wrong: not offered)
    assert all(c.schedule.value != "gpipe" for c in cands)


def test_every_searched_plan_emits(odd_seq):
    """The winner and every alternative pass the rules and build the runtime's PLAN (the emitter's checks)."""
    cluster = load_cluster("dgx-h100:nodes=1")
    model, _ = resolve_model(SMALL_SEQ_JOB).build(batch=1, seq=36, device="meta")
    for gb in (8, 16, 24):
        res = search(odd_seq, cluster, gb, top_k=8, time_limit=20, progress=False)
        for sol in [res.best, *(a.solution for a in res.alternatives)]:
            cfg = sol.config
            assert problems(cfg.runnable_facts(gb, odd_seq.model.arch, 36)) == [], cfg
            if sol is res.best:
                plan = make_plan(odd_seq, cluster, gb, res, model=SMALL_SEQ_JOB, cluster_spec="dgx-h100:nodes=1")
                runtime_config(plan, model)


def test_pinned_checkpointing_is_never_offered_with_zero_bubble(odd_seq):
    """A pinned ``ac`` enters the runnable rules with every candidate (it was only under --compile): with
    ``--fix ac=full`` the search offered zero-bubble candidates, which the emitter then refused."""
    cluster = load_cluster("dgx-h100:nodes=1")
    refused: list = []
    cands = candidates(odd_seq, cluster, 16, {"tp": 1, "pp": 2, "mbs": 1, "ac": "full"}, refused=refused)
    assert cands and all(c.schedule.value != "zb" for c in cands)
    assert any(c.schedule.value == "zb" and "zero-bubble" in why for c, why in refused)
    assert any(c.schedule.value == "zb" for c in candidates(odd_seq, cluster, 16, {"tp": 1, "pp": 2, "mbs": 1}))


def test_pinned_unrunnable_fix_says_why(odd_seq):
    cluster = load_cluster("dgx-h100:nodes=1")
    with pytest.raises(NoPlanFits, match="ZeroRedundancyOptimizer"):
        search(odd_seq, cluster, 16, fix={"zero": 1, "tp": 4}, progress=False)
    with pytest.raises(NoPlanFits, match="micro-batches"):
        search(odd_seq, cluster, 16, fix={"pp": 4, "dp": 2, "mbs": 4}, progress=False)


def test_tensor_parallelism_splits_nn_linear_layers_only():
    """Hugging Face GPT-2's projections are ``Conv1D`` modules named as column/row linears (c_attn, c_fc, c_proj),
    which the runtime's layout (`profiler.layers.tp_layout`: ``nn.Linear`` only) leaves whole: the search offered
    tp = 2 (pinned) and the emitter refused the plan. The capture gives them no tensor-parallel roles (they are
    ``aten.addmm``, not ``aten.linear``), the arch fact ``tp_split`` says why, and a pinned tp says so."""
    from costmodel.layercost import is_tp_layer
    from profiler.layers import tp_layout, tp_split_problem

    spec = "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=128,n_positions=64"
    lg = profile_model(spec)
    assert not any(is_tp_layer(layer) for layer in lg.blocks)
    model, _ = resolve_model(spec).build(device="meta")
    why = tp_split_problem(model, lg.block_container)
    assert lg.model.arch["tp_split"] == why and "attn.c_attn (Conv1D)" in why and "--fix tp=1" in why
    with pytest.raises(NoPlanFits, match=r"tp=2.*c_attn \(Conv1D\)"):
        search(lg, load_cluster("dgx-h100:nodes=1"), 16, fix={"tp": 2}, progress=False)
    llama, _ = resolve_model("llama-tiny").build(device="meta")
    assert tp_split_problem(llama, "layers") == "" and set(tp_layout(llama.layers[0]).values()) == {"colwise",
                                                                                                       "rowwise"}
    assert all(is_tp_layer(layer) for layer in profile_model("llama-tiny").blocks)


def test_emitter_refuses_an_unrunnable_plan():
    from planner.plan import LayerStrategy, Plan

    names = ["embed", "layers.0", "layers.1", "head"]
    plan = Plan(model="llama-tiny", fingerprint="x", seq=32, global_batch=2, cluster="cpu-local",
                config=ParallelConfig(pp=2, mbs=2, precision="fp32"),
                layers=tuple(LayerStrategy(name=n, stage=int(i >= 2)) for i, n in enumerate(names)))
    model, _ = resolve_model("llama-tiny").build(batch=1, seq=32, device="meta")
    with pytest.raises(ValueError, match="cannot run: pp=2 needs at least 2 micro-batches"):
        runtime_config(plan, model)


def test_irregular_groups_are_not_offered():
    """tp = 6 on 8-GPU nodes: half the TP groups would straddle two nodes while the cost model prices rank 0's (and
    likewise the cp groups, stride tp, and the dp × cp gradient groups)."""
    lg = profile_model("llama:layers=4,hidden=96,heads=6,kv_heads=6,ffn=192,vocab=256,seq=36")
    cluster = load_cluster("dgx-h100:nodes=3")  # 24 GPUs: tp = 6 and tp = 3 divide the world, not a node's 8
    cands = candidates(lg, cluster, 48, {})
    assert cands
    assert all(8 % c.tp == 0 and 8 % (c.cp * c.tp) == 0 for c in cands)
    assert all(8 % (c.dp * c.cp * c.tp) == 0 or (c.dp * c.cp * c.tp) % 8 == 0 for c in cands)
    assert {c.tp for c in cands} <= {1, 2}


def test_selective_ac_follows_the_models_attention(tmp_path):
    """Selective AC recomputes the seq×seq attention core where the blocks make one (Megatron's unfused attention);
    where the attention is a fused kernel there is none, and selective is torchtitan's per-op policy
    (`selective_policy`). The capture records which (`profiler.layers.has_attention_core`), and the plan file says
    which policy its selective layers run. With context parallelism the per-op policy and the checkpointed attend
    call are refused, one line, exit 2, no plan written, and the search offers the ILP no selective AC there."""
    import subprocess
    import sys

    import yaml

    fused = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=192,vocab=128,seq=48")
    math = profile_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=48,attention=math,dropout=0")
    assert (fused.model.arch["attention_core"], math.model.arch["attention_core"]) == (False, True)
    # the core is in the zoo GPT's attend method, in every block of a deep one (captured from fewer: a relative path)
    deep = profile_model("gpt:layers=24,hidden=64,heads=4,vocab=128,seq=48,attention=math,dropout=0")
    assert math.model.arch["attends"] is True and deep.model.arch["attends"] is True
    assert [selective_policy(core) for core in (False, True, None)] == [
        "every-other-matmul", "attention-core", "attention-core"]
    # a core outside an attend method: the per-op policy that keeps all but the core
    assert [selective_policy(core, attends=False) for core in (False, True, None)] == [
        "every-other-matmul", "all-but-attention-core", "all-but-attention-core"]
    assert problems(facts(checkpointed=True, selective_ac=True, attention_core=False)) == []
    found = problems(facts(checkpointed=True, selective_ac=True, attention_core=False, cp=2, cp_ready=True))
    assert len(found) == 1 and "cp=2" in found[0] and "ac=full or cp=1" in found[0]
    # checkpointing the attend call would recompute its all-gathers too (unpriced); a plan from before the policy
    # field runs torch's selective checkpoint over the block, as it did
    found = problems(facts(checkpointed=True, selective_ac=True, attention_core=True, cp=2, cp_ready=True))
    assert len(found) == 1 and "attention-core" in found[0] and "ac=full or cp=1" in found[0]
    assert problems(facts(checkpointed=True, selective_ac=True, attention_core=True, attends=False, cp=2,
                          cp_ready=True)) == []
    assert "selective" not in checkpoint_modes(1, cp=2, attention_core=False)
    assert "selective" not in checkpoint_modes(1, cp=2, attention_core=True)
    assert "selective" in checkpoint_modes(1, cp=1, attention_core=False)
    for spec, fix, rc, policy in (
            ("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=192,vocab=128,seq=48", "dp=2", 0, "every-other-matmul"),
            ("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=48,attention=math,dropout=0", "dp=2", 0, "attention-core"),
            ("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=192,vocab=128,seq=48", "cp=2", 2, None)):
        out = tmp_path / f"{rc}-{policy}.yaml"
        cmd = [sys.executable, "-m", "planner", "plan", spec, "--cluster", "cpu-local", "--global-batch", "4",
               "--fix", f"{fix},ac=selective", "--check", "off", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == rc and out.exists() == (rc == 0), proc.stderr[-2000:]
        if rc:
            assert proc.stderr.count("\n") == 1 and "cp=2" in proc.stderr, proc.stderr
        else:
            assert yaml.safe_load(out.read_text())["selective"] == policy


def test_attention_scores_are_told_from_activations_as_wide_as_the_sequence():
    """The one rule for what selective AC recomputes (`costmodel.runnable.attention_scores`), used by the capture and
    the runtime's policy: [batch, heads, seq, seq] and [batch·heads, seq, seq] are scores; [batch, seq, hidden] is
    not, even where hidden = seq (llama3-70b at seq 8192 had 29 of its 66 block ops, its linears among them, read
    as attention core)."""
    import itertools

    from costmodel.runnable import attention_scores
    from profiler.graph import attention_scores as captured

    dims = (1, 2, 3, 4, 8, 16)
    for rank, batch, seq in itertools.product((2, 3, 4, 5), (1, 2, 4), (0, 4, 8, 16)):  # the capture's copy agrees
        for shape in itertools.product(dims, repeat=rank):
            assert captured(shape, batch, seq) == attention_scores(shape, batch, seq), (shape, batch, seq)
    assert attention_scores((2, 16, 512, 512), 2, 512) and attention_scores((32, 512, 512), 2, 512)
    assert attention_scores((2, 1, 512, 512), 2, 512)  # one head per tensor-parallel rank
    assert not attention_scores((2, 512, 512), 2, 512)  # hidden = seq
    assert not attention_scores((2, 16, 256, 256), 2, 512)  # not the sequence
    assert not attention_scores((512, 512), 1, 512)  # a 2-D causal mask is made, not recomputed as scores
    wide = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=64")
    assert not any(n.is_attention_core for n in wide.model.nodes) and wide.model.arch["attention_core"] is False
    # heads as wide as the sequence: queries, keys and values [batch, heads, seq, head_dim] are shaped as scores,
    # but a block that calls a fused kernel has no core (a MoE read so took the attention-core policy: −11 %)
    square = profile_model("moe:layers=2,hidden=256,heads=4,kv_heads=4,ffn=128,vocab=128,seq=64,experts=4,top_k=2")
    assert any(n.is_attention_core for n in square.model.nodes) and square.model.arch["attention_core"] is False
    math = profile_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=64,attention=math,dropout=0")
    block = next(layer for layer in math.layers if layer.kind == "block")
    assert sorted({n.op.split(".")[1] for n in block.nodes if n.is_attention_core}) == [
        "baddbmm", "bmm", "dropout", "empty", "masked_fill", "softmax"]


def test_a_module_given_to_auto_parallelize_is_judged_as_its_file_would_be():
    """`auto_parallelize` plans a module it is given (`planner.search.outer.plan_for_module`) with the arch facts a
    captured ``file.py`` model gets (`profiler.api.runnable_facts`), its forward and its blocks under tensor
    parallelism tried on a meta copy of its real weights: a block that reads its head count from its settings
    fails at a rank's width, so no tp = 2 plan is offered, and `runtime_config` refuses one made for the module
    before. Before, the module path set none of these facts: the search offered tp = 2, and the first forward
    failed on every rank. A module that runs on its own device but not on meta at all (a CPU tensor made in its
    forward) is not judged: neither refused nor passed by a meta forward that proves nothing."""
    import types

    import torch
    import torch.nn.functional as F

    from planner.search.outer import plan_for_module

    example = f"{Path(__file__).parent.parent / 'examples' / 'custom_model.py'}:factory"
    model, inputs = resolve_model(example).build(batch=1, seq=32, device="cpu")
    tp2 = plan_for_module(model, inputs, cluster="cpu-local", fix={"tp": 2})  # (the example runs at tp = 2)
    assert tp2.config.tp == 2 and tp2.model == "module:TinyLM"

    def by_settings(self, x):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))

    for block in model.blocks:
        block.forward = types.MethodType(by_settings, block)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NoPlanFits, match="TinyLM's forward fails .* at tp=2"):
        plan_for_module(model, inputs, cluster="cpu-local", fix={"tp": 2})
    with pytest.raises(ValueError, match="TinyLM's forward fails .* at tp=2"):
        runtime_config(tp2, model)
    assert all(p.device.type == "cpu" and p.equal(w) for p, w in zip(model.parameters(), weights))

    def cpu_literal(self, x):  # runs on its own device, not on meta whatever the split: not judged, not refused
        return by_settings(self, x) + torch.zeros(x.shape[1], x.shape[2])

    for block in model.blocks:
        block.forward = types.MethodType(cpu_literal, block)
    model(inputs[0])  # (it runs)
    assert plan_for_module(model, inputs, cluster="cpu-local", fix={"tp": 2}).config.tp == 2
    runtime_config(tp2, model)  # (no ValueError)


def test_a_users_blocks_are_tried_split_as_tensor_parallelism_splits_them():
    """A ``file.py`` model's forward is run on the meta device with its column- and row-parallel linears cut as a
    rank of tp = 2 holds them (`profiler.layers.tensor_parallel_problems`): examples/custom_model.py read its head
    count from its settings, so its views failed on the local width, and the search offered tp = 2 for it (the
    plan's own check could not trace it); it reads them from the tensors now. Blocks whose linears sit directly in
    the block cannot take sequence parallelism, which would gather the whole residual stream. Each is one line, and
    the search and the emitter read them."""
    import sys
    import types

    import torch
    import torch.nn.functional as F

    from profiler.layers import tensor_parallel_problems

    sys.path.insert(0, str(Path(__file__).parent / "data"))
    import unfused_attention

    def meta(spec):
        model, inputs = resolve_model(spec).build(batch=1, seq=32, device="meta")
        return model, inputs[0]

    def by_settings(self, x):  # (the example's block as it was: the heads from its settings)
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))

    example = f"{Path(__file__).parent.parent / 'examples' / 'custom_model.py'}:factory"
    custom, ids = meta(example)
    tp, sp = tensor_parallel_problems(custom, "blocks", ids)
    assert "blocks.0.wq sits directly in its block" in sp and "sp=off" in sp
    assert sorted(tp) == ["8"] and "at tp=8" in tp["8"]  # (4 heads: 8 ranks cannot split them)
    for block in custom.blocks:
        block.forward = types.MethodType(by_settings, block)
    tp, _ = tensor_parallel_problems(custom, "blocks", ids)
    assert sorted(tp) == ["2", "4", "8"]  # (the widths 64 and 256: tp = 3 splits neither, and is not judged)
    assert "TinyLM's forward fails" in tp["2"] and "at tp=2" in tp["2"]
    assert custom.blocks[0].wq.forward.__func__ is torch.nn.Linear.forward  # (the model itself unchanged)

    def by_width(self, x):  # reads the width the module was built with, which a rank's ColwiseParallel keeps
        return by_settings(self, x) if self.wq.out_features == x.shape[-1] else x[0]

    for block in custom.blocks:
        block.forward = types.MethodType(by_width, block)
    assert sorted(tensor_parallel_problems(custom, "blocks", ids)[0]) == ["2", "4", "8"]
    ready, ids = meta(f"{Path(__file__).parent / 'data' / 'unfused_attention.py'}:factory")
    tp_ready, sp_ready = tensor_parallel_problems(ready, "blocks", ids)
    assert sorted(tp_ready) == ["8"] and sp_ready == ""  # (its 4 heads too)
    with torch.device("meta"):
        real = unfused_attention.UnfusedLM(vocab=64, dim=32, heads=4, layers=1).to_empty(device="cpu")
    # real weights (a module given to auto_parallelize): judged on a meta copy, the weights neither read nor changed
    tp_real, sp_real = tensor_parallel_problems(real, "blocks", ids)
    assert sorted(tp_real) == ["8"] and "UnfusedLM's forward fails" in tp_real["8"] and sp_real == ""
    assert not any(t.is_meta for t in real.parameters())
    assert problems(facts(tp=2, tp_forward=tp)) == [f"tp=2: {tp['2']}"]
    assert problems(facts(tp=3, tp_forward=tp)) == []
    assert problems(facts(tp=2, sp=True, sp_layout=sp)) == [f"sp=on: {sp}"]
    assert problems(facts(tp=1, tp_forward=tp, sp_layout=sp)) == []
