"""The parallel configuration of a training job (the "how"): degrees, schedule, sharding, checkpointing,
compression and precision. Shared by the cost model and the planner; parsed from ``k=v,…`` strings once, here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum

from costmodel.runnable import pipelined_fsdp, post_step_allreduce


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
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")  # fp8: float8 matmuls (torchao), bf16 everything else


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
    cp: int = 1  #: context-parallel degree: each sequence split over cp ranks (load-balanced causal attention)
    ep: int = 1  #: expert-parallel degree: experts split over ep ranks borrowed from the dp group (ep divides dp)
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
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} virtual stages per pipeline rank need a pipeline; set pp ≥ 2 or vpp=1")
        if self.schedule == Schedule.INTERLEAVED and self.pp > 1 and self.vpp < 2:
            raise ValueError("schedule=interleaved needs vpp ≥ 2 virtual stages per rank; set vpp=2 or more")
        if self.sp and self.tp == 1:
            raise ValueError("sp=on needs tp > 1: sequence parallel splits along the tensor-parallel group")
        if self.grad_compress != "none" and self.zero == 3 and parse_grad_compress(self.grad_compress)[0] == "powersgd":
            raise ValueError("grad_compress=powersgd works with DDP (zero 0-2), not with FSDP (zero=3)")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert-parallel groups are formed inside the "
                             "data-parallel group (dp = ep · expert-dp); choose an ep that divides dp")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def data_ranks(self) -> int:
        """The ranks that hold the same parameters and reduce their gradients together (the gradient-reduction
        group, over which ZeRO shards its states): data- and context-parallel, dp · cp (context-parallel ranks
        compute their gradients from their part of each sequence only: torchtitan's FSDP over dp × cp)."""
        return self.dp * self.cp

    @property
    def reduces_after_step(self) -> bool:
        """Data-parallel gradients all-reduced after the whole backward (`costmodel.runnable.post_step_allreduce`)."""
        return post_step_allreduce(self.data_ranks, self.tp, self.zero, self.schedule.value, self.pp)

    @property
    def param_bytes(self) -> int:
        """Bytes of a parameter (and of its unsharded gradient) in the training precision: 4 in fp32, else 2."""
        return 4 if self.precision == "fp32" else 2

    @property
    def zero_bubble(self) -> bool:
        """torch's zero-bubble schedule runs the pipeline: each backward split into an input pass and a weight pass."""
        return self.pp > 1 and self.schedule == Schedule.ZERO_BUBBLE

    @property
    def fsdp_in_pipeline(self) -> bool:
        """FSDP inside torch's pipeline stages (`costmodel.runnable.pipelined_fsdp`)."""
        return pipelined_fsdp(self.zero, self.data_ranks, self.pp)

    def runnable_facts(self, global_batch: int, arch: dict | None = None, seq: int | None = None) -> dict:
        """The plain values `costmodel.runnable.problems` judges for this configuration of a job."""
        arch = arch or {}
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "schedule": self.schedule.value,
                "zero": self.zero, "sp": self.sp, "grad_compress": parse_grad_compress(self.grad_compress)[0],
                "precision": self.precision, "micro_batches": global_batch // (self.dp * self.mbs),
                "seq": seq or arch.get("seq"), "heads": arch.get("heads"), "kv_heads": arch.get("kv_heads"),
                # the experts the runtime can split (the capture's `profiler.experts` rule), not the cost model's
                "ep": self.ep, "experts": arch.get("ep_experts", 0), "expert_dim1": arch.get("ep_dim1"),
                "tp_unsplit": arch.get("tp_unsplit", ""), "tp_split": arch.get("tp_split", ""),
                # whether tensor and sequence parallelism can run its blocks (`tensor_parallel_problems`)
                "tp_forward": arch.get("tp_forward") or {}, "sp_layout": arch.get("sp_layout", ""),
                # whether the runtime can split the model's sequence (`profiler.layers.context_parallel_ready`)
                "cp": self.cp, "cp_ready": arch.get("cp_ready"),
                # whether the runtime can cut it into pipeline stages (`profiler.layers.pipeline_split_problem`)
                "pp_split": arch.get("pp_split", ""),
                # whether the training step can call it for logits (`profiler.layers.forward_problem`)
                "forward": arch.get("forward", ""),
                # whether its blocks make seq×seq scores for selective AC to recompute (`has_attention_core`)
                "attention_core": arch.get("attention_core")}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schedule"] = self.schedule.value
        d["ac"] = self.ac.value
        d["sp"] = "on" if self.sp else "off"
        return d

    @staticmethod
    def from_dict(d: dict) -> ParallelConfig:
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
