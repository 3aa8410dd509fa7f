"""Fit the device efficiency constants on published runs and print predicted vs published, row by row.

    python -m costmodel.calibrate            # fit, write costmodel/data/fitted.yaml, print the tables
    python -m costmodel.calibrate --check    # no fit: print the tables with the constants in fitted.yaml
    python -m costmodel.calibrate --cv       # leave-one-source-out and anchored cross-validation (no file written;
                                             # --by table: one published table at a time; --jobs N: N processes)
    python -m costmodel.calibrate --cp       # torchtitan's context-parallel rows, predicted (never fitted)

Data: costmodel/data/published_runs.json, a copy of shared/calibration/published_runs.json (each record: source,
model, cluster, configuration, measured result). Rows used:

- Korthikanti et al. 2022 Table 5 (A100): 22B, 175B, 530B, 1T, full recomputation and selective + sequence
  parallel: 8 iteration times. Megatron-LM of 2022 ran unfused attention with dropout (no FlashAttention), so the
  models are captured with ``attention=math``; interleaving with 3 virtual stages for 175B and 530B, as published.
- llm-foundry MPT benchmarks (A100 40/80 GB, H100): pure FSDP (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2), with
  or without full activation checkpointing, FlashAttention; tokens/s. MPT has no biases and ALiBi instead of
  learned positions; our GPT is used with its sizes (the differences are < 0.1 % of the FLOPs). Two software
  generations (the benchmark README's history): the A100 40 GB table and the 80 GB table's 70B rows (bf16, PURE)
  are the May 2023 runs on torch 1.13.1 with triton attention; the rest of the A100 80 GB table (amp_bf16, DEFAULT)
  is their October 2023 re-run, 3-21 % faster for the 7B-30B models and within ±2 % up to 3B; the H100 tables are
  later still. All are the ``composer`` stack here, each row priced with its torch's checkpoint: 1.13.1's reruns a
  checkpointed block's forward whole, 2.1's stops before the down projection (`_torch_1_13`); the 7B-30B models
  run with full checkpointing (but the 7B and 13B at 2048 tokens on 80 GB), the smaller ones without it up to
  16K-32K tokens. Megatron-LM's checkpoint reruns the block whole too (Korthikanti's Table
  4: the 22B layer's backward takes 7.6 ms more with full recomputation, its forward 7.7 ms).
- torchtitan's Llama 3.1 runs on Grand Teton H100s (96 GB HBM2e, 500 W; the ``grand-teton`` preset): FSDP and
  FSDP + TP, eager, compiled (priced by `costmodel.layercost.compiled_bytes`) and float8 tensorwise; its selective
  checkpointing is the per-op policy (`costmodel.layercost.CostContext.selective`). Rows the cost model cannot
  describe yet are left out (`_torchtitan_row`). Its context-parallel rows (Table 2: Llama 3.1 8B on 8 GPUs, 32K-256K
  tokens, cp 2-8) are held out of every fit and predicted by `context_parallel_rows` / ``--cp``: torchtitan's
  context parallelism (``context_parallel_rotate_method = "allgather"``, its default) all-gathers each attention's
  keys and values, as autopar's runtime does (`costmodel.layercost.context_parallel_comm`).

Each row belongs to a software stack (`costmodel.stacks`): Megatron-LM (Korthikanti), Composer (llm-foundry),
torch-native (torchtitan). A device kind's own constants are fitted on its Megatron and Composer rows; a stack
with rows of its own (torch-native on H100) gets constants of its own, fitted on them alone and written under
``stacks:`` in fitted.yaml.

One set of constants per device *kind* (``a100``: 40 and 80 GB; ``h100``) and stack, never per row: the matmul
efficiency curve (``e_max``, ``f_half``), the memory-bound efficiency, the fused-attention efficiency and the
sequence length at which it is halved (``attention_seq_half``: FlashAttention's fixed cost per query tile, which
llm-foundry's sweeps from 512 to 65536 tokens show as rows predicted 6-12 % fast at 512-2048 tokens and 6-12 %
slow at 32K-64K under a constant attention efficiency), the fp8 efficiency and the overlap slowdown, each only
where some row's prediction depends on it (`unidentified`): the others keep the committed value, or in a cold fit
the published prior (`PRIOR`); a stack takes its kind's matmul curve shape, ``f_half`` (`KIND_CURVE`), and its
kind's half-point where its rows run fewer than three lengths (`KERNEL_CONSTANTS`). A faster kind's matmul curve is
held at or above a slower kind's achieved FLOP/s at every GEMM size (`matmul_floor`). The fit minimises the mean
absolute relative error of the step time over the kind's rows, each source weighted equally: differential evolution
over bounded, transformed parameters, then Nelder-Mead (`fit`), with the constants in fitted.yaml in the first
population, so that a refit on the same rows never makes them worse. Korthikanti Table 4 (per-layer forward/backward
of the 22B model) is predicted, not fitted, and printed as a check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType

import yaml

from costmodel.cluster import Cluster, load_cluster
from costmodel.config import AC, ParallelConfig, Schedule
from costmodel.estimate import Evaluator
from costmodel.hardware import (
    GPU_ATTENTION_EFF_PRIOR,
    GPU_MATMUL_PRIOR,
    GPU_MEMORY_EFF_PRIOR,
    KIND_ORDER,
    EfficiencyCurve,
    floored,
)
from costmodel.stacks import FITTED_FILE, STACKS, fitted

DATA = Path(__file__).parent / "data" / "published_runs.json"
KIND_OF_GPU = {"a100_40gb": "a100", "a100_80gb": "a100", "h100_80gb": "h100"}
PRESET = {"a100_40gb": "dgx-a100-40g", "a100_80gb": "dgx-a100-80g", "h100_80gb": "dgx-h100"}


def _torch_1_13(record: dict) -> bool:
    """Whether an llm-foundry row was measured on torch 1.13.1, whose non-reentrant checkpoint (the yamls'
    ``activation_checkpointing_reentrant: false``) reruns a block's forward whole (`Row.checkpoint_early_stop`).
    Its A100 tables of May 2023 were (scripts/train/benchmarking/sweep.sh at 1ef7b4d: ``IMAGE="mosaicml/pytorch:
    1.13.1_cu117-..."``; the README keeps "TODO: Update tables with torch 2.0"): 164 rows, every one ``bf16`` (MP
    mode PURE). The October 2023 update (b2a43a1, ``IMAGE="mosaicml/pytorch:2.1.0_cu121-..."``) measured the H100
    tables and replaced the A100 80 GB one with 59 ``amp_bf16`` rows on torch 2.1, which stops early, keeping its
    two 70B ``bf16`` rows; the A100 40 GB table stayed as measured in May."""
    return record["cluster"]["gpu"].startswith("a100") and record["config"]["precision"] == "bf16"


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run, translated into our terms."""

    id: str
    source: str  #: "korthikanti" or "llm-foundry"
    kind: str  #: device kind
    model: str  #: model spec
    cluster: str  #: cluster spec
    config: ParallelConfig
    global_batch: int
    measured_step_s: float
    stack: str = "megatron"  #: the software stack that ran it (`costmodel.stacks`)
    compiled: bool = False  #: torch.compile on the blocks (torchtitan)
    #: what its selective checkpointing keeps (`costmodel.layercost.CostContext.selective`)
    selective: str = "attention-core"
    #: the published table it is a row of (`table_of`): a source's tables differ by hardware, software version
    #: and benchmark script (llm-foundry's A100 40 GB table is older than its H100 ones)
    table: str = ""
    #: the torch its run had stops full checkpointing's recomputation early (`costmodel.layercost.CostContext.
    #: checkpoint_early_stop`); None: as its stack does today (`costmodel.stacks.Stack`)
    checkpoint_early_stop: bool | None = None

    @property
    def evaluator_options(self) -> dict:
        """How the row's stack computes where it differs from autopar's runtime (`costmodel.stacks.Stack.
        runtime_options`), and the row's own compilation, selective checkpointing (torchtitan may compile and
        checkpoint per op) and the torch version's checkpoint where it differs from the stack's today."""
        own = {} if self.checkpoint_early_stop is None else {"checkpoint_early_stop": self.checkpoint_early_stop}
        return STACKS[self.stack].runtime_options() | {"compiled": self.compiled, "selective": self.selective} | own


