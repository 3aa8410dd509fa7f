"""Capture an ``nn.Module`` as a `ModelGraph`: `torch.export` (non-strict) first, `torch.fx.symbolic_trace` as
the fallback, then a replay of the graph on fake tensors that measures what each node costs.

Why a replay: export gives the forward graph with module paths and shapes, but training also needs each node's
backward FLOPs and the activations autograd keeps for backward. Both are defined by autograd's derivative
formulas, so instead of re-deriving them we *run* each node under `FakeTensorMode` (no memory, no compute):

- forward FLOPs and bytes: the node runs under `FlopCounterMode` and a byte-counting dispatch mode;
- saved activations: the node runs inside `saved_tensors_hooks`; every storage it saves that is not a
  parameter, a buffer, or already saved by an earlier node is charged to it;
- backward FLOPs and bytes: the node's inputs are detached copies (so its autograd graph is local) and
  `torch.autograd.grad` of its outputs is run under the same counters.

``kernels="gpu"`` (the default) replays the ops whose autograd behaviour differs between CPU and GPU as the
GPU kernels behave: scaled-dot-product attention as FlashAttention (it saves q, k, v, the output and the row
log-sum-exp, not the seq² probabilities) and dropout as the fused `native_dropout` (a 1-byte mask; the CPU path
saves a mask in the input dtype). ``kernels="native"`` replays this machine's own dispatch, for comparing with a
real run here. Attention FLOPs come from `torch.utils.flop_counter.sdpa_flop_count` whenever FlopCounterMode
does not see the kernel (it does not see the CPU ones); the flash backward includes its recomputation of the
scores, as the kernel does.

``autocast="bf16"`` (or ``"fp16"``) replays an fp32 model under ``torch.autocast``, as autopar's runtime trains
outside FSDP: every node's outputs and saved tensors then have the dtypes autocast gives them (the residual stream
stays fp32, a norm saves its fp32 input, the loss casts the logits to fp32). The replay runs torch's own CPU
autocast; with ``kernels="gpu"`` the ops CUDA's autocast runs in fp32 and CPU's leaves alone (softmax, layer_norm,
rsqrt, …; `_cuda_fp32_policy`) are given CUDA's policy for the replay. Casts of parameters are autocast's cast
cache, state the cost model charges with the parameters (`costmodel.memory.state_bytes_per_param`), not
activations: they are neither saved bytes nor traffic here.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from profiler.graph import ModelGraph, NodeInfo, ParamInfo, attention_scores


class CaptureError(ValueError):
    """The model cannot be captured; the message says where and how to fix it."""


_SDPA = {torch.ops.aten.scaled_dot_product_attention.default}
_VIEW_TARGETS = {operator.getitem}
_CPU = torch.device("cpu")
# ops that move no data: aliases, and allocations whose contents are never read (baddbmm with beta=0)
_NO_TRAFFIC = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default,
               torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
               torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}
_KERNELS = ("gpu", "native")
_DROPOUT = {torch.ops.aten.dropout.default}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class _ByteCounter(TorchDispatchMode):
    """Counts bytes read and written by every non-view ATen op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = _tensors(out)
        if outs and not getattr(func, "is_view", False) and func.namespace == "aten" and func not in _NO_TRAFFIC:
            self.total += sum(_nbytes(t) for t in _tensors((args, kwargs)) + outs)
        return out


@contextlib.contextmanager
def _counting():
    flops = FlopCounterMode(display=False)
    nbytes = _ByteCounter()
    with flops, nbytes:
        yield flops, nbytes


def _argument(op, args, kwargs, name: str):
    """The value ``op`` is called with for its schema argument ``name`` (its default when not passed)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return kwargs.get(name, args[i] if i < len(args) else arg.default_value)
    return None


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Scaled-dot-product attention with FlashAttention's autograd semantics (what it saves for backward). Under
    autocast its inputs are cast to the autocast dtype, as both policies do for SDPA."""
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    dv = value.shape[-1]
    if dv < query.shape[-1]:  # the CPU kernel takes one head size (DeepSeek's MLA: v 128, q/k 192): pad V with
        # zeros and drop the padding from the output, as Hugging Face does for flash-attn
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0][..., :dv]


