"""The recipes `recommend` chooses from: one option per technique axis, and the lean recipes it tries after them.

`candidate_recipes` is the product of `CANDIDATE_AXES` (precision, optimizer, checkpointing), the training mode's
fields and the accumulation steps that divide the batch; on a CUDA target the precision is the target's autocast
(`precision_options`), and LoRA's frozen base is kept in that 16-bit dtype (`BASE_FOR_PRECISION`). When none of
those fits: full fine-tuning's lean recipes (`FULL_CANDIDATES`: optimizers with almost no state, 16-bit weights
without a master copy; then `INT8_CANDIDATES`, 8-bit weights), the long-context axes (offloaded checkpoints, the
chunked loss) and the longest-context round's recipe (`long_context_recipe`, notebook 17).

A new Recipe field (e.g. offload) plugs in with one axis in `CANDIDATE_AXES` and one entry per value
in `costs.TECHNIQUES`.
"""

from __future__ import annotations

from itertools import product
from typing import Any

from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS
from colab_memopt.planning.targets import Target, get_target
from colab_memopt.training.presets import mixed_precision, mode_fields
from colab_memopt.training.recipe import Recipe


MIXED = "<mixed>"  # replaced by the target's autocast precision (fp16 on a T4, bf16 where native)
# One axis per technique family; a candidate takes one option from each axis.
CANDIDATE_AXES: dict[str, list[dict[str, Any]]] = {
    "precision": [dict(precision="fp32"), dict(precision=MIXED)],
    "optimizer": [dict(optimizer="adamw"), dict(optimizer="adamw8bit"), dict(optimizer="paged_adamw8bit")],
    "checkpointing": [
        dict(checkpointing="none"),
        dict(checkpointing="selective"),
        dict(checkpointing="every_n", checkpoint_interval=8),
        dict(checkpointing="every_n", checkpoint_interval=4),
        dict(checkpointing="every_n", checkpoint_interval=2),
        dict(checkpointing="full"),
    ],
}
# Long context (notebook 17): considered when none of the recipes above passes the screen. Checkpoints
# in host RAM ('offload'; their host bytes count against the target's host RAM) and the loss by chunks
# of tokens (never the tokens x vocab logits); each candidate of this round uses at least one of them.
LONG_CONTEXT_AXES: dict[str, list[dict[str, Any]]] = {
    "checkpointing": [*CANDIDATE_AXES["checkpointing"], dict(checkpointing="offload")],
    "loss": [dict(loss_chunk_tokens=None), dict(loss_chunk_tokens=DEFAULT_CHUNK_TOKENS)],
}
ACCUMULATION_STEPS = (1, 2, 4)


def precision_options(target: Any = "t4", half_precision: bool = True) -> list[str]:
    """Return the precisions candidates may take on a target.

    On a CUDA target: its autocast precision only (fp16 + GradScaler on a T4, bf16 where native): an
    expert never trains in fp32 there, it is slower and holds 4-byte activations. `half_precision=False`
    (the user forbids 16-bit compute): fp32 only. On a CPU target both, ranked by the CPU's measured costs.
    """
    if not isinstance(half_precision, bool):
        raise ValueError(f"half_precision must be True or False, got {half_precision!r}")
    if not half_precision:
        return ["fp32"]
    mixed = mixed_precision(target)
    tgt = target if isinstance(target, Target) else get_target(target) if isinstance(target, (str, dict)) else None
    return [mixed] if tgt is None or tgt.cuda else ["fp32", mixed]


BASE_FOR_PRECISION = {"fp16-autocast": "fp16", "bf16-autocast": "bf16"}  # LoRA's frozen base per autocast precision


def _half_base(values: dict[str, Any]) -> dict[str, Any]:
    """Keep LoRA's frozen base in the candidate's 16-bit autocast dtype (half the bytes); fp32 compute keeps it fp32."""
    if values.get("lora_rank") and values.get("precision") in BASE_FOR_PRECISION:
        return {**values, "base_dtype": BASE_FOR_PRECISION[values["precision"]]}
    return values


