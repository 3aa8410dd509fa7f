"""SVG pictures for the HTML report: memory per pipeline rank, the step-time breakdown, alternatives as time vs
memory with the Pareto front, and the device mesh. Each takes the `planner.report.facts.build_report` dict."""

from __future__ import annotations

from html import escape

from planner.report.textui import human_bytes, human_time

MEM_COLOURS = {
    "params": "#4e79a7",
    "grads": "#76b7b2",
    "optimizer": "#edc948",
    "activations": "#e15759",
    "other": "#bab0ac",
}
TERM_COLOURS = {
    "compute": "#4e79a7",
    "recompute": "#f28e2b",
    "tp_comm": "#b07aa1",
    "cp_comm": "#ff9da7",
    "ep_comm": "#76b7b2",
    "pp_comm": "#9467bd",
    "dp_comm_exposed": "#e15759",
    "bubble": "#d3d3d3",
    "optimizer": "#59a14f",
    "compression": "#edc948",
}
GROUP_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d37295",
)


def _svg(id_: str, w: int, h: int, body: list[str], label: str) -> str:
    return (
        f'<svg id="{id_}" class="chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img" aria-label="{escape(label)}">' + "\n".join(body) + "</svg>"
    )


def _axis_bytes(v: float, span: float) -> str:
    """``v`` in the unit of the larger of the two, with enough decimals to tell ticks ``span``/4 apart."""
    import math

    unit, name = next(
        ((u, n) for u, n in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if max(abs(v), span) >= u),
        (1, "B"),
    )
    step = span / 4 / unit
    dec = 0 if step >= 1 or step <= 0 else min(4, math.ceil(-math.log10(step)))
    return f"{v / unit:.{dec}f} {name}"


def _legend(items, x0, y) -> str:
    out, x = [], x0
    for label, colour in items:
        out.append(
            f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{y}" class="lbl">{escape(label)}</text>'
        )
        x += 28 + 7 * len(label)
    return f'<g class="legend">{"".join(out)}</g>'


# ---------------------------------------------------------------------------------------------- memory bars
def rank_memory(rep: dict) -> list[dict]:
    """Per pipeline rank, its memory parts: the plan's per-stage breakdowns when it has them; for older plan files
    (peak rank only) another rank's model states are scaled by its layer count and its activations by layers ×
    in-flight micro-batches, and "other" takes what remains of its stored peak (the picture says so)."""
    mem = rep["memory"]["breakdown_bytes"]
    exact = {s["rank"]: s["memory_parts"] for s in rep["stages"] if s.get("memory_parts")}
    if exact and len(exact) == len({s["rank"] for s in rep["stages"]}):
        return [{"rank": r, "peak": parts["peak"], "parts": {k: v for k, v in parts.items() if k != "peak"},
                 "exact": True} for r, parts in sorted(exact.items())]
    ranks: dict[int, dict] = {}
    for s in rep["stages"]:
        r = ranks.setdefault(s["rank"], {"rank": s["rank"], "peak": s["memory_bytes"], "layers": 0, "act_w": 0})
        r["layers"] += s["n_layers"]
        r["act_w"] += s["n_layers"] * s["inflight"]
        r["peak"] = max(r["peak"], s["memory_bytes"])
    if not ranks:
        return [{"rank": 0, "peak": rep["memory"]["peak_bytes"], "parts": dict(mem), "exact": True}]
    worst = max(ranks.values(), key=lambda r: r["peak"])
    out = []
    for r in sorted(ranks.values(), key=lambda r: r["rank"]):
        if r is worst:
            out.append({"rank": r["rank"], "peak": r["peak"], "parts": dict(mem), "exact": True})
            continue
        k_state = r["layers"] / worst["layers"] if worst["layers"] else 1.0
        k_act = r["act_w"] / worst["act_w"] if worst["act_w"] else 1.0
        parts = {k: mem[k] * k_state for k in ("params", "grads", "optimizer")}
        parts["activations"] = mem["activations"] * k_act
        rest = r["peak"] - sum(parts.values())
        if rest < 0:  # scaled estimate above the stored peak: shrink to it
            f = r["peak"] / (r["peak"] - rest)
            parts = {k: v * f for k, v in parts.items()}
            rest = 0.0
        parts["other"] = rest
        out.append({"rank": r["rank"], "peak": r["peak"], "parts": parts, "exact": False})
    return out


