"""Imports point one way: no module of the project imports another that imports it back (directly or through a
cycle), every room imports only the rooms its ``__init__`` docstring allows, and the code that runs inside torchrun
(the runtime the emitter inlines, the validation driver) imports only torch and the standard library.

Every ``import`` statement counts, at module level or inside a function or an ``if TYPE_CHECKING:`` block: a lazy
import is still a dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("profiler", "costmodel", "planner")

#: room -> the rooms it may import (a room is a top-level package or a subpackage of planner, or one of planner's
#: top-level modules). Mirrors each package's ``__init__`` docstring.
ALLOWED = {
    "profiler": {"profiler"},
    "costmodel": {"costmodel", "profiler"},
    "planner.version": set(),
    "planner.files": set(),
    "planner.plan": {"costmodel", "planner.version", "planner.files"},
    "planner.search": {"planner.search", "planner.plan", "costmodel", "profiler"},
    "planner.emit": {"planner.emit", "planner.plan", "planner.version", "planner.files", "planner.search",
                     "costmodel", "profiler"},
    "planner.report": {"planner.report", "planner.plan", "costmodel", "profiler"},
    "planner.validate": {"planner.validate", "planner.plan", "planner.search", "planner.emit", "costmodel",
                         "profiler"},
    "planner.check": {"planner.check", "planner.plan", "planner.emit", "planner.search", "costmodel", "profiler"},
    "planner.cli": {"planner.cli", "planner.plan", "planner.files", "planner.search", "planner.emit",
                    "planner.report", "planner.validate", "planner.check", "costmodel", "profiler"},
    "planner.__main__": {"planner.cli"},
    "planner": {"planner.version"},  # planner/__init__: the public names load lazily, by string
}

#: modules that run inside torchrun next to (or copied into) a user's script: torch and the standard library only
#: (costmodel.runnable, the rules of what can run, is inlined beside the runtime and imports nothing of torch even)
TORCH_ONLY = {"planner.emit.runtime": {"costmodel.runnable"},
              "planner.emit.train": {"planner.emit.runtime", "costmodel.runnable"},
              "planner.validate.driver": set(), "costmodel.runnable": set()}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (``from pkg import sub`` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import a.b.c` of a package path: the deepest project module named
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "planner" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def test_the_walker_sees_lazy_and_type_checking_imports():
    assert "planner.search.outer" in GRAPH["planner.emit.apply"]  # imported inside a function
    assert "planner.emit.runtime" in GRAPH["planner.emit.train"]
    assert "costmodel.layercost" in GRAPH["costmodel.estimate"]


def test_no_import_cycles():
    """Tarjan's strongly connected components over the project's import graph: every one is a single module."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_rooms_import_only_what_they_may():
    bad = []
    for module, deps in sorted(GRAPH.items()):
        room = _room(module)
        allowed = ALLOWED.get(room)
        assert allowed is not None, f"{module}: room {room!r} has no entry in ALLOWED (add one, and its docstring)"
        bad += [f"{module} -> {d}" for d in sorted(deps) if _room(d) != room and _room(d) not in allowed]
    assert not bad, "imports against the rooms' rules:\n" + "\n".join(bad)


def test_torchrun_side_imports_only_torch():
    for module, allowed in TORCH_ONLY.items():
        assert GRAPH[module] <= allowed, f"{module} imports {sorted(GRAPH[module] - allowed)}"
        tree = ast.parse(MODULES[module].read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        outside = roots - set(sys.stdlib_module_names) - {"torch", "planner", "costmodel", "__future__"}
        if module == "costmodel.runnable":
            outside |= roots & {"torch"}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_every_package_says_what_it_holds_and_may_import():
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert doc, f"{path} has no docstring"
            if name.startswith("planner."):
                assert "may import" in doc.lower(), f"{path}: say what the room may import"


def test_public_api_from_the_top():
    code = ("import sys; import planner; assert 'torch' not in sys.modules, 'import planner pulls in torch'; "
            "from planner import auto_parallelize, Plan, search, write_script, __version__; "
            "assert Plan.__module__ == 'planner.plan' and callable(auto_parallelize) and callable(search); "
            "import costmodel, profiler")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
