"""The coefficients of one outer candidate's ILP, read from the cost model (planner/search/ilp.py builds the model).

`build_data` evaluates every per-layer cost the ILP needs once, through `Evaluator` (shared layer costs between
candidates via its ``cache``), and tabulates the rank-level quantities that depend non-linearly on a rank's block
count with the cost model's own functions.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace

from costmodel.cluster import Cluster
from costmodel.compression import allowed_options
from costmodel.config import AC, ParallelConfig, parse_grad_compress
from costmodel.estimate import Evaluator, block_classes, pipeline_factor, split_layers, stage_blocks_problem
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
    cfg: ParallelConfig  #: the candidate, with the gradient compression it gets under ZeRO 2/3 (build_data)
    S: int
    pp: int
    m: int
    phi: float
    slow: float
    pre: list[int]
    post: list[int]
    blocks: list[int]  #: the run's layers (`split_layers`), in order
    reps: list[int]  #: per kind of block (`block_classes`), the layer whose costs stand for every block of it
    kind_of: tuple[int, ...]  #: per position in the run, its block's kind (an index into ``reps``)
    counts: list[int]  #: blocks of each kind in the run
    acs: tuple[tuple[AC, ...], ...]  #: per kind, the AC modes offered to its blocks (most activations first)
    modes: tuple[AC, ...]  #: the AC modes offered
    fixed_acs: dict  #: pre/post layer → AC modes offered to it
    grad_opts: tuple[str, ...]
    pp_opts: tuple[str, ...]
    p2p: dict  #: pp option → per-micro-batch boundary time
    buffers: dict  #: (pp option, rank) → torch's pipelining buffers (`Evaluator.pipeline_buffers`)
    n_range: dict  #: rank → (lowest, highest) block count
    fixed_rank: dict  #: fixed layer → rank
    units: list  #: groups of stages counted together: one per rank, or one per stage (ZeRO-3, or vpp > 1)
    time_unit: float
    mem_unit: float
    evs: dict  #: grad option → evaluator with that compression

    @property
    def kinds(self) -> range:
        return range(len(self.reps))

    @property
    def cut(self) -> bool:
        """Whether stages are placed by their cut positions: blocks of several kinds, where which blocks a stage
        holds depends on where it starts and ends (one kind: only how many)."""
        return len(self.reps) > 1

    @property
    def nblocks(self) -> int:
        return len(self.blocks)

    def vectors(self, r: int) -> list[tuple[int, ...]]:
        """The per-kind block counts rank r can hold: of the blocks between two cuts where the rank is one stage,
        every count vector with its total in `n_range` otherwise (a superset: the counts are tied to the cuts)."""
        return _vectors(self.kind_of, self.S, self.pp, r, self.n_range[r])


@functools.lru_cache(maxsize=1024)
def _vectors(kind_of: tuple, S: int, pp: int, r: int, n_range: tuple) -> list[tuple[int, ...]]:
    if not kind_of:
        return [()]
    K, B = max(kind_of) + 1, len(kind_of)
    lo, hi = n_range
    if K == 1:
        return [(n,) for n in range(lo, hi + 1)]
    if S == pp:  # one stage: the blocks between its first and its last cut
        prefix = [[0] * K]
        for x in kind_of:
            prefix.append(list(prefix[-1]))
            prefix[-1][x] += 1
        # (the first stage starts at the run's first block, the last ends at its last)
        starts = [0] if r == 0 else range(r, B - (S - r) + 1)
        out = {tuple(e - s for e, s in zip(prefix[end], prefix[start])) for start in starts
               for end in ([B] if r == S - 1 else range(start + 1, B - (S - 1 - r) + 1))}
        return sorted(out)
    counts = [kind_of.count(k) for k in range(K)]
    if math.prod(c + 1 for c in counts) > MAX_VECTORS:
        raise NotSupportedError(
            f"{K} kinds of block ({', '.join(map(str, counts))} blocks) make more than {MAX_VECTORS} block counts "
            "per pipeline rank for the ILP's tables with interleaved stages; use vpp=1")
    return [v for v in itertools.product(*(range(c + 1) for c in counts)) if lo <= sum(v) <= hi]


#: the longest pattern of block kinds `pattern_cuts` looks for (Gemma 3's five local and one global attention blocks
#: is 6; Jamba's attention every 8 blocks with MoE every 2 is 8)
MAX_PERIOD = 8


def pattern_cuts(kind_of: tuple[int, ...], n_stages: int) -> set[int] | None:
    """Where stages may be cut so that every stage but the first starts a repeat of the run's pattern of block kinds:
    after the shortest prefix o (then the shortest period p ≤ `MAX_PERIOD`) beyond which the kinds repeat at least
    twice, at o and every p blocks after it (DeepSeek's leading dense blocks: o = 3, p = 1; dense and MoE in turn:
    o = 0, p = 2; Gemma 3's five local blocks and a global one, with two local ones left over: o = 0, p = 6); None
    when no pattern leaves room for ``n_stages`` stages. The ILP's warm start (`Model.warm_start`)."""
    B = len(kind_of)
    for o in range(B):
        for p in range(1, MAX_PERIOD + 1):
            if (B - o) // p < 2 or any(kind_of[j] != kind_of[j - p] for j in range(o + p, B)):
                continue
            allowed = set(range(o if o else p, B, p))
            if len(allowed) >= n_stages - 1:
                return allowed
    return None


#: the most per-kind count vectors a rank's tables are built over (`Data.vectors`, interleaved stages)
MAX_VECTORS = 20000


def _evaluator(lg, cluster, cfg, global_batch, cache):
    """An Evaluator sharing layer costs with the other candidates' through ``cache`` (`Evaluator`'s hook)."""
    return Evaluator(lg, cluster, cfg, global_batch, cache=cache)


def zero23_grad_option(grad_opts) -> str:
    """The gradient compression a ZeRO 2/3 candidate gets (it sets FSDP's reduce dtype: its time and its buffers):
    the one pinned (a single option), else none, the only one `build_data` offers there. The bounds read the same
    (`planner.search.bounds.Bounds`)."""
    return grad_opts[0] if len(grad_opts) == 1 else "none"


def build_data(lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
               acs=AC_ORDER, grad_opts=None, pp_opts=None, cost_cache=None, policy: str = "none") -> Data:
    if grad_opts is None:  # among those the runtime can apply to this sharding (costmodel.runnable) and the
        # compression policy allows (costmodel.compression.COMPRESSION_POLICIES); none under ZeRO 2/3
        runnable = grad_compress_options(cfg.data_ranks, cfg.tp, cfg.zero, cfg.schedule.value, cfg.pp, cfg.ep)
        grad_opts = ("none",) if cfg.zero >= 2 else tuple(k for k in allowed_options(policy, GRAD_OPTIONS)
                                                          if parse_grad_compress(k)[0] in runnable)
    base = replace(cfg, grad_compress=zero23_grad_option(grad_opts) if cfg.zero >= 2 else "none", pp_compress="none")
    ev = _evaluator(lg, cluster, base, global_batch, cost_cache)
    S = cfg.pp * cfg.vpp
    pre, blocks, post = split_layers(lg)
    classes = block_classes(lg)
    reps = [c[0] for c in classes]
    kind = {i: k for k, c in enumerate(classes) for i in c}
    kind_of = tuple(kind[i] for i in blocks)
    if why := stage_blocks_problem(lg, S):
        raise NotSupportedError(f"{lg.model.name}: {why}")
    # offer an AC mode only when it changes the layer's costs (selective on a layer without an attention core is
    # none): equal-cost choices would otherwise be broken arbitrarily by the solver
    block_acs = tuple(_most_activations_first(ev, i, _distinct_acs(ev, [i], acs)) for i in reps)
    fixed_acs = {i: _distinct_acs(ev, [i], acs) for i in pre + post}
    if pp_opts is None:
        pp_opts = ("none",) if S == 1 else allowed_options(policy, PP_OPTIONS)
    evs = {k: (ev if k == base.grad_compress else _evaluator(lg, cluster, replace(base, grad_compress=k),
                                                             global_batch, cost_cache)) for k in grad_opts}
    p2p, buffers = {}, {}
    for k in pp_opts:
        e = ev if k == "none" else _evaluator(lg, cluster, replace(base, pp_compress=k), global_batch, cost_cache)
        # a stage after the first may start at any block but the run's first: one transfer and one set of buffers
        # (which read the boundary's bytes only) for all of them (a block's input is the residual stream, whatever
        # its kind), or the ILP cannot price it
        vals = {e.p2p_time(i) for i in blocks[1:]} if S > 1 else {0.0}
        if len(vals) > 1 or len({e.p2p_bytes(i) for i in blocks[1:]}) > 1:
            raise NotSupportedError(f"{lg.model.name}: its blocks' inputs differ in size, and the ILP prices one "
                                    "stage boundary for all; use pp=1")
        firsts = [0] + [blocks[-1]] * (S - 1) if S > 1 else [0]
        buffers |= {(k, r): e.pipeline_buffers(r, firsts) for r in range(cfg.pp)}
        p2p[k] = vals.pop()
    if len(p2p) > 1 and p2p.get("bf16") == p2p["none"]:
        del p2p["bf16"]  # bf16 boundary casts change nothing when activations are already 16-bit
    pp_opts = tuple(p2p)
    nb = len(blocks)
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
    t_ref = sum(ev.cost(i, AC.NONE).fwd_s + ev.cost(i, AC.NONE).bwd_s for i in range(len(lg.layers))) * ev.m
    return Data(ev=ev, cfg=replace(cfg, grad_compress=base.grad_compress), S=S, pp=cfg.pp, m=ev.m,
                phi=pipeline_factor(cfg.schedule, cfg.vpp),
                slow=cluster.device.overlap_slowdown, pre=pre, post=post, blocks=blocks, reps=reps, kind_of=kind_of,
                counts=[len(c) for c in classes], acs=block_acs, modes=tuple(a for a in AC_ORDER if a in acs),
                fixed_acs=fixed_acs,
                grad_opts=tuple(grad_opts), pp_opts=pp_opts, p2p=p2p, buffers=buffers, n_range=n_range,
                fixed_rank=fixed_rank, units=units,
                time_unit=max(t_ref, 1e-12) / 1000.0, mem_unit=cluster.memory_budget_bytes / 1000.0, evs=evs)


def _most_activations_first(ev: Evaluator, i: int, modes) -> tuple[AC, ...]:
    """``modes`` of layer i by its activations, most first (the order `Model.decode` relies on)."""
    order = {a: k for k, a in enumerate(AC_ORDER)}
    return tuple(sorted(modes, key=lambda a: (-ev.cost(i, a).act_bytes, order[a])))


def _distinct_acs(ev: Evaluator, layers: list[int], acs) -> tuple[AC, ...]:
    """The modes among ``acs`` that give the layers (all at one mode) costs no earlier mode gives."""
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


def _rank_layer_costs(d: Data, r: int, v: tuple[int, ...]) -> list:
    """Costs (AC none: only parameters are read) of rank r holding v[k] blocks of kind k, in evaluate's order but
    for the blocks' (every use is a sum over them, or of the rank's first layer only where it holds the pre
    layers: `Model.first_kind` gives it otherwise)."""
    ev = d.ev
    first = [ev.cost(i, AC.NONE) for i in d.pre] if r == 0 else []
    blocks = [ev.cost(i, AC.NONE) for i, n in zip(d.reps, v) for _ in range(n)]
    last = [ev.cost(i, AC.NONE) for i in d.post] if (d.S - 1) % d.pp == r else []
    return first + blocks + last
