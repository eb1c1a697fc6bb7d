"""The recipe: which memory-saving techniques a training step applies.

One dataclass, read by the training step (`train.make_train_step`), by `recipe.build` (which
prepares the model and optimizer) and by the planner (`plan`), so a measurement and a prediction of
the same recipe run the same code. Each technique notebook adds its fields here, each with its
allowed values checked in `validate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques import zero
from colab_memopt.techniques.attention import REPEATED_KV_ATTENTION, repeat_kv_for_sdpa
from colab_memopt.techniques.checkpointing import POLICIES, apply_checkpointing, find_block_stacks, find_blocks
from colab_memopt.techniques.compression import MODES as COMPRESSION_MODES
from colab_memopt.techniques.compression import check_compressible, compress_activations
from colab_memopt.techniques.loss import apply_chunked_loss, check_chunkable, check_head_not_adapted
from colab_memopt.techniques.offload import STRATEGIES, LayerStreamer, check_streamable, streamer_of
from colab_memopt.techniques.lowstate import LOW_STATE_OPTIMIZERS, PROJECTED, badam_blocks, check_rank
from colab_memopt.techniques.optimizers import FUSED_BACKWARD_OPTIMIZERS, OPTIMIZERS, OptimizerInBackward, make_optimizer
from colab_memopt.techniques.phases import OFFLOAD_STRATEGIES
from colab_memopt.core.env import bf16_native
from colab_memopt.techniques.precision import (
    BASE_DTYPE_PRECISION,
    FORWARD_PRECISIONS,
    PURE_PRECISIONS,
    adapters_to_fp32,
    check_base_dtype,
    check_native_bf16,
    check_precision,
    half_frozen_base,
    prepare_model,
)
from colab_memopt.techniques.rounding import UpdateRounding, check_update_rounding
from colab_memopt.techniques.tiling import apply_tiled_mlp, apply_tiled_norm, check_tile_tokens, find_mlps, find_rmsnorms
from colab_memopt.techniques.int8train import INT8_RULES, check_weight_dtype, int8_weights, make_int8_optimizer, quantize_model_int8
from colab_memopt.techniques.quantization import (
    DEFAULT_LORA_TARGETS,
    SCHEMES,
    add_lora,
    check_lora_targets,
    check_quantizable,
    load_4bit_state,
    quantize_model,
    quantized_copy,
)
from colab_memopt.core.console import quiet


# What each Recipe field is applied by, per backend: 'torch' (`Recipe.build` and `train.make_train_step`
# on a plain module) and 'deepspeed' (a DeepSpeed engine: zero_stage >= 1 or offload_*). One source of
# truth: `Recipe.validate` refuses, by name, a field set away from its default on a backend that does not
# apply it, and `plan`, `doctor` and `build` all construct (so validate) the recipe first. A field missing
# here fails tests/test_recipe.py::test_every_field_has_a_backend_row; an empty row is applied by no step.
BACKENDS = ("torch", "deepspeed")
FIELD_BACKENDS: dict[str, tuple[str, ...]] = {
    "optimizer": ("torch", "deepspeed"),  # DeepSpeed: 'adamw' only (validate says so)
    "lr": ("torch", "deepspeed"),
    "attention": ("torch",),
    "optimizer_rank": ("torch",),
    "quantization": ("torch",),
    "quantization_phase": ("torch",),
    "lora_rank": ("torch",),
    "lora_targets": ("torch",),
    "base_dtype": ("torch",),
    "activation_compression": ("torch",),
    "compression_checkpointing": ("torch",),
    "phase_offload": ("torch",),
    "precision": ("torch",),
    "eval_precision": ("torch", "deepspeed"),  # `train.train`'s evaluation, under autocast, of either model
    "update_rounding": ("torch",),
    "checkpointing": ("torch",),
    "checkpoint_interval": ("torch",),
    "accumulation_steps": ("torch",),
    "attention_window": ("torch",),
    "layer_offload_active": ("torch",),
    "layer_offload_prefetch": ("torch",),
    "optimizer_state_offload": (),  # no training step reads it: `offload.OptimizerStateOffloader` does the work
    "zero_stage": ("deepspeed",),  # these three select the DeepSpeed backend
    "offload_optimizer": ("deepspeed",),
    "offload_param": ("deepspeed",),
    "loss_chunk_tokens": ("torch", "deepspeed"),  # installed on the module before the engine wraps it
    "mlp_tile_tokens": ("torch", "deepspeed"),  # installed on the module before the engine wraps it
    "norm_tile_tokens": ("torch", "deepspeed"),  # installed on the module before the engine wraps it
    "offload_keep_blocks": ("torch",),  # a split of checkpointing='offload', which DeepSpeed does not apply
    "weight_dtype": ("torch",),  # int8train's own in-backward update: validate refuses DeepSpeed by name first
}


@dataclass(frozen=True)
class Recipe:
    """Techniques applied to a training step. The defaults are plain fp32 training with AdamW.

    Attributes:
        optimizer: an optimizer name known to `optimizers.make_optimizer`.
        optimizer_rank: GaLore's and APOLLO's projection rank (`lowstate`); None: the method's default.
        lr: learning rate (> 0).
        quantization: None, or a scheme of `quantization.SCHEMES` applied to the linear layers (frozen).
        quantization_phase: 'all' quantizes the trained model's base (with LoRA: QLoRA); 'forward_only'
            keeps training in fp32 and quantizes only the copy `forward_model` returns for evaluation.
        lora_rank: 0 (no adapters) or the rank of peft LoRA adapters on `lora_targets`.
        lora_targets: module names that get adapters.
        base_dtype: None keeps LoRA's frozen base in fp32; 'fp16' (a T4) or 'bf16' (native bf16 only,
            compute capability >= 8.0) stores it in half precision, the adapters staying fp32. Needs
            lora_rank >= 1 and the matching autocast precision ('fp16-autocast' / 'bf16-autocast').
        activation_compression: None, or a mode of `compression.MODES` for the blocks' saved tensors.
        compression_checkpointing: also checkpoint each block, its saved input compressed (notebook 08).
        attention: None keeps the model's attention; 'sdpa', 'naive' or 'semiseparable' (notebook 13:
            causal semiseparable sequence mixing, parameter-free so it swaps in place) sets it
            (reference model only); 'sdpa_repeated_kv' (a transformers model) repeats grouped-query
            keys and values before SDPA (`attention.repeat_kv_for_sdpa`), so a T4 runs the O(T)
            memory-efficient kernel instead of math's T x T scores.
        precision: 'fp32', 'fp16-autocast' (with GradScaler), 'bf16-autocast', 'bf16' (pure bf16
            weights, gradients and optimizer state) or 'fp16' (pure fp16 weights and gradients, dynamic
            loss scaling; notebook 16) for the steps that compute gradients.
        update_rounding: how updates reach pure 16-bit weights (`rounding.UpdateRounding`): 'kahan'
            (one 16-bit compensation buffer per parameter), 'stochastic' (stochastic rounding, no
            state) or 'none' (round to nearest from an fp32 update). None: 'kahan' for 'fp16'; for
            'bf16' the optimizer steps the bf16 weights itself, as before this field existed.
            Refused for fp32 weights.
        eval_precision: precision of forward-only phases (evaluation): 'fp32', 'fp16-autocast' or
            'bf16-autocast'; None follows `precision` (see `forward_precision`).
        checkpointing: 'none', 'full', 'every_n', 'segments', 'selective' or 'offload' ('full' with each
            block's input kept in host memory; see `checkpointing`).
        checkpoint_interval: N for 'every_n' (every N-th block) and 'segments' (N blocks per segment); with
            'offload', one host copy per N blocks, each block checkpointed again inside (host RAM / N).
        accumulation_steps: micro-batches per optimizer step; the step's `batch_size` stays the
            effective batch.
        attention_window: sliding-window attention in tokens (reference model only); None: full causal.
        loss_chunk_tokens: None computes the loss from the full (tokens x vocab) logits; an integer computes
            it by chunks of that many tokens (`loss.apply_chunked_loss`: the reference model and transformers
            causal LMs), never holding the full logits or their gradient (notebook 17). 'auto': the planner
            chooses the chunk from the device memory its plan leaves at the loss (`loss.auto_chunk_tokens`);
            `plan(...).recipe` holds the number, which `build` needs (it refuses 'auto').
        mlp_tile_tokens: None runs each block's MLP on all tokens at once; an integer runs it by tiles of that
            many tokens, each recomputed in backward, so one tile's intermediate activations live at a time
            (`tiling.apply_tiled_mlp`, notebook 17).
        norm_tile_tokens: None keeps transformers' RMSNorm; an integer runs each Llama-style RMSNorm by tiles of
            that many tokens, saving only its 16-bit input and one fp32 scale per token (`tiling.apply_tiled_norm`;
            Liger's and Unsloth's fused RMSNorm save the same), not an fp32 copy of its input.
        offload_keep_blocks: under checkpointing='offload', how many blocks (the last ones, which backward
            reaches first) keep their input on the device; the others' inputs wait in host RAM. 0 offloads all.
    """

    optimizer: str = "adamw"
    lr: float = 1e-3
    attention: str | None = None
    # -- 06_lean_optimizers: `optimizer` takes every name of optimizers.OPTIMIZERS (8-bit, Lion, Adam-mini, ..._in_backward)
    # -- 16_full_finetuning_on_a_t4: the optimizers with almost no state (`lowstate`); GaLore's and APOLLO's
    # projection rank (None: the method's default, 128 for GaLore, 256 for APOLLO; APOLLO-Mini is rank 1)
    optimizer_rank: int | None = None
    # -- 07_weight_quantization
    quantization: str | None = None
    quantization_phase: str = "all"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    # LoRA's frozen base in half precision (None: fp32): half the bytes of weights that never update; the
    # adapters stay fp32
    base_dtype: str | None = None
    # -- 08_activation_compression
    activation_compression: str | None = None
    compression_checkpointing: bool = False
    # notebook 14 (phases.py): None trains ordinarily; a strategy name ('none', 'cpu', 'pinned_cpu',
    # 'int8', 'drop') trains phase-aware (full and predicted steps) with that optimizer-state offload.
    phase_offload: str | None = None
    # 02_mixed_precision
    precision: str = "fp32"
    eval_precision: str | None = None
    # 16_full_finetuning_on_a_t4: the update of pure 16-bit weights (rounding.UPDATE_ROUNDINGS)
    update_rounding: str | None = None
    # 03_activation_checkpointing
    checkpointing: str = "none"
    checkpoint_interval: int = 1
    # 04_gradient_accumulation
    accumulation_steps: int = 1
    # 05_memory_efficient_attention
    attention_window: int | None = None
    # -- 09_cpu_offload: stream the blocks from host memory (`offload.LayerStreamer`); 0 keeps them on the device
    layer_offload_active: int = 0
    layer_offload_prefetch: int = 1
    # strategy for the optimizer state in phases without backward (`offload.OptimizerStateOffloader`)
    optimizer_state_offload: str = "keep"
    # -- 10_deepspeed_zero: a DeepSpeed engine (`zero.initialize`) with this ZeRO stage and offload
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    # -- 17_long_context: the loss by chunks of tokens (`loss.apply_chunked_loss`); None: the plain loss
    loss_chunk_tokens: int | str | None = None
    # each block's MLP by sequence tiles; under 'offload', how many blocks' inputs stay on the device
    mlp_tile_tokens: int | None = None
    # each Llama-style RMSNorm by tiles of tokens, saving its 16-bit input and one scale per token (`tiling`)
    norm_tile_tokens: int | None = None
    offload_keep_blocks: int = 0
    # -- 16_full_finetuning_on_a_t4: None keeps the weights as `precision` says; 'int8' stores every
    # Linear and Embedding weight as int8 with fp32 group scales, updated inside backward with stochastic rounding
    # by the `optimizer` rule 'lomo' or 'adalomo' (`int8train`); needs precision 'bf16' or 'fp16'
    weight_dtype: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is not allowed."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"recipe.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or self.lr != self.lr or self.lr == float("inf"):
            raise ValueError(f"recipe.lr must be a finite number > 0, got {self.lr!r}")
        if self.optimizer.endswith("_in_backward") and self.precision == "fp16-autocast":
            raise ValueError(
                f"recipe.optimizer={self.optimizer!r} steps inside backward, before GradScaler can unscale the fp16 "
                "gradients or skip an overflow, so it cannot train under precision='fp16-autocast'; use "
                f"optimizer={self.optimizer.removesuffix('_in_backward')!r} with fp16, or this optimizer with 'fp32', "
                "'bf16-autocast' (native bf16: compute capability >= 8.0) or 'bf16'"
            )
        if self.optimizer.endswith("_in_backward") and self.accumulation_steps != 1:
            raise ValueError(
                f"recipe.optimizer={self.optimizer!r} updates the weights at every backward, so it cannot accumulate "
                f"gradients: use accumulation_steps=1 or optimizer={self.optimizer.removesuffix('_in_backward')!r} "
                f"(got accumulation_steps={self.accumulation_steps!r})"
            )
        if not self.lr > 0:
            raise ValueError(f"recipe.lr must be > 0, got {self.lr}")
        self._validate_low_state()
        # 07_weight_quantization
        if self.quantization is not None and self.quantization not in SCHEMES:
            raise ValueError(f"recipe.quantization must be None or one of {SCHEMES}, got {self.quantization!r}")
        if self.quantization_phase not in ("all", "forward_only"):
            raise ValueError(f"recipe.quantization_phase must be 'all' or 'forward_only', got {self.quantization_phase!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"recipe.lora_rank must be an integer >= 0, got {self.lora_rank!r}")
        if not isinstance(self.lora_targets, tuple) or not self.lora_targets or not all(isinstance(t, str) for t in self.lora_targets):
            raise ValueError(f"recipe.lora_targets must be a non-empty tuple of module names, got {self.lora_targets!r}")
        if self.quantization is not None and self.quantization_phase == "all" and self.lora_rank == 0:
            raise ValueError(
                f"recipe.quantization={self.quantization!r} freezes the quantized weights: set lora_rank >= 1 "
                "(QLoRA) or quantization_phase='forward_only'"
            )
        if self.lora_rank and self.quantization in ("int8_tensor", "int8_channel") and self.quantization_phase == "all":
            raise ValueError(
                f"recipe.lora_rank needs a base peft supports: quantization None, 'bnb_int8', 'nf4' or 'fp4', got {self.quantization!r}"
            )
        check_base_dtype(self.base_dtype, name="recipe.base_dtype")
        if self.base_dtype is not None and not self.lora_rank:
            raise ValueError(
                f"recipe.base_dtype={self.base_dtype!r} stores LoRA's frozen base in half precision: set lora_rank >= 1 "
                "(full fine-tuning keeps fp32 master weights; pure bf16 training is precision='bf16')"
            )
        if self.base_dtype is not None and self.precision != BASE_DTYPE_PRECISION[self.base_dtype]:
            raise ValueError(
                f"recipe.base_dtype={self.base_dtype!r} computes under autocast: set precision="
                f"{BASE_DTYPE_PRECISION[self.base_dtype]!r}, got {self.precision!r}"
            )
        # 08_activation_compression
        if self.activation_compression is not None and self.activation_compression not in COMPRESSION_MODES:
            raise ValueError(
                f"recipe.activation_compression must be None or one of {COMPRESSION_MODES}, got {self.activation_compression!r}"
            )
        if not isinstance(self.compression_checkpointing, bool):
            raise ValueError(f"recipe.compression_checkpointing must be True or False, got {self.compression_checkpointing!r}")
        if self.attention not in (None, "sdpa", "naive", "semiseparable", REPEATED_KV_ATTENTION):
            raise ValueError(
                f"recipe.attention must be None, 'sdpa', 'naive', 'semiseparable' or {REPEATED_KV_ATTENTION!r}, "
                f"got {self.attention!r}"
            )
        if self.phase_offload is not None and self.phase_offload not in OFFLOAD_STRATEGIES:
            raise ValueError(
                f"recipe.phase_offload must be None or one of {OFFLOAD_STRATEGIES}, got {self.phase_offload!r}"
            )
        if self.phase_offload is not None and (self.accumulation_steps != 1 or self.precision != "fp32"):
            raise ValueError(
                f"recipe.phase_offload={self.phase_offload!r} runs phase-aware training with its own precision per "
                f"phase: leave accumulation_steps=1 and precision='fp32' (got {self.accumulation_steps}, {self.precision!r})"
            )
        if self.checkpointing != "none" and self.compression_checkpointing:
            raise ValueError(
                f"recipe.checkpointing={self.checkpointing!r} and compression_checkpointing=True both checkpoint the "
                "blocks: use one (compression_checkpointing checkpoints every block with its input compressed)"
            )
        # 02-05: each technique module checks its own values; the messages name the recipe field.
        check_precision(self.precision, name="recipe.precision")
        if self.update_rounding is not None:
            check_update_rounding(self.update_rounding, name="recipe.update_rounding")
            if self.precision not in PURE_PRECISIONS:
                raise ValueError(
                    f"recipe.update_rounding={self.update_rounding!r} rounds updates into 16-bit weights, but "
                    f"precision={self.precision!r} keeps fp32 weights: use precision 'bf16' or 'fp16', or leave "
                    "update_rounding=None"
                )
        if self.optimizer in FUSED_BACKWARD_OPTIMIZERS:
            self._check_fused_backward()
        if self.precision == "fp16" and self.optimizer.endswith("_in_backward"):
            raise ValueError(
                f"recipe.optimizer={self.optimizer!r} steps inside backward, before the loss scaler can unscale "
                "the fp16 gradients or skip an overflow, so it cannot train under precision='fp16'; use "
                f"optimizer={self.optimizer.removesuffix('_in_backward')!r}, or precision='bf16'"
            )
        if self.eval_precision is not None:
            check_precision(self.eval_precision, allowed=FORWARD_PRECISIONS, name="recipe.eval_precision")
        if self.checkpointing not in POLICIES:
            raise ValueError(f"recipe.checkpointing must be one of {POLICIES}, got {self.checkpointing!r}")
        ci = self.checkpoint_interval
        if isinstance(ci, bool) or not isinstance(ci, int) or ci < 1:
            raise ValueError(f"recipe.checkpoint_interval must be an integer >= 1, got {ci!r}")
        acc = self.accumulation_steps
        if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
            raise ValueError(f"recipe.accumulation_steps must be an integer >= 1, got {acc!r}")
        w = self.attention_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"recipe.attention_window must be None or an integer >= 1 (tokens), got {w!r}")
        # 17_long_context
        c = self.loss_chunk_tokens
        if c is not None and c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"recipe.loss_chunk_tokens must be None or an integer >= 1 (tokens per chunk), or 'auto', got {c!r}")
        check_tile_tokens(self.mlp_tile_tokens, name="recipe.mlp_tile_tokens")
        check_tile_tokens(self.norm_tile_tokens, name="recipe.norm_tile_tokens")
        k = self.offload_keep_blocks
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"recipe.offload_keep_blocks must be an integer >= 0 (blocks), got {k!r}")
        if k and self.checkpointing == "offload" and ci > 1:
            raise ValueError(f"recipe.offload_keep_blocks={k} splits one checkpoint per block between device and host: "
                             f"use checkpoint_interval=1 with it, or offload_keep_blocks=0 (got checkpoint_interval={ci})")
        if k and self.checkpointing != "offload":
            raise ValueError(f"recipe.offload_keep_blocks={k} splits the checkpoints of checkpointing='offload' between "
                             f"device and host: set checkpointing='offload' (got {self.checkpointing!r}) or leave it 0")
        # 09_cpu_offload
        for name in ("layer_offload_active", "layer_offload_prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"recipe.{name} must be an integer >= 0, got {value!r}")
        if self.optimizer_state_offload not in STRATEGIES:
            raise ValueError(f"recipe.optimizer_state_offload must be one of {STRATEGIES}, got {self.optimizer_state_offload!r}")
        # 10_deepspeed_zero
        zero.check_zero_fields(self.zero_stage, self.offload_optimizer, self.offload_param, prefix="recipe.")
        if self.uses_deepspeed and self.optimizer != "adamw":
            raise ValueError(f"recipe.zero_stage / offload run DeepSpeed with AdamW: set optimizer='adamw', got {self.optimizer!r}")
        if self.uses_deepspeed and (self.precision != "fp32" or self.accumulation_steps != 1):
            raise ValueError(
                "recipe.precision and accumulation_steps do not reach a DeepSpeed engine: leave them at 'fp32' and 1 "
                f"and pass precision= and grad_accum_steps= to zero.deepspeed_config (got {self.precision!r}, {self.accumulation_steps})"
            )
        if self.uses_deepspeed and self.layer_offload_active:
            raise ValueError("recipe.layer_offload_active and DeepSpeed (zero_stage, offload_*) cannot be combined: pick one")
        self._validate_weight_dtype()
        self._validate_backend()

    @property
    def backend(self) -> str:
        """Return the backend that trains this recipe: 'deepspeed' (zero_stage >= 1 or offload_*) or 'torch'."""
        return "deepspeed" if self.uses_deepspeed else "torch"

    def _validate_backend(self) -> None:
        """Refuse, by name, every field set away from its default that this recipe's backend does not apply
        (`FIELD_BACKENDS`): a recipe either does what it says or is refused."""
        backend = self.backend
        for f in fields(self):
            value, default = getattr(self, f.name), f.default
            if value == default or backend in FIELD_BACKENDS.get(f.name, BACKENDS):
                continue
            if not FIELD_BACKENDS.get(f.name):
                raise ValueError(f"recipe.{f.name}={value!r} is applied by no training step; leave it at {default!r}"
                                 + (" and use offload.OptimizerStateOffloader around evaluation"
                                    if f.name == "optimizer_state_offload" else ""))
            raise ValueError(
                f"recipe.{f.name}={value!r} is not applied by a DeepSpeed engine (zero_stage={self.zero_stage}, "
                f"offload_optimizer={self.offload_optimizer}, offload_param={self.offload_param}): Recipe.build would "
                f"skip it while plan counted it; leave {f.name} at {default!r}, or train without DeepSpeed"
                if backend == "deepspeed" else
                f"recipe.{f.name}={value!r} needs the DeepSpeed backend (it is applied only by a DeepSpeed engine)")

    def _validate_weight_dtype(self) -> None:
        """Refuse what 8-bit trainable weights (`int8train`) cannot do, naming the values."""
        check_weight_dtype(self.weight_dtype, name="recipe.weight_dtype")
        if self.weight_dtype is None:
            return
        name = f"recipe.weight_dtype={self.weight_dtype!r}"
        if self.optimizer not in INT8_RULES:
            raise ValueError(f"{name} updates the int8 weights inside backward with the rule 'lomo' (SGD) or 'adalomo': "
                             f"set optimizer to one of {INT8_RULES}, got {self.optimizer!r}")
        if self.precision not in PURE_PRECISIONS:
            raise ValueError(f"{name} dequantizes into 16-bit compute: set precision 'bf16' or 'fp16' (a T4), "
                             f"got {self.precision!r}")
        if self.uses_deepspeed or self.zero_stage:
            raise ValueError(f"{name} trains its own int8 weights: leave zero_stage=0 and offload_* False")
        if self.quantization is not None:
            raise ValueError(f"{name} already stores the weights in 8 bits, which quantization cannot quantize again: "
                             f"leave quantization None (got {self.quantization!r}, "
                             f"quantization_phase={self.quantization_phase!r})")

    def _validate_low_state(self) -> None:
        """Refuse what the optimizers with almost no state (`lowstate`) cannot do, naming the values."""
        base = self.optimizer.removesuffix("_in_backward")
        try:
            check_rank(base, self.optimizer_rank)
        except ValueError as err:
            raise ValueError(f"recipe.{err}") from None
        if base not in LOW_STATE_OPTIMIZERS:
            return
        if self.lora_rank and (base in PROJECTED or base == "badam"):
            what = "projects the gradients of the full 2-D weights" if base in PROJECTED else "trains blocks of the full model"
            raise ValueError(f"recipe.optimizer={self.optimizer!r} {what}, not LoRA adapters: use lora_rank=0, or an "
                             f"optimizer such as 'adamw8bit' with lora_rank={self.lora_rank}")
        if self.layer_offload_active:
            raise ValueError(f"recipe.optimizer={self.optimizer!r} cannot step the streamed blocks' host copies "
                             f"(layer_offload_active={self.layer_offload_active}): use optimizer='adamw' or 'adamw8bit' there")
        if self.phase_offload is not None:
            raise ValueError(f"recipe.optimizer={self.optimizer!r} and phase_offload={self.phase_offload!r} cannot be "
                             "combined: phase-aware training offloads AdamW-like moments")

    @property
    def uses_deepspeed(self) -> bool:
        """Return True when the step runs in a DeepSpeed engine (zero_stage >= 1 or any offload)."""
        return self.zero_stage > 0 or self.offload_optimizer or self.offload_param

    def _check_fused_backward(self) -> None:
        """Refuse what LOMO / AdaLomo (lomo-optim: the update inside their own backward) cannot do."""
        name = f"recipe.optimizer={self.optimizer!r}"
        if self.accumulation_steps != 1:
            raise ValueError(f"{name} updates the weights inside every backward, so it cannot accumulate gradients: "
                             f"use accumulation_steps=1 (got {self.accumulation_steps!r})")
        if self.precision == "fp16-autocast":
            raise ValueError(f"{name} updates inside backward, before a GradScaler could unscale or skip: use "
                             "precision='fp16' (LOMO scales an fp16 loss itself; AdaLomo by a fixed 2**10) or 'bf16'")
        if self.update_rounding is not None:
            raise ValueError(f"{name} writes its fp32 update into the weights itself (round to nearest): leave "
                             f"update_rounding=None (got {self.update_rounding!r})")
        if self.lora_rank or self.quantization is not None and self.quantization_phase == "all":
            raise ValueError(f"{name} is full fine-tuning (it hooks and keeps state for every parameter): leave "
                             "lora_rank=0 and quantization None (or quantization_phase='forward_only')")
        if self.phase_offload is not None or self.layer_offload_active:
            raise ValueError(f"{name} runs its own backward: leave phase_offload=None and layer_offload_active=0")

    @property
    def rounding_mode(self) -> str | None:
        """Return the update rounding `build` applies: None (the optimizer steps the weights as they are)
        or a mode of `rounding.UPDATE_ROUNDINGS` (see `update_rounding`)."""
        if self.precision not in PURE_PRECISIONS or self.optimizer in FUSED_BACKWARD_OPTIMIZERS:
            return None
        if self.update_rounding is not None:
            return self.update_rounding
        return "kahan" if self.precision == "fp16" else None

    @property
    def untraceable_reason(self) -> str | None:
        """Return why the planner cannot trace this recipe on fake tensors (None when it can)."""
        if self.uses_deepspeed:
            return "DeepSpeed engines (zero_stage, offload_optimizer, offload_param) need a process group and real tensors"
        if self.layer_offload_active:
            return "layer streaming resizes tensor storage, which fake tensors do not model"
        return None

    def forward_precision(self) -> str:
        """Return the precision of forward-only phases: `eval_precision`, else the training one's autocast.

        Pure 'bf16' weights compute in bf16 anyway, so their evaluation needs no autocast: 'fp32' here.
        """
        if self.eval_precision is not None:
            return self.eval_precision
        return self.precision if self.precision in FORWARD_PRECISIONS else "fp32"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Recipe:
        """Return a recipe from a dict, rejecting unknown fields by name."""
        if not isinstance(values, dict):
            raise TypeError(f"recipe must be a Recipe or a dict of its fields, got {type(values).__name__} {values!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; known fields: {sorted(known)}")
        if isinstance(values.get("lora_targets"), list):  # JSON has no tuples
            values = {**values, "lora_targets": tuple(values["lora_targets"])}
        return cls(**values)

    @classmethod
    def preset(cls, name: str, *, target: Any = "t4", mode: str = "full", model: str | None = None,
               **overrides: Any) -> Recipe:
        """Return a preset recipe ('selective-ckpt', 'ckpt-every-8', 'ckpt-every-4', 'ckpt-every-2-paged'; see `presets`).

        `mode` is 'full', 'lora' or 'qlora' (`model`, a real architecture's name, picks its LoRA target
        layers); `target` picks fp16 (T4) or bf16 autocast; explicit
        field overrides apply last, e.g. `Recipe.preset('ckpt-every-8', accumulation_steps=4)`.
        """
        from colab_memopt.training.presets import preset_fields

        return cls.from_dict(preset_fields(name, target=target, mode=mode, model=model, **overrides))

    def with_(self, **changes: Any) -> Recipe:
        """Return a copy with fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict."""
        return asdict(self)

    def changed(self) -> dict[str, Any]:
        """Return the fields that differ from the defaults (plain fp32 AdamW), in field order.

        Example:
            >>> Recipe(precision="fp16", optimizer="lomo").changed()
            {'optimizer': 'lomo', 'precision': 'fp16'}
        """
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def __str__(self) -> str:
        """Return `Recipe(...)` with only the fields that differ from the defaults (`repr` keeps every field)."""
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError, with `build`'s own message, where this recipe cannot be applied to `model`.

        `build` calls it first, and so does the planner (on a meta-device copy of the model), so a recipe
        that cannot run is refused before anything is planned. It changes nothing.
        """
        if streamer_of(model) is not None:  # a recipe with layer_offload_active was built on it and still streams
            raise ValueError(f"this {type(model).__name__}'s blocks already stream from host memory (a recipe with "
                             "layer_offload_active was built on it): build on a fresh model, or end streaming first "
                             "with opt.streamer.materialize() (opt: the optimizer that build returned)")
        loaded_int8 = int8_weights(model)
        if loaded_int8 and all(w.optimizer is None for w in loaded_int8):  # loaded as int8 (loading.load_int8)
            if self.weight_dtype != "int8":
                raise ValueError(f"this {type(model).__name__} holds int8 weights (load_int8 loaded it so): build it "
                                 f"with weight_dtype='int8', got weight_dtype={self.weight_dtype!r}")
        elif loaded_int8:  # a recipe with weight_dtype='int8' was built on it: its layers are int8 already
            raise ValueError(f"this {type(model).__name__} is already built with weight_dtype='int8' (its linear and "
                             "embedding layers hold int8 weights): build on a fresh model, or keep training with the "
                             "optimizer that first build returned")
        if self.uses_deepspeed:  # DeepSpeed wraps any module
            return
        if self.attention == REPEATED_KV_ATTENTION:
            with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
                from transformers import PreTrainedModel

            if not isinstance(model, PreTrainedModel):
                raise ValueError(f"recipe.attention={REPEATED_KV_ATTENTION!r} applies to a transformers model, got "
                                 f"{type(model).__name__}; leave it None")
            if self.attention_window is not None:
                raise ValueError(f"recipe.attention_window={self.attention_window} applies to the reference model only: "
                                 f"attention={REPEATED_KV_ATTENTION!r} keeps the model's own causal attention; leave "
                                 "attention_window None")
        elif (self.attention is not None or self.attention_window is not None) and not hasattr(model, "blocks"):
            raise ValueError("recipe.attention and attention_window apply to the reference model only; leave them None")
        if self.quantization is not None and self.quantization_phase == "all":
            check_quantizable(model)
        if self.lora_rank:
            check_lora_targets(model, self.lora_targets)
        if self.activation_compression is not None or self.compression_checkpointing:
            check_compressible(model)
        if self.checkpointing != "none":
            find_blocks(model)
        if self.offload_keep_blocks:
            total = sum(len(blocks) for blocks in find_block_stacks(model))
            if self.offload_keep_blocks > total:
                raise ValueError(f"recipe.offload_keep_blocks={self.offload_keep_blocks} exceeds the model's {total} "
                                 f"blocks: use 0 to {total} (how many of the last blocks keep their input on the device)")
        if self.layer_offload_active:
            check_streamable(model)
        if self.optimizer == "badam":
            badam_blocks(model)  # BAdam trains one of the model's repeated blocks at a time
        if self.loss_chunk_tokens is not None:
            check_chunkable(model)
            if self.lora_rank:  # the adapters come later in build: refuse a LoRA-wrapped head now, as build would
                check_head_not_adapted(model, self.lora_targets)
        if self.mlp_tile_tokens is not None:
            find_mlps(model)
        if self.norm_tile_tokens is not None:
            find_rmsnorms(model)

    def build(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Apply the recipe's model-side techniques and return (model, optimizer).

        In order: attention (and its window); pure bf16 weights (before the optimizer exists, so its
        state is bf16 too); quantization of the linear layers and LoRA adapters; activation
        compression; the chunked loss (`loss_chunk_tokens`); the checkpointing policy on the model's
        repeated blocks; then the optimizer over the trainable parameters.
        With DeepSpeed fields (notebook 10) the model is a DeepSpeed engine and the optimizer its
        ZeRO optimizer; with `layer_offload_active` (notebook 09) the blocks stream from host memory
        and the optimizer steps their host copies (`offload.StreamingOptimizer`).
        """
        self.check_model(model)
        if self.loss_chunk_tokens == "auto":
            raise ValueError("recipe.loss_chunk_tokens='auto' is chosen for a target by the planner: build the recipe "
                             "of plan(model, batch, seq_len=..., recipe=..., target=...).recipe (it holds the chunk), or "
                             "give an integer")
        if self.uses_deepspeed:
            apply_chunked_loss(model, self.loss_chunk_tokens)
            apply_tiled_mlp(model, self.mlp_tile_tokens)
            apply_tiled_norm(model, self.norm_tile_tokens)
            return zero.initialize(model, self)
        if self.attention == REPEATED_KV_ATTENTION:  # grouped-query K/V repeated: SDPA's O(T) kernel on a T4
            repeat_kv_for_sdpa(model)
        elif self.attention is not None or self.attention_window is not None:
            for block in model.blocks:
                if self.attention is not None:
                    block.attn.attention = self.attention
                block.attn.window = self.attention_window
        prepare_model(model, self.precision)
        if self.weight_dtype == "int8" and not int8_weights(model):  # int8 weights, dequantized per layer (after
            quantize_model_int8(model)  # the 16-bit cast); a model from load_int8 holds them already
        if self.base_dtype is not None:  # the frozen base in fp16/bf16, before quantization and adapters
            device = next((t.device for t in model.parameters()), torch.device("cpu"))
            if device.type == "cuda":
                check_native_bf16(self.base_dtype, native_bf16=bf16_native(device), where=f"this GPU ({device})")
            half_frozen_base(model, self.base_dtype)
        if self.quantization is not None and self.quantization_phase == "all":
            quantize_model(model, self.quantization)
            if self.quantization in ("nf4", "fp4"):
                load_4bit_state(model)  # its state dict loads back into a model built the same way
        if self.lora_rank:
            add_lora(model, self.lora_rank, targets=self.lora_targets)
            if self.base_dtype is not None:
                adapters_to_fp32(model)
        if self.activation_compression is not None or self.compression_checkpointing:
            compress_activations(model, self.activation_compression, checkpoint_blocks=self.compression_checkpointing)
        apply_chunked_loss(model, self.loss_chunk_tokens)  # after LoRA: the head must still be a plain Linear
        apply_tiled_mlp(model, self.mlp_tile_tokens)  # after LoRA: the adapters sit inside the MLP
        apply_tiled_norm(model, self.norm_tile_tokens)
        apply_checkpointing(model, self.checkpointing, self.checkpoint_interval, keep_blocks=self.offload_keep_blocks)
        mode = self.rounding_mode
        if self.layer_offload_active:
            streamer = LayerStreamer(model, self.layer_offload_active, self.layer_offload_prefetch)

            def streamed_optimizer(ps: list[nn.Parameter]) -> torch.optim.Optimizer:  # pure 16-bit: rounded as below
                opt = make_optimizer(self.optimizer, ps, lr=self.lr)
                return opt if mode is None else UpdateRounding(opt, mode)

            return model, streamer.optimizer(streamed_optimizer)
        if self.weight_dtype == "int8":
            return model, make_int8_optimizer(self.optimizer, model, lr=self.lr)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = trainable if self.optimizer == "adam_mini" else [p for _, p in trainable]
        if mode is not None and self.optimizer.endswith("_in_backward"):  # one rounding wrapper per parameter
            inner = self.optimizer.removesuffix("_in_backward")
            return model, OptimizerInBackward(
                [p for _, p in trainable],
                lambda ps: UpdateRounding(make_optimizer(inner, ps, lr=self.lr, model=model, rank=self.optimizer_rank), mode))
        optimizer = make_optimizer(self.optimizer, params, lr=self.lr, model=None if self.lora_rank else model,
                                   rank=self.optimizer_rank)
        # (LOMO / AdaLomo: `rounding_mode` is None, they write their own fp32 update into the weights)
        return model, optimizer if mode is None else UpdateRounding(optimizer, mode)

    def forward_model(self, model: nn.Module) -> nn.Module:
        """Return the model for forward-only phases: a quantized copy under quantization_phase='forward_only'."""
        if self.quantization is not None and self.quantization_phase == "forward_only":
            return quantized_copy(model, self.quantization)
        return model
