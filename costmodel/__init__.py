"""autopar's cost model: hardware and clusters, compute, collectives, memory, overlap and compression.

`estimate(layer_graph, cluster, config, global_batch)` predicts one training step; see costmodel/estimate.py.
Imports `profiler`'s types only, never `planner`; inside, the evaluator (`estimate`) composes the formulas of
`layercost`, `memory`, `overlap` and `compression`, which never import it back.
"""

from costmodel.cluster import Cluster, GroupSpan, Link, dump_cluster, group_span, list_clusters, load_cluster
from costmodel.collectives import Collective, collective_time
from costmodel.config import AC, ParallelConfig, Schedule, parse_kv
from costmodel.estimate import ConfigError, Estimate, Evaluator, estimate
from costmodel.hardware import DEVICES, DeviceSpec, EfficiencyCurve, get_device

__all__ = [
    "AC", "Cluster", "Collective", "ConfigError", "DEVICES", "DeviceSpec", "EfficiencyCurve", "Estimate",
    "Evaluator", "GroupSpan", "Link", "ParallelConfig", "Schedule", "collective_time", "dump_cluster",
    "estimate", "get_device", "group_span", "list_clusters", "load_cluster", "parse_kv",
]
