"""Train a zoo model with `auto_parallelize` under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/train_auto_parallelize.py --plan plan.yaml
    torchrun --standalone --nproc-per-node 2 examples/train_auto_parallelize.py --model gpt-tiny --dp 2

With ``--plan`` the plan file (from ``autopar plan … --out plan.yaml``) says what to do; otherwise a data-parallel
or tensor-parallel plan is built inline from ``--dp``/``--tp``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from planner import LayerStrategy, ParallelConfig, Plan, auto_parallelize, synthetic_batch
from profiler.zoo.registry import resolve_model


def inline_plan(model: str, dp: int, tp: int, layers: int, seq: int, global_batch: int) -> Plan:
    names = ["embed", *(f"layers.{i}" for i in range(layers)), "head"]
    return Plan(model=model, fingerprint="inline", seq=seq, global_batch=global_batch, cluster="cpu-local",
                config=ParallelConfig(dp=dp, tp=tp, precision="fp32"),
                layers=tuple(LayerStrategy(name=n, stage=0, tp=tp > 1 and n.startswith("layers.")) for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="plan YAML file")
    parser.add_argument("--model", default="gpt-tiny", help="zoo model spec (without --plan)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    if args.plan:
        plan = Plan.load(args.plan)
    else:
        source = resolve_model(args.model)
        plan = inline_plan(args.model, args.dp, args.tp, source.arch()["layers"], source.seq, 8)
    source = resolve_model(plan.model).with_seq(plan.seq)
    torch.manual_seed(0)
    model, example_inputs = source.build(batch=1, seq=plan.seq, device="cpu")

    # the model itself stays untouched; AdamW, clipping at global norm 1, cosine decay over the run
    handle = auto_parallelize(model, example_inputs, plan=plan, lr=args.lr, total_steps=args.steps)
    for step in range(args.steps):
        batch = synthetic_batch(step, batch=plan.global_batch, seq=plan.seq, vocab=source.vocab, seed=0)
        start = time.perf_counter()
        loss = handle.step(batch)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.5f} grad norm {handle.grad_norm:.4g} "
                  f"time {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
    handle.close()  # every rank: the process groups end before the interpreter does


if __name__ == "__main__":
    main()
