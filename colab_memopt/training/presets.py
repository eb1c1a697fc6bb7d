"""Presets named by what they do: selective-ckpt, ckpt-every-8, ckpt-every-4, ckpt-every-2-paged, and the
training modes (full, LoRA, QLoRA).

The presets are this project's defaults, a ladder of common memory-saving stacks. Every one trains in
mixed precision with 8-bit optimizer state; the name says how much is checkpointed:

- 'selective-ckpt': every block checkpointed selectively (the matmul and attention outputs are kept,
  only the cheap elementwise ops are recomputed: the least recompute). It checkpoints *every* block, so
  at long sequences it can fit a larger model than the interval presets.
- 'ckpt-every-8', 'ckpt-every-4': one block in 8 (or 4) checkpointed whole (`checkpointing='every_n'`);
  the other blocks keep all their activations. A smaller N saves more and recomputes more.
- 'ckpt-every-2-paged': one block in 2, and the 8-bit optimizer state paged (bitsandbytes
  PagedAdamW8bit, which moves to host RAM under pressure on CUDA).

The ladder follows the "Optimization Stack Combinations" of a public memory optimization guide
(`Preset.document` keeps its fuller stack). They map onto the Recipe fields that exist:

- quantization: 8-bit quantization becomes 8-bit optimizer state (bitsandbytes
  AdamW8bit) for full fine-tuning; the weights are quantized only in QLoRA mode (nf4), because a
  quantized weight is frozen.
- precision: mixed precision everywhere: fp16 autocast + GradScaler on a T4 (sm_75 has no native
  bf16), bf16 autocast on targets that have it; in LoRA and QLoRA modes the frozen base is stored in
  that 16-bit dtype too (`Recipe.base_dtype`), the adapters in fp32.
- offload (CPU offloading: `Recipe.layer_offload_active`, `offload_optimizer`, `checkpointing='offload'`):
  no preset turns it on, because every step then waits on host-device copies; the recommender adds
  offloaded checkpoints only when nothing else fits (its long-context round), and notebooks 09, 10 and
  17 measure it.

A preset is a starting point, combinable with explicit overrides: `Recipe.preset('ckpt-every-8',
accumulation_steps=4)`. Each preset's expected cost is the product of its techniques' measured
step-time ratios (`costs.expected_slowdown`), never a typed-in figure.

The old names (conservative, balanced, aggressive, maximum) still work in this release, with a warning
that names the new one (`RENAMED`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

# Targets with native bf16 (Ampere and later); everything else gets fp16 autocast.
BF16_TARGETS = ("l4", "a100-40gb", "a100-80gb", "h100-80gb")
TARGET_NAMES = ("t4", *BF16_TARGETS)  # the names of targets.TARGETS (a test keeps them equal)


@dataclass(frozen=True)
class Preset:
    """A named set of Recipe fields, what it turns on, and when to use it (this project's defaults).

    `document` is the fuller stack the preset stands for (checkpointing, CPU offloading of layers,
    quantization), including what the Recipe fields do not turn on.
    """

    name: str
    fields: dict[str, Any]
    turns_on: str
    use_for: str
    document: dict[str, str] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "selective-ckpt",
            dict(checkpointing="selective", optimizer="adamw8bit"),
            "mixed precision, selective checkpointing, 8-bit optimizer state",
            "models that almost fit",
            {"checkpointing": "enabled", "cpu_offloading": "disabled", "quantization": "enabled"},
        ),
        Preset(
            "ckpt-every-8",
            dict(checkpointing="every_n", checkpoint_interval=8, optimizer="adamw8bit"),
            "mixed precision, every 8th block checkpointed, 8-bit optimizer state",
            "1B models on 16 GB GPUs",
            {"checkpointing": "interval=8", "cpu_offloading": "max_active_layers=4", "quantization": "enabled"},
        ),
        Preset(
            "ckpt-every-4",
            dict(checkpointing="every_n", checkpoint_interval=4, optimizer="adamw8bit"),
            "mixed precision, every 4th block checkpointed, 8-bit optimizer state",
            "7B models on 24 GB GPUs",
            {"checkpointing": "interval=4", "cpu_offloading": "max_active_layers=1-2", "quantization": "enabled"},
        ),
        Preset(
            "ckpt-every-2-paged",
            dict(checkpointing="every_n", checkpoint_interval=2, optimizer="paged_adamw8bit"),
            "mixed precision, every 2nd block checkpointed, paged 8-bit optimizer state",
            "the largest models, very slow but feasible",
            {"checkpointing": "interval=2", "cpu_offloading": "max_active_layers=1", "quantization": "enabled"},
        ),
    ]
}

# The names before this release, kept for one release: each still works, with a warning naming the new name.
RENAMED: dict[str, str] = {
    "conservative": "selective-ckpt",
    "balanced": "ckpt-every-8",
    "aggressive": "ckpt-every-4",
    "maximum": "ckpt-every-2-paged",
}


def preset_name(name: str) -> str:
    """Return the preset's current name: an old name (`RENAMED`) warns once per call and maps to its new one."""
    if name in RENAMED:
        warnings.warn(f"preset {name!r} is now called {RENAMED[name]!r}; the old name goes in the next release",
                      FutureWarning, stacklevel=3)
        return RENAMED[name]
    return name

# Training modes: what is trained. QLoRA quantizes the frozen base to nf4; LoRA keeps it as it is (a preset
# stores it in its autocast dtype: `preset_fields`).
MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": dict(lora_rank=16),
    "qlora": dict(lora_rank=16, quantization="nf4"),
}


