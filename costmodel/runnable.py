"""What the runtime can run, and how it reduces gradients: one rule set for the cost model, the search, the emitter
and the runtime itself.

A plan the search offers must emit, start, and run as costed. So each condition under which `planner.emit.runtime`
(the code every emitted script and `auto_parallelize` execute) would refuse a configuration, and each choice of
mechanism the cost model must price the same way the runtime makes it, is written once here, as a plain function
of plain values:

- `problems(facts)`: every reason a configuration cannot run, each one line saying what and how to fix. The
  search skips a candidate with any (`planner.search.outer.candidates`), the emitter refuses a plan with one
  (`planner.emit.config.runtime_config`), and the runtime checks its ``PLAN`` dict again at start
  (`planner.emit.runtime.check_world`: an edited script fails before any collective).
- `grad_compress_options(...)`: the data-parallel gradient compressions the runtime applies for a sharding (the ILP
  chooses among them only).
- `checkpoint_modes(...)`: the activation-checkpointing modes a block may take (the ILP chooses among them only).
- `post_step_allreduce(...)`: where gradients are all-reduced after the whole backward rather than in DDP's
  overlapped buckets (`costmodel.overlap.dp_exposed` then hides none of it); `pipelined_fsdp(...)`: where torch's
  pipeline stages hold FSDP's gradients unsharded and reduce-scatter once per step. `ParallelConfig` has both as
  properties (`reduces_after_step`, `fsdp_in_pipeline`) for the cost model and the search.

This module imports nothing but the standard library: the emitter copies it into every script beside the runtime.

``facts`` keys (missing optional ones are not checked): ``dp``, ``tp``, ``pp``, ``vpp``, ``schedule`` (``gpipe``,
``1f1b``, ``interleaved``, ``zb``), ``zero``, ``sp`` (bool), ``grad_compress`` (``none``, ``bf16``, ``fp16``,
``powersgd``), ``precision``, ``micro_batches`` (per pipeline per step), and optionally ``seq``, ``heads``,
``kv_heads``, ``compile`` (the launch's torch.compile backend or None), ``checkpointed`` (any block under AC),
``selective_ac`` (any block under selective AC), ``ep`` (expert-parallel degree, default 1), ``experts`` (experts
per MoE layer; None or 0: not a MoE model the runtime can split), ``expert_dim1`` (the gcd of the expert weights'
second dimensions; None: unknown) and ``tp_unsplit`` (a linear tensor parallelism cannot run,
`profiler.layers.tp_unsplit_linears`; empty: none), ``tp_split`` (why tensor parallelism cannot split the blocks:
one without a column- and row-parallel ``nn.Linear`` pair, `profiler.layers.tp_split_problem`; empty: it can),
``tp_forward`` (why tensor parallelism cannot run the blocks, per
degree as a string, `profiler.layers.tensor_parallel_problems`; a degree not in it: it can, or not judged) and
``sp_layout`` (why sequence parallelism cannot; empty: it can), ``cp``
(context-parallel degree, default 1) and ``cp_ready`` (the model's attention and positions can be split over the
sequence, `profiler.layers.context_parallel_ready`; None: unknown), ``pp_split`` (why the runtime cannot cut the
model into pipeline stages, `profiler.layers.pipeline_split_problem`; empty or None: it can, or unknown),
``forward`` (why the training step cannot call the model for its logits, `profiler.layers.forward_problem`;
empty or None: it can), ``attention_core`` (the blocks make seq×seq attention scores that selective AC can
recompute, `profiler.layers.has_attention_core`; None: unknown: it picks the selective policy, `selective_policy`)
and ``attends`` (the blocks compute that core in an ``attend(q, k, v)`` method, `profiler.layers.has_attend`).
"""

#: fp16 is not: its gradients underflow without loss scaling, which the runtime does not do yet (a GradScaler across
#: FSDP2, DTensor and pipeline stages)
RUNNABLE_PRECISIONS = ("fp32", "bf16")


