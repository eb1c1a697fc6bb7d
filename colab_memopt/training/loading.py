"""Load your own model without running out of host RAM: the dtype, device and path a recipe needs.

Colab's free tier has 12.7 GB of host RAM for a 14.56 GiB T4: the classic way to load a model
(random fp32 weights, then the whole state dict beside them, then `.to("cuda")`) needs 4 bytes per
parameter plus the checkpoint in host RAM, and a 3B model's load runs out of host RAM: Colab kills
and restarts the runtime before training starts, with no Python error that names memory.
`load_model` loads through transformers' meta-device initialisation (nothing is allocated before
the weights are read) shard by shard, straight to the device, in the dtype the recipe needs:

- frozen base weights (LoRA) in fp16 on a GPU without native bf16 (a T4), bf16 where it is native;
- trainable weights (full fine-tuning) in fp32: they are the master weights that fp16 autocast and
  the GradScaler need (fp16 trainable weights fail with "Attempting to unscale FP16 gradients");
- 4-bit bitsandbytes weights (nf4/fp4) for QLoRA, quantized shard by shard on the GPU
  (`BitsAndBytesConfig`); on the CPU, after loading, with `quantization.quantize_model`;
- peft LoRA adapters, checkpointing and the optimizer per the recipe;
- int8 weights (`weight_dtype='int8'`, notebook 16) through `load_int8`: an 8B checkpoint is 16 GB in
  bf16, more than Colab's RAM and a T4; `load_int8` reads one memory-mapped tensor at a time and
  quantizes it on the device, so the host holds about one tensor (1 GB at 8B), never a shard.

`load_host_bytes` gives the host RAM each path needs, for the plan and the doctor; `quantized_load_bytes` gives
what transformers' own 4-bit `from_pretrained` holds on the GPU and the host, read from its code path and the
checkpoint's headers (benchmarks/qlora_load.py measures the host side on the CPU).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.architectures import ARCHITECTURES, ModelSpec, resolve_model
from colab_memopt.core.env import bf16_native, pick_device
from colab_memopt.core.measure import HostPeak, format_bytes
from colab_memopt.techniques.quantization import DEFAULT_LORA_TARGETS, add_lora, quantize_model
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import quiet

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def _unique_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _checkpoint_dtype(config: Any) -> torch.dtype:
    values = vars(config) if config is not None else {}
    value = values.get("dtype") or values.get("torch_dtype")  # transformers 5 says dtype, 4 torch_dtype
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value in _DTYPE_BYTES else torch.float32


def load_dtype(recipe: Recipe, device_type: str, native_bf16: bool = False) -> torch.dtype:
    """Return the dtype the weights are loaded in: fp32 where they train, 16-bit where they stay frozen on a GPU.

    Frozen base weights (LoRA) take fp16 on a GPU without native bf16 (a T4), bf16 where it is native;
    trained weights stay fp32 (the master copy mixed precision needs), and so does everything on the CPU.
    """
    if recipe.precision == "bf16":
        return torch.bfloat16
    if recipe.precision == "fp16":  # pure fp16 weights: load them so, not in fp32 cast later (twice the memory)
        return torch.float16
    if recipe.base_dtype is not None:  # the recipe names the frozen base's dtype (LoRA's base in 16-bit)
        return torch.float16 if recipe.base_dtype == "fp16" else torch.bfloat16
    if device_type == "cuda" and recipe.lora_rank:
        return torch.bfloat16 if native_bf16 else torch.float16
    return torch.float32


@dataclass
class LoadPlan:
    """What loading a model's weights needs in host RAM, by the path `load_model` takes and the classic one."""

    model: str
    params: int
    checkpoint_bytes: int  # on disk (or params x the config's dtype where the files are not here)
    largest_shard_bytes: int
    checkpoint_dtype: str
    load_dtype: str
    device: str
    four_bit: bool
    host_bytes: int  # load_model's path: meta-device init, shard by shard, straight to `device`
    classic_host_bytes: int  # random fp32 init, then the whole state dict beside it, then .to(device)
    path: str
    notes: list[str] = field(default_factory=list)
    layout: str = ""  # where the checkpoint's size and shards come from
    assumed: bool = False  # whether that layout is an assumption (no files or hub headers read)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        return (f"loading {self.model} ({self.params / 1e6:.1f}M parameters, checkpoint {format_bytes(self.checkpoint_bytes)} "
                f"in {self.checkpoint_dtype}, largest shard {format_bytes(self.largest_shard_bytes)}) to {self.device} in "
                f"{self.load_dtype}{' (4-bit)' if self.four_bit else ''}: host RAM {format_bytes(self.host_bytes)} by {self.path}; "
                f"the classic load (fp32 init + state dict) would need {format_bytes(self.classic_host_bytes)}")


def _weight_files(folder: str | None) -> list[Path]:
    """Return a folder's weight files; a sharded checkpoint's index must find every shard it names."""
    if folder is None:
        return []
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    for index in sorted(Path(folder).glob("*.index.json")):
        from colab_memopt.core.fileio import read_json

        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map': not a sharded checkpoint's index (a truncated download?)")
        missing = sorted({str(v) for v in weight_map.values()} - {p.name for p in files})
        if missing:
            raise ValueError(f"{index} names shard(s) {missing[:4]}{' ...' if len(missing) > 4 else ''} that are not in "
                             f"{folder} (a partial download?): download them, or remove the index for random weights")
    return files


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, MemoryError) or "Cannot allocate memory" in text or "os error 12" in text


