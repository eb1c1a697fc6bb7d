"""Read Hugging Face training settings from files: TrainingArguments / SFTConfig, LoraConfig, BitsAndBytesConfig.

A TRL CLI config (`trl sft --config sft.yaml`) is one YAML file that mixes `SFTConfig` fields with
TRL's `ModelConfig` (model id, dtype, `use_peft`, `lora_r`, `load_in_4bit`, ...) and `ScriptArguments`
(dataset names). `read_training_config` sorts each key into the class that owns it, builds the
peft and bitsandbytes configs with TRL's own `get_peft_config` / `get_quantization_config`, and
refuses a key no class knows, by name. Nothing is dropped silently: keys that do not change memory
(dataset names, hub settings) are returned in `ignored`.

It also translates between these settings and this project's `Recipe` both ways (`trainer_recipe`,
`recipe_settings`), naming what one side cannot say, and knows which `optim` names the planner can trace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colab_memopt.training.recipe import Recipe


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
        try:
            values = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    else:
        import yaml

        try:
            values = yaml.load(text, Loader=_unique_key_loader(path))  # safe_load's loader, duplicate keys refused
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = " ".join(str(getattr(err, "problem", None) or err).split())
            raise ValueError(f"{str(path)!r} is not valid YAML: {problem}{where}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} must hold a mapping of settings, got {type(values).__name__}")
    return values


def _unique_keys(pairs: list[tuple[Any, Any]], path: Path, line: int | None = None) -> dict[Any, Any]:
    """Return `pairs` as a dict; refuse a key given twice (JSON and YAML keep the last one without a word)."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            where = f" (line {line})" if line is not None else ""
            raise ValueError(f"{str(path)!r} gives {key!r} twice{where} ({out[key]!r}, then {value!r}): "
                             "keep the one you mean")
        out[key] = value
    return out


def _unique_key_loader(path: Path) -> Any:
    """Return a PyYAML SafeLoader class whose mappings refuse a key given twice, naming the file and the line."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            written = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
            self.flatten_mapping(node)  # merge keys (<<) first, as SafeLoader does: the written keys override them
            merged = len(node.value) - written
            out: dict[Any, Any] = {}
            written_keys: set[Any] = set()
            for i, (knode, vnode) in enumerate(node.value):
                key, value = self.construct_object(knode, deep=deep), self.construct_object(vnode, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            "found unhashable key", knode.start_mark) from None
                if i >= merged:
                    if key in written_keys:
                        _unique_keys([(key, out[key]), (key, value)], path, knode.start_mark.line + 1)
                    written_keys.add(key)
                out[key] = value
            return out

    return UniqueKeyLoader


def _names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _listed(names: list[str], most: int = 8) -> str:
    """Return the first `most` names, and how many more there are: an error line stays one short line."""
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _typed(cls: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Return `values` with the strings of number and bool fields of dataclass `cls` converted, as TRL's parser
    converts a config's values (YAML reads `2e-4` as a string); refuse one that does not convert, naming the key."""
    import typing

    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        if not isinstance(value, str) or key not in hints:
            continue
        kinds = set(typing.get_args(hints[key])) or {hints[key]}
        if str in kinds or not kinds & {int, float, bool}:
            continue
        kind = int if int in kinds and float not in kinds else float if float in kinds else bool
        try:
            if kind is bool:
                out[key] = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}[value.lower()]
            else:
                out[key] = kind(value)
        except (KeyError, ValueError):
            raise ValueError(f"{key}: {value!r} is not {'an integer' if kind is int else kind.__name__ + ' value'}") from None
    return out


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
    unknown = sorted(str(k) for k in values if k not in sft_keys | model_keys | script_keys)
    if unknown:
        raise ValueError(f"unknown setting(s) {_listed(unknown)}: not a field of SFTConfig, TrainingArguments or TRL's "
                         "ModelConfig / ScriptArguments")
    for key in ("deepspeed", "fsdp"):
        if values.get(key):
            raise ValueError(f"{key}: the plan does not model {'DeepSpeed' if key == 'deepspeed' else 'FSDP'} (it traces "
                             f"one GPU without it); remove {key} from the file to plan that"
                             + (", or plan ZeRO with the recipe fields zero_stage and offload_optimizer"
                                if key == "deepspeed" else ""))
    model_values = _typed(ModelConfig, {k: v for k, v in values.items() if k in model_keys and k not in sft_keys})
    ignored = sorted(k for k in values if k in script_keys and k not in sft_keys and k not in model_keys)
    arg_values = _typed(SFTConfig, {k: v for k, v in values.items() if k in sft_keys})
    is_sft = bool(model_values or ignored or any(k not in ta_keys for k in arg_values)) or "max_length" in arg_values
    notes: list[str] = []
    sft_bf16 = is_sft and arg_values.get("bf16") is None and not arg_values.get("fp16")  # SFTConfig's bf16 default: True
    if not torch.cuda.is_available() and not arg_values.get("use_cpu") and (arg_values.get("bf16") or arg_values.get("fp16")
                                                                            or sft_bf16):
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
    unknown = sorted(str(k) for k in set(values) - _names(LoraConfig))
    if unknown:
        raise ValueError(f"unknown LoraConfig field(s) {_listed(unknown)}")
    return LoraConfig(**_typed(LoraConfig, values))


