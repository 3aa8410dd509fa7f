"""Collective time model: closed forms, published bus bandwidths, monotonicity, and a real gloo fit."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from costmodel.cluster import COLLECTIVE_KINDS, Cluster, GroupSpan, Link, SizeCurve, group_span, load_cluster
from costmodel.collectives import (
    Collective,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    broadcast_time,
    bus_bandwidth,
    collective_time,
    reduce_scatter_time,
    send_recv_time,
)

MB = 1e6
GB = 1e9


def _span(size: int, nodes: int = 1) -> GroupSpan:
    return GroupSpan(size=size, nodes=nodes, per_node=size // nodes)


@pytest.fixture
def a100x2() -> Cluster:
    return load_cluster("dgx-a100-80g:nodes=2")


def test_enum_matches_link_kinds():
    assert tuple(c.value for c in Collective) == COLLECTIVE_KINDS


# --- closed forms ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_intra_node_closed_forms(a100x2, n):
    S, B, a = 256 * MB, a100x2.intra.bandwidth, a100x2.intra.latency
    span = _span(n)
    assert all_reduce_time(S, span, a100x2) == pytest.approx(2 * (n - 1) / n * S / B + 2 * (n - 1) * a)
    assert all_gather_time(S, span, a100x2) == pytest.approx((n - 1) / n * S / B + (n - 1) * a)
    assert reduce_scatter_time(S, span, a100x2) == pytest.approx((n - 1) / n * S / B + (n - 1) * a)
    assert all_to_all_time(S, span, a100x2) == pytest.approx((n - 1) / n * S / B + (n - 1) * a)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_broadcast_closed_form(a100x2, n):
    """nccl-tests' broadcast: busbw = algbw, S/B + (n−1)·α; each call pays the call latency."""
    S, B, a = 256 * MB, a100x2.intra.bandwidth, a100x2.intra.latency
    assert broadcast_time(S, _span(n), a100x2) == pytest.approx(S / B + (n - 1) * a)
    lat = 1e-3
    slow = replace(a100x2, intra=replace(a100x2.intra, call_latency=lat))
    ring = 7 * broadcast_time(S / 7, _span(n), a100x2)
    assert broadcast_time(S, _span(n), slow, calls=7) == pytest.approx(ring + 7 * lat)


def test_all_reduce_is_reduce_scatter_plus_all_gather(a100x2):
    S, span = 1e9, _span(8)
    assert all_reduce_time(S, span, a100x2) == pytest.approx(
        reduce_scatter_time(S, span, a100x2) + all_gather_time(S, span, a100x2))


def test_send_recv_closed_form(a100x2):
    S = 64 * MB
    assert send_recv_time(S, False, a100x2) == pytest.approx(S / 230e9 + a100x2.intra.latency)
    assert send_recv_time(S, True, a100x2) == pytest.approx(S / 24e9 + a100x2.inter.latency)


def test_cross_node_closed_form(a100x2):
    # 16 ranks, 8 per node: ring busbw = min(230, 8·24) = 192 GB/s, each step pays the IB latency.
    S, n = 1e9, 16
    expected = 2 * (n - 1) / n * S / 192e9 + 2 * (n - 1) * a100x2.inter.latency
    assert all_reduce_time(S, group_span(a100x2, 16, 1), a100x2) == pytest.approx(expected)


@pytest.mark.parametrize("kind", list(Collective))
def test_size_one_and_zero_bytes_are_free(a100x2, kind):
    assert collective_time(kind, 1e9, _span(1), a100x2) == 0.0
    assert collective_time(kind, 0, _span(8), a100x2) == 0.0


def test_dispatcher_matches_functions(a100x2):
    S, span = 3e8, group_span(a100x2, 16, 1)
    assert collective_time("all_reduce", S, span, a100x2) == all_reduce_time(S, span, a100x2)
    assert collective_time(Collective.ALL_GATHER, S, span, a100x2) == all_gather_time(S, span, a100x2)
    assert collective_time(Collective.REDUCE_SCATTER, S, span, a100x2) == reduce_scatter_time(S, span, a100x2)
    assert collective_time(Collective.ALL_TO_ALL, S, span, a100x2) == all_to_all_time(S, span, a100x2)
    assert collective_time(Collective.SEND_RECV, S, group_span(a100x2, 2, 8), a100x2) == send_recv_time(
        S, True, a100x2)
    assert collective_time("broadcast", S, span, a100x2) == broadcast_time(S, span, a100x2)
    with pytest.raises(ValueError):
        collective_time("gather", S, span, a100x2)