def memory_svg(rep: dict, width: int = 1300) -> str:
    rows = rank_memory(rep)
    cap = rep["memory"]["capacity_bytes"] or max(r["peak"] for r in rows) or 1.0
    top = max([cap] + [r["peak"] for r in rows]) * 1.05
    left, bar_h, y0 = 90, 22, 10
    x = lambda b: left + (width - left - 140) * b / top
    body = []
    for i, r in enumerate(rows):
        y = y0 + i * (bar_h + 6)
        body.append(
            f'<text x="{left - 8}" y="{y + bar_h / 2 + 4}" text-anchor="end" class="lbl">rank {r["rank"]}'
            f"{'' if r['exact'] else '*'}</text>"
        )
        b = 0.0
        for k, v in r["parts"].items():
            if v > 0:
                body.append(
                    f'<rect class="mem-{k}" x="{x(b):.2f}" y="{y}" width="{max(x(b + v) - x(b), 0.5):.2f}" '
                    f'height="{bar_h}" fill="{MEM_COLOURS[k]}"><title>rank {r["rank"]} {k}: '
                    f"{human_bytes(v)}</title></rect>"
                )
            b += v
        body.append(
            f'<text x="{x(r["peak"]) + 6:.1f}" y="{y + bar_h / 2 + 4}" class="lbl">{human_bytes(r["peak"])}</text>'
        )
    h_bars = y0 + len(rows) * (bar_h + 6)
    body.append(
        f'<line class="capacity" x1="{x(cap):.2f}" y1="2" x2="{x(cap):.2f}" y2="{h_bars}" stroke="#c00" '
        f'stroke-width="2" stroke-dasharray="6 3"/><text x="{x(cap) - 4:.1f}" y="{h_bars + 14}" '
        f'text-anchor="end" class="lbl" fill="#c00">device {human_bytes(cap)}</text>'
    )
    body.append(_legend([(k, c) for k, c in MEM_COLOURS.items()], left, h_bars + 36))
    if any(not r["exact"] for r in rows):
        body.append(
            f'<text x="{left}" y="{h_bars + 56}" class="tick">* parts apportioned from the peak rank\'s '
            f"breakdown (the plan stores only each rank's total)</text>"
        )
    return _svg("memory", width, h_bars + 64, body, "memory per pipeline rank")


# ------------------------------------------------------------------------------------------ breakdown bar
def breakdown_svg(rep: dict, width: int = 1300) -> str:
    rows = [b for b in rep["breakdown"] if b["seconds"] > 0]
    total = sum(b["seconds"] for b in rows) or 1.0
    left, y, h = 10, 10, 34
    x = lambda t: left + (width - 2 * left) * t / total
    body, t = [], 0.0
    for b in rows:
        w = x(t + b["seconds"]) - x(t)
        body.append(
            f'<rect class="term-{b["term"]}" x="{x(t):.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{h}" '
            f'fill="{TERM_COLOURS.get(b["term"], "#999")}"><title>{b["term"]}: {human_time(b["seconds"])} '
            f"({b['share']:.1%})</title></rect>"
        )
        if w > 70:
            body.append(
                f'<text x="{x(t) + w / 2:.1f}" y="{y + h / 2 + 4}" text-anchor="middle" class="inbar">'
                f"{b['term']} {b['share']:.0%}</text>"
            )
        t += b["seconds"]
    body.append(
        _legend(
            [(f"{b['term']} {human_time(b['seconds'])}", TERM_COLOURS.get(b["term"], "#999")) for b in rows],
            left,
            y + h + 24,
        )
    )
    return _svg("breakdown", width, y + h + 36, body, "step-time breakdown")


# -------------------------------------------------------------------------------------- alternatives scatter
def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both time and memory (lower is better), by time."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best_mem = [], float("inf")
    for i in order:
        if points[i][1] < best_mem:
            front.append(i)
            best_mem = points[i][1]
    return front


