"""Emit a self-contained torchrun training script for a `Plan`.

The script has no autopar import: it inlines the model's source (zoo models), builds Hugging Face models from
their config class, or loads the user's ``file.py:factory`` by path; then it inlines `costmodel.runnable` (the
rules of what can run), `planner.emit.runtime` and `planner.emit.train` (the same functions `auto_parallelize`
calls) specialised to the plan: ``if plan[...]`` branches the plan decides are resolved (`specialize_runtime`) and
only the functions and imports still reached are kept; then the plan as a literal dict, a marked ``get_batch`` for
the user's data, and a training loop logging loss, step time and peak memory per rank. Names from the model appear
only as string literals (``repr``) inside ``PLAN``, never as identifiers.
"""

from __future__ import annotations

import ast
import inspect
import pprint
import re
import shutil
import subprocess
from pathlib import Path

from costmodel import runnable
from costmodel.compression import POWERSGD_START_ITER
from planner.emit import runtime, train
from planner.emit.config import choose_init, runtime_config
from planner.plan import Plan
from planner.version import __version__
from profiler.zoo.registry import ModelSource, resolve_model

DATA_SOURCES = ("synthetic",)
#: rule functions of `costmodel.runnable` (pure, standard library only) that a runtime ``if`` may call on ``plan[...]``
#: values: the emitter decides such a test for the plan as it decides ``plan[...]`` comparisons
PURE_RULES = {"post_step_allreduce": runnable.post_step_allreduce}
#: PLAN keys the script's flags set at launch (``--compile``): emission never decides their branches
LAUNCH_KEYS = frozenset({"compile"})


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


