"""Load your own model without running out of host RAM: the dtype, device and path a recipe needs.

`load_model` loads through transformers' meta-device initialisation (nothing is allocated before
the weights are read) shard by shard, straight to the device, in the dtype the recipe needs:

- frozen base weights (LoRA) in fp16 on a GPU without native bf16 (a T4), bf16 where it is native;
- trainable weights (full fine-tuning) in fp32: they are the master weights that fp16 autocast and
  the GradScaler need (fp16 trainable weights fail with "Attempting to unscale FP16 gradients");
- 4-bit bitsandbytes weights (nf4/fp4) for QLoRA, quantized shard by shard on the GPU
  (`BitsAndBytesConfig`); on the CPU, after loading, with `quantization.quantize_model`;
- peft LoRA adapters (fresh, or trained ones from a folder), checkpointing and the optimizer per the recipe;
- int8 weights (`weight_dtype='int8'`, notebook 16) through `load_int8` (`int8load`).

What each path needs is planned in `loadplan`; the trained weights are saved by `saving.save_trained`. The
names of those modules are also reachable here (`cm.loading.save_trained`, `cm.loading.load_host_bytes`), where
the notebooks and the README have always called them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.architectures import ModelSpec, resolve_model
from colab_memopt.core.env import bf16_native, pick_device
from colab_memopt.core.measure import HostPeak, format_bytes
from colab_memopt.techniques.quantization import DEFAULT_LORA_TARGETS, add_lora, quantize_model
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import quiet

from colab_memopt.training.checkpoints import (check_host_room, check_weight_files, has_weights, _weight_files)
from colab_memopt.training.int8load import load_int8
from colab_memopt.training.loadplan import load_dtype, load_host_bytes
from colab_memopt.training.saving import PEFT_PREFIX

# The names that lived in this module before it was split, reachable here as before (cm.loading.<name>)
from colab_memopt.training.checkpoints import (  # noqa: E402,F401
    checkpoint_folder, limit_heap_retention, open_safetensors, release_freed_host_memory, safetensors_largest_bytes,
    safetensors_map, unreadable_weights)
from colab_memopt.training.loadplan import (  # noqa: E402,F401
    ASYNC_QUANTIZED_LOAD, LOAD_INT8_OVERHEAD_BYTES, PUBLISHED_DTYPES, PUBLISHED_MAX_SHARD_BYTES,
    QLORA_LOAD_OVERHEAD_BYTES, LoadPlan, QuantizedLoadPlan, bnb_4bit_bytes, checkpoint_layout, hub_shard_bytes,
    quantized_load_bytes)
from colab_memopt.training.saving import save_random_model, save_trained  # noqa: E402,F401


@dataclass
class LoadedModel:
    """A loaded model with the recipe applied, its optimizer, and what loading took."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    recipe: Recipe
    dtype: torch.dtype
    device: torch.device
    random_weights: bool
    host_peak_bytes: int  # this process's peak RSS while loading (sampled)
    host_added_bytes: int  # that peak less the RSS before loading
    seconds: float
    source: str
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return (f"loaded {self.source} to {self.device} in {str(self.dtype).removeprefix('torch.')}"
                f"{' (random weights: no checkpoint)' if self.random_weights else ''} in {self.seconds:.1f} s; "
                f"host RAM peak {format_bytes(self.host_peak_bytes)} (+{format_bytes(self.host_added_bytes)}); "
                f"{trainable / 1e6:.2f}M trainable parameters" + "".join(f"\n  note: {n}" for n in self.notes))


def _bnb_config(recipe: Recipe, dtype: torch.dtype) -> Any:
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=recipe.quantization,
                              bnb_4bit_compute_dtype=torch.float32 if dtype == torch.float32 else dtype,
                              llm_int8_skip_modules=["lm_head"])


