"""Emit a self-contained torchrun training script for a `Plan`.

The script has no autopar import: it inlines the model's source (zoo models), builds Hugging Face models from
their config class, or loads the user's ``file.py:factory`` by path; then it inlines `planner.runtime` (the same
functions `auto_parallelize` calls), the plan as a literal dict, a marked ``get_batch`` for the user's data, and a
training loop logging loss, step time and peak memory per rank. Names from the model appear only as string
literals (``repr``) inside ``PLAN``, never as identifiers.
"""

from __future__ import annotations

import ast
import inspect
import pprint
import shutil
import subprocess
from pathlib import Path

from planner import __version__, runtime
from planner.emit_config import runtime_config
from planner.plan import Plan
from profiler.zoo.registry import ModelSource, resolve_model

DATA_SOURCES = ("synthetic",)


def _split_source(text: str) -> tuple[list[str], str]:
    """(top-level import statements, the rest without the module docstring and those imports)."""
    tree = ast.parse(text)
    lines = text.splitlines()
    drop: set[int] = set()
    imports = []
    for i, node in enumerate(tree.body):
        is_doc = i == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or is_doc:
            drop.update(range(node.lineno - 1, node.end_lineno))
            if not is_doc:
                imports.append(ast.unparse(node))
    body = "\n".join(line for k, line in enumerate(lines) if k not in drop).strip("\n")
    return imports, body


def _merge_imports(statements: list[str]) -> tuple[list[str], list[str]]:
    """Deduplicate import statements, merging ``from m import a`` lines per module; (future imports, others)."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for text in statements:
        node = ast.parse(text).body[0]
        if isinstance(node, ast.Import):
            plain.update(ast.unparse(ast.Import(names=[alias])) for alias in node.names)
        else:
            module = "." * node.level + (node.module or "")
            names.setdefault(module, set()).update(ast.unparse(alias) for alias in node.names)
    future = [f"from __future__ import {', '.join(sorted(names.pop('__future__')))}"] if "__future__" in names else []
    froms = [f"from {m} import {', '.join(sorted(n, key=str.lower))}" for m, n in sorted(names.items())]
    return future, sorted(plain) + froms


def _model_section(source: ModelSource) -> tuple[list[str], str]:
    """Imports and code defining ``build_model()`` for the plan's model."""
    if source.family == "hf":
        from profiler.zoo import hf

        config = source.config
        default = type(config)().to_dict()
        overrides = {k: v for k, v in config.to_dict().items() if default.get(k, object()) != v
                     and k not in ("transformers_version", "architectures", "model_type")}
        loss_src = inspect.getsource(hf.HFCausalLMLoss)
        moe = hf._is_moe(config)
        body = (
            f"{loss_src}\n\n"
            f"HF_MODEL_TYPE = {config.model_type!r}\n"
            f"HF_OVERRIDES = {pprint.pformat(overrides, width=100, sort_dicts=True)}\n\n\n"
            "def build_model() -> nn.Module:\n"
            '    """A Hugging Face model from its config class with random weights (nothing downloaded)."""\n'
            "    from transformers import AutoConfig, AutoModelForCausalLM\n\n"
            "    config = AutoConfig.for_model(HF_MODEL_TYPE, **HF_OVERRIDES)\n"
            "    model = AutoModelForCausalLM.from_config(config)\n"
            + ('    model.set_experts_implementation("batched_mm")\n' if moe else "")
            + "    return HFCausalLMLoss(model)\n"
        )
        return ["import torch", "from torch import nn"], body
    if source.family == "file":
        assert source.path is not None and source.factory is not None
        body = (
            f"MODEL_FILE = {str(source.path)!r}\nMODEL_FACTORY = {source.factory!r}\n\n\n"
            "def build_model() -> nn.Module:\n"
            '    """The model from your factory (loaded by path; it returns (model, example_inputs))."""\n'
            "    spec = importlib.util.spec_from_file_location('user_model', MODEL_FILE)\n"
            "    module = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(module)\n"
            "    factory = getattr(module, MODEL_FACTORY)\n"
            "    params = inspect.signature(factory).parameters\n"
            "    kwargs = {k: v for k, v in {'batch': 1, 'seq': PLAN['seq']}.items() if k in params}\n"
            "    model, _inputs = factory(**kwargs)\n"
            "    return model\n"
        )
        return ["import importlib.util", "import inspect", "from torch import nn"], body
    path = source.source_file()
    assert path is not None
    imports, body = _split_source(path.read_text())
    expr = source.model_expr()
    body = (
        f"# --- copied from profiler/zoo/{path.name} (autopar {__version__}) ---\n\n{body}\n\n\n"
        "def build_model() -> nn.Module:\n"
        f"    return {expr}\n"
    )
    return imports + ["from torch import nn"], body


