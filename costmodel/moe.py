"""Mixture-of-experts layers under expert parallelism (``ep``): what the cost model charges beyond a dense layer.

The runtime (`planner.emit.runtime`) forms expert-parallel groups inside the data-parallel group (dp = ep · edp,
consecutive dp ranks form an EP group, as torchtitan and Megatron-Core borrow EP from the data-parallel ranks). Each
EP rank holds E/ep of every MoE layer's experts; the tokens of a micro-batch are routed (dropless: every token reaches
its top-k experts) and exchanged with all-to-alls over the EP group:

- **Parameters.** An expert weight is a stacked parameter whose first dimension is the number of experts (the zoo's
  ``GroupedExperts.w1/w2/w3`` [E, …], Hugging Face's ``experts.gate_up_proj``/``down_proj`` [E, …]): a rank holds
  1/ep of it. Under FSDP (ZeRO 2/3) the experts are sharded again over the edp = dp/ep ranks that hold the same ones,
  so the sharded states of the experts are E_params/dp per rank, as without EP (`LayerCost.expert_shard_extra`
  carries the difference between what a rank holds and what ZeRO shards).
- **Token exchange.** Per MoE layer and micro-batch, the forward dispatches and combines (two all-to-alls of the
  routed tokens, tokens·top_k rows of ``hidden``, in the activation dtype: each rank keeps 1/ep and sends (ep−1)/ep,
  `costmodel.collectives.all_to_all_time`, hierarchical across nodes) and the backward runs both again for the
  gradients; full recomputation repeats the forward's two. Before each dispatch the ranks exchange their per-expert
  token counts (an all-to-all of E integers). None of it overlaps compute: torch-native EP (torchtitan without
  DeepEP) issues them in the layer's stream between the router and the experts.
- **Expert compute.** The capture prices the balanced case (every expert gets tokens·top_k/E, `profiler.zoo.moe`);
  real routing is not balanced and the busiest expert sets the time: the expert GEMMs are multiplied by the cluster's
  ``moe_imbalance`` (`costmodel.cluster.Cluster.moe_imbalance`, 1.0 by default: the balanced case that published
  Megatron-Bridge runs measure by forcing balanced routing; a measured value of your own routing can be stated in a
  cluster file).
"""

from __future__ import annotations

from collections.abc import Iterable

from profiler.graph import ParamInfo

#: bytes of one expert's token count in the count exchange (int64)
COUNT_BYTES = 8


def is_expert_param(p: ParamInfo, experts: int) -> bool:
    """A stacked expert weight: at least 3-D with the number of experts first."""
    return experts > 1 and len(p.shape) >= 3 and p.shape[0] == experts


def moe_modules(params: Iterable[ParamInfo], experts: int) -> int:
    """The number of expert sets (MoE feed-forwards) among ``params``: distinct modules holding expert weights."""
    return len({p.fqn.rsplit(".", 1)[0] for p in params if is_expert_param(p, experts)})


def a2a_calls(ffns: int, recompute: bool) -> tuple[int, int]:
    """(token all-to-alls, count all-to-alls) one micro-batch issues in ``ffns`` MoE feed-forwards: dispatch and
    combine forward, their gradients backward, the forward's two again under full recomputation; one count exchange
    per forward run."""
    runs = 2 if recompute else 1
    return ffns * (2 * runs + 2), ffns * runs
