"""Check deep plans fast: trace a plan with fewer blocks and micro-batches, twice, and extrapolate each rank's
figures to the real depth, as `profiler.fold` does for a capture.

A plan's blocks are alike (same shapes, same sharding, same collectives: `profiler.fold` requires it of every model
it captures at depth), and every micro-batch in the middle of a step does the same thing. So each figure a rank
traces (every memory category at its maximum, the peak, collective bytes and counts, FLOPs, gradient elements)
grows by the same amount with each block its pipeline chunks hold, as long as the moment of the peak stays at the
same place: the last block's backward, say, or the head's. Two traces tell the amount:

- trace A gives every chunk (pipeline stage, or virtual stage when interleaved) ``min(n, FOLD_BLOCKS)`` of its
  ``n`` blocks, trace B one more (``min(n, FOLD_BLOCKS + 1)``), each block with the plan's activation
  checkpointing and tensor-parallel choice for that chunk;
- a rank whose chunks hold ``n`` blocks each is credited ``A + (n − FOLD_BLOCKS) · (B − A)``;
- with pp = 1 and more than `MICRO_BATCHES` micro-batches, both trace three (the first, one in the middle and the
  last) and count the middle one as many times as the step has (`planner.check.trace.trace_rank`). A pipeline runs
  all of its micro-batches (the schedule's in-flight counts depend on them).

Folding is exact where its assumptions hold, and it checks the one that could fail: if the peak of A and of B fall
at different places (the first block in one and the last in the other, or a block in the middle), the rank is
traced again at its full depth. A plan is not folded when a chunk mixes activation checkpointing or tensor-parallel
choices, when a rank's chunks hold different numbers of blocks (interleaving), or when the model's depth cannot be
changed (a user's file): it is traced whole. ``tests/test_check.py`` checks folded against whole traces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from planner.check.trace import Trace
from planner.plan import LayerStrategy, Plan, StageInfo
from profiler.api import block_count, with_blocks
from profiler.zoo.registry import resolve_model

FOLD_BLOCKS = 3  #: blocks per chunk in the first trace: the second block is then a block in the middle (`_EDGE`)
MICRO_BATCHES = 3  #: the first, one in the middle, the last


@dataclass(frozen=True)
class Folding:
    """How a plan is traced folded: the two shallower plans and models, and what each rank extrapolates."""

    plans: tuple[Plan, Plan]  #: A and B (the same plan twice when only micro-batches are folded)
    sources: tuple  #: their models (`profiler.zoo.registry.ModelSource`)
    micro_batches: int | None  #: the real count where fewer are traced (pp = 1), else None
    depth: dict[int, tuple[int, int, int]]  #: pipeline rank → (blocks per chunk: real, in A, in B)
    container: str  #: the block list's name (``layers``)

    def describe(self) -> str:
        real = sorted({d[0] for d in self.depth.values()})
        a = sorted({d[1] for d in self.depth.values()})
        b = sorted({d[2] for d in self.depth.values()})
        text = (f"traced at {'/'.join(map(str, a))} and {'/'.join(map(str, b))} blocks per chunk, extrapolated to "
                f"{'/'.join(map(str, real))}") if a != real else "traced at full depth"
        if self.micro_batches:
            text += f"; {MICRO_BATCHES} of {self.micro_batches} micro-batches traced, the middle one repeated"
        return text


def fold_plan(plan: Plan) -> Folding | None:
    """The folding of ``plan`` (see the module docstring), or None when it is traced whole."""
    c = plan.config
    source = resolve_model(plan.model).with_seq(plan.seq)
    blocks = [lay for lay in plan.layers if lay.name not in ("embed", "head")]
    if not blocks or block_count(source) != len(blocks):
        return None
    container = blocks[0].name.rpartition(".")[0]
    chunks: dict[int, list[LayerStrategy]] = {}
    for lay in blocks:
        chunks.setdefault(lay.stage, []).append(lay)
    if any(len({(lay.ac, lay.tp) for lay in chunk}) > 1 for chunk in chunks.values()):
        return None  # a chunk mixing choices: where its blocks of each kind sit decides the peak
    if plan.stages and c.pp > 1:
        rank_of = {s.index: s.rank for s in plan.stages}
    else:
        rank_of = {s: s % c.pp for s in range(c.pp * c.vpp)}
    depth: dict[int, tuple[int, int, int]] = {}
    for stage, chunk in chunks.items():
        n = len(chunk)
        entry = (n, min(n, FOLD_BLOCKS), min(n, FOLD_BLOCKS + 1))
        if depth.setdefault(rank_of[stage], entry) != entry:
            return None  # a rank whose chunks differ in depth: each would need its own trace
    folds_blocks = any(n > b for n, _, b in depth.values())
    micro = plan.grad_accum if c.pp == 1 and plan.grad_accum > MICRO_BATCHES else None
    if not folds_blocks and not micro:
        return None
    batch = c.dp * c.mbs * MICRO_BATCHES if micro else plan.global_batch
    if not folds_blocks:
        return Folding((plan.with_(global_batch=batch),) * 2, (source, source), micro, depth, container)
    plans, sources = [], []
    for which in (1, 2):
        counts = {stage: depth[rank_of[stage]][which] for stage in chunks}
        shallow = with_blocks(source, sum(counts.values()))
        if shallow is None:
            return None
        plans.append(_shallow_plan(plan, chunks, counts, container, batch))
        sources.append(shallow)
    return Folding(tuple(plans), tuple(sources), micro, depth, container)


def _shallow_plan(plan: Plan, chunks: dict[int, list[LayerStrategy]], counts: dict[int, int], container: str,
                  batch: int) -> Plan:
    """``plan`` with ``counts[stage]`` blocks in each chunk (renumbered from 0), each as the chunk's blocks are."""
    by_name = {lay.name: lay for lay in plan.layers}
    layers = [by_name["embed"]]
    for stage in sorted(chunks):
        for _ in range(counts[stage]):
            layers.append(replace(chunks[stage][0], name=f"{container}.{len(layers) - 1}"))
    layers.append(by_name["head"])
    stages = []
    for s in plan.stages:
        mine = [i for i, lay in enumerate(layers) if lay.stage == s.index]
        stages.append(StageInfo(index=s.index, rank=s.rank, first=mine[0], last=mine[-1]) if mine else s)
    return plan.with_(layers=tuple(layers), stages=tuple(stages), global_batch=batch)


