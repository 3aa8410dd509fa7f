"""Measure emitted training scripts from outside: run under torchrun, one launch for several plans.

``python -m torch.distributed.run --standalone --nproc-per-node N planner/validate/driver.py CASES.json OUTDIR``

CASES.json lists ``{"name", "script", "steps", "warmup"}``; a name listed more than once is measured once per
listing, in the list's order, and its rounds pooled (`combine`): listing the plans round after round spreads a
drift in the machine's speed over all of them instead of the few that ran while it lasted. Each rank imports every
script as a module (its ``main()`` does not run), builds the plan with the script's own functions
(``init_distributed``, ``parallelize``, ``build_optimizer``, ``get_batch``, ``train_step``) and times it without
changing a line of it:

- step: ``train_step`` wall time after a barrier, for ``warmup + steps`` steps (the first ``warmup`` are dropped);
- forward: module forward hooks on each local model part (prepended pre-hook, appended post-hook, so FSDP's own
  hooks, and their parameter all-gathers, fall inside);
- backward: ``torch.autograd.backward`` / ``torch.autograd.grad`` wrapped (``loss.backward()`` and the pipeline
  stages' backward both go through them; nested calls count once);
- optimizer: ``Optimizer`` step pre/post hooks, and the script's gradient clipping before it (its
  ``clip_grad_norm``, wrapped where the script has one), as the cost model's ``optimizer`` part holds both;
- exposed communication: one extra step under ``torch.profiler``; the union of the main thread's intervals inside
  communication ops (``c10d::*``, ``_c10d_functional::wait_tensor``, FSDP all-gather/reduce waits), split into the
  part inside forward/backward and the rest, less what falls inside the optimizer phase (counted there), scaled to
  the unprofiled step time (the profiler slows ops down);
- peak memory: on CUDA ``max_memory_allocated`` (reset per plan); on CPU the largest resident set size sampled
  after every forward, backward and step, minus the resident size before the model was built.

Each rank writes ``OUTDIR/rank{R}.json``. This file imports only torch and the standard library, so it runs next
to an emitted script on any machine.
"""

import gc
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

