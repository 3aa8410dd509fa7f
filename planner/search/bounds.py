"""Lower bounds on a candidate's step time and peak memory, valid for every plan the ILP (`planner.search.ilp`) can
choose for that candidate; the outer search (`planner.search.outer`) prunes with them before any ILP is built.

Notation as in `planner.search.ilp`: S = p·v stages on p pipeline ranks, m micro-batches, φ the schedule's fill/drain
factor, s the device's overlap slowdown, T_r the per-micro-batch time of rank r, and

    step = (m − φ)·max_r T_r + φ·Σ_r T_r + max_r finish_r        (m ≥ φ, φ ≥ 0).

`Bounds.time` bounds each of the three terms from below separately (a sum of valid lower bounds is one):

1. Σ_r T_r ≥ W + pre/post + (S − 1)·p2p + F_fsdp, where
   - W: the blocks' per-micro-batch work (compute + recomputation + TP collectives) under the *aggregated* memory
     relaxation: rank r needs inflight_r·act_r ≤ cap_r − per·P_r − temp_r (cap = (capacity − reserve)/1.05, per the
     model-state bytes per parameter, P_r its parameters, temp_r its least temporaries, the recomputation peak
     dropped); dividing by inflight_r and summing gives Σ_r act_r ≤ Σ_r (cap − per·P_r − temp_r)/inflight_r, whose
     largest value over the block distributions puts every block beyond the one per stage on the rank with the
     most micro-batches in flight. The blocks' AC modes then solve min Σ t s.t. Σ act ≤ that capacity minus the
     least activations of the pre/post layers: a fractional knapsack over the run's points with each kind at one
     mode, weights summing to one, whose optimum mixes at most two points (closed form over the points and the
     pairs).
     No feasible mix ⇒ no plan fits (+∞, pruned as memory);
   - pre/post: those layers at their cheapest mode; p2p the boundary transfer (halved at best by bf16 casts of
     fp32 activations);
   - F_fsdp (ZeRO-3): per stage, X_c = ag(first) + ag(last) + rs(first) plus (1 − s)·max(0, A − window) + s·A for
     the forward and backward overlaps (`costmodel.overlap.fsdp_exposed`). Summed over stages, with
     Σ_c max(0, ·) ≥ max(0, Σ_c ·), the result is non-decreasing in Σ_c X_c (its slope is (1 − s)(1 − [·>0]) ≥ 0),
     so Σ_c X_c = S·(2·min ag + min rs) gives a bound; the windows are at most Σ fwd and Σ (bwd + fwd) (full
     recomputation recomputes the forward). Plus FSDP2's serial work of every layer
     (`costmodel.overlap.fsdp_serial`: additive over blocks; the fixed layers counted as one group, the
     fewest the stages can share).
2. max_r T_r ≥ max(Σ_r T_r / p, B_int): B_int is the least bottleneck of an integral distribution of the blocks,
   each at its cheapest time, over ranks carrying their fixed parts (pre/post layers, boundary transfers) with
   ≥ v blocks each: the greedy "next block to the least loaded rank" is optimal for identical items.
3. max_r finish_r ≥ (1/p)·Σ_r finish_r ≥ f(P/p, Fw/p, Wb/p) by Jensen: finish_r is jointly convex in the rank's
   parameters P_r > 0, forward window and backward window (ring collective times are affine in the bytes; a link's
   size curve, which is not convex, is replaced by its fastest factor here, `Link.without_curves`, so the times stay
   affine and never exceed the real ones) and non-increasing in the windows, so the upper bounds Fw = Σ fwd and
   Wb = Σ (bwd + fwd) may replace them. DDP/ZeRO-1 (`costmodel.overlap.dp_exposed`): exposed = max(max(0, C − W), L) +
   s·min(C, W) ≥ max(s·C, L, C − (1 − s)·W) with C the gradient all-reduce under the compression option, L the least
   last bucket, plus its encode time (PowerSGD's matmuls at the curve's e_max), minimised over the options; ZeRO-1
   adds one broadcast of the parameters (one call: ≤ the per-tensor ones of `costmodel.overlap.zero1_sync_time`);
   ZeRO-2 the two (1 − s)·max(0, ·) + s·(·) overlaps and the average rank's FSDP2 serial work; every rank its Adam
   step and clipping, its gradients' accumulation (affine in P_r), and the loss's reductions.

Blocks of several kinds (`costmodel.estimate.block_classes`): W's relaxation is over the run's (activations, time)
points with each kind at one mode (every per-kind mix of modes lies in their convex hull); the
placement term charges a smallest block per stage; B_int and the memory bottleneck take each block at the least
time (and the least weight) of any kind; a stage's first layer is any kind's for the last bucket.

`Bounds.memory`: the most loaded rank's model states plus its least activations (every layer at its smallest
mode) and temporaries; with a pipeline, every rank's states with torch's kept boundary buffers and zero-bubble's
pending weight passes, and the blocks spread over the ranks (`Bounds._held_peak`); > capacity ⇒ no plan of the
candidate fits. `tests/test_ilp.py` checks it against the peak of every plan of random pipelines.

`tests/test_ilp.py::test_time_bound_is_a_lower_bound` checks bound ≤ ILP optimum on the random problems.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodel.cluster import Cluster
from costmodel.collectives import all_gather_time, all_reduce_time, broadcast_time, reduce_scatter_time
from costmodel.compression import powersgd_volume
from costmodel.config import AC, ParallelConfig, Schedule, parse_grad_compress
from costmodel.estimate import Evaluator, block_classes, pipeline_factor, split_layers
from costmodel.memory import (
    FRAGMENTATION,
    autocast_dtype,
    dp_reduction_temp_bytes,
    edge_inflight,
    fsdp_reduce_dtype_bytes,
    grads_held_at_peak,
    held_states,
    inflight,
    plan_state_bytes,
    runtime_reserved_bytes,
    state_bytes_at_peak,
)
from costmodel.overlap import (
    fsdp_gather_share,
    fsdp_serial,
    grad_accumulation_time,
    loss_sync_time,
    optimizer_part_time,
)
from planner.search.ilp import GRAD_OPTIONS, PP_OPTIONS
from planner.search.ilp_data import zero23_grad_option
from profiler.graph import LayerGraph

INF = float("inf")
ROUND = 1e-9  #: relative slack taken off every bound against floating-point rounding


class Bounds:
    """Lower bounds on a candidate's step time and peak memory per GPU (see the module docstring); layer costs
    are shared across candidates with the same (tp, sp, mbs, precision) through ``cost_cache``."""

    def __init__(self, lg: LayerGraph, cluster: Cluster, global_batch: int, cost_cache: dict, *,
                 grad_opts=GRAD_OPTIONS, pp_opts=PP_OPTIONS) -> None:
        self.lg, self.cluster, self.gb, self.cache = lg, cluster, global_batch, cost_cache
        self.affine_cluster = cluster.without_curves()  #: for the Jensen bound on the data-parallel sync
        self.grad_opts = tuple(grad_opts)  #: the gradient compressions the ILP may choose
        self.pp_opts = tuple(pp_opts)  #: the stage-boundary compressions it may choose
        self._groups: dict = {}
        self._evs: dict = {}
        # the ILP's split (`costmodel.estimate.split_layers`): a run of blocks cut into stages, the layers around it
        # fixed; the run's blocks by kind (`block_classes`)
        self.pre, self.blocks, self.post = split_layers(lg)
        self.classes = block_classes(lg)

    def _ev(self, cfg: ParallelConfig) -> Evaluator:
        # the capture that prices the candidate's layers (`Evaluator`): under autocast (zero 0 stands for it) or not
        # (16-bit FSDP: zero 3 stands for zero 2 too, their layers cost the same)
        zero = 0 if autocast_dtype(cfg) or cfg.precision == "fp32" else 3
        key = (cfg.dp, cfg.tp, cfg.pp, cfg.mbs, cfg.sp, cfg.precision, cfg.ep, cfg.cp, zero)
        if key not in self._evs:
            base = ParallelConfig(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, mbs=cfg.mbs, sp=cfg.sp, precision=cfg.precision,
                                  schedule=Schedule.ONE_F_ONE_B, ep=cfg.ep, cp=cfg.cp, zero=zero)
            self._evs[key] = Evaluator(self.lg, self.cluster, base, self.gb, cache=self.cache)
        return self._evs[key]

    def _group(self, cfg: ParallelConfig) -> _Group:
        # (a pipeline's layer costs differ: the head keeps its logits, a tied embedding its copy)
        key = (cfg.tp, cfg.sp, cfg.mbs, cfg.precision, cfg.ep, cfg.cp, bool(autocast_dtype(cfg)), cfg.pp > 1)
        if key not in self._groups:
            self._groups[key] = _Group.build(self, self._ev(cfg))
        return self._groups[key]

    # ------------------------------------------------------------------------------------------------ time
    def time(self, cfg: ParallelConfig, *, refine: bool = False) -> float:
        """A lower bound on the candidate's step time; +∞ when no plan of it fits in memory. ``refine`` adds the
        per-rank memory bound on the bottleneck (`_memory_bottleneck`, a few ms: for candidates that survive the
        cheap bound)."""
        cfg = self._pinned(cfg)
        g, ev = self._group(cfg), self._ev(cfg)
        p, S, nb = cfg.pp, cfg.pp * cfg.vpp, len(self.blocks)
        m = self.gb // (cfg.dp * cfg.mbs)
        phi = pipeline_factor(cfg.schedule, cfg.vpp)
        p2p = 0.0
        if S > 1:  # a stage may start at any block but the first: the least of their transfers
            p2p = min(ev.p2p_time(c[-1]) for c in self.classes if c[-1] != self.blocks[0])
            if ev.wide_boundaries:
                p2p /= 2  # bf16 casts at best halve the transfer
        fixed = g.pre_t + g.post_t + (S - 1) * p2p + self._fsdp(cfg, g, ev)
        best = INF
        # PowerSGD keeps a 4-byte error buffer per parameter: its memory differs from the other options'
        psgd = (any(parse_grad_compress(k)[0] == "powersgd" for k in self.grad_opts) and cfg.data_ranks > 1
                and cfg.zero < 2)
        for extra in ((0.0, 4.0) if psgd else (0.0,)):
            kinds = [k for k in self.grad_opts if (parse_grad_compress(k)[0] == "powersgd") == (extra > 0)]
            if not kinds and cfg.data_ranks > 1 and cfg.zero < 2:
                continue
            work = self._block_work(cfg, g, m, extra)
            if work == INF:
                continue
            total = work + fixed
            bottleneck = total / p
            if nb and p > 1:
                bottleneck = max(bottleneck, self._integral_bottleneck(cfg, g, p2p))
                if refine:
                    bottleneck = max(bottleneck, self._memory_bottleneck(cfg, g, m, p2p, extra, bottleneck))
            if bottleneck == INF:
                continue
            pipe = (m - phi) * bottleneck + phi * total
            best = min(best, pipe + self._finish(cfg, g, ev, kinds or ("none",)))
        return best * (1 - ROUND)

    def _block_work(self, cfg: ParallelConfig, g: _Group, m: int, extra: float = 0.0) -> float:
        """Σ over the blocks of their per-micro-batch time under the aggregated memory relaxation: the least over
        the convex hull of the run's (activations, time) with each kind of block at one mode (`_Group.run_opts`,
        every per-kind mix of modes is in it) under the capacity; an LP with two constraints (the weights sum to
        one, the capacity), whose optimum mixes at most two points."""
        if not self.blocks:
            return 0.0
        cap = self._capacity(cfg, g, m, extra)
        if cap == INF or g.run_opts[0][0] <= cap:
            return g.run_opts[0][1]  # the fastest fits everywhere
        best = INF
        for act, t in g.run_opts:
            if act <= cap:
                best = min(best, t)
        for i, (act_a, t_a) in enumerate(g.run_opts):
            for act_b, t_b in g.run_opts[i + 1:]:
                hi, lo = (act_a, t_a), (act_b, t_b)
                if hi[0] < lo[0]:
                    hi, lo = lo, hi
                if hi[0] > cap >= lo[0] and hi[0] > lo[0]:
                    share = (cap - lo[0]) / (hi[0] - lo[0])
                    best = min(best, share * hi[1] + (1 - share) * lo[1])
        return best

    def _budget(self, cfg: ParallelConfig, g: _Group, m: int, extra: float) -> tuple[float, float, float]:
        """(allocatable bytes per GPU, model-state bytes per parameter at the activation peak, least temporaries
        of a rank)."""
        dev = self.cluster.device
        cap = (self.cluster.memory_budget_bytes - runtime_reserved_bytes(cfg, dev)) / (1 + FRAGMENTATION)
        per = _state_at_peak(cfg, m) + extra
        temp = dp_reduction_temp_bytes(cfg, "none", 0.0)  # a lower bound: the least over compressions and ranks
        if cfg.zero == 3 and cfg.data_ranks > 1:  # at least a gathered block (every rank holds one)
            temp = g.min_block_params * cfg.param_bytes
        return cap, per, temp

    def _capacity(self, cfg: ParallelConfig, g: _Group, m: int, extra: float = 0.0) -> float:
        """The largest Σ of the blocks' activations the aggregated memory relaxation allows."""
        cap, per, temp = self._budget(cfg, g, m, extra)
        p, S = cfg.pp, cfg.pp * cfg.vpp
        last = (S - 1) % p
        total, inv_own, inv_least = 0.0, 0.0, INF
        ks = [_held(cfg, r, m) for r in range(p)]
        if min(ks) <= 0:  # a state of a rank holds no micro-batch in some chunk: no bound from its activations
            return INF
        for r, k in enumerate(ks):
            fixed = (g.pre_params if r == 0 else 0.0) + (g.post_params if r == last else 0.0)
            total += (cap - per * fixed - temp) / k
            inv_own += cfg.vpp / k if p > 1 else 0.0
            inv_least = min(inv_least, 1.0 / k)
        own = cfg.vpp * p if p > 1 else 0
        # Σ_r P_r / inflight_r is least with a smallest block per stage and the rest on the rank with the most in
        # flight: Σ_own P_b/k_r + Σ_rest P_b/k_r ≥ min·Σ_own 1/k_r + (P_run − own·min)·min_r 1/k_r
        total -= per * (g.min_block_params * inv_own + (g.run_params - own * g.min_block_params) * inv_least)
        k_pre, k_post = _edge_held(cfg, m)  # their own chunks' counts, over the rank's
        return total - g.pre_act * k_pre / ks[0] - g.post_act * k_post / ks[last]

    def _integral_bottleneck(self, cfg: ParallelConfig, g: _Group, p2p: float) -> float:
        p, v, S = cfg.pp, cfg.vpp, cfg.pp * cfg.vpp
        t = g.block_opts_t_min
        load = []
        for r in range(p):
            fixed = (g.pre_t if r == 0 else 0.0) + (g.post_t if r == (S - 1) % p else 0.0)
            fixed += p2p * (v - 1 if r == 0 else v)
            load.append(fixed + v * t)
        heap = [(x, r) for r, x in enumerate(load)]
        heapq.heapify(heap)
        for _ in range(len(self.blocks) - S):
            x, r = heapq.heappop(heap)
            heapq.heappush(heap, (x + t, r))
        return max(x for x, _ in heap)

    def _memory_bottleneck(self, cfg: ParallelConfig, g: _Group, m: int, p2p: float, extra: float,
                           lo: float) -> float:
        """The least X such that the ranks can hold every block with T_r ≤ X and their memory: rank r holds at
        most ⌊cap_r(X)⌋ blocks, cap_r(X) the LP maximum of Σ_a n_a s.t. Σ_a t_a·n_a ≤ X − fixed_r and
        Σ_a (per·P_b + inflight_r·act_a)·n_a ≤ its budget (two constraints: a vertex uses ≤ 2 modes); bisection
        on X (cap_r is non-decreasing), the result rounded down."""
        p, v, S = cfg.pp, cfg.vpp, cfg.pp * cfg.vpp
        cap, per, temp = self._budget(cfg, g, m, extra)
        ranks = []
        k_pre, k_post = _edge_held(cfg, m)
        for r in range(p):
            k = _held(cfg, r, m)
            fixed_t = (g.pre_t if r == 0 else 0.0) + (g.post_t if r == (S - 1) % p else 0.0)
            fixed_t += p2p * (v - 1 if r == 0 else v)
            budget = cap - temp - per * ((g.pre_params if r == 0 else 0.0) + (g.post_params if r == (S - 1) % p
                                                                                else 0.0))
            budget -= (k_pre * g.pre_act if r == 0 else 0.0) + (k_post * g.post_act if r == (S - 1) % p else 0.0)
            ranks.append((fixed_t, budget, [(t, per * params + k * act) for act, t, params in g.block_opts]))
        nb = len(self.blocks)

        def holds(x: float) -> bool:
            n = 0
            for fixed_t, budget, opts in ranks:
                c = _lp_max_blocks(x - fixed_t, budget, opts)
                c = int(c + 1e-9) if c < INF else nb
                if c < v:
                    return False
                n += c
            return n >= nb

        if not holds(lo * 1e6 + 1.0):
            return INF
        if holds(lo):
            return lo
        hi = lo * 2
        while not holds(hi):
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
            if hi - lo <= 1e-9 * hi:
                break
        return lo

    def _pinned(self, cfg: ParallelConfig) -> ParallelConfig:
        """``cfg`` under ZeRO 2/3 with the gradient compression the ILP gives it
        (`planner.search.ilp_data.zero23_grad_option`)."""
        return cfg if cfg.zero < 2 else replace(cfg, grad_compress=zero23_grad_option(self.grad_opts))

    def _fsdp(self, cfg: ParallelConfig, g: _Group, ev: Evaluator) -> float:
        if not (cfg.zero == 3 and cfg.data_ranks > 1):
            return 0.0
        sl = self.cluster.device.overlap_slowdown
        S = cfg.pp * cfg.vpp
        share = fsdp_gather_share(cfg, ev.m)
        ag, rs = [share * a for a in g.ag[ev.dp_span]], g.rs[ev.dp_span, fsdp_reduce_dtype_bytes(cfg)]
        if cfg.fsdp_in_pipeline:
            rs = [0.0] * len(rs)  # once per step after the pipeline: in _finish
        xf, xl, xr = S * min(ag), S * min(ag), S * min(rs)
        fwd_excess = max(0.0, sum(ag) - xf - g.fwd)
        bwd_excess = max(0.0, sum(ag) - xl + sum(rs) - xr - (g.bwd + g.fwd))
        # FSDP2's serial work, summed over every layer (`costmodel.overlap.fsdp_serial`: additive over layers)
        return ((1 - sl) * (xf + xl + xr + fwd_excess + bwd_excess) + sl * (2 * sum(ag) + sum(rs))
                + self._serial(cfg, g, ev, "micro_batch"))

    def _serial(self, cfg: ParallelConfig, g: _Group, ev: Evaluator, per: str) -> float:
        """FSDP2's serial work of every layer ``per`` micro-batch or step, for the candidate's own configuration
        (its reduce dtype: ``ev`` is shared by candidates that differ in it)."""
        return fsdp_serial(g.costs, self._view(cfg, ev), per)

    def _view(self, cfg: ParallelConfig, ev: Evaluator) -> _SyncView:
        return _SyncView(cfg, self.cluster, ev.gathered_numel, ev.fsdp_copy_out, ev.m, ev.autocast,
                         ev.fused_grad_accumulation)

    def _finish(self, cfg: ParallelConfig, g: _Group, ev: Evaluator, grad_opts) -> float:
        p = cfg.pp
        P = g.params / p
        # the average rank's clipping and optimizer step (affine in its parameters and tensors: ≤ the slowest's),
        # the loss's reductions (every rank's)
        finish = (optimizer_part_time(P, sum(c.param_tensors for c in g.costs) / p, _OptView(cfg, self.cluster))
                  + sum(loss_sync_time(ev)) + grad_accumulation_time(P, self._view(cfg, ev)))
        pipelined = cfg.fsdp_in_pipeline
        if cfg.zero == 3 and pipelined:  # one exposed reduce-scatter of the average rank's gradients (affine: ≤ max)
            return (finish + reduce_scatter_time(P * fsdp_reduce_dtype_bytes(cfg), ev.dp_span, self.affine_cluster)
                    + self._serial(cfg, g, ev, "step") / p)
        if cfg.data_ranks == 1 or cfg.zero == 3:
            return finish
        span, cl, sl = ev.dp_span, self.affine_cluster, self.cluster.device.overlap_slowdown
        pbytes = cfg.param_bytes
        fw, wb = g.fwd / p, (g.bwd + g.fwd) / p
        if cfg.zero == 2:
            rs = reduce_scatter_time(P * fsdp_reduce_dtype_bytes(cfg), span, cl)
            ag = all_gather_time(P * pbytes, span, cl)
            # the average rank's serial work (additive over layers: ≤ the slowest's)
            finish += self._serial(cfg, g, ev, "step") / p
            m = 1 if pipelined else ev.m  # reduce-scatters per step
            if pipelined:  # one reduce-scatter after the pipeline, hidden by nothing
                return finish + rs + (1 - sl) * max(0.0, ag - fw) + sl * ag
            return finish + (1 - sl) * (m * max(0.0, rs - wb) + max(0.0, ag - fw)) + sl * (m * rs + ag)
        if cfg.reduces_after_step:
            wb = 0.0  # all-reduced after the whole backward (costmodel.runnable): no window
        dev = cl.device
        mem_bw = dev.hbm_bw * dev.memory_eff
        last_elems = min(g.min_first_params, 25 * 2**20 / 4)
        options = []
        for kind, rank in sorted({parse_grad_compress(k) for k in grad_opts}):
            if kind == "none":
                options.append((all_reduce_time(P * 4, span, cl), all_reduce_time(last_elems * 4, span, cl), 0.0))
                continue
            if kind in ("bf16", "fp16"):
                options.append((all_reduce_time(P * 2, span, cl), all_reduce_time(last_elems * 2, span, cl),
                                12 * P / mem_bw))
                continue
            # PowerSGD: costmodel.compression's formula on the average rank, the matmuls at the curve's e_max
            comp, vec, flops, mat = (x / p for x in g.powersgd(rank))
            dtype = "fp32" if "fp32" in dev.peak_flops else next(iter(dev.peak_flops))
            comm = all_reduce_time((comp / 2 + vec) * 4, span, cl) + all_reduce_time(comp / 2 * 4, span, cl)
            enc = flops / (dev.peak(dtype) * max(dev.matmul_eff.e_max, 1e-12)) + 12 * mat / mem_bw
            options.append((comm, all_reduce_time(min(last_elems, 1.0) * 4, span, cl), enc))
        exposed = min(max(sl * c, last, c - (1 - sl) * wb) + enc for c, last, enc in options)
        if cfg.zero == 1:  # one broadcast of them all: a lower bound of ZeroRedundancyOptimizer's per-tensor ones
            exposed += broadcast_time(P * pbytes, span, cl)
        return finish + exposed

    # ---------------------------------------------------------------------------------------------- memory
    def memory(self, cfg: ParallelConfig, capacity: float | None = None) -> float:
        """Peak memory of the most loaded rank with every layer at its smallest activations and the fewest
        layers it can hold (`_held_peak` on every pipeline rank). With ``capacity``, a looser bound first (no
        gradient charged at the peak, the first and the last rank only), returned when it already exceeds it: the
        full one reads every rank's passes as torch orders them, ~10 ms a candidate with hundreds of micro-batches."""
        cfg = self._pinned(cfg)
        g = self._group(cfg)
        m = self.gb // (cfg.dp * cfg.mbs)
        if capacity is not None:
            p, gr, k, _, _ = state_bytes_at_peak(cfg)
            if (quick := self._memory(cfg, g, m, p + gr + k, False)) > capacity:
                return quick
        return self._memory(cfg, g, m, _state_at_peak(cfg, m), True)

    def _memory(self, cfg: ParallelConfig, g: _Group, m: int, per: float, every_rank: bool) -> float:
        """`memory` with ``per`` model-state bytes per parameter at the peak (`_state_at_peak`)."""
        temp = dp_reduction_temp_bytes(cfg, "none", 0.0)
        block_act = g.block_opts_act_min
        k_pre, k_post = edge_inflight(cfg.schedule, cfg.pp, cfg.vpp, m)
        first = (per * (g.pre_params + cfg.vpp * g.min_block_params) + k_pre * g.pre_act
                 + inflight(cfg.schedule, cfg.pp, cfg.vpp, 0, m) * cfg.vpp * block_act)
        last_rank = (cfg.pp * cfg.vpp - 1) % cfg.pp
        last = (per * (g.post_params + cfg.vpp * g.min_block_params) + k_post * g.post_act
                + inflight(cfg.schedule, cfg.pp, cfg.vpp, last_rank, m) * cfg.vpp * block_act)
        if cfg.pp == 1:
            first = per * g.params + g.pre_act + g.post_act + g.run_act_min
        else:  # torch's kept buffers of the outputs each chunk sends (`_held_peak`): all of the first rank's chunks,
            # all but the last stage of the last rank's
            first += m * cfg.vpp * g.boundary_min
            last += m * (cfg.vpp - 1) * g.boundary_min
        after = sum(plan_state_bytes(cfg))  # every gradient
        held = self._held_peak(cfg, g, m, per) if every_rank else 0.0
        allocated = max(first, last, held, after * g.params / cfg.pp) + temp
        return (1 + FRAGMENTATION) * allocated + runtime_reserved_bytes(cfg, self.cluster.device)

    def _held_peak(self, cfg: ParallelConfig, g: _Group, m: int, per: float) -> float:
        """With a pipeline: the least peak of the most loaded rank over the ways the run's N blocks can be spread,
        each rank holding b_r ≥ v of them. At each of rank r's states (`costmodel.memory.held_states`: f_c
        micro-batches of chunk c holding their activations, w_c pending a weight pass) the ILP charges
        - torch's pipelining buffers (`costmodel.memory.pipeline_buffers`): m receive buffers of each chunk but the
          first stage and m sent outputs of each chunk but the last stage, kept, less at most one received buffer
          per micro-batch in flight (the received input the first layer saves): at least
          B_s = m·(chunks that send)·β + Σ over chunks that receive of (m − f_c − w_c)·β, with β the least
          boundary bytes (`_Group.boundary_min`);
        - each block of chunk c at f_c times its activations and w_c times what a pending micro-batch keeps
          (`_Group.block_pending_min`; the first stage's pending ones at full activations); every other term ≥ 0.
        So a block costs rank r at least u_r = per·(least block parameters) + max over states of min over chunks of
        (f_c·least activations + w_c·least pending). Then the peak is ≥ B_s + v·per·(least block parameters) +
        Σ_c (f_c·least activations + w_c·least pending) at every state of every rank (a block per chunk), and,
        with B_r = min over its states of B_s, ≥ (N + Σ_r B_r/u_r) / Σ_r 1/u_r (below it, Σ_r b_r < N).
        Zero-bubble's later ranks hold the most activations (their weight passes trail further)."""
        if cfg.pp == 1:
            return 0.0
        act, beta = g.block_opts_act_min, g.boundary_min
        base = per * g.min_block_params
        last = cfg.pp * cfg.vpp - 1  # the last stage
        one_per_chunk, unit, buf = 0.0, [], []
        for r in range(cfg.pp):
            stages = [c * cfg.pp + r for c in range(cfg.vpp)]
            sends = m * sum(s < last for s in stages) * beta
            pend = [act if s == 0 else g.block_pending_min for s in stages]  # (the first stage's: held as full)
            states = [(sends + sum((m - f - w) * beta for s, f, w in zip(stages, full, pending) if s > 0),
                       [f * act + w * x for f, w, x in zip(full, pending, pend)])
                      for full, pending, *_ in held_states(cfg.schedule, cfg.pp, cfg.vpp, r, m)]
            one_per_chunk = max(one_per_chunk, cfg.vpp * base + max(b + sum(x) for b, x in states))
            buf.append(min(b for b, _ in states))
            unit.append(base + max(min(x) for _, x in states))
        if not all(unit):
            return one_per_chunk
        spread = (len(self.blocks) + sum(b / u for b, u in zip(buf, unit))) / sum(1 / u for u in unit)
        return max(one_per_chunk, spread)


