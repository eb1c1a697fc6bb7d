"""Notebook 12: OOM troubleshooting as a procedure: `diagnose(error, recipe, plan)`.

It reads the error (a CUDA out-of-memory message or `MemoryBudget`'s), classifies the situation
(at step 0, after N steps, during evaluation, with long sequences, intermittent) and returns ordered,
specific suggestions, each with the predicted peak once it is enabled. The prediction comes from
`plan(recipe)` when a planner is passed and the recipe has the field; otherwise from the formulas of
`estimate.training_peak_bytes` (the reference model's budget on paper).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from colab_memopt.planning import estimate
from colab_memopt.core.measure import format_bytes
from colab_memopt.techniques.models import GPTConfig

SITUATIONS = ("step 0", "after N steps", "during evaluation", "long sequences", "intermittent")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
LONG_SEQUENCE = 1024  # tokens: from here the a*s^2 attention term dominates a block's activations (h <= 1024)


@dataclass
class Suggestion:
    """One thing to do, why, and the predicted peak with it (and all suggestions before it) applied."""

    action: str
    why: str
    predicted_peak_bytes: int | None = None
    fits: bool | None = None
    predicted_by: str = ""


@dataclass
class Diagnosis:
    """The situation an OOM happened in, what the error said, and ordered suggestions."""

    situation: str
    summary: str
    requested_bytes: int | None
    capacity_bytes: int | None
    reserved_unallocated_bytes: int | None
    suggestions: list[Suggestion] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"OOM {self.situation}: {self.summary}"]
        for i, s in enumerate(self.suggestions, 1):
            pred = ""
            if s.predicted_peak_bytes is not None:
                pred = f" -> predicted peak {format_bytes(s.predicted_peak_bytes)}"
                pred += "" if s.fits is None else (" (fits)" if s.fits else " (does not fit yet)")
            lines.append(f"{i}. {s.action}{pred}\n   {s.why}")
        return "\n".join(lines)


def _size(number: str, unit: str) -> int:
    return int(float(number.replace(",", "")) * _UNITS[unit])


def parse_oom_message(message: str) -> dict[str, int | None]:
    """Return the bytes an OOM message names: requested, capacity, free, reserved but unallocated."""
    out: dict[str, int | None] = {"requested_bytes": None, "capacity_bytes": None, "free_bytes": None,
                                  "reserved_unallocated_bytes": None}
    size = r"([\d.,]+) (B|KiB|MiB|GiB|TiB)"
    patterns = {
        "requested_bytes": rf"Tried to allocate {size}",
        "capacity_bytes": rf"total capacity of {size}",
        "free_bytes": rf"of which {size} is free",
        "reserved_unallocated_bytes": rf"{size} is reserved by PyTorch but unallocated",
    }
    for key, pattern in patterns.items():
        m = re.search(pattern, message)
        if m:
            out[key] = _size(*m.groups())
    m = re.search(r"asked for ([\d,]+) bytes.*limit of ([\d,]+) bytes", message)  # MemoryBudget
    if m:
        out["requested_bytes"] = int(m.group(1).replace(",", ""))
        out["capacity_bytes"] = int(m.group(2).replace(",", ""))
    return out


def classify(*, step: int | None, during: str, seq_len: int | None, oom_steps: Iterable[int],
             reserved_unallocated_bytes: int | None, capacity_bytes: int | None) -> str:
    """Return the situation: 'during evaluation', 'intermittent', 'long sequences', 'step 0' or 'after N steps'."""
    if during not in ("train", "eval"):
        raise ValueError(f"during must be 'train' or 'eval', got {during!r}")
    steps = sorted(set(oom_steps))
    if during == "eval":
        return "during evaluation"
    fragmented = bool(reserved_unallocated_bytes and capacity_bytes and reserved_unallocated_bytes > 0.1 * capacity_bytes)
    if len(steps) >= 2 or fragmented:
        return "intermittent"
    if seq_len is not None and seq_len >= LONG_SEQUENCE:
        return "long sequences"
    if not step:
        return "step 0"
    return "after N steps"


# Each step: (action, why, recipe changes for a planner, paper-estimate changes).
_ENABLE = {
    "sdpa": ("use memory-efficient attention (Recipe(attention='sdpa'), PyTorch SDPA)",
             "naive attention keeps the a*s^2 score matrix per layer; SDPA's kernel keeps a*s",
             {"attention": "sdpa"}, {"attention": "sdpa"}),
    "mixed": ("train in fp16 autocast with GradScaler on a T4 (bf16 on Ampere+)",
              "16-bit activations take half the bytes (model states stay fp32 here)",
              {"mixed_precision": "fp16"}, {"bytes_per_value": 2}),
    "ckpt": ("enable activation checkpointing (torch.utils.checkpoint per block)",
             "keeps each block's input (s*b*h values) instead of all its activations, recomputing in backward",
             {"gradient_checkpointing": True}, {"checkpointing": True}),
    "8bit": ("use an 8-bit optimizer (bitsandbytes AdamW8bit)",
             "AdamW's state drops from 8 to 2 bytes per parameter (Dettmers et al. 2022)",
             {"optimizer": "adamw8bit"}, {"optimizer_bytes_per_param": 2}),
    "micro": ("halve the micro-batch and double gradient accumulation (batching.train_with_oom_recovery)",
              "the effective batch stays; activations are those of the smaller micro-batch; last resort: it costs steps",
              {"gradient_accumulation_steps": 2}, {"batch_factor": 0.5}),
    "seq": ("shorten the sequence (max_length) or split long documents",
            "activations grow with s, attention without SDPA with s^2",
            {}, {"seq_factor": 0.5}),
    "offload": ("offload optimizer state to host RAM (DeepSpeed ZeRO-Offload)",
                "moves 8-12 B/param to host RAM (12.7 GB on Colab); 10-20x slower steps",
                {"optimizer_offload": True}, {"optimizer_bytes_per_param": 0}),
}
_ORDER = {
    "step 0": ("sdpa", "mixed", "ckpt", "8bit", "micro", "offload"),
    "long sequences": ("sdpa", "ckpt", "mixed", "seq", "micro"),
}


def _paper_peak(config: GPTConfig, batch: int, seq: int, recipe: Any, changes: dict[str, Any]) -> int:
    b = max(1, int(batch * changes.get("batch_factor", 1.0)))
    s = max(1, int(seq * changes.get("seq_factor", 1.0)))
    optimizer = getattr(recipe, "optimizer", "adamw") if recipe is not None else "adamw"
    optimizer = optimizer if optimizer in estimate.OPTIMIZER_STATE_BYTES else "adamw"
    kwargs = {k: v for k, v in changes.items() if k in ("attention", "bytes_per_value", "checkpointing", "optimizer_bytes_per_param")}
    kwargs.setdefault("attention", getattr(recipe, "attention", None) if recipe is not None else None)
    return estimate.training_peak_bytes(config, b, s, optimizer=optimizer, **kwargs)


def _planned_peak(plan: Callable[[Any], Any], recipe: Any, changes: dict[str, Any]) -> int | None:
    try:
        variant = recipe.with_(**changes)
    except (TypeError, ValueError):
        return None  # the recipe has no such field yet: fall back to the paper estimate
    result = plan(variant)
    return int(getattr(result, "peak_bytes", result))


def diagnose(
    error: BaseException | str,
    recipe: Any = None,
    plan: Callable[[Any], Any] | None = None,
    *,
    config: GPTConfig | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    step: int | None = None,
    during: str = "train",
    oom_steps: Iterable[int] = (),
    capacity_bytes: int | None = None,
) -> Diagnosis:
    """Return the situation of an OOM and ordered suggestions, each with its predicted peak.

    Args:
        error: the `torch.OutOfMemoryError` (or its message).
        recipe: the `Recipe` that ran; its fields decide what is already enabled.
        plan: a planner, `plan(recipe) -> object with peak_bytes`; None uses the paper estimate.
        config, batch_size, seq_len: the reference model's config and the step's shape, for predictions.
        step: the step that failed (0: the first); during: 'train' or 'eval'.
        oom_steps: steps at which earlier OOMs happened (two or more make it intermittent).
        capacity_bytes: the device's capacity, if the message does not say it.

    Example:
        >>> print(diagnose(err, cm.Recipe(), config=cm.get_config("gpt2-small"), batch_size=16, seq_len=1024, step=0))
    """
    message = str(error)
    if not message:
        raise ValueError("error must be an OOM error or its message, got an empty message")
    info = parse_oom_message(message)
    capacity = capacity_bytes or info["capacity_bytes"]
    situation = classify(step=step, during=during, seq_len=seq_len, oom_steps=list(oom_steps) + ([step] if step else []),
                         reserved_unallocated_bytes=info["reserved_unallocated_bytes"], capacity_bytes=capacity)
    asked = f"it asked for {format_bytes(info['requested_bytes'])}" if info["requested_bytes"] else "the request size is not in the message"
    summary = asked + (f" of a {format_bytes(capacity)} device" if capacity else "")
    suggestions: list[Suggestion] = []
    can_predict = config is not None and batch_size is not None and seq_len is not None
    if can_predict:
        summary += f"; predicted peak as configured {format_bytes(_paper_peak(config, batch_size, seq_len, recipe, {}))}"

    if situation in _ORDER:
        attention = getattr(recipe, "attention", None) or (config.attention if config is not None else None)
        applied_recipe: dict[str, Any] = {}
        applied_paper: dict[str, Any] = {}
        for key in _ORDER[situation]:
            action, why, recipe_changes, paper_changes = _ENABLE[key]
            if key == "sdpa" and attention == "sdpa":
                continue  # already on
            applied_recipe.update(recipe_changes)
            applied_paper.update(paper_changes)
            predicted, by = None, ""
            if plan is not None and recipe is not None:
                predicted = _planned_peak(plan, recipe, applied_recipe)
                by = "planner" if predicted is not None else ""
            if predicted is None and can_predict:
                predicted = _paper_peak(config, batch_size, seq_len, recipe, applied_paper)
                by = "paper (estimate.training_peak_bytes)"
            fits = None if predicted is None or not capacity else predicted <= capacity
            suggestions.append(Suggestion(action, why, predicted, fits, by))
    elif situation == "after N steps":
        suggestions += [
            Suggestion("look for a leak: run monitor.MemoryProfiler and monitor.find_leak over the steps",
                       "memory that climbs step after step is kept alive by the loop: losses appended without "
                       ".item(), outputs or hidden states stored in a list, a growing cache"),
            Suggestion("find the batch that failed: the longest sequences set the peak",
                       "with variable lengths a rare long batch exceeds what the first steps used; cap max_length "
                       "or bucket batches by length"),
            Suggestion("keep training with batching.train_with_oom_recovery",
                       "it halves the micro-batch on OOM and doubles accumulation, so the effective batch and the "
                       "samples seen stay the same"),
        ]
    elif situation == "during evaluation":
        suggestions += [
            Suggestion("evaluate under torch.no_grad() or torch.inference_mode(), with model.eval()",
                       "without them the forward keeps every activation for a backward that never comes"),
            Suggestion("move predictions off the device per batch (Trainer: eval_accumulation_steps)",
                       "logits of all eval batches kept on the GPU grow as batch x seq x vocab per step"),
            Suggestion("lower the eval batch size (per_device_eval_batch_size)",
                       "eval batches are often set larger than training batches"),
        ]
    else:  # intermittent
        frag = info["reserved_unallocated_bytes"]
        suggestions += [
            Suggestion("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch starts",
                       "reserved but unallocated memory is fragmentation: free blocks too small for the request"
                       + (f" ({format_bytes(frag)} of it in this message)" if frag else "")),
            Suggestion("make batch shapes regular: pad to a few fixed lengths or bucket by length",
                       "changing shapes leave differently sized free blocks behind"),
            Suggestion("keep training with batching.train_with_oom_recovery",
                       "a rare OOM then costs one retried step at a smaller micro-batch, not the run"),
        ]
    return Diagnosis(situation, summary, info["requested_bytes"], capacity, info["reserved_unallocated_bytes"], suggestions)
