"""The inner ILP equals brute-force enumeration of the same space, evaluated by `Evaluator.evaluate`.

Space of one candidate: an AC mode per layer (none, selective, full), contiguous stages with every stage holding
≥ 1 block (embedding on stage 0, head on the last), one gradient compression and one boundary compression. The
brute force enumerates every per-layer AC assignment (3^layers), every stage split and every compression pair.
Blocks of several kinds (DeepSeek's leading dense blocks, dense and MoE in turn) are cut anywhere, as alike ones.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from functools import cache

import pytest
from ortools.linear_solver import pywraplp

from costmodel.cluster import parse_cluster_yaml
from costmodel.config import AC, ParallelConfig, Schedule, parse_kv
from costmodel.estimate import Evaluator, split_layers
from planner.search import ilp
from profiler.api import profile_model

MODELS = ("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "gpt:layers=3,hidden=64,heads=4,seq=64,vocab=256",
          "gpt:layers=4,hidden=32,heads=2,seq=32,vocab=64",
          "moe:layers=3,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=4,top_k=2")
#: two block kinds: a dense block, then three MoE blocks (the zoo's DeepSeek-style ``dense_layers``)
TWO_KINDS = "moe:layers=5,hidden=64,heads=4,kv_heads=2,ffn=32,vocab=64,seq=64,experts=4,top_k=2,dense_layers=1"
#: two kinds that alternate after a leading block of one of them: dense, then dense, MoE, dense, MoE (the zoo's
#: ``dense_layers`` and Llama 4-style ``moe_every``): a stage may start and end at either kind
ALTERNATING = ("moe:layers=5,hidden=64,heads=4,kv_heads=2,ffn=32,vocab=64,seq=64,experts=4,top_k=2,moe_every=2,"
               "dense_layers=1")


@cache
def graph(spec):
    return profile_model(spec)


def cluster(rng: random.Random, memory_gib: float, gpus_per_node: int, nodes: int):
    text = f"""
name: random
gpus_per_node: {gpus_per_node}
nodes: {nodes}
device:
  name: tiny-gpu
  peak_tflops: {{bf16: {rng.choice([0.5, 2.0, 10.0])}, fp32: 0.5}}
  memory_GiB: {memory_gib!r}
  hbm_bw_GBps: {rng.choice([20, 100, 500])}
