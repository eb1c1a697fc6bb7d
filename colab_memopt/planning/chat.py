"""Chat fine-tuning's data and its way out: records to TRL's `messages`, and what merging an adapter costs.

    import colab_memopt as cm
    cm.to_messages({"instruction": "Name a colour.", "input": "", "output": "Blue."})
    # {'messages': [{'role': 'user', 'content': 'Name a colour.'}, {'role': 'assistant', 'content': 'Blue.'}]}
    print(cm.merge_cost("Qwen/Qwen2.5-1.5B-Instruct"))   # host RAM / GPU memory to merge a LoRA into it
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.training.merge import ST_NAMES, MergePlan

# ShareGPT's speaker names, as the datasets that use the format write them, and the chat roles they stand for
# 40 short chats in prompt-completion shape (JSONL), shipped with the package: notebook 19's default data.
SAMPLE_CHATS = Path(__file__).resolve().with_name("chat_sample.jsonl")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool"}


def to_messages(record: Mapping[str, Any], *, system: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Return one dataset record as TRL's conversational form, `{"messages": [{"role": ..., "content": ...}, ...]}`.

    Accepts the forms chat datasets come in:
    - Alpaca: `instruction`, optional `input` (appended to the instruction after a blank line), `output`;
    - ShareGPT: `conversations` (or `messages`) as a list of `{"from": "human"|"gpt"|..., "value": ...}`;
    - TRL's prompt-completion: `prompt` and `completion`, each a list of messages or a string;
    - TRL's `messages` (returned as they are).
    `system` puts a system message first where the record has none. Use it with `datasets.Dataset.map`:

    A record with no answer (an `output` or `completion` that is missing or None, as `datasets` fills a row
    that lacks the field), an empty chat or a turn without text is refused naming the field: mapped over a
    dataset, such a row would teach the model to answer "None" or nothing.

    Example:
        >>> ds = ds.map(cm.to_messages, remove_columns=ds.column_names)   # then SFTTrainer(train_dataset=ds)
    """
    if not isinstance(record, Mapping):
        raise TypeError(f"record must be a dict (one dataset row), got {type(record).__name__}")
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system must be a str (the system message's text) or None, got {type(system).__name__} "
                        f"{system!r}")
    if "instruction" in record and "output" in record:  # Alpaca
        prompt = _text(record["instruction"], "instruction")
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise ValueError(f"input must be a str (text added to the instruction) or empty, got "
                             f"{type(extra).__name__} {_short(extra)}")
        if extra:
            prompt = f"{prompt}\n\n{extra}"
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": _text(record["output"], "output")}]
    elif "conversations" in record or ("messages" in record and _sharegpt(record["messages"])):  # ShareGPT
        field = "conversations" if "conversations" in record else "messages"
        turns = _turn_list(record[field], field, "of {'from': ..., 'value': ...} turns")
        messages = []
        for i, turn in enumerate(turns):
            where = f"{field}[{i}]"
            if not isinstance(turn, Mapping):
                raise ValueError(f"{where} must be a dict {{'from': ..., 'value': ...}}, got {type(turn).__name__} "
                                 f"{_short(turn)}")
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(f"unknown ShareGPT speaker {turn.get('from')!r} in {where}: use one of "
                                 f"{sorted(SHAREGPT_ROLES)}")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": _text(turn.get("value"), f"{where}['value']")})
    elif "messages" in record:  # already TRL's conversational form
        messages = _messages(record["messages"], "messages")
    elif "prompt" in record and "completion" in record:  # TRL's prompt-completion
        messages = _as_turns(record["prompt"], "user", "prompt") + _as_turns(record["completion"], "assistant",
                                                                             "completion")
    else:
        raise ValueError(f"cannot read a chat from a record with fields {sorted(record)}: expected Alpaca "
                         "(instruction, input, output), ShareGPT (conversations of from/value), "
                         "prompt/completion or messages")
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: Any, field: str) -> str:
    """Return a turn's text; refuse None (a row that lacks the field) and anything but a string."""
    if value is None:
        raise ValueError(f"{field} is missing or None: every turn needs its text (filter such rows out first, e.g. "
                         f"ds.filter(lambda r: r[...] is not None))")
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a str, got {type(value).__name__} {_short(value)}")
    return value


