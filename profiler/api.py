"""One call from a model spec to its layer graph: resolve, build without memory, capture, group."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor

from profiler.capture import capture
from profiler.experts import expert_modules
from profiler.fold import unfold
from profiler.graph import LayerGraph
from profiler.layers import (
    context_parallel_ready,
    forward_problem,
    group_layers,
    has_attend,
    has_attention_core,
    pipeline_split_problem,
    tensor_parallel_problems,
    tp_split_problem,
    tp_unsplit_linears,
)
from profiler.zoo.hf import masks_as_trained
from profiler.zoo.registry import is_file_spec, resolve_model

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


#: Blocks captured before `profiler.fold.unfold` repeats the last one (≥ 2 so the repetition can be checked).
FOLD_BLOCKS = 3


#: Hugging Face config fields that make layers differ by their index (transformers' modeling code: Qwen2/3-MoE
#: ``decoder_sparse_step``, ``mlp_only_layers``; DeepSeek-V2/V3 ``first_k_dense_replace``, ``moe_layer_freq``; Llama 4
#: ``interleave_moe_layer_step``, ``no_rope_layers``; Qwen2 ``max_window_layers`` with ``use_sliding_window``; Gemma 3
#: ``sliding_window_pattern``; ModernBERT ``global_attn_every_n_layers``; Jamba ``attn_layer_period``,
#: ``expert_layer_period``; Qwen3-Next ``full_attention_interval``), with the value at which every layer is alike
_HF_UNIFORM_WHEN = {
    "decoder_sparse_step": lambda v, n: v in (None, 0, 1),
    "mlp_only_layers": lambda v, n: not v or sorted(set(v)) == list(range(n)),
    "first_k_dense_replace": lambda v, n: not v,
    "moe_layer_freq": lambda v, n: v in (None, 0, 1),
    "interleave_moe_layer_step": lambda v, n: v in (None, 0, 1),
    "sliding_window_pattern": lambda v, n: v in (None, 0, 1),
    "global_attn_every_n_layers": lambda v, n: v in (None, 0, 1),
    "attn_layer_period": lambda v, n: v in (None, 0, 1),
    "expert_layer_period": lambda v, n: v in (None, 0, 1),
    "full_attention_interval": lambda v, n: v in (None, 0, 1),
}


#: fields that make only the first k layers differ (DeepSeek's dense blocks before the MoE ones): a capture of k + 2
#: blocks, whose last is repeated, describes the model (`leading_blocks`)
_HF_LEADING = ("first_k_dense_replace",)


def leading_blocks(source) -> int:
    """How many first blocks differ from the rest, which are alike: a zoo MoE's ``dense_layers``, a Hugging Face
    config's `_HF_LEADING` field; 0 otherwise."""
    if source.family == "moe":
        return int(getattr(source.config, "dense_layers", 0) or 0)
    if source.family == "hf":
        return max((int(getattr(source.config, k, 0) or 0) for k in _HF_LEADING), default=0)
    return 0


def _hf_layers_alike(cfg, leading_ok: bool = False) -> bool:
    """Whether a Hugging Face config describes ``num_hidden_layers`` alike layers: no per-layer list or string
    (``layer_types``, ``no_rope_layers``, ``hybrid_override_pattern``, …) with two different entries, no field of
    `_HF_UNIFORM_WHEN` away from its uniform value, no sliding window on only some layers. ``leading_ok``: alike
    after the first blocks of `_HF_LEADING` (what a capture may fold, `with_blocks`)."""
    n = cfg.num_hidden_layers
    for key, value in vars(cfg).items():
        if isinstance(value, (list, tuple, str)) and len(value) == n and n > 1 and not key.startswith("_"):
            if len({repr(v) for v in value}) > 1:
                return False
        if key in _HF_UNIFORM_WHEN and not _HF_UNIFORM_WHEN[key](value, n) and not (leading_ok
                                                                                   and key in _HF_LEADING):
            return False
    window = getattr(cfg, "max_window_layers", None)
    return not (getattr(cfg, "use_sliding_window", False) and window is not None and 0 < window < n)