intra: {{bw_GBps: {rng.choice([1, 10, 100])}, latency_us: {rng.choice([1, 10])}}}
inter: {{bw_GBps: {rng.choice([0.05, 0.5, 5])}, latency_us: {rng.choice([5, 50])}}}
"""
    cl = parse_cluster_yaml(text)  # the YAML has no overlap_slowdown key: set it on the device
    # the whole memory (no headroom): the random problems sit near its limit on purpose
    device = replace(cl.device, overlap_slowdown=rng.choice([0.0, 0.1, 0.3]),
                     # FSDP2's host time per group and tensor (a CPU's: `costmodel.fsdp_probe`), or none (a GPU's)
                     fsdp_overhead_s=rng.choice([{}, {"gather": (2e-4, 1e-5), "reduce": (3e-4, 2e-5)}]))
    return replace(cl, device=device, memory_fraction=1.0)


def splits(n_blocks: int, n_stages: int):
    """Every way to give each stage ≥ 1 of the blocks, in order."""
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0,) + cuts + (n_blocks,)
        yield [bounds[k + 1] - bounds[k] for k in range(n_stages)]


def brute_force(lg, cl, cfg, gb, grad_opts, pp_opts, acs=ilp.AC_ORDER):
    n = len(lg.layers)
    blocks = split_layers(lg)[1]
    S = cfg.pp * cfg.vpp
    best = None
    for counts in splits(len(blocks), S):
        stage_of = [0] * blocks[0]
        for c, k in enumerate(counts):
            stage_of += [c] * k
        stage_of += [S - 1] * (n - len(stage_of))
        for g, p in itertools.product(grad_opts, pp_opts):
            ev = Evaluator(lg, cl, replace(cfg, grad_compress=g, pp_compress=p), gb)
            for modes in itertools.product(acs, repeat=n):
                est = ev.evaluate(list(modes), stage_of)
                if est.fits and (best is None or est.step_time_s < best):
                    best = est.step_time_s
    return best


def random_problem(seed: int, spec: str | None = None, floor: float = 0.02):
    """A random candidate of a random (or the given) model on a random cluster whose memory lies between the
    all-full-AC and the no-AC plans' peaks (widened to ``floor`` × the former)."""
    rng = random.Random(seed)
    spec = rng.choice(MODELS) if spec is None else spec
    lg = graph(spec)
    nb = len(split_layers(lg)[1])  # what stages are cut inside
    gpn, nodes = rng.choice([(2, 1), (2, 2), (4, 1), (1, 4)])
    world = gpn * nodes
    tp = rng.choice([t for t in (1, 2) if world % t == 0 and t <= gpn])
    pp = rng.choice([p for p in (1, 2, 3) if (world // tp) % p == 0 and p <= nb] or [1])
    dp = world // (tp * pp)
    schedule, vpp = Schedule.ONE_F_ONE_B, 1
    if pp > 1:
        schedule = rng.choice(list(Schedule))
        if schedule == Schedule.INTERLEAVED:
            if 2 * pp > nb:
                schedule = Schedule.ZERO_BUBBLE
            else:
                vpp = 2
    zero = rng.choice([0, 1, 2, 3]) if dp > 1 else 0
    mbs = rng.choice([1, 2])
    gb = dp * mbs * rng.choice([1, 2, 4])
    experts = int(lg.model.arch.get("experts") or 0)
    ep = rng.choice([e for e in (1, 2, 4) if dp % e == 0 and experts % e == 0]) if experts else 1
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=schedule, mbs=mbs, zero=zero,
                         sp=tp > 1 and rng.random() < 0.5, precision=rng.choice(["bf16", "bf16", "fp32"]), ep=ep)
    # memory from a little below the all-full-AC plan's need to above the no-AC one's, so memory binds in some problems
    probe = cluster(random.Random(seed), 1000.0, gpn, nodes)
    lo = Evaluator(lg, probe, cfg, gb).evaluate([AC.FULL] * len(lg.layers)).memory.peak
    hi = Evaluator(lg, probe, cfg, gb).evaluate([AC.NONE] * len(lg.layers)).memory.peak
    span = max(hi - lo, floor * lo)
    memory = (lo + (rng.random() * 1.4 - 0.15) * span) / 2**30
    cl = cluster(random.Random(seed), memory, gpn, nodes)
    # under ZeRO 2/3 the ILP offers no compression; a user may pin FSDP's bf16 reduction (`--fix grad_compress=`)
    grad_opts = (("none",) if dp == 1 else rng.choice([("none",), ("bf16",)]) if zero >= 2
                 else ("none", "bf16", "powersgd-4"))
    pp_opts = ("none", "bf16") if pp > 1 else ("none",)
    return lg, cl, cfg, gb, grad_opts, pp_opts


@pytest.mark.parametrize("seed", range(60))
def test_ilp_equals_brute_force(seed):
    lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed)
    expected = brute_force(lg, cl, cfg, gb, grad_opts, pp_opts)
    if expected is None:
        with pytest.raises(ilp.Infeasible):
            ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts)
        return
    sol = ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts)
    assert sol.status == "OPTIMAL"
    assert sol.objective == pytest.approx(expected, rel=1e-6), (cfg, sol.config, sol.acs, sol.stage_of)
    assert sol.gap <= 1e-6


@pytest.mark.parametrize("seed", [0, 60, 80, 161, 192, 214, 288, 298])
def test_pipelined_zero3_equals_brute_force(seed):
    """Pipelined ZeRO 3 gathers a chunk on its backward (`costmodel.memory.fsdp_chunk_gathered`): each moment's
    gathering beyond the states that hold the chunk gathered already, so the ILP bounds the rank per group of states
    (one per gathering). Seeds of `random_problem` that draw such a plan (1F1B, GPipe, interleaved, zero-bubble;
    3 of the 60 of `test_ilp_equals_brute_force` do)."""
    lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed)
    assert cfg.pp > 1 and cfg.zero == 3 and cfg.data_ranks > 1
    expected = brute_force(lg, cl, cfg, gb, grad_opts, pp_opts)
    assert expected is not None
    sol = ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts)
    assert sol.objective == pytest.approx(expected, rel=1e-6), (cfg, sol.config, sol.acs, sol.stage_of)