def load_rows(path: Path = DATA) -> list[Row]:
    recs = json.loads(path.read_text())["records"]
    rows = []
    for r in recs:
        rid, m, c, meas = r["id"], r["model"], r["config"], r["measured"]
        if rid.startswith("korthikanti22_t5_"):
            spec = (f"gpt:layers={m['layers']},hidden={m['hidden']},heads={m['heads']},seq={m['seq']},"
                    f"vocab={m['vocab']},attention=math")
            v = c.get("interleaved_stages") or 1
            cfg = ParallelConfig(dp=c["d"], tp=c["t"], pp=c["p"], mbs=c["micro_batch"], vpp=v,
                                 schedule=Schedule.INTERLEAVED if v > 1 else Schedule.ONE_F_ONE_B,
                                 ac=AC.FULL if c["recompute"] == "full" else AC.SELECTIVE, sp=bool(c["sp"]))
            n = c["t"] * c["p"] * c["d"]
            rows.append(Row(id=rid, source="korthikanti", kind="a100", model=spec,
                            cluster=f"dgx-a100-80g:nodes={n // 8}", config=cfg, global_batch=c["global_batch"],
                            measured_step_s=meas["step_time_s"], table=table_of(r)))
        elif rid.startswith("llmfoundry_"):
            gpu = r["cluster"]["gpu"]
            if gpu not in PRESET:
                continue
            spec = (f"gpt:layers={m['layers']},hidden={m['hidden']},heads={m['heads']},seq={m['seq']},"
                    f"vocab={m['vocab']},dropout=0")
            zero = 3 if "FULL_SHARD" in c["zero"] else 2 if "SHARD_GRAD_OP" in c["zero"] else 0
            prec = "fp8" if "fp8" in c["precision"] else "bf16"
            n = r["cluster"]["n_gpus"]
            cfg = ParallelConfig(dp=c["d"], mbs=c["micro_batch"], zero=zero,
                                 ac=AC.FULL if c["recompute"] == "full" else AC.NONE, precision=prec)
            gb = c["global_batch"]
            step = gb * m["seq"] / meas["tokens_per_s"]
            rows.append(Row(id=rid, source="llm-foundry", kind=KIND_OF_GPU[gpu], model=spec,
                            cluster=f"{PRESET[gpu]}:nodes={max(1, n // 8)}", config=cfg, global_batch=gb,
                            measured_step_s=step, stack="composer", table=table_of(r),
                            checkpoint_early_stop=False if _torch_1_13(r) else None))
        elif rid.startswith("torchtitan_") and (row := _torchtitan_row(r)) is not None:
            rows.append(row)
    return rows


def table_of(record: dict) -> str:
    """The published table a record is a row of: Korthikanti's Table 5 (both its columns: one table, one run of
    Megatron-LM), llm-foundry's README tables by heading, torchtitan's by file and table."""
    src = record["source"]
    if record["id"].startswith("korthikanti22_t5_"):
        return "Korthikanti et al. 2022, Table 5"
    if record["id"].startswith("llmfoundry_"):
        return "llm-foundry " + src["table"].removeprefix("MPT Training Benchmarks > ")
    return f"torchtitan {Path(src['path']).stem}" + (f", {src['table']}" if src.get("table") else "")


def context_parallel_rows(path: Path = DATA) -> list[Row]:
    """torchtitan's context-parallel rows (cp > 1, no pipeline), which no fit sees (see the module docstring)."""
    recs = json.loads(path.read_text())["records"]
    return [row for r in recs if r["id"].startswith("torchtitan_") and r["config"].get("cp", 1) > 1
            and (row := _torchtitan_row(r, context=True)) is not None]


def _torchtitan_row(r: dict, context: bool = False) -> Row | None:
    """A torchtitan row on Grand Teton H100s in our terms, or None for what the cost model cannot describe yet:
    context parallelism, asynchronous TP (the vanilla-TP column of the async-TP report is used), float8 rowwise
    (another recipe than tensorwise), pipelined rows (all of them async TP) and the H200 rows (float8 all-gather).
    "selective" is torchtitan's per-op policy (``selective_ac_option = "op"`` in its Llama 3 configs)."""
    rid, m, c, meas = r["id"], r["model"], r["config"], r["measured"]
    cp = c.get("cp", 1)
    if ((cp > 1) != context or c["p"] > 1 or "trainy" in rid or "rowwise" in rid
            or "AsyncTP" in c.get("techniques", "")):
        return None
    tps = meas.get("tokens_per_s_per_gpu") or meas.get("tokens_per_s_vanilla_tp")
    if not tps:
        return None
    spec = (f"llama:layers={m['layers']},hidden={m['hidden']},ffn={m['ffn']},heads={m['heads']},"
            f"kv_heads={m['kv_heads']},vocab={m['vocab']},seq={m['seq']}")
    dp, tp = c["fsdp"], c["t"]
    n, gb = dp * tp * cp, c.get("global_batch") or c["local_batch"] * dp
    fp8 = "float8" in (c.get("precision", "") + c.get("quantization", "")).lower()
    selective = c["recompute"].startswith("selective")
    cfg = ParallelConfig(dp=dp, tp=tp, cp=cp, mbs=c["local_batch"], zero=3, sp=tp > 1,
                         ac=AC.SELECTIVE if selective else AC.FULL, precision="fp8" if fp8 else "bf16")
    compiled = bool(c.get("compile")) or "compile" in c.get("techniques", "")
    return Row(id=rid, source="torchtitan", kind="h100", model=spec, cluster=f"grand-teton:nodes={max(1, n // 8)}",
               config=cfg, global_batch=gb, measured_step_s=gb * m["seq"] / (tps * n), stack="torch-native",
               compiled=compiled, selective="every-other-matmul" if selective else "attention-core",
               table=table_of(r))


def _graph(spec: str):
    from profiler.api import profile_once

    return profile_once(spec)


@cache
def _cluster(spec: str) -> Cluster:
    """A published run's cluster (``spec`` with its ``stack=``). Its memory check is against the whole device
    (``memory_fraction`` 1): the run happened, so the question is whether it fits the card, not a plan's
    headroom."""
    return dataclasses.replace(load_cluster(spec), memory_fraction=1.0)


