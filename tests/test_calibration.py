"""The cost model against published runs, with the committed constants (costmodel/data/fitted.yaml).

The constants are fitted by `python -m costmodel.calibrate`, one set per device kind over all of the kind's rows;
these tests only predict. Thresholds are the issue's acceptance criteria.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from costmodel import calibrate
from costmodel.hardware import fitted_constants


@pytest.fixture(scope="module")
def predictions():
    rows = calibrate.load_rows()
    return [(row, calibrate.predict(row)) for row in rows]


def _errors(predictions, source):
    return {row.id: est.step_time_s / row.measured_step_s - 1 for row, est in predictions if row.source == source}


def test_constants_are_fitted_and_say_on_what():
    for kind in ("a100", "h100"):
        fit = fitted_constants(kind)
        assert fit is not None, f"no fitted constants for {kind}: run python -m costmodel.calibrate"
        assert "published runs" in fit["source"]


def test_korthikanti_table5_iteration_times(predictions):
    """Korthikanti et al. 2022 Table 5: 22B/175B/530B/1T, full recomputation and selective + SP (8 runs):
    each within 8 %, mean absolute error ≤ 5 %."""
    errs = _errors(predictions, "korthikanti")
    assert len(errs) == 8
    worst = max(errs, key=lambda k: abs(errs[k]))
    assert abs(errs[worst]) <= 0.08, f"{worst}: {errs[worst]:+.1%}"
    assert sum(abs(e) for e in errs.values()) / len(errs) <= 0.05


def test_llm_foundry_throughput_and_fit(predictions):
    """llm-foundry MPT rows (FSDP, A100 40/80 GB and H100): mean absolute error ≤ 10 % over all rows, and every
    published run is predicted to fit in memory."""
    errs = _errors(predictions, "llm-foundry")
    assert len(errs) >= 200
    assert sum(abs(e) for e in errs.values()) / len(errs) <= 0.10
    no_fit = [row.id for row, est in predictions if row.source == "llm-foundry" and not est.fits]
    assert not no_fit, no_fit[:5]


def test_torchtitan_rows_under_the_torch_native_stack(predictions):
    """torchtitan's published Llama 3.1 runs on H100 (FSDP, FSDP + TP; eager, compiled, float8 tensorwise), under
    the torch-native stack's own constants (`costmodel.stacks`): mean absolute error ≤ 3 % over the 12 rows (1.1 %)
    and every row within 8 % (issue 15). The worst is the async-TP report's 8B float8 row at tp = 8 (−7.1 %:
    predicted faster than measured; its bf16 twin at +0.2 %). It was at −10.5 % while float8's casts were left in
    the fitted fp8 efficiency (0.77, now 0.92: the GEMMs' own), the head was priced in float8 (torchtitan leaves it
    16-bit) and the max-abs all-reduces over the TP group went unpriced (`costmodel.layercost.float8_cast_costs`,
    `is_float8_linear`): its small tensor-parallel linears cast the most bytes per FLOP. The two 8B TP = 8 rows
    were at −10.3 % and −13.4 % before the copies torch makes around sequence-parallel collectives were costed
    (`costmodel.layercost.sp_relayout_bytes`), with float8's all-gathers and the whole activations split linears
    move. Held out of the fit in turn (leave-one-out, measured before float8's casts were priced), ten rows were
    predicted within 4.9 %, that float8 row at −12.1 % and the one 32K-token row at +19.5 %: it alone pins the
    attention's efficiency (without it the fit trades attention 0.84 → 0.55 for matmul e_max 0.54 → 0.62 at an
    equal objective); mean 4.6 %."""
    errs = _errors(predictions, "torchtitan")
    assert len(errs) == 12
    assert sum(abs(e) for e in errs.values()) / len(errs) <= 0.03, errs
    assert all(abs(e) <= 0.08 for e in errs.values()), errs


def test_torchtitan_runs_fit_and_their_published_memory(predictions):
    """Every published run ran, so each is predicted to fit its card; and torchtitan's reports give each run's peak
    memory (the most over its GPUs, as its memory monitor reports it: what torch's caching allocator reserved, at
    least what it allocated), which the predicted peak stays at most 20 % under and 2 % over (measured: −13.2 % to
    −2.1 %). The 70B FSDP + TP row (tp 8, local batch 16, 71.9 GiB published) was predicted at 174 GiB, not to fit,
    while the loss-parallel backward was priced as twice the whole vocabulary's logits."""
    import json

    no_fit = [row.id for row, est in predictions if not est.fits]
    assert not no_fit, no_fit
    records = json.loads(calibrate.DATA.read_text())["records"]
    published = {r["id"]: r["measured"]["memory_GiB_max_over_gpus"] for r in records
                 if r["measured"].get("memory_GiB_max_over_gpus")}
    checked = {row.id: est.memory.peak / 2**30 / published[row.id] - 1 for row, est in predictions
               if row.source == "torchtitan" and row.id in published}
    assert len(checked) == 8, sorted(checked)
    assert all(-0.20 <= e <= 0.02 for e in checked.values()), checked


