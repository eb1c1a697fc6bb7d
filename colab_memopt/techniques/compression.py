"""Activation compression: what autograd saves for backward, stored smaller or elsewhere (notebook 08).

- `int8_saved_tensors(per)`: `torch.autograd.graph.saved_tensors_hooks` that pack every saved
  floating-point activation to int8 with a per-tensor or per-channel (last dimension) fp32 scale and
  unpack it for backward. Lossy: gradients become approximate.
- `offload_saved_tensors(device)`: `torch.autograd.graph.save_on_cpu`, pinned memory on CUDA.
- `compress_activations(model, mode, checkpoint=...)`: apply either to each block of the reference
  model, alone or combined with (reentrant) activation checkpointing, whose saved block inputs then
  go through the same hooks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("int8_tensor", "int8_channel", "cpu_offload")


def pack_int8(t: torch.Tensor, per: str = "tensor") -> Any:
    """Return a packed form of a saved tensor: (int8 values, fp32 scale, dtype), or the tensor as is.

    Floating-point tensors with more than one element are quantized symmetrically; `per='channel'`
    keeps one scale per index of the last dimension (a hidden channel). Parameters and integer
    tensors are kept: packing a weight would copy it, not save memory.
    """
    if not t.is_floating_point() or t.numel() <= 1 or isinstance(t, nn.Parameter):
        return t
    x = t.detach()
    if per == "channel" and x.dim() >= 2:
        absmax = x.abs().flatten(0, -2).amax(dim=0)  # (C,)
    elif per in ("tensor", "channel"):
        absmax = x.abs().amax()
    else:
        raise ValueError(f"per must be 'tensor' or 'channel', got {per!r}")
    scale = (absmax.float() / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return (q, scale, t.dtype)


def unpack_int8(packed: Any) -> torch.Tensor:
    """Return the tensor `pack_int8` packed, dequantized to its original dtype."""
    if isinstance(packed, torch.Tensor):
        return packed
    q, scale, dtype = packed
    return (q.float() * scale).to(dtype)


def int8_saved_tensors(per: str = "tensor") -> torch.autograd.graph.saved_tensors_hooks:
    """Return a context manager under which autograd saves activations as int8 with fp32 scales.

    Example:
        >>> with int8_saved_tensors("channel"):
        ...     loss = model(x, labels=x).loss
        >>> loss.backward()   # unpacks (dequantizes) each activation as backward needs it
    """
    if per not in ("tensor", "channel"):
        raise ValueError(f"per must be 'tensor' or 'channel', got {per!r}")
    return torch.autograd.graph.saved_tensors_hooks(functools.partial(pack_int8, per=per), unpack_int8)


def offload_saved_tensors(device: torch.device | str) -> torch.autograd.graph.save_on_cpu:
    """Return `save_on_cpu`: saved activations go to host memory (pinned on CUDA) until backward.

    On the CPU the "host" is the same memory: `tensor.cpu()` of a CPU tensor is that tensor, so nothing is
    copied and nothing is saved.
    """
    pin = torch.device(device).type == "cuda"
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def saved_tensors_context(mode: str | None, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Return the context manager for a compression mode (None: no change)."""
    if mode is None:
        return contextlib.nullcontext()
    if mode == "cpu_offload":
        return offload_saved_tensors(device)
    if mode in ("int8_tensor", "int8_channel"):
        return int8_saved_tensors(mode.split("_")[1])
    raise ValueError(f"activation compression must be None or one of {MODES}, got {mode!r}")


def _compressed_forward(forward: Callable[..., Any], mode: str | None, use_checkpoint: bool, device: torch.device,
                        *args: Any, **kwargs: Any) -> Any:
    with saved_tensors_context(mode, device):
        if use_checkpoint and torch.is_grad_enabled():
            # Reentrant checkpointing saves the block's inputs with save_for_backward, so they pass
            # through the hooks above; the non-reentrant kind keeps them in a closure, untouched.
            return checkpoint(forward, *args, use_reentrant=True, **kwargs)
        return forward(*args, **kwargs)


def check_compressible(model: nn.Module) -> None:
    """Raise ValueError when `model` has no `blocks` list to compress (only the reference model has one)."""
    if not hasattr(model, "blocks"):
        raise ValueError("compress_activations applies to models with a `blocks` list (the reference model)")


def compress_activations(model: nn.Module, mode: str | None, *, checkpoint_blocks: bool = False) -> nn.Module:
    """Make every block of `model` (its `blocks` list) save compressed activations; return the model.

    Args:
        mode: 'int8_tensor', 'int8_channel', 'cpu_offload', or None (with checkpoint_blocks: plain checkpointing).
        checkpoint_blocks: also recompute each block in backward; only its (compressed) input is kept.

    Example:
        >>> compress_activations(model, "int8_channel", checkpoint_blocks=True)
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be None or one of {MODES}, got {mode!r}")
    check_compressible(model)
    device = next(model.parameters()).device
    for block in model.blocks:
        original = block.__dict__.get("_uncompressed_forward", block.forward)
        block._uncompressed_forward = original
        if mode is None and not checkpoint_blocks:
            block.forward = original
        else:
            block.forward = functools.partial(_compressed_forward, original, mode, checkpoint_blocks, device)
    return model


@contextlib.contextmanager
def no_compression(model: nn.Module) -> Iterator[nn.Module]:
    """Run the model's blocks uncompressed inside the block (to compute exact reference gradients)."""
    saved = [block.__dict__.get("forward") for block in model.blocks]
    for block in model.blocks:
        if "_uncompressed_forward" in block.__dict__:
            block.forward = block._uncompressed_forward
    try:
        yield model
    finally:
        for block, fwd in zip(model.blocks, saved):
            if fwd is not None:
                block.forward = fwd
