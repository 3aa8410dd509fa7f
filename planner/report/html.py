"""The HTML report of `autopar inspect --html`: one self-contained file (inline CSS, SVG and a few lines of JS; no
network), with the pictures (`planner.report.timeline`, `planner.report.svg`) and the terminal report's tables."""

from __future__ import annotations

import json
from html import escape

from planner.report.svg import breakdown_svg, memory_svg, mesh_svg, scatter_svg
from planner.report.text import config_text, short_config
from planner.report.textui import human_bytes, human_count, human_time
from planner.report.timeline import timeline_svg

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px 32px;color:#222;max-width:1340px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#555;margin-bottom:14px} code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 16px;min-width:150px;background:#fcfcfc}
.card .v{font-size:22px;font-weight:600} .card .k{color:#666;font-size:12px;text-transform:uppercase}
.card.bad{border-color:#c00;background:#fff3f3}
table{border-collapse:collapse;margin:6px 0 10px} th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}
th{background:#f6f6f6;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff8e1;border-left:4px solid #f0a500;padding:6px 12px;margin:4px 0}
.ok{color:#2a7a2a} svg.chart{display:block;margin:6px 0;max-width:100%;height:auto}
svg .lbl{font-size:12px;fill:#333} svg .tick{font-size:11px;fill:#666}
svg .mb{font-size:10px;fill:#fff;text-anchor:middle}
svg .inbar{font-size:12px;fill:#fff;font-weight:600} svg .bubble{fill:url(#hatch)}
svg .op:hover rect{opacity:.75} svg .pt:hover circle{stroke:#000}
.row{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start} #errors{color:#c00}
.note{color:#666;font-size:12px}
"""

JS = """
window.__errors = [];
window.onerror = function (msg, src, line) {
  var e = document.getElementById('errors');
  if (e) { e.textContent += 'JS error: ' + msg + ' (line ' + line + ')\\n'; }
};
document.addEventListener('DOMContentLoaded', function () {
  document.body.setAttribute('data-ready', 'yes');
});
"""


def _table(headers, rows, numeric=()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=n' if i in numeric else ''}>{escape(str(c))}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pct(x) -> str:
    return "—" if x is None else f"{x * 100:.1f} %"


def _card(k, v, bad=False, id_=None) -> str:
    return (
        f'<div class="card{" bad" if bad else ""}"{f" id={id_}" if id_ else ""}><div class="k">{escape(k)}</div>'
        f'<div class="v">{escape(v)}</div></div>'
    )


def render_html(plan, rep: dict) -> str:
    p, mem, s = rep["predicted"], rep["memory"], rep["solver"]
    timeline, tl_facts = timeline_svg(plan)
    parts = [
        f"<h1>autopar plan: {escape(rep['model'])} on {escape(rep['cluster'])}</h1>",
        (
            f'<div class="sub">{rep["world"]} ranks · seq {rep["seq"]} · global batch {rep["global_batch"]} · '
            f"{rep['micro_batches']} micro-batches of {rep['config'].get('mbs')} per pipeline · fingerprint "
            f"<code>{escape(rep['fingerprint'])}</code></div>"
        ),
        f'<div id="config"><code>{escape(config_text(rep["config"]))}</code></div>',
        '<div class="cards">',
        _card("step time", human_time(p["step_time_s"]), id_="step-time"),
        _card("tokens/s", human_count(p["tokens_per_s"]) if p.get("tokens_per_s") else "—", id_="tokens"),
        _card("MFU", _pct(p.get("mfu")), id_="mfu"),
        _card("HFU", _pct(p.get("hfu")), id_="hfu"),
        _card(
            "memory / GPU",
            f"{human_bytes(mem['peak_bytes'])} of {human_bytes(mem['capacity_bytes'])}",
            bad=p.get("fits") is False or (mem["used_frac"] or 0) > 0.95,
            id_="mem",
        ),
        _card(
            "solver",
            f"{s.get('status', '—')}" + (f", gap {s['gap']:.1%}" if isinstance(s.get("gap"), (int, float)) else ""),
            id_="solver-card",
        ),
        "</div>",
    ]
    parts.append(
        '<section id="warnings"><h2>Warnings</h2>'
        + (
            "".join(f'<div class="warn">{escape(w)}</div>' for w in rep["warnings"])
            if rep["warnings"]
            else '<div class="ok">none</div>'
        )
        + "</section>"
    )
    parts.append(
        "<section><h2>Pipeline schedule (one step)</h2>"
        + timeline
        + '<div class="note">Stage times from the plan; each stage\'s time split into forward, recompute, '
        "backward and communication by the step breakdown's shares. Hover a block for its micro-batch."
        "</div></section>"
    )
    parts.append(
        "<section><h2>Step-time breakdown</h2>"
        + breakdown_svg(rep)
        + _table(
            ["term", "time", "share", "exposed", "hidden", "note"],
            [
                [
                    b["term"],
                    human_time(b["seconds"]),
                    _pct(b["share"]),
                    _t(b["exposed_s"]),
                    _t(b["hidden_s"]),
                    b["note"],
                ]
                for b in rep["breakdown"]
            ],
            numeric=(1, 2, 3, 4),
        )
        + "</section>"
    )
    parts.append(
        "<section><h2>Memory per pipeline rank</h2>"
        + memory_svg(rep)
        + _table(
            ["part", "bytes (peak rank)"],
            [[k, human_bytes(v)] for k, v in mem["breakdown_bytes"].items()]
            + [["peak", f"{human_bytes(mem['peak_bytes'])} ({_pct(mem['used_frac'])} of device)"]],
            numeric=(1,),
        )
        + "</section>"
    )
    if rep["stages"]:
        parts.append(
            "<section><h2>Stages</h2>"
            + _table(
                ["stage", "rank", "layers", "#", "time / micro-batch", "memory (rank)", "in-flight"],
                [
                    [
                        x["index"],
                        x["rank"],
                        x["layers"],
                        x["n_layers"],
                        human_time(x["time_s"]),
                        human_bytes(x["memory_bytes"]),
                        x["inflight"],
                    ]
                    for x in rep["stages"]
                ],
                numeric=(0, 1, 3, 4, 5, 6),
            )
            + "</section>"
        )
    parts.append(
        "<section><h2>Per-layer strategies</h2>"
        + _table(
            ["layers", "×", "stages", "TP layout", "AC", "sharding"],
            [
                [
                    r["name"],
                    r["count"],
                    f"{r['stage_first']}" + (f"–{r['stage_last']}" if r["stage_last"] != r["stage_first"] else ""),
                    r["tp_layout"],
                    r["ac"],
                    r["sharding"],
                ]
                for r in rep["layer_runs"]
            ],
            numeric=(1,),
        )
        + "</section>"
    )
    alt_rows = [
        [
            a["rank"],
            config_text(a["differs"]) or "(same)",
            human_time(a["step_time_s"]),
            (f"+{human_time(a['delta_s'])}" if a["delta_s"] >= 0 else f"−{human_time(-a['delta_s'])}")
            + (f" ({a['delta_frac'] * 100:+.1f} %)" if a["delta_frac"] is not None else ""),
            human_bytes(a["peak_bytes"]),
            a["lost_by"] or "—",
        ]
        for a in rep["alternatives"]
    ]
    parts.append(
        '<section><h2>Alternatives</h2><div class="row">'
        + scatter_svg(rep)
        + "<div>"
        + (
            _table(
                ["#", "differs from the plan", "step", "Δ step", "peak memory", "lost on"],
                alt_rows,
                numeric=(0, 2, 3, 4),
            )
            if alt_rows
            else "<p>none stored (<code>autopar plan … --top-k K</code>)</p>"
        )
        + "</div></div></section>"
    )
    ex = rep.get("experts")
    experts = ""
    if ex:
        share = f" ({ex['share']:.1%} of the step)" if ex["share"] is not None else ""
        skew = f"{ex['imbalance']:g}× the balanced load" if ex["imbalance"] is not None else "unknown"
        experts = (f"<p>Expert parallelism: ep={ex['ep']}, experts reduced over {ex['edp']} rank(s) holding the same; "
                   f"all-to-alls {ex['all_to_all_s']:.3g} s{escape(share)}, not overlapped; busiest expert {skew} "
                   "(the cluster's <code>moe_imbalance</code>).</p>")
    parts.append("<section><h2>Device mesh</h2>" + mesh_svg(rep) + experts + "</section>")
    parts.append(
        '<section id="solver"><h2>Solver</h2>'
        + (_table(["fact", "value"], [[k, _fmt(v)] for k, v in s.items()]) if s else "<p>no solver facts</p>")
        + "</section>"
    )
    data = json.dumps({k: rep[k] for k in ("predicted", "config", "memory")}, default=str).replace("</", "<\\/")
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>autopar plan: {escape(rep['model'])} on {escape(rep['cluster'])} "
        f"({escape(short_config(rep['config']))})</title><style>{CSS}</style><script>{JS}</script></head><body>"
        '<pre id="errors"></pre>' + "\n".join(parts) + f'<script type="application/json" id="plan-data">{data}</script>'
        f'<p class="note">autopar {escape(str(rep["provenance"].get("autopar_version", "")))} · '
        f"pipeline simulated {human_time(tl_facts.get('pipeline_s', 0.0))}</p></body></html>\n"
    )


def _t(x) -> str:
    return "—" if x is None else human_time(x)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)
