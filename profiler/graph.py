"""The captured model: per-node facts (`NodeInfo`), the whole graph (`ModelGraph`), and its grouping into
layers (`Layer`, `LayerGraph`).

Conventions:
- FLOPs follow `torch.utils.flop_counter`: only matmul-like ops (mm, bmm, addmm, baddbmm, convolution,
  scaled-dot-product attention) count, one multiply-add = 2 FLOPs. Memory-bound ops are costed by bytes.
- Every fact is for the batch the graph was captured with (`ModelGraph.batch`, usually 1). FLOPs, bytes and
  saved activations of a transformer scale linearly with the micro-batch; the cost model multiplies.
- `saved_bytes` of a node counts the activation storages autograd keeps for backward that this node saves
  first; a storage saved again later (e.g. one input feeding q, k and v projections) is not counted twice.
  In a `ModelGraph` "first" is over the whole model; inside a `Layer` it is over the layer (a tensor that
  several layers save, like RoPE tables, is then charged to each: each pipeline stage holds its own copy).
  Parameters and buffers are never activations.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

Shape = tuple[int, ...]


def attention_scores(shape, batch: int, seq: int) -> bool:
    """Whether a tensor of ``shape`` holds attention scores or probabilities (what selective AC recomputes), in a
    capture of ``batch`` sequences of ``seq`` tokens: [batch, heads, seq, seq], or [batch·heads, seq, seq] in
    Megatron's baddbmm attention. A trailing square is not enough: a [batch, seq, width] activation has one wherever
    width = seq (llama3-70b's hidden states at seq 8192). The runtime's selective policy applies the same rule,
    `costmodel.runnable.attention_scores` (the profiler imports nothing of the cost model, and the runtime nothing
    of the profiler); tests/test_runnable.py pins the two equal."""
    if len(shape) < 3 or shape[-1] != shape[-2] or shape[-1] <= 1 or (seq and shape[-1] != seq):
        return False
    if len(shape) >= 4:
        return True
    lead = 1
    for d in shape[:-2]:
        lead *= d
    return lead != batch


#: how the capture records an ``nn.Linear`` (``F.linear``): the only op the runtime's tensor parallelism splits
#: (`profiler.layers.tp_layout`)
LINEAR_OP = "aten.linear.default"


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """One operation of the captured forward graph, with its forward and backward costs."""

    name: str  #: fx node name, unique in the graph
    op: str  #: operator, e.g. ``aten.linear.default``
    kind: str  #: ``matmul`` | ``attention`` | ``memory`` (memory-bound) | ``view`` (free) | ``other``
    module_path: str  #: FQN of the innermost module that ran it (``''`` for the root)
    module_type: str  #: class name of that module
    input_shapes: tuple[Shape, ...]  #: shapes of the tensor inputs (parameters included)
    input_dtypes: tuple[str, ...]  #: dtypes of the tensor inputs
    output_shapes: tuple[Shape, ...]  #: shapes of the tensor outputs
    output_dtypes: tuple[str, ...]  #: dtypes of the tensor outputs
    fwd_flops: int  #: forward FLOPs (flop_counter conventions)
    bwd_flops: int  #: backward FLOPs: gradients of the inputs that require grad, as autograd computes them
    fwd_bytes: int  #: bytes read + written by the forward kernels (views excluded)
    bwd_bytes: int  #: bytes read + written by the backward kernels
    output_bytes: int  #: bytes of the node's tensor outputs
    params: tuple[str, ...]  #: FQNs of the parameters this node reads directly
    inputs: tuple[str, ...] = ()  #: names of the call nodes whose outputs this node reads
    #: (storage id, bytes, is seq×seq, is a weight's copy) of every storage it saves
    saved: tuple[tuple[int, int, bool, bool], ...] = ()
    saved_square_bytes: int = 0  #: the part of saved_bytes in seq×seq tensors (attention scores/probabilities)
    #: the part of saved_bytes in per-call copies of (parts of) parameters: under autocast the cast of a weight
    #: autocast does not cache (a grouped expert weight's transpose, `profiler.capture._ParamCasts`); sized as the
    #: weight (its shard on a rank), not as the batch
    saved_weight_bytes: int = 0
    #: whether it reads or makes attention scores (`attention_scores`, judged by the capture)
    attention_core: bool = False
    #: a fused attention kernel that draws dropout (``dropout_p`` > 0): selective AC recomputes it, since a kept
    #: kernel would skip its random draw in the recomputation (`planner.emit.runtime._FUSED_ATTENTION`)
    dropout: bool = False
    saved_bytes: int  #: activation bytes first saved for backward by this node
    tp_role: str = "none"  #: ``column`` | ``row`` | ``sharded`` | ``replicated`` | ``vocab`` | ``none``

    @property
    def is_attention_core(self) -> bool:
        """True for the unfused attention core: ops that produce or read seq×seq scores or probabilities
        (QKᵀ, mask, softmax, dropout, ·V). Selective recomputation (Korthikanti et al. 2022 §4.2) recomputes
        them and drops their seq×seq saved tensors. A fused attention kernel exposes none, so selective
        recomputation leaves it alone."""
        return self.kind != "attention" and self.attention_core


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter (or buffer) of the model."""

    fqn: str  #: fully qualified name
    shape: Shape  #: its shape
    dtype: str  #: its dtype as captured
    numel: int  #: number of elements
    is_buffer: bool = False  #: True for buffers (not trained, no gradient or optimizer state)


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """A model as captured: its nodes in execution order, its parameters and how it was captured."""

    name: str  #: the model spec or class name
    method: str  #: ``export`` or ``symbolic_trace``
    batch: int  #: batch size of the example inputs
    seq: int  #: sequence length of the example inputs (0 when not a sequence model)
    dtype: str  #: activation dtype the graph was captured in
    nodes: tuple[NodeInfo, ...]  #: all call nodes, in execution order
    params: tuple[ParamInfo, ...]  #: parameters and buffers
    arch: dict = field(default_factory=dict)  #: known architecture facts (hidden, heads, layers, ...)

    @property
    def fingerprint(self) -> str:
        """A hash of the structure and shapes: a plan refuses a model with another fingerprint."""
        import hashlib

        h = hashlib.sha256()
        for n in self.nodes:
            h.update(f"{n.op}|{n.module_path}|{n.input_shapes}|{n.output_shapes}|{n.input_dtypes}\n".encode())
        for p in self.params:
            h.update(f"{p.fqn}|{p.shape}|{p.is_buffer}\n".encode())
        return h.hexdigest()[:16]

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params if not p.is_buffer)

    def to_dict(self) -> dict:
        return asdict(self) | {"fingerprint": self.fingerprint}

    @staticmethod
    def from_dict(d: dict) -> ModelGraph:
        def tup(x):
            return tuple(tuple(s) for s in x)

        nodes = tuple(
            NodeInfo(**{**n, **{k: tup(n[k]) for k in ("input_shapes", "output_shapes")},
                        "input_dtypes": tuple(n["input_dtypes"]), "output_dtypes": tuple(n["output_dtypes"]),
                        "params": tuple(n["params"]), "inputs": tuple(n.get("inputs", ())),
                        # (a profile written before the weight-copy flag has 3-tuples: no copies)
                        "saved": tuple((*x, False)[:4] for x in n.get("saved", ()))})
            for n in d["nodes"]
        )
        params = tuple(ParamInfo(**{**p, "shape": tuple(p["shape"])}) for p in d["params"])
        return ModelGraph(name=d["name"], method=d["method"], batch=d["batch"], seq=d["seq"], dtype=d["dtype"],
                          nodes=nodes, params=params, arch=dict(d.get("arch", {})))

    def dumps(self) -> str:
        return json.dumps(self.to_dict())


