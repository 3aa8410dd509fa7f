"""The pipeline schedule of one step, as an SVG timeline for the HTML report.

Each pipeline rank runs its operations in the order its schedule prescribes (`rank_orders`: GPipe, 1F1B,
Megatron's interleaved 1F1B, zero-bubble ZB-H1); an operation starts when its rank is free and its input is ready
(the forward of the previous stage, the backward of the next). `simulate` replays that with the plan's per-stage
times, so the fill and drain bubbles appear where the schedule leaves them. A stage's time per micro-batch is
split into forward (⅓ of compute), recomputation and backward (⅔ of compute), and communication (TP collectives
and the boundary transfer, half in each direction) by the shares of the plan's step-time breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from planner.report.textui import human_time

MAX_DRAWN_OPS = 40_000  #: above this many operations the timeline is not drawn (a note says so)
COLOURS = {"F": "#4e79a7", "B": "#59a14f", "W": "#8cd17d", "R": "#f28e2b", "C": "#b07aa1", "T": "#9c9c9c"}
LABELS = {"F": "forward", "B": "backward", "W": "weight gradient (zero-bubble)", "R": "recompute",
          "C": "communication (tp + p2p)", "T": "dp reduction + optimizer"}


@dataclass(frozen=True)
class Op:
    kind: str  #: F forward, B backward (input gradient, and weight gradient unless split), W weight gradient
    mb: int  #: micro-batch
    stage: int  #: virtual stage


def rank_orders(schedule: str, p: int, v: int, m: int) -> list[list[Op]]:
    """Per pipeline rank, its operations in schedule order. Virtual stage c = chunk·p + rank."""
    orders = []
    for r in range(p):
        if schedule == "gpipe":
            ops = [Op("F", i, r) for i in range(m)] + [Op("B", i, r) for i in range(m)]
        elif schedule == "interleaved" and v > 1:
            ops = _interleaved(r, p, v, m)
        else:
            ops = _one_f_one_b(r, p, m, split=schedule == "zb")
        orders.append(ops)
    return orders


def _one_f_one_b(r: int, p: int, m: int, *, split: bool) -> list[Op]:
    warm = min(p - r - 1, m)
    ops = [Op("F", i, r) for i in range(warm)]
    deferred = []
    for i in range(m - warm):
        ops.append(Op("F", warm + i, r))
        ops.append(Op("B", i, r))
        if split:  # ZB-H1: the first p−r−1 weight gradients wait, to fill the drain bubble
            (deferred if i < p - r - 1 else ops).append(Op("W", i, r))
    for i in range(m - warm, m):
        ops.append(Op("B", i, r))
        if split:
            ops.append(Op("W", i, r))
            if deferred:
                ops.append(deferred.pop(0))
    return ops + deferred


def _interleaved(r: int, p: int, v: int, m: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021 §2.2.2): micro-batches in groups of p, each group
    through chunk 0, 1, …, v−1 forward and v−1, …, 0 backward; (p − r − 1)·2 + (v − 1)·p warm-up forwards."""
    fwd, bwd = [], []
    for g0 in range(0, m, p):
        group = range(g0, min(g0 + p, m))
        for chunk in range(v):
            fwd += [Op("F", i, chunk * p + r) for i in group]
            bwd += [Op("B", i, (v - 1 - chunk) * p + r) for i in group]
    warm = min((p - r - 1) * 2 + (v - 1) * p, len(fwd))
    ops = fwd[:warm]
    for k in range(warm, len(fwd)):
        ops += [fwd[k], bwd[k - warm]]
    return ops + bwd[len(fwd) - warm:]


def simulate(orders: list[list[Op]], dur: dict[tuple[str, int], float], n_stages: int) -> dict[Op, tuple[float, float]]:
    """Start and end of every operation; raises ValueError if the orders deadlock."""
    p = len(orders)
    done: dict[Op, tuple[float, float]] = {}
    pos, free = [0] * p, [0.0] * p
    total = sum(len(o) for o in orders)
    while len(done) < total:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                dep = _dep(op, n_stages)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep][1] if dep is not None else 0.0)
                end = start + dur[(op.kind, op.stage)]
                done[op], free[r], pos[r], progress = (start, end), end, pos[r] + 1, True
        if not progress:
            raise ValueError("the schedule's operation orders deadlock for these stages and micro-batches")
    return done


def _dep(op: Op, n_stages: int) -> Op | None:
    if op.kind == "F":
        return Op("F", op.mb, op.stage - 1) if op.stage > 0 else None
    if op.kind == "W":
        return Op("B", op.mb, op.stage)
    return Op("B", op.mb, op.stage + 1) if op.stage < n_stages - 1 else Op("F", op.mb, op.stage)


def stage_parts(plan) -> dict[int, dict[str, float]]:
    """Per virtual stage: forward, backward, recompute and communication seconds of one micro-batch."""
    bd = plan.predicted.get("breakdown_s") or {}
    comp, rec = float(bd.get("compute", 0.0)), float(bd.get("recompute", 0.0))
    comm = sum(float(bd.get(k, 0.0)) for k in ("tp_comm", "pp_comm", "cp_comm", "ep_comm"))
    tot = comp + rec + comm or 1.0
    out = {}
    for s in plan.stages:
        t = s.time_s
        out[s.index] = {"F": t * comp / tot / 3, "B": t * comp / tot * 2 / 3, "R": t * rec / tot,
                        "C": t * comm / tot / 2}
    return out


