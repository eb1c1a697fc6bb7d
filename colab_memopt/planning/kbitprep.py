"""peft's `prepare_model_for_kbit_training` in a plan: said to it from settings, read from a Trainer's model.

The function (peft `utils/other.py`) freezes every parameter, casts every 16-bit parameter that is not 4-bit
storage to float32 (the embeddings, a tied or untied lm_head, the norms), and with `use_gradient_checkpointing=True`
(its default) adds the input-require-grads hook and turns checkpointing on with `gradient_checkpointing_kwargs={}`
(so torch's default, `use_reentrant=True`, unless the settings' `gradient_checkpointing=True` re-enables it when
the Trainer trains). A plan made from settings cannot see the call: `plan_trainer(...,
prepare_model_for_kbit_training=True)` runs the installed peft's own function on the planner's fake model. A
Trainer's model shows it had the call by what it leaves (no marker of its own): a quantized model whose kept
floating-point parameters are all float32 while its compute dtype is 16-bit (`prepared_signs`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

ARGUMENT = "prepare_model_for_kbit_training"


def _function() -> Any:
    from colab_memopt.core.console import quiet

    with quiet():  # peft's import notes (torchao's): nothing about this run
        from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training


def _parameters() -> list[str]:
    """Return the keyword arguments the installed peft's function takes (its `model` left out)."""
    return [n for n in inspect.signature(_function()).parameters if n != "model"]


def prepare_kwargs(value: Any, *, bnb: Any, trainer_given: bool) -> dict[str, Any] | None:
    """Return the keyword arguments the run passes to `prepare_model_for_kbit_training` (None: no call).

    `value`: False/None (no call), True (its defaults) or a dict of its keyword arguments. Refuse it with a Trainer
    (its model shows the call) and without a quantized model (`bnb`), naming the value."""
    if value is None or value is False:
        return None
    if trainer_given:
        raise ValueError(f"{ARGUMENT}={value!r}: a Trainer's model already shows whether it went through "
                         f"{ARGUMENT} (its float32 embeddings and norms): leave it out")
    if not isinstance(value, (bool, dict)):
        raise ValueError(f"{ARGUMENT} must be True, False or a dict of its keyword arguments "
                         f"({', '.join(_parameters())}), got {value!r}")
    if bnb is None:
        raise ValueError(f"{ARGUMENT}={value!r} needs a quantized model: give "
                         "bnb=BitsAndBytesConfig(load_in_4bit=True) (or load_in_8bit=True)")
    if value is True:
        return {}
    unknown = sorted(set(value) - set(_parameters()))
    if unknown:
        raise ValueError(f"{ARGUMENT}: unknown keyword argument(s) {unknown}; the installed peft's function takes "
                         f"{', '.join(_parameters())}")
    return dict(value)


def apply(net: nn.Module, kwargs: dict[str, Any]) -> None:
    """Run the installed peft's `prepare_model_for_kbit_training` on the planner's (fake) model with `kwargs`; its
    accelerator cache release is left out where the installed function lets it be (the plan touches no device)."""
    call = dict(kwargs)
    if "auto_clear_cache" in _parameters():
        call["auto_clear_cache"] = False
    _function()(net, **call)


def _quantized(model: nn.Module) -> Any:
    """Return the model's bitsandbytes quantization config where it was loaded quantized, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)):
        return None
    return getattr(getattr(base, "config", None), "quantization_config", None)


def _kept_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Return the base's floating-point parameters that are not quantized storage and not peft's adapters."""
    return [p for n, p in model.named_parameters() if p.is_floating_point() and "lora_" not in n
            and type(p).__name__ not in ("Params4bit", "Int8Params")]


def prepared_signs(model: nn.Module) -> bool:
    """Return whether a Trainer's model shows `prepare_model_for_kbit_training`'s casts: quantized, every kept
    floating-point base parameter float32, and a 16-bit compute dtype (4-bit) or load dtype (8-bit) in its config."""
    config = _quantized(model)
    if config is None:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "is_loaded_in_4bit", False):
        compute = (config.get("bnb_4bit_compute_dtype") if isinstance(config, dict)
                   else getattr(config, "bnb_4bit_compute_dtype", None))
    else:
        compute = getattr(base.config, "dtype", None)
    if isinstance(compute, str):
        compute = getattr(torch, compute.removeprefix("torch."), None)
    kept = _kept_parameters(model)
    return compute in (torch.float16, torch.bfloat16) and bool(kept) and all(p.dtype == torch.float32 for p in kept)


def float32_bytes(model: nn.Module) -> int:
    """Return the bytes the function's float32 casts add over 16-bit storage: 2 a value of the kept parameters."""
    seen: set[int] = set()
    total = 0
    for p in _kept_parameters(model):
        if p.dtype == torch.float32 and id(p) not in seen:
            seen.add(id(p))
            total += 2 * p.numel()
    return total


def plan_line(model: nn.Module, *, said: bool, own_checkpointing: bool, autocast: bool = True,
              extra_bytes: int | None = None) -> str:
    """Return the plan's line about the call, in the user's words: said to the plan, or read from their model
    (`extra_bytes`: `float32_bytes` of the whole model, where `model` is a shallow copy of it)."""
    from colab_memopt.core.measure import format_bytes

    where = (f"{ARGUMENT}: planned with peft's own function" if said
             else f"your model went through {ARGUMENT} (read from its float32 weights)")
    extra = float32_bytes(model) if extra_bytes is None else extra_bytes
    text = f"{where}: embeddings, lm_head and norms in float32 (+{format_bytes(extra)} over 16 bits)"
    if autocast:  # autocast casts the frozen float32 head to 16 bits at every forward and keeps the copy for backward
        text += ", and lm_head's 16-bit copy each step"
    if own_checkpointing:
        text += "; its checkpointing stays on (use_reentrant=True: peft passes no use_reentrant)"
    return text
