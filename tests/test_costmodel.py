"""Closed forms and properties of the cost model (costmodel/estimate.py and friends)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from costmodel.cluster import dump_cluster, load_cluster, parse_cluster_yaml
from costmodel.config import AC, ParallelConfig, Schedule, parse_kv
from costmodel.estimate import ConfigError, Evaluator, estimate, even_stages, split_layers
from costmodel.memory import (
    CUDA_CONTEXT_BYTES,
    NCCL_COMM_BYTES,
    NCCL_COMM_BYTES_PAIR,
    NCCL_P2P_PEER_BYTES,
    communicators,
    inflight,
    module_param_bytes,
    runtime_reserved_bytes,
    state_bytes_per_param,
)
from costmodel.overlap import dp_exposed, dp_step_bytes, fsdp_exposed, fsdp_serial_time
from profiler.api import profile_model

GPT = "gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192,dropout=0"


@pytest.fixture(scope="module")
def gpt():
    return profile_model(GPT)


def _cluster(nodes=1, inter_bw=24, intra_bw=230, memory_gib=80):
    return parse_cluster_yaml(f"""
name: test
device: {{name: t, peak_tflops: {{bf16: 312, fp32: 19.5}}, memory_GiB: {memory_gib}, hbm_bw_GBps: 2039,
          matmul_eff: {{e_max: 0.7, f_half_gflop: 2}}, memory_eff: 0.8}}
