"""Real architectures, built from their published dimensions with random weights (no download).

The dimensions are typed from each model's published `config.json`; only shapes matter here, so the
models are built on the `meta` device or under fake tensors for planning, or small ones for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from colab_memopt.core.console import quiet
from colab_memopt.core.modelref import is_hub_id, local_path
from colab_memopt.techniques.models import MODEL_SIZES, build_model


@dataclass(frozen=True)
class Architecture:
    """A transformers architecture: its class names and config values."""

    name: str
    family: str  # 'llama', 'qwen2', 'gpt2'
    config: dict[str, Any]
    source: str
    dtype: str = "float32"  # the published checkpoint's dtype (its config.json's `torch_dtype`; none there: float32)

    @quiet()  # the libraries' notes when transformers loads its modules (cm.quiet(verbose=True) shows them)
    def hf_config(self) -> Any:
        """Return the transformers config of this architecture, with the published checkpoint's dtype: what
        transformers 5's `from_pretrained` loads it in when no dtype is given."""
        import transformers

        return getattr(transformers, _CLASSES[self.family][0])(**self.config, dtype=self.dtype)

    @quiet()
    def build(self) -> nn.Module:
        """Return the model with random weights on the current default device."""
        import transformers

        return getattr(transformers, _CLASSES[self.family][1])(self.hf_config())

    @property
    def max_seq_len(self) -> int:
        return int(self.config.get("max_position_embeddings", self.config.get("n_positions", 1024)))


_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}


