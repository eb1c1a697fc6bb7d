"""The installed libraries' defaults a Trainer plan assumed, one line each, with the versions that gave them.

Each is read from the installed library (its objects or its code), never inferred from a version number: the
checkpointing `use_reentrant` transformers passes when the settings give none (`hfconfig.checkpoint_use_reentrant`),
the loss (TRL's `SFTConfig.loss_type` default, or the model's own `loss_function` for a plain Trainer), and the
dtype a model id or folder is loaded in when the user names none (TRL's `create_model_from_path` default, or
transformers' `from_pretrained` default). A setting the user wrote is not a default and is not listed.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import torch

from colab_memopt.core.console import quiet


def _version(module: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - the package imported it
        return "?"


def _source_default(function: Any, pattern: str) -> str | None:
    """Return the first group of `pattern` in `function`'s source, None where it cannot be read or is not there."""
    try:
        found = re.search(pattern, inspect.getsource(function))
    except (OSError, TypeError):
        return None
    return found.group(1) if found else None


def checkpointing_line(args: Any, on: bool) -> list[str]:
    """Return the line of the `use_reentrant` the run checkpoints with where the settings give none."""
    from colab_memopt.planning.hfconfig import checkpoint_use_reentrant

    if not on:
        return []
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs",
                                                                            None) or {}
    reentrant, source = checkpoint_use_reentrant(kwargs)
    if source == "as you set it":
        return []
    if source == "torch's default":
        source = f"torch {torch.__version__}'s default (transformers passes none)"
    return [f"gradient checkpointing use_reentrant={reentrant}: {source}"]


def loss_line(args: Any, model: Any) -> list[str]:
    """Return the line of the loss the run computes: TRL's SFT `loss_type` where it is SFTConfig's default, else
    the model's own `loss_function` (transformers' loss for its head)."""
    if type(args).__name__ == "SFTConfig" and hasattr(args, "loss_type"):
        default = next((f.default for f in dataclasses.fields(args) if f.name == "loss_type"), None)
        if args.loss_type == default:
            return [f"loss: loss_type={args.loss_type!r}, TRL {_version('trl')}'s SFTConfig default"]
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    function = getattr(base, "loss_function", None)
    name = getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", None)
    if name is None:
        return []
    return [f"loss: {name}, transformers {_version('transformers')}'s loss for {type(base).__name__}"]


def load_dtype_line(args: Any, model: Any, dtype: Any, loaded: torch.dtype) -> list[str]:
    """Return the line of the dtype a model given by name is loaded in where the user names none (`dtype`,
    SFTConfig's `model_init_kwargs`): TRL's default for a model id, else transformers' `from_pretrained` default."""
    if dtype is not None or model is None:
        return []
    name = str(loaded).removeprefix("torch.")
    if type(args).__name__ == "SFTConfig" and isinstance(model, str):
        kwargs = getattr(args, "model_init_kwargs", None) or {}
        if kwargs.get("dtype", kwargs.get("torch_dtype")) is not None:
            return []
        try:
            with quiet():  # TRL's import notes: nothing about this run
                from trl.trainer.utils import create_model_from_path
        except ImportError:  # pragma: no cover - an older TRL
            return [f"load dtype: {name}, TRL {_version('trl')}'s default for a model id (model_init_kwargs names none)"]
        read = _source_default(create_model_from_path, r"""kwargs\.get\(["']dtype["'],\s*["'](\w+)["']\)""")
        said = f"TRL {_version('trl')}'s default for a model id" + ("" if read else " (its documented rule)")
        return [f"load dtype: {read or name}, {said}; set model_init_kwargs={{'dtype': ...}} to change it"]
    with quiet():  # transformers' modeling module imports torchao: its notes say nothing here
        from transformers import PreTrainedModel

    read = _source_default(PreTrainedModel.from_pretrained, r"""if dtype is None:\s*dtype = ["'](\w+)["']""")
    how = f"from_pretrained default dtype={read!r}" if read else "from_pretrained default"
    return [f"load dtype: {name} (the config's): transformers {_version('transformers')}'s {how}"]