@dataclasses.dataclass(frozen=True)
class Constants:
    e_max: float
    f_half: float
    memory_eff: float
    overlap_slowdown: float
    attention_eff: float
    fp8_eff: float
    #: the sequence length at which fused attention reaches half of ``attention_eff`` (`DeviceSpec`); 0: none
    attention_seq_half: float = 0.0

    def apply(self, cluster: Cluster, source: str) -> Cluster:
        """``cluster`` with these constants on its device, its memory efficiency at least the device's
        `costmodel.hardware.bandwidth_floor` under the cluster's stack, as the planner prices it: a row on
        h100-hbm2e priced with constants fitted elsewhere (a cross-validation fold's) is priced as `autopar plan`
        would price it (`costmodel.hardware.floored`, as `with_stack` does)."""
        effs = {"matmul_eff": EfficiencyCurve(e_max=self.e_max, f_half=self.f_half, source=source),
                "memory_eff": self.memory_eff, "overlap_slowdown": self.overlap_slowdown,
                "attention_eff": self.attention_eff, "fp8_eff": self.fp8_eff,
                "attention_seq_half": self.attention_seq_half}
        effs, _ = floored(cluster.device.name, cluster.device.hbm_bw, effs, cluster.stack)
        return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **effs))


def _catalogue(fits: dict, stacks: dict | None = None) -> dict:
    """fitted.yaml's contents once ``fits`` and ``stacks`` (`fit_all`'s, or some of them) are written over it."""
    now = fitted()
    written = dict(now.get("stacks") or {})
    for stack, kinds in (stacks or {}).items():
        written[stack] = {**written.get(stack, {}), **_fitted_entries(kinds)}
    return {**now, **_fitted_entries(fits)} | ({"stacks": written} if written else {})


@contextlib.contextmanager
def _priced_under(contents: dict):
    """Rows priced inside the block (`predict`) read ``contents`` (`_catalogue`) wherever their price reads fitted
    constants other than those it is given (`Constants.apply`'s floor: the slower kinds' achieved bandwidth,
    `costmodel.hardware.bandwidth_floor`), so that a fit in progress, or a cross-validation fold, is priced as
    `autopar plan` will price it once written, not under the constants it replaces (`costmodel.stacks.fitted_as`;
    the catalogues are rebuilt from them on entry and, on exit, from what `fitted` returns then)."""
    from costmodel import stacks

    with stacks.fitted_as(contents):
        _rebuild_catalogues()
        try:
            yield
        finally:
            _rebuild_catalogues()  # (emptied: each entry is built again on its next lookup, from what is fitted then)


def _rebuild_catalogues() -> None:
    """Forget the devices, cluster presets and clusters built so far: they read fitted.yaml when first built."""
    from costmodel import cluster, hardware

    hardware.DEVICES.rebuild()
    cluster.CLUSTER_PRESETS.rebuild()
    _cluster.cache_clear()


def _priced_with() -> str:
    """The fitted constants rows are priced under now (`_priced_under`), their sources left out: part of what a fit
    depends on (`_FITTED`)."""
    def constants(entries: dict) -> dict:
        return {kind: {n: v for n, v in entry.items() if n != "source"} for kind, entry in entries.items()
                if kind != "stacks"}

    now = fitted()
    return json.dumps([constants(now), {s: constants(ks) for s, ks in (now.get("stacks") or {}).items()}],
                      sort_keys=True)


def predict(row: Row, k: Constants | None = None):
    cluster = _cluster(f"{row.cluster}:stack={row.stack}")
    if k is not None:
        cluster = k.apply(cluster, "fit in progress")
    return Evaluator(_graph(row.model), cluster, row.config, row.global_batch, **row.evaluator_options).evaluate()


def _error(rows: list[Row], k: Constants) -> float:
    by_source: dict[str, list[float]] = {}
    for row in rows:
        est = predict(row, k)
        by_source.setdefault(row.source, []).append(abs(est.step_time_s / row.measured_step_s - 1))
    return sum(sum(v) / len(v) for v in by_source.values()) / len(by_source)


