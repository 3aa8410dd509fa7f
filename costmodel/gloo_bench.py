"""Fit the ``cpu-local`` link from a gloo micro-benchmark on this machine.

``python -m costmodel.gloo_bench [--ranks 2] [--out costmodel/data/cpu_local.yaml] [--check]``

Measurement. ``--launches`` times (12), fork ``--ranks`` gloo processes on 127.0.0.1 (one thread each, rank r
pinned to the r-th core when there is a core per rank, glibc's malloc thresholds fixed at the values a long-running
process settles at) and time all_reduce, all_gather, reduce_scatter, all_to_all, send/recv (ping-pong, half the
round trip) and broadcast (from rank 0) at every power of two from 4 KiB to 64 MiB. Every sample is one op, timed
alone. Each launch visits the points ``--rounds`` times (2) in a shuffled order (the same on every rank), a batch of
samples each time, so that a burst of load from elsewhere, and whatever ran just before, land on all sizes alike:
a size's time depends on its
predecessor (all_to_all at 1 MiB took 0.13 ms among small ops, 0.19 ms right after 64 MiB ones). A point's figure
is the geometric mean over the launches of each launch's 0.1 quantile.

Why these statistics: on this 2-vCPU VM a blocked rank sometimes waits ~1-3 ms for its core to wake, so single op
times are bimodal: the median of 60 single 1 MiB all_reduces moved from 0.6 to 3.3 ms between runs, and the mean
of a few back-to-back ops (what this benchmark used to take) ±40 %, while a launch's 0.1 quantile stayed within
±5 % (0.26-0.30 ms). And near the cache sizes the time depends on where a launch's buffers landed: over 14
consecutive launches all_reduce at 6 MiB took 0.30-0.77 ms/MiB (0.39-0.41 in five, 0.57-0.64 in six, in no order
in time), all_gather at 24 MiB 0.30-0.47. So many short launches, each weighing alike. Fit and check (in fresh
processes) differed at worst by 17-30 % with 6 launches × 3 rounds (four checks), 18-37 % with 24 × 1 (four), and
12-14 % for all_reduce and all_gather, ≤ 19 % for every kind, with 12 × 2 (the default; two checks).

Model (``costmodel.collectives``): ``steps · α + bus_factor · S / B(S)``. The time per byte is not a constant here:
it steps up 1.5-3× as buffers outgrow the 1 MiB L2 of a core and then the 32 MiB L3, at sizes that differ by
collective, so one bandwidth (or a line with one kink, which this fit used before) misses by 30-45 % somewhere in
1-64 MiB. So ``B(S)`` is a measured curve (``cluster.SizeCurve``, the busbw-per-size table nccl-tests prints): α
comes from a non-negative least-squares fit on relative error over the sizes ≤ 256 KiB, where latency is most of
the time, and every size whose bandwidth term is at least half its time gives a knot
``B(S) = (1/B feature)/(t − α feature)``. The features are computed *by the model's own functions* with unit links,
so the fit and the model cannot disagree. Between knots the time per byte is interpolated in log2(size). Where the
time per byte of two neighbouring sizes differs by more than ``STEP``, the size between them is measured too
(``refine``), up to three times, which places a sharp step (all_gather's L3 step) within an eighth of an octave.

Calls after compute (``measure_call_latency``; ``--calls`` measures only these and updates the saved file). The
fit above prices an op among ops, ranks in lock step. A training step calls a collective after computing, and on
this VM the call then pays the wake-up of blocked threads on vCPUs, heavy-tailed and ~10× the fit: a 64 KiB
all_reduce after 6 matmuls took 2.1-3.0 ms on average (median ~1 ms), against 0.15 ms fitted, every call. Per kind,
the mean over launches of such calls less the fit is the link's ``call_latency``, which every call pays once
(`costmodel.collectives`). The table and ``--check`` compare single ops in lock step with the fit alone.

Output: the YAML read by ``costmodel.cluster`` (``intra`` with ``by_kind`` figures; the defaults are all_reduce's),
the date, torch version, the statistic, and the raw times. A full run takes ~3 min, a check ~2 min.

``--kinds K,…`` measures, fits and times the calls of those kinds only and merges them into the saved fit file,
leaving the other kinds' figures as they were (a kind added to the benchmark after the file was written).

``--check`` measures again, in fresh processes, at 1-64 MiB: the fitted powers of two and, between each two, a size
the fit never saw (1.5, 3, 6, 12, 24, 48 MiB), among the fit's own sizes (so that each size has the same
neighbours as in the fit), and reports the error of the *saved* fit. Exit status 1 when an all_reduce or
all_gather error exceeds 20 % (the other kinds are printed too).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import nnls

from costmodel.cluster import CPU_LOCAL_FILE, Cluster, GroupSpan, Link, SizeCurve, _dump_link
from costmodel.collectives import Collective, collective_time
from costmodel.hardware import DeviceSpec, EfficiencyCurve

__all__ = ["Fit", "fit_kind", "main", "measure", "measure_samples", "predict"]

KiB, MiB = 2**10, 2**20
#: the fit's sizes: every power of two from 4 KiB to 64 MiB (the curve's steps are an octave wide or less).
SIZES = tuple(4 * KiB * 2**i for i in range(15))
#: α is fitted on the sizes up to this one, where the latency term is most of the time.
LINE_MAX = 256 * KiB
#: the check: 1-64 MiB, the fitted powers of two and, between each two, a size the fit never saw (1.5·2^k).
CHECK_SIZES = tuple(sorted({MiB * 2**i for i in range(7)} | {3 * MiB // 2 * 2**i for i in range(6)}))
KINDS = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
         Collective.SEND_RECV, Collective.BROADCAST)
TOLERANCE = 0.20
#: the kinds the check's verdict is on (issue 3's acceptance); the others are measured and printed alongside.
GRADED = (Collective.ALL_REDUCE, Collective.ALL_GATHER)
#: launches of fresh ranks, rounds over all points in each (see _rank_main), and the quantile of each launch's
#: single-op times; a point's time is the geometric mean of its launches' quantiles (see the module docstring).
LAUNCHES = 12
ROUNDS = 2
QUANTILE = 0.1
#: refinement: a step in the time per byte larger than this between neighbouring sizes gets a size between them,
#: up to this many times (see ``refine``). Why 50 %, not less: the L3 step of all_gather (0.33 → 0.73 ms/MiB
#: between 24 and 32 MiB) is sharp, 2.2× within a quarter octave, so knots must find it; but where all_reduce
#: crosses from 0.35 to 0.55 ms/MiB (8-16 MiB) the time at a size in between flips from launch to launch between
#: the two levels (12 MiB: 0.40-0.58 over four runs), and a knot there would pin the curve to whichever level its
#: launch drew, while the interpolation between the octaves predicts the middle, within 20 % of both.
STEP = 0.5
REFINE_PASSES = 3
#: the call-latency measurement (see ``measure_call_latency``): message size, launches, calls timed per launch and
#: kind, and the matmuls (n × n, the same on every rank) each call follows.
CALL_SIZE = 64 * KiB
CALL_LAUNCHES = 6
CALL_SAMPLES = 40
CALL_WORK = (6, 256)


# --- Measurement (runs in the forked ranks) ------------------------------------------------------------------------


def _samples_per_round(nbytes: int) -> int:
    """Single-op samples per point in each round: many for small messages (cheap, and noisiest), at least 3."""
    return max(3, min(16, (32 * MiB) // max(1, nbytes)))


def _op(kind: Collective, nbytes: int, rank: int, world: int):
    """A closure running one ``kind`` on float32 buffers with the module's ``nbytes`` convention."""
    import torch
    import torch.distributed as dist

    numel = max(world, nbytes // 4 // world * world)
    if kind is Collective.ALL_REDUCE:
        buf = torch.ones(numel)
        return lambda: dist.all_reduce(buf)
    if kind is Collective.ALL_GATHER:  # nbytes = total output
        out, inp = torch.empty(numel), torch.ones(numel // world)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind is Collective.REDUCE_SCATTER:  # nbytes = total input
        inp, out = torch.ones(numel), torch.empty(numel // world)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if kind is Collective.ALL_TO_ALL:  # nbytes = buffer per rank
        inp, out = torch.ones(numel), torch.empty(numel)
        return lambda: dist.all_to_all_single(out, inp)
    if kind is Collective.BROADCAST:  # nbytes = the buffer, from rank 0 (ZeroRedundancyOptimizer's, per tensor)
        buf = torch.ones(numel)
        return lambda: dist.broadcast(buf, src=0)
    buf = torch.ones(numel)  # send/recv ping-pong between ranks 0 and 1; other ranks idle

    def ping_pong() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return ping_pong


def _steady_malloc() -> None:
    """Fix glibc's malloc thresholds at the values a long-running process reaches.

    glibc raises its mmap threshold as the process frees mmapped chunks (to the largest freed, at most 32 MiB on
    64-bit) and its trim threshold to twice that, so whether a buffer of a few MiB comes from fresh page-faulting
    memory or from the heap depends on what the process freed before. Fixing them at 32 and 64 MiB starts every
    launch where a training process that has run a few steps is. (Reasoned from glibc's documented behaviour; its
    effect on the timings was not measured apart from the other choices.)
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to pin
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 * MiB)
    libc.mallopt(m_trim_threshold, 64 * MiB)


def _join(rank: int, world: int, port: int, pin: bool) -> None:
    """A forked rank's setup: one thread, steady malloc thresholds, pinned when asked, in the gloo group."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _steady_malloc()
    if pin:  # one core per rank, as far as there are cores: no migrations, no two ranks on one core
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _rank_main(rank: int, world: int, port: int, pin: bool, queue, points: Sequence[tuple[str, int]], rounds: int,
               seed: int) -> None:
    import torch.distributed as dist

    _join(rank, world, port, pin)
    ops = {(Collective(k), n): _op(Collective(k), n, rank, world) for k, n in points}
    samples: dict[tuple[Collective, int], list[float]] = {p: [] for p in ops}
    try:
        for op in ops.values():  # warm-up: buffers touched, connections and scratch space set up
            op()
        # Rounds over all points in a shuffled order, a batch of single-op samples each time: a burst of load from
        # elsewhere, and the effect of the op just before, then land on every size alike.
        order = list(ops)
        for r in range(rounds):
            random.Random(seed * 1000 + r).shuffle(order)  # the same order on every rank
            for kind, nbytes in order:
                op = ops[kind, nbytes]
                dist.barrier()
                for _ in range(_samples_per_round(nbytes)):
                    t0 = time.perf_counter()
                    op()
                    samples[kind, nbytes].append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        by_kind: dict[str, dict[int, list[float]]] = {}
        for (kind, nbytes), ts in samples.items():
            half = 0.5 if kind is Collective.SEND_RECV else 1.0
            by_kind.setdefault(kind.value, {})[nbytes] = [half * t for t in ts]
        queue.put(by_kind)


def _call_rank_main(rank: int, world: int, port: int, pin: bool, queue, kinds: Sequence[str], samples: int) -> None:
    """One rank of the call-latency measurement: per kind, ``samples`` times: barrier, the same matmuls on every
    rank, then one op, timed; rank 0 puts ``{kind: [s, …]}`` on ``queue``."""
    import torch
    import torch.distributed as dist

    _join(rank, world, port, pin)
    reps, n = CALL_WORK
    a = torch.randn(n, n)
    out: dict[str, list[float]] = {}
    try:
        for kind in kinds:
            op = _op(Collective(kind), CALL_SIZE, rank, world)
            op()
            ts = out.setdefault(kind, [])
            for _ in range(samples):
                dist.barrier()
                for _ in range(reps):
                    torch.mm(a, a)
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def measure_call_latency(link: Link, kinds: Sequence[Collective] = KINDS, ranks: int = 2,
                         launches: int = CALL_LAUNCHES, samples: int = CALL_SAMPLES,
                         timeout_s: float = 300.0) -> dict[str, tuple[float, float]]:
    """Per kind, (mean seconds of one ``CALL_SIZE`` op called right after compute, the call latency): the mean over
    ``launches`` launches of ``samples`` calls, each after the same matmuls on every rank (ranks computing, not
    spinning in the transport, as in a training step), less what ``link`` prices that op at (its fit of single
    ops in lock step); at least 0.

    Why the mean: a step pays the sum of its calls, and on this VM a call after compute is heavy-tailed (64 KiB
    all_reduce: q0.1 0.42 ms, median 1.1, mean 2.1; reduce_scatter mean 2.3; all_gather 0.64; send/recv 0.69 on
    2026-12-03), while the lock-step fit prices it at ~0.15 ms: the tail is the wake-up of blocked threads on vCPUs.
    """
    means: dict[str, list[float]] = {}
    for _ in range(launches):
        got = _spawn(_call_rank_main, ranks, None, timeout_s, [k.value for k in kinds], samples)
        for kind, ts in got.items():
            half = 0.5 if kind == Collective.SEND_RECV.value else 1.0
            means.setdefault(kind, []).append(half * float(np.mean(ts)))
    plain = _lock_step(link)
    out = {}
    for kind in kinds:
        mean = float(np.mean(means[kind.value]))
        out[kind.value] = (mean, max(0.0, mean - predict(kind, CALL_SIZE, ranks, plain)))
    return out


def _lock_step(link: Link) -> Link:
    """``link`` as the lock-step fit prices ops: without a per-call latency."""
    return replace(link, call_latency=0.0, call_latency_by_kind={})


def with_call_latency(link: Link, latencies: Mapping[str, tuple[float, float]]) -> Link:
    """``link`` with the call latencies of :func:`measure_call_latency` (all_reduce's as the default)."""
    by_kind = {k: lat for k, (_, lat) in latencies.items()}
    return replace(link, call_latency=by_kind.get(Collective.ALL_REDUCE.value, 0.0), call_latency_by_kind=by_kind)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_samples(points: Sequence[tuple[Collective, int]], ranks: int = 2, rounds: int = ROUNDS,
                    launches: int = LAUNCHES, timeout_s: float = 300.0,
                    pin: bool | None = None) -> dict[str, dict[int, list[list[float]]]]:
    """Every single-op time (seconds) of each (kind, nbytes) point in each of ``launches`` sets of ``ranks``
    freshly forked gloo processes (each with its own buffers), ``{kind: {nbytes: [[s, …] per launch]}}``.

    ``nbytes`` follows ``costmodel.collectives``: all_gather total output, reduce_scatter total input, otherwise the
    buffer per rank; send/recv is half a ping-pong round trip. ``pin`` (default: when there is a core per rank)
    binds rank r to the r-th allowed core.
    """
    per_launch: dict[str, dict[int, list[list[float]]]] = {}
    for seed in range(launches):
        for kind, by_size in _launch(points, ranks, rounds, timeout_s, pin, seed).items():
            for n, ts in by_size.items():
                per_launch.setdefault(kind, {}).setdefault(n, []).append(ts)
    return per_launch


def _statistic(launches: Sequence[Sequence[float]], quantile: float) -> float:
    """Geometric mean over launches of each launch's ``quantile``."""
    return float(np.exp(np.mean([np.log(np.quantile(ts, quantile)) for ts in launches])))


def _launch(points: Sequence[tuple[Collective, int]], ranks: int, rounds: int, timeout_s: float,
            pin: bool | None, seed: int) -> dict[str, dict[int, list[float]]]:
    """One set of forked ranks measuring ``points`` (see :func:`measure_samples`)."""
    plain = [(Collective(k).value, int(n)) for k, n in points]
    return _spawn(_rank_main, ranks, pin, timeout_s, plain, rounds, seed)


def _spawn(target, ranks: int, pin: bool | None, timeout_s: float, *args):
    """Fork ``ranks`` gloo ranks running ``target(rank, world, port, pin, queue, *args)`` and return what rank 0
    puts on the queue. ``pin`` (None: when there is a core per rank) binds rank r to the r-th allowed core."""
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"a collective benchmark needs at least 2 ranks, got {ranks}")
    if pin is None:
        pin = ranks <= len(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")  # children inherit the imported torch: ~0.1 s to start instead of ~4 s
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, pin, queue, *args), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout_s)
    except Exception as exc:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"gloo benchmark produced no result within {timeout_s} s (exit codes {codes})") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def measure(kinds: Sequence[Collective] = KINDS, sizes: Sequence[int] = SIZES, ranks: int = 2,
            rounds: int = ROUNDS, quantile: float = QUANTILE, launches: int = LAUNCHES, timeout_s: float = 300.0,
            pin: bool | None = None) -> dict[str, dict[int, float]]:
    """Seconds per op at every kind × size, ``{kind: {nbytes: s}}``: over :func:`measure_samples`' launches, the
    geometric mean of each launch's ``quantile``."""
    samples = measure_samples([(k, n) for k in kinds for n in sizes], ranks, rounds, launches, timeout_s, pin)
    return {kind: {n: _statistic(ts, quantile) for n, ts in by_size.items()} for kind, by_size in samples.items()}