def test_each_stack_has_its_constants_where_it_has_rows():
    """torch-native has H100 constants of its own, fitted on its rows and saying so; a stack without rows on a kind
    (torch-native on A100) keeps the kind's; a preset takes its stack as an option, default torch-native."""
    from costmodel.cluster import load_cluster
    from costmodel.hardware import get_device
    from costmodel.stacks import describe, stack_constants

    own = stack_constants("h100", "torch-native")
    assert own is not None and "torchtitan" in own["source"]
    assert stack_constants("a100", "torch-native") is None
    assert "no torch-native rows" in describe("a100", "torch-native")
    native, megatron = load_cluster("dgx-h100"), load_cluster("dgx-h100:nodes=2:stack=megatron")
    assert (native.stack, megatron.stack, megatron.nodes) == ("torch-native", "megatron", 2)
    assert native.device.matmul_eff.e_max == own["matmul_e_max"]
    assert megatron.device.matmul_eff == get_device("h100-sxm").matmul_eff  # the kind's own constants
    assert load_cluster("dgx-a100-80g").device.matmul_eff == get_device("a100-80g").matmul_eff
    with pytest.raises(ValueError, match="unknown software stack"):
        load_cluster("dgx-h100:stack=deepspeed")


def test_each_published_run_is_priced_with_its_torch_s_checkpoint():
    """Full checkpointing's recomputation stops early in torch >= 2.1 only (`costmodel.layercost.recompute_stop`):
    llm-foundry's A100 tables of May 2023 ran torch 1.13.1 (all 78 A100 40 GB rows and the two 70B ``bf16`` rows of
    the A100 80 GB table), its October 2023 rows torch 2.1 (`calibrate._torch_1_13`), Megatron-LM its own
    checkpoint that reruns the block whole, torchtitan today's torch."""
    rows = calibrate.load_rows()
    whole: dict[str, set[bool]] = {}
    for row in rows:
        whole.setdefault(row.table, set()).add(not row.evaluator_options["checkpoint_early_stop"])
    assert whole.pop("Korthikanti et al. 2022, Table 5") == {True}
    assert whole.pop(next(t for t in whole if "A100 40GB" in t)) == {True}
    mixed = next(t for t in whole if "A100 80GB" in t)
    assert whole.pop(mixed) == {True, False}  # (59 torch 2.1 rows, two torch 1.13 ones)
    assert sorted(r.id.split("_")[3] for r in rows if r.table == mixed and r.checkpoint_early_stop is False) == [
        "70b", "70b"]
    assert whole and all(flags == {False} for flags in whole.values()), whole  # every H100 and torchtitan table


def test_korthikanti_table4_layer_times():
    """Korthikanti Table 4: forward and backward of one 22B layer (t = 8, b = 4), each within 15 %."""
    rows = calibrate.table4(file=open("/dev/null", "w"))
    assert len(rows) == 5
    for rid, fwd_pub, fwd, bwd_pub, bwd in rows:
        assert fwd == pytest.approx(fwd_pub, rel=0.15), rid
        assert bwd == pytest.approx(bwd_pub, rel=0.15), rid


def test_no_job_is_predicted_slower_on_an_h100_than_on_an_a100():
    """Physical plausibility of the fitted constants (issue 15): at the same precision an H100 reaches at least an
    A100's FLOP/s on every GEMM size, memory-bound op and fused attention, and so every job below (small and large
    GEMMs, tensor and pipeline parallel, recomputation) is predicted at least as fast on a DGX-H100 as on a DGX-A100.
    The constants fitted without a floor failed it: a 2048³ GEMM at 57 TFLOP/s on the H100, 140 on the A100."""
    from costmodel.cluster import load_cluster
    from costmodel.config import ParallelConfig, parse_kv
    from costmodel.estimate import estimate
    from costmodel.hardware import get_device
    from costmodel.layercost import attention_len_eff
    from profiler.api import profile_model

    # every device of the faster kind against every device of the slower, under the kinds' own constants and
    # torch-native's: h100-hbm2e (2.4 TB/s), at the h100 kind's memory efficiency fitted on h100-sxm (3.35 TB/s),
    # moved memory-bound ops at 0.72× an A100-80G's rate until `hardware.bandwidth_floor`
    pairs = [(get_device(h), get_device(a)) for h in ("h100-sxm", "h100-hbm2e", "h200")
             for a in ("a100-40g", "a100-80g")]
    pairs += [(load_cluster(h).device, load_cluster(a).device) for h in ("dgx-h100", "grand-teton", "dgx-h200")
              for a in ("dgx-a100-80g", "dgx-a100-40g")]
    assert get_device("h100-hbm2e").memory_eff > get_device("h100-sxm").memory_eff  # (the floor binds there)
    for h, a in pairs:
        for exp in range(12, 61):  # 4 kFLOP … 1 EFLOP per GEMM
            f = 2.0 ** exp
            assert h.peak("bf16") * h.matmul_eff(f) >= a.peak("bf16") * a.matmul_eff(f), f
        assert h.hbm_bw * h.memory_eff >= a.hbm_bw * a.memory_eff
        assert h.peak("bf16") * h.attention_eff >= a.peak("bf16") * a.attention_eff
        for exp in range(20, 61, 4):  # fused attention of 1 MFLOP … 1 EFLOP per call, at 16 … 1M tokens
            for length in (2.0 ** e for e in range(4, 21)):
                f = 2.0 ** exp
                assert (h.peak("bf16") * h.matmul_eff(f) * h.attention_eff
                        * attention_len_eff(length, h.attention_seq_half)
                        >= a.peak("bf16") * a.matmul_eff(f) * a.attention_eff
                        * attention_len_eff(length, a.attention_seq_half)), (f, length)
    for model, gb, configs in (("gpt-small", 64, ("dp=8", "tp=8", "dp=2,tp=2,pp=2,mbs=2", "dp=8,zero=3,ac=full",
                                                  "tp=4,dp=2,sp=on,ac=selective")),):
        lg = profile_model(model)
        for text in configs:
            cfg = ParallelConfig(**parse_kv(text))
            for stack in ("torch-native", "megatron"):
                for h in ("dgx-h100", "grand-teton"):
                    fast = estimate(lg, load_cluster(f"{h}:stack={stack}"), cfg, gb).step_time_s
                    slow = estimate(lg, load_cluster(f"dgx-a100-80g:stack={stack}"), cfg, gb).step_time_s
                    assert fast <= slow, (model, text, stack, h, fast, slow)


