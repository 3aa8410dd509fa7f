"""Profiler facts against closed forms from the literature (all on the meta device, no real memory).

- FLOPs: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  appendix): one GPT block runs 24·B·s·h² + 4·B·s²·h forward FLOPs, the logit layer 2·B·s·h·V.
- Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), eq. 1:
  a block saves s·b·h·(34 + 5·a·s/h) bytes in 16-bit with dropout; with t-way tensor parallelism (eq. 2)
  s·b·h·(10 + 24/t + 5·a·s/(h·t)).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from profiler.api import profile_model, with_blocks
from profiler.layers import tp_saved_bytes

#: (spec, hidden h, heads a, seq s, vocab V): two sizes plus GPT-3 175B's block, two layers each
GPT_SIZES = [
    ("gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=4096,attention=math", 1024, 16, 512, 4096),
    ("gpt:layers=2,hidden=2048,heads=16,seq=1024,vocab=8192,attention=math", 2048, 16, 1024, 8192),
    ("gpt:layers=2,hidden=12288,heads=96,seq=2048,vocab=51200,attention=math", 12288, 96, 2048, 51200),
]


def megatron_block_flops(B: int, s: int, h: int) -> int:
    """Narayanan et al. 2021, appendix: 24Bsh² (q, k, v, output and MLP matmuls) + 4Bs²h (QKᵀ and ·V)."""
    return 24 * B * s * h * h + 4 * B * s * s * h


@pytest.mark.parametrize("spec,h,a,s,V", GPT_SIZES)
@pytest.mark.parametrize("B", [1, 2])
def test_gpt_flops_match_megatron(spec, h, a, s, V, B):
    """Forward FLOPs per block and of the head; backward is exactly 2× forward when attention is plain matmuls."""
    lg = profile_model(spec, batch=B)
    head = lg.layers[-1]
    for block in lg.blocks:
        assert block.fwd_flops == pytest.approx(megatron_block_flops(B, s, h), rel=0.01)
        assert block.bwd_flops == 2 * block.fwd_flops  # every matmul has two gradient matmuls
    assert head.kind == "head" and head.fwd_flops == pytest.approx(2 * B * s * h * V, rel=0.01)
    assert head.bwd_flops == 2 * head.fwd_flops
    assert lg.layers[0].fwd_flops == 0  # embedding lookups are memory-bound


def test_flash_backward_includes_score_recomputation():
    """With SDPA (FlashAttention on GPUs) the backward recomputes QKᵀ: one matmul of 2Bs²h more than 2× forward
    (`torch.utils.flop_counter.sdpa_backward_flop_count`); those are hardware FLOPs, not model FLOPs."""
    B, s, h = 2, 512, 1024
    lg = profile_model("gpt:layers=1,hidden=1024,heads=16,seq=512,vocab=4096", batch=B)
    block = lg.blocks[0]
    assert block.fwd_flops == megatron_block_flops(B, s, h)
    assert block.bwd_flops == 2 * block.fwd_flops + 2 * B * s * s * h


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """Korthikanti et al. 2022, eq. 1 (t = 1) and eq. 2: bytes a block saves in 16-bit with dropout."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("spec,h,a,s,V", GPT_SIZES)
@pytest.mark.parametrize("b", [1, 2])
def test_gpt_saved_activations_match_korthikanti(spec, h, a, s, V, b):
    """Saved bytes per block (bf16, dropout on, math attention, GPU kernels, no recomputation) within 5 % of
    sbh(34 + 5as/h); measured 0.07–0.7 % above it.

    Where the difference comes from: the block materialises its causal mask, a bool s×s tensor that
    `masked_fill` saves (s² bytes, shared by the batch: s/(bh) per sbh; Megatron's fused scale-mask-softmax keeps
    no mask), and LayerNorm saves its fp32 mean and rstd (2·4·sb bytes per norm, 8/h per sbh; Korthikanti counts
    only the norm's input). Everything else is the paper's list term by term: LayerNorm inputs 2+2, q/k/v input
    2, QKᵀ inputs 4, softmax output 2as/h, attention-dropout mask as/h, its output 2as/h and v 2, wo input 2,
    dropout masks 1+1, MLP input 2, GELU input 8, w2 input 8.

    Under tensor parallelism (column wq/wk/wv/w1, row wo/w2) the bytes that stay replicated are the paper's
    10·sbh and the rest is its 24·sbh + 5as²b, divided by t.
    """
    lg = profile_model(spec, batch=b)
    for block in lg.blocks:
        assert block.saved_bytes == pytest.approx(korthikanti(s, b, h, a), rel=0.01)  # measured: 0.07-0.7 %
        replicated, sharded = tp_saved_bytes(block)
        assert replicated == pytest.approx(10 * s * b * h, rel=0.01)
        assert sharded == pytest.approx(24 * s * b * h + 5 * a * s * s * b, rel=0.01)
        assert replicated + sharded / 8 == pytest.approx(korthikanti(s, b, h, a, t=8), rel=0.01)


