"""Fit the ``cpu-local`` link from a gloo micro-benchmark on this machine.

``python -m costmodel.gloo_bench [--ranks 2] [--out costmodel/data/cpu_local.yaml] [--check]``

Forks ``--ranks`` gloo processes on 127.0.0.1 (one thread each, as cpu-local runs them), times all_reduce,
all_gather, reduce_scatter, all_to_all and send/recv (ping-pong, half the round trip) from 4 KiB to 64 MiB
(warm-up, then the fastest of 7 repeats of a few back-to-back ops, nccl-tests style), and fits per collective
the per-step latency α and bus bandwidth B of the alpha-beta formulas in ``costmodel.collectives``. The features
(plus a cache-spill term beyond a threshold, ``cluster.Spill``: gloo's per-byte time roughly doubles once buffers
leave the 32 MiB L3, which no single line follows over 1-64 MiB). The features
of the fit are computed *by those functions* (with a unit link), so the fit and the model cannot disagree. The fit
minimises the relative error (rows weighted by 1/measured time) with non-negative least squares, so that 4 KiB and
64 MiB messages both count. It writes the YAML read by ``costmodel.cluster`` (``intra`` with ``by_kind``
overrides; the default figures are all_reduce's), plus the date, torch version and the raw times, and prints
measured vs predicted.

Why the fastest repeat, not the median: this is a shared 2-core machine; other processes only ever *add* time, and
the median of a few repeats moved by ±50 % run to run (FINDINGS.md, and here: all_reduce 64 MiB median 34-67 ms
over four runs, minimum 39-41 ms). The model predicts the uncontended time. ``--statistic median`` is available.

``--check`` re-measures at 1, 4, 16 and 64 MiB and reports the error of the *saved* fit (exit status 1 if any error
exceeds 20 %). A full run takes ~10-20 s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import nnls

from costmodel.cluster import CPU_LOCAL_FILE, Cluster, GroupSpan, Link, Spill
from costmodel.collectives import Collective, collective_time
from costmodel.hardware import DeviceSpec, EfficiencyCurve

__all__ = ["Fit", "fit_kind", "main", "measure", "predict"]

KiB, MiB = 2**10, 2**20
#: default sweep: 4 KiB, 16 KiB, …, 64 MiB, plus 32 MiB (the L3 size here) to place the cache spill.
SIZES = tuple(sorted({4 * KiB * 4**i for i in range(8)} | {32 * MiB}))
#: thresholds tried for the cache-spill term (the fit keeps the best, or none).
SPILL_THRESHOLDS = (4 * MiB, 8 * MiB, 16 * MiB, 24 * MiB, 32 * MiB)
CHECK_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
KINDS = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
         Collective.SEND_RECV)
TOLERANCE = 0.20


# --- Measurement (runs in the forked ranks) ------------------------------------------------------------------------


def _iters(nbytes: int) -> int:
    """Back-to-back ops per timed repeat: enough that small messages are not dominated by timer and barrier skew."""
    return max(1, min(20, (4 * MiB) // nbytes))


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
    buf = torch.ones(numel)  # send/recv ping-pong between ranks 0 and 1; other ranks idle

    def ping_pong() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return ping_pong


def _rank_main(rank: int, world: int, port: int, kinds: Sequence[str], sizes: Sequence[int], repeats: int,
               queue) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    samples_by: dict[str, dict[int, list[float]]] = {}
    try:
        for kind in map(Collective, kinds):
            samples_by[kind.value] = {}
            for nbytes in sizes:
                op, iters = _op(kind, nbytes, rank, world), _iters(nbytes)
                op()  # warm-up (buffers, connections)
                samples = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        op()
                    samples.append((time.perf_counter() - t0) / iters)
                half = 0.5 if kind is Collective.SEND_RECV else 1.0
                samples_by[kind.value][nbytes] = [half * t for t in samples]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(samples_by)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kinds: Sequence[Collective] = KINDS, sizes: Sequence[int] = SIZES, ranks: int = 2,
            repeats: int = 7, timeout_s: float = 300.0, statistic: str = "min") -> dict[str, dict[int, float]]:
    """Median seconds per op, ``{kind: {nbytes: s}}``, measured by ``ranks`` forked gloo processes.

    ``nbytes`` follows ``costmodel.collectives``: all_gather total output, reduce_scatter total input, otherwise the
    buffer per rank; send/recv is half a ping-pong round trip.
    """
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"a collective benchmark needs at least 2 ranks, got {ranks}")
    ctx = mp.get_context("fork")  # children inherit the imported torch: ~0.1 s to start instead of ~4 s
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, [k.value for k in kinds], list(sizes), repeats,
                                                   queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout_s)
    except Exception as exc:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"gloo benchmark produced no result within {timeout_s} s (exit codes {codes})") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    reduce = {"median": statistics.median, "min": min}[statistic]
    return {kind: {nbytes: reduce(samples) for nbytes, samples in by_size.items()} for kind, by_size in result.items()}


# --- Fit ---------------------------------------------------------------------------------------------------------


def _unit_cluster(ranks: int, bandwidth: float, latency: float, spill: Spill | None = None) -> Cluster:
    spills = {} if spill is None else {k.value: spill for k in Collective}
    link = Link(name="unit", bandwidth=bandwidth, latency=latency, spill_by_kind=spills)
    device = DeviceSpec(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1.0, hbm_bw=1.0,
                        matmul_eff=EfficiencyCurve(e_max=1.0, f_half=1.0, source="unit"), memory_eff=1.0)
    return Cluster(name="unit", device=device, gpus_per_node=ranks, nodes=1, intra=link, inter=link)


def _features(kind: Collective, nbytes: int, ranks: int, threshold: float) -> tuple[float, float, float]:
    """Coefficients of (1/B, α, 1/B_spill) in the model's time, read off ``collective_time`` with unit links."""
    span = GroupSpan(size=ranks, nodes=1, per_node=ranks)
    huge = 1e300
    beta = collective_time(kind, nbytes, span, _unit_cluster(ranks, bandwidth=1.0, latency=0.0))
    alpha = collective_time(kind, nbytes, span, _unit_cluster(ranks, bandwidth=huge, latency=1.0))
    spill = collective_time(kind, nbytes, span, _unit_cluster(ranks, huge, 0.0, Spill(threshold=threshold,
                                                                                        bandwidth=1.0)))
    return beta, alpha, spill


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Fitted alpha-beta (+ cache spill) figures of one collective kind on this machine."""

    #: the collective.
    kind: Collective
    #: bus bandwidth, bytes/s.
    bandwidth: float
    #: per-step latency, seconds.
    latency: float
    #: extra per-byte cost beyond a cache-sized threshold, or None when the fit needs none.
    spill: Spill | None
    #: largest |predicted − measured| / measured over the fitted points.
    max_rel_error: float


def fit_kind(kind: Collective, times_by: Mapping[int, float], ranks: int) -> Fit:
    """Non-negative least squares on relative error (rows ``features/t`` against 1), for each spill threshold in
    ``SPILL_THRESHOLDS``; keeps the one with the smallest sum of squared relative errors."""
    sizes = sorted(times_by)
    times = np.array([times_by[s] for s in sizes])
    best = None
    for threshold in SPILL_THRESHOLDS:
        feats = np.array([_features(kind, s, ranks, threshold) for s in sizes])
        coef, _ = nnls(feats / times[:, None], np.ones(len(sizes)))
        rel = (feats @ coef - times) / times
        if best is None or float(rel @ rel) < best[0]:
            best = (float(rel @ rel), threshold, coef, rel)
    _, threshold, (inv_bw, latency, inv_spill), rel = best
    if inv_bw <= 0:
        raise RuntimeError(f"{kind.value}: fit found no bandwidth term (times {times.tolist()}); too few sizes?")
    spill = Spill(threshold=threshold, bandwidth=1.0 / inv_spill) if inv_spill > 0 else None
    return Fit(kind=kind, bandwidth=1.0 / inv_bw, latency=float(latency), spill=spill,
               max_rel_error=float(np.max(np.abs(rel))))


def predict(kind: Collective, nbytes: int, ranks: int, link: Link) -> float:
    """Model time of one op on a one-node cluster of ``ranks`` ranks joined by ``link``."""
    cluster = Cluster(name="cpu-local", device=_unit_cluster(ranks, 1.0, 0.0).device, gpus_per_node=ranks,
                      nodes=1, intra=link, inter=link)
    return collective_time(kind, nbytes, GroupSpan(size=ranks, nodes=1, per_node=ranks), cluster)


def link_from_fits(fits: Mapping[Collective, Fit], source: str) -> Link:
    """The loopback link: all_reduce's figures as defaults, every kind's own as overrides."""
    default = fits.get(Collective.ALL_REDUCE) or next(iter(fits.values()))
    return Link(name="gloo over loopback", bandwidth=default.bandwidth, latency=default.latency, source=source,
                bandwidth_by_kind={k.value: f.bandwidth for k, f in fits.items()},
                latency_by_kind={k.value: f.latency for k, f in fits.items()},
                spill_by_kind={k.value: f.spill for k, f in fits.items() if f.spill is not None})


# --- Report and file ---------------------------------------------------------------------------------------------


def _table(times_by: Mapping[str, Mapping[int, float]], link: Link, ranks: int) -> tuple[str, float]:
    lines = [f"{'collective':<15}{'size':>10}{'measured ms':>14}{'predicted ms':>14}{'error':>9}"]
    worst = 0.0
    for kind_name, by_size in times_by.items():
        for nbytes, measured in sorted(by_size.items()):
            pred = predict(Collective(kind_name), nbytes, ranks, link)
            err = (pred - measured) / measured
            if nbytes >= MiB:
                worst = max(worst, abs(err))
            size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
            lines.append(f"{kind_name:<15}{size:>10}{measured * 1e3:>14.3f}{pred * 1e3:>14.3f}{err:>+9.1%}")
    return "\n".join(lines), worst


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def _kind_entry(fit: Fit) -> dict[str, float]:
    entry = {"bw_GBps": _sig(fit.bandwidth / 1e9), "latency_us": _sig(fit.latency / 1e-6)}
    if fit.spill is not None:
        entry |= {"spill_MiB": fit.spill.threshold / MiB, "spill_bw_GBps": _sig(fit.spill.bandwidth / 1e9)}
    return entry


def write_fit(path: Path, fits: Mapping[Collective, Fit], times_by: Mapping[str, Mapping[int, float]],
              ranks: int, source: str, statistic: str) -> None:
    """Write the cpu-local link YAML (``intra`` section as in a cluster file) with the raw times_by."""
    import torch

    default = fits.get(Collective.ALL_REDUCE) or next(iter(fits.values()))
    data = {
        "ranks": ranks,
        "threads_per_rank": 1,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": str(torch.__version__),
        "cpus": os.cpu_count(),
        "statistic": statistic,
        "intra": {
            "name": "gloo over loopback",
            "bw_GBps": _sig(default.bandwidth / 1e9),
            "latency_us": _sig(default.latency / 1e-6),
            "source": source,
            "by_kind": {k.value: _kind_entry(f) for k, f in fits.items()},
        },
        "fit_max_rel_error": {k.value: round(f.max_rel_error, 4) for k, f in fits.items()},
        "measured_s": {k: {int(s): _sig(t) for s, t in sorted(v.items())} for k, v in times_by.items()},
    }
    header = (f"# cpu-local loopback link, written by `python -m costmodel.gloo_bench` — do not edit by hand.\n"
              f"# Per-step latency and bus bandwidth of the alpha-beta model in costmodel/collectives.py,\n"
              f"# fitted per collective on {ranks} gloo ranks × 1 thread over 127.0.0.1 (relative-error NNLS).\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m costmodel.gloo_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (2: one per core on this machine)")
    parser.add_argument("--out", type=Path, default=CPU_LOCAL_FILE, help="fit file to write (or check)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per point")
    parser.add_argument("--statistic", choices=("min", "median"), default="min", help="of the repeats (see above)")
    parser.add_argument("--check", action="store_true", help="re-measure 1-64 MiB and report the saved fit's error")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    if args.check:
        from costmodel.cluster import _Ctx, _parse_link

        if not args.out.exists():
            print(f"{args.out}: no fit file; run python -m costmodel.gloo_bench first", file=sys.stderr)
            return 2
        saved = yaml.safe_load(args.out.read_text())
        link = _parse_link(_Ctx(str(args.out)), "intra", saved["intra"], default_name="gloo over loopback")
        kinds = [Collective(k) for k in saved["intra"].get("by_kind", {})] or list(KINDS)
        times_by = measure(kinds, CHECK_SIZES, ranks=saved.get("ranks", args.ranks), repeats=args.repeats,
                           statistic=saved.get("statistic", args.statistic))
        table, worst = _table(times_by, link, saved.get("ranks", args.ranks))
        print(f"saved fit {args.out} ({saved.get('date')}) against a new measurement:\n{table}")
        verdict = "PASS" if worst <= TOLERANCE else "FAIL"
        print(f"worst error at 1-64 MiB: {worst:.1%} ({verdict}, tolerance {TOLERANCE:.0%}); "
              f"{time.perf_counter() - t0:.1f} s")
        return 0 if worst <= TOLERANCE else 1

    times_by = measure(KINDS, SIZES, ranks=args.ranks, repeats=args.repeats, statistic=args.statistic)
    fits = {kind: fit_kind(kind, times_by[kind.value], args.ranks) for kind in KINDS}
    source = (f"gloo_bench fit, {args.ranks} ranks × 1 thread, 127.0.0.1, "
              f"{datetime.date.today().isoformat()}, sizes 4 KiB-64 MiB, {args.statistic} of {args.repeats} repeats")
    link = link_from_fits(fits, source)
    write_fit(args.out, fits, times_by, args.ranks, source, args.statistic)
    table, worst = _table(times_by, link, args.ranks)
    print(table)
    for kind, fit in fits.items():
        spill = (f"  spill > {fit.spill.threshold / MiB:g} MiB at {fit.spill.bandwidth / 1e9:.3f} GB/s"
                 if fit.spill else "")
        print(f"{kind.value:<15} B = {fit.bandwidth / 1e9:.3f} GB/s  α = {fit.latency * 1e6:.1f} µs/step{spill}  "
              f"max fit error {fit.max_rel_error:.1%}")
    print(f"wrote {args.out}; worst error at 1-64 MiB {worst:.1%}; {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
