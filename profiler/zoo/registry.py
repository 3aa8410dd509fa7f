"""Model specs: presets, parameterised zoo models, Hugging Face config classes and user files.

Spec forms accepted by :func:`resolve_model`:

- a preset, optionally with overrides: ``llama3-8b``, ``llama3-8b:seq=4096``;
- a parameterised zoo model: ``gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200[,ffn=…][,dropout=…]
  [,attention=math]``, ``llama:layers=…,hidden=…,heads=…,kv_heads=…,ffn=…,vocab=…,seq=…``, ``moe:…`` (llama keys
  plus ``experts``, ``top_k``, ``capacity_factor``);
- ``hf:MODEL_TYPE[:key=value,…]``: a transformers config class with overrides (``seq=`` sets our sequence length);
- ``path/to/file.py:factory``: ``factory(batch=…, seq=…)`` (each keyword only if it accepts it) returns
  ``(model, example_inputs)``.

Bad specs raise ``ValueError`` with one line saying what is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import pathlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from profiler.zoo import gpt, llama, moe

Family = Literal["gpt", "llama", "moe", "hf", "file"]

_ZOO: dict[str, tuple[type, type, types.ModuleType]] = {
    "gpt": (gpt.GPTConfig, gpt.GPT, gpt),
    "llama": (llama.LlamaConfig, llama.Llama, llama),
    "moe": (moe.MoEConfig, moe.MoETransformer, moe),
}

MODEL_PRESETS: dict[str, gpt.GPTConfig | llama.LlamaConfig | moe.MoEConfig] = {
    # Brown et al. 2020, table 2.1; Narayanan et al. 2021 use vocab 51200.
    "gpt3-175b": gpt.GPTConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    # Llama 3 herd of models (Dubey et al. 2024), table 3.
    "llama3-8b": llama.LlamaConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3-70b": llama.LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "llama3-405b": llama.LlamaConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
    # Mixtral of experts (Jiang et al. 2024), table 1.
    "mixtral-8x7b": moe.MoEConfig(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=32000,
        seq=4096,
        rope_theta=1e6,
        experts=8,
        top_k=2,
    ),
    # Small models for tests and CPU runs.
    "gpt-tiny": gpt.GPTConfig(layers=2, hidden=64, heads=4, seq=32, vocab=128),
    "gpt-small": gpt.GPTConfig(layers=4, hidden=256, heads=8, seq=128, vocab=1024),
    "llama-tiny": llama.LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32),
    "moe-tiny": moe.MoEConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, experts=4, top_k=2),
}

_DESCRIPTIONS = {
    "gpt3-175b": "GPT-3 175B",
    "llama3-8b": "Llama 3 8B",
    "llama3-70b": "Llama 3 70B",
    "llama3-405b": "Llama 3 405B",
    "mixtral-8x7b": "Mixtral 8x7B (top-2 of 8 experts)",
    "gpt-tiny": "tiny GPT for tests",
    "gpt-small": "small GPT for CPU runs",
    "llama-tiny": "tiny Llama for tests",
    "moe-tiny": "tiny MoE for tests",
}

_FORMS = "gpt:k=v,…/llama:k=v,…/moe:k=v,…/hf:TYPE[:k=v,…]/path.py:factory"


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A resolved model spec: how to build the model and what is known about it before building."""

    spec: str
    """The spec string as given."""
    family: Family
    """``gpt``, ``llama``, ``moe`` (zoo), ``hf`` (transformers config class) or ``file`` (user factory)."""
    config: Any = field(compare=False)
    """The zoo config dataclass, the transformers config object, or None for files."""
    seq: int
    """Sequence length of the example inputs."""
    vocab: int | None
    """Vocabulary size, None where unknown (files)."""
    path: pathlib.Path | None = None
    """The user's file (``file`` family only)."""
    factory: str | None = None
    """The factory's name in ``path`` (``file`` family only)."""

    def build(
        self, *, batch: int = 1, seq: int | None = None, device: str | torch.device = "meta"
    ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """The model and example inputs ``(input_ids, labels)`` of shape (batch, seq), int64, on ``device``.

        Zoo models are built under ``torch.device(device)`` with the config's ``seq`` replaced by ``seq`` (GPT's
        position table follows it). Hugging Face models on ``"meta"`` are built under ``FakeTensorMode`` instead and
        come back as fake tensors (see :mod:`profiler.zoo.hf`). File factories are called under
        ``torch.device(device)`` with ``batch``/``seq`` where they accept them; otherwise their own shapes stand.
        """
        seq = self.seq if seq is None else seq
        if batch < 1 or seq < 1:
            raise ValueError(f"{self.spec}: batch={batch} and seq={seq} must be >= 1")
        if self.family in _ZOO:
            config = self.config if seq == self.config.seq else dataclasses.replace(self.config, seq=seq)
            model_cls = _ZOO[self.family][1]
            with torch.device(device):
                model = model_cls(config)
                input_ids = torch.randint(0, config.vocab, (batch, seq))
                labels = torch.randint(0, config.vocab, (batch, seq))
            return model, (input_ids, labels)
        if self.family == "hf":
            from profiler.zoo import hf

            return hf.build_hf(self.config, batch=batch, seq=seq, device=device)
        assert self.family == "file" and self.path is not None and self.factory is not None
        return _call_factory(self.path, self.factory, batch=batch, seq=seq, device=device, seq_given=seq != self.seq)

    def arch(self) -> dict[str, int | float]:
        """Known architecture facts for the cost model: hidden, heads, kv_heads, layers, ffn, vocab, seq, and for
        MoE experts, top_k, capacity_factor; ``params`` (total parameter count) for zoo models."""
        if self.family == "hf":
            from profiler.zoo import hf

            return {**hf.hf_arch(self.config), "seq": self.seq}
        if self.family == "file":
            return {"seq": self.seq}
        c = self.config
        facts: dict[str, int | float] = {
            "hidden": c.hidden,
            "heads": c.heads,
            "kv_heads": getattr(c, "kv_heads", c.heads),
            "layers": c.layers,
            "ffn": c.ffn_dim if self.family == "gpt" else c.ffn,
            "vocab": c.vocab,
            "seq": self.seq,
        }
        if self.family == "moe":
            facts.update(experts=c.experts, top_k=c.top_k, capacity_factor=c.capacity_factor)
        facts["params"] = param_count(c)
        return facts

    def source_file(self) -> pathlib.Path | None:
        """The .py file defining the model, for the emitter: the zoo file, the user's file, or None (hf)."""
        if self.family in _ZOO:
            return pathlib.Path(_ZOO[self.family][2].__file__)
        return self.path

    def model_expr(self) -> str | None:
        """Python expression building the model from the namespace of :meth:`source_file` (zoo models only),
        e.g. ``GPT(GPTConfig(layers=2, …))``."""
        if self.family not in _ZOO:
            return None
        return f"{_ZOO[self.family][1].__name__}({self.config!r})"

    def with_seq(self, seq: int) -> ModelSource:
        """The same model at another sequence length (zoo configs get ``seq`` replaced)."""
        if seq == self.seq:
            return self
        config = self.config
        if self.family in _ZOO:
            config = _make_config(self.family, dataclasses.replace, config, seq=seq)
        return dataclasses.replace(self, config=config, seq=seq)


def param_count(config: gpt.GPTConfig | llama.LlamaConfig | moe.MoEConfig) -> int:
    """Closed-form parameter count of a zoo model (tied weights counted once).

    GPT: 12lh² + 13lh + Vh + sh + 2h for ffn = 4h (Narayanan et al. 2021, eq. 2, plus the final LayerNorm).
    """
    h, l, v = config.hidden, config.layers, config.vocab
    if isinstance(config, gpt.GPTConfig):
        f = config.ffn_dim
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        return l * per_layer + v * h + config.seq * h + 2 * h
    attention = 2 * h * h + 2 * h * config.kv_heads * config.head_dim
    if isinstance(config, moe.MoEConfig):
        ffn = h * config.experts + 3 * config.experts * h * config.ffn
    else:
        ffn = 3 * h * config.ffn
    head = 0 if config.tie_embeddings else v * h
    return l * (attention + ffn + 2 * h) + v * h + head + h


def list_models() -> list[tuple[str, str]]:
    """(name, one-line description with parameter count) for every preset, then the parameterised forms."""
    rows = []
    for name, config in MODEL_PRESETS.items():
        c = config
        shape = f"{c.layers} layers, hidden {c.hidden}, {c.heads} heads"
        if not isinstance(c, gpt.GPTConfig):
            shape += f" ({c.kv_heads} kv)"
        if isinstance(c, moe.MoEConfig):
            shape += f", {c.experts} experts top-{c.top_k}"
        shape += f", seq {c.seq}, vocab {c.vocab}"
        rows.append((name, f"{_DESCRIPTIONS[name]}: {shape}; {_human(param_count(c))} params"))
    rows += [
        ("gpt:k=v,…", "Megatron GPT: layers, hidden, heads, seq, vocab [, ffn, dropout, attention=sdpa|math]"),
        ("llama:k=v,…", "Llama: layers, hidden, heads, kv_heads, ffn, vocab [, seq, norm_eps, rope_theta]"),
        ("moe:k=v,…", "Mixtral-style MoE: llama keys + experts, top_k [, capacity_factor]"),
        (
            "hf:TYPE[:k=v,…]",
            "Hugging Face config class with overrides, random weights (e.g. hf:llama:num_hidden_layers=2)",
        ),
        ("path.py:factory", "your file; factory(batch=, seq=) returns (model, example_inputs)"),
    ]
    return rows


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names a user's ``path/to/file.py:factory`` (the form `resolve_model` resolves by path)."""
    return spec.strip().partition(":")[0].endswith(".py")


def resolve_model(spec: str) -> ModelSource:
    """Parse a model spec (see the module docstring) into a :class:`ModelSource`; ValueError on a bad spec."""
    spec = spec.strip()
    head, _, rest = spec.partition(":")
    if head == "hf":
        return _resolve_hf(spec, rest)
    if head in _ZOO:
        config = _make_config(head, lambda cls, **kw: cls(**kw), _ZOO[head][0], **_parse_kv(head, rest, _ZOO[head][0]))
        return ModelSource(spec=spec, family=head, config=config, seq=config.seq, vocab=config.vocab)
    if is_file_spec(spec):
        return _resolve_file(spec, head, rest)
    if head in MODEL_PRESETS:
        config = MODEL_PRESETS[head]
        if rest:
            overrides = _parse_kv(head, rest, type(config))
            config = _make_config(head, dataclasses.replace, config, **overrides)
        return ModelSource(spec=spec, family=_family_of(config), config=config, seq=config.seq, vocab=config.vocab)
    raise ValueError(f"unknown model {head!r}; known presets: {', '.join(MODEL_PRESETS)}; or use {_FORMS}")


def _family_of(config: object) -> Family:
    for family, (config_cls, _, _) in _ZOO.items():
        if isinstance(config, config_cls):
            return family  # type: ignore[return-value]
    raise AssertionError(f"not a zoo config: {config!r}")


def _make_config(where: str, make, *args, **kwargs):
    """Build a config via ``make``, prefixing its ValueError with where it came from."""
    try:
        return make(*args, **kwargs)
    except ValueError as err:
        raise ValueError(f"{where} spec: {err}") from None
    except TypeError as err:  # a missing required field
        missing = [f.name for f in dataclasses.fields(args[0]) if f.name not in kwargs and _required(f)]
        if not missing:
            raise
        raise ValueError(f"{where} spec: missing key(s) {', '.join(missing)} (e.g. {missing[0]}=…)") from err


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _parse_kv(where: str, text: str, config_cls: type) -> dict[str, Any]:
    """``k=v,k=v`` into typed values for the fields of ``config_cls``."""
    hints = typing.get_type_hints(config_cls)
    known = [f.name for f in dataclasses.fields(config_cls)]
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not raw:
            raise ValueError(f"{where} spec: expected key=value, got {item!r} (e.g. layers=2)")
        if key not in known:
            raise ValueError(f"{where} spec: unknown key {key!r} (known: {', '.join(known)})")
        values[key] = _convert(where, key, raw, hints[key])
    return values


def _convert(where: str, key: str, raw: str, hint: Any) -> Any:
    options = [t for t in typing.get_args(hint) if t is not type(None)] if typing.get_args(hint) else [hint]
    if typing.get_origin(hint) is Literal:
        if raw not in typing.get_args(hint):
            raise ValueError(f"{where} spec: {key}={raw!r} must be one of {', '.join(typing.get_args(hint))}")
        return raw
    kind = options[0]
    if raw.lower() == "none" and type(None) in typing.get_args(hint):
        return None
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{where} spec: {key}={raw!r} is not a bool (true/false)")
        return raw.lower() in ("true", "1")
    try:
        return float(raw) if kind is float else int(raw)
    except ValueError:
        raise ValueError(
            f"{where} spec: {key}={raw!r} is not {'a number' if kind is float else 'an integer'}"
        ) from None


def _resolve_hf(spec: str, rest: str) -> ModelSource:
    from profiler.zoo import hf

    model_type, _, text = rest.partition(":")
    if not model_type:
        raise ValueError(f"{spec!r}: missing model type; use hf:MODEL_TYPE[:key=value,…], e.g. hf:llama")
    published = None
    if model_type.endswith(".json"):  # a model's published config.json (nothing downloaded)
        published = _published_config(model_type)
        model_type = str(published.pop("model_type"))
    overrides: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"hf:{model_type}: expected key=value, got {item!r} (e.g. num_hidden_layers=2)")
        overrides[key.strip()] = hf.parse_value(raw.strip())
    seq = overrides.pop("seq", None)
    if seq is not None and (not isinstance(seq, int) or seq < 1):
        raise ValueError(f"hf:{model_type}: seq={seq!r} must be a positive integer")
    config = hf.hf_config(model_type, overrides, published)
    hf.hf_task(config)  # fail now, not at build time, for types without an LM head
    return ModelSource(
        spec=spec,
        family="hf",
        config=config,
        seq=seq if seq is not None else hf.hf_default_seq(config),
        vocab=config.vocab_size,
    )