def _sig(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def _logit(p: float) -> float:
    p = min(max(p, 1e-9), 1 - 1e-9)  # (a constant on its bound starts just inside it)
    return math.log(p / (1 - p))


#: the optimiser's parameters, in order: each constant's transformed value (f_half: its log, or under a floor its
#: fraction of `matmul_floor`'s ceiling; the others: where they sit in their range of `_ranges`)
_PARAMS = ("e_max", "f_half", "memory_eff", "overlap_slowdown", "attention_eff", "fp8_eff", "attention_seq_half")
_E_MAX = (0.3, 1.0)
#: the span of ``attention_seq_half``, tokens: at its top a 2048-token sequence runs attention at a fifth of its
#: long-sequence efficiency, below anything published for FlashAttention (Dao 2023, Fig. 4)
SEQ_HALF_MAX = 8192.0
#: the distinct sequence lengths of fused attention a fit's rows need to identify ``attention_seq_half``
#: (`unidentified`)
SEQ_HALF_LENGTHS = 3


def _ranges(e_max: float, f_half: float, floor: tuple[Constants, float, float] | None,
            attention_eff: float | None = None) -> dict:
    """Each constant's range but e_max's and f_half's, for a matmul curve (e_max, f_half); under ``floor`` (see
    `_unpack`) narrowed so that this kind is no slower than the slower one on any operation. ``attention_eff``:
    this kind's (moved into its range), which bounds its ``attention_seq_half`` under a floor (`_seq_half_top`);
    None: at its lowest."""
    memory_lo, slowdown_hi, attention_lo, seq_half_hi = 0.2, 0.5, 0.2, SEQ_HALF_MAX
    if floor is not None:
        slower, peak_ratio, hbm_ratio = floor
        # the smallest ratio of this kind's GEMM rate to the slower kind's, over all sizes (≥ 1 by the floor)
        gemm = min(peak_ratio * e_max / slower.e_max, peak_ratio * e_max * slower.f_half / (slower.e_max * f_half))
        memory_lo = max(0.2, min(1.0, slower.memory_eff / hbm_ratio))
        attention_lo = max(0.2, min(1.0, slower.attention_eff / gemm))  # fused attention: the GEMM rate × this
        slowdown_hi = min(0.5, (1 + slower.overlap_slowdown) * gemm - 1)  # overlapped compute: (1 + s) × time
        attention = attention_lo if attention_eff is None else min(max(attention_eff, attention_lo), 1.0)
        seq_half_hi = _seq_half_top(slower, gemm, attention)
    return {"memory_eff": (memory_lo, 1.0), "overlap_slowdown": (0.0, slowdown_hi),
            "attention_eff": (attention_lo, 1.0), "fp8_eff": (0.2, 1.0), "attention_seq_half": (0.0, seq_half_hi)}


def _seq_half_top(slower: Constants, gemm: float, attention_eff: float) -> float:
    """The largest ``attention_seq_half`` that keeps fused attention, at ``attention_eff`` and a GEMM rate
    ``gemm`` times the slower kind's, at least as fast as on the slower kind at every sequence length L:
    attention_eff·gemm·L/(L + h) ≥ slower's·L/(L + h_s) for all L is linear in L once multiplied out, so its
    two ends bound it: L → ∞ is ``attention_eff``'s floor, and L → 0 needs h ≤ h_s·attention_eff·gemm/slower's."""
    return min(SEQ_HALF_MAX, slower.attention_seq_half * attention_eff * gemm / slower.attention_eff)


def _within(span: tuple[float, float], v: float) -> float:
    return span[0] + (span[1] - span[0]) * _sig(v)


def _where(span: tuple[float, float], value: float) -> float:  # (`_within`'s inverse)
    return _logit((value - span[0]) / (span[1] - span[0]) if span[1] > span[0] else 0.5)


def _unpack(x, floor: tuple[Constants, float, float] | None = None,
            held: Mapping[str, float] = MappingProxyType({})) -> Constants:
    """Constants from the optimiser's unbounded parameters: e_max's, then each other constant's of `_PARAMS` but
    those ``held`` (name → value, each clipped into its range; f_half at most `matmul_floor`'s ceiling).
    ``floor`` = (a slower kind's constants, this kind's bf16 peak over that kind's, its HBM bandwidth over that
    kind's): each constant is kept where this kind is at least as fast as the slower one on every operation
    (`matmul_floor`)."""
    if len(x) != len(_PARAMS) - len(held):
        raise ValueError(f"{len(x)} parameters for {len(_PARAMS) - len(held)} free constants (held: {sorted(held)})")
    e_max = _within(_E_MAX, x[0])
    free = iter(x[1:])
    ceiling = math.inf if floor is None else matmul_floor(e_max, floor[0], floor[1])
    if "f_half" in held:  # (a stack's: its kind's, `KIND_CURVE`)
        f_half = min(held["f_half"], ceiling)
    else:
        f_half = math.exp(next(free)) if floor is None else ceiling * _sig(next(free))
    ranges = _ranges(e_max, f_half, floor)
    rest: dict[str, float] = {}
    for name in _PARAMS[2:]:
        if name == "attention_seq_half":  # (its range depends on the attention efficiency just unpacked)
            ranges = _ranges(e_max, f_half, floor, rest["attention_eff"])
        rest[name] = (min(max(held[name], ranges[name][0]), ranges[name][1]) if name in held
                      else _within(ranges[name], next(free)))
    return Constants(e_max=e_max, f_half=f_half, **rest)


def _pack(k: Constants, floor: tuple[Constants, float, float] | None, held: Iterable[str] = ()) -> list[float]:
    """`_unpack`'s inverse: the optimiser's parameters of constants ``k`` but those ``held``, each constant clipped
    into its bounds under ``floor`` (should a refitted slower kind have moved them)."""
    e = _where(_E_MAX, k.e_max)
    e_max = _within(_E_MAX, e)
    if floor is None:
        f_half, f = k.f_half, math.log(k.f_half)
    else:
        ceiling = matmul_floor(e_max, floor[0], floor[1])
        f_half = min(k.f_half, ceiling)
        f = _logit(f_half / ceiling)
    ranges = _ranges(e_max, f_half, floor, k.attention_eff)
    held = set(held)
    return [e] + [f] * ("f_half" not in held) + [_where(ranges[name], getattr(k, name)) for name in _PARAMS[2:]
                                                 if name not in held]


#: each constant where no row says otherwise, from hardware.py's published priors (fp8_eff: the bf16 curve's
#: efficiency at the fp8 peak): a cold fit holds here every constant its rows cannot identify (`unidentified`)
PRIOR = Constants(e_max=GPU_MATMUL_PRIOR.e_max, f_half=GPU_MATMUL_PRIOR.f_half, memory_eff=GPU_MEMORY_EFF_PRIOR,
                  overlap_slowdown=0.0, attention_eff=GPU_ATTENTION_EFF_PRIOR, fp8_eff=1.0, attention_seq_half=0.0)


#: the least relative change of some row's step time, between a constant's two bounds, that lets rows identify it
#: (`depends_on`): a constant that moves no row by 0.1 % over its whole range would be set by noise in the rows
IDENTIFIES = 1e-3


def depends_on(rows: Iterable, step_time: Callable[[object, float], float], span: tuple[float, float]) -> bool:
    """Whether any of ``rows`` is predicted a step time (``step_time(row, value)``) differing by more than
    `IDENTIFIES` at the two ends of a constant's ``span``, the other constants where they are: every constant's
    effect on a step is monotone, so a constant that moves none of the rows between its bounds is one they cannot
    identify (the fused-attention efficiency, to runs whose attention is unfused; the fp8 efficiency, to bf16 runs;
    the overlap slowdown, to runs that overlap no communication), and a fit leaves it where it was instead of
    wherever the optimiser drifted (Korthikanti's eight unfused rows alone once put attention_eff at 0.29, and
    llm-foundry's 64K-token rows, predicted with it, 160 % slow). One constant at a time, at the others' values:
    a constant no row depends on there could still matter where the others are far away (a roofline that flips);
    the rules above hold whatever the others."""
    for row in rows:
        lo, hi = (step_time(row, v) for v in span)
        if abs(lo - hi) > IDENTIFIES * max(lo, hi):
            return True
    return False


def unidentified(rows: list[Row], start: Constants) -> tuple[str, ...]:
    """The constants of `_PARAMS` but the matmul curve's that no row of ``rows`` depends on (`depends_on`, over
    each constant's range from ``start``), and ``attention_seq_half`` unless the rows run fused attention at three
    sequence lengths or more: at one it only trades against ``attention_eff``, and two would set it from the noise
    of the rows at the second length (torchtitan's one 32K-token row against its eleven at 8192)."""
    ranges = _ranges(start.e_max, start.f_half, None)

    def step_time(name: str) -> Callable[[Row, float], float]:
        return lambda row, v: predict(row, dataclasses.replace(start, **{name: v})).step_time_s

    few = _too_few_lengths(rows)
    return tuple(name for name in _PARAMS[2:] if not depends_on(rows, step_time(name), ranges[name])
                 or (name == "attention_seq_half" and few))


def _too_few_lengths(rows: Iterable[Row]) -> bool:
    """Whether ``rows`` run fused attention at fewer than `SEQ_HALF_LENGTHS` sequence lengths (`unidentified`)."""
    return len({n for r in rows if (n := attention_length(r))}) < SEQ_HALF_LENGTHS


def attention_length(row: Row) -> float:
    """The sequence length ``row``'s fused attention runs at on a rank (`costmodel.layercost`), 0 without one."""
    from costmodel.layercost import attention_call_length

    graph = _graph(row.model)
    return next((attention_call_length(n, row.config.cp) for layer in graph.layers for n in layer.nodes
                 if n.kind == "attention"), 0.0)


def matmul_floor(e_max: float, slower: Constants, peak_ratio: float) -> float:
    """The largest ``f_half`` for which a device ``peak_ratio`` times as fast as a slower kind (bf16 peak), with
    matmul efficiency ``e_max``·f/(f + f_half), achieves at least the slower kind's FLOP/s at every GEMM size f.

    The ratio of the two achieved rates, peak_ratio·e_max·(f + f_s) / (e_s·(f + f_half)), is monotonic in f, so
    it is smallest at one end: f → ∞ needs peak_ratio·e_max ≥ e_s, f → 0 needs
    f_half ≤ f_s·peak_ratio·e_max / e_s (the bound returned). Fitted without it on FSDP runs alone (no small TP
    GEMMs), the H100 curve had f_half 1.8e11 FLOP: a 2048³ GEMM at 57 TFLOP/s against the A100's 140. The other
    constants are bounded the same way in `_unpack` (memory-bound ops at the HBM ratio, fused attention at the
    GEMM ratio's minimum, the overlap slowdown no larger than what that minimum absorbs)."""
    return slower.f_half * peak_ratio * e_max / slower.e_max


#: (rows' ids, floor, kept, kind, the constants priced under: `_priced_with`) → `fit`'s result while cross-validation
#: runs (`cross_validate`): folds share the fits whose rows none of them leaves out; None otherwise (every fit runs)
_FITTED: dict | None = None

#: differential evolution's budget (`fit`): generations and population per parameter
DE_GENERATIONS, DE_POPULATION = 40, 12


def fit(rows: list[Row], floor: tuple[Constants, float, float] | None = None,
        kept: Constants | None = None, kind: Constants | None = None) -> tuple[Constants, float]:
    """The kind's constants that minimise `_error` on ``rows``, but for those the rows cannot identify
    (`unidentified`), held at ``kept``'s values, or cold at the published `PRIOR`, and under a ``floor`` (see
    `_unpack`) those of `FROM_SLOWER`, held at the slower kind's. The surface has many shallow local minima (the
    constants trade against each other row by row), so a global search first, differential evolution over the
    transformed parameters (each constant's range, seeded: the same rows give the same constants), then
    Nelder-Mead from its best. Nelder-Mead alone from three fixed starts left the torch-native stack at 6.8 % where
    this finds 2.8 % under the same floor.
    ``kept``: the constants in use, put in the first population; neither search ever returns a point worse than
    its best so far, so the result is never worse on ``rows`` than ``kept`` (clipped into the floor's bounds, its
    held constants as held) and a refit is monotone. ``kind``: a stack's fit, the device kind's own constants,
    whose `KIND_CURVE` the stack takes, and its `KERNEL_CONSTANTS` where its rows cannot identify them."""
    from scipy.optimize import differential_evolution, minimize

    memo = (tuple(r.id for r in rows), floor, kept, kind, _priced_with()) if _FITTED is not None else None
    if memo in (_FITTED or {}):
        return _FITTED[memo]
    curve = {name: getattr(kind, name) for name in KIND_CURVE} if kind is not None else {}
    start = dataclasses.replace(kept or PRIOR, **curve)
    held = curve | {name: getattr(kind if kind is not None and name in KERNEL_CONSTANTS else start, name)
                    for name in unidentified(rows, start)}
    if floor is not None:  # (a faster kind's, and its stacks')
        held |= _from_slower(floor)
    bounds = [(-6.0, 6.0)] * (len(_PARAMS) - len(held))  # logits: 0.25 % … 99.75 % of each constant's range
    if floor is None and "f_half" not in held:
        bounds[1] = (math.log(1e8), math.log(1e13))  # f_half, FLOP
    x0 = None
    if kept is not None:
        x0 = _pack(dataclasses.replace(kept, **curve), floor, held)
        bounds = [(min(lo, v), max(hi, v)) for (lo, hi), v in zip(bounds, x0)]  # (so that it is a member as it is)

    def objective(x):
        return _error(rows, _unpack(x, floor, held))

    res = differential_evolution(objective, bounds, x0=x0, seed=0, maxiter=DE_GENERATIONS, popsize=DE_POPULATION,
                                 tol=1e-6, init="sobol", polish=False)
    res = minimize(objective, res.x, method="Nelder-Mead", options={"maxiter": 800, "xatol": 1e-4, "fatol": 1e-6})
    out = _unpack(res.x, floor, held), float(res.fun)
    if memo is not None:
        _FITTED[memo] = out
    return out


#: constants a faster kind (and each stack on it) takes from the slower kind that floors it (`_floor`), not from
#: its own rows: how much compute slows beside the collectives. Where many rows set it, the fits agree (fitted
#: alone: the A100's 147 rows at 0.50, the top of its range, the H100's 77 at 0.44, torch-native's 12 at 0.50); on
#: fewer it trades against the memory efficiency and the attention half-point: the H100 fit without llm-foundry's
#: BF16 table (25 rows, 18 at one length) put it at 0.21, and that table 4.2 % off left out, 5.4 % anchored; held
#: at the A100's, 3.1 % and 3.7 % (the README's cross-validation, every H100 table)
FROM_SLOWER = ("overlap_slowdown",)


def _from_slower(floor: tuple[Constants, float, float]) -> dict[str, float]:
    """The constants of `FROM_SLOWER`, as the slower kind of ``floor`` (`_floor`) has them."""
    return {name: getattr(floor[0], name) for name in FROM_SLOWER}

#: constants of a kernel every stack on a kind runs alike (FlashAttention's tiling): a stack whose rows cannot
#: identify one takes the kind's (`fit`'s ``kind``), not the prior
KERNEL_CONSTANTS = ("attention_seq_half",)

#: the shape of the matmul curve, which every stack takes from its kind (`fit`'s ``kind``): how a GEMM's efficiency
#: falls with its size is the GEMM library's on that device, and every stack in the catalogue calls the same one
#: (cuBLAS: torch's ``aten::mm`` and ``_scaled_mm`` under Composer and torchtitan, compiled or not, since inductor
#: leaves GEMMs to it outside max-autotune; Transformer Engine's cuBLASLt under Megatron-Core). A stack's rows set
#: how far up that curve it gets (``e_max``). Fitted on its own rows, torch-native's twelve runs (every GEMM above
#: 1e10 FLOP) took f_half 2.2e8 FLOP, a flat curve that put a 1 GFLOP GEMM at 0.47 of the H100's peak, above
#: what the GEMM alone reaches (OpenXLA's sm_90 matmul table, xla/service/gpu/model/matmul_interpolator_data.h:
#: 0.14 at 1.07 GFLOP, 0.25 at 2.1); they fit as well at the kind's half-point (1.14 % against 1.09 %)
KIND_CURVE = ("f_half",)


#: the stacks whose rows make a kind's own constants (every stack without rows of its own uses them); the others
#: are fitted per (kind, stack) on their rows, written under ``stacks:`` (`costmodel.stacks`)
BASE_STACKS = ("megatron", "composer")


def write_fitted(fits: dict[str, tuple[Constants, str, list[Row]]],
                 stacks: dict[str, dict[str, tuple[Constants, str, list[Row]]]] | None = None) -> None:
    """Write each (constants, source line, rows) of `fit_all` to fitted.yaml."""
    out = _fitted_entries(fits)
    if stacks:
        out["stacks"] = {stack: _fitted_entries(kinds) for stack, kinds in sorted(stacks.items())}
    text = ("# Written by `python -m costmodel.calibrate`; one set of constants per device kind, and under stacks: per "
            "(software stack, kind) where the stack has rows of its own.\n")
    FITTED_FILE.write_text(text + yaml.safe_dump(out, sort_keys=True))


def _fitted_entries(fits: dict[str, tuple[Constants, str, list[Row]]]) -> dict:
    """Each kind's constants as fitted.yaml keeps them (`as_written`)."""
    out = {}
    for kind, (k, source, _) in sorted(fits.items()):
        k = as_written(k)
        out[kind] = {
            "matmul_e_max": k.e_max, "matmul_f_half": k.f_half, "memory_eff": k.memory_eff,
            "overlap_slowdown": k.overlap_slowdown, "attention_eff": k.attention_eff, "fp8_eff": k.fp8_eff,
            "attention_seq_half": k.attention_seq_half, "source": source,
        }
    return out


def as_written(k: Constants) -> Constants:
    """``k`` as fitted.yaml keeps it, each constant rounded the way that makes the device faster: the efficiencies
    up (to 4 decimals), the matmul curve's half-point down (to 4 digits), the overlap slowdown down (4 decimals)
    and the attention's half-point down (to a whole token). So a constant fitted at a slower kind's floor is
    written at or above it, and `fit_all` takes the slower kinds' floors from their constants as written: a floor
    from the unrounded ones let the H100's memory efficiency be written 1e-7 under the A100's bandwidth."""
    def up(v: float) -> float:
        return min(1.0, math.ceil(round(v * 1e4, 6)) / 1e4)

    def down(v: float) -> float:
        scale = 10.0 ** (math.floor(math.log10(v)) - 3)
        return float(f"{math.floor(round(v / scale, 6)) * scale:.4g}")

    return Constants(e_max=up(k.e_max), f_half=down(k.f_half), memory_eff=up(k.memory_eff),
                     overlap_slowdown=math.floor(round(k.overlap_slowdown * 1e4, 6)) / 1e4,
                     attention_eff=up(k.attention_eff), fp8_eff=up(k.fp8_eff),
                     attention_seq_half=float(math.floor(round(k.attention_seq_half, 6))))


def report(rows: list[Row], file=sys.stdout) -> dict[str, list[float]]:
    """Print predicted vs published per row; return the relative errors by source."""
    errs: dict[str, list[float]] = {}
    fits_all: dict[str, bool] = {}
    print(f"{'row':<70} {'published':>10} {'predicted':>10} {'error':>8} {'fits':>5}", file=file)
    for row in rows:
        est = predict(row)
        e = est.step_time_s / row.measured_step_s - 1
        errs.setdefault(row.source, []).append(e)
        fits_all[row.id] = est.fits
        print(f"{row.id[:70]:<70} {row.measured_step_s:>9.3f}s {est.step_time_s:>9.3f}s {e:>+7.1%} "
              f"{'yes' if est.fits else 'NO':>5}", file=file)
    for src, v in errs.items():
        mae = sum(abs(x) for x in v) / len(v)
        print(f"{src}: {len(v)} rows, mean abs error {mae:.1%}, max {max(abs(x) for x in v):.1%}", file=file)
    print(f"predicted to fit: {sum(fits_all.values())}/{len(fits_all)}", file=file)
    return errs


def table4(file=sys.stdout) -> list[tuple[str, float, float, float, float]]:
    """Korthikanti Table 4: per-layer forward/backward of the 22B model (t = 8, b = 4), predicted vs published."""
    recs = {r["id"]: r for r in json.loads(DATA.read_text())["records"] if r["id"].startswith("korthikanti22_t4")}
    spec = "gpt:layers=48,hidden=6144,heads=64,seq=2048,vocab=51200,attention=math"
    lg = _graph(spec)
    cluster = _cluster("dgx-a100-80g")
    out = []
    print(f"{'Table 4 row':<50} {'fwd pub':>8} {'fwd pred':>9} {'bwd pub':>8} {'bwd pred':>9}", file=file)
    for rid, r in recs.items():
        c = r["config"]
        ac = {"none": AC.NONE, "full": AC.FULL, "selective": AC.SELECTIVE}[c["recompute"]]
        cfg = ParallelConfig(tp=8, mbs=4, sp=bool(c["sp"]), ac=ac)
        ev = Evaluator(lg, cluster, cfg, 4, **STACKS["megatron"].runtime_options())  # (as Megatron-LM computes)
        block = next(i for i, layer in enumerate(lg.layers) if layer.kind == "block")
        lc = ev.cost(block, ac)
        fwd = (lc.fwd_s + lc.tp_comm_fwd_s) * 1e3
        bwd = (lc.bwd_s + lc.recompute_s + lc.tp_comm_bwd_s) * 1e3
        pf, pb = r["measured"]["layer_forward_ms"], r["measured"]["layer_backward_ms"]
        out.append((rid, pf, fwd, pb, bwd))
        print(f"{rid.removeprefix('korthikanti22_t4_22B_layer_'):<50} {pf:>7.1f}ms {fwd:>8.1f}ms {pb:>7.1f}ms "
              f"{bwd:>8.1f}ms", file=file)
    return out


def _kept(entry: dict) -> Constants:
    return Constants(e_max=entry["matmul_e_max"], f_half=entry["matmul_f_half"], memory_eff=entry["memory_eff"],
                     overlap_slowdown=entry["overlap_slowdown"], attention_eff=entry["attention_eff"],
                     attention_seq_half=entry.get("attention_seq_half", 0.0),
                     fp8_eff=entry["fp8_eff"])


def _into_floor(k: Constants, floor: tuple[Constants, float, float] | None) -> Constants:
    """``k`` with each constant moved into its range under ``floor`` (`_ranges`) where it is outside, and those of
    `FROM_SLOWER` the slower kind's: kept constants whose slower kind was refitted (``--only``), which may have
    moved the floor under them."""
    if floor is None:
        return k
    k = dataclasses.replace(k, **_from_slower(floor))
    f_half = min(k.f_half, matmul_floor(k.e_max, floor[0], floor[1]))
    ranges = _ranges(k.e_max, f_half, floor, k.attention_eff)
    return dataclasses.replace(k, f_half=f_half, **{name: min(max(getattr(k, name), lo), hi)
                                                    for name, (lo, hi) in ranges.items()})


def _floor(kind_index: int, fits: dict, rows: Iterable[Row] = ()) -> tuple[Constants, float, float] | None:
    """The binding floor of `KIND_ORDER`'s ``kind_index``-th kind: the slower kind whose bound on f_half is
    tightest (at this kind's prior e_max), from the slower kinds' own constants in ``fits``, as (constants, bf16
    peak ratio, HBM bandwidth ratio). The bandwidth is the least of the devices ``rows`` run on (the kind's
    catalogue device without rows): the torch-native stack's rows run on h100-hbm2e, whose memory efficiency
    `costmodel.hardware.bandwidth_floor` raises to the A100's achieved bandwidth where it prices them, so their fit
    is bounded there too."""
    from costmodel.hardware import get_device

    dev = get_device(KIND_ORDER[kind_index][1])
    bw = min((_cluster(r.cluster).device.hbm_bw for r in rows), default=dev.hbm_bw)
    slower = [(fits[s][0], dev.peak("bf16") / get_device(d).peak("bf16"), bw / get_device(d).hbm_bw)
              for s, d in KIND_ORDER[:kind_index] if s in fits]
    return min(slower, key=lambda f: matmul_floor(0.7, f[0], f[1])) if slower else None


def _source(rows: list[Row], err: float, floored: bool) -> str:
    srcs = ", ".join(sorted({r.source for r in rows}))
    return (f"fitted {_dt.date.today().isoformat()} by python -m costmodel.calibrate on {len(rows)} published runs "
            f"({srcs}); mean abs error {err:.1%}" + ("; matmul curve kept at or above the slower kinds' achieved "
                                                     "FLOP/s at every GEMM size (calibrate.matmul_floor); "
                                                     f"{', '.join(FROM_SLOWER)} the slower kind's"
                                                     if floored else ""))


def fit_all(rows: list[Row], only: str | None = None, warm: bool = True,
            kinds: Iterable[str] | None = None) -> tuple[dict, dict]:
    """Each device kind's constants on its rows of `BASE_STACKS`, then each other stack's per kind on its own rows
    (both under the slower kinds' floor). ``only``: ``KIND`` refits that kind's own constants, ``STACK`` that
    stack's; everything else keeps fitted.yaml's. ``warm``: each fit also starts from fitted.yaml's constants, so
    a refit on the same rows never makes them worse (`fit`); cross-validation fits cold, since those constants
    have seen the rows it holds out. ``kinds``: fit these device kinds only (their floors, the slower kinds of
    `KIND_ORDER`, must be among them); the others get no entry."""
    kept = fitted()
    fits: dict = {}
    stacks: dict = {}
    order = {kind: i for i, (kind, _) in enumerate(KIND_ORDER)}
    if kinds is not None:
        kinds = set(kinds)
        rows = [r for r in rows if r.kind in kinds]
    for kind in sorted({r.kind for r in rows}, key=lambda k: order.get(k, len(order))):
        kr = [r for r in rows if r.kind == kind and r.stack in BASE_STACKS]
        # (each kind's floor from the slower kinds' constants as written, so that this kind's, rounded the safe
        # way, are written at or above it)
        floor = _floor(order[kind], fits, kr) if kind in order else None
        if only and only != kind and kind in kept:
            fits[kind] = (as_written(_into_floor(_kept(kept[kind]), floor)), kept[kind]["source"], kr)
        elif kr:
            with _priced_under(_catalogue(fits, stacks)):
                k, err = fit(kr, floor, _kept(kept[kind]) if warm and kind in kept else None)
            print(f"{kind}: objective {err:.2%}", flush=True)
            fits[kind] = (as_written(k), _source(kr, err, floor is not None), kr)
    for stack in sorted({r.stack for r in rows} - set(BASE_STACKS)):
        for kind in sorted({r.kind for r in rows if r.stack == stack}):
            sr = [r for r in rows if r.kind == kind and r.stack == stack]
            old = ((kept.get("stacks") or {}).get(stack) or {}).get(kind)
            floor = _floor(order[kind], fits, sr) if kind in order else None
            if only and only != stack and old:
                k = _kept(old)
                if kind in fits:  # (its kind's curve and half-point, refitted or not)
                    taken = KIND_CURVE + KERNEL_CONSTANTS * _too_few_lengths(sr)
                    k = dataclasses.replace(k, **{n: getattr(fits[kind][0], n) for n in taken})
                stacks.setdefault(stack, {})[kind] = (as_written(_into_floor(k, floor)), old["source"], sr)
                continue
            with _priced_under(_catalogue(fits, stacks)):
                k, err = fit(sr, floor, _kept(old) if warm and old else None, fits[kind][0] if kind in fits else None)
            print(f"{kind}, {stack}: objective {err:.2%}", flush=True)
            stacks.setdefault(stack, {})[kind] = (as_written(k), _source(sr, err, floor is not None), sr)
    return fits, stacks


#: the anchors `cross_validate` prints for each fold, worst first (their error on the rest of the table)
WORST_ANCHORS = 3


def _needed_kinds(kinds: Iterable[str]) -> set[str]:
    """``kinds`` and every kind slower than one of them in `KIND_ORDER`: what fitting them needs (their floors)."""
    order = [kind for kind, _ in KIND_ORDER]
    out = set(kinds)
    for kind in list(out):
        if kind in order:
            out.update(order[:order.index(kind)])
    return out


#: what `cross_validate` leaves out in turn: a source (its stack: Megatron-LM, Composer, torch-native) or one
#: published table (`Row.table`)
FOLDS = {"source": lambda r: r.source, "table": lambda r: r.table}


def _fits_without(rows: list[Row], table: list[Row]) -> tuple[dict[tuple[str, str], Constants], dict]:
    """(kind, stack) → constants fitted on every row but those of ``table``, as `fit_all` fits them (a kind's own
    on its Megatron and Composer rows, a stack's on its own rows; one with no rows left takes its kind's), for each
    (kind, stack) of ``table``'s rows; and fitted.yaml's contents with every fit of the fold written (`_catalogue`),
    which ``table``'s rows are priced under. Only the kinds those rows run on are fitted, and the slower kinds
    their floors come from (`_needed_kinds`): Korthikanti's A100 rows need no H100 fit."""
    held = {r.id for r in table}
    base, stacks = fit_all([r for r in rows if r.id not in held], warm=False,
                           kinds=_needed_kinds(r.kind for r in table))
    own = {(kind, stack): k for stack, kinds in stacks.items() for kind, (k, _, _) in kinds.items()}
    out = {}
    for kind, stack in {(r.kind, r.stack) for r in table}:
        # a stack's own, else the kind's, else (the kind's rows all held out) another stack's on that kind
        others = [k for (kd, _), k in sorted(own.items()) if kd == kind]
        out[kind, stack] = own.get((kind, stack)) or (base[kind][0] if kind in base else others[0])
    return out, _catalogue(base, stacks)


def _anchored(row: Row, k: Constants) -> Constants:
    """``k`` with the one constant a single run identifies (the matmul ceiling ``e_max``, as `costmodel.runs` moves
    it first) set so that ``row`` is predicted exactly (to the optimiser's tolerance)."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(lambda e: abs(predict(row, dataclasses.replace(k, e_max=e)).step_time_s
                                        / row.measured_step_s - 1), bounds=(0.05, 1.0), method="bounded",
                          options={"xatol": 1e-4})
    return dataclasses.replace(k, e_max=float(res.x))


def _fold(rows: list[Row], table: list[Row]) -> dict:
    """One fold of `cross_validate`: ``table``'s rows left out of the fit, then anchored on each of its rows in
    turn (each row's relative error left out under ``left_out_errors``; each anchor's mean absolute error on the
    rest of its table under ``anchored_by_anchor``: an anchor out of line with its table moves every other row by
    its own error). Every row is an anchor, so the anchored figure is the mean over all (anchor, row) pairs, not
    over a sample of anchors that may or may not hold a table's outliers (a prediction is ~4 ms; the fit is what
    costs)."""
    ks, contents = _fits_without(rows, table)
    with _priced_under(contents):
        return _scores(table, ks)


def _scores(table: list[Row], ks: dict[tuple[str, str], Constants]) -> dict:
    """`_fold`'s figures for ``table``'s rows under constants ``ks`` ((kind, stack) → constants)."""
    errors = {r.id: predict(r, ks[r.kind, r.stack]).step_time_s / r.measured_step_s - 1 for r in table}
    loto = [abs(e) for e in errors.values()]
    anchored, by_anchor = [], {}
    for a in table:
        k = _anchored(a, ks[a.kind, a.stack])
        rest = [r for r in table if r is not a and r.kind == a.kind]
        errs = [abs(predict(r, k).step_time_s / r.measured_step_s - 1) for r in rest]
        anchored += errs
        if errs:
            by_anchor[a.id] = sum(errs) / len(errs)
    return {"rows": len(table), "leave_one_table_out": sum(loto) / len(loto),
            "anchored": sum(anchored) / len(anchored) if anchored else float("nan"),
            "anchored_median": statistics.median(by_anchor.values()) if by_anchor else float("nan"),
            "left_out_errors": errors, "anchored_by_anchor": by_anchor}


class _Prefixed:
    """A text stream that writes each line to ``out`` behind ``prefix`` (a fold's progress, among the others');
    anything else it is asked (``encoding``, ``isatty``) is ``out``'s."""

    def __init__(self, out, prefix: str):
        self.out, self.prefix, self.at_start = out, prefix, True

    def __getattr__(self, name: str):
        return getattr(self.out, name)

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            self.out.write((self.prefix if self.at_start else "") + piece)
            self.at_start = piece.endswith("\n")
        return len(text)


