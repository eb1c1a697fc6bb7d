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

from colab_memopt.checkpointing import POLICIES, apply_checkpointing
from colab_memopt.precision import FORWARD_PRECISIONS, check_precision, prepare_model
from colab_memopt.train import OPTIMIZERS, make_optimizer


@dataclass(frozen=True)
class Recipe:
    """Techniques applied to a training step. The defaults are plain fp32 training with AdamW.

    Attributes:
        optimizer: an optimizer name known to `train.make_optimizer`.
        lr: learning rate (> 0).
        attention: None keeps the model's attention; 'sdpa' or 'naive' sets it (reference model only).
        precision: 'fp32', 'fp16-autocast' (with GradScaler), 'bf16-autocast' or 'bf16' (pure bf16
            weights, gradients and optimizer state) for the steps that compute gradients.
        eval_precision: precision of forward-only phases (evaluation): 'fp32', 'fp16-autocast' or
            'bf16-autocast'; None follows `precision` (see `forward_precision`).
        checkpointing: 'none', 'full', 'every_n', 'segments' or 'selective' (see `checkpointing`).
        checkpoint_interval: N for 'every_n' (every N-th block) and 'segments' (N blocks per segment).
        accumulation_steps: micro-batches per optimizer step; the step's `batch_size` stays the
            effective batch.
        attention_window: sliding-window attention in tokens (reference model only); None: full causal.
    """

    optimizer: str = "adamw"
    lr: float = 1e-3
    attention: str | None = None
    # 02_mixed_precision
    precision: str = "fp32"
    eval_precision: str | None = None
    # 03_activation_checkpointing
    checkpointing: str = "none"
    checkpoint_interval: int = 1
    # 04_gradient_accumulation
    accumulation_steps: int = 1
    # 05_memory_efficient_attention
    attention_window: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is not allowed."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"recipe.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"recipe.lr must be > 0, got {self.lr}")
        if self.attention not in (None, "sdpa", "naive"):
            raise ValueError(f"recipe.attention must be None, 'sdpa' or 'naive', got {self.attention!r}")
        # 02-05: each technique module checks its own values; the messages name the recipe field.
        check_precision(self.precision, name="recipe.precision")
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def with_(self, **changes: Any) -> Recipe:
        """Return a copy with fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict."""
        return asdict(self)

    def build(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Apply the recipe's model-side techniques and return (model, optimizer).

        In order: attention (and its window), pure bf16 weights (before the optimizer exists, so its
        state is bf16 too), the checkpointing policy on the model's repeated blocks.
        """
        if self.attention is not None or self.attention_window is not None:
            if not hasattr(model, "blocks"):
                raise ValueError("recipe.attention and attention_window apply to the reference model only; leave them None")
            for block in model.blocks:
                if self.attention is not None:
                    block.attn.attention = self.attention
                block.attn.window = self.attention_window
        prepare_model(model, self.precision)
        apply_checkpointing(model, self.checkpointing, self.checkpoint_interval)
        return model, make_optimizer(self.optimizer, [p for p in model.parameters() if p.requires_grad], lr=self.lr)
