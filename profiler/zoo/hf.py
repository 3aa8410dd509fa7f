"""Hugging Face models from config classes: ``hf:MODEL_TYPE[:key=value,…]``, random weights, nothing downloaded.

``transformers.AutoConfig.for_model(model_type, **overrides)`` makes the config (``use_cache=False`` so the output
holds no cache and ``torch.export`` accepts it; pad/bos/eos ids clamped into the vocabulary so small configs work).
Decoders are built with ``AutoModelForCausalLM``; types that also have a masked-LM head (encoder-only models such
as bert and roberta) with ``AutoModelForMaskedLM``. MoE models get the ``grouped_mm`` experts implementation: the
tokens sorted by expert and one grouped GEMM per projection (``torch._grouped_mm`` in bf16, transformers' fallback
custom op elsewhere), which exports with static shapes and whose FLOPs and bytes are those of the work done
(`profiler.capture.grouped_mm_flops` counts them; ``batched_mm`` gathers an expert weight per routed token, which
no trainer does and which costs orders of magnitude more memory at training sizes; ``eager`` is data-dependent).

Hugging Face forwards fail on the meta device (``.item()`` in the mask utilities), so ``build_hf(device="meta")``
builds under ``torch._subclasses.fake_tensor.FakeTensorMode`` instead and returns *fake* tensors: parameters and
inputs carry shapes, dtypes and a (fake) CPU device but no storage. ``torch.export.export`` picks the fake mode up
from them; to run other code on them, re-enter it with ``torch._guards.detect_fake_mode(inputs)``.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

_TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
DEFAULT_MAX_SEQ = 2048
"""Default sequence length for hf models: min(max_position_embeddings, this)."""


class HFCausalLMLoss(nn.Module):
    """Wraps a Hugging Face LM so ``forward(input_ids, labels)`` returns the scalar loss (logits without labels).

    The loss follows autopar's batch contract, the zoo's: ``labels[:, t]`` is the token after ``input_ids[:, t]``,
    so the cross-entropy compares ``logits[:, t]`` with ``labels[:, t]`` directly (label −100 ignored). Passing
    ``labels=`` to the model instead would shift them once more (Hugging Face expects labels equal to the inputs).
    No key/value cache is built: training needs none. The wrapped model is ``self.model``, so module paths read
    ``model.model.layers.0…``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.takes_tokens = True  # a pipeline stage after the first takes hidden states (`pipeline_stage`)
        self.gives_logits = True  # a pipeline stage before the last returns hidden states

    def pipeline_stage(self, first: bool, last: bool) -> None:
        """Make this (copy of the) model one pipeline stage: it runs its base model's own forward on token ids (the
        first stage) or on the previous stage's hidden states as ``inputs_embeds``, and returns the logits (the
        last stage) or its last block's hidden states. The caller has removed the blocks it does not own
        (`planner.emit.runtime.split_pipeline`; `profiler.layers.pipeline_split_problem` says when this is exact)."""
        self.takes_tokens, self.gives_logits = first, last

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"input_ids" if self.takes_tokens else "inputs_embeds": input_ids}
        if not self.gives_logits:
            return self.model.base_model(**inputs, use_cache=False).last_hidden_state
        logits = self.model(**inputs, use_cache=False).logits
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def parse_value(text: str) -> bool | int | float | str | None:
    """``true``/``false`` → bool, ``none`` → None, then int, then float, else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def modeling_keys(model_type: str) -> set[str]:
    """Config keys that ``model_type``'s modeling code reads (``config.KEY``, ``getattr(config, "KEY", …)``) though
    its config class may not declare them: Qwen3-MoE's attention takes ``getattr(config, "head_dim", …)``."""
    import importlib
    import inspect
    import re

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return set()
    return set(re.findall(r"\bconfig\.([A-Za-z_]\w*)", source)) | set(
        re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']", source))


def hf_config(model_type: str, overrides: dict[str, object], published: dict | None = None):
    """The transformers config for ``model_type`` with ``overrides`` on top of ``published`` (a model's
    ``config.json``, taken as it is); ValueError for unknown types, or override keys that neither the config class
    nor the modeling code reads."""
    import difflib

    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"hf: unknown model type {model_type!r}; use a transformers model_type such as llama, gpt2, mistral, "
            f"mixtral, qwen2, bert (see transformers.CONFIG_MAPPING)"
        )
    default = AutoConfig.for_model(model_type)
    unknown = [key for key in overrides if not hasattr(default, key)]
    known = set(default.to_dict()) | modeling_keys(model_type) if unknown else set()
    unknown = [key for key in unknown if key not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. num_hidden_layers, hidden_size, vocab_size"
        raise ValueError(
            f"hf:{model_type}: unknown config key {unknown[0]!r}: neither {type(default).__name__} nor "
            f"{model_type}'s modeling code reads it; {hint}"
        )
    overrides = {**(published or {}), **overrides}
    vocab = overrides.get("vocab_size", default.vocab_size)
    token_ids = {}
    if isinstance(vocab, int):  # special-token ids past a small vocabulary are clamped to its last id
        for key in _TOKEN_ID_KEYS:
            value = overrides.get(key, getattr(default, key, None))
            if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
                token_ids[key] = vocab - 1
            elif isinstance(value, list):
                token_ids[key] = [min(v, vocab - 1) for v in value]
    try:
        return AutoConfig.for_model(model_type, **{**overrides, **token_ids, "use_cache": False})
    except Exception as exc:  # noqa: BLE001 - the config class's validation of the user's values (transformers',
        # huggingface_hub's strict dataclasses: StrictDataclassFieldValidationError is neither TypeError nor ValueError)
        detail = str(exc.__cause__ or exc).strip().splitlines()
        raise ValueError(f"hf:{model_type}: {detail[-1].strip() if detail else type(exc).__name__}; fix that "
                         "value in the spec") from exc


def hf_task(config) -> str:
    """``"masked"`` for encoder types with a masked-LM head, ``"causal"`` for decoders; ValueError otherwise."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    raise ValueError(
        f"hf:{model_type}: transformers has neither a causal-LM nor a masked-LM class for this type; use a decoder "
        f"(llama, gpt2, mistral, mixtral, …) or an encoder (bert, roberta, …)"
    )


def hf_max_positions(config) -> int | None:
    """Position limit from the config (``max_position_embeddings`` / ``n_positions``), if it has one."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def hf_default_seq(config) -> int:
    limit = hf_max_positions(config)
    return min(limit, DEFAULT_MAX_SEQ) if limit is not None else DEFAULT_MAX_SEQ


def hf_arch(config) -> dict[str, int]:
    """Architecture facts from a transformers config (keys as in ``ModelSource.arch``; missing ones left out)."""
    names = {
        "hidden": ("hidden_size",),
        "heads": ("num_attention_heads",),
        "kv_heads": ("num_key_value_heads",),
        "layers": ("num_hidden_layers",),
        "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
        "vocab": ("vocab_size",),
        "experts": _EXPERT_KEYS,
        "top_k": ("num_experts_per_tok", "moe_topk"),
        # mixture of experts: each routed expert's width, the shared experts every token also runs (DeepSeek,
        # Qwen2-MoE), the leading dense blocks (DeepSeek's first_k_dense_replace)
        "expert_ffn": ("moe_intermediate_size",),
        "shared_experts": ("n_shared_experts", "num_shared_experts"),
        "dense_layers": ("first_k_dense_replace",),
    }
    arch: dict[str, int] = {}
    for key, candidates in names.items():
        for name in candidates:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                arch[key] = value
                break
    if "heads" in arch and "kv_heads" not in arch:
        arch["kv_heads"] = arch["heads"]
    if "ffn" not in arch and "hidden" in arch and config.model_type == "gpt2":
        arch["ffn"] = 4 * arch["hidden"]
    return arch


def count_grouped_mm() -> None:
    """Give FlopCounterMode the FLOPs of transformers' grouped-GEMM fallback (the custom op its ``grouped_mm``
    experts run where ``torch._grouped_mm`` cannot: fp32, CPU) and of its backward (the input's and the weights'
    gradients: twice the forward)."""
    from profiler.capture import register_grouped_mm_flops

    ops = getattr(torch.ops, "transformers", None)
    fwd = getattr(ops, "grouped_mm_fallback", None) if ops is not None else None
    bwd = getattr(ops, "grouped_mm_fallback_backward", None) if ops is not None else None
    if fwd is not None:
        register_grouped_mm_flops(fwd)
    if bwd is not None:
        from torch.utils.flop_counter import flop_registry, register_flop_formula

        if bwd not in flop_registry:
            register_flop_formula(bwd)(
                lambda a, b, offs, grad, *_, out_shape=None, **__: 4 * a[0] * a[1] * b[-1])


@contextlib.contextmanager
def grouped_mm_on_fake_fp32():
    """Hugging Face MoE experts on fake fp32 tensors (`autopar check`'s trace; the pipeline split rule's fake run of
    an fp32 plan's model): transformers runs ``grouped_mm`` through torch's kernel wherever torch has one (CPU
    included, fp32 too), but torch 2.13's meta function for it accepts bf16 only, so on fake fp32 tensors it
    raises. There ``autopar::masked_grouped_mm`` (`_register_masked_grouped_mm`) runs instead: the same shapes and
    FLOPs as torch's kernel, and like its backward (``GroupedMmBackward0``) it computes only the gradients autograd
    asks for. transformers' own fallback op computes both every time, so under zero-bubble's split backward (the
    input pass asks for the input's gradient, the weight pass for the weights') it would trace each expert GEMM's
    backward twice."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or not hasattr(moe, "_grouped_mm") or not hasattr(moe, "_can_use_grouped_mm"):
        yield
        return
    _register_masked_grouped_mm()
    saved = moe._grouped_mm

    def routed(input, weight, offs):
        if weight.dtype == torch.bfloat16 and moe._can_use_grouped_mm(input, weight, offs):
            return saved(input, weight, offs)
        return torch.ops.autopar.masked_grouped_mm(input.to(weight.dtype), weight, offs)

    moe._grouped_mm = routed
    try:
        yield
    finally:
        moe._grouped_mm = saved


def _grouped_loop(a: torch.Tensor, b_of, offs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b_of(e), out=out[start:end])
        start = end
    return out


@functools.cache
def _register_masked_grouped_mm() -> None:
    """Register ``autopar::masked_grouped_mm`` (input [S, in], weight [E, in, out], offs [E] → [S, out]) and its two
    gradient ops, each with a fake implementation and its FLOPs (2·S·in·out each)."""
    from torch.utils.flop_counter import register_flop_formula

    lib = "autopar::masked_grouped_mm"

    @torch.library.custom_op(lib, mutates_args=())
    def fwd(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = input.new_zeros(input.shape[0], weight.shape[2])
        return _grouped_loop(input, lambda e: weight[e], offs, out)

    @fwd.register_fake
    def _(input, weight, offs):
        return input.new_empty(input.shape[0], weight.shape[2])

    @torch.library.custom_op(lib + "_grad_input", mutates_args=())
    def grad_input(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = grad.new_zeros(grad.shape[0], weight.shape[1])
        return _grouped_loop(grad, lambda e: weight[e].T, offs, out)

    @grad_input.register_fake
    def _(grad, weight, offs):
        return grad.new_empty(grad.shape[0], weight.shape[1])

    @torch.library.custom_op(lib + "_grad_weight", mutates_args=())
    def grad_weight(input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
        out = input.new_zeros(experts, input.shape[1], grad.shape[1])
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                torch.mm(input[start:end].T, grad[start:end], out=out[e])
            start = end
        return out

    @grad_weight.register_fake
    def _(input, grad, offs, experts):
        return input.new_empty(experts, input.shape[1], grad.shape[1])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.offs = inputs[2]

    def wanted(ctx, i: int) -> bool:
        # what a native node's output mask says (torch's task_should_compute_output): the input's gradient edge
        # leads somewhere this backward runs (`_will_engine_execute_node`, as register_multi_grad_hook asks it)
        if not ctx.needs_input_grad[i]:
            return False
        node = ctx.next_functions[i][0]
        try:
            return node is not None and torch._C._will_engine_execute_node(node)
        except RuntimeError:  # a leaf under autograd.grad, which torch cannot say of: computed, as the fallback does
            return True

    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        gi = grad_input(grad, weight, ctx.offs) if wanted(ctx, 0) else None
        gw = grad_weight(input, grad, ctx.offs, weight.shape[0]) if wanted(ctx, 1) else None
        return gi, gw, None

    fwd.register_autograd(backward, setup_context=setup_context)
    register_flop_formula(torch.ops.autopar.masked_grouped_mm)(
        lambda a, b, offs, *_, out_shape=None, **__: 2 * a[0] * a[1] * b[-1])
    register_flop_formula(torch.ops.autopar.masked_grouped_mm_grad_input)(
        lambda g, b, offs, *_, out_shape=None, **__: 2 * g[0] * g[1] * b[1])
    register_flop_formula(torch.ops.autopar.masked_grouped_mm_grad_weight)(
        lambda a, g, offs, *_, out_shape=None, **__: 2 * a[0] * a[1] * g[1])


@contextlib.contextmanager
def masks_as_trained():
    """Run Hugging Face forwards on fake tensors (and under ``torch.export``) with the attention masks a training
    step makes on real ones: none for plain causal attention.

    A training step calls the model on token ids alone (the batch contract: no positions, no padding mask), so the
    base model derives positions ``arange(seq)``. With real tensors transformers 5 then finds no packed sequences
    (``masking_utils.find_packed_sequence_indices`` reads the positions and returns None) and leaves causality to
    SDPA's ``is_causal`` (``_ignore_causal_mask_sdpa``), so no mask exists. On fake tensors it cannot read the
    positions (``is_tracing`` is true for a FakeTensor) and under export it declines to skip
    (``is_torchdynamo_exporting``): it materialises a [batch, 1, seq, seq] boolean mask that every attention reads
    and saves, and SDPA runs a masked kernel instead of the causal one. Inside this context both decisions are taken
    as on real tensors of the contract's shape: positions one sequence per row, and not exporting. Masks a real run
    makes (sliding windows, chunked attention) are still made: they do not depend on either decision.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # no Hugging Face models without transformers
        yield
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    exporting = getattr(masking_utils, "is_torchdynamo_exporting", None)
    if find is None or exporting is None:  # a transformers without these decisions: nothing to take
        yield
        return

    def one_sequence_per_row(position_ids):
        if masking_utils.is_tracing(position_ids):
            return None  # what the real positions arange(seq) give: no packing
        return find(position_ids)

    masking_utils.find_packed_sequence_indices = one_sequence_per_row
    masking_utils.is_torchdynamo_exporting = lambda: False
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find
        masking_utils.is_torchdynamo_exporting = exporting


def _is_moe(config) -> bool:
    return any(isinstance(getattr(config, key, None), int) and getattr(config, key) > 0 for key in _EXPERT_KEYS)


def build_lm(config) -> HFCausalLMLoss:
    """The wrapped model with random weights on the current default device (``torch.device("meta")`` gives meta
    tensors, as the emitted scripts' ``build_model`` under meta-device initialisation)."""
    return _build_lm(config)


def _build_lm(config) -> HFCausalLMLoss:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if hf_task(config) == "masked" else AutoModelForCausalLM
    model = auto.from_config(config)
    if _is_moe(config) and model._can_set_experts_implementation():
        model.set_experts_implementation("grouped_mm")
        count_grouped_mm()
    return HFCausalLMLoss(model)


def build_hf(
    config, *, batch: int, seq: int, device: str | torch.device = "meta"
) -> tuple[HFCausalLMLoss, tuple[torch.Tensor, torch.Tensor]]:
    """The wrapped model and ``(input_ids, labels)`` of shape (batch, seq).

    ``device="meta"`` builds under a fresh ``FakeTensorMode`` (fake tensors, see the module docstring); any other
    device builds real random weights there.
    """
    limit = hf_max_positions(config)
    learned_positions = getattr(config, "rope_parameters", None) is None  # rotary models extrapolate; tables don't
    if limit is not None and seq > limit and learned_positions:
        raise ValueError(
            f"hf:{config.model_type}: seq={seq} exceeds the {limit} learned positions; add "
            f"max_position_embeddings={seq} (n_positions for gpt2) to the spec"
        )
    vocab = config.vocab_size
    if str(device) == "meta":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            model = _build_lm(config)
            input_ids = torch.randint(0, vocab, (batch, seq))
            labels = torch.randint(0, vocab, (batch, seq))
        return model, (input_ids, labels)
    with torch.device(device):
        model = _build_lm(config)
        input_ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
    return model, (input_ids, labels)


def hf_layer_container(model: nn.Module) -> str:
    """Dotted path (relative to ``model``) of the ``nn.ModuleList`` holding the blocks: the one with most parameters.

    E.g. ``model.model.layers`` (Llama), ``model.transformer.h`` (GPT-2), ``model.bert.encoder.layer`` (BERT) for a
    ``HFCausalLMLoss``.
    """
    best_name, best_size = None, (-1, -1)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = (sum(p.numel() for p in module.parameters()), len(module))
            if size > best_size:
                best_name, best_size = name, size
    if best_name is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks; cannot find its layers")
    return best_name