gpus_per_node: 8
nodes: {nodes}
intra: {{bw_GBps: {intra_bw}, latency_us: 3}}
inter: {{bw_GBps: {inter_bw}, latency_us: 8}}
""", "test.yaml")


def cfg(s: str) -> ParallelConfig:
    return ParallelConfig(**parse_kv(s))


# ------------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("zero,expected", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 16 / 8), (3, 16 / 8)])
def test_zero_model_states_follow_the_zero_paper(zero, expected):
    """Rajbhandari et al. 2020 §3.1/Fig. 1: 2Ψ + 2Ψ + KΨ with K = 12, partitioned over N_d = 8 by stage, for
    16-bit parameters beside a master copy (Megatron-LM's distributed optimizer: ``autocast=False``); stage 2 as
    FSDP2 runs it (the runtime's ZeRO-2), whose gradient shard is fp32: 2Ψ/N more than the paper's 2 + 14/N."""
    p, g, k = state_bytes_per_param("bf16", zero, 8, autocast=False)
    assert p + g + k == pytest.approx(expected)


@pytest.mark.parametrize("zero,expected", [(0, (4, 4, 8)), (1, (4, 4, 1)), (2, (2 + 4 / 8, 4 / 8, 1))])
def test_zero_0_and_1_keep_fp32_parameters_under_autocast(zero, expected):
    """autopar's runtime trains DDP and ZeroRedundancyOptimizer plans in 16 bits with ``torch.autocast`` over the
    module's fp32 parameters (`planner.emit.train.autocast`): fp32 parameters and gradients, Adam's two fp32
    moments and no master copy, ZeRO-1 sharding the moments only: 8 + 8/N bytes, not the paper's 4 + 12/N, plus
    autocast's cached 16-bit copy of the weights it casts, per layer (`test_autocast_caches_the_matmuls_weights`).
    ZeRO 2/3 run FSDP2, which casts itself. fp32 training: no copy."""
    assert state_bytes_per_param("bf16", zero, 8) == pytest.approx(expected)
    assert state_bytes_per_param("fp32", zero, 8) == state_bytes_per_param("fp32", zero, 8, autocast=False)
    cfg = ParallelConfig(dp=8, zero=zero, precision="bf16")
    assert module_param_bytes(cfg) == (4 if zero <= 1 else 2) and module_param_bytes(cfg, autocast=False) == 2
    assert dp_step_bytes(cfg, 1.0, 1).get("broadcast", 4.0) == 4.0  # ZeRO-1 broadcasts the fp32 parameters


def test_plans_under_autocast_keep_activations_at_autocasts_dtypes():
    """A 16-bit DDP plan trains under ``torch.autocast``: its residual stream, norm inputs and loss stay fp32, so it
    keeps more activation bytes than the same plan in FSDP's pure 16 bits and fewer than in fp32; priced from the
    model captured under autocast (`LayerGraph.under_autocast`), which prices no FSDP plan."""
    lg = profile_model("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=128")
    cluster, acts = _cluster(), {}
    for name, s in (("ddp", "dp=8,zero=0"), ("fsdp", "dp=8,zero=3"), ("fp32", "dp=8,zero=0,precision=fp32")):
        ev = Evaluator(lg, cluster, cfg(s), 8)
        acts[name] = sum(ev.cost(i, AC.NONE).act_bytes for i in range(len(lg.layers)))
        assert bool(ev.lg.model.arch.get("autocast")) == (name == "ddp")
    assert acts["fsdp"] < acts["ddp"] < acts["fp32"] == pytest.approx(2 * acts["fsdp"])
    with pytest.raises(ValueError, match="autocast"):
        Evaluator(lg.under_autocast(), cluster, cfg("dp=8,zero=3"), 8)
    assert Evaluator(lg, cluster, cfg("dp=8,zero=0"), 8, autocast=False).lg is lg  # Megatron's 16-bit parameters


def test_fsdp_zero2_in_fp32_keeps_its_shard_beside_the_unsharded_parameters():
    """fp32, ZeRO-2 over 4 ranks: unsharded parameters (4) + FSDP's fp32 shard (4/4), gradient shard 4/4, Adam 8/4
    (what `autopar check` traces: parameters 381 MiB = 305 MiB unsharded + 76 MiB shard on a 80M-parameter rank)."""
    assert state_bytes_per_param("fp32", 2, 4) == pytest.approx((4 + 1, 1, 2))


def test_zero_stage_never_increases_memory(gpt):
    cl = _cluster()
    peaks = [estimate(gpt, cl, cfg(f"dp=8,zero={z}"), 64).memory.peak for z in range(4)]
    assert peaks == sorted(peaks, reverse=True)
    assert peaks[3] < peaks[0]


def test_autocast_caches_the_matmuls_weights(gpt):
    """Under autocast (DDP, ZeRO-1) the parameter bytes hold 2 more per element of each linear's weight and bias,
    the tied head's weight included, and none for the embedding's own use or the norms' (autocast runs those in
    fp32); fp32 training caches nothing."""
    import torch

    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(gpt.model.name).build(batch=1, seq=16, device="meta")
    linears = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    plain = estimate(gpt, _cluster(), cfg("dp=8,zero=0,precision=fp32"), 64).memory.params
    cast = estimate(gpt, _cluster(), cfg("dp=8,zero=0,precision=bf16"), 64).memory.params
    assert plain == 4 * gpt.model.num_params
    assert cast - plain == pytest.approx(2 * linears, rel=1e-9)
    assert 2 * linears < 2 * gpt.model.num_params


def test_estimate_model_states_match_zero_formula(gpt):
    """The ZeRO paper's model states, but ZeRO-1's optimizer: torch's ZeroRedundancyOptimizer partitions whole
    tensors, so its most loaded rank keeps more than 1/dp (`costmodel.memory.zero1_partition_numel`; traced by
    `tests/test_check.py`)."""
    from costmodel.memory import zero1_partition_numel

    cl = _cluster()
    psi = gpt.model.num_params
    for z in range(4):
        m = estimate(gpt, cl, cfg(f"dp=8,zero={z}"), 64).memory
        p, g, k = state_bytes_per_param("bf16", z, 8)
        # (and under autocast, DDP and ZeRO-1, its cached 16-bit copies of the matmuls' weights)
        cached = 2 * sum(q.numel for q in gpt.model.params if "norm" not in q.fqn
                         and "pos" not in q.fqn) if z <= 1 else 0
        assert m.params == pytest.approx(p * psi + cached, rel=1e-9)
        assert m.grads == pytest.approx(g * psi, rel=1e-9)
        if z == 1:
            tensors = [(q.numel, len(q.shape) >= 2, q.shape[0]) for q in gpt.model.params if not q.is_buffer]
            assert sum(n for n, _, _ in tensors) == psi
            assert m.optimizer == pytest.approx(k * 8 * zero1_partition_numel(tensors, 8), rel=1e-9)
            assert m.optimizer > k * psi
        else:
            assert m.optimizer == pytest.approx(k * psi, rel=1e-9)


def test_zero1_partition_is_torchs_own():
    """`zero1_partition_numel` against torch 2.13's own ``ZeroRedundancyOptimizer`` partition of random tensors in
    two parameter groups (matrices, then vectors, as the runtime builds them), on a fake process group."""
    import random

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from costmodel.memory import zero1_partition_numel

    rng = random.Random(0)
    for world in (2, 3, 8):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for _ in range(10):
                mats = [torch.nn.Parameter(torch.empty(rng.randint(1, 64), rng.randint(1, 64)))
                        for _ in range(rng.randint(1, 12))]
                vecs = [torch.nn.Parameter(torch.empty(rng.randint(1, 64))) for _ in range(rng.randint(0, 6))]
                groups = [{"params": mats}] + ([{"params": vecs}] if vecs else [])
                opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.SGD, lr=0.1)
                most = max(sum(p.numel() for g in rank for p in g["params"]) for rank in opt._partition_parameters())
                sizes = [(p.numel(), True, p.shape[0]) for p in mats] + [(p.numel(), False, p.shape[0]) for p in vecs]
                assert zero1_partition_numel(sizes, world) == most
        finally:
            dist.destroy_process_group()


def test_inflight_micro_batches_per_schedule():
    assert inflight(Schedule.GPIPE, 4, 1, 0, 16) == 16
    assert [inflight(Schedule.ONE_F_ONE_B, 4, 1, r, 16) for r in range(4)] == [4, 3, 2, 1]
    # Korthikanti et al. 2022 eq. 5: the first stage holds p(1 + (p-1)/(p·v)) micro-batches' worth
    assert inflight(Schedule.INTERLEAVED, 4, 2, 0, 16) == pytest.approx(4 * (1 + 3 / 8))
    assert inflight(Schedule.ONE_F_ONE_B, 8, 1, 0, 2) == 2  # never more than m



def test_interleaved_chunks_trade_micro_batches_over_the_step():
    """torch's interleaved schedule (read off its own order: `costmodel.memory.interleaved_states`) keeps the same
    number of chunk-micro-batches at its peaks (a state of fewer after a backward counts too, for what the backward
    left: `test_states_hold_what_came_before_them`), but moves them between chunks: the state at the first backward is
    one of several (the 70B plan's rank 0 at pp = 4, v = 5, m = 16 also holds 8, 8 and 7 in its first three)."""
    from costmodel.memory import held_states, inflight_chunks, interleaved_states

    for pp, vpp, m in ((4, 5, 16), (2, 2, 8), (2, 4, 8), (4, 2, 3), (2, 3, 2)):
        for r in range(pp):
            first = tuple(inflight_chunks(Schedule.INTERLEAVED, pp, vpp, r, m))
            states = interleaved_states(pp, vpp, r, m)
            assert first in states and max(sum(s) for s in states) == sum(first), (pp, vpp, m, r, states)
            assert all(max(s) <= m for s in states)
            assert {full for full, *_ in held_states(Schedule.INTERLEAVED, pp, vpp, r, m)} == set(states)
    assert (8.0, 8.0, 7.0, 0.0, 0.0) in interleaved_states(4, 5, 0, 16)
    assert {(3.0, 2.0), (4.0, 1.0)} <= set(interleaved_states(2, 2, 0, 8))


def test_states_hold_what_came_before_them():
    """A peak state (`costmodel.memory.held_states`: after each forward, as each backward starts) holds, per chunk,
    the micro-batches in flight, the gradients once a backward ran on it (where the runtime frees them between
    steps) and, pipelined ZeRO 3, the parameters its last backward left gathered; read off torch's own orders.
    1F1B reaches its p − r micro-batches again after a backward only when m > p − r; GPipe's most come before any
    backward; with no pipeline, one micro-batch holds no gradient and a second does."""
    from costmodel.memory import grads_held_at_peak, held_states

    one_f_one_b = Schedule.ONE_F_ONE_B
    assert held_states(one_f_one_b, 4, 1, 0, 4) == (((3.0,), (0.0,), (1.0,), (1.0,)), ((4.0,), (0.0,), (0.0,), (0.0,)))
    assert held_states(one_f_one_b, 4, 1, 0, 5) == (((3.0,), (0.0,), (1.0,), (1.0,)), ((4.0,), (0.0,), (1.0,), (0.0,)))
    gpipe = Schedule.GPIPE
    assert held_states(gpipe, 2, 1, 1, 3) == (((2.0,), (0.0,), (1.0,), (1.0,)), ((3.0,), (0.0,), (0.0,), (0.0,)))
    assert held_states(one_f_one_b, 1, 1, 0, 1) == (((1.0,), (0.0,), (0.0,), (0.0,)),)
    assert held_states(one_f_one_b, 1, 1, 0, 2) == (((1.0,), (0.0,), (1.0,), (0.0,)),)
    # interleaved pp 2, v 2, m 4, rank 0 (traced, llama 8×1024 ZeRO-3: the peak, in F3 of its second chunk, held
    # 3 and 2 micro-batches, both chunks' gradient accumulators and the first chunk's parameters gathered)
    assert ((3.0, 2.0), (0.0, 0.0), (1.0, 1.0), (1.0, 0.0)) in held_states(Schedule.INTERLEAVED, 2, 2, 0, 4)
    cfg = ParallelConfig(dp=4, pp=2, zero=2, schedule=one_f_one_b)
    assert not grads_held_at_peak(cfg, 2, 0) and not grads_held_at_peak(cfg, 2)
    assert grads_held_at_peak(dataclasses.replace(cfg, zero=0), 2, 0)  # DDP's buckets: from the step's start


def test_fsdp_reduce_scatter_input_is_padded_as_the_shards_are():
    """Outside a pipeline a block's backward holds its unsharded gradient (as the parameters are) beside the
    reduce-scatter input, which torch 2.13's ``foreach_reduce`` pads on dim 0 as the shards are padded."""
    from costmodel.memory import fsdp_reduce_bytes

    layers = [("embedding", 100.0), ("block", 10.0), ("block", 12.0), ("head", 100.0)]
    padded = [(kind, n * 1.5 if kind == "block" else n) for kind, n in layers]
    cfg = ParallelConfig(dp=4, zero=3, precision="bf16")
    assert fsdp_reduce_bytes(cfg, layers, padded) == 2 * 12.0 + 4 * 18.0
    assert fsdp_reduce_bytes(cfg, layers) == (2 + 4) * 12.0


def test_pipelined_fsdp_keeps_a_new_bf16_gradient_beside_its_accumulator():
    """Pipelined FSDP folds a unit's new gradient into its accumulator at the unit's post-backward, and only when
    the reduce dtype differs from the parameters' (torch 2.13 ``FSDPParam.to_accumulated_grad_if_needed``; else
    ``.grad`` is the accumulator): bf16 training with fp32 reduction holds a block's bf16 gradient in its backward,
    and the head's (in the root unit, whose post-backward ends the chunk's backward) through the chunk's backward;
    the accumulators themselves are in the reduce dtype. Read from torch, not traced here: the check runs fp32,
    where neither exists."""
    from costmodel.memory import fsdp_gathered_bytes, fsdp_reduce_bytes, head_grad_bytes, state_bytes_at_peak

    layers = [("embedding", 100.0), ("block", 10.0), ("block", 12.0), ("head", 100.0)]
    bf16 = ParallelConfig(dp=4, pp=2, zero=3, precision="bf16")
    assert fsdp_reduce_bytes(bf16, layers) == 2 * (12.0 + 100.0)
    assert fsdp_gathered_bytes(bf16, layers) == 2 * (100.0 + 12.0 + 10.0 + 100.0)  # root and two blocks
    assert head_grad_bytes(bf16, layers, 2, 1) == 0.0  # (counted by fsdp_reduce_bytes)
    assert fsdp_reduce_bytes(dataclasses.replace(bf16, grad_compress="bf16"), layers) == 0.0  # .grad accumulates
    # the accumulators are in the reduce dtype: fp32, or the 16 bits a compressing plan reduces in
    assert state_bytes_at_peak(bf16)[3] == 4.0 and state_bytes_at_peak(dataclasses.replace(
        bf16, grad_compress="bf16"))[3] == 2.0
    fp32 = dataclasses.replace(bf16, precision="fp32")
    assert fsdp_reduce_bytes(fp32, layers) == 0.0
    assert head_grad_bytes(fp32, layers, 4, 1) == 0.0  # 1F1B, m = 4: a backward came before every peak state
    # GPipe's most come before its first backward, which makes the head's gradient (an accumulator to be) first
    assert head_grad_bytes(dataclasses.replace(fp32, schedule=Schedule.GPIPE), layers, 4, 1) == 4 * 100.0


def test_checkpointing_reduces_activations_and_adds_recompute():
    # seq ≠ hidden: the attention core is told from the hidden states by its seq×seq shape
    # (profiler.graph.NodeInfo.is_attention_core), ambiguous when seq = hidden as in the `gpt` fixture
    model = profile_model("gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=8192,dropout=0,attention=math")
    cl = _cluster()
    e = {ac: estimate(model, cl, cfg(f"dp=8,ac={ac}"), 64) for ac in ("none", "selective", "full")}
    assert e["full"].memory.activations < e["selective"].memory.activations <= e["none"].memory.activations
    assert e["none"].breakdown_s["recompute"] == 0
    assert e["full"].breakdown_s["recompute"] > e["selective"].breakdown_s["recompute"]


# ------------------------------------------------------------------------------------------------- schedule
def test_1f1b_bubble_is_p_minus_1_over_m():
    """Narayanan et al. 2021: with p stages of equal time T and m micro-batches, the step is (m + p − 1)·T, so the
    bubble is (p − 1)/m of the ideal time. A 64-word vocabulary makes embed and head negligible, so the evenly
    split blocks give (nearly) equal stages."""
    gpt = profile_model("gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=64,dropout=0")
    cl = _cluster()
    m = 16
    ev = Evaluator(gpt, cl, cfg("dp=2,pp=4,schedule=1f1b"), 2 * m)
    blocks = [i for i, layer in enumerate(gpt.layers) if layer.kind == "block"]
    stage_of = even_stages(gpt, 4)
    est = ev.evaluate(stage_of=stage_of)
    per_stage = [s.time_s for s in est.stages]
    t_max = max(per_stage)
    assert est.breakdown_s["bubble"] == pytest.approx(sum(per_stage) - t_max, rel=1e-9)
    assert len(blocks) == 8
    # (p-1)/m relative to the m·T of the bottleneck, when stages are equal up to the embed/head extras
    bubble_ratio = est.breakdown_s["bubble"] / (m * t_max)
    assert bubble_ratio == pytest.approx(3 / m, rel=0.05)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_v(gpt, v):
    """Narayanan et al. 2021 §2.2: with v chunks per rank the bubble is (p − 1)/(v·m) of the step instead of
    (p − 1)/m. Same pp, same micro-batches, only v changes: the bubble shrinks to 1/v (within what the extra chunk
    boundaries' sends add to each rank's time)."""
    cl = _cluster()
    one = estimate(gpt, cl, cfg("dp=4,pp=2,schedule=1f1b"), 32).breakdown_s["bubble"]
    interleaved = estimate(gpt, cl, cfg(f"dp=4,pp=2,vpp={v},schedule=interleaved"), 32).breakdown_s["bubble"]
    assert interleaved / one == pytest.approx(1 / v, rel=0.05)


def test_gpipe_holds_all_micro_batches(gpt):
    cl = _cluster()
    g = estimate(gpt, cl, cfg("dp=2,pp=4,schedule=gpipe"), 64)
    f = estimate(gpt, cl, cfg("dp=2,pp=4,schedule=1f1b"), 64)
    assert g.step_time_s == pytest.approx(f.step_time_s)
    assert g.memory.activations > f.memory.activations


# ------------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize("config", ["dp=16", "dp=16,zero=3", "dp=2,tp=8", "dp=4,pp=4", "dp=2,tp=2,pp=4"])
def test_more_bandwidth_is_never_slower(gpt, config):
    slow, fast = _cluster(nodes=2, inter_bw=5, intra_bw=50), _cluster(nodes=2, inter_bw=50, intra_bw=400)
    assert estimate(gpt, fast, cfg(config), 64).step_time_s <= estimate(gpt, slow, cfg(config), 64).step_time_s


def test_compression_never_helps_hidden_communication(gpt):
    """With a very fast network the gradient all-reduce hides under the backward: compression only costs."""
    fast = _cluster(nodes=2, inter_bw=10_000, intra_bw=10_000)
    base = estimate(gpt, fast, cfg("dp=16"), 128)
    for comp in ("bf16", "powersgd-4"):
        c = estimate(gpt, fast, cfg(f"dp=16,grad_compress={comp}"), 128)
        assert c.step_time_s >= base.step_time_s
        assert c.breakdown_s["compression"] > 0


def test_compression_helps_exposed_communication(gpt):
    slow = _cluster(nodes=2, inter_bw=0.5)
    base = estimate(gpt, slow, cfg("dp=16"), 16)
    assert base.breakdown_s["dp_comm_exposed"] > 0.1 * base.step_time_s
    for comp in ("bf16", "powersgd-4"):
        assert estimate(gpt, slow, cfg(f"dp=16,grad_compress={comp}"), 16).step_time_s < base.step_time_s


def test_communication_on_the_compute_cores_is_not_hidden(gpt):
    """A device whose collectives run on the cores that compute (``overlap_slowdown`` 1: the CPU, each core a
    gloo rank) hides nothing: ZeRO-3's gathers and reduce-scatters, and ZeRO-2's reduce-scatter, cost their whole
    time, where a GPU with s = 0 hides them under compute. A device property, read by the one overlap formula."""
    from costmodel.collectives import all_gather_time, reduce_scatter_time
    from costmodel.overlap import GRAD_REDUCE_BYTES, loss_sync_time

    assert load_cluster("cpu-local").device.overlap_slowdown == 1.0
    cl = _cluster(nodes=1)
    serial = dataclasses.replace(cl, device=dataclasses.replace(cl.device, overlap_slowdown=1.0))
    c = cfg("dp=8,zero=3")
    hid, ser = Evaluator(gpt, cl, c, 8), Evaluator(gpt, serial, c, 8)
    e_hid, e_ser = hid.evaluate(), ser.evaluate()
    rank = [ser.cost(i, AC.NONE) for i in range(len(gpt.layers))]
    span = ser.dp_span
    comm = sum(all_gather_time(x.param_numel * 2, span, serial) * 2
               + reduce_scatter_time(x.param_numel * GRAD_REDUCE_BYTES, span, serial) for x in rank)
    comm += loss_sync_time(ser)[0]  # (and the loss's all-reduce at the step's end, which nothing could hide)
    # FSDP2's copies on the computing stream, serial on both devices (the serial one also pays the copy-in)
    copies = 2 * fsdp_serial_time(rank, ser, "gather") + fsdp_serial_time(rank, ser, "reduce")
    assert e_ser.breakdown_s["dp_comm_exposed"] == pytest.approx(comm + copies, rel=1e-9)
    assert e_hid.breakdown_s["dp_comm_exposed"] < 0.5 * comm + copies


def test_fsdp2_copies_and_host_work_are_serial_per_gather_and_per_reduction(gpt):
    """FSDP2 works on the computing stream beside its collectives (torch 2.13 ``foreach_all_gather_copy_out`` and
    ``foreach_reduce_scatter_copy_in``): each gather copies the gathered parameters out (read and written in the
    parameter dtype; the copy-in of the rank's shard, 1/dp of it, beside the all-gather, costs only the overlap
    slowdown: under bf16 mixed precision the fp32 shard's cast and the copy, 4 + 2 + 2 + 2 bytes; FSDP1 gathers
    in place, with neither copy, and casts its shard under mixed precision, 4 + 2), each reduction concatenates
    the gradients into the reduce-scatter input (read in the parameter dtype, written in the reduce dtype), at the
    device's memory bandwidth; and a CPU's host time per group and tensor (`costmodel.fsdp_probe`). Counted per
    step as the runtime runs them: ZeRO-3 2 gathers and 1 reduction per micro-batch, pipelined m + 1 gathers and 1
    reduction; ZeRO-2 1 gather and m reductions, pipelined 1 and 1; nothing under DDP."""
    cl = _cluster(nodes=1)
    dev = cl.device
    mem_bw = dev.hbm_bw * dev.memory_eff
    ev = Evaluator(gpt, cl, cfg("dp=8,zero=3"), 8)
    c = ev.cost(1, AC.NONE)
    n = ev.gathered_numel(c)
    assert fsdp_serial_time([c], ev, "gather") == pytest.approx(2 * n * 2 / mem_bw, rel=1e-12)  # bf16, s = 0
    assert fsdp_serial_time([c], ev, "reduce") == pytest.approx(n * (2 + 4) / mem_bw, rel=1e-12)  # into fp32
    measured = dataclasses.replace(cl, device=dataclasses.replace(dev, fsdp_copy_bw=1e11))  # (a CPU's, measured)
    assert fsdp_serial_time([c], Evaluator(gpt, measured, cfg("dp=8,zero=3"), 8), "reduce") == pytest.approx(
        n * (2 + 4) / 1e11, rel=1e-12)
    half = dataclasses.replace(cl, device=dataclasses.replace(dev, overlap_slowdown=0.5))
    ev_half = Evaluator(gpt, half, cfg("dp=8,zero=3,precision=fp32"), 8)
    assert fsdp_serial_time([c], ev_half, "gather") == pytest.approx(2 * n * 4 * (1 + 0.5 / 8) / mem_bw, rel=1e-12)
    mixed = Evaluator(gpt, half, cfg("dp=8,zero=3"), 8)
    assert fsdp_serial_time([c], mixed, "gather") == pytest.approx(n * (2 * 2 + 0.5 * 10 / 8) / mem_bw, rel=1e-12)
    # FSDP1 (Composer's published runs) gathers its flat parameter's shard in place and computes on views of the
    # result: no copy-in, no copy-out; under mixed precision it casts the shard first
    flat = Evaluator(gpt, half, cfg("dp=8,zero=3,precision=fp32"), 8, fsdp_copy_out=False)
    assert fsdp_serial_time([c], flat, "gather") == 0.0
    assert fsdp_serial_time([c], flat, "reduce") == fsdp_serial_time([c], ev_half, "reduce")
    flat_mixed = Evaluator(gpt, half, cfg("dp=8,zero=3"), 8, fsdp_copy_out=False)
    assert fsdp_serial_time([c], flat_mixed, "gather") == pytest.approx(n * 0.5 * 6 / 8 / mem_bw, rel=1e-12)

    host = {"gather": (3e-4, 2e-5), "reduce": (5e-4, 3e-5)}
    busy = dataclasses.replace(cl, device=dataclasses.replace(dev, fsdp_overhead_s=host))
    assert load_cluster("dgx-h100").device.fsdp_overhead("gather") == (0.0, 0.0)
    for text, m, gathers, reduces in (("dp=8,zero=3", 4, 8, 4), ("dp=4,pp=2,zero=3,schedule=1f1b", 4, 5, 1),
                                      ("dp=8,zero=2", 4, 1, 4), ("dp=4,pp=2,zero=2,schedule=1f1b", 4, 1, 1),
                                      ("dp=8", 4, 0, 0)):
        c = cfg(text)
        gb = c.dp * c.mbs * m
        quiet, loud = (Evaluator(gpt, x, c, gb) for x in (cl, busy))
        assert quiet.m == m
        rank = [loud.cost(i, AC.NONE) for i, s in enumerate(even_stages(gpt, c.pp)) if s == 0]

        def step(ev, c=c, m=m, rank=rank):  # what the evaluator charges the first rank's stage per step
            return m * (fsdp_exposed(rank, ev) if c.zero == 3 else 0.0) + dp_exposed(rank, ev)[0]

        got = step(loud) - step(quiet)
        if c.pp == 1:  # (one rank: as the whole step's breakdown says)
            assert got == pytest.approx(loud.evaluate().breakdown_s["dp_comm_exposed"]
                                        - quiet.evaluate().breakdown_s["dp_comm_exposed"], rel=1e-9, abs=1e-15)
        # FSDP2's groups on the first rank: its blocks, and the root holding the embedding (and at pp = 1 the head)
        blocks = set(split_layers(gpt)[1])
        groups = sum(1 for i, s in enumerate(even_stages(gpt, c.pp)) if s == 0 and i in blocks) + 1
        assert groups == len(rank) - (1 if c.pp == 1 else 0)  # (the embedding and the head share one group)
        tensors = sum(x.param_tensors for x in rank)
        want = sum(k * (host[e][0] * groups + host[e][1] * tensors) for e, k in (("gather", gathers),
                                                                                ("reduce", reduces)))
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), text


def test_gradients_accumulate_in_memory_bound_kernels_where_nothing_reduces_them(gpt):
    """Over m micro-batches a rank's unsharded gradients are accumulated on the computing stream where nothing
    reduces them in between: autograd adds into ``.grad`` from the second micro-batch on (read both, write one:
    3 × 4 bytes for autocast's fp32 gradients, (m − 1) times) under DDP; pipelined FSDP with bf16 parameters and
    an fp32 reduction casts on the first (2 + 4), adds in fp32 on each later one (2 + 4 + 4), and its chunk_cat
    reads fp32 (+2): 38 bytes at m = 4; FSDP outside a pipeline reduce-scatters every micro-batch (0); Megatron-LM
    fuses it into its weight-gradient GEMMs (0). Charged once per rank per step, as compute."""
    from costmodel.overlap import grad_accumulation_time

    cl = _cluster(nodes=1)
    mem_bw = cl.device.hbm_bw * cl.device.memory_eff
    params = 1e9
    for text, m, per in (("dp=8", 4, 36), ("dp=8,precision=fp32", 4, 36), ("dp=8", 1, 0), ("dp=8,zero=3", 4, 0),
                         ("dp=8,zero=2", 4, 0), ("dp=4,pp=2,zero=3,schedule=1f1b", 4, 38),
                         ("dp=4,pp=2,zero=2,schedule=1f1b,grad_compress=bf16", 4, 18),
                         ("dp=4,pp=2,zero=3,schedule=1f1b,precision=fp32", 4, 36), ("dp=4,pp=2", 4, 36)):
        c = cfg(text)
        ev = Evaluator(gpt, cl, c, c.dp * c.mbs * m)
        assert grad_accumulation_time(params, ev) == pytest.approx(params * per / mem_bw, rel=1e-12), text
        fused = Evaluator(gpt, cl, c, c.dp * c.mbs * m, fused_grad_accumulation=True)
        assert grad_accumulation_time(params, fused) == 0.0
    c = cfg("dp=8")
    ev, fused = Evaluator(gpt, cl, c, 32), Evaluator(gpt, cl, c, 32, fused_grad_accumulation=True)
    mine, theirs = ev.evaluate(), fused.evaluate()
    rank = sum(ev.cost(i, AC.NONE).param_numel for i in range(len(gpt.layers)))
    assert mine.step_time_s - theirs.step_time_s == pytest.approx(rank * 36 / mem_bw, rel=1e-9)
    assert mine.breakdown_s["compute"] - theirs.breakdown_s["compute"] == pytest.approx(rank * 36 / mem_bw, rel=1e-9)


def test_the_step_ends_with_clipping_and_the_losss_reduction(gpt):
    """What the runtime's step runs after the backward besides Adam (`planner.emit.train`): the gradient clipping
    reads every local fp32 gradient element for its norm and scales it in place (12 bytes each, at the device's
    memory bandwidth), all-reduces the squared norm over every rank, and the loss is all-reduced over the
    data-parallel group at the end; the ``optimizer`` part holds the clipping (and ZeRO-1's broadcasts),
    ``dp_comm_exposed`` the loss's reduction. Under ZeRO 2/3 the gradients are FSDP's shards, 1/dp of them."""
    from costmodel.cluster import group_span
    from costmodel.collectives import all_reduce_time
    from costmodel.overlap import clip_time, loss_sync_time, optimizer_time, zero1_sync_time

    cl = _cluster(nodes=2)
    mem_bw = cl.device.hbm_bw * cl.device.memory_eff
    for text, sharded in (("dp=16", 1), ("dp=16,zero=1", 1), ("dp=16,zero=3", 16), ("dp=8,pp=2,zero=2", 8)):
        c = cfg(text)
        ev = Evaluator(gpt, cl, c, 64)
        est = ev.evaluate()
        params = sum(ev.cost(i, AC.NONE).param_numel for i, s in enumerate(even_stages(gpt, c.pp)) if s == 0)
        tensors = sum(ev.cost(i, AC.NONE).param_tensors for i, s in enumerate(even_stages(gpt, c.pp)) if s == 0)
        norm = all_reduce_time(4, group_span(cl, 16, 1), cl)
        clip = clip_time(params, tensors, ev)
        assert clip == pytest.approx(params / sharded * 12 / mem_bw + norm, rel=1e-12), text  # (GPU: no op cost)
        loss_dp, loss_pp = loss_sync_time(ev)
        assert loss_dp == pytest.approx(all_reduce_time(4, ev.dp_span, cl), rel=1e-12) and loss_dp > 0
        assert (loss_pp > 0) == (c.pp > 1)
        if c.pp == 1:
            # (ZeRO-1's parameter broadcasts run in its optimizer's step: test_zero1_broadcasts_are_part_of_…)
            broadcasts = zero1_sync_time([ev.cost(i, AC.NONE) for i in range(len(gpt.layers))], ev)
            assert est.breakdown_s["optimizer"] == pytest.approx(optimizer_time(params, ev) + clip + broadcasts,
                                                                 rel=1e-12)
    # on a CPU every op also pays its host time: 2 per parameter tensor
    cpu = load_cluster("cpu-local")
    ev = Evaluator(gpt, cpu, cfg("dp=2"), 4)
    bare = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, op_overhead_s=(0.0, 0.0)))
    assert clip_time(1e6, 10, ev) - clip_time(1e6, 10, Evaluator(gpt, bare, cfg("dp=2"), 4)) == pytest.approx(
        20 * cpu.device.op_overhead_s[0])


