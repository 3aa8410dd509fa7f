"""Pipeline parallelism for Hugging Face causal LMs and user models (issue 18): stages cut from the real model.

- the rule (`profiler.layers.pipeline_split_problem`): a base model that hands its embedding's output to its first
  block untouched and its last block's output straight to its final norm splits (Llama, Qwen2, GPT-NeoX, Gemma,
  whose √hidden scaling lives in its embedding module); one that does more in its own forward does not (Granite's
  embedding multiplier, GPT-2's position embeddings), and the search, the emitter and the capture say why;
- the gloo matrix: Llama-style under all four schedules (1F1B, interleaved, GPipe with full AC, zero-bubble with
  full AC), with DDP and with FSDP beside the pipeline, with tensor parallelism inside the stages, and Qwen2
  and GPT-NeoX (another family: parallel attention and MLP, partial rotary) with 1F1B, and a checkpoint that
  resumes, each through the emitted script and `auto_parallelize` against one
  process (3 SGD steps, losses and updates ≤ 1e-4 relative);
- a user's ``file.py:factory`` model (examples/custom_model.py, the zoo convention: blocks in a top-level
  ``nn.ModuleList``, a forward that skips a None embedding, norm or head) with pp = 2 and pp × dp in the same
  matrix; one whose forward needs labels, or calls its embedding unconditionally, is refused by the search and the
  emitter with the reason (`profiler.layers.forward_problem`, `pipeline_split_problem`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.plan import AC, LayerStrategy, ParallelConfig, Plan
from tests import dist_util
from tests.test_emit_dist import EXACT, RESUME_STEPS, STEPS

LLAMA = ("hf:llama:num_hidden_layers=4,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=128,seq=32")
NEOX = ("hf:gpt_neox:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
        "vocab_size=128,seq=32")
QWEN2 = ("hf:qwen2:num_hidden_layers=4,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=128,seq=32")
#: two block kinds (a dense block, then MoE ones whose experts run transformers' grouped_mm) and MLA attention
DEEPSEEK = ("hf:deepseek_v3:num_hidden_layers=4,hidden_size=64,intermediate_size=128,moe_intermediate_size=32,"
            "num_attention_heads=4,num_key_value_heads=4,n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,"
            "first_k_dense_replace=1,vocab_size=128,q_lora_rank=16,kv_lora_rank=16,qk_rope_head_dim=8,"
            "qk_nope_head_dim=16,v_head_dim=16,n_group=1,topk_group=1,seq=32")
#: two block kinds in turn (Qwen3-MoE's decoder_sparse_step=2: dense, MoE, dense, MoE): stages cut between pairs
QWEN3_MOE_TURNS = ("hf:qwen3_moe:num_hidden_layers=4,hidden_size=64,intermediate_size=64,num_attention_heads=4,"
                   "num_key_value_heads=2,head_dim=16,vocab_size=128,moe_intermediate_size=32,num_experts=4,"
                   "num_experts_per_tok=2,decoder_sparse_step=2,seq=32")
SMALL = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=128"
EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "custom_model.py") + ":factory"


def _plan(spec: str, container: str, n_blocks: int, *, ac: dict | None = None, **cfg) -> Plan:
    """A hand-built plan for a Hugging Face model, its blocks split evenly over pp·vpp stages."""
    config = ParallelConfig(precision="fp32", **cfg)
    n_stages = config.pp * config.vpp
    layers = [LayerStrategy(name="embed", stage=0)]
    for i in range(n_blocks):
        name = f"{container}.{i}"
        layers.append(LayerStrategy(name=name, stage=i * n_stages // n_blocks, ac=AC((ac or {}).get(i, "none")),
                                    tp=config.tp > 1))
    layers.append(LayerStrategy(name="head", stage=n_stages - 1))
    return Plan(model=spec, fingerprint="hand-built", seq=32, global_batch=8, cluster="cpu-local", config=config,
                layers=tuple(layers))


def _llama(**cfg) -> Plan:
    return _plan(LLAMA, "model.model.layers", 4, **cfg)


CASES = {
    "hf_pp2_1f1b": (2, lambda: _llama(pp=2)),
    "hf_pp2_interleaved": (2, lambda: _llama(pp=2, vpp=2, schedule="interleaved")),
    "hf_pp2_gpipe_full_ac": (2, lambda: _llama(pp=2, schedule="gpipe", ac={0: "full", 3: "full"})),
    "hf_pp2_zero_bubble": (2, lambda: _llama(pp=2, vpp=2, mbs=2, schedule="zb")),
    "hf_neox_pp2": (2, lambda: _plan(NEOX, "model.gpt_neox.layers", 2, pp=2)),
    "hf_qwen2_pp2": (2, lambda: _plan(QWEN2, "model.model.layers", 4, pp=2)),
    "hf_deepseek_pp2": (2, lambda: _plan(DEEPSEEK, "model.model.layers", 4, pp=2)),  # the dense block on stage 0
    "hf_qwen3moe_turns_pp2": (2, lambda: _plan(QWEN3_MOE_TURNS, "model.model.layers", 4, pp=2, ac={1: "full"})),
    "hf_pp2_dp2": (4, lambda: _llama(pp=2, dp=2)),
    "hf_pp2_dp2_zero3": (4, lambda: _llama(pp=2, dp=2, zero=3)),
    "hf_pp2_tp2": (4, lambda: _llama(pp=2, tp=2)),
    "hf_tied_pp2": (2, lambda: _plan(LLAMA.replace("vocab_size=128", "vocab_size=128,tie_word_embeddings=True"),
                                      "model.model.layers", 4, pp=2)),
    "file_pp2_1f1b": (2, lambda: _plan(EXAMPLE, "blocks", 3, pp=2)),
    "file_pp2_dp2": (4, lambda: _plan(EXAMPLE, "blocks", 3, pp=2, dp=2)),
}
RESUME_CASES = {"hf_pp2_resume": (2, lambda: _llama(pp=2))}


@pytest.mark.parametrize("spec, container", [
    (LLAMA, "model.model.layers"), (QWEN2, "model.model.layers"), (NEOX, "model.gpt_neox.layers"),
    (f"hf:gemma:{SMALL},num_key_value_heads=2,head_dim=16", "model.model.layers"),
    (DEEPSEEK, "model.model.layers"),  # fp32 MoE experts on fake tensors (`grouped_mm_on_fake_fp32`)
])
def test_these_models_split(spec, container):
    from profiler.layers import pipeline_split_problem
    from profiler.zoo.registry import resolve_model

    for device in ("cpu", "meta"):
        model, _ = resolve_model(spec).build(batch=1, seq=16, device=device)
        assert pipeline_split_problem(model, container) == ""


def test_zero_bubble_traces_the_expert_flops_it_prices(tmp_path, capsys):
    """Zero-bubble splits a stage's backward into an input pass and a weight pass, each asking autograd for some
    gradients only. torch's grouped GEMM computes just those; on fake fp32 tensors the check runs the experts
    through `grouped_mm_on_fake_fp32`'s op, which must do the same (transformers' fallback computes both every
    time: the last stage traced 10.9 % more FLOPs than priced). A searched zero-bubble plan of Qwen3-MoE with dense
    and MoE blocks in turn: the check's FLOPs are the cost model's."""
    import json

    from planner.cli.main import main

    plan = tmp_path / "plan.yaml"
    assert main(["plan", QWEN3_MOE_TURNS, "--cluster", "cpu-local", "--global-batch", "8", "--fix",
                 "pp=2,schedule=zb,mbs=4", "--check", "off", "--out", str(plan)]) == 0
    capsys.readouterr()
    main(["check", str(plan), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["flops_error_max"] <= 1e-9, result


def test_fake_fp32_experts_compute_the_gradients_asked_for():
    """`grouped_mm_on_fake_fp32`'s op equals torch's grouped GEMM (values and gradients, fp32 on CPU, where torch
    has the kernel), and like it computes only the gradients a backward asks for."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from profiler.zoo.hf import _register_masked_grouped_mm

    _register_masked_grouped_mm()
    torch.manual_seed(0)
    x = torch.randn(24, 8, requires_grad=True)
    w = torch.randn(3, 8, 12, requires_grad=True)  # (torch's kernel: strides a multiple of 16 bytes)
    offs = torch.tensor([6, 6, 24], dtype=torch.int32)  # an expert with no tokens
    native = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    ours = torch.ops.autopar.masked_grouped_mm(x, w, offs)
    torch.testing.assert_close(ours, native(x, w, offs=offs))
    g = torch.randn_like(ours)
    torch.testing.assert_close(torch.autograd.grad(ours, [x, w], g),
                               torch.autograd.grad(native(x, w, offs=offs), [x, w], g))
    # (the model's experts take views of their weights: non-leaf inputs, whose edges torch can say are wanted)
    xv, wv = x * 1, w.transpose(1, 2).transpose(1, 2)
    ours = torch.ops.autopar.masked_grouped_mm(xv, wv, offs)
    fwd = 2 * 24 * 8 * 12
    for wanted, ops in (([xv], {"masked_grouped_mm_grad_input"}), ([wv], {"masked_grouped_mm_grad_weight"})):
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(ours, wanted, g, retain_graph=True)
        counts = {str(k).split(".")[-1]: v for k, v in counter.get_flop_counts()["Global"].items()}
        assert counts == {op: fwd for op in ops}, counts


