"""The inner problem: for one outer candidate (dp, tp, pp, vpp, schedule, mbs, zero, sp), choose activation
checkpointing per layer, contiguous (virtual) pipeline stages and compression per communication group, minimising
the predicted step time of `costmodel.estimate.Evaluator.evaluate` subject to memory per rank. A mixed-integer
program solved with pywraplp (SCIP; CBC or HiGHS when SCIP is missing).

Data. S = pp·vpp stages; stage c runs on pipeline rank r(c) = c mod pp. The layers before the run of blocks ("pre":
the embedding, `costmodel.estimate.split_layers`) sit on stage 0, the layers after it ("post", the head) on stage
S − 1, and every stage holds ≥ 1 block of the run. Blocks of one kind (signature) cost the same, so they are
*counted* per stage and AC mode, not placed. With one kind in the run every split with the same counts is the same
plan; with several (DeepSeek's leading dense blocks, dense and MoE in turn, five local attention blocks and a global
one) which blocks a stage holds depends on where it starts and ends, so the stages' bounds are variables too
(``before``) and each kind's count on a stage is the number of its blocks between them: a stage may start and end
at any block. Per AC mode a and layer i the evaluator gives t = fwd + bwd + recompute + tp_comm, the backward window
bwd + recompute, activations, the recomputation peak and parameters (`Evaluator.cost`). Functions of a rank's
per-kind block counts v that are not linear (collective times, PowerSGD encode, FSDP's two largest layers) are
tabulated exactly with the cost model's own functions, one value per possible v (`ilp_data.Data.vectors`). All
times are in units of ``time_unit`` seconds and all bytes in units of ``mem_unit`` so that the solver's tolerances
are relative.

Variables (dicts keyed by meaning):
- ``blocks[c, k, a]`` ∈ ℤ≥0: blocks of kind k on stage c with AC mode a.
- ``before[c, j]`` ∈ {0,1} (several kinds): the run's block j is on a stage ≤ c.
- ``fixed_ac[i, a]`` ∈ {0,1}: AC mode of a pre/post layer i (one per layer).
- ``onehots[r, cap]``: key → {0,1}, rank r's per-kind counts (cap None) or those counts clipped at cap (1: which
  kinds it holds; 2: one or more than one), exactly one set; only where a table needs it (`tab`).
- ``uses_ac[r, k, a]`` ∈ {0,1}: some block of kind k on rank r uses AC mode a (for the recomputation peak).
- ``compress["dp", k]``, ``compress["pp", k]`` ∈ {0,1}: gradient / boundary compression (one each).
- continuous: ``stage_time[c]``, ``bottleneck``, ``finish``, the epigraph variables of the max(0, ·) terms
  (``fsdp_excess[c, "fwd"|"bwd"]``, ``dp_excess[r, k]``, ``dp_tail[r, k]``, ``zero2_excess[r, …]``), the
  recomputation peak ``rec_peak[r, g]`` (g: a group of the rank's states, below).

Objective (`add_objective`): step = (m − φ)·bottleneck + φ·Σ_r T_r + finish, which equals evaluate's
m·max_r T_r + φ·(Σ_r T_r − max_r T_r) + max_r finish_r because m ≥ φ (m ≥ 1, φ ≤ 1).

Constraint families, one function each:
1. `add_assignment`: one AC per fixed layer; all blocks placed; every stage non-empty; one compression per group.
   Several kinds: before[c, j] ≥ before[c, j + 1] (the blocks on stages ≤ c are a prefix), before[c, j] ≥
   before[c − 1, j − 1] (stage c is not empty), before[c, j] ≤ before[c + 1, j], and Σ_a blocks[c, k, a] =
   Σ_{j of kind k} (before[c, j] − before[c − 1, j]). A stage's first and last blocks (FSDP's unoverlapped
   all-gathers, the last DDP bucket) are linear in ``before`` too.
2. `tab`: rank r's per-kind counts N_r,k = Σ_{c≡r} Σ_a blocks[c, k, a] equal Σ_key key_k·onehot[r, None][key]
   (clipped: key_k ≤ N_r,k, and N_r,k ≤ key_k below the cap).
3. `add_stage_times`: T_c = Σ layer t + [c > 0]·p2p(chosen pp compression) + fsdp_c. Under ZeRO-3 fsdp_c =
   ag_first + ag_last + rs_first + (1 − s)·E_f + s·A_f + (1 − s)·E_b + s·A_b + Σ serial with E ≥ A − window, E ≥ 0
   (`costmodel.overlap.fsdp_exposed`; s = overlap_slowdown; serial: FSDP2's copies and host work,
   `costmodel.overlap.fsdp_serial`, linear in the blocks). max(0, A − W) + s·min(A, W) = (1 − s)·max(0, A − W)
   + s·A, and 1 − s > 0, so the concave min needs no binary: the epigraph is tight at the optimum.
4. `add_bottleneck`: bottleneck ≥ T_r = Σ_{c≡r} T_c.
5. `add_finish`: finish ≥ dp_exposed_r + encode_r + optimizer_r (with the clipping, and under ZeRO-1 its parameter
   broadcasts, which the evaluator reports in its optimizer part) + the loss's reductions for every rank (for the
   chosen gradient compression k, big-M-gated by compress["dp", k]). DDP/ZeRO-1 (`costmodel.overlap.dp_exposed`):
   exposed = max(max(0, x), L) + s·min(C, W) with x = C − W, C the all-reduce time (tabulated in N_r), W the rank's
   backward window, L the last bucket. Written as s·C + G with G ≥ (1 − s)·x,
   G ≥ 0, G ≥ L − s·P and P ≤ max(0, x) by a binary δ (P ≤ x + M(1 − δ), P ≤ M·δ): the concave part of the max
   is what needs the binary. ZeRO-2: two tight epigraphs as in 3, plus FSDP2's serial work (tabulated). ZeRO-1
   adds the parameters' broadcasts (tabulated, `costmodel.overlap.zero1_sync_time`), charged with the DDP part
   here: the finish is their sum either way.
6. `add_memory`: per rank, 1.05·(params + grads + optimizer + in-flight activations + backward peak +
   temporaries) + reserve ≤ capacity (`costmodel.memory`); blocks weigh the rank's average in-flight count, the
   embedding and head their own chunk's; the backward peak is the max over the rank's layers, rec_peak ≥
   peak_k,a·uses_ac[r, k, a] + need_r + extra_r (ZeRO-3's gathered layers during a block's backward; the head's
   gradient, FSDP's gradient buffers and a tied weight's gradient in flight) with
   blocks[c, k, a] ≤ n_k·uses_ac[r, k, a], and rec_peak ≥ the embedding's and head's own; PowerSGD's error buffer
   is gated by its compress binary. Pipelined ZeRO 3 holds a chunk gathered at the states after its backward and
   gathers it on a backward otherwise (`costmodel.memory.fsdp_chunk_gathered`): the states are grouped by which
   chunks they hold gathered, each group with its own in-flight activations and rec_peak[r, g] (the moments'
   gathering beyond the group's), and each group's sum is bounded; elsewhere there is one group.

Warm start (`Model.warm_start`, several kinds that repeat a pattern): the problem with stages cut only where the
pattern starts again is solved first (half the time limit) and its whole solution starts the full problem.

Decode (`decode`) gives each stage its blocks (several kinds: those between its bounds; one kind: in order, stage 0
first) and each kind's AC modes to its blocks there, most activations first (`ilp_data.Data.acs`), checks one AC
per layer, contiguous non-empty stages and memory, and re-evaluates with `Evaluator.evaluate`; the solver's
objective must agree with it to 1e-6 relative at an optimum (and be no lower at a solution the time limit stopped):
that is the consistency proof.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from ortools.linear_solver import pywraplp

from costmodel.cluster import Cluster
from costmodel.collectives import all_gather_time, reduce_scatter_time
from costmodel.compression import compressed_grad_comm
from costmodel.config import AC, ParallelConfig, parse_grad_compress
from costmodel.estimate import Estimate, Evaluator
from costmodel.memory import (
    AUTOCAST_COPY_BYTES,
    FRAGMENTATION,
    dp_reduction_temp_bytes,
    fsdp_chunk_gathered,
    fsdp_edge_bytes,
    fsdp_gathered_bytes,
    fsdp_reduce_bytes,
    fsdp_reduce_dtype_bytes,
    fsdp_reduce_in_flight_bytes,
    fsdp_root_bytes,
    head_grad_bytes,
    held_states,
    inflight_chunks,
    runtime_reserved_bytes,
)
from costmodel.overlap import (
    fsdp_gather_share,
    fsdp_serial,
    grad_accumulation_time,
    loss_sync_time,
    optimizer_part_time,
    zero1_sync_time,
    zero2_gather_time,
)
from planner.search.ilp_data import (  # noqa: F401 - re-exported: the ILP's data and options
    AC_ORDER,
    GRAD_OPTIONS,
    PP_OPTIONS,
    Data,
    NotSupportedError,
    _fixed_on_stage,
    _rank_layer_costs,
    _units_of,
    build_data,
    pattern_cuts,
)
from profiler.graph import LayerGraph

BACKENDS = ("SCIP", "CBC", "HIGHS")
AGREEMENT = 1e-6  #: relative tolerance between the solver's objective and Evaluator.evaluate


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The solved inner problem of one candidate."""

    config: ParallelConfig  #: the candidate with the chosen compression (and the blocks' usual AC) filled in
    acs: tuple[AC, ...]  #: AC mode per layer
    stage_of: tuple[int, ...]  #: (virtual) stage per layer
    estimate: Estimate  #: Evaluator.evaluate of the decoded plan
    status: str  #: OPTIMAL or FEASIBLE (time limit hit)
    objective: float  #: the solver's objective, seconds
    bound: float  #: the solver's best bound, seconds
    gap: float  #: (objective − bound) / objective
    time_s: float  #: build + solve + decode
    backend: str  #: SCIP, CBC or HIGHS