#: config.json entries that describe the checkpoint or the tooling, not the model
_NOT_MODEL_KEYS = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "auto_map",
                   "quantization_config", "use_cache")


def _published_config(path_text: str) -> dict:
    """A Hugging Face ``config.json`` as config overrides (its ``model_type`` included)."""
    import json

    path = pathlib.Path(path_text).expanduser()
    if not path.is_file():
        raise ValueError(f"hf:{path_text}: no such file; give the path of a model's config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"hf:{path_text}: not a JSON config ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"hf:{path_text}: no model_type in it; a transformers config.json names its model_type")
    return {k: v for k, v in data.items() if k not in _NOT_MODEL_KEYS}


def _resolve_file(spec: str, file_part: str, factory: str) -> ModelSource:
    if not factory:
        raise ValueError(f"{spec}: name the factory after the file, e.g. {file_part}:make_model")
    path = pathlib.Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{spec}: file not found ({path}); check the path")
    _model, inputs = _call_factory(path, factory, batch=1, seq=None, device="meta", seq_given=False)
    if not inputs or inputs[0].dim() < 2:
        got = tuple(inputs[0].shape) if inputs else "no inputs"
        raise ValueError(f"{spec}: example_inputs[0] must be (batch, seq) token ids, got {got}")
    return ModelSource(
        spec=spec, family="file", config=None, seq=int(inputs[0].shape[1]), vocab=None, path=path, factory=factory
    )