def with_blocks(source, n: int):
    """The same model with ``n`` blocks, or None where its blocks cannot be counted or are not all alike (a user's
    file; a Hugging Face model whose layers differ by index, `_hf_layers_alike`)."""
    if source.family in ("gpt", "llama", "moe"):
        if getattr(source.config, "moe_every", 1) > 1:
            return None  # dense and MoE blocks alternate: no run of alike blocks to repeat
        if leading_blocks(source) and n < leading_blocks(source) + 2:
            return None  # the leading blocks that differ and two alike ones, or the last repeated is the wrong kind
        return dataclasses.replace(source, config=dataclasses.replace(source.config, layers=n))
    if source.family == "hf" and getattr(source.config, "num_hidden_layers", None):
        if not _hf_layers_alike(source.config, leading_ok=n >= leading_blocks(source) + 2):
            return None
        cfg = copy.deepcopy(source.config)
        depth = cfg.num_hidden_layers
        for key, value in vars(source.config).items():  # per-layer lists (all entries alike) follow the depth
            if isinstance(value, (list, tuple)) and len(value) == depth and depth > 1 and not key.startswith("_"):
                setattr(cfg, key, type(value)(value[:1]) * n)
        cfg.num_hidden_layers = n
        return dataclasses.replace(source, config=cfg)
    return None


def block_count(source) -> int | None:
    """The number of blocks of a zoo or Hugging Face model (None for a user's file)."""
    if source.family in ("gpt", "llama", "moe"):
        return source.config.layers
    return getattr(source.config, "num_hidden_layers", None) if source.family == "hf" else None


def _folded_source(source):
    """The same model with FOLD_BLOCKS blocks, and its real depth; (source, None) when it cannot be folded."""
    depth = block_count(source)
    blocks = max(FOLD_BLOCKS, leading_blocks(source) + 2)  # the leading blocks that differ, and two alike ones
    folded = with_blocks(source, blocks) if depth and depth > blocks else None
    return (folded, depth) if folded is not None else (source, None)


def runnable_facts(model: torch.nn.Module, container: str, input_ids, *, user_code: bool) -> dict:
    """The arch facts `costmodel.runnable` judges a model's plans by, which the search offers only plans that pass
    and the emitter and the runtime refuse the others with: the same for a captured spec (`profile_model`) and a
    module given to `auto_parallelize` (`planner.search.outer.plan_for_module`; one with real weights is run as a
    meta copy, `profiler.layers.meta_copy`). How many experts expert parallelism can split (0: none;
    `profiler.experts`), a linear tensor parallelism cannot run (`profiler.layers.tp_unsplit_linears`), blocks it
    cannot split (`profiler.layers.tp_split_problem`), whether
    its sequence can be split (`profiler.layers.context_parallel_ready`), whether the runtime can cut it into
    pipeline stages (`profiler.layers.pipeline_split_problem`), and for the user's own code (``user_code``: a
    ``file.py`` model or a module; the zoo's and Hugging Face's follow the contract by construction) whether the
    training step can call it for logits (`profiler.layers.forward_problem`) and whether tensor and sequence
    parallelism can run its blocks (`profiler.layers.tensor_parallel_problems`)."""
    out: dict = {}
    try:
        found = expert_modules(model)
        out["ep_experts"], out["ep_dim1"] = found["experts"], found["expert_dim1"]
    except ValueError:
        out["ep_experts"], out["ep_dim1"] = 0, 0
    unsplit = tp_unsplit_linears(model)
    out["tp_unsplit"] = unsplit[0] if unsplit else ""
    out["tp_split"] = tp_split_problem(model, container)
    out["cp_ready"] = context_parallel_ready(model)
    out["forward"] = forward_problem(model, input_ids) if user_code else ""
    out["tp_forward"], out["sp_layout"] = (tensor_parallel_problems(model, container, input_ids) if user_code
                                           else ({}, ""))
    out["pp_split"] = pipeline_split_problem(model, container, seq=input_ids.shape[1])
    return out