def _held(cfg: ParallelConfig, r: int, m: int) -> float:
    """Micro-batches in flight that every block of pipeline rank ``r`` may be charged in the aggregated memory
    relaxations. With one chunk per rank or one state, the rank's average (`inflight`). With several chunks
    (interleaved, zero-bubble) the ILP weighs each chunk by its own count in every state the rank passes through
    (`costmodel.memory.held_states`), and a late chunk may hold fewer than the average, so the relaxation charges
    the least count of a chunk in the state where that least is largest (full micro-batches only; pending ones
    hold at least a block's activations too, but are not needed for a valid bound): each block's activations count
    at least that often in that state, and the rank's peak is at least that state's."""
    if cfg.pp > 1 and cfg.vpp > 1:
        return max(min(full) for full, *_ in held_states(cfg.schedule, cfg.pp, cfg.vpp, r, m))
    return inflight(cfg.schedule, cfg.pp, cfg.vpp, r, m)


def _edge_held(cfg: ParallelConfig, m: int) -> tuple[float, float]:
    """(embedding, head): their chunks' counts (`edge_inflight`), or with several chunks per rank the counts of
    `_held`'s state, which are at least its least (`_held` itself)."""
    if cfg.pp > 1 and cfg.vpp > 1:
        return _held(cfg, 0, m), _held(cfg, (cfg.pp * cfg.vpp - 1) % cfg.pp, m)
    return edge_inflight(cfg.schedule, cfg.pp, cfg.vpp, m)


