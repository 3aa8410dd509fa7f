"""The emitted script as text: golden files, compile and lint checks, launch checks and short training runs."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.emit.script import emit, write_script
from planner.plan import Plan
from tests.test_emit_dist import GOLDEN_PLANS, GPT, HF_LLAMA, LLAMA4, _hf_plan, make_plan

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[1]



@pytest.mark.parametrize("name", list(GOLDEN_PLANS))
def test_golden(name):
    text = emit(GOLDEN_PLANS[name]())
    path = GOLDEN / f"{name}.py"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: write it with AUTOPAR_UPDATE_GOLDEN=1"
    assert text == path.read_text(), "emitted text changed; if intended, rerun with AUTOPAR_UPDATE_GOLDEN=1"


def test_emission_does_not_depend_on_path(monkeypatch):
    """The script is formatted by the ruff installed with this Python, found without PATH (a venv's python called by
    its path formats as the `python` on PATH does)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    plan = GOLDEN_PLANS["gpt_dp2_zero3_ac"]()
    assert emit(plan) == (GOLDEN / "gpt_dp2_zero3_ac.py").read_text()


@pytest.mark.parametrize("name", [*GOLDEN_PLANS, "hf"])
def test_compiles_and_lints(name, tmp_path):
    plan = _hf_plan(tp=2) if name == "hf" else GOLDEN_PLANS[name]()
    script = write_script(plan, tmp_path / "train.py")
    subprocess.run([sys.executable, "-m", "py_compile", str(script)], check=True)
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (pip install ruff)")
    result = subprocess.run(
        [ruff, "check", "--isolated", "--line-length", "120", str(script)], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_no_autopar_import_and_names_escaped(tmp_path):
    text = emit(GOLDEN_PLANS["llama_dp2_tp2_sp"]())
    assert not re.search(r"^\s*(from|import) (planner|profiler|costmodel)\b", text, re.MULTILINE)
    assert "'layers.1'" in text or '"layers.1"' in text  # module names only as string literals


def test_unknown_data_source_is_refused():
    with pytest.raises(ValueError, match="data="):
        emit(GOLDEN_PLANS["gpt_dp2_zero3_ac"](), data="s3://bucket")


def _torchrun(script: Path, nproc: int, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=script.parent)


@pytest.mark.dist
def test_wrong_world_size_stops_every_rank(tmp_path):
    script = write_script(make_plan(GPT, 2, dp=2, tp=2), tmp_path / "train.py", steps=1)
    result = _torchrun(script, 2, timeout=60)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    # torchrun SIGTERMs the other ranks as soon as one exits, so under torchrun only the first message is sure to
    # print; each rank's own check is run below without the launcher.
    assert "this plan needs 4 processes" in out, out[-3000:]
    assert "torchrun --nproc-per-node 4" in out
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env,
                               cwd=tmp_path, check=False)
        assert alone.returncode == 2, alone.stderr[-2000:]
        assert alone.stderr.strip().splitlines()[-1].startswith(f"[rank {rank}] error: this plan needs 4 processes")


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", output, re.M)]  # rank 0 alone prints


