"""The MLP tiled along the sequence: one tile's intermediate activations alive at a time (notebook 17).

A transformer block's MLP works on each token alone: `down(act(gate(x)) * up(x))` for the gated MLPs of
Llama, Qwen2, Mistral and Gemma, `down(gelu(up(x)))` for the reference model and GPT-2. Its
intermediate tensors are `tokens x intermediate` wide (Llama-3.1-8B: 14,336 = 3.5 x hidden), several
of them alive in backward (the two projections, the activation, their product and their gradients),
so at long context they, not the attention, set the block's backward peak. `apply_tiled_mlp(model,
tile_tokens)` makes each block's MLP run on tiles of `tile_tokens` tokens, each tile under its own
non-reentrant `torch.utils.checkpoint.checkpoint`: forward keeps only the tiles' inputs (views of the
MLP's input, which is alive anyway), and backward recomputes and differentiates one tile at a time.
Inside a checkpointed block (every policy of `checkpointing`) the nesting is PyTorch's own: the
block's recomputation runs the tiles again, saving only their inputs, and each tile is recomputed
once more when backward reaches it (so a tiled MLP runs its forward three times per step under
checkpointing, twice without).

The gradients are those of the untiled MLP up to float summation order: a parameter's gradient is
the sum of its tiles' contributions, which autograd adds before the parameter's gradient is
accumulated (one accumulation per step, so hooks that fire on accumulation, as an optimizer stepping
inside backward, fire once). Autocast state and the RNG state (LoRA dropout) are restored by
`checkpoint` for each recomputation. LoRA (peft) and QLoRA (bitsandbytes) layers inside the MLP are
ordinary submodules and are tiled with it. Plain PyTorch, so it runs on the CPU, on a T4 and under the
planner's fake tensors (the trace is exact).

What it costs: one more forward of the MLP per step, and in backward the input gradient is first
held per tile and then joined (one more `tokens x hidden` tensor for a moment).

Why not DeepSpeed's `TiledMLP` (deepspeed 0.19.8, `deepspeed.runtime.sequence_parallel.ulysses_sp`),
an `autograd.Function` that runs the tiles under `no_grad` in forward and, in its backward, runs
each tile again under `enable_grad` and calls `torch.autograd.backward` on it:
- its recomputation runs in backward, outside the forward's autocast region, and it does not restore
  it: under fp16 autocast (a T4) the recomputed tile runs in fp32, with other numbers and twice the
  bytes;
- it does not restore the RNG state, so a LoRA layer with dropout recomputes with another mask;
- each tile's `torch.autograd.backward` accumulates into the parameters' `.grad` once per tile, so
  post-accumulate hooks (an optimizer stepping inside backward) fire once per tile, and it flags
  ZeRO's buckets by hand (`ds_grad_is_ready`).
The idea, tiles of the sequence through the MLP with one recomputation, is the same; ALST (Bekman et
al. 2025, https://arxiv.org/abs/2506.13996) and Unsloth's tiled MLP describe it.

Example:
    >>> apply_tiled_mlp(model, 2048)  # or Recipe(mlp_tile_tokens=2048)
    >>> model(ids, labels=ids).loss.backward()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from colab_memopt.checkpointing import find_blocks

__all__ = ["MLP_NAMES", "apply_tiled_mlp", "check_tile_tokens", "find_mlps", "remove_tiled_mlp", "tiled"]

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # the MLP's attribute name in a block (transformers and the reference model)
_ORIGINAL = "_cm_untiled_forward"
_TILE = "_cm_mlp_tile_tokens"


def check_tile_tokens(tile_tokens: object, name: str = "mlp_tile_tokens") -> None:
    """Raise ValueError unless `tile_tokens` is None or an integer >= 1."""
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1):
        raise ValueError(f"{name} must be None or an integer >= 1 (tokens per tile), got {tile_tokens!r}")


def find_mlps(model: nn.Module) -> list[nn.Module]:
    """Return the MLP of each of the model's repeated blocks (`checkpointing.find_blocks`).

    Raises ValueError naming the block class when a block has no submodule called one of MLP_NAMES.
    """
    mlps = []
    for block in find_blocks(model):
        mlp = next((m for n in MLP_NAMES if isinstance(m := getattr(block, n, None), nn.Module)), None)
        if mlp is None:
            children = [n for n, _ in block.named_children()]
            raise ValueError(f"mlp_tile_tokens: block {type(block).__name__} has no MLP submodule named one of {MLP_NAMES} "
                             f"(its children: {children})")
        mlps.append(mlp)
    return mlps


def tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile_tokens: int) -> Callable[..., torch.Tensor]:
    """Return `forward` (a token-wise map of (..., hidden) to (..., out)) run by tiles of `tile_tokens` tokens.

    With gradients enabled each tile runs under a non-reentrant `checkpoint`, so only its input is kept and
    backward recomputes one tile at a time; without gradients the tiles simply run in turn.
    """
    check_tile_tokens(tile_tokens)

    @functools.wraps(forward)
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise ValueError("a tiled MLP takes only the hidden states (one tensor); got extra arguments "
                             f"{len(args)} positional and {sorted(kwargs)}")
        flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden): tiles of tokens whatever the batch
        if flat.shape[0] <= tile_tokens:
            return forward(x)
        tiles = flat.split(tile_tokens)
        if torch.is_grad_enabled():
            outs = [checkpoint(forward, t, use_reentrant=False) for t in tiles]
        else:
            outs = [forward(t) for t in tiles]
        out = torch.cat(outs)  # (tokens, out)
        return out.view(*x.shape[:-1], out.shape[-1])

    return run


def apply_tiled_mlp(model: nn.Module, tile_tokens: int | None) -> nn.Module:
    """Run every block's MLP by tiles of `tile_tokens` tokens, in place; return the model.

    `tile_tokens=None` removes the tiling. Patches each MLP's `forward` on the instance, so parameter
    names, the state dict and adapters (peft, applied before or after) do not change.

    Args:
        model: a module with repeated blocks whose MLP is named one of MLP_NAMES (the reference model,
            transformers Llama, Qwen2, Mistral, Gemma, GPT-2, ...), peft-wrapped or not.
        tile_tokens: tokens per tile (batch and sequence flattened), or None.

    Example:
        >>> apply_tiled_mlp(build_model("small"), 64)
    """
    check_tile_tokens(tile_tokens)
    if tile_tokens is None:
        return remove_tiled_mlp(model)
    for mlp in find_mlps(model):
        original = mlp.__dict__.get(_ORIGINAL, mlp.forward)
        setattr(mlp, _ORIGINAL, original)
        setattr(mlp, _TILE, tile_tokens)
        mlp.forward = tiled(original, tile_tokens)
    return model


def remove_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo `apply_tiled_mlp`; return the model (a no-op on a model that is not tiled)."""
    try:
        blocks = find_blocks(model)
    except ValueError:  # no repeated blocks: nothing was tiled
        return model
    for block in blocks:
        for n in MLP_NAMES:
            mlp = getattr(block, n, None)
            if isinstance(mlp, nn.Module) and _ORIGINAL in mlp.__dict__:
                original = mlp.__dict__.pop(_ORIGINAL)
                mlp.__dict__.pop(_TILE, None)
                if getattr(original, "__func__", None) is type(mlp).forward:
                    mlp.__dict__.pop("forward", None)
                else:
                    mlp.forward = original
    return model


