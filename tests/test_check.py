"""`autopar check`: the runtime's own parallelize + one step on a fake world, compared with the cost model.

Pinned here: the terms where the runtime and the cost model agree exactly today (data-parallel and tensor-parallel
collective bytes, parameter memory, FLOPs, the peak of a tensor-parallel role with a vocabulary-parallel embedding
and head), that a rank whose gradients are never reduced is caught, and the command's contract. Known divergences
the check reports (and that are not asserted away) are listed in the note of issue 12.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from costmodel.config import AC
from planner.check.conformance import check_plan
from planner.cli.main import main
from planner.emit import runtime, train
from planner.validate.loop import plan_from_config

MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
#: a model whose unfused attention is inline in its blocks, not in an attend method
UNFUSED = f"{Path(__file__).parent / 'data' / 'unfused_attention.py'}:factory"


def _plan(config: str):
    return plan_from_config(MODEL, "cpu-local", 8, config)


@pytest.mark.parametrize("config, kinds", [
    ("dp=2,zero=0", ["all_reduce@dp"]),
    ("dp=2,zero=1", ["all_reduce@dp", "broadcast@dp"]),
    # (and under ZeRO 2/3 the step's scalars alone all-reduced: the gradient norm's and the loss's, 8 bytes)
    ("dp=2,zero=3", ["all_gather@dp", "all_reduce@dp", "reduce_scatter@dp"]),
    ("dp=2,zero=2", ["all_gather@dp", "all_reduce@dp", "reduce_scatter@dp"]),  # 4 micro-batches: gathered once
    # FSDP reduces in bf16 when the plan compresses (its reduce_dtype): priced at 4 bytes an element before
    ("dp=2,zero=3,grad_compress=bf16", ["all_gather@dp", "all_reduce@dp", "reduce_scatter@dp"]),
])
def test_data_parallel_terms_match_the_trace(config, kinds):
    result = check_plan(_plan(config))
    (role,) = result["roles"]
    assert sorted(role["predicted"]["collectives"]) == sorted(kinds)
    for kind in kinds:
        assert role["errors"]["collectives"][kind] <= 0.02, (kind, role["predicted"]["collectives"][kind],
                                                              role["traced"]["collectives"][kind])
    assert role["errors"]["flops"] <= 0.02
    if "zero=0" in config or "zero=1" in config:
        assert role["errors"]["memory"]["params"] <= 0.01  # replicated: every parameter on every rank
    assert result["unreduced_params"] == []
    assert role["traced"]["dp_reduced_elements"] >= role["traced"]["grad_elements"] > 0


MOE = "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32,experts=4,top_k=2"


@pytest.mark.parametrize("model, config", [(MODEL, "tp=2,sp=on"), (MODEL, "tp=2,sp=off"), (MOE, "tp=2,sp=off"),
                                           (MOE, "tp=2,sp=on")])
def test_tensor_parallel_terms_match_the_trace(model, config):
    """Vocabulary-parallel embedding and head (`planner.emit.runtime.apply_vocab_parallel`), the loss on the vocab
    slices and sequence parallelism's run edges: tensor-parallel traffic and FLOPs as costed. Before the runtime
    split the vocabulary, TP traffic was 29 % off and FLOPs 16 %; a MoE block's experts, which the runtime does not
    split, were costed as column/row pairs (59 % more TP traffic than traced)."""
    result = check_plan(plan_from_config(model, "cpu-local", 8, config))
    (role,) = result["roles"]
    assert role["errors"]["collectives"]["all_reduce_equivalent@tp"] <= 0.02, role["traced_equivalent"]
    assert role["errors"]["flops"] <= 0.02
    if config.endswith("sp=on"):  # the copies around the sequence-parallel collectives (next test)
        assert role["errors"]["collectives"]["relayout@tp"] <= 1e-9, role["traced_equivalent"]


@pytest.mark.parametrize("config", ["dp=4,tp=2,sp=on,mbs=2,ac=selective", "dp=4,tp=2,sp=on,mbs=1,ac=full",
                                    "dp=4,tp=2,sp=on,mbs=2,ac=full", "dp=2,pp=2,tp=2,sp=off,mbs=1",
                                    "dp=2,pp=2,tp=2,sp=on,mbs=1"])
def test_sequence_relayout_copies_match_the_trace(config):
    """torch's functional collectives copy the whole activation around each collective along the sequence
    (`costmodel.layercost.seq_relayout_bytes`): the copies the trace sees where torch makes them equal, to the byte,
    what the cost model charges (``relayout@tp``): sequence parallelism's pairs at one sequence per micro-batch and
    at two, a full recomputation's repeats, the per-op selective policy's (which serves reduce-scatters from its
    cache but runs the copy before each again: first missed, 5.6 % under), and a pipeline boundary's gathers, along
    the hidden dimension, which copy even at one sequence per micro-batch (first priced as along the sequence)."""
    plan = plan_from_config("llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128",
                            "dgx-h100:nodes=1", 16, config)
    result = check_plan(plan)
    for role in result["roles"]:
        assert role["predicted"]["collectives"]["relayout@tp"] > 0
        assert role["errors"]["collectives"]["relayout@tp"] <= 1e-9, (role["predicted"]["collectives"],
                                                                        role["traced_equivalent"])


def test_tensor_parallel_peak_memory_matches_the_trace():
    """The conformance table's TP + SP row (benchmarks/conformance.py), at a size where activations, not
    allocator-sized scraps, make the peak: within the acceptance's 5 % (it was 29.6 % off)."""
    spec = "llama:layers=2,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048"
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 32, "dp=4,tp=2,zero=2,sp=on"))
    (role,) = result["roles"]
    assert role["errors"]["memory"]["peak"] <= 0.05, (role["predicted"]["memory"], role["traced"]["memory"])
    assert role["errors"]["collectives"]["all_reduce_equivalent@tp"] <= 0.02


@pytest.mark.parametrize("model, config, peak", [
    ("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=8000,seq=1024", "dp=8", 0.02),
    ("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=8000,seq=1024", "dp=4,tp=2,sp=on", 0.02),
    ("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=8000,seq=1024", "dp=4,tp=2,sp=off", 0.02),
    # SDPA with dropout: torch runs its math path on CPU, whose batched matmuls the policy does not count. The
    # prediction is over: 5.5 % since the tied head's gradient, held in autograd's buffer through the blocks'
    # backward (`Evaluator.tied_in_flight_bytes`, real: MemTracker on this model in one process), is charged on a
    # block moment that was already 2.5 % over here (the same without dropout, cause not found; full AC 6.5 %)
    ("gpt:layers=2,hidden=512,heads=8,vocab=8000,seq=1024,dropout=0.1", "dp=8", 0.06),
])
def test_per_op_selective_checkpointing_matches_the_trace(model, config, peak):
    """Selective AC on blocks whose attention is a fused kernel is torchtitan's per-op policy
    (`costmodel.runnable.selective_policy`): the outputs of the attention kernel, the odd matmuls and (under
    sequence parallelism) the reduce-scatters are kept, the rest recomputed. The runtime's policy and the cost
    model agree on peak memory, recomputed FLOPs and the reductions the recomputation repeats. On llama 4×1024
    (seq 1024, dp4 tp2 sp), before the row-parallel matmuls' whole partial sums and the kept reduce-scatters were
    priced the peak was 4.4 % under, and TP's traffic 17 % under before `recompute_traffic` knew the policy."""
    # (fp32: the policy, not autocast, is under test; `test_a_plan_under_autocast_is_traced_and_priced_under_autocast`)
    plan = plan_from_config(model, "dgx-h100:nodes=1", 16, config + ",ac=selective,mbs=2,precision=fp32")
    assert plan.selective == "every-other-matmul"
    result = check_plan(plan)
    (role,) = result["roles"]
    assert role["errors"]["memory"]["peak"] <= peak, (role["predicted"]["memory"], role["traced"]["memory"])
    assert role["errors"]["flops"] <= 0.005
    assert all(e <= 0.005 for e in role["errors"]["collectives"].values()), role["errors"]["collectives"]