def _llama(hidden, inter, layers, heads, kv, vocab, tied, positions, **extra):
    return dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=positions, **extra
    )


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture("gpt2", "gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
                     "openai-community/gpt2 config.json"),
        Architecture("smollm2-135m", "llama", _llama(576, 1536, 30, 9, 3, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-135M config.json", "bfloat16"),
        Architecture("smollm2-360m", "llama", _llama(960, 2560, 32, 15, 5, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-360M config.json", "bfloat16"),
        Architecture("smollm2-1.7b", "llama", _llama(2048, 8192, 24, 32, 32, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-1.7B config.json", "bfloat16"),
        Architecture("qwen2.5-0.5b", "qwen2", _llama(896, 4864, 24, 14, 2, 151936, True, 32768),
                     "Qwen/Qwen2.5-0.5B config.json", "bfloat16"),
        Architecture("qwen2.5-1.5b", "qwen2", _llama(1536, 8960, 28, 12, 2, 151936, True, 32768),
                     "Qwen/Qwen2.5-1.5B config.json", "bfloat16"),
        Architecture("llama-3.2-1b", "llama", _llama(2048, 8192, 16, 32, 8, 128256, True, 131072),
                     "meta-llama/Llama-3.2-1B config.json", "bfloat16"),
        Architecture("llama-3.2-3b", "llama", _llama(3072, 8192, 28, 24, 8, 128256, True, 131072),
                     "meta-llama/Llama-3.2-3B config.json", "bfloat16"),
        Architecture("llama-3.1-8b", "llama", _llama(4096, 14336, 32, 32, 8, 128256, False, 131072),
                     "meta-llama/Llama-3.1-8B config.json", "bfloat16"),
    ]
}


def model_names() -> list[str]:
    """Return every model name `model_factory` accepts: reference sizes, then real architectures."""
    return [*MODEL_SIZES, *ARCHITECTURES]


def model_factory(name: str, **overrides: Any) -> Callable[[], nn.Module]:
    """Return a zero-argument function that builds the named model with random weights.

    Reference sizes ('tiny' ... '1b') build `models.GPT` (overrides are config fields); real
    architectures ('llama-3.2-1b', 'qwen2.5-0.5b', ...) build the transformers model; anything else
    `resolve_model` accepts (a Hugging Face id, a folder or config.json) builds from its config.
    """
    if name in MODEL_SIZES:
        return lambda: build_model(name, device="cpu", **overrides)
    if name in ARCHITECTURES:
        if overrides:
            raise ValueError(f"overrides apply to reference sizes only, got {sorted(overrides)} for {name!r}")
        return ARCHITECTURES[name].build
    if overrides:
        raise ValueError(f"overrides apply to reference sizes only, got {sorted(overrides)} for {name!r}")
    return resolve_model(name).build


def max_seq_len(name: str) -> int:
    """Return the longest sequence the named model accepts."""
    if name in MODEL_SIZES:
        return MODEL_SIZES[name].seq_len
    if name in ARCHITECTURES:
        return ARCHITECTURES[name].max_seq_len
    limit = resolve_model(name).max_seq_len
    if limit is None:
        raise ValueError(f"model {name!r} has no maximum sequence length in its config: give seq_len")
    return limit


# -- Any causal LM: our names, a Hugging Face model id, a local folder or config.json, a config, a factory.

HUB_HOST = "huggingface.co"


@dataclass(frozen=True)
class ModelSpec:
    """A model the planner, the recommender and the loader can use: how to build it and what it is.

    `build` returns the model with random weights on the current default device (`meta` or fake
    tensors for planning); `family` is transformers' `model_type` ('llama', 'qwen2', ...) where known;
    `config` the `PretrainedConfig` where there is one; `source` says where it came from.
    """

    name: str
    build: Callable[[], nn.Module]
    max_seq_len: int | None
    family: str | None
    config: Any = None
    source: str = ""
    path: str | None = None  # a local folder that may also hold weights and a tokenizer


# Models resolved from ids, folders and configs, by name: `model_factory`, `max_seq_len` and
# `family_of` find them again (the recommender and capacity pass names around).
_RESOLVED: dict[str, ModelSpec] = {}


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Return whether the Hugging Face hub answers at all (one TCP connection, `timeout_s` at most)."""
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _config_seq_len(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# Config fields that size the model: each, where the config has it, must be an integer >= 1.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim")


def check_config(config: Any, where: str) -> None:
    """Raise ValueError naming the field if `config` (a config or config.json's dict) cannot size a model."""
    import torch

    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    values = {}
    for key in _SIZE_FIELDS:
        try:
            value = get(key, None)
        except Exception:  # noqa: BLE001 - a property that cannot compute from a broken config
            value = None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        values[key] = value
    positions = get("max_position_embeddings", None)
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 0):
        raise ValueError(f"{where}: max_position_embeddings must be an integer >= 0, got {positions!r}")
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    if hidden and heads and "head_dim" not in values and hidden % heads:
        raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    kv = values.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    # A config object of transformers >= 4.56 keeps its dtype as `dtype` and answers `torch_dtype` with a deprecation
    # note: read the old name only from config.json's dict or a config that has no `dtype`.
    keys = ("dtype",) if not isinstance(config, dict) and hasattr(config, "dtype") else ("dtype", "torch_dtype")
    for key in keys:
        dtype = get(key, None)
        if isinstance(dtype, str) and not isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
            raise ValueError(f"{where}: {key} must name a torch dtype ('float32', 'float16', 'bfloat16'), got {dtype!r}")


def _from_config(name: str, config: Any, source: str, path: str | None = None) -> ModelSpec:
    """Return the spec of a transformers causal LM built from `config` (fp32 weights, whatever the checkpoint's dtype)."""
    import copy

    import torch
    import transformers

    check_config(config, source)
    from_config = transformers.AutoModelForCausalLM.from_config
    try:
        transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(
            f"{name!r} is a {config.model_type!r} model, which transformers {transformers.__version__} cannot build as a "
            "causal language model (AutoModelForCausalLM); give a causal LM's id, folder or config"
        ) from None

    def build() -> nn.Module:
        # Training keeps fp32 master weights; the recipe (not the checkpoint's dtype) decides the precision. Each model
        # gets its own copy of the config: transformers' from_config writes the dtype into the config it is given
        # (the caller's, whose dtype says what from_pretrained would load) and the model keeps that object.
        with quiet():  # the libraries' notes when transformers loads the model's modules
            return from_config(copy.deepcopy(config), dtype=torch.float32)

    build.__name__ = name
    spec = ModelSpec(name, build, _config_seq_len(config), getattr(config, "model_type", None), config, source, path)
    _RESOLVED[name] = spec
    return spec


def _read_config(path: Any) -> Any:
    import json
    from pathlib import Path

    import transformers

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(file)!r} as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} does not hold a JSON object (a transformers config), got {type(raw).__name__}")
    check_config(raw, str(file))
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers' strict validation raises its own classes: the file is the user's
        text = " ".join(str(exc).split())[:400] or type(exc).__name__
        raise ValueError(f"cannot read a transformers config from {str(path)!r}: {text}") from None
    if not isinstance(config, transformers.PretrainedConfig):
        raise ValueError(f"config.json in {str(path)!r} does not hold a JSON object of a transformers config")
    return config


# Specs of local folders, keyed by the config.json's resolved path, modification time and size: an edited
# config.json is read again (a folder's name alone would answer for the old model).
_FOLDERS: dict[tuple[str, int, int], ModelSpec] = {}
_FOLDER_SPECS: dict[str, ModelSpec] = {}  # the spec each folder name last resolved to


def _from_folder(model: str, folder: Any) -> ModelSpec:
    config_path = folder / "config.json"
    stat = config_path.stat()
    key = (str(config_path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _FOLDERS:
        _FOLDERS[key] = _from_config(model, _read_config(folder), f"local config {config_path}", str(folder))
    spec = _FOLDERS[key]
    _RESOLVED[model] = _FOLDER_SPECS[model] = spec
    return spec


@quiet()  # transformers' first use imports torchao and DeepSpeed, whose notes say nothing about the user's model
def resolve_model(model: Any) -> ModelSpec:
    """Return the `ModelSpec` of a model given in any of the accepted forms.

    Args:
        model: one of our names (`model_names()`); a local folder holding a `config.json` or the path of
            a `config.json`; a Hugging Face model id such as 'Qwen/Qwen2.5-0.5B' (its config is read
            with `transformers.AutoConfig`: from the local cache, else from the hub); a
            `transformers.PretrainedConfig`; or a zero-argument function that builds an `nn.Module`.

    Raises:
        ValueError: an unknown name, a folder without a config, a config transformers cannot build as
            a causal LM, or a hub id on a machine that cannot reach the hub (the message says so).

    Example:
        >>> spec = resolve_model("path/to/folder")        # folder with config.json
        >>> plan(spec.build, 1, seq_len=128)               # or simply plan("path/to/folder", ...)
    """
    from pathlib import Path

    import os

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str) and not model.strip():
        raise ValueError("model must not be empty: give a name, a Hugging Face id, a folder or a config.json")
    if isinstance(model, str):
        if model in MODEL_SIZES or model in ARCHITECTURES:
            arch = ARCHITECTURES.get(model)
            return ModelSpec(model, model_factory(model), max_seq_len(model), arch.family if arch else None,
                             arch.hf_config() if arch else None, source="colab_memopt.techniques.architectures")
        if model in _RESOLVED and _RESOLVED[model] is not _FOLDER_SPECS.get(model):
            return _RESOLVED[model]
        path = local_path(model)
        if path.is_dir() or path.is_file():
            folder = path if path.is_dir() else path.parent
            if path.is_file() and path.name != "config.json":
                raise ValueError(f"a model file must be a config.json, got {model!r}")
            if not (folder / "config.json").is_file():
                raise ValueError(f"the folder {str(folder)!r} holds no config.json: give a folder saved with save_pretrained")
            return _from_folder(model, folder)
        if is_hub_id(model):
            return _from_hub(model)
        raise ValueError(
            f"unknown model {model!r}: not one of our names ({', '.join(model_names())}), not a local folder or "
            "config.json, and not a Hugging Face id ('org/name')"
        )
    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        PretrainedConfig = ()  # type: ignore[assignment,misc]
    if PretrainedConfig and isinstance(model, PretrainedConfig):
        name = getattr(model, "name_or_path", "") or f"{model.model_type}-config-{id(model):x}"
        if Path(name).is_dir():  # read from a folder (a loaded model's config): its weights are there
            return _from_config(name, model, f"local config {Path(name) / 'config.json'}", name)
        if name.count("/") == 1 and not Path(name).exists():  # read from the hub
            return _from_config(name, model, f"Hugging Face config {name}")
        return _from_config(name, model, f"PretrainedConfig ({type(model).__name__})")
    if callable(model):
        name = getattr(model, "__name__", "model")
        return ModelSpec(name, model, None, None, source="factory")
    raise TypeError(
        f"model must be a name, a Hugging Face id, a folder or config.json, a PretrainedConfig or a zero-argument "
        f"factory, got {type(model).__name__}"
    )


def _from_hub(model_id: str) -> ModelSpec:
    """Return the spec of a hub model from its config: the local cache first, then the hub if it answers."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError):
        if not _hub_reachable():
            raise ValueError(
                f"cannot read the config of Hugging Face model {model_id!r}: no network (huggingface.co unreachable) "
                "and not in the local cache; download it where there is a network, or give a local folder or config.json"
            ) from None
        try:
            config = transformers.AutoConfig.from_pretrained(model_id)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the config of Hugging Face model {model_id!r}: {str(exc).splitlines()[0]}") from None
    return _from_config(model_id, config, f"Hugging Face config {model_id}", None)


def family_of(model: Any) -> str | None:
    """Return the transformers `model_type` of a model (None for the reference model and factories)."""
    return resolve_model(model).family


# Small configs of transformers families, for tests and CI runs: a few hundred thousand parameters.
SMALL_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma2", "gpt_neox")


@quiet()
def small_config(family: str, **overrides: Any) -> Any:
    """Return a small `PretrainedConfig` of a transformers family (2 layers, width 64, vocabulary 512).

    For tests and CI: save it with `.save_pretrained(folder)` and pass the folder wherever a model is
    taken. `overrides` replace config fields (e.g. num_hidden_layers=4).
    """
    import transformers

    if not isinstance(family, str) or family not in transformers.CONFIG_MAPPING:
        raise ValueError(f"unknown transformers family {family!r}; for example one of {SMALL_FAMILIES}")
    values: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
    )
    if family == "gemma2":
        values.update(head_dim=16, sliding_window=64)
    if family == "gpt_neox":
        values.pop("num_key_value_heads")
    values.update(overrides)
    return transformers.AutoConfig.for_model(family, **values)
