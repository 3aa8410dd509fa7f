"""Commands that need the cost model and the planner: registered here so `autopar profile` stays light."""

from __future__ import annotations


def register(sub) -> None:
    """Add the plan/estimate/inspect sub-commands (filled in as those stages land)."""
    return None