def _turn_list(value: Any, field: str, form: str) -> list[Any]:
    if value is None or isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{field} must be a list {form}, got {type(value).__name__} {_short(value)}")
    if not value:
        raise ValueError(f"{field} is an empty chat: it needs at least one turn with text")
    return list(value)


def _messages(value: Any, field: str) -> list[dict[str, Any]]:
    """Return TRL messages as new dicts, each checked: a role and a text (or, for a tool call, its calls)."""
    out = []
    for i, m in enumerate(_turn_list(value, field, "of {'role': ..., 'content': ...} messages")):
        where = f"{field}[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be a dict {{'role': ..., 'content': ...}}, got {type(m).__name__} "
                             f"{_short(m)}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where} has no 'role' (a str such as 'user' or 'assistant'), got {_short(m.get('role'))}")
        content = m.get("content")
        if not (isinstance(content, (str, list)) or (content is None and m.get("tool_calls"))):
            _text(content, f"{where}['content']")  # names None and a content of another type
        out.append(dict(m))
    return out


def _sharegpt(turns: Any) -> bool:
    return isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "from" in turns[0]


def _as_turns(value: Any, role: str, field: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if value is None:
        _text(value, field)
    return _messages(value, field)


@dataclass(frozen=True)
class MergeCost:
    """The memory that merging a LoRA adapter into its base takes (`merge_cost`): bytes, counted from the model's
    parameters and the dtype the base is loaded in; and what `merge_adapter` takes shard by shard instead."""

    parameters: int  # the base model's parameters (tied weights once)
    dtype: torch.dtype  # the dtype the base is loaded in for the merge
    weights_bytes: int  # the base in that dtype: what the merged model holds, and what its saved files hold
    adapter_bytes: int  # LoRA's A and B in fp32 on every Linear but the head (peft's default dtype for them)
    update_bytes: int  # the largest layer's update while it is added: B @ A and its scaled copy, in fp32
    largest_layer: str  # the layer that update belongs to
    shard_by_shard: MergePlan | None = None  # merge_adapter's host peak and disk need, merging into `dtype`

    @property
    def peak_bytes(self) -> int:
        """The peak of `merge_and_unload()`: the base's weights, the adapter and one layer's update."""
        return self.weights_bytes + self.adapter_bytes + self.update_bytes

    def __str__(self) -> str:
        from colab_memopt.core.measure import format_bytes

        name = str(self.dtype).removeprefix("torch.")
        count = f"{self.parameters / 1e9:.2f}B" if self.parameters >= 1e8 else f"{self.parameters:,}"
        lines = [f"merge in {name}: {format_bytes(self.peak_bytes)} at the peak (merge_and_unload, the whole model)",
                 f"  {format_bytes(self.weights_bytes)} of weights ({count} parameters), "
                 f"+{format_bytes(self.adapter_bytes)} adapter, +{format_bytes(self.update_bytes)} one layer's update"]
        if self.shard_by_shard is not None:
            plan = self.shard_by_shard
            lines += [f"shard by shard (cm.merge_adapter): {format_bytes(plan.host_bytes)} of host RAM, no GPU; "
                      f"{format_bytes(plan.disk_bytes)} of disk",
                      f"  layout: {plan.source}"]
        return "\n".join(lines)


def _dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    names = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be 'float16', 'bfloat16' or 'float32', got {dtype!r}")
        return names[dtype]
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    return dtype


def _refuse_quantized(net: nn.Module) -> None:
    """Refuse a model whose weights are quantized (bitsandbytes 4- or 8-bit, int8 weights): its 16-bit weights are
    not in memory, so neither its size nor its merge can be read from it."""
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if t.dtype in (torch.int8, torch.uint8) or type(t).__name__ in ("Params4bit", "Int8Params") or \
                str(t.dtype).startswith("torch.float8"):
            raise ValueError(f"model is quantized ({name} is {str(t.dtype).removeprefix('torch.')}): give its id, "
                             "folder or config (the merge loads the base in 16-bit)")


def _base_parts(net: nn.Module) -> tuple[dict[str, nn.Parameter], list[tuple[str, nn.Module]], Any]:
    """Return a model's base parameters (by checkpoint name, tied ones once), its base Linear layers (by name) and
    its head: a peft model's adapters (lora_A, lora_B, ...) and `modules_to_save` copies left out."""
    if hasattr(net, "get_base_model"):  # a PeftModel: its base, adapters injected
        net = net.get_base_model()

    def base_name(name: str) -> str | None:
        parts = name.split(".")
        if any(p.startswith("lora_") or p == "modules_to_save" for p in parts):
            return None
        return ".".join(p for p in parts if p not in ("base_layer", "original_module"))

    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in net.named_parameters(remove_duplicate=False):
        key = base_name(name)
        if key is not None and id(p) not in seen:
            seen.add(id(p))
            params[key] = p
    head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    head = getattr(head, "base_layer", None) or getattr(head, "original_module", None) or head
    layers = [(key, m) for name, m in net.named_modules()
              if isinstance(m, nn.Linear) and m is not head and (key := base_name(name)) is not None]
    return params, layers, net


def merge_cost(model: Any, dtype: torch.dtype | str = torch.float16, *, r: int = 16) -> MergeCost:
    """Return what merging a LoRA adapter into `model` loaded in `dtype` holds at its peak, without loading it.

    `merge_and_unload()` needs the base in 16-bit (a 4-bit base cannot take the update exactly): its weights in
    `dtype`, the adapter (fp32), and while each layer is merged that layer's update: peft computes `B @ A` and
    its scaled copy in the adapter's dtype, then adds it to the weight. The same bytes on the CPU (host RAM) or a
    GPU, whichever the base is loaded on; the adapter is counted on every Linear but the head (an upper bound
    for any `target_modules`).

    `.shard_by_shard` plans `merge_adapter` instead, which merges from the files into `dtype` on the CPU: the host
    RAM it holds (the adapter, one weight with its fp32 update, a slice of one other tensor) and the disk the merged
    folder takes. It reads the checkpoint's tensors from the safetensors headers where it has the files (a folder)
    or can read them (a hub id, online), else from the config's shapes in the config's or the published dtype,
    and says which.

    Args:
        model: a Hugging Face model id or local folder, a `PretrainedConfig`, one of
            `architectures.model_names()`, or a model (`nn.Module`, not quantized; a peft model counts its base).
        dtype: the dtype the base is loaded in for the merge: torch.float16 (a T4), torch.bfloat16 or
            torch.float32, or their names.
        r: the LoRA rank (`LoraConfig(r=...)`).

    Example:
        >>> cost = cm.merge_cost("Qwen/Qwen2.5-1.5B-Instruct", torch.float16)
        >>> cost.peak_bytes <= cm.COLAB_HOST_RAM_BYTES, cost.shard_by_shard.host_bytes
    """
    from colab_memopt.training.merge import merge_bytes

    dtype = _dtype_of(dtype)
    if isinstance(r, bool) or not (isinstance(r, int) and r >= 1):
        raise ValueError(f"r must be an int >= 1 (LoraConfig's rank), got {r!r}")
    spec = None
    if isinstance(model, nn.Module):
        _refuse_quantized(model)
        net = model
    else:
        from colab_memopt.techniques.architectures import resolve_model

        spec = resolve_model(model)
        with torch.device("meta"):
            net = spec.build()
        _refuse_quantized(net)
    params, layers, _ = _base_parts(net)
    parameters = sum(p.numel() for p in params.values())
    itemsize = torch.empty((), dtype=dtype).element_size()
    largest_layer, largest = max(((name, m.weight.numel()) for name, m in layers), key=lambda nl: nl[1],
                                 default=("", 0))
    adapter_bytes = sum(r * (m.in_features + m.out_features) * 4 for _, m in layers)  # A (r, in), B (out, r) in fp32
    update_bytes = largest * 4 * 2  # bytes: B @ A and B @ A * scaling, both (out, in) in fp32
    if spec is None:  # a model in memory: its tensors as it holds them
        tensors = [(k, ST_NAMES.get(p.dtype, "F32"), tuple(p.shape)) for k, p in params.items()]
        source = "the model in memory, its tensors in the dtypes it holds"
    else:
        from colab_memopt.training.loadplan import checkpoint_layout

        tensors, source = checkpoint_layout(spec, net, dtype)
    shard = merge_bytes(tensors, [f"{name}.weight" for name, _ in layers], adapter_bytes, dtype, source)
    return MergeCost(parameters, dtype, parameters * itemsize, adapter_bytes, update_bytes, largest_layer, shard)
