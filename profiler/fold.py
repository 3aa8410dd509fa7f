"""Capture deep models fast: capture a few blocks, then repeat the last captured block to the full depth.

A transformer's blocks are identical (same ops, shapes and parameters, checked by their signature), so capturing
96 of them teaches nothing that 3 do not. `unfold` takes a `ModelGraph` captured with ``k ≥ 2`` blocks of a
numbered container and writes out the graph of ``depth`` blocks: block ``i ≥ k`` is a copy of block ``k − 1``
with its module paths, parameter names, node names and saved-storage ids renamed, its inputs from block ``k − 2``
re-pointed at block ``i − 1``, and the head re-pointed at the new last block. Storages the template block shares
with the rest of the model (a RoPE table computed once, say) keep their id. The result equals a full capture
node for node up to node names (tests/test_fold.py checks this), in a fraction of the time.
"""

from __future__ import annotations

import re
from dataclasses import replace

from profiler.graph import ModelGraph, NodeInfo, ParamInfo
from profiler.layers import _block_key, find_block_container


def unfold(graph: ModelGraph, depth: int) -> ModelGraph:
    """``graph`` (captured with k ≥ 2 identical blocks) extended to ``depth`` blocks; see the module docstring."""
    container = find_block_container(graph)
    if not container:
        raise ValueError(f"cannot unfold {graph.name}: no numbered block container found")
    blocks: dict[int, list[NodeInfo]] = {}
    before: list[NodeInfo] = []
    after: list[NodeInfo] = []
    for n in graph.nodes:
        key = _block_key(n.module_path)
        if key and key[0] == container:
            blocks.setdefault(key[1], []).append(n)
        elif blocks:
            after.append(n)
        else:
            before.append(n)
    k = len(blocks)
    if sorted(blocks) != list(range(k)) or k < 2:
        raise ValueError(f"cannot unfold {graph.name}: need ≥ 2 consecutive captured blocks, found {sorted(blocks)}")
    if depth <= k:
        return graph
    tmpl, prev = blocks[k - 1], blocks[k - 2]
    if [n.op for n in tmpl] != [n.op for n in prev]:
        raise ValueError(f"cannot unfold {graph.name}: blocks {k - 2} and {k - 1} differ")

    first_seen: dict[int, str] = {}
    for n in graph.nodes:
        for sid, *_ in n.saved:
            first_seen.setdefault(sid, n.name)
    tmpl_names = {n.name for n in tmpl}
    own_ids = {sid for n in tmpl for sid, *_ in n.saved if first_seen[sid] in tmpl_names}
    next_id = max(first_seen, default=-1) + 1

    prefix_t = f"{container}.{k - 1}"
    pos_prev = {n.name: j for j, n in enumerate(prev)}
    pos_tmpl = {n.name: j for j, n in enumerate(tmpl)}
    pattern = re.compile(rf"^{re.escape(prefix_t)}(?=\.|$)")

    new_blocks = [list(blocks[i]) for i in range(k)]
    for i in range(k, depth):
        last = new_blocks[-1]
        id_map = {sid: next_id + j for j, sid in enumerate(sorted(own_ids))}
        next_id += len(own_ids)
        copy = []
        for n in tmpl:
            inputs = []
            for x in n.inputs:
                if x in pos_tmpl:
                    inputs.append(f"{x}__b{i}")
                elif x in pos_prev:
                    inputs.append(last[pos_prev[x]].name)
                else:
                    inputs.append(x)
            copy.append(replace(
                n, name=f"{n.name}__b{i}", module_path=pattern.sub(f"{container}.{i}", n.module_path),
                params=tuple(pattern.sub(f"{container}.{i}", p) for p in n.params), inputs=tuple(inputs),
                saved=tuple((id_map.get(sid, sid), *rest) for sid, *rest in n.saved),
            ))
        new_blocks.append(copy)

    last_old = {n.name: j for j, n in enumerate(tmpl)}
    final = new_blocks[-1]
    head = [replace(n, inputs=tuple(final[last_old[x]].name if x in last_old else x for x in n.inputs))
            for n in after]

    params = list(graph.params)
    tmpl_params = [p for p in graph.params if pattern.match(p.fqn)]
    insert_at = max(j for j, p in enumerate(params) if pattern.match(p.fqn)) + 1 if tmpl_params else len(params)
    extra: list[ParamInfo] = []
    for i in range(k, depth):
        extra += [replace(p, fqn=pattern.sub(f"{container}.{i}", p.fqn)) for p in tmpl_params]
    params[insert_at:insert_at] = extra
    arch = dict(graph.arch)
    if "layers" in arch:
        arch["layers"] = depth
    nodes = tuple(before) + tuple(n for b in new_blocks for n in b) + tuple(head)
    return replace(graph, nodes=nodes, params=tuple(params), arch=arch)