def _merge_imports(statements: list[str], used: set[str]) -> tuple[list[str], list[str]]:
    """Deduplicate import statements, merging ``from m import a`` lines per module and dropping names the script
    does not use; (future imports, others)."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for text in statements:
        node = ast.parse(text).body[0]
        if isinstance(node, ast.Import):
            plain.update(ast.unparse(ast.Import(names=[alias])) for alias in node.names
                         if (alias.asname or alias.name.partition(".")[0]) in used)
        else:
            module = "." * node.level + (node.module or "")
            keep = [a for a in node.names if module == "__future__" or (a.asname or a.name) in used]
            if keep:
                names.setdefault(module, set()).update(ast.unparse(alias) for alias in keep)
    future = [f"from __future__ import {', '.join(sorted(names.pop('__future__')))}"] if "__future__" in names else []
    froms = [f"from {m} import {', '.join(sorted(n, key=str.lower))}" for m, n in sorted(names.items())]
    return future, sorted(plain) + froms


def _static_test(test: ast.expr, plan: dict) -> bool | None:
    """The value of an ``if`` test as far as ``plan`` decides it (``and``/``or`` short-circuit on a decided
    operand); None when it depends on anything but ``plan[...]`` and constants (and arithmetic on them: the
    data-parallel size ``plan["dp"] * plan["cp"]``)."""
    if isinstance(test, ast.BoolOp):
        values = [_static_test(v, plan) for v in test.values]
        stop = isinstance(test.op, ast.Or)  # the operand value that decides the whole test
        if stop in values:
            return stop
        return None if None in values else not stop
    allowed = (ast.Compare, ast.UnaryOp, ast.BinOp, ast.Subscript, ast.Constant, ast.Name, ast.Tuple, ast.List,
               ast.expr_context, ast.cmpop, ast.unaryop, ast.operator, ast.Call)
    for node in ast.walk(test):
        if not isinstance(node, allowed) or (isinstance(node, ast.Name) and node.id != "plan"
                                             and node.id not in PURE_RULES):
            return None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in LAUNCH_KEYS:
            return None
        if isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name) or node.keywords):
            return None
    return bool(eval(compile(ast.Expression(test), "<plan>", "eval"), {"__builtins__": {}},
                     {"plan": plan, **PURE_RULES}))


class _Specializer:
    """Drop the branches of ``if plan[...]`` tests that ``plan`` decides, editing lines so comments survive."""

    def __init__(self, text: str, plan: dict):
        self.lines = text.splitlines()
        self.keep = [True] * len(self.lines)
        self.dedent = [0] * len(self.lines)
        self.plan = plan

    def text(self) -> str:
        out = []
        for line, keep, n in zip(self.lines, self.keep, self.dedent):
            if keep:
                out.append(line[min(n, len(line) - len(line.lstrip(" "))):])
        return "\n".join(out)

    def _drop(self, first: int, last: int) -> None:  # 1-based, inclusive
        for i in range(first - 1, last):
            self.keep[i] = False

    def _shift(self, first: int, last: int, by: int) -> None:
        for i in range(first - 1, last):
            self.dedent[i] += by

    def block(self, stmts: list[ast.stmt]) -> None:
        for k, node in enumerate(stmts):
            value = _static_test(node.test, self.plan) if isinstance(node, ast.If) else None
            if value is None:
                self.visit(node)
            elif self.decide(node, value) and k + 1 < len(stmts):  # the kept branch returns: the rest is dead
                self._drop(node.end_lineno + 1, stmts[-1].end_lineno)
                return

    def visit(self, node: ast.AST) -> None:
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            if name == "orelse" and isinstance(node, ast.If) and self._is_elif(node):
                self.visit(stmts[0])  # an elif of an undecided test stays an elif
            else:
                self.block(stmts)
        for handler in getattr(node, "handlers", []):
            self.block(handler.body)

    def _is_elif(self, node: ast.If) -> bool:
        return len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and \
            self.lines[node.orelse[0].lineno - 1].lstrip().startswith("elif")

    def decide(self, node: ast.If, value: bool, first: int | None = None) -> bool:
        """Keep the branch ``value`` selects; True when that branch ends in return/raise. ``first``: the first line
        to drop when nothing is kept (the comment above the step, or above the ``if`` that an ``elif`` continues)."""
        if first is None:
            first = node.lineno
            while first > 1 and self.lines[first - 2].strip().startswith("#"):
                first -= 1
        body_first, body_last = node.test.end_lineno + 1, node.body[-1].end_lineno
        if value:
            self._drop(node.lineno, node.test.end_lineno)
            self._shift(body_first, body_last, node.body[0].col_offset - node.col_offset)
            self._drop(body_last + 1, node.end_lineno)  # else/elif branches
            self.block(node.body)
            return isinstance(node.body[-1], (ast.Return, ast.Raise))
        if not node.orelse:
            self._drop(first, node.end_lineno)
            return False
        if self._is_elif(node):
            nested = node.orelse[0]
            self._drop(node.lineno, nested.lineno - 1)
            self.lines[nested.lineno - 1] = re.sub(r"^(\s*)elif\b", r"\1if", self.lines[nested.lineno - 1])
            nested_value = _static_test(nested.test, self.plan)
            if nested_value is None:
                self.visit(nested)
                return False
            return self.decide(nested, nested_value, first)
        else_line = next(i for i in range(body_last + 1, node.orelse[0].lineno)
                         if self.lines[i - 1].strip().startswith("else"))
        self._drop(node.lineno, else_line)
        self._shift(else_line + 1, node.end_lineno, node.orelse[0].col_offset - node.col_offset)
        self.block(node.orelse)
        return isinstance(node.orelse[-1], (ast.Return, ast.Raise))


def specialize_runtime(body: str, plan: dict, roots: set[str]) -> str:
    """The runtime source for one plan: branches the plan decides removed, then only the top-level definitions
    reachable from ``roots`` (names the rest of the script uses), in their original order."""
    spec = _Specializer(body, plan)
    spec.block(ast.parse(body).body)
    text = spec.text()
    tree = ast.parse(text)
    lines = text.splitlines()
    defined: dict[str, ast.stmt] = {}
    for node in tree.body:
        for name in _defined_names(node):
            defined[name] = node
    needed, todo = set(), [n for n in roots if n in defined]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo.extend(n.id for n in ast.walk(defined[name]) if isinstance(n, ast.Name) and n.id in defined)
    chunks = []
    for node in tree.body:
        names = _defined_names(node)
        if names and not names & needed:
            continue
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        chunks.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "\n\n\n".join(chunks)


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _used_names(text: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}


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
            + ('    model.set_experts_implementation("grouped_mm")\n' if moe else "")
            + "    return HFCausalLMLoss(model)\n"
        )
        return ["import torch", "import torch.nn.functional as F", "from torch import nn"], body
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


def vocab_size(source: ModelSource, model) -> int:
    if source.vocab is not None:
        return int(source.vocab)
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    raise ValueError(f"{source.spec}: cannot tell the vocabulary size (no nn.Embedding); write get_batch yourself")


_MAIN = '''
DATA = None  # a token file (--data): 1-D .npy, or raw token ids of DATA_DTYPE (nanoGPT's .bin); None: synthetic
DATA_DTYPE = "uint16"


def get_batch(step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    \"\"\">>> YOUR DATA HERE <<< Rows ``rows`` of the global batch of ``step``: (input_ids, labels), each
    [rows, SEQ] int64, with labels[:, t] the token after input_ids[:, t] (-100: ignored).

    Each data-parallel rank asks for its own rows; every rank of one data-parallel replica for the same rows,
    except middle pipeline stages, which read no batch (`feeds_data`). Whole sequences: with context parallelism
    (cp > 1) the training step keeps each rank's part of them.
    \"\"\"
    if DATA is not None:
        return token_file_batch(DATA, step, rows, batch=PLAN["global_batch"], seq=PLAN["seq"], dtype=DATA_DTYPE)
    return synthetic_batch(step, batch=PLAN["global_batch"], seq=PLAN["seq"], vocab=VOCAB, seed=PLAN["seed"], rows=rows)


def train(steps: int = STEPS, *, checkpoint_dir: str | None = None, save_every: int = 0, resume: bool = False,
          stop_after: int | None = None) -> tuple[Parallel, list[float]]:
    \"\"\"Apply the plan and train up to optimizer step ``steps``; returns the parallel model and this launch's losses.

    With ``checkpoint_dir``: save every ``save_every`` steps and at the end of the launch; ``resume`` continues from
    its latest checkpoint (model, optimizer, learning-rate schedule, step and so the data position); ``stop_after``
    ends this launch after that many steps (a job's time limit), to be resumed.
    \"\"\"
    mesh = init_distributed(PLAN)  # checks the launch against the plan before any collective
    par = parallelize(build_model, PLAN, mesh)
    optimizer = build_optimizer(par, PLAN)
    lr_schedule = build_lr_schedule(optimizer, PLAN, steps)  # warm-up, then cosine decay to the last step
    rank = dist.get_rank()
    first = 0
    if resume:
        path = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        if path is None:
            if rank == 0:
                print(f"no checkpoint in {checkpoint_dir}: starting from step 0", flush=True)
        else:
            first = load_checkpoint(path, par, optimizer, lr_schedule)
            if rank == 0:
                print(f"resumed from {path} after step {first - 1}", flush=True)
    last = steps if stop_after is None else min(steps, first + stop_after)
    losses = []
    for step in range(first, last):
        inputs, labels = get_batch(step, data_rows(par)) if feeds_data(par) else (None, None)
        start = time.perf_counter()
        loss = train_step(par, optimizer, inputs, labels)
        elapsed = time.perf_counter() - start
        lr = lr_schedule.get_last_lr()[0]
        lr_schedule.step()
        losses.append(loss)
        if rank == 0:
            print(step_report(par, step, loss, lr, elapsed), flush=True)
        if checkpoint_dir and ((save_every and (step + 1) % save_every == 0) or step + 1 == last):
            save_checkpoint(checkpoint_dir, par, optimizer, lr_schedule, step + 1)
    return par, losses


def main() -> None:
    global DATA, DATA_DTYPE
    parser = argparse.ArgumentParser(description="Train with the plan above (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    parser.add_argument("--lr", type=float, default=PLAN["lr"], help=f"peak learning rate (default {PLAN['lr']})")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear learning-rate warm-up steps (default: a tenth of --steps), then cosine decay to "
                        f"{PLAN['min_lr_ratio']} of --lr at the last step")
    parser.add_argument("--clip-norm", type=float, default=PLAN["clip_norm"],
                        help=f"clip the global gradient norm to this (0: off; default {PLAN['clip_norm']})")
    parser.add_argument("--data", help="token file: .npy, or raw token ids (see --data-dtype); default synthetic")
    parser.add_argument("--data-dtype", default=DATA_DTYPE, choices=["uint16", "uint32", "int32", "int64"],
                        help=f"element type of a raw token file (default {DATA_DTYPE}, nanoGPT's .bin)")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here (torch.distributed.checkpoint, sharded)")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (and at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--stop-after", type=int, help="end this launch after N steps (resume later with --resume)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=PLAN["compile"], metavar="BACKEND",
                        help="torch.compile each block (default backend inductor; the plan prices it when planned "
                             "with autopar plan --compile)")
    args = parser.parse_args()
    if args.compile and args.compile not in torch.compiler.list_backends(exclude_tags=()):
        parser.error(f"--compile {args.compile}: not a torch.compile backend; choose one of "
                     f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}")
    if args.steps < 1 or args.lr <= 0 or args.clip_norm < 0 or (args.warmup_steps or 0) < 0 or args.save_every < 0:
        parser.error("--steps and --lr must be > 0; --warmup-steps, --clip-norm and --save-every ≥ 0")
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        parser.error("--resume and --save-every need --checkpoint-dir")
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    DATA, DATA_DTYPE = args.data, args.data_dtype
    warmup = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    PLAN.update(lr=args.lr, warmup_steps=warmup, clip_norm=args.clip_norm, compile=args.compile)
    train(args.steps, checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, resume=args.resume,
          stop_after=args.stop_after)
    shutdown()  # (the model went with train's frame)


if __name__ == "__main__":
    main()
'''


def emit(plan: Plan, *, steps: int = 10, data: str = "synthetic", optimizer: str = "adamw", lr: float = 1e-3,
         seed: int = 0, init: str | None = None, powersgd_start_iter: int = POWERSGD_START_ITER,
         compile: str | None = None) -> str:
    """The training script for ``plan`` as formatted Python source (run it with ``torchrun --nproc-per-node``
    ``plan.config.world``). ``init``: ``"full"`` (every rank builds the seeded model, then shards it) or ``"meta"``
    (built on the meta device, each rank initialises only its shards); None chooses by model size. ``compile``:
    the script's default ``--compile`` backend (None: the plan's, `Plan.compile`, which is None unless it was
    planned with ``--compile``)."""
    if data not in DATA_SOURCES:
        raise ValueError(f"data={data!r}: choose one of {', '.join(DATA_SOURCES)}; edit get_batch for your data")
    if steps < 1:
        raise ValueError(f"steps={steps} must be ≥ 1")
    source = resolve_model(plan.model).with_seq(plan.seq)
    model, _ = source.build(batch=1, seq=plan.seq, device="meta")
    init_mode, init_why = choose_init(plan, model, init)
    config = runtime_config(plan, model, seed=seed, optimizer=optimizer, lr=lr, init=init_mode,
                            powersgd_start_iter=powersgd_start_iter, compile=compile or plan.compile)
    vocab = vocab_size(source, model)
    model_imports, model_body = _model_section(source)
    runtime_imports, runtime_body = [], []
    for module in (runnable, runtime, train):  # one body, in dependency order; imports between them dropped
        imports_m, body_m = _split_source(inspect.getsource(module))
        runtime_imports += [i for i in imports_m if not i.startswith(("from planner", "from costmodel"))]
        runtime_body.append(body_m)
    runtime_body = "\n\n\n".join(runtime_body)
    main = _MAIN.strip("\n")
    # full_parameters is not called by the loop: kept for saving an unsharded checkpoint (and for the tests).
    roots = _used_names(main) | _used_names(model_body) | {"full_parameters"}
    runtime_body = specialize_runtime(runtime_body, config, roots)
    imports = ["import argparse", "import os", "import time", "import torch",
               "import torch.distributed as dist",
               *model_imports, *runtime_imports]
    future, others = _merge_imports(imports, _used_names("\n\n".join([model_body, runtime_body, main])))
    precision_note = (
        f"\n# precision={config['precision']} applies on GPUs only (autocast or the FSDP2 policy); on CPU (gloo) "
        "this script trains in fp32."
        if config["precision"] != "fp32" else ""
    )
    c = plan.config
    header = (
        f'"""Train a model on {plan.cluster} as autopar {__version__} planned it.\n\n'
        f"Model: {_doc_safe(plan.model)}\n"
        f"Plan: dp={c.dp} tp={c.tp} {f'cp={c.cp} ' if c.cp > 1 else ''}pp={c.pp} (vpp={c.vpp}, {c.schedule.value}) "
        f"zero={c.zero} "
        f"sp={'on' if c.sp else 'off'} grad_compress={c.grad_compress} pp_compress={c.pp_compress}.\n\n"
        f"Run: {launch_line(plan)}\n\n"
        "Needs only torch (and transformers for hf: models). Train on a token file with --data,\n"
        "or edit get_batch(). Flags: --steps --lr --warmup-steps --clip-norm --data --checkpoint-dir --save-every\n"
        "--resume --stop-after --compile (see --help).\n"
        '"""\n'
    )
    parts = [
        header,
        "\n".join(future),
        "\n".join(others),
        "# --- The plan (module names are plain strings) ---",
        f"PLAN = {pprint.pformat(config, width=110, sort_dicts=False)}\nSTEPS = {steps}\nVOCAB = {vocab}"
        + f"\n# init={init_mode}: {_doc_safe(init_why)}"
        + precision_note,
        "# --- The model ---",
        model_body,
        "# --- Parallelism: autopar's costmodel/runnable.py, planner/emit/runtime.py and train.py, as used here ---",
        runtime_body,
        "# --- Data and training loop ---",
        main,
    ]
    return format_source("\n\n\n".join(p for p in parts if p) + "\n")


