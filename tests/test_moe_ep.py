"""Expert parallelism and dropless routing, for the zoo MoE and Hugging Face MoE models, and the tensor parallelism
they run beside (issue: mixture-of-experts planned, costed and emitted).

- dropless routing equals a per-token reference (one process);
- the gloo matrix additions: every EP plan (with DDP, FSDP, pipelining, TP and SP), and the TP plans whose gradients
  each TP rank computes from its share only (per-head q/k norms, MoE feed-forwards under SP), through the emitted
  script and through `auto_parallelize`, against one process on the same seed and data (3 SGD steps, losses and
  parameter updates ≤ 1e-4 relative), in two torchrun launches (2 and 4 ranks; `tests.dist_util` runs all cases of
  a size in the same processes);
- the collectives, FLOPs and memory one step issues (`autopar check`'s trace on a fake world) against the cost model,
  and the rules that refuse what the runtime cannot run.
"""

from __future__ import annotations

import pytest
import torch

from profiler.zoo import moe
from tests import dist_util
from tests.test_emit_dist import EXACT, RESUME_STEPS, STEPS, _hf_plan, make_plan
from tests.test_zoo import naive_moe

MOE = "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=4,top_k=2"
#: one expert per ep rank and edp = 2: FSDP2 shards the experts along dim 1 (`apply_fsdp_experts`)
MOE2 = "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=2,top_k=1"
HF_MOE = ("hf:mixtral:num_hidden_layers=2,hidden_size=64,intermediate_size=64,num_attention_heads=4,"
          "num_key_value_heads=2,vocab_size=128,num_local_experts=4,num_experts_per_tok=2,seq=32")
#: per-head q/k norms; and with a dense first block beside a MoE one (decoder_sparse_step=2)
QWEN3 = ("hf:qwen3:num_hidden_layers=2,hidden_size=64,intermediate_size=64,num_attention_heads=4,"
         "num_key_value_heads=2,head_dim=16,vocab_size=128,seq=32")
#: two block kinds: a dense block before MoE ones (the zoo's DeepSeek-style ``dense_layers``), pipelined as the
#: search splits it (stages cut between any two blocks)
DENSE_MOE = "moe:layers=5,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=4,top_k=2,dense_layers=1"
#: two kinds that alternate (the zoo's Llama 4-style ``moe_every=2``: dense, MoE, dense, MoE): a stage may start at
#: either kind
ALTERNATING = "moe:layers=8,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=4,top_k=2,moe_every=2"
QWEN3_MOE = ("hf:qwen3_moe:num_hidden_layers=2,hidden_size=64,intermediate_size=64,num_attention_heads=4,"
             "num_key_value_heads=2,head_dim=16,vocab_size=128,moe_intermediate_size=32,num_experts=4,"
             "num_experts_per_tok=2,decoder_sparse_step=2,seq=32")