def _total(nodes: Iterable[NodeInfo], attr: str) -> int:
    return sum(getattr(n, attr) for n in nodes)


@dataclass(frozen=True, kw_only=True)
class Layer:
    """A contiguous group of nodes that a pipeline stage boundary may not split: the embedding, one
    repeated block, or the head (final norm, output projection and loss)."""

    name: str  #: module path of the block (``layers.3``) or ``embed`` / ``head``
    kind: str  #: ``embed`` | ``block`` | ``head``
    index: int  #: position in execution order
    signature: str  #: structural hash: identical blocks share it
    nodes: tuple[NodeInfo, ...]  #: the layer's nodes, in execution order
    param_numel: int  #: elements of the parameters this layer owns
    shared_params: tuple[str, ...] = ()  #: parameters it uses but an earlier layer owns (tied weights)
    input_bytes: int = 0  #: bytes of activations flowing in from the previous layer (pipeline boundary)

    @property
    def fwd_flops(self) -> int:
        return _total(self.nodes, "fwd_flops")

    @property
    def bwd_flops(self) -> int:
        return _total(self.nodes, "bwd_flops")

    @property
    def saved_bytes(self) -> int:
        return _total(self.nodes, "saved_bytes")

    @property
    def fwd_bytes(self) -> int:
        return _total(self.nodes, "fwd_bytes")

    @property
    def bwd_bytes(self) -> int:
        return _total(self.nodes, "bwd_bytes")