def test_tied_embedding_is_owned_by_embed():
    lg = profile_model("gpt-tiny")
    embed, head = lg.layers[0], lg.layers[-1]
    assert (embed.kind, head.kind) == ("embed", "head")
    assert "tok_embeddings.weight" in {p for n in embed.nodes for p in n.params}
    assert head.shared_params == ("tok_embeddings.weight",)
    for spec in ("gpt-tiny", "llama-tiny", "moe-tiny"):
        lg = profile_model(spec)
        assert sum(layer.param_numel for layer in lg.layers) == lg.model.num_params
        assert lg.model.num_params == lg.model.arch["params"]


@pytest.mark.parametrize("spec,layers", [("gpt-tiny", 2), ("llama-tiny", 2), ("moe-tiny", 2),
                                         ("llama:layers=5,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=100,seq=16", 5)])
def test_zoo_groups_into_embed_blocks_head(spec, layers):
    lg = profile_model(spec)
    assert [layer.kind for layer in lg.layers] == ["embed"] + ["block"] * layers + ["head"]
    assert lg.block_container == "layers"
    assert [b.name for b in lg.blocks] == [f"layers.{i}" for i in range(layers)]
    assert len({b.signature for b in lg.blocks}) == 1
    assert len(lg.signatures) == 3
    # a pipeline boundary carries the previous layer's hidden state, b·s·h in bf16, and nothing else: the RoPE
    # cos/sin tables that Llama blocks also read are recomputed by each stage's forward (what the runtime sends);
    # only the first block reads them from the layer before it (the embedding, never in another stage), s·head_dim
    arch, b, s = lg.model.arch, lg.model.batch, lg.model.seq
    rope = 0 if spec.startswith("gpt") else 2 * s * (arch["hidden"] // arch["heads"]) * 2
    for layer in lg.layers[1:]:
        assert layer.input_bytes == b * s * arch["hidden"] * 2 + (rope if layer.name == "layers.0" else 0)


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny"])
def test_tensor_parallel_roles(spec):
    """Megatron roles: q/k/v and the first MLP linears column, the output linears row, attention and the
    activation in between sharded, norms (and the residual path) replicated."""
    lg = profile_model(spec)
    for block in lg.blocks:
        role_of = {}
        for n in block.nodes:
            leaf = n.module_path.rsplit(".", 1)[-1]
            if n.kind == "matmul" and n.params:
                role_of[leaf] = n.tp_role
            if n.kind == "attention" or "norm" in leaf:
                role_of.setdefault(leaf if "norm" in leaf else "attention", set()).add(n.tp_role)
            if "gelu" in n.op or "silu" in n.op:
                role_of.setdefault("activation", set()).add(n.tp_role)
        assert {k: role_of[k] for k in ("wq", "wk", "wv", "w1")} == dict.fromkeys(("wq", "wk", "wv", "w1"), "column")
        assert (role_of["wo"], role_of["w2"]) == ("row", "row")
        if spec.startswith("llama"):
            assert role_of["w3"] == "column"
        assert role_of["attention"] == {"sharded"} and role_of["activation"] == {"sharded"}
        assert role_of["attention_norm"] == {"replicated"} and role_of["ffn_norm"] == {"replicated"}


def test_fingerprint_stable_and_shape_sensitive():
    a = profile_model("gpt-tiny").model
    b = profile_model("gpt-tiny").model
    assert a.fingerprint == b.fingerprint
    assert profile_model("gpt-tiny", seq=16).model.fingerprint != a.fingerprint
    assert profile_model("gpt-tiny", batch=2).model.fingerprint != a.fingerprint
    assert profile_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=130").model.fingerprint != a.fingerprint


def test_model_graph_round_trips_through_json():
    from profiler.graph import ModelGraph

    g = profile_model("llama-tiny").model
    back = ModelGraph.from_dict(json.loads(g.dumps()))
    assert back == g
    assert back.fingerprint == g.fingerprint
    assert json.loads(back.dumps()) == json.loads(g.dumps())
    assert dataclasses.asdict(back.nodes[3]) == dataclasses.asdict(g.nodes[3])


# --- Hugging Face --------------------------------------------------------------------------------------------------

SMALL = "hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=128"
HF = {  # spec, blocks, block container
    "gpt2": ("hf:gpt2:n_layer=3,n_embd=64,n_head=4,vocab_size=128,n_positions=64", 3, "model.transformer.h"),
    "llama": (f"hf:llama:num_hidden_layers=2,{SMALL},num_key_value_heads=2,seq=32", 2, "model.model.layers"),
    "bert": (f"hf:bert:num_hidden_layers=2,{SMALL},max_position_embeddings=64", 2, "model.bert.encoder.layer"),
    "mixtral": (f"hf:mixtral:num_hidden_layers=3,{SMALL},num_key_value_heads=2,num_local_experts=4,seq=32", 3,
                "model.model.layers"),
}


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_models_group_into_embed_blocks_head(name):
    spec, layers, container = HF[name]
    lg = profile_model(spec)
    assert lg.model.method == "export"
    assert lg.block_container == container
    assert [layer.kind for layer in lg.layers] == ["embed"] + ["block"] * layers + ["head"]
    assert len({b.signature for b in lg.blocks}) == 1
    assert sum(layer.param_numel for layer in lg.layers) == lg.model.num_params  # tied weights counted once
    assert all(b.fwd_flops > 0 and b.bwd_flops > b.fwd_flops and b.saved_bytes > 0 for b in lg.blocks)
    roles = {n.tp_role for b in lg.blocks for n in b.nodes}
    if name == "gpt2":  # its projections are Conv1D, which tensor parallelism leaves whole (test_runnable)
        assert roles == {"none"}
    else:
        assert {"column", "row", "sharded", "replicated"} <= roles


_HF_SMALL = ("num_hidden_layers=8,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
             "vocab_size=128")


@pytest.mark.parametrize("spec, folds", [
    (f"hf:llama:{_HF_SMALL}", True),
    (f"hf:qwen3_moe:{_HF_SMALL},moe_intermediate_size=32", True),  # every layer a MoE layer
    (f"hf:qwen3_moe:{_HF_SMALL},moe_intermediate_size=32,decoder_sparse_step=2", False),  # every other layer
    (f"hf:qwen3_moe:{_HF_SMALL},moe_intermediate_size=32", {"mlp_only_layers": [0]}),  # the first one dense
    (f"hf:qwen2:{_HF_SMALL},use_sliding_window=true,max_window_layers=4", False),  # half the layers windowed
    (f"hf:gemma2:{_HF_SMALL},head_dim=16", False),  # alternating local and global attention
])
def test_hugging_face_layers_that_differ_by_index_are_not_folded(spec, folds):
    """Capture (and `autopar check`) fold a model to a few blocks only when its blocks are alike; a config whose
    layers differ by their index (a per-layer list, or a period such as Qwen's ``decoder_sparse_step``) is taken
    whole, where folding would repeat the wrong block."""
    import copy

    from profiler.zoo.registry import resolve_model

    source = resolve_model(spec)
    if isinstance(folds, dict):  # a field the hf: form cannot spell (a list), set on the config
        config = copy.deepcopy(source.config)
        for key, value in folds.items():
            setattr(config, key, value)
        source, folds = dataclasses.replace(source, config=config), False
    folded = with_blocks(source, 3)
    assert (folded is not None) == folds
    if folded is not None:
        assert folded.config.num_hidden_layers == 3
        assert len(getattr(folded.config, "layer_types", None) or [0] * 3) == 3


def test_a_replay_failure_is_one_line_naming_the_module(monkeypatch):
    """An operator the fake-tensor replay cannot run (as Falcon's lifted constants could not) is a CaptureError of
    one line naming the operator, the module it came from and a way out; not a raw torch error."""
    from profiler import capture as cap

    callable_of = cap._Replay._callable

    def failing(self, node):
        if self._module_of(node)[0].startswith("layers.1.") and node.op == "call_function":
            def boom(*args, **kwargs):
                raise RuntimeError("Expected a proper Tensor but got None\nC++ frames …")
            return boom
        return callable_of(self, node)

    monkeypatch.setattr(cap._Replay, "_callable", failing)
    with pytest.raises(cap.CaptureError) as err:
        profile_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32", fold=False)
    message = str(err.value)
    assert "\n" not in message and message.startswith("cannot replay ") and " from layers.1." in message
    assert "Expected a proper Tensor but got None;" in message and "file.py:factory" in message


def test_lifted_constants_replay():
    """Falcon-7B's attention builds a tensor in its forward, which export lifts into the program's constants: it is
    captured, and its parameter count is the published 6,921,720,704 (tests/data/hf_configs/falcon-7b.json)."""
    config = Path(__file__).parent / "data" / "hf_configs" / "falcon-7b.json"
    lg = profile_model(f"hf:{config}:seq=64,num_hidden_layers=2", fold=False)
    per_block = (4544 * (4544 + 2 * 64) + 4544 * 4544 + 2 * 4544 * 4 * 4544 + 2 * 4544)
    assert lg.model.num_params == 65024 * 4544 + 2 * per_block + 2 * 4544  # embedding tied to the head, final norm


_DEEPSEEK = ("hf:deepseek_v3:num_hidden_layers=6,hidden_size=128,intermediate_size=256,moe_intermediate_size=64,"
             "num_attention_heads=4,num_key_value_heads=4,n_routed_experts=8,num_experts_per_tok=2,n_shared_experts=1,"
             "first_k_dense_replace=2,vocab_size=256,q_lora_rank=32,kv_lora_rank=32,qk_rope_head_dim=16,"
             "qk_nope_head_dim=32,v_head_dim=32,n_group=1,topk_group=1,seq=32")


def test_leading_dense_blocks_fold_after_them():
    """DeepSeek's first_k_dense_replace: the first k blocks are dense, the rest alike MoE blocks; a capture of k + 2
    blocks whose last is repeated equals the whole capture (same layer signatures, FLOPs and saved bytes), and
    fewer than k + 2 blocks are refused. MLA's value heads (32) are narrower than its query/key heads (48)."""
    from profiler.api import leading_blocks
    from profiler.zoo.registry import resolve_model

    source = resolve_model(_DEEPSEEK)
    assert leading_blocks(source) == 2
    assert with_blocks(source, 3) is None and with_blocks(source, 4) is not None
    folded, whole = profile_model(_DEEPSEEK), profile_model(_DEEPSEEK, fold=False)
    assert [layer.signature for layer in folded.layers] == [layer.signature for layer in whole.layers]
    for attr in ("fwd_flops", "bwd_flops", "saved_bytes"):
        assert [getattr(x, attr) for x in folded.layers] == [getattr(x, attr) for x in whole.layers]
    assert folded.layers[1].signature != folded.layers[3].signature  # dense, then MoE
    assert folded.model.arch["dense_layers"] == 2 and folded.model.arch["shared_experts"] == 1


AUTOCAST_MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"


def _whole_model_saved_bytes(spec: str, seq: int = 32) -> tuple[int, int]:
    """(activation bytes autograd keeps, bytes of autocast's casts of the linears' weights) in one forward of the
    whole fp32 model under CPU autocast on fake tensors: no node-by-node replay, no capture code."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from profiler.api import resolve_model

    model, inputs = resolve_model(spec).build(batch=1, seq=seq, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = model.float().to_empty(device="cpu")
        inputs = [mode.from_tensor(torch.zeros(t.shape, dtype=t.dtype)) for t in inputs]
        states = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        saved: dict = {}

        def pack(t):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in states:
                saved[ref] = t.untyped_storage().nbytes()
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    casts = sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return sum(saved.values()), casts


@pytest.mark.parametrize("spec", [AUTOCAST_MODEL, "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,"
                                              "seq=32,experts=4,top_k=2"])
def test_an_autocast_capture_saves_what_a_whole_autocast_run_saves(spec):
    """Node by node under CPU autocast, the capture keeps what one autocast forward of the whole model keeps, less
    autocast's 16-bit copies of the linears' weights (its cast cache: state, `costmodel.memory.state_bytes_per_param`);
    between the 16-bit and the fp32 capture, since the residual stream and the loss stay fp32. A grouped expert
    weight is cast through a transpose, which autocast does not cache: that copy is made and saved at every call,
    an activation (counted as cache it was 50 % under on this MoE)."""
    lg = profile_model(spec, dtype="fp32", kernels="native", autocast="bf16")
    whole, casts = _whole_model_saved_bytes(spec)
    captured = sum(n.saved_bytes for n in lg.model.nodes)
    assert captured == whole - casts
    low = sum(n.saved_bytes for n in profile_model(spec, dtype="bf16", kernels="native").model.nodes)
    high = sum(n.saved_bytes for n in profile_model(spec, dtype="fp32", kernels="native").model.nodes)
    # (the MoE keeps more than in fp32: its expert weights' copies, where fp32 reads the parameters themselves)
    assert low < captured and (captured < high) == (spec == AUTOCAST_MODEL)
    dtypes = {n.op: n.output_dtypes for n in lg.model.nodes}
    assert dtypes["aten.linear.default"] == ("bfloat16",) and dtypes["aten.embedding.default"] == ("float32",)
    assert dtypes["aten.cross_entropy_loss.default"] == ("float32",)
    assert lg.model.arch["autocast"] == "bf16"


def test_the_gpu_replay_runs_cudas_fp32_ops_in_fp32():
    """CUDA's autocast runs softmax and layer_norm in fp32 (ATen/autocast_mode.h), CPU's in the input's dtype: the
    replay for GPUs gives an attention-core GPT's probabilities fp32, and the policy is gone afterwards."""
    import torch

    spec = "gpt:layers=1,hidden=64,heads=4,vocab=128,seq=32,attention=math"
    gpu = profile_model(spec, dtype="fp32", autocast="bf16")
    native = profile_model(spec, dtype="fp32", kernels="native", autocast="bf16")
    softmax = [n for n in gpu.model.nodes if n.op.startswith("aten.softmax")]
    assert softmax and all(n.output_dtypes == ("float32",) for n in softmax)
    assert all(n.output_dtypes == ("bfloat16",) for n in native.model.nodes if n.op.startswith("aten.softmax"))
    saved = {n.name: n.saved_bytes for n in native.model.nodes}
    assert all(n.saved_bytes == 2 * saved[n.name] > 0 for n in softmax)  # the probabilities it saves: fp32, not 16-bit
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(torch.ones(2, 2, dtype=torch.bfloat16), -1).dtype == torch.bfloat16


def test_a_16_bit_graph_makes_its_autocast_twin_once():
    lg = profile_model(AUTOCAST_MODEL)
    twin = lg.under_autocast()
    assert twin is lg.under_autocast() and twin.model.arch["autocast"] == "bf16" and twin.model.dtype == "float32"
    assert [layer.name for layer in twin.layers] == [layer.name for layer in lg.layers]
    assert profile_model(AUTOCAST_MODEL, dtype="fp32").under_autocast() is None
    with pytest.raises(ValueError, match="fp32"):
        profile_model(AUTOCAST_MODEL, autocast="bf16")



def test_a_capture_is_made_once_per_process(tmp_path, monkeypatch):
    """`profiler.api.profile_once` (what the search, the check and the cost model's layer graphs call): the same
    spec and arguments give the same graph, captured once; other arguments another, and a relative ``file.py``
    spec named from another directory the other file's."""
    from profiler.api import profile_once

    text = (Path(__file__).parent / "data" / "unfused_attention.py").read_text()
    assert "heads=4, layers=3)" in text
    graphs = []
    for layers in (3, 2):
        here = tmp_path / str(layers)
        here.mkdir()
        (here / "mine.py").write_text(text.replace("heads=4, layers=3)", f"heads=4, layers={layers})"))
        monkeypatch.chdir(here)
        graphs.append(profile_once("mine.py:factory"))
        assert profile_once("mine.py:factory") is graphs[-1]
    assert len(graphs[0].layers) == len(graphs[1].layers) + 1

    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"
    first = profile_once(spec)
    assert profile_once(spec) is first and first == profile_model(spec)
    assert profile_once(spec, dtype="fp32") is not first
    assert profile_once(spec, seq=16) is not first