def _no_ddp() -> None:  # runs in the tracing process: a runtime that forgets data-parallel reduction
    runtime.apply_ddp = lambda part, plan, dp_mesh: part


@pytest.mark.parametrize("model, config", [
    (MODEL, "dp=8,zero=0"), (MODEL, "dp=4,tp=2,sp=on,zero=0,ac=full"), (MODEL, "dp=4,pp=2,zero=1,mbs=1"),
    ("moe:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=256,experts=4,top_k=2", "dp=8,ep=4,zero=0"),
])
def test_a_plan_under_autocast_is_traced_and_priced_under_autocast(model, config):
    """16-bit plans outside FSDP train under ``torch.autocast`` (fp32 residual stream, fp32 loss): the check traces
    them under CPU autocast and prices them from the capture under the same autocast. Sequence parallelism then
    all-gathers the fp32 norm output and reduce-scatters the 16-bit row output, which its recomputation repeats;
    expert parallelism dispatches fp32 tokens and combines 16-bit expert outputs (priced as 16-bit both: 33 % under),
    and each call casts its rank's expert weights again (a transpose autocast does not cache)."""
    plan = plan_from_config(model, "dgx-h100:nodes=1", 16, config + ",precision=bf16")
    result = check_plan(plan)
    assert result["precision_traced"] == "bf16"
    for role in result["roles"]:
        assert role["errors"]["memory"]["peak"] <= 0.05, (role["predicted"]["memory"], role["traced"]["memory"])
        assert max(role["errors"]["collectives"].values()) <= 0.02, role["errors"]["collectives"]
        assert role["errors"]["memory"]["params"] <= 0.01  # the cast cache is counted on the same side
    fp32 = check_plan(plan_from_config(model, "dgx-h100:nodes=1", 16, config + ",precision=fp32"))
    assert fp32["precision_traced"] == "fp32"
    traced = [r["traced"]["memory"] for r in (result["roles"][0], fp32["roles"][0])]
    # the same parameters, another step: (each category's maximum can coincide where the fp32 logits of the loss
    # set it, as at tp = 2 with this model's 128-word vocabulary: the peak cannot)
    assert traced[0]["params"] == traced[1]["params"] and traced[0]["peak"] != traced[1]["peak"]


def test_a_replica_that_never_syncs_is_caught():
    """A runtime that forgets data-parallel reduction (as zero-bubble did under DDP) fails the check."""
    result = check_plan(_plan("dp=2,zero=0"), prepare=_no_ddp)
    assert not result["ok"] and result["unreduced_params"]
    assert "never reduced over the data-parallel group" in result["unreduced_params"][0]


def _extra_collective() -> None:  # runs in the tracing process: a runtime that broadcasts more than priced
    from torch import distributed as dist

    def clip(par, max_norm, _orig=train.clip_grad_norm):
        dist.broadcast(torch.zeros(256), src=0)
        return _orig(par, max_norm)

    train.clip_grad_norm = clip


def test_a_collective_the_cost_model_does_not_know_of_is_an_error():
    """Every traced kind is compared, not only those predicted: a broadcast no cost model term prices fails the
    check (before, only predicted kinds were compared, and it passed)."""
    plan = _plan("dp=2,zero=0")
    assert check_plan(plan)["ok"]
    result = check_plan(plan, prepare=_extra_collective)
    (role,) = result["roles"]
    assert not result["ok"] and role["errors"]["collectives"]["broadcast@dp"] == 1.0


def test_a_redistribution_inside_dtensors_dispatch_is_recorded():
    """A collective DTensor issues inside its own dispatch (a sharding rule's redistribution) is out of the trace's
    dispatch mode and is seen through the functional collective it calls: in torch 2.13 ``all_gather_single``
    (the ``*_tensor`` names are deprecated aliases of it). Before, only the deprecated names were watched, and this
    gather went unrecorded (its copy alone was)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.check.trace import _Collectives, _inner_collectives

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        rows = DTensor.from_local(torch.randn(4, 4), mesh, [Shard(0)], run_check=False)
        cols = DTensor.from_local(torch.randn(8, 2), mesh, [Shard(1)], run_check=False)
        counter = _Collectives({tuple(dist.get_process_group_ranks(mesh.get_group())): "tp"})
        with counter, _inner_collectives(counter):
            rows + cols  # (DTensor brings cols to Shard(0): gathered, then chunked on a CPU group)
    finally:
        dist.destroy_process_group()
    kinds = [kind for kind, *_ in counter.log]
    assert kinds.count("all_gather") == 1 and ("all_gather", "tp", 8 * 4 * 4, 8 * 4) in counter.log


@pytest.mark.parametrize("spec, config", [
    (MODEL, "dp=2,zero=0,grad_compress=powersgd-4"),
    (MODEL, "dp=2,zero=1,grad_compress=powersgd-16"),
    # 67 MiB of gradients in DDP's rebuilt buckets, the 31 MiB embedding a bucket of its own
    ("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=32000,seq=32",
     "dp=2,zero=0,grad_compress=powersgd-4"),
])
def test_powersgd_steady_state_matches_the_trace(spec, config):
    """PowerSGD is traced in its steady state (the hook past ``start_powerSGD_iter``): the tensors it sends whole and
    its low-rank factors (three all-reduces a bucket), to the byte, as `costmodel.compression.powersgd_volume` prices
    them with torch's own compression test (at rank 16 this model's 64 × 64 matrices are sent whole,
    ``_should_compress``);
    the peak within the check's tolerance with the hook's copies of its largest bucket
    (`costmodel.memory.dp_reduction_temp_bytes`, `ddp_largest_bucket`; traced in DDP's rebuilt buckets,
    `planner.check.trace._rebuilt_buckets`). Before, the trace failed inside torch's hook: the fake process group's
    futures carry no value. On the large-vocabulary row the trace of DDP's first-step bucket (every gradient) peaked
    23 % above the charge with 25 MiB buckets; buckets of 25 MiB plus the largest tensor charged 12 % too much; now
    3 %."""
    result = check_plan(plan_from_config(spec, "cpu-local", 16, config))
    (role,) = result["roles"]
    assert result["ok"], role["errors"]
    assert role["errors"]["collectives"]["all_reduce@dp"] == 0.0 and role["errors"]["flops"] == 0.0
    if "powersgd-16" in config:  # fewer bytes than the whole gradients, more than every matrix compressed
        assert role["traced"]["dp_reduced_elements"] < role["traced"]["grad_elements"]


def test_cli_check_json_contract(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    _plan("dp=2,zero=3").save(path)
    html = tmp_path / "check.html"
    assert main(["check", str(path), "--json", "--html", str(html)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("ok", "memory_error_max", "comm_error_max", "flops_error_max", "unreduced_params", "roles"):
        assert key in out
    role = out["roles"][0]
    assert {"ranks", "stage", "predicted", "traced"} <= set(role)
    assert set(role["traced"]["memory"]) == {"params", "grads", "optimizer", "activations", "temporaries", "peak"}
    assert "reduce_scatter@dp" in html.read_text()


def test_cli_check_bad_input_is_one_line(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.yaml" in err[0]


ZB_MODEL = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=256,vocab=256,seq=64"


def _zb_plan():
    return plan_from_config(ZB_MODEL, "dgx-h100:nodes=1", 16, "pp=2,dp=4,zero=0,mbs=2,schedule=zb")


def test_pipeline_roles_trace_their_boundaries():
    """Each pipeline rank is a role; sends and receives match the cost model's boundary bytes exactly."""
    result = check_plan(_zb_plan())
    assert [r["stage"] for r in result["roles"]] == [0, 1]
    for role in result["roles"]:
        for kind in ("send@pp", "recv@pp", "all_reduce@dp"):
            assert role["errors"]["collectives"][kind] <= 0.02, (kind, role["predicted"]["collectives"],
                                                                  role["traced"]["collectives"])
    assert result["unreduced_params"] == []
    assert all(role["traced"]["memory"]["peak"] > 0 for role in result["roles"])  # zero-bubble ranks too


