"""Merge a LoRA adapter into its base one tensor at a time, writing each merged shard as it goes.

    import colab_memopt as cm
    cm.merge_adapter("meta-llama/Llama-3.1-8B-Instruct", "out/adapter", "out/merged")  # then from_pretrained("out/merged")

peft's `merge_and_unload()` needs the whole base in 16-bit in memory: 15 GiB for an 8B model, more than Colab's
12.7 GB of host RAM and a T4. A merge is a sum per weight, W + B @ A * scaling, so it needs no model at all:
`merge_adapter` reads the base's safetensors shards from disk one tensor at a time (memory-mapped, through
safetensors' `safe_open`), adds the adapter's update where the adapter has one, and streams each merged tensor into
the merged shard's file, so the host holds about the adapter, one adapted weight with its fp32 update, and a slice
of one other tensor, never a shard or the model. Each shard is written to a temporary file and renamed when it is
whole (`core.fileio.atomic_write`), and config.json is written last: a merge that is killed leaves no half-written
shard under its final name and no folder that `from_pretrained` takes for a whole model.

The update is peft's own (`peft.tuners.lora.layer.Linear.get_delta_weight` and `.merge`): `B @ A` in fp32, times
`lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`, per module with `rank_pattern` / `alpha_pattern`),
transposed for `fan_in_fan_out` (GPT-2's Conv1D), added to the weight in fp32 and rounded once to the weight's
dtype (`merge_and_unload()`'s default, `safe_merge=False`); embeddings' `lora_embedding_A/B` (whose update peft rounds
to the weight's dtype before adding it), `lora_bias` and `modules_to_save` copies are merged as peft does. DoRA
and the other LoRA variants are refused by name. `merge_bytes` plans the host RAM it takes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colab_memopt.core.fileio import atomic_write, atomic_write_text, read_json
from colab_memopt.core.modelref import is_hub_id

# safetensors' dtype names and the torch dtypes they hold (the ones a checkpoint of a causal LM uses)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
FLOAT_NAMES = ("F64", "F32", "F16", "BF16")
MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "fp32": torch.float32}
# A tensor that takes no update is copied in slices of at most this many bytes (an 8B model's 1 GB embedding too).
SLICE_BYTES = 64 * 2**20
# What the merge holds beside its tensors: headers, the module-free bookkeeping, the allocator's rounding.
MERGE_OVERHEAD_BYTES = 16 * 2**20
# Weight files of any format in a checkpoint folder (not copied: the merged shards replace them); the loaders read
# only checkpoints.LOADED_WEIGHT_SUFFIXES
ANY_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
# Tokenizer files the adapter's folder may hold (TRL saves the tokenizer it trained with beside the adapter)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# adapter_config.json fields that do not change what merging computes (peft 0.13 to 0.21); any other field set to
# a value is a LoRA variant (DoRA, aLoRA, ...) that this merge refuses by name.
_PLAIN_LORA_FIELDS = frozenset({
    "alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "corda_config", "ensure_weight_tying",
    "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode", "init_lora_weights", "layers_pattern",
    "layers_to_transform", "loftq_config", "lora_alpha", "lora_bias", "lora_dropout", "lora_ga_config",
    "megatron_config", "megatron_core", "modules_to_save", "peft_type", "peft_version", "qalora_group_size", "r",
    "rank_pattern", "revision", "target_modules", "task_type", "use_rslora"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: name, dtype name ('BF16'), shape, byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # bytes from the start of the data
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """Return a safetensors file's tensors (in the order of their bytes) and its metadata, from the header only."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= path.stat().st_size - 8:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None) or {}
        entries = sorted((TensorEntry(str(k), str(v["dtype"]), tuple(int(d) for d in v["shape"]),
                                      int(v["data_offsets"][0]), int(v["data_offsets"][1]))
                          for k, v in header.items()), key=lambda e: (e.begin, e.end))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file (a truncated or corrupt download?): "
                         f"{' '.join(str(exc).split())[:200]}") from None
    return entries, {str(k): str(v) for k, v in metadata.items()}


