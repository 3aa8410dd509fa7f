"""Multi-process checks: run many plans in one torchrun launch, compare each with a one-process reference.

One launch per world size runs every case twice in the same processes: the emitted script (imported as a module,
its ``train()`` called) and `auto_parallelize`. Each rank saves its losses and unsharded parameters; the test
process merges the ranks and compares them with a plain single-process run on the same seed and data.

Run as a script under torchrun: ``python -m torch.distributed.run --nproc-per-node N tests/dist_util.py CASES.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str):
    """Import an emitted script as a module (its ``main()`` does not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does (torch.compile looks the module up by name)
    spec.loader.exec_module(module)
    return module


def reference(script: str | Path, steps: int) -> dict:
    """One process, no parallelism: the emitted script's model, data, seed and optimizer settings (SGD, the
    script's learning-rate schedule over ``steps``), the gradient norm clipped by torch's ``clip_grad_norm_``."""
    mod = load_script(script, f"ref_{Path(script).stem}")
    plan = mod.PLAN
    assert plan["optimizer"] == "sgd" or steps == 0, "the reference trains with SGD"
    torch.manual_seed(plan["seed"])
    model = mod.build_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=plan["lr"])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: mod.lr_factor(step, plan, steps))
    losses, norms = [], []
    for step in range(steps):
        inputs, labels = mod.get_batch(step, slice(None))
        opt.zero_grad()
        loss = model(inputs, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), plan["clip_norm"] or float("inf")).item())
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "init": init,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def launch(cases: list[dict], nproc: int, workdir: Path, timeout: float = 900) -> tuple[float, str]:
    """Run ``cases`` in one torchrun launch of ``nproc`` gloo ranks; returns (wall seconds, output)."""
    manifest = workdir / f"cases_{nproc}.json"
    manifest.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        str(manifest),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun with {nproc} ranks failed (rc {proc.returncode}):\n{_root_cause(out)}"
                           f"\n... the output's end:\n{out[-6000:]}")
    return wall, out


def _root_cause(out: str) -> str:
    """The lines of a failed launch's output that say why a rank died, wherever they are: a C++ abort's
    ``terminate called …``/``what():`` (a rank killed by SIGABRT leaves no Python traceback, and the others' "Connection
    closed by peer" fills the output's end), a Python exception's last line, the case being run."""
    marks = ("terminate called", "what():", "Error:", "Exception:", "EnforceNotMet", "enforce fail", "Signal ")
    lines = [line for line in out.splitlines() if any(mark in line for mark in marks)]
    return "\n".join(dict.fromkeys(lines).keys())[:4000] or "(no line names the cause)"


def add_case(by_world: dict, work: Path, out: Path, name: str, world: int, plan, steps: int, *, resume: bool = False,
             **emit) -> Path:
    """Emit ``plan`` as ``work/name.py`` (``emit``: `planner.emit.script.write_script`'s options), save it beside,
    and add the case to the launch of its world size in ``by_world``; returns the script."""
    from planner.emit.script import write_script

    script = write_script(plan, work / f"{name}.py", steps=steps, **emit)
    plan.save(work / f"{name}.yaml")
    case = {"name": name, "script": str(script), "plan": str(work / f"{name}.yaml"), "steps": steps, "out": str(out)}
    by_world.setdefault(world, []).append(case | ({"resume": True} if resume else {}))
    return script


def launch_all(by_world: dict, work: Path) -> tuple[dict, dict]:
    """One `launch` per world size: ({"launch_N_ranks_s": wall seconds}, {world size: the failure})."""
    timing, failures = {}, {}
    for world, cases in sorted(by_world.items()):
        try:
            timing[f"launch_{world}_ranks_s"], _ = launch(cases, world, work)
        except RuntimeError as exc:
            failures[world] = str(exc)
    return timing, failures


def run_matrix(work: Path, label: str, cases: dict, resume_cases: dict, steps: int, resume_steps: int,
               extra: dict | None = None) -> tuple[Path, dict, dict]:
    """A gloo matrix: each of ``cases`` (name → (world, make plan)) emitted for ``steps`` SGD steps and run in one
    process for its reference, each of ``resume_cases`` for ``resume_steps`` AdamW steps with a resume, ``extra``
    (world → more launch entries: probes) beside them, one launch per world size. Returns (the output directory,
    name → reference, world → the launch's failure)."""
    out = work / "out"
    out.mkdir()
    by_world: dict[int, list[dict]] = {}
    refs = {}
    for name, (world, make) in cases.items():
        script = add_case(by_world, work, out, name, world, make(), steps, optimizer="sgd", lr=0.5)
        refs[name] = reference(script, steps)
    for name, (world, make) in resume_cases.items():
        refs[name] = add_case(by_world, work, out, name, world, make(), resume_steps, resume=True,
                              optimizer="adamw", lr=1e-2)
    for world, entries in (extra or {}).items():
        by_world[world].extend(entry | {"out": str(out)} for entry in entries)
    timing, failures = launch_all(by_world, work)
    print(f"\n{label} matrix: {timing}")
    return out, refs, failures