def test_zero_bubble_holds_what_torchs_schedule_keeps():
    """The states the memory model takes from torch's zero-bubble schedule, pinned on pp = 2, m = 4, where torch
    2.13 orders rank 0 F0 F1 I0 W0 F2 I1 W1 … and rank 1 F0 I0 F1 I1 W0 F2 …: (full, pending) micro-batches. The
    last rank holds two where 1F1B holds one."""
    from costmodel.config import Schedule
    from costmodel.memory import held_states, inflight

    assert [s[:2] for s in held_states(Schedule.ZERO_BUBBLE, 2, 1, 0, 4)] == [((1.0,), (1.0,)), ((2.0,), (0.0,))]
    assert [s[:2] for s in held_states(Schedule.ZERO_BUBBLE, 2, 1, 1, 4)] == [((0.0,), (2.0,)), ((1.0,), (1.0,))]
    assert inflight(Schedule.ONE_F_ONE_B, 2, 1, 1, 4) == 1.0


def _old_zero_bubble_rule(dp, tp, zero, schedule, pp) -> bool:
    return dp > 1 and zero <= 1 and tp > 1  # before: DDP's hooks trusted under zero-bubble


def _ddp_under_zero_bubble() -> None:  # runs in the tracing process
    from planner.emit import train

    runtime.post_step_allreduce = train.post_step_allreduce = _old_zero_bubble_rule


def test_the_zero_bubble_ddp_bug_is_caught():
    """With the old rule (DDP hooks under zero-bubble) the weight gradients of the second stage are never reduced:
    torch writes them with autograd.grad, past DDP's reducer. The check names that pipeline rank."""
    result = check_plan(_zb_plan(), prepare=_ddp_under_zero_bubble)
    assert not result["ok"]
    assert any(line.startswith("pipeline rank 1") for line in result["unreduced_params"]), result["unreduced_params"]


def _keep_outputs() -> None:  # runs in the tracing process: torch's default, return_outputs=True
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        def step(self, *args, _orig=cls.step, **kwargs):
            kwargs["return_outputs"] = True
            return _orig(self, *args, **kwargs)

        cls.step = step


def test_the_last_stage_keeps_no_outputs():
    """With torch's default return_outputs=True the last stage keeps every micro-batch's logits through the step;
    the runtime steps with False, and the check sees the difference: m × the logits on the last rank."""
    model = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=4096,seq=64"
    plan = plan_from_config(model, "cpu-local", 8, "pp=2,mbs=2,schedule=1f1b")  # 4 micro-batches
    kept = check_plan(plan, prepare=_keep_outputs)["roles"][1]["traced"]["memory"]["peak"]
    lean = check_plan(plan)["roles"][1]["traced"]["memory"]["peak"]
    logits = 2 * 64 * 4096 * 4  # mbs · seq · vocab · fp32
    assert kept - lean >= 3 * logits, (kept, lean, logits)


PP_BUFFER_MODEL = "llama:layers=8,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=256,seq=1024"


@pytest.mark.parametrize("config, terms, tolerance", [
    ("pp=2,dp=4,vpp=4,mbs=1,schedule=interleaved,zero=1", ("activations", "peak"), 0.045),  # the buffer is the input
    ("pp=2,dp=2,tp=2,mbs=1,schedule=1f1b,pp_compress=bf16,zero=0", ("activations", "peak"), 0.045),  # gather, cast
    # tensor-parallel slices on the wire, not cast: torch sizes each receive buffer by its metadata's strides, so
    # the check's own stage metadata must be contiguous as the runtime's slices are (a view's: 18.9 % over the peak)
    ("pp=2,dp=2,tp=2,sp=on,vpp=2,mbs=1,schedule=interleaved,zero=2,ac=full", ("peak",), 0.045),
    # zero-bubble: the peak, over-predicted as reached (the last rank's pending micro-batches, ~11 % of its
    # activations, are over-counted, and not by the buffers)
    ("pp=2,dp=4,vpp=4,mbs=1,schedule=zb,zero=1", ("peak",), 0.06),
])
def test_torchs_pipelining_buffers_are_priced(config, terms, tolerance, monkeypatch):
    """torch 2.13's PipelineStage keeps a receive buffer per micro-batch for every activation and every output
    gradient of the step, and each stage's outputs until their backward (`costmodel.memory.pipeline_buffers`). Priced,
    each pipeline rank's activations and peak match the trace; without them, interleaving's 4 micro-batches of
    buffers × 7 boundaries on rank 0 are ~10 % of its activations, unpriced."""
    import sys

    from planner.check.conformance import predicted_roles

    est = sys.modules["costmodel.estimate"]  # (the package exports a function of that name)

    plan = plan_from_config(PP_BUFFER_MODEL, "dgx-h100:nodes=1", 16, config)
    result = check_plan(plan)
    for role in result["roles"]:
        for term in terms:
            assert role["errors"]["memory"][term] <= tolerance, (config, role["stage"], role["errors"]["memory"])
    if "interleaved" in config:  # the term is what makes them match
        monkeypatch.setattr(est, "pipeline_buffers",
                            lambda m, received, sent, kept, **_: (0.0, [0.0] * len(sent), 0.0))
        unpriced = predicted_roles(plan)[0]["memory"]["activations"]
        traced = result["roles"][0]["traced"]["memory"]["activations"]
        assert (traced - unpriced) / traced > 0.08, (traced, unpriced)


@pytest.mark.parametrize("config", ["pp=2,dp=4,zero=2,mbs=2,schedule=1f1b",
                                    "pp=2,dp=2,tp=2,zero=3,mbs=2,schedule=1f1b"])
def test_a_tied_embedding_sums_its_gradient_shard(config):
    """A weight tied between the embedding and the head is summed over the pipeline's ends after the reduction;
    under ZeRO 2/3 that is the rank's FSDP2 shard, 1/dp of the copy (priced whole, GPT-3 175B's dp 32 ZeRO-2 plan
    was 32× over: 600 MiB against 18.8 MiB traced)."""
    plan = plan_from_config("gpt:layers=4,hidden=256,heads=4,seq=256,vocab=4096", "dgx-h100:nodes=1", 16, config)
    for role in check_plan(plan)["roles"]:
        assert role["errors"]["collectives"]["all_reduce@pp"] <= 0.02, (role["stage"], role["errors"])


def test_zero_bubble_keeps_no_gradient_of_a_weight_view():
    """Zero-bubble keeps, from a micro-batch's input pass to its weight pass, the gradients at the ops on the
    input's gradient path that read a parameter (torch 2.13's get_param_groups intermediates). The MoE experts read
    their stacked weights through a transpose: the bmm's output gradient is kept, not one of the weight's size per
    view (counted, the last rank's peak was 16.9 % over the trace)."""
    model = "moe:layers=4,hidden=256,heads=4,kv_heads=2,ffn=352,vocab=256,seq=1024,experts=8,top_k=2"
    plan = plan_from_config(model, "dgx-h100:nodes=1", 32, "pp=2,dp=4,mbs=4,schedule=zb,zero=0")
    for role in check_plan(plan)["roles"]:
        assert role["errors"]["memory"]["peak"] <= 0.05, (role["stage"], role["errors"]["memory"])


