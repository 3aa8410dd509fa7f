"""Cluster presets, YAML loading and dumping, and where communication groups sit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel import cluster as cluster_mod
from costmodel.cluster import (
    CLUSTER_PRESETS,
    GroupSpan,
    Link,
    SizeCurve,
    dump_cluster,
    group_span,
    list_clusters,
    load_cluster,
    parse_cluster_yaml,
)
from costmodel.hardware import DEVICES, EfficiencyCurve, get_device, with_stack

GPU_PRESETS = ("dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "dgx-h200")

GOOD_YAML = """\
name: my-cluster
device: h100-sxm
gpus_per_node: 8
nodes: 4
intra: {bw_GBps: 370, latency_us: 3}
inter: {bw_GBps: 48, latency_us: 8}
"""


# --- devices -----------------------------------------------------------------------------------------------------


def test_device_catalog_figures():
    assert DEVICES["a100-80g"].peak("bf16") == 312e12
    assert DEVICES["a100-40g"].peak("tf32") == 156e12
    assert DEVICES["h100-sxm"].peak("fp8") == 1978.9e12
    assert DEVICES["h200"].peak("bf16") == DEVICES["h100-sxm"].peak("bf16") == 989.4e12
    # what torch can allocate on each card (its OOM reports' "total capacity"), not the marketed size
    assert DEVICES["a100-80g"].memory_bytes == 79.25 * 2**30
    assert DEVICES["h100-sxm"].memory_bytes == 79.11 * 2**30
    assert DEVICES["h200"].memory_bytes == 139.80 * 2**30
    assert DEVICES["h100-sxm"].hbm_bw == 3.35e12
    # efficiencies come from the calibration fit (costmodel/data/fitted.yaml) and say so
    assert DEVICES["h100-sxm"].matmul_eff.source.startswith("fitted ")
    assert DEVICES["h200"].matmul_eff == DEVICES["h100-sxm"].matmul_eff  # one set per device kind


def test_unknown_dtype_and_device_errors_name_the_choices():
    with pytest.raises(ValueError, match=r"no peak for dtype 'fp8'.*bf16"):
        DEVICES["a100-80g"].peak("fp8")
    with pytest.raises(ValueError, match="unknown device 'v100'.*h200"):
        get_device("v100")


def test_efficiency_curve_is_saturating():
    curve = EfficiencyCurve(e_max=0.8, f_half=1e9, source="test")
    assert curve(1e9) == pytest.approx(0.4)
    assert curve(1e6) < curve(1e9) < curve(1e12) < 0.8
    with pytest.raises(ValueError, match="e_max must be in"):
        EfficiencyCurve(e_max=1.5, f_half=1e9, source="test")


def test_cpu_device_is_measured():
    cpu = DEVICES["cpu"]
    assert 1e8 < cpu.peak("fp32") < 1e13  # one core: 0.1 GFLOP/s … 10 TFLOP/s
    assert "measured" in cpu.source


# --- presets and load_cluster ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_load(name):
    c = load_cluster(name)
    preset = CLUSTER_PRESETS[name]  # with the default stack's constants (`costmodel.stacks`)
    assert c == replace(preset, device=with_stack(preset.device, "torch-native"), stack="torch-native")
    assert (c.gpus_per_node, c.nodes, c.world_size) == (8, 1, 8)
    assert c.intra.bandwidth > c.inter.bandwidth > 0


def test_preset_figures_are_the_published_ones():
    a100, h100 = load_cluster("dgx-a100-80g"), load_cluster("dgx-h100")
    assert a100.intra.bandwidth == 230e9 and a100.inter.bandwidth == 24e9
    assert h100.intra.bandwidth == 370e9 and h100.inter.bandwidth == 48e9
    assert "nccl#812" in a100.inter.source


def test_nodes_option():
    c = load_cluster("dgx-h100:nodes=4")
    assert (c.nodes, c.world_size) == (4, 32)
    assert c.device == with_stack(DEVICES["h100-sxm"], "torch-native")


def test_cpu_local_preset_and_options():
    c = load_cluster("cpu-local")
    assert (c.name, c.gpus_per_node, c.nodes) == ("cpu-local", 2, 1)
    assert c.device.name == "cpu"
    assert load_cluster("cpu-local:gpus_per_node=4").world_size == 4


def test_cpu_local_falls_back_to_findings_without_fit_file(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster_mod, "CPU_LOCAL_FILE", tmp_path / "absent.yaml")
    link = cluster_mod._cpu_local_link()
    assert "FINDINGS" in link.source
    assert link.bandwidth_for("all_gather") < link.bandwidth_for("all_reduce")


@pytest.mark.parametrize("spec, match", [
    ("dgx-h100:nodes=0", "nodes must be an integer >= 1, got '0'"),
    ("dgx-h100:nodes=two", "nodes must be an integer >= 1, got 'two'"),
    ("dgx-h100:racks=2", "unknown option 'racks=2'"),
    ("dgx-b200", "unknown cluster 'dgx-b200'"),
    ("missing.yaml", "does not exist"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        load_cluster(spec)


def test_list_clusters_describes_every_preset():
    names = [name for name, _ in list_clusters()]
    assert names == list(CLUSTER_PRESETS)
    assert all(desc for _, desc in list_clusters())


# --- YAML ------------------------------------------------------------------------------------------------------


def test_yaml_file_loads_with_units_converted(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(GOOD_YAML)
    c = load_cluster(str(path))
    assert (c.name, c.world_size) == ("my-cluster", 32)
    assert c.intra.bandwidth == 370e9 and c.intra.latency == pytest.approx(3e-6)
    assert c.inter.bandwidth == 48e9
    assert load_cluster(f"{path}:nodes=2").nodes == 2


def test_memory_fraction_from_the_cluster_file(tmp_path, capsys):
    """A cluster file's memory_fraction sets the plan's budget; `autopar plan` keeps it unless --memory-fraction
    says otherwise; dumped and read back unchanged."""
    assert load_cluster("dgx-h100").memory_fraction == 0.90
    path = tmp_path / "cluster.yaml"
    path.write_text(GOOD_YAML + "memory_fraction: 0.8\n")
    c = load_cluster(str(path))
    assert c.memory_fraction == 0.8 and c.memory_budget_bytes == 0.8 * c.device.memory_bytes
    assert parse_cluster_yaml(dump_cluster(c)) == c
    from planner.cli.main import main

    job = ["plan", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32", "--cluster", f"{path}:nodes=1",
           "--global-batch", "8", "--check", "off"]
    assert main(job) == 0
    assert "(80% of" in capsys.readouterr().out
    assert main([*job, "--memory-fraction", "0.7"]) == 0
    assert "(70% of" in capsys.readouterr().out


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_presets_round_trip(name):
    c = load_cluster(f"{name}:nodes=3")
    assert parse_cluster_yaml(dump_cluster(c)) == c


def test_custom_device_and_per_kind_link_round_trip():
    text = """\
