"""The coefficients of one outer candidate's ILP, read from the cost model (planner/search/ilp.py builds the model).

`build_data` evaluates every per-layer cost the ILP needs once, through `Evaluator` (shared layer costs between
candidates via its ``cache``), and tabulates the rank-level quantities that depend non-linearly on a rank's block
count with the cost model's own functions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from costmodel.cluster import Cluster
from costmodel.compression import allowed_options
from costmodel.config import AC, ParallelConfig, parse_grad_compress
from costmodel.estimate import Evaluator, block_groups, pipeline_factor, split_layers, stage_blocks_problem
from costmodel.runnable import grad_compress_options
from profiler.graph import LayerGraph

AC_ORDER = (AC.NONE, AC.SELECTIVE, AC.FULL)  #: decode order inside a stage and tie-break order
GRAD_OPTIONS = ("none", "bf16", "powersgd-4", "powersgd-8")  #: data-parallel gradient compression searched
PP_OPTIONS = ("none", "bf16")  #: pipeline-boundary activation compression searched


class NotSupportedError(ValueError):
    """The model's shape is outside what the ILP handles yet; the message says what to do."""


@dataclass
class Data:
    """Coefficients of one candidate, read from the cost model (see the module docstring)."""

    ev: Evaluator
    cfg: ParallelConfig
    S: int
    pp: int
    m: int
    phi: float
    slow: float
    pre: list[int]
    post: list[int]
    blocks: list[int]  #: the run's layers (`split_layers`), counted in groups
    groups: list[list[int]]  #: the run's groups (`block_groups`): what the ILP counts per stage
    acs: tuple[tuple[AC, ...], ...]  #: AC combinations offered to a group: one mode per layer of `group`
    modes: tuple[AC, ...]  #: the AC modes offered
    fixed_acs: dict  #: pre/post layer → AC modes offered to it
    grad_opts: tuple[str, ...]
    pp_opts: tuple[str, ...]
    p2p: dict  #: pp option → per-micro-batch boundary time
    buffers: dict  #: (pp option, rank) → torch's pipelining buffers (`Evaluator.pipeline_buffers`)
    n_range: dict  #: rank → (lowest, highest) block count
    fixed_rank: dict  #: fixed layer → rank
    units: list  #: groups of stages counted together: one per rank, or one per stage under ZeRO-3
    time_unit: float
    mem_unit: float
    evs: dict  #: grad option → evaluator with that compression

    @property
    def group(self) -> list[int]:
        """The run's first group: its layers stand for every group's (all groups are alike)."""
        return self.groups[0] if self.groups else []

    @property
    def ngroups(self) -> int:
        return len(self.groups)


def _evaluator(lg, cluster, cfg, global_batch, cache):
    """An Evaluator sharing layer costs with the other candidates' through ``cache`` (`Evaluator`'s hook)."""
    return Evaluator(lg, cluster, cfg, global_batch, cache=cache)


def build_data(lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
               acs=AC_ORDER, grad_opts=None, pp_opts=None, cost_cache=None, policy: str = "none") -> Data:
    base = replace(cfg, grad_compress="none", pp_compress="none")
    ev = _evaluator(lg, cluster, base, global_batch, cost_cache)
    S = cfg.pp * cfg.vpp
    kinds = [layer.kind for layer in lg.layers]
    pre, blocks, post = split_layers(lg)
    groups = block_groups(lg)
    group, nb = (groups[0] if groups else []), len(groups)  # (as `Data.group`, `Data.ngroups`)
    if why := stage_blocks_problem(lg, S):
        raise NotSupportedError(f"{lg.model.name}: {why}")
    # offer an AC mode only when it changes the layer's costs (selective on a layer without an attention core is
    # none): equal-cost choices would otherwise be broken arbitrarily by the solver
    block_acs = group_modes(ev, group, acs) if blocks else tuple((a,) for a in acs)
    fixed_acs = {i: _distinct_acs(ev, [i], acs) for i in pre + post}
    # offer a compression option only when it can change some coefficient
    if grad_opts is None:  # among those the runtime can apply to this sharding (costmodel.runnable) and the
        # compression policy allows (costmodel.compression.COMPRESSION_POLICIES)
        runnable = grad_compress_options(cfg.data_ranks, cfg.tp, cfg.zero, cfg.schedule.value, cfg.pp, cfg.ep)
        grad_opts = ("none",) if cfg.zero >= 2 else tuple(k for k in allowed_options(policy, GRAD_OPTIONS)
                                                          if parse_grad_compress(k)[0] in runnable)
    if pp_opts is None:
        pp_opts = ("none",) if S == 1 else allowed_options(policy, PP_OPTIONS)
    evs = {k: (ev if k == "none" else _evaluator(lg, cluster, replace(base, grad_compress=k), global_batch,
                                                   cost_cache)) for k in grad_opts}
    p2p, buffers = {}, {}
    for k in pp_opts:
        e = ev if k == "none" else _evaluator(lg, cluster, replace(base, pp_compress=k), global_batch, cost_cache)
        vals = {e.p2p_time(g[0]) for g in groups[1:]} if S > 1 else {0.0}
        assert len(vals) == 1, "alike groups must have alike boundary transfers"
        p2p[k] = vals.pop()
        # every stage after the first starts at a group (each holds one), all alike: any group stands for its first
        firsts = [0] + [groups[-1][0]] * (S - 1) if S > 1 else [0]
        buffers |= {(k, r): e.pipeline_buffers(r, firsts) for r in range(cfg.pp)}
    if len(p2p) > 1 and p2p.get("bf16") == p2p["none"]:
        del p2p["bf16"]  # bf16 boundary casts change nothing when activations are already 16-bit
    pp_opts = tuple(p2p)
    n_range = {}
    for r in range(cfg.pp):
        own = sum(1 for c in range(S) if c % cfg.pp == r)
        n_range[r] = (own, nb - (S - own)) if nb else (0, 0)
    fixed_rank = {i: 0 for i in pre} | {i: (S - 1) % cfg.pp for i in post}
    # Only a rank's totals matter (T_r, memory, dp) unless ZeRO-3's per-stage overlap applies, or the rank's chunks
    # hold different numbers of micro-batches over the step (`costmodel.memory.held_states`: interleaved and
    # zero-bubble), where a chunk's activations count at its own weights in each state: then count blocks per stage;
    # otherwise per rank (vpp stages each, split evenly on decode), which removes the symmetry between its stages
    if (cfg.zero == 3 and cfg.data_ranks > 1) or (cfg.pp > 1 and cfg.vpp > 1):
        units = [(c,) for c in range(S)]
    else:
        units = [tuple(range(r, S, cfg.pp)) for r in range(cfg.pp)]
    # units: the even, no-recompute step for time, capacity/1000 for memory (solver tolerances become relative)
    t_ref = sum(ev.cost(i, AC.NONE).fwd_s + ev.cost(i, AC.NONE).bwd_s for i in range(len(kinds))) * ev.m
    return Data(ev=ev, cfg=cfg, S=S, pp=cfg.pp, m=ev.m, phi=pipeline_factor(cfg.schedule, cfg.vpp),
                slow=cluster.device.overlap_slowdown, pre=pre, post=post, blocks=blocks, groups=groups,
                acs=block_acs, modes=tuple(a for a in AC_ORDER if a in acs),
                fixed_acs=fixed_acs,
                grad_opts=tuple(grad_opts), pp_opts=pp_opts, p2p=p2p, buffers=buffers, n_range=n_range,
                fixed_rank=fixed_rank, units=units,
                time_unit=max(t_ref, 1e-12) / 1000.0, mem_unit=cluster.memory_budget_bytes / 1000.0, evs=evs)