@pytest.mark.parametrize("schedule", [Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE])
def test_zero3_chunks_of_uneven_size_are_costed_as_evaluated(schedule):
    """ZeRO-3 counts each stage's blocks on its own (its overlap is per stage), so a rank's chunks may hold different
    numbers of blocks: their activations must be weighed chunk by chunk, as `Evaluator._rank_memory` does. Weighed at
    the rank's average, the ILP decoded plans that did not fit (llama3-70b on 64 H100 with pp=4, vpp=2, zero=3:
    90.7 GB for a 76.4 GB budget, an assertion inside `autopar plan --fix pp=4`). Memory from below the all-full-AC
    need to above the no-AC one, against brute force."""
    lg = graph("gpt:layers=4,hidden=32,heads=2,seq=32,vocab=64")
    cfg = ParallelConfig(dp=2, pp=2, vpp=2, schedule=schedule, mbs=1, zero=3, precision="fp32")
    probe = cluster(random.Random(0), 1000.0, 4, 1)
    lo = Evaluator(lg, probe, cfg, 8).evaluate([AC.FULL] * len(lg.layers)).memory.peak
    hi = Evaluator(lg, probe, cfg, 8).evaluate([AC.NONE] * len(lg.layers)).memory.peak
    for share in (0.1, 0.4, 0.7, 1.3):
        cl = cluster(random.Random(0), (lo + share * (hi - lo)) / 2**30, 4, 1)
        expected = brute_force(lg, cl, cfg, 8, ("none",), ("none",))
        if expected is None:
            with pytest.raises(ilp.Infeasible):
                ilp.solve(lg, cl, cfg, 8, grad_opts=("none",), pp_opts=("none",))
            continue
        sol = ilp.solve(lg, cl, cfg, 8, grad_opts=("none",), pp_opts=("none",))
        assert sol.estimate.fits and sol.objective == pytest.approx(expected, rel=1e-6), (share, sol.stage_of)


def test_some_random_problems_bind_memory_and_some_are_infeasible():
    """The random suite is not trivial: memory changes the answer in some problems."""
    kinds = set()
    for seed in range(60):
        lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed)
        try:
            sol = ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts)
        except ilp.Infeasible:
            kinds.add("infeasible")
            continue
        kinds.add("recompute" if any(a != AC.NONE for a in sol.acs) else "none")
        kinds.add(f"grad={sol.config.grad_compress}")
    assert {"infeasible", "recompute", "none"} <= kinds, kinds


def test_decoded_plan_is_evaluated_and_reports_solver_facts():
    lg = graph(MODELS[2])
    cl = cluster(random.Random(0), 100.0, 2, 2)
    sol = ilp.solve(lg, cl, ParallelConfig(dp=2, pp=2), 8)
    assert sol.status == "OPTIMAL" and sol.backend in ilp.BACKENDS
    assert sol.bound <= sol.objective and sol.gap == pytest.approx(0.0, abs=1e-9)
    est = Evaluator(lg, cl, sol.config, 8).evaluate(list(sol.acs), list(sol.stage_of))
    assert est.step_time_s == sol.objective
    assert list(sol.stage_of) == sorted(sol.stage_of) and set(sol.stage_of) == {0, 1}