def assert_matches(matrix: tuple[Path, dict, dict], name: str, world: int, mode: str, exact: tuple) -> None:
    """The case ``name`` of a `run_matrix` matrix, run through ``mode`` (``emit``: its script; ``apply``:
    ``auto_parallelize``), equals its one-process reference: losses and updates within ``exact`` (relative), the
    gradient norm within 1e-5."""
    import pytest

    out, refs, failures = matrix
    if world in failures:
        pytest.fail(failures[world])
    got = merged(out, f"{name}.{mode}", world)
    problems = compare(got, refs[name], loss_rtol=exact[0], delta_rtol=exact[1], norm_rtol=1e-5)
    assert not problems, f"{name} via {mode}:\n" + "\n".join(problems[:10])


def merged(out_dir: Path, name: str, nproc: int) -> dict:
    """Losses of rank 0 and the union of every rank's parameters; copies held by several ranks (replicas, tied
    weights on the first and last pipeline stage) must agree."""
    params, losses, norms = {}, None, None
    for rank in range(nproc):
        got = torch.load(out_dir / f"{name}.rank{rank}.pt")
        losses = got["losses"] if losses is None else losses  # (rank 0's, even when empty: then every rank's is)
        norms = got["norms"] if norms is None else norms
        assert got["losses"] == losses, f"{name}: ranks disagree on the loss"
        assert got["norms"] == norms, f"{name}: ranks disagree on the gradient norm"
        for key, value in got["params"].items():
            if key in params:
                assert torch.allclose(value, params[key], rtol=1e-5, atol=1e-7), f"{name}: copies of {key} differ"
        params.update(got["params"])
    return {"losses": losses, "norms": norms, "params": params}


def compare(got: dict, ref: dict, *, loss_rtol: float, delta_rtol: float, norm_rtol: float) -> list[str]:
    """Problems found: losses within ``loss_rtol``; global gradient norms (before clipping) within ``norm_rtol``;
    per parameter, the update p_T − p_0 within ``delta_rtol`` of the reference update (norm-wise, plus 1e-6 of the
    largest update for parameters that barely move)."""
    problems = []
    for key in ("losses", "norms"):  # one per step on both sides: a short or empty list is a failure, not a pass
        if len(got[key]) != len(ref[key]) or not ref[key]:
            problems.append(f"{key}: {len(got[key])} steps vs {len(ref[key])} in the reference")
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        if abs(a - b) > loss_rtol * abs(b):
            problems.append(f"step {step}: loss {a:.7f} vs reference {b:.7f}")
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        if abs(a - b) > norm_rtol * abs(b):
            problems.append(f"step {step}: gradient norm {a:.7g} vs reference {b:.7g}")
    if set(got["params"]) != set(ref["params"]):
        problems.append(f"parameter names differ: {sorted(set(got['params']) ^ set(ref['params']))[:4]}")
        return problems
    deltas = {n: ref["params"][n] - ref["init"][n] for n in ref["params"]}
    floor = 1e-6 * max(d.norm().item() for d in deltas.values())
    for name, d_ref in deltas.items():
        d_got = got["params"][name] - ref["init"][name]
        err = (d_got - d_ref).norm().item()
        if err > delta_rtol * d_ref.norm().item() + floor:
            problems.append(f"{name}: update differs by {err:.3g} (reference norm {d_ref.norm().item():.3g})")
    return problems


