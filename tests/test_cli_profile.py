"""``autopar profile`` and ``autopar models``: table, JSON, --out, measured times and their cache, user errors."""

import json
import subprocess
import sys
import textwrap

import pytest

from planner.cli.main import main
from profiler.zoo.registry import MODEL_PRESETS

LAYER_FIELDS = {"name", "kind", "signature", "params", "shared_params", "fwd_flops", "bwd_flops", "saved_bytes",
                "input_bytes", "fwd_bytes", "bwd_bytes", "nodes"}


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_profile_table(capsys):
    rc, out, err = run(capsys, "profile", "gpt-tiny")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("gpt-tiny: 110.34 K parameters, captured by export at batch 1, seq 32, bfloat16")
    assert lines[1].split()[:7] == ["layers", "count", "params", "fwd", "FLOPs", "bwd", "FLOPs"]
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["embed", "layers.0", "head"]
    assert rows[1][1:3] == ["…", "layers.1"] and rows[1][3] == "2"  # the two identical blocks share a row


def test_profile_json_has_per_layer_fields(capsys):
    rc, out, _ = run(capsys, "profile", "gpt-tiny", "--json")
    assert rc == 0
    data = json.loads(out)  # stdout is one JSON object and nothing else
    assert data["model"] == "gpt-tiny" and data["params"] == 110336
    assert len(data["fingerprint"]) == 16 and data["block_container"] == "layers"
    assert [layer["kind"] for layer in data["layers"]] == ["embed", "block", "block", "head"]
    for layer in data["layers"]:
        assert set(layer) == LAYER_FIELDS
    assert sum(layer["params"] for layer in data["layers"]) == data["params"]
    assert data["layers"][1]["fwd_flops"] > 0 and data["layers"][1]["saved_bytes"] > 0
    assert "measured" not in data


def test_profile_out_writes_file(capsys, tmp_path):
    path = tmp_path / "profile.json"
    rc, out, _ = run(capsys, "profile", "llama-tiny", "--out", str(path))
    assert rc == 0 and out.rstrip().endswith(f"wrote {path}")
    data = json.loads(path.read_text())
    assert data["model"] == "llama-tiny" and len(data["layers"]) == 4
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_profile_out_into_missing_folder_exits_2(capsys, tmp_path):
    path = tmp_path / "missing" / "profile.json"
    rc, out, err = run(capsys, "profile", "gpt-tiny", "--out", str(path))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "does not exist" in err and "missing" in err
    assert not path.parent.exists()


def test_profile_measures_on_cpu_and_caches(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    rc, out, _ = run(capsys, "profile", "gpt-tiny", "--device", "cpu", "--json")
    assert rc == 0
    first = json.loads(out)["measured"]
    assert first["cached"] == 0 and first["device"].startswith("cpu")
    assert set(first["layers"]) == {"embed", "layers.0", "layers.1", "head"}
    assert all(t["fwd_s"] > 0 and t["bwd_s"] > 0 for t in first["layers"].values())
    assert any((tmp_path / "profile").iterdir())
    rc, out, _ = run(capsys, "profile", "gpt-tiny", "--device", "cpu", "--json")
    second = json.loads(out)["measured"]
    assert second["cached"] == 4 and second["layers"] == first["layers"]  # served from the cache
    rc, out, _ = run(capsys, "profile", "gpt-tiny", "--device", "cpu")
    assert rc == 0 and "fwd time" in out.splitlines()[1]


def test_models_lists_presets(capsys):
    rc, out, _ = run(capsys, "models")
    assert rc == 0
    for name in MODEL_PRESETS:
        assert f"\n{name} " in out
    assert "hf:TYPE" in out and "file.py:factory" in out


@pytest.mark.parametrize("spec,message", [
    ("nosuch-model", "unknown model 'nosuch-model'"),
    ("gpt:layers=x", "layers='x' is not an integer"),
    ("hf:nosuch", "unknown model type 'nosuch'"),
    ("missing.py:factory", "file not found"),
])
def test_bad_model_spec_exits_2_with_one_line(capsys, spec, message):
    rc, out, err = run(capsys, "profile", spec)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


BAD_MODEL = textwrap.dedent("""
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            if x.sum() > 0:  # Python branching on a tensor's value: export cannot capture this
                x = x * 2
            return self.lin(x)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            for layer in self.layers:
                h = layer(h)
            return h.float().mean()


    def factory(batch=1, seq=8):
        return Net(), (torch.randint(0, 32, (batch, seq)), torch.randint(0, 32, (batch, seq)))
""")


def test_uncapturable_model_exits_2_naming_module_and_construct(tmp_path):
    """A real process, so torch's own logging and printing to stderr are checked too: one line, no traceback."""
    path = tmp_path / "bad.py"
    path.write_text(BAD_MODEL)
    proc = subprocess.run([sys.executable, "-m", "planner", "profile", f"{path}:factory"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    err = proc.stderr
    assert err.startswith("autopar profile: error: cannot capture Net:")
    assert "module 'layers.0' (Block.forward" in err and f"{path}:12" in err  # where
    assert "Python control flow or .item() on a tensor's value" in err  # what
    assert "torch.where" in err and "file.py:factory" in err  # the way out


USER_CODE = '''import torch


def raises(batch=1):
    raise RuntimeError("boom in my factory")
'''


@pytest.mark.parametrize("spec, needle", [
    ("{path}:raises", "user_model.py:5: factory 'raises' raised RuntimeError: boom in my factory"),
    ("{broken}:anything", "broken.py:1: importing broken.py raised ZeroDivisionError: division by zero"),
    ("hf:llama:num_hidden_layers=x", "hf:llama: Field 'num_hidden_layers' expected int, got str"),
    ("hf:llama:hidden_size=1.5", "hf:llama: Field 'hidden_size' expected int, got float"),
])
def test_errors_in_user_code_and_config_values_are_one_line(tmp_path, spec, needle):
    """A factory or module that raises, or an hf: override of the wrong type: one line naming the user's file and
    line (or the key), exit 2, no traceback; --debug shows the traceback."""
    import subprocess
    import sys

    (tmp_path / "user_model.py").write_text(USER_CODE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    spec = spec.format(path=tmp_path / "user_model.py", broken=tmp_path / "broken.py")
    r = subprocess.run([sys.executable, "-m", "planner", "profile", spec], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert needle in lines[0], lines[0]
    debug = subprocess.run([sys.executable, "-m", "planner", "--debug", "profile", spec], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
    assert "Traceback" in debug.stderr


def test_hf_published_config_json_plans_with_its_true_parameter_count(tmp_path, capsys):
    """hf:path/config.json: a model described by its published config file (extra keys such as architectures and
    torch_dtype ignored, nothing downloaded) profiles with the parameter count transformers builds."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, tie_word_embeddings=False)
    data = {**cfg.to_dict(), "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
            "transformers_version": "4.99.0"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with torch.device("meta"):
        true = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    rc, out, _ = run(capsys, "profile", f"hf:{path}:seq=64", "--json")
    assert rc == 0 and json.loads(out)["params"] == true


def test_hf_keys_read_by_modeling_code_are_accepted_and_typos_get_the_closest_names(capsys):
    """Qwen3-MoE's attention reads getattr(config, "head_dim", …): a key its config class may not declare."""
    from profiler.zoo import hf

    assert "head_dim" in hf.modeling_keys("qwen3_moe")
    rc, _, err = run(capsys, "profile", "hf:llama:hidden_sise=64")
    assert rc == 2 and "did you mean hidden_size" in err