def test_anchoring_on_one_row_reproduces_it():
    """`python -m costmodel.calibrate --cv`'s anchored step: the one constant a single run identifies (e_max) is
    moved until that run is predicted exactly; the other constants are kept."""
    import dataclasses

    from costmodel.hardware import fitted_constants

    row = next(r for r in calibrate.load_rows() if r.id == "korthikanti22_t5_22B_sp_selective")
    start = dataclasses.replace(calibrate._kept(fitted_constants("a100")), e_max=0.5)
    moved = calibrate._anchored(row, start)
    assert calibrate.predict(row, moved).step_time_s == pytest.approx(row.measured_step_s, rel=1e-3)
    assert dataclasses.replace(moved, e_max=0.5) == start


def test_the_optimiser_parameters_of_the_kept_constants_give_them_back():
    """`calibrate._pack` inverts `_unpack`, with and without the faster kind's floor: a refit can start from the
    constants in use (the torch-native stack's sit under the A100's floor). A constant on a bound of its range
    (the torch-native overlap_slowdown at 0.5) comes back just inside it, by 1e-9 of the range (`calibrate._logit`)."""
    from costmodel.stacks import fitted

    kept = fitted()
    floor = calibrate._floor(1, {"a100": (calibrate._kept(kept["a100"]), "", [])})
    for entry, fl, fp8 in ((kept["a100"], None, False), (kept["h100"], floor, True),
                           (kept["stacks"]["torch-native"]["h100"], floor, True)):
        k = calibrate._kept(entry)
        held = {} if fp8 else {"fp8_eff": k.fp8_eff}
        back = calibrate._unpack(calibrate._pack(k, fl, held), fl, held)
        for name in ("e_max", "f_half", "memory_eff", "overlap_slowdown", "attention_eff") + (("fp8_eff",) * fp8):
            assert getattr(back, name) == pytest.approx(getattr(k, name), rel=1e-8), name
        assert back.attention_seq_half == pytest.approx(k.attention_seq_half, abs=1e-4)
    # a constant held in the middle of the order keeps the others in place; held below the floor's range, it is
    # clipped into it (the H100's fused attention no slower than the A100's)
    k = calibrate._kept(kept["h100"])
    held = {"memory_eff": k.memory_eff, "attention_eff": 0.05}
    x = calibrate._pack(k, floor, held)
    assert len(x) == 5
    back = calibrate._unpack(x, floor, held)
    assert (back.e_max, back.overlap_slowdown, back.fp8_eff) == pytest.approx((k.e_max, k.overlap_slowdown, k.fp8_eff))
    low = calibrate._ranges(back.e_max, back.f_half, floor)["attention_eff"][0]
    assert low > 0.2 and back.attention_eff == low
    with pytest.raises(ValueError, match="3 parameters for 5 free constants"):
        calibrate._unpack(x[:3], floor, held)


