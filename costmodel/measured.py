"""Use a measured profile (`autopar profile MODEL --device … --out PROFILE.json`) in the cost model.

The profile holds each layer's forward and backward time at one batch on one device. It applies only to the same
model (same spec, sequence length and layer names) on a cluster of that device; anything else is refused with
the reason, never silently mixed.
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel.cluster import Cluster
from profiler.graph import LayerGraph

_GPU_KINDS = {"a100-40g": "a100", "a100-80g": "a100", "h100-sxm": "h100", "h200": "h200"}


def _same_device(measured_on: str, cluster: Cluster) -> bool:
    name = cluster.device.name
    if name == "cpu":
        return measured_on.startswith("cpu")
    kind = _GPU_KINDS.get(name)
    return kind is not None and kind in measured_on.lower().replace(" ", "")


def load_measured(path: str | Path, lg: LayerGraph, cluster: Cluster) -> tuple[dict[str, tuple[float, float]], int]:
    """(layer name → (forward s, backward s), measured batch) from a profile file; ValueError if it does not apply."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"profile {path} not found; write one with `autopar profile MODEL --device cpu --out {path}`")
    try:
        d = json.loads(path.read_text())
        m = d["measured"]
        layers = {k: (float(v["fwd_s"]), float(v["bwd_s"])) for k, v in m["layers"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: not a measured profile (run `autopar profile MODEL --device cpu --out {path}`)") \
            from None
    if d.get("model") != lg.model.name or d.get("seq") != lg.model.seq:
        raise ValueError(f"{path} profiles {d.get('model')} at seq {d.get('seq')}, not {lg.model.name} at seq "
                         f"{lg.model.seq}; profile this model")
    missing = [layer.name for layer in lg.layers if layer.name not in layers]
    if missing:
        raise ValueError(f"{path} has no time for layer {missing[0]}; profile this model again")
    if not _same_device(m["device"], cluster):
        raise ValueError(f"{path} was measured on {m['device']!r} but cluster {cluster.name} has {cluster.device.name} "
                         "devices; measure on that device or drop --profile")
    return layers, int(m["batch"])