@pytest.mark.parametrize("pp", [2, 3])
def test_blocks_without_a_repeated_pattern_are_cut_anywhere(pp):
    """Blocks A, B, A repeat no pattern: stages are cut between any two of them, and the ILP equals the brute force
    over every split; more stages than blocks are refused, saying so."""
    lg = graph(MODELS[1])
    blocks = [i for i, layer in enumerate(lg.layers) if layer.kind == "block"]
    layers = list(lg.layers)
    layers[blocks[1]] = replace(layers[blocks[1]], signature="other")
    lg2 = replace(lg, layers=tuple(layers))
    cl = cluster(random.Random(0), 100.0, pp, 1)
    cfg = ParallelConfig(pp=pp, dp=1, precision="fp32")
    expected = brute_force(lg2, cl, cfg, 4, ("none",), ("none",), (AC.NONE, AC.FULL))
    sol = ilp.solve(lg2, cl, cfg, 4, grad_opts=("none",), pp_opts=("none",), acs=(AC.NONE, AC.FULL))
    assert sol.objective == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ilp.NotSupportedError, match="only 3 blocks"):
        ilp.solve(lg2, cluster(random.Random(0), 100.0, 4, 1), ParallelConfig(pp=4), 4)


@pytest.mark.parametrize("seed", range(16))
def test_two_block_kinds_equal_brute_force(seed):
    """A dense block before four MoE blocks: the ILP (each kind counted per stage, the stages placed by their cuts)
    equals the brute force over every assignment of no or full AC and every split of the five blocks, and the
    outer search's bound stays below it."""
    lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed, TWO_KINDS, floor=0.0)
    pre, run, _ = split_layers(lg)
    assert [lg.layers[i].kind for i in pre] == ["embed"] and len(run) == 5
    acs = (AC.NONE, AC.FULL)
    assert_optimum_and_bound(lg, cl, cfg, gb, grad_opts, pp_opts, acs,
                             brute_force(lg, cl, cfg, gb, grad_opts, pp_opts, acs))


def assert_optimum_and_bound(lg, cl, cfg, gb, grad_opts, pp_opts, acs, expected):
    """The ILP's optimum is ``expected`` (infeasible when it is None), and the outer search's bound is below it."""
    from planner.search.bounds import Bounds

    bound = Bounds(lg, cl, gb, {}, grad_opts=grad_opts).time(cfg, refine=True)
    if expected is None:
        with pytest.raises(ilp.Infeasible):
            ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts, acs=acs)
        return
    sol = ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts, acs=acs)
    assert sol.status == "OPTIMAL"
    assert sol.objective == pytest.approx(expected, rel=1e-6), (cfg, sol.config, sol.acs, sol.stage_of)
    assert bound <= sol.objective * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(16))
def test_alternating_block_kinds_equal_brute_force(seed):
    """Dense and MoE blocks that alternate after a leading dense one: a stage may start or end inside the pattern
    (a cut inside a period), each block takes its own AC mode, and a block's costs are its kind's first block's
    (`Evaluator.cost`) in whichever order the ILP's data asks for them. The ILP equals the brute force over every
    split and every per-layer no or full AC, and the outer search's bound stays below it."""
    lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed, ALTERNATING, floor=0.0)
    kinds = [lg.layers[i].signature for i in split_layers(lg)[1]]
    assert len(kinds) == 5 and kinds[1:] == [kinds[0], kinds[2], kinds[0], kinds[2]] and kinds[0] != kinds[2]
    acs = (AC.NONE, AC.FULL)
    assert_optimum_and_bound(lg, cl, cfg, gb, grad_opts, pp_opts, acs,
                             brute_force(lg, cl, cfg, gb, grad_opts, pp_opts, acs))


@pytest.mark.parametrize("seed", range(60))
def test_time_bound_is_a_lower_bound(seed):
    """The outer search's pruning bounds (cheap and refined) never exceed the ILP's optimum, and say +∞ only
    when the ILP finds nothing that fits."""
    from planner.search.bounds import Bounds

    lg, cl, cfg, gb, grad_opts, pp_opts = random_problem(seed)
    b = Bounds(lg, cl, gb, {}, grad_opts=grad_opts)
    cheap, refined = b.time(cfg), b.time(cfg, refine=True)
    assert cheap <= refined
    try:
        sol = ilp.solve(lg, cl, cfg, gb, grad_opts=grad_opts, pp_opts=pp_opts)
    except ilp.Infeasible:
        return
    assert b.memory(cfg) <= sol.estimate.memory.peak * (1 + 1e-9), (cfg, b.memory(cfg), sol.estimate.memory.peak)
    assert refined <= sol.objective, (cfg, cheap, refined, sol.objective)