COMM_PREFIXES = ("c10d::", "_c10d_functional::wait_tensor", "FSDP::all_gather", "FSDP::post_backward_rs_wait",
                 "FSDP::post_backward_reduce", "nccl:", "gloo:")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class Timer:
    """Accumulates phase times of the current step; records profiler ranges while profiling."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()
        self.profiling = False
        self.depth = 0
        self.peak_rss = 0

    def reset(self) -> None:
        self.acc = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.open: dict = {}

    def sample_memory(self) -> None:
        if self.device.type == "cpu":
            self.peak_rss = max(self.peak_rss, rss_bytes())

    def start(self, phase: str, key=None) -> None:
        rf = None
        if self.profiling:
            rf = torch.profiler.record_function(f"validate::{phase}")
            rf.__enter__()
        self.open[(phase, key)] = (time.perf_counter(), rf)

    def stop(self, phase: str, key=None) -> None:
        t0, rf = self.open.pop((phase, key), (None, None))
        if t0 is None:
            return
        if rf is not None:
            rf.__exit__(None, None, None)
        self.acc[phase] += time.perf_counter() - t0
        self.sample_memory()


TIMER: Timer | None = None
_orig_backward = torch.autograd.backward
_orig_grad = torch.autograd.grad


def _wrap(fn):
    def wrapped(*args, **kwargs):
        t = TIMER
        if t is None or t.depth:
            return fn(*args, **kwargs)
        t.depth += 1
        t.start("backward")
        try:
            return fn(*args, **kwargs)
        finally:
            t.stop("backward")
            t.depth -= 1

    return wrapped


torch.autograd.backward = _wrap(_orig_backward)
torch.autograd.grad = _wrap(_orig_grad)


def load_script(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _union(intervals: list) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(xs: list, ys: list) -> float:
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def comm_from_profile(prof) -> dict:
    """Seconds of the profiled step the main thread spent in communication: inside forward/backward and outside
    them but not inside the optimizer phase (which holds its own: `measure` times the clipping and the step)."""
    events = prof.events()
    threads = [e.thread for e in events if e.name == "validate::step"]
    if not threads:
        return {"comm_s": 0.0, "comm_in_compute_s": 0.0, "step_s": 0.0}
    main = threads[0]
    comm, compute, step, optim = [], [], [], []
    for e in events:
        if e.thread != main:
            continue
        r = e.time_range
        iv = (r.start / 1e6, r.end / 1e6)
        if e.name == "validate::step":
            step.append(iv)
        elif e.name in ("validate::forward", "validate::backward"):
            compute.append(iv)
        elif e.name == "validate::optimizer":
            optim.append(iv)
        elif e.name.startswith(COMM_PREFIXES):
            comm.append(iv)
    comm_u, compute_u = _union(comm), _union(compute)
    # what the optimizer phase timed (the clipping's all-reduce, ZeroRedundancyOptimizer's broadcasts) is its own
    return {"comm_s": sum(b - a for a, b in comm_u) - _overlap(comm_u, _union(optim)),
            "comm_in_compute_s": _overlap(comm_u, compute_u),
            "step_s": sum(b - a for a, b in _union(step))}


def measure(mod, steps: int, warmup: int) -> dict:
    global TIMER
    plan = mod.PLAN
    base_rss = rss_bytes()
    mesh = mod.init_distributed(plan)
    par = mod.parallelize(mod.build_model, plan, mesh)
    opt = mod.build_optimizer(par, plan)
    device = par.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer(device)
    handles = []
    for k, module in enumerate(par.modules):
        handles.append(module.register_forward_pre_hook(lambda m, a, k=k: timer.start("forward", k), prepend=True))
        handles.append(module.register_forward_hook(lambda m, a, o, k=k: timer.stop("forward", k)))
    handles.append(opt.register_step_pre_hook(lambda o, a, kw: timer.start("optimizer")))
    handles.append(opt.register_step_post_hook(lambda o, a, kw: timer.stop("optimizer")))
    clip = getattr(mod, "clip_grad_norm", None)
    if clip is not None:  # the script's train step looks it up in its module at every call

        def timed_clip(*args, **kwargs):
            timer.start("optimizer", "clip")
            try:
                return clip(*args, **kwargs)
            finally:
                timer.stop("optimizer", "clip")

        mod.clip_grad_norm = timed_clip
    TIMER = timer
    # as the script's own loop reads batches: middle pipeline stages read none (scripts emitted before feeds_data
    # existed: every rank)
    rows_of = mod.data_rows(par) if getattr(mod, "feeds_data", lambda _: True)(par) else None

    def batch(step: int):
        return mod.get_batch(step, rows_of) if rows_of is not None else (None, None)

    rows, losses = [], []
    try:
        for step in range(warmup + steps):
            inputs, labels = batch(step)
            dist.barrier()
            timer.reset()
            t0 = time.perf_counter()
            loss = mod.train_step(par, opt, inputs, labels)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            timer.sample_memory()
            losses.append(loss)
            if step >= warmup:
                rows.append({"step": elapsed, **timer.acc})
        # one profiled step for the communication share
        inputs, labels = batch(warmup + steps)
        dist.barrier()
        timer.reset()
        timer.profiling = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function("validate::step"):
                mod.train_step(par, opt, inputs, labels)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        timer.profiling = False
        comm = comm_from_profile(prof)
    finally:
        TIMER = None
        for h in handles:
            h.remove()
        if clip is not None:
            mod.clip_grad_norm = clip
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    scale = med["step"] / comm["step_s"] if comm["step_s"] > 0 else 1.0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = max(0, timer.peak_rss - base_rss)
    out = {
        "step_s": med["step"], "steps_s": [r["step"] for r in rows],
        "forward_s": med["forward"], "backward_s": med["backward"], "optimizer_s": med["optimizer"],
        "comm_s": comm["comm_s"] * scale, "comm_in_compute_s": comm["comm_in_compute_s"] * scale,
        "profiled_step_s": comm["step_s"], "peak_memory_bytes": peak, "losses": losses,
        "device": str(device), "backend": dist.get_backend(),
    }
    del par, opt
    gc.collect()
    return out


def combine(rounds: list) -> dict:
    """One plan measured in several rounds: its timed steps pooled (the step time their median), each part's time
    the median over the rounds, the peak memory the largest; the losses are the first round's (each round trains
    the same steps from the same initialisation)."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    out["steps_s"] = [t for r in rounds for t in r["steps_s"]]
    out["step_s"] = statistics.median(out["steps_s"])
    for key in ("forward_s", "backward_s", "optimizer_s", "comm_s", "comm_in_compute_s", "profiled_step_s"):
        out[key] = statistics.median(r[key] for r in rounds)
    out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in rounds)
    out["wall_s"] = sum(r["wall_s"] for r in rounds)
    out["rounds"] = len(rounds)
    return out


def main() -> None:
    cases_path, out_dir = sys.argv[1], sys.argv[2]
    cases = json.loads(open(cases_path).read())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rounds: dict = {}
    rank = int(os.environ.get("RANK", "0"))
    for i, case in enumerate(cases):
        mod = load_script(case["script"], f"autopar_case_{i}")
        t0 = time.perf_counter()
        result = measure(mod, int(case["steps"]), int(case["warmup"]))
        result["wall_s"] = time.perf_counter() - t0
        rounds.setdefault(case["name"], []).append(result)
        if rank == 0:
            print(f"[validate] {case['name']}: step {result['step_s'] * 1e3:.1f} ms", flush=True)
    results = {name: combine(runs) for name, runs in rounds.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "cases": results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
