"""Group a `ModelGraph`'s nodes into layers and say how each node behaves under tensor parallelism.

Layers follow the module hierarchy: the repeated blocks are the children of the largest numbered container (the
``nn.ModuleList`` of a transformer, e.g. ``layers.7`` or ``model.model.layers.7``); everything that runs before
the first block is the ``embed`` layer and everything after the last one the ``head``. Ops that run between
two blocks outside any block stay with the block before them. Identical blocks get the same signature.

Tensor-parallel roles follow Megatron-LM (Shoeybi et al. 2019, §3): inside a block, linears that read the
replicated hidden state are split column-wise (their outputs are sharded by heads or FFN columns) and the linear
that returns to the hidden size is split row-wise (its output needs an all-reduce, or a reduce-scatter with
sequence parallelism). Which linear is which is read from the module names that the zoo and the common Hugging
Face families use (`COLUMN_NAMES`, `ROW_NAMES`); every other node is ``sharded`` when it consumes a sharded
value and ``replicated`` otherwise. A block with no recognised linear pair has no roles, and the planner will not
tensor-parallelise it.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections import Counter

from torch import nn

from profiler.graph import LINEAR_OP, Layer, LayerGraph, ModelGraph, NodeInfo

#: Linear names split column-wise (zoo: wq/wk/wv/w1/w3; Llama-style HF: *_proj; BERT: query/key/value). The runtime
#: splits ``nn.Linear`` layers only (`tp_layout`): Hugging Face GPT-2's c_attn (fused q/k/v), c_fc and c_proj are
#: ``Conv1D`` modules, which it leaves whole, so GPT-2 gets no tensor parallelism (`tp_split_problem`).
COLUMN_NAMES = ("wq", "wk", "wv", "w1", "w3", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                "query", "key", "value", "fc1", "intermediate.dense", "c_attn", "c_fc")
#: Linear names split row-wise.
ROW_NAMES = ("wo", "w2", "o_proj", "down_proj", "out_proj", "fc2", "attention.output.dense", "output.dense",
             "c_proj")

_INDEX = re.compile(r"^(?P<container>(?:[^.]+\.)*?[^.]+)\.(?P<idx>\d+)(?:\.|$)")


def _block_key(path: str) -> tuple[str, int] | None:
    m = _INDEX.match(path)
    return (m["container"], int(m["idx"])) if m else None


def find_block_container(graph: ModelGraph) -> str:
    """The module path whose numbered children run the most distinct blocks (``''`` when there is none)."""
    counts: Counter[str] = Counter()
    seen = set()
    for n in graph.nodes:
        key = _block_key(n.module_path)
        if key and key not in seen:
            seen.add(key)
            counts[key[0]] += 1
    if not counts:
        return ""
    best = max(counts.values())
    return next(c for c, k in counts.items() if k == best)


def _matches(path: str, names: tuple[str, ...]) -> bool:
    return any(path == n or path.endswith("." + n) for n in names)


def tp_layout(block: nn.Module) -> dict[str, str]:
    """``{relative linear name: "colwise" | "rowwise"}`` for one block, by module name: the ``nn.Linear`` layers
    tensor parallelism splits (`planner.emit.runtime.apply_tp`). One rule for the capture (`tp_split_problem`, the
    arch fact ``tp_split``) and the emitter."""
    layout = {}
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            if _matches(name, COLUMN_NAMES):
                layout[name] = "colwise"
            elif _matches(name, ROW_NAMES):
                layout[name] = "rowwise"
    return layout


def tp_split_problem(model: nn.Module, container: str) -> str:
    """Why tensor parallelism cannot split ``model``'s blocks (the list at ``container``): a block without both a
    column- and a row-parallel ``nn.Linear`` by name (`tp_layout`), which the runtime needs to split it; "" when
    every block has them (or the model has no block list: judged elsewhere). The arch fact ``tp_split``, judged by
    `costmodel.runnable.problems` for the search and the emitter."""
    blocks = model.get_submodule(container) if container else None
    if blocks is None:
        return ""
    for i, block in enumerate(blocks):
        kinds = set(tp_layout(block).values())
        if kinds != {"colwise", "rowwise"}:
            named = [f"{rel} ({type(m).__name__})" for rel, m in block.named_modules() if rel
                     and not isinstance(m, nn.Linear) and (_matches(rel, COLUMN_NAMES) or _matches(rel, ROW_NAMES))]
            why = f"; {', '.join(named[:3])} {'is' if len(named) == 1 else 'are'} not nn.Linear" if named else ""
            return (f"block {container}.{i} holds no pair of column- and row-parallel nn.Linear layers by name "
                    f"(the runtime splits nn.Linear layers named {COLUMN_NAMES[0]}/{ROW_NAMES[0]}, q_proj/o_proj, …"
                    f"{why}); re-plan with --fix tp=1")
    return ""


def _attend_modules(module: nn.Module) -> dict[str, nn.Module]:
    """``module``'s submodules (by relative name) with an ``attend(q, k, v)`` method: the zoo models' protocol, the
    runtime's `planner.emit.runtime.attention_modules` (a copy: the runtime imports nothing of autopar's)."""
    return {rel: m for rel, m in module.named_modules() if callable(getattr(m, "attend", None))}


def context_parallel_ready(model: nn.Module) -> bool:
    """Whether the runtime can split ``model``'s sequence over a context-parallel group
    (`planner.emit.runtime.apply_cp`): the model reads its tokens' positions from ``context_positions`` (None:
    0..s−1, set by the runtime to the global positions of the tokens a rank holds) and every attention computes its
    core in an ``attend(q, k, v)`` method the runtime replaces (the zoo ``llama:`` and ``gpt:`` models). The
    replacement runs scaled-dot-product attention, which is what the cost model prices it from (the capture's fused
    attention nodes): a model whose attention is captured otherwise (the zoo GPT's ``attention=math``, Megatron's
    unfused kernels: ``use_sdpa`` False) would run other than it is costed, so it is not ready. One rule for the
    capture (the arch fact ``cp_ready``, which `costmodel.runnable.context_problems` judges) and the runtime."""
    attends = _attend_modules(model).values()
    return (getattr(model, "context_positions", False) is None and bool(attends)
            and all(getattr(m, "use_sdpa", True) for m in attends))


def has_attend(model: nn.Module, lg: LayerGraph) -> bool:
    """Whether every op of ``lg``'s attention cores (`has_attention_core`) runs in a module with an ``attend(q, k,
    v)`` method (the zoo models' protocol, which `context_parallel_ready` reads too), or one inside such a module:
    what selective activation checkpointing checkpoints whole where the core is unfused
    (`costmodel.runnable.selective_policy`; the runtime's `planner.emit.runtime.attention_modules`). A core inline
    in a module without one (a model of the user's, a Hugging Face model's eager attention) is not. The arch fact
    ``attends``."""
    # (paths relative to the block: a deep model is captured from fewer blocks than ``lg`` has, `profiler.fold`)
    paths = {n.module_path.removeprefix(layer.name).removeprefix(".") for layer in lg.layers if layer.kind == "block"
             for n in layer.nodes if n.is_attention_core}
    blocks = model.get_submodule(lg.block_container) if lg.block_container else []
    attends = {rel for block in blocks for rel in _attend_modules(block)}
    return all(any(not a or p == a or p.startswith(a + ".") for a in attends) for p in paths)


def pipeline_split_problem(model: nn.Module, container: str, seq: int = 8) -> str:
    """Why the runtime cannot cut ``model`` into pipeline stages at its blocks
    (``planner.emit.runtime.split_pipeline``), or ``''`` when it can. Two shapes split:

    - the zoo convention: the blocks in a top-level ``nn.ModuleList``, and a forward that skips an embedding or head
      set to None (each stage is the model with the modules it does not own set to None: a forward on meta tensors
      of the first, a middle and the last stage checks it, `_stage_trace`);
    - a Hugging Face causal LM (`profiler.zoo.hf.HFCausalLMLoss`): each stage is the real model with the blocks it
      does not own removed, its base model's forward run on token ids (the first stage) or on the hidden states the
      previous stage sent as ``inputs_embeds`` (positions, rotary tables and masks are then made by the model's own
      code on every stage), the final norm replaced by an identity and the logits not computed before the last.
      That is exact only when the base model passes the embedding's output to its first block untouched and the
      last block's output straight to its final norm: a fake forward checks both (Granite multiplies the embedding
      in its base model's forward and GPT-2 adds position embeddings there, which a later stage would do again;
      Gemma's √hidden scaling lives in its embedding module, so Gemma splits).

    One rule for the capture (the arch fact ``pp_split``, which `costmodel.runnable.problems` judges for the search),
    the emitter and the runtime. ``seq``: the sequence length the stages are tried at (the plan's)."""
    parent, _, leaf = container.rpartition(".")
    if not container:
        return "the model has no list of blocks to cut into pipeline stages; plan it with pp=1"
    if not parent:
        return _stage_trace(model, leaf, seq)
    base = getattr(getattr(model, "model", None), "base_model", None)
    if not (callable(getattr(model, "pipeline_stage", None)) and base is not None
            and model.get_submodule(parent) is base):
        return (f"pipeline parallelism cuts models whose blocks sit in a top-level nn.ModuleList (the zoo convention) "
                f"or Hugging Face causal LMs; {type(model).__name__} keeps them at {container!r}; plan it with pp=1")
    names = [name for name, _ in base.named_children()]
    at = names.index(leaf)
    weighted = [i for i, n in enumerate(names) if any(True for _ in getattr(base, n).parameters())]  # (no rotary)
    before = [getattr(base, names[i]) for i in weighted if i < at]
    if len(before) != 1 or not isinstance(before[0], nn.Embedding):
        return (f"{type(base).__name__} has {len(before)} modules with parameters before its blocks, not one "
                "embedding, so a later pipeline stage cannot take hidden states as inputs_embeds; plan it with pp=1")
    after = [getattr(base, names[i]) for i in weighted if i > at]
    problem = _split_trace(base, leaf, before[0], after)  # (parameter-free modules, rotary tables: every stage)
    return f"{type(base).__name__}: {problem}; plan it with pp=1" if problem else ""


def forward_problem(model: nn.Module, input_ids) -> str:
    """Why the runtime cannot train ``model`` (``''`` when it can): it calls ``model(input_ids)`` for the logits
    [batch, seq, vocab] and takes the loss itself (`planner.emit.train`, with the label and loss conventions of
    shared/DESIGN.md), while the capture calls ``model(input_ids, labels)`` for the loss. A forward whose labels have
    no default, or that returns something else without them, is refused with this line. Checked by a forward on the
    meta device (``input_ids`` there; a model with real weights as a meta copy, `meta_copy`): one rule for the
    capture (the arch fact ``forward``, judged by `costmodel.runnable.problems`) and the emitter."""
    import inspect

    import torch

    name = type(model).__name__
    given = model
    model = _on_meta_or_copy(model)  # (one with real weights, given to `auto_parallelize`: a meta copy of it)
    if model is None:
        return ""
    try:
        inspect.signature(model.forward).bind(input_ids)
    except TypeError:
        return (f"{name}.forward needs more than the token ids, but the training step calls it as model(input_ids) "
                "for the logits; give labels a default of None and return the logits when none are given (see "
                "examples/custom_model.py)")
    try:
        with torch.no_grad():
            out = model(input_ids.to("meta"))
    except Exception as e:  # noqa: BLE001 (the user's code: any failure is the answer)
        # (a copy of a module that runs on its own device but not on meta, a device literal in its forward: not
        # judged, as the runtime's own first step will)
        return "" if model is not given else f"{name}(input_ids) failed on the meta device ({_first_line(e)})"
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != tuple(input_ids.shape):
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        return (f"{name}(input_ids) returns {what}, not the logits [batch, seq, vocab] the training step takes its "
                "loss from; return the logits when no labels are given (see examples/custom_model.py)")
    return ""


#: the tensor-parallel degrees `tensor_parallel_problems` tries a user's forward at (those that split its widths)
TP_PROBED = (2, 3, 4, 8)


def tensor_parallel_problems(model: nn.Module, container: str, input_ids) -> tuple[dict, str]:
    """Why tensor parallelism, and why sequence parallelism, cannot run ``model``'s blocks (the list at
    ``container``) as the runtime splits them (`planner.emit.runtime.apply_tp`): ``({str(tp): why}, why-sp)``, empty
    where they can; the arch facts ``tp_forward`` and ``sp_layout``, judged by `costmodel.runnable.problems` for the
    search and the emitter. A tensor-parallel rank holds the column-parallel linears' output rows and the row-parallel
    ones' input columns, so a forward that reads its head count from its settings (``view(b, s, self.heads, …)``)
    fails on the local widths: a forward on the meta device with every such linear computing its rank's share (its
    module, sizes and weight untouched, as torch's ``ColwiseParallel``/``RowwiseParallel`` leave them) checks it at
    each degree of `TP_PROBED` that splits every such width (other degrees are not judged). Sequence parallelism
    all-gathers the input of each module holding column-parallel linears; a linear directly in the block would have
    the block's whole residual stream gathered, which its row-parallel output (a slice of the sequence) does not
    match. The model is run on the meta device (a zoo or ``file.py`` model; one with real weights, given to
    `auto_parallelize`, as a meta copy, `meta_copy`), on a copy: the model is not changed."""
    import torch
    import torch.nn.functional as F

    blocks = model.get_submodule(container) if container else None
    if blocks is None or (on_meta := _on_meta_or_copy(model)) is None:
        return {}, ""
    found = [(f"{i}.{rel}", rel, m) for i, block in enumerate(blocks) for rel, m in block.named_modules()
             if isinstance(m, nn.Linear) and (_matches(rel, COLUMN_NAMES) or _matches(rel, ROW_NAMES))]
    flat = next((f"{container}.{name}" for name, rel, _ in found if "." not in rel and _matches(rel, COLUMN_NAMES)),
                None)
    sp = (f"sequence parallelism gathers the input of the modules holding column-parallel linears, but {flat} sits "
          "directly in its block, whose residual stream would be gathered too; put the attention's and the MLP's "
          "linears in submodules of their own (as the zoo models do), or plan it with sp=off") if flat else ""

    def column(w, b, tp):
        return lambda x: F.linear(x, w[: w.shape[0] // tp], None if b is None else b[: b.shape[0] // tp])

    def row(w, b, tp):
        return lambda x: F.linear(x, w[:, : w.shape[1] // tp], b)

    out = {}
    degrees = [tp for tp in TP_PROBED if found and not any(
        (m.out_features if _matches(rel, COLUMN_NAMES) else m.in_features) % tp for _, rel, m in found)]
    if not degrees:
        return out, sp
    try:
        probe = copy.deepcopy(model) if on_meta is model else on_meta
        cut = [(probe.get_submodule(container).get_submodule(name), _matches(rel, COLUMN_NAMES))
               for name, rel, _ in found]
        with torch.no_grad():  # (unsplit first: a forward that fails on meta whatever the split is not judged)
            probe(input_ids.to("meta"))
    except Exception:  # noqa: BLE001 (a model that cannot be copied or run on meta: not judged)
        return out, sp
    for tp in degrees:
        for m, is_column in cut:
            m.forward = (column if is_column else row)(m.weight, m.bias, tp)
        try:
            with torch.no_grad():
                probe(input_ids.to("meta"))
        except Exception as e:  # noqa: BLE001 (the user's code: any failure is the answer)
            out[str(tp)] = (f"{type(model).__name__}'s forward fails with its column- and row-parallel linears "
                            f"computing a rank's share at tp={tp} ({_first_line(e)}); read the local head count "
                            "from a projection's output (q.shape[-1] // head_dim, as the zoo models do), or plan "
                            "it with a tp it runs at")
    return out, sp


def _on_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device (as the capture and the emitter build
    zoo and ``file.py`` models)."""
    return all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no data copied; shared
    parameters stay shared)."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def _on_meta_or_copy(model: nn.Module) -> nn.Module | None:
    """``model`` itself on the meta device, where the rules here run it at no cost; a model with real weights
    (given to `auto_parallelize`) as a meta copy of it (`meta_copy`: its weights neither read nor changed); None for
    one that cannot be copied so or is built on fake tensors (a Hugging Face capture's: not judged here)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if _on_meta(model):
        return model
    if any(isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers())):
        return None
    try:
        return meta_copy(model)
    except Exception:  # noqa: BLE001 (a model that cannot be deep-copied: not judged)
        return None


def _first_line(e: Exception) -> str:
    """``Type: first line of the message`` (at most 100 characters of it; the message may be empty)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:100]}" if lines else type(e).__name__


def _stage_trace(model: nn.Module, leaf: str, seq: int) -> str:
    """Run the stages the runtime would make of ``model`` (the zoo convention: `pipeline_split_problem`) on the meta
    device, the model's blocks cut to its first one: the first stage on token ids, a middle stage (no modules
    before or after the blocks) and the last stage on hidden states. Each is a shallow copy with the modules it does
    not own set to None, as `planner.emit.runtime.split_pipeline` makes them. '' when every stage runs and the
    first and middle ones return the hidden states the next one takes. A model with real weights (given to
    `auto_parallelize`) is run as a meta copy (`meta_copy`)."""
    import torch

    names = [name for name, _ in model.named_children()]
    at = names.index(leaf)
    given = model
    if not len(getattr(model, leaf)) or (model := _on_meta_or_copy(model)) is None:
        return ""
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    if model is not given:  # (a copy of a module that does not run on meta whatever the cut: not judged)
        try:
            with torch.no_grad():
                model(ids)
        except Exception:  # noqa: BLE001
            return ""
    blocks = getattr(model, leaf)
    before, after = names[:at], names[at + 1:]  # (all of them, as the runtime sets them to None)

    def stage(drop: list):
        part = copy.copy(model)
        part._modules = dict(model._modules)
        part._modules[leaf] = nn.ModuleList([blocks[0]])
        for n in drop:
            part._modules[n] = None
        return part

    kind = type(model).__name__
    hidden = None
    for what, drop, x in (("first", after, ids), ("middle", before + after, None), ("last", before, None)):
        x = hidden if x is None else x
        try:
            with torch.no_grad():
                out = stage(drop)(x)
        except Exception as e:  # noqa: BLE001 (the user's code: any failure is the answer)
            skipped = " or ".join(repr(n) for n in drop) or "nothing"
            return (f"{kind}: its {what} pipeline stage (with {skipped} set to None) fails on the meta device "
                    f"({_first_line(e)}); skip the embedding and the head when "
                    "they are None in forward, as the zoo models do, or plan it with pp=1")
        if what == "first":
            hidden = out
        elif what == "middle" and (not isinstance(out, torch.Tensor) or out.shape != hidden.shape):
            return (f"{kind}: a middle pipeline stage returns {getattr(out, 'shape', type(out).__name__)}, not the "
                    f"hidden states {tuple(hidden.shape)} it takes; return them when the head is None")
    return ""


def _split_trace(base: nn.Module, leaf: str, embedding: nn.Module, after: list) -> str:
    """Run ``base`` on fake tensors with its first and last blocks only and say what breaks `pipeline_split_problem`'s
    condition ('' if nothing)."""
    import torch
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from profiler.zoo.hf import grouped_mm_on_fake_fp32

    blocks = getattr(base, leaf)
    seen: dict = {}

    def keep(key, first=True):  # a hook recording one tensor it sees (returns None: changes nothing)
        def hook(module, args, *rest):
            value = rest[-1] if key in ("embedding", "block_out", "norm_out") else (
                args[0] if args else rest[0].get("hidden_states"))
            if not first or key not in seen:
                seen[key] = value
        return hook

    hooks = [embedding.register_forward_hook(keep("embedding")),
             blocks[0].register_forward_pre_hook(keep("block_in"), with_kwargs=True),
             blocks[-1].register_forward_hook(keep("block_out", first=False))]
    if after:
        hooks.append(after[0].register_forward_pre_hook(keep("norm_in"), with_kwargs=True))
        hooks.append(after[-1].register_forward_hook(keep("norm_out", first=False)))
    ends = nn.ModuleList([blocks[0], blocks[-1]] if len(blocks) > 1 else [blocks[0]])
    setattr(base, leaf, ends)
    try:
        tensors = dict(base.named_parameters()) | dict(base.named_buffers())
        mode = detect_fake_mode(tuple(tensors.values())) or FakeTensorMode(allow_non_fake_inputs=True)
        with mode, grouped_mm_on_fake_fp32():  # (an fp32 plan's MoE experts: torch's meta grouped_mm is bf16 only)
            fakes = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in tensors.items()}
            ids = torch.zeros(1, 8, dtype=torch.long)
            try:
                out = functional_call(base, fakes, (), {"input_ids": ids, "use_cache": False}).last_hidden_state
            except (RuntimeError, TypeError, ValueError) as e:  # unverified: not split
                return f"its first and last blocks did not run on fake tensors ({_first_line(e)})"
    finally:
        setattr(base, leaf, blocks)
        for h in hooks:
            h.remove()
    if seen.get("block_in") is not seen.get("embedding"):
        return "its forward changes the embedding's output before the first block, and a later stage would again"
    last = seen.get("block_out")
    if after and (seen.get("norm_in") is not last or out is not seen.get("norm_out")):
        return "its forward does more than its final norm between the last block and its output"
    if not after and out is not last:
        return "its forward changes the last block's output before returning it"
    return ""


def tp_unsplit_linears(model: nn.Module) -> list[str]:
    """The ``nn.Linear`` layers tensor parallelism cannot run: in a module that holds a column- or row-parallel
    linear (whose inputs and outputs the runtime makes DTensors or head slices, `planner.emit.runtime.apply_tp`) but
    matching neither `COLUMN_NAMES` nor `ROW_NAMES`, so left plain, to be fed a DTensor or a slice it does not fit
    (torch: "got mixed torch.Tensor and DTensor", or a shape mismatch). Multi-head latent attention's (DeepSeek-V2/V3)
    down- and up-projections are, with or without a query down-projection (``q_lora_rank``), and Phi-3's fused
    ``qkv_proj``/``gate_up_proj``. One rule for the capture (the arch fact ``tp_unsplit``, which
    `costmodel.runnable.problems` reads for the search) and the emitter."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    parents = {name.rpartition(".")[0] for name in linears if _matches(name, COLUMN_NAMES + ROW_NAMES)}
    return [name for name in linears if name.rpartition(".")[0] in parents
            and not _matches(name, COLUMN_NAMES) and not _matches(name, ROW_NAMES)]


def _linear_role(node: NodeInfo) -> str | None:
    """``column`` / ``row`` for a recognised linear, else None. A mixture-of-experts layer's matmuls over stacked
    expert weights get none: the runtime does not split experts across tensor-parallel ranks (it shards the
    ``nn.Linear`` layers `planner.emit.config.tp_layout` names), so they run whole, or on the sequence slice under
    sequence parallelism, like any replicated node (`autopar check` traced 59 % less TP traffic than a column/row
    costing of the experts charged)."""
    if node.kind != "matmul" or not node.params or node.op != LINEAR_OP:  # (an nn.Linear: `tp_layout`)
        return None
    if _matches(node.module_path, COLUMN_NAMES):
        return "column"
    if _matches(node.module_path, ROW_NAMES):
        return "row"
    return None


def assign_tp_roles(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Return the block's nodes with ``tp_role`` set (see the module docstring)."""
    roles = [_linear_role(n) for n in nodes]
    if "column" not in roles or "row" not in roles:
        return nodes
    sharded: set[str] = set()
    out = []
    for n, role in zip(nodes, roles):
        if role == "column":
            sharded.add(n.name)
        elif role == "row":
            pass  # output is replicated after the all-reduce
        elif any(i in sharded for i in n.inputs):
            role = "sharded"
            sharded.add(n.name)
        else:
            role = "replicated"
        out.append(_with(n, tp_role=role))
    return out


def _with(n: NodeInfo, **changes) -> NodeInfo:
    from dataclasses import replace

    return replace(n, **changes)


def _edge_roles(nodes: list[NodeInfo], kind: str, vocab: int | None, param_shapes: dict[str, tuple]) -> list[NodeInfo]:
    """Tensor-parallel roles outside the blocks, as the runtime shards them (Megatron-LM's vocabulary parallelism):
    the token embedding (the embedding whose table has ``vocab`` rows, the head's output width) and the head's
    vocabulary projection are ``vocab``; in the head, every node downstream of that projection (the fp32 cast,
    log-softmax and loss) works on this rank's slice of the vocabulary under torch's ``loss_parallel``:
    ``sharded``. Everything else (position embeddings, dropout, the final norm) runs whole on every rank: ``none``.
    """
    out = []
    on_slice: set[str] = set()
    for n in nodes:
        rows = [param_shapes.get(p, (0,))[0] for p in n.params]
        if vocab and "embedding" in n.op and vocab in rows:
            role = "vocab"
        elif vocab and kind == "head" and n.kind == "matmul" and vocab in rows:
            role = "vocab"
            on_slice.add(n.name)
        elif kind == "head" and any(i in on_slice for i in n.inputs):
            role = "sharded"
            on_slice.add(n.name)
        else:
            role = "none"
        out.append(_with(n, tp_role=role))
    return out


def _vocabulary(groups: list, param_shapes: dict[str, tuple]) -> int | None:
    """The head's output width: rows of the last parameterised matmul after the blocks (None without a head)."""
    if not groups or groups[-1][1] != "head":
        return None
    for n in reversed(groups[-1][2]):
        if n.kind == "matmul" and n.params:
            shape = param_shapes.get(n.params[0])
            if shape and len(shape) == 2:
                return shape[0]
    return None


def _dedupe_saved_within(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Charge each saved storage to the first node of *this layer* that saves it."""
    seen: set[int] = set()
    out = []
    for n in nodes:
        fresh = [s for s in n.saved if s[0] not in seen]
        seen.update(sid for sid, *_ in fresh)
        out.append(_with(n, saved_bytes=sum(b for _, b, _, _ in fresh),
                         saved_square_bytes=sum(b for _, b, sq, _ in fresh if sq),
                         saved_weight_bytes=sum(b for _, b, _, w in fresh if w)))
    return out


def _signature(kind: str, prefix: str, nodes: list[NodeInfo], param_shapes: dict[str, tuple]) -> str:
    h = hashlib.sha256(kind.encode())
    strip = len(prefix) + 1 if prefix else 0
    for n in nodes:
        rel = n.module_path[strip:] if prefix and n.module_path.startswith(prefix) else n.module_path
        rel_params = [(p[strip:] if prefix and p.startswith(prefix) else p, param_shapes.get(p)) for p in n.params]
        h.update(f"{n.op}|{rel}|{n.input_shapes}|{n.output_shapes}|{n.input_dtypes}|{rel_params}|"
                 f"{n.fwd_flops}|{n.saved_bytes}\n".encode())
    return h.hexdigest()[:12]


def has_attention_core(lg: LayerGraph) -> bool:
    """Whether the blocks make seq×seq attention scores (`profiler.graph.NodeInfo.is_attention_core`): what selective
    activation checkpointing recomputes. A fused attention kernel makes none (`costmodel.runnable.problems`), so a
    block that calls one has no core, whatever its shapes say: where a head's width equals the sequence, its queries,
    keys and values ([batch, heads, seq, head_dim]) are shaped as scores (`attention_scores`). Read as a core, a MoE
    with 64-wide heads at seq 64 took a policy that kept every op's output outside a core it does not have, and
    priced it as no checkpointing: traced, 74.2 MiB against 65.7 predicted, more than the 66.5
    it holds uncheckpointed."""
    return any(any(n.is_attention_core for n in layer.nodes) and not any(n.kind == "attention" for n in layer.nodes)
               for layer in lg.layers if layer.kind == "block")


def group_layers(graph: ModelGraph) -> LayerGraph:
    """Group ``graph``'s nodes into embed, blocks and head (see the module docstring)."""
    container = find_block_container(graph)
    groups: list[tuple[str, str, list[NodeInfo]]] = []  # (name, kind, nodes)
    for n in graph.nodes:
        key = _block_key(n.module_path)
        if container and key is not None and key[0] == container:
            name, kind = f"{container}.{key[1]}", "block"
        elif container:
            name, kind = ("embed", "embed") if not groups or groups[-1][1] == "embed" else ("between", "between")
        else:
            top = n.module_path.split(".", 1)[0] or "<root>"
            name, kind = (top, "other")
        if groups and (groups[-1][0] == name or (kind == "between" and groups[-1][1] == "between")):
            groups[-1][2].append(n)
        else:
            groups.append((name, kind, [n]))
    if container:
        # ops outside any block that run between two blocks stay with the block before them; the ones after
        # the last block are the head
        merged: list[tuple[str, str, list[NodeInfo]]] = []
        for i, (name, kind, nodes) in enumerate(groups):
            if kind == "between" and i == len(groups) - 1:
                merged.append(("head", "head", nodes))
            elif kind == "between":
                merged[-1][2].extend(nodes)
            else:
                merged.append((name, kind, nodes))
        groups = merged

    param_numel = {p.fqn: p.numel for p in graph.params if not p.is_buffer}
    param_shapes = {p.fqn: p.shape for p in graph.params}
    owner: dict[str, int] = {}
    producer: dict[str, int] = {}
    out_bytes = {n.name: n.output_bytes for n in graph.nodes}
    vocab = _vocabulary(groups, param_shapes)
    layers = []
    for idx, (name, kind, nodes) in enumerate(groups):
        nodes = _dedupe_saved_within(nodes)
        if kind == "block":
            nodes = assign_tp_roles(nodes)
        elif kind in ("embed", "head"):
            nodes = _edge_roles(nodes, kind, vocab, param_shapes)
        owned, shared = [], []
        for n in nodes:
            for p in n.params:
                if p not in param_numel:
                    continue
                if p not in owner:
                    owner[p] = idx
                    owned.append(p)
                elif owner[p] != idx and p not in shared:
                    shared.append(p)
        # what a pipeline boundary before this layer carries: the previous layer's outputs it reads (values made
        # earlier, such as rotary tables, are recomputed by every stage's forward, as the zoo's models do)
        incoming = {i for n in nodes for i in n.inputs if producer.get(i, idx) == idx - 1}
        for n in nodes:
            producer[n.name] = idx
        prefix = name if kind == "block" else ""
        layers.append(Layer(
            name=name, kind=kind, index=idx, signature=_signature(kind, prefix, nodes, param_shapes),
            nodes=tuple(nodes), param_numel=sum(param_numel[p] for p in owned), shared_params=tuple(shared),
            input_bytes=sum(out_bytes[i] for i in incoming),
        ))
    return LayerGraph(model=graph, layers=tuple(layers), block_container=container)


def tp_saved_bytes(layer: Layer) -> tuple[int, int]:
    """Split a block's saved activation bytes into (replicated, sharded) under tensor parallelism.

    A column linear saves its input, the replicated hidden state; a row linear saves its input, the sharded
    output of the attention or MLP core; every other node saves tensors of its own role. Sharded bytes are
    divided by the tensor-parallel degree, replicated ones are not (Korthikanti et al. 2022, eq. 2:
    sbh(10 + 24/t + 5as/(ht)), of which 10·sbh is replicated). A block without roles is all replicated.
    """
    replicated = sum(n.saved_bytes for n in layer.nodes if n.tp_role in ("column", "replicated", "none", "vocab"))
    return replicated, layer.saved_bytes - replicated
