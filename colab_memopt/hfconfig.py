"""Read Hugging Face training settings from files: TrainingArguments / SFTConfig, LoraConfig, BitsAndBytesConfig.

A TRL CLI config (`trl sft --config sft.yaml`) is one YAML file that mixes `SFTConfig` fields with
TRL's `ModelConfig` (model id, dtype, `use_peft`, `lora_r`, `load_in_4bit`, ...) and `ScriptArguments`
(dataset names). `read_training_config` sorts each key into the class that owns it, builds the
peft and bitsandbytes configs with TRL's own `get_peft_config` / `get_quantization_config`, and
refuses a key no class knows, by name. Nothing is dropped silently: keys that do not change memory
(dataset names, hub settings) are returned in `ignored`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainingConfig:
    """Settings read from files: what `plan_trainer` and `fit_trainer` take."""

    args: Any  # TrainingArguments or SFTConfig
    model: str | None = None  # ModelConfig.model_name_or_path, where the file names one
    lora: Any = None  # peft LoraConfig
    bnb: Any = None  # transformers BitsAndBytesConfig
    ignored: list[str] = field(default_factory=list)  # keys read but without effect on memory, each named
    notes: list[str] = field(default_factory=list)


def read_mapping(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Return the dict in a JSON or YAML file (or the dict itself); refuse anything else by name."""
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"no such config file: {str(path)!r}")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        values = json.loads(text)
    else:
        import yaml

        values = yaml.safe_load(text)
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} must hold a mapping of settings, got {type(values).__name__}")
    return values


def _names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def read_training_config(training_args: str | Path | dict[str, Any], *, lora: Any = None, bnb: Any = None) -> TrainingConfig:
    """Return the settings of a TrainingArguments / SFTConfig / TRL CLI file (JSON or YAML), with the peft and
    bitsandbytes configs of `lora` and `bnb` (files, dicts or config objects) or of the TRL keys in it.

    Example:
        >>> cfg = read_training_config("sft.yaml")
        >>> cm.plan_trainer(cfg.args, model=cfg.model, lora=cfg.lora, target="t4")
    """
    import torch
    from transformers import TrainingArguments
    from trl import ModelConfig, ScriptArguments, SFTConfig

    values = read_mapping(training_args)
    sft_keys, ta_keys = _names(SFTConfig), _names(TrainingArguments)
    model_keys, script_keys = _names(ModelConfig), _names(ScriptArguments)
    unknown = sorted(k for k in values if k not in sft_keys | model_keys | script_keys)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}: not a field of SFTConfig, TrainingArguments or TRL's "
                         "ModelConfig / ScriptArguments")
    model_values = {k: v for k, v in values.items() if k in model_keys and k not in sft_keys}
    ignored = sorted(k for k in values if k in script_keys and k not in sft_keys and k not in model_keys)
    arg_values = {k: v for k, v in values.items() if k in sft_keys}
    is_sft = bool(model_values or ignored or any(k not in ta_keys for k in arg_values)) or "max_length" in arg_values
    notes: list[str] = []
    if not torch.cuda.is_available() and not arg_values.get("use_cpu") and (arg_values.get("bf16") or arg_values.get("fp16")):
        arg_values["use_cpu"] = True  # TrainingArguments refuses fp16/bf16 without a GPU; planning changes nothing by it
        notes.append("use_cpu=True set to build the arguments on this machine without a GPU (no effect on the plan)")
    arg_values.setdefault("report_to", [])
    cls = SFTConfig if is_sft else TrainingArguments
    args = cls(**arg_values)
    model_args = ModelConfig(**model_values) if model_values else None
    if model_args is not None:
        from trl import get_peft_config, get_quantization_config

        if lora is None:
            lora = get_peft_config(model_args)
        if bnb is None:
            bnb = get_quantization_config(model_args)
        if model_args.dtype not in (None, "auto") and not (getattr(args, "model_init_kwargs", None) or {}).get("dtype"):
            args.model_init_kwargs = {**(getattr(args, "model_init_kwargs", None) or {}), "dtype": model_args.dtype}
    return TrainingConfig(args, getattr(model_args, "model_name_or_path", None), read_lora(lora), read_bnb(bnb),
                          ignored, notes)


def read_lora(source: Any) -> Any:
    """Return a peft LoraConfig from a file, a dict or a LoraConfig (None stays None)."""
    if source is None:
        return None
    from peft import LoraConfig

    if isinstance(source, LoraConfig):
        return source
    values = read_mapping(source)
    unknown = sorted(set(values) - _names(LoraConfig))
    if unknown:
        raise ValueError(f"unknown LoraConfig field(s) {unknown}")
    return LoraConfig(**values)


def read_bnb(source: Any) -> Any:
    """Return a transformers BitsAndBytesConfig from a file, a dict or a config (None stays None)."""
    if source is None:
        return None
    from transformers import BitsAndBytesConfig

    if isinstance(source, BitsAndBytesConfig):
        return source
    values = read_mapping(source)
    import inspect

    known = set(inspect.signature(BitsAndBytesConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown BitsAndBytesConfig field(s) {unknown}; known: {sorted(known)}")
    return BitsAndBytesConfig(**values)


def inline_fields(items: list[str]) -> dict[str, Any]:
    """Return FIELD=VALUE items (values as JSON where they parse, else strings) as a dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"expected FIELD=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out
