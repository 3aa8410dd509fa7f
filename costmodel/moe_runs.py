"""Published mixture-of-experts runs predicted by the cost model: costmodel/data/moe_runs.json (a copy of
shared/calibration/moe_runs.json, see its README §6), the rows whose model and hardware autopar can describe.

Usable rows: H100 SXM runs in bf16 of a model the profiler captures with an expert-parallel configuration the cost
model covers (tp, pp, vpp, ep, dp as published; etp = 1): Megatron-LM's Mixtral 8x7B (MCore v0.8 and v0.9, the zoo's
``mixtral-8x7b``). Left out, and why: Megatron-Bridge's GPT-OSS-120B rows (Hugging Face ``gpt_oss``, `GPT_OSS_120B`,
captures with its experts as grouped GEMMs but its attention as transformers runs it: eager matmuls and softmax over
seq × seq scores, for the attention sinks, where Megatron runs a fused kernel; predicted 48-63 TFLOP/s/GPU against
153-163 published, a difference of attention kernels, not of expert parallelism), Blackwell systems (not in the
device catalogue), FP8/MXFP8 rows (the runtime trains bf16; fp8 is priced but not calibrated on MoE), DeepSeek-V3
(MLA with fp8, tp = 2 with expert-TP unknown), verification cards with real-data routing or SFT packing.

Each prediction uses the ``megatron`` stack (these are Megatron-Core runs), the published mesh, global batch,
micro-batch and sequence, the distributed optimizer (zero = 1, over 16-bit parameters: ``autocast=False``), no
activation recomputation (none is published), balanced routing (Megatron-Bridge forces it; the Mixtral rows are
dropless), and compares model TFLOP/s per GPU, the figure both sources publish (Megatron's own FLOP formula; the
capture's FLOPs count the same GEMMs and the full, non-causal attention matrix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from costmodel.cluster import load_cluster
from costmodel.config import ParallelConfig
from costmodel.stacks import STACKS

#: GPT-OSS-120B as published (moe_runs.json "architectures": NeMo's GPTOSSConfig120B; Megatron-Bridge's perf
#: recipes use vocab 128256 where the table does not say otherwise)
GPT_OSS_120B = ("hf:gpt_oss:num_hidden_layers=36,hidden_size=2880,intermediate_size=2880,num_attention_heads=64,"
                "num_key_value_heads=8,head_dim=64,num_local_experts=128,num_experts_per_tok=4,vocab_size=128256,"
                "sliding_window=128,seq=4096")
SPECS = {"Mixtral-8x7B": "mixtral-8x7b"}


@dataclass(frozen=True)
class MoERow:
    id: str
    model: str  #: the profiler spec
    nodes: int
    config: ParallelConfig
    global_batch: int
    seq: int
    tflops_per_gpu: float  #: published model TFLOP/s per GPU


@cache
def records() -> list[dict]:
    text = resources.files("costmodel").joinpath("data/moe_runs.json").read_text()
    return json.loads(text)["records"]


def usable_rows() -> list[MoERow]:
    """The rows the module docstring lists, in file order."""
    out = []
    for r in records():
        c, m = r["config"], r["model"]
        bf16 = "bf16" in (c.get("precision"), c.get("precision_normalized"))
        if ("H100" not in r["cluster"]["gpu"] or m["name"] not in SPECS or not bf16
                or not r["measured"].get("tflops_per_gpu") or (c.get("etp") or 1) != 1
                or r["id"].startswith("mb-card-")):
            continue
        vpp = c.get("vpp") or 1
        cfg = ParallelConfig(dp=c["dp"], tp=c["tp"], pp=c["pp"], vpp=vpp, ep=c["ep"], mbs=c["micro_batch"],
                             schedule="interleaved" if vpp > 1 else "1f1b", zero=1, precision="bf16")
        out.append(MoERow(id=r["id"], model=SPECS[m["name"]], nodes=r["cluster"]["n_gpus"] // 8, config=cfg,
                          global_batch=c["global_batch"], seq=c["seq"],
                          tflops_per_gpu=float(r["measured"]["tflops_per_gpu"])))
    return out


def predict(rows: list[MoERow] | None = None, stack: str = "megatron") -> list[tuple[MoERow, float]]:
    """(row, predicted model TFLOP/s per GPU) for each row (captures each model once)."""
    from costmodel.estimate import Evaluator
    from profiler.api import profile_model

    graphs: dict = {}
    out = []
    for row in rows if rows is not None else usable_rows():
        key = (row.model, row.seq)
        if key not in graphs:
            graphs[key] = profile_model(row.model, seq=row.seq)
        cluster = load_cluster(f"dgx-h100:nodes={row.nodes},stack={stack}")
        # as the stack computes (`costmodel.stacks.Stack.runtime_options`; Megatron-Core's distributed optimizer:
        # 16-bit parameters beside fp32 master shards, gathered in 16 bits; its fused gradient accumulation)
        est = Evaluator(graphs[key], cluster, row.config, row.global_batch,
                        **STACKS[stack].runtime_options()).evaluate()
        out.append((row, est.tflops_per_gpu_model))
    return out


def main() -> None:
    results = predict()
    print("| run | model | mesh (dp tp pp vpp ep) | published TFLOP/s/GPU | predicted | error |")
    print("|---|---|---|---|---|---|")
    errors = []
    for row, tf in results:
        c = row.config
        err = tf / row.tflops_per_gpu - 1
        errors.append(abs(err))
        print(f"| {row.id} | {':'.join(row.model.split(':')[:2])} | "
              f"{c.dp} {c.tp} {c.pp} {c.vpp} {c.ep} | {row.tflops_per_gpu:.0f} | {tf:.0f} | {err:+.1%} |")
    print(f"MAPE {sum(errors) / len(errors):.1%} over {len(errors)} rows")


if __name__ == "__main__":
    main()
