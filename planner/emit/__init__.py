"""From a plan to code that trains: the runtime that runs inside torchrun (`runtime`: parallelise; `train`: the
step, optimizer and data; both import only torch, so the emitter can inline them), the plan-to-runtime dict
(`config`), the script emitter (`script`) and `auto_parallelize` (`apply`).

May import `planner.plan`, `profiler` (model sources) and, for a plan made on the fly, `planner.search`.
"""