def read_bnb(source: Any) -> Any:
    """Return a transformers BitsAndBytesConfig from a file, a dict or a config (None stays None)."""
    if source is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if isinstance(source, BitsAndBytesConfig):
        return source
    values = read_mapping(source)
    import inspect

    known = set(inspect.signature(BitsAndBytesConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(str(k) for k in set(values) - known)
    if unknown:
        raise ValueError(f"unknown BitsAndBytesConfig field(s) {_listed(unknown)}; known: {sorted(known)}")
    for name, allowed in _BNB_DTYPES.items():
        value = values.get(name)
        text = str(value).removeprefix("torch.") if value is not None else None
        if text is not None and (not isinstance(value, (str, torch.dtype)) or text not in allowed):
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    try:
        return BitsAndBytesConfig(**values)
    except (TypeError, ValueError, AttributeError) as err:  # transformers' own checks name the field, or nothing
        raise ValueError(f"BitsAndBytesConfig({', '.join(f'{k}={v!r}' for k, v in values.items())}) is refused: "
                         f"{err}") from None


# The dtypes bitsandbytes' 4-bit layers compute in and store their packed weights in
_BNB_DTYPES = {"bnb_4bit_compute_dtype": ("float32", "float16", "bfloat16"),
               "bnb_4bit_quant_storage": ("uint8", "float16", "bfloat16", "float32")}


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


# -- transformers' optim names ----------------------------------------------------------------------------
# transformers' `optim` names -> this project's optimizer names (`optimizers.OPTIMIZERS`), for the Recipe.
# The trace builds what the Trainer builds, so this table is only the Recipe's vocabulary.
OPTIM_TO_RECIPE = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_npu_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_apex_fused": "adamw",
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
    "paged_adamw": "adamw",
    "paged_adamw_32bit": "adamw",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "lion_8bit": "lion8bit",
    "paged_lion_8bit": "lion8bit",
    "lion_32bit": "lion",
    "paged_lion_32bit": "lion",
    "galore_adamw_8bit": "galore_adamw8bit",
    "galore_adamw": "galore_adamw",
    "apollo_adamw": "apollo",
    "lomo": "lomo",
    "adalomo": "adalomo",
}

# The optimizers the trace can build and step on fake tensors: every `OptimizerNames` value not listed
# here is refused by name (`check_optim`).
TRACEABLE_OPTIMS = (
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop",
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "paged_adamw_32bit",
    "adamw_anyprecision", "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "ademamix", "ademamix_8bit", "paged_ademamix_8bit",
    "paged_ademamix_32bit",
)
_BNB_OPTIMS = tuple(o for o in TRACEABLE_OPTIMS if "8bit" in o or "32bit" in o or o in ("paged_adamw", "ademamix", "rmsprop_bnb"))


def check_optim(optim: Any) -> str:
    """Return `optim` as a string if the plan can trace it; else raise ValueError naming it and what is allowed."""
    from transformers.training_args import OptimizerNames

    value = optim.value if isinstance(optim, OptimizerNames) else str(optim)
    known = [o.value for o in OptimizerNames]
    if value not in known:
        raise ValueError(f"optim={value!r} is not a transformers OptimizerNames value; known: {known}")
    if value not in TRACEABLE_OPTIMS:
        raise ValueError(f"optim={value!r} cannot be planned here (it needs a GPU-only build, a process group or an "
                         f"optimizer that steps inside backward); planned optims: {list(TRACEABLE_OPTIMS)}")
    return value


# -- the Recipe a Trainer's settings amount to ---------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _installed_checkpoint_keywords(given: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Return the keywords the installed transformers hands torch's checkpoint for these settings' kwargs, as a
    Trainer enables it (the kwargs without `every_n_layers` and `offload`, or None when nothing is left)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=8)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    kwargs = dict(given) or None
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    func = getattr(model.model.layers[0], "_gradient_checkpointing_func", None)
    return dict(getattr(func, "keywords", None) or {})


