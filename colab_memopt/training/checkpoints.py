"""A checkpoint's files, read safely: which weight files a folder holds, whether they can be read, the host RAM
left to read them, and one tensor at a time from memory-mapped safetensors.

`load_model`, `load_int8`, `merge_adapter` and the plans of a load (`loadplan`) read checkpoints through these:
a truncated or corrupt download is named with its file, and a file that cannot be mapped for want of memory is
a MemoryError, not a corrupt file. `release_freed_host_memory` and `limit_heap_retention` hand freed heap memory
back to the system (glibc), which tensor-by-tensor loads on the CPU need.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import Any

import torch

from colab_memopt.techniques.architectures import ModelSpec
from colab_memopt.core.measure import format_bytes
from colab_memopt.core.modelref import is_hub_id

# The weight files transformers loads (the merge skips more formats: merge.ANY_WEIGHT_SUFFIXES)
LOADED_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
# safetensors' dtype names load_int8 quantizes or keeps (16-bit and fp32 floats)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _weight_files(folder: str | None) -> list[Path]:
    """Return a folder's weight files; a sharded checkpoint's index must find every shard it names."""
    if folder is None:
        return []
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in LOADED_WEIGHT_SUFFIXES and p.is_file())
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
    if is_hub_id(text):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
    raise ValueError(f"{text!r} is neither a local folder nor a Hugging Face id ('org/name'): give the folder that "
                     "save_pretrained wrote, or the model's id")


def safetensors_index(folder: str | Path) -> dict[str, str] | None:
    """Return a sharded safetensors checkpoint's weight_map ({tensor name: shard file name}) from its
    `model.safetensors.index.json`, checked: the index has one and every shard it names is in the folder; None
    where the folder has no index (one `model.safetensors`, or no safetensors)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    from colab_memopt.core.fileio import read_json

    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map': not a sharded checkpoint's index (a truncated download?)")
    weight_map = {str(k): str(v) for k, v in weight_map.items()}
    missing = sorted({v for v in weight_map.values() if not (folder / v).is_file()})
    if missing:
        raise ValueError(f"{index} names shard(s) {missing[:4]} that are not in {folder} (a partial download?)")
    return weight_map


def no_safetensors(folder: Path, reader: str, suffixes: tuple[str, ...] = LOADED_WEIGHT_SUFFIXES) -> ValueError:
    """Return the error for a folder without a safetensors checkpoint, naming the weight files it has instead."""
    found = sorted(p.name for p in folder.iterdir() if p.suffix in suffixes) if folder.is_dir() else []
    return ValueError(f"{folder} holds no model.safetensors or model.safetensors.index.json"
                      + (f" (found {found[:4]}: {reader} reads safetensors checkpoints; save_pretrained writes them)"
                         if found else ""))


def safetensors_map(folder: str | Path) -> dict[str, Path]:
    """Return {tensor name: its file} of a safetensors checkpoint: `model.safetensors.index.json`'s weight_map
    for sharded ones, else the one `model.safetensors`. Raises ValueError naming what is missing."""
    folder = Path(folder)
    weight_map = safetensors_index(folder)
    if weight_map is not None:
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    raise no_safetensors(folder, "load_int8")


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
