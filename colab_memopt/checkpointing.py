"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Works on any model with a stack of repeated blocks (an `nn.ModuleList` of modules of one class):
the reference model's `blocks`, a transformers model's `model.layers` or `transformer.h`. A policy
patches the chosen blocks' `forward` in place, so parameter names and the state dict do not change,
and `remove_checkpointing` restores them. Policies (notebook 03):

- 'none': keep every activation.
- 'full': checkpoint every block: keep only each block's input, recompute the block in backward.
- 'every_n': checkpoint every `interval`-th block (checkpoint ratio 1/interval); the others keep
  their activations.
- 'segments': the literature's `checkpoint_interval`: keep the input of every `interval`-th block
  and recompute the `interval` blocks of a segment together in backward. Blocks must take the hidden
  states first and return them (or a tuple that starts with them), with the same other arguments.
- 'selective': checkpoint every block, but save the outputs of matmuls and attention kernels
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) and recompute only the cheap
  pointwise ops (LayerNorm, GELU, adds).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("none", "full", "every_n", "segments", "selective")

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing saves: the expensive ones (FLOPs grow with h^2 or s^2).
SAVE_OPS: tuple[Any, ...] = tuple(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    )
    if op is not None
)
_SAVE_OPS = set(SAVE_OPS)
_SAVE_OPS |= {getattr(op, "default") for op in SAVE_OPS if hasattr(op, "default")}
_ORIGINAL = "_cm_original_forward"