def test_dropless_routing_equals_the_per_token_reference():
    """The default routing computes every pair, however unbalanced: here an expert gets far more than a balanced
    share (a capacity of 1.0 would drop pairs), and gradients reach every expert that was chosen."""
    torch.manual_seed(0)
    config = moe.MoEConfig(layers=1, hidden=16, heads=2, kv_heads=2, ffn=24, vocab=32, seq=8, experts=4, top_k=2)
    assert config.capacity_factor is None
    layer = moe.MoETransformer(config).layers[0].feed_forward
    with torch.no_grad():
        layer.gate.weight[0] += 0.5  # skew the router towards expert 0
    x = torch.randn(2, 8, 16, requires_grad=True)
    chosen = torch.topk(layer.gate(x.detach().view(16, 16)), 2, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    assert counts.max() > moe.expert_capacity(16, 4, 2, 1.0)  # capacity routing would drop pairs here
    got = layer(x)
    torch.testing.assert_close(got, naive_moe(layer, x), rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    for e in range(4):
        assert (layer.experts.w1.grad[e].abs().sum() > 0) == bool(counts[e] > 0)


def test_fake_tensors_take_the_balanced_case():
    """Where the counts have no values (fake tensors: export, `autopar check`) the layer runs the balanced case:
    the capacity path with C = ⌈tokens·top_k/experts⌉, so its FLOPs are the dropless expectation."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    config = moe.MoEConfig(layers=1, hidden=16, heads=2, kv_heads=2, ffn=24, vocab=32, seq=8, experts=4, top_k=2)
    with FakeTensorMode():
        layer = moe.MoETransformer(config).layers[0].feed_forward
        with FlopCounterMode(display=False) as counter:
            out = layer(torch.randn(2, 8, 16))
    assert out.shape == (2, 8, 16)
    tokens, capacity = 16, moe.expert_capacity(16, 4, 2, 1.0)
    assert capacity == tokens * 2 // 4
    assert counter.get_total_flops() == 2 * tokens * 16 * 4 + 6 * 4 * capacity * 16 * 24


# name: (world, plan): every case dropless (the zoo default), 3 SGD steps, EXACT tolerances
CASES = {
    "ep2": (2, lambda: make_plan(MOE, 2, dp=2, ep=2)),
    "ep2_fsdp_edp1": (2, lambda: make_plan(MOE, 2, dp=2, ep=2, zero=3, ac={"layers.1": "full"})),
    "ep2_dp4": (4, lambda: make_plan(MOE, 2, dp=4, ep=2)),
    "ep2_fsdp_dp4": (4, lambda: make_plan(MOE, 2, dp=4, ep=2, zero=3)),
    "ep2_fsdp_dp4_dim1": (4, lambda: make_plan(MOE2, 2, dp=4, ep=2, zero=3)),
    "ep2_pp2": (4, lambda: make_plan(MOE, 2, pp=2, dp=2, ep=2, schedule="1f1b", ac={"layers.1": "full"})),
    # tensor parallelism for attention (experts whole on each TP rank, which all route the same tokens)
    "dense_moe_pp2": (2, lambda: make_plan(DENSE_MOE, 5, pp=2, mbs=2, schedule="1f1b", stages=[0, 0, 0, 1, 1],
                                           ac={"layers.0": "full", "layers.3": "full"})),
    "dense_moe_pp2_interleaved": (2, lambda: make_plan(DENSE_MOE, 5, pp=2, vpp=2, mbs=2, schedule="interleaved",
                                                       stages=[0, 0, 1, 2, 3])),
    "dense_moe_pp2_ep2": (4, lambda: make_plan(DENSE_MOE, 5, pp=2, dp=2, ep=2, schedule="1f1b",
                                               stages=[0, 0, 1, 1, 1])),
    "alternating_pp2": (2, lambda: make_plan(ALTERNATING, 8, pp=2, mbs=2, schedule="1f1b", stages=[0] * 4 + [1] * 4,
                                             ac={"layers.1": "full", "layers.5": "full", "layers.7": "full"})),
    "alternating_pp2_interleaved": (2, lambda: make_plan(ALTERNATING, 8, pp=2, vpp=2, mbs=2, schedule="interleaved",
                                                         stages=[0, 0, 1, 1, 2, 2, 3, 3])),
    # cut inside the pattern: a stage starts at a MoE block, stages of 3 and 5 blocks (both kinds on each); and
    # interleaved chunks of 1, 3, 1 and 3 blocks
    "alternating_pp2_cut_in_pattern": (2, lambda: make_plan(ALTERNATING, 8, pp=2, mbs=2, schedule="1f1b",
                                                            stages=[0] * 3 + [1] * 5,
                                                            ac={"layers.2": "full", "layers.3": "full"})),
    "alternating_pp2_interleaved_uneven": (2, lambda: make_plan(ALTERNATING, 8, pp=2, vpp=2, mbs=2,
                                                                schedule="interleaved",
                                                                stages=[0, 1, 1, 1, 2, 3, 3, 3])),
    "moe_tp2": (2, lambda: make_plan(MOE, 2, tp=2)),
    # with sequence parallelism the feed-forward runs on each TP rank's slice: router and experts summed over tp
    "moe_tp2_sp": (2, lambda: make_plan(MOE, 2, tp=2, sp=True)),
    "ep2_tp2_sp_fsdp": (4, lambda: make_plan(MOE, 2, dp=2, tp=2, ep=2, zero=2, sp=True)),
    "ep2_tp2": (4, lambda: make_plan(MOE, 2, dp=2, tp=2, ep=2)),
    "ep2_tp2_fsdp": (4, lambda: make_plan(MOE, 2, dp=2, tp=2, ep=2, zero=3)),
    # per-head q/k norms on each TP rank's heads: their gradients summed over tp
    "qwen3_tp2": (2, lambda: _hf_plan(QWEN3, tp=2)),
    "qwen3_tp2_sp": (2, lambda: _hf_plan(QWEN3, tp=2, sp=True)),
    # a dense block and a MoE block (Qwen3-MoE, decoder_sparse_step=2): each takes its own TP layout
    "qwen3moe_tp2_sp": (2, lambda: _hf_plan(QWEN3_MOE, tp=2, sp=True)),
    "qwen3moe_ep2_tp2": (4, lambda: _hf_plan(QWEN3_MOE, dp=2, tp=2, ep=2)),
    # Hugging Face transformers' experts (grouped_mm; its CPU fallback here), routed by Mixtral's own router
    "hf_ep2": (2, lambda: _hf_plan(HF_MOE, dp=2, ep=2)),
    "hf_ep2_fsdp_dp4": (4, lambda: _hf_plan(HF_MOE, dp=4, ep=2, zero=3)),
}

#: checkpoint and resume with expert parallelism (AdamW, so its moments matter): name → (world, plan)
RESUME_CASES = {
    "resume_ep2": (2, lambda: make_plan(MOE, 2, dp=2, ep=2)),
    "resume_ep2_fsdp_dp4": (4, lambda: make_plan(MOE, 2, dp=4, ep=2, zero=3)),
    "resume_ep2_fsdp_dim1": (4, lambda: make_plan(MOE2, 2, dp=4, ep=2, zero=2)),
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return dist_util.run_matrix(tmp_path_factory.mktemp("ep_matrix"), "expert-parallel", CASES, RESUME_CASES, STEPS,
                                RESUME_STEPS)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["emit", "apply"])
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_one_process(matrix, name, mode):
    dist_util.assert_matches(matrix, name, CASES[name][0], mode, EXACT)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_expert_parallel_checkpoint_resumes_and_loads_whole(matrix, name):
    """A checkpoint of an expert-parallel plan holds every rank's experts: resuming gives the losses of straight
    steps (≤ 1e-6, AdamW's moments included), through the emitted script and `auto_parallelize`'s handle, and the
    checkpoint loads into one unparallelised model (the whole [experts, …] tensors under their own names), whose loss
    on the next batch is the resumed run's."""
    import torch.distributed.checkpoint as dcp

    out, refs, failures = matrix
    world, _ = RESUME_CASES[name]
    if world in failures:
        pytest.fail(failures[world])
    got = torch.load(out / f"{name}.resume.rank0.pt")
    assert got["resumed"] == pytest.approx(got["straight"], rel=1e-6), (got["resumed"], got["straight"])
    assert got["handle"] == pytest.approx(got["straight"], rel=1e-6), (got["handle"], got["straight"])
    mod = dist_util.load_script(refs[name], f"resume_one_process_{name}")
    torch.manual_seed(1)
    model = mod.build_model()  # other weights: the checkpoint must overwrite every one
    state = {f"model.{n}": p for n, p in model.named_parameters()}
    assert state["model.layers.0.feed_forward.experts.w1"].shape[0] == model.config.experts  # the whole tensor
    dcp.load(state, checkpoint_id=got["first_half"], no_dist=True)
    half = RESUME_STEPS // 2
    inputs, labels = mod.get_batch(half, slice(None))
    with torch.no_grad():
        loss = model(inputs, labels).item()
    assert loss == pytest.approx(got["resumed"][half], rel=1e-5)


def test_a_step_issues_the_expert_all_to_alls():
    """`autopar check`'s trace of one step (fake world, balanced routing) of dp=2, ep=2: per MoE layer and
    micro-batch five all-to-alls on the ep group: the count exchange, the dispatch and the combine, and the two
    token all-to-alls of their backward; each token all-to-all carries the micro-batch's tokens·top_k rows (fp32),
    the count exchange one int64 per expert. The experts' gradients need no reduction here (edp = 1); the rest of
    the model is all-reduced over dp as without ep."""
    from planner.check.trace import trace_rank

    plan = make_plan(MOE, 2, dp=2, ep=2)
    layers, micro_batches, experts, top_k, hidden = 2, plan.grad_accum, 4, 2, 64
    trace = trace_rank(plan, 1)
    a2a = trace.collectives["all_to_all@ep"]
    assert a2a["count"] == 5 * layers * micro_batches
    rows = plan.config.mbs * plan.seq * top_k
    assert a2a["bytes"] == layers * micro_batches * (4 * rows * hidden * 4 + experts * 8)
    assert set(trace.collectives) == {"all_to_all@ep", "all_reduce@dp"}
    assert trace.dp_reduced_elements >= trace.grad_elements > 0


#: DeepSeek-V3's layout (Moonlight's shape, scaled down): a dense first block, 8 routed experts (top-2) and a shared
#: one, multi-head latent attention; Hugging Face's experts interface (top-k indices and weights). A real model's
#: vocabulary makes the head's working set the backward's largest temporary, as at full size (with a 512-token one
#: the trace's attention scratch, which the cost model does not size, moved the peak 8 %, with ep = 1 as well)
HF_DEEPSEEK = ("hf:deepseek_v3:hidden_size=256,num_hidden_layers=3,num_attention_heads=4,num_key_value_heads=4,"
               "intermediate_size=512,moe_intermediate_size=128,n_routed_experts=8,num_experts_per_tok=2,"
               "n_shared_experts=1,first_k_dense_replace=1,n_group=1,topk_group=1,q_lora_rank=null,kv_lora_rank=64,"
               "qk_nope_head_dim=32,qk_rope_head_dim=16,v_head_dim=32,vocab_size=32000,seq=1024")


def test_hugging_face_experts_trace_as_costed():
    """A plan with the experts over ep = 2 on the top-k interface (`expert_parallel_topk_forward`), traced on a
    fake world of the planned size: its all-to-alls, FLOPs (transformers' grouped-GEMM fallback: uncounted, the
    trace's FLOPs were 43 % short on Moonlight's shape) and peak as costed."""
    from planner.check.conformance import check_plan
    from planner.validate.loop import plan_from_config

    plan = plan_from_config(HF_DEEPSEEK, "dgx-h100:nodes=1", 32, "dp=8,ep=2,zero=2,mbs=2")
    assert plan.config.ep == 2
    result = check_plan(plan)
    (role,) = result["roles"]
    errors = role["errors"]
    assert errors["collectives"]["all_to_all@ep"] <= 1e-6, role["traced"]["collectives"]
    assert errors["flops"] <= 0.02
    assert errors["memory"]["peak"] <= 0.05, (role["predicted"]["memory"], role["traced"]["memory"])


def test_hugging_face_experts_keep_what_they_keep_in_one_process():
    """Saved for backward by one MoE layer's experts: over ep = 2 (`expert_parallel_topk_forward`, on a fake
    two-rank world and fake tensors: the balanced case) exactly what transformers' own experts keep in one process,
    less the half of the expert weights the rank does not hold. The cost model charges a MoE layer's activations
    as captured in one process; the runtime once put the returned rows back with an ``index_copy``, whose backward
    keeps a copy of them (+4 % of Moonlight's peak, uncosted)."""
    from functools import partial

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.emit import runtime
    from profiler.zoo.hf import grouped_mm_on_fake_fp32
    from profiler.zoo.registry import resolve_model

    tokens, hidden = 256, 256
    experts_total = 8

    def saved_bytes(ep: int) -> int:
        model, _ = resolve_model(HF_DEEPSEEK).build(device="cpu")
        experts = model.model.model.layers[1].mlp.experts  # (layer 0 is dense)
        saved = []
        with FakeTensorMode(allow_non_fake_inputs=True):
            experts.to_empty(device="cpu")
            if ep > 1:
                local = experts_total // ep
                for name, p in list(experts.named_parameters(recurse=False)):
                    setattr(experts, name, torch.nn.Parameter(p.detach()[:local].clone()))
                experts.num_experts = local
                experts.forward = partial(runtime.expert_parallel_topk_forward, experts.forward, dist.group.WORLD,
                                          ep, experts_total)
            weights = {p.untyped_storage()._cdata for p in experts.parameters()}
            x = torch.randn(tokens, hidden, requires_grad=True)
            index = torch.randint(0, experts_total, (tokens, 2))
            routing = torch.rand(tokens, 2, requires_grad=True)

            def pack(t):
                if t.untyped_storage()._cdata not in weights:
                    saved.append(t.numel() * t.element_size())
                return t

            with grouped_mm_on_fake_fp32(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                experts(x, index, routing)
        return sum(saved)

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        one, two = saved_bytes(1), saved_bytes(2)
    finally:
        dist.destroy_process_group()
    rows = tokens * 2 * hidden * 4  # one [tokens·top_k, hidden] fp32 tensor
    assert one > 4 * rows
    assert abs(two - one) < rows / 4, (one, two)


def test_tensor_parallel_refuses_what_it_cannot_split():
    """Multi-head latent attention (DeepSeek-V3): its down- and up-projections sit beside the column-parallel
    ``q_proj`` but take no tensor-parallel layout, so the runtime would feed them a DTensor ("got mixed
    torch.Tensor and DTensor"): the search offered tp = 2 for Moonlight's shape. One rule names them for the search
    (the capture's ``tp_unsplit``) and the emitter; Mixtral's attention and experts have none."""
    from profiler.api import profile_model
    from profiler.layers import tp_unsplit_linears
    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(HF_DEEPSEEK).build(device="meta")
    unsplit = tp_unsplit_linears(model)
    assert {name.rpartition(".")[2] for name in unsplit} == {"kv_a_proj_with_mqa", "kv_b_proj"}
    assert profile_model(HF_DEEPSEEK).model.arch["tp_unsplit"] == unsplit[0]
    mixtral, _ = resolve_model(HF_MOE).build(device="meta")
    assert tp_unsplit_linears(mixtral) == []


def test_experts_under_sequence_parallelism_trace_as_costed():
    """ep = 2 × tp = 2 with sequence parallelism on a fake world of 8: each TP rank routes its slice of the sequence
    (all-to-alls of tokens/tp rows: costed whole, they were 50 % off), the router's and experts' gradients summed
    over tp once per step (`reduce_tp_partial_grads`, in the TP traffic), FLOPs and peak as costed."""
    from planner.check.conformance import check_plan
    from planner.validate.loop import plan_from_config

    spec = "moe:layers=4,hidden=1024,heads=16,kv_heads=8,ffn=1024,vocab=32000,seq=1024,experts=8,top_k=2"
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 32, "dp=4,tp=2,ep=2,zero=2,sp=on"))
    (role,) = result["roles"]
    errors = role["errors"]
    assert errors["collectives"]["all_to_all@ep"] <= 1e-6, role["traced"]["collectives"]
    assert errors["collectives"]["all_reduce_equivalent@tp"] <= 0.02, role["traced_equivalent"]
    assert errors["flops"] <= 0.02
    assert errors["memory"]["peak"] <= 0.05, (role["predicted"]["memory"], role["traced"]["memory"])
    assert result["unreduced_params"] == []


def test_experts_shard_only_where_fsdp_can():
    """Where a rank's E/ep experts do not split over the dp/ep ranks sharing them, FSDP2 shards their weights along
    dim 1 (`apply_fsdp_experts`), which torch 2.13 accepts only evenly ("FSDP does not support uneven sharding on
    dim 1"): one rule, from the weights' second dimensions (`profiler.experts`), refuses the rest for the search,
    the emitter and the runtime."""
    from costmodel.runnable import problems
    from profiler.experts import expert_modules
    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(MOE2).build(device="meta")
    found = expert_modules(model)
    assert (found["experts"], found["expert_dim1"]) == (2, 64)  # w1, w3 [E, ffn, hidden], w2 [E, hidden, ffn]
    base = {"tp": 1, "pp": 1, "vpp": 1, "schedule": "1f1b", "zero": 3, "sp": False, "grad_compress": "none",
            "precision": "fp32", "micro_batches": 2, "ep": 2, "experts": 2, "expert_dim1": 64}
    assert problems({**base, "dp": 4}) == []  # edp = 2 divides 64: dim 1 (the gloo case ep2_fsdp_dp4_dim1)
    (why,) = problems({**base, "dp": 6})  # edp = 3 neither divides the one expert per rank nor 64
    assert "do not split over the 3 ranks sharing them" in why and "re-plan" in why
    assert problems({**base, "dp": 6, "zero": 0}) == []  # DDP does not shard them


def test_an_emitted_hugging_face_moe_script_runs_as_the_runtime(tmp_path):
    """`autopar check --script` on an emitted expert-parallel script of a Hugging Face MoE: its own code (its model
    built by itself, never through `profiler.zoo.hf`) computes and communicates what autopar's runtime does. The
    script's trace once missed every expert FLOP (the grouped-GEMM fallback's formula was registered only where
    `profiler.zoo.hf` built the model: 43 % short on Moonlight's shape)."""
    from planner.check.conformance import check_plan
    from planner.emit.script import emit
    from planner.validate.loop import plan_from_config

    plan = plan_from_config(HF_DEEPSEEK, "dgx-h100:nodes=1", 32, "dp=8,ep=2,zero=2,mbs=2")
    script = tmp_path / "train.py"
    script.write_text(emit(plan, init="meta"))
    ran, runtime_ran = check_plan(plan, script=str(script)), check_plan(plan)
    for got, want in zip(ran["roles"], runtime_ran["roles"]):
        assert got["traced"]["flops"] == want["traced"]["flops"] > 0
        assert got["traced"]["collectives"] == want["traced"]["collectives"]
