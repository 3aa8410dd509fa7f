"""The search: outer loop over mesh shapes, schedules and micro-batches (`outer`), its lower bounds (`bounds`), the
inner integer program per candidate (`ilp`, with its coefficients in `ilp_data`), and what-if sweeps (`sweep`).

May import `costmodel`, `profiler` and `planner.plan`; never emission, reports, validation or the CLI.
"""