def launch_line(plan: Plan) -> str:
    """The torchrun command for ``plan``: one node standalone, else the same line on each of the plan's nodes with a
    c10d rendezvous on the first (as many processes per node as the cluster has GPUs per node, or the largest count
    that divides the world: torchrun starts the same number on every node)."""
    import math

    from costmodel.cluster import load_cluster

    world = plan.config.world
    try:
        per_node = math.gcd(load_cluster(plan.cluster).gpus_per_node, world)
    except (ValueError, OSError):  # a cluster file no longer at hand: one process per device of one node
        per_node = world
    nodes = world // per_node
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {world} THIS_FILE.py"
    return (f"on each of the {nodes} nodes,\n  torchrun --nnodes {nodes} --nproc-per-node {per_node} "
            "--rdzv-backend c10d \\\n    --rdzv-endpoint FIRST_NODE_HOST:29500 --rdzv-id JOB_ID THIS_FILE.py")


def _doc_safe(text: str) -> str:
    """Text safe inside a triple-quoted docstring (names from the model are never pasted into code)."""
    return " ".join(text.replace("\\", "/").replace('"', "'").split())


def _ruff() -> str | None:
    """The ruff installed with this Python (its package knows where its binary is, whatever PATH says), or else
    one on PATH; None without either."""
    try:
        from ruff.__main__ import find_ruff_bin

        return str(find_ruff_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("ruff")


def format_source(text: str) -> str:
    """``ruff format`` the text when ruff is installed; otherwise return it unchanged (it is already valid)."""
    ruff = _ruff()
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
    from planner.files import write_atomic

    path = Path(path)
    write_atomic(path, emit(plan, **kwargs))
    return path