def candidate_recipes(batch: int, *, target: Any = "t4", mode: str = "full", model: str | None = None,
                      half_precision: bool = True, long_context: bool = False) -> list[Recipe]:
    """Return every candidate recipe: one option per axis, the mode's fields, accumulation dividing the batch.

    With `long_context`, the recipes of `LONG_CONTEXT_AXES` that use offloaded checkpoints or the
    chunked loss (the ones the plain axes do not hold), which `recommend` considers when no plain
    candidate passes the screen. The precision axis is the target's (`precision_options`); LoRA and QLoRA candidates in 16-bit
    autocast keep their frozen base in that dtype (`Recipe.base_dtype`).
    """
    allowed = precision_options(target, half_precision)
    extra = mode_fields(mode, model)
    out = []
    axes = {**CANDIDATE_AXES, **LONG_CONTEXT_AXES} if long_context else CANDIDATE_AXES
    for options in product(*axes.values()):
        values: dict[str, Any] = {}
        for opt in options:
            values.update({k: (mixed_precision(target) if v == MIXED else v) for k, v in opt.items()})
        if values.get("precision") not in allowed:
            continue
        values = _half_base({**values, **extra})
        for acc in ACCUMULATION_STEPS:
            if long_context and values.get("checkpointing") != "offload" and values.get("loss_chunk_tokens") is None:
                continue  # a plain candidate: the first round has it
            if acc <= batch and batch % acc == 0:
                out.append(Recipe.from_dict({**values, "accumulation_steps": acc}))
    return list(dict.fromkeys(out))


# Full fine-tuning recipes beyond `recommend`'s candidates (optimizers with almost no state, 16-bit weights
# without a master copy; notebook 16): one line each, by name. Each is crossed with every precision and
# checkpointing option of `CANDIDATE_AXES` that its recipe allows (`Recipe.validate` refuses the rest,
# e.g. an in-backward step under fp16's GradScaler).
FULL_CANDIDATES: dict[str, dict[str, Any]] = {
    "GaLore 8-bit per layer": {"optimizer": "galore_adamw8bit_in_backward"},
    "APOLLO": {"optimizer": "apollo"},
    "APOLLO-Mini": {"optimizer": "apollo_mini"},
    "torchao AdamW 8-bit": {"optimizer": "torchao_adamw8bit"},
    "torchao AdamW 4-bit": {"optimizer": "torchao_adamw4bit"},
    "BAdam": {"optimizer": "badam"},
    # 16-bit weights without a master copy (notebook 16): fp16 on a T4, bf16 where native (`PURE16`)
    "AdamW, 16-bit weights + Kahan": {"optimizer": "adamw", "precision": "<pure16>", "update_rounding": "kahan"},
    "LOMO, 16-bit weights": {"optimizer": "lomo", "precision": "<pure16>"},
    "AdaLomo, 16-bit weights": {"optimizer": "adalomo", "precision": "<pure16>"},
}
PURE16 = "<pure16>"  # replaced by 'fp16' on a target without native bf16 (a T4), else 'bf16'
# 8-bit trainable weights (`int8train`), offered for mode 'full' only when nothing with 16-bit weights
# fits. What they trade: each weight sits on an int8 grid (1.03 B/param with its scales) and moves by stochastic
# rounding, unbiased but noisy: benchmarks/results/optimizer_quality.json ('finetune') has the measured loss gap.
INT8_CANDIDATES: dict[str, dict[str, Any]] = {
    "AdaLomo, int8 weights": {"optimizer": "adalomo", "precision": PURE16, "weight_dtype": "int8",
                              "loss_chunk_tokens": DEFAULT_CHUNK_TOKENS},
    "LOMO, int8 weights": {"optimizer": "lomo", "precision": PURE16, "weight_dtype": "int8",
                           "loss_chunk_tokens": DEFAULT_CHUNK_TOKENS},
}
INT8_TRADE = ("8-bit weights trade precision for memory: every Linear and Embedding weight is int8 with fp32 scales "
              "(1.03 bytes per value instead of 2), updated inside backward with stochastic rounding (unbiased, but each "
              "update moves a weight by a whole grid step or not at all), by SGD (LOMO) or AdaLomo only: no momentum, no "
              "gradient accumulation, no clipping; see benchmarks/results/optimizer_quality.json ('finetune') for the "
              "measured loss gap to fp32 AdamW")