def _main(manifest: str) -> None:
    import torch.distributed as dist

    from planner.emit import runtime, train
    from planner.emit.apply import auto_parallelize
    from planner.plan import Plan
    from profiler.zoo.registry import resolve_model

    cases = json.loads(Path(manifest).read_text())
    for case in cases:
        out = Path(case["out"])
        if case.get("meta"):
            _meta_case(case, out)
            continue
        if case.get("comm"):
            _comm_case(case, out)
            continue
        if case.get("context"):
            _context_case(case, out)
            continue
        if case.get("resume"):
            _resume_case(case, out)
            continue
        # 1. The emitted script, imported as a module (its clipping function watched for the norms it returns).
        mod = load_script(case["script"], f"emitted_{case['name']}")
        norms = []
        clip = mod.clip_grad_norm

        def watched(par, max_norm, clip=clip, norms=norms):
            norm = clip(par, max_norm)
            norms.append(norm.item())
            return norm

        mod.clip_grad_norm = watched
        batches = []  # the steps whose batch this rank read
        get_batch = mod.get_batch

        def read(step, rows, get_batch=get_batch, batches=batches):
            batches.append(step)
            return get_batch(step, rows)

        mod.get_batch = read
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        par, losses = mod.train(case["steps"])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        params = mod.full_parameters(par)
        rank = dist.get_rank()
        torch.save({"losses": losses, "norms": norms, "params": params, "batches": batches,
                    "stages": sorted(par.stage_indices), "graphs": graphs}, out / f"{case['name']}.emit.rank{rank}.pt")
        dist.barrier()
        # 2. auto_parallelize on a model built the same way.
        plan = Plan.load(case["plan"])
        torch.manual_seed(mod.PLAN["seed"])
        model = mod.build_model()
        inputs = resolve_model(plan.model).build(batch=1, seq=plan.seq, device="meta")[1]
        handle = auto_parallelize(model, inputs, plan=plan, optimizer="sgd", lr=mod.PLAN["lr"],
                                  total_steps=case["steps"], powersgd_start_iter=mod.PLAN["powersgd_start_iter"],
                                  compile=mod.PLAN["compile"])
        losses, norms = [], []
        for step in range(case["steps"]):
            batch = train.synthetic_batch(step, batch=plan.global_batch, seq=plan.seq, vocab=mod.VOCAB,
                                          seed=mod.PLAN["seed"])
            losses.append(handle.step(batch))
            norms.append(handle.grad_norm)
        params = handle.full_parameters()
        torch.save({"losses": losses, "norms": norms, "params": params},
                   out / f"{case['name']}.apply.rank{rank}.pt")
        dist.barrier()
    mod = par = model = handle = params = None  # what holds the groups goes first (`planner.emit.runtime.shutdown`)
    runtime.shutdown()


def _local_numel(par) -> int:
    """Parameter elements this rank holds (local shards of DTensors; a shared parameter once)."""
    from torch.distributed.tensor import DTensor

    seen = {id(p): p for part in par.parts for p in part.parameters()}
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in seen.values())


def _meta_case(case: dict, out: Path) -> None:
    """An init=meta script: its weights right after `parallelize` (is the model built on meta? how many parameter
    elements does this rank hold?), then its losses over ``steps``; and `auto_parallelize(init="meta")`'s losses."""
    import torch.distributed as dist

    from planner.emit import train
    from planner.emit.apply import auto_parallelize
    from planner.plan import Plan
    from profiler.zoo.registry import resolve_model

    mod = load_script(case["script"], f"emitted_{case['name']}")
    built = []
    build = mod.build_model

    def watched():
        model = build()
        built.append(all(t.is_meta for t in [*model.parameters(), *model.buffers()]))
        return model

    mod.build_model = watched
    par, _ = mod.train(0)
    rank = dist.get_rank()
    result = {"init": mod.full_parameters(par), "local_numel": _local_numel(par), "built_meta": all(built)}
    del par
    _, result["losses"] = mod.train(case["steps"])
    plan = Plan.load(case["plan"])
    with torch.device("meta"):
        model = build()
    inputs = resolve_model(plan.model).build(batch=1, seq=plan.seq, device="meta")[1]
    handle = auto_parallelize(model, inputs, plan=plan, optimizer=mod.PLAN["optimizer"], lr=mod.PLAN["lr"], init="meta",
                              total_steps=case["steps"])
    result["apply_losses"] = [
        handle.step(train.synthetic_batch(step, batch=plan.global_batch, seq=plan.seq, vocab=mod.VOCAB,
                                            seed=mod.PLAN["seed"]))
        for step in range(case["steps"])
    ]
    torch.save(result, out / f"{case['name']}.meta.rank{rank}.pt")
    dist.barrier()


class CollectiveLog:
    """A dispatch mode recording every collective a rank issues as ``(phase, op, elements of the full tensor, bytes
    on the wire)``: ring costs per rank, all-reduce 2·(n−1)/n·S, all-gather and reduce-scatter (n−1)/n·S of the full
    tensor S. Sees the
    functional collectives (DTensor redistributions) and the c10d ops (``dist.*``), forward and backward (CPU
    backward runs in the calling thread, under the mode)."""

    def __new__(cls, world: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.phase, self.log = "forward", []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                kind = next((k for k, ops in cls.OPS.items() if name in ops), None)
                if func.namespace in ("_c10d_functional", "c10d") and kind is not None:
                    tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
                    scale = world if kind == "all_gather" else 1  # elements and bytes of the full tensor
                    full = sum(t.numel() * t.element_size() for t in tensors) * scale
                    wire = full * (world - 1) / world * (2 if kind == "all_reduce" else 1)
                    self.log.append((self.phase, kind, sum(t.numel() for t in tensors) * scale, wire))
                return func(*args, **(kwargs or {}))

        return Mode()

    OPS = {"all_reduce": ("all_reduce", "all_reduce_", "allreduce_"),
           "all_gather": ("all_gather_into_tensor", "all_gather_into_tensor_out", "allgather_", "_allgather_base_"),
           "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_", "_reduce_scatter_base_")}