@pytest.mark.dist
@pytest.mark.parametrize("which", ["gpt", "hf_llama"])
def test_tp2_loss_decreases_over_20_steps(which, tmp_path):
    """`autopar plan MODEL --cluster cpu-local --fix tp=2` (the real planner), then the emitted script for 20 steps
    under torchrun: the loss falls."""
    from planner.cli.main import main

    spec = "gpt-tiny" if which == "gpt" else HF_LLAMA
    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", spec, "--cluster", "cpu-local", "--fix", "tp=2", "--global-batch", "8",
                 "--out", str(plan_path)]) == 0
    plan = Plan.load(plan_path)
    assert plan.config.tp == 2
    script = write_script(plan, tmp_path / "train.py", steps=20, lr=3e-3)
    result = _torchrun(script, 2, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    losses = _losses(result.stdout)
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


@pytest.mark.dist
def test_example_train_auto_parallelize(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    make_plan("gpt-tiny", 2, dp=2).save(plan_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "examples" / "train_auto_parallelize.py"),
        "--plan",
        str(plan_path),
        "--steps",
        "5",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert len(_losses(result.stdout)) == 5


def test_specializer_keeps_only_the_plans_branches():
    from planner.emit.script import specialize_runtime

    source = '''def f(plan, x):
    y = x
    # 1. Tensor parallel.
    if plan["tp"] > 1:
        y = g(y)
    # 2. Data parallel: one of three.
    if plan["dp"] > 1 and plan["zero"] == 0:
        y = ddp(y)
    elif plan["dp"] > 1 and x:
        y = fsdp(y)
    else:
        y = y  # none
    if plan["pp"] == 1:
        return y
    return h(y)


def g(y):
    return y


def h(y):
    return y
'''
    text = specialize_runtime(source, {"tp": 1, "dp": 2, "zero": 3, "pp": 1}, {"f"})
    assert "Tensor parallel" not in text and "def g" not in text and "def h" not in text
    assert "elif" not in text and "ddp" not in text  # the first branch is gone, its elif became the if
    assert '    if plan["dp"] > 1 and x:\n        y = fsdp(y)\n    else:\n        y = y  # none\n    return y' in text
    compile(text, "f.py", "exec")


def test_ddp_script_carries_only_ddp():
    text = emit(make_plan(GPT, 2, dp=2))
    assert "DDP(" in text
    absent_calls = ("apply_tp(", "fully_shard(", "PipelineStage(", "powerSGD", "checkpoint_wrapper(",
                    "sync_tied_grads(")
    for absent in absent_calls:
        assert absent not in text, absent
    assert "precision=" not in text.split("# --- The model ---")[0].split("PLAN = ")[1].split("}")[-1]


def test_tied_gpt_pipeline_keeps_an_embedding_group():
    from planner.emit.config import runtime_config
    from profiler.zoo.registry import resolve_model

    plan = make_plan(GPT, 2, pp=2, dp=2, schedule="1f1b")
    model, _ = resolve_model(plan.model).build(batch=1, seq=32, device="meta")
    assert runtime_config(plan, model)["tied"] == [{"names": ["tok_embeddings.weight", "output.weight"],
                                                    "pp_ranks": [0, 1]}]
    assert "sync_tied_grads(par)" in emit(plan)
    assert "sync_tied_grads(" not in emit(make_plan(LLAMA4, 4, pp=2, mbs=2))  # nothing tied


def test_low_precision_is_noted_and_fp8_refused():
    text = emit(make_plan(GPT, 2, dp=2, precision="bf16"))
    assert "# precision=bf16 applies on GPUs only" in text
    with pytest.raises(ValueError, match="float8 training needs torchao"):
        emit(make_plan(GPT, 2, dp=2, precision="fp8"))


def test_big_model_emits_meta_init_and_small_full():
    import dataclasses

    big = dataclasses.replace(make_plan("gpt3-175b", 96, dp=8, zero=3), cluster="dgx-h100")
    text = emit(big)
    assert '"init": "meta"' in text and "# init=meta: 650.4 GiB of fp32 parameters > a quarter of the 79 GiB" in text
    assert "part.to_empty(" in text and "find_init(" in text
    small = emit(make_plan(GPT, 2, dp=2))
    assert '"init": "full"' in small and "# init=full:" in small and "part.to_empty(" not in small
    assert '"init": "meta"' in emit(make_plan(GPT, 2, dp=2), init="meta")
    with pytest.raises(ValueError, match="init="):
        emit(make_plan(GPT, 2, dp=2), init="lazy")


def test_meta_init_without_init_weights_is_refused():
    from torch import nn

    from planner.emit.runtime import find_init

    with pytest.raises(ValueError, match="has no init_weights"):
        find_init(nn.Sequential(nn.Linear(2, 2)))


def test_meta_init_of_hf_model_recomputes_rotary_buffers():
    """One process: a Hugging Face Llama built on meta, materialised and initialised as a rank would."""
    import torch

    from planner.emit.runtime import materialize
    from profiler.zoo.registry import resolve_model

    source = resolve_model(HF_LLAMA)
    torch.manual_seed(0)
    full, _ = source.build(batch=1, seq=32, device="cpu")
    with torch.device("meta"):
        meta = full.__class__(type(full.model)(full.model.config))
    materialize(meta, 0, {"seed": 0}, torch.device("cpu"))
    got, ref = dict(meta.named_parameters()), dict(full.named_parameters())
    assert set(got) == set(ref)
    for name, p in ref.items():
        assert abs(got[name].std().item() - p.std().item()) <= 0.1 * p.std().item() + 1e-7, name
    buffers = dict(full.named_buffers())
    for name, b in meta.named_buffers():
        assert torch.equal(b, buffers[name]), name  # inv_freq recomputed, not left as garbage


def test_lr_schedule_warms_up_then_decays_to_its_floor():
    """Linear warm-up from lr/warmup to lr, then half a cosine to min_lr_ratio·lr at the last step (closed forms)."""
    import math

    from planner.emit.train import lr_factor

    plan = {"warmup_steps": 10, "min_lr_ratio": 0.1}
    assert [lr_factor(s, plan, 110) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, plan, 110) == pytest.approx(1.0)
    assert lr_factor(60, plan, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(110, plan, 110) == pytest.approx(0.1) and lr_factor(500, plan, 110) == pytest.approx(0.1)
    assert lr_factor(50, plan, None) == 1.0  # no decay without a run length
    assert lr_factor(0, {"warmup_steps": 0, "min_lr_ratio": 0.0}, 4) == 1.0


def test_weight_decay_on_matrices_only():
    """AdamW's decoupled weight decay on the embedding and linear weights; none on norms' scales and biases."""
    import torch

    from planner.emit.runtime import Parallel
    from planner.emit.train import build_optimizer

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    plan = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "dp": 1, "zero": 0}
    opt = build_optimizer(Parallel(plan=plan, mesh=None, parts=[model], modules=[model]), plan)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert isinstance(opt, torch.optim.AdamW)
    assert decay == {id(model[0].weight): 0.1, id(model[1].weight): 0.0, id(model[1].bias): 0.0,
                     id(model[2].weight): 0.1, id(model[2].bias): 0.0}


def test_optimizer_is_fused_and_grouped_by_mesh():
    """AdamW runs fused (the traffic `costmodel.overlap.optimizer_time` prices) in groups whose tensors share a kind
    and a mesh: torch's foreach and fused steps take a group's tensors in one call, which DTensor refuses when plain
    tensors and DTensors, or DTensors of two meshes, meet (a tensor-parallel layer beside a replicated one, the
    default foreach path on CUDA). Stepped on a fake process group with a 1-D and a 2-D mesh and a plain tensor."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.emit.runtime import Parallel
    from planner.emit.train import build_optimizer

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh["tp"], [Shard(0)]))
        model[1].weight = torch.nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh, [Shard(0), Shard(0)]))
        plan = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "dp": 1, "zero": 0, "cp": 1}
        opt = build_optimizer(Parallel(plan=plan, mesh=mesh, parts=[model], modules=[model]), plan)
        assert all(g["fused"] for g in opt.param_groups)
        for g in opt.param_groups:
            kinds = {(type(p), getattr(p, "device_mesh", None)) for p in g["params"]}
            assert len(kinds) == 1, kinds
        assert len(opt.param_groups) == 3  # the 1-D and the 2-D sharded matrices, the plain vectors
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # one fused call per group
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # what one group would do
            torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", ["dgx-h100:nodes=2", "cpu-local"])
def test_header_gives_the_launch_for_the_plans_nodes(spec):
    """Multi-node plans: --nnodes, GPUs per node and a rendezvous, not one standalone node of the whole world."""
    from planner.emit.script import launch_line

    plan = make_plan(GPT, 2, dp=16 if spec.startswith("dgx") else 2)
    plan = dataclasses.replace(plan, cluster=spec)
    line = launch_line(plan)
    if spec.startswith("dgx"):
        assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in line and "--standalone" not in line
    else:
        assert line == "torchrun --standalone --nproc-per-node 2 THIS_FILE.py"


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_file_gives_each_rank_its_windows(tmp_path, suffix):
    """--data: a memory-mapped token file (1-D .npy, or raw uint32 ids), read without numpy by the emitted script.
    Row i of step s is window s·batch + i of seq + 1 tokens, labels the inputs shifted by one, wrapping at the end."""
    import numpy as np
    import torch

    from planner.emit.train import token_file_batch

    tokens = np.arange(1001, dtype=np.uint32)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    x, y = token_file_batch(str(path), 1, slice(2, 4), batch=4, seq=10, dtype="uint32")
    assert x.dtype == torch.int64 and x.shape == (2, 10)
    assert torch.equal(x[:, 0], torch.tensor([60, 70])) and torch.equal(y, x + 1)
    x, _ = token_file_batch(str(path), 25, slice(0, 1), batch=4, seq=10, dtype="uint32")  # window 100 wraps to 0
    assert x[0, 0].item() == 0


def test_compile_is_a_launch_flag_refused_where_torch_cannot_run_it(tmp_path):
    """--compile BACKEND (default off) compiles each block; the emitted script keeps the branch for the flag, and
    the one rule set refuses tensor parallelism with AC under compile, in emission and in auto_parallelize's config."""
    text = emit(make_plan(GPT, 2, dp=2))
    assert "PLAN = {" in text and '"compile": None' in text and 'if plan["compile"]:' in text
    assert "--compile" in text and "block.compile(backend=plan[\"compile\"])" in text
    assert '"compile": "aot_eager"' in emit(make_plan(LLAMA4, 4, tp=2), compile="aot_eager")
    with pytest.raises(ValueError, match="torch.compile with tensor parallelism and activation checkpointing"):
        emit(make_plan(LLAMA4, 4, tp=2, ac={"layers.1": "full"}), compile="aot_eager")
    with pytest.raises(ValueError, match="'nope': not a torch.compile backend"):
        emit(make_plan(GPT, 2, dp=2), compile="nope")
    script = tmp_path / "train.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script), "--compile", "nope"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and "--compile nope: not a torch.compile backend" in proc.stderr, proc.stderr[-500:]


def test_synthetic_rows_are_the_global_batchs_rows():
    """A data-parallel rank's synthetic rows are those rows of the step's global batch (built alone, not sliced from
    it), so every plan trains on the same data as one process."""
    import torch

    from planner.emit.train import synthetic_batch

    whole = synthetic_batch(3, batch=8, seq=16, vocab=50, seed=1)
    for rows in (slice(0, 2), slice(2, 4), slice(6, 8), slice(None)):
        part = synthetic_batch(3, batch=8, seq=16, vocab=50, seed=1, rows=rows)
        assert part[0].shape[0] == whole[0][rows].shape[0]
        assert torch.equal(part[0], whole[0][rows]) and torch.equal(part[1], whole[1][rows])
    assert torch.equal(whole[1][:, :-1], whole[0][:, 1:])  # labels: the next tokens
    assert not torch.equal(whole[0], synthetic_batch(4, batch=8, seq=16, vocab=50, seed=1)[0])


HF_AS_RETURNED = '''
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from planner import auto_parallelize

cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)  # as transformers returns it: cache on, no loss wrapper
assert model.config.use_cache
g = torch.Generator().manual_seed(1)
inputs, labels = torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)
with torch.no_grad():  # one process, no autopar: the loss of the batch contract
    logits = model(inputs).logits
    expected = F.cross_entropy(logits.float().reshape(-1, 128), labels.reshape(-1)).item()
handle = auto_parallelize(model, inputs[:2], plan_kwargs={"global_batch": 4})  # no cluster, no plan
loss = handle.step((inputs, labels))
every = [None] * dist.get_world_size()  # each rank holds its stage's parameters when the plan pipelines
dist.all_gather_object(every, set(handle.full_parameters()))
names = set().union(*every)
plans = [None] * dist.get_world_size()  # rank 0 planned and broadcast: one plan, byte for byte
dist.all_gather_object(plans, handle.plan.dumps())
assert len(set(plans)) == 1
if dist.get_rank() == 0:
    print(f"plan {handle.plan.cluster} dp={handle.plan.config.dp} pp={handle.plan.config.pp} loss {loss:.7f} "
          f"expected {expected:.7f}")
    assert abs(loss - expected) <= 1e-5 * abs(expected), (loss, expected)
    assert names == {n for n, _ in model.named_parameters()}, sorted(names ^ {n for n, _ in model.named_parameters()})
    print("OK")
handle.close()  # the groups end before the interpreter does (`planner.emit.runtime.shutdown`)
'''


@pytest.mark.dist
def test_auto_parallelize_takes_an_hf_model_as_transformers_returns_it(tmp_path):
    """`auto_parallelize` on `AutoModelForCausalLM.from_config(cfg)` (key/value cache on), no plan and no cluster
    given: it plans for the hardware it runs on (cpu-local here; on rank 0, whose plan every rank runs) and its
    first loss equals one process's F.cross_entropy(model(inputs).logits, labels) (≤ 1e-5), under the model's own
    parameter names."""
    script = tmp_path / "hf_as_returned.py"
    script.write_text(HF_AS_RETURNED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "plan cpu-local" in r.stdout


def test_the_distributed_comparison_fails_on_missing_steps(tmp_path):
    """`tests/dist_util.py`, which every gloo run answers to: a run that logged fewer steps (or none) than the
    one-process reference fails, and ranks that disagree on how many steps they logged fail."""
    import torch

    from tests import dist_util

    ref = {"losses": [2.0, 1.5, 1.2], "norms": [1.0, 0.9, 0.8], "params": {"w": torch.ones(2)},
           "init": {"w": torch.zeros(2)}}
    same = {"losses": list(ref["losses"]), "norms": list(ref["norms"]), "params": {"w": torch.ones(2)}}
    assert dist_util.compare(same, ref, loss_rtol=1e-6, delta_rtol=1e-6, norm_rtol=1e-6) == []
    for short in ([], [2.0, 1.5]):
        got = same | {"losses": short}
        assert dist_util.compare(got, ref, loss_rtol=1e-6, delta_rtol=1e-6, norm_rtol=1e-6), short
    for rank, losses in enumerate([[], [2.0]]):  # rank 0 logged nothing, rank 1 one step
        torch.save({"losses": losses, "norms": [], "params": {}}, tmp_path / f"case.rank{rank}.pt")
    with pytest.raises(AssertionError, match="disagree"):
        dist_util.merged(tmp_path, "case", 2)
