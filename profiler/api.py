"""One call from a model spec to its layer graph: resolve, build without memory, capture, group."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from profiler.capture import capture
from profiler.fold import unfold
from profiler.graph import LayerGraph
from profiler.layers import group_layers
from profiler.zoo.registry import resolve_model

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


def with_blocks(source, n: int):
    """The same model with ``n`` blocks, or None where its blocks cannot be counted or are not all alike (a user's
    file; a Hugging Face model whose layers mix attention kinds)."""
    if source.family in ("gpt", "llama", "moe"):
        return dataclasses.replace(source, config=dataclasses.replace(source.config, layers=n))
    if source.family == "hf" and getattr(source.config, "num_hidden_layers", None):
        cfg = copy.deepcopy(source.config)
        if getattr(cfg, "layer_types", None):  # per-layer attention kinds must stay uniform to fold
            if len(set(cfg.layer_types)) > 1:
                return None
            cfg.layer_types = cfg.layer_types[:1] * n
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
    folded = with_blocks(source, FOLD_BLOCKS) if depth and depth > FOLD_BLOCKS else None
    return (folded, depth) if folded is not None else (source, None)


def profile_model(spec: str, *, batch: int = 1, seq: int | None = None, dtype: str = "bf16",
                  kernels: str = "gpu", fold: bool = True) -> LayerGraph:
    """Capture the model named by ``spec`` (zoo preset, ``gpt:…``, ``llama:…``, ``hf:…``, ``file.py:factory``) on
    the meta device (Hugging Face models on fake tensors) in ``dtype``, and group it into layers.

    ``batch`` is the micro-batch the facts are captured for (they scale linearly with it); ``seq`` overrides
    the model's default sequence length. ``fold``: capture a few blocks and repeat them to the full depth
    (`profiler.fold`; exact for identical blocks, much faster for deep models).
    """
    if batch < 1:
        raise ValueError(f"batch must be ≥ 1, got {batch}")
    source = resolve_model(spec)
    depth = None
    if fold:
        source, depth = _folded_source(source)
    torch_dtype = parse_dtype(dtype)
    with _default_dtype(torch_dtype):  # builds in dtype; fake-tensor (Hugging Face) models cannot be cast later
        model, inputs = source.build(batch=batch, seq=seq, device="meta")
    if any(p.is_floating_point() and p.dtype != torch_dtype for p in model.parameters()):
        model = model.to(torch_dtype)
    arch = dict(source.arch())
    graph = capture(model, inputs, name=spec, arch=arch, kernels=kernels)
    if depth:
        graph = unfold(graph, depth)
    return group_layers(graph)
