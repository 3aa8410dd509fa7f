"""Expert parallelism in the cost model (costmodel/moe.py): closed forms of the all-to-alls and the expert states,
the imbalance factor, the search's ep dimension."""

from __future__ import annotations

import pytest

from costmodel.cluster import parse_cluster_yaml
from costmodel.collectives import all_to_all_time
from costmodel.config import AC, ParallelConfig
from costmodel.estimate import ConfigError, Evaluator, estimate
from costmodel.moe import COUNT_BYTES, is_expert_param
from profiler.api import profile_model

HIDDEN, SEQ, EXPERTS, TOP_K, LAYERS = 256, 64, 8, 2, 2
MOE = (f"moe:layers={LAYERS},hidden={HIDDEN},heads=4,kv_heads=2,ffn=512,vocab=512,seq={SEQ},experts={EXPERTS},"
       f"top_k={TOP_K}")


@pytest.fixture(scope="module")
def moe():
    return profile_model(MOE)


def _cluster(nodes=1, imbalance=None):
    extra = f"moe_imbalance: {imbalance}\n" if imbalance else ""
    return parse_cluster_yaml(f"""
name: test
device: {{name: t, peak_tflops: {{bf16: 312, fp32: 19.5}}, memory_GiB: 80, hbm_bw_GBps: 2039,
          matmul_eff: {{e_max: 0.7, f_half_gflop: 2}}, memory_eff: 0.8}}
gpus_per_node: 8
nodes: {nodes}
intra: {{bw_GBps: 230, latency_us: 3}}
inter: {{bw_GBps: 24, latency_us: 8}}
""" + extra)


def _block(lg):
    return next(i for i, layer in enumerate(lg.layers) if layer.kind == "block")


def _expert_numel(lg):
    return sum(p.numel for p in lg.model.params if is_expert_param(p, EXPERTS))