def _vocab(source: ModelSource, model) -> int:
    if source.vocab is not None:
        return int(source.vocab)
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    raise ValueError(f"{source.spec}: cannot tell the vocabulary size (no nn.Embedding); write get_batch yourself")


_MAIN = '''
def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """>>> YOUR DATA HERE <<< The global batch of ``step``: (input_ids, labels), each [GLOBAL_BATCH, SEQ] int64.

    Return the same global batch on every rank; each data-parallel rank trains on its own rows of it.
    """
    return synthetic_batch(step, batch=PLAN["global_batch"], seq=PLAN["seq"], vocab=VOCAB, seed=PLAN["seed"])


def train(steps: int = STEPS) -> tuple[Parallel, list[float]]:
    """Apply the plan and train ``steps`` optimizer steps; returns the parallel model and the losses."""
    mesh = init_distributed(PLAN)  # checks the launch against the plan before any collective
    par = parallelize(build_model, PLAN, mesh)
    optimizer = build_optimizer(par, PLAN)
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        inputs, labels = get_batch(step)
        start = time.perf_counter()
        loss = train_step(par, optimizer, inputs, labels)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        peak = peak_memory_bytes(par.device) / 2**20
        print(f"[rank {rank}] step {step} loss {loss:.5f} time {elapsed * 1e3:.1f} ms peak memory {peak:.0f} MiB",
              flush=True)
    return par, losses


def main() -> None:
    train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def emit(plan: Plan, *, steps: int = 10, data: str = "synthetic", optimizer: str = "adamw", lr: float = 1e-3,
         seed: int = 0) -> str:
    """The training script for ``plan`` as formatted Python source (run it with ``torchrun --nproc-per-node``
    ``plan.config.world``)."""
    if data not in DATA_SOURCES:
        raise ValueError(f"data={data!r}: choose one of {', '.join(DATA_SOURCES)}; edit get_batch for your data")
    if steps < 1:
        raise ValueError(f"steps={steps} must be ≥ 1")
    source = resolve_model(plan.model).with_seq(plan.seq)
    model, _ = source.build(batch=1, seq=plan.seq, device="meta")
    config = runtime_config(plan, model, seed=seed, optimizer=optimizer, lr=lr)
    vocab = _vocab(source, model)
    model_imports, model_body = _model_section(source)
    runtime_imports, runtime_body = _split_source(inspect.getsource(runtime))
    imports = ["import time", "import torch", "import torch.distributed as dist", *model_imports, *runtime_imports]
    future, others = _merge_imports(imports)
    c = plan.config
    header = (
        f'"""Train a model on {plan.cluster} as autopar {__version__} planned it.\n\n'
        f"Model: {_doc_safe(plan.model)}\n"
        f"Plan: dp={c.dp} tp={c.tp} pp={c.pp} (vpp={c.vpp}, {c.schedule.value}) zero={c.zero} "
        f"sp={'on' if c.sp else 'off'} grad_compress={c.grad_compress} pp_compress={c.pp_compress}.\n\n"
        f"Run: torchrun --standalone --nproc-per-node {c.world} THIS_FILE.py\n\n"
        "Needs only torch (and transformers for hf: models). Edit get_batch() to train on your data.\n"
        '"""\n'
    )
    parts = [
        header,
        "\n".join(future),
        "\n".join(others),
        "# --- The plan (module names are plain strings) ---",
        f"PLAN = {pprint.pformat(config, width=110, sort_dicts=False)}\nSTEPS = {steps}\nVOCAB = {vocab}",
        "# --- The model ---",
        model_body,
        "# --- Parallelism: copied from autopar's planner/runtime.py ---",
        runtime_body,
        "# --- Data and training loop ---",
        _MAIN.strip("\n"),
    ]
    return format_source("\n\n\n".join(p for p in parts if p) + "\n")


def _doc_safe(text: str) -> str:
    """Text safe inside a triple-quoted docstring (names from the model are never pasted into code)."""
    return " ".join(text.replace("\\", "/").replace('"', "'").split())


def format_source(text: str) -> str:
    """``ruff format`` the text when ruff is installed; otherwise return it unchanged (it is already valid)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        return text
    for args in (["check", "--select", "I", "--fix", "--exit-zero"], ["format"]):  # sort imports, then format
        result = subprocess.run([ruff, *args, "--isolated", "--line-length", "120", "--stdin-filename", "train.py",
                                 "-"], input=text, capture_output=True, text=True, check=False)
        if result.returncode == 0 and result.stdout:
            text = result.stdout
    return text


def write_script(plan: Plan, path: str | Path, **kwargs) -> Path:
    """Write ``emit(plan, **kwargs)`` to ``path`` and return it."""
    from planner.cli import write_atomic

    path = Path(path)
    write_atomic(path, emit(plan, **kwargs))
    return path