def full_candidates(*, target: Any = "t4", model: str | None = None,
                    extra: dict[str, dict[str, Any]] | None = None) -> list[tuple[str, Recipe]]:
    """Return (name, recipe) for each `FULL_CANDIDATES` entry (or `extra`) crossed with the precisions and
    checkpointing options of `CANDIDATE_AXES`, each a full fine-tuning recipe that validates."""
    tgt = get_target(target)
    mixed = mixed_precision(tgt)
    pure16 = "bf16" if mixed == "bf16-autocast" else "fp16"
    out = []
    for label, fields_ in (FULL_CANDIDATES if extra is None else extra).items():
        for prec, ckpt in product(CANDIDATE_AXES["precision"], CANDIDATE_AXES["checkpointing"]):
            values = {**{k: (mixed if v == MIXED else v) for k, v in prec.items()}, **ckpt, **mode_fields("full", model),
                      **{k: (pure16 if v == PURE16 else v) for k, v in fields_.items()}}
            try:
                recipe = Recipe.from_dict(values)
            except ValueError:  # a combination the recipe refuses
                continue
            if (label, recipe) not in out:  # a candidate's own precision makes the precision axis repeat it
                out.append((label, recipe))
    return out


LONG_CONTEXT_TILE_TOKENS = 4096  # the MLP's tile in the longest-context round (tokens)


def long_context_recipe(model: str | None, mode: str, target: Any = "t4") -> Recipe:
    """Return the longest-context round's recipe for a mode (notebook 17) on `target`.

    Every block checkpointed with its input in host RAM (`checkpointing='offload'`; `longest_sequence` splits
    the checkpoints between device and host where the host is short), the loss by chunks of 128 tokens, each
    MLP by tiles of `LONG_CONTEXT_TILE_TOKENS`; a Llama-style RMSNorm (Llama, Qwen2, Mistral, SmolLM) by tiles too,
    saving its 16-bit input and one scale per token (`norm_tile_tokens`); a grouped-query model on a target below
    sm_80 (a T4) with its keys and values repeated before SDPA (`attention='sdpa_repeated_kv'`), so the O(T)
    memory-efficient kernel runs, not math's T x T scores. LoRA and QLoRA: AdamW on the adapters, the frozen base in the
    target's 16-bit autocast dtype. Full fine-tuning: 8-bit AdamW stepping each parameter inside backward (no
    full set of gradients held), in fp32 on a T4 (an in-backward step cannot run under fp16's GradScaler),
    under bf16 autocast where bf16 is native.
    """
    tgt = get_target(target)
    precision = mixed_precision(tgt)
    fields: dict[str, Any] = dict(checkpointing="offload", loss_chunk_tokens=DEFAULT_CHUNK_TOKENS,
                                  mlp_tile_tokens=LONG_CONTEXT_TILE_TOKENS)
    fields.update(_long_context_model_fields(model, tgt))
    if mode == "full":
        fields.update(optimizer="adamw8bit_in_backward", precision="fp32" if precision == "fp16-autocast" else precision)
    else:
        fields.update(optimizer="adamw", precision=precision, base_dtype=BASE_FOR_PRECISION[precision])
    return Recipe.from_dict({**fields, **mode_fields(mode, model)})


LONG_CONTEXT_NORM_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3")  # transformers' Llama-style RMSNorm


def _long_context_model_fields(model: str | None, tgt: Target) -> dict[str, Any]:
    """Return the longest-context round's fields that depend on the architecture: the norm by tiles (Llama-style
    RMSNorm families) and K/V repeated before SDPA (grouped-query attention on a CUDA target below sm_80)."""
    if model is None:
        return {}
    from colab_memopt.techniques.architectures import resolve_model

    spec = resolve_model(model)
    out: dict[str, Any] = {}
    if spec.family in LONG_CONTEXT_NORM_FAMILIES:
        out["norm_tile_tokens"] = LONG_CONTEXT_TILE_TOKENS
    config = spec.config
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    below_sm80 = tgt.cuda and tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0)
    if below_sm80 and isinstance(heads, int) and isinstance(kv, int) and kv < heads:
        out["attention"] = "sdpa_repeated_kv"
    return out