def attention_scores(shape, batch: int, seq: int) -> bool:
    """Whether a tensor of ``shape`` holds attention scores or probabilities: what selective activation
    checkpointing recomputes, in the runtime's policy; the capture applies the same rule (`profiler.graph.
    attention_scores`, a copy: neither side imports the other's package; tests/test_runnable.py pins them equal).
    Scores are [batch, heads, seq, seq], or [batch·heads, seq, seq] in Megatron's baddbmm attention: a
    trailing square is not enough, since a [batch, seq, width] activation has one wherever width = seq (llama3-70b's
    hidden states at seq 8192), so a 3-D one counts only with leading dimension other than the batch. ``seq`` 0:
    not known. Read wrongly: Megatron's 3-D scores with one head per tensor-parallel rank (as activations), and
    [batch, heads, seq, head_dim] queries where head_dim = seq (as scores)."""
    if len(shape) < 3 or shape[-1] != shape[-2] or shape[-1] <= 1 or (seq and shape[-1] != seq):
        return False
    if len(shape) >= 4:
        return True
    lead = 1
    for d in shape[:-2]:
        lead *= d
    return lead != batch


def post_step_allreduce(dp: int, tp: int, zero: int, schedule: str, pp: int) -> bool:
    """True where data-parallel gradients are averaged by an explicit all-reduce after the whole backward instead of
    DDP's overlapped bucket hooks: tensor parallelism without FSDP (DDP takes no DTensor parameters), and the
    zero-bubble schedule (torch computes its weight gradients with ``autograd.grad`` and writes ``.grad`` by hand,
    so DDP's reducer hooks never fire for them: replicas would silently diverge)."""
    return dp > 1 and zero <= 1 and (tp > 1 or (pp > 1 and schedule == "zb"))


def trains_under_autocast(precision: str, zero: int, data_ranks: int) -> bool:
    """Whether autopar's runtime trains under ``torch.autocast`` over fp32 parameters: 16-bit training outside
    FSDP (DDP, ZeRO-1, one data-parallel rank); FSDP2 (ZeRO 2/3 over dp × cp > 1) casts through its
    mixed-precision policy instead. What the runtime does on GPUs (`planner.emit.train.autocast`), what a check
    traces under CPU autocast, and which capture prices the plan's activations (`costmodel.memory.autocast_dtype`)."""
    return precision in ("bf16", "fp16") and not (data_ranks > 1 and zero >= 2)


def pipelined_fsdp(zero: int, dp: int, pp: int) -> bool:
    """FSDP2 (ZeRO 2/3) inside torch's pipeline stages: ``PipelineStage`` turns off FSDP's gradient sync and its
    reshard after backward for every micro-batch and reduce-scatters once after the last backward
    (torch/distributed/pipelining/stage.py, 2.13: ``backward_maybe_with_nosync``, ``perform_reduce_grad``). So
    the stage holds unsharded gradients (accumulated in the fp32 reduce dtype) and, under ZeRO 3, unsharded
    parameters from its first backward to the end of the step, and reduce-scatters once per step."""
    return pp > 1 and zero >= 2 and dp > 1


#: the selective activation-checkpointing policies, by what they keep (`selective_policy` picks one per model)
SELECTIVE_POLICIES = ("attention-core", "all-but-attention-core", "every-other-matmul")


def selective_policy(attention_core, attends=True) -> str:
    """What ``ac=selective`` does to a model's blocks; the cost model (`costmodel.layercost.CostContext.selective`)
    and the runtime (`planner.emit.runtime.apply_ac`) read this one rule.

    - ``attention-core`` where the blocks make seq×seq attention scores (``attention_core`` true or not known) in
      an ``attend(q, k, v)`` method (``attends``: `profiler.layers.has_attend`; the zoo models' protocol): Korthikanti
      et al. 2022 §4.2, Megatron-LM's selective recomputation, which checkpoints its core attention module: each
      ``attend`` runs under torch's checkpoint, which drops the core's saved tensors and recomputes the core in the
      backward; the rest of the block saves what autograd saves.
    - ``all-but-attention-core`` where such a core is not in an ``attend`` method (a Hugging Face model's eager
      attention, a model of the user's): the block runs under torch's selective checkpoint with a policy that
      recomputes the ops reading or making scores and keeps every other op's output, which is more than autograd
      saves (a norm's intermediates, a residual sum's operands: traced, a zoo GPT with unfused attention held
      more so than without checkpointing).
    - ``every-other-matmul`` where the attention is a fused kernel (``attention_core`` False), which leaves no core
      to recompute: torchtitan's per-op policy (``selective_ac_option = "op"``, the default of its Llama 3
      configurations): the attention kernel's output, every second matmul's (the 1st, 3rd, … of a block's forward)
      and reduce-scatters' are kept, every other op is recomputed."""
    if attention_core is False:
        return "every-other-matmul"
    return "all-but-attention-core" if attends is False else "attention-core"