def test_a_refit_never_makes_the_kept_constants_worse(monkeypatch):
    """`calibrate.fit` starts from the kept constants too, so a refit on the same rows is monotone. The objective
    here has its minimum in a narrow well at the kept constants, which the seeded search misses: cold, the fit
    lands elsewhere; warm, it keeps them."""
    import math

    from costmodel.hardware import fitted_constants

    # (overlap_slowdown moved inside its range: a constant fitted on a bound packs to a logit of ~20, where this
    # test's bowl at 0 would outweigh its well)
    kept = dataclasses.replace(calibrate._kept(fitted_constants("a100")), overlap_slowdown=0.4,
                               attention_seq_half=1000.0)
    target = calibrate._pack(kept, None, ("fp8_eff",))

    def error(rows, k):
        x = calibrate._pack(k, None, ("fp8_eff",))
        d2 = sum((a - b) ** 2 for a, b in zip(x, target))
        return 1.0 - 0.9 * math.exp(-d2 / 1e-4) + 1e-3 * sum(v * v for v in x)  # a well at kept; a bowl at 0

    monkeypatch.setattr(calibrate, "_error", error)
    # (every constant free but fp8_eff, as bf16 rows would leave them)
    monkeypatch.setattr(calibrate, "unidentified", lambda rows, start: ("fp8_eff",))
    cold, cold_err = calibrate.fit([])
    warm, warm_err = calibrate.fit([], kept=kept)
    assert warm_err <= error([], kept) + 1e-9 < cold_err
    assert warm.e_max == pytest.approx(kept.e_max, rel=1e-3) and warm.f_half == pytest.approx(kept.f_half, rel=1e-2)


def test_a_constant_no_row_depends_on_is_held_where_it_was(monkeypatch):
    """Korthikanti's Megatron-LM of 2022 ran unfused attention on tp × pp = every GPU (no data-parallel gradient
    to overlap): no row depends on the fused-attention efficiency, the overlap slowdown or the fp8 efficiency, and
    a fit on them holds those at the published priors (cold) or at the kept constants (warm), whatever the
    objective would prefer. A run with FlashAttention identifies attention_eff; a float8 run, fp8_eff."""
    rows = calibrate.load_rows()
    korthikanti = [r for r in rows if r.source == "korthikanti"][:2]
    assert calibrate.unidentified(korthikanti, calibrate.PRIOR) == ("overlap_slowdown", "attention_eff", "fp8_eff",
                                                                     "attention_seq_half")
    flash = next(r for r in rows if r.source == "llm-foundry" and r.config.precision != "fp8")
    fp8 = next(r for r in rows if r.source == "torchtitan" and r.config.precision == "fp8")
    assert "attention_eff" not in calibrate.unidentified([flash], calibrate.PRIOR)
    assert calibrate.unidentified([fp8], calibrate.PRIOR) == ("attention_seq_half",)  # (one length)

    # an objective whose minimum is at attention_eff 0.29 and overlap_slowdown 0.1 cannot move them
    def error(rows, k):
        return (k.e_max - 0.7) ** 2 + (k.attention_eff - 0.29) ** 2 + (k.overlap_slowdown - 0.1) ** 2

    monkeypatch.setattr(calibrate, "_error", error)
    cold, _ = calibrate.fit(korthikanti)
    kept = dataclasses.replace(calibrate.PRIOR, attention_eff=0.6, overlap_slowdown=0.3, fp8_eff=0.9)
    warm, _ = calibrate.fit(korthikanti, kept=kept)
    assert cold.e_max == pytest.approx(0.7, abs=1e-3)
    assert (cold.attention_eff, cold.overlap_slowdown, cold.fp8_eff) == (
        calibrate.PRIOR.attention_eff, calibrate.PRIOR.overlap_slowdown, calibrate.PRIOR.fp8_eff)
    assert (warm.attention_eff, warm.overlap_slowdown, warm.fp8_eff) == (0.6, 0.3, 0.9)


def test_the_attention_half_point_needs_three_lengths_and_a_stack_with_fewer_takes_its_kinds(monkeypatch):
    """``attention_seq_half`` is identified by runs of fused attention at three sequence lengths or more
    (llm-foundry sweeps 512-65536 tokens); at one it only trades against ``attention_eff``, at two it would be set
    by the second length's noise, so a fit holds it: torchtitan's rows (eleven at 8192 tokens, one at 32768) under
    the torch-native stack take the device kind's, fitted on Composer's rows of the same FlashAttention
    (`calibrate.KERNEL_CONSTANTS`), whatever their objective would prefer; cold without a kind, the prior (no
    dependence)."""
    rows = calibrate.load_rows()
    a100 = [r for r in rows if r.table.startswith("llm-foundry A100 80GB")]
    three = [next(r for r in a100 if f"_seq{n}_" in r.id) for n in (512, 2048, 8192)]
    assert [calibrate.attention_length(r) for r in three] == [512, 2048, 8192]
    assert "attention_seq_half" not in calibrate.unidentified(three, calibrate.PRIOR)
    assert "attention_seq_half" in calibrate.unidentified(three[:2], calibrate.PRIOR)
    titan = [r for r in rows if r.source == "torchtitan"]
    assert sorted(calibrate.attention_length(r) for r in titan) == [8192] * 11 + [32768]
    assert "attention_seq_half" in calibrate.unidentified(titan, calibrate.PRIOR)
    titan = titan[:2]

    monkeypatch.setattr(calibrate, "_error", lambda rows, k: (k.e_max - 0.7) ** 2 + (k.attention_seq_half - 50) ** 2)
    kind = dataclasses.replace(calibrate.PRIOR, attention_seq_half=777.0)
    assert calibrate.fit(titan, kind=kind)[0].attention_seq_half == 777.0
    assert calibrate.fit(titan)[0].attention_seq_half == calibrate.PRIOR.attention_seq_half == 0.0