name: custom
device: {name: mygpu, peak_tflops: {bf16: 500, fp32: 50}, memory_GiB: 64, hbm_bw_GBps: 2000,
         matmul_eff: {e_max: 0.7, f_half_gflop: 1.5}, memory_eff: 0.75}
gpus_per_node: 4
nodes: 2
intra: {bw_GBps: 100, latency_us: 2,
        by_kind: {all_gather: {bw_GBps: 50}, send_recv: {latency_us: 1,
                   size_curve: {sizes_KiB: [1024, 4096], factor: [2, 1]}}}}
inter: {bw_GBps: 12.5, latency_us: 10}
"""
    c = parse_cluster_yaml(text, "custom.yaml")
    assert c.device.peak("bf16") == 500e12 and c.device.memory_bytes == 64 * 2**30
    assert c.device.matmul_eff.f_half == 1.5e9
    assert c.device.attention_seq_half == 0.0  # (absent: attention's efficiency does not depend on the length)
    longer = parse_cluster_yaml(text.replace("memory_eff: 0.75}", "memory_eff: 0.75, attention_seq_half: 900}"))
    assert longer.device.attention_seq_half == 900.0 and parse_cluster_yaml(dump_cluster(longer)) == longer
    for bad in ("-1", ".inf", "true"):
        with pytest.raises(ValueError, match=r"attention_seq_half must be a finite number of tokens ≥ 0"):
            parse_cluster_yaml(text.replace("memory_eff: 0.75}", f"memory_eff: 0.75, attention_seq_half: {bad}}}"))
    assert c.intra.bandwidth_for("all_gather") == 50e9 and c.intra.bandwidth_for("all_reduce") == 100e9
    assert c.intra.curve_for("send_recv") == SizeCurve(sizes=(2**20, 4 * 2**20), factors=(2.0, 1.0))
    assert parse_cluster_yaml(dump_cluster(c)) == c


def test_call_latency_and_op_overhead_round_trip():
    """A link's per-call latency (its own and per kind), a device's per-op host overhead, DTensor's (per op and per
    MB of its data) and FSDP2's (per group and tensor, and its copies' rate) are read in µs (GB/s) and written
    back."""
    text = """\