def unreadable_weights(path: Path, exc: BaseException) -> Exception:
    """Return the error to raise for a weight file the libraries could not read: MemoryError where the process ran
    out of memory mapping it (the file is fine), else ValueError naming the file (a truncated or corrupt download)."""
    detail = " ".join(str(exc).split())[:200]
    if _out_of_memory(exc):
        return MemoryError(f"reading {path} needs host memory this process does not have ({detail}): free memory "
                           "(restart the runtime) and load again")
    return ValueError(f"{path} is not a readable {path.suffix.lstrip('.')} weight file (a truncated or corrupt "
                      f"download?): {detail}")


@contextlib.contextmanager
def open_safetensors(path: Path) -> Any:
    """`safetensors.safe_open(path)`, its errors (a cut-short header, garbage, no memory to map it) named with the file."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), "pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError names no file
        raise unreadable_weights(path, exc) from None
    with handle as f:
        yield f


def check_weight_files(files: list[Path]) -> None:
    """Raise ValueError naming the file if a weight file cannot be read (a truncated or corrupt download)."""
    for path in files:
        if path.suffix == ".safetensors":
            with open_safetensors(path) as f:
                f.keys()
            continue
        try:
            torch.load(path, map_location="meta", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - the unpickler's own errors name nothing
            raise unreadable_weights(path, exc) from None


def _host_room_bytes() -> int:
    """Return the host RAM this process can still take: the machine's available RAM, or less under an address-space limit."""
    import resource

    from colab_memopt.core.env import host_memory

    room = host_memory().available_bytes
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        import psutil

        room = min(room, soft - psutil.Process().memory_info().vms)
    return room


def check_host_room(name: str, device: torch.device, need_bytes: int) -> None:
    """Raise MemoryError naming both figures if loading needs more host RAM than this process has left."""
    room = _host_room_bytes()
    if need_bytes > room:
        raise MemoryError(f"loading {name} to {device} needs about {format_bytes(need_bytes)} of host RAM and this "
                          f"process has {format_bytes(room)} left: free memory (restart the runtime), or load to 'cuda' "
                          "shard by shard")


def has_weights(spec: ModelSpec) -> bool:
    """Return whether a model has a checkpoint to load: a hub id, or a local folder with weight files."""
    return spec.source.startswith("Hugging Face config") or bool(_weight_files(spec.path))