def shard_files(folder: str | Path) -> list[Path]:
    """Return a safetensors checkpoint's shard files, sorted by name (or its one file)."""
    from colab_memopt.training.checkpoints import no_safetensors, safetensors_index

    folder = Path(folder)
    weight_map = safetensors_index(folder)
    if weight_map is not None:
        return [folder / n for n in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise no_safetensors(folder, "the merge", ANY_WEIGHT_SUFFIXES)


def base_folder(base: str | os.PathLike[str]) -> Path:
    """Return the local folder of a base model: `base` itself, or a hub id's snapshot (its config, tokenizer and the
    safetensors shards its index names, by `huggingface_hub.snapshot_download`; no other weight files)."""
    text = os.fspath(base)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(text):
        raise ValueError(f"base {text!r} is neither a local folder nor a Hugging Face id ('org/name'): give the "
                         "folder save_pretrained wrote, or the model's id")
    import huggingface_hub

    try:  # the index names the shards: a repository may hold other weight files (consolidated.safetensors)
        index = huggingface_hub.hf_hub_download(text, "model.safetensors.index.json")
        shards = sorted(set(map(str, read_json(index)["weight_map"].values())))
        weights = ["model.safetensors.index.json", *shards]
    except huggingface_hub.errors.EntryNotFoundError:
        weights = ["model.safetensors"]
    patterns = ["config.json", "generation_config.json", *TOKENIZER_FILES, *weights]
    return Path(huggingface_hub.snapshot_download(text, allow_patterns=patterns))


# -- the adapter -----------------------------------------------------------------------------------------------------

@dataclass
class Update:
    """One base weight's LoRA update: delta = B @ A * scaling (transposed where `transpose`)."""

    module: str
    a: torch.Tensor  # (r, in), or lora_embedding_A (r, num_embeddings)
    b: torch.Tensor  # (out, r), or lora_embedding_B (dim, r)
    scaling: float
    transpose: bool  # fan_in_fan_out (Conv1D) and embeddings: the weight is (in, out)
    bias: torch.Tensor | None = None  # lora_bias: lora_B's bias, added times scaling to the base's bias
    keys: tuple[str, ...] = ()  # the adapter's keys, for messages
    round_first: bool = False  # embeddings: peft rounds the update to the weight's dtype before adding it

    def delta(self) -> torch.Tensor:
        """Return the update in fp32, shaped like the base weight (peft's `get_delta_weight` on the CPU)."""
        out = self.b.float() @ self.a.float()  # (out, in) fp32
        if self.transpose:
            out = out.T  # a view: the result is made contiguous when it is rounded to the weight's dtype
        return out.mul_(self.scaling)


@dataclass
class Adapter:
    """A peft LoRA adapter read from its folder: the updates by base weight name, and whole tensors that replace a
    base tensor (`modules_to_save`, a trained bias)."""

    folder: Path
    config: dict[str, Any]
    updates: dict[str, Update]  # base key ('model.layers.0.self_attn.q_proj.weight') -> update
    replacements: dict[str, torch.Tensor]  # base key -> the adapter's copy
    nbytes: int  # the adapter's tensors as read


def _lora_variant(config: Mapping[str, Any]) -> str | None:
    if config.get("use_dora"):
        return "DoRA (use_dora=True)"
    for key, value in sorted(config.items()):
        if key not in _PLAIN_LORA_FIELDS and key != "use_dora" and value not in (None, False, {}, [], ""):
            return f"{key}={value!r}"
    return None


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """Return peft's per-module rank or alpha: the first pattern key that matches the module's name's end."""
    if not patterns:
        return default
    from colab_memopt.core.console import quiet

    with quiet():  # imported only here: peft imports transformers (seconds) and torchao, whose notes say nothing
        from peft.utils.other import get_pattern_key

    key = get_pattern_key(list(patterns), module)
    return patterns.get(key, default)


def read_adapter(adapter_dir: str | os.PathLike[str]) -> Adapter:
    """Read a peft LoRA adapter folder (adapter_config.json and adapter_model.safetensors, or .bin).

    Raises ValueError naming what cannot be merged: another PEFT method, DoRA or another LoRA variant, a rank the
    tensors do not have, an A without its B."""
    folder = Path(os.fspath(adapter_dir)).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} holds no adapter_config.json: give the folder that peft's save_pretrained "
                         "(or the Trainer's save_model) wrote for the adapter")
    config = read_json(config_file)
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{config_file}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}; "
                         "merge_adapter merges LoRA adapters (peft_type 'LORA')")
    variant = _lora_variant(config)
    if variant is not None:
        raise ValueError(f"{config_file}: {variant} is a LoRA variant merge_adapter does not merge: merge it with "
                         "peft's merge_and_unload() on a machine with room for the 16-bit model")
    weights = folder / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (folder / "adapter_model.bin").is_file():
        state = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} holds no adapter_model.safetensors (or adapter_model.bin)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_file}: r must be an int >= 1 and lora_alpha a number, got r={r!r}, "
                         f"lora_alpha={alpha!r}")
    rslora, fan_in_fan_out = bool(config.get("use_rslora")), bool(config.get("fan_in_fan_out"))
    parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    replacements: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A.weight", "lora_B.weight", "lora_B.bias", "lora_embedding_A", "lora_embedding_B"):
            if name.endswith("." + part):
                parts.setdefault(name[: -len(part) - 1], {})[part] = (key, t)
                break
        else:
            if "lora_" in name:
                raise ValueError(f"{weights.name}: {key!r} is no LoRA A or B (a DoRA magnitude or another variant?): "
                                 "merge_adapter merges plain LoRA")
            replacements[name.replace(".base_layer.", ".").replace(".modules_to_save.", ".")] = t
    updates = {}
    for module, found in sorted(parts.items()):
        embedding = "lora_embedding_A" in found or "lora_embedding_B" in found
        a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
        if a_key not in found or b_key not in found:
            have = [k for k, _ in found.values()]
            raise ValueError(f"{weights.name}: {have[0]!r} has no {(b_key if a_key in found else a_key)!r} beside it: "
                             "an incomplete adapter")
        (ka, a), (kb, b) = found[a_key], found[b_key]
        rank = _pattern_value(config.get("rank_pattern") or {}, module, r)
        mod_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{weights.name}: {ka!r} {tuple(a.shape)} and {kb!r} {tuple(b.shape)} are not a rank-{rank} "
                             f"pair (adapter_config.json's r and rank_pattern say {rank})")
        scaling = mod_alpha / math.sqrt(rank) if rslora else mod_alpha / rank
        bias = found["lora_B.bias"][1] if "lora_B.bias" in found else None
        keys = tuple(k for k, _ in found.values())
        updates[f"{module}.weight"] = Update(module, a, b, float(scaling), embedding or fan_in_fan_out, bias, keys,
                                             round_first=embedding)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return Adapter(folder, config, updates, replacements, nbytes)