def test_zero1_broadcasts_each_tensor(gpt):
    """ZeroRedundancyOptimizer broadcasts every parameter tensor from its owner (torch 2.13 ``_sync_params``): one
    broadcast per tensor, each with the link's call latency."""
    from costmodel.collectives import broadcast_time
    from costmodel.overlap import zero1_sync_time

    cl = _cluster()
    slow = dataclasses.replace(cl, intra=dataclasses.replace(cl.intra, call_latency=1e-3))
    for cluster in (cl, slow):
        ev = Evaluator(gpt, cluster, cfg("dp=8,zero=1,precision=bf16"), 64)
        costs = [ev.cost(i, AC.NONE) for i in range(len(gpt.layers))]
        params, n = sum(c.param_numel for c in costs), sum(c.param_tensors for c in costs)
        ring = n * broadcast_time(params * 4 / n, ev.dp_span, cl)  # fp32 module parameters under autocast
        assert zero1_sync_time(costs, ev) == pytest.approx(ring + n * cluster.intra.call_latency, rel=1e-12)


def test_zero1_broadcasts_are_part_of_the_optimizer_step(gpt):
    """ZeroRedundancyOptimizer broadcasts inside its ``step()``, which `autopar validate` times as the optimizer
    phase: the breakdown's ``optimizer`` holds them, ``dp_comm_exposed`` is DDP's gradient reduction alone (as
    under ZeRO-0), and the step time is unchanged by where they are reported."""
    from costmodel.overlap import optimizer_part_time, zero1_sync_time

    cl = _cluster()
    plain, zero1 = (Evaluator(gpt, cl, cfg(f"dp=8,zero={z},precision=bf16"), 64) for z in (0, 1))
    costs = [zero1.cost(i, AC.NONE) for i in range(len(gpt.layers))]
    params, tensors = sum(c.param_numel for c in costs), sum(c.param_tensors for c in costs)
    broadcasts = zero1_sync_time(costs, zero1)
    assert broadcasts > 0 and zero1_sync_time(costs, plain) == 0.0
    got, ddp = zero1.evaluate(), plain.evaluate()
    assert got.breakdown_s["dp_comm_exposed"] == pytest.approx(ddp.breakdown_s["dp_comm_exposed"], rel=1e-12)
    assert got.breakdown_s["optimizer"] == pytest.approx(
        optimizer_part_time(params, tensors, zero1) + broadcasts, rel=1e-12)
    assert got.step_time_s - ddp.step_time_s == pytest.approx(
        got.breakdown_s["optimizer"] - ddp.breakdown_s["optimizer"], rel=1e-9)


def test_tensor_parallel_across_nodes_is_slower(gpt):
    """Same model, tp=8 inside a node vs tp=16 spanning two: the second pays the network on every layer."""
    cl = _cluster(nodes=2)
    inside = estimate(gpt, cl, cfg("dp=2,tp=8"), 32)
    across = estimate(gpt, cl, cfg("tp=16"), 32)
    assert across.breakdown_s["tp_comm"] > inside.breakdown_s["tp_comm"]


def test_breakdown_sums_to_step_time(gpt):
    cl = _cluster(nodes=2)
    for c in ("dp=16", "dp=2,tp=2,pp=4,ac=full", "dp=4,pp=2,vpp=2,schedule=interleaved,tp=2,sp=on",
              "dp=16,zero=3,ac=selective", "dp=8,pp=2,schedule=zb,grad_compress=bf16"):
        e = estimate(gpt, cl, cfg(c), 64)
        assert sum(e.breakdown_s.values()) == pytest.approx(e.step_time_s, rel=1e-9), c


def test_mfu_uses_model_flops(gpt):
    """Model FLOPs = 3 × forward (Korthikanti eq. 7 convention); HFU adds recomputation: with full AC each block's
    forward up to its last saving op (torch's checkpoint stops early there: here the MLP's down projection, as
    dropout is 0, is not recomputed), so between 1 and 4/3 of MFU."""
    from costmodel.layercost import recompute_stop

    cl = _cluster()
    e = estimate(gpt, cl, cfg("dp=8,ac=full"), 64)
    fwd = sum(layer.fwd_flops for layer in gpt.layers)  # per sequence at the captured batch of 1
    model_flops = 3 * fwd * 64
    assert e.mfu == pytest.approx(model_flops / e.step_time_s / 8 / 312e12, rel=1e-6)
    rec = sum(n.fwd_flops for layer in gpt.blocks for n in layer.nodes[:recompute_stop(layer)])
    assert rec < sum(layer.fwd_flops for layer in gpt.blocks)
    assert e.hfu == pytest.approx(e.mfu * (3 * fwd + rec) / (3 * fwd), rel=1e-6)


def test_a_checkpoint_without_early_stop_recomputes_the_whole_forward(gpt):
    """torch 1.13's non-reentrant checkpoint and Megatron-LM's ``CheckpointFunction`` rerun a checkpointed block's
    forward whole (`costmodel.layercost.CostContext.checkpoint_early_stop` False: the published runs of those stacks,
    `costmodel.calibrate.Row.checkpoint_early_stop`): the hardware FLOPs add the blocks' whole forward once more
    (llm-foundry's own HFU formula: "an extra forward pass"; 4/3 of the model FLOPs but for the embedding and head,
    never checkpointed), and the step is slower than torch ≥ 2.1's, which stops at the down projection."""
    from costmodel.estimate import Evaluator

    cl = _cluster()
    early = Evaluator(gpt, cl, cfg("dp=8,ac=full"), 64).evaluate()
    whole = Evaluator(gpt, cl, cfg("dp=8,ac=full"), 64, checkpoint_early_stop=False).evaluate()
    fwd = sum(layer.fwd_flops for layer in gpt.blocks)
    head = sum(layer.fwd_flops for layer in gpt.layers) - fwd  # (embedding and head: never checkpointed)
    assert whole.hfu == pytest.approx(whole.mfu * (3 * (fwd + head) + fwd) / (3 * (fwd + head)), rel=1e-6)
    assert whole.breakdown_s["recompute"] > early.breakdown_s["recompute"] > 0
    assert whole.step_time_s > early.step_time_s
    # nothing else moves: the same memory (the checkpoint keeps the block's input either way)
    assert whole.memory.peak == early.memory.peak


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("config,match", [
    ("dp=3", "ranks"), ("dp=8,mbs=3", "multiple"), ("tp=8,heads=0", None),
])
def test_bad_configurations_explain_themselves(gpt, config, match):
    if match is None:
        with pytest.raises(ValueError, match="unknown key"):
            cfg(config)
        return
    with pytest.raises(ConfigError, match=match):
        estimate(gpt, _cluster(), cfg(config), 64)


