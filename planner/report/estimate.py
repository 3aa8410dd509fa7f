"""Human-readable output of `autopar estimate`."""

from __future__ import annotations

from planner.report.textui import human_bytes, human_time, render_table


def print_estimate(model, cluster, cfg, global_batch, lg, est, *, file) -> None:
    c = cfg.to_dict()
    conf = ", ".join(f"{k}={v}" for k, v in c.items())
    print(f"{model} on {cluster}, global batch {global_batch} × seq {lg.model.seq}", file=file)
    print(f"config: {conf}", file=file)
    print(f"step time {human_time(est.step_time_s)}   tokens/s {est.tokens_per_s:,.0f}   "
          f"MFU {est.mfu:.1%}   HFU {est.hfu:.1%}   "
          f"TFLOP/s/GPU {est.tflops_per_gpu_model:.1f} (model) {est.tflops_per_gpu_hw:.1f} (hw)", file=file)
    fits = "fits" if est.fits else "DOES NOT FIT"
    print(f"memory per GPU {human_bytes(est.memory.peak)} of {human_bytes(est.capacity_bytes)}: {fits}", file=file)
    rows = [[k, human_time(v), f"{v / est.step_time_s:.1%}"] for k, v in est.breakdown_s.items() if v > 0]
    render_table("step time breakdown", ["part", "time", "share"], rows, file=file)
    mem = est.memory.to_dict()
    rows = [[k, human_bytes(v)] for k, v in mem.items()]
    render_table("memory per GPU (worst rank)", ["part", "bytes"], rows, file=file)