def checkpoint_use_reentrant(kwargs: dict[str, Any] | None) -> tuple[bool, str]:
    """Return (whether a Trainer with these `gradient_checkpointing_kwargs` checkpoints with use_reentrant=True, why).

    Read from the installed transformers, not from its version: it enables checkpointing on a one-layer model as the
    Trainer does and reads what it passes to `torch.utils.checkpoint.checkpoint`, which takes a missing
    `use_reentrant` as True. transformers 5 passes False when the Trainer gives no kwargs; 4.x passed True.
    """
    import transformers

    given = {k: v for k, v in (kwargs or {}).items() if k not in ("every_n_layers", "offload")}
    if "use_reentrant" in given:
        return bool(given["use_reentrant"]), "as you set it"
    keywords = _installed_checkpoint_keywords(tuple(sorted(given.items(), key=lambda kv: kv[0])))
    if "use_reentrant" in keywords:
        return bool(keywords["use_reentrant"]), f"transformers {transformers.__version__}'s default"
    return True, "torch's default"


def learning_rate(value: Any) -> float:
    """Return the `learning_rate` setting as a float if it is a finite number > 0; else raise ValueError naming it."""
    import math

    if isinstance(value, str):  # a YAML or a script may give '2e-4'; TRL's parser converts such strings
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"learning_rate must be a number such as 2e-4, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"learning_rate must be a finite number > 0 such as 2e-4, got {value!r}")
    return float(value)


def packed_rows_note(setting: str) -> str:
    """Return the plan's one line for packed or padding-free rows (`setting`: 'packing=True', 'padding_free=True')."""
    return f"{setting}: planned as full rows of max_length (the same tokens); the packed row's attention is not traced"


def check_tokens(seq_len: Any, batch: Any, host_bytes: int, *, seq_name: str = "max_length",
                 target_name: str = "the target") -> None:
    """Refuse a micro-batch whose token ids alone (int64, as the Trainer's collator builds them in host RAM before
    the step) take more than the target's `host_bytes`: no run of it can start. Names the setting `seq_name`."""
    from colab_memopt.core.measure import format_bytes

    whole_setting(seq_name, seq_len)
    whole_setting("per_device_train_batch_size", batch)
    if 8 * seq_len * batch > host_bytes:
        raise ValueError(f"{seq_name}={seq_len:,} at per_device_train_batch_size={batch}: the micro-batch's token ids "
                         f"alone (int64, 8 bytes each) outgrow {target_name}'s {format_bytes(host_bytes)} of host RAM, "
                         f"so no run of it can start; at most {host_bytes // (8 * batch):,} tokens")


