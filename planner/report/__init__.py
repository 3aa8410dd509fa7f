"""What a plan does and why, for people: the facts `autopar inspect` shows (`facts`), rendered for the terminal
(`text`, `textui`) and as one HTML page (`html`, `svg`, `timeline`), plus the outputs of `profile`, `estimate`
and `--sweep`.

May import `planner.plan` and `costmodel` (to recompute a fact from the plan file); never search, emission or CLI.
"""