# --- Fit ---------------------------------------------------------------------------------------------------------


def refine(times_by: dict[str, dict[int, float]], ranks: int = 2, rounds: int = ROUNDS, launches: int = LAUNCHES,
           quantile: float = QUANTILE, passes: int = REFINE_PASSES) -> list[tuple[str, int]]:
    """Measure more sizes where the time per byte steps: between two neighbouring sizes ≥ ``LINE_MAX`` whose times
    per byte differ by more than ``STEP``, measure their geometric mean; ``passes`` times (each halves the gap, so
    3 passes place a step within 1/8 octave). Adds the new points to ``times_by``; returns them.

    The new sizes are measured among their kind's ``SIZES`` again (timed, not kept), so that they have the same
    kind of neighbours as in the main measurement: measured among big ops only, a size near a cache step came out
    ~25 % slower.
    """
    added: list[tuple[str, int]] = []
    for _ in range(passes):
        new: dict[str, list[int]] = {}
        for kind, by_size in times_by.items():
            sizes = sorted(n for n in by_size if n >= LINE_MAX)
            for a, b in zip(sizes, sizes[1:], strict=False):
                mid = round(math.sqrt(a * b) / (4 * KiB)) * 4 * KiB
                ratio = (by_size[b] / b) / (by_size[a] / a)
                if a < mid < b and max(ratio, 1 / ratio) > 1 + STEP:
                    new.setdefault(kind, []).append(mid)
        if not new:
            break
        points = [(Collective(k), n) for k, mids in new.items() for n in sorted(set(SIZES) | set(mids))]
        for kind, by_size in measure_samples(points, ranks, rounds, launches).items():
            for n in new[kind]:
                times_by[kind][n] = _statistic(by_size[n], quantile)
                added.append((kind, n))
    return added