def extrapolate(folding: Folding, pp_rank: int, a: Trace, b: Trace) -> Trace | None:
    """The rank's figures at the real depth from its traces A and B, or None when a place where B peaks has no
    counterpart in A (the rank must be traced whole).

    Collectives, FLOPs, gradient elements and each category's maximum grow on a line through A and B. The peak is
    the highest of every place's own maximum, each on its line (`_places`): where a rank peaks can move with the
    depth (a big head's backward at two blocks, the first block's backward, with every gradient, at eighty)."""
    n, ka, kb = folding.depth[pp_rank]
    if kb == ka:
        return b
    t = (n - ka) / (kb - ka)

    def line(x: float, y: float) -> float:
        return x + t * (y - x)

    def mapping(x: dict, y: dict) -> dict:
        return {k: line(x.get(k, 0), y.get(k, 0)) for k in {*x, *y}}

    places_a, places_b = _places(a.moments, ka, folding.container), _places(b.moments, kb, folding.container)
    if not places_b or any(total >= b.memory["peak"] and place not in places_a
                           for place, (total, _) in places_b.items()):
        return None
    peak, place = max((line(places_a[p][0], places_b[p][0]), p) for p in places_b if p in places_a)
    at_peak = mapping(places_a[place][1], places_b[place][1])
    collectives = {}
    for key in {*a.collectives, *b.collectives}:
        ca, cb = a.collectives.get(key, {}), b.collectives.get(key, {})
        collectives[key] = {"count": round(line(ca.get("count", 0), cb.get("count", 0))),
                            "bytes": line(ca.get("bytes", 0), cb.get("bytes", 0))}
    memory = mapping(a.memory, b.memory) | {"peak": peak}
    return replace(b, memory=memory, collectives=collectives, flops=line(a.flops, b.flops),
                   grad_elements=line(a.grad_elements, b.grad_elements),
                   dp_reduced_elements=line(a.dp_reduced_elements, b.dp_reduced_elements),
                   memory_at_peak=at_peak, peak_at=_real_place(place, n, folding.container), moments={})


#: how far from either end of a chunk a block's places are followed. What is held while a block runs depends on
#: its neighbours (FSDP2 prefetches the next block's parameters and keeps the previous one's reduce-scatter input,
#: torch 2.13), so the first and the last block are each unlike the others, and every block in between is alike
#: except for where it stands: its memory grows or falls by the same amount from one block to the next, so over
#: the middle it is highest next to an end. The second and the one before the last block are followed: in a
#: chunk of FOLD_BLOCKS = 3 they are the same block
_EDGE = 2


def _places(moments: dict, k: int, container: str) -> dict:
    """A trace's places keyed by where they are in a chunk of ``k`` blocks: ``layers.+0`` the first block,
    ``layers.-0`` the last, ``layers.+1`` the second, ``layers.-1`` the one before the last (a block can be both);
    blocks further than `_EDGE` from both ends are not kept. Each place keeps its highest total and categories."""
    pattern = re.compile(rf"\b{re.escape(container)}\.(\d+)\b")
    out: dict = {}
    for where, value in moments.items():
        match = pattern.search(where)
        if not match:
            out[where] = value
            continue
        i = int(match.group(1))
        for key, near in ((f"+{i}", i < _EDGE), (f"-{k - 1 - i}", k - 1 - i < _EDGE)):
            if near:
                out[pattern.sub(f"{container}.{key}", where, count=1)] = value
    return out


def _real_place(place: str, n: int, container: str) -> str:
    """A place in a chunk of ``n`` blocks (``layers.-1`` of 80 → ``layers.78``)."""
    def index(match):
        sign, d = match.group(1), int(match.group(2))
        return f"{container}.{d if sign == '+' else n - 1 - d}"

    return re.sub(rf"\b{re.escape(container)}\.([+-])(\d+)\b", index, place)
