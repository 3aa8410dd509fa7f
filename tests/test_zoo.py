"""Model zoo: published parameter counts, CPU training steps, meta-device export, MoE dispatch, spec parsing, hf."""

import dataclasses
import inspect
import math
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from profiler.zoo import (
    MODEL_PRESETS,
    GPTConfig,
    HFCausalLMLoss,
    MoEConfig,
    gpt,
    hf_layer_container,
    list_models,
    llama,
    moe,
    param_count,
    resolve_model,
)


def meta_params(spec: str) -> int:
    model, _ = resolve_model(spec).build(device="meta")
    return sum(p.numel() for p in model.parameters())


def narayanan_params(l: int, h: int, V: int, s: int) -> float:
    """Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
    eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


# --- parameter counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, l, h, V, s",
    [
        ("gpt3-175b", 96, 12288, 51200, 2048),
        ("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", 24, 2048, 51200, 2048),  # ~1.3B
        ("gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=51200", 40, 5120, 51200, 2048),  # ~13B
    ],
)
def test_gpt_params_match_narayanan_eq2(spec, l, h, V, s):
    counted = meta_params(spec)
    assert counted == pytest.approx(narayanan_params(l, h, V, s), rel=1e-3)
    assert counted == param_count(resolve_model(spec).config)  # closed form is exact (eq. 2 + final LayerNorm)


@pytest.mark.parametrize(
    "spec, published, rel",
    [
        ("llama3-8b", 8.03e9, 5e-3),
        ("llama3-70b", 70.6e9, 5e-3),
        ("llama3-405b", 405.9e9, 5e-3),  # full model, meta device only
        ("mixtral-8x7b", 46.7e9, 1e-2),
    ],
)
def test_published_param_counts(spec, published, rel):
    counted = meta_params(spec)
    assert counted == pytest.approx(published, rel=rel)
    assert counted == param_count(resolve_model(spec).config)


def test_list_models_covers_presets():
    rows = dict(list_models())
    assert set(MODEL_PRESETS) <= set(rows)
    assert "405.9B" in rows["llama3-405b"]


# --- CPU training step --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["gpt-tiny", "gpt-tiny:attention=math", "llama-tiny", "moe-tiny"])
def test_tiny_models_train_on_cpu(spec):
    torch.manual_seed(0)
    model, (input_ids, labels) = resolve_model(spec).build(batch=2, device="cpu")
    loss = model(input_ids, labels)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    logits = model(input_ids)
    assert logits.shape == (*input_ids.shape, resolve_model(spec).vocab)
    _trains(model, input_ids, labels)


def _trains(model, input_ids, labels, steps: int = 8) -> None:
    """A few AdamW steps on one batch lower its loss (the model learns: every parameter's gradient is real)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_gpt_math_and_sdpa_attention_agree():
    torch.manual_seed(0)
    sdpa, (input_ids, labels) = resolve_model("gpt-tiny:dropout=0").build(batch=2, device="cpu")
    math_model, _ = resolve_model("gpt-tiny:dropout=0,attention=math").build(device="cpu")
    math_model.load_state_dict(sdpa.state_dict())
    torch.testing.assert_close(math_model(input_ids, labels), sdpa(input_ids, labels))


def test_gpt_output_head_is_tied():
    model, _ = resolve_model("gpt-tiny").build(device="meta")
    assert model.output.weight is model.tok_embeddings.weight


def test_heads_follow_sharded_projection_width():
    """A tensor-parallel shard of wq/wk/wv (half the heads) still runs: heads come from the weight's width."""
    torch.manual_seed(0)
    model, (input_ids, _) = resolve_model("llama-tiny").build(device="cpu")
    attention = model.layers[0].attention
    for name in ("wq", "wk", "wv"):
        full = getattr(attention, name)
        half = torch.nn.Linear(full.in_features, full.out_features // 2, bias=False)
        setattr(attention, name, half)
    attention.wo = torch.nn.Linear(attention.wo.in_features // 2, attention.wo.out_features, bias=False)
    assert torch.isfinite(model(input_ids, input_ids))


# --- export on meta ------------------------------------------------------------------------------------------------


EXPORT_SPECS = {
    "gpt-tiny": "gpt-tiny",
    "gpt-small": "gpt-small:attention=math",
    "llama-tiny": "llama-tiny",
    "moe-tiny": "moe-tiny",
    # Big presets at their real widths with 2 layers (the full 405B is only counted above).
    "gpt3-175b": "gpt3-175b:layers=2",
    "llama3-8b": "llama3-8b:layers=2",
    "llama3-70b": "llama3-70b:layers=2",
    "llama3-405b": "llama:layers=2,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=8192",
    "mixtral-8x7b": "mixtral-8x7b:layers=2",
}


def test_export_specs_cover_every_preset():
    assert set(EXPORT_SPECS) == set(MODEL_PRESETS)


@pytest.mark.parametrize("name", sorted(EXPORT_SPECS))
def test_preset_exports_on_meta(name):
    model, inputs = resolve_model(EXPORT_SPECS[name]).build(batch=1, device="meta")
    model.train()
    exported = torch.export.export(model, inputs, strict=False)
    (loss,) = next(n for n in exported.graph.nodes if n.op == "output").args[0]
    assert loss.meta["val"].shape == ()


# --- MoE dispatch --------------------------------------------------------------------------------------------------


def naive_moe(ffn: moe.MoEFeedForward, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Per-token loop: y[t] = Σ_j w[t, j] · expert_{e(t, j)}(x[t]). With ``capacity``, GShard's priority as moe.py's
    docstring states it: every token's first choice, in token order, then every second choice; a pair whose expert
    already has ``capacity`` tokens is dropped and contributes nothing."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(ffn.gate(tokens).float(), dim=-1)
    weights, chosen = torch.topk(probs, ffn.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    w1, w2, w3 = ffn.experts.w1, ffn.experts.w2, ffn.experts.w3
    out = torch.zeros_like(tokens)
    taken = [0] * ffn.num_experts
    for j in range(ffn.top_k):
        for t in range(tokens.shape[0]):
            e = int(chosen[t, j])
            if capacity is not None and taken[e] == capacity:
                continue
            taken[e] += 1
            h = torch.nn.functional.silu(w1[e] @ tokens[t]) * (w3[e] @ tokens[t])
            out[t] += weights[t, j].to(x.dtype) * (w2[e] @ h)
    return out.view_as(x)


def tiny_moe_layer(capacity_factor: float) -> moe.MoEFeedForward:
    torch.manual_seed(0)
    config = MoEConfig(
        layers=1,
        hidden=16,
        heads=2,
        kv_heads=2,
        ffn=24,
        vocab=32,
        seq=8,
        experts=4,
        top_k=2,
        capacity_factor=capacity_factor,
    )
    return moe.MoETransformer(config).layers[0].feed_forward


def test_moe_dispatch_is_exact_with_enough_capacity():
    layer = tiny_moe_layer(capacity_factor=4.0)  # C = tokens: nothing can be dropped
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(layer(x), naive_moe(layer, x))


def test_moe_drops_tokens_when_capacity_is_tight():
    layer = tiny_moe_layer(capacity_factor=0.5)
    tokens, experts = 16, 4
    capacity = moe.expert_capacity(tokens, experts, 2, 0.5)
    assert capacity == 4
    x = torch.randn(2, 8, 16)
    chosen = torch.topk(layer.gate(x.view(tokens, 16)), 2, dim=-1).indices
    slots = moe.dispatch_slots(chosen.t().reshape(-1), experts, capacity)
    kept = slots < experts * capacity
    assert int(kept.sum()) <= experts * capacity < 2 * tokens  # some pairs had to be dropped
    assert len(set(slots[kept].tolist())) == int(kept.sum())  # kept pairs have distinct slots
    assert not torch.allclose(layer(x), naive_moe(layer, x))
    # dropped pairs contribute nothing, kept ones their weighted expert output (first choices have priority)
    torch.testing.assert_close(layer(x), naive_moe(layer, x, capacity=capacity), rtol=1e-5, atol=1e-6)


def test_moe_flops_are_router_plus_capacity_matmuls():
    """Forward FLOPs = 2·T·h·E (router) + 3 · 2·E·C·h·ffn (experts): no one-hot einsum, nothing per token."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = tiny_moe_layer(capacity_factor=1.0)
    tokens, hidden, experts, ffn = 16, 16, 4, 24
    capacity = moe.expert_capacity(tokens, experts, 2, 1.0)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(2, 8, hidden))
    assert counter.get_total_flops() == 2 * tokens * hidden * experts + 6 * experts * capacity * hidden * ffn


def test_dispatch_slots_prefers_first_choices():
    # Expert 0 has capacity 1: the first pair routed to it keeps it, the later one is dropped to the overflow row.
    slots = moe.dispatch_slots(torch.tensor([0, 1, 0, 1]), experts=2, capacity=1)
    assert slots.tolist() == [0, 1, 2, 2]


def test_moe_copies_of_llama_pieces_are_identical():
    for name in ("RMSNorm", "rope_cos_sin", "apply_rope", "Attention", "FeedForward"):
        assert inspect.getsource(getattr(moe, name)) == inspect.getsource(getattr(llama, name)), name


def test_model_files_import_only_torch_and_stdlib():
    for module in (gpt, llama, moe):
        source = inspect.getsource(module)
        imports = [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert {name.split(".")[0] for name in imports} <= {"torch", "math", "dataclasses", "typing"}, module


# --- spec parsing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("llama9", "unknown model 'llama9'; known presets: gpt3-175b"),
        ("gpt:layers=2,hiden=64", "gpt spec: unknown key 'hiden' (known: layers, hidden"),
        ("gpt:layers=2,hidden=64,heads=7,seq=32,vocab=128", "gpt spec: heads=7 does not divide hidden=64"),
        ("gpt:layers=2,hidden=64", "gpt spec: missing key(s) heads, seq, vocab"),
        ("gpt:layers=two", "gpt spec: layers='two' is not an integer"),
        ("gpt-tiny:attention=flash", "attention='flash' must be one of sdpa, math"),
        ("llama3-8b:kv_heads=5", "kv_heads=5 does not divide heads=32"),
        ("moe:layers=1,hidden=64,heads=4,kv_heads=2,ffn=32,vocab=100,experts=2,top_k=3", "top_k=3 exceeds experts=2"),
        ("missing_dir/file.py:factory", "file.py:factory: file not found"),
        ("models.py", "name the factory"),
        ("hf:nonsense_type", "unknown model type 'nonsense_type'"),
        ("hf:llama:hiden_size=8", "unknown config key 'hiden_size'"),
    ],
)
def test_bad_specs_raise_helpful_errors(spec, message):
    with pytest.raises(ValueError) as info:
        resolve_model(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_preset_overrides_and_source():
    source = resolve_model("llama3-8b:seq=4096")
    assert (source.family, source.seq, source.vocab) == ("llama", 4096, 128256)
    assert source.arch()["kv_heads"] == 8 and source.arch()["seq"] == 4096
    assert source.source_file() == __import__("pathlib").Path(llama.__file__)
    assert source.model_expr().startswith("Llama(LlamaConfig(layers=32, hidden=4096")
    assert resolve_model("mixtral-8x7b").arch()["experts"] == 8
    assert resolve_model("gpt3-175b").arch()["ffn"] == 4 * 12288
    model, (input_ids, labels) = resolve_model("gpt-tiny").build(batch=3, seq=16, device="meta")
    assert input_ids.shape == labels.shape == (3, 16) and input_ids.dtype == torch.int64
    assert input_ids.device.type == "meta" and next(model.parameters()).device.type == "meta"
    assert resolve_model("gpt-tiny").with_seq(64).config.seq == 64


def test_file_factory(tmp_path):
    (tmp_path / "models.py").write_text(
        textwrap.dedent("""
        import torch

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(50, 8)
                self.out = torch.nn.Linear(8, 50)

            def forward(self, input_ids, labels):
                logits = self.out(self.emb(input_ids))
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

        def make(batch=4, seq=12):
            ids = torch.randint(0, 50, (batch, seq))
            return Tiny(), (ids, ids)

        def fixed():
            ids = torch.randint(0, 50, (2, 10))
            return Tiny(), (ids, ids)
    """)
    )
    source = resolve_model(f"{tmp_path}/models.py:make")
    assert (source.family, source.seq, source.vocab) == ("file", 12, None)
    assert source.source_file() == tmp_path / "models.py"
    model, inputs = source.build(batch=3, seq=7, device="cpu")
    assert inputs[0].shape == (3, 7) and torch.isfinite(model(*inputs))
    model, inputs = source.build(device="meta")
    assert inputs[0].device.type == "meta"
    fixed = resolve_model(f"{tmp_path}/models.py:fixed")
    assert fixed.seq == 10
    with pytest.raises(ValueError, match="does not take seq"):
        fixed.build(seq=20)
    with pytest.raises(ValueError, match="factory 'make_model' not found in models.py"):
        resolve_model(f"{tmp_path}/models.py:make_model")


# --- Hugging Face --------------------------------------------------------------------------------------------------


HF_SPECS = {
    "gpt2": ("hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=128,n_positions=64", "model.transformer.h"),
    "llama": (
        (
            "hf:llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
            "num_key_value_heads=2,vocab_size=128"
        ),
        "model.model.layers",
    ),
    "bert": (
        (
            "hf:bert:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=128,"
            "max_position_embeddings=64"
        ),
        "model.bert.encoder.layer",
    ),
    "mixtral": (
        (
            "hf:mixtral:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
            "num_key_value_heads=2,vocab_size=128,num_local_experts=4,seq=32"
        ),
        "model.model.layers",
    ),
}


@pytest.mark.parametrize("name", sorted(HF_SPECS))
def test_hf_models_build_and_train_on_cpu(name):
    spec, container = HF_SPECS[name]
    source = resolve_model(spec)
    assert source.family == "hf" and source.vocab == 128 and source.arch()["layers"] == 2
    torch.manual_seed(0)
    model, (input_ids, labels) = source.build(batch=2, seq=16, device="cpu")
    assert isinstance(model, HFCausalLMLoss)
    assert hf_layer_container(model) == container
    loss = model(input_ids, labels)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    _trains(model, input_ids, labels)
    if name == "mixtral":
        assert source.seq == 32 and source.arch()["experts"] == 4
        assert model.model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_hf_loss_follows_the_batch_contract(name):
    """labels[:, t] is the token after input_ids[:, t]: the wrapper's loss is the cross-entropy of the model's own
    logits[:, t] against labels[:, t], computed here independently (passing labels= to transformers would shift
    them a second time and train on token t + 2)."""
    source = resolve_model(HF_SPECS[name][0])
    torch.manual_seed(0)
    model, (input_ids, labels) = source.build(batch=2, seq=16, device="cpu")
    logits = model.model(input_ids=input_ids).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    assert model(input_ids, labels).item() == pytest.approx(expected.item(), rel=1e-5)
    shifted_again = model.model(input_ids=input_ids, labels=labels).loss  # what the wrapper used to return
    assert abs(shifted_again.item() - expected.item()) > 1e-3


def test_hf_meta_build_returns_fake_tensors_that_export():
    spec, _ = HF_SPECS["llama"]
    model, (input_ids, labels) = resolve_model(spec).build(batch=2, seq=16, device="meta")
    assert isinstance(input_ids, FakeTensor) and isinstance(labels, FakeTensor)
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    torch.export.export(model, (input_ids, labels), strict=False)


def test_hf_small_vocab_keeps_special_tokens_inside():
    config = resolve_model("hf:gpt2:n_layer=1,vocab_size=100").config
    assert config.bos_token_id == config.eos_token_id == 99 and config.use_cache is False


def test_hf_learned_positions_limit_seq():
    source = resolve_model(HF_SPECS["gpt2"][0])
    assert source.seq == 64
    with pytest.raises(ValueError, match="n_positions"):
        source.build(seq=128, device="meta")


def test_config_dataclasses_are_frozen_and_keyword_only():
    config = GPTConfig(layers=1, hidden=8, heads=2, seq=4, vocab=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(1, 8, 2, 4, 10)  # type: ignore[misc]
    assert math.isclose(MODEL_PRESETS["mixtral-8x7b"].rope_theta, 1e6)