@pytest.mark.parametrize("ac, calls", [(AC.NONE, 4), (AC.FULL, 6)])
def test_all_to_all_bytes_and_time_closed_form(moe, ac, calls):
    """Per MoE layer and micro-batch: dispatch + combine forward, both again backward (and forward again under full
    recomputation), each tokens·top_k·hidden activations; one count exchange per forward run."""
    cfg = ParallelConfig(dp=8, ep=4, zero=3, mbs=2, precision="bf16")
    ev = Evaluator(moe, _cluster(), cfg, 16)
    c = ev.cost(_block(moe), ac)
    payload = 2 * SEQ * TOP_K * HIDDEN * 2  # mbs · seq tokens, top-k copies, bf16
    assert c.a2a_calls == calls and c.a2a_count_calls == calls // 2 - 1
    assert c.a2a_bytes == pytest.approx(calls * payload)
    one, count = all_to_all_time(payload, ev.ep_span, ev.cluster), all_to_all_time(EXPERTS * COUNT_BYTES,
                                                                                    ev.ep_span, ev.cluster)
    assert c.ep_comm_s == pytest.approx(calls * one + (calls // 2 - 1) * count)
    assert ev.cost(_block(moe), ac).ep_comm_fwd_s == pytest.approx(2 * one + count)


def test_no_expert_traffic_without_expert_parallelism(moe):
    c = Evaluator(moe, _cluster(), ParallelConfig(dp=8, zero=3), 16).cost(_block(moe), AC.NONE)
    assert c.a2a_bytes == 0 and c.ep_comm_s == 0 and c.expert_shard_extra == 0


def test_expert_parameters_held_one_over_ep(moe):
    """A rank holds 1/ep of the experts; ZeRO 0 keeps them whole, so its model states shrink by the experts'
    (1 − 1/ep); under ZeRO 3 the sharded states are experts/dp either way (FSDP over the dp/ep ranks holding the same
    experts)."""
    experts = _expert_numel(moe)
    est = {}
    for zero in (0, 3):
        for ep in (1, 4):
            cfg = ParallelConfig(dp=8, ep=ep, zero=zero, precision="bf16")
            est[zero, ep] = estimate(moe, _cluster(), cfg, 16).memory
    # ZeRO 0 (DDP under autocast): fp32 parameters, their 16-bit copies, fp32 gradients and two moments, 18 bytes
    states = [est[0, ep].params + est[0, ep].grads + est[0, ep].optimizer for ep in (1, 4)]
    assert states[0] - states[1] == pytest.approx(18 * experts * (1 - 1 / 4))
    # ZeRO 3: the sharded states do not depend on ep
    assert est[3, 1].params + est[3, 1].optimizer == pytest.approx(est[3, 4].params + est[3, 4].optimizer)


def test_imbalance_scales_the_expert_gemms_only(moe):
    cfg = ParallelConfig(dp=8, ep=4, zero=3, precision="bf16")
    even = Evaluator(moe, _cluster(), cfg, 16).cost(_block(moe), AC.NONE)
    skewed = Evaluator(moe, _cluster(imbalance=1.5), cfg, 16).cost(_block(moe), AC.NONE)
    assert skewed.fwd_s > even.fwd_s and skewed.fwd_s < 1.5 * even.fwd_s  # attention and router unchanged
    assert skewed.ep_comm_s == even.ep_comm_s


def test_the_busiest_expert_reads_its_weights_once(moe):
    """Imbalance gives the busiest expert more tokens, not more weights: on a device where every op is
    memory-bound (1 GB/s), each unit of imbalance adds the same time, less than reading the block's expert
    weights once (16 tokens an expert here, so their bytes are a tenth of the weights'). Multiplying the whole
    roofline charged the weights' bytes again for every unit."""
    def cluster(imbalance):
        return parse_cluster_yaml(f"""
name: slow-memory
device: {{name: t, peak_tflops: {{bf16: 312, fp32: 19.5}}, memory_GiB: 80, hbm_bw_GBps: 1, memory_eff: 1.0}}
gpus_per_node: 8
nodes: 1
intra: {{bw_GBps: 230, latency_us: 3}}
inter: {{bw_GBps: 24, latency_us: 8}}
moe_imbalance: {imbalance}
""")

    cfg = ParallelConfig(dp=8, zero=3, precision="bf16")
    t1, t2, t3 = (Evaluator(moe, cluster(i), cfg, 8).cost(_block(moe), AC.NONE).fwd_s for i in (1, 2, 3))
    weights_once = _expert_numel(moe) / LAYERS * 2 / 1e9  # bf16 expert weights of one block, read at 1 GB/s
    assert t2 - t1 == pytest.approx(t3 - t2, rel=1e-9)
    assert 0 < t2 - t1 < 0.2 * weights_once


def test_ep_needs_experts_it_divides(moe):
    dense = profile_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32")
    with pytest.raises(ConfigError, match="no mixture-of-experts"):
        estimate(dense, _cluster(), ParallelConfig(dp=8, ep=2), 16)
    with pytest.raises(ValueError, match="must divide dp"):
        ParallelConfig(dp=4, ep=8)
    cl = parse_cluster_yaml("""
name: t6
device: {name: t, peak_tflops: {bf16: 312}, memory_GiB: 80, hbm_bw_GBps: 2039, matmul_eff: {e_max: 0.7,
  f_half_gflop: 2}, memory_eff: 0.8}
gpus_per_node: 6
nodes: 1
intra: {bw_GBps: 230, latency_us: 3}
inter: {bw_GBps: 24, latency_us: 8}
""")
    with pytest.raises(ConfigError, match="does not divide the 8 experts"):
        estimate(moe, cl, ParallelConfig(dp=6, ep=6), 12)


def test_a_bad_moe_imbalance_is_refused():
    with pytest.raises(ValueError, match="moe_imbalance"):
        _cluster(imbalance=0.5)


def test_published_mixtral_rows_held_at_the_level_reached():
    """Megatron-LM's Mixtral 8x7B on 64 H100 (tp 1, pp 4, vpp 8, ep 8, dp 16): 438 / 468 model TFLOP/s per GPU
    published (MCore v0.8 / v0.9); predicted 342 under the megatron stack as that stack computes
    (`costmodel.stacks.Stack.runtime_options`: −21.8 %, −26.8 %; MAPE 24.3 %: `python -m costmodel.moe_runs`). When
    expert parallelism was first costed it was 348 (MAPE 23.0 %). Reading each weight once per micro-batch, not once
    per sequence, raised it to 360 with the H100 constants of then; the refit that followed (these rows are not in
    it) lowered the H100 kind's memory efficiency from 0.583 to 0.461, at the A100's achieved bandwidth, which took
    it to 341. Priced with autopar's runtime's gradient accumulation over its micro-batches (Megatron-LM
    fuses it into the weight-gradient GEMMs) it read 333 (MAPE 26.3 %): the stack's options had not reached here."""
    from costmodel.moe_runs import predict, usable_rows

    rows = usable_rows()
    assert {r.id for r in rows} == {"mlm-moe-readme-mixtral-8x7b-mcore-v0.8", "mlm-moe-readme-mixtral-8x7b-mcore-v0.9"}
    errors = [abs(tf / row.tflops_per_gpu - 1) for row, tf in predict(rows)]
    assert sum(errors) / len(errors) <= 0.25