def test_virtual_stages_need_a_pipeline():
    """vpp > 1 with pp = 1 was accepted: `estimate` priced it as two stages on one rank and `ilp.solve` asserted."""
    with pytest.raises(ValueError, match="vpp=2 virtual stages per pipeline rank need a pipeline"):
        cfg("dp=8,vpp=2,schedule=interleaved")
    assert cfg("dp=4,pp=2,vpp=2,schedule=interleaved").vpp == 2


def test_tp_must_divide_heads():
    lg = profile_model("gpt:layers=2,hidden=96,heads=6,seq=64,vocab=256")
    with pytest.raises(ConfigError, match="does not divide heads=6"):
        estimate(lg, _cluster(), cfg("tp=4,dp=2"), 8)


# ------------------------------------------------------------------------------------------------- CLI
def test_estimate_json_has_the_design_fields():
    out = subprocess.run([sys.executable, "-m", "planner", "estimate", "gpt-tiny", "--cluster", "dgx-h100",
                          "--config", "dp=8,zero=3,ac=selective", "--global-batch", "16", "--json"],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu_model", "tflops_per_gpu_hw", "mfu", "hfu", "fits"):
        assert key in d
    assert set(d["memory_per_gpu_bytes"]) == {"params", "grads", "optimizer", "activations", "other", "peak"}
    assert set(d["breakdown_s"]) == {"compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "dp_comm_exposed",
                                     "bubble", "optimizer", "compression"}


def test_estimate_bad_config_is_one_line_exit_2():
    out = subprocess.run([sys.executable, "-m", "planner", "estimate", "gpt-tiny", "--cluster", "dgx-h100",
                          "--config", "dp=3"], capture_output=True, text=True)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "dp·tp·pp·cp" in out.stderr


def test_presets_have_cited_links():
    cl = load_cluster("dgx-a100-80g:nodes=2")
    assert cl.world_size == 16 and "nccl" in cl.intra.source.lower()
    assert dataclasses.replace(cl, nodes=4).world_size == 32


# ------------------------------------------------------------------------------------------------- measured profile
def test_measured_profile_sets_the_level_and_the_roofline_the_scaling(tmp_path, monkeypatch):
    """With a measured profile on the cluster's device, single-rank compute equals the measured layer times
    (scaled by the micro-batch as the roofline scales it); a profile from another device is refused."""
    from costmodel.measured import load_measured
    from planner.cli.main import main

    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    prof = tmp_path / "p.json"
    assert main(["profile", "gpt-tiny", "--device", "cpu", "--dtype", "fp32", "--out", str(prof), "--json"]) == 0
    lg = profile_model("gpt-tiny")
    cl = load_cluster("cpu-local")
    measured = load_measured(prof, lg, cl)
    d = json.loads(prof.read_text())["measured"]["layers"]
    total = sum(v["fwd_s"] + v["bwd_s"] for v in d.values())
    e = estimate(lg, cl, cfg("dp=2,precision=fp32"), 2, measured=measured)  # mbs 1 = the measured batch
    assert e.breakdown_s["compute"] == pytest.approx(total, rel=1e-6)
    m4 = Evaluator(lg, cl, cfg("dp=2,precision=fp32,mbs=4"), 8, measured=measured)
    r4 = Evaluator(lg, cl, cfg("dp=2,precision=fp32,mbs=4"), 8)
    r1 = Evaluator(lg, cl, cfg("dp=2,precision=fp32"), 2)
    for i, layer in enumerate(lg.layers):  # per layer: measured × the roofline's ratio for the new micro-batch
        want = d[layer.name]["fwd_s"] * r4.cost(i, AC.NONE).fwd_s / r1.cost(i, AC.NONE).fwd_s
        assert m4.cost(i, AC.NONE).fwd_s == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="was measured on"):
        load_measured(prof, lg, load_cluster("dgx-h100"))


def _cached_here(lg, epoch: str):
    """``lg``'s layer times as `costmodel.measured.measure_here` cached them under ``epoch`` (one thread names the
    device, as it was measured), or None."""
    import torch

    from profiler.measure import cached, device_name

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cached(lg, device_name(torch.device("cpu")), "float32", lg.model.batch, epoch)
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_clusters_graph_carries_its_layers_measured_here(tmp_path, monkeypatch):
    """On a CPU cluster the cost model's graph (`layer_graph`) carries each layer as `profiler.measure` timed it on
    this machine (one thread; cached unless the machine was busy), and every Evaluator of that graph prices
    single-rank compute at those times; a GPU cluster's graph carries none; the CLI says which the plan used."""
    import costmodel.hardware
    from costmodel.hardware import measure_cpu_device
    from costmodel.layercost import measured_scale
    from costmodel.measured import _cpu_graph, device_epoch, layer_graph
    from planner.cli.main import main

    def cached_here(lg):  # (under the device measurement the times are priced against)
        return _cached_here(lg, device_epoch(measure_cpu_device()))

    monkeypatch.setattr("profiler.measure.cache_dir", lambda: tmp_path / "profile")  # (the device's cache kept)
    cl = load_cluster("cpu-local")
    monkeypatch.setattr(costmodel.hardware, "machine_load", lambda: 99.0)
    _cpu_graph.cache_clear()
    try:
        busy = layer_graph("gpt-tiny", cl)
        assert busy.timings.measured is not None and cached_here(busy) is None, busy.timings.note
        monkeypatch.setattr(costmodel.hardware, "machine_load", lambda: 0.0)
        _cpu_graph.cache_clear()
        lg = layer_graph("gpt-tiny", cl)
        assert lg.timings is not None and "measured on this machine" in lg.timings.note
        times, batch = lg.timings.measured
        assert batch == lg.model.batch and set(times) == {layer.name for layer in lg.layers}
        prof = cached_here(lg)
        assert prof is not None and {k: (v.fwd_s, v.bwd_s) for k, v in prof.layers.items()} == dict(times)
        e = Evaluator(lg, cl, cfg("dp=2,precision=fp32"), 2)  # mbs 1 = the measured batch
        for i, layer in enumerate(lg.layers):
            c = e.cost(i, AC.NONE)
            assert (c.fwd_s, c.bwd_s) == pytest.approx(times[layer.name], rel=1e-9)
        # and at the larger batch measured beside it, which the level goes through too: a fixed part plus one in
        # proportion to the roofline (`measured_scale`, tested on its own below), each priced on the right reference
        four = lg.timings.larger_batch
        assert four == 4 * batch and set(lg.timings.larger) == set(times), lg.timings.note
        bare = dataclasses.replace(lg, timings=None)
        r1 = Evaluator(bare, cl, cfg("dp=2,precision=fp32"), 2)
        r4 = Evaluator(bare, cl, cfg(f"dp=2,mbs={four},precision=fp32"), 2 * four)
        e4 = Evaluator(lg, cl, cfg(f"dp=2,mbs={four},precision=fp32"), 2 * four)
        e8 = Evaluator(lg, cl, cfg(f"dp=2,mbs={2 * four},precision=fp32"), 4 * four)
        r8 = Evaluator(bare, cl, cfg(f"dp=2,mbs={2 * four},precision=fp32"), 4 * four)
        for i, layer in enumerate(lg.layers):
            for k in (0, 1):  # forward, backward
                m1, m4 = times[layer.name][k], lg.timings.larger[layer.name][k]
                x1, x4, x8 = ((c.fwd_s, c.bwd_s)[k] for c in (r1.cost(i, AC.NONE), r4.cost(i, AC.NONE),
                                                             r8.cost(i, AC.NONE)))
                for ev, x in ((e4, x4), (e8, x8)):
                    assert (ev.cost(i, AC.NONE).fwd_s, ev.cost(i, AC.NONE).bwd_s)[k] == pytest.approx(
                        measured_scale(m1, x1, x, m4, x4) * x, rel=1e-9)
                if m4 > m1:  # (rising with the batch, as every layer does: through the larger batch's time)
                    assert (e4.cost(i, AC.NONE).fwd_s, e4.cost(i, AC.NONE).bwd_s)[k] == pytest.approx(m4, rel=1e-9)
        # the reference is the eager process measured: compiling scales the measured level as the roofline says
        fused = Evaluator(lg, cl, cfg("dp=2,precision=fp32"), 2, compiled=True)
        assert fused.cost(1, AC.NONE).fwd_s < e.cost(1, AC.NONE).fwd_s
        rough = Evaluator(dataclasses.replace(lg, timings=None), cl, cfg("dp=2,precision=fp32"), 2)
        assert rough.cost(1, AC.NONE).fwd_s != pytest.approx(times[lg.layers[1].name], rel=1e-3)
        assert layer_graph("gpt-tiny", load_cluster("dgx-h100")).timings is None
        assert main(["estimate", "gpt-tiny", "--cluster", "cpu-local", "--config", "dp=2", "--json"]) == 0
    finally:
        _cpu_graph.cache_clear()


def test_layer_times_are_cached_per_measurement_of_the_device_they_are_priced_against(tmp_path, monkeypatch):
    """`costmodel.measured.timed_here` keys the cached layer times by the CPU device's measurement
    (`device_epoch`): measured again against another, found against the same. Priced against a device measured
    after them, on a machine whose speed had moved since, they put every validate_cpu plan ~25 % fast."""
    import dataclasses

    import costmodel.measured as cm
    from costmodel.hardware import measure_cpu_device
    from costmodel.measured import device_epoch, measure_here, timed_here

    monkeypatch.setattr("profiler.measure.cache_dir", lambda: tmp_path / "profile")
    monkeypatch.setattr("costmodel.hardware.busy", lambda *_: False)  # (times taken while busy are not cached)
    lg = profile_model("gpt-tiny", dtype="fp32", kernels="native")
    here = measure_cpu_device()
    other = dataclasses.replace(here, peak_flops={"fp32": here.peak("fp32") * 0.9})
    assert device_epoch(other) != device_epoch(here)
    # (each process reads the memory anew, under its own cgroup's limit: not part of the measurement)
    assert device_epoch(dataclasses.replace(here, memory_bytes=here.memory_bytes / 2)) == device_epoch(here)
    seen = []
    monkeypatch.setattr(cm, "measure_here", lambda *a, **kw: seen.append(kw["epoch"]) or measure_here(*a, **kw))
    timed_here(lg)
    assert seen == [device_epoch(here)]
    assert _cached_here(lg, device_epoch(here)) is not None
    assert _cached_here(lg, device_epoch(other)) is None
    assert _cached_here(lg, "") is None  # (nor under `autopar profile`'s key)


def test_a_model_too_large_to_run_here_is_priced_by_the_roofline_and_says_so():
    """Measuring builds the model for real: one over the memory or time it may take here is left to the roofline,
    with the reason; `measure` refuses inputs of another batch than the graph's."""
    from costmodel.measured import MEASURE_SECONDS, measure_here
    from profiler.measure import measure
    from profiler.zoo.registry import resolve_model

    lg = profile_model("gpt-tiny", dtype="fp32", kernels="native")
    flops = sum(n.fwd_flops + n.bwd_flops for n in lg.model.nodes)
    slow = measure_here(lg, peak=7 * flops / (2 * MEASURE_SECONDS), memory=1e12)
    assert slow.measured is None and "too large to measure" in slow.note
    small = measure_here(lg, peak=1e12, memory=8.0 * lg.model.num_params)
    assert small.measured is None and "too large to measure" in small.note
    # the captured batch fits, four times it does not: measured alone, scaled in proportion
    one = measure_here(lg, peak=14 * flops / MEASURE_SECONDS, memory=1e12)
    assert one.measured is not None and not one.larger and one.larger_batch == 0
    assert "batch 4 not measured" in one.note and "in proportion" in one.note
    model, inputs = resolve_model("gpt-tiny").build(batch=2, device="cpu")
    with pytest.raises(ValueError, match="a batch of 2, not 1"):
        measure(model, inputs, lg, use_cache=False)
    with pytest.raises(ValueError, match="a batch of 2, not 4"):
        measure(model, inputs, lg, use_cache=False, batch=4)


FLAT_MODEL = """
import torch
from torch import nn


class Net(nn.Module):  # no list of blocks: `profiler.measure` times it whole
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 32)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(self.emb(ids)))).flatten(0, 1), labels.flatten())


def factory(batch=1, seq=8):
    return Net(), (torch.randint(0, 32, (batch, seq)), torch.randint(0, 32, (batch, seq)))
"""


def test_a_model_whose_layers_cannot_be_timed_one_by_one_stays_on_the_roofline(tmp_path, monkeypatch):
    """A model without a list of blocks is timed whole, which is no layer of its graph: it is priced by the roofline
    and says so (not "measured"), and the recalibration counts it as untimed."""
    from costmodel.measured import _cpu_graph, layer_graph

    monkeypatch.setattr("profiler.measure.cache_dir", lambda: tmp_path / "profile")
    path = tmp_path / "flat.py"
    path.write_text(FLAT_MODEL)
    _cpu_graph.cache_clear()
    try:
        lg = layer_graph(f"{path}:factory", load_cluster("cpu-local"))
    finally:
        _cpu_graph.cache_clear()
    assert lg.timings.measured is None and "could not be timed one by one" in lg.timings.note


