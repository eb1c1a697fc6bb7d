"""`load_int8`: a checkpoint straight to int8 weights, one tensor at a time (notebook 16's 8B on a T4).

An 8B checkpoint is 16 GB in bf16, more than Colab's RAM and a T4; `load_int8` reads one memory-mapped tensor
at a time and quantizes it on the device, so the host holds about one tensor (1 GB at 8B), never a shard.
`loadplan.load_host_bytes` plans what it holds (`LOAD_INT8_OVERHEAD_BYTES` beside the tensor).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.core.env import bf16_native, pick_device

from colab_memopt.training.checkpoints import (_DTYPE_BYTES, _read_tensor, check_host_room, checkpoint_folder,
                                               open_safetensors, release_freed_host_memory, safetensors_map)
from colab_memopt.training.loadplan import LOAD_INT8_OVERHEAD_BYTES, _checkpoint_dtype


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
    try:
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) computed
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (MemoryError, RuntimeError) as exc:
        # the rotary tables are the load's first allocations: with almost no host RAM left they fail first (probe 4:
        # torch's "can't allocate memory" from transformers, before the room check below could say so)
        if isinstance(exc, RuntimeError) and "can't allocate memory" not in str(exc):
            raise
        check_host_room(folder.name, dev, LOAD_INT8_OVERHEAD_BYTES)  # says how much is left, where that is the cause
        raise
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
