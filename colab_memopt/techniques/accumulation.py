"""Gradient accumulation: one optimizer step over several micro-batches (notebook 04).

Conventions used throughout the project: `batch_size` is the EFFECTIVE batch, the rows one
optimizer step learns from. `accumulation_steps` splits it into that many micro-batches
(`torch.tensor_split`: sizes differ by at most one, the later ones smaller when it does not divide),
run forward and backward one at a time, so only one micro-batch's activations are alive at once.

Each micro-batch's mean loss is weighted by its share of the effective batch's tokens, so the
accumulated gradient equals the large batch's gradient even when the last micro-batch is smaller.
(Dividing every micro-batch loss by `accumulation_steps` is only right when all are the same size.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

LR_RULES = ("none", "linear", "sqrt")


def check_accumulation_steps(accumulation_steps: int, batch_size: int | None = None) -> None:
    """Raise ValueError unless 1 <= accumulation_steps (<= batch_size when given)."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
    if batch_size is not None and accumulation_steps > batch_size:
        raise ValueError(
            f"accumulation_steps ({accumulation_steps}) must not exceed the effective batch_size ({batch_size}): "
            "each micro-batch needs at least one row"
        )


def micro_batch_sizes(batch_size: int, accumulation_steps: int) -> list[int]:
    """Return the rows of each micro-batch: `batch_size` split into `accumulation_steps` parts.

    Example:
        >>> micro_batch_sizes(10, 4)
        [3, 3, 2, 2]
    """
    check_accumulation_steps(accumulation_steps, batch_size)
    base, extra = divmod(batch_size, accumulation_steps)
    return [base + (1 if i < extra else 0) for i in range(accumulation_steps)]


def split_micro_batches(input_ids: torch.Tensor, accumulation_steps: int) -> list[torch.Tensor]:
    """Return `input_ids` (B, T) split along the batch into `accumulation_steps` micro-batches."""
    check_accumulation_steps(accumulation_steps, input_ids.size(0))
    return list(torch.tensor_split(input_ids, accumulation_steps, dim=0))


def accumulate_gradients(
    model: nn.Module,
    micro_batches: Sequence[torch.Tensor],
    *,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Add the effective batch's gradient to `.grad` by running the micro-batches one at a time.

    Each micro-batch of n_i rows out of N weighs its mean loss by n_i / N: the sum of the weighted
    losses is the mean loss over all N rows (every row has the same number of predicted tokens), so
    the summed gradients equal the large batch's. Does not zero gradients or step the optimizer.
    Returns the effective batch's mean loss.

    Args:
        model: called as `model(x, labels=x).loss` (the transformers convention).
        micro_batches: token ids, each (n_i, T); sizes may differ.
        autocast: a fresh context for each forward (e.g. `precision.autocast_context`); None for none.
        scaler: a GradScaler for fp16 (scales each backward); None for none.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one batch, got none")
    lengths = {mb.size(1) for mb in micro_batches}
    if len(lengths) != 1:
        raise ValueError(f"micro-batches must share one sequence length to be weighted by rows, got {sorted(lengths)}")
    total_rows = sum(mb.size(0) for mb in micro_batches)
    total_loss = 0.0
    for mb in micro_batches:
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = model(mb, labels=mb).loss
        weighted = loss * (mb.size(0) / total_rows)
        (scaler.scale(weighted) if scaler is not None else weighted).backward()
        total_loss += weighted.item()
    return total_loss


def scaled_lr(lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """Return the learning rate for `new_batch` rows given `lr` tuned at `base_batch` rows.

    'linear' (Goyal et al. 2017, for SGD: lr grows with the batch), 'sqrt' (Hoffer et al. 2017;
    Malladi et al. 2022 for Adam), 'none'. Accumulation that keeps the effective batch changes nothing.
    """
    if rule not in LR_RULES:
        raise ValueError(f"rule must be one of {LR_RULES}, got {rule!r}")
    if base_batch < 1 or new_batch < 1:
        raise ValueError(f"batches must be >= 1, got base_batch={base_batch}, new_batch={new_batch}")
    ratio = new_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[rule]


def grad_rel_diff(grads_a: Sequence[torch.Tensor | None], grads_b: Sequence[torch.Tensor | None]) -> float:
    """Return max over tensors of ||a - b|| / ||b||: how far two sets of gradients are apart."""
    if len(grads_a) != len(grads_b):
        raise ValueError(f"gradient lists differ in length: {len(grads_a)} and {len(grads_b)}")
    worst = 0.0
    for a, b in zip(grads_a, grads_b):
        if a is None or b is None:
            if a is not b:
                raise ValueError("one gradient is None and the other is not")
            continue
        denom = b.double().norm().item()
        diff = (a.double() - b.double()).norm().item()
        worst = max(worst, diff / denom if denom else diff)
    return worst