def _state_at_peak(cfg: ParallelConfig, m: int) -> float:
    """Model-state bytes per parameter at every state of every rank's activation peak
    (`costmodel.memory.state_bytes_at_peak`): the gradients where `costmodel.memory.grads_held_at_peak` holds for
    all ranks; parameters gathered at some states only (pipelined ZeRO 3) are not charged."""
    p, g, k, made, _ = state_bytes_at_peak(cfg)
    return p + g + k + (made if grads_held_at_peak(cfg, m) else 0.0)


@dataclass
class _Group:
    """Per (tp, sp, mbs, precision): the layer-cost sums the bounds read."""

    run_opts: list  #: (act, time) of the whole run with each kind of block at one mode, undominated, fastest first
    block_opts: list  #: (act, time, parameters) of one block, per kind and mode
    block_opts_t_min: float  #: the least time of a block of any kind
    block_opts_act_min: float  #: the least activations of a block of any kind
    #: the least a block of any kind holds for a micro-batch pending its weight pass (zero-bubble), at any mode
    block_pending_min: float
    #: the least bytes a stage boundary into a block carries per micro-batch (`Evaluator.p2p_bytes`, halved where
    #: the ILP may choose a bf16 boundary cast that applies)
    boundary_min: float
    min_block_params: float  #: the smallest kind's parameters: ZeRO-3 gathers at least those on every rank
    run_params: float
    run_act_min: float  #: Σ over the run of each block's least activations
    pre_t: float
    post_t: float
    pre_act: float
    post_act: float
    pre_params: float
    post_params: float
    params: float
    fwd: float
    bwd: float
    min_first_params: float
    ag: _PerSpan
    rs: _PerSpan  #: (span, bytes per element) → each layer's reduce-scatter
    costs: list

    @staticmethod
    def build(b: Bounds, ev: Evaluator) -> _Group:
        n = len(b.lg.layers)
        per_ac = {a: [ev.cost(i, a) for i in range(n)] for a in AC}
        none = per_ac[AC.NONE]

        def t(c):
            return c.fwd_s + c.bwd_s + c.recompute_s + c.comm_s

        def least_t(idx):
            return sum(min(t(per_ac[a][i]) for a in AC) for i in idx)

        def least_act(idx):
            return sum(min(per_ac[a][i].act_bytes for a in AC) for i in idx)

        # the run with each kind at one mode (every mode, a superset of the ILP's): the kinds' undominated
        # (activations, time) points added one kind at a time (a sum's undominated points are sums of undominated
        # ones)
        run = [(0.0, 0.0)]
        block_opts = []
        for c in b.classes:
            i = c[0]
            mine = [(len(c) * per_ac[a][i].act_bytes, len(c) * t(per_ac[a][i])) for a in AC]
            run = _undominated([(x + y, u + w) for x, u in run for y, w in mine])
            block_opts += [(per_ac[a][i].act_bytes, t(per_ac[a][i]), none[i].param_numel) for a in AC]
        run.sort(key=lambda x: (x[1], x[0]))
        block_opts = block_opts or [(0.0, 0.0, 0.0)]
        pb = 4 if ev.cfg.precision == "fp32" else 2
        firsts = [none[i].param_numel for i in ([b.pre[0]] if b.pre else []) + [c[0] for c in b.classes]]
        return _Group(
            run_opts=run, block_opts=block_opts, block_opts_t_min=min(x[1] for x in block_opts),
            block_opts_act_min=min(x[0] for x in block_opts),
            block_pending_min=min((per_ac[a][c[0]].pending_bytes for c in b.classes for a in AC), default=0.0),
            # (a stage starts at any block but the first, whose captured input also holds what every block reads)
            boundary_min=min((ev.p2p_bytes(i) for i in b.blocks[1:]), default=0.0) / (
                2 if ev.wide_boundaries and "bf16" in b.pp_opts else 1),
            min_block_params=min((none[c[0]].param_numel for c in b.classes), default=0.0),
            run_params=sum(none[i].param_numel for i in b.blocks), run_act_min=least_act(b.blocks),
            pre_t=least_t(b.pre), post_t=least_t(b.post), pre_act=least_act(b.pre),
            post_act=least_act(b.post), pre_params=sum(none[i].param_numel for i in b.pre),
            post_params=sum(none[i].param_numel for i in b.post), params=sum(c.param_numel for c in none),
            fwd=sum(c.fwd_s for c in none), bwd=sum(c.bwd_s for c in none),
            min_first_params=min(firsts) if firsts else 0.0,
            ag=_PerSpan(lambda span: [all_gather_time(c.param_numel * pb, span, b.cluster) for c in none]),
            rs=_PerSpan(lambda key: [reduce_scatter_time(c.param_numel * key[1], key[0], b.cluster) for c in none]),
            costs=none)

    def powersgd(self, rank: int) -> tuple[float, float, float, float]:
        """Σ over all layers of (compressed elements, vector elements, encode FLOPs, matrix elements)."""
        return powersgd_volume(self.costs, rank)


