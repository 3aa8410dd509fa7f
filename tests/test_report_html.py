"""`autopar inspect --html`: the page opens in a real browser (headless Chromium, Debian's `chromium` package)
from disk, without a network, with no console errors; the pictures are in the DOM and the plan's numbers on the
page; a screenshot is written next to it (look at it: /tmp/pytest-of-*/…/report-*.png)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from planner.cli.main import main
from planner.report.textui import human_time
from tests.test_inspect import compressed_plan, dp_plan, three_d_plan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: CI (`.ci/run`) sets AUTOPAR_REQUIRE_BROWSER=1: there a missing browser fails these tests instead of skipping them
REQUIRED = os.environ.get("AUTOPAR_REQUIRE_BROWSER") == "1"
needs_chromium = pytest.mark.skipif(CHROMIUM is None and not REQUIRED,
                                    reason="headless browser check needs Debian's chromium: apt-get install -y "
                                           "chromium (not installed here)")
FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--window-size=1400,2400"]


def _chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None, "AUTOPAR_REQUIRE_BROWSER=1 but no chromium here: apt-get install -y chromium"
    return subprocess.run([CHROMIUM, *FLAGS, "--enable-logging=stderr", "--v=0", *args], check=False,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", params=["dp", "3d", "compressed"])
def page(request, tmp_path_factory):
    plan = {"dp": dp_plan, "3d": three_d_plan, "compressed": compressed_plan}[request.param]()
    d = tmp_path_factory.mktemp(f"report-{request.param}")
    plan.save(d / "plan.yaml")
    html = d / f"report-{request.param}.html"
    assert main(["inspect", str(d / "plan.yaml"), "--html", str(html)]) == 0
    return plan, html


def test_html_is_self_contained(page):
    _, html = page
    text = html.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # no network fetches
    assert "<link" not in text and "@import" not in text
    for pic in ("timeline", "memory", "breakdown", "scatter", "mesh"):
        assert f'<svg id="{pic}"' in text


@needs_chromium
def test_html_renders_in_chromium(page):
    plan, html = page
    dom = _chromium("--dump-dom", f"file://{html}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    out, log = dom.stdout, dom.stderr
    assert 'data-ready="yes"' in out  # the page's script ran
    assert re.search(r'<pre id="errors">\s*</pre>', out), "window.onerror caught a script error"
    assert "Uncaught" not in log and "ERROR:CONSOLE" not in log, log[-2000:]
    # the pictures
    for pic in ("timeline", "memory", "breakdown", "scatter", "mesh"):
        assert re.search(rf'<svg id="{pic}"', out), pic
    assert out.count('class="op op-F"') == plan.grad_accum * plan.config.pp * plan.config.vpp
    assert out.count('class="rank"') >= plan.config.world  # one square per rank in each mesh panel
    assert 'class="capacity"' in out
    assert re.search(r'<g class="pt plan[^"]*">', out)
    if plan.alternatives:
        assert out.count('class="pt alt') == len(plan.alternatives)
    # the plan's numbers
    p = plan.predicted
    assert human_time(p["step_time_s"]) in out
    assert f"{p['mfu'] * 100:.1f} %" in out
    assert plan.fingerprint in out
    assert f"schedule={plan.config.schedule.value}" in out
    shot = html.with_suffix(".png")
    res = _chromium(f"--screenshot={shot}", f"file://{html}")
    assert res.returncode == 0 and shot.stat().st_size > 20_000, res.stderr[-2000:]


@needs_chromium
def test_broken_script_is_caught(tmp_path):
    """The check above would see a script error: a page with one shows it in #errors."""
    from planner.report import html as report_html

    bad = tmp_path / "bad.html"
    bad.write_text(f"<html><head><script>{report_html.JS}</script></head><body><pre id=errors></pre>"
                   "<script>undefinedFunction()</script></body></html>")
    out = _chromium("--dump-dom", f"file://{bad}").stdout
    assert "JS error: Uncaught ReferenceError" in out