def test_fsdp_gradient_buffers_at_a_block_backward_match_the_trace():
    """ZeRO-3 with big blocks and small activations: the peak is FSDP's — the block and its prefetched neighbour
    gathered, the block's unsharded gradients and the previous block's reduce-scatter input in flight (torch 2.13
    frees it only when the next block reduces). The cost model held neither gradient buffer: 35 % under."""
    spec = "llama:layers=4,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=1024,seq=128"
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 8, "dp=8,zero=3,mbs=1,ac=none"))
    assert result["memory_error_max"] <= 0.05, result["roles"][0]["errors"]["memory"]


def _loss_parallel_peak(tp: int, own_mode: bool) -> float:
    """torch's MemTracker over a loss_parallel cross-entropy and its backward (4096 tokens, 32000 vocabulary,
    Shard(1) over a tp-rank fake process group), in local slices."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.check.trace import _propagation_off_the_books

    tokens, vocab = 4096, 32000
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        with (_propagation_off_the_books() if own_mode else contextlib.nullcontext()),\
                FakeTensorMode(allow_non_fake_inputs=True):
            logits = DTensor.from_local(torch.randn(tokens, vocab // tp, requires_grad=True), mesh, [Shard(1)])
            target = torch.randint(0, vocab, (tokens,))
            tracker = MemTracker()
            tracker.track_external(logits)
            with tracker, loss_parallel():
                F.cross_entropy(logits, target).backward()
            peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    finally:
        dist.destroy_process_group()
    return peak / (tokens * vocab // tp * 4)


def test_loss_parallel_backward_holds_local_slices_only():
    """torch 2.13's loss_parallel backward runs on the local slices (``_nll_loss_and_log_softmax_backward``: the
    logits, zeros_like, exp and their sum: 5 slices at the peak, at any tp), but its sharding propagator derives
    the output's global shape by running the op on fake tensors of the global shape, which on a GPU hold nothing.
    Under the check's own fake mode torch's MemTracker counted them (10 slices at tp = 4): the check gives the
    propagator a fake mode of its own (`_propagation_off_the_books`), as a GPU run has. The cost model's working set
    (3 slices beyond the saved ones) then conforms on a plan, where it and the check had agreed on 2·tp slices."""
    assert _loss_parallel_peak(2, True) == pytest.approx(5.0, abs=0.01)
    assert _loss_parallel_peak(4, True) == pytest.approx(5.0, abs=0.01)
    assert _loss_parallel_peak(4, False) > 6.0  # (torch's MemTracker as the check entered it before: if torch
    # stops counting the propagator's tensors this fails, and `_propagation_off_the_books` is no longer needed)
    spec = "llama:layers=2,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048"
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 8, "dp=2,tp=4,zero=3,sp=on,mbs=4,ac=full"))
    assert result["memory_error_max"] <= 0.05, result["roles"][0]["errors"]["memory"]


def test_real_tensor_parallel_shards_are_tracked_once():
    """Tensor parallelism without sequence parallelism leaves the norms plain tensors, so the part is built real and
    its DTensors' local shards are real too: each enters the fake step as the fake mode's copy of it, which the
    tracker counted as new memory beside the shard (the vocabulary-parallel head: +62.5 MiB per copy; 6.7 % over the
    cost model's peak before, 0.3 % after)."""
    spec = "llama:layers=2,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048"
    # (fp32: the tracking is under test; under autocast this plan's peak is 2.1 % under, its loss forward)
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 8, "dp=4,tp=2,zero=0,mbs=1,precision=fp32"))
    errors = result["roles"][0]["errors"]["memory"]
    assert result["memory_error_max"] <= 0.02, errors
    # the second micro-batch's arriving gradients are temporaries, not gradients, and the optimizer step's
    # temporaries and in-place updates are not states (torch's MemTracker labels both so): 26-33 % before
    assert errors["grads"] <= 1e-6 and errors["optimizer"] <= 1e-6, errors


FOLD_MODEL = "llama:layers={},hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"


def _mixed(plan, plain: int):
    """``plan`` with its first ``plain`` blocks not checkpointed and the others fully: two runs of like blocks."""
    blocks = [lay.name for lay in plan.layers if lay.name not in ("embed", "head")]
    return plan.with_(layers=tuple(lay if lay.name not in blocks else
                                   replace(lay, ac=AC.NONE if blocks.index(lay.name) < plain else AC.FULL)
                                   for lay in plan.layers))


@pytest.mark.parametrize("layers, batch, config, plain, width", [
    (8, 64, "dp=4,tp=2,zero=3,sp=on,mbs=2,ac=full", 0, 2),  # 3 and 4 of 8 blocks, 2 of 8 micro-batches (ZeRO-3)
    (8, 64, "dp=8,zero=2,mbs=2", 0, 2),  # 3 of 4 micro-batches: ZeRO-2 reshards after the last only
    (12, 32, "pp=2,dp=4,zero=0,mbs=2,schedule=zb", 0, 4),  # each stage 6 blocks; zero-bubble's W actions
    (20, 32, "pp=2,vpp=2,dp=4,zero=0,mbs=2,schedule=interleaved", 0, 8),  # two chunks of 5 blocks per rank
    (12, 16, "dp=8,zero=2,mbs=2", 5, 3),  # runs of 5 plain and 7 checkpointed blocks: three traces side by side
    (12, 16, "dp=8,zero=2,mbs=2", 5, 2),  # on two cores the run of 5 is traced whole: two traces
])
def test_a_folded_trace_equals_the_whole_trace(layers, batch, config, plain, width):
    """A deep plan is traced with each run of like blocks it folds cut to 3 and 4 blocks (one run at a time) and
    2 or 3 micro-batches, and extrapolated; every rank's peak, memory categories, collectives and FLOPs equal those
    of tracing every block and micro-batch."""
    from planner.check.tracers import Tracers

    plan = plan_from_config(FOLD_MODEL.format(layers), "dgx-h100:nodes=1", batch, config)
    if plain:
        plan = _mixed(plan, plain)
    tracers = Tracers()
    tracers.cores = width
    whole, folded = check_plan(plan, fold=False), check_plan(plan, tracers=tracers)
    assert "runs of like blocks extrapolated" in folded["traced_how"], folded["traced_how"]
    if plain:
        assert folded["traced_how"].startswith("traced at 6 and 7 and 7 of 12" if width == 3 else
                                               "traced at 8 and 9 of 12"), folded["traced_how"]
    for w, f in zip(whole["roles"], folded["roles"]):
        w, f = w["traced"], f["traced"]
        for key, value in w["memory"].items():
            assert f["memory"][key] == pytest.approx(value, rel=1e-9), (key, w["peak_at"], f["peak_at"])
        flat = {(k, part): v[part] for k, v in w["collectives"].items() for part in ("count", "bytes")}
        assert {(k, part): v[part] for k, v in f["collectives"].items() for part in ("count", "bytes")} == (
            pytest.approx(flat, rel=1e-9))
        assert f["flops"] == pytest.approx(w["flops"], rel=1e-9)
        assert (f["grad_elements"], f["dp_reduced_elements"]) == pytest.approx(
            (w["grad_elements"], w["dp_reduced_elements"]), rel=1e-9)


