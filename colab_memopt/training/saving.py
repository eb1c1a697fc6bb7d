"""Save what was trained so that it loads back as it was trained: LoRA adapters as peft saves them, int8 weights
as the 16-bit weights they compute with, else the whole model; every file written whole, so a save killed
part-way (a Colab runtime reset) keeps the earlier save loadable. `save_random_model` writes a random checkpoint
from a config, for tests without a network.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.architectures import resolve_model
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import quiet



# An earlier save's weight files a new save replaces: removed when the new one did not write them (a sharded save over
# a single file, or the reverse), so no loader reads the earlier save's weights beside the new config.
WEIGHT_FILE_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                        "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
ADAPTER_FILE_PATTERNS = ("adapter_model.safetensors", "adapter_model.bin")
# peft's own saves name each adapter tensor as PeftModel holds it: under `base_model.model.`
PEFT_PREFIX = "base_model.model."


def save_random_model(model: Any, folder: str | Path, *, max_shard_size: str | int = "2GB") -> Path:
    """Save a causal LM with random weights, built from `model`'s config, to `folder` (`save_pretrained`).

    For tests and CI, which have no network: `model` is a config, a family name's `small_config` or
    anything `architectures.resolve_model` takes. Returns the folder. Each file is written whole
    (`fileio.replace_files`): a kill while saving leaves the folder's earlier files as they were.
    """
    from colab_memopt.core.fileio import replace_files

    spec = resolve_model(model)
    if spec.config is None:
        raise ValueError(f"save_random_model needs a transformers config, got {spec.name!r}")
    folder = Path(folder)
    built = spec.build()
    replace_files(folder, lambda tmp: built.save_pretrained(tmp, max_shard_size=max_shard_size), stale=WEIGHT_FILE_PATTERNS)
    return folder


def _check_folder(folder: Any) -> Path:
    if isinstance(folder, bytes) or not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or pathlib.Path), got {type(folder).__name__} {folder!r}")
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} is a file: give a folder to save into")
    return folder


def save_trained(model: nn.Module, folder: str | Path, recipe: Recipe | dict[str, Any]) -> list[Path]:
    """Save what was trained so that it loads back as it was trained; return the files written.

    - Under a LoRA recipe (`lora_rank` > 0): the adapters as peft saves them (`adapter_model.safetensors`
      with peft's tensor names, `adapter_config.json`): `PeftModel.from_pretrained(base, folder)` and
      `load_model(base, recipe, adapter=folder)` load them.
    - Int8 weights (`weight_dtype='int8'`): each weight dequantized to the 16-bit dtype it computed in,
      under the usual names: `AutoModelForCausalLM.from_pretrained(folder)` gives the trained logits, and
      `load_int8(folder)` quantizes it to int8 again.
    - Otherwise the whole model (`save_pretrained`).

    Every file is written whole: a save killed part-way (a Colab runtime reset) keeps the earlier save
    loadable, and other files in `folder` (a tokenizer) are left alone.

    Args:
        model: the trained model (a transformers model, or one with LoRA adapters from a recipe).
        folder: where to save; created if missing.
        recipe: the `Recipe` it was trained with (or a dict of its fields, as `load_model` takes).

    Example:
        >>> loaded = cm.load_model("Qwen/Qwen2.5-0.5B", cm.Recipe(lora_rank=16))
        >>> ...  # train
        >>> save_trained(loaded.model, "adapter", loaded.recipe)
    """
    if recipe is None or not isinstance(recipe, (Recipe, dict)):
        raise TypeError(f"recipe must be the Recipe the model was trained with (or a dict of its fields), got "
                        f"{type(recipe).__name__} {recipe!r}")
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the trained torch model, got {type(model).__name__}")
    folder = _check_folder(folder)
    if rec.lora_rank:
        return _save_adapters(model, folder)
    from colab_memopt.core.fileio import replace_files
    from colab_memopt.techniques.int8train import int8_weights

    if not hasattr(model, "save_pretrained"):
        raise ValueError(f"{type(model).__name__} has no save_pretrained (the course's own model): save its weights "
                         "with torch.save(model.state_dict(), 'model.pt'), and load them into a model built the same "
                         "way with model.load_state_dict(torch.load('model.pt'))")
    if int8_weights(model):
        state, dtype = _int8_as_16_bit(model)
        config = copy.deepcopy(model.config)
        config.dtype = dtype

        def save(tmp: Path) -> None:
            model.save_pretrained(tmp, state_dict=state)
            config.save_pretrained(tmp)  # the 16-bit dtype the weights are in

        return replace_files(folder, save, stale=WEIGHT_FILE_PATTERNS)
    return replace_files(folder, lambda tmp: model.save_pretrained(tmp), stale=WEIGHT_FILE_PATTERNS)


def _int8_as_16_bit(model: nn.Module) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """Return `model`'s state dict with each int8 weight (`qweight`, `scale`) as the 16-bit `weight` it computes with
    (the same values its forward uses: int8 x scale in fp32, cast to its dtype), and that dtype."""
    from colab_memopt.techniques.int8train import Int8Embedding, Int8Linear, dequantize_int8

    state = dict(model.state_dict())
    weights: dict[int, torch.Tensor] = {}  # a tied embedding and head: one tensor, which save_pretrained keeps once
    dtypes = set()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, (Int8Linear, Int8Embedding)):
                prefix = f"{name}." if name else ""
                state.pop(prefix + "qweight", None)
                state.pop(prefix + "scale", None)
                if id(m.shared) not in weights:
                    weights[id(m.shared)] = dequantize_int8(m.qweight, m.scale, m.shared.dtype).cpu()
                state[prefix + "weight"] = weights[id(m.shared)]
                dtypes.add(m.shared.dtype)
    return state, dtypes.pop() if len(dtypes) == 1 else torch.float32


def _save_adapters(model: nn.Module, folder: Path) -> list[Path]:
    """Save a model's LoRA adapters as peft saves them (tensor names under `base_model.model.`)."""
    from colab_memopt.core.fileio import replace_files

    config = (getattr(model, "peft_config", None) or {}).get("default")
    if config is None or not any("lora_" in n for n, _ in model.named_parameters()):
        raise ValueError("the recipe has lora_rank > 0 but the model holds no LoRA adapters: save the model the "
                         "recipe built (load_model(..., recipe).model), or give the recipe it was trained with")
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    if isinstance(model, PeftModel):  # peft's own model: its own save, each file written whole
        return replace_files(folder, lambda tmp: model.save_pretrained(tmp), stale=ADAPTER_FILE_PATTERNS)
    state = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    config = copy.deepcopy(config)  # the user's model keeps its own
    hf_config = getattr(model, "config", None)
    if getattr(config, "base_model_name_or_path", None) is None and getattr(hf_config, "_name_or_path", ""):
        config.base_model_name_or_path = hf_config._name_or_path
    if getattr(config, "task_type", None) is None and hasattr(model, "generate") and hf_config is not None:
        config.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then gives a model that generates

    def save(tmp: Path) -> None:
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))

    return replace_files(folder, save, stale=ADAPTER_FILE_PATTERNS)