def test_negative_bytes_and_oversized_groups_are_rejected(a100x2):
    with pytest.raises(ValueError, match="must be >= 0 bytes, got -1"):
        all_reduce_time(-1, _span(8), a100x2)
    with pytest.raises(ValueError, match="does not fit"):
        all_reduce_time(1e6, GroupSpan(size=32, nodes=4, per_node=8), a100x2)


def test_per_kind_override_and_size_curve():
    # all_reduce 2× faster at ≤ 1 MiB, as fast as the link at ≥ 4 MiB; time per byte interpolated in log2(size)
    curve = SizeCurve(sizes=(2**20, 4 * 2**20), factors=(2.0, 1.0))
    link = Link(name="l", bandwidth=2e9, latency=1e-4, bandwidth_by_kind={"all_gather": 1e9},
                curve_by_kind={"all_reduce": curve})
    c = replace(load_cluster("dgx-h100"), intra=link)
    span = _span(2)
    assert all_gather_time(4e6, span, c) == pytest.approx(0.5 * 4e6 / 1e9 + 1e-4)
    assert all_reduce_time(8 * 2**20, span, c) == pytest.approx(8 * 2**20 / 2e9 + 2e-4)
    assert all_reduce_time(2**19, span, c) == pytest.approx(2**19 / 4e9 + 2e-4)
    # 2 MiB is halfway (in log2) between the knots: time per byte halfway between 1/(2·B) and 1/B
    assert all_reduce_time(2 * 2**20, span, c) == pytest.approx(2 * 2**20 * 0.75 / 2e9 + 2e-4)
    # the curve at its fastest bounds every size from below (what the search's convexity bounds use)
    fast = replace(c, intra=link.without_curves())
    for nbytes in (1e3, 2**20, 3e6, 1e8):
        assert all_reduce_time(nbytes, span, fast) <= all_reduce_time(nbytes, span, c)
        assert all_gather_time(nbytes, span, fast) == all_gather_time(nbytes, span, c)


def test_size_curve_rejects_bad_knots():
    with pytest.raises(ValueError, match="strictly increasing"):
        SizeCurve(sizes=(2.0, 1.0), factors=(1.0, 1.0))
    with pytest.raises(ValueError, match="as many factors as sizes"):
        SizeCurve(sizes=(1.0,), factors=(1.0, 2.0))
    with pytest.raises(ValueError, match="factors must be > 0"):
        SizeCurve(sizes=(1.0,), factors=(0.0,))


# --- published bus bandwidths ----------------------------------------------------------------------------------


def _busbw_from_time(cluster: Cluster, span: GroupSpan, nbytes: float) -> float:
    """nccl-tests: algbw = S / t, busbw = algbw · 2(n−1)/n for all_reduce."""
    n = span.size
    return nbytes / all_reduce_time(nbytes, span, cluster) * 2 * (n - 1) / n


def test_dgx_a100_two_nodes_reproduce_192_GBps(a100x2):
    # AddyLaddy, NVIDIA/nccl#812: DGX-A100 with 8×200 Gb/s IB per node, "we measure 192GB/s AllReduce BusBW".
    span = group_span(a100x2, 16, 1)
    assert bus_bandwidth(Collective.ALL_REDUCE, span, a100x2) == pytest.approx(192e9)
    assert _busbw_from_time(a100x2, span, 8e9) == pytest.approx(192e9, rel=0.01)


def test_one_nic_per_node_reproduces_24_GBps(a100x2):
    # sjeaugey, NVIDIA/nccl#412: one HDR NIC per node -> ~24 GB/s inter-node busbw. Per GPU that is 24/8 GB/s.
    one_nic = replace(a100x2, inter=replace(a100x2.inter, bandwidth=24e9 / 8))
    span = group_span(one_nic, 16, 1)
    assert bus_bandwidth(Collective.ALL_REDUCE, span, one_nic) == pytest.approx(24e9)
    assert _busbw_from_time(one_nic, span, 8e9) == pytest.approx(24e9, rel=0.01)