def test_a_stack_kept_in_a_refit_of_its_kind_takes_the_kind_s_new_curve_and_half_point(monkeypatch):
    """``--only h100`` refits the H100's own constants and keeps the torch-native stack's, but for its matmul
    curve's shape, always its kind's (`calibrate.KIND_CURVE`), and the half-point its rows (two lengths) cannot
    identify (`calibrate.KERNEL_CONSTANTS`): those are the refitted kind's."""
    kept = calibrate._kept(fitted_constants("h100"))
    refit = dataclasses.replace(kept, attention_seq_half=300.0, f_half=1.5e10)
    monkeypatch.setattr(calibrate, "fit", lambda rows, floor=None, kept=None, kind=None: (refit, 0.0))
    rows = [r for r in calibrate.load_rows() if r.kind == "h100"]
    fits, stacks = calibrate.fit_all(rows, only="h100")
    assert fits["h100"][0] == calibrate.as_written(refit)
    native = stacks["torch-native"]["h100"][0]
    assert (native.attention_seq_half, native.f_half) == (300.0, 1.5e10)
    own = calibrate._kept(calibrate.fitted()["stacks"]["torch-native"]["h100"])
    assert dataclasses.replace(native, attention_seq_half=own.attention_seq_half, f_half=own.f_half) == own


def test_a_stack_takes_its_kind_s_matmul_curve_shape_whatever_its_rows_prefer(monkeypatch):
    """A stack's GEMMs are its kind's library's, so its fit holds ``f_half`` at the kind's (`calibrate.KIND_CURVE`)
    and moves ``e_max`` only, whatever its objective would prefer; without a kind (a kind's own fit) ``f_half`` is
    fitted. The committed torch-native constants carry the H100 kind's half-point."""
    rows = [r for r in calibrate.load_rows() if r.source == "torchtitan"][:2]
    monkeypatch.setattr(calibrate, "_error",
                        lambda rows, k: (k.e_max - 0.7) ** 2 + (math.log(k.f_half) - math.log(3e8)) ** 2)
    kind = dataclasses.replace(calibrate.PRIOR, f_half=2e10)
    k = calibrate.fit(rows, kind=kind)[0]
    assert k.f_half == 2e10 and k.e_max == pytest.approx(0.7, abs=1e-3)
    assert calibrate.fit(rows)[0].f_half == pytest.approx(3e8, rel=1e-2)
    committed = calibrate.fitted()
    assert committed["stacks"]["torch-native"]["h100"]["matmul_f_half"] == committed["h100"]["matmul_f_half"]


def test_a_faster_kind_and_its_stacks_take_the_slower_kind_s_overlap_slowdown(monkeypatch):
    """How much compute slows beside the collectives is fitted on the slowest kind's rows and held on every faster
    kind and each stack on it (`calibrate.FROM_SLOWER`): under a floor, a fit returns the slower kind's whatever
    its objective prefers; without one it fits it; the committed constants carry it."""
    a100 = calibrate._kept(fitted_constants("a100"))
    floor = calibrate._floor(1, {"a100": (a100, "", [])})

    def error(rows, k):  # (a minimum at overlap_slowdown 0.1)
        return (k.e_max - 0.7) ** 2 + (k.overlap_slowdown - 0.1) ** 2

    monkeypatch.setattr(calibrate, "_error", error)
    monkeypatch.setattr(calibrate, "unidentified", lambda rows, start: ("fp8_eff",))
    assert calibrate.fit([], floor)[0].overlap_slowdown == a100.overlap_slowdown
    assert calibrate.fit([])[0].overlap_slowdown == pytest.approx(0.1, abs=1e-3)
    h100 = dataclasses.replace(calibrate._kept(fitted_constants("h100")), overlap_slowdown=0.2)
    assert calibrate._into_floor(h100, floor).overlap_slowdown == a100.overlap_slowdown  # (a kept one, `--only`)
    written = calibrate.fitted()
    faster = [written["h100"]] + [k for kinds in written["stacks"].values() for kind, k in kinds.items()
                                  if kind != "a100"]
    assert [k["overlap_slowdown"] for k in faster] == [written["a100"]["overlap_slowdown"]] * len(faster)