def check_micro_batch(batch: int, seq_len: int, hidden: Any, device_bytes: int, *, seq_name: str = "max_length",
                      target_name: str = "the target") -> None:
    """Refuse a micro-batch whose first two hidden states alone are more than the target's whole device memory: the
    embedding's output and the first block's normalized copy of it (a decoder normalizes before each block, and both
    are alive while it runs, whatever is checkpointed or offloaded), each batch x seq_len x hidden values of 2 bytes at
    the least (16-bit). No step of it can run, and tracing it would first build, map and collate rows of that many
    tokens (minutes at tens of millions). `hidden` None (unknown) refuses nothing."""
    from colab_memopt.core.measure import format_bytes

    if not isinstance(hidden, int) or hidden < 1:
        return
    need = 2 * 2 * batch * seq_len * hidden
    if need > device_bytes:
        most_rows = device_bytes // (4 * seq_len * hidden)
        most_tokens = device_bytes // (4 * batch * hidden)
        raise ValueError(f"per_device_train_batch_size={batch:,} at {seq_name}={seq_len:,}: the embedding's output and "
                         f"the first block's normalized copy of it alone (2 x {batch:,} x {seq_len:,} x {hidden:,} "
                         f"values, 2 bytes each at the least) need {format_bytes(need)}, more than {target_name}'s "
                         f"{format_bytes(device_bytes)} of device memory, so no step of it can run; "
                         + (f"per_device_train_batch_size={most_rows:,} at most at this length, or " if most_rows else "")
                         + f"{seq_name}={most_tokens:,} at most at this batch")