def scatter_svg(rep: dict, width: int = 640, height: int = 380) -> str:
    from planner.report.text import short_config

    pts = [("plan", rep["config"], rep["predicted"]["step_time_s"], rep["memory"]["peak_bytes"], None)]
    pts += [
        (f"#{a['rank']}", a["config"], a["step_time_s"], a["peak_bytes"], a["lost_by"]) for a in rep["alternatives"]
    ]
    cap = rep["memory"]["capacity_bytes"]
    ts, ms = [p[2] for p in pts], [p[3] for p in pts]
    t_lo, t_hi = min(ts), max(ts)
    m_lo, m_hi = (
        min(ms + ([cap] if cap and cap < 1.3 * max(ms) else [])),
        max(ms + ([cap] if cap and cap < 1.3 * max(ms) else [])),
    )
    pad_t, pad_m = (t_hi - t_lo) * 0.08 or t_hi * 0.1 or 1.0, (m_hi - m_lo) * 0.08 or m_hi * 0.1 or 1.0
    t_lo, t_hi, m_lo, m_hi = t_lo - pad_t, t_hi + pad_t, max(0.0, m_lo - pad_m), m_hi + pad_m
    L, R, T, B = 80, 30, 44, 50
    x = lambda t: L + (width - L - R) * (t - t_lo) / (t_hi - t_lo)
    y = lambda m: height - B - (height - T - B) * (m - m_lo) / (m_hi - m_lo)
    body = [f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="#fafafa" stroke="#ccc"/>']
    for i in range(5):
        tv, mv = t_lo + (t_hi - t_lo) * i / 4, m_lo + (m_hi - m_lo) * i / 4
        body.append(
            f'<text x="{x(tv):.1f}" y="{height - B + 16}" text-anchor="{"end" if i == 4 else "middle"}" '
            f'class="tick">'
            f'{human_time(tv)}</text><text x="{L - 6}" y="{y(mv) + 4:.1f}" text-anchor="end" class="tick">'
            f"{_axis_bytes(mv, m_hi - m_lo)}</text>"
        )
    body.append(
        f'<text x="{(L + width - R) / 2}" y="{height - 8}" text-anchor="middle" class="lbl">step time</text>'
        f'<text x="14" y="{(T + height - B) / 2}" transform="rotate(-90 14 {(T + height - B) / 2})" '
        f'text-anchor="middle" class="lbl">peak memory per GPU</text>'
    )
    if cap and m_lo <= cap <= m_hi:
        body.append(
            f'<line x1="{L}" x2="{width - R}" y1="{y(cap):.1f}" y2="{y(cap):.1f}" stroke="#c00" '
            f'stroke-dasharray="6 3"/><text x="{width - R - 4}" y="{y(cap) - 4:.1f}" text-anchor="end" '
            f'class="tick" fill="#c00">device memory</text>'
        )
    front = pareto([(p[2], p[3]) for p in pts])
    if len(front) > 1:
        path = " ".join(f"{x(pts[i][2]):.1f},{y(pts[i][3]):.1f}" for i in front)
        body.append(f'<polyline id="pareto" points="{path}" fill="none" stroke="#e15759" stroke-width="2"/>')
    for i, (name, cfg, t, m, lost) in enumerate(pts):
        on = i in front
        cls = "pt plan" if i == 0 else "pt alt"
        r = 8 if i == 0 else 6
        tip = f"{name}: {short_config(cfg)}; {human_time(t)}, {human_bytes(m)}" + (f"; lost on {lost}" if lost else "")
        body.append(
            f'<g class="{cls}{" pareto" if on else ""}"><title>{escape(tip)}</title>'
            f'<circle cx="{x(t):.1f}" cy="{y(m):.1f}" r="{r}" fill="{"#222" if i == 0 else "#4e79a7"}" '
            f'stroke="{"#e15759" if on else "#fff"}" stroke-width="2.5"/>'
            f'<text x="{x(t) + (10 if i % 2 == 0 else -10):.1f}" y="{y(m) + (-8 if i % 2 == 0 else 18):.1f}" '
            f'text-anchor="{"start" if i % 2 == 0 else "end"}" class="lbl">{escape(name)}</text></g>'
        )
    body.append(_legend([("plan", "#222"), ("alternative", "#4e79a7"), ("Pareto front", "#e15759")], L, 16))
    return _svg("scatter", width, height, body, "alternatives: step time vs memory")


# ------------------------------------------------------------------------------------------------ device mesh
def mesh_coords(rank: int, cfg: dict) -> dict[str, int]:
    """pp (outermost), dp, cp, tp (innermost) coordinates of a global rank; with expert parallelism the dp
    coordinate splits into edp (outer) and ep (inner, consecutive dp ranks: `costmodel.moe`)."""
    tp, cp, dp = int(cfg["tp"]), int(cfg.get("cp", 1)), int(cfg["dp"])
    out = {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}
    ep = int(cfg.get("ep", 1))
    if ep > 1:
        out |= {"ep": out["dp"] % ep, "edp": out["dp"] // ep}
    return out


#: the coordinates a group of each kind varies (the rest identify the group)
_VARIES = {"ep": ("ep",), "edp": ("edp",), "dp": ("dp", "ep", "edp"), "dp×cp": ("dp", "cp")}


def group_id(rank: int, kind: str, cfg: dict) -> int:
    """Which group of ``kind`` the rank belongs to (ranks sharing all other coordinates)."""
    c = mesh_coords(rank, cfg)
    varies = _VARIES.get(kind, (kind,))
    fixed = {k: v for k, v in c.items() if k not in varies and not (kind in ("ep", "edp") and k == "dp")}
    return sum(v * 100_000**i for i, (k, v) in enumerate(sorted(fixed.items())))


def mesh_svg(rep: dict, width: int = 1300) -> str:
    mesh, cfg = rep["mesh"], rep["config"]
    gpn, world = mesh["gpus_per_node"], mesh["world"]
    nodes = -(-world // gpn)
    kinds = [g for g in mesh["groups"] if g["size"] > 1] or [mesh["groups"][0]]
    cell = max(6, min(28, int((width - 40) / max(1, min(nodes, 16)) / (gpn + 1))))
    per_row = max(1, min(nodes, (width - 200) // (cell * (gpn + 1))))
    node_w = cell * gpn + cell
    rows = -(-nodes // per_row)
    panel_h = rows * (cell + 8) + 40
    body, y0 = [], 0
    for g in kinds:
        kind = g["kind"]
        ids: dict[int, int] = {}
        link = g["link"] or "link unknown"
        net = g["crosses_nodes"]
        body.append(
            f'<text x="10" y="{y0 + 16}" class="lbl"><tspan font-weight="bold">{kind} groups</tspan> of '
            f"{g['size']} (stride {g['stride']}) — {escape(link)}"
            f"{' (crosses nodes)' if net else ''}</text>"
        )
        body.append(f'<g class="mesh-{kind.replace("×", "x")}">')
        for rank in range(world):
            node, local = divmod(rank, gpn)
            gx = 10 + (node % per_row) * node_w + local * cell
            gy = y0 + 26 + (node // per_row) * (cell + 8)
            gid = ids.setdefault(group_id(rank, kind, cfg), len(ids))
            c = mesh_coords(rank, cfg)
            tip = f"rank {rank}, node {node}: " + ", ".join(f"{k} {v}" for k, v in c.items()) + f"; {kind} group {gid}"
            body.append(
                f'<rect class="rank" x="{gx}" y="{gy}" width="{cell - 1}" height="{cell - 1}" '
                f'fill="{GROUP_PALETTE[gid % len(GROUP_PALETTE)]}"><title>{tip}</title></rect>'
            )
        for node in range(nodes):
            gx = 10 + (node % per_row) * node_w - 2
            gy = y0 + 26 + (node // per_row) * (cell + 8) - 2
            body.append(
                f'<rect class="node" x="{gx}" y="{gy}" width="{cell * gpn + 3}" height="{cell + 3}" '
                f'fill="none" stroke="{"#c00" if net else "#333"}" stroke-width="1"/>'
            )
        body.append("</g>")
        y0 += panel_h
    body.append(
        f'<text x="10" y="{y0 + 4}" class="tick">each box is a node of {gpn}; each square a rank (order pp, dp, '
        f"cp, tp); squares of one colour form one group (colours repeat every {len(GROUP_PALETTE)} groups); "
        f"red node outlines: that group kind uses the network</text>"
    )
    return _svg("mesh", width, y0 + 14, body, "device mesh")