def grad_compress_options(dp: int, tp: int, zero: int, schedule: str = "1f1b", pp: int = 1,
                          ep: int = 1) -> tuple[str, ...]:
    """The gradient compressions (``none``, ``bf16``, ``fp16``, ``powersgd``) the runtime can apply: DDP comm hooks
    (ZeRO 0/1 under DDP) take all; FSDP2 (ZeRO 2/3) reduces in bf16/fp16 through its ``reduce_dtype`` but has no
    PowerSGD; the explicit post-step all-reduces (`post_step_allreduce`; with expert parallelism under DDP, the
    experts' reduction over edp) compress nothing."""
    if dp == 1 or post_step_allreduce(dp, tp, zero, schedule, pp) or (ep > 1 and zero == 0):
        return ("none",)
    if zero >= 2:
        return ("none", "bf16", "fp16")
    return ("none", "bf16", "fp16", "powersgd")


def checkpoint_modes(tp: int, ep: int = 1, compiled: bool = False, zero_bubble: bool = False, cp: int = 1,
                     attention_core=None) -> tuple[str, ...]:
    """The activation-checkpointing modes a block may take (`problems` refuses the others): none under torch.compile
    with tensor parallelism or under the zero-bubble schedule, no selective AC with expert parallelism or with
    context parallelism (a model the runtime can split over the sequence has a fused attention, whose per-op policy
    `problems` refuses with cp > 1); the search offers the ILP only these. (``attention_core``: kept for callers.)"""
    if (compiled and tp > 1) or zero_bubble:
        return ("none",)
    if ep > 1 or cp > 1:
        return ("none", "full")
    return ("none", "selective", "full")