def test_auto_parallelize_times_the_live_module_on_a_cpu_cluster(tmp_path, monkeypatch):
    """`auto_parallelize`'s plan (`plan_for_module`) on a CPU cluster prices the user's module as `autopar plan`
    prices a spec: its layers timed here, on a copy, the module's gradients and the global random state untouched."""
    import torch

    import costmodel.measured as cm
    from planner.search.outer import plan_for_module
    from profiler.zoo.registry import resolve_model

    monkeypatch.setattr("profiler.measure.cache_dir", lambda: tmp_path / "profile")
    seen = []
    real = cm.measure_here

    def spy(lg, *args, **kw):
        seen.append((lg, real(lg, *args, **kw)))
        return seen[-1][1]

    monkeypatch.setattr(cm, "measure_here", spy)
    model, inputs = resolve_model("gpt-tiny").build(batch=2, device="cpu")
    rng = torch.get_rng_state()
    plan = plan_for_module(model, inputs, cluster="cpu-local", time_limit=10)
    assert torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in model.parameters())
    (lg, timings), = seen
    assert timings.measured is not None and "measured on this machine" in timings.note
    assert set(timings.layers) == {layer.name for layer in lg.layers} and plan.predicted["step_time_s"] > 0
    # and at four times the example's batch: its rows repeated
    assert timings.larger_batch == 4 * lg.model.batch == 8 and set(timings.larger) == set(timings.layers)


def test_gradients_not_yet_held_at_a_single_micro_batch_peak():
    """The runtime zeroes gradients with set_to_none: with one micro-batch and no pipeline (and at GPipe's most
    micro-batches) no backward has run at the activation peak, so FSDP's gradient shards are not there yet
    (traced: llama3-8b ZeRO-3 on 8 ranks); with two micro-batches the first's shards are; DDP's buckets always
    are. The step's other peak, after the backward, holds them all."""
    from costmodel.memory import held_states

    lg = profile_model("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=512", dtype="fp32")
    cl = load_cluster("dgx-h100:nodes=1")
    cfg = ParallelConfig(dp=8, zero=3, mbs=1, precision="fp32")
    one = estimate(lg, cl, cfg, global_batch=8)
    two = estimate(lg, cl, cfg, global_batch=16)
    ddp = estimate(lg, cl, dataclasses.replace(cfg, zero=0), global_batch=8)
    assert one.memory.grads == 0.0
    # GPipe's most micro-batches come before any backward (a state after one may still hold more)
    assert ((4.0,), (0.0,), (0.0,), (0.0,)) in held_states(Schedule.GPIPE, 2, 1, 0, 4)
    assert two.memory.grads == pytest.approx(two.memory.params)  # fp32 ZeRO-3: 4/dp bytes each, like the shards
    assert ddp.memory.grads == pytest.approx(ddp.memory.params)


def test_runtime_reserves_a_cuda_context_and_nccl_buffers_per_communicator():
    """What a GPU rank holds outside torch's allocator: the context, one NCCL communicator per process group it runs
    collectives on (the default group and each mesh dimension of more than one rank; a pair's is smaller), and with
    pipelining the point-to-point buffers of each neighbouring stage. Nothing on CPU."""
    gpu = load_cluster("dgx-h100").device
    cfg = ParallelConfig(dp=8, tp=8, pp=4)
    assert communicators(cfg) == [256, 8, 8, 4]
    assert runtime_reserved_bytes(cfg, gpu) == CUDA_CONTEXT_BYTES + 4 * NCCL_COMM_BYTES + 2 * NCCL_P2P_PEER_BYTES
    two = ParallelConfig(dp=1, tp=1, pp=2)  # the default group and the pp group are pairs; one neighbour
    assert runtime_reserved_bytes(two, gpu) == CUDA_CONTEXT_BYTES + 2 * NCCL_COMM_BYTES_PAIR + NCCL_P2P_PEER_BYTES
    assert runtime_reserved_bytes(ParallelConfig(), gpu) == CUDA_CONTEXT_BYTES  # one GPU: no communicator
    assert runtime_reserved_bytes(cfg, dataclasses.replace(gpu, name="cpu")) == 0.0
    # a cluster file may state what it measured instead (round trip included)
    text = dump_cluster(dataclasses.replace(load_cluster("dgx-h100"), device=dataclasses.replace(
        gpu, name="mine", runtime_reserved=3 * 2**30)))
    assert "runtime_reserved_GiB: 3.0" in text
    assert runtime_reserved_bytes(cfg, parse_cluster_yaml(text).device) == 3 * 2**30


def test_compiled_blocks_move_the_bytes_of_fused_kernels():
    """torch.compile fuses a block's memory-bound ops (`costmodel.layercost.compiled_bytes`): inside RMSNorm nothing
    is written back (its pow, mean and rsqrt live in one kernel), a residual sum read again after the MLP's matmuls
    is written, matmuls and attention are not fused; the compiled step is faster than the eager one and the
    difference is memory-bound time only."""
    from costmodel.layercost import compiled_bytes
    from profiler.api import profile_model

    lg = profile_model("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=64")
    block = next(layer for layer in lg.layers if layer.kind == "block")
    fused = compiled_bytes(block)
    nodes = {n.name: n for n in block.nodes}
    assert all(nodes[name].kind == "memory" for name in fused)
    norm = [n for n in block.nodes if n.module_path.endswith("attention_norm") and n.kind == "memory"]
    assert {fused[n.name][0] for n in norm if n.op in ("aten.pow.Tensor_Scalar", "aten.mean.dim",
                                                        "aten.rsqrt.default")} == {0}
    residual = next(n for n in block.nodes if n.module_path == block.name and n.op == "aten.add.Tensor")
    assert fused[residual.name][0] >= residual.output_bytes  # read after the MLP: written
    assert sum(v[0] for v in fused.values()) < 0.6 * sum(nodes[k].fwd_bytes for k in fused)
    cfg = ParallelConfig(dp=8, zero=3)
    cluster = load_cluster("dgx-h100")
    eager, comp = (estimate(lg, cluster, cfg, 16, compiled=c) for c in (False, True))
    assert comp.step_time_s < eager.step_time_s
    assert comp.memory.peak == eager.memory.peak  # (priced as time only)


def test_a_fused_loss_moves_the_bytes_of_one_kernel_on_the_16_bit_logits():
    """llm-foundry's loss is flash-attn's fused cross entropy on the matmul's 16-bit logits
    (`costmodel.layercost.fused_loss_bytes`, the Composer stack's ``fused_loss``), and Composer computes two more
    cross entropies on them for its training metrics: the head's ops after its matmul (the upcast and
    ``F.cross_entropy`` of autopar's runtime) move a read of the logits forward and a read and a write backward,
    plus each metric's forward, all on the last of them; the step gets faster by memory-bound time only, the
    memory is the same; no other stack does either."""
    from costmodel.estimate import Evaluator
    from costmodel.layercost import fused_loss_bytes
    from costmodel.stacks import STACKS
    from profiler.api import profile_model

    lg = profile_model("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=5000")
    head = next(layer for layer in lg.layers if layer.kind == "head")
    fused = fused_loss_bytes(head)
    matmul = max(j for j, n in enumerate(head.nodes) if n.kind == "matmul")
    after = [n for n in head.nodes[matmul + 1:] if n.kind == "memory"]
    assert [n.name for n in after] == list(fused) and len(after) >= 2  # (the upcast and the loss)
    logits = head.nodes[matmul].output_bytes
    assert logits == 128 * 5000 * 2  # (16-bit)
    assert [fused[n.name] for n in after] == [(0.0, 0.0)] * (len(after) - 1) + [(logits, 2 * logits)]
    # Composer's two training metrics: a log-softmax (16-bit in, fp32 out) and an NLL reading it, each, forward
    assert fused_loss_bytes(head, 2)[after[-1].name] == (11 * logits, 2 * logits)
    assert sum(n.fwd_bytes + n.bwd_bytes for n in after) > 5 * 4 * logits  # (priced as the runtime runs it)
    assert fused_loss_bytes(next(layer for layer in lg.layers if layer.kind == "block")) == {}  # (no loss there)
    cluster, config = load_cluster("dgx-h100"), ParallelConfig(dp=8, zero=3, precision="bf16")
    plain, one = (Evaluator(lg, cluster, config, 16, autocast=False, fused_loss=f).evaluate() for f in (False, True))
    assert one.step_time_s < plain.step_time_s and one.memory.peak == plain.memory.peak
    assert {name for name, stack in STACKS.items() if stack.runtime_options()["fused_loss"]} == {"composer"}
    assert {name: stack.train_metrics for name, stack in STACKS.items()} == {
        "torch-native": 0, "megatron": 0, "composer": 2}


def test_estimate_takes_a_stack_and_compile(capsys, tmp_path):
    """`estimate --stack NAME --compile`: the stack is the preset's option (the JSON says which), compile prices the
    blocks fused; a cluster file carries its own constants and refuses a stack in one line."""
    from costmodel.cluster import dump_cluster
    from planner.cli.main import main

    args = ["estimate", "llama-tiny", "--cluster", "dgx-h100", "--config", "dp=8,zero=3", "--global-batch", "16",
            "--json"]
    assert main(args) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*args, "--stack", "megatron", "--compile"]) == 0
    comp = json.loads(capsys.readouterr().out)
    assert (eager["stack"], comp["stack"], comp["compile"]) == ("torch-native", "megatron", True)
    assert comp["cluster"] == "dgx-h100:stack=megatron"
    own = tmp_path / "mine.yaml"
    own.write_text(dump_cluster(load_cluster("dgx-h100")))
    assert main(["estimate", "llama-tiny", "--cluster", str(own), "--stack", "megatron", "--config", "dp=8"]) == 2
    assert "stack= applies to presets" in capsys.readouterr().err


def test_op_overhead_is_charged_once_per_captured_op_each_way(gpt):
    """A device's host time per op (a CPU's: the thread that dispatches an op also runs it) adds to each layer
    ``nodes × o_f`` forward and ``nodes × o_b`` backward, and the recompute of full checkpointing repeats the
    forward's part; a GPU's is 0, so nothing it prices changes."""
    from costmodel.layercost import CostContext, layer_cost, owned_params

    cl = _cluster()
    o_f, o_b = 3e-6, 5e-6
    busy = dataclasses.replace(cl, device=dataclasses.replace(cl.device, op_overhead_s=(o_f, o_b)))
    owned = owned_params(gpt)
    assert load_cluster("dgx-h100:nodes=1").device.op_overhead_s == (0.0, 0.0)
    for layer in gpt.layers:
        base = layer_cost(layer, AC.FULL, CostContext(cluster=cl, tp=1, sp=False, mbs=2, captured_batch=1,
                                                      precision="bf16"), owned.get(layer.name, ()))
        more = layer_cost(layer, AC.FULL, CostContext(cluster=busy, tp=1, sp=False, mbs=2, captured_batch=1,
                                                      precision="bf16"), owned.get(layer.name, ()))
        n = len(layer.nodes)
        assert more.fwd_s - base.fwd_s == pytest.approx(n * o_f, rel=1e-9)
        assert more.bwd_s - base.bwd_s == pytest.approx(n * o_b, rel=1e-9)
        assert more.recompute_s >= base.recompute_s


def test_dtensor_overhead_is_charged_per_tensor_parallel_linear_and_per_norm_module():
    """DTensor's host time (a CPU's: `costmodel.dtensor_probe`) is charged where the runtime runs DTensor ops: on
    each of a Llama block's 7 column/row-parallel linears in both passes (``sp_linear`` under sequence
    parallelism), on each of its 2 norms under sequence parallelism (an RMSNorm is several captured ops but one
    ``SequenceParallel`` module), on the vocabulary-parallel head's linear, and again on what full checkpointing
    recomputes; never without tensor parallelism, and never on a GPU (empty: 0). Per op, and per byte its forward
    reads and writes on the rank (`dtensor_bytes`, in closed form below: the probe's count)."""
    from costmodel.cluster import group_span
    from costmodel.layercost import CostContext, dtensor_bytes, dtensor_ops, is_tp_layer, layer_cost, owned_params

    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    cl = _cluster()
    assert not cl.device.dtensor_overhead_s and load_cluster("dgx-h100").device.dtensor_overhead("tp_linear") == (0, 0)
    figures = {"tp_linear": (2e-4, 3e-4), "sp_linear": (2.5e-4, 3.5e-4), "sp_norm": (1.9e-4, 3.6e-4)}
    per_byte = {"tp_linear": (1.5e-10, 2e-10), "sp_linear": (1.5e-10, 2e-10), "sp_norm": (5e-11, 8e-11)}
    busy = dataclasses.replace(cl, device=dataclasses.replace(cl.device, dtensor_overhead_s=figures,
                                                              dtensor_byte_s=per_byte))
    # the probe's count, bf16, 2 sequences of 128 tokens on a rank of tp = 2: tokens·(in + out) · 2 bytes
    tokens = 2 * 128
    closed = {"column": lambda i, o: tokens * (i + o / 2) * 2,  # whole input, half the features
              "row": lambda i, o: tokens * (i / 2 + o) * 2}  # half the input, whole partial sums
    closed["vocab"] = closed["column"]
    owned = owned_params(lg)
    span = group_span(cl, 2, 1)
    head = next(lay for lay in lg.layers if lay.kind == "head")
    for tp, sp in ((1, False), (2, False), (2, True)):
        ctx = CostContext(cluster=cl, tp=tp, sp=sp, mbs=2, captured_batch=1, precision="bf16",
                          tp_span=span if tp > 1 else None)
        for layer, linears, norms in ((lg.blocks[0], 7, 2), (head, 1, 0)):
            kind = "sp_linear" if sp and layer.kind == "block" else "tp_linear"
            n_lin, n_norm = (linears, norms if sp else 0) if tp > 1 else (0, 0)
            base, more = (layer_cost(layer, AC.FULL, dataclasses.replace(ctx, cluster=c), owned.get(layer.name, ()))
                          for c in (cl, busy))
            wrapped = dtensor_ops(layer, ctx, is_tp_layer(layer))
            assert sorted(wrapped.values()) == sorted([kind] * n_lin + ["sp_norm"] * n_norm)
            nbytes = {"linear": 0.0, "norm": 0.0}
            for n in layer.nodes:
                if n.name in wrapped and wrapped[n.name] == "sp_norm":  # its input and output, half the sequence
                    nbytes["norm"] += 2 * tokens // 2 * 256 * 2
                    assert dtensor_bytes(n, "sp_norm", ctx) == 2 * tokens // 2 * 256 * 2
                elif n.name in wrapped:
                    w_out, w_in = n.input_shapes[1]
                    nbytes["linear"] += closed[n.tp_role](w_in, w_out)
            if layer.kind == "block" and tp > 1:  # q, k, v, o, gate, up, down of hidden 256, 4 kv heads of 32
                shapes = [("column", 256, 256), ("column", 256, 128), ("column", 256, 128), ("row", 256, 256),
                          ("column", 256, 704), ("column", 256, 704), ("row", 704, 256)]
                assert nbytes["linear"] == sum(closed[role](i, o) for role, i, o in shapes)
            for i, (got_base, got_more) in enumerate(((base.fwd_s, more.fwd_s), (base.bwd_s, more.bwd_s))):
                want = (n_lin * figures[kind][i] + n_norm * figures["sp_norm"][i]
                        + per_byte[kind][i] * nbytes["linear"] + per_byte["sp_norm"][i] * nbytes["norm"])
                assert got_more - got_base == pytest.approx(want, rel=1e-9, abs=1e-15)
            # full checkpointing repeats the forward's share of what it recomputes (at most all of it)
            assert 0 <= more.recompute_s - base.recompute_s <= more.fwd_s - base.fwd_s + 1e-15
            if layer.kind == "block" and tp > 1:
                assert more.recompute_s - base.recompute_s > 0