@pytest.mark.parametrize("spec, container, words", [
    (f"hf:granite:{SMALL},embedding_multiplier=12.0", "model.model.layers", "changes the embedding's output"),
    ("hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=128", "model.transformer.h", "not one embedding"),
])
def test_these_do_not_and_every_rule_user_says_why(spec, container, words, tmp_path):
    """Granite multiplies the embedding in its base model's forward, GPT-2 adds position embeddings there: a later
    stage handed hidden states would do it again. The capture's fact, the search (`--fix pp=2` names the reason)
    and the emitter refuse with the same line."""
    import subprocess
    import sys

    from profiler.api import profile_model
    from profiler.layers import pipeline_split_problem
    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(spec).build(batch=1, seq=16, device="meta")
    why = pipeline_split_problem(model, container)
    assert words in why and why.endswith("plan it with pp=1")
    assert profile_model(spec, seq=16).model.arch["pp_split"] == why
    cmd = [sys.executable, "-m", "planner", "plan", spec, "--seq-len", "16", "--cluster", "cpu-local",
           "--global-batch", "4", "--fix", "pp=2", "--out", str(tmp_path / "p.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and words in proc.stderr and not (tmp_path / "p.yaml").exists(), proc.stderr[-2000:]
    from planner.emit.config import runtime_config

    with pytest.raises(ValueError, match="pp=2: .*" + words.split("'")[0]):
        runtime_config(_plan(spec, container, 2, pp=2), model)


def test_a_stage_holds_only_its_own_modules():
    """Stage 0 of two keeps the embedding and its blocks, returns hidden states and has no norm weight or head;
    stage 1 keeps its blocks (under their original indices), the final norm and the head, and takes hidden states.
    Both keep the rotary tables (every stage's base model makes its own positions and masks)."""
    from planner.emit.config import runtime_config
    from planner.emit.runtime import split_pipeline
    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(LLAMA).build(device="cpu")
    config = runtime_config(_llama(pp=2), model)
    parts = [split_pipeline(resolve_model(LLAMA).build(device="cpu")[0], config, rank)[1][0] for rank in (0, 1)]
    names = [{n for n, _ in part.named_parameters()} for part in parts]
    assert "model.model.embed_tokens.weight" in names[0] and "model.model.embed_tokens.weight" not in names[1]
    assert "model.lm_head.weight" in names[1] and not any("lm_head" in n or "norm.weight" == n[-11:] for n in names[0]
                                                          if n.startswith(("model.lm_head", "model.model.norm")))
    assert [part._autopar_block_names for part in parts] == [["model.model.layers.0", "model.model.layers.1"],
                                                             ["model.model.layers.2", "model.model.layers.3"]]
    assert all(part.model.model.rotary_emb is not None for part in parts)
    assert (parts[0].takes_tokens, parts[0].gives_logits, parts[1].takes_tokens, parts[1].gives_logits) == (
        True, False, False, True)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return dist_util.run_matrix(tmp_path_factory.mktemp("hf_pp_matrix"), "hf pipeline", CASES, RESUME_CASES, STEPS,
                                RESUME_STEPS)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["emit", "apply"])
@pytest.mark.parametrize("name", list(CASES))
def test_hf_pipeline_matches_one_process(matrix, name, mode):
    dist_util.assert_matches(matrix, name, CASES[name][0], mode, EXACT)


@pytest.mark.dist
def test_hf_pipeline_checkpoint_resumes(matrix):
    """Saved and resumed (model under its original block names, AdamW moments, schedule), the losses are those of
    straight steps."""
    import torch

    out, _, failures = matrix
    if 2 in failures:
        pytest.fail(failures[2])
    got = torch.load(out / "hf_pp2_resume.resume.rank0.pt")
    assert got["resumed"] == pytest.approx(got["straight"], rel=1e-6), (got["resumed"], got["straight"])


BROKEN = {
    "labels": ("needs more than the token ids", """
    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), labels.flatten())
"""),
    "embedding": ("its middle pipeline stage (with 'embed' or 'lm_head' set to None) fails", """
    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x if self.lm_head is None else self.lm_head(x)
"""),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_a_user_model_the_runtime_cannot_call_is_refused_with_the_reason(what, tmp_path):
    """The training step calls ``model(input_ids)`` for logits, and a pipeline stage is the model with the modules
    it does not own set to None: a user model whose forward needs labels is refused for every plan, one that calls
    its embedding unconditionally for pp > 1, by the search (exit 2, no plan written) and the emitter alike."""
    import subprocess
    import sys

    words, forward = BROKEN[what]
    source = f"""
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.lm_head = nn.Linear(32, 64)
{forward}

def factory(batch=1, seq=16):
    return Model(), (torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq)))
"""
    path = tmp_path / "model.py"
    path.write_text(source)
    cmd = [sys.executable, "-m", "planner", "plan", f"{path}:factory", "--cluster", "cpu-local", "--global-batch",
           "4", "--fix", "pp=2", "--out", str(tmp_path / "p.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and words in proc.stderr and not (tmp_path / "p.yaml").exists(), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line
    from planner.emit.config import runtime_config
    from profiler.zoo.registry import resolve_model

    model, _ = resolve_model(f"{path}:factory").build(batch=1, seq=16, device="meta")
    with pytest.raises(ValueError, match=words.split("(")[0]):
        runtime_config(_plan(f"{path}:factory", "blocks", 2, pp=2), model)


def test_fake_runs_make_the_masks_a_training_step_makes():
    """transformers 5 leaves causality to SDPA's ``is_causal`` (no mask, grouped-query K/V unexpanded) when it can
    read the positions; on fake tensors and under export it cannot, and materialises a [b, 1, s, s] mask that every
    attention saves. The capture and `autopar check`'s trace run as a real step does (`profiler.zoo.hf.
    masks_as_trained`): the same attention call as on real tensors, no seq × seq tensor anywhere."""
    import torch
    from torch.overrides import TorchFunctionMode

    from profiler.api import profile_model
    from profiler.zoo.registry import resolve_model

    seq = 64
    spec = LLAMA.replace("seq=32", f"seq={seq}")

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                self.seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal"), args[1].shape[1],
                                  kwargs.get("enable_gqa")))
            return func(*args, **kwargs)

    model, (ids, _) = resolve_model(spec).build(batch=2, seq=seq, device="cpu")
    with Calls() as real:
        model(ids)
    assert {(m is None, c, heads, g) for m, c, heads, g in real.seen} == {(True, True, 2, True)}, real.seen

    graph = profile_model(spec, batch=2, seq=seq, fold=False).model
    attention = [n for n in graph.nodes if n.kind == "attention"]
    assert len(attention) == 4
    assert all(len(n.input_shapes) == 3 and n.input_shapes[1][1] == 2 for n in attention)  # q, k, v: no mask
    assert not [n.op for n in graph.nodes for s in n.output_shapes if len(s) == 4 and s[-2:] == (seq, seq)]


def test_an_interleaved_hugging_face_plan_holds_what_the_cost_model_prices():
    """Each Hugging Face stage runs its base model's own forward; traced as a real step runs it (no causal mask per
    stage and micro-batch, `masks_as_trained`), with torch's pipelining buffers priced, every pipeline rank's peak
    is the predicted one."""
    from planner.check.conformance import check_plan
    from planner.validate.loop import plan_from_config

    spec = LLAMA.replace("hidden_size=64", "hidden_size=128").replace("intermediate_size=128",
                                                                      "intermediate_size=256")
    plan = plan_from_config(spec.replace("seq=32", "seq=1024"), "dgx-h100:nodes=1", 16,
                            "pp=2,dp=4,vpp=2,mbs=1,schedule=interleaved,zero=1")
    result = check_plan(plan)
    for role in result["roles"]:
        assert role["errors"]["memory"]["peak"] <= 0.03, (role["stage"], role["errors"]["memory"])
        assert role["errors"]["memory"]["activations"] <= 0.03, (role["stage"], role["errors"]["memory"])