def test_folding_follows_runs_of_like_blocks():
    """Each run of like blocks (same checkpointing and tensor-parallel choice, one chunk) it folds is lengthened in
    a trace of its own; runs of at most 4 blocks are traced whole, and so is a longer one where that ends the traces
    sooner (one trace fewer, on the cores there are); a plan with nothing to fold is traced whole."""
    from planner.check.fold import fold_plan, traces_for

    plan = plan_from_config(FOLD_MODEL.format(12), "dgx-h100:nodes=1", 16, "dp=8,zero=2,mbs=2")
    assert fold_plan(plan, cores=2).traced == ({0: [3]}, {0: [4]})
    assert fold_plan(plan, cores=1) is None  # 12 blocks at once end sooner than 3 and then 4 with a start each
    assert fold_plan(_mixed(plan, 5), cores=3).traced == ({0: [3, 3]}, {0: [4, 3]}, {0: [3, 4]})
    assert fold_plan(_mixed(plan, 5), cores=2).traced == ({0: [5, 3]}, {0: [5, 4]})
    assert fold_plan(_mixed(plan, 4), cores=3).traced == ({0: [4, 3]}, {0: [4, 4]})
    interleaved = plan_from_config(FOLD_MODEL.format(20), "dgx-h100:nodes=1", 32,
                                   "pp=2,vpp=2,dp=4,zero=0,mbs=2,schedule=interleaved")
    folding = fold_plan(interleaved, cores=8)
    assert [traces_for(folding, r) for r in (0, 1)] == [[0, 1, 2], [0, 1, 2]]  # each rank: two chunks of 5
    assert fold_plan(plan_from_config(FOLD_MODEL.format(3), "dgx-h100:nodes=1", 16, "dp=8,mbs=2")) is None


def _fold_score(lengths: dict, rank_of: dict, micro: int, width: int, folded: set) -> tuple[int, int]:
    """(when the last trace ends, their total cost) folding the (chunk, run)s in ``folded``, written out."""
    from planner.check.fold import FOLD_BLOCKS, makespan, trace_cost

    costs = []
    for r in sorted(set(rank_of.values())):
        mine = [x for x in folded if rank_of[x[0]] == r]
        blocks = sum(n if (s, k) not in folded else FOLD_BLOCKS
                     for s in lengths if rank_of[s] == r for k, n in enumerate(lengths[s]))
        costs += [trace_cost(blocks, micro)] + [trace_cost(blocks + 1, micro)] * len(mine)
    return makespan(costs, width), sum(costs)


def test_folding_ends_the_traces_soonest():
    """`choose_folds` against every choice: no other set of folded runs ends the traces sooner on the given cores
    (then costs less in all); a rank's runs are folded or not on their own."""
    import itertools

    from planner.check.fold import FOLD_BLOCKS, choose_folds

    cases = [({0: [6, 1, 73]}, {0: 0}, 2, 2), ({0: [5, 7]}, {0: 0}, 1, 3), ({0: [30, 30]}, {0: 0}, 3, 2),
             ({0: [5, 9], 1: [12], 2: [2, 6], 3: [40]}, {0: 0, 1: 1, 2: 0, 3: 1}, 8, 2),
             ({0: [6, 6], 1: [6, 6]}, {0: 0, 1: 1}, 4, 8)]
    for lengths, rank_of, micro, width in cases:
        long = [(s, k) for s in sorted(lengths) for k, n in enumerate(lengths[s]) if n > FOLD_BLOCKS + 1]
        best = min(_fold_score(lengths, rank_of, micro, width, set(c))
                   for n in range(len(long) + 1) for c in itertools.combinations(long, n))
        chosen = choose_folds(lengths, rank_of, micro, width)
        assert _fold_score(lengths, rank_of, micro, width, {x for runs in chosen.values() for x in runs}) == best, (
            lengths, chosen)
    assert choose_folds({0: [6, 1, 73]}, {0: 0}, 2, 2) == {0: [(0, 2)]}  # llama3-70b's: its run of 6 whole


@pytest.mark.parametrize("mbs", [4, 1])
def test_ddp_buckets_are_held_from_the_step_start(mbs):
    """DDP's reducer allocates its gradient buckets, real, when it is built; the trace saw them only as the fake
    copies the backward makes, after the loss's backward had peaked without them (6.5 % under the cost model, which
    holds them throughout, as a GPU does). Placeholders of DDP's own bucket sizes stand in until then.
    With four micro-batches (mbs=1) the runtime set gradients to None each step, so the three unsynchronised
    micro-batches built a second copy of every gradient beside the buckets (16.8 % over); it now zeroes them in
    place, where they stay views into the buckets (`planner.emit.train.train_step_loss`)."""
    result = check_plan(_plan(f"dp=2,zero=0,mbs={mbs}"))
    assert result["memory_error_max"] <= 0.05, result["roles"][0]["errors"]["memory"]
    (role,) = result["roles"]
    # the one bucket, the loss and the gradient norm: a steady-state step synchronises its gradients once (the first
    # step of a run, which starts without gradients, also synchronises its first micro-batch)
    assert role["traced"]["collectives"]["all_reduce@dp"]["count"] == 3



def test_a_cast_hooks_copy_is_charged_after_the_backward():
    """A bf16 reduction hook copies a bucket when the bucket fills; torch's DDP holds every gradient in one bucket
    until its first step is over, so the copy comes when the backward has ended. Charged at the activation peak,
    the cost model was 6.4 % over the trace (gpt-tiny, ZeRO-1, one micro-batch)."""
    result = check_plan(plan_from_config("gpt-tiny", "cpu-local", 8, "dp=2,zero=1,grad_compress=bf16"))
    assert result["memory_error_max"] <= 0.05, result["roles"][0]["errors"]["memory"]


@pytest.mark.parametrize("config, init", [("dp=2,zero=3", "meta"), ("dp=2,zero=0", "meta"),
                                          ("pp=2,mbs=2,schedule=1f1b", "full")])
def test_an_emitted_script_runs_as_the_runtime(tmp_path, config, init):
    """`autopar check --script`: the emitted script's own code (its PLAN, model and inlined, specialised runtime),
    not autopar's, runs a step on the fake world, and does what autopar's runtime does: the same collectives and
    FLOPs, and (initialised on the meta device, as the tracer initialises autopar's) the same memory. Initialised
    whole, a script's model is real on this machine, so its memory is not judged."""
    from planner.emit.script import emit

    plan = _plan(config)
    script = tmp_path / "train.py"
    script.write_text(emit(plan, init=init))
    ran, runtime_ran = check_plan(plan, script=str(script)), check_plan(plan)
    assert str(script) in ran["traced_how"]
    assert ("memory not judged" in ran["traced_how"]) == (init == "full")
    for got, want in zip(ran["roles"], runtime_ran["roles"]):
        assert got["traced"]["collectives"] == want["traced"]["collectives"]
        assert got["traced"]["flops"] == want["traced"]["flops"]
        assert got["traced"]["dp_reduced_elements"] == want["traced"]["dp_reduced_elements"]
        if init == "meta":  # (a DDP part is real after materialising: the script's rotary tables are its own)
            for part, nbytes in want["traced"]["memory"].items():
                assert got["traced"]["memory"][part] == pytest.approx(nbytes, rel=0.01, abs=1024), part


@pytest.mark.parametrize("schedule", ["interleaved", "zb"])
def test_fsdp_stages_beyond_torchs_window_are_gathered_once(schedule):
    """torch 2.13 lowers the multi-stage schedules keeping at most 3 of a rank's stages unsharded and gathers an
    evicted one again at its next compute; the runtime widens that window to the rank's stages
    (`planner.emit.runtime._stages_stay_unsharded`), so with vpp = 4 under ZeRO-2 each stage is gathered once per step
    as the cost model prices it (torch's window: rank 0 gathered 2.8 times as much, 64 % over the prediction)."""
    plan = plan_from_config(PP_BUFFER_MODEL, "dgx-h100:nodes=1", 16,
                            f"pp=2,dp=4,vpp=4,mbs=1,schedule={schedule},zero=2")
    result = check_plan(plan)
    assert result["comm_error_max"] <= 0.02, [role["errors"]["collectives"] for role in result["roles"]]
    assert result["memory_error_max"] <= 0.05, [role["errors"]["memory"] for role in result["roles"]]