def load_model(id_or_path: Any, recipe: Recipe | dict[str, Any] | None = None, device: str | torch.device = "auto", *,
               adapter: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a causal LM's weights without a host-RAM spike, apply the recipe, and return it with its optimizer.

    Args:
        id_or_path: a Hugging Face model id, a folder saved with `save_pretrained` (weights and
            config.json), or anything else `architectures.resolve_model` takes (a config or one of our
            names: random weights, said in `notes`).
        recipe: the techniques (a `Recipe` or a dict of its fields); LoRA targets default to the
            model family's (`presets.LORA_TARGETS_BY_FAMILY`) when the recipe keeps the reference model's.
        device: 'auto' (CUDA if present), 'cpu' or 'cuda'.
        adapter: a folder of trained LoRA adapters (`save_trained`'s, or peft's `save_pretrained`) to load into
            the recipe's adapters instead of fresh ones; its rank, targets and alpha are the adapter's own.

    Returns:
        `LoadedModel`: `.model` (adapters, quantization and checkpointing applied), `.optimizer` over
        the trainable parameters, the load dtype and the host RAM the load took (peak RSS, sampled).

    Example:
        >>> loaded = load_model("Qwen/Qwen2.5-0.5B", Recipe.preset("ckpt-every-8", mode="qlora", model="qwen2.5-0.5b"))
        >>> step = make_train_step(loaded.model, loaded.optimizer, corpus, batch_size=4, seq_len=512, recipe=loaded.recipe)
    """
    if recipe is not None and not isinstance(recipe, (Recipe, dict)):
        raise TypeError(f"recipe must be a Recipe or a dict of its fields, got {type(recipe).__name__} {recipe!r}")
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe or {})
    if rec.uses_deepspeed or rec.layer_offload_active:
        raise ValueError("load_model applies in-process recipes; DeepSpeed (zero_stage, offload_*) and layer streaming "
                         "build their own engines: load with load_model(..., Recipe()) and pass the model to Recipe.build")
    dev = pick_device(device)
    lora_config = None
    if adapter is not None:
        lora_config = read_adapter_config(adapter)
        if not rec.lora_rank:
            raise ValueError(f"adapter={os.fspath(adapter)!r} holds LoRA adapters: give a LoRA recipe (lora_rank="
                             f"{lora_config.r}), or load the base alone without adapter=")
        if rec.lora_rank != lora_config.r:
            raise ValueError(f"adapter={os.fspath(adapter)!r} has rank r={lora_config.r}, the recipe lora_rank="
                             f"{rec.lora_rank}: give lora_rank={lora_config.r}")
        rec = rec.with_(lora_targets=tuple(sorted(lora_config.target_modules)))
    spec: ModelSpec = resolve_model(id_or_path)
    if spec.config is None:
        raise ValueError(f"load_model loads transformers causal LMs (an id, a folder or a config); {spec.name!r} is "
                         "the reference model or a factory: build it and call Recipe.build")
    if rec.lora_rank and rec.lora_targets == DEFAULT_LORA_TARGETS:
        from colab_memopt.training.presets import mode_fields

        rec = rec.with_(**{k: v for k, v in mode_fields("lora", spec.name).items() if k == "lora_targets"})
    dtype = load_dtype(rec, dev.type, bf16_native(dev))
    four_bit = rec.quantization in ("nf4", "fp4") and rec.quantization_phase == "all"
    notes: list[str] = []
    import transformers

    source = spec.path or spec.name
    weights = has_weights(spec)
    need = load_host_bytes(spec, rec, dev.type, native_bf16=bf16_native(dev)).host_bytes
    check_host_room(spec.name, dev, need)  # before the files are opened: a file mapped without room is not corrupt
    check_weight_files(_weight_files(spec.path))
    start = time.perf_counter()
    with HostPeak() as host:
        if weights and rec.weight_dtype == "int8":  # one tensor at a time to int8: an 8B model fits a T4 and Colab's RAM
            model = load_int8(source, dtype=dtype, device=dev)
        elif weights:
            kwargs: dict[str, Any] = dict(dtype=dtype)
            if dev.type == "cuda":
                kwargs["device_map"] = {"": dev.index or 0}
                if four_bit:
                    kwargs["quantization_config"] = _bnb_config(rec, dtype)
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs)
            except (MemoryError, torch.OutOfMemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - the checkpoint is the user's: name it
                raise ValueError(f"cannot load the weights in {source} ({', '.join(p.name for p in _weight_files(spec.path))}): "
                                 f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from exc
        else:
            notes.append("no weight files: random weights from the config")
            model = transformers.AutoModelForCausalLM.from_config(spec.config, dtype=dtype)
        if dev.type != "cuda" or not weights:
            model.to(dev)
        if four_bit and not (weights and dev.type == "cuda"):
            quantize_model(model, rec.quantization)  # bitsandbytes Linear4bit, quantized when moved to the device
            model.to(dev)
    if rec.lora_rank:
        add_lora(model, rec.lora_rank, targets=rec.lora_targets,
                 alpha=None if lora_config is None else lora_config.lora_alpha)
        for p in model.parameters():  # adapters train in fp32 (master weights) whatever the base's dtype
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        if adapter is not None:
            load_adapter_weights(model, adapter)
            notes.append(f"LoRA adapters from {os.fspath(adapter)}")
    seconds = time.perf_counter() - start
    rest = rec.with_(quantization=None, lora_rank=0, lora_targets=DEFAULT_LORA_TARGETS, base_dtype=None)
    model, optimizer = rest.build(model)
    return LoadedModel(model, optimizer, rec, dtype, dev, not weights, host.peak_bytes, host.added_bytes, seconds,
                       source, notes)


def _adapter_folder(adapter: Any) -> Path:
    if isinstance(adapter, bytes) or not isinstance(adapter, (str, os.PathLike)):
        raise TypeError(f"adapter must be a folder (str or pathlib.Path), got {type(adapter).__name__} {adapter!r}")
    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"adapter={str(folder)!r} holds no adapter_config.json: give the folder save_trained (or "
                         "peft's save_pretrained) wrote")
    return folder


def read_adapter_config(adapter: str | os.PathLike[str]) -> Any:
    """Return the peft LoraConfig of an adapter folder; refuse one load_model cannot rebuild, naming what to use."""
    with quiet():  # peft's import notes (torchao's): nothing about this adapter
        from peft import LoraConfig

    from colab_memopt.core.fileio import read_json

    folder = _adapter_folder(adapter)
    values = read_json(folder / "adapter_config.json")
    if not isinstance(values, dict) or values.get("peft_type") not in (None, "LORA"):
        raise ValueError(f"{folder / 'adapter_config.json'} is not a LoRA adapter's config (peft_type "
                         f"{values.get('peft_type') if isinstance(values, dict) else None!r}): load it with "
                         "PeftModel.from_pretrained(base, folder)")
    config = LoraConfig.from_pretrained(str(folder))
    other = [name for name, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none"),
                                      ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                                      ("layers_to_transform", None)) if (getattr(config, name, plain) or plain) != plain]
    if other or isinstance(config.target_modules, str) or not config.target_modules:
        what = other or [f"target_modules={config.target_modules!r}"]
        raise ValueError(f"the adapter in {folder} sets {what}, which load_model does not rebuild: load it with "
                         "PeftModel.from_pretrained(base, folder)")
    return config


def load_adapter_weights(model: nn.Module, adapter: str | os.PathLike[str]) -> None:
    """Load an adapter folder's trained LoRA weights into the adapters `model` holds (`add_lora`'s); refuse, naming
    them, tensors the model has no place for or adapters the folder does not fill."""
    with quiet():  # peft's import notes (torchao's): nothing about this adapter
        from peft import set_peft_model_state_dict

    folder = _adapter_folder(adapter)
    files = [folder / name for name in ("adapter_model.safetensors", "adapter_model.bin") if (folder / name).is_file()]
    if not files:
        raise ValueError(f"{folder} holds adapter_config.json but no adapter_model.safetensors (a save cut short?)")
    check_weight_files(files[:1])
    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(files[0]))
    else:
        state = torch.load(files[0], map_location="cpu", weights_only=True)
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    expected = {n for n, _ in model.named_parameters() if "lora_" in n}
    result = set_peft_model_state_dict(model, state)
    unexpected = sorted(getattr(result, "unexpected_keys", []) or [])
    missing = sorted(k for k in (getattr(result, "missing_keys", []) or []) if k in expected)
    if unexpected or missing:
        keys = unexpected or missing
        raise ValueError(f"the adapter in {folder} does not fit this model: {len(keys)} tensor(s) "
                         f"{'it has no place for' if unexpected else 'left unfilled'}, e.g. {keys[:2]} (another base "
                         "model, or other target modules?)")