def test_interleaved_relaxation_charges_a_late_chunk_no_more_than_the_evaluator():
    """Under interleaving a late chunk holds fewer micro-batches than its rank's average (pp 4, v 2, m 8: rank 3's
    states are (4, 1) and (5, 0)), and the ILP, which weighs each chunk by its own count, piles blocks there when
    memory binds. The bounds' relaxations charge a rank's blocks `_held` micro-batches each: no more than the
    heaviest state of the ILP's own plan holds (the average, 2.5, charged rank 3 more than that), and the bound
    stays below the optimum."""
    from costmodel.memory import held_states, inflight
    from planner.search.bounds import Bounds, _held

    lg = graph("gpt:layers=16,hidden=32,heads=2,seq=1024,vocab=32")
    cfg = ParallelConfig(pp=4, vpp=2, schedule=Schedule.INTERLEAVED, precision="fp32")
    probe = cluster(random.Random(3), 1000.0, 4, 1)
    need = Evaluator(lg, probe, cfg, 8).evaluate([AC.FULL] * len(lg.layers)).memory.peak
    cl = cluster(random.Random(3), need / 2**30, 4, 1)
    sol = ilp.solve(lg, cl, cfg, 8, grad_opts=("none",), pp_opts=("none",))
    ev = Evaluator(lg, cl, cfg, 8)
    blocks = split_layers(lg)[1]
    over_average = False
    for r in range(cfg.pp):
        chunks = [sum(ev.cost(i, sol.acs[i]).act_bytes for i in blocks if sol.stage_of[i] == c)
                  for c in range(r, cfg.pp * cfg.vpp, cfg.pp)]
        held = max(sum(f * a for f, a in zip(full, chunks)) for full, *_ in held_states(cfg.schedule, 4, 2, r, ev.m))
        assert _held(cfg, r, ev.m) * sum(chunks) <= held * (1 + 1e-9), r
        over_average |= inflight(cfg.schedule, 4, 2, r, ev.m) * sum(chunks) > held
    assert over_average  # the case this guards: the average would charge some rank more than it holds
    assert Bounds(lg, cl, 8, {}, grad_opts=("none",)).time(cfg, refine=True) <= sol.objective * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_memory_bound_is_below_every_plans_peak(seed):
    """`Bounds.memory` is a lower bound on the peak of every plan of the candidate: random pipelines (every
    schedule, up to 256 micro-batches, so that torch's per-micro-batch buffers and zero-bubble's pending weight
    passes weigh), every stage split with full recomputation (the least activations: where the bound is closest)
    and random splits with random recomputation per layer, each evaluated by `Evaluator.evaluate`; the runtime's
    reserve is left out, as the plans do not differ in it."""
    from planner.search.bounds import Bounds

    rng = random.Random(seed)
    lg = graph("llama:layers=8,hidden=1024,heads=8,kv_heads=2,ffn=2048,vocab=1024,seq=4096")
    pre, blocks, post = split_layers(lg)
    pp = rng.choice([2, 4])
    schedule = rng.choice(list(Schedule))
    vpp = 2 if schedule == Schedule.INTERLEAVED else 1
    tp, dp = rng.choice([(1, 1), (1, 2), (2, 1)])
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=schedule, mbs=rng.choice([1, 2]),
                         zero=rng.choice([0, 1, 2, 3]) if dp > 1 else 0, sp=tp > 1 and rng.random() < 0.5,
                         precision=rng.choice(["bf16", "fp32"]), pp_compress=rng.choice(["none", "bf16"]))
    gb = dp * cfg.mbs * rng.choice([1, 4, 16, 32, 256])
    cl = cluster(random.Random(seed), 1000.0, dp * tp * pp, 1)
    cl = replace(cl, device=replace(cl.device, runtime_reserved=0.0))
    bound = Bounds(lg, cl, gb, {}).memory(cfg)
    ev = Evaluator(lg, cl, cfg, gb)
    n = pp * vpp

    def stages(counts):
        return [0] * len(pre) + [c for c, k in enumerate(counts) for _ in range(k)] + [n - 1] * len(post)

    full = [AC.FULL] * len(lg.layers)
    every = list(splits(len(blocks), n))
    least = min(ev.evaluate(full, stages(counts)).memory.peak for counts in every)
    assert bound <= least * (1 + 1e-9), (cfg, gb, bound, least)
    for _ in range(4):
        acs = [rng.choice(list(AC)) for _ in lg.layers]
        assert bound <= ev.evaluate(acs, stages(rng.choice(every))).memory.peak * (1 + 1e-9)