def check_policy(policy: str, interval: int = 1) -> None:
    """Raise ValueError unless `policy` is one of POLICIES and `interval` an integer >= 1."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"checkpoint interval must be an integer >= 1, got {interval!r}")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """Return the model's stack of repeated blocks: the longest ModuleList of modules of one class.

    Raises ValueError when the model has no ModuleList of two or more blocks of the same class.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to checkpoint")
    return best


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> Any:
    """Return the contexts that save matmul and attention outputs and recompute everything else."""
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward: Callable[..., Any], *, selective: bool) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        extra = {"context_fn": selective_context_fn} if selective else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _segment_forward(forwards: list[Callable[..., Any]]) -> Callable[..., Any]:
    """Return a forward that runs a segment of blocks under one checkpoint."""

    def run_segment(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out: Any = hidden
        for forward in forwards:
            out = forward(_hidden(out), *args, **kwargs)
        return out

    def run(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return run_segment(hidden, *args, **kwargs)
        return checkpoint(run_segment, hidden, *args, use_reentrant=False, **kwargs)

    return run


def _passthrough(example_out_is_tuple: list[bool]) -> Callable[..., Any]:
    def run(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        # The segment's first block already ran this block; hand its output on unchanged.
        if example_out_is_tuple[0] and not isinstance(hidden, tuple):
            return (hidden,)
        return hidden

    return run


def checkpointed_blocks(n_blocks: int, policy: str, interval: int = 1) -> list[int]:
    """Return the indices of the blocks whose inputs are the stored checkpoints under `policy`."""
    check_policy(policy, interval)
    if policy == "none":
        return []
    if policy in ("full", "selective"):
        return list(range(n_blocks))
    if policy == "every_n":
        return [i for i in range(n_blocks) if i % interval == interval - 1]
    return list(range(0, n_blocks, interval))  # segments: the first block of each segment


def apply_checkpointing(model: nn.Module, policy: str, interval: int = 1) -> nn.Module:
    """Apply a checkpointing policy to the model's repeated blocks, in place; return the model.

    Args:
        model: any module with a stack of repeated blocks (see `find_blocks`).
        policy: one of POLICIES.
        interval: for 'every_n', checkpoint blocks interval-1, 2*interval-1, ...; for 'segments',
            recompute `interval` consecutive blocks from one stored input.

    Example:
        >>> apply_checkpointing(build_model("small"), "selective")
    """
    check_policy(policy, interval)
    if policy == "none":  # also fine on a model without repeated blocks
        if any(isinstance(m, nn.ModuleList) for m in model.modules()) or hasattr(model, "blocks"):
            with contextlib.suppress(ValueError):
                remove_checkpointing(model)
        return model
    blocks = find_blocks(model)
    if policy == "every_n" and interval > len(blocks):
        warnings.warn(f"checkpoint_interval {interval} exceeds the model's {len(blocks)} blocks: 'every_n' checkpoints "
                      f"blocks {interval - 1}, {2 * interval - 1}, ..., so none is checkpointed and nothing is saved; "
                      f"use an interval <= {len(blocks)}", RuntimeWarning, stacklevel=2)
    remove_checkpointing(model)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A KV cache filled in forward is global state the recomputation would fill again (with
        # different shapes): transformers turns it off for checkpointing too.
        config.use_cache = False
    for block in blocks:
        setattr(block, _ORIGINAL, block.forward)
    if policy == "segments":
        is_tuple = [False]
        for start in range(0, len(blocks), interval):
            segment = list(blocks[start : start + interval])
            forwards = [getattr(b, _ORIGINAL) for b in segment]
            first = _segment_forward(forwards)

            def first_forward(hidden: Any, *args: Any, _run: Callable[..., Any] = first, **kwargs: Any) -> Any:
                out = _run(hidden, *args, **kwargs)
                is_tuple[0] = isinstance(out, tuple)
                return out

            segment[0].forward = first_forward
            for block in segment[1:]:
                block.forward = _passthrough(is_tuple)
        return model
    chosen = set(checkpointed_blocks(len(blocks), policy, interval))
    for i, block in enumerate(blocks):
        if i in chosen:
            block.forward = _checkpointed(getattr(block, _ORIGINAL), selective=policy == "selective")
    return model


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo what `apply_checkpointing` installed on the blocks; return the model.

    Only blocks this module patched are touched, and each gets back the forward it had before, so a
    patch installed by another technique first (activation compression) survives.
    """
    for block in find_blocks(model):
        original = block.__dict__.pop(_ORIGINAL, None)
        if original is None:
            continue  # not checkpointed here: leave other patches alone
        if getattr(original, "__self__", None) is block and getattr(original, "__func__", None) is type(block).forward:
            block.__dict__.pop("forward", None)  # it was the class's own forward
        else:
            block.forward = original
    return model


def expected_stored_blocks(n_blocks: int, policy: str, interval: int = 1) -> float:
    """Return the analytic activation memory, in blocks' worth, kept for backward under `policy`.

    Units: one block's saved activations = 1. A block's input is `input_fraction` of that (see
    `expected_activation_fraction`). This counts whole blocks that keep everything, plus the
    recomputation window (one block, or one segment) alive during backward.
    """
    check_policy(policy, interval)
    if policy == "none":
        return float(n_blocks)
    if policy in ("full", "selective"):
        return 1.0
    if policy == "every_n":
        return float(n_blocks - len(checkpointed_blocks(n_blocks, policy, interval))) + 1.0
    return float(min(interval, n_blocks))


def expected_activation_bytes(
    block_bytes: int, input_bytes: int, n_blocks: int, policy: str, interval: int = 1, *, saved_bytes: int = 0
) -> int:
    """Return the analytic peak of block activations under `policy`, in bytes.

    stored = the inputs of the checkpointed blocks (or segments) + the blocks that keep everything
    + one recomputation window (a block, or a segment) alive during backward. For 'selective',
    `saved_bytes` per block (the matmul outputs it keeps) is added for every block.

    Args:
        block_bytes: one block's saved activations without checkpointing (measured or estimated).
        input_bytes: one block's input (B*T*h values).
        saved_bytes: per block, what 'selective' keeps in forward.
    """
    check_policy(policy, interval)
    if policy == "none":
        return n_blocks * block_bytes
    checkpoints = len(checkpointed_blocks(n_blocks, policy, interval))
    if policy == "full":
        return checkpoints * input_bytes + block_bytes
    if policy == "selective":
        return n_blocks * (input_bytes + saved_bytes) + block_bytes
    if policy == "every_n":
        return checkpoints * input_bytes + (n_blocks - checkpoints) * block_bytes + block_bytes
    return checkpoints * input_bytes + min(interval, n_blocks) * block_bytes