def test_dtensor_probe_measures_every_wrapped_op_in_a_process_of_its_own(monkeypatch):
    """`costmodel.dtensor_probe` runs torch 2.13's parallel styles as rank 0 of a 2-rank fake process group in a
    child process (the planner's process gets no process group) and finds each DTensor op slower than its plain op:
    here ~200-700 µs per op against a few µs, so a positive figure for each of the three, each both ways, and a
    figure per byte for each (≥ 0), the linear's positive: its extra time at 8×128 tokens was 2-4 times the one at
    2×8 in every run here. It runs as it would inside a torchrun rank
    (`auto_parallelize` plans there): with the launcher's variables set, an `init_method` probe joined the agent's
    store and waited for a 2-rank world until its 300 s timeout."""
    import socket

    import torch.distributed as dist

    from costmodel.hardware import DTENSOR_OPS, _measure_dtensor_overhead

    with socket.socket() as s:  # a port nobody listens on, as the agent's would be to a stranger
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2",
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RUN_ID": "probe-test"}.items():
        monkeypatch.setenv(k, v)

    figures, per_byte, note = _measure_dtensor_overhead()
    assert set(figures) == set(DTENSOR_OPS) == set(per_byte), note
    assert all(t > 1e-5 for pair in figures.values() for t in pair), figures
    assert all(0 <= t < 1e-8 for pair in per_byte.values() for t in pair), per_byte
    assert sum(per_byte["tp_linear"]) > 0, per_byte
    assert not dist.is_initialized()


def test_fsdp_probe_measures_fsdp2_beside_its_collectives_in_a_process_of_its_own(monkeypatch):
    """`costmodel.fsdp_probe` runs torch 2.13's ``fully_shard`` (ZeRO-3 and ZeRO-2) as rank 0 of a 2-rank fake
    process group in a child process, inside a torchrun-like environment as `test_dtensor_probe_...` does: FSDP2's
    multi-rank path with collectives that move nothing. Each event costs its group time (here ~220 µs a gather,
    ~290 µs a reduction, against a step of ~20 µs per block), and its copies run at a positive rate below the one
    of a plain copy (here ~8-10 GB/s against ~33: they write storage freed and allocated at every gather)."""
    from costmodel.hardware import FSDP_EVENTS, _measure_fsdp_overhead

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "probe-test")
    figures, copy_bw, note = _measure_fsdp_overhead()
    assert set(figures) == set(FSDP_EVENTS), note
    assert all(figures[e][0] > 2e-5 and figures[e][1] >= 0 for e in FSDP_EVENTS), figures
    assert 1e8 < copy_bw < 1e12, copy_bw


def test_tensor_parallel_calls_are_counted_per_collective():
    """A Llama block all-reduces twice in each pass under TP (after the attention's and the MLP's row-parallel
    projections; before the shared inputs of q/k/v and of gate/up), so on a link with a per-call latency L the
    block's forward communication is 2 calls; with sequence parallelism each becomes a reduce-scatter and an
    all-gather, two calls each, and the copy torch makes before the reduce-scatter (`seq_relayout_bytes`; at one
    sequence per micro-batch the all-gather's is a view)."""
    from costmodel.cluster import group_span
    from costmodel.collectives import all_gather_time, all_reduce_time, reduce_scatter_time
    from costmodel.layercost import (
        CostContext,
        copy_time,
        layer_cost,
        owned_params,
        seq_relayout_bytes,
        tp_comm_bytes,
        tp_comm_calls,
    )

    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    cl = _cluster()
    lat = 1e-3
    slow = dataclasses.replace(cl, intra=dataclasses.replace(cl.intra, call_latency=lat))
    block = lg.blocks[0]
    span = group_span(slow, 2, 1)
    for sp in (False, True):
        ctx = CostContext(cluster=slow, tp=2, sp=sp, mbs=1, captured_batch=1, precision="bf16", tp_span=span)
        assert tp_comm_calls(block, ctx) == (2, 2)
        bf, _ = tp_comm_bytes(block, ctx)
        got = layer_cost(block, AC.NONE, ctx, owned_params(lg)[block.name]).tp_comm_fwd_s
        want = (reduce_scatter_time(bf, span, slow, 2) + all_gather_time(bf, span, slow, 2)
                + copy_time(seq_relayout_bytes(bf, bf, ctx), ctx) if sp else all_reduce_time(bf, span, slow, 2))
        assert got == pytest.approx(want, rel=1e-12)
        assert got >= (4 if sp else 2) * lat


