"""Check deep plans fast: trace a plan with fewer blocks and micro-batches and extrapolate each rank's figures to
the real depth, as `profiler.fold` does for a capture.

A model's blocks are alike (same shapes: `profiler.fold` requires it of every model it captures at depth), and a
plan treats consecutive blocks of a chunk (a pipeline stage, or a virtual stage when interleaved) alike unless it
gives them different activation checkpointing or tensor-parallel choices: a chunk is a sequence of *runs* of like
blocks. What a rank traces (each memory category at its maximum, collective bytes and counts, FLOPs, gradient
elements) grows by the same amount with each block a run holds. So does the memory at each *place* of the step
(`planner.check.trace._CategoryPeaks.moments`: a schedule action or micro-batch, and the block or module running):

- trace A gives each run it folds ``FOLD_BLOCKS`` of its ``L`` blocks, and every other run all of its blocks;
  trace ``B_j`` gives the ``j``-th folded run of each rank one block more; each block keeps its run's choices.
  A run of at most ``FOLD_BLOCKS + 1`` blocks is never folded; a longer one is folded when that makes the check
  faster: each folded run costs a trace of its own, so a short run in a plan with another to fold is often
  quicker traced whole (`choose_folds`, from `trace_cost` and the cores the traces share);
- a figure ``f`` at the real depth is ``A + Σ_j (L_j − FOLD_BLOCKS) · (B_j − A)``;
- one count is not linear in the depth: the data-parallel reduction's gradient buckets (DDP's, and the runtime's
  post-step ones, `planner.emit.train.allreduce_grads`) close at a byte cap, not at a block's end, so their number
  at the real depth can differ from the extrapolated one by the buckets a boundary moves across (its bytes are
  exact, and the cost model prices the reduction by its bytes);
- the peak is the highest place, each place on its own line: where a rank peaks can move with the depth (at three
  blocks the head's backward, with a big vocabulary, at eighty the first block's, with every gradient). A place in
  a block is named by the block's run and its position from the run's nearer end (`_places`);
- with pp = 1 and more micro-batches than `micro_batches_traced`, each trace runs that many (the first, one in the
  middle and the last; under ZeRO-3 the first and the last) and counts the second as many times as the step has
  the micro-batches it stands for (`planner.check.trace.trace_rank`). A pipeline runs all of its micro-batches
  (the schedule's in-flight counts depend on them).

Where a place that sets the peak in a folded trace has no counterpart in another (it cannot be followed), the rank is
traced whole. So is a model whose depth cannot be changed (a user's file). ``tests/test_check.py`` checks folded
against whole traces; ZeRO-1's optimizer shards are the one figure that is not exact (torch's
ZeroRedundancyOptimizer gives whole parameters to ranks greedily, not a fixed share per block: 0.2 % of the peak on
an 8-block model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from planner.check.record import Trace, memory_parts
from planner.plan import LayerStrategy, Plan, StageInfo
from profiler.api import block_count, with_blocks
from profiler.zoo.registry import resolve_model

FOLD_BLOCKS = 3  #: blocks of a run in trace A: its second block is then one in the middle (`_EDGE`)

#: a trace's fixed part (its process, model, sharding, optimizer state and step outside the blocks) in the unit of
#: `trace_cost`, one block's forward and backward for one micro-batch: about 0.8-1.0 s against 0.12-0.15 s
#: (llama3-70b's blocks, this 2-core machine, 1 to 11 blocks × 1 to 3 micro-batches). On fake tensors an operator
#: costs its dispatch, not its size, so the ratio holds for any transformer's blocks.
TRACE_START = 8


def micro_batches_traced(zero: int) -> int:
    """How many micro-batches a pp = 1 trace runs to stand for a step of more (`planner.check.trace.trace_rank`):
    the first (it creates the gradients), one in the middle and the last, which alone synchronises DDP's gradients
    and reshards ZeRO-2's parameters (`planner.emit.train._accumulate`). Under ZeRO-3 every micro-batch after the
    first runs what the last runs (FSDP2 reduce-scatters each one), so the first and the last."""
    return 2 if zero == 3 else 3


def trace_cost(blocks: int, micro_batches: int) -> int:
    """What a trace of ``blocks`` blocks and ``micro_batches`` micro-batches costs, in blocks × micro-batches
    (`TRACE_START`)."""
    return TRACE_START + blocks * micro_batches


def makespan(costs: list[int], cores: int) -> float:
    """When the last of traces costing ``costs`` ends, all started at once on ``cores`` cores
    (`planner.check.tracers.Tracers` runs them side by side, the operating system sharing the cores): the later of
    their total over the cores and the longest one. Three traces on two cores end sooner so than two at a time and
    then the third (llama3-70b's check: 5.1 s against 6.9 s)."""
    return max(sum(costs) / max(1, cores), max(costs, default=0))


@dataclass(frozen=True)
class Folding:
    """How a plan is traced folded: the shallower plans and models, and what each run of like blocks holds."""

    plans: tuple[Plan, ...]  #: A, then B_1, B_2, …
    sources: tuple  #: their models (`profiler.zoo.registry.ModelSource`)
    micro_batches: int | None  #: the real count where fewer are traced (pp = 1), else None
    micro_traced: int  #: micro-batches each trace runs
    runs: dict[int, list[int]]  #: chunk (stage index) → its runs' real lengths, in order
    traced: tuple[dict[int, list[int]], ...]  #: per trace, chunk → its runs' traced lengths
    varied: tuple[dict[int, tuple[int, int]], ...]  #: per trace B_j, pipeline rank → (chunk, run) it lengthens
    rank_of: dict[int, int]  #: chunk → the pipeline rank that runs it
    container: str  #: the block list's name (``layers``)

    def describe(self) -> str:
        real = sum(sum(r) for r in self.runs.values())
        shallow = [sum(sum(r) for r in t.values()) for t in self.traced]
        text = (f"traced at {' and '.join(map(str, shallow))} of {real} blocks (runs of like blocks extrapolated)"
                if shallow[0] != real else "traced at full depth")
        if self.micro_batches:
            text += (f"; {self.micro_traced} of {self.micro_batches} micro-batches traced, the "
                     f"{'last' if self.micro_traced == 2 else 'middle'} one repeated")
        return text

    def blocks_traced(self, pp_rank: int) -> list[int]:
        """Blocks of ``pp_rank``'s chunks in each trace."""
        mine = [c for c, r in self.rank_of.items() if r == pp_rank]
        return [sum(sum(t[c]) for c in mine) for t in self.traced]


def fold_plan(plan: Plan, cores: int = 1) -> Folding | None:
    """The folding of ``plan`` (see the module docstring) whose traces end soonest on ``cores`` cores, or None when
    it is traced whole."""
    c = plan.config
    source = resolve_model(plan.model).with_seq(plan.seq)
    blocks = [lay for lay in plan.layers if lay.name not in ("embed", "head")]
    if not blocks or block_count(source) != len(blocks):
        return None
    container = blocks[0].name.rpartition(".")[0]
    chunks: dict[int, list[list[LayerStrategy]]] = {}  # chunk → runs of like blocks
    for lay in blocks:
        runs = chunks.setdefault(lay.stage, [])
        if runs and (runs[-1][0].ac, runs[-1][0].tp) == (lay.ac, lay.tp):
            runs[-1].append(lay)
        else:
            runs.append([lay])
    if plan.stages and c.pp > 1:
        rank_of = {s.index: s.rank for s in plan.stages}
    else:
        rank_of = {s: s % c.pp for s in range(c.pp * c.vpp)}
    lengths = {stage: [len(run) for run in runs] for stage, runs in chunks.items()}
    micro = plan.grad_accum if c.pp == 1 and plan.grad_accum > micro_batches_traced(c.zero) else None
    per_trace = micro_batches_traced(c.zero) if micro else plan.grad_accum
    folds = choose_folds(lengths, rank_of, per_trace, cores)  # pipeline rank → the (chunk, run)s it folds
    if not any(folds.values()) and not micro:
        return None
    base = {stage: [FOLD_BLOCKS if (stage, k) in folds[rank_of[stage]] else n for k, n in enumerate(ns)]
            for stage, ns in lengths.items()}
    batch = c.dp * c.mbs * per_trace if micro else plan.global_batch
    traced, varied = [base], []
    for j in range(max(map(len, folds.values()), default=0)):
        counts = {stage: list(ns) for stage, ns in base.items()}
        chosen = {}
        for rank, runs in folds.items():
            if j < len(runs):
                stage, k = runs[j]
                counts[stage][k] = FOLD_BLOCKS + 1
                chosen[rank] = (stage, k)
        traced.append(counts)
        varied.append(chosen)
    plans, sources = [], []
    for counts in traced:
        shallow = with_blocks(source, sum(sum(ns) for ns in counts.values()))
        if shallow is None:
            return None
        plans.append(_shallow_plan(plan, chunks, counts, container, batch))
        sources.append(shallow)
    return Folding(tuple(plans), tuple(sources), micro, per_trace, lengths, tuple(traced), tuple(varied), rank_of,
                   container)


def choose_folds(lengths: dict[int, list[int]], rank_of: dict[int, int], micro_batches: int,
                 cores: int) -> dict[int, list[tuple[int, int]]]:
    """Per pipeline rank, the runs it folds (chunk, run index; in order), among those longer than
    ``FOLD_BLOCKS + 1`` (``lengths``: chunk → its runs' lengths): those for which its traces (A and a B per folded
    run, ``micro_batches`` each) end soonest, all ranks' traces sharing ``cores`` cores (`makespan`), and then cost
    least in all. Each rank's choice is tried whole against the others' (a rank rarely has more than two runs)."""
    ranks = sorted(set(rank_of.values()))
    long = {r: [(stage, k) for stage in sorted(lengths) if rank_of[stage] == r
                for k, n in enumerate(lengths[stage]) if n > FOLD_BLOCKS + 1] for r in ranks}
    whole = {r: sum(sum(ns) for stage, ns in lengths.items() if rank_of[stage] == r) for r in ranks}

    def jobs(r: int, folded: tuple) -> list[int]:
        blocks = whole[r] - sum(lengths[stage][k] - FOLD_BLOCKS for stage, k in folded)
        return [trace_cost(blocks, micro_batches)] + [trace_cost(blocks + 1, micro_batches)] * len(folded)

    def score(choice: dict) -> tuple[float, int]:
        costs = [cost for r in ranks for cost in jobs(r, choice[r])]
        return makespan(costs, cores), sum(costs)

    def subsets(runs: list) -> list[tuple]:
        if len(runs) > 8:  # (never met: 256 choices per rank at most; beyond, fold them all)
            return [tuple(runs)]
        return [tuple(run for i, run in enumerate(runs) if mask >> i & 1) for mask in range(1 << len(runs))]

    choice = {r: tuple(long[r]) for r in ranks}  # everything folded: the fewest blocks
    best = score(choice)
    improved = True
    while improved:
        improved = False
        for r in ranks:
            for option in subsets(long[r]):
                trial = choice | {r: option}
                if (got := score(trial)) < best:
                    choice, best, improved = trial, got, True
    return {r: list(choice[r]) for r in ranks}


def _shallow_plan(plan: Plan, chunks: dict[int, list[list[LayerStrategy]]], counts: dict[int, list[int]],
                  container: str, batch: int) -> Plan:
    """``plan`` with ``counts[stage][k]`` blocks in run ``k`` of each chunk (renumbered from 0), each as the run's
    blocks are."""
    by_name = {lay.name: lay for lay in plan.layers}
    layers = [by_name["embed"]]
    for stage in sorted(chunks):
        for run, n in zip(chunks[stage], counts[stage]):
            for _ in range(n):
                layers.append(replace(run[0], name=f"{container}.{len(layers) - 1}"))
    layers.append(by_name["head"])
    stages = []
    for s in plan.stages:
        mine = [i for i, lay in enumerate(layers) if lay.stage == s.index]
        stages.append(StageInfo(index=s.index, rank=s.rank, first=mine[0], last=mine[-1]) if mine else s)
    return plan.with_(layers=tuple(layers), stages=tuple(stages), global_batch=batch)


def traces_for(folding: Folding, pp_rank: int) -> list[int]:
    """The traces ``pp_rank`` needs: A, and each B_j that lengthens one of its runs."""
    return [0] + [1 + j for j, chosen in enumerate(folding.varied) if pp_rank in chosen]


def extrapolate(folding: Folding, pp_rank: int, traces: dict[int, Trace]) -> Trace | None:
    """The rank's figures at the real depth from its traces (``traces_for``: index → trace), or None when a place
    where one of them peaks has no counterpart in the others (the rank must then be traced whole)."""
    which = traces_for(folding, pp_rank)
    used = [traces[w] for w in which]
    if len(used) == 1:
        return used[0]
    lengthened = [folding.varied[w - 1][pp_rank] for w in which[1:]]
    ts = [folding.runs[stage][k] - FOLD_BLOCKS for stage, k in lengthened]

    def line(values: list[float]) -> float:
        return values[0] + sum(t * (v - values[0]) for t, v in zip(ts, values[1:]))

    places = [_places(traces[w].moments, folding.traced[w], folding) for w in which]
    common = [key for key in places[0] if all(key in pl for pl in places[1:])]
    for tr, pl in zip(used, places):
        if any(value[0] >= tr.memory["peak"] and key not in common for key, value in pl.items()):
            return None
    peak, place = max((line([pl[key][0] for pl in places]), key) for key in common)
    names = {name for pl in places for name in pl[place][1]}
    at_peak = {name: line([pl[place][1].get(name, 0) for pl in places]) for name in names}

    def most(name: str) -> float:  # a category's maximum: the highest place, each on its line
        return max(line([pl[key][2].get(name, 0) for pl in places]) for key in common)

    memory = memory_parts(most) | {"peak": peak}
    collectives = {}
    for key in {k for tr in used for k in tr.collectives}:
        got = [tr.collectives.get(key, {}) for tr in used]
        collectives[key] = {"count": round(line([g.get("count", 0) for g in got])),
                            "bytes": line([g.get("bytes", 0) for g in got])}
    return replace(used[0], memory=memory, collectives=collectives, flops=line([tr.flops for tr in used]),
                   grad_elements=line([tr.grad_elements for tr in used]),
                   dp_reduced_elements=line([tr.dp_reduced_elements for tr in used]), memory_at_peak=at_peak,
                   peak_at=_real_place(place, folding), moments={})


#: how far from either end of a run a block's places are followed. What is held while a block runs depends on its
#: neighbours (FSDP2 prefetches the next block's parameters and keeps the previous one's reduce-scatter input,
#: torch 2.13), so a run's first and last blocks are each unlike the others, and every block in between is alike
#: except for where it stands: its memory grows or falls by the same amount from one block to the next, so over
#: the middle it is highest next to an end. The second and the one before the last block are followed: in a run
#: of FOLD_BLOCKS = 3 they are the same block
_EDGE = 2
_STAGE = re.compile(r"\bof stage (\d+)\b")


def _places(moments: dict, counts: dict[int, list[int]], folding: Folding) -> dict:
    """A trace's places keyed by where they are in their chunk's runs (``counts``: chunk → traced run lengths):
    ``layers.r0+0`` the first block of run 0, ``layers.r0-0`` its last, ``+1`` the second, ``-1`` the one before the
    last (a block can be both); blocks further than `_EDGE` from both ends of their run are not kept. The chunk is
    the stage of the place's schedule action (one chunk without a pipeline). Each place keeps its highest total and
    the categories then."""
    pattern = re.compile(rf"\b{re.escape(folding.container)}\.(\d+)\b")
    out: dict = {}
    for where, value in moments.items():
        match = pattern.search(where)
        stage = _STAGE.search(where)
        chunk = int(stage.group(1)) if stage else (0 if len(counts) == 1 else None)
        if not match or chunk not in counts:
            out[where] = value
            continue
        i, run, runs = int(match.group(1)), 0, counts[chunk]
        while run < len(runs) and i >= runs[run]:  # the run holding the block, and the block's index in it
            i -= runs[run]
            run += 1
        if run == len(runs):
            out[where] = value
            continue
        k = runs[run]
        for key, near in ((f"+{i}", i < _EDGE), (f"-{k - 1 - i}", k - 1 - i < _EDGE)):
            if near:
                out[pattern.sub(f"{folding.container}.c{chunk}r{run}{key}", where, count=1)] = value
    return out


def _real_place(place: str, folding: Folding) -> str:
    """A place named by `_places` in the real plan (run 1's ``-1`` of a chunk whose runs hold 4 and 122 blocks →
    block 124 of the chunk)."""
    def index(match):
        chunk, run, sign, d = int(match.group(1)), int(match.group(2)), match.group(3), int(match.group(4))
        start = sum(folding.runs[chunk][:run])
        return f"{folding.container}.{start + d if sign == '+' else start + folding.runs[chunk][run] - 1 - d}"

    return re.sub(rf"\b{re.escape(folding.container)}\.c(\d+)r(\d+)([+-])(\d+)\b", index, place)