def measure_tiled_block(block_factory: Callable[[], nn.Module], tokens: int, tile_tokens: int, *,
                        hidden: int | None = None, repeat: int = 3, device: str = "cpu") -> dict[str, Any]:
    """Measure one checkpointed block's forward and backward with its MLP untiled and tiled.

    The block (from `block_factory`, called once per variant with the same seed) runs under `checkpoint`, as
    every block of a checkpointed model does: its backward recomputes it, and that recomputation's MLP is what
    tiling shrinks. Both variants go through `measure.measure_step`. Returns the two `MemoryReport`s'
    `peak_bytes` and `step_seconds`, `saving_pct` (the peak saved, % of the untiled one) and `time_cost_pct`.

    Example:
        >>> measure_tiled_block(lambda: LlamaDecoderLayer(config, 0), 2048, 256, hidden=config.hidden_size)
    """
    from colab_memopt.measure import measure_step

    reports = {}
    for tile in (None, tile_tokens):
        torch.manual_seed(0)
        block = block_factory().to(device)
        width = hidden if hidden is not None else next(p.shape[-1] for p in block.parameters() if p.dim() == 2)
        mlp = next(m for n in MLP_NAMES if isinstance(m := getattr(block, n, None), nn.Module))
        if tile is not None:
            setattr(mlp, _ORIGINAL, mlp.forward)
            mlp.forward = tiled(mlp.forward, tile)
        x = torch.randn(1, tokens, width, device=device, requires_grad=True)
        extra = _block_kwargs(block, tokens, width, device)

        def step(block: nn.Module = block, x: torch.Tensor = x, extra: dict = extra) -> None:
            x.grad = None
            block.zero_grad(set_to_none=True)
            out = checkpoint(block, x, use_reentrant=False, **extra)
            (out[0] if isinstance(out, tuple) else out).sum().backward()

        reports[tile] = measure_step(step, model=block, track=[x, *(t for v in extra.values() for t in v)], device=device, repeat=repeat,
                                     label="untiled" if tile is None else f"tiles of {tile}")
    plain, tiled_report = reports[None], reports[tile_tokens]
    return {"tokens": tokens, "tile_tokens": tile_tokens,
            "untiled_peak_bytes": plain.peak_bytes, "tiled_peak_bytes": tiled_report.peak_bytes,
            "saving_pct": 100.0 * (plain.peak_bytes - tiled_report.peak_bytes) / plain.peak_bytes,
            "untiled_seconds": plain.step_seconds, "tiled_seconds": tiled_report.step_seconds,
            "time_cost_pct": 100.0 * (tiled_report.step_seconds - plain.step_seconds) / plain.step_seconds}


def _block_kwargs(block: nn.Module, tokens: int, width: int, device: str) -> dict[str, Any]:
    """Return the extra inputs a transformers decoder layer needs (rotary position embeddings), else none."""
    attn = getattr(block, "self_attn", None)
    if attn is None:
        return {}
    config = attn.config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=config).to(device)
    positions = torch.arange(tokens, device=device)[None]
    cos, sin = rotary(torch.empty(1, device=device), positions)  # (1, tokens, head_dim) each
    return {"position_embeddings": (cos, sin)}
