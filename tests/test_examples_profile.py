"""The examples work as their docstrings say: ``autopar profile examples/custom_model.py:factory``."""

import json
from pathlib import Path

from planner.cli.main import main
from profiler.api import profile_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_model.py"


def test_custom_model_profiles_from_the_cli(capsys):
    rc = main(["profile", f"{EXAMPLE}:factory", "--json", "--batch", "2", "--seq", "32"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert (data["batch"], data["seq"], data["block_container"]) == (2, 32, "blocks")
    assert [layer["kind"] for layer in data["layers"]] == ["embed", "block", "block", "block", "head"]
    assert len({layer["signature"] for layer in data["layers"] if layer["kind"] == "block"}) == 1
    assert all(layer["fwd_flops"] > 0 for layer in data["layers"][1:])


def test_custom_model_layers_and_roles():
    lg = profile_model(f"{EXAMPLE}:factory")
    assert lg.model.seq == 64 and sum(layer.param_numel for layer in lg.layers) == lg.model.num_params
    roles = {n.module_path.rsplit(".", 1)[-1]: n.tp_role for n in lg.blocks[0].nodes if n.kind == "matmul" and n.params}
    assert roles == {"wq": "column", "wk": "column", "wv": "column", "wo": "row", "w1": "column", "w2": "row"}
