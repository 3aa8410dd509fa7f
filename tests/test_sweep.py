"""What-if sweeps: parsing, plain data, and each value's winner is optimal for its value."""

from __future__ import annotations

import json

import pytest

from planner.cli.sweep import parse_sweep
from planner.search.sweep import check_optimal, sweep, with_inter_bandwidth

MODEL = "gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192"
CLUSTER = "dgx-a100-80g:nodes=2"


def test_parse_sweep():
    assert parse_sweep("inter_bw_GBps=1,2.5,25") == ("inter_bw_GBps", [1.0, 2.5, 25.0])
    assert parse_sweep("nodes=1,2") == ("nodes", [1, 2])
    with pytest.raises(ValueError, match="sweepable|KEY"):
        parse_sweep("bandwidth=1,2")
    with pytest.raises(ValueError, match="integer"):
        parse_sweep("nodes=1.5")


def test_inter_bandwidth_scales_link():
    from costmodel.cluster import load_cluster

    c = with_inter_bandwidth(load_cluster(CLUSTER), 5)
    assert c.inter.bandwidth == pytest.approx(5e9)
    assert c.intra == load_cluster(CLUSTER).intra


def test_bandwidth_sweep_winners_are_optimal_and_change():
    res = sweep(MODEL, CLUSTER, "inter_bw_GBps", [0.5, 5, 50], global_batch=64, time_limit=10)
    d = json.loads(json.dumps(res.to_dict()))
    assert [p["value"] for p in d["points"]] == [0.5, 5, 50]
    assert all(p["step_time_s"] > 0 for p in d["points"])
    times = [p.step_time_s for p in res.points]
    assert times == sorted(times, reverse=True)  # more bandwidth never hurts the best plan
    assert check_optimal(res, CLUSTER, time_limit=10) == []
    # and the winner changes: 0.5 GB/s between nodes keeps data parallelism inside them, 50 GB/s does not
    assert res.points[0].config != res.points[-1].config and res.changes
    assert res.points[0].config["dp"] < res.points[-1].config["dp"]


def test_sweep_html_plots_each_value_and_marks_changes(tmp_path):
    """`autopar plan … --sweep … --html` writes a self-contained page: one point per value, a dashed line where
    the best plan changes (slow network: compression on; fast: off), and the table of winners."""
    from planner.cli.main import main

    out = tmp_path / "sweep.html"
    rc = main(["plan", "gpt:layers=8,hidden=2048,heads=16,seq=1024,vocab=32000", "--cluster", CLUSTER,
               "--global-batch", "64", "--sweep", "inter_bw_GBps=0.2,5,100", "--html", str(out),
               "--time-limit", "20", "--compress", "lossy"])
    assert rc == 0
    html = out.read_text()
    assert 'id="sweep-plot"' in html and "http" not in html.replace("http-equiv", "")
    assert html.count('<g class="pt">') == 3
    assert html.count('class="change"') >= 1
    assert "grad=powersgd" in html or "grad=bf16" in html  # the slow end compresses its gradients


@pytest.mark.parametrize("flag", [["--profile", "prof.json"], ["--compile"], ["--baseline", "dp=2"],
                                  ["--emit", "train.py"], ["--check", "on"]])
def test_a_sweep_refuses_what_it_would_not_do(flag, tmp_path, capsys):
    """A sweep plans each value afresh and writes a table: a flag it does not honour is refused in one line (exit
    2), not dropped (it once ran on the roofline with a --profile that did not exist), and nothing is written."""
    from planner.cli.main import main

    out = tmp_path / "sweep.json"
    rc = main(["plan", "gpt-tiny", "--cluster", "cpu-local", "--sweep", "global_batch=8,16", "--out", str(out),
               *[str(tmp_path / f) if f.endswith((".json", ".py")) else f for f in flag]])
    err = capsys.readouterr().err
    assert rc == 2 and flag[0] in err and "--sweep" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_html_without_a_sweep_is_refused(tmp_path, capsys):
    from planner.cli.main import main

    rc = main(["plan", "gpt-tiny", "--cluster", "cpu-local", "--html", str(tmp_path / "x.html")])
    assert rc == 2 and "--sweep" in capsys.readouterr().err and not (tmp_path / "x.html").exists()
