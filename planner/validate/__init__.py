"""The closed loop: run plans' emitted scripts for a few steps (`loop`, with `driver` running inside torchrun and
importing only torch), put measured time and memory beside the prediction, and refit a cluster to them (`fit`).

May import `planner.plan`, `planner.search`, `planner.emit`, `costmodel` and `profiler`; never reports or the CLI.
"""