def _fused_dropout(input, p, train):
    """Dropout as GPUs run it: the fused kernel, which saves a 1-byte mask."""
    if not train or p == 0:
        return input
    return torch.ops.aten.native_dropout.default(input, p, train)[0]


#: the ops torch's CUDA autocast runs in fp32 (ATen/autocast_mode.h, torch 2.13: AT_FORALL_FP32, casting every
#: floating input) and those it gives an fp32 ``dtype`` when none is passed (AT_FORALL_FP32_SET_OPT_DTYPE)
_CUDA_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
              "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
              "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
              "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
              "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
              "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
              "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
              "logsumexp")
_CUDA_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                            "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                            "sum.dim_IntList")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _eligible(t) -> bool:
    """What autocast casts (autocast_mode.h, ``is_autocast_eligible``): floating tensors other than fp64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _fp32_kernel(op, set_dtype: bool):
    """An AutocastCPU kernel with CUDA autocast's fp32 policy for ``op`` (autocast_mode.h's ``fp32`` and
    ``fp32_set_opt_dtype``): run it with autocast excluded, on fp32 inputs, or with ``dtype=float32``."""
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if set_dtype:
                floating = any(_eligible(t) for t in _tensors((args, kwargs)))
                if floating and _argument(op, args, kwargs, "dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            up = lambda t: t.float() if _eligible(t) else t  # noqa: E731
            return op(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
    return kernel


@contextlib.contextmanager
def _cuda_fp32_policy():
    """While inside, CPU autocast casts as CUDA's does where the two differ: the ops CUDA's autocast runs in fp32
    and CPU's has no policy for get an AutocastCPU kernel that does so (registered in a `torch.library.Library`,
    removed on exit). The lower-precision lists agree for the ops transformers run (linear, matmul, bmm,
    baddbmm, SDPA: autocast_mode.h and autocast_mode.cpp); CPU's own fp32 ops (the losses) are left as they are."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for set_dtype, names in ((False, _CUDA_FP32), (True, _CUDA_FP32_SET_OPT_DTYPE)):
            for name in names:
                if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU"):
                    lib.impl(name, _fp32_kernel(_overload(name), set_dtype), "AutocastCPU")
        yield
    finally:
        lib._destroy()


