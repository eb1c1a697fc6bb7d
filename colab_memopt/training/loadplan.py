"""What loading a model needs, planned before anything is loaded: the dtype it loads in, the host RAM each
loading path takes (`load_host_bytes`), a checkpoint's tensors (`checkpoint_layout`) and what transformers' own
4-bit `from_pretrained` holds on the GPU and the host (`quantized_load_bytes`).

Colab's free tier has 12.7 GB of host RAM for a 14.56 GiB T4: the classic way to load a model
(random fp32 weights, then the whole state dict beside them, then `.to("cuda")`) needs 4 bytes per
parameter plus the checkpoint in host RAM, and a 3B model's load runs out of host RAM: Colab kills
and restarts the runtime before training starts, with no Python error that names memory. The plan and
the doctor read these figures; benchmarks/qlora_load.py and benchmarks/int8_load.py measure them on the CPU.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.architectures import ARCHITECTURES, ModelSpec, resolve_model
from colab_memopt.core.measure import format_bytes
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import quiet

from colab_memopt.training.checkpoints import (_DTYPE_BYTES, _weight_files, safetensors_largest_bytes)

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
        from colab_memopt.techniques.int8train import int8_weight_bytes, quantize_int8_transient_bytes

        # quantize_int8's transient beyond the tensor and its int8 output (one fp32 row chunk and its per-group min and
        # max), the most of any weight's
        chunk = max(quantize_int8_transient_bytes(p.shape[0], p.numel() // max(1, p.shape[0]))
                    for p in shape.parameters() if p.dim() == 2)
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
        dtype: `from_pretrained(dtype=...)`: the dtype kept weights load in and quantized ones are materialized in
            (a torch dtype or its name: 'float16'); None for transformers' default ("auto": the config's dtype, the checkpoint's).
        double_quant: `BitsAndBytesConfig(bnb_4bit_use_double_quant=...)`.
        skip_modules: `BitsAndBytesConfig(llm_int8_skip_modules=...)`.
        transformers_version: plan another release's path (default: the installed one).

    Example:
        >>> print(cm.loading.quantized_load_bytes("meta-llama/Llama-3.1-8B", dtype=torch.float16))
    """
    from colab_memopt.training.merge import FLOAT_NAMES, ST_DTYPES, ST_NAMES, _itemsize

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    from colab_memopt.training.merge import DTYPE_NAMES

    if isinstance(dtype, str) and dtype in DTYPE_NAMES:  # a name, as from_pretrained and model_init_kwargs take it
        dtype = DTYPE_NAMES[dtype]
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


# What load_int8 holds beside the tensor it reads: the model's module objects, the files' headers, the allocator's
# rounding. Measured about 6 MiB on the CPU for a 32-layer llama of 291 tensors (tests/test_load_int8.py), as many
# as Llama-3.1-8B has.
LOAD_INT8_OVERHEAD_BYTES = 16 * 2**20
