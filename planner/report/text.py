"""The terminal report of `autopar inspect`: rich tables and colour on a terminal, plain text otherwise."""

from __future__ import annotations

import sys

from planner.report.textui import human_bytes, human_count, human_time, render_table

CONFIG_ORDER = ("dp", "tp", "pp", "vpp", "schedule", "mbs", "ac", "zero", "sp", "grad_compress", "pp_compress",
                "precision", "cp", "ep")


def _pct(x) -> str:
    return "—" if x is None else f"{x * 100:.1f} %"


def _t(x) -> str:
    return "—" if x is None else human_time(x)


def _signed_time(x: float) -> str:
    return ("+" if x >= 0 else "−") + human_time(abs(x))


def _signed_bytes(x: float) -> str:
    return ("+" if x >= 0 else "−") + human_bytes(abs(x))


def config_text(cfg: dict) -> str:
    keys = [k for k in CONFIG_ORDER if k in cfg] + [k for k in cfg if k not in CONFIG_ORDER]
    return " ".join(f"{k}={cfg[k]}" for k in keys)


def short_config(cfg: dict) -> str:
    """The keys worth reading at a glance (degrees, schedule, micro-batch, sharding, recompute, compression)."""
    keys = ["dp", "tp", "pp", "mbs", "zero", "ac"]
    if int(cfg.get("vpp", 1) or 1) > 1:
        keys.insert(3, "vpp")
    if int(cfg.get("pp", 1) or 1) > 1:
        keys.insert(3, "schedule")
    for k, off in (("sp", "off"), ("grad_compress", "none"), ("pp_compress", "none"), ("precision", "bf16")):
        if str(cfg.get(k, off)) != off:
            keys.append(k)
    return ",".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


class _Out:
    """Headings and lines: coloured through rich on a terminal, plain otherwise."""

    def __init__(self, file) -> None:
        self.file = file
        self.tty = file.isatty()
        if self.tty:
            from rich.console import Console

            self.console = Console(file=file, highlight=False)

    def heading(self, text: str) -> None:
        if self.tty:
            self.console.print(f"\n[bold cyan]{text}[/]")
        else:
            print(f"\n{text}", file=self.file)

    def line(self, text: str, style: str = "") -> None:
        if self.tty:
            from rich.markup import escape

            self.console.print(f"[{style}]{escape(text)}[/]" if style else escape(text))
        else:
            print(text, file=self.file)


