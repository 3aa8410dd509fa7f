"""The HTML page of `autopar plan … --sweep KEY=v1,v2,… --html SWEEP.html`: predicted step time and MFU of the best
plan at each value, with the values where the best plan changes marked, and the winners in a table. One
self-contained file (inline CSS and SVG, no network), written atomically by the caller."""

from __future__ import annotations

import math
from html import escape

from planner.report.html import CSS, JS, _table

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _scale(lo: float, hi: float, a: float, b: float, log: bool):
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    span = (hi - lo) or 1.0

    def f(v: float) -> float:
        v = math.log10(v) if log else v
        return a + (v - lo) / span * (b - a)

    return f


def sweep_svg(d: dict, width: int = 900, height: int = 420) -> str:
    """Step time (left axis) of the best plan per value, one colour per distinct winner, changes marked."""
    pts = [p for p in d["points"] if not p["error"]]
    if not pts:
        return '<p id="sweep-empty">no value of the sweep has a plan that fits</p>'
    xs = [float(p["value"]) for p in pts]
    ys = [p["step_time_s"] for p in pts]
    log_x = min(xs) > 0 and max(xs) / min(xs) >= 20
    left, right, top, bottom = 80, width - 30, 30, height - 60
    sx = _scale(min(xs), max(xs), left, right, log_x) if len(set(xs)) > 1 else (lambda v: (left + right) / 2)
    y_hi = max(ys) * 1.1
    sy = _scale(0.0, y_hi, bottom, top, False)
    winners = list(dict.fromkeys(p["label"] for p in pts))
    colour = {w: _COLOURS[i % len(_COLOURS)] for i, w in enumerate(winners)}
    body = [f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>']
    for k in range(5):
        v = y_hi * k / 4
        body.append(f'<text class="tick" x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        body.append(f'<line x1="{left}" y1="{sy(v):.1f}" x2="{right}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for x in xs:
        body.append(f'<text class="tick" x="{sx(x):.1f}" y="{bottom + 16}" text-anchor="middle">{x:g}</text>')
    body.append(f'<text class="lbl" x="{(left + right) / 2}" y="{height - 20}" text-anchor="middle">'
                f'{escape(d["key"])}{" (log scale)" if log_x else ""}</text>')
    body.append(f'<text class="lbl" x="16" y="{(top + bottom) / 2}" transform="rotate(-90 16 {(top + bottom) / 2})" '
                'text-anchor="middle">predicted step time (s)</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(zip(xs, ys)))
    body.append(f'<path d="{path}" fill="none" stroke="#999" stroke-width="1.5"/>')
    for ch in d["changes"]:
        x = sx(float(ch["value"]))
        body.append(f'<line class="change" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#c00" '
                    f'stroke-dasharray="5,4"><title>best plan changes to {escape(ch["to"])}</title></line>')
    for p, x, y in zip(pts, xs, ys):
        body.append(f'<g class="pt"><circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="6" fill="{colour[p["label"]]}">'
                    f'<title>{escape(d["key"])}={x:g}: {y:.4g} s, MFU {p["mfu"]:.1%}, {escape(p["label"])}</title>'
                    '</circle></g>')
    for i, w in enumerate(winners):
        y = top + 4 + 16 * i
        body.append(f'<circle cx="{right - 300}" cy="{y}" r="5" fill="{colour[w]}"/>'
                    f'<text class="tick" x="{right - 290}" y="{y + 4}">{escape(w)}</text>')
    return (f'<svg id="sweep-plot" class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'role="img" aria-label="best plan per {escape(d["key"])}">{"".join(body)}</svg>')


def render_sweep_html(d: dict) -> str:
    rows = [[f"{float(p['value']):g}", "-" if p["error"] else f"{p['step_time_s']:.4g}",
             "-" if p["error"] else f"{p['mfu']:.1%}", p["error"] or p["label"]] for p in d["points"]]
    changes = "".join(f"<li>at {escape(d['key'])} = {float(c['value']):g}: {escape(c['from'])} → "
                      f"<b>{escape(c['to'])}</b></li>" for c in d["changes"]) or "<li>the best plan never changes</li>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>autopar sweep: {escape(d['model'])}</title>"
            f"<style>{CSS}</style><script>{JS}</script></head><body>"
            f"<h1>What-if: {escape(d['key'])} for {escape(d['model'])}</h1>"
            f"<div class='sub'>cluster <code>{escape(d['cluster'])}</code>; each value planned from scratch</div>"
            f"<pre id='errors'></pre><h2>Best plan per value</h2>{sweep_svg(d)}"
            f"<h2>Where the plan changes</h2><ul id='changes'>{changes}</ul>"
            + _table([d["key"], "step (s)", "MFU", "best plan"], rows, numeric=(0, 1, 2))
            + "</body></html>")