def test_a_faster_kind_s_attention_half_point_keeps_it_no_slower_at_any_length():
    """`calibrate._seq_half_top`: at the largest half-point the floor allows, the faster kind's fused attention is
    as fast as the slower kind's on the shortest sequences and faster on every longer one; past it, slower on
    short ones."""
    from costmodel.layercost import attention_len_eff

    slower = dataclasses.replace(calibrate._kept(fitted_constants("a100")), attention_eff=0.7,
                                 attention_seq_half=1000.0)
    for gemm, attention_eff in ((1.0, 0.7), (3.2, 0.3), (3.2, 0.9)):
        top = calibrate._seq_half_top(slower, gemm, attention_eff)
        assert top >= slower.attention_seq_half  # (the faster kind's long-sequence rate is at least the slower's)

        def rate(h: float, length: float, gemm: float = gemm, attention_eff: float = attention_eff) -> float:
            return gemm * attention_eff * attention_len_eff(length, h)

        for length in (1.0, 64.0, 512.0, 2048.0, 65536.0):
            assert rate(top, length) >= slower.attention_eff * attention_len_eff(length, 1000.0) * (1 - 1e-9)
        if top < calibrate.SEQ_HALF_MAX:
            assert rate(top * 1.01, 1.0) < slower.attention_eff * attention_len_eff(1.0, 1000.0)


def test_constants_are_written_at_or_above_the_floor_of_the_slower_kinds_as_written():
    """`calibrate.as_written` rounds every constant the way that makes the device faster, and `fit_all` takes a
    faster kind's floor from the slower kinds' constants as written: the H100's memory efficiency fitted at the
    floor of the A100's unrounded 0.93827 was written 0.5711, under the rounded A100's 0.9383 × 2039 / 3350 =
    0.571101. A kept constant under a refitted slower kind's floor is moved into it (`_into_floor`)."""
    from costmodel.hardware import get_device

    a100 = dataclasses.replace(calibrate._kept(fitted_constants("a100")), memory_eff=0.93827)
    written = calibrate.as_written(a100)
    assert written.memory_eff == 0.9383 and calibrate.as_written(written) == written
    floor = calibrate._floor(1, {"a100": (written, "", [])})
    h100 = dataclasses.replace(calibrate._kept(fitted_constants("h100")), memory_eff=0.5711)
    moved = calibrate.as_written(calibrate._into_floor(h100, floor))
    a, h = get_device("a100-80g"), get_device("h100-sxm")
    assert h.hbm_bw * moved.memory_eff >= a.hbm_bw * written.memory_eff > h.hbm_bw * h100.memory_eff
    assert moved.memory_eff == 0.5712
    assert dataclasses.replace(moved, memory_eff=h100.memory_eff) == h100  # (the others were inside already)
    fast = dataclasses.replace(h100, overlap_slowdown=0.43549, attention_seq_half=407.9, f_half=3.36549e10)
    assert calibrate.as_written(fast) == dataclasses.replace(h100, overlap_slowdown=0.4354, attention_seq_half=407.0,
                                                             f_half=3.365e10)


def test_a_fit_on_a_device_with_less_bandwidth_than_its_kind_s_is_bounded_at_that_device_s():
    """The fit's memory-efficiency floor (`calibrate._floor`, `_ranges`) and the price's
    (`costmodel.hardware.bandwidth_floor`) are one bound: the torch-native stack's rows run on h100-hbm2e (2.4 TB/s),
    so their fit keeps its memory-bound ops at the A100-80G's achieved bandwidth, 0.797 of its peak, not the
    h100-sxm's 0.571; the kind's own rows (dgx-h100) keep the h100-sxm's ratio."""
    from costmodel.hardware import bandwidth_floor, get_device

    rows = calibrate.load_rows()
    a100 = calibrate._kept(fitted_constants("a100"))
    native = calibrate._floor(1, {"a100": (a100, "", [])}, [r for r in rows if r.stack == "torch-native"])
    own = calibrate._floor(1, {"a100": (a100, "", [])}, [r for r in rows if r.kind == "h100" and r.stack == "composer"])
    assert own == calibrate._floor(1, {"a100": (a100, "", [])})
    for floor, device in ((native, "h100-hbm2e"), (own, "h100-sxm")):
        low = calibrate._ranges(0.6, 3e10, floor)["memory_eff"][0]
        dev = get_device(device)
        assert low == pytest.approx(bandwidth_floor(device, dev.hbm_bw)[0], rel=1e-12)
        assert low * dev.hbm_bw == pytest.approx(a100.memory_eff * get_device("a100-80g").hbm_bw, rel=1e-12)
    # the committed torch-native constants sit inside their bound, so the price of their rows is the fit's
    from costmodel.stacks import stack_constants

    committed = stack_constants("h100", "torch-native")["memory_eff"]
    assert committed >= calibrate._ranges(0.6, 3e10, native)["memory_eff"][0]
    # and a row there priced with constants fitted elsewhere (a fold's fallback to the kind's) is priced as the
    # planner prices the kind's constants on that device, at the floor
    from costmodel.cluster import load_cluster

    kind = calibrate._kept(fitted_constants("h100"))
    applied = kind.apply(calibrate._cluster("grand-teton:stack=torch-native"), "fold").device.memory_eff
    planned = load_cluster("grand-teton:stack=megatron").device.memory_eff  # (megatron: the kind's constants)
    assert applied == planned == bandwidth_floor("h100-hbm2e", get_device("h100-hbm2e").hbm_bw)[0] > kind.memory_eff


