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
planner's fake tensors (the trace is exact; it runs four tiles of each MLP and holds the others' outputs and
gradients, `traced_tiles`, which tests measure against every tile run).

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

from colab_memopt.techniques.checkpointing import find_blocks
from colab_memopt.techniques.loss import chunk_starts, first_rounds_only
from colab_memopt.core.console import quiet

__all__ = ["MLP_NAMES", "apply_tiled_mlp", "apply_tiled_norm", "check_tile_tokens", "find_mlps", "find_rmsnorms",
           "remove_tiled_mlp", "remove_tiled_norm", "tiled", "tiled_rms_norm"]

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
            traced = traced_tiles(len(tiles), flat)
            outs = []
            for i, t in enumerate(tiles):
                if i in traced:
                    outs.append(checkpoint(forward, t, use_reentrant=False))
                else:  # (only in the planner's trace of fake tensors: a tile that holds what its neighbours do)
                    outs.append(_HeldTile.apply(t, outs[0].shape, outs[0].dtype))
        else:
            outs = [forward(t) for t in tiles]
        out = torch.cat(outs)  # (tokens, out)
        return out.view(*x.shape[:-1], out.shape[-1])

    return run


def traced_tiles(n_tiles: int, flat: torch.Tensor) -> range | set[int]:
    """Return the tiles run through the MLP: all of them, or, in the planner's trace of fake tensors
    (`loss.first_rounds_traced`), the first two and the last two.

    Every tile keeps its output until they are joined, and backward keeps each tile's input gradient until all are
    in: what is alive grows by one tile's output per tile in forward, and by one tile's gradient per tile in backward,
    while each tile's own intermediates are alike (the last, shorter, fewer). So forward peaks in the second-to-last
    or the last tile, and backward, which runs the tiles last to first, in the second or the first (where the
    parameters' gradients, summed over the tiles, leave autograd's buffer one by one). The others are traced as
    `_HeldTile`: the output and the input gradient a tile holds, without its intermediates. Tests measure every tile
    against the trace (tests/test_tiling.py).
    """
    if first_rounds_only(flat) is None or n_tiles <= 4:
        return range(n_tiles)
    return {0, 1, n_tiles - 2, n_tiles - 1}


class _HeldTile(torch.autograd.Function):
    """A tile's output (shape and dtype of the first tile's) and, in backward, its input's gradient: what a tiled MLP
    holds of a tile between its neighbours, for the planner's trace (`traced_tiles`)."""

    @staticmethod
    def forward(ctx: Any, tile: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        ctx.tile_shape, ctx.tile_dtype = tile.shape, tile.dtype
        return tile.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.new_empty(ctx.tile_shape, dtype=ctx.tile_dtype), None, None


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


# -- the RMSNorm by tiles: its 16-bit input and one scale per token saved, nothing in fp32 ----------------------

_NORM_ORIGINAL = "_cm_untiled_norm_forward"


class _TiledRMSNorm(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), computed in fp32 by tiles of tokens.

    Saves x (the norm's input, which the residual stream keeps alive anyway), the weight and one fp32 scale
    per token; backward recomputes the normalised tile from them. transformers' Llama-style RMSNorm runs the
    same arithmetic as separate autograd ops, which save an fp32 copy of the input (4 bytes per value, twice
    a 16-bit input) and, in backward, hold several fp32 tokens x hidden tensors at once.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, tile: int) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
        out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)  # (tokens, 1)
        for start in chunk_starts(flat.shape[0], tile, flat):
            xf = flat[start:start + tile].float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[start:start + tile] = r
            out[start:start + tile] = weight * (xf * r).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.tile = tile
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, rstd = ctx.saved_tensors
        tile = ctx.tile
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(flat)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        w = weight.float()
        for start in chunk_starts(flat.shape[0], tile, flat):
            r = rstd[start:start + tile]
            xhat = flat[start:start + tile].float() * r
            gt = g[start:start + tile].float()
            gy = gt * w  # the gradient of the normalised tile
            grad_x[start:start + tile] = r * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
            if grad_w is not None:
                grad_w += (gt * xhat.to(x.dtype).float()).sum(0)
        return (grad_x.view_as(x), grad_w.to(weight.dtype) if grad_w is not None else None, None, None)


def tiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tile_tokens: int) -> torch.Tensor:
    """Return transformers' Llama-style RMSNorm of `x` computed by tiles of `tile_tokens` tokens (`_TiledRMSNorm`)."""
    check_tile_tokens(tile_tokens, "norm_tile_tokens")
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return _TiledRMSNorm.forward(_NoCtx(), x, weight, eps, tile_tokens)
    return _TiledRMSNorm.apply(x, weight, eps, tile_tokens)


class _NoCtx:
    """A stand-in autograd context for `_TiledRMSNorm.forward` run without gradients."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def find_rmsnorms(model: nn.Module) -> list[nn.Module]:
    """Return the model's Llama-style RMSNorms: transformers modules named ...RMSNorm with a `weight` and a
    `variance_epsilon` that compute `weight * normalised.to(input dtype)` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
    SmolLM). Gemma's (1 + weight, all in fp32) are not of that form and are left out.

    Raises ValueError when the model has none (the reference model and GPT-2 use LayerNorm).
    """
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and "Gemma" not in type(m).__name__
             and isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")]
    if not norms:
        raise ValueError(f"norm_tile_tokens: {type(model).__name__} has no Llama-style RMSNorm (a module named "
                         "...RMSNorm with weight and variance_epsilon; Llama, Mistral, Qwen2, SmolLM have them); leave "
                         "norm_tile_tokens=None")
    return norms


def apply_tiled_norm(model: nn.Module, tile_tokens: int | None) -> nn.Module:
    """Run every Llama-style RMSNorm of the model by tiles of `tile_tokens` tokens (`tiled_rms_norm`), in place.

    Each norm then saves only its 16-bit input and one fp32 scale per token for backward, where transformers'
    norm saves an fp32 copy of its input (Llama-3.1-8B at 49,152 tokens: 805 MB per norm, two per block) and
    holds fp32 tokens x hidden temporaries in backward. Liger Kernel's and Unsloth's fused RMSNorm kernels save
    the same two tensors; this is plain PyTorch, so it runs on a T4, on the CPU and under the planner's fake
    tensors. `tile_tokens=None` removes it. Returns the model.

    Example:
        >>> apply_tiled_norm(model, 4096)  # or Recipe(norm_tile_tokens=4096)
    """
    check_tile_tokens(tile_tokens, "norm_tile_tokens")
    if tile_tokens is None:
        return remove_tiled_norm(model)
    for norm in find_rmsnorms(model):
        setattr(norm, _NORM_ORIGINAL, norm.__dict__.get(_NORM_ORIGINAL, norm.forward))

        def forward(hidden_states: torch.Tensor, _norm: nn.Module = norm) -> torch.Tensor:
            return tiled_rms_norm(hidden_states, _norm.weight, _norm.variance_epsilon, tile_tokens)

        norm.forward = forward
    return model


def remove_tiled_norm(model: nn.Module) -> nn.Module:
    """Undo `apply_tiled_norm`; return the model (a no-op on a model without it)."""
    for m in model.modules():
        original = m.__dict__.pop(_NORM_ORIGINAL, None)
        if original is None:
            continue
        if getattr(original, "__func__", None) is type(m).forward:
            m.__dict__.pop("forward", None)
        else:
            m.forward = original
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
    from colab_memopt.core.measure import measure_step

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
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=config).to(device)
    positions = torch.arange(tokens, device=device)[None]
    cos, sin = rotary(torch.empty(1, device=device), positions)  # (1, tokens, head_dim) each
    return {"position_embeddings": (cos, sin)}