class _ParamCasts(TorchDispatchMode):
    """Records the casts autocast keeps in its cast cache: their outputs join ``constants``, the storages that are
    never activations, and their bytes are kept apart from the node's traffic. torch caches the cast of an fp32 leaf
    that requires grad and is not a view, to the autocast dtype (autocast_mode.cpp, ``cached_cast``): a whole
    parameter (``whole``: storage → shape and strides), not a slice or a transpose of one (a grouped expert
    weight's ``w.transpose(1, 2)``, ``w[e]``), whose copy is made, and saved, at every call."""

    def __init__(self, constants: set, whole: dict, copies: set) -> None:
        super().__init__()
        self.constants, self.whole, self.copies, self.bytes = constants, whole, copies, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        a = args[0] if args else None
        if func is not torch.ops.aten._to_copy.default or not isinstance(a, torch.Tensor):
            return out
        ref = StorageWeakRef(a.untyped_storage())
        if a.dtype == torch.float32 and out.dtype in (torch.bfloat16, torch.float16) and a.storage_offset() == 0 \
                and self.whole.get(ref) == (tuple(a.shape), a.stride()):
            self.constants.add(StorageWeakRef(out.untyped_storage()))
            self.bytes += _nbytes(a) + _nbytes(out)
        elif ref in self.whole:  # a copy of (part of) a weight, made per call: sized as the weight, not the batch
            self.copies.add(StorageWeakRef(out.untyped_storage()))
        return out


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm`` (a grouped GEMM: the mixture-of-experts experts of torchtitan and of
    transformers' ``grouped_mm`` experts), which torch's FlopCounterMode has no formula for: 2·M·K·N summed over the
    groups. [S, K] × [E, K, N] (tokens sorted by expert, the forward and the input gradient) and batched [E, M, K] ×
    [E, K, N] make 2·numel(out)·K; [K, S] × [S, N] grouped along S (the weight gradient, [E, K, N] out) makes
    2·K·S·N, once, not per group."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    numel = 1
    for d in out_shape:
        numel *= d
    return 2 * numel * a_shape[-1]


def register_grouped_mm_flops(*ops) -> None:
    """Count ``ops`` (grouped GEMMs with the signature of ``aten._grouped_mm``) with `grouped_mm_flops` wherever a
    FlopCounterMode runs (the capture, `autopar check`'s trace); ops already known are left alone."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    for op in ops:
        packet = getattr(op, "overloadpacket", op)
        if packet not in flop_registry:
            register_flop_formula(packet)(grouped_mm_flops)


register_grouped_mm_flops(torch.ops.aten._grouped_mm)


def _attention_flops(args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> tuple[int, int]:
    q, k, v = args[0], args[1], args[2]
    k_shape, v_shape = list(k.shape), list(v.shape)
    k_shape[-3] = v_shape[-3] = q.shape[-3]  # grouped-query attention computes as many heads as q has
    fwd = sdpa_flop_count(q.shape, tuple(k_shape), tuple(v_shape))
    bwd = sdpa_backward_flop_count(out.shape, q.shape, tuple(k_shape), tuple(v_shape)) if q.requires_grad else 0
    return fwd, bwd


class _ModuleStack:
    """Records which modules are executing, so a capture failure can name the module it happened in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[tuple[str, torch.nn.Module]] = []
        self.deepest: list[tuple[str, torch.nn.Module]] = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._push(name, mod)))
            self.handles.append(mod.register_forward_hook(self._pop))

    def _push(self, name, mod):
        def hook(*_):
            self.stack.append((name, mod))
            self.deepest = list(self.stack)
        return hook

    def _pop(self, *_):
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _explain_failure(exc: BaseException, model: torch.nn.Module, stack: list[tuple[str, torch.nn.Module]]) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lowered = str(exc).lower()
    if any(s in lowered for s in ("data-dependent", "data dependent", ".item()", "control flow",
                                   "guard on", "cannot be called on meta")):
        construct = "Python control flow or .item() on a tensor's value"
    else:
        construct = msg[:160]
    name, mod = stack[-1] if stack else ("", model)
    where = f"module '{name or '<root>'}' ({type(mod).__name__}.forward"
    try:
        src = inspect.getsourcefile(type(mod))
        line = None
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == src:
                line = tb.tb_lineno
            tb = tb.tb_next
        where += f", {src}:{line})" if line else f", {src})"
    except (TypeError, OSError):
        where += ")"
    return (f"cannot capture {type(model).__name__}: {construct} in {where}; make it depend on shapes only "
            f"(static shapes, torch.where/torch.cond instead of `if tensor`), or pass a traceable model through "
            f"a file.py:factory")


def _export(model: torch.nn.Module, example_inputs: tuple) -> torch.fx.GraphModule:
    fake_mode = next((t.fake_mode for t in list(model.parameters()) + list(example_inputs)
                      if isinstance(t, FakeTensor)), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), _quiet_logging():
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
    return ep