def _relayout_copies(tp: int, batch: int, seq: int = 16, width: int = 4) -> dict[str, int]:
    """Bytes torch 2.13 copies (``aten.cat`` outputs) around DTensor's sequence-parallel redistributions on a
    ``tp``-rank fake process group: an all-gather of a [batch, seq, width] fp32 activation along the sequence
    (``Shard(1)`` → ``Replicate``), and a reduce-scatter of its partial sums back (``Partial`` → ``Shard(1)``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default:
                self.nbytes += out.numel() * out.element_size()
            return out

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        out = {}
        for kind, source, target, shape in (("gather", Shard(1), Replicate(), (batch, seq // tp, width)),
                                            ("scatter", Partial(), Shard(1), (batch, seq, width))):
            with Copies() as copies:
                DTensor.from_local(torch.randn(shape), mesh, [source], run_check=False).redistribute(mesh, [target])
            out[kind] = copies.nbytes
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_sequence_parallel_collectives_copy_what_torch_copies(batch):
    """torch 2.13's DTensor gathers and scatters a batch-first activation along its sequence (dim 1) through NCCL's
    dim 0, with a copy of the whole tensor around the collective (`costmodel.layercost.seq_relayout_bytes`): before
    every reduce-scatter, and after an all-gather unless the micro-batch is one sequence (a view). Traced on a fake
    process group, the copies are what the cost model charges, for a micro-batch of 1 and of 3; Megatron-LM's
    sequence-first activations (``seq_relayout=False``) copy nothing."""
    from costmodel.layercost import CostContext, copy_time, seq_relayout_bytes

    tp, seq, width = 4, 16, 4
    traced = _relayout_copies(tp, batch, seq, width)
    whole = batch * seq * width * 4
    ctx = CostContext(cluster=_cluster(), tp=tp, sp=True, mbs=batch, captured_batch=1, precision="bf16")
    assert traced["gather"] == seq_relayout_bytes(whole, 0.0, ctx)
    assert traced["scatter"] == seq_relayout_bytes(0.0, whole, ctx) == whole
    assert traced["gather"] == (whole if batch > 1 else 0)
    dev = ctx.cluster.device
    assert copy_time(seq_relayout_bytes(whole, whole, ctx), ctx) == pytest.approx(
        2 * (traced["gather"] + traced["scatter"]) / (dev.hbm_bw * dev.memory_eff))
    assert seq_relayout_bytes(whole, whole, dataclasses.replace(ctx, seq_relayout=False)) == 0.0


def test_pipeline_boundary_gathers_copy_as_torch_does():
    """Under tensor parallelism a pipeline boundary's transfer is scattered over the TP ranks and gathered back
    (`planner.emit.runtime.apply_pp_scatter`) along the hidden dimension (`planner.emit.runtime._hidden_gather`:
    the sequence precedes it), so each such gather pays torch's copy whatever the micro-batch; sequence
    parallelism's two more gathers, along the sequence, only beyond one sequence per micro-batch
    (`Evaluator.pp_gather_copies`)."""
    from costmodel.collectives import all_gather_time, send_recv_time
    from costmodel.layercost import copy_time

    lg = profile_model("llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    cl = dataclasses.replace(_cluster(nodes=2), gpus_per_node=4)
    for mbs in (1, 2):
        for sp in (False, True):
            ev = Evaluator(lg, cl, ParallelConfig(dp=1, tp=4, pp=2, mbs=mbs, sp=sp), 8)
            i = lg.layers.index(lg.blocks[2])
            gathers = ev.pp_gathers(i)
            assert len(gathers) == (4 if sp else 2)
            hidden = sum(gathers[:2])
            assert ev.pp_gather_copies(i) == hidden + (sum(gathers[2:]) if mbs > 1 else 0.0)
            want = (2 * send_recv_time(ev.p2p_bytes(i), ev.pp_cross_node, cl)
                    + sum(all_gather_time(g, ev.tp_span, cl) for g in gathers) + copy_time(ev.pp_gather_copies(i),
                                                                                            ev.ctx))
            assert ev.p2p_time(i) == pytest.approx(want, rel=1e-12)


def test_float8_gathers_sequence_parallel_activations_in_float8():
    """Under float8 training the tensor-parallel linears cast before they gather (torchao's tensorwise
    ``PrepareFloat8ModuleInput``, ``Float8ColwiseParallel``, ``Float8RowwiseParallel``, as torchtitan runs them):
    with sequence parallelism each all-gather of a block whose linears run in float8 (and the copy after it,
    `tp_relayout_bytes`) moves half the bytes of the 16-bit one, the reduce-scatters (and the copies before them)
    the same; without sequence parallelism the all-reduces are unchanged. The head, and a block none of whose
    linears runs in float8 (`is_float8_linear`: a width not a multiple of 16), gather 16-bit: one rule decides
    both what computes and what gathers in float8."""
    from costmodel.cluster import group_span
    from costmodel.collectives import all_gather_time, all_reduce_time, reduce_scatter_time
    from costmodel.layercost import CostContext, gather_scale, tp_comm_bytes, tp_comm_time, tp_relayout_bytes

    cl = _cluster()
    span = group_span(cl, 4, 1)
    nbytes = 64 * 2**20
    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    block, head = lg.blocks[0], lg.layers[-1]
    for sp in (True, False):
        ctx = {p: CostContext(cluster=cl, tp=4, sp=sp, mbs=2, captured_batch=1, precision=p, tp_span=span)
               for p in ("bf16", "fp8")}
        g = {p: gather_scale(block, ctx[p]) for p in ctx}
        assert gather_scale(head, ctx["fp8"]) == 1.0
        if not sp:
            assert g == {"bf16": 1.0, "fp8": 1.0}
            assert tp_comm_time(nbytes, 2, ctx["fp8"], scale=g["fp8"]) == all_reduce_time(nbytes, span, cl, 2)
            continue
        assert g == {"bf16": 1.0, "fp8": 0.5}
        want = reduce_scatter_time(nbytes, span, cl, 2) + all_gather_time(nbytes / 2, span, cl, 2)
        assert tp_comm_time(nbytes, 2, ctx["fp8"], scale=g["fp8"]) == pytest.approx(want, rel=1e-12)
        assert tp_comm_time(nbytes, 2, ctx["fp8"], scale=g["fp8"]) < tp_comm_time(nbytes, 2, ctx["bf16"])
    # a Llama block's copies: the all-gathers' halve, the reduce-scatters' stay
    ctx = {p: CostContext(cluster=cl, tp=4, sp=True, mbs=2, captured_batch=1, precision=p, tp_span=span)
           for p in ("bf16", "fp8")}
    (bf16_f, bf16_b), (fp8_f, fp8_b) = (tp_relayout_bytes(block, ctx[p]) for p in ("bf16", "fp8"))
    bf, bb = tp_comm_bytes(block, ctx["bf16"])
    assert (bf16_f, bf16_b) == (2 * bf, 2 * bb) and (fp8_f, fp8_b) == (1.5 * bf, 1.5 * bb)
    # hidden 264 = 16 · 16.5: no linear of the block runs in float8, nor does it gather in float8
    odd = profile_model("llama:layers=2,hidden=264,heads=4,kv_heads=2,ffn=704,vocab=1024,seq=128").blocks[0]
    assert gather_scale(odd, ctx["fp8"]) == 1.0
    assert tp_relayout_bytes(odd, ctx["fp8"]) == tp_relayout_bytes(odd, ctx["bf16"])
    # and the block's own tensor-parallel time follows the same rule
    from costmodel.layercost import layer_cost, owned_params

    odd_lg = profile_model("llama:layers=2,hidden=264,heads=4,kv_heads=2,ffn=704,vocab=1024,seq=128")
    for layer, lgraph, halved in ((block, lg, True), (odd, odd_lg, False)):
        own = owned_params(lgraph)[layer.name]
        c = {p: layer_cost(layer, AC.NONE, ctx[p], own) for p in ctx}
        assert (c["fp8"].tp_comm_fwd_s < c["bf16"].tp_comm_fwd_s) is halved
        assert (c["fp8"].tp_comm_fwd_s == c["bf16"].tp_comm_fwd_s) is not halved


def test_float8_runs_the_blocks_linears_only():
    """Float8 training (torchao's conversion) swaps the blocks' ``nn.Linear`` modules: the head (left out by
    torchtitan's configs, ``filter_fqns = ["output"]``), a linear with a dimension not a multiple of 16 and any
    other matmul (an unfused attention's) keep 16 bits, so they cost under fp8 what they cost under bf16."""
    from costmodel.layercost import CostContext, is_float8_linear, layer_cost, owned_params

    cl = load_cluster("dgx-h100")  # (a device with an fp8 peak)
    for spec, odd in (("gpt:layers=2,hidden=2048,heads=16,seq=128,vocab=1024,attention=math", False),
                      ("llama:layers=2,hidden=2048,heads=16,kv_heads=4,ffn=5448,vocab=1024,seq=128", True)):
        lg = profile_model(spec)
        owned = owned_params(lg)
        head, block = lg.layers[-1], lg.blocks[0]
        linears = [n for n in block.nodes if is_float8_linear(n, block)]
        others = [n for n in block.nodes if n.kind == "matmul" and n not in linears]
        assert not any(is_float8_linear(n, head) for n in head.nodes)
        if odd:  # ffn 5448 = 16 · 340.5: the feed-forward's three linears stay 16-bit
            assert {n.module_path.rsplit(".", 1)[-1] for n in others} == {"w1", "w2", "w3"}
        else:  # the attention core's two batched matmuls
            assert len(others) == 2 and all(not n.params for n in others)
        assert linears
        ctx = {p: CostContext(cluster=cl, tp=1, sp=False, mbs=8, captured_batch=1, precision=p, float8_recipe=None)
               for p in ("bf16", "fp8")}
        bf16, fp8 = (layer_cost(head, AC.NONE, ctx[p], owned[head.name]) for p in ("bf16", "fp8"))
        assert (fp8.fwd_s, fp8.bwd_s) == (bf16.fwd_s, bf16.bwd_s)
        bf16, fp8 = (layer_cost(block, AC.NONE, ctx[p], owned[block.name]) for p in ("bf16", "fp8"))
        assert fp8.fwd_s < bf16.fwd_s and fp8.bwd_s < bf16.bwd_s


def test_float8_casts_priced_as_torchao_runs_them():
    """torchao's tensorwise float8 casts, per element of a 16-bit tensor: a max-abs pass reads it (2 bytes), a
    cast reads it and writes a byte per layout, a float8 copy into the other layout ``torch._scaled_mm`` takes moves
    1 + 1. Compiled, as torchao's roofline model counts them (``roofline_utils.get_tensor_memory_traffic_ovhd_s``,
    fusion modeling): input forward and output gradient backward one cast into both layouts (max-abs fused: 4),
    once per tensor (q, k and v share theirs); weight 2 + 3 forward, 3 backward. Eager, as torchao's code runs
    them: each linear casts its input forward (5) and again backward, then copies it (7); its output gradient twice,
    one copied (12); its weight once (5) and copies it backward (2). Under TP a column-parallel input is cast once
    by the module (on its shard under SP, then gathered in float8 and copied whole: 1 + 1), a row-parallel output
    gradient likewise; a tensor split over the TP ranks waits for a 4-byte max-abs all-reduce per cast
    (torchtitan's docs/float8.md). Closed form for a Llama block, and the block's time under fp8 grows by exactly
    those bytes at the achieved memory bandwidth and those all-reduces."""
    from costmodel.cluster import group_span
    from costmodel.collectives import all_reduce_time
    from costmodel.layercost import (
        AMAX_BYTES,
        CostContext,
        float8_cast_costs,
        is_float8_linear,
        layer_cost,
        owned_params,
    )

    cl = _cluster()
    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    block = lg.blocks[0]
    owned = owned_params(lg)[block.name]
    linears = [n for n in block.nodes if is_float8_linear(n, block)]
    assert [n.module_path.rsplit(".", 1)[-1] for n in linears] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    mbs, tokens, hidden, kv, ffn = 2, 128, 256, 128, 704
    act = mbs * tokens
    big = act * hidden  # the attention's and the feed-forward's inputs, wo's and w2's outputs
    for tp, sp, compiled in [(1, False, False), (1, False, True)] + [(4, sp, c) for sp in (0, 1) for c in (0, 1)]:
        ctx = CostContext(cluster=cl, tp=tp, sp=bool(sp), mbs=mbs, captured_batch=1, precision="fp8",
                          compiled=bool(compiled), tp_span=group_span(cl, tp, 1) if tp > 1 else None)
        s = 1 / tp
        row_in = act * s * (hidden + ffn)  # wo's and w2's inputs, their rank's share
        col_out = act * s * (hidden + 2 * kv + 2 * ffn)  # q, k, v, w1, w3's outputs, likewise
        weights = s * (hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * ffn)
        if compiled:
            # the two shared inputs, the two row-parallel outputs' gradients: gathered under SP, else in place
            gathered = (3 * big * s, 2 * big) if sp else (4 * big, 0)
            fwd = 2 * gathered[0] + 4 * row_in + 5 * weights
            bwd = 2 * gathered[1] + 4 * col_out + 2 * sum(gathered) + 3 * weights
            reduces = (7 + 2 + 2 * sp, 5 + 2 * sp)
        elif tp == 1:
            inputs = 5 * big + row_in  # q, k, v and w1, w3 each cast their own
            fwd, bwd = 5 * inputs + 5 * weights, 7 * inputs + 12 * (col_out + 2 * big) + 2 * weights
            reduces = (0, 0)
        else:
            once = 5 * big * (s if sp else 1)  # the attention's and the feed-forward's, by the module
            row_g = 5 * big * (s if sp else 1) + 2 * big  # wo's and w2's output gradients, likewise, then copied
            fwd = 2 * once + 5 * row_in + 5 * weights
            bwd = 5 * 2 * big + 7 * row_in + 12 * col_out + 2 * row_g + 2 * weights
            reduces = (7 + 2 + 2 * sp, 2 * 5 + 2 + 2 * sp)
        if tp == 1:
            reduces = (0, 0)
        seen: set[str] = set()
        got = [float8_cast_costs(n, ctx, tp, seen) for n in linears]
        case = (tp, sp, compiled)
        assert sum(c.fwd_bytes for c in got) == pytest.approx(fwd, rel=1e-12), case
        assert sum(c.bwd_bytes for c in got) == pytest.approx(bwd, rel=1e-12), case
        assert (sum(c.fwd_amax for c in got), sum(c.bwd_amax for c in got)) == reduces, case
        # the block's time: the casts are kernels of their own, at the achieved memory bandwidth, each all-reduce
        # a 4-byte one of the group
        bw = cl.device.hbm_bw * cl.device.memory_eff
        one = all_reduce_time(AMAX_BYTES, ctx.tp_span, cl) if tp > 1 else 0.0
        on, off = (layer_cost(block, AC.NONE, dataclasses.replace(ctx, float8_recipe=c), owned)
                   for c in ("torchao", None))
        assert on.fwd_s - off.fwd_s == pytest.approx(fwd / bw + reduces[0] * one, rel=1e-9), case
        assert on.bwd_s - off.bwd_s == pytest.approx(bwd / bw + reduces[1] * one, rel=1e-9), case


def test_float8_casts_priced_as_transformer_engine_runs_them():
    """Transformer Engine's delayed scaling (``te.Linear``): each cast is one ``fp8_cast_transpose_fused`` kernel
    that reads the 16-bit tensor (2 bytes an element), writes both layouts (1 + 1) and records the max-abs as it
    goes, its scale taken from earlier steps' (no max-abs pass, no all-reduce to wait for). Per linear: its input
    forward, its weight every forward, its output gradient backward, each module its own (q, k and v cast the
    same input three times). Under SP a column-parallel input is cast on its shard (2 + 1), gathered in float8 and
    transposed whole backward (1 + 1), a row-parallel output gradient likewise. Closed form for a Llama block."""
    from costmodel.cluster import group_span
    from costmodel.layercost import CostContext, float8_cast_costs, is_float8_linear, layer_cost, owned_params

    cl = _cluster()
    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    block = lg.blocks[0]
    owned = owned_params(lg)[block.name]
    linears = [n for n in block.nodes if is_float8_linear(n, block)]
    mbs, tokens, hidden, kv, ffn = 2, 128, 256, 128, 704
    act = mbs * tokens
    big = act * hidden
    for tp, sp, compiled in [(1, False, False), (1, False, True), (4, False, False), (4, True, True)]:
        ctx = CostContext(cluster=cl, tp=tp, sp=sp, mbs=mbs, captured_batch=1, precision="fp8", compiled=compiled,
                          tp_span=group_span(cl, tp, 1) if tp > 1 else None, float8_recipe="transformer-engine")
        s = 1 / tp
        row_in = act * s * (hidden + ffn)
        col_out = act * s * (hidden + 2 * kv + 2 * ffn)
        weights = s * (hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * ffn)
        col_in = 5 * big  # q, k, v and w1, w3 each cast their own (whole) input
        if sp:
            fwd = 3 * col_in * s + 4 * row_in + 4 * weights
            bwd = 2 * col_in + 4 * col_out + 2 * (3 * big * s + 2 * big)
        else:
            fwd = 4 * col_in + 4 * row_in + 4 * weights
            bwd = 4 * col_out + 4 * 2 * big
        got = [float8_cast_costs(n, ctx, tp, set()) for n in linears]
        case = (tp, sp, compiled)
        assert sum(c.fwd_bytes for c in got) == pytest.approx(fwd, rel=1e-12), case
        assert sum(c.bwd_bytes for c in got) == pytest.approx(bwd, rel=1e-12), case
        assert all(c.fwd_amax == c.bwd_amax == 0 for c in got), case
        bw = cl.device.hbm_bw * cl.device.memory_eff
        on, off = (layer_cost(block, AC.NONE, dataclasses.replace(ctx, float8_recipe=c), owned)
                   for c in ("transformer-engine", None))
        assert on.fwd_s - off.fwd_s == pytest.approx(fwd / bw, rel=1e-9), case
        assert on.bwd_s - off.bwd_s == pytest.approx(bwd / bw, rel=1e-9), case


def test_split_linears_move_their_whole_activation():
    """A tensor-parallel rank's share of a split linear reads the whole input (column-parallel: gathered or
    replicated) or writes whole partial sums (row-parallel), so its bytes do not shrink by tp as its FLOPs do: each
    split matmul of a Llama block at tp = 4 is charged at least the whole activation it reads or writes forward,
    and twice what does not shrink backward (its input read again for the weight's gradient and the input's
    gradient written whole, or the output's gradient read twice)."""
    from costmodel.layercost import _shard, _whole_bytes

    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    block = lg.blocks[0]
    split = [n for n in block.nodes if n.kind == "matmul" and n.tp_role in ("column", "row")]
    by_name = {n.name: n for n in block.nodes}
    assert {n.tp_role for n in split} == {"column", "row"}
    for n in split:
        f = _shard(n, 4, True, True)
        assert f == 0.25
        w_f, w_b = _whole_bytes(n, f, block, by_name)
        whole = n.output_bytes if n.tp_role == "row" else math.prod(n.input_shapes[0]) * 2  # (x: bf16)
        assert n.fwd_bytes * f + w_f >= whole  # the rank's forward bytes
        assert w_b == 2 * w_f > 0
        assert _whole_bytes(n, 1.0, block, by_name) == (0.0, 0.0)  # without tensor parallelism: the captured bytes


def test_cpu_device_measured_by_an_older_version_is_measured_again(tmp_path, monkeypatch):
    """The CPU's figures are cached per machine; a file written by an older measurement (no version, no per-op
    overhead) is measured again and replaced, and a current one is read back as written; one measured while the
    machine was busy (a core's benchmark shared with other work reads slow) is measured again once it is quiet."""
    from costmodel import hardware

    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    path = hardware.cpu_cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"name": "cpu", "peak_flops": {"fp32": 9e10}, "memory_bytes": 1e9, "hbm_bw": 3e10,
                                "memory_eff": 1.0, "source": "old",
                                "matmul_eff": {"e_max": 1.0, "f_half": 1e7, "source": "prior"}}))
    fresh = hardware.DeviceSpec(name="cpu", peak_flops={"fp32": 7e10}, memory_bytes=1e9, hbm_bw=2e10,
                                matmul_eff=hardware.EfficiencyCurve(e_max=1.0, f_half=2e6, source="fit"),
                                memory_eff=1.0, attention_eff=0.6, op_overhead_s=(2.5e-6, 4e-6),
                                fsdp_overhead_s={"gather": (1.8e-4, 1e-5), "reduce": (2.7e-4, 2e-5)},
                                fsdp_copy_bw=9.7e9, overlap_slowdown=hardware.CPU_OVERLAP_SLOWDOWN, host_memory=True,
                                source="new")
    calls = []
    monkeypatch.setattr(hardware, "_measure_cpu_device", lambda: calls.append(1) or fresh)
    monkeypatch.setattr(hardware, "machine_load", lambda: 0.0)
    assert hardware.measure_cpu_device.__wrapped__() == fresh and calls == [1]
    assert json.loads(path.read_text())["version"] == hardware._CPU_MEASURE_VERSION
    assert hardware.measure_cpu_device.__wrapped__() == fresh and calls == [1]  # read back, not measured
    # a container's memory limit lowered since: read back at the limit
    host = hardware.host_memory_bytes
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: 5e8)
    assert hardware.measure_cpu_device.__wrapped__() == dataclasses.replace(fresh, memory_bytes=5e8)
    monkeypatch.setattr(hardware, "host_memory_bytes", host)

    # measured on a busy machine: shared while the machine stays busy, measured again once it is quiet
    path.unlink()
    load = [4.0]
    monkeypatch.setattr(hardware, "machine_load", lambda: load[0])
    monkeypatch.setattr(hardware, "_cpus", lambda: 2)
    first = hardware.measure_cpu_device.__wrapped__()
    assert calls == [1, 1] and "busy (load 4.0 on 2 CPUs)" in first.source
    assert json.loads(path.read_text())["load"] == pytest.approx(4.0, abs=0.01)
    assert hardware.measure_cpu_device.__wrapped__() == first and calls == [1, 1]
    load[0] = 0.3
    assert hardware.measure_cpu_device.__wrapped__() == fresh and calls == [1, 1, 1]
    assert hardware.measure_cpu_device.__wrapped__() == fresh and calls == [1, 1, 1]
    assert hardware.busy(1.6, cpus=2) and not hardware.busy(1.4, cpus=2) and not hardware.busy(None)
    # work that starts while it measures counts: the load after, less what 60 s of its own thread add (1 − 1/e)
    load[0] = 2.2
    assert hardware._load_during(0.3, 60.0) == pytest.approx(2.2 - (1 - math.exp(-1)), rel=1e-12)
    load[0] = None
    assert hardware._load_during(0.3, 60.0) == 0.3