def problems(facts: dict) -> list:
    """Every reason the runtime cannot run ``facts`` as planned (empty when it can), one actionable line each."""
    f = facts
    dp, tp, pp, zero = f["dp"], f["tp"], f["pp"], f["zero"]
    ranks = dp * f.get("cp", 1)  # those reducing gradients together: data- and context-parallel
    schedule = f["schedule"] if pp > 1 else "1f1b"
    out = []
    if f["precision"] == "fp16":
        out.append("precision=fp16 is not supported by the runtime yet (fp16 gradients need loss scaling, which it "
                   "does not do; the cost model only predicts it); re-plan with --fix precision=bf16")
    elif f["precision"] not in RUNNABLE_PRECISIONS:
        out.append(f"precision={f['precision']} is not supported by the runtime yet (float8 training needs torchao; "
                   "the cost model only predicts it); re-plan with --fix precision=bf16")
    if zero == 1 and tp > 1 and ranks > 1:
        out.append("zero=1 with tp>1 is not supported yet (ZeroRedundancyOptimizer takes no DTensor parameters); "
                   "re-plan with --fix zero=2 or tp=1")
    if tp > 1 and f.get("tp_split"):  # (`profiler.layers.tp_split_problem`)
        out.append(f"tp={tp} cannot run: {f['tp_split']}")
    if tp > 1 and f.get("tp_unsplit"):
        out.append(f"tp={tp} cannot run {f['tp_unsplit']}: a linear beside the column-parallel ones whose name has no "
                   "tensor-parallel layout (multi-head latent attention's projections have none yet); re-plan with "
                   "--fix tp=1")
    if tp > 1 and (why := (f.get("tp_forward") or {}).get(str(tp))):  # (`profiler.layers.tensor_parallel_problems`)
        out.append(f"tp={tp}: {why}")
    if tp > 1 and f.get("sp") and f.get("sp_layout"):
        out.append(f"sp=on: {f['sp_layout']}")
    for key in ("heads", "kv_heads"):
        if tp > 1 and f.get(key) and f[key] % tp:
            out.append(f"tp={tp} does not divide {key}={f[key]}; choose a tp that divides it")
    if f.get("sp") and tp > 1 and f.get("seq") and f["seq"] % tp:
        out.append(f"sequence parallel needs seq={f['seq']} divisible by tp={tp}; re-plan with --fix sp=off or a "
                   "tp that divides the sequence")
    if f.get("forward"):  # (`profiler.layers.forward_problem`: "" when the training step can call the model)
        out.append(f["forward"])
    if pp > 1 and f.get("pp_split"):  # (`profiler.layers.pipeline_split_problem`: "" when the model splits)
        out.append(f"pp={pp}: {f['pp_split']}")
    m = f["micro_batches"]
    # torch runs GPipe and the interleaved schedules with fewer micro-batches than ranks (1F1B refuses), but the cost
    # model prices a full pipeline: m ≥ pp for every schedule
    if pp > 1 and m < pp:
        out.append(f"pp={pp} needs at least {pp} micro-batches per step, but global_batch/(dp·mbs) = {m}; raise "
                   "--global-batch or lower mbs")
    rounds = max(1, m // pp)  # torch 2.13's interleaved schedules run m micro-batches in rounds of m // rounds
    if pp > 1 and schedule in ("interleaved", "zb") and m % rounds:
        out.append(f"schedule={schedule} runs the {m} micro-batches per step in {rounds} equal rounds (torch's "
                   f"ScheduleInterleaved*: m divisible by max(1, m // pp)), which {m} is not; change --global-batch "
                   "or mbs")
    policy = selective_policy(f.get("attention_core"), f.get("attends", True))
    if f.get("selective_ac") and f.get("cp", 1) > 1 and policy != "all-but-attention-core":
        out.append(f"selective activation checkpointing with cp={f['cp']} is not supported yet where its policy is "
                   f"{policy} (it recomputes the context-parallel all-gather of the keys and values, which the cost "
                   "model does not price); re-plan with --fix ac=full or cp=1")
    if pp > 1 and schedule == "zb" and (f.get("checkpointed") or f.get("selective_ac")):
        out.append("activation checkpointing with the zero-bubble schedule is not supported (torch 2.13's weight "
                   "pass asks autograd once per parameter group, stage_backward_weight: a selective region refuses "
                   "the second ask, 'Trying to backward an extra time', and a fully checkpointed block is recomputed "
                   "at each, as its non-reentrant checkpoint recomputes per graph task: the check traced 2.5x the "
                   "priced FLOPs on the last stage); re-plan with --fix ac=none or schedule=1f1b")
    if pp > 1 and schedule == "zb" and zero >= 3 and ranks > 1:
        out.append("zero=3 with the zero-bubble schedule is not supported yet (torch 2.13 with FSDP2 resharding after "
                   "each forward: the last stage's weight gradients are never computed nor reduced, so it trains "
                   "wrong; `autopar check` and a 4-rank gloo run against one process both show it); re-plan with "
                   "--fix zero=2 or schedule=1f1b")
    if f.get("compile") and tp > 1 and f.get("checkpointed"):
        out.append("torch.compile with tensor parallelism and activation checkpointing is not supported yet (torch "
                   "2.13's AOTAutograd fails on a checkpointed block's DTensor inputs: it saves their DeviceMesh for "
                   "backward); drop --compile, or re-plan with --fix ac=none or tp=1")
    out += expert_problems(f)
    out += context_problems(f)
    kind = f.get("grad_compress", "none")
    ep = f.get("ep", 1)
    allowed = grad_compress_options(ranks, tp, zero, schedule, pp, ep)
    if kind not in allowed:
        why = ("FSDP2 (zero ≥ 2) reduces in bf16/fp16 only" if zero >= 2 else
               f"with ep={ep} the experts' gradients are all-reduced after the step, where no compression hook "
               "applies (part of the model only would be compressed)" if ep > 1 and zero == 0 else
               "gradients are all-reduced after the step here (tensor parallel or zero-bubble without FSDP), where "
               "no compression hook applies")
        cp = f" cp={f['cp']}" if f.get("cp", 1) > 1 else ""
        out.append(f"grad_compress={kind} cannot run with dp={dp} tp={tp}{cp} zero={zero} schedule={schedule}: {why}; "
                   f"choose one of {', '.join(allowed)}")
    return out


def expert_problems(facts: dict) -> list:
    """Why expert parallelism (``ep`` > 1) cannot run as planned: the ep ranks are a sub-group of the dp group,
    each holding E/ep experts (`planner.emit.runtime.apply_ep`)."""
    f = facts
    ep, dp, pp, zero = f.get("ep", 1), f["dp"], f["pp"], f["zero"]
    if ep <= 1:
        return []
    out = []
    if dp % ep:
        out.append(f"ep={ep} must divide dp={dp} (expert-parallel ranks are borrowed from the data-parallel group); "
                   "re-plan with --fix ep=<a divisor of dp>")
    if "experts" in f and not f["experts"]:
        out.append(f"ep={ep} needs a mixture-of-experts model whose experts the runtime can split (a zoo moe: "
                   "model); re-plan with --fix ep=1")
    elif f.get("experts") and f["experts"] % ep:
        out.append(f"ep={ep} does not divide experts={f['experts']}; re-plan with --fix ep=<a divisor of "
                   f"{f['experts']}>")
    experts, dim1 = f.get("experts") or 0, f.get("expert_dim1")
    edp = dp // ep if dp % ep == 0 else 1
    if zero >= 2 and edp > 1 and experts and experts % ep == 0 and (experts // ep) % edp and dim1 and dim1 % edp:
        out.append(f"ep={ep} with zero={zero} and dp={dp}: the {experts // ep} experts a rank holds do not split over "
                   f"the {edp} ranks sharing them (dp/ep), nor do their weights' second dimensions (divisible by "
                   f"{dim1}), which torch's FSDP2 needs; re-plan with --fix ep=<a divisor of dp with (experts/ep) "
                   "divisible by dp/ep>")
    if zero == 1:
        out.append(f"ep={ep} with zero=1 is not supported (ZeroRedundancyOptimizer would broadcast one rank's experts "
                   "over the whole dp group); re-plan with --fix zero=0, zero=2 or zero=3")
    if pp > 1 and f.get("schedule") == "zb":
        out.append(f"ep={ep} with the zero-bubble schedule is not supported yet (its split weight-gradient pass "
                   "bypasses the experts' gradient reduction); re-plan with --fix schedule=1f1b")
    if f.get("selective_ac"):
        out.append(f"selective activation checkpointing with ep={ep} is not supported yet (torch 2.13's selective "
                   "checkpoint cannot replay the autograd all-to-all it saved); re-plan with --fix ac=full or ac=none")
    if f.get("compile"):
        out.append(f"torch.compile with ep={ep} is not supported yet (the dropless dispatch's split sizes depend on "
                   "the data); drop --compile, or re-plan with --fix ep=1")
    return out


def context_problems(facts: dict) -> list:
    """Why context parallelism (``cp`` > 1) cannot run as planned: each sequence is cut into 2·cp chunks and a cp
    rank holds chunks r and 2·cp − 1 − r, so that every rank does the same share of causal attention
    (`planner.emit.runtime.apply_cp`); its gradients are reduced over dp × cp."""
    f = facts
    cp, tp, seq = f.get("cp", 1), f["tp"], f.get("seq")
    if cp <= 1:
        return []
    out = []
    if f.get("cp_ready") is False:
        out.append(f"cp={cp} needs a model whose attention and positions the runtime can split along the sequence "
                   "(the zoo llama: and gpt: models; Hugging Face and file.py models not yet); re-plan with --fix "
                   "cp=1")
    if seq and seq % (2 * cp):
        out.append(f"cp={cp} cuts each sequence into 2·cp = {2 * cp} chunks (two per rank, for balanced causal "
                   f"attention), which seq={seq} does not divide into; choose a cp with 2·cp dividing the sequence")
    elif seq and f.get("sp") and tp > 1 and (seq // cp) % tp:
        out.append(f"sequence parallel with cp={cp} needs each rank's {seq // cp} tokens divisible by tp={tp}; "
                   "re-plan with --fix sp=off or another tp")
    if f["pp"] > 1:
        out.append(f"cp={cp} with pipeline parallelism is not supported yet (stages would have to pass each chunk's "
                   "positions on); re-plan with --fix pp=1 or cp=1")
    if f.get("ep", 1) > 1:
        out.append(f"cp={cp} with expert parallelism is not supported yet; re-plan with --fix ep=1 or cp=1")
    if f.get("compile"):
        out.append(f"torch.compile with cp={cp} is not supported yet; drop --compile, or re-plan with --fix cp=1")
    return out
