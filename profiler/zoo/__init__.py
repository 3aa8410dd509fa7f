"""Model zoo: GPT, Llama and Mixtral-style MoE as plain modules, Hugging Face config classes, and model specs.

``resolve_model(spec)`` turns a spec string (preset, ``gpt:…``, ``llama:…``, ``moe:…``, ``hf:TYPE[:…]``,
``path.py:factory``) into a :class:`ModelSource` that builds the model and its example inputs.
"""

from profiler.zoo.gpt import GPT, GPTConfig
from profiler.zoo.hf import HFCausalLMLoss, hf_layer_container
from profiler.zoo.llama import Llama, LlamaConfig
from profiler.zoo.moe import MoEConfig, MoETransformer, expert_capacity
from profiler.zoo.registry import MODEL_PRESETS, ModelSource, list_models, param_count, resolve_model

__all__ = [
    "GPT",
    "MODEL_PRESETS",
    "GPTConfig",
    "HFCausalLMLoss",
    "Llama",
    "LlamaConfig",
    "MoEConfig",
    "MoETransformer",
    "ModelSource",
    "expert_capacity",
    "hf_layer_container",
    "list_models",
    "param_count",
    "resolve_model",
]