name: cpu-like
device: {name: mycpu, peak_tflops: {fp32: 0.07}, memory_GiB: 24, hbm_bw_GBps: 20, op_overhead_us: [2.5, 4],
         dtensor_overhead_us: {tp_linear: [200, 330], sp_norm: [190, 350]}, dtensor_us_per_MB: {tp_linear: [150, 0.2]},
         fsdp_overhead_us: {gather: [180, 12.5], reduce: [270, 20]}, fsdp_copy_GBps: 9.7}
gpus_per_node: 2
nodes: 1
intra: {bw_GBps: 1.8, latency_us: 50, call_latency_us: 2500, by_kind: {all_gather: {call_latency_us: 1300}}}
inter: {bw_GBps: 1.8, latency_us: 50}
"""
    c = parse_cluster_yaml(text, "cpu-like.yaml")
    assert c.device.op_overhead_s == pytest.approx((2.5e-6, 4e-6))
    assert c.device.dtensor_overhead("tp_linear") == pytest.approx((200e-6, 330e-6))
    assert c.device.dtensor_overhead("sp_linear") == (0.0, 0.0)  # (not given: not charged)
    assert c.device.dtensor_overhead("tp_linear", 2e6) == pytest.approx((200e-6 + 300e-6, 330e-6 + 0.4e-6))
    assert c.device.dtensor_overhead("sp_norm", 2e6) == pytest.approx((190e-6, 350e-6))  # (no per-byte figure)
    assert c.device.dtensor_byte_s["tp_linear"] == (150e-12, 0.2e-12)
    assert parse_cluster_yaml(dump_cluster(c)) == c
    assert c.device.fsdp_overhead("gather") == pytest.approx((180e-6, 12.5e-6))
    assert c.device.fsdp_overhead("reduce") == pytest.approx((270e-6, 20e-6))
    assert c.device.fsdp_copy_rate == pytest.approx(9.7e9)
    tiny = parse_cluster_yaml(text.replace("fsdp_copy_GBps: 9.7", "fsdp_copy_GBps: 0.00001"))  # (repr: 1e-05)
    assert tiny.device.fsdp_copy_bw == 1e4 and parse_cluster_yaml(dump_cluster(tiny)) == tiny
    assert load_cluster("dgx-h100").device.fsdp_copy_rate == pytest.approx(3.35e12 * load_cluster(
        "dgx-h100").device.memory_eff)  # (not measured: the memory bandwidth)
    assert c.intra.call_latency_for("all_reduce") == pytest.approx(2.5e-3)
    assert c.intra.call_latency_for("all_gather") == pytest.approx(1.3e-3)
    assert c.inter.call_latency_for("all_gather") == 0.0
    assert parse_cluster_yaml(dump_cluster(c)) == c


def test_cpu_local_round_trips():
    c = load_cluster("cpu-local")
    again = parse_cluster_yaml(dump_cluster(c))
    assert again.device is c.device
    assert again.intra.bandwidth == pytest.approx(c.intra.bandwidth, rel=1e-9)


def _edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize("old, new, message", [
    ("bw_GBps: 48", "bw_GBps: fast", "cluster.yaml: inter.bw_GBps must be a positive number, got 'fast'"),
    ("bw_GBps: 48", "bw_GBps: -1", "cluster.yaml: inter.bw_GBps must be a positive number, got -1"),
    ("bw_GBps: 370", "bandwith: 370", "cluster.yaml: unknown key 'intra.bandwith' (did you mean 'bw_GBps'?)"),
    ("latency_us: 3", "latency_us: -3", "cluster.yaml: intra.latency_us must be a number >= 0, got -3"),
    ("intra: {bw_GBps: 370, latency_us: 3}", "intra: {latency_us: 3}", "cluster.yaml: missing key 'intra.bw_GBps'"),
    ("intra: {bw_GBps: 370, latency_us: 3}", "intra: fast", "cluster.yaml: intra must be a mapping, got 'fast'"),
    ("nodes: 4", "nodes: 0", "cluster.yaml: nodes must be an integer >= 1, got 0"),
    ("nodes: 4", "nodes: 2.5", "cluster.yaml: nodes must be an integer >= 1, got 2.5"),
    ("gpus_per_node: 8", "gpus_per_nod: 8", "cluster.yaml: unknown key 'gpus_per_nod' (did you mean 'gpus_per_node'?)"),
    ("gpus_per_node: 8\n", "", "cluster.yaml: missing key 'gpus_per_node'"),
    ("device: h100-sxm", "device: v100", "cluster.yaml: device 'v100' is not in the catalog"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, speed: 3}",
     "cluster.yaml: unknown key 'device.speed'"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {int4: 1}, memory_GiB: 8, hbm_bw_GBps: 1}",
     "cluster.yaml: unknown key 'device.peak_tflops.int4'"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, hbm_bw_GBps: 1}",
     "cluster.yaml: device needs exactly one of memory_GiB"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "matmul_eff: {e_max: 2, f_half_gflop: 1}}", "cluster.yaml: device.matmul_eff.e_max must be in (0, 1], got 2.0"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, by_kind: {allreduce: {bw_GBps: 1}}}",
     "cluster.yaml: unknown key 'inter.by_kind.allreduce' (did you mean 'all_reduce'?)"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, by_kind: {all_reduce: {bw_GBps: 0}}}",
     "cluster.yaml: inter.by_kind.all_reduce.bw_GBps must be a positive number, got 0"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, by_kind: {all_reduce: "
     "{size_curve: {sizes_KiB: [4, 1], factor: [1, 1]}}}}",
     "cluster.yaml: inter.by_kind.all_reduce.size_curve: SizeCurve sizes must be > 0 bytes and strictly increasing"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, by_kind: {all_reduce: "
     "{size_curve: {sizes_KiB: [4], factors: [1]}}}}",
     "cluster.yaml: unknown key 'inter.by_kind.all_reduce.size_curve.factors' (did you mean 'factor'?)"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, by_kind: {all_reduce: "
     "{size_curve: {sizes_KiB: 4, factor: [1]}}}}",
     "cluster.yaml: inter.by_kind.all_reduce.size_curve.sizes_KiB must be a non-empty list of positive numbers"),
    ("inter: {bw_GBps: 48, latency_us: 8}", "inter: {bw_GBps: 48, latency_us: 8, call_latency_us: -1}",
     "cluster.yaml: inter.call_latency_us must be a number >= 0, got -1"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "op_overhead_us: 3}", "cluster.yaml: device.op_overhead_us must be [forward, backward] microseconds ≥ 0, got 3"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "dtensor_overhead_us: {tp_lin: [1, 2]}}", "cluster.yaml: device.dtensor_overhead_us must map tp_linear, "
     "sp_linear, sp_norm to [forward, backward] microseconds ≥ 0, got {'tp_lin': [1, 2]}"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "dtensor_us_per_MB: {sp_norm: [1, -2]}}", "cluster.yaml: device.dtensor_us_per_MB must map tp_linear, "
     "sp_linear, sp_norm to [forward, backward] microseconds per MB ≥ 0, got {'sp_norm': [1, -2]}"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "fsdp_overhead_us: {gather: [1]}}", "cluster.yaml: device.fsdp_overhead_us must map gather, reduce to "
     "[per group, per tensor] microseconds ≥ 0, got {'gather': [1]}"),
    ("device: h100-sxm", "device: {name: x, peak_tflops: {bf16: 1}, memory_GiB: 8, hbm_bw_GBps: 1, "
     "fsdp_copy_GBps: -2}", "cluster.yaml: device.fsdp_copy_GBps must be a number ≥ 0 (0: the memory bandwidth)"),
    ("nodes: 4", "nodes: 4\nmemory_fraction: 1.5", "cluster.yaml: memory_fraction must be in (0, 1]"),
    ("nodes: 4", "nodes: 4\nmemory_fraction: high", "cluster.yaml: memory_fraction must be a positive number"),
])
def test_bad_yaml_fields_are_named(old, new, message):
    with pytest.raises(ValueError) as info:
        parse_cluster_yaml(_edit(GOOD_YAML, old, new), origin="cluster.yaml")
    assert message in str(info.value)


def test_yaml_that_is_not_a_mapping():
    with pytest.raises(ValueError, match="cluster.yaml: a cluster file must be a mapping"):
        parse_cluster_yaml("- 1\n- 2\n", origin="cluster.yaml")


def test_link_and_cluster_validation_show_numbers():
    with pytest.raises(ValueError, match="bandwidth must be > 0 bytes/s, got -1"):
        Link(name="x", bandwidth=-1, latency=0)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        Link(name="x", bandwidth=1, latency=0, bandwidth_by_kind={"gather": 1.0})
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        replace(load_cluster("dgx-h100"), nodes=0)


def test_specs_are_hashable():
    assert len({load_cluster("dgx-h100"), load_cluster("dgx-h100"), load_cluster("dgx-h200")}) == 2


# --- group placement -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, cp, dp, pp", [(8, 1, 2, 1), (4, 1, 4, 1), (2, 1, 4, 2), (1, 1, 16, 1), (4, 2, 2, 1)])
def test_group_spans_on_two_dgx_nodes(tp, cp, dp, pp):
    c = load_cluster("dgx-h100:nodes=2")
    assert tp * cp * dp * pp == c.world_size
    spans = {
        "tp": group_span(c, tp, 1),
        "cp": group_span(c, cp, tp),
        "dp": group_span(c, dp, tp * cp),
        "pp": group_span(c, pp, dp * cp * tp),
    }
    expected = {
        (8, 1, 2, 1): {"tp": (8, 1, 8), "cp": (1, 1, 1), "dp": (2, 2, 1), "pp": (1, 1, 1)},
        (4, 1, 4, 1): {"tp": (4, 1, 4), "cp": (1, 1, 1), "dp": (4, 2, 2), "pp": (1, 1, 1)},
        (2, 1, 4, 2): {"tp": (2, 1, 2), "cp": (1, 1, 1), "dp": (4, 1, 4), "pp": (2, 2, 1)},
        (1, 1, 16, 1): {"tp": (1, 1, 1), "cp": (1, 1, 1), "dp": (16, 2, 8), "pp": (1, 1, 1)},
        (4, 2, 2, 1): {"tp": (4, 1, 4), "cp": (2, 1, 2), "dp": (2, 2, 1), "pp": (1, 1, 1)},
    }[(tp, cp, dp, pp)]
    got = {name: (s.size, s.nodes, s.per_node) for name, s in spans.items()}
    assert got == expected


def test_group_too_large_for_the_cluster():
    with pytest.raises(ValueError, match="needs rank 16, but cluster 'dgx-h100' has 16 ranks"):
        group_span(load_cluster("dgx-h100:nodes=2"), 2, 16)


def test_group_span_validation():
    with pytest.raises(ValueError, match="impossible"):
        GroupSpan(size=4, nodes=1, per_node=2)


@pytest.mark.parametrize("env, gpu, expected", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, ("NVIDIA H100 80GB HBM3", 80 * 2**30),
     "dgx-h100:nodes=2:gpus_per_node=8"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, ("NVIDIA A100-SXM4-40GB", 40 * 2**30),
     "dgx-a100-40g:nodes=1:gpus_per_node=8"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, ("NVIDIA H200", 141 * 2**30), "dgx-h200:nodes=1:gpus_per_node=4"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, None, "cpu-local:nodes=1:gpus_per_node=2"),
])
def test_detect_cluster_from_device_and_torchrun_environment(env, gpu, expected):
    """auto_parallelize without a cluster plans for the hardware it runs on (issue 13), not cpu-local."""
    from costmodel.cluster import detect_cluster

    if gpu is None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
    assert detect_cluster(env, gpu) == expected
    assert load_cluster(expected).world_size == int(env["WORLD_SIZE"])


def test_detect_cluster_refuses_an_unknown_gpu():
    from costmodel.cluster import detect_cluster

    with pytest.raises(ValueError, match="no cluster preset for GPU 'Tesla T4'"):
        detect_cluster({"WORLD_SIZE": "1"}, ("Tesla T4", 16 * 2**30))


def test_ranks_sharing_a_hosts_memory_plan_on_their_share(tmp_path):
    """A CPU device's memory is the host's, which the ranks of its node share (gloo processes): each rank plans on
    its share, a GPU on its own memory; the property round-trips through a cluster file, where a ``cpu`` device
    without it is the host's; the host's memory is a container's cgroup limit where that is lower than the RAM."""
    from costmodel.hardware import host_memory_bytes

    c = load_cluster("cpu-local")
    assert c.device.host_memory and c.memory_per_rank_bytes == c.device.memory_bytes / 2
    assert c.memory_budget_bytes == pytest.approx(c.memory_fraction * c.device.memory_bytes / 2)
    assert load_cluster("cpu-local:gpus_per_node=4").memory_per_rank_bytes == c.device.memory_bytes / 4
    h = load_cluster("dgx-h100")
    assert not h.device.host_memory and h.memory_per_rank_bytes == h.device.memory_bytes
    text = """\
name: host
device: {name: cpu, peak_tflops: {fp32: 0.1}, memory_GiB: 16, hbm_bw_GBps: 10}
gpus_per_node: 4
nodes: 1
intra: {bw_GBps: 1.8, latency_us: 50}
inter: {bw_GBps: 1.8, latency_us: 50}
"""
    shared = parse_cluster_yaml(text, "host.yaml")
    assert shared.device.host_memory and shared.memory_per_rank_bytes == 4 * 2**30
    assert parse_cluster_yaml(dump_cluster(shared)) == shared
    own = parse_cluster_yaml(text.replace("hbm_bw_GBps: 10", "hbm_bw_GBps: 10, host_memory: false"))
    assert not own.device.host_memory and own.memory_per_rank_bytes == 16 * 2**30
    assert parse_cluster_yaml(dump_cluster(own)) == own
    with pytest.raises(ValueError, match="host_memory must be true or false"):
        parse_cluster_yaml(text.replace("hbm_bw_GBps: 10", "hbm_bw_GBps: 10, host_memory: 2"))
    ram = host_memory_bytes(())
    limit = tmp_path / "memory.max"
    for content, expect in (("max\n", ram), (f"{2**30}\n", 2**30), (f"{2**63 - 4096}\n", ram), ("", ram)):
        limit.write_text(content)
        assert host_memory_bytes((str(tmp_path / "absent"), str(limit))) == expect