# -- the merge -------------------------------------------------------------------------------------------------------

@dataclass
class MergeResult:
    """What `merge_adapter` wrote: the merged folder and its figures."""

    out_dir: Path
    shards: int
    updated: int  # base weights that took a LoRA update
    replaced: int  # base tensors the adapter's copies replaced (modules_to_save)
    dtype: str  # the merged floating-point weights' dtype(s): 'float16', or 'bfloat16 and float32' where kept
    written_bytes: int  # the merged shards' tensor bytes
    seconds: float
    notes: list[str] = field(default_factory=list)
    base_dir: Path | None = None  # the folder the base's shards were read from (a hub id's download cache)

    def __str__(self) -> str:
        from colab_memopt.core.measure import format_bytes

        lines = [f"merged {self.updated} LoRA updates into {self.shards} shard(s): "
                 f"{format_bytes(self.written_bytes)} of {self.dtype} weights in {self.seconds:.1f} s",
                 f"  {self.out_dir}",
                 "  load it with AutoModelForCausalLM.from_pretrained(<that folder>)"]
        if self.replaced:
            lines.insert(1, f"  {self.replaced} tensor(s) replaced by the adapter's trained copies (modules_to_save)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _merge_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be None (keep the base's), 'float16', 'bfloat16' or 'float32', got {dtype!r}")
        return DTYPE_NAMES[dtype]
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"dtype must be None (keep the base's), torch.float16, torch.bfloat16 or torch.float32, "
                         f"got {dtype!r}")
    return dtype


def _out_name(entry: TensorEntry, dtype: torch.dtype | None) -> str:
    return ST_NAMES[dtype] if dtype is not None and entry.dtype in FLOAT_NAMES else entry.dtype


def _itemsize(name: str) -> int:
    return torch.empty((), dtype=ST_DTYPES[name]).element_size() if name in ST_DTYPES else 1


