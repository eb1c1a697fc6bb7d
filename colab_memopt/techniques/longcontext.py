"""Long context through your own Trainer: the package's long-context techniques installed by one call (notebook 17).

`cm.long_context(trainer)` installs into a transformers `Trainer` / TRL `SFTTrainer`'s model (or a model) what the
package's own loop uses for its longest sequences, in place, before `trainer.train()`:

- every decoder layer checkpointed with its input kept in host RAM (`checkpointing.apply_checkpointing(model,
  'offload', checkpoint_interval)`): the device holds two layer inputs at a time instead of one per layer. With
  `checkpoint_interval` k > 1 one input per k layers goes to the host (1/k of the host RAM) and the layers inside
  are checkpointed again on the device (two-level: k - 1 more layer inputs on the device, one more forward);
- each MLP run by tiles of `mlp_tile_tokens` tokens (`tiling.apply_tiled_mlp`), each Llama-style RMSNorm by tiles
  of `norm_tile_tokens` (`tiling.apply_tiled_norm`);
- a grouped-query model's key/value heads repeated before SDPA (`attention.repeat_kv_for_sdpa`), so a T4 runs the
  memory-efficient kernel, not math's tokens x tokens scores.

The Trainer's own `gradient_checkpointing` must be off (`SFTConfig(gradient_checkpointing=False)`): the layers are
checkpointed here, with their inputs in host RAM. TRL's loss (`loss_type`) runs as installed. `plan_trainer` traces
what is installed (it runs in the trace) and counts the host RAM of the offloaded inputs; for settings without a
Trainer yet, pass the same `LongContext` to `plan_trainer(..., long_context=...)`.

Example:
    >>> lc = cm.long_context(trainer)  # SFTConfig(..., gradient_checkpointing=False, max_length=40960)
    >>> cm.plan_trainer(trainer, target="t4").fits
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from colab_memopt.techniques import checkpointing, tiling

__all__ = ["LongContext", "installed_long_context", "long_context", "remove_long_context"]

DEFAULT_TILE_TOKENS = 4096  # tokens per MLP / RMSNorm tile (the package's longest-context round uses the same)
_MARK = "_cm_long_context"


@dataclass(frozen=True)
class LongContext:
    """What `long_context` installs.

    Args:
        checkpoint_interval: layers per host copy: 1 keeps every layer's input in host RAM; k > 1 keeps one
            per k layers there and checkpoints the k layers again on the device (two-level).
        keep_blocks: how many of the last layers keep their input on the device instead (interval 1 only):
            less host RAM, more device memory.
        mlp_tile_tokens: tokens per MLP tile, or None for the untiled MLP.
        norm_tile_tokens: tokens per RMSNorm tile, or None (a model without Llama-style RMSNorm needs None).
        repeat_kv: repeat a grouped-query model's key/value heads before SDPA (the O(T) kernel on a T4).
    """

    checkpoint_interval: int = 1
    keep_blocks: int = 0
    mlp_tile_tokens: int | None = DEFAULT_TILE_TOKENS
    norm_tile_tokens: int | None = DEFAULT_TILE_TOKENS
    repeat_kv: bool = True

    def __post_init__(self) -> None:
        for name in ("checkpoint_interval", "keep_blocks"):
            value, low = getattr(self, name), 1 if name == "checkpoint_interval" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.keep_blocks and self.checkpoint_interval > 1:
            raise ValueError(f"keep_blocks={self.keep_blocks} needs checkpoint_interval=1, got "
                             f"checkpoint_interval={self.checkpoint_interval}")
        tiling.check_tile_tokens(self.mlp_tile_tokens)
        tiling.check_tile_tokens(self.norm_tile_tokens, "norm_tile_tokens")
        if not isinstance(self.repeat_kv, bool):
            raise ValueError(f"repeat_kv must be True or False, got {self.repeat_kv!r}")

    def describe(self) -> str:
        """Return one line in the user's words: what is installed."""
        where = ("every layer's input in host RAM" if self.checkpoint_interval == 1
                 else f"one layer input per {self.checkpoint_interval} layers in host RAM (two-level checkpoints)")
        if self.keep_blocks:
            where += f", the last {self.keep_blocks} on the device"
        tiles = [f"{name} by tiles of {n:,} tokens" for name, n in (("MLP", self.mlp_tile_tokens),
                                                                   ("RMSNorm", self.norm_tile_tokens)) if n]
        return "cm.long_context: " + ", ".join([where, *tiles])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model_of(obj: Any) -> nn.Module:
    """Return the model of a Trainer (refusing its own gradient checkpointing), or `obj` if it is a model."""
    args = getattr(obj, "args", None)
    if args is not None and hasattr(obj, "model"):
        # transformers 5 names it activation_checkpointing (gradient_checkpointing its alias)
        if getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)):
            raise ValueError("gradient_checkpointing=True in your training arguments: cm.long_context checkpoints the "
                             "layers itself, with their inputs in host RAM; set gradient_checkpointing=False")
        obj = obj.model
    if not isinstance(obj, nn.Module):
        raise TypeError(f"long_context takes a transformers Trainer / TRL SFTTrainer or a model, got {type(obj).__name__}")
    return obj