#: how `cross_validate`'s workers start: a fresh interpreter each (torch's state is not forked)
_START_METHOD = "spawn"


@contextlib.contextmanager
def _sharing_fits(memo: dict):
    """`fit` returns what ``memo`` holds for its inputs, and adds what it fits to it, until the block ends."""
    global _FITTED
    _FITTED = memo
    try:
        yield memo
    finally:
        _FITTED = None


def _in_worker(task: Callable, name: str, memo: dict, *args):
    """Run ``task(*args)`` in a cross-validation worker, its progress behind ``[name]``, with ``memo``'s fits known;
    return its result and the fits known after it."""
    with _sharing_fits(dict(memo)) as fits, contextlib.redirect_stdout(_Prefixed(sys.stdout, f"[{name}] ")):
        return task(*args), fits


def _published(ids: frozenset[str]) -> list[Row]:
    return [r for r in load_rows() if r.id in ids]


def _prefit(ids: frozenset[str]) -> None:
    fit_all(_published(ids), warm=False)


def _fold_of(by: str, held: str, ids: frozenset[str]) -> dict:
    rows = _published(ids)
    return _fold(rows, [r for r in rows if FOLDS[by](r) == held])


def cross_validate(rows: list[Row], file=sys.stdout, jobs: int = 1, by: str = "source") -> dict[str, dict]:
    """Leave-one-out by source (``by="source"``: each stack's rows predicted with constants fitted on the others)
    or by published table (``"table"``), and anchored (each left-out group's rows predicted from those constants
    moved by each of its rows in turn, `_anchored`): the mean absolute error of each per
    group, printed and returned (with each fold's `_fold` ``left_out_errors``). ``jobs`` > 1 runs that many
    processes: first, beside the folds that cannot use them, the cold fits on every row, which the folds that
    leave none of a kind's rows out share (`_FITTED`), then a fold each. The workers read ``rows`` from the
    published ones (`load_rows`) and run this module as it is on disk: a caller's changes to it (the fit's budget,
    `WORST_ANCHORS`) reach ``jobs=1`` only. A fold that fails cancels those not started yet; its error is raised when
    the running ones end."""
    key = FOLDS[by]
    groups = sorted({key(r) for r in rows})
    out: dict[str, dict] = {}

    def show(held: str) -> None:
        fold = out[held]
        print(f"{held}: {fold['rows']} rows; left out of the fit: mean abs error {fold['leave_one_table_out']:.1%}; "
              f"anchored on one of its rows: {fold['anchored']:.1%} (median over anchors "
              f"{fold['anchored_median']:.1%})", file=file, flush=True)
        worst = sorted(fold["anchored_by_anchor"].items(), key=lambda a: -a[1])[:WORST_ANCHORS]
        for anchor, err in worst if len(fold["anchored_by_anchor"]) > 1 else ():
            print(f"    anchored on {anchor} ({fold['left_out_errors'][anchor]:+.1%} left out): {err:.1%}",
                  file=file, flush=True)

    if jobs <= 1:
        with _sharing_fits({}):
            for held in groups:
                out[held] = _fold(rows, [r for r in rows if key(r) == held])
                show(held)
        return out
    import concurrent.futures
    import multiprocessing

    ids = frozenset(r.id for r in rows)
    if _published(ids) != rows:
        raise ValueError("cross_validate(jobs > 1) reads its rows in its workers from the published ones "
                         "(load_rows), in their order; pass jobs=1 for other rows")
    slowest = KIND_ORDER[0][0]
    # a fold that leaves out rows of the slowest kind refits it, and so every faster kind: it shares no fit
    alone = [g for g in groups if any(key(r) == g and r.kind == slowest for r in rows)]
    waiting = [g for g in groups if g not in alone]
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(groups) + bool(waiting)),
                                                mp_context=multiprocessing.get_context(_START_METHOD)) as pool:
        pending = {pool.submit(_in_worker, _fold_of, held, {}, by, held, ids): held for held in alone}
        if waiting:
            pending[pool.submit(_in_worker, _prefit, "fits on every row", {}, ids)] = None
        try:
            while pending:  # (each fold printed as it ends; the others submitted once the fits they share exist)
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    held = pending.pop(future)
                    result, memo = future.result()
                    if held is None:
                        pending |= {pool.submit(_in_worker, _fold_of, g, memo, by, g, ids): g for g in waiting}
                    else:
                        out[held] = result
                        show(held)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return {g: out[g] for g in groups}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m costmodel.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not fit; report with the constants in fitted.yaml")
    ap.add_argument("--only", help="refit this device kind's (a100, h100) or this stack's (torch-native) constants "
                                   "only; the others keep fitted.yaml's")
    ap.add_argument("--cv", action="store_true",
                    help="cross-validate instead: each source (or --by table, each published table) predicted by "
                         "constants fitted without it, and anchored on one of its rows (40 min with --jobs 3 here)")
    ap.add_argument("--by", choices=sorted(FOLDS), default="source",
                    help="with --cv: leave out one source (its stack) at a time, or one published table")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="with --cv: N processes, a fold each (one first fits every row, for the folds that share "
                         "those fits; default 1)")
    ap.add_argument("--cp", action="store_true",
                    help="predict torchtitan's context-parallel rows with the constants in fitted.yaml (no fit)")
    args = ap.parse_args(argv)
    if args.cp:
        report(context_parallel_rows())
        return 0
    rows = load_rows()
    if args.cv:
        cross_validate(rows, jobs=args.jobs, by=args.by)
        return 0
    if not args.check:
        fits, stacks = fit_all(rows, args.only)
        for name, (k, err, _) in [*fits.items(), *((f"{kd}, {st}", v) for st, ks in stacks.items()
                                                   for kd, v in ks.items())]:
            print(f"{name}: e_max {k.e_max:.3f}, f_half {k.f_half:.3g} FLOP, memory_eff {k.memory_eff:.3f}, "
                  f"overlap_slowdown {k.overlap_slowdown:.3f}, attention_eff {k.attention_eff:.3f}, "
                  f"fp8_eff {k.fp8_eff:.3f}, attention_seq_half {k.attention_seq_half:.0f}; {err}")
        write_fitted(fits, stacks)
        _rebuild_catalogues()
    report(rows)
    table4()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