@pytest.mark.parametrize("schedule", [Schedule.ZERO_BUBBLE, Schedule.ONE_F_ONE_B])
def test_every_rank_memory_bound_prunes_what_the_ilp_cannot_fit(schedule):
    """Many micro-batches on a pipeline: torch's receive buffers (one per micro-batch, kept) and, under
    zero-bubble, the later ranks' micro-batches pending a weight pass are what do not fit. The bound over every
    rank (`Bounds._held_peak`) says so where the first-and-last-rank bound does not, and the ILP agrees: at a
    memory between the two there is no plan."""
    from planner.search.bounds import Bounds

    lg = graph("llama:layers=8,hidden=1024,heads=8,kv_heads=2,ffn=2048,vocab=1024,seq=4096")
    cfg = ParallelConfig(pp=4, schedule=schedule, mbs=1)
    gb = 64
    probe = cluster(random.Random(0), 1000.0, 4, 1)
    probe = replace(probe, device=replace(probe.device, runtime_reserved=0.0))
    b = Bounds(lg, probe, gb, {})
    full = b.memory(cfg)
    quick = b.memory(cfg, capacity=0.0)  # (the looser bound: it exceeds any capacity of 0)
    assert quick < full
    between = (quick + full) / 2
    cl = replace(probe, device=replace(probe.device, memory_bytes=between))
    assert b.memory(cfg, capacity=between) > between
    with pytest.raises(ilp.Infeasible):
        ilp.solve(lg, cl, cfg, gb, grad_opts=("none",), pp_opts=("none", "bf16"))


def test_memory_bound_of_a_candidate_does_not_depend_on_the_ones_before():
    """The layer costs the bounds share across candidates (`Bounds._group`) differ with a pipeline (the head keeps
    its logits, a tied embedding its copy): a pipelined candidate bounded first must not raise a later
    unpipelined one's bound above that plan's own peak."""
    from planner.search.bounds import Bounds

    lg = graph("gpt:layers=6,hidden=256,heads=4,seq=512,vocab=32768")
    cl = cluster(random.Random(0), 1000.0, 2, 1)
    one = ParallelConfig(dp=2, mbs=1)
    fresh = Bounds(lg, cl, 8, {}).memory(one)
    b = Bounds(lg, cl, 8, {})
    b.memory(ParallelConfig(pp=2, mbs=1))
    assert b.memory(one) == fresh


BIG_VOCAB = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=8192"
TWO_EXPERTS = "moe:layers=3,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=128,seq=32,experts=2,top_k=1"


def _pinned_fits(lg, cl, cfg, gb, acs, stage_of, memory_bytes) -> bool:
    """Whether the ILP, its decisions pinned to the plan (`ilp.Model.pin`), fits it in ``memory_bytes``."""
    cl = replace(cl, device=replace(cl.device, memory_bytes=memory_bytes))
    model = ilp.Model(ilp.build_data(lg, cl, cfg, gb, grad_opts=("none",), pp_opts=("none",)))
    model.pin(acs, stage_of, "none", "none")
    return model.solve(20) in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)