class Infeasible(Exception):
    """No assignment of this candidate fits in memory (or the solver found none within the time limit)."""

    def __init__(self, status: str, time_s: float) -> None:
        super().__init__(status)
        self.status, self.time_s = status, time_s


class CutOff(Infeasible):
    """No plan of this candidate is as fast as the ``cutoff`` given to `solve` (it may or may not fit)."""


# ---------------------------------------------------------------------------------------------------- the model
class Model:
    """The MIP of one candidate: build with `Model(data)`, then `solve`, then `decode`."""

    def __init__(self, d: Data, backend: str | None = None) -> None:
        self.d = d
        self.solver, self.backend = _create_solver(backend)
        self.inf = self.solver.infinity()
        self.add_variables()
        self.add_assignment()  # (family 2, the rank counts' one-hots, is added where a table needs it: `tab`)
        self.add_stage_times()
        self.add_bottleneck()
        self.add_finish()
        self.add_memory()
        self.add_objective()

    # -- variables -------------------------------------------------------------------------------------------
    def add_variables(self) -> None:
        d, s = self.d, self.solver
        self.blocks = {(u, k, a): s.IntVar(0, d.counts[k], f"blocks[{u},{k},{a.value}]") for u in range(len(d.units))
                       for k in d.kinds for a in d.acs[k]}
        # blocks of several kinds: before[c, j] = 1 when the run's block j is on a stage ≤ c (family 1; the blocks
        # every split puts there, or never does, are constants: `before`)
        self.before_var = {}
        if d.cut:
            assert all(len(st) == 1 for st in d.units), "units are stages wherever the ranks hold one stage each"
            self.before_var = {(c, j): s.BoolVar(f"before[{c},{j}]") for c in range(d.S - 1)
                               for j in range(c + 1, d.nblocks - (d.S - 1 - c))}
        self.fixed_ac = {(i, a): s.BoolVar(f"fixed_ac[{i},{a.value}]") for i in d.pre + d.post for a in d.fixed_acs[i]}
        self.onehots = {}  # (rank, cap) → its one-hot counts, created only where a table is not affine (`tab`)
        self.compress = {("dp", k): s.BoolVar(f"compress[dp,{k}]") for k in d.grad_opts}
        self.compress |= {("pp", k): s.BoolVar(f"compress[pp,{k}]") for k in d.pp_opts}
        self.stage_time = {u: s.NumVar(0, self.inf, f"stage_time[{u}]") for u in range(len(d.units))}
        self.bottleneck = s.NumVar(0, self.inf, "bottleneck")
        self.finish = s.NumVar(0, self.inf, "finish")

    # -- helpers: linear expressions in the model's units ----------------------------------------------------
    def _t(self, seconds: float) -> float:
        return seconds / self.d.time_unit

    def _b(self, nbytes: float) -> float:
        return nbytes / self.d.mem_unit

    @property
    def zero(self):
        return 0.0 * self.bottleneck

    def layer_sum(self, stages, attr) -> pywraplp.LinearExpr:
        """Σ over the stages' layers of ``attr(cost)`` (a function of a LayerCost), linear in the AC choices."""
        d, ev = self.d, self.d.ev
        terms = []
        for c in stages:
            terms += [attr(ev.cost(i, a)) * self.blocks[c, k, a] for k, i in enumerate(d.reps) for a in d.acs[k]]
            for i in _fixed_on_stage(d, c):
                terms += [attr(ev.cost(i, a)) * self.fixed_ac[i, a] for a in d.fixed_acs[i]]
        return sum(terms, self.zero)

    def n_kind(self, u, k):
        return sum((self.blocks[u, k, a] for a in self.d.acs[k]), self.zero)

    def n_stage(self, u):
        return sum((self.n_kind(u, k) for k in self.d.kinds), self.zero)

    def n_rank(self, r, k):
        return sum((self.n_kind(u, k) for u in _units_of(self.d, r)), self.zero)

    def before(self, c: int, j: int):
        """1 when the run's block j is on a stage ≤ c (a constant where every split agrees), as an expression."""
        d = self.d
        if j < 0 or c >= d.S - 1 or j <= c:
            return 1.0  # the first c + 1 blocks are on stages ≤ c: each stage holds one at least
        if c < 0 or j >= d.nblocks or j >= d.nblocks - (d.S - 1 - c):
            return 0.0  # the last S − 1 − c blocks are on the later stages
        return self.before_var[c, j]

    def end(self, c):
        """Per kind, the blocks of it on stages 0 … c (cut mode): Σ_{j of kind k} before[c, j]."""
        d = self.d
        return [sum((self.before(c, j) for j in range(d.nblocks) if d.kind_of[j] == k), self.zero) for k in d.kinds]

    def first_kind(self, c: int, k: int):
        """1 when stage c's first block is of kind k, else 0: the block j with before[c − 1, j − 1] − before[c − 1, j]
        = 1."""
        d = self.d
        if c == 0 or not d.cut:
            return float(d.kind_of[0] == k) if d.blocks else 0.0
        return sum((self.before(c - 1, j - 1) - self.before(c - 1, j) for j in range(d.nblocks)
                    if d.kind_of[j] == k), self.zero)

    def last_kind(self, c: int, k: int):
        """1 when stage c's last block is of kind k, else 0: the block j with before[c, j] − before[c, j + 1] = 1."""
        d = self.d
        if c == d.S - 1 or not d.cut:
            return float(d.kind_of[-1] == k) if d.blocks else 0.0
        return sum((self.before(c, j) - self.before(c, j + 1) for j in range(d.nblocks) if d.kind_of[j] == k),
                   self.zero)

    def at_block(self, which, c: int, f):
        """f(layer) of stage c's first (``which`` = first_kind) or last block as an expression in the cuts."""
        return sum((f(i) * which(c, k) for k, i in enumerate(self.d.reps)), self.zero)

    def tab(self, r: int, f) -> tuple:
        """(expression, lowest, highest) of f(v) for rank r's per-kind block counts v (`Data.vectors`), exact: a
        line in the counts where f is affine over them; else a one-hot over the counts clipped at 1 or 2 where f
        depends on those only (FSDP's largest gathered blocks: which kinds the rank holds, one or more than one);
        else a one-hot over the count vectors (family 2)."""
        vecs = self.d.vectors(r)
        vals = {v: f(v) for v in vecs}
        lo, hi = min(vals.values()), max(vals.values())
        if len(vecs) == 1 or lo == hi:
            return vals[vecs[0]] + self.zero, lo, hi
        scale = max(abs(lo), abs(hi)) or 1.0
        if len(self.d.reps) == 1:
            (a,), (b,) = vecs[0], vecs[-1]
            slope = (vals[vecs[-1]] - vals[vecs[0]]) / (b - a)
            coef = [vals[vecs[0]] - slope * a, slope]
        else:
            x = np.array([[1.0, *v] for v in vecs])
            coef = list(np.linalg.lstsq(x, np.array([vals[v] for v in vecs]), rcond=None)[0])
        if all(abs(coef[0] + sum(c * n for c, n in zip(coef[1:], v)) - y) <= 1e-12 * scale for v, y in vals.items()):
            # an affine table (collective times are α + β·bytes) needs no one-hot: use the line in the counts
            return coef[0] + sum((c * self.n_rank(r, k) for k, c in enumerate(coef[1:])), self.zero), lo, hi
        for cap in (1, 2):
            keyed: dict[tuple, float] = {}
            if all(abs(keyed.setdefault(_clip(v, cap), y) - y) <= 1e-12 * scale for v, y in vals.items()):
                onehot = self._onehot(r, cap)
                return sum(y * onehot[key] for key, y in keyed.items()), lo, hi
        onehot = self._onehot(r, None)
        return sum(y * onehot[v] for v, y in vals.items()), lo, hi

    def _onehot(self, r: int, cap: int | None) -> dict:
        """Rank r's one-hot over its per-kind block counts (``cap`` None) or those counts clipped at ``cap``,
        created on first use: key → binary, exactly one set, the one the rank's counts give."""
        if (r, cap) in self.onehots:
            return self.onehots[r, cap]
        s, d = self.solver, self.d
        vecs = d.vectors(r)
        keys = sorted({_clip(v, cap) for v in vecs})
        tag = "" if cap is None else f"≤{cap}"
        out = self.onehots[r, cap] = {key: s.BoolVar(f"rank_vec{tag}[{r},{','.join(map(str, key))}]") for key in keys}
        s.Add(sum(out.values()) == 1)
        for k in d.kinds:
            if cap is None:
                s.Add(self.n_rank(r, k) == sum(key[k] * x for key, x in out.items()))
                continue
            # a clipped count below the cap is the count; at the cap, the count is at least it
            most = max(v[k] for v in vecs)
            s.Add(self.n_rank(r, k) >= sum(key[k] * x for key, x in out.items()))
            s.Add(self.n_rank(r, k) <= sum((key[k] if key[k] < cap else most) * x for key, x in out.items()))
        return out

    # -- 1. assignment ---------------------------------------------------------------------------------------
    def add_assignment(self) -> None:
        d, s = self.d, self.solver
        # each pre/post layer takes exactly one AC mode
        for i in d.pre + d.post:
            s.Add(sum(self.fixed_ac[i, a] for a in d.fixed_acs[i]) == 1)
        if d.cut:
            # stages are contiguous: the blocks on stages ≤ c are a prefix of the run; and non-empty: when block
            # j − 1 is on a stage ≤ c − 1, block j is on a stage ≤ c; a stage holds of each kind the blocks of it
            # between the two prefixes
            for (c, j), x in self.before_var.items():
                s.Add(x >= self.before(c, j + 1))
                s.Add(x >= self.before(c - 1, j - 1))
                s.Add(x <= self.before(c + 1, j))
            for u, (c,) in enumerate(d.units):
                for k, (hi, lo) in enumerate(zip(self.end(c), self.end(c - 1))):
                    s.Add(self.n_kind(u, k) == hi - lo)
        elif d.blocks:  # one kind: every block placed, every stage holds at least one
            s.Add(sum(self.blocks.values()) == d.nblocks)
            for u, stages in enumerate(d.units):
                s.Add(self.n_stage(u) >= len(stages))
        # exactly one compression per communication group
        for group, opts in (("dp", d.grad_opts), ("pp", d.pp_opts)):
            s.Add(sum(self.compress[group, k] for k in opts) == 1)

    # -- 3. stage times --------------------------------------------------------------------------------------
    def add_stage_times(self) -> None:
        d, s = self.d, self.solver
        self.fsdp_excess = {}
        for u, stages in enumerate(d.units):
            # compute + recompute + tensor-parallel collectives of the unit's layers, per micro-batch
            t = self.layer_sum([u], lambda x: self._t(x.fwd_s + x.bwd_s + x.recompute_s + x.comm_s))
            # boundary transfers into its stages (all but stage 0), with the chosen pp compression
            n_in = sum(1 for c in stages if c > 0)
            t += n_in * sum(self._t(d.p2p[k]) * self.compress["pp", k] for k in d.pp_opts)
            if d.cfg.zero == 3 and d.cfg.data_ranks > 1:
                t += self._fsdp(u)
            s.Add(self.stage_time[u] == t)

    def _fsdp(self, u):
        """ZeRO-3 exposed all-gathers and reduce-scatters of stage c (costmodel.overlap.fsdp_exposed)."""
        c = self.d.units[u][0]  # one stage per unit under ZeRO-3
        d, s, ev = self.d, self.solver, self.d.ev
        span, cl = ev.dp_span, ev.cluster
        pbytes = 4 if d.cfg.precision == "fp32" else 2

        share = fsdp_gather_share(d.cfg, ev.m)

        def ag(i):
            return share * all_gather_time(ev.gathered_numel(ev.cost(i, AC.NONE)) * pbytes, span, cl)

        rs_bytes = 0.0 if d.cfg.fsdp_in_pipeline else fsdp_reduce_dtype_bytes(d.cfg)  # once per step

        def rs(i):
            return reduce_scatter_time(ev.gathered_numel(ev.cost(i, AC.NONE)) * rs_bytes, span, cl)

        fixed = _fixed_on_stage(d, u)
        # the stage's first and last layers: the embedding's or the head's where it holds them, a block of the kind
        # its stage's bounds give otherwise (a model without blocks has only fixed layers, on one stage)
        if c == 0 and d.pre or not d.blocks:
            ag_first, rs_first = ag(fixed[0]), rs(fixed[0])
        else:
            ag_first, rs_first = self.at_block(self.first_kind, c, ag), self.at_block(self.first_kind, c, rs)
        ag_last = ag(fixed[-1]) if (c == d.S - 1 and d.post or not d.blocks) else self.at_block(self.last_kind, c, ag)
        sum_ag = sum((ag(i) * self.n_kind(u, k) for k, i in enumerate(d.reps)), self.zero) + sum(ag(i) for i in fixed)
        sum_rs = sum((rs(i) * self.n_kind(u, k) for k, i in enumerate(d.reps)), self.zero) + sum(rs(i) for i in fixed)

        def serial(idx):  # FSDP2's work on the computing stream (costmodel.overlap.fsdp_serial)
            return fsdp_serial([ev.cost(i, AC.NONE) for i in idx], ev, "micro_batch")

        # (a block is a group of its own, the stage's fixed layers one group together: `fsdp_groups`)
        sum_serial = (sum((serial([i]) * self.n_kind(u, k) for k, i in enumerate(d.reps)), self.zero)
                      + (serial(fixed) if fixed else 0.0))
        a_f = self._t(1) * (sum_ag - ag_first)
        a_b = self._t(1) * (sum_ag - ag_last + sum_rs - rs_first)
        fwd = self.layer_sum([u], lambda x: self._t(x.fwd_s))
        bwd = self.layer_sum([u], lambda x: self._t(x.bwd_s + x.recompute_s))
        e_f = self.fsdp_excess[c, "fwd"] = s.NumVar(0, self.inf, f"fsdp_excess[{c},fwd]")
        e_b = self.fsdp_excess[c, "bwd"] = s.NumVar(0, self.inf, f"fsdp_excess[{c},bwd]")
        s.Add(e_f >= a_f - fwd)
        s.Add(e_b >= a_b - bwd)
        sl = d.slow
        return (self._t(1) * (ag_first + ag_last + rs_first) + (1 - sl) * (e_f + e_b) + sl * (a_f + a_b)
                + self._t(1) * sum_serial)

    # -- 4. bottleneck ---------------------------------------------------------------------------------------
    def rank_time(self, r):
        return sum((self.stage_time[u] for u in _units_of(self.d, r)), 0.0 * self.bottleneck)

    def add_bottleneck(self) -> None:
        for r in range(self.d.pp):  # the bottleneck rank is at least as slow as every rank
            self.solver.Add(self.bottleneck >= self.rank_time(r))

    # -- 5. finish: exposed data-parallel communication, encode, optimizer -----------------------------------
    def add_finish(self) -> None:
        d, s = self.d, self.solver
        self.dp_excess, self.dp_tail, self.dp_delta = {}, {}, {}
        for r in range(d.pp):
            # the clipping and the optimizer, and the sum over tp of the gradients TP ranks compute from their share
            # (and the gradients' accumulation over the micro-batches, the evaluator's finish too)
            opt, _, opt_hi = self.tab(r, lambda v, r=r: self._t(
                optimizer_part_time(self._params(r, v), self._tensors(r, v), d.ev, self._extra(r, v))
                + d.ev.tp_partial_sync_time(_rank_layer_costs(d, r, v))
                + grad_accumulation_time(self._params(r, v), d.ev)))
            # the embedding group's all-reduce (first/last rank) and the loss's reductions (every rank), exposed
            fixed = self._t(d.ev.tied_sync_time(r) + sum(loss_sync_time(d.ev)))
            opt, opt_hi = opt + fixed, opt_hi + fixed
            if d.cfg.data_ranks == 1 or (d.cfg.zero == 3 and not d.cfg.fsdp_in_pipeline):
                s.Add(self.finish >= opt)
            elif d.cfg.zero == 3:  # pipelined: one reduce-scatter after the last backward, nothing hides it
                rs, _, _ = self.tab(r, lambda v, r=r: self._t(reduce_scatter_time(
                    self._gathered(r, v) * fsdp_reduce_dtype_bytes(d.cfg), d.ev.dp_span, d.ev.cluster)
                    + fsdp_serial(_rank_layer_costs(d, r, v), d.ev, "step")))
                s.Add(self.finish >= opt + rs)
            elif d.cfg.zero == 2:
                s.Add(self.finish >= opt + self._zero2(r))
            else:
                for k in d.grad_opts:
                    expr, hi = self._ddp(r, k)
                    if len(d.grad_opts) == 1:
                        s.Add(self.finish >= opt + expr)
                    else:  # only the chosen compression counts
                        s.Add(self.finish >= opt + expr - (opt_hi + hi) * (1 - self.compress["dp", k]))

    def _params(self, r: int, v: tuple) -> float:
        memo = self.__dict__.setdefault("_params_memo", {})
        if (r, v) not in memo:
            memo[r, v] = sum(x.param_numel for x in _rank_layer_costs(self.d, r, v))
        return memo[r, v]

    def _gathered(self, r: int, v: tuple) -> float:
        """`_params` as FSDP2 gathers and reduce-scatters them (`costmodel.estimate.Evaluator.gathered_numel`)."""
        memo = self.__dict__.setdefault("_gathered_memo", {})
        if (r, v) not in memo:
            memo[r, v] = sum(self.d.ev.gathered_numel(x) for x in _rank_layer_costs(self.d, r, v))
        return memo[r, v]

    def _tensors(self, r: int, v: tuple) -> float:
        memo = self.__dict__.setdefault("_tensors_memo", {})
        if (r, v) not in memo:
            memo[r, v] = sum(x.param_tensors for x in _rank_layer_costs(self.d, r, v))
        return memo[r, v]

    def _extra(self, r: int, v: tuple) -> float:
        """Expert parameters ZeRO 2/3 shards on rank r beyond those it holds (`LayerCost.expert_shard_extra`)."""
        memo = self.__dict__.setdefault("_extra_memo", {})
        if (r, v) not in memo:
            memo[r, v] = sum(x.expert_shard_extra for x in _rank_layer_costs(self.d, r, v))
        return memo[r, v]

    def _window(self, r, attr):
        return self.layer_sum(_units_of(self.d, r), attr)

    def _zero2(self, r):
        d, s, ev = self.d, self.solver, self.d.ev
        span, cl, sl = ev.dp_span, ev.cluster, d.slow
        rs, _, _ = self.tab(r, lambda v: self._t(reduce_scatter_time(
            self._gathered(r, v) * fsdp_reduce_dtype_bytes(d.cfg), span, cl)))
        ag, _, _ = self.tab(r, lambda v: self._t(zero2_gather_time(self._gathered(r, v), ev)))
        # FSDP2's work on the computing stream (costmodel.overlap.fsdp_serial)
        ser, _, _ = self.tab(r, lambda v: self._t(fsdp_serial(_rank_layer_costs(d, r, v), ev, "step")))
        e1 = self.dp_excess[r, "rs"] = s.NumVar(0, self.inf, f"zero2_excess[{r},rs]")
        e2 = self.dp_excess[r, "ag"] = s.NumVar(0, self.inf, f"zero2_excess[{r},ag]")
        s.Add(e2 >= ag - self._window(r, lambda x: self._t(x.fwd_s)))
        if d.cfg.fsdp_in_pipeline:  # one reduce-scatter after the pipeline, exposed
            s.Add(e1 >= rs)
            return e1 + (1 - sl) * e2 + sl * ag + ser
        s.Add(e1 >= rs - self._window(r, lambda x: self._t(x.bwd_s + x.recompute_s)))
        return (1 - sl) * (d.m * e1 + e2) + sl * (d.m * rs + ag) + ser  # a reduce-scatter per micro-batch

    def _ddp(self, r, k):
        """(expression, upper bound) of exposed DDP reduction + encode (+ ZeRO-1 broadcasts) under option k."""
        d, s = self.d, self.solver
        ev_k, sl = d.evs[k], d.slow

        def comm(v, first=None):
            costs = _rank_layer_costs(d, r, v)
            params = sum(x.param_numel for x in costs)
            first = costs[0].param_numel if first is None else first
            return compressed_grad_comm(costs, params, first, ev_k)

        table = {v: comm(v) for v in d.vectors(r)}
        c_expr, c_lo, c_hi = self.tab(r, lambda v: self._t(table[v][0]))
        enc, _, enc_hi = self.tab(r, lambda v: self._t(table[v][2]))
        # the last bucket is the rank's first layer's: the embedding's, or the first block's of its first stage
        v0 = d.vectors(r)[0]
        if r == 0 and d.pre or not d.blocks:
            tail = tail_hi = self._t(table[v0][1])
        else:
            tails = [self._t(comm(v0, d.ev.cost(i, AC.NONE).param_numel)[1]) for i in d.reps]
            tail, tail_hi = sum((t * self.first_kind(r, k) for k, t in enumerate(tails)), self.zero), max(tails)
        cfg = d.cfg
        if cfg.reduces_after_step:
            w, w_lo, w_hi = 0.0, 0.0, 0.0  # all-reduced after the whole backward: no window hides it
        else:
            w = self._window(r, lambda x: self._t(x.bwd_s + x.recompute_s))
            w_lo, w_hi = self._window_bounds(r)
        x = c_expr - w
        g = self.dp_excess[r, k] = s.NumVar(0, self.inf, f"dp_excess[{r},{k}]")
        p = self.dp_tail[r, k] = s.NumVar(0, self.inf, f"dp_tail[{r},{k}]")
        delta = self.dp_delta[r, k] = s.BoolVar(f"dp_delta[{r},{k}]")
        m_up, m_dn = max(0.0, c_hi - w_lo), max(0.0, w_hi - c_lo)
        # G = max((1 − s)·max(0, x), L − s·max(0, x)); P ≤ max(0, x) through δ
        s.Add(g >= (1 - sl) * x)
        s.Add(g >= tail - sl * p)
        s.Add(p <= x + m_dn * (1 - delta))
        s.Add(p <= m_up * delta)
        expr = sl * c_expr + g + enc
        hi = sl * c_hi + max((1 - sl) * m_up, tail_hi) + enc_hi
        if d.cfg.zero == 1:
            ag, _, ag_hi = self.tab(r, lambda v: self._t(zero1_sync_time(_rank_layer_costs(d, r, v), d.ev)))
            expr, hi = expr + ag, hi + ag_hi
        return expr, hi

    def _window_bounds(self, r):
        d, ev = self.d, self.d.ev
        vals = [[self._t(ev.cost(i, a).bwd_s + ev.cost(i, a).recompute_s) for a in d.acs[k]]
                for k, i in enumerate(d.reps)]
        lo = min(sum(n * min(x) for n, x in zip(v, vals)) for v in d.vectors(r))
        hi = max(sum(n * max(x) for n, x in zip(v, vals)) for v in d.vectors(r))
        fixed = [[self._t(ev.cost(i, a).bwd_s + ev.cost(i, a).recompute_s) for a in d.fixed_acs[i]]
                 for i, rr in d.fixed_rank.items() if rr == r]
        return (lo + sum(min(f) for f in fixed), hi + sum(max(f) for f in fixed))

    # -- 6. memory -------------------------------------------------------------------------------------------
    def add_memory(self) -> None:
        d, s, ev, cfg = self.d, self.solver, self.d.ev, self.d.cfg
        cap = self._b(ev.cluster.memory_budget_bytes) * (1 - 1e-9)
        reserve = self._b(runtime_reserved_bytes(cfg, ev.cluster.device))
        # model states at every state of the activation peak; then, per chunk, the gradients once a backward ran
        # on it and the parameters gathered while its last pass was one (costmodel.memory.state_bytes_at_peak)
        *static, made_pp, gathered_pp = ev.peak_static_bytes(1.0)
        per_param = sum(static)
        x_made_pp = ev.peak_static_bytes(0.0, 1.0)[3]
        after_backward = sum(ev.static_bytes(1.0))  # every gradient, no activation
        self.rec_peak, self.uses_ac = {}, {}
        for r in range(d.pp):
            stages = _units_of(d, r)
            params = self.tab(r, lambda v, r=r: self._params(r, v))[0]
            x_made = 0.0  # the expert shards' gradients, with the rank's first backward
            if x_made_pp:
                x_made = self.tab(r, lambda v, r=r: self._b(x_made_pp) * self._extra(r, v))[0]
            # held_states with, per state, the chunks' gradients and gathered parameters it holds
            each = [(self.layer_sum([u], lambda c: self._b(made_pp * c.param_numel)),
                     self.layer_sum([u], lambda c: self._b(gathered_pp * ev.gathered_numel(c)))) for u in stages]
            assert len(each) == cfg.vpp, "a rank's chunks are one unit each (ilp_data)"
            every = [(full, pend, sum(x * g + y * h for x, y, (g, h) in zip(made, gathered, each))
                      + (x_made if max(made) else 0.0), gathered, made)
                     for full, pend, made, gathered in held_states(cfg.schedule, cfg.pp, cfg.vpp, r, d.m)]
            # pipelined ZeRO 3: the states grouped by which chunks they hold gathered, each group with the moments
            # that gathering leaves (`costmodel.estimate.Evaluator._rank_memory`); otherwise one group
            groups = sorted({g for *_, g, _ in every}) if gathered_pp else [None]
            # a pipelined backward under autocast holds the 16-bit weight gradients of the chunks a backward ran on
            # already (`Evaluator.autocast_held_bytes`): the states also grouped by those chunks, each group with
            # those moments (one group of states per such set of chunks; never with pipelined ZeRO 3, never FSDP)
            holds = ev.holds_cast_grads
            assert not (holds and gathered_pp), "autocast and FSDP exclude each other (trains_under_autocast)"
            act_made = {made: s.NumVar(0, self.inf, f"act_made[{r},{made}]")
                        for made in sorted({m for *_, m in every if max(m)})} if holds else {}
            # per state of the rank's chunks (costmodel.memory.held_states: micro-batches holding all their
            # activations, and zero-bubble's pending a weight pass), blocks at the rank's average count (decoding
            # spreads them evenly over its chunks), the embedding and head at their own chunk's; the largest state
            # zero-bubble (`costmodel.estimate.Evaluator._rank_memory`): rank 0's first chunk is the first stage,
            # whose pending micro-batches hold their full activations; the input pass of a micro-batch in another
            # chunk builds its weight ops' output gradients on top of its full activations
            full_sum = self.layer_sum(stages, lambda x: self._b(x.act_bytes))
            pending_sum = building_sum = None  # zero-bubble only
            zero_bubble = cfg.zero_bubble
            v = cfg.vpp
            # each chunk counted on its own (ZeRO-3's per-stage units: its chunks may hold different numbers of
            # blocks): every chunk's layers at that chunk's own weights, exactly as `_rank_memory` sums them
            per_chunk = v > 1  # (one unit per chunk, asserted above)

            def buffers(full, pend, r=r):  # torch's pipelining buffers in this state, by the chosen boundary precision
                return sum(self._b(d.buffers[k, r][0] + sum((f + p) * x for f, p, x in zip(full, pend,
                                                                                             d.buffers[k, r][1])))
                           * self.compress["pp", k] for k in d.pp_opts)
            act, act_building = {}, {}  # per group; zero-bubble: with the building gradients
            for gath in groups:
                act[gath] = s.NumVar(0, self.inf, f"act[{r},{gath}]")
                act_building[gath] = s.NumVar(0, self.inf, f"act_building[{r},{gath}]")
            for full, pend, extra, gath, made in every if per_chunk else ():
                gath = gath if gathered_pp else None
                eligible = [f >= 1 and not (r == 0 and j == 0) for j, f in enumerate(full)]
                expr = buffers(full, pend) + extra + 0.0 * self.bottleneck
                for j, u in enumerate(stages):
                    own = r == 0 and j == 0  # the first stage: its pending micro-batches hold full activations
                    expr += (full[j] + (pend[j] if own else 0.0)) * self.layer_sum([u], lambda x: self._b(x.act_bytes))
                    if pend[j] and not own:
                        expr += pend[j] * self.layer_sum([u], lambda x: self._b(x.pending_bytes))
                s.Add(act[gath] >= expr)
                s.Add(act_building[gath] >= expr)
                if made in act_made:
                    s.Add(act_made[made] >= expr)
                for j, u in enumerate(stages):
                    if zero_bubble and eligible[j]:
                        s.Add(act_building[gath] >= expr
                              + self.layer_sum([u], lambda x: self._b(x.weight_output_bytes)))
            for full, pend, extra, gath, made in every if not per_chunk else ():
                gath = gath if gathered_pp else None
                k, w = sum(full) / len(full), sum(pend) / len(pend)
                first = pend[0] / v if r == 0 else 0.0  # the first stage's share, held as full activations
                expr = (k + first) * full_sum + buffers(full, pend) + extra
                if w - first:
                    if pending_sum is None:
                        pending_sum = self.layer_sum(stages, lambda x: self._b(x.pending_bytes))
                    expr += (w - first) * pending_sum
                eligible = [f >= 1 and not (r == 0 and c == 0) for c, f in enumerate(full)]
                builds = zero_bubble and any(eligible)
                building = 0.0
                if builds:
                    if building_sum is None:
                        building_sum = self.layer_sum(stages, lambda x: self._b(x.weight_output_bytes))
                    building = building_sum / v
                for i, rr in d.fixed_rank.items():
                    if rr == r:
                        c = 0 if i in d.pre else len(full) - 1  # the embedding's chunk, the head's
                        own = r == 0 and c == 0  # in the first stage: pending as full
                        as_full = full[c] - k - first + (pend[c] if own else 0.0)
                        as_pending = (0.0 if own else pend[c]) - (w - first)
                        expr += sum((as_full * self._b(ev.cost(i, a).act_bytes)
                                     + as_pending * self._b(ev.cost(i, a).pending_bytes))
                                    * self.fixed_ac[i, a] for a in d.fixed_acs[i])
                        if builds:
                            building += sum((float(eligible[c]) - 1 / v) * self._b(ev.cost(i, a).weight_output_bytes)
                                            * self.fixed_ac[i, a] for a in d.fixed_acs[i])
                s.Add(act[gath] >= expr)
                s.Add(act_building[gath] >= expr + building)
                if made in act_made:
                    s.Add(act_made[made] >= expr)
            # the recomputation peak is the largest over the rank's layers (one per group of states)
            edges = [(ev.lg.layers[i].kind, ev.cost(i, AC.NONE).param_numel) for i in d.fixed_rank
                     if d.fixed_rank[i] == r]
            numel = [ev.cost(i, AC.NONE).param_numel for i in d.reps]
            # ...and as FSDP2 gathers them, padded (costmodel.estimate.Evaluator.gathered_numel)
            g_edges = [(ev.lg.layers[i].kind, ev.gathered_numel(ev.cost(i, AC.NONE))) for i in d.fixed_rank
                       if d.fixed_rank[i] == r]
            g_numel = [ev.gathered_numel(ev.cost(i, AC.NONE)) for i in d.reps]

            def held_layers(v, edges=edges, numel=numel):  # (kind, parameters) of the rank's layers
                return [("block", x) for x, n in zip(numel, v) for _ in range(n)] + edges

            def gathering(v, edges=g_edges, numel=g_numel):
                return held_layers(v, edges, numel)

            in_block = 0.0  # ZeRO-3 outside a pipeline (costmodel.memory.fsdp_gathered_bytes): what a block's
            # backward gathers (pipelined: per chunk, `two` and `roots` below)
            if cfg.zero == 3 and cfg.data_ranks > 1 and not gathered_pp:
                in_block = self.tab(r, lambda v: self._b(fsdp_gathered_bytes(cfg, gathering(v))))[0]
            # the head's gradient, where no other gradient is held yet; FSDP's gradient buffers of the block
            reduce = self.tab(r, lambda v: self._b(fsdp_reduce_bytes(cfg, held_layers(v), gathering(v))))[0] \
                if d.blocks else 0.0
            # FSDP's root parameter group in flight at the ends of a micro-batch, with the after-backward moment's
            fsdp_edge, _, edge_hi = self.tab(r, lambda v: self._b(fsdp_edge_bytes(cfg, gathering(v), d.m)))
            extra_b = self._b(head_grad_bytes(cfg, edges, d.m, r, d.ev.autocast)) + reduce
            extra_b += self._b(ev.tied_in_flight_bytes)  # (pp = 1: a rank with blocks)
            # a block's backward comes after the head's: that micro-batch's head activations are gone; zero-bubble:
            # a block's input pass runs with the head's activations still held and the weight ops' gradients built
            # on top (`act_building`); the head's own backward before them (`act`)
            head_act = 0.0 if zero_bubble else sum(
                self._b(ev.cost(i, a).act_bytes) * self.fixed_ac[i, a] for i, rr in d.fixed_rank.items()
                if rr == r and ev.lg.layers[i].kind == "head" for a in d.fixed_acs[i])
            # each block choice's working set and, for a chunk's lowest block (pipelined ZeRO 3), with its own
            # activations (the chunk's others freed; an input pass frees none), as expressions in its indicator
            work = []
            cast_work = []  # (autocast, `holds`) each block choice's working set less its `cast_grad_excess`, its
            # indicator (None: always held)
            for k, i in enumerate(d.reps):
                for a in d.acs[k]:
                    u = self.uses_ac[r, k, a] = s.BoolVar(f"uses_ac[{r},{k},{a.value}]")
                    for c in stages:
                        s.Add(self.blocks[c, k, a] <= d.counts[k] * u)
                    w = self._b(ev.cost(i, a).backward_peak_bytes)
                    work.append((w * u, (w + (0.0 if zero_bubble else self._b(ev.cost(i, a).act_bytes))) * u))
                    cast_work.append((w - self._b(ev.cast_grad_excess(ev.cost(i, a))), u))
            root = fsdp_root_bytes(cfg, gathering(d.vectors(r)[0]))  # (ZeRO-3 outside a pipeline)
            # pipelined ZeRO 3 (costmodel.memory.fsdp_chunk_gathered): the rank's largest block, prefetched at the
            # head's backward, as a one-hot over its count vectors (`tab`)
            largest = self.tab(r, lambda v: self._b(gathered_pp * max(
                (n for kind, n in gathering(v) if kind == "block"), default=0.0)))[0] if gathered_pp else 0.0
            # one block's reduce-scatter input in flight at the embedding's backward (ZeRO 2/3 outside a pipeline)
            reducing = self.tab(r, lambda v: self._b(fsdp_reduce_in_flight_bytes(cfg, gathering(v))))[0]
            edge_moments = []  # the embedding's and head's: (chunk, with it gathered at the state, without)
            embeds = []  # the embedding's: (chunk, its moments), for the 16-bit weight gradients held beside them
            roots = []  # each chunk's root unit (its layers other than blocks), gathered
            for u in stages:
                fixed = [ev.cost(j, AC.NONE) for j in _fixed_on_stage(d, u) if ev.lg.layers[j].kind != "block"]
                roots.append(self._b(gathered_pp * sum(ev.gathered_numel(c) for c in fixed)))
            for i, rr in d.fixed_rank.items():
                if rr != r:
                    continue
                (u,) = [c for c in stages if i in _fixed_on_stage(d, c)]
                if ev.lg.layers[i].kind == "block":  # a block of another kind beside the embedding or the head
                    work.append(tuple(sum(self._b(ev.cost(i, a).backward_peak_bytes + (
                        0.0 if zero_bubble or lowest_only else ev.cost(i, a).act_bytes)) * self.fixed_ac[i, a]
                        for a in d.fixed_acs[i]) for lowest_only in (True, False)))
                    cast_work.append((sum(self._b(ev.cost(i, a).backward_peak_bytes - ev.cast_grad_excess(
                        ev.cost(i, a))) * self.fixed_ac[i, a] for a in d.fixed_acs[i]), None))
                    continue
                freed = 0.0
                if ev.lg.layers[i].kind == "embed":  # the lowest block's reduction beside it (outside a pipeline)
                    freed -= reducing
                    if not zero_bubble:  # its chunk's last backward: the micro-batch's other activations there freed
                        # (`costmodel.estimate.Evaluator._freed_before`)
                        mine = sum(self._b(ev.cost(i, a).act_bytes) * self.fixed_ac[i, a] for a in d.fixed_acs[i])
                        freed += self.layer_sum([u], lambda x: self._b(x.act_bytes)) - mine
                j = stages.index(u)

                def moments(root_bytes, i=i, freed=freed):  # edge_moments as expressions in its checkpointing
                    per = [ev.edge_moments(i, a, root_bytes) for a in d.fixed_acs[i]]
                    return [sum(self._b(m[n]) * self.fixed_ac[i, a] for m, a in zip(per, d.fixed_acs[i]))
                            - freed for n in range(len(per[0]))]
                gathered = bare = moments(root)
                if gathered_pp:  # the chunk's gathering is on the backward (`fsdp_chunk_gathered`): the head's
                    # root, a constant, inside its moments (its copy-out's is 2 × root); an expression (the whole
                    # chunk, the largest block's buffer) added to its weights' moment, the only one it enters
                    kind = ev.lg.layers[i].kind
                    held_here, prefetch = fsdp_chunk_gathered(kind, each[j][1], roots[j], largest)
                    bare = moments(held_here * d.mem_unit if kind == "head" else 0.0)
                    bare[1] = bare[1] + prefetch + (0.0 if kind == "head" else held_here)
                edge_moments.append((j, gathered, bare))
                if ev.lg.layers[i].kind == "embed":
                    embeds.append((j, bare))
            lowest, copy_out = [], []  # pipelined ZeRO 3: each chunk's lowest block's backward, the chunk gathered
            # whole; the root's copy-out where a chunk has no head (`costmodel.estimate.Evaluator._rank_memory`);
            # each chunk's top block's, with its root and the rank's two largest blocks
            two = 0.0
            if gathered_pp and work:
                two = self.tab(r, lambda v: self._b(fsdp_gathered_bytes(
                    cfg, [(kind, n) for kind, n in gathering(v) if kind == "block"])))[0]
                for j, u in enumerate(stages):
                    acts = 0.0 if zero_bubble else sum(
                        (self._b(ev.cost(i, a).act_bytes) * self.blocks[u, k, a] for k, i in enumerate(d.reps)
                         for a in d.acs[k]), self.zero) + sum(
                        self._b(ev.cost(i, a).act_bytes) * self.fixed_ac[i, a] for i in _fixed_on_stage(d, u)
                        if ev.lg.layers[i].kind == "block" for a in d.fixed_acs[i])
                    lowest.append((j, acts, each[j][1]))
                    heads = any(ev.lg.layers[i].kind == "head" for i in _fixed_on_stage(d, u))
                    if not heads and roots[j]:
                        copy_out.append((j, two + 2 * roots[j]))
            tops = []  # per group of states: its heaviest state with the moments it leaves
            for gath in groups:
                peak = s.NumVar(0, self.inf, f"rec_peak[{r},{gath}]")
                self.rec_peak[r, gath] = peak
                block_peak = s.NumVar(0, self.inf, f"block_peak[{r},{gath}]") if zero_bubble else peak

                def beyond(j, need, gath=gath):  # a chunk gathered whole at the state holds what a moment needs
                    return need * (1 - gath[j])  # (pipelined ZeRO 3 only: `lowest` and `copy_out` are empty else)
                for w, w_low in work:
                    if gath is None:
                        s.Add(block_peak >= w + in_block + extra_b - head_act)
                        continue
                    for j, acts, whole in lowest:
                        s.Add(block_peak >= w + beyond(j, two + roots[j]) + extra_b - head_act)
                        s.Add(block_peak >= w_low - acts + beyond(j, whole) + extra_b - head_act)
                for j, gathering_j in copy_out:
                    s.Add(block_peak >= beyond(j, gathering_j) + extra_b - head_act)
                for j, e_in, e_out in edge_moments:
                    for e in e_in if gath is not None and gath[j] else e_out:
                        s.Add(peak >= e)
                if zero_bubble:  # the larger of the two moments, as one bound on `peak`
                    s.Add(peak >= act_building[gath] - act[gath] + block_peak)
                tops.append(act[gath] + peak)
            if act_made:
                tops += self._held_cast_moments(r, stages, act_made, self.rec_peak[r, None], cast_work, embeds,
                                                extra_b - head_act)
            # the rank's states beyond the per-parameter ones (autocast's cache, FSDP's padding, ZeRO-1's partition)
            # (autocast's cached copies, `cast_cache_bytes`, depend on the layers' checkpointing: a sum over them)
            uneven = self.tab(r, lambda v, r=r: self._b(sum(ev.rank_state_extras(c := _rank_layer_costs(d, r, v)))
                                                        - ev.cast_cache_bytes(c)))[0]
            tied_cache = ev.cast_cache_bytes([])  # (a tied head's copy: pp = 1)
            cache = self.layer_sum(stages, lambda c, t=tied_cache: self._b(ev.cast_cache_bytes([c]) - t)) \
                + self._b(tied_cache)
            uneven += cache
            # ...of which autocast's copies are gone by the moment after the backward (`cache_after_backward`)
            uncached = self.zero if ev.cache_after_backward else cache
            # pipelined ZeRO 3: the gathered parameters' padding, all held after the backward
            padding = self.tab(r, lambda v, r=r: self._b(ev.gathered_padding_bytes(_rank_layer_costs(d, r, v))))[0]
            static_b = self._b(per_param) * params + uneven
            # expert shards beyond the held parameters (ZeRO 2/3 with expert parallelism), at both moments
            x_peak, x_after = sum(ev.peak_static_bytes(0.0, 1.0)[:3]), sum(ev.static_bytes(0.0, 1.0))
            x_at_peak = x_at_after = 0.0
            if x_after:
                x_at_peak = self.tab(r, lambda v, r=r, x=x_peak: self._b(x) * self._extra(r, v))[0]
                x_at_after = self.tab(r, lambda v, r=r, x=x_after: self._b(x) * self._extra(r, v))[0]
            static_b += x_at_peak
            # the TP sum's copy after the backward (`Evaluator.tp_partial_bucket`), whatever the compression
            tp_copy = {v: ev.tp_partial_bucket(_rank_layer_costs(d, r, v)) for v in d.vectors(r)}
            for k in d.grad_opts:
                kind, rank = parse_grad_compress(k)
                per, whole = ev.powersgd_memory(rank) if kind == "powersgd" else (0.0, 1.0)
                # PowerSGD's error feedback and low-rank factors, held step to step
                extra = self._b(per) * params if kind == "powersgd" and cfg.data_ranks > 1 else 0.0
                # the step's other peak, after the backward: every gradient and the reduction's copy of a bucket,
                # then the TP sum's
                copy, _, copy_hi = self.tab(r, lambda v, r=r, kind=kind, whole=whole, tp_copy=tp_copy: self._b(max(
                    dp_reduction_temp_bytes(cfg, kind, 4.0 * self._params(r, v), whole, ev.largest_bucket),
                    tp_copy[v])))
                moments = [(1 + FRAGMENTATION) * (static_b + top + extra) + reserve for top in tops]
                if after_backward > per_param or copy_hi > 0 or x_after > x_peak or d.pp > 1 or edge_hi > 0:
                    kept = sum(self._b(d.buffers[o, r][2]) * self.compress["pp", o] for o in d.pp_opts)  # (torch's)
                    moments.append((1 + FRAGMENTATION) * (self._b(after_backward) * params + x_at_after + copy + kept
                                                          + fsdp_edge + uneven - uncached + padding + extra)
                                   + reserve)
                for lhs in moments:
                    if len(d.grad_opts) == 1:
                        s.Add(lhs <= cap)
                    else:
                        big = 1e6  # memory in thousandths of the capacity: 1e6 is far above any rank's total
                        s.Add(lhs <= cap + big * (1 - self.compress["dp", k]))

    def _held_cast_moments(self, r: int, stages: list, act_made: dict, peak, cast_work: list, embeds: list,
                           beside) -> list:
        """Rank ``r``'s heaviest states where a pipelined backward under autocast holds the 16-bit weight gradients
        of the chunks a backward ran on already (`costmodel.estimate.Evaluator.autocast_held_bytes`), with their
        moments: per set of such chunks (``act_made``: its states' heaviest, keyed by `held_states`' ``made``), the
        group's own moments (``peak``) and, for each such chunk, a block's backward beside the head's and the
        blocks' excess (``cast_work``: each block choice's working set less its own excess, with its indicator;
        ``beside``: what every block moment adds), the embedding's (``embeds``: its chunk and moments) with all of
        them, and the cast-backs with all of them and an fp32 copy, the micro-batch's activations gone. Returns
        the states' totals, for `add_memory`'s ``tops``."""
        d, s, ev = self.d, self.solver, self.d.ev

        def chunk_sum(u, f):  # Σ over chunk u's layers of f(kind, cost), linear in the AC choices
            terms = [f("block", ev.cost(i, a)) * self.blocks[u, k, a] for k, i in enumerate(d.reps) for a in d.acs[k]]
            for i in _fixed_on_stage(d, u):
                terms += [f(ev.lg.layers[i].kind, ev.cost(i, a)) * self.fixed_ac[i, a] for a in d.fixed_acs[i]]
            return sum(terms, self.zero)

        every = [chunk_sum(u, lambda kind, c: self._b(AUTOCAST_COPY_BYTES * c.cast_numel)) for u in stages]
        above = [chunk_sum(u, lambda kind, c: self._b(AUTOCAST_COPY_BYTES * c.cast_numel if kind == "head" else
                                                      ev.cast_grad_excess(c) if kind == "block" else 0.0))
                 for u in stages]
        freed = [self.layer_sum([u], lambda c: self._b(c.act_bytes)) for u in stages]
        cast_back = self.tab(r, lambda v: self._b(4.0 * max(
            (c.cast_largest for c in _rank_layer_costs(d, r, v)), default=0.0)))[0]
        big = self._b(AUTOCAST_COPY_BYTES * sum(ev.cost(i, AC.NONE).cast_numel for i in range(len(ev.lg.layers))))
        totals = []
        for made, act in act_made.items():
            held = s.NumVar(0, self.inf, f"rec_peak_made[{r},{made}]")
            s.Add(held >= peak)
            for j in (j for j, m in enumerate(made) if m):
                for w, u in cast_work:  # (a choice the rank does not use, u = 0, bounds nothing)
                    s.Add(held >= (w if u is None else w * u - big * (1 - u)) + above[j] + beside)
                for _, moments in (e for e in embeds if e[0] == j):
                    for e in moments:
                        s.Add(held >= e + every[j])
                s.Add(held >= every[j] + cast_back - freed[j])
            totals.append(act + held)
        return totals

    # -- objective -------------------------------------------------------------------------------------------
    def add_objective(self) -> None:
        d = self.d
        total = sum((self.rank_time(r) for r in range(d.pp)), 0.0 * self.bottleneck)
        self.objective = (d.m - d.phi) * self.bottleneck + d.phi * total + self.finish
        self.solver.Minimize(self.objective)

    def add_cutoff(self, seconds: float) -> None:
        """Only plans with step ≤ ``seconds`` (the outer search's (top_k + 1)-th best known step): when none
        exists the solve is INFEASIBLE, which proves the candidate cannot matter; otherwise the optimum is kept."""
        self.solver.Add(self.objective <= self._t(seconds) * (1 + 1e-9))

    # -- hint, solve, decode ---------------------------------------------------------------------------------
    def hint(self, acs: list[AC], stage_of: list[int], grad: str, ppc: str) -> None:
        """A warm start from a plan; each layer's mode is read as the offered one that costs the same (a mode
        dropped as costing what another does, `ilp_data._distinct_acs`, is that other one)."""
        pairs = self._plan_values(acs, stage_of, grad, ppc)
        self.solver.SetHint([v for v, _ in pairs], [float(x) for _, x in pairs])

    def pin(self, acs: list[AC], stage_of: list[int], grad: str, ppc: str) -> None:
        """Fix the problem's decisions to a plan (as `hint` reads it): the solve then says whether that plan fits
        and costs what the ILP charges it, which tests hold equal to `costmodel.estimate.Evaluator`'s."""
        for v, x in self._plan_values(acs, stage_of, grad, ppc):
            v.SetBounds(float(x), float(x))

    def _plan_values(self, acs: list[AC], stage_of: list[int], grad: str, ppc: str) -> list[tuple]:
        """(variable, value) of every decision for a plan."""
        d, ev = self.d, self.d.ev

        def offered(i, modes):
            return next((a for a in modes if ev.cost(i, a) == ev.cost(i, acs[i])), None)

        unit_of = {c: u for u, stages in enumerate(d.units) for c in stages}
        count = Counter((unit_of[stage_of[i]], k, offered(i, d.acs[k])) for i, k in zip(d.blocks, d.kind_of))
        pairs = [(x, count[key]) for key, x in self.blocks.items()]
        held = [tuple(sum(1 for i, x in zip(d.blocks, d.kind_of) if x == k and stage_of[i] % d.pp == r)
                      for k in d.kinds) for r in range(d.pp)]
        pairs += [(x, 1.0 if _clip(held[r], cap) == key else 0.0) for (r, cap), onehot in self.onehots.items()
                  for key, x in onehot.items()]
        pairs += [(x, 1.0 if stage_of[d.blocks[j]] <= c else 0.0) for (c, j), x in self.before_var.items()]
        for i in d.pre + d.post:
            mode = offered(i, d.fixed_acs[i])
            pairs += [(self.fixed_ac[i, a], 1.0 if mode == a else 0.0) for a in d.fixed_acs[i]]
        pairs += [(self.compress["dp", k], 1.0 if k == grad else 0.0) for k in d.grad_opts]
        pairs += [(self.compress["pp", k], 1.0 if k == ppc else 0.0) for k in d.pp_opts]
        return pairs

    def warm_start(self, time_limit: float):
        """Blocks of several kinds that repeat a pattern (`ilp_data.pattern_cuts`): first solve with stages cut only
        where the pattern starts again (fewer splits: SCIP finds good plans there quickly), then hand that whole
        solution to the full problem as its start, with the restriction lifted. Return the restricted problem's
        plan and objective (seconds) as `decode` gives them, None when there was none."""
        d, s = self.d, self.solver
        allowed = pattern_cuts(d.kind_of, d.S) if d.cut else None
        if allowed is None:
            return None
        tied = [s.Add(x == self.before(c, j - 1)) for (c, j), x in self.before_var.items()
                if j not in allowed]  # no cut between blocks j − 1 and j
        if not tied:
            return None  # the pattern allows every split: nothing to start from
        code = self.solve(time_limit)
        out, hint = None, None
        if code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            variables = s.variables()
            hint = (variables, [v.solution_value() for v in variables])
            out = (self.decode(), s.Objective().Value() * d.time_unit)
        for con in tied:
            con.SetBounds(-self.inf, self.inf)
        if hint:  # (the released ties changed the model: the next solve starts over from it, with this start)
            s.SetHint(*hint)
        return out

    def solve(self, time_limit: float) -> int:
        self.solver.SetTimeLimit(max(1, int(time_limit * 1000)))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
        return self.solver.Solve(params)

    def decode(self) -> tuple[list[AC], list[int], str, str]:
        d = self.d
        n_layers = len(d.ev.lg.layers)
        acs: list[AC | None] = [None] * n_layers
        stage_of: list[int | None] = [None] * n_layers
        for i in d.pre + d.post:
            chosen = [a for a in d.fixed_acs[i] if self.fixed_ac[i, a].solution_value() > 0.5]
            assert len(chosen) == 1, f"layer {i}: {len(chosen)} AC modes chosen"
            acs[i] = chosen[0]
            stage_of[i] = 0 if i in d.pre else d.S - 1
        # blocks of several kinds: the cuts give each stage its blocks, and each kind's modes go to its blocks there
        # in order (most activations first: only the counts matter to the cost model)
        cfg = d.cfg
        if d.cut:
            ends = [0] + [sum(1 for j in range(d.nblocks) if _value(self.before(c, j)) > 0.5)
                          for c in range(d.S - 1)] + [d.nblocks]
            assert all(a < b for a, b in zip(ends, ends[1:])), "stages in order, none empty"
            for c in range(d.S):
                for k in d.kinds:
                    modes = [a for a in d.acs[k] for _ in range(round(self.blocks[c, k, a].solution_value()))]
                    mine = [d.blocks[j] for j in range(ends[c], ends[c + 1]) if d.kind_of[j] == k]
                    assert len(modes) == len(mine), f"stage {c}: its cuts and its counts of kind {k} agree"
                    for i, a in zip(mine, modes):
                        acs[i], stage_of[i] = a, c
        # one kind: a unit's blocks are split evenly over its stages, AC modes in order (most activations first) onto
        # the stages with the fewest micro-batches in flight first, which also take the extra ones: the rank then
        # holds no more than the ILP's average-weighted activations (rearrangement inequality). (Where the units are
        # stages, under ZeRO-3 or with vpp > 1, there is nothing to split.)
        else:
            per_stage: dict[int, list[AC]] = {}
            for u, stages in enumerate(d.units):
                modes = [a for k in d.kinds for a in d.acs[k]
                         for _ in range(round(self.blocks[u, k, a].solution_value()))]
                base, extra = divmod(len(modes), len(stages))
                held = inflight_chunks(cfg.schedule, cfg.pp, cfg.vpp, stages[0] % d.pp, d.m)
                order = sorted(range(len(stages)), key=lambda j: (held[stages[j] // d.pp], j))
                k = 0
                for rank_in_order, j in enumerate(order):
                    take = base + (1 if rank_in_order < extra else 0)
                    per_stage[stages[j]], k = modes[k:k + take], k + take
            it = iter(d.blocks)
            for c in range(d.S):
                for a in per_stage.get(c, []):
                    i = next(it)
                    acs[i], stage_of[i] = a, c
            assert next(it, None) is None, "every block gets one stage"
        assert None not in acs and None not in stage_of, "every layer gets one AC and one stage"
        grad = [k for k in d.grad_opts if self.compress["dp", k].solution_value() > 0.5]
        ppc = [k for k in d.pp_opts if self.compress["pp", k].solution_value() > 0.5]
        assert len(grad) == 1 and len(ppc) == 1, "one compression per group"
        return acs, stage_of, grad[0], ppc[0]


def _value(x) -> float:
    """A solved variable's value, or the constant itself."""
    return x if isinstance(x, float) else x.solution_value()


def _clip(v: tuple, cap: int | None) -> tuple:
    return v if cap is None else tuple(min(n, cap) for n in v)


def _create_solver(backend: str | None):
    for name in ([backend] if backend else BACKENDS):
        solver = pywraplp.Solver.CreateSolver(name)
        if solver is not None:
            return solver, name
    raise RuntimeError(f"no MIP backend available in OR-Tools (tried {', '.join(BACKENDS)})")


_STATUS = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
           pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
           pywraplp.Solver.ABNORMAL: "ABNORMAL", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED"}


def usual_ac(acs, blocks) -> AC:
    """The blocks' most common AC mode (ties: the first in AC_ORDER): the configuration's ``ac``."""
    pool = [acs[i] for i in blocks] or list(acs)
    return max(AC_ORDER, key=lambda a: (pool.count(a), -AC_ORDER.index(a)))


def greedy(d: Data) -> tuple[list[AC], list[int]]:
    """Even stages (Megatron's split) with the least recomputation that fits, uniform over the layers."""
    from costmodel.estimate import even_stages

    stage_of = even_stages(d.ev.lg, d.S) if d.blocks else [0] * len(d.ev.lg.layers)
    for a in d.modes:
        acs = [a] * len(stage_of)
        if d.ev.evaluate(acs, stage_of).fits:
            return acs, stage_of
    return [d.modes[-1]] * len(stage_of), stage_of


def solve(lg: LayerGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *, time_limit: float = 10.0,
          acs=AC_ORDER, grad_opts=None, pp_opts=None, backend: str | None = None, cost_cache=None,
          cutoff: float | None = None, policy: str = "none") -> Solution:
    """Solve the inner problem of ``cfg`` (its compression and ac fields are ignored: chosen here, within
    ``acs``/``grad_opts``/``pp_opts``, by default those the compression ``policy`` allows). Raise `Infeasible`
    when nothing fits."""
    t0 = time.perf_counter()
    d = build_data(lg, cluster, cfg, global_batch, acs=acs, grad_opts=grad_opts, pp_opts=pp_opts,
                   cost_cache=cost_cache, policy=policy)
    model = Model(d, backend)
    h_acs, h_stage = greedy(d)
    model.hint(h_acs, h_stage, "none" if "none" in d.grad_opts else d.grad_opts[0],
               "none" if "none" in d.pp_opts else d.pp_opts[0])
    if cutoff is not None:
        model.add_cutoff(cutoff)
    first = model.warm_start(time_limit / 2)
    code = model.solve(time_limit - (time.perf_counter() - t0))
    if code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        acs_out, stage_of, grad, ppc = model.decode()
        objective = model.solver.Objective().Value() * d.time_unit
        bound = model.solver.Objective().BestBound() * d.time_unit
        if first and first[1] < objective and code != pywraplp.Solver.OPTIMAL:
            # the solver set the warm start's plan aside (tolerances) and found a worse one in time: keep it
            (acs_out, stage_of, grad, ppc), objective = first
    elif first:  # out of time before the warm start's plan was even taken back: that plan, proved nothing of
        (acs_out, stage_of, grad, ppc), objective = first
        code, bound = pywraplp.Solver.FEASIBLE, 0.0
    status = _STATUS.get(code, str(code))
    if code not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if cutoff is not None and code == pywraplp.Solver.INFEASIBLE:
            raise CutOff(status, time.perf_counter() - t0)
        raise Infeasible(status, time.perf_counter() - t0)
    final = replace(cfg, grad_compress=grad, pp_compress=ppc, ac=usual_ac(acs_out, d.blocks))
    est = Evaluator(lg, cluster, final, global_batch, cache=cost_cache).evaluate(acs_out, stage_of)
    # the consistency proof: the linearisation is the cost model. At a solution the time limit stopped short of
    # optimal, an epigraph variable (an exposed part's max(0, ·)) may sit above its value: the objective is then an
    # upper bound of the plan's step, never below it
    slack = AGREEMENT * est.step_time_s + 1e-12
    assert (abs(objective - est.step_time_s) <= slack if code == pywraplp.Solver.OPTIMAL
            else objective >= est.step_time_s - slack), (
        f"ILP objective {objective!r} != Evaluator.evaluate {est.step_time_s!r} for {final} ({status})")
    assert est.fits, f"decoded plan does not fit: {est.memory.peak} > {est.capacity_bytes}"
    validate(stage_of, d.S)
    bound = min(max(bound, 0.0), est.step_time_s)  # (SCIP's dual bound is -1e20 where it has none yet)
    gap = max(0.0, (est.step_time_s - bound) / est.step_time_s)
    return Solution(config=final, acs=tuple(acs_out), stage_of=tuple(stage_of), estimate=est, status=status,
                    objective=est.step_time_s, bound=bound, gap=gap, time_s=time.perf_counter() - t0,
                    backend=model.backend)


def validate(stage_of, n_stages: int) -> None:
    """Contiguous, non-decreasing stages covering 0..n_stages-1."""
    assert list(stage_of) == sorted(stage_of), "stages are contiguous"
    assert set(stage_of) == set(range(n_stages)), "every stage holds a layer"
