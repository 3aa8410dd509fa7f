"""From a `Plan` and the model's module tree to the literal dict ``PLAN`` that `planner.emit.runtime` applies.

Both the emitted script (as a literal) and `auto_parallelize` (in-process) use this dict, so the two paths apply
the same decisions. The tensor-parallel layout is `profiler.layers.tp_layout` (``nn.Linear`` layers by the names in
`COLUMN_NAMES`, `ROW_NAMES`), the rule the capture, the cost model and the search read.
"""

from __future__ import annotations

import torch
from torch import nn

from costmodel.compression import POWERSGD_START_ITER
from costmodel.runnable import problems
from planner.emit.runtime import attention_modules, selective_of
from planner.plan import AC, Plan, parse_grad_compress
from profiler.experts import expert_modules
from profiler.layers import (
    context_parallel_ready,
    forward_problem,
    pipeline_split_problem,
    tensor_parallel_problems,
    tp_layout,
    tp_split_problem,
    tp_unsplit_linears,
)
from profiler.zoo.hf import HFCausalLMLoss
from profiler.zoo.registry import is_file_spec

OPTIMIZERS = ("adamw", "sgd")
INITS = ("full", "meta")
CPU_META_BYTES = 2 * 2**30
"""On CPU clusters (``cpu-local``, or a cluster that does not load here), models above this many fp32 parameter bytes
are initialised on the meta device."""


def block_container(plan: Plan) -> str:
    """The ModuleList holding the blocks, from the plan's layer names (``layers.3`` → ``layers``)."""
    blocks = [lay.name for lay in plan.layers if lay.name not in ("embed", "head")]
    if not blocks:
        raise ValueError(f"plan for {plan.model} has no block layers; re-plan the model")
    containers = {name.rpartition(".")[0] for name in blocks}
    if len(containers) != 1 or "" in containers:
        raise ValueError(f"plan layers {blocks[:3]}… are not numbered children of one module list; re-plan")
    return containers.pop()


def vocab_modules(model: nn.Module, container: str) -> dict:
    """The modules tensor parallelism splits along the vocabulary (Megatron-LM's vocabulary-parallel embedding and
    head), as `profiler.layers` assigns their ``vocab`` roles: the head is the last ``nn.Linear`` outside the blocks
    whose output width is the row count of an ``nn.Embedding`` outside the blocks (the token embedding; position
    embeddings stay whole). ``{"vocab": V, "vocab_embed": name | None, "vocab_head": name | None}``."""
    outside = [(n, m) for n, m in model.named_modules() if n != container and not n.startswith(container + ".")]
    embeddings = {m.num_embeddings: n for n, m in outside if isinstance(m, nn.Embedding)}
    heads = [(n, m) for n, m in outside if isinstance(m, nn.Linear) and m.out_features in embeddings]
    if not heads:
        return {"vocab": 0, "vocab_embed": None, "vocab_head": None}
    name, head = heads[-1]
    return {"vocab": head.out_features, "vocab_embed": embeddings[head.out_features], "vocab_head": name}


def tied_parameters(model: nn.Module, plan: Plan, container: str, stage_rank: list[int]) -> list[dict]:
    """Weights the model shares between modules (the GPT head tied to the token embedding), each as
    ``{"names": [first name, aliases…], "pp_ranks": [pipeline ranks holding a copy]}``.

    As in Megatron-LM, a tie between the embedding (first stage) and the head (last stage) is kept as one copy per
    stage whose gradients the runtime sums; a tie inside the blocks across pipeline ranks is refused.
    """
    stage_of = {lay.name: lay.stage for lay in plan.layers}
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    tied = []
    for names in (n for n in shared.values() if len(n) > 1):
        stages = set()
        for name in names:
            if name.startswith(container + "."):
                stages.add(stage_of[".".join(name.split(".")[: container.count(".") + 2])])
            else:
                stages.add(stage_of[_side(model, container, name)])
        ranks = sorted({stage_rank[s] for s in stages})
        if len(ranks) > 1 and any(n.startswith(container + ".") for n in names):
            raise ValueError(f"tied parameters {names} would live on pipeline ranks {ranks}; only a tie between the "
                             f"embedding and the head may span pipeline ranks; put those blocks on one stage")
        tied.append({"names": names, "pp_ranks": ranks})
    return tied