# LoRA adapters go on these Linear layers per architecture family (transformers' module names); the
# reference model's are `quantization.DEFAULT_LORA_TARGETS`.
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS_BY_FAMILY: dict[str, tuple[str, ...]] = {
    **{family: _LLAMA_LIKE for family in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2")},
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    # GPT-2's layers are transformers' Conv1D (a transposed Linear): attention's c_attn and c_proj, the MLP's c_fc and
    # c_proj. peft adapts them with fan_in_fan_out (its own default mapping names only c_attn).
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


def with_family_lora_targets(recipe: Any, family: str | None) -> Any:
    """Return `recipe` with the family's LoRA targets where it keeps the reference model's defaults (as `load_model`)."""
    from colab_memopt.techniques.quantization import DEFAULT_LORA_TARGETS

    if recipe.lora_rank and recipe.lora_targets == DEFAULT_LORA_TARGETS and family in LORA_TARGETS_BY_FAMILY:
        return recipe.with_(lora_targets=LORA_TARGETS_BY_FAMILY[family])
    return recipe


def preset_names() -> list[str]:
    """Return the preset names, from selective checkpointing of every block to one block in 2 (the ladder's order)."""
    return list(PRESETS)


def mixed_precision(target: Any = "t4") -> str:
    """Return the autocast precision for a target: 'fp16-autocast' on a T4 (no native bf16), else bf16."""
    name = getattr(target, "name", target) if not isinstance(target, dict) else target.get("name")
    return "bf16-autocast" if name in BF16_TARGETS else "fp16-autocast"


def mode_fields(mode: str, model: str | None = None) -> dict[str, Any]:
    """Return the Recipe fields of a training mode ('full', 'lora' or 'qlora'), for a named model's family."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
    if model is not None:
        from colab_memopt.techniques.architectures import model_names, resolve_model

        if model not in model_names():
            try:  # a Hugging Face id, a folder or config.json: architectures beyond our named models
                resolve_model(model)
            except ValueError:
                raise ValueError(f"unknown model {model!r}; choose one of {model_names()}, a Hugging Face id, a folder "
                                 "or a config.json (or None: the reference model)") from None
    values = dict(MODES[mode])
    if values.get("lora_rank") and model is not None:
        from colab_memopt.techniques.architectures import family_of

        family = family_of(model)  # our names, and ids, folders and configs already resolved
        if family in LORA_TARGETS_BY_FAMILY:
            values["lora_targets"] = LORA_TARGETS_BY_FAMILY[family]
        elif family is not None:
            raise ValueError(f"no LoRA targets known for {model!r} (family {family!r}); "
                             f"families with targets: {list(LORA_TARGETS_BY_FAMILY)}")
    return values


def preset_fields(name: str, *, target: Any = "t4", mode: str = "full", model: str | None = None,
                  **overrides: Any) -> dict[str, Any]:
    """Return the Recipe fields of a preset for a target, mode and model, with explicit overrides applied last."""
    name = preset_name(name)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {preset_names()}")
    if isinstance(target, str) and target not in TARGET_NAMES:  # named, not taken for a T4
        raise ValueError(f"unknown target {target!r}; choose one of {sorted(TARGET_NAMES)} or give a Target")
    values: dict[str, Any] = {"precision": mixed_precision(target), **PRESETS[name].fields, **mode_fields(mode, model)}
    values = {**values, **overrides}
    # LoRA's frozen base in the autocast dtype (fp16 on a T4, bf16 where native): half the bytes of fp32 for
    # weights that never update; the adapters stay fp32
    base = {"fp16-autocast": "fp16", "bf16-autocast": "bf16"}.get(values.get("precision"))
    if values.get("lora_rank") and base is not None and "base_dtype" not in overrides:
        values["base_dtype"] = base
    return values