def whole_setting(name: str, value: Any) -> int:
    """Return a Trainer setting that counts something (steps, sequences) if it is an int >= 1; else raise naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value



def trainer_recipe(args: Any, lora: Any = None, bnb: Any = None) -> tuple[Recipe, list[str]]:
    """Return (the `Recipe` closest to these Trainer / peft / bitsandbytes settings, what it cannot say).

    The second item names every setting the Recipe has no field for (the trace of `plan_trainer`
    still runs it): nothing is dropped silently.
    """
    from colab_memopt.techniques.optimizers import OPTIMIZERS

    notes: list[str] = []
    optim = str(getattr(args.optim, "value", args.optim))
    fields: dict[str, Any] = {"lr": learning_rate(args.learning_rate),
                              "accumulation_steps": whole_setting("gradient_accumulation_steps", args.gradient_accumulation_steps)}
    name = OPTIM_TO_RECIPE.get(optim)
    if name in OPTIMIZERS:
        fields["optimizer"] = name
        if optim == "adamw_torch_fused":
            notes.append("optim='adamw_torch_fused': planned with the fused AdamW kernel (no foreach temporaries)")
        if optim.startswith("paged_"):
            notes.append(f"optim={optim!r}: paged state (bitsandbytes pages it to host RAM under pressure on CUDA)")
    else:
        notes.append(f"optim={optim!r}: planned as the Trainer builds it (no step-time figure for it)")
    if args.fp16:
        fields["precision"] = "fp16-autocast"
    elif args.bf16:
        fields["precision"] = "bf16-autocast"
    if args.gradient_checkpointing:
        fields["checkpointing"] = "full"
        kwargs = args.gradient_checkpointing_kwargs or {}
        reentrant, source = checkpoint_use_reentrant(kwargs)
        if reentrant:
            notes.append(f"use_reentrant=True ({source}): set {checkpointing_names()[1]}={{'use_reentrant': False}}")
        other = sorted(set(kwargs) - {"use_reentrant", "every_n_layers", "offload"})
        if other:
            notes.append(f"{checkpointing_names()[1]} {other}: planned as set")
    if getattr(args, "torch_compile", False):
        notes.append("torch_compile=True: the plan cannot model compiled kernels: it plans the eager step (compiled ones can hold less)")
    if getattr(args, "use_liger_kernel", False):
        notes.append("use_liger_kernel=True: the plan cannot model Liger's kernels: it plans transformers' layers (they hold more)")
    if getattr(args, "label_smoothing_factor", 0):
        notes.append(f"label_smoothing_factor={args.label_smoothing_factor}: the full logits are built (traced)")
    if getattr(args, "packing", False):
        notes.append(packed_rows_note("packing=True"))
    if lora is not None and not (hasattr(lora, "r") and hasattr(lora, "lora_dropout")):
        kind = str(getattr(getattr(lora, "peft_type", None), "value", "") or type(lora).__name__)
        notes.append(f"peft {kind} ({type(lora).__name__}): planned as peft builds it (no step-time figure for it)")
        lora = None
    if lora is not None:
        fields["lora_rank"] = int(lora.r)
        targets = lora.target_modules
        if isinstance(targets, str):
            notes.append(f"lora target_modules={targets!r}: planned on the modules peft picks for it")
        elif targets:
            fields["lora_targets"] = tuple(sorted(targets))
        if lora.lora_dropout:
            notes.append(f"lora_dropout={lora.lora_dropout}: each adapted layer keeps a dropped copy of its input and the "
                         "mask (planned)")
        if lora.bias != "none":
            notes.append(f"lora bias={lora.bias!r}: trains biases too (planned)")
        if lora.modules_to_save:
            notes.append(f"lora modules_to_save={list(lora.modules_to_save)}: full trainable copies (planned)")
        if getattr(lora, "use_dora", False):
            notes.append("use_dora=True: DoRA's magnitude vectors and weight norms (planned; step time counted as plain LoRA's)")
        if getattr(lora, "layers_to_transform", None) is not None:
            notes.append(f"layers_to_transform={lora.layers_to_transform!r}: adapters on those layers only (planned; "
                         "step time counted as on every layer)")
        for name in ("rank_pattern", "alpha_pattern"):
            if getattr(lora, name, None):
                notes.append(f"{name}={getattr(lora, name)!r}: per-layer ranks (planned)")
    if bnb is not None:
        if getattr(bnb, "load_in_4bit", False):
            fields["quantization"] = str(bnb.bnb_4bit_quant_type)
            if bnb.bnb_4bit_use_double_quant:
                notes.append("bnb_4bit_use_double_quant=True: the absmax scales quantized again (planned as set)")
            notes.append(f"bnb_4bit_compute_dtype={bnb.bnb_4bit_compute_dtype}: planned as set")
        elif getattr(bnb, "load_in_8bit", False):
            fields["quantization"] = "bnb_int8"
        if getattr(bnb, "llm_int8_skip_modules", None):
            notes.append(f"llm_int8_skip_modules={list(bnb.llm_int8_skip_modules)}: kept in 16 bits (planned)")
    try:
        return Recipe.from_dict(fields), notes
    except ValueError as err:
        notes.append(f"these settings together have no step-time figure ({err}): planned as set; the step time counts "
                     "the precision and batch only")
        keep = {k: v for k, v in fields.items() if k in ("lr", "accumulation_steps", "precision", "checkpointing")}
        return Recipe.from_dict(keep), notes


# -- a Recipe as Trainer settings ------------------------------------------------------------------------
_RECIPE_TO_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_8bit", "paged_adamw8bit": "paged_adamw_8bit",
                    "adafactor": "adafactor", "sgd": "sgd", "lion8bit": "lion_8bit", "lion": "lion_32bit",
                    "galore_adamw8bit": "galore_adamw_8bit", "galore_adamw": "galore_adamw", "apollo": "apollo_adamw",
                    "lomo": "lomo", "adalomo": "adalomo"}


@functools.lru_cache(maxsize=None)
def checkpointing_names() -> tuple[str, str]:
    """Return the names the installed transformers' TrainingArguments gives checkpointing and its keyword arguments.

    transformers 5.2x renamed `gradient_checkpointing` / `gradient_checkpointing_kwargs` to `activation_checkpointing`
    / `activation_checkpointing_kwargs` and keeps the old names as deprecated aliases (a FutureWarning, gone in v6);
    older versions, as on Colab, know only the old ones. Read from its fields, not its version.
    """
    try:
        from transformers import TrainingArguments
    except ImportError:
        return ("gradient_checkpointing", "gradient_checkpointing_kwargs")
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return ("activation_checkpointing", "activation_checkpointing_kwargs")
    return ("gradient_checkpointing", "gradient_checkpointing_kwargs")


@functools.lru_cache(maxsize=None)
def trainer_checkpointing_keys() -> frozenset[str]:
    """Return the `gradient_checkpointing_kwargs` keys the installed transformers' Trainer takes for itself.

    Read from its code, not its version: 'every_n_layers' (checkpoint every n-th decoder layer) and 'offload' (the
    checkpoints in host memory) count where the model's checkpointing method takes the argument and the Trainer
    reads the key. Older Trainers hand every key to `torch.utils.checkpoint`, which refuses both: empty there.
    """
    import inspect

    from colab_memopt.core.console import quiet

    try:
        with quiet():  # the Trainer's module imports torchao and DeepSpeed, whose notes say nothing here
            from transformers import PreTrainedModel
            from transformers import trainer as trainer_module
    except ImportError:
        return frozenset()
    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None) or PreTrainedModel.gradient_checkpointing_enable
    try:
        parameters = inspect.signature(enable).parameters
        source = inspect.getsource(trainer_module)
    except (OSError, TypeError, ValueError):  # no source shipped: say only what every Trainer takes
        return frozenset()
    return frozenset(key for key in ("every_n_layers", "offload") if key in parameters and f'"{key}"' in source)


def _checkpointing_kwargs(rec: Recipe) -> tuple[dict[str, Any], str | None]:
    """Return a checkpointing recipe's `gradient_checkpointing_kwargs` and, where the Trainer cannot say it, the note.

    transformers' `every_n_layers` checkpoints layers 0, n, 2n, ...: at least as many as the recipe's every n-th,
    so the run holds at most the planned activations.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    keys = trainer_checkpointing_keys()
    interval, policy = rec.checkpoint_interval, rec.checkpointing
    if policy == "full":
        return kwargs, None
    if policy == "every_n" and "every_n_layers" in keys:
        return {**kwargs, "every_n_layers": interval}, None
    if policy == "offload" and "offload" in keys and not rec.offload_keep_blocks:
        return {**kwargs, "offload": True}, None
    planned = f"checkpointing={policy!r}" + (f", checkpoint_interval={interval}" if policy in ("every_n", "segments") else "")
    why = {"every_n": "this transformers' Trainer checkpoints every layer or none",
           "selective": "the Trainer recomputes whole layers, not parts of them",
           "segments": "the Trainer checkpoints layers, not segments of them",
           "offload": ("this transformers' Trainer keeps its checkpoints on the GPU" if "offload" not in keys
                       else "the Trainer offloads every layer's checkpoint or none")}[policy]
    every_layer = f"{checkpointing_names()[0]}=True checkpoints every layer"
    if policy in ("every_n", "selective"):  # every layer checkpointed whole: less memory than planned
        return kwargs, f"{planned} ({why}: {every_layer}: slower, less memory)"
    return kwargs, f"{planned} ({why}: {every_layer}: can hold more than planned)"