class UserCodeError(ValueError):
    """An exception raised by the user's own code (a factory, its module): reported in one line, exit 2."""


def user_error(exc: BaseException, path: pathlib.Path, what: str) -> str:
    """One line for an exception from the user's file ``path``: the deepest line of that file on the traceback,
    what ran (``what``), and the exception (`autopar … --debug` shows the whole traceback)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if pathlib.Path(f.filename).resolve() == path.resolve()]
    where = f"{path.name}:{frames[-1].lineno}" if frames else path.name
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{where}: {what} raised {type(exc).__name__}" + (f": {message}" if message else "") + \
        " (fix it there; --debug shows the traceback)"


def _load_factory(path: pathlib.Path, factory: str):
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_autopar_user_{path.stem}_{digest}"
    module = sys.modules.get(name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[name]
            if isinstance(exc, Exception):  # the user's module failed; KeyboardInterrupt and exits pass through
                raise UserCodeError(user_error(exc, path, f"importing {path.name}")) from exc
            raise
    fn = getattr(module, factory, None)
    if not callable(fn):
        message = f"factory {factory!r} not found in {path.name}; define def {factory}(batch, seq) there"
        raise ValueError(message)  # noqa: TRY004 - a bad spec, reported like the others
    return fn


def _call_factory(
    path: pathlib.Path, factory: str, *, batch: int, seq: int | None, device: str | torch.device, seq_given: bool
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    fn = _load_factory(path, factory)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, int] = {}
    if takes_any or "batch" in params:
        kwargs["batch"] = batch
    if seq is not None and (takes_any or "seq" in params):
        kwargs["seq"] = seq
    elif seq_given:
        raise ValueError(f"factory {factory!r} in {path.name} does not take seq; add a seq keyword to it")
    try:
        with torch.device(device):
            result = fn(**kwargs)
    except Exception as exc:
        raise UserCodeError(user_error(exc, path, f"factory {factory!r}")) from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module)):
        # A user error (exit code 2) like every other bad spec, hence ValueError.
        message = f"factory {factory!r} in {path.name} must return (model, example_inputs)"
        raise ValueError(message)
    model, inputs = result
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError(f"factory {factory!r} in {path.name}: example_inputs must be tensors")
    return model, inputs


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