def test_a_fit_is_priced_under_the_slower_kinds_being_fitted_beside_it_not_the_committed_ones(monkeypatch):
    """A row on h100-hbm2e is priced with its memory efficiency raised to the A100's achieved bandwidth
    (`costmodel.hardware.bandwidth_floor`). In a full refit the A100 is refitted first, so the torch-native fit
    prices its rows under the new A100 (`calibrate._priced_under`), as `autopar plan` will once both are written,
    not under the committed one; so does a cross-validation fold, under its own A100. Outside, the catalogue is
    the file's again. (`fit` replaced: the A100's fit returns the committed constants at another memory
    efficiency; the others record the floor their rows are priced at.)"""
    from costmodel.hardware import bandwidth_floor, get_device

    committed = calibrate._kept(fitted_constants("a100"))
    new_a100 = dataclasses.replace(committed, memory_eff=round(committed.memory_eff * 0.8, 4))
    hbm2e = get_device("h100-hbm2e").hbm_bw
    seen = {}

    def fake_fit(rows, floor=None, kept=None, kind=None):
        if rows[0].kind == "a100":
            return new_a100, 0.0
        low = dataclasses.replace(committed, memory_eff=0.2)  # (under every floor: the price raises it)
        cluster = calibrate._cluster(f"{rows[0].cluster}:stack={rows[0].stack}")
        seen[rows[0].stack] = low.apply(cluster, "fit").device.memory_eff
        return floor[0] if floor else committed, 0.0

    monkeypatch.setattr(calibrate, "fit", fake_fit)
    rows = [r for r in calibrate.load_rows() if r.table != "Korthikanti 2022 Table 5"]
    calibrate.fit_all(rows, warm=False)
    a100_bw = get_device("a100-80g").hbm_bw
    assert seen["torch-native"] == pytest.approx(new_a100.memory_eff * a100_bw / hbm2e, rel=1e-9)
    assert seen["torch-native"] < committed.memory_eff * a100_bw / hbm2e
    # outside the fit: the file's constants again, and the floor the planner prices with
    assert calibrate.fitted()["a100"]["memory_eff"] == committed.memory_eff
    assert get_device("a100-80g").memory_eff == committed.memory_eff
    planned = bandwidth_floor("h100-hbm2e", hbm2e)[0]
    assert planned == pytest.approx(committed.memory_eff * a100_bw / hbm2e, rel=1e-9)
    # a fold prices its held rows under its own A100
    titan = [r for r in rows if r.source == "torchtitan"][:1]
    ks, contents = calibrate._fits_without(rows, titan)
    assert contents["a100"]["memory_eff"] == new_a100.memory_eff
    low = dataclasses.replace(ks[titan[0].kind, titan[0].stack], memory_eff=0.2)
    cluster = f"{titan[0].cluster}:stack={titan[0].stack}"
    with calibrate._priced_under(contents):
        inside = low.apply(calibrate._cluster(cluster), "fold").device.memory_eff
    assert inside == pytest.approx(new_a100.memory_eff * a100_bw / hbm2e, rel=1e-9)
    assert low.apply(calibrate._cluster(cluster), "fold").device.memory_eff == planned


def test_a_cross_validation_fold_fits_only_the_kinds_its_table_runs_on(monkeypatch):
    """`calibrate._fits_without`: leaving out Korthikanti's A100 rows refits the A100 alone (no H100 fit, no
    torch-native one); leaving out torchtitan's H100 rows fits the A100 too, for the H100's floor; every (kind,
    stack) of the held rows gets constants."""
    from costmodel.stacks import fitted

    kept = calibrate._kept(fitted()["a100"])
    fitted_on = []

    def fake_fit(rows, floor=None, kept_=None):
        fitted_on.append({(r.kind, r.stack) for r in rows})
        return kept, 0.0

    monkeypatch.setattr(calibrate, "fit", fake_fit)
    rows = calibrate.load_rows()
    ks, _ = calibrate._fits_without(rows, [r for r in rows if r.source == "korthikanti"])
    assert fitted_on == [{("a100", "composer")}] and set(ks) == {("a100", "megatron")}
    fitted_on.clear()
    ks, _ = calibrate._fits_without(rows, [r for r in rows if r.source == "torchtitan"])
    assert fitted_on == [{("a100", "megatron"), ("a100", "composer")}, {("h100", "composer")}]
    assert set(ks) == {("h100", "torch-native")}
    assert calibrate._needed_kinds(["h100"]) == {"a100", "h100"} and calibrate._needed_kinds(["a100"]) == {"a100"}


def _optimisers_at_their_start(monkeypatch, shift: float = 0.0) -> list:
    """Replace `calibrate.fit`'s optimisers by their starting points (differential evolution: the middle of its
    bounds, plus ``shift``; Nelder-Mead: where it starts); return the parameter count of each differential evolution
    run, as they happen."""
    import types

    import scipy.optimize

    runs = []

    def start(f, bounds, **_):
        runs.append(len(bounds))
        return types.SimpleNamespace(x=[(lo + hi) / 2 + shift for lo, hi in bounds])

    monkeypatch.setattr(scipy.optimize, "differential_evolution", start)
    monkeypatch.setattr(scipy.optimize, "minimize", lambda f, x, **_: types.SimpleNamespace(x=x, fun=f(x)))
    return runs