def _resume_case(case: dict, out: Path) -> None:
    """The emitted script trained ``steps`` straight, then again as two launches: half the steps saving a
    checkpoint (``stop_after``), a fresh `train` resuming from it for the rest. Saves both runs' losses and the
    checkpoint's path."""
    import torch.distributed as dist

    mod = load_script(case["script"], f"resume_{case['name']}")
    steps, ckpt = case["steps"], str(out / f"{case['name']}.ckpt")
    _, straight = mod.train(steps)
    _, first = mod.train(steps, checkpoint_dir=ckpt, stop_after=steps // 2)
    dist.barrier()
    _, rest = mod.train(steps, checkpoint_dir=ckpt, resume=True)
    # the same through auto_parallelize's handle: step, save, and a new handle that loads and continues
    from planner.emit import train
    from planner.emit.apply import auto_parallelize
    from planner.plan import Plan
    from profiler.zoo.registry import resolve_model

    plan = Plan.load(case["plan"])
    inputs = resolve_model(plan.model).build(batch=1, seq=plan.seq, device="meta")[1]

    def handle():
        torch.manual_seed(mod.PLAN["seed"])
        return auto_parallelize(mod.build_model(), inputs, plan=plan, optimizer="adamw", lr=mod.PLAN["lr"],
                                total_steps=steps)

    def batch(step):
        return train.synthetic_batch(step, batch=plan.global_batch, seq=plan.seq, vocab=mod.VOCAB,
                                     seed=mod.PLAN["seed"])

    a = handle()
    handle_losses = [a.step(batch(step)) for step in range(steps // 2)]
    a.save(str(out / f"{case['name']}.handle_ckpt"))
    b = handle()
    start = b.load(str(out / f"{case['name']}.handle_ckpt"))
    handle_losses += [b.step(batch(step)) for step in range(start, steps)]
    torch.save({"straight": straight, "resumed": first + rest, "checkpoint": mod.latest_checkpoint(ckpt),
                "first_half": f"{ckpt}/step-{steps // 2:08d}", "handle": handle_losses},
               out / f"{case['name']}.resume.rank{dist.get_rank()}.pt")
    dist.barrier()


def _comm_case(case: dict, out: Path) -> None:
    """The collectives of one forward and one backward of each emitted script in ``case["comm"]`` (name → path)."""
    import torch.distributed as dist

    result = {}
    for name, script in case["comm"].items():
        mod = load_script(script, f"comm_{name}")
        mesh = mod.init_distributed(mod.PLAN)
        par = mod.parallelize(mod.build_model, mod.PLAN, mesh)
        inputs, labels = mod.get_batch(0, slice(None))
        mode = CollectiveLog(dist.get_world_size())
        with mode, mod.loss_context(mod.PLAN):
            loss = par.loss_fn(par.modules[0](inputs), labels)
            mode.phase = "backward"
            loss.backward()
        result[name] = mode.log
    torch.save(result, out / f"{case['name']}.rank{dist.get_rank()}.pt")
    dist.barrier()


def _context_case(case: dict, out: Path) -> None:
    """For each context-parallel script in ``case["context"]`` (name → path): what its model sees (the shape of the
    token batch entering it, its ``context_positions``) and the collectives of one forward and one backward of this
    rank's rows, cut to its part of the sequence as the training step cuts them (`CollectiveLog` over as many ranks
    as the plan's cp: its sizes are right for the cp group's collectives)."""
    import torch.distributed as dist

    result = {}
    for name, script in case["context"].items():
        mod = load_script(script, f"context_{name}")
        mesh = mod.init_distributed(mod.PLAN)
        par = mod.parallelize(mod.build_model, mod.PLAN, mesh)
        inputs, labels = mod.get_batch(0, mod.data_rows(par))
        x, y = mod.context_tokens(par, inputs), mod.context_tokens(par, labels)
        seen = []
        hook = par.parts[0].register_forward_pre_hook(lambda module, args, seen=seen: seen.append(tuple(args[0].shape)))
        mode = CollectiveLog(mod.PLAN["cp"])
        with mode, mod.loss_context(mod.PLAN):
            loss = par.loss_fn(par.modules[0](x), y)
            mode.phase = "backward"
            loss.backward()
        hook.remove()
        result[name] = {"log": mode.log, "inputs": seen, "positions": par.parts[0].context_positions.tolist(),
                        "cp_rank": mesh["cp"].get_local_rank()}
    torch.save(result, out / f"{case['name']}.rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1])
