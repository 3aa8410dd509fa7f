"""Korthikanti et al. 2022 Table 3: for each published configuration (same model, GPU count and global batch), the
searched plan predicts at least the throughput the cost model predicts for the published configuration
(t = 8, the published p, selective recomputation, sequence parallel, interleaving with 3 virtual stages for 175B
and 530B; Megatron 2022 ran unfused attention, hence ``attention=math``, see costmodel/calibrate.py), wherever
that configuration fits the card as autopar's runtime runs it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.cluster import load_cluster
from costmodel.config import AC, ParallelConfig, Schedule
from costmodel.estimate import estimate
from planner.search.outer import search
from profiler.api import profile_model

#: name, layers, hidden, heads, GPUs, global batch, published (pp, mbs, vpp)
TABLE3 = (("22B", 48, 6144, 64, 8, 4, (1, 4, 1)),
          ("175B", 96, 12288, 96, 64, 64, (8, 1, 3)),
          ("530B", 105, 20480, 128, 280, 280, (35, 1, 3)),
          ("1T", 128, 25600, 160, 512, 512, (64, 1, 1)))


def published(row):
    name, layers, hidden, heads, gpus, gb, (pp, mbs, vpp) = row
    spec = f"gpt:layers={layers},hidden={hidden},heads={heads},seq=2048,vocab=51200,attention=math"
    cluster = f"dgx-a100-80g:nodes={gpus // 8}"
    cfg = ParallelConfig(dp=gpus // (8 * pp), tp=8, pp=pp, mbs=mbs, vpp=vpp, ac=AC.SELECTIVE, sp=True,
                         schedule=Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B)
    return spec, cluster, gb, cfg


@pytest.mark.parametrize("row", TABLE3, ids=[r[0] for r in TABLE3])
def test_search_matches_or_beats_the_published_configuration(row):
    spec, cluster, gb, cfg = published(row)
    # the whole card, as the published runs had it (`costmodel.calibrate._cluster`), for both: the published 175B
    # configuration fills 90.6 % of it with the CUDA context and NCCL's buffers counted
    lg, cl = profile_model(spec), replace(load_cluster(cluster), memory_fraction=1.0)
    pub = estimate(lg, cl, cfg, gb)
    r = search(lg, cl, gb, time_limit=8, progress=False)
    assert r.best.estimate.fits
    if not pub.fits:  # as autopar's runtime would run it: its sequence-parallel linears save the gathered input
        # (torch's DTensor), where Megatron-LM saves the shard, torch's interleaved warm-up leaves the first
        # rank's first chunk (the embedding's) with 2p − 1 micro-batches in flight, and without FSDP it trains
        # under autocast over fp32 parameters (+ their cached 16-bit copies: 18 bytes per parameter, not
        # Megatron's 16, `costmodel.memory.state_bytes_per_param`): 175B needs 79.6 GiB of 79.2 (74.0 with
        # Megatron's states), 530B more, 1T ~90
        assert row[0] in ("175B", "530B", "1T"), f"{row[0]}: the published configuration no longer fits"
        return
    assert r.best.estimate.tokens_per_s >= pub.tokens_per_s * (1 - 1e-9), (row[0], r.best.config, cfg)