def _base(model: nn.Module) -> nn.Module:
    """Return the transformers model under peft's wrappers (the one with the config and the layers)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _grouped_query(base: nn.Module) -> bool:
    config = getattr(base, "config", None)
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads and kv and kv < heads)


def long_context(trainer_or_model: Any, settings: LongContext | None = None, **fields: Any) -> LongContext:
    """Install the long-context techniques into a Trainer's model (or a model), in place; return what was installed.

    Args:
        trainer_or_model: a transformers `Trainer` / TRL `SFTTrainer` (its settings must have
            gradient_checkpointing=False), or a model (peft-wrapped or not).
        settings: a `LongContext`; or its fields as keywords (`checkpoint_interval=2`, `mlp_tile_tokens=4096`).

    Call it once, before `trainer.train()` and before planning the Trainer (`plan_trainer` traces what is
    installed). `remove_long_context(model)` takes it out again.

    Example:
        >>> cm.long_context(trainer, checkpoint_interval=2)
    """
    if settings is not None and fields:
        raise ValueError(f"give settings= or its fields, not both (got settings and {sorted(fields)})")
    if settings is not None and not isinstance(settings, LongContext):
        raise TypeError(f"settings must be a LongContext, got {type(settings).__name__}")
    settings = settings if settings is not None else LongContext(**fields)
    model = _model_of(trainer_or_model)
    base = _base(model)
    on = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.2x; older: is_gradient_checkpointing
    if on if on is not None else getattr(base, "is_gradient_checkpointing", False):
        raise ValueError("the model has transformers' gradient checkpointing on: cm.long_context checkpoints the layers "
                         "itself; call model.gradient_checkpointing_disable() first")
    if installed_long_context(model) is not None:
        remove_long_context(model)
    checkpointing.apply_checkpointing(base, "offload", settings.checkpoint_interval, keep_blocks=settings.keep_blocks)
    tiling.apply_tiled_mlp(base, settings.mlp_tile_tokens)
    if settings.norm_tile_tokens is not None:
        tiling.apply_tiled_norm(base, settings.norm_tile_tokens)
    if settings.repeat_kv and _grouped_query(base):
        from colab_memopt.techniques.attention import repeat_kv_for_sdpa

        repeat_kv_for_sdpa(base)
    setattr(base, _MARK, settings)
    return settings


def installed_long_context(model: Any) -> LongContext | None:
    """Return what `long_context` installed into `model` (a Trainer's model, peft-wrapped or not), else None."""
    if hasattr(model, "args") and hasattr(model, "model"):
        model = model.model
    return getattr(_base(model), _MARK, None) if isinstance(model, nn.Module) else None


def remove_long_context(model: nn.Module) -> nn.Module:
    """Undo `long_context` (checkpointing and tiles; the repeated-K/V attention stays, it gives the same results)."""
    base = _base(model)
    checkpointing.remove_checkpointing(base)
    tiling.remove_tiled_mlp(base)
    tiling.remove_tiled_norm(base)
    base.__dict__.pop(_MARK, None)
    return model
