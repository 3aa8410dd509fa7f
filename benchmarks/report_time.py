"""Time `autopar inspect` (terminal + HTML + JSON) for gpt3-175b on 1024 A100 and a small model on cpu-local.

The plans are built from the cost model (`tests.test_inspect.make_plan`; building them is not timed), saved to
a temporary folder, and each report is timed twice: in-process from `Plan.load` to the written HTML, and as the
whole command `autopar inspect PLAN --html …` in a fresh interpreter (what a user waits for). Target: ≤ 2 s each.

    python benchmarks/report_time.py
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.plan import Plan
from planner.report.facts import build_report
from planner.report.html import render_html
from planner.report.text import print_report
from tests.test_inspect import make_plan

CASES = {
    "gpt3-175b on 1024 A100 (dp=8,tp=8,pp=16,interleaved vpp=2)": lambda: make_plan(
        "gpt3-175b", "dgx-a100-80g:nodes=128",
        "dp=8,tp=8,pp=16,vpp=2,schedule=interleaved,mbs=1,ac=selective,zero=1,sp=on", 1536,
        alternatives=("dp=8,tp=8,pp=16,schedule=1f1b,mbs=1,ac=selective,zero=1,sp=on",
                      "dp=16,tp=8,pp=8,vpp=2,schedule=interleaved,mbs=1,ac=full,zero=1,sp=on",
                      "dp=4,tp=8,pp=32,schedule=1f1b,mbs=1,ac=selective,zero=1,sp=on")),
    "gpt-small on cpu-local (dp=2)": lambda: make_plan("gpt-small", "cpu-local", "dp=2,mbs=1", 8,
                                                       alternatives=("tp=2,mbs=1",)),
}


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="autopar-report-"))
    for name, build in CASES.items():
        path = out / (name.split()[0] + ".yaml")
        build().save(path)
        t0 = time.perf_counter()
        plan = Plan.load(path)
        rep = build_report(plan)
        print_report(rep, file=io.StringIO())
        html = render_html(plan, rep)
        (out / (path.stem + ".html")).write_text(html)
        json.dumps(rep, default=str)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner", "inspect", str(path), "--html", str(out / "cli.html")],
                       check=True, stdout=subprocess.DEVNULL)
        cli = time.perf_counter() - t1
        print(f"{name}: in-process {dt:.3f} s, command {cli:.3f} s (HTML {len(html) / 1e6:.2f} MB)  "
              f"{'ok' if max(dt, cli) <= 2 else 'SLOW'}")
    print(f"reports in {out}")


if __name__ == "__main__":
    main()