def profile_once(spec: str, *, seq: int | None = None, dtype: str = "bf16", kernels: str = "gpu",
                 autocast: str | None = None) -> LayerGraph:
    """`profile_model`'s graph of one micro-batch, captured once per process (as a user's ``file.py`` is imported
    once, `profiler.zoo.registry`): a search, a check and a calibration price many plans of one model. Shared: not
    to be modified (`LayerGraph` is frozen; its ``model.arch`` dict is not)."""
    # (a user's file by its whole path, as the registry imports it: a relative spec names another file elsewhere)
    where = str(Path(spec.strip().partition(":")[0]).expanduser().resolve()) if is_file_spec(spec) else None
    return _profile_once(spec, seq, dtype, kernels, autocast, where)


@functools.cache  # (every model a process prices, kept: a calibration prices ~50 at every step of its fit)
def _profile_once(spec: str, seq: int | None, dtype: str, kernels: str, autocast: str | None,
                  where: str | None) -> LayerGraph:
    return profile_model(spec, seq=seq, dtype=dtype, kernels=kernels, autocast=autocast)


def profile_model(spec: str, *, batch: int = 1, seq: int | None = None, dtype: str = "bf16",
                  kernels: str = "gpu", fold: bool = True, autocast: str | None = None) -> LayerGraph:
    """Capture the model named by ``spec`` (zoo preset, ``gpt:…``, ``llama:…``, ``hf:…``, ``file.py:factory``) on
    the meta device (Hugging Face models on fake tensors) in ``dtype``, and group it into layers.

    ``batch`` is the micro-batch the facts are captured for (they scale linearly with it); ``seq`` overrides
    the model's default sequence length. ``fold``: capture a few blocks and repeat them to the full depth
    (`profiler.fold`; exact for identical blocks, much faster for deep models). ``autocast`` (``"bf16"``,
    ``"fp16"``; ``dtype`` must then be ``"fp32"``): replay the model under ``torch.autocast``
    (`profiler.capture`). A 16-bit graph can make its autocast twin on demand (`LayerGraph.under_autocast`).
    """
    if autocast is not None and dtype != "fp32":
        raise ValueError(f"an autocast capture is of fp32 parameters: pass dtype='fp32', not {dtype!r}")
    if batch < 1:
        raise ValueError(f"batch must be ≥ 1, got {batch}")
    source = resolve_model(spec)
    depth = None
    if fold:
        source, depth = _folded_source(source)
    torch_dtype = parse_dtype(dtype)
    with _default_dtype(torch_dtype):  # builds in dtype; fake-tensor (Hugging Face) models cannot be cast later
        model, inputs = source.build(batch=batch, seq=seq, device="meta")
    # a model built on fake tensors (Hugging Face) keeps the dtypes its modeling code chose (DeepSeek-V3's router
    # weight is float32 by design, and fake parameters cannot be swapped); meta-built models are cast
    fake = any(isinstance(p, FakeTensor) for p in model.parameters())
    if not fake and any(p.is_floating_point() and p.dtype != torch_dtype for p in model.parameters()):
        model = model.to(torch_dtype)
    arch = dict(source.arch())
    arch["kernels"] = kernels  # whose attention kernels the capture replays (`profiler.capture`)
    with masks_as_trained():  # the masks a training step makes on real tensors (`profiler.zoo.hf`)
        graph = capture(model, inputs, name=spec, arch=arch, kernels=kernels, autocast=autocast)
        if depth:
            graph = unfold(graph, depth)
        lg = group_layers(graph)
        lg.model.arch["attention_core"] = has_attention_core(lg)  # what selective AC recomputes (`runnable`)
        lg.model.arch["attends"] = has_attend(model, lg)  # and how (`costmodel.runnable.selective_policy`)
        lg.model.arch.update(runnable_facts(model, lg.block_container, inputs[0], user_code=source.family == "file"))
    if autocast is None and dtype in ("bf16", "fp16"):  # what plans that train under autocast keep (`Evaluator`)
        lg = dataclasses.replace(lg, recapture=functools.partial(
            profile_model, spec, batch=batch, seq=seq, dtype="fp32", kernels=kernels, fold=fold, autocast=dtype))
    return lg