def _undominated(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (activations, time) points no other point beats in both, by activations."""
    out, fastest = [], INF
    for act, time in sorted(set(points)):
        if time < fastest:
            out.append((act, time))
            fastest = time
    return out


def _lp_max_blocks(time_room: float, mem_room: float, opts) -> float:
    """max Σ n_a s.t. Σ t_a·n_a ≤ time_room, Σ w_a·n_a ≤ mem_room, n ≥ 0 (opts: (t_a, w_a), all > 0)."""
    if time_room < 0 or mem_room < 0:
        return -1.0
    best = 0.0
    for t, w in opts:
        best = max(best, min(time_room / t if t > 0 else INF, mem_room / w if w > 0 else INF))
    for i, (t1, w1) in enumerate(opts):
        for t2, w2 in opts[i + 1:]:
            det = t1 * w2 - t2 * w1
            if det == 0:
                continue
            n1 = (time_room * w2 - t2 * mem_room) / det
            n2 = (t1 * mem_room - w1 * time_room) / det
            if n1 >= 0 and n2 >= 0:
                best = max(best, n1 + n2)
    return best


class _PerSpan(dict):
    """span → f(span), computed on first use."""

    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def __missing__(self, span):
        self[span] = v = self.f(span)
        return v


@dataclass(frozen=True)
class _SyncView:
    """What `fsdp_serial` and `grad_accumulation_time` read from an Evaluator, for a candidate's own
    configuration."""

    cfg: ParallelConfig
    cluster: Cluster
    gathered_numel: Callable
    fsdp_copy_out: bool
    m: int
    autocast: bool
    fused_grad_accumulation: bool


@dataclass(frozen=True)
class _OptView:
    """What `optimizer_part_time` reads from an Evaluator."""

    cfg: ParallelConfig
    cluster: Cluster