def timeline_svg(plan, width: int = 1300) -> tuple[str, dict]:
    """The SVG and the facts it shows (simulated pipeline time, bubble share)."""
    cfg = plan.config
    p, v, m = cfg.pp, cfg.vpp if cfg.pp > 1 else 1, plan.grad_accum
    n_stages = p * v
    sched = cfg.schedule.value if p > 1 else "1f1b"
    parts = stage_parts(plan)
    if len(parts) != n_stages:
        return _note_svg("no per-stage times in the plan: timeline not drawn"), {}
    if 2 * m * n_stages > MAX_DRAWN_OPS:
        return _note_svg(f"{2 * m * n_stages} operations: too many to draw"), {}
    split = sched == "zb"
    dur = {}
    for c, q in parts.items():
        back = q["R"] + q["B"] + q["C"]
        dur[("F", c)] = q["F"] + q["C"]
        dur[("B", c)] = back / 2 if split else back
        dur[("W", c)] = back / 2
    orders = rank_orders(sched, p, v, m)
    times = simulate(orders, dur, n_stages)
    bd = plan.predicted.get("breakdown_s") or {}
    tail = sum(float(bd.get(k, 0.0)) for k in ("dp_comm_exposed", "optimizer", "compression"))
    pipe = max(e for _, e in times.values())
    span = pipe + tail or 1.0
    left, row_h, top = 90, 26, 28
    x = lambda t: left + (width - left - 20) * t / span
    busy = sum(dur[(op.kind, op.stage)] for o in orders for op in o)
    facts = {"schedule": sched, "micro_batches": m, "pipeline_s": pipe, "tail_s": tail,
             "bubble_frac": 1 - busy / (p * pipe) if pipe else 0.0}
    h = top + p * row_h + 60
    out = [(f'<svg id="timeline" class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
            f'viewBox="0 0 {width} {h}" role="img" aria-label="pipeline schedule">')]
    titles = len(times) <= 3000
    for r in range(p):
        y = top + r * row_h
        out.append(f'<rect class="bubble" x="{left}" y="{y}" width="{x(pipe) - left:.2f}" height="{row_h - 6}"/>')
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2}" text-anchor="end" class="lbl">rank {r}</text>')
        for op in orders[r]:
            s, e = times[op]
            q = parts[op.stage]
            if op.kind == "F":
                segs = [("F", q["F"]), ("C", q["C"])]
            elif op.kind == "W":
                segs = [("W", e - s)]
            else:
                segs = [("R", q["R"]), ("B", q["B"]), ("C", q["C"])]
                if split:
                    segs = [(k, d / 2) for k, d in segs]
            t0 = s
            tip = (f"<title>{LABELS[op.kind]} micro-batch {op.mb}, stage {op.stage}: {human_time(s)} – "
                   f"{human_time(e)}</title>") if titles else ""
            out.append(f'<g class="op op-{op.kind}">{tip}')
            for k, d in segs:
                if d > 0:
                    out.append(f'<rect x="{x(t0):.2f}" y="{y}" width="{max(x(t0 + d) - x(t0), 0.3):.2f}" '
                               f'height="{row_h - 6}" fill="{COLOURS[k]}"/>')
                t0 += d
            out.append("</g>")
            if x(e) - x(s) > 14 and op.kind in ("F", "B"):
                out.append(f'<text x="{(x(s) + x(e)) / 2:.1f}" y="{y + row_h / 2 + 1}" class="mb">{op.mb}</text>')
        end = max((times[o][1] for o in orders[r]), default=0.0)
        if tail > 0:
            out.append(f'<rect x="{x(end):.2f}" y="{y}" width="{x(end + tail) - x(end):.2f}" height="{row_h - 6}" '
                       f'fill="{COLOURS["T"]}"><title>exposed dp reduction + optimizer: {human_time(tail)}</title>'
                       f'</rect>')
    y = top + p * row_h + 8
    out.append(_axis(x, span, y, left, width))
    out.append(_legend([(LABELS[k], COLOURS[k]) for k in ("F", "R", "B") + (("W",) if split else ()) + ("C", "T")]
                       + [("idle (bubble)", "url(#hatch)")], left, y + 30))
    out.insert(1, '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
                  'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
                  '<line x1="0" y1="0" x2="0" y2="6" stroke="#d0d0d0" stroke-width="2"/></pattern></defs>')
    out.append(f'<text x="{left}" y="16" class="lbl">{escape(sched)} schedule, {p} rank(s) × {v} virtual stage(s), '
               f'{m} micro-batches; pipeline {human_time(pipe)}, idle {facts["bubble_frac"]:.0%} of rank time</text>')
    out.append("</svg>")
    return "\n".join(out), facts


def _axis(x, span: float, y: float, left: int, width: int) -> str:
    out = [f'<line x1="{left}" y1="{y}" x2="{width - 20}" y2="{y}" stroke="#888"/>']
    for i in range(6):
        t = span * i / 5
        out.append(f'<line x1="{x(t):.1f}" y1="{y}" x2="{x(t):.1f}" y2="{y + 4}" stroke="#888"/>'
                   f'<text x="{x(t):.1f}" y="{y + 16}" text-anchor="{"end" if i == 5 else "middle"}" class="tick">'
                   f'{human_time(t)}</text>')
    return "".join(out)


def _legend(items: list[tuple[str, str]], x0: float, y: float) -> str:
    out, x = [], x0
    for label, colour in items:
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}" stroke="#999" '
                   f'stroke-width="0.5"/><text x="{x + 16}" y="{y}" class="lbl">{escape(label)}</text>')
        x += 26 + 7 * len(label)
    return f'<g class="legend">{"".join(out)}</g>'


def _note_svg(text: str) -> str:
    return (f'<svg id="timeline" class="chart" xmlns="http://www.w3.org/2000/svg" width="800" height="30">'
            f'<text x="10" y="20" class="lbl">{escape(text)}</text></svg>')