#: most AC combinations offered to a group (`group_modes`): 3 modes for each of 3 kinds of block in it
MAX_GROUP_MODES = 27


def group_modes(ev: Evaluator, group: list[int], acs) -> tuple[tuple[AC, ...], ...]:
    """The AC combinations offered to a group of blocks (`costmodel.estimate.block_groups`), one mode per layer:
    blocks of one kind (signature) in a group share a mode, each kind among the modes that change its costs; all
    kinds one mode where that makes more than `MAX_GROUP_MODES`. Combinations that cost the same as an earlier one
    are dropped, and they are sorted by the group's activations, most first (the order `Model.decode` relies on)."""
    layers = ev.lg.layers
    kinds = list(dict.fromkeys(layers[i].signature for i in group))
    per_kind = [_distinct_acs(ev, [i for i in group if layers[i].signature == k], acs) for k in kinds]
    if len(per_kind) == 1 or math.prod(len(m) for m in per_kind) > MAX_GROUP_MODES:
        combos = [tuple(a for _ in group) for a in _distinct_acs(ev, group, acs)]
    else:
        combos = [tuple(choice[kinds.index(layers[i].signature)] for i in group)
                  for choice in itertools.product(*per_kind)]
    kept, seen = [], set()
    for c in combos:
        key = tuple(ev.cost(i, a) for i, a in zip(group, c))
        if key not in seen:
            seen.add(key)
            kept.append(c)
    order = {a: k for k, a in enumerate(AC_ORDER)}
    return tuple(sorted(kept, key=lambda c: (-sum(ev.cost(i, a).act_bytes for i, a in zip(group, c)),
                                             [order[a] for a in c])))


def _distinct_acs(ev: Evaluator, layers: list[int], acs) -> tuple[AC, ...]:
    """The modes among ``acs`` that give the layers (a group's, all at one mode) costs no earlier mode gives."""
    kept: list[AC] = []
    for a in AC_ORDER:
        if a in acs and all([ev.cost(i, a) for i in layers] != [ev.cost(i, b) for i in layers] for b in kept):
            kept.append(a)
    return tuple(kept)


def _fixed_on_stage(d: Data, u: int) -> list[int]:
    """The pre/post layers of unit u."""
    return (d.pre if 0 in d.units[u] else []) + (d.post if d.S - 1 in d.units[u] else [])


def _units_of(d: Data, r: int) -> list[int]:
    return [u for u, st in enumerate(d.units) if st[0] % d.pp == r]


def _rank_layer_costs(d: Data, r: int, n: int) -> list:
    """Costs (AC none: only parameters are read) of rank r holding n groups, in evaluate's order: every stage
    holds a group, so the rank's first layer is a group's first unless the rank holds the pre layers."""
    ev = d.ev
    first = [ev.cost(i, AC.NONE) for i in d.pre] if r == 0 else []
    blocks = [ev.cost(i, AC.NONE) for i in d.group] * n
    last = [ev.cost(i, AC.NONE) for i in d.post] if (d.S - 1) % d.pp == r else []
    return first + blocks + last