#: a device nobody computes on: the benchmark's clusters only carry links.
_UNIT_DEVICE = DeviceSpec(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1.0, hbm_bw=1.0,
                          matmul_eff=EfficiencyCurve(e_max=1.0, f_half=1.0, source="unit"), memory_eff=1.0)


def _unit_cluster(ranks: int, bandwidth: float, latency: float) -> Cluster:
    link = Link(name="unit", bandwidth=bandwidth, latency=latency)
    return Cluster(name="unit", device=_UNIT_DEVICE, gpus_per_node=ranks, nodes=1, intra=link, inter=link)


def _features(kind: Collective, nbytes: int, ranks: int) -> tuple[float, float]:
    """Coefficients of (1/B, α) in the model's time, read off ``collective_time`` with unit links."""
    span = GroupSpan(size=ranks, nodes=1, per_node=ranks)
    beta = collective_time(kind, nbytes, span, _unit_cluster(ranks, bandwidth=1.0, latency=0.0))
    alpha = collective_time(kind, nbytes, span, _unit_cluster(ranks, bandwidth=1e300, latency=1.0))
    return beta, alpha


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Fitted figures of one collective kind on this machine: α, and the bus bandwidth as a curve over size."""

    #: the collective.
    kind: Collective
    #: bus bandwidth at the largest measured size (the curve's reference), bytes/s.
    bandwidth: float
    #: per-step latency, seconds.
    latency: float
    #: bandwidth over message size relative to ``bandwidth``, or None when no size is bandwidth-bound.
    curve: SizeCurve | None
    #: largest |predicted − measured| / measured over the fitted points.
    max_rel_error: float


def fit_kind(kind: Collective, times_by: Mapping[int, float], ranks: int) -> Fit:
    """α from the small sizes, then the bandwidth each bandwidth-bound size needs, as a curve (see module doc).

    1. α (and a provisional bandwidth) by non-negative least squares on relative error (rows ``features/t``
       against 1) over the sizes up to ``LINE_MAX`` (all sizes if fewer than two are that small).
    2. At every size whose bandwidth term is at least half its time, ``B(S) = (1/B feature) / (t − α feature)``.
       The largest such size gives the reference bandwidth; the others its factors. With no such size, the
       provisional bandwidth and no curve.
    """
    sizes = sorted(times_by)
    times = np.array([times_by[s] for s in sizes])
    feats = np.array([_features(kind, s, ranks) for s in sizes])
    small = [i for i, s in enumerate(sizes) if s <= LINE_MAX]
    rows = small if len(small) >= 2 else list(range(len(sizes)))
    (inv_bw, latency), _ = nnls(feats[rows] / times[rows, None], np.ones(len(rows)))
    knots = [(s, feats[i, 0] / (times[i] - latency * feats[i, 1])) for i, s in enumerate(sizes)
             if times[i] - latency * feats[i, 1] >= 0.5 * times[i] and feats[i, 0] > 0]
    if knots:
        bandwidth = knots[-1][1]
        curve = SizeCurve(sizes=tuple(s for s, _ in knots), factors=tuple(b / bandwidth for _, b in knots))
    elif inv_bw > 0:
        bandwidth, curve = 1.0 / inv_bw, None
    else:
        raise RuntimeError(f"{kind.value}: no size is bandwidth-bound and the fit found no bandwidth term "
                           f"(times {times.tolist()}); measure larger sizes")
    link = Link(name="fit", bandwidth=bandwidth, latency=float(latency),
                curve_by_kind={} if curve is None else {kind.value: curve})
    rel = [(predict(kind, s, ranks, link) - t) / t for s, t in zip(sizes, times, strict=True)]
    return Fit(kind=kind, bandwidth=float(bandwidth), latency=float(latency), curve=curve,
               max_rel_error=float(np.max(np.abs(rel))))


def predict(kind: Collective, nbytes: int, ranks: int, link: Link) -> float:
    """Model time of one op on a one-node cluster of ``ranks`` ranks joined by ``link``."""
    cluster = Cluster(name="cpu-local", device=_UNIT_DEVICE, gpus_per_node=ranks,
                      nodes=1, intra=link, inter=link)
    return collective_time(kind, nbytes, GroupSpan(size=ranks, nodes=1, per_node=ranks), cluster)


def link_from_fits(fits: Mapping[Collective, Fit], source: str) -> Link:
    """The loopback link: all_reduce's figures as defaults, every kind's own as overrides."""
    default = fits.get(Collective.ALL_REDUCE) or next(iter(fits.values()))
    return Link(name="gloo over loopback", bandwidth=default.bandwidth, latency=default.latency, source=source,
                bandwidth_by_kind={k.value: f.bandwidth for k, f in fits.items()},
                latency_by_kind={k.value: f.latency for k, f in fits.items()},
                curve_by_kind={k.value: f.curve for k, f in fits.items() if f.curve is not None})


# --- Report and file ---------------------------------------------------------------------------------------------


def _table(times_by: Mapping[str, Mapping[int, float]], link: Link, ranks: int) -> tuple[str, dict[str, float]]:
    """The measured-vs-predicted table (ops in lock step: the fit without the call latency), and each kind's worst
    |error| at 1-64 MiB."""
    link = _lock_step(link)
    lines = [f"{'collective':<15}{'size':>10}{'measured ms':>14}{'predicted ms':>14}{'error':>9}"]
    worst: dict[str, float] = {}
    for kind_name, by_size in times_by.items():
        for nbytes, measured in sorted(by_size.items()):
            pred = predict(Collective(kind_name), nbytes, ranks, link)
            err = (pred - measured) / measured
            if MiB <= nbytes <= 64 * MiB:
                worst[kind_name] = max(worst.get(kind_name, 0.0), abs(err))
            lines.append(f"{kind_name:<15}{_size(nbytes):>10}{measured * 1e3:>14.3f}{pred * 1e3:>14.3f}{err:>+9.1%}")
    return "\n".join(lines), worst


def _size(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def _call_record(calls: Mapping[str, tuple[float, float]]) -> dict:
    return {"size_KiB": CALL_SIZE // KiB, "launches": CALL_LAUNCHES, "samples": CALL_SAMPLES,
            "matmuls": f"{CALL_WORK[0]} × {CALL_WORK[1]}²", "statistic": "mean",
            "mean_ms": {k: _sig(m * 1e3) for k, (m, _) in calls.items()}}


def write_fit(path: Path, link: Link, fits: Mapping[Collective, Fit], times_by: Mapping[str, Mapping[int, float]],
              ranks: int, quantile: float, rounds: int, launches: int,
              calls: Mapping[str, tuple[float, float]] | None = None) -> None:
    """Write the cpu-local link YAML (``intra`` section as in a cluster file) with the raw times_by."""
    import torch

    data = {
        "ranks": ranks,
        "threads_per_rank": 1,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": str(torch.__version__),
        "cpus": os.cpu_count(),
        "quantile": quantile,
        "rounds": rounds,
        "launches": launches,
        "pinned": ranks <= len(os.sched_getaffinity(0)),
        "intra": _dump_link(link),
        "fit_max_rel_error": {k.value: round(f.max_rel_error, 4) for k, f in fits.items()},
        **({"call_latency": _call_record(calls)} if calls else {}),
        "measured_s": {k: {int(s): _sig(t) for s, t in sorted(v.items())} for k, v in times_by.items()},
    }
    header = (f"# cpu-local loopback link, written by `python -m costmodel.gloo_bench` — do not edit by hand.\n"
              f"# Per-step latency and bus bandwidth of the alpha-beta model in costmodel/collectives.py,\n"
              f"# fitted per collective on {ranks} gloo ranks × 1 thread over 127.0.0.1: α by relative-error NNLS on\n"
              f"# the small sizes, the bandwidth as a curve over message size (size_curve: factor × bw_GBps);\n"
              f"# call_latency_us: what a call right after compute pays beyond that (measure_call_latency).\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + _yaml(data))


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True, default_flow_style=None)


def _rewrite(path: Path, text: str, saved: dict) -> None:
    """Write ``saved`` back to the fit file whose text was ``text``, keeping its header comment."""
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    path.write_text(header + _yaml(saved))


def _read_fit(path: Path) -> tuple[str, dict, Link] | None:
    """(text, data, link) of a saved fit file, or None after a one-line error on stderr."""
    from costmodel.cluster import _Ctx, _parse_link

    if not path.exists():
        print(f"{path}: no fit file; run python -m costmodel.gloo_bench first", file=sys.stderr)
        return None
    try:
        text = path.read_text()
        saved = yaml.safe_load(text)
        return text, saved, _parse_link(_Ctx(str(path)), "intra", saved["intra"], default_name="gloo over loopback")
    except (OSError, yaml.YAMLError, ValueError, TypeError, KeyError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{path}: not a gloo_bench fit file ({why}); run python -m costmodel.gloo_bench to write one",
              file=sys.stderr)
        return None


def _update_kinds(args, kinds: Sequence[Collective], text: str, saved: dict, link: Link, t0: float) -> int:
    """``--kinds``: measure, refine, fit and time the calls of ``kinds`` on the saved file's ranks, and write them
    into the file beside the other kinds' figures, which stay as they were."""
    ranks, quantile = saved.get("ranks", args.ranks), saved.get("quantile", args.quantile)  # (the file's statistic)
    rounds, launches = args.rounds, args.launches
    times_by = measure(kinds, SIZES, ranks=ranks, rounds=rounds, quantile=quantile, launches=launches)
    refine(times_by, ranks=ranks, rounds=rounds, launches=launches, quantile=quantile)
    fits = {kind: fit_kind(kind, times_by[kind.value], ranks) for kind in kinds}
    new = link_from_fits(fits, link.source)
    calls = measure_call_latency(new, kinds, ranks=ranks)
    names = {k.value for k in kinds}

    def merged(old: Mapping, fresh: Mapping) -> dict:  # a refitted kind's figures are all new (a curve may go)
        return {**{k: v for k, v in old.items() if k not in names}, **fresh}

    link = replace(link, bandwidth_by_kind=merged(link.bandwidth_by_kind, new.bandwidth_by_kind),
                   latency_by_kind=merged(link.latency_by_kind, new.latency_by_kind),
                   curve_by_kind=merged(link.curve_by_kind, new.curve_by_kind),
                   call_latency_by_kind=merged(link.call_latency_by_kind, {k: lat for k, (_, lat) in calls.items()}))
    if Collective.ALL_REDUCE in fits:  # the link's defaults are all_reduce's (`link_from_fits`)
        fit = fits[Collective.ALL_REDUCE]
        link = replace(link, bandwidth=fit.bandwidth, latency=fit.latency,
                       call_latency=calls[Collective.ALL_REDUCE.value][1])
    saved["intra"] = _dump_link(link)
    saved.setdefault("fit_max_rel_error", {}).update({k.value: round(f.max_rel_error, 4) for k, f in fits.items()})
    record = saved.setdefault("call_latency", _call_record(calls))
    record.setdefault("mean_ms", {}).update({k: _sig(m * 1e3) for k, (m, _) in calls.items()})
    saved.setdefault("updated", {}).update({k.value: datetime.date.today().isoformat() for k in kinds})
    saved.setdefault("measured_s", {}).update(
        {k: {int(n): _sig(t) for n, t in sorted(v.items())} for k, v in times_by.items()})
    _rewrite(args.out, text, saved)
    table, _ = _table(times_by, link, ranks)
    print(table)
    for kind, fit in fits.items():
        print(f"{kind.value:<15} B = {fit.bandwidth / 1e9:.3f} GB/s  α = {fit.latency * 1e6:.1f} µs/step  "
              f"call latency {calls[kind.value][1] * 1e3:.3f} ms  max fit error {fit.max_rel_error:.1%}")
    print(f"updated {', '.join(k.value for k in kinds)} in {args.out}; {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m costmodel.gloo_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (2: one per core on this machine)")
    parser.add_argument("--out", type=Path, default=CPU_LOCAL_FILE, help="fit file to write (or check)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds over all points per launch (see above)")
    parser.add_argument("--launches", type=int, default=LAUNCHES, help="launches of fresh ranks (see above)")
    parser.add_argument("--quantile", type=float, default=QUANTILE,
                        help="quantile of the single-op times to fit (default %(default)s; see above)")
    parser.add_argument("--calls", action="store_true",
                        help="measure only the per-call latency and update it in the saved fit file")
    parser.add_argument("--check", action="store_true",
                        help="re-measure 1-64 MiB (sizes outside the fit too) and report the saved fit's error")
    parser.add_argument("--kinds", help="measure and fit only these kinds (comma-separated, e.g. broadcast) and "
                                        "merge them into the saved fit file")
    args = parser.parse_args(argv)
    if not 0.0 <= args.quantile <= 1.0:
        parser.error(f"--quantile must lie in [0, 1], got {args.quantile}")
    if args.rounds < 1 or args.launches < 1:
        parser.error(f"--rounds and --launches must be at least 1, got {args.rounds} and {args.launches}")
    kinds = list(KINDS)
    if args.kinds:
        try:
            kinds = [Collective(k.strip()) for k in args.kinds.split(",") if k.strip()]
        except ValueError as exc:
            parser.error(f"--kinds: {exc}; known: {', '.join(k.value for k in KINDS)}")
        if not kinds:
            parser.error(f"--kinds names no kind; known: {', '.join(k.value for k in KINDS)}")
        if args.calls:
            parser.error("--kinds and --calls: --kinds already measures those kinds' call latency; give one")
    t0 = time.perf_counter()

    if args.calls or args.check or args.kinds:
        loaded = _read_fit(args.out)
        if loaded is None:
            return 2
        text, saved, link = loaded

    if args.calls:
        calls = measure_call_latency(link, ranks=saved.get("ranks", args.ranks))
        saved["intra"] = _dump_link(with_call_latency(link, calls))
        saved["call_latency"] = _call_record(calls)
        _rewrite(args.out, text, saved)
        for kind, (mean, lat) in calls.items():
            print(f"{kind:<15} after compute: mean {mean * 1e3:.3f} ms, call latency {lat * 1e3:.3f} ms")
        print(f"updated {args.out}; {time.perf_counter() - t0:.1f} s")
        return 0

    if args.kinds and not args.check:
        return _update_kinds(args, kinds, text, saved, link, t0)

    if args.check:
        if not args.kinds:
            kinds = [Collective(k) for k in saved["intra"].get("by_kind", {})] or list(KINDS)
        ranks = saved.get("ranks", args.ranks)
        # the fit's own sizes are measured alongside, unreported, so that every size is timed among the same
        # neighbours as in the fit (an op's time depends on what ran just before it; see the module docstring)
        times_by = measure(kinds, sorted(set(SIZES) | set(CHECK_SIZES)), ranks=ranks, rounds=args.rounds,
                           quantile=saved.get("quantile", args.quantile), launches=args.launches)
        times_by = {k: {n: t for n, t in by.items() if n in CHECK_SIZES} for k, by in times_by.items()}
        table, worst = _table(times_by, link, ranks)
        q = saved.get("quantile", args.quantile)
        print(f"saved fit {args.out} ({saved.get('date')}) against a new measurement (geometric mean over "
              f"{args.launches} launches of the q{q:g} of single-op times):\n{table}")
        print("worst error at 1-64 MiB: " + ", ".join(f"{k} {w:.1%}" for k, w in worst.items()))
        graded = max(worst.get(k.value, 0.0) for k in GRADED)
        verdict = "PASS" if graded <= TOLERANCE else "FAIL"
        print(f"{' and '.join(k.value for k in GRADED)}: worst {graded:.1%} ({verdict}, tolerance {TOLERANCE:.0%}); "
              f"{time.perf_counter() - t0:.1f} s")
        return 0 if graded <= TOLERANCE else 1

    times_by = measure(KINDS, SIZES, ranks=args.ranks, rounds=args.rounds, quantile=args.quantile,
                       launches=args.launches)
    added = refine(times_by, ranks=args.ranks, rounds=args.rounds, launches=args.launches, quantile=args.quantile)
    print(f"refined {len(added)} points where the time per byte steps by more than {STEP:.0%}")
    fits = {kind: fit_kind(kind, times_by[kind.value], args.ranks) for kind in KINDS}
    source = (f"gloo_bench fit, {args.ranks} ranks × 1 thread, 127.0.0.1, {datetime.date.today().isoformat()}, "
              f"sizes 4 KiB-64 MiB, geometric mean over {args.launches} launches of the q{args.quantile:g} of "
              f"single-op times")
    calls = measure_call_latency(link_from_fits(fits, source), ranks=args.ranks)
    link = with_call_latency(link_from_fits(fits, source), calls)
    write_fit(args.out, link, fits, times_by, args.ranks, args.quantile, args.rounds, args.launches, calls)
    table, worst_by_kind = _table(times_by, link, args.ranks)
    print(table)
    worst = max(worst_by_kind.values(), default=0.0)
    for kind, fit in fits.items():
        curve = (f"  × {min(fit.curve.factors):.2f}-{max(fit.curve.factors):.2f} over "
                 f"{_size(fit.curve.sizes[0])}-{_size(fit.curve.sizes[-1])}" if fit.curve else "")
        print(f"{kind.value:<15} B = {fit.bandwidth / 1e9:.3f} GB/s{curve}  α = {fit.latency * 1e6:.1f} µs/step  "
              f"max fit error {fit.max_rel_error:.1%}")
    print(f"wrote {args.out}; worst in-sample error at 1-64 MiB {worst:.1%} (--check measures anew); "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