def _side(model: nn.Module, container: str, name: str) -> str:
    """``"embed"`` or ``"head"``: whether parameter ``name`` (outside the blocks) comes before or after the block
    list ``container`` in module order, judged in the deepest module holding both (a Hugging Face causal LM's
    ``lm_head`` sits beside its base model, the embedding inside it, next to the blocks)."""
    path, mine = container.split("."), name.split(".")
    depth = 0
    while depth < len(path) - 1 and mine[depth] == path[depth]:
        depth += 1
    holder = model.get_submodule(".".join(path[:depth])) if depth else model
    order = [child for child, _ in holder.named_children()]
    return "embed" if order.index(mine[depth]) < order.index(path[depth]) else "head"


def param_bytes(model: nn.Module) -> int:
    """fp32 bytes of ``model``'s parameters, each shared parameter counted once."""
    return 4 * sum(p.numel() for p in model.parameters())


def meta_threshold(plan: Plan) -> tuple[int, str]:
    """(bytes, where from): a quarter of the plan's device memory, or `CPU_META_BYTES` on CPU."""
    name = plan.cluster.partition(":")[0]
    if name != "cpu-local":  # load_cluster("cpu-local") measures this machine: not needed for a threshold
        try:
            from costmodel.cluster import load_cluster

            device = load_cluster(plan.cluster).device
            if "cpu" not in device.name.lower():
                gib = device.memory_bytes / 2**30
                return int(device.memory_bytes) // 4, f"a quarter of the {gib:.0f} GiB {device.name}"
        except (ValueError, OSError):
            pass
    return CPU_META_BYTES, f"{CPU_META_BYTES / 2**30:.0f} GiB on CPU"


def choose_init(plan: Plan, model: nn.Module, init: str | None = None) -> tuple[str, str]:
    """(``"full"`` or ``"meta"``, why): meta when the fp32 parameters exceed `meta_threshold`, unless forced."""
    size = param_bytes(model)
    if init is not None:
        if init not in INITS:
            raise ValueError(f"init={init!r}: choose one of {', '.join(INITS)}")
        return init, f"init={init} was asked for ({size / 2**30:.2f} GiB of fp32 parameters)"
    limit, where = meta_threshold(plan)
    if size > limit:
        return "meta", (f"{size / 2**30:.1f} GiB of fp32 parameters > {where}: built on the meta device, "
                        "each rank initialises only its shards")
    return "full", f"{size / 2**30:.2f} GiB of fp32 parameters ≤ {where}: every rank builds the whole model, seeded"