def recipe_settings(recipe: Recipe | dict[str, Any], batch: int, seq_len: int) -> dict[str, Any]:
    """Return a `Recipe` (at an effective `batch` of `seq_len` tokens) as Hugging Face settings.

    {'training_args': SFTConfig / TrainingArguments fields, 'lora': LoraConfig fields or None,
    'bnb': BitsAndBytesConfig fields or None, 'not_expressible': the recipe fields they cannot say, 'install': the
    pip lines for the packages the recipe's optimizer needs (BAdam, GaLore, APOLLO, torchao, LOMO), else []}.
    A recipe that checkpoints always gets `gradient_checkpointing=True` (or `activation_checkpointing=True`: the
    installed transformers' name, `checkpointing_names`): every n-th layer and offloaded checkpoints go in its
    keyword arguments where the installed Trainer takes them
    (`trainer_checkpointing_keys`); otherwise the note says what checkpointing every layer changes.
    """
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe))
    whole_setting("batch", batch)
    whole_setting("seq_len", seq_len)
    missing: list[str] = []
    # The Trainer's micro-batches are equal, the recipe's may not be (batch 3 in 2 steps: 2 + 1). Keep the
    # effective batch exactly: the fewest equal micro-batches, at least the recipe's count, that make `batch`;
    # each is then no larger than the recipe's largest micro-batch, where its plan's peak is.
    accumulation = next(n for n in range(min(rec.accumulation_steps, batch), batch + 1) if batch % n == 0)
    micro = batch // accumulation
    args: dict[str, Any] = {"per_device_train_batch_size": micro,
                            "gradient_accumulation_steps": accumulation, "max_length": seq_len, "learning_rate": rec.lr}
    if accumulation != rec.accumulation_steps:
        largest = -(-batch // rec.accumulation_steps)
        missing.append(f"accumulation_steps={rec.accumulation_steps} at batch {batch}: gradient_accumulation_steps="
                       f"{accumulation} of {micro} keeps the batch of {batch} (the Trainer's micro-batches are equal; "
                       f"the recipe's largest was {largest}, so each step holds no more)")
    install: list[str] = []
    package = optimizer_package(rec.optimizer)
    if package is not None:
        install.append(f"pip install {package}")
    if rec.optimizer in _RECIPE_TO_OPTIM:
        args["optim"] = _RECIPE_TO_OPTIM[rec.optimizer]
    else:
        missing.append(f"optimizer={rec.optimizer!r}: no Trainer optim; build it and pass it to the trainer: "
                       f"opt = cm.make_optimizer({rec.optimizer!r}, model.parameters(), lr=args.learning_rate, "
                       "model=model) for args = SFTConfig(...) above; SFTTrainer(..., optimizers=(opt, None))")
    if rec.optimizer_rank is not None:
        missing.append(f"optimizer_rank={rec.optimizer_rank} (the Trainer sets GaLore's / APOLLO's rank through "
                       f"optim_args, e.g. optim_args='rank={rec.optimizer_rank}')")
    if rec.precision == "fp16-autocast":
        args["fp16"] = True
    elif rec.precision == "bf16-autocast":
        args["bf16"] = True
    elif rec.precision in ("bf16", "fp16"):
        args["model_init_kwargs"] = {"dtype": "bfloat16" if rec.precision == "bf16" else "float16"}
        missing.append(f"precision={rec.precision!r}: the Trainer trains the weights in that dtype with no update rounding")
    if rec.weight_dtype is not None:
        missing.append(f"weight_dtype={rec.weight_dtype!r} (the Trainer trains the weights in the dtype they load in; "
                       "no 8-bit trainable weights)")
    if rec.base_dtype is not None:
        args["model_init_kwargs"] = {"dtype": "float16" if rec.base_dtype == "fp16" else "bfloat16"}
    if rec.checkpointing != "none":
        kwargs, note = _checkpointing_kwargs(rec)
        on, kwargs_name = checkpointing_names()
        args.update({on: True, kwargs_name: kwargs})
        if note:
            missing.append(note)
    lora = None
    if rec.lora_rank:
        lora = {"r": rec.lora_rank, "lora_alpha": 2 * rec.lora_rank, "lora_dropout": 0.0,
                "target_modules": list(rec.lora_targets), "task_type": "CAUSAL_LM"}
    bnb = None
    if rec.quantization in ("nf4", "fp4") and rec.quantization_phase == "all":
        bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": rec.quantization,
               "bnb_4bit_compute_dtype": "bfloat16" if rec.precision == "bf16-autocast" else "float16"}
    elif rec.quantization == "bnb_int8" and rec.quantization_phase == "all":
        bnb = {"load_in_8bit": True}
    elif rec.quantization is not None:
        missing.append(f"quantization={rec.quantization!r} ({rec.quantization_phase})")
    if rec.loss_chunk_tokens is not None:
        missing.append(f"loss_chunk_tokens={rec.loss_chunk_tokens} (TRL's SFTTrainer computes the loss by tiles itself)")
    if rec.mlp_tile_tokens is not None:
        missing.append(f"mlp_tile_tokens={rec.mlp_tile_tokens} (the Trainer runs each MLP on all tokens at once)")
    # Every other field set away from its default is named as it is: none is dropped without a word.
    said = {"accumulation_steps", "lr", "optimizer", "optimizer_rank", "precision", "weight_dtype", "base_dtype",
            "checkpointing", "lora_rank", "lora_targets", "quantization", "quantization_phase", "loss_chunk_tokens",
            "mlp_tile_tokens"} | ({"checkpoint_interval"} if rec.checkpointing in ("every_n", "segments") else set())
    for name, value in rec.changed().items():
        if name not in said:
            missing.append(f"{name}={value!r}")
    return {"training_args": args, "lora": lora, "bnb": bnb, "not_expressible": missing, "install": install}