@dataclass(frozen=True, kw_only=True)
class Timings:
    """Each layer's forward and backward time measured at one batch on one device (`profiler.measure`), and at a
    larger one when it fits, or why none was measured (``layers`` empty)."""

    layers: Mapping[str, tuple[float, float]]  #: layer name → (forward s, backward s) at ``batch``
    batch: int  #: the batch measured
    note: str  #: where they were measured, or why not (for reports)
    #: the device they were measured on as the cost model describes it (`costmodel.hardware.DeviceSpec`; a CPU
    #: cluster's: this machine's as `measure_cpu_device` measured it); None: the cluster's own device
    device: object = field(default=None, compare=False)
    #: the same layers measured at ``larger_batch`` (empty: only ``batch`` was): with the two, a layer's time is
    #: a part that does not grow with the batch plus one that grows as the roofline does (`costmodel.layercost`)
    larger: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    larger_batch: int = 0  #: the batch of ``larger`` (0: none)

    @property
    def measured(self) -> tuple[Mapping[str, tuple[float, float]], int] | None:
        """What `costmodel.estimate.Evaluator` takes as ``measured``; None when nothing was measured."""
        return (self.layers, self.batch) if self.layers else None


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The model as a chain of layers, the unit of pipeline partitioning and per-layer strategy choice."""

    model: ModelGraph  #: the captured graph the layers were made from
    layers: tuple[Layer, ...]  #: embed, blocks…, head in execution order
    block_container: str  #: FQN of the ModuleList holding the repeated blocks (``''`` if none found)
    #: each layer's time measured on the machine the cost model prices (`costmodel.measured.layer_graph`: a CPU
    #: cluster's model measured here), used instead of the roofline's level; None: the roofline's
    timings: Timings | None = field(default=None, compare=False, repr=False)
    #: makes the same model's graph captured under ``torch.autocast`` (`under_autocast`); None where it cannot be
    recapture: Callable[[], LayerGraph] | None = field(default=None, compare=False, repr=False)
    _twin: list = field(default_factory=list, init=False, compare=False, repr=False)

    def under_autocast(self) -> LayerGraph | None:
        """The same model captured with fp32 parameters under ``torch.autocast`` (`profiler.capture`), as autopar's
        runtime trains outside FSDP: its nodes carry the dtypes autocast gives them. Captured on first use (once
        per graph); None for a graph that cannot be recaptured (read from a file, or a live module's)."""
        if not self._twin and self.recapture is not None:
            self._twin.append(self.recapture())
        return self._twin[0] if self._twin else None

    @property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")

    @property
    def signatures(self) -> dict[str, list[int]]:
        """Signature → indices of the layers that share it."""
        out: dict[str, list[int]] = {}
        for layer in self.layers:
            out.setdefault(layer.signature, []).append(layer.index)
        return out
