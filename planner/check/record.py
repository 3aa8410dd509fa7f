"""What a trace records (`Trace`) and how torch's memory categories map onto the parts a check compares
(`memory_parts`): no torch import here, so the side that compares (`planner.check.conformance`, `planner.check.fold`)
starts without the tracer's imports (FSDP, pipelining, torch's trackers), which only the tracing processes need."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trace:
    """What one rank did in one (steady-state) training step."""

    rank: int  #: global rank traced
    coords: dict  #: its (pp, dp, tp) coordinates
    memory: dict  #: bytes, each category's maximum over the step: params, grads, optimizer, activations,
    #: temporaries, and the peak of their sum
    collectives: dict = field(default_factory=dict)  #: "kind@group" → {"count", "bytes"} per step
    flops: float = 0.0  #: FLOPs this rank executed (forward, backward, recomputation)
    grad_elements: float = 0.0  #: gradient elements on this rank that its dp group must reduce
    dp_reduced_elements: float = 0.0  #: elements reduced over this rank's dp group (all-reduce / reduce-scatter)
    memory_at_peak: dict = field(default_factory=dict)  #: torch's categories at the moment of the peak, bytes
    peak_at: str = ""  #: where the peak happened: forward or backward, and the innermost modules running
    moments: dict = field(default_factory=dict)  #: each such place → (its highest total, the categories then, each
    #: category's own maximum there)


def memory_parts(most) -> dict:
    """The memory parts a check compares, from ``most(category)``, a torch tracker category's maximum in bytes
    (``Total``: the peak)."""
    return {"params": most("Parameter") + most("Buffer"), "grads": most("Gradient"), "optimizer": most("Optstate"),
            "activations": most("Activation"), "temporaries": most("Temp") + most("Other"), "peak": most("Total")}