def _check_base(folder: Path, layout: dict[Path, list[TensorEntry]], adapter: Adapter) -> None:
    """Refuse a quantized base and an adapter whose modules or shapes the base does not have, naming the key."""
    config_file = folder / "config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(f"{config_file} has a quantization_config ({method}): the base is quantized. Merge into the "
                         "16-bit base the adapter was trained on: give its id or its folder")
    by_name = {e.name: e for entries in layout.values() for e in entries}
    for entry in by_name.values():
        if entry.name.endswith((".absmax", ".quant_map", ".SCB", ".weight_format")) or ".quant_state." in entry.name:
            raise ValueError(f"the base holds {entry.name!r}, a quantization state: the base is quantized. Merge into "
                             "the 16-bit base: give its id or its folder")
    for key, update in adapter.updates.items():
        entry = by_name.get(key)
        if entry is None:
            tied = " (a head tied to the embedding is saved once, as the embedding)" if "lm_head" in key else ""
            raise ValueError(f"the adapter adapts {update.module!r} ({update.keys[0]!r}), but the base checkpoint has "
                             f"no tensor {key!r}{tied}: is this the adapter of another model?")
        if entry.dtype not in FLOAT_NAMES:
            raise ValueError(f"the base's {key!r} is {entry.dtype}, not a 16- or 32-bit float: the base is quantized. "
                             "Merge into the 16-bit base: give its id or its folder")
        a_in, b_out = update.a.shape[1], update.b.shape[0]
        want = (a_in, b_out) if update.transpose else (b_out, a_in)
        if entry.shape != want:
            raise ValueError(f"the adapter's {update.keys[0]!r} and {update.keys[1]!r} make a {want} update, the base's "
                             f"{key!r} is {entry.shape}: is this the adapter of another model?")
        if update.bias is not None:
            bias = by_name.get(f"{update.module}.bias")
            if bias is None or bias.shape != (b_out,):
                raise ValueError(f"the adapter has a lora_bias for {update.module!r} but the base's "
                                 f"{update.module + '.bias'!r} is {'missing' if bias is None else bias.shape}")
    for key, t in adapter.replacements.items():
        entry = by_name.get(key)
        if entry is None:
            raise ValueError(f"the adapter holds {key!r} (modules_to_save or a trained bias), which the base checkpoint "
                             "does not have: is this the adapter of another model?")
        if entry.shape != tuple(t.shape):
            raise ValueError(f"the adapter's copy of {key!r} is {tuple(t.shape)}, the base's {entry.shape} (a resized "
                             "vocabulary?): merge it with peft's merge_and_unload()")