def load_host_bytes(model: Any, recipe: Recipe | None = None, device: str | torch.device = "cuda", *,
                    native_bf16: bool = False) -> LoadPlan:
    """Return the host RAM that loading `model`'s weights needs, on `load_model`'s path and the classic one.

    Args:
        model: anything `architectures.resolve_model` takes (a Hugging Face id, a folder, ...).
        recipe: decides the load dtype and 4-bit quantization (default: full fine-tuning in fp32).
        device: where the weights go: 'cuda' (the default: plan for the GPU even on a CPU) or 'cpu'.
        native_bf16: whether that GPU has native bf16 (a T4 has not: frozen weights load in fp16).

    The figures: the checkpoint's files on disk where they are local (else parameters x the config's
    dtype); straight to a GPU, the host holds about one shard at a time; to the CPU, the whole model
    in the load dtype plus the shard being read; the classic path holds fp32 random weights plus the
    whole state dict.
    """
    recipe = recipe or Recipe()
    spec = resolve_model(model)
    if not isinstance(device, torch.device) and not (isinstance(device, str) and device.split(":")[0] in ("cpu", "cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    with torch.device("meta"):
        shape = spec.build()
    params = _unique_params(shape)
    ckpt_dtype = _checkpoint_dtype(spec.config)
    files = _weight_files(spec.path)
    notes = []
    assumed = False
    hub = None if files or not str(spec.source).startswith("Hugging Face config") else hub_shard_bytes(spec.name)
    if files:
        sizes = [p.stat().st_size for p in files]
        checkpoint, largest = sum(sizes), max(sizes)
        layout = f"the weight files in {spec.path}"
    elif hub:
        checkpoint, largest = sum(hub), max(hub)
        layout = f"the safetensors headers of {spec.name} on the hub ({len(hub)} shard(s))"
    elif spec.name in ARCHITECTURES:  # a built-in name: its published checkpoint (its dtype in the config), in shards
        checkpoint = params * _DTYPE_BYTES[ckpt_dtype]
        largest = min(checkpoint, PUBLISHED_MAX_SHARD_BYTES)
        assumed = True
        layout = (f"assumed: the published checkpoint in {str(ckpt_dtype).removeprefix('torch.')}, in shards of at most "
                  f"{PUBLISHED_MAX_SHARD_BYTES / 1e9:.0f} GB")
        notes.append(f"no weight files here: {layout.removeprefix('assumed: ')} (not read)")
    else:
        checkpoint = largest = params * _DTYPE_BYTES[ckpt_dtype]
        assumed = True
        layout = f"assumed: one shard in {str(ckpt_dtype).removeprefix('torch.')} (the config's dtype, else float32)"
        notes.append("no weight files here: checkpoint size from the parameter count and the config's dtype, one shard assumed")
    dtype = load_dtype(recipe, dev.type, native_bf16)
    four_bit = recipe.quantization in ("nf4", "fp4") and recipe.quantization_phase == "all"
    if recipe.weight_dtype == "int8":  # load_int8: one memory-mapped tensor at a time, quantized on `device`
        tensor = max(p.numel() for p in shape.parameters()) * _DTYPE_BYTES[ckpt_dtype]  # fp32 if the config says nothing
        if files and spec.path and any(p.suffix == ".safetensors" for p in files):
            try:
                tensor = safetensors_largest_bytes(spec.path)
            except MemoryError:  # no room even to map the headers: the config's figure, and the room check says so
                notes.append("the files' headers could not be mapped (no memory left): tensor size from the config")
        from colab_memopt.techniques.int8train import CHUNK_ELEMENTS, int8_weight_bytes

        values = max(p.numel() for p in shape.parameters())
        chunk = 3 * 4 * min(CHUNK_ELEMENTS, values)  # quantize_int8's fp32 row chunk, its scaled copy, the rounded one
        dtype = torch.int8
        if dev.type == "cuda":
            host = tensor + LOAD_INT8_OVERHEAD_BYTES
            path = "cm.load_int8: one memory-mapped tensor at a time, quantized to int8 on the GPU"
        else:
            host = int8_weight_bytes(shape)[0] + tensor + chunk + LOAD_INT8_OVERHEAD_BYTES
            path = "cm.load_int8: the int8 model in host RAM, one memory-mapped tensor at a time"
        notes.append(f"largest tensor {format_bytes(tensor)} in {str(ckpt_dtype).removeprefix('torch.')}, read alone "
                     "from its shard (the file is closed before the next one)")
    elif dev.type == "cuda":
        host = largest
        path = "meta-device init, shards straight to the GPU (device_map)"
    else:
        host = params * _DTYPE_BYTES[dtype] + largest
        path = "meta-device init, the model in host RAM, one shard read at a time"
    classic = params * 4 + checkpoint
    return LoadPlan(spec.name, params, checkpoint, largest, str(ckpt_dtype).removeprefix("torch."),
                    str(dtype).removeprefix("torch."), str(dev), four_bit, host, classic, path, notes, layout, assumed)


@functools.lru_cache(maxsize=32)
def hub_shard_bytes(model_id: str) -> tuple[int, ...] | None:
    """Return the bytes of each safetensors shard of a Hugging Face id, from the hub's headers (nothing downloaded);
    None where the hub cannot be read (offline, gated, no safetensors). Asked once per id in a process: the
    recommender and fit_trainer plan the same model many times."""
    from colab_memopt.training.merge import _itemsize

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return None
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(model_id)
    except Exception:  # noqa: BLE001 - offline, gated, or no safetensors: the layout is assumed, and said so
        return None
    shards = tuple(sum(math.prod(t.shape) * _itemsize(t.dtype) for t in f.tensors.values())
                   for f in meta.files_metadata.values())
    return shards or None


# -- what from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) holds -----------------------

# The dtype each named architecture's published checkpoint is saved in (its config.json's torch_dtype on the hub):
# plans of a name read it where they have no files. gpt2's safetensors are fp32, the others bf16.
PUBLISHED_DTYPES = {"gpt2": "F32", "smollm2-135m": "BF16", "smollm2-360m": "BF16", "smollm2-1.7b": "BF16",
                    "qwen2.5-0.5b": "BF16", "qwen2.5-1.5b": "BF16", "llama-3.2-1b": "BF16", "llama-3.2-3b": "BF16",
                    "llama-3.1-8b": "BF16"}
# The built-in names' published checkpoints were written by save_pretrained in shards of at most its default
# max_shard_size then (5 GB); their files are not read here, so a plan of a name says this is assumed.
PUBLISHED_MAX_SHARD_BYTES = 5 * 10**9
# What a 4-bit load holds beside its tensors: the loader's bookkeeping, the allocator's rounding and the holes that
# freed transients leave between the quantized weights (measured: benchmarks/qlora_load.py).
QLORA_LOAD_OVERHEAD_BYTES = 32 * 2**20
# bitsandbytes' 4-bit blocks: one fp32 absmax per 64 values; double quantization (bnb_4bit_use_double_quant) keeps
# them as uint8 with one fp32 absmax per 256 blocks and a 256-entry fp32 code
BNB_4BIT_BLOCKSIZE = 64
# transformers' releases that materialize tensors in 4 threads while quantizing on the fly, so full-precision
# tensors pile up on the device ahead of the quantizer (huggingface/transformers#43032, #44387); 5.4.0 loads one
# tensor at a time when it quantizes (PR #44576)
ASYNC_QUANTIZED_LOAD = ("5.0.0", "5.4.0")


def checkpoint_layout(spec: ModelSpec, net: nn.Module, dtype: torch.dtype | None = None
                      ) -> tuple[list[tuple[str, str, tuple[int, ...]]], str]:
    """Return a checkpoint's tensors (name, safetensors dtype name, shape) and where they come from: the headers of
    the safetensors files (a local folder), the hub's headers of an id (read over the network, nothing downloaded),
    else the shapes of `net` (built from the config, tied weights once) in the config's dtype, the published one of a
    named architecture, or `dtype`; an assumption, and said so."""
    from colab_memopt.training.merge import ST_DTYPES, ST_NAMES, folder_tensors

    if spec.path:
        try:
            return folder_tensors(spec.path), f"the headers of the safetensors files in {spec.path}"
        except ValueError:
            pass
    note = ""
    if str(spec.source).startswith("Hugging Face config"):
        try:
            from huggingface_hub import get_safetensors_metadata

            meta = get_safetensors_metadata(spec.name)
            return ([(k, v.dtype, tuple(v.shape)) for f in meta.files_metadata.values() for k, v in f.tensors.items()],
                    f"the safetensors headers of {spec.name} on the hub")
        except Exception as exc:  # noqa: BLE001 - offline, gated, or no safetensors: the config's shapes
            note = f"; the hub's headers: {type(exc).__name__}"
    values = vars(spec.config) if spec.config is not None else {}  # not getattr: transformers 5 warns on torch_dtype
    value = values.get("dtype") or values.get("torch_dtype")
    value = getattr(torch, value, None) if isinstance(value, str) else value
    if isinstance(value, torch.dtype) and value in ST_NAMES:
        st = ST_NAMES[value]
        why = "as published" if PUBLISHED_DTYPES.get(spec.name) == st else "the config's dtype"  # built-in names carry it
    elif spec.name in PUBLISHED_DTYPES:
        st, why = PUBLISHED_DTYPES[spec.name], "as published"
    else:
        st, why = ST_NAMES[dtype or torch.float32], "the config names none"
    tensors = [(k, st, tuple(p.shape)) for k, p in net.named_parameters()]  # tied weights once, as save_pretrained
    return tensors, f"assumed: the config's shapes in {str(ST_DTYPES[st]).removeprefix('torch.')} ({why}){note}"


def _bnb_4bit_targets(net: nn.Module, skip_modules: list[str] | None) -> set[str]:
    """Return the weight names a bitsandbytes 4-bit load quantizes: what transformers' Bnb4BitHfQuantizer replaces
    (`replace_with_bnb_linear`: every nn.Linear or Conv1D but `get_keys_to_not_convert`'s output embedding, tied and
    last modules, or only `llm_int8_skip_modules` where given, and `_keep_in_fp32_modules`)."""
    try:
        with quiet():  # transformers' submodules import torchao, whose notes say nothing about this load
            from transformers.pytorch_utils import Conv1D
            from transformers.quantizers.base import get_keys_to_not_convert
            from transformers.quantizers.quantizers_utils import should_convert_module

        skip = list(get_keys_to_not_convert(net)) if skip_modules is None else list(skip_modules)
    except (ImportError, AttributeError):  # another transformers: the output embedding only
        Conv1D = ()  # type: ignore[assignment]
        head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
        skip = [n for n, m in net.named_modules() if m is head] if skip_modules is None else list(skip_modules)

        def should_convert_module(name: str, patterns: list[str]) -> bool:
            return not any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in patterns)
    skip += list(getattr(net, "_keep_in_fp32_modules", None) or [])
    return {f"{name}.weight" for name, m in net.named_modules()
            if (type(m) is nn.Linear or (Conv1D and isinstance(m, Conv1D))) and should_convert_module(name, skip)}


def bnb_4bit_bytes(numel: int, double_quant: bool = False) -> int:
    """Return the bytes a bitsandbytes 4-bit weight of `numel` values holds: two values a byte, and its absmax."""
    blocks = -(-numel // BNB_4BIT_BLOCKSIZE)
    absmax = blocks + -(-blocks // 256) * 4 + 256 * 4 if double_quant else blocks * 4
    return -(-numel // 2) + absmax


def _version_tuple(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


@dataclass
class QuantizedLoadPlan:
    """What `AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    device_map={"": device})` holds at its peak, from the checkpoint's tensors (bytes)."""

    model: str
    transformers_version: str
    device: str  # 'cuda' or 'cpu': where device_map puts the model
    checkpoint_dtype: str
    load_dtype: str  # the dtype tensors are materialized in before quantizing, and the kept weights' dtype
    checkpoint_bytes: int  # every tensor of the checkpoint: the pages the loader maps
    quantized_bytes: int  # the 4-bit weights with their absmax
    kept_bytes: int  # the weights left in `load_dtype` (embeddings, the head, norms)
    transient_bytes: int  # the most one tensor adds while it is materialized (and quantized) where the model goes
    transient_tensor: str
    device_bytes: int  # the GPU's allocated peak (0 for a load to the CPU)
    host_bytes: int  # the process's resident peak (VmHWM): the checkpoint pages it reads + what it allocates
    host_anon_bytes: int  # of which allocated (what cannot be dropped; the mapped pages the kernel can drop)
    spikes: bool  # whether this transformers piles up full-precision tensors on the device
    source: str  # where the checkpoint's tensors came from
    fix: str = ""  # the setting that avoids a spike, where there is one
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        fmt = format_bytes
        if self.device == "cuda":
            head = (f"4-bit load of {self.model} to the GPU: {fmt(self.device_bytes)} on the GPU at the peak, "
                    f"{fmt(self.host_anon_bytes)} of host RAM")
        else:
            head = (f"4-bit load of {self.model} to the CPU: {fmt(self.host_bytes)} of host RAM at the peak "
                    f"({fmt(self.host_anon_bytes)} allocated)")
        lines = [head]
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        lines += [f"  4-bit weights {fmt(self.quantized_bytes)}, kept in {self.load_dtype} {fmt(self.kept_bytes)}, "
                  f"+{fmt(self.transient_bytes)} for one tensor being loaded",
                  f"  the checkpoint's pages it reads ({fmt(self.host_bytes - self.host_anon_bytes)}) stay mapped "
                  "until the load ends:",
                  "  resident, but pages the kernel drops when memory runs short",
                  f"  transformers {self.transformers_version}; layout: {self.source}"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def quantized_load_bytes(model: Any, *, device: str = "cuda", dtype: torch.dtype | None = None,
                         double_quant: bool = False, skip_modules: list[str] | None = None,
                         transformers_version: str | None = None) -> QuantizedLoadPlan:
    """Return the host and device peak of loading `model` in 4 bits with transformers' bitsandbytes path.

    The installed transformers (5.23; the same from 5.4.0) opens every safetensors shard memory-mapped at the start
    and keeps them open until all weights are loaded (`modeling_utils.PreTrainedModel._load_pretrained_model`:
    `safe_open(file, ..., backend="mmap")` per file, closed after `convert_and_load_state_dict_in_model`). With
    on-the-fly quantization it loads one tensor at a time (`core_model_loading.convert_and_load_state_dict_in_model`:
    `has_on_the_fly_quantization` -> no thread pool): `_materialize_copy` slices the mapped tensor and moves it to
    the device in the load dtype (`tensor.to(device=..., dtype=...)`), then `integrations.bitsandbytes.
    Bnb4bitQuantize.convert` wraps it in a `Params4bit` and quantizes it there (`Params4bit.to(device)`), and the
    full-precision copy is dropped before the next tensor. So:

    - on the GPU: the 4-bit weights, the kept weights (embeddings, head, norms) in the load dtype, and one tensor in
      full precision being quantized; never a shard or the model (releases 5.0.0 to 5.3.x load in 4 threads and can
      pile up full-precision tensors there: `spikes`, and a note with the setting that avoids it);
    - on the host, to a GPU: the checkpoint's pages as they are read, mapped until the load ends (resident, so the
      process's RSS reaches the checkpoint's size, but file pages the kernel drops under pressure) and nothing
      allocated beyond the CUDA runtime's own memory;
    - on the host, to the CPU (`device_map={"": "cpu"}`, what this machine measures): the mapped pages, the 4-bit
      weights, the kept weights (mapped pages themselves when the load dtype is the checkpoint's, else copies), and
      one tensor's quantizing transients (bitsandbytes' default kernel: about 14 bytes a value in fp32 and int32
      temporaries), plus QLORA_LOAD_OVERHEAD_BYTES.

    Args:
        model: a folder with a safetensors checkpoint, a Hugging Face id, a config or one of our names (its tensors
            are read from the files' headers where there are files, else planned from the config and said so).
        device: 'cuda' (device_map={"": 0}) or 'cpu'.
        dtype: `from_pretrained(dtype=...)`: the dtype kept weights load in and quantized ones are materialized in;
            None for transformers' default ("auto": the config's dtype, the checkpoint's).
        double_quant: `BitsAndBytesConfig(bnb_4bit_use_double_quant=...)`.
        skip_modules: `BitsAndBytesConfig(llm_int8_skip_modules=...)`.
        transformers_version: plan another release's path (default: the installed one).

    Example:
        >>> print(cm.loading.quantized_load_bytes("meta-llama/Llama-3.1-8B", dtype=torch.float16))
    """
    from colab_memopt.training.merge import FLOAT_NAMES, ST_DTYPES, ST_NAMES, _itemsize

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    spec = resolve_model(model)
    with torch.device("meta"):
        net = spec.build()
    tensors, source = checkpoint_layout(spec, net, dtype)
    targets = _bnb_4bit_targets(net, skip_modules)
    floats = [st for _, st, _ in tensors if st in FLOAT_NAMES]
    ckpt = max(set(floats), key=floats.count) if floats else "F32"
    load = ST_NAMES[dtype] if dtype is not None else ckpt
    notes: list[str] = []
    missing = sorted(targets - {name for name, _, _ in tensors})
    if missing:
        notes.append(f"{len(missing)} layer(s) to quantize are not in the checkpoint under their names "
                     f"({missing[0]}, ...): planned as kept")
    checkpoint = mapped = quantized = kept = kept_anon = piled = 0
    transient = {"cuda": (0, ""), "cpu": (0, ""), "host": (0, "")}  # the GPU's; the CPU load's; the host's, to a GPU
    for name, st, shape in tensors:
        n = math.prod(shape)
        src = _itemsize(st)
        dst = _itemsize(load) if st in FLOAT_NAMES else src
        cast = st in FLOAT_NAMES and st != load  # torch casts a host-to-GPU copy on the host (copy_kernel_cuda)
        checkpoint += n * src
        if name in targets:
            quantized += bnb_4bit_bytes(n, double_quant)
            mapped += n * src  # read to quantize it
            piled += n * dst if cast else 0
            adds = {"cuda": n * dst, "cpu": 14 * n + (n * dst if cast else 0), "host": n * dst if cast else 0}
        else:
            kept += n * dst
            kept_anon += n * dst if cast else 0  # uncast, a kept weight stays the mapped page, not read yet
            mapped += n * src if cast else 0
            adds = {"cuda": 0, "cpu": 0, "host": n * dst if cast else 0}
        for key, value in adds.items():
            if value > transient[key][0]:
                transient[key] = (value, name)
    version = _version_tuple(transformers_version)
    threaded = _version_tuple(ASYNC_QUANTIZED_LOAD[0]) <= version < _version_tuple(ASYNC_QUANTIZED_LOAD[1])
    if version < _version_tuple(ASYNC_QUANTIZED_LOAD[0]):
        notes.append(f"transformers {transformers_version}'s 4.x loader is not read here: planned as 5.4's")
    fix = ""
    load_name = str(ST_DTYPES[load]).removeprefix("torch.")
    if device == "cuda":
        spikes = threaded
        full = sum(math.prod(s) * _itemsize(load if st in FLOAT_NAMES else st) for n_, st, s in tensors if n_ in targets)
        device_bytes = (kept + full) if spikes else (quantized + kept + transient["cuda"][0])
        (transient_bytes, tensor), anon = transient["cuda"], transient["host"][0] + QLORA_LOAD_OVERHEAD_BYTES
        mapped = checkpoint  # every tensor is read to be copied to the GPU
        notes.append("the CUDA runtime's own host memory is not counted")
    else:
        spikes = threaded and piled > 0  # threads read ahead: cast copies pile up (uncast ones are mapped pages)
        device_bytes = 0
        (transient_bytes, tensor) = transient["cpu"]
        anon = quantized + kept_anon + transient_bytes + (piled if spikes else 0) + QLORA_LOAD_OVERHEAD_BYTES
        notes.append("glibc keeps freed copies in its heap: cm.loading.limit_heap_retention() before loading")
    if spikes:
        fix = "os.environ['HF_DEACTIVATE_ASYNC_LOAD'] = '1' before from_pretrained, or transformers>=5.4"
        notes.append(f"transformers {transformers_version} reads 4 tensors ahead of the quantizer: up to "
                     f"the model in {load_name}")
    return QuantizedLoadPlan(spec.name, transformers_version, device, str(ST_DTYPES[ckpt]).removeprefix("torch."),
                             load_name, checkpoint, quantized, kept, transient_bytes, tensor, device_bytes,
                             mapped + anon, anon, spikes, source, fix, notes)


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


# -- load_int8: a checkpoint straight to int8 weights, one tensor at a time (notebook 16's 8B on a T4) -----------

# What load_int8 holds beside the tensor it reads: the model's module objects, the files' headers, the allocator's
# rounding. Measured about 6 MiB on the CPU for a 32-layer llama of 291 tensors (tests/test_load_int8.py), as many
# as Llama-3.1-8B has.
LOAD_INT8_OVERHEAD_BYTES = 16 * 2**20
# safetensors' dtype names load_int8 quantizes or keeps (16-bit and fp32 floats)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_folder(id_or_path: str | os.PathLike[str]) -> Path:
    """Return the local folder of a checkpoint: `id_or_path` itself, or a hub id's snapshot (config and
    safetensors files only, downloaded by `huggingface_hub.snapshot_download` or read from its cache)."""
    if isinstance(id_or_path, bytes) or not isinstance(id_or_path, (str, os.PathLike)):
        raise TypeError(f"id_or_path must be a folder or a Hugging Face id (a str or pathlib.Path), got "
                        f"{type(id_or_path).__name__} {id_or_path!r}")
    text = os.fspath(id_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            raise ValueError(f"{path} holds LoRA adapters (adapter_config.json), not a model: load its base model, then "
                             "the adapters (load_model(base, recipe, adapter=folder), or peft's "
                             "PeftModel.from_pretrained(base, folder))")
        if not (path / "config.json").is_file():
            found = sorted(p.name for p in path.iterdir())
            raise ValueError(f"{path} has no config.json (found {found[:5]}): give the folder save_pretrained wrote, "
                             "with its config.json beside the weights")
        return path
    if text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/")):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
    raise ValueError(f"{text!r} is neither a local folder nor a Hugging Face id ('org/name'): give the folder that "
                     "save_pretrained wrote, or the model's id")


def safetensors_map(folder: str | Path) -> dict[str, Path]:
    """Return {tensor name: its file} of a safetensors checkpoint: `model.safetensors.index.json`'s weight_map
    for sharded ones, else the one `model.safetensors`. Raises ValueError naming what is missing."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        from colab_memopt.core.fileio import read_json

        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map': not a sharded checkpoint's index (a truncated download?)")
        out = {str(k): folder / str(v) for k, v in weight_map.items()}
        missing = sorted({f.name for f in out.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{index} names shard(s) {missing[:4]} that are not in {folder} (a partial download?)")
        return out
    single = folder / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    found = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    raise ValueError(f"{folder} holds no model.safetensors or model.safetensors.index.json"
                     + (f" (found {found[:4]}: load_int8 reads safetensors only; save_pretrained writes them)" if found else ""))


def safetensors_largest_bytes(folder: str | Path) -> int:
    """Return the bytes of a safetensors checkpoint's largest tensor, read from the files' headers only."""
    largest = 0
    for file in sorted(set(safetensors_map(folder).values())):
        with open_safetensors(file) as f:
            for key in f.keys():
                sl = f.get_slice(key)
                numel = math.prod(sl.get_shape())
                largest = max(largest, numel * _DTYPE_BYTES.get(SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.float32), 4))
    return largest


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        name = ctypes.util.find_library("c")
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:  # not glibc: nothing to hand back this way
        return None


def release_freed_host_memory() -> None:
    """Hand freed heap memory back to the system (glibc's `malloc_trim`; nothing elsewhere).

    glibc keeps freed blocks resident between live ones: quantizing tensor after tensor on the CPU left the
    fp32 transients' holes between the int8 weights, about 1 GB more RSS than the int8 model at 1B parameters."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def limit_heap_retention(threshold_bytes: int = 128 * 1024) -> bool:
    """Make glibc hand every freed block of `threshold_bytes` or more back to the system at once (`mallopt`'s
    M_MMAP_THRESHOLD, fixed); return whether it took effect (glibc only). Process-wide, for the process's life.

    glibc raises that threshold to the size of each large block freed (up to 32 MiB), so later blocks come from the
    heap and, once freed, stay there between the blocks that live on: a 4-bit `from_pretrained` to the CPU keeps
    the freed full-precision copies between its 4-bit weights (benchmarks/qlora_load.py measures how much). Call it
    before such a load; it costs an mmap per large allocation."""
    trim = _malloc_trim()  # glibc is there
    if trim is None:
        return False
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    return bool(ctypes.CDLL(ctypes.util.find_library("c")).mallopt(m_mmap_threshold, int(threshold_bytes)))


def _read_tensor(file: Path, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Return one tensor of a safetensors file, checked: its name, shape and dtype; memory-mapped (the caller
    copies it and drops it: the file is open only as long as the tensor lives, so the host holds one tensor)."""
    with open_safetensors(file) as f:
        if key not in f.keys():
            raise ValueError(f"{file.name} has no tensor {key!r}, though the checkpoint's index names it there")
        sl = f.get_slice(key)
        dtype, got = sl.get_dtype(), tuple(sl.get_shape())
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file.name}: tensor {key!r} is {dtype}; load_int8 reads {sorted(SAFETENSORS_DTYPES)} "
                             "(a checkpoint quantized already? load it with from_pretrained)")
        if got != shape:
            raise ValueError(f"{file.name}: tensor {key!r} has shape {got}, the model's config needs {shape} "
                             "(a config.json from another model?)")
        return f.get_tensor(key)


def load_int8(id_or_path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "auto",
              group_size: int | None = None) -> nn.Module:
    """Load a causal LM's safetensors checkpoint as int8 weights, tensor by tensor, within little host RAM.

    The model is built on the meta device from the config (no memory), its Linear and Embedding layers
    replaced by int8 ones (`int8train.quantize_model_int8`), then each weight is read from the
    memory-mapped shards one tensor at a time, moved to `device` and quantized there; the file is
    closed before the next tensor, so the host holds about one tensor (an 8B model's largest, its
    embedding, is 1.05 GB in bf16), never a shard or the model. The result is what
    `Recipe(weight_dtype='int8', precision=...).build` trains (it keeps the loaded int8 weights).
    Your files are only read. Measured on a 2-core CPU (benchmarks/int8_load.py): a random Llama-3.2-1B
    in bf16 (2.47 GB, 5 shards) loaded with 1.41 GB of added host RAM at peak, 1.27 GB of it the int8
    model itself; from_pretrained and then quantizing took 3.90 GB.

    Args:
        id_or_path: a folder written by `save_pretrained` (config.json and safetensors files), or a
            Hugging Face id (its config and safetensors files are downloaded first).
        dtype: the 16-bit dtype the int8 weights are dequantized to and the norms are kept in
            (default: fp16 on a GPU without native bf16, like a T4; bf16 elsewhere).
        device: 'auto' (CUDA if present), 'cpu' or 'cuda'.
        group_size: values of a row per fp32 scale (default `int8train.GROUP_SIZE`, 128).

    Raises:
        ValueError: no safetensors checkpoint, a tensor missing, of another shape than the config
            says, or of a dtype other than fp32, fp16 or bf16 (each named with its file).

    Example:
        >>> model = cm.load_int8("meta-llama/Llama-3.1-8B", dtype=torch.float16)
        >>> model, opt = cm.Recipe(weight_dtype="int8", optimizer="adalomo", precision="fp16").build(model)
    """
    import warnings

    import transformers
    from accelerate import init_empty_weights

    from colab_memopt.techniques.int8train import GROUP_SIZE, Int8Embedding, Int8Linear, quantize_int8, quantize_model_int8

    dev = pick_device(device)
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" and not bf16_native(dev) else torch.bfloat16
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (what int8 weights dequantize to), got {dtype!r}")
    group_size = GROUP_SIZE if group_size is None else group_size
    folder = checkpoint_folder(id_or_path)
    config = transformers.AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) computed
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # under init_empty_weights from_config leaves a tied head untied
    from colab_memopt.techniques.int8train import int8_weight_bytes

    int8_bytes, largest_values = int8_weight_bytes(model, group_size)
    tensor_bytes = largest_values * _DTYPE_BYTES[_checkpoint_dtype(config)]  # before any file is mapped
    check_host_room(folder.name, dev, tensor_bytes + LOAD_INT8_OVERHEAD_BYTES + (int8_bytes if dev.type == "cpu" else 0))
    files = safetensors_map(folder)
    quantize_model_int8(model, group_size=group_size, compute_dtype=dtype)  # on meta: the layout only
    _untie_where_the_checkpoint_differs(model, files, folder)
    int8_by_key: dict[str, Any] = {}  # checkpoint key -> the int8 weight its layer holds
    users: dict[int, list[nn.Module]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (Int8Linear, Int8Embedding)):
            int8_by_key[f"{name}.weight" if name else "weight"] = m.shared
            users.setdefault(id(m.shared), []).append(m)
    int8_params = {id(w.qweight) for w in int8_by_key.values()} | {id(w.scale) for w in int8_by_key.values()}
    float_by_key: dict[str, nn.Parameter] = {}
    slots: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter -> every (module, attribute) holding it
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in int8_params:
            continue
        float_by_key[name] = p
        mod_name, _, attr = name.rpartition(".")
        slots.setdefault(id(p), []).append((model.get_submodule(mod_name), attr))
    filled: set[int] = set()
    with torch.no_grad():
        for key, file in files.items():
            if key in int8_by_key:
                shared = int8_by_key[key]
                if id(shared) in filled:
                    continue
                t = _read_tensor(file, key, tuple(shared.qweight.shape))
                q, scale = quantize_int8(t.to(dev), group_size)  # (out, in) int8, (out, in / group) fp32
                del t
                shared.qweight = nn.Parameter(q, requires_grad=False)
                shared.scale = nn.Parameter(scale, requires_grad=False)
                for m in users[id(shared)]:
                    m.qweight, m.scale = shared.qweight, shared.scale
                filled.add(id(shared))
                if dev.type == "cpu":  # the int8 weights accumulate here: do not let the transients' holes stay
                    release_freed_host_memory()
            elif key in float_by_key:
                p = float_by_key[key]
                if id(p) in filled:
                    continue
                t = _read_tensor(file, key, tuple(p.shape))
                new = nn.Parameter(t.to(dev, dtype, copy=True), requires_grad=p.requires_grad)  # a copy: the file closes
                del t
                for m, attr in slots[id(p)]:
                    m._parameters[attr] = new
                filled.add(id(p))
    missing = sorted([k for k, w in int8_by_key.items() if id(w) not in filled]
                     + [k for k, p in float_by_key.items() if id(p) not in filled])
    if missing:
        raise ValueError(f"the checkpoint in {folder} has no tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + ", which the model's config needs: a partial download, or a config.json from another model?")
    unused = sorted(set(files) - set(int8_by_key) - set(float_by_key))
    if unused:
        warnings.warn(f"load_int8 left {len(unused)} tensor(s) of the checkpoint unread, which the model does not have: "
                      f"{unused[:4]}", stacklevel=2)
    model.to(dev)  # the buffers; the weights are there already
    model.eval()
    return model


def _same_values(a: tuple[Path, str], b: tuple[Path, str]) -> bool:
    """Return whether two checkpoint tensors hold the same values, compared a slice of rows at a time (the host holds
    two slices, never two whole tensors)."""
    with open_safetensors(a[0]) as fa, open_safetensors(b[0]) as fb:
        sa, sb = fa.get_slice(a[1]), fb.get_slice(b[1])
        if sa.get_shape() != sb.get_shape() or sa.get_dtype() != sb.get_dtype():
            return False
        rows = sa.get_shape()[0] if sa.get_shape() else 1
        step = max(1, (1 << 22) // max(1, math.prod(sa.get_shape()[1:])))
        for start in range(0, rows, step):
            if not torch.equal(sa[start:start + step], sb[start:start + step]):
                return False
    return True


def _untie_where_the_checkpoint_differs(model: nn.Module, files: dict[str, Path], folder: Path) -> None:
    """Give a tied head its own int8 weight where the checkpoint holds both it and the embedding with different
    values, as `from_pretrained` does (it warns and does not tie them); warn naming the config field."""
    import warnings

    from colab_memopt.techniques.int8train import Int8Embedding, Int8Linear, _Int8Weight

    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (Int8Linear, Int8Embedding)):
            holders.setdefault(id(m.shared), []).append((f"{name}.weight" if name else "weight", m))
    for group in holders.values():
        keys = [k for k, _ in group if k in files]
        if len(group) < 2 or len(keys) < 2 or all(_same_values((files[keys[0]], keys[0]), (files[k], k)) for k in keys[1:]):
            continue
        first = group[0][1].shared
        for key, m in group[1:]:
            if key not in files:
                continue
            q, scale = first.qweight, first.scale
            own = _Int8Weight(nn.Parameter(torch.empty_like(q), requires_grad=False),
                              nn.Parameter(torch.empty_like(scale), requires_grad=False), first.dtype)
            own.uses, first.uses = 1, first.uses - 1
            m._register(own)
        if hasattr(model.config, "tie_word_embeddings"):
            model.config.tie_word_embeddings = False
        warnings.warn(f"{folder / 'config.json'} ties {keys[1:]} to {keys[0]}, but the checkpoint holds both with "
                      "different values: they are loaded apart, as from_pretrained does (set tie_word_embeddings to "
                      "false in config.json to say so)", UserWarning, stacklevel=3)


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