def test_interleaved_peak_with_chunks_of_different_weight():
    """Interleaved pp = 2, v = 2, m = 8: rank 0 holds 3 and 2 micro-batches in its chunks at its first backward and
    4 and 1 later (`costmodel.memory.interleaved_states`). With no AC in the first chunks and full AC in the second,
    the later state is the heavier: priced from the first state only, rank 0's peak was 16 % under the trace. The
    prediction is never more than 5 % under the traced peak (a plan the search offers fits) on either rank."""
    plan = plan_from_config(PP_BUFFER_MODEL, "dgx-h100:nodes=1", 16,
                            "pp=2,dp=4,vpp=2,mbs=1,schedule=interleaved,zero=1")
    light = {2, 3}  # the ranks' second chunks
    plan = replace(plan, layers=tuple(replace(layer, ac=AC.FULL if layer.stage in light and layer.name != "head"
                                              else AC.NONE) for layer in plan.layers))
    for role in check_plan(plan)["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert 0.95 * traced <= predicted <= 1.12 * traced, (role["ranks"], predicted, traced)


def test_gradients_ddp_leaves_alone_outlive_the_step():
    """With any DDP module the runtime zeroes gradients in place (`planner.emit.train.zeroes_grads_in_place`), so
    the experts' gradients, which DDP ignores (they reduce over edp), are held from the step's start as DDP's
    buckets are. The trace dropped them and took them for bucket views, untracked, and labelled the buckets'
    placeholders temporaries: the first stage's gradients traced 0 B of the 6.9 GiB priced, its peak 9.3 % under
    (a 4-block MoE at seq 8192, dp4 pp2 ep4 1F1B)."""
    model = "moe:layers=4,hidden=1024,heads=8,kv_heads=4,ffn=2048,vocab=32000,seq=512,experts=8,top_k=1"
    # (fp32: the gradients' tracking is under test; under autocast the prediction of stage 0's peak is 4.4 % over)
    plan = plan_from_config(model, "dgx-h100:nodes=1", 32, "pp=2,dp=4,ep=4,mbs=2,schedule=1f1b,zero=0,precision=fp32")
    for role in check_plan(plan)["roles"]:
        assert role["errors"]["memory"]["grads"] <= 0.01, (role["stage"], role["errors"]["memory"])
        assert role["errors"]["memory"]["peak"] <= 0.05, (role["stage"], role["errors"]["memory"])


#: models whose weights outweigh their activations (16 and 32 tokens, 32000 words; GPT's tied to its head): their
#: peaks are where parameters and gradients are in flight, not where activations are
WIDE = "llama:layers=2,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=32000,seq=16"
TIED = "gpt:layers=2,hidden=256,heads=4,vocab=32000,seq=32"


@pytest.mark.parametrize("model, cluster, batch, config, before", [
    # a new weight gradient beside the held one (AccumulateGrad adds it in place): DDP's bucket views
    (WIDE, "cpu-local", 4, "dp=2,zero=0,mbs=1", 0.087),
    (WIDE, "dgx-h100:nodes=1", 32, "dp=8,zero=0,mbs=1,precision=bf16", 0.082),  # (traced under autocast)
    # ... and pipelined FSDP's unsharded accumulators, micro-batches after the first
    (WIDE, "dgx-h100:nodes=1", 32, "dp=4,pp=2,zero=2,mbs=1,schedule=1f1b", 0.202),
    # FSDP's root unit in flight: its all-gather buffer kept to the first block's, its reduce-scatter input
    (WIDE, "dgx-h100:nodes=1", 32, "dp=8,zero=3,mbs=1", 0.133),
    (WIDE, "dgx-h100:nodes=1", 8, "dp=8,zero=3,mbs=1", 0.140),
    (WIDE, "dgx-h100:nodes=1", 32, "dp=8,zero=2,mbs=1", 0.503),
    (WIDE, "dgx-h100:nodes=1", 8, "dp=8,zero=2,mbs=1", 0.140),
    # ZeRO-1 keeps whole tensors' states: the embedding's two moments on one rank of 8
    (WIDE, "dgx-h100:nodes=1", 32, "dp=8,zero=1,mbs=1,precision=fp32", 0.304),
    # a weight tied between the embedding and the head: the head's gradient in autograd's buffer through the
    # backward, three copies at the embedding's; under ZeRO-3 beside the gathered root
    (TIED, "dgx-h100:nodes=1", 32, "dp=8,zero=0,mbs=2,ac=full,precision=fp32", 0.288),
    (TIED, "dgx-h100:nodes=1", 32, "dp=8,zero=3,mbs=2,ac=full", 0.565),
    # ... at 256 tokens, where the logits' gradient meets them: ZeRO-3's root unshard at the head's backward keeps
    # its flat all-gather output through the copy-out (and the head's new unsharded gradient after it)
    (WIDE.replace("seq=16", "seq=256"), "dgx-h100:nodes=1", 8, "dp=8,zero=3,mbs=1", 0.230),
    (TIED.replace("seq=32", "seq=256"), "dgx-h100:nodes=1", 8, "dp=8,zero=3,mbs=1", 0.138),
    # (the embedding's gradient at its chunk's last backward; autocast caches the matmuls' weights only)
    ("llama:layers=4,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=32000,seq=256", "dgx-h100:nodes=1", 16,
     "dp=4,pp=2,zero=0,mbs=1,schedule=1f1b,precision=bf16", 0.050),
])
def test_peaks_where_weights_are_in_flight_match_the_trace(model, cluster, batch, config, before):
    """Where weights, not activations, set the peak, the trace found moments the cost model did not hold (each
    ``before`` under the traced peak): a layer's new weight gradient beside the ``.grad`` it is added into
    (`costmodel.layercost.weight_grad_working_set`, `costmodel.memory.grads_accumulate`; the embedding's dense one at
    its chunk's last backward, its micro-batch's other activations gone), FSDP's root unit at the ends of a
    micro-batch (`costmodel.memory.fsdp_edge_bytes`) and gathered for the head's and the embedding's weight
    gradients (`fsdp_root_bytes`), ZeRO-1's partition of whole tensors (`zero1_partition_numel`) and a tied weight's
    gradients in flight (`costmodel.estimate.Evaluator.tied_in_flight_bytes`). Now each peak is within the check's
    tolerance, and not under the trace by more than 3 % (the tied model under ZeRO-3 at 256 tokens: 2.6 %)."""
    result = check_plan(plan_from_config(model, cluster, batch, config))
    for role in result["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert role["errors"]["memory"]["peak"] <= 0.05 and predicted >= 0.97 * traced, (
            role["stage"], predicted / 2**20, traced / 2**20, before)


@pytest.mark.parametrize("model, config, before", [
    # the head's backward: its root gathered and the top block's all-gather output prefetched
    (WIDE, "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b", (0.035, -0.202)),
    ("moe:layers=2,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=16000,seq=32,experts=4,top_k=2",
     "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b", (0.091, -0.181)),
    # the root's copy-out beside the top block and the next one's buffer (no head in the chunk); the lowest block's
    # backward with the chunk gathered whole
    ("llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=768,vocab=8000,seq=256", "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b",
     (-0.050, -0.047)),
    ("llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=768,vocab=8000,seq=256",
     "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b,ac=full", (0.203, -0.055)),
])
def test_pipelined_zero3_gathers_as_its_backward_runs(model, config, before):
    """Under pipelining FSDP2 reshards a chunk after each forward and leaves it gathered after each backward, so a
    backward gathers its chunk unit by unit (`costmodel.memory.fsdp_chunk_gathered`) unless the state holds it
    gathered already (its last pass was a backward). The cost model charged the chunk per state only, and a block's
    root and two blocks on top of any state: the head's backward was under by up to 20 %, a gathered state's blocks
    counted twice (``before``: each stage's error, predicted / traced − 1). Now each is within 2 %."""
    result = check_plan(plan_from_config(model, "dgx-h100:nodes=1", 32, config))
    for role in result["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert role["errors"]["memory"]["peak"] <= 0.02 and predicted >= 0.99 * traced, (
            role["stage"], predicted / 2**20, traced / 2**20, before)


def test_a_stage_holding_no_block_is_traced():
    """Two blocks over four interleaved stages leave the last stage the final norm and the head alone; the trace
    gave each stage its first block's input as what it receives, and failed there (a KeyError). It receives the
    last block's output, and the plan conforms."""
    result = check_plan(plan_from_config(WIDE, "dgx-h100:nodes=1", 32,
                                         "dp=4,pp=2,vpp=2,zero=3,mbs=1,schedule=interleaved"))
    assert len(result["roles"]) == 2
    for role in result["roles"]:
        assert role["errors"]["memory"]["peak"] <= 0.05, (role["stage"], role["predicted"]["memory"],
                                                          role["traced"]["memory"])


@pytest.mark.parametrize("config", ["dp=8,zero=3,mbs=2,ac=full", "dp=8,zero=2,mbs=4"])
def test_fsdp_pads_its_shards_as_torch_does(config):
    """FSDP2 shards dim 0 in ``torch.chunk``'s padded chunks (`costmodel.memory.fsdp_padding_numel`): a grouped
    expert weight of 4 experts on 8 ranks is a whole expert on each, twice the even share, and it gathers and
    reduce-scatters 8 (`costmodel.estimate.Evaluator.gathered_numel`). The model states match the trace (they were
    1.5 MiB of gradients and 3 MiB of moments under), and so do the all-gathers and reduce-scatters (21 % under)
    and ZeRO-3's peak, a middle block's backward with the block gathered, the next one's padded buffer and the
    previous one's padded reduce-scatter input (with 2 blocks, whose peak was the first block's forward, 9.4 %
    under). ZeRO-2's peak is over (the head's backward, which the trace reaches with the logits freed), its gathered
    parameters exact (20 % under). (Befores measured on the 2-block model.)"""
    model = "moe:layers=3,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=16000,seq=32,experts=4,top_k=2"
    (role,) = check_plan(plan_from_config(model, "dgx-h100:nodes=1", 32, config))["roles"]
    # (each term is its own maximum: ZeRO-2's predicted peak comes before any gradient shard, so the gradients do not
    # compare there)
    for part in ("grads", "optimizer", "peak") if "zero=3" in config else ("params", "optimizer"):
        assert role["errors"]["memory"][part] <= 0.01, (part, role["predicted"]["memory"], role["traced"]["memory"])
    assert role["predicted"]["memory"]["peak"] >= role["traced"]["memory"]["peak"]
    assert max(role["errors"]["collectives"].values()) == 0.0, role["errors"]["collectives"]


@pytest.mark.parametrize("config", ["dp=4,pp=2,vpp=2,zero=3,mbs=2,schedule=interleaved",
                                    "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b", "dp=4,pp=2,zero=2,mbs=4,schedule=1f1b"])
def test_pipelined_fsdp_states_match_the_trace(config):
    """Pipelined FSDP (torch 2.13's PipelineStage: no gradient sync, no reshard after backward) accumulates a
    chunk's unsharded gradients from its first backward and makes the shards only after the last; under ZeRO 3 a
    forward reshards the chunk and a backward leaves it gathered. The cost model held all of it at every state:
    6.9 % (interleaved), 8.1 / 13.5 % (1F1B, m = 8) and 5.7 % (ZeRO-2, m = 2, rank 0's peak in its first backward)
    over the trace; per state (`costmodel.memory.held_states`) within 5 %."""
    spec = "llama:layers=8,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048"
    result = check_plan(plan_from_config(spec, "dgx-h100:nodes=1", 32, config))
    for role in result["roles"]:
        assert role["errors"]["memory"]["peak"] <= 0.05, (role["stage"], role["errors"]["memory"])


@pytest.mark.parametrize("config", ["dp=8,zero=2,mbs=1", "dp=4,cp=2,zero=3,mbs=1,ac=full"])
def test_the_embeddings_backward_holds_the_lowest_blocks_reduction(config):
    """FSDP2 frees a unit's reduce-scatter input only when the next unit reduces, so the lowest block's is still held
    while the token embedding (in the root unit, which reduces last) runs its backward, beside the three copies of a
    tied weight's gradient (`costmodel.memory.fsdp_reduce_in_flight_bytes`). The cost model left it out: the peak
    was 6.6 % (ZeRO-2) and 6.7 % (ZeRO-3 with context parallelism) under. Now within 1 %."""
    model = "gpt:layers=3,hidden=192,heads=6,vocab=5000,seq=64"
    (role,) = check_plan(plan_from_config(model, "dgx-h100:nodes=1", 32, config))["roles"]
    assert "embeddings" in role["traced"]["peak_at"], role["traced"]["peak_at"]
    predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
    assert abs(predicted / traced - 1) <= 0.01, (predicted / 2**20, traced / 2**20)


@pytest.mark.parametrize("config, before", [
    ("dp=8,zero=0,mbs=1,ac=full", "-7.0 %"),
    ("dp=4,tp=2,zero=0,mbs=1,ac=full", "+6.5 %"),
    ("dp=4,pp=2,zero=0,mbs=1,ac=full", "-7.3 % / -6.7 %"),
    ("dp=4,pp=2,vpp=2,zero=0,mbs=1,ac=none,schedule=interleaved", "-2.2 % / -0.2 %"),
])
def test_autocast_holds_what_the_cost_model_prices(config, before):
    """Autocast keeps a weight's 16-bit copy to the end of its region, and autograd runs a backward's nodes latest
    first: a micro-batch's backward reaching a copy an earlier micro-batch made runs its cast-back after all its own
    nodes, holding every 16-bit weight gradient to its end (measured on real tensors: 8 of 8 alive at the second
    micro-batch's embedding backward, none at the first's). The runtime's one region over the step held them
    unpriced, and its copies were priced after the backward, where the region had ended (``before``: predicted /
    traced − 1). Now outside a pipeline each micro-batch has a region of its own; a pipeline's, over torch's
    schedule, is priced in the states after a chunk's first backward (`costmodel.estimate.Evaluator.
    autocast_held_bytes`); and the all-reduce after the backward packs its buckets with no small first one."""
    model = "llama:layers=6,hidden=320,heads=4,kv_heads=2,ffn=864,vocab=3001,seq=96"
    for role in check_plan(plan_from_config(model, "dgx-h100:nodes=1", 32, f"{config},precision=bf16"))["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        # (within 1 %, but the 1F1B last stage's cast-backs: −1.0 %, its input's gradient beside them unpriced)
        assert -0.015 <= predicted / traced - 1 <= 0.02, (role["stage"], predicted / 2**20, traced / 2**20, before)



def test_sequence_parallelism_splits_a_replicated_ops_tokens_not_its_weight_copies():
    """Under autocast an op that casts a weight autocast does not cache (a grouped expert weight, cast through a
    transpose) saves a 16-bit copy of the weight per call (`profiler.graph.NodeInfo.saved_weight_bytes`). Sequence
    parallelism splits a replicated op's tokens over tp, not that copy: the cost model split both, and a MoE under
    GPipe, 32 micro-batches in flight, was priced at half its traced peak (−48 % / −43 %). Now within 3 % over."""
    model = "moe:layers=3,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=4000,seq=64,experts=4,top_k=2"
    config = "dp=1,tp=4,pp=2,zero=0,mbs=1,ac=none,sp=on,schedule=gpipe,precision=bf16"
    for role in check_plan(plan_from_config(model, "dgx-h100:nodes=1", 32, config))["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert 0.0 <= predicted / traced - 1 <= 0.03, (role["stage"], predicted / 2**20, traced / 2**20)


_AUTOCAST_RUN = """
import json, sys, torch, torch.distributed as dist
from planner.emit import runtime as rt, train as tr
from planner.emit.config import runtime_config
from planner.validate.loop import plan_from_config
from profiler.zoo.registry import resolve_model

spec = sys.argv[2]
tr.autocast = lambda plan, device: torch.autocast("cpu", dtype=torch.bfloat16)  # (what a GPU runs: CUDA's)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
losses, policy = {}, None
for ac in ("selective", "full"):
    plan = plan_from_config(spec, "dgx-h100:nodes=1:gpus_per_node=1", 8, f"dp=1,mbs=1,ac={ac},precision=bf16")
    source = resolve_model(plan.model).with_seq(plan.seq)
    def build():
        return source.build(batch=1, seq=plan.seq, device="meta")[0]
    with torch.device("meta"):
        config = runtime_config(plan, build(), init="meta", optimizer="adamw")
    par = rt.parallelize(build, config, rt.build_mesh(config, "cpu"))
    optimizer = tr.build_optimizer(par, config)
    policy = plan.selective or policy
    x, y = tr.synthetic_batch(0, batch=8, seq=plan.seq, vocab=2048, seed=0)
    losses[ac] = [float(tr.train_step_loss(par, optimizer, x, y)) for _ in range(2)]
dist.destroy_process_group()
print(json.dumps({"losses": losses, "policy": policy}))
"""


@pytest.mark.parametrize("spec, policy", [
    ("llama:layers=3,hidden=256,heads=4,kv_heads=2,ffn=704,vocab=2048,seq=64", "every-other-matmul"),
    ("gpt:layers=3,hidden=256,heads=4,vocab=2048,seq=64,attention=math,dropout=0", "attention-core"),
    (UNFUSED, "all-but-attention-core")])
def test_selective_checkpointing_trains_under_autocast(tmp_path, spec, policy):
    """Real tensors, one gloo rank, the runtime's own step under CPU autocast (what CUDA's is on a GPU): with
    autocast's weight cache, a selectively checkpointed block's forward (the first in its region) cast its weights
    and the recomputation found them cached, and torch's replay of the forward's ops failed at the first backward
    ("aten.mul.Scalar encountered during backward but not found in storage": llama 3 × 256 with 4 heads; where the
    shapes agree, it would serve one cast's kept output for another's, silently). A block under one of torch's
    selective checkpoint policies now runs with the cache off (`planner.emit.runtime._WithoutCastCache`); one whose
    attend call is checkpointed keeps it. Each of the three policies trains to the same losses, bit for bit, as
    full checkpointing with the cache."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _AUTOCAST_RUN, str(tmp_path / "pg"), spec], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["policy"] == policy
    assert out["losses"]["selective"] == out["losses"]["full"], out


@pytest.mark.parametrize("model", [
    "llama:layers=3,hidden=256,heads=4,kv_heads=2,ffn=704,vocab=4096,seq=64",
    "gpt:layers=3,hidden=256,heads=4,vocab=4096,seq=128,attention=math,dropout=0",
    UNFUSED])
@pytest.mark.parametrize("config", ["dp=8,zero=0,mbs=1", "dp=4,pp=2,zero=0,mbs=1"])
def test_selective_checkpointing_under_autocast_costs_what_it_holds(model, config):
    """Under autocast a block under one of torch's selective checkpoint policies keeps no 16-bit copy of its weights
    (the cache off, the copies recast: `planner.emit.runtime._WithoutCastCache`), and the cost model prices none in
    the cache, its recomputation's in its backward (`costmodel.layercost.layer_cost`); a block whose attend call is
    checkpointed (``attention-core``) keeps the cache, as without checkpointing. The llama's 64-wide heads at seq 64
    were read as an attention core, which took the policy that keeps every op's output (−2.7 % / −3.7 %); the
    GPT's unfused core, under that policy, held more than no checkpointing."""
    plan = plan_from_config(model, "dgx-h100:nodes=1", 32, f"{config},ac=selective,precision=bf16")
    for role in check_plan(plan)["roles"]:
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert -0.015 <= predicted / traced - 1 <= 0.025, (role["stage"], predicted / 2**20, traced / 2**20)


@pytest.mark.parametrize("model, config, policy", [
    ("gpt:layers=3,hidden=256,heads=4,vocab=4096,seq=128,attention=math,dropout=0", "dp=8,zero=0,mbs=2",
     "attention-core"),
    (UNFUSED, "dp=8,zero=0,mbs=2", "all-but-attention-core"),
    (UNFUSED, "dp=4,tp=2,zero=0,mbs=2", "all-but-attention-core"),
    (UNFUSED, "dp=4,tp=2,zero=2,mbs=2,sp=on", "all-but-attention-core")])
def test_selective_checkpointing_holds_what_its_policy_keeps(model, config, policy):
    """Selective checkpointing of an unfused attention core, as the runtime runs it and the trace holds it: a core in
    an ``attend`` method is checkpointed whole (Megatron-LM's checkpointed core attention), which holds less than no
    checkpointing (it held more when every op's output outside the core was kept: traced 81.8 MiB against 78.7,
    priced at 77.3); a core inline in the block runs torch's selective checkpoint keeping every op's output but the
    core's, tensor-parallel collectives' and their copies included, which the cost model now prices as kept (it
    priced autograd's saved set: −3.9 % at dp 8, −4.0 % at tp 2, −16.7 % under sequence parallelism)."""
    peaks = {}
    for ac in ("selective", "none"):
        plan = plan_from_config(model, "dgx-h100:nodes=1", 32, f"{config},ac={ac},precision=fp32")
        (role,) = check_plan(plan)["roles"]
        peaks[ac] = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        if ac == "selective":
            assert plan.selective == policy
    predicted, traced = peaks["selective"]
    assert -0.03 <= predicted / traced - 1 <= 0.02, (predicted / 2**20, traced / 2**20)
    if policy == "attention-core":
        assert traced < peaks["none"][1] and predicted < peaks["none"][0]


def test_the_tensor_parallel_sum_after_the_backward_is_priced():
    """Under sequence parallelism a MoE's router and experts are plain parameters whose gradient each TP rank makes
    from its slice of the tokens; the runtime sums them over tp after the backward in one flat copy per bucket
    (`planner.emit.runtime.reduce_tp_partial_grads`), the step's peak beside every gradient: 18 MiB here, priced at
    nothing (−13 % for any checkpointing). Now `Evaluator.tp_partial_bucket`, in the estimate and the ILP."""
    model = "moe:layers=3,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=4000,seq=64,experts=4,top_k=2"
    for ac in ("none", "full"):
        plan = plan_from_config(model, "dgx-h100:nodes=1:gpus_per_node=4", 32,
                                f"dp=1,tp=4,zero=0,mbs=4,ac={ac},sp=on,precision=fp32")
        (role,) = check_plan(plan)["roles"]
        predicted, traced = role["predicted"]["memory"]["peak"], role["traced"]["memory"]["peak"]
        assert -0.01 <= predicted / traced - 1 <= 0.01, (ac, predicted / 2**20, traced / 2**20)


def test_a_block_whose_linears_sit_in_it_reduces_each_input_alone():
    """examples/custom_model.py keeps its projections directly in the block: tensor parallelism gives each column
    linear its plain input, and each all-reduces its input's gradient alone (q, k and v: three, where a module
    holding them shares one replicated input and one reduction, `planner.emit.runtime.apply_tp`'s ``sp_gather``).
    The cost model priced one per source: the trace moved 30 % more over tp. Now every TP term conforms."""
    example = f"{Path(__file__).parent.parent / 'examples' / 'custom_model.py'}:factory"
    (role,) = check_plan(plan_from_config(example, "dgx-h100:nodes=1", 32, "dp=4,tp=2,zero=2,mbs=8,sp=off"))["roles"]
    tp = {kind: err for kind, err in role["errors"]["collectives"].items() if kind.endswith("@tp")}
    assert tp and max(tp.values()) <= 0.02, tp