def runtime_config(plan: Plan, model: nn.Module, *, seed: int = 0, optimizer: str = "adamw", lr: float = 1e-3,
                   powersgd_start_iter: int = POWERSGD_START_ITER, init: str | None = None,
                   weight_decay: float | None = None, clip_norm: float = 1.0, warmup_steps: int = 0,
                   min_lr_ratio: float = 0.1, compile: str | None = None) -> dict:
    """The ``PLAN`` dict of `planner.emit.runtime` for ``plan`` applied to ``model`` (any device, meta included).

    ``init``: ``"full"`` or ``"meta"`` (see `planner.emit.runtime`), or None to choose by size (`choose_init`).
    ``powersgd_start_iter``: uncompressed steps before PowerSGD starts (`costmodel.compression.POWERSGD_START_ITER`).
    ``weight_decay``: on matrices only (None: 0.1 for AdamW, as GPT-3 and Llama train; 0
    for SGD). ``clip_norm``: the global gradient norm clipped to (0: no clipping). ``warmup_steps``,
    ``min_lr_ratio``: the learning-rate schedule (`planner.emit.train.lr_factor`). ``compile``: a
    ``torch.compile`` backend to compile each block with (None: off; the cost model does not price compilation, so
    no plan assumes it).
    """
    c = plan.config
    if compile is not None and compile not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"compile={compile!r}: not a torch.compile backend; choose one of "
                         f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}, or None")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    weight_decay = (0.1 if optimizer == "adamw" else 0.0) if weight_decay is None else weight_decay
    for label, value in (("lr", lr), ("weight_decay", weight_decay), ("clip_norm", clip_norm),
                         ("warmup_steps", warmup_steps), ("min_lr_ratio", min_lr_ratio)):
        if not isinstance(value, (int, float)) or value < 0 or (label == "min_lr_ratio" and value > 1):
            raise ValueError(f"{label}={value!r} must be a number ≥ 0" + (" and ≤ 1" if label == "min_lr_ratio"
                                                                             else ""))
    init_mode, _ = choose_init(plan, model, init)
    if plan.global_batch % (c.dp * c.mbs):
        raise ValueError(f"global_batch {plan.global_batch} is not a multiple of dp·mbs = {c.dp}·{c.mbs}")
    container = block_container(plan)
    try:
        blocks = model.get_submodule(container)
    except AttributeError:
        raise ValueError(f"plan for {plan.model} expects blocks at {container!r}, which this model lacks") from None
    # the user's own code is tried as the capture tries it (`profiler.api.runnable_facts`): a file.py model, or a
    # module given to `auto_parallelize` (its plans are named module:<class>; a meta copy of it is run), not the
    # zoo's and Hugging Face's, which follow the contract by construction
    ids = torch.zeros(1, plan.seq, dtype=torch.long, device="meta")
    user_code = is_file_spec(plan.model) or (plan.model.startswith("module:")
                                             and not isinstance(model, HFCausalLMLoss))
    if user_code and (why := forward_problem(model, ids)):
        raise ValueError(f"this plan cannot run: {why}")
    tp_forward, sp_layout = tensor_parallel_problems(model, container, ids) if user_code and c.tp > 1 \
        else ({}, "")
    if c.pp > 1 and (why := pipeline_split_problem(model, container, seq=plan.seq)):
        raise ValueError(f"pp={c.pp}: {why}")
    names = {lay.name for lay in plan.layers}
    expected = {"embed", "head"} | {f"{container}.{i}" for i in range(len(blocks))}
    if names != expected:
        missing = sorted(expected - names) or sorted(names - expected)
        raise ValueError(f"plan layers do not match the model's {len(blocks)} blocks (first difference: "
                         f"{missing[0]!r}); re-plan for this model")
    block_layers = [lay for lay in plan.layers if lay.name not in ("embed", "head")]
    ac = {lay.name: lay.ac.value for lay in block_layers if lay.ac != AC.NONE}
    if not ac and c.ac != AC.NONE:  # no per-layer choice: the configuration's default applies to every block
        ac = {lay.name: c.ac.value for lay in block_layers}
    tp_blocks = [lay.name for lay in block_layers if lay.tp]
    if c.tp > 1 and not tp_blocks:  # no per-layer choice: every block is split
        tp_blocks = [lay.name for lay in block_layers]
    # the union of the blocks' layouts (by relative name): blocks that differ (DeepSeek's and Qwen3-MoE's dense
    # first blocks beside MoE ones) each take the entries they hold (`planner.emit.runtime.block_tp_layout`)
    layout = {}
    for block in blocks:
        own = tp_layout(block)
        if c.tp > 1:
            _check_tp(plan, block, own)
        layout.update(own)
    n_stages = c.pp * c.vpp
    if plan.stages and c.pp > 1:
        stage_rank = [s.rank for s in sorted(plan.stages, key=lambda s: s.index)]
        if len(stage_rank) != n_stages:
            raise ValueError(f"plan has {len(stage_rank)} stage entries for pp·vpp = {n_stages}; re-plan")
    else:
        stage_rank = [s % c.pp for s in range(n_stages)]
    kind, rank = parse_grad_compress(c.grad_compress)
    experts = expert_modules(list(blocks))
    # what selective AC recomputes: the policy the plan was priced under (a plan file from before the field: as the
    # runtime then reads it)
    selective = selective_of({"selective": plan.selective, "cp": c.cp}, blocks)
    if selective == "attention-core" and "selective" in ac.values():
        lacking = next((name for name, mode in ac.items() if mode == "selective"
                        and not attention_modules(blocks[int(name.rpartition(".")[2])])), None)
        if lacking:
            raise ValueError(f"this plan cannot run: its selective policy attention-core checkpoints each attention's "
                             f"attend(q, k, v) call, but block {lacking} has none; re-plan this model")
    # the rules the search and runtime apply
    why = problems({**c.runnable_facts(plan.global_batch, seq=plan.seq), "compile": compile, "checkpointed": bool(ac),
                    "selective_ac": "selective" in ac.values(), "attention_core": selective != "every-other-matmul",
                    "attends": selective != "all-but-attention-core",
                    "ep": c.ep, "experts": experts["experts"],
                    "expert_dim1": experts["expert_dim1"],
                    "tp_unsplit": next(iter(tp_unsplit_linears(model)), ""), "tp_forward": tp_forward,
                    "tp_split": tp_split_problem(model, container),
                    "sp_layout": sp_layout,
                    "cp_ready": context_parallel_ready(model), "pp_split": "", "forward": ""})  # (judged above)
    if why:
        raise ValueError(f"this plan cannot run: {why[0]}")
    sp_norms = sorted({n for block in blocks for n, m in block.named_children() if "norm" in type(m).__name__.lower()})
    sp_gather = sorted({rel.rpartition(".")[0] for rel, k in layout.items() if k == "colwise"} - {""})
    return {
        "model": plan.model, "world": c.world, "pp": c.pp, "dp": c.dp, "tp": c.tp, "cp": c.cp, "ep": c.ep, **experts,
        "vpp": c.vpp,
        "schedule": c.schedule.value, "zero": c.zero, "sp": c.sp, "grad_compress": kind, "powersgd_rank": rank,
        "powersgd_start_iter": powersgd_start_iter, "pp_compress": c.pp_compress, "precision": c.precision,
        "mbs": c.mbs, "grad_accum": plan.grad_accum, "global_batch": plan.global_batch, "seq": plan.seq,
        "block_container": container, "stage_of": {lay.name: lay.stage for lay in plan.layers},
        "stage_rank": stage_rank, "ac": ac, "selective": selective if "selective" in ac.values() else None,
        "tp_blocks": tp_blocks, "tp_layout": layout, "sp_norms": sp_norms,
        "sp_gather": sp_gather, "tied": tied_parameters(model, plan, container, stage_rank) if c.pp > 1 else [],
        "optimizer": optimizer, "lr": lr, "weight_decay": weight_decay, "clip_norm": clip_norm,
        "warmup_steps": int(warmup_steps), "min_lr_ratio": min_lr_ratio, "seed": seed, "init": init_mode,
        "compile": compile,
        "mfu_per_token_rate": _mfu_rate(plan),
        **vocab_modules(model, container),
    }


def _mfu_rate(plan: Plan) -> float | None:
    """Model FLOPs utilisation per token/s of the whole job on the plan's devices (the prediction's MFU over its
    tokens/s: the same model-FLOPs count), so a run reports MFU from its measured tokens/s; None without one."""
    mfu, tps = plan.predicted.get("mfu"), plan.predicted.get("tokens_per_s")
    return mfu / tps if mfu and tps else None


def _check_tp(plan: Plan, block: nn.Module, layout: dict[str, str]) -> None:
    tp = plan.config.tp  # (a block without a column/row pair: the rules' ``tp_split``, `tp_split_problem`)
    for rel, kind in layout.items():
        linear = block.get_submodule(rel)
        width = linear.out_features if kind == "colwise" else linear.in_features
        head_dim = getattr(block.get_submodule(rel.rpartition(".")[0]) if "." in rel else block, "head_dim", 1)
        if width % (tp * head_dim):
            raise ValueError(f"tp={tp} does not divide {rel} ({width} features, head size {head_dim}); "
                             f"choose tp among the divisors of the head counts")