def print_report(rep: dict, file=None) -> None:
    file = file or sys.stdout
    out = _Out(file)
    p, mem = rep["predicted"], rep["memory"]
    out.line(f"plan for {rep['model']} on {rep['cluster']} ({rep['world']} ranks): seq {rep['seq']}, global batch "
             f"{rep['global_batch']} ({rep['micro_batches']} micro-batches of {rep['config'].get('mbs')} per "
             f"pipeline)", "bold")

    out.heading("configuration")
    out.line("  " + config_text(rep["config"]))

    out.heading("prediction")
    fits = p.get("fits")
    rows = [["step time", _t(p.get("step_time_s"))],
            ["tokens/s", human_count(p["tokens_per_s"]) if p.get("tokens_per_s") else "—"],
            ["MFU", _pct(p.get("mfu"))], ["HFU", _pct(p.get("hfu"))]]
    if p.get("tflops_per_gpu_model") is not None:
        rows.append(["TFLOP/s per GPU (model / hardware)",
                     f"{p['tflops_per_gpu_model']:.1f} / {p.get('tflops_per_gpu_hw') or 0:.1f}"])
    render_table("", ["quantity", "value"], rows, right=[False, True], file=file)

    out.heading(f"memory per GPU (peak rank): {human_bytes(mem['peak_bytes'])} of {human_bytes(mem['capacity_bytes'])}"
                f" ({_pct(mem['used_frac'])}){'' if fits is not False else ' — DOES NOT FIT'}")
    peak = mem["peak_bytes"] or 1.0
    render_table("", ["part", "bytes", "share"],
                 [[k, human_bytes(v), _pct(v / peak)] for k, v in mem["breakdown_bytes"].items()]
                 + [["peak", human_bytes(mem["peak_bytes"]), _pct(mem["used_frac"]) + " of device"]],
                 right=[False, True, True], file=file)

    if rep["stages"]:
        out.heading(f"stages ({len(rep['stages'])}; time per micro-batch, memory of the stage's rank)")
        render_table("", ["stage", "rank", "layers", "#", "time", "memory", "in-flight"],
                     [[s["index"], s["rank"], s["layers"], s["n_layers"], human_time(s["time_s"]),
                       human_bytes(s["memory_bytes"]), s["inflight"]] for s in rep["stages"]],
                     right=[True, True, False, True, True, True, True], file=file)

    out.heading("per-layer strategies (runs of identical layers)")
    render_table("", ["layers", "×", "stages", "TP layout", "AC", "sharding"],
                 [[r["name"], r["count"], _stages(r), r["tp_layout"], r["ac"], r["sharding"]]
                  for r in rep["layer_runs"]], right=[False, True, False, False, False, False], file=file)

    out.heading(f"step-time breakdown (step {_t(p.get('step_time_s'))})")
    render_table("", ["term", "time", "share", "exposed", "hidden", "note"],
                 [[b["term"], human_time(b["seconds"]), _pct(b["share"]), _t(b["exposed_s"]), _t(b["hidden_s"]),
                   b["note"]] for b in rep["breakdown"]],
                 right=[False, True, True, True, True, False], file=file)

    out.heading("alternatives")
    if rep["alternatives"]:
        render_table("", ["#", "configuration (differences)", "step", "Δ step", "peak mem", "Δ mem", "lost on"],
                     [[a["rank"], config_text(a["differs"]).replace(" ", ",") or "(same)", _t(a["step_time_s"]),
                       f"{_signed_time(a['delta_s'])} ({a['delta_frac'] * 100:+.1f} %)" if a["delta_frac"] is not None
                       else _signed_time(a["delta_s"]),
                       human_bytes(a["peak_bytes"]), _signed_bytes(a["delta_bytes"]), _lost(a)]
                      for a in rep["alternatives"]],
                     right=[True, False, True, True, True, True, False], file=file)
    else:
        out.line("  none stored (write them with `autopar plan … --top-k K`)")

    out.heading("solver")
    s = rep["solver"]
    if s:
        facts = []
        for k in ("status", "objective", "bound", "gap", "time_s", "candidates", "backend"):
            if k in s:
                facts.append(f"{k} {_fmt_solver(k, s[k])}")
        facts += [f"{k} {s[k]}" for k in s if k not in ("status", "objective", "bound", "gap", "time_s",
                                                          "candidates", "backend")]
        out.line("  " + "; ".join(facts))
    else:
        out.line("  no solver facts (plan not made by the search)")

    out.heading("traced (autopar check: the runtime on a fake world of this size)")
    tr = rep.get("traced") or {}
    if tr:
        verdict = "conforms" if tr.get("ok") else "DIVERGES"
        out.line(f"  {verdict}: worst peak-memory error {_pct(tr['memory_error_max'])}, collectives "
                 f"{_pct(tr['comm_error_max'])}, FLOPs {_pct(tr['flops_error_max'])} (traced at "
                 f"{tr.get('precision_traced', '?')})", "green" if tr.get("ok") else "bold yellow")
        rows = []
        for role in tr.get("roles", []):
            peak = role["peak_bytes"]
            rows.append([f"pp rank {role['stage']}", "peak memory", human_bytes(peak["predicted"]),
                         human_bytes(peak["traced"]) if peak["traced"] is not None else "(not traced)"])
            for kind, v in role["collective_bytes"].items():
                rows.append(["", kind, human_bytes(v["predicted"]), human_bytes(v["traced"])])
        render_table("", ["role", "term", "predicted", "traced"], rows, right=[False, False, True, True], file=file)
        for line in tr.get("unreduced_params", []):
            out.line(f"  ! not reduced: {line}", "bold yellow")
    else:
        out.line("  not checked: `autopar check PLAN.yaml --write` traces it and records the result here")

    mesh = rep["mesh"]
    out.heading(f"device mesh ({mesh['world']} ranks, {mesh['gpus_per_node']} per node; order pp, dp, cp, tp)")
    for g in mesh["groups"]:
        if g["size"] > 1:
            where = (f"{g['nodes']} node(s), {g['per_node']} per node, {g['link']}" if g["link"]
                     else "link unknown (cluster not loadable)")
            out.line(f"  {g['kind']} groups of {g['size']} (stride {g['stride']}): {where}")
    ex = rep.get("experts")
    if ex:
        share = f" ({ex['share']:.1%} of the step)" if ex["share"] is not None else ""
        skew = (f"the busiest expert at {ex['imbalance']:g}× the balanced load (the cluster's moe_imbalance)"
                if ex["imbalance"] is not None else "imbalance unknown (cluster not loadable)")
        out.line(f"  experts: ep={ex['ep']} (each rank holds 1/{ex['ep']} of every MoE layer's experts, reduced "
                 f"over {ex['edp']} rank(s) holding the same); all-to-alls {human_time(ex['all_to_all_s'])}"
                 f"{share}, not overlapped; {skew}")

    out.heading("warnings")
    if rep["warnings"]:
        for w in rep["warnings"]:
            out.line(f"  ! {w}", "bold yellow")
    else:
        out.line("  none", "green")


def _stages(r: dict) -> str:
    return str(r["stage_first"]) if r["stage_first"] == r["stage_last"] else f"{r['stage_first']}–{r['stage_last']}"


def _lost(a: dict) -> str:
    if not a["lost_by"]:
        return "—"
    return a["lost_by"] + (f" (+{human_time(a['lost_by_s'])})" if a["lost_by_s"] and a["lost_by_s"] > 0 else "")


def _fmt_solver(k: str, v) -> str:
    if isinstance(v, float):
        if k == "gap":
            return f"{v:.2%}"
        if k in ("time_s",):
            return human_time(v)
        return f"{v:.6g}"
    return str(v)
