"""Capture and plan public Hugging Face causal-LM architectures from their published ``config.json`` files
(``tests/data/hf_configs``: each file is the model's config as published on its model card, fields that do not shape
the network dropped), and compare the captured parameter count with the count the model card publishes.

    python benchmarks/hf_architectures.py [--cluster dgx-h100:nodes=1] [--global-batch 64] [--only NAME]

Every architecture is captured at its full depth (folded: a few blocks captured and repeated, `profiler.fold`), then
planned for the cluster. The published counts are the model cards' "Model size" figures (safetensors metadata);
the capture's count is also compared with transformers' own count of the model built from the same file (on the
meta device), which must be equal. GPT-J's card gives 6,053,381,344 parameters for the original JAX model, 2,498,560
more than its transformers port holds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from costmodel.cluster import load_cluster
from planner.search.outer import NoPlanFits, search
from profiler.api import profile_model
from profiler.zoo.registry import resolve_model

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs"

#: name: (published parameter count, what the architecture exercises)
PUBLISHED = {
    "mistral-7b-v0.1": (7_241_732_096, "dense, GQA 32/8, sliding-window attention"),
    "qwen3-8b": (8_190_735_360, "dense, GQA 32/8, q/k norms, head_dim 128"),
    "gemma-7b": (8_537_680_896, "dense, head_dim 256 ≠ hidden/heads, tied 256K vocabulary"),
    "olmo-2-1124-7b": (7_298_617_344, "dense, norms after attention and MLP, q/k norms"),
    "phi-3-mini-4k-instruct": (3_821_079_552, "dense, fused qkv and gate/up projections"),
    "stablelm-2-1_6b": (1_644_515_328, "dense, qkv biases, partial rotary (25 %), LayerNorm"),
    "pythia-1.4b": (1_414_647_808, "GPT-NeoX: parallel attention and MLP, partial rotary"),
    "gpt-j-6b": (6_053_381_344, "parallel attention and MLP, rotary on 64 dims, head bias"),
    "falcon-7b": (6_921_720_704, "parallel attention, multi-query (1 KV head), tied head"),
    "phi-2": (2_779_683_840, "parallel attention and MLP, partial rotary (40 %), biases"),
    "opt-1.3b": (1_315_758_080, "learned positions, ReLU MLP, tied head"),
    "olmoe-1b-7b-0924": (6_919_161_856, "mixture of experts: 64 experts, top-8, every layer"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dgx-h100:nodes=1")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--only", help="the architectures whose name contains this text")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    bad = unplanned = 0
    print(f"{'model':<24} {'published':>15} {'captured':>15} {'diff':>7} {'= transformers':>14}  {'capture':>7} "
          f"{'search':>6}  plan")
    for name, (published, what) in PUBLISHED.items():
        if args.only and args.only not in name:
            continue
        spec = f"hf:{CONFIGS / (name + '.json')}:seq={args.seq}"
        t0 = time.perf_counter()
        lg = profile_model(spec)
        t1 = time.perf_counter()
        try:
            r = search(lg, cluster, args.global_batch, progress=False)
            c = r.best.config
            plan = (f"dp={c.dp} tp={c.tp} pp={c.pp} zero={c.zero} mbs={c.mbs} ac={c.ac.value}: "
                    f"{r.best.estimate.tokens_per_s:,.0f} tok/s, peak {r.best.estimate.memory.peak / 2**30:.1f} GiB")
        except NoPlanFits as exc:
            plan, unplanned = f"NO PLAN: {exc}", unplanned + 1
        t2 = time.perf_counter()
        model, _ = resolve_model(spec).build(batch=1, seq=64, device="meta")
        theirs = sum(p.numel() for p in model.parameters())  # transformers' count (tied weights once)
        got = lg.model.num_params
        diff = got / published - 1
        bad += abs(diff) > 0.005 or got != theirs
        print(f"{name:<24} {published:>15,} {got:>15,} {diff:>+7.2%} {'yes' if got == theirs else 'NO':>14}  "
              f"{t1 - t0:>6.1f}s {t2 - t1:>5.1f}s  {plan} ({what})", flush=True)
    print(f"{bad} architectures off the published count by more than 0.5 % or unequal to transformers' count; "
          f"{unplanned} without a plan")
    return 1 if bad or unplanned else 0


if __name__ == "__main__":
    raise SystemExit(main())
