"""Conformance: run the runtime's own `parallelize` and training step for each distinct rank role of a plan on a fake
process group of the plan's world size, with fake tensors (`trace`), and put what it did (memory by category,
collectives by kind, FLOPs, gradient reduction) beside what the cost model charged (`conformance`).

May import `planner.plan`, `planner.emit` (the runtime it runs), `planner.search` (the model's profile),
`costmodel` and `profiler`; never reports, validation or the CLI.
"""