@contextlib.contextmanager
def _quiet_logging():
    """Keep export's noise off stderr: on a data-dependent branch it logs warnings and prints the partial graph
    to stderr before raising, and the CLI's contract is one line there (`_explain_failure` writes it). What it
    prints on success is passed on."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        logging.disable(previous)
    sys.stderr.write(buffer.getvalue())


def _trace(model: torch.nn.Module, example_inputs: tuple, stack: _ModuleStack):
    """Return (graph module, method, placeholder → parameter FQN or None). Raises CaptureError."""
    try:
        ep = _export(model, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure gets the fallback, then a readable error
        export_exc, export_stack = exc, list(stack.deepest)
    else:
        mapping = {}
        for spec in ep.graph_signature.input_specs:
            mapping[spec.arg.name] = (spec.kind.name, spec.target)
        # tensors the forward creates (Falcon's attention: torch.tensor(...)) are lifted into the program's
        # constants, not attributes of its graph module: the replay reads them from here
        ep.graph_module._autopar_constants = dict(ep.constants)
        return ep.graph_module, "export", mapping
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001
        raise CaptureError(_explain_failure(export_exc, model, export_stack)) from export_exc
    return gm, "symbolic_trace", {}


def _to_fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.is_floating_point() and t.requires_grad:
        out.requires_grad_(True)
    return out


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    name: str | None = None,
    arch: dict | None = None,
    kernels: str = "gpu",
    autocast: str | None = None,
) -> ModelGraph:
    """Capture ``model`` called on ``example_inputs`` (real, meta or fake tensors) as a `ModelGraph`.

    The model should return a scalar loss, so that the backward of every node is part of training.
    ``kernels``: ``"gpu"`` or ``"native"``; ``autocast``: None, ``"bf16"`` or ``"fp16"``, replaying the fp32
    ``model`` under ``torch.autocast`` (see the module docstring; recorded as ``arch["autocast"]``).
    """
    if kernels not in _KERNELS:
        raise ValueError(f"kernels must be one of {_KERNELS}, got {kernels!r}")
    if autocast is not None:
        if autocast not in _AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {tuple(_AUTOCAST_DTYPES)} or None, got {autocast!r}")
        low = next(((n, p.dtype) for n, p in model.named_parameters()
                    if p.is_floating_point() and p.dtype != torch.float32), None)
        if low:
            raise ValueError(f"autocast capture needs fp32 parameters (autocast trains over fp32 ones), but "
                             f"{low[0]} is {low[1]}; build the model in fp32")
    example_inputs = tuple(example_inputs)
    stack = _ModuleStack(model)
    try:
        gm, method, mapping = _trace(model, example_inputs, stack)
    finally:
        stack.remove()

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    fake: dict[str, torch.Tensor] = {}  # FQN → fake tensor (tied parameters share one)
    by_id: dict[int, torch.Tensor] = {}
    for fqn, t in list(named_params.items()) + list(named_buffers.items()):
        if id(t) not in by_id:
            by_id[id(t)] = _to_fake(t, mode)
        fake[fqn] = by_id[id(t)]
    for fqn in named_buffers:
        fake[fqn].requires_grad_(False)
    constant_storages = {StorageWeakRef(t.untyped_storage()) for t in by_id.values()}
    inputs = [_to_fake(t, mode) for t in example_inputs]
    for t in inputs:
        t.requires_grad_(False)

    # tied parameters have several FQNs (GPT-2's lm_head.weight is transformer.wte.weight) and export may use any
    # of them: every node names a parameter by its canonical FQN, the first that named_parameters() yields
    canonical: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for fqn, t in named_params.items():
        canonical[fqn] = first_name.setdefault(id(t), fqn)
    first = example_inputs[0] if example_inputs else None
    batch = int(first.shape[0]) if first is not None and first.dim() >= 1 else 1
    seq = int(first.shape[1]) if first is not None and first.dim() >= 2 else 0
    replay = _Replay(gm, method, mapping, fake, canonical, inputs, mode, constant_storages, kernels, model, batch, seq,
                     autocast=_AUTOCAST_DTYPES[autocast] if autocast else None)
    nodes = replay.run()

    seen: set[int] = set()
    params = []
    for fqn, t in list(named_params.items()) + list(named_buffers.items()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        params.append(ParamInfo(fqn=fqn, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                numel=t.numel(), is_buffer=fqn in named_buffers))
    float_params = [p for p in named_params.values() if p.is_floating_point()]
    dtype = str(float_params[0].dtype).removeprefix("torch.") if float_params else "float32"
    arch = dict(arch or {})
    if autocast:
        arch["autocast"] = autocast
    return ModelGraph(name=name or type(model).__name__, method=method, batch=batch, seq=seq, dtype=dtype,
                      nodes=tuple(nodes), params=tuple(params), arch=arch)


class _Replay:
    """Runs the captured graph node by node on fake tensors and records each node's costs."""

    def __init__(self, gm, method, mapping, fake, canonical, inputs, mode, constant_storages, kernels, model,
                 batch=1, seq=0, autocast: torch.dtype | None = None):
        self.autocast = autocast
        # the parameters autocast caches a cast of (fp32 leaves that require grad: `_ParamCasts`)
        self.whole = {StorageWeakRef(t.untyped_storage()): (tuple(t.shape), t.stride()) for t in fake.values()
                      if t.requires_grad and t.dtype == torch.float32}
        self.weight_copies: set = set()  # casts of parts of them, made per call (`NodeInfo.saved_weight_bytes`)
        self.gm, self.method, self.mapping = gm, method, mapping
        self.batch, self.seq = batch, seq
        self.fake, self.canonical, self.inputs, self.mode = fake, canonical, inputs, mode
        self.constant_storages = constant_storages
        self.gpu_kernels = kernels == "gpu"
        self.model = model
        self.storage_ids: dict = {}  # activation storage → id, in the order first saved
        self._saved: list[tuple[int, int, bool]] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.param_of: dict[torch.fx.Node, str] = {}  # node → FQN of the parameter it is (a view of)
        self._charged = 0

    def scores(self, shape) -> bool:
        """Whether a tensor of this shape holds attention scores: what selective AC recomputes."""
        return attention_scores(tuple(shape), self.batch, self.seq)

    def _pack(self, t: torch.Tensor):
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self.constant_storages:
            return t
        square = self.scores(t.shape)  # seq×seq attention scores/probabilities
        weight = ref in self.weight_copies
        if ref not in self.storage_ids:
            self.storage_ids[ref] = len(self.storage_ids)
            self._charged += t.untyped_storage().nbytes()
            if square:
                self._square_charged += t.untyped_storage().nbytes()
            if weight:
                self._weight_charged += t.untyped_storage().nbytes()
        self._saved.append((self.storage_ids[ref], t.untyped_storage().nbytes(), bool(square), weight))
        return t

    def _placeholders(self) -> None:
        user_inputs = iter(self.inputs)
        for node in self.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            kind, target = self.mapping.get(node.name, ("USER_INPUT", None))
            if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR") and target in self.fake:
                self.env[node] = self.fake[target]
                if kind == "PARAMETER":
                    self.param_of[node] = self.canonical.get(target, target)
            elif kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                const = getattr(self.gm, target) if hasattr(self.gm, target) else \
                    getattr(self.gm, "_autopar_constants", {}).get(target)
                self.env[node] = _to_fake(const, self.mode) if isinstance(const, torch.Tensor) else const
            else:
                self.env[node] = next(user_inputs)

    def _callable(self, node: torch.fx.Node) -> Callable:
        if node.op == "call_function":
            if node.target in _SDPA and self.gpu_kernels:
                return _flash_sdpa
            if node.target in _DROPOUT and self.gpu_kernels:
                return _fused_dropout
            return node.target
        if node.op == "call_method":
            return lambda obj, *a, **k: getattr(obj, node.target)(*a, **k)
        # call_module (symbolic_trace fallback): run the submodule with fake parameters
        sub = self.gm.get_submodule(node.target)
        prefix = node.target + "."
        state = {k[len(prefix):]: v for k, v in self.fake.items() if k.startswith(prefix)}
        return lambda *a, **k: torch.func.functional_call(sub, state, a, k)

    def run(self) -> list[NodeInfo]:
        self._placeholders()
        out_nodes = []
        with self.mode, self._autocast():
            for node in self.gm.graph.nodes:
                if node.op == "get_attr":
                    self.env[node] = self.fake.get(node.target, getattr(self.gm, node.target, None))
                    if node.target in self.canonical:
                        self.param_of[node] = self.canonical[node.target]
                elif node.op in ("call_function", "call_method", "call_module"):
                    try:
                        out_nodes.append(self._run_node(node))
                    except Exception as exc:  # noqa: BLE001 - named with where it came from, in one line
                        path, cls = self._module_of(node)
                        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        raise CaptureError(
                            f"cannot replay {node.target} from {path or 'the model'} ({cls}) on fake tensors: "
                            f"{why}; write that part with standard torch operators in a file.py:factory model, "
                            "or report it to autopar") from exc
        return out_nodes

    @contextlib.contextmanager
    def _autocast(self):
        """One autocast region over the whole replay, as over a micro-batch of the runtime's training step (so its
        cast cache lives as long), with CUDA's fp32 policy for ``kernels="gpu"``."""
        if self.autocast is None:
            yield
            return
        policy = _cuda_fp32_policy() if self.gpu_kernels else contextlib.nullcontext()
        with policy, torch.autocast("cpu", dtype=self.autocast):
            yield

    def _module_of(self, node: torch.fx.Node) -> tuple[str, str]:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, cls = list(stack.values())[-1]
            path = _clean_path(path)
            return path, (cls.rsplit(".", 1)[-1] if isinstance(cls, str) else cls.__name__)
        if node.op == "call_module":
            return node.target, type(self.gm.get_submodule(node.target)).__name__
        return "", type(self.model).__name__

    def _run_node(self, node: torch.fx.Node) -> NodeInfo:
        args = torch.fx.node.map_arg(node.args, lambda a: self.env[a])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: self.env[a])
        params = sorted({self.param_of[a] for a in node.all_input_nodes if a in self.param_of})

        def local(t):  # a detached alias: the node's autograd graph starts here
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.requires_grad:
                return t.detach().requires_grad_(True)
            if isinstance(t, torch.device) and t.type == "meta":  # graphs exported on meta replay on fake cpu
                return _CPU
            return t

        args, kwargs = pytree.tree_map(local, (args, kwargs))
        leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if _mutates(node):  # an in-place op may not write into a leaf: give it a non-leaf alias of each input
            args, kwargs = pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, (args, kwargs))
        fn = self._callable(node)
        if self.autocast is not None and node.target is torch.ops.aten._assert_tensor_metadata.default:
            kwargs = {**kwargs, "dtype": None}  # export's check of the dtype it traced (fp32) before a cast
        self._charged = 0
        self._saved = []
        self._square_charged = 0
        self._weight_charged = 0
        casts = _ParamCasts(self.constant_storages, self.whole, self.weight_copies) if self.autocast is not None else \
            contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), _counting() as (fc, bc), casts:
            out = fn(*args, **kwargs)
        fwd_flops, fwd_bytes, saved = fc.get_total_flops(), bc.total, self._charged
        fwd_bytes -= casts.bytes if self.autocast is not None else 0
        self.env[node] = out

        ins = leaves
        outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
        bwd_flops = bwd_bytes = 0
        if ins and outs:
            grads = [torch.ones_like(o) for o in outs]
            with _counting() as (fb, bb):
                torch.autograd.grad(outs, ins, grads, allow_unused=True)
            bwd_flops, bwd_bytes = fb.get_total_flops(), bb.total

        is_view = node.target in _VIEW_TARGETS or (fwd_bytes == 0 and fwd_flops == 0)
        if is_view and len(node.all_input_nodes) == 1 and node.all_input_nodes[0] in self.param_of:
            self.param_of[node] = self.param_of[node.all_input_nodes[0]]
        dropout = False
        if node.op == "call_function" and node.target in _SDPA:
            kind = "attention"
            dropout = bool(_argument(node.target, args, kwargs, "dropout_p"))
            if not fwd_flops:  # FlopCounterMode does not see the fused CPU kernels: use the closed form
                fwd_flops, bwd_flops = _attention_flops(args, kwargs, out)
        elif fwd_flops:
            kind = "matmul"
        elif is_view:
            kind = "view"
        else:
            kind = "memory"
        in_t, out_t = _tensors((args, kwargs)), _tensors(out)
        path, cls = self._module_of(node)
        return NodeInfo(
            name=node.name, op=_op_name(node), kind=kind, module_path=path, module_type=cls,
            input_shapes=tuple(tuple(t.shape) for t in in_t),
            input_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in in_t),
            output_shapes=tuple(tuple(t.shape) for t in out_t),
            output_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in out_t),
            fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops), fwd_bytes=int(fwd_bytes), bwd_bytes=int(bwd_bytes),
            output_bytes=sum(_nbytes(t) for t in out_t), params=tuple(params), saved_bytes=int(saved),
            saved_square_bytes=int(self._square_charged), saved_weight_bytes=int(self._weight_charged),
            attention_core=any(self.scores(s) for s in (*(t.shape for t in in_t), *(t.shape for t in out_t))),
            dropout=dropout,
            saved=tuple(dict.fromkeys(self._saved)),
            inputs=tuple(a.name for a in node.all_input_nodes if a.op not in ("placeholder", "get_attr")),
        )


def _mutates(node: torch.fx.Node) -> bool:
    """True for in-place ops (``aten.div_``, ``x.add_(…)``)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    return node.op == "call_method" and isinstance(t, str) and t.endswith("_") and not t.startswith("_")


def _clean_path(path: str) -> str:
    """Export writes module paths like ``L['self'].layers[0].attn`` in some versions; normalise to FQNs."""
    path = path.replace("L['self']", "").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return path.lstrip(".")


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        t = node.target
        return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    return f"{node.op}:{node.target}"