def test_ddp_largest_bucket_is_torchs_own_assignment():
    """`costmodel.memory.ddp_largest_bucket` against torch 2.13's ``_compute_bucket_assignment_by_size`` (which DDP
    rebuilds its buckets with: 1 MiB first, 25 MiB after) on random gradient lists, with embedding-sized tensors
    far beyond a bucket among them: the largest bucket, to the byte."""
    import random

    import torch
    import torch.distributed as dist

    from costmodel.memory import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_largest_bucket

    rng = random.Random(0)
    for _ in range(50):
        numel = [rng.choice([rng.randint(1, 4096), rng.randint(2**16, 2**22), rng.randint(2**22, 2**24)])
                 for _ in range(rng.randint(1, 40))]
        tensors = [torch.empty(n, device="meta") for n in numel]
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES],
                                                             [False] * len(tensors))
        assert ddp_largest_bucket([4.0 * n for n in numel]) == max(sum(4 * numel[i] for i in b) for b in buckets)


def test_autocasts_weight_casts_are_priced_where_the_runtime_makes_them():
    """Autocast casts each weight once per region (fp32 read, 16 bits written), which the capture leaves out of its
    nodes' traffic. The runtime's region is a micro-batch's outside pipelines, so a block's forward there carries
    its casts; within a pipeline the schedule's one region casts once per step (not charged per micro-batch); a
    selectively checkpointed block, its cache off, casts in its forward and again in its recomputation."""
    from costmodel.layercost import _node_time

    lg = profile_model("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=128")
    cl = load_cluster("dgx-h100:nodes=1:gpus_per_node=2")
    block = next(i for i, layer in enumerate(lg.layers) if layer.kind == "block")
    ddp = Evaluator(lg, cl, ParallelConfig(dp=2, mbs=1, precision="bf16"), 8)
    piped = Evaluator(lg, cl, ParallelConfig(pp=2, mbs=1, precision="bf16"), 8)
    plain = ddp.cost(block, AC.NONE)
    cast = _node_time(0.0, 6.0 * plain.cast_numel, ddp.ctx)
    assert cast > 0
    assert plain.fwd_s == pytest.approx(piped.cost(block, AC.NONE).fwd_s + cast, rel=1e-12)
    selective = piped.cost(block, AC.SELECTIVE)  # (its recomputation recasts, in a pipeline too)
    full = piped.cost(block, AC.FULL)  # (the cache serves its recomputation)
    assert selective.fwd_s == pytest.approx(full.fwd_s + cast, rel=1e-12)
    assert selective.cast_numel == 0.0 and full.cast_numel == plain.cast_numel


def test_weights_are_read_once_per_micro_batch_not_once_per_sequence(monkeypatch):
    """The capture counts every tensor an op reads or writes at its batch of one sequence, a linear's weight
    among them; a micro-batch of m sequences moves m times the activations but reads the weight once (and writes
    its gradient once). Each linear of a Llama block at mbs 8 is charged 8 × its one-sequence bytes less 7 weights
    forward and 14 backward (read for the input's gradient, its gradient written), the rank's share of them under
    TP; the embedding its table once each way. Before, a micro-batch of 56 sequences of 512 tokens read each weight
    56 times, which made llm-foundry's short-sequence float8 GEMMs memory-bound (its 1B seq 512 row +30 %)."""
    import costmodel.layercost as lc
    from costmodel.cluster import group_span

    cl = _cluster()
    lg = profile_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1024,seq=128")
    owned = lc.owned_params(lg)
    calls: list = []
    real = lc._node_time
    monkeypatch.setattr(lc, "_node_time", lambda flops, nbytes, ctx, **kw: calls.append(nbytes) or real(
        flops, nbytes, ctx, **kw))
    for layer, tp in [(lg.blocks[0], 1), (lg.blocks[0], 4), (lg.layers[0], 1)]:
        charged = {}
        for mbs in (1, 8):
            ctx = lc.CostContext(cluster=cl, tp=tp, sp=False, mbs=mbs, captured_batch=1, precision="bf16",
                                 tp_span=group_span(cl, tp, 1) if tp > 1 else None, grad_bytes=2)
            calls.clear()
            lc.layer_cost(layer, AC.NONE, ctx, owned[layer.name])
            charged[mbs] = list(calls)
        nodes = list(layer.nodes)
        assert len(charged[1]) == len(charged[8]) == 2 * len(nodes)
        weighted = 0
        for i, n in enumerate(nodes):
            f_bytes = charged[8][2 * i] - 8 * charged[1][2 * i]
            b_bytes = charged[8][2 * i + 1] - 8 * charged[1][2 * i + 1]
            share = 1 / tp if n.tp_role in ("column", "row") else 1.0
            if n.kind == "matmul" and n.params:
                w = 2 * lc._prod(n.input_shapes[1]) * share
                assert (f_bytes, b_bytes) == (pytest.approx(-7 * w), pytest.approx(-14 * w)), n.name
                weighted += 1
            elif n.op == "aten.embedding.default":
                w = 2 * lc._prod(n.input_shapes[0])
                assert (f_bytes, b_bytes) == (pytest.approx(-7 * w), pytest.approx(-7 * w)), n.name
                weighted += 1
            else:
                assert (f_bytes, b_bytes) == (pytest.approx(0.0, abs=1e-6), pytest.approx(0.0, abs=1e-6)), n.name
        assert weighted == (7 if layer.kind == "block" else 1)


def test_measured_scale_is_the_line_through_two_measured_batches():
    """`measured_scale`: one time scales in proportion to the roofline; two give a fixed part plus a proportional
    one, through both points; a line steeper than proportional holds above the first point and gives way to
    proportion below it; one falling with the work (noise) is flat."""
    from costmodel.layercost import measured_scale

    assert measured_scale(2.0, 1.0, 3.0) == pytest.approx(2.0)
    # 1 s fixed + 1 s per roofline second: 2 s where the roofline says 1, 5 s where it says 4
    assert measured_scale(2.0, 1.0, 1.0, 5.0, 4.0) * 1.0 == pytest.approx(2.0)
    assert measured_scale(2.0, 1.0, 4.0, 5.0, 4.0) * 4.0 == pytest.approx(5.0)
    assert measured_scale(2.0, 1.0, 8.0, 5.0, 4.0) * 8.0 == pytest.approx(9.0)
    # steeper than proportional (a negative fixed part): through both points above the first, proportional below
    assert measured_scale(2.0, 1.0, 4.0, 12.0, 4.0) * 4.0 == pytest.approx(12.0)
    assert measured_scale(2.0, 1.0, 8.0, 12.0, 4.0) * 8.0 == pytest.approx(2.0 + 10.0 / 3.0 * 7.0)
    assert measured_scale(2.0, 1.0, 0.5, 12.0, 4.0) == pytest.approx(2.0)
    # flat or falling (a fixed part over m): the first point's time throughout
    assert measured_scale(2.0, 1.0, 8.0, 1.5, 4.0) * 8.0 == pytest.approx(2.0)
    # no second point, or one the roofline does not put above the first: in proportion
    assert measured_scale(2.0, 1.0, 8.0, 5.0, 1.0) == pytest.approx(2.0)


def test_auto_parallelize_on_more_ranks_of_this_host_shares_its_memory():
    """More ranks than a CPU preset has are more processes on this host, sharing its memory (not more hosts): the
    plan names the cluster it was made for; a cluster given with options must match the world size."""
    from planner.search.outer import plan_for_module
    from profiler.zoo.registry import resolve_model

    model, inputs = resolve_model("gpt-tiny").build(batch=1, device="cpu")
    plan = plan_for_module(model, inputs, cluster="cpu-local", world_size=4, time_limit=10)
    c = plan.config
    assert plan.cluster == "cpu-local:gpus_per_node=4" and c.dp * c.tp * c.pp * c.cp == 4
    cl = load_cluster(plan.cluster)
    assert cl.memory_per_rank_bytes == cl.device.memory_bytes / 4
    with pytest.raises(ValueError, match="world size 3 but cluster cpu-local:nodes=1"):
        plan_for_module(model, inputs, cluster="cpu-local:nodes=1", world_size=3, time_limit=10)


def test_example_rows_repeated_for_a_larger_batch():
    """`_rows` (auto_parallelize's second measured batch): every tensor holding the example's batch in its first
    dimension repeated to the larger batch, anything else as it is; a batch that is no multiple is refused."""
    import torch

    from planner.search.outer import _rows

    ids, mask, scale = torch.arange(6).reshape(2, 3), torch.ones(2, 1, 3), 0.5
    big = _rows([ids, mask, scale], 8)
    assert big[0].shape == (8, 3) and torch.equal(big[0][2:4], ids) and big[1].shape == (8, 1, 3)
    assert big[2] == 0.5
    with pytest.raises(ValueError, match="5 rows from inputs of 2"):
        _rows([ids], 5)


def test_fused_attention_is_less_efficient_on_short_sequences():
    """`DeviceSpec.attention_seq_half`: a fused causal attention kernel runs at ``L/(L + seq_half)`` of its
    long-sequence efficiency (FlashAttention's fixed cost per query tile against the causal prefix it walks). A
    step at 512 tokens per sequence slows by more than one at 8192 when the half-point rises from 0 (the
    committed default: no dependence), and by as much as the attention's own time predicts; under context
    parallelism a rank's calls run at 1/cp of the length."""
    from costmodel.layercost import attention_call_length, attention_len_eff

    assert attention_len_eff(1000.0, 0.0) == 1.0 and attention_len_eff(1000.0, 1000.0) == 0.5
    assert attention_len_eff(0.0, 1000.0) == 1.0  # (a node without a length: as before)
    assert [attention_len_eff(x, 1024.0) for x in (512, 2048, 8192)] == pytest.approx([1 / 3, 2 / 3, 8 / 9])
    base = load_cluster("dgx-a100-80g")

    def with_half(h: float, attention_eff: float = base.device.attention_eff):
        return dataclasses.replace(base, device=dataclasses.replace(base.device, attention_seq_half=h,
                                                                    attention_eff=attention_eff))

    slowdown = {}
    for seq in (512, 8192):
        lg = profile_model(f"gpt:layers=2,hidden=1024,heads=16,seq={seq},vocab=8192,dropout=0")
        node = next(n for layer in lg.layers for n in layer.nodes if n.kind == "attention")
        assert attention_call_length(node, 1) == seq and attention_call_length(node, 4) == seq / 4
        cfg, gb = ParallelConfig(dp=8), 8 * 65536 // seq
        t0 = estimate(lg, with_half(0.0), cfg, gb).breakdown_s["compute"]
        t1 = estimate(lg, with_half(1024.0), cfg, gb).breakdown_s["compute"]
        # halving the long-sequence attention efficiency adds the attention's time once: the half-point adds it
        # (1 + 1024/L) − 1 times
        t_attn = estimate(lg, with_half(0.0, base.device.attention_eff / 2), cfg, gb).breakdown_s["compute"] - t0
        assert t1 - t0 == pytest.approx(t_attn * 1024 / seq, rel=1e-6)
        slowdown[seq] = t1 / t0
    assert slowdown[512] > slowdown[8192] > 1.0
