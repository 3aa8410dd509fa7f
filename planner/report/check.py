"""The output of `autopar check`: predicted vs traced per rank role, term by term, for the terminal and as one
self-contained HTML page. Takes the dict `planner.check.conformance.check_plan` returns."""

from __future__ import annotations

import sys
from html import escape

from planner.report.textui import human_bytes, human_count, render_table


def _rows(role: dict) -> list[tuple[str, str, str, str, str]]:
    """(what, term, predicted, traced, error) for one role."""
    pred, got, err = role["predicted"], role["traced"], role["errors"]
    rows = [("memory", k, human_bytes(v), human_bytes(got["memory"][k]), f"{err['memory'][k]:.1%}")
            for k, v in pred["memory"].items()]
    traced_comm = {k: v["bytes"] for k, v in got["collectives"].items()}
    for k, e in err["collectives"].items():  # every kind predicted or traced (a kind not costed is off by 100 %)
        rows.append(("collective", k, human_bytes(pred["collectives"][k]) if k in pred["collectives"] else
                     "(not costed)", human_bytes(role["traced_equivalent"].get(k, 0.0)), f"{e:.1%}"))
    for k, v in sorted(traced_comm.items()):
        if k not in err["collectives"]:  # TP's all-gathers and reduce-scatters, compared as the all-reduce they make
            rows.append(("collective", k, "(as all_reduce_equivalent@tp)" if k.endswith("@tp") else "(not costed)",
                         human_bytes(v), ""))
    rows.append(("compute", "FLOPs", human_count(pred["flops"]), human_count(got["flops"]), f"{err['flops']:.1%}"))
    return rows


def _summary(result: dict) -> str:
    tol = result["tolerances"]
    verdict = "conforms" if result["ok"] else "DIVERGES"
    return (f"{verdict}: worst memory error {result['memory_error_max']:.1%} (≤ {tol['memory']:.0%}), collectives "
            f"{result['comm_error_max']:.1%} (≤ {tol['comm']:.0%}), FLOPs {result['flops_error_max']:.1%} "
            f"(≤ {tol['flops']:.0%}); traced at {result['precision_traced']} (the runtime's CPU path)"
            + (f"; {result['traced_how']}" if result.get("traced_how") else ""))


def print_check(result: dict, file=None) -> None:
    file = file or sys.stdout
    for role in result["roles"]:
        render_table(f"role {role['ranks']}: traced as rank {role['rank']}",
                     ["what", "term", "predicted", "traced", "error"], _rows(role),
                     right=[False, False, True, True, True], file=file)
        if role["traced"].get("peak_at"):
            print(f"traced peak: {role['traced']['peak_at']} (memory terms: each one's own maximum)",
                  file=file)
        print(file=file)
    for line in result["unreduced_params"]:
        print(f"NOT REDUCED: {line}", file=file)
    print(_summary(result), file=file)


def render_check_html(result: dict, title: str) -> str:
    parts = [f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title>",
             "<style>body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:nth-child(-n+2){text-align:left}"
             ".bad{color:#b00;font-weight:bold}</style>", f"<h1>{escape(title)}</h1>",
             f"<p class='{'' if result['ok'] else 'bad'}'>{escape(_summary(result))}</p>"]
    for line in result["unreduced_params"]:
        parts.append(f"<p class='bad'>not reduced: {escape(line)}</p>")
    for role in result["roles"]:
        parts.append(f"<h2>role {escape(role['ranks'])}</h2><table><tr><th>what</th><th>term</th><th>predicted"
                     "</th><th>traced</th><th>error</th></tr>")
        for row in _rows(role):
            parts.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    return "\n".join(parts) + "\n"
