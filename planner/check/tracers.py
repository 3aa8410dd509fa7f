"""The processes traces run in: `start_tracers` starts a fork server that imports the tracer (torch, FSDP,
pipelining, torch's trackers) once, and `Tracers` runs traces and the check's own capture in children of it, as many
at once as there are cores. This module imports no torch, so a caller starts the fork server first and imports torch
beside it (`autopar plan` does so before its capture and search)."""

from __future__ import annotations

#: the trace runs this machine's CPU kernels (attention, dropout), so the prediction is made from a capture of the
#: same kernels (``native``), at the traced precision: what each saves for backward differs from the GPU kernels'
KERNELS = "native"


def trace_job(plan, rank: int, script: str | None = None, **kwargs):
    """`planner.check.trace.trace_rank`, of the runtime in ``script`` (an emitted training script) if given."""
    from planner.check.trace import trace_rank  # preloaded by the fork server; the comparing side never needs it

    return trace_rank(plan, rank, code=load_script(script) if script else None, **kwargs)


def load_script(path: str):
    """An emitted training script as a module (its ``main()`` does not run: it is guarded by ``__main__``)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("autopar_script", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--script {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses and pickling look the module up by name)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: one line, not a traceback
        raise ValueError(f"--script {path}: importing it failed: {type(exc).__name__}: {exc}") from None
    missing = [n for n in ("PLAN", "build_model", "parallelize", "build_optimizer", "train_step_loss",
                           "synthetic_batch", "data_rows") if not hasattr(module, n)]
    if missing:
        raise ValueError(f"--script {path}: no {', '.join(missing)}; pass a script written by `autopar plan --emit`")
    return module


def check_capture(model: str, seq: int | None, autocast: str | None = None):
    """The capture a check predicts from (`planner.check.conformance.predicted_roles`): fp32, or for a plan that
    trains under autocast, fp32 parameters under CPU autocast to ``autocast``, as the trace runs it."""
    from profiler.api import profile_once

    return profile_once(model, seq=seq, dtype="fp32", kernels=KERNELS, autocast=autocast)


def _child(job, args: tuple, kwargs: dict, conn, prepare) -> None:
    import gc

    # what the fork server imported (torch: hundreds of thousands of objects) is never garbage; out of the
    # collector's sight, the collections a trace runs (`planner.check.trace._no_cycle_collection`) walk the trace's
    # own objects only
    gc.freeze()
    try:
        if prepare is not None:
            prepare()
        conn.send(("ok", job(*args, **kwargs)))
    except ValueError as exc:  # the user's input: reported in one line by the CLI
        conn.send(("value", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - a bug: carried to the parent with its traceback
        import traceback

        conn.send(("bug", "".join(traceback.format_exception(exc))))
    finally:
        conn.close()


#: traces run side by side at most (each a process of a few hundred MB to a few GB, on fake tensors)
AT_ONCE = 8


def tracer_cores() -> int:
    """The cores traces share: those this process may use, at most `AT_ONCE` (no more traces run at once)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, AT_ONCE))


def _tracer_context():
    """The multiprocessing context traces run in: a fork server that imports the tracer once (`Tracers`)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["planner.check.trace", "profiler.api"])
    return ctx


def start_tracers() -> Tracers:
    """Start the fork server the traces come from (`Tracers`), so that its ``import torch`` runs while the caller
    does something else (`autopar plan` calls it before its capture and search). Pass what it returns to
    `check_plan` as ``tracers`` (after `Tracers.prefetch_capture`, if the caller can); `Tracers.close` stops its
    children when no check follows."""
    from multiprocessing import forkserver

    _tracer_context()
    forkserver.ensure_running()
    return Tracers()


class Tracers:
    """Jobs in child processes (`trace_job`: `trace_rank`; `check_capture`), up to `AT_ONCE` at a time (``width``),
    sharing this machine's cores: each trace gets a fresh fake process group (torch keeps process-group names and
    DTensor's mesh caches per process, so a second world in one process resolves stale groups). Children come from a
    fork server that has imported the tracer once, so a trace costs itself, not another ``import torch``; not forked
    from this process, whose threads (a test runner's, torch's) may hold locks. ``submit`` queues a job, ``results``
    waits for them (in the parent's time: the prediction is computed meanwhile)."""

    def __init__(self, prepare=None):
        self.ctx = _tracer_context()
        self.prepare = prepare
        self.width = AT_ONCE  #: jobs running at once (the operating system shares the cores among them)
        self.cores = tracer_cores()  #: what they share (`planner.check.fold.makespan`)
        self.queue: list[tuple] = []
        self.running: dict = {}  # connection → (key, process, what it is, for errors)
        self.done: dict = {}
        self.model = None  #: the model whose capture runs under the key "capture" (`prefetch_capture`)

    def prefetch_capture(self, model: str, seq: int | None) -> None:
        """Capture ``model`` as the check will predict from it (fp32, this machine's kernels: not the plan's) in a
        child, beside what the caller does next (`autopar plan`: its search, on another core)."""
        self.submit("capture", check_capture, model, seq, what=f"capturing {model}")
        self.model = model

    def captures(self, model: str) -> bool:
        """Whether the capture of ``model`` is done or under way here."""
        return self.model == model and ("capture" in self.done or any(
            k == "capture" for k, _, _ in self.running.values()) or any(q[0] == "capture" for q in self.queue))

    def submit(self, key, job, *args, what: str = "", **kwargs) -> None:
        """Queue ``job(*args, **kwargs)`` (a module-level function) under ``key``; ``what`` names it in errors."""
        self.queue.append((key, job, args, kwargs, what or key))
        self._fill()

    def _fill(self) -> None:
        while self.queue and len(self.running) < self.width:
            key, job, args, kwargs, what = self.queue.pop(0)
            parent, child = self.ctx.Pipe(duplex=False)
            # daemonic: a caller that stops early (an error, no check after all) takes its children with it
            proc = self.ctx.Process(target=_child, args=(job, args, kwargs, child, self.prepare), daemon=True)
            proc.start()
            child.close()
            self.running[parent] = (key, proc, what)

    def results(self, *keys) -> dict:
        """Wait for the jobs under ``keys`` (all of them when none is named); every job finished so far, by key."""
        from multiprocessing.connection import wait

        def waiting() -> bool:
            return any(k not in self.done for k in keys) if keys else bool(self.running or self.queue)

        while waiting():
            if not self.running:
                raise KeyError(f"no job under {[k for k in keys if k not in self.done]}")
            for conn in wait(list(self.running)):
                key, proc, what = self.running.pop(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    proc.join()
                    self.close()
                    raise RuntimeError(f"{what} died (exit code {proc.exitcode})") from None
                proc.join()
                if kind != "ok":
                    self.close()
                    if kind == "value":
                        raise ValueError(value)
                    raise RuntimeError(f"{what} failed:\n{value}")
                self.done[key] = value
                self._fill()
        return self.done

    def close(self) -> None:
        """Stop every job still queued or running."""
        self.queue.clear()
        for _, proc, _ in self.running.values():
            proc.kill()
            proc.join()
        self.running.clear()