def _slices(entry: TensorEntry, limit: int) -> Iterable[slice | None]:
    """Yield row ranges of at most `limit` bytes (None: the whole tensor, for 0-d and 1-d tensors)."""
    if len(entry.shape) < 2 or entry.end - entry.begin <= limit:
        yield None
        return
    rows = entry.shape[0]
    step = max(1, limit // max(1, (entry.end - entry.begin) // rows))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _write_bytes(f: Any, t: torch.Tensor) -> None:
    if t.numel():
        f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _merged_tensor(source: Path, entry: TensorEntry, dtype: torch.dtype | None, update: Update | None,
                   replacement: torch.Tensor | None, bias_of: Update | None) -> torch.Tensor:
    """Return one merged tensor whole: the weight (the adapter's copy where it saved one: `modules_to_save`, an
    embedding it adapts) plus its update, or a bias plus its lora_bias."""
    from safetensors import safe_open

    target = ST_DTYPES[_out_name(entry, dtype)]
    if replacement is not None:
        w = replacement  # peft loads the adapter's copy into the base's module
    else:
        with safe_open(str(source), "pt") as f:
            w = f.get_tensor(entry.name)  # memory-mapped: read as it is used
    w = w.to(target)  # from_pretrained(dtype=...) casts first, then peft merges into that weight
    if update is not None and update.round_first:  # peft's Embedding.merge: weight += delta.to(weight's dtype)
        out = update.delta().to(target)
        out.add_(w)
        return out
    if update is not None:
        out = update.delta()  # fp32, like the weight
    elif bias_of is not None and bias_of.bias is not None:
        out = bias_of.bias.float() * bias_of.scaling
    else:
        return w
    out.add_(w)  # peft: weight += delta, computed in fp32, rounded once below
    del w
    return out.to(target, memory_format=torch.contiguous_format)


def _write_shard(source: Path, dest: Path, entries: list[TensorEntry], metadata: dict[str, str],
                 dtype: torch.dtype | None, adapter: Adapter, biases: dict[str, Update]) -> int:
    """Write `source`'s tensors merged to `dest`, one at a time (a safetensors file: header, then the bytes)."""
    from safetensors import safe_open

    header: dict[str, Any] = {"__metadata__": {**metadata, "format": metadata.get("format", "pt")}}
    offset = 0
    for e in entries:
        name = _out_name(e, dtype)
        size = e.numel * _itemsize(name)
        header[e.name] = {"dtype": name, "shape": list(e.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(dest, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for e in entries:
            update, replacement, bias_of = adapter.updates.get(e.name), adapter.replacements.get(e.name), biases.get(e.name)
            if update is not None or replacement is not None or bias_of is not None:
                _write_bytes(f, _merged_tensor(source, e, dtype, update, replacement, bias_of))
                continue
            target = ST_DTYPES.get(_out_name(e, dtype))
            for rows in _slices(e, SLICE_BYTES):  # one slice read, cast and written at a time
                with safe_open(str(source), "pt") as src:
                    part = src.get_tensor(e.name) if rows is None else src.get_slice(e.name)[rows]
                if target is not None and part.dtype != target:
                    part = part.to(target)
                _write_bytes(f, part)
                del part
    return offset


def _copy_file(src: Path, dest: Path) -> None:
    atomic_write(dest, lambda tmp: shutil.copyfile(src, tmp))


def merge_adapter(base: str | os.PathLike[str], adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                  *, dtype: torch.dtype | str | None = None, overwrite: bool = False) -> MergeResult:
    """Merge a LoRA adapter into its base, shard by shard on disk, within about the adapter's size of host RAM.

    Writes `out_dir` as `save_pretrained` would: the merged safetensors shards under the base's shard names, its
    index, config.json, generation_config.json and the tokenizer files (the adapter folder's where it has them,
    else the base's). Reads the base's files and the adapter's, changes neither. The merged weights equal peft's
    `PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()` on the CPU (the update computed in fp32,
    added in fp32, rounded once to the weight's dtype).

    Args:
        base: the base model the adapter was trained on: a folder with its safetensors checkpoint and config.json,
            or a Hugging Face id (its config, tokenizer and safetensors shards are downloaded first).
        adapter_dir: the adapter's folder (adapter_config.json and adapter_model.safetensors), as peft's or the
            Trainer's `save_pretrained` / `save_model` wrote it.
        out_dir: where the merged model goes: a new folder, or one a merge did not finish (no config.json yet);
            one that holds a model only with `overwrite=True`.
        dtype: the merged weights' dtype: None (keep the base's: bf16 stays bf16), torch.float16 (what a T4 runs),
            torch.bfloat16 or torch.float32, or their names. Only floating-point tensors are cast.
        overwrite: replace the files of a model already in `out_dir` (one with a config.json).

    Returns:
        `MergeResult`: the folder, the shards written, the weights updated, the bytes and the seconds.

    Raises:
        ValueError: naming the key or the setting: a quantized base, an adapter module or shape the base does not
            have, DoRA or another LoRA variant, a folder that holds no checkpoint, too little disk.

    Example:
        >>> cm.merge_adapter("Qwen/Qwen2.5-1.5B-Instruct", "out/adapter", "out/merged", dtype=torch.float16)
        >>> model = AutoModelForCausalLM.from_pretrained("out/merged", dtype=torch.float16)
    """
    start = time.perf_counter()
    dtype = _merge_dtype(dtype)
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False, got {overwrite!r}")
    adapter = read_adapter(adapter_dir)
    folder = base_folder(base)
    out = Path(os.fspath(out_dir)).expanduser()
    for other, what in ((folder, "the base's folder"), (adapter.folder, "the adapter's folder")):
        if out.resolve() == other.resolve():
            raise ValueError(f"out_dir {str(out)!r} is {what}: write the merged model to a folder of its own")
    files = shard_files(folder)
    layout = {p: read_header(p)[0] for p in files}
    _check_base(folder, layout, adapter)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} is a file, not a folder")
    if (out / "config.json").is_file() and not overwrite:  # shards without it are a merge that did not finish
        raise ValueError(f"out_dir {str(out)!r} holds a model already (its config.json): pass overwrite=True to "
                         "replace it, or give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # the folder is a whole model again only when it is rewritten
    need = sum(e.numel * _itemsize(_out_name(e, dtype)) for entries in layout.values() for e in entries)
    free = shutil.disk_usage(out).free
    if need > free:
        from colab_memopt.core.measure import format_bytes

        raise ValueError(f"the merged model needs {format_bytes(need)} of disk in {out}, and {format_bytes(free)} "
                         "is free: free some disk (delete the download cache of other models) or choose another folder")
    biases = {f"{u.module}.bias": u for u in adapter.updates.values() if u.bias is not None}
    written = 0
    for path in files:
        entries = layout[path]
        _, metadata = read_header(path)
        atomic_write(out / path.name, lambda tmp, p=path, e=entries, m=metadata: _write_shard(p, tmp, e, m, dtype,
                                                                                               adapter, biases))
        written += sum(e.numel * _itemsize(_out_name(e, dtype)) for e in entries)
    if overwrite:  # the model replaced: its weight files that these do not overwrite would be loaded beside them
        import fnmatch

        names = {p.name for p in files} | {"model.safetensors.index.json"}
        for stale in sorted(out.iterdir()):
            if stale.is_file() and stale.name not in names and any(fnmatch.fnmatch(stale.name, pattern) for pattern in (
                    "model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                    "pytorch_model.bin.index.json")):
                stale.unlink()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        data["metadata"] = {**(data.get("metadata") or {}), "total_size": written}
        atomic_write_text(out / index.name, json.dumps(data, indent=2, sort_keys=True) + "\n")
    for src_folder in (folder, adapter.folder):  # the adapter's tokenizer files win: the run trained with them
        for p in sorted(src_folder.iterdir()):
            if not p.is_file() or p.name == "config.json" or p.name.startswith("."):
                continue
            if src_folder == folder and (p.suffix in ANY_WEIGHT_SUFFIXES or p.name.endswith(".index.json")):
                continue
            if src_folder == adapter.folder and p.name not in TOKENIZER_FILES:
                continue
            _copy_file(p, out / p.name)
    notes = []
    config_file = folder / "config.json"
    if config_file.is_file():
        config = read_json(config_file)
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
            config.update(dict.fromkeys(keys, name))
        atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")  # last: now whole
    else:
        notes.append(f"{folder} has no config.json: copy the base's config.json into {out} to load the merged model")
    floats = sorted({str(ST_DTYPES[_out_name(e, dtype)]).removeprefix("torch.") for entries in layout.values()
                     for e in entries if e.dtype in FLOAT_NAMES})
    return MergeResult(out, len(files), len(adapter.updates), len(adapter.replacements), " and ".join(floats),
                       written, time.perf_counter() - start, notes, folder)


# -- the plan --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MergePlan:
    """The host RAM `merge_adapter` holds at its peak, and the disk the merged folder takes (bytes)."""

    host_bytes: int  # the adapter + the largest working set of one tensor + MERGE_OVERHEAD_BYTES
    adapter_bytes: int
    working_bytes: int  # the largest tensor's working set: the weight, its cast, its fp32 update, the result
    working_tensor: str
    disk_bytes: int  # the merged shards
    source: str  # where the layout came from: the files' headers, or the config (an assumption)


def merge_bytes(tensors: Iterable[tuple[str, str, tuple[int, ...]]], adapted: Iterable[str], adapter_bytes: int,
                dtype: torch.dtype | None, source: str) -> MergePlan:
    """Plan `merge_adapter`'s host peak from the checkpoint's tensors (name, safetensors dtype name, shape), the
    names of the weights the adapter updates and the adapter's bytes.

    An updated weight of n values goes through three steps, each holding: the memory-mapped weight (its dtype) and
    its cast to the merged dtype (where they differ); the weight in the merged dtype and the fp32 update (B @ A,
    scaled, the weight added in place); the update and the merged result. Any other tensor is copied in slices of
    at most SLICE_BYTES (read, cast, written)."""
    adapted = set(adapted)
    worst, worst_name, disk = 0, "", 0
    for name, st_dtype, shape in tensors:
        n = math.prod(shape)
        src = _itemsize(st_dtype)
        dst = _itemsize(ST_NAMES[dtype]) if dtype is not None and st_dtype in FLOAT_NAMES else src
        disk += n * dst
        cast = dtype is not None and st_dtype in FLOAT_NAMES and ST_NAMES[dtype] != st_dtype
        if name in adapted:
            work = max(n * src + (n * dst if cast else 0), n * (dst + 4))
        else:
            part = n * src if len(shape) < 2 or n * src <= SLICE_BYTES else SLICE_BYTES + src * math.prod(shape[1:])
            work = part + (part // src * dst if cast else 0)
        if work > worst:
            worst, worst_name = work, name
    return MergePlan(adapter_bytes + worst + MERGE_OVERHEAD_BYTES, adapter_bytes, worst, worst_name, disk, source)


def folder_tensors(folder: str | Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """Return (name, dtype name, shape) of every tensor of a local safetensors checkpoint, from its headers."""
    return [(e.name, e.dtype, e.shape) for p in shard_files(folder) for e in read_header(p)[0]]
