"""autopar's planner: from a captured model and a cluster to a plan, and from a plan to code that trains.

Rooms: `planner.search` (outer search, ILP, bounds, what-if sweeps) → `planner.plan` (the plan file every room
shares) → `planner.emit` (the runtime, the script emitter, `auto_parallelize`), `planner.report` (what `inspect`
shows), `planner.validate` (run plans and compare), `planner.cli` (the `autopar` command, over all of them).

The public API is importable from here (``from planner import auto_parallelize, Plan``); names load on first use,
so ``import planner`` stays cheap for the command line.
"""

from __future__ import annotations

import importlib

from planner.version import __version__

#: public name -> the module that defines it
_PUBLIC = {
    "Plan": "planner.plan",
    "LayerStrategy": "planner.plan",
    "StageInfo": "planner.plan",
    "ParallelConfig": "planner.plan",
    "auto_parallelize": "planner.emit.apply",
    "ParallelHandle": "planner.emit.apply",
    "synthetic_batch": "planner.emit.train",
    "emit": "planner.emit.script",
    "write_script": "planner.emit.script",
    "search": "planner.search.outer",
    "make_plan": "planner.search.outer",
    "NoPlanFits": "planner.search.outer",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'planner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