@pytest.mark.parametrize("spec, config, batch", [
    # pipelined ZeRO 3 with a large vocabulary: the head's and embedding's moments set the peak (their chunk's
    # gathering, `costmodel.memory.fsdp_chunk_gathered`), which random problems rarely reach
    (BIG_VOCAB, "dp=2,pp=2,zero=3,mbs=1,schedule=1f1b,precision=fp32", 2),
    (BIG_VOCAB, "dp=2,pp=2,zero=3,mbs=1,schedule=1f1b,precision=bf16", 8),
    (BIG_VOCAB, "dp=2,pp=2,zero=3,mbs=1,schedule=gpipe,precision=fp32", 4),
    (BIG_VOCAB, "dp=2,pp=2,zero=3,mbs=1,schedule=zb,precision=fp32", 4),
    (BIG_VOCAB, "dp=2,pp=2,vpp=2,zero=3,mbs=1,schedule=interleaved,precision=fp32", 4),
    # ZeRO 2 and 3 with a large tied vocabulary: the embedding's backward (three copies of the tied weight's gradient
    # beside the lowest block's reduce-scatter input, `costmodel.memory.fsdp_reduce_in_flight_bytes`) sets the peak
    (BIG_VOCAB, "dp=4,zero=2,mbs=1,precision=fp32", 8),
    (BIG_VOCAB, "dp=4,zero=3,mbs=1,precision=fp32", 8),
    # pipelined DDP under autocast: a later micro-batch's backward holds the 16-bit weight gradients to its end
    # (`Evaluator.autocast_held_bytes`: at a block's, the embedding's and the cast-backs' moments)
    (BIG_VOCAB, "dp=2,pp=2,mbs=1,schedule=1f1b,precision=bf16", 8),
    (BIG_VOCAB.replace("vocab=8192", "vocab=128"), "dp=2,pp=2,mbs=1,schedule=1f1b,precision=bf16", 8),
    (BIG_VOCAB.replace("vocab=8192", "vocab=128"), "dp=2,pp=2,mbs=1,schedule=gpipe,precision=bf16", 8),
    (BIG_VOCAB.replace("vocab=8192", "vocab=128"), "dp=2,pp=2,vpp=2,mbs=1,schedule=interleaved,precision=bf16", 8),
    (TWO_EXPERTS.replace("layers=3", "layers=4"), "dp=2,pp=2,mbs=1,schedule=1f1b,precision=bf16", 8),
    # FSDP2's padded shards, gathered and held (2 experts over 4 ranks: `Evaluator.gathered_numel`)
    (TWO_EXPERTS, "dp=4,zero=3,mbs=1,precision=bf16", 16),
    (TWO_EXPERTS, "dp=4,zero=2,mbs=1,precision=bf16", 16),
    # ... pipelined: the chunks' gathered padding, at the states and after the backward; 130 words pad too
    (TWO_EXPERTS.replace("layers=3", "layers=4").replace("vocab=128", "vocab=130"),
     "dp=4,pp=2,vpp=2,zero=3,mbs=1,schedule=interleaved,precision=bf16", 8),
    (TWO_EXPERTS.replace("layers=3", "layers=4").replace("vocab=128", "vocab=130"),
     "dp=4,pp=2,zero=3,mbs=1,schedule=1f1b,precision=bf16", 8),
])
def test_the_ilp_charges_a_pinned_plan_the_estimates_peak(spec, config, batch):
    """The ILP's memory of a plan is the estimate's, to a millionth: pinned to the plan, it fits the estimate's peak
    and not a millionth less (no reserve: the peak is all the constraint reads). Three plans each (checkpointing
    and stage sizes drawn)."""
    lg = graph(spec)
    cfg = ParallelConfig(**parse_kv(config))
    cl = cluster(random.Random(7), 1000.0, 4, max(1, cfg.world // 4))
    cl = replace(cl, device=replace(cl.device, runtime_reserved=0.0))
    rng = random.Random(spec + config)
    blocks = split_layers(lg)[1]
    n, S = len(lg.layers), cfg.pp * cfg.vpp
    for _ in range(3):
        counts = rng.choice(list(splits(len(blocks), S)))
        stage_of = [0] * blocks[0] + [c for c, k in enumerate(counts) for _ in range(k)]
        stage_of += [S - 1] * (n - len(stage_of))
        acs = [rng.choice(ilp.AC_ORDER) for _ in range(n)]
        peak = Evaluator(lg, cl, cfg, batch).evaluate(acs, stage_of).memory.peak
        assert _pinned_fits(lg, cl, cfg, batch, acs, stage_of, peak * (1 + 1e-6)), (counts, acs)
        assert not _pinned_fits(lg, cl, cfg, batch, acs, stage_of, peak * (1 - 1e-6)), (counts, acs)
