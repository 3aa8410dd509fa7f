"""Context parallelism (cp > 1) in the runtime, for the zoo llama: and gpt: models.

- the hook protocol: the zoo models expose ``context_positions`` and an ``attend`` core
  (`profiler.layers.context_parallel_ready`);
- `planner.emit.runtime.context_parallel_attention` on 2 and 4 gloo ranks equals the model's own causal attention
  in one process, output and the gradients of q, k and v (grouped-query and plain multi-head);
- the gloo matrix: cp alone and with dp (DDP, ZeRO-1), FSDP (ZeRO 2 and 3), tensor and sequence parallelism and
  activation checkpointing, each through the emitted script and through `auto_parallelize`, against one process on
  the same seed and data (3 SGD steps, losses and parameter updates ≤ 1e-4 relative, gradient norms ≤ 1e-5), in two
  torchrun launches (2 and 4 ranks; `tests.dist_util` runs all cases of a size in the same processes), and a
  checkpoint that resumes;
- that the sequence really is split (a match alone cannot tell cp ranks from ranks training whole sequences): each
  rank's model sees seq/cp tokens at its chunks' positions, and each layer all-gathers its K/V over cp once
  forward (again in backward under full AC) and reduce-scatters their gradients;
- what is refused: cp with pipeline parallelism (the emitter, by `costmodel.runnable.context_problems`), an edited
  ``PLAN`` whose sequence 2·cp does not divide (the runtime at start), and a batch of shorter sequences.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_util
from tests.test_emit_dist import EXACT, RESUME_STEPS, STEPS, make_plan

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"
GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,dropout=0"
BOTH_FULL = {"layers.0": "full", "layers.1": "full"}


def test_zoo_models_expose_the_context_parallel_hooks():
    """``context_positions`` None (positions 0..s−1) and an ``attend`` method on every attention: what the runtime
    replaces. Set, the positions are those Llama's RoPE tables and GPT's position embedding use."""
    from planner.emit.runtime import context_shard
    from profiler.layers import context_parallel_ready
    from profiler.zoo import llama
    from profiler.zoo.registry import resolve_model

    for spec in (LLAMA, GPT):
        model, _ = resolve_model(spec).build(device="cpu")
        assert context_parallel_ready(model) and model.context_positions is None
        assert all(callable(layer.attention.attend) for layer in model.layers)
    positions = context_shard(torch.arange(32), 2, 1, dim=0)  # rank 1 of cp = 2: tokens 8-15 and 16-23
    assert positions.tolist() == list(range(8, 24))
    whole = llama.rope_cos_sin(32, 16, 500000.0, torch.device("cpu"), torch.float32)
    part = llama.rope_cos_sin(16, 16, 500000.0, torch.device("cpu"), torch.float32, positions)
    for a, b in zip(part, whole):
        torch.testing.assert_close(a, b[positions])
    model, _ = resolve_model(GPT).build(device="cpu")
    model.context_positions = positions
    seen = []
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens)
    torch.testing.assert_close(seen[0], model.tok_embeddings(tokens) + model.pos_embeddings.weight[positions])


def _attention_worker(rank: int, world: int, init_file: str) -> None:
    """One gloo rank of `test_context_parallel_attention_is_exact`."""
    import torch.distributed as dist

    from planner.emit.runtime import context_masks, context_parallel_attention, context_shard
    from profiler.zoo import llama

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batch, seq, heads, d = 2, 8 * world, 4, 8
        for kv_heads in (2, 4):  # grouped-query (the smaller K/V travels) and plain multi-head
            torch.manual_seed(kv_heads)
            q, grad = torch.randn(batch, seq, heads, d), torch.randn(batch, seq, heads, d)
            k, v = torch.randn(batch, seq, kv_heads, d), torch.randn(batch, seq, kv_heads, d)
            # the model's own core in one process (the default `attend`: GQA expansion, causal SDPA)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out = llama.Attention(heads * d, heads, kv_heads).attend(*ref)
            out.backward(grad)
            mine = [context_shard(t, world, rank).requires_grad_() for t in (q, k, v)]
            got = context_parallel_attention(*mine, dist.group.WORLD, world, rank, context_masks(seq, world, rank))
            got.backward(context_shard(grad, world, rank))
            torch.testing.assert_close(got, context_shard(out.detach(), world, rank), rtol=1e-5, atol=1e-6)
            for name, a, b in zip("qkv", mine, ref):
                torch.testing.assert_close(a.grad, context_shard(b.grad, world, rank), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name: f"rank {rank}/{world}, d{name}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_is_exact(tmp_path, world):
    """Each rank's two query chunks over the all-gathered keys and values, with lower-right causal masks: the
    output of its tokens and, through the all-gather's reduce-scatter backward, its q, k and v gradients equal one
    process's full causal attention (grouped-query and multi-head)."""
    import torch.multiprocessing as mp

    mp.spawn(_attention_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


# name: (world, plan); 3 SGD steps, EXACT tolerances
CASES = {
    "llama_cp2": (2, lambda: make_plan(LLAMA, 2, cp=2)),
    "gpt_cp2": (2, lambda: make_plan(GPT, 2, cp=2)),  # learned positions, a head tied to the embedding
    "llama_cp2_zero2": (2, lambda: make_plan(LLAMA, 2, cp=2, zero=2)),  # FSDP over the cp ranks alone (dp = 1)
    "llama_cp2_ac_full": (2, lambda: make_plan(LLAMA, 2, cp=2, ac=BOTH_FULL)),  # the all-gather recomputed
    "gpt_cp2_ac_selective_zero3": (2, lambda: make_plan(GPT, 2, cp=2, zero=3, ac={"layers.0": "selective"})),
    "llama_cp4": (4, lambda: make_plan(LLAMA, 2, cp=4)),
    "gpt_cp2_dp2_ddp": (4, lambda: make_plan(GPT, 2, dp=2, cp=2)),
    "llama_cp2_dp2_zero1": (4, lambda: make_plan(LLAMA, 2, dp=2, cp=2, zero=1)),
    "llama_cp2_dp2_fsdp": (4, lambda: make_plan(LLAMA, 2, dp=2, cp=2, zero=3)),
    "llama_cp2_tp2": (4, lambda: make_plan(LLAMA, 2, cp=2, tp=2)),
    "llama_cp2_tp2_sp": (4, lambda: make_plan(LLAMA, 2, cp=2, tp=2, sp=True)),
    "gpt_cp2_tp2_sp_ac_full": (4, lambda: make_plan(GPT, 2, cp=2, tp=2, sp=True, ac=BOTH_FULL)),
}

#: the scripts whose model inputs, positions and collectives `test_context_parallel_splits_the_sequence` reads, per
#: world size (plans with data parallelism by DDP or none: no FSDP all-gathers among the counted ones)
PROBED = {2: ["llama_cp2", "llama_cp2_ac_full"], 4: ["llama_cp4"]}

#: checkpoint and resume with the parameters sharded over the flattened dp × cp group (AdamW): name → (world, plan)
RESUME_CASES = {
    "resume_llama_cp2_fsdp": (2, lambda: make_plan(LLAMA, 2, cp=2, zero=3)),
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    work = tmp_path_factory.mktemp("cp_matrix")
    probes = {world: [{"name": f"context_probe_{world}", "context": {name: str(work / f"{name}.py") for name in names}}]
              for world, names in PROBED.items()}
    return dist_util.run_matrix(work, "context-parallel", CASES, RESUME_CASES, STEPS, RESUME_STEPS, extra=probes)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["emit", "apply"])
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_one_process(matrix, name, mode):
    dist_util.assert_matches(matrix, name, CASES[name][0], mode, EXACT)


@pytest.mark.dist
@pytest.mark.parametrize("name", [name for names in PROBED.values() for name in names])
def test_context_parallel_splits_the_sequence(matrix, name):
    """What the matches above cannot tell apart from cp ranks that each train whole sequences: every rank's model
    sees seq/cp tokens of its rows, at the positions of chunks r and 2·cp − 1 − r, and one forward all-gathers each
    layer's keys and values once over the cp group (kv_heads wide: grouped-query attention's smaller K/V), which
    the backward reduce-scatters; under full AC the backward gathers them again (the block recomputed)."""
    out, _, failures = matrix
    world, make = CASES[name]
    if world in failures:
        pytest.fail(failures[world])
    cp, seq, rows, layers, kv_width = make().config.cp, 32, 8, 2, 2 * 16  # kv_heads · head_dim
    chunk = seq // (2 * cp)
    for rank in range(world):
        got = torch.load(out / f"context_probe_{world}.rank{rank}.pt")[name]
        r = got["cp_rank"]
        assert got["inputs"] == [(rows, seq // cp)], got["inputs"]
        assert got["positions"] == [*range(r * chunk, (r + 1) * chunk),
                                    *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
        gathered = rows * seq * kv_width  # elements of one layer's keys (or values) over the whole sequence
        full_ac = bool(make().layers[1].ac.value == "full")
        for phase, kind, count in (("forward", "all_gather", 2 * layers), ("backward", "reduce_scatter", 2 * layers),
                                   ("backward", "all_gather", 2 * layers if full_ac else 0)):
            calls = [c for c in got["log"] if c[0] == phase and c[1] == kind]
            assert len(calls) == count and all(c[2] == gathered for c in calls), (phase, kind, calls)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_context_parallel_checkpoint_resumes(matrix, name):
    """Saved and resumed (model, AdamW moments, schedule), the losses are those of straight steps, through the
    emitted script and `auto_parallelize`'s handle."""
    out, _, failures = matrix
    world, _ = RESUME_CASES[name]
    if world in failures:
        pytest.fail(failures[world])
    got = torch.load(out / f"{name}.resume.rank0.pt")
    assert got["resumed"] == pytest.approx(got["straight"], rel=1e-6), (got["resumed"], got["straight"])
    assert got["handle"] == pytest.approx(got["straight"], rel=1e-6), (got["handle"], got["straight"])


def test_emitted_script_keeps_the_context_parallel_code_only_when_planned():
    """A cp plan's script holds the cp mesh, `apply_cp` and its attention, and slices the batch; a cp = 1 plan's
    script none of it (the emitter keeps what the plan reaches)."""
    from planner.emit.script import emit

    with_cp, without = emit(make_plan(LLAMA, 2, cp=2)), emit(make_plan(LLAMA, 2, dp=2))
    for name in ("def apply_cp", "def context_parallel_attention", "def context_tokens", '"dp_cp"',
                 "causal_lower_right"):
        assert name in with_cp and name not in without, name
    compile(with_cp, "cp.py", "exec")


def test_cp_with_pipeline_parallelism_is_refused():
    """The emitter refuses a plan the runtime cannot run, with `costmodel.runnable.context_problems`'s line."""
    from planner.emit.script import emit

    with pytest.raises(ValueError, match="cp=2 with pipeline parallelism is not supported yet"):
        emit(make_plan(LLAMA, 2, pp=2, cp=2, schedule="1f1b"))


def test_runtime_refuses_an_edited_plan_and_short_sequences():
    """An edited ``PLAN`` fails at start with the rule's line (`planner.emit.runtime.plan_problems`), and a batch
    whose sequences are not the planned length is refused before any collective (its positions would not match)."""
    from types import SimpleNamespace

    from planner.emit import runtime, train
    from planner.emit.config import runtime_config
    from profiler.zoo.registry import resolve_model

    plan = make_plan(LLAMA, 2, cp=2)
    model, _ = resolve_model(LLAMA).with_seq(32).build(batch=1, seq=32, device="meta")
    config = runtime_config(plan, model)
    assert runtime.plan_problems(config) == []
    assert any("2·cp = 4 chunks" in why for why in runtime.plan_problems({**config, "seq": 30}))
    par = SimpleNamespace(plan=config, mesh=None)
    with pytest.raises(ValueError, match="whole sequences of the planned 32 tokens"):
        train.context_tokens(par, torch.zeros(8, 16, dtype=torch.long))


def test_context_parallel_attention_under_autocast():
    """DDP plans run under autocast on GPUs, where RoPE's fp32 tables leave q and k in fp32 and v in the autocast
    dtype; SDPA would cast them, but a lower-right causal mask dispatches before autocast and refuses mixed dtypes.
    The context-parallel attention casts first (CPU autocast stands in for CUDA's here; one gloo rank)."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
from planner.emit.runtime import context_parallel_attention, context_masks
q = torch.randn(1, 16, 4, 8, requires_grad=True)
k = torch.randn(1, 16, 2, 8, requires_grad=True)
v = torch.randn(1, 16, 2, 8).bfloat16().requires_grad_()
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = context_parallel_attention(q, k, v, dist.group.WORLD, 1, 0, context_masks(16, 1, 0))
out.float().sum().backward()
print(out.dtype, q.grad.dtype, v.grad.dtype)
dist.destroy_process_group()
"""
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["torch.bfloat16", "torch.float32", "torch.bfloat16"]


@pytest.mark.parametrize("cp, kv_heads", [(8, 2), (8, 8), (4, 1)])
def test_context_parallel_attention_memory_is_what_the_cost_model_prices(cp, kv_heads):
    """The attention's memory as `costmodel.layercost.context_parallel_comm` prices it on this machine's kernels,
    every rank of cp on a fake process group: the keys and values saved for the backward are each query chunk's,
    expanded to the query heads ((2·cp + 1)·c positions of the S = 2·cp·c; without grouped-query heads, views of
    the gathered keys: S positions), besides the materialised lower-right mask of each chunk with more keys than
    queries (this counts those chunks only: a chunk's queries are indistinguishable from its keys by shape); the
    temporaries torch's memory tracker sees at their peak in the backward are the priced working set on the worst
    rank (rank 0 with grouped-query heads, rank cp − 1 without), and no more on any other."""
    import subprocess
    import sys

    code = f"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from planner.emit.runtime import context_parallel_attention, context_masks
cp, seq, heads, kv, d = {cp}, 1024, 8, {kv_heads}, 16
for rank in range(cp):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    q = torch.randn(1, seq // cp, heads, d, requires_grad=True)
    k, v = (torch.randn(1, seq // cp, kv, d, requires_grad=True) for _ in range(2))
    masks = context_masks(seq, cp, rank)
    saved = dict()
    def pack(t):
        if t.dim() == 4 and t.shape[1] == heads and t.shape[2] > seq // (2 * cp):  # keys and values, many positions
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif t.dim() == 2 and t.shape[1] > t.shape[0]:  # a materialised mask
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    tracker = MemTracker()
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(q, k, v, dist.group.WORLD, cp, rank, masks)
        out.sum().backward()
    temp = tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_MemRefType.TEMP]
    print(sum(saved.values()), temp)
    dist.destroy_process_group()
"""
    seq, heads, d, elt = 1024, 8, 16, 4
    c, width = seq // (2 * cp), heads * d
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    temps = []
    for rank, line in enumerate(ran.stdout.splitlines()):
        saved, temp = map(int, line.split())
        seen = [n * c for n in (rank + 1, 2 * cp - rank) if n > 1]  # the chunks with more keys than queries
        # (rank 0's first chunk, as many keys as queries, runs as plain causal attention: neither counted nor masked)
        keys = 2 * sum(seen) * width if kv_heads != heads else 2 * seq * width
        assert saved == (keys + c * sum(seen)) * elt, rank
        temps.append(temp)
    assert len(temps) == cp
    priced = (2 * seq + c) * width * elt if kv_heads != heads else (3 * seq + 3 * c) * width * elt
    assert max(temps) == priced, temps