def _two_rows_of_each_table(keep=lambda table: True) -> tuple[list, dict]:
    """The first two published rows of each table ``keep`` accepts, and the rows taken per table."""
    rows, per_table = [], {}
    for r in calibrate.load_rows():
        if per_table.get(r.table, 0) < 2 and keep(r.table):
            per_table[r.table] = per_table.get(r.table, 0) + 1
            rows.append(r)
    return rows, per_table


def test_cross_validation_by_published_table_shares_the_fits_no_fold_changes(monkeypatch):
    """`cross_validate(by="table")` leaves out one published table at a time; a fit whose rows several folds
    leave whole (the A100's, for every H100 table) runs once. Counted with the optimisers replaced by their
    starting points, on two rows of each of six tables: 9 fits where fold by fold would make 14."""
    import io

    runs = _optimisers_at_their_start(monkeypatch)
    rows, per_table = _two_rows_of_each_table(lambda t: "FP8" not in t and "40GB" not in t and (
        "Table" not in t or "Table 1" in t or "Korthikanti" in t))
    assert len(per_table) == 6
    out = calibrate.cross_validate(rows, file=io.StringIO(), by="table")
    assert set(out) == set(per_table) and all(v["rows"] == 2 for v in out.values())
    for v in out.values():  # (every anchor predicts the same number of rows: the mean is the anchors' mean)
        assert v["anchored"] == pytest.approx(sum(v["anchored_by_anchor"].values()) / len(v["anchored_by_anchor"]))
    assert len(runs) == 9 and calibrate._FITTED is None


def test_shared_fits_are_the_fits_each_fold_would_make_alone(monkeypatch):
    """`calibrate._FITTED`: with the fits shared, every table's fold gets the constants a fold computing everything
    itself (the memo off) gets; a fit under another floor is another fit (optimisers replaced by their starting
    points, which move with the floor)."""
    import dataclasses

    _optimisers_at_their_start(monkeypatch, shift=0.3)
    rows, per_table = _two_rows_of_each_table()
    alone = {t: calibrate._fits_without(rows, [r for r in rows if r.table == t]) for t in per_table}
    monkeypatch.setattr(calibrate, "_FITTED", {})
    shared = {t: calibrate._fits_without(rows, [r for r in rows if r.table == t]) for t in per_table}
    assert shared == alone and len(calibrate._FITTED) < 2 * len(per_table)
    h100 = [r for r in rows if r.kind == "h100" and r.stack == "composer"]
    a100 = calibrate._kept(calibrate.fitted()["a100"])
    floor = calibrate._floor(1, {"a100": (a100, "", [])})
    other = (dataclasses.replace(floor[0], e_max=floor[0].e_max / 2), *floor[1:])
    assert calibrate.fit(h100, floor) != calibrate.fit(h100, other)


def test_cross_validation_in_parallel_gives_the_sequential_result(monkeypatch):
    """`cross_validate(jobs=2)`: the folds in worker processes, the H100 fold after the fits on every row it
    shares, give what one process gives, fold by fold (optimisers replaced by their starting points, the workers
    forked so that they run the replacements)."""
    import io

    _optimisers_at_their_start(monkeypatch)
    monkeypatch.setattr(calibrate, "_START_METHOD", "fork")
    rows, _ = _two_rows_of_each_table()
    text = io.StringIO()
    parallel = calibrate.cross_validate(rows, file=text, jobs=2)
    assert parallel == calibrate.cross_validate(rows, file=io.StringIO(), jobs=1)
    assert sorted(parallel) == ["korthikanti", "llm-foundry", "torchtitan"]
    folds = [line for line in text.getvalue().splitlines() if not line.startswith(" ")]
    assert sorted(line.split(":")[0] for line in folds) == sorted(parallel)
    # each fold's line, then its worst anchors (every row is one): its left-out error and its mean on the rest
    anchors = [line for line in text.getvalue().splitlines() if line.startswith("    anchored on ")]
    counts = [len(v["anchored_by_anchor"]) for v in parallel.values()]
    assert counts == [len({r.id for r in rows if r.source == s}) for s in sorted(parallel)]
    assert len(anchors) == sum(min(n, calibrate.WORST_ANCHORS) for n in counts if n > 1) > 0
    with pytest.raises(ValueError, match="published"):
        calibrate.cross_validate(rows[::-1], jobs=2)


def test_cross_validation_folds_in_parallel_report_each_line_of_progress_behind_their_table():
    import io

    out = io.StringIO()
    stream = calibrate._Prefixed(out, "[t] ")
    stream.write("a100: objective")
    stream.write(" 1%\nh100: objective 2%\n")
    assert out.getvalue() == "[t] a100: objective 1%\n[t] h100: objective 2%\n"
