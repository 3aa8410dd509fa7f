"""The plan: the parallel configuration, per-layer strategies, stages, predictions and solver facts.

A `Plan` is frozen and round-trips through YAML (`Plan.save` / `Plan.load`), validated on load. It carries the
fingerprint of the model it was made for, so it can refuse another model (`Plan.check_model`).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from costmodel.config import (  # noqa: F401 - re-exported: the plan speaks in these types
    AC,
    GRAD_COMPRESS,
    PP_COMPRESS,
    PRECISIONS,
    ParallelConfig,
    Schedule,
    _enum,
    _parse_bool,
    parse_grad_compress,
    parse_kv,
)
from costmodel.runnable import SELECTIVE_POLICIES

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LayerStrategy:
    """What the plan does with one layer."""

    name: str  #: layer name from the profile (``embed``, ``layers.7``, ``head``)
    stage: int  #: pipeline stage (virtual stage with interleaving), 0-based
    ac: AC = AC.NONE  #: activation checkpointing of this layer
    tp: bool = False  #: split by tensor parallelism (Megatron column/row layout)

    def to_dict(self) -> dict:
        return {"name": self.name, "stage": self.stage, "ac": self.ac.value, "tp": self.tp}


@dataclass(frozen=True, kw_only=True)
class StageInfo:
    """One (virtual) pipeline stage."""

    index: int  #: 0-based (virtual) stage index
    rank: int  #: pipeline rank that runs it
    first: int  #: index of its first layer
    last: int  #: index of its last layer (inclusive)
    time_s: float = 0.0  #: predicted forward+backward (+recompute) time of one micro-batch
    memory_bytes: float = 0.0  #: predicted peak memory of its rank
    inflight: float = 1.0  #: micro-batches whose activations it holds at the peak (fractional when interleaved)
    memory_parts: dict = field(default_factory=dict)  #: its rank's memory breakdown (params, grads, …, peak)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel training plan for one model on one cluster."""

    model: str  #: model spec (``llama3-70b``, ``hf:llama:…``, ``file.py:factory``)
    fingerprint: str  #: fingerprint of the captured model the plan was made for
    seq: int  #: sequence length
    global_batch: int  #: sequences per optimizer step
    cluster: str  #: cluster spec (preset or YAML path)
    config: ParallelConfig  #: the parallel configuration
    layers: tuple[LayerStrategy, ...]  #: per-layer choices, in order
    stages: tuple[StageInfo, ...] = ()  #: pipeline stages (one when pp == 1)
    predicted: dict = field(default_factory=dict)  #: the estimate (shared/DESIGN.md JSON contract)
    solver: dict = field(default_factory=dict)  #: status, objective, bound, gap, time_s, candidates
    alternatives: tuple[dict, ...] = ()  #: top-k other candidates: config, predicted, why they lost
    provenance: dict = field(default_factory=dict)  #: versions, cluster facts, creation time
    traced: dict = field(default_factory=dict)  #: what `autopar check` traced beside the prediction (`traced_summary`)
    #: the torch.compile backend the plan's blocks were priced under (`plan --compile`; the emitted script's default
    #: ``--compile``), or None: eager
    compile: str | None = None
    #: the per-layer profile its compute was priced from (`plan --profile`, its absolute path), which `validate`
    #: prices it from again; None: the cluster's own compute (the roofline, or a CPU cluster's layers as measured
    #: here, `costmodel.measured.layer_graph`)
    profile: str | None = None
    #: what its selective layers recompute (`costmodel.runnable.selective_policy` of the model: ``attention-core``,
    #: ``all-but-attention-core`` or ``every-other-matmul``), or None: no layer is selective (a plan file without
    #: it: ``attention-core``)
    selective: str | None = None
    schema_version: int = SCHEMA_VERSION  #: plan file schema

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each pipeline (gradient accumulation)."""
        return self.global_batch // (self.config.dp * self.config.mbs)

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version, "model": self.model, "fingerprint": self.fingerprint,
            "seq": self.seq, "global_batch": self.global_batch, "cluster": self.cluster,
            "config": self.config.to_dict(), "layers": [lay.to_dict() for lay in self.layers],
            "stages": [s.to_dict() for s in self.stages], "predicted": self.predicted, "solver": self.solver,
            "alternatives": list(self.alternatives), "provenance": self.provenance,
        } | ({"traced": self.traced} if self.traced else {}) | ({"compile": self.compile} if self.compile else {}) \
            | ({"profile": self.profile} if self.profile else {}) \
            | ({"selective": self.selective} if self.selective else {})

    def dumps(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    def save(self, path: str | Path) -> None:
        from planner.files import write_atomic

        write_atomic(path, self.dumps())

    @staticmethod
    def from_dict(d: dict, *, source: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: not a plan file (expected a mapping at the top)")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"{source}: schema_version {version!r} is not supported (this autopar reads "
                             f"{SCHEMA_VERSION}); re-run `autopar plan` to write a new plan")
        missing = [k for k in ("model", "fingerprint", "seq", "global_batch", "cluster", "config", "layers")
                   if k not in d]
        if missing:
            raise ValueError(f"{source}: missing key {missing[0]!r}")
        try:
            cfg_d = dict(d["config"])
            if isinstance(cfg_d.get("sp"), str):
                cfg_d["sp"] = _parse_bool(cfg_d["sp"], "sp")
            config = ParallelConfig.from_dict(cfg_d)
            layers = tuple(LayerStrategy(name=x["name"], stage=int(x["stage"]), ac=_enum(AC, x["ac"], "ac"),
                                         tp=bool(x.get("tp", False))) for x in d["layers"])
            stages = tuple(StageInfo(**s) for s in d.get("stages", []))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: malformed entry ({exc}); re-run `autopar plan`") from None
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        profile = d.get("profile") or None
        if profile is not None and not isinstance(profile, str):
            raise ValueError(f"{source}: profile must be the path of a profile file, got {profile!r}; re-run "
                             "`autopar plan`")
        plan = Plan(model=d["model"], fingerprint=d["fingerprint"], seq=int(d["seq"]),
                    global_batch=int(d["global_batch"]), cluster=d["cluster"], config=config, layers=layers,
                    stages=stages, predicted=d.get("predicted") or {}, solver=d.get("solver") or {},
                    alternatives=tuple(d.get("alternatives") or ()), provenance=d.get("provenance") or {},
                    traced=d.get("traced") or {}, compile=d.get("compile") or None, profile=profile,
                    selective=d.get("selective") or None)
        plan.validate(source=source)
        return plan

    @staticmethod
    def load(path: str | Path) -> Plan:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"plan file {path} not found; write one with `autopar plan MODEL --out {path}`")
        try:
            d = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        return Plan.from_dict(d, source=str(path))

    def validate(self, *, source: str = "plan") -> None:
        """Check the invariants a decoded plan must satisfy; raise ValueError naming the first broken one."""
        c = self.config
        if self.global_batch % (c.dp * c.mbs):
            raise ValueError(f"{source}: global_batch {self.global_batch} is not a multiple of dp·mbs = "
                             f"{c.dp}·{c.mbs}")
        if self.selective is not None and self.selective not in SELECTIVE_POLICIES:
            raise ValueError(f"{source}: selective {self.selective!r} is not a policy ({', '.join(SELECTIVE_POLICIES)}"
                             "); re-run `autopar plan`")
        n_stages = c.pp * c.vpp
        prev = 0
        for lay in self.layers:
            if not 0 <= lay.stage < n_stages:
                raise ValueError(f"{source}: layer {lay.name} on stage {lay.stage}, but there are {n_stages}")
            if lay.stage < prev:
                raise ValueError(f"{source}: stages are not contiguous at layer {lay.name}")
            prev = lay.stage
        used = {lay.stage for lay in self.layers}
        if self.layers and used != set(range(n_stages)):
            empty = sorted(set(range(n_stages)) - used)
            raise ValueError(f"{source}: stage {empty[0]} has no layers")

    def check_model(self, fingerprint: str) -> None:
        """Refuse a model whose fingerprint differs from the one the plan was made for."""
        if fingerprint != self.fingerprint:
            raise ValueError(f"this plan was made for model {self.model} with fingerprint {self.fingerprint}, "
                             f"but the model given has fingerprint {fingerprint}; re-plan for this model")

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)


def provenance(cluster_desc: dict) -> dict:
    import torch

    from planner.version import __version__

    return {"autopar_version": __version__, "torch_version": str(torch.__version__),
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "cluster": cluster_desc}
