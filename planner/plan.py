"""The plan: the parallel configuration, per-layer strategies, stages, predictions and solver facts.

A `Plan` is frozen and round-trips through YAML (`Plan.save` / `Plan.load`), validated on load. It carries the
fingerprint of the model it was made for, so it can refuse another model (`Plan.check_model`).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path

import yaml

SCHEMA_VERSION = 1


class Schedule(str, Enum):
    """Pipeline schedules (torch.distributed.pipelining names in brackets)."""

    GPIPE = "gpipe"  # ScheduleGPipe
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B
    INTERLEAVED = "interleaved"  # ScheduleInterleaved1F1B, vpp > 1 virtual stages per rank
    ZERO_BUBBLE = "zb"  # ScheduleInterleavedZeroBubble (split weight-gradient backward)


class AC(str, Enum):
    """Activation checkpointing of one layer."""

    NONE = "none"  # keep every saved activation
    SELECTIVE = "selective"  # recompute the attention core (Korthikanti et al. 2022 §4.2)
    FULL = "full"  # keep the layer input only, recompute the whole layer


GRAD_COMPRESS = ("none", "bf16", "fp16")  # plus "powersgd-R" for a rank R
PP_COMPRESS = ("none", "bf16")
PRECISIONS = ("bf16", "fp16", "fp32")


def parse_grad_compress(value: str) -> tuple[str, int]:
    """``none|bf16|fp16|powersgd-R`` → (kind, rank); rank is 0 unless PowerSGD."""
    if value in GRAD_COMPRESS:
        return value, 0
    if value.startswith("powersgd-"):
        rank = value.removeprefix("powersgd-")
        if rank.isdigit() and int(rank) > 0:
            return "powersgd", int(rank)
    raise ValueError(f"grad_compress={value!r}: use none, bf16, fp16 or powersgd-R with a rank R ≥ 1 (powersgd-4)")


def _enum(cls, value, key):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{key}={value!r}: choose one of {', '.join(m.value for m in cls)}") from None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the training job is spread over the GPUs: the keys of ``--config`` and ``--fix``."""

    dp: int = 1  #: data-parallel degree (replicas, or the sharding group under ZeRO/FSDP)
    tp: int = 1  #: tensor-parallel degree (inside a node)
    pp: int = 1  #: pipeline-parallel degree (ranks)
    cp: int = 1  #: context-parallel degree (not searched yet; must be 1)
    ep: int = 1  #: expert-parallel degree (not searched yet; must be 1)
    mbs: int = 1  #: micro-batch size per data-parallel rank
    vpp: int = 1  #: virtual pipeline stages per pipeline rank (interleaved schedule)
    schedule: Schedule = Schedule.ONE_F_ONE_B  #: pipeline schedule (ignored when pp == 1)
    ac: AC = AC.NONE  #: activation checkpointing for layers without their own choice
    zero: int = 0  #: ZeRO stage: 0 replicate (DDP), 1 optimizer, 2 +gradients, 3 +parameters (FSDP)
    sp: bool = False  #: sequence parallel (with tp > 1): norms/dropout sharded along the sequence
    grad_compress: str = "none"  #: data-parallel gradient reduction: none, bf16, fp16, powersgd-R
    pp_compress: str = "none"  #: pipeline-boundary activations: none or bf16
    precision: str = "bf16"  #: training precision (mixed precision with fp32 master weights unless fp32)

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "cp", "ep", "mbs", "vpp"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key}={v!r}: must be an integer ≥ 1")
        if not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", _enum(Schedule, self.schedule, "schedule"))
        if not isinstance(self.ac, AC):
            object.__setattr__(self, "ac", _enum(AC, self.ac, "ac"))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r}: choose 0, 1, 2 or 3")
        parse_grad_compress(self.grad_compress)
        if self.pp_compress not in PP_COMPRESS:
            raise ValueError(f"pp_compress={self.pp_compress!r}: choose one of {', '.join(PP_COMPRESS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.vpp > 1 and self.schedule not in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE):
            raise ValueError(f"vpp={self.vpp} needs schedule=interleaved (or zb); got schedule={self.schedule.value}")
        if self.schedule == Schedule.INTERLEAVED and self.pp > 1 and self.vpp < 2:
            raise ValueError("schedule=interleaved needs vpp ≥ 2 virtual stages per rank; set vpp=2 or more")
        if self.sp and self.tp == 1:
            raise ValueError("sp=on needs tp > 1: sequence parallel splits along the tensor-parallel group")
        if self.grad_compress != "none" and self.zero == 3 and parse_grad_compress(self.grad_compress)[0] == "powersgd":
            raise ValueError("grad_compress=powersgd works with DDP (zero 0-2), not with FSDP (zero=3)")
        if self.cp != 1 or self.ep != 1:
            raise ValueError(f"cp={self.cp}, ep={self.ep}: context and expert parallelism are not supported yet; "
                             "use cp=1, ep=1")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schedule"] = self.schedule.value
        d["ac"] = self.ac.value
        d["sp"] = "on" if self.sp else "off"
        return d

    @staticmethod
    def from_dict(d: dict) -> "ParallelConfig":
        known = {f.name for f in fields(ParallelConfig)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown configuration key {bad[0]!r}; known keys: {', '.join(sorted(known))}")
        d = dict(d)
        if "sp" in d and isinstance(d["sp"], str):
            d["sp"] = _parse_bool(d["sp"], "sp")
        return ParallelConfig(**d)


def _parse_bool(v: str, key: str) -> bool:
    low = v.lower()
    if low in ("on", "true", "1", "yes"):
        return True
    if low in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"{key}={v!r}: use on or off")


_INT_KEYS = ("dp", "tp", "pp", "cp", "ep", "mbs", "vpp", "zero")


def parse_kv(text: str, *, what: str = "--config") -> dict:
    """``"tp=8,pp=4,schedule=interleaved"`` → a dict of typed values (ints for the integer keys)."""
    known = {f.name for f in fields(ParallelConfig)}
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"{what}: {item!r} is not key=value (e.g. {what} tp=8,pp=2)")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in known:
            raise ValueError(f"{what}: unknown key {k!r}; known keys: {', '.join(sorted(known))}")
        if k in _INT_KEYS:
            if not v.lstrip("-").isdigit():
                raise ValueError(f"{what}: {k}={v!r} must be an integer")
            out[k] = int(v)
        elif k == "sp":
            out[k] = _parse_bool(v, k)
        else:
            out[k] = v
    return out


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
    inflight: int = 1  #: micro-batches whose activations it holds at the peak

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
        }

    def dumps(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    def save(self, path: str | Path) -> None:
        from planner.cli import write_atomic

        write_atomic(path, self.dumps())

    @staticmethod
    def from_dict(d: dict, *, source: str = "plan") -> "Plan":
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
        plan = Plan(model=d["model"], fingerprint=d["fingerprint"], seq=int(d["seq"]),
                    global_batch=int(d["global_batch"]), cluster=d["cluster"], config=config, layers=layers,
                    stages=stages, predicted=d.get("predicted") or {}, solver=d.get("solver") or {},
                    alternatives=tuple(d.get("alternatives") or ()), provenance=d.get("provenance") or {})
        plan.validate(source=source)
        return plan

    @staticmethod
    def load(path: str | Path) -> "Plan":
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

    def with_(self, **changes) -> "Plan":
        return replace(self, **changes)


def provenance(cluster_desc: dict) -> dict:
    import torch

    from planner import __version__

    return {"autopar_version": __version__, "torch_version": torch.__version__,
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "cluster": cluster_desc}