# The optimizers a recipe may name whose code is in a package of their own (name prefix -> pip name): neither torch,
# transformers nor bitsandbytes has them. transformers' optim='galore_adamw...', 'apollo_adamw', 'lomo' and 'adalomo'
# import the same packages.
_OPTIMIZER_PACKAGES = {"badam": "badam", "galore": "galore-torch", "apollo": "apollo-torch", "torchao": "torchao",
                       "lomo": "lomo-optim", "adalomo": "lomo-optim"}


def optimizer_package(optimizer: str) -> str | None:
    """Return the pip name of the package a recipe's optimizer needs beyond torch, transformers and bitsandbytes
    ('badam' -> 'badam', 'galore_adamw8bit' -> 'galore-torch'), or None where it needs none."""
    base = optimizer.removesuffix("_in_backward")
    for prefix, pip_name in _OPTIMIZER_PACKAGES.items():
        if base == prefix or base.startswith(prefix + "_"):
            return pip_name
    return None



def save_example_chat_model(family: str, folder: str | Any, *, max_shard_size: str | int = "2GB") -> str:
    """Save a small random causal LM of a transformers family with a character tokenizer and a chat template
    to `folder`, for CI and tests, which have no hub access; return the folder. Its generations are noise.
    `max_shard_size`: as `save_pretrained`'s (a small one gives a checkpoint in several shards, as real ones are)."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from colab_memopt.techniques import architectures

    from colab_memopt.training.saving import save_random_model

    folder = Path(folder)
    # A token for every id of the model's 128: ids 3-31 as the Latin-1 characters À to Ü, so no id decodes to nothing
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(0xC0 + i - 3): i for i in range(3, 32)},
             **{chr(i): i for i in range(32, 127)}, "\n": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    from colab_memopt.core.fileio import replace_files

    save_random_model(architectures.small_config(family, vocab_size=128, eos_token_id=1, bos_token_id=1), folder,
                      max_shard_size=max_shard_size)
    replace_files(folder, lambda tmp: tokenizer.save_pretrained(tmp))  # each file whole, the model's files kept
    return str(folder)