def test_intra_node_reproduces_nvlink_busbw():
    # sjeaugey, nccl-tests#149 (~230 GB/s, A100) and #212 (~370 GB/s ring, H100).
    for name, busbw in (("dgx-a100-80g", 230e9), ("dgx-h100", 370e9)):
        c = load_cluster(name)
        assert _busbw_from_time(c, _span(8), 8e9) == pytest.approx(busbw, rel=0.01)


# --- monotonicity ----------------------------------------------------------------------------------------------

SIZES = (1e3, 1e6, 64e6, 1e9)
SPANS = ((2, 1), (8, 1), (16, 2), (32, 4), (4, 4))


def _all_times(cluster: Cluster, nbytes: float, size: int, nodes: int) -> list[float]:
    span = GroupSpan(size=size, nodes=nodes, per_node=size // nodes)
    return [collective_time(k, nbytes, span, cluster) for k in Collective]


@pytest.mark.parametrize("size, nodes", SPANS)
def test_more_bytes_never_faster(size, nodes):
    c = load_cluster("dgx-h100:nodes=4")
    for small, big in zip(SIZES, SIZES[1:]):
        for t_small, t_big in zip(_all_times(c, small, size, nodes), _all_times(c, big, size, nodes)):
            assert t_small <= t_big


@pytest.mark.parametrize("size, nodes", SPANS)
@pytest.mark.parametrize("which", ["intra", "inter"])
def test_more_bandwidth_never_slower(size, nodes, which):
    c = load_cluster("dgx-a100-80g:nodes=4")
    faster = replace(c, **{which: replace(getattr(c, which), bandwidth=getattr(c, which).bandwidth * 2)})
    for nbytes in SIZES:
        for t_slow, t_fast in zip(_all_times(c, nbytes, size, nodes), _all_times(faster, nbytes, size, nodes)):
            assert t_fast <= t_slow


@pytest.mark.parametrize("preset", ["dgx-a100-80g", "dgx-h100"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_crossing_nodes_never_faster(preset, size):
    c = load_cluster(f"{preset}:nodes=8")
    inside = GroupSpan(size=size, nodes=1, per_node=size)
    for nodes in (2, size):
        across = GroupSpan(size=size, nodes=nodes, per_node=size // nodes)
        for kind in Collective:
            for nbytes in SIZES:
                assert collective_time(kind, nbytes, across, c) >= collective_time(kind, nbytes, inside, c)


# --- a real gloo measurement and fit -----------------------------------------------------------------------------


@pytest.mark.dist
def test_gloo_fit_reproduces_its_measurements():
    """Two forked gloo ranks, a few sizes, three launches: the fit reproduces what it was fitted on (its curve has a
    knot at every bandwidth-bound size, so those within 1 %; the latency-bound 64 KiB within a factor of 2) and the
    figures are sane.

    Whether a fit predicts a *new* measurement is a timing target, so it is not asserted here: the tests share a
    2-core machine with other work (pytest-xdist runs another test file on the other core), where a re-measurement in
    fresh processes read up to 3.6× apart at 64 KiB and 2.05× at a 4 MiB all-reduce (CI, 2026-12-04) although the
    fit was right. `python -m costmodel.gloo_bench --check` measures it (the 20 % acceptance) on a quiet machine.
    """
    from costmodel.gloo_bench import QUANTILE, _statistic, fit_kind, link_from_fits, measure_samples, predict

    MiB = 2**20
    sizes = (64 * 2**10, MiB, 4 * MiB, 16 * MiB)
    kinds = (Collective.ALL_REDUCE, Collective.ALL_GATHER)
    samples = measure_samples([(k, n) for k in kinds for n in sizes], ranks=2, rounds=2, launches=3)
    times = {kind: {n: _statistic(ts, QUANTILE) for n, ts in by.items()} for kind, by in samples.items()}
    fits = {k: fit_kind(k, times[k.value], 2) for k in kinds}
    link = link_from_fits(fits, "test")
    for kind in kinds:
        fit = fits[kind]
        assert 1e7 < fit.bandwidth < 1e12 and 0 <= fit.latency < 1e-2  # 10 MB/s … 1 TB/s, α under 10 ms
        assert fit.curve is not None and fit.curve.sizes[-1] == 16 * MiB
        for nbytes in sizes:
            ratio = predict(kind, nbytes, 2, link) / times[kind.value][nbytes]
            assert ratio == pytest.approx(1.0, rel=0.01) if nbytes in fit.curve.sizes else 0.5 < ratio < 2, ratio


def test_gloo_refine_localises_a_sharp_step(monkeypatch):
    """``gloo_bench.refine`` bisects (in log size) between neighbours whose time per byte differs by more than STEP,
    measuring each new size among its kind's grid; on a synthetic step at 24 MiB (0.3 → 0.75 ms/MiB), three passes
    leave knots within an eighth of an octave on both sides, and a gentle slope (1.3× per octave) gets none."""
    from costmodel import gloo_bench as gb

    MiB = 2**20

    def per_mib(kind, n):
        if kind == "all_gather":
            return 0.3e-3 if n < 24 * MiB else 0.75e-3
        return 0.3e-3 * (n / MiB) ** math.log2(1.3)  # all_reduce: 1.3× per octave, never a 50 % step

    requested = []

    def fake_samples(points, ranks, rounds, launches):
        requested.append(points)
        out = {}
        for kind, n in points:
            out.setdefault(kind.value, {})[n] = [[per_mib(kind.value, n) * n / MiB]] * launches
        return out

    monkeypatch.setattr(gb, "measure_samples", fake_samples)
    times = {k: {n: per_mib(k, n) * n / MiB for n in gb.SIZES} for k in ("all_gather", "all_reduce")}
    added = gb.refine(times, launches=2)
    assert added and {k for k, _ in added} == {"all_gather"}
    for points in requested:  # every new size measured among its kind's whole grid
        assert set(gb.SIZES) <= {n for _, n in points}
    sizes = sorted(times["all_gather"])
    below = max(n for n in sizes if n < 24 * MiB)
    above = min(n for n in sizes if n >= 24 * MiB)
    assert math.log2(above / below) <= 1 / 8 + 1e-3, (below / MiB, above / MiB)
    fit = gb.fit_kind(gb.Collective.ALL_GATHER, times["all_gather"], 2)
    link = gb.link_from_fits({gb.Collective.ALL_GATHER: fit}, "test")
    for n in (16 * MiB, 20 * MiB, 28 * MiB, 48 * MiB):  # away from the step, the curve follows it
        assert gb.predict(gb.Collective.ALL_GATHER, n, 2, link) == pytest.approx(times["all_gather"].get(
            n, per_mib("all_gather", n) * n / MiB), rel=0.05)


def test_gloo_check_grades_the_saved_fit_against_a_new_measurement(monkeypatch, tmp_path, capsys):
    """``python -m costmodel.gloo_bench --check`` on a synthetic machine (α = 50 µs per step, 3 GB/s bus bandwidth
    that halves above 20 MiB for every kind, between sizes the check measures): the fit the benchmark writes,
    checked against the same machine at sizes it never saw, passes within 2 %; the same file checked against a
    machine whose all_gather is 30 % slower from 1 MiB fails (exit 1) and reports that kind's error as
    1 − 1/1.3 = 23.1 %; a missing or foreign fit file is a one-line error (exit 2). The per-call latency the fit
    file also carries is not part of what the check grades (ops in lock step), and ``--calls`` rewrites it alone."""
    from costmodel import gloo_bench as gb

    MiB = 2**20
    slower = {"all_gather": 1.0}

    def truth(kind, n):
        beta, alpha = gb._features(kind, n, 2)
        bandwidth = 3e9 if n < 20 * MiB else 1.5e9
        return (alpha * 50e-6 + beta / bandwidth) * (slower.get(kind.value, 1.0) if n >= MiB else 1.0)

    def fake_samples(points, ranks=2, rounds=2, launches=1, timeout_s=300.0, pin=None):
        out = {}
        for kind, n in points:
            out.setdefault(gb.Collective(kind).value, {})[n] = [[truth(gb.Collective(kind), n)]] * launches
        return out

    monkeypatch.setattr(gb, "measure_samples", fake_samples)
    call = {"latency": 2e-3}  # what a call after compute adds on this synthetic machine
    monkeypatch.setattr(gb, "measure_call_latency", lambda link, kinds=gb.KINDS, ranks=2: {
        k.value: (call["latency"] + 1e-4, call["latency"]) for k in kinds})
    fit = tmp_path / "fit.yaml"

    def saved_link():
        import yaml

        from costmodel.cluster import _Ctx, _parse_link

        return _parse_link(_Ctx(str(fit)), "intra", yaml.safe_load(fit.read_text())["intra"], "gloo")

    assert gb.main(["--out", str(fit), "--launches", "1"]) == 0
    capsys.readouterr()
    assert saved_link().call_latency_for("send_recv") == pytest.approx(2e-3)

    assert gb.main(["--check", "--out", str(fit), "--launches", "1"]) == 0
    out = capsys.readouterr().out
    worst = dict(re.findall(r"(\w+) (\d+\.\d)%", out.split("worst error at 1-64 MiB:")[1].splitlines()[0]))
    assert set(worst) == {k.value for k in gb.KINDS} and max(float(v) for v in worst.values()) < 2.0, worst
    assert "PASS" in out

    slower["all_gather"] = 1.3
    assert gb.main(["--check", "--out", str(fit), "--launches", "1"]) == 1
    out = capsys.readouterr().out
    worst = dict(re.findall(r"(\w+) (\d+\.\d)%", out.split("worst error at 1-64 MiB:")[1].splitlines()[0]))
    assert float(worst["all_gather"]) == pytest.approx(100 * (1 - 1 / 1.3), abs=2.0), worst
    assert float(worst["all_reduce"]) < 2.0 and "FAIL" in out

    assert gb.main(["--check", "--out", str(tmp_path / "none.yaml")]) == 2
    (tmp_path / "foreign.yaml").write_text("name: my-cluster\n")
    assert gb.main(["--check", "--out", str(tmp_path / "foreign.yaml")]) == 2
    err = capsys.readouterr().err
    assert "none.yaml: no fit file" in err and "foreign.yaml: not a gloo_bench fit file" in err

    # --calls measures the per-call latency alone and rewrites only that (and its record) in the saved file
    before = saved_link()
    call["latency"] = 3e-3
    assert gb.main(["--calls", "--out", str(fit)]) == 0
    after = saved_link()
    assert after.call_latency == pytest.approx(3e-3) and after.call_latency_for("all_gather") == pytest.approx(3e-3)
    assert after.bandwidth_by_kind == pytest.approx(dict(before.bandwidth_by_kind))
    assert fit.read_text().startswith("# cpu-local loopback link")
    assert gb.main(["--calls", "--out", str(tmp_path / "foreign.yaml")]) == 2
    assert "foreign.yaml: not a gloo_bench fit file" in capsys.readouterr().err

    # --kinds measures and fits those kinds alone and merges them: here broadcast, on a machine where it got 2×
    # slower; every other kind's figures stay as they were
    slower["broadcast"] = 2.0
    call["latency"] = 5e-3
    assert gb.main(["--kinds", "broadcast", "--out", str(fit)]) == 0
    merged = saved_link()
    assert "updated broadcast" in capsys.readouterr().out
    for kind in gb.KINDS:
        if kind is not Collective.BROADCAST:
            assert merged.bandwidth_for(kind.value) == pytest.approx(after.bandwidth_for(kind.value))
            assert merged.call_latency_for(kind.value) == pytest.approx(after.call_latency_for(kind.value))
    assert merged.call_latency_for("broadcast") == pytest.approx(5e-3)
    for n in (4 * MiB, 32 * MiB):  # the new fit reproduces the slower broadcast
        assert gb.predict(Collective.BROADCAST, n, 2, gb._lock_step(merged)) == pytest.approx(
            truth(Collective.BROADCAST, n), rel=0.02)
    assert fit.read_text().startswith("# cpu-local loopback link")
    with pytest.raises(SystemExit) as refused:  # argparse's one-line error
        gb.main(["--kinds", "gather", "--out", str(fit)])
    assert refused.value.code == 2 and "--kinds" in capsys.readouterr().err


def test_calls_split_the_bytes_and_each_pays_the_call_latency(a100x2):
    """``calls`` equal calls of a share each: k·(ring(S/k) + L) for every kind, the send/recv too; with no call
    latency one call is what the functions always priced, and a fraction of a call is refused."""
    lat = 0.7e-3
    link = replace(a100x2.intra, call_latency=lat, call_latency_by_kind={"all_gather": 2 * lat})
    slow = replace(a100x2, intra=link)
    span, s = _span(8), 64 * MB
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        own = 2 * lat if kind == "all_gather" else lat
        for k in (1, 2, 5):
            want = k * (collective_time(kind, s / k, span, a100x2) + own)
            assert collective_time(kind, s, span, slow, calls=k) == pytest.approx(want, rel=1e-12)
    assert send_recv_time(s, False, slow, calls=3) == pytest.approx(3 * (send_recv_time(s / 3, False, a100x2) + lat))
    assert all_reduce_time(s, span, a100x2, calls=1) == all_reduce_time(s, span, a100x2)
    assert all_reduce_time(0.0, span, slow, calls=4) == 0.0  # no bytes, no call
    with pytest.raises(ValueError, match="calls must be a whole number"):
        all_reduce_time(s, span, slow, calls=1.5)


def test_call_latency_is_the_slower_links_across_nodes(a100x2):
    inter = replace(a100x2.inter, call_latency=3e-3)
    cl = replace(a100x2, inter=inter)
    across, inside = _span(16, nodes=2), _span(8)
    assert all_reduce_time(MB, across, cl) - all_reduce_time(MB, across, a100x2) == pytest.approx(3e-3)
    assert all_reduce_time(MB, inside, cl) == all_reduce_time(MB, inside, a100x2)


def test_gloo_call_latency_is_the_mean_after_compute_less_the_fit(monkeypatch):
    """``measure_call_latency`` takes the mean of each launch's calls (half a ping-pong for send/recv) over the
    launches and subtracts what the lock-step fit prices a call at; the table and ``--check`` price lock-step ops
    without it."""
    from costmodel import gloo_bench as gb

    link = load_cluster("cpu-local").intra
    plain = replace(link, call_latency=0.0, call_latency_by_kind={})
    launches = iter([{"all_reduce": [1e-3, 3e-3], "send_recv": [4e-3]}, {"all_reduce": [2e-3], "send_recv": [2e-3]}])

    class _Proc:
        exitcode = 0

        def __init__(self, target, args, daemon):
            self.queue = args[-1]

        def start(self):
            pass

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    class _Queue:
        def get(self, timeout=None):
            return next(launches)

    class _Ctx:
        Process = _Proc

        def Queue(self):  # noqa: N802 (multiprocessing's name)
            return _Queue()

    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda method: _Ctx())
    monkeypatch.setattr(gb, "_free_port", lambda: 0)
    kinds = (Collective.ALL_REDUCE, Collective.SEND_RECV)
    got = gb.measure_call_latency(link, kinds=kinds, launches=2)
    ar = gb.predict(Collective.ALL_REDUCE, gb.CALL_SIZE, 2, plain)
    sr = gb.predict(Collective.SEND_RECV, gb.CALL_SIZE, 2, plain)
    assert got["all_reduce"] == pytest.approx((2e-3, 2e-3 - ar))  # launch means 2 and 2 ms
    assert got["send_recv"] == pytest.approx((1.5e-3, 1.5e-3 - sr))  # halves of 4 and 2 ms
    with_calls = gb.with_call_latency(plain, got)
    assert with_calls.call_latency == pytest.approx(2e-3 - ar)
    assert with_calls.call_latency_for("send_recv") == pytest.approx(1.5e-3 - sr)
    table, _ = gb._table({"all_reduce": {gb.MiB: 1e-3}}, with_calls, 2)
    assert f"{gb.predict(Collective.ALL_REDUCE, gb.MiB, 2, plain) * 1e3:.3f}" in table
