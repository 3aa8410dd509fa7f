"""The per-layer table and JSON of ``autopar profile``."""

from __future__ import annotations

from planner.report.textui import human_bytes, human_count, human_time
from profiler.graph import LayerGraph
from profiler.measure import Profile


def runs_of_identical(lg: LayerGraph) -> list[tuple[int, int]]:
    """(first, last) index ranges of consecutive layers with the same signature."""
    runs: list[tuple[int, int]] = []
    for layer in lg.layers:
        if runs and lg.layers[runs[-1][1]].signature == layer.signature:
            runs[-1] = (runs[-1][0], layer.index)
        else:
            runs.append((layer.index, layer.index))
    return runs


def layer_rows(lg: LayerGraph, prof: Profile | None) -> tuple[list[str], list[list[str]]]:
    headers = ["layers", "count", "params", "fwd FLOPs", "bwd FLOPs", "saved act.", "boundary"]
    if prof:
        headers += ["fwd time", "bwd time"]
    rows = []
    for first, last in runs_of_identical(lg):
        layer = lg.layers[first]
        name = layer.name if first == last else f"{layer.name} … {lg.layers[last].name}"
        row = [name, str(last - first + 1), human_count(layer.param_numel), human_count(layer.fwd_flops, "FLOP"),
               human_count(layer.bwd_flops, "FLOP"), human_bytes(layer.saved_bytes), human_bytes(layer.input_bytes)]
        if prof:
            t = prof.layers.get(layer.name)
            row += [human_time(t.fwd_s), human_time(t.bwd_s)] if t else ["-", "-"]
        rows.append(row)
    return headers, rows


def profile_to_dict(lg: LayerGraph, prof: Profile | None) -> dict:
    g = lg.model
    out = {
        "model": g.name, "fingerprint": g.fingerprint, "method": g.method, "batch": g.batch, "seq": g.seq,
        "dtype": g.dtype, "params": g.num_params, "arch": g.arch, "block_container": lg.block_container,
        "layers": [
            {"name": layer.name, "kind": layer.kind, "signature": layer.signature, "params": layer.param_numel,
             "shared_params": list(layer.shared_params), "fwd_flops": layer.fwd_flops,
             "bwd_flops": layer.bwd_flops, "saved_bytes": layer.saved_bytes, "input_bytes": layer.input_bytes,
             "fwd_bytes": layer.fwd_bytes, "bwd_bytes": layer.bwd_bytes, "nodes": len(layer.nodes)}
            for layer in lg.layers
        ],
    }
    if prof:
        out["measured"] = prof.to_dict()
    return out
