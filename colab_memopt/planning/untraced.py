"""The lines of a plan that its trace does not produce: the CUDA workspaces, host RAM.

On a CUDA target a step holds cuBLAS and cuBLASLt workspaces (`cuda_workspace_costs`). What CUDA's kernels free inside
one op (SDPA's math kernel's copies and masks) the trace counts at the moment they live (`tracker.in_op_bytes`); where
SDPA runs its math kernel, the plan warns (`math_attention_warning`). In host RAM: this process, the data
pipeline, ZeRO-Offload's states, offloaded checkpoints (`offloaded_checkpoint_bytes`) and loading a checkpoint.
Each is a `Cost` with where its figure comes from; bitsandbytes' own lines are in `colab_memopt.planning.quantized`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from colab_memopt.planning import estimate
from colab_memopt.core.measure import format_bytes, host_memory
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.prediction import Cost
from colab_memopt.planning.targets import _CUBLAS_SOURCE, Target, cublas_workspace_bytes, cublaslt_workspace_bytes


def cuda_workspace_costs(compute_capability: tuple[int, int] | None) -> list[Cost]:
    """Return the plan lines of the cuBLAS and cuBLASLt workspaces a training step holds on CUDA.

    torch keys each workspace by (cuBLAS handle, stream) (`setWorkspaceForHandle`,
    `cublas_handle_stream_to_workspace` in CublasHandlePool.cpp) and a handle belongs to one thread
    (`thread_local` pool window in `getCurrentCUDABlasHandle`). A step runs its matmuls on two threads:
    forward (and the optimizer) on the caller's, backward on the autograd engine's device thread, so it
    holds two cuBLAS workspaces; the forward's biased Linears (`addmm` through cuBLASLt) add a cuBLASLt
    workspace. All are allocated through the caching allocator at the first step and kept: inside
    `max_memory_allocated`, outside a later step's foreign-corrected peak. Sizes are torch's defaults for the
    capability: a plan does not read this machine's `CUBLAS_WORKSPACE_CONFIG` and the like (`cublas_workspace_bytes`
    and `cublaslt_workspace_bytes` take a run's own values).
    """
    workspace, source = cublas_workspace_bytes(compute_capability)
    lt, lt_source = cublaslt_workspace_bytes()
    costs = [
        Cost("cuBLAS workspace", workspace, f"forward thread's handle: {source}", in_allocator=True),
        Cost("cuBLAS workspace (autograd thread)", workspace,
             f"backward's matmuls run on the autograd engine's device thread, whose own cuBLAS handle gets its own "
             f"workspace (handles are per thread, workspaces per (handle, stream): {_CUBLAS_SOURCE}); {source}",
             in_allocator=True),
    ]
    if lt:
        costs.append(Cost("cuBLASLt workspace", lt, f"addmm with a bias (nn.Linear) runs cuBLASLt: {lt_source}", in_allocator=True))
    return costs


def _grouped_query(model: Any) -> bool:
    """Return whether a transformers model has fewer key/value heads than query heads (grouped-query attention)."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    config = get() if callable(get) else config
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv, int) and kv < heads


def math_attention_warning(target: Target) -> str:
    """Return the warning of a plan whose attention runs SDPA's math kernel on the target: T x T scores per layer."""
    return (f"attention runs SDPA's math kernel on {target.name}: T x T scores per layer (planned); for a "
            "grouped-query model, colab_memopt.techniques.attention.repeat_kv_for_sdpa(model) runs the O(T) kernel")


def _host_costs(recipe: Recipe, batch: int, seq_len: int, n_params: int = 0) -> list[Cost]:
    rss = host_memory().rss_bytes
    costs = [
        Cost("this process", rss, "measured: this Python process's RSS now (torch, the model code, the notebook)"),
        Cost("data pipeline", estimate.dataloader_prefetch_bytes(1, 1, batch, seq_len, 8),
             "one batch of int64 token ids in flight (estimate.dataloader_prefetch_bytes)"),
    ]
    if recipe.offload_optimizer or recipe.offload_param:  # notebook 10: ZeRO-Offload keeps model states in host RAM
        ds = estimate.zero_offload_bytes(n_params, zero_stage=recipe.zero_stage, offload_optimizer=recipe.offload_optimizer,
                                         offload_param=recipe.offload_param)
        costs.append(Cost("offloaded states", ds["host_bytes"], "DeepSpeed's estimate_zero*_model_states_mem_needs (estimate.zero_offload_bytes)"))
    return costs


def offloaded_checkpoint_bytes(model: nn.Module, batch: int, seq_len: int, recipe: Recipe, *, pinned: bool = False) -> int:
    """Return the host RAM of `recipe`'s offloaded checkpoints by rule: one (micro-batch x seq x hidden)
    input per block (0 unless checkpointing="offload"); a traced plan counts the traced bytes instead. The inputs are the residual
    stream, fp32 under autocast (fp32 weights and norms; so too after peft's prepare_model_for_kbit_training),
    2 bytes with pure 16-bit weights or a 16-bit frozen base (`Recipe.base_dtype`). `pinned` (a CUDA target): each input is a pinned host copy, which
    torch's caching host allocator rounds up to a power of two (`offload.pinned_bytes`); the offloader stores
    it in pieces of power-of-two bytes (`offload.power_of_two_pieces`), so the rounding adds nothing.
    Blocks kept on the device (`Recipe.offload_keep_blocks`) hold no host bytes; with checkpoint_interval N, one
    input per N blocks."""
    from colab_memopt.techniques.offload import pinned_bytes, power_of_two_pieces

    if recipe.checkpointing != "offload":
        return 0
    dims = estimate._dims(model)
    micro = -(-batch // recipe.accumulation_steps)
    # a 16-bit frozen base (base_dtype) under autocast makes the residual stream 16-bit too
    width = 2 if recipe.precision in ("bf16", "fp16") or recipe.base_dtype is not None else 4
    one = micro * seq_len * dims["hidden"] * width
    # stored in pieces of power-of-two bytes (offload.power_of_two_pieces), which the pinned allocator takes unrounded
    per_block = sum(pinned_bytes(n * width) for n in power_of_two_pieces(one // width)) if pinned else one
    stored = -(-dims["layers"] // recipe.checkpoint_interval)  # one input per segment of checkpoint_interval blocks
    return max(0, stored - recipe.offload_keep_blocks) * per_block


_PINNED_NOTE = ("; each a pinned copy stored in pieces of power-of-two bytes, which torch's caching host allocator "
                "(ATen/core/CachingHostAllocator.h: PowerOf2Ceil) takes without rounding, kept cached between steps")


def _load_costs(spec: Any, recipe: Recipe, target: Target) -> list[Cost]:
    """Return the host RAM of loading a checkpoint (a hub id, or a folder with weights), by `loading.load_model`'s path;
    with int8 weights by `loading.load_int8`'s, for our names too (their published checkpoints are 16 GB at 8B)."""
    from colab_memopt.training.checkpoints import has_weights
    from colab_memopt.training.loadplan import load_host_bytes
    from colab_memopt.training.presets import BF16_TARGETS

    if not has_weights(spec) and not (recipe.weight_dtype == "int8" and spec.config is not None):
        return []
    load = load_host_bytes(spec, recipe, "cuda" if target.cuda else "cpu", native_bf16=target.name in BF16_TARGETS)
    return [Cost("loading weights", load.host_bytes,
                 f"loading.load_host_bytes: {load.path}, {load.load_dtype} (the classic load would need "
                 f"{format_bytes(load.classic_host_bytes)})")]
